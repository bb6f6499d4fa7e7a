//! What tracing costs, measured in one run (issues #4, #10 and #11,
//! docs/performance.md):
//!
//! ```text
//! cargo bench --bench overhead              # the full run, about 20 minutes
//! cargo bench --bench overhead -- --quick   # smaller inputs, no 10 M-event run
//! ```
//!
//! 1. The bare cost of a ptrace stop: a tracee executing `int3` in a loop,
//!    the tracer doing waitpid, GETREGS, SETREGS, CONT (`bare.rs`), with a
//!    blocking wait and with memptrace's wait (polling, then blocking); and
//!    the price of each extra system call memptrace's stop path can make.
//! 2. memptrace per call on a single-threaded loop of malloc + free, each
//!    eight frames deep (`tracee.c`): (traced loop time - untraced loop
//!    time) / calls, with jump probes and with int3 probes (per stop too:
//!    2 stops per malloc, 1 per free), for each way of taking stacks; the
//!    same loop under ltrace, heaptrack and valgrind when they are
//!    installed; then a multithreaded loop (`loops.rs`).
//! 3. Whole programs side by side: the sqlite3 shell and python3 running
//!    scripts, and both loops, untraced, under heaptrack and under
//!    memptrace with each probe kind (`programs.rs`).
//! 4. Fairness: per-thread progress of threads allocating flat out
//!    (`fairness.rs`); and loops that outrun memptrace, whose calls must
//!    all be in the trace (a full ring makes the program wait).
//! 5. The recorder alone (events/s), bytes per event of the databases, and
//!    memptrace's peak RSS for 10 M events.
//! 6. With `--scale` (and nothing else): issue 19's scale section
//!    (`scale/`): tracee-tests/scale.c at 1 M, 10 M and 100 M calls
//!    (`--scale-calls` to choose) under memptrace (full and `--aggregate`)
//!    and heaptrack; what reading each trace costs against heaptrack_print;
//!    real programs (python3, perl, node, java) and `make -j2` under `-f`.
//!
//! Every memptrace trace is checked: each malloc and free of a loop is in
//! the database with the stack its options promise, and the traces of one
//! program's input hold the same events with either probe kind. `cargo
//! test` runs this target without `--bench`: then it is a smoke test with
//! tiny inputs (and no other tool), checking the same things in seconds.

mod bare;
mod fairness;
mod loops;
mod programs;
mod recorder;
mod report;
mod runs;
mod scale;
mod tables;

use std::path::{Path, PathBuf};
use std::process::Command;

use bare::{Extra, Wait};
use loops::Loops;
use programs::{Programs, Sizes};
use report::Figures;
use runs::Load;
use tables::RingRow;

/// The `loop_ns` figure the tracee prints.
pub fn loop_ns(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("loop_ns "))
        .and_then(|v| v.trim().parse().ok())
}

/// Sizes of one run of the benchmark.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    rounds: usize,
    bare_stops: u64,
    /// Repetitions of each system call timed on a stopped thread.
    syscall_calls: u32,
    single: u64,
    /// libunwind walks the live stack with ptrace: fewer iterations.
    single_libunwind: u64,
    threads: u32,
    multi: u64,
    /// The sqlite3 shell's table rows and python3's records.
    shell_rows: Sizes,
    python_records: Sizes,
    /// How long the threads of the fairness run allocate.
    fair_ms: u64,
    external_tools: bool,
    rss_events: u64,
    replay_events: u64,
}

const FULL: Plan = Plan {
    rounds: 3,
    bare_stops: 100_000,
    syscall_calls: 100_000,
    single: 100_000,
    single_libunwind: 20_000,
    threads: 4,
    multi: 25_000,
    // About 1.5 M and 0.8 M allocator calls; int3 probes get about 0.30 M
    // and 0.16 M (a stop costs some 20 µs here).
    shell_rows: Sizes {
        full: 100_000,
        int3: 20_000,
    },
    python_records: Sizes {
        full: 30_000,
        int3: 5_000,
    },
    fair_ms: 2_000,
    external_tools: true,
    rss_events: 10_000_000,
    replay_events: 2_000_000,
};

const QUICK: Plan = Plan {
    rounds: 1,
    bare_stops: 20_000,
    syscall_calls: 20_000,
    single: 20_000,
    single_libunwind: 5_000,
    threads: 4,
    multi: 5_000,
    shell_rows: Sizes {
        full: 10_000,
        int3: 10_000,
    },
    python_records: Sizes {
        full: 3_000,
        int3: 3_000,
    },
    fair_ms: 1_000,
    external_tools: true,
    rss_events: 0,
    replay_events: 200_000,
};

