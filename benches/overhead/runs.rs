//! Running the tracee, plain or under a tool, and reading what it left: the
//! tracee's own loop time, the whole command's wall time and, for memptrace,
//! the database (checked: no call may be missing).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rusqlite::Connection;

/// A workload of the tracee (see tracee.c).
#[derive(Clone, Copy, Debug)]
pub enum Load {
    /// `st N`: N x (malloc through 8 frames, free through 8 frames).
    Single { iterations: u64 },
    /// `mt T N`: T threads, each N x (malloc, free).
    Multi { threads: u32, iterations: u64 },
}

impl Load {
    fn args(self) -> Vec<String> {
        match self {
            Load::Single { iterations } => vec!["st".into(), iterations.to_string()],
            Load::Multi {
                threads,
                iterations,
            } => vec!["mt".into(), threads.to_string(), iterations.to_string()],
        }
    }

    /// malloc calls = free calls made by the loop.
    pub fn pairs(self) -> u64 {
        match self {
            Load::Single { iterations } => iterations,
            Load::Multi {
                threads,
                iterations,
            } => u64::from(threads) * iterations,
        }
    }

    /// ptrace stops a breakpoint tracer needs: entry and return of malloc,
    /// entry of free.
    pub fn stops(self) -> u64 {
        3 * self.pairs()
    }
}

/// How the tracee runs.
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

/// One run's figures.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The tracee's loop, timed by itself.
    pub loop_s: f64,
    /// The whole command, start to exit (memptrace: until the database is closed).
    pub wall_s: f64,
    /// memptrace only: the database.
    pub db: Option<PathBuf>,
    /// The command's resident set (VmRSS, KiB) sampled every 100 ms.
    pub rss_kib: Vec<u64>,
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
    std::fs::create_dir_all(scratch).map_err(|e| e.to_string())?;
    let loop_file = scratch.join("loop_ns");
    let _ = std::fs::remove_file(&loop_file);
    let mut db = None;
    let mut cmd = match tool {
        Tool::Plain => Command::new(tracee),
        Tool::Memptrace { options, .. } => {
            let path = scratch.join("trace.db");
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_memptrace"));
            cmd.arg("-o")
                .arg(&path)
                .arg("--force")
                .args(options)
                .arg("--");
            cmd.arg(tracee);
            db = Some(path);
            cmd
        }
        Tool::External { program, args, .. } => {
            let mut cmd = Command::new(program);
            for arg in args {
                cmd.arg(arg.replace("{scratch}", &scratch.to_string_lossy()));
            }
            cmd.arg(tracee);
            cmd
        }
    };
    cmd.args(load.args())
        .env("LOOP_NS_FILE", &loop_file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
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
        return Err(format!("{} failed ({status}): {stderr}", tool.label()));
    }
    let text = std::fs::read_to_string(&loop_file)
        .map_err(|e| format!("{}: no loop time: {e}", tool.label()))?;
    let loop_ns = crate::loop_ns(&text).ok_or("no loop_ns line")?;
    Ok(Outcome {
        loop_s: loop_ns as f64 * 1e-9,
        wall_s,
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

/// Read a benchmark trace and check that every call of the loop is there:
/// `pairs` mallocs of 16..2015 bytes and as many frees of those blocks.
pub fn check_trace(db: &Path, load: Load) -> Result<TraceFacts, String> {
    let conn = Connection::open(db).map_err(|e| e.to_string())?;
    let int = |sql: &str| -> Result<i64, String> {
        conn.query_row(sql, [], |r| r.get::<_, Option<i64>>(0))
            .map(|v| v.unwrap_or(0))
            .map_err(|e| format!("{sql}: {e}"))
    };
    // The loop's blocks are 16..2015 bytes; stdio's buffer is 4 KiB.
    let mallocs =
        int("SELECT count(*) FROM events WHERE op = 'malloc' AND size BETWEEN 16 AND 2015")?;
    let frees = int(
        "SELECT count(*) FROM events f JOIN events a ON a.id = f.alloc_id
         WHERE f.op = 'free' AND a.op = 'malloc' AND a.size BETWEEN 16 AND 2015",
    )?;
    let want = load.pairs() as i64;
    if mallocs != want || frees != want {
        return Err(format!(
            "{}: {mallocs} mallocs and {frees} frees recorded, {want} of each made",
            db.display()
        ));
    }
    let lost = int("SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'lost_returns'")?;
    if lost != 0 {
        return Err(format!("{}: {lost} lost returns", db.display()));
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
        events: int("SELECT count(*) FROM events")? as u64,
        bytes: std::fs::metadata(db).map_err(|e| e.to_string())?.len(),
        peak_rss_kib: peak.and_then(|p| p.parse().ok()),
        full_stacks: full_stacks as u64,
        min_frames: min_depth.map(|d| d as u64 + 1),
    })
}
