//! The lifecycle of what is traced: threads attached and stopped, children
//! born, forked and exec'd, and everything let go at the detach. It runs
//! over the [`Target`] port, so each step is tested on the fake target.
//!
//! [`Life`] borrows what a lifecycle step touches for one stop: the
//! processes and threads, the stops queued, the events booked, the stats,
//! how the trace is going (`Control`), and the target. It leaves out the
//! heap maps, which are read once the threads are let go.

use std::collections::HashMap;
use std::time::Instant;

use super::booking::Booking;
use super::images::Images;
use super::ledger::CallFacts;
use super::process::{Child, Family, Process, Role};
use super::stop::Stopped;
use super::stopping::{Stopping, Trap};
use super::stops::Stops;
use super::target::Target;
use super::{Control, Ending, TraceError, TraceOptions, TraceStats};
use crate::os::ptrace::{self, Stop, Tid};
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

// forwards (coordinator removes): stopping.rs's steps on this view, until
// they move here from the tracer's methods; the same bodies, with a returning
// call booked at once (no heap walk runs while stopping to detach).
impl<T: Target> Life<'_, T> {
    pub fn settle_stopping(
        &mut self,
        tid: Tid,
        stop: Stop,
        deliver: &mut HashMap<Tid, i32>,
    ) -> Result<bool, TraceError> {
        match Stopped::of(stop) {
            Stopped::Gone => self.thread_gone(tid, stop)?,
            Stopped::Trap if self.family.step_ended(self.target, tid) => {}
            Stopped::Trap if self.settle_trap(tid)? => {}
            Stopped::Fault(_) if self.family.walk_faulted(self.target, tid).is_some() => {
                let to = self
                    .family
                    .walk_faulted(self.target, tid)
                    .unwrap_or_default();
                if let Ok(mut regs) = self.target.regs(tid) {
                    regs.rip = to;
                    let _ = self.target.set_regs(tid, &regs);
                }
                self.stats.walk_faults += 1;
            }
            Stopped::Fault(_) if self.family.copy_faulted(self.target, tid) => {
                self.family.note_copy_fault(self.stats, tid);
            }
            Stopped::Trap => {
                deliver.insert(tid, libc::SIGTRAP);
            }
            Stopped::Fault(sig) | Stopped::Signal(sig) => {
                deliver.insert(tid, sig);
            }
            Stopped::Birth(event) => self.announce_child(tid, event, true)?,
            Stopped::Exec => {
                let pid = self.family.pid_of(tid).unwrap_or(tid);
                if self.family.is_traced(pid) {
                    if let Some(space) = self.family.space_of_mut(tid) {
                        space.hooks.clear();
                    }
                } else {
                    self.family.end_sharing(pid);
                }
            }
            Stopped::Exiting => {}
            Stopped::GroupStop(_) | Stopped::Interrupt => {
                let pid = self.family.pid_of(tid).unwrap_or(tid);
                if self.family.at_int3(self.target, tid) && sigtrap_pending(pid, tid) {
                    self.target.cont(tid, 0)?;
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    pub fn adopt_announced(&mut self, deadline: Instant) -> Result<(), TraceError> {
        while !self.family.announced.is_empty() && Instant::now() < deadline {
            match self.next_stop_while_stopping()? {
                Stopping::NoneLeft => break,
                Stopping::Known(tid, stop) => {
                    self.target.keep_for_later(tid, stop);
                    break;
                }
                _ => {}
            }
        }
        Ok(())
    }

    pub fn next_stop_while_stopping(&mut self) -> Result<Stopping, TraceError> {
        let (tid, stop) = match self.stops.wait(self.target) {
            Ok(Some(found)) => found,
            Ok(None) => return Ok(Stopping::Nothing),
            Err(err) if ptrace::no_children(&err) => return Ok(Stopping::NoneLeft),
            Err(err) => return Err(err.into()),
        };
        if self.family.threads.contains_key(&tid) {
            return Ok(Stopping::Known(tid, stop));
        }
        if let Some(child) = self.family.announced.remove(&tid) {
            self.adopt_stopped(tid, child)?;
            if self.family.threads.contains_key(&tid) {
                return Ok(Stopping::Adopted(tid));
            }
        } else if Stopped::of(stop) != Stopped::Gone {
            self.family.early.insert(tid, stop);
        }
        Ok(Stopping::Nothing)
    }

    fn settle_trap(&mut self, tid: Tid) -> Result<bool, TraceError> {
        let (rsp, rax) = match self.family.rewind_trap(self.target, tid)? {
            Trap::Returned { rsp, rax } => (rsp, rax),
            Trap::Rewound => return Ok(true),
            Trap::Foreign => return Ok(false),
        };
        let pid = self.family.pid_of(tid).unwrap_or(tid);
        self.book.settle_copy(self.family, self.target, tid, true);
        if let Some(call) = self.family.returning_call(self.stats, tid, rsp) {
            let facts = CallFacts {
                pid: pid as u32,
                tid: tid as u32,
                ts_ns: self.book.now_ns(),
                args: call.args,
                ret: rax,
                stored_ptr: super::calls::stored_block_in(self.target, pid, &call, rax),
            };
            let msg = self
                .book
                .completed(call.op, &facts, call.stack, call.module_id);
            self.book.send(msg);
        } else if let Some(map) = self.family.returning_map(tid, rsp) {
            self.book.record_map(pid, tid, map, rax);
        }
        Ok(true)
    }

    pub fn adopt_stopped(&mut self, tid: Tid, child: Child) -> Result<(), TraceError> {
        match child {
            Child::Thread { pid } => {
                self.book.add_thread(self.family, tid, pid);
                Ok(())
            }
            Child::Shared { parent, by } => {
                let mut process = Process::new(Role::Shares { parent }, None);
                process.paused = Some(by);
                self.family.processes.insert(tid, process);
                self.book.add_thread(self.family, tid, tid);
                Ok(())
            }
            fork => self.adopt(tid, fork, Stop::EventStop(libc::SIGTRAP)),
        }
    }
}

fn sigtrap_pending(pid: Tid, tid: Tid) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigPnd:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (libc::SIGTRAP - 1)) != 0)
}
