//! A program that writes over the memory it shares with memptrace
//! (`tracee-tests/scribble.c`, issue 18): whatever it writes, memptrace
//! neither panics nor hangs, passes the program's exit status on, ends the
//! trace with its end rows, refuses what no probe could have recorded,
//! counts the damage in `meta` and says so, and `memptrace report` reads
//! the trace. With int3 probes there is no shared memory: the program finds
//! none and runs as any other.

use std::process::Command;

use crate::support::{
    Background, Trace, Variant, memptrace, open_trace, probes, run, scratch, trace, trace_program,
    tracee,
};

/// Every way scribble.c damages its slot; whether the damage is to records
/// (or only to the slot's words); whether the calls after it are recorded
/// (not when every number after a forged counter is implausible, nor once
/// the slot is dropped); the slots dropped.
const MODES: [(&str, bool, bool, u64); 9] = [
    ("random", true, true, 0),
    ("size65", true, true, 0),
    ("again", true, false, 1),
    ("ffff", true, true, 0),
    ("head", false, true, 0),
    ("counters", false, true, 0),
    ("counter", true, false, 0),
    ("seqs", true, true, 0),
    ("garbage", true, true, 0),
];

fn meta_count(t: &Trace, key: &str) -> u64 {
    t.meta(key)
        .unwrap_or_else(|| panic!("meta has no {key}"))
        .parse()
        .unwrap_or_else(|e| panic!("meta {key}: {e}"))
}

#[test]
fn a_program_scribbling_on_its_shared_memory() {
    let jump = probes() == "jump";
    for variant in [Variant::Dynamic, Variant::Musl] {
        for (mode, records, after_recorded, dropped) in MODES {
            let what = format!("{variant:?} {mode}");
            if !jump {
                // No shared memory to damage: a trace like any other.
                let t = trace(variant, "scribble", &[mode], &[]);
                assert_eq!(t.run.code(), 0, "{what}");
                assert!(t.run.stdout.starts_with("no control area\n"), "{what}");
                t.assert_truth();
                continue;
            }
            let t = trace_program(&tracee(variant, "scribble"), &[mode], &[]);
            assert_eq!(t.run.code(), 0, "{what}: {}", t.run.stderr);
            assert!(
                t.run.stdout.starts_with(&format!("scribbled {mode}\n")),
                "{what}: {}",
                t.run.stdout
            );
            assert!(t.meta("ended_at").is_some(), "{what}");
            assert_eq!(
                t.meta("end_reason").as_deref(),
                Some("exited with status 0"),
                "{what}"
            );
            let damaged_records = meta_count(&t, "damaged_records");
            let damaged_slots = meta_count(&t, "damaged_slots");
            if records {
                assert!(damaged_records > 0, "{what}: {}", t.run.stderr);
            } else {
                assert!(damaged_slots > 0, "{what}: {}", t.run.stderr);
            }
            // The slot words the program can write add nothing implausible.
            for key in [
                "nested_calls",
                "lost_returns",
                "ring_waits",
                "skipped_records",
            ] {
                assert!(meta_count(&t, key) < 1 << 40, "{what}: {key}");
            }
            // Said once, on stderr, and kept as a warning.
            assert_eq!(
                t.run.stderr.matches("the trace is damaged").count(),
                1,
                "{what}: {}",
                t.run.stderr
            );
            assert_eq!(
                t.int("SELECT count(*) FROM meta WHERE key LIKE 'warning.%' AND value LIKE 'the trace is damaged%'"),
                1,
                "{what}"
            );
            // Only what a probe can record, and only within the trace.
            let ops = t.int(
                "SELECT count(*) FROM events WHERE op NOT IN ('malloc', 'calloc', 'realloc',
                 'free', 'posix_memalign', 'aligned_alloc', 'memalign', 'valloc', 'pvalloc',
                 'reallocarray')",
            );
            assert_eq!(ops, 0, "{what}: ops no probe records");
            let duration = meta_count(&t, "duration_ns");
            let outside = t.int(&format!(
                "SELECT count(*) FROM events WHERE ts_ns < 0 OR ts_ns > {duration}"
            ));
            assert_eq!(outside, 0, "{what}: events stamped outside the trace");
            assert_eq!(meta_count(&t, "dropped_slots"), dropped, "{what}");
            let after = t.int(
                "SELECT count(*) FROM events e JOIN stacks s ON s.id = e.stack_id
                 JOIN frames f ON f.id = s.frame_id WHERE f.function = 'scribble_after'",
            );
            assert_eq!(after, if after_recorded { 2000 } else { 0 }, "{what}");
            let report = run(memptrace().arg("report").arg(&t.path), b"");
            assert_eq!(report.code(), 0, "{what}: {}", report.stderr);
            assert!(
                report.stdout.contains("damaged"),
                "{what}: {}",
                report.stdout
            );
        }
    }
}

/// A panic of memptrace's tracer thread (asked for by the debug build's
/// `MEMPTRACE_PANIC_AFTER`) while attached: the process is let go and runs
/// on unharmed, and the trace still ends with its end rows, saying where
/// memptrace failed; memptrace exits 101, as a Rust program that panics.
#[test]
fn a_panic_of_memptrace_lets_the_process_go_and_ends_the_trace() {
    let mut victim = Background::start(Command::new(tracee(Variant::Dynamic, "victim")).arg("2"));
    let pid: i32 = victim.wait_for("ready").parse().unwrap();
    let db = scratch("panic").join("trace.db");
    let tracer = Background::start(
        memptrace()
            .env("MEMPTRACE_PANIC_AFTER", "1000")
            .args(["attach", &pid.to_string(), "-o"])
            .arg(&db),
    );
    let run = tracer.finish();
    assert_eq!(run.code(), 101, "{}", run.stderr);
    assert!(
        run.stderr.contains("MEMPTRACE_PANIC_AFTER"),
        "{}",
        run.stderr
    );
    let t = open_trace(&db, run);
    assert!(t.meta("ended_at").is_some());
    let reason = t.meta("end_reason").unwrap();
    assert!(
        reason.starts_with("memptrace failed: panicked at src/tracer/life/failure.rs:")
            && reason.contains("MEMPTRACE_PANIC_AFTER"),
        "{reason}"
    );
    assert_eq!(t.meta("exit_status").as_deref(), Some("101"));
    assert!(t.int("SELECT count(*) FROM events") >= 1000);
    // Let go: no tracer, no trampoline left, and it checks itself.
    assert_eq!(
        crate::support::proc_status(pid, "TracerPid").as_deref(),
        Some("0")
    );
    assert_eq!(crate::attach::trampoline_pages(pid), Vec::<String>::new());
    victim.signal(libc::SIGTERM);
    let out = victim.finish();
    assert_eq!(out.code(), 0, "{}", out.stderr);
    assert_eq!(out.stderr, "", "the victim found damage");
}
