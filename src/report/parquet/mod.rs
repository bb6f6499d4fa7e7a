//! `memptrace export --parquet DIR`: a trace as four Parquet files
//! (`events`, `stacks`, `frames`, `meta`), each row with the trace's id, so
//! that DuckDB or Spark can read the traces of many processes and machines
//! as one table (`read_parquet('*/events.parquet')`). The columns are in
//! docs/schema.md, "Parquet export".
//!
//! It streams: the events are read and written [`ROWS_PER_GROUP`] at a time,
//! a row group each, so its memory is bounded by the stacks and frames of the
//! trace (loaded whole, as every report does), never by its events. Every
//! file is written as `NAME.parquet.partial` and renamed only when all four
//! are complete: an export that fails leaves no file that looks whole. Its
//! reads are one read transaction, so a trace still being recorded gives
//! files that agree with each other.
//!
//! What the trace holds is checked as it is read: a value of the wrong type,
//! a negative size or a loop in the stack trie is an error naming the trace,
//! never a panic or an endless walk.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use arrow_array::ArrayRef;
use arrow_array::builder::{
    ArrayBuilder, BooleanBuilder, Int64Builder, StringBuilder, UInt64Builder,
};
use arrow_schema::{DataType, Field};
use rusqlite::types::ValueRef;

use super::{ReportError, Trace, check_output};
use sheet::Sheet;

mod sheet;

/// Rows read from the trace and written per row group.
pub const ROWS_PER_GROUP: usize = 65_536;

/// Frames walked per stack, at most: the trie cannot be deeper than
/// `--max-depth` (4096), so a longer walk means a loop in a damaged file.
const MAX_WALK: usize = 1 << 16;

/// The files an export writes, in the order it writes them.
pub const FILES: [&str; 4] = ["meta", "frames", "events", "stacks"];

/// Rows written per file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    pub meta: u64,
    pub frames: u64,
    pub events: u64,
    pub stacks: u64,
}

/// The trace's id: `meta.trace_id`, or for a trace written before that row
/// existed, one derived from its `pid`, `started_at` and `command` (`true`
/// in the second place then).
pub fn trace_id(trace: &Trace) -> Result<(String, bool), ReportError> {
    if let Some(id) = trace.meta("trace_id")? {
        return Ok((id, false));
    }
    let facts = [
        trace.meta("pid")?.unwrap_or_default(),
        trace.meta("started_at")?.unwrap_or_default(),
        trace.meta("command")?.unwrap_or_default(),
    ];
    let facts: Vec<&str> = facts.iter().map(String::as_str).collect();
    Ok((crate::trace_id::derived(&facts), true))
}

