//! Errors a user can act on, one variant per cause, each with a message that
//! says what happened and, where there is something to do, what to do.
//!
//! `main` prints an error with its chain of causes (`{:#}`: `message: cause:
//! cause`), so a message never repeats its `source`: the system's words
//! ("Not a directory (os error 20)") come once, at the end.

use std::io;
use std::path::PathBuf;

use crate::report::ReportError;
use crate::sink::SinkError;
use crate::tracer::TraceError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // --- the program to run ---
    #[error("{0}: no such program (not a path, and not found in PATH)")]
    ProgramNotFound(String),
    #[error("{}: no such file", .0.display())]
    NoSuchFile(PathBuf),
    #[error("{}: not executable ({reason})", path.display())]
    NotExecutable { path: PathBuf, reason: String },
    #[error("{}: not an ELF executable (memptrace runs ELF programs and #! scripts)", .0.display())]
    NotElf(PathBuf),
    #[error("{}: a 32-bit program; memptrace traces x86-64 programs only", .0.display())]
    Not64Bit(PathBuf),
    #[error("{}: {reason}", path.display())]
    WrongMachine { path: PathBuf, reason: String },
    #[error(
        "{}: statically linked and stripped, and its allocator (malloc, free, ...) was not found: no symbol, no debug file, and its code matches none of the C libraries tried ({tried}); trace an unstripped build, put its debug file beside it, or install the libc.a it was linked with",
        path.display()
    )]
    NoAllocator { path: PathBuf, tried: String },
    #[error("cannot execute {}", path.display())]
    Exec { path: PathBuf, source: io::Error },
    #[error("cannot execute {}: its #! line names the interpreter {interpreter}", path.display())]
    BadInterpreter {
        path: PathBuf,
        interpreter: String,
        source: io::Error,
    },

    // --- the options ---
    #[error("a --wrapper is not a regular expression")]
    Wrapper(#[source] regex::Error),

    // --- the output ---
    #[error("{}: already exists; choose another file with -o, or replace it with --force", .0.display())]
    OutputExists(PathBuf),
    #[error("cannot create {}", path.display())]
    OutputUnwritable { path: PathBuf, source: io::Error },
    #[error("cannot create the trace database {}", path.display())]
    OutputDatabase { path: PathBuf, source: SinkError },

    // --- permission ---
    #[error(
        "ptrace is not permitted here (run memptrace as root, or allow it: sysctl kernel.yama.ptrace_scope=0, or the CAP_SYS_PTRACE capability; in a container, a seccomp profile that allows ptrace)"
    )]
    PtraceDenied(#[source] io::Error),

    // --- the process to attach to ---
    #[error("no process {0} (it may have exited; see `ps`)")]
    NoSuchProcess(i32),
    #[error(
        "process {pid} is already traced by process {tracer} ({name}): detach that debugger or tracer first"
    )]
    AlreadyTraced {
        pid: i32,
        tracer: i32,
        name: String,
        source: io::Error,
    },
    #[error(
        "not permitted to trace process {pid} (run memptrace as its owner or as root, and check kernel.yama.ptrace_scope: 1 allows tracing only your own children; set it to 0, or give memptrace the CAP_SYS_PTRACE capability)"
    )]
    AttachDenied { pid: i32, source: io::Error },
    #[error(
        "process {0} has already exited: it is a zombie its parent has not reaped; there is nothing to trace"
    )]
    ZombieProcess(i32),
    #[error(
        "the main thread of process {pid} has exited while {running} other thread(s) run on; ptrace cannot attach to a process whose main thread is gone, the process was left as it was"
    )]
    LeaderExited { pid: i32, running: usize },
    #[error(
        "process {0}: no allocator (malloc, free, ...) found in any of its images (no symbol, no debug file, no C library signature matched); nothing to trace, the process was left as it was"
    )]
    NoAllocatorInProcess(i32),
    #[error("attaching to process {pid} given up ({reason}); the process was left as it was")]
    AttachAbandoned { pid: i32, reason: String },

    // --- while tracing ---
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("recording the trace failed")]
    Sink(#[from] SinkError),
    #[error(transparent)]
    Io(#[from] io::Error),

    // --- reading a trace ---
    #[error(transparent)]
    Report(#[from] ReportError),
    #[error(transparent)]
    Heap(#[from] crate::heap::HeapError),
    #[error("--from ({from}) is after --to ({to}): give the window's start first")]
    EmptyWindow { from: String, to: String },
}

impl Error {
    /// memptrace's exit status for this error: as a shell would have it for
    /// a program that cannot be found (127) or cannot be run (126); 1 for
    /// everything else.
    pub fn exit_status(&self) -> u8 {
        match self {
            Error::ProgramNotFound(_) | Error::NoSuchFile(_) => 127,
            Error::NotExecutable { .. } | Error::Exec { .. } | Error::BadInterpreter { .. } => 126,
            _ => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text main prints: the message and its causes.
    fn printed(err: Error) -> String {
        format!("{:#}", anyhow::Error::new(err))
    }

    #[test]
    fn causes_are_named_once() {
        let enotdir = || io::Error::from_raw_os_error(libc::ENOTDIR);
        let eperm = || io::Error::from_raw_os_error(libc::EPERM);
        let cases = [
            (
                Error::OutputUnwritable {
                    path: "/dev/null/trace.db".into(),
                    source: enotdir(),
                },
                "cannot create /dev/null/trace.db: Not a directory (os error 20)",
            ),
            (
                Error::Exec {
                    path: "./prog".into(),
                    source: eperm(),
                },
                "cannot execute ./prog: Operation not permitted (os error 1)",
            ),
            (
                Error::Trace(TraceError::Ptrace(eperm())),
                "a ptrace request failed: Operation not permitted (os error 1)",
            ),
            (
                Error::Trace(TraceError::from(io::Error::from(
                    crate::os::procfs::read_maps(i32::MAX).unwrap_err(),
                ))),
                "cannot read /proc/2147483647/maps: No such file or directory (os error 2)",
            ),
            (
                Error::Trace(TraceError::from(
                    crate::os::mem::write_data(i32::MAX, 0x1000, &[0; 8]).unwrap_err(),
                )),
                "cannot write 8 bytes at 0x1000 in process 2147483647: No such process (os error 3)",
            ),
            (Error::Io(enotdir()), "Not a directory (os error 20)"),
        ];
        for (err, text) in cases {
            assert_eq!(printed(err), text);
        }
        for err in [
            Error::PtraceDenied(eperm()),
            Error::AttachDenied {
                pid: 1,
                source: eperm(),
            },
            Error::Trace(TraceError::Denied {
                pid: 1,
                source: eperm(),
                tracer: None,
            }),
            Error::Sink(SinkError::Io(eperm())),
            Error::OutputDatabase {
                path: "t.db".into(),
                source: SinkError::Io(eperm()),
            },
        ] {
            let text = printed(err);
            assert_eq!(text.matches("Operation not permitted").count(), 1, "{text}");
        }
    }

    #[test]
    fn exit_status_as_a_shell_would() {
        assert_eq!(Error::NoSuchFile("./x".into()).exit_status(), 127);
        assert_eq!(Error::ProgramNotFound("x".into()).exit_status(), 127);
        assert_eq!(
            Error::NotExecutable {
                path: "x".into(),
                reason: "no execute permission".into()
            }
            .exit_status(),
            126
        );
        assert_eq!(Error::OutputExists("t.db".into()).exit_status(), 1);
    }
}
