//! One ELF image, read once: what memptrace needs to hook it and unwind it.
//!
//! Parsing keeps only small, owned pieces (symbol addresses, unwind sections,
//! relocation slots) so that an image can be shared with the unwinder thread
//! after the file's bytes are dropped. All addresses here are SVMAs.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use goblin::elf::{Elf, header, program_header, reloc, section_header, sym};

use crate::addr::{Avma, LoadBias, Svma};
use crate::event::{MapOp, Op};
use crate::symbols::cfi::CfiIndex;
use crate::symbols::names::{ALLOCATOR_NAMES, BODY_NAMES, HOUSEKEEPING_NAMES, MAPPING_NAMES};
use crate::symbols::signatures::matcher::Segment;
pub use crate::symbols::symbolize::DebugLink;

/// The dynamic linker's hook that debuggers break on (`r_debug.r_brk`): it is
/// called after libraries are mapped and before their constructors run.
const DEBUG_STATE: &str = "_dl_debug_state";

/// An allocator function found in an image. Several names can share an address
/// (glibc: memalign = aligned_alloc = __libc_memalign); `ops` lists every op
/// named there, preferred first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocatorEntry {
    pub svma: Svma,
    /// The function's size: its symbol's, or the length of its code in
    /// the signature set that found it.
    pub size: u64,
    pub ops: Vec<Op>,
    pub found_by: FoundBy,
}

/// How memptrace knows where an allocator function is (`meta`'s
/// `allocator.*` rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FoundBy {
    /// The image's own `.symtab` or `.dynsym`.
    Symbol,
    /// The symbol table of its separate debug file, at this path.
    DebugFile(String),
    /// Its machine code matched a signature set: the library's label, the
    /// function of the set found here, and the op's own function when the hook
    /// is on the function it jumps to.
    Signature {
        library: String,
        function: String,
        via: Option<String>,
    },
}

