//! Where a jump probe can be planted, and what it displaces.
//!
//! A `jmp rel32` takes five bytes. They go at the function's entry (after
//! an `endbr64`, which indirect calls must still find there), over whole
//! instructions that the probe runs displaced, relocated by iced-x86. That
//! is safe only if nothing else in the program can land inside those five
//! bytes: no branch of the function (scanned with iced-x86) may target any
//! byte of them but the first, and no instruction before them may end the
//! function (a `ret` or a jump out within the first bytes of a tiny
//! function: the jump would overwrite what follows it). Where that cannot
//! be shown, the function keeps an int3 on its first instruction, and the
//! thread that stops there is sent to the same probe by memptrace.

use iced_x86::{Code, Decoder, DecoderOptions, Encoder, FlowControl, Instruction, Mnemonic};

/// Bytes of a `jmp rel32` (what [`jump`] makes).
pub const JUMP_LEN: u64 = 5;

/// The `jmp rel32` at `at` to `to`, encoded by iced-x86: the one place a
/// patch's jump is made. `None` when `to` lies beyond ±2 GiB of `at`.
pub fn jump(at: u64, to: u64) -> Option<[u8; JUMP_LEN as usize]> {
    let insn = Instruction::with_branch(Code::Jmp_rel32_64, to).ok()?;
    let mut encoder = Encoder::new(64);
    encoder.encode(&insn, at).ok()?;
    encoder.take_buffer().try_into().ok()
}
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// How a function's entry is patched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Where the patch goes.
    pub at: u64,
    /// The instructions it displaces (decoded at their addresses).
    pub displaced: Vec<Instruction>,
    /// Where the function goes on after them.
    pub resume: u64,
    /// `None`: a jump; `Some(why)`: an int3, because a jump is not safe.
    pub int3: Option<NoJump>,
}

impl Plan {
    pub fn is_jump(&self) -> bool {
        self.int3.is_none()
    }
}

/// The plan for a function at `addr` whose code (and what follows it, up to
/// the end of its image or a few KiB) is `code`.
pub fn plan(code: &[u8], addr: u64) -> Plan {
    match jump_plan(code, addr) {
        Ok(plan) => plan,
        Err(why) => int3_plan(code, addr, why),
    }
}

/// Why a function gets an int3 rather than a jump: the five bytes a jump
/// overwrites are not safe to take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoJump {
    #[error("the function is shorter than a jump")]
    TooShort,
    #[error("cannot decode the instruction at {0:#x}")]
    Undecodable(u64),
    #[error("the function leaves at {0:#x}, within the bytes a jump needs")]
    LeavesEarly(u64),
    #[error("{0:#x}: a trap in the first instructions")]
    Trap(u64),
    /// Its callee would return inside the jump.
    #[error("{0:#x}: a call in the bytes a jump needs")]
    Call(u64),
    #[error("a branch at {0:#x} lands inside the bytes a jump would cover")]
    BranchInto(u64),
}

fn jump_plan(code: &[u8], addr: u64) -> Result<Plan, NoJump> {
    let skip = if code.starts_with(&ENDBR64) { 4 } else { 0 };
    let at = addr + skip as u64;
    let mut decoder = Decoder::with_ip(64, &code[skip..], at, DecoderOptions::NONE);
    let mut displaced = Vec::new();
    let mut len = 0u64;
    while len < JUMP_LEN {
        if !decoder.can_decode() {
            return Err(NoJump::TooShort);
        }
        let insn = decoder.decode();
        if insn.is_invalid() {
            return Err(NoJump::Undecodable(insn.ip()));
        }
        len += insn.len() as u64;
        let ends = matches!(
            insn.flow_control(),
            FlowControl::Return | FlowControl::UnconditionalBranch | FlowControl::IndirectBranch
        );
        displaced.push(insn);
        if ends && len < JUMP_LEN {
            return Err(NoJump::LeavesEarly(insn.ip()));
        }
        if matches!(insn.code(), Code::Int3 | Code::Int1 | Code::Ud2) {
            return Err(NoJump::Trap(insn.ip()));
        }
        if insn.flow_control() == FlowControl::Call && len < JUMP_LEN {
            return Err(NoJump::Call(insn.ip()));
        }
    }
    let patched = at + 1..at + len;
    if let Some(from) = branch_into(code, addr, &patched) {
        return Err(NoJump::BranchInto(from));
    }
    Ok(Plan {
        at,
        displaced,
        resume: at + len,
        int3: None,
    })
}

/// A jump over a function that only returns (`ret`, after an `endbr64`
/// perhaps) and the padding that follows it: the dynamic linker's
/// `_dl_debug_state`, whose int3 would kill the process without memptrace
/// (see `tracer::failopen`). Only the `ret` is displaced; the padding
/// (nops or int3s) never runs, no branch lands in it (checked as for any
/// plan), and the jump stays short of the next 16-byte boundary past the
/// `ret`, where the next function may start.
pub fn over_padding(code: &[u8], addr: u64) -> Option<Plan> {
    let skip = if code.starts_with(&ENDBR64) { 4 } else { 0 };
    let at = addr + skip as u64;
    let mut decoder = Decoder::with_ip(64, code.get(skip..)?, at, DecoderOptions::NONE);
    let ret = decoder.decode();
    if ret.code() != Code::Retnq || (at + 1).next_multiple_of(16) < at + JUMP_LEN {
        return None;
    }
    let mut len = 1;
    while len < JUMP_LEN {
        if !decoder.can_decode() {
            return None;
        }
        let pad = decoder.decode();
        if !(pad.mnemonic() == Mnemonic::Nop || pad.code() == Code::Int3) {
            return None;
        }
        len += pad.len() as u64;
    }
    if branch_into(code, addr, &(at + 1..at + JUMP_LEN)).is_some() {
        return None;
    }
    Some(Plan {
        at,
        displaced: vec![ret],
        resume: at + 1,
        int3: None,
    })
}

