//! The heap of a running process, read live: each arena's chunks read and
//! walked until it reads right, or until it is clear that it fails
//! (damage) or kept changing under the reader (threads in the allocator).

use super::chain::{Chain, Failed, Links, WINDOW, read_chain};
use super::mmapped::{mmapped, pages};
use super::tcache::tcaches;
use super::walk::{begin, each_arena, finish};
use super::{Arena, Glibc, HeapMap, Residency};
use crate::memory::Memory;
use crate::os::procfs::Mapping;

/// Read the whole heap of a running process: each arena read and walked
/// until it reads right (up to `attempts` times), through one window.
pub(super) fn read_heap(
    mem: &dyn Memory,
    g: &Glibc,
    maps: &[Mapping],
    residency: &dyn Residency,
    attempts: u32,
) -> HeapMap {
    let (mut map, sbrk_base) = begin(mem, g);
    let Some(sbrk_base) = sbrk_base else {
        return map;
    };
    let mut window = Vec::with_capacity(WINDOW);
    let (read, bad_list) = each_arena(g, |arena, main| {
        read_arena(mem, g, maps, arena, main, sbrk_base, attempts, &mut window)
    });
    drop(window);
    let mut links = Vec::new();
    for read in read {
        match read {
            Ok((a, kept)) => {
                map.arenas.push(a);
                links.push(kept);
            }
            Err(a) => {
                map.arenas.push(a);
                links.push(Links::default());
            }
        }
    }
    map.arenas.extend(bad_list);
    tcaches(g, &mut map.arenas, &links);
    drop(links);
    mmapped(mem, g, maps, &mut map);
    pages(&mut map, residency);
    map
}

/// One arena, read and walked until it reads right; and the next arena.
///
/// A failure proves damage only where the arena stood still: in a live
/// process a thread can take the mutex, change the bins and let go between
/// the two reads of the mutex that frame a read, so an unlocked read that
/// fails its checks is damage only when the next attempt fails the same way
/// on the same words (or when there is one attempt, the process stopped).
/// An arena that failed differently each time was changing, not damaged.
#[allow(clippy::too_many_arguments)]
fn read_arena(
    mem: &dyn Memory,
    g: &Glibc,
    maps: &[Mapping],
    arena: u64,
    main: bool,
    sbrk_base: u64,
    attempts: u32,
    window: &mut Vec<u8>,
) -> (Result<(Arena, Links), Arena>, Option<u64>) {
    let mut err = String::new();
    let mut next = None;
    let mut locked = false;
    let mut stable = attempts == 1;
    // The last unlocked failure: its reason and the fingerprint of the
    // words it read.
    let mut last: Option<(String, u64)> = None;
    for attempt in 0..attempts {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let more = attempt + 1 < attempts;
        let read = read_chain(mem, g, maps, arena, main, sbrk_base, window, !more);
        let failure = match read {
            Ok(mut chain) => {
                next = Some(chain.next);
                locked = chain.arena.locked;
                if locked && more {
                    continue;
                }
                match finish(g, &mut chain) {
                    Ok(()) => {
                        let Chain { arena, links, .. } = chain;
                        return (Ok((arena, links)), next);
                    }
                    Err(e) if locked => {
                        err = e;
                        continue;
                    }
                    Err(e) => (e, chain.fingerprint),
                }
            }
            Err(Failed {
                error,
                locked: held,
                next: told,
                fingerprint,
            }) => {
                next = told.or(next);
                locked = held;
                if held {
                    err = error;
                    continue;
                }
                (error, fingerprint)
            }
        };
        err = failure.0.clone();
        if last.as_ref() == Some(&failure) {
            stable = true;
            break;
        }
        last = Some(failure);
    }
    let failed = Arena {
        addr: arena,
        main,
        locked,
        changing: !locked && !stable,
        error: Some(err),
        ..Arena::default()
    };
    (Err(failed), next)
}
