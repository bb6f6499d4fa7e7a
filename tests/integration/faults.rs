//! The fault suite: what a launched program may do to its tracer, and what
//! may happen to memptrace, with the program none the worse: threads by the
//! thousand, job control, crashes, and memptrace itself interrupted,
//! terminated or killed.

use std::os::unix::process::CommandExt;

use crate::support::{
    Background, VARIANTS, Variant, count_events, memptrace, open_trace, proc_status, scratch,
    trace, tracee, truth_of, wait_until,
};

#[test]
fn a_thousand_short_lived_threads() {
    for variant in VARIANTS {
        let t = trace(variant, "churn", &[], &[]);
        assert_eq!(t.run.code(), 0, "{variant:?}");
        t.assert_truth();
        let threads = t.int(
            "SELECT count(DISTINCT e.tid) FROM events e JOIN stacks s ON s.id = e.stack_id
             JOIN frames f ON f.id = s.frame_id WHERE f.function = 'churn_alloc'",
        );
        // Thread ids are reused; at least the 16 alive at once are distinct.
        assert!(threads >= 16, "{variant:?}: {threads}");
        assert_eq!(t.int("SELECT count(*) FROM threads WHERE end_ns IS NULL AND tid <> (SELECT value FROM meta WHERE key = 'pid')"), 0, "every thread's end is known");
    }
}

#[test]
fn sixty_four_threads() {
    for variant in [Variant::Dynamic, Variant::Musl] {
        let t = trace(variant, "threads", &["64", "1000"], &[]);
        assert_eq!(t.run.code(), 0);
        t.assert_truth();
        let per_thread = t.int(
            "SELECT count(*) FROM (SELECT e.tid FROM events e JOIN stacks s ON s.id = e.stack_id
             JOIN frames f ON f.id = s.frame_id
             WHERE f.function IN ('thread_alloc', 'thread_release')
             GROUP BY e.tid HAVING count(*) = 2000)",
        );
        assert_eq!(per_thread, 64, "{variant:?}");
    }
}

/// -f: children are traced into the same database, each with its pid.
#[test]
fn follow_forks() {
    for variant in VARIANTS {
        let t = trace(variant, "forks", &[], &["-f"]);
        assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
        let pid: i64 = t.meta("pid").unwrap().parse().unwrap();
        // The parent's calls, exactly; the forked child's 100 + 100 under
        // its own pid.
        for c in t
            .truth()
            .iter()
            .filter(|c| c.function.starts_with("parent_"))
        {
            assert_eq!(&t.recorded(&c.function, &c.op), c);
        }
        let child = t.int(&format!(
            "SELECT count(*) FROM events e JOIN stacks s ON s.id = e.stack_id
             JOIN frames f ON f.id = s.frame_id
             WHERE f.function = 'child_work' AND e.pid <> {pid}"
        ));
        assert_eq!(child, 200, "{variant:?}");
        // The shells of the ten vforks, posix_spawn and system() were
        // exec'd and traced: each has its images.
        let shells = t.int("SELECT count(DISTINCT pid) FROM modules WHERE path LIKE '%sh'");
        assert_eq!(shells, 12, "{variant:?}");
        let processes = t.int("SELECT count(DISTINCT pid) FROM events");
        assert!(processes >= 5, "{variant:?}: {processes}");
    }
}

/// -f with libunwind: a forked child that execs another program at the same
/// addresses (two static, non-PIE executables at 0x400000) is unwound with
/// its own unwind tables, not its parent's.
#[test]
fn follow_forks_libunwind_exec_at_the_same_addresses() {
    let deep = tracee(Variant::Static, "deep");
    let t = trace(
        Variant::Static,
        "forks",
        &["exec", deep.to_str().unwrap()],
        &["-f", "--unwinder", "libunwind"],
    );
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    let pid: i64 = t.meta("pid").unwrap().parse().unwrap();
    let stacks = t.stacks_from("deep_inner", "malloc");
    assert_eq!(stacks.len(), 1);
    assert_eq!(
        t.stack_functions(stacks[0])[..4],
        ["deep_inner", "deep_middle", "deep_outer", "main"]
    );
    let child = t.int("SELECT DISTINCT pid FROM events WHERE op = 'malloc' AND size = 12");
    assert_ne!(child, pid, "deep ran in the child");
}

