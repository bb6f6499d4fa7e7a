//! One address space of the target: its ELF images ([`images`]), the hooks
//! planted in them ([`Hooks`]), the trampoline areas that serve the hooks
//! ([`areas`]) and the stack buffers its threads copy their stacks into
//! ([`buffers`]).
//!
//! Code changes only through [`Hooks`]: every byte written over the
//! program's code is put back by a detach or, in a forked child that is not
//! traced, before the child runs. Areas and buffers are new mappings, made
//! by running `mmap` in a stopped thread of the target, and go the same way.

pub mod areas;
pub mod buffers;
mod control;
mod gate;
pub mod images;
mod retpaths;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::Range;
use std::sync::Arc;

use super::inject;
use super::probes::int3::{self, DISPLACED, INT3, SLOT_SIZE};
use super::probes::jump::code::{self as probe_code, ProbeSpec};
use super::probes::jump::control::Control;
use super::probes::jump::layout::{self, Called};
use super::probes::jump::plan;
use super::probes::{Hook, HookKind, Hooks, Probe};
use crate::addr::Svma;
use crate::event::{MapOp, Op};
use crate::memory::Memory;
use crate::os::mem::CodeWriter;
use crate::os::procfs::{self, Mapping};
use crate::os::ptrace::{Regs, Tid};
use crate::unwind::tables;
use areas::{AREA_SIZE, Areas, JUMP_AREA_SIZE};
use buffers::{BUFFER_STRIDE, BUFFERS, COPY_ROUTINE, InCopy, StackBuffers};
use images::{ImageMapping, LoadedModule};

#[derive(Debug, thiserror::Error)]
pub enum SpaceError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("no room for a trampoline page within reach of {0}")]
    NoRoom(String),
    #[error("{path}: {source}")]
    Relocate {
        path: String,
        source: int3::RelocateError,
    },
    #[error("cannot map a trampoline page: {0}")]
    Inject(#[from] inject::InjectError),
    #[error(transparent)]
    Probe(#[from] probe_code::AsmError),
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::Refusal),
}

/// How the calls of a space's allocator functions are caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Catch {
    /// An int3 on each entry; `buffers`: threads copy their own stacks.
    Int3 { buffers: bool },
    /// A jump to a probe that records the call in the target, taking at
    /// most `max_frames` return addresses; its probes count memptrace as
    /// gone once its heartbeat is `alive_ticks` old (0: never; see
    /// [`crate::tracer::probes::jump::liveness`]).
    Jump { max_frames: u64, alive_ticks: u64 },
}

/// What the jump probes of a space need.
pub struct Jumps {
    /// The control area, once made (see [`Control`]).
    pub control: Option<Control>,
    /// Making it was tried.
    tried: bool,
    max_frames: u64,
    alive_ticks: u64,
    fsgsbase: bool,
    /// What each probe serves, by its number.
    pub probes: Vec<ProbeInfo>,
}

/// What a jump probe serves.
#[derive(Clone, Debug)]
pub struct ProbeInfo {
    pub module_id: u64,
    /// The names sharing the function's address (see `callsite`); none for
    /// a mapping function.
    pub ops: Vec<Op>,
    /// The mapping function, for a mapping function's probe.
    pub map: Option<MapOp>,
}

impl ProbeInfo {
    /// Whether the probe records calls of `what`.
    pub fn records(&self, what: Called) -> bool {
        match what {
            Called::Alloc(op) => self.map.is_none() && self.ops.first() == Some(&op),
            Called::Map(op) => self.map == Some(op),
        }
    }
}

/// How one allocator (or, attached with jump probes, mapping) function was
/// hooked, for the trace's `meta`.
#[derive(Clone, Debug)]
pub struct Planted {
    pub module: String,
    /// Its names.
    pub ops: Vec<&'static str>,
    /// `jump`, or `int3` and why.
    pub how: String,
}

/// What a refresh of the image list found.
#[derive(Default)]
pub struct Changes {
    pub added: Vec<LoadedModule>,
    pub removed: Vec<LoadedModule>,
    /// Signals that arrived while a system call was injected; deliver them.
    pub signals: Vec<i32>,
    /// Problems with single images (unreadable file, unrelocatable entry);
    /// the trace goes on without them.
    pub warnings: Vec<String>,
    /// The allocator functions hooked.
    pub planted: Vec<Planted>,
}

