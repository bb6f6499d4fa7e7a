//! memptrace records every heap allocation call of a Linux x86-64 process, with
//! its thread and full call stack, into a SQLite database.
//!
//! It is a debugger, not a preload library: it starts or attaches to a process
//! with ptrace, plants int3 breakpoints on malloc, free and the rest of the
//! allocator API in every ELF image, and so works on static binaries and on
//! processes that are already running.
//!
//! Data flows one way:
//! 1. [`os`] is the only place that talks to the kernel (ptrace, /proc, process memory).
//! 2. [`tracer`] runs the wait loop, handles breakpoints and turns stops into raw calls
//!    ([`trace_msg`]).
//! 3. [`unwind`] turns a stack snapshot into return addresses and interns stacks.
//! 4. [`sink`] stores [`event::Event`]s and the rest on a thread of its own (SQLite).
//! 5. [`symbols`] names each unique code address once, at the end of the trace.
//!
//! [`report`] reads a trace database back (read-only): text and JSON
//! summaries, flame graphs, plots, pprof profiles and time windows.

#![deny(unsafe_code)]

pub mod addr;
pub mod cli;
pub mod error;
pub mod event;
pub mod heap;
pub mod memory;
pub mod namer;
pub mod os;
pub mod program;
pub mod progress;
pub mod report;
pub mod sampler;
pub mod seccomp;
pub mod session;
pub mod sink;
pub mod symbols;
pub mod time;
pub mod trace_id;
pub mod trace_msg;
pub mod tracer;
pub mod unwind;
pub mod util;
pub mod wrappers;
