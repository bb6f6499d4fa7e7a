//! `memptrace attach`: trace a running process and leave it as it was, again
//! and again; and every way an attach can be refused.

use std::os::unix::fs::PermissionsExt;

use crate::support::{
    Background, Variant, memptrace, open_trace, proc_status, run, scratch, tracee, truth_of,
};

/// Anonymous executable mappings other than the vDSO, and shared anonymous
/// ones: memptrace's trampoline pages and stack buffers, if any were left
/// behind (the victim maps neither).
pub fn trampoline_pages(pid: i32) -> Vec<String> {
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

/// The executable mappings of files in process `pid` whose bytes differ
/// from their file's (past the file's end, from zero): a probe's jump or
/// breakpoint, or the stub lent to page padding, left behind.
pub fn code_unlike_files(pid: i32) -> Vec<String> {
    use std::os::unix::fs::FileExt;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut unlike = Vec::new();
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 6 || !fields[1].contains('x') || !fields[5].starts_with('/') {
            continue;
        }
        let (start, end) = fields[0].split_once('-').unwrap();
        let start = u64::from_str_radix(start, 16).unwrap();
        let end = u64::from_str_radix(end, 16).unwrap();
        let offset = u64::from_str_radix(fields[2], 16).unwrap();
        let mut live = vec![0u8; (end - start) as usize];
        mem.read_exact_at(&mut live, start).unwrap();
        let mut file = vec![0u8; live.len()];
        let f = std::fs::File::open(fields[5]).unwrap();
        let mut done = 0;
        while done < file.len() {
            match f.read_at(&mut file[done..], offset + done as u64).unwrap() {
                0 => break,
                n => done += n,
            }
        }
        if let Some(at) = live.iter().zip(&file).position(|(a, b)| a != b) {
            unlike.push(format!("{} at {:#x}", fields[5], start + at as u64));
        }
    }
    unlike
}

