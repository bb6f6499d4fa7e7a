//! The figures of one run, printed as the Markdown tables of
//! docs/performance.md.

use std::fmt::Write;

use crate::recorder::Replay;
use crate::runs::{Load, Outcome, TraceFacts};

/// One tracer (or way of tracing) on both loops.
#[derive(Clone, Debug, Default)]
pub struct Row {
    pub label: String,
    pub st_loop_s: Option<f64>,
    pub st_per_stop_us: Option<f64>,
    pub st_slowdown: Option<f64>,
    pub mt_loop_s: Option<f64>,
    pub mt_slowdown: Option<f64>,
    pub mt_wall_s: Option<f64>,
    pub mt_wall_slowdown: Option<f64>,
    pub bytes_per_event: Option<f64>,
    pub mt_bytes_per_event: Option<f64>,
    pub note: String,
}

fn median_of(outcomes: &[Outcome], f: impl Fn(&Outcome) -> f64) -> f64 {
    crate::median(outcomes.iter().map(f).collect())
}

impl Row {
    pub fn new(label: &str) -> Row {
        Row {
            label: label.into(),
            ..Row::default()
        }
    }

    pub fn fill_single(&mut self, runs: &[Outcome], plain_s: f64, stops: u64) {
        let traced = median_of(runs, |o| o.loop_s);
        self.st_loop_s = Some(traced);
        self.st_per_stop_us = Some((traced - plain_s) / stops as f64 * 1e6);
        self.st_slowdown = Some(traced / plain_s);
    }

    pub fn fill_multi(&mut self, runs: &[Outcome], plain_s: f64, plain_wall_s: f64) {
        let traced = median_of(runs, |o| o.loop_s);
        let wall = median_of(runs, |o| o.wall_s);
        self.mt_loop_s = Some(traced);
        self.mt_slowdown = Some(traced / plain_s);
        self.mt_wall_s = Some(wall);
        self.mt_wall_slowdown = Some(wall / plain_wall_s);
    }
}

/// How the stacks of a checked trace look, for the notes column.
pub fn stack_note(facts: &TraceFacts, load: Load) -> String {
    let calls = 2 * load.pairs();
    match facts.min_frames {
        Some(frames) => format!(
            "{} of {calls} calls with a full stack, ≥ {frames} frames",
            facts.full_stacks
        ),
        None => format!("all {calls} calls recorded, no stacks"),
    }
}

pub struct Figures {
    pub rounds: usize,
    pub plan: String,
    pub load_before: String,
    pub load_after: String,
    /// (what, µs per stop)
    pub bare: Vec<(String, f64)>,
    /// (system call, µs per call on a stopped thread)
    pub syscalls: Vec<(String, f64)>,
    pub plain_single_s: f64,
    pub plain_multi_s: f64,
    pub plain_multi_wall_s: f64,
    pub rows: Vec<Row>,
    /// (events, memptrace's peak RSS in KiB)
    pub rss: Vec<(u64, Option<u64>)>,
    pub rss_bytes_per_event: Option<f64>,
    /// VmRSS every 100 ms during the largest run (KiB).
    pub rss_timeline: Vec<u64>,
    pub replay: Option<Replay>,
}

/// The 1-minute load average, as /proc/loadavg has it.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "?".into())
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

fn opt(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(|| "–".into(), |v| format!("{v:.digits$}"))
}

fn ratio(value: Option<f64>) -> String {
    match value {
        Some(v) if v >= 100.0 => format!("{v:.0}x"),
        Some(v) if v >= 10.0 => format!("{v:.1}x"),
        Some(v) => format!("{v:.2}x"),
        None => "–".into(),
    }
}

impl Figures {
    pub fn new(rounds: usize) -> Figures {
        Figures {
            rounds,
            plan: String::new(),
            load_before: String::new(),
            load_after: String::new(),
            bare: Vec::new(),
            syscalls: Vec::new(),
            plain_single_s: 0.0,
            plain_multi_s: 0.0,
            plain_multi_wall_s: 0.0,
            rows: Vec::new(),
            rss: Vec::new(),
            rss_bytes_per_event: None,
            rss_timeline: Vec::new(),
            replay: None,
        }
    }

    /// The bare stop with memptrace's way of waiting: the reference.
    fn bare_reference(&self) -> f64 {
        self.bare.get(1).map_or(f64::NAN, |b| b.1)
    }

    fn bare_blocking(&self) -> f64 {
        self.bare.first().map_or(f64::NAN, |b| b.1)
    }

