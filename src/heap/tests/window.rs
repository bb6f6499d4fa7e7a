//! The walk through its window ([`chain::WINDOW`] bytes read at once) on
//! heaps larger than it: chunks whose header or link words straddle a
//! window's end, chunks larger than a window (their bodies never read),
//! damaged sizes at a window's edge.

use super::*;
use crate::heap::chain::WINDOW;

const W: u64 = WINDOW as u64;

/// Memory that counts the bytes asked of it.
struct Counting<'a> {
    mem: &'a Snapshot,
    bytes: std::cell::Cell<u64>,
}

impl crate::memory::Memory for Counting<'_> {
    fn read(&self, addr: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        self.bytes.set(self.bytes.get() + buf.len() as u64);
        self.mem.read(addr, buf)
    }
}

/// A tcache struct (one 0x30 entry), a chunk of `big` bytes in use, then
/// small chunks of every kind: in use, free in a bin, two in a fastbin,
/// one in the tcache; top fills the rest of a heap of `big` + 8 KiB.
fn spanning(big: u64) -> Builder {
    let mut b = Builder::sized(
        big + 0x2000,
        &[
            (0x290, false),
            (big, false),
            (0x30, false),
            (0x100, true),
            (0x40, false),
            (0x20, false),
            (0x20, false),
            (0x30, false),
            (0x30, false),
        ],
    );
    b.bin(1, 3);
    b.fastbin(0, &[5, 6]);
    let user = b.chunk(0) + 16 - HEAP;
    b.heap[user as usize + 2] = 1;
    let entry = b.chunk(8) + 16;
    put(&mut b.heap, user + 128 + 8, entry);
    put(&mut b.heap, entry - HEAP, entry >> 12);
    b
}

fn states(map: &HeapMap) -> Vec<ChunkState> {
    map.arenas[0].chunks.iter().map(|c| c.state).collect()
}

/// The first window is read at the first chunk's `size` (HEAP + 8): as
/// `big` grows 16 bytes at a time, its end moves over every word of the
/// small chunks after `big`: each header, `fd` and `bk` is read across an
/// edge once. The map is the same every time, read live or frozen.
#[test]
fn chunks_across_a_window_edge_read_whole() {
    use ChunkState::*;
    let want = [
        TcacheStruct,
        InUse,
        InUse,
        Free,
        InUse,
        Fastbin,
        Fastbin,
        InUse,
        Tcache,
        Top,
    ];
    let small = 0x30 + 0x100 + 0x40 + 0x20 + 0x20 + 0x30 + 0x30;
    let first_end = HEAP + 8 + W;
    let mut big = W - 0x290 - small - 0x20;
    while HEAP + 0x290 + big <= first_end + 0x10 {
        let b = spanning(big);
        let map = b.read();
        assert_eq!(map.arenas[0].error, None, "big {big:#x}");
        assert_eq!(states(&map), want, "big {big:#x}");
        let size = big + 0x2000;
        let top = size - 0x290 - big - small;
        assert_eq!(
            map.mallinfo(),
            MallInfo {
                arena: size,
                ordblks: 2,
                smblks: 2,
                fsmblks: 0x40,
                fordblks: top + 0x40 + 0x100,
                uordblks: size - top - 0x40 - 0x100,
                keepcost: top,
                ..MallInfo::default()
            },
            "big {big:#x}"
        );
        let frozen = frozen::freeze(
            &b.memory(),
            &glibc(),
            &heap_maps(size, ""),
            Buffers::default(),
        );
        assert_eq!(frozen::thaw(frozen, &NoResidency), map, "big {big:#x}");
        big += 0x10;
    }
}

