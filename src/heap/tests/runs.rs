//! Chunks found by address in place ([`ChunkRuns`]): the answer of the
//! index of (address, chunk) pairs it replaced, on arenas whose heaps lie
//! out of address order.

use super::super::walk::ChunkRuns;
use super::*;

/// `sizes` laid out from `start`, one after the other.
fn heap(start: u64, sizes: &[u64]) -> Vec<Chunk> {
    let mut at = start;
    sizes
        .iter()
        .map(|&size| {
            let c = Chunk {
                addr: at,
                size,
                state: ChunkState::InUse,
            };
            at += size;
            c
        })
        .collect()
}

#[test]
fn every_chunk_is_found_where_it_lies_and_nothing_else() {
    // The main arena's brk heap; a thread arena whose newer heap lies
    // below its older one (mmap hands out addresses downwards), the
    // second heap's chunks after the first's as the walk reads them; an
    // arena with no chunk.
    let main = heap(HEAP, &[32, 48, 1024, 32, 4096]);
    let mut thread = heap(0x7f10_0400_0000, &[64, 32, 32, 256]);
    thread.extend(heap(0x7f10_0000_0000, &[16, 32, 2048]));
    let arenas: Vec<&[Chunk]> = vec![&main, &[], &thread];
    let runs = ChunkRuns::new(arenas.iter().copied());
    let mut probes = Vec::new();
    for (ai, chunks) in arenas.iter().enumerate() {
        for (ci, c) in chunks.iter().enumerate() {
            assert_eq!(runs.get(&arenas, c.addr), Some((ai, ci)), "{:#x}", {
                c.addr
            });
            probes.extend([c.addr - 16, c.addr + 8, c.addr + c.size + 16]);
        }
    }
    probes.extend([0, 1, u64::MAX, HEAP - 32, 0x7f10_0800_0000]);
    for addr in probes {
        let brute = arenas.iter().enumerate().find_map(|(ai, chunks)| {
            let ci = chunks.iter().position(|c| c.addr == addr)?;
            Some((ai, ci))
        });
        assert_eq!(runs.get(&arenas, addr), brute, "{addr:#x}");
    }
}

#[test]
fn runs_of_other_arenas_are_not_searched_out_of_bounds() {
    let main = heap(HEAP, &[32, 32]);
    let runs = ChunkRuns::new([main.as_slice()]);
    // Asked with fewer arenas than it was made of: no chunk, no panic.
    assert_eq!(runs.get(&[], HEAP), None);
    assert_eq!(runs.get(&[&main[..1]], HEAP + 32), None);
    assert_eq!(runs.get(&[&main], HEAP + 32), Some((0, 1)));
}
