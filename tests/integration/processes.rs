//! The program under memptrace is the program without it: libraries loaded
//! at start and by dlopen, children it forks, its signals, its standard
//! streams and its exit status.

use crate::support::{VARIANTS, Variant, memptrace, run, scratch, trace, trace_program, tracee};

#[test]
fn libraries_are_hooked_before_their_constructors_run() {
    let plugin = tracee(Variant::Dynamic, "libplugin.so");
    let t = trace(Variant::Dynamic, "dlopen", &[plugin.to_str().unwrap()], &[]);
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    t.assert_truth();
    for lib in ["libplugin.so", "libneeded.so", "libc.so.6"] {
        let n = t.int(&format!(
            "SELECT count(*) FROM modules WHERE path LIKE '%/{lib}'"
        ));
        assert_eq!(n, 1, "{lib} in modules");
    }
}

fn forks(variant: Variant) {
    let t = trace(variant, "forks", &[], &[]);
    // The tracee exits 0 only if every child (fork, vfork, posix_spawn,
    // system) ran unharmed and exited with the status it chose.
    assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
    t.assert_truth();
}

#[test]
fn forked_children_are_released_unharmed() {
    for variant in VARIANTS {
        forks(variant);
    }
}

#[test]
fn signals_reach_the_program() {
    for variant in VARIANTS {
        let t = trace(variant, "signals", &[], &[]);
        assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
        t.assert_truth();
    }
}

#[test]
fn exit_status_is_the_programs() {
    for variant in [Variant::Dynamic, Variant::Musl] {
        let t = trace(variant, "status", &["exit", "3"], &[]);
        assert_eq!(t.run.code(), 3);
        assert_eq!(t.meta("exit_status").as_deref(), Some("3"));
        assert_eq!(t.meta("exit_signal"), None);
        t.assert_truth();
    }
}

#[test]
fn death_by_signal_is_128_plus_n() {
    let t = trace(Variant::Dynamic, "status", &["abort"], &[]);
    assert_eq!(t.run.code(), 128 + libc::SIGABRT);
    assert_eq!(t.meta("exit_signal").as_deref(), Some("SIGABRT"));
    t.assert_truth();
    let t = trace(Variant::Static, "status", &["signal", "9"], &[]);
    assert_eq!(t.run.code(), 128 + 9);
    assert_eq!(t.meta("exit_signal").as_deref(), Some("SIGKILL"));
    assert!(t.meta("end_reason").unwrap().contains("SIGKILL"));
}

/// stdin, stdout and stderr are the program's own.
#[test]
fn standard_streams_pass_through() {
    let dir = scratch("streams");
    let db = dir.join("trace.db");
    let out = run(
        memptrace()
            .arg("-o")
            .arg(&db)
            .args(["--", "sh", "-c", "cat; echo to-stderr >&2; exit 7"]),
        b"hello from stdin\n",
    );
    assert_eq!(out.code(), 7);
    assert_eq!(out.stdout, "hello from stdin\n");
    assert_eq!(out.stderr, "to-stderr\n");
}

/// A program named without a slash is found in PATH, like a shell does, and
/// a real program of the system is traced: its events are all paired.
#[test]
fn traces_programs_found_in_path() {
    let t = trace_program(std::path::Path::new("ls"), &["-l", "/"], &[]);
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    t.assert_sound();
    assert!(t.int("SELECT count(*) FROM events WHERE op = 'malloc'") > 0);
    assert!(t.run.stdout.contains("usr"));
}

/// A traced program whose child (with `-f`) execs a binary with nothing
/// memptrace can hook (no C library at all) is not traced silently: the
/// child's process is named on stderr and in `meta`. (The program execing
/// it itself: `cli::warnings_are_stored_and_reported`.)
#[test]
fn a_child_with_nothing_to_hook_is_said() {
    let program = tracee(Variant::Static, "nolibc");
    let dir = scratch("exec-nolibc");
    let db = dir.join("trace.db");
    let mut traced = crate::support::Background::start(
        memptrace()
            .arg("-o")
            .arg(&db)
            .args(["-f", "--", "sh", "-c"])
            .arg(format!("{} & wait; echo parent done", program.display())),
    );
    let pid: i32 = traced.wait_for("ready").parse().unwrap();
    crate::support::signal(pid, libc::SIGTERM);
    assert_eq!(traced.wait_for("parent done"), "");
    let out = traced.finish();
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let warning = format!(
        "process {pid} ({}): no allocator function (malloc, free, ...) \
         found to hook in any of its images; its calls are not recorded",
        program.display()
    );
    assert_eq!(out.stderr, format!("memptrace: warning: {warning}\n"));
    let t = crate::support::open_trace(&db, out);
    assert_eq!(t.meta("warning.1"), Some(warning));
}
