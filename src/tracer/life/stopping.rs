//! Stopping every thread, to detach or to attach: the next stop of a known
//! thread, a child born meanwhile adopted, each stop settled (a trap of
//! memptrace's completed or rewound, a signal kept to be delivered).

use std::collections::HashMap;
use std::time::Instant;

use crate::os::ptrace::{self, Stop, Tid};
use crate::tracer::TraceError;
use crate::tracer::life::Life;
use crate::tracer::process::{Child, Family, Process, Role};
use crate::tracer::serve::calls::stored_block_in;
use crate::tracer::stop::Stopped;
use crate::tracer::target::Target;

/// What [`Life::next_stop_while_stopping`] found.
pub(in crate::tracer) enum Stopping {
    /// A stop of a thread already known.
    Known(Tid, Stop),
    /// A new thread, adopted and left stopped.
    Adopted(Tid),
    /// Nothing to act on (an interrupted wait, a stop kept for later).
    Nothing,
    /// No traced thread is left.
    NoneLeft,
}

/// What a SIGTRAP at one of memptrace's int3s was, while stopping.
pub(in crate::tracer) enum Trap {
    /// A call came back through its stub's return int3, with this stack
    /// pointer and return value: to be recorded; the thread goes on to its
    /// caller.
    Returned { rsp: u64, rax: u64 },
    /// An entry's int3, or a jump probe's miss: the thread was moved back
    /// to the entry, to run the original instruction once the byte is back
    /// (or the thread is gone, and there is nothing to settle).
    Rewound,
    /// Not one of memptrace's: the program's own SIGTRAP.
    Foreign,
}

impl Family {
    /// True when the thread is stopped right after one of our int3s (an
    /// entry, a stub's return, or a jump probe's miss).
    pub fn at_int3<T: Target>(&self, target: &mut T, tid: Tid) -> bool {
        let Ok(regs) = target.regs(tid) else {
            return false;
        };
        let at = regs.rip.wrapping_sub(1);
        self.space_of(tid).is_some_and(|s| {
            s.hooks.is_return(at) || s.hooks.contains(at) || s.hooks.missed(at).is_some()
        })
    }

    /// A thread that reported a SIGTRAP while stopping: which of our int3s
    /// it hit, rewinding it to the entry when the call has not begun.
    pub fn rewind_trap<T: Target>(&self, target: &mut T, tid: Tid) -> std::io::Result<Trap> {
        let Ok(mut regs) = target.regs(tid) else {
            return Ok(Trap::Rewound);
        };
        let at = regs.rip.wrapping_sub(1);
        let Some(space) = self.space_of(tid) else {
            return Ok(Trap::Foreign);
        };
        if space.hooks.is_return(at) {
            return Ok(Trap::Returned {
                rsp: regs.rsp,
                rax: regs.rax,
            });
        }
        if space.hooks.contains(at) {
            regs.rip = at;
        } else if let Some(hook) = space.hooks.missed(at) {
            // A jump probe's thread without a slot: its call has not begun;
            // it begins again at the restored entry.
            regs.rip = hook.addr;
        } else {
            return Ok(Trap::Foreign);
        }
        target.set_regs(tid, &regs)?;
        Ok(Trap::Rewound)
    }
}

impl<T: Target> Life<'_, T> {
    /// While detaching, a stop of the known thread `tid`: settle it (a trap
    /// of ours completed or rewound, a signal kept for `deliver`, a child
    /// announced). True when the thread is stopped for good, to be
    /// detached; false when it was resumed to report a queued trap.
    pub fn settle_stopping(
        &mut self,
        tid: Tid,
        stop: Stop,
        deliver: &mut HashMap<Tid, i32>,
    ) -> Result<bool, TraceError> {
        match Stopped::of(stop) {
            Stopped::Gone => self.thread_gone(tid, stop)?,
            // The end of a step into a signal handler: the thread is at
            // its first instruction, and is detached there.
            Stopped::Trap if self.family.step_ended(self.target, tid) => {}
            Stopped::Trap if self.settle_trap(tid)? => {}
            Stopped::Fault(_) if self.family.walk_faulted(self.target, tid).is_some() => {
                // A probe's stack walk faulted: the thread leaves the probe
                // with the others; the program never sees it.
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
                // The copy routine's own fault: the copy is read with the
                // others, the thread leaves the routine with the others, and
                // the program never sees the signal.
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
                // The old code is gone with the old memory, if the memory was
                // the process's own: a vfork child that execs leaves its
                // parent's memory, and the probes in it, as they are.
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
            Stopped::GroupStop(_) | Stopped::Interrupt | Stopped::VforkDone => {
                // The stop came before a trap of memptrace's that is queued
                // already: an int3 just hit, or the end of a step into a
                // signal (the kernel reports the interrupt first if it
                // lands between the step's debug exception and the trap's
                // delivery). Detached now, the thread would die of it.
                let pid = self.family.pid_of(tid).unwrap_or(tid);
                let stepping = self.family.threads.get(&tid).is_some_and(|t| t.stepping);
                if (stepping || self.family.at_int3(self.target, tid))
                    && self.target.signal_pending(pid, tid, libc::SIGTRAP)
                {
                    // Let the queued trap be reported, then settle it.
                    self.target.cont(tid, 0)?;
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Adopt, until `deadline`, the children announced while stopping
    /// (their first stop may not have come yet).
    pub fn adopt_announced(&mut self, deadline: Instant) -> Result<(), TraceError> {
        while !self.family.announced.is_empty() && Instant::now() < deadline {
            match self.next_stop_while_stopping()? {
                Stopping::NoneLeft => break,
                Stopping::Known(tid, stop) => {
                    // A known thread's stop is not this loop's: kept.
                    self.target.keep_for_later(tid, stop);
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

    /// A thread reported the SIGTRAP of one of our int3s while detaching:
    /// complete a return (recording it) or rewind an entry so the original
    /// instruction runs once the byte is back. False for a foreign SIGTRAP.
    fn settle_trap(&mut self, tid: Tid) -> Result<bool, TraceError> {
        let (rsp, rax) = match self.family.rewind_trap(self.target, tid)? {
            Trap::Returned { rsp, rax } => (rsp, rax),
            Trap::Rewound => return Ok(true),
            Trap::Foreign => return Ok(false),
        };
        // A call came back through its stub: record it; the thread goes on
        // past the int3 to the caller.
        let pid = self.family.pid_of(tid).unwrap_or(tid);
        self.book.settle_copy(self.family, self.target, tid, true);
        if let Some(call) = self.family.returning_call(self.stats, tid, rsp) {
            let stored = stored_block_in(self.target, pid, &call, rax);
            self.book.record_return(pid, tid, call, rax, stored);
        } else if let Some(map) = self.family.returning_map(tid, rsp) {
            self.book.record_map(pid, tid, map, rax);
        }
        Ok(true)
    }

    /// Adopt a new child while stopping: threads stay stopped (to be
    /// detached, or resumed by the attach, with the rest), forked children
    /// are cleaned and released now.
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

#[cfg(test)]
#[path = "stopping_tests.rs"]
mod tests;
