//! The data the tracer hands on: plain values, no process handles.
//!
//! An [`Event`] is one call of the allocator API as the target made it. Everything
//! downstream of the tracer (unwinding, interning, recording, reports) sees only
//! these types, so it can be driven by tests without a live process.

use std::fmt;

/// The allocator functions memptrace hooks, in the order of the `op` codes stored
/// in the database (`event_log.op`). Never reorder: the code is on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Op {
    Malloc = 0,
    Calloc = 1,
    Realloc = 2,
    Free = 3,
    PosixMemalign = 4,
    AlignedAlloc = 5,
    Memalign = 6,
    Valloc = 7,
    Pvalloc = 8,
    Reallocarray = 9,
    /// Not a call: a block live when memptrace attached, found by walking
    /// the heap (`heap::HeapMap::live_blocks`); its size is the block's
    /// usable size, its stack unknown. Never hooked: not in [`Op::ALL`].
    Inventory = 10,
}

impl Op {
    /// Every op, in code order.
    pub const ALL: [Op; 10] = [
        Op::Malloc,
        Op::Calloc,
        Op::Realloc,
        Op::Free,
        Op::PosixMemalign,
        Op::AlignedAlloc,
        Op::Memalign,
        Op::Valloc,
        Op::Pvalloc,
        Op::Reallocarray,
    ];

    /// Every op a trace may hold, in code order: the functions, then
    /// [`Op::Inventory`]. For decoding stored events.
    pub const RECORDED: [Op; Op::ALL.len() + 1] = {
        let mut ops = [Op::Inventory; Op::ALL.len() + 1];
        let mut i = 0;
        while i < Op::ALL.len() {
            ops[i] = Op::ALL[i];
            i += 1;
        }
        ops
    };

    /// The C name of the function, as stored in `events.op`.
    pub fn name(self) -> &'static str {
        match self {
            Op::Malloc => "malloc",
            Op::Calloc => "calloc",
            Op::Realloc => "realloc",
            Op::Free => "free",
            Op::PosixMemalign => "posix_memalign",
            Op::AlignedAlloc => "aligned_alloc",
            Op::Memalign => "memalign",
            Op::Valloc => "valloc",
            Op::Pvalloc => "pvalloc",
            Op::Reallocarray => "reallocarray",
            Op::Inventory => "inventory",
        }
    }

    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }

    pub fn from_code(code: u8) -> Option<Op> {
        Op::RECORDED.get(usize::from(code)).copied()
    }

    /// True for every function that hands a block to the caller (all but
    /// free), and for a block found at attach.
    /// These are the calls whose return value memptrace captures.
    pub fn allocates(self) -> bool {
        self != Op::Free
    }

    /// True for the functions that take a block back: free, realloc, reallocarray.
    pub fn takes_block(self) -> bool {
        matches!(self, Op::Free | Op::Realloc | Op::Reallocarray)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One allocator call, complete: arguments, result and the stack it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Sequence number, in the order the calls took effect (allocations at their
    /// return, frees at their entry). Unique within a trace.
    pub id: u64,
    /// Nanoseconds since the trace started, taken when the call took effect.
    pub ts_ns: u64,
    /// Process (thread group) id.
    pub pid: u32,
    pub tid: u32,
    pub op: Op,
    /// The block returned (allocating calls; 0 when the call failed) or released (free).
    pub ptr: u64,
    /// Bytes requested (calloc and reallocarray: n*m). `None` for free, and when the
    /// product n*m does not fit in 64 bits.
    pub size: Option<u64>,
    /// The block realloc/reallocarray received.
    pub old_ptr: Option<u64>,
    /// The alignment asked of posix_memalign, aligned_alloc and memalign.
    pub align: Option<u64>,
    /// For a call that released a block (free, or realloc moving it away): the id of
    /// the event that allocated that block, when it was traced.
    pub alloc_id: Option<u64>,
    /// The leaf of the call stack in the `stacks` trie; `None` when no stack was taken.
    pub stack_id: Option<u64>,
}

impl Event {
    /// True when this call released `old_ptr` (realloc/reallocarray): it returned a
    /// block, or it was asked for 0 bytes (glibc frees and returns NULL then).
    /// A failed realloc leaves the old block alone.
    pub fn released_old(&self) -> bool {
        match self.old_ptr {
            Some(old) if old != 0 => self.ptr != 0 || self.size == Some(0),
            _ => false,
        }
    }
}

#[cfg(test)]
impl Event {
    /// A test's call: `op` by thread `tid` of process 100 at `ts_ns`,
    /// returning (or releasing) `ptr`, `size` requested, from leaf `stack`;
    /// the rest (`alloc_id`, `old_ptr`, `align`) by struct update.
    pub fn test(
        id: u64,
        ts_ns: u64,
        tid: u32,
        op: Op,
        ptr: u64,
        size: Option<u64>,
        stack: Option<u64>,
    ) -> Event {
        Event {
            id,
            ts_ns,
            pid: 100,
            tid,
            op,
            ptr,
            size,
            old_ptr: None,
            align: None,
            alloc_id: None,
            stack_id: stack,
        }
    }

    /// A test's `free` of `ptr`, the block event `alloc_id` allocated.
    pub fn test_free(
        id: u64,
        ts_ns: u64,
        tid: u32,
        ptr: u64,
        alloc_id: u64,
        stack: Option<u64>,
    ) -> Event {
        Event {
            alloc_id: Some(alloc_id),
            ..Event::test(id, ts_ns, tid, Op::Free, ptr, None, stack)
        }
    }
}

/// The memory-mapping functions memptrace hooks beside the allocator: the
/// calls through which a process's address space, and so its resident
/// memory, grows and shrinks (the allocator's own included).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MapOp {
    Mmap,
    Munmap,
    Mremap,
    Brk,
    Sbrk,
    Madvise,
    Mprotect,
}

impl MapOp {
    pub const ALL: [MapOp; 7] = [
        MapOp::Mmap,
        MapOp::Munmap,
        MapOp::Mremap,
        MapOp::Brk,
        MapOp::Sbrk,
        MapOp::Madvise,
        MapOp::Mprotect,
    ];

    /// The C name, as stored in `map_events.op`.
    pub fn name(self) -> &'static str {
        match self {
            MapOp::Mmap => "mmap",
            MapOp::Munmap => "munmap",
            MapOp::Mremap => "mremap",
            MapOp::Brk => "brk",
            MapOp::Sbrk => "sbrk",
            MapOp::Madvise => "madvise",
            MapOp::Mprotect => "mprotect",
        }
    }
}

impl fmt::Display for MapOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One call of a mapping function: its arguments (System V ABI order: rdi,
/// rsi, rdx, rcx, r8, r9) and result, as made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapEvent {
    pub id: u64,
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub op: MapOp,
    pub args: [u64; 6],
    /// What the function returned (rax): an address (mmap, mremap, sbrk's
    /// old break) or 0/-1.
    pub result: u64,
    pub stack_id: Option<u64>,
    /// The allocator function (malloc, free, ...) the call was made in, when
    /// it was made by the allocator, not by the program.
    pub by_allocator: Option<Op>,
}
