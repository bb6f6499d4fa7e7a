//! Attaching on a fake target: seizing every thread, stopping them all,
//! the thread that runs the injected calls, hooking the images, and
//! letting each go as it was.

use super::*;
use crate::os::ptrace::Stop;
use crate::trace_msg::TraceMsg;
use crate::tracer::PATIENCE;
use crate::tracer::life::tests::Rig;
use crate::tracer::process::Thread;
use crate::tracer::space::fake::{BASE, FakeSpace, PID};
use crate::tracer::space::images::image_mappings;
use crate::tracer::target::fake::{Call, FakeTarget};

fn seized(fake: &FakeTarget) -> Vec<Tid> {
    let calls = fake.calls.iter();
    calls
        .filter_map(|c| match c {
            Call::Seize(t) => Some(*t),
            _ => None,
        })
        .collect()
}

#[test]
fn every_thread_is_seized_and_none_is_stopped() {
    let mut fake = FakeTarget::new();
    fake.process(10, &[12, 10, 11]);
    assert_eq!(seize_all(&mut fake, 10, None).unwrap(), [10, 11, 12]);
    assert_eq!(seized(&fake), [10, 11, 12]);
    assert!(fake.threads.values().all(|t| !t.stopped));
    assert!(fake.pending.is_empty());
}

#[test]
fn a_dying_thread_is_passed_over_but_a_dying_leader_is_an_error() {
    let mut fake = FakeTarget::new();
    fake.process(10, &[10, 11, 12]);
    fake.ending.insert(12);
    assert_eq!(seize_all(&mut fake, 10, None).unwrap(), [10, 11]);

    // The main thread gone, two threads on (one of them dying): an exited
    // main thread, not a refusal of permission. A zombie: nothing runs.
    for (tids, ending, running) in [(&[10, 11, 12, 13][..], &[10, 13][..], 2), (&[10], &[10], 0)] {
        let mut fake = FakeTarget::new();
        fake.process(10, tids);
        fake.ending.extend(ending);
        match seize_all(&mut fake, 10, None) {
            Err(TraceError::Exited { pid, running: n }) => assert_eq!((pid, n), (10, running)),
            other => panic!("{tids:?}: {:?}", other.map_err(|e| e.to_string())),
        }
        assert!(seized(&fake).is_empty());
    }
}

#[test]
fn a_thread_held_by_another_tracer_gives_the_attach_up_and_lets_the_others_go() {
    let mut fake = FakeTarget::new();
    fake.process(10, &[10, 11, 12]);
    fake.foreign.insert(11, 4242);
    fake.foreign.insert(10, 4242);
    let err = seize_all(&mut fake, 10, None).unwrap_err();
    // The leader is held already: nothing was seized, the tracer named.
    assert!(
        matches!(
            err,
            TraceError::Denied {
                pid: 10,
                tracer: Some(4242),
                ..
            }
        ),
        "{err}"
    );
    assert!(fake.threads.is_empty());

    let mut fake = FakeTarget::new();
    fake.process(10, &[10, 11, 12]);
    fake.foreign.insert(11, 4242);
    let err = seize_all(&mut fake, 10, None).unwrap_err();
    // Only a thread is held: its tracer is the one named.
    assert!(matches!(
        err,
        TraceError::Denied {
            pid: 10,
            tracer: Some(4242),
            ..
        }
    ));
    // 10 was seized before 11 refused: stopped, then detached, running.
    assert_eq!(
        fake.calls,
        [Call::Seize(10), Call::Interrupt(10), Call::Detach(10, 0)]
    );
    assert!(fake.threads.is_empty());
}

#[test]
fn a_thread_memptrace_holds_already_is_not_seized_again() {
    // Made by a thread seized a moment ago, it was attached with its
    // birth (PTRACE_O_TRACECLONE).
    let mut fake = FakeTarget::new();
    fake.process(10, &[10, 11]);
    fake.foreign.insert(11, std::process::id() as Tid);
    assert_eq!(seize_all(&mut fake, 10, None).unwrap(), [10]);
}

