//! Events through the `events` view, the pairing of blocks in
//! `allocations` and `leaks`, and `heap_over_time` and `temporary`, against
//! hand-written cases and a model.

use std::collections::{BTreeMap, HashMap};

use rusqlite::Connection;

use super::*;

#[test]
fn events_round_trip_with_op_names() {
    let dir = TempDir::new("events");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    let events = vec![
        Event {
            size: Some(24),
            stack_id: Some(12),
            ..event(1, Op::Malloc, 0x5555_0000_9000)
        },
        Event {
            size: Some(u64::MAX),
            ..event(2, Op::Malloc, 0)
        },
        Event {
            tid: 101,
            size: Some(64),
            align: Some(32),
            ..event(3, Op::PosixMemalign, 0x7f00_0000_1000)
        },
        Event {
            tid: 101,
            old_ptr: Some(0x5555_0000_9000),
            size: Some(48),
            alloc_id: Some(1),
            ..event(4, Op::Realloc, 0x5555_0000_a000)
        },
        Event {
            old_ptr: Some(0x1234),
            size: Some(8),
            ..event(5, Op::Reallocarray, 0x1240)
        },
        Event {
            alloc_id: Some(4),
            ..event(6, Op::Free, 0x5555_0000_a000)
        },
        event(7, Op::Free, 0x9999),
        event(8, Op::Free, 0),
        Event {
            size: None,
            ..event(9, Op::Calloc, 0)
        },
    ];
    for e in &events {
        sink.write(&Record::Event(e.clone())).unwrap();
    }
    sink.finish().unwrap();
    let conn = read(&dir.db());
    let back = stored_events(&conn);
    assert_eq!(back, events);
    let huge: f64 = conn
        .query_row("SELECT size FROM events WHERE id = 2", [], |r| r.get(0))
        .unwrap();
    assert!(huge > 1.8e19);
}

/// The block lives: (ptr, size, op, alloc_id, alloc_ns, free_ns, free_op, free_id).
type Life = (
    i64,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<i64>,
);

