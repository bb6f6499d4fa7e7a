//! The report's numbers on a small trace written through the real SQLite
//! sink, where every answer is worked out by hand (see [`scenario`]), and
//! on a random one checked against the schema's views.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use super::scan::Analysis;
use super::stacks::{Owner, StackTable};
use super::summary::{LiveAtEnd, Summary};
use super::window::{self, Class};
use super::*;
use crate::event::{Event, Op};
use crate::sink::{
    EventSink, FrameRecord, FrameSymbols, ModuleRecord, Record, SourceLine, SqliteSink, StackNode,
    ThreadRecord,
};

mod live;
mod outputs;

/// A directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "memptrace-report-{}-{}-{name}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating a temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const APP: u64 = 0x1000_0000;
const LIBC: u64 = 0x7f00_0000_0000;
const CXX: u64 = 0x7f10_0000_0000;

fn module(id: u64, path: &str, base: u64) -> Record {
    Record::Module(ModuleRecord {
        id,
        pid: 100,
        path: path.into(),
        build_id: None,
        start: base,
        end: base + 0x10_0000,
        base,
        loaded_ns: 0,
        static_exe: false,
    })
}

fn frame(id: u64, ip: u64, module_id: u64) -> Record {
    Record::Frame(FrameRecord {
        id,
        ip,
        module_id: Some(module_id),
    })
}

fn node(id: u64, parent_id: Option<u64>, frame_id: u64, depth: u32) -> Record {
    Record::StackNode(StackNode {
        id,
        parent_id,
        frame_id,
        depth,
        trust: crate::sink::Trust::Cfi,
    })
}

fn symbols(frame_id: u64, lines: &[(&str, u32)]) -> Record {
    Record::Symbols(FrameSymbols {
        frame_id,
        lines: lines
            .iter()
            .map(|(f, l)| SourceLine {
                function: Some(f.to_string()),
                file: Some("/src/app.c".into()),
                line: Some(*l),
            })
            .collect(),
        wrapper: false,
    })
}

