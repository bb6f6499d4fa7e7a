//! What tracing costs, measured in one run (issue #4, docs/performance.md):
//!
//! ```text
//! cargo bench --bench overhead              # the full run, about 20 minutes
//! cargo bench --bench overhead -- --quick   # smaller loops, no 10 M-event run
//! ```
//!
//! 1. The bare cost of a ptrace stop: a tracee executing `int3` in a loop,
//!    the tracer doing waitpid, GETREGS, SETREGS, CONT (`bare.rs`), with a
//!    blocking wait and with memptrace's wait (polling, then blocking); and
//!    the price of each extra system call memptrace's stop path can make.
//! 2. memptrace per stop on a single-threaded loop of malloc + free, each
//!    eight frames deep (`tracee.c`): (traced loop time - untraced loop
//!    time) / stops, with 2 stops per malloc (entry, return) and 1 per free,
//!    for each way of taking stacks; the same loop under ltrace, heaptrack
//!    and valgrind when they are installed.
//! 3. The whole-program slowdown of a multithreaded allocation-heavy loop.
//! 4. The recorder alone (events/s), bytes per event of the databases, and
//!    memptrace's peak RSS for 10 M events.
//!
//! Every memptrace trace is checked: each malloc and free of the loop is in
//! the database, and the stacks have the frames they should. `cargo test`
//! runs this target without `--bench`: then it is a smoke test with tiny
//! loops (and no other tool), checking the same things in a second or two.

mod bare;
mod recorder;
mod report;
mod runs;

use std::path::{Path, PathBuf};
use std::process::Command;

use bare::{Extra, Wait};
use report::{Figures, Row};
use runs::{Load, Outcome, Tool};

/// The `loop_ns` figure the tracee prints.
pub fn loop_ns(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("loop_ns "))
        .and_then(|v| v.trim().parse().ok())
}

/// Sizes of one run of the benchmark.
#[derive(Clone, Copy, Debug)]
struct Plan {
    rounds: usize,
    bare_stops: u64,
    /// Repetitions of each system call timed on a stopped thread.
    syscall_calls: u32,
    single: u64,
    /// libunwind walks the live stack with ptrace: fewer iterations.
    single_libunwind: u64,
    threads: u32,
    multi: u64,
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
    external_tools: false,
    rss_events: 0,
    replay_events: 1_000,
};