/// A thread listed, then gone, its id given to a thread of another
/// process before the seize: that thread is let go at once, unstopped, and
/// the attach goes on without it. (Two attaches side by side, each to a
/// process whose threads come and go, met this way: one seized a thread of
/// the other's process, which then found it held by another tracer.)
#[test]
fn a_thread_id_reused_by_another_process_is_let_go() {
    let mut fake = FakeTarget::new();
    fake.process(10, &[10, 11, 12]);
    fake.process(20, &[20]);
    fake.reused.insert(11, 20);
    assert_eq!(seize_all(&mut fake, 10, None).unwrap(), [10, 12]);
    let of_11: Vec<&Call> = fake
        .calls
        .iter()
        .filter(|c| {
            matches!(
                c,
                Call::Seize(11) | Call::Interrupt(11) | Call::Detach(11, _)
            )
        })
        .collect();
    assert_eq!(
        of_11,
        [&Call::Seize(11), &Call::Interrupt(11), &Call::Detach(11, 0)]
    );
    assert!(!fake.threads.get(&11).is_some_and(|t| t.stopped));

    // Gone and not reused yet: not seized at all.
    let mut fake = FakeTarget::new();
    fake.process(10, &[10, 11]);
    fake.ending.insert(11);
    assert_eq!(seize_all(&mut fake, 10, None).unwrap(), [10]);
    assert_eq!(seized(&fake), [10]);
}

#[test]
fn no_such_process() {
    let mut fake = FakeTarget::new();
    let err = seize_all(&mut fake, 10, None).unwrap_err();
    assert!(matches!(err, TraceError::NoSuchProcess(10)));
}

/// Thread `tid` of the rig stands stopped, its stop `stop` about to be
/// reported (a signal, a group-stop: the interrupt comes after it).
fn stops_with(rig: &mut Rig, tid: Tid, stop: Stop) {
    rig.target.threads.get_mut(&tid).expect("seized").stopped = true;
    rig.target.report(tid, stop);
}

/// Stop threads `seized` of the rig, as an attach does.
fn stop_all(
    rig: &mut Rig,
    seized: &[Tid],
    patience: Duration,
) -> Result<HashMap<Tid, Resume>, TraceError> {
    rig.life().stop_all(PID, seized, patience)
}

fn interrupted(rig: &Rig) -> Vec<Tid> {
    let calls = rig.target.calls.iter();
    let mut tids: Vec<Tid> = calls
        .filter_map(|c| match c {
            Call::Interrupt(t) => Some(*t),
            _ => None,
        })
        .collect();
    tids.sort_unstable();
    tids
}

#[test]
fn every_thread_is_interrupted_and_held_until_resumed() {
    let mut rig = Rig::new(&[PID, PID + 1, PID + 2]);
    let resume = stop_all(&mut rig, &[PID, PID + 1, PID + 2], PATIENCE).unwrap();
    assert_eq!(interrupted(&rig), [PID, PID + 1, PID + 2]);
    assert_eq!(rig.target.calls.len(), 3, "interrupts only");
    let all = |r: Resume| HashMap::from([(PID, r), (PID + 1, r), (PID + 2, r)]);
    assert_eq!(resume, all(Resume::Cont(0)));
    assert_eq!(
        rig.control.held,
        HashMap::from([(PID, 0), (PID + 1, 0), (PID + 2, 0)])
    );
    assert!(rig.target.threads.values().all(|t| t.stopped));
}

#[test]
fn stops_taken_in_any_order_keep_each_threads_signal() {
    let mut rig = Rig::new(&[PID, PID + 1, PID + 2]);
    // The kernel reports the threads last first, each with its own stop.
    stops_with(&mut rig, PID + 2, Stop::Signal(libc::SIGUSR1));
    stops_with(&mut rig, PID + 1, Stop::Signal(libc::SIGTRAP));
    let resume = stop_all(&mut rig, &[PID, PID + 1, PID + 2], PATIENCE).unwrap();
    assert_eq!(interrupted(&rig), [PID, PID + 1, PID + 2]);
    assert_eq!(
        resume,
        HashMap::from([
            (PID, Resume::Cont(0)),
            (PID + 1, Resume::Cont(libc::SIGTRAP)),
            (PID + 2, Resume::Cont(libc::SIGUSR1)),
        ])
    );
    // A failed attach lets each go with the signal it was stopped with.
    assert_eq!(
        rig.control.held,
        HashMap::from([(PID, 0), (PID + 1, libc::SIGTRAP), (PID + 2, libc::SIGUSR1)])
    );
}

