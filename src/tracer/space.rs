//! One address space of the target: its ELF images, the breakpoints planted in
//! them and the trampoline areas that serve those breakpoints.
//!
//! Planting and restoring are the only two ways code changes: a breakpoint
//! remembers the byte it covers, and every byte written is put back by
//! [`Space::restore_all`] (detach) or [`Space::restore_into`] (a forked child
//! that is not traced). Trampoline pages are new mappings, not changed bytes.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::Range;
use std::sync::Arc;

use super::inject;
use super::trampoline::{
    self, AREA_SIZE, COPY_HEADER, COPY_ROUTINE, DISPLACED, InCopy, InStub, RETURN_INT3, SLOT_SIZE,
};
use crate::addr::{LoadBias, Svma};
use crate::event::Op;
use crate::os::mem::{CodeWriter, SharedMapping};
use crate::os::procfs::{self, Mapping};
use crate::os::ptrace::{Regs, Tid};
use crate::sink::ModuleRecord;
use crate::symbols::elf::ElfImage;
use crate::unwind::MappedImage;

const INT3: u8 = 0xcc;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BreakpointKind {
    /// Entry of an allocator function; `ops` as in [`crate::symbols::elf::AllocatorEntry`].
    Allocator { module_id: u64, ops: Vec<Op> },
    /// The dynamic linker's `_dl_debug_state`: images were mapped or unmapped.
    DebugState,
}

#[derive(Clone, Debug)]
pub struct Breakpoint {
    pub addr: u64,
    /// The byte the int3 replaced.
    pub orig: u8,
    /// Where a thread stopped here resumes: the displaced instruction.
    pub resume_at: u64,
    /// Where it resumes instead when memptrace wants the call's result: the
    /// slot's call stub, which returns through the int3 at
    /// `stub + RETURN_INT3` (see [`trampoline::slot_code`]).
    pub stub: u64,
    /// What the slot holds.
    pub slot: trampoline::Displaced,
    pub kind: BreakpointKind,
}

/// An ELF image mapped in this space.
#[derive(Clone, Debug)]
pub struct LoadedModule {
    pub id: u64,
    pub path: String,
    pub inode: u64,
    pub range: Range<u64>,
    pub bias: LoadBias,
    pub image: Arc<ElfImage>,
    pub is_main: bool,
}

impl LoadedModule {
    /// The module as the unwinders need it.
    pub fn mapped(&self) -> MappedImage {
        MappedImage {
            module_id: self.id,
            image: self.image.clone(),
            bias: self.bias,
            range: self.range.clone(),
            is_main: self.is_main,
        }
    }

