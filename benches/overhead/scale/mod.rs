//! Issue 19's scale section (`scripts/bench --scale`): the workload of
//! tracee-tests/scale.c (2 threads, 200 call stacks of 6 to 13 frames, 5 %
//! of the blocks leaked) at 1 M, 10 M and 100 M calls, untraced, under
//! memptrace (a full trace and `--aggregate`) and under heaptrack, in one
//! run; then what reading each trace costs (`report`, its JSON,
//! `flamegraph`, `export --pprof`, the README's leak query; heaptrack_print);
//! then real programs and `make -j2` (`real.rs`).
//!
//! Every trace is checked against the workload's own truth: its mallocs and
//! frees from the workload's stacks, and its leaked blocks.

mod measure;
mod real;

use std::path::{Path, PathBuf};
use std::process::Command;

use rusqlite::Connection;

pub use measure::Timed;
use measure::{figure, timed};

/// Sizes of the scale section.
#[derive(Clone, Debug)]
pub struct ScalePlan {
    pub calls: Vec<u64>,
    /// Run heaptrack and heaptrack_print beside memptrace.
    pub external: bool,
    /// Rounds of the real programs (0: none).
    pub real_rounds: usize,
}

/// What the workload says it did.
#[derive(Clone, Copy, Debug, Default)]
struct Truth {
    mallocs: u64,
    frees: u64,
    leaked: u64,
    /// The workload's own CPU time, to take out of a tracer's.
    cpu_s: f64,
}

impl Truth {
    fn parse(stdout: &str) -> Result<Truth, String> {
        let words: Vec<&str> = stdout
            .lines()
            .find(|l| l.starts_with("truth scale "))
            .ok_or("scale printed no truth")?
            .split_whitespace()
            .collect();
        let at = |i: usize| words.get(i).and_then(|w| w.parse().ok());
        Ok(Truth {
            mallocs: at(3).ok_or("scale: no mallocs")?,
            frees: at(5).ok_or("scale: no frees")?,
            leaked: figure(stdout, "leak scale").ok_or("scale: no leaks")?,
            cpu_s: figure(stdout, "cpu_us").ok_or("scale: no cpu_us")? as f64 * 1e-6,
        })
    }

    fn calls(&self) -> u64 {
        self.mallocs + self.frees
    }
}

/// One tracer's run of one size.
#[derive(Clone, Debug, Default)]
pub struct TracedRow {
    pub tool: String,
    pub calls: u64,
    pub wall_s: f64,
    pub untraced_s: f64,
    /// The tracer's CPU (its run's minus the workload's own), per call.
    pub cpu_us_per_call: f64,
    pub bytes: u64,
    pub ring_waits: Option<u64>,
    pub peak_rss_kib: Option<u64>,
}

/// Reading one size's traces.
#[derive(Clone, Debug, Default)]
pub struct ReadRow {
    pub calls: u64,
    /// (what, CPU seconds, peak RSS KiB)
    pub reads: Vec<(String, Timed)>,
}

#[derive(Default)]
pub struct ScaleFigures {
    pub traced: Vec<TracedRow>,
    pub read: Vec<ReadRow>,
    pub real: Vec<real::RealRow>,
}

const LEAK_QUERY: &str = "SELECT l.blocks, l.bytes, t.text \
     FROM leaks_by_stack l JOIN stack_text t ON t.stack_id = l.stack_id \
     ORDER BY l.bytes DESC LIMIT 5;";

fn memptrace() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_memptrace"))
}

