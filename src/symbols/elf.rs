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
use crate::event::Op;

/// Symbol names that denote an allocator entry point. Only the public names:
/// glibc's `__libc_malloc` and friends are aliases at the same addresses, and
/// musl's `__libc_free` is the body that `free` jumps to (hooking both would
/// count every free twice). Local symbols count too: in a static-pie glibc
/// binary `malloc` itself is local.
const ALLOCATOR_NAMES: [(&str, Op); 10] = [
    ("malloc", Op::Malloc),
    ("calloc", Op::Calloc),
    ("realloc", Op::Realloc),
    ("free", Op::Free),
    ("posix_memalign", Op::PosixMemalign),
    ("aligned_alloc", Op::AlignedAlloc),
    ("memalign", Op::Memalign),
    ("valloc", Op::Valloc),
    ("pvalloc", Op::Pvalloc),
    ("reallocarray", Op::Reallocarray),
];

/// glibc functions that release a thread's cached blocks through the public
/// `free` when the thread exits (malloc.c: tcache_thread_shutdown). Those frees
/// are the allocator's housekeeping, not the program's.
const HOUSEKEEPING_NAMES: [&str; 3] = [
    "tcache_thread_shutdown",
    "__malloc_arena_thread_freeres",
    "__libc_thread_freeres",
];

/// The dynamic linker's hook that debuggers break on (`r_debug.r_brk`): it is
/// called after libraries are mapped and before their constructors run.
const DEBUG_STATE: &str = "_dl_debug_state";

/// An allocator function found in an image. Several names can share an address
/// (glibc: memalign = aligned_alloc = __libc_memalign); `ops` lists every op
/// named there, preferred first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocatorEntry {
    pub svma: Svma,
    pub ops: Vec<Op>,
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
    pub segments: Vec<LoadSegment>,
    pub allocators: Vec<AllocatorEntry>,
    pub debug_state: Option<Svma>,
    /// Code ranges whose frees of unknown blocks are allocator housekeeping.
    pub housekeeping: Vec<Range<u64>>,
    pub has_symtab: bool,
    pub text: Option<Range<u64>>,
    pub eh_frame: Option<SectionData>,
    pub eh_frame_hdr: Option<SectionData>,
    pub debug_frame: Option<SectionData>,
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
            segments,
            allocators: Vec::new(),
            debug_state: None,
            housekeeping: Vec::new(),
            has_symtab: !elf.syms.is_empty(),
            text: section_range(".text"),
            eh_frame: section_data(".eh_frame"),
            eh_frame_hdr: section_data(".eh_frame_hdr"),
            debug_frame: section_data(".debug_frame"),
            got: section_range(".got"),
            plt: [".plt", ".plt.sec", ".plt.got"]
                .iter()
                .filter_map(|n| section_range(n))
                .collect(),
            got_slots: BTreeMap::new(),
            syscall_insn: None,
        };
        image.collect_symbols(&elf);
        image.collect_got_slots(&elf);
        image.syscall_insn = find_syscall_insn(&elf, bytes);
        Ok(image)
    }

    fn collect_symbols(&mut self, elf: &Elf) {
        let mut by_addr: BTreeMap<u64, Vec<Op>> = BTreeMap::new();
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
                        let ops = by_addr.entry(s.st_value).or_default();
                        if !ops.contains(&op) {
                            ops.push(op);
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
        self.allocators = by_addr
            .into_iter()
            .map(|(svma, mut ops)| {
                ops.sort_by_key(|op| preference(*op));
                AllocatorEntry {
                    svma: Svma(svma),
                    ops,
                }
            })
            .collect();
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

fn find_syscall_insn(elf: &Elf, bytes: &[u8]) -> Option<Svma> {
    for ph in elf.program_headers.iter() {
        if ph.p_type != program_header::PT_LOAD || ph.p_flags & program_header::PF_X == 0 {
            continue;
        }
        let start = ph.p_offset as usize;
        let end = start.saturating_add(ph.p_filesz as usize).min(bytes.len());
        let code = bytes.get(start..end)?;
        if let Some(pos) = code.windows(2).position(|w| w == [0x0f, 0x05]) {
            return Some(Svma(ph.p_vaddr + pos as u64));
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
