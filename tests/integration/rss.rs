//! Resident memory over time (table `rss`): a tracee that maps and touches
//! 64 MiB when told, holds it, and unmaps it when told, launched on every
//! build, as a `-f` child and attached to. The test waits for conditions
//! (a sample showing the memory) before each step, never for time; the
//! assertions are on the order of the samples.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use crate::support::{
    Background, VARIANTS, Variant, memptrace, open_trace, run, scratch, trace, tracee, wait_until,
};

/// What the tracee touches (`TOUCHED` in resident.c) and requests untouched.
const TOUCHED: i64 = 64 << 20;
const REQUESTED: i64 = 8 << 20;

/// One row of `rss`.
#[derive(Clone, Copy, Debug)]
struct Sample {
    ts_ns: i64,
    anon: i64,
    rss: i64,
    mapped: i64,
}

/// The samples of process `pid` committed so far, in time order; none while
/// the trace cannot be read.
fn samples(path: &Path, pid: i32) -> Vec<Sample> {
    let read = || -> rusqlite::Result<Vec<Sample>> {
        let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        conn.busy_timeout(Duration::from_secs(2))?;
        let mut stmt = conn.prepare(
            "SELECT ts_ns, anon, rss, mapped FROM rss WHERE pid = ? ORDER BY ts_ns, rowid",
        )?;
        let rows = stmt.query_map([pid], |r| {
            Ok(Sample {
                ts_ns: r.get(0)?,
                anon: r.get(1)?,
                rss: r.get(2)?,
                mapped: r.get(3)?,
            })
        })?;
        rows.collect()
    };
    read().unwrap_or_default()
}

/// Drive a `resident` process through its steps, `pid` being the one that
/// touches: wait for a sample of it, let it touch, wait for a sample
/// showing the memory, let it release, wait for a sample without it. It
/// then waits for one more line to end.
fn steps(program: &mut Background, db: &Path) -> i32 {
    let pid: i32 = program.wait_for("ready").parse().unwrap();
    wait_until("a first sample of the program", || {
        !samples(db, pid).is_empty()
    });
    let base = samples(db, pid)[0].anon;
    program.send("\n");
    assert_eq!(program.wait_for("touched"), TOUCHED.to_string());
    wait_until("a sample with the touched memory", || {
        samples(db, pid).iter().any(|s| s.anon >= base + TOUCHED)
    });
    program.send("\n");
    program.wait_for("released");
    wait_until("a sample after the release", || {
        let s = samples(db, pid);
        let high = s.iter().position(|s| s.anon >= base + TOUCHED).unwrap();
        s[high..]
            .iter()
            .any(|x| x.anon <= s[high].anon - TOUCHED / 2)
    });
    pid
}

/// The ordered facts of a finished trace: before the touch, a sample; then
/// anonymous memory up by at least what was touched (and by less than what
/// was also requested: malloc'd but untouched memory is mapped, not
/// resident); then down by what was released.
fn check(db: &Path, pid: i32, what: &str) {
    let s = samples(db, pid);
    assert!(s.len() >= 3, "{what}: {s:?}");
    let first = s[0];
    let high = s.iter().position(|x| x.anon >= first.anon + TOUCHED);
    let high = s[high.unwrap_or_else(|| panic!("{what}: no rise of {TOUCHED}: {s:?}"))];
    assert!(
        high.anon - first.anon < TOUCHED + REQUESTED / 2,
        "{what}: the requested block is not resident: {s:?}"
    );
    assert!(high.rss >= high.anon, "{what}: {high:?}");
    assert!(
        high.mapped - first.mapped >= TOUCHED + REQUESTED,
        "{what}: both are mapped: {s:?}"
    );
    let low = s
        .iter()
        .filter(|x| x.ts_ns > high.ts_ns)
        .map(|x| x.anon)
        .min()
        .unwrap_or_else(|| panic!("{what}: no sample after the rise: {s:?}"));
    // The touched pages, less a page or two the program may have
    // allocated in between (stdio's buffers).
    assert!(low <= high.anon - (TOUCHED - (1 << 20)), "{what}: {s:?}");
    // memptrace's own shared areas (rings, ~200 MiB with jump probes) are
    // not the program's.
    let last = s.last().unwrap();
    assert!(last.mapped < TOUCHED, "{what}: mapped {}", last.mapped);
}

