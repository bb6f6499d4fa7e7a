//! The report as text for a terminal: units people read (KiB, seconds),
//! thousands separators, aligned tables, and colour only on a terminal.

use std::fmt::Write as _;
use std::io::IsTerminal;

use super::Color;
use super::listing::stack_lines;
use super::scan::StackStats;
use super::summary::{LiveAtEnd, StackRow, Summary};
use crate::event::Op;

/// ANSI styles, or none.
#[derive(Clone, Copy, Debug)]
pub struct Style {
    pub color: bool,
}

impl Style {
    /// Colour when asked, or on a terminal unless `NO_COLOR` is set
    /// (no-color.org).
    pub fn new(choice: Color) -> Style {
        let color = match choice {
            Color::Always => true,
            Color::Never => false,
            Color::Auto => {
                std::io::stdout().is_terminal()
                    && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
            }
        };
        Style { color }
    }

    fn paint(&self, code: &str, text: &str) -> String {
        if self.color && !text.is_empty() {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }

    pub fn heading(&self, text: &str) -> String {
        self.paint("1", text)
    }

    /// The number a ranking is by.
    pub fn value(&self, text: &str) -> String {
        self.paint("1;33", text)
    }

    /// Something memptrace warned about.
    pub fn warning(&self, text: &str) -> String {
        self.paint("1;31", text)
    }

    pub fn dim(&self, text: &str) -> String {
        self.paint("2", text)
    }

    pub fn module(&self, text: &str) -> String {
        self.paint("36", text)
    }
}

/// `1,234,567`.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `1 block`, `1,000 blocks`.
pub fn counted(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{} {noun}s", count(n))
    }
}

/// `512 B`, `1.5 KiB`, `21.3 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Nanoseconds since the trace started, as `1.234 s`.
pub fn seconds(ns: i64) -> String {
    format!("{:.3} s", ns as f64 / 1e9)
}

/// `12.5 %`, or an empty string for a zero whole.
pub fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        return String::new();
    }
    format!("{:.1} %", part as f64 * 100.0 / whole as f64)
}

/// A table with a header: the first column left-aligned, the others right.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self, style: Style, out: &mut String) {
        let columns = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(columns) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let line = |cells: &[String]| -> String {
            let mut text = String::from(" ");
            for (i, cell) in cells.iter().enumerate().take(columns) {
                let pad = widths[i] - cell.chars().count();
                if i == 0 {
                    text.push(' ');
                    text.push_str(cell);
                    text.push_str(&" ".repeat(pad));
                } else {
                    text.push_str("  ");
                    text.push_str(&" ".repeat(pad));
                    text.push_str(cell);
                }
            }
            text.trim_end().to_string()
        };
        let _ = writeln!(out, "{}", style.dim(&line(&self.header)));
        for row in &self.rows {
            let _ = writeln!(out, "{}", line(row));
        }
    }
}

/// `text` cut to `max` characters, `...` marking the cut (long C++ names in
/// a table; the JSON has them whole).
pub fn shortened(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(max.saturating_sub(3)).collect();
    cut.push_str("...");
    cut
}

/// A module name in brackets; `[unknown]` and `[no stack]` already are.
pub fn bracketed(module: &str) -> String {
    if module.starts_with('[') {
        module.to_string()
    } else {
        format!("[{module}]")
    }
}

fn ranking(
    style: Style,
    title: &str,
    rows: &[StackRow],
    frames: usize,
    label: impl Fn(&StackRow) -> String,
    out: &mut String,
) {
    let _ = writeln!(out, "\n{}", style.heading(title));
    if rows.is_empty() {
        let _ = writeln!(out, "  {}", style.dim("none"));
        return;
    }
    for (i, row) in rows.iter().enumerate() {
        let _ = writeln!(
            out,
            "  {:>2}. {}  {}",
            i + 1,
            label(row),
            style.module(&bracketed(&row.module))
        );
        stack_lines(style, &row.frames, frames, out);
    }
}

