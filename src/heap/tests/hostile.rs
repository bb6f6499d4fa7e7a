//! The walk on memory a program wrote to mislead it, by a stray pointer or
//! on purpose: sizes that wrap the address space, lists that loop, lengths
//! of terabytes. Each is a failed arena (or no mmapped block) with its
//! reason, never a panic, an endless loop or a huge allocation.

use proptest::prelude::*;

use super::*;

const BASE: u64 = 0x7e00_0000_0000;

fn anon(len: u64) -> String {
    format!("{BASE:x}-{:x} rw-p 00000000 00:00 0\n", BASE + len)
}

/// The sample heap beside an anonymous mapping holding `region`.
fn with_region(b: &Builder, region: &[u8]) -> HeapMap {
    let mem = b.memory().with(BASE, region);
    read_heap(
        &mem,
        &glibc(),
        &maps(&anon(region.len() as u64)),
        &NoResidency,
        1,
    )
}

#[test]
fn a_page_whose_header_wraps_the_address_space_is_no_block() {
    // The words that made memptrace divide by zero: prev_size 0 and a
    // size of 2^64 - 4096 with IS_MMAPPED.
    let b = sample();
    let mut region = vec![0u8; 0x3000];
    put(&mut region, 8, 0xffff_ffff_ffff_f002);
    // The same at the last page, where `p + size` wraps to just below it.
    put(&mut region, 0x2000 + 8, 0xffff_ffff_ffff_f002);
    let map = with_region(&b, &region);
    assert_eq!(map.mmapped, []);
    assert_eq!(map.mmapped_error, None);
    assert_eq!(map.arenas[0].error, None);
    assert_eq!(map.live_blocks().len(), 3);
}

#[test]
fn a_fake_mmapped_header_that_fits_disagrees_with_glibc() {
    // Looks like a block of the mapping's size, with a memalign lead that
    // points past its end: found, but glibc counts no mmapped block, so
    // none is trusted.
    let b = sample();
    let mut region = vec![0u8; 0x2000];
    put(&mut region, 8, 0x2000 | 2);
    put(&mut region, 0x1ff0, 0xffff_ffff_ffff_fff0);
    put(&mut region, 0x1ff8, 0x10 | 2);
    let map = with_region(&b, &region);
    assert_eq!(map.mmapped.len(), 1);
    assert_eq!(
        map.mmapped_error.as_deref(),
        Some("found 1 mmapped blocks of 8192 bytes, glibc counts 0 of 0")
    );
    assert_eq!(map.live_blocks().len(), 3);
}

fn arena_error(b: &Builder) -> String {
    let map = b.read();
    assert!(map.arenas[0].chunks.is_empty());
    map.arenas[0].error.clone().expect("the arena was read")
}

#[test]
fn chunk_sizes_that_wrap_fail_the_arena() {
    for size in [0xffff_ffff_ffff_fff0, 0x8000_0000_0000_0000, 0x10] {
        let mut b = sample();
        put(&mut b.heap, 0x290 + 8, size | 1);
        assert!(arena_error(&b).contains("bad size"), "{size:#x}");
    }
    // Top's size running to the end of the address space.
    let mut b = sample();
    let top = b.chunks.iter().map(|c| c.1).sum::<u64>();
    put(&mut b.heap, top + 8, 0xffff_ffff_ffff_fff1);
    assert!(arena_error(&b).contains("does not end its heap"));
    // Top at the very end of the address space.
    let mut b = sample();
    put(&mut b.arena, glibc().layout.top, u64::MAX - 7);
    assert!(arena_error(&b).contains("outside the brk area"));
}

#[test]
fn a_heap_longer_than_its_mapping_is_not_read() {
    // system_mem of 2^60 bytes, top's size to match: the walk would allocate
    // for 2^48 pages.
    let mut b = sample();
    let l = glibc().layout;
    put(&mut b.arena, l.system_mem, 1 << 60);
    let top = b.chunks.iter().map(|c| c.1).sum::<u64>();
    put(&mut b.heap, top + 8, ((1 << 60) - top) | 1);
    assert!(arena_error(&b).contains("is not all mapped"));
    // sbrk_base + system_mem wrapping.
    let mut b = sample();
    put(&mut b.arena, l.system_mem, u64::MAX - 0xfff);
    assert!(arena_error(&b).contains("overflows"));
}

#[test]
fn lists_that_loop_fail_the_arena() {
    // A fastbin chunk whose link points back at itself.
    let mut b = sample();
    let c = b.chunk(4);
    put(&mut b.heap, c - HEAP + 16, ((c + 16) >> 12) ^ c);
    assert!(arena_error(&b).contains("does not belong"));
    // A bin whose chunk's bk points back at itself.
    let mut b = sample();
    let c = b.chunk(2);
    put(&mut b.heap, c - HEAP + 24, c);
    assert!(arena_error(&b).contains("is not a free chunk"));
    // A bin head at the end of the address space.
    let mut b = sample();
    put(&mut b.arena, 0, 0);
    let map = read_heap(
        &b.memory(),
        &Glibc {
            main_arena: u64::MAX - 0x100,
            ..glibc()
        },
        &maps(""),
        &NoResidency,
        1,
    );
    assert!(map.arenas[0].error.is_some());
}

