//! Compact unwind tables: an image's DWARF CFI (`.eh_frame`, and
//! `.debug_frame` where `.eh_frame` says nothing) reduced to one rule per
//! address range, the shape the jump probes walk stacks with inside the
//! target (the layout of the kernel's ORC tables and of the eBPF profilers
//! that unwind without frame pointers).
//!
//! A rule says where the caller's frame is: the CFA is rsp or rbp plus an
//! offset, the return address is at CFA - 8, and the caller's rbp is either
//! unchanged or saved at CFA - 8k. Every CFI row that says anything else
//! (a CFA expression, as in PLT entries; a return address elsewhere) gets
//! the rule "none", where a stack walk stops, and so does every address no
//! FDE covers: a walk never guesses. The one exception is the signal-return
//! trampoline, whose CFI is an expression: its row gets the rule "signal",
//! which the walk follows by the context the kernel saved (see
//! [`super::signal`]).

use std::collections::HashMap;

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, EndianSlice, FrameDescriptionEntry,
    LittleEndian, Register, RegisterRule, UnwindContext, UnwindContextStorage, UnwindOffset,
    UnwindSection, UnwindTableRow, X86_64,
};

use crate::symbols::elf::{ElfImage, SectionData};

/// An unwind rule, as a u32: how to find the caller's frame from a frame
/// at an address the row covers.
pub mod rule {
    /// Bits 0-15: the CFA is this many bytes above its base register.
    pub const OFFSET_MASK: u32 = 0xffff;
    /// Bit 16: the base register is rbp (else rsp).
    pub const RBP_BASED: u32 = 1 << 16;
    /// Bits 17-24: the caller's rbp is saved at CFA - 8 * this (0: rbp is
    /// not changed in this frame).
    pub const RBP_SHIFT: u32 = 17;
    pub const RBP_MASK: u32 = 0xff;
    /// Bit 31: no CFI covers the address: the walk goes on by the frame
    /// pointer, as framehop's and libunwind's do (and memptrace checks that
    /// what it finds are return addresses).
    pub const NONE: u32 = 1 << 31;
    /// The outermost frame (its return address is undefined: `_start`, a
    /// thread's start routine): the stack is complete.
    pub const END: u32 = NONE | 1;
    /// CFI covers the address with a rule the probes cannot follow (a CFA
    /// expression, as in PLT entries): the stack ends here, marked
    /// truncated.
    pub const UNSUPPORTED: u32 = NONE | 2;
    /// A return address into the signal-return trampoline (the row covers
    /// the byte before it, where such an address is looked up): the
    /// caller's frame is the interrupted code's, whose rip, rsp and rbp are
    /// at CFA + [`super::super::signal::RIP`], `RSP` and `RBP`.
    pub const SIGNAL: u32 = NONE | 3;
}

/// Rows sorted by key: `keys[i]` is the SVMA where `rules[i]` starts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnwindTable {
    pub keys: Vec<u32>,
    pub rules: Vec<u32>,
}

impl UnwindTable {
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The rule covering `svma`, if a row does.
    pub fn rule_at(&self, svma: u32) -> Option<u32> {
        let i = self.keys.partition_point(|&k| k <= svma).checked_sub(1)?;
        Some(self.rules[i])
    }

    /// CFI says how to leave the code at `svma` (a walk from there needs
    /// no frame pointer).
    pub fn covers(&self, svma: u64) -> bool {
        u32::try_from(svma)
            .ok()
            .and_then(|svma| self.rule_at(svma))
            .is_some_and(|r| r & rule::NONE == 0)
    }
}

/// The table of `image`'s CFI.
pub fn build(image: &ElfImage) -> UnwindTable {
    let mut rows: Vec<(u64, u64, u32)> = Vec::new();
    if let Some(section) = &image.eh_frame {
        let mut bases = BaseAddresses::default().set_eh_frame(section.svma.start);
        if let Some(text) = &image.text {
            bases = bases.set_text(text.start);
        }
        rows_of(
            &EhFrame::new(&section.data, LittleEndian),
            &bases,
            &mut rows,
        );
    }
    if let Some(section) = &image.debug_frame {
        let covered = covered(&rows);
        let mut more = Vec::new();
        rows_of_debug_frame(section, &mut more);
        more.retain(|&(start, _, _)| !in_ranges(&covered, start));
        rows.extend(more);
    }
    for at in super::signal::trampolines(image) {
        if let Some(before) = at.checked_sub(1) {
            set_rule(&mut rows, before, rule::SIGNAL);
        }
    }
    compact(rows)
}

