//! Stack buffers: where threads copy their own stacks (int3 probes with
//! framehop stacks, see `tracer::copies`).
//!
//! A mapping shared between the target and memptrace holds one buffer per
//! thread; the copy routine, in a trampoline slot, copies a thread's stack
//! into its buffer and counts the copy done in the buffer's header. The
//! routine writes only below the thread's stack pointer (free until the
//! allocator function runs) and to the thread's own buffer.

use std::collections::HashMap;

use iced_x86::BlockEncoderOptions;
use iced_x86::code_asm::{CodeAssembler, IcedError, qword_ptr, r10, r11, rax, rsp};

use crate::os::ptrace::Tid;
use crate::os::shared::SharedMemory;

/// Bytes of stack copied per call for framehop (less at the top of a stack).
pub const STACK_COPY: u64 = 32 * 1024;

/// The copy routine: a thread sent here at an allocator's entry copies
/// `r10` words of its stack, from rsp up, to `r11` (its buffer in memory
/// shared with memptrace), counts the copy done in the word
/// [`COPY_HEADER`] bytes before `r11`, and jumps to `rax` (the breakpoint's
/// stub or displaced instruction). rax, r10 and r11 hold nothing at a
/// function's entry (System V ABI: scratch registers, no arguments in
/// them), so the function sees nothing changed; the routine writes only
/// below rsp, which is free until the function runs, and to its buffer.
#[derive(Debug)]
pub struct CopyRoutine {
    /// The routine's code, position independent.
    pub bytes: Vec<u8>,
    /// Offset of the first instruction after `push rax`: from here the
    /// continuation is on the stack...
    pub pushed: u64,
    /// ...until the `jmp rax` (after `pop rax`).
    pub jump: u64,
}

/// The copy routine (see [`CopyRoutine`]), assembled once.
pub fn copy_routine() -> &'static CopyRoutine {
    static ROUTINE: std::sync::LazyLock<CopyRoutine> = std::sync::LazyLock::new(|| {
        assemble_copy_routine().expect("the copy routine assembles (a unit test decodes it)")
    });
    &ROUTINE
}

fn assemble_copy_routine() -> Result<CopyRoutine, IcedError> {
    let mut a = CodeAssembler::new(64)?;
    let mut pushed = a.create_label();
    let mut jump = a.create_label();
    a.push(rax)?; // the continuation
    a.set_label(&mut pushed)?;
    a.mov(rax, qword_ptr(rsp + r10 * 8))?;
    a.mov(qword_ptr(r11 + r10 * 8 - 8), rax)?;
    a.dec(r10)?;
    a.jnz(pushed)?;
    a.inc(qword_ptr(r11 - COPY_HEADER as i32))?;
    a.pop(rax)?;
    a.set_label(&mut jump)?;
    a.jmp(rax)?;
    let result = a.assemble_options(0, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)?;
    Ok(CopyRoutine {
        pushed: result.label_ip(&pushed)?,
        jump: result.label_ip(&jump)?,
        bytes: result.inner.code_buffer,
    })
}

/// Bytes before a copy buffer's data: the word the routine counts copies in.
pub const COPY_HEADER: u64 = 64;

/// Where the continuation of a thread stopped at `rip` in the copy routine at
/// `routine` is: in rax (before the push, after the pop), on the stack, or
/// `None` outside the routine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InCopy {
    Rax,
    Stack,
}

/// See [`InCopy`].
pub fn in_copy(rip: u64, routine: u64) -> Option<InCopy> {
    let r = copy_routine();
    match rip.wrapping_sub(routine) {
        off if off == 0 || off == r.jump => Some(InCopy::Rax),
        off if (r.pushed..r.jump).contains(&off) => Some(InCopy::Stack),
        _ => None,
    }
}

/// Stack buffers: a mapping shared between the target and memptrace, one
/// buffer per thread, and the copy routine ([`copy_routine`]) in a
/// trampoline slot. At an allocator entry the tracer sends the thread through
/// the routine instead of copying its stack with a system call while it is
/// stopped: the thread copies its own stack, and memptrace reads the copy
/// from the shared mapping once the thread has counted it done, or, if the
/// thread stops before that, with process_vm_readv then.
pub struct StackBuffers {
    map: SharedMemory,
    /// Start of the mapping in the target.
    remote: u64,
    /// Address of the copy routine in the target.
    pub routine: u64,
    by_thread: HashMap<Tid, usize>,
    free: Vec<usize>,
    /// Copies asked of each buffer so far.
    issued: Vec<u64>,
}

/// Buffers per space: threads beyond this many at once copy the old way.
pub const BUFFERS: usize = 64;
/// Bytes per buffer: the counter's header, then up to a full stack copy.
pub const BUFFER_STRIDE: u64 = COPY_HEADER + STACK_COPY;

/// A copy asked of a thread: its buffer, and the count that says it is done.
#[derive(Clone, Copy, Debug)]
pub struct Issued {
    pub buffer: usize,
    /// Address of the buffer's data in the target (the routine's r11).
    pub data: u64,
    pub seq: u64,
}

