//! Breakpoint stops: an allocator entry, a redirected return, the dynamic
//! linker's hook.
//!
//! At an entry the tracer reads the registers once (PTRACE_GETREGS), points
//! the thread at the breakpoint's slot (PTRACE_SETREGS) and resumes it
//! (PTRACE_CONT): at the displaced instruction for `free`, which returns
//! nothing worth a stop, and at the slot's call stub for every call that
//! returns a block, so that the call returns to the stub's int3 (see
//! [`crate::tracer::probes::int3::slot_code`]). When its space has stack buffers (framehop or
//! `--no-stacks`, see [`crate::tracer::booking::copies`]) the thread first passes through the
//! copy routine, which copies its stack, or its return address, into memory
//! shared with memptrace; otherwise that is read with one process_vm_readv
//! while the thread is stopped.
//! At the return stop the tracer reads rax and resumes the thread where it
//! is: the stub returns to the caller itself. So an entry costs three system
//! calls (four without the routine), a return two, and nothing is written to
//! the target's stack. Only a thread's
//! outermost allocator call is recorded: an entry below a pending call of the
//! same thread (realloc(NULL, n) entering malloc) just passes through, unless
//! a signal handler that interrupted the pending call makes it
//! (see [`crate::tracer::serve::handlers`]). The bookkeeping runs after the thread is
//! resumed.
//!
//! [`Serve`] borrows, for one stop, what serving it needs of the tracer:
//! the options, the traced processes, the booking, the heap maps (a call
//! completed while the attach's heap is walked is held back), the counts
//! and the target. It never waits for a stop, and never sees the stop
//! queue or the trace's control.

use crate::event::{MapOp, Op};
use crate::os::ptrace::{Regs, Tid};
use crate::trace_msg::{CallStack, StackSample};
use crate::tracer::booking::Booking;
use crate::tracer::booking::copies::{self, CopyInto, PendingCopy};
use crate::tracer::booking::ledger::CallFacts;
use crate::tracer::heapmaps::{HeapMaps, HeldCall};
use crate::tracer::images::Images;
use crate::tracer::probes::{HookKind, Probe};
use crate::tracer::process::{Family, PendingCall, PendingMap};
use crate::tracer::space::buffers::STACK_COPY;
use crate::tracer::target::Target;
use crate::tracer::{TraceError, TraceOptions, TraceStats};
use crate::unwind::Unwinder;

/// The two ways out of an int3 probe (see [`Probe::Int3`]).
#[derive(Clone, Copy, Debug)]
struct Slot {
    resume_at: u64,
    stub: u64,
}

/// The tracer's parts that serving a breakpoint stop concerns, borrowed
/// for that stop.
pub(in crate::tracer) struct Serve<'a, T: Target> {
    pub opts: &'a TraceOptions,
    pub family: &'a mut Family,
    pub book: &'a mut Booking,
    pub heaps: &'a mut HeapMaps,
    pub stats: &'a mut TraceStats,
    pub target: &'a mut T,
}