/// Chunks larger than a window are skipped over by their size: their
/// bodies are never read (here they are not even there: holes in the
/// memory), and the header jumped to is read with a short window.
#[test]
fn a_chunk_larger_than_a_window_is_skipped_over() {
    let held = 2 * W + 0x1000;
    let free = W + 0x2000;
    let size = 4 * W;
    let mut b = Builder::sized(
        size,
        &[(0x290, false), (held, false), (free, true), (0x30, false)],
    );
    b.bin(1, 2);
    let (held_at, free_at) = (b.chunk(1) - HEAP, b.chunk(2) - HEAP);
    // The memory, less each large chunk's body past the window read at
    // its header.
    let hole = |at: u64, len: u64| (at + W + 0x100, at + len - 0x100);
    let holes = [hole(held_at, held), hole(free_at, free)];
    let mut mem = Snapshot::new().with(ARENA, &b.arena).with(MP, &b.mp);
    let mut at = 0;
    for (start, end) in holes {
        mem = mem.with(HEAP + at, &b.heap[at as usize..start as usize]);
        at = end;
    }
    mem = mem.with(HEAP + at, &b.heap[at as usize..]);
    let counting = Counting {
        mem: &mem,
        bytes: Default::default(),
    };
    let map = read_heap(&counting, &glibc(), &heap_maps(size, ""), &NoResidency, 1);
    let a = &map.arenas[0];
    assert_eq!(a.error, None);
    use ChunkState::*;
    assert_eq!(states(&map), [TcacheStruct, InUse, Free, InUse, Top]);
    let sizes: Vec<u64> = a.chunks.iter().map(|c| c.size).collect();
    let top = size - 0x290 - held - free - 0x30;
    assert_eq!(sizes, [0x290, held, free, 0x30, top]);
    assert_eq!((a.bin_blocks, a.bin_bytes), (1, free));
    assert_eq!(
        map.live_blocks(),
        [
            LiveBlock {
                addr: b.chunk(1) + 16,
                usable: held - 8
            },
            LiveBlock {
                addr: b.chunk(3) + 16,
                usable: 0x28
            },
        ]
    );
    // A window, then a short read at each header jumped to: the holes
    // were never read.
    let read = counting.bytes.get();
    let short = chain::AFTER_JUMP as u64;
    assert!(
        read <= W + 2 * short + 0x1000,
        "{read} bytes read of {size}"
    );
    // The same read in a stop.
    let frozen = frozen::freeze(&mem, &glibc(), &heap_maps(size, ""), Buffers::default());
    assert_eq!(&frozen::thaw(frozen, &NoResidency), &map);
}

/// A size damaged where a window ends (the edge inside the chunk's
/// first 32 bytes: `prev_size`, `size`, `fd`, `bk`): the arena fails with
/// its reason and no chunks, as anywhere else.
#[test]
fn a_damaged_size_at_a_window_edge_fails_its_arena() {
    let small = 0x30 + 0x100 + 0x40 + 0x20 + 0x20 + 0x30 + 0x30;
    let first_end = HEAP + 8 + W;
    let mut edges = 0;
    let mut big = W - 0x290 - small - 0x20;
    while HEAP + 0x290 + big <= first_end + 0x10 {
        let this = big;
        big += 0x10;
        let b = spanning(this);
        let Some(&(chunk, _)) = b.chunks[2..]
            .iter()
            .find(|c| c.0 <= first_end && first_end < c.0 + 32)
        else {
            continue;
        };
        edges += 1;
        let header = chunk + 8 - HEAP;
        let size = b.heap.len() as u64;
        for bad in [0x18 | 1, (size + 0x1000) | 1, 0xffff_ffff_ffff_fff1, 0] {
            let mut broken = spanning(this);
            put(&mut broken.heap, header, bad);
            let map = broken.read();
            let a = &map.arenas[0];
            let err = a.error.as_deref().unwrap_or_default();
            assert!(err.contains("bad size"), "{chunk:#x} = {bad:#x}: {err}");
            assert!(a.chunks.is_empty() && map.live_blocks().is_empty());
        }
        // A size that sends the chain past top, into top's body, which
        // is never read.
        let mut broken = spanning(this);
        let at = header as usize;
        let old = u64::from_le_bytes(broken.heap[at..at + 8].try_into().unwrap());
        put(&mut broken.heap, header, old + 0x1000);
        let err = broken.read().arenas[0].error.clone().unwrap();
        assert!(err.contains("outside the heap read"), "{chunk:#x}: {err}");
    }
    assert!(edges >= 7, "{edges} edges");
}

/// A window the walk needs that cannot be read fails the arena with the
/// address; the bytes it skips over need not be readable.
#[test]
fn an_unreadable_window_fails_its_arena() {
    let b = spanning(W);
    let size = b.heap.len() as u64;
    // The small chunks after the large one are gone.
    let cut = (0x290 + W) as usize;
    let mem = Snapshot::new()
        .with(ARENA, &b.arena)
        .with(MP, &b.mp)
        .with(HEAP, &b.heap[..cut]);
    let map = read_heap(&mem, &glibc(), &heap_maps(size, ""), &NoResidency, 1);
    let err = map.arenas[0].error.as_deref().unwrap();
    assert!(err.starts_with("cannot read the heap at "), "{err}");
}