pub struct Space {
    pub pid: Tid,
    mem: CodeWriter,
    pub hooks: Hooks,
    areas: Areas,
    /// Mapped images by start address.
    pub modules: BTreeMap<u64, LoadedModule>,
    exe: Option<String>,
    /// Where threads copy their own stacks, once set up.
    pub buffers: Option<StackBuffers>,
    /// The target's range of the buffers' shared mapping, to unmap at detach
    /// (a forked child has one too, inherited, that it does not use).
    shared: Option<Range<u64>>,
    /// Setting the buffers up was tried (it is tried once per space).
    buffers_tried: bool,
    /// With jump probes: what they need.
    pub jump: Option<Jumps>,
    /// Why jump probes, asked for, do not record in this space (its calls
    /// are caught by int3 probes).
    fallback: Option<String>,
    /// Why a system call hooking needed was not made, the first time one
    /// was not (the thread's seccomp filter does not allow it).
    pub refused: Option<String>,
    /// The stub injected system calls go through, once a trampoline area
    /// holds it (see [`inject::stub`]): its address and its save area's.
    stub: Option<(u64, u64)>,
    /// Rows of return paths published for each trampoline area (see
    /// [`retpaths`]), by its start.
    return_rows: HashMap<u64, usize>,
    /// Images read before the threads stopped (attach), for the first
    /// [`Space::refresh`].
    pub ahead: images::Ahead,
}

impl Space {
    /// The space of process `pid`, its calls caught as `catch` says.
    pub fn new(pid: Tid, catch: Catch) -> io::Result<Space> {
        let (buffers, jump) = match catch {
            Catch::Int3 { buffers } => (buffers, None),
            Catch::Jump {
                max_frames,
                alive_ticks,
            } => (
                false,
                Some(Jumps {
                    control: None,
                    tried: false,
                    max_frames,
                    alive_ticks,
                    fsgsbase: procfs::fsgsbase(pid),
                    probes: Vec::new(),
                }),
            ),
        };
        Ok(Space {
            pid,
            mem: CodeWriter::open(pid)?,
            hooks: Hooks::default(),
            areas: Areas::default(),
            modules: BTreeMap::new(),
            exe: procfs::exe(pid).map(|p| p.to_string_lossy().into_owned()),
            buffers: None,
            shared: None,
            buffers_tried: !buffers,
            jump,
            fallback: None,
            refused: None,
            stub: None,
            return_rows: HashMap::new(),
            ahead: images::Ahead::default(),
        })
    }

    /// The control area of the jump probes, if this space has one.
    pub fn control(&self) -> Option<&Control> {
        self.jump.as_ref()?.control.as_ref()
    }

    pub fn control_mut(&mut self) -> Option<&mut Control> {
        self.jump.as_mut()?.control.as_mut()
    }

    /// What jump probe `id` serves.
    pub fn probe_info(&self, id: u16) -> Option<&ProbeInfo> {
        self.jump.as_ref()?.probes.get(usize::from(id))
    }

    /// The space of a child forked from this one (`pid`), which has copies of
    /// the same hooks, trampoline pages and images. Its modules get ids of
    /// their own, taken from `next_id`.
    pub fn fork_copy(&self, pid: Tid, next_id: &mut u64) -> io::Result<Space> {
        let mut renamed = HashMap::new();
        let modules = self
            .modules
            .iter()
            .map(|(&start, module)| {
                *next_id += 1;
                renamed.insert(module.id, *next_id);
                let copy = LoadedModule {
                    id: *next_id,
                    ..module.clone()
                };
                (start, copy)
            })
            .collect();
        let mut hooks = Hooks::default();
        for hook in self.hooks.iter() {
            let mut hook = hook.clone();
            if let HookKind::Allocator { module_id, .. } = &mut hook.kind {
                *module_id = renamed.get(module_id).copied().unwrap_or(*module_id);
            }
            hooks.book(hook);
        }
        Ok(Space {
            pid,
            mem: CodeWriter::open(pid)?,
            hooks,
            areas: self.areas.clone(),
            modules,
            exe: self.exe.clone(),
            // The child's copy of the shared mapping is still shared with
            // the parent: it copies stacks the old way, and the mapping goes
            // with the trampoline pages. Its control area, likewise, is its
            // parent's until it gets one of its own (`adopt_control`).
            buffers: None,
            shared: self.shared.clone(),
            buffers_tried: true,
            jump: self.jump.as_ref().map(|j| Jumps {
                control: None,
                tried: true,
                max_frames: j.max_frames,
                alive_ticks: j.alive_ticks,
                fsgsbase: j.fsgsbase,
                probes: j.probes.clone(),
            }),
            fallback: self.fallback.clone(),
            refused: None,
            // In the child's copy of the trampoline areas.
            stub: self.stub,
            return_rows: HashMap::new(),
            ahead: images::Ahead::default(),
        })
    }