impl<T: Target> Serve<'_, T> {
    /// A SIGTRAP stop: one of our int3s, or the program's own SIGTRAP.
    pub(in crate::tracer) fn trap(&mut self, tid: Tid) -> Result<(), TraceError> {
        let regs = match self.target.regs(tid) {
            Ok(regs) => regs,
            Err(_) => return Ok(()), // killed meanwhile; waitpid will say
        };
        let Some(pid) = self.family.pid_of(tid) else {
            return Ok(());
        };
        let recording = self.family.is_traced(pid);
        let Some(space) = self.family.space_of(tid) else {
            return self.resume(tid, libc::SIGTRAP);
        };
        let at = regs.rip.wrapping_sub(1);
        let Some(hook) = space.hooks.get(at) else {
            if space.hooks.is_return(at) {
                return self.on_return(tid, regs);
            }
            if let Some(hook) = space.hooks.missed(at) {
                let Probe::Jump { code, .. } = &hook.probe else {
                    unreachable!("a miss is a jump probe's")
                };
                if hook.kind == HookKind::DebugState {
                    // The gate of `_dl_debug_state` (see `failopen`): on to
                    // its displaced `ret` once the images are read.
                    let on = code.displaced;
                    let signals = if recording {
                        self.images().refresh(pid, tid)?
                    } else {
                        Vec::new()
                    };
                    return self.redirect(tid, regs, on, signals);
                }
                let entry = code.entry;
                return Ok(self
                    .family
                    .on_miss(self.target, self.stats, tid, pid, regs, entry)?);
            }
            return self.resume(tid, libc::SIGTRAP);
        };
        let (resume_at, stub) = match &hook.probe {
            Probe::Int3 {
                resume_at, stub, ..
            } => (*resume_at, *stub),
            // A jump probe where a jump could not be planted: on to it.
            Probe::Jump {
                code,
                via_int3: true,
                ..
            } => return self.redirect(tid, regs, code.entry, Vec::new()),
            Probe::Jump { .. } => return self.resume(tid, libc::SIGTRAP),
        };
        match hook.kind.clone() {
            HookKind::DebugState => {
                let signals = if recording {
                    self.images().refresh(pid, tid)?
                } else {
                    Vec::new()
                };
                self.redirect(tid, regs, resume_at, signals)
            }
            HookKind::Allocator { .. } if !recording => {
                self.redirect(tid, regs, resume_at, Vec::new())
            }
            HookKind::Allocator { module_id, ops } => {
                let slot = Slot { resume_at, stub };
                self.on_entry(tid, pid, regs, slot, module_id, &ops)
            }
            HookKind::Mapping { .. } if !recording => {
                self.redirect(tid, regs, resume_at, Vec::new())
            }
            HookKind::Mapping { op } => self.on_map_entry(tid, pid, regs, resume_at, stub, op),
        }
    }

    /// Resume a thread stopped at a breakpoint at the displaced instruction.
    fn redirect(
        &mut self,
        tid: Tid,
        regs: Regs,
        resume_at: u64,
        signals: Vec<i32>,
    ) -> Result<(), TraceError> {
        Ok(redirect(
            self.family,
            self.target,
            tid,
            regs,
            resume_at,
            &signals,
        )?)
    }

    /// Resume a thread, delivering `sig` (see [`crate::tracer::running`]).
    fn resume(&mut self, tid: Tid, sig: i32) -> Result<(), TraceError> {
        Ok(self.family.resume(self.target, tid, sig)?)
    }

    /// The parts images concern (see [`Images`]).
    fn images(&mut self) -> Images<'_> {
        Images {
            opts: self.opts,
            family: self.family,
            book: self.book,
            stats: self.stats,
        }
    }

    fn on_entry(
        &mut self,
        tid: Tid,
        pid: Tid,
        regs: Regs,
        slot: Slot,
        module_id: u64,
        ops: &[Op],
    ) -> Result<(), TraceError> {
        let thread = self.family.threads.get_mut(&tid).expect("known thread");
        // A handler that interrupted a call and has returned since: that
        // call is pending again (see `handlers`).
        self.stats.lost_returns += thread.leave_handlers(regs.rsp);
        if let Some(call) = &thread.in_call {
            // The stack grows down: an entry below the pending call's frame is
            // inside it, including a tail call from it (musl's memalign jumps
            // to aligned_alloc), which enters 16 bytes below: the stub's
            // return address and alignment word. An entry at or above it
            // means the pending call was left by a longjmp and will never
            // return.
            if regs.rsp < call.entry_sp {
                self.stats.nested_calls += 1;
                return self.redirect(tid, regs, slot.resume_at, Vec::new());
            }
            thread.in_call = None;
            self.stats.lost_returns += 1;
        }
        // A release of a block the ledger does not know may be allocator
        // housekeeping, which the pipeline tells from the program's calls by
        // the whole stack: such a call always gets one.
        let unknown_release = regs.rdi != 0
            && ops.iter().any(|op| op.takes_block())
            && !self.book.ledger.is_live(pid as u32, regs.rdi);
        if let [op] = ops {
            if let Some(copy) = self.ask_copy(tid, pid, &regs, unknown_release) {
                return self.on_entry_copying(tid, pid, regs, slot, module_id, *op, copy);
            }
        }
        let (ret_addr, stack) = self.capture(tid, pid, &regs, unknown_release);
        let op = match ops {
            [op] => *op,
            _ => self.family.alias(pid, ops, ret_addr),
        };
        let args = [regs.rdi, regs.rsi, regs.rdx];
        if op == Op::Free {
            self.redirect(tid, regs, slot.resume_at, Vec::new())?;
            let facts = self.facts(pid, tid, args, 0, 0);
            self.complete(op, &facts, stack, module_id);
            return Ok(());
        }
        if let Some(thread) = self.family.threads.get_mut(&tid) {
            thread.in_call = Some(PendingCall {
                op,
                args,
                entry_sp: regs.rsp,
                stub: slot.stub,
                stack,
                module_id,
            });
        }
        self.redirect(tid, regs, slot.stub, Vec::new())
    }

    /// A stack copy for the thread to make itself (see [`crate::tracer::booking::copies`]),
    /// when its space has a buffer free: the whole stack for framehop, just
    /// the return address with `--no-stacks`. `always`: the call gets its
    /// stack even when `--stack-every` would skip it. Returns the copy and
    /// where the routine is.
    fn ask_copy(
        &mut self,
        tid: Tid,
        pid: Tid,
        regs: &Regs,
        always: bool,
    ) -> Option<(PendingCopy, u64, u64)> {
        // A free with a copy is booked at once (its stack follows): not
        // while calls are held back for the attach's inventory.
        if self.unwinds_with_libunwind(pid) || self.heaps.walking() {
            return None;
        }
        let sp = regs.rsp;
        let len = if self.opts.stacks {
            let top = self.family.stack_top(self.target, tid, pid, sp);
            top.saturating_sub(sp).min(STACK_COPY) & !7
        } else {
            8
        };
        if len == 0 {
            return None;
        }
        let unfinished = self
            .family
            .threads
            .get(&tid)
            .and_then(|t| t.unfinished_copy);
        let buffers = self.family.space_of_mut(tid)?.buffers_mut()?;
        if let Some((buffer, seq)) = unfinished {
            // A copy of this thread read at a stop before its routine was
            // done: the routine may still write the buffer (from a signal
            // handler's interrupted context); this call's stack is read in
            // the stop until then.
            if !buffers.done(buffer, seq) {
                return None;
            }
            if let Some(thread) = self.family.threads.get_mut(&tid) {
                thread.unfinished_copy = None;
            }
        }
        let buffers = self.family.space_of_mut(tid)?.buffers_mut()?;
        let issued = buffers.issue(tid)?;
        let copy = PendingCopy {
            buffer: issued.buffer,
            seq: issued.seq,
            len: len as usize,
            sp,
            pid,
            always,
            into: CopyInto::Call,
        };
        Some((copy, issued.data, buffers.routine))
    }

    /// An entry whose thread copies its own stack: the thread goes through
    /// the copy routine (r11: its buffer, r10: words to copy, rax: where to
    /// go on), so the stop is GETREGS, SETREGS, CONT and nothing else.
    #[allow(clippy::too_many_arguments)]
    fn on_entry_copying(
        &mut self,
        tid: Tid,
        pid: Tid,
        mut regs: Regs,
        slot: Slot,
        module_id: u64,
        op: Op,
        (mut copy, data, routine): (PendingCopy, u64, u64),
    ) -> Result<(), TraceError> {
        let args = [regs.rdi, regs.rsi, regs.rdx];
        let entry_sp = regs.rsp;
        let stack = copies::awaited_sample(regs.rsp, regs.rbp);
        let go_on = if op == Op::Free {
            slot.resume_at
        } else {
            slot.stub
        };
        regs.r11 = data;
        regs.r10 = copy.len as u64 / 8;
        regs.rax = go_on;
        regs.rip = routine;
        if self.target.set_regs(tid, &regs).is_err() {
            return Ok(()); // gone
        }
        self.resume(tid, 0)?;
        if op == Op::Free {
            // Recorded now, in order; its stack follows (see `copies`).
            let facts = self.facts(pid, tid, args, 0, 0);
            let msg = self.book.completed(op, &facts, stack, module_id);
            copy.into = CopyInto::Batch(self.book.out.push_awaiting(msg, tid));
            if let Some(thread) = self.family.threads.get_mut(&tid) {
                thread.copy = Some(copy);
            }
            return Ok(());
        }
        if let Some(thread) = self.family.threads.get_mut(&tid) {
            thread.in_call = Some(PendingCall {
                op,
                args,
                entry_sp,
                stub: slot.stub,
                stack,
                module_id,
            });
            thread.copy = Some(copy);
        }
        Ok(())
    }

    /// The return int3 of a call stub: the call's result is in rax, and the
    /// thread goes on where it is (the stub returns to the caller).
    fn on_return(&mut self, tid: Tid, regs: Regs) -> Result<(), TraceError> {
        let pid = self.family.pid_of(tid).unwrap_or(tid);
        let Some(call) = self.family.returning_call(self.stats, tid, regs.rsp) else {
            if let Some(map) = self.family.returning_map(tid, regs.rsp) {
                self.resume(tid, 0)?;
                self.book.record_map(pid, tid, map, regs.rax);
                return Ok(());
            }
            // A call memptrace gave up on (left by a longjmp, as far as it
            // could tell) came back after all: not recorded, no harm done.
            return self.resume(tid, 0);
        };
        let stored = stored_block_in(self.target, pid, &call, regs.rax);
        self.resume(tid, 0)?;
        self.record_return(pid, tid, call, regs.rax, stored);
        Ok(())
    }

    /// The entry of a mapping function: take its arguments and stack, and
    /// send the thread through the slot's stub (`stub`) to see its result;
    /// a call inside the thread's mapping call in progress goes straight on
    /// (`resume_at`).
    pub(in crate::tracer) fn on_map_entry(
        &mut self,
        tid: Tid,
        pid: Tid,
        regs: Regs,
        resume_at: u64,
        stub: u64,
        op: MapOp,
    ) -> Result<(), TraceError> {
        let thread = self.family.threads.get_mut(&tid).expect("known thread");
        if let Some(pending) = &thread.in_map {
            if regs.rsp < pending.entry_sp {
                return self.redirect(tid, regs, resume_at, Vec::new());
            }
            // Left by a longjmp.
            thread.in_map = None;
        }
        let (_, stack) = self.capture(tid, pid, &regs, true);
        let args = [regs.rdi, regs.rsi, regs.rdx, regs.rcx, regs.r8, regs.r9];
        if let Some(thread) = self.family.threads.get_mut(&tid) {
            thread.in_map = Some(PendingMap {
                op,
                args,
                entry_sp: regs.rsp,
                stub,
                stack,
            });
        }
        self.redirect(tid, regs, stub, Vec::new())
    }

    /// Book a call that returned `rax` (and, for posix_memalign, `stored`).
    pub(in crate::tracer) fn record_return(
        &mut self,
        pid: Tid,
        tid: Tid,
        call: PendingCall,
        rax: u64,
        stored: u64,
    ) {
        let facts = self.facts(pid, tid, call.args, rax, stored);
        self.complete(call.op, &facts, call.stack, call.module_id);
    }

    pub(in crate::tracer) fn facts(
        &self,
        pid: Tid,
        tid: Tid,
        args: [u64; 3],
        ret: u64,
        stored_ptr: u64,
    ) -> CallFacts {
        self.book.facts(pid, tid, args, ret, stored_ptr)
    }

    /// Book a finished call and send it down the pipeline.
    /// While the attach's heap is walked, held back to be booked after it.
    pub(in crate::tracer) fn complete(
        &mut self,
        op: Op,
        facts: &CallFacts,
        stack: CallStack,
        module_id: u64,
    ) {
        let held = HeldCall {
            op,
            facts: *facts,
            stack,
            module_id,
        };
        if let Some(call) = self.heaps.hold_back(held) {
            let msg = self
                .book
                .completed(call.op, &call.facts, call.stack, call.module_id);
            self.book.send(msg);
        }
    }

    /// The caller's return address and what the unwinder needs, taken while
    /// the thread is stopped at a hooked function's first instruction. With
    /// `--stack-every N`, only every Nth call of a call site (and every
    /// `always` call) gets more than its caller.
    pub(in crate::tracer) fn capture(
        &mut self,
        tid: Tid,
        pid: Tid,
        regs: &Regs,
        always: bool,
    ) -> (u64, CallStack) {
        let sp = regs.rsp;
        if !self.opts.stacks {
            let ret = self.target.read_word(pid, sp).unwrap_or(0);
            return (ret, CallStack::CallerOnly(ret));
        }
        if self.opts.stack_every > 1 {
            // The call site is the return address: one word read first.
            let ret = self.target.read_word(pid, sp).unwrap_or(0);
            if !self.family.sampled(pid, ret, self.opts.stack_every) && !always {
                return (ret, CallStack::CallerOnly(ret));
            }
        }
        let libunwind = self
            .family
            .processes
            .get_mut(&pid)
            .and_then(|p| p.libunwind.as_mut());
        if let Some(libunwind) = libunwind {
            let ret = self.target.read_word(pid, sp).unwrap_or(0);
            let sample = StackSample {
                ip: ret,
                sp: sp + 8,
                bp: regs.rbp,
                ..StackSample::default()
            };
            let mut ips = Vec::new();
            let end = libunwind.unwind(tid, &sample, &mut ips, self.opts.max_depth);
            return (ret, CallStack::Unwound { ips, end });
        }
        let top = self.family.stack_top(self.target, tid, pid, sp);
        let len = top.saturating_sub(sp).min(STACK_COPY) as usize;
        let mut bytes = Vec::new();
        if self.target.read_data(pid, sp, len, &mut bytes).is_err() {
            bytes.clear();
        }
        let sample = StackSample {
            ip: 0,
            sp: sp + 8,
            bp: regs.rbp,
            base: sp,
            bytes,
        };
        let ret = sample.read_u64(sp).unwrap_or(0);
        (ret, CallStack::Sample(StackSample { ip: ret, ..sample }))
    }

    /// True when process `pid`'s stacks are unwound by libunwind.
    fn unwinds_with_libunwind(&self, pid: Tid) -> bool {
        self.family
            .processes
            .get(&pid)
            .is_some_and(|p| p.libunwind.is_some())
    }
}

