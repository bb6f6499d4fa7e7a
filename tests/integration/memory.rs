//! Memory beyond the calls: `memptrace heapmap` on a running process and on
//! a trace, checked against glibc's own `mallinfo2()` that the `heapmap`
//! tracee prints; the blocks live at attach entering the trace as
//! `inventory` events, each with its exact usable size, their frees paired;
//! and what musl and bad input get.

use std::process::Command;

use crate::support::{
    Background, Trace, Variant, memptrace, open_trace, run, scratch, tracee, wait_until,
};

/// The glibc builds.
const GLIBC: [Variant; 3] = [Variant::Dynamic, Variant::Static, Variant::StaticPie];

const MALLINFO: [&str; 10] = [
    "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
    "keepcost",
];

/// What the tracee printed about its heap.
struct Truth {
    mallinfo: Vec<u64>,
    /// (address, usable size) of every block it holds, glibc's thread
    /// vectors included.
    blocks: Vec<(u64, u64)>,
    /// The first block main allocated: blocks below it came before main.
    first: u64,
}

fn hex(text: &str) -> u64 {
    u64::from_str_radix(text.trim_start_matches("0x"), 16).unwrap()
}

fn truth(stdout: &str) -> Truth {
    let mut t = Truth {
        mallinfo: Vec::new(),
        blocks: Vec::new(),
        first: 0,
    };
    for line in stdout.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["mallinfo", rest @ ..] => {
                t.mallinfo = rest.iter().map(|w| w.parse().unwrap()).collect()
            }
            ["block" | "libc", addr, usable] => t.blocks.push((hex(addr), usable.parse().unwrap())),
            ["first", addr] => t.first = hex(addr),
            _ => {}
        }
    }
    assert_eq!(t.mallinfo.len(), 10, "no mallinfo line in {stdout:?}");
    assert!(t.blocks.len() > 30, "too few blocks in {stdout:?}");
    t.blocks.sort_unstable();
    t
}

/// mallinfo2 of the stored snapshot taken at `moment`.
pub(crate) fn stored_mallinfo(t: &Trace, moment: &str) -> Vec<u64> {
    t.db.query_row(
        &format!(
            "SELECT {} FROM heap_mallinfo m JOIN heap_snapshots s ON s.id = m.snapshot_id
             WHERE s.moment = ?1",
            MALLINFO.join(", ")
        ),
        [moment],
        |r| {
            (0..10)
                .map(|i| r.get::<_, i64>(i).map(|v| v as u64))
                .collect()
        },
    )
    .unwrap()
}

/// mallinfo2 of `heapmap --format json`.
fn json_mallinfo(json: &serde_json::Value) -> Vec<u64> {
    MALLINFO
        .iter()
        .map(|k| json["mallinfo"][k].as_u64().unwrap())
        .collect()
}

