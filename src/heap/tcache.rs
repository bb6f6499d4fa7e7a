//! The threads' tcaches, found among the in-use chunks of the arenas
//! walked: a candidate is taken only when every one of its lists reads
//! exactly as its counts say. Counts and links are the target's words: a
//! count is at most 65535, a chunk is taken at most once, so a list that
//! loops makes the candidate no tcache, in at most 64 x 65535 steps.

use std::collections::HashSet;

use super::walk::{ChunkIndex, MINSIZE, reveal};
use super::{Arena, ChunkState, Glibc, TCACHE_BINS};
use crate::memory::Memory;

/// Find each thread's `tcache_perthread_struct` (`uint16_t counts[64]`,
/// then `tcache_entry *entries[64]`; `char` counts before 2.30) among the
/// in-use chunks of its size, and the chunks its lists hold. A candidate is
/// taken only when every list is exactly as long as its count and holds
/// in-use chunks of its bin's size; one with every list empty only when it
/// is the first chunk of its arena, where tcache_init puts it.
pub(super) fn tcaches(mem: &dyn Memory, g: &Glibc, arenas: &mut [Arena]) {
    let index = ChunkIndex::new(
        arenas
            .iter()
            .enumerate()
            .flat_map(|(ai, a)| {
                a.chunks
                    .iter()
                    .enumerate()
                    .map(move |(ci, c)| (c.addr, (ai, ci)))
            })
            .collect(),
    );
    let safe_tries: &[bool] = match g.layout.safe_linking {
        Some(s) => {
            if s {
                &[true]
            } else {
                &[false]
            }
        }
        None => &[true, false],
    };
    let mut found = Vec::new();
    for (ai, a) in arenas.iter().enumerate() {
        for (ci, c) in a.chunks.iter().enumerate() {
            if c.state != ChunkState::InUse {
                continue;
            }
            for &(size, count_bytes) in &g.layout.tcache {
                if c.size != size {
                    continue;
                }
                for &safe in safe_tries {
                    if let Some(entries) =
                        tcache_lists(mem, c.addr + 16, count_bytes, safe, &index, arenas)
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

/// The chunks in the lists of the tcache at `user`, if it is one.
fn tcache_lists(
    mem: &dyn Memory,
    user: u64,
    count_bytes: u64,
    safe: bool,
    index: &ChunkIndex<(usize, usize)>,
    arenas: &[Arena],
) -> Option<Vec<(usize, usize)>> {
    let bins = TCACHE_BINS as u64;
    if count_bytes != 1 && count_bytes != 2 {
        return None;
    }
    let mut counts = vec![0u8; (bins * count_bytes) as usize];
    mem.read_exact(user, &mut counts).ok()?;
    let entries_at = user.checked_add(bins * count_bytes)?;
    let mut entries = Vec::new();
    let mut taken = HashSet::new();
    for bin in 0..bins {
        let count = if count_bytes == 2 {
            u16::from_le_bytes([counts[2 * bin as usize], counts[2 * bin as usize + 1]]) as u64
        } else {
            counts[bin as usize] as u64
        };
        let mut e = mem.read_u64(entries_at.checked_add(8 * bin)?).ok()?;
        // At most `count` (< 65536) turns, each taking a chunk not taken before.
        for _ in 0..count {
            if e == 0 || e % 16 != 0 {
                return None;
            }
            let (ai, ci) = index.get(e - 16)?;
            let c = arenas[ai].chunks[ci];
            if c.state != ChunkState::InUse
                || c.size.checked_sub(MINSIZE).map(|s| s / 16) != Some(bin)
                || !taken.insert((ai, ci))
            {
                return None;
            }
            entries.push((ai, ci));
            e = reveal(e, mem.read_u64(e).ok()?, safe);
        }
        if e != 0 {
            return None;
        }
    }
    Some(entries)
}
