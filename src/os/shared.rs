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
    let pidfd = super::pidfd::Pidfd::open(pid)?;
    // SAFETY: a plain system call with integer arguments; the returned
    // descriptor is owned here from the moment it exists.
    unsafe {
        let got = libc::syscall(libc::SYS_pidfd_getfd, pidfd.fd(), fd, 0);
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

    /// The word at `offset`: `None` when it is not an aligned word of the
    /// mapping (an offset is never trusted to be one).
    fn word(&self, offset: u64) -> Option<&AtomicU64> {
        let offset = usize::try_from(offset).ok()?;
        if offset % 8 != 0 || offset.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: in bounds and aligned (checked); AtomicU64 has the layout
        // of u64, and the other side writes the word with one store.
        Some(unsafe { &*(self.ptr.add(offset) as *const AtomicU64) })
    }

    /// The 4-byte word at `offset` (a futex word: see `sentinel`), at an
    /// offset memptrace chose (a layout constant, never a value read from
    /// the target).
    pub fn word32(&self, offset: u64) -> &AtomicU32 {
        let offset = offset as usize;
        assert!(offset % 4 == 0 && offset + 4 <= self.len, "{offset:#x}");
        // SAFETY: in bounds and aligned (checked); AtomicU32 has the layout
        // of u32.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU32) }
    }

    /// The byte range `offset..offset + len` if it lies in the mapping.
    fn range(&self, offset: u64, len: usize) -> Option<usize> {
        let offset = usize::try_from(offset).ok()?;
        (offset.checked_add(len)? <= self.len).then_some(offset)
    }

    /// The word at `offset`, with everything the writer stored before it;
    /// 0 for an offset that is not an aligned word of the mapping.
    pub fn load(&self, offset: u64) -> u64 {
        self.word(offset).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Store a word at `offset`, after everything stored before it (nothing
    /// for an offset that is not an aligned word of the mapping).
    pub fn store(&self, offset: u64, value: u64) {
        if let Some(w) = self.word(offset) {
            w.store(value, Ordering::Release)
        }
    }

    /// Add to the word at `offset` (as the target's `lock xadd` does);
    /// returns the value before (0, adding nothing, for a bad offset).
    pub fn fetch_add(&self, offset: u64, value: u64) -> u64 {
        self.word(offset)
            .map_or(0, |w| w.fetch_add(value, Ordering::AcqRel))
    }

    /// Copy `bytes` in at `offset` (memory the target is not using yet);
    /// false, writing nothing, when they do not fit the mapping.
    pub fn write(&self, offset: u64, bytes: &[u8]) -> bool {
        let Some(offset) = self.range(offset, bytes.len()) else {
            return false;
        };
        // SAFETY: in bounds (checked); plain bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len()) }
        true
    }

    /// Copy out `buf.len()` bytes at `offset` (memory the target finished
    /// writing: a committed record); false, copying nothing, when they are
    /// not all in the mapping.
    #[must_use]
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> bool {
        let Some(offset) = self.range(offset, buf.len()) else {
            return false;
        };
        // SAFETY: in bounds (checked); plain bytes, copied as they are even
        // if the target writes them meanwhile (they are checked after).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), buf.as_mut_ptr(), buf.len()) }
        true
    }

    /// Copy out `out.len()` little-endian words at `offset`, aligned or not
    /// (memory the target finished writing); false, copying nothing, when
    /// they are not all in the mapping.
    #[must_use]
    pub fn read_words(&self, offset: u64, out: &mut [u64]) -> bool {
        let Some(len) = out.len().checked_mul(8) else {
            return false;
        };
        let Some(offset) = self.range(offset, len) else {
            return false;
        };
        // SAFETY: in bounds (checked); copied byte by byte into `out`'s
        // `len` bytes, so no alignment is needed on either side; x86-64 is
        // little-endian, as the words are.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr().cast::<u8>(), len)
        }
        true
    }

    /// Append `len` bytes at `offset` to `out` (memory the target finished
    /// writing); false, appending nothing, when they are not all in the
    /// mapping.
    pub fn copy_out(&self, offset: u64, len: usize, out: &mut Vec<u8>) -> bool {
        let Some(offset) = self.range(offset, len) else {
            return false;
        };
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
        true
    }

    /// Wake the target's threads waiting on the 32-bit futex word at
    /// `offset` (`futex(2)`, FUTEX_WAKE, not private: the word is shared).
    pub fn wake(&self, offset: u64) {
        let Some(word) = self.word(offset) else {
            return;
        };
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

/// For unit tests above os/: a memfd of memptrace's own mapped twice, one
/// mapping standing for the target's side of the memory, the other for
/// memptrace's.
#[cfg(test)]
pub fn pair_for_tests(len: usize) -> io::Result<(SharedMemory, SharedMemory)> {
    // SAFETY: memfd_create with a NUL-terminated name; the descriptor is
    // owned from here on; ftruncate of our own memfd.
    let fd = unsafe {
        let fd = libc::memfd_create(c"memptrace-test".as_ptr(), libc::MFD_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0 {
            return Err(io::Error::last_os_error());
        }
        fd
    };
    Ok((SharedMemory::map(&fd, len)?, SharedMemory::map(&fd, len)?))
}

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
        assert!(b.write(16, b"memptrace"));
        let mut buf = [0u8; 9];
        assert!(a.read(16, &mut buf));
        assert_eq!(&buf, b"memptrace");
        a.wake(4096);
    }

    #[test]
    fn bad_offsets_are_refused_not_a_panic() {
        // SAFETY: memfd_create with a valid name; the descriptor is owned.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: just created, owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate of our own descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        let m = SharedMemory::map(&fd, 4096).unwrap();
        m.store(8, 7);
        for bad in [3, 4090, 4096, u64::MAX - 3, u64::MAX] {
            assert_eq!(m.load(bad), 0);
            m.store(bad, 1);
            assert_eq!(m.fetch_add(bad, 1), 0);
            m.wake(bad);
        }
        // Bytes need no alignment, only to be in the mapping.
        for bad in [4090, 4096, u64::MAX - 3, u64::MAX] {
            let mut buf = [9u8; 16];
            assert!(!m.read(bad, &mut buf));
            assert_eq!(buf, [9u8; 16]);
            assert!(!m.write(bad, &buf));
            let mut out = Vec::new();
            assert!(!m.copy_out(bad, 16, &mut out));
            assert!(out.is_empty());
        }
        assert_eq!(m.load(8), 7);
        let mut odd = [0u8; 5];
        assert!(m.read(3, &mut odd));
        let mut words = [0u64; 2];
        assert!(m.read_words(1, &mut words));
        assert_eq!(words[0], 7 << 56);
        assert!(!m.read_words(4088, &mut words));
        let mut whole = vec![0u8; 4096];
        assert!(m.read(0, &mut whole));
        assert!(!m.read(1, &mut whole));
    }
}
