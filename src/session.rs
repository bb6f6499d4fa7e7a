//! One run of memptrace, start to end: check the input, open the database,
//! start the program, trace it, name the addresses, close the database, and
//! work out the exit status. The order matters: nothing is created before the
//! input is known to be good, and the database has its `meta` rows from the
//! first moment it exists.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use crate::cli::{Config, TraceConfig};
use crate::error::Error;
use crate::os::{launch, signals};
use crate::program;
use crate::progress::ProgressLine;
use crate::report;
use crate::sink::{EventSink, Record, RecordSender, Recorder, SqliteSink};
use crate::symbols::symbolize::Symbolizer;
use crate::tracer::{Ending, Progress, TraceOptions, Tracer, signal_name};
use crate::unwind::UnwinderKind;
use crate::unwind::pipeline::{PipelineHandle, PipelineResult};

/// Run a config; returns memptrace's exit status.
pub fn run(config: Config) -> Result<i32, Error> {
    match config {
        Config::Launch { trace, program } => launch(trace, program),
        Config::Attach { .. } => Err(Error::Unsupported("attach is not written yet")),
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
    }
}

fn launch(config: TraceConfig, args: Vec<OsString>) -> Result<i32, Error> {
    let program = program::resolve(&args[0])?;
    program::check(&program)?;
    let mut sink = create_output(&config.output, config.force)?;

    let started = SystemTime::now();
    let clock = Instant::now();
    let command = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let meta = [
        ("command", command),
        ("mode", "launch".to_string()),
        ("started_at", rfc3339(started)),
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        ("unwinder", unwinder_name(&config)),
        ("max_depth", config.max_depth.to_string()),
    ];
    for (key, value) in meta {
        sink.write(&meta_record(key, value))?;
    }
    sink.commit()?;

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
                Error::Exec {
                    path: program,
                    source: err,
                }
            });
        }
    };
    let recorder = Recorder::spawn(Box::new(sink));
    let records = recorder.sender();
    records.send(vec![meta_record("pid", child.pid.to_string())])?;
    let pipeline = PipelineHandle::spawn(
        records.clone(),
        config.stacks && config.unwinder == UnwinderKind::Framehop,
        config.stacks,
        config.max_depth,
    );

    let progress = Arc::new(Progress::default());
    let line = ProgressLine::start(progress.clone());
    let options = TraceOptions {
        max_depth: config.max_depth,
        unwinder: config.unwinder,
        stacks: config.stacks,
    };
    let tracer = Tracer::new(options, pipeline, child.pid, clock, progress)?;
    signals::unblock_here(std::time::Duration::from_millis(100))?;
    let traced = tracer.run();
    signals::quiesce();
    line.finish();
    let (ending, stats, pipeline) = traced?;

    if ending == Ending::Exited(127) {
        if let Some(err) = child.exec_error() {
            // The program never ran: no trace of it is worth keeping. Every
            // sender goes before the recorder, which waits for them all.
            drop(pipeline);
            drop(records);
            drop(recorder);
            discard(&config.output);
            return Err(Error::Exec {
                path: program,
                source: err,
            });
        }
    }

    let result = pipeline.finish()?;
    symbolize(&result, &records)?;

    let status = exit_status(&ending);
    let mut end = vec![
        ("ended_at", rfc3339(SystemTime::now())),
        ("exit_status", status.to_string()),
        ("end_reason", end_reason(&ending)),
        ("events", result.events.to_string()),
        ("images", stats.images.to_string()),
        ("housekeeping_frees", result.housekeeping_frees.to_string()),
        ("nested_calls", stats.nested_calls.to_string()),
        ("lost_returns", stats.lost_returns.to_string()),
        ("duration_ns", clock.elapsed().as_nanos().to_string()),
    ];
    if let Ending::Killed { sig, .. } = ending {
        end.push(("exit_signal", signal_name(sig)));
    }
    if stats.hooked_functions == 0 {
        eprintln!(
            "memptrace: warning: no allocator function found in any image; nothing was recorded"
        );
        end.push(("warning", "no allocator function found".to_string()));
    }
    for warning in &stats.warnings {
        eprintln!("memptrace: warning: {warning}");
    }
    records.send(end.into_iter().map(|(k, v)| meta_record(k, v)).collect())?;
    drop(records);
    recorder.finish()?;
    Ok(status)
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
    // read-only place is vaguer than the system's.
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|source| Error::OutputUnwritable {
            path: path.to_path_buf(),
            source,
        })?;
    SqliteSink::create(path).map_err(|err| {
        let _ = std::fs::remove_file(path);
        Error::OutputUnwritable {
            path: path.to_path_buf(),
            source: std::io::Error::other(err.to_string()),
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

/// Name every unique frame once: group by image, ask the symbolizer.
fn symbolize(result: &PipelineResult, records: &RecordSender) -> Result<(), Error> {
    let mut by_module: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
    for frame in &result.frames {
        if let Some(module) = frame.module_id {
            by_module
                .entry(module)
                .or_default()
                .push((frame.id, frame.ip));
        }
    }
    let mut symbolizer = Symbolizer::new();
    // A bar on a terminal: a program with large debug info takes seconds.
    let total: usize = by_module.values().map(Vec::len).sum();
    let bar = crate::progress::bar(total as u64, "naming code addresses");
    for (module_id, frames) in by_module {
        let Some(module) = result.modules.get(&module_id) else {
            bar.inc(frames.len() as u64);
            continue;
        };
        bar.set_message(format!(
            "naming code addresses in {}",
            crate::report::stacks::file_name(&module.path)
        ));
        // Return addresses point after the call: look up the call itself.
        let probes: Vec<u64> = frames
            .iter()
            .map(|&(_, ip)| ip.wrapping_sub(1).wrapping_sub(module.base))
            .collect();
        let path = module.path.trim_end_matches(" (deleted)");
        let names = symbolizer.symbolize(Path::new(path), module.build_id.as_deref(), &probes);
        let batch: Vec<Record> = frames
            .iter()
            .zip(names)
            .filter(|(_, lines)| !lines.is_empty())
            .map(|(&(frame_id, _), lines)| {
                Record::Symbols(crate::sink::FrameSymbols { frame_id, lines })
            })
            .collect();
        records.send(batch)?;
        bar.inc(frames.len() as u64);
    }
    bar.finish_and_clear();
    Ok(())
}

fn meta_record(key: &str, value: String) -> Record {
    Record::Meta {
        key: key.to_string(),
        value,
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
