//! The heap of a running process, read live: each arena copied and walked
//! until it reads right, or until it is clear that it fails (damage) or
//! kept changing under the reader (threads in the allocator).

use super::frozen::Buffers;
use super::mmapped::{mmapped, pages};
use super::tcache::tcaches;
use super::walk::{Copy, begin, copy, each_arena, walk};
use super::{Arena, Glibc, HeapMap, Residency};
use crate::memory::{Memory, Snapshot};
use crate::os::procfs::Mapping;

/// Read the whole heap of a running process: each arena copied and walked
/// until it reads right (up to `attempts` times).
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
    let (read, bad_list) = each_arena(g, |arena, main| {
        read_arena(mem, g, maps, arena, main, sbrk_base, attempts)
    });
    let mut all = Snapshot::new();
    for read in read {
        match read {
            Ok((a, copy)) => {
                all.merge(copy.mem);
                map.arenas.push(a);
            }
            Err(a) => map.arenas.push(a),
        }
    }
    map.arenas.extend(bad_list);
    tcaches(&all, g, &mut map.arenas);
    mmapped(mem, g, maps, &mut map);
    pages(&mut map, residency);
    map
}

/// One arena, copied and walked until it reads right; and the next arena.
///
/// A failure proves damage only where the arena stood still: in a live
/// process a thread can take the mutex, change the bins and let go between
/// the two reads of the mutex that frame a copy, so an unlocked copy that
/// fails its checks is damage only when the next attempt fails the same way
/// on the same bytes (or when there is one attempt, the process stopped).
/// An arena that failed differently each time was changing, not damaged.
fn read_arena(
    mem: &dyn Memory,
    g: &Glibc,
    maps: &[Mapping],
    arena: u64,
    main: bool,
    sbrk_base: u64,
    attempts: u32,
) -> (Result<(Arena, Copy), Arena>, Option<u64>) {
    let mut err = String::new();
    let mut next = None;
    let mut locked = false;
    let mut stable = attempts == 1;
    // The last unlocked failure: its reason and its copy, if it copied.
    let mut last: Option<(String, Option<Copy>)> = None;
    for attempt in 0..attempts {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let failure = match copy(
            mem,
            g,
            maps,
            arena,
            main,
            sbrk_base,
            &mut Buffers::default(),
        ) {
            Ok(c) => {
                next = Some(c.next);
                locked = c.locked;
                if c.locked && attempt + 1 < attempts {
                    continue;
                }
                match walk(g, arena, main, &c) {
                    Ok(a) => return (Ok((a, c)), next),
                    Err(e) if c.locked => {
                        err = e;
                        continue;
                    }
                    Err(e) => (e, Some(c)),
                }
            }
            Err(e) => {
                locked = false;
                (e, None)
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
