//! What lies outside the arenas' chunk chains: the blocks glibc mapped on
//! their own, found by their headers in the anonymous mappings, and what
//! each page of the heap holds.
//!
//! A header is the target's word: a size that runs past its mapping, or an
//! offset that would wrap, makes the page no block (the scan goes on at
//! the next page); every sum is checked, every loop is bounded by the
//! mapping it scans.

use super::walk::{IS_MMAPPED, PAGE, SIZE_BITS, align16};
use super::{Chunk, ChunkState, Glibc, HeapMap, PageRun, PageState, Residency};
use crate::memory::Memory;
use crate::os::procfs::Mapping;

/// The blocks glibc mapped on their own: a chunk with IS_MMAPPED at the
/// start of its own mapping (`prev_size` 0), found at page starts of the
/// anonymous writable mappings that are no arena's. An aligned allocation
/// (`_int_memalign`) moves the chunk up by `prev_size` bytes and leaves the
/// old header behind: the chunk at the first offset whose header says so
/// is the real one. What is found must add up to glibc's own count.
pub(super) fn mmapped(mem: &dyn Memory, g: &Glibc, maps: &[Mapping], map: &mut HeapMap) {
    let arena_ranges: Vec<(u64, u64)> = map
        .arenas
        .iter()
        .flat_map(|a| {
            a.heaps.iter().map(move |h| {
                if a.main {
                    (h.start, h.end)
                } else {
                    (h.start, h.start.saturating_add(g.layout.heap_max))
                }
            })
        })
        .collect();
    // Bytes found; `None` once the sum wraps (it cannot match glibc's then).
    let mut total = Some(0u64);
    for m in maps
        .iter()
        .filter(|m| m.read && m.write && m.path.is_empty())
    {
        // Each turn moves `p` up by a page or more, and it stays below
        // the mapping's end: the scan ends.
        let mut p = m.start;
        while p
            .checked_add(16)
            .is_some_and(|header_end| header_end <= m.end)
        {
            let next_page = p.saturating_add(PAGE);
            if arena_ranges.iter().any(|&(s, e)| p >= s && p < e) {
                p = next_page;
                continue;
            }
            let Some(size) = mmapped_at(mem, p, m.end) else {
                p = next_page;
                continue;
            };
            map.mmapped.push(moved(mem, p, size));
            total = total.and_then(|t| t.checked_add(size));
            // `mmapped_at` checked that the block ends inside the mapping.
            p += size;
        }
    }
    if map.mmapped.len() as u64 != map.n_mmaps || total != Some(map.mmapped_mem) {
        let total = total.map_or("too many".to_string(), |t| t.to_string());
        map.mmapped_error = Some(format!(
            "found {} mmapped blocks of {total} bytes, glibc counts {} of {}",
            map.mmapped.len(),
            map.n_mmaps,
            map.mmapped_mem
        ));
    }
}

/// The size of the mmapped block whose header is at `p`, if one is: its
/// `prev_size` 0, IS_MMAPPED set, and a whole number of pages ending by
/// `end`.
fn mmapped_at(mem: &dyn Memory, p: u64, end: u64) -> Option<u64> {
    let prev = mem.read_u64(p).ok()?;
    let head = mem.read_u64(p.checked_add(8)?).ok()?;
    let size = head & !SIZE_BITS;
    let fits = p
        .checked_add(size)
        .is_some_and(|block_end| block_end <= end);
    (prev == 0 && head & IS_MMAPPED != 0 && size != 0 && size % PAGE == 0 && fits).then_some(size)
}

