//! The trace ends (SIGTERM to memptrace) while eight threads are inside
//! allocator calls, between an entry and its return, or inside a probe's
//! code: every thread must go back to its caller unharmed and the program
//! run on untraced. The victim checks every block it allocated and its own
//! system calls, and says whether anything was damaged.

use crate::support::{Background, Variant, memptrace, open_trace, proc_status, scratch, tracee};

fn detach_mid_run(variant: Variant) {
    let dir = scratch("detach-mid-run");
    let db = dir.join("trace.db");
    let mut traced = Background::start(
        memptrace()
            .arg("-o")
            .arg(&db)
            .arg("--")
            .arg(tracee(variant, "victim"))
            .arg("8"),
    );
    let pid: i32 = traced.wait_for("ready").parse().unwrap();
    // The eight workers allocate: their calls reach the database (it is
    // committed at least every 500 ms, and readable meanwhile).
    crate::support::wait_until("the workers' calls are recorded", || {
        rusqlite::Connection::open(&db)
            .and_then(|c| {
                c.query_row("SELECT count(DISTINCT tid) FROM events", [], |r| {
                    r.get::<_, i64>(0)
                })
            })
            .is_ok_and(|threads| threads >= 8)
    });
    crate::support::signal(traced.pid(), libc::SIGTERM);
    crate::support::wait_until("memptrace detached", || {
        proc_status(pid, "TracerPid").as_deref() == Some("0")
    });
    // The program runs on untraced; asked to end, it checks itself.
    crate::support::signal(pid, libc::SIGTERM);
    let run = traced.finish();
    assert_eq!(
        run.code(),
        128 + libc::SIGTERM,
        "{variant:?}: {}",
        run.stderr
    );
    assert!(
        run.stdout.contains(" 0 damaged"),
        "{variant:?}: the program found damage:\n{}",
        run.stdout
    );
    let t = open_trace(&db, run);
    let reason = t.meta("end_reason").unwrap();
    assert!(reason.starts_with("detached"), "{reason}");
}

#[test]
fn detach_while_threads_allocate_dynamic() {
    for _ in 0..2 {
        detach_mid_run(Variant::Dynamic);
    }
}

#[test]
fn detach_while_threads_allocate_static() {
    for _ in 0..2 {
        detach_mid_run(Variant::Static);
    }
}

#[test]
fn detach_while_threads_allocate_musl() {
    detach_mid_run(Variant::Musl);
}
