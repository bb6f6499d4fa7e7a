//! Running a command, plain or under a tool, and reading what it left: the
//! whole command's wall time, the figures the benchmark's tracee prints about
//! its own loop and, for memptrace, the database (checked: no call may be
//! missing).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rusqlite::Connection;

/// A workload of the benchmark's tracee (see tracee.c).
#[derive(Clone, Copy, Debug)]
pub enum Load {
    /// `st N`: N x (malloc through 8 frames, free through 8 frames).
    Single { iterations: u64 },
    /// `mt T N`: T threads, each N x (malloc, free).
    Multi { threads: u32, iterations: u64 },
    /// `fair T MS`: T threads doing malloc + free flat out for MS
    /// milliseconds; how many times each is its own output.
    Fair { threads: u32, ms: u64 },
}

impl Load {
    fn args(self) -> Vec<OsString> {
        let args = match self {
            Load::Single { iterations } => vec!["st".into(), iterations.to_string()],
            Load::Multi {
                threads,
                iterations,
            } => vec!["mt".into(), threads.to_string(), iterations.to_string()],
            Load::Fair { threads, ms } => vec!["fair".into(), threads.to_string(), ms.to_string()],
        };
        args.into_iter().map(OsString::from).collect()
    }

    /// malloc calls = free calls made by the loop (a fixed-time loop counts
    /// them itself: see [`Own::iterations`]).
    pub fn pairs(self) -> u64 {
        match self {
            Load::Single { iterations } => iterations,
            Load::Multi {
                threads,
                iterations,
            } => u64::from(threads) * iterations,
            Load::Fair { .. } => 0,
        }
    }

    /// Allocator calls made by the loop.
    pub fn calls(self) -> u64 {
        2 * self.pairs()
    }

    /// ptrace stops a breakpoint tracer needs: entry and return of malloc,
    /// entry of free.
    pub fn stops(self) -> u64 {
        3 * self.pairs()
    }

    /// Frames of a whole stack of the loop's calls: alloc8 to alloc1, then
    /// main and libc's start (3 frames) or a thread's start (2 frames).
    pub fn frames(self) -> u64 {
        match self {
            Load::Single { .. } => 12,
            Load::Multi { .. } | Load::Fair { .. } => 11,
        }
    }
}

/// A command to run: the program, its arguments and its environment.
#[derive(Clone, Debug)]
pub struct Job {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: Vec<(String, OsString)>,
    /// The program writes figures of its own (the tracee: `loop_ns`...).
    pub own_figures: bool,
}

impl Job {
    /// The benchmark's tracee running `load`.
    pub fn tracee(tracee: &Path, load: Load) -> Job {
        Job {
            program: tracee.to_path_buf(),
            args: load.args(),
            env: Vec::new(),
            own_figures: true,
        }
    }
}

/// How a command runs.
#[derive(Clone, Debug)]
pub enum Tool {
    Plain,
    Memptrace {
        label: String,
        options: Vec<String>,
    },
    External {
        label: String,
        program: String,
        args: Vec<String>,
    },
}

impl Tool {
    pub fn memptrace(label: &str, options: &[&str]) -> Tool {
        Tool::Memptrace {
            label: label.into(),
            options: options.iter().map(|o| o.to_string()).collect(),
        }
    }

    pub fn external(label: &str, program: &str, args: &[&str]) -> Tool {
        Tool::External {
            label: label.into(),
            program: program.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
        }
    }

    pub fn label(&self) -> &str {
        match self {
            Tool::Plain => "untraced",
            Tool::Memptrace { label, .. } | Tool::External { label, .. } => label,
        }
    }

    /// Whether memptrace is given `option`.
    pub fn has(&self, option: &str) -> bool {
        matches!(self, Tool::Memptrace { options, .. } if options.iter().any(|o| o == option))
    }

    /// The tool stops the program at each call (int3 probes, libunwind,
    /// ltrace): its cost is also given per stop.
    pub fn stops(&self) -> bool {
        match self {
            Tool::Plain => false,
            Tool::Memptrace { .. } => self.has("int3") || self.has("libunwind"),
            Tool::External { program, .. } => program == "ltrace",
        }
    }