/// Allocator calls (not inventory) committed to a trace being written.
pub fn calls_committed(db: &std::path::Path) -> i64 {
    let open =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY);
    open.and_then(|c| {
        c.busy_timeout(std::time::Duration::from_secs(2))?;
        c.query_row(
            "SELECT count(*) FROM events WHERE op <> 'inventory'",
            [],
            |r| r.get(0),
        )
    })
    .unwrap_or(0)
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
        // Traced until the first events are committed, then Ctrl-C: a
        // condition, not a timer (on a loaded machine the attach itself,
        // heap map included, can outlast a short --duration).
        let tracer = Background::start(
            memptrace()
                .args(["attach", &pid.to_string(), "--unwinder", unwinder, "-o"])
                .arg(&db),
        );
        crate::support::wait_until("calls committed", || calls_committed(&db) > 0);
        tracer.signal(libc::SIGINT);
        let out = tracer.finish();
        assert_eq!(out.code(), 0, "cycle {cycle}: {}", out.stderr);
        // int3 probes (libunwind unwinds a stopped thread): memptrace's
        // death would kill the victim, and the attach says so.
        if unwinder == "libunwind" || crate::support::probes() == "int3" {
            let warning = format!(
                "memptrace's death (SIGKILL, OOM, a crash) would kill process {pid} with SIGTRAP\n"
            );
            assert!(
                out.stderr
                    .starts_with("memptrace: warning: int3 probes at ")
                    && out.stderr.ends_with(&warning)
                    && out.stderr.lines().count() == 1,
                "cycle {cycle}: {}",
                out.stderr
            );
        } else {
            assert_eq!(out.stderr, "", "cycle {cycle}");
        }
        let t = open_trace(&db, out);
        assert_eq!(t.meta("mode").as_deref(), Some("attach"));
        assert_eq!(t.meta("pid"), Some(pid.to_string()));
        assert_eq!(t.meta("exit_status").as_deref(), Some("0"));
        assert!(
            t.meta("end_reason").unwrap().contains("interrupted"),
            "cycle {cycle}"
        );
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
        // Blocks allocated before the attach and freed during it: with
        // glibc, in the inventory taken at attach, which their frees pair
        // with; with musl (no heap map), shown as such, not as errors.
        let before = t
            .int("SELECT count(*) FROM allocations WHERE alloc_ns IS NULL AND free_ns IS NOT NULL");
        if variant.glibc() {
            let paired = t.int(
                "SELECT count(*) FROM allocations WHERE op = 'inventory' AND free_ns IS NOT NULL",
            );
            assert!(paired > 0, "cycle {cycle}: frees of inventory blocks");
            assert_eq!(
                t.int(
                    "SELECT count(*) FROM heap_snapshots WHERE moment = 'attach' AND error IS NULL"
                ),
                1
            );
            // A free of a block the inventory missed only when the map was
            // incomplete (an arena or the mmapped blocks caught mid-call),
            // or when a call was in flight at the attach: a thread stopped
            // inside malloc goes on, unrecorded, to take its block from free
            // memory (its tcache, a fastbin, a bin, top, or a new mapping),
            // at most one block per thread. A block in use at the attach is
            // never missed.
            let incomplete = t.int(
                "SELECT count(*) FROM heap_snapshots s WHERE s.moment = 'attach'
                 AND (s.mmapped_error IS NOT NULL OR EXISTS (SELECT 1 FROM heap_arenas a
                      WHERE a.snapshot_id = s.id AND (a.error IS NOT NULL OR a.locked))
                      OR s.narenas > (SELECT count(*) FROM heap_arenas a
                                      WHERE a.snapshot_id = s.id))",
            );
            if incomplete == 0 {
                // Each missed block, the thread that freed it, and the state
                // of the chunk that held it at the attach.
                let missed: Option<String> =
                    t.db.query_row(
                        "SELECT group_concat(printf('%#x %d %s', a.ptr, a.free_tid, coalesce((SELECT c.state
                             FROM heap_chunks c JOIN heap_snapshots s ON s.id = c.snapshot_id
                             WHERE s.moment = 'attach' AND a.ptr - 16 >= c.addr
                               AND a.ptr - 16 < c.addr + c.size), 'in no chunk')), ', ')
                         FROM allocations a WHERE a.alloc_ns IS NULL AND a.free_ns IS NOT NULL",
                        [],
                        |r| r.get(0),
                    )
                    .unwrap();
                // Free at the attach: cached, binned, top, or not yet part of
                // the heap (a block the call mapped).
                let from_free_memory = |m: &str| {
                    ["in use", "mmapped", "tcache struct"]
                        .iter()
                        .all(|state| !m.ends_with(&format!(" {state}")))
                };
                let missed = missed.unwrap_or_default();
                assert!(
                    before <= 10,
                    "cycle {cycle}: {before} frees the inventory missed (let through: {:?}, \
                     skipped records: {:?}): {missed}",
                    t.meta("let_through_calls"),
                    t.meta("skipped_records"),
                );
                assert!(
                    missed
                        .split(", ")
                        .filter(|m| !m.is_empty())
                        .all(from_free_memory),
                    "cycle {cycle}: the inventory missed blocks in use: {missed}"
                );
            }
        } else {
            assert!(before > 0, "cycle {cycle}: frees of pre-attach blocks");
            assert_eq!(
                t.int("SELECT count(*) FROM heap_snapshots WHERE error LIKE '%musl%'"),
                2,
                "cycle {cycle}: no heap map at attach and detach"
            );
        }
        // Gone without a trace: no tracer, no trampoline page.
        assert_eq!(proc_status(pid, "TracerPid").as_deref(), Some("0"));
        assert_eq!(trampoline_pages(pid), Vec::<String>::new(), "cycle {cycle}");
        assert_eq!(
            code_unlike_files(pid),
            Vec::<String>::new(),
            "cycle {cycle}"
        );
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

    // A process that has exited, not yet reaped by its parent (this test).
    let mut zombie = std::process::Command::new("true").spawn().unwrap();
    let zombie_pid = zombie.id() as i32;
    crate::support::wait_until("the child is a zombie", || {
        proc_status(zombie_pid, "State").is_some_and(|s| s.starts_with('Z'))
    });
    refused(
        &[&zombie_pid.to_string()],
        &format!("process {zombie_pid} has already exited"),
    );
    zombie.wait().unwrap();

    // A process whose main thread has exited while its other threads run.
    let mut headless = Background::start(
        std::process::Command::new(tracee(Variant::Dynamic, "victim")).args(["2", "leader-exits"]),
    );
    let headless_pid: i32 = headless.wait_for("ready").parse().unwrap();
    crate::support::wait_until("the main thread is a zombie", || {
        proc_status(headless_pid, "State").is_some_and(|s| s.starts_with('Z'))
    });
    refused(
        &[&headless_pid.to_string()],
        &format!("the main thread of process {headless_pid} has exited while 3 other thread(s)"),
    );
    assert_eq!(
        proc_status(headless_pid, "TracerPid").as_deref(),
        Some("0"),
        "left untraced"
    );
    headless.signal(libc::SIGKILL);
    headless.finish();

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
    // Ctrl-C once the attach is done (calls recorded): a Ctrl-C while the
    // threads are still being stopped gives the attach up instead.
    crate::support::wait_until("the first memptrace records calls", || {
        calls_committed(&first) > 0
    });
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

