//! Where glibc's allocator keeps its state in a process, and how that state
//! is laid out: the runtime addresses of `main_arena` and `mp_` (from the
//! symbol table of libc, of its debug file, or of a static executable), and
//! the offsets of the fields the walk reads.
//!
//! The offsets come from the DWARF of `malloc.c` in the same file as the
//! symbols ([`super::dwarf`]) when it has them; otherwise they are glibc's
//! x86-64 layout since 2.27 (`malloc/malloc.c`, `malloc/arena.c`), told
//! apart by the sizes of the two symbols: 2200 bytes
//! of `malloc_state` (with `have_fastchunks`, 2.27+), and 112 bytes of
//! `malloc_par` (2.27–2.34) or 136 (2.35+: `thp_pagesize`, `hp_pagesize`,
//! `hp_flags`). Any other size is refused rather than guessed at.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use goblin::elf::{Elf, program_header, section_header};

use super::HeapError;
use crate::os::procfs::Mapping;
use crate::symbols::elf::build_id;
use crate::symbols::symbolize::{DEFAULT_DEBUG_ROOT, debug_file, parse_debuglink};

/// Offsets (bytes) and constants of glibc's allocator structures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// `sizeof(struct malloc_state)`.
    pub state_size: u64,
    /// `malloc_state.fastbinsY`, and how many there are (`NFASTBINS`).
    pub fastbins: u64,
    pub nfastbins: usize,
    pub top: u64,
    /// `malloc_state.bins`: `NBINS` (128) bins of two pointers, bin 0 unused.
    pub bins: u64,
    pub nbins: usize,
    pub next: u64,
    pub system_mem: u64,
    /// `malloc_par` fields.
    pub n_mmaps: u64,
    pub mmapped_mem: u64,
    pub sbrk_base: u64,
    /// Free-list pointers are mangled (`PROTECT_PTR`, 2.32+); `None` when
    /// the version does not say and each list is tried both ways.
    pub safe_linking: Option<bool>,
    /// The tcache structures this glibc may have: (chunk size, bytes per
    /// count). 64 bins (`TCACHE_MAX_BINS`).
    pub tcache: Vec<(u64, u64)>,
    /// `HEAP_MAX_SIZE`: a thread arena's heaps are aligned to it.
    pub heap_max: u64,
}

/// `TCACHE_MAX_BINS`.
pub const TCACHE_BINS: usize = 64;

impl Layout {
    /// The layout of a glibc whose `main_arena` and `mp_` have these sizes.
    pub fn for_sizes(arena_size: u64, mp_size: u64) -> Option<Layout> {
        if arena_size != 2200 {
            return None;
        }
        let (n_mmaps, mmapped_mem, sbrk_base, safe_linking, tcache) = match mp_size {
            136 => (60, 80, 96, Some(true), vec![(0x290, 2)]),
            112 => (40, 56, 72, None, vec![(0x290, 2), (0x250, 1)]),
            _ => return None,
        };
        Some(Layout {
            state_size: 2200,
            fastbins: 0x10,
            nfastbins: 10,
            top: 0x60,
            bins: 0x70,
            nbins: 128,
            next: 0x870,
            system_mem: 0x888,
            n_mmaps,
            mmapped_mem,
            sbrk_base,
            safe_linking,
            tcache,
            heap_max: 64 << 20,
        })
    }
}

/// glibc's allocator in one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Glibc {
    /// The image that holds it (libc.so.6, or a static executable).
    pub image: String,
    pub main_arena: u64,
    pub mp: u64,
    /// `narenas` (arena.c): arenas created, counted before one is made and
    /// linked; `None` when the symbol is missing.
    pub narenas: Option<u64>,
    pub layout: Layout,
}

/// An object symbol: its file address and size.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    value: u64,
    size: u64,
}

/// What one ELF file says about glibc's allocator, wherever it is loaded:
/// worked out once per file (reading a C library's DWARF takes tens of
/// milliseconds) and kept for the next heap map of any process.
#[derive(Debug)]
enum ImageFacts {
    /// musl's allocator, which the walk does not know.
    Musl,
    /// No `main_arena`/`mp_` in the file or its debug file; `is_libc`: the
    /// file is a C library (or a static executable) that should have them.
    NoSymbols { is_libc: bool },
    Allocator {
        arena: Symbol,
        mp: Symbol,
        narenas: Option<Symbol>,
        /// The layout the DWARF states, if it has malloc.c's.
        layout: Option<Box<Layout>>,
        /// `(p_offset, p_vaddr)` of each loadable segment.
        segments: Vec<(u64, u64)>,
    },
}

/// A file as it is now: replaced, it is another.
type FileKey = (PathBuf, u64, u64, u64, i64, i64, Vec<PathBuf>);

/// The files worked out so far.
type Known = Vec<(FileKey, Arc<ImageFacts>)>;

/// What heap maps know of glibc's allocator in ELF files, worked out once
/// per file and shared by its clones: the namer thread reads a C library's
/// facts ahead ([`Facts::prepare`]) for the heap map the tracer takes later
/// from the same `Facts`.
#[derive(Clone, Default)]
pub struct Facts(Arc<Mutex<Known>>);

