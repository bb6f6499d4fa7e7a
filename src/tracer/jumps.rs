//! The stops the jump probes still need: a thread meeting a probe before it
//! has a slot, a vfork child running on its parent's slot, and the detach,
//! which must get every thread out of the probes before their code goes.

use std::collections::HashMap;

use super::probes::Probe;
use super::process::Role;
use super::{TraceError, Tracer};
use crate::memory::Memory;
use crate::os::mem;
use crate::os::ptrace::{self, Regs, Stop, Tid};

/// Instructions a thread is stepped through, at most, to leave a probe at
/// detach (a probe is a few hundred; a thread waiting for room in its ring
/// loops through its wait until memptrace reads the ring).
const MAX_STEPS: usize = 200_000;

impl Tracer {
    /// A thread with no slot met a probe (its first allocator call, or its
    /// thread pointer changed): give it one, and send it back into the
    /// probe, which now finds it.
    pub(super) fn on_miss(
        &mut self,
        tid: Tid,
        pid: Tid,
        regs: Regs,
        entry: u64,
    ) -> Result<(), TraceError> {
        let stack = self.stack_range(tid, pid, regs.rsp);
        let shares = self
            .family
            .processes
            .get(&pid)
            .is_some_and(|p| matches!(p.role, Role::Shares { .. }));
        let registered = self
            .family
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
            self.note_no_slot(tid);
        }
        self.redirect(tid, regs, entry, Vec::new())
    }

    /// Where a probe's stack walk that faulted goes on (its end, the stack
    /// marked truncated): a fault raised by the CPU (si_code > 0) at an
    /// instruction of a walk, when the thread's stack mapping shrank since
    /// memptrace read it.
    pub(super) fn walk_faulted(&self, tid: Tid) -> Option<u64> {
        let regs = ptrace::get_regs(tid).ok()?;
        let space = self.family.space_of(tid)?;
        let to = space.hooks.iter().find_map(|h| match &h.probe {
            Probe::Jump { code, .. } if code.walk.contains(&regs.rip) => Some(code.truncated),
            _ => None,
        })?;
        ptrace::siginfo(tid)
            .is_ok_and(|i| i.si_code > 0)
            .then_some(to)
    }

    /// After a fault of a probe's stack walk: the walk ends there, the
    /// program never sees the signal, and the thread's stack is read anew.
    pub(super) fn recover_walk(&mut self, tid: Tid, to: u64) -> Result<(), TraceError> {
        let Ok(mut regs) = ptrace::get_regs(tid) else {
            return Ok(());
        };
        self.stats.walk_faults += 1;
        let pid = self.family.pid_of(tid).unwrap_or(tid);
        if let Some(thread) = self.family.threads.get_mut(&tid) {
            thread.stack = None;
        }
        let stack = self.stack_range(tid, pid, regs.rsp);
        if let Some(control) = self.family.space_of(tid).and_then(|s| s.control()) {
            control.set_stack(tid, stack);
        }
        regs.rip = to;
        if ptrace::set_regs(tid, &regs).is_err() {
            return Ok(());
        }
        self.resume(tid, 0)
    }

    /// Move a stopped thread standing inside the bytes a jump probe's patch
    /// covers (past the entry) to the same instruction in the probe's
    /// displaced copy, which goes on where the function does.
    pub(super) fn step_over_patch(&mut self, tid: Tid) -> Result<(), TraceError> {
        let Ok(mut regs) = ptrace::get_regs(tid) else {
            return Ok(());
        };
        let Some(space) = self.family.space_of(tid) else {
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
            ptrace::set_regs(tid, &regs)?;
        }
        Ok(())
    }

    /// The mapping holding a thread's stack (the probes read nothing else).
    pub(super) fn stack_range(&mut self, tid: Tid, pid: Tid, sp: u64) -> std::ops::Range<u64> {
        let end = self.stack_top(tid, pid, sp);
        let start = self
            .family
            .threads
            .get(&tid)
            .and_then(|t| t.stack.clone())
            .map_or(sp, |r| r.start);
        start..end
    }

    fn note_no_slot(&mut self, tid: Tid) {
        let warning = format!(
            "thread {tid} found no free slot in the jump probes' memory (over {} threads at once?) and waits for one",
            super::probes::jump::layout::SLOTS
        );
        if !self.stats.warnings.contains(&warning) {
            self.stats.warnings.push(warning);
        }
    }

    /// Record nothing (`paused`), or again, of what thread `tid` calls: the
    /// thread of a parent whose vfork child runs on its stack.
    pub(super) fn pause_slots(&mut self, tid: Tid, paused: bool) {
        if let Some(control) = self.family.space_of(tid).and_then(|s| s.control()) {
            control.pause(tid, paused);
        }
    }

    /// A vfork child (`pid`) execs or exits: its parent's thread records
    /// again, and the slots the child took in its parent's memory go.
    pub(super) fn end_sharing(&mut self, pid: Tid) {
        let Some(process) = self.family.processes.get(&pid) else {
            return;
        };
        let (Role::Shares { parent }, Some(by)) = (process.role, process.paused) else {
            return;
        };
        let control = self
            .family
            .processes
            .get_mut(&parent)
            .and_then(|p| p.space.as_mut())
            .and_then(|s| s.control_mut());
        if let Some(control) = control {
            control.pause(by, false);
            for slot in control.slots_of(pid) {
                control.release(slot);
            }
        }
    }

    /// At detach, every thread stopped: step each thread standing in a
    /// probe's code until it is out (its record committed, or its call not
    /// begun), and send every call still inside a function that a probe
    /// called straight back to its caller, as the int3 probes' stubs are
    /// (see `detach`). Signals that stopped a thread meanwhile go to
    /// `deliver`.
    pub(super) fn leave_jump_probes(
        &mut self,
        deliver: &mut HashMap<Tid, i32>,
        keep_pages: &mut std::collections::HashSet<Tid>,
    ) -> Result<(), TraceError> {
        self.drain_rings(false);
        let tids: Vec<Tid> = self.family.threads.keys().copied().collect();
        for &tid in &tids {
            if !self.step_out(tid, deliver)? {
                if let Some(owner) = self.family.owner_of(tid) {
                    keep_pages.insert(owner);
                }
            }
        }
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
                let sp = control.pending_sp(slot);
                if sp == 0 {
                    continue;
                }
                let ret = mem::ProcessMemory(pid).read_u64(sp - 16).ok();
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
                    Some(to) => mem::write_data(pid, sp - 16, &to.to_le_bytes())?,
                    None => {
                        keep_pages.insert(owner);
                    }
                }
            }
        }
        self.drain_rings(true);
        Ok(())
    }

    /// Single-step `tid` until it stands outside the trampoline areas.
    /// False when it could not be got out.
    fn step_out(&mut self, tid: Tid, deliver: &mut HashMap<Tid, i32>) -> Result<bool, TraceError> {
        for step in 0..MAX_STEPS {
            let Ok(mut regs) = ptrace::get_regs(tid) else {
                return Ok(true); // gone
            };
            let Some(space) = self.family.space_of(tid) else {
                return Ok(true);
            };
            if !space.in_areas(regs.rip) {
                return Ok(true);
            }
            // At a miss int3 (stepped onto it, or stopped on it): the call
            // has not begun; it begins again at the restored entry.
            if let Some(hook) = space.hooks.missed(regs.rip.wrapping_sub(1)) {
                regs.rip = hook.addr;
                ptrace::set_regs(tid, &regs)?;
                return Ok(true);
            }
            if step % 256 == 255 {
                // A thread waiting for room in its ring needs it read.
                self.drain_rings(false);
            }
            ptrace::single_step(tid)?;
            // Bounded: a thread that does not come back from one step (it
            // was killed with its process, whose leader a wait would then
            // wait for) is not waited for forever; it counts as not out.
            let deadline = std::time::Instant::now() + super::PATIENCE;
            match ptrace::wait_tid_until(tid, deadline)? {
                None => return Ok(false),
                Some(Stop::Signal(libc::SIGTRAP)) => {}
                Some(Stop::Signal(sig)) => {
                    deliver.entry(tid).or_insert(sig);
                }
                Some(stop @ (Stop::Exited(_) | Stop::Killed { .. })) => {
                    // How it ended is the wait loop's to see.
                    ptrace::keep_for_later(tid, stop);
                    return Ok(true);
                }
                Some(_) => {}
            }
        }
        Ok(false)
    }
}
