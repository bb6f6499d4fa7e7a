//! Signal handlers that run while a thread's allocator call is pending
//! (int3 probes): the handler's own calls are recorded whole, and the
//! interrupted call's return is still matched to its entry.
//!
//! A thread with a call pending (entry seen, return not yet) that is sent
//! a signal is stepped into it (PTRACE_SINGLESTEP with the signal): the
//! kernel builds the handler's frame and reports a SIGTRAP stop at the
//! handler's first instruction before it runs (`signal_delivered`,
//! kernel/signal.c; si_code SIGTRAP), or, when no handler runs, after one
//! instruction (si_code TRAP_TRACE). At the first, the thread's stack
//! pointer is the handler's frame: the pending call is put aside with it
//! ([`HandlerFrame`]), and a call entered below that frame is the
//! handler's, the outermost of a level of its own. A call entered below a
//! pending call of the same level is the allocator's own (realloc entering
//! malloc): not recorded, as ever.
//!
//! Nothing tells memptrace when a handler returns (rt_sigreturn is not
//! traced): the first stop of an entry or a return whose stack pointer is
//! not inside the frame's stack below it ends the frame, and the call it
//! interrupted is pending again. The frame lies below the interrupted
//! stack pointer by the 128-byte red zone and the saved registers (over a
//! kilobyte with the FPU state), deeper than the allocator's own calls go.

use std::io;

use crate::os::ptrace::{self, Tid};
use crate::tracer::process::{Family, PendingCall, Thread};
use crate::tracer::stop::is_stopping_signal;
use crate::tracer::target::Target;

/// si_code of the stop at a handler's first instruction after a step
/// into a signal (`ptrace_notify(SIGTRAP)`).
const AT_HANDLER: i32 = libc::SIGTRAP;
/// si_code of a single-step trap (`TRAP_TRACE`, siginfo.h): no handler ran.
pub(in crate::tracer) const TRAP_TRACE: i32 = 2;
/// si_code of a single step that ended at a system call's exit
/// (`TRAP_BRKPT`: x86's `user_single_step_report`). A thread stepped with a
/// signal it ignores, while stopped inside a blocking call (a futex wait in
/// the allocator's lock), goes back into the call; the step ends only when
/// the call returns, maybe much later, and is reported so. No handler ran.
const TRAP_BRKPT: i32 = 1;

/// A signal handler running on a thread that had a call pending.
#[derive(Debug)]
pub struct HandlerFrame {
    /// The handler's stack pointer at its first instruction: its return
    /// address (the signal-return trampoline) sits there, the saved
    /// context above.
    pub sp: u64,
    /// The start of the mapping holding that stack (an alternate signal
    /// stack may lie anywhere): a stack pointer is the handler's when it
    /// is in `lo..sp`.
    pub lo: u64,
    /// The call the handler interrupted.
    pub call: Option<PendingCall>,
}

impl HandlerFrame {
    fn holds(&self, rsp: u64) -> bool {
        self.lo <= rsp && rsp < self.sp
    }
}

impl Thread {
    /// End the handler frames that a stack pointer `rsp` seen at an entry
    /// or a return is not inside: their handlers have returned (or jumped
    /// out), and the call each interrupted is pending again. Returns how
    /// many handler calls were left pending, never to return.
    pub fn leave_handlers(&mut self, rsp: u64) -> u64 {
        let mut lost = 0;
        while self.handlers.last().is_some_and(|f| !f.holds(rsp)) {
            if self.in_call.is_some() {
                lost += 1;
            }
            self.in_call = self.handlers.pop().and_then(|f| f.call);
        }
        lost
    }

    /// Every call of the thread still pending, its own and those its
    /// handlers interrupted, taken.
    pub fn take_calls(&mut self) -> Vec<PendingCall> {
        let mut calls: Vec<PendingCall> = self.in_call.take().into_iter().collect();
        calls.extend(self.handlers.drain(..).rev().filter_map(|f| f.call));
        calls
    }
}

impl Family {
    /// Let thread `tid` go at its signal-delivery-stop with `sig`: stepped
    /// into the handler when it has a call pending (see the module docs).
    /// Stopping signals are delivered as they are: a group-stop follows.
    /// A thread gone meanwhile is not an error (waitpid reports its end).
    pub fn deliver<T: Target>(&mut self, target: &mut T, tid: Tid, sig: i32) -> io::Result<()> {
        let thread = self
            .threads
            .get_mut(&tid)
            .filter(|t| sig != 0 && t.in_call.is_some() && !is_stopping_signal(sig));
        let steps = thread.is_some();
        if let Some(thread) = thread {
            thread.stepping = true;
        }
        // The heartbeat is fresh whenever a thread runs.
        self.beat();
        if steps {
            ptrace::unless_gone(target.step(tid, sig))
        } else {
            ptrace::unless_gone(target.cont(tid, sig))
        }
    }

