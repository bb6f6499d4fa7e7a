//! How one record becomes a row: the events' compact encoding (see
//! docs/schema.md, "How events are stored"), the mappings' columns, and the
//! integers SQLite stores.

use rusqlite::types::{ToSql, ToSqlOutput, ValueRef};
use rusqlite::{Connection, OptionalExtension, params};
use rustc_hash::FxHashMap;

use super::nodes::insert_many;
use super::{EVENT_COLUMNS, SinkError};
use crate::event::{Event, Op};

/// An event's time is stored as the time since the first event of its
/// epoch, the ids sharing `id >> EPOCH_BITS` (`event_epochs`): 3 bytes at a
/// thousand events per 8 ms or more, where the time since the start takes 4
/// to 6.
pub const EPOCH_BITS: u32 = 10;

/// `k`: the op code in bits 0-3, [`RAW_PTR`], the site code from bit 5.
pub const SITE_SHIFT: u32 = 5;

/// Set in `k` when `p` holds the pointer itself rather than its distance
/// from the site's base in units of 16 bytes (0, a pointer not 16-aligned
/// or above `i64::MAX`).
pub const RAW_PTR: i64 = 16;

/// One `event_log` row. See docs/schema.md for the encoding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct EventRow {
    pub(super) id: Num,
    /// `ts_ns` minus its epoch's base time.
    t: Num,
    /// Op code, [`RAW_PTR`] and site code (thread and stack).
    k: i64,
    /// `id - alloc_id`: small for the short-lived blocks that dominate.
    /// Before `p` and `n`, so that a free's row ends with it.
    d: Num,
    /// The pointer, encoded against the site's base: NULL for a free of a
    /// known block (the allocating event has it).
    p: Num,
    /// Bytes requested.
    n: Num,
    /// realloc/reallocarray: `old_ptr` (NULL when `alloc_id` names the
    /// block); every other op: `align`.
    o: Num,
}

impl EventRow {
    pub(super) fn values(&self) -> [Num; EVENT_COLUMNS] {
        [
            self.id,
            self.t,
            Num::Int(self.k),
            self.d,
            self.p,
            self.n,
            self.o,
        ]
    }
}

/// A site's key, (thread code, stack), and its (code, base pointer).
type Site = ((i64, Option<u64>), (i64, u64));

/// What rows are encoded against: the base time of each epoch and the code
/// and base pointer of each site, a (thread, stack) pair. Each is written
/// to `event_epochs` and `event_sites` when first used, in the transaction
/// of the rows that use it.
#[derive(Default)]
pub(super) struct Coder {
    /// (thread code, stack) -> (site code, base pointer).
    sites: FxHashMap<(i64, Option<u64>), (i64, u64)>,
    /// The site of the last event: most events repeat one of a few.
    last_site: Option<Site>,
    /// The current epoch and its base time.
    epoch: Option<(u64, u64)>,
    /// The last 16-aligned pointer an event carried: the base of a site
    /// whose first event carries none.
    last_ptr: u64,
    /// Sites not yet written, [`SITES`] to a statement: `-f -- make -j2`
    /// makes 553 000 of them for 3.8 M events (every `cc1` its own stacks).
    new_sites: Vec<SiteRow>,
}

/// New sites per statement: 6 parameters a row.
const SITES: usize = 128;

/// An `event_sites` row.
struct SiteRow {
    code: i64,
    thread: i64,
    stack: Option<u64>,
    base: u64,
    pid: u32,
    tid: u32,
}

impl Coder {
    /// The row of `event`, made by thread `thread` (`event_threads.code`).
    pub(super) fn encode(
        &mut self,
        conn: &Connection,
        event: &Event,
        thread: i64,
    ) -> Result<EventRow, SinkError> {
        let base_ns = self.epoch_base(conn, event)?;
        let (site, base) = self.site(conn, event, thread)?;
        let released_known = event.alloc_id.is_some();
        let reallocates = matches!(event.op, Op::Realloc | Op::Reallocarray);
        let (p, raw) = if event.op == Op::Free && released_known {
            (Num::Null, false)
        } else {
            match pointer(event.ptr, base) {
                Some(p) => (Num::Int(p), false),
                None => (int(event.ptr), true),
            }
        };
        if pointer(event.ptr, 0).is_some() {
            self.last_ptr = event.ptr;
        }
        let o = if reallocates {
            if released_known {
                Num::Null
            } else {
                event.old_ptr.map_or(Num::Null, int)
            }
        } else {
            event.align.map_or(Num::Null, int)
        };
        let d = match event.alloc_id {
            Some(alloc) => Num::Int((event.id as i64).wrapping_sub(alloc as i64)),
            None => Num::Null,
        };
        let t = match i64::try_from(i128::from(event.ts_ns) - i128::from(base_ns)) {
            Ok(t) => Num::Int(t),
            Err(_) => Num::Real(event.ts_ns as f64 - base_ns as f64),
        };
        Ok(EventRow {
            id: int(event.id),
            t,
            k: i64::from(event.op as u8) | if raw { RAW_PTR } else { 0 } | (site << SITE_SHIFT),
            p,
            n: event.size.map_or(Num::Null, int),
            d,
            o,
        })
    }

