//! Children of a traced process: threads join the trace; a forked child
//! either joins it too (`--follow-forks`) or is cleaned and released; a
//! vfork child (or any clone that shares memory) runs in its parent's memory,
//! breakpoints included, unrecorded, until it execs.
//!
//! A forked child is a copy of its parent at the fork: the int3 bytes, the
//! trampoline pages and the stacks. Released, it gets the original bytes back
//! and loses the pages before it runs a single instruction; followed, it gets
//! a copy of its parent's [`Space`] with modules of its own.

use super::process::{Child, Process, Role, Thread};
use super::space::Space;
use super::{TraceError, Tracer, detach};
use crate::os::procfs;
use crate::os::ptrace::{self, Stop, Tid};

impl Tracer {
    /// A clone/fork/vfork event: learn what the child is. Its first stop may
    /// already have arrived (then it is adopted now) or may come later.
    /// `stopped`: adopt it without resuming it (while detaching).
    pub(super) fn announce_child(
        &mut self,
        tid: Tid,
        event: i32,
        stopped: bool,
    ) -> Result<(), TraceError> {
        let child = ptrace::event_msg(tid)? as Tid;
        let pid = self.family.pid_of(tid).unwrap_or(tid);
        let kind = match event {
            libc::PTRACE_EVENT_FORK => Child::Fork { parent: pid },
            libc::PTRACE_EVENT_VFORK => Child::Shared {
                parent: pid,
                by: tid,
            },
            _ if procfs::tgid(child) == Some(pid) => Child::Thread { pid },
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
            self.pause_slots(by, true);
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
    pub(super) fn adopt(&mut self, tid: Tid, child: Child, first: Stop) -> Result<(), TraceError> {
        match child {
            Child::Thread { pid } => {
                self.add_thread(tid, pid);
                let alive_ticks = self.alive_ticks();
                self.family
                    .register_early(&mut self.target, tid, alive_ticks);
                // A thread born while its process stops (SIGSTOP, SIGTSTP)
                // starts in that group-stop: it stays stopped with the rest.
                self.resume_from(tid, first)
            }
            Child::Fork { parent } if self.opts.follow_forks => self.follow_fork(tid, parent),
            Child::Fork { parent } => self.release_fork(tid, parent),
            Child::Shared { parent, by } => {
                let mut process = Process::new(Role::Shares { parent }, None);
                process.paused = Some(by);
                self.family.processes.insert(tid, process);
                let start_ns = self.now_ns();
                self.family.threads.insert(tid, Thread::new(tid, start_ns));
                self.resume(tid, 0)
            }
        }
    }

    /// Children still running in the memory of a process that is gone (a
    /// clone with CLONE_VM that outlived it) get the original code back
    /// through the dead process's open /proc/PID/mem, which still holds the
    /// shared memory, and are released.
    pub(super) fn release_sharers(&mut self, pid: Tid, mut space: Space) -> Result<(), TraceError> {
        let sharers: Vec<Tid> = self
            .family
            .processes
            .iter()
            .filter(|(_, p)| p.role == Role::Shares { parent: pid })
            .map(|(child, _)| *child)
            .collect();
        if sharers.is_empty() {
            return Ok(());
        }
        if let Err(err) = space.restore_all() {
            self.stats
                .warnings
                .push(format!("restoring code shared with {sharers:?}: {err}"));
        }
        for child in sharers {
            self.family.processes.remove(&child);
            for t in self.family.threads_of(child) {
                self.family.threads.remove(&t);
                // It is running: PTRACE_DETACH needs a stop first.
                detach::detach_running(t);
            }
        }
        Ok(())
    }

    /// A forked child, at its first stop: trace it as its parent was traced.
    fn follow_fork(&mut self, tid: Tid, parent: Tid) -> Result<(), TraceError> {
        let Some(space) = self
            .family
            .processes
            .get(&parent)
            .and_then(|p| p.space.as_ref())
        else {
            return self.release_fork(tid, parent);
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
                        self.note_planted(tid, planted);
                    }
                    Err(again) => {
                        self.stats.warnings.push(format!(
                            "process {tid}: its calls cannot be recorded apart from its parent's ({err}), nor caught by int3 probes ({again}); it is released"
                        ));
                        return self.release_fork(tid, parent);
                    }
                }
            }
            for sig in signals {
                let _ = ptrace::tgkill(tid, tid, sig);
            }
        }
        let now = self.now_ns();
        let modules: Vec<_> = copy.modules.values().cloned().collect();
        let areas = copy.area_ranges();
        self.send(crate::trace_msg::TraceMsg::Trampolines {
            pid: tid as u32,
            areas,
        });
        for module in &modules {
            self.announce_image(tid, module, now);
        }
        self.family
            .processes
            .insert(tid, Process::new(Role::Traced, Some(copy)));
        self.add_thread(tid, tid);
        self.resume(tid, 0)
    }

    /// A forked child not to be traced: put the original bytes back in its
    /// copy of memory, unmap its copies of the trampoline pages, let it go.
    fn release_fork(&mut self, tid: Tid, parent: Tid) -> Result<(), TraceError> {
        let mut deliver = 0;
        let space = self
            .family
            .processes
            .get(&parent)
            .and_then(|p| p.space.as_ref());
        if let Some(space) = space {
            let cleaned = space
                .restore_into(tid)
                .map_err(|e| e.to_string())
                .and_then(|()| space.unmap_areas_in(tid).map_err(|e| e.to_string()));
            match cleaned {
                Ok(signals) => {
                    for (i, sig) in signals.into_iter().enumerate() {
                        if i == 0 {
                            deliver = sig;
                        } else {
                            let _ = ptrace::tgkill(tid, tid, sig);
                        }
                    }
                }
                Err(err) => self
                    .stats
                    .warnings
                    .push(format!("cleaning code in child {tid}: {err}")),
            }
        }
        Ok(ptrace::unless_gone(ptrace::detach(tid, deliver))?)
    }
}