#[test]
fn a_group_stopped_thread_is_held_to_be_listened_to() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    stops_with(&mut rig, PID + 1, Stop::EventStop(libc::SIGTSTP));
    let resume = stop_all(&mut rig, &[PID, PID + 1], PATIENCE).unwrap();
    assert_eq!(resume[&(PID + 1)], Resume::Listen);
    assert_eq!(rig.control.held[&(PID + 1)], 0);
    let worker = rig.life().worker(PID, &resume).unwrap();
    assert_eq!(worker, PID);
    rig.target.calls.clear();
    rig.life()
        .resume_all(PID, resume, worker, Vec::new())
        .unwrap();
    // Left in its group-stop; the leader runs on.
    let mut calls = rig.target.calls.clone();
    calls.sort_by_key(|c| format!("{c:?}"));
    assert_eq!(calls, [Call::Cont(PID, 0), Call::Listen(PID + 1)]);
    assert!(rig.control.held.is_empty());
}

#[test]
fn a_thread_that_exits_while_being_stopped_is_forgotten() {
    let mut rig = Rig::new(&[PID, PID + 1, PID + 2]);
    stops_with(&mut rig, PID + 1, Stop::Exited(0));
    let resume = stop_all(&mut rig, &[PID, PID + 1, PID + 2], PATIENCE).unwrap();
    assert_eq!(
        resume.keys().copied().collect::<HashSet<_>>(),
        HashSet::from([PID, PID + 2])
    );
    assert!(!rig.family.threads.contains_key(&(PID + 1)));
    assert!(!rig.control.held.contains_key(&(PID + 1)));
    assert_eq!(rig.control.ending, None);
}

#[test]
fn the_leader_exiting_while_stopped_ends_the_attach() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    stops_with(&mut rig, PID + 1, Stop::Signal(libc::SIGUSR1));
    stops_with(&mut rig, PID, Stop::Exited(3));
    let err = stop_all(&mut rig, &[PID, PID + 1], PATIENCE).unwrap_err();
    assert!(matches!(err, TraceError::NoSuchProcess(PID)), "{err}");
    // The thread stopped before is held, with its signal, to be let go.
    assert_eq!(rig.control.held, HashMap::from([(PID + 1, libc::SIGUSR1)]));
    assert_eq!(rig.control.ending, Some(crate::tracer::Ending::Exited(3)));
}

#[test]
fn a_thread_born_while_stopping_is_adopted_and_stopped_too() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    rig.target.process(PID, &[PID, PID + 1, PID + 5]);
    // PID + 1 clones PID + 5, whose first stop comes after the birth.
    stops_with(&mut rig, PID + 1, Stop::Event(libc::PTRACE_EVENT_CLONE));
    let born = (libc::PTRACE_EVENT_CLONE, (PID + 5) as u64);
    rig.target.events.insert(PID + 1, born);
    rig.target.stopped_at(PID + 5, 0x2000, 0x7000);
    rig.target.report(PID + 5, Stop::EventStop(libc::SIGTRAP));
    let resume = stop_all(&mut rig, &[PID, PID + 1], PATIENCE).unwrap();
    assert_eq!(interrupted(&rig), [PID, PID + 1], "born stopped");
    assert_eq!(resume.len(), 3);
    assert_eq!(resume[&(PID + 5)], Resume::Cont(0));
    assert_eq!(resume[&(PID + 1)], Resume::Cont(0));
    assert_eq!(rig.family.threads[&(PID + 5)].pid, PID);
    assert!(rig.family.announced.is_empty());
    assert_eq!(rig.control.held[&(PID + 5)], 0);
}

