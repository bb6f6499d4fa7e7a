//! Hooking an image of a space: a jump probe, an int3 probe or (attached
//! with jump probes) a gate on each function memptrace must see, the code
//! each runs through placed in a trampoline area within reach of it, and
//! the stack buffers' copy routine. Each probe's code is written before the
//! patch that leads to it: a thread never reaches a patch whose code is not
//! ready. Which probe a function gets depends on the space's probe mode
//! ([`super::probing`]).

use std::io;

use super::areas::{self, AREA_SIZE, JUMP_AREA_SIZE};
use super::buffers::{self, BUFFER_STRIDE, BUFFERS, StackBuffers};
use super::images::LoadedModule;
use super::probing::{NextJump, ProbeInfo};
use super::{Changes, How, Int3Why, Planted, Space, SpaceError, Unhooked};
use crate::addr::Svma;
use crate::os::procfs::{self, Mapping};
use crate::os::ptrace::Tid;
use crate::symbols::elf::ElfImage;
use crate::tracer::inject;
use crate::tracer::probes::int3::{self, DISPLACED, INT3, SLOT_SIZE};
use crate::tracer::probes::jump::code as probe_code;
use crate::tracer::probes::jump::layout::Called;
use crate::tracer::probes::jump::plan;
use crate::tracer::probes::{Hook, HookKind, Probe};
use crate::unwind::tables::UnwindTable;

/// `image` was built with unwind tables, and they cover its allocator
/// functions (their code, where an entry only jumps to it): a jump probe's
/// walk from a mapping call the allocator makes inside them (arena growth,
/// a large block) leaves them, to the allocator call and the program, as
/// an int3 probe's unwinder does. musl's `libc.a` has no unwind tables
/// (memptrace describes some of its functions, `symbols::height`): a walk
/// inside the target stopped in its allocator's helpers, where the int3
/// probe's unwinder, on a copy of the stack, finds the rest.
pub(super) fn allocator_walkable(image: &ElfImage, table: &UnwindTable) -> bool {
    let entries = image.allocators.iter().map(|a| a.svma.0);
    let bodies = image.allocator_bodies.iter().map(|(range, _)| range.start);
    !image.lacks_cfi() && entries.chain(bodies).all(|at| table.covers(at))
}

impl Space {
    /// Hook what memptrace must see in `module`, a new image of this space:
    /// its allocator functions, its mapping functions and the dynamic
    /// linker's `_dl_debug_state`, each with the probe the space's mode
    /// gives it; what was planted goes into `changes`. `walkable`: a jump
    /// probe's walk leaves the image's allocator functions (see
    /// [`allocator_walkable`]), so its mapping functions may have jump
    /// probes in a launch too.
    pub(super) fn hook(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        walkable: bool,
        changes: &mut Changes,
    ) -> Result<(), SpaceError> {
        let mut targets: Vec<(u64, HookKind)> = module
            .image
            .allocator_avmas(module.bias)
            .map(|(avma, entry)| {
                (
                    avma.0,
                    HookKind::Allocator {
                        module_id: module.id,
                        ops: entry.ops.clone(),
                    },
                )
            })
            .collect();
        for (&svma, &op) in &module.image.mappings {
            targets.push((module.bias.to_avma(Svma(svma)).0, HookKind::Mapping { op }));
        }
        if let Some(svma) = module.image.debug_state {
            targets.push((module.bias.to_avma(svma).0, HookKind::DebugState));
        }
        let signals = &mut changes.signals;
        for (addr, kind) in targets {
            if self.hooks.contains(addr) {
                continue;
            }
            // Jump probes record only once the control area is made.
            match (kind, self.probing.next_jump()) {
                // Launched, a mapping function may be called before TLS is
                // set up (a static glibc's start maps memory when brk
                // fails), where only `rdfsbase` finds the slot safely.
                (HookKind::Mapping { op }, Some(next))
                    if next.fail_open || (walkable && next.reads_fs_base()) =>
                {
                    let kind = HookKind::Mapping { op };
                    let how = self.plant_jump(tid, module, maps, addr, kind, next, signals)?;
                    changes.planted.push(Planted {
                        module: module.path.clone(),
                        ops: vec![op.name()],
                        how,
                    });
                }
                (HookKind::DebugState, Some(next))
                    if next.fail_open
                        && self.plant_gate(tid, module, maps, addr, next.control, signals)? => {}
                (HookKind::Allocator { module_id, ops }, Some(next)) => {
                    let names = ops.iter().map(|op| op.name()).collect();
                    let kind = HookKind::Allocator { module_id, ops };
                    let how = self.plant_jump(tid, module, maps, addr, kind, next, signals)?;
                    changes.planted.push(Planted {
                        module: module.path.clone(),
                        ops: names,
                        how,
                    });
                }
                (HookKind::Allocator { module_id, ops }, None) => {
                    let why = self
                        .probing
                        .fallback()
                        .map(|why| Int3Why::FellBack(why.into()));
                    let how = How::Int3(why);
                    changes.planted.push(Planted {
                        module: module.path.clone(),
                        ops: ops.iter().map(|op| op.name()).collect(),
                        how,
                    });
                    let kind = HookKind::Allocator { module_id, ops };
                    self.plant_int3(tid, module, maps, addr, kind, signals)?;
                }
                (kind @ (HookKind::Mapping { .. } | HookKind::DebugState), _) => {
                    self.plant_int3(tid, module, maps, addr, kind, signals)?
                }
            }
        }
        // A mapping call's walk from inside an allocator call meets the
        // allocator probe's return path, in a launch as in an attach.
        if self.probing.next_jump().is_some() {
            self.publish_return_paths();
        }
        Ok(())
    }

