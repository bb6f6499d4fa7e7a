//! The names the C libraries give the functions memptrace looks for: in a
//! symbol table ([`crate::symbols::elf`]) and in a `libc.a` when a signature
//! set is made ([`crate::symbols::signatures::extract`]). One list for both,
//! so that a stripped binary is hooked where its unstripped build would be.

use crate::event::{MapOp, Op};

/// Symbol names that denote an allocator entry point. Only the public names:
/// glibc's `__libc_malloc` and friends are aliases at the same addresses, and
/// musl's `__libc_free` is the body that `free` jumps to (hooking both would
/// count every free twice). Local symbols count too: in a static-pie glibc
/// binary `malloc` itself is local.
pub const ALLOCATOR_NAMES: [(&str, Op); 10] = [
    ("malloc", Op::Malloc),
    ("calloc", Op::Calloc),
    ("realloc", Op::Realloc),
    ("free", Op::Free),
    ("posix_memalign", Op::PosixMemalign),
    ("aligned_alloc", Op::AlignedAlloc),
    ("memalign", Op::Memalign),
    ("valloc", Op::Valloc),
    ("pvalloc", Op::Pvalloc),
    ("reallocarray", Op::Reallocarray),
];

/// The bodies of allocator functions whose public names only jump to them
/// (musl), for telling a mapping call made inside the allocator.
pub const BODY_NAMES: [(&str, Op); 5] = [
    ("__libc_malloc_impl", Op::Malloc),
    ("__libc_malloc", Op::Malloc),
    ("__libc_free", Op::Free),
    ("__libc_calloc", Op::Calloc),
    ("__libc_realloc", Op::Realloc),
];

/// The mapping functions, under every name the C libraries give them (the
/// internal aliases are the same code: one hook each).
pub const MAPPING_NAMES: [(&str, MapOp); 16] = [
    ("mmap", MapOp::Mmap),
    ("mmap64", MapOp::Mmap),
    ("__mmap", MapOp::Mmap),
    ("__mmap64", MapOp::Mmap),
    ("munmap", MapOp::Munmap),
    ("__munmap", MapOp::Munmap),
    ("mremap", MapOp::Mremap),
    ("__mremap", MapOp::Mremap),
    ("brk", MapOp::Brk),
    ("__brk", MapOp::Brk),
    ("sbrk", MapOp::Sbrk),
    ("__sbrk", MapOp::Sbrk),
    ("madvise", MapOp::Madvise),
    ("__madvise", MapOp::Madvise),
    ("mprotect", MapOp::Mprotect),
    ("__mprotect", MapOp::Mprotect),
];

/// glibc functions that release a thread's cached blocks through the public
/// `free` when the thread exits (malloc.c: tcache_thread_shutdown, which
/// Debian's glibc 2.36 inlines into `__malloc_arena_thread_freeres`). Those
/// frees are the allocator's housekeeping, not the program's.
pub const HOUSEKEEPING_NAMES: [&str; 3] = [
    "tcache_thread_shutdown",
    "__malloc_arena_thread_freeres",
    "__libc_thread_freeres",
];

/// The mapping function `name` names, if any.
pub fn map_op(name: &str) -> Option<MapOp> {
    MAPPING_NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, op)| op)
}

/// The allocator op whose body `name` names, if any.
pub fn body_op(name: &str) -> Option<Op> {
    BODY_NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, op)| op)
}

pub fn is_housekeeping(name: &str) -> bool {
    HOUSEKEEPING_NAMES.contains(&name)
}
