//! The walk on byte buffers: a main arena built by hand the way glibc 2.36
//! lays it out, then broken in the ways a torn or corrupt read would be.

use super::*;
use crate::memory::Snapshot;

mod hostile;
mod runs;
mod window;

const ARENA: u64 = 0x7f00_0000_0000;
const MP: u64 = 0x7f00_0000_2000;
const HEAP: u64 = 0x5500_0000_0000;
const HEAP_SIZE: u64 = 0x2000;

fn glibc() -> Glibc {
    Glibc {
        image: "libc.so.6".into(),
        main_arena: ARENA,
        mp: MP,
        narenas: None,
        layout: Layout::for_sizes(2200, 136).unwrap(),
    }
}

/// The mappings of the hand-made process: the brk heap, then `more`
/// (lines of /proc/PID/maps above it).
fn maps(more: &str) -> Vec<crate::os::procfs::Mapping> {
    heap_maps(HEAP_SIZE, more)
}

/// The same with a brk heap of `size` bytes.
fn heap_maps(size: u64, more: &str) -> Vec<crate::os::procfs::Mapping> {
    crate::os::procfs::parse_maps(&format!(
        "{HEAP:x}-{:x} rw-p 00000000 00:00 0 [heap]\n{more}",
        HEAP + size
    ))
}

/// A hand-made heap: chunk sizes and states, laid out from HEAP; the last
/// is top and fills the heap.
struct Builder {
    arena: Vec<u8>,
    mp: Vec<u8>,
    heap: Vec<u8>,
    chunks: Vec<(u64, u64)>,
}

fn put(buf: &mut [u8], at: u64, value: u64) {
    buf[at as usize..at as usize + 8].copy_from_slice(&value.to_le_bytes());
}

impl Builder {
    /// Chunks of these sizes; `free` marks which are free (PREV_INUSE of
    /// the next cleared).
    fn new(sizes: &[(u64, bool)]) -> Builder {
        Builder::sized(HEAP_SIZE, sizes)
    }

    /// The same in a heap of `heap_size` bytes.
    fn sized(heap_size: u64, sizes: &[(u64, bool)]) -> Builder {
        let l = glibc().layout;
        let mut b = Builder {
            arena: vec![0; 2200],
            mp: vec![0; 136],
            heap: vec![0; heap_size as usize],
            chunks: Vec::new(),
        };
        // Every bin empty: its fd and bk point at its own head.
        for bin in 1..128u64 {
            let head = ARENA + l.bins + (bin - 1) * 16 - 16;
            put(&mut b.arena, l.bins + (bin - 1) * 16, head);
            put(&mut b.arena, l.bins + (bin - 1) * 16 + 8, head);
        }
        put(&mut b.arena, l.next, ARENA);
        put(&mut b.arena, l.system_mem, heap_size);
        put(&mut b.mp, l.sbrk_base, HEAP);
        let mut at = 0;
        let mut prev_free = false;
        for &(size, free) in sizes {
            put(&mut b.heap, at + 8, size | if prev_free { 0 } else { 1 });
            b.chunks.push((HEAP + at, size));
            at += size;
            prev_free = free;
        }
        let top = heap_size - at;
        put(&mut b.heap, at + 8, top | if prev_free { 0 } else { 1 });
        put(&mut b.arena, l.top, HEAP + at);
        b
    }

    fn chunk(&self, i: usize) -> u64 {
        self.chunks[i].0
    }

    /// Put chunk `i` alone in regular bin `bin`.
    fn bin(&mut self, bin: u64, i: usize) {
        let l = glibc().layout;
        let head = ARENA + l.bins + (bin - 1) * 16 - 16;
        let c = self.chunk(i);
        put(&mut self.arena, l.bins + (bin - 1) * 16, c);
        put(&mut self.arena, l.bins + (bin - 1) * 16 + 8, c);
        put(&mut self.heap, c - HEAP + 16, head);
        put(&mut self.heap, c - HEAP + 24, head);
    }

