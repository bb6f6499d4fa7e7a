//! The dynamic linker's `_dl_debug_state` in a process memptrace attached
//! to: memptrace must stop there to see images come and go, but an int3
//! would kill the process once memptrace is gone (see `tracer::failopen`).
//! Where a jump fits, the entry jumps to a gate that stops only while
//! memptrace is alive ([`liveness::gate`]); elsewhere it keeps its int3.

use super::images::LoadedModule;
use super::{Space, SpaceError};
use crate::os::procfs::Mapping;
use crate::os::ptrace::Tid;
use crate::tracer::probes::jump::{liveness, plan};
use crate::tracer::probes::{Hook, HookKind, Probe};

impl Space {
    /// Hook `_dl_debug_state` at `addr` with a gate that reads the control
    /// area at `remote`; false when no jump fits (the caller plants an
    /// int3).
    pub(super) fn plant_gate(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        addr: u64,
        remote: u64,
        signals: &mut Vec<i32>,
    ) -> Result<bool, SpaceError> {
        let mut code = vec![0u8; 64.min(module.range.end.saturating_sub(addr)) as usize];
        let n = self.mem.read(addr, &mut code)?;
        code.truncate(n);
        let plan = match plan::plan(&code, addr) {
            p if p.is_jump() => p,
            _ => match plan::over_padding(&code, addr) {
                Some(p) => p,
                None => return Ok(false),
            },
        };
        let near = module.range.start.saturating_sub(super::areas::AREA_SIZE);
        let size = liveness::gate(remote, &plan.displaced, plan.resume, near)?
            .bytes
            .len() as u64;
        let room = (size + 32).next_multiple_of(16);
        let at = self.room_near(tid, module, maps, room, signals)?;
        let gate = liveness::gate(remote, &plan.displaced, plan.resume, at)?;
        if gate.bytes.len() as u64 > room {
            return Err(SpaceError::Grew {
                module: module.path.clone(),
                what: "gate",
            });
        }
        let mut orig = vec![0u8; plan::JUMP_LEN as usize];
        self.mem.read_exact(plan.at, &mut orig)?;
        // The gate first, then the jump to it.
        self.mem.write_code(at, &gate.bytes)?;
        let hook = Hook {
            addr: plan.at,
            orig,
            probe: Probe::Jump {
                code: gate,
                via_int3: false,
            },
            kind: HookKind::DebugState,
        };
        self.plant_hook(hook)?;
        Ok(true)
    }
}