fn build(dir: &Path) -> Result<PathBuf, String> {
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("tracee-tests");
    let out_path = dir.join("scale");
    let out = Command::new("gcc")
        .args(["-O1", "-g", "-fno-optimize-sibling-calls", "-pthread", "-I"])
        .arg(&sources)
        .arg("-o")
        .arg(&out_path)
        .arg(sources.join("scale.c"))
        .output()
        .map_err(|e| format!("gcc: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "gcc scale.c: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(out_path)
}

fn int(conn: &Connection, sql: &str) -> Result<u64, String> {
    conn.query_row(sql, [], |r| r.get::<_, Option<i64>>(0))
        .map(|v| v.unwrap_or(0) as u64)
        .map_err(|e| format!("{sql}: {e}"))
}

fn meta(conn: &Connection, key: &str) -> Option<u64> {
    conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| {
        r.get::<_, String>(0)
    })
    .ok()?
    .parse()
    .ok()
}

/// The workload's calls and leaks in a trace equal its truth.
fn check(db: &Path, aggregate: bool, truth: Truth) -> Result<(), String> {
    let conn = Connection::open(db).map_err(|e| e.to_string())?;
    let leaf = "JOIN stacks s ON s.id = x.stack_id JOIN frames f ON f.id = s.frame_id";
    let ours = "f.function IN ('scale_a', 'scale_b', 'scale_c')";
    let (mallocs, frees, leaked) = if aggregate {
        (
            format!("SELECT sum(x.calls) FROM agg_calls x {leaf} WHERE x.op = 'malloc' AND {ours}"),
            format!(
                "SELECT sum(x.calls) FROM agg_calls x {leaf} \
                 WHERE x.op = 'free' AND f.function = 'scale_release'"
            ),
            format!("SELECT count(*) FROM agg_live x {leaf} WHERE {ours}"),
        )
    } else {
        (
            format!("SELECT count(*) FROM events x {leaf} WHERE x.op = 'malloc' AND {ours}"),
            format!(
                "SELECT count(*) FROM events x {leaf} \
                 WHERE x.op = 'free' AND f.function = 'scale_release'"
            ),
            "SELECT count(*) FROM leaks l JOIN stacks s ON s.id = l.alloc_stack_id \
             JOIN frames f ON f.id = s.frame_id \
             WHERE f.function IN ('scale_a', 'scale_b', 'scale_c')"
                .to_string(),
        )
    };
    let found = (
        int(&conn, &mallocs)?,
        int(&conn, &frees)?,
        int(&conn, &leaked)?,
    );
    let want = (truth.mallocs, truth.frees, truth.leaked);
    if found != want {
        return Err(format!(
            "{}: (mallocs, frees, leaks) {found:?} recorded, {want:?} made",
            db.display()
        ));
    }
    Ok(())
}

/// Trace the workload once with memptrace `options`; its row.
fn trace(
    scale: &Path,
    calls: u64,
    options: &[&str],
    label: &str,
    dir: &Path,
    untraced_s: f64,
) -> Result<(TracedRow, PathBuf), String> {
    let db = dir.join(format!("{}.db", label.replace(' ', "_")));
    let n = calls.to_string();
    let scale_path = scale.to_string_lossy();
    let db_path = db.to_string_lossy();
    let mut args = vec!["-o", db_path.as_ref(), "--force"];
    args.extend_from_slice(options);
    args.extend(["--", scale_path.as_ref(), n.as_str()]);
    let run = timed(&memptrace(), &args, &[], &dir.join(label.replace(' ', "_")))?;
    let truth = Truth::parse(&run.stdout)?;
    check(&db, options.contains(&"--aggregate"), truth)?;
    let conn = Connection::open(&db).map_err(|e| e.to_string())?;
    let row = TracedRow {
        tool: label.into(),
        calls: truth.calls(),
        wall_s: run.wall_s,
        untraced_s,
        cpu_us_per_call: (run.cpu_s - truth.cpu_s) / truth.calls() as f64 * 1e6,
        bytes: std::fs::metadata(&db).map_err(|e| e.to_string())?.len(),
        ring_waits: meta(&conn, "ring_waits"),
        peak_rss_kib: meta(&conn, "peak_rss_kib"),
    };
    Ok((row, db))
}

/// heaptrack's run of the workload, and the file it wrote.
fn heaptrack(
    scale: &Path,
    calls: u64,
    dir: &Path,
    untraced_s: f64,
) -> Result<(TracedRow, PathBuf), String> {
    let out = dir.join("heaptrack");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    let base = out.join("h");
    let n = calls.to_string();
    let run = timed(
        Path::new("/usr/bin/heaptrack"),
        &["-o", &base.to_string_lossy(), &scale.to_string_lossy(), &n],
        &[],
        &dir.join("heaptrack-run"),
    )?;
    let truth = Truth::parse(&run.stdout)?;
    let file = std::fs::read_dir(&out)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("h."))
        })
        .ok_or("heaptrack wrote no file")?;
    Ok((
        TracedRow {
            tool: "heaptrack".into(),
            calls: truth.calls(),
            wall_s: run.wall_s,
            untraced_s,
            cpu_us_per_call: (run.cpu_s - truth.cpu_s) / truth.calls() as f64 * 1e6,
            bytes: std::fs::metadata(&file).map_err(|e| e.to_string())?.len(),
            ring_waits: None,
            peak_rss_kib: None,
        },
        file,
    ))
}

/// What reading a full trace, an aggregate trace and heaptrack's file costs.
fn read(
    full: &Path,
    aggregate: &Path,
    heaptrack: Option<&Path>,
    dir: &Path,
) -> Result<Vec<(String, Timed)>, String> {
    let mut reads = Vec::new();
    let bin = memptrace();
    let out = |name: &str| dir.join(name).to_string_lossy().into_owned();
    for (db, kind) in [(full, "full"), (aggregate, "aggregate")] {
        let db = db.to_string_lossy().into_owned();
        let (svg, pprof) = (out("flame.svg"), out("profile.pb.gz"));
        let cases: Vec<(String, Vec<&str>)> = vec![
            (format!("report ({kind})"), vec!["report", &db]),
            (
                format!("report --format json ({kind})"),
                vec!["report", "--format", "json", &db],
            ),
            (
                format!("flamegraph ({kind})"),
                vec!["flamegraph", &db, "-o", &svg],
            ),
            (
                format!("export --pprof ({kind})"),
                vec!["export", "--pprof", &pprof, &db],
            ),
        ];
        for (label, args) in cases {
            let run = timed(&bin, &args, &[], &dir.join("read"))?;
            reads.push((label, run));
        }
        if kind == "full" {
            let run = timed(
                Path::new("/usr/bin/sqlite3"),
                &[&db, LEAK_QUERY],
                &[],
                &dir.join("read"),
            )?;
            reads.push(("README leak query (sqlite3, full)".into(), run));
        }
    }
    if let Some(file) = heaptrack {
        let run = timed(
            Path::new("/usr/bin/heaptrack_print"),
            &[&file.to_string_lossy()],
            &[],
            &dir.join("read"),
        )?;
        reads.push(("heaptrack_print".into(), run));
    }
    Ok(reads)
}

