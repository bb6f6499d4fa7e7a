//! One run of memptrace, start to end: check the input, open the database,
//! start the program, trace it, name the addresses, close the database, and
//! work out the exit status. The order matters: nothing is created before the
//! input is known to be good, and the database has its `meta` rows from the
//! first moment it exists.

mod output;
mod recording;

pub use output::exit_status;

use std::ffi::OsString;
use std::time::Duration;

use crate::cli::{Config, TraceConfig};
use crate::error::Error;
use crate::os::pidfd::Pidfd;
use crate::os::procfs;
use crate::os::{launch, ptrace, signals};
use crate::program;
use crate::report;
use crate::report::heapmap::{HeapReport, HeapSource};
use crate::tracer::{Ending, TraceError, TraceOptions, Tracer};
use crate::wrappers::Wrappers;

use output::{discard, end_reason, meta_record, start_output};
use recording::Recording;

/// How often the tracer looks at its signals and flushes its records.
const TICK: Duration = Duration::from_millis(100);

/// Run a config; returns memptrace's exit status.
pub fn run(config: Config) -> Result<i32, Error> {
    match config {
        Config::Launch { trace, program } => launch(trace, program),
        Config::Attach {
            trace,
            pid,
            duration,
        } => attach(trace, pid, duration),
        Config::Report { trace, options } => {
            report::run_report(&trace, &options)?;
            Ok(0)
        }
        Config::Flamegraph { trace, options } => {
            report::run_flamegraph(&trace, &options)?;
            Ok(0)
        }
        Config::Plot { trace, options } => {
            report::run_plot(&trace, &options)?;
            Ok(0)
        }
        Config::Export { trace, options } => {
            report::run_export(&trace, &options)?;
            Ok(0)
        }
        Config::Window { trace, options } => {
            if options.from_ns > options.to_ns {
                return Err(Error::EmptyWindow {
                    from: crate::report::text::seconds(options.from_ns as i64),
                    to: crate::report::text::seconds(options.to_ns as i64),
                });
            }
            report::run_window(&trace, &options)?;
            Ok(0)
        }
        Config::Heapmap { source, options } => {
            match source {
                HeapSource::Pid(pid) => {
                    let map = crate::heap::read_process(pid, false, &Default::default())?;
                    report::show_heapmap(&HeapReport::of(pid.into(), &map), &options)?;
                }
                HeapSource::Trace { path, snapshot } => {
                    report::run_heapmap(&path, snapshot, &options)?
                }
            }
            Ok(0)
        }
        Config::Completions { shell } => {
            report::print(&crate::cli::manual::completions(shell))?;
            Ok(0)
        }
        Config::Manual { command } => {
            report::print(&crate::cli::manual::man_page(command.as_deref())?)?;
            Ok(0)
        }
    }
}

fn launch(config: TraceConfig, args: Vec<OsString>) -> Result<i32, Error> {
    // Signals first (blocked until the tracer waits for stops), threads
    // after: the threads inherit the blocked mask, and no Ctrl-C or SIGTERM
    // kills memptrace while it makes the database (it would leave one
    // without its meta rows).
    signals::install()?;
    let wrappers = Wrappers::new(&config.wrappers).map_err(Error::Wrapper)?;
    let program = program::resolve(&args[0])?;
    program::check(&program)?;
    let command = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let sink = start_output(&config, &command, "launch")?;
    let child = match launch::spawn(&program, &args) {
        Ok(child) => child,
        Err(err) => {
            drop(sink);
            discard(&config.output);
            return Err(if err.raw_os_error() == Some(libc::EPERM) {
                Error::PtraceDenied(err)
            } else {
                exec_error(program, err)
            });
        }
    };
    let recording = Recording::start(sink, child.pid, &config, wrappers)?;
    let tracer = Tracer::new(
        options(&config, None),
        recording.pipeline(&config),
        child.pid,
        recording.clock,
        recording.progress.clone(),
        recording.heap_facts.clone(),
    )?;
    recording.records.send(vec![meta_record(
        "on_memptrace_death",
        "killed with it: launched under memptrace (PTRACE_O_EXITKILL)".to_string(),
    )])?;
    let (mut ending, stats, pipeline) = recording.trace(tracer)?;
    let mut status = exit_status(&ending);
    if let Some(reason) = recording.halted(&ending) {
        // The database cannot grow: the program runs on untraced, to its
        // end, which is the trace's.
        eprintln!("memptrace: {reason}: the trace ends here; the program runs on untraced");
        let program = match ptrace::wait_exit(child.pid)? {
            ptrace::Stop::Killed { sig, core } => Ending::Killed { sig, core },
            ptrace::Stop::Exited(code) => Ending::Exited(code),
            _ => Ending::Exited(0),
        };
        status = exit_status(&program);
        ending = Ending::Detached {
            reason: format!(
                "{reason}; the program ran on untraced and {}",
                end_reason(&program)
            ),
        };
    }
    if ending == Ending::Exited(127) {
        if let Some(err) = child.exec_error() {
            // The program never ran: no trace of it is worth keeping.
            drop(pipeline);
            recording.abandon(&config.output);
            return Err(exec_error(program, err));
        }
    }
    recording.finish(&ending, status, &stats, pipeline)?;
    Ok(status)
}

