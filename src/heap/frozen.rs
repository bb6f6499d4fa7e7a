//! The heap of a process that memptrace holds stopped (at attach): copied
//! while it stands still, walked once it runs again. Copying is the part
//! that must see one instant (every arena, and the mmapped blocks' headers,
//! as they are while no thread runs); walking the copy, finding the
//! tcaches and the pages needs no process at all, so it is no part of the
//! stop (it took half of the attach's stop of a 200 k-block heap,
//! docs/performance.md).
//!
//! The walk of a copy is the walk of [`super::walk`], on the same bytes:
//! the map is the one a walk of the stopped process would have made, never
//! a mix of before and after. Its pages' residency is read when it is
//! walked (what is resident changes without any thread of the program).

use super::mmapped::{mmapped, pages};
use super::tcache::tcaches;
use super::walk::{Copy, Walked, begin, copy, each_arena, state, walk};
use super::{Arena, Glibc, HeapMap, Residency};
use crate::memory::{Memory, Snapshot};
use crate::os::procfs::Mapping;

/// A heap copied, not yet walked.
pub(super) struct Frozen {
    glibc: Glibc,
    /// The map begun: glibc's counts, the mmapped blocks; no arena yet.
    map: HeapMap,
    /// Each arena on the list, in order: its copy, or why there is none.
    arenas: Vec<(u64, bool, Walked<Copy>)>,
    /// The arena where the list went wrong, if it did.
    bad_list: Option<Arena>,
}

/// Memory to copy arenas into. A fresh buffer costs the kernel a page
/// fault and a cleared page per 4 KiB it copies into: most of the time
/// the copy of a large heap took (43 ms for 56 MB, docs/performance.md).
/// [`super::reserve_copy`] faults them in while the program still runs; a
/// copy takes the smallest that holds it, or a new one.
#[derive(Default)]
pub struct Buffers(pub(super) Vec<Vec<u8>>);

impl Buffers {
    /// An empty buffer of at least `len` bytes; a reserved one for a heap,
    /// not for a few pages (the main arena's `malloc_state`).
    pub(super) fn take(&mut self, len: usize) -> Vec<u8> {
        let best = (self.0.iter().enumerate())
            .filter(|(_, b)| len >= SMALL && b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => {
                let mut buffer = self.0.swap_remove(i);
                buffer.clear();
                buffer
            }
            None => Vec::with_capacity(len),
        }
    }
}

/// Copies shorter than this take a new buffer.
const SMALL: usize = 64 << 10;

/// Most bytes reserved for one arena, and for all: `system_mem` is the
/// target's word.
const RESERVE_ARENA: u64 = 256 << 20;
const RESERVE_ALL: u64 = 1 << 30;

/// Buffers for copying the heap in `mem` a moment later, faulted in now:
/// one per arena on the list, of its `system_mem` and a quarter more (the
/// heap may grow before it stops), within [`RESERVE_ARENA`] and
/// [`RESERVE_ALL`]. An arena that does not read gets none.
pub(super) fn reserve(mem: &dyn Memory, g: &Glibc) -> Buffers {
    let (sizes, _) = each_arena(g, |arena, _| match state(mem, g, arena) {
        Ok(st) => (Some(st.system_mem), Some(st.next)),
        Err(_) => (None, None),
    });
    let mut total = 0;
    let mut buffers = Vec::new();
    for size in sizes.into_iter().flatten() {
        let len = size
            .saturating_add(size / 4)
            .saturating_add(1 << 20)
            .min(RESERVE_ARENA)
            .min(RESERVE_ALL - total);
        if len == 0 {
            break;
        }
        total += len;
        // Written, so that every page is faulted in now.
        buffers.push(vec![1u8; len as usize]);
    }
    Buffers(buffers)
}

/// Copy the heap in `mem` (every thread of its process stopped): each
/// arena read once, the blocks mapped on their own found.
pub(super) fn freeze(
    mem: &dyn Memory,
    g: &Glibc,
    maps: &[Mapping],
    mut buffers: Buffers,
) -> Frozen {
    let (mut map, sbrk_base) = begin(mem, g);
    let Some(sbrk_base) = sbrk_base else {
        return Frozen {
            glibc: g.clone(),
            map,
            arenas: Vec::new(),
            bad_list: None,
        };
    };
    let (arenas, bad_list) = each_arena(g, |arena, main| {
        let copied = copy(mem, g, maps, arena, main, sbrk_base, &mut buffers);
        let next = copied.as_ref().ok().map(|c| c.next);
        ((arena, main, copied), next)
    });
    // The mmapped blocks are looked for outside the arenas' heaps, which
    // is all they need of the arenas.
    map.arenas = arenas
        .iter()
        .map(|(addr, main, copied)| Arena {
            addr: *addr,
            main: *main,
            heaps: copied.as_ref().map(|c| c.heaps.clone()).unwrap_or_default(),
            ..Arena::default()
        })
        .collect();
    mmapped(mem, g, maps, &mut map);
    map.arenas.clear();
    Frozen {
        glibc: g.clone(),
        map,
        arenas,
        bad_list,
    }
}

/// Walk what `freeze` copied: the map of the heap as it was then.
pub(super) fn thaw(frozen: Frozen, residency: &dyn Residency) -> HeapMap {
    let Frozen {
        glibc,
        mut map,
        arenas,
        bad_list,
    } = frozen;
    let g = &glibc;
    let mut all = Snapshot::new();
    for (addr, main, copied) in arenas {
        let failed = |locked, error| Arena {
            addr,
            main,
            locked,
            error: Some(error),
            ..Arena::default()
        };
        match copied {
            Ok(c) => match walk(g, addr, main, &c) {
                Ok(a) => {
                    all.merge(c.mem);
                    map.arenas.push(a);
                }
                Err(e) => map.arenas.push(failed(c.locked, e)),
            },
            Err(e) => map.arenas.push(failed(false, e)),
        }
    }
    map.arenas.extend(bad_list);
    tcaches(&all, g, &mut map.arenas);
    pages(&mut map, residency);
    map
}
