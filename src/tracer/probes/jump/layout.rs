//! The control area: memory shared between the target and memptrace, where
//! jump probes find their thread's slot and ring, the unwind tables, and
//! write what they record. Its layout is the contract between the code the
//! probes run (written by [`super::code`]) and memptrace, which reads the
//! rings (`tracer::rings`) and writes everything else.
//!
//! ```text
//! 0          header: the sequence counter, the unwind directory in use,
//!            memptrace's heartbeat
//! SLOTS      one 256-byte slot per thread, found by hashing the thread pointer
//! DIRS       unwind directories (a sorted array of images), rotated on change
//! TABLES     unwind tables, appended as images appear
//! RINGS      one ring per slot, each followed by room for a record that
//!            runs past its end (a record is never split)
//! ```
//!
//! Who writes what: memptrace writes a slot's fixed part (key last, so a
//! probe never sees a half-made slot), the directories and tables, and each
//! ring's tail; the thread owning a slot writes its working part, its ring
//! and its head (a record's bytes first, then the head: x86 stores are seen
//! in order). All offsets and sizes are in bytes.

use crate::event::{MapOp, Op};

/// Slots for threads at once; a thread whose hash finds no slot within
/// [`PROBES`] of its place waits in memptrace's stop until one frees.
pub const SLOT_BITS: u32 = 10;
pub const SLOTS: u64 = 1 << SLOT_BITS;
/// Places a probe looks at, from the hashed one on.
pub const PROBES: u64 = 4;
pub const SLOT_SIZE: u64 = 256;

/// Header fields.
pub const MAGIC: u64 = 0;
/// The next sequence number (`lock xadd`): a total order of every record
/// of the address space.
pub const SEQ: u64 = 64;
/// Address of the unwind directory in use.
pub const DIRECTORY: u64 = 128;
/// A `struct timespec` of 1 ms: how long a thread waits on a full ring
/// before it looks again.
pub const WAIT_TIMESPEC: u64 = 192;
/// memptrace's process and tracer thread: a thread that finds its ring
/// full sends that thread SIGCHLD, which wakes it if it sleeps.
pub const TRACER_PID: u64 = 256;
pub const TRACER_TID: u64 = 264;
/// Not 0: the probe must not send that signal. memptrace sets it in every
/// area: a seccomp filter the program installs at any time may kill it
/// for `tgkill`, and memptrace reads the rings every 1 ms anyway.
pub const NO_WAKE: u64 = 384;
/// Whether memptrace is still there (attach only: see [`ALIVE_TICKS`]).
/// memptrace's last heartbeat: the time-stamp counter (`rdtsc`), stored
/// from its wait loop at every tick.
pub const ALIVE_TSC: u64 = 512;
/// How many counter ticks after its last heartbeat memptrace counts as
/// gone (about a second); 0: never (a launched program dies with
/// memptrace, so its probes never need to give up on it).
pub const ALIVE_TICKS: u64 = 520;
/// Set when memptrace lets go of the area (its end, orderly or not): the
/// probes record nothing from then on.
pub const GONE: u64 = 528;
/// A 4-byte futex word holding the id of a thread of memptrace's, which the
/// kernel clears (FUTEX_OWNER_DIED) the moment memptrace dies, however it
/// dies (see `os::sentinel`): a probe that finds no thread id here lets the
/// call through at once. 0 also once memptrace let go of the area.
pub const ALIVE_WORD: u64 = 640;
/// Calls a probe let through unrecorded because memptrace looked gone
/// (`lock inc`): a thread with no slot, or with a full ring, goes on
/// rather than wait for a tracer that may never answer.
pub const LET_THROUGH: u64 = 576;
pub const HEADER_SIZE: u64 = 4096;

pub const MAGIC_VALUE: u64 = u64::from_le_bytes(*b"memptrc1");

/// Slot fields, written by memptrace.
pub mod slot {
    /// The thread pointer (fs base) + 1 of the thread owning the slot; 0: free.
    pub const KEY: u64 = 0;
    /// Bit 0: the thread's calls are not recorded (a vfork child runs on
    /// its stack and thread pointer until it execs).
    pub const FLAGS: u64 = 8;
    /// The thread's stack mapping: unwinding reads nothing outside it.
    pub const STACK_LO: u64 = 16;
    pub const STACK_HI: u64 = 24;
    /// Address of the slot's ring.
    pub const RING: u64 = 32;
    // Written by the thread.
    /// The stack pointer of the probe running on the thread (0: none): a
    /// probe entered below it is a signal handler's, which records nothing;
    /// one entered above it means the holder was left by a longjmp.
    pub const BUSY: u64 = 64;
    /// The stack pointer at the entry of the thread's outermost call in
    /// progress (0: none).
    pub const PENDING_SP: u64 = 72;
    /// Its arguments.
    pub const ARG0: u64 = 80;
    pub const ARG1: u64 = 88;
    pub const ARG2: u64 = 96;
    /// Frames it recorded at its entry, waiting in the ring past the head.
    pub const PENDING_FRAMES: u64 = 104;
    /// Calls of the thread seen but not recorded: nested in a pending call
    /// or in a probe interrupted by a signal handler.
    pub const NESTED: u64 = 112;
    /// Outermost calls whose frame was left by a longjmp.
    pub const ABANDONED: u64 = 120;
    /// Bytes of records committed, ever (the ring position is this modulo
    /// the ring size).
    pub const HEAD: u64 = 128;
    /// Set by a thread waiting for room in its ring (memptrace wakes it).
    pub const WAITING: u64 = 136;
    /// Times the thread found its ring full and waited for memptrace.
    pub const WAITS: u64 = 144;
    /// Address of the thread's cache of unwind rules (written by memptrace).
    pub const CACHE: u64 = 40;
    /// The directory the cache was filled under (written by the thread).
    pub const CACHE_DIR: u64 = 152;
    /// Bytes of records memptrace has taken, ever (written by memptrace).
    pub const TAIL: u64 = 192;
    /// A mapping call's fourth to sixth arguments (its probe keeps rcx, r8
    /// and r9 for the function, which takes them).
    pub const ARG3: u64 = 160;
    pub const ARG4: u64 = 168;
    pub const ARG5: u64 = 176;
}

