//! Stopping every thread, to detach or to attach: the next stop of a known
//! thread, a child born meanwhile adopted, each stop settled (a trap of
//! memptrace's completed or rewound, a signal kept to be delivered).

use std::collections::HashMap;
use std::time::Instant;

use super::process::{Child, Process, Role};
use super::stop::Stopped;
use super::{TraceError, Tracer};
use crate::os::ptrace::{self, Stop, Tid};

/// What [`Tracer::next_stop_while_stopping`] found.
pub(super) enum Stopping {
    /// A stop of a thread already known.
    Known(Tid, Stop),
    /// A new thread, adopted and left stopped.
    Adopted(Tid),
    /// Nothing to act on (an interrupted wait, a stop kept for later).
    Nothing,
    /// No traced thread is left.
    NoneLeft,
}

/// True when the thread has a SIGTRAP pending (`SigPnd` of its status file).
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

impl Tracer {
    /// While detaching, a stop of the known thread `tid`: settle it (a trap
    /// of ours completed or rewound, a signal kept for `deliver`, a child
    /// announced). True when the thread is stopped for good, to be
    /// detached; false when it was resumed to report a queued trap.
    pub(super) fn settle_stopping(
        &mut self,
        tid: Tid,
        stop: Stop,
        deliver: &mut HashMap<Tid, i32>,
    ) -> Result<bool, TraceError> {
        match Stopped::of(stop) {
            Stopped::Gone => self.thread_gone(tid, stop)?,
            // The end of a step into a signal handler: the thread is at
            // its first instruction, and is detached there.
            Stopped::Trap if self.family.step_ended(&mut self.target, tid) => {}
            Stopped::Trap if self.settle_trap(tid)? => {}
            Stopped::Fault(_) if self.walk_faulted(tid).is_some() => {
                // A probe's stack walk faulted: the thread leaves the probe
                // with the others; the program never sees it.
                let to = self.walk_faulted(tid).unwrap_or_default();
                if let Ok(mut regs) = ptrace::get_regs(tid) {
                    regs.rip = to;
                    let _ = ptrace::set_regs(tid, &regs);
                }
                self.stats.walk_faults += 1;
            }
            Stopped::Fault(_) if self.copy_faulted(tid) => {
                // The copy routine's own fault: the copy is read with the
                // others, the thread leaves the routine with the others, and
                // the program never sees the signal.
                self.note_copy_fault(tid);
            }
            Stopped::Trap => {
                deliver.insert(tid, libc::SIGTRAP);
            }
            Stopped::Fault(sig) | Stopped::Signal(sig) => {
                deliver.insert(tid, sig);
            }
            Stopped::Birth(event) => self.announce_child(tid, event, true)?,
            Stopped::Exec => {
                // The old code is gone with the old memory, if the memory was
                // the process's own: a vfork child that execs leaves its
                // parent's memory, and the probes in it, as they are.
                let pid = self.family.pid_of(tid).unwrap_or(tid);
                if self.family.is_traced(pid) {
                    if let Some(space) = self.family.space_of_mut(tid) {
                        space.hooks.clear();
                    }
                } else {
                    self.end_sharing(pid);
                }
            }
            Stopped::Exiting => {}
            Stopped::GroupStop(_) | Stopped::Interrupt => {
                let pid = self.family.pid_of(tid).unwrap_or(tid);
                if self.at_int3(tid) && sigtrap_pending(pid, tid) {
                    // Let the queued trap be reported, then settle it.
                    ptrace::cont(tid, 0)?;
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Adopt, until `deadline`, the children announced while stopping
    /// (their first stop may not have come yet).
    pub(super) fn adopt_announced(&mut self, deadline: Instant) -> Result<(), TraceError> {
        while !self.family.announced.is_empty() && Instant::now() < deadline {
            match self.next_stop_while_stopping()? {
                Stopping::NoneLeft => break,
                Stopping::Known(tid, stop) => {
                    // A known thread's stop is not this loop's: kept.
                    ptrace::keep_for_later(tid, stop);
                    break;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// While stopping every thread (to attach or detach): the next stop of a
    /// known thread. A thread born meanwhile is adopted without being
    /// resumed (a forked child is cleaned and released); the first stop of
    /// one whose birth is not announced yet is kept for when it is.
    pub(super) fn next_stop_while_stopping(&mut self) -> Result<Stopping, TraceError> {
        let (tid, stop) = match self.stops.wait() {
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

    /// True when the thread is stopped right after one of our int3s (an
    /// entry, a stub's return, or a jump probe's miss).
    fn at_int3(&self, tid: Tid) -> bool {
        let Ok(regs) = ptrace::get_regs(tid) else {
            return false;
        };
        let at = regs.rip.wrapping_sub(1);
        self.family.space_of(tid).is_some_and(|s| {
            s.hooks.is_return(at) || s.hooks.contains(at) || s.hooks.missed(at).is_some()
        })
    }

    /// A thread reported the SIGTRAP of one of our int3s while detaching:
    /// complete a return (recording it) or rewind an entry so the original
    /// instruction runs once the byte is back. False for a foreign SIGTRAP.
    fn settle_trap(&mut self, tid: Tid) -> Result<bool, TraceError> {
        let Ok(mut regs) = ptrace::get_regs(tid) else {
            return Ok(true);
        };
        let at = regs.rip.wrapping_sub(1);
        let Some(space) = self.family.space_of(tid) else {
            return Ok(false);
        };
        if space.hooks.is_return(at) {
            // A call came back through its stub: record it; the thread goes on
            // past the int3 to the caller.
            let pid = self.family.pid_of(tid).unwrap_or(tid);
            self.settle_copy(tid, true);
            if let Some(call) = self.returning_call(tid, regs.rsp) {
                let stored = super::calls::stored_block(pid, &call, regs.rax);
                self.record_return(pid, tid, call, regs.rax, stored);
            } else if let Some(map) = self.family.returning_map(tid, regs.rsp) {
                self.book.record_map(pid, tid, map, regs.rax);
            }
            return Ok(true);
        }
        if space.hooks.contains(at) {
            regs.rip = at;
            ptrace::set_regs(tid, &regs)?;
            return Ok(true);
        }
        if let Some(hook) = space.hooks.missed(at) {
            // A jump probe's thread without a slot: its call has not begun;
            // it begins again at the restored entry.
            regs.rip = hook.addr;
            ptrace::set_regs(tid, &regs)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Adopt a new child during detach: threads stay stopped (to be detached
    /// with the rest), forked children are cleaned and released now.
    pub(super) fn adopt_stopped(&mut self, tid: Tid, child: Child) -> Result<(), TraceError> {
        match child {
            Child::Thread { pid } => {
                self.add_thread(tid, pid);
                Ok(())
            }
            Child::Shared { parent, by } => {
                let mut process = Process::new(Role::Shares { parent }, None);
                process.paused = Some(by);
                self.family.processes.insert(tid, process);
                self.add_thread(tid, tid);
                Ok(())
            }
            fork => self.adopt(tid, fork, Stop::EventStop(libc::SIGTRAP)),
        }
    }
}
