//! Displaced execution: the instruction an int3 covers runs from a slot in a
//! trampoline area of the target, so a breakpoint never has to be lifted.
//!
//! Lifting it to single-step (the classic debugger dance) costs five times a
//! stop and lets other threads run through the function unseen while the
//! original byte is back. Instead each breakpoint gets a slot holding its
//! displaced instruction, relocated by iced-x86's block encoder (RIP-relative
//! operands and branches keep their targets), followed by a jump back to the
//! instruction after it. A thread stopped at the int3 resumes at the slot.
//!
//! Slots must lie within ±2 GiB of the code they stand for (rel32 operands),
//! so areas are placed next to the image they serve, in a gap of the address
//! space found from /proc/PID/maps. This module is pure: it computes bytes and
//! addresses; the tracer writes and maps them.

use std::ops::Range;

use iced_x86::{
    BlockEncoder, BlockEncoderOptions, Code, Decoder, DecoderOptions, Instruction, InstructionBlock,
};

use crate::os::procfs::Mapping;

/// Size of one trampoline area (one page holds the return int3 and 127 slots).
pub const AREA_SIZE: u64 = 4096;
/// Bytes per slot: the longest x86 instruction (15), relocated, plus a jump back.
pub const SLOT_SIZE: u64 = 32;
/// The first slot offset; the bytes before it hold the return trampoline.
pub const FIRST_SLOT: u64 = 16;
/// How far a rel32 operand reaches, with a margin for the image's own size.
const REACH: u64 = (1 << 31) - (64 << 20);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RelocateError {
    #[error("cannot decode the instruction at {0:#x}")]
    Undecodable(u64),
    #[error("cannot relocate the instruction at {0:#x}: {1}")]
    Unrelocatable(u64, String),
}

/// A displaced instruction's slot: its bytes and where its parts are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Displaced {
    /// The relocated instruction followed by a jump back.
    pub bytes: Vec<u8>,
    /// Length of the original instruction.
    pub len: usize,
    /// Length of the relocated copy; the jump back starts there.
    pub copy_len: usize,
}

impl Displaced {
    /// Where a thread stopped at `rip` inside the slot at `slot`, for the
    /// instruction at `addr`, stands in the original code: before the
    /// instruction (it has not run) or after it (only the jump back is left).
    /// `None` if `rip` is elsewhere.
    pub fn original_rip(&self, rip: u64, slot: u64, addr: u64) -> Option<u64> {
        if rip == slot {
            Some(addr)
        } else if rip == slot + self.copy_len as u64 {
            Some(addr + self.len as u64)
        } else {
            None
        }
    }
}

/// The code for a slot at `slot` that executes the instruction found at `addr`
/// (whose bytes start `code`) and continues at the next instruction.
pub fn displaced(code: &[u8], addr: u64, slot: u64) -> Result<Displaced, RelocateError> {
    let mut decoder = Decoder::with_ip(64, code, addr, DecoderOptions::NONE);
    let insn = decoder.decode();
    if insn.is_invalid() {
        return Err(RelocateError::Undecodable(addr));
    }
    let len = insn.len();
    let back = Instruction::with_branch(Code::Jmp_rel32_64, addr + len as u64)
        .map_err(|e| RelocateError::Unrelocatable(addr, e.to_string()))?;
    let insns = [insn, back];
    let block = InstructionBlock::new(&insns, slot);
    let encoded = BlockEncoder::encode(64, block, BlockEncoderOptions::NONE)
        .map_err(|e| RelocateError::Unrelocatable(addr, e.to_string()))?;
    let bytes = encoded.code_buffer;
    if bytes.len() as u64 > SLOT_SIZE {
        return Err(RelocateError::Unrelocatable(
            addr,
            format!("{} bytes do not fit a slot", bytes.len()),
        ));
    }
    // The copy must be one instruction followed by the jump back: a thread
    // stopped in the slot is then always at one of two known places.
    let mut copy = Decoder::with_ip(64, &bytes, slot, DecoderOptions::NONE);
    let first = copy.decode();
    let second = copy.decode();
    if second.code() != Code::Jmp_rel32_64 || second.near_branch_target() != addr + len as u64 {
        return Err(RelocateError::Unrelocatable(
            addr,
            "the relocated instruction is more than one instruction".into(),
        ));
    }
    Ok(Displaced {
        copy_len: first.len(),
        bytes,
        len,
    })
}

/// True when an area at `area` can serve code in `image` (rel32 reach both ways).
pub fn reaches(area: u64, image: &Range<u64>) -> bool {
    let lo = image.end.saturating_sub(REACH);
    let hi = image.start.saturating_add(REACH);
    area >= lo && area + AREA_SIZE <= hi
}

