//! What every integration test needs: the tracees, built once per run for
//! each variant (dynamic, -static, -static-pie, musl -static), the real
//! memptrace binary run on them with a time limit, their ground truth, and
//! queries on the database memptrace wrote.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OptionalExtension, params};

/// How a tracee is linked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// `gcc`: a PIE that loads libc.so.6 through the dynamic linker.
    Dynamic,
    /// `gcc -static`: no dynamic linker, fixed addresses, no .eh_frame_hdr.
    Static,
    /// `gcc -static-pie`: static, but loaded at a random address.
    StaticPie,
    /// `musl-gcc -static`: musl's allocator (mallocng), no unwind info in libc.
    Musl,
}

pub const VARIANTS: [Variant; 4] = [
    Variant::Dynamic,
    Variant::Static,
    Variant::StaticPie,
    Variant::Musl,
];

/// Tracees built for every variant (see tracee-tests/README.md).
const TRACEES: [&str; 24] = [
    "api", "threads", "leaks", "deep", "forks", "status", "signals", "victim", "churn", "phases",
    "shrink", "ticker", "wrappers", "sigalloc", "outrun", "mapping", "resident", "heapmap",
    "spawner", "scribble", "cnames", "execs", "sigstack", "clib",
];

/// Tracees of the heap walker's untrusted input, of the attach's pauses
/// and of a large heap.
const MORE_TRACEES: [&str; 5] = ["hostile_heap", "gaps", "busyheap", "bigheap", "filler"];

/// Fixed flags: debug info for names and lines; -O1 with no sibling calls, so
/// each tracee function really calls the allocator and stays on the stack.
const CFLAGS: [&str; 4] = ["-O1", "-g", "-fno-optimize-sibling-calls", "-pthread"];

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::Dynamic => "dynamic",
            Variant::Static => "static",
            Variant::StaticPie => "static-pie",
            Variant::Musl => "musl",
        }
    }

    fn compiler(self) -> (&'static str, &'static [&'static str]) {
        match self {
            Variant::Dynamic => ("gcc", &[]),
            Variant::Static => ("gcc", &["-static"]),
            Variant::StaticPie => ("gcc", &["-static-pie"]),
            Variant::Musl => ("musl-gcc", &["-static"]),
        }
    }

    /// True for glibc builds (pvalloc exists; aligned_alloc is memalign).
    pub fn glibc(self) -> bool {
        self != Variant::Musl
    }

    /// True when the allocator is linked into the executable.
    pub fn is_static(self) -> bool {
        self != Variant::Dynamic
    }

    fn dir(self) -> PathBuf {
        work_dir().join("tracees").join(self.name())
    }
}

fn work_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

fn source_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tracee-tests")
}

/// Run a build command; panic with its output when it fails.
fn build(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("cannot run {cmd:?}: {e} (scripts/deps installs the compilers)")
    });
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn compile(variant: Variant, sources: &[&str], out: &Path, extra: &[&str]) {
    let (cc, link) = variant.compiler();
    let mut cmd = Command::new(cc);
    cmd.args(CFLAGS).args(link).arg("-o").arg(out);
    for s in sources {
        cmd.arg(source_dir().join(s));
    }
    cmd.args(extra);
    build(&mut cmd);
}

