//! Stopping every thread on a fake target: each kind of stop settled (a
//! trap of memptrace's completed or rewound, a signal kept), children born
//! meanwhile adopted stopped.

use std::collections::HashSet;

use super::*;
use crate::event::Op;
use crate::sink::Record;
use crate::trace_msg::{CallStack, TraceMsg};
use crate::tracer::life::tests::Rig;
use crate::tracer::probes::int3;
use crate::tracer::process::PendingCall;
use crate::tracer::space::fake::PID;
use crate::tracer::target::fake::{Call, FakeTarget};

/// The C library hooked with int3 probes, in a family of one process
/// [`PID`] whose thread `PID + 1` runs too; an allocator's entry and the
/// return int3 of its stub.
fn hooked() -> (Family, u64, u64) {
    let rig = Rig::new(&[PID, PID + 1]);
    let (entry, ret) = rig.allocator_probe();
    (rig.family, entry, ret)
}

#[test]
fn a_thread_past_an_entry_int3_is_rewound_to_the_entry() {
    let (family, entry, _) = hooked();
    let mut target = FakeTarget::new();
    target.stopped_at(PID + 1, entry + 1, 0x7000);
    assert!(family.at_int3(&mut target, PID + 1));
    let trap = family.rewind_trap(&mut target, PID + 1).unwrap();
    assert!(matches!(trap, Trap::Rewound));
    assert_eq!(target.threads[&(PID + 1)].regs.rip, entry);
    assert_eq!(target.calls, vec![Call::SetRegs(PID + 1)]);
}

#[test]
fn a_return_through_a_stub_is_left_where_it_is_to_be_recorded() {
    let (family, _, ret) = hooked();
    let mut target = FakeTarget::new();
    target.stopped_at(PID, ret + 1, 0x7000);
    assert!(family.at_int3(&mut target, PID));
    let mut regs = target.threads[&PID].regs;
    regs.rax = 0x5000;
    target.set_regs(PID, &regs).unwrap();
    target.calls.clear();
    let trap = family.rewind_trap(&mut target, PID).unwrap();
    assert!(matches!(
        trap,
        Trap::Returned {
            rsp: 0x7000,
            rax: 0x5000
        }
    ));
    assert_eq!(target.threads[&PID].regs.rip, ret + 1);
    assert!(target.calls.is_empty(), "the thread goes on to its caller");
}

#[test]
fn a_sigtrap_elsewhere_is_the_programs_own() {
    let (family, entry, _) = hooked();
    let mut target = FakeTarget::new();
    // Just past the entry's int3 is the program's code again.
    target.stopped_at(PID, entry + 2, 0x7000);
    // A thread of no traced process.
    target.stopped_at(99, entry + 1, 0x7000);
    for tid in [PID, 99] {
        assert!(!family.at_int3(&mut target, tid));
        assert!(matches!(
            family.rewind_trap(&mut target, tid).unwrap(),
            Trap::Foreign
        ));
    }
    assert!(target.calls.is_empty());
}

#[test]
fn a_thread_gone_meanwhile_has_nothing_to_settle() {
    let (family, _, _) = hooked();
    let mut target = FakeTarget::new();
    assert!(!family.at_int3(&mut target, PID));
    assert!(matches!(
        family.rewind_trap(&mut target, PID).unwrap(),
        Trap::Rewound
    ));
    assert!(target.calls.is_empty());
}

/// Settle `stop` of thread `tid` as a detach does: whether the thread is
/// stopped for good, and the signal kept for it, if any.
fn settle(rig: &mut Rig, tid: Tid, stop: Stop) -> (bool, Option<i32>) {
    let mut deliver = HashMap::new();
    let done = rig.life().settle_stopping(tid, stop, &mut deliver).unwrap();
    assert!(deliver.keys().all(|&t| t == tid), "{deliver:?}");
    (done, deliver.get(&tid).copied())
}

/// Rig's thread `tid` stands stopped at `rip`, stack pointer 0x7000.
fn stopped_at(rig: &mut Rig, tid: Tid, rip: u64) {
    rig.target.stopped_at(tid, rip, 0x7000);
}

#[test]
fn a_signal_met_while_stopping_is_kept_for_the_release() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    stopped_at(&mut rig, PID + 1, 0x1000);
    let stop = Stop::Signal(libc::SIGUSR1);
    assert_eq!(settle(&mut rig, PID + 1, stop), (true, Some(libc::SIGUSR1)));
    // Kept, not delivered: the thread stays stopped.
    assert!(rig.target.calls.is_empty());
    assert!(rig.target.threads[&(PID + 1)].stopped);
}

#[test]
fn an_entrys_trap_is_rewound_and_never_reaches_the_program() {
    let mut rig = Rig::new(&[PID]);
    let (entry, _) = rig.allocator_probe();
    stopped_at(&mut rig, PID, entry + 1);
    let trap = Stop::Signal(libc::SIGTRAP);
    assert_eq!(settle(&mut rig, PID, trap), (true, None));
    assert_eq!(rig.target.threads[&PID].regs.rip, entry);
    assert_eq!(rig.target.calls, [Call::SetRegs(PID)]);
}

