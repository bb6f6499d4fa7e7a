//! Probes: how the calls of a hooked function reach memptrace, and the book
//! of every hook planted in one address space.
//!
//! A hook patches the entry of a function and sends the thread that calls it
//! through code of memptrace's, in a trampoline area. The kinds of probe sit
//! behind one type, [`Probe`], so that the space plants them, a detach moves
//! threads out of them and restores them, all the same way:
//! - [`int3`]: a breakpoint on the first instruction; the thread stops, and
//!   memptrace sends it on through a slot holding the displaced instruction
//!   (and a call stub when it wants the call's result).
//! - [`jump`]: a jump to code that records the call inside the target, into
//!   memory shared with memptrace, with no stop (or, where a jump cannot be
//!   planted safely, an int3 whose stop sends the thread to the same code).
//!
//! Planting and restoring are the only two ways code changes: a hook
//! remembers the bytes its patch covers, and the space writes the patch
//! and puts every one of them back (`Space::restore_all` at a detach,
//! `Space::restore_into` in a forked child that is not traced).

pub mod int3;
pub mod jump;

use std::collections::HashMap;
use std::ops::Range;

use crate::event::{MapOp, Op};
use crate::memory::Memory;
use crate::os::ptrace::Regs;
use int3::{Displaced, InStub};

/// What a hooked entry is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HookKind {
    /// An allocator function; `ops` as in [`crate::symbols::elf::AllocatorEntry`]
    /// (several when names share the address).
    Allocator { module_id: u64, ops: Vec<Op> },
    /// A mapping function (mmap, munmap, brk...): a jump probe like an
    /// allocator function's, or an int3 probe (a stop per call) with int3
    /// probes or where a jump is not safe.
    Mapping { op: MapOp },
    /// The dynamic linker's `_dl_debug_state`: images were mapped or unmapped.
    DebugState,
}

/// The code a hooked call runs through.
#[derive(Clone, Debug)]
pub enum Probe {
    /// An int3 on the entry, served by a slot (see [`int3::slot_code`]).
    Int3 {
        /// Where a thread stopped at the int3 resumes: the displaced
        /// instruction.
        resume_at: u64,
        /// Where it resumes instead when memptrace wants the call's result:
        /// the slot's call stub, which returns through the int3 at
        /// `stub +` [`int3::Stub::return_int3`].
        stub: u64,
        /// What the slot holds at `resume_at`.
        displaced: Displaced,
    },
    /// A jump (or an int3, `via_int3`) to a recording probe.
    Jump {
        code: jump::code::ProbeCode,
        via_int3: bool,
    },
}

impl Probe {
    /// The bytes that patch the function's entry, at `at`; `None` when the
    /// probe lies out of a jump's reach (a space never puts it there).
    pub fn patch(&self, at: u64) -> Option<Vec<u8>> {
        match self {
            Probe::Int3 { .. } | Probe::Jump { via_int3: true, .. } => Some(vec![int3::INT3]),
            Probe::Jump { code, .. } => Some(jump::plan::jump(at, code.entry)?.to_vec()),
        }
    }
}

/// One hooked entry.
#[derive(Clone, Debug)]
pub struct Hook {
    pub addr: u64,
    /// The bytes the patch covers, as they were.
    pub orig: Vec<u8>,
    pub probe: Probe,
    pub kind: HookKind,
}

/// The hooks of one address space.
#[derive(Clone, Debug, Default)]
pub struct Hooks {
    by_addr: HashMap<u64, Hook>,
    /// The return int3 of each call stub, and the hook it serves.
    returns: HashMap<u64, u64>,
    /// The int3 of each jump probe that a thread without a slot reaches,
    /// and the hook it serves.
    misses: HashMap<u64, u64>,
}

impl Hooks {
    pub fn get(&self, addr: u64) -> Option<&Hook> {
        self.by_addr.get(&addr)
    }

