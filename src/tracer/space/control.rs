//! The control area of a space's jump probes (see
//! `probes::jump::control`), made as the program's seccomp filter allows,
//! and the way back to int3 probes when it cannot be made.
//!
//! A jump probe waits with `futex` when its ring is full: a process whose
//! filter does not allow that gets no jump probes. It could also wake
//! memptrace with `tgkill`, but a filter the program installs later (a
//! sandbox set up after start) could kill it for that, and memptrace reads
//! the rings every 1 ms anyway: every control area turns that wake-up off
//! (`layout::NO_WAKE`). A forked child whose control
//! area cannot be made (its filter refuses `memfd_create`, say) has its
//! parent's jump patches in its copy of the code: they are put back and
//! int3 probes planted on the same functions, before the child runs.

use std::io;

use super::images::LoadedModule;
use super::{How, Int3Why, Planted, Space, SpaceError};
use crate::os::procfs::{self, Mapping};
use crate::os::ptrace::Tid;
use crate::os::seccomp as os_seccomp;
use crate::seccomp;
use crate::tracer::probes::jump::control::Control;
use crate::tracer::probes::{HookKind, Probe};

/// Whether the jump probes of the process of the stopped thread `tid` may
/// wait for room in a full ring: an error when they may not.
pub fn probe_calls(tid: Tid) -> Result<(), SpaceError> {
    Ok(seccomp::check(
        &os_seccomp::filters(tid),
        &seccomp::probe_wait(),
    )?)
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
            self.mem.write_code(hook.addr, &hook.orig)?;
            self.hooks.forget_in(&(hook.addr..hook.addr + 1));
        }
        // From here on the space is one of int3 probes: images mapped later
        // are hooked with them too.
        self.probing.fall_back(why.to_string());
        let maps = procfs::read_maps(self.pid).map_err(io::Error::from)?;
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
                ops: ops.iter().map(|op| op.name()).collect(),
                how: How::Int3(Some(Int3Why::FellBack(why.to_string()))),
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
    ) -> Result<(), SpaceError> {
        probe_calls(tid)?;
        let name = self.name_in_target(tid, signals)?;
        let via = self
            .via()
            .ok_or(SpaceError::NoSyscall("make the shared memory"))?;
        let mut control = Control::create(self.pid, tid, via, name, Some(parent.remote), signals)
            .map_err(SpaceError::Control)?;
        control.copy_tables_from(parent);
        control.maps = parent.maps;
        self.install_control(control);
        Ok(())
    }

    /// Make the control area of the jump probes (once per space).
    pub(super) fn make_control(
        &mut self,
        tid: Tid,
        near: &LoadedModule,
        maps: &[Mapping],
        signals: &mut Vec<i32>,
    ) -> Result<(), SpaceError> {
        probe_calls(tid)?;
        let name = self.room_near(tid, near, maps, 16, signals)?;
        self.mem.write_code(name, b"memptrace\0")?;
        let via = self
            .via()
            .ok_or(SpaceError::NoSyscall("make the shared memory"))?;
        let control = Control::create(self.pid, tid, via, name, None, signals)
            .map_err(SpaceError::Control)?;
        self.install_control(control);
        Ok(())
    }

    /// Make `control` the space's control area: its probes never wake
    /// memptrace with `tgkill` (see `layout::NO_WAKE`) and, where memptrace
    /// attached, give up on it once its heartbeat stops.
    fn install_control(&mut self, mut control: Control) {
        control.forbid_wake();
        self.probing.install_control(control);
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
            .ok_or(SpaceError::NoSlot("the shared memory's name"))?;
        self.mem.write_code(at, b"memptrace\0")?;
        Ok(at)
    }
}
