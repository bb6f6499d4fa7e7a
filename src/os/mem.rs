//! Reading and writing the target's memory.
//!
//! Reads use process_vm_readv: one system call for any amount, no stop needed.
//! Writes to data (stack slots) use process_vm_writev; writes to code use
//! /proc/PID/mem, because process_vm_writev honours page protections and code
//! pages are read-only (`proc(5)`: /proc/PID/mem writes use FOLL_FORCE, as
//! ptrace does).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;

use super::ptrace::Tid;
use crate::memory::Memory;

const PAGE: u64 = 4096;

/// Most iovecs one read is split into (`UIO_MAXIOV` is 1024).
const MAX_IOV: usize = 64;

/// Read as much of `buf.len()` bytes at `addr` as is mapped, in one system call.
/// Returns the number of bytes read from the start of `buf`: a short count when
/// the range runs into unmapped memory (the top of a stack mapping, say).
///
/// process_vm_readv stops at the first iovec it cannot read completely
/// (`process_vm_readv(2)`, "partial transfers apply at the granularity of iovec
/// elements"), so the remote range is split at page boundaries: the pages that
/// are mapped are all read.
pub fn read(pid: Tid, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
    read_raw(pid, addr, buf.as_mut_ptr(), buf.len())
}

/// One process_vm_readv of `len` bytes at `addr` into `dest`, as one iovec.
fn read_one(pid: Tid, addr: u64, dest: *mut u8, len: usize) -> io::Result<usize> {
    let local = libc::iovec {
        iov_base: dest.cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: `local` covers `len` writable bytes at `dest` (callers pass a
    // buffer they own); the kernel checks the remote range.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// [`read`] into `len` bytes at `dest`, which the kernel only writes.
fn read_raw(pid: Tid, addr: u64, dest: *mut u8, len: usize) -> io::Result<usize> {
    if len == 0 {
        return Ok(0);
    }
    let mut remote = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; MAX_IOV];
    let mut count = 0;
    let mut at = addr;
    let end = addr.saturating_add(len as u64);
    while at < end && count < MAX_IOV {
        let page_end = (at / PAGE + 1) * PAGE;
        let chunk_end = if count == MAX_IOV - 1 {
            end
        } else {
            page_end.min(end)
        };
        remote[count] = libc::iovec {
            iov_base: at as *mut libc::c_void,
            iov_len: (chunk_end - at) as usize,
        };
        count += 1;
        at = chunk_end;
    }
    let local = libc::iovec {
        iov_base: dest.cast(),
        iov_len: (end - addr) as usize,
    };
    // SAFETY: `local` covers `len` writable bytes at `dest` (callers pass a
    // buffer they own); remote addresses are only read by the kernel, which
    // checks them.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, remote.as_ptr(), count as _, 0) };
    if n < 0 {
        let err = io::Error::last_os_error();
        // EFAULT on the very first page: nothing is mapped there.
        if err.raw_os_error() == Some(libc::EFAULT) {
            return Ok(0);
        }
        return Err(err);
    }
    Ok(n as usize)
}

/// Read `len` bytes at `addr`, which the caller knows to lie in one mapping
/// (a thread's stack, from /proc/PID/maps), into `out` (cleared first).
///
/// A stack copy is taken while the thread is stopped, and every microsecond
/// there counts: the bytes are read with one iovec (splitting 32 KiB at
/// pages, as [`read`] must for ranges it knows nothing about, costs a fifth
/// more, measured in docs/performance.md), into fresh capacity rather than a
/// zeroed buffer. Should the mapping have changed after all, it falls back to
/// [`read`]'s split, which reads what is mapped.
pub fn read_mapped_into(pid: Tid, addr: u64, len: usize, out: &mut Vec<u8>) -> io::Result<()> {
    out.clear();
    out.reserve_exact(len);
    let dest: *mut u8 = out.spare_capacity_mut().as_mut_ptr().cast();
    let n = match read_one(pid, addr, dest, len) {
        Ok(n) if n == len => n,
        _ => read_raw(pid, addr, dest, len)?,
    };
    // SAFETY: the capacity is at least `len`, and process_vm_readv wrote the
    // first `n <= len` bytes.
    unsafe { out.set_len(n) };
    Ok(())
}

/// The memory of a live process, read with process_vm_readv (no stop needed;
/// page protections apply).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessMemory(pub Tid);

impl Memory for ProcessMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
        read(self.0, addr, buf)
    }
}

/// A write into a traced process's memory that failed: where, and why.
/// It travels inside an `io::Error` of the same kind (see
/// [`WriteError::from_io`]), so that a caller far up can say what failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {len} bytes at {addr:#x} in process {pid}")]
pub struct WriteError {
    pub pid: Tid,
    pub addr: u64,
    pub len: usize,
    #[source]
    pub error: io::Error,
}

impl From<WriteError> for io::Error {
    fn from(err: WriteError) -> io::Error {
        io::Error::new(err.error.kind(), err)
    }
}

impl WriteError {
    fn of(pid: Tid, addr: u64, len: usize) -> impl FnOnce(io::Error) -> io::Error {
        move |error| {
            WriteError {
                pid,
                addr,
                len,
                error,
            }
            .into()
        }
    }

    /// The write error `err` carries, if it is one; otherwise `err`.
    pub fn from_io(err: io::Error) -> Result<WriteError, io::Error> {
        super::carried(err)
    }
}

/// Write to writable memory (a stack slot) in one system call.
pub fn write_data(pid: Tid, addr: u64, bytes: &[u8]) -> io::Result<()> {
    write_data_once(pid, addr, bytes).map_err(WriteError::of(pid, addr, bytes.len()))
}

fn write_data_once(pid: Tid, addr: u64, bytes: &[u8]) -> io::Result<()> {
    let local = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: `local` covers `bytes`, which the kernel only reads.
    let n = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != bytes.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("{addr:#x}: short write"),
        ));
    }
    Ok(())
}

/// /proc/PID/mem of a process, open for writing code (breakpoints, trampolines).
pub struct CodeWriter {
    file: File,
    pid: Tid,
}

impl CodeWriter {
    pub fn open(pid: Tid) -> io::Result<CodeWriter> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))?;
        Ok(CodeWriter { file, pid })
    }

    /// The process whose memory this is.
    pub fn pid(&self) -> Tid {
        self.pid
    }

    pub fn write(&self, addr: u64, bytes: &[u8]) -> io::Result<()> {
        self.file
            .write_all_at(bytes, addr)
            .map_err(WriteError::of(self.pid, addr, bytes.len()))
    }
}

/// Reads through /proc/PID/mem: code pages included, whatever their
/// protection.
impl Memory for CodeWriter {
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], addr + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(err) if err.raw_os_error() == Some(libc::EIO) && done > 0 => break,
                Err(err) if err.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Err(err) => return Err(err),
            }
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_into_a_fresh_buffer() {
        let me = std::process::id() as Tid;
        let data: Vec<u8> = (0..=255).collect();
        let mut out = vec![7u8; 3];
        read_mapped_into(me, data.as_ptr() as u64, data.len(), &mut out).unwrap();
        assert_eq!(out, data);
        read_mapped_into(me, data.as_ptr() as u64, 0, &mut out).unwrap();
        assert!(out.is_empty());
    }
}
