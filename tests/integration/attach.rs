//! `memptrace attach`: trace a running process and leave it as it was, again
//! and again; and every way an attach can be refused.

use std::os::unix::fs::PermissionsExt;

use crate::support::{
    Background, Variant, memptrace, open_trace, proc_status, run, scratch, tracee, truth_of,
};

/// Anonymous executable mappings other than the vDSO, and shared anonymous
/// ones: memptrace's trampoline pages and stack buffers, if any were left
/// behind (the victim maps neither).
fn trampoline_pages(pid: i32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .filter(|l| {
            (l.contains(" r-xp 00000000 00:00 0") && !l.contains('['))
                || (l.contains(" rw-s ") && l.contains("/dev/zero"))
        })
        .map(str::to_string)
        .collect()
}

fn cycles(variant: Variant) {
    let mut victim =
        Background::start(std::process::Command::new(tracee(variant, "victim")).arg("8"));
    let pid: i32 = victim.wait_for("ready").parse().unwrap();
    assert_eq!(pid, victim.pid());
    let dir = scratch("cycles");
    for cycle in 0..10 {
        let db = dir.join(format!("attach-{cycle}.db"));
        let unwinder = if cycle % 2 == 0 {
            "framehop"
        } else {
            "libunwind"
        };
        let out = run(
            memptrace()
                .args([
                    "attach",
                    &pid.to_string(),
                    "--duration",
                    "0.3",
                    "--unwinder",
                    unwinder,
                    "-o",
                ])
                .arg(&db),
            b"",
        );
        assert_eq!(out.code(), 0, "cycle {cycle}: {}", out.stderr);
        assert_eq!(out.stderr, "", "cycle {cycle}");
        let t = open_trace(&db, out);
        assert_eq!(t.meta("mode").as_deref(), Some("attach"));
        assert_eq!(t.meta("pid"), Some(pid.to_string()));
        assert_eq!(t.meta("exit_status").as_deref(), Some("0"));
        assert!(t.meta("end_reason").unwrap().contains("--duration"));
        assert!(t.meta("command").unwrap().contains("victim"));
        // Every worker allocated while traced, with stacks through the
        // victim's own functions.
        let workers = t.int(
            "SELECT count(DISTINCT e.tid) FROM events e JOIN stacks s ON s.id = e.stack_id
             JOIN frames f ON f.id = s.frame_id WHERE f.function = 'victim_alloc'",
        );
        assert!(workers >= 1, "cycle {cycle}");
        // Every thread was seized: 8 workers, the sleeper, the main thread.
        assert_eq!(t.int("SELECT count(*) FROM threads"), 10, "cycle {cycle}");
        // Blocks allocated before the attach and freed during it are shown
        // as such, not as errors.
        let before = t
            .int("SELECT count(*) FROM allocations WHERE alloc_ns IS NULL AND free_ns IS NOT NULL");
        assert!(before > 0, "cycle {cycle}: frees of pre-attach blocks");
        // Gone without a trace: no tracer, no trampoline page.
        assert_eq!(proc_status(pid, "TracerPid").as_deref(), Some("0"));
        assert_eq!(trampoline_pages(pid), Vec::<String>::new(), "cycle {cycle}");
        let state = proc_status(pid, "State").unwrap();
        assert!(
            state.starts_with('S') || state.starts_with('R'),
            "cycle {cycle}: {state}"
        );
    }
    victim.signal(libc::SIGTERM);
    let out = victim.finish();
    assert_eq!(out.stderr, "", "the victim found damage");
    assert_eq!(out.code(), 0, "{}", out.stdout);
    assert!(out.stdout.contains(" 0 damaged"), "{}", out.stdout);
}

#[test]
fn ten_attach_detach_cycles_dynamic() {
    cycles(Variant::Dynamic);
}

#[test]
fn ten_attach_detach_cycles_static() {
    cycles(Variant::Static);
}

#[test]
fn ten_attach_detach_cycles_musl() {
    cycles(Variant::Musl);
}