fn lives(conn: &Connection, view: &str) -> Vec<Life> {
    conn.prepare(&format!(
        "SELECT ptr, size, op, alloc_id, alloc_ns, free_ns, free_op, free_id FROM {view}
         ORDER BY coalesce(alloc_id, free_id)"
    ))
    .unwrap()
    .query_map([], |r| {
        Ok((
            r.get(0)?,
            r.get(1)?,
            r.get(2)?,
            r.get(3)?,
            r.get(4)?,
            r.get(5)?,
            r.get(6)?,
            r.get(7)?,
        ))
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

fn life(ptr: i64, size: i64, op: &str, alloc_id: i64, free: Option<(&str, i64)>) -> Life {
    (
        ptr,
        Some(size),
        Some(op.into()),
        Some(alloc_id),
        Some(alloc_id * 1000),
        free.map(|(_, id)| id * 1000),
        free.map(|(op, _)| op.into()),
        free.map(|(_, id)| id),
    )
}

#[test]
fn allocations_pair_each_block_with_its_release() {
    let dir = TempDir::new("allocations");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    write_all(
        &mut sink,
        &[
            malloc(1, 0x1000, 10),
            free(2, 0x1000, Some(1)),
            // realloc moving: releases #3's block, allocates its own.
            malloc(3, 0x2000, 20),
            realloc(4, 0x2000, 40, 0x3000, Some(3)),
            // realloc(p, 0) returning NULL: glibc freed p.
            realloc(5, 0x3000, 0, 0, Some(4)),
            // A block from before the trace.
            free(6, 0x9000, None),
            // Failed realloc: the block stays live.
            malloc(7, 0x4000, 70),
            realloc(8, 0x4000, 1 << 40, 0, None),
            // realloc of a block from before the trace.
            realloc(9, 0x8000, 90, 0x5000, None),
            free(10, 0, None),
            malloc(11, 0, 1 << 50),
        ],
    );
    // Before finish the views find the leaks themselves; after it they read
    // open_blocks. Both must say the same.
    sink.commit().unwrap();
    let before = read(&dir.db());
    let unfinished = (lives(&before, "allocations"), lives(&before, "leaks"));
    drop(before);
    sink.finish().unwrap();
    let conn = read(&dir.db());
    assert_eq!(
        query_i64(&conn, "SELECT open_blocks FROM trace_finished"),
        2
    );
    assert_eq!(
        unfinished,
        (lives(&conn, "allocations"), lives(&conn, "leaks"))
    );
    let expected = vec![
        life(0x1000, 10, "malloc", 1, Some(("free", 2))),
        life(0x2000, 20, "malloc", 3, Some(("realloc", 4))),
        life(0x3000, 40, "realloc", 4, Some(("realloc", 5))),
        (
            0x9000,
            None,
            None,
            None,
            None,
            Some(6000),
            Some("free".into()),
            Some(6),
        ),
        life(0x4000, 70, "malloc", 7, None),
        (
            0x8000,
            None,
            None,
            None,
            None,
            Some(9000),
            Some("realloc".into()),
            Some(9),
        ),
        life(0x5000, 90, "realloc", 9, None),
    ];
    assert_eq!(lives(&conn, "allocations"), expected);
    let leaks: Vec<Life> = expected
        .into_iter()
        .filter(|l| l.4.is_some() && l.5.is_none())
        .collect();
    assert_eq!(lives(&conn, "leaks"), leaks);
    let (tid, pid, stack): (i64, i64, Option<i64>) = conn
        .query_row(
            "SELECT tid, pid, alloc_stack_id FROM allocations WHERE alloc_id = 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!((tid, pid, stack), (100, 100, None));
}

/// A tiny deterministic generator (xorshift64*), so the test needs no crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn thousands_of_events_agree_with_a_model() {
    check_against_model("model", 1);
}

/// Ids so far apart that the sink cannot keep its bitset of open blocks:
/// `finish` must find the leaks with SQL, and every id is stored explicitly.
#[test]
fn sparse_event_ids_give_the_same_answers() {
    check_against_model("sparse", 1 << 40);
}

fn leak_ids(conn: &Connection) -> Vec<i64> {
    let mut ids: Vec<i64> = conn
        .prepare("SELECT alloc_id FROM leaks")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    ids.sort_unstable();
    ids
}

/// `leaks_by_stack`: stack -> (blocks, bytes).
fn leaks_by_stack(conn: &Connection) -> BTreeMap<Option<i64>, (i64, i64)> {
    conn.prepare("SELECT stack_id, blocks, bytes FROM leaks_by_stack")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// Thousands of calls from several threads, ids `first..` with gaps (as when
/// the pipeline drops allocator housekeeping), checked against a model of
/// the heap kept in the test: every view must agree with it, row for row,
/// before `finish` and after.
fn check_against_model(name: &str, first: u64) {
    let dir = TempDir::new(name);
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut live: BTreeMap<u64, u64> = BTreeMap::new(); // ptr -> alloc id
    let mut released: HashMap<u64, u64> = HashMap::new(); // alloc id -> release id
    let mut expected_events = Vec::new();
    let mut next_ptr = 0x5555_5555_0000u64;
    let mut id = first - 1;
    for n in 1..=5000u64 {
        id += 1 + u64::from(rng.below(20) == 0);
        let tid = 200 + rng.below(4) as u32;
        let mut e = Event {
            tid,
            stack_id: Some(rng.below(50)),
            ..event(id, Op::Malloc, 0)
        };
        let choice = rng.below(10);
        if choice < 4 || live.is_empty() {
            e.op = [Op::Malloc, Op::Calloc, Op::Memalign][rng.below(3) as usize];
            e.size = Some(1 + rng.below(4096));
            if e.op == Op::Memalign {
                e.align = Some(64);
            }
            next_ptr += 0x40 * (1 + rng.below(8));
            e.ptr = next_ptr;
            live.insert(e.ptr, id);
        } else {
            let nth = rng.below(live.len() as u64) as usize;
            let (&block, &alloc) = live.iter().nth(nth).expect("a live block");
            live.remove(&block);
            released.insert(alloc, id);
            e.alloc_id = Some(alloc);
            if choice < 8 {
                e.op = Op::Free;
                e.ptr = block;
            } else {
                e.op = Op::Realloc;
                e.old_ptr = Some(block);
                e.size = Some(rng.below(8192));
                next_ptr += 0x1000;
                e.ptr = next_ptr;
                live.insert(e.ptr, id);
            }
        }
        sink.write(&Record::Event(e.clone())).unwrap();
        expected_events.push(e);
        if n % 777 == 0 {
            sink.commit().unwrap();
        }
    }
    sink.commit().unwrap();
    let unfinished = leak_ids(&read(&dir.db()));
    let unfinished_by_stack = leaks_by_stack(&read(&dir.db()));
    sink.finish().unwrap();
    let conn = read(&dir.db());
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM events"), 5000);
    let ptr_sum: i64 = expected_events.iter().map(|e| e.ptr as i64).sum();
    assert_eq!(query_i64(&conn, "SELECT sum(ptr) FROM events"), ptr_sum);
    let old_sum: i64 = expected_events
        .iter()
        .filter_map(|e| e.old_ptr)
        .map(|p| p as i64)
        .sum();
    assert_eq!(query_i64(&conn, "SELECT sum(old_ptr) FROM events"), old_sum);
    for tid in 200..204 {
        let n = expected_events.iter().filter(|e| e.tid == tid).count() as i64;
        assert_eq!(
            query_i64(
                &conn,
                &format!("SELECT count(*) FROM events WHERE tid = {tid}")
            ),
            n
        );
    }

    let allocs: Vec<&Event> = expected_events
        .iter()
        .filter(|e| e.op != Op::Free)
        .collect();
    assert_eq!(
        query_i64(&conn, "SELECT count(*) FROM allocations"),
        allocs.len() as i64
    );
    let mut stmt = conn
        .prepare("SELECT alloc_id, ptr, size, free_id, tid FROM allocations")
        .unwrap();
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)? as u64,
                r.get::<_, i64>(1)? as u64,
                r.get::<_, i64>(2)? as u64,
                r.get::<_, Option<i64>>(3)?.map(|v| v as u64),
                r.get::<_, i64>(4)? as u32,
            ))
        })
        .unwrap();
    let by_id: HashMap<u64, &Event> = allocs.iter().map(|e| (e.id, *e)).collect();
    for row in rows {
        let (alloc_id, ptr, size, free_id, tid) = row.unwrap();
        let e = by_id[&alloc_id];
        assert_eq!((ptr, Some(size), tid), (e.ptr, e.size, e.tid));
        assert_eq!(
            free_id,
            released.get(&alloc_id).copied(),
            "block #{alloc_id}"
        );
    }
    let mut leaked: Vec<i64> = live.values().map(|&id| id as i64).collect();
    leaked.sort_unstable();
    assert_eq!(leak_ids(&conn), leaked);
    assert_eq!(unfinished, leaked);
    // By stack: the table `finish` wrote, and the search before it.
    let mut by_stack: BTreeMap<Option<i64>, (i64, i64)> = BTreeMap::new();
    let events_by_id: HashMap<u64, &Event> = expected_events.iter().map(|e| (e.id, e)).collect();
    for id in live.values() {
        let e = events_by_id[id];
        let entry = by_stack.entry(e.stack_id.map(|s| s as i64)).or_default();
        *entry = (entry.0 + 1, entry.1 + e.size.unwrap_or(0) as i64);
    }
    assert!(by_stack.len() > 10, "{} stacks leaked", by_stack.len());
    assert_eq!(leaks_by_stack(&conn), by_stack);
    assert_eq!(unfinished_by_stack, by_stack);

    // heap_over_time, row for row, and temporary: the same walk in the model.
    let mut sizes: HashMap<u64, u64> = HashMap::new(); // alloc id -> size
    let (mut bytes, mut blocks) = (0i64, 0i64);
    let mut last_of_thread: HashMap<u32, u64> = HashMap::new();
    let mut heap = Vec::new();
    let mut temporary = Vec::new();
    for e in &expected_events {
        let mut delta = 0;
        if let Some(alloc) = e.alloc_id {
            delta -= sizes.remove(&alloc).expect("a live block") as i64;
            blocks -= 1;
            if last_of_thread.get(&e.tid) == Some(&alloc) {
                temporary.push(alloc as i64);
            }
        }
        if e.op != Op::Free && e.ptr != 0 {
            let size = e.size.unwrap_or(0);
            sizes.insert(e.id, size);
            delta += size as i64;
            blocks += 1;
        }
        bytes += delta;
        last_of_thread.insert(e.tid, e.id);
        heap.push((e.id as i64, e.ts_ns as i64, delta, bytes, blocks));
    }
    let rows: Vec<(i64, i64, i64, i64, i64)> = conn
        .prepare("SELECT id, ts_ns, delta, bytes, blocks FROM heap_over_time ORDER BY id")
        .unwrap()
        .query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(rows, heap);
    let found: Vec<i64> = conn
        .prepare("SELECT alloc_id FROM temporary ORDER BY alloc_id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    temporary.sort_unstable();
    assert!(!temporary.is_empty(), "the model has temporary blocks");
    assert_eq!(found, temporary);
}

