//! memptrace records every heap allocation call of a Linux x86-64 process, with
//! its thread and full call stack, into a SQLite database.
//!
//! It is a debugger, not a preload library: it starts or attaches to a process
//! with ptrace and hooks malloc, free and the rest of the allocator API in
//! every ELF image, and so works on static binaries and on processes that are
//! already running. Each function gets a jump probe by default: a 5-byte jump
//! to code memptrace writes into the target, which records the call into
//! memory the target shares with memptrace, with no stop per call. int3
//! breakpoints (`--probes int3`, one stop per call) are the reference the jump
//! probes are checked against, and catch what a jump cannot be planted on.
//!
//! Data flows one way:
//! 1. [`os`] is the only place that talks to the kernel (ptrace, /proc, process memory).
//! 2. [`tracer`] runs the wait loop, reads the probes' rings, serves the stops and
//!    turns calls into raw messages ([`trace_msg`]).
//! 3. [`unwind`] turns a stack snapshot into return addresses and interns stacks.
//! 4. [`sink`] stores [`event::Event`]s and the rest on a thread of its own (SQLite).
//! 5. [`namer`] names each unique code address once, with [`symbols`], on a thread
//!    of its own as the trace runs.
//!
//! [`report`] reads a trace database back (read-only): text and JSON
//! summaries, flame graphs, plots, pprof profiles and time windows.
//!
//! No two top-level modules use each other, directly or through others
//! (`scripts/cycles` checks); [`util`] holds the few helpers several share.

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
pub mod queue;
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
