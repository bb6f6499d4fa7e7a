//! Heap snapshots as stored: the arenas, chunks and pages of a map, and
//! `heap_mallinfo` adding up as `HeapMap::mallinfo` does.

use super::*;
use crate::heap::{Arena, Chunk, ChunkState, HeapMap, HeapRange, PageRun, PageState};
use crate::sink::HeapSnapshot;

fn arena(addr: u64, main: bool, top: u64, bins: (u64, u64), fast: (u64, u64)) -> Arena {
    Arena {
        addr,
        main,
        heaps: vec![HeapRange {
            start: addr,
            end: addr + 0x21000,
        }],
        system_mem: 0x21000,
        top_size: top,
        chunks: vec![
            Chunk {
                addr: addr + 0x10,
                size: 0x30,
                state: ChunkState::InUse,
            },
            Chunk {
                addr: addr + 0x40,
                size: 0x100,
                state: ChunkState::Free,
            },
        ],
        bin_blocks: bins.0,
        bin_bytes: bins.1,
        fast_blocks: fast.0,
        fast_bytes: fast.1,
        ..Arena::default()
    }
}

#[test]
fn stores_a_snapshot_and_its_mallinfo() {
    let map = HeapMap {
        arenas: vec![
            arena(0x1000_0000, true, 0x20000, (1, 0x100), (2, 0x40)),
            arena(0x7000_0000, false, 0x18000, (3, 0x900), (0, 0)),
            Arena {
                addr: 0x7400_0000,
                error: Some("chunk 0x7400_0010 has a bad size".into()),
                ..Arena::default()
            },
        ],
        mmapped: vec![Chunk {
            addr: 0x7f00_0000,
            size: 0x4000,
            state: ChunkState::Mmapped,
        }],
        n_mmaps: 1,
        mmapped_mem: 0x4000,
        mmapped_error: None,
        narenas: Some(3),
        pages: vec![PageRun {
            addr: 0x1000_0000,
            pages: 33,
            state: PageState::InUse,
            resident: Some(true),
        }],
    };
    let dir = TempDir::new("heap");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    for (moment, map) in [
        ("attach", Ok(map.clone())),
        ("exit", Err("musl".to_string())),
    ] {
        sink.write(&Record::Heap(Box::new(HeapSnapshot {
            ts_ns: 7,
            pid: 42,
            moment: moment.into(),
            map,
        })))
        .unwrap();
    }
    sink.finish().unwrap();
    let conn = Connection::open(dir.db()).unwrap();
    let m = map.mallinfo();
    let stored: Vec<i64> = conn
        .query_row(
            "SELECT arena, ordblks, smblks, hblks, hblkhd, usmblks, fsmblks, uordblks, fordblks,
                    keepcost FROM heap_mallinfo WHERE snapshot_id = 1",
            [],
            |r| (0..10).map(|i| r.get(i)).collect(),
        )
        .unwrap();
    let expected = [
        m.arena, m.ordblks, m.smblks, m.hblks, m.hblkhd, m.usmblks, m.fsmblks, m.uordblks,
        m.fordblks, m.keepcost,
    ];
    assert_eq!(stored, expected.map(|x| x as i64));
    assert_eq!(m.ordblks, 2 + 1 + 3);
    let count = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, i64>(0)).unwrap();
    assert_eq!(
        count("SELECT count(*) FROM heap_chunks WHERE snapshot_id = 1"),
        5
    );
    assert_eq!(
        count("SELECT count(*) FROM heap_chunks WHERE arena IS NULL AND state = 'mmapped'"),
        1
    );
    assert_eq!(
        count("SELECT count(*) FROM heap_arenas WHERE error IS NOT NULL"),
        1
    );
    assert_eq!(
        count("SELECT sum(pages) FROM heap_pages WHERE resident"),
        33
    );
    let error: String = conn
        .query_row(
            "SELECT error FROM heap_snapshots WHERE moment = 'exit'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(error, "musl");
    // A snapshot with no arena has no mallinfo row.
    assert_eq!(count("SELECT count(*) FROM heap_mallinfo"), 1);
}
