//! The walk itself (glibc `malloc/malloc.c`, `malloc/arena.c`): an
//! arena's chunks read from the first to `top` a window at a time
//! ([`super::chain`], while its mutex is free), then its fastbins and bins
//! on what that read kept; after every arena, the tcaches and the mmapped
//! blocks.
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

use super::chain::{Chain, field};
use super::{Arena, Chunk, ChunkState, Glibc, HeapMap};
use crate::memory::Memory;

pub(super) const PREV_INUSE: u64 = 1;
pub(super) const IS_MMAPPED: u64 = 2;
pub(super) const SIZE_BITS: u64 = 7;
pub(super) const MINSIZE: u64 = 32;
pub(super) const PAGE: u64 = 4096;
/// Most arenas followed on the `next` list (glibc allows 8 per core).
const MAX_ARENAS: usize = 4096;

pub(super) type Walked<T> = Result<T, String>;

/// Chunks found by address where they lie, with no index beside them: a
/// heap's chunks are read in address order (each one starts where the one
/// before ends), so each run of ascending chunks of an arena (a heap) is
/// searched by bisection, and the runs, a few per arena, by their first
/// chunk. An index of (address, chunk) pairs cost 16 bytes a chunk, twice
/// over (the bins', then the tcaches'): 41 MB each for the 2.6 M chunks of
/// a heap at exit.
pub(super) struct ChunkRuns {
    /// (first chunk's address, arena, first chunk, chunks), by address.
    runs: Vec<(u64, usize, usize, usize)>,
}

impl ChunkRuns {
    /// The runs of `arenas`, each arena's chunks in the order read.
    pub(super) fn new<'a>(arenas: impl IntoIterator<Item = &'a [Chunk]>) -> ChunkRuns {
        let mut runs = Vec::new();
        for (ai, chunks) in arenas.into_iter().enumerate() {
            let mut first = 0;
            for i in 1..=chunks.len() {
                if i == chunks.len() || chunks[i].addr <= chunks[i - 1].addr {
                    runs.push((chunks[first].addr, ai, first, i - first));
                    first = i;
                }
            }
        }
        runs.sort_unstable_by_key(|&(addr, ..)| addr);
        ChunkRuns { runs }
    }

    /// The chunk at `addr`, as (arena, chunk), in `arenas` (those it was
    /// made of). Runs overlap only in a heap that lies (a thread arena's
    /// heap inside the brk area): then a chunk of the one starting last
    /// below `addr` is found, or none.
    pub(super) fn get(&self, arenas: &[&[Chunk]], addr: u64) -> Option<(usize, usize)> {
        let r = self.runs.partition_point(|&(start, ..)| start <= addr);
        let &(_, ai, first, len) = self.runs.get(r.checked_sub(1)?)?;
        let run = arenas.get(ai)?.get(first..first.checked_add(len)?)?;
        let i = run.binary_search_by_key(&addr, |c| c.addr).ok()?;
        Some((ai, first + i))
    }
}

pub(super) fn word(mem: &dyn Memory, addr: u64) -> Walked<u64> {
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

pub(super) fn aligned16(x: u64) -> Walked<u64> {
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

/// The second half of the walk, on what [`super::chain::read_chain`]
/// kept (no process needed): the fastbins and the bins of `chain`'s arena,
/// each list checked against its chunks.
pub(super) fn finish(g: &Glibc, chain: &mut Chain) -> Walked<()> {
    let runs = ChunkRuns::new([chain.arena.chunks.as_slice()]);
    let Chain {
        arena,
        state,
        links,
        ..
    } = chain;
    fastbins(state, &links.words, g, arena, &runs)?;
    bins(state, &links.words, g, arena, &runs)
}

/// The link word kept for chunk `i` (one per chunk).
fn link(links: &[u64], i: usize) -> Walked<u64> {
    links
        .get(i)
        .copied()
        .ok_or_else(|| format!("no link word for chunk {i}"))
}

/// The fastbins: singly linked through `fd`, mangled since 2.32.
fn fastbins(state: &[u8], links: &[u64], g: &Glibc, a: &mut Arena, runs: &ChunkRuns) -> Walked<()> {
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
                let mut p = field(state, add(l.fastbins, 8 * bin)?)?;
                // Each chunk is taken once: the list ends.
                while p != 0 {
                    let (_, i) = runs
                        .get(&[&a.chunks], p)
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
                    // An in-use chunk of a fastbin's size: its `fd` kept.
                    p = reveal(add(p, 16)?, link(links, i)?, safe);
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
fn bins(state: &[u8], links: &[u64], g: &Glibc, a: &mut Arena, runs: &ChunkRuns) -> Walked<()> {
    let l = &g.layout;
    let mut binned = vec![false; a.chunks.len()];
    for bin in 1..l.nbins as u64 {
        let head = add(a.addr, l.bins)?
            .checked_sub(16)
            .and_then(|h| h.checked_add((bin - 1) * 16))
            .ok_or_else(|| format!("bin {bin} of arena {:#x} is outside memory", a.addr))?;
        // The bin's `bk`, in malloc_state.
        let mut p = field(state, add(l.bins, (bin - 1) * 16 + 8)?)?;
        // Each chunk is binned once: the list ends.
        while p != head {
            let (_, i) = runs
                .get(&[&a.chunks], p)
                .ok_or_else(|| format!("bin {bin}: {p:#x} is no chunk"))?;
            if a.chunks[i].state != ChunkState::Free || binned[i] {
                return Err(format!("bin {bin}: chunk {p:#x} is not a free chunk"));
            }
            binned[i] = true;
            a.bin_blocks += 1;
            a.bin_bytes = add(a.bin_bytes, a.chunks[i].size)?;
            // A free chunk: its `bk` kept.
            p = link(links, i)?;
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
