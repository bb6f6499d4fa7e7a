//! A map of glibc's heap, read from outside the process: every arena (the
//! main one and the thread arenas on its `next` list) with its heaps, each
//! chunk classified, the bins, fastbins and tcaches, the blocks glibc mapped
//! on their own (`IS_MMAPPED`), and which pages are resident.
//!
//! Everything is read through [`Memory`], so the walk is tested on byte
//! buffers. Nothing is guessed: every read is checked (chunk sizes sane, the
//! chain of chunks ends exactly at `top`, every free chunk is in a bin and
//! every binned chunk is free, fastbin and tcache chunks have the size of
//! their bin, tcache counts equal the lists). An arena that fails is kept
//! with its reason and no chunks: nothing wrong is drawn or counted.
//!
//! The heap is read a window of a few MiB at a time (`heap::chain`): what
//! memptrace holds for a map is the window, the chunks and a word per
//! chunk, whatever the heap's size.
//!
//! A running process changes its heap while it is read. Each arena's
//! chunks are read while its mutex is free (looked at before and after),
//! then its lists walked on what was read; a read that is locked or fails
//! its checks is made again, up to `attempts` times 2 ms apart. Arenas are
//! read one after the other, milliseconds apart: a live map is not one
//! instant.

mod chain;
mod dwarf;
mod frozen;
mod glibc;
mod live;
mod mmapped;
mod tcache;
#[cfg(test)]
mod tests;
mod walk;

use std::io;
use std::path::PathBuf;

use serde::Serialize;

pub use frozen::Buffers;
pub use glibc::{Facts, Glibc, Layout, TCACHE_BINS, is_c_library};

use crate::memory::Memory;
use crate::os::procfs::{self, Mapping};
use crate::symbols::symbolize::DEFAULT_DEBUG_ROOT;

/// Why a heap could not be mapped at all.
#[derive(Debug, thiserror::Error)]
pub enum HeapError {
    #[error("no process {0} (it may have exited; see `ps`)")]
    NoSuchProcess(i32),
    #[error(
        "cannot read the memory of process {pid} (heap maps need ptrace rights over it: run as its owner or as root)"
    )]
    Denied { pid: i32, source: io::Error },
    #[error(
        "the process uses musl's allocator: heap maps read glibc's malloc only (not supported)"
    )]
    Musl,
    #[error(
        "no glibc allocator with symbols found (a stripped static binary, or another allocator): heap maps are not supported here"
    )]
    NotGlibc,
    #[error(
        "{0}: glibc without the symbols main_arena and mp_; install its debug file (Debian: libc6-dbg)"
    )]
    NoSymbols(String),
    #[error(
        "unknown glibc layout (main_arena is {arena_size} bytes, mp_ {mp_size}): heap maps know glibc 2.27 and later on x86-64"
    )]
    Layout { arena_size: u64, mp_size: u64 },
}

/// What a chunk is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChunkState {
    /// Held by the program.
    InUse,
    /// In a bin (unsorted, small or large).
    Free,
    /// Freed into a fastbin (glibc counts it as in use in its arena).
    Fastbin,
    /// Freed into a thread's tcache (in use, for its arena).
    Tcache,
    /// A thread's `tcache_perthread_struct`: the allocator's own block.
    TcacheStruct,
    Top,
    /// The marker at the end of a thread arena's older heap.
    Fencepost,
    /// A block glibc mapped on its own.
    Mmapped,
}

impl ChunkState {
    /// As stored in `heap_chunks.state`.
    pub fn name(self) -> &'static str {
        match self {
            ChunkState::InUse => "in use",
            ChunkState::Free => "free",
            ChunkState::Fastbin => "fastbin",
            ChunkState::Tcache => "tcache",
            ChunkState::TcacheStruct => "tcache struct",
            ChunkState::Top => "top",
            ChunkState::Fencepost => "fencepost",
            ChunkState::Mmapped => "mmapped",
        }
    }

    /// Cached by the allocator for reuse: counted in use by glibc, free for
    /// the program.
    pub fn cached(self) -> bool {
        matches!(self, ChunkState::Fastbin | ChunkState::Tcache)
    }
}