/// Blocks live at an exec are released by it (`exec_releases`): `free_op`
/// `exec` in `allocations`, not in `leaks`, before and after finish,
/// whichever came first to the sink, the exec or the allocation.
#[test]
fn an_exec_releases_the_blocks_live_at_it() {
    let dir = TempDir::new("exec");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    let exec = Record::ExecReleased {
        pid: 100,
        ts_ns: 3500,
        alloc_ids: vec![1, 4],
    };
    write_all(
        &mut sink,
        &[
            malloc(1, 0x1000, 10),
            malloc(2, 0x2000, 20),
            free(3, 0x2000, Some(2)),
            exec,
            // Its allocation reaches the sink after the exec's record.
            malloc(4, 0x4000, 40),
            malloc(5, 0x1000, 50),
        ],
    );
    sink.commit().unwrap();
    let before = read(&dir.db());
    let unfinished = (lives(&before, "allocations"), lives(&before, "leaks"));
    drop(before);
    sink.finish().unwrap();
    let conn = read(&dir.db());
    assert_eq!(
        query_i64(&conn, "SELECT open_blocks FROM trace_finished"),
        1
    );
    let leaks = lives(&conn, "leaks");
    assert_eq!(leaks, [life(0x1000, 50, "malloc", 5, None)]);
    let by_exec = |ptr: i64, size: i64, alloc_id: i64| -> Life {
        (
            ptr,
            Some(size),
            Some("malloc".into()),
            Some(alloc_id),
            Some(alloc_id * 1000),
            Some(3500),
            Some("exec".into()),
            None,
        )
    };
    let mut allocations = lives(&conn, "allocations");
    allocations.sort_by_key(|l| l.3);
    assert_eq!(
        allocations,
        [
            by_exec(0x1000, 10, 1),
            life(0x2000, 20, "malloc", 2, Some(("free", 3))),
            by_exec(0x4000, 40, 4),
            life(0x1000, 50, "malloc", 5, None),
        ]
    );
    let mut before = unfinished.0;
    before.sort_by_key(|l| l.3);
    assert_eq!((before, unfinished.1), (allocations, leaks));
    assert_eq!(
        query_i64(
            &conn,
            "SELECT count(*) FROM allocations WHERE free_op = 'exec' AND pid = 100"
        ),
        2
    );
}
