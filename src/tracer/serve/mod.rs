//! The stops the probes still make while the trace runs: an int3 probe's
//! call entered and returned (`calls`, with the name the caller used,
//! `callsite`, and the signal handlers that interrupt a pending call,
//! `handlers`), the mapping calls (`mappings`), and what jump probes cannot
//! do alone (`jumps`: a thread without a slot, a faulted walk).

pub(super) mod calls;
pub(super) mod callsite;
pub(in crate::tracer) mod handlers;
pub(super) mod jumps;
pub(super) mod mappings;
