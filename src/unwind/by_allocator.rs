//! Which allocator call a mapping call (mmap, munmap, brk...) was made in,
//! if any: the `by_allocator` of a `maps` row. Found in the call's stack, by
//! a frame inside an allocator function or just after a call of one, or,
//! where the stack ends early (an allocator without unwind tables: musl),
//! by the return addresses left in the stack copy. Reads only the images'
//! own bytes, never the target.

use super::{MappedImage, StackSample};
use crate::addr::Avma;
use crate::event::Op;
use crate::symbols::callsite::{CallTarget, call_before, jump_target, plt_slot};

/// Return addresses to try, at most, when looking for an allocator call in
/// a stack copy word by word.
const SCAN: usize = 256;

/// The allocator call a stack copy shows a return address of: the
/// outermost word that is a return address (into an image's code, just
/// after a call) whose call instruction is inside an allocator function or
/// calls one, as [`allocator_frame`] tells of a walked frame. Not a stack:
/// only the fact that the thread was inside that call.
pub fn allocator_call_in_copy<'a>(
    sample: &StackSample,
    image_at: &impl Fn(u64) -> Option<&'a MappedImage>,
) -> Option<Op> {
    sample
        .bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .filter(|&word| super::vet::is_return_address(word, image_at(word)))
        .take(SCAN)
        .filter_map(|word| allocator_frame(word, image_at))
        .last()
}

/// True when the last of the return addresses `ips` is in code that CFI
/// describes: a walk that stops there is at the outermost frame.
pub fn ends_in_cfi<'a>(ips: &[u64], image_at: impl Fn(u64) -> Option<&'a MappedImage>) -> bool {
    ips.last().is_some_and(|&ip| {
        image_at(ip).is_some_and(|m| {
            let svma = m.bias.to_svma(Avma(ip.wrapping_sub(1)));
            m.image.cfi.covers(svma.0)
        })
    })
}

/// The allocator function that return address `ip` is inside of (its
/// call instruction is), or that the call instruction before it calls.
pub fn allocator_frame<'a>(
    ip: u64,
    image_at: &impl Fn(u64) -> Option<&'a MappedImage>,
) -> Option<Op> {
    let image = image_at(ip)?;
    image
        .image
        .allocator_containing(image.bias.to_svma(Avma(ip - 1)))
        .or_else(|| allocator_called_before(ip, image_at))
}

/// The allocator function (malloc, free, ...) that the call instruction
/// before return address `ip` calls, directly, through a jump (musl's
/// `malloc`, when a stripped binary's allocator is hooked at the body it
/// jumps to), or through a PLT stub or a GOT slot: a mapping call whose
/// stack has such a frame was made inside that allocator call, by the
/// allocator.
fn allocator_called_before<'a>(
    ip: u64,
    image_at: &impl Fn(u64) -> Option<&'a MappedImage>,
) -> Option<Op> {
    let image = image_at(ip)?;
    let svma = image.bias.to_svma(Avma(ip)).0;
    let before: [u8; 6] = image
        .image
        .code_at(svma.checked_sub(6)?, 6)?
        .try_into()
        .ok()?;
    let slot = match call_before(&before, ip)? {
        CallTarget::Direct(target) => {
            let callee = image_at(target)?;
            let at = callee.bias.to_svma(Avma(target));
            let entry_at = |at| {
                let mut entries = callee.image.allocators.iter();
                entries.find(|a| a.svma == at).map(|a| a.default_op())
            };
            if let Some(op) = entry_at(at) {
                return Some(op);
            }
            let jump = (callee
                .image
                .code_at(at.0, 9)
                .or_else(|| callee.image.code_at(at.0, 5)))
            .and_then(|code| jump_target(code, target));
            if let Some(next) = jump.filter(|&next| callee.range.contains(&next)) {
                if let Some(op) = entry_at(callee.bias.to_svma(Avma(next))) {
                    return Some(op);
                }
            }
            if !callee.image.in_plt(at) {
                return None;
            }
            plt_slot(callee.image.code_at(at.0, 16)?, target)?
        }
        CallTarget::Slot(slot) => slot,
    };
    let owner = image_at(slot)?;
    owner
        .image
        .got_slots
        .get(&owner.bias.to_svma(Avma(slot)).0)
        .copied()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::addr::{LoadBias, Svma};
    use crate::symbols::elf::ElfImage;

    /// The C library these tests run on, as if loaded at `BIAS`.
    fn libc() -> MappedImage {
        const BIAS: LoadBias = LoadBias(0x7f00_0000_0000);
        let path = "/lib/x86_64-linux-gnu/libc.so.6";
        let image = ElfImage::parse(path, &std::fs::read(path).unwrap()).unwrap();
        MappedImage {
            module_id: 1,
            range: image.avma_range(BIAS),
            image: Arc::new(image),
            bias: BIAS,
            is_main: false,
        }
    }

    #[test]
    fn a_frame_inside_an_allocator_function_is_that_call() {
        let libc = libc();
        let image_at = |ip: u64| libc.range.contains(&ip).then_some(&libc);
        let malloc = libc
            .image
            .allocators
            .iter()
            .find(|a| a.ops.contains(&Op::Malloc))
            .expect("libc has malloc");
        assert!(malloc.size > 16);
        // A return address 16 bytes into malloc: a call malloc made.
        let inside = libc.bias.to_avma(Svma(malloc.svma.0 + 16)).0;
        assert_eq!(allocator_frame(inside, &image_at), Some(Op::Malloc));
        // Outside every image: nothing.
        assert_eq!(allocator_frame(0x1000, &image_at), None);
        // Words that are no return address say nothing, whatever they hold.
        let words = [0u64, 0x1000, u64::MAX, libc.range.start, inside - 16];
        let sample = StackSample {
            bytes: words.iter().flat_map(|w| w.to_le_bytes()).collect(),
            ..StackSample::default()
        };
        assert_eq!(allocator_call_in_copy(&sample, &image_at), None);
        assert_eq!(
            allocator_call_in_copy(&StackSample::default(), &image_at),
            None
        );
    }
}
