//! The stops the jump probes still need: a thread meeting a probe before it
//! has a slot, a vfork child running on its parent's slot, a stack walk
//! that faulted, a thread inside a patch at attach (all the family's, over
//! a target). Leaving the probes at detach is the lifecycle's
//! (`life::detach::jumps`).

use std::io;

use crate::os::ptrace::{Regs, Tid};
use crate::tracer::TraceStats;
use crate::tracer::probes::Probe;
use crate::tracer::process::{Family, Role};
use crate::tracer::serve::calls::redirect;
use crate::tracer::target::Target;

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
    /// again (unless its vfork-done stop let it already), and the slots the
    /// child took in its parent's memory go.
    pub fn end_sharing(&mut self, pid: Tid) {
        let Some(process) = self.processes.get_mut(&pid) else {
            return;
        };
        let Role::Shares { parent } = process.role else {
            return;
        };
        let by = process.paused.take();
        if let Some(control) = self.space_mut(parent).and_then(|s| s.control_mut()) {
            if let Some(by) = by {
                control.pause(by, false);
            }
            control.release_all_of(pid);
        }
    }

    /// Thread `tid`'s vfork child exec'd or exited (its vfork-done stop,
    /// which comes before `tid` runs on): `tid` records again now. The
    /// child's exec or exit reaches memptrace later, while `tid` may
    /// already be allocating (posix_spawn's parent frees what it set up
    /// as soon as it returns): waiting for it lost those calls. Only when
    /// that child is the one sharing `tid`'s thread pointer: a raw
    /// `clone(CLONE_VM)` child of `tid` still running on it keeps the
    /// slots paused until its own exec or exit.
    pub fn vfork_done(&mut self, tid: Tid) {
        let children: Vec<Tid> = self
            .processes
            .iter()
            .filter(|(_, p)| matches!(p.role, Role::Shares { .. }) && p.paused == Some(tid))
            .map(|(&child, _)| child)
            .collect();
        if let [child] = children[..] {
            self.end_sharing(child);
        }
    }
}

/// Thread `tid` found no free slot: the user hears of it once.
fn note_no_slot(stats: &mut TraceStats, tid: Tid) {
    let warning = format!(
        "thread {tid} found no free slot in the jump probes' memory (over {} threads at once?) and waits for one",
        crate::tracer::probes::jump::layout::SLOTS
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
