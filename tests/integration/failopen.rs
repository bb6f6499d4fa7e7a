//! memptrace's death never kills a process it attached to: SIGKILL in the
//! middle of a trace, and a memptrace that stops answering (SIGSTOP) while
//! a thread's ring fills. The tracee (`tracee-tests/failopen.c`) checks
//! every block it allocates, makes threads all the time, fills a ring,
//! starts new threads and loads a library after the fact, and exits 0 only
//! if nothing went wrong.
//!
//! With `--probes int3` memptrace's death kills the process (an int3
//! without a tracer is a fatal SIGTRAP): the attach says so, and the tests
//! check that it did and what then happens, as documented in the README.

use std::process::Command;

use crate::attach::trampoline_pages;
use crate::support::{
    Background, Run, Variant, memptrace, open_trace, probes, proc_status, scratch, tracee,
    wait_until,
};

/// The warning an attach prints when memptrace's death would kill the
/// process.
fn death_warning(pid: i32) -> String {
    format!("memptrace's death (SIGKILL, OOM, a crash) would kill process {pid} with SIGTRAP")
}

/// The tracee, running, and memptrace attached to it and recording.
fn attached(label: &str) -> (Background, i32, Background, std::path::PathBuf) {
    let dir = tracee(Variant::Dynamic, "failopen")
        .parent()
        .unwrap()
        .to_path_buf();
    // With int3 probes, a stop per call: a burst that ends in a few seconds.
    let burst = if probes() == "int3" {
        "20000"
    } else {
        "1000000"
    };
    let mut target = Background::interactive(
        Command::new(dir.join("failopen"))
            .arg(dir.join("libplugin.so"))
            .arg(burst),
    );
    let pid: i32 = target.wait_for("ready").parse().unwrap();
    let db = scratch(label).join("trace.db");
    let tracer = Background::start(
        memptrace()
            .args(["attach", &pid.to_string(), "-o"])
            .arg(&db),
    );
    wait_until("memptrace records the process's calls", || {
        crate::attach::calls_committed(&db) > 0
    });
    (target, pid, tracer, db)
}

/// memptrace killed itself at its `k`th moment (a debug knob), and the
/// kernel let process `pid` go.
fn killed_at(tracer: Background, pid: i32, k: u32) {
    use std::os::unix::process::ExitStatusExt;
    let out = tracer.finish();
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGKILL),
        "k = {k}: {}",
        out.stderr
    );
    assert_eq!(proc_status(pid, "TracerPid").as_deref(), Some("0"));
}

/// The victim, let go by a dead memptrace at moment `k`, runs on for a
/// while untraced (through the probes' pages, if any are left), then ends
/// on SIGTERM with its own verdict: exit 0, nothing damaged.
fn runs_on_unharmed(victim: Background, k: u32) {
    std::thread::sleep(std::time::Duration::from_millis(300));
    victim.signal(libc::SIGTERM);
    let end = victim.finish();
    assert_eq!(end.stderr, "", "k = {k}: the victim found damage");
    assert_eq!(end.code(), 0, "k = {k}: {:?}\n{}", end.status, end.stdout);
    assert!(end.stdout.contains(" 0 damaged"), "k = {k}: {}", end.stdout);
}

/// The tracee's own verdict: exit 0, nothing damaged.
fn assert_unharmed(end: &Run) {
    assert_eq!(end.code(), 0, "{}\n{}", end.stdout, end.stderr);
    assert!(end.stdout.contains(" 0 damaged"), "{}", end.stdout);
    assert!(end.stderr.is_empty(), "{}", end.stderr);
}

#[test]
fn sigkill_of_memptrace_in_the_middle_of_a_trace() {
    use std::os::unix::process::ExitStatusExt;
    let (mut target, pid, tracer, _db) = attached("failopen-kill");
    tracer.signal(libc::SIGKILL);
    let out = tracer.finish();
    assert_eq!(out.status.signal(), Some(libc::SIGKILL));
    if probes() == "int3" {
        // Known and said at the start: the process dies with memptrace, of
        // the first int3 its threads meet (they allocate all the time).
        assert!(out.stderr.contains(&death_warning(pid)), "{}", out.stderr);
        let end = target.finish();
        assert_eq!(end.status.signal(), Some(libc::SIGTRAP), "{}", end.stdout);
        return;
    }
    assert!(!out.stderr.contains("would kill"), "{}", out.stderr);
    // The kernel let it go: no tracer, and it runs on.
    let state = proc_status(pid, "State").unwrap_or_default();
    if state.starts_with('Z') {
        let end = target.finish();
        panic!(
            "the process died with memptrace: {:?}\n{}",
            end.status, end.stderr
        );
    }
    assert_eq!(proc_status(pid, "TracerPid").as_deref(), Some("0"));
    assert!(
        !trampoline_pages(pid).is_empty(),
        "the probes are still there"
    );
    // A ring-full of calls, new threads (no slot) and a library loaded
    // (the dynamic linker's hook), all with the probes in place.
    target.send("go\n");
    assert_eq!(target.wait_for("tracer"), "0");
    target.wait_for("burst");
    let end = target.finish();
    assert_unharmed(&end);
}

