//! The unwind rules of [`super::tables`] walked in Rust: what the jump
//! probe's assembly does with a rule (src/tracer/probes/jump/code.rs,
//! `walk`), step for step, so that the rules and the assembly have a
//! reference to be checked against (and framehop a peer: the tests below
//! walk every row of real images both ways).

use super::signal;
use super::tables::rule;

/// A frame of a walk: `ip` a return address (or an interrupted address
/// plus one), `cfa` its stack pointer so far (the CFA of the frame below),
/// `bp` rbp as the frame left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    pub ip: u64,
    pub cfa: u64,
    pub bp: u64,
}

/// What one step of a walk finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The caller's frame.
    Caller(Frame),
    /// The outermost frame: the stack is whole.
    Outermost,
    /// The walk cannot go on: the stack is truncated.
    Truncated,
}

/// One step from `frame` by `rule`, reading the stack below `stack_end`
/// with `read` (`None`: unreadable, where the probe's walk would fault).
/// The checks are the assembly's: a CFA above the frame and inside the
/// stack, a saved rbp above the frame, a frame pointer aligned and inside.
pub fn step(rule: u32, frame: Frame, stack_end: u64, read: impl Fn(u64) -> Option<u64>) -> Step {
    let next = |ip: u64, cfa: u64, bp: u64| match ip {
        0 => Step::Outermost,
        ip => Step::Caller(Frame { ip, cfa, bp }),
    };
    match rule {
        rule::END => Step::Outermost,
        rule::NONE => {
            let bp = frame.bp;
            let Some(cfa) = bp.checked_add(16) else {
                return Step::Truncated;
            };
            if bp % 8 != 0 || bp < frame.cfa || cfa > stack_end {
                return Step::Truncated;
            }
            match (read(bp + 8), read(bp)) {
                (Some(ip), Some(caller_bp)) => next(ip, cfa, caller_bp),
                _ => Step::Truncated,
            }
        }
        rule::SIGNAL => signal_step(frame, stack_end, &read),
        r if r & rule::NONE != 0 => Step::Truncated,
        r => {
            let base = if r & rule::RBP_BASED != 0 {
                frame.bp
            } else {
                frame.cfa
            };
            let cfa = base.wrapping_add(u64::from(r & rule::OFFSET_MASK));
            if cfa < frame.cfa.wrapping_add(8) || cfa > stack_end {
                return Step::Truncated;
            }
            let saved = (r >> rule::RBP_SHIFT) & rule::RBP_MASK;
            let bp = if saved == 0 {
                frame.bp
            } else {
                let at = cfa.wrapping_sub(u64::from(saved) * 8);
                if at < frame.cfa {
                    return Step::Truncated;
                }
                let Some(bp) = read(at) else {
                    return Step::Truncated;
                };
                bp
            };
            match read(cfa.wrapping_sub(8)) {
                Some(ip) => next(ip, cfa, bp),
                None => Step::Truncated,
            }
        }
    }
}

/// How a walk ended, as the probe's record says it (its flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The outermost frame: the stack is whole.
    Outermost,
    /// A step could not be taken: the stack is truncated.
    Truncated,
    /// `max` frames were taken (`--max-depth`).
    Full,
}

/// A walk from `frame` as the probe's: each frame's address taken, then a
/// step by the rule `rule_of` gives for it, until `max` addresses are taken
/// (at least one) or a step ends the walk.
pub fn walk(
    mut frame: Frame,
    max: usize,
    stack_end: u64,
    rule_of: impl Fn(u64) -> u32,
    read: impl Fn(u64) -> Option<u64>,
) -> (Vec<u64>, End) {
    let mut ips = Vec::new();
    loop {
        ips.push(frame.ip);
        if ips.len() >= max {
            return (ips, End::Full);
        }
        match step(rule_of(frame.ip), frame, stack_end, &read) {
            Step::Caller(caller) => frame = caller,
            Step::Outermost => return (ips, End::Outermost),
            Step::Truncated => return (ips, End::Truncated),
        }
    }
}

/// A return address into the signal-return trampoline: the next frame is
/// the interrupted code's, from the context the kernel saved at the CFA.
fn signal_step(frame: Frame, stack_end: u64, read: &impl Fn(u64) -> Option<u64>) -> Step {
    let Some(end) = frame.cfa.checked_add(signal::RIP + 8) else {
        return Step::Truncated;
    };
    if end > stack_end {
        return Step::Truncated;
    }
    let (Some(sp), Some(ip), Some(bp)) = (
        read(frame.cfa + signal::RSP),
        read(frame.cfa + signal::RIP),
        read(frame.cfa + signal::RBP),
    ) else {
        return Step::Truncated;
    };
    if sp < end || sp > stack_end || ip == 0 {
        return Step::Truncated;
    }
    Step::Caller(Frame {
        ip: ip + 1,
        cfa: sp,
        bp,
    })
}

