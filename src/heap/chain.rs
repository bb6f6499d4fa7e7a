//! An arena's chain of chunks, read from the process a window at a time:
//! the first half of the walk, the part that needs the process (the second,
//! [`super::walk::finish`], works on what this one kept).
//!
//! The walk needs each chunk's header, the next chunk's `PREV_INUSE` bit,
//! the two link words after a header (a free chunk's `bk`, a small in-use
//! chunk's `fd`: fastbin and tcache lists) and the contents of the chunks
//! that may be a thread's tcache. It reads a window of [`WINDOW`] bytes
//! from the header it needs next and moves on inside it; a chunk that ends
//! past the window is skipped over by its size (checked as before: inside
//! its heap, aligned, at least `MINSIZE`), and the next window starts at
//! the next header (a short one, [`AFTER_JUMP`], after such a jump). What memptrace holds for a heap is the window, the
//! chunks and one link word per chunk: it does not grow with the bytes of
//! the heap (a whole copy of each arena once made memptrace as large as
//! the program's heap, docs/performance.md).

use super::walk::{MINSIZE, PAGE, PREV_INUSE, SIZE_BITS};
use super::walk::{Walked, add, aligned16, word};
use super::{Arena, Chunk, ChunkState, Glibc, HeapRange, TCACHE_BINS};
use crate::memory::Memory;
use crate::os::procfs::Mapping;
use std::collections::HashSet;

/// Bytes of the heap read at once.
pub(super) const WINDOW: usize = 4 << 20;

/// Bytes read at a header the walk jumped to, past the end of the window
/// (the chunk before it was larger than what was left of the window): the
/// chunks there may be large too, whose bodies a whole window would read
/// for nothing (three quarters of the bytes of a heap of 64 KiB-6 MiB
/// blocks). A walk that reads on from the end of this one gets a whole
/// window again.
pub(super) const AFTER_JUMP: usize = 64 << 10;

/// What the second half of the walk needs of an arena besides its chunks:
/// for each chunk one link word (a free chunk's `bk`, an in-use chunk's
/// `fd` when it is small enough for a fastbin or a tcache, else 0), and
/// the bytes of each in-use chunk that may be a `tcache_perthread_struct`
/// (its index among the chunks, then `counts` and `entries`).
#[derive(Debug, Default)]
pub(super) struct Links {
    pub(super) words: Vec<u64>,
    pub(super) tcaches: Vec<(usize, Vec<u8>)>,
}

/// An arena whose chunks were read: its chunks and heaps, its
/// `malloc_state` as read, and what the bins, fastbins and tcaches need.
#[derive(Debug)]
pub(super) struct Chain {
    pub(super) arena: Arena,
    pub(super) state: Vec<u8>,
    pub(super) links: Links,
    pub(super) next: u64,
    /// Of every word read: two reads that fail the same way with the same
    /// fingerprint read the same bytes.
    pub(super) fingerprint: u64,
}

/// An arena whose chunks could not be read: why, whether its mutex was
/// held, the next arena if its state told, and the fingerprint of what
/// was read before it failed.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Failed {
    pub(super) error: String,
    pub(super) locked: bool,
    pub(super) next: Option<u64>,
    pub(super) fingerprint: u64,
}

/// Mix `word` into `fingerprint` (FxHash's step).
fn mix(fingerprint: &mut u64, word: u64) {
    *fingerprint = (fingerprint.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
}

/// The memory of one heap, read a window at a time, only inside
/// `lo..limit` (what the arena's state says its chunks lie in).
pub(super) struct Reader<'a> {
    mem: &'a dyn Memory,
    /// The window: its first `valid` bytes are those at `at`.
    buf: &'a mut Vec<u8>,
    at: u64,
    valid: usize,
    lo: u64,
    limit: u64,
    pub(super) fingerprint: u64,
}

impl<'a> Reader<'a> {
    /// `buf` is the window, of [`WINDOW`] bytes (made so if it is not).
    pub(super) fn new(mem: &'a dyn Memory, buf: &'a mut Vec<u8>, lo: u64, limit: u64) -> Self {
        buf.resize(WINDOW, 0);
        Reader {
            mem,
            buf,
            at: 0,
            valid: 0,
            lo,
            limit,
            fingerprint: 0,
        }
    }

    /// The `len` bytes at `addr`, from the window, read anew from `addr`
    /// when it does not hold them.
    pub(super) fn bytes(&mut self, addr: u64, len: usize) -> Walked<&[u8]> {
        let held = addr
            .checked_sub(self.at)
            .and_then(|off| usize::try_from(off).ok())
            .filter(|off| off.checked_add(len).is_some_and(|end| end <= self.valid));
        let off = match held {
            Some(off) => off,
            None => {
                self.fill(addr, len)?;
                0
            }
        };
        Ok(&self.buf[off..off + len])
    }