/// Candidate addresses for a new area serving `image`, best first: the highest
/// free gaps below the image that are in reach, then (unless `below_only`) the
/// lowest above it. The main executable passes `below_only`: the brk heap grows
/// up from its end, and an area there could stop the heap from growing.
pub fn place_area(
    maps: &[Mapping],
    image: &Range<u64>,
    min_addr: u64,
    below_only: bool,
) -> Vec<u64> {
    let mut gaps = Vec::new();
    let mut prev_end = min_addr.max(0x10000);
    for m in maps {
        if m.start > prev_end {
            gaps.push(prev_end..m.start);
        }
        prev_end = prev_end.max(m.end);
    }
    let mut below: Vec<u64> = gaps
        .iter()
        .filter(|g| g.end <= image.start && g.end - g.start >= AREA_SIZE)
        .map(|g| g.end - AREA_SIZE)
        .filter(|&a| reaches(a, image))
        .collect();
    below.sort_unstable_by(|a, b| b.cmp(a));
    let mut above: Vec<u64> = gaps
        .iter()
        .filter(|g| g.start >= image.end && g.end - g.start >= AREA_SIZE)
        .filter(|_| !below_only)
        .map(|g| g.start)
        .filter(|&a| reaches(a, image))
        .collect();
    above.sort_unstable();
    below.extend(above);
    below
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::Mnemonic;

    fn decode_all(bytes: &[u8], ip: u64) -> Vec<Instruction> {
        Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE)
            .into_iter()
            .collect()
    }

    #[test]
    fn relocates_a_push_and_jumps_back() {
        // push r12 (glibc malloc's first instruction) followed by junk.
        let code = [0x41, 0x54, 0x55, 0x48, 0x89, 0xe5];
        let d = displaced(&code, 0x7f00_0000_1000, 0x7f00_0000_0000).unwrap();
        assert_eq!((d.len, d.copy_len), (2, 2));
        let insns = decode_all(&d.bytes, 0x7f00_0000_0000);
        assert_eq!(insns[0].mnemonic(), Mnemonic::Push);
        assert_eq!(insns[1].mnemonic(), Mnemonic::Jmp);
        assert_eq!(insns[1].near_branch_target(), 0x7f00_0000_1002);
        // A thread stopped in the slot, before or after the copy.
        let (slot, addr) = (0x7f00_0000_0000, 0x7f00_0000_1000);
        assert_eq!(d.original_rip(slot, slot, addr), Some(addr));
        assert_eq!(d.original_rip(slot + 2, slot, addr), Some(addr + 2));
        assert_eq!(d.original_rip(slot + 3, slot, addr), None);
    }

    #[test]
    fn relocates_rip_relative_operands() {
        // cmp byte [rip+0x100], 0 (glibc memalign's first instruction).
        let code = [0x80, 0x3d, 0x00, 0x01, 0x00, 0x00, 0x00];
        let addr = 0x7f00_0010_0000;
        let slot = 0x7f00_0000_0000;
        let d = displaced(&code, addr, slot).unwrap();
        assert_eq!(d.len, 7);
        let insns = decode_all(&d.bytes, slot);
        assert_eq!(insns[0].mnemonic(), Mnemonic::Cmp);
        // The operand still names the same byte.
        assert_eq!(insns[0].memory_displacement64(), addr + 7 + 0x100);
        assert_eq!(insns[1].near_branch_target(), addr + 7);
    }

    #[test]
    fn relocates_a_jump_stub() {
        // musl: malloc is `jmp rel32` to the real implementation.
        let code = [0xe9, 0x0b, 0x00, 0x00, 0x00];
        let d = displaced(&code, 0x401800, 0x300000).unwrap();
        let insns = decode_all(&d.bytes, 0x300000);
        assert_eq!(insns[0].mnemonic(), Mnemonic::Jmp);
        assert_eq!(insns[0].near_branch_target(), 0x401810);
    }

    #[test]
    fn refuses_out_of_reach_rip_relative() {
        let code = [0x80, 0x3d, 0x00, 0x01, 0x00, 0x00, 0x00];
        assert!(displaced(&code, 0x7f00_0000_0000, 0x1000).is_err());
        assert!(displaced(&[0xff, 0xff], 0x1000, 0x2000).is_err());
    }

    #[test]
    fn places_areas_in_reach_and_off_the_heap() {
        let map = |start: u64, end: u64| Mapping {
            start,
            end,
            read: true,
            write: false,
            exec: false,
            offset: 0,
            inode: 1,
            path: "/x".into(),
        };
        let maps = vec![
            map(0x400000, 0x500000),                 // static executable
            map(0x7f00_0000_0000, 0x7f00_0020_0000), // a library
            map(0x7ffc_0000_0000, 0x7ffc_0002_1000), // stack
        ];
        let exe = 0x400000..0x500000;
        let spots = place_area(&maps, &exe, 0x10000, true);
        assert_eq!(spots[0], 0x400000 - AREA_SIZE);
        assert!(
            spots.iter().all(|&a| a < 0x400000),
            "nothing above the heap start"
        );
        let lib = 0x7f00_0000_0000..0x7f00_0020_0000;
        let spots = place_area(&maps, &lib, 0x10000, false);
        assert_eq!(spots[0], 0x7f00_0000_0000 - AREA_SIZE);
        assert!(spots.iter().all(|&a| reaches(a, &lib)));
    }
}
