//! The jump probe: calls recorded inside the target, into memory shared with
//! memptrace, with no stop per call.
//!
//! [`plan`] decides how a function's entry is patched (a `jmp` to the
//! probe, or an int3 where a jump is not safe), [`code`] writes the probe's
//! machine code, and [`layout`] is the shared memory the probes and
//! memptrace agree on.

pub mod code;
pub mod control;
pub mod decode;
mod labels;
pub mod layout;
pub mod liveness;
mod paths;
pub mod plan;
mod walk;

#[cfg(test)]
mod tests;
