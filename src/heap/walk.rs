//! The walk itself (glibc `malloc/malloc.c`, `malloc/arena.c`): copy an
//! arena while its mutex is free, walk its chunks from the first to `top`,
//! then its fastbins and bins on the copy; after every arena, the tcaches
//! and the mmapped blocks.
//!
//! A chunk is 16-byte aligned: `prev_size`, then `size` whose low bits are
//! PREV_INUSE (the chunk before is in use), IS_MMAPPED and NON_MAIN_ARENA.
//! Whether a chunk is free is said by the next chunk's PREV_INUSE bit.

use std::collections::HashMap;

use super::{
    Arena, Chunk, ChunkState, Glibc, HeapMap, HeapRange, PageRun, PageState, Residency, TCACHE_BINS,
};
use crate::memory::{Memory, Snapshot};
use crate::os::procfs::Mapping;

const PREV_INUSE: u64 = 1;
const IS_MMAPPED: u64 = 2;
const SIZE_BITS: u64 = 7;
const MINSIZE: u64 = 32;
const PAGE: u64 = 4096;
/// Most arenas followed on the `next` list (glibc allows 8 per core).
const MAX_ARENAS: usize = 4096;

type Walked<T> = Result<T, String>;

fn word(mem: &dyn Memory, addr: u64) -> Walked<u64> {
    mem.read_u64(addr)
        .map_err(|e| format!("cannot read {addr:#x}: {e}"))
}

fn align16(x: u64) -> u64 {
    (x + 15) & !15
}

/// glibc's `REVEAL_PTR`: a free-list link stored at `at`, unmangled.
fn reveal(at: u64, stored: u64, safe_linking: bool) -> u64 {
    if safe_linking {
        (at >> 12) ^ stored
    } else {
        stored
    }
}

/// The fields of `malloc_state` the walk needs.
struct State {
    mutex: u32,
    top: u64,
    next: u64,
    system_mem: u64,
}

fn state(mem: &dyn Memory, g: &Glibc, arena: u64) -> Walked<State> {
    let l = &g.layout;
    Ok(State {
        mutex: word(mem, arena)? as u32,
        top: word(mem, arena + l.top)?,
        next: word(mem, arena + l.next)?,
        system_mem: word(mem, arena + l.system_mem)?,
    })
}

/// An arena copied: its `malloc_state` and its heaps, and whether its mutex
/// was held.
struct Copy {
    mem: Snapshot,
    heaps: Vec<HeapRange>,
    locked: bool,
    next: u64,
}

fn read_range(mem: &dyn Memory, start: u64, end: u64) -> Walked<Vec<u8>> {
    let mut bytes = vec![0u8; (end - start) as usize];
    mem.read_exact(start, &mut bytes)
        .map_err(|e| format!("cannot read the heap at {start:#x}: {e}"))?;
    Ok(bytes)
}

