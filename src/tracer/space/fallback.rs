//! What a space's jump probes may do under the program's seccomp filter,
//! and the way back to int3 probes when they cannot record at all.
//!
//! A jump probe makes two system calls of its own when its ring is full:
//! `tgkill` to wake memptrace (which also polls every 1 ms, so a filter
//! without it only turns the wake-up off) and `futex` to wait (without it
//! the probe cannot wait: no jump probes). A forked child whose control
//! area cannot be made (its filter refuses `memfd_create`, say) has its
//! parent's jump patches in its copy of the code: they are put back and
//! int3 probes planted on the same functions, before the child runs.

use super::{Planted, Space, SpaceError};
use crate::os::ptrace::Tid;
use crate::os::{procfs, seccomp as os_seccomp};
use crate::seccomp;
use crate::tracer::probes::{HookKind, Probe};

/// What the jump probes of a process may call.
pub struct ProbeCalls {
    /// Why the probes may not wake memptrace, if they may not.
    pub no_wake: Option<seccomp::Refusal>,
}

/// Whether the jump probes of the process of the stopped thread `tid` may
/// make their calls: an error when they may not wait (no jump probes).
pub fn probe_calls(tid: Tid) -> Result<ProbeCalls, SpaceError> {
    let filters = os_seccomp::filters(tid);
    seccomp::check(&filters, &seccomp::probe_wait())?;
    let wake = seccomp::probe_wake(std::process::id(), crate::os::local::thread_id() as u32);
    Ok(ProbeCalls {
        no_wake: seccomp::check(&filters, &wake).err(),
    })
}

impl Space {
    /// Catch the calls of this space (a forked child's, its thread `tid`
    /// stopped) with int3 probes instead of the jump probes it inherited:
    /// each jump patch is put back and an int3 planted on its function.
    /// `why`: what kept the jump probes from recording, for `meta`.
    pub fn jumps_to_int3(
        &mut self,
        tid: Tid,
        why: &str,
        signals: &mut Vec<i32>,
    ) -> Result<Vec<Planted>, SpaceError> {
        let jumps: Vec<_> = self
            .hooks
            .iter()
            .filter(|h| matches!(h.probe, Probe::Jump { .. }))
            .cloned()
            .collect();
        for hook in &jumps {
            self.mem.write(hook.addr, &hook.orig)?;
            self.hooks.forget_in(&(hook.addr..hook.addr + 1));
        }
        // From here on the space is one of int3 probes: images mapped later
        // are hooked with them too.
        self.jump = None;
        self.fallback = Some(why.to_string());
        let maps = procfs::read_maps(self.pid)?;
        let mut planted = Vec::new();
        for hook in jumps {
            let HookKind::Allocator { ref ops, .. } = hook.kind else {
                continue;
            };
            let Some(module) = self.module_at(hook.addr).cloned() else {
                continue;
            };
            self.plant_int3(tid, &module, &maps, hook.addr, hook.kind.clone(), signals)?;
            planted.push(Planted {
                module: module.path.clone(),
                ops: ops.clone(),
                how: format!("int3: {why}"),
            });
        }
        Ok(planted)
    }
}
