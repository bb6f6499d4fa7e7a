//! The trace database's schema: tables written during the trace and the views
//! people query. The views are the public interface (`docs/schema.md`); the
//! compact `event_log` table under `events` is an encoding that may change
//! with the schema version.
//!
//! Every view must work on a database that was never finished (memptrace was
//! killed): views may use indexes created here; what `finish` writes
//! (`open_blocks`) may only make them faster. The schema's SQL uses nothing
//! newer than SQLite 3.9 (recursive CTEs, view column lists; no `->>`, no
//! ORDER BY inside aggregates), because whatever `sqlite3` a user has must be
//! able to parse it, or it cannot open the file at all.

use super::rows::{EPOCH_BITS, RAW_PTR, SITE_SHIFT};
use crate::event::Op;

/// `PRAGMA user_version` of databases written with this schema.
pub const SCHEMA_VERSION: i64 = 2;

/// `PRAGMA application_id`: "MPTR", so `file(1)` and tools can tell a trace.
pub const APPLICATION_ID: i64 = 0x4d50_5452;

/// Tables. Created in one transaction with the views, before any record.
const TABLES: &str = "
CREATE TABLE meta(
    key TEXT PRIMARY KEY,
    value TEXT
);
CREATE TABLE threads(
    tid INTEGER PRIMARY KEY,
    pid INTEGER NOT NULL,
    name TEXT,
    start_ns INTEGER,
    end_ns INTEGER
);
CREATE TABLE modules(
    id INTEGER PRIMARY KEY,
    pid INTEGER NOT NULL,
    path TEXT NOT NULL,
    build_id TEXT,
    start INTEGER NOT NULL,
    \"end\" INTEGER NOT NULL,
    base INTEGER NOT NULL,
    loaded_ns INTEGER,
    unloaded_ns INTEGER
);
CREATE TABLE frames(
    id INTEGER PRIMARY KEY,
    ip INTEGER NOT NULL,
    module_id INTEGER,
    function TEXT,
    file TEXT,
    line INTEGER,
    wrapper INTEGER
);
CREATE TABLE frame_lines(
    frame_id INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    function TEXT,
    file TEXT,
    line INTEGER,
    PRIMARY KEY (frame_id, idx)
) WITHOUT ROWID;
CREATE TABLE stacks(
    id INTEGER PRIMARY KEY,
    parent_id INTEGER,
    frame_id INTEGER NOT NULL,
    depth INTEGER NOT NULL,
    trust TEXT
);
-- stack_text walks the trie from the roots down: without this index each
-- step would scan the table. Stack nodes are few next to events, so it is
-- kept up to date from the start rather than built at the end.
CREATE INDEX stacks_parent ON stacks(parent_id);
-- Each stack's call site: its first frame outside the allocator's wrappers
-- (frames.wrapper), and that frame's node. A table rather than a view, so
-- that joining it with millions of events costs a rowid lookup each: a row
-- per stack node as it is written (its own frame: no frame is marked until
-- the end), rewritten by a clean finish once frames are marked
-- (CALL_SITES_AT_FINISH).
CREATE TABLE call_sites(
    stack_id INTEGER PRIMARY KEY,
    frame_id INTEGER NOT NULL,
    site_id INTEGER NOT NULL
);
CREATE TABLE ops(
    code INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE
);
CREATE TABLE event_threads(
    code INTEGER PRIMARY KEY,
    pid INTEGER NOT NULL,
    tid INTEGER NOT NULL
);
-- Written once by a clean finish, in one transaction: the allocations no
-- release named, and one row saying so. Until then `leaks` searches itself.
CREATE TABLE open_blocks(
    alloc_id INTEGER PRIMARY KEY
);
CREATE TABLE trace_finished(
    open_blocks INTEGER NOT NULL
);
-- The leaks by stack, written by the same clean finish (`leaks_by_stack`):
-- asking what leaked, by stack, then reads a row per stack, not one per
-- leaked block (2.5 M of them in a 100 M-call trace).
CREATE TABLE finished_leaks(
    stack_id INTEGER,
    blocks INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
-- The blocks live in a process when it exec'd: the exec released them with
-- its old image (docs/schema.md, exec_releases). Not leaks.
CREATE TABLE exec_releases(
    alloc_id INTEGER PRIMARY KEY,
    ts_ns INTEGER NOT NULL,
    pid INTEGER NOT NULL
);
-- One row per allocator call, in as few bytes as SQLite can store it: see
-- docs/schema.md, \"How events are stored\". The columns most often NULL come
-- last (an SQLite built with SQLITE_ENABLE_NULL_TRIM leaves them out).
CREATE TABLE event_log(
    id INTEGER PRIMARY KEY,
    t INTEGER,
    k INTEGER,
    d INTEGER,
    p INTEGER,
    n INTEGER,
    o INTEGER
);
-- The base time of each epoch of event_log: the ids sharing id >> 10.
CREATE TABLE event_epochs(
    epoch INTEGER PRIMARY KEY,
    ts_ns INTEGER NOT NULL
);
-- Each (thread, stack) that called the allocator: an event's k names it.
-- pid and tid repeat event_threads', so that a view finds them in one
-- lookup per event.
CREATE TABLE event_sites(
    code INTEGER PRIMARY KEY,
    thread INTEGER NOT NULL,
    stack_id INTEGER,
    base INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    tid INTEGER NOT NULL
);
-- One row per call of a mapping function (docs/schema.md, map_events).
CREATE TABLE map_events(
    id INTEGER PRIMARY KEY,
    ts_ns INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    tid INTEGER NOT NULL,
    op TEXT NOT NULL,
    addr INTEGER,
    len INTEGER,
    new_len INTEGER,
    prot INTEGER,
    flags INTEGER,
    fd INTEGER,
    offset INTEGER,
    advice INTEGER,
    result INTEGER NOT NULL,
    stack_id INTEGER,
    by_allocator TEXT
);
-- The traced processes' resident and mapped memory, sampled every
-- meta rss_interval_ms (docs/schema.md, rss). A sample is a few rows at
-- most every 100 ms: no index but the one on time.
CREATE TABLE rss(
    ts_ns INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    rss INTEGER NOT NULL,
    anon INTEGER NOT NULL,
    file INTEGER NOT NULL,
    shmem INTEGER NOT NULL,
    mapped INTEGER NOT NULL
);
CREATE INDEX rss_ts ON rss(ts_ns);
";

/// The call site of every stack whose own frame is a wrapper: walk up
/// from each node while the frames are wrappers; the first that is not is
/// the call site. A stack that is all wrappers keeps its own frame. Run by
/// a clean finish, after the frames are named and marked.
///
/// The walk starts only from the nodes whose frame is a wrapper (the few
/// wrapper frames held as a set SQLite builds once, `IN w`), not from
/// every node with a lookup of its frame: on `-f -- make -j2`'s 1.42 M
/// nodes, 9 302 wrapper frames, 0.8 s where that took 2.3 s.
pub const CALL_SITES_AT_FINISH: &str = "
WITH RECURSIVE w(id) AS (SELECT id FROM frames WHERE wrapper),
up(stack_id, node, parent_id, wrapper) AS (
    SELECT s.id, s.id, s.parent_id, 1 FROM stacks s WHERE s.frame_id IN w
    UNION ALL
    SELECT up.stack_id, p.id, p.parent_id, p.frame_id IN w
    FROM up JOIN stacks p ON p.id = up.parent_id
    WHERE up.wrapper
)
INSERT OR REPLACE INTO call_sites(stack_id, frame_id, site_id)
SELECT up.stack_id, s.frame_id, up.node
FROM up JOIN stacks s ON s.id = up.node
WHERE NOT up.wrapper;
";

/// The name of the module-relative address of frame `f` in module `m`
/// (`libc.so.6+0x2a1c9`), or its absolute address (`0x7f12...`) without one.
const ADDRESS: &str = "CASE WHEN m.id IS NULL THEN printf('0x%x', f.ip) \
     ELSE substr(m.path, length(rtrim(m.path, replace(m.path, '/', ''))) + 1) \
          || printf('+0x%x', f.ip - m.base) END";

/// ` (file:line)`, ` (file)` or nothing, for a row `x` with file and line.
fn location(x: &str) -> String {
    format!(
        "CASE WHEN {x}.file IS NULL THEN '' \
              WHEN {x}.line IS NULL THEN ' (' || {x}.file || ')' \
              ELSE ' (' || {x}.file || ':' || {x}.line || ')' END"
    )
}

/// ` [found by frame pointer]` after a frame of stack node `x` found by a
/// frame pointer, nothing after the others (breakpad's "found by").
fn trust_mark(x: &str) -> String {
    format!("CASE WHEN {x}.trust = 'frame pointer' THEN ' [found by frame pointer]' ELSE '' END")
}

/// `name` of the op of `event_log` row `x`, as a CASE (cheaper than a join,
/// and computed only when the column is used).
fn op_name(x: &str) -> String {
    let arms: Vec<String> = Op::RECORDED
        .iter()
        .map(|&op| format!("WHEN {} THEN '{}'", op as u8, op.name()))
        .collect();
    format!("CASE {x}.k & 15 {} END", arms.join(" "))
}

/// `column` of the site (`event_sites`) of `event_log` row `x`.
fn site(x: &str, column: &str) -> String {
    format!("(SELECT {column} FROM event_sites WHERE code = {x}.k >> {SITE_SHIFT})")
}

/// `column` (pid or tid) of the thread of `event_log` row `x`.
fn thread(x: &str, column: &str) -> String {
    site(x, column)
}

/// `ts_ns` of `event_log` row `x`: its time in its epoch plus the epoch's.
fn ts(x: &str) -> String {
    format!("({x}.t + (SELECT ts_ns FROM event_epochs WHERE epoch = {x}.id >> {EPOCH_BITS}))")
}

/// The pointer stored in `event_log` row `x` (NULL for a free of a known
/// block): raw, or the site's base plus 16 bytes per unit.
fn ptr(x: &str) -> String {
    format!(
        "CASE WHEN {x}.p IS NULL THEN NULL WHEN {x}.k & {RAW_PTR} THEN {x}.p \
         ELSE {base} + {x}.p * 16 END",
        base = site(x, "base")
    )
}

/// True when `event_log` row `x` stores a pointer other than 0 (`ptr <> 0`
/// on the decoded pointer: an encoded one never is 0).
fn nonzero(x: &str) -> String {
    format!("({x}.p IS NOT NULL AND NOT ({x}.k & {RAW_PTR} AND {x}.p = 0))")
}

/// The block released by `event_log` row `x`, when `x.d` names the event
/// that allocated it.
fn released_ptr(x: &str) -> String {
    format!(
        "(SELECT {} FROM event_log q WHERE q.id = {x}.id - {x}.d)",
        ptr("q")
    )
}

/// True for an allocation `a` (an event that returned a block) that no
/// release names and no exec released. The one definition of a leak: the
/// `leaks` view uses it until `finish` has stored its result in
/// `open_blocks`.
pub fn unreleased(a: &str) -> String {
    format!(
        "{a}.k & 15 <> {free} AND {nonzero} \
         AND {a}.id NOT IN (SELECT r.id - r.d FROM event_log r WHERE r.d IS NOT NULL) \
         AND {a}.id NOT IN (SELECT alloc_id FROM exec_releases)",
        free = Op::Free as u8,
        nonzero = nonzero(a),
    )
}

/// The columns of `allocations` for a release `r` left-joined with the
/// allocation `a` it names (shared with `temporary`).
fn pair_columns() -> String {
    format!(
        "coalesce({ptr_a}, CASE WHEN r.k & 15 = {free} THEN {ptr_r} ELSE r.o END) AS ptr,
       a.n AS size,
       {tid_a} AS tid,
       {pid_a} AS pid,
       {op_a} AS op,
       a.id AS alloc_id,
       {ts_a} AS alloc_ns,
       {ts_r} AS free_ns,
       {op_r} AS free_op,
       r.id AS free_id,
       {stack_a} AS alloc_stack_id,
       {stack_r} AS free_stack_id,
       {tid_r} AS free_tid",
        free = Op::Free as u8,
        ptr_a = ptr("a"),
        ptr_r = ptr("r"),
        tid_a = thread("a", "tid"),
        pid_a = thread("a", "pid"),
        op_a = op_name("a"),
        op_r = op_name("r"),
        ts_a = ts("a"),
        ts_r = ts("r"),
        stack_a = site("a", "stack_id"),
        stack_r = site("r", "stack_id"),
        tid_r = thread("r", "tid"),
    )
}

/// The columns of `leaks` for an allocation `a` no release named, and of
/// `allocations` for one an exec released (`x`).
fn unpaired_columns(exec: bool) -> String {
    let (pid, free_ns, free_op) = if exec {
        ("x.pid".to_string(), "x.ts_ns", "'exec'")
    } else {
        (thread("a", "pid"), "NULL", "NULL")
    };
    format!(
        "{ptr} AS ptr, a.n AS size, {tid} AS tid, {pid} AS pid, {op} AS op,
         a.id AS alloc_id, {ts} AS alloc_ns, {free_ns} AS free_ns, {free_op} AS free_op,
         NULL AS free_id, {stack} AS alloc_stack_id, NULL AS free_stack_id,
         NULL AS free_tid",
        ptr = ptr("a"),
        tid = thread("a", "tid"),
        op = op_name("a"),
        ts = ts("a"),
        stack = site("a", "stack_id"),
    )
}

/// Views: the user's contract, over the tables above. Columns come from
/// scalar subqueries and CASEs rather than joins where they can, so a query
/// pays only for the columns it uses.
fn views() -> String {
    let realloc = format!("IN ({}, {})", Op::Realloc as u8, Op::Reallocarray as u8);
    let free = Op::Free as u8;
    let leak_columns = unpaired_columns(false);
    let exec_columns = unpaired_columns(true);
    let unreleased = unreleased("a");
    // The leaks of a finished trace are its rows of agg_live (those of
    // open_blocks): read there, the event log is not read at all. A trace
    // without aggregates (its storage stopped growing) joins open_blocks
    // with the event log; one not finished searches the log. An arm that
    // does not apply has an empty range of ids, which SQLite skips without
    // a scan (a NOT EXISTS alone still scans).
    let live_columns = "l.ptr AS ptr, l.size AS size,
         (SELECT tid FROM event_threads WHERE code = l.thread) AS tid,
         (SELECT pid FROM event_threads WHERE code = l.thread) AS pid, l.op AS op,
         l.alloc_id AS alloc_id, l.ts_ns AS alloc_ns, NULL AS free_ns, NULL AS free_op,
         NULL AS free_id, l.stack_id AS alloc_stack_id, NULL AS free_stack_id,
         NULL AS free_tid";
    let unless = |table: &str| {
        format!(
            "(SELECT CASE WHEN count(*) = 0 THEN {} ELSE -1 END FROM {table})",
            i64::MAX
        )
    };
    let (unless_agg, unless_finished) = (unless("agg_totals"), unless("trace_finished"));
    // 1 when event `e` returned a block, else 0 (heap_over_time).
    let allocated = format!("(e.k & 15 <> {free} AND {})", nonzero("e"));
    let line_loc = location("l");
    let frame_loc = location("f");
    format!(
        "
CREATE VIEW events AS
SELECT e.id AS id,
       {ts_e} AS ts_ns,
       {pid_e} AS pid,
       {tid_e} AS tid,
       {op_e} AS op,
       coalesce({ptr_e}, {released_e}) AS ptr,
       e.n AS size,
       CASE WHEN e.k & 15 {realloc} THEN coalesce(e.o, {released_e}) END AS old_ptr,
       CASE WHEN e.k & 15 NOT {realloc} THEN e.o END AS align,
       e.id - e.d AS alloc_id,
       {stack_e} AS stack_id
FROM event_log e;

CREATE VIEW leaks AS
SELECT {live_columns}
FROM open_blocks b JOIN agg_live l ON l.alloc_id = b.alloc_id
UNION ALL
SELECT {leak_columns}
FROM open_blocks b JOIN event_log a ON a.id = b.alloc_id
WHERE b.alloc_id <= {unless_agg}
UNION ALL
SELECT {leak_columns}
FROM event_log a
WHERE a.id <= {unless_finished} AND {unreleased};

CREATE VIEW leaks_by_stack(stack_id, blocks, bytes) AS
SELECT stack_id, blocks, bytes FROM finished_leaks
UNION ALL
SELECT {stack_a}, count(*), sum(a.n)
FROM event_log a
WHERE a.id <= {unless_finished} AND {unreleased}
GROUP BY 1;

CREATE VIEW allocations AS
SELECT {pair_columns}
FROM event_log r
LEFT JOIN event_log a ON a.id = r.id - r.d
WHERE r.d IS NOT NULL
   OR (r.k & 15 = {free} AND {nonzero_r})
   OR (r.k & 15 {realloc} AND r.o <> 0 AND ({nonzero_r} OR r.n = 0))
UNION ALL
SELECT {exec_columns}
FROM exec_releases x JOIN event_log a ON a.id = x.alloc_id
UNION ALL
SELECT * FROM leaks;

CREATE VIEW temporary AS
SELECT {pair_columns}
FROM event_log r
JOIN event_log a ON a.id = r.id - r.d
WHERE r.d IS NOT NULL
  AND {thread_a} = {thread_r}
  AND NOT EXISTS (SELECT 1 FROM event_log x
                  WHERE x.id > a.id AND x.id < r.id AND {thread_x} = {thread_r});

CREATE VIEW heap_over_time(id, ts_ns, delta, bytes, blocks) AS
WITH RECURSIVE h(id, ts_ns, delta, dblocks, bytes, blocks) AS (
    SELECT e.id, {ts_e}, {delta}, {dblocks}, {delta}, {dblocks}
    FROM event_log e LEFT JOIN event_log a ON a.id = e.id - e.d
    WHERE e.id = (SELECT min(id) FROM event_log)
    UNION ALL
    SELECT e.id, {ts_e}, {delta}, {dblocks}, h.bytes + {delta}, h.blocks + {dblocks}
    FROM h
    JOIN event_log e ON e.id = (SELECT min(x.id) FROM event_log x WHERE x.id > h.id)
    LEFT JOIN event_log a ON a.id = e.id - e.d
)
SELECT id, ts_ns, delta, bytes, blocks FROM h;

CREATE VIEW frame_text(frame_id, text) AS
SELECT f.id,
       coalesce(
         (SELECT group_concat(x.text, char(10)) FROM (
            SELECT coalesce(l.function, {ADDRESS}) || {line_loc} AS text
            FROM frame_lines l WHERE l.frame_id = f.id ORDER BY l.idx) x),
         coalesce(f.function, {ADDRESS}) || {frame_loc})
FROM frames f
LEFT JOIN modules m ON m.id = f.module_id;

CREATE VIEW stack_text(stack_id, text) AS
WITH RECURSIVE walk(id, text) AS (
    SELECT s.id, coalesce((SELECT text FROM frame_text WHERE frame_id = s.frame_id), '??')
                 || {trust_s}
    FROM stacks s WHERE s.parent_id IS NULL
    UNION ALL
    SELECT s.id, coalesce((SELECT text FROM frame_text WHERE frame_id = s.frame_id), '??')
                 || {trust_s} || char(10) || w.text
    FROM walk w JOIN stacks s ON s.parent_id = w.id
)
SELECT id, text FROM walk;
",
        trust_s = trust_mark("s"),
        ts_e = ts("e"),
        pid_e = thread("e", "pid"),
        tid_e = thread("e", "tid"),
        op_e = op_name("e"),
        ptr_e = ptr("e"),
        stack_e = site("e", "stack_id"),
        stack_a = site("a", "stack_id"),
        released_e = released_ptr("e"),
        nonzero_r = nonzero("r"),
        thread_a = site("a", "thread"),
        thread_r = site("r", "thread"),
        thread_x = site("x", "thread"),
        pair_columns = pair_columns(),
        delta = format!("({allocated} * coalesce(e.n, 0) - coalesce(a.n, 0))"),
        dblocks = format!("({allocated} - (a.id IS NOT NULL))"),
    )
}

/// The whole schema, for one `execute_batch`, followed by the `ops` rows.
pub fn ddl() -> String {
    let mut sql = String::from(TABLES);
    sql.push_str(super::heap::HEAP_TABLES);
    sql.push_str(super::aggregates::AGGREGATE_TABLES);
    sql.push_str(&views());
    for op in Op::RECORDED {
        sql.push_str(&format!(
            "INSERT INTO ops(code, name) VALUES ({}, '{}');\n",
            op as u8,
            op.name()
        ));
    }
    sql
}