    pub fn module_at(&self, addr: u64) -> Option<&LoadedModule> {
        let (_, m) = self.modules.range(..=addr).next_back()?;
        m.range.contains(&addr).then_some(m)
    }

    /// Re-read the memory map; hook images that appeared, forget those gone.
    /// `tid` is a stopped thread of this space, used to map trampoline pages.
    pub fn refresh(&mut self, tid: Tid, next_id: &mut u64) -> io::Result<Changes> {
        let maps = procfs::read_maps(self.pid)?;
        let found = images::image_mappings(&maps);
        let mut changes = Changes::default();

        let gone: Vec<u64> = self
            .modules
            .values()
            .filter(|m| {
                !found
                    .iter()
                    .any(|f| f.start == m.range.start && f.inode == m.inode)
            })
            .map(|m| m.range.start)
            .collect();
        for start in gone {
            if let Some(module) = self.modules.remove(&start) {
                self.hooks.forget_in(&module.range);
                changes.removed.push(module);
            }
        }

        if let Some(jump) = self.jump.as_mut() {
            for module in &changes.removed {
                if let Some(control) = jump.control.as_mut() {
                    control.remove_image(module.range.start);
                }
            }
        }
        for f in found {
            if self
                .modules
                .get(&f.start)
                .is_some_and(|m| m.inode == f.inode)
            {
                continue;
            }
            match self.add_image(&f, next_id) {
                Ok(Some(module)) => {
                    let gaps = module.image.signature_gaps.iter();
                    changes
                        .warnings
                        .extend(gaps.map(|gap| format!("{}: {gap}", f.path)));
                    changes.added.push(module);
                }
                Ok(None) => {}
                Err(err) => changes.warnings.push(format!("{}: {err}", f.path)),
            }
        }
        if !changes.added.is_empty() && self.jump.as_ref().is_some_and(|j| !j.tried) {
            if let Err(err) = self.make_control(tid, &changes.added[0], &maps, &mut changes.signals)
            {
                let why = crate::error::with_causes(&err);
                changes.warnings.push(format!(
                    "process {}: jump probes cannot record without memory shared with memptrace, int3 probes catch its calls: {why}",
                    self.pid
                ));
                self.fallback = Some(why);
            }
        }
        if let Some(control) = self.jump.as_mut().and_then(|j| j.control.as_mut()) {
            for module in &changes.added {
                let table = self
                    .ahead
                    .take_table(module)
                    .unwrap_or_else(|| tables::build(&module.image));
                control.add_image(module.range.clone(), module.bias.0, &table);
            }
        }
        // What was read ahead served the first look at the images.
        self.ahead = images::Ahead::default();
        let added = changes.added.clone();
        for module in &added {
            if let Err(err) = self.hook(tid, module, &maps, &mut changes) {
                if let SpaceError::Inject(inject::InjectError::Forbidden(why)) = &err {
                    self.refused.get_or_insert_with(|| why.to_string());
                }
                changes.warnings.push(format!("{}: {err}", module.path));
            }
        }
        if !self.buffers_tried && !self.areas.is_empty() {
            self.buffers_tried = true;
            if let Err(err) = self.set_up_buffers(tid, &mut changes.signals) {
                // The stop path copies stacks with process_vm_readv instead.
                changes.warnings.push(format!(
                    "stacks are read with process_vm_readv, which costs more per call: {err}"
                ));
            }
        }
        Ok(changes)
    }