/// Stacks (leaf first): s11 make_node [inlined in push_back] <- main;
/// s12 strdup (libc) <- main; s14 operator new (libstdc++) <- Widget <- main;
/// s16 _IO_file_doallocate <- puts (all libc); s18 unknown app code <- main.
///
/// Events (thread 100 unless said, ts = id µs):
///  1 malloc 100 A (s12, leaked)     2 malloc 64 B (s11)   3 free B: temporary
///  4 malloc 1000 C (s14)            5 [101] malloc 32 D (s11)
///  6 free C: temporary (5 is another thread's)
///  7 malloc 4096 E (s16, leaked)    8 [101] realloc D -> F 128 (s11): D temporary
///  9 malloc 10 G (s18)             10 malloc 2000 H (s14, leaked): the peak, 6334 B
/// 11 free G: not temporary (10 came between)
/// 12 [101] free F: temporary       13 malloc 2^40 fails (s18)
fn scenario() -> Vec<Record> {
    let mut r = vec![
        Record::Meta {
            key: "command".into(),
            value: "./app --test".into(),
        },
        module(1, "/usr/bin/app", APP),
        module(2, "/lib/x86_64-linux-gnu/libc.so.6", LIBC),
        module(3, "/usr/lib/x86_64-linux-gnu/libstdc++.so.6", CXX),
        Record::Thread(ThreadRecord {
            tid: 100,
            pid: 100,
            name: "app".into(),
            start_ns: 0,
            end_ns: None,
        }),
        Record::Thread(ThreadRecord {
            tid: 101,
            pid: 100,
            name: "worker".into(),
            start_ns: 0,
            end_ns: None,
        }),
        frame(1, APP + 0x1100, 1),
        frame(2, APP + 0x1200, 1),
        frame(3, LIBC + 0x300, 2),
        frame(4, CXX + 0x400, 3),
        frame(5, APP + 0x1500, 1),
        frame(6, LIBC + 0x600, 2),
        frame(7, LIBC + 0x700, 2),
        frame(8, APP + 0x2345, 1),
        node(10, None, 1, 0),
        node(11, Some(10), 2, 1),
        node(12, Some(10), 3, 1),
        node(13, Some(10), 5, 1),
        node(14, Some(13), 4, 2),
        node(15, None, 7, 0),
        node(16, Some(15), 6, 1),
        node(18, Some(10), 8, 1),
    ];
    let events = [
        Event::test(1, 1000, 100, Op::Malloc, 0xa0, Some(100), Some(12)),
        Event::test(2, 2000, 100, Op::Malloc, 0xb0, Some(64), Some(11)),
        Event::test_free(3, 3000, 100, 0xb0, 2, None),
        Event::test(4, 4000, 100, Op::Malloc, 0xc0, Some(1000), Some(14)),
        Event::test(5, 5000, 101, Op::Malloc, 0xd0, Some(32), Some(11)),
        Event::test_free(6, 6000, 100, 0xc0, 4, None),
        Event::test(7, 7000, 100, Op::Malloc, 0xe0, Some(4096), Some(16)),
        Event {
            old_ptr: Some(0xd0),
            alloc_id: Some(5),
            ..Event::test(8, 8000, 101, Op::Realloc, 0xf0, Some(128), Some(11))
        },
        Event::test(9, 9000, 100, Op::Malloc, 0x90, Some(10), Some(18)),
        Event::test(10, 10000, 100, Op::Malloc, 0x80, Some(2000), Some(14)),
        Event::test_free(11, 11000, 100, 0x90, 9, None),
        Event::test_free(12, 12000, 101, 0xf0, 8, None),
        Event::test(13, 13000, 100, Op::Malloc, 0, Some(1 << 40), Some(18)),
    ];
    r.extend(events.into_iter().map(Record::Event));
    r.extend([
        symbols(1, &[("main", 50)]),
        symbols(2, &[("make_node", 12), ("push_back", 40)]),
        symbols(3, &[("strdup", 0)]),
        symbols(4, &[("operator new(unsigned long)", 0)]),
        symbols(5, &[("Widget::Widget()", 30)]),
        symbols(6, &[("_IO_file_doallocate", 0)]),
        symbols(7, &[("puts", 0)]),
    ]);
    r
}

fn write_trace(dir: &TempDir, records: &[Record], finish: bool) -> PathBuf {
    let path = dir.0.join("trace.db");
    let mut sink = SqliteSink::create(&path).expect("creating a trace");
    for record in records {
        sink.write(record).expect("writing a record");
    }
    sink.commit().expect("committing");
    if finish {
        sink.finish().expect("finishing");
    }
    path
}

fn stats(a: &Analysis, stack: u64) -> scan::StackStats {
    a.stacks[&Some(stack as i64)]
}

#[test]
fn one_pass_finds_peak_leaks_and_temporary_blocks() {
    let dir = TempDir::new("scenario");
    let trace = open(&write_trace(&dir, &scenario(), true)).unwrap();
    let a = Analysis::full(&trace).unwrap();
    assert_eq!(a.events, 13);
    let malloc = a.ops[Op::Malloc as usize];
    assert_eq!((malloc.calls, malloc.failed, malloc.bytes), (8, 1, 7302));
    assert_eq!(a.ops[Op::Realloc as usize].bytes, 128);
    assert_eq!(a.ops[Op::Free as usize].calls, 4);
    assert_eq!((a.blocks, a.bytes, a.releases), (8, 7430, 5));
    assert_eq!(
        a.peak,
        scan::Peak {
            bytes: 6334,
            blocks: 5,
            event: 10,
            ts_ns: 10_000
        }
    );
    assert_eq!((a.leaked_blocks, a.leaked_bytes), (3, 6196));
    assert_eq!(a.temporary, 4);

    let s11 = stats(&a, 11);
    assert_eq!((s11.calls, s11.bytes, s11.temporary), (3, 224, 3));
    assert_eq!(
        (s11.leaked_bytes, s11.peak_blocks, s11.peak_bytes),
        (0, 1, 128)
    );
    let s14 = stats(&a, 14);
    assert_eq!((s14.calls, s14.bytes, s14.temporary), (2, 3000, 1));
    assert_eq!((s14.leaked_bytes, s14.peak_bytes), (2000, 2000));
    assert_eq!(stats(&a, 16).peak_bytes, 4096);
    assert_eq!((stats(&a, 18).calls, stats(&a, 18).bytes), (2, 10));
    assert!(
        !a.stacks.contains_key(&None),
        "only allocations count at a stack"
    );
    // Thread codes in order of first call: 100 is 0, 101 is 1.
    assert_eq!(a.threads[&0].calls, 10);
    assert_eq!(a.threads[&1].calls, 3);
    assert_eq!(a.threads[&1].temporary, 2);
    assert_eq!(a.threads[&0].leaked_bytes, 6196);
    assert_eq!(a.sizes[scan::size_bucket(4096)], 1);
    assert_eq!(a.sizes.iter().sum::<u64>(), 8);
    // The timeline ends where the heap ends.
    assert_eq!(a.timeline.last().map(|s| s.last_bytes), Some(6196));
    assert_eq!(a.timeline.iter().map(|s| s.max_bytes).max(), Some(6334));
}