    /// A jump probe on the allocator function at `addr` (`kind`): a jump to
    /// it where that is safe, else an int3 that memptrace turns into the
    /// same. On a mapping function, a jump where that is safe, else an int3
    /// probe of its own (a stop per call) or, attached (see
    /// `tracer::failopen`), nothing: its calls are then not recorded. Says
    /// which.
    #[allow(clippy::too_many_arguments)]
    fn plant_jump(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        addr: u64,
        kind: HookKind,
        next: NextJump,
        signals: &mut Vec<i32>,
    ) -> Result<How, SpaceError> {
        let (what, ops, map) = match &kind {
            HookKind::Allocator { ops, .. } => (Called::Alloc(ops[0]), ops.clone(), None),
            HookKind::Mapping { op } => (Called::Map(*op), Vec::new(), Some(*op)),
            HookKind::DebugState => return Ok(How::Unhooked(Unhooked::DebugState)),
        };
        const SCAN: u64 = 512;
        let mut code = vec![0u8; SCAN.min(module.range.end.saturating_sub(addr)) as usize];
        let n = self.mem.read(addr, &mut code)?;
        code.truncate(n);
        if code.first() == Some(&INT3) {
            return Ok(How::Unhooked(Unhooked::EntryIsInt3));
        }
        let plan = plan::plan(&code, addr);
        if let (Some(_), Some(why)) = (map, plan.int3) {
            if next.fail_open {
                return Ok(How::Unhooked(Unhooked::NeedsJump(why)));
            }
            self.plant_int3(tid, module, maps, addr, kind, signals)?;
            return Ok(How::Int3(Some(Int3Why::Plan(why))));
        }
        let spec = next.spec(what, &plan);
        // Its size, assembled near where it will go, with room for branches
        // that come out longer there.
        let near = module.range.start.saturating_sub(AREA_SIZE);
        let room = (probe_code::probe(&spec, near)?.bytes.len() as u64 + 64).next_multiple_of(16);
        let at = self.room_near(tid, module, maps, room, signals)?;
        let probe = probe_code::probe(&spec, at)?;
        if probe.bytes.len() as u64 > room {
            return Err(SpaceError::Grew {
                module: module.path.clone(),
                what: "probe",
            });
        }
        let patch_len = if plan.is_jump() { plan::JUMP_LEN } else { 1 };
        let mut orig = vec![0u8; patch_len as usize];
        self.mem.read_exact(plan.at, &mut orig)?;
        // The probe first, then the patch: a thread never reaches a patch
        // whose probe is not ready.
        self.mem.write_code(at, &probe.bytes)?;
        let hook = Hook {
            addr: plan.at,
            orig,
            probe: Probe::Jump {
                code: probe,
                via_int3: !plan.is_jump(),
            },
            kind,
        };
        self.plant_hook(hook)?;
        self.probing.add_probe(ProbeInfo {
            module_id: module.id,
            ops,
            map,
        });
        Ok(match plan.int3 {
            None => How::Jump,
            Some(why) => How::Int3(Some(Int3Why::Plan(why))),
        })
    }

