//! The walk itself (glibc `malloc/malloc.c`, `malloc/arena.c`): copy an
//! arena while its mutex is free, walk its chunks from the first to `top`,
//! then its fastbins and bins on the copy; after every arena, the tcaches
//! and the mmapped blocks.
//!
//! A chunk is 16-byte aligned: `prev_size`, then `size` whose low bits are
//! PREV_INUSE (the chunk before is in use), IS_MMAPPED and NON_MAIN_ARENA.
//! Whether a chunk is free is said by the next chunk's PREV_INUSE bit.
//!
//! Every word read is the target's, and the target may be corrupt or
//! hostile: sums of addresses and sizes are checked, every list is walked
//! at most once per element (a cycle is an error, never an endless loop),
//! and a length is only ever allocated for as far as the memory it names
//! can be read. A bad value fails its arena, with the reason; the walk
//! goes on with the next one. It never panics on what it reads.

use std::collections::HashSet;

use super::frozen::Buffers;
use super::{Arena, Chunk, ChunkState, Glibc, HeapMap, HeapRange};
use crate::memory::{Memory, Snapshot};
use crate::os::procfs::Mapping;

pub(super) const PREV_INUSE: u64 = 1;
pub(super) const IS_MMAPPED: u64 = 2;
pub(super) const SIZE_BITS: u64 = 7;
pub(super) const MINSIZE: u64 = 32;
pub(super) const PAGE: u64 = 4096;
/// Most arenas followed on the `next` list (glibc allows 8 per core).
const MAX_ARENAS: usize = 4096;
/// The heap is copied this many bytes at a time, so that a length read
/// from the target is allocated only as far as it can be read.
const PIECE: u64 = 16 << 20;

pub(super) type Walked<T> = Result<T, String>;

/// Chunks by address: sorted pairs looked up by binary search, cheaper to
/// build than a hash map for the 200 k chunks of a large heap, which is
/// read while the program waits.
pub(super) struct ChunkIndex<T>(Vec<(u64, T)>);

impl<T: std::marker::Copy> ChunkIndex<T> {
    pub(super) fn new(mut pairs: Vec<(u64, T)>) -> ChunkIndex<T> {
        // Already in address order within each heap: a few runs to merge.
        pairs.sort_by_key(|&(addr, _)| addr);
        ChunkIndex(pairs)
    }

    pub(super) fn get(&self, addr: u64) -> Option<T> {
        let i = self.0.binary_search_by_key(&addr, |&(a, _)| a).ok()?;
        Some(self.0[i].1)
    }
}

fn word(mem: &dyn Memory, addr: u64) -> Walked<u64> {
    mem.read_u64(addr)
        .map_err(|e| format!("cannot read {addr:#x}: {e}"))
}

/// `a + b`: an address or size from the target that would wrap is an error.
pub(super) fn add(a: u64, b: u64) -> Walked<u64> {
    a.checked_add(b)
        .ok_or_else(|| format!("{a:#x} + {b:#x} overflows"))
}

/// `x` rounded up to 16; `None` past the end of the address space.
pub(super) fn align16(x: u64) -> Option<u64> {
    Some(x.checked_add(15)? & !15)
}

fn aligned16(x: u64) -> Walked<u64> {
    align16(x).ok_or_else(|| format!("{x:#x} overflows when aligned"))
}

/// glibc's `REVEAL_PTR`: a free-list link stored at `at`, unmangled.
pub(super) fn reveal(at: u64, stored: u64, safe_linking: bool) -> u64 {
    if safe_linking {
        (at >> 12) ^ stored
    } else {
        stored
    }
}

/// The fields of `malloc_state` the walk needs.
pub(super) struct State {
    mutex: u32,
    top: u64,
    pub(super) next: u64,
    pub(super) system_mem: u64,
}

pub(super) fn state(mem: &dyn Memory, g: &Glibc, arena: u64) -> Walked<State> {
    let l = &g.layout;
    Ok(State {
        mutex: word(mem, arena)? as u32,
        top: word(mem, add(arena, l.top)?)?,
        next: word(mem, add(arena, l.next)?)?,
        system_mem: word(mem, add(arena, l.system_mem)?)?,
    })
}

/// An arena copied: its `malloc_state` and its heaps, and whether its mutex
/// was held.
#[derive(PartialEq)]
pub(super) struct Copy {
    pub(super) mem: Snapshot,
    pub(super) heaps: Vec<HeapRange>,
    pub(super) locked: bool,
    pub(super) next: u64,
}

