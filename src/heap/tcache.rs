//! The threads' tcaches, found among the in-use chunks of the arenas
//! walked: a candidate is taken only when every one of its lists reads
//! exactly as its counts say. Counts and links are the target's words: a
//! count is at most 65535, a chunk is taken at most once, so a list that
//! loops makes the candidate no tcache, in at most 64 x 65535 steps.
//!
//! It works on what the chains' reads kept ([`super::chain::Links`]): the
//! bytes of each candidate and each small chunk's link word.

use std::collections::HashSet;

use super::chain::{Links, tcache_count, tcache_entry};
use super::walk::{ChunkRuns, MINSIZE, reveal};
use super::{Arena, Chunk, ChunkState, Glibc, TCACHE_BINS};

/// Find each thread's `tcache_perthread_struct` (`uint16_t counts[64]`,
/// then `tcache_entry *entries[64]`; `char` counts before 2.30) among the
/// in-use chunks of its size kept in `links` (one per arena of `arenas`,
/// in order), and the chunks its lists hold. A candidate is taken only
/// when every list is exactly as long as its count and holds in-use chunks
/// of its bin's size; one with every list empty only when it is the first
/// chunk of its arena, where tcache_init puts it.
pub(super) fn tcaches(g: &Glibc, arenas: &mut [Arena], links: &[Links]) {
    let chunks: Vec<&[Chunk]> = arenas.iter().map(|a| a.chunks.as_slice()).collect();
    let runs = ChunkRuns::new(chunks.iter().copied());
    let safe_tries: &[bool] = match g.layout.safe_linking {
        Some(true) => &[true],
        Some(false) => &[false],
        None => &[true, false],
    };
    let mut found = Vec::new();
    for (ai, (a, kept)) in arenas.iter().zip(links).enumerate() {
        for (ci, bytes) in &kept.tcaches {
            let ci = *ci;
            let Some(c) = a.chunks.get(ci) else {
                continue;
            };
            if c.state != ChunkState::InUse {
                continue;
            }
            for &(size, count_bytes) in &g.layout.tcache {
                if c.size != size {
                    continue;
                }
                for &safe in safe_tries {
                    if let Some(entries) =
                        tcache_lists(bytes, count_bytes, safe, &runs, &chunks, links)
                    {
                        if !entries.is_empty() || ci == 0 {
                            found.push(((ai, ci), entries));
                        }
                        break;
                    }
                }
            }
        }
    }
    for ((ai, ci), entries) in found {
        arenas[ai].chunks[ci].state = ChunkState::TcacheStruct;
        for (ea, ec) in entries {
            arenas[ea].chunks[ec].state = ChunkState::Tcache;
        }
    }
}

/// The chunks in the lists of the tcache whose `counts` and `entries` are
/// `bytes`, if it is one.
fn tcache_lists(
    bytes: &[u8],
    count_bytes: u64,
    safe: bool,
    runs: &ChunkRuns,
    chunks: &[&[Chunk]],
    links: &[Links],
) -> Option<Vec<(usize, usize)>> {
    let count_bytes = usize::try_from(count_bytes).ok()?;
    let mut entries = Vec::new();
    let mut taken = HashSet::new();
    for bin in 0..TCACHE_BINS {
        let count = tcache_count(bytes, count_bytes, bin)?;
        let mut e = tcache_entry(bytes, count_bytes, bin)?;
        // At most `count` (< 65536) turns, each taking a chunk not taken before.
        for _ in 0..count {
            if e == 0 || e % 16 != 0 {
                return None;
            }
            let (ai, ci) = runs.get(chunks, e - 16)?;
            let c = chunks[ai][ci];
            if c.state != ChunkState::InUse
                || c.size.checked_sub(MINSIZE).map(|s| s / 16) != Some(bin as u64)
                || !taken.insert((ai, ci))
            {
                return None;
            }
            entries.push((ai, ci));
            // An in-use chunk of a tcache bin's size: its `fd` (the
            // entry's `next`) was kept.
            e = reveal(e, *links.get(ai)?.words.get(ci)?, safe);
        }
        if e != 0 {
            return None;
        }
    }
    Some(entries)
}
