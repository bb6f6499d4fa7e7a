//! The report's content as plain data: what `memptrace report` prints as
//! text and as JSON. Rankings break ties by stack id, and tables by name,
//! so the same trace always gives the same report.

use std::collections::HashMap;

use serde::Serialize;

use super::scan::{Analysis, StackStats, ThreadStats};
use super::stacks::{Location, Merged, StackTable};
use super::{ReportError, Trace};
use crate::event::Op;

#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub trace: TraceInfo,
    pub functions: Vec<FunctionRow>,
    pub heap: HeapTotals,
    pub top: Rankings,
    /// Every function that called the allocator (a call site's function),
    /// most bytes first.
    pub callers: Vec<CallerRow>,
    pub threads: Vec<ThreadRow>,
    pub modules: Vec<ModuleRow>,
}

/// Facts about the run, from `meta`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TraceInfo {
    pub path: String,
    pub command: Option<String>,
    pub mode: Option<String>,
    pub started_at: Option<String>,
    pub duration_ns: Option<u64>,
    pub end_reason: Option<String>,
    /// False while memptrace is still writing it, or when it was killed.
    pub finished: bool,
    pub events: u64,
    pub processes: u64,
    pub threads: u64,
    /// Recorded with `--aggregate`: the length of a bucket over time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aggregate_resolution_ns: Option<u64>,
    /// What memptrace warned about while tracing (`meta` rows `warning.N`).
    pub warnings: Vec<String>,
    /// Damage the program did to the memory it shares with memptrace
    /// (`meta` rows `damaged_records`, `damaged_slots`, `dropped_slots`).
    #[serde(skip_serializing_if = "is_zero")]
    pub damaged_records: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub damaged_slots: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub dropped_slots: u64,
    /// Allocator calls not recorded: made inside another allocator call of
    /// their thread, or by a signal handler that interrupted one (`meta`
    /// row `nested_calls`).
    #[serde(skip_serializing_if = "is_zero")]
    pub nested_calls: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl TraceInfo {
    pub fn read(trace: &Trace) -> Result<TraceInfo, ReportError> {
        let count = |sql: &str| -> Result<u64, ReportError> {
            trace
                .conn
                .query_row(sql, [], |r| r.get::<_, i64>(0))
                .map(|n| n.max(0) as u64)
                .map_err(|e| trace.err(e))
        };
        // A count in `meta` (0 when absent, or not a count).
        let number = |key: &str| -> Result<u64, ReportError> {
            Ok(trace.meta(key)?.and_then(|v| v.parse().ok()).unwrap_or(0))
        };
        Ok(TraceInfo {
            path: trace.path.display().to_string(),
            command: trace.meta("command")?,
            mode: trace.meta("mode")?,
            started_at: trace.meta("started_at")?,
            duration_ns: trace.meta("duration_ns")?.and_then(|d| d.parse().ok()),
            end_reason: trace.meta("end_reason")?,
            finished: count("SELECT count(*) FROM trace_finished")? > 0,
            events: 0,
            processes: count("SELECT count(DISTINCT pid) FROM event_threads")?,
            threads: count("SELECT count(*) FROM event_threads")?,
            aggregate_resolution_ns: match super::aggregated::TraceMode::of(trace)? {
                super::aggregated::TraceMode::Aggregate { resolution_ns } => Some(resolution_ns),
                super::aggregated::TraceMode::Full => None,
            },
            warnings: trace.warnings()?,
            damaged_records: number("damaged_records")?,
            damaged_slots: number("damaged_slots")?,
            dropped_slots: number("dropped_slots")?,
            nested_calls: number("nested_calls")?,
        })
    }
}

/// One allocator function.
#[derive(Clone, Debug, Serialize)]
pub struct FunctionRow {
    pub function: &'static str,
    pub calls: u64,
    /// Allocating calls that returned no block.
    pub failed: u64,
    /// Bytes requested by the calls that returned a block.
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct HeapTotals {
    pub calls: u64,
    /// Blocks allocated, and the bytes requested for them.
    pub blocks: u64,
    pub bytes: u64,
    /// Calls that released a traced block.
    pub releases: u64,
    pub peak_bytes: u64,
    pub peak_blocks: u64,
    /// When the peak was first reached: nanoseconds since the trace
    /// started, and the event.
    pub peak_ns: i64,
    pub peak_event: i64,
    /// The blocks live at the end of the trace (the `leaks` view's), and
    /// what they are.
    pub live_at_end: LiveAtEnd,
    pub leaked_blocks: u64,
    pub leaked_bytes: u64,
    /// Of those, the blocks live since the attach (`Op::Inventory`).
    pub inventory_live_blocks: u64,
    pub inventory_live_bytes: u64,
    /// Blocks live when their process exec'd: the exec released them (not
    /// in the figures above).
    pub exec_released_blocks: u64,
    pub exec_released_bytes: u64,
    /// Blocks released by the next allocator call of their thread.
    pub temporary: u64,
}

/// What the blocks no release named are, by how the trace ended: leaked
/// only when the program ended; when memptrace let it go (a detach, or its
/// own failure) it may free them yet, and a trace still recording has not
/// ended at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LiveAtEnd {
    /// The program exited or was killed: never freed while traced.
    Leaked,
    /// memptrace detached; the program runs on.
    AtDetach,
    /// Still recording (or memptrace was killed).
    Now,
}

