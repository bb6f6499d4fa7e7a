//! Serving int3 stops on a fake target: the C library's real code hooked
//! in byte buffers, a thread's registers and stack, and what the tracer
//! asked of the target and booked at each stop.

use super::*;
use crate::heap;
use crate::os::ptrace::zeroed_regs;
use crate::queue::Receiver;
use crate::trace_msg::TraceMsg;
use crate::tracer::probes::int3;
use crate::tracer::process::Thread;
use crate::tracer::space::fake::{FakeSpace, PID};
use crate::tracer::target::fake::{Call, FakeTarget};

/// The thread's stack pointer at the entry, and the caller's return
/// address on top of its stack.
const SP: u64 = 0x7ff0_0000;
const RET: u64 = 0x40_1234;
const STACK: u64 = 0x100;

/// Everything a stop is served with.
struct Rig {
    opts: TraceOptions,
    family: Family,
    book: Booking,
    rx: Receiver<Vec<TraceMsg>>,
    heaps: HeapMaps,
    stats: TraceStats,
    target: FakeTarget,
}

impl Rig {
    /// Process [`PID`] with the C library hooked by int3s (its threads do
    /// not copy their stacks), and its thread [`PID`] running.
    fn new() -> Rig {
        let mut fake = FakeSpace::libc(true);
        fake.hook();
        let mut target = FakeTarget::new();
        target.spaces.insert(PID, fake.mem.clone());
        let mut stack = vec![0x5a; STACK as usize];
        stack[..8].copy_from_slice(&RET.to_le_bytes());
        fake.mem.map(SP, stack);
        let mut family = Family::of_one(PID, fake.space, &[]);
        let mut thread = Thread::new(PID, 0);
        // Its stack's mapping, known: not looked up in /proc.
        thread.stack = Some(SP - 0x1000..SP + STACK);
        family.threads.insert(PID, thread);
        let (book, rx) = Booking::for_tests(None);
        Rig {
            opts: TraceOptions::for_tests(true),
            family,
            book,
            rx,
            heaps: HeapMaps::new(heap::Facts::default()),
            stats: TraceStats::default(),
            target,
        }
    }

    fn serve(&mut self) -> Serve<'_, FakeTarget> {
        Serve {
            opts: &self.opts,
            family: &mut self.family,
            book: &mut self.book,
            heaps: &mut self.heaps,
            stats: &mut self.stats,
            target: &mut self.target,
        }
    }

    /// The int3 probe of the allocator function that is `op` alone:
    /// (its entry, where it resumes, its stub).
    fn probe(&self, op: Op) -> (u64, u64, u64) {
        let space = self.family.processes[&PID].space.as_ref().unwrap();
        space
            .hooks
            .iter()
            .find_map(|h| match (&h.kind, &h.probe) {
                (
                    HookKind::Allocator { ops, .. },
                    Probe::Int3 {
                        resume_at, stub, ..
                    },
                ) if ops == &[op] => Some((h.addr, *resume_at, *stub)),
                _ => None,
            })
            .expect("hooked in the C library")
    }

    /// The thread stops at the int3 at `at` with these registers; the
    /// requests of earlier stops are forgotten.
    fn trap_at(&mut self, at: u64, rsp: u64, arg: u64, rax: u64) {
        let mut regs = zeroed_regs();
        regs.rip = at + 1;
        regs.rsp = rsp;
        regs.rdi = arg;
        regs.rax = rax;
        self.target.stopped_at(PID, at + 1, rsp);
        self.target.threads.get_mut(&PID).unwrap().regs = regs;
        self.target.calls.clear();
        self.serve().trap(PID).unwrap();
    }

    fn rip(&self) -> u64 {
        self.target.threads[&PID].regs.rip
    }

    /// The calls booked and sent so far: (op, size, block, the stack's
    /// return address and its bytes' length).
    fn sent(&mut self) -> Vec<(Op, u64, u64, u64, usize)> {
        self.book.out.send_ready(true).unwrap();
        let mut calls = Vec::new();
        while let Ok((msgs, _permit)) = self.rx.recv_timeout(std::time::Duration::ZERO) {
            for msg in msgs {
                if let TraceMsg::Call(call) = msg {
                    let (ip, len) = match &call.stack {
                        CallStack::Sample(s) => (s.ip, s.bytes.len()),
                        CallStack::CallerOnly(ret) => (*ret, 0),
                        CallStack::Unwound { .. } => (0, 0),
                    };
                    let e = &call.event;
                    calls.push((e.op, e.size.unwrap_or(0), e.ptr, ip, len));
                }
            }
        }
        calls
    }
}

