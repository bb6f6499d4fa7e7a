//! The stub an injected system call runs through: a `syscall` instruction
//! followed by code that puts the thread back as it was.
//!
//! While memptrace runs a system call in a thread, that thread's registers
//! are not its own. If memptrace died then (SIGKILL, the OOM killer), the
//! kernel would let the thread go with them: on from a `syscall` instruction
//! of the C library with the call's arguments in its registers, into code
//! that expects others. Through the stub it cannot go wrong: after the call
//! the stub loads every general register from a save area written before
//! the call (the thread's own values, with an interrupted system call of its
//! own set up to run again) and jumps to where the thread was. memptrace,
//! alive, never lets the thread reach that code: it takes the result at the
//! system call's exit stop and puts the registers back itself.
//!
//! The flags need no code: the kernel returns from `syscall` with the flags
//! the thread entered it with (r11), which are the thread's own. The stub
//! writes no memory and uses no stack, so a signal that arrives while it
//! runs finds the program's stack as it was. It lies in a trampoline area,
//! mapped read + execute; memptrace writes its save area before each call
//! through /proc/PID/mem.

use iced_x86::code_asm::*;
use iced_x86::{BlockEncoderOptions, IcedError};

use crate::os::ptrace::Regs;

/// The registers the stub loads, in save-area order; `rsp` last but one
/// and the address to go back to last.
const LOADED: [AsmRegister64; 15] = [
    rax, rbx, rcx, rdx, rsi, rdi, rbp, r8, r9, r10, r11, r12, r13, r14, r15,
];

/// Words in the save area: the registers of [`LOADED`], `rsp`, and `rip`.
pub const SAVED_WORDS: usize = LOADED.len() + 2;

/// The stub's machine code and where its save area lies in it.
pub struct Stub {
    pub code: Vec<u8>,
    /// Offset of the save area from the stub's start (8-aligned).
    pub save: u64,
}

impl Stub {
    /// Bytes the stub takes in a trampoline area.
    pub fn len(&self) -> u64 {
        self.code.len() as u64
    }
}

/// The stub, assembled once; `None` if iced-x86 cannot (then every call
/// goes through the program's own instruction).
pub fn code() -> Option<&'static Stub> {
    static CODE: std::sync::OnceLock<Option<Stub>> = std::sync::OnceLock::new();
    CODE.get_or_init(|| assemble().ok()).as_ref()
}

/// Assemble the stub. Its code is position independent (every load is
/// relative to `rip`), so it runs wherever it is written.
pub fn assemble() -> Result<Stub, IcedError> {
    let first = build(1)?;
    match first.save % 8 {
        0 => Ok(first),
        // rip-relative loads keep their size: more padding moves only the
        // save area.
        off => build(1 + (8 - off) as usize),
    }
}

/// The stub with `pad` int3 bytes between its code and its save area.
fn build(pad: usize) -> Result<Stub, IcedError> {
    let mut a = CodeAssembler::new(64)?;
    let mut words: Vec<CodeLabel> = (0..SAVED_WORDS).map(|_| a.create_label()).collect();
    a.syscall()?;
    for (reg, word) in LOADED.iter().zip(&words) {
        a.mov(*reg, qword_ptr(*word))?;
    }
    a.mov(rsp, qword_ptr(words[LOADED.len()]))?;
    a.jmp(qword_ptr(words[LOADED.len() + 1]))?;
    for _ in 0..pad {
        a.int3()?;
    }
    for word in &mut words {
        a.set_label(word)?;
        a.dq(&[0])?;
    }
    let result = a.assemble_options(0, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)?;
    let save = result.label_ip(&words[0])?;
    Ok(Stub {
        code: result.inner.code_buffer,
        save,
    })
}

/// The save area's words for a thread to go on with `regs`: the stub loads
/// them in this order.
pub fn save_area(regs: &Regs) -> [u8; SAVED_WORDS * 8] {
    let words: [u64; SAVED_WORDS] = [
        regs.rax, regs.rbx, regs.rcx, regs.rdx, regs.rsi, regs.rdi, regs.rbp, regs.r8, regs.r9,
        regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15, regs.rsp, regs.rip,
    ];
    let mut bytes = [0u8; SAVED_WORDS * 8];
    for (chunk, word) in bytes.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::{Decoder, DecoderOptions, Mnemonic, Register};

    #[test]
    fn loads_every_register_from_the_save_area_and_jumps_back() {
        let stub = assemble().unwrap();
        assert_eq!(stub.save % 8, 0);
        assert_eq!(stub.code.len() as u64, stub.save + SAVED_WORDS as u64 * 8);
        let base = 0x7f00_0000_0000u64;
        let code = &stub.code[..stub.save as usize];
        let insns: Vec<_> = Decoder::with_ip(64, code, base, DecoderOptions::NONE)
            .into_iter()
            .collect();
        assert_eq!(insns[0].mnemonic(), Mnemonic::Syscall);
        let word = |i: usize| base + stub.save + 8 * i as u64;
        let expected = [
            Register::RAX,
            Register::RBX,
            Register::RCX,
            Register::RDX,
            Register::RSI,
            Register::RDI,
            Register::RBP,
            Register::R8,
            Register::R9,
            Register::R10,
            Register::R11,
            Register::R12,
            Register::R13,
            Register::R14,
            Register::R15,
            Register::RSP,
        ];
        for (i, reg) in expected.iter().enumerate() {
            let insn = &insns[1 + i];
            assert_eq!(insn.mnemonic(), Mnemonic::Mov, "{insn:?}");
            assert_eq!(insn.op0_register(), *reg, "{insn:?}");
            assert!(insn.is_ip_rel_memory_operand(), "{insn:?}");
            assert_eq!(insn.ip_rel_memory_address(), word(i), "{insn:?}");
        }
        let jump = &insns[1 + expected.len()];
        assert_eq!(jump.mnemonic(), Mnemonic::Jmp);
        assert_eq!(jump.ip_rel_memory_address(), word(SAVED_WORDS - 1));
        // Nothing after the jump runs; whatever pads is a trap.
        assert!(
            insns[2 + expected.len()..]
                .iter()
                .all(|i| i.mnemonic() == Mnemonic::Int3)
        );
    }

    #[test]
    fn the_save_area_holds_the_registers_in_load_order() {
        let mut regs = crate::os::ptrace::zeroed_regs();
        regs.rax = 1;
        regs.r15 = 15;
        regs.rsp = 0x7ffd_0000;
        regs.rip = 0x401000;
        let bytes = save_area(&regs);
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!(word(0), 1);
        assert_eq!(word(14), 15);
        assert_eq!(word(15), 0x7ffd_0000);
        assert_eq!(word(16), 0x401000);
    }
}