/// A table of totals under a heading, one row per name: calls, bytes
/// allocated, at the peak and live at the end (`live`: leaked, at detach,
/// now), temporary blocks; the first `top` rows, and how many more there
/// are. `names` is the first column's title and the rows' plural.
fn totals_table(
    style: Style,
    (heading, live): (&str, LiveAtEnd),
    names: (&str, &str),
    rows: impl ExactSizeIterator<Item = (String, [u64; 5])>,
    top: usize,
    out: &mut String,
) {
    let _ = writeln!(out, "\n{}", style.heading(heading));
    let total = rows.len();
    let mut table = Table::new(&[
        names.0,
        "calls",
        "allocated",
        "at peak",
        match live {
            LiveAtEnd::Leaked => "leaked",
            LiveAtEnd::AtDetach => "at detach",
            LiveAtEnd::Now => "live now",
        },
        "temporary",
    ]);
    for (name, [calls, allocated, peak, leaked, temporary]) in rows.take(top) {
        table.row(vec![
            name,
            count(calls),
            bytes(allocated),
            bytes(peak),
            bytes(leaked),
            count(temporary),
        ]);
    }
    table.render(style, out);
    more(style, total, top, names.1, out);
}

/// The columns of [`totals_table`] for the totals of some stacks.
fn columns(t: &StackStats) -> [u64; 5] {
    [t.calls, t.bytes, t.peak_bytes, t.leaked_bytes, t.temporary]
}

/// `Top 5 stacks`, `Top stack`.
fn top_stacks(top: usize) -> String {
    if top == 1 {
        "Top stack".to_string()
    } else {
        format!("Top {top} stacks")
    }
}

/// "... and 3 more" under a table cut at `shown` rows.
fn more(style: Style, total: usize, shown: usize, what: &str, out: &mut String) {
    if total > shown {
        let _ = writeln!(
            out,
            "  {}",
            style.dim(&format!("... and {} more {what}", total - shown))
        );
    }
}

/// The blocks no release named: leaked only when the program ended (see
/// [`LiveAtEnd`]); those live since the attach (the inventory) apart.
fn live_at_end(summary: &Summary, style: Style, out: &mut String) {
    let h = &summary.heap;
    let note = match h.live_at_end {
        LiveAtEnd::Leaked => "never freed while traced",
        LiveAtEnd::AtDetach => "the program runs on: not leaks",
        LiveAtEnd::Now => "the trace has not ended: not leaks",
    };
    let label = h.live_at_end.label();
    let (blocks, bytes_) = (h.leaked_blocks, h.leaked_bytes);
    let (inventory, inventory_bytes) = (h.inventory_live_blocks, h.inventory_live_bytes);
    let amount = |b: u64, n: u64| format!("{} in {}", style.value(&bytes(b)), counted(n, "block"));
    if inventory == 0 {
        let _ = writeln!(out, "  {label:<10} {}, {note}", amount(bytes_, blocks));
        return;
    }
    let note = match h.live_at_end {
        LiveAtEnd::Leaked => "never freed",
        _ => note,
    };
    let _ = writeln!(
        out,
        "  {label:<10} {} allocated while traced, {note}",
        amount(
            bytes_.saturating_sub(inventory_bytes),
            blocks.saturating_sub(inventory)
        )
    );
    let _ = writeln!(
        out,
        "  {:<10} {} live since the attach (the inventory)",
        "",
        amount(inventory_bytes, inventory)
    );
}

