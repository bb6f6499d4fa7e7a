//! The detach on a fake target: every thread stopped and let go with the
//! signal it is owed, children born meanwhile released, a vfork parent
//! let go last, threads in a probe's code run out of it. The munmap of the
//! trampoline pages is injected (not behind the port): these tests leave
//! the space no image to find a system call in, so the pages stay, and
//! that is said.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::os::ptrace::{self, Stop};
use crate::tracer::life::detach::*;
use crate::tracer::life::tests::Rig;
use crate::tracer::space::fake::{FakeSpace, PID};
use crate::tracer::target::fake::{Call, FakeTarget};
use crate::tracer::{DETACH_PATIENCE, PATIENCE};

const T1: Tid = PID + 1;
const T2: Tid = PID + 2;
const CHILD: Tid = PID + 10;

/// A new thread's or child's first stop.
const FIRST: Stop = Stop::EventStop(libc::SIGSTOP);

impl Rig {
    /// The hooked space's code as the C library's file has it.
    fn original_code() -> Vec<(u64, Vec<u8>)> {
        FakeSpace::libc(true).code
    }

    /// No image to find a system call in (see the module's doc).
    fn no_syscall(&mut self) {
        self.family.space_mut(PID).expect("traced").modules.clear();
    }

    /// Every byte of process `pid`'s code is the file's again.
    fn code_is_back(&mut self, pid: Tid) -> bool {
        let mem = self.target.memory(pid);
        Rig::original_code()
            .iter()
            .all(|(at, orig)| mem.bytes(*at, orig.len()) == *orig)
    }

    /// Detach every thread as the tracer does, the heaps aside.
    fn detach_all(&mut self) -> Vec<Tid> {
        let detached = self.life().detach_all(PATIENCE).expect("detached");
        let heaps = detached.heaps.clone();
        self.life().finish_detach(detached, DETACH_PATIENCE);
        heaps
    }

    /// While detaching, thread `tid` reports ptrace event `event`, which
    /// made [`CHILD`]; then the child's first stop comes.
    fn makes_a_child(&mut self, tid: Tid, event: i32) {
        self.target.report(tid, Stop::Event(event));
        self.target.events.insert(tid, (event, CHILD as u64));
        self.target.stopped_at(CHILD, 0x1000, 0x7000);
        self.target.report(CHILD, FIRST);
    }

    /// The position of `call` among the calls made of the target.
    fn at(&self, call: &Call) -> usize {
        let at = self.target.calls.iter().position(|c| c == call);
        at.unwrap_or_else(|| panic!("no {call:?} in {:?}", self.target.calls))
    }

    fn detached(&self) -> Vec<Call> {
        let mut detached: Vec<Call> = (self.target.calls.iter())
            .filter(|c| matches!(c, Call::Detach(..)))
            .cloned()
            .collect();
        detached.sort_by_key(|c| format!("{c:?}"));
        detached
    }
}

fn sorted(mut calls: Vec<Call>) -> Vec<Call> {
    calls.sort_by_key(|c| format!("{c:?}"));
    calls
}

/// The warning of pages left mapped in process [`PID`].
fn left_mapped(warnings: &[String]) -> usize {
    let prefix = format!("process {PID}: trampoline pages left mapped");
    warnings.iter().filter(|w| w.starts_with(&prefix)).count()
}

/// How long the deadline test lets a thread that never comes out run:
/// long enough that a loaded machine still lets it run more than once (it
/// failed once at 50 ms under load), short enough for a unit test.
const RUN_OUT_PATIENCE: Duration = Duration::from_secs(1);

#[test]
fn every_thread_is_stopped_and_let_go_with_the_signal_it_was_stopped_with() {
    let mut rig = Rig::new(&[PID, T1, T2]);
    rig.no_syscall();
    // T1 is stopping for a signal of its own: it is owed it.
    rig.target.report(T1, Stop::Signal(libc::SIGUSR1));
    let heaps = rig.detach_all();
    assert_eq!(heaps, vec![PID]);
    let first_detach = rig
        .at(&Call::Detach(PID, 0))
        .min(rig.at(&Call::Detach(T2, 0)));
    for tid in [PID, T1, T2] {
        assert!(rig.at(&Call::Interrupt(tid)) < first_detach);
    }
    assert_eq!(
        rig.detached(),
        sorted(vec![
            Call::Detach(PID, 0),
            Call::Detach(T1, libc::SIGUSR1),
            Call::Detach(T2, 0)
        ])
    );
    assert!(rig.code_is_back(PID));
    assert!(rig.family.threads.is_empty() && rig.family.processes.is_empty());
    assert_eq!(
        left_mapped(&rig.stats.warnings),
        1,
        "{:?}",
        rig.stats.warnings
    );
    assert!(rig.stats.detach_left.is_empty());
    assert_eq!(rig.stats.in_probes_at_detach, Some(0));
    assert_eq!(rig.stats.pauses.len(), 1);
    assert_eq!(rig.stats.pauses[0].kind, "detach");
}

