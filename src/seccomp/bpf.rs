//! A classic-BPF interpreter for seccomp filters: what a filter answers for
//! one `struct seccomp_data`, computed here so that memptrace never has to
//! try a system call in the target to find out.
//!
//! It follows the kernel (`kernel/seccomp.c`, `seccomp_check_filter`, and
//! `net/core/filter.c`, `bpf_convert_filter`): 32-bit loads from the data at
//! 4-aligned offsets below 64, `BPF_LEN` is 64, division or modulo by a zero
//! `X` returns 0 (`SECCOMP_RET_KILL_THREAD`), shifts by `X` use its low 5
//! bits, jumps go forward only. It must never panic or loop on a program,
//! whatever its bytes: every step moves forward, every index is checked,
//! and anything the kernel would refuse is an error. A field of the data
//! that is not known (an argument the probe's code leaves as it finds it)
//! makes the program's answer unknown as soon as it is loaded.

/// One instruction (`struct sock_filter`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    pub code: u16,
    pub jt: u8,
    pub jf: u8,
    pub k: u32,
}

impl Insn {
    /// Decode the 8-byte `struct sock_filter` (little-endian fields).
    pub fn from_bytes(b: [u8; 8]) -> Insn {
        Insn {
            code: u16::from_le_bytes([b[0], b[1]]),
            jt: b[2],
            jf: b[3],
            k: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        }
    }
}

/// What the filter sees of a system call (`struct seccomp_data`); `None`
/// for a field whose value memptrace does not know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Data {
    pub nr: i32,
    pub arch: u32,
    pub instruction_pointer: Option<u64>,
    pub args: [Option<u64>; 6],
}

/// `sizeof(struct seccomp_data)`.
pub const DATA_LEN: u32 = 64;

impl Data {
    /// The 32-bit word at byte `offset` of the data, as the kernel loads it.
    fn word(&self, offset: u32) -> Result<u32, BpfError> {
        if offset % 4 != 0 || offset >= DATA_LEN {
            return Err(BpfError::BadLoad(offset));
        }
        let half = |value: Option<u64>, what: &'static str| -> Result<u32, BpfError> {
            let v = value.ok_or(BpfError::Unknown(what))?;
            Ok(if offset % 8 == 0 {
                v as u32
            } else {
                (v >> 32) as u32
            })
        };
        match offset {
            0 => Ok(self.nr as u32),
            4 => Ok(self.arch),
            8 | 12 => half(self.instruction_pointer, "instruction_pointer"),
            _ => {
                let i = ((offset - 16) / 8) as usize;
                half(self.args[i], ARG_NAMES[i])
            }
        }
    }
}