/// The scale section: every size, then the real programs.
pub fn run(plan: &ScalePlan, dir: &Path) -> Result<ScaleFigures, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let scale = build(dir)?;
    let mut figures = ScaleFigures::default();
    for &calls in &plan.calls {
        crate::progress(&format!("scale: {calls} calls"));
        let here = dir.join(calls.to_string());
        std::fs::create_dir_all(&here).map_err(|e| e.to_string())?;
        let plain = timed(&scale, &[&calls.to_string()], &[], &here.join("untraced"))?;
        Truth::parse(&plain.stdout)?;
        let (row, full) = trace(&scale, calls, &[], "memptrace", &here, plain.wall_s)?;
        figures.traced.push(row);
        let (row, aggregate) = trace(
            &scale,
            calls,
            &["--aggregate"],
            "memptrace --aggregate",
            &here,
            plain.wall_s,
        )?;
        figures.traced.push(row);
        let mut heaptrack_file = None;
        if plan.external && crate::runs::which("heaptrack").is_some() {
            let (row, file) = heaptrack(&scale, calls, &here, plain.wall_s)?;
            figures.traced.push(row);
            heaptrack_file = Some(file);
        }
        crate::progress(&format!("scale: reading the traces of {calls} calls"));
        let reads = read(&full, &aggregate, heaptrack_file.as_deref(), &here)?;
        figures.read.push(ReadRow { calls, reads });
        // The largest traces take gigabytes: keep only what is being made.
        let _ = std::fs::remove_dir_all(&here);
    }
    if plan.real_rounds > 0 {
        figures.real = real::run(plan.real_rounds, plan.external, &dir.join("real"))?;
    }
    Ok(figures)
}

fn mb(kib: u64) -> String {
    format!("{:.0}", kib as f64 / 1024.0)
}

impl ScaleFigures {
    /// The section's Markdown tables.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\n### Scale: tracee-tests/scale.c (2 threads, 200 stacks of 6-13 frames, 5 % leaked)\n\n\
             | calls | tool | wall s | x untraced | tool CPU µs/call | B/call on disk | ring waits | memptrace peak RSS MB |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|"
        );
        for r in &self.traced {
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} | {:.2} | {:.3} | {:.2} | {} | {} |",
                crate::tables::grouped(r.calls),
                r.tool,
                r.wall_s,
                r.wall_s / r.untraced_s,
                r.cpu_us_per_call,
                r.bytes as f64 / r.calls as f64,
                r.ring_waits.map_or("-".into(), |w| w.to_string()),
                r.peak_rss_kib.map_or("-".into(), mb),
            );
        }
        let _ = writeln!(
            out,
            "\n### Scale: reading the traces (CPU s / peak RSS MB)\n\n| calls | what | CPU s | wall s | RSS MB |\n|---:|---|---:|---:|---:|"
        );
        for row in &self.read {
            for (what, t) in &row.reads {
                let _ = writeln!(
                    out,
                    "| {} | {what} | {:.2} | {:.2} | {} |",
                    crate::tables::grouped(row.calls),
                    t.cpu_s,
                    t.wall_s,
                    mb(t.max_rss_kib)
                );
            }
        }
        if !self.real.is_empty() {
            let _ = writeln!(
                out,
                "\n### Real programs (medians, same minutes)\n\n\
                 | program | untraced s | heaptrack s | memptrace s | memptrace / heaptrack | memptrace / untraced | events | processes | memptrace peak RSS MB |\n\
                 |---|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for r in &self.real {
                let _ = writeln!(
                    out,
                    "| {} | {:.2} | {} | {:.2} | {} | {:.2} | {} | {} | {} |",
                    r.label,
                    r.untraced_s,
                    r.heaptrack_s.map_or("-".into(), |h| format!("{h:.2}")),
                    r.memptrace_s,
                    r.heaptrack_s
                        .map_or("-".into(), |h| format!("{:.2}", r.memptrace_s / h)),
                    r.memptrace_s / r.untraced_s,
                    crate::tables::grouped(r.events),
                    r.processes,
                    mb(r.memptrace_rss_kib)
                );
            }
        }
        out
    }
}
