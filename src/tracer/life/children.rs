//! Children of a traced process: threads join the trace; a forked child
//! either joins it too (`--follow-forks`) or is cleaned and released; a
//! vfork child (or any clone that shares memory) runs in its parent's memory,
//! breakpoints included, unrecorded, until it execs.
//!
//! A forked child is a copy of its parent at the fork: the int3 bytes, the
//! trampoline pages and the stacks. Released, it gets the original bytes back
//! and loses the pages before it runs a single instruction; followed, it gets
//! a copy of its parent's [`Space`] with modules of its own.

use crate::os::ptrace::{self, Stop, Tid};
use crate::trace_msg::TraceMsg;
use crate::tracer::TraceError;
use crate::tracer::life::Life;
use crate::tracer::life::{detach, failopen};
use crate::tracer::process::{Child, Family, Process, Role, Thread};
use crate::tracer::space::Space;
use crate::tracer::target::Target;

/// Children are a lifecycle step: they run on the [`Life`] view.
impl<T: Target> Life<'_, T> {
    /// A clone/fork/vfork event: learn what the child is. Its first stop may
    /// already have arrived (then it is adopted now) or may come later.
    /// `stopped`: adopt it without resuming it (while detaching).
    pub(in crate::tracer) fn announce_child(
        &mut self,
        tid: Tid,
        event: i32,
        stopped: bool,
    ) -> Result<(), TraceError> {
        let child = self.target.event_msg(tid)? as Tid;
        let pid = self.family.pid_of(tid).unwrap_or(tid);
        let kind = match event {
            libc::PTRACE_EVENT_FORK => Child::Fork { parent: pid },
            libc::PTRACE_EVENT_VFORK => Child::Shared {
                parent: pid,
                by: tid,
            },
            _ if self.target.tgid(child) == Some(pid) => Child::Thread { pid },
            // A clone that is not a thread may share memory (CLONE_VM):
            // treat it like vfork, never touch the shared code.
            _ => Child::Shared {
                parent: pid,
                by: tid,
            },
        };
        if let Child::Shared { by, .. } = kind {
            // The child runs on the parent thread's stack and thread
            // pointer: the jump probes must not record its calls as the
            // parent's (the parent itself waits until the child execs).
            self.family.pause_slots(by, true);
        }
        match (self.family.early.remove(&child), stopped) {
            (Some(first), false) => self.adopt(child, kind, first),
            (Some(_), true) => self.adopt_stopped(child, kind),
            (None, _) => {
                self.family.announced.insert(child, kind);
                Ok(())
            }
        }
    }

    /// The first stop of an announced child.
    pub(in crate::tracer) fn adopt(
        &mut self,
        tid: Tid,
        child: Child,
        first: Stop,
    ) -> Result<(), TraceError> {
        match child {
            Child::Thread { pid } => {
                self.book.add_thread(self.family, tid, pid);
                let alive_ticks =
                    failopen::alive_ticks(self.book.tsc.as_ref(), self.control.attached);
                self.family.register_early(self.target, tid, alive_ticks);
                // A thread born while its process stops (SIGSTOP, SIGTSTP)
                // starts in that group-stop: it stays stopped with the rest.
                Ok(self.family.resume_from(self.target, tid, first)?)
            }
            Child::Fork { parent } if self.opts.follow_forks => self.follow_fork(tid, parent),
            Child::Fork { parent } => self.let_fork_go(tid, parent),
            Child::Shared { parent, by } => {
                let mut process = Process::new(Role::Shares { parent }, None);
                process.paused = Some(by);
                self.family.processes.insert(tid, process);
                let start_ns = self.book.now_ns();
                self.family.threads.insert(tid, Thread::new(tid, start_ns));
                Ok(self.family.resume(self.target, tid, 0)?)
            }
        }
    }

    /// A forked child, at its first stop: trace it as its parent was traced.
    fn follow_fork(&mut self, tid: Tid, parent: Tid) -> Result<(), TraceError> {
        let Some(space) = self.family.space(parent) else {
            return self.let_fork_go(tid, parent);
        };
        let mut copy = space.fork_copy(tid, &mut self.book.next_module_id)?;
        if let Some(control) = space.control() {
            // Its copy of the control area is shared with the parent: it
            // gets one of its own before it runs.
            let mut signals = Vec::new();
            if let Err(err) = copy.adopt_control(tid, control, &mut signals) {
                // As in a process that execs: int3 probes catch its calls.
                let why = format!("no memory shared with memptrace: {err}");
                match copy.jumps_to_int3(tid, &why, &mut signals) {
                    Ok(planted) => {
                        self.stats.warnings.push(format!(
                            "process {tid}: jump probes cannot record without memory shared with memptrace, int3 probes catch its calls: {err}"
                        ));
                        self.stats.note_planted(tid, planted);
                    }
                    Err(again) => {
                        self.stats.warnings.push(format!(
                            "process {tid}: its calls cannot be recorded apart from its parent's ({err}), nor caught by int3 probes ({again}); it is released"
                        ));
                        return self.let_fork_go(tid, parent);
                    }
                }
            }
            for sig in signals {
                let _ = self.target.tgkill(tid, tid, sig);
            }
        }
        let now = self.book.now_ns();
        let modules: Vec<_> = copy.modules.values().cloned().collect();
        let areas = copy.area_ranges();
        self.book.send(TraceMsg::Trampolines {
            pid: tid as u32,
            areas,
        });
        for module in &modules {
            self.images().announce(tid, module, now);
        }
        self.family
            .processes
            .insert(tid, Process::new(Role::Traced, Some(copy)));
        self.book.add_thread(self.family, tid, tid);
        Ok(self.family.resume(self.target, tid, 0)?)
    }

    /// A forked child not to be traced, let go (see [`Family::release_fork`]).
    fn let_fork_go(&mut self, tid: Tid, parent: Tid) -> Result<(), TraceError> {
        let warnings = &mut self.stats.warnings;
        Ok(self
            .family
            .release_fork(self.target, tid, parent, warnings)?)
    }
}

