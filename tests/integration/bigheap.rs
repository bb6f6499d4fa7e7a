//! A heap of 1 GiB (`bigheap.c`: tens of thousands of blocks of mixed
//! sizes in the main arena and a thread arena's several heaps, chunks
//! larger than the window the walk reads through, blocks mapped on their
//! own): the heap maps at exit, at attach and after the detach are exactly
//! the heap the program described (glibc's `mallinfo2()` and every block
//! it holds, with its usable size), and memptrace, which reads the heap a
//! window at a time, stays under a quarter of the heap's size (it once
//! copied each arena whole: more than the heap). The figures themselves
//! are in docs/performance.md.

use std::collections::BTreeSet;
use std::process::Command;

use crate::memory::stored_mallinfo;
use crate::support::{Background, Trace, Variant, memptrace, open_trace, run, scratch, tracee};

/// The heap the tracee builds, in MiB.
const MIB: &str = "1024";

/// What `bigheap` printed.
struct Truth {
    mallinfo: Vec<u64>,
    /// (address, usable size) of every block it holds, glibc's thread
    /// vector of the worker included.
    blocks: BTreeSet<(u64, u64)>,
}

fn truth(stdout: &str) -> Truth {
    let hex = |text: &str| u64::from_str_radix(text.trim_start_matches("0x"), 16).unwrap();
    let mut t = Truth {
        mallinfo: Vec::new(),
        blocks: BTreeSet::new(),
    };
    let mut held = None;
    for line in stdout.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["mallinfo", rest @ ..] => {
                t.mallinfo = rest.iter().map(|w| w.parse().unwrap()).collect()
            }
            ["block" | "libc", addr, usable] => {
                t.blocks.insert((hex(addr), usable.parse().unwrap()));
            }
            ["held", count, _] => held = Some(count.parse::<usize>().unwrap()),
            _ => {}
        }
    }
    assert_eq!(t.mallinfo.len(), 10, "no mallinfo line");
    // Its blocks, and the worker's thread vector.
    assert_eq!(Some(t.blocks.len()), held.map(|n| n + 1));
    assert!(t.blocks.len() > 20_000, "{} blocks", t.blocks.len());
    t
}

/// The heap's bytes: its arenas' and the blocks mapped on their own.
fn heap_bytes(truth: &Truth) -> u64 {
    truth.mallinfo[0] + truth.mallinfo[4]
}

/// The map stored at `moment` is the heap `truth` describes: mallinfo2,
/// every block held and nothing else, both arenas read.
fn check_map(t: &Trace, moment: &str, truth: &Truth) {
    assert_eq!(stored_mallinfo(t, moment), truth.mallinfo, "{moment}");
    let snapshot = t.int(&format!(
        "SELECT id FROM heap_snapshots WHERE moment = '{moment}' AND error IS NULL"
    ));
    let arenas = t.int(&format!(
        "SELECT count(*) FROM heap_arenas WHERE snapshot_id = {snapshot}
         AND error IS NULL AND NOT locked"
    ));
    assert_eq!(arenas, 2, "{moment}: the main arena and the worker's");
    assert_eq!(
        t.int(&format!(
            "SELECT chunks = chunks_stored FROM heap_snapshots WHERE id = {snapshot}"
        )),
        1
    );
    let mut stmt =
        t.db.prepare(
            "SELECT addr, size, state FROM heap_chunks WHERE snapshot_id = ?1
             AND state IN ('in use', 'mmapped')",
        )
        .unwrap();
    let blocks: BTreeSet<(u64, u64)> = stmt
        .query_map([snapshot], |r| {
            let (addr, size) = (r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64);
            let header = if r.get::<_, String>(2)? == "mmapped" {
                16
            } else {
                8
            };
            Ok((addr + 16, size - header))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(blocks.len(), truth.blocks.len(), "{moment}");
    assert!(blocks == truth.blocks, "{moment}: other blocks");
    // Chunks in the arenas larger than the walk's window (4 MiB), in use
    // and free: skipped over by their size.
    for state in ["in use", "free"] {
        let large = t.int(&format!(
            "SELECT count(*) FROM heap_chunks WHERE snapshot_id = {snapshot}
             AND state = '{state}' AND size > 4 << 20"
        ));
        assert!(large > 0, "{moment}: no {state} chunk larger than a window");
    }
}

/// memptrace's own peak RSS stayed under a quarter of the heap.
fn check_memory(t: &Trace, truth: &Truth) {
    let kib: u64 = t.meta("peak_rss_kib").unwrap().parse().unwrap();
    let heap = heap_bytes(truth);
    // (Blocks mapped on their own and freed are gone from it.)
    assert!(heap >= 768 << 20, "a heap of {heap} bytes");
    assert!(
        kib * 1024 < heap / 4,
        "memptrace's peak RSS {kib} KiB, the heap {heap} bytes"
    );
}

#[test]
fn a_big_heap_at_exit_is_exact_in_bounded_memory() {
    let db = scratch("bigheap-exit").join("trace.db");
    let out = run(
        memptrace()
            .arg("-o")
            .arg(&db)
            .arg("--")
            .arg(tracee(Variant::Dynamic, "bigheap"))
            .args([MIB, "exit"]),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    assert_eq!(out.stderr, "");
    let truth = truth(&out.stdout);
    let t = open_trace(&db, out);
    check_map(&t, "exit", &truth);
    check_memory(&t, &truth);
}

#[test]
fn a_big_heap_at_attach_and_detach_is_exact_in_bounded_memory() {
    let mut target = Background::interactive(
        Command::new(tracee(Variant::Dynamic, "bigheap"))
            .args([MIB, "wait"])
            .env_remove("LD_LIBRARY_PATH"),
    );
    let pid: i32 = target.wait_for("ready").parse().unwrap();
    let truth = truth(&target.stdout_so_far());
    let db = scratch("bigheap-attach").join("trace.db");
    let tracer = Background::start(
        memptrace()
            .args(["attach", &pid.to_string(), "--duration", "1", "-o"])
            .arg(&db),
    );
    let out = tracer.finish();
    assert_eq!(out.code(), 0, "{}", out.stderr);
    assert_eq!(crate::support::without_death_warning(&out.stderr), "");
    target.send("go\n");
    let end = target.finish();
    assert_eq!(end.code(), 0, "{}", end.stderr);
    let t = open_trace(&db, out);
    check_map(&t, "attach", &truth);
    check_map(&t, "detach", &truth);
    // Every block held entered the trace at attach, with its usable size.
    let mut stmt =
        t.db.prepare("SELECT ptr, size FROM events WHERE op = 'inventory'")
            .unwrap();
    let inventory: BTreeSet<(u64, u64)> = stmt
        .query_map([], |r| {
            Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(inventory.len(), truth.blocks.len());
    assert!(inventory == truth.blocks, "other blocks in the inventory");
    check_memory(&t, &truth);
}
