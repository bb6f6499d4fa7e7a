//! Tables, symbols, stack text, and the database's life: created, committed,
//! read while running, finished, or abandoned.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension};

use super::*;
use crate::sink::{
    FrameRecord, FrameSymbols, ModuleRecord, RssSample, SourceLine, StackNode, ThreadRecord,
};

#[test]
fn creates_the_schema() {
    let dir = TempDir::new("schema");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    sink.commit().unwrap();
    let conn = read(&dir.db());
    let mut names: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_schema WHERE type IN ('table', 'view') ORDER BY name")
        .unwrap()
        .query_map([], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    names.retain(|n| !n.starts_with("sqlite_"));
    for expected in [
        "agg_calls",
        "agg_live",
        "agg_over_time",
        "agg_peak",
        "agg_sizes",
        "agg_totals",
        "allocations",
        "event_epochs",
        "event_log",
        "event_sites",
        "event_threads",
        "events",
        "frame_lines",
        "frame_text",
        "frames",
        "heap_arenas",
        "heap_chunks",
        "heap_mallinfo",
        "heap_over_time",
        "heap_pages",
        "heap_snapshots",
        "leaks",
        "meta",
        "modules",
        "ops",
        "rss",
        "stack_text",
        "stacks",
        "temporary",
        "threads",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} in {names:?}"
        );
    }
    assert_eq!(query_i64(&conn, "PRAGMA user_version"), 2);
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM ops"), 11);
    // The contract's columns, by name.
    conn.prepare(
        "SELECT id, ts_ns, pid, tid, op, ptr, size, old_ptr, align, alloc_id, stack_id FROM events",
    )
    .unwrap();
    conn.prepare(
        "SELECT ptr, size, tid, pid, op, alloc_id, alloc_ns, free_ns, free_op, free_id,
                alloc_stack_id, free_stack_id FROM allocations",
    )
    .unwrap();
    conn.prepare("SELECT ptr, size, tid, pid, op, alloc_ns, free_ns FROM leaks")
        .unwrap();
    conn.prepare(
        "SELECT id, path, build_id, start, end, base, loaded_ns, unloaded_ns FROM modules",
    )
    .unwrap();
    conn.prepare("SELECT stack_id, text FROM stack_text")
        .unwrap();
}

#[test]
fn finishes_an_empty_trace_without_leftover_files() {
    let dir = TempDir::new("empty");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    sink.finish().unwrap();
    assert!(
        sink.write(&meta("k", "v")).is_err(),
        "writes after finish fail"
    );
    for suffix in ["-wal", "-shm"] {
        let mut side = dir.db().into_os_string();
        side.push(suffix);
        assert!(!Path::new(&side).exists(), "{suffix} left behind");
    }
    let conn = read(&dir.db());
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM allocations"), 0);
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM stack_text"), 0);
}