impl Family {
    /// Children still running in the memory of a process that is gone (a
    /// clone with CLONE_VM that outlived it) get the original code back
    /// through the dead process's open /proc/PID/mem, which still holds the
    /// shared memory, and are released.
    pub fn release_sharers(
        &mut self,
        target: &mut impl Target,
        pid: Tid,
        mut space: Space,
        warnings: &mut Vec<String>,
    ) {
        let sharers: Vec<Tid> = self
            .processes
            .iter()
            .filter(|(_, p)| p.role == Role::Shares { parent: pid })
            .map(|(child, _)| *child)
            .collect();
        if sharers.is_empty() {
            return;
        }
        if let Err(err) = space.restore_all() {
            warnings.push(format!("restoring code shared with {sharers:?}: {err}"));
        }
        for child in sharers {
            self.processes.remove(&child);
            for t in self.threads_of(child) {
                self.threads.remove(&t);
                // It is running: PTRACE_DETACH needs a stop first.
                detach::detach_running(target, t);
            }
        }
    }

    /// A forked child not to be traced: put the original bytes of
    /// `parent`'s probes back in its copy of memory, unmap its copies of
    /// the trampoline pages, let it go. What could not be cleaned is a
    /// warning.
    pub fn release_fork<T: Target>(
        &self,
        target: &mut T,
        tid: Tid,
        parent: Tid,
        warnings: &mut Vec<String>,
    ) -> std::io::Result<()> {
        let mut deliver = 0;
        if let Some(space) = self.space(parent) {
            let cleaned = target
                .code(tid)
                .and_then(|mem| space.put_back_into(&*mem))
                .map_err(|e| e.to_string())
                .and_then(|()| space.unmap_areas_in(tid).map_err(|e| e.to_string()));
            match cleaned {
                Ok(signals) => {
                    for (i, sig) in signals.into_iter().enumerate() {
                        if i == 0 {
                            deliver = sig;
                        } else {
                            let _ = target.tgkill(tid, tid, sig);
                        }
                    }
                }
                Err(err) => warnings.push(format!("cleaning code in child {tid}: {err}")),
            }
        }
        ptrace::unless_gone(target.detach(tid, deliver))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracer::space::fake::{FakeSpace, PID};
    use crate::tracer::target::fake::{Call, FakeTarget};

    const CHILD: Tid = PID + 10;

    #[test]
    fn a_released_fork_gets_the_original_code_back_and_is_let_go() {
        let mut fake = FakeSpace::libc(true);
        fake.hook();
        let mut target = FakeTarget::new();
        // The child's copy of its parent's memory, probes included.
        let child = target.memory(CHILD);
        for (at, orig) in &fake.code {
            child.map(*at, fake.mem.bytes(*at, orig.len()));
        }
        assert!(!fake.changed_code().is_empty());
        // No image to find a system call in: the trampoline pages cannot
        // be unmapped, which is said.
        fake.space.modules.clear();
        target.stopped_at(CHILD, 0x1000, 0x7000);
        let FakeSpace {
            space, mem, code, ..
        } = fake;
        let family = Family::of_one(PID, space, &[PID]);
        let mut warnings = Vec::new();
        family
            .release_fork(&mut target, CHILD, PID, &mut warnings)
            .unwrap();
        for (at, orig) in &code {
            assert_eq!(&child.bytes(*at, orig.len()), orig, "code at {at:#x}");
        }
        assert_eq!(target.calls, vec![Call::Detach(CHILD, 0)]);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].starts_with(&format!("cleaning code in child {CHILD}")));
        // The parent's code is its own: still hooked.
        let hooked = |(at, orig): &(u64, Vec<u8>)| mem.bytes(*at, orig.len()) != *orig;
        assert!(code.iter().any(hooked));
    }

    #[test]
    fn a_fork_of_a_process_without_probes_is_only_let_go() {
        let mut family = Family::default();
        family
            .processes
            .insert(PID, Process::new(Role::Traced, None));
        let mut target = FakeTarget::new();
        target.stopped_at(CHILD, 0x1000, 0x7000);
        let mut warnings = Vec::new();
        family
            .release_fork(&mut target, CHILD, PID, &mut warnings)
            .unwrap();
        assert_eq!(target.calls, vec![Call::Detach(CHILD, 0)]);
        assert!(warnings.is_empty());
        // Gone meanwhile: not an error.
        family
            .release_fork(&mut target, CHILD, PID, &mut warnings)
            .unwrap();
    }
}
