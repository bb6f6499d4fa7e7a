//! `.debug_frame` for unwinders that read only `.eh_frame`.
//!
//! Code built with `-fno-asynchronous-unwind-tables` has its CFI only in
//! `.debug_frame` (with `-g`), often beside an `.eh_frame` that covers the
//! C library's code. framehop reads `.debug_frame` only when an image has no
//! `.eh_frame` at all, and libunwind-ptrace never does; both read
//! `.eh_frame`. So the entries of `.debug_frame` are rewritten here into
//! `.eh_frame`'s format (DWARF "Call Frame Information" against the LSB's
//! `.eh_frame`): a CIE id of 0, a CIE pointer relative to itself, version 1,
//! augmentation `zR` with absolute 8-byte addresses (`DW_EH_PE_udata8`), so
//! that the result means the same wherever it is placed. The call frame
//! instructions are the same in both sections and are copied as they are.

/// `.debug_frame` in `.eh_frame`'s format, and where each FDE is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Converted {
    pub data: Vec<u8>,
    /// `(first SVMA, offset of the FDE in data)`, sorted.
    pub fdes: Vec<(u64, u32)>,
}

const DW_EH_PE_UDATA8: u8 = 0x04;

struct Cie<'a> {
    code_align: &'a [u8],
    data_align: &'a [u8],
    ra: u8,
    instructions: &'a [u8],
}

/// Rewrite `.debug_frame` (32-bit DWARF, 8-byte addresses), adding `bias`
/// to every code address (0 for SVMAs; a load bias for runtime addresses).
/// Entries it cannot read (64-bit DWARF, a CIE augmentation) are left out.
pub fn to_eh_frame(debug_frame: &[u8], bias: u64) -> Converted {
    let mut out = Converted::default();
    let mut cies: Vec<(usize, Option<usize>)> = Vec::new();
    let mut at = 0;
    while at + 8 <= debug_frame.len() {
        let len = u32::from_le_bytes(debug_frame[at..at + 4].try_into().unwrap_or_default());
        if len == 0xffff_ffff {
            break;
        }
        let end = at + 4 + len as usize;
        let Some(body) = debug_frame.get(at + 4..end) else {
            break;
        };
        if len >= 4 {
            let id = u32::from_le_bytes(body[..4].try_into().unwrap_or_default());
            if id == 0xffff_ffff {
                let written = parse_cie(&body[4..]).map(|cie| write_cie(&mut out.data, &cie));
                cies.push((at, written));
            } else if let Some(&(_, Some(cie_at))) = cies.iter().find(|(o, _)| *o == id as usize) {
                if let Some(fde) = write_fde(&mut out.data, cie_at, &body[4..], bias) {
                    out.fdes.push(fde);
                }
            }
        }
        at = end;
    }
    out.fdes.sort_unstable();
    out
}

fn leb(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let n = data.iter().position(|b| b & 0x80 == 0)? + 1;
    Some(data.split_at(n))
}

fn parse_cie(body: &[u8]) -> Option<Cie<'_>> {
    let version = *body.first()?;
    let rest = &body[1..];
    let aug_end = rest.iter().position(|&b| b == 0)?;
    if aug_end != 0 {
        return None;
    }
    let mut rest = &rest[1..];
    if version >= 4 {
        // address_size, segment_selector_size
        if rest.get(..2)? != [8, 0] {
            return None;
        }
        rest = &rest[2..];
    }
    let (code_align, rest) = leb(rest)?;
    let (data_align, rest) = leb(rest)?;
    let (ra, rest) = if version == 1 {
        (*rest.first()?, &rest[1..])
    } else {
        let (ra, rest) = leb(rest)?;
        (if ra.len() == 1 { ra[0] } else { return None }, rest)
    };
    Some(Cie {
        code_align,
        data_align,
        ra,
        instructions: rest,
    })
}