    /// At a SIGTRAP stop of `tid`: true when it ends the thread's step into
    /// a signal (and was dealt with: a handler's frame put on the thread),
    /// false when it is any other trap. The thread is left stopped.
    pub fn step_ended<T: Target>(&mut self, target: &mut T, tid: Tid) -> bool {
        let Some(thread) = self.threads.get_mut(&tid) else {
            return false;
        };
        if !std::mem::take(&mut thread.stepping) {
            return false;
        }
        let code = target.si_code(tid).unwrap_or(0);
        if code == TRAP_TRACE || code == TRAP_BRKPT {
            return true;
        }
        if code != AT_HANDLER {
            return false;
        }
        let Ok(regs) = target.regs(tid) else {
            return true; // gone: waitpid will say
        };
        let sp = regs.rsp;
        let lo = match &thread.stack {
            Some(stack) if stack.contains(&sp) => stack.start,
            _ => target.mapping_at(thread.pid, sp).map_or(0, |m| m.start),
        };
        let call = thread.in_call.take();
        thread.handlers.push(HandlerFrame { sp, lo, call });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Op;
    use crate::trace_msg::CallStack;
    use crate::tracer::target::fake::{Call, FakeTarget};

    fn call(entry_sp: u64) -> PendingCall {
        PendingCall {
            op: Op::Malloc,
            args: [24, 0, 0],
            entry_sp,
            stub: 0x7000,
            stack: CallStack::CallerOnly(0x401000),
            module_id: 1,
        }
    }

    /// A thread inside malloc (entry at 0x9000) interrupted by a handler
    /// whose frame is at 0x8000, on the stack 0x1000..0xa000.
    fn interrupted() -> Thread {
        let mut t = Thread::new(1, 0);
        t.handlers.push(HandlerFrame {
            sp: 0x8000,
            lo: 0x1000,
            call: Some(call(0x9000)),
        });
        t
    }

    #[test]
    fn a_handler_call_is_its_own_level() {
        let mut t = interrupted();
        assert_eq!(t.leave_handlers(0x7f00), 0);
        assert!(t.in_call.is_none(), "the handler's call is outermost");
        t.in_call = Some(call(0x7f00));
        // malloc inside the handler's realloc: same level, below it.
        assert_eq!(t.leave_handlers(0x7e00), 0);
        assert_eq!(t.in_call.as_ref().map(|c| c.entry_sp), Some(0x7f00));
        assert_eq!(t.handlers.len(), 1);
    }

    #[test]
    fn the_interrupted_call_is_pending_again_once_the_handler_is_left() {
        let mut t = interrupted();
        // The interrupted malloc's return (its stub's int3, 8 below entry).
        assert_eq!(t.leave_handlers(0x9000 - 8), 0);
        assert_eq!(t.in_call.as_ref().map(|c| c.entry_sp), Some(0x9000));
        assert!(t.handlers.is_empty());
    }

    #[test]
    fn a_handler_call_left_by_a_longjmp_is_lost() {
        let mut t = interrupted();
        t.in_call = Some(call(0x7f00));
        assert_eq!(t.leave_handlers(0x8f00), 1);
        assert_eq!(t.in_call.as_ref().map(|c| c.entry_sp), Some(0x9000));
    }

    #[test]
    fn an_alternate_stack_above_is_not_the_handler_s() {
        // The handler runs on a stack mapped above the thread's.
        let mut t = Thread::new(1, 0);
        t.handlers.push(HandlerFrame {
            sp: 0x20_8000,
            lo: 0x20_0000,
            call: Some(call(0x9000)),
        });
        assert_eq!(t.leave_handlers(0x20_7000), 0);
        assert!(t.in_call.is_none());
        // Back on the thread's stack, inside the interrupted call.
        assert_eq!(t.leave_handlers(0x8f00), 0);
        assert_eq!(t.in_call.as_ref().map(|c| c.entry_sp), Some(0x9000));
    }

    #[test]
    fn nested_handlers_unwind_in_order_and_every_call_is_taken() {
        let mut t = interrupted();
        t.handlers.push(HandlerFrame {
            sp: 0x6000,
            lo: 0x1000,
            call: Some(call(0x7f00)),
        });
        t.in_call = Some(call(0x5f00));
        let sps: Vec<u64> = t.take_calls().iter().map(|c| c.entry_sp).collect();
        assert_eq!(sps, [0x5f00, 0x7f00, 0x9000]);
        assert!(t.handlers.is_empty() && t.in_call.is_none());
    }

    /// A family of one thread (7 of process 7), stopped in the fake at
    /// stack pointer `rsp` on the stack 0x1000..0xa000, `pending` a call.
    fn one_thread(pending: bool, rsp: u64) -> (Family, FakeTarget) {
        let mut family = Family::default();
        let mut thread = Thread::new(7, 0);
        thread.stack = Some(0x1000..0xa000);
        thread.in_call = pending.then(|| call(0x9000));
        family.threads.insert(7, thread);
        let mut target = FakeTarget::new();
        target.stopped_at(7, 0x5000, rsp);
        (family, target)
    }

    /// A thread is stepped into a signal's handler only with a call
    /// pending and a signal that does not stop it.
    #[test]
    fn only_a_call_pending_steps_a_thread_into_its_handler() {
        let (usr1, tstp) = (libc::SIGUSR1, libc::SIGTSTP);
        let cases = [
            (false, usr1, Call::Cont(7, usr1), false),
            (true, usr1, Call::Step(7, usr1), true),
            (true, tstp, Call::Cont(7, tstp), false),
        ];
        for (pending, sig, asked, stepping) in cases {
            let (mut family, mut target) = one_thread(pending, 0x8f00);
            family.deliver(&mut target, 7, sig).unwrap();
            assert_eq!(target.calls, [asked], "pending {pending}, signal {sig}");
            assert_eq!(family.threads[&7].stepping, stepping);
        }
    }

    /// The thread of [`one_thread`], with a call pending, sent SIGUSR1 and
    /// stopped after its step at `rip`, `rsp` with `si_code`: the step
    /// ended there.
    fn stepped(rip: u64, rsp: u64, si_code: i32) -> Family {
        let (mut family, mut target) = one_thread(true, rsp);
        family.deliver(&mut target, 7, libc::SIGUSR1).unwrap();
        target.stopped_at(7, rip, rsp);
        target.threads.get_mut(&7).unwrap().si_code = si_code;
        assert!(family.step_ended(&mut target, 7));
        family
    }

    #[test]
    fn a_step_that_reaches_a_handler_puts_the_pending_call_aside() {
        let family = stepped(0x6000, 0x8000, AT_HANDLER);
        let thread = &family.threads[&7];
        assert!(!thread.stepping && thread.in_call.is_none());
        let frame = &thread.handlers[..];
        assert_eq!(frame.len(), 1);
        assert_eq!((frame[0].sp, frame[0].lo), (0x8000, 0x1000));
        assert_eq!(frame[0].call.as_ref().map(|c| c.entry_sp), Some(0x9000));
    }

    #[test]
    fn a_step_without_a_handler_leaves_the_call_pending() {
        let family = stepped(0x5001, 0x8f00, TRAP_TRACE);
        let thread = &family.threads[&7];
        assert!(thread.handlers.is_empty() && thread.in_call.is_some());
    }

    #[test]
    fn a_step_that_ends_at_a_system_calls_exit_leaves_the_call_pending() {
        // Found by an attach soak: stepped with SIGCHLD (ignored) inside a
        // futex wait, a thread's step ended when the wait did; taken for
        // the program's own trap, that SIGTRAP killed the program.
        let family = stepped(0x5001, 0x8f00, TRAP_BRKPT);
        let thread = &family.threads[&7];
        assert!(!thread.stepping);
        assert!(thread.handlers.is_empty() && thread.in_call.is_some());
    }

    #[test]
    fn a_trap_that_ends_no_step_is_not_the_step_s() {
        let (mut family, mut target) = one_thread(true, 0x8f00);
        target.threads.get_mut(&7).unwrap().si_code = AT_HANDLER;
        assert!(!family.step_ended(&mut target, 7), "not stepping");
        family.threads.get_mut(&7).unwrap().stepping = true;
        target.threads.get_mut(&7).unwrap().si_code = 0x80; // SI_KERNEL: an int3
        assert!(!family.step_ended(&mut target, 7));
        assert!(!family.threads[&7].stepping, "the step is over either way");
        assert!(family.threads[&7].handlers.is_empty());
    }
}
