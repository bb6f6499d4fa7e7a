//! The command line, parsed by clap into a plain [`Config`]. No system calls
//! here; `session` acts on the config.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, ValueEnum};

use crate::unwind::UnwinderKind;

#[derive(Debug, Parser)]
#[command(
    name = "memptrace",
    version,
    about = "Record every heap allocation call of a program, with its stack and thread, into SQLite",
    long_about = "Record every heap allocation call of a program, with its stack and thread, into SQLite.\n\n\
memptrace runs PROGRAM under ptrace, plants breakpoints on malloc, calloc, realloc, free and the \
rest of the allocator API in every ELF image (static binaries included), and writes each call to \
a SQLite database. Query it with sqlite3; see docs/queries.md.",
    after_help = "Example:\n  memptrace -o trace.db -- ./myprog --flag\n  sqlite3 trace.db \"SELECT op, count(*), sum(size) FROM events GROUP BY op\""
)]
pub struct Cli {
    #[command(flatten)]
    pub trace: TraceArgs,

    /// The program to run, and its arguments (after `--`).
    #[arg(last = true, value_name = "PROGRAM", required = true)]
    pub program: Vec<OsString>,
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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceConfig {
    pub output: PathBuf,
    pub force: bool,
    pub max_depth: usize,
    pub unwinder: UnwinderKind,
    pub stacks: bool,
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
        }
    }
}

impl Cli {
    pub fn into_config(self) -> Config {
        Config::Launch {
            trace: self.trace.into(),
            program: self.program,
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
        let Config::Launch { trace, program } = parse(&["memptrace", "--", "ls", "-l"]).unwrap();
        assert_eq!(program, vec![OsString::from("ls"), OsString::from("-l")]);
        assert_eq!(trace.output, PathBuf::from("trace.db"));
        assert!(!trace.force);
        assert_eq!(trace.max_depth, 128);
        assert_eq!(trace.unwinder, UnwinderKind::Framehop);
        assert!(trace.stacks);
    }

    #[test]
    fn launch_options() {
        let Config::Launch { trace, program } = parse(&[
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
        ])
        .unwrap();
        assert_eq!(trace.output, PathBuf::from("x.db"));
        assert!(trace.force);
        assert_eq!(trace.max_depth, 16);
        assert_eq!(trace.unwinder, UnwinderKind::Libunwind);
        assert!(!trace.stacks);
        assert_eq!(program[1], OsString::from("--its-own-flag"));
    }

    #[test]
    fn rejects_bad_input() {
        assert!(parse(&["memptrace"]).is_err(), "a program is required");
        assert!(parse(&["memptrace", "--max-depth", "0", "--", "ls"]).is_err());
        assert!(parse(&["memptrace", "--unwinder", "magic", "--", "ls"]).is_err());
    }
}
