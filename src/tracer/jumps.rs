//! The stops the jump probes still need: a thread meeting a probe before it
//! has a slot, a vfork child running on its parent's slot, a stack walk
//! that faulted, a thread inside a patch at attach (all the family's, over
//! a target); and the detach, which must get every thread out of the
//! probes before their code goes (a lifecycle step, on the [`Life`] view).

use std::collections::{HashMap, HashSet};
use std::io;
use std::time::{Duration, Instant};

use super::calls::redirect;
use super::life::Life;
use super::probes::Probe;
use super::process::{Family, Role};
use super::target::Target;
use super::{TraceError, TraceStats};
use crate::os::ptrace::{Regs, Tid};

/// How long threads in a probe's code run at first before they are
/// stopped again at detach, and at most (doubled at each round).
const RUN_OUT: (Duration, Duration) = (Duration::from_micros(50), Duration::from_millis(5));

impl<T: Target> Life<'_, T> {
    /// At detach, every thread stopped: let each thread standing in a
    /// probe's code run until it is out (its record committed, or its call
    /// begun), and send every call still inside a function that a probe
    /// called straight back to its caller, as the int3 probes' stubs are
    /// (see `detach`). Signals that stopped a thread meanwhile go to
    /// `deliver`. Returns the threads that were let run and did not stop
    /// again (they stay traced until they do: see `detach_later`).
    pub(super) fn leave_jump_probes(
        &mut self,
        deliver: &mut HashMap<Tid, i32>,
        keep_pages: &mut HashSet<Tid>,
    ) -> Result<Vec<Tid>, TraceError> {
        self.book.drain_rings(self.family, self.stats, false);
        let (inside, running) = self.run_out(deliver)?;
        for tid in inside.iter().chain(&running) {
            if let Some(owner) = self.family.owner_of(*tid) {
                keep_pages.insert(owner);
            }
        }
        for tid in &running {
            self.family.threads.remove(tid);
        }
        let tids: Vec<Tid> = self.family.threads.keys().copied().collect();
        // Calls in progress return to the probe's return path: rewrite
        // those return addresses.
        let mut pop_rets: HashMap<Tid, Option<u64>> = HashMap::new();
        for &tid in &tids {
            let Some(space) = self.family.space_of(tid) else {
                continue;
            };
            let Some(control) = space.control() else {
                continue;
            };
            let owner = space.pid;
            let pid = self.family.pid_of(tid).unwrap_or(tid);
            for slot in control.slots_of(tid) {
                // The slot is the target's memory: a stack pointer below 16
                // is no call in progress.
                let sp = control.pending_sp(slot);
                let Some(at) = sp.checked_sub(16).filter(|_| sp != 0) else {
                    continue;
                };
                let ret = self.target.read_word(pid, at).ok();
                let is_ours = ret.is_some_and(|r| {
                    space.hooks.iter().any(|h| {
                        matches!(&h.probe, Probe::Jump { code, .. } if code.ret_path == Some(r))
                    })
                });
                if !is_ours {
                    continue;
                }
                self.stats.lost_returns += 1;
                let gadget = *pop_rets.entry(owner).or_insert_with(|| space.pop_ret());
                match gadget {
                    Some(to) => self.target.write_data(pid, at, &to.to_le_bytes())?,
                    None => {
                        keep_pages.insert(owner);
                    }
                }
            }
        }
        self.book.drain_rings(self.family, self.stats, true);
        Ok(running)
    }

    /// Get every thread out of the jump probes' code without a single
    /// step: the probes' entries get their original bytes back (no call
    /// enters a probe any more), then the threads inside run for a moment
    /// and are interrupted, again and again, until each stands outside.
    /// A thread stopped by a single step or an int3 sits in a SIGTRAP stop,
    /// which memptrace's death would turn into a SIGTRAP that kills the
    /// process; one stopped by PTRACE_INTERRUPT is let go unharmed.
    /// Returns the threads still inside at the end of [`super::PATIENCE`]
    /// and those that were let run and did not stop again.
    fn run_out(
        &mut self,
        deliver: &mut HashMap<Tid, i32>,
    ) -> Result<(Vec<Tid>, Vec<Tid>), TraceError> {
        let mut inside = self.inside_probes()?;
        if super::dying::wants_threads_in_probes() {
            inside = self.until_some_thread_is_in_a_probe(inside, deliver)?;
        }
        *self.stats.in_probes_at_detach.get_or_insert(0) += inside.len() as u64;
        if inside.is_empty() {
            return Ok((inside, Vec::new()));
        }
        for (_, process) in self.family.traced() {
            if let Some(space) = &process.space {
                space.put_back_code()?;
            }
        }
        super::dying::in_detach();
        let deadline = Instant::now() + super::PATIENCE;
        let mut run = RUN_OUT.0;
        while !inside.is_empty() && Instant::now() < deadline {
            let running = self.run_a_moment(&inside, run, true, deliver, deadline)?;
            super::dying::in_detach();
            if !running.is_empty() {
                inside = self.inside_probes()?;
                inside.retain(|t| !running.contains(t));
                return Ok((inside, running));
            }
            inside = self.inside_probes()?;
            run = (run * 2).min(RUN_OUT.1);
        }
        Ok((inside, Vec::new()))
    }

    /// For a test of memptrace's death at detach (see `dying`): every
    /// thread let run a moment and stopped again, up to a thousand times,
    /// until one stops in a probe's code.
    fn until_some_thread_is_in_a_probe(
        &mut self,
        mut inside: Vec<Tid>,
        deliver: &mut HashMap<Tid, i32>,
    ) -> Result<Vec<Tid>, TraceError> {
        for _ in 0..1000 {
            if !inside.is_empty() {
                break;
            }
            let all: Vec<Tid> = self.family.threads.keys().copied().collect();
            let deadline = Instant::now() + super::PATIENCE;
            if !self
                .run_a_moment(&all, RUN_OUT.0, false, deliver, deadline)?
                .is_empty()
            {
                break;
            }
            inside = self.inside_probes()?;
        }
        Ok(inside)
    }

    /// The threads standing in a probe's code where no place in the
    /// original code matches (a jump probe recording a call); a thread at a
    /// miss int3 is sent back to its function's entry.
    fn inside_probes(&mut self) -> Result<Vec<Tid>, TraceError> {
        let mut inside = Vec::new();
        let tids: Vec<Tid> = self.family.threads.keys().copied().collect();
        for tid in tids {
            let Ok(mut regs) = self.target.regs(tid) else {
                continue; // gone
            };
            let Some(space) = self.family.space_of(tid) else {
                continue;
            };
            if !space.in_areas(regs.rip) {
                continue;
            }
            // At a miss int3: the call has not begun; it begins again at
            // the restored entry.
            if let Some(hook) = space.hooks.missed(regs.rip.wrapping_sub(1)) {
                regs.rip = hook.addr;
                self.target.set_regs(tid, &regs)?;
                continue;
            }
            if space.leave_areas(&mut regs.clone()).is_none() {
                inside.push(tid);
            }
        }
        Ok(inside)
    }

    /// Let the threads `tids` run for `run`, then interrupt them and wait
    /// (until `deadline`) for each to stop again; a signal that had stopped
    /// one is delivered as it runs (one that came next would take its place
    /// in `deliver`). `moment`: the threads running is a moment of the
    /// detach (see `dying`). Returns the threads that did not stop again.
    fn run_a_moment(
        &mut self,
        tids: &[Tid],
        run: Duration,
        moment: bool,
        deliver: &mut HashMap<Tid, i32>,
        deadline: Instant,
    ) -> Result<Vec<Tid>, TraceError> {
        // A thread waiting for room in its ring needs it read.
        self.book.drain_rings(self.family, self.stats, false);
        let mut waiting: HashSet<Tid> = HashSet::new();
        for &tid in tids {
            let sig = deliver.remove(&tid).unwrap_or(0);
            if self.target.cont(tid, sig).is_ok() {
                waiting.insert(tid);
            }
        }
        if moment {
            super::dying::in_detach();
        }
        std::thread::sleep(run);
        for &tid in &waiting {
            let _ = self.target.interrupt(tid);
        }
        self.stop_again(waiting, deliver, deadline)
    }

    /// Wait, until `deadline`, for the threads `waiting` (resumed, then
    /// interrupted) to stop again, settling each stop as the detach's stop
    /// does; a thread born meanwhile is adopted. Returns the threads that
    /// did not stop.
    fn stop_again(
        &mut self,
        mut waiting: HashSet<Tid>,
        deliver: &mut HashMap<Tid, i32>,
        deadline: Instant,
    ) -> Result<Vec<Tid>, TraceError> {
        let mut kicked = Instant::now();
        while !waiting.is_empty() && Instant::now() < deadline {
            let tid = *waiting.iter().next().unwrap_or(&0);
            let step = (Instant::now() + super::PATIENCE / 16).min(deadline);
            match self.target.wait_tid_until(tid, step)? {
                None => {
                    if kicked.elapsed() >= super::PATIENCE / 8 {
                        // Between two states (leaving a system call): ask
                        // again.
                        for &tid in &waiting {
                            let _ = self.target.interrupt(tid);
                        }
                        kicked = Instant::now();
                    }
                }
                Some(stop) => {
                    if self.settle_stopping(tid, stop, deliver)? {
                        waiting.remove(&tid);
                    }
                }
            }
        }
        self.adopt_announced(deadline)?;
        Ok(waiting.into_iter().collect())
    }
}

