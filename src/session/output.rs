//! The trace database of a run: created with the `meta` rows of the start,
//! discarded when the program never started, and the rows that say how it
//! ended.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::SystemTime;

use crate::cli::TraceConfig;
use crate::error::Error;
use crate::os::signals;
use crate::sink::{EventSink, Record, SqliteSink};
use crate::tracer::{Ending, ProbeMode, signal_name};
use crate::unwind::UnwinderKind;

/// Create the database with the `meta` rows of the start, committed: from
/// the first moment it exists, a trace says what it is.
pub(super) fn start_output(
    config: &TraceConfig,
    command: &str,
    mode: &str,
) -> Result<SqliteSink, Error> {
    let mut sink = create_output(&config.output, config.force)?;
    let meta = [
        ("command", command.to_string()),
        ("mode", mode.to_string()),
        ("started_at", crate::time::rfc3339(SystemTime::now())),
        ("trace_id", crate::trace_id::new()),
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        ("unwinder", unwinder_name(config)),
        ("max_depth", config.max_depth.to_string()),
        ("stack_every", config.stack_every.to_string()),
        ("follow_forks", config.follow_forks.to_string()),
        ("probes", probes_name(config).to_string()),
        ("rss_interval_ms", config.rss_interval_ms.to_string()),
        (
            "trace_mode",
            if config.aggregate {
                "aggregate"
            } else {
                "full"
            }
            .to_string(),
        ),
        ("agg_resolution_ns", config.resolution_ns.to_string()),
    ];
    sink.aggregate(config.aggregate, config.resolution_ns);
    let limited = match config.max_size {
        Some(bytes) => sink.limit(bytes),
        None => Ok(()),
    };
    let written = limited
        .and_then(|()| {
            meta.into_iter()
                .map(|(key, value)| meta_record(key, value))
                .chain(numbered_rows("wrapper", &config.wrappers))
                .try_for_each(|record| sink.write(&record))
        })
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

/// Create the database, refusing to mix a new trace into an existing file.
pub(super) fn create_output(path: &Path, force: bool) -> Result<SqliteSink, Error> {
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
pub(super) fn discard(output: &Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut file = output.as_os_str().to_owned();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

/// Values of one kind as `meta` rows of their own, numbered in order:
/// `warning.1`, `warning.2`, ... (`meta`'s key is its primary key).
pub(super) fn numbered_rows(kind: &str, values: &[String]) -> Vec<Record> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| meta_record(&format!("{kind}.{}", i + 1), v.clone()))
        .collect()
}

pub(super) fn meta_record(key: &str, value: String) -> Record {
    Record::Meta {
        key: key.to_string(),
        value,
    }
}

/// The probes a trace uses: libunwind walks a stopped thread's stack, so
/// it takes int3 probes whatever `--probes` says.
pub(super) fn probes_name(config: &TraceConfig) -> &'static str {
    if config.stacks && config.unwinder == UnwinderKind::Libunwind {
        ProbeMode::Int3.name()
    } else {
        config.probes.name()
    }
}

pub(super) fn unwinder_name(config: &TraceConfig) -> String {
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

pub(super) fn end_reason(ending: &Ending) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

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
