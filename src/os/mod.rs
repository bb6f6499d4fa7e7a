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
pub mod procfs;
pub mod ptrace;
pub mod resident;
pub mod room;
pub mod seccomp;
pub mod sentinel;
pub mod shared;
pub mod signals;
