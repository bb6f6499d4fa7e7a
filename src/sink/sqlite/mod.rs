//! SQLite storage for a trace: the file people query with `sqlite3` while the
//! trace runs and after it.
//!
//! One connection in WAL mode. Everything written between two
//! [`EventSink::commit`] calls is one transaction, begun at the first write
//! after a commit, so readers see whole batches and a memptrace killed by
//! SIGKILL leaves every committed batch readable and consistent. Events are
//! the hot path (millions per second must fit): they are encoded compactly
//! (see `docs/schema.md`, "How events are stored") and inserted many rows per
//! statement. Nothing a view needs may be built only by [`EventSink::finish`]:
//! a trace that never finished must be queryable as it is.

mod aggregates;
mod decode;
mod heap;
mod nodes;
mod rows;
mod schema;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::Path;

use rusqlite::{Connection, params};

use super::aggregate::Aggregator;
use super::{EventSink, FrameSymbols, Record, SinkError};
use crate::event::Event;
pub use decode::EventDecoder;
use nodes::NodeRows;
pub use rows::RAW_PTR;
use rows::{Coder, EventRow, Num, int, write_map};
pub use schema::{APPLICATION_ID, SCHEMA_VERSION};

/// Events inserted by one multi-row statement: SQLite's per-statement cost
/// (step, reset, the statement cache) is paid once per chunk. 256 rows of 7
/// parameters stay far below SQLite's limit of 32766 parameters.
const CHUNK: usize = 256;

/// Larger pages than SQLite's 4 KiB default: fewer page splits and a
/// shallower table for an append-only log (measured: about 8 % faster,
/// same size; see examples/sink_throughput.rs).
const PAGE_SIZE: i64 = 16 * 1024;

/// Columns of `event_log`, in table order.
const EVENT_COLUMNS: usize = 7;

/// Page cache of the writing connection, in KiB (SQLite's negative
/// `cache_size`). Events are appended (no index on `event_log`): a page
/// once full is not read again, and a commit interval (at most
/// `COMMIT_RECORDS` rows, about 1 MiB) fits many times over; SQLite spills
/// to the WAL what does not. 64 MiB filled up and stayed: 66 MiB of
/// memptrace's heap at 5 M calls, for no gain in CPU (issue 19 item 6).
const CACHE_KIB: i64 = 8 * 1024;

/// Room kept on the database's filesystem for the end of a trace whose disk
/// fills up (see [`crate::os::room`]): the end's rows, the call sites and
/// the blocks still open, written twice (WAL, then the database).
const ROOM: u64 = 8 << 20;

/// Buckets of the heap over time until [`SqliteSink::aggregate`] says
/// otherwise: `--resolution`'s default, 100 ms.
const DEFAULT_RESOLUTION_NS: u64 = 100_000_000;

/// SQLite's largest `max_page_count`: no limit.
const NO_PAGE_LIMIT: i64 = 0xffff_fffe;

/// A trace database being written.
pub struct SqliteSink {
    /// `None` once finished.
    conn: Option<Connection>,
    in_transaction: bool,
    /// A write or commit failed: every later call fails too.
    failed: bool,
    /// Events waiting for a full [`CHUNK`]; written before every commit.
    pending: Vec<EventRow>,
    /// The epochs and sites the rows are encoded against.
    coder: Coder,
    /// Stack nodes waiting likewise.
    nodes: NodeRows,
    /// (pid, tid) -> code in `event_threads`.
    thread_codes: HashMap<(u32, u32), i64>,
    /// The SQL of the statement inserting [`CHUNK`] events.
    chunk_sql: String,
    /// The largest event id written, to let SQLite number consecutive ones.
    last_id: u64,
    /// The (pid, tid) of the last event and its code: most events repeat it.
    last_thread: ((u32, u32), i64),
    /// Room given back when the disk is full, for the end (none when the
    /// filesystem could not allocate it).
    room: Option<std::fs::File>,
    /// The directory of the database, and `--max-size` in bytes.
    dir: std::path::PathBuf,
    max_size: Option<u64>,
    /// The storage could not grow: the events after the last commit before
    /// that are not stored.
    stopped_growing: bool,
    /// The reports' figures, kept as the events go by, in both modes; its
    /// live blocks are the leaks, if the trace ended now.
    aggregator: Aggregator,
    /// `--aggregate`: no `event_log` rows, only the aggregates.
    aggregate_only: bool,
}