#[test]
fn crashes_are_recorded() {
    for variant in [Variant::Dynamic, Variant::Static, Variant::Musl] {
        let t = trace(variant, "status", &["segv"], &[]);
        assert_eq!(t.run.code(), 128 + libc::SIGSEGV, "{variant:?}");
        assert_eq!(t.meta("exit_signal").as_deref(), Some("SIGSEGV"));
        t.assert_truth();
    }
}

/// The victim, launched under memptrace in a process group of its own (as a
/// shell would run it), and its pid once it runs.
fn launch_victim(args: &[&str], label: &str) -> (Background, i32, std::path::PathBuf) {
    let db = scratch(label).join("trace.db");
    let mut cmd = memptrace();
    cmd.arg("-o")
        .arg(&db)
        .arg("--")
        .arg(tracee(Variant::Dynamic, "victim"))
        .args(args);
    cmd.process_group(0);
    let mut tracer = Background::start(&mut cmd);
    let pid: i32 = tracer.wait_for("ready").parse().unwrap();
    (tracer, pid, db)
}

/// SIGSTOP and SIGCONT while traced: the program stops and goes on as it
/// would untraced, and no call is lost.
#[test]
fn job_control_while_traced() {
    let (tracer, pid, db) = launch_victim(&["4"], "jobs");
    crate::support::signal(pid, libc::SIGSTOP);
    // Every thread, not just the leader: the others stop a moment later.
    let all_stopped = || {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
        tasks.flatten().all(|task| {
            std::fs::read_to_string(task.path().join("status"))
                .ok()
                .and_then(|text| {
                    text.lines()
                        .find_map(|l| l.strip_prefix("State:"))
                        .map(|v| v.trim().starts_with(['T', 't']))
                })
                .unwrap_or(true) // gone meanwhile
        })
    };
    wait_until("every thread of the victim is stopped", all_stopped);
    // It stays stopped: its CPU time does not move.
    let cpu = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap()
            .split(' ')
            .nth(13)
            .unwrap()
            .to_string()
    };
    // It stays stopped: its CPU time does not move at all over a while (an
    // equality, not a threshold: a stopped program runs no instruction, on
    // an idle machine or a loaded one).
    let before = cpu();
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(cpu(), before, "a stopped program ran");
    assert!(
        proc_status(pid, "State").unwrap().starts_with('T')
            || proc_status(pid, "State").unwrap().starts_with('t')
    );
    crate::support::signal(pid, libc::SIGCONT);
    // It runs again: its CPU time moves.
    wait_until("the victim runs again", || cpu() != before);
    crate::support::signal(pid, libc::SIGTERM);
    let run = tracer.finish();
    assert_eq!(run.code(), 0, "{}", run.stderr);
    let t = open_trace(&db, run);
    t.assert_sound();
    t.assert_truth();
}

/// Ctrl-C in a terminal signals the whole foreground process group: the
/// first reaches the program (here it counts it and goes on); memptrace
/// records on; the second ends the trace, and the program runs on untraced.
#[test]
fn ctrl_c_twice() {
    let (mut tracer, pid, db) = launch_victim(&["2", "count-int"], "ctrl-c");
    let group = tracer.pid();
    crate::support::signal(-group, libc::SIGINT);
    // The program has it (memptrace passed it on, so it has seen its own
    // too): only now may the second come, or the two would be one.
    assert_eq!(tracer.wait_for("interrupt"), "1");
    assert!(
        proc_status(tracer.pid(), "State").is_some_and(|s| !s.starts_with('Z')),
        "memptrace went on after one Ctrl-C"
    );
    crate::support::signal(-group, libc::SIGINT);
    let run_done = {
        wait_until("memptrace detached", || {
            proc_status(pid, "TracerPid").as_deref() == Some("0")
        });
        crate::support::signal(pid, libc::SIGTERM);
        tracer.rest_of_stdout()
    };
    let run = tracer.finish();
    assert_eq!(run.code(), 128 + libc::SIGINT, "{}", run.stderr);
    assert!(run_done.contains("2 interrupts, 0 damaged"), "{run_done}");
    let t = open_trace(&db, run);
    assert_eq!(
        t.meta("end_reason").as_deref(),
        Some("detached: interrupted (Ctrl-C twice)")
    );
    assert!(t.int("SELECT count(*) FROM events") > 0);
}

