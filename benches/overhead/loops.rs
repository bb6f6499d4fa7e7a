//! The loop tables: the single-threaded loop (cost per call; per stop too
//! for the tools that stop the program) and the multithreaded one (whole
//! program), under memptrace in both probe modes with each way of taking
//! stacks, and under the other tools when they are installed.

use std::path::Path;

use crate::runs::{self, Load, Outcome, Tool, TraceFacts};
use crate::tables::{RingRow, Row};
use crate::{EVERY, Plan, median};

/// Labels the other tables find their rows by.
pub const JUMP: &str = "memptrace --probes jump";
pub const INT3: &str = "memptrace --probes int3";
pub const HEAPTRACK: &str = "heaptrack";

pub fn jump() -> Tool {
    Tool::memptrace(JUMP, &["--probes", "jump"])
}

pub fn int3() -> Tool {
    Tool::memptrace(INT3, &["--probes", "int3"])
}

pub fn heaptrack() -> Tool {
    Tool::external(HEAPTRACK, "heaptrack", &["-o", "{scratch}/heaptrack"])
}

/// Every tool of both tables but libunwind, which gets a shorter loop.
fn tools(plan: &Plan) -> Vec<Tool> {
    let every = EVERY.to_string();
    let mut tools = Vec::new();
    for probes in ["jump", "int3"] {
        let label = format!("memptrace --probes {probes}");
        tools.extend([
            Tool::memptrace(&label, &["--probes", probes]),
            Tool::memptrace(
                &format!("{label} --stack-every {EVERY}"),
                &["--probes", probes, "--stack-every", &every],
            ),
            Tool::memptrace(
                &format!("{label} --no-stacks"),
                &["--probes", probes, "--no-stacks"],
            ),
        ]);
    }
    if plan.external_tools {
        tools.extend([
            Tool::external(
                "ltrace -f -e malloc+free",
                "ltrace",
                &["-f", "-e", "malloc+free", "-o", "/dev/null"],
            ),
            heaptrack(),
            Tool::external("valgrind (memcheck)", "valgrind", &["-q"]),
            Tool::external(
                "valgrind --tool=dhat",
                "valgrind",
                &["-q", "--tool=dhat", "--dhat-out-file=/dev/null"],
            ),
        ]);
    }
    tools
}

/// The runs of both loops, round after round.
pub struct Loops {
    pub single: Load,
    /// libunwind walks the live stack with ptrace: a shorter loop.
    pub single_lu: Load,
    pub multi: Load,
    tools: Vec<Tool>,
    libunwind: Tool,
    plain_single: Vec<Outcome>,
    plain_single_lu: Vec<Outcome>,
    plain_multi: Vec<Outcome>,
    /// Per tool: its runs of the single-threaded and multithreaded loops.
    traced: Vec<(Vec<Outcome>, Vec<Outcome>)>,
    traced_lu: Vec<Outcome>,
}

/// What the loops gave, for the tables of loops and beyond.
pub struct LoopFigures {
    pub plain_single_s: f64,
    pub plain_multi_s: f64,
    pub plain_single_wall_s: f64,
    pub plain_multi_wall_s: f64,
    pub rows: Vec<Row>,
    /// The jump probes' runs of both loops: programs that outrun memptrace.
    pub ring: Vec<RingRow>,
    /// The trace of the single-threaded loop with jump probes, and its facts.
    pub st_trace: Option<(std::path::PathBuf, TraceFacts)>,
}

impl Loops {
    pub fn new(plan: &Plan) -> Loops {
        let tools = tools(plan);
        Loops {
            single: Load::Single {
                iterations: plan.single,
            },
            single_lu: Load::Single {
                iterations: plan.single_libunwind,
            },
            multi: Load::Multi {
                threads: plan.threads,
                iterations: plan.multi,
            },
            traced: vec![(Vec::new(), Vec::new()); tools.len()],
            tools,
            libunwind: Tool::memptrace(
                "memptrace --unwinder libunwind (int3 probes)",
                &["--probes", "int3", "--unwinder", "libunwind"],
            ),
            plain_single: Vec::new(),
            plain_single_lu: Vec::new(),
            plain_multi: Vec::new(),
            traced_lu: Vec::new(),
        }
    }

    /// One run of each loop, untraced and under each tool.
    pub fn round(&mut self, tracee: &Path, dir: &Path) -> Result<(), String> {
        let scratch = dir.join("plain");
        let plain = &Tool::Plain;
        self.plain_single
            .push(runs::run(tracee, self.single, plain, &scratch)?);
        self.plain_single_lu
            .push(runs::run(tracee, self.single_lu, plain, &scratch)?);
        self.plain_multi
            .push(runs::run(tracee, self.multi, plain, &scratch)?);
        for (i, tool) in self.tools.iter().enumerate() {
            if tool.missing().is_some() {
                continue;
            }
            let scratch = dir.join(format!("tool{i}"));
            let st = runs::run(tracee, self.single, tool, &scratch.join("st"))?;
            let mt = runs::run(tracee, self.multi, tool, &scratch.join("mt"))?;
            self.traced[i].0.push(st);
            self.traced[i].1.push(mt);
        }
        let scratch = dir.join("libunwind");
        self.traced_lu.push(runs::run(
            tracee,
            self.single_lu,
            &self.libunwind,
            &scratch,
        )?);
        Ok(())
    }