/// The chunk of the block mapped at `p` (`size` bytes, inside its mapping):
/// moved up by `_int_memalign` to the first power-of-two alignment whose
/// header says so, or where it was mapped.
fn moved(mem: &dyn Memory, p: u64, size: u64) -> Chunk {
    let mut chunk = Chunk {
        addr: p,
        size,
        state: ChunkState::Mmapped,
    };
    // The block lies inside its mapping, so `p + size` does not wrap; the
    // alignment doubles up to `size`, and never reaches 0.
    let end = p + size;
    let mut align: u64 = 32;
    while align < size {
        let x = align16(p + 16)
            .and_then(|user| user.checked_next_multiple_of(align))
            .and_then(|user| user.checked_sub(16));
        if let Some(x) = x.filter(|&x| x > p && x.checked_add(16).is_some_and(|e| e <= end)) {
            if let (Ok(lead), Ok(h)) = (mem.read_u64(x), mem.read_u64(x + 8)) {
                if lead == x - p && h & IS_MMAPPED != 0 && h & !SIZE_BITS == size - lead {
                    chunk.addr = x;
                    chunk.size = size - lead;
                    break;
                }
            }
        }
        let Some(doubled) = align.checked_mul(2) else {
            break;
        };
        align = doubled;
    }
    chunk
}

/// What each page of the arenas' heaps and of the mmapped blocks holds,
/// and which are resident; each arena's resident bytes.
pub(super) fn pages(map: &mut HeapMap, residency: &dyn Residency) {
    let mut runs = Vec::new();
    for a in &mut map.arenas {
        let mut resident_bytes = Some(0);
        for h in &a.heaps {
            let first = h.start / PAGE;
            let n = h.end.div_ceil(PAGE) - first;
            // Bytes of each page: in use (headers included), free, top.
            let mut tally = vec![[0u64; 3]; n as usize];
            let mut add = |start: u64, end: u64, kind: usize| {
                let mut at = start.max(h.start);
                while at < end.min(h.end) {
                    let page = at / PAGE;
                    let next = ((page + 1) * PAGE).min(end);
                    tally[(page - first) as usize][kind] += next - at;
                    at = next;
                }
            };
            add(h.start, h.end, 0);
            for c in a
                .chunks
                .iter()
                .filter(|c| c.addr >= h.start && c.addr < h.end)
            {
                let kind = match c.state {
                    ChunkState::Free | ChunkState::Fastbin | ChunkState::Tcache => 1,
                    ChunkState::Top => 2,
                    _ => continue,
                };
                // The header stays in use.
                add(c.addr + 16, c.addr + c.size, kind);
            }
            let resident = residency.resident(first * PAGE, n);
            if let (Some(r), Some(bytes)) = (&resident, resident_bytes.as_mut()) {
                *bytes += r.iter().filter(|&&x| x).count() as u64 * PAGE;
            } else {
                resident_bytes = None;
            }
            for (i, t) in tally.iter().enumerate() {
                let in_use = t[0].saturating_sub(t[1] + t[2]);
                let state = if t[2] > in_use.max(t[1]) {
                    PageState::Top
                } else if t[1] > in_use {
                    PageState::Free
                } else {
                    PageState::InUse
                };
                let r = resident.as_ref().map(|r| r[i]);
                push_run(&mut runs, (first + i as u64) * PAGE, state, r);
            }
        }
        a.resident = resident_bytes;
    }
    for c in &map.mmapped {
        let start = c.addr & !(PAGE - 1);
        let n = (c.addr + c.size).div_ceil(PAGE) - start / PAGE;
        let resident = residency.resident(start, n);
        for i in 0..n {
            let r = resident.as_ref().map(|r| r[i as usize]);
            push_run(&mut runs, start + i * PAGE, PageState::Mmapped, r);
        }
    }
    map.pages = runs;
}

fn push_run(runs: &mut Vec<PageRun>, addr: u64, state: PageState, resident: Option<bool>) {
    if let Some(last) = runs.last_mut() {
        if last.addr + last.pages * PAGE == addr && last.state == state && last.resident == resident
        {
            last.pages += 1;
            return;
        }
    }
    runs.push(PageRun {
        addr,
        pages: 1,
        state,
        resident,
    });
}
