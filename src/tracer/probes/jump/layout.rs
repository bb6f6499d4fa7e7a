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
pub const SLOT_SIZE: u64 = size_of::<Slot>() as u64;

/// The area's header, as the probes and memptrace see it: each group of
/// fields on a cache line (or several) of its own, so that the threads'
/// `lock xadd` on the sequence counter does not share a line with what
/// memptrace stores at every tick.
#[repr(C)]
pub struct Header {
    pub magic: u64,
    _pad0: [u64; 7],
    /// The next sequence number (`lock xadd`): a total order of every
    /// record of the address space.
    pub seq: u64,
    _pad1: [u64; 7],
    /// Address of the unwind directory in use.
    pub directory: u64,
    _pad2: [u64; 7],
    /// A `struct timespec` of 1 ms: how long a thread waits on a full ring
    /// before it looks again.
    pub wait_timespec: [u64; 2],
    _pad3: [u64; 6],
    /// memptrace's process and tracer thread: a thread that finds its ring
    /// full sends that thread SIGCHLD, which wakes it if it sleeps.
    pub tracer_pid: u64,
    pub tracer_tid: u64,
    _pad4: [u64; 14],
    /// Not 0: the probe must not send that signal. memptrace sets it in
    /// every area: a seccomp filter the program installs at any time may
    /// kill it for `tgkill`, and memptrace reads the rings every 1 ms
    /// anyway.
    pub no_wake: u64,
    _pad5: [u64; 15],
    /// Whether memptrace is still there (attach only: see [`ALIVE_TICKS`]).
    /// memptrace's last heartbeat: the time-stamp counter (`rdtsc`),
    /// stored from its wait loop at every tick.
    pub alive_tsc: u64,
    /// How many counter ticks after its last heartbeat memptrace counts as
    /// gone (about a second); 0: never (a launched program dies with
    /// memptrace, so its probes never need to give up on it).
    pub alive_ticks: u64,
    /// Set when memptrace lets go of the area (its end, orderly or not):
    /// the probes record nothing from then on.
    pub gone: u64,
    _pad6: [u64; 5],
    /// Calls a probe let through unrecorded because memptrace looked gone
    /// (`lock inc`): a thread with no slot, or with a full ring, goes on
    /// rather than wait for a tracer that may never answer.
    pub let_through: u64,
    _pad7: [u64; 7],
    /// A 4-byte futex word holding the id of a thread of memptrace's, which
    /// the kernel clears (FUTEX_OWNER_DIED) the moment memptrace dies,
    /// however it dies (see `os::sentinel`): a probe that finds no thread
    /// id here lets the call through at once. 0 also once memptrace let go
    /// of the area.
    pub alive_word: u64,
    _pad8: [u64; 431],
}

/// Offsets of the [`Header`]'s fields, for the probes' code and the
/// control area's accessors.
macro_rules! offsets {
    ($ty:ty { $($name:ident = $field:ident),* $(,)? }) => {
        $(
            #[doc = concat!("Offset of `", stringify!($field), "` (see [`", stringify!($ty), "`]).")]
            pub const $name: u64 = std::mem::offset_of!($ty, $field) as u64;
        )*
    };
}

offsets!(Header {
    MAGIC = magic,
    SEQ = seq,
    DIRECTORY = directory,
    WAIT_TIMESPEC = wait_timespec,
    TRACER_PID = tracer_pid,
    TRACER_TID = tracer_tid,
    NO_WAKE = no_wake,
    ALIVE_TSC = alive_tsc,
    ALIVE_TICKS = alive_ticks,
    GONE = gone,
    LET_THROUGH = let_through,
    ALIVE_WORD = alive_word,
});
pub const HEADER_SIZE: u64 = size_of::<Header>() as u64;

pub const MAGIC_VALUE: u64 = u64::from_le_bytes(*b"memptrc1");