/// Set in the key of a thread's second slot, the one its mapping calls use
/// (attach only): a mapping call made inside an allocator call (malloc's
/// mmap, sbrk) is recorded while the allocator call's record waits past its
/// slot's head, so it needs a ring, a pending call and arguments of its
/// own. A thread pointer never has bit 63 set.
pub const MAP_KEY: u64 = 1 << 63;

/// Set in the key of a thread's signal slot: an allocator call of a signal
/// handler that interrupted one of the thread's probes (its slot busy, with
/// a stack pointer above the handler's) is recorded there, with a ring, a
/// pending call and arguments of its own, while the interrupted probe's
/// record waits past its own slot's head. One level: a handler inside a
/// handler's probe is counted in `nested_calls`, as is a handler's call
/// made while the function itself runs (it cannot be told from a call the
/// function makes). A thread pointer never has bit 62 set.
pub const SIGNAL_KEY: u64 = 1 << 62;

/// Directories: `DIR_COUNT` of them, used in turn, each a count then sorted
/// entries.
pub const DIRS: u64 = (HEADER_SIZE + (SLOTS + PROBES) * SLOT_SIZE).next_multiple_of(4096);
pub const DIR_COUNT: u64 = 8;
pub const DIR_SIZE: u64 = 64 << 10;
pub const DIR_ENTRY_SIZE: u64 = 48;
pub const DIR_ENTRIES: u64 = (DIR_SIZE - 16) / DIR_ENTRY_SIZE;

/// Directory entry fields: the image's range, its load bias, its table.
pub mod dir {
    pub const START: u64 = 0;
    pub const END: u64 = 8;
    pub const BIAS: u64 = 16;
    /// Address of the row keys (u32 SVMA of each row's start, sorted).
    pub const KEYS: u64 = 24;
    /// Address of the rules (u32 each, see [`super::rule`]).
    pub const RULES: u64 = 32;
    pub const ROWS: u64 = 40;
}

/// The rules of the unwind tables (see [`crate::unwind::tables`]).
pub use crate::unwind::tables::rule;

pub const TABLES: u64 = DIRS + DIR_COUNT * DIR_SIZE;
pub const TABLES_SIZE: u64 = 64 << 20;

/// Rings: one per slot.
pub const RINGS: u64 = TABLES + TABLES_SIZE;
/// More than the records a thread makes while memptrace's tracer thread,
/// caught up, sleeps its 1 ms: at 128 KiB the sqlite3 shell of the
/// benchmark filled its ring 1,679 times in 1.5 M calls and waited each
/// time for the tracer to wake (twice a wakeup here); at 1 MiB, 60 times,
/// and it ran 15-25 % faster. Only the pages a thread fills are resident.
pub const RING_SIZE: u64 = 1 << 20;
/// The largest record: a mapping call's header and [`MAX_FRAMES`] return
/// addresses.
pub const MAX_FRAMES: u64 = 128;
pub const RECORD_HEADER: u64 = 64;
pub const MAP_RECORD_HEADER: u64 = record::MAP_FRAMES;
pub const MAX_RECORD: u64 = MAP_RECORD_HEADER + MAX_FRAMES * 8;
/// Ring and the room past its end for a record that starts near it (a
/// page, to keep rings page-aligned).
pub const RING_STRIDE: u64 = RING_SIZE + MAX_RECORD.next_multiple_of(4096);

/// Rule caches: one per slot, `CACHE_SIZE` bytes of (return address,
/// rule) entries, direct-mapped: a thread's stacks repeat, and a hit costs
/// a hash and a compare where a miss searches the directory and a table.
pub const CACHES: u64 = RINGS + (SLOTS + PROBES) * RING_STRIDE;
pub const CACHE_BITS: u32 = 9;
pub const CACHE_SIZE: u64 = 16 << CACHE_BITS;

