//! Errors a user can act on, one variant per cause, each with a message that
//! says what happened and, where there is something to do, what to do.

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
    #[error("cannot execute {}: {source}", path.display())]
    Exec { path: PathBuf, source: io::Error },

    // --- the output ---
    #[error("{}: already exists; choose another file with -o, or replace it with --force", .0.display())]
    OutputExists(PathBuf),
    #[error("cannot create {}: {source}", path.display())]
    OutputUnwritable { path: PathBuf, source: io::Error },

    // --- permission ---
    #[error(
        "ptrace is not permitted here ({0}); run memptrace as root, or allow it (sysctl kernel.yama.ptrace_scope=0, or the CAP_SYS_PTRACE capability; in a container, a seccomp profile that allows ptrace)"
    )]
    PtraceDenied(io::Error),

    // --- the process to attach to ---
    #[error("no process {0} (it may have exited; see `ps`)")]
    NoSuchProcess(i32),
    #[error(
        "process {pid} is already traced by process {tracer} ({name}): detach that debugger or tracer first ({source})"
    )]
    AlreadyTraced {
        pid: i32,
        tracer: i32,
        name: String,
        source: io::Error,
    },
    #[error(
        "not permitted to trace process {pid} ({source}); run memptrace as its owner or as root, and check kernel.yama.ptrace_scope (1 allows tracing only your own children: set it to 0, or give memptrace the CAP_SYS_PTRACE capability)"
    )]
    AttachDenied { pid: i32, source: io::Error },
    #[error(
        "process {0}: no allocator (malloc, free, ...) found in any of its images (no symbol, no debug file, no C library signature matched); nothing to trace, the process was left as it was"
    )]
    NoAllocatorInProcess(i32),
    #[error("attaching to process {pid} given up ({reason}); the process was left as it was")]
    AttachAbandoned { pid: i32, reason: String },

    // --- while tracing ---
    #[error("{0}")]
    Trace(#[from] TraceError),
    #[error("recording the trace failed: {0}")]
    Sink(#[from] SinkError),
    #[error("{0}")]
    Io(#[from] io::Error),

    // --- reading a trace ---
    #[error(transparent)]
    Report(#[from] ReportError),
    #[error("--from ({from}) is after --to ({to}): give the window's start first")]
    EmptyWindow { from: String, to: String },
}
