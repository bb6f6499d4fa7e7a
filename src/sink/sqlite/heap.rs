//! Heap maps in the trace (docs/schema.md, "Heap maps"): one
//! `heap_snapshots` row per map taken, its arenas, chunks and page runs
//! beside it, and `heap_mallinfo`, glibc's `mallinfo2()` of each snapshot
//! computed from the arena rows the way `int_mallinfo` does.

use rusqlite::{Connection, params};

use super::rows::int;
use crate::heap::HeapMap;
use crate::sink::HeapSnapshot;

/// Most `heap_chunks` rows stored per snapshot: a heap of millions of
/// chunks keeps its arena numbers, its pages and its first chunks
/// (`heap_snapshots.chunks` says how many there were).
pub const MAX_CHUNK_ROWS: usize = 2_000_000;

/// Tables and the view, created with the rest of the schema.
pub const HEAP_TABLES: &str = "
CREATE TABLE heap_snapshots(
    id INTEGER PRIMARY KEY,
    ts_ns INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    moment TEXT NOT NULL,
    error TEXT,
    n_mmaps INTEGER,
    mmapped_mem INTEGER,
    mmapped_error TEXT,
    narenas INTEGER,
    chunks INTEGER,
    chunks_stored INTEGER
);
CREATE TABLE heap_arenas(
    snapshot_id INTEGER NOT NULL,
    arena INTEGER NOT NULL,
    kind TEXT NOT NULL,
    heaps INTEGER NOT NULL,
    system INTEGER NOT NULL,
    in_use INTEGER NOT NULL,
    free INTEGER NOT NULL,
    top INTEGER NOT NULL,
    largest_free INTEGER NOT NULL,
    fragmentation REAL NOT NULL,
    blocks INTEGER NOT NULL,
    cached INTEGER NOT NULL,
    resident INTEGER,
    locked INTEGER NOT NULL,
    error TEXT,
    bin_blocks INTEGER NOT NULL,
    bin_bytes INTEGER NOT NULL,
    fast_blocks INTEGER NOT NULL,
    fast_bytes INTEGER NOT NULL
);
CREATE TABLE heap_chunks(
    snapshot_id INTEGER NOT NULL,
    arena INTEGER,
    addr INTEGER NOT NULL,
    size INTEGER NOT NULL,
    state TEXT NOT NULL
);
CREATE TABLE heap_pages(
    snapshot_id INTEGER NOT NULL,
    addr INTEGER NOT NULL,
    pages INTEGER NOT NULL,
    state TEXT NOT NULL,
    resident INTEGER
);
CREATE VIEW heap_mallinfo(snapshot_id, arena, ordblks, smblks, hblks, hblkhd, usmblks,
                          fsmblks, uordblks, fordblks, keepcost) AS
SELECT s.id, sum(a.system), sum(1 + a.bin_blocks), sum(a.fast_blocks), s.n_mmaps,
       s.mmapped_mem, 0, sum(a.fast_bytes),
       sum(a.system - a.top - a.fast_bytes - a.bin_bytes),
       sum(a.top + a.fast_bytes + a.bin_bytes),
       coalesce(max(CASE a.kind WHEN 'main' THEN a.top END), 0)
FROM heap_snapshots s JOIN heap_arenas a ON a.snapshot_id = s.id AND a.error IS NULL
GROUP BY s.id;
";

/// Store one snapshot.
pub fn write(conn: &Connection, snap: &HeapSnapshot) -> rusqlite::Result<()> {
    let (map, error) = match &snap.map {
        Ok(map) => (map, None),
        Err(error) => (&HeapMap::default(), Some(error.as_str())),
    };
    let chunks = map.arenas.iter().map(|a| a.chunks.len()).sum::<usize>() + map.mmapped.len();
    let stored = chunks.min(MAX_CHUNK_ROWS);
    conn.prepare_cached(
        "INSERT INTO heap_snapshots(ts_ns, pid, moment, error, n_mmaps, mmapped_mem,
                                    mmapped_error, narenas, chunks, chunks_stored)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )?
    .execute(params![
        int(snap.ts_ns),
        snap.pid,
        snap.moment,
        error,
        error.is_none().then_some(int(map.n_mmaps)),
        error.is_none().then_some(int(map.mmapped_mem)),
        map.mmapped_error,
        map.narenas.map(int),
        chunks as i64,
        stored as i64
    ])?;
    let id = conn.last_insert_rowid();
    let mut arena_row = conn.prepare_cached(
        "INSERT INTO heap_arenas(snapshot_id, arena, kind, heaps, system, in_use, free, top,
             largest_free, fragmentation, blocks, cached, resident, locked, error,
             bin_blocks, bin_bytes, fast_blocks, fast_bytes)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )?;
    let mut chunk_row = conn.prepare_cached(
        "INSERT INTO heap_chunks(snapshot_id, arena, addr, size, state) VALUES (?, ?, ?, ?, ?)",
    )?;
    let mut left = stored;
    for a in &map.arenas {
        let s = a.summary();
        arena_row.execute(params![
            id,
            int(a.addr),
            if a.main { "main" } else { "thread" },
            int(s.heaps),
            int(s.system),
            int(s.in_use),
            int(s.free),
            int(s.top),
            int(s.largest_free),
            s.fragmentation,
            int(s.blocks),
            int(s.cached),
            s.resident.map(int),
            a.locked,
            a.error,
            int(a.bin_blocks),
            int(a.bin_bytes),
            int(a.fast_blocks),
            int(a.fast_bytes)
        ])?;
        for c in a.chunks.iter().take(left) {
            chunk_row.execute(params![
                id,
                int(a.addr),
                int(c.addr),
                int(c.size),
                c.state.name()
            ])?;
        }
        left -= a.chunks.len().min(left);
    }
    for c in map.mmapped.iter().take(left) {
        chunk_row.execute(params![
            id,
            None::<i64>,
            int(c.addr),
            int(c.size),
            c.state.name()
        ])?;
    }
    let mut page_row = conn.prepare_cached(
        "INSERT INTO heap_pages(snapshot_id, addr, pages, state, resident) VALUES (?, ?, ?, ?, ?)",
    )?;
    for r in &map.pages {
        page_row.execute(params![
            id,
            int(r.addr),
            int(r.pages),
            r.state.name(),
            r.resident
        ])?;
    }
    Ok(())
}
