//! Letting go: stop every thread, put back every byte and return address,
//! detach without injecting a signal. The program runs on as if never traced.
//!
//! Subtleties (`ptrace(2)`): PTRACE_INTERRUPT reports its stop *before* a
//! SIGTRAP that an int3 already queued; detaching then would let that SIGTRAP
//! kill the program. Such a thread is resumed once more so the queued trap is
//! reported and consumed. A thread inside an allocator call it entered
//! through a slot's stub is sent to return straight to its caller (through a
//! `pop` + `ret` pair of the program's own code); that call is not recorded.
//! A thread standing in a trampoline moves to the same place in the original
//! code, and the trampoline pages are unmapped, unless some thread stands
//! where no such place exists.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::inject::InjectError;
use super::pauses::PauseClock;
use super::process::{Family, Role};
use super::space::SpaceError;
use super::stop::Stopped;
use super::stopping::Stopping;
use super::target::Target;
use super::{TraceError, TraceStats, Tracer};
use crate::os::procfs;
use crate::os::ptrace::{self, Stop, Tid};
use leave::Pending;

mod leave;

/// Detach a running thread that memptrace no longer wants: interrupt it, wait
/// for that stop, detach. Other threads' stops stay queued.
pub(super) fn detach_running(tid: Tid) {
    if ptrace::interrupt(tid).is_err() {
        return;
    }
    // Bounded: a thread that never stops (uninterruptible sleep) is left
    // to the kernel, which lets it go when memptrace exits.
    let deadline = Instant::now() + super::PATIENCE;
    match ptrace::wait_tid_until(tid, deadline) {
        Ok(Some(stop @ (Stop::Exited(_) | Stop::Killed { .. }))) => {
            ptrace::keep_for_later(tid, stop);
        }
        Ok(None) | Err(_) => {}
        Ok(Some(Stop::Signal(sig))) => {
            let _ = ptrace::detach(tid, sig);
        }
        Ok(Some(_)) => {
            let _ = ptrace::detach(tid, 0);
        }
    }
}

impl Tracer {
    /// Detach the threads an attach stopped, putting back whatever was
    /// planted; the threads that did not stop are left alone.
    pub(super) fn let_go_held(&mut self) -> Result<(), TraceError> {
        let held = std::mem::take(&mut self.control.held);
        let deliver = held
            .iter()
            .filter(|(_, sig)| **sig != 0)
            .map(|(&t, &s)| (t, s));
        let deliver: HashMap<Tid, i32> = deliver.collect();
        let stuck: HashSet<Tid> = self
            .family
            .threads
            .keys()
            .filter(|t| !held.contains_key(t))
            .copied()
            .collect();
        self.restore_and_release(deliver, &stuck, &HashSet::new(), None)
    }

    pub(super) fn detach_all(&mut self) -> Result<(), TraceError> {
        // The calls held back for the attach's inventory are booked first.
        self.finish_inventory(true);
        let mut pause = PauseClock::start("detach");
        super::dying::detaching();
        let mut waiting: HashSet<Tid> = HashSet::new();
        let mut deliver: HashMap<Tid, i32> = HashMap::new();
        // Threads already stopped (an attach that failed) report nothing
        // more: waiting for them would never end.
        let held = std::mem::take(&mut self.control.held);
        for &tid in self.family.threads.keys() {
            match held.get(&tid) {
                Some(&sig) => {
                    if sig != 0 {
                        deliver.insert(tid, sig);
                    }
                }
                None => {
                    if self.target.interrupt(tid).is_ok() {
                        waiting.insert(tid);
                    }
                }
            }
        }
        let mut progress = Instant::now();
        let mut stuck: HashSet<Tid> = HashSet::new();
        let mut kicked = Instant::now();
        loop {
            // A vfork parent waits in the kernel until its child execs or
            // exits, and cannot stop before: it is detached last, once the
            // child runs again (see `restore_and_release`).
            let parents = self.family.vfork_parents();
            let blocked = |t: &Tid| parents.contains(t);
            if waiting.iter().all(blocked) && self.family.announced.is_empty() {
                break;
            }
            let (tid, stop) = match self.next_stop_while_stopping()? {
                Stopping::Known(tid, stop) => (tid, stop),
                Stopping::Adopted(_) => continue,
                Stopping::Nothing if progress.elapsed() < super::PATIENCE => {
                    if kicked.elapsed() >= super::PATIENCE / 8 {
                        // A thread between two states (leaving a system
                        // call, a group-stop) is asked again.
                        for &tid in &waiting {
                            let _ = ptrace::interrupt(tid);
                        }
                        kicked = Instant::now();
                    }
                    continue;
                }
                Stopping::Nothing => {
                    // Not one stop for a while (uninterruptible sleep, a
                    // frozen cgroup): what has not stopped by now is detached
                    // last, once it stops (see `restore_and_release`); the
                    // trampoline pages stay, since it may be in them.
                    stuck = std::mem::take(&mut waiting);
                    self.family.announced.clear();
                    break;
                }
                Stopping::NoneLeft => break,
            };
            progress = Instant::now();
            if self.settle_stopping(tid, stop, &mut deliver)? {
                waiting.remove(&tid);
            }
        }
        let late: HashSet<Tid> = waiting.difference(&stuck).copied().collect();
        pause.lap("stop");
        self.restore_and_release(deliver, &stuck, &late, Some(pause))
    }