    pub(super) fn plant_int3(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        addr: u64,
        kind: HookKind,
        signals: &mut Vec<i32>,
    ) -> Result<(), SpaceError> {
        let mut code = [0u8; 16];
        self.mem.read_exact(addr, &mut code)?;
        if code[0] == INT3 {
            // Someone else's breakpoint (or a function that starts with int3):
            // displacing it would change what the program does.
            return Ok(());
        }
        let slot = self.room_near(tid, module, maps, SLOT_SIZE, signals)?;
        let (bytes, displaced) =
            int3::slot_code(&code, addr, slot).map_err(|source| SpaceError::Relocate {
                path: module.path.clone(),
                source,
            })?;
        // The slot first, then the int3: a thread never reaches an int3 whose
        // slot is not ready.
        self.mem.write_code(slot, &bytes)?;
        let hook = Hook {
            addr,
            orig: vec![code[0]],
            probe: Probe::Int3 {
                resume_at: slot + DISPLACED,
                stub: slot,
                displaced,
            },
            kind,
        };
        self.plant_hook(hook)?;
        Ok(())
    }

    /// `len` bytes of trampoline area within reach of `module`, mapping a
    /// new area next to it when none has room.
    pub(super) fn room_near(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        len: u64,
        signals: &mut Vec<i32>,
    ) -> Result<u64, SpaceError> {
        if let Some(at) = self.areas.take(len, &module.range) {
            return Ok(at);
        }
        let via = self.via().ok_or(SpaceError::NoSyscall("map a page"))?;
        let size = if self.probing.is_jump() {
            JUMP_AREA_SIZE
        } else {
            AREA_SIZE
        }
        .max(len.next_multiple_of(AREA_SIZE));
        let candidates = areas::place_area(
            maps,
            &module.range,
            procfs::mmap_min_addr(),
            module.is_main,
            size,
        );
        for addr in candidates {
            match self.through_a_stub(tid, via, |via| inject::map_code(tid, via, addr, size)) {
                Ok(done) => {
                    signals.extend(done.signals);
                    if done.value != addr {
                        continue;
                    }
                    self.areas.add(addr, size, len);
                    self.place_stub()?;
                    return Ok(addr);
                }
                Err(inject::InjectError::Errno(libc::EEXIST)) => continue,
                Err(err) => return Err(err.into()),
            }
        }
        Err(SpaceError::NoRoom(module.path.clone()))
    }

    /// Write the stub into the trampoline areas, once there are some.
    fn place_stub(&mut self) -> Result<(), SpaceError> {
        if self.stub.is_some() {
            return Ok(());
        }
        let Some(stub) = inject::stub::code() else {
            return Ok(());
        };
        let Some(at) = self.areas.take_anywhere(stub.len()) else {
            return Ok(());
        };
        self.mem.write_code(at, &stub.code)?;
        self.stub = Some((at, at + stub.save));
        Ok(())
    }

    /// Make the stack buffers, shared between the target and memptrace
    /// (see [`inject::shared_memory`]), and write the copy routine into a
    /// free slot.
    pub(super) fn set_up_buffers(
        &mut self,
        tid: Tid,
        signals: &mut Vec<i32>,
    ) -> Result<StackBuffers, SpaceError> {
        let routine = self
            .areas
            .take_anywhere(SLOT_SIZE)
            .ok_or(SpaceError::NoSlot("the stack-copy routine"))?;
        let via = self
            .via()
            .ok_or(SpaceError::NoSyscall("map the stack buffers"))?;
        let name = self.name_in_target(tid, signals)?;
        let len = BUFFERS as u64 * BUFFER_STRIDE;
        let (remote, map) = inject::shared_memory(self.pid, tid, via, name, len, None, signals)
            .map_err(|e| io::Error::other(crate::util::with_causes(&e)))?;
        self.shared = Some(remote..remote + len);
        self.mem
            .write_code(routine, &buffers::copy_routine().bytes)?;
        Ok(StackBuffers::new(map, remote, routine))
    }
}
