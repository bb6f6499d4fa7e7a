//! The command line, parsed by clap into a plain [`Config`]. No system calls
//! here; `session` acts on the config. A command line that cannot be acted
//! on is a usage error ([`usage`]): exit status 2, the error, the usage and
//! one hint.

use std::ffi::OsString;
use std::path::PathBuf;

use std::time::Duration;

use clap::error::ErrorKind;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::report::heapmap::{HeapSource, HeapmapOptions};
use crate::report::{
    Color, ExportOptions, FlamegraphOptions, Format, Metric, PlotOptions, ReportOptions,
    WindowOptions,
};

#[derive(Debug, Parser)]
#[command(
    name = "memptrace",
    version,
    about = "Record every heap allocation call of a program, with its stack and thread, into SQLite",
    long_about = "Record every heap allocation call of a program, with its stack and thread, into SQLite.\n\n\
memptrace runs PROGRAM under ptrace (or attaches to a running process) and hooks malloc, \
calloc, realloc, free and the rest of the allocator API in every ELF image (static binaries \
included): by default with a jump to code it writes into the program, which records each call \
there without stopping it (--probes int3: a breakpoint and a ptrace stop per call). Each call \
goes to a SQLite database: read it with `memptrace report`, or query it with sqlite3 (see \
docs/queries.md).",
    after_help = "Examples:\n  memptrace -o trace.db -- ./myprog --flag\n  memptrace attach 1234 --duration 30\n  memptrace -o web.db attach 1234\n  memptrace report trace.db\n  memptrace flamegraph trace.db -o leaks.svg --metric leaked\n  memptrace completions bash > ~/.local/share/bash-completion/completions/memptrace\n  sqlite3 trace.db \"SELECT op, count(*), sum(size) FROM events GROUP BY op\"",
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Options of a trace: of the launched PROGRAM, or of `attach`, given
    /// before it (`memptrace -o x.db attach PID`) or after it.
    #[command(flatten)]
    pub trace: TraceArgs,

    /// (attach) Stop tracing after this many seconds.
    #[arg(long, value_name = "SECONDS", value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// The program to run, and its arguments (after `--`).
    #[arg(last = true, value_name = "PROGRAM", required = true)]
    pub program: Vec<OsString>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Trace a running process until Ctrl-C, --duration or its exit; then
    /// detach and leave it running.
    Attach(AttachArgs),
    /// Summarise a trace: calls per function, peak heap, leaks, the top
    /// stacks by leaked bytes, peak, calls and temporary blocks, and totals
    /// per thread and per module.
    Report(ReportArgs),
    /// Draw a flame graph of the stacks (SVG), weighed by a metric.
    Flamegraph(FlamegraphArgs),
    /// Plot the heap in use over time, with its peak, and the sizes
    /// requested (SVG or PNG, by the file's extension).
    Plot(PlotArgs),
    /// Write a pprof heap profile and/or folded stacks.
    Export(ExportArgs),
    /// Classify the blocks live during a window of time, with the bytes
    /// per stack: allocated inside or before it, freed inside it or not.
    Window(WindowArgs),
    /// Map glibc's heap per arena (in use, free, top, largest free chunk,
    /// fragmentation, cached, resident), of a running process (read without
    /// stopping it) or as stored in a trace; -o draws its pages.
    Heapmap(HeapmapArgs),
    /// Print the shell completion script of memptrace (bash, zsh, fish,
    /// elvish, powershell).
    Completions(CompletionsArgs),
    /// Print the man page of memptrace, or of one of its commands (roff:
    /// `memptrace man | man -l -`).
    Man(ManArgs),
}

/// The trace a report reads.
#[derive(Debug, Clone, Args)]
pub struct TraceFile {
    /// The trace database to read.
    #[arg(value_name = "TRACE", default_value = "trace.db")]
    pub trace: PathBuf,
}

/// How a report is shown.
#[derive(Debug, Clone, Args)]
pub struct ViewArgs {
    /// Text for people, or JSON for scripts.
    #[arg(long, value_enum, default_value_t = FormatArg::Text)]
    pub format: FormatArg,