impl std::fmt::Display for FoundBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FoundBy::Symbol => write!(f, "symbol"),
            FoundBy::DebugFile(path) => write!(f, "debug file {path}"),
            FoundBy::Signature {
                library,
                function,
                via,
            } => {
                write!(f, "signature {function} of {library}")?;
                match via {
                    Some(via) => write!(f, " (jumped to by {via})"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl AllocatorEntry {
    /// The op recorded when the call site cannot tell which alias was called.
    pub fn default_op(&self) -> Op {
        self.ops[0]
    }
}

/// A section's address and a copy of its bytes.
#[derive(Clone, Debug)]
pub struct SectionData {
    pub svma: Range<u64>,
    pub data: Arc<[u8]>,
}

/// A PT_LOAD segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSegment {
    pub vaddr: u64,
    pub memsz: u64,
    pub offset: u64,
    pub exec: bool,
}

#[derive(Clone, Debug)]
pub struct ElfImage {
    pub path: String,
    pub build_id: Option<String>,
    /// ET_EXEC (fixed address) or ET_DYN (PIE, shared library, static-pie).
    pub is_dyn: bool,
    /// PT_INTERP: the program needs a dynamic linker.
    pub interpreter: Option<String>,
    /// A static executable: no dynamic linker, no library it needs, not a
    /// library itself (static and static-pie programs).
    pub is_static_exe: bool,
    /// `.gnu_debuglink`: the name of its separate debug file.
    pub debuglink: Option<DebugLink>,
    pub segments: Vec<LoadSegment>,
    /// The file bytes of the executable segments, by SVMA: to tell a return
    /// address (just after a call instruction) from a stray code address.
    pub code: Vec<SectionData>,
    pub allocators: Vec<AllocatorEntry>,
    pub debug_state: Option<Svma>,
    /// Code ranges whose frees of unknown blocks are allocator housekeeping.
    pub housekeeping: Vec<Range<u64>>,
    /// The code of allocator functions whose public entry only jumps to it
    /// (musl's `malloc` is a jump to `__libc_malloc_impl`).
    pub allocator_bodies: Vec<(Range<u64>, Op)>,
    /// Mapping functions (mmap, munmap, brk...) by SVMA.
    pub mappings: BTreeMap<u64, MapOp>,
    pub has_symtab: bool,
    pub text: Option<Range<u64>>,
    pub eh_frame: Option<SectionData>,
    pub eh_frame_hdr: Option<SectionData>,
    /// `.debug_frame`, the image's own or its debug file's.
    pub debug_frame: Option<SectionData>,
    /// The code that `.eh_frame` and `.debug_frame` describe.
    pub cfi: CfiIndex,
    /// The signature sets its code was matched against, when it had no
    /// allocator symbol (for the error that none matched).
    pub signature_sets: Vec<String>,
    /// What the signature set that found the allocator did not find of the
    /// rest (mapping functions, thread-exit frees): one warning each.
    pub signature_gaps: Vec<String>,
    pub got: Option<Range<u64>>,
    /// .plt, .plt.sec and .plt.got: stubs that jump through a GOT slot.
    pub plt: Vec<Range<u64>>,
    /// GOT slots that hold the address of an allocator function, by slot SVMA
    /// (JUMP_SLOT and GLOB_DAT relocations): they tell which alias a call
    /// through the PLT meant.
    pub got_slots: BTreeMap<u64, Op>,
    /// SVMA of some `syscall` instruction bytes (0f 05) in executable code, for
    /// running a system call in the target.
    pub syscall_insn: Option<Svma>,
    /// SVMA range of the widest page padding after an executable segment:
    /// bytes mapped with the code (the rest of its last page) that belong to
    /// no segment, so nothing runs or reads them. memptrace writes a stub
    /// there for the few injected system calls that cannot go through one
    /// in a trampoline area (`tracer::inject`), and puts the bytes back.
    pub code_padding: Option<Range<u64>>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ElfError {
    #[error("not an ELF file")]
    NotElf,
    #[error("a 32-bit program; memptrace traces x86-64 programs only")]
    Not64Bit,
    #[error("built for another machine ({0}); memptrace traces x86-64 programs only")]
    WrongMachine(String),
    #[error("malformed ELF: {0}")]
    Malformed(String),
}

/// The ELF identification of a file's first bytes, without parsing the rest:
/// enough to refuse a program before launching it.
pub fn check_header(bytes: &[u8]) -> Result<(), ElfError> {
    if bytes.len() < 20 || &bytes[..4] != b"\x7fELF" {
        return Err(ElfError::NotElf);
    }
    if bytes[header::EI_CLASS] != header::ELFCLASS64 {
        return Err(ElfError::Not64Bit);
    }
    let machine = u16::from_le_bytes([bytes[18], bytes[19]]);
    if bytes[header::EI_DATA] != header::ELFDATA2LSB || machine != header::EM_X86_64 {
        return Err(ElfError::WrongMachine(
            header::machine_to_str(machine).into(),
        ));
    }
    Ok(())
}

impl ElfImage {
    pub fn parse(path: &str, bytes: &[u8]) -> Result<ElfImage, ElfError> {
        check_header(bytes)?;
        let elf = Elf::parse(bytes).map_err(|e| ElfError::Malformed(e.to_string()))?;

        let segments = elf
            .program_headers
            .iter()
            .filter(|ph| ph.p_type == program_header::PT_LOAD)
            .map(|ph| LoadSegment {
                vaddr: ph.p_vaddr,
                memsz: ph.p_memsz,
                offset: ph.p_offset,
                exec: ph.p_flags & program_header::PF_X != 0,
            })
            .collect::<Vec<_>>();

        let section = |name: &str| {
            elf.section_headers.iter().find(|sh| {
                sh.sh_type != section_header::SHT_NOBITS
                    && elf.shdr_strtab.get_at(sh.sh_name) == Some(name)
            })
        };
        let section_data = |name: &str| {
            let sh = section(name)?;
            let range = sh.file_range()?;
            let data = bytes.get(range)?;
            Some(SectionData {
                svma: sh.sh_addr..sh.sh_addr + sh.sh_size,
                data: Arc::from(data),
            })
        };
        let section_range =
            |name: &str| section(name).map(|sh| sh.sh_addr..sh.sh_addr + sh.sh_size);

        let mut image = ElfImage {
            path: path.to_string(),
            build_id: build_id(&elf, bytes),
            is_dyn: elf.header.e_type == header::ET_DYN,
            interpreter: elf.interpreter.map(str::to_string),
            is_static_exe: elf.interpreter.is_none()
                && elf.libraries.is_empty()
                && elf.soname.is_none()
                && elf.header.e_entry != 0,
            debuglink: section(".gnu_debuglink")
                .and_then(|sh| bytes.get(sh.file_range()?))
                .and_then(crate::symbols::symbolize::parse_debuglink),
            code: elf
                .program_headers
                .iter()
                .filter(|ph| {
                    ph.p_type == program_header::PT_LOAD && ph.p_flags & program_header::PF_X != 0
                })
                .filter_map(|ph| {
                    let start = ph.p_offset as usize;
                    let data = bytes.get(start..start.checked_add(ph.p_filesz as usize)?)?;
                    Some(SectionData {
                        svma: ph.p_vaddr..ph.p_vaddr + ph.p_filesz,
                        data: Arc::from(data),
                    })
                })
                .collect(),
            segments,
            allocators: Vec::new(),
            debug_state: None,
            housekeeping: Vec::new(),
            allocator_bodies: Vec::new(),
            mappings: BTreeMap::new(),
            has_symtab: !elf.syms.is_empty(),
            text: section_range(".text"),
            eh_frame: section_data(".eh_frame"),
            eh_frame_hdr: section_data(".eh_frame_hdr"),
            debug_frame: None,
            cfi: CfiIndex::default(),
            signature_sets: Vec::new(),
            signature_gaps: Vec::new(),
            got: section_range(".got"),
            plt: [".plt", ".plt.sec", ".plt.got"]
                .iter()
                .filter_map(|n| section_range(n))
                .collect(),
            got_slots: BTreeMap::new(),
            syscall_insn: None,
            code_padding: super::room::code_padding(&elf),
        };
        if let Some(eh) = &image.eh_frame {
            let text = image.text.as_ref().map(|t| t.start);
            image.cfi.add_eh_frame(&eh.data, eh.svma.start, text);
        }
        image.set_debug_frame(section_data(".debug_frame"));
        image.collect_symbols(&elf, &FoundBy::Symbol);
        image.collect_got_slots(&elf);
        image.syscall_insn = super::room::find_syscall_insn(&elf, bytes);
        Ok(image)
    }

    /// The allocator entry points, housekeeping ranges and linker hook that
    /// `elf`'s symbol tables name: the image's own, or those of its debug
    /// file (`found_by`). Entries found before are kept.
    pub(crate) fn collect_symbols(&mut self, elf: &Elf, found_by: &FoundBy) {
        let mut by_addr: BTreeMap<u64, (u64, Vec<Op>)> = BTreeMap::new();
        let tables = [(&elf.syms, &elf.strtab), (&elf.dynsyms, &elf.dynstrtab)];
        for (syms, strtab) in tables {
            for s in syms.iter() {
                // Undefined symbols (an executable's import of malloc sits in
                // .dynsym with value 0) are someone else's definition.
                if s.st_shndx == section_header::SHN_UNDEF as usize || s.st_value == 0 {
                    continue;
                }
                let Some(name) = strtab.get_at(s.st_name) else {
                    continue;
                };
                if s.st_type() == sym::STT_FUNC {
                    if let Some(&(_, op)) = ALLOCATOR_NAMES.iter().find(|(n, _)| *n == name) {
                        let (size, ops) = by_addr.entry(s.st_value).or_default();
                        *size = (*size).max(s.st_size);
                        if !ops.contains(&op) {
                            ops.push(op);
                        }
                    }
                    if let Some(&(_, op)) = MAPPING_NAMES.iter().find(|(n, _)| *n == name) {
                        self.mappings.entry(s.st_value).or_insert(op);
                    }
                    if let Some(&(_, op)) = BODY_NAMES.iter().find(|(n, _)| *n == name) {
                        let range = s.st_value..s.st_value + s.st_size;
                        if s.st_size > 0 && !self.allocator_bodies.contains(&(range.clone(), op)) {
                            self.allocator_bodies.push((range, op));
                        }
                    }
                    if HOUSEKEEPING_NAMES.contains(&name) && s.st_size > 0 {
                        let range = s.st_value..s.st_value + s.st_size;
                        if !self.housekeeping.contains(&range) {
                            self.housekeeping.push(range);
                        }
                    }
                }
                if name == DEBUG_STATE && s.st_type() == sym::STT_FUNC {
                    self.debug_state = Some(Svma(s.st_value));
                }
            }
        }
        for (svma, (size, ops)) in by_addr {
            self.add_allocator(Svma(svma), &ops, found_by);
            if let Some(entry) = self.allocators.iter_mut().find(|a| a.svma.0 == svma) {
                entry.size = entry.size.max(size);
            }
        }
    }

    /// Record allocator function `ops` at `svma` (merged with an entry
    /// already there).
    pub(crate) fn add_allocator(&mut self, svma: Svma, ops: &[Op], found_by: &FoundBy) {
        let at = self.allocators.partition_point(|a| a.svma.0 < svma.0);
        if self.allocators.get(at).is_none_or(|a| a.svma != svma) {
            self.allocators.insert(
                at,
                AllocatorEntry {
                    svma,
                    size: 0,
                    ops: Vec::new(),
                    found_by: found_by.clone(),
                },
            );
        }
        let entry = &mut self.allocators[at];
        for op in ops {
            if !entry.ops.contains(op) {
                entry.ops.push(*op);
            }
        }
        entry.ops.sort_by_key(|op| preference(*op));
    }

    /// The allocator function whose code holds `svma` (by its symbol's
    /// size, or its body's), if any.
    pub fn allocator_containing(&self, svma: Svma) -> Option<Op> {
        let at = self.allocators.partition_point(|a| a.svma.0 <= svma.0);
        let entry = self.allocators[..at]
            .last()
            .filter(|e| svma.0 < e.svma.0 + e.size)
            .map(AllocatorEntry::default_op);
        entry.or_else(|| {
            self.allocator_bodies
                .iter()
                .find(|(range, _)| range.contains(&svma.0))
                .map(|&(_, op)| op)
        })
    }

    /// Use `section` as the image's `.debug_frame`.
    pub(crate) fn set_debug_frame(&mut self, section: Option<SectionData>) {
        if let Some(section) = section.filter(|s| !s.data.is_empty()) {
            self.cfi.add_debug_frame(&section.data);
            self.debug_frame = Some(section);
        }
    }

    /// True when some stretch of `.text` longer than a few small functions
    /// has no CFI: code built without unwind tables (`gcc
    /// -fno-asynchronous-unwind-tables`), whose CFI may be in a debug file.
    pub fn lacks_cfi(&self) -> bool {
        const GAP: u64 = 512;
        self.text
            .as_ref()
            .is_some_and(|text| self.cfi.largest_gap(text.clone()) >= GAP)
    }

    /// The executable segments' bytes, for [`crate::symbols::signatures`].
    pub fn code_segments(&self) -> Vec<Segment<'_>> {
        self.code
            .iter()
            .map(|s| Segment {
                svma: s.svma.start,
                bytes: &s.data,
            })
            .collect()
    }

    fn collect_got_slots(&mut self, elf: &Elf) {
        for r in elf.pltrelocs.iter().chain(elf.dynrelas.iter()) {
            if r.r_type != reloc::R_X86_64_JUMP_SLOT && r.r_type != reloc::R_X86_64_GLOB_DAT {
                continue;
            }
            let name = elf
                .dynsyms
                .get(r.r_sym)
                .and_then(|s| elf.dynstrtab.get_at(s.st_name));
            if let Some(op) = name.and_then(Op::from_name) {
                self.got_slots.insert(r.r_offset, op);
            }
        }
    }

    /// The load bias of this image, given one of its mappings: the mapping's
    /// start address and file offset.
    pub fn load_bias(&self, map_start: u64, map_offset: u64) -> Option<LoadBias> {
        let page = |x: u64| x & !0xfff;
        self.segments
            .iter()
            .find(|s| page(s.offset) == map_offset)
            .map(|s| LoadBias(map_start.wrapping_sub(page(s.vaddr))))
    }

    /// True when `svma` is in a PLT section.
    /// `len` bytes of the image's executable code at `svma`, if they are in
    /// one executable segment.
    pub fn code_at(&self, svma: u64, len: usize) -> Option<&[u8]> {
        let seg = self.code.iter().find(|s| s.svma.contains(&svma))?;
        let at = (svma - seg.svma.start) as usize;
        seg.data.get(at..at.checked_add(len)?)
    }

    pub fn in_plt(&self, svma: Svma) -> bool {
        self.plt.iter().any(|r| r.contains(&svma.0))
    }

    pub fn is_housekeeping(&self, svma: Svma) -> bool {
        self.housekeeping.iter().any(|r| r.contains(&svma.0))
    }

    /// The runtime address range of the image's segments.
    pub fn avma_range(&self, bias: LoadBias) -> Range<u64> {
        let start = self.segments.iter().map(|s| s.vaddr & !0xfff).min();
        let end = self.segments.iter().map(|s| s.vaddr + s.memsz).max();
        match (start, end) {
            (Some(s), Some(e)) => bias.to_avma(Svma(s)).0..bias.to_avma(Svma(e)).0,
            _ => 0..0,
        }
    }

    pub fn allocator_avmas(&self, bias: LoadBias) -> impl Iterator<Item = (Avma, &AllocatorEntry)> {
        self.allocators
            .iter()
            .map(move |a| (bias.to_avma(a.svma), a))
    }
}

/// Which alias names an address when several do: the function the allocator
/// implements under that name (glibc's aligned_alloc is its memalign).
fn preference(op: Op) -> usize {
    const ORDER: [Op; 10] = [
        Op::Malloc,
        Op::Calloc,
        Op::Realloc,
        Op::Free,
        Op::PosixMemalign,
        Op::Memalign,
        Op::AlignedAlloc,
        Op::Valloc,
        Op::Pvalloc,
        Op::Reallocarray,
    ];
    ORDER.iter().position(|o| *o == op).unwrap_or(ORDER.len())
}

/// The GNU build-id note (program headers first, then sections), as
/// lowercase hex.
pub(crate) fn build_id(elf: &Elf, bytes: &[u8]) -> Option<String> {
    let notes = elf
        .iter_note_headers(bytes)
        .into_iter()
        .flatten()
        .chain(elf.iter_note_sections(bytes, None).into_iter().flatten());
    for note in notes.flatten() {
        if note.n_type == goblin::elf::note::NT_GNU_BUILD_ID && note.name == "GNU" {
            return Some(note.desc.iter().map(|b| format!("{b:02x}")).collect());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn libc_image() -> ElfImage {
        let path = "/lib/x86_64-linux-gnu/libc.so.6";
        ElfImage::parse(path, &std::fs::read(path).unwrap()).unwrap()
    }

    #[test]
    fn finds_glibc_allocator_and_aliases() {
        let libc = libc_image();
        assert!(libc.is_dyn);
        let ops: Vec<Op> = libc.allocators.iter().flat_map(|a| a.ops.clone()).collect();
        for op in Op::ALL {
            assert!(ops.contains(&op), "{op} not found in libc");
        }
        // glibc's aligned_alloc is memalign, at one address: one entry, memalign first.
        let memalign = libc
            .allocators
            .iter()
            .find(|a| a.ops.contains(&Op::AlignedAlloc))
            .unwrap();
        assert_eq!(memalign.ops, vec![Op::Memalign, Op::AlignedAlloc]);
        assert!(libc.build_id.as_ref().is_some_and(|id| id.len() == 40));
        assert!(libc.syscall_insn.is_some());
        let padding = libc
            .code_padding
            .clone()
            .expect("libc's code ends inside a page");
        assert!(padding.start < padding.end && padding.end % 4096 == 0);
        assert!(padding.end - padding.start < 4096);
        assert!(libc.eh_frame_hdr.is_some());
    }

    #[test]
    fn finds_the_dynamic_linker_hook() {
        let path = "/lib64/ld-linux-x86-64.so.2";
        let ld = ElfImage::parse(path, &std::fs::read(path).unwrap()).unwrap();
        assert!(ld.debug_state.is_some());
    }

    #[test]
    fn refuses_what_it_cannot_trace() {
        assert_eq!(check_header(b"#!/bin/sh\necho hi\n"), Err(ElfError::NotElf));
        let mut elf32 = vec![0u8; 52];
        elf32[..4].copy_from_slice(b"\x7fELF");
        elf32[header::EI_CLASS] = header::ELFCLASS32;
        assert_eq!(check_header(&elf32), Err(ElfError::Not64Bit));
        let mut arm = vec![0u8; 64];
        arm[..4].copy_from_slice(b"\x7fELF");
        arm[header::EI_CLASS] = header::ELFCLASS64;
        arm[header::EI_DATA] = header::ELFDATA2LSB;
        arm[18..20].copy_from_slice(&header::EM_AARCH64.to_le_bytes());
        assert!(matches!(check_header(&arm), Err(ElfError::WrongMachine(_))));
    }

    #[test]
    fn load_bias_from_a_mapping() {
        let libc = libc_image();
        let bias = libc.load_bias(0x7f00_0000_0000, 0).unwrap();
        assert_eq!(bias, LoadBias(0x7f00_0000_0000));
        let range = libc.avma_range(bias);
        assert_eq!(range.start, 0x7f00_0000_0000);
        assert!(range.end > range.start + 0x100000);
    }
}
