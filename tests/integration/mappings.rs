//! Mapping calls (mmap, munmap, mremap, brk/sbrk, madvise, mprotect) as
//! events, with their stacks, the program's own told apart from those the
//! allocator makes inside its calls: against the tracee's own truth, on
//! every build, launched, under `-f` and attached.

use std::process::Command;

use crate::attach::trampoline_pages;
use crate::support::{
    Background, Trace, VARIANTS, Variant, memptrace, open_trace, probes, run, scratch, trace,
    tracee, wait_until,
};

/// Calls of `op` whose stack's innermost frame is `function`, made by the
/// program itself.
fn own_calls(t: &Trace, function: &str, op: &str) -> i64 {
    t.db.query_row(
        "SELECT count(*) FROM map_events m JOIN stacks s ON s.id = m.stack_id
         JOIN frames f ON f.id = s.frame_id
         WHERE f.function = ?1 AND m.op = ?2 AND m.by_allocator IS NULL",
        [function, op],
        |r| r.get(0),
    )
    .unwrap()
}

/// Calls of `op` of at least 1 MiB the allocator made inside `allocator`
/// calls (smaller ones are its own housekeeping: musl maps a page of
/// metadata on the first big block).
fn allocator_calls(t: &Trace, op: &str, allocator: &str) -> i64 {
    t.db.query_row(
        "SELECT count(*) FROM map_events WHERE op = ?1 AND by_allocator = ?2
         AND len >= 1048576",
        [op, allocator],
        |r| r.get(0),
    )
    .unwrap()
}

/// The `map <function> <op> <calls>` lines of the tracee's output.
fn stated(stdout: &str) -> Vec<(String, String, i64)> {
    stdout
        .lines()
        .filter_map(|l| {
            let mut w = l.strip_prefix("map ")?.split_whitespace();
            Some((w.next()?.into(), w.next()?.into(), w.next()?.parse().ok()?))
        })
        .collect()
}

fn check(t: &Trace, variant: Variant) {
    let truth = stated(&t.run.stdout);
    assert_eq!(truth.len(), 6, "{variant:?}: {}", t.run.stdout);
    for (function, op, calls) in truth {
        assert_eq!(
            own_calls(t, &function, &op),
            calls,
            "{variant:?}: {function} {op}"
        );
    }
    // Each big block was mapped by malloc and unmapped by free.
    let big: i64 = t
        .run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("big "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(allocator_calls(t, "mmap", "malloc"), big, "{variant:?}");
    assert_eq!(allocator_calls(t, "munmap", "free"), big, "{variant:?}");
    // The results are the program's: every mmap it made succeeded and
    // returned a page-aligned address, which its munmap released.
    let failed: i64 = t.int("SELECT count(*) FROM map_events WHERE op = 'mmap' AND result = -1");
    assert_eq!(failed, 0, "{variant:?}");
    let unaligned: i64 =
        t.int("SELECT count(*) FROM map_events WHERE op = 'mmap' AND result % 4096 <> 0");
    assert_eq!(unaligned, 0, "{variant:?}");
    t.assert_truth();
}

#[test]
fn mapping_calls_on_every_build() {
    for variant in VARIANTS {
        let t = trace(variant, "mapping", &[], &[]);
        assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
        check(&t, variant);
    }
}

/// Under `-f`, a child's mapping calls are its own process's.
#[test]
fn mapping_calls_of_a_forked_child() {
    let dir = scratch("mapping-f");
    let db = dir.join("trace.db");
    let program = tracee(Variant::Dynamic, "mapping");
    let out = run(
        memptrace()
            .arg("-o")
            .arg(&db)
            .args(["-f", "--", "sh", "-c"])
            .arg(format!("{}; true", program.display())),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let t = open_trace(&db, out);
    let child: i64 = t.int("SELECT pid FROM map_events WHERE op = 'mremap' GROUP BY pid");
    assert_ne!(
        child.to_string(),
        t.meta("pid").unwrap(),
        "the child's own pid"
    );
    check(&t, Variant::Dynamic);
}

/// Attached to a running process before it makes any of its mapping calls:
/// with int3 probes every one of them is recorded, the allocator's told
/// apart, on every build. With jump probes none is: mapping calls are caught
/// by int3s, which would kill the process if memptrace died (see README,
/// "memptrace's death"), so an attach with jump probes does not hook them.
#[test]
fn mapping_calls_while_attached() {
    for variant in VARIANTS {
        let mut target =
            Background::interactive(Command::new(tracee(variant, "mapping")).arg("wait"));
        let pid: i32 = target.wait_for("ready").parse().unwrap();
        let db = scratch("mapping-attach").join("trace.db");
        let tracer = Background::start(
            memptrace()
                .args(["attach", &pid.to_string(), "-o"])
                .arg(&db),
        );
        wait_until("memptrace hooked the process", || {
            !trampoline_pages(pid).is_empty()
        });
        target.send("go\n");
        let end = target.finish();
        assert_eq!(end.code(), 0, "{variant:?}: {}", end.stderr);
        let out = tracer.finish();
        assert_eq!(out.code(), 0, "{variant:?}: {}", out.stderr);
        let mut t = open_trace(&db, out);
        t.run.stdout = end.stdout;
        if probes() == "int3" {
            check(&t, variant);
        } else {
            assert_eq!(t.int("SELECT count(*) FROM map_events"), 0, "{variant:?}");
        }
    }
}
