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
pub mod images;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::Range;
use std::sync::Arc;

use super::inject;
use super::probes::int3::{self, DISPLACED, INT3, SLOT_SIZE};
use super::probes::{Hook, HookKind, Hooks, Probe};
use crate::addr::Svma;
use crate::memory::Memory;
use crate::os::mem::{CodeWriter, SharedMapping};
use crate::os::procfs::{self, Mapping};
use crate::os::ptrace::{Regs, Tid};
use areas::{AREA_SIZE, Areas};
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
}

impl Space {
    /// The space of process `pid`; `buffers`: set up stack buffers (only
    /// framehop stacks on every call use them).
    pub fn new(pid: Tid, buffers: bool) -> io::Result<Space> {
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
        })
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
            // with the trampoline pages.
            buffers: None,
            shared: self.shared.clone(),
            buffers_tried: true,
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
                    if let Err(err) = self.hook(tid, &module, &maps, &mut changes.signals) {
                        changes.warnings.push(format!("{}: {err}", module.path));
                    }
                    changes.added.push(module);
                }
                Ok(None) => {}
                Err(err) => changes.warnings.push(format!("{}: {err}", f.path)),
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
        let image = images::load_image(self.pid, f)?;
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
            image: Arc::new(image),
        };
        self.modules.insert(module.range.start, module.clone());
        Ok(Some(module))
    }

    /// Map the stack buffers in the target (an injected mmap), here too
    /// (/proc/PID/map_files), and write the copy routine into a free slot.
    fn set_up_buffers(&mut self, tid: Tid, signals: &mut Vec<i32>) -> Result<(), SpaceError> {
        let routine = self
            .areas
            .take_anywhere(SLOT_SIZE)
            .ok_or_else(|| SpaceError::NoRoom("no free trampoline slot".into()))?;
        let insn = self
            .syscall_insn()
            .ok_or_else(|| SpaceError::NoRoom("no syscall instruction".into()))?;
        let len = BUFFERS as u64 * BUFFER_STRIDE;
        let prot = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let flags = (libc::MAP_SHARED | libc::MAP_ANONYMOUS) as u64;
        let done = inject::syscall(
            tid,
            insn,
            libc::SYS_mmap as u64,
            [0, len, prot, flags, u64::MAX, 0],
        )?;
        signals.extend(done.signals);
        let remote = done.value;
        self.shared = Some(remote..remote + len);
        let map = SharedMapping::open(self.pid, remote, remote + len).map_err(|err| {
            io::Error::new(
                err.kind(),
                format!("cannot map the target's stack buffers (/proc/PID/map_files needs CAP_SYS_ADMIN): {err}"),
            )
        })?;
        self.mem.write(routine, &COPY_ROUTINE)?;
        self.buffers = Some(StackBuffers::new(map, remote, routine));
        Ok(())
    }

    fn hook(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        signals: &mut Vec<i32>,
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
        if let Some(svma) = module.image.debug_state {
            targets.push((module.bias.to_avma(svma).0, HookKind::DebugState));
        }
        for (addr, kind) in targets {
            if self.hooks.contains(addr) {
                continue;
            }
            self.plant_int3(tid, module, maps, addr, kind, signals)?;
        }
        Ok(())
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
        let insn = self.syscall_insn().ok_or_else(|| {
            SpaceError::NoRoom("no syscall instruction to map a page with".into())
        })?;
        let candidates =
            areas::place_area(maps, &module.range, procfs::mmap_min_addr(), module.is_main);
        for addr in candidates {
            match inject::map_code(tid, insn, addr, AREA_SIZE) {
                Ok(done) => {
                    signals.extend(done.signals);
                    if done.value != addr {
                        continue;
                    }
                    self.areas.add(addr, len);
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
        self.buffers = None;
        self.shared = None;
        Ok(signals)
    }

    /// Unmap the trampoline areas in the process of the stopped thread `tid`:
    /// this one, or a forked copy of it, which has the same areas.
    pub fn unmap_areas_in(&self, tid: Tid) -> Result<Vec<i32>, SpaceError> {
        let insn = self
            .syscall_insn()
            .ok_or_else(|| SpaceError::NoRoom("no syscall instruction to unmap with".into()))?;
        let mut signals = Vec::new();
        let ranges = self.areas.ranges().chain(self.shared.clone());
        for range in ranges {
            let done = inject::syscall(
                tid,
                insn,
                libc::SYS_munmap as u64,
                [range.start, range.end - range.start, 0, 0, 0, 0],
            )?;
            signals.extend(done.signals);
        }
        Ok(signals)
    }

    fn syscall_insn(&self) -> Option<u64> {
        self.modules
            .values()
            .find_map(|m| m.image.syscall_insn.map(|s| m.bias.to_avma(s).0))
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
