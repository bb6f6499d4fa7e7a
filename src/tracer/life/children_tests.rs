//! Children on a fake target: a clone, fork or vfork announced by its
//! parent's event, and adopted at its first stop, whichever comes first;
//! a fork that is not followed released with its code put back, and so is
//! a child that shared the memory of a process that ended.

use crate::os::ptrace::{Stop, Tid};
use crate::tracer::life::tests::Rig;
use crate::tracer::process::{Child, Process, Role, Thread};
use crate::tracer::space::fake::{FakeSpace, PID};
use crate::tracer::target::Target;
use crate::tracer::target::fake::Call;

const NEW: Tid = PID + 1;
const CHILD: Tid = PID + 10;

impl Rig {
    /// Thread `tid` stopped at ptrace event `event`, which made `child`.
    pub fn at_event(&mut self, tid: Tid, event: i32, child: Tid) {
        self.target.threads.get_mut(&tid).expect("seized").stopped = true;
        self.target.events.insert(tid, (event, child as u64));
    }

    /// `tid`, new and stopped (its first stop not reported).
    pub fn born(&mut self, tid: Tid) {
        self.target.stopped_at(tid, 0x1000, 0x7000);
    }

    /// Thread `tid` reports ptrace event `event`, which made `child`
    /// (`stopped`: while detaching).
    pub fn announce(&mut self, tid: Tid, event: i32, child: Tid, stopped: bool) {
        self.at_event(tid, event, child);
        self.life()
            .announce_child(tid, event, stopped)
            .expect("announced");
    }
}

/// Process [`PID`] made thread [`NEW`], whose first stop, a group-stop's,
/// came before the clone event was reported (`stopped`: while detaching).
fn clone_after_its_first_stop(stopped: bool) -> Rig {
    let mut rig = Rig::new(&[PID]);
    rig.target.process(PID, &[PID, NEW]);
    rig.born(NEW);
    rig.family.early.insert(NEW, FIRST);
    rig.announce(PID, libc::PTRACE_EVENT_CLONE, NEW, stopped);
    assert!(rig.family.early.is_empty() && rig.family.announced.is_empty());
    assert_eq!(rig.family.threads[&NEW].pid, PID);
    rig
}

/// The first stop of a new thread or child.
const FIRST: Stop = Stop::EventStop(libc::SIGSTOP);

#[test]
fn a_thread_announced_before_its_first_stop_is_adopted_when_it_comes() {
    let mut rig = Rig::new(&[PID]);
    rig.target.process(PID, &[PID, NEW]);
    rig.announce(PID, libc::PTRACE_EVENT_CLONE, NEW, false);
    assert!(matches!(
        rig.family.announced.get(&NEW),
        Some(Child::Thread { pid: PID })
    ));
    assert!(!rig.family.threads.contains_key(&NEW));
    // Its first stop, an interrupt's: it joins its process and runs on.
    rig.born(NEW);
    let child = rig.family.announced.remove(&NEW).unwrap();
    rig.life()
        .adopt(NEW, child, Stop::EventStop(libc::SIGTRAP))
        .unwrap();
    assert_eq!(rig.family.threads[&NEW].pid, PID);
    assert_eq!(rig.family.pid_of(NEW), Some(PID));
    assert_eq!(rig.target.calls, vec![Call::Cont(NEW, 0)]);
}

#[test]
fn a_thread_whose_first_stop_came_first_is_adopted_at_its_announcement() {
    // Born while its process stops: it starts in that group-stop, and
    // stays in it (PTRACE_LISTEN).
    let rig = clone_after_its_first_stop(false);
    assert_eq!(rig.target.calls, vec![Call::Listen(NEW)]);
}

#[test]
fn a_thread_born_while_detaching_is_adopted_and_left_stopped() {
    // To be detached with the rest: not resumed.
    let rig = clone_after_its_first_stop(true);
    assert!(rig.target.calls.is_empty());
    assert!(rig.target.threads[&NEW].stopped);
}