    /// The program an external tool needs, when it is not installed.
    pub fn missing(&self) -> Option<&str> {
        match self {
            Tool::External { program, .. } if which(program).is_none() => Some(program),
            _ => None,
        }
    }
}

/// The full path of `program` on PATH.
pub fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// What the tracee says about its own loop.
#[derive(Clone, Debug, Default)]
pub struct Own {
    pub loop_s: f64,
    /// Voluntary context switches in the loop: a thread slept (a ptrace
    /// stop, a jump probe waiting for room in its ring).
    pub sleeps: u64,
    /// Per thread, in a fixed-time loop: the iterations it made.
    pub iterations: Vec<u64>,
}

impl Own {
    fn parse(text: &str) -> Option<Own> {
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        };
        let number = |name: &str| field(name)?.trim().parse::<u64>().ok();
        let iterations = match field("iterations") {
            Some(counts) => counts
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?,
            None => Vec::new(),
        };
        Some(Own {
            loop_s: number("loop_ns")? as f64 * 1e-9,
            sleeps: number("sleeps")?,
            iterations,
        })
    }
}

/// One run's figures.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The whole command, start to exit (memptrace: until the database is closed).
    pub wall_s: f64,
    /// What the tracee printed about its loop, for a job with figures of its own.
    pub own: Option<Own>,
    /// What the program wrote on its stdout.
    pub stdout: Vec<u8>,
    /// memptrace only: the database.
    pub db: Option<PathBuf>,
    /// The command's resident set (VmRSS, KiB) sampled every 100 ms.
    pub rss_kib: Vec<u64>,
}

impl Outcome {
    /// The tracee's loop, timed by itself (NaN for a program without one).
    pub fn loop_s(&self) -> f64 {
        self.own.as_ref().map_or(f64::NAN, |o| o.loop_s)
    }
}

/// VmRSS of a process, in KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Run `tracee` with `load` under `tool`; `scratch` holds its files.
pub fn run(tracee: &Path, load: Load, tool: &Tool, scratch: &Path) -> Result<Outcome, String> {
    run_job(&Job::tracee(tracee, load), tool, scratch)
}

/// Run `job` under `tool`; `scratch` holds its files.
pub fn run_job(job: &Job, tool: &Tool, scratch: &Path) -> Result<Outcome, String> {
    std::fs::create_dir_all(scratch).map_err(|e| e.to_string())?;
    let own_file = scratch.join("loop_ns");
    let stdout_file = scratch.join("stdout");
    let _ = std::fs::remove_file(&own_file);
    let mut db = None;
    let mut cmd = match tool {
        Tool::Plain => Command::new(&job.program),
        Tool::Memptrace { options, .. } => {
            let path = scratch.join("trace.db");
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_memptrace"));
            cmd.arg("-o")
                .arg(&path)
                .arg("--force")
                .args(options)
                .arg("--")
                .arg(&job.program);
            db = Some(path);
            cmd
        }
        Tool::External { program, args, .. } => {
            let mut cmd = Command::new(program);
            for arg in args {
                cmd.arg(arg.replace("{scratch}", &scratch.to_string_lossy()));
            }
            cmd.arg(&job.program);
            cmd
        }
    };
    let stdout = std::fs::File::create(&stdout_file).map_err(|e| e.to_string())?;
    cmd.args(&job.args)
        .envs(job.env.iter().map(|(k, v)| (k, v)))
        .env("LOOP_NS_FILE", &own_file)
        // The probes are the ones each tool's options ask for.
        .env_remove("MEMPTRACE_PROBES")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("{cmd:?}: {e}"))?;
    let mut stderr = child.stderr.take().ok_or("no stderr")?;
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    // The resident set, sampled beside the run; the wait itself is exact.
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (done, pid) = (done.clone(), child.id());
        std::thread::spawn(move || {
            let mut rss = Vec::new();
            while !done.load(Ordering::Relaxed) {
                rss.extend(rss_kib(pid));
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            rss
        })
    };
    let status = child.wait().map_err(|e| e.to_string())?;
    let wall_s = started.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let rss = sampler.join().unwrap_or_default();
    let stderr = reader.join().unwrap_or_default();
    if !status.success() {
        return Err(format!(
            "{} on {} failed ({status}): {stderr}",
            tool.label(),
            job.program.display()
        ));
    }
    let own = if job.own_figures {
        let text = std::fs::read_to_string(&own_file)
            .map_err(|e| format!("{}: no loop time: {e}", tool.label()))?;
        Some(Own::parse(&text).ok_or_else(|| format!("{}: no loop figures", tool.label()))?)
    } else {
        None
    };
    Ok(Outcome {
        wall_s,
        own,
        stdout: std::fs::read(&stdout_file).map_err(|e| e.to_string())?,
        db,
        rss_kib: rss,
    })
}

