//! The int3 probe: a breakpoint on the function's first instruction, and a
//! slot where that instruction runs displaced, so a breakpoint never has to
//! be lifted.
//!
//! Lifting it to single-step (the classic debugger dance) costs five times a
//! stop and lets other threads run through the function unseen while the
//! original byte is back. Instead each breakpoint gets a slot holding its
//! displaced instruction, relocated by iced-x86's block encoder (RIP-relative
//! operands and branches keep their targets), followed by a jump back to the
//! instruction after it. A thread stopped at the int3 resumes at the slot.
//! The slot also holds a call stub through which memptrace captures a call's
//! return without touching the target's stack (see [`slot_code`]).
//!
//! Slots lie in trampoline areas (`space::areas`), within ±2 GiB of the code
//! they stand for. This module is pure: it computes bytes and addresses; the
//! space writes them.

use iced_x86::code_asm::{CodeAssembler, IcedError, qword_ptr, rsp};
use iced_x86::{
    BlockEncoder, BlockEncoderOptions, Code, Decoder, DecoderOptions, Instruction, InstructionBlock,
};

/// The breakpoint instruction.
pub const INT3: u8 = 0xcc;
/// Bytes per slot: the call stub, then the displaced instruction.
pub const SLOT_SIZE: u64 = 64;
/// Offset of the displaced instruction (the longest x86 instruction is 15
/// bytes; relocated, plus the jump back, it fits in 32).
pub const DISPLACED: u64 = 32;

/// The call stub at the start of every slot: `lea rsp, [rsp-8]; call
/// slot+DISPLACED; int3; lea rsp, [rsp+8]; ret`, assembled once, with the
/// offset of each place a thread can stop in it taken from its labels.
#[derive(Debug)]
pub struct Stub {
    /// The stub's code, position independent (the call is relative),
    /// padded with int3 to [`DISPLACED`].
    pub bytes: Vec<u8>,
    /// The `call`: the `lea` before it has run.
    pub call: u64,
    /// The int3 a call through the stub returns to.
    pub return_int3: u64,
    /// The `lea` that undoes the first.
    pub unlea: u64,
    /// The `ret` to the allocator's caller.
    pub ret: u64,
}

/// The stub (see [`Stub`]).
pub fn stub() -> &'static Stub {
    static STUB: std::sync::LazyLock<Stub> = std::sync::LazyLock::new(|| {
        assemble_stub().expect("the int3 call stub assembles (a unit test decodes it)")
    });
    &STUB
}

fn assemble_stub() -> Option<Stub> {
    let assembled = || -> Result<(Vec<u8>, [u64; 4]), IcedError> {
        let mut a = CodeAssembler::new(64)?;
        let mut labels = [(); 4].map(|_| a.create_label());
        let [call, return_int3, unlea, ret] = &mut labels;
        a.lea(rsp, qword_ptr(rsp - 8))?;
        a.set_label(call)?;
        // Assembled at 0: the relative call reaches the displaced
        // instruction wherever the slot lies.
        a.call(DISPLACED)?;
        a.set_label(return_int3)?;
        a.int3()?;
        a.set_label(unlea)?;
        a.lea(rsp, qword_ptr(rsp + 8))?;
        a.set_label(ret)?;
        a.ret()?;
        let result = a.assemble_options(0, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)?;
        let mut offsets = [0; 4];
        for (offset, label) in offsets.iter_mut().zip(&labels) {
            *offset = result.label_ip(label)?;
        }
        Ok((result.inner.code_buffer, offsets))
    };
    let (mut bytes, [call, return_int3, unlea, ret]) = assembled().ok()?;
    if bytes.len() as u64 > DISPLACED {
        return None;
    }
    bytes.resize(DISPLACED as usize, INT3);
    Some(Stub {
        bytes,
        call,
        return_int3,
        unlea,
        ret,
    })
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RelocateError {
    #[error("cannot decode the instruction at {0:#x}")]
    Undecodable(u64),
    #[error("cannot relocate the instruction at {0:#x}: {1}")]
    Unrelocatable(u64, String),
}

/// The whole slot at `slot` for a breakpoint at `addr` (whose bytes start
/// `code`).
///
/// A thread stopped at the breakpoint resumes at one of two entries:
/// - `slot + DISPLACED`: the displaced instruction, then a jump back into the
///   function. The call goes on as if no breakpoint were there.
/// - `slot` (the stub), when memptrace wants the call's result: the stub
///   *calls* the displaced instruction, so the function returns into the stub,
///   to the int3 at `slot +` [`Stub::return_int3`], where memptrace reads rax; after it,
///   `ret` returns to the real caller. Nothing is written to the target's
///   stack by memptrace and no register changes at the return stop, and calls
///   and returns stay paired (a shadow stack sees nothing amiss). The `lea`
///   keeps the stack 16-byte aligned as the ABI wants at a function's entry:
///   inside the function the stack is 16 bytes deeper than without memptrace,
///   which nothing may rely on (the allocator functions take no arguments on
///   the stack).
///
/// Returns the slot's bytes and its displaced part (at `slot + DISPLACED`).
pub fn slot_code(code: &[u8], addr: u64, slot: u64) -> Result<(Vec<u8>, Displaced), RelocateError> {
    let displaced = displaced(code, addr, slot + DISPLACED)?;
    let mut bytes = stub().bytes.clone();
    bytes.extend_from_slice(&displaced.bytes);
    Ok((bytes, displaced))
}

/// Where a thread stopped at `rip` stands in the stub of the slot at `stub`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InStub {
    /// Not in this stub.
    No,
    /// Before the call: the function has not started. The thread belongs at
    /// the function's entry, with rsp `pop` bytes higher (undoing the `lea`).
    NotCalled { pop: u64 },
    /// The call returned: the caller's return address is at rsp + `at`, and
    /// the stub's `ret` would leave rsp `pop` bytes higher than now.
    Returned { at: u64, pop: u64 },
}