impl StackBuffers {
    /// A copy for thread `tid`: its buffer (one is taken for it on its first
    /// call), `None` when all are taken.
    pub fn issue(&mut self, tid: Tid) -> Option<Issued> {
        let buffer = match self.by_thread.get(&tid) {
            Some(&b) => b,
            None => {
                let b = self.free.pop()?;
                self.by_thread.insert(tid, b);
                // Its last thread may have left a copy unmade (killed, or
                // gone before the routine ran).
                self.resync(b);
                b
            }
        };
        self.issued[buffer] += 1;
        Some(Issued {
            buffer,
            data: self.remote + buffer as u64 * BUFFER_STRIDE + COPY_HEADER,
            seq: self.issued[buffer],
        })
    }

    /// Count the copies asked of `buffer` as those its thread made: after a
    /// copy that will never be made (the routine faulted and the thread was
    /// sent past it), so that "done" keeps meaning done.
    pub fn resync(&mut self, buffer: usize) {
        self.issued[buffer] = self.map.load(buffer as u64 * BUFFER_STRIDE);
    }

    /// [`StackBuffers::resync`] the buffer of thread `tid`.
    pub fn resync_thread(&mut self, tid: Tid) {
        if let Some(&b) = self.by_thread.get(&tid) {
            self.resync(b);
        }
    }

    /// True when the thread has made copy `seq` of `buffer`.
    pub fn done(&self, buffer: usize, seq: u64) -> bool {
        let counted = self.map.load(buffer as u64 * BUFFER_STRIDE);
        counted.wrapping_sub(seq) as i64 >= 0
    }

    /// Append the first `len` bytes of `buffer` to `out`.
    pub fn copy_out(&self, buffer: usize, len: usize, out: &mut Vec<u8>) {
        let at = buffer * BUFFER_STRIDE as usize + COPY_HEADER as usize;
        self.map.copy_out(at as u64, len, out);
    }

    /// A thread is gone: its buffer serves the next one.
    pub fn release(&mut self, tid: Tid) {
        if let Some(b) = self.by_thread.remove(&tid) {
            self.free.push(b);
        }
    }
}

impl StackBuffers {
    /// Buffers in `map` (the target's mapping at `remote`), the copy routine
    /// at `routine`.
    pub fn new(map: SharedMemory, remote: u64, routine: u64) -> StackBuffers {
        StackBuffers {
            map,
            remote,
            routine,
            by_thread: HashMap::new(),
            free: (0..BUFFERS).rev().collect(),
            issued: vec![0; BUFFERS],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::{Code, Decoder, DecoderOptions, Instruction};

    #[test]
    fn copy_routine_is_what_it_says() {
        use iced_x86::Register::{R10, R11, RAX, RSP};
        let routine = copy_routine();
        assert_eq!((routine.pushed, routine.jump), (1, 20));
        let decoder = Decoder::with_ip(64, &routine.bytes, 0x1000, DecoderOptions::NONE);
        let insns: Vec<Instruction> = decoder.into_iter().collect();
        let codes: Vec<(u64, Code)> = insns.iter().map(|i| (i.ip() - 0x1000, i.code())).collect();
        assert_eq!(
            codes,
            [
                (0, Code::Push_r64),
                (1, Code::Mov_r64_rm64),
                (5, Code::Mov_rm64_r64),
                (10, Code::Dec_rm64),
                (13, Code::Jne_rel8_64),
                (15, Code::Inc_rm64),
                (19, Code::Pop_r64),
                (20, Code::Jmp_rm64),
            ]
        );
        let mem = |i: &Instruction| {
            (
                i.memory_base(),
                i.memory_index(),
                i.memory_index_scale(),
                i.memory_displacement64() as i64,
            )
        };
        assert_eq!(insns[0].op0_register(), RAX);
        assert_eq!(
            (insns[1].op0_register(), mem(&insns[1])),
            (RAX, (RSP, R10, 8, 0))
        );
        assert_eq!(
            (insns[2].op1_register(), mem(&insns[2])),
            (RAX, (R11, R10, 8, -8))
        );
        assert_eq!(insns[3].op0_register(), R10);
        assert_eq!(insns[4].near_branch_target(), 0x1001);
        assert_eq!(
            mem(&insns[5]),
            (R11, iced_x86::Register::None, 1, -(COPY_HEADER as i64))
        );
        assert_eq!(
            (insns[6].op0_register(), insns[7].op0_register()),
            (RAX, RAX)
        );
        assert_eq!(in_copy(0x1000, 0x1000), Some(InCopy::Rax));
        assert_eq!(in_copy(0x1001, 0x1000), Some(InCopy::Stack));
        assert_eq!(in_copy(0x1013, 0x1000), Some(InCopy::Stack));
        assert_eq!(in_copy(0x1014, 0x1000), Some(InCopy::Rax));
        assert_eq!(in_copy(0x1016, 0x1000), None);
    }
}