/// The bytes from `start` to `end`, read [`PIECE`] at a time: a length
/// the target made up fails at its first unmapped piece instead of being
/// allocated whole.
fn read_range(mem: &dyn Memory, start: u64, end: u64, buffers: &mut Buffers) -> Walked<Vec<u8>> {
    let len = end
        .checked_sub(start)
        .ok_or_else(|| format!("the range {start:#x}..{end:#x} ends before it starts"))?;
    // The main arena's range was checked against the mappings, a thread
    // arena's is at most HEAP_MAX: the length can be reserved at once,
    // sparing a reallocation and copy per piece (or taken from memory
    // faulted in before the program was stopped).
    let mut bytes = buffers.take(len as usize);
    let mut done = 0;
    while done < len {
        let n = (len - done).min(PIECE);
        let old = bytes.len();
        bytes.resize(old + n as usize, 0);
        let at = start + done;
        mem.read_exact(at, &mut bytes[old..])
            .map_err(|e| format!("cannot read the heap at {at:#x}: {e}"))?;
        done += n;
    }
    Ok(bytes)
}

/// True when the mappings `maps` (in address order) cover `start..end`
/// without a hole.
fn covered(maps: &[Mapping], start: u64, end: u64) -> bool {
    let mut at = start;
    for m in maps {
        if at >= end {
            break;
        }
        if m.start <= at && at < m.end {
            at = m.end;
        }
    }
    at >= end
}

/// Copy arena `arena`: its state, then the memory its chunks are in.
/// `maps`: the process's mappings, which the main arena's heap must lie in
/// (its `system_mem` is a length the target states, and what the walk
/// allocates for its pages follows it).
pub(super) fn copy(
    mem: &dyn Memory,
    g: &Glibc,
    maps: &[Mapping],
    arena: u64,
    main: bool,
    sbrk_base: u64,
    buffers: &mut Buffers,
) -> Walked<Copy> {
    let l = &g.layout;
    let before = state(mem, g, arena)?;
    let mut snap = Snapshot::new();
    let mut heaps = Vec::new();
    // The top chunk's body is never read, and is often most of the heap
    // (16 of 21 MiB in a Python at its exit): copy up to its header only.
    let used_end = |start: u64, end: u64| match before.top {
        top if top >= start && top < end => top.saturating_add(16).min(end),
        _ => end,
    };
    if main {
        snap = snap.with_owned(
            arena,
            read_range(mem, arena, add(arena, l.state_size)?, buffers)?,
        );
        if before.system_mem > 0 {
            let end = add(sbrk_base, before.system_mem)?;
            if !covered(maps, sbrk_base, end) {
                return Err(format!(
                    "its heap {sbrk_base:#x}..{end:#x} (system_mem) is not all mapped"
                ));
            }
            let used = used_end(sbrk_base, end);
            snap = snap.with_owned(sbrk_base, read_range(mem, sbrk_base, used, buffers)?);
            heaps.push(HeapRange {
                start: sbrk_base,
                end,
            });
        }
    } else {
        // The newest heap holds top; each heap_info names the one before
        // (`heap_info`: ar_ptr, prev, size, ...).
        let mask = !(l.heap_max.max(PAGE) - 1);
        let mut h = before.top & mask;
        let mut seen = HashSet::new();
        while h != 0 {
            let ar_ptr = word(mem, h)?;
            let prev = word(mem, add(h, 8)?)?;
            let size = word(mem, add(h, 16)?)?;
            if ar_ptr != arena
                || size == 0
                || size > l.heap_max
                || size % PAGE != 0
                || h & !mask != 0
            {
                return Err(format!(
                    "heap {h:#x} is not one of this arena's (arena {ar_ptr:#x}, size {size:#x})"
                ));
            }
            if !seen.insert(h) || heaps.len() > (1 << 16) {
                return Err(format!("the list of heaps does not end (at {h:#x})"));
            }
            let end = add(h, size)?;
            snap = snap.with_owned(h, read_range(mem, h, used_end(h, end), buffers)?);
            heaps.push(HeapRange { start: h, end });
            h = prev;
        }
        heaps.reverse();
    }
    let after = word(mem, arena)? as u32;
    Ok(Copy {
        mem: snap,
        heaps,
        locked: before.mutex != 0 || after != 0,
        next: before.next,
    })
}