const ARG_NAMES: [&str; 6] = [
    "args[0]", "args[1]", "args[2]", "args[3]", "args[4]", "args[5]",
];

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BpfError {
    #[error("the filter reads {0}, which is not known in advance")]
    Unknown(&'static str),
    #[error("the filter loads from offset {0}, outside seccomp_data")]
    BadLoad(u32),
    #[error("the filter has an instruction seccomp does not allow ({0:#06x})")]
    BadInsn(u16),
    #[error("the filter jumps or runs past its end")]
    OutOfRange,
    #[error("the filter uses scratch memory word {0}, of 16")]
    BadMemory(u32),
}

// Instruction classes and fields (`linux/bpf_common.h`).
const LD: u16 = 0x00;
const LDX: u16 = 0x01;
const ST: u16 = 0x02;
const STX: u16 = 0x03;
const ALU: u16 = 0x04;
const JMP: u16 = 0x05;
const RET: u16 = 0x06;
const MISC: u16 = 0x07;
const W: u16 = 0x00;
const IMM: u16 = 0x00;
const ABS: u16 = 0x20;
const MEM: u16 = 0x60;
const LEN: u16 = 0x80;
const K: u16 = 0x00;
const X: u16 = 0x08;
const A: u16 = 0x10;

/// Longest program the kernel accepts (`BPF_MAXINSNS`).
pub const MAX_INSNS: usize = 4096;

/// Run `prog` on `data`: the value of its `ret`.
pub fn run(prog: &[Insn], data: &Data) -> Result<u32, BpfError> {
    if prog.len() > MAX_INSNS {
        return Err(BpfError::OutOfRange);
    }
    let (mut a, mut x) = (0u32, 0u32);
    let mut mem = [0u32; 16];
    let mut pc = 0usize;
    // Every instruction moves pc forward by at least one, so this ends
    // within prog.len() steps.
    loop {
        let insn = *prog.get(pc).ok_or(BpfError::OutOfRange)?;
        pc += 1;
        if insn.code > 0xff {
            return Err(BpfError::BadInsn(insn.code));
        }
        let k = insn.k;
        let slot = |k: u32| -> Result<usize, BpfError> {
            (k < 16).then_some(k as usize).ok_or(BpfError::BadMemory(k))
        };
        match insn.code {
            c if c == LD | W | ABS => a = data.word(k)?,
            c if c == LD | W | LEN => a = DATA_LEN,
            c if c == LDX | W | LEN => x = DATA_LEN,
            c if c == LD | IMM => a = k,
            c if c == LDX | IMM => x = k,
            c if c == LD | MEM => a = mem[slot(k)?],
            c if c == LDX | MEM => x = mem[slot(k)?],
            c if c == ST => mem[slot(k)?] = a,
            c if c == STX => mem[slot(k)?] = x,
            c if c == RET | K => return Ok(k),
            c if c == RET | A => return Ok(a),
            c if c == MISC => x = a,        // TAX
            c if c == MISC | 0x80 => a = x, // TXA
            c if c & 0x07 == ALU => {
                let src = if c & X != 0 { x } else { k };
                a = match alu(c & 0xf0, a, src, c & X != 0)? {
                    Some(v) => v,
                    // Division by a zero X: the program returns 0.
                    None => return Ok(0),
                };
            }
            c if c & 0x07 == JMP => {
                let src = if c & X != 0 { x } else { k };
                let skip = match c & 0xf0 {
                    0x00 if c & X == 0 => k as usize, // JA
                    0x10 => pick(a == src, insn),
                    0x20 => pick(a > src, insn),
                    0x30 => pick(a >= src, insn),
                    0x40 => pick(a & src != 0, insn),
                    _ => return Err(BpfError::BadInsn(c)),
                };
                pc = pc.checked_add(skip).ok_or(BpfError::OutOfRange)?;
            }
            c => return Err(BpfError::BadInsn(c)),
        }
    }
}

fn pick(taken: bool, insn: Insn) -> usize {
    usize::from(if taken { insn.jt } else { insn.jf })
}

/// An ALU operation on `a` and `src`; `None` for a division by a zero `X`
/// (a zero `K` is refused, as the kernel refuses the program).
fn alu(op: u16, a: u32, src: u32, by_x: bool) -> Result<Option<u32>, BpfError> {
    let bad = || BpfError::BadInsn(ALU | op);
    Ok(Some(match op {
        0x00 => a.wrapping_add(src),
        0x10 => a.wrapping_sub(src),
        0x20 => a.wrapping_mul(src),
        0x30 | 0x90 => {
            if src == 0 {
                return if by_x { Ok(None) } else { Err(bad()) };
            }
            if op == 0x30 { a / src } else { a % src }
        }
        0x40 => a | src,
        0x50 => a & src,
        0x60 | 0x70 if !by_x && src >= 32 => return Err(bad()),
        0x60 => a.wrapping_shl(src),
        0x70 => a.wrapping_shr(src),
        0x80 if !by_x => a.wrapping_neg(),
        0xa0 => a ^ src,
        _ => return Err(bad()),
    }))
}

/// What a filter's return value tells the kernel to do
/// (`SECCOMP_RET_ACTION_FULL` of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    KillProcess,
    KillThread,
    Trap,
    Errno(u16),
    UserNotif,
    Trace,
    Log,
    Allow,
    /// A value the kernel does not know: it kills the process.
    Other(u32),
}

