//! The figures of one run, printed as the Markdown tables of
//! docs/performance.md.

use std::fmt::Write;

use crate::recorder::Replay;
use crate::runs::Load;
use crate::tables::{self, FairRow, ProgramRow, RingRow, Row};

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
    /// The loop tables' rows, and the multithreaded loop.
    pub rows: Vec<Row>,
    pub multi: Load,
    pub programs: Vec<ProgramRow>,
    pub fair: Vec<FairRow>,
    pub fair_load: Load,
    pub ring: Vec<RingRow>,
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

impl Figures {
    pub fn new(rounds: usize, multi: Load, fair_load: Load) -> Figures {
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
            multi,
            programs: Vec::new(),
            fair: Vec::new(),
            fair_load,
            ring: Vec::new(),
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

        tables::single(
            &mut out,
            &self.rows,
            self.plain_single_s,
            reference,
            blocking,
        );
        tables::multi(
            &mut out,
            &self.rows,
            self.plain_multi_s,
            self.plain_multi_wall_s,
            self.multi,
        );
        tables::programs(&mut out, &self.programs, self.rounds);
        tables::fairness(&mut out, &self.fair, self.fair_load);
        tables::ring(&mut out, &self.ring);

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
        out
    }
}