fn build_variant(variant: Variant) -> PathBuf {
    let dir = variant.dir();
    std::fs::create_dir_all(&dir).unwrap();
    for name in TRACEES.iter().chain(&MORE_TRACEES) {
        compile(variant, &[&format!("{name}.c")], &dir.join(name), &[]);
    }
    if variant == Variant::Musl {
        // musl's dynamic build of clib, against its libc.so.
        let mut cmd = Command::new("musl-gcc");
        cmd.args(CFLAGS)
            .arg("-o")
            .arg(dir.join("clib-dynamic"))
            .arg(source_dir().join("clib.c"));
        build(&mut cmd);
    }
    // No unwind tables, frame pointers: the unwinders' fallback. Without
    // its .debug_frame too, which would describe the code (-g).
    compile(
        variant,
        &["nocfi.c"],
        &dir.join("nocfi"),
        &[
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
            "-fno-omit-frame-pointer",
        ],
    );
    build(
        Command::new("objcopy")
            .arg("--remove-section=.debug_frame")
            .arg(dir.join("nocfi")),
    );
    match variant {
        Variant::Dynamic => {
            build(
                Command::new("g++")
                    .args(CFLAGS)
                    .arg("-o")
                    .arg(dir.join("cxx"))
                    .arg(source_dir().join("cxx.cpp")),
            );
            // A library loaded by dlopen, and one the program needs at start.
            for lib in ["plugin", "needed"] {
                compile(
                    variant,
                    &[&format!("{lib}.c")],
                    &dir.join(format!("lib{lib}.so")),
                    &["-fPIC", "-shared"],
                );
            }
            let libdir = format!("-L{}", dir.display());
            compile(
                variant,
                &["dlopen.c"],
                &dir.join("dlopen"),
                &[&libdir, "-lneeded", "-Wl,-rpath,$ORIGIN"],
            );
            compile(variant, &["noptrace.c"], &dir.join("noptrace"), &[]);
            compile(variant, &["secexec.c"], &dir.join("secexec"), &[]);
            compile(variant, &["failopen.c"], &dir.join("failopen"), &[]);
            // No C library: the dynamic linker is the only other image.
            compile(
                variant,
                &["nolibc.c"],
                &dir.join("nolibc"),
                &[
                    "-nostdlib",
                    "-fno-stack-protector",
                    "-Wl,--dynamic-linker=/lib64/ld-linux-x86-64.so.2",
                ],
            );
        }
        Variant::Static | Variant::StaticPie | Variant::Musl => stripped_builds(variant, &dir),
    }
    dir
}

/// Static binaries as they ship (tests/integration/stripped.rs): built
/// without unwind tables and without frame pointers (`nounwind`, from
/// deep.c: CFI only in `.debug_frame`); `strip -s` copies of `leaks`,
/// `deep`, `nounwind`, `threads` and `mapping` (`stripped-*`: no symbol, no
/// DWARF, no `.debug_frame`); and in `split/` the first three stripped,
/// each with its debug file beside it (`objcopy --only-keep-debug`, `--add-gnu-debuglink`).
/// Stripping moves no code: the unstripped builds name the stripped ones'
/// addresses. A static binary with no C library at all (`nolibc`) has no
/// allocator to find.
fn stripped_builds(variant: Variant, dir: &Path) {
    compile(
        variant,
        &["deep.c"],
        &dir.join("nounwind"),
        &[
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
            "-fomit-frame-pointer",
        ],
    );
    let split = dir.join("split");
    std::fs::create_dir_all(&split).unwrap();
    for name in ["leaks", "deep", "nounwind"] {
        let stripped = dir.join(format!("stripped-{name}"));
        build(
            Command::new("strip")
                .arg("-s")
                .arg("-o")
                .arg(&stripped)
                .arg(dir.join(name)),
        );
        let debug = split.join(format!("{name}.debug"));
        build(
            Command::new("objcopy")
                .arg("--only-keep-debug")
                .arg(dir.join(name))
                .arg(&debug),
        );
        build(
            Command::new("objcopy")
                .arg(format!("--add-gnu-debuglink={}", debug.display()))
                .arg(&stripped)
                .arg(split.join(name)),
        );
    }
    for name in ["threads", "mapping"] {
        build(
            Command::new("strip")
                .arg("-s")
                .arg("-o")
                .arg(dir.join(format!("stripped-{name}")))
                .arg(dir.join(name)),
        );
    }
    compile(
        variant,
        &["nolibc.c"],
        &dir.join("nolibc"),
        &["-nostdlib", "-fno-stack-protector"],
    );
    build(Command::new("strip").arg("-s").arg(dir.join("nolibc")));
}

/// The path of a tracee, building the variant's tracees on first use.
pub fn tracee(variant: Variant, name: &str) -> PathBuf {
    static BUILT: [OnceLock<PathBuf>; 4] = [const { OnceLock::new() }; 4];
    let index = VARIANTS.iter().position(|v| *v == variant).unwrap();
    BUILT[index]
        .get_or_init(|| build_variant(variant))
        .join(name)
}

