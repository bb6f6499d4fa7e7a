//! Trampoline areas: pages memptrace maps in the target, next to the images
//! whose functions it hooks, to hold the code a hooked call runs through.
//!
//! Code in an area must lie within ±2 GiB of the code it stands for (rel32
//! operands and jumps), so an area is placed next to the image it serves,
//! in a gap of the address space found from /proc/PID/maps. An area is a
//! new mapping, not a changed byte: it goes at detach (or with a child that
//! is released) as a whole. This module is pure bookkeeping; the space maps
//! and unmaps.

use std::ops::Range;

use crate::os::procfs::Mapping;

/// Size of a trampoline area for int3 probes (one page: 64 slots); jump
/// probes, a few hundred bytes each, take areas of [`JUMP_AREA_SIZE`].
pub const AREA_SIZE: u64 = 4096;
pub const JUMP_AREA_SIZE: u64 = 64 << 10;

/// Places tried in each gap of the address space, from its end down (or
/// its start up): one may have been taken since /proc/PID/maps was read.
const TRIES_PER_GAP: u64 = 8;

/// How far a rel32 operand reaches, with a margin for the image's own size.
const REACH: u64 = (1 << 31) - (64 << 20);

/// The areas of one address space, each filled from its start.
#[derive(Clone, Debug, Default)]
pub struct Areas {
    areas: Vec<Area>,
}

#[derive(Clone, Copy, Debug)]
struct Area {
    start: u64,
    end: u64,
    /// The next free byte.
    next: u64,
}

impl Areas {
    /// `len` bytes in an area within reach of `image`, if one has room.
    pub fn take(&mut self, len: u64, image: &Range<u64>) -> Option<u64> {
        let area = self
            .areas
            .iter_mut()
            .find(|a| a.next + len <= a.end && reaches(a.start, image))?;
        let at = area.next;
        area.next += len;
        Some(at)
    }

    /// `len` bytes anywhere, if an area has room.
    pub fn take_anywhere(&mut self, len: u64) -> Option<u64> {
        let area = self.areas.iter_mut().find(|a| a.next + len <= a.end)?;
        let at = area.next;
        area.next += len;
        Some(at)
    }

    /// A new area of `size` bytes mapped at `start`; its first `len` bytes
    /// are taken.
    pub fn add(&mut self, start: u64, size: u64, len: u64) {
        self.areas.push(Area {
            start,
            end: start + size,
            next: start + len,
        });
    }

    /// True when `addr` lies in an area.
    pub fn contains(&self, addr: u64) -> bool {
        self.areas.iter().any(|a| (a.start..a.end).contains(&addr))
    }

    /// The areas' address ranges, to unmap.
    pub fn ranges(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        self.areas.iter().map(|a| a.start..a.end)
    }

    pub fn is_empty(&self) -> bool {
        self.areas.is_empty()
    }

    pub fn clear(&mut self) {
        self.areas.clear();
    }
}

/// True when an area at `area` can serve code in `image` (rel32 reach both
/// ways; the margin in [`REACH`] covers the area's own size).
pub fn reaches(area: u64, image: &Range<u64>) -> bool {
    let lo = image.end.saturating_sub(REACH);
    let hi = image.start.saturating_add(REACH);
    area >= lo && area + JUMP_AREA_SIZE <= hi
}

/// Candidate addresses for a new area of `size` bytes serving `image`, best
/// first: the highest free places below the image that are in reach, then
/// (unless `below_only`) the lowest above it. The main executable passes
/// `below_only`: the brk heap grows up from its end, and an area there could
/// stop the heap from growing.
pub fn place_area(
    maps: &[Mapping],
    image: &Range<u64>,
    min_addr: u64,
    below_only: bool,
    size: u64,
) -> Vec<u64> {
    let mut gaps = Vec::new();
    let mut prev_end = min_addr.max(0x10000);
    for m in maps {
        if m.start > prev_end {
            gaps.push(prev_end..m.start);
        }
        prev_end = prev_end.max(m.end);
    }
    let fits = |g: &&Range<u64>| g.end - g.start >= size;
    let mut below: Vec<u64> = gaps
        .iter()
        .filter(|g| g.end <= image.start)
        .filter(fits)
        .flat_map(|g| {
            (1..=TRIES_PER_GAP)
                .map(move |i| g.end.wrapping_sub(i * size))
                .take_while(move |&a| a >= g.start && a <= g.end)
        })
        .filter(|&a| reaches(a, image))
        .collect();
    below.sort_unstable_by(|a, b| b.cmp(a));
    let mut above: Vec<u64> = gaps
        .iter()
        .filter(|g| g.start >= image.end)
        .filter(fits)
        .filter(|_| !below_only)
        .flat_map(|g| {
            (0..TRIES_PER_GAP)
                .map(move |i| g.start + i * size)
                .take_while(move |&a| a + size <= g.end)
        })
        .filter(|&a| reaches(a, image))
        .collect();
    above.sort_unstable();
    below.extend(above);
    below
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_areas_in_reach_and_off_the_heap() {
        let map = |start: u64, end: u64| Mapping {
            start,
            end,
            read: true,
            write: false,
            exec: false,
            offset: 0,
            inode: 1,
            path: "/x".into(),
        };
        let maps = vec![
            map(0x400000, 0x500000),                 // static executable
            map(0x7f00_0000_0000, 0x7f00_0020_0000), // a library
            map(0x7ffc_0000_0000, 0x7ffc_0002_1000), // stack
        ];
        let exe = 0x400000..0x500000;
        let spots = place_area(&maps, &exe, 0x10000, true, AREA_SIZE);
        assert_eq!(spots[0], 0x400000 - AREA_SIZE);
        assert!(
            spots.iter().all(|&a| a < 0x400000),
            "nothing above the heap start"
        );
        let lib = 0x7f00_0000_0000..0x7f00_0020_0000;
        let spots = place_area(&maps, &lib, 0x10000, false, AREA_SIZE);
        assert_eq!(spots[0], 0x7f00_0000_0000 - AREA_SIZE);
        assert!(spots.iter().all(|&a| reaches(a, &lib)));
        // Several places per gap, highest first, none overlapping.
        assert_eq!(spots[1], spots[0] - AREA_SIZE);
    }

    #[test]
    fn takes_room_within_reach() {
        let mut areas = Areas::default();
        let lib = 0x7f00_0000_0000..0x7f00_0020_0000;
        assert_eq!(areas.take(64, &lib), None);
        areas.add(0x7f00_0000_0000 - AREA_SIZE, AREA_SIZE, 64);
        assert_eq!(
            areas.take(64, &lib),
            Some(0x7f00_0000_0000 - AREA_SIZE + 64)
        );
        assert_eq!(areas.take(64, &(0x400000..0x500000)), None, "out of reach");
        assert_eq!(areas.take(AREA_SIZE, &lib), None, "full");
        assert!(areas.contains(0x7f00_0000_0000 - 1));
        assert!(!areas.contains(0x7f00_0000_0000));
    }
}
