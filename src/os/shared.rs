//! Memory shared with a target, and the one system call that crosses it.
//!
//! The target creates a memfd (a `memfd_create` memptrace injects) and maps
//! it `MAP_SHARED`; memptrace takes a duplicate of that descriptor with
//! `pidfd_getfd(2)` (the ptrace access check a tracer passes anyway: no
//! CAP_SYS_ADMIN, unlike /proc/PID/map_files) or, on a kernel without it,
//! by opening `/proc/PID/fd/N`, and maps it too. From then on the target
//! writes and memptrace reads, or the other way round, with no system call
//! on either side; a thread of the target that waits for memptrace sleeps
//! on a futex in the shared memory, which memptrace wakes.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::ptrace::Tid;

/// A duplicate of file descriptor `fd` of process `pid`.
pub fn take_fd(pid: Tid, fd: i32) -> io::Result<OwnedFd> {
    match pidfd_getfd(pid, fd) {
        Ok(owned) => Ok(owned),
        Err(_) => {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(format!("/proc/{pid}/fd/{fd}"))?;
            Ok(OwnedFd::from(file))
        }
    }
}

fn pidfd_getfd(pid: Tid, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain system calls with integer arguments; each returned
    // descriptor is owned here from the moment it exists.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        if pidfd < 0 {
            return Err(io::Error::last_os_error());
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd as i32);
        let got = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(got as i32))
    }
}

/// `len` bytes of a shared memory file, mapped read-write here.
pub struct SharedMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; every access
// goes through the bounds-checked methods below, with atomic loads and
// stores where the target writes concurrently.
unsafe impl Send for SharedMemory {}
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    pub fn map(fd: &OwnedFd, len: usize) -> io::Result<SharedMemory> {
        // SAFETY: a new private anonymous range placed by the kernel, its
        // first page kept private (see `private_page`), the rest replaced
        // by a shared mapping of an open file; both unmapped in Drop, never
        // handed out as slices.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                len + PRIVATE_PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let ptr = libc::mmap(
                base.cast::<u8>().add(PRIVATE_PAGE).cast(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            );
            if ptr == libc::MAP_FAILED {
                let err = io::Error::last_os_error();
                libc::munmap(base, len + PRIVATE_PAGE);
                return Err(err);
            }
            Ok(SharedMemory {
                ptr: ptr.cast(),
                len,
            })
        }
    }

    /// The page of memptrace's own memory just before the mapping, which
    /// the target cannot write: where the kernel's list of robust futexes
    /// finds its entry for a word of the mapping (see `sentinel`).
    pub(super) fn private_page(&self) -> *mut u8 {
        self.ptr.wrapping_sub(PRIVATE_PAGE)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn word(&self, offset: u64) -> &AtomicU64 {
        let offset = offset as usize;
        assert!(offset % 8 == 0 && offset + 8 <= self.len, "{offset:#x}");
        // SAFETY: in bounds and aligned (checked); AtomicU64 has the layout
        // of u64, and the other side writes the word with one store.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU64) }
    }

    /// The 4-byte word at `offset` (a futex word: see `sentinel`).
    pub fn word32(&self, offset: u64) -> &AtomicU32 {
        let offset = offset as usize;
        assert!(offset % 4 == 0 && offset + 4 <= self.len, "{offset:#x}");
        // SAFETY: in bounds and aligned (checked); AtomicU32 has the layout
        // of u32.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU32) }
    }

    /// The word at `offset`, with everything the writer stored before it.
    pub fn load(&self, offset: u64) -> u64 {
        self.word(offset).load(Ordering::Acquire)
    }

    /// Store a word at `offset`, after everything stored before it.
    pub fn store(&self, offset: u64, value: u64) {
        self.word(offset).store(value, Ordering::Release)
    }

    /// Add to the word at `offset` (as the target's `lock xadd` does);
    /// returns the value before.
    pub fn fetch_add(&self, offset: u64, value: u64) -> u64 {
        self.word(offset).fetch_add(value, Ordering::AcqRel)
    }

    /// Copy `bytes` in at `offset` (memory the target is not using yet).
    pub fn write(&self, offset: u64, bytes: &[u8]) {
        let offset = offset as usize;
        assert!(offset + bytes.len() <= self.len);
        // SAFETY: in bounds (checked); plain bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len()) }
    }

    /// Copy out `buf.len()` bytes at `offset` (memory the target finished
    /// writing: a committed record).
    pub fn read(&self, offset: u64, buf: &mut [u8]) {
        let offset = offset as usize;
        assert!(offset + buf.len() <= self.len);
        // SAFETY: in bounds (checked); plain bytes no one writes now.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), buf.as_mut_ptr(), buf.len()) }
    }

    /// Copy out `out.len()` words at `offset` (memory the target finished
    /// writing; x86-64 is little-endian, as the words are).
    pub fn read_words(&self, offset: u64, out: &mut [u64]) {
        let offset = offset as usize;
        assert!(offset % 8 == 0 && offset + 8 * out.len() <= self.len);
        // SAFETY: in bounds and aligned (checked); plain words.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(offset) as *const u64,
                out.as_mut_ptr(),
                out.len(),
            )
        }
    }

    /// Append `len` bytes at `offset` to `out` (memory the target finished
    /// writing).
    pub fn copy_out(&self, offset: u64, len: usize, out: &mut Vec<u8>) {
        let offset = offset as usize;
        assert!(offset + len <= self.len);
        out.reserve(len);
        // SAFETY: in bounds (checked); `out` has `len` bytes of spare
        // capacity, all written before the length grows.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(offset),
                out.as_mut_ptr().add(out.len()),
                len,
            );
            out.set_len(out.len() + len);
        }
    }

    /// Wake the target's threads waiting on the 32-bit futex word at
    /// `offset` (`futex(2)`, FUTEX_WAKE, not private: the word is shared).
    pub fn wake(&self, offset: u64) {
        let word = self.word(offset);
        // SAFETY: FUTEX_WAKE on an address of our mapping; no memory is
        // read or written by the call beyond the futex word's key.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word as *const AtomicU64,
                libc::FUTEX_WAKE,
                i32::MAX,
                0,
                0,
                0,
            );
        }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: our own mappings: the private page and `len` bytes after
        // it, no longer used.
        unsafe {
            libc::munmap(self.private_page().cast(), self.len + PRIVATE_PAGE);
        }
    }
}

/// Bytes of private memory before each shared mapping.
pub const PRIVATE_PAGE: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_a_memfd_of_our_own_twice() {
        // SAFETY: memfd_create with a valid name; the descriptor is owned.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: just created, owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate of our own descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 8192) }, 0);
        let again = take_fd(std::process::id() as Tid, fd.as_raw_fd()).unwrap();
        let a = SharedMemory::map(&fd, 8192).unwrap();
        let b = SharedMemory::map(&again, 8192).unwrap();
        a.store(4096, 42);
        assert_eq!(b.load(4096), 42);
        assert_eq!(b.fetch_add(4096, 1), 42);
        assert_eq!(a.load(4096), 43);
        b.write(16, b"memptrace");
        let mut buf = [0u8; 9];
        a.read(16, &mut buf);
        assert_eq!(&buf, b"memptrace");
        a.wake(4096);
    }
}