fn attach(config: TraceConfig, pid: i32, duration: Option<Duration>) -> Result<i32, Error> {
    // As at a launch: no signal kills memptrace while it makes the database.
    signals::install()?;
    let wrappers = Wrappers::new(&config.wrappers).map_err(Error::Wrapper)?;
    // The process the number names now: the one checked below, and the
    // one traced (should it be reaped before the seize and its number
    // given to another, that one is let go). None on a kernel without
    // pidfds (before 5.3), and for a thread that is not a process (refused
    // below).
    let origin = match Pidfd::open(pid) {
        Err(err) if err.raw_os_error() == Some(libc::ESRCH) => {
            return Err(Error::NoSuchProcess(pid));
        }
        opened => opened.ok(),
    };
    if procfs::tgid(pid).is_none() {
        return Err(Error::NoSuchProcess(pid));
    }
    // The same checks as a launch, before the process is touched: a static
    // executable with nothing to hook is refused without stopping it.
    if let Some(exe) = procfs::exe(pid) {
        if let Ok(bytes) = std::fs::read(format!("/proc/{pid}/exe")) {
            program::check_image(&exe, &bytes)?;
        }
    }
    let command = procfs::cmdline(pid).unwrap_or_default();
    let sink = start_output(&config, &command, "attach")?;
    let recording = Recording::start(sink, pid, &config, wrappers)?;
    // Ctrl-C, SIGTERM and the tick are live while attaching too: an attach
    // that cannot finish gives up and lets the process go.
    signals::unblock_here(TICK)?;
    let tracer = match Tracer::attach(
        options(&config, duration),
        recording.pipeline(&config),
        pid,
        origin.as_ref(),
        recording.clock,
        recording.progress.clone(),
        recording.heap_facts.clone(),
    ) {
        Ok(tracer) => tracer,
        Err(err) => {
            signals::quiesce();
            recording.abandon(&config.output);
            return Err(attach_error(err));
        }
    };
    // What memptrace's death would do to the process, said once at the start.
    let death = match tracer.int3s_left(pid) {
        Some(why) => {
            eprintln!("memptrace: warning: {why}");
            format!("kills it: {why}")
        }
        None => "runs on: the probes let calls through unrecorded".to_string(),
    };
    recording
        .records
        .send(vec![meta_record("on_memptrace_death", death)])?;
    let (ending, stats, pipeline) = recording.trace(tracer)?;
    if let Some(reason) = recording.halted(&ending) {
        eprintln!("memptrace: {reason}: the trace ends here; the process runs on, detached");
    }
    // Detached as asked, memptrace did its job: 0. The process ending
    // during the trace is reported as a launched program's end would be.
    // A detach that could not let every thread go says so and fails.
    let status = match ending {
        Ending::Detached { .. } if !stats.detach_left.is_empty() => 1,
        Ending::Detached { .. } => 0,
        _ => exit_status(&ending),
    };
    recording.finish(&ending, status, &stats, pipeline)?;
    Ok(status)
}

/// The program could not be executed: for a script whose interpreter
/// cannot be run, say which interpreter.
fn exec_error(path: std::path::PathBuf, source: std::io::Error) -> Error {
    match program::interpreter(&path) {
        Some(interpreter) => Error::BadInterpreter {
            path,
            interpreter,
            source,
        },
        None => Error::Exec { path, source },
    }
}

fn attach_error(err: TraceError) -> Error {
    match err {
        TraceError::NoSuchProcess(pid) => Error::NoSuchProcess(pid),
        TraceError::Denied {
            pid,
            source,
            tracer: Some(tracer),
        } => Error::AlreadyTraced {
            pid,
            tracer,
            name: procfs::cmdline(tracer).unwrap_or_default(),
            source,
        },
        TraceError::Denied {
            pid,
            source,
            tracer: None,
        } => Error::AttachDenied { pid, source },
        TraceError::NoAllocator(pid) => Error::NoAllocatorInProcess(pid),
        TraceError::Exited { pid, running: 0 } => Error::ZombieProcess(pid),
        TraceError::Exited { pid, running } => Error::LeaderExited { pid, running },
        TraceError::AttachAbandoned { pid, reason } => Error::AttachAbandoned { pid, reason },
        other => Error::Trace(other),
    }
}

fn options(config: &TraceConfig, duration: Option<Duration>) -> TraceOptions {
    TraceOptions {
        probes: config.probes,
        max_depth: config.max_depth,
        unwinder: config.unwinder,
        stacks: config.stacks,
        stack_every: config.stack_every,
        follow_forks: config.follow_forks,
        duration,
    }
}
