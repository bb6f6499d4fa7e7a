//! What happened to the heap during a window of time [t0, t1]: every block
//! live at some moment of it, in four classes, with the bytes per stack.
//!
//! | class | allocated | released |
//! |---|---|---|
//! | `allocated-inside/freed-inside` | t0 <= alloc <= t1 | t0 <= free <= t1 |
//! | `allocated-inside/outstanding` | t0 <= alloc <= t1 | after t1, or never |
//! | `allocated-before/freed-inside` | alloc < t0 | t0 <= free <= t1 |
//! | `allocated-before/outstanding` | alloc < t0 | after t1, or never |
//!
//! The heap in use at t0 is the two `allocated-before` classes; at t1 the
//! two `outstanding` ones; what the window added to the heap is
//! `allocated-inside/outstanding` minus `allocated-before/freed-inside`.
//! docs/reports.md has the same classification as one SQL query over the
//! `allocations` view.

use std::fmt::Write as _;

use serde::Serialize;

use super::listing::stack_lines;
use super::scan::{IdMap, for_each_event};
use super::stacks::{Location, StackTable};
use super::text::{Style, Table, bracketed, bytes, count, counted, seconds};
use super::{ReportError, Trace};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    InsideFreed,
    InsideOutstanding,
    BeforeFreed,
    BeforeOutstanding,
}

