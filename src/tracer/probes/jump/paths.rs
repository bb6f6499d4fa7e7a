//! A jump probe's side paths (see [`super::code`]): the calls it lets
//! through unrecorded, its wait for room in the ring, the way on when
//! memptrace is gone, the displaced instructions, and the tail that
//! finishes and commits a record.

use iced_x86::code_asm::*;

use super::code::ProbeSpec;
use super::labels::{INTERRUPTED, Labels, RECORD, SLOT};
use super::layout::{self, Called, RecordHead, record, slot};
use super::liveness::if_gone_keeping;
use super::walk::find_slot;

/// The calls not recorded, counted.
pub(super) fn not_recorded(
    a: &mut CodeAssembler,
    l: &mut Labels,
    spec: &ProbeSpec,
) -> Result<(), IcedError> {
    let map = matches!(spec.what, Called::Map(_));
    // Not recorded: nested in the thread's call, in a signal handler
    // inside a probe of the thread, or a vfork child's. Counted for an
    // allocator call only: a mapping call inside another (sbrk's brk) is
    // left out by design, as the int3 path leaves it out, and goes
    // straight to `release` or `displaced` (see `code::claim`).
    if !map {
        a.set_label(&mut l.release_nested)?;
        a.inc(qword_ptr(SLOT + slot::NESTED as i32))?;
    }
    a.set_label(&mut l.release)?;
    a.mov(qword_ptr(SLOT + slot::BUSY as i32), 0)?;
    a.jmp(l.displaced)?;
    // A signal handler's call inside a probe of the thread: its own slot,
    // once (see `layout::SIGNAL_KEY`); rax holds the key.
    if !map {
        a.set_label(&mut l.in_probe)?;
        a.bt(rax, 62)?;
        a.jc(l.skip_nested)?;
        a.mov(INTERRUPTED, SLOT)?;
        a.bts(rax, 62)?;
        find_slot(a, spec.control, l.found)?;
        a.mov(SLOT, INTERRUPTED)?; // no signal slot: counted in the interrupted one's
        a.set_label(&mut l.skip_nested)?;
        a.inc(qword_ptr(SLOT + slot::NESTED as i32))?;
        a.jmp(l.displaced)?;
    }
    Ok(())
}

/// No room: wait on the ring's tail for memptrace (1 ms at most), then
/// start over.
pub(super) fn wait_room(
    a: &mut CodeAssembler,
    l: &mut Labels,
    spec: &ProbeSpec,
) -> Result<(), IcedError> {
    let map = matches!(spec.what, Called::Map(_));
    // No room: wait on the ring's tail for memptrace (1 ms at most), then
    // start over.
    a.set_label(&mut l.wait_room)?;
    a.mov(qword_ptr(SLOT + slot::BUSY as i32), 0)?;
    if_gone_keeping(a, spec.control, l.let_through, map)?;
    a.inc(qword_ptr(SLOT + slot::WAITS as i32))?;
    // Say so, then look at the tail again: memptrace stores the tail, then
    // reads WAITING; the thread stores WAITING, then reads the tail. With a
    // full barrier on each side (xchg here), one of them sees the other's
    // store: either memptrace wakes the thread, or the thread sees the room.
    a.mov(eax, 1)?;
    a.xchg(qword_ptr(SLOT + slot::WAITING as i32), rax)?;
    a.mov(r11, qword_ptr(SLOT + slot::HEAD as i32))?;
    a.sub(r11, qword_ptr(SLOT + slot::TAIL as i32))?;
    a.cmp(r11, (layout::RING_SIZE - layout::MAX_RECORD) as i32)?;
    a.ja(l.sleep)?;
    a.mov(qword_ptr(SLOT + slot::WAITING as i32), 0)?;
    a.jmp(l.entry)?;
    a.set_label(&mut l.sleep)?;
    let kept = [rdi, rsi, rdx, rcx, r8, r9];
    let kept = if map { &kept[..] } else { &kept[..3] };
    for &reg in kept {
        a.push(reg)?;
    }
    // Wake memptrace's tracer thread, which may sleep (tgkill, SIGCHLD),
    // unless told not to (`NO_WAKE`: a seccomp filter could kill the
    // program for it; memptrace finds the full ring by polling)...
    let mut woken = a.create_label();
    a.mov(rax, spec.control + layout::TRACER_PID)?;
    a.cmp(
        qword_ptr(rax + (layout::NO_WAKE - layout::TRACER_PID) as i32),
        0,
    )?;
    a.jne(woken)?;
    a.mov(rdi, qword_ptr(rax))?;
    a.mov(rsi, qword_ptr(rax + 8))?;
    a.mov(edx, libc::SIGCHLD as u32)?;
    a.mov(eax, libc::SYS_tgkill as u32)?;
    a.syscall()?;
    a.set_label(&mut woken)?;
    // ...and wait on the ring's tail, 1 ms at most, then start over.
    a.mov(eax, libc::SYS_futex as u32)?;
    a.lea(rdi, qword_ptr(SLOT + slot::TAIL as i32))?;
    a.xor(esi, esi)?; // FUTEX_WAIT, shared: memptrace wakes it from its mapping
    a.mov(edx, dword_ptr(SLOT + slot::TAIL as i32))?;
    a.mov(r10, spec.control + layout::WAIT_TIMESPEC)?; // the timeout (syscall(2): SLOT is the 4th argument)
    a.xor(r8d, r8d)?;
    a.xor(r9d, r9d)?;
    a.syscall()?;
    for &reg in kept.iter().rev() {
        a.pop(reg)?;
    }
    a.jmp(l.entry)?;
    Ok(())
}