/// memptrace stops answering (SIGSTOP: alive, its thread id still in the
/// word the kernel would clear). With jump probes, a thread whose ring
/// fills waits for it a second, then lets its calls through unrecorded;
/// once memptrace goes on, it counts them, says so, and traces on to the
/// process's end. With int3 probes a thread waits in its stop for as long
/// as memptrace is stopped, and nothing is lost.
#[test]
fn a_memptrace_that_stops_answering_is_given_up_on_after_a_second() {
    let jumps = probes() != "int3";
    let (mut target, pid, tracer, db) = attached("failopen-stop");
    tracer.signal(libc::SIGSTOP);
    target.send("go\n");
    if jumps {
        assert_eq!(target.wait_for("tracer"), tracer.pid().to_string());
        // The burst's 1,000,000 calls overflow the thread's ring many times.
        target.wait_for("burst");
    } else {
        // The main thread's first call after reading the line stops at an
        // int3, for memptrace.
        wait_until("the main thread waits in a stop for memptrace", || {
            in_tracing_stop(pid, pid)
        });
    }
    tracer.signal(libc::SIGCONT);
    let end = target.finish();
    assert_unharmed(&end);
    let out = tracer.finish();
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let warned = out
        .stderr
        .contains("calls were not recorded: memptrace did not answer the jump probes for over 1 s");
    assert_eq!(warned, jumps, "{}", out.stderr);
    let t = open_trace(&db, out);
    let through: i64 = t.meta("let_through_calls").unwrap().parse().unwrap();
    assert_eq!(through > 0, jumps, "{through}");
    assert_eq!(t.meta("pid"), Some(pid.to_string()));
}

/// An orderly trace: `meta` says what memptrace's death would have done,
/// and no call was let through.
#[test]
fn meta_says_what_memptraces_death_would_do() {
    let (target, pid, tracer, db) = attached("failopen-meta");
    tracer.signal(libc::SIGINT);
    let out = tracer.finish();
    assert_eq!(out.code(), 0, "{}", out.stderr);
    drop(target);
    let t = open_trace(&db, out);
    let death = t.meta("on_memptrace_death").unwrap();
    if probes() == "int3" {
        assert!(death.starts_with("kills it: int3 probes at "), "{death}");
        // Every hook an int3: the first four, and how many more.
        assert!(death.contains(", libc.so.6:"), "{death}");
        assert!(death.contains(" more: memptrace's death"), "{death}");
        assert!(death.ends_with(&death_warning(pid)), "{death}");
        assert!(
            t.run.stderr.contains(&death_warning(pid)),
            "{}",
            t.run.stderr
        );
    } else {
        assert_eq!(death, "runs on: the probes let calls through unrecorded");
        assert!(!t.run.stderr.contains("would kill"), "{}", t.run.stderr);
        // Mapping calls recorded by jump probes (the tracee's threads map
        // their stacks, its library is mapped), with no int3 anywhere.
        assert!(t.int("SELECT count(*) FROM map_events") > 0);
        assert_eq!(t.meta("probe.libc.so.6:mmap").as_deref(), Some("jump"));
    }
    assert_eq!(t.meta("let_through_calls").as_deref(), Some("0"));
}

/// Thread `tid` of `pid` stands in a ptrace stop (state `t`).
fn in_tracing_stop(pid: i32, tid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat"))
        .ok()
        .and_then(|stat| Some(stat.rsplit_once(") ")?.1.starts_with('t')))
        .unwrap_or(false)
}

