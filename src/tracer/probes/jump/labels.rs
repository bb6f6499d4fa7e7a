//! Names in a jump probe's code (see [`super::code`]): its labels, one per
//! place a branch goes to or memptrace needs to know, its registers by
//! role, and the registers that carry a call's arguments.

use iced_x86::code_asm::{
    AsmRegister32, AsmRegister64, CodeAssembler, CodeLabel, ebp, ebx, r8, r9, r9d, r10, r11, r12,
    r13, r14, r15, rbx, rcx, rdi, rdx, rsi,
};

use super::layout::slot;

// Registers by role. While a probe runs, the caller-saved registers that
// carry no argument (System V ABI) serve it, and it saves the callee-saved
// ones its walk uses. r9 carries a sixth argument only into a mapping
// function, and `code::room` keeps it in the slot first: after that it serves
// several roles, one at a time, each named here.

/// The thread's slot, from `code::enter` on.
pub(super) const SLOT: AsmRegister64 = r10;
/// Where the record goes in the ring, from `code::room` on.
pub(super) const RECORD: AsmRegister64 = r11;
/// The walk's frame: its address (a return address, or an interrupted
/// address + 1), its CFA so far (its stack pointer), its rbp.
pub(super) const IP: AsmRegister64 = r12;
pub(super) const CFA: AsmRegister64 = r13;
pub(super) const BP: AsmRegister64 = r14;
/// Where the walk writes the next frame.
pub(super) const OUT: AsmRegister64 = r15;
/// Frames the walk may still take.
pub(super) const LEFT: AsmRegister64 = rbx;
pub(super) const LEFT32: AsmRegister32 = ebx;
/// The record's flags, while the walk runs.
pub(super) const FLAGS32: AsmRegister32 = ebp;
/// The end of the thread's stack, while the walk runs...
pub(super) const STACK_END: AsmRegister64 = r9;
/// ...but for a table's search, which holds the SVMA it looks for there
/// (and reloads the stack's end after).
pub(super) const SVMA: AsmRegister64 = r9;
pub(super) const SVMA32: AsmRegister32 = r9d;
/// The function's result, while its record is finished.
pub(super) const RESULT: AsmRegister64 = r9;
/// The interrupted probe's slot, while a signal handler's call looks for
/// the thread's signal slot.
pub(super) const INTERRUPTED: AsmRegister64 = r9;

/// The labels of a probe.
pub(super) struct Labels {
    pub(super) entry: CodeLabel,
    pub(super) miss: CodeLabel,
    pub(super) found: CodeLabel,
    pub(super) claim: CodeLabel,
    pub(super) outermost: CodeLabel,
    pub(super) only_caller: CodeLabel,
    pub(super) frame: CodeLabel,
    pub(super) dir_loop: CodeLabel,
    pub(super) dir_left: CodeLabel,
    pub(super) dir_end: CodeLabel,
    pub(super) key_loop: CodeLabel,
    pub(super) key_left: CodeLabel,
    pub(super) key_end: CodeLabel,
    pub(super) keep_bp: CodeLabel,
    pub(super) frame_pointer: CodeLabel,
    pub(super) signal: CodeLabel,
    pub(super) cache_ok: CodeLabel,
    pub(super) lookup: CodeLabel,
    pub(super) found_rule: CodeLabel,
    pub(super) have_rule: CodeLabel,
    pub(super) truncated: CodeLabel,
    pub(super) full: CodeLabel,
    pub(super) walked: CodeLabel,
    pub(super) ret_path: CodeLabel,
    pub(super) ret_claim: CodeLabel,
    pub(super) ret_release: CodeLabel,
    pub(super) ret_out: CodeLabel,
    pub(super) stored: CodeLabel,
    pub(super) release_nested: CodeLabel,
    pub(super) release: CodeLabel,
    pub(super) skip_nested: CodeLabel,
    pub(super) in_probe: CodeLabel,
    pub(super) wait_room: CodeLabel,
    pub(super) sleep: CodeLabel,
    pub(super) let_through: CodeLabel,
    pub(super) displaced: CodeLabel,
    pub(super) back: CodeLabel,
    pub(super) end: CodeLabel,
}

impl Labels {
    pub(super) fn new(a: &mut CodeAssembler) -> Labels {
        Labels {
            entry: a.create_label(),
            miss: a.create_label(),
            found: a.create_label(),
            claim: a.create_label(),
            outermost: a.create_label(),
            only_caller: a.create_label(),
            frame: a.create_label(),
            dir_loop: a.create_label(),
            dir_left: a.create_label(),
            dir_end: a.create_label(),
            key_loop: a.create_label(),
            key_left: a.create_label(),
            key_end: a.create_label(),
            keep_bp: a.create_label(),
            frame_pointer: a.create_label(),
            signal: a.create_label(),
            cache_ok: a.create_label(),
            lookup: a.create_label(),
            found_rule: a.create_label(),
            have_rule: a.create_label(),
            truncated: a.create_label(),
            full: a.create_label(),
            walked: a.create_label(),
            ret_path: a.create_label(),
            ret_claim: a.create_label(),
            ret_release: a.create_label(),
            ret_out: a.create_label(),
            stored: a.create_label(),
            release_nested: a.create_label(),
            release: a.create_label(),
            skip_nested: a.create_label(),
            in_probe: a.create_label(),
            wait_room: a.create_label(),
            sleep: a.create_label(),
            let_through: a.create_label(),
            displaced: a.create_label(),
            back: a.create_label(),
            end: a.create_label(),
        }
    }
}

/// The registers carrying a call's arguments, and the slot fields that keep
/// them while its probe runs: three for an allocator call, six for a
/// mapping call.
pub(super) fn arg_regs(map: bool) -> &'static [(AsmRegister64, u64)] {
    const SIX: [(AsmRegister64, u64); 6] = [
        (rdi, slot::ARG0),
        (rsi, slot::ARG1),
        (rdx, slot::ARG2),
        (rcx, slot::ARG3),
        (r8, slot::ARG4),
        (r9, slot::ARG5),
    ];
    if map { &SIX } else { &SIX[..3] }
}