impl LiveAtEnd {
    pub fn of(info: &TraceInfo) -> LiveAtEnd {
        let ended = |r: &String| r.starts_with("exited") || r.starts_with("killed by");
        if !info.finished {
            LiveAtEnd::Now
        } else if info.end_reason.as_ref().is_none_or(ended) {
            LiveAtEnd::Leaked
        } else {
            LiveAtEnd::AtDetach
        }
    }

    /// What the report calls them: `leaked`, `live at detach`, `live now`.
    pub fn label(self) -> &'static str {
        match self {
            LiveAtEnd::Leaked => "leaked",
            LiveAtEnd::AtDetach => "live at detach",
            LiveAtEnd::Now => "live now",
        }
    }
}

/// One stack and what was allocated from it.
#[derive(Clone, Debug, Serialize)]
pub struct StackRow {
    /// `stacks.id` of the leaf; several when stacks that read the same were
    /// merged; empty for the calls without a stack.
    pub stack_ids: Vec<i64>,
    #[serde(flatten)]
    pub totals: StackStats,
    /// The module the stack's allocations are charged to.
    pub module: String,
    /// Innermost first.
    pub frames: Vec<Location>,
}

/// The top stacks by each measure.
#[derive(Clone, Debug, Serialize)]
pub struct Rankings {
    pub leaked: Vec<StackRow>,
    pub peak: Vec<StackRow>,
    pub calls: Vec<StackRow>,
    pub temporary: Vec<StackRow>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ThreadRow {
    pub pid: i64,
    pub tid: i64,
    pub name: Option<String>,
    #[serde(flatten)]
    pub totals: ThreadStats,
}

/// What one function allocated through the allocator: the stacks whose
/// caller it is (their call site's function, see [`super::stacks`]) added
/// up. Functions of the same name in several modules are one row each.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CallerRow {
    /// The function, `module+0xoffset` when it has no name, or `[no stack]`.
    pub function: String,
    /// Its module's file name.
    pub module: Option<String>,
    #[serde(flatten)]
    pub totals: StackStats,
}

/// What the allocations charged to one module add up to (see
/// [`super::stacks`] for the rule).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ModuleRow {
    pub module: String,
    pub path: Option<String>,
    /// Its stacks' totals added up.
    #[serde(flatten)]
    pub totals: StackStats,
}

/// A (merged) stack's row, with its frames and owner.
pub fn stack_row(table: &StackTable, stacks: &[Option<i64>], s: &StackStats) -> StackRow {
    let stack = stacks.first().copied().flatten();
    StackRow {
        stack_ids: stacks.iter().flatten().copied().collect(),
        totals: *s,
        module: table.owner_name(&table.owner(stack)),
        frames: table.locations(stack),
    }
}

/// The `n` (merged) stacks with the largest `key`, ties by stack id;
/// zeros left out.
pub fn top_stacks(
    merged: &[Merged<StackStats>],
    table: &StackTable,
    n: usize,
    key: impl Fn(&StackStats) -> u64,
) -> Vec<StackRow> {
    let mut ranked: Vec<&Merged<StackStats>> =
        merged.iter().filter(|m| key(&m.value) > 0).collect();
    ranked.sort_by(|a, b| {
        key(&b.value)
            .cmp(&key(&a.value))
            .then(a.stacks.cmp(&b.stacks))
    });
    ranked
        .into_iter()
        .take(n)
        .map(|m| stack_row(table, &m.stacks, &m.value))
        .collect()
}