#[test]
fn the_views_agree_with_the_report() {
    for finish in [false, true] {
        let dir = TempDir::new("views");
        let path = write_trace(&dir, &scenario(), finish);
        let trace = open(&path).unwrap();
        let a = Analysis::full(&trace).unwrap();
        let int = |sql: &str| -> i64 { trace.conn.query_row(sql, [], |r| r.get(0)).unwrap() };
        assert_eq!(
            int("SELECT max(bytes) FROM heap_over_time"),
            a.peak.bytes as i64
        );
        assert_eq!(
            int(
                "SELECT min(id) FROM heap_over_time WHERE bytes = (SELECT max(bytes) FROM heap_over_time)"
            ),
            a.peak.event
        );
        assert_eq!(int("SELECT count(*) FROM temporary"), a.temporary as i64);
        assert_eq!(int("SELECT sum(size) FROM leaks"), a.leaked_bytes as i64);
    }
}

#[test]
fn allocations_are_charged_to_the_first_frame_outside_the_allocator() {
    let dir = TempDir::new("owners");
    let trace = open(&write_trace(&dir, &scenario(), true)).unwrap();
    let table = StackTable::load(&trace, &[]).unwrap();
    // strdup in libc and operator new in libstdc++ allocate for main.
    assert_eq!(table.owner(Some(12)), Owner::Module(1));
    assert_eq!(table.owner(Some(14)), Owner::Module(1));
    assert_eq!(table.owner(Some(11)), Owner::Module(1));
    // libc allocating for itself, all the way out.
    assert_eq!(table.owner(Some(16)), Owner::Module(2));
    assert_eq!(table.owner(None), Owner::NoStack);
    assert_eq!(table.owner_name(&Owner::Module(2)), "libc.so.6");

    let names = table.locations(Some(11));
    let functions: Vec<&str> = names.iter().map(|l| l.function.as_str()).collect();
    assert_eq!(functions, ["make_node", "push_back", "main"]);
    assert!(names[0].inlined && !names[1].inlined);
    assert_eq!(table.locations(Some(18))[0].function, "app+0x2345");

    // The call site: the first frame outside the allocator, its function
    // the caller; the innermost when all of a stack is the allocator's.
    let flags = |stack| -> Vec<(String, bool, bool)> {
        table
            .locations(Some(stack))
            .into_iter()
            .map(|l| (l.function, l.wrapper, l.caller))
            .collect()
    };
    let line = |f: &str, wrapper, caller| (f.to_string(), wrapper, caller);
    assert_eq!(
        flags(14),
        [
            line("operator new(unsigned long)", true, false),
            line("Widget::Widget()", false, true),
            line("main", false, false)
        ]
    );
    assert_eq!(
        flags(16),
        [
            line("_IO_file_doallocate", true, true),
            line("puts", true, false)
        ]
    );
    assert_eq!(table.caller(Some(12)).unwrap().function, "main");
    assert_eq!(table.caller(Some(11)).unwrap().function, "push_back");
    assert_eq!(table.caller(None), None);
}

