//! Leaving the jump probes at detach: every thread stopped, each thread
//! standing in a probe's code is let run until it is out, and each call
//! still inside a function a probe called is sent straight back to its
//! caller, before the probes' code goes.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::os::ptrace::Tid;
use crate::tracer::TraceError;
use crate::tracer::life::Life;
use crate::tracer::probes::Probe;
use crate::tracer::target::Target;

/// How long threads in a probe's code run at first before they are
/// stopped again at detach, and at most (doubled at each round).
const RUN_OUT: (Duration, Duration) = (Duration::from_micros(50), Duration::from_millis(5));

impl<T: Target> Life<'_, T> {
    /// At detach, every thread stopped: let each thread standing in a
    /// probe's code run until it is out (its record committed, or its call
    /// begun), and send every call still inside a function that a probe
    /// called straight back to its caller, as the int3 probes' stubs are
    /// (see `detach`). Signals that stopped a thread meanwhile go to
    /// `deliver`; threads still inside after `patience` are left there, and
    /// their pages kept. Returns the threads that were let run and did not
    /// stop again (they stay traced until they do: see `detach_later`).
    pub(in crate::tracer) fn leave_jump_probes(
        &mut self,
        deliver: &mut HashMap<Tid, i32>,
        keep_pages: &mut HashSet<Tid>,
        patience: Duration,
    ) -> Result<Vec<Tid>, TraceError> {
        self.book.drain_rings(self.family, self.stats, false);
        let (inside, running) = self.run_out(deliver, patience)?;
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
    /// Returns the threads still inside at the end of `patience` and those
    /// that were let run and did not stop again.
    fn run_out(
        &mut self,
        deliver: &mut HashMap<Tid, i32>,
        patience: Duration,
    ) -> Result<(Vec<Tid>, Vec<Tid>), TraceError> {
        let mut inside = self.inside_probes()?;
        if crate::tracer::life::dying::wants_threads_in_probes() {
            inside = self.until_some_thread_is_in_a_probe(inside, deliver, patience)?;
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
        crate::tracer::life::dying::in_detach();
        let deadline = Instant::now() + patience;
        let mut run = RUN_OUT.0;
        while !inside.is_empty() && Instant::now() < deadline {
            let running = self.run_a_moment(&inside, run, true, deliver, deadline)?;
            crate::tracer::life::dying::in_detach();
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
        patience: Duration,
    ) -> Result<Vec<Tid>, TraceError> {
        for _ in 0..1000 {
            if !inside.is_empty() {
                break;
            }
            let all: Vec<Tid> = self.family.threads.keys().copied().collect();
            let deadline = Instant::now() + patience;
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
            crate::tracer::life::dying::in_detach();
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
            let step = (Instant::now() + crate::tracer::PATIENCE / 16).min(deadline);
            match self.target.wait_tid_until(tid, step)? {
                None => {
                    if kicked.elapsed() >= crate::tracer::PATIENCE / 8 {
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

#[cfg(test)]
#[path = "jumps_tests.rs"]
mod tests;