/// `cargo test`: prove the benchmark works, fast.
const SMOKE: Plan = Plan {
    rounds: 1,
    bare_stops: 300,
    syscall_calls: 100,
    single: 200,
    single_libunwind: 50,
    threads: 2,
    multi: 100,
    // Two inputs for the shell, as in the full run.
    shell_rows: Sizes {
        full: 200,
        int3: 100,
    },
    python_records: Sizes { full: 10, int3: 10 },
    fair_ms: 50,
    external_tools: false,
    rss_events: 0,
    replay_events: 1_000,
};

/// `--stack-every` used by the benchmark.
pub const EVERY: u64 = 10;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bench = args.iter().any(|a| a == "--bench");
    let mut plan = match (bench, args.iter().any(|a| a == "--quick")) {
        (false, _) => SMOKE,
        (true, true) => QUICK,
        (true, false) => FULL,
    };
    if let Some(n) = value_of(&args, "--rss-events") {
        plan.rss_events = n;
    }
    // `--scale`: issue 19's scale section alone (an hour with 100 M calls).
    if bench && args.iter().any(|a| a == "--scale") {
        let mut scale = scale_plan(&args);
        if args.iter().any(|a| a == "--quick") {
            scale.calls.truncate(1);
            scale.real_rounds = scale.real_rounds.min(1);
        }
        match scale::run(&scale, &work_dir().join("scale")) {
            Ok(figures) => {
                progress("done");
                print!("{}", figures.render());
            }
            Err(err) => {
                eprintln!("overhead: {err}");
                std::process::exit(1);
            }
        }
        return;
    }
    if let Err(err) = run(plan, bench) {
        eprintln!("overhead: {err}");
        std::process::exit(1);
    }
}

/// Where the run is, on stderr, with the time since it started.
fn progress(what: &str) {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(std::time::Instant::now);
    eprintln!("overhead: {:6.1} s: {what}", start.elapsed().as_secs_f64());
}

/// The scale section's sizes: `--scale-calls 1000000,10000000` or 1 M, 10 M,
/// 100 M; `--scale-rounds N` rounds of the real programs (3; 0: none).
fn scale_plan(args: &[String]) -> scale::ScalePlan {
    let calls = args
        .iter()
        .position(|a| a == "--scale-calls")
        .and_then(|at| args.get(at + 1))
        .map(|list| list.split(',').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000_000, 10_000_000, 100_000_000]);
    scale::ScalePlan {
        calls,
        external: true,
        real_rounds: value_of(args, "--scale-rounds").map_or(3, |n| n as usize),
    }
}

fn value_of(args: &[String], name: &str) -> Option<u64> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1)?.parse().ok()
}

fn work_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("overhead")
}