/// A thread's slot. memptrace writes the fixed part (`key` last); the
/// thread owning the slot writes its working part.
#[repr(C)]
pub struct Slot {
    /// The thread pointer (fs base) + 1 of the thread owning the slot; 0: free.
    pub key: u64,
    /// Bit 0: the thread's calls are not recorded (a vfork child runs on
    /// its stack and thread pointer until it execs).
    pub flags: u64,
    /// The thread's stack mapping: unwinding reads nothing outside it.
    pub stack_lo: u64,
    pub stack_hi: u64,
    /// Address of the slot's ring.
    pub ring: u64,
    /// Address of the thread's cache of unwind rules.
    pub cache: u64,
    _pad0: [u64; 2],
    // Written by the thread.
    /// The stack pointer of the probe running on the thread (0: none): a
    /// probe entered below it is a signal handler's, which records nothing;
    /// one entered above it means the holder was left by a longjmp.
    pub busy: u64,
    /// The stack pointer at the entry of the thread's outermost call in
    /// progress (0: none).
    pub pending_sp: u64,
    /// Its arguments.
    pub arg0: u64,
    pub arg1: u64,
    pub arg2: u64,
    /// Frames it recorded at its entry, waiting in the ring past the head
    /// (the count, and the record's flags: see [`PENDING_FLAGS_SHIFT`]).
    pub pending_frames: u64,
    /// Calls of the thread seen but not recorded: nested in a pending call
    /// or in a probe interrupted by a signal handler.
    pub nested: u64,
    /// Outermost calls whose frame was left by a longjmp.
    pub abandoned: u64,
    /// Bytes of records committed, ever (the ring position is this modulo
    /// the ring size).
    pub head: u64,
    /// Set by a thread waiting for room in its ring (memptrace wakes it).
    pub waiting: u64,
    /// Times the thread found its ring full and waited for memptrace.
    pub waits: u64,
    /// The directory the cache was filled under (written by the thread).
    pub cache_dir: u64,
    /// A mapping call's fourth to sixth arguments (its probe keeps rcx, r8
    /// and r9 for the function, which takes them).
    pub arg3: u64,
    pub arg4: u64,
    pub arg5: u64,
    _pad1: u64,
    /// Bytes of records memptrace has taken, ever (written by memptrace,
    /// on a cache line of its own).
    pub tail: u64,
    _pad2: [u64; 7],
}

/// Offsets of the [`Slot`]'s fields.
pub mod slot {
    use super::Slot;

    offsets!(Slot {
        KEY = key,
        FLAGS = flags,
        STACK_LO = stack_lo,
        STACK_HI = stack_hi,
        RING = ring,
        CACHE = cache,
        BUSY = busy,
        PENDING_SP = pending_sp,
        ARG0 = arg0,
        ARG1 = arg1,
        ARG2 = arg2,
        PENDING_FRAMES = pending_frames,
        NESTED = nested,
        ABANDONED = abandoned,
        HEAD = head,
        WAITING = waiting,
        WAITS = waits,
        CACHE_DIR = cache_dir,
        ARG3 = arg3,
        ARG4 = arg4,
        ARG5 = arg5,
        TAIL = tail,
    });
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
pub const DIR_ENTRY_SIZE: u64 = size_of::<DirEntry>() as u64;
pub const DIR_ENTRIES: u64 = (DIR_SIZE - 16) / DIR_ENTRY_SIZE;

/// Directory entry fields: the image's range, its load bias, its table.
#[repr(C)]
pub struct DirEntry {
    pub start: u64,
    pub end: u64,
    pub bias: u64,
    /// Address of the row keys (u32 SVMA of each row's start, sorted).
    pub keys: u64,
    /// Address of the rules (u32 each, see [`rule`]).
    pub rules: u64,
    pub rows: u64,
}

/// Offsets of the [`DirEntry`]'s fields.
pub mod dir {
    use super::DirEntry;

    offsets!(DirEntry {
        START = start,
        END = end,
        BIAS = bias,
        KEYS = keys,
        RULES = rules,
        ROWS = rows,
    });
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
pub const RECORD_HEADER: u64 = record::FRAMES;
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

/// An allocator call's record (8-byte aligned), followed by its frames.
#[repr(C)]
pub struct Record {
    /// A [`RecordHead`], packed.
    pub head: u64,
    pub seq: u64,
    pub tsc: u64,
    pub arg0: u64,
    pub arg1: u64,
    pub arg2: u64,
    pub ret: u64,
    /// posix_memalign: the block stored through its first argument.
    pub stored: u64,
}

/// A mapping call's record: its fourth argument where an allocator call's
/// record has `stored`, then the fifth and sixth, then the frames.
#[repr(C)]
pub struct MapRecord {
    pub head: u64,
    pub seq: u64,
    pub tsc: u64,
    pub arg0: u64,
    pub arg1: u64,
    pub arg2: u64,
    pub ret: u64,
    pub arg3: u64,
    pub arg4: u64,
    pub arg5: u64,
}

/// Offsets of the fields of a [`Record`] and a [`MapRecord`], and the
/// record's flags.
pub mod record {
    use super::{MapRecord, Record};

    offsets!(Record {
        HEAD = head,
        SEQ = seq,
        TSC = tsc,
        ARG0 = arg0,
        ARG1 = arg1,
        ARG2 = arg2,
        RET = ret,
        STORED = stored,
    });
    offsets!(MapRecord {
        ARG3 = arg3,
        ARG4 = arg4,
        ARG5 = arg5,
    });
    /// Where an allocator call's frames start.
    pub const FRAMES: u64 = size_of::<Record>() as u64;
    /// Where a mapping call's frames start.
    pub const MAP_FRAMES: u64 = size_of::<MapRecord>() as u64;
    /// The op code of a mapping call's record: this + its `MapOp` index.
    pub const MAP_OPS: u8 = 0x40;

