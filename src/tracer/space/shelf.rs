//! Images and the jump probes' unwind tables, parsed and built once per
//! file and shared by every process that maps it.
//!
//! `memptrace -f -- make -j2` of 37 C files starts 112 processes, 37 of
//! them `cc1` (27 MB of code): parsed per process, every one copied the
//! file's code and built its tables again, and memptrace held 744 copies of
//! images at its peak. A file is known by its device, inode, size and
//! modification time (a file rewritten in place is another file) and its
//! path (the name the image is recorded under). The shelf holds weak
//! references: an image lives as long as some process's space or a
//! pending message holds it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};

use super::images::ImageMapping;
use crate::os::procfs;
use crate::os::ptrace::Tid;
use crate::symbols::elf::ElfImage;
use crate::unwind::tables::{self, UnwindTable};

/// What tells one file from another.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct FileKey {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    path: String,
}

#[derive(Default)]
struct Shelf {
    images: HashMap<FileKey, Weak<ElfImage>>,
    /// By the image they were built from (its address while it lives).
    tables: HashMap<usize, (Weak<ElfImage>, Arc<UnwindTable>)>,
}

impl Shelf {
    /// Forget what no one holds any more (at most as many entries as
    /// images alive, plus those dropped since the last look).
    fn prune(&mut self) {
        self.images.retain(|_, image| image.strong_count() > 0);
        self.tables.retain(|_, (image, _)| image.strong_count() > 0);
    }
}

fn shelf() -> MutexGuard<'static, Shelf> {
    static SHELF: LazyLock<Mutex<Shelf>> = LazyLock::new(Mutex::default);
    SHELF
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The image `f` of process `pid`: the one already parsed for the same
/// file, or read (through /proc/PID/map_files when possible: it works for
/// deleted files and files in other mount namespaces) and parsed now.
pub fn image(pid: Tid, f: &ImageMapping) -> io::Result<Arc<ElfImage>> {
    let mut file = File::open(procfs::map_file(pid, f.start, f.first_end))
        .or_else(|_| File::open(f.path.trim_end_matches(" (deleted)")))?;
    let meta = file.metadata()?;
    let key = FileKey {
        dev: meta.dev(),
        ino: meta.ino(),
        size: meta.size(),
        mtime: (meta.mtime(), meta.mtime_nsec()),
        path: f.path.clone(),
    };
    if let Some(image) = shelf().images.get(&key).and_then(Weak::upgrade) {
        return Ok(image);
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    let image = Arc::new(crate::symbols::locate::load(&f.path, &bytes).map_err(io::Error::other)?);
    let mut shelf = shelf();
    shelf.prune();
    // Parsed meanwhile by another thread: one copy is kept.
    if let Some(first) = shelf.images.get(&key).and_then(Weak::upgrade) {
        return Ok(first);
    }
    shelf.images.insert(key, Arc::downgrade(&image));
    Ok(image)
}

/// The jump probes' unwind table of `image`, built once per image.
pub fn table(image: &Arc<ElfImage>) -> Arc<UnwindTable> {
    let at = Arc::as_ptr(image) as usize;
    let alive = |(held, table): &(Weak<ElfImage>, Arc<UnwindTable>)| {
        (held.as_ptr() == Arc::as_ptr(image) && held.strong_count() > 0).then(|| table.clone())
    };
    if let Some(table) = shelf().tables.get(&at).and_then(alive) {
        return table;
    }
    let table = Arc::new(tables::build(image));
    let mut shelf = shelf();
    shelf.prune();
    shelf
        .tables
        .insert(at, (Arc::downgrade(image), table.clone()));
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::procfs;

    /// libc as this test process maps it, under a name of this test's own
    /// (read through /proc/self/map_files): no other test holds its image.
    fn libc(name: &str) -> ImageMapping {
        let maps = procfs::read_maps(std::process::id() as Tid).unwrap();
        let libc = super::super::images::image_mappings(&maps)
            .into_iter()
            .find(|f| f.path.ends_with("/libc.so.6"))
            .expect("libc mapped in the test process");
        ImageMapping {
            path: format!("/shelf-test/{name}/libc.so.6"),
            ..libc
        }
    }

    #[test]
    fn one_image_and_one_table_per_file_while_held() {
        let me = std::process::id() as Tid;
        let f = libc("one");
        let first = image(me, &f).unwrap();
        let again = image(me, &f).unwrap();
        assert!(Arc::ptr_eq(&first, &again), "parsed once");
        assert_eq!(first.path, f.path);
        let table = table(&first);
        assert!(!table.is_empty());
        assert!(Arc::ptr_eq(&table, &super::table(&again)), "built once");
        // Under another name it is another image (its rows name the path).
        let other = image(me, &libc("other")).unwrap();
        assert!(!Arc::ptr_eq(&first, &other));
        // Once no one holds it, it is forgotten and parsed again.
        let weak = Arc::downgrade(&first);
        drop((first, again, table));
        assert_eq!(weak.strong_count(), 0);
        let fresh = image(me, &f).unwrap();
        assert!(Arc::ptr_eq(&fresh, &image(me, &f).unwrap()));
    }
}
