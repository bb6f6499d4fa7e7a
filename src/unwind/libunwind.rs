//! `--unwinder libunwind`: libunwind-ptrace, reading the stopped thread's
//! memory through ptrace. Slower than framehop and run while the target waits,
//! but an independent second opinion on every stack.

use std::ops::Range;

use gimli::{BaseAddresses, CieOrFde, EhFrame, LittleEndian, UnwindSection};

use super::{MappedImage, StackSample, Unwinder};
use crate::os::libunwind::{CfiTable, Libunwind};
use crate::os::ptrace::Regs;

pub struct LibunwindUnwinder {
    inner: Libunwind,
}

impl LibunwindUnwinder {
    pub fn new() -> std::io::Result<LibunwindUnwinder> {
        Ok(LibunwindUnwinder {
            inner: Libunwind::new()?,
        })
    }

    /// A thread exited: drop libunwind's state for it.
    pub fn forget_thread(&mut self, tid: i32) {
        self.inner.forget_thread(tid);
    }
}

impl Unwinder for LibunwindUnwinder {
    fn add_image(&mut self, mapped: &MappedImage) {
        // Every image, .eh_frame_hdr or not: see os::libunwind on why
        // libunwind-ptrace's own lookup cannot be used.
        if let Some(table) = cfi_table(mapped) {
            self.inner.add_table(table);
        }
    }

    fn remove_image(&mut self, range: Range<u64>) {
        self.inner.forget(range.start, range.end);
    }

    fn unwind(&mut self, tid: i32, sample: &StackSample, out: &mut Vec<u64>, max: usize) {
        let mut regs: Regs = crate::os::ptrace::zeroed_regs();
        regs.rip = sample.ip;
        regs.rsp = sample.sp;
        regs.rbp = sample.bp;
        self.inner.unwind(tid, &regs, out, max);
    }
}

/// An .eh_frame_hdr-style search table for an image that has only .eh_frame.
fn cfi_table(mapped: &MappedImage) -> Option<CfiTable> {
    let section = mapped.image.eh_frame.as_ref()?;
    let bias = mapped.bias.0;
    let eh_frame = EhFrame::new(&section.data, LittleEndian);
    let mut bases = BaseAddresses::default().set_eh_frame(section.svma.start);
    if let Some(text) = &mapped.image.text {
        bases = bases.set_text(text.start);
    }
    let segbase = mapped.range.start;
    let eh_frame_avma = section.svma.start.wrapping_add(bias);
    let offset = |avma: u64| i32::try_from(avma.wrapping_sub(segbase) as i64).ok();
    let mut entries = Vec::new();
    let mut iter = eh_frame.entries(&bases);
    while let Ok(Some(entry)) = iter.next() {
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else {
            continue;
        };
        let start = fde.initial_address().wrapping_add(bias);
        let at = eh_frame_avma + fde.offset() as u64;
        if let (Some(start), Some(at)) = (offset(start), offset(at)) {
            entries.push((start, at));
        }
    }
    entries.sort_unstable();
    (!entries.is_empty()).then_some(CfiTable {
        start: mapped.range.start,
        end: mapped.range.end,
        segbase,
        entries,
    })
}
