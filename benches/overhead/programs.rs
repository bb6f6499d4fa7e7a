//! Whole programs, side by side in one run: Debian's sqlite3 shell running a
//! SQL script and python3 running a script (`programs/`), untraced, under
//! heaptrack and under memptrace with jump and with int3 probes; the wall
//! time of each whole command. With the benchmark's two loops, whose runs
//! the loop tables made, they make the table of whole programs.
//!
//! Both workloads are deterministic: every trace of one input must hold the
//! same number of events, whatever the probes; the benchmark fails when two
//! differ. Each traced program must also print what it prints untraced.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::loops::{self, HEAPTRACK, INT3, JUMP, LoopFigures, Loops};
use crate::runs::{self, Job, Load, Tool};
use crate::tables::{ProgramRow, Row, Wall, grouped};
use crate::{Plan, median};

/// Inputs of a workload: the one of every tool but int3 probes, and the
/// one int3 probes get (the same, or a smaller one so that a stop per call
/// does not take minutes).
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub full: u64,
    pub int3: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Program {
    /// The sqlite3 shell; the size is the table's rows.
    Shell,
    /// python3; the size is the records the script makes.
    Python,
}

/// A program with one input, and the tools that run it.
struct Workload {
    label: String,
    job: Job,
    tools: Vec<Tool>,
    /// Per tool, per round: the wall time.
    walls: Vec<Vec<f64>>,
    /// Every trace's events: (tool, events).
    events: Vec<(String, u64)>,
    /// What the program prints untraced.
    stdout: Option<Vec<u8>>,
    /// int3 probes run the program's smaller input instead, on the next row.
    int3_on_next_row: bool,
}

pub struct Programs {
    workloads: Vec<Workload>,
}

const SHELL_SQL: &str = include_str!("programs/shell.sql");
const OBJECTS_PY: &str = include_str!("programs/objects.py");

/// Debian's sqlite3 shell (the `sqlite3` package; scripts/deps installs it).
fn sqlite3() -> Result<PathBuf, String> {
    let debian = Path::new("/usr/bin/sqlite3");
    if debian.is_file() {
        return Ok(debian.into());
    }
    runs::which("sqlite3").ok_or_else(|| "sqlite3 not found: scripts/deps installs it".into())
}

/// The python3 interpreter itself (not a shim that would run a shell
/// first): Debian's, or the one python3 on PATH names.
fn python3() -> Result<PathBuf, String> {
    let debian = Path::new("/usr/bin/python3");
    if debian.is_file() {
        return Ok(debian.into());
    }
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .map_err(|e| format!("python3: {e}"))?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || path.is_empty() {
        return Err("python3 does not say where it is (sys.executable)".into());
    }
    Ok(path.into())
}

impl Program {
    fn label(self, size: u64) -> String {
        match self {
            Program::Shell => format!("sqlite3 shell, {} rows", grouped(size)),
            Program::Python => format!("python3 (PYTHONMALLOC=malloc), {} records", grouped(size)),
        }
    }

    fn job(self, size: u64, dir: &Path) -> Result<Job, String> {
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
            Ok::<_, String>(path)
        };
        Ok(match self {
            Program::Shell => {
                let script = write(
                    &format!("shell-{size}.sql"),
                    &SHELL_SQL.replace("{rows}", &size.to_string()),
                )?;
                let mut read = OsString::from(".read ");
                read.push(script);
                Job {
                    program: sqlite3()?,
                    args: vec![":memory:".into(), read],
                    env: Vec::new(),
                    own_figures: false,
                }
            }
            Program::Python => {
                let script = write("objects.py", OBJECTS_PY)?;
                Job {
                    program: python3()?,
                    // No site packages (fewer start-up calls), no .pyc
                    // written by one run and read by the next.
                    args: vec![
                        "-S".into(),
                        "-s".into(),
                        "-B".into(),
                        script.into(),
                        size.to_string().into(),
                    ],
                    env: vec![
                        ("PYTHONMALLOC".into(), "malloc".into()),
                        ("PYTHONHASHSEED".into(), "0".into()),
                    ],
                    own_figures: false,
                }
            }
        })
    }
}