/// A thread's slot in the jump probes' memory, and pausing the probes of
/// a vfork child's parent, are the family's.
impl Family {
    /// A thread with no slot met a probe (its first allocator call, or its
    /// thread pointer changed): give it one, and send it back into the
    /// probe, which now finds it.
    pub fn on_miss<T: Target>(
        &mut self,
        target: &mut T,
        stats: &mut TraceStats,
        tid: Tid,
        pid: Tid,
        regs: Regs,
        entry: u64,
    ) -> io::Result<()> {
        let stack = self.stack_range(target, tid, pid, regs.rsp);
        let shares = self
            .processes
            .get(&pid)
            .is_some_and(|p| matches!(p.role, Role::Shares { .. }));
        let registered = self
            .space_of_mut(tid)
            .and_then(|s| s.control_mut())
            .and_then(|c| {
                let slot = c.register(tid, regs.fs_base, stack)?;
                if shares {
                    // A vfork child: its calls are not recorded.
                    c.pause(tid, true);
                }
                Some(slot)
            });
        if registered.is_none() {
            note_no_slot(stats, tid);
        }
        redirect(self, target, tid, regs, entry, &[])
    }

    /// Where a probe's stack walk that faulted goes on (its end, the stack
    /// marked truncated): a fault raised by the CPU (si_code > 0) at an
    /// instruction of a walk, when the thread's stack mapping shrank since
    /// memptrace read it.
    pub fn walk_faulted<T: Target>(&self, target: &mut T, tid: Tid) -> Option<u64> {
        let regs = target.regs(tid).ok()?;
        let space = self.space_of(tid)?;
        let to = space.hooks.iter().find_map(|h| match &h.probe {
            Probe::Jump { code, .. } if code.walk.contains(&regs.rip) => Some(code.truncated),
            _ => None,
        })?;
        target.si_code(tid).is_ok_and(|code| code > 0).then_some(to)
    }

