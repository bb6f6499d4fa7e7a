//! The SQL that reads an event out of its group's row (the encoding of
//! `groups.rs`, decoded by the views): an [`Ev`] is the SQL of each column
//! of `event_log`, either of a view row (`a.kind`) or of slot `k` of an
//! `event_groups` row, for the joins SQLite cannot flatten (the right side
//! of a LEFT JOIN).

use super::groups::{KIND_BITS, SLOTS};
use crate::event::Op;

/// The SQL of each column of an event.
pub struct Ev {
    pub id: String,
    pub ts_ns: String,
    pub kind: String,
    pub stack_id: String,
    pub ptr: String,
    pub size: String,
    pub alloc_dist: String,
    pub arg: String,
}

/// Slot `k`'s column `col` of group row `g`.
fn slot(g: &str, k: &str, col: char) -> String {
    let arms: String = (0..SLOTS)
        .map(|i| format!(" WHEN {i} THEN {g}.{col}{i}"))
        .collect();
    format!("(CASE {k}{arms} END)")
}

/// True when slot `k` of group row `g` holds an event.
pub fn present(g: &str, k: &str) -> String {
    format!("((coalesce({g}.m, 65535) >> ({k})) & 1)")
}

impl Ev {
    /// The columns of view row `x` (`event_log`, `event_rows`).
    pub fn alias(x: &str) -> Ev {
        Ev {
            id: format!("{x}.id"),
            ts_ns: format!("{x}.ts_ns"),
            kind: format!("{x}.kind"),
            stack_id: format!("{x}.stack_id"),
            ptr: format!("{x}.ptr"),
            size: format!("{x}.size"),
            alloc_dist: format!("{x}.alloc_dist"),
            arg: format!("{x}.arg"),
        }
    }

    /// The event in slot `k` (an SQL integer) of `event_groups` row `g`:
    /// every column NULL when there is none.
    pub fn slot(g: &str, k: &str) -> Ev {
        let e = slot(g, k, 'e');
        let s = slot(g, k, 's');
        let w = format!("coalesce({g}.w, {KIND_BITS})");
        let id = format!("(({g}.g << 4) | ({k}))");
        let op = format!("({e} & 15)");
        let free = Op::Free as u8;
        let extra = |col: &str| format!("(SELECT {col} FROM event_extra WHERE id = {id})");
        let plain = [Op::Malloc, Op::Calloc, Op::Free].map(|op| (op as u8).to_string());
        Ev {
            ts_ns: format!("({g}.ts + {})", slot(g, k, 't')),
            kind: format!("({e} & ((1 << {w}) - 1))"),
            stack_id: format!("(nullif({e} >> {w}, 0) - 1)"),
            ptr: format!("({g}.ptr + {})", slot(g, k, 'p')),
            size: format!("(CASE WHEN {op} <> {free} THEN {s} END)"),
            alloc_dist: format!(
                "(CASE {op} WHEN {free} THEN -{s} WHEN {} THEN {dist} WHEN {} THEN {dist} END)",
                Op::Realloc as u8,
                Op::Reallocarray as u8,
                dist = extra("alloc_dist"),
            ),
            arg: format!(
                "(CASE WHEN {op} NOT IN ({}) THEN {} END)",
                plain.join(", "),
                extra("arg")
            ),
            id,
        }
    }
}

/// The views over `event_groups`: `event_rows` (the events with their
/// group and slot, for joins on an id: `a.g = X >> 4 AND a.k = X & 15` is
/// two rowid lookups), and `event_log` (the events, as users query them).
pub fn event_views() -> String {
    let ev = Ev::slot("g", "s.k");
    format!(
        "
CREATE VIEW event_rows(g, k, id, ts_ns, kind, stack_id, ptr, size, alloc_dist, arg) AS
SELECT g.g, s.k, {}, {}, {}, {}, {}, {}, {}, {}
FROM event_groups g CROSS JOIN event_slots s
WHERE {};

CREATE VIEW event_log(id, ts_ns, kind, stack_id, ptr, size, alloc_dist, arg) AS
SELECT id, ts_ns, kind, stack_id, ptr, size, alloc_dist, arg FROM event_rows;
",
        ev.id,
        ev.ts_ns,
        ev.kind,
        ev.stack_id,
        ev.ptr,
        ev.size,
        ev.alloc_dist,
        ev.arg,
        present("g", "s.k"),
    )
}