#[test]
fn resident_memory_rises_and_falls_on_every_build() {
    for variant in VARIANTS {
        let db = scratch("rss").join("trace.db");
        let mut tracer = Background::interactive(
            memptrace()
                .arg("-o")
                .arg(&db)
                .arg("--")
                .arg(tracee(variant, "resident")),
        );
        let pid = steps(&mut tracer, &db);
        tracer.send("\n");
        let run = tracer.finish();
        assert_eq!(run.code(), 0, "{variant:?}: {}", run.stderr);
        let t = open_trace(&db, run);
        assert_eq!(t.meta("rss_interval_ms").as_deref(), Some("100"));
        assert_eq!(t.meta("pid"), Some(pid.to_string()));
        check(&db, pid, variant.name());
        // Every sample is on the events' clock, within the trace.
        let duration: i64 = t.meta("duration_ns").unwrap().parse().unwrap();
        assert_eq!(
            t.int(&format!(
                "SELECT count(*) FROM rss WHERE ts_ns < 0 OR ts_ns > {duration}"
            )),
            0
        );
        let first_event = t.int("SELECT min(ts_ns) FROM events WHERE size = 8388608");
        let after = t.int(&format!(
            "SELECT count(*) FROM rss WHERE anon >= {TOUCHED} AND ts_ns > {first_event}"
        ));
        assert!(after > 0, "{variant:?}: the rise follows the malloc");
        if variant == Variant::Dynamic {
            plots(&db);
        }
    }
}

/// `memptrace plot` of a trace with samples draws them beside the heap; of
/// one without the table (older traces), the heap alone.
fn plots(db: &Path) {
    let dir = db.parent().unwrap();
    let svg = dir.join("memory.svg");
    let out = run(memptrace().arg("plot").arg(db).arg("-o").arg(&svg), b"");
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let text = std::fs::read_to_string(&svg).unwrap();
    roxmltree::Document::parse(&text).expect("the SVG is well-formed XML");
    for label in [
        "Heap in use (bytes requested): peak",
        "resident (RSS)",
        "resident anonymous",
        "mapped",
        "RSS peak",
    ] {
        assert!(text.contains(label), "{label} in the plot");
    }
    let png = dir.join("memory.png");
    let out = run(memptrace().arg("plot").arg(db).arg("-o").arg(&png), b"");
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    assert_eq!(decoder.read_info().expect("a PNG").info().width, 1200);

    let old = dir.join("old.db");
    std::fs::copy(db, &old).unwrap();
    Connection::open(&old)
        .unwrap()
        .execute_batch("DROP TABLE rss")
        .unwrap();
    let svg = dir.join("old.svg");
    let out = run(memptrace().arg("plot").arg(&old).arg("-o").arg(&svg), b"");
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("Heap in use (bytes requested): peak"));
    assert!(!text.contains("resident (RSS)"));
}

#[test]
fn a_forked_child_is_sampled() {
    let db = scratch("rss-fork").join("trace.db");
    let mut tracer = Background::interactive(
        memptrace()
            .arg("-o")
            .arg(&db)
            .arg("-f")
            .arg("--")
            .arg(tracee(Variant::Dynamic, "resident"))
            .arg("fork"),
    );
    let child = steps(&mut tracer, &db);
    tracer.send("\n");
    tracer.wait_for("parent done");
    let run = tracer.finish();
    assert_eq!(run.code(), 0, "{}", run.stderr);
    let t = open_trace(&db, run);
    let parent: i32 = t.meta("pid").unwrap().parse().unwrap();
    assert_ne!(parent, child);
    check(&db, child, "child");
    assert!(!samples(&db, parent).is_empty(), "the parent is sampled");
}

#[test]
fn an_attached_process_is_sampled_until_the_detach() {
    let mut program = Background::interactive(&mut std::process::Command::new(tracee(
        Variant::Dynamic,
        "resident",
    )));
    let db = scratch("rss-attach").join("trace.db");
    let pid = program.pid();
    let tracer = Background::start(
        memptrace()
            .args(["attach", &pid.to_string(), "--rss-interval", "20", "-o"])
            .arg(&db),
    );
    assert_eq!(steps(&mut program, &db), pid);
    // The samples after the release are in; the program is still there.
    tracer.signal(libc::SIGINT);
    let run = tracer.finish();
    assert_eq!(run.code(), 0, "{}", run.stderr);
    let t = open_trace(&db, run);
    assert_eq!(t.meta("rss_interval_ms").as_deref(), Some("20"));
    check(&db, pid, "attached");
    assert!(t.meta("end_reason").unwrap().contains("interrupted"));
    program.send("\n");
    let out = program.finish();
    assert_eq!(out.code(), 0, "{}", out.stderr);
}

#[test]
fn no_samples_with_an_interval_of_zero() {
    let t = trace(Variant::Dynamic, "resident", &[], &["--rss-interval", "0"]);
    assert_eq!(t.run.code(), 0);
    assert_eq!(t.meta("rss_interval_ms").as_deref(), Some("0"));
    assert_eq!(t.int("SELECT count(*) FROM rss"), 0);
}