/// SIGKILL of memptrace while it runs a system call in a thread of the
/// process it attaches to (`MEMPTRACE_DIE_IN_CALL=k`: memptrace kills
/// itself at the k-th moment a thread holds an injected call's registers:
/// set, at the call's entry, at its exit; three per call). Every call after
/// the first goes through memptrace's stub, after which the thread puts
/// its own registers back (`tracer::inject`): the process runs on and ends
/// well. Jump probes in both suite modes: with int3 probes memptrace's
/// death kills the process anyway (said at the attach).
///
/// The first call of an attach (k = 1 to 3), which maps the stub's page,
/// runs through a copy of the stub lent to page padding after the program's
/// code (see the next test for that and for the detach's last call). A
/// death during a detach while a thread stands at a SIGTRAP stop is not
/// survived (docs/design.md).
#[test]
fn sigkill_of_memptrace_while_it_runs_a_system_call_in_the_process() {
    let dir = tracee(Variant::Dynamic, "failopen")
        .parent()
        .unwrap()
        .to_path_buf();
    // The attach of this tracee injects six calls (18 moments).
    for k in [1, 2, 3, 4, 5, 6, 8, 13, 17] {
        let mut target = Background::interactive(
            Command::new(dir.join("failopen"))
                .arg(dir.join("libplugin.so"))
                .arg("20000"),
        );
        let pid: i32 = target.wait_for("ready").parse().unwrap();
        let db = scratch(&format!("failopen-die-{k}")).join("trace.db");
        let tracer = Background::start(
            memptrace()
                .env("MEMPTRACE_DIE_IN_CALL", k.to_string())
                .args(["attach", "--probes", "jump", &pid.to_string(), "-o"])
                .arg(&db),
        );
        killed_at(tracer, pid, k);
        target.send("go\n");
        let end = target.finish();
        assert_eq!(end.code(), 0, "k = {k}: {:?}\n{}", end.status, end.stderr);
        assert!(end.stdout.contains("tracer 0"), "k = {k}: {}", end.stdout);
        assert!(end.stdout.contains(" 0 damaged"), "k = {k}: {}", end.stdout);
    }
}

/// SIGKILL of memptrace during the two calls that cannot go through the
/// stub in the trampoline area: the attach's first, which maps that area
/// (k = 1 to 3: the call set up, at its entry, at its exit), and the
/// detach's last, which unmaps it (k = 4 to 6). Both run through a copy of
/// the stub lent to the page padding after an image's code
/// (`MEMPTRACE_DIE_IN_LENT_STUB=k` counts only their moments): the thread
/// left with the call's registers runs the call, puts its own registers
/// back and goes on. In either probe mode: no probe is planted yet at the
/// first call, and none is left at the last. The victim's 8 threads
/// allocate all the time and check every block.
#[test]
fn sigkill_of_memptrace_in_the_first_or_last_injected_call() {
    for k in 1..=6 {
        let mut victim =
            Background::start(Command::new(tracee(Variant::Dynamic, "victim")).arg("8"));
        let pid: i32 = victim.wait_for("ready").parse().unwrap();
        let db = scratch(&format!("failopen-lent-{k}")).join("trace.db");
        let tracer = Background::start(
            memptrace()
                .env("MEMPTRACE_DIE_IN_LENT_STUB", k.to_string())
                .args(["attach", &pid.to_string(), "--duration", "1", "-o"])
                .arg(&db),
        );
        killed_at(tracer, pid, k);
        runs_on_unharmed(victim, k);
    }
}

/// memptrace killed (SIGKILL) while it detaches, at each moment of its way
/// out of the jump probes (`MEMPTRACE_DIE_IN_DETACH`, which also makes the
/// detach wait until a thread stands in a probe's code): the probes'
/// entries already hold their own bytes again; a thread let run out of a
/// probe is running, one stopped again sits in an interrupt stop, which
/// the kernel ends without a signal. The victim, whose 8 threads allocate
/// all the time and check every block, runs on, its allocator's code as it
/// was, and ends well. (A thread stepped out of a probe, as memptrace once
/// did, would sit in a SIGTRAP stop: its death killed the process.)
#[test]
fn sigkill_of_memptrace_while_it_detaches() {
    for k in [1, 2, 3] {
        let mut victim =
            Background::start(Command::new(tracee(Variant::Dynamic, "victim")).arg("8"));
        let pid: i32 = victim.wait_for("ready").parse().unwrap();
        let db = scratch(&format!("failopen-detach-{k}")).join("trace.db");
        let tracer = Background::start(
            memptrace()
                .env("MEMPTRACE_DIE_IN_DETACH", k.to_string())
                .args([
                    "attach",
                    "--probes",
                    "jump",
                    &pid.to_string(),
                    "--duration",
                    "1",
                    "-o",
                ])
                .arg(&db),
        );
        killed_at(tracer, pid, k);
        runs_on_unharmed(victim, k);
    }
}
