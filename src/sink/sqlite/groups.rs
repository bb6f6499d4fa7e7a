//! Events stored sixteen to a row: `event_groups` row `g` holds the events
//! whose id is `g * 16 + k`, slot `k` in columns `t{k}`, `e{k}`, `p{k}`,
//! `s{k}` (see docs/schema.md, "How events are stored"). SQLite's cost per
//! row (rowid, cell pointer, record header) is paid once per sixteen events,
//! and each value is stored relative to the group where that makes it
//! short. This module is the one place that knows the encoding, both ways:
//! the writer's, and the reports' reader (the views decode the same in SQL,
//! in `schema.rs`).

use rusqlite::Row;
use rusqlite::types::ValueRef;

use super::rows::{Num, int};
use crate::event::{Event, Op};

/// Events per row.
pub const SLOTS: usize = 16;

/// Columns of `event_groups` before the slots: `g`, `m`, `w`, `ts`, `ptr`.
const HEAD: usize = 5;

/// Columns of an `event_groups` row.
pub const GROUP_COLUMNS: usize = HEAD + 4 * SLOTS;

/// `m` of a group whose sixteen slots are all used: stored as NULL.
const FULL: i64 = 0xffff;

/// Bits of `e` below the stack, unless the group says more (`w`): the op
/// code's 4 and a thread code of 0 or 1 (at least 4: the views take the op
/// code from `e & 15`).
pub const KIND_BITS: u32 = 5;
const _: () = assert!(KIND_BITS >= 4);

/// The `event_groups` table; `slot_columns` adds the slots.
pub fn table_sql() -> String {
    let slots: Vec<String> = (0..SLOTS)
        .map(|k| format!("t{k} INTEGER, e{k} INTEGER, p{k} INTEGER, s{k} INTEGER"))
        .collect();
    format!(
        "CREATE TABLE event_groups(
    g INTEGER PRIMARY KEY,
    m INTEGER,
    w INTEGER,
    ts INTEGER,
    ptr INTEGER,
    {}
);",
        slots.join(",\n    ")
    )
}

/// One event as stored, its values absolute (the group's bases are taken
/// out when the row is written).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slot {
    pub ts: Num,
    /// Op code in the low 4 bits, thread code above.
    pub kind: i64,
    /// Stack id plus one; 0 for none.
    pub stack: i64,
    /// NULL for a free of a known block: the allocating event has it.
    pub ptr: Num,
    /// The size; for a free, minus its `alloc_dist`.
    pub s: Num,
}

/// What does not fit in a slot: `event_extra(id, arg, alloc_dist)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Extra {
    pub id: i64,
    pub arg: Num,
    pub alloc_dist: Num,
}

/// Ops whose `arg` or `alloc_dist` may be in `event_extra`: all but the
/// three that make nearly every call (malloc, calloc, free), so that those
/// never look there.
pub fn has_extra(op_code: i64) -> bool {
    ![Op::Malloc as i64, Op::Calloc as i64, Op::Free as i64].contains(&op_code)
}

/// Why an event cannot be stored: a value no SQLite integer holds.
fn too_large(what: &str) -> String {
    format!("an event's {what} is too large for the trace format")
}

/// `event`'s slot, and its `event_extra` row if it needs one.
pub fn encode(event: &Event, thread: i64) -> Result<(Slot, Option<Extra>), String> {
    let id = i64::try_from(event.id).map_err(|_| too_large("id"))?;
    let released_known = event.alloc_id.is_some();
    let reallocates = matches!(event.op, Op::Realloc | Op::Reallocarray);
    let ptr = if event.op == Op::Free && released_known {
        Num::Null
    } else {
        int(event.ptr)
    };
    let arg = if reallocates {
        match event.old_ptr {
            Some(old) if !released_known => int(old),
            _ => Num::Null,
        }
    } else {
        event.align.map_or(Num::Null, int)
    };
    let alloc_dist = match event.alloc_id {
        Some(alloc) => Some(
            i64::try_from(alloc)
                .ok()
                .and_then(|alloc| id.checked_sub(alloc))
                .ok_or_else(|| too_large("alloc_id"))?,
        ),
        None => None,
    };
    let op = i64::from(event.op as u8);
    let kind = thread
        .checked_mul(16)
        .map(|t| t | op)
        .ok_or_else(|| too_large("thread code"))?;
    let stack = match event.stack_id {
        Some(s) => i64::try_from(s)
            .ok()
            .and_then(|s| s.checked_add(1))
            .ok_or_else(|| too_large("stack id"))?,
        None => 0,
    };
    let s = if event.op == Op::Free {
        match alloc_dist {
            Some(d) => Num::Int(d.checked_neg().ok_or_else(|| too_large("alloc_id"))?),
            None => Num::Null,
        }
    } else {
        event.size.map_or(Num::Null, int)
    };
    let slot = Slot {
        ts: int(event.ts_ns),
        kind,
        stack,
        ptr,
        s,
    };
    let dist = match alloc_dist {
        Some(d) if reallocates => Num::Int(d),
        _ => Num::Null,
    };
    let extra = (has_extra(op) && (arg != Num::Null || dist != Num::Null)).then_some(Extra {
        id,
        arg,
        alloc_dist: dist,
    });
    Ok((slot, extra))
}