#[test]
fn the_programs_own_trap_is_kept_for_it() {
    let mut rig = Rig::new(&[PID]);
    stopped_at(&mut rig, PID, 0x1234);
    let trap = Stop::Signal(libc::SIGTRAP);
    assert_eq!(settle(&mut rig, PID, trap), (true, Some(libc::SIGTRAP)));
    assert!(rig.target.calls.is_empty());
}

#[test]
fn a_call_returning_through_its_stub_while_stopping_is_recorded() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    let (_, ret) = rig.allocator_probe();
    // malloc(48) entered with rsp 0x7008: its stub's return int3 is hit
    // with rsp 0x7000, returning 0x5000.
    rig.family.threads.get_mut(&(PID + 1)).unwrap().in_call = Some(PendingCall {
        op: Op::Malloc,
        args: [48, 0, 0],
        entry_sp: 0x7008,
        stub: ret - int3::stub().return_int3,
        stack: CallStack::CallerOnly(0x4321),
        module_id: 1,
    });
    rig.target.stopped_at(PID + 1, ret + 1, 0x7000);
    rig.target.threads.get_mut(&(PID + 1)).unwrap().regs.rax = 0x5000;
    let trap = Stop::Signal(libc::SIGTRAP);
    assert_eq!(settle(&mut rig, PID + 1, trap), (true, None));
    // Left where it is: it goes on to its caller when let go.
    assert!(rig.target.calls.is_empty());
    assert!(rig.family.threads[&(PID + 1)].in_call.is_none());
    let sent = rig.sent();
    let calls: Vec<_> = sent
        .iter()
        .filter_map(|m| match m {
            TraceMsg::Call(call) => Some(&call.event),
            _ => None,
        })
        .collect();
    assert_eq!(calls.len(), 1);
    let event = calls[0];
    assert_eq!(
        (event.op, event.ptr, event.size),
        (Op::Malloc, 0x5000, Some(48))
    );
    assert_eq!((event.pid, event.tid), (PID as u32, (PID + 1) as u32));
    assert_eq!(rig.stats.lost_returns, 0);
}

#[test]
fn an_interrupt_at_an_int3_with_its_trap_queued_lets_the_trap_be_reported() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    let (entry, _) = rig.allocator_probe();
    stopped_at(&mut rig, PID + 1, entry + 1);
    rig.target.queued.insert((PID + 1, libc::SIGTRAP));
    let interrupt = Stop::EventStop(libc::SIGTRAP);
    // Resumed, to be settled at its trap.
    assert_eq!(settle(&mut rig, PID + 1, interrupt), (false, None));
    assert_eq!(rig.target.calls, [Call::Cont(PID + 1, 0)]);
    // Nothing queued: stopped for good where it is.
    rig.target.queued.clear();
    stopped_at(&mut rig, PID + 1, entry + 1);
    rig.target.calls.clear();
    assert_eq!(settle(&mut rig, PID + 1, interrupt), (true, None));
    assert!(rig.target.calls.is_empty());
}

#[test]
fn an_interrupt_after_a_step_into_a_signal_lets_the_steps_trap_be_reported() {
    // A signal was delivered to a thread in a call by a step (see
    // `Family::deliver`); the detach's interrupt came after the step's debug
    // exception, before its SIGTRAP was reported.
    let mut rig = Rig::new(&[PID, PID + 1]);
    rig.family.threads.get_mut(&(PID + 1)).unwrap().stepping = true;
    stopped_at(&mut rig, PID + 1, 0x1234);
    rig.target.queued.insert((PID + 1, libc::SIGTRAP));
    let interrupt = Stop::EventStop(libc::SIGTRAP);
    assert_eq!(settle(&mut rig, PID + 1, interrupt), (false, None));
    assert_eq!(rig.target.calls, [Call::Cont(PID + 1, 0)]);
    // The trap, reported: the step's end, never the program's.
    rig.target.queued.clear();
    rig.target.calls.clear();
    stopped_at(&mut rig, PID + 1, 0x1235);
    rig.target.threads.get_mut(&(PID + 1)).unwrap().si_code =
        crate::tracer::serve::handlers::TRAP_TRACE;
    let trap = Stop::Signal(libc::SIGTRAP);
    assert_eq!(settle(&mut rig, PID + 1, trap), (true, None));
    assert!(!rig.family.threads[&(PID + 1)].stepping);
    // A thread not stepping, away from any int3, with the program's own
    // SIGTRAP queued: stopped for good, the signal left to the program.
    rig.target.queued.insert((PID + 1, libc::SIGTRAP));
    rig.target.calls.clear();
    assert_eq!(settle(&mut rig, PID + 1, interrupt), (true, None));
    assert!(rig.target.calls.is_empty());
}

