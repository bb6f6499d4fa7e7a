//! Reading a target's memory through one small trait, so that the logic
//! that reads it (which call instruction precedes a return address, where a
//! thread inside a trampoline belongs, which `pop` + `ret` pair to return
//! through) is tested on byte buffers, without a live process. The live
//! implementations are in `os::mem` (process_vm_readv, and
//! /proc/PID/mem for code); [`Snapshot`] holds bytes at addresses.

use std::collections::BTreeMap;
use std::io;

/// Read access to an address space.
pub trait Memory {
    /// Read as much of `buf` as is mapped at `addr`, from its start: the
    /// number of bytes read (short when the range runs into unmapped memory).
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<usize>;

    /// Read exactly `buf.len()` bytes or fail.
    fn read_exact(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        let n = self.read(addr, buf)?;
        if n == buf.len() {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{addr:#x}: only {n} of {} bytes are mapped", buf.len()),
            ))
        }
    }

    /// The little-endian word at `addr`.
    fn read_u64(&self, addr: u64) -> io::Result<u64> {
        let mut word = [0u8; 8];
        self.read_exact(addr, &mut word)?;
        Ok(u64::from_le_bytes(word))
    }
}

/// Bytes at addresses: regions that do not overlap; anything else reads as
/// unmapped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    regions: BTreeMap<u64, Vec<u8>>,
}

impl Snapshot {
    pub fn new() -> Snapshot {
        Snapshot::default()
    }

    /// Add `bytes` at `addr`.
    pub fn with(mut self, addr: u64, bytes: &[u8]) -> Snapshot {
        self.regions.insert(addr, bytes.to_vec());
        self
    }

    /// Add `bytes` at `addr`, taking them as they are (no copy).
    pub fn with_owned(mut self, addr: u64, bytes: Vec<u8>) -> Snapshot {
        self.regions.insert(addr, bytes);
        self
    }

    /// Add every region of `other`.
    pub fn merge(&mut self, other: Snapshot) {
        self.regions.extend(other.regions);
    }
}

impl Memory for Snapshot {
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            let at = addr + done as u64;
            let Some((&start, bytes)) = self.regions.range(..=at).next_back() else {
                break;
            };
            let offset = (at - start) as usize;
            if offset >= bytes.len() {
                break;
            }
            let n = (bytes.len() - offset).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&bytes[offset..offset + n]);
            done += n;
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_across_adjacent_regions_and_stops_at_a_hole() {
        let mem = Snapshot::new()
            .with(0x1000, &[1, 2, 3, 4])
            .with(0x1004, &[5, 6])
            .with(0x2000, &[9; 8]);
        let mut buf = [0u8; 8];
        assert_eq!(mem.read(0x1002, &mut buf).unwrap(), 4);
        assert_eq!(&buf[..4], &[3, 4, 5, 6]);
        assert!(mem.read_exact(0x1002, &mut buf).is_err());
        assert_eq!(mem.read_u64(0x2000).unwrap(), 0x0909_0909_0909_0909);
        assert_eq!(mem.read(0x0fff, &mut buf).unwrap(), 0);
    }
}