/// The events of one group, as they will be stored.
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    pub g: i64,
    pub slots: [Option<Slot>; SLOTS],
}

impl Group {
    pub fn new(g: i64) -> Group {
        Group {
            g,
            slots: [None; SLOTS],
        }
    }

    pub fn is_full(&self) -> bool {
        self.slots.iter().all(Option::is_some)
    }

    /// The row's values, in table order.
    pub fn values(&self) -> Result<Vec<Num>, String> {
        let present = self.slots.iter().flatten();
        let mask = (0..SLOTS)
            .filter(|&k| self.slots[k].is_some())
            .fold(0i64, |m, k| m | 1 << k);
        let max_kind = present.clone().map(|s| s.kind).max().unwrap_or(0);
        let w = (u64::BITS - (max_kind as u64).leading_zeros()).max(KIND_BITS);
        // A value that is not an integer (above i64::MAX: stored as REAL)
        // makes the group's base 0, so every value is stored whole.
        let base = |values: Vec<Num>| -> i64 {
            if values.iter().any(|v| matches!(v, Num::Real(_))) {
                return 0;
            }
            values
                .iter()
                .find_map(|v| match v {
                    Num::Int(n) => Some(*n),
                    _ => None,
                })
                .unwrap_or(0)
        };
        let ts_base = base(present.clone().map(|s| s.ts).collect());
        let ptr_base = base(present.clone().map(|s| s.ptr).collect());
        let delta = |v: Num, b: i64| match v {
            // Both in 0..=i64::MAX: no overflow.
            Num::Int(n) => Num::Int(n - b),
            other => other,
        };
        let mut row = Vec::with_capacity(GROUP_COLUMNS);
        row.push(Num::Int(self.g));
        row.push(if mask == FULL {
            Num::Null
        } else {
            Num::Int(mask)
        });
        row.push(if w == KIND_BITS {
            Num::Null
        } else {
            Num::Int(i64::from(w))
        });
        row.push(Num::Int(ts_base));
        // 0 takes no bytes: no need for NULL.
        row.push(Num::Int(ptr_base));
        for slot in &self.slots {
            match slot {
                Some(s) => {
                    let e = s
                        .stack
                        .checked_shl(w)
                        .filter(|e| e >> w == s.stack)
                        .ok_or_else(|| too_large("stack id"))?
                        | s.kind;
                    row.extend([
                        delta(s.ts, ts_base),
                        Num::Int(e),
                        delta(s.ptr, ptr_base),
                        s.s,
                    ]);
                }
                None => row.extend([Num::Null; 4]),
            }
        }
        Ok(row)
    }

    /// A stored row back as absolute values (`SELECT * FROM event_groups`).
    pub fn from_row(row: &Row) -> rusqlite::Result<Group> {
        Group::from_row_until(row, i64::MAX)
    }

    /// The same, but only the events of time `until` at the latest (the
    /// others' columns are not read).
    fn from_row_until(row: &Row, until: i64) -> rusqlite::Result<Group> {
        let num = |i: usize| -> rusqlite::Result<Num> {
            Ok(match row.get_ref(i)? {
                ValueRef::Integer(n) => Num::Int(n),
                ValueRef::Real(x) => Num::Real(x),
                _ => Num::Null,
            })
        };
        let g: i64 = row.get(0)?;
        let mask: Option<i64> = row.get(1)?;
        let mask = mask.unwrap_or(FULL);
        let w: Option<i64> = row.get(2)?;
        let w = w.map_or(KIND_BITS, |w| w.clamp(0, 62) as u32);
        let ts_base: i64 = row.get::<_, Option<i64>>(3)?.unwrap_or(0);
        let ptr_base: i64 = row.get::<_, Option<i64>>(4)?.unwrap_or(0);
        let add = |v: Num, b: i64| match v {
            Num::Int(n) => n
                .checked_add(b)
                .map_or(Num::Real(n as f64 + b as f64), Num::Int),
            other => other,
        };
        let mut group = Group::new(g);
        for k in 0..SLOTS {
            if mask >> k & 1 == 0 {
                continue;
            }
            let at = HEAD + 4 * k;
            let ts = add(num(at)?, ts_base);
            if whole(ts).is_some_and(|ts| ts > until) {
                continue;
            }
            let Num::Int(e) = num(at + 1)? else {
                continue;
            };
            group.slots[k] = Some(Slot {
                ts,
                kind: e & ((1 << w) - 1),
                stack: e >> w,
                ptr: add(num(at + 2)?, ptr_base),
                s: num(at + 3)?,
            });
        }
        Ok(group)
    }
}

