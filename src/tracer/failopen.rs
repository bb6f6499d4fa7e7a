//! memptrace's death never kills a process it attached to.
//!
//! A launched program is started under memptrace and dies with it
//! (PTRACE_O_EXITKILL). A process memptrace attached to was not: its
//! threads are seized without EXITKILL (and so are the threads and, with
//! `-f`, the children it makes, which the kernel attaches with their
//! parent's options), so a SIGKILL, an OOM kill or a panic of memptrace
//! leaves it running, detached by the kernel. What memptrace left in it
//! must then do no harm: the jump probes fail open (see
//! [`super::probes::jump::liveness`]): memptrace keeps a heartbeat in each
//! control area, fresh at every tick of the wait loop and whenever a thread
//! runs again, and sets the area's `GONE` word when it lets go of it.
//!
//! An int3 is fatal without a tracer (SIGTRAP). In attach mode with jump
//! probes, mapping calls (mmap, munmap, ...) get jump probes too, recorded
//! into the rings like allocator calls (a mapping function too short for a
//! jump is not hooked at all, and `meta` says so), and the dynamic linker's
//! `_dl_debug_state` is hooked by a jump to a gate that traps only while
//! memptrace is alive. Where an int3 stays anyway (int3 probes, an
//! allocator function too short for a jump), the attach says so on stderr
//! and in `meta` (`on_memptrace_death`).

use std::time::Duration;

use super::Tracer;
use super::probes::{HookKind, Probe};
use super::process::Family;
use crate::os::ptrace::{self, Tid};

/// How long memptrace may go without a heartbeat before the probes of an
/// attached process count it as gone. Its wait loop beats every 100 ms
/// tick; a trace that stalls longer than this (a pipeline that cannot
/// keep up) loses calls, counted in `let_through`.
const ALIVE: Duration = Duration::from_secs(1);

impl Tracer {
    /// The age of a heartbeat, in counter ticks, at which the probes count
    /// memptrace as gone: attach with jump probes only (0: never).
    pub(super) fn alive_ticks(&self) -> u64 {
        match (&self.book.tsc, self.control.attached) {
            (Some(clock), true) => clock.ticks_in(ALIVE).max(1),
            _ => 0,
        }
    }

    /// Give stopped thread `tid` a slot now, where it would otherwise trap
    /// at its first call (attached with jump probes only): a thread
    /// stopped at an int3 when memptrace dies gets the SIGTRAP, so the
    /// probes of an attached process trap as seldom as they can. Threads
    /// stopped by the attach, and each thread at its birth.
    pub(super) fn register_early(&mut self, tid: Tid) {
        if self.alive_ticks() == 0 {
            return;
        }
        let (Some(pid), Ok(regs)) = (self.family.pid_of(tid), ptrace::get_regs(tid)) else {
            return;
        };
        if !self.family.is_traced(pid) {
            return;
        }
        let stack = self.stack_range(tid, pid, regs.rsp);
        if let Some(control) = self.family.space_of_mut(tid).and_then(|s| s.control_mut()) {
            control.register(tid, regs.fs_base, stack);
        }
    }

    /// Calls the probes let through while memptrace did not answer: a
    /// warning.
    pub(super) fn warn_let_through(&mut self) {
        let n = self.stats.let_through;
        if n > 0 {
            self.stats.warnings.push(format!(
                "{n} calls were not recorded: memptrace did not answer the jump probes for over {} s and they let the calls through",
                ALIVE.as_secs()
            ));
        }
    }

    /// What memptrace's death would do to process `pid` now: `None` when it
    /// runs on, else which int3s would kill it.
    pub fn int3s_left(&self, pid: Tid) -> Option<String> {
        let space = self.family.processes.get(&pid)?.space.as_ref()?;
        let mut left: Vec<String> = space
            .hooks
            .iter()
            .filter(|h| {
                matches!(
                    h.probe,
                    Probe::Int3 { .. } | Probe::Jump { via_int3: true, .. }
                )
            })
            .map(|h| {
                let what = match &h.kind {
                    HookKind::Allocator { ops, .. } => {
                        ops.iter().map(|op| op.name()).collect::<Vec<_>>().join("/")
                    }
                    HookKind::Mapping { op } => op.name().to_string(),
                    HookKind::DebugState => "_dl_debug_state".to_string(),
                };
                match space.module_at(h.addr) {
                    Some(m) => format!("{}:{what}", short(&m.path)),
                    None => what,
                }
            })
            .collect();
        if left.is_empty() {
            return None;
        }
        left.sort();
        left.dedup();
        // One line: the first few, and how many more.
        const SHOWN: usize = 4;
        let more = left.len().saturating_sub(SHOWN);
        left.truncate(SHOWN);
        if more > 0 {
            left.push(format!("{more} more"));
        }
        Some(format!(
            "int3 probes at {}: memptrace's death (SIGKILL, OOM, a crash) would kill process {pid} with SIGTRAP",
            left.join(", ")
        ))
    }
}

impl Family {
    /// memptrace is here: a fresh heartbeat in every control area.
    pub fn beat(&self) {
        for process in self.processes.values() {
            if let Some(control) = process.space.as_ref().and_then(|s| s.control()) {
                control.beat();
            }
        }
    }
}

/// The file name of an image's path.
fn short(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}
