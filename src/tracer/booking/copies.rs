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

use std::io;

use crate::os::ptrace::{Stop, Tid};
use crate::trace_msg::{CallStack, StackSample, TraceMsg};
use crate::tracer::booking::Booking;
use crate::tracer::process::Family;
use crate::tracer::target::Target;
use crate::tracer::{TraceOptions, TraceStats};

/// A stack copy asked of a thread and not taken yet.
#[derive(Clone, Copy, Debug)]
pub(in crate::tracer) struct PendingCopy {
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
pub(in crate::tracer) enum CopyInto {
    Call,
    Batch(u64),
}

/// Whether threads copy their own stacks in this trace: with framehop,
/// and with `--no-stacks` (the return address alone).
pub(in crate::tracer) fn wanted(opts: &TraceOptions) -> bool {
    !opts.stacks || opts.unwinder == crate::unwind::UnwinderKind::Framehop
}

/// The sample of a call whose thread copies its own stack: everything but
/// the bytes, which the copy adds when it is settled.
pub(in crate::tracer) fn awaited_sample(sp: u64, bp: u64) -> CallStack {
    CallStack::Sample(StackSample {
        ip: 0,
        sp: sp + 8,
        bp,
        base: sp,
        bytes: Vec::new(),
    })
}

/// Settling copies is the booking's: a copy goes into the stack of a
/// call, pending in its thread (`Family`) or waiting in the batch.
impl Booking {
    /// At a stop of `tid`: take its pending copy, if it has one. The
    /// thread's memory can be read unless it is gone or has just exec'd.
    pub fn settle_at_stop<T: Target>(
        &mut self,
        family: &mut Family,
        target: &mut T,
        tid: Tid,
        stop: &Stop,
    ) {
        let readable = !matches!(
            stop,
            Stop::Exited(_) | Stop::Killed { .. } | Stop::Event(libc::PTRACE_EVENT_EXEC)
        );
        self.settle_copy(family, target, tid, readable);
    }

