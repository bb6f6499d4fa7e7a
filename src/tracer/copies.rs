//! Stacks the threads copy themselves.
//!
//! At an allocator entry the tracer can send a thread through the copy
//! routine of its space (`space::StackBuffers`) instead of copying the
//! thread's stack with process_vm_readv while it is stopped: the entry stop
//! then costs what a bare ptrace stop costs (measured in
//! docs/performance.md). The copy is ready once the thread has counted it
//! done in its buffer, and certainly at the thread's next stop: the routine
//! runs before the allocator function, and nothing of the stack above the
//! entry's stack pointer changes before the function returns. So:
//!
//! - a call whose result is awaited (malloc) gets its copy at its return
//!   stop, or at any stop of the thread before it;
//! - a `free`, recorded at its entry, waits in the batch for its copy; the
//!   batch is handed to the pipeline only up to the first call still waiting,
//!   so the pipeline sees every message in order;
//! - a thread that stops before its copy is done (a signal, a group-stop,
//!   the stop of a detach) is read with process_vm_readv right then; one that
//!   is gone gets no stack.

use super::{TraceError, Tracer};
use crate::os::mem;
use crate::os::ptrace::{self, Stop, Tid};
use crate::trace_msg::{CallStack, StackSample, TraceMsg};

/// A stack copy asked of a thread and not taken yet.
#[derive(Clone, Copy, Debug)]
pub(super) struct PendingCopy {
    pub buffer: usize,
    pub seq: u64,
    pub len: usize,
    /// The thread's stack pointer at the entry: where the copy starts.
    pub sp: u64,
    pub pid: Tid,
    /// The call gets its whole stack even with `--stack-every`.
    pub always: bool,
    pub into: CopyInto,
}

/// Where the copy goes: the stack of the thread's pending call, or that of
/// the call with this message number in the outbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CopyInto {
    Call,
    Batch(u64),
}

impl Tracer {
    /// Whether threads copy their own stacks in this trace: with framehop,
    /// and with `--no-stacks` (the return address alone).
    pub(super) fn copies_wanted(&self) -> bool {
        !self.opts.stacks || self.opts.unwinder == crate::unwind::UnwinderKind::Framehop
    }

    /// At a stop of `tid`: take its pending copy, if it has one. The
    /// thread's memory can be read unless it is gone or has just exec'd.
    pub(super) fn settle_at_stop(&mut self, tid: Tid, stop: &Stop) {
        let readable = !matches!(
            stop,
            Stop::Exited(_) | Stop::Killed { .. } | Stop::Event(libc::PTRACE_EVENT_EXEC)
        );
        self.settle_copy(tid, readable);
    }

    /// Take the pending copy of `tid` into its call: from the shared buffer
    /// if the thread made it, else (the thread is stopped before or inside
    /// the routine, `readable`) from its stack, else no stack.
    pub(super) fn settle_copy(&mut self, tid: Tid, readable: bool) {
        let Some(thread) = self.family.threads.get_mut(&tid) else {
            return;
        };
        let Some(copy) = thread.copy.take() else {
            return;
        };
        let pid = thread.pid;
        let mut bytes = Vec::new();
        let buffers = self.family.space_of(tid).and_then(|s| s.buffers());
        let unfinished = match buffers {
            Some(b) if b.done(copy.buffer, copy.seq) => {
                b.copy_out(copy.buffer, copy.len, &mut bytes);
                false
            }
            _ if readable => {
                if mem::read_mapped_into(pid, copy.sp, copy.len, &mut bytes).is_err() {
                    bytes.clear();
                }
                true
            }
            _ => false,
        };
        if unfinished {
            // The routine may still run (a signal handler interrupted it and
            // will return into it) and write the buffer: no new copy goes
            // there until it has counted this one done.
            if let Some(thread) = self.family.threads.get_mut(&tid) {
                thread.unfinished_copy = Some((copy.buffer, copy.seq));
            }
        }
        self.fill(tid, copy.into, bytes, Some(copy));
    }

