//! The real memptrace binary on the tracees of `tracee-tests/`, each built
//! dynamic, `-static`, `-static-pie` and musl `-static`, with SQL assertions
//! on the database it writes: exact counts and sizes per function and op
//! against the truth each tracee prints, leaks, threads, the order of the
//! functions along stacks with both unwinders, process and signal handling,
//! and every kind of bad input; and the reports over the traces.
//!
//! These tests need ptrace rights over a child process; where ptrace is not
//! allowed they fail, they never skip.

mod aggregate;
mod api;
mod attach;
mod bad_input;
mod bigheap;
mod cli;
mod debuginfod;
mod docs;
mod export;
mod failopen;
mod faults;
mod full;
mod hostile;
mod hostile_heap;
mod lifecycle;
mod mappings;
mod memory;
mod pauses;
mod probes;
mod processes;
mod report;
mod report_live;
mod returns;
mod rss;
mod sampling;
mod seccomp;
mod stacks;
mod stripped;
mod support;
mod terminal;
mod wrappers;
