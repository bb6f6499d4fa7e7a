//! A program whose memory misleads the heap walker (`hostile_heap.c`: a
//! header whose size wraps the address space, a fake mmapped block, a list
//! of arenas that loops): traced launched and attached, it runs to its
//! end, memptrace counts each part of each heap map it could not read
//! (`heap_walk_errors`) and warns once per map, the program's own calls are
//! all there, and the trace reads.

use std::process::Command;

use crate::support::{
    Background, Calls, Trace, Variant, memptrace, open_trace, run, scratch, trace_program, tracee,
    truth_of,
};

/// Parts of one heap map of `hostile_heap` not read: the fake arena, the
/// loop back to the thread arena, the mmapped blocks glibc does not count.
const ERRORS_PER_MAP: u64 = 3;

/// What every trace of the program must show; `maps`: heap maps taken
/// (each with its warning), `stdout`: the program's.
fn check(t: &Trace, maps: &[&str], stdout: &str) {
    assert!(stdout.contains("corrupted arena\n"), "{stdout}");
    assert!(t.meta("ended_at").is_some());
    assert_eq!(
        t.meta("end_reason").as_deref(),
        Some("exited with status 0")
    );
    let total = ERRORS_PER_MAP * maps.len() as u64;
    assert_eq!(t.meta("heap_walk_errors"), Some(total.to_string()));
    let pid = t.meta("pid").unwrap();
    // (With int3 probes an attach also says that memptrace's death would
    // kill the process.)
    let stderr = crate::support::without_death_warning(&t.run.stderr);
    let warnings: Vec<&str> = stderr.lines().collect();
    assert_eq!(warnings.len(), maps.len(), "{}", t.run.stderr);
    for (warning, moment) in warnings.iter().zip(maps) {
        let says = format!(
            "memptrace: warning: the heap map of process {pid} at {moment}: {ERRORS_PER_MAP} part(s) could not be read"
        );
        assert!(warning.starts_with(&says), "{warning}");
    }
    // Every heap map stored, with its arenas' reasons.
    assert_eq!(
        t.int("SELECT count(*) FROM heap_snapshots WHERE error IS NULL") as usize,
        maps.len()
    );
    let truth = truth_of(stdout);
    assert_eq!(truth.len(), 2, "{stdout}");
    for want in truth {
        let got: Calls = t.recorded(&want.function, &want.op);
        assert_eq!(got, want);
    }
    let unknown =
        t.int("SELECT count(*) FROM events WHERE op = 'free' AND ptr <> 0 AND alloc_id IS NULL");
    assert_eq!(unknown, 0);
    let report = run(memptrace().arg("report").arg(&t.path), b"");
    assert_eq!(report.code(), 0, "{}", report.stderr);
    assert!(report.stdout.contains("hostile_alloc"), "{}", report.stdout);
}

#[test]
fn a_hostile_heap_launched() {
    let program = tracee(Variant::Dynamic, "hostile_heap");
    let t = trace_program(&program, &[], &[]);
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    let stdout = t.run.stdout.clone();
    check(&t, &["exit"], &stdout);
}

#[test]
fn a_hostile_heap_attached() {
    let mut target = Background::interactive(
        Command::new(tracee(Variant::Dynamic, "hostile_heap"))
            .arg("wait")
            .env_remove("LD_LIBRARY_PATH"),
    );
    let pid: i32 = target.wait_for("ready").parse().unwrap();
    let db = scratch("hostile-heap-attach").join("trace.db");
    let tracer = Background::start(
        memptrace()
            .args(["attach", &pid.to_string(), "-o"])
            .arg(&db),
    );
    crate::support::wait_until("memptrace hooked the process", || {
        !crate::attach::trampoline_pages(pid).is_empty()
    });
    target.send("go\n");
    let end = target.finish();
    assert_eq!(end.code(), 0, "{}", end.stderr);
    let out = tracer.finish();
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let t = open_trace(&db, out);
    check(&t, &["attach", "exit"], &end.stdout);
}
