//! Events sixteen to a row: every value comes back through the views and
//! through the reports' reader, whatever the group holds (many threads,
//! values above i64::MAX, groups written in pieces and out of order).

use rusqlite::types::Value;

use super::*;
use crate::sink::read_events;

/// `value` as SQLite holds it: REAL above i64::MAX.
fn num(value: u64) -> Value {
    match i64::try_from(value) {
        Ok(v) => Value::Integer(v),
        Err(_) => Value::Real(value as f64),
    }
}

fn opt(value: Option<u64>) -> Value {
    value.map_or(Value::Null, num)
}

fn cases() -> Vec<Event> {
    let mut events: Vec<Event> = (1..=50u64)
        .map(|id| Event {
            // 40 threads: thread codes above 15 widen the group's kinds.
            tid: 100 + (id % 40) as u32,
            ts_ns: 5_000_000_000 + id * 3,
            size: Some(id * 7),
            stack_id: (id % 3 != 0).then_some(id * 1000),
            ..event(id, Op::Malloc, 0x7f00_0000_0000 + id * 64)
        })
        .collect();
    events.extend([
        Event {
            size: Some(u64::MAX),
            stack_id: Some(0),
            ..event(51, Op::Malloc, 0)
        },
        event(52, Op::Free, u64::MAX - 15),
        Event {
            alloc_id: Some(3),
            ..event(53, Op::Free, 0x7f00_0000_0000 + 3 * 64)
        },
        Event {
            old_ptr: Some(0x7f00_0000_0000 + 4 * 64),
            alloc_id: Some(4),
            size: Some(99),
            ..event(54, Op::Realloc, 0x9000)
        },
        Event {
            align: Some(64),
            size: Some(10),
            ..event(55, Op::Memalign, 0x7f00_0000_1000)
        },
        // Out of order: 60 belongs to the group of 48..=55, written before.
        malloc_event(70),
        malloc_event(60),
        malloc_event(80),
    ]);
    events
}

fn malloc_event(id: u64) -> Event {
    Event {
        size: Some(id),
        ..event(id, Op::Malloc, 0x6000 + id)
    }
}

#[test]
fn every_value_comes_back_through_the_groups() {
    let dir = TempDir::new("groups");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    let events = cases();
    for (i, e) in events.iter().enumerate() {
        sink.write(&Record::Event(e.clone())).unwrap();
        // Groups written half full, then again.
        if i == 24 || i == 54 {
            sink.commit().unwrap();
        }
    }
    sink.finish().unwrap();
    let conn = read(&dir.db());
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM event_groups"), 6);
    let mut stmt = conn
        .prepare(
            "SELECT id, ts_ns, tid, op, ptr, size, old_ptr, align, alloc_id, stack_id \
             FROM events ORDER BY id",
        )
        .unwrap();
    let rows: Vec<Vec<Value>> = stmt
        .query_map([], |r| (0..10).map(|i| r.get(i)).collect())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut sorted = events.clone();
    sorted.sort_by_key(|e| e.id);
    let expected: Vec<Vec<Value>> = sorted
        .iter()
        .map(|e| {
            vec![
                num(e.id),
                num(e.ts_ns),
                Value::Integer(i64::from(e.tid)),
                Value::Text(e.op.name().into()),
                num(e.ptr),
                opt(e.size),
                opt(e.old_ptr),
                opt(e.align),
                opt(e.alloc_id),
                opt(e.stack_id),
            ]
        })
        .collect();
    assert_eq!(rows, expected);

    let mut read = Vec::new();
    read_events(&conn, i64::MAX, i64::MAX, |s| read.push(*s)).unwrap();
    assert_eq!(read.len(), sorted.len());
    for (s, e) in read.iter().zip(&sorted) {
        assert_eq!(s.id, e.id as i64);
        assert_eq!(s.ts_ns, e.ts_ns as i64);
        assert_eq!(s.kind & 15, e.op as i64);
        assert_eq!(s.stack_id, e.stack_id.map(|id| id as i64));
        assert_eq!(s.size, if e.op == Op::Free { None } else { e.size });
        assert_eq!(s.alloc_dist, e.alloc_id.map(|a| (e.id - a) as i64));
        let stored = !(e.op == Op::Free && e.alloc_id.is_some());
        assert_eq!(s.ptr_nonzero, stored && e.ptr != 0);
    }
    // Up to an id inside a group.
    let mut upto = Vec::new();
    read_events(&conn, 20, i64::MAX, |s| upto.push(s.id)).unwrap();
    assert_eq!(upto, (1..=20).collect::<Vec<i64>>());
    // Up to a time: the events after it are left out, wherever they are.
    let mut until = Vec::new();
    read_events(&conn, i64::MAX, 5_000_000_030, |s| until.push(s.id)).unwrap();
    let times = sorted.iter().filter(|e| e.ts_ns <= 5_000_000_030);
    assert_eq!(until, times.map(|e| e.id as i64).collect::<Vec<i64>>());
    assert_eq!(crate::sink::last_event(&conn).unwrap(), Some((80, 80_000)));
}
