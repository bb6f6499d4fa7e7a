//! The only room with system calls: ptrace, process memory, /proc, the launch
//! of the target, memptrace's own signal handling, the libunwind FFI and
//! elfutils' debuginfod client (loaded with dlopen).
//!
//! Everything outside `os` works on the plain values these functions return, so
//! it can be tested without a live process. Functions here are thin: they do
//! one kernel operation each and report errors as `io::Error` with the errno.

#![allow(unsafe_code)]

pub mod debuginfod;
pub mod launch;
pub mod libunwind;
pub mod local;
pub mod mem;
pub mod own_heap;
pub mod pidfd;
pub mod procfs;
pub mod ptrace;
pub mod resident;
pub mod room;
pub mod seccomp;
pub mod sentinel;
pub mod shared;
pub mod signals;

/// The error of type `E` that `err` carries (an `io::Error` made from it,
/// of the same kind), if it is one; otherwise `err` as it was. How a /proc
/// read's or a memory write's error, passed up as an `io::Error`, is told
/// apart from a ptrace request's.
pub fn carried<E>(err: std::io::Error) -> Result<E, std::io::Error>
where
    E: std::error::Error + Send + Sync + 'static,
{
    if !err.get_ref().is_some_and(|inner| inner.is::<E>()) {
        return Err(err);
    }
    let kind = err.kind();
    match err.into_inner().map(|inner| inner.downcast::<E>()) {
        Some(Ok(carried)) => Ok(*carried),
        Some(Err(other)) => Err(std::io::Error::new(kind, other)),
        None => Err(std::io::Error::from(kind)),
    }
}