/// The process ends while memptrace is attached: its end is recorded and
/// memptrace exits with its status.
#[test]
fn attached_process_exits() {
    let mut victim =
        Background::start(std::process::Command::new(tracee(Variant::Dynamic, "victim")).arg("2"));
    let pid: i32 = victim.wait_for("ready").parse().unwrap();
    let dir = scratch("attach-exit");
    let db = dir.join("trace.db");
    let mut tracer = Background::start(
        memptrace()
            .args(["attach", &pid.to_string(), "-o"])
            .arg(&db),
    );
    // Attached and hooked: its trampoline pages are there.
    crate::support::wait_until("memptrace hooked the process", || {
        !trampoline_pages(pid).is_empty()
    });
    victim.signal(libc::SIGTERM);
    let out = tracer.rest_of_stdout();
    assert_eq!(out, "");
    let run = tracer.finish();
    assert_eq!(run.code(), 0, "{}", run.stderr);
    let victim_run = victim.finish();
    let t = open_trace(&db, run);
    assert_eq!(
        t.meta("end_reason").as_deref(),
        Some("exited with status 0")
    );
    // Everything from the attach to the end: the victim's own frees at the
    // end (its 64 blocks per thread) are all there.
    let truth = truth_of(&victim_run.stdout);
    let frees = truth
        .iter()
        .find(|c| c.function == "victim_free")
        .unwrap()
        .calls;
    let recorded = t.recorded("victim_free", "free").calls;
    assert!(recorded > 0 && recorded <= frees, "{recorded} of {frees}");
}

/// Run `memptrace attach` with `args`; check the one-line refusal.
fn refused(args: &[&str], says: &str) {
    let dir = scratch("attach-refused");
    let db = dir.join("trace.db");
    let out = run(memptrace().arg("attach").args(args).arg("-o").arg(&db), b"");
    assert_eq!(out.code(), 1, "{}", out.stderr);
    assert_eq!(out.stderr.lines().count(), 1, "{:?}", out.stderr);
    assert!(
        out.stderr.contains(says),
        "{:?} does not say {says:?}",
        out.stderr
    );
    assert!(!db.exists(), "no database for an attach that failed");
}

#[test]
fn attach_refusals() {
    // pid_max is at most 4194304 (2^22).
    refused(&["5000000"], "no process 5000000");

    let mut victim =
        Background::start(std::process::Command::new(tracee(Variant::Dynamic, "victim")).arg("2"));
    let pid: i32 = victim.wait_for("ready").parse().unwrap();
    // A thread id is not a process.
    let tid = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().to_str()?.parse::<i32>().ok())
        .find(|&t| t != pid)
        .unwrap();
    refused(
        &[&tid.to_string()],
        &format!("is a thread of process {pid}"),
    );

    // Somebody else is tracing it.
    let dir = scratch("attach-twice");
    let first = dir.join("first.db");
    let tracer = Background::start(
        memptrace()
            .args(["attach", &pid.to_string(), "-o"])
            .arg(&first),
    );
    crate::support::wait_until("the first memptrace attached", || {
        proc_status(pid, "TracerPid").is_some_and(|t| t != "0")
    });
    refused(
        &[&pid.to_string()],
        &format!("already traced by process {}", tracer.pid()),
    );
    tracer.signal(libc::SIGINT);
    let first_run = tracer.finish();
    assert_eq!(
        first_run.code(),
        0,
        "Ctrl-C ends an attach cleanly: {}",
        first_run.stderr
    );
    assert_eq!(
        open_trace(&first, first_run).meta("end_reason").as_deref(),
        Some("detached: interrupted (Ctrl-C)")
    );

    // Another user's process.
    let dir = scratch("attach-nobody");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let db = dir.join("trace.db");
    let out = run(
        std::process::Command::new("setpriv")
            .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
            .arg(env!("CARGO_BIN_EXE_memptrace"))
            .args(["attach", &pid.to_string(), "-o"])
            .arg(&db),
        b"",
    );
    assert_eq!(out.code(), 1, "{}", out.stderr);
    // What to do, and the system's reason once.
    assert_eq!(
        out.stderr,
        format!(
            "memptrace: not permitted to trace process {pid} (run memptrace as its owner or as root, and check kernel.yama.ptrace_scope: 1 allows tracing only your own children; set it to 0, or give memptrace the CAP_SYS_PTRACE capability): Operation not permitted (os error 1)\n"
        )
    );
    assert!(!db.exists());

    victim.signal(libc::SIGTERM);
    let out = victim.finish();
    assert_eq!(out.code(), 0, "{}{}", out.stdout, out.stderr);
}