/// Walk one arena on its copy.
pub(super) fn walk(g: &Glibc, arena: u64, main: bool, c: &Copy) -> Walked<Arena> {
    let mem: &dyn Memory = &c.mem;
    let l = &g.layout;
    let st = state(mem, g, arena)?;
    let mut a = Arena {
        addr: arena,
        main,
        heaps: c.heaps.clone(),
        system_mem: st.system_mem,
        locked: c.locked,
        ..Arena::default()
    };
    if main && st.system_mem == 0 {
        return Ok(a);
    }
    if main && !c.heaps.iter().any(|h| st.top >= h.start && st.top < h.end) {
        return Err(format!(
            "top {:#x} is outside the brk area: a main arena that is not contiguous is not supported",
            st.top
        ));
    }
    let system = c
        .heaps
        .iter()
        .try_fold(0u64, |sum, h| sum.checked_add(h.end.checked_sub(h.start)?));
    if system != Some(st.system_mem) {
        let system = system.map_or("too many".to_string(), |s| s.to_string());
        return Err(format!(
            "its heaps hold {system} bytes, its system_mem says {}",
            st.system_mem
        ));
    }
    // Where a thread arena's heap_info ends: the arena follows it in its
    // first heap.
    let heap_info = arena & (l.heap_max.max(PAGE) - 1);
    for (i, h) in c.heaps.iter().enumerate() {
        let last = i + 1 == c.heaps.len();
        let start = if main {
            aligned16(h.start)?
        } else if i == 0 {
            aligned16(add(arena, l.state_size)?)?
        } else {
            aligned16(add(h.start, heap_info)?)?
        };
        walk_heap(mem, &mut a, start, h.end, last.then_some(st.top))?;
    }
    let index = ChunkIndex::new(
        a.chunks
            .iter()
            .enumerate()
            .map(|(i, c)| (c.addr, i))
            .collect(),
    );
    fastbins(mem, g, &mut a, &index)?;
    bins(mem, g, &mut a, &index)?;
    Ok(a)
}

/// The chunks from `start` to `end`; in the newest heap the chain ends at
/// `top`, which must end the heap; in older ones at a zero-sized fencepost.
fn walk_heap(
    mem: &dyn Memory,
    a: &mut Arena,
    start: u64,
    end: u64,
    top: Option<u64>,
) -> Walked<()> {
    // Each turn moves `p` up by at least 16 bytes, and `p` never passes
    // `end`: the loop ends.
    let mut p = start;
    loop {
        if Some(p) == top {
            let size = word(mem, add(p, 8)?)? & !SIZE_BITS;
            if p.checked_add(size) != Some(end) {
                return Err(format!(
                    "top {p:#x} ({size} bytes) does not end its heap at {end:#x}"
                ));
            }
            a.top_size = size;
            a.chunks.push(Chunk {
                addr: p,
                size,
                state: ChunkState::Top,
            });
            return Ok(());
        }
        if p.checked_add(16).is_none_or(|header_end| header_end > end) {
            return Err(match top {
                Some(top) => format!("the chunks end at {p:#x} without reaching top {top:#x}"),
                None => format!("the chunks of heap ending at {end:#x} run past it"),
            });
        }
        let size = word(mem, p + 8)? & !SIZE_BITS;
        if top.is_none() && size == 0 {
            return Ok(());
        }
        if top.is_none() && size == 16 {
            a.chunks.push(Chunk {
                addr: p,
                size,
                state: ChunkState::Fencepost,
            });
            p += 16;
            continue;
        }
        let next = p
            .checked_add(size)
            .filter(|next| next.checked_add(16).is_some_and(|n| n <= end));
        let Some(next) = next.filter(|_| size >= MINSIZE && size % 16 == 0) else {
            return Err(format!("chunk {p:#x} has a bad size {size:#x}"));
        };
        let in_use = word(mem, next + 8)? & PREV_INUSE != 0;
        a.chunks.push(Chunk {
            addr: p,
            size,
            state: if in_use {
                ChunkState::InUse
            } else {
                ChunkState::Free
            },
        });
        p = next;
    }
}

/// The fastbins: singly linked through `fd`, mangled since 2.32.
fn fastbins(mem: &dyn Memory, g: &Glibc, a: &mut Arena, index: &ChunkIndex<usize>) -> Walked<()> {
    let l = &g.layout;
    let tries: &[bool] = match l.safe_linking {
        Some(true) => &[true],
        Some(false) => &[false],
        None => &[true, false],
    };
    let mut last_err = String::new();
    for &safe in tries {
        let mut found = Vec::new();
        let mut taken = vec![false; a.chunks.len()];
        let walked = (|| -> Walked<()> {
            for bin in 0..l.nfastbins as u64 {
                let mut p = word(mem, add(a.addr, add(l.fastbins, 8 * bin)?)?)?;
                // Each chunk is taken once: the list ends.
                while p != 0 {
                    let i = index
                        .get(p)
                        .ok_or_else(|| format!("fastbin {bin}: {p:#x} is no chunk"))?;
                    let c = a.chunks[i];
                    if c.state != ChunkState::InUse
                        || (c.size >> 4).checked_sub(2) != Some(bin)
                        || taken[i]
                    {
                        return Err(format!("fastbin {bin}: chunk {p:#x} does not belong"));
                    }
                    taken[i] = true;
                    found.push(i);
                    let link = add(p, 16)?;
                    p = reveal(link, word(mem, link)?, safe);
                }
            }
            Ok(())
        })();
        match walked {
            Ok(()) => {
                for i in found {
                    a.chunks[i].state = ChunkState::Fastbin;
                    a.fast_blocks += 1;
                    a.fast_bytes += a.chunks[i].size;
                }
                return Ok(());
            }
            Err(e) => last_err = e,
        }
    }
    Err(last_err)
}