    /// Put chunks in fastbin `bin`, first to last (links mangled).
    fn fastbin(&mut self, bin: u64, chunks: &[usize]) {
        let l = glibc().layout;
        let addrs: Vec<u64> = chunks.iter().map(|&i| self.chunk(i)).collect();
        put(&mut self.arena, l.fastbins + 8 * bin, addrs[0]);
        for (k, &c) in addrs.iter().enumerate() {
            let next = addrs.get(k + 1).copied().unwrap_or(0);
            put(&mut self.heap, c - HEAP + 16, ((c + 16) >> 12) ^ next);
        }
    }

    fn memory(&self) -> Snapshot {
        Snapshot::new()
            .with(ARENA, &self.arena)
            .with(MP, &self.mp)
            .with(HEAP, &self.heap)
    }

    fn read(&self) -> HeapMap {
        let maps = heap_maps(self.heap.len() as u64, "");
        read_heap(&self.memory(), &glibc(), &maps, &NoResidency, 1)
    }
}

/// In use 0x30, free 0x100 (unsorted bin), in use 0x40, two 0x20 fastbin
/// chunks, a 0x290 tcache struct with one 0x30 entry, in use 0x30 in it.
fn sample() -> Builder {
    let mut b = Builder::new(&[
        (0x290, false),
        (0x30, false),
        (0x100, true),
        (0x40, false),
        (0x20, false),
        (0x20, false),
        (0x30, false),
        (0x30, false),
    ]);
    b.bin(1, 2);
    b.fastbin(0, &[4, 5]);
    // The tcache struct (first chunk): counts[1] = 1, entries[1] = chunk 7.
    let user = b.chunk(0) + 16 - HEAP;
    b.heap[user as usize + 2] = 1;
    let entry = b.chunk(7) + 16;
    put(&mut b.heap, user + 128 + 8, entry);
    put(&mut b.heap, entry - HEAP, entry >> 12);
    b
}

#[test]
fn walks_an_arena_and_adds_up_as_mallinfo2() {
    let b = sample();
    let map = b.read();
    let a = &map.arenas[0];
    assert_eq!(a.error, None);
    let states: Vec<ChunkState> = a.chunks.iter().map(|c| c.state).collect();
    use ChunkState::*;
    assert_eq!(
        states,
        [
            TcacheStruct,
            InUse,
            Free,
            InUse,
            Fastbin,
            Fastbin,
            InUse,
            Tcache,
            Top
        ]
    );
    let top = HEAP_SIZE - 0x290 - 0x30 - 0x100 - 0x40 - 0x40 - 0x60;
    assert_eq!(a.top_size, top);
    let m = map.mallinfo();
    assert_eq!(
        m,
        MallInfo {
            arena: HEAP_SIZE,
            ordblks: 2,
            smblks: 2,
            fsmblks: 0x40,
            fordblks: top + 0x40 + 0x100,
            uordblks: HEAP_SIZE - top - 0x40 - 0x100,
            keepcost: top,
            ..MallInfo::default()
        }
    );
    // The program holds three blocks: tcache'd, fastbin'd and the tcache
    // itself are not its.
    let live = map.live_blocks();
    assert_eq!(
        live,
        [
            LiveBlock {
                addr: b.chunk(1) + 16,
                usable: 0x28
            },
            LiveBlock {
                addr: b.chunk(3) + 16,
                usable: 0x38
            },
            LiveBlock {
                addr: b.chunk(6) + 16,
                usable: 0x28
            },
        ]
    );
    let s = a.summary();
    assert_eq!((s.free, s.largest_free, s.blocks), (0x100, 0x100, 3));
    assert_eq!(s.cached, 0x70);
    assert_eq!(s.in_use, 0x290 + 0x30 + 0x40 + 0x30);
    assert_eq!(map.mmapped_error, None);
    // Two pages, both mostly top; residency unknown.
    assert_eq!(
        map.pages,
        [PageRun {
            addr: HEAP,
            pages: 2,
            state: PageState::Top,
            resident: None
        }]
    );
}

