//! The lifecycle on a fake target: processes and threads as the tracer
//! holds them, the stops the fake reports, and what each step asked of the
//! target and booked.

use crate::os::ptrace::Stop;
use crate::queue::Receiver;
use crate::tracer::probes::int3;
use crate::tracer::probes::{HookKind, Probe};
use crate::tracer::process::Thread;
use crate::tracer::space::fake::{FakeSpace, PID};
use crate::tracer::target::Target;
use crate::tracer::target::fake::FakeTarget;
use crate::tracer::*;

/// Everything a lifecycle step is run with.
pub(super) struct Rig {
    pub opts: TraceOptions,
    pub family: Family,
    pub stops: Stops,
    pub book: Booking,
    pub rx: Receiver<Vec<TraceMsg>>,
    pub stats: TraceStats,
    pub control: Control,
    pub target: FakeTarget,
}

impl Rig {
    /// Process [`PID`], the trace's root, with the C library hooked by
    /// int3s in a fake space, and threads `tids` (the leader among them),
    /// all seized and running.
    pub fn new(tids: &[Tid]) -> Rig {
        Rig::of(FakeSpace::libc(true), tids)
    }

    /// The same, the C library hooked in `fake` (as its probe mode says).
    pub fn of(mut fake: FakeSpace, tids: &[Tid]) -> Rig {
        fake.hook();
        let mut target = FakeTarget::new();
        target.spaces.insert(PID, fake.mem.clone());
        target.process(PID, tids);
        let mut family = Family::of_one(PID, fake.space, &[]);
        for &tid in tids {
            family.threads.insert(tid, Thread::new(PID, 0));
            target.seize(tid, 0).expect("listed");
        }
        target.calls.clear();
        let (book, rx) = Booking::for_tests(None);
        Rig {
            opts: TraceOptions::for_tests(true),
            family,
            stops: Stops::default(),
            book,
            rx,
            stats: TraceStats::default(),
            control: Control::new(PID, None),
            target,
        }
    }

    pub fn life(&mut self) -> Life<'_, FakeTarget> {
        Life {
            opts: &self.opts,
            family: &mut self.family,
            stops: &mut self.stops,
            book: &mut self.book,
            stats: &mut self.stats,
            control: &mut self.control,
            target: &mut self.target,
        }
    }

    /// An allocator's entry, hooked by an int3, and the return int3 of its
    /// slot's call stub.
    pub fn allocator_probe(&self) -> (u64, u64) {
        let space = self.family.space_of(PID).expect("the rig's process");
        let (entry, stub) = space
            .hooks
            .iter()
            .find_map(|h| match (&h.kind, &h.probe) {
                (HookKind::Allocator { .. }, Probe::Int3 { stub, .. }) => Some((h.addr, *stub)),
                _ => None,
            })
            .expect("an allocator hooked");
        (entry, stub + int3::stub().return_int3)
    }

    /// Every message sent down the pipeline so far.
    pub fn sent(&mut self) -> Vec<TraceMsg> {
        self.book.out.send_ready(true).expect("the test's queue");
        let mut sent = Vec::new();
        while let Ok((msgs, _permit)) = self.rx.recv_timeout(std::time::Duration::ZERO) {
            sent.extend(msgs);
        }
        sent
    }
}

#[test]
fn a_thread_that_ends_leaves_its_process_traced() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    rig.life().thread_gone(PID + 1, Stop::Exited(0)).unwrap();
    assert!(!rig.family.threads.contains_key(&(PID + 1)));
    assert!(rig.family.processes.contains_key(&PID));
    assert_eq!(rig.control.ending, None);
    assert!(
        !rig.sent()
            .iter()
            .any(|m| matches!(m, TraceMsg::ProcessGone { .. }))
    );
}

#[test]
fn the_root_leaders_end_is_the_traces_and_its_process_goes() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    // The leader's exit comes last; a thread still listed goes with it.
    let killed = Stop::Killed {
        sig: libc::SIGSEGV,
        core: true,
    };
    rig.life().thread_gone(PID, killed).unwrap();
    assert!(rig.family.threads.is_empty());
    assert!(rig.family.processes.is_empty());
    assert_eq!(
        rig.control.ending,
        Some(Ending::Killed {
            sig: libc::SIGSEGV,
            core: true
        })
    );
    // Nothing was asked of the target: the process is gone.
    assert!(rig.target.calls.is_empty());
}

#[test]
fn a_thread_gone_twice_or_never_known_changes_nothing() {
    let mut rig = Rig::new(&[PID]);
    rig.life().thread_gone(PID + 7, Stop::Exited(0)).unwrap();
    assert_eq!(rig.family.threads.len(), 1);
    assert_eq!(rig.control.ending, None);
}
