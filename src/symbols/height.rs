//! Call frame information for the C library's functions of a static
//! executable that has none for them (musl's `libc.a` is built without
//! unwind tables), made by following the stack pointer through each
//! function's machine code.
//!
//! Without it a stack that starts in musl's `strdup` ends there, and the
//! block is charged to `strdup`, where the dynamic build (musl's `libc.so`
//! has `.eh_frame`) charges the caller. The C library's functions are
//! compiled code that moves the stack pointer only by push, pop, call, ret,
//! and `sub`/`add`/`lea` of a constant: from the entry, where the return
//! address is at rsp, every path through the function is followed (iced-x86
//! decodes it) and each instruction gets the stack height above it, and
//! where the caller's rbp is saved. A function is described only when that
//! is exact: every instruction reached, at one height on every path, the
//! height back to 0 at each `ret` and jump out, no other write to rsp (a
//! frame pointer's `leave`, an alignment's `and`); anything else gets no
//! description, and its stacks end there as before. The result is
//! `.debug_frame` (gimli's writer), which every unwinder of memptrace reads.

use std::collections::BTreeMap;
use std::sync::Arc;

use goblin::elf::{Elf, sym};

use super::elf::{ElfImage, SectionData};
use gimli::write::{
    Address, CallFrameInstruction, CommonInformationEntry, DebugFrame, EndianVec,
    FrameDescriptionEntry, FrameTable, Writer,
};
use gimli::{Encoding, Format, LittleEndian, X86_64};
use iced_x86::{Decoder, DecoderOptions, FlowControl, Instruction, Mnemonic, OpKind, Register};

/// Describe the C library's functions that no CFI covers, in the image's
/// `.debug_frame`: those of a static executable `image` (whose file is
/// `bytes`) by the names its symbol table gives them, every function that
/// musl's shared C library exports. Only when some of the code has no CFI
/// (glibc's has it all).
pub fn describe_c_library(image: &mut ElfImage, bytes: &[u8]) {
    let musl = is_musl_library(&image.path);
    if !(image.is_static_exe || musl) || !image.lacks_cfi() {
        return;
    }
    let Ok(elf) = Elf::parse(bytes) else {
        return;
    };
    let mut functions: BTreeMap<u64, (Vec<Row>, u64)> = BTreeMap::new();
    let tables = [(&elf.syms, &elf.strtab), (&elf.dynsyms, &elf.dynstrtab)];
    for s in tables.into_iter().flat_map(|(syms, names)| {
        syms.iter().filter(move |s| {
            musl || names
                .get_at(s.st_name)
                .is_some_and(crate::wrappers::is_c_library_function)
        })
    }) {
        let start = s.st_value;
        let undefined = s.st_shndx == goblin::elf::section_header::SHN_UNDEF as usize;
        if s.st_type() != sym::STT_FUNC || s.st_size == 0 || undefined {
            continue;
        }
        if functions.contains_key(&start) || image.cfi.covers(start) {
            continue;
        }
        let code = image.code.iter().find_map(|seg| {
            let from = start.checked_sub(seg.svma.start)? as usize;
            let to = from.checked_add(usize::try_from(s.st_size).ok()?)?;
            seg.data.get(from..to)
        });
        if let Some(described) = code.and_then(|code| rows(code, start)) {
            functions.insert(start, described);
        }
    }
    if functions.is_empty() {
        return;
    }
    let existing = image.debug_frame.as_ref();
    let svma = existing.map_or(0..0, |s| s.svma.clone());
    let old: &[u8] = existing.map_or(&[], |s| &s.data);
    let functions: Vec<(Vec<Row>, u64)> = functions.into_values().collect();
    if let Some(data) = debug_frame(old, &functions) {
        image.set_debug_frame(Some(SectionData {
            svma,
            data: Arc::from(data),
        }));
    }
}

/// musl's C library as a file: `libc.so` (the dynamic linker's link,
/// `ld-musl-x86_64.so.1`, names it), or Alpine's `libc.musl-x86_64.so.1`.
fn is_musl_library(path: &str) -> bool {
    let base = path.rsplit('/').next().unwrap_or("");
    base == "libc.so" || base.starts_with("ld-musl-") || base.starts_with("libc.musl-")
}