/// Write the four files of `trace` into `dir` (created if missing; files of
/// an earlier export there are replaced), with `id` in every row.
pub fn export(trace: &Trace, dir: &Path, id: &str) -> Result<Written, ReportError> {
    if dir.exists() && !dir.is_dir() {
        return Err(ReportError::Output {
            path: dir.to_path_buf(),
            what: "not a directory: --parquet names the directory to write the files into".into(),
        });
    }
    std::fs::create_dir_all(dir).map_err(|source| ReportError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    for name in FILES {
        check_output(&trace.path, &dir.join(format!("{name}.parquet")))?;
    }
    // One snapshot for every file (a trace being recorded moves on).
    let err = |e| trace.err(e);
    trace.conn.execute_batch("BEGIN").map_err(err)?;
    let written = write_all(trace, dir, id);
    // A read transaction has nothing to keep.
    let _ = trace.conn.execute_batch("ROLLBACK");
    written
}

fn write_all(trace: &Trace, dir: &Path, id: &str) -> Result<Written, ReportError> {
    let mut meta = Sheet::create(dir, "meta", id, meta_fields(), &[])?;
    write_meta(trace, &mut meta)?;
    let mut frames = Sheet::create(dir, "frames", id, frame_fields(), &[])?;
    let known = write_frames(trace, &mut frames)?;
    let mut events = Sheet::create(
        dir,
        "events",
        id,
        event_fields(),
        &["id", "ts_ns", "ptr", "old_ptr", "alloc_id"],
    )?;
    let used = write_events(trace, &mut events)?;
    let mut stacks = Sheet::create(dir, "stacks", id, stack_fields(), &[])?;
    write_stacks(trace, &known, &used, &mut stacks)?;
    let mut sheets = [meta, frames, events, stacks];
    let mut rows = [0; 4];
    for (sheet, rows) in sheets.iter_mut().zip(&mut rows) {
        *rows = sheet.close()?;
    }
    // Renamed only now, all four complete.
    for sheet in &mut sheets {
        sheet.publish()?;
    }
    let [meta, frames, events, stacks] = rows;
    Ok(Written {
        meta,
        frames,
        events,
        stacks,
    })
}

fn field(name: &str, kind: DataType, nullable: bool) -> Field {
    Field::new(name, kind, nullable)
}

fn meta_fields() -> Vec<Field> {
    vec![
        field("key", DataType::Utf8, false),
        field("value", DataType::Utf8, true),
    ]
}

fn frame_fields() -> Vec<Field> {
    vec![
        field("frame_id", DataType::Int64, false),
        field("ip", DataType::Int64, false),
        field("image", DataType::Utf8, true),
        field("build_id", DataType::Utf8, true),
        field("offset", DataType::Int64, true),
        field("function", DataType::Utf8, true),
        field("file", DataType::Utf8, true),
        field("line", DataType::Int64, true),
        field("wrapper", DataType::Boolean, true),
    ]
}

fn event_fields() -> Vec<Field> {
    vec![
        field("id", DataType::Int64, false),
        field("ts_ns", DataType::Int64, false),
        field("pid", DataType::Int64, true),
        field("tid", DataType::Int64, true),
        field("op", DataType::Utf8, true),
        field("ptr", DataType::Int64, true),
        field("size", DataType::UInt64, true),
        field("old_ptr", DataType::Int64, true),
        field("align", DataType::Int64, true),
        field("alloc_id", DataType::Int64, true),
        field("stack_id", DataType::Int64, true),
    ]
}

fn stack_fields() -> Vec<Field> {
    vec![
        field("stack_id", DataType::Int64, false),
        field("position", DataType::Int64, false),
        field("frame_id", DataType::Int64, true),
        field("call_site", DataType::Boolean, false),
        field("function", DataType::Utf8, true),
        field("file", DataType::Utf8, true),
        field("line", DataType::Int64, true),
        field("image", DataType::Utf8, true),
    ]
}

/// `meta`, every row as stored, and the trace id's row when the trace
/// has none (a derived id).
fn write_meta(trace: &Trace, sheet: &mut Sheet) -> Result<(), ReportError> {
    let err = |e| trace.err(e);
    let mut keys = StringBuilder::new();
    let mut values = StringBuilder::new();
    let mut stmt = trace
        .conn
        .prepare("SELECT key, value FROM meta ORDER BY key")
        .map_err(err)?;
    let mut rows = stmt.query([]).map_err(err)?;
    let mut has_id = false;
    while let Some(r) = rows.next().map_err(err)? {
        let key: String = r.get(0).map_err(err)?;
        has_id |= key == "trace_id";
        keys.append_value(key);
        values.append_option(r.get::<_, Option<String>>(1).map_err(err)?);
    }
    if !has_id {
        keys.append_value("trace_id");
        values.append_value(sheet.trace_id.clone());
    }
    sheet.write(vec![Arc::new(keys.finish()), Arc::new(values.finish())])
}

/// What a stack row repeats of its frame.
struct KnownFrame {
    function: Option<String>,
    file: Option<String>,
    line: Option<i64>,
    image: Option<String>,
}

fn has_column(trace: &Trace, table: &str, column: &str) -> bool {
    trace
        .conn
        .prepare(&format!("SELECT {column} FROM {table} LIMIT 0"))
        .is_ok()
}

/// `frames` with the image each is in; returns them for the stacks.
fn write_frames(trace: &Trace, sheet: &mut Sheet) -> Result<HashMap<i64, KnownFrame>, ReportError> {
    let err = |e| trace.err(e);
    // Traces older than `frames.wrapper` have no such column.
    let wrapper = if has_column(trace, "frames", "wrapper") {
        "f.wrapper"
    } else {
        "NULL"
    };
    let sql = format!(
        "SELECT f.id, f.ip, m.path, m.build_id, m.base, f.function, f.file, f.line, {wrapper}
         FROM frames f LEFT JOIN modules m ON m.id = f.module_id ORDER BY f.id"
    );
    let mut stmt = trace.conn.prepare(&sql).map_err(err)?;
    let mut rows = stmt.query([]).map_err(err)?;
    let mut known = HashMap::new();
    let mut b = FrameColumns::default();
    while let Some(r) = rows.next().map_err(err)? {
        let id: i64 = r.get(0).map_err(err)?;
        let ip: i64 = r.get(1).map_err(err)?;
        let image: Option<String> = r.get(2).map_err(err)?;
        let base: Option<i64> = r.get(4).map_err(err)?;
        let frame = KnownFrame {
            function: r.get(5).map_err(err)?,
            file: r.get(6).map_err(err)?,
            line: r.get(7).map_err(err)?,
            image: image.clone(),
        };
        b.id.append_value(id);
        b.ip.append_value(ip);
        b.image.append_option(image);
        b.build_id
            .append_option(r.get::<_, Option<String>>(3).map_err(err)?);
        b.offset
            .append_option(base.and_then(|base| ip.checked_sub(base)));
        b.function.append_option(frame.function.as_deref());
        b.file.append_option(frame.file.as_deref());
        b.line.append_option(frame.line);
        b.wrapper
            .append_option(r.get::<_, Option<bool>>(8).map_err(err)?);
        known.insert(id, frame);
        if b.id.len() == ROWS_PER_GROUP {
            sheet.write(b.finish())?;
        }
    }
    sheet.write(b.finish())?;
    Ok(known)
}

#[derive(Default)]
struct FrameColumns {
    id: Int64Builder,
    ip: Int64Builder,
    image: StringBuilder,
    build_id: StringBuilder,
    offset: Int64Builder,
    function: StringBuilder,
    file: StringBuilder,
    line: Int64Builder,
    wrapper: BooleanBuilder,
}

impl FrameColumns {
    fn finish(&mut self) -> Vec<ArrayRef> {
        vec![
            Arc::new(self.id.finish()),
            Arc::new(self.ip.finish()),
            Arc::new(self.image.finish()),
            Arc::new(self.build_id.finish()),
            Arc::new(self.offset.finish()),
            Arc::new(self.function.finish()),
            Arc::new(self.file.finish()),
            Arc::new(self.line.finish()),
            Arc::new(self.wrapper.finish()),
        ]
    }
}

/// `events` as the view gives them, a row group at a time; returns the
/// stacks they name.
fn write_events(trace: &Trace, sheet: &mut Sheet) -> Result<HashSet<i64>, ReportError> {
    let err = |e| trace.err(e);
    let mut stmt = trace
        .conn
        .prepare(
            "SELECT id, ts_ns, pid, tid, op, ptr, size, old_ptr, align, alloc_id, stack_id
             FROM events ORDER BY id",
        )
        .map_err(err)?;
    let mut rows = stmt.query([]).map_err(err)?;
    let mut used = HashSet::new();
    let mut b = EventColumns::default();
    while let Some(r) = rows.next().map_err(err)? {
        let id: i64 = r.get(0).map_err(err)?;
        b.id.append_value(id);
        b.ts_ns.append_value(r.get(1).map_err(err)?);
        b.pid
            .append_option(r.get::<_, Option<i64>>(2).map_err(err)?);
        b.tid
            .append_option(r.get::<_, Option<i64>>(3).map_err(err)?);
        b.op.append_option(r.get::<_, Option<String>>(4).map_err(err)?);
        b.ptr
            .append_option(r.get::<_, Option<i64>>(5).map_err(err)?);
        b.size
            .append_option(size(trace, id, r.get_ref(6).map_err(err)?)?);
        b.old_ptr
            .append_option(r.get::<_, Option<i64>>(7).map_err(err)?);
        b.align
            .append_option(r.get::<_, Option<i64>>(8).map_err(err)?);
        b.alloc_id
            .append_option(r.get::<_, Option<i64>>(9).map_err(err)?);
        let stack: Option<i64> = r.get(10).map_err(err)?;
        b.stack_id.append_option(stack);
        used.extend(stack);
        if b.id.len() == ROWS_PER_GROUP {
            sheet.write(b.finish())?;
        }
    }
    sheet.write(b.finish())?;
    Ok(used)
}

/// `events.size`: an integer, or a REAL for a request above 2^63 - 1
/// (docs/schema.md, "Conventions"), exact as a `u64` either way.
fn size(trace: &Trace, id: i64, value: ValueRef) -> Result<Option<u64>, ReportError> {
    let bad = |what: String| ReportError::NotATrace {
        path: trace.path.clone(),
        reason: format!("event {id} has {what} as its size"),
    };
    match value {
        ValueRef::Null => Ok(None),
        ValueRef::Integer(n) => u64::try_from(n).map(Some).map_err(|_| bad(n.to_string())),
        // Only requests too big to succeed are stored as REAL; `as`
        // saturates at u64::MAX, the SIZE_MAX they were.
        ValueRef::Real(x) if x >= 0.0 => Ok(Some(x as u64)),
        ValueRef::Real(x) => Err(bad(x.to_string())),
        ValueRef::Text(_) | ValueRef::Blob(_) => Err(bad("text".into())),
    }
}

#[derive(Default)]
struct EventColumns {
    id: Int64Builder,
    ts_ns: Int64Builder,
    pid: Int64Builder,
    tid: Int64Builder,
    op: StringBuilder,
    ptr: Int64Builder,
    size: UInt64Builder,
    old_ptr: Int64Builder,
    align: Int64Builder,
    alloc_id: Int64Builder,
    stack_id: Int64Builder,
}

impl EventColumns {
    fn finish(&mut self) -> Vec<ArrayRef> {
        vec![
            Arc::new(self.id.finish()),
            Arc::new(self.ts_ns.finish()),
            Arc::new(self.pid.finish()),
            Arc::new(self.tid.finish()),
            Arc::new(self.op.finish()),
            Arc::new(self.ptr.finish()),
            Arc::new(self.size.finish()),
            Arc::new(self.old_ptr.finish()),
            Arc::new(self.align.finish()),
            Arc::new(self.alloc_id.finish()),
            Arc::new(self.stack_id.finish()),
        ]
    }
}

/// Every stack the events name, flattened: a row per frame, innermost
/// first (`position` 0 is the frame that called the allocator), with the
/// frame's names repeated and its call site marked, so that "bytes by
/// caller" over many traces is one join of `events` with `stacks`.
fn write_stacks(
    trace: &Trace,
    known: &HashMap<i64, KnownFrame>,
    used: &HashSet<i64>,
    sheet: &mut Sheet,
) -> Result<(), ReportError> {
    let err = |e| trace.err(e);
    let mut nodes: HashMap<i64, (Option<i64>, Option<i64>)> = HashMap::new();
    let mut stmt = trace
        .conn
        .prepare("SELECT id, parent_id, frame_id FROM stacks")
        .map_err(err)?;
    let mut rows = stmt.query([]).map_err(err)?;
    while let Some(r) = rows.next().map_err(err)? {
        let id = r.get(0).map_err(err)?;
        nodes.insert(id, (r.get(1).map_err(err)?, r.get(2).map_err(err)?));
    }
    // Stack -> the node of its call site (docs/schema.md, `call_sites`);
    // a stack without a row is its own call site, as in a killed trace.
    let mut sites: HashMap<i64, i64> = HashMap::new();
    if has_column(trace, "call_sites", "site_id") {
        let mut stmt = trace
            .conn
            .prepare("SELECT stack_id, site_id FROM call_sites")
            .map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            let stack: i64 = r.get(0).map_err(err)?;
            if let Some(site) = r.get::<_, Option<i64>>(1).map_err(err)?
                && used.contains(&stack)
            {
                sites.insert(stack, site);
            }
        }
    }
    let mut order: Vec<i64> = used.iter().copied().collect();
    order.sort_unstable();
    let mut b = StackColumns::default();
    for stack in order {
        let site = sites.get(&stack).copied().unwrap_or(stack);
        let mut node = Some(stack);
        let mut position = 0;
        while let Some(at) = node {
            let Some(&(up, frame)) = nodes.get(&at) else {
                break;
            };
            if position == MAX_WALK {
                return Err(ReportError::NotATrace {
                    path: trace.path.clone(),
                    reason: format!(
                        "stack {stack} has more than {MAX_WALK} frames: its parent_ids loop"
                    ),
                });
            }
            let names = frame.and_then(|f| known.get(&f));
            b.stack_id.append_value(stack);
            b.position.append_value(position as i64);
            b.frame_id.append_option(frame);
            b.call_site.append_value(at == site);
            b.function
                .append_option(names.and_then(|f| f.function.as_deref()));
            b.file.append_option(names.and_then(|f| f.file.as_deref()));
            b.line.append_option(names.and_then(|f| f.line));
            b.image
                .append_option(names.and_then(|f| f.image.as_deref()));
            if b.stack_id.len() == ROWS_PER_GROUP {
                sheet.write(b.finish())?;
            }
            node = up;
            position += 1;
        }
    }
    sheet.write(b.finish())
}

#[derive(Default)]
struct StackColumns {
    stack_id: Int64Builder,
    position: Int64Builder,
    frame_id: Int64Builder,
    call_site: BooleanBuilder,
    function: StringBuilder,
    file: StringBuilder,
    line: Int64Builder,
    image: StringBuilder,
}

impl StackColumns {
    fn finish(&mut self) -> Vec<ArrayRef> {
        vec![
            Arc::new(self.stack_id.finish()),
            Arc::new(self.position.finish()),
            Arc::new(self.frame_id.finish()),
            Arc::new(self.call_site.finish()),
            Arc::new(self.function.finish()),
            Arc::new(self.file.finish()),
            Arc::new(self.line.finish()),
            Arc::new(self.image.finish()),
        ]
    }
}
