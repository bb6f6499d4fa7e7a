//! The aggregate tables (docs/schema.md, "Aggregates"): what the
//! [`Aggregator`] kept while the events went by, written when the trace
//! ends (`agg_over_time` as its buckets close). In both modes: a full
//! trace has them beside its events, an `--aggregate` trace instead of them.

use std::collections::HashMap;

use rusqlite::{Connection, params};

use super::SinkError;
use super::rows::int;
use crate::sink::aggregate::{Aggregates, Aggregator, LiveBlock, OverTimeRow};

/// Tables, created with the rest of the schema. `thread` is an
/// `event_threads.code`; `op` a function's name, as in `events.op`.
pub const AGGREGATE_TABLES: &str = "
CREATE TABLE agg_calls(
    stack_id INTEGER,
    thread INTEGER NOT NULL,
    op TEXT NOT NULL,
    calls INTEGER NOT NULL,
    failed INTEGER NOT NULL,
    blocks INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    releases INTEGER NOT NULL,
    temporary INTEGER NOT NULL
);
CREATE TABLE agg_live(
    alloc_id INTEGER PRIMARY KEY,
    ptr INTEGER NOT NULL,
    size INTEGER NOT NULL,
    stack_id INTEGER,
    thread INTEGER NOT NULL,
    op TEXT NOT NULL,
    ts_ns INTEGER NOT NULL
);
CREATE TABLE agg_peak(
    stack_id INTEGER,
    thread INTEGER NOT NULL,
    blocks INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
CREATE TABLE agg_over_time(
    stack_id INTEGER,
    bucket_ns INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    blocks INTEGER NOT NULL
);
CREATE TABLE agg_sizes(
    bucket INTEGER PRIMARY KEY,
    blocks INTEGER NOT NULL
);
CREATE TABLE agg_totals(
    events INTEGER NOT NULL,
    last_event INTEGER NOT NULL,
    last_ns INTEGER NOT NULL,
    peak_bytes INTEGER NOT NULL,
    peak_blocks INTEGER NOT NULL,
    peak_event INTEGER NOT NULL,
    peak_ns INTEGER NOT NULL,
    exec_released_blocks INTEGER NOT NULL,
    exec_released_bytes INTEGER NOT NULL,
    resolution_ns INTEGER NOT NULL
);
";

/// Rows of `agg_over_time` inserted by one statement: a full trace of
/// thousands of stacks closes thousands of rows per bucket.
const OVER_TIME_CHUNK: usize = 128;

/// Store the buckets of the heap over time closed so far, many rows per
/// statement.
pub fn write_over_time(conn: &Connection, rows: &[OverTimeRow]) -> Result<(), SinkError> {
    let statement = |n: usize| {
        format!(
            "INSERT INTO agg_over_time(stack_id, bucket_ns, bytes, blocks) VALUES {}",
            vec!["(?, ?, ?, ?)"; n].join(",")
        )
    };
    // Whole chunks by one statement, the rest one row at a time (one
    // statement each, so the cache holds two).
    let whole = rows.len() / OVER_TIME_CHUNK * OVER_TIME_CHUNK;
    let chunks = rows[..whole]
        .chunks(OVER_TIME_CHUNK)
        .chain(rows[whole..].chunks(1));
    for chunk in chunks {
        let mut insert = conn.prepare_cached(&statement(chunk.len()))?;
        for (i, r) in chunk.iter().enumerate() {
            insert.raw_bind_parameter(4 * i + 1, r.stack.map(int))?;
            insert.raw_bind_parameter(4 * i + 2, int(r.bucket_ns))?;
            insert.raw_bind_parameter(4 * i + 3, int(r.bytes))?;
            insert.raw_bind_parameter(4 * i + 4, int(r.blocks))?;
        }
        insert.raw_execute()?;
    }
    Ok(())
}

/// `finished_leaks`: the blocks of `live` by stack, less those an exec
/// released (`exec_releases` can name a block whose allocation reached the
/// sink after the exec's record: `agg_live` keeps it, `leaks` does not).
/// Summed here rather than by SQL over `agg_live`, which at 2.5 M leaked
/// blocks (100 M calls) costs seconds of the finish.
fn write_leaks_by_stack(
    conn: &Connection,
    live: impl Iterator<Item = LiveBlock>,
) -> Result<(), SinkError> {
    let mut by_stack: HashMap<Option<u64>, (i64, i64)> = HashMap::new();
    for b in live {
        let entry = by_stack.entry(b.stack).or_default();
        entry.0 += 1;
        entry.1 = entry.1.wrapping_add(b.size as i64);
    }
    let mut released = conn.prepare_cached(
        "SELECT l.stack_id, count(*), sum(l.size) FROM exec_releases x
         JOIN agg_live l ON l.alloc_id = x.alloc_id GROUP BY l.stack_id",
    )?;
    let rows = released.query_map([], |r| {
        Ok((
            r.get::<_, Option<i64>>(0)?.map(|s| s as u64),
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
        ))
    })?;
    for row in rows {
        let (stack, blocks, bytes) = row?;
        if let Some(entry) = by_stack.get_mut(&stack) {
            entry.0 -= blocks;
            entry.1 = entry.1.wrapping_sub(bytes);
        }
    }
    let mut insert = conn
        .prepare_cached("INSERT INTO finished_leaks(stack_id, blocks, bytes) VALUES (?, ?, ?)")?;
    for (stack, (blocks, bytes)) in by_stack {
        if blocks > 0 {
            insert.execute(params![stack.map(int), blocks, bytes])?;
        }
    }
    Ok(())
}

/// Store everything the aggregator kept: the end of a trace. Its last
/// bucket over time is closed and stored too.
pub fn write_all(conn: &Connection, aggregator: &mut Aggregator) -> Result<(), SinkError> {
    let a: Aggregates = aggregator.finish();
    write_over_time(conn, &aggregator.take_over_time())?;
    let mut insert = conn.prepare_cached(
        "INSERT INTO agg_calls(stack_id, thread, op, calls, failed, blocks, bytes, releases, temporary)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )?;
    for (k, s) in &a.calls {
        insert.execute(params![
            k.stack.map(int),
            k.thread,
            k.op.name(),
            int(s.calls),
            int(s.failed),
            int(s.blocks),
            int(s.bytes),
            int(s.releases),
            int(s.temporary)
        ])?;
    }
    let mut insert = conn.prepare_cached(
        "INSERT INTO agg_live(alloc_id, ptr, size, stack_id, thread, op, ts_ns)
         VALUES (?, ?, ?, ?, ?, ?, ?)",
    )?;
    // One by one from the aggregator's store: a copy of millions of them
    // (56 bytes each) was the largest thing at the end of a trace.
    for b in aggregator.live_blocks() {
        insert.execute(params![
            int(b.alloc_id),
            int(b.ptr),
            int(b.size),
            b.stack.map(int),
            b.thread,
            b.op.name(),
            int(b.ts_ns)
        ])?;
    }
    write_leaks_by_stack(conn, aggregator.live_blocks())?;
    let mut insert = conn.prepare_cached(
        "INSERT INTO agg_peak(stack_id, thread, blocks, bytes) VALUES (?, ?, ?, ?)",
    )?;
    for r in &a.at_peak {
        insert.execute(params![
            r.stack.map(int),
            r.thread,
            int(r.blocks),
            int(r.bytes)
        ])?;
    }
    let mut insert = conn.prepare_cached("INSERT INTO agg_sizes(bucket, blocks) VALUES (?, ?)")?;
    for (bucket, &blocks) in a.sizes.iter().enumerate() {
        if blocks > 0 {
            insert.execute(params![bucket as i64, int(blocks)])?;
        }
    }
    conn.prepare_cached(
        "INSERT INTO agg_totals(events, last_event, last_ns, peak_bytes, peak_blocks, peak_event,
             peak_ns, exec_released_blocks, exec_released_bytes, resolution_ns)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )?
    .execute(params![
        int(a.events),
        int(a.last_event),
        int(a.last_ns),
        int(a.peak.bytes),
        int(a.peak.blocks),
        int(a.peak.event),
        int(a.peak.ts_ns),
        int(a.exec_released_blocks),
        int(a.exec_released_bytes),
        int(aggregator.resolution_ns())
    ])?;
    Ok(())
}
