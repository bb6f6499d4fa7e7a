//! The end of a detach, once every thread is stopped and out of the jump
//! probes: each call still in progress through a stub sent home, each
//! thread moved out of the trampolines (see [`leave`]), every byte put
//! back, the trampoline pages unmapped, every thread let go with the
//! signal it is owed; and the threads that had not stopped, later, as each
//! stops. It owns nothing: it borrows the family it empties, the stops
//! still queued, the stats it reports into, and the target.
//!
//! It never unmaps pages a thread may still stand in or return to
//! (`keep_pages`), and never detaches a thread before its code is back.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::os::ptrace::{self, Stop, Tid};
use crate::tracer::inject::InjectError;
use crate::tracer::life::detach::leave::{self, Pending};
use crate::tracer::process::Family;
use crate::tracer::space::{Space, SpaceError};
use crate::tracer::stop::Stopped;
use crate::tracer::stops::Stops;
use crate::tracer::target::Target;
use crate::tracer::{PATIENCE, TraceError, TraceStats};

/// What a detach's last steps borrow of the tracer.
pub(in crate::tracer) struct Release<'a, T: Target> {
    pub family: &'a mut Family,
    pub stops: &'a mut Stops,
    pub stats: &'a mut TraceStats,
    pub target: &'a mut T,
}

/// What [`Release::restore`] leaves to do.
pub(in crate::tracer) struct Restored {
    /// The threads to let go now.
    pub tids: Vec<Tid>,
    /// Spaces whose trampoline pages a thread detached later unmaps.
    pub deferred: HashMap<Tid, Space>,
}