/// The whole area.
pub const AREA_SIZE: u64 = CACHES + (SLOTS + PROBES) * CACHE_SIZE;

/// Record fields (8-byte aligned, [`RECORD_HEADER`] bytes, then the frames;
/// a mapping call's record: [`MAP_RECORD_HEADER`] bytes, then the frames).
pub mod record {
    /// u16 size of the record in bytes, u16 frames, u8 flags, u8 op
    /// (`Op as u8`; a mapping call's: [`MAP_OPS`] + its index in
    /// `MapOp::ALL`), u16 the probe's number.
    pub const HEAD: u64 = 0;
    pub const SEQ: u64 = 8;
    pub const TSC: u64 = 16;
    pub const ARG0: u64 = 24;
    pub const ARG1: u64 = 32;
    pub const ARG2: u64 = 40;
    pub const RET: u64 = 48;
    /// posix_memalign: the block stored through its first argument.
    pub const STORED: u64 = 56;
    pub const FRAMES: u64 = 64;

    /// A mapping call's record: `STORED` holds its fourth argument, then
    /// come the fifth and sixth, then the frames.
    pub const ARG3: u64 = STORED;
    pub const ARG4: u64 = 64;
    pub const ARG5: u64 = 72;
    pub const MAP_FRAMES: u64 = 80;
    /// The op code of a mapping call's record: this + its `MapOp` index.
    pub const MAP_OPS: u8 = 0x40;

    /// Flag: the stack ended where no unwind rule covered an address (or
    /// outside the thread's stack): it may be incomplete.
    pub const TRUNCATED: u8 = 1;
    /// Flag: `--max-depth` frames were taken.
    pub const FULL: u8 = 2;
}

/// What a probe records: an allocator call, or a mapping call (six
/// arguments, in a slot of its own: see [`MAP_KEY`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Called {
    Alloc(Op),
    Map(MapOp),
}

impl Called {
    /// The op code in a record's header.
    pub fn code(self) -> u8 {
        match self {
            Called::Alloc(op) => op as u8,
            Called::Map(op) => record::MAP_OPS + op as u8,
        }
    }

    /// The call of op code `code`, if a probe records it: an allocator
    /// function (never an `inventory` row, which only the heap walk makes)
    /// or a mapping function.
    pub fn of_code(code: u8) -> Option<Called> {
        match code.checked_sub(record::MAP_OPS) {
            Some(i) => MapOp::ALL.get(usize::from(i)).copied().map(Called::Map),
            None => Op::ALL.get(usize::from(code)).copied().map(Called::Alloc),
        }
    }

    /// Where a record's frames start.
    pub fn frames_at(self) -> u64 {
        match self {
            Called::Alloc(_) => record::FRAMES,
            Called::Map(_) => record::MAP_FRAMES,
        }
    }

    /// The probe records the call's result (all but `free`).
    pub fn returns(self) -> bool {
        match self {
            Called::Alloc(op) => op.allocates(),
            Called::Map(_) => true,
        }
    }
}

/// The multiplier of the slot hash (Fibonacci hashing: 2^64 / φ, odd),
/// which spreads thread pointers a stack size apart over the slots.
pub const HASH: u64 = 0x9e37_79b9_7f4a_7c15;

/// A slot's key for thread pointer `tp`: never 0, which marks a free slot.
pub fn key_of(tp: u64) -> u64 {
    tp.wrapping_add(1)
}

/// The key of the slot a thread's mapping calls use (see [`MAP_KEY`]).
pub fn map_key_of(tp: u64) -> u64 {
    key_of(tp) | MAP_KEY
}

/// The key of the slot a thread's signal handlers use inside its probes
/// (see [`SIGNAL_KEY`]).
pub fn signal_key_of(tp: u64) -> u64 {
    key_of(tp) | SIGNAL_KEY
}

/// Where a slot with key `key` is first looked for (the probe computes the
/// same: see `code`).
pub fn home_of_key(key: u64) -> u64 {
    (key.wrapping_mul(HASH) >> (64 - SLOT_BITS)) & (SLOTS - 1)
}

/// Offset of slot `i`, and of its ring.
pub fn slot_offset(i: u64) -> u64 {
    HEADER_SIZE + i * SLOT_SIZE
}

pub fn ring_offset(i: u64) -> u64 {
    RINGS + i * RING_STRIDE
}

pub fn cache_offset(i: u64) -> u64 {
    CACHES + i * CACHE_SIZE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_consistent() {
        assert_eq!(AREA_SIZE % 4096, 0);
        assert_eq!(DIRS % 64, 0);
        assert_eq!(TABLES % 64, 0);
        assert_eq!(RINGS % 4096, 0);
        assert!(RING_SIZE.is_power_of_two());
        assert_eq!(RING_STRIDE % 8, 0);
        // Slots of threads a stack apart land apart.
        let homes: std::collections::HashSet<u64> = (0..64u64)
            .map(|i| home_of_key(key_of(0x7f00_0000_0000 + i * (8 << 20) + 0x6c0)))
            .collect();
        assert!(homes.len() >= 60, "{}", homes.len());
    }
}