/// Copy arena `arena`: its state, then the memory its chunks are in.
fn copy(mem: &dyn Memory, g: &Glibc, arena: u64, main: bool, sbrk_base: u64) -> Walked<Copy> {
    let l = &g.layout;
    let before = state(mem, g, arena)?;
    let mut snap = Snapshot::new();
    let mut heaps = Vec::new();
    // The top chunk's body is never read, and is often most of the heap
    // (16 of 21 MiB in a Python at its exit): copy up to its header only.
    let used_end = |start: u64, end: u64| match before.top {
        top if top >= start && top < end => (top + 16).min(end),
        _ => end,
    };
    if main {
        snap = snap.with_owned(arena, read_range(mem, arena, arena + l.state_size)?);
        if before.system_mem > 0 {
            let end = sbrk_base + before.system_mem;
            let used = used_end(sbrk_base, end);
            snap = snap.with_owned(sbrk_base, read_range(mem, sbrk_base, used)?);
            heaps.push(HeapRange {
                start: sbrk_base,
                end,
            });
        }
    } else {
        // The newest heap holds top; each heap_info names the one before
        // (`heap_info`: ar_ptr, prev, size, ...).
        let mut h = before.top & !(l.heap_max - 1);
        while h != 0 {
            let ar_ptr = word(mem, h)?;
            let prev = word(mem, h + 8)?;
            let size = word(mem, h + 16)?;
            if ar_ptr != arena || size == 0 || size > l.heap_max || size % PAGE != 0 {
                return Err(format!(
                    "heap {h:#x} is not one of this arena's (arena {ar_ptr:#x}, size {size:#x})"
                ));
            }
            if heaps.len() > (1 << 16) {
                return Err("the list of heaps does not end".into());
            }
            snap = snap.with_owned(h, read_range(mem, h, used_end(h, h + size))?);
            heaps.push(HeapRange {
                start: h,
                end: h + size,
            });
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
fn walk(g: &Glibc, arena: u64, main: bool, c: &Copy) -> Walked<Arena> {
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
    let system: u64 = c.heaps.iter().map(|h| h.end - h.start).sum();
    if system != st.system_mem {
        return Err(format!(
            "its heaps hold {system} bytes, its system_mem says {}",
            st.system_mem
        ));
    }
    // Where a thread arena's heap_info ends: the arena follows it in its
    // first heap.
    let heap_info = arena - (arena & !(l.heap_max - 1));
    for (i, h) in c.heaps.iter().enumerate() {
        let last = i + 1 == c.heaps.len();
        let start = if main {
            align16(h.start)
        } else if i == 0 {
            align16(arena + l.state_size)
        } else {
            align16(h.start + heap_info)
        };
        walk_heap(mem, &mut a, start, h.end, last.then_some(st.top))?;
    }
    let index: HashMap<u64, usize> = a
        .chunks
        .iter()
        .enumerate()
        .map(|(i, c)| (c.addr, i))
        .collect();
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
    let mut p = start;
    loop {
        if Some(p) == top {
            let size = word(mem, p + 8)? & !SIZE_BITS;
            if p + size != end {
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
        if p + 16 > end {
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
        if size < MINSIZE || size % 16 != 0 || p + size + 16 > end {
            return Err(format!("chunk {p:#x} has a bad size {size:#x}"));
        }
        let in_use = word(mem, p + size + 8)? & PREV_INUSE != 0;
        a.chunks.push(Chunk {
            addr: p,
            size,
            state: if in_use {
                ChunkState::InUse
            } else {
                ChunkState::Free
            },
        });
        p += size;
    }
}

/// The fastbins: singly linked through `fd`, mangled since 2.32.
fn fastbins(mem: &dyn Memory, g: &Glibc, a: &mut Arena, index: &HashMap<u64, usize>) -> Walked<()> {
    let l = &g.layout;
    let tries: &[bool] = match l.safe_linking {
        Some(true) => &[true],
        Some(false) => &[false],
        None => &[true, false],
    };
    let mut last_err = String::new();
    for &safe in tries {
        let mut found = Vec::new();
        let walked = (|| -> Walked<()> {
            for bin in 0..l.nfastbins {
                let mut p = word(mem, a.addr + l.fastbins + 8 * bin as u64)?;
                while p != 0 {
                    let &i = index
                        .get(&p)
                        .ok_or_else(|| format!("fastbin {bin}: {p:#x} is no chunk"))?;
                    let c = a.chunks[i];
                    if c.state != ChunkState::InUse
                        || (c.size >> 4) - 2 != bin as u64
                        || found.contains(&i)
                    {
                        return Err(format!("fastbin {bin}: chunk {p:#x} does not belong"));
                    }
                    found.push(i);
                    p = reveal(p + 16, word(mem, p + 16)?, safe);
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
fn bins(mem: &dyn Memory, g: &Glibc, a: &mut Arena, index: &HashMap<u64, usize>) -> Walked<()> {
    let l = &g.layout;
    let mut binned = vec![false; a.chunks.len()];
    for bin in 1..l.nbins as u64 {
        let head = a.addr + l.bins + (bin - 1) * 16 - 16;
        let mut p = word(mem, head + 24)?;
        while p != head {
            let &i = index
                .get(&p)
                .ok_or_else(|| format!("bin {bin}: {p:#x} is no chunk"))?;
            if a.chunks[i].state != ChunkState::Free || binned[i] {
                return Err(format!("bin {bin}: chunk {p:#x} is not a free chunk"));
            }
            binned[i] = true;
            a.bin_blocks += 1;
            a.bin_bytes += a.chunks[i].size;
            p = word(mem, p + 24)?;
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

/// Read the whole heap.
pub(super) fn read_heap(
    mem: &dyn Memory,
    g: &Glibc,
    maps: &[Mapping],
    residency: &dyn Residency,
    attempts: u32,
) -> HeapMap {
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
                return map;
            }
        };
    map.n_mmaps = n_mmaps;
    map.mmapped_mem = mmapped_mem;
    map.narenas = g.narenas.and_then(|at| word(mem, at).ok());
    let mut all = Snapshot::new();
    let mut arena = g.main_arena;
    loop {
        let main = arena == g.main_arena;
        let (read, next) = read_arena(mem, g, arena, main, sbrk_base, attempts);
        match read {
            Ok((a, copy)) => {
                all.merge(copy.mem);
                map.arenas.push(a);
            }
            Err(a) => map.arenas.push(a),
        }
        match next {
            Some(next) if next != g.main_arena && next != 0 && map.arenas.len() < MAX_ARENAS => {
                arena = next
            }
            _ => break,
        }
    }
    tcaches(&all, g, &mut map.arenas);
    mmapped(mem, g, maps, &mut map);
    pages(&mut map, residency);
    map
}

/// One arena, copied and walked until it reads right; and the next arena.
fn read_arena(
    mem: &dyn Memory,
    g: &Glibc,
    arena: u64,
    main: bool,
    sbrk_base: u64,
    attempts: u32,
) -> (Result<(Arena, Copy), Arena>, Option<u64>) {
    let mut err = String::new();
    let mut next = None;
    let mut locked = false;
    for attempt in 0..attempts {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        match copy(mem, g, arena, main, sbrk_base) {
            Ok(c) => {
                next = Some(c.next);
                locked = c.locked;
                if c.locked && attempt + 1 < attempts {
                    continue;
                }
                match walk(g, arena, main, &c) {
                    Ok(a) => return (Ok((a, c)), next),
                    Err(e) => err = e,
                }
            }
            Err(e) => err = e,
        }
    }
    let failed = Arena {
        addr: arena,
        main,
        locked,
        error: Some(err),
        ..Arena::default()
    };
    (Err(failed), next)
}

/// Find each thread's `tcache_perthread_struct` (`uint16_t counts[64]`,
/// then `tcache_entry *entries[64]`; `char` counts before 2.30) among the
/// in-use chunks of its size, and the chunks its lists hold. A candidate is
/// taken only when every list is exactly as long as its count and holds
/// in-use chunks of its bin's size; one with every list empty only when it
/// is the first chunk of its arena, where tcache_init puts it.
fn tcaches(mem: &dyn Memory, g: &Glibc, arenas: &mut [Arena]) {
    let mut index: HashMap<u64, (usize, usize)> = HashMap::new();
    for (ai, a) in arenas.iter().enumerate() {
        for (ci, c) in a.chunks.iter().enumerate() {
            index.insert(c.addr, (ai, ci));
        }
    }
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
    index: &HashMap<u64, (usize, usize)>,
    arenas: &[Arena],
) -> Option<Vec<(usize, usize)>> {
    let bins = TCACHE_BINS as u64;
    let mut counts = vec![0u8; (bins * count_bytes) as usize];
    mem.read_exact(user, &mut counts).ok()?;
    let mut entries = Vec::new();
    for bin in 0..bins {
        let count = if count_bytes == 2 {
            u16::from_le_bytes([counts[2 * bin as usize], counts[2 * bin as usize + 1]]) as u64
        } else {
            counts[bin as usize] as u64
        };
        let mut e = mem.read_u64(user + bins * count_bytes + 8 * bin).ok()?;
        for _ in 0..count {
            if e == 0 || e % 16 != 0 {
                return None;
            }
            let &(ai, ci) = index.get(&(e - 16))?;
            let c = arenas[ai].chunks[ci];
            if c.state != ChunkState::InUse
                || (c.size - MINSIZE) / 16 != bin
                || entries.contains(&(ai, ci))
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

/// The blocks glibc mapped on their own: a chunk with IS_MMAPPED at the
/// start of its own mapping (`prev_size` 0), found at page starts of the
/// anonymous writable mappings that are no arena's. An aligned allocation
/// (`_int_memalign`) moves the chunk up by `prev_size` bytes and leaves the
/// old header behind: the chunk at the first offset whose header says so
/// is the real one. What is found must add up to glibc's own count.
fn mmapped(mem: &dyn Memory, g: &Glibc, maps: &[Mapping], map: &mut HeapMap) {
    let arena_ranges: Vec<(u64, u64)> = map
        .arenas
        .iter()
        .flat_map(|a| {
            a.heaps.iter().map(move |h| {
                if a.main {
                    (h.start, h.end)
                } else {
                    (h.start, h.start + g.layout.heap_max)
                }
            })
        })
        .collect();
    let mut total = 0;
    for m in maps
        .iter()
        .filter(|m| m.read && m.write && m.path.is_empty())
    {
        let mut p = m.start;
        while p + 16 <= m.end {
            if arena_ranges.iter().any(|&(s, e)| p >= s && p < e) {
                p += PAGE;
                continue;
            }
            let (Ok(prev), Ok(head)) = (mem.read_u64(p), mem.read_u64(p + 8)) else {
                p += PAGE;
                continue;
            };
            let size = head & !SIZE_BITS;
            if prev != 0
                || head & IS_MMAPPED == 0
                || size == 0
                || size % PAGE != 0
                || p + size > m.end
            {
                p += PAGE;
                continue;
            }
            let mut chunk = Chunk {
                addr: p,
                size,
                state: ChunkState::Mmapped,
            };
            let mut align = 32;
            while align < size {
                let x = align16(p + 16).next_multiple_of(align) - 16;
                if x > p && x + 16 <= p + size {
                    if let (Ok(lead), Ok(h)) = (mem.read_u64(x), mem.read_u64(x + 8)) {
                        if lead == x - p && h & IS_MMAPPED != 0 && h & !SIZE_BITS == size - lead {
                            chunk.addr = x;
                            chunk.size = size - lead;
                            break;
                        }
                    }
                }
                align *= 2;
            }
            total += size;
            map.mmapped.push(chunk);
            p += size;
        }
    }
    if map.mmapped.len() as u64 != map.n_mmaps || total != map.mmapped_mem {
        map.mmapped_error = Some(format!(
            "found {} mmapped blocks of {total} bytes, glibc counts {} of {}",
            map.mmapped.len(),
            map.n_mmaps,
            map.mmapped_mem
        ));
    }
}

/// What each page of the arenas' heaps and of the mmapped blocks holds,
/// and which are resident; each arena's resident bytes.
fn pages(map: &mut HeapMap, residency: &dyn Residency) {
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