impl Slot {
    pub fn op_code(&self) -> i64 {
        self.kind & 15
    }

    pub fn stack_id(&self) -> Option<i64> {
        (self.stack != 0).then_some(self.stack - 1)
    }

    /// The bytes asked for (not for a free).
    pub fn size(&self) -> Num {
        if self.op_code() == Op::Free as i64 {
            Num::Null
        } else {
            self.s
        }
    }

    /// `alloc_dist` of a free; the others' are in `event_extra`.
    pub fn free_dist(&self) -> Option<i64> {
        match self.s {
            Num::Int(n) if self.op_code() == Op::Free as i64 => Some(n.wrapping_neg()),
            _ => None,
        }
    }
}

/// One stored event, as the reports read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredEvent {
    pub id: i64,
    pub ts_ns: i64,
    /// Op code in the low 4 bits, thread code above.
    pub kind: i64,
    pub stack_id: Option<i64>,
    /// `ptr` is there and not 0.
    pub ptr_nonzero: bool,
    /// Bytes asked for; `None` for free, and when not known.
    pub size: Option<u64>,
    pub alloc_dist: Option<i64>,
}

/// Call `f` on every stored event with an id up to `upto` and a time up to
/// `until`, in id order:
/// the rows of `event_groups`, with the `alloc_dist`s of `event_extra`
/// merged in (read side by side, both in id order).
pub fn read_events(
    conn: &rusqlite::Connection,
    upto: i64,
    until: i64,
    mut f: impl FnMut(&StoredEvent),
) -> rusqlite::Result<()> {
    let mut extra_stmt = conn.prepare(
        "SELECT id, alloc_dist FROM event_extra \
         WHERE alloc_dist IS NOT NULL AND id <= ?1 ORDER BY id",
    )?;
    let mut extras = extra_stmt.query([upto])?;
    let mut next_extra = |id: i64, current: &mut Option<(i64, i64)>| -> rusqlite::Result<()> {
        while current.is_some_and(|(at, _)| at < id) {
            *current = match extras.next()? {
                Some(row) => Some((row.get(0)?, row.get(1)?)),
                None => None,
            };
        }
        Ok(())
    };
    // Before the first extra row: ids are at least 0 > i64::MIN.
    let mut extra = Some((i64::MIN, 0));
    let mut stmt = conn.prepare("SELECT * FROM event_groups WHERE g <= ?1 ORDER BY g")?;
    let mut rows = stmt.query([upto >> 4])?;
    while let Some(row) = rows.next()? {
        let group = Group::from_row_until(row, until)?;
        for (k, slot) in group.slots.iter().enumerate() {
            let Some(slot) = slot else {
                continue;
            };
            let Some(id) = group.g.checked_mul(SLOTS as i64).map(|b| b | k as i64) else {
                continue;
            };
            if id > upto {
                break;
            }
            let alloc_dist = match slot.free_dist() {
                Some(d) => Some(d),
                None if has_extra(slot.op_code()) => {
                    next_extra(id, &mut extra)?;
                    extra.filter(|&(at, _)| at == id).map(|(_, d)| d)
                }
                None => None,
            };
            f(&StoredEvent {
                id,
                ts_ns: whole(slot.ts).unwrap_or(0),
                kind: slot.kind,
                stack_id: slot.stack_id(),
                ptr_nonzero: matches!(slot.ptr, Num::Int(n) if n != 0)
                    || matches!(slot.ptr, Num::Real(_)),
                size: match slot.size() {
                    Num::Int(n) => Some(n.max(0) as u64),
                    // Sizes above 2^63 - 1 are stored as REAL.
                    Num::Real(x) => Some(x as u64),
                    Num::Null => None,
                },
                alloc_dist,
            });
        }
    }
    Ok(())
}

/// The id and time of the last stored event.
pub fn last_event(conn: &rusqlite::Connection) -> rusqlite::Result<Option<(i64, i64)>> {
    let mut stmt = conn.prepare("SELECT * FROM event_groups ORDER BY g DESC LIMIT 1")?;
    let mut rows = stmt.query([])?;
    let Some(row) = rows.next()? else {
        return Ok(None);
    };
    let group = Group::from_row(row)?;
    Ok(group.slots.iter().enumerate().rev().find_map(|(k, slot)| {
        let slot = slot.as_ref()?;
        let id = group.g.checked_mul(SLOTS as i64)? | k as i64;
        Some((id, whole(slot.ts).unwrap_or(0)))
    }))
}

fn whole(n: Num) -> Option<i64> {
    match n {
        Num::Int(n) => Some(n),
        Num::Real(x) => Some(x as i64),
        Num::Null => None,
    }
}