    /// After a fault of a probe's stack walk: the walk ends there, the
    /// program never sees the signal, and the thread's stack is read anew.
    pub fn recover_walk<T: Target>(
        &mut self,
        target: &mut T,
        stats: &mut TraceStats,
        tid: Tid,
        to: u64,
    ) -> io::Result<()> {
        let Ok(mut regs) = target.regs(tid) else {
            return Ok(());
        };
        stats.walk_faults += 1;
        let pid = self.pid_of(tid).unwrap_or(tid);
        if let Some(thread) = self.threads.get_mut(&tid) {
            thread.stack = None;
        }
        let stack = self.stack_range(target, tid, pid, regs.rsp);
        if let Some(control) = self.space_of(tid).and_then(|s| s.control()) {
            control.set_stack(tid, stack);
        }
        regs.rip = to;
        if target.set_regs(tid, &regs).is_err() {
            return Ok(());
        }
        self.resume(target, tid, 0)
    }

    /// Move a stopped thread standing inside the bytes a jump probe's patch
    /// covers (past the entry) to the same instruction in the probe's
    /// displaced copy, which goes on where the function does.
    pub fn step_over_patch<T: Target>(&self, target: &mut T, tid: Tid) -> io::Result<()> {
        let Ok(mut regs) = target.regs(tid) else {
            return Ok(());
        };
        let Some(space) = self.space_of(tid) else {
            return Ok(());
        };
        let moved = space.hooks.iter().find_map(|h| match &h.probe {
            Probe::Jump {
                code,
                via_int3: false,
            } if regs.rip > h.addr => code
                .displaced_map
                .iter()
                .find(|&&(_, orig)| orig == regs.rip)
                .map(|&(here, _)| here),
            _ => None,
        });
        if let Some(here) = moved {
            regs.rip = here;
            target.set_regs(tid, &regs)?;
        }
        Ok(())
    }

