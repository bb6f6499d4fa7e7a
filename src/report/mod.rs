//! Reports over a finished (or still running) trace: read-only queries on a
//! trace database, turned into text, JSON, flame graphs, plots and profiles.
//!
//! This room never writes to the trace: it opens the database read-only, so
//! a report can run while memptrace is still recording (the database is in
//! WAL mode then, and a reader never blocks the writer).
//!
//! Every command starts from one [`scan::Analysis`]. A trace that has the
//! aggregate tables memptrace keeps while recording (docs/schema.md,
//! "Aggregates") gives it in a few small queries ([`aggregated`]); `plot`
//! and `window` on a full trace, and traces without them, take a single
//! pass over the events in the order they took effect, which pairs each
//! release with its allocation (through the `alloc_id` the tracer
//! recorded) and keeps running sums. It reads the compact `event_log` table under the `events` view
//! directly, because it is the same program that wrote it and the view's
//! per-row subqueries (thread, released pointer) cost more than the whole
//! analysis; [`open`] refuses a schema version it does not know. The stack
//! trie, frames and modules are small next to the events and are loaded
//! whole ([`stacks::StackTable`]).
//!
//! Definitions shared by every output (and by the `heap_over_time` and
//! `temporary` views, docs/schema.md):
//! - **heap in use** after an event: the sum of the sizes of the blocks
//!   allocated and not yet released; **peak**: its maximum over the events,
//!   and the first event that reached it;
//! - **leaked**: blocks no release named by the end of the trace (the `leaks`
//!   view);
//! - **temporary**: a block released by the very next allocator call of the
//!   thread that allocated it (heaptrack's definition);
//! - **calls** of a stack: calls to the allocating functions (all but `free`).

pub mod aggregated;
pub mod flame;
mod heapdraw;
pub mod heapmap;
pub mod listing;
pub mod parquet;
pub mod plot;
mod plotmodel;
pub mod pprof;
mod run;
pub mod scan;
pub mod stacks;
pub mod summary;
#[cfg(test)]
mod tests;
pub mod text;
pub mod window;

use std::io::Write;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags, OptionalExtension};

use crate::sink::{APPLICATION_ID, SCHEMA_VERSION};
pub use run::{
    run_export, run_flamegraph, run_heapmap, run_plot, run_report, run_window, show_heapmap,
};

/// How a report is printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// For people: aligned columns, units, colour on a terminal.
    Text,
    /// For scripts: exact numbers, every row.
    Json,
}

/// When text output is coloured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Color {
    /// When stdout is a terminal and `NO_COLOR` is not set.
    Auto,
    Always,
    Never,
}

/// What a flame graph or a folded-stacks file weighs each stack by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Bytes never released.
    Leaked,
    /// Bytes requested by every successful allocation.
    Allocated,
    /// Calls to the allocating functions.
    Calls,
    /// Bytes in use at the peak.
    Peak,
}

