//! An image as memptrace hooks and unwinds it: [`ElfImage::parse`], then
//! what the file itself does not say, from elsewhere.
//!
//! - A stripped static executable has no allocator symbol: its separate
//!   debug file (found as gdb finds it, by build-id or `.gnu_debuglink`:
//!   `symbolize::debug_file`) has them; failing that, its machine code is
//!   matched against the signature sets of the C libraries it may have been
//!   linked with ([`crate::symbols::signatures`]).
//! - Code built without unwind tables has CFI only in `.debug_frame`, which
//!   the debug file may hold when the image was stripped; the C library's
//!   functions of a static executable that have none at all (musl's) get
//!   theirs from their machine code ([`super::height`]).
//!
//! Each allocator entry says how it was found ([`FoundBy`]). Nothing here
//! fails: what cannot be read is simply not found.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use goblin::elf::{Elf, section_header};

use super::elf::{ElfError, ElfImage, FoundBy, SectionData};
use super::signatures::{self, Library, matcher};
use super::symbolize::{DEFAULT_DEBUG_ROOT, debug_file};
use crate::addr::Svma;

/// Parse the image at `path` (whose bytes are `bytes`) and complete it from
/// its debug file and the signature sets, looking for debug files under
/// [`DEFAULT_DEBUG_ROOT`].
pub fn load(path: &str, bytes: &[u8]) -> Result<ElfImage, ElfError> {
    load_with(
        path,
        bytes,
        &[PathBuf::from(DEFAULT_DEBUG_ROOT)],
        shipped_and_machine,
    )
}

/// [`load`] with the debug roots and signature sets given (the sets are
/// asked for only when needed: reading them costs tens of milliseconds).
pub fn load_with<'a>(
    path: &str,
    bytes: &[u8],
    roots: &[PathBuf],
    libraries: impl FnOnce() -> &'a [Library],
) -> Result<ElfImage, ElfError> {
    let mut image = ElfImage::parse(path, bytes)?;
    let wants_symbols = image.allocators.is_empty() && image.is_static_exe;
    if wants_symbols || image.debug_frame.is_none() && image.lacks_cfi() {
        from_debug_file(&mut image, path, roots, wants_symbols);
    }
    if image.allocators.is_empty() && image.is_static_exe {
        from_signatures(&mut image, libraries());
    }
    super::height::describe_c_library(&mut image, bytes);
    Ok(image)
}

/// The signature sets, read once per run (the machine's `libc.a` files are
/// megabytes).
fn shipped_and_machine() -> &'static [Library] {
    static LIBRARIES: OnceLock<Vec<Library>> = OnceLock::new();
    LIBRARIES.get_or_init(signatures::libraries)
}

fn from_debug_file(image: &mut ElfImage, path: &str, roots: &[PathBuf], symbols: bool) {
    let file = Path::new(path.trim_end_matches(" (deleted)"));
    let Some(debug) = debug_file::find(
        file,
        image.build_id.as_deref(),
        image.debuglink.as_ref(),
        roots,
    ) else {
        return;
    };
    let Ok(bytes) = std::fs::read(&debug.path) else {
        return;
    };
    let Ok(elf) = Elf::parse(&bytes) else {
        return;
    };
    if symbols {
        let found_by = FoundBy::DebugFile(debug.path.display().to_string());
        image.collect_symbols(&elf, &found_by);
    }
    if image.debug_frame.is_none() {
        image.set_debug_frame(debug_frame(&elf, &bytes));
    }
}

/// A section `.debug_frame` with contents (a debug file keeps it; `strip`
/// leaves a NOBITS placeholder at most).
fn debug_frame(elf: &Elf, bytes: &[u8]) -> Option<SectionData> {
    let sh = elf.section_headers.iter().find(|sh| {
        sh.sh_type != section_header::SHT_NOBITS
            && sh.sh_size > 0
            && elf.shdr_strtab.get_at(sh.sh_name) == Some(".debug_frame")
    })?;
    let data = bytes.get(sh.file_range()?)?;
    Some(SectionData {
        svma: sh.sh_addr..sh.sh_addr + sh.sh_size,
        data: Arc::from(data),
    })
}