/// The call goes on unrecorded when memptrace is gone (counted), then
/// the displaced instructions, relocated, and the way back: returns a
/// label per displaced instruction.
pub(super) fn let_through(
    a: &mut CodeAssembler,
    l: &mut Labels,
    spec: &ProbeSpec,
) -> Result<Vec<CodeLabel>, IcedError> {
    // memptrace is gone: the call goes on unrecorded (counted, for a
    // memptrace that was only slow to answer).
    a.set_label(&mut l.let_through)?;
    a.mov(r11, spec.control + layout::LET_THROUGH)?;
    a.lock().inc(qword_ptr(r11))?;

    // The displaced instructions, relocated, and the way back.
    a.set_label(&mut l.displaced)?;
    let mut marks = Vec::new();
    for (i, insn) in spec.displaced.iter().enumerate() {
        let mut mark = a.create_label();
        if i > 0 {
            a.set_label(&mut mark)?;
        }
        a.add_instruction(*insn)?;
        marks.push(mark);
    }
    a.set_label(&mut l.back)?;
    a.jmp(spec.resume)?;
    a.set_label(&mut l.end)?;
    a.int3()?;
    Ok(marks)
}

/// The tail of a record: TSC, arguments, header, sequence number; then the
/// commit (the head moves past it). r10 slot, r11 record. Keeps r9 and rsi;
/// clobbers rax, rcx, rdx, rdi, r8.
pub(super) fn finish_record(a: &mut CodeAssembler, spec: &ProbeSpec) -> Result<(), IcedError> {
    a.mov(r8, qword_ptr(SLOT + slot::HEAD as i32))?;
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.mov(qword_ptr(RECORD + record::TSC as i32), rax)?;
    let map = [
        (slot::ARG3, record::ARG3),
        (slot::ARG4, record::ARG4),
        (slot::ARG5, record::ARG5),
    ];
    let args = [
        (slot::ARG0, record::ARG0),
        (slot::ARG1, record::ARG1),
        (slot::ARG2, record::ARG2),
    ];
    let six = matches!(spec.what, Called::Map(_));
    for &(from, to) in args.iter().chain(if six { &map[..] } else { &[] }) {
        a.mov(rcx, qword_ptr(SLOT + from as i32))?;
        a.mov(qword_ptr(RECORD + to as i32), rcx)?;
    }
    // The header (see `RecordHead`): the frames and flags the walk left in
    // the slot, the size they make, and the op and probe, known now.
    const { assert!(RecordHead::SIZE_SHIFT == 0) };
    a.mov(rcx, qword_ptr(SLOT + slot::PENDING_FRAMES as i32))?;
    a.movzx(edi, cx)?;
    a.lea(rdx, qword_ptr(rdi * 8 + spec.what.frames_at() as i32))?;
    a.add(r8, rdx)?; // the head past this record
    a.shl(rdi, RecordHead::FRAMES_SHIFT)?;
    a.or(rdi, rdx)?;
    a.shr(ecx, layout::PENDING_FLAGS_SHIFT)?;
    a.and(ecx, 0xff)?;
    a.shl(rcx, RecordHead::FLAGS_SHIFT)?;
    a.or(rdi, rcx)?;
    let known = RecordHead {
        op: spec.what.code(),
        probe: spec.id,
        ..RecordHead::default()
    };
    a.mov(rax, known.pack())?;
    a.or(rdi, rax)?;
    a.mov(qword_ptr(RECORD + record::HEAD as i32), rdi)?;
    a.mov(rax, spec.control + layout::SEQ)?;
    a.mov(ecx, 1)?;
    a.lock().xadd(qword_ptr(rax), rcx)?;
    a.mov(qword_ptr(RECORD + record::SEQ as i32), rcx)?;
    a.mov(qword_ptr(SLOT + slot::HEAD as i32), r8)?;
    Ok(())
}
