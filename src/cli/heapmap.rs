//! `memptrace heapmap PID|TRACE`: its arguments, and the plain config they
//! become.

use std::path::PathBuf;

use clap::Args;

use super::{Config, FormatArg};
use crate::report::Format;
use crate::report::heapmap::{HeapSource, HeapmapOptions};

#[derive(Debug, Clone, Args)]
pub struct HeapmapArgs {
    /// A process id (read live), or a trace database (its stored snapshots).
    #[arg(value_name = "PID|TRACE", default_value = "trace.db")]
    pub target: String,

    /// Draw the arenas' pages into this picture (.png or .svg).
    #[arg(short, long, value_name = "PATH")]
    pub output: Option<PathBuf>,

    /// Text for people, or JSON for scripts.
    #[arg(long, value_enum, default_value_t = FormatArg::Text)]
    pub format: FormatArg,

    /// (a trace) The snapshot to show (`heap_snapshots.id`); the last by
    /// default.
    #[arg(long, value_name = "ID")]
    pub snapshot: Option<i64>,
}

impl HeapmapArgs {
    /// A number is a process; anything else a trace.
    pub(super) fn into_config(self) -> Result<Config, String> {
        let source = match self.target.parse::<i32>() {
            Ok(pid) if self.snapshot.is_none() => HeapSource::Pid(pid),
            Ok(_) => return Err("--snapshot reads a trace, not a process".into()),
            Err(_) => HeapSource::Trace {
                path: PathBuf::from(&self.target),
                snapshot: self.snapshot,
            },
        };
        Ok(Config::Heapmap {
            source,
            options: HeapmapOptions {
                format: match self.format {
                    FormatArg::Text => Format::Text,
                    FormatArg::Json => Format::Json,
                },
                output: self.output,
            },
        })
    }
}