/// Resume a thread stopped at a breakpoint at `resume_at` (the displaced
/// instruction, a stub, a probe), delivering `signals`.
pub(in crate::tracer) fn redirect<T: Target>(
    family: &Family,
    target: &mut T,
    tid: Tid,
    mut regs: Regs,
    resume_at: u64,
    signals: &[i32],
) -> std::io::Result<()> {
    regs.rip = resume_at;
    if target.set_regs(tid, &regs).is_err() {
        return Ok(()); // gone
    }
    family.resume_with(target, tid, signals)
}

impl Family {
    /// The pending call of `tid` that a stop at a return int3 with stack
    /// pointer `rsp` completes. The stub's `call` pushed its return address
    /// 16 bytes below the entry's stack pointer, and `ret` popped it.
    pub fn returning_call(
        &mut self,
        stats: &mut TraceStats,
        tid: Tid,
        rsp: u64,
    ) -> Option<PendingCall> {
        let thread = self.threads.get_mut(&tid)?;
        stats.lost_returns += thread.leave_handlers(rsp);
        let ours = thread
            .in_call
            .as_ref()
            .is_some_and(|c| c.entry_sp.wrapping_sub(8) == rsp);
        if ours { thread.in_call.take() } else { None }
    }
}

/// posix_memalign's block, stored through its first argument: read it while
/// the thread is stopped at the return, before the caller can touch it.
pub(in crate::tracer) fn stored_block_in<T: Target>(
    target: &mut T,
    pid: Tid,
    call: &PendingCall,
    rax: u64,
) -> u64 {
    if call.op == Op::PosixMemalign && rax as u32 == 0 {
        target.read_word(pid, call.args[0]).unwrap_or(0)
    } else {
        0
    }
}

#[cfg(test)]
#[path = "calls_tests.rs"]
mod tests;