/// Where a function's frame stands at an instruction: `height` bytes pushed
/// since the entry (the canonical frame address is rsp + 8 + height), and
/// the caller's rbp saved at CFA - `rbp_at`, if it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub at: u64,
    pub height: u64,
    pub rbp_at: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct State {
    height: u64,
    rbp_at: Option<u64>,
}

/// The rows of the function whose machine code is `code`, at `start`: one
/// where the frame changes, the first at `start`; and the end of the code
/// they describe (past the last instruction reached). None when the
/// function does anything but the plain moves of the stack pointer above.
pub fn rows(code: &[u8], start: u64) -> Option<(Vec<Row>, u64)> {
    let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
    let mut insns: BTreeMap<u64, Instruction> = BTreeMap::new();
    for insn in &mut decoder {
        if insn.is_invalid() {
            return None;
        }
        insns.insert(insn.ip(), insn);
    }
    let end = start + code.len() as u64;
    let mut seen: BTreeMap<u64, State> = BTreeMap::new();
    let mut work = vec![(
        start,
        State {
            height: 0,
            rbp_at: None,
        },
    )];
    while let Some((at, state)) = work.pop() {
        match seen.get(&at) {
            Some(s) if *s == state => continue,
            Some(_) => return None, // two heights at one instruction
            None => {}
        }
        let insn = insns.get(&at)?;
        seen.insert(at, state);
        let next = step(insn, state)?;
        let inside = |target: u64| (start..end).contains(&target);
        match insn.flow_control() {
            // A call that ends the function never returns
            // (`__stack_chk_fail`).
            FlowControl::Call | FlowControl::IndirectCall if !inside(insn.next_ip()) => {}
            FlowControl::Next | FlowControl::Call | FlowControl::IndirectCall => {
                work.push((insn.next_ip(), next));
            }
            FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch => {
                let target = insn.near_branch_target();
                if inside(target) {
                    work.push((target, next));
                } else if next.height != 0 {
                    return None; // a jump out, not a tail call
                }
                if insn.flow_control() == FlowControl::ConditionalBranch {
                    work.push((insn.next_ip(), next));
                }
            }
            FlowControl::Return if state.height == 0 => {}
            // A jump through a register: a tail call when the frame is
            // gone; a jump table's targets are not followed (and are then
            // not reached: no description).
            FlowControl::IndirectBranch if state.height == 0 => {}
            FlowControl::Interrupt if insn.mnemonic() != Mnemonic::Int3 => {
                work.push((insn.next_ip(), next));
            }
            FlowControl::Interrupt | FlowControl::Exception => {}
            _ => return None,
        }
    }
    // Every instruction up to the last one reached must have been reached,
    // but the padding between paths (what follows the last is padding too).
    let (&last, _) = seen.last_key_value()?;
    let padding = |i: &Instruction| matches!(i.mnemonic(), Mnemonic::Nop | Mnemonic::Int3);
    if insns
        .range(..=last)
        .any(|(at, i)| !seen.contains_key(at) && !padding(i))
    {
        return None;
    }
    let mut rows: Vec<Row> = Vec::new();
    for (&at, &state) in &seen {
        let same = rows
            .last()
            .is_some_and(|r| r.height == state.height && r.rbp_at == state.rbp_at);
        if !same {
            rows.push(Row {
                at,
                height: state.height,
                rbp_at: state.rbp_at,
            });
        }
    }
    Some((rows, insns.get(&last).map_or(end, Instruction::next_ip)))
}