/// An int3 on the first instruction (after `endbr64` too: the int3 takes
/// one byte, and the thread is sent on from memptrace's stop).
fn int3_plan(code: &[u8], addr: u64, why: NoJump) -> Plan {
    let mut decoder = Decoder::with_ip(64, code, addr, DecoderOptions::NONE);
    let insn = decoder.decode();
    Plan {
        at: addr,
        displaced: vec![insn],
        resume: addr + insn.len() as u64,
        int3: Some(why),
    }
}

/// The address of a direct branch in `code` (at `addr`) whose target lies
/// in `range`, if any.
fn branch_into(code: &[u8], addr: u64, range: &std::ops::Range<u64>) -> Option<u64> {
    let decoder = Decoder::with_ip(64, code, addr, DecoderOptions::NONE);
    decoder
        .into_iter()
        .filter(|insn| !insn.is_invalid())
        .find(|insn| {
            matches!(
                insn.flow_control(),
                FlowControl::ConditionalBranch
                    | FlowControl::UnconditionalBranch
                    | FlowControl::Call
                    | FlowControl::XbeginXabortXend
            ) && range.contains(&insn.near_branch_target())
        })
        .map(|insn| insn.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    const AT: u64 = 0x7f00_0000_1000;

    #[test]
    fn displaces_whole_instructions_of_glibc_malloc() {
        // push r12; push rbp; push rbx; mov rbx, rdi; sub rsp, 0x10
        let code = [
            0x41, 0x54, 0x55, 0x53, 0x48, 0x89, 0xfb, 0x48, 0x83, 0xec, 0x10, 0xc3,
        ];
        let plan = plan(&code, AT);
        assert!(plan.is_jump(), "{:?}", plan.int3);
        assert_eq!(plan.at, AT);
        assert_eq!(plan.displaced.len(), 4);
        assert_eq!(plan.resume, AT + 7);
    }

    #[test]
    fn encodes_a_jump_within_reach_only() {
        assert_eq!(jump(0x1000, 0x1015), Some([0xe9, 0x10, 0, 0, 0]));
        assert_eq!(jump(0x1000, 0x0ff0), Some([0xe9, 0xeb, 0xff, 0xff, 0xff]));
        assert_eq!(jump(0x7f00_0000_0000, 0x1000), None);
    }

    #[test]
    fn jumps_over_endbr64() {
        let mut code = ENDBR64.to_vec();
        code.extend(jump(AT + 4, AT + 0x19).unwrap()); // jmp rel32 (musl's malloc)
        let plan = plan(&code, AT);
        assert!(plan.is_jump(), "{:?}", plan.int3);
        assert_eq!(plan.at, AT + 4);
        assert_eq!(plan.resume, AT + 9);
    }

    #[test]
    fn keeps_an_int3_where_a_jump_is_not_safe() {
        // test rdi, rdi; je +2; ret; ... a loop back to the je (offset 3).
        let code = [0x48, 0x85, 0xff, 0x74, 0x02, 0x90, 0x90, 0xeb, 0xfa, 0xc3];
        let plan = plan(&code, AT);
        assert!(!plan.is_jump());
        assert_eq!(plan.int3, Some(NoJump::BranchInto(AT + 7)));
        assert_eq!((plan.at, plan.resume), (AT, AT + 3));
        // xor eax, eax; ret: too short.
        let plan = super::plan(&[0x31, 0xc0, 0xc3, 0xcc, 0xcc, 0xcc], AT);
        assert_eq!(plan.int3, Some(NoJump::LeavesEarly(AT + 2)));
    }

    #[test]
    fn jumps_over_a_lone_ret_and_its_padding() {
        // ld.so's _dl_debug_state: ret; nopw cs:[rax+rax] (11 bytes).
        let code = [
            0xc3, 0x66, 0x66, 0x2e, 0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0, 0x0f, 0x1f, 0x40, 0,
        ];
        let plan = over_padding(&code, AT).unwrap();
        assert_eq!(
            (plan.at, plan.resume, plan.displaced.len()),
            (AT, AT + 1, 1)
        );
        // After endbr64, and int3 padding.
        let mut code = ENDBR64.to_vec();
        code.extend([0xc3, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc]);
        let plan = over_padding(&code, AT).unwrap();
        assert_eq!((plan.at, plan.resume), (AT + 4, AT + 5));
        // Code after the ret, or too near a 16-byte boundary: no.
        assert!(over_padding(&[0xc3, 0x31, 0xc0, 0xc3, 0x90, 0x90], AT).is_none());
        assert!(over_padding(&[0xc3, 0x90, 0x90, 0x90, 0x90, 0x90], AT + 12).is_none());
        assert!(over_padding(&[0x31, 0xc0, 0xc3, 0x90, 0x90, 0x90], AT).is_none());
    }
}