impl SqliteSink {
    /// Open (or create) the database at `path` and create the schema. The file
    /// must be new or empty: the schema is created, not reused.
    pub fn create(path: &Path) -> Result<SqliteSink, SinkError> {
        let conn = Connection::open(path)?;
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
            _ => std::path::PathBuf::from("."),
        };
        // page_size must be set before the first table exists.
        conn.pragma_update(None, "page_size", PAGE_SIZE)?;
        let mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "wal", |row| row.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(SinkError::Io(std::io::Error::other(format!(
                "{}: SQLite refused WAL mode (got {mode}); readers could not follow the trace",
                path.display()
            ))));
        }
        // A crash of memptrace (even SIGKILL) loses nothing committed with
        // synchronous=OFF: the WAL is in the page cache. Only a power loss
        // could, and a trace is not worth an fsync per commit.
        conn.pragma_update(None, "synchronous", "OFF")?;
        conn.pragma_update(None, "cache_size", -CACHE_KIB)?;
        conn.pragma_update(None, "temp_store", "MEMORY")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.set_prepared_statement_cache_capacity(32);

        conn.execute_batch(&format!(
            "BEGIN;\n{}\nPRAGMA user_version = {};\nPRAGMA application_id = {};\nCOMMIT;",
            schema::ddl(),
            schema::SCHEMA_VERSION,
            schema::APPLICATION_ID
        ))?;

        let row = format!("({})", ["?"; EVENT_COLUMNS].join(","));
        let chunk_sql = format!(
            "INSERT INTO event_log VALUES {}",
            vec![row.as_str(); CHUNK].join(",")
        );
        Ok(SqliteSink {
            conn: Some(conn),
            in_transaction: false,
            failed: false,
            pending: Vec::with_capacity(CHUNK),
            coder: Coder::default(),
            nodes: NodeRows::default(),
            thread_codes: HashMap::new(),
            chunk_sql,
            last_id: 0,
            last_thread: ((0, 0), -1),
            room: crate::os::room::keep(&dir, ROOM).ok(),
            dir,
            max_size: None,
            stopped_growing: false,
            aggregator: Aggregator::new(DEFAULT_RESOLUTION_NS),
            aggregate_only: false,
        })
    }

    /// Let the database grow to `bytes` at most (`--max-size`): a write past
    /// it fails as on a full disk, and the trace ends the same way.
    pub fn limit(&mut self, bytes: u64) -> Result<(), SinkError> {
        let pages = (bytes / PAGE_SIZE as u64).clamp(1, NO_PAGE_LIMIT as u64);
        self.conn()?
            .pragma_update(None, "max_page_count", pages as i64)?;
        self.max_size = Some(bytes);
        Ok(())
    }

    /// Keep the heap over time in buckets of `resolution_ns`, and when
    /// `aggregate_only` (`--aggregate`) store no row per event, only the
    /// aggregates. Before the first event.
    pub fn aggregate(&mut self, aggregate_only: bool, resolution_ns: u64) {
        self.aggregator = Aggregator::new(resolution_ns);
        self.aggregate_only = aggregate_only;
    }

    /// After a failed write the transaction may be gone (SQLite rolls back on
    /// a full disk, for one) and with it rows the sink counted on, such as
    /// the id of the last event: stop rather than write wrong data.
    fn check(&self) -> Result<(), SinkError> {
        if self.failed {
            return Err(SinkError::Stopped(
                "an earlier write to the trace database failed".into(),
            ));
        }
        Ok(())
    }

    fn conn(&self) -> Result<&Connection, SinkError> {
        self.conn.as_ref().ok_or_else(closed)
    }

    fn begin(&mut self) -> Result<(), SinkError> {
        if !self.in_transaction {
            self.conn()?.execute_batch("BEGIN")?;
            self.in_transaction = true;
        }
        Ok(())
    }

    fn write_event(&mut self, event: &Event) -> Result<(), SinkError> {
        let thread = self.thread_code(event.pid, event.tid)?;
        self.aggregator.add(event, thread as u32);
        if self.aggregate_only {
            return Ok(());
        }
        let conn = self.conn.as_ref().ok_or_else(closed)?;
        let mut row = self.coder.encode(conn, event, thread)?;
        // SQLite gives a row without an id the largest id plus one, without
        // the search that checks an explicit id is new: ids come in
        // increasing order, and nearly always one apart.
        if self.last_id.checked_add(1) == Some(event.id) {
            row.id = Num::Null;
        }
        self.last_id = self.last_id.max(event.id);
        self.pending.push(row);
        if self.pending.len() < CHUNK {
            return Ok(());
        }
        {
            // A statement comes from the cache with every parameter NULL
            // (rusqlite clears them when it takes it back) and runs once
            // here: only the other values are bound, a third of them.
            let mut stmt = self.conn()?.prepare_cached(&self.chunk_sql)?;
            let values = self.pending.iter().flat_map(EventRow::values);
            for (index, value) in values.enumerate() {
                if value != Num::Null {
                    stmt.raw_bind_parameter(index + 1, value)?;
                }
            }
            stmt.raw_execute()?;
        }
        self.pending.clear();
        Ok(())
    }

    fn write_node(&mut self, node: &super::StackNode) -> Result<(), SinkError> {
        let conn = self.conn.as_ref().ok_or_else(closed)?;
        Ok(self.nodes.push(conn, node)?)
    }

    /// Write the stack nodes and sites waiting: the rows of the
    /// transaction refer to them.
    fn flush_nodes(&mut self) -> Result<(), SinkError> {
        let conn = self.conn.as_ref().ok_or_else(closed)?;
        self.coder.flush_sites(conn)?;
        Ok(self.nodes.flush(conn)?)
    }

    /// Write events that did not fill a chunk, one row at a time.
    fn flush_events(&mut self) -> Result<(), SinkError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        {
            let mut stmt = self
                .conn()?
                .prepare_cached("INSERT INTO event_log VALUES (?,?,?,?,?,?,?)")?;
            for row in &self.pending {
                for (index, value) in row.values().into_iter().enumerate() {
                    stmt.raw_bind_parameter(index + 1, value)?;
                }
                stmt.raw_execute()?;
            }
        }
        self.pending.clear();
        Ok(())
    }

    /// The small integer standing for (pid, tid) in `event_log.kind`.
    fn thread_code(&mut self, pid: u32, tid: u32) -> Result<i64, SinkError> {
        if self.last_thread.0 == (pid, tid) {
            return Ok(self.last_thread.1);
        }
        if let Some(&code) = self.thread_codes.get(&(pid, tid)) {
            self.last_thread = ((pid, tid), code);
            return Ok(code);
        }
        let code = self.thread_codes.len() as i64;
        self.conn()?
            .prepare_cached("INSERT INTO event_threads(code, pid, tid) VALUES (?, ?, ?)")?
            .execute(params![code, pid, tid])?;
        self.thread_codes.insert((pid, tid), code);
        self.last_thread = ((pid, tid), code);
        Ok(code)
    }

    fn write_symbols(&mut self, symbols: &FrameSymbols) -> Result<(), SinkError> {
        let conn = self.conn()?;
        // The frame is named after the function whose machine code it is (the
        // outermost line); the inlined functions are in frame_lines.
        let real = symbols.lines.last().cloned().unwrap_or_default();
        let stored = conn
            .prepare_cached(
                "UPDATE frames SET function = ?, file = ?, line = ?, wrapper = ? WHERE id = ?",
            )?
            .execute(params![
                real.function,
                real.file,
                real.line,
                i64::from(symbols.wrapper),
                int(symbols.frame_id)
            ])?;
        if stored == 0 {
            // Not stored (dropped when the storage could not grow).
            return Ok(());
        }
        conn.prepare_cached("DELETE FROM frame_lines WHERE frame_id = ?")?
            .execute([int(symbols.frame_id)])?;
        let mut insert = conn.prepare_cached(
            "INSERT INTO frame_lines(frame_id, idx, function, file, line) VALUES (?, ?, ?, ?, ?)",
        )?;
        for (idx, line) in symbols.lines.iter().enumerate() {
            insert.execute(params![
                int(symbols.frame_id),
                idx as i64,
                line.function,
                line.file,
                line.line
            ])?;
        }
        Ok(())
    }

    fn write_other(&mut self, record: &Record) -> Result<(), SinkError> {
        let conn = self.conn()?;
        match record {
            Record::Meta { key, value } => {
                conn.prepare_cached("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)")?
                    .execute(params![key, value])?;
            }
            Record::Module(m) => {
                conn.prepare_cached(
                    "INSERT OR REPLACE INTO modules(id, pid, path, build_id, start, \"end\", base, loaded_ns)
                     VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                )?
                .execute(params![
                    int(m.id),
                    m.pid,
                    m.path,
                    m.build_id,
                    int(m.start),
                    int(m.end),
                    int(m.base),
                    int(m.loaded_ns)
                ])?;
            }
            Record::ModuleUnloaded { id, ts_ns } => {
                conn.prepare_cached("UPDATE modules SET unloaded_ns = ? WHERE id = ?")?
                    .execute([int(*ts_ns), int(*id)])?;
            }
            Record::Thread(t) => {
                conn.prepare_cached(
                    "INSERT OR REPLACE INTO threads(tid, pid, name, start_ns, end_ns)
                     VALUES (?, ?, ?, ?, ?)",
                )?
                .execute(params![
                    t.tid,
                    t.pid,
                    t.name,
                    int(t.start_ns),
                    t.end_ns.map(int)
                ])?;
            }
            Record::Frame(f) => {
                // An upsert, so a frame sent twice keeps its symbols.
                conn.prepare_cached(
                    "INSERT INTO frames(id, ip, module_id) VALUES (?, ?, ?)
                     ON CONFLICT(id) DO UPDATE SET ip = excluded.ip, module_id = excluded.module_id",
                )?
                .execute(params![int(f.id), int(f.ip), f.module_id.map(int)])?;
            }
            Record::Map(m) => write_map(conn, m)?,
            Record::Heap(snap) => heap::write(conn, snap)?,
            Record::Rss(r) => {
                conn.prepare_cached(
                    "INSERT INTO rss(ts_ns, pid, rss, anon, file, shmem, mapped) \
                     VALUES (?, ?, ?, ?, ?, ?, ?)",
                )?
                .execute(params![
                    int(r.ts_ns),
                    r.pid,
                    int(r.rss),
                    int(r.anon),
                    int(r.file),
                    int(r.shmem),
                    int(r.mapped)
                ])?;
            }
            Record::ExecReleased {
                pid,
                ts_ns,
                alloc_ids,
            } => {
                let mut insert = conn.prepare_cached(
                    "INSERT OR REPLACE INTO exec_releases(alloc_id, ts_ns, pid) VALUES (?, ?, ?)",
                )?;
                for id in alloc_ids {
                    insert.execute(params![int(*id), int(*ts_ns), pid])?;
                }
            }
            Record::Event(_) | Record::Symbols(_) | Record::StackNode(_) => {}
        }
        Ok(())
    }
}

