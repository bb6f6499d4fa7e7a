//! memptrace's own memory, for running the code it writes into targets
//! here, where a test can watch it: an anonymous mapping, code in it
//! called like a C function, and the calling thread's thread pointer.
//! Nothing here touches another process.

use std::io;

/// An anonymous private mapping of memptrace's own (read, write and, if
/// asked, execute), unmapped on drop.
pub struct LocalMapping {
    ptr: *mut u8,
    len: usize,
}

impl LocalMapping {
    pub fn new(len: usize, exec: bool) -> io::Result<LocalMapping> {
        let mut prot = libc::PROT_READ | libc::PROT_WRITE;
        if exec {
            prot |= libc::PROT_EXEC;
        }
        // SAFETY: a new anonymous mapping placed by the kernel; unmapped in
        // Drop, reached only through the bounds-checked methods below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(LocalMapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Its address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Write `bytes` at `offset`.
    pub fn write(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.len);
        // SAFETY: in bounds (checked); plain bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len()) }
    }

    /// Read `buf.len()` bytes at `offset`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) {
        assert!(offset + buf.len() <= self.len);
        // SAFETY: in bounds (checked); plain bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), buf.as_mut_ptr(), buf.len()) }
    }

    pub fn read_u64(&self, offset: usize) -> u64 {
        let mut word = [0u8; 8];
        self.read(offset, &mut word);
        u64::from_le_bytes(word)
    }

    pub fn write_u64(&self, offset: usize, value: u64) {
        self.write(offset, &value.to_le_bytes());
    }

    /// Call the code at `offset` as `extern "C" fn(u64, u64, u64) -> u64`.
    ///
    /// # Safety
    /// The mapping must be executable and hold, at `offset`, code that
    /// follows the System V ABI for such a function and touches no memory
    /// but this mapping's, its own stack's and what the caller vouches for.
    pub unsafe fn call(&self, offset: usize, a: u64, b: u64, c: u64) -> u64 {
        assert!(offset < self.len);
        // SAFETY: the caller vouches for the code (see above).
        unsafe {
            let f: extern "C" fn(u64, u64, u64) -> u64 = std::mem::transmute(self.ptr.add(offset));
            f(a, b, c)
        }
    }
}

impl LocalMapping {
    /// Call the code at `offset` as `extern "C" fn(u64, u64, u64, u64, u64,
    /// u64) -> u64` (six arguments: rdi, rsi, rdx, rcx, r8, r9).
    ///
    /// # Safety
    /// As for [`LocalMapping::call`].
    pub unsafe fn call6(&self, offset: usize, args: [u64; 6]) -> u64 {
        assert!(offset < self.len);
        // SAFETY: the caller vouches for the code (see `call`).
        unsafe {
            let f: extern "C" fn(u64, u64, u64, u64, u64, u64) -> u64 =
                std::mem::transmute(self.ptr.add(offset));
            f(args[0], args[1], args[2], args[3], args[4], args[5])
        }
    }
}

impl Drop for LocalMapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `len` bytes, no longer used.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// The calling thread's thread pointer (its fs base): glibc and musl keep
/// it in the word it points to, so it is read there.
pub fn thread_pointer() -> u64 {
    let tp: u64;
    // SAFETY: reads one word at fs:0, which both C libraries set up for
    // every thread (the TCB's pointer to itself).
    unsafe { std::arch::asm!("mov {}, fs:[0]", out(reg) tp, options(nostack, readonly)) };
    tp
}

/// The CPU's time-stamp counter (`rdtsc`): the clock the jump probes
/// stamp their records with.
pub fn tsc() -> u64 {
    // SAFETY: rdtsc reads a counter; it touches no memory.
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// The calling thread's id (`gettid(2)`).
pub fn thread_id() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Lower the calling thread's priority to the lowest nice value (19): its
/// work then takes the CPU time the other threads leave. A thread cannot
/// raise it back without privileges. Best effort: an error is ignored.
pub fn lower_own_priority() {
    // SAFETY: setpriority changes the scheduling priority of one thread
    // (PRIO_PROCESS with a thread id); it touches no memory.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, thread_id() as libc::id_t, 19);
    }
}
