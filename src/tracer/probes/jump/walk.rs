//! Parts of a jump probe (see [`super::code`]): finding a thread's slot,
//! and, in its stack walk, the thread's cache of rules and the step
//! through a signal frame.
//!
//! Registers of the walk: r12 the frame's address (a return address, or
//! an interrupted address + 1), r13 its CFA so far (its stack pointer), r14
//! rbp, r9 the end of the thread's stack, r10 the slot.

use iced_x86::code_asm::*;

use super::layout::{self, slot};
use crate::unwind::signal;

/// r10 = the slot whose key is rax (the key of a thread: see
/// [`layout::key_of`]), and on at `found`; falls through when none of the
/// `PROBES` slots from its home has it. Clobbers r11.
pub(super) fn find_slot(
    a: &mut CodeAssembler,
    control: u64,
    found: CodeLabel,
) -> Result<(), IcedError> {
    a.mov(r11, layout::HASH)?;
    a.imul_2(r11, rax)?;
    a.shr(r11, 64 - layout::SLOT_BITS)?;
    a.shl(r11, layout::SLOT_SIZE.trailing_zeros())?;
    a.mov(r10, control + layout::HEADER_SIZE)?;
    a.add(r10, r11)?;
    for i in 0..layout::PROBES {
        a.cmp(qword_ptr(r10 + slot::KEY as i32), rax)?;
        a.je(found)?;
        if i + 1 < layout::PROBES {
            a.add(r10, layout::SLOT_SIZE as i32)?;
        }
    }
    Ok(())
}

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
