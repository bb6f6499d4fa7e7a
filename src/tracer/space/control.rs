//! The control area of a space's jump probes (see
//! `probes::jump::control`), made as the program's seccomp filter allows,
//! and the way back to int3 probes when it cannot be made.
//!
//! A jump probe makes two system calls of its own when its ring is full:
//! `tgkill` to wake memptrace (which also polls every 1 ms, so a filter
//! without it only turns the wake-up off) and `futex` to wait (without it
//! the probe cannot wait: no jump probes). A forked child whose control
//! area cannot be made (its filter refuses `memfd_create`, say) has its
//! parent's jump patches in its copy of the code: they are put back and
//! int3 probes planted on the same functions, before the child runs.

use std::io;

use super::images::LoadedModule;
use super::{Planted, Space, SpaceError};
use crate::os::procfs::{self, Mapping};
use crate::os::ptrace::Tid;
use crate::os::seccomp as os_seccomp;
use crate::seccomp;
use crate::tracer::probes::jump::control::Control;
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

    /// Give a forked child (this space, made by [`Space::fork_copy`], its
    /// thread `tid` stopped) a control area of its own at the address of
    /// its parent's, with the parent's tables: its probes, copies of the
    /// parent's, then record into memory the parent does not share.
    pub fn adopt_control(
        &mut self,
        tid: Tid,
        parent: &Control,
        signals: &mut Vec<i32>,
    ) -> Result<(), String> {
        let insn = self.syscall_insn().ok_or("no syscall instruction")?;
        let calls = probe_calls(tid).map_err(|e| e.to_string())?;
        let name = self
            .name_in_target(tid, signals)
            .map_err(|e| e.to_string())?;
        let mut control = Control::create(self.pid, tid, insn, name, Some(parent.remote), signals)
            .map_err(|e| crate::error::with_causes(&e))?;
        control.copy_tables_from(parent);
        if calls.no_wake.is_some() {
            control.forbid_wake();
        }
        if let Some(jump) = self.jump.as_mut() {
            jump.control = Some(control);
        }
        Ok(())
    }

    /// Make the control area of the jump probes (once per space). Returns
    /// why the probes may not wake memptrace, if they may not.
    pub(super) fn make_control(
        &mut self,
        tid: Tid,
        near: &LoadedModule,
        maps: &[Mapping],
        signals: &mut Vec<i32>,
    ) -> Result<Option<String>, SpaceError> {
        if let Some(jump) = self.jump.as_mut() {
            jump.tried = true;
        }
        let calls = probe_calls(tid)?;
        let insn = self
            .syscall_insn()
            .ok_or_else(|| SpaceError::NoRoom("no syscall instruction".into()))?;
        let name = self.room_near(tid, near, maps, 16, signals)?;
        self.mem.write(name, b"memptrace\0")?;
        let mut control = Control::create(self.pid, tid, insn, name, None, signals)
            .map_err(|e| io::Error::other(crate::error::with_causes(&e)))?;
        if calls.no_wake.is_some() {
            control.forbid_wake();
        }
        if let Some(jump) = self.jump.as_mut() {
            jump.control = Some(control);
        }
        Ok(calls.no_wake.map(|r| r.to_string()))
    }

    /// A NUL-terminated name in the target's memory, for `memfd_create`.
    pub(super) fn name_in_target(
        &mut self,
        _tid: Tid,
        _signals: &mut Vec<i32>,
    ) -> Result<u64, SpaceError> {
        let at = self
            .areas
            .take_anywhere(16)
            .ok_or_else(|| SpaceError::NoRoom("no room for a name".into()))?;
        self.mem.write(at, b"memptrace\0")?;
        Ok(at)
    }
}
