//! Write the events of a trace again, through the current sink, into a new
//! trace: to check that a change of how events are stored leaves every view
//! as it was (scripts/compare_views compares them).
//!
//! ```text
//! cargo run --release --example replay_trace -- OLD.db NEW.db
//! ```
//!
//! OLD.db may be of any schema version whose `events` view has the
//! documented columns; its `exec_releases` are replayed after the events.
//! Only what the event views read is written (events, and the aggregates
//! and open blocks a clean finish derives from them): not stacks, frames or
//! modules.

use std::collections::BTreeMap;
use std::path::Path;

use memptrace::event::{Event, Op};
use memptrace::sink::{EventSink, Record, SqliteSink};
use rusqlite::types::ValueRef;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [old, new] = args.as_slice() else {
        return Err("usage: replay_trace OLD.db NEW.db".into());
    };
    let conn =
        rusqlite::Connection::open_with_flags(old, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    let mut sink = SqliteSink::create(Path::new(new))?;
    let mut stmt = conn.prepare(
        "SELECT id, ts_ns, pid, tid, op, ptr, size, old_ptr, align, alloc_id, stack_id
         FROM events ORDER BY id",
    )?;
    let mut rows = stmt.query([])?;
    let mut written = 0u64;
    while let Some(row) = rows.next()? {
        let name: String = row.get(4)?;
        let op = Op::RECORDED
            .into_iter()
            .find(|op| op.name() == name)
            .ok_or_else(|| format!("unknown op {name}"))?;
        let number = |i: usize| -> rusqlite::Result<Option<u64>> {
            Ok(match row.get_ref(i)? {
                ValueRef::Integer(n) => Some(n as u64),
                ValueRef::Real(x) => Some(x as u64),
                _ => None,
            })
        };
        let event = Event {
            id: number(0)?.unwrap_or_default(),
            ts_ns: number(1)?.unwrap_or_default(),
            pid: row.get(2)?,
            tid: row.get(3)?,
            op,
            ptr: number(5)?.unwrap_or_default(),
            size: number(6)?,
            old_ptr: number(7)?,
            align: number(8)?,
            alloc_id: number(9)?,
            stack_id: number(10)?,
        };
        sink.write(&Record::Event(event))?;
        written += 1;
        if written % 100_000 == 0 {
            sink.commit()?;
        }
    }
    let mut execs: BTreeMap<(u32, u64), Vec<u64>> = BTreeMap::new();
    let mut stmt = conn.prepare("SELECT pid, ts_ns, alloc_id FROM exec_releases")?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        execs
            .entry((row.get(0)?, row.get::<_, i64>(1)? as u64))
            .or_default()
            .push(row.get::<_, i64>(2)? as u64);
    }
    for ((pid, ts_ns), alloc_ids) in execs {
        sink.write(&Record::ExecReleased {
            pid,
            ts_ns,
            alloc_ids,
        })?;
    }
    sink.finish()?;
    eprintln!("{written} events written to {new}");
    Ok(())
}