/// Wrappers given to the report (and to the trace, in `meta`) make their
/// callers the call sites.
#[test]
fn wrappers_given_to_the_report_and_the_trace() {
    let dir = TempDir::new("user-wrappers");
    let trace = open(&write_trace(&dir, &scenario(), true)).unwrap();
    let table = StackTable::load(&trace, &["^Widget::".to_string()]).unwrap();
    assert_eq!(table.caller(Some(14)).unwrap().function, "main");
    // An inlined line by a wrapper's name is the allocator's, not its frame.
    let table = StackTable::load(&trace, &["^make_node$".to_string()]).unwrap();
    let s11 = table.locations(Some(11));
    assert!(s11[0].wrapper && !s11[1].wrapper && s11[1].caller);

    let mut records = scenario();
    records.push(Record::Meta {
        key: "wrapper.1".into(),
        value: "^push_back$".into(),
    });
    let dir = TempDir::new("trace-wrappers");
    let trace = open(&write_trace(&dir, &records, true)).unwrap();
    let table = StackTable::load(&trace, &[]).unwrap();
    assert_eq!(table.caller(Some(11)).unwrap().function, "main");
    assert!(matches!(
        StackTable::load(&trace, &["(".to_string()]),
        Err(ReportError::Wrapper { .. })
    ));
}

#[test]
fn summary_text_and_json() {
    let dir = TempDir::new("summary");
    let trace = open(&write_trace(&dir, &scenario(), true)).unwrap();
    let a = Analysis::full(&trace).unwrap();
    let table = StackTable::load(&trace, &[]).unwrap();
    let s = Summary::build(&trace, &a, &table, 2).unwrap();
    assert!(s.trace.finished);
    assert_eq!(s.trace.threads, 2);
    assert_eq!(s.top.leaked.len(), 2);
    assert_eq!(s.top.leaked[0].stack_ids, [16]);
    assert_eq!(s.top.leaked[0].module, "libc.so.6");
    assert_eq!(s.top.calls[0].stack_ids, [11]);
    assert_eq!(s.top.temporary[0].totals.temporary, 3);
    let modules: Vec<(&str, u64)> = s
        .modules
        .iter()
        .map(|m| (m.module.as_str(), m.totals.bytes))
        .collect();
    assert_eq!(modules, [("libc.so.6", 4096), ("app", 3334)]);
    let threads: Vec<(i64, Option<&str>)> = s
        .threads
        .iter()
        .map(|t| (t.tid, t.name.as_deref()))
        .collect();
    assert_eq!(threads, [(100, Some("app")), (101, Some("worker"))]);

    let callers: Vec<(&str, u64)> = s
        .callers
        .iter()
        .map(|c| (c.function.as_str(), c.totals.bytes))
        .collect();
    assert_eq!(
        callers,
        [
            ("_IO_file_doallocate", 4096),
            ("Widget::Widget()", 3000),
            ("push_back", 224),
            ("main", 100),
            ("app+0x2345", 10)
        ]
    );

    let out = text::render(&s, text::Style { color: false }, 3, 2);
    for line in [
        "  program    ./app --test",
        "  peak       6.2 KiB in 5 blocks, at 0.000 s",
        "  leaked     6.1 KiB in 3 blocks, never freed while traced",
        "  temporary  4 blocks (50.0 % of blocks), freed by their thread's next allocator call",
        "  malloc        8       1          7.1 KiB",
        "   1. 4.0 KiB in 1 block  [libc.so.6]",
        "       make_node (app.c:12) [inlined]",
        "       via operator new(unsigned long)",
        "       Widget::Widget() (app.c:30)",
        "  _IO_file_doallocate      1    4.0 KiB  4.0 KiB  4.0 KiB          0",
        "  ... and 3 more callers",
    ] {
        assert!(out.lines().any(|l| l == line), "{line:?} not in\n{out}");
    }
    assert!(!out.contains('\x1b'), "no colour asked");
    let json: serde_json::Value =
        serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
    assert_eq!(json["heap"]["peak_bytes"], 6334);
    assert_eq!(
        json["top"]["leaked"][0]["frames"][0]["function"],
        "_IO_file_doallocate"
    );
    assert_eq!(json["callers"][1]["function"], "Widget::Widget()");
    assert_eq!(json["callers"][1]["module"], "app");
    assert_eq!(json["top"]["leaked"][1]["frames"][0]["wrapper"], true);
    assert_eq!(json["top"]["leaked"][1]["frames"][1]["caller"], true);
}