/// SIGTERM to memptrace: it detaches, the database is complete, the program
/// runs on unharmed.
#[test]
fn sigterm_to_memptrace() {
    let (mut tracer, pid, db) = launch_victim(&["4"], "sigterm");
    wait_until("the first events are committed", || {
        count_events(&db).is_some_and(|n| n > 0)
    });
    crate::support::signal(tracer.pid(), libc::SIGTERM);
    wait_until("memptrace detached", || {
        proc_status(pid, "TracerPid").as_deref() == Some("0")
    });
    crate::support::signal(pid, libc::SIGTERM);
    let stdout = tracer.rest_of_stdout();
    assert!(stdout.contains(" 0 damaged"), "{stdout}");
    let run = tracer.finish();
    assert_eq!(run.code(), 128 + libc::SIGTERM, "{}", run.stderr);
    let t = open_trace(&db, run);
    assert_eq!(
        t.meta("end_reason").as_deref(),
        Some("detached: memptrace received SIGTERM")
    );
    assert!(t.meta("ended_at").is_some());
    // Every free the trace saw of a block allocated while traced is paired.
    assert_eq!(
        t.int("SELECT count(*) FROM events WHERE op = 'free' AND ptr <> 0 AND alloc_id IS NULL"),
        0
    );
    assert!(truth_of(&stdout).iter().all(|c| c.calls > 0));
}

/// SIGKILL to memptrace: the kernel kills the program with it (it must not
/// run on with int3 bytes and nobody to handle them), and everything
/// committed is readable.
#[test]
fn sigkill_to_memptrace() {
    let (tracer, pid, db) = launch_victim(&["4"], "sigkill");
    let mut committed = 0;
    wait_until("a thousand events are committed", || {
        committed = count_events(&db).unwrap_or(0);
        committed >= 1000
    });
    crate::support::signal(tracer.pid(), libc::SIGKILL);
    let run = tracer.finish();
    assert_eq!(run.status.code(), None, "memptrace was killed");
    wait_until("the program is gone", || {
        proc_status(pid, "State").is_none_or(|s| s.starts_with('Z'))
    });
    let db = rusqlite::Connection::open(&db).unwrap();
    let meta: i64 = db
        .query_row(
            "SELECT count(*) FROM meta WHERE key IN ('command', 'started_at', 'pid')",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(meta, 3);
    let ended: i64 = db
        .query_row(
            "SELECT count(*) FROM meta WHERE key = 'ended_at'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(ended, 0, "a killed memptrace wrote no end");
    let events: i64 = db
        .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .unwrap();
    assert!(
        events >= committed,
        "committed events are readable: {events} of {committed}"
    );
    let leaks: i64 = db
        .query_row("SELECT count(*) FROM leaks", [], |r| r.get(0))
        .unwrap();
    assert!(leaks > 0, "the views work on an unfinished trace");
}

/// A thread's stack mapping shrinks under it (the upper half of a merged
/// mapping unmapped while the thread runs): the stack copy the thread makes
/// runs into unmapped memory. memptrace reads that copy itself, the program
/// never sees the fault, and every call keeps its stack.
#[test]
fn a_stack_mapping_that_shrinks() {
    for variant in [Variant::Dynamic, Variant::Static, Variant::Musl] {
        let t = trace(variant, "shrink", &[], &[]);
        assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
        t.assert_truth();
        let faults: i64 = t.meta("copy_faults").unwrap().parse().unwrap();
        if crate::support::probes() == "int3" {
            assert!(
                (1..=2).contains(&faults),
                "{variant:?}: {faults} faults of the copy routine"
            );
        } else {
            // Jump probes walk the stack in place, never past its outermost
            // frame: nothing to fault on, and no copy routine.
            assert_eq!(faults, 0, "{variant:?}");
            assert_eq!(t.meta("walk_faults").as_deref(), Some("0"), "{variant:?}");
        }
    }
}