/// The regular bins: doubly linked lists through `fd`/`bk` whose heads are
/// in `bins` (`bin_at`: a fake chunk 16 bytes before each pair).
fn bins(mem: &dyn Memory, g: &Glibc, a: &mut Arena, index: &ChunkIndex<usize>) -> Walked<()> {
    let l = &g.layout;
    let mut binned = vec![false; a.chunks.len()];
    for bin in 1..l.nbins as u64 {
        let head = add(a.addr, l.bins)?
            .checked_sub(16)
            .and_then(|h| h.checked_add((bin - 1) * 16))
            .ok_or_else(|| format!("bin {bin} of arena {:#x} is outside memory", a.addr))?;
        let mut p = word(mem, add(head, 24)?)?;
        // Each chunk is binned once: the list ends.
        while p != head {
            let i = index
                .get(p)
                .ok_or_else(|| format!("bin {bin}: {p:#x} is no chunk"))?;
            if a.chunks[i].state != ChunkState::Free || binned[i] {
                return Err(format!("bin {bin}: chunk {p:#x} is not a free chunk"));
            }
            binned[i] = true;
            a.bin_blocks += 1;
            a.bin_bytes = add(a.bin_bytes, a.chunks[i].size)?;
            p = word(mem, add(p, 24)?)?;
        }
    }
    let free = a
        .chunks
        .iter()
        .filter(|c| c.state == ChunkState::Free)
        .count() as u64;
    if free != a.bin_blocks {
        return Err(format!(
            "{free} free chunks, {} of them in the bins",
            a.bin_blocks
        ));
    }
    Ok(())
}

/// A map begun from glibc's `mp_` (the mmapped blocks' count and bytes)
/// and `narenas`; and where the brk heap starts (`sbrk_base`). When `mp_`
/// cannot be read: the map, its main arena failed, and no `sbrk_base`.
pub(super) fn begin(mem: &dyn Memory, g: &Glibc) -> (HeapMap, Option<u64>) {
    let l = &g.layout;
    let mut map = HeapMap::default();
    let mp = |off: u64| word(mem, g.mp + off);
    let (sbrk_base, n_mmaps, mmapped_mem) =
        match (mp(l.sbrk_base), mp(l.n_mmaps), mp(l.mmapped_mem)) {
            (Ok(s), Ok(n), Ok(b)) => (s, n as u32 as u64, b),
            (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => {
                map.arenas.push(Arena {
                    addr: g.main_arena,
                    main: true,
                    error: Some(e),
                    ..Arena::default()
                });
                return (map, None);
            }
        };
    map.n_mmaps = n_mmaps;
    map.mmapped_mem = mmapped_mem;
    map.narenas = g.narenas.and_then(|at| word(mem, at).ok());
    (map, Some(sbrk_base))
}

/// Follow the arenas' `next` list from `main_arena`: `step` reads each
/// (its main flag given) and says which arena comes next, if it read that
/// far. Each arena is taken once and at most [`MAX_ARENAS`]: a list that
/// does not come back to `main_arena` ends in an arena with that error.
pub(super) fn each_arena<T>(
    g: &Glibc,
    mut step: impl FnMut(u64, bool) -> (T, Option<u64>),
) -> (Vec<T>, Option<Arena>) {
    let mut read = Vec::new();
    let mut arena = g.main_arena;
    let mut seen = HashSet::new();
    loop {
        seen.insert(arena);
        let (one, next) = step(arena, arena == g.main_arena);
        read.push(one);
        match next {
            Some(next) if next == g.main_arena || next == 0 => return (read, None),
            Some(next) if seen.contains(&next) || read.len() >= MAX_ARENAS => {
                let bad = Arena {
                    addr: next,
                    error: Some(format!(
                        "the list of arenas does not return to main_arena (at {next:#x})"
                    )),
                    ..Arena::default()
                };
                return (read, Some(bad));
            }
            Some(next) => arena = next,
            None => return (read, None),
        }
    }
}
