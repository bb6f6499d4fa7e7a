//! Letting go: stop every thread, put back every byte and return address,
//! detach without injecting a signal. The program runs on as if never traced.
//!
//! Subtleties (`ptrace(2)`): PTRACE_INTERRUPT reports its stop *before* a
//! SIGTRAP that an int3 already queued; detaching then would let that SIGTRAP
//! kill the program. Such a thread is resumed once more so the queued trap is
//! reported and consumed. A thread inside the allocator returns past the
//! stub's int3 to its caller; that call is not recorded. Trampoline pages stay
//! mapped: a thread may be executing a displaced instruction or returning
//! through a stub right now.

use std::collections::{HashMap, HashSet};

use super::trampoline::{DISPLACED, RETURN_INT3};
use super::{Role, TraceError, Tracer};
use crate::os::mem;
use crate::os::ptrace::{self, Stop, Tid};

/// Detach a running thread that memptrace no longer wants: interrupt it, wait
/// for that stop, detach. Other threads' stops stay queued.
pub(super) fn detach_running(tid: Tid) {
    if ptrace::interrupt(tid).is_err() {
        return;
    }
    loop {
        match ptrace::wait_tid(tid) {
            Ok(Some((_, Stop::Exited(_) | Stop::Killed { .. }))) | Err(_) => return,
            Ok(Some((_, Stop::Signal(sig)))) => {
                let _ = ptrace::detach(tid, sig);
                return;
            }
            Ok(Some(_)) => {
                let _ = ptrace::detach(tid, 0);
                return;
            }
            Ok(None) => continue,
        }
    }
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
    pub(super) fn detach_all(&mut self) -> Result<(), TraceError> {
        let mut waiting: HashSet<Tid> = HashSet::new();
        for &tid in self.threads.keys() {
            if ptrace::interrupt(tid).is_ok() {
                waiting.insert(tid);
            }
        }
        let mut deliver: HashMap<Tid, i32> = HashMap::new();
        while !waiting.is_empty() || !self.announced.is_empty() {
            let (tid, stop) = match ptrace::wait_any() {
                Ok(Some(found)) => found,
                Ok(None) => continue,
                Err(err) if ptrace::no_children(&err) => break,
                Err(err) => return Err(err.into()),
            };
            if !self.threads.contains_key(&tid) {
                // A new child: adopt it stopped (threads) or released (forks).
                if let Some(child) = self.announced.remove(&tid) {
                    self.adopt_stopped(tid, child)?;
                } else if !matches!(stop, Stop::Exited(_) | Stop::Killed { .. }) {
                    self.early.insert(tid, stop);
                }
                continue;
            }
            match stop {
                Stop::Exited(_) | Stop::Killed { .. } => {
                    waiting.remove(&tid);
                    self.thread_gone(tid, stop)?;
                }
                Stop::Signal(libc::SIGTRAP) if self.settle_trap(tid)? => {
                    waiting.remove(&tid);
                }
                Stop::Signal(sig) => {
                    deliver.insert(tid, sig);
                    waiting.remove(&tid);
                }
                Stop::Event(event) => {
                    match event {
                        libc::PTRACE_EVENT_CLONE
                        | libc::PTRACE_EVENT_FORK
                        | libc::PTRACE_EVENT_VFORK => self.announce_child(tid, event, true)?,
                        libc::PTRACE_EVENT_EXEC => {
                            // The old code is gone with the old memory.
                            let pid = self.threads[&tid].pid;
                            if let Some(space) =
                                self.processes.get_mut(&pid).and_then(|p| p.space.as_mut())
                            {
                                space.breakpoints.clear();
                            }
                        }
                        _ => {}
                    }
                    waiting.remove(&tid);
                }
                Stop::EventStop(_) | Stop::Syscall => {
                    let pid = self.threads[&tid].pid;
                    if self.at_int3(tid) && sigtrap_pending(pid, tid) {
                        // Let the queued trap be reported, then settle it.
                        ptrace::cont(tid, 0)?;
                    } else {
                        waiting.remove(&tid);
                    }
                }
            }
        }
        self.restore_and_release(deliver)
    }

    /// Put back what was changed, then detach every thread.
    fn restore_and_release(&mut self, deliver: HashMap<Tid, i32>) -> Result<(), TraceError> {
        let pending: Vec<(Tid, Tid, u64, u64)> = self
            .threads
            .iter_mut()
            .filter_map(|(&tid, t)| t.in_call.take().map(|c| (tid, t.pid, c.entry_sp, c.stub)))
            .collect();
        for (tid, pid, sp, stub) in pending {
            // Still inside the allocator: the call returns past the stub's
            // int3 (the trampoline pages stay), straight to the caller.
            self.unhook_return(tid, pid, sp, stub)?;
            self.stats.lost_returns += 1;
        }
        for process in self.processes.values_mut() {
            if process.role == Role::Traced {
                if let Some(space) = process.space.as_mut() {
                    space.restore_all()?;
                }
            }
        }
        let tids: Vec<Tid> = self.threads.keys().copied().collect();
        for tid in tids {
            let sig = deliver.get(&tid).copied().unwrap_or(0);
            match ptrace::detach(tid, sig) {
                Err(err) if err.raw_os_error() == Some(libc::ESRCH) => {}
                other => other?,
            }
        }
        self.threads.clear();
        self.processes.clear();
        Ok(())
    }

    /// Make a call that went through a slot's stub (`trampoline::slot_code`)
    /// return to its caller without the stub's int3 stopping it.
    fn unhook_return(&mut self, tid: Tid, pid: Tid, sp: u64, stub: u64) -> Result<(), TraceError> {
        let past_int3 = stub + RETURN_INT3 + 1;
        let Ok(mut regs) = ptrace::get_regs(tid) else {
            return Ok(()); // gone
        };
        match regs.rip.wrapping_sub(stub) {
            // Not called yet (before or after the `lea`): run the displaced
            // instruction instead, as if the call had never been redirected.
            0 => regs.rip = stub + DISPLACED,
            5 => {
                regs.rsp += 8;
                regs.rip = stub + DISPLACED;
            }
            // Returned, the int3 not executed yet: step over it.
            RETURN_INT3 => regs.rip = past_int3,
            // In the function: its return address is the stub's int3.
            _ => {
                mem::write_data(pid, sp - 16, &past_int3.to_le_bytes())?;
                return Ok(());
            }
        }
        ptrace::set_regs(tid, &regs)?;
        Ok(())
    }

    /// True when the thread is stopped right after one of our int3s.
    fn at_int3(&self, tid: Tid) -> bool {
        let Ok(regs) = ptrace::get_regs(tid) else {
            return false;
        };
        let at = regs.rip.wrapping_sub(1);
        self.space_of(tid)
            .is_some_and(|s| s.is_return(at) || s.breakpoints.contains_key(&at))
    }

    fn space_of(&self, tid: Tid) -> Option<&super::space::Space> {
        let pid = self.threads.get(&tid)?.pid;
        let owner = match self.processes.get(&pid)?.role {
            Role::Shares { parent } => parent,
            _ => pid,
        };
        self.processes.get(&owner)?.space.as_ref()
    }

    /// A thread reported the SIGTRAP of one of our int3s while detaching:
    /// complete a return (recording it) or rewind an entry so the original
    /// instruction runs once the byte is back. False for a foreign SIGTRAP.
    fn settle_trap(&mut self, tid: Tid) -> Result<bool, TraceError> {
        let Ok(mut regs) = ptrace::get_regs(tid) else {
            return Ok(true);
        };
        let at = regs.rip.wrapping_sub(1);
        let Some(space) = self.space_of(tid) else {
            return Ok(false);
        };
        if space.is_return(at) {
            // A call came back through its stub: record it; the thread goes on
            // past the int3 to the caller.
            let pid = self.threads[&tid].pid;
            if let Some(call) = self.returning_call(tid, regs.rsp) {
                let stored = super::calls::stored_block(pid, &call, regs.rax);
                self.record_return(pid, tid, call, regs.rax, stored);
            }
            return Ok(true);
        }
        if space.breakpoints.contains_key(&at) {
            regs.rip = at;
            ptrace::set_regs(tid, &regs)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Adopt a new child during detach: threads stay stopped (to be detached
    /// with the rest), forked children are cleaned and released now.
    pub(super) fn adopt_stopped(
        &mut self,
        tid: Tid,
        child: super::Child,
    ) -> Result<(), TraceError> {
        match child {
            super::Child::Thread { pid } => {
                self.add_thread(tid, pid);
                Ok(())
            }
            super::Child::Shared { parent } => {
                self.processes.insert(
                    tid,
                    super::Process {
                        role: Role::Shares { parent },
                        space: None,
                    },
                );
                self.add_thread(tid, tid);
                Ok(())
            }
            fork => self.adopt(tid, fork),
        }
    }
}