#[test]
fn a_thread_born_while_stopping_is_adopted_and_stays_stopped() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    rig.target.process(PID, &[PID, PID + 1, PID + 5]);
    stopped_at(&mut rig, PID + 1, 0x1000);
    let born = (libc::PTRACE_EVENT_CLONE, (PID + 5) as u64);
    rig.target.events.insert(PID + 1, born);
    let birth = Stop::Event(libc::PTRACE_EVENT_CLONE);
    assert_eq!(settle(&mut rig, PID + 1, birth), (true, None));
    // Its first stop has not come: it is expected.
    assert!(rig.family.announced.contains_key(&(PID + 5)));
    stopped_at(&mut rig, PID + 5, 0x2000);
    rig.target.report(PID + 5, Stop::EventStop(libc::SIGTRAP));
    assert!(matches!(
        rig.life().next_stop_while_stopping().unwrap(),
        Stopping::Adopted(t) if t == PID + 5
    ));
    assert!(rig.family.announced.is_empty());
    assert_eq!(rig.family.threads[&(PID + 5)].pid, PID);
    // Not resumed: it is let go (or resumed by the attach) with the rest.
    assert!(rig.target.calls.is_empty());
    let row = |m: &TraceMsg| match m {
        TraceMsg::Record(Record::Thread(t)) => Some((t.tid, t.pid)),
        _ => None,
    };
    let rows: Vec<_> = rig.sent().iter().filter_map(row).collect();
    assert_eq!(rows, [((PID + 5) as u32, PID as u32)]);
}

#[test]
fn a_first_stop_before_its_birth_is_kept_until_the_birth() {
    let mut rig = Rig::new(&[PID]);
    rig.target.process(PID, &[PID, PID + 5]);
    stopped_at(&mut rig, PID + 5, 0x2000);
    stopped_at(&mut rig, PID, 0x1000);
    rig.target.report(PID + 5, Stop::EventStop(libc::SIGTRAP));
    rig.target
        .report(PID, Stop::Event(libc::PTRACE_EVENT_CLONE));
    let born = (libc::PTRACE_EVENT_CLONE, (PID + 5) as u64);
    rig.target.events.insert(PID, born);
    assert!(matches!(
        rig.life().next_stop_while_stopping().unwrap(),
        Stopping::Nothing
    ));
    assert!(rig.family.early.contains_key(&(PID + 5)));
    let Stopping::Known(tid, stop) = rig.life().next_stop_while_stopping().unwrap() else {
        panic!("the parent's birth event");
    };
    assert_eq!((tid, settle(&mut rig, tid, stop)), (PID, (true, None)));
    assert!(rig.family.early.is_empty() && rig.family.announced.is_empty());
    assert!(rig.family.threads.contains_key(&(PID + 5)));
    assert!(rig.target.calls.is_empty());
}

#[test]
fn a_known_threads_stop_met_while_adopting_is_kept_for_the_wait_loop() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    let child = Child::Thread { pid: PID };
    rig.family.announced.insert(PID + 5, child);
    stopped_at(&mut rig, PID + 1, 0x1000);
    rig.target.report(PID + 1, Stop::Signal(libc::SIGUSR2));
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    rig.life().adopt_announced(deadline).unwrap();
    assert_eq!(rig.target.kept, [(PID + 1, Stop::Signal(libc::SIGUSR2))]);
    assert!(rig.family.announced.contains_key(&(PID + 5)));
}

#[test]
fn a_vfork_child_is_adopted_in_its_parents_memory_with_the_parent_paused() {
    let mut rig = Rig::new(&[PID]);
    let child = Child::Shared {
        parent: PID,
        by: PID,
    };
    rig.life().adopt_stopped(PID + 9, child).unwrap();
    let process = &rig.family.processes[&(PID + 9)];
    assert_eq!(process.role, Role::Shares { parent: PID });
    assert_eq!(process.paused, Some(PID));
    assert_eq!(rig.family.pid_of(PID + 9), Some(PID + 9));
    assert_eq!(rig.family.vfork_parents(), HashSet::from([PID]));
    assert!(rig.target.calls.is_empty());
}

#[test]
fn an_exec_while_stopping_forgets_the_probes_of_the_old_code() {
    let mut rig = Rig::new(&[PID]);
    stopped_at(&mut rig, PID, 0x1000);
    let hooks = |rig: &Rig| rig.family.space_of(PID).unwrap().hooks.iter().count();
    assert!(hooks(&rig) > 0);
    let exec = Stop::Event(libc::PTRACE_EVENT_EXEC);
    assert_eq!(settle(&mut rig, PID, exec), (true, None));
    assert_eq!(hooks(&rig), 0);
    assert!(rig.target.calls.is_empty());
}

#[test]
fn a_thread_that_ends_while_stopping_is_forgotten() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    assert_eq!(settle(&mut rig, PID + 1, Stop::Exited(0)), (true, None));
    assert!(!rig.family.threads.contains_key(&(PID + 1)));
    assert!(rig.family.threads.contains_key(&PID));
    assert_eq!(rig.control.ending, None);
}