/// The usable sizes of the blocks glibc allocates before `main` and still
/// holds when `main` makes its first allocation (the block it prints as
/// `first`), from a launched trace of the same program, sorted.
fn held_from_before_main(variant: Variant) -> Vec<u64> {
    let t = crate::support::trace(variant, "heapmap", &[], &[]);
    let first = truth(&t.run.stdout).first;
    let mut stmt =
        t.db.prepare(
            "SELECT a.size FROM allocations a,
               (SELECT min(id) AS id FROM events WHERE op = 'malloc' AND ptr = ?1) f
             WHERE a.alloc_id < f.id AND (a.free_id IS NULL OR a.free_id > f.id)",
        )
        .unwrap();
    let requested: Vec<i64> = stmt
        .query_map([first as i64], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    // glibc's usable size of a block from the heap: its chunk (the request
    // and an 8-byte header, rounded up to 16, at least 32) less the header.
    let mut usable: Vec<u64> = requested
        .iter()
        .map(|&n| ((n as u64 + 8 + 15) & !15).max(32) - 8)
        .collect();
    usable.sort_unstable();
    usable
}

/// The tracee, waiting; in the environment `trace` gives a launched one
/// (what glibc allocates before main depends on LD_LIBRARY_PATH, which
/// cargo sets for tests).
fn start(variant: Variant) -> Background {
    Background::interactive(
        Command::new(tracee(variant, "heapmap"))
            .arg("wait")
            .env_remove("LD_LIBRARY_PATH"),
    )
}

/// A heap read while the process runs, with nothing stopped: every field
/// of mallinfo2 as glibc computed it, and the blocks the tracee holds.
#[test]
fn heapmap_of_a_running_process_equals_mallinfo2() {
    for variant in GLIBC {
        let mut target = start(variant);
        let pid: i32 = target.wait_for("ready").parse().unwrap();
        let truth = truth(&target.stdout_so_far());
        let out = run(
            memptrace().args(["heapmap", &pid.to_string(), "--format", "json"]),
            b"",
        );
        assert_eq!(out.code(), 0, "{variant:?}: {}", out.stderr);
        assert_eq!(out.stderr, "");
        let json: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        let mallinfo = json_mallinfo(&json);
        assert_eq!(mallinfo, truth.mallinfo, "{variant:?}: {}", out.stdout);
        let arenas = json["arenas"].as_array().unwrap();
        assert_eq!(arenas.len(), 3, "{variant:?}: main and two thread arenas");
        assert!(
            arenas
                .iter()
                .all(|a| a["error"].is_null() && a["locked"] == false)
        );
        assert_eq!(arenas[0]["kind"], "main");
        assert_eq!(json["narenas"], 3, "{variant:?}: glibc's own count");
        assert_eq!(json["mmapped_blocks"], 2, "{variant:?}");
        assert!(json["mmapped_error"].is_null());
        // Each worker kept 10 blocks in its arena.
        assert!(arenas[1..].iter().all(|a| a["blocks"] == 10), "{variant:?}");
        // Every block the tracee holds; a static glibc has a few of its own
        // from before main.
        let bytes: u64 = truth.blocks.iter().map(|b| b.1).sum();
        let (live, live_bytes) = (
            json["live_blocks"].as_u64().unwrap(),
            json["live_bytes"].as_u64().unwrap(),
        );
        if variant == Variant::Dynamic {
            assert_eq!((live, live_bytes), (truth.blocks.len() as u64, bytes));
        } else {
            assert!(live > truth.blocks.len() as u64 && live_bytes > bytes);
        }
        // The text form says the same.
        let text = run(memptrace().args(["heapmap", &pid.to_string()]), b"");
        assert_eq!(text.code(), 0);
        let line = format!(
            "mallinfo2: {}",
            MALLINFO
                .iter()
                .zip(&truth.mallinfo)
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        assert!(text.stdout.contains(&line), "{}", text.stdout);
        assert!(text.stdout.contains("mmapped: 2 blocks"), "{}", text.stdout);
        target.send("go\n");
        assert_eq!(target.finish().code(), 0);
    }
}

/// The map memptrace stores when a traced program exits is the heap
/// glibc's mallinfo2 described just before.
#[test]
fn heap_at_exit_equals_mallinfo2() {
    for variant in GLIBC {
        let db = scratch("heap-exit").join("trace.db");
        let out = run(
            memptrace()
                .arg("-o")
                .arg(&db)
                .arg("--")
                .arg(tracee(variant, "heapmap"))
                .arg("exit"),
            b"",
        );
        assert_eq!(out.code(), 0, "{variant:?}: {}", out.stderr);
        let truth = truth(&out.stdout);
        let t = open_trace(&db, out);
        t.assert_sound();
        assert_eq!(stored_mallinfo(&t, "exit"), truth.mallinfo, "{variant:?}");
        assert_eq!(
            t.int("SELECT count(*) FROM heap_arenas WHERE error IS NULL AND NOT locked"),
            3
        );
        // One row per chunk: the arenas' chunks tile their heaps.
        assert_eq!(
            t.int("SELECT count(*) FROM heap_chunks WHERE state = 'mmapped'"),
            2
        );
        assert_eq!(
            t.int("SELECT count(*) FROM heap_chunks WHERE state = 'top'"),
            3
        );
        assert!(t.int("SELECT count(*) FROM heap_chunks WHERE state = 'tcache'") > 0);
        assert!(t.int("SELECT count(*) FROM heap_chunks WHERE state = 'fastbin'") > 0);
        // heapmap reads the stored snapshot back.
        let report = run(
            memptrace()
                .arg("heapmap")
                .arg(&db)
                .args(["--format", "json"]),
            b"",
        );
        assert_eq!(report.code(), 0, "{}", report.stderr);
        let json: serde_json::Value = serde_json::from_str(&report.stdout).unwrap();
        assert_eq!(json["moment"], "exit");
        let mallinfo = json_mallinfo(&json);
        assert_eq!(mallinfo, truth.mallinfo);
        // And draws its pages.
        let png = scratch("heap-exit").join("map.png");
        let drawn = run(memptrace().arg("heapmap").arg(&db).arg("-o").arg(&png), b"");
        assert_eq!(drawn.code(), 0, "{}", drawn.stderr);
        let decoder =
            png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
        let info = decoder.read_info().unwrap();
        assert_eq!(info.info().width, 1362);
        // The same as SVG: each region is named by its arena, and every
        // colour drawn is in the legend.
        let svg = scratch("heap-exit").join("map.svg");
        let drawn = run(memptrace().arg("heapmap").arg(&db).arg("-o").arg(&svg), b"");
        assert_eq!(drawn.code(), 0, "{}", drawn.stderr);
        let mut threads: Vec<u64> = json["arenas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["kind"] == "thread")
            .map(|a| a["arena"].as_u64().unwrap())
            .collect();
        threads.sort();
        let mut names = vec!["main arena".to_string()];
        names.extend(threads.iter().map(|a| format!("arena {a:#x}")));
        names.push("mmapped blocks".to_string());
        let texts = crate::support::svg_texts(&svg);
        let mut labels: Vec<String> = texts
            .into_iter()
            .filter(|t| {
                t.starts_with("main arena") || t.starts_with("arena ") || t == "mmapped blocks"
            })
            .collect();
        // A region is named at its first row: mmapped blocks far apart are
        // two regions of the same name.
        labels.sort();
        labels.dedup();
        names.sort();
        assert_eq!(labels, names, "{variant:?}");
        let rects = crate::support::svg_rects(&svg);
        let legend: Vec<&str> = rects
            .iter()
            .filter(|r| r.0 == "14")
            .map(|r| r.2.as_str())
            .collect();
        assert_eq!(legend.len(), 8, "two rows of four states: {rects:?}");
        let squares: Vec<&str> = rects
            .iter()
            .filter(|r| r.0 == "8")
            .map(|r| r.2.as_str())
            .collect();
        assert!(!squares.is_empty());
        for fill in squares {
            assert!(
                legend.contains(&fill),
                "{variant:?}: {fill} is not in the legend"
            );
        }
    }
}

/// Attached to a process holding blocks: each one enters the trace as an
/// `inventory` event with its exact usable size, and its free, traced,
/// pairs with it; the heap at attach is glibc's.
#[test]
fn inventory_at_attach_is_every_live_block() {
    for variant in GLIBC {
        let mut target = start(variant);
        let pid: i32 = target.wait_for("ready").parse().unwrap();
        let truth = truth(&target.stdout_so_far());
        let db = scratch("inventory").join("trace.db");
        let tracer = Background::start(
            memptrace()
                .args(["attach", &pid.to_string(), "-o"])
                .arg(&db),
        );
        // Hooked: the inventory was taken before the process went on.
        wait_until("memptrace hooked the process", || {
            !crate::attach::trampoline_pages(pid).is_empty()
        });
        target.send("go\n");
        let end = target.finish();
        assert_eq!(end.code(), 0, "{variant:?}: {}", end.stderr);
        let freed = end
            .stdout
            .lines()
            .find(|l| l.starts_with("freed"))
            .unwrap()
            .to_string();
        let out = tracer.finish();
        assert_eq!(out.code(), 0, "{variant:?}: {}", out.stderr);
        assert_eq!(
            crate::support::without_death_warning(&out.stderr),
            "",
            "{variant:?}"
        );
        let t = open_trace(&db, out);
        let mut stmt = t
            .db
            .prepare("SELECT ptr, size, stack_id FROM events WHERE op = 'inventory' ORDER BY ptr")
            .unwrap();
        let inventory: Vec<(u64, u64)> = stmt
            .query_map([], |r| {
                assert_eq!(
                    r.get::<_, Option<i64>>(2)?,
                    None,
                    "an inventory event has no stack"
                );
                Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64))
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        // Exactly the tracee's blocks, and those glibc allocated before main
        // and still holds: as many, and of the same sizes, as a launched
        // trace of the same program shows.
        let before_main: Vec<(u64, u64)> = inventory
            .iter()
            .copied()
            .filter(|b| !truth.blocks.contains(b))
            .collect();
        let mut sizes: Vec<u64> = before_main.iter().map(|b| b.1).collect();
        sizes.sort_unstable();
        assert_eq!(
            sizes,
            held_from_before_main(variant),
            "{variant:?}: blocks that are not the tracee's: {before_main:x?}"
        );
        for block in &truth.blocks {
            assert!(
                inventory.contains(block),
                "{variant:?}: {block:x?} not in the inventory"
            );
        }
        assert_eq!(inventory.len(), truth.blocks.len() + before_main.len());
        // Count and bytes of the blocks the tracee freed: all paired.
        let words: Vec<&str> = freed.split_whitespace().collect();
        let (n, bytes): (i64, i64) = (words[1].parse().unwrap(), words[2].parse().unwrap());
        assert_eq!(
            t.int(
                "SELECT count(*) FROM allocations a
                 WHERE a.op = 'inventory' AND a.free_op = 'free'"
            ),
            n,
            "{variant:?}"
        );
        assert_eq!(
            t.int("SELECT sum(size) FROM allocations WHERE op = 'inventory' AND free_op = 'free'"),
            bytes,
            "{variant:?}"
        );
        assert_eq!(
            t.int(
                "SELECT count(*) FROM events WHERE op = 'free' AND ptr <> 0 AND alloc_id IS NULL"
            ),
            0,
            "{variant:?}: a free of a block the inventory missed"
        );
        // The heap at attach is the one the tracee described.
        assert_eq!(stored_mallinfo(&t, "attach"), truth.mallinfo, "{variant:?}");
        // Leaks in attach mode count the blocks from before it: the ones
        // glibc itself never frees.
        assert_eq!(
            t.int("SELECT count(*) FROM leaks WHERE op = 'inventory'"),
            before_main.len() as i64 + 2,
            "{variant:?}: the thread vectors and glibc's own blocks"
        );
        // The report tells the inventory apart from the calls it saw.
        let report = run(memptrace().arg("report").arg(&db), b"");
        assert_eq!(report.code(), 0, "{}", report.stderr);
        let calls = t.int("SELECT count(*) FROM events WHERE op <> 'inventory'");
        assert!(
            report
                .stdout
                .contains(&format!("events     {calls} allocator calls from "))
                && report.stdout.contains(&format!(
                    "\n             and {} blocks live at attach",
                    inventory.len()
                )),
            "{variant:?}: {}",
            report.stdout
        );
    }
}

/// musl: a heap map is refused in one line; a trace records why there is
/// none, and says nothing.
#[test]
fn musl_heap_is_not_supported() {
    let mut target = start(Variant::Musl);
    let pid: i32 = target.wait_for("ready").parse().unwrap();
    let out = run(memptrace().args(["heapmap", &pid.to_string()]), b"");
    assert_eq!(out.code(), 1);
    assert_eq!(out.stdout, "");
    assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
    assert!(out.stderr.contains("musl"), "{}", out.stderr);
    target.send("go\n");
    assert_eq!(target.finish().code(), 0);

    let db = scratch("heap-musl").join("trace.db");
    let out = run(
        memptrace()
            .arg("-o")
            .arg(&db)
            .arg("--")
            .arg(tracee(Variant::Musl, "heapmap"))
            .arg("exit"),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let t = open_trace(&db, out);
    t.assert_sound();
    assert_eq!(
        t.int("SELECT count(*) FROM heap_snapshots WHERE moment = 'exit' AND error LIKE '%musl%'"),
        1
    );
}

/// A pid that is no process, a file that is no trace, a trace without
/// snapshots: one line on stderr, a failure status.
#[test]
fn heapmap_of_bad_input() {
    let dir = scratch("heap-bad");
    let junk = dir.join("junk.db");
    std::fs::write(&junk, "not a database").unwrap();
    let gone = {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    };
    for args in [
        vec!["heapmap".to_string(), gone.to_string()],
        vec!["heapmap".to_string(), junk.display().to_string()],
        vec![
            "heapmap".to_string(),
            dir.join("none.db").display().to_string(),
        ],
    ] {
        let out = run(memptrace().args(&args), b"");
        assert_ne!(out.code(), 0, "{args:?}");
        assert_eq!(out.stdout, "", "{args:?}");
        assert_eq!(out.stderr.lines().count(), 1, "{args:?}: {}", out.stderr);
    }
}