/// At attach the heap's chunks are read while the program is stopped and
/// walked once it runs: the map is the one read at once, and what the
/// program writes after the read is in none of it.
#[test]
fn a_heap_copied_then_walked_is_the_heap_read_at_once() {
    let mut b = sample();
    let expected = b.read();
    let frozen = frozen::freeze(&b.memory(), &glibc(), &maps(""), Buffers::default());
    b.heap.fill(0xff);
    b.arena.fill(0xff);
    assert_eq!(frozen::thaw(frozen, &NoResidency), expected);
    assert_eq!(expected.live_blocks().len(), 3);

    // An arena that does not walk: the same error, no chunks.
    let mut broken = sample();
    put(&mut broken.heap, 0x290 + 8, 0x9990 | 1);
    let frozen = frozen::freeze(&broken.memory(), &glibc(), &maps(""), Buffers::default());
    let map = frozen::thaw(frozen, &NoResidency);
    assert_eq!(map, broken.read());
    assert!(map.arenas[0].error.as_deref().unwrap().contains("bad size"));
}

/// The heap is read through a window reserved ahead (faulted in while
/// the program runs), the same map as through a new one.
#[test]
fn a_reserved_window_reads_the_same_heap() {
    let reserved = frozen::reserve();
    assert_eq!(reserved.0.len(), chain::WINDOW);
    let b = sample();
    let frozen = frozen::freeze(&b.memory(), &glibc(), &maps(""), reserved);
    assert_eq!(frozen::thaw(frozen, &NoResidency), b.read());
}

#[test]
fn a_broken_arena_is_reported_not_drawn() {
    // A chunk size running past the heap.
    let mut b = sample();
    put(&mut b.heap, 0x290 + 8, 0x9990 | 1);
    let map = b.read();
    let err = map.arenas[0].error.as_deref().unwrap();
    assert!(err.contains("bad size"), "{err}");
    assert!(map.arenas[0].chunks.is_empty());
    assert!(map.live_blocks().is_empty());
    assert_eq!(map.mallinfo().arena, 0);

    // A free chunk in no bin.
    let mut b = sample();
    let l = glibc().layout;
    let head = ARENA + l.bins - 16;
    put(&mut b.arena, l.bins, head);
    put(&mut b.arena, l.bins + 8, head);
    let err = b.read().arenas[0].error.clone().unwrap();
    assert!(err.contains("in the bins"), "{err}");

    // A fastbin chunk of the wrong size.
    let mut b = sample();
    b.fastbin(1, &[4]);
    assert!(b.read().arenas[0].error.is_some());

    // A chain that misses top.
    let mut b = sample();
    let c = b.chunk(3);
    put(&mut b.arena, l.top, c);
    assert!(b.read().arenas[0].error.is_some());
}

#[test]
fn a_tcache_whose_count_disagrees_is_a_plain_block() {
    let mut b = sample();
    let user = b.chunk(0) + 16 - HEAP;
    b.heap[user as usize + 2] = 2;
    let map = b.read();
    assert_eq!(map.arenas[0].chunks[0].state, ChunkState::InUse);
    assert_eq!(map.arenas[0].chunks[7].state, ChunkState::InUse);
}

#[test]
fn a_locked_arena_is_read_again_then_marked() {
    let mut b = sample();
    b.arena[0] = 1;
    let map = read_heap(&b.memory(), &glibc(), &maps(""), &NoResidency, 3);
    assert!(map.arenas[0].locked);
    // Its copy was still consistent: it is read, and said to be locked.
    assert_eq!(map.arenas[0].error, None);
}

/// Memory that shows its next picture after each read at the arena's
/// start (its mutex): a live arena that threads change between reads.
struct Moving {
    pictures: Vec<Snapshot>,
    reads: std::cell::Cell<usize>,
}

impl crate::memory::Memory for Moving {
    fn read(&self, addr: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let now = self.reads.get();
        if addr == ARENA {
            self.reads.set(now + 1);
        }
        self.pictures[now % self.pictures.len()].read(addr, buf)
    }
}

