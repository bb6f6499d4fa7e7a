//! Letting go: stop every thread, put back every byte and return address,
//! detach without injecting a signal. The program runs on as if never traced.
//!
//! Subtleties (`ptrace(2)`): PTRACE_INTERRUPT reports its stop *before* a
//! SIGTRAP that an int3, or the end of a step into a signal, already queued;
//! detaching then would let that SIGTRAP kill the program. Such a thread is
//! resumed once more so the queued trap is reported and consumed. A thread
//! inside an allocator call it entered through a slot's stub is sent to
//! return straight to its caller (through a `pop` + `ret` pair of the
//! program's own code); that call is not recorded.
//! A thread standing in a trampoline moves to the same place in the original
//! code, and the trampoline pages are unmapped, unless some thread stands
//! where no such place exists.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::os::ptrace::{Stop, Tid};
use crate::tracer::life::Life;
use crate::tracer::life::pauses::PauseClock;
use crate::tracer::life::stopping::Stopping;
use crate::tracer::process::{Family, Role};
use crate::tracer::space::Space;
use crate::tracer::target::Target;
use crate::tracer::{TraceError, TraceStats};

#[cfg(test)]
mod detach_tests;
mod jumps;
mod leave;
mod release;

use release::Release;

/// What a detach leaves once every thread it stopped is let go: the heaps
/// to map (the tracer's, which [`Life`] does not hold), then the threads
/// that had not stopped, let go as each stops ([`Life::finish_detach`]).
pub(in crate::tracer) struct Detached {
    /// The traced processes, whose heaps are mapped now they run again.
    pub heaps: Vec<Tid>,
    later: Vec<(Tid, Tid)>,
    deferred: HashMap<Tid, Space>,
}

/// Detach a running thread that memptrace no longer wants: interrupt it, wait
/// for that stop, detach. Other threads' stops stay queued.
pub(in crate::tracer) fn detach_running(target: &mut impl Target, tid: Tid) {
    if target.interrupt(tid).is_err() {
        return;
    }
    // Bounded: a thread that never stops (uninterruptible sleep) is left
    // to the kernel, which lets it go when memptrace exits.
    let deadline = Instant::now() + crate::tracer::PATIENCE;
    match target.wait_tid_until(tid, deadline) {
        Ok(Some(stop @ (Stop::Exited(_) | Stop::Killed { .. }))) => {
            target.keep_for_later(tid, stop);
        }
        Ok(None) | Err(_) => {}
        Ok(Some(Stop::Signal(sig))) => {
            let _ = target.detach(tid, sig);
        }
        Ok(Some(_)) => {
            let _ = target.detach(tid, 0);
        }
    }
}

/// Detaching is a lifecycle step: it runs on the [`Life`] view.
impl<T: Target> Life<'_, T> {
    /// Detach the threads an attach stopped, putting back whatever was
    /// planted; the threads that did not stop are left alone. `patience`:
    /// how long threads in a jump probe's code may take to leave it.
    pub fn let_go_held(&mut self, patience: Duration) -> Result<Detached, TraceError> {
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
        self.restore_and_release(deliver, &stuck, &HashSet::new(), None, patience)
    }

    /// Stop every thread, settle each stop (see [`Life::settle_stopping`]),
    /// and let the threads go as [`Life::restore_and_release`] does. The
    /// calls held back for the attach's inventory must be booked before.
    /// Stopping is given up when no thread stopped for `patience`.
    pub fn detach_all(&mut self, patience: Duration) -> Result<Detached, TraceError> {
        let mut pause = PauseClock::start("detach");
        crate::tracer::life::dying::detaching();
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
                Stopping::Nothing if progress.elapsed() < patience => {
                    if kicked.elapsed() >= patience / 8 {
                        // A thread between two states (leaving a system
                        // call, a group-stop) is asked again.
                        for &tid in &waiting {
                            let _ = self.target.interrupt(tid);
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
        self.restore_and_release(deliver, &stuck, &late, Some(pause), patience)
    }

    /// Put back what was changed, then detach every thread: return addresses,
    /// threads standing in a trampoline slot (moved to the same place in the
    /// original code), the int3 bytes, and last the trampoline pages.
    /// `pause`: the detach's stop, timed from its start, to be ended here;
    /// `patience`: how long threads in a jump probe's code may take to
    /// leave it.
    fn restore_and_release(
        &mut self,
        mut deliver: HashMap<Tid, i32>,
        stuck: &HashSet<Tid>,
        late: &HashSet<Tid>,
        mut pause: Option<PauseClock>,
        patience: Duration,
    ) -> Result<Detached, TraceError> {
        let mut lap = |name| {
            if let Some(p) = pause.as_mut() {
                p.lap(name)
            }
        };
        // Every thread is stopped: copies not made yet are read now.
        self.book.settle_all(self.family, self.target, true);
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
            .leave_jump_probes(&mut deliver, &mut keep_pages, patience)?
            .into_iter()
            .filter_map(|tid| Some((tid, self.family.pid_of(tid)?)))
            .collect::<Vec<_>>()
        {
            later.push((tid, pid));
        }
        lap("leave_probes");
        let heaps = self.family.heaps_to_map();
        let restored = self
            .release()
            .restore(&mut deliver, &mut keep_pages, &mut later)?;
        lap("restore");
        self.release().let_go(&restored.tids, &deliver)?;
        lap("release");
        if let Some(pause) = pause {
            self.stats.pauses.push(pause.finish());
        }
        Ok(Detached {
            heaps,
            later,
            deferred: restored.deferred,
        })
    }

    /// The end of a detach, once the heaps are mapped: forget every thread
    /// and process, and let go those that had not stopped as each stops,
    /// given up after `patience`.
    pub fn finish_detach(&mut self, detached: Detached, patience: Duration) {
        self.release()
            .finish(detached.later, detached.deferred, patience);
    }

    /// The end of a detach's borrows (see [`Release`]).
    fn release(&mut self) -> Release<'_, T> {
        Release {
            family: self.family,
            stops: self.stops,
            stats: self.stats,
            target: self.target,
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
    pub fn left_mapped(&mut self, target: &mut impl Target, pid: Tid, why: Option<String>) {
        let dying = target
            .threads(pid)
            .map(|threads| threads.iter().all(|&t| target.thread_ending(pid, t)))
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
