//! The command line as users type it, the trace file it writes (private:
//! it holds command lines and addresses of a process), and the warnings a
//! trace keeps.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use crate::support::{
    Background, Variant, count_events, memptrace, open_trace, run, scratch, trace_program, tracee,
    wait_until,
};

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{path:?}: {e}"))
        .permissions()
        .mode()
        & 0o777
}

fn side(db: &Path, suffix: &str) -> PathBuf {
    let mut path = db.as_os_str().to_owned();
    path.push(suffix);
    PathBuf::from(path)
}

/// The database and its -wal and -shm files are 0600 from the moment they
/// exist, under the usual umask 022 (which would make them 0644), and also
/// when an existing file is replaced with --force.
#[test]
fn trace_files_are_private() {
    let dir = scratch("private");
    let db = dir.join("trace.db");
    for force in [false, true] {
        if force {
            // An existing, world-readable file is replaced by a private one.
            std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let mut cmd = memptrace();
        cmd.arg("-o").arg(&db);
        if force {
            cmd.arg("--force");
        }
        cmd.arg("--")
            .arg(tracee(Variant::Dynamic, "ticker"))
            .arg("stdin");
        // SAFETY: umask(2) in the child before exec; async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::umask(0o022);
                Ok(())
            });
        }
        let mut tracer = Background::interactive(&mut cmd);
        tracer.send("\n");
        assert_eq!(tracer.wait_for("step"), "1");
        // The trace is being written: its events reach readers, and the
        // write-ahead log and shared-memory index exist.
        wait_until("the first event is committed", || {
            count_events(&db).is_some_and(|n| n > 0)
        });
        for file in [db.clone(), side(&db, "-wal"), side(&db, "-shm")] {
            assert_eq!(
                mode(&file),
                0o600,
                "{file:?} while tracing (force: {force})"
            );
        }
        tracer.close_stdin();
        let run = tracer.finish();
        assert_eq!(run.code(), 0, "{}", run.stderr);
        assert_eq!(mode(&db), 0o600, "the finished trace (force: {force})");
        open_trace(&db, run).assert_truth();
    }
}

/// `memptrace -o X.db attach PID`: the options of a trace before `attach`
/// work as well as after it.
#[test]
fn options_before_attach() {
    let mut victim =
        Background::start(std::process::Command::new(tracee(Variant::Dynamic, "victim")).arg("2"));
    let pid = victim.wait_for("ready");
    let dir = scratch("before-attach");
    let db = dir.join("x.db");
    let out = run(
        memptrace().arg("-o").arg(&db).args([
            "--duration",
            "0.2",
            "--max-depth",
            "7",
            "attach",
            &pid,
        ]),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    assert_eq!(crate::support::without_death_warning(&out.stderr), "");
    let t = open_trace(&db, out);
    assert_eq!(t.meta("mode").as_deref(), Some("attach"));
    assert_eq!(t.meta("pid"), Some(pid.clone()));
    assert_eq!(t.meta("max_depth").as_deref(), Some("7"));
    assert!(t.meta("end_reason").unwrap().contains("--duration"));
    assert!(t.int("SELECT count(*) FROM events") > 0);
    victim.signal(libc::SIGTERM);
    let end = victim.finish();
    assert_eq!(end.code(), 0, "{}{}", end.stdout, end.stderr);
}

/// Every warning memptrace prints is also a `meta` row (`warning.1`, ...)
/// and a line of `memptrace report`. Here: the program execs one with
/// nothing memptrace can hook (no C library at all), which runs until it is
/// killed.
#[test]
fn warnings_are_stored_and_reported() {
    let dir = scratch("warnings");
    let db = dir.join("trace.db");
    let program = tracee(Variant::Static, "nolibc");
    let mut traced = crate::support::Background::start(
        memptrace()
            .arg("-o")
            .arg(&db)
            .args(["--", "sh", "-c"])
            .arg(format!("exec {}", program.display())),
    );
    let pid: i32 = traced.wait_for("ready").parse().unwrap();
    crate::support::signal(pid, libc::SIGTERM);
    let out = traced.finish();
    assert_eq!(out.code(), 128 + libc::SIGTERM, "{}", out.stderr);
    let warning = format!(
        "process {pid} ({}): no allocator function (malloc, free, ...) found to hook in any of \
         its images; its calls are not recorded",
        program.display()
    );
    assert_eq!(out.stderr, format!("memptrace: warning: {warning}\n"));
    let t = open_trace(&db, out);
    assert_eq!(t.meta("warning.1").as_deref(), Some(warning.as_str()));
    assert_eq!(
        t.int("SELECT count(*) FROM meta WHERE key LIKE 'warning%'"),
        1
    );

    let text = run(memptrace().arg("report").arg(&db), b"");
    assert_eq!(text.code(), 0, "{}", text.stderr);
    assert!(
        text.stdout
            .lines()
            .any(|l| l == format!("  warning    {warning}")),
        "{}",
        text.stdout
    );
    let json = run(
        memptrace()
            .arg("report")
            .arg(&db)
            .args(["--format", "json"]),
        b"",
    );
    let json: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(json["trace"]["warnings"], serde_json::json!([warning]));

    // A trace without warnings has no such row and says nothing.
    let clean = trace_program(&tracee(Variant::Dynamic, "leaks"), &[], &[]);
    clean.assert_sound();
    assert_eq!(
        clean.int("SELECT count(*) FROM meta WHERE key LIKE 'warning%'"),
        0
    );
}
