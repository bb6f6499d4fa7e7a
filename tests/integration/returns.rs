//! Return capture through the slots' call stubs, under the worst timing: the
//! trace ends (SIGTERM) while eight threads are inside allocator calls, or
//! between an entry and its stub, or at a return int3. Every thread must go
//! back to its caller unharmed and the program run on to its normal end.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rusqlite::Connection;

use crate::support::{Child, Variant, memptrace, scratch, tracee};

/// The threads of memptrace's child (the tracee), 0 while there is none.
fn tracee_threads(memptrace: u32) -> usize {
    let children = std::fs::read_to_string(format!("/proc/{memptrace}/task/{memptrace}/children"))
        .unwrap_or_default();
    let Some(tracee) = children.split_whitespace().next() else {
        return 0;
    };
    std::fs::read_dir(format!("/proc/{tracee}/task")).map_or(0, |d| d.count())
}

fn detach_mid_run(variant: Variant) {
    let dir = scratch("detach-mid-run");
    let db = dir.join("trace.db");
    let mut cmd: Command = memptrace();
    cmd.arg("-o")
        .arg(&db)
        .arg("--")
        .arg(tracee(variant, "threads"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = Child(cmd.spawn().unwrap());
    let mut stdout = child.0.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    // Wait until the eight threads exist: they start allocating together
    // (a barrier), each making 10 000 calls, seconds of work under a trace.
    let deadline = Instant::now() + Duration::from_secs(60);
    while tracee_threads(child.0.id()) < 9 {
        assert!(
            Instant::now() < deadline,
            "{variant:?}: no threads after 60 s"
        );
        assert!(
            child.0.try_wait().unwrap().is_none(),
            "{variant:?}: the trace ended before it could be interrupted"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    kill(Pid::from_raw(child.0.id() as i32), Signal::SIGTERM).unwrap();
    let status = child.0.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{variant:?}");
    // The program runs on untraced; its stdout closes when it ends.
    let out = reader.join().unwrap();
    assert!(
        out.contains("threads 8 10000"),
        "{variant:?}: the program did not reach its end:\n{out}"
    );
    let conn = Connection::open(&db).unwrap();
    let reason: String = conn
        .query_row("SELECT value FROM meta WHERE key = 'end_reason'", [], |r| {
            r.get(0)
        })
        .unwrap();
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
