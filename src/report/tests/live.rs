//! What the blocks live at the end of a trace are called, by how it ended:
//! leaked (the program ended), live at detach (memptrace let it go), live
//! now (still recording); the blocks live since an attach apart.

use super::*;

/// The scenario's trace, ended by `end_reason` (finished) or still
/// recording, with two blocks live at attach of which one is freed.
fn ended(name: &str, end_reason: Option<&str>) -> (TempDir, Summary) {
    let dir = TempDir::new(name);
    let mut records = scenario();
    if let Some(reason) = end_reason {
        records.push(Record::Meta {
            key: "end_reason".into(),
            value: reason.into(),
        });
    }
    let inventory = |id: u64, ptr: u64, size: u64| {
        Event::test(id, id * 1000, 100, Op::Inventory, ptr, Some(size), None)
    };
    records.extend(
        [
            inventory(14, 0x500, 300),
            inventory(15, 0x600, 50),
            Event::test_free(16, 16_000, 100, 0x600, 15, None),
        ]
        .map(Record::Event),
    );
    let trace = open(&write_trace(&dir, &records, end_reason.is_some())).unwrap();
    let a = Analysis::full(&trace).unwrap();
    assert_eq!((a.leaked_blocks, a.leaked_bytes), (4, 6496));
    assert_eq!((a.inventory_live_blocks, a.inventory_live_bytes), (1, 300));
    let table = StackTable::load(&trace, &[]).unwrap();
    let s = Summary::build(&trace, &a, &table, 2).unwrap();
    (dir, s)
}

fn lines(s: &Summary) -> String {
    text::render(s, text::Style { color: false }, 3, 2)
}

fn has(out: &str, line: &str) {
    assert!(out.lines().any(|l| l == line), "{line:?} not in\n{out}");
}

#[test]
fn blocks_live_at_detach_are_not_leaks() {
    let (_dir, s) = ended("detach", Some("detached: SIGINT"));
    assert_eq!(s.heap.live_at_end, LiveAtEnd::AtDetach);
    let out = lines(&s);
    has(
        &out,
        "  live at detach 6.1 KiB in 3 blocks allocated while traced, the program runs on: not leaks",
    );
    has(
        &out,
        "             300 B in 1 block live since the attach (the inventory)",
    );
    has(&out, "Top 2 stacks by bytes live at detach");
    has(
        &out,
        "  function             calls  allocated  at peak  at detach  temporary",
    );
    assert!(!out.contains("leaked"), "{out}");
    // A block live at attach freed by its thread's next call was not
    // allocated by the call before it: not temporary.
    assert_eq!(s.heap.temporary, 4);
    let json = serde_json::to_value(&s).unwrap();
    assert_eq!(json["heap"]["live_at_end"], "at_detach");
    assert_eq!(json["heap"]["leaked_blocks"], 4);
    assert_eq!(json["heap"]["inventory_live_blocks"], 1);
    assert_eq!(json["heap"]["inventory_live_bytes"], 300);
    // memptrace's own failure lets the program go too.
    let (_dir, s) = ended("failed", Some("memptrace failed: panicked at x.rs:1:1: no"));
    assert_eq!(s.heap.live_at_end, LiveAtEnd::AtDetach);
}

#[test]
fn blocks_live_in_a_trace_still_recording_are_live_now() {
    let (_dir, s) = ended("recording", None);
    assert_eq!(s.heap.live_at_end, LiveAtEnd::Now);
    let out = lines(&s);
    has(
        &out,
        "  live now   6.1 KiB in 3 blocks allocated while traced, the trace has not ended: not leaks",
    );
    has(&out, "Top 2 stacks by bytes live now");
    assert_eq!(
        serde_json::to_value(&s).unwrap()["heap"]["live_at_end"],
        "now"
    );
}

#[test]
fn blocks_of_a_program_that_ended_are_leaked() {
    for reason in ["exited with status 0", "killed by SIGSEGV (core dumped)"] {
        let (_dir, s) = ended("exited", Some(reason));
        assert_eq!(s.heap.live_at_end, LiveAtEnd::Leaked);
        let out = lines(&s);
        has(
            &out,
            "  leaked     6.1 KiB in 3 blocks allocated while traced, never freed",
        );
        has(
            &out,
            "             300 B in 1 block live since the attach (the inventory)",
        );
        has(&out, "Top 2 stacks by leaked bytes");
    }
}