    /// The word at `addr`.
    pub(super) fn word(&mut self, addr: u64) -> Walked<u64> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.bytes(addr, 8)?);
        let w = u64::from_le_bytes(w);
        mix(&mut self.fingerprint, w);
        Ok(w)
    }

    /// Read the window at `addr`: up to [`WINDOW`] bytes ([`AFTER_JUMP`]
    /// when `addr` is a page or more past the end of the last), at least
    /// `len`.
    fn fill(&mut self, addr: u64, len: usize) -> Walked<()> {
        let end = self.at.saturating_add(self.valid as u64);
        let jumped = self.valid > 0 && addr > end.saturating_add(PAGE);
        let most = if jumped { AFTER_JUMP } else { WINDOW };
        self.valid = 0;
        let inside = addr >= self.lo
            && len <= WINDOW
            && addr
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.limit);
        if !inside {
            return Err(format!(
                "cannot read {addr:#x}: outside the heap read ({:#x}..{:#x})",
                self.lo, self.limit
            ));
        }
        let n = (self.limit - addr).min(most.max(len) as u64) as usize;
        self.mem
            .read_exact(addr, &mut self.buf[..n])
            .map_err(|e| format!("cannot read the heap at {addr:#x}: {e}"))?;
        self.at = addr;
        self.valid = n;
        Ok(())
    }
}

/// The fields of `malloc_state` the walk needs.
pub(super) struct State {
    pub(super) mutex: u32,
    pub(super) top: u64,
    pub(super) next: u64,
    pub(super) system_mem: u64,
}

/// The word at `offset` in the `malloc_state` bytes `state`.
pub(super) fn field(state: &[u8], offset: u64) -> Walked<u64> {
    let at = usize::try_from(offset).ok();
    let bytes = at
        .and_then(|at| state.get(at..at.checked_add(8)?))
        .ok_or_else(|| format!("offset {offset:#x} is outside malloc_state"))?;
    let mut w = [0u8; 8];
    w.copy_from_slice(bytes);
    Ok(u64::from_le_bytes(w))
}