/// `--stack-every` used by the benchmark.
const EVERY: u64 = 10;

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
    if let Err(err) = run(plan, bench) {
        eprintln!("overhead: {err}");
        std::process::exit(1);
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

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// The tools of the single-threaded and multithreaded comparisons.
fn tools(plan: &Plan) -> Vec<Tool> {
    let every = EVERY.to_string();
    let mut tools = vec![
        Tool::memptrace("memptrace (framehop stacks)", &[]),
        Tool::memptrace(
            &format!("memptrace --stack-every {EVERY}"),
            &["--stack-every", &every],
        ),
        Tool::memptrace("memptrace --no-stacks", &["--no-stacks"]),
    ];
    if plan.external_tools {
        tools.extend([
            Tool::external(
                "ltrace -f -e malloc+free",
                "ltrace",
                &["-f", "-e", "malloc+free", "-o", "/dev/null"],
            ),
            Tool::external("heaptrack", "heaptrack", &["-o", "{scratch}/heaptrack"]),
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

fn run(plan: Plan, bench: bool) -> Result<(), String> {
    let dir = work_dir();
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let tracee = build_tracee(&dir)?;
    let mut figures = Figures::new(plan.rounds);
    figures.load_before = report::load_average();

    let single = Load::Single {
        iterations: plan.single,
    };
    let single_lu = Load::Single {
        iterations: plan.single_libunwind,
    };
    let multi = Load::Multi {
        threads: plan.threads,
        iterations: plan.multi,
    };
    let libunwind = Tool::memptrace(
        "memptrace --unwinder libunwind",
        &["--unwinder", "libunwind"],
    );
    let tools = tools(&plan);
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
    let mut plain_single = Vec::new();
    let mut plain_single_lu = Vec::new();
    let mut plain_multi = Vec::new();
    let mut traced: Vec<(Vec<Outcome>, Vec<Outcome>)> = vec![(Vec::new(), Vec::new()); tools.len()];
    let mut traced_lu = Vec::new();
    let mut syscalls: Vec<Vec<(String, f64)>> = Vec::new();
    for round in 0..plan.rounds {
        eprintln!("overhead: round {} of {}", round + 1, plan.rounds);
        for (i, (_, wait, extra)) in bare_cases.iter().enumerate() {
            bare[i].push(bare::stop_cost(&tracee, plan.bare_stops, *wait, *extra)?);
        }
        syscalls.push(bare::syscall_costs(&tracee, plan.syscall_calls)?);
        let scratch = dir.join("plain");
        plain_single.push(runs::run(&tracee, single, &Tool::Plain, &scratch)?);
        plain_single_lu.push(runs::run(&tracee, single_lu, &Tool::Plain, &scratch)?);
        plain_multi.push(runs::run(&tracee, multi, &Tool::Plain, &scratch)?);
        for (i, tool) in tools.iter().enumerate() {
            if tool.missing().is_some() {
                continue;
            }
            let scratch = dir.join(format!("tool{i}"));
            let st = runs::run(&tracee, single, tool, &scratch.join("st"))?;
            let mt = runs::run(&tracee, multi, tool, &scratch.join("mt"))?;
            traced[i].0.push(st);
            traced[i].1.push(mt);
        }
        traced_lu.push(runs::run(
            &tracee,
            single_lu,
            &libunwind,
            &dir.join("libunwind"),
        )?);
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
    let plain_st = median(plain_single.iter().map(|o| o.loop_s).collect());
    let plain_st_lu = median(plain_single_lu.iter().map(|o| o.loop_s).collect());
    let plain_mt = median(plain_multi.iter().map(|o| o.loop_s).collect());
    let plain_mt_wall = median(plain_multi.iter().map(|o| o.wall_s).collect());
    figures.plain_single_s = plain_st;
    figures.plain_multi_s = plain_mt;
    figures.plain_multi_wall_s = plain_mt_wall;

    let mut st_trace = None;
    for (tool, (st, mt)) in tools.iter().zip(&traced) {
        let mut row = Row::new(tool.label());
        if let Some(program) = tool.missing() {
            row.note = format!("{program}: not installed");
            figures.rows.push(row);
            continue;
        }
        row.fill_single(st, plain_st, single.stops());
        row.fill_multi(mt, plain_mt, plain_mt_wall);
        if let Tool::Memptrace { .. } = tool {
            let facts =
                runs::check_trace(st.last().and_then(|o| o.db.as_deref()).unwrap(), single)?;
            let mt_facts =
                runs::check_trace(mt.last().and_then(|o| o.db.as_deref()).unwrap(), multi)?;
            check_stacks(tool, &facts, single)?;
            check_stacks(tool, &mt_facts, multi)?;
            row.note = report::stack_note(&facts, single);
            row.bytes_per_event = Some(facts.bytes as f64 / facts.events as f64);
            row.mt_bytes_per_event = Some(mt_facts.bytes as f64 / mt_facts.events as f64);
            if st_trace.is_none() {
                figures.rss.push((facts.events, facts.peak_rss_kib));
                st_trace = st.last().and_then(|o| o.db.clone());
            }
        }
        figures.rows.push(row);
    }
    let mut row = Row::new(libunwind.label());
    row.fill_single(&traced_lu, plain_st_lu, single_lu.stops());
    let facts = runs::check_trace(
        traced_lu.last().and_then(|o| o.db.as_deref()).unwrap(),
        single_lu,
    )?;
    check_stacks(&libunwind, &facts, single_lu)?;
    row.note = format!(
        "{}; {} iterations",
        report::stack_note(&facts, single_lu),
        plan.single_libunwind
    );
    figures.rows.insert(1, row);

    // 10 M events: memptrace's memory must not grow with them.
    let mut replay_source = st_trace.clone();
    if plan.rss_events > 0 {
        eprintln!("overhead: {} events for the peak RSS", plan.rss_events);
        let big = Load::Single {
            iterations: plan.rss_events / 2,
        };
        let tool = Tool::memptrace("memptrace", &[]);
        let outcome = runs::run(&tracee, big, &tool, &dir.join("rss"))?;
        let db = outcome.db.clone().unwrap();
        let facts = runs::check_trace(&db, big)?;
        check_stacks(&tool, &facts, big)?;
        figures.rss.push((facts.events, facts.peak_rss_kib));
        figures.rss_timeline = outcome.rss_kib.clone();
        figures.rss_bytes_per_event = Some(facts.bytes as f64 / facts.events as f64);
        replay_source = Some(db);
    }
    if let Some(source) = replay_source {
        let replay = recorder::replay(&source, &dir.join("replay.db"), plan.replay_events)?;
        figures.replay = Some(replay);
    }
    figures.load_after = report::load_average();
    figures.plan = format!(
        "single-threaded loop: {} x (malloc + free) = {} stops (libunwind: {} stops); \
         multithreaded loop: {} threads x {} x (malloc + free); bare: {} stops; \
         median of {} interleaved round(s)",
        plan.single,
        single.stops(),
        single_lu.stops(),
        plan.threads,
        plan.multi,
        plan.bare_stops,
        plan.rounds
    );
    print!("{}", figures.render(bench));
    Ok(())
}

/// Stacks as each mode promises them, for every call of the loop.
fn check_stacks(tool: &Tool, facts: &runs::TraceFacts, load: Load) -> Result<(), String> {
    let Tool::Memptrace { options, .. } = tool else {
        return Ok(());
    };
    let calls = 2 * load.pairs();
    let want = if options.iter().any(|o| o == "--no-stacks") {
        0
    } else if options.iter().any(|o| o == "--stack-every") {
        // Per call site (one for malloc, one for free): the 1st, 11th, ...
        match load {
            Load::Single { iterations } => 2 * iterations.div_ceil(EVERY),
            // Threads share the call sites: only the total is known.
            Load::Multi { .. } => 2 * load.pairs().div_ceil(EVERY),
        }
    } else {
        calls
    };
    if facts.full_stacks != want {
        return Err(format!(
            "{}: {} calls with a full stack, {want} expected",
            tool.label(),
            facts.full_stacks
        ));
    }
    if want > 0 && facts.min_frames.unwrap_or(0) < 8 {
        return Err(format!(
            "{}: a stack of {:?} frames, 8 or more expected",
            tool.label(),
            facts.min_frames
        ));
    }
    Ok(())
}