/// See [`InStub`].
pub fn in_stub(rip: u64, at: u64) -> InStub {
    let s = stub();
    match rip.wrapping_sub(at) {
        0 => InStub::NotCalled { pop: 0 },
        off if off == s.call => InStub::NotCalled { pop: 8 },
        // At the int3 or past it, before `lea rsp, [rsp+8]`.
        off if off == s.return_int3 || off == s.unlea => InStub::Returned { at: 8, pop: 16 },
        off if off == s.ret => InStub::Returned { at: 0, pop: 8 },
        _ => InStub::No,
    }
}

/// The offset in `code` of a `pop` into a register no caller expects to
/// survive a call (rdi, rsi or rcx) followed by `ret`. A call made through a
/// stub can be sent there to return to its caller once the stub is gone: the
/// word the stub's `lea` skipped goes into that register, rax (the result)
/// is untouched. Any real program has such a pair: `pop r15; ret`
/// (41 5f c3) holds `pop rdi; ret`.
pub fn pop_ret(code: &[u8]) -> Option<usize> {
    code.windows(2)
        .position(|w| matches!(w, [0x59 | 0x5e | 0x5f, 0xc3]))
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
    if bytes.len() as u64 > SLOT_SIZE - DISPLACED {
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
    fn stub_calls_the_displaced_instruction() {
        // push r12 (glibc malloc's first instruction).
        let code = [0x41, 0x54, 0x55, 0x48, 0x89, 0xe5];
        let slot = 0x7f00_0000_0040;
        let (bytes, d) = slot_code(&code, 0x7f00_0000_1000, slot).unwrap();
        assert_eq!(d.bytes[..], bytes[DISPLACED as usize..]);
        assert!(bytes.len() as u64 <= SLOT_SIZE);
        let stub = decode_all(&bytes[..DISPLACED as usize], slot);
        let names: Vec<Mnemonic> = stub.iter().take(5).map(|i| i.mnemonic()).collect();
        assert_eq!(
            names,
            [
                Mnemonic::Lea,
                Mnemonic::Call,
                Mnemonic::Int3,
                Mnemonic::Lea,
                Mnemonic::Ret
            ]
        );
        assert_eq!(stub[0].memory_displacement64() as i64, -8);
        assert_eq!(stub[1].near_branch_target(), slot + DISPLACED);
        assert_eq!(stub[2].ip(), slot + super::stub().return_int3);
        assert_eq!(stub[3].memory_displacement64(), 8);
        let displaced = decode_all(&bytes[DISPLACED as usize..], slot + DISPLACED);
        assert_eq!(displaced[0].mnemonic(), Mnemonic::Push);
        assert_eq!(displaced[1].near_branch_target(), 0x7f00_0000_1002);
    }

    #[test]
    fn places_in_a_stub() {
        let stub = 0x1000;
        assert_eq!(in_stub(stub, stub), InStub::NotCalled { pop: 0 });
        assert_eq!(in_stub(stub + 5, stub), InStub::NotCalled { pop: 8 });
        let returned = InStub::Returned { at: 8, pop: 16 };
        assert_eq!(in_stub(stub + 10, stub), returned);
        assert_eq!(in_stub(stub + 11, stub), returned);
        assert_eq!(in_stub(stub + 16, stub), InStub::Returned { at: 0, pop: 8 });
        for other in [stub + 1, stub + 12, stub + DISPLACED, stub - 1] {
            assert_eq!(in_stub(other, stub), InStub::No);
        }
        // The offsets agree with the stub's code.
        let (bytes, _) = slot_code(&[0x41, 0x54], 0x7f00_0000_1000, 0x7f00_0000_0000).unwrap();
        let insns = decode_all(&bytes[..DISPLACED as usize], 0);
        let ips: Vec<u64> = insns.iter().take(5).map(|i| i.ip()).collect();
        assert_eq!(ips, [0, 5, 10, 11, 16]);
        let s = super::stub();
        assert_eq!([s.call, s.return_int3, s.unlea, s.ret], [5, 10, 11, 16]);
    }

    #[test]
    fn finds_a_pop_and_ret() {
        // pop r15; ret: the second byte starts pop rdi; ret.
        assert_eq!(pop_ret(&[0x90, 0x41, 0x5f, 0xc3]), Some(2));
        assert_eq!(pop_ret(&[0x5e, 0xc3]), Some(0));
        // pop rdx could hold half of a 128-bit result; pop rbx is the caller's.
        assert_eq!(pop_ret(&[0x5a, 0xc3, 0x5b, 0xc3, 0xc3]), None);
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
}
