//! Never an invented frame: what an unwinder returns is checked before it
//! becomes a stack.
//!
//! The first frame is the return address read at the allocator's entry,
//! exact. Every frame after it must be a return address into the
//! executable code of a mapped image, just after a call instruction (or the
//! start of the C library's signal-return trampoline, which a signal handler
//! "returns" to; the frame after one is the interrupted code's, stored as
//! its address + 1: see [`super::signal`]). The first frame that is not
//! ends the stack, and the stack counts as truncated. Each frame says how it
//! was found ([`Trust`]): from the registers at the entry, by the CFI of its
//! callee's code, by the callee's frame pointer where no CFI covers that
//! code (which code compiled without frame pointers makes unreliable), or
//! from a signal frame, as crash reporters say it
//! (breakpad: "found by call frame info", "found by previous frame's frame
//! pointer").

use iced_x86::{Decoder, DecoderOptions, FlowControl};

use super::MappedImage;
use super::signal::SIGRETURN;
use crate::addr::{Avma, Svma};
pub use crate::sink::Trust;

/// Check `ips` (innermost first) against the images (`image_at`): cut it at
/// the first frame that is not a return address, and fill `trust` with how
/// each frame left was found. Returns true when frames were cut. `known`
/// holds the `(module, address)` pairs already found to be return
/// addresses: a program's stacks repeat, and decoding is the cost here.
pub fn vet<'a>(
    ips: &mut Vec<u64>,
    trust: &mut Vec<Trust>,
    known: &mut rustc_hash::FxHashSet<(u64, u64)>,
    image_at: impl Fn(u64) -> Option<&'a MappedImage>,
) -> bool {
    trust.clear();
    if ips.is_empty() {
        return false;
    }
    trust.push(Trust::Context);
    for i in 1..ips.len() {
        let image = image_at(ips[i]);
        if is_signal_return(ips[i - 1], image_at(ips[i - 1])) {
            // The interrupted code: any instruction of an image's code.
            if !in_code(ips[i].wrapping_sub(1), image) {
                ips.truncate(i);
                return true;
            }
            trust.push(Trust::Signal);
            continue;
        }
        let key = (image.map_or(u64::MAX, |m| m.module_id), ips[i]);
        if !known.contains(&key) {
            if !is_return_address(ips[i], image) {
                ips.truncate(i);
                return true;
            }
            known.insert(key);
        }
        // The callee's code: the call instruction before its return address.
        let callee = ips[i - 1];
        let by_cfi = image_at(callee).is_some_and(|m| {
            let svma = m.bias.to_svma(Avma(callee.wrapping_sub(1)));
            m.image.cfi.covers(svma.0)
        });
        trust.push(if by_cfi {
            Trust::Cfi
        } else {
            Trust::FramePointer
        });
    }
    false
}

/// True when `ip` is in an executable segment of `image`, just after a call
/// instruction (or at a signal-return trampoline).
pub fn is_return_address(ip: u64, image: Option<&MappedImage>) -> bool {
    code_at(ip, image)
        .is_some_and(|(code, at)| code[at..].starts_with(&SIGRETURN) || after_call(code, at))
}

/// True when `ip` is the start of a signal-return trampoline.
pub fn is_signal_return(ip: u64, image: Option<&MappedImage>) -> bool {
    code_at(ip, image).is_some_and(|(code, at)| code[at..].starts_with(&SIGRETURN))
}

fn in_code(ip: u64, image: Option<&MappedImage>) -> bool {
    code_at(ip, image).is_some()
}

/// The executable segment of `image` holding `ip`, and `ip`'s offset in it.
fn code_at(ip: u64, image: Option<&MappedImage>) -> Option<(&[u8], usize)> {
    let m = image?;
    let Svma(svma) = m.bias.to_svma(Avma(ip));
    let seg = m.image.code.iter().find(|s| s.svma.contains(&svma))?;
    Some((&seg.data, (svma - seg.svma.start) as usize))
}

/// True when some call instruction ends exactly at `code[at]` (x86-64
/// instructions are at most 15 bytes).
pub fn after_call(code: &[u8], at: usize) -> bool {
    (2..=15.min(at)).any(|len| {
        let bytes = &code[at - len..at];
        let mut decoder = Decoder::new(64, bytes, DecoderOptions::NONE);
        let insn = decoder.decode();
        !insn.is_invalid()
            && insn.len() == len
            && matches!(
                insn.flow_control(),
                FlowControl::Call | FlowControl::IndirectCall
            )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_return_addresses_from_other_bytes() {
        // nop; call rel32; nop; call *%rax; nop; call *0x10(%rip); ret
        let code = [
            0x90, 0xe8, 1, 2, 3, 4, 0x90, 0xff, 0xd0, 0x90, 0xff, 0x15, 0x10, 0, 0, 0, 0xc3,
        ];
        assert!(after_call(&code, 6));
        assert!(after_call(&code, 9));
        assert!(after_call(&code, 16));
        for at in [0, 1, 2, 5, 7, 8, 10, 17] {
            assert!(!after_call(&code, at), "{at}");
        }
        // The bytes of argv ("data.txt") are no call.
        assert!(!after_call(b"data.txt", 8));
    }
}
