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

pub mod debug_frame;
pub mod framehop;
pub mod intern;
pub mod libunwind;
pub mod pipeline;
pub mod signal;
pub mod tables;
pub mod vet;

use std::ops::Range;
use std::sync::Arc;

use crate::addr::LoadBias;
use crate::symbols::elf::ElfImage;

/// The caller's registers at an allocator entry, and a copy of the stack from
/// the allocator's stack pointer up.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StackSample {
    /// The return address into the caller.
    pub ip: u64,
    /// The caller's stack pointer (the allocator's rsp + 8).
    pub sp: u64,
    pub bp: u64,
    /// Address of `bytes[0]`.
    pub base: u64,
    pub bytes: Vec<u8>,
}

impl StackSample {
    /// Read a word of the copied stack.
    pub fn read_u64(&self, addr: u64) -> Option<u64> {
        let offset = usize::try_from(addr.checked_sub(self.base)?).ok()?;
        let word = self.bytes.get(offset..offset.checked_add(8)?)?;
        Some(u64::from_le_bytes(word.try_into().ok()?))
    }
}

/// An image mapped in a process, as unwinders need it.
#[derive(Clone, Debug)]
pub struct MappedImage {
    pub module_id: u64,
    pub image: Arc<ElfImage>,
    pub bias: LoadBias,
    pub range: Range<u64>,
    /// The process's main executable (as opposed to a shared library).
    pub is_main: bool,
}

/// Turns the caller state of one call into return addresses.
pub trait Unwinder {
    fn add_image(&mut self, image: &MappedImage);
    fn remove_image(&mut self, range: Range<u64>);
    /// Append up to `max` return addresses to `out`, innermost first; the first
    /// is `sample.ip`, the caller of the allocator. Says why the walk ended.
    fn unwind(&mut self, tid: i32, sample: &StackSample, out: &mut Vec<u64>, max: usize)
    -> WalkEnd;
}

/// Why an unwinder stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WalkEnd {
    /// At the outermost frame (CFI that says there is no caller, a zero
    /// return address or frame pointer: the ABI's end of the chain), or at
    /// the depth limit.
    Outermost,
    /// It could not go on: no rule for an address, or the end of the stack
    /// copy. The stack is truncated.
    Failed,
    /// It stopped without saying why (libunwind's end of a walk): outermost
    /// if CFI describes the last frame's code, else truncated.
    Stopped,
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
