//! The database contract, checked through the views with plain SQL, the way
//! users see it: tables and the trace's life in `tables`, events and the
//! views over them in `events`.

mod encoding;
mod events;
mod heap;
mod tables;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use rusqlite::Connection;

use super::SqliteSink;
use crate::event::{Event, Op};
use crate::sink::{EventSink, Record};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "memptrace-sqlite-{}-{}-{name}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating a temp dir");
        TempDir(dir)
    }

    fn db(&self) -> PathBuf {
        self.0.join("trace.db")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_all(sink: &mut SqliteSink, records: &[Record]) {
    for record in records {
        sink.write(record).expect("writing a record");
    }
}

fn read(path: &Path) -> Connection {
    Connection::open(path).expect("opening the trace for reading")
}

fn query_i64(conn: &Connection, sql: &str) -> i64 {
    conn.query_row(sql, [], |row| row.get(0)).expect(sql)
}

fn event(id: u64, op: Op, ptr: u64) -> Event {
    Event {
        id,
        ts_ns: id.saturating_mul(1000),
        pid: 100,
        tid: 100,
        op,
        ptr,
        size: None,
        old_ptr: None,
        align: None,
        alloc_id: None,
        stack_id: None,
    }
}

fn malloc(id: u64, ptr: u64, size: u64) -> Record {
    Record::Event(Event {
        size: Some(size),
        ..event(id, Op::Malloc, ptr)
    })
}

fn free(id: u64, ptr: u64, alloc_id: Option<u64>) -> Record {
    Record::Event(Event {
        alloc_id,
        ..event(id, Op::Free, ptr)
    })
}

fn realloc(id: u64, old: u64, size: u64, ptr: u64, alloc_id: Option<u64>) -> Record {
    Record::Event(Event {
        old_ptr: Some(old),
        size: Some(size),
        alloc_id,
        ..event(id, Op::Realloc, ptr)
    })
}

fn meta(key: &str, value: &str) -> Record {
    Record::Meta {
        key: key.into(),
        value: value.into(),
    }
}

/// Every row of the `events` view, in id order, as the events written. A
/// number beyond i64::MAX comes back as REAL, so close to what it was.
fn stored_events(conn: &Connection) -> Vec<Event> {
    let mut stmt = conn
        .prepare(
            "SELECT id, ts_ns, pid, tid, op, ptr, size, old_ptr, align, alloc_id, stack_id
             FROM events ORDER BY id",
        )
        .unwrap();
    stmt.query_map([], |r| {
        let op: String = r.get(4)?;
        let opt = |i: usize| -> rusqlite::Result<Option<u64>> {
            Ok(match r.get_ref(i)? {
                rusqlite::types::ValueRef::Real(v) => Some(v as u64),
                other => other.as_i64_or_null()?.map(|v| v as u64),
            })
        };
        let u = |i: usize| opt(i).map(Option::unwrap_or_default);
        Ok(Event {
            id: u(0)?,
            ts_ns: u(1)?,
            pid: r.get(2)?,
            tid: r.get(3)?,
            op: Op::from_name(&op).expect("a known op name"),
            ptr: u(5)?,
            size: opt(6)?,
            old_ptr: opt(7)?,
            align: opt(8)?,
            alloc_id: opt(9)?,
            stack_id: opt(10)?,
        })
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}
