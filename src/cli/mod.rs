//! The command line, parsed by clap into a plain [`Config`]. No system calls
//! here; `session` acts on the config.

use std::ffi::OsString;
use std::path::PathBuf;

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::report::heapmap::{HeapSource, HeapmapOptions};
use crate::report::{
    Color, ExportOptions, FlamegraphOptions, Format, Metric, PlotOptions, ReportOptions,
    WindowOptions,
};
use crate::tracer::ProbeMode;
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
    after_help = "Examples:\n  memptrace -o trace.db -- ./myprog --flag\n  memptrace attach 1234 --duration 30\n  memptrace -o web.db attach 1234\n  memptrace report trace.db\n  memptrace flamegraph trace.db -o leaks.svg --metric leaked\n  sqlite3 trace.db \"SELECT op, count(*), sum(size) FROM events GROUP BY op\"",
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
#[command(group = clap::ArgGroup::new("outputs").required(true).multiple(true))]
pub struct ExportArgs {
    #[command(flatten)]
    pub file: TraceFile,

    /// Write a gzipped pprof profile (alloc_objects, alloc_space,
    /// inuse_objects, inuse_space).
    #[arg(long, value_name = "PATH", group = "outputs")]
    pub pprof: Option<PathBuf>,

    /// Write folded stacks, one `outer;...;inner value` line per stack.
    #[arg(long, value_name = "PATH", group = "outputs")]
    pub collapsed: Option<PathBuf>,

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

/// Options of a trace. Each is optional here, so that options given before
/// `attach` and after it can be told apart and put together
/// ([`TraceArgs::merge`]); the defaults are applied in [`TraceConfig`].
#[derive(Debug, Clone, Default, Args)]
pub struct TraceArgs {
    /// Database to write [default: trace.db].
    #[arg(short, long, value_name = "PATH")]
    pub output: Option<PathBuf>,

    /// Replace the output file if it exists.
    #[arg(long)]
    pub force: bool,

    /// Frames recorded per stack, at most [default: 128].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_depth: Option<u32>,

    /// How stacks are unwound [default: framehop].
    #[arg(long, value_enum)]
    pub unwinder: Option<UnwinderArg>,

    /// Record every call but no stacks (fastest).
    #[arg(long)]
    pub no_stacks: bool,

    /// Unwind the stack of every Nth call from each call site only (the 1st,
    /// the N+1th, ...); every call is still recorded, the others with their
    /// caller as a one-frame stack [default: 1].
    #[arg(long, value_name = "N", conflicts_with = "no_stacks",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub stack_every: Option<u64>,
    /// Trace forked children too, into the same database (without it they
    /// are released unharmed).
    #[arg(short = 'f', long)]
    pub follow_forks: bool,

    /// How calls are caught: recorded inside the program with no stop
    /// (jump), or with a ptrace stop each (int3, the reference) [default:
    /// jump, or the environment's MEMPTRACE_PROBES].
    #[arg(long, value_enum)]
    pub probes: Option<ProbesArg>,

    /// Sample the resident and mapped memory of the traced processes every
    /// MS milliseconds into the rss table; 0 turns it off [default: 100].
    #[arg(long, value_name = "MS")]
    pub rss_interval: Option<u64>,

    #[command(flatten)]
    pub wrappers: WrapperArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProbesArg {
    /// A jump to code that records the call in the program (default).
    Jump,
    /// A breakpoint and a ptrace stop per call.
    Int3,
}

/// The user's allocator wrappers, for a trace and for the reports.
#[derive(Debug, Clone, Default, Args)]
pub struct WrapperArgs {
    /// A function that allocates on behalf of its caller (xmalloc,
    /// g_malloc, Perl_safesysmalloc...): a regular expression searched in
    /// demangled function names, such as '^xmalloc$'. Its callers are the
    /// call sites (view call_sites, report, flame graphs), as for operator
    /// new and the other built-in wrappers. Repeat it for more.
    #[arg(long = "wrapper", value_name = "REGEX", value_parser = crate::wrappers::check)]
    pub wrappers: Vec<String>,
}

impl TraceArgs {
    /// The options given before a subcommand and after it, as one; an
    /// option given on both sides is refused.
    pub fn merge(self, after: TraceArgs) -> Result<TraceArgs, String> {
        fn once<T>(name: &str, a: Option<T>, b: Option<T>) -> Result<Option<T>, String> {
            match (a, b) {
                (Some(_), Some(_)) => Err(format!("{name} is given twice")),
                (a, b) => Ok(a.or(b)),
            }
        }
        let merged = TraceArgs {
            output: once("--output", self.output, after.output)?,
            force: self.force || after.force,
            max_depth: once("--max-depth", self.max_depth, after.max_depth)?,
            unwinder: once("--unwinder", self.unwinder, after.unwinder)?,
            no_stacks: self.no_stacks || after.no_stacks,
            stack_every: once("--stack-every", self.stack_every, after.stack_every)?,
            follow_forks: self.follow_forks || after.follow_forks,
            probes: once("--probes", self.probes, after.probes)?,
            rss_interval: once("--rss-interval", self.rss_interval, after.rss_interval)?,
            wrappers: WrapperArgs {
                wrappers: [self.wrappers.wrappers, after.wrappers.wrappers].concat(),
            },
        };
        if merged.no_stacks && merged.stack_every.is_some() {
            return Err("--no-stacks and --stack-every cannot be used together".to_string());
        }
        Ok(merged)
    }