    pub fn render(&self, bench: bool) -> String {
        let mut out = String::new();
        let reference = self.bare_reference();
        let blocking = self.bare_blocking();
        let _ = writeln!(
            out,
            "{}\n",
            if bench {
                "# memptrace overhead (cargo bench --bench overhead)"
            } else {
                "# memptrace overhead: smoke run (cargo test); figures mean nothing"
            }
        );
        let _ = writeln!(
            out,
            "Machine: {} CPUs ({}), Linux {}; load average {} before, {} after.  ",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            cpu_model(),
            kernel(),
            self.load_before,
            self.load_after
        );
        let _ = writeln!(out, "Run: {}.\n", self.plan);

        let _ = writeln!(out, "## The bare ptrace stop and its parts\n");
        let _ = writeln!(
            out,
            "| stop | µs per stop | x bare stop (memptrace's wait) |"
        );
        let _ = writeln!(out, "|---|---:|---:|");
        for (label, us) in &self.bare {
            let _ = writeln!(out, "| {label} | {us:.2} | {:.2}x |", us / reference);
        }

        let _ = writeln!(
            out,
            "\n## System calls of a stop path, each alone (thread stays stopped)\n"
        );
        let _ = writeln!(out, "| system call | µs per call |");
        let _ = writeln!(out, "|---|---:|");
        for (label, us) in &self.syscalls {
            let _ = writeln!(out, "| {label} | {us:.2} |");
        }

        let _ = writeln!(
            out,
            "\n## Single-threaded loop: cost per stop\n\n\
             Untraced loop: {:.4} s. Per stop = (traced loop - untraced loop) / stops.\n",
            self.plain_single_s
        );
        let _ = writeln!(
            out,
            "| tracer | loop (s) | µs per stop | x bare (memptrace's wait) | x bare (blocking) | loop slowdown | DB bytes/event | stacks |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---|");
        for row in &self.rows {
            let per_stop = row.st_per_stop_us;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                row.label,
                opt(row.st_loop_s, 3),
                opt(per_stop, 2),
                ratio(per_stop.map(|p| p / reference)),
                ratio(per_stop.map(|p| p / blocking)),
                ratio(row.st_slowdown),
                opt(row.bytes_per_event, 1),
                row.note
            );
        }

        let _ = writeln!(
            out,
            "\n## Multithreaded loop: whole-program slowdown\n\n\
             Untraced: loop {:.4} s, whole command {:.4} s.\n",
            self.plain_multi_s, self.plain_multi_wall_s
        );
        let _ = writeln!(
            out,
            "| tracer | loop (s) | loop slowdown | whole command (s) | whole-command slowdown | DB bytes/event |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|");
        for row in self.rows.iter().filter(|r| r.mt_loop_s.is_some()) {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                row.label,
                opt(row.mt_loop_s, 3),
                ratio(row.mt_slowdown),
                opt(row.mt_wall_s, 3),
                ratio(row.mt_wall_slowdown),
                opt(row.mt_bytes_per_event, 1)
            );
        }

        let _ = writeln!(out, "\n## Recorder and memory\n");
        if let Some(replay) = &self.replay {
            let _ = writeln!(
                out,
                "- Recorder alone: {:.2} M events/s ({} events of a benchmark trace replayed \
                 through Recorder + SqliteSink, finish included), {:.1} bytes/event on disk.",
                replay.events_per_s / 1e6,
                replay.events,
                replay.bytes_per_event
            );
        }
        for (events, kib) in &self.rss {
            let _ = writeln!(
                out,
                "- memptrace peak RSS (VmHWM) for {events} events: {}.",
                kib.map_or_else(
                    || "not recorded".into(),
                    |k| format!("{:.1} MiB", k as f64 / 1024.0)
                )
            );
        }
        if self.rss_timeline.len() >= 10 {
            let at = |f: usize| self.rss_timeline[(self.rss_timeline.len() - 1) * f / 100];
            let _ = writeln!(
                out,
                "- Its VmRSS along that run (at 10 %, 25 %, 50 %, 75 % and 100 % of it): {} MiB.",
                [10, 25, 50, 75, 100]
                    .map(|f| format!("{:.1}", at(f) as f64 / 1024.0))
                    .join(", ")
            );
        }
        if let Some(b) = self.rss_bytes_per_event {
            let _ = writeln!(out, "- Database of that trace: {b:.1} bytes/event.");
        }
        let _ = self.rounds;
        out
    }
}