/// The `malloc_state` of `arena`, read whole.
pub(super) fn read_state(mem: &dyn Memory, g: &Glibc, arena: u64) -> Walked<(Vec<u8>, State)> {
    let l = &g.layout;
    let mut bytes = vec![0u8; l.state_size.min(1 << 16) as usize];
    mem.read_exact(arena, &mut bytes)
        .map_err(|e| format!("cannot read {arena:#x}: {e}"))?;
    let st = State {
        mutex: field(&bytes, 0)? as u32,
        top: field(&bytes, l.top)?,
        next: field(&bytes, l.next)?,
        system_mem: field(&bytes, l.system_mem)?,
    };
    Ok((bytes, st))
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

/// The heaps of arena `arena` whose state is `st`, oldest first: the brk
/// area from `sbrk_base` (which must be mapped: its `system_mem` is a
/// length the target states), or a thread arena's list of `heap_info`s.
fn heaps(
    mem: &dyn Memory,
    g: &Glibc,
    maps: &[Mapping],
    arena: u64,
    main: bool,
    sbrk_base: u64,
    st: &State,
) -> Walked<Vec<HeapRange>> {
    let l = &g.layout;
    let mut heaps = Vec::new();
    if main {
        if st.system_mem > 0 {
            let end = add(sbrk_base, st.system_mem)?;
            if !covered(maps, sbrk_base, end) {
                return Err(format!(
                    "its heap {sbrk_base:#x}..{end:#x} (system_mem) is not all mapped"
                ));
            }
            heaps.push(HeapRange {
                start: sbrk_base,
                end,
            });
        }
        return Ok(heaps);
    }
    // The newest heap holds top; each heap_info names the one before
    // (`heap_info`: ar_ptr, prev, size, ...).
    let mask = !(l.heap_max.max(PAGE) - 1);
    let mut h = st.top & mask;
    let mut seen = HashSet::new();
    while h != 0 {
        let ar_ptr = word(mem, h)?;
        let prev = word(mem, add(h, 8)?)?;
        let size = word(mem, add(h, 16)?)?;
        if ar_ptr != arena || size == 0 || size > l.heap_max || size % PAGE != 0 || h & !mask != 0 {
            return Err(format!(
                "heap {h:#x} is not one of this arena's (arena {ar_ptr:#x}, size {size:#x})"
            ));
        }
        if !seen.insert(h) || heaps.len() > (1 << 16) {
            return Err(format!("the list of heaps does not end (at {h:#x})"));
        }
        heaps.push(HeapRange {
            start: h,
            end: add(h, size)?,
        });
        h = prev;
    }
    heaps.reverse();
    Ok(heaps)
}

/// Read the chunks of arena `arena` (the main one when `main`), its state
/// first, through the window `buf`; its mutex looked at before and after.
/// `maps`: the process's mappings, which the main arena's heap must lie in.
/// `if_locked`: read on when the mutex is held at first (else that is the
/// failure, and nothing more is read).
#[allow(clippy::too_many_arguments)]
pub(super) fn read_chain(
    mem: &dyn Memory,
    g: &Glibc,
    maps: &[Mapping],
    arena: u64,
    main: bool,
    sbrk_base: u64,
    buf: &mut Vec<u8>,
    if_locked: bool,
) -> Result<Chain, Failed> {
    let failed = |error, locked, next, fingerprint| Failed {
        error,
        locked,
        next,
        fingerprint,
    };
    let (state, st) = read_state(mem, g, arena).map_err(|e| failed(e, false, None, 0))?;
    let mut fingerprint = 0;
    for w in state.chunks(8) {
        let mut word = [0u8; 8];
        word[..w.len()].copy_from_slice(w);
        mix(&mut fingerprint, u64::from_le_bytes(word));
    }
    if st.mutex != 0 && !if_locked {
        let error = format!("its mutex is held ({:#x})", st.mutex);
        return Err(failed(error, true, Some(st.next), fingerprint));
    }
    let mut a = Arena {
        addr: arena,
        main,
        system_mem: st.system_mem,
        ..Arena::default()
    };
    let mut links = Links::default();
    let walked = heaps(mem, g, maps, arena, main, sbrk_base, &st).and_then(|heaps| {
        a.heaps = heaps;
        walk_chunks(mem, g, &st, &mut a, &mut links, buf, &mut fingerprint)
    });
    // The mutex again: a read framed by two free mutexes saw no call
    // hold it throughout (one may have run between: see `super::live`).
    let locked = st.mutex != 0 || word(mem, arena).map_or(true, |m| m as u32 != 0);
    a.locked = locked;
    match walked {
        Ok(()) => Ok(Chain {
            arena: a,
            state,
            links,
            next: st.next,
            fingerprint,
        }),
        Err(e) => Err(failed(e, locked, Some(st.next), fingerprint)),
    }
}

/// The chunks of every heap of `a`: each heap's chain, in the newest up to
/// `top`'s header only (top's body, often most of a heap, is never read).
fn walk_chunks(
    mem: &dyn Memory,
    g: &Glibc,
    st: &State,
    a: &mut Arena,
    links: &mut Links,
    buf: &mut Vec<u8>,
    fingerprint: &mut u64,
) -> Walked<()> {
    let l = &g.layout;
    if a.main && st.system_mem == 0 {
        return Ok(());
    }
    if a.main && !a.heaps.iter().any(|h| st.top >= h.start && st.top < h.end) {
        return Err(format!(
            "top {:#x} is outside the brk area: a main arena that is not contiguous is not supported",
            st.top
        ));
    }
    let system = a
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
    let heap_info = a.addr & (l.heap_max.max(PAGE) - 1);
    let heaps = a.heaps.clone();
    for (i, h) in heaps.iter().enumerate() {
        let last = i + 1 == heaps.len();
        let start = if a.main {
            aligned16(h.start)?
        } else if i == 0 {
            aligned16(add(a.addr, l.state_size)?)?
        } else {
            aligned16(add(h.start, heap_info)?)?
        };
        let top = last.then_some(st.top);
        // Read up to top's header, or to the heap's end.
        let limit = match top {
            Some(top) if top >= h.start && top < h.end => top.saturating_add(16).min(h.end),
            _ => h.end,
        };
        let mut reader = Reader::new(mem, buf, h.start, limit);
        reader.fingerprint = *fingerprint;
        let walked = walk_heap(&mut reader, g, a, links, start, h.end, top);
        *fingerprint = reader.fingerprint;
        walked?;
    }
    Ok(())
}

/// Largest in-use chunk whose `fd` the lists may follow: the largest
/// tcache bin's, or the largest fastbin's.
fn linked_max(g: &Glibc) -> u64 {
    let tcache = MINSIZE + 16 * (TCACHE_BINS as u64 - 1);
    let fast = (g.layout.nfastbins as u64 + 1) * 16;
    tcache.max(fast)
}

/// The chunks from `start` to `end`; in the newest heap the chain ends at
/// `top`, which must end the heap; in older ones at a zero-sized fencepost.
pub(super) fn walk_heap(
    r: &mut Reader,
    g: &Glibc,
    a: &mut Arena,
    links: &mut Links,
    start: u64,
    end: u64,
    top: Option<u64>,
) -> Walked<()> {
    let linked = linked_max(g);
    // Each turn moves `p` up by at least 16 bytes, and `p` never passes
    // `end`: the loop ends.
    let mut p = start;
    loop {
        if Some(p) == top {
            let size = r.word(add(p, 8)?)? & !SIZE_BITS;
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
            links.words.push(0);
            return Ok(());
        }
        if p.checked_add(16).is_none_or(|header_end| header_end > end) {
            return Err(match top {
                Some(top) => format!("the chunks end at {p:#x} without reaching top {top:#x}"),
                None => format!("the chunks of heap ending at {end:#x} run past it"),
            });
        }
        let size = r.word(p + 8)? & !SIZE_BITS;
        if top.is_none() && size == 0 {
            return Ok(());
        }
        if top.is_none() && size == 16 {
            a.chunks.push(Chunk {
                addr: p,
                size,
                state: ChunkState::Fencepost,
            });
            links.words.push(0);
            p += 16;
            continue;
        }
        let next = p
            .checked_add(size)
            .filter(|next| next.checked_add(16).is_some_and(|n| n <= end));
        let Some(next) = next.filter(|_| size >= MINSIZE && size % 16 == 0) else {
            return Err(format!("chunk {p:#x} has a bad size {size:#x}"));
        };
        // The link words follow the header (inside the chunk: it is at
        // least MINSIZE), read before the next header, in address order.
        let fd = r.word(p + 16)?;
        let bk = r.word(p + 24)?;
        let in_use = r.word(next + 8)? & PREV_INUSE != 0;
        let first = a.chunks.is_empty();
        if in_use {
            tcache_candidate(r, g, links, a.chunks.len(), p, size, first)?;
        }
        links.words.push(match in_use {
            false => bk,
            true if size <= linked => fd,
            true => 0,
        });
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

/// Keep the bytes of in-use chunk `index` (at `p`, `size` bytes) when it
/// may be a `tcache_perthread_struct`: of a tcache's size, every list's
/// head 16-byte aligned and empty exactly where its count is 0, and some
/// list not empty unless it is its arena's first chunk (`tcache_init`
/// puts it there). Every struct [`super::tcache::tcaches`] takes passes
/// this; most blocks of the same size do not, and are not kept.
fn tcache_candidate(
    r: &mut Reader,
    g: &Glibc,
    links: &mut Links,
    index: usize,
    p: u64,
    size: u64,
    first: bool,
) -> Walked<()> {
    for &(tsize, count_bytes) in &g.layout.tcache {
        let len = TCACHE_BINS * (count_bytes as usize + 8);
        if size != tsize || !(count_bytes == 1 || count_bytes == 2) || 16 + len as u64 > size {
            continue;
        }
        let bytes = r.bytes(p + 16, len)?;
        if plausible(bytes, count_bytes as usize, first) {
            let kept = bytes.to_vec();
            links.tcaches.push((index, kept));
            return Ok(());
        }
    }
    Ok(())
}

/// The cheap half of [`super::tcache`]'s test of a candidate's `counts`
/// and `entries` (`count_bytes` a count).
pub(super) fn plausible(bytes: &[u8], count_bytes: usize, first: bool) -> bool {
    let mut any = false;
    for bin in 0..TCACHE_BINS {
        let count = tcache_count(bytes, count_bytes, bin);
        let entry = tcache_entry(bytes, count_bytes, bin);
        let (Some(count), Some(entry)) = (count, entry) else {
            return false;
        };
        if (count == 0) != (entry == 0) || entry % 16 != 0 {
            return false;
        }
        any |= count != 0;
    }
    any || first
}

/// `counts[bin]` of the tcache struct bytes `bytes`.
pub(super) fn tcache_count(bytes: &[u8], count_bytes: usize, bin: usize) -> Option<u64> {
    match count_bytes {
        1 => bytes.get(bin).map(|&c| c as u64),
        2 => Some(u16::from_le_bytes([*bytes.get(2 * bin)?, *bytes.get(2 * bin + 1)?]) as u64),
        _ => None,
    }
}

/// `entries[bin]` of the tcache struct bytes `bytes`.
pub(super) fn tcache_entry(bytes: &[u8], count_bytes: usize, bin: usize) -> Option<u64> {
    let at = TCACHE_BINS * count_bytes + 8 * bin;
    let mut w = [0u8; 8];
    w.copy_from_slice(bytes.get(at..at + 8)?);
    Some(u64::from_le_bytes(w))
}
