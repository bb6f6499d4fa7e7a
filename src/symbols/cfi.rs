//! Which code of an image its call frame information covers: the address
//! ranges of the FDEs of `.eh_frame` and `.debug_frame`. The unwinders use
//! CFI where it covers a frame and fall back to frame pointers elsewhere; a
//! frame found so is less certain, and says so (`stacks.trust`).

use std::ops::Range;

use gimli::{BaseAddresses, CieOrFde, DebugFrame, EhFrame, LittleEndian, UnwindSection};

/// Sorted, possibly overlapping, FDE ranges (SVMAs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CfiIndex {
    ranges: Vec<(u64, u64)>,
}

impl CfiIndex {
    /// The ranges of `.eh_frame` (at `eh_frame_svma`, `text_svma` for the
    /// bases of its pointer encodings).
    pub fn add_eh_frame(&mut self, data: &[u8], eh_frame_svma: u64, text_svma: Option<u64>) {
        let section = EhFrame::new(data, LittleEndian);
        let mut bases = BaseAddresses::default().set_eh_frame(eh_frame_svma);
        if let Some(text) = text_svma {
            bases = bases.set_text(text);
        }
        add(&mut self.ranges, &section, &bases);
        self.ranges.sort_unstable();
    }

    pub fn add_debug_frame(&mut self, data: &[u8]) {
        let mut section = DebugFrame::new(data, LittleEndian);
        section.set_address_size(8);
        add(&mut self.ranges, &section, &BaseAddresses::default());
        self.ranges.sort_unstable();
    }

    /// True when some FDE covers `svma`.
    pub fn covers(&self, svma: u64) -> bool {
        // Ranges starting at or before svma; FDEs are short, so look back a
        // little for one that reaches svma.
        let end = self.ranges.partition_point(|&(s, _)| s <= svma);
        self.ranges[..end]
            .iter()
            .rev()
            .take(16)
            .any(|&(_, e)| svma < e)
    }

    /// The longest stretch of `code` no FDE covers.
    pub fn largest_gap(&self, code: Range<u64>) -> u64 {
        let mut at = code.start;
        let mut gap = 0;
        for &(s, e) in &self.ranges {
            if e <= at {
                continue;
            }
            if s >= code.end {
                break;
            }
            gap = gap.max(s.saturating_sub(at));
            at = at.max(e);
        }
        gap.max(code.end.saturating_sub(at))
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

fn add<'a, S>(ranges: &mut Vec<(u64, u64)>, section: &S, bases: &BaseAddresses)
where
    S: UnwindSection<gimli::EndianSlice<'a, LittleEndian>>,
    S::Offset: gimli::UnwindOffset<usize>,
{
    let mut entries = section.entries(bases);
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) = partial.parse(S::cie_from_offset) else {
            continue;
        };
        let start = fde.initial_address();
        if start != 0 && fde.len() > 0 {
            ranges.push((start, start.saturating_add(fde.len())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_and_gaps() {
        let index = CfiIndex {
            ranges: vec![(0x100, 0x180), (0x180, 0x200), (0x400, 0x410)],
        };
        assert!(index.covers(0x100) && index.covers(0x1ff) && index.covers(0x40f));
        assert!(!index.covers(0xff) && !index.covers(0x200) && !index.covers(0x410));
        assert_eq!(index.largest_gap(0x100..0x410), 0x200);
        assert_eq!(index.largest_gap(0x100..0x1000), 0x1000 - 0x410);
        assert_eq!(CfiIndex::default().largest_gap(0..10), 10);
    }
}