impl Action {
    pub fn of(ret: u32) -> Action {
        match ret & 0xffff_0000 {
            0x8000_0000 => Action::KillProcess,
            0x0000_0000 => Action::KillThread,
            0x0003_0000 => Action::Trap,
            0x0005_0000 => Action::Errno((ret & 0xffff) as u16),
            0x7fc0_0000 => Action::UserNotif,
            0x7ff0_0000 => Action::Trace,
            0x7ffc_0000 => Action::Log,
            0x7fff_0000 => Action::Allow,
            _ => Action::Other(ret),
        }
    }

    /// The call runs as if no filter were there. (`SECCOMP_RET_TRACE` does
    /// not: memptrace does not ask for seccomp stops, and then the call
    /// fails with ENOSYS.)
    pub fn allows(self) -> bool {
        matches!(self, Action::Allow | Action::Log)
    }

    /// How the kernel orders the results of several filters: the lowest
    /// action, taken as a signed number, wins (`seccomp_run_filters`).
    pub fn rank(ret: u32) -> i32 {
        (ret & 0xffff_0000) as i32
    }
}

/// The result of every filter together, as the kernel combines them: the
/// strictest. `None` when there is no filter.
pub fn strictest(results: impl IntoIterator<Item = u32>) -> Option<u32> {
    results.into_iter().min_by_key(|&r| Action::rank(r))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A statement: no jump offsets.
    pub(in crate::seccomp) fn stmt(code: u16, k: u32) -> Insn {
        Insn {
            code,
            jt: 0,
            jf: 0,
            k,
        }
    }

    pub(in crate::seccomp) fn jump(code: u16, k: u32, jt: u8, jf: u8) -> Insn {
        Insn { code, jt, jf, k }
    }

    const ALLOW: u32 = 0x7fff_0000;
    const KILL: u32 = 0x8000_0000;
    const EPERM: u32 = 0x0005_0001;

    fn data(nr: i32) -> Data {
        Data {
            nr,
            arch: 0xc000_003e,
            instruction_pointer: Some(0x7f00_1234_5678),
            args: [
                Some(1),
                Some(2),
                Some(0x1_0000_0003),
                None,
                Some(0),
                Some(0),
            ],
        }
    }

    /// Kill on `nr`, allow the rest, after checking the architecture.
    fn deny(nr: u32, action: u32) -> Vec<Insn> {
        vec![
            stmt(LD | W | ABS, 4),
            jump(JMP | 0x10, 0xc000_003e, 1, 0),
            stmt(RET | K, KILL),
            stmt(LD | W | ABS, 0),
            jump(JMP | 0x10, nr, 0, 1),
            stmt(RET | K, action),
            stmt(RET | K, ALLOW),
        ]
    }

    #[test]
    fn a_deny_list_answers_per_call() {
        let prog = deny(319, KILL);
        assert_eq!(run(&prog, &data(319)), Ok(KILL));
        assert_eq!(run(&prog, &data(9)), Ok(ALLOW));
        let other_arch = Data {
            arch: 0x4000_0003,
            ..data(9)
        };
        assert_eq!(run(&prog, &other_arch), Ok(KILL));
        assert_eq!(Action::of(KILL), Action::KillProcess);
        assert_eq!(Action::of(EPERM), Action::Errno(1));
        assert!(Action::of(ALLOW).allows());
        assert!(Action::of(0x7ffc_0000).allows());
        assert!(!Action::of(0x7ff0_0000).allows());
        assert_eq!(Action::of(0x1234_0000), Action::Other(0x1234_0000));
    }

    #[test]
    fn the_strictest_result_wins() {
        assert_eq!(strictest([ALLOW, EPERM, 0x7ffc_0000]), Some(EPERM));
        assert_eq!(strictest([EPERM, 0, ALLOW]), Some(0));
        assert_eq!(strictest([0, KILL]), Some(KILL));
        assert_eq!(strictest([]), None);
    }

    #[test]
    fn loads_words_of_the_data() {
        let d = data(7);
        let load = |k| run(&[stmt(LD | W | ABS, k), stmt(RET | A, 0)], &d);
        assert_eq!(load(0), Ok(7));
        assert_eq!(load(8), Ok(0x1234_5678));
        assert_eq!(load(12), Ok(0x7f00));
        assert_eq!(load(32), Ok(3));
        assert_eq!(load(36), Ok(1));
        assert_eq!(load(40), Err(BpfError::Unknown("args[3]")));
        assert_eq!(load(60), Ok(0));
        assert_eq!(load(64), Err(BpfError::BadLoad(64)));
        assert_eq!(load(2), Err(BpfError::BadLoad(2)));
        assert_eq!(
            run(&[stmt(LD | W | LEN, 0), stmt(RET | A, 0)], &d),
            Ok(DATA_LEN)
        );
    }

    #[test]
    fn alu_memory_and_jumps() {
        let d = data(5);
        let prog = [
            stmt(LD | W | ABS, 0),       // a = 5
            stmt(ST, 3),                 // m[3] = 5
            stmt(LDX | IMM, 3),          // x = 3
            stmt(ALU | 0x20 | X, 0),     // a = 15
            stmt(ALU | 0x90 | K, 4),     // a = 3
            stmt(ALU | 0x60 | K, 4),     // a = 48
            stmt(ALU | 0xa0 | X, 0),     // a = 51
            stmt(LDX | MEM, 3),          // x = 5
            stmt(ALU | 0x10 | X, 0),     // a = 46
            jump(JMP | 0x40, 0x2, 0, 2), // 46 & 2: taken
            stmt(MISC | 0x80, 0),        // a = x = 5
            stmt(RET | A, 0),
            stmt(RET | K, 99),
        ];
        assert_eq!(run(&prog, &d), Ok(5));
        let ja = [stmt(JMP, 1), stmt(RET | K, 1), stmt(RET | K, 2)];
        assert_eq!(run(&ja, &d), Ok(2));
    }

    #[test]
    fn division_by_a_zero_x_returns_zero() {
        let prog = [
            stmt(LD | IMM, 8),
            stmt(ALU | 0x30 | X, 0),
            stmt(RET | K, ALLOW),
        ];
        assert_eq!(run(&prog, &data(0)), Ok(0));
        let by_k = [stmt(ALU | 0x30 | K, 0), stmt(RET | K, ALLOW)];
        assert_eq!(run(&by_k, &data(0)), Err(BpfError::BadInsn(ALU | 0x30)));
        let shift_x = [
            stmt(LD | IMM, 1),
            stmt(LDX | IMM, 33),
            stmt(ALU | 0x60 | X, 0),
            stmt(RET | A, 0),
        ];
        assert_eq!(run(&shift_x, &data(0)), Ok(2));
    }

    #[test]
    fn bad_programs_are_errors_not_panics() {
        let d = data(0);
        assert_eq!(run(&[], &d), Err(BpfError::OutOfRange));
        assert_eq!(run(&[stmt(LD | IMM, 1)], &d), Err(BpfError::OutOfRange));
        let far = [jump(JMP | 0x10, 0, 255, 255), stmt(RET | K, 0)];
        assert_eq!(run(&far, &d), Err(BpfError::OutOfRange));
        let ja = [stmt(JMP, u32::MAX), stmt(RET | K, 0)];
        assert_eq!(run(&ja, &d), Err(BpfError::OutOfRange));
        assert_eq!(run(&[stmt(ST, 16)], &d), Err(BpfError::BadMemory(16)));
        assert_eq!(run(&[stmt(0x30, 0)], &d), Err(BpfError::BadInsn(0x30)));
        let long = vec![stmt(RET | K, 0); MAX_INSNS + 1];
        assert_eq!(run(&long, &d), Err(BpfError::OutOfRange));
        // Every 16-bit opcode with any k: an answer or an error.
        for code in 0..=u16::MAX {
            for k in [0, 1, 15, 16, 63, 64, u32::MAX] {
                let _ = run(
                    &[
                        Insn {
                            code,
                            jt: 1,
                            jf: 0,
                            k,
                        },
                        stmt(RET | K, 1),
                    ],
                    &d,
                );
            }
        }
        assert_eq!(
            Insn::from_bytes([0x15, 0, 1, 2, 0x3f, 1, 0, 0]),
            jump(0x15, 0x13f, 1, 2)
        );
    }
}