    /// Put back what was changed, then detach every thread: return addresses,
    /// threads standing in a trampoline slot (moved to the same place in the
    /// original code), the int3 bytes, and last the trampoline pages.
    /// `pause`: the detach's stop, timed from its start, to be ended here.
    fn restore_and_release(
        &mut self,
        mut deliver: HashMap<Tid, i32>,
        stuck: &HashSet<Tid>,
        late: &HashSet<Tid>,
        mut pause: Option<PauseClock>,
    ) -> Result<(), TraceError> {
        let mut lap = |name| {
            if let Some(p) = pause.as_mut() {
                p.lap(name)
            }
        };
        // Every thread is stopped: copies not made yet are read now.
        self.settle_all(true);
        lap("settle");
        // Spaces whose pages must stay: a thread is somewhere in them that
        // cannot be mapped back to the original code, or will return there,
        // or did not stop.
        let mut keep_pages: HashSet<Tid> = stuck
            .iter()
            .filter_map(|&tid| self.family.owner_of(tid))
            .collect();
        // Threads not stopped yet are detached last (they run nothing of
        // memptrace's meanwhile: they are in the kernel).
        let mut later: Vec<(Tid, Tid)> = Vec::new();
        for tid in stuck.iter().chain(late) {
            if let Some(thread) = self.family.threads.remove(tid) {
                later.push((*tid, thread.pid));
            }
        }
        // Jump probes: every thread out of their code, every call in
        // progress sent back to its caller, every record read.
        for (tid, pid) in self
            .leave_jump_probes(&mut deliver, &mut keep_pages)?
            .into_iter()
            .filter_map(|tid| Some((tid, self.family.pid_of(tid)?)))
            .collect::<Vec<_>>()
        {
            later.push((tid, pid));
        }
        lap("leave_probes");
        let heaps = self.family.heaps_to_map();
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
            &mut self.target,
            &pending,
            |tid| family.space_of(tid),
            &mut keep_pages,
        )?;
        let tids: Vec<Tid> = self.family.threads.keys().copied().collect();
        for &tid in &tids {
            if let Some(space) = self.family.space_of(tid) {
                leave::move_out(&mut self.target, tid, space, &mut keep_pages)?;
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
            if ptrace::event_of(tid) == Some(libc::PTRACE_EVENT_VFORK) {
                let sig = deliver.remove(&tid).unwrap_or(0);
                // Nothing it makes from now on is attached to memptrace (a
                // next vfork's child would hold it again), and memptrace's
                // exit does not kill it (see `ptrace::RELEASE_OPTIONS`).
                let _ = ptrace::set_options(tid, ptrace::RELEASE_OPTIONS);
                // This stop, if queued, is over once it runs.
                let _ = self.stops.take_of(tid);
                if ptrace::cont(tid, sig).is_ok() {
                    let _ = ptrace::interrupt(tid);
                    let pid = self.family.pid_of(tid).unwrap_or(tid);
                    later.push((tid, pid));
                }
            }
        }
        let tids: Vec<Tid> = tids
            .into_iter()
            .filter(|t| !later.iter().any(|(l, _)| l == t))
            .collect();
        let mut deferred: HashMap<Tid, super::space::Space> = HashMap::new();
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
                        ptrace::event_of(t),
                        Some(libc::PTRACE_EVENT_EXIT | libc::PTRACE_EVENT_VFORK)
                    )
                })
                .collect();
            workers.sort_by_key(|&t| t != pid);
            let Some(space) = self
                .family
                .processes
                .get_mut(&pid)
                .and_then(|p| p.space.as_mut())
            else {
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
                self.stats.left_mapped(pid, None);
                continue;
            }
            let mut last_error = None;
            for &worker in &workers {
                match space.unmap_areas(worker) {
                    Ok(signals) => {
                        for sig in signals {
                            if let std::collections::hash_map::Entry::Vacant(e) =
                                deliver.entry(worker)
                            {
                                e.insert(sig);
                            } else {
                                let _ = ptrace::tgkill(pid, worker, sig);
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
                self.stats.left_mapped(pid, Some(err.to_string()));
            }
        }
        lap("restore");
        for tid in tids {
            let sig = deliver.get(&tid).copied().unwrap_or(0);
            ptrace::unless_gone(self.target.detach(tid, sig))?;
        }
        // Threads and children whose first stop came before their birth was
        // reported: stopped, and memptrace's until let go.
        let early: Vec<(Tid, Stop)> = self.family.early.drain().collect();
        for (tid, stop) in early {
            let _ = ptrace::unless_gone(ptrace::detach(tid, Stopped::of(stop).signal()));
        }
        lap("release");
        if let Some(pause) = pause {
            self.stats.pauses.push(pause.finish());
        }
        self.heaps
            .map_heaps_after_detach(&mut self.book, &mut self.stats, heaps);
        self.family.threads.clear();
        self.family.processes.clear();
        self.detach_later(later, deferred);
        Ok(())
    }

    /// Detach the threads that had not stopped when the rest were let go (a
    /// vfork parent, released when its child, now running, execs; a thread
    /// in uninterruptible sleep), as each stops: asked again and again, up
    /// to [`super::DETACH_PATIENCE`], or until memptrace is told to stop
    /// once more. What is left is said: such a thread stays traced until
    /// memptrace exits, when the kernel lets it go.
    /// `deferred`: spaces whose trampoline pages one of these threads
    /// unmaps once it stops (every other thread of the process is gone).
    fn detach_later(
        &mut self,
        later: Vec<(Tid, Tid)>,
        mut deferred: HashMap<Tid, super::space::Space>,
    ) {
        let deadline = Instant::now() + super::DETACH_PATIENCE;
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
                    let _ = ptrace::interrupt(tid);
                }
                let step = (Instant::now() + super::PATIENCE / 8).min(deadline);
                let next = match queued {
                    Some(stop) => Ok(Some(stop)),
                    None => ptrace::wait_tid_until(tid, step),
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
                            Stopped::Birth(event) => ptrace::event_msg(tid)
                                .ok()
                                .map(|child| (event, child as Tid)),
                            _ => None,
                        };
                        let born = born.and_then(|(event, child)| {
                            let early = self.family.early.remove(&child);
                            let first = early.or_else(|| self.stops.take_of(child)).or_else(|| {
                                ptrace::wait_tid_until(child, Instant::now() + super::PATIENCE)
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
                                let _ = ptrace::detach(child, 0);
                            }
                            let _ = ptrace::set_options(tid, ptrace::RELEASE_OPTIONS);
                            let _ = ptrace::cont(tid, sig);
                            continue;
                        }
                        if let (Some(space), false) = (deferred.get_mut(&pid), exiting) {
                            match space.unmap_areas(worker) {
                                Ok(signals) => {
                                    for extra in signals {
                                        if sig == 0 {
                                            sig = extra;
                                        } else {
                                            let _ = ptrace::tgkill(pid, tid, extra);
                                        }
                                    }
                                    deferred.remove(&pid);
                                }
                                Err(err) => {
                                    self.stats.left_mapped(pid, Some(err.to_string()));
                                    deferred.remove(&pid);
                                }
                            }
                        }
                        if let Some(child) = born {
                            let _ = ptrace::detach(child, 0);
                        }
                        if ptrace::unless_gone(ptrace::detach(tid, sig)).is_ok() {
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
            self.stats.left_mapped(pid, None);
        }
    }
}

impl Family {
    /// Threads blocked in a vfork until their child execs or exits.
    pub fn vfork_parents(&self) -> HashSet<Tid> {
        self.processes
            .values()
            .filter(|p| matches!(p.role, Role::Shares { .. }))
            .filter_map(|p| p.paused)
            .collect()
    }
}

impl TraceStats {
    /// Process `pid`'s trampoline pages could not be unmapped (`why`): a
    /// warning, unless the process is gone or dying (its memory goes with
    /// it: a backend of a forking server that ended during the detach).
    pub fn left_mapped(&mut self, pid: Tid, why: Option<String>) {
        let dying = procfs::threads(pid)
            .map(|threads| threads.iter().all(|&t| procfs::thread_ending(pid, t)))
            .unwrap_or(true);
        if dying {
            return;
        }
        self.warnings.push(match why {
            Some(why) => format!("process {pid}: trampoline pages left mapped: {why}"),
            None => format!("process {pid}: trampoline pages left mapped"),
        });
    }
}