    /// Stacks listed per ranking, and rows per table.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub top: u32,

    /// Frames shown per stack (text).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub frames: u32,

    /// When to colour the text.
    #[arg(long, value_enum, default_value_t = ColorArg::Auto)]
    pub color: ColorArg,

    #[command(flatten)]
    pub wrappers: WrapperArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    #[command(flatten)]
    pub file: TraceFile,

    #[command(flatten)]
    pub view: ViewArgs,
}

#[derive(Debug, Clone, Args)]
pub struct FlamegraphArgs {
    #[command(flatten)]
    pub file: TraceFile,

    /// The SVG file to write.
    #[arg(short, long, value_name = "PATH", default_value = "flamegraph.svg")]
    pub output: PathBuf,

    /// What each stack is weighed by.
    #[arg(long, value_enum, default_value_t = MetricArg::Allocated)]
    pub metric: MetricArg,

    #[command(flatten)]
    pub wrappers: WrapperArgs,
}

#[derive(Debug, Clone, Args)]
pub struct PlotArgs {
    #[command(flatten)]
    pub file: TraceFile,

    /// The picture to write: .svg or .png.
    #[arg(short, long, value_name = "PATH", default_value = "heap.svg")]
    pub output: PathBuf,

    /// Width and height in pixels.
    #[arg(long, value_name = "WxH", default_value = "1200x900", value_parser = parse_size)]
    pub size: (u32, u32),
}

#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    #[command(flatten)]
    pub file: TraceFile,

    /// Write a gzipped pprof profile (alloc_objects, alloc_space,
    /// inuse_objects, inuse_space).
    #[arg(long, value_name = "PATH")]
    pub pprof: Option<PathBuf>,

    /// Write folded stacks, one `outer;...;inner value` line per stack.
    #[arg(long, value_name = "PATH")]
    pub collapsed: Option<PathBuf>,

    /// Write the trace as Parquet files into DIR (created if missing):
    /// events, stacks, frames and meta, each row with the trace's id, to
    /// query many traces together (DuckDB, Spark).
    #[arg(long, value_name = "DIR")]
    pub parquet: Option<PathBuf>,

    /// What the folded stacks are weighed by.
    #[arg(long, value_enum, default_value_t = MetricArg::Allocated)]
    pub metric: MetricArg,

    #[command(flatten)]
    pub wrappers: WrapperArgs,
}

#[derive(Debug, Clone, Args)]
pub struct WindowArgs {
    #[command(flatten)]
    pub file: TraceFile,

    /// Start of the window, since the trace started: seconds, or a number
    /// with a unit (250ms, 1.5s, 300us, 42ns).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub from: u64,

    /// End of the window (included), in the same units.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub to: u64,