/// What a memptrace database says about a run of the benchmark loop.
#[derive(Clone, Debug)]
pub struct TraceFacts {
    pub events: u64,
    pub bytes: u64,
    /// memptrace's peak resident set (meta `peak_rss_kib`).
    pub peak_rss_kib: Option<u64>,
    /// Calls of the loop recorded with a full stack (innermost frame alloc8
    /// or release8, eight frames or more).
    pub full_stacks: u64,
    /// Fewest frames on a full stack.
    pub min_frames: Option<u64>,
}

fn open(db: &Path) -> Result<Connection, String> {
    Connection::open(db).map_err(|e| format!("{}: {e}", db.display()))
}

fn int(conn: &Connection, sql: &str) -> Result<i64, String> {
    conn.query_row(sql, [], |r| r.get::<_, Option<i64>>(0))
        .map(|v| v.unwrap_or(0))
        .map_err(|e| format!("{sql}: {e}"))
}

/// The events of any trace, once it is known that no return was lost.
pub fn trace_events(db: &Path) -> Result<u64, String> {
    let conn = open(db)?;
    let lost = int(
        &conn,
        "SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'lost_returns'",
    )?;
    if lost != 0 {
        return Err(format!("{}: {lost} lost returns", db.display()));
    }
    Ok(int(&conn, "SELECT count(*) FROM events")? as u64)
}

/// Read a benchmark trace and check that every call of the loop is there:
/// `pairs` mallocs of 16..2015 bytes and as many frees of those blocks.
pub fn check_trace(db: &Path, pairs: u64) -> Result<TraceFacts, String> {
    let events = trace_events(db)?;
    let conn = open(db)?;
    // The loop's blocks are 16..2015 bytes; stdio's buffer is 4 KiB.
    let mallocs = int(
        &conn,
        "SELECT count(*) FROM events WHERE op = 'malloc' AND size BETWEEN 16 AND 2015",
    )?;
    let frees = int(
        &conn,
        "SELECT count(*) FROM events f JOIN events a ON a.id = f.alloc_id
         WHERE f.op = 'free' AND a.op = 'malloc' AND a.size BETWEEN 16 AND 2015",
    )?;
    if mallocs != pairs as i64 || frees != pairs as i64 {
        return Err(format!(
            "{}: {mallocs} mallocs and {frees} frees recorded, {pairs} of each made",
            db.display()
        ));
    }
    let (full_stacks, min_depth): (i64, Option<i64>) = conn
        .query_row(
            "SELECT count(*), min(s.depth) FROM events e
             JOIN stacks s ON s.id = e.stack_id JOIN frames f ON f.id = s.frame_id
             WHERE f.function IN ('alloc8', 'release8') AND s.depth >= 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .map_err(|e| e.to_string())?;
    let peak: Option<String> = conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'peak_rss_kib'",
            [],
            |r| r.get(0),
        )
        .ok();
    Ok(TraceFacts {
        events,
        bytes: std::fs::metadata(db).map_err(|e| e.to_string())?.len(),
        peak_rss_kib: peak.and_then(|p| p.parse().ok()),
        full_stacks: full_stacks as u64,
        min_frames: min_depth.map(|d| d as u64 + 1),
    })
}
