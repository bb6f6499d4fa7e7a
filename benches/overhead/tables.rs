//! The rows of the tables about tracing (the loops, whole programs,
//! fairness, a full ring) and how they print.

use std::fmt::Write;

use crate::median;
use crate::runs::{Load, Outcome, Tool};

/// One tracer (or way of tracing) on both loops.
#[derive(Clone, Debug, Default)]
pub struct Row {
    pub label: String,
    /// The tool stops the program at each call: its cost per stop counts.
    pub stops: bool,
    pub st_loop_s: Option<f64>,
    pub st_wall_s: Option<f64>,
    pub st_per_call_us: Option<f64>,
    pub st_per_stop_us: Option<f64>,
    pub st_slowdown: Option<f64>,
    pub mt_loop_s: Option<f64>,
    pub mt_per_call_us: Option<f64>,
    pub mt_slowdown: Option<f64>,
    pub mt_wall_s: Option<f64>,
    pub mt_wall_slowdown: Option<f64>,
    /// memptrace: events in the database.
    pub st_events: Option<u64>,
    pub mt_events: Option<u64>,
    pub bytes_per_event: Option<f64>,
    pub mt_bytes_per_event: Option<f64>,
    pub note: String,
}

fn median_of(outcomes: &[Outcome], f: impl Fn(&Outcome) -> f64) -> f64 {
    median(outcomes.iter().map(f).collect())
}

/// Microseconds per unit of what the tool added to the untraced loop.
fn per(traced_s: f64, plain_s: f64, units: u64) -> f64 {
    (traced_s - plain_s) / units as f64 * 1e6
}

impl Row {
    pub fn new(tool: &Tool) -> Row {
        Row {
            label: tool.label().into(),
            stops: tool.stops(),
            ..Row::default()
        }
    }

    pub fn fill_single(&mut self, runs: &[Outcome], plain_s: f64, load: Load) {
        let traced = median_of(runs, Outcome::loop_s);
        self.st_loop_s = Some(traced);
        self.st_wall_s = Some(median_of(runs, |o| o.wall_s));
        self.st_per_call_us = Some(per(traced, plain_s, load.calls()));
        self.st_per_stop_us = self.stops.then(|| per(traced, plain_s, load.stops()));
        self.st_slowdown = Some(traced / plain_s);
    }

    pub fn fill_multi(&mut self, runs: &[Outcome], plain_s: f64, plain_wall_s: f64, load: Load) {
        let traced = median_of(runs, Outcome::loop_s);
        let wall = median_of(runs, |o| o.wall_s);
        self.mt_loop_s = Some(traced);
        self.mt_per_call_us = Some(per(traced, plain_s, load.calls()));
        self.mt_slowdown = Some(traced / plain_s);
        self.mt_wall_s = Some(wall);
        self.mt_wall_slowdown = Some(wall / plain_wall_s);
    }
}

/// A program that outruns memptrace: its loop, and whether every call
/// made it into the trace.
#[derive(Clone, Debug)]
pub struct RingRow {
    pub label: String,
    pub calls: u64,
    pub loop_s: f64,
    /// Voluntary context switches in the loop.
    pub sleeps: u64,
}

impl RingRow {
    /// `outcome` is a run whose trace was checked to hold all `calls`.
    pub fn new(label: &str, outcome: Option<&Outcome>, calls: u64) -> RingRow {
        let own = outcome.and_then(|o| o.own.clone()).unwrap_or_default();
        RingRow {
            label: label.into(),
            calls,
            loop_s: own.loop_s,
            sleeps: own.sleeps,
        }
    }
}

/// A command's wall time, or why there is none.
#[derive(Clone, Debug)]
pub enum Wall {
    Seconds(f64),
    Missing(String),
}