impl Programs {
    pub fn new(plan: &Plan, dir: &Path) -> Result<Programs, String> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let mut workloads = Vec::new();
        for (program, sizes) in [
            (Program::Shell, plan.shell_rows),
            (Program::Python, plan.python_records),
        ] {
            let smaller = sizes.int3 != sizes.full;
            for size in [sizes.full, sizes.int3] {
                let mut tools = vec![Tool::Plain];
                if plan.external_tools {
                    tools.push(loops::heaptrack());
                }
                tools.push(loops::jump());
                let int3_on_next_row = smaller && size == sizes.full;
                if !int3_on_next_row {
                    tools.push(loops::int3());
                }
                workloads.push(Workload {
                    label: program.label(size),
                    job: program.job(size, dir)?,
                    walls: vec![Vec::new(); tools.len()],
                    tools,
                    events: Vec::new(),
                    stdout: None,
                    int3_on_next_row,
                });
                if !smaller {
                    break;
                }
            }
        }
        Ok(Programs { workloads })
    }

    /// One run of each program under each tool.
    pub fn round(&mut self, dir: &Path) -> Result<(), String> {
        for (w, workload) in self.workloads.iter_mut().enumerate() {
            for (t, tool) in workload.tools.iter().enumerate() {
                if tool.missing().is_some() {
                    continue;
                }
                let scratch = dir.join(format!("program{w}-tool{t}"));
                let outcome = runs::run_job(&workload.job, tool, &scratch)?;
                workload.walls[t].push(outcome.wall_s);
                match tool {
                    Tool::Plain => {
                        workload.stdout.get_or_insert(outcome.stdout);
                    }
                    Tool::Memptrace { .. } => {
                        if workload.stdout.as_ref() != Some(&outcome.stdout) {
                            return Err(format!(
                                "{} under {}: not the output of the untraced run",
                                workload.label,
                                tool.label()
                            ));
                        }
                        let db = outcome.db.as_deref().ok_or("no trace")?;
                        let events = runs::trace_events(db)?;
                        workload.events.push((tool.label().into(), events));
                        same_events(&workload.label, &workload.events)?;
                    }
                    Tool::External { .. } => {}
                }
            }
        }
        Ok(())
    }

    /// The table's rows of the programs, medians of the rounds.
    pub fn rows(&self) -> Vec<ProgramRow> {
        let mut rows = Vec::new();
        for workload in &self.workloads {
            let wall = |label: &str| {
                let Some(t) = workload.tools.iter().position(|t| t.label() == label) else {
                    let why = if workload.int3_on_next_row && label == INT3 {
                        "next row"
                    } else {
                        "not run"
                    };
                    return Wall::Missing(why.into());
                };
                match workload.tools[t].missing() {
                    Some(_) => Wall::Missing("not installed".into()),
                    None => Wall::Seconds(median(workload.walls[t].clone())),
                }
            };
            let events = |label: &str| {
                workload
                    .events
                    .iter()
                    .find(|(tool, _)| tool == label)
                    .map(|e| e.1)
            };
            rows.push(ProgramRow {
                label: workload.label.clone(),
                untraced_s: median(workload.walls[0].clone()),
                heaptrack: wall(HEAPTRACK),
                jump: wall(JUMP),
                int3: wall(INT3),
                jump_events: events(JUMP),
                int3_events: events(INT3),
            });
        }
        rows
    }
}

/// The whole-program rows of the two loops, from the loop tables' runs;
/// the jump and int3 traces of each loop must hold as many events.
pub fn loop_rows(loops: &Loops, figures: &LoopFigures) -> Result<Vec<ProgramRow>, String> {
    let find = |label: &str| figures.rows.iter().find(|r| r.label == label);
    let (heaptrack, jump, int3) = (find(HEAPTRACK), find(JUMP), find(INT3));
    let mut rows = Vec::new();
    for (load, plain_s) in [
        (loops.single, figures.plain_single_wall_s),
        (loops.multi, figures.plain_multi_wall_s),
    ] {
        let single = matches!(load, Load::Single { .. });
        let wall = |row: Option<&Row>| match row {
            None => Wall::Missing("not run".into()),
            Some(r) => match if single { r.st_wall_s } else { r.mt_wall_s } {
                Some(s) => Wall::Seconds(s),
                None => Wall::Missing("not installed".into()),
            },
        };
        let events =
            |row: Option<&Row>| row.and_then(|r| if single { r.st_events } else { r.mt_events });
        let label = format!(
            "{} loop, {} calls",
            loops::loop_name(load),
            grouped(load.calls())
        );
        let (jump_events, int3_events) = (events(jump), events(int3));
        if let (Some(j), Some(i)) = (jump_events, int3_events) {
            same_events(&label, &[(JUMP.into(), j), (INT3.into(), i)])?;
        }
        rows.push(ProgramRow {
            label,
            untraced_s: plain_s,
            heaptrack: wall(heaptrack),
            jump: wall(jump),
            int3: wall(int3),
            jump_events,
            int3_events,
        });
    }
    Ok(rows)
}

/// Every trace of one input holds as many events, whatever the probes.
fn same_events(label: &str, events: &[(String, u64)]) -> Result<(), String> {
    let Some((_, first)) = events.first() else {
        return Ok(());
    };
    if events.iter().all(|(_, n)| n == first) {
        return Ok(());
    }
    let counts: Vec<String> = events
        .iter()
        .map(|(tool, n)| format!("{tool}: {n}"))
        .collect();
    Err(format!(
        "{label}: the traces of one input differ ({}); jump and int3 probes must record the same calls",
        counts.join(", ")
    ))
}