    /// Parse a newly mapped image and add it to the modules (before hooking
    /// it: its `syscall` bytes may be the only ones there are to map a
    /// trampoline page with, in a static executable).
    fn add_image(
        &mut self,
        f: &ImageMapping,
        next_id: &mut u64,
    ) -> io::Result<Option<LoadedModule>> {
        let image = match self.ahead.image(f) {
            Some(image) => image,
            None => Arc::new(images::load_image(self.pid, f)?),
        };
        let Some(bias) = image.load_bias(f.start, 0) else {
            return Ok(None);
        };
        *next_id += 1;
        let module = LoadedModule {
            id: *next_id,
            path: f.path.clone(),
            inode: f.inode,
            range: f.start..f.end.max(image.avma_range(bias).end),
            bias,
            is_main: self.exe.as_deref() == Some(f.path.as_str()),
            image,
        };
        self.modules.insert(module.range.start, module.clone());
        Ok(Some(module))
    }

    /// Make the stack buffers, shared between the target and memptrace
    /// (see [`inject::shared_memory`]), and write the copy routine into a
    /// free slot.
    fn set_up_buffers(&mut self, tid: Tid, signals: &mut Vec<i32>) -> Result<(), SpaceError> {
        let routine = self
            .areas
            .take_anywhere(SLOT_SIZE)
            .ok_or_else(|| SpaceError::NoRoom("no free trampoline slot".into()))?;
        let via = self
            .via()
            .ok_or_else(|| SpaceError::NoRoom("no syscall instruction".into()))?;
        let name = self.name_in_target(tid, signals)?;
        let len = BUFFERS as u64 * BUFFER_STRIDE;
        let (remote, map) = inject::shared_memory(self.pid, tid, via, name, len, None, signals)
            .map_err(|e| io::Error::other(crate::error::with_causes(&e)))?;
        self.shared = Some(remote..remote + len);
        self.mem.write(routine, &COPY_ROUTINE)?;
        self.buffers = Some(StackBuffers::new(map, remote, routine));
        Ok(())
    }

    fn hook(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
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
        let jumps = self.control().is_some();
        // Attached with jump probes: no int3 where memptrace's death would
        // make it fatal (see `tracer::failopen`).
        let fail_open = jumps && self.jump.as_ref().is_some_and(|j| j.alive_ticks != 0);
        for (addr, kind) in targets {
            if self.hooks.contains(addr) {
                continue;
            }
            match kind {
                HookKind::Mapping { op } if fail_open => {
                    let how = self.plant_jump(tid, module, maps, addr, kind, signals)?;
                    changes.planted.push(Planted {
                        module: module.path.clone(),
                        ops: vec![op.name()],
                        how,
                    });
                }
                HookKind::DebugState
                    if fail_open && self.plant_gate(tid, module, maps, addr, signals)? => {}
                HookKind::Allocator { ref ops, .. } if jumps => {
                    let names = ops.iter().map(|op| op.name()).collect();
                    let how = self.plant_jump(tid, module, maps, addr, kind, signals)?;
                    changes.planted.push(Planted {
                        module: module.path.clone(),
                        ops: names,
                        how,
                    });
                }
                HookKind::Allocator { ref ops, .. } => {
                    let how = match &self.fallback {
                        Some(why) => format!("int3: {why}"),
                        None => "int3".into(),
                    };
                    changes.planted.push(Planted {
                        module: module.path.clone(),
                        ops: ops.iter().map(|op| op.name()).collect(),
                        how,
                    });
                    self.plant_int3(tid, module, maps, addr, kind, signals)?;
                }
                HookKind::Mapping { .. } | HookKind::DebugState => {
                    self.plant_int3(tid, module, maps, addr, kind, signals)?
                }
            }
        }
        if fail_open {
            self.publish_return_paths();
        }
        Ok(())
    }