/// One whole program (or loop) untraced, under heaptrack and under
/// memptrace in both modes.
#[derive(Clone, Debug)]
pub struct ProgramRow {
    pub label: String,
    pub untraced_s: f64,
    pub heaptrack: Wall,
    pub jump: Wall,
    pub int3: Wall,
    /// Events in memptrace's traces: jump, int3 (checked equal when both ran).
    pub jump_events: Option<u64>,
    pub int3_events: Option<u64>,
}

/// Per-thread progress of a fixed-time loop.
#[derive(Clone, Debug)]
pub struct FairRow {
    pub label: String,
    pub iterations: Vec<u64>,
    /// memptrace: calls found in the trace (all the threads made).
    pub recorded: Option<u64>,
}

pub fn opt(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(|| "–".into(), |v| format!("{v:.digits$}"))
}

pub fn ratio(value: Option<f64>) -> String {
    match value {
        Some(v) if v >= 100.0 => format!("{v:.0}x"),
        Some(v) if v >= 10.0 => format!("{v:.1}x"),
        Some(v) => format!("{v:.2}x"),
        None => "–".into(),
    }
}

/// `1234567` as `1 234 567`.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// The single-threaded loop's table. `bare` and `blocking`: µs per bare
/// stop with memptrace's wait and with a blocking one.
pub fn single(out: &mut String, rows: &[Row], plain_s: f64, bare: f64, blocking: f64) {
    let _ = writeln!(
        out,
        "\n## Single-threaded loop: cost per call\n\n\
         Untraced loop: {plain_s:.4} s. Per call = (traced loop - untraced loop) / calls; \
         per stop, for the tools that stop the program at each call, \
         = (traced loop - untraced loop) / stops (3 per malloc + free).\n"
    );
    let _ = writeln!(
        out,
        "| tracer | loop (s) | µs per call | µs per stop | x bare stop (memptrace's wait) | x bare stop (blocking) | loop slowdown | DB bytes/event | stacks |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for row in rows {
        let per_stop = row.st_per_stop_us;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.label,
            opt(row.st_loop_s, 3),
            opt(row.st_per_call_us, 3),
            opt(per_stop, 2),
            ratio(per_stop.map(|p| p / bare)),
            ratio(per_stop.map(|p| p / blocking)),
            ratio(row.st_slowdown),
            opt(row.bytes_per_event, 1),
            row.note
        );
    }
}

/// The multithreaded loop's table.
pub fn multi(out: &mut String, rows: &[Row], plain_s: f64, plain_wall_s: f64, load: Load) {
    let _ = writeln!(
        out,
        "\n## {} loop: whole program\n\n\
         Untraced: loop {plain_s:.4} s, whole command {plain_wall_s:.4} s. \
         Per call = (traced loop - untraced loop) / calls, as above \
         ({} calls); \"x single-threaded\" divides it by the same tracer's \
         cost per call on the single-threaded loop.\n",
        crate::loops::loop_name(load),
        grouped(load.calls())
    );
    let _ = writeln!(
        out,
        "| tracer | loop (s) | µs per call | x single-threaded | loop slowdown | whole command (s) | whole-command slowdown | DB bytes/event |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows.iter().filter(|r| r.mt_loop_s.is_some()) {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            row.label,
            opt(row.mt_loop_s, 3),
            opt(row.mt_per_call_us, 3),
            ratio(
                row.mt_per_call_us
                    .zip(row.st_per_call_us)
                    .map(|(m, s)| m / s)
            ),
            ratio(row.mt_slowdown),
            opt(row.mt_wall_s, 3),
            ratio(row.mt_wall_slowdown),
            opt(row.mt_bytes_per_event, 1)
        );
    }
}

fn wall_cell(wall: &Wall, untraced_s: f64) -> String {
    match wall {
        Wall::Seconds(s) => format!("{s:.3} s, {}", ratio(Some(s / untraced_s))),
        Wall::Missing(why) => why.clone(),
    }
}

