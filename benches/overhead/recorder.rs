//! The recorder on its own: the events of a real benchmark trace, read back
//! into memory, written again through a [`Recorder`] running a
//! [`SqliteSink`], the way a trace writes them (batches from another thread,
//! commits every 500 ms, `finish` at the end). Reading happens before the
//! clock starts. `examples/sink_throughput.rs` does the same with a synthetic
//! workload of more varied stacks and threads.

use std::path::Path;
use std::time::Instant;

use memptrace::event::{Event, Op};
use memptrace::sink::{
    FrameRecord, ModuleRecord, Record, Recorder, SqliteSink, StackNode, ThreadRecord,
};
use rusqlite::Connection;

const BATCH: usize = 1024;

pub struct Replay {
    pub events: u64,
    /// Until the last batch was handed over and written, finish included.
    pub events_per_s: f64,
    pub bytes_per_event: f64,
}

fn get_u64(row: &rusqlite::Row, i: usize) -> rusqlite::Result<Option<u64>> {
    Ok(row.get::<_, Option<i64>>(i)?.map(|v| v as u64))
}

/// Everything of `source` a sink needs before and with its first `limit` events.
fn read(source: &Path, limit: u64) -> rusqlite::Result<(Vec<Vec<Record>>, u64)> {
    let conn = Connection::open(source)?;
    let mut head = Vec::new();
    let mut stmt = conn
        .prepare("SELECT id, pid, path, build_id, start, \"end\", base, loaded_ns FROM modules")?;
    for m in stmt.query_map([], |r| {
        Ok(Record::Module(ModuleRecord {
            id: r.get::<_, i64>(0)? as u64,
            pid: r.get(1)?,
            path: r.get(2)?,
            build_id: r.get(3)?,
            start: r.get::<_, i64>(4)? as u64,
            end: r.get::<_, i64>(5)? as u64,
            base: r.get::<_, i64>(6)? as u64,
            loaded_ns: r.get::<_, i64>(7)? as u64,
            static_exe: false,
        }))
    })? {
        head.push(m?);
    }
    let mut stmt = conn.prepare("SELECT tid, pid, name, start_ns, end_ns FROM threads")?;
    for t in stmt.query_map([], |r| {
        Ok(Record::Thread(ThreadRecord {
            tid: r.get(0)?,
            pid: r.get(1)?,
            name: r.get(2)?,
            start_ns: r.get::<_, i64>(3)? as u64,
            end_ns: get_u64(r, 4)?,
        }))
    })? {
        head.push(t?);
    }
    let mut stmt = conn.prepare("SELECT id, ip, module_id FROM frames ORDER BY id")?;
    for f in stmt.query_map([], |r| {
        Ok(Record::Frame(FrameRecord {
            id: r.get::<_, i64>(0)? as u64,
            ip: r.get::<_, i64>(1)? as u64,
            module_id: get_u64(r, 2)?,
        }))
    })? {
        head.push(f?);
    }
    let mut stmt = conn.prepare("SELECT id, parent_id, frame_id, depth FROM stacks ORDER BY id")?;
    for s in stmt.query_map([], |r| {
        Ok(Record::StackNode(StackNode {
            id: r.get::<_, i64>(0)? as u64,
            parent_id: get_u64(r, 1)?,
            frame_id: r.get::<_, i64>(2)? as u64,
            depth: r.get(3)?,
            trust: memptrace::sink::Trust::Cfi,
        }))
    })? {
        head.push(s?);
    }
    let mut batches = vec![head];
    let mut stmt = conn.prepare(
        "SELECT id, ts_ns, pid, tid, op, ptr, size, old_ptr, align, alloc_id, stack_id
         FROM events ORDER BY id LIMIT ?1",
    )?;
    let mut batch = Vec::with_capacity(BATCH);
    let mut events = 0;
    let rows = stmt.query_map([limit as i64], |r| {
        let op: String = r.get(4)?;
        Ok(Event {
            id: r.get::<_, i64>(0)? as u64,
            ts_ns: r.get::<_, i64>(1)? as u64,
            pid: r.get(2)?,
            tid: r.get(3)?,
            op: Op::from_name(&op).unwrap_or(Op::Malloc),
            ptr: r.get::<_, i64>(5)? as u64,
            size: get_u64(r, 6)?,
            old_ptr: get_u64(r, 7)?,
            align: get_u64(r, 8)?,
            alloc_id: get_u64(r, 9)?,
            stack_id: get_u64(r, 10)?,
        })
    })?;
    for event in rows {
        batch.push(Record::Event(event?));
        events += 1;
        if batch.len() == BATCH {
            batches.push(std::mem::replace(&mut batch, Vec::with_capacity(BATCH)));
        }
    }
    batches.push(batch);
    Ok((batches, events))
}

/// Replay up to `limit` events of `source` into a new database at `target`.
pub fn replay(source: &Path, target: &Path, limit: u64) -> Result<Replay, String> {
    let (batches, events) = read(source, limit).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(target);
    let sink = SqliteSink::create(target).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let recorder = Recorder::spawn(Box::new(sink));
    let sender = recorder.sender();
    for batch in batches {
        sender.send(batch).map_err(|e| e.to_string())?;
    }
    drop(sender);
    recorder.finish().map_err(|e| e.to_string())?;
    let took = started.elapsed().as_secs_f64();
    let bytes = std::fs::metadata(target).map_err(|e| e.to_string())?.len();
    let _ = std::fs::remove_file(target);
    Ok(Replay {
        events,
        events_per_s: events as f64 / took,
        bytes_per_event: bytes as f64 / events.max(1) as f64,
    })
}
