//! The command line, parsed by clap into a plain [`Config`]. No system calls
//! here; `session` acts on the config.

use std::ffi::OsString;
use std::path::PathBuf;

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::unwind::UnwinderKind;

#[derive(Debug, Parser)]
#[command(
    name = "memptrace",
    version,
    about = "Record every heap allocation call of a program, with its stack and thread, into SQLite",
    long_about = "Record every heap allocation call of a program, with its stack and thread, into SQLite.\n\n\
memptrace runs PROGRAM under ptrace (or attaches to a running process), plants breakpoints on \
malloc, calloc, realloc, free and the rest of the allocator API in every ELF image (static \
binaries included), and writes each call to a SQLite database. Query it with sqlite3; see \
docs/queries.md.",
    after_help = "Examples:\n  memptrace -o trace.db -- ./myprog --flag\n  memptrace attach 1234 --duration 30\n  sqlite3 trace.db \"SELECT op, count(*), sum(size) FROM events GROUP BY op\"",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub trace: TraceArgs,

    /// The program to run, and its arguments (after `--`).
    #[arg(last = true, value_name = "PROGRAM", required = true)]
    pub program: Vec<OsString>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Trace a running process until Ctrl-C, --duration or its exit; then
    /// detach and leave it running.
    Attach(AttachArgs),
}

#[derive(Debug, Clone, Args)]
pub struct AttachArgs {
    /// The process to trace.
    #[arg(value_name = "PID")]
    pub pid: i32,

    /// Stop tracing after this many seconds.
    #[arg(long, value_name = "SECONDS", value_parser = parse_duration)]
    pub duration: Option<Duration>,

    #[command(flatten)]
    pub trace: TraceArgs,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!("{text:?}: give a positive number of seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    /// Database to write.
    #[arg(short, long, value_name = "PATH", default_value = "trace.db")]
    pub output: PathBuf,

    /// Replace the output file if it exists.
    #[arg(long)]
    pub force: bool,

    /// Frames recorded per stack, at most.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_depth: u32,

    /// How stacks are unwound.
    #[arg(long, value_enum, default_value_t = UnwinderArg::Framehop)]
    pub unwinder: UnwinderArg,

    /// Record every call but no stacks (fastest).
    #[arg(long)]
    pub no_stacks: bool,

    /// Trace forked children too, into the same database (without it they
    /// are released unharmed).
    #[arg(short = 'f', long)]
    pub follow_forks: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum UnwinderArg {
    /// DWARF CFI and frame pointers over a copy of the stack (default, fast).
    Framehop,
    /// libunwind-ptrace, reading the stopped thread's memory.
    Libunwind,
}

/// What to do, as plain data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Config {
    Launch {
        trace: TraceConfig,
        program: Vec<OsString>,
    },
    Attach {
        trace: TraceConfig,
        pid: i32,
        duration: Option<Duration>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceConfig {
    pub output: PathBuf,
    pub force: bool,
    pub max_depth: usize,
    pub unwinder: UnwinderKind,
    pub stacks: bool,
    pub follow_forks: bool,
}

impl From<TraceArgs> for TraceConfig {
    fn from(a: TraceArgs) -> TraceConfig {
        TraceConfig {
            output: a.output,
            force: a.force,
            max_depth: a.max_depth as usize,
            unwinder: match a.unwinder {
                UnwinderArg::Framehop => UnwinderKind::Framehop,
                UnwinderArg::Libunwind => UnwinderKind::Libunwind,
            },
            stacks: !a.no_stacks,
            follow_forks: a.follow_forks,
        }
    }
}

impl Cli {
    pub fn into_config(self) -> Config {
        match self.command {
            None => Config::Launch {
                trace: self.trace.into(),
                program: self.program,
            },
            Some(Command::Attach(a)) => Config::Attach {
                trace: a.trace.into(),
                pid: a.pid,
                duration: a.duration,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Cli::try_parse_from(args).map(Cli::into_config)
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn launch_defaults() {
        let Ok(Config::Launch { trace, program }) = parse(&["memptrace", "--", "ls", "-l"]) else {
            panic!("not a launch");
        };
        assert_eq!(program, vec![OsString::from("ls"), OsString::from("-l")]);
        assert_eq!(trace.output, PathBuf::from("trace.db"));
        assert!(!trace.force);
        assert_eq!(trace.max_depth, 128);
        assert_eq!(trace.unwinder, UnwinderKind::Framehop);
        assert!(trace.stacks);
    }

    #[test]
    fn launch_options() {
        let Ok(Config::Launch { trace, program }) = parse(&[
            "memptrace",
            "-o",
            "x.db",
            "--force",
            "--max-depth",
            "16",
            "--unwinder",
            "libunwind",
            "--no-stacks",
            "--",
            "./prog",
            "--its-own-flag",
        ]) else {
            panic!("not a launch");
        };
        assert_eq!(trace.output, PathBuf::from("x.db"));
        assert!(trace.force);
        assert_eq!(trace.max_depth, 16);
        assert_eq!(trace.unwinder, UnwinderKind::Libunwind);
        assert!(!trace.stacks);
        assert_eq!(program[1], OsString::from("--its-own-flag"));
    }

    #[test]
    fn attach_options() {
        let config = parse(&[
            "memptrace",
            "attach",
            "1234",
            "--duration",
            "2.5",
            "-o",
            "a.db",
        ]);
        let Ok(Config::Attach {
            trace,
            pid,
            duration,
        }) = config
        else {
            panic!("not an attach: {config:?}");
        };
        assert_eq!(pid, 1234);
        assert_eq!(duration, Some(Duration::from_millis(2500)));
        assert_eq!(trace.output, PathBuf::from("a.db"));
        // A program called `attach` is still a program after `--`.
        assert!(matches!(
            parse(&["memptrace", "--", "attach", "1"]),
            Ok(Config::Launch { .. })
        ));
        assert!(
            parse(&["memptrace", "attach"]).is_err(),
            "a pid is required"
        );
        assert!(parse(&["memptrace", "attach", "1", "--duration", "-1"]).is_err());
        assert!(parse(&["memptrace", "attach", "1", "--", "ls"]).is_err());
    }

    #[test]
    fn rejects_bad_input() {
        assert!(parse(&["memptrace"]).is_err(), "a program is required");
        assert!(parse(&["memptrace", "--max-depth", "0", "--", "ls"]).is_err());
        assert!(parse(&["memptrace", "--unwinder", "magic", "--", "ls"]).is_err());
    }
}
