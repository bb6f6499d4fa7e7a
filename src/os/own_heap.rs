//! memptrace's own heap (glibc's malloc): the memory it freed, given back
//! to the kernel.
//!
//! glibc keeps what a program frees for its next allocations, and gives
//! memory back by itself only from the top of a heap, past a threshold it
//! raises each time a large block mapped on its own is freed (up to 64 MiB,
//! `mallopt(3)`, M_TRIM_THRESHOLD). memptrace's threads hand batches of
//! records, stack copies and maps to one another, each freed by another
//! thread than the one that made it: the free pages stayed resident in
//! every arena, and memptrace's resident memory grew with what passed
//! through it, not with what it holds (247 MB during a 30 M-call trace,
//! 80 MB once `malloc_trim` was called, docs/performance.md).

/// Give the free pages of every arena of memptrace's own heap back to the
/// kernel (`malloc_trim(3)`); true when some were.
#[cfg(target_env = "gnu")]
pub fn give_back_freed() -> bool {
    // SAFETY: malloc_trim takes no pointer; it takes each arena's lock
    // itself and releases only memory no allocation holds.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Another C library: its allocator is left to its own ways.
#[cfg(not(target_env = "gnu"))]
pub fn give_back_freed() -> bool {
    false
}