#[test]
fn window_classes() {
    let dir = TempDir::new("window");
    let trace = open(&write_trace(&dir, &scenario(), true)).unwrap();
    let table = StackTable::load(&trace, &[]).unwrap();
    let w = window::analyse(&trace, &table, 4500, 10_500, 10).unwrap();
    let classes: Vec<(&str, u64, u64)> = w
        .classes
        .iter()
        .map(|c| (c.class, c.blocks, c.bytes))
        .collect();
    assert_eq!(
        classes,
        [
            (Class::InsideFreed.name(), 1, 32),
            (Class::InsideOutstanding.name(), 4, 4096 + 128 + 10 + 2000),
            (Class::BeforeFreed.name(), 1, 1000),
            (Class::BeforeOutstanding.name(), 1, 100),
        ]
    );
    assert_eq!((w.in_use_at_start, w.in_use_at_end), (1100, 6334));
    let outstanding = &w.classes[Class::InsideOutstanding as usize].stacks;
    assert_eq!(outstanding[0].stack_ids, [16]);
    assert_eq!(outstanding[0].frames[0].function, "_IO_file_doallocate");
    let text = window::render(&w, text::Style { color: false }, 4);
    assert!(text.contains("  change               +5.1 KiB"), "{text}");
}

#[test]
fn refuses_what_is_not_a_trace() {
    let dir = TempDir::new("refuse");
    let missing = dir.0.join("missing.db");
    assert!(matches!(open(&missing), Err(ReportError::NoTrace(_))));
    let text = dir.0.join("notes.txt");
    std::fs::write(&text, "hello").unwrap();
    assert!(matches!(open(&text), Err(ReportError::NotATrace { .. })));
    let other = dir.0.join("other.db");
    rusqlite::Connection::open(&other)
        .unwrap()
        .execute_batch("CREATE TABLE t(x)")
        .unwrap();
    let err = open(&other).err().expect("not a trace");
    assert!(err.to_string().contains("application_id"), "{err}");
    let path = write_trace(&dir, &scenario(), true);
    assert!(matches!(
        check_output(&path, &path),
        Err(ReportError::OutputIsTrace(_))
    ));
}

#[test]
fn stacks_that_read_the_same_are_one_row() {
    // Another call site in main, on the same line as frame 1, calling the
    // same inlined make_node: stack 20 reads exactly as stack 11.
    let mut records = scenario();
    records.extend([
        frame(9, APP + 0x1108, 1),
        node(19, None, 9, 0),
        node(20, Some(19), 2, 1),
        Record::Event(Event::test(
            14,
            14000,
            100,
            Op::Malloc,
            0x70,
            Some(16),
            Some(20),
        )),
        symbols(9, &[("main", 50)]),
    ]);
    let dir = TempDir::new("merge");
    let trace = open(&write_trace(&dir, &records, true)).unwrap();
    let a = Analysis::full(&trace).unwrap();
    let table = StackTable::load(&trace, &[]).unwrap();
    let s = Summary::build(&trace, &a, &table, 10).unwrap();
    assert_eq!(s.top.calls[0].stack_ids, [11, 20]);
    assert_eq!(
        (s.top.calls[0].totals.calls, s.top.calls[0].totals.bytes),
        (4, 240)
    );
    let leaked: Vec<(Vec<i64>, u64)> = s
        .top
        .leaked
        .iter()
        .map(|r| (r.stack_ids.clone(), r.totals.leaked_bytes))
        .collect();
    assert_eq!(
        leaked,
        [
            (vec![16], 4096),
            (vec![14], 2000),
            (vec![12], 100),
            (vec![11, 20], 16)
        ]
    );
}