impl Facts {
    fn lock(&self) -> MutexGuard<'_, Known> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Read ahead what a heap map of a process using the C library or
    /// static executable at `path` will need, so that the map, taken while
    /// the process waits, does not spend tens of milliseconds in DWARF.
    pub fn prepare(&self, path: &Path) {
        ImageFacts::of(path, &[PathBuf::from(DEFAULT_DEBUG_ROOT)], self);
    }
}

impl ImageFacts {
    /// The facts of the file at `path` (`None`: it cannot be read, or is no
    /// ELF file), from `cache` when it knows them.
    fn of(path: &Path, debug_roots: &[PathBuf], cache: &Facts) -> Option<Arc<ImageFacts>> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).ok()?;
        let key = (
            path.to_path_buf(),
            meta.dev(),
            meta.ino(),
            meta.size(),
            meta.mtime(),
            meta.mtime_nsec(),
            debug_roots.to_vec(),
        );
        let known = |facts: &Known| {
            facts
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, f)| f.clone())
        };
        if let Some(found) = known(&cache.lock()) {
            return Some(found);
        }
        // A dynamically linked executable has none of glibc's allocator in
        // it (its C library has): its bytes are not read (99 MB for node,
        // which were most of memptrace's memory at its exit map).
        let facts = if !named_as_libc(path) && has_interpreter(path) == Some(true) {
            Arc::new(ImageFacts::NoSymbols { is_libc: false })
        } else {
            let bytes = std::fs::read(path).ok()?;
            Arc::new(ImageFacts::read(path, &bytes, debug_roots)?)
        };
        let mut all = cache.lock();
        Some(known(&all).unwrap_or_else(|| {
            all.push((key, facts.clone()));
            facts
        }))
    }

    fn read(path: &Path, bytes: &[u8], debug_roots: &[PathBuf]) -> Option<ImageFacts> {
        let elf = Elf::parse(bytes).ok()?;
        if symbol(&elf, "__libc_malloc_impl").is_some() {
            return Some(ImageFacts::Musl);
        }
        let (arena, mp, narenas, layout) = match (symbol(&elf, "main_arena"), symbol(&elf, "mp_")) {
            (Some(a), Some(m)) => (a, m, symbol(&elf, "narenas"), super::dwarf::layout(bytes)),
            _ => match from_debug_file(path, &elf, bytes, debug_roots) {
                Some(found) => found,
                None => {
                    let is_libc = symbol(&elf, "malloc").is_some()
                        && (elf.interpreter.is_none() || named_as_libc(path));
                    return Some(ImageFacts::NoSymbols { is_libc });
                }
            },
        };
        let segments = elf
            .program_headers
            .iter()
            .filter(|ph| ph.p_type == program_header::PT_LOAD)
            .map(|ph| (ph.p_offset, ph.p_vaddr))
            .collect();
        Some(ImageFacts::Allocator {
            arena,
            mp,
            narenas,
            layout: layout.map(Box::new),
            segments,
        })
    }

    /// Runtime address minus file address for the image at `path`, from the
    /// mapping of its first loadable segment.
    fn load_bias(&self, maps: &[Mapping], path: &str) -> Option<u64> {
        let ImageFacts::Allocator { segments, .. } = self else {
            return None;
        };
        let page = |x: u64| x & !0xfff;
        maps.iter().filter(|m| m.path == path).find_map(|m| {
            segments
                .iter()
                .find(|&&(offset, _)| page(offset) == m.offset)
                .map(|&(_, vaddr)| m.start.wrapping_sub(page(vaddr)))
        })
    }
}

/// A file with an interpreter (a dynamically linked executable) is taken
/// for a C library only when its name says so: glibc's `libc.so.6` names
/// one, and can be run.
fn named_as_libc(path: &Path) -> bool {
    path.to_string_lossy().contains("libc")
}

/// Whether the ELF file at `path` names an interpreter (`PT_INTERP`: it is
/// linked dynamically), from its first 64 KiB, where its program headers
/// are. `None`: no ELF file, or program headers beyond them.
fn has_interpreter(path: &Path) -> Option<bool> {
    use std::io::Read;
    let mut head = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(64 << 10)
        .read_to_end(&mut head)
        .ok()?;
    let header = Elf::parse_header(&head).ok()?;
    let ctx = goblin::container::Ctx::new(header.container().ok()?, header.endianness().ok()?);
    let offset = usize::try_from(header.e_phoff).ok()?;
    let headers =
        program_header::ProgramHeader::parse(&head, offset, usize::from(header.e_phnum), ctx)
            .ok()?;
    Some(
        headers
            .iter()
            .any(|ph| ph.p_type == program_header::PT_INTERP),
    )
}

/// A file named as glibc names its C library (`libc.so.6`, `libc-2.31.so`).
pub fn is_c_library(path: &str) -> bool {
    let base = path.rsplit('/').next().unwrap_or("");
    base.starts_with("libc.so") || base.starts_with("libc-")
}

