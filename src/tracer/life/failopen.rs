//! memptrace's death never kills a process it attached to.
//!
//! A launched program is started under memptrace and dies with it
//! (PTRACE_O_EXITKILL). A process memptrace attached to was not: its
//! threads are seized without EXITKILL (and so are the threads and, with
//! `-f`, the children it makes, which the kernel attaches with their
//! parent's options), so a SIGKILL, an OOM kill or a panic of memptrace
//! leaves it running, detached by the kernel. What memptrace left in it
//! must then do no harm: the jump probes fail open (see
//! [`crate::tracer::probes::jump::liveness`]): memptrace keeps a heartbeat in each
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

use crate::os::ptrace::Tid;
use crate::tracer::TraceStats;
use crate::tracer::booking::merge::TscClock;
use crate::tracer::probes::{HookKind, Probe};
use crate::tracer::process::Family;
use crate::tracer::space::Space;
use crate::tracer::target::Target;

/// How long memptrace may go without a heartbeat before the probes of an
/// attached process count it as gone. Its wait loop beats every 100 ms
/// tick; a trace that stalls longer than this (a pipeline that cannot
/// keep up) loses calls, counted in `let_through`.
const ALIVE: Duration = Duration::from_secs(1);

/// The age of a heartbeat, in counter ticks, at which the probes count
/// memptrace as gone: attached (`attached`) with jump probes (a counter
/// `tsc`) only; 0: never.
pub(in crate::tracer) fn alive_ticks(tsc: Option<&TscClock>, attached: bool) -> u64 {
    match (tsc, attached) {
        (Some(clock), true) => clock.ticks_in(ALIVE).max(1),
        _ => 0,
    }
}

impl TraceStats {
    /// Calls the probes let through while memptrace did not answer: a
    /// warning.
    pub(in crate::tracer) fn warn_let_through(&mut self) {
        let n = self.let_through;
        if n > 0 {
            self.warnings.push(format!(
                "{n} calls were not recorded: memptrace did not answer the jump probes for over {} s and they let the calls through",
                ALIVE.as_secs()
            ));
        }
    }
}

impl Space {
    /// What memptrace's death would do to process `pid`, whose space this
    /// is: `None` when it runs on, else which int3s would kill it.
    pub fn int3s_left(&self, pid: Tid) -> Option<String> {
        let mut left: Vec<String> = self
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
                match self.module_at(h.addr) {
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
    /// Give stopped thread `tid` a slot now, where it would otherwise trap
    /// at its first call (attached with jump probes only: `alive_ticks`
    /// not 0): a thread stopped at an int3 when memptrace dies gets the
    /// SIGTRAP, so the probes of an attached process trap as seldom as they
    /// can. Threads stopped by the attach, and each thread at its birth.
    pub fn register_early<T: Target>(&mut self, target: &mut T, tid: Tid, alive_ticks: u64) {
        if alive_ticks == 0 {
            return;
        }
        let (Some(pid), Ok(regs)) = (self.pid_of(tid), target.regs(tid)) else {
            return;
        };
        if !self.is_traced(pid) {
            return;
        }
        let stack = self.stack_range(target, tid, pid, regs.rsp);
        if let Some(control) = self.space_of_mut(tid).and_then(|s| s.control_mut()) {
            control.register(tid, regs.fs_base, stack);
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracer::space::fake::{FakeSpace, PID};

    #[test]
    fn only_an_attach_with_jump_probes_fails_open() {
        let clock = TscClock::calibrate(|| 0);
        assert_eq!(alive_ticks(None, true), 0, "int3 probes");
        assert_eq!(alive_ticks(Some(&clock), false), 0, "launched");
        assert!(alive_ticks(Some(&clock), true) >= 1);
    }

    #[test]
    fn calls_let_through_are_one_warning() {
        let mut stats = TraceStats::default();
        stats.warn_let_through();
        assert!(stats.warnings.is_empty());
        stats.let_through = 3;
        stats.warn_let_through();
        assert_eq!(stats.warnings.len(), 1);
        assert!(stats.warnings[0].starts_with("3 calls were not recorded"));
    }

    #[test]
    fn int3s_left_name_the_first_four_and_count_the_rest() {
        let mut fake = FakeSpace::libc(true);
        assert_eq!(fake.space.int3s_left(PID), None, "nothing planted");
        fake.hook();
        let left = fake.space.int3s_left(PID).expect("int3 probes in libc");
        let (list, tail) = left.split_once(": ").expect("a list");
        assert_eq!(
            tail,
            format!(
                "memptrace's death (SIGKILL, OOM, a crash) would kill process {PID} with SIGTRAP"
            )
        );
        let list = list.strip_prefix("int3 probes at ").expect("the prefix");
        let names: Vec<&str> = list.split(", ").collect();
        assert_eq!(names.len(), 5, "four names and how many more: {list}");
        assert!(names[..4].iter().all(|n| n.starts_with("libc.so.6:")));
        assert!(names[..4].windows(2).all(|w| w[0] < w[1]), "sorted");
        assert!(names[4].ends_with(" more"));
    }
}