    /// Medians of the rounds, each memptrace trace checked.
    pub fn figures(&self) -> Result<LoopFigures, String> {
        let loop_s = |o: &Outcome| o.loop_s();
        let wall_s = |o: &Outcome| o.wall_s;
        let mut figures = LoopFigures {
            plain_single_s: median_of(&self.plain_single, loop_s),
            plain_multi_s: median_of(&self.plain_multi, loop_s),
            plain_single_wall_s: median_of(&self.plain_single, wall_s),
            plain_multi_wall_s: median_of(&self.plain_multi, wall_s),
            rows: Vec::new(),
            ring: Vec::new(),
            st_trace: None,
        };
        for (tool, (st, mt)) in self.tools.iter().zip(&self.traced) {
            let mut row = Row::new(tool);
            if let Some(program) = tool.missing() {
                row.note = format!("{program}: not installed");
                figures.rows.push(row);
                continue;
            }
            row.fill_single(st, figures.plain_single_s, self.single);
            row.fill_multi(
                mt,
                figures.plain_multi_s,
                figures.plain_multi_wall_s,
                self.multi,
            );
            if let Tool::Memptrace { .. } = tool {
                let (st_db, facts) = checked(tool, st, self.single)?;
                let (_, mt_facts) = checked(tool, mt, self.multi)?;
                row.note = stack_note(&facts, self.single);
                row.st_events = Some(facts.events);
                row.mt_events = Some(mt_facts.events);
                row.bytes_per_event = Some(facts.bytes as f64 / facts.events as f64);
                row.mt_bytes_per_event = Some(mt_facts.bytes as f64 / mt_facts.events as f64);
                if tool.label() == JUMP {
                    for (outcomes, load) in [(st, self.single), (mt, self.multi)] {
                        figures.ring.push(RingRow::new(
                            &format!("{} loop", loop_name(load)),
                            outcomes.last(),
                            load.calls(),
                        ));
                    }
                    figures.st_trace = Some((st_db, facts));
                }
            }
            figures.rows.push(row);
        }
        let mut row = Row::new(&self.libunwind);
        row.fill_single(
            &self.traced_lu,
            median_of(&self.plain_single_lu, loop_s),
            self.single_lu,
        );
        let (_, facts) = checked(&self.libunwind, &self.traced_lu, self.single_lu)?;
        row.note = format!(
            "{}; {} iterations",
            stack_note(&facts, self.single_lu),
            self.single_lu.pairs()
        );
        let after_int3 = figures
            .rows
            .iter()
            .position(|r| r.label.starts_with(INT3))
            .map_or(figures.rows.len(), |i| i + 1);
        figures.rows.insert(after_int3, row);
        Ok(figures)
    }
}

fn median_of(outcomes: &[Outcome], f: impl Fn(&Outcome) -> f64) -> f64 {
    median(outcomes.iter().map(f).collect())
}

/// "single-threaded" or "4-thread".
pub fn loop_name(load: Load) -> String {
    match load {
        Load::Single { .. } => "single-threaded".into(),
        Load::Multi { threads, .. } | Load::Fair { threads, .. } => format!("{threads}-thread"),
    }
}

/// The last run's trace, checked: every call of the loop, and the stacks
/// the tool's options promise.
fn checked(
    tool: &Tool,
    outcomes: &[Outcome],
    load: Load,
) -> Result<(std::path::PathBuf, TraceFacts), String> {
    let db = outcomes
        .last()
        .and_then(|o| o.db.clone())
        .ok_or_else(|| format!("{}: no trace", tool.label()))?;
    let facts = runs::check_trace(&db, load.pairs())?;
    check_stacks(tool, &facts, load)?;
    Ok((db, facts))
}

/// Stacks as each mode promises them, for every call of the loop: whole
/// stacks (main or the thread's start included) on every call, on every
/// `EVERY`th call of a call site, or none.
pub fn check_stacks(tool: &Tool, facts: &TraceFacts, load: Load) -> Result<(), String> {
    let want = if tool.has("--no-stacks") {
        0
    } else if tool.has("--stack-every") {
        // Per call site (one for malloc, one for free): the 1st, 11th, ...
        match load {
            Load::Single { iterations } => 2 * iterations.div_ceil(EVERY),
            // Threads share the call sites: only the total is known.
            Load::Multi { .. } | Load::Fair { .. } => 2 * load.pairs().div_ceil(EVERY),
        }
    } else {
        load.calls()
    };
    if facts.full_stacks != want {
        return Err(format!(
            "{}: {} calls with a full stack, {want} expected",
            tool.label(),
            facts.full_stacks
        ));
    }
    if want > 0 && facts.min_frames.unwrap_or(0) < load.frames() {
        return Err(format!(
            "{}: a stack of {:?} frames, {} or more expected",
            tool.label(),
            facts.min_frames,
            load.frames()
        ));
    }
    Ok(())
}

/// How the stacks of a checked trace look, for the notes column.
pub fn stack_note(facts: &TraceFacts, load: Load) -> String {
    match facts.min_frames {
        Some(frames) => format!(
            "{} of {} calls with a full stack, ≥ {frames} frames",
            facts.full_stacks,
            load.calls()
        ),
        None => format!("all {} calls recorded, no stacks", load.calls()),
    }
}
