//! Signal frames: a stack that goes on through a signal handler into the
//! code the signal interrupted.
//!
//! A handler "returns" to the C library's signal-return trampoline
//! (`__restore_rt`, glibc's and musl's `sa_restorer`: `mov $15, %rax;
//! syscall`, that is rt_sigreturn). The kernel put the interrupted code's
//! registers just above that return address (`struct rt_sigframe`:
//! the return address, then a `struct ucontext` whose `uc_mcontext` holds
//! them). So the frame after the trampoline is not found by a rule of the
//! handler's code but read from that context, as gdb and libunwind do:
//! they, too, know the trampoline by its bytes (the CFI glibc gives it is a
//! DWARF expression that framehop and the probes' tables cannot follow,
//! and musl's static library may have none).
//!
//! The interrupted frame's address is exact, not a return address: it is
//! stored as that address + 1, so that every frame, this one included, is
//! named and looked up by `ip - 1` (the convention of return addresses);
//! `stacks.trust` says `signal` for it.

use crate::symbols::elf::ElfImage;

/// `mov $15, %rax; syscall`: rt_sigreturn, where a signal handler returns to.
pub const SIGRETURN: [u8; 9] = [0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05];

/// Where the interrupted registers are, in bytes above the handler's CFA
/// (the address just above its return address: the `struct ucontext`):
/// `uc_mcontext` is 40 bytes into it (`uc_flags`, `uc_link`, `uc_stack`),
/// and rbp, rsp and rip are its 11th, 16th and 17th words (`struct
/// sigcontext`, arch/x86/include/uapi/asm/sigcontext.h).
pub const RBP: u64 = 40 + 10 * 8;
pub const RSP: u64 = 40 + 15 * 8;
pub const RIP: u64 = 40 + 16 * 8;

/// The interrupted code's frame, read from the context above `cfa`, the
/// handler's CFA: `(ip + 1, sp, bp)`. None when a word cannot be read, the
/// address is 0, or the stack pointer is not above the context (a walk
/// must go up the stack; a handler on an alternate stack (sigaltstack)
/// interrupted code on another one, which the walk does not follow).
pub fn interrupted(cfa: u64, read: impl Fn(u64) -> Option<u64>) -> Option<(u64, u64, u64)> {
    let ip = read(cfa.checked_add(RIP)?)?;
    let sp = read(cfa.checked_add(RSP)?)?;
    let bp = read(cfa.checked_add(RBP)?)?;
    if ip == 0 || sp < cfa.checked_add(RIP + 8)? {
        return None;
    }
    Some((ip.checked_add(1)?, sp, bp))
}

/// The SVMAs of the signal-return trampolines in `image`'s code.
pub fn trampolines(image: &ElfImage) -> Vec<u64> {
    let finder = memchr::memmem::Finder::new(&SIGRETURN);
    let mut out = Vec::new();
    for seg in &image.code {
        out.extend(
            finder
                .find_iter(&seg.data)
                .map(|at| seg.svma.start + at as u64),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_glibc_restore_rt() {
        let path = "/lib/x86_64-linux-gnu/libc.so.6";
        let bytes = std::fs::read(path).unwrap();
        let image = ElfImage::parse(path, &bytes).unwrap();
        let found = trampolines(&image);
        assert_eq!(found.len(), 1, "{found:x?}");
        // Its CFI starts a byte before it (padding), where a return
        // address into it is looked up.
        assert!(image.cfi.covers(found[0] - 1));
    }

    #[test]
    fn reads_the_interrupted_frame_above_the_handler() {
        let cfa = 0x7000_0000u64;
        let words = |addr: u64| match addr - cfa {
            RIP => Some(0x40_1234),
            RSP => Some(cfa + 0x800),
            RBP => Some(cfa + 0x900),
            _ => None,
        };
        assert_eq!(
            interrupted(cfa, words),
            Some((0x40_1235, cfa + 0x800, cfa + 0x900))
        );
        // A stack pointer below the context, or address 0: no frame.
        let low = |addr: u64| {
            if addr - cfa == RSP {
                Some(cfa)
            } else {
                words(addr)
            }
        };
        assert_eq!(interrupted(cfa, low), None);
        let zero = |addr: u64| {
            if addr - cfa == RIP {
                Some(0)
            } else {
                words(addr)
            }
        };
        assert_eq!(interrupted(cfa, zero), None);
    }
}