    /// Record nothing (`paused`), or again, of what thread `tid` calls: the
    /// thread of a parent whose vfork child runs on its stack.
    pub fn pause_slots(&self, tid: Tid, paused: bool) {
        if let Some(control) = self.space_of(tid).and_then(|s| s.control()) {
            control.pause(tid, paused);
        }
    }

    /// A vfork child (`pid`) execs or exits: its parent's thread records
    /// again, and the slots the child took in its parent's memory go.
    pub fn end_sharing(&mut self, pid: Tid) {
        let Some(process) = self.processes.get(&pid) else {
            return;
        };
        let (Role::Shares { parent }, Some(by)) = (process.role, process.paused) else {
            return;
        };
        if let Some(control) = self.space_mut(parent).and_then(|s| s.control_mut()) {
            control.pause(by, false);
            control.release_all_of(pid);
        }
    }
}

/// Thread `tid` found no free slot: the user hears of it once.
fn note_no_slot(stats: &mut TraceStats, tid: Tid) {
    let warning = format!(
        "thread {tid} found no free slot in the jump probes' memory (over {} threads at once?) and waits for one",
        super::probes::jump::layout::SLOTS
    );
    if !stats.warnings.contains(&warning) {
        stats.warnings.push(warning);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracer::process::{Process, Thread};
    use crate::tracer::target::fake::{Call, FakeTarget};

    const PID: Tid = 7;
    const SP: u64 = 0x7ff0_0000;

    /// Process [`PID`], traced with no space made, its thread stopped.
    fn family() -> (Family, FakeTarget) {
        let mut family = Family::default();
        family
            .processes
            .insert(PID, Process::new(Role::Traced, None));
        let mut thread = Thread::new(PID, 0);
        thread.stack = Some(SP - 0x1000..SP + 0x1000);
        family.threads.insert(PID, thread);
        let mut target = FakeTarget::new();
        target.stopped_at(PID, 0x1001, SP);
        (family, target)
    }

    #[test]
    fn a_thread_finding_no_slot_goes_back_into_the_probe_and_is_warned_of_once() {
        let (mut family, mut target) = family();
        let mut stats = TraceStats::default();
        for _ in 0..2 {
            let regs = target.threads[&PID].regs;
            family
                .on_miss(&mut target, &mut stats, PID, PID, regs, 0x2000)
                .unwrap();
            target.threads.get_mut(&PID).unwrap().stopped = true;
        }
        assert_eq!(target.threads[&PID].regs.rip, 0x2000);
        assert_eq!(
            target.calls,
            [
                Call::SetRegs(PID),
                Call::Cont(PID, 0),
                Call::SetRegs(PID),
                Call::Cont(PID, 0)
            ]
        );
        assert_eq!(stats.warnings.len(), 1);
        assert!(stats.warnings[0].starts_with(&format!("thread {PID} found no free slot")));
    }

    #[test]
    fn a_walk_that_faulted_ends_where_it_is_told_unseen() {
        let (mut family, mut target) = family();
        let mut stats = TraceStats::default();
        family
            .recover_walk(&mut target, &mut stats, PID, 0x3000)
            .unwrap();
        assert_eq!(target.calls, [Call::SetRegs(PID), Call::Cont(PID, 0)]);
        assert_eq!(target.threads[&PID].regs.rip, 0x3000);
        assert_eq!(stats.walk_faults, 1);
        // No jump probe in the space: no fault is a walk's.
        target.threads.get_mut(&PID).unwrap().stopped = true;
        target.threads.get_mut(&PID).unwrap().si_code = 1;
        assert_eq!(family.walk_faulted(&mut target, PID), None);
        // A thread gone meanwhile is no error, and not counted.
        target.threads.clear();
        family
            .recover_walk(&mut target, &mut stats, PID, 0x3000)
            .unwrap();
        assert_eq!(stats.walk_faults, 1);
    }
}