#[test]
fn a_fork_made_while_detaching_is_released_before_its_parent_goes() {
    let mut rig = Rig::new(&[PID]);
    rig.no_syscall();
    let child = rig.target.memory(CHILD);
    let parent = rig.target.memory(PID);
    for (at, orig) in Rig::original_code() {
        child.map(at, parent.bytes(at, orig.len()));
    }
    rig.makes_a_child(PID, libc::PTRACE_EVENT_FORK);
    rig.detach_all();
    assert!(rig.code_is_back(CHILD));
    assert!(rig.at(&Call::Detach(CHILD, 0)) < rig.at(&Call::Detach(PID, 0)));
    assert!(rig.family.announced.is_empty() && rig.family.early.is_empty());
    let cleaning = format!("cleaning code in child {CHILD}");
    assert!(rig.stats.warnings.iter().any(|w| w.starts_with(&cleaning)));
    assert_eq!(
        left_mapped(&rig.stats.warnings),
        1,
        "{:?}",
        rig.stats.warnings
    );
}

#[test]
fn a_vfork_parent_goes_on_into_its_vfork_and_is_detached_last() {
    let mut rig = Rig::new(&[PID, T1]);
    rig.no_syscall();
    rig.target.process(CHILD, &[CHILD]);
    rig.makes_a_child(T1, libc::PTRACE_EVENT_VFORK);
    rig.detach_all();
    // Nothing it makes from now on is memptrace's; it runs into its vfork
    // and is asked to stop once out of it.
    let options = rig.at(&Call::SetOptions(T1, ptrace::RELEASE_OPTIONS));
    let cont = rig.at(&Call::Cont(T1, 0));
    assert!(options < cont);
    let interrupts: Vec<usize> = (rig.target.calls.iter().enumerate())
        .filter(|(_, c)| **c == Call::Interrupt(T1))
        .map(|(i, _)| i)
        .collect();
    assert!(
        interrupts.iter().any(|&i| i > cont),
        "{:?}",
        rig.target.calls
    );
    // Its child runs first: the parent is let go last.
    assert_eq!(rig.target.calls.last(), Some(&Call::Detach(T1, 0)));
    assert!(rig.at(&Call::Detach(CHILD, 0)) < rig.at(&Call::Detach(T1, 0)));
    assert!(rig.at(&Call::Detach(PID, 0)) < rig.at(&Call::Detach(T1, 0)));
    assert!(
        rig.stats.detach_left.is_empty(),
        "{:?}",
        rig.stats.detach_left
    );
    assert!(rig.code_is_back(PID));
}

#[test]
fn threads_an_attach_held_go_with_their_signals_and_the_others_once_they_stop() {
    let mut rig = Rig::new(&[PID, T1, T2]);
    for tid in [PID, T1] {
        rig.target.threads.get_mut(&tid).unwrap().stopped = true;
    }
    rig.control.held = HashMap::from([(PID, 0), (T1, libc::SIGUSR2)]);
    let detached = rig.life().let_go_held(PATIENCE).unwrap();
    assert_eq!(detached.heaps, vec![PID]);
    // T2 had not stopped: it may stand in the pages, which stay.
    assert_eq!(
        left_mapped(&rig.stats.warnings),
        1,
        "{:?}",
        rig.stats.warnings
    );
    assert_eq!(
        rig.detached(),
        sorted(vec![Call::Detach(PID, 0), Call::Detach(T1, libc::SIGUSR2)])
    );
    assert!(rig.code_is_back(PID));
    rig.life().finish_detach(detached, DETACH_PATIENCE);
    assert_eq!(rig.target.calls.last(), Some(&Call::Detach(T2, 0)));
    assert!(rig.control.held.is_empty());
    assert!(rig.family.threads.is_empty());
    assert!(rig.stats.pauses.is_empty());
}