/// The frame after `insn` (for a call: once the callee has returned).
/// None for a write to rsp other than a constant move.
fn step(insn: &Instruction, state: State) -> Option<State> {
    let mut next = state;
    let writes_rsp = |i: u32| insn.op_kind(i) == OpKind::Register && is_rsp(insn.op_register(i));
    match insn.mnemonic() {
        Mnemonic::Push if insn.op0_kind() == OpKind::Register => {
            if insn.op0_register() == Register::RBP && state.rbp_at.is_none() {
                next.rbp_at = Some(state.height + 16);
            }
            next.height = state.height + 8;
        }
        Mnemonic::Pop if writes_rsp(0) => return None,
        Mnemonic::Pop if insn.op0_kind() == OpKind::Register => {
            if insn.op0_register() == Register::RBP && state.rbp_at == Some(state.height + 8) {
                next.rbp_at = None;
            }
            next.height = state.height.checked_sub(8)?;
        }
        Mnemonic::Sub | Mnemonic::Add if writes_rsp(0) => {
            let by = constant(insn)?;
            let by = if insn.mnemonic() == Mnemonic::Sub {
                by
            } else {
                -by
            };
            next.height = state.height.checked_add_signed(by)?;
        }
        Mnemonic::Lea if writes_rsp(0) => {
            if insn.memory_base() != Register::RSP || insn.memory_index() != Register::None {
                return None;
            }
            let by = insn.memory_displacement64() as i64;
            next.height = state.height.checked_add_signed(by.checked_neg()?)?;
        }
        // The callee pops its return address; a ret's pop ends the frame.
        Mnemonic::Call | Mnemonic::Ret => {}
        Mnemonic::Leave | Mnemonic::Enter => return None,
        _ if writes_rsp(0) || (insn.mnemonic() == Mnemonic::Xchg && writes_rsp(1)) => {
            return None;
        }
        _ => {
            // push of a constant or of flags, pop of flags: what iced-x86
            // says they move rsp by.
            let by = insn.stack_pointer_increment() as i64;
            next.height = state.height.checked_add_signed(by.checked_neg()?)?;
        }
    }
    Some(next)
}

fn is_rsp(reg: Register) -> bool {
    matches!(
        reg,
        Register::RSP | Register::ESP | Register::SP | Register::SPL
    )
}

/// The immediate of `sub rsp, imm` / `add rsp, imm`, sign-extended.
fn constant(insn: &Instruction) -> Option<i64> {
    match insn.op1_kind() {
        OpKind::Immediate8to64 | OpKind::Immediate32to64 => Some(insn.immediate64() as i64),
        OpKind::Immediate8 | OpKind::Immediate32 => Some(insn.immediate(1) as i64),
        _ => None,
    }
}

