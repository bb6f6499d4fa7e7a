//! One address space of the target: its ELF images ([`images`]), the hooks
//! planted in them ([`Hooks`]), the trampoline areas that serve the hooks
//! ([`areas`]), and the state of its probe mode ([`probing`]): the stack
//! buffers its threads copy their stacks into ([`buffers`]) or the control
//! area of its jump probes ([`control`]).
//!
//! Code changes only through [`Hooks`]: every byte written over the
//! program's code is put back by a detach or, in a forked child that is not
//! traced, before the child runs. Areas and buffers are new mappings, made
//! by running `mmap` in a stopped thread of the target, and go the same way.
//!
//! Here: what a space holds, how it follows the images, and how it goes.
//! Hooking an image is [`plant`]'s; questions about addresses (which image,
//! which area, how a thread leaves one) are [`lookup`]'s.

pub mod areas;
pub mod buffers;
mod control;
#[cfg(test)]
pub mod fake;
#[cfg(test)]
mod fake_tests;
mod gate;
pub mod images;
mod lookup;
mod plant;
pub mod probing;
mod retpaths;
mod shelf;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::ops::Range;

use super::inject;
use super::probes::int3;
use super::probes::jump::code as probe_code;
use super::probes::jump::control::{Control, ControlError};
use super::probes::jump::layout;
use super::probes::jump::plan::NoJump;
use super::probes::{Hook, HookKind, Hooks};
use super::target::{CodeMemory, Live, Target};
use crate::os::procfs;
use crate::os::ptrace::Tid;
use areas::Areas;
use buffers::StackBuffers;
use images::{ImageMapping, LoadedModule};
pub use probing::{Catch, ProbeInfo, Probing};

#[derive(Debug, thiserror::Error)]
pub enum SpaceError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("no room for a trampoline page within reach of {0}")]
    NoRoom(String),
    /// Code made for a place came out longer than the room made for it
    /// (branches encoded longer there than where it was measured).
    #[error("{module}: the {what} came out longer than the room made for it")]
    Grew { module: String, what: &'static str },
    /// Injecting a system call needs a `syscall` instruction in the
    /// process's code (the one memptrace plants is not there yet).
    #[error("no system call instruction in the process's code to {0} with")]
    NoSyscall(&'static str),
    /// Every trampoline slot of the space's areas is taken.
    #[error("no free trampoline slot for {0}")]
    NoSlot(&'static str),
    /// The memory shared with the jump probes could not be made.
    #[error("{}", crate::util::with_causes(.0))]
    Control(ControlError),
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

/// How one allocator (or, attached with jump probes, mapping) function was
/// hooked, for the trace's `meta`.
#[derive(Clone, Debug)]
pub struct Planted {
    pub module: String,
    /// Its names.
    pub ops: Vec<&'static str>,
    pub how: How,
}

/// How a function was hooked. Its text (`jump`, `int3: why`, `none: why`)
/// is what the trace's `meta` says of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum How {
    /// A jump to its probe.
    Jump,
    /// An int3 on its entry: asked for (`--probes int3`: no reason), or
    /// where a jump probe could not be used.
    Int3(Option<Int3Why>),
    /// Not hooked at all: its calls are not recorded.
    Unhooked(Unhooked),
}

/// Why a jump probe's function has an int3.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Int3Why {
    /// The bytes a jump would overwrite are not safe to take.
    Plan(NoJump),
    /// The space gave up jump probes, for this reason (a seccomp filter
    /// refusing what they need, no memory shared with memptrace...).
    FellBack(String),
}

/// Why a function was left without a hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unhooked {
    /// The dynamic linker's debug hook, served otherwise.
    DebugState,
    /// Someone else's breakpoint is there: displacing it would change what
    /// the program does.
    EntryIsInt3,
    /// A mapping function where a jump is not safe: an int3 would kill the
    /// process if memptrace died (attach, see `tracer::failopen`).
    NeedsJump(NoJump),
}