    /// Calls of the batch waiting for copies that are now done: fill them.
    /// Calls of threads that are gone get no stack.
    pub(super) fn settle_finished(&mut self) {
        for (at, tid) in self.book.out.awaiting() {
            let copy = self.family.threads.get(&tid).and_then(|t| t.copy);
            match copy {
                Some(copy) if copy.into == CopyInto::Batch(at) => {
                    let done = self
                        .family
                        .space_of(tid)
                        .and_then(|s| s.buffers())
                        .is_some_and(|b| b.done(copy.buffer, copy.seq));
                    if done {
                        self.settle_copy(tid, false);
                    }
                }
                _ => self.fill(tid, CopyInto::Batch(at), Vec::new(), None),
            }
        }
    }

    /// Every pending copy, taken now (the end of the trace).
    pub(super) fn settle_all(&mut self, readable: bool) {
        let tids: Vec<Tid> = self.family.threads.keys().copied().collect();
        for tid in tids {
            self.settle_copy(tid, readable);
        }
        self.settle_finished();
    }

    /// True when the thread's fault (SIGSEGV, SIGBUS) is the copy routine's:
    /// its copy ran into memory unmapped since memptrace last read the
    /// thread's stack mapping (a neighbouring thread's stack, merged with it
    /// in /proc/PID/maps then, unmapped since). The copy was read at this stop
    /// already, as far as it is mapped.
    pub(super) fn copy_faulted(&self, tid: Tid) -> bool {
        let Ok(regs) = ptrace::get_regs(tid) else {
            return false;
        };
        let in_routine = self
            .family
            .space_of(tid)
            .is_some_and(|s| s.in_copy(regs.rip).is_some());
        // A fault raised by the CPU (si_code > 0), not a signal sent by kill.
        in_routine && ptrace::siginfo(tid).is_ok_and(|info| info.si_code > 0)
    }

    /// After a fault of the copy routine: the thread goes on where the routine
    /// would have, and the program never sees the signal.
    pub(super) fn recover_copy(&mut self, tid: Tid) -> Result<(), TraceError> {
        let Ok(mut regs) = ptrace::get_regs(tid) else {
            return Ok(());
        };
        let left = self
            .family
            .space_of(tid)
            .and_then(|s| s.leave_copy(&mut regs));
        if left != Some(true) {
            return Ok(());
        }
        self.note_copy_fault(tid);
        if ptrace::set_regs(tid, &regs).is_err() {
            return Ok(());
        }
        self.resume(tid, 0)
    }

    /// A copy the thread will never finish (its routine faulted): counted,
    /// its buffer's count set to what it made, its stack mapping read
    /// again at its next call.
    pub(super) fn note_copy_fault(&mut self, tid: Tid) {
        self.stats.copy_faults += 1;
        if let Some(thread) = self.family.threads.get_mut(&tid) {
            thread.stack = None;
        }
        if let Some(buffers) = self.family.space_of_mut(tid).and_then(|s| s.buffers_mut()) {
            buffers.resync_thread(tid);
        }
    }

    /// Give a call its stack copy. With `--no-stacks`, and for a call
    /// `--stack-every` skips, only the return address is kept.
    fn fill(&mut self, tid: Tid, into: CopyInto, bytes: Vec<u8>, copy: Option<PendingCopy>) {
        let ret = bytes
            .get(..8)
            .map_or(0, |w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
        let caller_only = match copy {
            Some(c) => {
                !self.opts.stacks
                    || (!c.always && !self.family.sampled(c.pid, ret, self.opts.stack_every))
            }
            None => false,
        };
        if !caller_only {
            self.book.out.add_bytes(bytes.len());
        }
        let stack = match into {
            CopyInto::Call => self
                .family
                .threads
                .get_mut(&tid)
                .and_then(|t| t.in_call.as_mut())
                .map(|call| &mut call.stack),
            CopyInto::Batch(at) => match self.book.out.take_awaiting(at) {
                Some(TraceMsg::Call(call)) => Some(&mut call.stack),
                _ => None,
            },
        };
        match stack {
            Some(stack) if caller_only => *stack = CallStack::CallerOnly(ret),
            Some(CallStack::Sample(sample)) => {
                sample.bytes = bytes;
                sample.ip = ret;
            }
            _ => {}
        }
    }

    /// The sample of a call whose thread copies its own stack: everything
    /// but the bytes, which [`Tracer::fill`] adds.
    pub(super) fn awaited_sample(sp: u64, bp: u64) -> CallStack {
        CallStack::Sample(StackSample {
            ip: 0,
            sp: sp + 8,
            bp,
            base: sp,
            bytes: Vec::new(),
        })
    }
}
