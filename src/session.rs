//! One run of memptrace, start to end: check the input, open the database,
//! start the program, trace it, name the addresses, close the database, and
//! work out the exit status. The order matters: nothing is created before the
//! input is known to be good, and the database has its `meta` rows from the
//! first moment it exists.

use std::ffi::OsString;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::cli::{Config, TraceConfig};
use crate::error::Error;
use crate::os::procfs;
use crate::os::{launch, signals};
use crate::program;
use crate::progress::ProgressLine;
use crate::report;
use crate::report::heapmap::{HeapReport, HeapSource};
use crate::sampler::{Sampler, Watchlist};
use crate::sink::{EventSink, Record, RecordSender, Recorder, SqliteSink};
use crate::symbols::debuginfod::Debuginfod;
use crate::symbols::namer::Namer;
use crate::tracer::{
    Ending, ProbeMode, Progress, TraceError, TraceOptions, TraceStats, Tracer, signal_name,
};
use crate::unwind::UnwinderKind;
use crate::unwind::pipeline::PipelineHandle;
use crate::wrappers::Wrappers;

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
                    let map = crate::heap::read_process(pid, false)?;
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
    let wrappers = Wrappers::new(&config.wrappers).map_err(Error::Wrapper)?;
    let program = program::resolve(&args[0])?;
    program::check(&program)?;
    let command = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let sink = start_output(&config, &command, "launch")?;

    // Signals first, threads after: the threads inherit the blocked mask.
    signals::install()?;
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
    )?;
    recording.records.send(vec![meta_record(
        "on_memptrace_death",
        "killed with it: launched under memptrace (PTRACE_O_EXITKILL)".to_string(),
    )])?;
    let (ending, stats, pipeline) = recording.trace(tracer)?;
    if ending == Ending::Exited(127) {
        if let Some(err) = child.exec_error() {
            // The program never ran: no trace of it is worth keeping.
            drop(pipeline);
            recording.abandon(&config.output);
            return Err(exec_error(program, err));
        }
    }
    let status = exit_status(&ending);
    recording.finish(&ending, status, &stats, pipeline)?;
    Ok(status)
}

