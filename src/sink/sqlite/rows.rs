//! How one record becomes a row: the mappings' columns, and the integers
//! SQLite stores (the events' encoding is groups.rs's).

use rusqlite::params;
use rusqlite::types::{ToSql, ToSqlOutput, Value};

use super::SinkError;

/// An SQL number. SQLite integers are signed 64-bit: a `u64` above
/// `i64::MAX` (only sizes of failed requests such as `malloc(SIZE_MAX)`) is
/// stored as REAL, so it still compares and sorts as the large number it is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Num {
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