    /// Take the pending copy of `tid` into its call: from the shared buffer
    /// if the thread made it, else (the thread is stopped before or inside
    /// the routine, `readable`) from its stack, else no stack.
    pub fn settle_copy<T: Target>(
        &mut self,
        family: &mut Family,
        target: &mut T,
        tid: Tid,
        readable: bool,
    ) {
        let Some(thread) = family.threads.get_mut(&tid) else {
            return;
        };
        let Some(copy) = thread.copy.take() else {
            return;
        };
        let pid = thread.pid;
        let mut bytes = Vec::new();
        let buffers = family.space_of(tid).and_then(|s| s.buffers());
        let unfinished = match buffers {
            Some(b) if b.done(copy.buffer, copy.seq) => {
                b.copy_out(copy.buffer, copy.len, &mut bytes);
                false
            }
            _ if readable => {
                if target
                    .read_data(pid, copy.sp, copy.len, &mut bytes)
                    .is_err()
                {
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
            if let Some(thread) = family.threads.get_mut(&tid) {
                thread.unfinished_copy = Some((copy.buffer, copy.seq));
            }
        }
        self.fill(family, tid, copy.into, bytes, Some(copy));
    }

    /// Calls of the batch waiting for copies that are now done: fill them.
    /// Calls of threads that are gone get no stack.
    pub fn settle_finished<T: Target>(&mut self, family: &mut Family, target: &mut T) {
        for (at, tid) in self.out.awaiting() {
            let copy = family.threads.get(&tid).and_then(|t| t.copy);
            match copy {
                Some(copy) if copy.into == CopyInto::Batch(at) => {
                    let done = family
                        .space_of(tid)
                        .and_then(|s| s.buffers())
                        .is_some_and(|b| b.done(copy.buffer, copy.seq));
                    if done {
                        self.settle_copy(family, target, tid, false);
                    }
                }
                _ => self.fill(family, tid, CopyInto::Batch(at), Vec::new(), None),
            }
        }
    }

    /// Every pending copy, taken now (the end of the trace).
    pub fn settle_all<T: Target>(&mut self, family: &mut Family, target: &mut T, readable: bool) {
        let tids: Vec<Tid> = family.threads.keys().copied().collect();
        for tid in tids {
            self.settle_copy(family, target, tid, readable);
        }
        self.settle_finished(family, target);
    }

    /// Give a call its stack copy. With `--no-stacks`, and for a call
    /// `--stack-every` skips, only the return address is kept.
    fn fill(
        &mut self,
        family: &mut Family,
        tid: Tid,
        into: CopyInto,
        bytes: Vec<u8>,
        copy: Option<PendingCopy>,
    ) {
        let ret = bytes
            .get(..8)
            .map_or(0, |w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
        let caller_only = match copy {
            Some(c) => !self.keeps_stack(family, c.pid, ret, c.always),
            None => false,
        };
        if !caller_only {
            self.out.add_bytes(bytes.len());
        }
        let stack = match into {
            CopyInto::Call => family
                .threads
                .get_mut(&tid)
                .and_then(|t| t.in_call.as_mut())
                .map(|call| &mut call.stack),
            CopyInto::Batch(at) => match self.out.take_awaiting(at) {
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
}

/// A fault of the copy routine is the thread's and its space's.
impl Family {
    /// True when the thread's fault (SIGSEGV, SIGBUS) is the copy routine's:
    /// its copy ran into memory unmapped since memptrace last read the
    /// thread's stack mapping (a neighbouring thread's stack, merged with it
    /// in /proc/PID/maps then, unmapped since). The copy was read at this stop
    /// already, as far as it is mapped.
    pub fn copy_faulted<T: Target>(&self, target: &mut T, tid: Tid) -> bool {
        let Ok(regs) = target.regs(tid) else {
            return false;
        };
        let in_routine = self
            .space_of(tid)
            .is_some_and(|s| s.in_copy(regs.rip).is_some());
        // A fault raised by the CPU (si_code > 0), not a signal sent by kill.
        in_routine && target.si_code(tid).is_ok_and(|code| code > 0)
    }

    /// After a fault of the copy routine: the thread goes on where the routine
    /// would have, and the program never sees the signal.
    pub fn recover_copy<T: Target>(
        &mut self,
        target: &mut T,
        stats: &mut TraceStats,
        tid: Tid,
    ) -> io::Result<()> {
        let Ok(mut regs) = target.regs(tid) else {
            return Ok(());
        };
        let left = self.space_of(tid).and_then(|s| s.leave_copy(&mut regs));
        if left != Some(true) {
            return Ok(());
        }
        self.note_copy_fault(stats, tid);
        if target.set_regs(tid, &regs).is_err() {
            return Ok(());
        }
        self.resume(target, tid, 0)
    }

    /// A copy the thread will never finish (its routine faulted): counted,
    /// its buffer's count set to what it made, its stack mapping read
    /// again at its next call.
    pub fn note_copy_fault(&mut self, stats: &mut TraceStats, tid: Tid) {
        stats.copy_faults += 1;
        if let Some(thread) = self.threads.get_mut(&tid) {
            thread.stack = None;
        }
        if let Some(buffers) = self.space_of_mut(tid).and_then(|s| s.buffers_mut()) {
            buffers.resync_thread(tid);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::event::Op;
    use crate::os::shared;
    use crate::os::shared::SharedMemory;
    use crate::queue::Receiver;
    use crate::tracer::booking::ledger::CallFacts;
    use crate::tracer::booking::outbox::Outbox;
    use crate::tracer::process::{PendingCall, Process, Role, Thread};
    use crate::tracer::space::buffers::{BUFFER_STRIDE, BUFFERS, COPY_HEADER, StackBuffers};
    use crate::tracer::space::fake;
    use crate::tracer::target::fake::{Call, FakeTarget};

    const PID: Tid = 7;
    const SP: u64 = 0x7ff0_1000;
    const RET: u64 = 0x40_1234;
    const ROUTINE: u64 = 0x1_0000;
    /// `si_code` of a SIGSEGV the CPU raised at unmapped memory.
    const SEGV_MAPERR: i32 = 1;

    /// A booking whose batches go to the queue returned.
    fn booking(stacks: bool) -> (Booking, Receiver<Vec<TraceMsg>>) {
        let (tx, rx) = crate::queue::bounded(16, |_| 1);
        let opts = TraceOptions::for_tests(stacks);
        let out = Outbox::new(crate::unwind::pipeline::PipelineHandle::to_channel(tx));
        let book = Booking::new(&opts, Instant::now(), None, out, Arc::default());
        (book, rx)
    }

    /// 32 bytes of a stack whose first word is `ret`.
    fn stack(ret: u64, fill: u8) -> Vec<u8> {
        let mut bytes = vec![fill; 32];
        bytes[..8].copy_from_slice(&ret.to_le_bytes());
        bytes
    }

    /// Process [`PID`] with thread [`PID`] stopped in a malloc whose stack
    /// it was sent to copy into its buffer; its stack (at [`SP`]) holds
    /// `on_stack`, if anything. Returns the target's side of the buffers.
    fn copying(on_stack: Option<Vec<u8>>) -> (Family, FakeTarget, SharedMemory, PendingCopy) {
        let (ours, theirs) =
            shared::pair_for_tests((BUFFERS as u64 * BUFFER_STRIDE) as usize).expect("a memfd");
        let mut target = FakeTarget::new();
        target.stopped_at(PID, 0x40_0000, SP);
        let mem = target.memory(PID);
        if let Some(bytes) = on_stack {
            mem.map(SP, bytes);
        }
        let mut buffers = StackBuffers::new(ours, 0x2_0000, ROUTINE);
        let issued = buffers.issue(PID).expect("a free buffer");
        let space = fake::with_buffers(PID, mem, buffers);
        let mut family = Family::default();
        family
            .processes
            .insert(PID, Process::new(Role::Traced, Some(space)));
        let mut thread = Thread::new(PID, 0);
        thread.in_call = Some(PendingCall {
            op: Op::Malloc,
            args: [24, 0, 0],
            entry_sp: SP,
            stub: 0,
            stack: awaited_sample(SP, 0),
            module_id: 1,
        });
        let copy = PendingCopy {
            buffer: issued.buffer,
            seq: issued.seq,
            len: 32,
            sp: SP,
            pid: PID,
            always: false,
            into: CopyInto::Call,
        };
        thread.copy = Some(copy);
        family.threads.insert(PID, thread);
        (family, target, theirs, copy)
    }

    /// What the thread's copy routine does: the bytes, then the count.
    fn make_copy(theirs: &SharedMemory, copy: &PendingCopy, bytes: &[u8]) {
        let at = copy.buffer as u64 * BUFFER_STRIDE;
        assert!(theirs.write(at + COPY_HEADER, bytes));
        theirs.store(at, copy.seq);
    }

    fn pending_stack(family: &Family) -> &CallStack {
        let call = family.threads[&PID].in_call.as_ref().expect("the call");
        &call.stack
    }

    fn sample(stack: &CallStack) -> (u64, u64, &[u8]) {
        match stack {
            CallStack::Sample(s) => (s.ip, s.sp, &s.bytes),
            other => panic!("a sample, not {other:?}"),
        }
    }

    #[test]
    fn a_copy_the_thread_made_is_taken_from_its_buffer() {
        // Nothing on the stack in the fake: a read there would find nothing.
        let (mut family, mut target, theirs, copy) = copying(None);
        make_copy(&theirs, &copy, &stack(RET, 0xab));
        let (mut book, _rx) = booking(true);
        book.settle_at_stop(&mut family, &mut target, PID, &Stop::Signal(libc::SIGUSR1));
        assert_eq!(
            sample(pending_stack(&family)),
            (RET, SP + 8, &stack(RET, 0xab)[..])
        );
        let thread = &family.threads[&PID];
        assert!(thread.copy.is_none());
        assert_eq!(thread.unfinished_copy, None);
        assert!(target.calls.is_empty());
    }

    #[test]
    fn a_copy_not_made_by_the_stop_is_read_and_its_buffer_kept_back() {
        let (mut family, mut target, _theirs, copy) = copying(Some(stack(RET, 0xcd)));
        let (mut book, _rx) = booking(true);
        book.settle_at_stop(&mut family, &mut target, PID, &Stop::Signal(libc::SIGUSR1));
        assert_eq!(
            sample(pending_stack(&family)),
            (RET, SP + 8, &stack(RET, 0xcd)[..])
        );
        // The routine may still write the buffer: no copy goes there until
        // it has counted this one.
        let thread = &family.threads[&PID];
        assert_eq!(thread.unfinished_copy, Some((copy.buffer, copy.seq)));
    }

    #[test]
    fn a_thread_that_execd_is_not_read() {
        let (mut family, mut target, _theirs, _copy) = copying(Some(stack(RET, 0xcd)));
        let (mut book, _rx) = booking(true);
        let exec = Stop::Event(libc::PTRACE_EVENT_EXEC);
        book.settle_at_stop(&mut family, &mut target, PID, &exec);
        assert_eq!(sample(pending_stack(&family)), (0, SP + 8, &[][..]));
        assert_eq!(family.threads[&PID].unfinished_copy, None);
        assert!(family.threads[&PID].copy.is_none());
    }

    #[test]
    fn without_stacks_a_call_keeps_its_return_address_only() {
        let (mut family, mut target, _theirs, _copy) = copying(Some(stack(RET, 0xcd)));
        let (mut book, _rx) = booking(false);
        book.settle_copy(&mut family, &mut target, PID, true);
        assert!(matches!(pending_stack(&family), CallStack::CallerOnly(RET)));
    }

    #[test]
    fn a_free_in_the_batch_waits_for_its_copy_and_goes_once_made() {
        let (mut family, mut target, theirs, mut copy) = copying(None);
        let (mut book, rx) = booking(true);
        family.threads.get_mut(&PID).unwrap().in_call = None;
        let facts = CallFacts {
            pid: PID as u32,
            tid: PID as u32,
            ts_ns: 1,
            args: [0x5000, 0, 0],
            ret: 0,
            stored_ptr: 0,
        };
        let msg = book.completed(Op::Free, &facts, awaited_sample(SP, 0), 1);
        copy.into = CopyInto::Batch(book.out.push_awaiting(msg, PID));
        family.threads.get_mut(&PID).unwrap().copy = Some(copy);
        // Not made yet: it waits, and so does the batch.
        book.settle_finished(&mut family, &mut target);
        assert!(book.out.awaiting_copies());
        make_copy(&theirs, &copy, &stack(RET, 0x11));
        book.settle_finished(&mut family, &mut target);
        assert!(!book.out.awaiting_copies());
        book.out.send_ready(true).unwrap();
        let (msgs, _permit) = rx.recv().expect("the batch");
        let stacks: Vec<(u64, u64, Vec<u8>)> = msgs
            .iter()
            .filter_map(|m| match m {
                TraceMsg::Call(call) => {
                    let (ip, sp, bytes) = sample(&call.stack);
                    Some((ip, sp, bytes.to_vec()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(stacks, vec![(RET, SP + 8, stack(RET, 0x11))]);
    }

    #[test]
    fn a_batch_call_of_a_gone_thread_goes_without_a_stack() {
        let (mut book, rx) = booking(true);
        let mut family = Family::default();
        let facts = CallFacts {
            pid: PID as u32,
            tid: 99,
            ts_ns: 1,
            args: [0x5000, 0, 0],
            ret: 0,
            stored_ptr: 0,
        };
        let msg = book.completed(Op::Free, &facts, awaited_sample(SP, 0), 1);
        book.out.push_awaiting(msg, 99);
        book.settle_all(&mut family, &mut FakeTarget::new(), true);
        assert!(!book.out.awaiting_copies());
        book.out.send_ready(true).unwrap();
        let (msgs, _permit) = rx.recv().expect("the batch");
        let empty = msgs.iter().any(
            |m| matches!(m, TraceMsg::Call(call) if sample(&call.stack) == (0, SP + 8, &[][..])),
        );
        assert!(empty);
    }

    #[test]
    fn a_fault_of_the_copy_routine_is_recovered_unseen() {
        let (mut family, mut target, _theirs, _copy) = copying(None);
        // In the routine's loop, the return address of `push rax` on top.
        let rsp = SP - 0x100;
        target
            .memory(PID)
            .map(rsp, 0x40_5555u64.to_le_bytes().to_vec());
        let thread = target.threads.get_mut(&PID).unwrap();
        thread.regs.rip = ROUTINE + 5;
        thread.regs.rsp = rsp;
        // A signal sent with kill(2) is the program's.
        thread.si_code = 0;
        assert!(!family.copy_faulted(&mut target, PID));
        target.threads.get_mut(&PID).unwrap().si_code = SEGV_MAPERR;
        assert!(family.copy_faulted(&mut target, PID));
        family.threads.get_mut(&PID).unwrap().stack = Some(SP - 0x1000..SP + 0x1000);
        let mut stats = TraceStats::default();
        family.recover_copy(&mut target, &mut stats, PID).unwrap();
        assert_eq!(target.calls, vec![Call::SetRegs(PID), Call::Cont(PID, 0)]);
        let regs = target.threads[&PID].regs;
        assert_eq!((regs.rip, regs.rsp), (0x40_5555, rsp + 8));
        assert_eq!(stats.copy_faults, 1);
        // Its stack mapping is read again at its next call.
        assert_eq!(family.threads[&PID].stack, None);
    }

    #[test]
    fn a_fault_elsewhere_is_not_the_routines() {
        let (mut family, mut target, _theirs, _copy) = copying(None);
        let thread = target.threads.get_mut(&PID).unwrap();
        thread.regs.rip = ROUTINE + 0x100;
        thread.si_code = SEGV_MAPERR;
        assert!(!family.copy_faulted(&mut target, PID));
        let mut stats = TraceStats::default();
        family.recover_copy(&mut target, &mut stats, PID).unwrap();
        assert!(target.calls.is_empty());
        assert_eq!(stats.copy_faults, 0);
        // A thread memptrace does not know, nor its space.
        assert!(!family.copy_faulted(&mut target, 99));
    }
}
