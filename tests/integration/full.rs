//! A database that cannot grow ends the trace cleanly (`--max-size`, a full
//! disk): memptrace says so once, the database holds every event up to a
//! commit and the end's rows, and the program runs on untraced: a launched
//! one to its own end, whose status memptrace exits with; an attached one
//! detached, running.

use std::path::Path;
use std::process::Command;

use crate::support::{
    Background, Trace, Variant, memptrace, open_trace, proc_status, run, scratch, tracee,
};

/// 2 MiB: the filler's 2 M calls need about 30 MiB.
const LIMIT: &str = "2M";
const REASON: &str = "the trace database reached --max-size (2097152 bytes)";

/// What every trace that stopped growing holds: the end's rows, a prefix
/// of the program's calls (each free of a block after its malloc), and
/// views that read.
/// `attached`: the first call seen may be the free of a block the program
/// allocated before the attach (an inventory block).
fn check_prefix(t: &Trace, attached: bool) {
    assert!(t.meta("ended_at").is_some());
    let events = t.int("SELECT count(*) FROM events");
    assert_eq!(t.meta("events"), Some(events.to_string()));
    let mallocs = t.recorded("fill_alloc", "malloc").calls;
    let frees = t.recorded("fill_release", "free").calls;
    assert!(mallocs > 1000, "{mallocs} mallocs recorded");
    assert!(mallocs < 1_000_000, "{mallocs} mallocs recorded");
    // Each malloc's free follows it; the trace may end between the two and,
    // attached, begin between them.
    let before = i64::from(attached);
    assert!(
        (mallocs - frees == 0 || mallocs - frees == 1 || mallocs - frees == -before),
        "{mallocs} mallocs, {frees} frees"
    );
    // A free never seen allocated: only, attached, that of a malloc in
    // flight at the attach (docs/schema.md: it finishes unrecorded).
    let unknown =
        t.int("SELECT count(*) FROM events WHERE op = 'free' AND ptr <> 0 AND alloc_id IS NULL");
    assert!(unknown <= before, "{unknown} frees never seen allocated");
    assert_eq!(t.int("SELECT count(*) FROM trace_finished"), 1);
    // Live at the end: at most the last malloc, whose free came after it.
    let leaked = t.int(
        "SELECT count(*) FROM leaks l JOIN stack_text s ON s.stack_id = l.alloc_stack_id \
         WHERE s.text LIKE 'fill_alloc%'",
    );
    let freed_first = t.int(
        "SELECT count(*) FROM (SELECT op FROM events WHERE op IN ('malloc', 'free') \
         ORDER BY id LIMIT 1) WHERE op = 'free'",
    );
    assert_eq!(leaked, mallocs - frees + freed_first);
    let report = run(memptrace().arg("report").arg(&t.path), b"");
    assert_eq!(report.code(), 0, "{}", report.stderr);
    assert!(report.stdout.contains("fill_alloc"), "{}", report.stdout);
}

fn size_of(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

#[test]
fn max_size_ends_a_launched_trace_and_the_program_runs_to_its_end() {
    let path = scratch("max-size-launch").join("trace.db");
    let out = run(
        memptrace()
            .env_remove("LD_LIBRARY_PATH")
            .args(["--max-size", LIMIT, "-o"])
            .arg(&path)
            .arg("--")
            .arg(tracee(Variant::Dynamic, "filler"))
            // 20 M calls: the 2 MiB are written long before the program
            // could end, however far the recorder lags on a loaded machine
            // (the rings make the program wait for it).
            .arg("2000"),
        b"",
    );
    // The program's end and status: it ran on untraced.
    assert_eq!(out.code(), 3, "{}", out.stderr);
    assert_eq!(out.stdout, "done 20000000\ntracer 0\n");
    assert_eq!(
        out.stderr,
        format!("memptrace: {REASON}: the trace ends here; the program runs on untraced\n")
    );
    let t = open_trace(&path, out);
    assert_eq!(
        t.meta("end_reason"),
        Some(format!(
            "detached: {REASON}; the program ran on untraced and exited with status 3"
        ))
    );
    assert_eq!(t.meta("exit_status").as_deref(), Some("3"));
    check_prefix(&t, false);
    // The end's rows come on top of the limit, and they are few.
    let size = size_of(&path);
    assert!(size <= 3 << 20, "{size} bytes");
}

#[test]
fn max_size_detaches_from_an_attached_process_which_runs_on() {
    let mut target = Background::interactive(
        Command::new(tracee(Variant::Dynamic, "filler"))
            .arg("wait")
            .env_remove("LD_LIBRARY_PATH"),
    );
    let pid: i32 = target.wait_for("ready").parse().unwrap();
    let path = scratch("max-size-attach").join("trace.db");
    let out = run(
        memptrace()
            .args(["attach", &pid.to_string(), "--max-size", LIMIT, "-o"])
            .arg(&path),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    assert_eq!(
        crate::support::without_death_warning(&out.stderr),
        format!("memptrace: {REASON}: the trace ends here; the process runs on, detached\n")
    );
    // Detached and running: it still counts, untraced, until told to end.
    assert_eq!(proc_status(pid, "TracerPid").as_deref(), Some("0"));
    target.signal(libc::SIGTERM);
    let end = target.finish();
    assert_eq!(end.code(), 3, "{}", end.stderr);
    assert!(end.stdout.ends_with("tracer 0\n"), "{}", end.stdout);
    let t = open_trace(&path, out);
    assert_eq!(t.meta("end_reason"), Some(format!("detached: {REASON}")));
    assert_eq!(t.meta("exit_status").as_deref(), Some("0"));
    check_prefix(&t, true);
}

/// A small tmpfs mounted for one test (root only: `mount(8)`), unmounted
/// on drop.
struct SmallDisk {
    dir: std::path::PathBuf,
}

impl SmallDisk {
    fn mount(label: &str, size: &str) -> SmallDisk {
        let dir = scratch(label).join("disk");
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "memptrace-test",
            ])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mounting a {size} tmpfs needs root (this test fills a disk): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk { dir }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

#[test]
fn a_full_disk_ends_a_launched_trace_and_the_program_runs_to_its_end() {
    // memptrace keeps 8 MiB of it for the end: the trace fills the rest.
    let disk = SmallDisk::mount("full-disk", "14M");
    let path = disk.dir.join("trace.db");
    let out = run(
        memptrace()
            .env_remove("LD_LIBRARY_PATH")
            .arg("-o")
            .arg(&path)
            .arg("--")
            .arg(tracee(Variant::Dynamic, "filler"))
            .arg("2000"),
        b"",
    );
    assert_eq!(out.code(), 3, "{}", out.stderr);
    assert_eq!(out.stdout, "done 20000000\ntracer 0\n");
    let reason = "the trace database's disk is full (or a quota is reached)";
    assert_eq!(
        out.stderr,
        format!("memptrace: {reason}: the trace ends here; the program runs on untraced\n")
    );
    // A copy off the full disk, to read.
    let copy = scratch("full-disk-copy").join("trace.db");
    std::fs::copy(&path, &copy).unwrap();
    assert!(!disk.dir.join("trace.db-wal").exists());
    let t = open_trace(&copy, out);
    assert_eq!(
        t.meta("end_reason"),
        Some(format!(
            "detached: {reason}; the program ran on untraced and exited with status 3"
        ))
    );
    assert_eq!(t.meta("exit_status").as_deref(), Some("3"));
    check_prefix(&t, false);
}