/// An arena that fails its checks the same way at two reads in a row is
/// damaged; one that fails differently at each read, with its mutex free
/// at every one, was changing under the reader: not damaged.
#[test]
fn only_an_arena_that_fails_the_same_way_twice_is_damaged() {
    let broken = |size: u64| {
        let mut b = sample();
        put(&mut b.heap, 0x290 + 8, size | 1);
        b.memory()
    };
    let still = Moving {
        pictures: vec![broken(0x9990)],
        reads: Default::default(),
    };
    let map = read_heap(&still, &glibc(), &maps(""), &NoResidency, 100);
    let a = &map.arenas[0];
    assert!(a.error.as_deref().unwrap().contains("bad size"), "{a:?}");
    assert!(!a.locked && !a.changing, "{a:?}");
    // Two attempts were enough to prove it.
    assert!(still.reads.get() <= 8, "{} reads", still.reads.get());

    let moving = Moving {
        pictures: (1..=9).map(|k| broken(0x9990 + 0x1000 * k)).collect(),
        reads: Default::default(),
    };
    let map = read_heap(&moving, &glibc(), &maps(""), &NoResidency, 5);
    let a = &map.arenas[0];
    assert!(a.error.is_some(), "{a:?}");
    assert!(!a.locked && a.changing, "{a:?}");

    // Changing, then still at a picture that walks: read right.
    let mut pictures: Vec<Snapshot> = (1..=3).map(|k| broken(0x9990 + 0x1000 * k)).collect();
    pictures.push(sample().memory());
    let settling = Moving {
        pictures,
        reads: Default::default(),
    };
    let map = read_heap(&settling, &glibc(), &maps(""), &NoResidency, 100);
    assert_eq!(map.arenas[0].error, None);
}

#[test]
fn finds_mmapped_blocks_and_moved_aligned_ones() {
    let b = sample();
    let l = glibc().layout;
    let mut mp = b.mp.clone();
    put(&mut mp, l.n_mmaps, 2);
    put(&mut mp, l.mmapped_mem, 0x3000 + 0x2000);
    let mut region = vec![0u8; 0x6000];
    // A plain one at the start: 0x3000 bytes.
    put(&mut region, 8, 0x3000 | 2);
    // An aligned one: mapped at 0x3000, moved up to 0x3ff0 (4096-aligned
    // block), the old header left behind.
    put(&mut region, 0x3000 + 8, 0x2000 | 2);
    put(&mut region, 0x3ff0, 0xff0);
    put(&mut region, 0x3ff8, (0x2000 - 0xff0) | 2);
    let base = 0x7e00_0000_0000;
    let mem = Snapshot::new()
        .with(ARENA, &b.arena)
        .with(MP, &mp)
        .with(HEAP, &b.heap)
        .with(base, &region);
    let maps = maps(&format!(
        "{base:x}-{:x} rw-p 00000000 00:00 0\n",
        base + 0x6000
    ));
    let map = read_heap(&mem, &glibc(), &maps, &NoResidency, 1);
    assert_eq!(map.mmapped_error, None);
    let found: Vec<(u64, u64)> = map.mmapped.iter().map(|c| (c.addr, c.size)).collect();
    assert_eq!(found, [(base, 0x3000), (base + 0x3ff0, 0x2000 - 0xff0)]);
    assert!(map.live_blocks().contains(&LiveBlock {
        addr: base + 0x4000,
        usable: 0x2000 - 0xff0 - 16
    }));
    assert_eq!(map.mallinfo().hblks, 2);

    // glibc counting another block: the found ones are not trusted.
    put(&mut mp, l.n_mmaps, 3);
    let mem = mem.with(MP, &mp);
    let map = read_heap(&mem, &glibc(), &maps, &NoResidency, 1);
    assert!(map.mmapped_error.is_some());
    assert!(map.live_blocks().iter().all(|b| b.addr < base));
}

#[test]
fn layouts_by_symbol_sizes() {
    assert_eq!(Layout::for_sizes(2200, 136).unwrap().n_mmaps, 60);
    assert_eq!(Layout::for_sizes(2200, 112).unwrap().n_mmaps, 40);
    assert!(Layout::for_sizes(2192, 112).is_none());
    assert!(Layout::for_sizes(2200, 80).is_none());
}
