//! The trace file itself: it holds command lines and addresses of a
//! process, so only its owner may read it, side files included.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use crate::support::{Background, Variant, count_events, memptrace, open_trace, scratch, tracee};

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
        crate::support::wait_until("the first event is committed", || {
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