/// `.debug_frame` describing `functions` (each: rows from [`rows`] and the
/// end of its code), after the `existing` section's bytes (whose entries
/// keep their offsets). SVMAs as they are.
pub fn debug_frame(existing: &[u8], functions: &[(Vec<Row>, u64)]) -> Option<Vec<u8>> {
    let encoding = Encoding {
        format: Format::Dwarf32,
        version: 1,
        address_size: 8,
    };
    let mut cie = CommonInformationEntry::new(encoding, 1, -8, X86_64::RA);
    cie.add_instruction(CallFrameInstruction::Cfa(X86_64::RSP, 8));
    cie.add_instruction(CallFrameInstruction::Offset(X86_64::RA, -8));
    let mut table = FrameTable::default();
    let cie = table.add_cie(cie);
    for (rows, end) in functions {
        let Some(first) = rows.first() else {
            continue;
        };
        let len = u32::try_from(end.checked_sub(first.at)?).ok()?;
        let mut fde = FrameDescriptionEntry::new(Address::Constant(first.at), len);
        let mut prev = Row {
            at: first.at,
            height: 0,
            rbp_at: None,
        };
        for row in rows {
            let offset = (row.at - first.at) as u32;
            if row.height != prev.height {
                let cfa = i32::try_from(row.height + 8).ok()?;
                fde.add_instruction(offset, CallFrameInstruction::CfaOffset(cfa));
            }
            if row.rbp_at != prev.rbp_at {
                let rule = match row.rbp_at {
                    Some(at) => CallFrameInstruction::Offset(X86_64::RBP, -i32::try_from(at).ok()?),
                    None => CallFrameInstruction::Restore(X86_64::RBP),
                };
                fde.add_instruction(offset, rule);
            }
            prev = *row;
        }
        table.add_fde(cie, fde);
    }
    let mut out = DebugFrame(EndianVec::new(LittleEndian));
    out.write(existing).ok()?;
    table.write_debug_frame(&mut out).ok()?;
    Some(out.0.into_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// musl 1.2.3's `strdup` (libc.a, Debian 12): its calls' targets zero, its
    /// tail call's past its end.
    const STRDUP: &[u8] = &[
        0x41, 0x54, 0x55, 0x48, 0x89, 0xfd, 0x48, 0x83, 0xec, 0x08, 0xe8, 0, 0, 0, 0, 0x4c, 0x8d,
        0x60, 0x01, 0x4c, 0x89, 0xe7, 0xe8, 0, 0, 0, 0, 0x48, 0x85, 0xc0, 0x74, 0x18, 0x48, 0x83,
        0xc4, 0x08, 0x4c, 0x89, 0xe2, 0x48, 0x89, 0xee, 0x48, 0x89, 0xc7, 0x5d, 0x41, 0x5c, 0xe9,
        0, 1, 0, 0, 0x0f, 0x1f, 0x00, 0x48, 0x83, 0xc4, 0x08, 0x31, 0xc0, 0x5d, 0x41, 0x5c, 0xc3,
    ];

    fn height_at(rows: &[Row], at: u64) -> (u64, Option<u64>) {
        let row = rows.iter().rev().find(|r| r.at <= at).expect("a row");
        (row.height, row.rbp_at)
    }

    #[test]
    fn strdup_s_frame_at_every_call() {
        let start = 0x1000;
        let (rows, end) = rows(STRDUP, start).expect("described");
        assert_eq!(end, start + STRDUP.len() as u64);
        // At its entry, after push r12, push rbp (saved at CFA-24), sub 8.
        assert_eq!(height_at(&rows, start), (0, None));
        assert_eq!(height_at(&rows, start + 2), (8, None));
        // The return address of malloc's call (0x1b): 24 bytes pushed.
        assert_eq!(height_at(&rows, start + 0x1b), (24, Some(24)));
        // The tail call to memcpy, after the epilogue: nothing pushed.
        assert_eq!(height_at(&rows, start + 0x30), (0, None));
        // The other path's epilogue: the frame as at the calls.
        assert_eq!(height_at(&rows, start + 0x38), (24, Some(24)));
        assert_eq!(height_at(&rows, start + 0x41), (0, None));
    }

    #[test]
    fn the_written_section_reads_back_with_gimli() {
        use gimli::{BaseAddresses, UnwindContext, UnwindSection};
        let start = 0x1000;
        let described = rows(STRDUP, start).expect("described");
        let existing = [0u8; 0];
        let data = debug_frame(&existing, &[described]).expect("written");
        let mut section = gimli::DebugFrame::new(&data, LittleEndian);
        section.set_address_size(8);
        let bases = BaseAddresses::default();
        let mut ctx = UnwindContext::new();
        let row = section
            .unwind_info_for_address(
                &bases,
                &mut ctx,
                start + 0x1b,
                gimli::DebugFrame::cie_from_offset,
            )
            .expect("a row");
        assert_eq!(
            *row.cfa(),
            gimli::CfaRule::RegisterAndOffset {
                register: X86_64::RSP,
                offset: 32
            }
        );
        assert_eq!(
            row.register(X86_64::RBP),
            Some(gimli::RegisterRule::Offset(-24))
        );
    }

    #[test]
    fn a_frame_pointer_or_an_alignment_is_not_described() {
        // push rbp; mov rbp, rsp; and rsp, -16; call 0; leave; ret
        let aligned = [
            0x55, 0x48, 0x89, 0xe5, 0x48, 0x83, 0xe4, 0xf0, 0xe8, 0, 0, 0, 0, 0xc9, 0xc3,
        ];
        assert_eq!(rows(&aligned, 0x1000), None);
        // push rbx; ret (a height left at the ret)
        assert_eq!(rows(&[0x53, 0xc3], 0x1000), None);
    }

    #[test]
    fn a_jump_table_s_targets_unreached_leave_it_undescribed() {
        // sub rsp, 8; jmp rax; (unreached) add rsp, 8; ret
        let table = [
            0x48, 0x83, 0xec, 0x08, 0xff, 0xe0, 0x48, 0x83, 0xc4, 0x08, 0xc3,
        ];
        assert_eq!(rows(&table, 0x1000), None);
    }
}
