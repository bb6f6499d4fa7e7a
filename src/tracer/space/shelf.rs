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
//! pending message holds it, or while it is among the images used last
//! (at most [`KEPT_BYTES`] of them, [`KEPT_IMAGES`] at most): `make` runs
//! cc1 after cc1, each one often after the previous one ended, and the
//! table of each would be built again.

use std::collections::{HashMap, VecDeque};
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

/// How much the images kept after their last holder may weigh
/// ([`weight`]): cc1 with its libraries, a gcc's set, weighs about 45 MB.
const KEPT_BYTES: usize = 128 << 20;
/// How many images may be kept after their last holder.
const KEPT_IMAGES: usize = 64;

struct Shelf {
    images: HashMap<FileKey, Weak<ElfImage>>,
    /// By the image they were built from (its address while it lives).
    tables: HashMap<usize, (Weak<ElfImage>, Arc<UnwindTable>)>,
    /// The images used last, the latest last: kept alive, and with them
    /// their tables, within `kept_bytes` and `kept_images`.
    recent: VecDeque<Arc<ElfImage>>,
    kept_bytes: usize,
    kept_images: usize,
}

impl Default for Shelf {
    fn default() -> Self {
        Shelf {
            images: HashMap::new(),
            tables: HashMap::new(),
            recent: VecDeque::new(),
            kept_bytes: KEPT_BYTES,
            kept_images: KEPT_IMAGES,
        }
    }
}

impl Shelf {
    /// `image` was just used: keep it, and let go of the least recently
    /// used ones beyond the bounds.
    fn used(&mut self, image: &Arc<ElfImage>) {
        if let Some(i) = self.recent.iter().position(|r| Arc::ptr_eq(r, image)) {
            self.recent.remove(i);
        }
        self.recent.push_back(image.clone());
        self.bound();
    }

    /// Let go of the least recently used images beyond the bounds.
    fn bound(&mut self) {
        let weigh = |image: &Arc<ElfImage>| {
            let table = self.tables.get(&(Arc::as_ptr(image) as usize));
            weight(image) + table.map_or(0, |(_, table)| table.len() * 8)
        };
        let mut total: usize = self.recent.iter().map(weigh).sum();
        while total > self.kept_bytes || self.recent.len() > self.kept_images {
            let Some(oldest) = self.recent.pop_front() else {
                break;
            };
            total -= weigh(&oldest);
        }
    }

    /// Forget what no one holds any more (at most as many entries as
    /// images alive, plus those dropped since the last look).
    fn prune(&mut self) {
        self.images.retain(|_, image| image.strong_count() > 0);
        self.tables.retain(|_, (image, _)| image.strong_count() > 0);
    }
}

/// About the bytes `image` holds: its largest parts, the copies of its code
/// and of its unwind sections.
fn weight(image: &ElfImage) -> usize {
    let sections = [&image.eh_frame, &image.eh_frame_hdr, &image.debug_frame];
    let code: usize = image.code.iter().map(|c| c.data.len()).sum();
    code + sections
        .iter()
        .flat_map(|s| s.as_ref())
        .map(|s| s.data.len())
        .sum::<usize>()
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
    {
        let mut shelf = shelf();
        if let Some(image) = shelf.images.get(&key).and_then(Weak::upgrade) {
            shelf.used(&image);
            return Ok(image);
        }
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    let image = Arc::new(crate::symbols::locate::load(&f.path, &bytes).map_err(io::Error::other)?);
    let mut shelf = shelf();
    shelf.prune();
    // Parsed meanwhile by another thread: one copy is kept.
    if let Some(first) = shelf.images.get(&key).and_then(Weak::upgrade) {
        shelf.used(&first);
        return Ok(first);
    }
    shelf.images.insert(key, Arc::downgrade(&image));
    shelf.used(&image);
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
    // The table weighs on the images kept.
    shelf.bound();
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
    fn one_image_and_one_table_per_file() {
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
        // Once no one holds it, it is kept still, and its table with it:
        // the next process to map the file finds both.
        let (weak, table_at) = (Arc::downgrade(&first), Arc::as_ptr(&table));
        drop((first, again, table, other));
        let fresh = image(me, &f).unwrap();
        assert!(fresh.path == f.path && Arc::as_ptr(&fresh) == weak.as_ptr());
        assert_eq!(
            Arc::as_ptr(&super::table(&fresh)),
            table_at,
            "not built again"
        );
    }

    #[test]
    fn keeps_the_images_used_last_within_its_bounds() {
        let bytes = std::fs::read("/lib/x86_64-linux-gnu/libc.so.6").unwrap();
        let libc = ElfImage::parse("libc.so.6", &bytes).unwrap();
        let [a, b, c] = [(); 3].map(|()| Arc::new(libc.clone()));
        let mut shelf = Shelf {
            kept_images: 2,
            ..Shelf::default()
        };
        for image in [&a, &b, &a, &c] {
            shelf.used(image);
        }
        let kept: Vec<_> = shelf.recent.iter().map(Arc::as_ptr).collect();
        assert_eq!(
            kept,
            [Arc::as_ptr(&a), Arc::as_ptr(&c)],
            "b used least lately"
        );
        assert_eq!(Arc::strong_count(&b), 1);
        // By bytes: a table weighs 8 bytes a row.
        let table = Arc::new(tables::build(&a));
        let at = Arc::as_ptr(&a) as usize;
        shelf.tables.insert(at, (Arc::downgrade(&a), table.clone()));
        shelf.kept_bytes = weight(&a) + table.len() * 8 + weight(&c);
        shelf.bound();
        assert_eq!(shelf.recent.len(), 2);
        shelf.kept_bytes -= 1;
        shelf.bound();
        let kept: Vec<_> = shelf.recent.iter().map(Arc::as_ptr).collect();
        assert_eq!(kept, [Arc::as_ptr(&c)]);
        assert_eq!(Arc::strong_count(&a), 1);
        assert!(weight(&a) > 1 << 20, "libc's code: {}", weight(&a));
    }
}