impl<T: Target> Release<'_, T> {
    /// Every thread is stopped and out of the jump probes: send the calls
    /// in progress home, move threads out of the trampolines, put the code
    /// back and unmap the pages where no thread needs them. `deliver`: the
    /// signal each thread is owed; `keep_pages`: the processes whose pages
    /// stay; `later`: (thread, process) to detach once each stops.
    pub fn restore(
        &mut self,
        deliver: &mut HashMap<Tid, i32>,
        keep_pages: &mut HashSet<Tid>,
        later: &mut Vec<(Tid, Tid)>,
    ) -> Result<Restored, TraceError> {
        // Allocator calls, and mapping calls, entered through a stub.
        let mut pending: Vec<Pending> = Vec::new();
        for (&tid, t) in self.family.threads.iter_mut() {
            for c in t.take_calls() {
                pending.push(Pending {
                    tid,
                    pid: t.pid,
                    entry_sp: c.entry_sp,
                    stub: c.stub,
                });
            }
            if let Some(m) = t.in_map.take() {
                pending.push(Pending {
                    tid,
                    pid: t.pid,
                    entry_sp: m.entry_sp,
                    stub: m.stub,
                });
            }
        }
        // Still inside the allocator: those calls are not recorded.
        let family = &self.family;
        self.stats.lost_returns += leave::send_calls_home(
            &mut *self.target,
            &pending,
            |tid| family.space_of(tid),
            keep_pages,
        )?;
        let tids: Vec<Tid> = self.family.threads.keys().copied().collect();
        for &tid in &tids {
            if let Some(space) = self.family.space_of(tid) {
                leave::move_out(&mut *self.target, tid, space, keep_pages)?;
            }
        }
        let traced: Vec<Tid> = self
            .family
            .traced()
            .filter(|(_, p)| p.space.is_some())
            .map(|(pid, _)| pid)
            .collect();
        // A vfork parent stopped at its vfork cannot run the munmap calls,
        // and its child, stopped too, cannot exec until let go: the parent
        // goes on into its vfork (asked to stop once out of it) and is
        // detached later, by which time its child runs.
        for &tid in &tids {
            if self.target.event_of(tid) == Some(libc::PTRACE_EVENT_VFORK) {
                let sig = deliver.remove(&tid).unwrap_or(0);
                // Nothing it makes from now on is attached to memptrace (a
                // next vfork's child would hold it again), and memptrace's
                // exit does not kill it (see `ptrace::RELEASE_OPTIONS`).
                let _ = self.target.set_options(tid, ptrace::RELEASE_OPTIONS);
                // This stop, if queued, is over once it runs.
                let _ = self.stops.take_of(tid);
                if self.target.cont(tid, sig).is_ok() {
                    let _ = self.target.interrupt(tid);
                    let pid = self.family.pid_of(tid).unwrap_or(tid);
                    later.push((tid, pid));
                }
            }
        }
        let tids: Vec<Tid> = tids
            .into_iter()
            .filter(|t| !later.iter().any(|(l, _)| l == t))
            .collect();
        let mut deferred: HashMap<Tid, Space> = HashMap::new();
        for pid in traced {
            // The threads that can run the munmap calls: any stopped thread
            // of the process, but not one that is exiting or a vfork parent
            // (see `inject::leave_system_call`); if one goes meanwhile, the
            // next one does it (munmap of what is already gone succeeds).
            let mut workers: Vec<Tid> = tids
                .iter()
                .copied()
                .filter(|&t| self.family.pid_of(t) == Some(pid))
                .filter(|&t| {
                    !matches!(
                        self.target.event_of(t),
                        Some(libc::PTRACE_EVENT_EXIT | libc::PTRACE_EVENT_VFORK)
                    )
                })
                .collect();
            workers.sort_by_key(|&t| t != pid);
            let Some(space) = self.family.space_mut(pid) else {
                continue;
            };
            space.restore_all()?;
            if workers.is_empty() && !keep_pages.contains(&pid) {
                // Its only threads stop later (a vfork parent): one of them
                // unmaps the pages then.
                if later.iter().any(|&(_, p)| p == pid) {
                    if let Some(space) = self
                        .family
                        .processes
                        .get_mut(&pid)
                        .and_then(|p| p.space.take())
                    {
                        deferred.insert(pid, space);
                    }
                    continue;
                }
            }
            if keep_pages.contains(&pid) || workers.is_empty() {
                self.stats.left_mapped(self.target, pid, None);
                continue;
            }
            let mut last_error = None;
            for &worker in &workers {
                match space.unmap_areas(worker) {
                    Ok(signals) => {
                        for sig in signals {
                            if let Entry::Vacant(e) = deliver.entry(worker) {
                                e.insert(sig);
                            } else {
                                let _ = self.target.tgkill(pid, worker, sig);
                            }
                        }
                        last_error = None;
                        break;
                    }
                    Err(SpaceError::Inject(err @ (InjectError::Gone | InjectError::InVfork))) => {
                        last_error = Some(SpaceError::Inject(err))
                    }
                    Err(err) => {
                        last_error = Some(err);
                        break;
                    }
                }
            }
            if let Some(err) = last_error {
                self.stats
                    .left_mapped(self.target, pid, Some(err.to_string()));
            }
        }
        Ok(Restored { tids, deferred })
    }

    /// Detach `tids` with the signals they are owed, and the threads whose
    /// first stop came before their birth was reported.
    pub fn let_go(&mut self, tids: &[Tid], deliver: &HashMap<Tid, i32>) -> Result<(), TraceError> {
        for &tid in tids {
            let sig = deliver.get(&tid).copied().unwrap_or(0);
            ptrace::unless_gone(self.target.detach(tid, sig))?;
        }
        // Threads and children whose first stop came before their birth was
        // reported: stopped, and memptrace's until let go.
        let early: Vec<(Tid, Stop)> = self.family.early.drain().collect();
        for (tid, stop) in early {
            let _ = ptrace::unless_gone(self.target.detach(tid, Stopped::of(stop).signal()));
        }
        Ok(())
    }

    /// Forget every thread and process, then detach `later` as each stops,
    /// given up after `patience`.
    pub fn finish(
        &mut self,
        later: Vec<(Tid, Tid)>,
        deferred: HashMap<Tid, Space>,
        patience: Duration,
    ) {
        self.family.threads.clear();
        self.family.processes.clear();
        self.detach_later(later, deferred, patience);
    }

    /// Detach the threads that had not stopped when the rest were let go (a
    /// vfork parent, released when its child, now running, execs; a thread
    /// in uninterruptible sleep), as each stops: asked again and again, up
    /// to `patience` ([`crate::tracer::DETACH_PATIENCE`]), or until memptrace is told to stop
    /// once more. What is left is said: such a thread stays traced until
    /// memptrace exits, when the kernel lets it go.
    /// `deferred`: spaces whose trampoline pages one of these threads
    /// unmaps once it stops (every other thread of the process is gone).
    fn detach_later(
        &mut self,
        later: Vec<(Tid, Tid)>,
        mut deferred: HashMap<Tid, Space>,
        patience: Duration,
    ) {
        let deadline = Instant::now() + patience;
        let asked = crate::os::signals::interrupts()
            + u32::from(crate::os::signals::terminate_signal().is_some());
        for (tid, pid) in later {
            let mut stopped = false;
            while !stopped && Instant::now() < deadline {
                let told = crate::os::signals::interrupts()
                    + u32::from(crate::os::signals::terminate_signal().is_some());
                if told > asked {
                    break;
                }
                let queued = self.stops.take_of(tid);
                if queued.is_none() {
                    let _ = self.target.interrupt(tid);
                }
                let step = (Instant::now() + PATIENCE / 8).min(deadline);
                let next = match queued {
                    Some(stop) => Ok(Some(stop)),
                    None => self.target.wait_tid_until(tid, step),
                };
                match next {
                    Ok(None) => continue,
                    Ok(Some(Stop::Exited(_) | Stop::Killed { .. })) | Err(_) => {
                        stopped = true;
                    }
                    Ok(Some(stop)) => {
                        let mut sig = Stopped::of(stop).signal();
                        let exiting = Stopped::of(stop) == Stopped::Exiting;
                        // It made a thread or a process on its way out of the
                        // kernel: that one was attached with its birth and is
                        // let go too; a vfork child, which runs in the same
                        // memory from a clean stop, unmaps the pages then.
                        let mut worker = tid;
                        let born = match Stopped::of(stop) {
                            Stopped::Birth(event) => self
                                .target
                                .event_msg(tid)
                                .ok()
                                .map(|child| (event, child as Tid)),
                            _ => None,
                        };
                        let born = born.and_then(|(event, child)| {
                            let early = self.family.early.remove(&child);
                            let first = early.or_else(|| self.stops.take_of(child)).or_else(|| {
                                self.target
                                    .wait_tid_until(child, Instant::now() + PATIENCE)
                                    .ok()
                                    .flatten()
                            });
                            let stopped = first.is_some_and(|f| Stopped::of(f) != Stopped::Gone);
                            if stopped && event != libc::PTRACE_EVENT_FORK {
                                worker = child;
                            }
                            stopped.then_some(child)
                        });
                        let in_vfork =
                            Stopped::of(stop) == Stopped::Birth(libc::PTRACE_EVENT_VFORK);
                        if in_vfork && worker == tid {
                            // At a vfork whose child is not memptrace's: it
                            // cannot run the calls; it goes on into the vfork,
                            // making nothing memptrace's, and stops once out.
                            if let Some(child) = born {
                                let _ = self.target.detach(child, 0);
                            }
                            let _ = self.target.set_options(tid, ptrace::RELEASE_OPTIONS);
                            let _ = self.target.cont(tid, sig);
                            continue;
                        }
                        if let (Some(space), false) = (deferred.get_mut(&pid), exiting) {
                            match space.unmap_areas(worker) {
                                Ok(signals) => {
                                    for extra in signals {
                                        if sig == 0 {
                                            sig = extra;
                                        } else {
                                            let _ = self.target.tgkill(pid, tid, extra);
                                        }
                                    }
                                    deferred.remove(&pid);
                                }
                                Err(err) => {
                                    self.stats
                                        .left_mapped(self.target, pid, Some(err.to_string()));
                                    deferred.remove(&pid);
                                }
                            }
                        }
                        if let Some(child) = born {
                            let _ = self.target.detach(child, 0);
                        }
                        if ptrace::unless_gone(self.target.detach(tid, sig)).is_ok() {
                            stopped = true;
                        }
                    }
                }
            }
            if !stopped {
                self.stats.detach_left.push(format!(
                    "thread {tid} of process {pid} did not stop to be detached"
                ));
            }
        }
        for pid in deferred.into_keys() {
            self.stats.left_mapped(self.target, pid, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Op;
    use crate::trace_msg::CallStack;
    use crate::tracer::probes::Probe;
    use crate::tracer::process::{PendingCall, Thread};
    use crate::tracer::space::fake::FakeSpace;
    use crate::tracer::target::fake::{Call, FakeMemory, FakeTarget};

    /// A process and threads that cannot exist (above any pid_max): what
    /// the tests ask of the real system about them (its threads, the
    /// ptrace event a thread is at) finds nothing.
    const PROC: Tid = Tid::MAX - 1;
    const T1: Tid = Tid::MAX - 2;
    const T2: Tid = Tid::MAX - 3;
    const T3: Tid = Tid::MAX - 4;

    /// The C library hooked with int3 probes as process [`PROC`] of a
    /// family with threads [`PROC`] and [`T1`]; its memory, the file's
    /// code, and the stub of one probe.
    fn hooked() -> (Family, FakeMemory, Vec<(u64, Vec<u8>)>, u64) {
        let mut fake = FakeSpace::libc(true);
        fake.hook();
        assert!(!fake.changed_code().is_empty());
        let stub = fake
            .space
            .hooks
            .iter()
            .find_map(|h| match h.probe {
                Probe::Int3 { stub, .. } => Some(stub),
                Probe::Jump { .. } => None,
            })
            .expect("int3 probes");
        let family = Family::of_one(PROC, fake.space, &[PROC, T1]);
        (family, fake.mem, fake.code, stub)
    }

    fn release<'a>(
        family: &'a mut Family,
        stops: &'a mut Stops,
        stats: &'a mut TraceStats,
        target: &'a mut FakeTarget,
    ) -> Release<'a, FakeTarget> {
        Release {
            family,
            stops,
            stats,
            target,
        }
    }

    #[test]
    fn every_byte_goes_back_and_each_thread_goes_with_its_signal() {
        let (mut family, mem, code, _) = hooked();
        // A thread whose first stop came before its birth was reported.
        family.early.insert(T3, Stop::Signal(libc::SIGUSR2));
        let mut target = FakeTarget::new();
        for tid in [PROC, T1, T3] {
            target.stopped_at(tid, 0x1000, 0x7000);
        }
        let (mut stops, mut stats) = (Stops::default(), TraceStats::default());
        let mut deliver = HashMap::from([(T1, libc::SIGUSR1)]);
        // A thread did not stop: the pages stay.
        let mut keep_pages = HashSet::from([PROC]);
        let mut later = Vec::new();
        let mut release = release(&mut family, &mut stops, &mut stats, &mut target);
        let restored = release
            .restore(&mut deliver, &mut keep_pages, &mut later)
            .unwrap();
        let mut tids = restored.tids.clone();
        tids.sort_unstable();
        assert_eq!(tids, vec![T1, PROC]);
        assert!(restored.deferred.is_empty() && later.is_empty());
        release.let_go(&restored.tids, &deliver).unwrap();
        release.finish(later, restored.deferred, crate::tracer::DETACH_PATIENCE);
        for (at, orig) in &code {
            assert_eq!(&mem.bytes(*at, orig.len()), orig, "code at {at:#x}");
        }
        let mut calls = target.calls.clone();
        calls.sort_by_key(|c| format!("{c:?}"));
        let want = [
            Call::Detach(T3, libc::SIGUSR2),
            Call::Detach(T1, libc::SIGUSR1),
            Call::Detach(PROC, 0),
        ];
        let mut want = want.to_vec();
        want.sort_by_key(|c| format!("{c:?}"));
        assert_eq!(calls, want);
        assert!(family.threads.is_empty() && family.processes.is_empty());
        assert!(family.early.is_empty());
        // Its pages stay, but the process is gone: nothing to warn of.
        assert!(stats.warnings.is_empty(), "{:?}", stats.warnings);
    }

    #[test]
    fn calls_in_progress_are_lost_whether_their_thread_stopped_or_went() {
        let (mut family, _, _, stub) = hooked();
        family.threads.insert(T2, Thread::new(PROC, 0));
        for tid in [T1, T2] {
            let thread = family.threads.get_mut(&tid).unwrap();
            thread.in_call = Some(PendingCall {
                op: Op::Malloc,
                args: [24, 0, 0],
                entry_sp: 0x7000,
                stub,
                stack: CallStack::CallerOnly(0x401000),
                module_id: 7,
            });
        }
        let mut target = FakeTarget::new();
        // T1 stands in the stub (left to move out of it); T2 is gone.
        target.stopped_at(PROC, 0x1000, 0x7000);
        target.stopped_at(T1, stub, 0x6ff8);
        let (mut stops, mut stats) = (Stops::default(), TraceStats::default());
        let (mut deliver, mut keep_pages) = (HashMap::new(), HashSet::from([PROC]));
        let mut later = Vec::new();
        let mut release = release(&mut family, &mut stops, &mut stats, &mut target);
        let restored = release
            .restore(&mut deliver, &mut keep_pages, &mut later)
            .unwrap();
        release.let_go(&restored.tids, &deliver).unwrap();
        assert_eq!(stats.lost_returns, 2);
        assert!(family.threads.values().all(|t| t.in_call.is_none()));
        // Nothing written into the stack: no call was sent home through it.
        assert!(
            !target
                .calls
                .iter()
                .any(|c| matches!(c, Call::WriteData(..)))
        );
        assert!(target.calls.contains(&Call::Detach(T1, 0)));
        assert!(target.calls.contains(&Call::Detach(PROC, 0)));
        assert!(!target.threads.contains_key(&T1));
    }
}