/// Hook what the best matching set finds: the one that finds the most ops
/// (the first of equals), with its mapping functions, housekeeping ranges
/// and allocator bodies. Every set tried is remembered for the error that
/// nothing matched; what the best set does not find that every program
/// linked with its allocator has is said in `signature_gaps`.
fn from_signatures(image: &mut ElfImage, libraries: &[Library]) {
    let segments = image.code_segments();
    let mut best: Option<(&Library, matcher::Matches)> = None;
    for lib in libraries {
        let found = matcher::find(lib, &segments);
        if found.hooks.len() > best.as_ref().map_or(0, |(_, m)| m.hooks.len()) {
            best = Some((lib, found));
        }
    }
    drop(segments);
    image.signature_sets = libraries.iter().map(|l| l.label.clone()).collect();
    let Some((lib, found)) = best else {
        return;
    };
    for hook in found.hooks {
        let found_by = FoundBy::Signature {
            library: lib.label.clone(),
            function: hook.function.clone(),
            via: hook.via.clone(),
        };
        image.add_allocator(Svma(hook.svma), &[hook.op], &found_by);
        if let Some(entry) = image.allocators.iter_mut().find(|a| a.svma.0 == hook.svma) {
            entry.size = entry.size.max(hook.len);
        }
    }
    for map in &found.maps {
        image.mappings.entry(map.svma).or_insert(map.op);
    }
    image.housekeeping.extend(found.housekeeping);
    image.allocator_bodies.extend(found.bodies);
    // The allocator maps memory through these (glibc's and musl's malloc
    // both call mmap), and glibc's malloc.o holds its thread-exit frees:
    // a set that finds the allocator but not them was made from another
    // build of the C library than the program's.
    if found.maps.is_empty() {
        image.signature_gaps.push(format!(
            "no mapping function (mmap, munmap, ...) of {} found by its code: the program's \
             mapping calls are not recorded (map_events)",
            lib.label
        ));
    }
    if image.housekeeping.is_empty() && lib.functions.iter().any(|f| f.housekeeping) {
        image.signature_gaps.push(format!(
            "the thread-exit frees of {} not found by their code: the blocks a thread's cache \
             holds when it exits are counted as frees of the program",
            lib.label
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{MapOp, Op};

    /// Debian's busybox-static is stripped and static: its glibc allocator
    /// is found by its code.
    #[test]
    fn busybox_allocator_by_signature() {
        let path = "/bin/busybox";
        let bytes = std::fs::read(path).expect("busybox-static (scripts/deps installs it)");
        let libs = signatures::libraries();
        let image = load_with(path, &bytes, &[], || &libs).unwrap();
        assert!(!image.has_symtab);
        let ops: Vec<Op> = image
            .allocators
            .iter()
            .flat_map(|a| a.ops.clone())
            .collect();
        for op in [Op::Malloc, Op::Free, Op::Calloc, Op::Realloc] {
            assert!(ops.contains(&op), "{op} not found: {:?}", image.allocators);
        }
        for a in &image.allocators {
            assert!(
                matches!(&a.found_by, FoundBy::Signature { library, .. } if library.starts_with("glibc")),
                "{a:?}"
            );
            assert!(a.size > 0, "{a:?}");
        }
        // Its mapping functions and thread-exit frees too.
        let maps: Vec<MapOp> = image.mappings.values().copied().collect();
        for op in MapOp::ALL {
            assert!(maps.contains(&op), "{op} not found: {maps:?}");
        }
        assert_eq!(image.housekeeping.len(), 1, "{:?}", image.housekeeping);
        assert_eq!(image.signature_gaps, Vec::<String>::new());
    }

    /// A set made from another build of glibc than busybox's, that finds
    /// its allocator but neither its mapping functions nor its thread-exit
    /// frees: each gap is said in one line.
    #[test]
    fn what_a_set_does_not_find_is_said() {
        let path = "/bin/busybox";
        let bytes = std::fs::read(path).expect("busybox-static (scripts/deps installs it)");
        let mut lib = signatures::libraries()
            .into_iter()
            .find(|l| l.label.starts_with("glibc"))
            .unwrap();
        lib.label = "glibc 9.99 (another build)".into();
        for f in &mut lib.functions {
            if !f.maps.is_empty() || f.housekeeping {
                // Other code: the first byte that must match differs.
                let first = f.mask.iter().position(|&m| m != 0).unwrap();
                f.code[first] ^= 0xff;
            }
        }
        let libs = [lib];
        let image = load_with(path, &bytes, &[], || &libs).unwrap();
        assert!(!image.allocators.is_empty());
        assert!(image.mappings.is_empty() && image.housekeeping.is_empty());
        assert_eq!(
            image.signature_gaps,
            [
                "no mapping function (mmap, munmap, ...) of glibc 9.99 (another build) found by \
                 its code: the program's mapping calls are not recorded (map_events)",
                "the thread-exit frees of glibc 9.99 (another build) not found by their code: the \
                 blocks a thread's cache holds when it exits are counted as frees of the program"
            ]
        );
    }
}