/// A directory of its own for one test.
pub fn scratch(label: &str) -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = work_dir().join("runs").join(format!(
        "{label}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// How long one memptrace run may take before the test fails.
const TIME_LIMIT: Duration = Duration::from_secs(120);

/// What a finished run left behind.
pub struct Run {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn code(&self) -> i32 {
        self.status
            .code()
            .unwrap_or_else(|| panic!("the process was killed, no exit code: {:?}", self.status))
    }
}

/// A process that is killed when dropped, so no test leaves one behind.
pub struct Child(pub std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The memptrace binary under test, without the `DEBUGINFOD_URLS` of the
/// shell that runs the tests: no test asks a server it did not start.
pub fn memptrace() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_memptrace"));
    cmd.env_remove("DEBUGINFOD_URLS");
    cmd
}

/// A command started by [`spawn`], its output being collected.
pub struct Running {
    pub child: Child,
    writer: std::thread::JoinHandle<()>,
    out: std::thread::JoinHandle<Vec<u8>>,
    err: std::thread::JoinHandle<Vec<u8>>,
    what: String,
}

/// Start a command with stdin from `input`, collecting its output.
pub fn spawn(cmd: &mut Command, input: &[u8]) -> Running {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = Child(cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}")));
    let mut stdin = child.0.stdin.take().unwrap();
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        let _ = stdin.write_all(&input);
    });
    let mut stdout = child.0.stdout.take().unwrap();
    let mut stderr = child.0.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        s
    });
    Running {
        child,
        writer,
        out,
        err,
        what: format!("{cmd:?}"),
    }
}

impl Running {
    /// Wait for the end, within the time limit.
    pub fn finish(mut self) -> Run {
        let deadline = Instant::now() + TIME_LIMIT;
        let status = loop {
            if let Some(status) = self.child.0.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not finish within {TIME_LIMIT:?}",
                self.what
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        let _ = self.writer.join();
        Run {
            status,
            stdout: String::from_utf8_lossy(&self.out.join().unwrap()).into_owned(),
            stderr: String::from_utf8_lossy(&self.err.join().unwrap()).into_owned(),
        }
    }
}

/// Run a command to its end with stdin from `input`, within the time limit.
pub fn run(cmd: &mut Command, input: &[u8]) -> Run {
    spawn(cmd, input).finish()
}

/// A process running in the background, its stdout collected line by line.
pub struct Background {
    pub child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    stdout: Vec<String>,
    stderr: std::thread::JoinHandle<Vec<u8>>,
    /// Its stdin, when started with [`Background::interactive`].
    stdin: Option<std::process::ChildStdin>,
}

impl Background {
    /// Start `cmd` with stdout and stderr piped, stdin empty.
    pub fn start(cmd: &mut Command) -> Background {
        Background::with_stdin(cmd.stdin(Stdio::null()))
    }

    /// Start `cmd` with stdin, stdout and stderr piped: the test writes the
    /// program's input as it goes ([`Background::send`]).
    pub fn interactive(cmd: &mut Command) -> Background {
        Background::with_stdin(cmd.stdin(Stdio::piped()))
    }

    fn with_stdin(cmd: &mut Command) -> Background {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = Child(cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}")));
        let stdin = child.0.stdin.take();
        let stdout = child.0.stdout.take().unwrap();
        let mut stderr = child.0.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = stderr.read_to_end(&mut s);
            s
        });
        Background {
            child,
            lines,
            stdout: Vec::new(),
            stderr,
            stdin,
        }
    }

    /// Write `text` to the program's stdin.
    pub fn send(&mut self, text: &str) {
        use std::io::Write;
        let stdin = self
            .stdin
            .as_mut()
            .expect("started with Background::interactive");
        stdin.write_all(text.as_bytes()).unwrap();
        stdin.flush().unwrap();
    }

    /// Close the program's stdin: it reads end of file.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    pub fn pid(&self) -> i32 {
        self.child.0.id() as i32
    }

    /// Wait for a line of stdout that starts with `prefix`; return the rest.
    pub fn wait_for(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + TIME_LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no line {prefix:?} in {:?}", self.stdout));
            self.stdout.push(line.clone());
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }

    /// The lines of stdout read so far (by [`Background::wait_for`]).
    pub fn stdout_so_far(&self) -> String {
        self.stdout.iter().map(|l| format!("{l}\n")).collect()
    }

    /// The process has ended (its status is kept for [`Background::finish`]).
    pub fn has_ended(&mut self) -> bool {
        matches!(self.child.0.try_wait(), Ok(Some(_)))
    }

    /// Send a signal to the process.
    pub fn signal(&self, sig: i32) {
        signal(self.pid(), sig);
    }

    /// Wait for the process to end (within the time limit).
    pub fn finish(mut self) -> Run {
        self.stdin = None;
        let deadline = Instant::now() + TIME_LIMIT;
        let status = loop {
            if let Some(status) = self.child.0.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "the process did not end");
            std::thread::sleep(Duration::from_millis(5));
        };
        // Whatever the process wrote, up to the end of its stdout (which its
        // own children may hold open: wait for them too, within the limit).
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.stdout.push(line);
        }
        let stderr = std::mem::replace(&mut self.stderr, std::thread::spawn(Vec::new));
        Run {
            status,
            stdout: self.stdout.iter().map(|l| format!("{l}\n")).collect(),
            stderr: String::from_utf8_lossy(&stderr.join().unwrap()).into_owned(),
        }
    }

    /// Lines of stdout received so far, and everything until it closes.
    pub fn rest_of_stdout(&mut self) -> String {
        let deadline = Instant::now() + TIME_LIMIT;
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.stdout.push(line);
        }
        self.stdout.iter().map(|l| format!("{l}\n")).collect()
    }
}