/// One chunk: its header's address and its size (flags masked off).
/// Packed: 17 bytes, not 24, for each of the millions of chunks a map of a
/// large heap holds while it is walked (its fields are read by copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[repr(C, packed)]
pub struct Chunk {
    pub addr: u64,
    pub size: u64,
    pub state: ChunkState,
}

/// A range of memory an arena carves chunks from: the main arena's brk
/// area, or one heap of a thread arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HeapRange {
    pub start: u64,
    pub end: u64,
}

/// One arena as read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Arena {
    pub addr: u64,
    pub main: bool,
    pub heaps: Vec<HeapRange>,
    pub system_mem: u64,
    pub top_size: u64,
    /// In address order, heaps one after the other.
    pub chunks: Vec<Chunk>,
    /// Chunks and bytes in the regular bins (unsorted, small, large).
    pub bin_blocks: u64,
    pub bin_bytes: u64,
    pub fast_blocks: u64,
    pub fast_bytes: u64,
    /// Its mutex was never seen free (a call in flight inside the allocator).
    pub locked: bool,
    /// Read live, it failed its checks differently at each attempt: threads
    /// were changing it (a busy arena), which proves no damage.
    pub changing: bool,
    /// Why it was not read; then it has no chunks and counts nowhere.
    pub error: Option<String>,
    /// Resident bytes of its heaps; `None` when residency is unknown.
    pub resident: Option<u64>,
}

/// The numbers of one arena, as `heapmap` shows them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ArenaSummary {
    pub heaps: u64,
    pub system: u64,
    /// Bytes of chunks the program holds (the tcache structures included).
    pub in_use: u64,
    /// Bytes of chunks in the bins.
    pub free: u64,
    pub top: u64,
    pub largest_free: u64,
    /// 1 - largest free / free: 0 when the free bytes are one chunk.
    pub fragmentation: f64,
    /// Chunks the program holds.
    pub blocks: u64,
    /// Bytes in tcaches and fastbins.
    pub cached: u64,
    pub resident: Option<u64>,
}

impl Arena {
    pub fn summary(&self) -> ArenaSummary {
        let mut s = ArenaSummary {
            heaps: self.heaps.len() as u64,
            system: self.system_mem,
            top: self.top_size,
            resident: self.resident,
            ..ArenaSummary::default()
        };
        for c in &self.chunks {
            match c.state {
                ChunkState::InUse => {
                    s.in_use += c.size;
                    s.blocks += 1;
                }
                ChunkState::TcacheStruct => s.in_use += c.size,
                ChunkState::Free => {
                    s.free += c.size;
                    s.largest_free = s.largest_free.max(c.size);
                }
                ChunkState::Fastbin | ChunkState::Tcache => s.cached += c.size,
                ChunkState::Top | ChunkState::Fencepost | ChunkState::Mmapped => {}
            }
        }
        if s.free > 0 {
            s.fragmentation = 1.0 - s.largest_free as f64 / s.free as f64;
        }
        s
    }
}

/// What a page of the heap holds, by most of its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PageState {
    InUse,
    Free,
    Top,
    Mmapped,
}

impl PageState {
    /// As stored in `heap_pages.state`.
    pub fn name(self) -> &'static str {
        match self {
            PageState::InUse => "in use",
            PageState::Free => "free",
            PageState::Top => "top",
            PageState::Mmapped => "mmapped",
        }
    }
}

/// Consecutive pages alike: same state, same residency.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PageRun {
    pub addr: u64,
    pub pages: u64,
    pub state: PageState,
    pub resident: Option<bool>,
}

/// A block the program holds: the pointer malloc returned and
/// `malloc_usable_size` of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct LiveBlock {
    pub addr: u64,
    pub usable: u64,
}