    /// The options given, by name (to refuse them where they do not apply).
    pub fn given(&self) -> Vec<&'static str> {
        let mut names = Vec::new();
        let flags = [
            (self.output.is_some(), "--output"),
            (self.force, "--force"),
            (self.max_depth.is_some(), "--max-depth"),
            (self.unwinder.is_some(), "--unwinder"),
            (self.no_stacks, "--no-stacks"),
            (self.stack_every.is_some(), "--stack-every"),
            (self.follow_forks, "--follow-forks"),
            (self.probes.is_some(), "--probes"),
            (self.rss_interval.is_some(), "--rss-interval"),
        ];
        for (given, name) in flags {
            if given {
                names.push(name);
            }
        }
        names
    }
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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceConfig {
    pub output: PathBuf,
    pub force: bool,
    pub max_depth: usize,
    pub unwinder: UnwinderKind,
    pub stacks: bool,
    /// Take a full stack for every Nth call of each call site (1: all).
    pub stack_every: u64,
    pub follow_forks: bool,
    pub probes: ProbeMode,
    /// The user's allocator wrappers (regular expressions).
    pub wrappers: Vec<String>,
    /// Milliseconds between samples of resident memory; 0: none.
    pub rss_interval_ms: u64,
}

impl TraceConfig {
    /// The options of a trace with their defaults; `env_probes` is
    /// `MEMPTRACE_PROBES`, used when `--probes` is not given (read once,
    /// here, rather than by clap on both sides of `attach`).
    fn new(a: TraceArgs, env_probes: Option<ProbesArg>) -> TraceConfig {
        TraceConfig {
            output: a.output.unwrap_or_else(|| PathBuf::from("trace.db")),
            force: a.force,
            max_depth: a.max_depth.unwrap_or(128) as usize,
            unwinder: match a.unwinder.unwrap_or(UnwinderArg::Framehop) {
                UnwinderArg::Framehop => UnwinderKind::Framehop,
                UnwinderArg::Libunwind => UnwinderKind::Libunwind,
            },
            stacks: !a.no_stacks,
            stack_every: a.stack_every.unwrap_or(1),
            follow_forks: a.follow_forks,
            probes: match a.probes.or(env_probes).unwrap_or(ProbesArg::Jump) {
                ProbesArg::Jump => ProbeMode::Jump,
                ProbesArg::Int3 => ProbeMode::Int3,
            },
            wrappers: a.wrappers.wrappers,
            rss_interval_ms: a.rss_interval.unwrap_or(100),
        }
    }
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
        }
    }
}

impl Cli {
    /// Parse the process's arguments; on a usage error print it as clap
    /// does and exit with status 2.
    pub fn config_from_args() -> Config {
        let env_probes = std::env::var("MEMPTRACE_PROBES").ok();
        Cli::parse()
            .into_config(env_probes.as_deref())
            .unwrap_or_else(|err| err.exit())
    }

    /// The plain config. Options of a trace may come before `attach` as well
    /// as after it; before another subcommand they are a usage error.
    /// `env_probes` is the value of `MEMPTRACE_PROBES`, if set.
    pub fn into_config(self, env_probes: Option<&str>) -> Result<Config, clap::Error> {
        let usage = |message: String| {
            <Cli as clap::CommandFactory>::command()
                .error(clap::error::ErrorKind::ArgumentConflict, message)
        };
        let env_probes = match env_probes {
            Some(value) => Some(ProbesArg::from_str(value, true).map_err(|_| {
                <Cli as clap::CommandFactory>::command().error(
                    clap::error::ErrorKind::InvalidValue,
                    format!("MEMPTRACE_PROBES={value:?}: give jump or int3"),
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
                return Err(usage(format!(
                    "{} before `{name}`: options of a trace go with `memptrace [OPTIONS] -- PROGRAM` or `memptrace attach PID [OPTIONS]`",
                    given.join(", ")
                )));
            }
        } else if self.duration.is_some() {
            return Err(usage(
                "--duration applies to `attach` (a launched program is traced until it exits)"
                    .to_string(),
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
                let trace = self.trace.merge(a.trace).map_err(usage)?;
                let duration = match (self.duration, a.duration) {
                    (Some(_), Some(_)) => return Err(usage("--duration is given twice".into())),
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
            Some(Command::Export(a)) => Config::Export {
                trace: a.file.trace,
                options: ExportOptions {
                    pprof: a.pprof,
                    collapsed: a.collapsed,
                    metric: a.metric.into(),
                    wrappers: with_before(a.wrappers.wrappers),
                },
            },
            Some(Command::Heapmap(a)) => a.into_config().map_err(usage)?,
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
#[cfg(test)]
mod tests;

pub use heapmap::HeapmapArgs;