    #[command(flatten)]
    pub view: ViewArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ColorArg {
    /// On a terminal, unless NO_COLOR is set.
    Auto,
    Always,
    Never,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MetricArg {
    /// Bytes never freed while traced.
    Leaked,
    /// Bytes requested by every allocation.
    Allocated,
    /// Calls to the allocating functions.
    Calls,
    /// Bytes in use at the heap's peak.
    Peak,
}

/// `1.5`, `1.5s`, `250ms`, `300us`, `42ns`: nanoseconds.
fn parse_time(text: &str) -> Result<u64, String> {
    let (number, scale) = if let Some(n) = text.strip_suffix("ns") {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix("us").or_else(|| text.strip_suffix("µs")) {
        (n, 1e3)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1e6)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1e9)
    } else {
        (text, 1e9)
    };
    let value: f64 = number.trim().parse().map_err(|_| {
        format!("{text:?} is not a time; give seconds (1.5) or a unit: 1.5s, 250ms, 300us, 42ns")
    })?;
    if !(value.is_finite() && value >= 0.0) {
        return Err(format!("{text:?}: give a time of 0 or more"));
    }
    Ok((value * scale).round() as u64)
}

/// `1200x900`.
fn parse_size(text: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{text:?}: give the size as WIDTHxHEIGHT in pixels, e.g. 1200x900");
    let (w, h) = text.split_once(['x', 'X']).ok_or_else(bad)?;
    let (w, h): (u32, u32) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
    if !(200..=20_000).contains(&w) || !(200..=20_000).contains(&h) {
        return Err(format!(
            "{text:?}: width and height go from 200 to 20000 pixels"
        ));
    }
    Ok((w, h))
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
    Report {
        trace: PathBuf,
        options: ReportOptions,
    },
    Flamegraph {
        trace: PathBuf,
        options: FlamegraphOptions,
    },
    Plot {
        trace: PathBuf,
        options: PlotOptions,
    },
    Export {
        trace: PathBuf,
        options: ExportOptions,
    },
    Window {
        trace: PathBuf,
        options: WindowOptions,
    },
    Heapmap {
        source: HeapSource,
        options: HeapmapOptions,
    },
    /// Print a shell's completion script.
    Completions { shell: clap_complete::Shell },
    /// Print a man page: memptrace's, or a command's.
    Manual { command: Option<String> },
}

impl From<ViewArgs> for ReportOptions {
    fn from(v: ViewArgs) -> ReportOptions {
        ReportOptions {
            format: match v.format {
                FormatArg::Text => Format::Text,
                FormatArg::Json => Format::Json,
            },
            color: match v.color {
                ColorArg::Auto => Color::Auto,
                ColorArg::Always => Color::Always,
                ColorArg::Never => Color::Never,
            },
            top: v.top as usize,
            frames: v.frames as usize,
            wrappers: v.wrappers.wrappers,
        }
    }
}

impl From<MetricArg> for Metric {
    fn from(m: MetricArg) -> Metric {
        match m {
            MetricArg::Leaked => Metric::Leaked,
            MetricArg::Allocated => Metric::Allocated,
            MetricArg::Calls => Metric::Calls,
            MetricArg::Peak => Metric::Peak,
        }
    }
}

impl Command {
    fn name(&self) -> &'static str {
        match self {
            Command::Attach(_) => "attach",
            Command::Report(_) => "report",
            Command::Flamegraph(_) => "flamegraph",
            Command::Plot(_) => "plot",
            Command::Export(_) => "export",
            Command::Window(_) => "window",
            Command::Heapmap(_) => "heapmap",
            Command::Completions(_) => "completions",
            Command::Man(_) => "man",
        }
    }
}

impl Cli {
    /// Parse the process's arguments; on a usage error print it (the
    /// error, the usage, one hint) and exit with status 2.
    pub fn config_from_args() -> Config {
        let env_probes = std::env::var("MEMPTRACE_PROBES").ok();
        let args: Vec<OsString> = std::env::args_os().collect();
        Cli::try_parse_from(&args)
            .map_err(|err| usage::with_hint(err, &args))
            .and_then(|cli| cli.into_config(env_probes.as_deref()))
            .unwrap_or_else(|err| usage::exit(err))
    }

