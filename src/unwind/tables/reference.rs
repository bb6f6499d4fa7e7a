//! The table built the straightforward way, as [`super::build`] did before
//! it was made fast (gimli's default storage, each FDE's CIE parsed again,
//! one comparison sort of all rows): the fast build must give the same
//! table on real images.

use gimli::{BaseAddresses, CieOrFde, EhFrame, LittleEndian, RegisterRule, UnwindContext};
use gimli::{UnwindSection, X86_64};

use super::{UnwindTable, rule, rule_of};
use crate::symbols::elf::ElfImage;

/// `image`'s `.eh_frame` table (with the signal rule where
/// [`super::build`] sets it); `.debug_frame`'s rows are left out, as the
/// images compared have none.
fn reference(image: &ElfImage) -> UnwindTable {
    let mut rows: Vec<(u64, u64, u32)> = Vec::new();
    let section = image.eh_frame.as_ref().expect(".eh_frame");
    let mut bases = BaseAddresses::default().set_eh_frame(section.svma.start);
    if let Some(text) = &image.text {
        bases = bases.set_text(text.start);
    }
    let eh_frame = EhFrame::new(&section.data, LittleEndian);
    let mut ctx = UnwindContext::new();
    let mut entries = eh_frame.entries(&bases);
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else {
            continue;
        };
        let Ok(mut table) = fde.rows(&eh_frame, &bases, &mut ctx) else {
            continue;
        };
        while let Ok(Some(row)) = table.next_row() {
            let unchanged = |r| row.register(r).unwrap_or(RegisterRule::SameValue);
            let rule = rule_of(row.cfa(), unchanged(X86_64::RA), unchanged(X86_64::RBP));
            rows.push((row.start_address(), row.end_address(), rule));
        }
    }
    for at in crate::unwind::signal::trampolines(image) {
        super::set_rule(&mut rows, at - 1, rule::SIGNAL);
    }
    rows.retain(|&(start, end, _)| start < end && end <= u64::from(u32::MAX));
    rows.sort_unstable_by_key(|&(start, _, _)| start);
    let mut table = UnwindTable::default();
    for (i, &(start, end, rule)) in rows.iter().enumerate() {
        let mut push = |key: u64, rule: u32| {
            if table.keys.last() == Some(&(key as u32)) {
                *table.rules.last_mut().unwrap() = rule;
            } else if table.rules.last() != Some(&rule) {
                table.keys.push(key as u32);
                table.rules.push(rule);
            }
        };
        push(start, rule);
        if rows.get(i + 1).map(|&(s, _, _)| s) != Some(end) {
            push(end, rule::NONE);
        }
    }
    table
}

fn same_table(path: &str) {
    let bytes = std::fs::read(path).unwrap();
    let image = ElfImage::parse(path, &bytes).unwrap();
    assert!(image.debug_frame.is_none(), "{path} has .debug_frame");
    let (fast, reference) = (super::build(&image), reference(&image));
    assert!(fast.len() > 10_000, "{path}: {} rows", fast.len());
    assert!(fast == reference, "{path}: the tables differ");
}

#[test]
fn same_table_as_the_reference_on_libc() {
    same_table("/lib/x86_64-linux-gnu/libc.so.6");
}

#[test]
fn same_table_as_the_reference_on_the_test_binary() {
    let exe = std::env::current_exe().unwrap();
    same_table(exe.to_str().unwrap());
}
