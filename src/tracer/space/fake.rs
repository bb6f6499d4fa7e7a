//! A space on a fake target, for unit tests: the C library this test runs
//! on, parsed from its file, its code mapped into a [`FakeMemory`] at a
//! fixed address, and one trampoline area of zeros within reach of it (so
//! that planting needs no injected system call). What a test checks is
//! what changed in those buffers against the image's own bytes.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use super::buffers::StackBuffers;
use super::images::LoadedModule;
use super::{Catch, Changes, Control, Probing, Space, layout};
use crate::addr::{LoadBias, Svma};
use crate::os::procfs::Mapping;
use crate::os::ptrace::Tid;
use crate::os::shared::{self, SharedMemory};
use crate::symbols::elf::ElfImage;
use crate::tracer::target::fake::FakeMemory;

/// The process of the fake space.
pub const PID: Tid = 4242;
/// Where the C library's image starts in it.
pub const BASE: u64 = 0x7f10_0000_0000;
/// The trampoline area: 1 MiB below the image.
pub const AREA: u64 = BASE - (1 << 20);
pub const AREA_LEN: u64 = 256 << 10;
/// Where the jump probes' control area is in it (not in its memory: the
/// probes' code, which reads it, is never run here).
pub const CONTROL: u64 = AREA - layout::AREA_SIZE;

/// The C library this test process runs on, parsed once.
pub fn libc_image() -> Arc<ElfImage> {
    static IMAGE: OnceLock<Arc<ElfImage>> = OnceLock::new();
    IMAGE
        .get_or_init(|| {
            let maps = crate::os::procfs::read_maps(std::process::id() as Tid).unwrap();
            let path = maps
                .iter()
                .find(|m| m.path.ends_with("/libc.so.6"))
                .map(|m| m.path.clone())
                .expect("libc mapped in the test process");
            let bytes = std::fs::read(&path).unwrap();
            Arc::new(ElfImage::parse(&path, &bytes).unwrap())
        })
        .clone()
}

/// An int3 space of process `pid` with no image in it, on `mem`, whose
/// threads copy their own stacks into `buffers`.
pub fn with_buffers(pid: Tid, mem: FakeMemory, buffers: StackBuffers) -> Space {
    let mut probing = Probing::new(Catch::Int3 { buffers: true }, || false);
    probing.set_buffers(Some(buffers));
    Space::with_memory(pid, Box::new(mem), None, probing)
}

/// A fake space and what it was made of.
pub struct FakeSpace {
    pub space: Space,
    pub mem: FakeMemory,
    pub module: LoadedModule,
    /// The image's executable segments as mapped: (address, bytes).
    pub code: Vec<(u64, Vec<u8>)>,
}

impl FakeSpace {
    /// The C library in an int3 space of process [`PID`], not hooked yet;
    /// `area`: with the trampoline area mapped and known to the space.
    pub fn libc(area: bool) -> FakeSpace {
        let image = libc_image();
        let first = image
            .segments
            .iter()
            .map(|s| s.vaddr & !0xfff)
            .min()
            .unwrap();
        let bias = LoadBias(BASE - first);
        let mem = FakeMemory::new();
        let mut code = Vec::new();
        for seg in &image.code {
            let at = bias.to_avma(Svma(seg.svma.start)).0;
            mem.map(at, seg.data.to_vec());
            code.push((at, seg.data.to_vec()));
        }
        let module = LoadedModule {
            id: 7,
            path: image.path.clone(),
            inode: 99,
            range: image.avma_range(bias),
            bias,
            image,
            is_main: false,
        };
        let probing = Probing::new(Catch::Int3 { buffers: false }, || false);
        let mut space = Space::with_memory(PID, Box::new(mem.clone()), None, probing);
        space.modules.insert(module.range.start, module.clone());
        if area {
            mem.map(AREA, vec![0; AREA_LEN as usize]);
            space.areas.add(AREA, AREA_LEN, 0);
        }
        FakeSpace {
            space,
            mem,
            module,
            code,
        }
    }

    /// The C library in a jump-probe space of process [`PID`], not hooked
    /// yet, its control area made: memptrace's side of it in the space,
    /// and the probes' side, returned, for a test to write what the probes
    /// would.
    pub fn libc_jumps() -> (FakeSpace, SharedMemory) {
        let mut fake = FakeSpace::libc(true);
        let (ours, probes) = shared::pair_for_tests(layout::AREA_SIZE as usize).expect("a memfd");
        let catch = Catch::Jump {
            max_frames: 16,
            alive_ticks: 0,
        };
        fake.space.probing = Probing::new(catch, || false);
        fake.space
            .probing
            .install_control(Control::over(CONTROL, ours));
        (fake, probes)
    }

    /// The C library's mapping as `/proc/PID/maps` lists it: one
    /// executable mapping of the file over the whole image.
    pub fn maps(&self) -> Vec<Mapping> {
        vec![Mapping {
            start: self.module.range.start,
            end: self.module.range.end,
            read: true,
            write: false,
            exec: true,
            offset: 0,
            inode: self.module.inode,
            path: self.module.path.clone(),
        }]
    }

    /// Hook the C library as a refresh does (allocator and mapping
    /// functions, `_dl_debug_state`).
    pub fn hook(&mut self) -> Changes {
        let mut changes = Changes::default();
        let module = self.module.clone();
        let table = super::shelf::table(&module.image);
        let walkable = super::plant::allocator_walkable(&module.image, &table);
        self.space
            .hook(PID, &module, &[], walkable, &mut changes)
            .expect("hooked on the fake");
        changes
    }

    /// Every byte of the image's code that differs from the file's, by
    /// address.
    pub fn changed_code(&self) -> HashMap<u64, (u8, u8)> {
        let mut changed = HashMap::new();
        for (at, orig) in &self.code {
            let now = self.mem.bytes(*at, orig.len());
            for (i, (&was, &is)) in orig.iter().zip(&now).enumerate() {
                if was != is {
                    changed.insert(at + i as u64, (was, is));
                }
            }
        }
        changed
    }
}