/// Whole programs, side by side.
pub fn programs(out: &mut String, rows: &[ProgramRow], rounds: usize) {
    let _ = writeln!(
        out,
        "\n## Whole programs, side by side\n\n\
         Wall time of the whole command (memptrace: until its database is \
         closed), median of {rounds} round(s), and its ratio to the untraced \
         command. memptrace records full stacks. Events: the allocator calls \
         in memptrace's trace of the same input, with jump probes and with \
         int3 probes (the benchmark fails if they differ). µs per call: \
         (traced wall time - untraced wall time) / events. Where a stop per \
         call would take minutes, int3 probes get a smaller input, on the \
         next row.\n"
    );
    let _ = writeln!(
        out,
        "| program | events (jump / int3) | untraced | heaptrack | memptrace --probes jump | memptrace --probes int3 | µs per call (jump / int3) | jump / heaptrack |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        let events = |e: Option<u64>| e.map_or_else(|| "–".into(), grouped);
        let per_call = |wall: &Wall, events: Option<u64>| match (wall, events) {
            (Wall::Seconds(s), Some(n)) if n > 0 => {
                format!("{:.3}", per(*s, row.untraced_s, n))
            }
            _ => "–".into(),
        };
        let versus = match (&row.jump, &row.heaptrack) {
            (Wall::Seconds(j), Wall::Seconds(h)) => ratio(Some(j / h)),
            _ => "–".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {} / {} | {:.3} s | {} | {} | {} | {} / {} | {versus} |",
            row.label,
            events(row.jump_events),
            events(row.int3_events),
            row.untraced_s,
            wall_cell(&row.heaptrack, row.untraced_s),
            wall_cell(&row.jump, row.untraced_s),
            wall_cell(&row.int3, row.untraced_s),
            per_call(&row.jump, row.jump_events),
            per_call(&row.int3, row.int3_events),
        );
    }
}

/// Per-thread progress.
pub fn fairness(out: &mut String, rows: &[FairRow], load: Load) {
    let Load::Fair { threads, ms } = load else {
        return;
    };
    let _ = writeln!(
        out,
        "\n## Fairness: {threads} threads allocating flat out for {ms} ms\n\n\
         Each thread does malloc + free through 8 frames until the time is up \
         and counts its iterations; max/min is the fastest thread's count over \
         the slowest's (1.00x: all kept the same pace). Every call the threads \
         counted was found in memptrace's traces, with its whole stack.\n"
    );
    let _ = writeln!(
        out,
        "| run | iterations per thread | max/min | calls in the trace |"
    );
    let _ = writeln!(out, "|---|---|---:|---|");
    for row in rows {
        let max = row.iterations.iter().max().copied().unwrap_or(0);
        let min = row.iterations.iter().min().copied().unwrap_or(0);
        let counts: Vec<String> = row.iterations.iter().map(|&n| grouped(n)).collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            row.label,
            counts.join(" / "),
            ratio((min > 0).then(|| max as f64 / min as f64)),
            row.recorded
                .map_or_else(|| "–".into(), |n| format!("{}, all", grouped(n)))
        );
    }
}

/// Programs that outrun memptrace's jump probes.
pub fn ring(out: &mut String, rows: &[RingRow]) {
    let _ = writeln!(
        out,
        "\n## A full ring: programs that outrun memptrace\n\n\
         Loops that call the allocator faster than memptrace records them \
         (jump probes, full stacks): a thread whose ring is full waits for \
         room; it never drops a call. Sleeps: the voluntary context switches \
         of the loop (getrusage), which in a loop that never blocks are its \
         waits for room (with threads, also the main thread's wait for them \
         to end). µs per call: the loop's time / its calls. Every call of \
         the loop was found in the trace.\n"
    );
    let _ = writeln!(
        out,
        "| run | calls | loop (s) | µs per call | sleeps in the loop | calls in the trace |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---|");
    for row in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {:.3} | {:.3} | {} | {}, all |",
            row.label,
            grouped(row.calls),
            row.loop_s,
            row.loop_s / row.calls as f64 * 1e6,
            grouped(row.sleeps),
            grouped(row.calls)
        );
    }
}