    /// A jump probe on the allocator function at `addr` (`kind`): a jump to
    /// it where that is safe, else an int3 that memptrace turns into the
    /// same. On a mapping function (attach only, see `tracer::failopen`),
    /// a jump or nothing: its calls are then not recorded. Says which.
    fn plant_jump(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        addr: u64,
        kind: HookKind,
        signals: &mut Vec<i32>,
    ) -> Result<String, SpaceError> {
        let (what, ops, map) = match &kind {
            HookKind::Allocator { ops, .. } => (Called::Alloc(ops[0]), ops.clone(), None),
            HookKind::Mapping { op } => (Called::Map(*op), Vec::new(), Some(*op)),
            HookKind::DebugState => return Ok("none".into()),
        };
        const SCAN: u64 = 512;
        let mut code = vec![0u8; SCAN.min(module.range.end.saturating_sub(addr)) as usize];
        let n = self.mem.read(addr, &mut code)?;
        code.truncate(n);
        if code.first() == Some(&INT3) {
            // Someone else's breakpoint: displacing it would change what the
            // program does.
            return Ok("none: the entry is an int3 already".into());
        }
        let plan = plan::plan(&code, addr);
        if let (Some(_), Some(why)) = (map, &plan.int3) {
            return Ok(format!(
                "none: {why} (an int3 would kill the process if memptrace died; its calls are not recorded)"
            ));
        }
        let jump = self.jump.as_ref().expect("jump probes");
        let control = jump.control.as_ref().expect("a control area");
        let spec = ProbeSpec {
            id: jump.probes.len() as u16,
            what,
            control: control.remote,
            displaced: plan.displaced.clone(),
            resume: plan.resume,
            max_frames: jump.max_frames,
            fsgsbase: jump.fsgsbase,
        };
        // Its size, assembled near where it will go, with room for branches
        // that come out longer there.
        let near = module.range.start.saturating_sub(AREA_SIZE);
        let room = (probe_code::probe(&spec, near)?.bytes.len() as u64 + 64).next_multiple_of(16);
        let at = self.room_near(tid, module, maps, room, signals)?;
        let probe = probe_code::probe(&spec, at)?;
        if probe.bytes.len() as u64 > room {
            return Err(SpaceError::NoRoom(format!(
                "{}: the probe grew",
                module.path
            )));
        }
        let patch_len = if plan.is_jump() { plan::JUMP_LEN } else { 1 };
        let mut orig = vec![0u8; patch_len as usize];
        self.mem.read_exact(plan.at, &mut orig)?;
        // The probe first, then the patch: a thread never reaches a patch
        // whose probe is not ready.
        self.mem.write(at, &probe.bytes)?;
        let hook = Hook {
            addr: plan.at,
            orig,
            probe: Probe::Jump {
                code: probe,
                via_int3: !plan.is_jump(),
            },
            kind,
        };
        self.hooks.plant(&self.mem, hook)?;
        let jump = self.jump.as_mut().expect("jump probes");
        if map.is_some() {
            if let Some(control) = jump.control.as_mut() {
                control.maps = true;
            }
        }
        jump.probes.push(ProbeInfo {
            module_id: module.id,
            ops,
            map,
        });
        Ok(match plan.int3 {
            None => "jump".into(),
            Some(why) => format!("int3: {why}"),
        })
    }

    fn plant_int3(
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
        self.mem.write(slot, &bytes)?;
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
        self.hooks.plant(&self.mem, hook)?;
        Ok(())
    }

