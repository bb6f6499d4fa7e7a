//! From a stopped call to a stack: return addresses, innermost first.
//!
//! Two [`Unwinder`]s: framehop over a copy of the stack (the default; it runs
//! on the pipeline thread after the target has been resumed), and
//! libunwind-ptrace (`--unwinder libunwind`; it reads the live process, so it
//! runs on the tracer thread while the thread is stopped). Both start from the
//! *caller's* registers at the allocator's entry (rip = the return address, rsp
//! just above it), which are exact there, so the allocator itself needs no
//! unwind information. Both fall back to frame pointers where no CFI covers an
//! address. [`intern`] turns return addresses into ids of the stack trie, and
//! [`pipeline`] is the thread that does both.

pub mod by_allocator;
pub mod debug_frame;
pub mod framehop;
pub mod intern;
pub mod libunwind;
pub mod pipeline;
pub mod seen;
pub mod signal;
pub mod step;
pub mod tables;
pub mod vet;

use std::ops::Range;

/// The stack copies, walk ends and images the tracer hands on; defined with
/// the rest of its output (see [`crate::trace_msg`]).
pub use crate::trace_msg::{MappedImage, StackSample, WalkEnd};

/// Turns the caller state of one call into return addresses.
pub trait Unwinder {
    fn add_image(&mut self, image: &MappedImage);
    fn remove_image(&mut self, range: Range<u64>);
    /// Append up to `max` return addresses to `out`, innermost first; the first
    /// is `sample.ip`, the caller of the allocator. Says why the walk ended.
    fn unwind(&mut self, tid: i32, sample: &StackSample, out: &mut Vec<u64>, max: usize)
    -> WalkEnd;
}

/// Which unwinder a trace uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum UnwinderKind {
    #[default]
    Framehop,
    Libunwind,
}

impl UnwinderKind {
    pub fn name(self) -> &'static str {
        match self {
            UnwinderKind::Framehop => "framehop",
            UnwinderKind::Libunwind => "libunwind",
        }
    }
}