impl Metric {
    pub fn name(self) -> &'static str {
        match self {
            Metric::Leaked => "leaked",
            Metric::Allocated => "allocated",
            Metric::Calls => "calls",
            Metric::Peak => "peak",
        }
    }

    /// The unit of the metric's values.
    pub fn unit(self) -> &'static str {
        match self {
            Metric::Calls => "calls",
            _ => "bytes",
        }
    }

    /// What the metric counts, in words (titles, messages).
    pub fn describe(self) -> &'static str {
        match self {
            Metric::Leaked => "leaked bytes",
            Metric::Allocated => "allocated bytes",
            Metric::Calls => "allocator calls",
            Metric::Peak => "bytes in use at the peak",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportOptions {
    pub format: Format,
    pub color: Color,
    /// Stacks listed per ranking, and rows per table in text.
    pub top: usize,
    /// Frames printed per stack in text.
    pub frames: usize,
    /// The user's allocator wrappers, beside the trace's ([`crate::wrappers`]).
    pub wrappers: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlamegraphOptions {
    pub output: PathBuf,
    pub metric: Metric,
    /// The user's allocator wrappers, beside the trace's.
    pub wrappers: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlotOptions {
    /// `.svg` or `.png`.
    pub output: PathBuf,
    pub width: u32,
    pub height: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportOptions {
    /// A gzipped profile.proto for pprof.
    pub pprof: Option<PathBuf>,
    /// Folded stacks, one `outer;...;inner value` line per stack.
    pub collapsed: Option<PathBuf>,
    /// A directory for the Parquet files ([`parquet`]).
    pub parquet: Option<PathBuf>,
    /// What the folded stacks are weighed by.
    pub metric: Metric,
    /// The user's allocator wrappers, beside the trace's.
    pub wrappers: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowOptions {
    /// The window, in nanoseconds since the trace started, both ends included.
    pub from_ns: u64,
    pub to_ns: u64,
    pub report: ReportOptions,
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(
        "{}: no such file; give the database memptrace wrote (by default trace.db, or the file named with -o)",
        .0.display()
    )]
    NoTrace(PathBuf),
    #[error("{}: not a memptrace trace ({reason})", path.display())]
    NotATrace { path: PathBuf, reason: String },
    #[error(
        "{}: written with trace schema version {found}, this memptrace reads version {SCHEMA_VERSION}; use the memptrace that recorded it",
        path.display()
    )]
    Version { path: PathBuf, found: i64 },
    #[error("{}: reading the trace failed", path.display())]
    Query {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("cannot write {}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: would overwrite the trace being read; choose another output file", .0.display())]
    OutputIsTrace(PathBuf),
    #[error("{}: {what}", path.display())]
    Output { path: PathBuf, what: String },
    #[error("{}: a wrapper is not a regular expression", path.display())]
    Wrapper { path: PathBuf, source: regex::Error },
    #[error("nothing to draw: {0}")]
    Empty(String),
    #[error("{}: {what}", path.display())]
    NotInTrace { path: PathBuf, what: String },
    #[error("writing JSON failed: {0}")]
    Json(serde_json::Error),
}

/// A trace opened for reading.
pub struct Trace {
    pub conn: Connection,
    pub path: PathBuf,
}

impl Trace {
    /// Wrap a query error with the trace's path.
    pub fn err(&self, source: rusqlite::Error) -> ReportError {
        ReportError::Query {
            path: self.path.clone(),
            source,
        }
    }

    /// A `meta` value, if the trace has it.
    pub fn meta(&self, key: &str) -> Result<Option<String>, ReportError> {
        self.conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
            .map_err(|e| self.err(e))
    }
}

impl Trace {
    /// The warnings of the trace, in the order memptrace gave them: `meta`
    /// rows `warning.1`, `warning.2`, ... (and `warning`, one row, in traces
    /// of an earlier memptrace).
    pub fn warnings(&self) -> Result<Vec<String>, ReportError> {
        let mut all: Vec<String> = self.meta("warning")?.into_iter().collect();
        all.extend(self.numbered_meta("warning")?);
        Ok(all)
    }

    /// The values of `meta` rows `KIND.1`, `KIND.2`, ..., in that order.
    pub fn numbered_meta(&self, kind: &str) -> Result<Vec<String>, ReportError> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT value FROM meta WHERE key GLOB ?1 || '.[0-9]*'
                 ORDER BY CAST(substr(key, length(?1) + 2) AS INTEGER)",
            )
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map([kind], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.err(e))
    }
}

/// Open a trace read-only, checking that it is one this memptrace can read.
pub fn open(path: &Path) -> Result<Trace, ReportError> {
    if !path.exists() {
        return Err(ReportError::NoTrace(path.to_path_buf()));
    }
    let not_a_trace = |reason: String| ReportError::NotATrace {
        path: path.to_path_buf(),
        reason,
    };
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| not_a_trace(e.to_string()))?;
    // A reader may meet the writer's commit: wait for it rather than fail.
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(|e| not_a_trace(e.to_string()))?;
    let id: i64 = conn
        .pragma_query_value(None, "application_id", |r| r.get(0))
        .map_err(|e| not_a_trace(e.to_string()))?;
    if id != APPLICATION_ID {
        return Err(not_a_trace(format!(
            "its application_id is {id:#x}, a trace's is {APPLICATION_ID:#x}"
        )));
    }
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(|e| not_a_trace(e.to_string()))?;
    if version != SCHEMA_VERSION {
        return Err(ReportError::Version {
            path: path.to_path_buf(),
            found: version,
        });
    }
    Ok(Trace {
        conn,
        path: path.to_path_buf(),
    })
}

/// Refuse to write an output over the trace itself.
pub fn check_output(trace: &Path, output: &Path) -> Result<(), ReportError> {
    let same = match (trace.canonicalize(), output.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        return Err(ReportError::OutputIsTrace(output.to_path_buf()));
    }
    Ok(())
}

/// Write a whole file, naming it in the error.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    std::fs::write(path, bytes).map_err(|source| ReportError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Print to stdout; a closed pipe (`memptrace report | head`) is not an error.
pub fn print(text: &str) -> Result<(), ReportError> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(ReportError::Write {
            path: PathBuf::from("<stdout>"),
            source: e,
        }),
        _ => Ok(()),
    }
}