    pub fn contains(&self, addr: u64) -> bool {
        self.by_addr.contains_key(&addr)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Hook> {
        self.by_addr.values()
    }

    /// Allocator functions hooked.
    pub fn allocators(&self) -> usize {
        self.iter()
            .filter(|h| matches!(h.kind, HookKind::Allocator { .. }))
            .count()
    }

    /// True when `at` is the return int3 of a call stub: a call made
    /// through the stub came back.
    pub fn is_return(&self, at: u64) -> bool {
        self.returns.contains_key(&at)
    }

    /// The hook whose jump probe has its miss int3 at `at`.
    pub fn missed(&self, at: u64) -> Option<&Hook> {
        self.by_addr.get(self.misses.get(&at)?)
    }

    /// Book a hook whose patch is already in the code (a forked child's
    /// copy of its parent's).
    pub fn book(&mut self, hook: Hook) {
        match &hook.probe {
            Probe::Int3 { stub, .. } => {
                self.returns
                    .insert(stub + int3::stub().return_int3, hook.addr);
            }
            Probe::Jump { code, .. } => {
                self.misses.insert(code.miss, hook.addr);
            }
        }
        self.by_addr.insert(hook.addr, hook);
    }

    /// Forget the hooks in `range` (an image that was unmapped, with its
    /// code: nothing to restore).
    pub fn forget_in(&mut self, range: &Range<u64>) {
        self.by_addr.retain(|addr, _| !range.contains(addr));
        let by_addr = &self.by_addr;
        self.returns.retain(|_, addr| by_addr.contains_key(addr));
        self.misses.retain(|_, addr| by_addr.contains_key(addr));
    }

    /// Forget every hook (the code they patched is gone: an exec).
    pub fn clear(&mut self) {
        self.by_addr.clear();
        self.returns.clear();
        self.misses.clear();
    }

    /// Move a thread stopped with `regs` out of probe code, to the same place
    /// in the original code: before or after a displaced instruction; at the
    /// function's entry from a stub not yet through its call; at the caller
    /// from a stub past its return, as the stub's `ret` would have left it
    /// (the caller's return address is read through `mem`). `Some(false)`
    /// when the thread is in no probe, `Some(true)` when `regs` changed,
    /// `None` when it stands somewhere that cannot be mapped back.
    pub fn leave(&self, regs: &mut Regs, mem: &dyn Memory) -> Option<bool> {
        for hook in self.by_addr.values() {
            let Probe::Int3 {
                resume_at,
                stub,
                displaced,
            } = &hook.probe
            else {
                continue;
            };
            if let Some(rip) = displaced.original_rip(regs.rip, *resume_at, hook.addr) {
                regs.rip = rip;
                return Some(true);
            }
            match int3::in_stub(regs.rip, *stub) {
                InStub::No => {}
                InStub::NotCalled { pop } => {
                    regs.rsp += pop;
                    regs.rip = hook.addr;
                    return Some(true);
                }
                InStub::Returned { at, pop } => {
                    regs.rip = mem.read_u64(regs.rsp + at).ok()?;
                    regs.rsp += pop;
                    return Some(true);
                }
            }
        }
        Some(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Snapshot;

    fn regs(rip: u64, rsp: u64) -> Regs {
        let mut regs = crate::os::ptrace::zeroed_regs();
        regs.rip = rip;
        regs.rsp = rsp;
        regs
    }

    fn hooks_with_one(addr: u64, slot: u64) -> Hooks {
        // push r12 (glibc malloc's first instruction).
        let (_, displaced) = int3::slot_code(&[0x41, 0x54, 0x55], addr, slot).unwrap();
        let mut hooks = Hooks::default();
        hooks.book(Hook {
            addr,
            orig: vec![0x41],
            probe: Probe::Int3 {
                resume_at: slot + int3::DISPLACED,
                stub: slot,
                displaced,
            },
            kind: HookKind::DebugState,
        });
        hooks
    }

    #[test]
    fn moves_threads_out_of_slots_and_stubs() {
        let (addr, slot) = (0x7f00_0000_1000, 0x7f00_0000_0000);
        let hooks = hooks_with_one(addr, slot);
        let stack = Snapshot::new().with(0x7ffc_0000_0000, &0x5555_1234u64.to_le_bytes());
        // Before the displaced push: at the entry; after it: past it.
        let mut r = regs(slot + int3::DISPLACED, 0x7ffc_0000_0008);
        assert_eq!(hooks.leave(&mut r, &stack), Some(true));
        assert_eq!(r.rip, addr);
        let mut r = regs(slot + int3::DISPLACED + 2, 0x7ffc_0000_0008);
        assert_eq!(hooks.leave(&mut r, &stack), Some(true));
        assert_eq!(r.rip, addr + 2);
        // In the stub past its `lea`: back to the entry, the word undone.
        let mut r = regs(slot + 5, 0x7ffc_0000_0000);
        assert_eq!(hooks.leave(&mut r, &stack), Some(true));
        assert_eq!((r.rip, r.rsp), (addr, 0x7ffc_0000_0008));
        // At the stub's `ret`: to the caller whose address is on the stack.
        let mut r = regs(slot + 16, 0x7ffc_0000_0000);
        assert_eq!(hooks.leave(&mut r, &stack), Some(true));
        assert_eq!((r.rip, r.rsp), (0x5555_1234, 0x7ffc_0000_0008));
        // Elsewhere: nothing to do.
        let mut r = regs(0x400000, 0x7ffc_0000_0000);
        assert_eq!(hooks.leave(&mut r, &stack), Some(false));
        let return_int3 = int3::stub().return_int3;
        assert!(hooks.is_return(slot + return_int3));
        assert!(!hooks.is_return(slot + return_int3 + 1));
    }
}