impl std::fmt::Display for How {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            How::Jump => write!(f, "jump"),
            How::Int3(None) => write!(f, "int3"),
            How::Int3(Some(Int3Why::Plan(why))) => write!(f, "int3: {why}"),
            How::Int3(Some(Int3Why::FellBack(why))) => write!(f, "int3: {why}"),
            How::Unhooked(Unhooked::DebugState) => write!(f, "none"),
            How::Unhooked(Unhooked::EntryIsInt3) => {
                write!(f, "none: the entry is an int3 already")
            }
            How::Unhooked(Unhooked::NeedsJump(why)) => write!(
                f,
                "none: {why} (an int3 would kill the process if memptrace died; its calls are not recorded)"
            ),
        }
    }
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
    /// The space's memory, through the target port: read, and written
    /// only to plant or restore.
    mem: Box<dyn CodeMemory>,
    pub hooks: Hooks,
    areas: Areas,
    /// Mapped images by start address.
    pub modules: BTreeMap<u64, LoadedModule>,
    exe: Option<String>,
    /// The probe mode, and what it needs.
    probing: Probing,
    /// The target's range of the stack buffers' shared mapping, to unmap at
    /// detach (a forked child has one too, inherited, that it does not use).
    shared: Option<Range<u64>>,
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
        let exe = procfs::exe(pid).map(|p| p.to_string_lossy().into_owned());
        let probing = Probing::new(catch, || procfs::fsgsbase(pid));
        Ok(Space::with_memory(pid, Live.code(pid)?, exe, probing))
    }

    /// The space of process `pid` whose memory is `mem` (the target port's:
    /// a fake one in tests), its executable `exe`.
    pub fn with_memory(
        pid: Tid,
        mem: Box<dyn CodeMemory>,
        exe: Option<String>,
        probing: Probing,
    ) -> Space {
        Space {
            pid,
            mem,
            hooks: Hooks::default(),
            areas: Areas::default(),
            modules: BTreeMap::new(),
            exe,
            probing,
            shared: None,
            refused: None,
            stub: None,
            return_rows: HashMap::new(),
            ahead: images::Ahead::default(),
        }
    }

    /// The control area of the jump probes, once made.
    pub fn control(&self) -> Option<&Control> {
        self.probing.control()
    }

    pub fn control_mut(&mut self) -> Option<&mut Control> {
        self.probing.control_mut()
    }

    /// The control area of the jump probes, once made, and what each probe
    /// serves.
    pub fn recording_mut(&mut self) -> Option<(&mut Control, &[ProbeInfo])> {
        self.probing.recording_mut()
    }

    /// What jump probe `id` serves.
    pub fn probe_info(&self, id: u16) -> Option<&ProbeInfo> {
        self.probing.probe_info(id)
    }

    /// Where threads copy their own stacks (int3 probes), once set up.
    pub fn buffers(&self) -> Option<&StackBuffers> {
        self.probing.buffers()
    }

    pub fn buffers_mut(&mut self) -> Option<&mut StackBuffers> {
        self.probing.buffers_mut()
    }

    /// The space of a child forked from this one (`pid`), which has copies of
    /// the same hooks, trampoline pages and images. Its modules get ids of
    /// their own, taken from `next_id`.
    pub fn fork_copy(&self, pid: Tid, next_id: &mut u64) -> io::Result<Space> {
        self.fork_copy_in(pid, Live.code(pid)?, next_id)
    }

    /// [`Space::fork_copy`], the child's memory being `mem`.
    pub fn fork_copy_in(
        &self,
        pid: Tid,
        mem: Box<dyn CodeMemory>,
        next_id: &mut u64,
    ) -> io::Result<Space> {
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
            mem,
            hooks,
            areas: self.areas.clone(),
            modules,
            exe: self.exe.clone(),
            // The child's copy of the shared mapping is still shared with
            // the parent: it copies stacks the old way, and the mapping goes
            // with the trampoline pages. Its control area, likewise, is its
            // parent's until it gets one of its own (`adopt_control`).
            probing: self.probing.fork_copy(),
            shared: self.shared.clone(),
            refused: None,
            // In the child's copy of the trampoline areas.
            stub: self.stub,
            return_rows: HashMap::new(),
            ahead: images::Ahead::default(),
        })
    }

    /// Re-read the memory map; hook images that appeared, forget those gone.
    /// `tid` is a stopped thread of this space, used to map trampoline pages.
    pub fn refresh(&mut self, tid: Tid, next_id: &mut u64) -> io::Result<Changes> {
        let maps = self.mem.maps()?;
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

        if let Some(control) = self.probing.control_mut() {
            for module in &changes.removed {
                control.remove_image(module.range.start);
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
        if !changes.added.is_empty() && self.probing.control_to_make() {
            if let Err(err) = self.make_control(tid, &changes.added[0], &maps, &mut changes.signals)
            {
                let why = crate::util::with_causes(&err);
                changes.warnings.push(format!(
                    "process {}: jump probes cannot record without memory shared with memptrace, int3 probes catch its calls: {why}",
                    self.pid
                ));
                self.probing.fall_back(why);
            }
        }
        // Images whose allocator functions a jump probe's walk can leave.
        let mut walkable = HashSet::new();
        if let Some(control) = self.probing.control_mut() {
            for module in &changes.added {
                let table = self
                    .ahead
                    .take_table(module)
                    .unwrap_or_else(|| shelf::table(&module.image));
                if plant::allocator_walkable(&module.image, &table) {
                    walkable.insert(module.range.start);
                }
                control.add_image(module.range.clone(), module.bias.0, &table);
            }
        }
        // What was read ahead served the first look at the images.
        self.ahead = images::Ahead::default();
        let added = changes.added.clone();
        for module in &added {
            let walkable = walkable.contains(&module.range.start);
            if let Err(err) = self.hook(tid, module, &maps, walkable, &mut changes) {
                if let SpaceError::Inject(inject::InjectError::Forbidden(why)) = &err {
                    self.refused.get_or_insert_with(|| why.to_string());
                }
                changes.warnings.push(format!("{}: {err}", module.path));
            }
        }
        if self.probing.buffers_to_make() && !self.areas.is_empty() {
            let made = self.set_up_buffers(tid, &mut changes.signals);
            let failed = made.as_ref().err().map(ToString::to_string);
            self.probing.set_buffers(made.ok());
            if let Some(err) = failed {
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
            None => shelf::image(self.pid, f)?,
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

    /// Unmap every trampoline area, running munmap in the stopped thread
    /// `tid`. Call only when no hook is planted and no thread is in an area
    /// or will return into a stub. Returns signals that arrived meanwhile,
    /// to deliver.
    pub fn unmap_areas(&mut self, tid: Tid) -> Result<Vec<i32>, SpaceError> {
        let signals = self.unmap_areas_in(tid)?;
        self.areas.clear();
        self.stub = None;
        self.shared = None;
        self.probing.unmapped();
        Ok(signals)
    }

    /// Unmap the trampoline areas in the process of the stopped thread `tid`:
    /// this one, or a forked copy of it, which has the same areas. The area
    /// that holds the stub goes last, through a copy of the stub lent to page
    /// padding (see [`inject`]).
    pub fn unmap_areas_in(&self, tid: Tid) -> Result<Vec<i32>, SpaceError> {
        let via = self.via().ok_or(SpaceError::NoSyscall("unmap"))?;
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
            let done = self.through_a_stub(tid, via, |via| {
                inject::syscall(
                    tid,
                    via,
                    libc::SYS_munmap as u64,
                    [range.start, range.end - range.start, 0, 0, 0, 0],
                )
            })?;
            signals.extend(done.signals);
        }
        Ok(signals)
    }

    /// Put every original byte back, the probes still known (to move
    /// threads out of their code, see [`Space::leave_areas`]).
    pub fn put_back_code(&self) -> io::Result<()> {
        self.put_back_into(&*self.mem)
    }

    /// Put every original byte back (before detaching), and forget the
    /// hooks.
    pub fn restore_all(&mut self) -> io::Result<()> {
        self.put_back_code()?;
        self.hooks.clear();
        Ok(())
    }

    /// Put every original byte of the hooks back through `mem`: this
    /// space's, or a forked child's, which holds a copy of the same code.
    pub fn put_back_into(&self, mem: &dyn CodeMemory) -> io::Result<()> {
        for hook in self.hooks.iter() {
            mem.write_code(hook.addr, &hook.orig)?;
        }
        Ok(())
    }

    /// Write `hook`'s patch over the entry (its code is in place) and book
    /// it: the one way a probe enters the program's code.
    fn plant_hook(&mut self, hook: Hook) -> io::Result<()> {
        let patch = hook.probe.patch(hook.addr).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the probe of {:#x} is out of a jump's reach", hook.addr),
            )
        })?;
        self.mem.write_code(hook.addr, &patch)?;
        self.hooks.book(hook);
        Ok(())
    }
}