#[test]
fn pages_left_in_a_dying_or_gone_process_are_not_warned_of() {
    let mut target = FakeTarget::new();
    let mut stats = TraceStats::default();
    // Gone: no threads to list.
    stats.left_mapped(&mut target, PID, None);
    // Dying: every thread on its way out.
    target.process(PID, &[PID, T1]);
    target.ending = HashSet::from([PID, T1]);
    stats.left_mapped(&mut target, PID, Some("no munmap".into()));
    assert!(stats.warnings.is_empty(), "{:?}", stats.warnings);
    // One thread runs on: the pages stay in a live process.
    target.ending.remove(&T1);
    stats.left_mapped(&mut target, PID, Some("no munmap".into()));
    assert_eq!(
        stats.warnings,
        vec![format!(
            "process {PID}: trampoline pages left mapped: no munmap"
        )]
    );
}

#[test]
fn a_thread_inside_probe_code_is_run_and_stopped_again_until_the_deadline() {
    let mut rig = Rig::new(&[PID, T1]);
    // T1 stands in the trampoline area where no place in the original
    // code matches; the leader elsewhere.
    let area = rig.family.space(PID).unwrap().area_ranges()[0].clone();
    rig.target.stopped_at(PID, 0x1000, 0x7000);
    rig.target.stopped_at(T1, area.end - 1, 0x7000);
    let mut deliver = HashMap::from([(T1, libc::SIGUSR1)]);
    let mut keep_pages = HashSet::new();
    let running = rig
        .life()
        .leave_jump_probes(&mut deliver, &mut keep_pages, RUN_OUT_PATIENCE)
        .unwrap();
    // It never came out (the fake runs nothing): at the deadline it is
    // still inside, or was let run once more and not waited for (then it
    // is left to be detached later); either way its process keeps its
    // pages.
    assert_eq!(keep_pages, HashSet::from([PID]));
    match running.as_slice() {
        [] => assert!(rig.family.threads.contains_key(&T1)),
        [T1] => assert!(!rig.family.threads.contains_key(&T1)),
        other => panic!("running: {other:?}"),
    }
    assert_eq!(rig.stats.in_probes_at_detach, Some(1));
    // Its signal went with its first run, and each run was interrupted.
    let conts: Vec<&Call> = (rig.target.calls.iter())
        .filter(|c| matches!(c, Call::Cont(..)))
        .collect();
    assert!(conts.len() > 1, "{:?}", rig.target.calls);
    assert_eq!(conts[0], &Call::Cont(T1, libc::SIGUSR1));
    assert!(conts[1..].iter().all(|c| **c == Call::Cont(T1, 0)));
    let interrupts = (rig.target.calls.iter())
        .filter(|c| **c == Call::Interrupt(T1))
        .count();
    assert_eq!(interrupts, conts.len());
    assert!(deliver.is_empty());
    // The entries have their bytes back: no call enters a probe now.
    assert!(rig.code_is_back(PID));
}

#[test]
fn a_thread_that_never_stops_is_given_up_and_the_others_go_with_their_code_back() {
    let mut rig = Rig::new(&[PID, T1, T2]);
    rig.no_syscall();
    // T2 takes every interrupt and never stops (uninterruptible sleep);
    // the waits are woken by memptrace's tick meanwhile.
    rig.target.stuck.insert(T2);
    rig.target.ticking = true;
    rig.target.report(T1, Stop::Signal(libc::SIGUSR1));
    let patience = Duration::from_millis(40);
    let start = Instant::now();
    let detached = rig.life().detach_all(patience).expect("detached");
    // The others go, with their signals and their code back; T2 may stand
    // in the trampoline pages, which stay (no munmap was even tried).
    assert_eq!(
        rig.detached(),
        sorted(vec![Call::Detach(PID, 0), Call::Detach(T1, libc::SIGUSR1)])
    );
    assert!(rig.code_is_back(PID));
    assert_eq!(
        rig.stats.warnings,
        [format!("process {PID}: trampoline pages left mapped")]
    );
    let asked = |rig: &Rig| {
        (rig.target.calls.iter())
            .filter(|c| **c == Call::Interrupt(T2))
            .count()
    };
    // Asked again while the others were waited for.
    let before = asked(&rig);
    assert!(before > 1, "{:?}", rig.target.calls);
    rig.life().finish_detach(detached, patience);
    // Asked again and again, then given up, and said.
    assert!(asked(&rig) > before);
    assert!(start.elapsed() >= 2 * patience);
    assert_eq!(
        rig.stats.detach_left,
        [format!(
            "thread {T2} of process {PID} did not stop to be detached"
        )]
    );
    assert!(!(rig.target.calls.iter()).any(|c| matches!(c, Call::Detach(T2, _))));
    assert!(rig.family.threads.is_empty() && rig.family.processes.is_empty());
    assert_eq!(rig.stats.pauses.len(), 1);
}