#[test]
fn a_thread_whose_first_stop_came_before_its_birth_is_adopted_at_the_birth() {
    let mut rig = Rig::new(&[PID]);
    rig.target.process(PID, &[PID, PID + 5]);
    rig.target.stopped_at(PID + 5, 0x2000, 0x7000);
    rig.target.report(PID + 5, Stop::EventStop(libc::SIGTRAP));
    stops_with(&mut rig, PID, Stop::Event(libc::PTRACE_EVENT_CLONE));
    let born = (libc::PTRACE_EVENT_CLONE, (PID + 5) as u64);
    rig.target.events.insert(PID, born);
    let resume = stop_all(&mut rig, &[PID], PATIENCE).unwrap();
    assert_eq!(
        resume,
        HashMap::from([(PID, Resume::Cont(0)), (PID + 5, Resume::Cont(0))])
    );
    assert!(rig.family.early.is_empty());
    assert!(rig.family.threads.contains_key(&(PID + 5)));
}

#[test]
fn a_thread_that_never_stops_gives_the_attach_up_holding_the_others() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    // Stopped in the kernel (uninterruptible sleep): it reports nothing.
    rig.target.threads.get_mut(&(PID + 1)).unwrap().stopped = true;
    rig.target.ticking = true;
    let err = stop_all(&mut rig, &[PID, PID + 1], Duration::ZERO).unwrap_err();
    let TraceError::AttachAbandoned { pid, reason } = err else {
        panic!("{err}");
    };
    assert_eq!(pid, PID);
    assert_eq!(
        reason,
        format!("threads [{}] did not stop within 0 s", PID + 1)
    );
    assert_eq!(rig.control.held, HashMap::from([(PID, 0)]));
}

#[test]
fn the_leader_runs_the_injected_calls_when_it_can() {
    let mut rig = Rig::new(&[PID, PID + 1]);
    for tid in [PID, PID + 1] {
        rig.target.threads.get_mut(&tid).unwrap().stopped = true;
    }
    let both = |a, b| HashMap::from([(PID, a), (PID + 1, b)]);
    let mut life = rig.life();
    let runs = both(Resume::Cont(0), Resume::Cont(libc::SIGUSR1));
    assert_eq!(life.worker(PID, &runs).unwrap(), PID);
    // In group-stop, the leader leaves them to a thread that runs...
    let listens = both(Resume::Listen, Resume::Cont(0));
    assert_eq!(life.worker(PID, &listens).unwrap(), PID + 1);
    // ...and takes them when no thread runs.
    let listens = HashMap::from([(PID, Resume::Listen)]);
    assert_eq!(life.worker(PID, &listens).unwrap(), PID);
    // A vfork parent cannot run a call before its child execs.
    life.target
        .events
        .insert(PID, (libc::PTRACE_EVENT_VFORK, 0));
    assert_eq!(life.worker(PID, &runs).unwrap(), PID + 1);
}

#[test]
fn a_vfork_parent_alone_leaves_the_injected_calls_to_its_child() {
    let mut rig = Rig::new(&[PID]);
    rig.target.threads.get_mut(&PID).unwrap().stopped = true;
    rig.target.events.insert(PID, (libc::PTRACE_EVENT_VFORK, 0));
    let child = PID + 9;
    let mut process = Process::new(Role::Shares { parent: PID }, None);
    process.paused = Some(PID);
    rig.family.processes.insert(child, process);
    rig.family.threads.insert(child, Thread::new(child, 0));
    rig.target.stopped_at(child, 0x2000, 0x7000);
    let resume = HashMap::from([(PID, Resume::Cont(0)), (child, Resume::Cont(0))]);
    assert_eq!(rig.life().worker(PID, &resume).unwrap(), child);
    // Nothing stopped: no worker, and no process to attach to.
    let err = rig.life().worker(PID, &HashMap::new()).unwrap_err();
    assert!(matches!(err, TraceError::NoSuchProcess(PID)), "{err}");
}

