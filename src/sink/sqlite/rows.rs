//! How one record becomes a row: the events' compact encoding (see
//! docs/schema.md, "How events are stored"), the mappings' columns, and the
//! integers SQLite stores.

use rusqlite::params;
use rusqlite::types::{ToSql, ToSqlOutput, Value};

use super::{EVENT_COLUMNS, SinkError};
use crate::event::{Event, Op};

/// One `event_log` row. See docs/schema.md for the encoding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct EventRow {
    pub(super) id: Num,
    ts_ns: Num,
    /// Op code in the low 4 bits, thread code above.
    kind: i64,
    stack_id: Num,
    /// NULL for a free of a known block: the allocating event has it.
    ptr: Num,
    size: Num,
    /// `id - alloc_id`: small for the short-lived blocks that dominate.
    alloc_dist: Num,
    /// realloc/reallocarray: `old_ptr` (NULL when `alloc_id` names the
    /// block); every other op: `align`.
    arg: Num,
}

impl EventRow {
    pub(super) fn encode(event: &Event, thread: i64) -> EventRow {
        let released_known = event.alloc_id.is_some();
        let reallocates = matches!(event.op, Op::Realloc | Op::Reallocarray);
        let ptr = if event.op == Op::Free && released_known {
            Num::Null
        } else {
            int(event.ptr)
        };
        let arg = if reallocates {
            if released_known {
                Num::Null
            } else {
                event.old_ptr.map_or(Num::Null, int)
            }
        } else {
            event.align.map_or(Num::Null, int)
        };
        let alloc_dist = match event.alloc_id {
            Some(alloc) => Num::Int((event.id as i64).wrapping_sub(alloc as i64)),
            None => Num::Null,
        };
        EventRow {
            id: int(event.id),
            ts_ns: int(event.ts_ns),
            kind: i64::from(event.op as u8) | (thread << 4),
            stack_id: event.stack_id.map_or(Num::Null, int),
            ptr,
            size: event.size.map_or(Num::Null, int),
            alloc_dist,
            arg,
        }
    }

    pub(super) fn values(&self) -> [Num; EVENT_COLUMNS] {
        [
            self.id,
            self.ts_ns,
            Num::Int(self.kind),
            self.stack_id,
            self.ptr,
            self.size,
            self.alloc_dist,
            self.arg,
        ]
    }
}

/// An SQL number. SQLite integers are signed 64-bit: a `u64` above
/// `i64::MAX` (only sizes of failed requests such as `malloc(SIZE_MAX)`) is
/// stored as REAL, so it still compares and sorts as the large number it is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Num {
    Null,
    Int(i64),
    Real(f64),
}

/// A mapping call's row: each argument in the column that names it, for its
/// function (see docs/schema.md).
/// The argument columns of a `map_events` row; each op fills its own.
#[derive(Default)]
struct MapColumns {
    addr: Option<Num>,
    len: Option<Num>,
    new_len: Option<Num>,
    prot: Option<Num>,
    flags: Option<Num>,
    fd: Option<Num>,
    offset: Option<Num>,
    advice: Option<Num>,
}

pub(super) fn write_map(
    conn: &rusqlite::Connection,
    m: &crate::event::MapEvent,
) -> Result<(), SinkError> {
    use crate::event::MapOp;
    let [a0, a1, a2, a3, a4, a5] = m.args;
    // Arguments that are C ints are sign-extended from 32 bits.
    let c_int = |v: u64| Some(Num::Int(v as i32 as i64));
    let mut c = MapColumns::default();
    match m.op {
        MapOp::Mmap => {
            (c.addr, c.len) = (Some(int(a0)), Some(int(a1)));
            (c.prot, c.flags, c.fd) = (c_int(a2), c_int(a3), c_int(a4));
            c.offset = Some(Num::Int(a5 as i64));
        }
        MapOp::Munmap => (c.addr, c.len) = (Some(int(a0)), Some(int(a1))),
        MapOp::Mremap => {
            (c.addr, c.len, c.new_len) = (Some(int(a0)), Some(int(a1)), Some(int(a2)));
            c.flags = c_int(a3);
        }
        MapOp::Brk => c.addr = Some(int(a0)),
        // sbrk's increment is signed.
        MapOp::Sbrk => c.len = Some(Num::Int(a0 as i64)),
        MapOp::Madvise => {
            (c.addr, c.len, c.advice) = (Some(int(a0)), Some(int(a1)), c_int(a2));
        }
        MapOp::Mprotect => {
            (c.addr, c.len, c.prot) = (Some(int(a0)), Some(int(a1)), c_int(a2));
        }
    }
    // A failed call returns -1 (brk, munmap, madvise, mprotect: 0 or -1;
    // mmap, mremap: MAP_FAILED).
    let result = m.result as i64;
    conn.prepare_cached(
        "INSERT INTO map_events(id, ts_ns, pid, tid, op, addr, len, new_len, prot, flags, fd, \
         offset, advice, result, stack_id, by_allocator) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )?
    .execute(params![
        int(m.id),
        int(m.ts_ns),
        m.pid,
        m.tid,
        m.op.name(),
        c.addr,
        c.len,
        c.new_len,
        c.prot,
        c.flags,
        c.fd,
        c.offset,
        c.advice,
        result,
        m.stack_id.map(int),
        m.by_allocator.map(|op| op.name()),
    ])?;
    Ok(())
}

pub(super) fn int(value: u64) -> Num {
    match i64::try_from(value) {
        Ok(v) => Num::Int(v),
        Err(_) => Num::Real(value as f64),
    }
}

impl ToSql for Num {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Owned(match *self {
            Num::Null => Value::Null,
            Num::Int(v) => Value::Integer(v),
            Num::Real(v) => Value::Real(v),
        }))
    }
}