fn closed() -> SinkError {
    SinkError::Stopped("the trace database is already closed".into())
}

impl EventSink for SqliteSink {
    fn write(&mut self, record: &Record) -> Result<(), SinkError> {
        self.check()?;
        if let Record::ExecReleased { alloc_ids, .. } = record {
            self.aggregator.exec_released(alloc_ids);
        }
        let result = self.begin().and_then(|()| match record {
            Record::Event(event) => self.write_event(event),
            Record::StackNode(node) => self.write_node(node),
            Record::Symbols(symbols) => self.write_symbols(symbols),
            other => self.write_other(other),
        });
        self.failed = result.is_err();
        result
    }

    fn commit(&mut self) -> Result<(), SinkError> {
        self.check()?;
        if !self.in_transaction {
            return Ok(());
        }
        let over_time = self.aggregator.take_over_time();
        let result = self
            .flush_events()
            .and_then(|()| self.flush_nodes())
            .and_then(|()| aggregates::write_over_time(self.conn()?, &over_time))
            .and_then(|()| Ok(self.conn()?.execute_batch("COMMIT")?));
        self.failed = result.is_err();
        self.in_transaction = false;
        result
    }

    fn finish(&mut self) -> Result<(), SinkError> {
        self.commit()?;
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        // The blocks still live, stored once: until this commits, `leaks`
        // finds them on every query (correct, and slower). And the call
        // sites, now that the frames are named and marked.
        conn.execute_batch("BEGIN")?;
        if self.stopped_growing {
            // `events` counts the calls the trace saw: those stored, here.
            conn.execute_batch(
                "INSERT OR REPLACE INTO meta(key, value) SELECT 'events', count(*) FROM event_log",
            )?;
        }
        conn.execute_batch(schema::CALL_SITES_AT_FINISH)?;
        // A full trace whose storage stopped growing lost events the
        // aggregator saw: its reports read the events stored instead, and
        // its leaks are found by the query behind `leaks`. Otherwise the
        // blocks still live are the aggregator's.
        if self.stopped_growing && !self.aggregate_only {
            conn.execute_batch(&format!(
                "INSERT INTO open_blocks(alloc_id) SELECT a.id FROM event_log a WHERE {}",
                schema::unreleased("a")
            ))?;
        } else {
            aggregates::write_all(&conn, &mut self.aggregator)?;
            if !self.aggregate_only {
                conn.execute_batch(
                    "INSERT INTO open_blocks(alloc_id) SELECT alloc_id FROM agg_live",
                )?;
            }
        }
        // Blocks an exec released are not open, whichever order their
        // allocation and the exec reached the sink in.
        conn.execute_batch(
            "DELETE FROM open_blocks WHERE alloc_id IN (SELECT alloc_id FROM exec_releases);
             INSERT INTO trace_finished(open_blocks) SELECT count(*) FROM open_blocks;",
        )?;
        // The leaks by stack (`leaks_by_stack`) were summed with the
        // aggregates; a trace without them sums `leaks`, now that the trace
        // is finished `open_blocks` joined with the events.
        if self.stopped_growing && !self.aggregate_only {
            conn.execute_batch(
                "INSERT INTO finished_leaks(stack_id, blocks, bytes)
                 SELECT alloc_stack_id, count(*), sum(size) FROM leaks GROUP BY alloc_stack_id;",
            )?;
        }
        conn.execute_batch("COMMIT")?;
        // Leave a plain rollback-journal database: no -wal/-shm beside it, and
        // it opens read-only (a copy, a read-only mount). If a reader still
        // has it open, SQLite keeps WAL mode; the data is complete either way
        // and the last connection to close removes the WAL.
        conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")?;
        let _ = conn.pragma_update(None, "journal_mode", "delete");
        conn.close().map_err(|(_, err)| SinkError::Sqlite(err))
    }