impl Class {
    pub const ALL: [Class; 4] = [
        Class::InsideFreed,
        Class::InsideOutstanding,
        Class::BeforeFreed,
        Class::BeforeOutstanding,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Class::InsideFreed => "allocated-inside/freed-inside",
            Class::InsideOutstanding => "allocated-inside/outstanding",
            Class::BeforeFreed => "allocated-before/freed-inside",
            Class::BeforeOutstanding => "allocated-before/outstanding",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Class::InsideFreed => "allocated and freed inside",
            Class::InsideOutstanding => "allocated inside, still live after",
            Class::BeforeFreed => "allocated before, freed inside",
            Class::BeforeOutstanding => "allocated before, still live after",
        }
    }

    /// The class of a block allocated at `alloc` and released at `free`
    /// (`None`: live after t1); `None` when it was not live in the window.
    pub fn of(alloc: i64, free: Option<i64>, t0: i64, t1: i64) -> Option<Class> {
        if alloc > t1 || free.is_some_and(|f| f < t0) {
            return None;
        }
        let inside = alloc >= t0;
        let freed = free.is_some_and(|f| f <= t1);
        Some(match (inside, freed) {
            (true, true) => Class::InsideFreed,
            (true, false) => Class::InsideOutstanding,
            (false, true) => Class::BeforeFreed,
            (false, false) => Class::BeforeOutstanding,
        })
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct WindowReport {
    pub path: String,
    pub from_ns: i64,
    pub to_ns: i64,
    pub in_use_at_start: u64,
    pub in_use_at_end: u64,
    pub classes: Vec<ClassRow>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ClassRow {
    pub class: &'static str,
    pub blocks: u64,
    pub bytes: u64,
    /// The stacks that allocated the class's blocks, most bytes first.
    pub stacks: Vec<WindowStack>,
}

#[derive(Clone, Debug, Serialize)]
pub struct WindowStack {
    /// The stacks, merged when they read the same (see [`StackTable::merge`]).
    pub stack_ids: Vec<i64>,
    pub blocks: u64,
    pub bytes: u64,
    pub module: String,
    pub frames: Vec<Location>,
}

#[derive(Clone, Copy)]
struct Block {
    ts_ns: i64,
    size: u64,
    stack: Option<i64>,
}

/// Where the trace ends, in nanoseconds since it started, and whether it
/// has ended: its `duration_ns`, or, while it is still being recorded, the
/// time of its last event.
pub fn trace_end(trace: &Trace) -> Result<(i64, bool), ReportError> {
    if let Some(ns) = trace.meta("duration_ns")?.and_then(|d| d.parse().ok()) {
        return Ok((ns, true));
    }
    let last: i64 = trace
        .conn
        .query_row(
            "SELECT coalesce(max(ts_ns), 0) FROM events
             WHERE id = (SELECT max(id) FROM event_log)",
            [],
            |r| r.get(0),
        )
        .map_err(|e| trace.err(e))?;
    Ok((last, false))
}

/// Classify the blocks of the window [from_ns, to_ns]: one pass over the
/// events up to `to_ns`.
pub fn analyse(
    trace: &Trace,
    table: &StackTable,
    from_ns: i64,
    to_ns: i64,
    top: usize,
) -> Result<WindowReport, ReportError> {
    let bar = crate::progress::bar(
        super::scan::last_event_id(trace)?.max(0) as u64,
        "reading events",
    );
    let mut live: IdMap<i64, Block> = IdMap::default();
    let mut totals: IdMap<(Class, Option<i64>), (u64, u64)> = IdMap::default();
    let mut add = |class: Class, block: &Block| {
        let t = totals.entry((class, block.stack)).or_default();
        t.0 += 1;
        t.1 += block.size;
    };
    // Events after t1 are not read: a block they would release is live
    // after t1, which is all the classification needs to know.
    for_each_event(trace, None, Some(to_ns), &bar, |e| {
        if let Some(block) = e.released.and_then(|id| live.remove(&id)) {
            if let Some(class) = Class::of(block.ts_ns, Some(e.ts_ns), from_ns, to_ns) {
                add(class, &block);
            }
        }
        if e.allocated {
            live.insert(
                e.id,
                Block {
                    ts_ns: e.ts_ns,
                    size: e.size.unwrap_or(0),
                    stack: e.stack,
                },
            );
        }
    })?;
    bar.finish_and_clear();
    for block in live.values() {
        if let Some(class) = Class::of(block.ts_ns, None, from_ns, to_ns) {
            add(class, block);
        }
    }

    let classes: Vec<ClassRow> = Class::ALL
        .iter()
        .map(|&class| {
            let mut stacks = table.merge(
                totals
                    .iter()
                    .filter(|((c, _), _)| *c == class)
                    .map(|((_, s), t)| (*s, *t)),
                |a: &mut (u64, u64), b| {
                    a.0 += b.0;
                    a.1 += b.1;
                },
            );
            stacks.sort_by(|a, b| b.value.1.cmp(&a.value.1).then(a.stacks.cmp(&b.stacks)));
            ClassRow {
                class: class.name(),
                blocks: stacks.iter().map(|s| s.value.0).sum(),
                bytes: stacks.iter().map(|s| s.value.1).sum(),
                stacks: stacks
                    .into_iter()
                    .take(top)
                    .map(|m| {
                        let first = m.stacks.first().copied().flatten();
                        WindowStack {
                            stack_ids: m.stacks.iter().flatten().copied().collect(),
                            blocks: m.value.0,
                            bytes: m.value.1,
                            module: table.owner_name(&table.owner(first)),
                            frames: table.locations(first),
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    let bytes_of = |c: Class| classes[c as usize].bytes;
    Ok(WindowReport {
        path: trace.path.display().to_string(),
        from_ns,
        to_ns,
        in_use_at_start: bytes_of(Class::BeforeFreed) + bytes_of(Class::BeforeOutstanding),
        in_use_at_end: bytes_of(Class::InsideOutstanding) + bytes_of(Class::BeforeOutstanding),
        classes,
    })
}

/// The window report as text.
pub fn render(w: &WindowReport, style: Style, frames: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} {}, from {} to {}",
        style.heading("memptrace window:"),
        w.path,
        seconds(w.from_ns),
        seconds(w.to_ns)
    );
    let _ = writeln!(
        out,
        "  in use at {:<10} {}",
        seconds(w.from_ns),
        bytes(w.in_use_at_start)
    );
    let _ = writeln!(
        out,
        "  in use at {:<10} {}",
        seconds(w.to_ns),
        bytes(w.in_use_at_end)
    );
    let (grew, change) = if w.in_use_at_end >= w.in_use_at_start {
        ('+', w.in_use_at_end - w.in_use_at_start)
    } else {
        ('-', w.in_use_at_start - w.in_use_at_end)
    };
    let _ = writeln!(
        out,
        "  change               {}",
        style.value(&format!("{grew}{}", bytes(change)))
    );
    let _ = writeln!(out, "\n{}", style.heading("Blocks live in the window"));
    let mut table = Table::new(&["class", "blocks", "bytes"]);
    for c in &w.classes {
        table.row(vec![c.class.to_string(), count(c.blocks), bytes(c.bytes)]);
    }
    table.render(style, &mut out);
    for (class, row) in Class::ALL.iter().zip(&w.classes) {
        let _ = writeln!(
            out,
            "\n{}",
            style.heading(&format!("Stacks: {} ({})", class.describe(), row.class))
        );
        if row.stacks.is_empty() {
            let _ = writeln!(out, "  {}", style.dim("none"));
        }
        for (i, s) in row.stacks.iter().enumerate() {
            let _ = writeln!(
                out,
                "  {:>2}. {} in {}  {}",
                i + 1,
                style.value(&bytes(s.bytes)),
                counted(s.blocks, "block"),
                style.module(&bracketed(&s.module))
            );
            stack_lines(style, &s.frames, frames, &mut out);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_by_time() {
        let (t0, t1) = (100, 200);
        assert_eq!(Class::of(50, Some(60), t0, t1), None, "freed before");
        assert_eq!(Class::of(250, None, t0, t1), None, "allocated after");
        assert_eq!(Class::of(100, Some(200), t0, t1), Some(Class::InsideFreed));
        assert_eq!(
            Class::of(150, Some(201), t0, t1),
            Some(Class::InsideOutstanding)
        );
        assert_eq!(Class::of(150, None, t0, t1), Some(Class::InsideOutstanding));
        assert_eq!(Class::of(99, Some(100), t0, t1), Some(Class::BeforeFreed));
        assert_eq!(Class::of(0, None, t0, t1), Some(Class::BeforeOutstanding));
        assert_eq!(
            Class::of(0, Some(300), t0, t1),
            Some(Class::BeforeOutstanding)
        );
    }
}