#[test]
fn a_vfork_child_runs_in_its_parents_memory_with_the_parents_slot_paused() {
    let mut rig = Rig::new(&[PID, NEW]);
    rig.target.process(CHILD, &[CHILD]);
    rig.announce(NEW, libc::PTRACE_EVENT_VFORK, CHILD, false);
    assert!(matches!(
        rig.family.announced.get(&CHILD),
        Some(Child::Shared {
            parent: PID,
            by: NEW
        })
    ));
    rig.born(CHILD);
    let child = rig.family.announced.remove(&CHILD).unwrap();
    rig.life().adopt(CHILD, child, FIRST).unwrap();
    let process = &rig.family.processes[&CHILD];
    assert_eq!(process.role, Role::Shares { parent: PID });
    assert_eq!(process.paused, Some(NEW));
    assert!(process.space.is_none());
    assert_eq!(rig.family.threads[&CHILD].pid, CHILD);
    // The parent's thread waits in the kernel until its child execs.
    assert_eq!(
        rig.family.vfork_parents().into_iter().collect::<Vec<_>>(),
        vec![NEW]
    );
    assert_eq!(rig.target.calls, vec![Call::Cont(CHILD, 0)]);
}

#[test]
fn a_clone_into_a_process_of_its_own_is_treated_as_sharing_memory() {
    // CLONE_VM without CLONE_THREAD: its own thread group, the parent's
    // memory; its code is never touched.
    let mut rig = Rig::new(&[PID]);
    rig.target.process(CHILD, &[CHILD]);
    rig.announce(PID, libc::PTRACE_EVENT_CLONE, CHILD, false);
    assert!(matches!(
        rig.family.announced.get(&CHILD),
        Some(Child::Shared {
            parent: PID,
            by: PID
        })
    ));
}

#[test]
fn a_fork_not_followed_is_released_with_its_code_put_back() {
    let mut rig = Rig::new(&[PID]);
    // The child's copy of its parent's memory, probes included.
    let parent = rig.target.memory(PID);
    let code = FakeSpace::libc(true).code;
    let child = rig.target.memory(CHILD);
    let hooked = |(at, orig): &(u64, Vec<u8>)| parent.bytes(*at, orig.len()) != *orig;
    assert!(code.iter().any(hooked));
    for (at, orig) in &code {
        child.map(*at, parent.bytes(*at, orig.len()));
    }
    // No image to find a system call in (the munmap is injected, on the
    // real path only): the trampoline pages stay, which is said.
    rig.family.space_mut(PID).unwrap().modules.clear();
    rig.born(CHILD);
    rig.family.early.insert(CHILD, FIRST);
    rig.announce(PID, libc::PTRACE_EVENT_FORK, CHILD, false);
    for (at, orig) in &code {
        assert_eq!(&child.bytes(*at, orig.len()), orig, "code at {at:#x}");
    }
    assert_eq!(rig.target.calls, vec![Call::Detach(CHILD, 0)]);
    assert!(!rig.family.processes.contains_key(&CHILD));
    assert!(!rig.family.threads.contains_key(&CHILD));
    assert_eq!(rig.stats.warnings.len(), 1, "{:?}", rig.stats.warnings);
    assert!(rig.stats.warnings[0].starts_with(&format!("cleaning code in child {CHILD}")));
    // The parent's code is its own: still hooked.
    assert!(code.iter().any(hooked));
}

#[test]
fn a_child_sharing_memory_with_a_process_that_ends_gets_the_code_back_and_goes() {
    // A clone with CLONE_VM outlived its parent: the memory is its own now.
    let mut rig = Rig::new(&[PID]);
    rig.target.process(CHILD, &[CHILD]);
    rig.target.seize(CHILD, 0).unwrap();
    rig.target.calls.clear();
    let mut process = Process::new(Role::Shares { parent: PID }, None);
    process.paused = Some(PID);
    rig.family.processes.insert(CHILD, process);
    rig.family.threads.insert(CHILD, Thread::new(CHILD, 0));
    rig.life().thread_gone(PID, Stop::Exited(0)).unwrap();
    let mem = rig.target.memory(PID);
    for (at, orig) in FakeSpace::libc(true).code {
        assert_eq!(mem.bytes(at, orig.len()), orig, "code at {at:#x}");
    }
    // Running: stopped first, then let go.
    assert_eq!(
        rig.target.calls,
        vec![Call::Interrupt(CHILD), Call::Detach(CHILD, 0)]
    );
    assert!(rig.family.processes.is_empty() && rig.family.threads.is_empty());
}