/// Give the byte at `at` the rule `rule`, splitting the row that covers it.
fn set_rule(rows: &mut Vec<(u64, u64, u32)>, at: u64, rule: u32) {
    if let Some(i) = rows.iter().position(|&(s, e, _)| s <= at && at < e) {
        let (start, end, old) = rows.swap_remove(i);
        rows.push((start, at, old));
        rows.push((at + 1, end, old));
    }
    rows.push((at, at + 1, rule));
}

fn rows_of_debug_frame(section: &SectionData, rows: &mut Vec<(u64, u64, u32)>) {
    let mut frame = DebugFrame::new(&section.data, LittleEndian);
    frame.set_address_size(8);
    rows_of(&frame, &BaseAddresses::default(), rows);
}

/// Register rules kept inline, few enough that copying a row (gimli
/// copies the row at each `remember_state` and each new FDE) costs little:
/// gimli's default keeps room for 192 rules, 6 KiB a row, and copying them
/// was a third of cc1's build. An x86-64 row names at most the return
/// address and the callee-saved registers; a program that names more is
/// evaluated again with the default storage, so the rows are the same.
struct FewRules;

impl UnwindContextStorage<usize> for FewRules {
    type Rules = [(Register, RegisterRule<usize>); 16];
    /// As deep as gimli's default (`MAX_UNWIND_STACK_DEPTH`).
    type Stack = [UnwindTableRow<usize, FewRules>; 4];
}

/// Append `(start, end, rule)` for every CFI row of `section`.
fn rows_of<'a, S>(section: &S, bases: &BaseAddresses, rows: &mut Vec<(u64, u64, u32)>)
where
    S: UnwindSection<EndianSlice<'a, LittleEndian>>,
{
    let mut few = Box::new(UnwindContext::<usize, FewRules>::new_in());
    let mut many: Option<Box<UnwindContext<usize>>> = None;
    // Each CIE parsed once, not once per FDE.
    let mut cies = HashMap::new();
    let mut cie = |section: &S, bases: &BaseAddresses, offset: S::Offset| {
        let at = UnwindOffset::into(offset);
        if let Some(cie) = cies.get(&at) {
            return Ok(Clone::clone(cie));
        }
        let cie = section.cie_from_offset(bases, offset)?;
        cies.insert(at, cie.clone());
        Ok(cie)
    };
    let mut entries = section.entries(bases);
    loop {
        let entry = match entries.next() {
            Ok(Some(entry)) => entry,
            Ok(None) => break,
            Err(_) => break, // a malformed section: what was read stays
        };
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) = partial.parse(&mut cie) else {
            continue;
        };
        let before = rows.len();
        // A malformed program: the rows before the error stay.
        if let Err(gimli::Error::TooManyRegisterRules | gimli::Error::StackFull) =
            fde_rows(section, bases, &fde, &mut few, rows)
        {
            rows.truncate(before);
            let many = many.get_or_insert_with(|| Box::new(UnwindContext::new()));
            let _ = fde_rows(section, bases, &fde, many, rows);
        }
    }
}

/// Append the rows of `fde`, up to the first error in its program.
fn fde_rows<'a, S, T>(
    section: &S,
    bases: &BaseAddresses,
    fde: &FrameDescriptionEntry<EndianSlice<'a, LittleEndian>>,
    ctx: &mut UnwindContext<usize, T>,
    rows: &mut Vec<(u64, u64, u32)>,
) -> gimli::Result<()>
where
    S: UnwindSection<EndianSlice<'a, LittleEndian>>,
    T: UnwindContextStorage<usize>,
{
    let mut table = fde.rows(section, bases, ctx)?;
    while let Some(row) = table.next_row()? {
        // A register with no rule of its own keeps its value (x86-64
        // CIEs give the return address its rule; rbp usually has none).
        let unchanged = |r| row.register(r).unwrap_or(RegisterRule::SameValue);
        let rule = rule_of(row.cfa(), unchanged(X86_64::RA), unchanged(X86_64::RBP));
        rows.push((row.start_address(), row.end_address(), rule));
    }
    Ok(())
}