    /// The base time of `event`'s epoch: its time if it is the epoch's
    /// first event.
    fn epoch_base(&mut self, conn: &Connection, event: &Event) -> Result<u64, SinkError> {
        let epoch = event.id >> EPOCH_BITS;
        if let Some((current, base)) = self.epoch
            && current == epoch
        {
            return Ok(base);
        }
        let inserted = conn
            .prepare_cached("INSERT OR IGNORE INTO event_epochs(epoch, ts_ns) VALUES (?, ?)")?
            .execute(params![int(epoch), int(event.ts_ns)])?;
        let base = if inserted == 1 {
            event.ts_ns
        } else {
            // An epoch met again (ids out of order): its base is stored.
            let stored: Option<i64> = conn
                .prepare_cached("SELECT ts_ns FROM event_epochs WHERE epoch = ?")?
                .query_row([int(epoch)], |r| r.get(0))
                .optional()?;
            stored.map_or(event.ts_ns, |ns| ns.max(0) as u64)
        };
        self.epoch = Some((epoch, base));
        Ok(base)
    }

    /// The code and base pointer of (thread, `event`'s stack).
    fn site(
        &mut self,
        conn: &Connection,
        event: &Event,
        thread: i64,
    ) -> Result<(i64, u64), SinkError> {
        let key = (thread, event.stack_id);
        if let Some((last, site)) = self.last_site
            && last == key
        {
            return Ok(site);
        }
        let site = match self.sites.get(&key) {
            Some(&site) => site,
            None => {
                let code = self.sites.len() as i64;
                let base = if pointer(event.ptr, 0).is_some() {
                    event.ptr
                } else {
                    self.last_ptr
                };
                self.new_sites.push(SiteRow {
                    code,
                    thread,
                    stack: event.stack_id,
                    base,
                    pid: event.pid,
                    tid: event.tid,
                });
                if self.new_sites.len() >= SITES {
                    self.flush_sites(conn)?;
                }
                self.sites.insert(key, (code, base));
                (code, base)
            }
        };
        self.last_site = Some((key, site));
        Ok(site)
    }

    /// Write the sites made since the last call: before the transaction of
    /// the rows that use them commits.
    pub(super) fn flush_sites(&mut self, conn: &Connection) -> Result<(), SinkError> {
        insert_many(
            conn,
            "INSERT INTO event_sites(code, thread, stack_id, base, pid, tid)",
            &self.new_sites,
            SITES,
            |site| {
                [
                    ValueRef::Integer(site.code),
                    ValueRef::Integer(site.thread),
                    site.stack.map_or(Num::Null, int).into(),
                    int(site.base).into(),
                    ValueRef::Integer(site.pid.into()),
                    ValueRef::Integer(site.tid.into()),
                ]
            },
        )?;
        self.new_sites.clear();
        Ok(())
    }

    /// Forget what may have been rolled back with a failed transaction, and
    /// take the sites and epochs as the database has them.
    pub(super) fn reload(&mut self, conn: &Connection) -> Result<(), SinkError> {
        self.new_sites.clear();
        self.sites.clear();
        self.last_site = None;
        self.epoch = None;
        let mut stmt = conn.prepare("SELECT code, thread, stack_id, base FROM event_sites")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let stack: Option<i64> = row.get(2)?;
            let base: i64 = row.get(3)?;
            self.sites.insert(
                (row.get(1)?, stack.map(|s| s as u64)),
                (row.get(0)?, base as u64),
            );
        }
        Ok(())
    }
}

/// `ptr` as the distance from `base` in units of 16 bytes, when it is a
/// 16-aligned pointer other than 0 that SQLite can hold as an integer.
fn pointer(ptr: u64, base: u64) -> Option<i64> {
    if ptr == 0 || ptr % 16 != 0 || ptr > i64::MAX as u64 || base % 16 != 0 {
        return None;
    }
    i64::try_from((i128::from(ptr) - i128::from(base)) / 16).ok()
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

impl From<Num> for ValueRef<'static> {
    fn from(n: Num) -> Self {
        match n {
            Num::Null => ValueRef::Null,
            Num::Int(v) => ValueRef::Integer(v),
            Num::Real(v) => ValueRef::Real(v),
        }
    }
}

impl ToSql for Num {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        // Borrowed: a number needs no owned value made and dropped per
        // parameter (the events' chunks bind millions).
        Ok(ToSqlOutput::Borrowed((*self).into()))
    }
}