#[test]
fn meta_threads_and_modules_keep_the_last_word() {
    let dir = TempDir::new("meta");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    let thread = |name: &str, end_ns| {
        Record::Thread(ThreadRecord {
            tid: 7,
            pid: 5,
            name: name.into(),
            start_ns: 10,
            end_ns,
        })
    };
    write_all(
        &mut sink,
        &[
            meta("exit_status", "1"),
            meta("exit_status", "0"),
            thread("main", None),
            thread("worker", Some(99)),
            Record::Module(ModuleRecord {
                id: 3,
                pid: 5,
                path: "/lib/libc.so.6".into(),
                build_id: Some("abcd".into()),
                start: 0x7f00_0000_0000,
                end: 0x7f00_0020_0000,
                base: 0x7f00_0000_0000,
                loaded_ns: 5,
                static_exe: false,
            }),
            Record::ModuleUnloaded { id: 3, ts_ns: 77 },
        ],
    );
    sink.finish().unwrap();
    let conn = read(&dir.db());
    let value: String = conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'exit_status'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(value, "0");
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM meta"), 1);
    let thread: (i64, String, i64, Option<i64>) = conn
        .query_row(
            "SELECT pid, name, start_ns, end_ns FROM threads WHERE tid = 7",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert_eq!(thread, (5, "worker".into(), 10, Some(99)));
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM threads"), 1);
    let module: (String, i64, i64, i64) = conn
        .query_row(
            "SELECT path, end - start, loaded_ns, unloaded_ns FROM modules WHERE id = 3",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert_eq!(module, ("/lib/libc.so.6".into(), 0x20_0000, 5, 77));
}

/// Module 1 (`/usr/bin/app`, loaded with bias 0x5555_0000_0000), frames:
/// 1 symbolized with an inlined chain, 2 unknown inside the module, 3 outside
/// every module, 4 with a name only. Stack: 3 (outermost) -> 2 -> 1 (leaf).
fn stack_records() -> Vec<Record> {
    let frame = |id, ip, module_id| Record::Frame(FrameRecord { id, ip, module_id });
    let node = |id, parent_id, frame_id, depth| {
        Record::StackNode(StackNode {
            id,
            parent_id,
            frame_id,
            depth,
            trust: crate::sink::Trust::Cfi,
        })
    };
    vec![
        Record::Module(ModuleRecord {
            id: 1,
            pid: 100,
            path: "/usr/bin/app".into(),
            build_id: None,
            start: 0x5555_0000_1000,
            end: 0x5555_0001_0000,
            base: 0x5555_0000_0000,
            loaded_ns: 0,
            static_exe: false,
        }),
        frame(1, 0x5555_0000_1234, Some(1)),
        frame(2, 0x5555_0000_2abc, Some(1)),
        frame(3, 0x7fff_1234_5678, None),
        frame(4, 0x5555_0000_3000, Some(1)),
        node(10, None, 3, 0),
        node(11, Some(10), 2, 1),
        node(12, Some(11), 1, 2),
        node(13, Some(11), 4, 2),
    ]
}

fn line(function: Option<&str>, file: Option<&str>, line: Option<u32>) -> SourceLine {
    SourceLine {
        function: function.map(String::from),
        file: file.map(String::from),
        line,
    }
}

fn symbols() -> Vec<Record> {
    vec![
        Record::Symbols(FrameSymbols {
            frame_id: 1,
            lines: vec![
                line(Some("make_node"), Some("src/list.c"), Some(12)),
                line(Some("push_back"), Some("src/list.c"), Some(40)),
            ],
            wrapper: false,
        }),
        Record::Symbols(FrameSymbols {
            frame_id: 4,
            lines: vec![line(Some("helper"), None, None)],
            wrapper: false,
        }),
    ]
}

#[test]
fn symbols_fill_frames_and_frame_lines() {
    let dir = TempDir::new("symbols");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    write_all(&mut sink, &stack_records());
    write_all(&mut sink, &symbols());
    // Sent twice: the second replaces the first, no duplicate lines.
    write_all(&mut sink, &symbols());
    sink.finish().unwrap();
    let conn = read(&dir.db());
    let frame: (String, String, i64) = conn
        .query_row(
            "SELECT function, file, line FROM frames WHERE id = 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    // Named after the function whose code it is: make_node was inlined.
    assert_eq!(frame, ("push_back".into(), "src/list.c".into(), 40));
    let lines: Vec<(i64, String, i64)> = conn
        .prepare("SELECT idx, function, line FROM frame_lines WHERE frame_id = 1 ORDER BY idx")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        lines,
        vec![(0, "make_node".into(), 12), (1, "push_back".into(), 40)]
    );
    let unnamed: Option<String> = conn
        .query_row("SELECT function FROM frames WHERE id = 2", [], |r| r.get(0))
        .unwrap();
    assert_eq!(unnamed, None);
}

fn stack_text(conn: &Connection, id: i64) -> Option<String> {
    conn.query_row(
        "SELECT text FROM stack_text WHERE stack_id = ?",
        [id],
        |r| r.get(0),
    )
    .optional()
    .unwrap()
}

#[test]
fn stack_text_names_every_frame_innermost_first() {
    let dir = TempDir::new("stack_text");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    write_all(&mut sink, &stack_records());
    sink.commit().unwrap();
    // Before symbols arrive: addresses only.
    let conn = read(&dir.db());
    assert_eq!(
        stack_text(&conn, 12).as_deref(),
        Some("app+0x1234\napp+0x2abc\n0x7fff12345678")
    );
    write_all(&mut sink, &symbols());
    sink.finish().unwrap();
    let conn = read(&dir.db());
    assert_eq!(
        stack_text(&conn, 12).as_deref(),
        Some("make_node (src/list.c:12)\npush_back (src/list.c:40)\napp+0x2abc\n0x7fff12345678")
    );
    assert_eq!(
        stack_text(&conn, 13).as_deref(),
        Some("helper\napp+0x2abc\n0x7fff12345678")
    );
    assert_eq!(stack_text(&conn, 10).as_deref(), Some("0x7fff12345678"));
    assert_eq!(query_i64(&conn, "SELECT count(*) FROM stack_text"), 4);
}

/// One row per stack: the first frame outside the allocator's wrappers,
/// innermost first, and its node; the innermost frame when every frame is
/// a wrapper, and until the trace is finished.
#[test]
fn call_sites_skip_the_wrappers() {
    let named = |frame_id, function: &str, wrapper| {
        Record::Symbols(FrameSymbols {
            frame_id,
            lines: vec![line(Some(function), None, None)],
            wrapper,
        })
    };
    let sites = |conn: &Connection| -> Vec<(i64, i64, i64)> {
        conn.prepare("SELECT stack_id, frame_id, site_id FROM call_sites ORDER BY stack_id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    };
    // 12 -> 11 -> 10 holds frames 1, 2, 3; 13 -> 11 -> 10 holds 4, 2, 3.
    let own = [(10, 3, 10), (11, 2, 11), (12, 1, 12), (13, 4, 13)];
    for (wrappers, finished) in [
        // Frame 1 (xmalloc) a wrapper: 12 is charged to frame 2, node 11.
        (
            &[1][..],
            [(10, 3, 10), (11, 2, 11), (12, 2, 11), (13, 4, 13)],
        ),
        // Every frame of 12 a wrapper: its own frame stands for the call.
        (&[1, 2, 3][..], own),
    ] {
        let dir = TempDir::new("call_sites");
        let mut sink = SqliteSink::create(&dir.db()).unwrap();
        write_all(&mut sink, &stack_records());
        let mut marks = vec![named(4, "helper", false)];
        marks.extend(wrappers.iter().map(|&f| named(f, "xmalloc", true)));
        write_all(&mut sink, &marks);
        sink.commit().unwrap();
        // A running (or killed) trace: each stack's own frame.
        assert_eq!(sites(&read(&dir.db())), own);
        sink.finish().unwrap();
        assert_eq!(sites(&read(&dir.db())), finished, "wrappers {wrappers:?}");
    }
}

#[test]
fn a_running_trace_is_readable_after_each_commit() {
    let dir = TempDir::new("live");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    write_all(&mut sink, &[meta("mode", "launch"), malloc(1, 0x1000, 8)]);
    let reader = read(&dir.db());
    assert_eq!(query_i64(&reader, "SELECT count(*) FROM events"), 0);
    sink.commit().unwrap();
    assert_eq!(query_i64(&reader, "SELECT count(*) FROM events"), 1);
    assert_eq!(query_i64(&reader, "SELECT count(*) FROM leaks"), 1);
    write_all(&mut sink, &[free(2, 0x1000, Some(1))]);
    // Uncommitted rows are invisible, committed ones stay consistent.
    assert_eq!(query_i64(&reader, "SELECT count(*) FROM leaks"), 1);
    sink.commit().unwrap();
    assert_eq!(query_i64(&reader, "SELECT count(*) FROM leaks"), 0);
    // The writer dies without finishing (as under SIGKILL): the WAL stays,
    // and everything committed is there.
    write_all(&mut sink, &[malloc(3, 0x2000, 8)]);
    std::mem::forget(sink);
    drop(reader);
    let after = read(&dir.db());
    assert_eq!(query_i64(&after, "SELECT count(*) FROM events"), 2);
    assert_eq!(query_i64(&after, "SELECT count(*) FROM allocations"), 1);
}

/// A `sqlite3` left open on the trace must not make `finish` fail or wait:
/// the database just stays in WAL mode until the reader closes it.
#[test]
fn finish_with_a_reader_attached_keeps_the_data() {
    let dir = TempDir::new("reader");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    write_all(&mut sink, &[malloc(1, 0x1000, 8)]);
    sink.commit().unwrap();
    let reader = read(&dir.db());
    assert_eq!(query_i64(&reader, "SELECT count(*) FROM leaks"), 1);
    sink.finish().unwrap();
    assert_eq!(query_i64(&reader, "SELECT count(*) FROM trace_finished"), 1);
    assert_eq!(query_i64(&reader, "SELECT count(*) FROM leaks"), 1);
    drop(reader);
    let mut wal = dir.db().into_os_string();
    wal.push("-wal");
    assert!(!Path::new(&wal).exists(), "the last reader removes the WAL");
}

/// An id SQLite cannot store fails the commit, as an error, and the sink
/// refuses to go on rather than number later rows wrongly.
#[test]
fn a_failed_write_stops_the_sink() {
    let dir = TempDir::new("failed");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    write_all(&mut sink, &[malloc(1, 0x1000, 8)]);
    sink.commit().unwrap();
    sink.write(&malloc(u64::MAX, 0x2000, 8)).unwrap();
    assert!(sink.commit().is_err());
    assert!(sink.write(&malloc(2, 0x3000, 8)).is_err());
    drop(sink);
    assert_eq!(
        query_i64(&read(&dir.db()), "SELECT count(*) FROM events"),
        1
    );
}

#[test]
fn stores_rss_samples_in_bytes() {
    let dir = TempDir::new("rss");
    let mut sink = SqliteSink::create(&dir.db()).unwrap();
    let sample = RssSample {
        ts_ns: 100_000_000,
        pid: 42,
        rss: 3 << 20,
        anon: 2 << 20,
        file: 1 << 20,
        shmem: 0,
        mapped: 5 << 30,
    };
    sink.write(&Record::Rss(sample)).unwrap();
    sink.finish().unwrap();
    let conn = read(&dir.db());
    let row: (i64, i64, i64, i64, i64, i64, i64) = conn
        .query_row(
            "SELECT ts_ns, pid, rss, anon, file, shmem, mapped FROM rss",
            [],
            |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                ))
            },
        )
        .unwrap();
    assert_eq!(
        row,
        (100_000_000, 42, 3 << 20, 2 << 20, 1 << 20, 0, 5 << 30)
    );
}