/// The rule for one CFI row.
fn rule_of(cfa: &CfaRule<usize>, ra: RegisterRule<usize>, rbp: RegisterRule<usize>) -> u32 {
    if let RegisterRule::Undefined = ra {
        return rule::END;
    }
    let CfaRule::RegisterAndOffset { register, offset } = *cfa else {
        return rule::UNSUPPORTED;
    };
    let base = match register {
        X86_64::RSP => 0,
        X86_64::RBP => rule::RBP_BASED,
        _ => return rule::UNSUPPORTED,
    };
    let Ok(offset) = u16::try_from(offset) else {
        return rule::UNSUPPORTED;
    };
    if !matches!(ra, RegisterRule::Offset(-8)) {
        return rule::UNSUPPORTED;
    }
    let saved = match rbp {
        RegisterRule::Undefined | RegisterRule::SameValue => 0,
        RegisterRule::Offset(at) if at < 0 && at % 8 == 0 && -at / 8 <= rule::RBP_MASK as i64 => {
            (-at / 8) as u32
        }
        _ => return rule::UNSUPPORTED,
    };
    u32::from(offset) | base | (saved << rule::RBP_SHIFT)
}

/// Sort rows, end each FDE's run with "none" where nothing follows it, and
/// merge neighbours with the same rule. Rows beyond 4 GiB are dropped (the
/// probes compare 32-bit keys). Of rows starting at the same address, the
/// later in the section wins.
fn compact(mut rows: Vec<(u64, u64, u32)>) -> UnwindTable {
    rows.retain(|&(start, end, _)| start < end && end <= u64::from(u32::MAX));
    let rows = sorted(rows);
    let mut table = UnwindTable::default();
    let push = |key: u64, rule: u32, table: &mut UnwindTable| {
        let key = key as u32;
        if table.keys.last() == Some(&key) {
            // A row starting where the previous one did: the later wins.
            *table.rules.last_mut().expect("a rule per key") = rule;
            return;
        }
        if table.rules.last() == Some(&rule) {
            return;
        }
        table.keys.push(key);
        table.rules.push(rule);
    };
    for (i, &(start, end, rule)) in rows.iter().enumerate() {
        push(start, rule, &mut table);
        let next = rows.get(i + 1).map(|&(s, _, _)| s);
        if next != Some(end) {
            push(end, rule::NONE, &mut table);
        }
    }
    table
}

/// `rows` sorted by start, those starting at the same address in their
/// order in `rows` (every start is below 2^32: [`compact`] dropped the
/// others). A radix sort, stable, three passes of 11 bits: the rows come
/// in thousands of short runs in order (cc1: 444 000 rows in 7 300 runs
/// that interleave), on which a comparison sort took a quarter of the
/// build.
fn sorted(mut rows: Vec<(u64, u64, u32)>) -> Vec<(u64, u64, u32)> {
    if rows.is_sorted_by_key(|&(start, _, _)| start) {
        return rows;
    }
    let mut other = vec![(0, 0, 0); rows.len()];
    for shift in [0, 11, 22] {
        let digit = |&(start, _, _): &(u64, u64, u32)| ((start >> shift) & 0x7ff) as usize;
        // Where each digit's rows go: the count of rows with a smaller one.
        let mut at = [0usize; 1 << 11];
        for row in &rows {
            at[digit(row)] += 1;
        }
        let mut sum = 0;
        for slot in &mut at {
            (*slot, sum) = (sum, sum + *slot);
        }
        for row in &rows {
            let slot = &mut at[digit(row)];
            other[*slot] = *row;
            *slot += 1;
        }
        std::mem::swap(&mut rows, &mut other);
    }
    rows
}