impl Glibc {
    /// Find glibc's allocator among a process's mappings: in its C library
    /// (`libc.so.6`, symbols from the debug file under `debug_roots`), or in
    /// the executable `exe` when it is static. What files say is kept in
    /// `facts`.
    pub fn find(
        maps: &[Mapping],
        exe: Option<&Path>,
        debug_roots: &[PathBuf],
        facts: &Facts,
    ) -> Result<Glibc, HeapError> {
        if maps.iter().any(|m| m.path.contains("ld-musl")) {
            return Err(HeapError::Musl);
        }
        let mut images: Vec<&str> = Vec::new();
        let exe = exe.and_then(Path::to_str);
        for m in maps.iter().filter(|m| m.is_file()) {
            let libc = is_c_library(&m.path);
            if (libc || Some(m.path.as_str()) == exe) && !images.contains(&m.path.as_str()) {
                images.push(&m.path);
            }
        }
        let mut missing = None;
        for path in images {
            let found = match ImageFacts::of(Path::new(path), debug_roots, facts) {
                Some(found) => found,
                None => continue,
            };
            let (arena, mp, narenas, dwarf) = match &*found {
                ImageFacts::Musl => return Err(HeapError::Musl),
                ImageFacts::NoSymbols { is_libc } => {
                    if *is_libc {
                        missing = Some(path.to_string());
                    }
                    continue;
                }
                ImageFacts::Allocator {
                    arena,
                    mp,
                    narenas,
                    layout,
                    ..
                } => (*arena, *mp, *narenas, layout.as_deref().cloned()),
            };
            let Some(bias) = found.load_bias(maps, path) else {
                continue;
            };
            let layout = match dwarf {
                Some(layout) if layout.state_size == arena.size => layout,
                _ => Layout::for_sizes(arena.size, mp.size).ok_or(HeapError::Layout {
                    arena_size: arena.size,
                    mp_size: mp.size,
                })?,
            };
            return Ok(Glibc {
                image: path.to_string(),
                main_arena: bias.wrapping_add(arena.value),
                mp: bias.wrapping_add(mp.value),
                narenas: narenas.map(|n| bias.wrapping_add(n.value)),
                layout,
            });
        }
        Err(match missing {
            Some(path) => HeapError::NoSymbols(path),
            None => HeapError::NotGlibc,
        })
    }
}

/// `main_arena` and `mp_` from the image's separate debug file, and the
/// layout its DWARF states.
fn from_debug_file(
    path: &Path,
    elf: &Elf,
    bytes: &[u8],
    roots: &[PathBuf],
) -> Option<(Symbol, Symbol, Option<Symbol>, Option<Layout>)> {
    let link = elf
        .section_headers
        .iter()
        .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(".gnu_debuglink"))
        .and_then(|sh| bytes.get(sh.file_range()?))
        .and_then(parse_debuglink);
    let id = build_id(elf, bytes);
    let found = debug_file::find(path, id.as_deref(), link.as_ref(), roots)?;
    let debug = std::fs::read(&found.path).ok()?;
    let elf = Elf::parse(&debug).ok()?;
    let (arena, mp) = (symbol(&elf, "main_arena")?, symbol(&elf, "mp_")?);
    let narenas = symbol(&elf, "narenas");
    Some((arena, mp, narenas, super::dwarf::layout(&debug)))
}

/// An object symbol by name, from `.symtab` or `.dynsym`.
fn symbol(elf: &Elf, name: &str) -> Option<Symbol> {
    let found = |syms: &goblin::elf::Symtab, strtab: &goblin::strtab::Strtab| {
        syms.iter()
            .find(|s| {
                s.st_shndx != section_header::SHN_UNDEF as usize
                    && strtab.get_at(s.st_name) == Some(name)
            })
            .map(|s| Symbol {
                value: s.st_value,
                size: s.st_size,
            })
    };
    found(&elf.syms, &elf.strtab).or_else(|| found(&elf.dynsyms, &elf.dynstrtab))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test's own executable names an interpreter; the same headers
    /// with `PT_INTERP` made `PT_NULL` (a static executable's) do not; a
    /// file that is no ELF file is not known.
    #[test]
    fn an_interpreter_is_read_from_the_program_headers() {
        let exe = std::env::current_exe().unwrap();
        assert_eq!(has_interpreter(&exe), Some(true));
        let mut head = std::fs::read(&exe).unwrap();
        head.truncate(64 << 10);
        let header = Elf::parse_header(&head).unwrap();
        let (at, size) = (header.e_phoff as usize, usize::from(header.e_phentsize));
        for i in 0..usize::from(header.e_phnum) {
            let p_type = at + i * size;
            if head[p_type..p_type + 4] == program_header::PT_INTERP.to_le_bytes() {
                head[p_type..p_type + 4].copy_from_slice(&program_header::PT_NULL.to_le_bytes());
            }
        }
        let dir = std::env::temp_dir().join(format!("memptrace-interp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (static_exe, text) = (dir.join("static"), dir.join("text"));
        std::fs::write(&static_exe, &head).unwrap();
        std::fs::write(&text, "not an ELF file").unwrap();
        let found = (has_interpreter(&static_exe), has_interpreter(&text));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found, (Some(false), None));
    }
}
