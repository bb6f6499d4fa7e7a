//! The lifecycle of what is traced: threads attached and stopped, children
//! born, forked and exec'd, and everything let go at the detach. It runs
//! over the [`Target`] port, so each step is tested on the fake target.
//!
//! [`Life`] borrows what a lifecycle step touches for one stop: the
//! processes and threads, the stops queued, the events booked, the stats,
//! how the trace is going (`Control`), and the target. It leaves out the
//! heap maps, which are read once the threads are let go.

use super::booking::Booking;
use super::failopen;
use super::images::Images;
use super::process::{Child, Family, Process, Role, Thread};
use super::stops::Stops;
use super::target::Target;
use super::{Control, Ending, TraceError, TraceOptions, TraceStats};
use crate::os::ptrace::{Stop, Tid};
use crate::trace_msg::TraceMsg;

/// The parts a lifecycle step concerns, borrowed for one step.
pub(super) struct Life<'a, T: Target> {
    pub opts: &'a TraceOptions,
    pub family: &'a mut Family,
    pub stops: &'a mut Stops,
    pub book: &'a mut Booking,
    pub stats: &'a mut TraceStats,
    pub control: &'a mut Control,
    pub target: &'a mut T,
}

impl<T: Target> Life<'_, T> {
    /// The parts images concern (see [`super::images`]).
    pub fn images(&mut self) -> Images<'_> {
        Images {
            opts: self.opts,
            family: self.family,
            book: self.book,
            stats: self.stats,
        }
    }

    /// The age of a heartbeat at which the probes count memptrace as gone
    /// (see [`super::failopen`]).
    pub fn alive_ticks(&self) -> u64 {
        failopen::alive_ticks(self.book.tsc.as_ref(), self.control.attached)
    }

    /// Thread `tid` is gone (`stop`: how it ended). When it is a process's
    /// leader, the process is: its calls are drained, its probes counted,
    /// its blocks forgotten and the memory it shared released; when it is
    /// the root, the trace ends as it did.
    pub fn thread_gone(&mut self, tid: Tid, stop: Stop) -> Result<(), TraceError> {
        self.book.settle_copy(self.family, self.target, tid, false);
        self.stops.forget(tid);
        if let Some(b) = self.family.space_of_mut(tid).and_then(|s| s.buffers_mut()) {
            b.release(tid);
        }
        if self.family.pid_of(tid) == Some(tid) {
            self.family.end_sharing(tid);
        }
        let Some(mut thread) = self.family.threads.remove(&tid) else {
            return Ok(());
        };
        if let Some(lu) = self
            .family
            .processes
            .get_mut(&thread.pid)
            .and_then(|p| p.libunwind.as_mut())
        {
            lu.forget_thread(tid);
        }
        self.stats.lost_returns += thread.take_calls().len() as u64;
        if tid != thread.pid {
            return Ok(());
        }
        // The leader's exit is reported last: the whole process is gone.
        self.images().warn_if_unhooked(tid);
        self.book.drain_process(self.family, self.stats, tid, true);
        self.stats.count_probes(self.family, tid);
        for t in self.family.threads_of(tid) {
            self.book.settle_copy(self.family, self.target, t, false);
            self.family.threads.remove(&t);
        }
        if let Some(process) = self.family.processes.remove(&tid) {
            if process.recorded() {
                self.book.send(TraceMsg::ProcessGone { pid: tid as u32 });
                let _ = self.book.ledger.forget_process(tid as u32);
            }
            if let Some(space) = process.space {
                self.family
                    .release_sharers(self.target, tid, space, &mut self.stats.warnings);
            }
        }
        if tid == self.control.root {
            self.control.ending = Some(match stop {
                Stop::Killed { sig, core } => Ending::Killed { sig, core },
                Stop::Exited(code) => Ending::Exited(code),
                _ => Ending::Exited(0),
            });
        }
        Ok(())
    }
}

// forwards (coordinator removes): children.rs's `announce_child` and
// `adopt` (with `follow_fork` and `let_fork_go`) as they are on `Tracer`,
// until the other branch's `Life` versions replace them.
impl<T: Target> Life<'_, T> {
    pub fn announce_child(
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
            _ => Child::Shared {
                parent: pid,
                by: tid,
            },
        };
        if let Child::Shared { by, .. } = kind {
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

    pub fn adopt(&mut self, tid: Tid, child: Child, first: Stop) -> Result<(), TraceError> {
        match child {
            Child::Thread { pid } => {
                self.book.add_thread(self.family, tid, pid);
                let alive_ticks = self.alive_ticks();
                self.family.register_early(self.target, tid, alive_ticks);
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

    fn follow_fork(&mut self, tid: Tid, parent: Tid) -> Result<(), TraceError> {
        let Some(space) = self.family.space(parent) else {
            return self.let_fork_go(tid, parent);
        };
        let mut copy = space.fork_copy(tid, &mut self.book.next_module_id)?;
        if let Some(control) = space.control() {
            let mut signals = Vec::new();
            if let Err(err) = copy.adopt_control(tid, control, &mut signals) {
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
        self.book.send(crate::trace_msg::TraceMsg::Trampolines {
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

    fn let_fork_go(&mut self, tid: Tid, parent: Tid) -> Result<(), TraceError> {
        let warnings = &mut self.stats.warnings;
        Ok(self
            .family
            .release_fork(self.target, tid, parent, warnings)?)
    }
}