    /// `len` bytes of trampoline area within reach of `module`, mapping a
    /// new area next to it when none has room.
    fn room_near(
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
        let via = self.via().ok_or_else(|| {
            SpaceError::NoRoom("no syscall instruction to map a page with".into())
        })?;
        let size = if self.jump.is_some() {
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
            match inject::map_code(tid, via, addr, size) {
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

    /// Move a thread stopped with `regs` out of the trampoline areas, to the
    /// same place in the original code (see [`Hooks::leave`]); from the copy
    /// routine, to where the routine would have gone on. `Some(false)` when
    /// the thread is in no area, `Some(true)` when `regs` changed, `None`
    /// when it is somewhere in an area that cannot be mapped back.
    pub fn leave_areas(&self, regs: &mut Regs) -> Option<bool> {
        if !self.areas.contains(regs.rip) {
            return Some(false);
        }
        self.leave_copy(regs)?;
        match self.hooks.leave(regs, &self.mem)? {
            true => Some(true),
            false => None,
        }
    }

    /// The address of a `pop` + `ret` pair in the program's own code (see
    /// [`int3::pop_ret`]): where a call still running through a stub is
    /// sent to return once the trampoline pages are gone.
    pub fn pop_ret(&self) -> Option<u64> {
        const CHUNK: u64 = 64 << 10;
        for module in self.modules.values() {
            let Some(text) = &module.image.text else {
                continue;
            };
            let start = module.bias.to_avma(Svma(text.start)).0;
            let end = module.bias.to_avma(Svma(text.end)).0;
            let mut at = start;
            let mut buf = vec![0u8; CHUNK as usize + 1];
            while at < end {
                let len = (end - at).min(CHUNK + 1) as usize;
                if self.mem.read_exact(at, &mut buf[..len]).is_err() {
                    break;
                }
                if let Some(offset) = int3::pop_ret(&buf[..len]) {
                    return Some(at + offset as u64);
                }
                at += CHUNK;
            }
        }
        None
    }

    /// Move a thread stopped with `regs` in the copy routine to where the
    /// routine would have jumped, as if its copy were done: `Some(true)`
    /// when it was there, `Some(false)` when not, `None` when its
    /// continuation cannot be read.
    pub fn leave_copy(&self, regs: &mut Regs) -> Option<bool> {
        match self.in_copy(regs.rip) {
            Some(InCopy::Rax) => regs.rip = regs.rax,
            Some(InCopy::Stack) => {
                regs.rip = self.mem.read_u64(regs.rsp).ok()?;
                regs.rsp += 8;
            }
            None => return Some(false),
        }
        Some(true)
    }

    /// The trampoline areas' address ranges.
    pub fn area_ranges(&self) -> Vec<Range<u64>> {
        self.areas.ranges().collect()
    }

    /// True when `rip` lies in one of the trampoline areas.
    pub fn in_areas(&self, rip: u64) -> bool {
        self.areas.contains(rip)
    }

    /// Where a thread at `rip` stands in the copy routine, if it is there.
    pub fn in_copy(&self, rip: u64) -> Option<InCopy> {
        buffers::in_copy(rip, self.buffers.as_ref()?.routine)
    }

    /// Unmap every trampoline area, running munmap in the stopped thread
    /// `tid`. Call only when no hook is planted and no thread is in an area
    /// or will return into a stub. Returns signals that arrived meanwhile,
    /// to deliver.
    pub fn unmap_areas(&mut self, tid: Tid) -> Result<Vec<i32>, SpaceError> {
        let signals = self.unmap_areas_in(tid)?;
        self.areas.clear();
        self.stub = None;
        self.buffers = None;
        self.shared = None;
        if let Some(jump) = self.jump.as_mut() {
            jump.control = None;
        }
        Ok(signals)
    }

    /// Unmap the trampoline areas in the process of the stopped thread `tid`:
    /// this one, or a forked copy of it, which has the same areas. The area
    /// that holds the stub goes last, through the program's own `syscall`
    /// instruction (see [`inject`]).
    pub fn unmap_areas_in(&self, tid: Tid) -> Result<Vec<i32>, SpaceError> {
        let via = self
            .via()
            .ok_or_else(|| SpaceError::NoRoom("no syscall instruction to unmap with".into()))?;
        let mut signals = Vec::new();
        let control = self
            .control()
            .map(|c| c.remote..c.remote + layout::AREA_SIZE);
        let holds_stub = |r: &Range<u64>| via.stub.is_some_and(|(at, _)| r.contains(&at));
        let mut ranges: Vec<Range<u64>> = self
            .areas
            .ranges()
            .chain(self.shared.clone())
            .chain(control)
            .collect();
        ranges.sort_by_key(|r| holds_stub(r));
        for range in ranges {
            let via = if holds_stub(&range) { via.own() } else { via };
            let done = inject::syscall(
                tid,
                via,
                libc::SYS_munmap as u64,
                [range.start, range.end - range.start, 0, 0, 0, 0],
            )?;
            signals.extend(done.signals);
        }
        Ok(signals)
    }

    /// How an injected call enters the kernel in this space: through the
    /// stub once there is one.
    pub(super) fn via(&self) -> Option<inject::Via> {
        Some(inject::Via {
            insn: self.syscall_insn()?,
            stub: self.stub,
        })
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
        self.mem.write(at, &stub.code)?;
        self.stub = Some((at, at + stub.save));
        Ok(())
    }

    fn syscall_insn(&self) -> Option<u64> {
        self.modules
            .values()
            .find_map(|m| m.image.syscall_insn.map(|s| m.bias.to_avma(s).0))
    }

    /// Put every original byte back, the probes still known (to move
    /// threads out of their code, see [`Space::leave_areas`]).
    pub fn put_back_code(&self) -> io::Result<()> {
        self.hooks.restore_into(&self.mem)
    }

    /// Put every original byte back (before detaching).
    pub fn restore_all(&mut self) -> io::Result<()> {
        self.hooks.restore_all(&self.mem)
    }

    /// Put every original byte back in another process that has a copy of
    /// this space (a forked child).
    pub fn restore_into(&self, pid: Tid) -> io::Result<()> {
        self.hooks.restore_into(&CodeWriter::open(pid)?)
    }
}