/// Pad an entry that started at `start` with DW_CFA_nop to a multiple of 8
/// and write its length.
fn finish(out: &mut Vec<u8>, start: usize) {
    while (out.len() - start) % 8 != 0 {
        out.push(0);
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

fn write_cie(out: &mut Vec<u8>, cie: &Cie) -> usize {
    let start = out.len();
    out.extend([0; 4]); // length
    out.extend([0; 4]); // CIE id
    out.push(1); // version
    out.extend(b"zR\0");
    out.extend(cie.code_align);
    out.extend(cie.data_align);
    out.push(cie.ra);
    out.push(1); // augmentation data length
    out.push(DW_EH_PE_UDATA8);
    out.extend(cie.instructions);
    finish(out, start);
    start
}

fn write_fde(out: &mut Vec<u8>, cie_at: usize, body: &[u8], bias: u64) -> Option<(u64, u32)> {
    let svma = u64::from_le_bytes(body.get(..8)?.try_into().ok()?);
    let pc = svma.wrapping_add(bias);
    let range = u64::from_le_bytes(body.get(8..16)?.try_into().ok()?);
    if svma == 0 || range == 0 {
        return None;
    }
    let start = out.len();
    out.extend([0; 4]);
    // The CIE pointer: the distance from this field back to the CIE.
    let pointer = (start + 4 - cie_at) as u32;
    out.extend(pointer.to_le_bytes());
    out.extend(pc.to_le_bytes());
    out.extend(range.to_le_bytes());
    out.push(0); // augmentation data length
    out.extend(&body[16..]);
    finish(out, start);
    Some((pc, start as u32))
}

/// The end of the entries of an `.eh_frame` (its zero terminator, if any),
/// so that more can be appended.
pub fn eh_frame_end(eh_frame: &[u8]) -> usize {
    let mut at = 0;
    while at + 4 <= eh_frame.len() {
        let len = u32::from_le_bytes(eh_frame[at..at + 4].try_into().unwrap_or_default());
        let next = match len {
            0 => return at,
            0xffff_ffff => {
                let Some(long) = eh_frame.get(at + 4..at + 12) else {
                    return at;
                };
                (at + 12).saturating_add(u64::from_le_bytes(long.try_into().unwrap_or_default()) as usize)
            }
            n => at + 4 + n as usize,
        };
        if next > eh_frame.len() {
            return at;
        }
        at = next;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;
    use gimli::{BaseAddresses, EhFrame, LittleEndian, UnwindContext, UnwindSection};

    /// A `.debug_frame` as gcc writes it (version 1 CIE: CFA = rsp+8, RA at
    /// CFA-8; an FDE for 0x401000..0x401010 that pushes one register).
    fn debug_frame() -> Vec<u8> {
        let mut d = Vec::new();
        // CIE
        let cie: Vec<u8> = [
            &0xffff_ffffu32.to_le_bytes()[..],
            &[1, 0, 1, 0x78, 16],
            &[0x0c, 7, 8, 0x90, 1], // def_cfa rsp+8; offset r16 at cfa-8
            &[0, 0, 0],
        ]
        .concat();
        d.extend((cie.len() as u32).to_le_bytes());
        d.extend(&cie);
        let fde: Vec<u8> = [
            &0u32.to_le_bytes()[..],
            &0x401000u64.to_le_bytes(),
            &0x10u64.to_le_bytes(),
            &[0x41, 0x0e, 16], // advance 1; def_cfa_offset 16
            &[0, 0, 0, 0, 0],
        ]
        .concat();
        d.extend((fde.len() as u32).to_le_bytes());
        d.extend(&fde);
        d
    }

    #[test]
    fn rewrites_debug_frame_as_eh_frame() {
        let c = to_eh_frame(&debug_frame(), 0);
        assert_eq!(c.fdes.len(), 1);
        assert_eq!(c.fdes[0].0, 0x401000);
        // gimli reads it as .eh_frame placed anywhere, with the same rules.
        let eh = EhFrame::new(&c.data, LittleEndian);
        let bases = BaseAddresses::default().set_eh_frame(0x7000_0000);
        let mut ctx = UnwindContext::new();
        let row = eh
            .unwind_info_for_address(&bases, &mut ctx, 0x401004, EhFrame::cie_from_offset)
            .unwrap();
        assert_eq!(
            *row.cfa(),
            gimli::CfaRule::RegisterAndOffset {
                register: gimli::X86_64::RSP,
                offset: 16
            }
        );
        assert!(
            eh.unwind_info_for_address(&bases, &mut ctx, 0x401010, EhFrame::cie_from_offset)
                .is_err()
        );
    }

    #[test]
    fn finds_the_end_of_an_eh_frame() {
        let c = to_eh_frame(&debug_frame(), 0);
        let mut with_terminator = c.data.clone();
        with_terminator.extend([0; 4]);
        assert_eq!(eh_frame_end(&with_terminator), c.data.len());
        assert_eq!(eh_frame_end(&c.data), c.data.len());
        assert_eq!(to_eh_frame(b"garbage", 0), Converted::default());
    }
}
