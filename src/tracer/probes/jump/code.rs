//! The machine code of a jump probe, written with iced-x86's code assembler.
//!
//! A hooked function's entry jumps (or, where a jump cannot be planted, an
//! int3 sends the thread) to its probe, which:
//!
//! 1. finds its thread's slot in the control area by hashing the thread
//!    pointer (`rdfsbase`, or `fs:[0]` where the kernel does not allow it);
//!    a thread without a slot traps (`int3`) for memptrace to give it one,
//!    unless memptrace is gone (below);
//! 2. records nothing for a call made inside the thread's outermost call in
//!    progress (realloc entering malloc) and for a vfork child; a signal
//!    handler's call made while a probe of the thread was running goes to
//!    the thread's signal slot (see [`layout::SIGNAL_KEY`]);
//! 3. waits (futex) while its ring has no room for a record: nothing is
//!    ever dropped while memptrace is there;
//! 4. walks the caller's stack with the unwind tables memptrace wrote into
//!    the control area (CFA = rsp or rbp + offset; return address at
//!    CFA - 8; rbp saved at a fixed distance below the CFA or unchanged),
//!    reading nothing outside the thread's stack, into the ring past its head,
//!    through signal frames (see [`super::walk`]);
//! 5. for `free`: finishes the record (sequence number, TSC, arguments) and
//!    commits it by moving the head, then runs the displaced instructions;
//!    for a call that returns a block: calls the displaced instructions, so
//!    that the function returns into the probe, which then finishes and
//!    commits the record with the result and returns to the caller.
//!
//! Fail open (see [`super::liveness`]): a probe that finds memptrace dead
//! runs the function and records nothing; one that would wait for
//! memptrace (no slot, a full ring) and finds it gone or not answering for
//! about a second lets the call through unrecorded, and counts it.
//!
//! The call is made through `lea rsp, [rsp-8]; call`: the caller's return
//! address stays where it is, unchanged, inside the function the stack is
//! 16 bytes deeper and still aligned, and calls and returns stay paired. The
//! word the `lea` skips holds the slot's address for the return path.
//!
//! Registers (System V ABI): at a function's entry rdi, rsi and rdx carry
//! the arguments (no allocator function takes more than three, nor any
//! on the stack), and rax, rcx, r8-r11 carry nothing the function may use;
//! at its return, rax carries the result and every register but rax, rdx
//! and the callee-saved ones is dead. The probe keeps to that: it saves the
//! callee-saved registers it uses and puts the arguments back before the
//! function runs, and it keeps rax and rdx on the way back. A mapping
//! function (mmap, munmap, ..., attach only) takes up to six, in rcx, r8
//! and r9 too: its probe leaves them alone until it keeps them in the
//! slot with the others, and it uses a slot of its own (see
//! [`layout::MAP_KEY`]), so that a mapping call made inside an allocator
//! call is recorded.

use iced_x86::code_asm::*;
use iced_x86::{BlockEncoderOptions, Instruction};

use super::labels::{
    BP, CFA, FLAGS32, IP, LEFT, LEFT32, Labels, OUT, RECORD, RESULT, SLOT, STACK_END, SVMA, SVMA32,
    arg_regs,
};
use super::layout::{self, Called, dir, record, rule, slot};
use super::liveness::if_gone_keeping;
use super::paths::{finish_record, let_through, not_recorded, wait_room};
use super::walk::{cache_entry, find_slot, signal_frame};
use crate::event::Op;
use crate::os::sentinel::TID_MASK;

/// What a probe is made for.
#[derive(Clone, Debug)]
pub struct ProbeSpec {
    /// The probe's number in its space, written into each record.
    pub id: u16,
    pub what: Called,
    /// The control area's address in the target.
    pub control: u64,
    /// The instructions the probe's entry displaces (decoded at their
    /// addresses), and where the function goes on after them.
    pub displaced: Vec<Instruction>,
    pub resume: u64,
    /// Return addresses to take at most (`--max-depth`).
    pub max_frames: u64,
    /// The kernel lets user code read the fs base (`rdfsbase`).
    pub fsgsbase: bool,
}

