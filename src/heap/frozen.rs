//! The heap of a process that memptrace holds stopped (at attach): its
//! chunks read while it stands still, walked the rest of the way once it
//! runs again. Reading is the part that must see one instant (every
//! arena's chain of chunks, the words its lists follow, the mmapped
//! blocks' headers, as they are while no thread runs); the bins, the
//! tcaches and the pages need no process at all, so they are no part of
//! the stop (docs/performance.md).
//!
//! The walk is that of [`super::walk`], on the same words: the map is the
//! one a walk of the stopped process would have made, never a mix of
//! before and after. Its pages' residency is read when it is walked (what
//! is resident changes without any thread of the program).

use super::chain::{Chain, Failed, Links, WINDOW, read_chain};
use super::mmapped::{mmapped, pages};
use super::tcache::tcaches;
use super::walk::{begin, each_arena, finish};
use super::{Arena, Glibc, HeapMap, Residency};
use crate::memory::Memory;
use crate::os::procfs::Mapping;

/// A heap read in the stop, not yet walked.
pub(super) struct Frozen {
    glibc: Glibc,
    /// The map begun: glibc's counts, the mmapped blocks; no arena yet.
    map: HeapMap,
    /// Each arena on the list, in order: its chain, or why there is none.
    arenas: Vec<(u64, bool, Result<Chain, Failed>)>,
    /// The arena where the list went wrong, if it did.
    bad_list: Option<Arena>,
}

/// The window the heap is read through, faulted in before the program
/// stops (a fresh buffer costs the kernel a page fault and a cleared page
/// per 4 KiB it copies into). Before windows, each arena was copied whole
/// into buffers reserved here, of its `system_mem` and a quarter more: up
/// to 1 GiB of memptrace's memory for a large heap.
#[derive(Default)]
pub struct Buffers(pub(super) Vec<u8>);

impl Buffers {
    /// The window, as reserved or new.
    pub(super) fn window(self) -> Vec<u8> {
        let mut window = self.0;
        if window.capacity() < WINDOW {
            window = Vec::with_capacity(WINDOW);
        }
        window
    }
}

/// The window for reading a heap a moment later, faulted in now.
pub(super) fn reserve() -> Buffers {
    // Written, so that every page is faulted in now.
    Buffers(vec![1u8; WINDOW])
}

/// Read the heap in `mem` (every thread of its process stopped): each
/// arena's chain read once through the window in `buffers`, the blocks
/// mapped on their own found.
pub(super) fn freeze(mem: &dyn Memory, g: &Glibc, maps: &[Mapping], buffers: Buffers) -> Frozen {
    let (mut map, sbrk_base) = begin(mem, g);
    let Some(sbrk_base) = sbrk_base else {
        return Frozen {
            glibc: g.clone(),
            map,
            arenas: Vec::new(),
            bad_list: None,
        };
    };
    let mut window = buffers.window();
    let (arenas, bad_list) = each_arena(g, |arena, main| {
        let read = read_chain(mem, g, maps, arena, main, sbrk_base, &mut window, true);
        let next = match &read {
            Ok(chain) => Some(chain.next),
            Err(failed) => failed.next,
        };
        ((arena, main, read), next)
    });
    drop(window);
    // The mmapped blocks are looked for outside the arenas' heaps, which
    // is all they need of the arenas.
    map.arenas = arenas
        .iter()
        .map(|(addr, main, read)| Arena {
            addr: *addr,
            main: *main,
            heaps: read
                .as_ref()
                .map(|c| c.arena.heaps.clone())
                .unwrap_or_default(),
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

/// Walk what `freeze` read: the map of the heap as it was then.
pub(super) fn thaw(frozen: Frozen, residency: &dyn Residency) -> HeapMap {
    let Frozen {
        glibc,
        mut map,
        arenas,
        bad_list,
    } = frozen;
    let g = &glibc;
    let mut links = Vec::new();
    for (addr, main, read) in arenas {
        let failed = |locked, error| Arena {
            addr,
            main,
            locked,
            error: Some(error),
            ..Arena::default()
        };
        match read {
            Ok(mut chain) => match finish(g, &mut chain) {
                Ok(()) => {
                    map.arenas.push(chain.arena);
                    links.push(chain.links);
                }
                Err(e) => {
                    map.arenas.push(failed(chain.arena.locked, e));
                    links.push(Links::default());
                }
            },
            Err(f) => {
                map.arenas.push(failed(f.locked, f.error));
                links.push(Links::default());
            }
        }
    }
    map.arenas.extend(bad_list);
    tcaches(g, &mut map.arenas, &links);
    pages(&mut map, residency);
    map
}