fn attach(config: TraceConfig, pid: i32, duration: Option<Duration>) -> Result<i32, Error> {
    let wrappers = Wrappers::new(&config.wrappers).map_err(Error::Wrapper)?;
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
    signals::install()?;
    let recording = Recording::start(sink, pid, &config, wrappers)?;
    // Ctrl-C, SIGTERM and the tick are live while attaching too: an attach
    // that cannot finish gives up and lets the process go.
    signals::unblock_here(TICK)?;
    let tracer = match Tracer::attach(
        options(&config, duration),
        recording.pipeline(&config),
        pid,
        recording.clock,
        recording.progress.clone(),
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

/// Create the database with the `meta` rows of the start, committed: from
/// the first moment it exists, a trace says what it is.
fn start_output(config: &TraceConfig, command: &str, mode: &str) -> Result<SqliteSink, Error> {
    let mut sink = create_output(&config.output, config.force)?;
    let meta = [
        ("command", command.to_string()),
        ("mode", mode.to_string()),
        ("started_at", rfc3339(SystemTime::now())),
        ("trace_id", crate::trace_id::new()),
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        ("unwinder", unwinder_name(config)),
        ("max_depth", config.max_depth.to_string()),
        ("stack_every", config.stack_every.to_string()),
        ("follow_forks", config.follow_forks.to_string()),
        ("probes", probes_name(config).to_string()),
        ("rss_interval_ms", config.rss_interval_ms.to_string()),
    ];
    let written = meta
        .into_iter()
        .map(|(key, value)| meta_record(key, value))
        .chain(numbered_rows("wrapper", &config.wrappers))
        .try_for_each(|record| sink.write(&record))
        .and_then(|()| sink.commit());
    if let Err(source) = written {
        drop(sink);
        discard(&config.output);
        return Err(Error::OutputDatabase {
            path: config.output.clone(),
            source,
        });
    }
    Ok(sink)
}

/// A trace being recorded: the recorder thread and what the session needs
/// to end it.
///
/// Fields drop in order: every sender (the sampler holds one) before the
/// recorder, which waits for them all.
struct Recording {
    /// Samples resident memory (`--rss-interval`), unless it is 0.
    sampler: Option<Sampler>,
    /// Names the frames the pipeline hands it, as the trace goes.
    namer: Namer,
    /// The debuginfod servers the namer asks (for their warning).
    debuginfod: Option<Debuginfod>,
    records: RecordSender,
    recorder: Recorder,
    clock: Instant,
    progress: Arc<Progress>,
    /// Progress may be drawn: on a terminal the program does not write to.
    draw: bool,
}

impl Recording {
    fn start(
        sink: SqliteSink,
        pid: i32,
        config: &TraceConfig,
        wrappers: Wrappers,
    ) -> Result<Recording, Error> {
        let interval = Duration::from_millis(config.rss_interval_ms);
        let watchlist = (!interval.is_zero()).then(Watchlist::new);
        let recorder = match &watchlist {
            // The sampler learns the processes (-f children too) from the
            // thread records the trace writes.
            Some(list) => Recorder::spawn_observed(Box::new(sink), list.observer()),
            None => Recorder::spawn(Box::new(sink)),
        };
        let records = recorder.sender();
        records.send(vec![meta_record("pid", pid.to_string())])?;
        let clock = Instant::now();
        let sampler = watchlist.map(|list| {
            // A launched program is sampled from its exec on (see sampler).
            list.watch(pid as u32);
            Sampler::start(list, interval, clock, records.clone())
        });
        let debuginfod = Debuginfod::from_env();
        Ok(Recording {
            namer: Namer::spawn(records.clone(), wrappers, debuginfod.clone()),
            debuginfod,
            recorder,
            records,
            clock,
            progress: Arc::new(Progress::default()),
            draw: terminal_free(pid),
            sampler,
        })
    }

    /// The pipeline thread between the tracer and the recorder.
    fn pipeline(&self, config: &TraceConfig) -> PipelineHandle {
        PipelineHandle::spawn(
            self.records.clone(),
            config.stacks && config.unwinder == UnwinderKind::Framehop,
            config.stacks,
            config.max_depth,
            Some(self.namer.sender()),
        )
    }

    /// Run the tracer to its end, with the progress line and memptrace's own
    /// signals live meanwhile.
    fn trace(&self, tracer: Tracer) -> Result<(Ending, TraceStats, PipelineHandle), Error> {
        let line = ProgressLine::start(self.progress.clone(), self.draw);
        signals::unblock_here(TICK)?;
        let traced = tracer.run();
        signals::quiesce();
        line.finish();
        Ok(traced?)
    }

    /// Nothing worth keeping was traced: close and remove the database.
    /// Every sender goes before the recorder, which waits for them all.
    fn abandon(self, output: &Path) {
        drop(self.sampler);
        drop(self.namer);
        drop(self.records);
        drop(self.recorder);
        discard(output);
    }

    /// Name the frames, write the `meta` rows of the end, close the database.
    fn finish(
        self,
        ending: &Ending,
        status: i32,
        stats: &TraceStats,
        pipeline: PipelineHandle,
    ) -> Result<(), Error> {
        // The last sample, as near the end as the trace knows: a detached
        // process's memory as memptrace lets it go.
        if let Some(sampler) = self.sampler {
            sampler.finish();
        }
        // The pipeline's end lets the namer finish (it holds a sender).
        let result = pipeline.finish()?;
        self.namer.finish(self.draw)?;
        let mut end = vec![
            ("ended_at", rfc3339(SystemTime::now())),
            ("exit_status", status.to_string()),
            ("end_reason", end_reason(ending)),
            ("events", result.events.to_string()),
            ("images", stats.images.to_string()),
            ("housekeeping_frees", result.housekeeping_frees.to_string()),
            ("truncated_stacks", result.truncated_stacks.to_string()),
            ("nested_calls", stats.nested_calls.to_string()),
            ("lost_returns", stats.lost_returns.to_string()),
            ("copy_faults", stats.copy_faults.to_string()),
            ("walk_faults", stats.walk_faults.to_string()),
            ("ring_waits", stats.ring_waits.to_string()),
            ("let_through_calls", stats.let_through.to_string()),
            ("skipped_records", stats.skipped_records.to_string()),
            ("damaged_records", stats.damaged.records.to_string()),
            ("damaged_slots", stats.damaged.slots.to_string()),
            ("dropped_slots", stats.damaged.dropped.to_string()),
            ("heap_walk_errors", stats.heap_walk_errors.to_string()),
            ("duration_ns", self.clock.elapsed().as_nanos().to_string()),
        ];
        if let Some(kib) = procfs::own_peak_rss_kib() {
            end.push(("peak_rss_kib", kib.to_string()));
        }
        if let Ending::Killed { sig, .. } = ending {
            end.push(("exit_signal", signal_name(*sig)));
        }
        let probes: Vec<(String, String)> = stats
            .probes
            .iter()
            .map(|(function, how)| (format!("probe.{function}"), how.clone()))
            .chain(crate::tracer::pauses::meta_rows(&stats.pauses))
            .chain(
                stats
                    .in_probes_at_detach
                    .map(|n| ("detach_threads_in_probes".to_string(), n.to_string())),
            )
            .collect();
        let mut warnings = Vec::new();
        if stats.hooked_functions == 0 {
            warnings
                .push("no allocator function found in any image; nothing was recorded".to_string());
        }
        warnings.extend(stats.warnings.iter().cloned());
        warnings.extend(stats.damaged.warning());
        warnings.extend(self.debuginfod.as_ref().and_then(Debuginfod::warning));
        for warning in &warnings {
            eprintln!("memptrace: warning: {warning}");
        }
        for left in &stats.detach_left {
            eprintln!(
                "memptrace: detach incomplete: {left}; it stays traced until memptrace exits, when the kernel lets it go"
            );
        }
        let rows = end
            .into_iter()
            .map(|(k, v)| meta_record(k, v))
            .chain(
                probes
                    .into_iter()
                    .map(|(k, v)| Record::Meta { key: k, value: v }),
            )
            .chain(numbered_rows("warning", &warnings))
            .chain(numbered_rows("detach_incomplete", &stats.detach_left))
            .collect();
        self.records.send(rows)?;
        drop(self.records);
        self.recorder.finish()?;
        Ok(())
    }
}

/// True when memptrace's stderr is a terminal that neither the stdout nor
/// the stderr of process `pid` writes to: progress drawn there cannot touch
/// the program's output (see `progress`). A launched program inherits
/// memptrace's stderr, so this is false for it whenever stderr is a terminal.
fn terminal_free(pid: i32) -> bool {
    use std::io::IsTerminal;
    let ours = if std::io::stderr().is_terminal() {
        procfs::terminal_of(std::process::id() as i32, 2)
            .ok()
            .flatten()
    } else {
        None
    };
    let program = [procfs::terminal_of(pid, 1), procfs::terminal_of(pid, 2)];
    crate::progress::may_draw(ours, &program)
}

/// Create the database, refusing to mix a new trace into an existing file.
fn create_output(path: &Path, force: bool) -> Result<SqliteSink, Error> {
    if path.exists() {
        if !force {
            return Err(Error::OutputExists(path.to_path_buf()));
        }
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut file = path.as_os_str().to_owned();
            file.push(suffix);
            match std::fs::remove_file(&file) {
                Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::OutputUnwritable {
                        path: path.to_path_buf(),
                        source: err,
                    });
                }
                _ => {}
            }
        }
    }
    // Create the file first: SQLite's own error for a missing directory or a
    // read-only place is vaguer than the system's. It is private (0600, the
    // umask notwithstanding): it holds command lines and addresses of a
    // process that may be another user's. SQLite gives the -wal, -shm and
    // -journal files it creates beside it the database file's mode.
    let private = |source| Error::OutputUnwritable {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(private)?;
    if let Err(err) = file.set_permissions(std::fs::Permissions::from_mode(0o600)) {
        let _ = std::fs::remove_file(path);
        return Err(private(err));
    }
    SqliteSink::create(path).map_err(|source| {
        let _ = std::fs::remove_file(path);
        Error::OutputDatabase {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// The program could not be started: remove the database, which holds
/// nothing but the start of a run that never was. Call after closing it.
fn discard(output: &Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut file = output.as_os_str().to_owned();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

/// Values of one kind as `meta` rows of their own, numbered in order:
/// `warning.1`, `warning.2`, ... (`meta`'s key is its primary key).
fn numbered_rows(kind: &str, values: &[String]) -> Vec<Record> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| meta_record(&format!("{kind}.{}", i + 1), v.clone()))
        .collect()
}

fn meta_record(key: &str, value: String) -> Record {
    Record::Meta {
        key: key.to_string(),
        value,
    }
}

/// The probes a trace uses: libunwind walks a stopped thread's stack, so
/// it takes int3 probes whatever `--probes` says.
fn probes_name(config: &TraceConfig) -> &'static str {
    if config.stacks && config.unwinder == UnwinderKind::Libunwind {
        ProbeMode::Int3.name()
    } else {
        config.probes.name()
    }
}

fn unwinder_name(config: &TraceConfig) -> String {
    if config.stacks {
        config.unwinder.name().to_string()
    } else {
        "none".to_string()
    }
}

/// memptrace's exit status: the program's, 128+N when signal N killed it.
pub fn exit_status(ending: &Ending) -> i32 {
    match ending {
        Ending::Exited(code) => *code,
        Ending::Killed { sig, .. } => 128 + sig,
        Ending::Detached { .. } => 128 + signals::terminate_signal().unwrap_or(libc::SIGINT),
        // As a Rust program that panics.
        Ending::Failed { .. } => 101,
    }
}

fn end_reason(ending: &Ending) -> String {
    match ending {
        Ending::Exited(code) => format!("exited with status {code}"),
        Ending::Killed { sig, core } => format!(
            "killed by {}{}",
            signal_name(*sig),
            if *core { " (core dumped)" } else { "" }
        ),
        Ending::Detached { reason } => format!("detached: {reason}"),
        Ending::Failed { reason } => reason.clone(),
    }
}

/// A UTC timestamp as RFC 3339 (`2026-11-22T13:30:54.123Z`).
pub fn rfc3339(time: SystemTime) -> String {
    let since = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn formats_utc_times() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(1_795_354_254_123);
        assert_eq!(rfc3339(t), "2026-11-22T13:30:54.123Z");
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn warnings_and_wrappers_are_numbered_meta_rows() {
        let rows = numbered_rows("warning", &["first".to_string(), "second".to_string()]);
        assert_eq!(
            rows,
            [
                meta_record("warning.1", "first".into()),
                meta_record("warning.2", "second".into())
            ]
        );
        assert!(numbered_rows("warning", &[]).is_empty());
    }

    #[test]
    fn exit_status_follows_the_program() {
        assert_eq!(exit_status(&Ending::Exited(3)), 3);
        assert_eq!(
            exit_status(&Ending::Killed {
                sig: libc::SIGABRT,
                core: true
            }),
            134
        );
    }
}