/// kill(2), panicking on failure.
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: plain system call.
    let ret = unsafe { libc::kill(pid, sig) };
    assert_eq!(
        ret,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

/// A field of /proc/PID/status, e.g. `TracerPid`.
pub fn proc_status(pid: i32, field: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// Poll `cond` every few milliseconds until it holds, within the time limit.
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIME_LIMIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The number of events committed to a trace that may still be being
/// written, or None while it cannot be read.
pub fn count_events(path: &Path) -> Option<i64> {
    let conn =
        Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).ok()?;
    conn.busy_timeout(Duration::from_secs(2)).ok()?;
    conn.query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .ok()
}

/// Parse `truth` lines from a tracee's output.
pub fn truth_of(stdout: &str) -> Vec<Calls> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("truth "))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Calls {
                function: f[0].into(),
                op: f[1].into(),
                calls: f[2].parse().unwrap(),
                bytes: f[3].parse().unwrap(),
            }
        })
        .collect()
}

/// A finished trace: the run and its database.
pub struct Trace {
    pub run: Run,
    pub db: Connection,
    pub path: PathBuf,
}

/// Trace `program args` with memptrace `options` into a fresh database.
pub fn trace_program(program: &Path, args: &[&str], options: &[&str]) -> Trace {
    trace_program_env(program, args, options, &[])
}

/// The same, with variables `env` set for memptrace (debug knobs).
pub fn trace_program_env(
    program: &Path,
    args: &[&str],
    options: &[&str],
    env: &[(&str, &str)],
) -> Trace {
    let dir = scratch(program.file_name().unwrap().to_str().unwrap());
    let path = dir.join("trace.db");
    // Not cargo's LD_LIBRARY_PATH: static glibc copies it at start-up
    // (_dl_init_paths), so the program's own allocations, which golden
    // files show, would depend on where the checkout is.
    let run = run(
        memptrace()
            .env_remove("LD_LIBRARY_PATH")
            .envs(env.iter().copied())
            .arg("-o")
            .arg(&path)
            .args(options)
            .arg("--")
            .arg(program)
            .args(args),
        b"",
    );
    assert!(
        path.exists(),
        "memptrace wrote no database (exit {:?}): {}",
        run.status,
        run.stderr
    );
    let db = Connection::open(&path).unwrap();
    Trace { run, db, path }
}

/// Open a database memptrace wrote, for a run that is not a `Trace`.
pub fn open_trace(path: &Path, run: Run) -> Trace {
    assert!(path.exists(), "no database at {path:?}: {}", run.stderr);
    Trace {
        db: Connection::open(path).unwrap(),
        run,
        path: path.to_path_buf(),
    }
}

/// Trace a tracee and check what every trace must satisfy.
pub fn trace(variant: Variant, name: &str, args: &[&str], options: &[&str]) -> Trace {
    let t = trace_program(&tracee(variant, name), args, options);
    t.assert_sound();
    t
}

/// One `truth` line of a tracee: calls to `op` from `function`, bytes asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Calls {
    pub function: String,
    pub op: String,
    pub calls: i64,
    pub bytes: i64,
}

/// One `leak` line: blocks from `function` never freed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leak {
    pub function: String,
    pub blocks: i64,
    pub bytes: i64,
}

impl Trace {
    pub fn meta(&self, key: &str) -> Option<String> {
        self.db
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
            .unwrap()
    }

