//! Programs under a seccomp filter (tracee-tests/secexec.c): memptrace never
//! makes a system call the filter refuses, catches the calls another way
//! where it must, says so in `meta`, and the program's output and exit
//! status are its own. Run in the probe mode of the suite (`MEMPTRACE_PROBES`).

use crate::support::{
    Background, Trace, Variant, memptrace, probes, run, scratch, trace_program, tracee,
};

fn secexec() -> String {
    tracee(Variant::Dynamic, "secexec")
        .to_str()
        .unwrap()
        .to_string()
}

/// Trace `secexec args`: the program's exit status and memptrace's, and
/// stderr is the warnings `meta` keeps, each once.
fn trace(args: &[&str], options: &[&str]) -> Trace {
    let t = trace_program(&tracee(Variant::Dynamic, "secexec"), args, options);
    let said: String = warnings(&t)
        .iter()
        .map(|w| format!("memptrace: warning: {w}\n"))
        .collect();
    assert_eq!(t.run.stderr, said);
    assert_eq!(
        t.meta("exit_status").unwrap(),
        t.run.code().to_string(),
        "meta.exit_status is memptrace's exit status"
    );
    let unknown =
        t.int("SELECT count(*) FROM events WHERE op = 'free' AND ptr <> 0 AND alloc_id IS NULL");
    assert_eq!(unknown, 0, "frees of blocks never seen allocated");
    t
}

fn jumps() -> bool {
    probes() == "jump"
}

fn warnings(t: &Trace) -> Vec<String> {
    let mut stmt =
        t.db.prepare("SELECT value FROM meta WHERE key LIKE 'warning.%' ORDER BY key")
            .unwrap();
    stmt.query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// The program ended on its own, with exit status 3.
fn assert_exit_3(t: &Trace) {
    assert_eq!(t.run.code(), 3, "{}", t.run.stderr);
    assert_eq!(t.meta("exit_status").as_deref(), Some("3"));
    assert_eq!(
        t.meta("end_reason").as_deref(),
        Some("exited with status 3")
    );
}

/// memfd_create kills the program: the exec'd program's calls are caught
/// by int3 probes (jump probes need memory shared with memptrace).
#[test]
fn a_filter_that_kills_on_memfd_create() {
    let me = secexec();
    let t = trace(&["kill-memfd", "exec", &me, "none", "loop", "2000"], &[]);
    assert_exit_3(&t);
    t.assert_truth();
    let pid = t.meta("pid").unwrap();
    let refused = "cannot make the shared memory in the target: the thread's seccomp \
                   filter answers SECCOMP_RET_KILL_PROCESS to memfd_create";
    let warnings = warnings(&t);
    if jumps() {
        // secexec itself, before its filter, had jump probes.
        assert_eq!(
            t.meta("probe.libc.so.6:malloc"),
            Some(format!("jump; in process {pid}: int3: {refused}"))
        );
        assert_eq!(
            warnings,
            [format!(
                "process {pid}: jump probes cannot record without memory shared with \
                 memptrace, int3 probes catch its calls: {refused}"
            )]
        );
    } else {
        assert_eq!(t.meta("probe.libc.so.6:malloc").as_deref(), Some("int3"));
        assert!(
            warnings.iter().all(|w| w.ends_with(refused)),
            "{warnings:?}"
        );
    }
}

/// The case: a program that is not a tracee prints what it prints.
#[test]
fn perl_under_a_filter_that_kills_on_memfd_create() {
    let t = trace(
        &[
            "kill-memfd",
            "exec",
            "perl",
            "-e",
            "print \"hello\\n\"; exit 3",
        ],
        &[],
    );
    assert_exit_3(&t);
    assert_eq!(t.run.stdout, "hello\n");
    assert!(t.int("SELECT count(*) FROM events") > 0);
}

/// tgkill kills the program, under a filter installed before the exec or
/// by the program while the probes are live: jump probes record, and never
/// call tgkill (memptrace finds a full ring by polling).
#[test]
fn a_filter_that_kills_on_tgkill() {
    let me = secexec();
    // Enough calls to fill a jump probe's ring, most runs.
    let pairs = if jumps() { "1000000" } else { "20000" };
    for args in [
        &["no-tgkill", "exec", &me, "none", "loop", pairs][..],
        &["no-tgkill", "loop", pairs],
    ] {
        let t = trace(args, &[]);
        assert_exit_3(&t);
        t.assert_truth();
        assert_eq!(
            t.meta("probe.libc.so.6:malloc").as_deref(),
            Some(probes().as_str())
        );
        assert_eq!(warnings(&t), Vec::<String>::new());
    }
}

/// -f: a child whose memfd_create fails with EPERM is traced by int3 probes
/// (its parent made its shared memory before the filter).
#[test]
fn a_child_refused_memfd_create_is_traced_by_int3_probes() {
    let t = trace(&["eperm-memfd", "fork", "5000"], &["-f"]);
    assert_exit_3(&t);
    t.assert_truth();
    let pid: i64 = t.meta("pid").unwrap().parse().unwrap();
    let child = t.int(&format!(
        "SELECT count(DISTINCT pid) FROM events WHERE pid <> {pid}"
    ));
    assert_eq!(child, 1, "the child's calls are its own");
    let child = t.int(&format!("SELECT max(pid) FROM events WHERE pid <> {pid}"));
    if jumps() {
        let refused = "cannot make the shared memory in the target: the thread's seccomp \
                       filter answers SECCOMP_RET_ERRNO(1) to memfd_create";
        assert_eq!(
            t.meta("probe.libc.so.6:malloc"),
            Some(format!(
                "jump; in process {child}: int3: no memory shared with memptrace: {refused}"
            ))
        );
        assert_eq!(
            warnings(&t),
            [format!(
                "process {child}: jump probes cannot record without memory shared with \
                 memptrace, int3 probes catch its calls: {refused}"
            )]
        );
    } else {
        assert_eq!(t.meta("probe.libc.so.6:malloc").as_deref(), Some("int3"));
        assert_eq!(warnings(&t), Vec::<String>::new());
    }
}

/// Strict mode allows no call memptrace would add: an attach says so in one
/// line and leaves the process as it was, to run on to its own end.
#[test]
fn attach_to_a_process_in_strict_mode_leaves_it_unharmed() {
    let mut program = Background::interactive(
        std::process::Command::new(tracee(Variant::Dynamic, "secexec")).args(["strict", "wait"]),
    );
    let pid: i32 = program.wait_for("ready").parse().unwrap();
    program.wait_for("strict");
    let db = scratch("attach-strict").join("trace.db");
    let out = run(
        memptrace()
            .args(["attach", &pid.to_string(), "--duration", "1", "-o"])
            .arg(&db),
        b"",
    );
    assert_eq!(out.code(), 1, "{}", out.stderr);
    assert_eq!(
        out.stderr,
        format!(
            "memptrace: attaching to process {pid} given up (its allocator functions cannot be \
             hooked without a system call its seccomp filter may refuse: the thread is in strict \
             seccomp mode, which allows no call memptrace needs); the process was left as it was\n"
        )
    );
    assert!(!db.exists(), "no database for an attach that failed");
    program.send("still here\n");
    assert_eq!(program.wait_for("still here"), "");
    program.close_stdin();
    let end = program.finish();
    assert_eq!(end.code(), 3, "{}", end.stderr);
}
