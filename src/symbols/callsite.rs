//! Where a call went, from its instruction: a direct call names its target;
//! a call through the PLT (`call stub`, the stub jumping through a GOT slot)
//! or through the GOT (`call [rip+slot]`, -fno-plt) names its slot, and the
//! caller's relocation for that slot names the symbol. This tells which of
//! several names sharing an address the caller used (glibc's `aligned_alloc`
//! and `memalign` are one function), and which allocator call a mapping
//! call was made in.

/// Where the call that returns to an address went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallTarget {
    /// `call rel32`: to this address (a function, or a PLT stub).
    Direct(u64),
    /// `call [rip+disp32]`: through the GOT slot at this address.
    Slot(u64),
}

/// Decode the call instruction that ends at `ret`, given the 6 bytes before it.
pub fn call_before(before: &[u8; 6], ret: u64) -> Option<CallTarget> {
    if before[0] == 0xff && before[1] == 0x15 {
        let disp = i32::from_le_bytes(before[2..6].try_into().ok()?);
        return Some(CallTarget::Slot(ret.wrapping_add_signed(disp.into())));
    }
    if before[1] == 0xe8 {
        let disp = i32::from_le_bytes(before[2..6].try_into().ok()?);
        return Some(CallTarget::Direct(ret.wrapping_add_signed(disp.into())));
    }
    None
}

/// The GOT slot a PLT stub at `addr` jumps through, from its first bytes:
/// `jmp [rip+d]`, optionally after `endbr64` and/or with a `bnd` prefix
/// (the .plt.sec entries of IBT-enabled binaries).
pub fn plt_slot(stub: &[u8], addr: u64) -> Option<u64> {
    const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
    let mut at = 0;
    if stub.starts_with(&ENDBR64) {
        at += 4;
    }
    if stub.get(at) == Some(&0xf2) {
        at += 1; // bnd
    }
    if stub.get(at..at + 2) != Some(&[0xff, 0x25]) {
        return None;
    }
    let disp = i32::from_le_bytes(stub.get(at + 2..at + 6)?.try_into().ok()?);
    let next = addr + at as u64 + 6;
    Some(next.wrapping_add_signed(disp.into()))
}

/// Where a function at `addr` that is nothing but a jump (`[endbr64] jmp
/// rel32`, from its first bytes `code`) goes: musl's `malloc` is a jump to
/// `__libc_malloc_impl`, so a call of it is a call of that.
pub fn jump_target(code: &[u8], addr: u64) -> Option<u64> {
    const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
    let at = if code.starts_with(&ENDBR64) { 4 } else { 0 };
    if code.get(at) != Some(&0xe9) {
        return None;
    }
    let disp = i32::from_le_bytes(code.get(at + 1..at + 5)?.try_into().ok()?);
    let next = addr.checked_add(at as u64 + 5)?;
    Some(next.wrapping_add_signed(disp.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_calls() {
        // call rel32 with displacement -0x100, returning to 0x2000.
        let before = [0x90, 0xe8, 0x00, 0xff, 0xff, 0xff];
        assert_eq!(
            call_before(&before, 0x2000),
            Some(CallTarget::Direct(0x1f00))
        );
        // call [rip+0x30] returning to 0x2000.
        let before = [0xff, 0x15, 0x30, 0x00, 0x00, 0x00];
        assert_eq!(call_before(&before, 0x2000), Some(CallTarget::Slot(0x2030)));
        assert_eq!(call_before(&[0x90; 6], 0x2000), None);
    }

    #[test]
    fn decodes_plt_stubs() {
        // jmp [rip+0x2fe2] at 0x1030 -> slot 0x1030 + 6 + 0x2fe2.
        let plain = [0xff, 0x25, 0xe2, 0x2f, 0x00, 0x00, 0x68, 0x00];
        assert_eq!(plt_slot(&plain, 0x1030), Some(0x4018));
        // endbr64; bnd jmp [rip+0x2fe2] (.plt.sec).
        let ibt = [
            0xf3, 0x0f, 0x1e, 0xfa, 0xf2, 0xff, 0x25, 0xe2, 0x2f, 0x00, 0x00,
        ];
        assert_eq!(plt_slot(&ibt, 0x1030), Some(0x1030 + 11 + 0x2fe2));
        assert_eq!(plt_slot(&[0x90; 8], 0x1030), None);
    }

    #[test]
    fn decodes_jump_wrappers() {
        // jmp rel32 -0x30 at 0x1000 -> 0x1005 - 0x30.
        let jmp = [0xe9, 0xd0, 0xff, 0xff, 0xff];
        assert_eq!(jump_target(&jmp, 0x1000), Some(0xfd5));
        let ibt = [0xf3, 0x0f, 0x1e, 0xfa, 0xe9, 0x10, 0x00, 0x00, 0x00];
        assert_eq!(jump_target(&ibt, 0x1000), Some(0x1019));
        assert_eq!(jump_target(&[0xe9, 0x00], 0x1000), None);
        assert_eq!(jump_target(&[0x55; 5], 0x1000), None);
    }
}