    fn cannot_grow(&mut self, err: &SinkError) -> Option<String> {
        let SinkError::Sqlite(rusqlite::Error::SqliteFailure(failure, _)) = err else {
            return None;
        };
        let reason = match failure.code {
            // The limit, unless the disk filled up first (little room left).
            rusqlite::ErrorCode::DiskFull
                if self.max_size.is_some()
                    && crate::os::room::available(&self.dir).is_ok_and(|n| n >= ROOM) =>
            {
                format!(
                    "the trace database reached --max-size ({} bytes)",
                    self.max_size.unwrap_or_default()
                )
            }
            rusqlite::ErrorCode::DiskFull => {
                "the trace database's disk is full (or a quota is reached)".to_string()
            }
            rusqlite::ErrorCode::SystemIoFailure => {
                format!("the trace database cannot be written ({failure})")
            }
            _ => return None,
        };
        // What the transaction wrote before the statement that failed is a
        // prefix of the trace, in order: kept, with the room given back and
        // the limit lifted for it (SQLite undid the failed statement; if it
        // undid the whole transaction, or the commit fails, the trace ends
        // at the last commit).
        self.room = None;
        if let Some(conn) = &self.conn {
            let _ = conn.pragma_update(None, "max_page_count", NO_PAGE_LIMIT);
            if !conn.is_autocommit() && conn.execute_batch("COMMIT").is_err() {
                let _ = conn.execute_batch("ROLLBACK");
            }
        }
        self.in_transaction = false;
        self.failed = false;
        self.pending.clear();
        self.nodes.clear();
        if let Some(conn) = &self.conn
            && self.coder.reload(conn).is_err()
        {
            self.failed = true;
        }
        // Its allocations may have been rolled back: `finish` asks SQLite.
        self.stopped_growing = true;
        Some(reason)
    }
}
