//! The options of a trace (of a launched program or of `attach`): given
//! before `attach` or after it, put together by [`TraceArgs::merge`], and
//! made a plain [`TraceConfig`] with the defaults applied.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::tracer::ProbeMode;
use crate::unwind::UnwinderKind;
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

pub(super) fn parse_duration(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!("{text:?}: give a positive number of seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A size in bytes, with an optional K, M or G (KiB, MiB, GiB).
pub(super) fn parse_size(text: &str) -> Result<u64, String> {
    let (digits, unit) = match text.char_indices().last() {
        Some((i, 'K' | 'k')) => (&text[..i], 1 << 10),
        Some((i, 'M' | 'm')) => (&text[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&text[..i], 1 << 30),
        _ => (text, 1),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{text:?} is not a size in bytes (such as 500M)"))
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

    /// End the trace once the database reaches BYTES (K, M, G: KiB, MiB,
    /// GiB), as a full disk would: the program runs on untraced.
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    pub max_size: Option<u64>,

    /// Store no row per call, only what the reports need, exactly: totals
    /// per stack, thread and function, the blocks live at the end, the peak
    /// and the blocks live at it, and the heap over time per stack. The
    /// trace's size grows with the stacks, not with the calls.
    #[arg(long)]
    pub aggregate: bool,

    /// Length of a bucket of the heap over time per stack (agg_over_time),
    /// in milliseconds [default: 100].
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub resolution: Option<u64>,

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
            max_size: once("--max-size", self.max_size, after.max_size)?,
            aggregate: self.aggregate || after.aggregate,
            resolution: once("--resolution", self.resolution, after.resolution)?,
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
            (self.max_size.is_some(), "--max-size"),
            (self.aggregate, "--aggregate"),
            (self.resolution.is_some(), "--resolution"),
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
    /// `--max-size`: the database's largest size in bytes.
    pub max_size: Option<u64>,
    /// `--aggregate`: no row per call, only the aggregate tables.
    pub aggregate: bool,
    /// The length of a bucket of `agg_over_time`, in nanoseconds.
    pub resolution_ns: u64,
}

impl TraceConfig {
    /// The options of a trace with their defaults; `env_probes` is
    /// `MEMPTRACE_PROBES`, used when `--probes` is not given (read once,
    /// here, rather than by clap on both sides of `attach`).
    pub(super) fn new(a: TraceArgs, env_probes: Option<ProbesArg>) -> TraceConfig {
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
            max_size: a.max_size,
            aggregate: a.aggregate,
            resolution_ns: a.resolution.unwrap_or(100) * 1_000_000,
        }
    }
}