#[test]
fn a_malloc_goes_through_its_stub_and_is_booked_at_its_return() {
    let mut rig = Rig::new();
    let (entry, _, stub) = rig.probe(Op::Malloc);
    rig.trap_at(entry, SP, 24, 0);
    // GETREGS, SETREGS, CONT: into the stub, which calls the function.
    assert_eq!(rig.target.calls, [Call::SetRegs(PID), Call::Cont(PID, 0)]);
    assert_eq!(rig.rip(), stub);
    let pending = rig.family.threads[&PID].in_call.as_ref().unwrap();
    assert_eq!(
        (pending.op, pending.args[0], pending.entry_sp),
        (Op::Malloc, 24, SP)
    );
    // The stub's return int3, the stack as the stub's `call` and `ret` left it.
    let ret_int3 = stub + int3::stub().return_int3;
    rig.trap_at(ret_int3, SP - 8, 0, 0x5000);
    // The stub returns to the caller itself: the thread goes on where it is.
    assert_eq!(rig.target.calls, [Call::Cont(PID, 0)]);
    assert!(rig.family.threads[&PID].in_call.is_none());
    assert_eq!(rig.sent(), [(Op::Malloc, 24, 0x5000, RET, STACK as usize)]);
}

#[test]
fn a_free_is_booked_at_its_entry_and_goes_straight_on() {
    let mut rig = Rig::new();
    let (entry, resume_at, _) = rig.probe(Op::Free);
    rig.trap_at(entry, SP, 0x5000, 0);
    assert_eq!(rig.target.calls, [Call::SetRegs(PID), Call::Cont(PID, 0)]);
    assert_eq!(rig.rip(), resume_at);
    assert!(rig.family.threads[&PID].in_call.is_none());
    assert_eq!(rig.sent(), [(Op::Free, 0, 0x5000, RET, STACK as usize)]);
}

#[test]
fn an_entry_inside_a_pending_call_passes_through() {
    let mut rig = Rig::new();
    let (entry, resume_at, _) = rig.probe(Op::Malloc);
    rig.trap_at(entry, SP, 24, 0);
    // realloc(NULL, n) entering malloc, say: below the pending call's frame.
    rig.trap_at(entry, SP - 0x40, 8, 0);
    assert_eq!(rig.rip(), resume_at);
    assert_eq!(rig.stats.nested_calls, 1);
    let pending = rig.family.threads[&PID].in_call.as_ref().unwrap();
    assert_eq!(pending.args[0], 24);
}

#[test]
fn a_call_left_by_a_longjmp_is_lost_and_the_next_one_pending() {
    let mut rig = Rig::new();
    let (entry, _, stub) = rig.probe(Op::Malloc);
    rig.trap_at(entry, SP - 0x40, 24, 0);
    // At or above the pending call's frame: that call will never return.
    rig.trap_at(entry, SP, 32, 0);
    assert_eq!(rig.rip(), stub);
    assert_eq!(rig.stats.lost_returns, 1);
    let pending = rig.family.threads[&PID].in_call.as_ref().unwrap();
    assert_eq!((pending.args[0], pending.entry_sp), (32, SP));
    // Its late return, if it comes after all, books nothing.
    rig.trap_at(stub + int3::stub().return_int3, SP - 0x48, 0, 0x5000);
    assert_eq!(rig.target.calls, [Call::Cont(PID, 0)]);
    assert_eq!(rig.sent(), []);
}

#[test]
fn a_trap_that_is_not_ours_goes_to_the_program() {
    let mut rig = Rig::new();
    rig.trap_at(SP + 0x10, SP, 0, 0);
    assert_eq!(rig.target.calls, [Call::Cont(PID, libc::SIGTRAP)]);
    // Nor is one in a process memptrace does not know.
    rig.family.threads.insert(99, Thread::new(99, 0));
    rig.target.stopped_at(99, 0x1001, SP);
    rig.target.calls.clear();
    rig.serve().trap(99).unwrap();
    assert_eq!(rig.target.calls, [Call::Cont(99, libc::SIGTRAP)]);
}

#[test]
fn without_stacks_an_entry_keeps_only_its_caller() {
    let mut rig = Rig::new();
    rig.opts.stacks = false;
    let (entry, _, _) = rig.probe(Op::Free);
    rig.trap_at(entry, SP, 0x5000, 0);
    assert_eq!(rig.sent(), [(Op::Free, 0, 0x5000, RET, 0)]);
}

#[test]
fn posix_memalign_s_block_is_read_where_its_first_argument_points() {
    let mut target = FakeTarget::new();
    target
        .memory(PID)
        .map(0x9000, 0x5000u64.to_le_bytes().to_vec());
    let call = |op| PendingCall {
        op,
        args: [0x9000, 16, 64],
        entry_sp: SP,
        stub: 0,
        stack: CallStack::CallerOnly(0),
        module_id: 0,
    };
    assert_eq!(
        stored_block_in(&mut target, PID, &call(Op::PosixMemalign), 0),
        0x5000
    );
    // It failed (ENOMEM): nothing stored.
    let enomem = libc::ENOMEM as u64;
    assert_eq!(
        stored_block_in(&mut target, PID, &call(Op::PosixMemalign), enomem),
        0
    );
    assert_eq!(stored_block_in(&mut target, PID, &call(Op::Malloc), 0), 0);
}