/// The lines of /proc/PID/maps: what an attach that gave up must leave as
/// it found.
fn maps(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap()
}

/// A static binary with no allocator to find: the attach is refused with the
/// launch's own error, at once, and the process runs on as it was.
#[test]
fn attach_to_a_static_binary_with_nothing_to_hook() {
    let program = tracee(Variant::Static, "nolibc");
    let dir = scratch("attach-nolibc");
    let launched = run(
        memptrace()
            .arg("-o")
            .arg(dir.join("launch.db"))
            .arg("--")
            .arg(&program),
        b"",
    );
    assert_eq!(launched.code(), 1, "{}", launched.stderr);
    assert_eq!(launched.stderr.lines().count(), 1, "{:?}", launched.stderr);

    let mut target = Background::start(&mut std::process::Command::new(&program));
    let pid: i32 = target.wait_for("ready").parse().unwrap();
    let before = maps(pid);
    let db = dir.join("attach.db");
    let out = run(
        memptrace()
            .args(["attach", &pid.to_string(), "-o"])
            .arg(&db),
        b"",
    );
    assert_eq!(out.code(), 1, "{}", out.stderr);
    assert_eq!(
        out.stderr, launched.stderr,
        "the launch's error, word for word"
    );
    assert!(!db.exists(), "no database for an attach that failed");
    assert_eq!(proc_status(pid, "TracerPid").as_deref(), Some("0"));
    assert!(proc_status(pid, "State").unwrap().starts_with('S'));
    assert_eq!(maps(pid), before);
}

/// Nothing to hook in any image of a running dynamic program (no C library):
/// the attach stops every thread, finds nothing, and lets the process go at
/// once, unchanged (memptrace used to wait forever for stops it had seen).
#[test]
fn attach_with_no_allocator_in_any_image() {
    let mut target = Background::start(&mut std::process::Command::new(tracee(
        Variant::Dynamic,
        "nolibc",
    )));
    let pid: i32 = target.wait_for("ready").parse().unwrap();
    let before = maps(pid);
    let dir = scratch("attach-nolibc-dyn");
    let db = dir.join("attach.db");
    let out = run(
        memptrace()
            .args(["attach", &pid.to_string(), "-o"])
            .arg(&db),
        b"",
    );
    assert_eq!(out.code(), 1, "{}", out.stderr);
    assert_eq!(
        out.stderr,
        format!(
            "memptrace: process {pid}: no allocator (malloc, free, ...) found in any of its images \
             (no symbol, no debug file, no C library signature matched); nothing to trace, the \
             process was left as it was\n"
        )
    );
    assert!(!db.exists());
    assert_eq!(proc_status(pid, "TracerPid").as_deref(), Some("0"));
    assert!(proc_status(pid, "State").unwrap().starts_with('S'));
    assert_eq!(
        maps(pid),
        before,
        "the trampoline page of the linker's hook is gone"
    );
}

/// A process whose cgroup is frozen: its threads cannot stop for memptrace.
/// The cgroup is thawed and removed on drop.
struct Frozen {
    dir: std::path::PathBuf,
    state: &'static str,
    thawed: &'static str,
}

impl Frozen {
    fn new(pid: i32) -> Frozen {
        // Named after this test process too: a cgroup left by one that was
        // killed (its drop never ran) is thawed and removed here.
        let name = format!("memptrace-test-{}-{pid}", std::process::id());
        // cgroup v1's freezer, or v2's cgroup.freeze (unified or pure v2).
        let candidates = [
            (
                "/sys/fs/cgroup/freezer",
                "freezer.state",
                "FROZEN",
                "THAWED",
            ),
            ("/sys/fs/cgroup/unified", "cgroup.freeze", "1", "0"),
            ("/sys/fs/cgroup", "cgroup.freeze", "1", "0"),
        ];
        for (root, state, _, thawed) in candidates {
            Frozen::sweep(std::path::Path::new(root), state, thawed);
        }
        for (root, state, frozen, thawed) in candidates {
            let dir = std::path::Path::new(root).join(&name);
            if std::fs::create_dir(&dir).is_err() {
                continue;
            }
            if !dir.join(state).exists() {
                // A v1 hierarchy of another controller, or not v2 at all.
                let _ = std::fs::remove_dir(&dir);
                continue;
            }
            let cgroup = Frozen { dir, state, thawed };
            std::fs::write(cgroup.dir.join("cgroup.procs"), pid.to_string()).unwrap();
            std::fs::write(cgroup.dir.join(state), frozen).unwrap();
            crate::support::wait_until("the cgroup is frozen", || {
                std::fs::read_to_string(cgroup.dir.join(state)).is_ok_and(|s| s.trim() == frozen)
            });
            return cgroup;
        }
        panic!("this test needs a cgroup freezer (cgroup v1 freezer or v2), as root");
    }
}