/// glibc's `struct mallinfo2`, as `mallinfo2()` computes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MallInfo {
    pub arena: u64,
    pub ordblks: u64,
    pub smblks: u64,
    pub hblks: u64,
    pub hblkhd: u64,
    pub usmblks: u64,
    pub fsmblks: u64,
    pub uordblks: u64,
    pub fordblks: u64,
    pub keepcost: u64,
}

/// A whole heap, as read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HeapMap {
    pub arenas: Vec<Arena>,
    /// The blocks glibc mapped on their own.
    pub mmapped: Vec<Chunk>,
    /// glibc's own count and bytes of them (`mp_.n_mmaps`, `mp_.mmapped_mem`).
    pub n_mmaps: u64,
    pub mmapped_mem: u64,
    /// Why the mmapped blocks found do not match glibc's count.
    pub mmapped_error: Option<String>,
    /// glibc's count of arenas (`narenas`): more than were found on the
    /// list while a thread is making one.
    pub narenas: Option<u64>,
    pub pages: Vec<PageRun>,
}

impl HeapMap {
    /// Every block the program holds, in address order: in-use chunks of
    /// the arenas read, and the mmapped blocks.
    pub fn live_blocks(&self) -> Vec<LiveBlock> {
        let mut blocks: Vec<LiveBlock> = self
            .arenas
            .iter()
            .flat_map(|a| &a.chunks)
            .filter(|c| c.state == ChunkState::InUse)
            // The next chunk's prev_size field is the block's too.
            .map(|c| LiveBlock {
                addr: c.addr + 16,
                usable: c.size - 8,
            })
            .chain(
                (self.mmapped_error.is_none())
                    .then_some(&self.mmapped)
                    .into_iter()
                    .flatten()
                    .map(|c| LiveBlock {
                        addr: c.addr + 16,
                        usable: c.size - 16,
                    }),
            )
            .collect();
        blocks.sort_unstable();
        blocks
    }

    /// `mallinfo2()` as glibc's `int_mallinfo` adds it up over the arenas
    /// read (malloc.c): the top chunk and every binned chunk are free, the
    /// rest of `system_mem` in use; fastbin chunks count as free there.
    pub fn mallinfo(&self) -> MallInfo {
        let mut m = MallInfo {
            hblks: self.n_mmaps,
            hblkhd: self.mmapped_mem,
            ..MallInfo::default()
        };
        for a in self.arenas.iter().filter(|a| a.error.is_none()) {
            let avail = a.top_size + a.fast_bytes + a.bin_bytes;
            m.smblks += a.fast_blocks;
            m.ordblks += 1 + a.bin_blocks;
            m.fordblks += avail;
            m.uordblks += a.system_mem.saturating_sub(avail);
            m.arena += a.system_mem;
            m.fsmblks += a.fast_bytes;
            if a.main {
                m.keepcost = a.top_size;
            }
        }
        m
    }

    /// True when every arena and the mmapped blocks were read, and no
    /// arena was being made.
    pub fn complete(&self) -> bool {
        self.mmapped_error.is_none()
            && self.arenas.iter().all(|a| a.error.is_none())
            && self.narenas.is_none_or(|n| n <= self.arenas.len() as u64)
    }
}

/// Which pages are in memory.
pub trait Residency {
    /// For `pages` pages from `start`: resident or not; `None` when unknown.
    fn resident(&self, start: u64, pages: u64) -> Option<Vec<bool>>;
}

/// Residency unknown.
pub struct NoResidency;

impl Residency for NoResidency {
    fn resident(&self, _start: u64, _pages: u64) -> Option<Vec<bool>> {
        None
    }
}

/// /proc/PID/pagemap of a live process.
struct Pagemap(i32);

impl Residency for Pagemap {
    fn resident(&self, start: u64, pages: u64) -> Option<Vec<bool>> {
        procfs::resident_pages(self.0, start, pages).ok()
    }
}

/// Copies an arena is read from when a live process is not stopped.
pub const LIVE_ATTEMPTS: u32 = 100;

