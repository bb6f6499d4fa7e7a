//! Whether memptrace is still there, as a probe asks it.
//!
//! memptrace's death (SIGKILL, an OOM kill, a panic) must never harm a
//! process it attached to: without PTRACE_O_EXITKILL the process runs on,
//! and its probes must then neither trap for memptrace (a thread without a
//! slot) nor wait for it forever (a full ring). Three words of the control
//! area's header tell them:
//! - `ALIVE_WORD`: a thread id of memptrace's, which the kernel clears the
//!   moment memptrace dies (a robust futex: see `os::sentinel`), and
//!   memptrace when it lets go of the area. Every probe looks at it first
//!   (one load and a test): with no id there it runs the function, and
//!   records and counts nothing, since nobody will read it.
//! - `GONE`: set when memptrace lets go of the area.
//! - `ALIVE_TSC`, `ALIVE_TICKS`: memptrace's heartbeat (the time-stamp
//!   counter, stored at every 100 ms tick of its wait loop and whenever it
//!   lets a thread run) and the age at which it counts as gone (about a
//!   second; 0 for a launched program, which never gives up on memptrace).
//!   Only the slow paths look at it (a thread with no slot, a full ring):
//!   a memptrace alive but stalled (stopped, or stuck) is given up on
//!   there, and the calls let through are counted (`LET_THROUGH`).
//!
//! What still traps or faults without memptrace: a thread that passed the
//! first test just before memptrace died, and a fault of a probe's stack
//! walk (a thread stack smaller than memptrace read it), which memptrace
//! would turn into a truncated stack.

use iced_x86::code_asm::*;
use iced_x86::{BlockEncoderOptions, Instruction};

use super::code::{AsmError, ProbeCode};
use super::layout;
use crate::os::sentinel::TID_MASK;

/// Go to `gone` when memptrace looks gone: it said so (`GONE`), it died
/// (`ALIVE_WORD`), or its last heartbeat is more than `ALIVE_TICKS` counter
/// ticks old (when that is not 0). A heartbeat ahead of this CPU's counter
/// (counters a few ticks apart between CPUs) is a fresh one: the
/// difference is compared signed. Keeps the arguments (rdi, rsi, rdx) and
/// r10; clobbers rax, rcx, r8, r9, r11.
pub fn if_gone(a: &mut CodeAssembler, control: u64, gone: CodeLabel) -> Result<(), IcedError> {
    a.mov(r11, control)?;
    a.cmp(qword_ptr(r11 + layout::GONE as i32), 0)?;
    a.jne(gone)?;
    a.test(dword_ptr(r11 + layout::ALIVE_WORD as i32), TID_MASK)?;
    a.jz(gone)?;
    a.mov(r8, rdx)?;
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.mov(rdx, r8)?;
    a.sub(rax, qword_ptr(r11 + layout::ALIVE_TSC as i32))?;
    // No limit (0): the largest difference, never exceeded.
    a.mov(rcx, qword_ptr(r11 + layout::ALIVE_TICKS as i32))?;
    a.mov(r9, i64::MAX as u64)?;
    a.test(rcx, rcx)?;
    a.cmovz(rcx, r9)?;
    a.cmp(rax, rcx)?;
    a.jg(gone)
}

/// The gate of a function whose call memptrace must see but where an int3
/// would kill the process without memptrace (the dynamic linker's
/// `_dl_debug_state`, called when images come or go): the function's entry
/// jumps here; the gate stops at its int3 (`miss` in the returned code) for
/// memptrace while memptrace is there, and runs the `displaced`
/// instructions and goes on at `resume` either way. Made for control area
/// `control`, to live at `at`. Clobbers rax, rcx, r8, r9, r11 and the flags
/// (dead at the entry of a function that takes no argument).
pub fn gate(
    control: u64,
    displaced: &[Instruction],
    resume: u64,
    at: u64,
) -> Result<ProbeCode, AsmError> {
    let mut a = CodeAssembler::new(64)?;
    let (mut entry, mut trap, mut through, mut back, mut end) = (
        a.create_label(),
        a.create_label(),
        a.create_label(),
        a.create_label(),
        a.create_label(),
    );
    a.set_label(&mut entry)?;
    if_gone(&mut a, control, through)?;
    a.set_label(&mut trap)?;
    a.int3()?;
    a.set_label(&mut through)?;
    let mut marks = Vec::new();
    for (i, insn) in displaced.iter().enumerate() {
        let mut mark = a.create_label();
        if i > 0 {
            a.set_label(&mut mark)?;
        }
        a.add_instruction(*insn)?;
        marks.push(mark);
    }
    a.set_label(&mut back)?;
    a.jmp(resume)?;
    a.set_label(&mut end)?;
    a.int3()?;
    let result = a.assemble_options(at, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)?;
    let ip = |label: &CodeLabel| result.label_ip(label);
    let first = ip(&through)?;
    let mut displaced_map = Vec::new();
    for (i, (mark, insn)) in marks.iter().zip(displaced).enumerate() {
        let here = if i == 0 { first } else { ip(mark)? };
        displaced_map.push((here, insn.ip()));
    }
    displaced_map.push((ip(&back)?, resume));
    let entry = ip(&entry)?;
    Ok(ProbeCode {
        bytes: result.inner.code_buffer.clone(),
        entry,
        miss: ip(&trap)?,
        ret_path: None,
        walk: entry..entry,
        truncated: entry,
        displaced: first,
        displaced_map,
        end: ip(&end)?,
    })
}

/// [`if_gone`], keeping rcx, r8 and r9 (`keep`: a mapping call's arguments,
/// which it clobbers) on the stack meanwhile.
pub fn if_gone_keeping(
    a: &mut CodeAssembler,
    control: u64,
    gone: CodeLabel,
    keep: bool,
) -> Result<(), IcedError> {
    if !keep {
        return if_gone(a, control, gone);
    }
    let mut out = a.create_label();
    let mut here = a.create_label();
    for reg in [rcx, r8, r9] {
        a.push(reg)?;
    }
    if_gone(a, control, out)?;
    for reg in [r9, r8, rcx] {
        a.pop(reg)?;
    }
    a.jmp(here)?;
    a.set_label(&mut out)?;
    for reg in [r9, r8, rcx] {
        a.pop(reg)?;
    }
    a.jmp(gone)?;
    a.set_label(&mut here)?;
    a.nop()?;
    Ok(())
}