    /// The plain config. Options of a trace may come before `attach` as well
    /// as after it; before another subcommand they are a usage error.
    /// `env_probes` is the value of `MEMPTRACE_PROBES`, if set.
    pub fn into_config(self, env_probes: Option<&str>) -> Result<Config, clap::Error> {
        let conflict = |command: Option<&str>, message: String| {
            usage::error(command, ErrorKind::ArgumentConflict, message, None)
        };
        let env_probes = match env_probes {
            Some(value) => Some(ProbesArg::from_str(value, true).map_err(|_| {
                usage::error(
                    None,
                    ErrorKind::InvalidValue,
                    format!("MEMPTRACE_PROBES={value:?}: give jump or int3"),
                    None,
                )
            })?),
            None => None,
        };
        if let Some(command) = &self.command {
            let name = command.name();
            let mut given = self.trace.given();
            if self.duration.is_some() && name != "attach" {
                given.push("--duration");
            }
            if name == "plot" && !self.trace.wrappers.wrappers.is_empty() {
                given.push("--wrapper");
            }
            if name != "attach" && !given.is_empty() {
                return Err(usage::error(
                    Some(name),
                    ErrorKind::ArgumentConflict,
                    format!(
                        "{} before `{name}`: options of a trace go with `memptrace [OPTIONS] -- PROGRAM` or `memptrace attach PID [OPTIONS]`",
                        given.join(", ")
                    ),
                    Some(format!(
                        "the options of `{name}` go after it: memptrace {name} --help lists them"
                    )),
                ));
            }
        } else if let Some(duration) = self.duration {
            return Err(usage::error(
                None,
                ErrorKind::ArgumentConflict,
                "--duration applies to `attach` (a launched program is traced until it exits)",
                Some(format!(
                    "to trace a running process for {} s: memptrace attach PID --duration {}",
                    duration.as_secs_f64(),
                    duration.as_secs_f64()
                )),
            ));
        }
        // --wrapper before a report command is the report's.
        let before = self.trace.wrappers.wrappers.clone();
        let with_before = |after: Vec<String>| [before.clone(), after].concat();
        Ok(match self.command {
            None => Config::Launch {
                trace: TraceConfig::new(self.trace, env_probes),
                program: self.program,
            },
            Some(Command::Attach(a)) => {
                let trace = self
                    .trace
                    .merge(a.trace)
                    .map_err(|m| conflict(Some("attach"), m))?;
                let duration = match (self.duration, a.duration) {
                    (Some(_), Some(_)) => {
                        return Err(conflict(Some("attach"), "--duration is given twice".into()));
                    }
                    (before, after) => before.or(after),
                };
                Config::Attach {
                    trace: TraceConfig::new(trace, env_probes),
                    pid: a.pid,
                    duration,
                }
            }
            Some(Command::Report(mut a)) => Config::Report {
                trace: a.file.trace,
                options: {
                    a.view.wrappers.wrappers = with_before(a.view.wrappers.wrappers);
                    a.view.into()
                },
            },
            Some(Command::Flamegraph(a)) => Config::Flamegraph {
                trace: a.file.trace,
                options: FlamegraphOptions {
                    output: a.output,
                    metric: a.metric.into(),
                    wrappers: with_before(a.wrappers.wrappers),
                },
            },
            Some(Command::Plot(a)) => Config::Plot {
                trace: a.file.trace,
                options: PlotOptions {
                    output: a.output,
                    width: a.size.0,
                    height: a.size.1,
                },
            },
            Some(Command::Export(a))
                if a.pprof.is_none() && a.collapsed.is_none() && a.parquet.is_none() =>
            {
                return Err(usage::error(
                    Some("export"),
                    ErrorKind::MissingRequiredArgument,
                    "nothing to export: give --pprof PATH, --collapsed PATH, --parquet DIR, or several",
                    Some(format!(
                        "memptrace export {} --pprof heap.pb.gz",
                        usage::quoted(a.file.trace.as_os_str())
                    )),
                ));
            }
            Some(Command::Export(a)) => Config::Export {
                trace: a.file.trace,
                options: ExportOptions {
                    pprof: a.pprof,
                    collapsed: a.collapsed,
                    parquet: a.parquet,
                    metric: a.metric.into(),
                    wrappers: with_before(a.wrappers.wrappers),
                },
            },
            Some(Command::Heapmap(a)) => {
                a.into_config().map_err(|m| conflict(Some("heapmap"), m))?
            }
            Some(Command::Completions(a)) => Config::Completions { shell: a.shell },
            Some(Command::Man(a)) => Config::Manual { command: a.command },
            Some(Command::Window(mut a)) => Config::Window {
                trace: a.file.trace,
                options: WindowOptions {
                    from_ns: a.from,
                    to_ns: a.to,
                    report: {
                        a.view.wrappers.wrappers = with_before(a.view.wrappers.wrappers);
                        a.view.into()
                    },
                },
            },
        })
    }
}

mod heapmap;
pub mod manual;
#[cfg(test)]
mod tests;
mod trace;
pub mod usage;

pub use heapmap::HeapmapArgs;
pub use manual::{CompletionsArgs, ManArgs};
use trace::parse_duration;
pub use trace::{AttachArgs, ProbesArg, TraceArgs, TraceConfig, UnwinderArg, WrapperArgs};
