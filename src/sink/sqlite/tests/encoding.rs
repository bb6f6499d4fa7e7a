//! How events are stored (docs/schema.md, "How events are stored"): every
//! value comes back exactly through the views, whatever the encoding made
//! of it, and finding an event by id stays a B-tree search.

use super::*;

/// Events that test each corner of the encoding: pointers below and above
/// their site's base, far from it, not 16-aligned, 0 and beyond i64::MAX;
/// times before their epoch's base and far after it; ids across epochs,
/// with gaps, and one going back to an epoch already written.
fn corners() -> Vec<Event> {
    let at = |id: u64, ts_ns: u64, op: Op, ptr: u64| Event {
        ts_ns,
        size: (op != Op::Free).then_some(id * 8),
        stack_id: Some(id % 3),
        ..event(id, op, ptr)
    };
    vec![
        at(1, 5_000, Op::Malloc, 0x5555_0000_9000),
        at(2, 5_100, Op::Malloc, 0x5555_0000_8000),
        at(3, 4_000, Op::Malloc, 0x7fff_ffff_f000),
        at(4, 5_200, Op::Malloc, 0x5555_0000_9008),
        at(5, 5_300, Op::Malloc, 0),
        Event {
            size: Some(1),
            ..at(6, 5_400, Op::Malloc, 0xffff_ffff_ffff_f000)
        },
        at(7, 5_500, Op::Free, 0x9999),
        Event {
            alloc_id: Some(2),
            ..at(8, 5_600, Op::Free, 0x5555_0000_8000)
        },
        at(1023, 3_000_000_000_000, Op::Malloc, 0x10),
        at(1024, 3_000_000_000_001, Op::Calloc, 0x7f00_0000_0010),
        Event {
            alloc_id: Some(1),
            old_ptr: Some(0x5555_0000_9000),
            ..at(1025, 3_000_000_000_002, Op::Realloc, 0x5555_0001_0000)
        },
        Event {
            align: Some(64),
            ..at(5000, 3_000_000_100_000, Op::PosixMemalign, 0x5555_0001_0040)
        },
        at(9, 5_700, Op::Malloc, 0x5555_0000_a000),
    ]
}

#[test]
fn every_corner_of_the_encoding_comes_back_exactly() {
    let dir = TempDir::new("corners");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    let events = corners();
    for e in &events {
        sink.write(&Record::Event(e.clone())).unwrap();
    }
    sink.finish().unwrap();
    let conn = read(&dir.db());
    let mut expected = events.clone();
    expected.sort_by_key(|e| e.id);
    // Beyond i64::MAX a pointer is a REAL, as a size is.
    let huge = expected.iter_mut().find(|e| e.id == 6).unwrap();
    huge.ptr = huge.ptr as f64 as u64;
    assert_eq!(stored_events(&conn), expected);
    // Two epochs, and one site per (thread, stack).
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM event_epochs"), 3);
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM event_sites"), 3);
}

/// More sites than `k` holds in 2 bytes, and rows whose NULLs move from
/// column to column between the chunks of rows inserted together (every
/// third event frees the one before it: a chunk of 256 rows starts one
/// step further along the pattern than the last).
#[test]
fn many_threads_and_stacks_keep_their_names() {
    let dir = TempDir::new("sites");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    let ptr = |id: u64| 0x5555_0000_0000 + id * 0x40;
    let events: Vec<Event> = (1..=3000u64)
        .map(|id| Event {
            tid: 100 + (id % 7) as u32,
            stack_id: (id % 5 != 0).then_some(id % 600),
            ts_ns: id * 1_000_000,
            ..if id % 3 == 0 {
                Event {
                    alloc_id: Some(id - 1),
                    ..event(id, Op::Free, ptr(id - 1))
                }
            } else {
                Event {
                    size: Some(id),
                    ..event(id, Op::Malloc, ptr(id))
                }
            }
        })
        .collect();
    for e in &events {
        sink.write(&Record::Event(e.clone())).unwrap();
    }
    sink.finish().unwrap();
    assert_eq!(stored_events(&read(&dir.db())), events);
}

/// The plan of `sql` on a trace of a few events: one line per step.
fn plan(sql: &str) -> Vec<String> {
    let dir = TempDir::new("plan");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    write_all(&mut sink, &[malloc(1, 0x1000, 8), free(2, 0x1000, Some(1))]);
    sink.finish().unwrap();
    let conn = read(&dir.db());
    let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
    stmt.query_map([], |r| r.get::<_, String>(3))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[test]
fn an_event_is_found_by_id_with_a_search() {
    let steps = plan("SELECT * FROM events WHERE id = 2");
    assert!(steps.iter().all(|s| !s.starts_with("SCAN")), "{steps:?}");
    assert!(steps.contains(&"SEARCH e USING INTEGER PRIMARY KEY (rowid=?)".to_string()));
}

#[test]
fn a_release_finds_its_allocation_with_a_search() {
    // The one scan is of the releases; each allocation is a search.
    let steps = plan(
        "SELECT f.id, a.ptr, f.ts_ns - a.ts_ns FROM events f JOIN events a ON a.id = f.alloc_id",
    );
    let scans: Vec<&String> = steps.iter().filter(|s| s.starts_with("SCAN")).collect();
    assert_eq!(scans, ["SCAN e"], "{steps:?}");
    assert!(steps.contains(&"SEARCH e USING INTEGER PRIMARY KEY (rowid=?)".to_string()));
}