/// The whole report.
pub fn render(summary: &Summary, style: Style, frames: usize, top: usize) -> String {
    let mut out = String::new();
    let t = &summary.trace;
    let _ = writeln!(out, "{} {}", style.heading("memptrace report:"), t.path);
    if let Some(command) = &t.command {
        let _ = writeln!(out, "  program    {command}");
    }
    let mut traced = Vec::new();
    if let Some(start) = &t.started_at {
        traced.push(start.clone());
    }
    if let Some(d) = t.duration_ns {
        traced.push(format!("for {}", seconds(d as i64)));
    }
    if let Some(reason) = &t.end_reason {
        traced.push(reason.clone());
    }
    if !t.finished {
        traced.push("not finished (still recording, or memptrace was killed)".to_string());
    }
    if !traced.is_empty() {
        let _ = writeln!(out, "  traced     {}", traced.join(", "));
    }
    if let Some(ns) = t.aggregate_resolution_ns {
        let _ = writeln!(
            out,
            "  aggregate  recorded with --aggregate: totals, leaks and peak exact, heap over time \
             by {}; no row per call (the events views are empty)",
            seconds(ns as i64)
        );
    }
    for warning in &t.warnings {
        let _ = writeln!(out, "  {}    {warning}", style.warning("warning"));
    }
    if [t.damaged_records, t.damaged_slots, t.dropped_slots]
        .iter()
        .any(|&n| n > 0)
    {
        let _ = writeln!(
            out,
            "  {}    {} records refused, {} slot words implausible, {} slots no longer read \
             (the program wrote over the memory it shares with memptrace)",
            style.warning("damaged"),
            count(t.damaged_records),
            count(t.damaged_slots),
            count(t.dropped_slots),
        );
    }
    if t.nested_calls > 0 {
        let _ = writeln!(
            out,
            "  nested     {} allocator calls made inside another of their thread, or by a \
             signal handler that interrupted one, not recorded",
            count(t.nested_calls),
        );
    }
    // Blocks found live at attach are events, but no call was seen.
    let inventory = summary
        .functions
        .iter()
        .find(|f| f.function == Op::Inventory.name())
        .map_or(0, |f| f.calls);
    let _ = writeln!(
        out,
        "  events     {} allocator calls from {} thread{} in {} process{}",
        count(t.events - inventory.min(t.events)),
        count(t.threads),
        if t.threads == 1 { "" } else { "s" },
        count(t.processes),
        if t.processes == 1 { "" } else { "es" }
    );
    if inventory > 0 {
        let _ = writeln!(
            out,
            "             and {} blocks live at attach (the inventory: no stack, origin unknown)",
            count(inventory)
        );
    }

    let h = &summary.heap;
    let _ = writeln!(out, "\n{}", style.heading("Heap"));
    let _ = writeln!(
        out,
        "  allocated  {} in {}",
        bytes(h.bytes),
        counted(h.blocks, "block")
    );
    // The time, not the event's id: ids have gaps.
    let _ = writeln!(
        out,
        "  peak       {} in {}, at {}",
        style.value(&bytes(h.peak_bytes)),
        counted(h.peak_blocks, "block"),
        seconds(h.peak_ns),
    );
    live_at_end(summary, style, &mut out);
    if h.exec_released_blocks > 0 {
        let _ = writeln!(
            out,
            "  exec'd     {} in {}, released by an exec (their program image was replaced)",
            bytes(h.exec_released_bytes),
            counted(h.exec_released_blocks, "block")
        );
    }
    let _ = writeln!(
        out,
        "  temporary  {} ({} of blocks), freed by their thread's next allocator call",
        counted(h.temporary, "block"),
        percent(h.temporary, h.blocks)
    );

    let _ = writeln!(out, "\n{}", style.heading("Calls per function"));
    let mut table = Table::new(&["function", "calls", "failed", "bytes requested"]);
    for f in &summary.functions {
        let allocates = f.function != "free";
        table.row(vec![
            f.function.to_string(),
            count(f.calls),
            if allocates {
                count(f.failed)
            } else {
                String::new()
            },
            if allocates {
                bytes(f.bytes)
            } else {
                String::new()
            },
        ]);
    }
    table.row(vec![
        "total".to_string(),
        count(summary.functions.iter().map(|f| f.calls).sum()),
        count(summary.functions.iter().map(|f| f.failed).sum()),
        bytes(h.bytes),
    ]);
    table.render(style, &mut out);

    totals_table(
        style,
        (
            "Callers (the first frame outside the allocator and its wrappers)",
            h.live_at_end,
        ),
        ("function", "callers"),
        summary
            .callers
            .iter()
            .map(|c| (shortened(&c.function, 60), columns(&c.totals))),
        top,
        &mut out,
    );

    let r = &summary.top;
    ranking(
        style,
        &match h.live_at_end {
            LiveAtEnd::Leaked => format!("{} by leaked bytes", top_stacks(top)),
            live => format!("{} by bytes {}", top_stacks(top), live.label()),
        },
        &r.leaked,
        frames,
        |s| {
            format!(
                "{} in {}",
                style.value(&bytes(s.totals.leaked_bytes)),
                counted(s.totals.leaked_blocks, "block")
            )
        },
        &mut out,
    );
    ranking(
        style,
        &format!("{} by bytes in use at the peak", top_stacks(top)),
        &r.peak,
        frames,
        |s| {
            format!(
                "{} in {}",
                style.value(&bytes(s.totals.peak_bytes)),
                counted(s.totals.peak_blocks, "block")
            )
        },
        &mut out,
    );
    ranking(
        style,
        &format!("{} by allocation calls", top_stacks(top)),
        &r.calls,
        frames,
        |s| {
            format!(
                "{}, {}",
                style.value(&counted(s.totals.calls, "call")),
                bytes(s.totals.bytes)
            )
        },
        &mut out,
    );
    ranking(
        style,
        &format!("{} by temporary blocks", top_stacks(top)),
        &r.temporary,
        frames,
        |s| {
            format!(
                "{} temporary of {}",
                style.value(&count(s.totals.temporary)),
                counted(s.totals.blocks, "block")
            )
        },
        &mut out,
    );

    totals_table(
        style,
        ("Threads", h.live_at_end),
        ("thread", "threads"),
        summary.threads.iter().map(|th| {
            let t = &th.totals;
            let name = th.name.as_deref().unwrap_or("");
            let totals = [t.calls, t.bytes, t.peak_bytes, t.leaked_bytes, t.temporary];
            (format!("{} {name}", th.tid), totals)
        }),
        top,
        &mut out,
    );
    totals_table(
        style,
        (
            "Modules (each allocation charged to its first frame outside the allocator)",
            h.live_at_end,
        ),
        ("module", "modules"),
        summary
            .modules
            .iter()
            .map(|m| (m.module.clone(), columns(&m.totals))),
        top,
        &mut out,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_for_people() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(1_234_567), "1,234,567");
        assert_eq!(counted(1, "block"), "1 block");
        assert_eq!(counted(1000, "block"), "1,000 blocks");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.0 KiB");
        assert_eq!(bytes(3 << 20), "3.0 MiB");
        assert_eq!(seconds(1_234_567_890), "1.235 s");
        assert_eq!(percent(1, 8), "12.5 %");
        assert_eq!(percent(1, 0), "");
        assert_eq!(shortened("main", 10), "main");
        assert_eq!(shortened("a_long_function_name", 10), "a_long_...");
    }

    #[test]
    fn tables_align() {
        let mut t = Table::new(&["name", "n"]);
        t.row(vec!["a".into(), "1,000".into()]);
        t.row(vec!["longer".into(), "2".into()]);
        let mut out = String::new();
        t.render(Style { color: false }, &mut out);
        assert_eq!(out, "  name        n\n  a       1,000\n  longer      2\n");
    }

    #[test]
    fn colour_only_when_asked() {
        let on = Style { color: true };
        assert_eq!(on.heading("x"), "\x1b[1mx\x1b[0m");
        assert_eq!(Style { color: false }.heading("x"), "x");
    }
}
