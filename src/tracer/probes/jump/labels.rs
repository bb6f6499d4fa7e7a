//! Names in a jump probe's code (see [`super::code`]): its labels, one per
//! place a branch goes to or memptrace needs to know, and the registers
//! that carry a call's arguments.

use iced_x86::code_asm::{AsmRegister64, CodeAssembler, CodeLabel, r8, r9, rcx, rdi, rdx, rsi};

use super::layout::slot;

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