impl Frozen {
    /// Thaw and remove the cgroups under `root` whose test process is
    /// gone, and end the victims frozen in them.
    fn sweep(root: &std::path::Path, state: &'static str, thawed: &'static str) {
        let Ok(entries) = std::fs::read_dir(root) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(owner) = name
                .strip_prefix("memptrace-test-")
                .and_then(|rest| rest.split_once('-'))
                .and_then(|(owner, _)| owner.parse::<u32>().ok())
            else {
                continue;
            };
            if std::path::Path::new(&format!("/proc/{owner}")).exists() {
                continue;
            }
            let stale = Frozen {
                dir: entry.path(),
                state,
                thawed,
            };
            let procs = std::fs::read_to_string(stale.dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|p| p.parse::<i32>().ok()) {
                // SAFETY: plain system call; a victim gone meanwhile is fine.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            drop(stale);
        }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join(self.state), self.thawed);
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        let parent = self.dir.parent().unwrap().join("cgroup.procs");
        for pid in procs.lines() {
            let _ = std::fs::write(&parent, pid);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Threads that cannot stop (a frozen cgroup): the attach gives up after a
/// while, or at once on SIGTERM, Ctrl-C or the end of `--duration`, and the
/// process, once thawed, runs on untraced and unharmed.
#[test]
fn attach_to_a_frozen_process_gives_up() {
    let mut victim =
        Background::start(std::process::Command::new(tracee(Variant::Dynamic, "victim")).arg("2"));
    let pid: i32 = victim.wait_for("ready").parse().unwrap();
    let dir = scratch("attach-frozen");
    {
        let frozen = Frozen::new(pid);
        // Left alone: it waits a while for the threads, then says why.
        let out = run(
            memptrace()
                .args(["attach", &pid.to_string(), "-o"])
                .arg(dir.join("patience.db")),
            b"",
        );
        assert_eq!(out.code(), 1, "{}", out.stderr);
        assert_eq!(out.stderr.lines().count(), 1, "{:?}", out.stderr);
        assert!(
            out.stderr.starts_with(&format!(
                "memptrace: attaching to process {pid} given up (threads ["
            )) && out
                .stderr
                .ends_with("] did not stop within 2 s); the process was left as it was\n"),
            "{:?}",
            out.stderr
        );
        assert!(!dir.join("patience.db").exists());
        // Told to stop: at once.
        for (how, says) in [
            (libc::SIGTERM, "memptrace received SIGTERM"),
            (libc::SIGINT, "interrupted (Ctrl-C)"),
        ] {
            let db = dir.join(format!("signal-{how}.db"));
            let tracer = Background::start(
                memptrace()
                    .args(["attach", &pid.to_string(), "-o"])
                    .arg(&db),
            );
            crate::support::wait_until("memptrace seized the victim", || {
                proc_status(pid, "TracerPid").is_some_and(|t| t == tracer.pid().to_string())
            });
            tracer.signal(how);
            let out = tracer.finish();
            assert_eq!(out.code(), 1, "{}", out.stderr);
            assert_eq!(
                out.stderr,
                format!(
                    "memptrace: attaching to process {pid} given up ({says}); the process was \
                     left as it was\n"
                )
            );
            assert!(!db.exists());
        }
        let out = run(
            memptrace()
                .args(["attach", &pid.to_string(), "--duration", "0.2", "-o"])
                .arg(dir.join("duration.db")),
            b"",
        );
        assert_eq!(out.code(), 1, "{}", out.stderr);
        assert!(
            out.stderr.contains("(the --duration elapsed)"),
            "{:?}",
            out.stderr
        );
        drop(frozen);
    }
    // Thawed: untraced, still working, and it finds no damage.
    crate::support::wait_until("the victim is released", || {
        proc_status(pid, "TracerPid").as_deref() == Some("0")
    });
    let out = run(
        memptrace()
            .args(["attach", &pid.to_string(), "--duration", "0.3", "-o"])
            .arg(dir.join("after.db")),
        b"",
    );
    assert_eq!(
        out.code(),
        0,
        "a normal attach after the thaw: {}",
        out.stderr
    );
    victim.signal(libc::SIGTERM);
    let out = victim.finish();
    assert_eq!(out.stderr, "", "the victim found damage");
    assert_eq!(out.code(), 0, "{}", out.stdout);
    assert!(out.stdout.contains(" 0 damaged"), "{}", out.stdout);
}
