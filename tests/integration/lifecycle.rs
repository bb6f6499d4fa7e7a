//! Attach and detach while the process makes threads and processes without
//! pause (tracee-tests/spawner.c): pthread_create (clone3, then clone), raw
//! clone3 and clone, fork, and vfork + exec. Every cycle must leave it
//! unharmed: each start routine run once, each clone returning the id of
//! the thread it made, each child ending as it should, no block damaged, no
//! byte or page of memptrace's left, and memptrace's own exit status 0.
//! Cycles end in turn by `--duration`, Ctrl-C and SIGTERM.

use crate::attach::trampoline_pages;
use crate::support::{
    Background, Variant, count_events, memptrace, open_trace, proc_status, scratch, tracee,
    without_death_warning,
};

/// How a cycle is ended.
#[derive(Clone, Copy, Debug)]
enum End {
    Duration,
    Interrupt,
    Terminate,
}

fn cycles(variant: Variant, how: &str, count: usize) {
    let mut spawner =
        Background::start(std::process::Command::new(tracee(variant, "spawner")).arg(how));
    let pid: i32 = spawner.wait_for("ready").parse().unwrap();
    let dir = scratch(&format!("lifecycle-{how}"));
    let ends = [End::Duration, End::Interrupt, End::Terminate];
    for cycle in 0..count {
        let end = ends[cycle % ends.len()];
        let db = dir.join(format!("{how}-{cycle}.db"));
        let mut cmd = memptrace();
        cmd.args(["attach", &pid.to_string(), "-o"]).arg(&db);
        if let End::Duration = end {
            cmd.args(["--duration", "1"]);
        }
        let mut tracer = Background::start(&mut cmd);
        match end {
            End::Duration => {}
            // Once calls are committed: the attach is over, the probes live.
            // (Or memptrace has ended: its exit status and stderr say why.)
            End::Interrupt | End::Terminate => {
                crate::support::wait_until("calls committed", || {
                    count_events(&db).is_some_and(|n| n > 0) || tracer.has_ended()
                });
                if tracer.has_ended() {
                    let out = tracer.finish();
                    panic!(
                        "{how} cycle {cycle} ({end:?}): memptrace ended before it was signalled: {:?} {}",
                        out.status, out.stderr
                    );
                }
                let sig = match end {
                    End::Interrupt => libc::SIGINT,
                    _ => libc::SIGTERM,
                };
                tracer.signal(sig);
            }
        }
        let out = tracer.finish();
        assert_eq!(
            out.code(),
            0,
            "{how} cycle {cycle} ({end:?}): {}",
            out.stderr
        );
        // (With int3 probes, the one line that says memptrace's death would
        // kill the process.)
        assert_eq!(
            without_death_warning(&out.stderr),
            "",
            "{how} cycle {cycle} ({end:?})"
        );
        assert_eq!(
            proc_status(pid, "TracerPid").as_deref(),
            Some("0"),
            "{how} cycle {cycle}"
        );
        assert_eq!(
            trampoline_pages(pid),
            Vec::<String>::new(),
            "{how} cycle {cycle}"
        );
    }
    spawner.signal(libc::SIGTERM);
    let out = spawner.finish();
    assert_eq!(out.stderr, "", "the spawner found damage");
    assert!(out.stdout.contains("\n0 damaged\n"), "{}", out.stdout);
    assert_eq!(out.code(), 0, "{}", out.stdout);
}

#[test]
fn attach_cycles_while_pthreads_come_and_go() {
    cycles(Variant::Dynamic, "pthread", 21);
}

#[test]
fn attach_cycles_while_raw_clone3_makes_threads() {
    cycles(Variant::Dynamic, "clone3", 21);
}

#[test]
fn attach_cycles_while_raw_clone_makes_threads() {
    cycles(Variant::Static, "clone", 9);
}

#[test]
fn attach_cycles_while_the_process_forks() {
    cycles(Variant::Dynamic, "fork", 21);
}

#[test]
fn attach_cycles_while_the_process_vforks_and_execs() {
    cycles(Variant::Dynamic, "vfork", 21);
}

#[test]
fn attach_cycles_on_static_and_musl_builds() {
    cycles(Variant::Static, "pthread", 6);
    cycles(Variant::Musl, "pthread", 6);
    cycles(Variant::Static, "vfork", 6);
    cycles(Variant::Musl, "clone3", 6);
}

/// SIGTERM at any moment of an attach, from memptrace's first instructions
/// to the running trace: memptrace ends with a whole trace (its end rows in
/// `meta`) or with none, the attach given up in one line, and the process
/// unharmed either way. Killed by the signal, as any program is, only
/// before it has made anything. (Before the fix, a SIGTERM while the
/// database was being made killed memptrace and left a database with a
/// rollback journal and no `meta` table.)
#[test]
fn a_signal_at_any_moment_of_an_attach_leaves_a_whole_trace_or_none() {
    use std::os::unix::process::ExitStatusExt;
    let mut spawner = Background::start(
        std::process::Command::new(tracee(Variant::Dynamic, "spawner")).arg("pthread"),
    );
    let pid: i32 = spawner.wait_for("ready").parse().unwrap();
    let dir = scratch("lifecycle-any-moment");
    let delays_ms = [0, 1, 2, 4, 8, 15, 30, 60, 120, 250, 500];
    for (cycle, delay) in delays_ms.into_iter().enumerate() {
        let db = dir.join(format!("{cycle}.db"));
        let tracer = Background::start(
            memptrace()
                .args(["attach", &pid.to_string(), "-o"])
                .arg(&db),
        );
        std::thread::sleep(std::time::Duration::from_millis(delay));
        tracer.signal(libc::SIGTERM);
        let out = tracer.finish();
        let what = format!("SIGTERM after {delay} ms: {:?} {}", out.status, out.stderr);
        for leftover in ["db-journal", "db-wal"] {
            assert!(!db.with_extension(leftover).exists(), "{leftover}: {what}");
        }
        match out.status.code() {
            None => {
                assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{what}");
                assert!(!db.exists(), "killed after making a database: {what}");
            }
            Some(0) => {
                let trace = open_trace(&db, out);
                assert!(trace.meta("ended_at").is_some(), "{what}");
                assert_eq!(
                    trace.meta("end_reason").as_deref(),
                    Some("detached: memptrace received SIGTERM"),
                    "{what}"
                );
            }
            Some(1) => {
                assert_eq!(out.stderr.lines().count(), 1, "{what}");
                assert!(out.stderr.contains("given up"), "{what}");
                assert!(!db.exists(), "a database for an attach given up: {what}");
            }
            Some(_) => panic!("{what}"),
        }
        assert_eq!(
            proc_status(pid, "TracerPid").as_deref(),
            Some("0"),
            "{what}"
        );
        assert_eq!(trampoline_pages(pid), Vec::<String>::new(), "{what}");
    }
    spawner.signal(libc::SIGTERM);
    let out = spawner.finish();
    assert_eq!(out.stderr, "", "the spawner found damage");
    assert!(out.stdout.contains("\n0 damaged\n"), "{}", out.stdout);
    assert_eq!(out.code(), 0, "{}", out.stdout);
}