#[test]
fn every_thread_goes_on_as_it_stopped_the_worker_with_the_signals_it_got() {
    let mut rig = Rig::new(&[PID, PID + 1, PID + 2]);
    stops_with(&mut rig, PID, Stop::Signal(libc::SIGUSR1));
    stops_with(&mut rig, PID + 1, Stop::EventStop(libc::SIGSTOP));
    let resume = stop_all(&mut rig, &[PID, PID + 1, PID + 2], PATIENCE).unwrap();
    assert_eq!(rig.control.held.len(), 3);
    rig.target.calls.clear();
    let arrived = vec![libc::SIGCHLD, libc::SIGALRM];
    rig.life().resume_all(PID, resume, PID, arrived).unwrap();
    let of = |tid: Tid| -> Vec<Call> {
        let calls = rig.target.calls.iter();
        calls
            .filter(|c| match c {
                Call::Cont(t, _) | Call::Listen(t) | Call::Tgkill(t, _) => *t == tid,
                _ => false,
            })
            .cloned()
            .collect()
    };
    // The worker: its own signal now, the ones that arrived queued first.
    assert_eq!(
        of(PID),
        [
            Call::Tgkill(PID, libc::SIGCHLD),
            Call::Tgkill(PID, libc::SIGALRM),
            Call::Cont(PID, libc::SIGUSR1)
        ]
    );
    assert_eq!(of(PID + 1), [Call::Listen(PID + 1)]);
    assert_eq!(of(PID + 2), [Call::Cont(PID + 2, 0)]);
    assert_eq!(rig.target.calls.len(), 5);
    assert!(rig.control.held.is_empty());
    assert!(!rig.target.threads[&PID].stopped);
}

#[test]
fn a_group_stopped_worker_gets_the_signals_that_arrived_queued() {
    let mut rig = Rig::new(&[PID]);
    stops_with(&mut rig, PID, Stop::EventStop(libc::SIGSTOP));
    let resume = stop_all(&mut rig, &[PID], PATIENCE).unwrap();
    rig.target.calls.clear();
    rig.life()
        .resume_all(PID, resume, PID, vec![libc::SIGCHLD])
        .unwrap();
    assert_eq!(
        rig.target.calls,
        [Call::Tgkill(PID, libc::SIGCHLD), Call::Listen(PID)]
    );
    assert!(rig.target.threads[&PID].stopped, "still in its group-stop");
}

/// The C library in a new int3 space of the rig's process, not hooked
/// yet: its memory map lists the library, whose image was read ahead.
/// The rig's process has no space until the hook gives it this one.
fn new_space(rig: &mut Rig) -> FakeSpace {
    let mut fake = FakeSpace::libc(true);
    fake.space.modules.clear();
    let maps = fake.maps();
    fake.mem.set_maps(maps.clone());
    let f = &image_mappings(&maps)[0];
    fake.space.ahead = Ahead::of(f, fake.module.image.clone());
    rig.family.processes.get_mut(&PID).expect("the rig's").space = None;
    fake
}

/// The addresses of the bytes of `fake`'s image changed, each checked
/// to be an int3.
fn int3s(fake: &FakeSpace) -> HashSet<u64> {
    let mut at = HashSet::new();
    for (start, orig) in &fake.code {
        let now = fake.mem.bytes(*start, orig.len());
        for (i, (&was, &is)) in orig.iter().zip(&now).enumerate() {
            if was != is {
                assert_eq!(is, 0xcc, "at {:#x}", start + i as u64);
                at.insert(start + i as u64);
            }
        }
    }
    at
}