/// The ranges rows cover, merged.
fn covered(rows: &[(u64, u64, u32)]) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = rows.iter().map(|&(s, e, _)| (s, e)).collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (s, e) in ranges {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    merged
}

fn in_ranges(ranges: &[(u64, u64)], at: u64) -> bool {
    let i = ranges.partition_point(|&(s, _)| s <= at);
    i > 0 && at < ranges[i - 1].1
}

/// A register's rule as the probes understand them; for tests.
#[cfg(test)]
fn rbp_slot(rule: u32) -> u32 {
    (rule >> rule::RBP_SHIFT) & rule::RBP_MASK
}

#[cfg(test)]
mod reference;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduces_cfi_rows_to_rules() {
        // push rbp; mov rbp, rsp: CFA rsp+8, then rsp+16 with rbp at CFA-16,
        // then rbp+16.
        let at_entry = rule_of(
            &CfaRule::RegisterAndOffset {
                register: X86_64::RSP,
                offset: 8,
            },
            RegisterRule::Offset(-8),
            RegisterRule::Undefined,
        );
        assert_eq!(at_entry, 8);
        let framed = rule_of(
            &CfaRule::RegisterAndOffset {
                register: X86_64::RBP,
                offset: 16,
            },
            RegisterRule::Offset(-8),
            RegisterRule::Offset(-16),
        );
        assert_eq!(framed & rule::OFFSET_MASK, 16);
        assert_ne!(framed & rule::RBP_BASED, 0);
        assert_eq!(rbp_slot(framed), 2);
        // A CFA expression (PLT entries), or rbx as the base: no rule.
        let expr = CfaRule::Expression(gimli::UnwindExpression {
            offset: 0,
            length: 0,
        });
        assert_eq!(
            rule_of(&expr, RegisterRule::Offset(-8), RegisterRule::Undefined),
            rule::UNSUPPORTED
        );
        let rbx = CfaRule::RegisterAndOffset {
            register: Register(3),
            offset: 8,
        };
        assert_eq!(
            rule_of(&rbx, RegisterRule::Offset(-8), RegisterRule::Undefined),
            rule::UNSUPPORTED
        );
        // _start: the return address is undefined: the outermost frame.
        assert_eq!(
            rule_of(&rbx, RegisterRule::Undefined, RegisterRule::Undefined),
            rule::END
        );
    }

    #[test]
    fn ends_each_function_and_merges_runs() {
        let table = compact(vec![
            (0x1000, 0x1001, 8),
            (0x1001, 0x1010, 16),
            (0x1010, 0x1020, 16),
            (0x2000, 0x2008, 8),
        ]);
        assert_eq!(table.keys, [0x1000, 0x1001, 0x1020, 0x2000, 0x2008]);
        assert_eq!(table.rules, [8, 16, rule::NONE, 8, rule::NONE]);
        assert_eq!(table.rule_at(0x0fff), None);
        assert_eq!(table.rule_at(0x1015), Some(16));
        assert_eq!(table.rule_at(0x1500), Some(rule::NONE));
    }

    #[test]
    fn covers_glibc_with_rules() {
        let path = "/lib/x86_64-linux-gnu/libc.so.6";
        let bytes = std::fs::read(path).unwrap();
        let image = ElfImage::parse(path, &bytes).unwrap();
        let table = build(&image);
        assert!(table.len() > 1000, "{} rows", table.len());
        assert!(table.keys.windows(2).all(|w| w[0] < w[1]));
        // malloc has a rule at its entry: CFA = rsp + 8.
        let malloc = image
            .allocators
            .iter()
            .find(|a| a.ops.contains(&crate::event::Op::Malloc));
        let svma = malloc.unwrap().svma.0 as u32;
        assert_eq!(table.rule_at(svma), Some(8));
        // __restore_rt: a return address into it finds the signal rule.
        let restore = crate::unwind::signal::trampolines(&image)[0] as u32;
        assert_eq!(table.rule_at(restore - 1), Some(rule::SIGNAL));
        assert_ne!(table.rule_at(restore), Some(rule::SIGNAL));
    }
}