/// The images whose every row the tests walk: this machine's libc and the
/// test binary.
#[cfg(test)]
pub(crate) fn real_images() -> [String; 2] {
    [
        "/lib/x86_64-linux-gnu/libc.so.6".to_string(),
        std::env::current_exe()
            .expect("the test binary")
            .to_string_lossy()
            .into_owned(),
    ]
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::addr::LoadBias;
    use crate::symbols::elf::ElfImage;
    use crate::trace_msg::{MappedImage, StackSample};
    use crate::unwind::Unwinder;
    use crate::unwind::framehop::FramehopUnwinder;
    use crate::unwind::tables::{self, UnwindTable};

    /// Every word of the synthetic stack is its address plus this: a
    /// caller's return address names the CFA it was read below.
    const PATTERN: u64 = 0x0000_5555_0000_0000;
    const SP: u64 = 0x7ffd_0000_0000;
    const BP: u64 = SP + 0x200;
    const LEN: u64 = 0x1_0000;

    /// A frame on the synthetic stack.
    const FRAME: Frame = Frame {
        ip: 0x401234,
        cfa: SP,
        bp: BP,
    };

    fn word(at: u64) -> Option<u64> {
        (SP..SP + LEN).contains(&at).then_some(PATTERN + at)
    }

    #[test]
    fn steps_by_each_kind_of_rule() {
        let frame = FRAME;
        let end = SP + LEN;
        // CFA = rsp + 24, rbp kept.
        let caller = step(24, frame, end, word);
        assert_eq!(
            caller,
            Step::Caller(Frame {
                ip: PATTERN + SP + 16,
                cfa: SP + 24,
                bp: BP
            })
        );
        // CFA = rbp + 16, rbp saved at CFA - 16.
        let r = rule::RBP_BASED | 16 | (2 << rule::RBP_SHIFT);
        assert_eq!(
            step(r, frame, end, word),
            Step::Caller(Frame {
                ip: PATTERN + BP + 8,
                cfa: BP + 16,
                bp: PATTERN + BP
            })
        );
        // No CFI: the frame pointer.
        assert_eq!(
            step(rule::NONE, frame, end, word),
            Step::Caller(Frame {
                ip: PATTERN + BP + 8,
                cfa: BP + 16,
                bp: PATTERN + BP
            })
        );
        assert_eq!(step(rule::END, frame, end, word), Step::Outermost);
        assert_eq!(step(rule::UNSUPPORTED, frame, end, word), Step::Truncated);
        // A CFA below the frame, or past the stack's end; a misaligned or
        // low frame pointer; a saved rbp below the frame.
        assert_eq!(step(4, frame, end, word), Step::Truncated);
        assert_eq!(step(24, frame, SP + 16, word), Step::Truncated);
        let low = Frame {
            bp: SP - 16,
            ..frame
        };
        assert_eq!(step(rule::NONE, low, end, word), Step::Truncated);
        let odd = Frame {
            bp: BP + 4,
            ..frame
        };
        assert_eq!(step(rule::NONE, odd, end, word), Step::Truncated);
        assert_eq!(
            step(8 | (2 << rule::RBP_SHIFT), frame, end, word),
            Step::Truncated
        );
        // A zero return address ends the stack.
        assert_eq!(step(24, frame, end, |_| Some(0)), Step::Outermost);
        // Unreadable: truncated, never a guess.
        assert_eq!(step(24, frame, end, |_| None), Step::Truncated);
    }

    #[test]
    fn a_walk_ends_full_whole_or_truncated() {
        let frame = FRAME;
        let end = SP + LEN;
        // CFA = rsp + 24 each time: return addresses at CFA - 8.
        let (ips, how) = walk(frame, 3, end, |_| 24, word);
        assert_eq!(ips, [0x401234, PATTERN + SP + 16, PATTERN + SP + 40]);
        assert_eq!(how, End::Full);
        assert_eq!(
            walk(frame, 3, end, |_| rule::END, word),
            (vec![0x401234], End::Outermost)
        );
        let once = |ip: u64| {
            if ip == frame.ip {
                24
            } else {
                rule::UNSUPPORTED
            }
        };
        assert_eq!(
            walk(frame, 3, end, once, word),
            (vec![0x401234, PATTERN + SP + 16], End::Truncated)
        );
        // At least the first frame, whatever the limit.
        assert_eq!(walk(frame, 0, end, |_| 24, word).0, [0x401234]);
    }

    #[test]
    fn a_signal_frame_leads_to_the_interrupted_code() {
        let frame = FRAME;
        let (rip, rsp, rbp) = (0x40_5000, SP + 0x800, SP + 0x900);
        let read = |at: u64| match at - SP {
            signal::RIP => Some(rip),
            signal::RSP => Some(rsp),
            signal::RBP => Some(rbp),
            _ => word(at),
        };
        assert_eq!(
            step(rule::SIGNAL, frame, SP + LEN, read),
            Step::Caller(Frame {
                ip: rip + 1,
                cfa: rsp,
                bp: rbp
            })
        );
        // The interrupted stack pointer inside the context: refused.
        let inside = |at: u64| {
            if at - SP == signal::RSP {
                Some(SP + 8)
            } else {
                read(at)
            }
        };
        assert_eq!(step(rule::SIGNAL, frame, SP + LEN, inside), Step::Truncated);
    }

    fn mapped(path: &str, bias: LoadBias) -> MappedImage {
        let image = ElfImage::parse(path, &std::fs::read(path).unwrap()).unwrap();
        MappedImage {
            module_id: 1,
            range: image.avma_range(bias),
            image: Arc::new(image),
            bias,
            is_main: false,
        }
    }

    /// The caller framehop finds from a return address `ip` on the
    /// synthetic stack (rsp = SP, rbp = BP), if it finds one.
    fn framehop_caller(unwinder: &mut FramehopUnwinder, ip: u64) -> Option<u64> {
        let bytes: Vec<u8> = (0..LEN / 8)
            .flat_map(|i| (PATTERN + SP + 8 * i).to_le_bytes())
            .collect();
        let sample = StackSample {
            ip,
            sp: SP,
            bp: BP,
            base: SP,
            bytes,
        };
        let mut out = Vec::new();
        unwinder.unwind(0, &sample, &mut out, 2);
        (out.len() == 2).then(|| out[1])
    }

    /// The rule keeps a saved rbp below the frame's stack pointer: an
    /// epilogue's row (rbp was saved, then popped), where no return address
    /// points. The walk refuses to read below the frame; framehop reads it.
    fn saved_below(rule: u32) -> bool {
        let saved = (rule >> rule::RBP_SHIFT) & rule::RBP_MASK;
        rule & rule::RBP_BASED == 0 && saved != 0 && (rule & rule::OFFSET_MASK) < saved * 8
    }

    /// Every row of `path`'s table, walked one step from a return address
    /// it covers by the rule and by framehop over the image's CFI: where
    /// the rule is a CFA rule (the rows the probes follow), framehop finds
    /// the same caller, or the rule's row is an epilogue's (`saved_below`).
    /// Returns (CFA rows, rows where both found the same caller).
    fn cross_check(path: &str) -> (usize, usize) {
        let bias = LoadBias(0x7f00_0000_0000);
        let image = mapped(path, bias);
        let table: UnwindTable = tables::build(&image.image);
        let mut unwinder = FramehopUnwinder::new();
        unwinder.add_image(&image);
        let (mut cfa_rows, mut same) = (0, 0);
        let mut differ = Vec::new();
        for (&key, &rule) in table.keys.iter().zip(&table.rules) {
            if rule & rule::NONE != 0 {
                continue;
            }
            cfa_rows += 1;
            let ip = bias.0 + u64::from(key) + 1;
            let frame = Frame {
                ip,
                cfa: SP,
                bp: BP,
            };
            let ours = match step(rule, frame, SP + LEN, word) {
                Step::Caller(caller) => Some(caller.ip),
                _ => None,
            };
            match (ours, framehop_caller(&mut unwinder, ip)) {
                (Some(a), Some(b)) if a == b => same += 1,
                (None, _) if saved_below(rule) => {}
                (a, b) => differ.push((key, rule, a, b)),
            }
        }
        assert!(
            differ.is_empty(),
            "{path}: {} of {cfa_rows} rows step otherwise than framehop, first (svma, rule, ours, framehop): {:x?}",
            differ.len(),
            &differ[..differ.len().min(5)]
        );
        (cfa_rows, same)
    }

    #[test]
    fn the_rules_of_real_images_step_as_framehop_does() {
        for path in real_images() {
            let (rows, same) = cross_check(&path);
            eprintln!("{path}: {same} of {rows} CFA rows walked alike by the rule and framehop");
            assert!(rows > 1000, "{path}: {rows} CFA rows");
            // The epilogues' rows are a minority: most rows are walked.
            assert!(
                same * 2 > rows,
                "{path}: {same} of {rows} rows walked alike"
            );
        }
    }
}
