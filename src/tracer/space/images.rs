//! The ELF images of an address space, as found in /proc/PID/maps: each
//! file mapped with an executable part, parsed once (goblin), with the
//! addresses it was loaded at.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use crate::addr::LoadBias;
use crate::os::procfs::{self, Mapping};
use crate::os::ptrace::Tid;
use crate::sink::ModuleRecord;
use crate::symbols::elf::ElfImage;
use crate::trace_msg::MappedImage;
use crate::unwind::tables::UnwindTable;

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
            static_exe: self.image.is_static_exe,
        }
    }
}

/// A file mapped with some executable part: a candidate ELF image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageMapping {
    pub path: String,
    pub inode: u64,
    /// Start of the mapping at file offset 0, and end of its last mapping.
    pub start: u64,
    pub end: u64,
    /// End of the offset-0 mapping (for /proc/PID/map_files).
    pub first_end: u64,
}

/// Group the file mappings of /proc/PID/maps into images: each mapping at
/// offset 0 starts one, and later mappings of the same file extend it.
pub fn image_mappings(maps: &[Mapping]) -> Vec<ImageMapping> {
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

/// An image read ahead, and its unwind table when asked for.
type ReadAhead = (Arc<ElfImage>, Option<Arc<UnwindTable>>);

/// The images of a process read and parsed before its threads stop (and,
/// for jump probes, their unwind tables built): an attach to a program
/// with a JVM's images spent 75-155 ms of its stop on them. Each is taken
/// by the space only for the same file (inode) at the same address.
#[derive(Default)]
pub struct Ahead {
    images: HashMap<(u64, u64), ReadAhead>,
}

impl Ahead {
    /// Read ahead every image process `pid` maps now; `tables`: build
    /// the jump probes' unwind tables too. What fails is left to the stop.
    pub fn read(pid: Tid, tables: bool) -> Ahead {
        let Ok(maps) = procfs::read_maps(pid) else {
            return Ahead::default();
        };
        let images = image_mappings(&maps)
            .iter()
            .filter_map(|f| {
                let image = super::shelf::image(pid, f).ok()?;
                let table = tables.then(|| super::shelf::table(&image));
                Some(((f.start, f.inode), (image, table)))
            })
            .collect();
        Ahead { images }
    }

    /// `image`, read ahead for the mapping `f` (a test's: no unwind table).
    #[cfg(test)]
    pub fn of(f: &ImageMapping, image: Arc<ElfImage>) -> Ahead {
        let images = HashMap::from([((f.start, f.inode), (image, None))]);
        Ahead { images }
    }

    /// The image read ahead for `f`, if the same file was there.
    pub fn image(&self, f: &ImageMapping) -> Option<Arc<ElfImage>> {
        let (image, _) = self.images.get(&(f.start, f.inode))?;
        (image.path == f.path).then(|| image.clone())
    }

    /// The unwind table read ahead for the image `module` (once).
    pub fn take_table(&mut self, module: &LoadedModule) -> Option<Arc<UnwindTable>> {
        let (image, table) = self.images.get_mut(&(module.range.start, module.inode))?;
        if Arc::ptr_eq(image, &module.image) {
            table.take()
        } else {
            None
        }
    }
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
