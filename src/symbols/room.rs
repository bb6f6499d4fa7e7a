//! Where memptrace can enter the kernel from an image's own code: some
//! `syscall` bytes, and the page padding after its code, where a stub is
//! lent for the calls that cannot use a trampoline area's
//! (`tracer::inject`).

use std::ops::Range;

use goblin::elf::{Elf, program_header};

use crate::addr::Svma;

/// The widest padding after an executable `PT_LOAD` segment to the end of
/// its last page, where no other segment is mapped (`ElfImage::code_padding`).
pub(super) fn code_padding(elf: &Elf) -> Option<Range<u64>> {
    const PAGE: u64 = 4096;
    let loads: Vec<(u64, u64)> = elf
        .program_headers
        .iter()
        .filter(|ph| ph.p_type == program_header::PT_LOAD)
        .filter_map(|ph| {
            let end = ph.p_vaddr.checked_add(ph.p_memsz.max(ph.p_filesz))?;
            Some((ph.p_vaddr, end))
        })
        .collect();
    let mut best: Option<Range<u64>> = None;
    for ph in elf.program_headers.iter() {
        if ph.p_type != program_header::PT_LOAD || ph.p_flags & program_header::PF_X == 0 {
            continue;
        }
        let Some(end) = ph.p_vaddr.checked_add(ph.p_memsz.max(ph.p_filesz)) else {
            continue;
        };
        let Some(page_end) = end.checked_next_multiple_of(PAGE) else {
            continue;
        };
        // Another segment's pages over the padding replace it when mapped.
        let shared = loads.iter().any(|&(start, stop)| {
            start != ph.p_vaddr
                && start / PAGE * PAGE < page_end
                && stop.checked_next_multiple_of(PAGE).unwrap_or(u64::MAX) > end
        });
        if !shared
            && page_end > end
            && best
                .as_ref()
                .is_none_or(|b| page_end - end > b.end - b.start)
        {
            best = Some(end..page_end);
        }
    }
    best
}

pub(super) fn find_syscall_insn(elf: &Elf, bytes: &[u8]) -> Option<Svma> {
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
