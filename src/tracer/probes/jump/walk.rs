//! Parts of a jump probe's stack walk (see [`super::code`]): the thread's
//! cache of rules, and the step through a signal frame.
//!
//! Registers of the walk: r12 the frame's address (a return address, or
//! an interrupted address + 1), r13 its CFA so far (its stack pointer), r14
//! rbp, r9 the end of the thread's stack, r10 the slot.

use iced_x86::code_asm::*;

use super::layout::{self, slot};
use crate::unwind::signal;

/// `reg` = the entry of the thread's rule cache (r10: its slot) for the
/// return address in r12: (address, rule), 16 bytes, direct-mapped by a
/// Fibonacci hash.
pub(super) fn cache_entry(a: &mut CodeAssembler, reg: AsmRegister64) -> Result<(), IcedError> {
    a.mov(reg, layout::HASH)?;
    a.imul_2(reg, r12)?;
    a.shr(reg, 64 - layout::CACHE_BITS)?;
    a.shl(reg, 4)?;
    a.add(reg, qword_ptr(r10 + slot::CACHE as i32))?;
    Ok(())
}

/// r12 returns into the signal-return trampoline (rule `SIGNAL`): the next
/// frame is the code the signal interrupted, whose registers the kernel
/// saved above the handler's frame (r13, its CFA). Read inside the stack
/// only; the interrupted stack pointer must lie above that context (a
/// handler on an alternate stack ends the walk). Then r12 = its rip + 1,
/// r13 = its rsp, r14 = its rbp, and on at `frame`; else at `truncated`.
/// Clobbers rcx and rdx.
pub(super) fn signal_frame(
    a: &mut CodeAssembler,
    frame: CodeLabel,
    truncated: CodeLabel,
) -> Result<(), IcedError> {
    a.lea(rcx, qword_ptr(r13 + (signal::RIP + 8) as i32))?;
    a.cmp(rcx, r9)?;
    a.ja(truncated)?;
    a.mov(rdx, qword_ptr(r13 + signal::RSP as i32))?;
    a.cmp(rdx, rcx)?;
    a.jb(truncated)?;
    a.cmp(rdx, r9)?;
    a.ja(truncated)?;
    a.mov(rcx, qword_ptr(r13 + signal::RIP as i32))?;
    a.test(rcx, rcx)?;
    a.jz(truncated)?;
    a.lea(r12, qword_ptr(rcx + 1))?;
    a.mov(r14, qword_ptr(r13 + signal::RBP as i32))?;
    a.mov(r13, rdx)?;
    a.jmp(frame)?;
    Ok(())
}