#[test]
fn a_tcache_that_loops_is_a_plain_block() {
    // counts[1] = 65535, and its entry links to itself.
    let mut b = sample();
    let user = b.chunk(0) + 16 - HEAP;
    b.heap[user as usize + 2] = 0xff;
    b.heap[user as usize + 3] = 0xff;
    let entry = b.chunk(7) + 16;
    put(&mut b.heap, entry - HEAP, (entry >> 12) ^ entry);
    let map = b.read();
    assert_eq!(map.arenas[0].error, None);
    assert_eq!(map.arenas[0].chunks[0].state, ChunkState::InUse);
    assert_eq!(map.arenas[0].chunks[7].state, ChunkState::InUse);
}

#[test]
fn a_list_of_arenas_that_loops_ends() {
    // main_arena -> T -> T: T is read (and fails: its bins are zeros), then
    // the loop is reported.
    let t: u64 = 0x7d00_0000_0000;
    let l = glibc().layout;
    let mut b = sample();
    put(&mut b.arena, l.next, t);
    let mut other = vec![0u8; 2200];
    put(&mut other, l.next, t);
    let mem = b.memory().with(t, &other);
    let map = read_heap(&mem, &glibc(), &maps(""), &NoResidency, 1);
    let addrs: Vec<u64> = map.arenas.iter().map(|a| a.addr).collect();
    assert_eq!(addrs, [ARENA, t, t]);
    assert_eq!(map.arenas[0].error, None);
    assert!(map.arenas[1].error.is_some());
    assert_eq!(
        map.arenas[2].error.as_deref(),
        Some("the list of arenas does not return to main_arena (at 0x7d0000000000)")
    );
}

#[test]
fn a_list_of_heaps_that_loops_fails_its_arena() {
    // A thread arena whose heap names itself as the heap before it.
    let h: u64 = 0x7c00_0000_0000;
    let arena = h + 32;
    let l = glibc().layout;
    let mut b = sample();
    put(&mut b.arena, l.next, arena);
    let mut heap = vec![0u8; 0x1000];
    put(&mut heap, 0, arena);
    put(&mut heap, 8, h);
    put(&mut heap, 16, 0x1000);
    put(&mut heap, 32 + l.top, h + 0x900);
    put(&mut heap, 32 + l.next, ARENA);
    let mem = b.memory().with(h, &heap);
    let map = read_heap(&mem, &glibc(), &maps(""), &NoResidency, 1);
    assert_eq!(map.arenas.len(), 2);
    assert_eq!(
        map.arenas[1].error.as_deref(),
        Some("the list of heaps does not end (at 0x7c0000000000)")
    );
}

/// Words a hostile program would pick: edges of the address space, sizes
/// with flags, addresses inside the heap and the arena.
fn nasty_word() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        Just(0xffff_ffff_ffff_f002),
        Just(1 << 63),
        (0u64..0x4000).prop_map(|x| x * 16 + 1),
        (0u64..HEAP_SIZE / 8).prop_map(|x| HEAP + 8 * x),
        (0u64..2200 / 8).prop_map(|x| ARENA + 8 * x),
        (0u64..0x3000 / 8).prop_map(|x| BASE + 8 * x),
        any::<u64>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random words written over the arena, the heap, `mp_` and an
    /// anonymous mapping: the walk returns (the test would hang or panic
    /// otherwise) and what it keeps is inside the memory it was given.
    #[test]
    fn random_words_never_break_the_walk(
        writes in proptest::collection::vec((0u8..4, 0u64..0x3000 / 8, nasty_word()), 1..24)
    ) {
        let mut b = sample();
        let mut region = vec![0u8; 0x3000];
        put(&mut region, 8, 0x1000 | 2);
        let mut mp = b.mp.clone();
        for (target, at, value) in writes {
            let buf = match target {
                0 => &mut b.arena,
                1 => &mut b.heap,
                2 => &mut mp,
                _ => &mut region,
            };
            let at = (8 * at) as usize % (buf.len() - 7) / 8 * 8;
            put(buf, at as u64, value);
        }
        let mem = b.memory().with(MP, &mp).with(BASE, &region);
        let map = read_heap(&mem, &glibc(), &maps(&anon(0x3000)), &NoResidency, 2);
        let inside = |addr: u64, end: u64| {
            (addr >= HEAP && end <= HEAP + HEAP_SIZE) || (addr >= BASE && end <= BASE + 0x3000)
        };
        for block in map.live_blocks() {
            prop_assert!(inside(block.addr, block.addr + block.usable), "{block:?}");
        }
        for run in &map.pages {
            prop_assert!(inside(run.addr, run.addr + run.pages * 4096), "{run:?}");
        }
        let _ = map.mallinfo();
        for a in &map.arenas {
            let _ = a.summary();
        }
    }
}