/// Map the heap of process `pid`. `stopped`: every thread is stopped (by
/// ptrace), so one read of each arena is the truth; otherwise arenas are
/// read again while they change.
pub fn read_process(pid: i32, stopped: bool, facts: &Facts) -> Result<HeapMap, HeapError> {
    if stopped {
        return copy_process(pid, Buffers::default(), facts).map(HeapCopy::walk);
    }
    let (mem, glibc, maps) = open_process(pid, facts)?;
    Ok(read_heap(&mem, &glibc, &maps, &Pagemap(pid), LIVE_ATTEMPTS))
}

/// The heap of a stopped process, read: its chunks and the words its
/// lists follow. [`HeapCopy::walk`] makes its map later, the process
/// running again (the read is what needs it stopped).
pub struct HeapCopy {
    pid: i32,
    frozen: frozen::Frozen,
}

impl HeapCopy {
    /// The map of the heap as it was copied; residency as it is now.
    pub fn walk(self) -> HeapMap {
        frozen::thaw(self.frozen, &Pagemap(self.pid))
    }
}

/// Read the heap of process `pid`, every thread of which is stopped (by
/// ptrace): each arena's chunks read once, a window at a time, through the
/// window in `buffers` ([`reserve_copy`]).
pub fn copy_process(pid: i32, buffers: Buffers, facts: &Facts) -> Result<HeapCopy, HeapError> {
    let (mem, glibc, maps) = open_process(pid, facts)?;
    Ok(HeapCopy {
        pid,
        frozen: frozen::freeze(&mem, &glibc, &maps, buffers),
    })
}

/// The window [`copy_process`] reads the heap of `pid` through, faulted
/// in while it still runs (none when its heap cannot be read).
pub fn reserve_copy(pid: i32, facts: &Facts) -> Buffers {
    match open_process(pid, facts) {
        Ok(_) => frozen::reserve(),
        Err(_) => Buffers::default(),
    }
}

/// The memory, glibc and mappings of process `pid`, once its memory is
/// known to be readable.
fn open_process(
    pid: i32,
    facts: &Facts,
) -> Result<(crate::os::mem::ProcessMemory, Glibc, Vec<Mapping>), HeapError> {
    let maps = procfs::read_maps(pid).map_err(|err| match err.error.kind() {
        io::ErrorKind::NotFound => HeapError::NoSuchProcess(pid),
        _ => HeapError::Denied {
            pid,
            source: err.error,
        },
    })?;
    let exe = procfs::exe(pid);
    let glibc = Glibc::find(
        &maps,
        exe.as_deref(),
        &[PathBuf::from(DEFAULT_DEBUG_ROOT)],
        facts,
    )?;
    let mem = crate::os::mem::ProcessMemory(pid);
    // One word of main_arena tells whether the memory can be read at all.
    mem.read_u64(glibc.main_arena)
        .map_err(|source| HeapError::Denied { pid, source })?;
    Ok((mem, glibc, maps))
}

/// Read ahead, while process `pid` still runs, what a map of its heap
/// will need from its C library or static executable (their symbols and
/// DWARF: over 100 ms on a loaded machine), so that the map taken while it
/// is stopped at attach does not wait for it. What they say is kept in
/// `facts`.
pub fn prepare_process(pid: i32, facts: &Facts) {
    let Ok(maps) = procfs::read_maps(pid) else {
        return;
    };
    let exe = procfs::exe(pid);
    let mut done: Vec<&str> = Vec::new();
    for m in maps.iter().filter(|m| m.is_file()) {
        let wanted = is_c_library(&m.path) || exe.as_deref() == Some(std::path::Path::new(&m.path));
        if wanted && !done.contains(&m.path.as_str()) {
            facts.prepare(std::path::Path::new(&m.path));
            done.push(&m.path);
        }
    }
}

/// Map the heap in `mem`, whose allocator `glibc` describes and whose
/// mappings are `maps` (for the mmapped blocks).
pub fn read_heap(
    mem: &dyn Memory,
    glibc: &Glibc,
    maps: &[Mapping],
    residency: &dyn Residency,
    attempts: u32,
) -> HeapMap {
    live::read_heap(mem, glibc, maps, residency, attempts.max(1))
}