    /// The module's row in the database, for process `pid`, found at `now`.
    pub fn record(&self, pid: Tid, now: u64) -> ModuleRecord {
        ModuleRecord {
            id: self.id,
            pid: pid as u32,
            path: self.path.clone(),
            build_id: self.image.build_id.clone(),
            start: self.range.start,
            end: self.range.end,
            base: self.bias.0,
            loaded_ns: now,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Area {
    start: u64,
    next: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SpaceError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("no room for a trampoline page within reach of {0}")]
    NoRoom(String),
    #[error("{path}: {source}")]
    Relocate {
        path: String,
        source: trampoline::RelocateError,
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
    pub breakpoints: HashMap<u64, Breakpoint>,
    areas: Vec<Area>,
    /// Mapped images by start address.
    pub modules: BTreeMap<u64, LoadedModule>,
    exe: Option<String>,
    /// Where threads copy their own stacks (see [`StackBuffers`]), once set up.
    pub buffers: Option<StackBuffers>,
    /// The target's range of the buffers' shared mapping, to unmap at detach
    /// (a forked child has one too, inherited, that it does not use).
    shared: Option<Range<u64>>,
    /// Setting the buffers up was tried (it is tried once per space).
    buffers_tried: bool,
}

/// Stack buffers: a mapping shared between the target and memptrace, one
/// buffer per thread, and the copy routine (`trampoline::COPY_ROUTINE`) in a
/// trampoline slot. At an allocator entry the tracer sends the thread through
/// the routine instead of copying its stack with a system call while it is
/// stopped: the thread copies its own stack, and memptrace reads the copy
/// from the shared mapping once the thread has counted it done, or, if the
/// thread stops before that, with process_vm_readv then.
pub struct StackBuffers {
    map: SharedMapping,
    /// Start of the mapping in the target.
    remote: u64,
    /// Address of the copy routine in the target.
    pub routine: u64,
    by_thread: HashMap<Tid, usize>,
    free: Vec<usize>,
    /// Copies asked of each buffer so far.
    issued: Vec<u64>,
}

/// Buffers per space: threads beyond this many at once copy the old way.
const BUFFERS: usize = 64;
/// Bytes per buffer: the counter's header, then up to a full stack copy.
const BUFFER_STRIDE: u64 = COPY_HEADER + crate::tracer::calls::STACK_COPY;

/// A copy asked of a thread: its buffer, and the count that says it is done.
#[derive(Clone, Copy, Debug)]
pub struct Issued {
    pub buffer: usize,
    /// Address of the buffer's data in the target (the routine's r11).
    pub data: u64,
    pub seq: u64,
}

impl StackBuffers {
    /// A copy for thread `tid`: its buffer (one is taken for it on its first
    /// call), `None` when all are taken.
    pub fn issue(&mut self, tid: Tid) -> Option<Issued> {
        let buffer = match self.by_thread.get(&tid) {
            Some(&b) => b,
            None => {
                let b = self.free.pop()?;
                self.by_thread.insert(tid, b);
                // Its last thread may have left a copy unmade (killed, or
                // gone before the routine ran).
                self.resync(b);
                b
            }
        };
        self.issued[buffer] += 1;
        Some(Issued {
            buffer,
            data: self.remote + buffer as u64 * BUFFER_STRIDE + COPY_HEADER,
            seq: self.issued[buffer],
        })
    }

    /// Count the copies asked of `buffer` as those its thread made: after a
    /// copy that will never be made (the routine faulted and the thread was
    /// sent past it), so that "done" keeps meaning done.
    pub fn resync(&mut self, buffer: usize) {
        self.issued[buffer] = self.map.read_u64_acquire(buffer * BUFFER_STRIDE as usize);
    }

    /// [`StackBuffers::resync`] the buffer of thread `tid`.
    pub fn resync_thread(&mut self, tid: Tid) {
        if let Some(&b) = self.by_thread.get(&tid) {
            self.resync(b);
        }
    }

    /// True when the thread has made copy `seq` of `buffer`.
    pub fn done(&self, buffer: usize, seq: u64) -> bool {
        let counted = self.map.read_u64_acquire(buffer * BUFFER_STRIDE as usize);
        counted.wrapping_sub(seq) as i64 >= 0
    }

    /// Append the first `len` bytes of `buffer` to `out`.
    pub fn copy_out(&self, buffer: usize, len: usize, out: &mut Vec<u8>) {
        let at = buffer * BUFFER_STRIDE as usize + COPY_HEADER as usize;
        self.map.copy_out(at, len, out);
    }

    /// A thread is gone: its buffer serves the next one.
    pub fn release(&mut self, tid: Tid) {
        if let Some(b) = self.by_thread.remove(&tid) {
            self.free.push(b);
        }
    }
}

impl Space {
    /// The space of process `pid`; `buffers`: set up stack buffers (only
    /// framehop stacks on every call use them).
    pub fn new(pid: Tid, buffers: bool) -> io::Result<Space> {
        Ok(Space {
            pid,
            mem: CodeWriter::open(pid)?,
            breakpoints: HashMap::new(),
            areas: Vec::new(),
            modules: BTreeMap::new(),
            exe: procfs::exe(pid).map(|p| p.to_string_lossy().into_owned()),
            buffers: None,
            shared: None,
            buffers_tried: !buffers,
        })
    }

    /// True when `at` is the return int3 of a slot in use: a call made
    /// through a stub came back.
    pub fn is_return(&self, at: u64) -> bool {
        self.areas
            .iter()
            .any(|a| (a.start..a.next).contains(&at) && (at - a.start) % SLOT_SIZE == RETURN_INT3)
    }

    /// The space of a child forked from this one (`pid`), which has copies of
    /// the same breakpoints, trampoline pages and images. Its modules get
    /// ids of their own, taken from `next_id`.
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
        let breakpoints = self
            .breakpoints
            .iter()
            .map(|(&addr, bp)| {
                let mut bp = bp.clone();
                if let BreakpointKind::Allocator { module_id, .. } = &mut bp.kind {
                    *module_id = renamed.get(module_id).copied().unwrap_or(*module_id);
                }
                (addr, bp)
            })
            .collect();
        Ok(Space {
            pid,
            mem: CodeWriter::open(pid)?,
            breakpoints,
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
        let found = image_mappings(&maps);
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
                self.breakpoints
                    .retain(|&addr, _| !module.range.contains(&addr));
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
            let image = match load_image(self.pid, &f) {
                Ok(image) => image,
                Err(err) => {
                    changes.warnings.push(format!("{}: {err}", f.path));
                    continue;
                }
            };
            let Some(bias) = image.load_bias(f.start, 0) else {
                continue;
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
            // Inserted before hooking: its `syscall` bytes may be the only ones
            // there are to map a trampoline page with (a static executable).
            self.modules.insert(module.range.start, module.clone());
            if let Err(err) = self.hook(tid, &module, &maps, &mut changes.signals) {
                changes.warnings.push(format!("{}: {err}", module.path));
            }
            changes.added.push(module);
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

    /// Map the stack buffers in the target (an injected mmap), here too
    /// (/proc/PID/map_files), and write the copy routine into a free slot.
    fn set_up_buffers(&mut self, tid: Tid, signals: &mut Vec<i32>) -> Result<(), SpaceError> {
        let Some(area) = self
            .areas
            .iter_mut()
            .find(|a| a.next + SLOT_SIZE <= a.start + AREA_SIZE)
        else {
            return Err(SpaceError::NoRoom("no free trampoline slot".into()));
        };
        let routine = area.next;
        area.next += SLOT_SIZE;
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
        self.buffers = Some(StackBuffers {
            map,
            remote,
            routine,
            by_thread: HashMap::new(),
            free: (0..BUFFERS).rev().collect(),
            issued: vec![0; BUFFERS],
        });
        Ok(())
    }

    fn hook(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        signals: &mut Vec<i32>,
    ) -> Result<(), SpaceError> {
        let mut targets: Vec<(u64, BreakpointKind)> = module
            .image
            .allocator_avmas(module.bias)
            .map(|(avma, entry)| {
                (
                    avma.0,
                    BreakpointKind::Allocator {
                        module_id: module.id,
                        ops: entry.ops.clone(),
                    },
                )
            })
            .collect();
        if let Some(svma) = module.image.debug_state {
            targets.push((module.bias.to_avma(svma).0, BreakpointKind::DebugState));
        }
        for (addr, kind) in targets {
            if self.breakpoints.contains_key(&addr) {
                continue;
            }
            self.plant(tid, module, maps, addr, kind, signals)?;
        }
        Ok(())
    }

    fn plant(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        addr: u64,
        kind: BreakpointKind,
        signals: &mut Vec<i32>,
    ) -> Result<(), SpaceError> {
        let mut code = [0u8; 16];
        self.mem.read(addr, &mut code)?;
        if code[0] == INT3 {
            // Someone else's breakpoint (or a function that starts with int3):
            // displacing it would change what the program does.
            return Ok(());
        }
        let slot = self.slot_for(tid, module, maps, signals)?;
        let (bytes, displaced) =
            trampoline::slot_code(&code, addr, slot).map_err(|source| SpaceError::Relocate {
                path: module.path.clone(),
                source,
            })?;
        // The slot first, then the int3: a thread never reaches an int3 whose
        // slot is not ready.
        self.mem.write(slot, &bytes)?;
        self.mem.write(addr, &[INT3])?;
        self.breakpoints.insert(
            addr,
            Breakpoint {
                addr,
                orig: code[0],
                resume_at: slot + DISPLACED,
                stub: slot,
                slot: displaced,
                kind,
            },
        );
        Ok(())
    }

    /// A free slot in an area within reach of `module`, mapping a new area
    /// next to it when none is.
    fn slot_for(
        &mut self,
        tid: Tid,
        module: &LoadedModule,
        maps: &[Mapping],
        signals: &mut Vec<i32>,
    ) -> Result<u64, SpaceError> {
        if let Some(area) = self.areas.iter_mut().find(|a| {
            a.next + SLOT_SIZE <= a.start + AREA_SIZE && trampoline::reaches(a.start, &module.range)
        }) {
            let slot = area.next;
            area.next += SLOT_SIZE;
            return Ok(slot);
        }
        let insn = self.syscall_insn().ok_or_else(|| {
            SpaceError::NoRoom("no syscall instruction to map a page with".into())
        })?;
        let candidates =
            trampoline::place_area(maps, &module.range, procfs::mmap_min_addr(), module.is_main);
        for addr in candidates {
            match inject::map_code(tid, insn, addr, AREA_SIZE) {
                Ok(done) => {
                    signals.extend(done.signals);
                    if done.value != addr {
                        continue;
                    }
                    self.areas.push(Area {
                        start: addr,
                        next: addr + SLOT_SIZE,
                    });
                    return Ok(addr);
                }
                Err(inject::InjectError::Errno(libc::EEXIST)) => continue,
                Err(err) => return Err(err.into()),
            }
        }
        Err(SpaceError::NoRoom(module.path.clone()))
    }

    /// Move a thread stopped with `regs` out of the trampoline areas, to the
    /// same place in the original code: before or after a displaced
    /// instruction; at the function's entry from a stub not yet through its
    /// call; at the caller from a stub past its return, as the stub's `ret`
    /// would have left it. `Some(false)` when the thread is in no area,
    /// `Some(true)` when `regs` changed, `None` when it is somewhere in an
    /// area that cannot be mapped back.
    pub fn leave_slots(&self, regs: &mut Regs) -> Option<bool> {
        if !self.in_area(regs.rip) {
            return Some(false);
        }
        // In the copy routine: on to where it would have jumped (the copy is
        // not needed any more), then out of that slot as below.
        self.leave_copy(regs)?;
        for bp in self.breakpoints.values() {
            if let Some(rip) = bp.slot.original_rip(regs.rip, bp.resume_at, bp.addr) {
                regs.rip = rip;
                return Some(true);
            }
            match trampoline::in_stub(regs.rip, bp.stub) {
                InStub::No => {}
                InStub::NotCalled { pop } => {
                    regs.rsp += pop;
                    regs.rip = bp.addr;
                    return Some(true);
                }
                InStub::Returned { at, pop } => {
                    let mut word = [0u8; 8];
                    self.mem.read(regs.rsp + at, &mut word).ok()?;
                    regs.rip = u64::from_le_bytes(word);
                    regs.rsp += pop;
                    return Some(true);
                }
            }
        }
        None
    }

    /// The address of a `pop` + `ret` pair in the program's own code (see
    /// [`trampoline::pop_ret`]): where a call still running through a stub
    /// is sent to return once the trampoline pages are gone.
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
                if self.mem.read(at, &mut buf[..len]).is_err() {
                    break;
                }
                if let Some(offset) = trampoline::pop_ret(&buf[..len]) {
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
                let mut word = [0u8; 8];
                self.mem.read(regs.rsp, &mut word).ok()?;
                regs.rip = u64::from_le_bytes(word);
                regs.rsp += 8;
            }
            None => return Some(false),
        }
        Some(true)
    }

    /// Where a thread at `rip` stands in the copy routine, if it is there.
    pub fn in_copy(&self, rip: u64) -> Option<InCopy> {
        trampoline::in_copy(rip, self.buffers.as_ref()?.routine)
    }

    fn in_area(&self, addr: u64) -> bool {
        self.areas
            .iter()
            .any(|a| (a.start..a.start + AREA_SIZE).contains(&addr))
    }

    /// Unmap every trampoline area, running munmap in the stopped thread
    /// `tid`. Call only when no breakpoint is planted and no thread is in an
    /// area or will return into a stub. Returns signals that
    /// arrived meanwhile, to deliver.
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
        for area in &self.areas {
            let done = inject::syscall(
                tid,
                insn,
                libc::SYS_munmap as u64,
                [area.start, AREA_SIZE, 0, 0, 0, 0],
            )?;
            signals.extend(done.signals);
        }
        if let Some(shared) = &self.shared {
            let done = inject::syscall(
                tid,
                insn,
                libc::SYS_munmap as u64,
                [shared.start, shared.end - shared.start, 0, 0, 0, 0],
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
        for bp in self.breakpoints.values() {
            self.mem.write(bp.addr, &[bp.orig])?;
        }
        self.breakpoints.clear();
        Ok(())
    }

    /// Put every original byte back in another process that has a copy of this
    /// space (a forked child).
    pub fn restore_into(&self, pid: Tid) -> io::Result<()> {
        let child = CodeWriter::open(pid)?;
        for bp in self.breakpoints.values() {
            child.write(bp.addr, &[bp.orig])?;
        }
        Ok(())
    }
}

/// A file mapped with some executable part: a candidate ELF image.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ImageMapping {
    path: String,
    inode: u64,
    /// Start of the mapping at file offset 0, and end of its last mapping.
    start: u64,
    end: u64,
    /// End of the offset-0 mapping (for /proc/PID/map_files).
    first_end: u64,
}

/// Group the file mappings of /proc/PID/maps into images: each mapping at
/// offset 0 starts one, and later mappings of the same file extend it.
fn image_mappings(maps: &[Mapping]) -> Vec<ImageMapping> {
    let mut images: Vec<(ImageMapping, bool)> = Vec::new();
    let mut current: HashMap<(u64, &str), usize> = HashMap::new();
    for m in maps.iter().filter(|m| m.is_file()) {
        let key = (m.inode, m.path.as_str());
        if m.offset == 0 {
            current.insert(key, images.len());
            images.push((
                ImageMapping {
                    path: m.path.clone(),
                    inode: m.inode,
                    start: m.start,
                    end: m.end,
                    first_end: m.end,
                },
                m.exec,
            ));
        } else if let Some(&i) = current.get(&key) {
            let (image, exec) = &mut images[i];
            if m.start >= image.end {
                image.end = m.end;
                *exec |= m.exec;
            }
        }
    }
    images
        .into_iter()
        .filter(|(_, exec)| *exec)
        .map(|(image, _)| image)
        .collect()
}

/// Read and parse an image, through /proc/PID/map_files when possible (it
/// works for deleted files and files in other mount namespaces).
fn load_image(pid: Tid, f: &ImageMapping) -> io::Result<ElfImage> {
    let bytes = std::fs::read(procfs::map_file(pid, f.start, f.first_end))
        .or_else(|_| std::fs::read(f.path.trim_end_matches(" (deleted)")))?;
    crate::symbols::locate::load(&f.path, &bytes).map_err(io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_mappings_into_images() {
        let text = "\
555555554000-555555555000 r--p 00000000 fe:01 10 /usr/bin/prog
555555555000-555555556000 r-xp 00001000 fe:01 10 /usr/bin/prog
555555556000-555555557000 r--p 00002000 fe:01 10 /usr/bin/prog
555555559000-55555557a000 rw-p 00000000 00:00 0 [heap]
7ffff7d80000-7ffff7da8000 r--p 00000000 fe:01 20 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffff7da8000-7ffff7f3d000 r-xp 00028000 fe:01 20 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffff7f3d000-7ffff7f95000 r--p 001bd000 fe:01 20 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffff7fa0000-7ffff7fa4000 r--p 00000000 fe:01 30 /usr/lib/locale/C.utf8/LC_CTYPE
";
        let images = image_mappings(&procfs::parse_maps(text));
        assert_eq!(images.len(), 2, "data-only files are not images");
        assert_eq!(images[0].path, "/usr/bin/prog");
        assert_eq!(images[0].start, 0x555555554000);
        assert_eq!(images[0].end, 0x555555557000);
        assert_eq!(images[1].first_end, 0x7ffff7da8000);
        assert_eq!(images[1].end, 0x7ffff7f95000);
    }
}