    /// Flag: the stack ended where no unwind rule covered an address (or
    /// outside the thread's stack): it may be incomplete.
    pub const TRUNCATED: u8 = 1;
    /// Flag: `--max-depth` frames were taken.
    pub const FULL: u8 = 2;
}

/// A record's header word ([`Record::head`]), the one format both sides
/// share: the probe packs it (`code::finish_record`, with these shifts
/// and, for its constant part, [`RecordHead::pack`]) and memptrace unpacks
/// it with [`RecordHead::unpack`] before it checks it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordHead {
    /// Bytes of the record, its frames included.
    pub size: u16,
    pub frames: u16,
    /// [`record::TRUNCATED`], [`record::FULL`].
    pub flags: u8,
    /// `Op as u8`; a mapping call's: [`record::MAP_OPS`] + its index in
    /// `MapOp::ALL` (see [`Called::code`]).
    pub op: u8,
    /// The probe's number in its space.
    pub probe: u16,
}

impl RecordHead {
    pub const SIZE_SHIFT: u32 = 0;
    pub const FRAMES_SHIFT: u32 = 16;
    pub const FLAGS_SHIFT: u32 = 32;
    pub const OP_SHIFT: u32 = 40;
    pub const PROBE_SHIFT: u32 = 48;

    pub fn pack(self) -> u64 {
        u64::from(self.size) << Self::SIZE_SHIFT
            | u64::from(self.frames) << Self::FRAMES_SHIFT
            | u64::from(self.flags) << Self::FLAGS_SHIFT
            | u64::from(self.op) << Self::OP_SHIFT
            | u64::from(self.probe) << Self::PROBE_SHIFT
    }

    /// Every word is some header: whether its fields make sense is for the
    /// reader to check (`decode::decode_header`).
    pub fn unpack(word: u64) -> RecordHead {
        RecordHead {
            size: (word >> Self::SIZE_SHIFT) as u16,
            frames: (word >> Self::FRAMES_SHIFT) as u16,
            flags: (word >> Self::FLAGS_SHIFT) as u8,
            op: (word >> Self::OP_SHIFT) as u8,
            probe: (word >> Self::PROBE_SHIFT) as u16,
        }
    }
}

/// How a slot's [`Slot::pending_frames`] holds a call's frame count (low
/// 16 bits) and its record's flags (from this bit on), between the walk
/// and the record.
pub const PENDING_FLAGS_SHIFT: u32 = 16;

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
    fn the_structs_keep_the_offsets_the_probes_were_built_on() {
        // The header's groups each on a cache line of their own.
        let header = [
            (MAGIC, 0),
            (SEQ, 64),
            (DIRECTORY, 128),
            (WAIT_TIMESPEC, 192),
            (TRACER_PID, 256),
            (TRACER_TID, 264),
            (NO_WAKE, 384),
            (ALIVE_TSC, 512),
            (ALIVE_TICKS, 520),
            (GONE, 528),
            (LET_THROUGH, 576),
            (ALIVE_WORD, 640),
            (HEADER_SIZE, 4096),
        ];
        for (offset, expected) in header {
            assert_eq!(offset, expected);
        }
        // memptrace's tail on a line of its own, away from the thread's
        // fields.
        assert_eq!(SLOT_SIZE, 256);
        assert_eq!(slot::TAIL, 192);
        let threads = [
            slot::BUSY,
            slot::PENDING_SP,
            slot::ARG0,
            slot::ARG1,
            slot::ARG2,
            slot::PENDING_FRAMES,
            slot::NESTED,
            slot::ABANDONED,
            slot::HEAD,
            slot::WAITING,
            slot::WAITS,
            slot::CACHE_DIR,
            slot::ARG3,
            slot::ARG4,
            slot::ARG5,
        ];
        assert!(threads.iter().all(|&f| (64..192).contains(&f)));
        const { assert!(slot::CACHE < 64 && slot::RING < 64 && slot::KEY == 0) };
        assert_eq!((DIR_ENTRY_SIZE, dir::ROWS), (48, 40));
        // A mapping call's record is an allocator call's with its fourth
        // argument where the stored block goes.
        assert_eq!(record::ARG3, record::STORED);
        assert_eq!((record::FRAMES, record::MAP_FRAMES), (64, 80));
        assert_eq!(MAP_RECORD_HEADER, 80);
    }

    #[test]
    fn a_record_head_packs_and_unpacks() {
        let head = RecordHead {
            size: 0x1234,
            frames: 0xfedc,
            flags: record::TRUNCATED | record::FULL,
            op: record::MAP_OPS + 3,
            probe: 0xabcd,
        };
        let word = head.pack();
        assert_eq!(word, 0xabcd_4303_fedc_1234);
        assert_eq!(RecordHead::unpack(word), head);
        for word in [0, u64::MAX, 0x8000_0000_0000_0001] {
            assert_eq!(RecordHead::unpack(word).pack(), word);
        }
    }

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