#[test]
fn the_images_are_hooked_with_what_was_read_ahead_and_counted() {
    let mut rig = Rig::new(&[PID]);
    let mut fake = new_space(&mut rig);
    let space = std::mem::replace(&mut fake.space, FakeSpace::libc(false).space);
    let arrived = rig.life().hook(PID, PID, space).unwrap();
    assert!(arrived.is_empty());
    // As many allocator functions as the library has, hooked the way a
    // refresh hooks them.
    let mut reference = FakeSpace::libc(true);
    reference.hook();
    let allocators = reference.space.hooks.allocators() as u64;
    assert!(allocators > 0);
    assert_eq!(rig.stats.hooked_functions, allocators);
    assert_eq!(rig.stats.images, 1);
    let space = rig.family.space_of(PID).expect("given to the process");
    assert_eq!(space.hooks.allocators() as u64, allocators);
    let module = &space.modules[&BASE];
    assert!(Arc::ptr_eq(&module.image, &fake.module.image));
    assert_eq!(module.bias, fake.module.bias);
    // An int3 on each hooked entry and nowhere else; no thread was asked
    // anything (the trampoline area was there: no injected call).
    let entries: HashSet<u64> = space.hooks.iter().map(|h| h.addr).collect();
    assert_eq!(int3s(&fake), entries);
    assert!(rig.target.calls.is_empty(), "{:?}", rig.target.calls);
    let sent = rig.sent();
    assert!(
        matches!(
            &sent[..],
            [TraceMsg::Trampolines { pid, .. }, TraceMsg::Image { record, .. }]
                if *pid == PID as u32 && record.path == fake.module.path && record.start == BASE
        ),
        "{sent:?}"
    );
}

#[test]
fn a_process_without_an_allocator_cannot_be_traced() {
    let mut rig = Rig::new(&[PID]);
    let fake = FakeSpace::libc(true);
    // No image in its memory map.
    let err = rig.life().hook(PID, PID, fake.space).unwrap_err();
    assert!(matches!(err, TraceError::NoAllocator(PID)), "{err}");
    assert_eq!(rig.stats.hooked_functions, 0);
    assert!(rig.target.calls.is_empty());
    let code = FakeSpace::libc(true).code;
    assert!(
        code.iter()
            .all(|(at, orig)| fake.mem.bytes(*at, orig.len()) == *orig)
    );
}

#[test]
fn a_space_a_seccomp_filter_kept_from_hooking_abandons_the_attach_saying_why() {
    let mut rig = Rig::new(&[PID]);
    let mut fake = FakeSpace::libc(true);
    fake.space.refused = Some("mmap: Operation not permitted".to_string());
    let err = rig.life().hook(PID, PID, fake.space).unwrap_err();
    let TraceError::AttachAbandoned { pid, reason } = err else {
        panic!("{err}");
    };
    assert_eq!(pid, PID);
    assert_eq!(
        reason,
        "its allocator functions cannot be hooked without a system call its seccomp filter \
         may refuse: mmap: Operation not permitted"
    );
    assert_eq!(rig.stats.hooked_functions, 0);
}

#[test]
fn a_pid_whose_process_was_reaped_since_it_was_checked_is_let_go() {
    // The process checked, reaped since: its number now names another
    // process (the fake's), which is seized and then let go.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let origin = Pidfd::open(child.id() as Tid).unwrap();
    assert!(origin.unreaped());
    child.wait().unwrap();
    assert!(!origin.unreaped());
    let mut fake = FakeTarget::new();
    fake.process(10, &[10, 11]);
    let err = seize_all(&mut fake, 10, Some(&origin)).unwrap_err();
    assert!(matches!(err, TraceError::NoSuchProcess(10)), "{err}");
    assert_eq!(seized(&fake), [10, 11]);
    assert!(fake.threads.is_empty(), "every thread seized was let go");
    // Unreaped, even exited: the same process, attached as usual.
    let mut zombie = std::process::Command::new("true").spawn().unwrap();
    let origin = Pidfd::open(zombie.id() as Tid).unwrap();
    while std::fs::read_to_string(format!("/proc/{}/stat", zombie.id()))
        .is_ok_and(|stat| !stat.contains(") Z "))
    {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(origin.unreaped(), "a zombie is not reaped");
    let mut fake = FakeTarget::new();
    fake.process(10, &[10, 11]);
    assert_eq!(seize_all(&mut fake, 10, Some(&origin)).unwrap(), [10, 11]);
    zombie.wait().unwrap();
}