fn build_tracee(dir: &Path) -> Result<PathBuf, String> {
    let tracee = dir.join("tracee");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/overhead/tracee.c");
    let out = Command::new("gcc")
        .args(["-O1", "-g", "-fno-optimize-sibling-calls", "-pthread", "-o"])
        .arg(&tracee)
        .arg(&source)
        .output()
        .map_err(|e| format!("gcc: {e} (scripts/deps installs it)"))?;
    if !out.status.success() {
        return Err(format!("gcc: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(tracee)
}

pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn run(plan: Plan, bench: bool) -> Result<(), String> {
    progress("building the tracee");
    let dir = work_dir();
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let tracee = build_tracee(&dir)?;
    let mut loops = Loops::new(&plan);
    let mut programs = Programs::new(&plan, &dir.join("programs"))?;
    let fair = Load::Fair {
        threads: plan.threads,
        ms: plan.fair_ms,
    };
    let mut figures = Figures::new(plan.rounds, loops.multi, fair);
    figures.load_before = report::load_average();
    let bare_cases = [
        ("bare stop, blocking waitpid", Wait::Block, Extra::default()),
        ("bare stop, memptrace's wait", Wait::Spin, Extra::default()),
        (
            "bare + 4 KiB stack copy (process_vm_readv)",
            Wait::Spin,
            Extra {
                read: 4 << 10,
                write: false,
            },
        ),
        (
            "bare + 32 KiB stack copy (process_vm_readv)",
            Wait::Spin,
            Extra {
                read: 32 << 10,
                write: false,
            },
        ),
        (
            "bare + 8-byte stack write (process_vm_writev)",
            Wait::Spin,
            Extra {
                read: 0,
                write: true,
            },
        ),
    ];

    // Rounds interleave every measurement, so a burst of load elsewhere on
    // the machine blurs all of them a little rather than one a lot.
    let mut bare: Vec<Vec<f64>> = vec![Vec::new(); bare_cases.len()];
    let mut syscalls: Vec<Vec<(String, f64)>> = Vec::new();
    for round in 0..plan.rounds {
        progress(&format!(
            "round {} of {}: bare stops",
            round + 1,
            plan.rounds
        ));
        for (i, (_, wait, extra)) in bare_cases.iter().enumerate() {
            bare[i].push(bare::stop_cost(&tracee, plan.bare_stops, *wait, *extra)?);
        }
        syscalls.push(bare::syscall_costs(&tracee, plan.syscall_calls)?);
        progress("loops");
        loops.round(&tracee, &dir)?;
        progress("whole programs");
        programs.round(&dir.join("programs"))?;
    }

    for ((label, _, _), values) in bare_cases.iter().zip(bare) {
        figures
            .bare
            .push((label.to_string(), median(values) * 1e-3));
    }
    for (i, (label, _)) in syscalls[0].iter().enumerate() {
        let values = syscalls.iter().map(|round| round[i].1).collect();
        figures.syscalls.push((label.clone(), median(values)));
    }
    let looped = loops.figures()?;
    figures.programs = programs.rows();
    figures
        .programs
        .extend(programs::loop_rows(&loops, &looped)?);
    figures.plain_single_s = looped.plain_single_s;
    figures.plain_multi_s = looped.plain_multi_s;
    figures.plain_multi_wall_s = looped.plain_multi_wall_s;
    figures.rows = looped.rows;
    figures.ring = looped.ring;
    let mut replay_source = None;
    if let Some((db, facts)) = looped.st_trace {
        figures.rss.push((facts.events, facts.peak_rss_kib));
        replay_source = Some(db);
    }
    progress("fairness");
    figures.fair = fairness::measure(&tracee, fair, &dir)?;

    // 10 M events: memptrace's memory must not grow with them.
    if plan.rss_events > 0 {
        progress(&format!("{} events for the peak RSS", plan.rss_events));
        let big = Load::Single {
            iterations: plan.rss_events / 2,
        };
        let tool = loops::jump();
        let outcome = runs::run(&tracee, big, &tool, &dir.join("rss"))?;
        let db = outcome.db.clone().ok_or("no trace")?;
        let facts = runs::check_trace(&db, big.pairs())?;
        loops::check_stacks(&tool, &facts, big)?;
        figures.ring.push(RingRow::new(
            &format!(
                "single-threaded loop, {} iterations (the peak-RSS run)",
                tables::grouped(big.pairs())
            ),
            Some(&outcome),
            big.calls(),
        ));
        figures.rss.push((facts.events, facts.peak_rss_kib));
        figures.rss_timeline = outcome.rss_kib.clone();
        figures.rss_bytes_per_event = Some(facts.bytes as f64 / facts.events as f64);
        replay_source = Some(db);
    }
    if let Some(source) = replay_source {
        let replay = recorder::replay(&source, &dir.join("replay.db"), plan.replay_events)?;
        figures.replay = Some(replay);
    }
    let mut scale_tables = String::new();
    if !bench {
        // The smoke test of the scale section: small, no other tool.
        let smoke = scale::ScalePlan {
            calls: vec![20_000],
            external: false,
            real_rounds: 0,
        };
        scale_tables = scale::run(&smoke, &dir.join("scale"))?.render();
    }
    progress("done");
    figures.load_after = report::load_average();
    figures.plan = format!(
        "single-threaded loop: {} x (malloc + free) = {} calls, {} stops with int3 probes \
         (libunwind: {} stops); multithreaded loop: {} threads x {} x (malloc + free); \
         sqlite3 shell: {} rows ({} with int3 probes); python3: {} records ({} with int3 \
         probes); fairness: {} threads for {} ms; bare: {} stops; median of {} interleaved \
         round(s)",
        plan.single,
        loops.single.calls(),
        loops.single.stops(),
        loops.single_lu.stops(),
        plan.threads,
        plan.multi,
        plan.shell_rows.full,
        plan.shell_rows.int3,
        plan.python_records.full,
        plan.python_records.int3,
        plan.threads,
        plan.fair_ms,
        plan.bare_stops,
        plan.rounds
    );
    print!("{}{scale_tables}", figures.render(bench));
    Ok(())
}