    /// One integer from a query.
    pub fn int(&self, sql: &str) -> i64 {
        self.db
            .query_row(sql, [], |r| r.get(0))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Invariants of every complete trace of a program that ran to its end.
    pub fn assert_sound(&self) {
        for key in [
            "command",
            "pid",
            "mode",
            "started_at",
            "ended_at",
            "exit_status",
            "version",
            "unwinder",
        ] {
            assert!(self.meta(key).is_some(), "meta has no {key}");
        }
        assert_eq!(
            self.meta("exit_status").unwrap(),
            self.run.code().to_string(),
            "meta.exit_status is memptrace's exit status"
        );
        // memptrace says nothing on a pipe unless something went wrong; the
        // tracees write nothing to stderr when all is well.
        assert_eq!(self.run.stderr, "", "stderr of a clean run");
        // A finished trace is one file: no write-ahead log left behind.
        for suffix in ["-wal", "-shm"] {
            let mut side = self.path.clone().into_os_string();
            side.push(suffix);
            assert!(!Path::new(&side).exists(), "{side:?} left behind");
        }
        // Every block freed was allocated under the trace: no lost event, and
        // glibc's release of a dead thread's cache is not taken for the program's.
        let unknown = self
            .int("SELECT count(*) FROM events WHERE op = 'free' AND ptr <> 0 AND alloc_id IS NULL");
        assert_eq!(unknown, 0, "frees of blocks never seen allocated");
        // Never an invented frame: every frame after the first is in an
        // image (memptrace checked it is just after a call there).
        let outside = self.int(
            "SELECT count(*) FROM stacks s JOIN frames f ON f.id = s.frame_id
             WHERE f.module_id IS NULL AND s.trust <> 'context'",
        );
        assert_eq!(outside, 0, "frames outside every image");
        assert!(
            self.meta("truncated_stacks").is_some(),
            "meta has no truncated_stacks"
        );
    }

    pub fn truth(&self) -> Vec<Calls> {
        truth_of(&self.run.stdout)
    }

    pub fn truth_leaks(&self) -> Vec<Leak> {
        self.run
            .stdout
            .lines()
            .filter_map(|l| l.strip_prefix("leak "))
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Leak {
                    function: f[0].into(),
                    blocks: f[1].parse().unwrap(),
                    bytes: f[2].parse().unwrap(),
                }
            })
            .collect()
    }

    /// Calls to `op` recorded with `function` as the innermost frame.
    pub fn recorded(&self, function: &str, op: &str) -> Calls {
        let (calls, bytes) = self
            .db
            .query_row(
                "SELECT count(*), coalesce(sum(e.size), 0)
                 FROM events e JOIN stacks s ON s.id = e.stack_id JOIN frames f ON f.id = s.frame_id
                 WHERE f.function = ?1 AND e.op = ?2",
                params![function, op],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        Calls {
            function: function.into(),
            op: op.into(),
            calls,
            bytes,
        }
    }

    /// Blocks allocated with `function` as the innermost frame, never freed.
    pub fn leaked(&self, function: &str) -> Leak {
        let (blocks, bytes) = self
            .db
            .query_row(
                "SELECT count(*), coalesce(sum(l.size), 0)
                 FROM leaks l JOIN stacks s ON s.id = l.alloc_stack_id JOIN frames f ON f.id = s.frame_id
                 WHERE f.function = ?1",
                [function],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        Leak {
            function: function.into(),
            blocks,
            bytes,
        }
    }

    /// Compare every truth line with the database, with `op_of` mapping the
    /// op a tracee called to the op memptrace can know it by.
    pub fn assert_truth_with(&self, op_of: impl Fn(&str) -> String) {
        let truth = self.truth();
        assert!(
            !truth.is_empty(),
            "the tracee stated no truth:\n{}",
            self.run.stdout
        );
        for want in truth {
            let want = Calls {
                op: op_of(&want.op),
                ..want
            };
            assert_eq!(self.recorded(&want.function, &want.op), want);
        }
        for want in self.truth_leaks() {
            assert_eq!(self.leaked(&want.function), want);
        }
    }

    pub fn assert_truth(&self) {
        self.assert_truth_with(str::to_string);
    }

    /// The function names along a stack, innermost first.
    pub fn stack_functions(&self, stack_id: i64) -> Vec<String> {
        let mut stmt = self
            .db
            .prepare(
                "WITH RECURSIVE walk(id, depth) AS (
                     SELECT ?1, 0
                     UNION ALL
                     SELECT s.parent_id, w.depth + 1 FROM stacks s JOIN walk w ON s.id = w.id
                     WHERE s.parent_id IS NOT NULL)
                 SELECT coalesce(f.function, '?') FROM walk w
                 JOIN stacks s ON s.id = w.id JOIN frames f ON f.id = s.frame_id
                 ORDER BY w.depth",
            )
            .unwrap();
        stmt.query_map([stack_id], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// The stacks of tracee-tests/deep.c, function by function: the chain
    /// `deep_inner ← deep_middle ← deep_outer ← main`, twenty frames of
    /// `deep_recurse` then `main`, and `deep_release ← main`. `what` names
    /// the trace in failures.
    pub fn assert_deep_stacks(&self, what: &str) {
        let stacks = self.stacks_from("deep_inner", "malloc");
        assert_eq!(
            stacks.len(),
            1,
            "{what}: one call site, one stack: {stacks:?}"
        );
        let functions = self.stack_functions(stacks[0]);
        assert_eq!(
            functions[..4],
            ["deep_inner", "deep_middle", "deep_outer", "main"],
            "{what}: {functions:?}"
        );
        let stacks = self.stacks_from("deep_recurse", "malloc");
        assert_eq!(stacks.len(), 1, "{what}");
        let functions = self.stack_functions(stacks[0]);
        assert!(
            functions[..20].iter().all(|f| f == "deep_recurse") && functions[20] == "main",
            "{what}: {functions:?}"
        );
        for stack in self.stacks_from("deep_release", "free") {
            assert_eq!(
                self.stack_functions(stack)[..2],
                ["deep_release", "main"],
                "{what}"
            );
        }
    }

    /// How each frame of a stack was found (`stacks.trust`), innermost first.
    pub fn stack_trust(&self, stack_id: i64) -> Vec<String> {
        let mut stmt = self
            .db
            .prepare(
                "WITH RECURSIVE up(id, parent_id, trust, n) AS (
                     SELECT id, parent_id, trust, 0 FROM stacks WHERE id = ?1
                     UNION ALL SELECT s.id, s.parent_id, s.trust, n + 1
                     FROM stacks s JOIN up ON s.id = up.parent_id)
                 SELECT trust FROM up ORDER BY n",
            )
            .unwrap();
        stmt.query_map([stack_id], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// Stacks of the events whose innermost frame is `function`.
    pub fn stacks_from(&self, function: &str, op: &str) -> Vec<i64> {
        let mut stmt = self
            .db
            .prepare(
                "SELECT DISTINCT e.stack_id FROM events e
                 JOIN stacks s ON s.id = e.stack_id JOIN frames f ON f.id = s.frame_id
                 WHERE f.function = ?1 AND e.op = ?2",
            )
            .unwrap();
        stmt.query_map(params![function, op], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }
}

/// memptrace's stderr without the one line an attach with int3 probes
/// prints (memptrace's death would kill the process: see `failopen`).
pub fn without_death_warning(stderr: &str) -> String {
    stderr
        .lines()
        .filter(|l| {
            !(l.starts_with("memptrace: warning: int3 probes at ")
                && l.contains("memptrace's death"))
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The probes the traces of this test run use: `MEMPTRACE_PROBES` (which
/// memptrace reads too), jump by default. `scripts/test` runs the suite
/// once with each.
pub fn probes() -> String {
    std::env::var("MEMPTRACE_PROBES").unwrap_or_else(|_| "jump".to_string())
}

/// The text of every `<text>` of an SVG that plotters drew, in order.
pub fn svg_texts(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the SVG is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter(|n| n.tag_name().name() == "text")
        .map(|n| {
            let text: String = n
                .descendants()
                .filter(|d| d.is_text())
                .filter_map(|d| d.text())
                .collect();
            text.trim().to_string()
        })
        .collect()
}

/// Every filled `<rect>` of an SVG that plotters drew: (width, height,
/// fill colour).
pub fn svg_rects(path: &Path) -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the SVG is well-formed XML");
    doc.descendants()
        .filter(|n| n.tag_name().name() == "rect")
        .map(|n| {
            let attr = |a| n.attribute(a).unwrap_or_default().to_string();
            (attr("width"), attr("height"), attr("fill"))
        })
        .collect()
}
