//! Return capture through the slots' call stubs, under the worst timing: the
//! trace ends (SIGTERM) while eight threads are inside allocator calls, or
//! between an entry and its stub, or at a return int3. Every thread must go
//! back to its caller unharmed and the program run on to its normal end.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rusqlite::{Connection, OpenFlags};

use crate::support::{Child, Variant, memptrace, scratch, tracee};

fn events_so_far(db: &std::path::Path) -> i64 {
    // The trace is being written (WAL): read what is committed, and never
    // create the file before memptrace does.
    if !db.exists() {
        return 0;
    }
    Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .and_then(|c| c.query_row("SELECT count(*) FROM events", [], |r| r.get(0)))
        .unwrap_or(0)
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
    // Wait until the threads are busy allocating under the trace.
    let deadline = Instant::now() + Duration::from_secs(60);
    while events_so_far(&db) < 2000 {
        assert!(
            Instant::now() < deadline,
            "{variant:?}: no events after 60 s"
        );
        assert!(
            child.0.try_wait().unwrap().is_none(),
            "{variant:?}: the trace ended before it could be interrupted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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