/// A probe's code and the addresses memptrace needs to know in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeCode {
    pub bytes: Vec<u8>,
    /// The probe's first instruction (where the entry's jump goes).
    pub entry: u64,
    /// The int3 of a thread without a slot.
    pub miss: u64,
    /// Where the function returns to (a call that returns a block).
    pub ret_path: Option<u64>,
    /// The stack walk: a fault of an instruction in `walk` (a stack mapping
    /// smaller than memptrace knew) goes on at `truncated`.
    pub walk: std::ops::Range<u64>,
    pub truncated: u64,
    /// The displaced instructions (relocated), then the jump back.
    pub displaced: u64,
    /// `(address here, address in the function)` of each displaced
    /// instruction, and of the jump back (which stands for `resume`): where
    /// a thread standing here belongs once the probe is gone.
    pub displaced_map: Vec<(u64, u64)>,
    pub end: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot assemble the probe: {0}")]
pub struct AsmError(#[from] IcedError);

/// The probe for `spec`, to live at `at`.
pub fn probe(spec: &ProbeSpec, at: u64) -> Result<ProbeCode, AsmError> {
    let mut a = CodeAssembler::new(64)?;
    let mut l = Labels::new(&mut a);
    let returns = spec.what.returns();

    enter(&mut a, &mut l, spec)?;
    claim(&mut a, &mut l, spec)?;
    room(&mut a, &mut l, spec)?;
    walk(&mut a, &mut l, spec)?;
    record(&mut a, &mut l, spec)?;
    not_recorded(&mut a, &mut l, spec)?;
    wait_room(&mut a, &mut l, spec)?;
    let marks = let_through(&mut a, &mut l, spec)?;

    let result = a.assemble_options(at, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)?;
    let ip = |label: &CodeLabel| result.label_ip(label);
    let displaced = ip(&l.displaced)?;
    let mut displaced_map = Vec::new();
    for (i, (mark, insn)) in marks.iter().zip(&spec.displaced).enumerate() {
        let here = if i == 0 { displaced } else { ip(mark)? };
        displaced_map.push((here, insn.ip()));
    }
    displaced_map.push((ip(&l.back)?, spec.resume));
    let bytes = result.inner.code_buffer.clone();
    Ok(ProbeCode {
        entry: ip(&l.entry)?,
        miss: ip(&l.miss)?,
        ret_path: if returns {
            Some(ip(&l.ret_path)?)
        } else {
            None
        },
        walk: ip(&l.frame)?..ip(&l.walked)?,
        truncated: ip(&l.truncated)?,
        displaced,
        displaced_map,
        end: ip(&l.end)?,
        bytes,
    })
}

/// Steps 0 and 1: on at once when memptrace is gone; else the thread's
/// slot into [`SLOT`] (the key in rax), or the miss int3.
fn enter(a: &mut CodeAssembler, l: &mut Labels, spec: &ProbeSpec) -> Result<(), IcedError> {
    let map = matches!(spec.what, Called::Map(_));
    // 0. memptrace is gone (see `liveness`): straight on, unrecorded.
    a.set_label(&mut l.entry)?;
    a.mov(r11, spec.control + layout::ALIVE_WORD)?;
    a.test(dword_ptr(r11), TID_MASK)?;
    a.jz(l.displaced)?;
    // 1. The thread's slot: SLOT; the key in rax.
    if spec.fsgsbase {
        a.rdfsbase(rax)?;
    } else {
        a.mov(rax, qword_ptr(0u64).fs())?;
    }
    a.inc(rax)?;
    if map {
        a.bts(rax, 63)?; // layout::MAP_KEY
    }
    find_slot(a, spec.control, l.found)?;
    // No slot: memptrace gives it one at the int3, if memptrace is there.
    if_gone_keeping(a, spec.control, l.let_through, map)?;
    a.set_label(&mut l.miss)?;
    a.int3()?;
    a.jmp(l.entry)?;
    Ok(())
}

/// Step 2: claim the slot, or go on unrecorded (busy, paused, nested).
fn claim(a: &mut CodeAssembler, l: &mut Labels, spec: &ProbeSpec) -> Result<(), IcedError> {
    let map = matches!(spec.what, Called::Map(_));
    // 2. Busy, paused, nested.
    a.set_label(&mut l.found)?;
    a.mov(r11, qword_ptr(SLOT + slot::BUSY as i32))?;
    a.test(r11, r11)?;
    a.jz(l.claim)?;
    a.cmp(rsp, r11)?;
    a.jb(if map { l.displaced } else { l.in_probe })?;
    a.set_label(&mut l.claim)?;
    a.mov(qword_ptr(SLOT + slot::BUSY as i32), rsp)?;
    a.test(byte_ptr(SLOT + slot::FLAGS as i32), 1)?;
    a.jnz(l.release)?;
    a.mov(r11, qword_ptr(SLOT + slot::PENDING_SP as i32))?;
    a.test(r11, r11)?;
    a.jz(l.outermost)?;
    a.cmp(rsp, r11)?;
    a.jb(if map { l.release } else { l.release_nested })?;
    a.inc(qword_ptr(SLOT + slot::ABANDONED as i32))?;
    a.mov(qword_ptr(SLOT + slot::PENDING_SP as i32), 0)?;
    a.set_label(&mut l.outermost)?;
    Ok(())
}

/// Step 3: room in the ring, or wait; keep the arguments; [`RECORD`] =
/// where the record goes.
fn room(a: &mut CodeAssembler, l: &mut Labels, spec: &ProbeSpec) -> Result<(), IcedError> {
    let map = matches!(spec.what, Called::Map(_));
    // 3. Room in the ring, or wait.
    a.mov(rax, qword_ptr(SLOT + slot::HEAD as i32))?;
    a.sub(rax, qword_ptr(SLOT + slot::TAIL as i32))?;
    a.cmp(rax, (layout::RING_SIZE - layout::MAX_RECORD) as i32)?;
    a.ja(l.wait_room)?;
    for &(reg, field) in arg_regs(map) {
        a.mov(qword_ptr(SLOT + field as i32), reg)?;
    }
    a.mov(RECORD, qword_ptr(SLOT + slot::HEAD as i32))?;
    a.and(RECORD, (layout::RING_SIZE - 1) as i32)?;
    a.add(RECORD, qword_ptr(SLOT + slot::RING as i32))?;
    Ok(())
}

/// Step 4: the stack walk, into the ring past the head; its count and
/// flags into the slot (see [`layout::PENDING_FLAGS_SHIFT`]).
fn walk(a: &mut CodeAssembler, l: &mut Labels, spec: &ProbeSpec) -> Result<(), IcedError> {
    let frames_at = spec.what.frames_at() as i32;
    // 4. The stack walk. IP ip, CFA sp (the frame's CFA so far), BP bp,
    // OUT where the next frame goes, LEFT frames left, STACK_END the stack's end,
    // FLAGS32 the record's flags.
    const SAVED: i32 = 6 * 8;
    for reg in [LEFT, rbp, IP, CFA, BP, OUT] {
        a.push(reg)?;
    }
    a.mov(IP, qword_ptr(rsp + SAVED))?;
    a.lea(CFA, qword_ptr(rsp + SAVED + 8))?;
    a.mov(BP, rbp)?; // the caller's: the function has not run yet
    a.lea(OUT, qword_ptr(RECORD + frames_at))?;
    a.mov(LEFT32, spec.max_frames.clamp(1, layout::MAX_FRAMES) as u32)?;
    a.mov(STACK_END, qword_ptr(SLOT + slot::STACK_HI as i32))?;
    a.xor(FLAGS32, FLAGS32)?;
    // The thread's cache of rules holds for one directory: when images came
    // or went since it was filled, it starts empty.
    a.mov(rax, spec.control + layout::DIRECTORY)?;
    a.mov(rax, qword_ptr(rax))?;
    a.cmp(rax, qword_ptr(SLOT + slot::CACHE_DIR as i32))?;
    a.je(l.cache_ok)?;
    a.mov(qword_ptr(SLOT + slot::CACHE_DIR as i32), rax)?;
    a.mov(rdi, qword_ptr(SLOT + slot::CACHE as i32))?;
    a.mov(ecx, (layout::CACHE_SIZE / 8) as u32)?;
    a.xor(eax, eax)?;
    a.rep().stosq()?;
    a.set_label(&mut l.cache_ok)?;
    a.lea(rcx, qword_ptr(rsp + SAVED))?;
    a.cmp(rcx, qword_ptr(SLOT + slot::STACK_LO as i32))?;
    a.jb(l.only_caller)?;
    a.cmp(rcx, STACK_END)?;
    a.jae(l.only_caller)?;

    a.set_label(&mut l.frame)?;
    a.mov(qword_ptr(OUT), IP)?;
    a.add(OUT, 8)?;
    a.dec(LEFT)?;
    a.jz(l.full)?;
    // The rule for ip: from the thread's cache of the return addresses it
    // met (stacks repeat), else from the directory and the image's table.
    cache_entry(a, rdx)?;
    a.cmp(qword_ptr(rdx), IP)?;
    a.jne(l.lookup)?;
    a.mov(eax, dword_ptr(rdx + 8))?;
    a.jmp(l.have_rule)?;
    a.set_label(&mut l.lookup)?;
    // The image: the last directory entry starting at or below ip.
    a.mov(rdi, spec.control + layout::DIRECTORY)?;
    a.mov(rdi, qword_ptr(rdi))?;
    a.mov(ecx, dword_ptr(rdi))?;
    a.add(rdi, 16)?;
    a.xor(esi, esi)?;
    a.set_label(&mut l.dir_loop)?;
    a.test(rcx, rcx)?;
    a.jz(l.dir_end)?;
    a.mov(rdx, rcx)?;
    a.shr(rdx, 1)?;
    a.imul_3(rax, rdx, layout::DIR_ENTRY_SIZE as i32)?;
    a.add(rax, rdi)?;
    a.cmp(qword_ptr(rax + dir::START as i32), IP)?;
    a.ja(l.dir_left)?;
    a.mov(rsi, rax)?;
    a.lea(rdi, qword_ptr(rax + layout::DIR_ENTRY_SIZE as i32))?;
    a.sub(rcx, rdx)?;
    a.dec(rcx)?;
    a.jmp(l.dir_loop)?;
    a.set_label(&mut l.dir_left)?;
    a.mov(rcx, rdx)?;
    a.jmp(l.dir_loop)?;
    a.set_label(&mut l.dir_end)?;
    // Outside every image: the stack ends (memptrace would not take such a
    // frame anyway).
    a.mov(eax, rule::UNSUPPORTED)?;
    a.test(rsi, rsi)?;
    a.jz(l.found_rule)?;
    a.cmp(IP, qword_ptr(rsi + dir::END as i32))?;
    a.jae(l.found_rule)?;
    // The row: the last key at or below the call's SVMA (ip - 1 - bias).
    a.lea(rax, qword_ptr(IP - 1))?;
    a.sub(rax, qword_ptr(rsi + dir::BIAS as i32))?;
    a.mov(rdx, rax)?;
    a.shr(rdx, 32)?;
    a.mov(eax, rule::UNSUPPORTED)?;
    a.jnz(l.found_rule)?;
    a.lea(rax, qword_ptr(IP - 1))?;
    a.sub(rax, qword_ptr(rsi + dir::BIAS as i32))?;
    a.mov(SVMA, rax)?;
    a.mov(rdi, qword_ptr(rsi + dir::KEYS as i32))?;
    a.mov(rcx, qword_ptr(rsi + dir::ROWS as i32))?;
    a.mov(r8, qword_ptr(rsi + dir::RULES as i32))?;
    a.sub(r8, rdi)?; // rules are u32 as keys are: rule = key address + r8
    a.xor(esi, esi)?;
    a.set_label(&mut l.key_loop)?;
    a.test(rcx, rcx)?;
    a.jz(l.key_end)?;
    a.mov(rdx, rcx)?;
    a.shr(rdx, 1)?;
    a.lea(rax, qword_ptr(rdi + rdx * 4))?;
    a.cmp(dword_ptr(rax), SVMA32)?;
    a.ja(l.key_left)?;
    a.mov(rsi, rax)?;
    a.lea(rdi, qword_ptr(rax + 4))?;
    a.sub(rcx, rdx)?;
    a.dec(rcx)?;
    a.jmp(l.key_loop)?;
    a.set_label(&mut l.key_left)?;
    a.mov(rcx, rdx)?;
    a.jmp(l.key_loop)?;
    a.set_label(&mut l.key_end)?;
    a.mov(STACK_END, qword_ptr(SLOT + slot::STACK_HI as i32))?;
    // Before the image's first row: no CFI.
    a.mov(eax, rule::NONE)?;
    a.test(rsi, rsi)?;
    a.jz(l.found_rule)?;
    a.mov(eax, dword_ptr(rsi + r8))?;
    a.set_label(&mut l.found_rule)?;
    cache_entry(a, rdx)?;
    a.mov(qword_ptr(rdx), IP)?;
    a.mov(dword_ptr(rdx + 8), eax)?;
    a.set_label(&mut l.have_rule)?;
    a.cmp(eax, rule::END as i32)?;
    a.je(l.walked)?; // the outermost frame: the stack is whole
    a.cmp(eax, rule::NONE as i32)?;
    a.je(l.frame_pointer)?;
    a.cmp(eax, rule::SIGNAL as i32)?;
    a.je(l.signal)?;
    a.test(eax, eax)?;
    a.js(l.truncated)?; // a rule the walk cannot follow
    // CFA = base + offset, above the frame and inside the stack.
    a.mov(ecx, eax)?;
    a.and(ecx, rule::OFFSET_MASK)?;
    a.mov(rdx, CFA)?;
    a.test(eax, rule::RBP_BASED)?;
    a.cmovne(rdx, BP)?;
    a.add(rdx, rcx)?;
    a.lea(rcx, qword_ptr(CFA + 8))?;
    a.cmp(rdx, rcx)?;
    a.jb(l.truncated)?;
    a.cmp(rdx, STACK_END)?;
    a.ja(l.truncated)?;
    a.shr(eax, rule::RBP_SHIFT)?;
    a.and(eax, rule::RBP_MASK)?;
    a.jz(l.keep_bp)?;
    a.shl(rax, 3)?;
    a.mov(rcx, rdx)?;
    a.sub(rcx, rax)?;
    a.cmp(rcx, CFA)?;
    a.jb(l.truncated)?;
    a.mov(BP, qword_ptr(rcx))?;
    a.set_label(&mut l.keep_bp)?;
    a.mov(IP, qword_ptr(rdx - 8))?;
    a.mov(CFA, rdx)?;
    a.test(IP, IP)?;
    a.jnz(l.frame)?;
    a.jmp(l.walked)?;
    // No CFI: the frame pointer, if it points into the stack above the
    // frame: the caller's rbp at [rbp], its return address at [rbp + 8].
    a.set_label(&mut l.frame_pointer)?;
    a.mov(rdx, BP)?;
    a.test(dl, 7)?;
    a.jnz(l.truncated)?;
    a.cmp(rdx, CFA)?;
    a.jb(l.truncated)?;
    a.lea(rcx, qword_ptr(rdx + 16))?;
    a.cmp(rcx, STACK_END)?;
    a.ja(l.truncated)?;
    a.mov(IP, qword_ptr(rdx + 8))?;
    a.mov(BP, qword_ptr(rdx))?;
    a.mov(CFA, rcx)?;
    a.test(IP, IP)?;
    a.jnz(l.frame)?;
    a.jmp(l.walked)?;
    a.set_label(&mut l.signal)?;
    signal_frame(a, l.frame, l.truncated)?;
    a.set_label(&mut l.only_caller)?;
    a.mov(qword_ptr(OUT), IP)?;
    a.add(OUT, 8)?;
    a.set_label(&mut l.truncated)?;
    a.or(FLAGS32, record::TRUNCATED as i32)?;
    a.jmp(l.walked)?;
    a.set_label(&mut l.full)?;
    a.or(FLAGS32, record::FULL as i32)?;
    a.set_label(&mut l.walked)?;
    // rax: frames, rcx: flags.
    a.mov(rax, OUT)?;
    a.sub(rax, RECORD)?;
    a.sub(rax, frames_at)?;
    a.shr(rax, 3)?;
    a.mov(ecx, FLAGS32)?;
    for reg in [OUT, BP, CFA, IP, rbp, LEFT] {
        a.pop(reg)?;
    }
    a.shl(ecx, layout::PENDING_FLAGS_SHIFT)?;
    a.or(rax, rcx)?;
    a.mov(qword_ptr(SLOT + slot::PENDING_FRAMES as i32), rax)?;
    Ok(())
}

/// Step 5: record now (free), or call the function and record its
/// result.
fn record(a: &mut CodeAssembler, l: &mut Labels, spec: &ProbeSpec) -> Result<(), IcedError> {
    let map = matches!(spec.what, Called::Map(_));
    let returns = spec.what.returns();
    // 5. Record now (free), or call the function and record its result.
    if returns {
        a.mov(qword_ptr(SLOT + slot::PENDING_SP as i32), rsp)?;
        for &(reg, field) in arg_regs(map) {
            a.mov(reg, qword_ptr(SLOT + field as i32))?;
        }
        a.mov(qword_ptr(SLOT + slot::BUSY as i32), 0)?;
        a.lea(rsp, qword_ptr(rsp - 8))?;
        a.mov(qword_ptr(rsp), SLOT)?;
        a.call(l.displaced)?;
        a.set_label(&mut l.ret_path)?;
        a.mov(SLOT, qword_ptr(rsp))?;
        a.mov(rcx, qword_ptr(SLOT + slot::BUSY as i32))?;
        a.test(rcx, rcx)?;
        a.jz(l.ret_claim)?;
        a.cmp(rsp, rcx)?;
        a.jb(l.ret_out)?;
        a.set_label(&mut l.ret_claim)?;
        a.mov(qword_ptr(SLOT + slot::BUSY as i32), rsp)?;
        a.lea(rcx, qword_ptr(rsp + 8))?;
        a.cmp(rcx, qword_ptr(SLOT + slot::PENDING_SP as i32))?;
        a.jne(l.ret_release)?;
        a.mov(RESULT, rax)?;
        a.mov(RECORD, qword_ptr(SLOT + slot::HEAD as i32))?;
        a.and(RECORD, (layout::RING_SIZE - 1) as i32)?;
        a.add(RECORD, qword_ptr(SLOT + slot::RING as i32))?;
        a.mov(qword_ptr(RECORD + record::RET as i32), rax)?;
        if spec.what == Called::Alloc(Op::PosixMemalign) {
            // The block, stored through the first argument when it succeeded.
            a.mov(qword_ptr(RECORD + record::STORED as i32), 0)?;
            a.test(eax, eax)?;
            a.jnz(l.stored)?;
            a.mov(rcx, qword_ptr(SLOT + slot::ARG0 as i32))?;
            a.mov(rcx, qword_ptr(rcx))?;
            a.mov(qword_ptr(RECORD + record::STORED as i32), rcx)?;
            a.set_label(&mut l.stored)?;
        }
        a.mov(rsi, rdx)?;
        finish_record(a, spec)?;
        a.mov(rdx, rsi)?;
        a.mov(qword_ptr(SLOT + slot::PENDING_SP as i32), 0)?;
        a.mov(rax, RESULT)?;
        a.set_label(&mut l.ret_release)?;
        a.mov(qword_ptr(SLOT + slot::BUSY as i32), 0)?;
        a.set_label(&mut l.ret_out)?;
        a.lea(rsp, qword_ptr(rsp + 8))?;
        a.ret()?;
    } else {
        a.mov(qword_ptr(RECORD + record::RET as i32), 0)?;
        a.mov(qword_ptr(RECORD + record::STORED as i32), 0)?;
        finish_record(a, spec)?;
        a.mov(rdi, qword_ptr(SLOT + slot::ARG0 as i32))?;
        a.mov(rsi, qword_ptr(SLOT + slot::ARG1 as i32))?;
        a.mov(rdx, qword_ptr(SLOT + slot::ARG2 as i32))?;
        a.mov(qword_ptr(SLOT + slot::BUSY as i32), 0)?;
        a.jmp(l.displaced)?;
    }
    Ok(())
}