impl Summary {
    pub fn build(
        trace: &Trace,
        analysis: &Analysis,
        table: &StackTable,
        top: usize,
    ) -> Result<Summary, ReportError> {
        let mut info = TraceInfo::read(trace)?;
        info.events = analysis.events;
        let functions = Op::RECORDED
            .iter()
            .map(|&op| {
                let s = analysis.ops[op as usize];
                FunctionRow {
                    function: op.name(),
                    calls: s.calls,
                    failed: s.failed,
                    bytes: s.bytes,
                }
            })
            .filter(|f| f.calls > 0)
            .collect();
        let heap = HeapTotals {
            calls: analysis.events,
            blocks: analysis.blocks,
            bytes: analysis.bytes,
            releases: analysis.releases,
            peak_bytes: analysis.peak.bytes,
            peak_blocks: analysis.peak.blocks,
            peak_ns: analysis.peak.ts_ns,
            peak_event: analysis.peak.event,
            live_at_end: LiveAtEnd::of(&info),
            leaked_blocks: analysis.leaked_blocks,
            leaked_bytes: analysis.leaked_bytes,
            inventory_live_blocks: analysis.inventory_live_blocks,
            inventory_live_bytes: analysis.inventory_live_bytes,
            exec_released_blocks: analysis.exec_released_blocks,
            exec_released_bytes: analysis.exec_released_bytes,
            temporary: analysis.temporary,
        };
        let merged = table.merge(
            analysis.stacks.iter().map(|(k, v)| (*k, *v)),
            StackStats::add,
        );
        let rankings = Rankings {
            leaked: top_stacks(&merged, table, top, |s| s.leaked_bytes),
            peak: top_stacks(&merged, table, top, |s| s.peak_bytes),
            calls: top_stacks(&merged, table, top, |s| s.calls),
            temporary: top_stacks(&merged, table, top, |s| s.temporary),
        };
        Ok(Summary {
            trace: info,
            functions,
            heap,
            top: rankings,
            callers: callers(analysis, table),
            threads: threads(trace, analysis)?,
            modules: modules(analysis, table),
        })
    }
}

fn threads(trace: &Trace, analysis: &Analysis) -> Result<Vec<ThreadRow>, ReportError> {
    let err = |e| trace.err(e);
    let mut stmt = trace
        .conn
        .prepare(
            "SELECT c.code, c.pid, c.tid, t.name FROM event_threads c
             LEFT JOIN threads t ON t.tid = c.tid",
        )
        .map_err(err)?;
    let mut rows = stmt.query([]).map_err(err)?;
    let mut out = Vec::new();
    while let Some(r) = rows.next().map_err(err)? {
        let code: i64 = r.get(0).map_err(err)?;
        let s = analysis
            .threads
            .get(&(code as u32))
            .copied()
            .unwrap_or_default();
        out.push(ThreadRow {
            pid: r.get(1).map_err(err)?,
            tid: r.get(2).map_err(err)?,
            name: r.get(3).map_err(err)?,
            totals: s,
        });
    }
    out.sort_by(|a, b| {
        (b.totals.bytes, b.totals.calls)
            .cmp(&(a.totals.bytes, a.totals.calls))
            .then((a.pid, a.tid).cmp(&(b.pid, b.tid)))
    });
    Ok(out)
}

fn callers(analysis: &Analysis, table: &StackTable) -> Vec<CallerRow> {
    let mut by_name: HashMap<(String, Option<String>), CallerRow> = HashMap::new();
    for (stack, s) in &analysis.stacks {
        let (function, module) = match table.caller(*stack) {
            Some(l) => (l.function, l.module),
            None => ("[no stack]".to_string(), None),
        };
        by_name
            .entry((function.clone(), module.clone()))
            .or_insert_with(|| CallerRow {
                function,
                module,
                ..CallerRow::default()
            })
            .totals
            .add(*s);
    }
    largest_first(
        by_name.into_values(),
        |c| &c.totals,
        |c| (c.function.clone(), c.module.clone()),
    )
}

/// The rows that allocated, most bytes first, then most calls, then by
/// `key`: the same trace always gives the same order.
fn largest_first<T, K: Ord>(
    rows: impl Iterator<Item = T>,
    totals: impl Fn(&T) -> &StackStats,
    key: impl Fn(&T) -> K,
) -> Vec<T> {
    let mut rows: Vec<T> = rows.filter(|r| totals(r).calls > 0).collect();
    rows.sort_by(|a, b| {
        let (ta, tb) = (totals(a), totals(b));
        (tb.bytes, tb.calls)
            .cmp(&(ta.bytes, ta.calls))
            .then(key(a).cmp(&key(b)))
    });
    rows
}

fn modules(analysis: &Analysis, table: &StackTable) -> Vec<ModuleRow> {
    let mut by_name: HashMap<String, ModuleRow> = HashMap::new();
    for (stack, s) in &analysis.stacks {
        let owner = table.owner(*stack);
        let name = table.owner_name(&owner);
        let row = by_name.entry(name.clone()).or_insert_with(|| ModuleRow {
            module: name,
            path: table.owner_path(&owner),
            ..ModuleRow::default()
        });
        row.totals.add(*s);
    }
    largest_first(by_name.into_values(), |m| &m.totals, |m| m.module.clone())
}
