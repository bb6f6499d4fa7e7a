//! The merge on fake rings: byte buffers written as the probes write
//! them (header word, sequence number, counter, arguments, frames), read
//! with the same decoder as the control area's rings.

use std::time::{Duration, Instant};

use super::*;
use crate::event::{MapOp, Op};
use crate::os::ptrace::Tid;
use crate::tracer::probes::jump::control::Record;
use crate::tracer::probes::jump::decode::{Checks, Header, read_ring};
use crate::tracer::probes::jump::layout::{RING_SIZE, RING_STRIDE, record};

/// Probe 0 records malloc, probe 1 free, probe 2 mmap.
fn what(probe: u16) -> Option<Called> {
    match probe {
        0 => Some(Called::Alloc(Op::Malloc)),
        1 => Some(Called::Alloc(Op::Free)),
        2 => Some(Called::Map(MapOp::Mmap)),
        _ => None,
    }
}

fn probe(id: u16, called: Called) -> bool {
    what(id) == Some(called)
}

/// One thread's ring: its bytes, head and tail, as in a slot.
struct FakeRing {
    tid: Tid,
    bytes: Vec<u8>,
    head: u64,
    tail: u64,
}

impl FakeRing {
    fn new(tid: Tid) -> FakeRing {
        FakeRing {
            tid,
            bytes: vec![0; RING_STRIDE as usize],
            head: 0,
            tail: 0,
        }
    }

    /// Commit a record as a probe does: at the head (never split: one
    /// near the end runs into the room past it), then the head moves.
    fn commit(&mut self, probe: u16, seq: u64, tsc: u64, arg: u64, frames: &[u64]) {
        let what = what(probe).unwrap();
        let size = what.frames_at() + 8 * frames.len() as u64;
        let header = Header {
            size,
            frames: frames.len() as u64,
            flags: 0,
            what,
            probe,
        };
        let at = (self.head % RING_SIZE) as usize;
        let mut put = |field: u64, value: u64| {
            let i = at + field as usize;
            self.bytes[i..i + 8].copy_from_slice(&value.to_le_bytes());
        };
        put(record::HEAD, header.pack());
        put(record::SEQ, seq);
        put(record::TSC, tsc);
        put(record::ARG0, arg);
        put(record::RET, arg + 1);
        for (i, f) in frames.iter().enumerate() {
            put(what.frames_at() + 8 * i as u64, *f);
        }
        self.head += size;
    }
}

/// The rings of a space, with its sequence counter.
struct FakeRings {
    rings: Vec<FakeRing>,
    seq_limit: u64,
    damaged: Damaged,
}

impl FakeRings {
    fn new(tids: &[Tid]) -> FakeRings {
        FakeRings {
            rings: tids.iter().map(|&t| FakeRing::new(t)).collect(),
            seq_limit: 0,
            damaged: Damaged::default(),
        }
    }

    /// Thread `ring` commits a malloc numbered `seq` (the counter moves
    /// past it).
    fn malloc(&mut self, ring: usize, seq: u64, tsc: u64) {
        self.rings[ring].commit(0, seq, tsc, 100 + seq, &[0x5555_0000 + seq]);
        self.seq_limit = self.seq_limit.max(seq + 1);
    }
}

impl Rings for FakeRings {
    fn read_rings(&mut self, probe: &dyn Fn(u16, Called) -> bool, out: &mut Pulled) -> usize {
        let checks = Checks {
            probe,
            seq_limit: self.seq_limit,
        };
        let mut n = 0;
        for ring in &mut self.rings {
            let read = read_ring(
                &ring.bytes[..],
                ring.head,
                ring.tail,
                ring.tid,
                &checks,
                out,
            );
            if let Some(damage) = read.damage {
                self.damaged.records += 1;
                self.damaged
                    .note(|| format!("thread {}'s ring: {damage}", ring.tid));
            }
            ring.tail = read.tail;
            n += read.records;
        }
        n
    }

    fn damaged(&mut self) -> &mut Damaged {
        &mut self.damaged
    }
}

fn seqs(merged: &Merged) -> Vec<u64> {
    merged.ready.records.iter().map(|r| r.seq).collect()
}

fn read(merge: &mut Merge, rings: &mut FakeRings, settle: bool, now: Instant) -> Merged {
    merge.read(rings, &probe, settle, now)
}

#[test]
fn records_of_every_ring_come_out_in_the_order_they_took_effect() {
    let mut rings = FakeRings::new(&[10, 11, 12]);
    for (ring, seq) in [(0, 0), (1, 1), (0, 2), (2, 3), (1, 4), (2, 5)] {
        rings.malloc(ring, seq, 1000 + seq);
    }
    let mut merge = Merge::default();
    let merged = read(&mut merge, &mut rings, false, Instant::now());
    assert_eq!(merged.read, 6);
    assert_eq!(seqs(&merged), vec![0, 1, 2, 3, 4, 5]);
    let tids: Vec<Tid> = merged.ready.records.iter().map(|r| r.tid).collect();
    assert_eq!(tids, vec![10, 11, 10, 12, 11, 12]);
    // Each record keeps its own arguments and frames.
    for r in &merged.ready.records {
        assert_eq!(r.args[0], 100 + r.seq);
        assert_eq!(r.ret, 101 + r.seq);
        assert_eq!(merged.ready.frames(r), &[0x5555_0000 + r.seq]);
    }
    assert_eq!(merge.next(), 6);
    assert_eq!(merged.damaged, Damaged::default());
    assert!(rings.rings.iter().all(|r| r.tail == r.head));
}

#[test]
fn records_after_a_missing_number_wait_for_it() {
    let mut rings = FakeRings::new(&[10, 11]);
    rings.malloc(0, 0, 1);
    rings.malloc(0, 2, 3);
    rings.malloc(0, 3, 4);
    let mut merge = Merge::default();
    let now = Instant::now();
    let first = read(&mut merge, &mut rings, false, now);
    assert_eq!(seqs(&first), vec![0]);
    assert_eq!(merge.held(), 2);
    merge.give_back(first.ready);
    // The late record arrives from the other thread: all three follow.
    rings.malloc(1, 1, 2);
    let second = read(&mut merge, &mut rings, false, now);
    assert_eq!(seqs(&second), vec![1, 2, 3]);
    assert_eq!(second.read, 1);
    assert_eq!(second.skipped, 0);
    assert_eq!(merge.held(), 0);
}

#[test]
fn a_hole_is_skipped_once_it_has_waited_long_enough() {
    let mut rings = FakeRings::new(&[10]);
    rings.malloc(0, 0, 1);
    rings.malloc(0, 2, 3);
    let mut merge = Merge::default();
    let t0 = Instant::now();
    let m = read(&mut merge, &mut rings, false, t0);
    assert_eq!(seqs(&m), vec![0]);
    merge.give_back(m.ready);
    let m = read(&mut merge, &mut rings, false, t0 + GAP_PATIENCE / 2);
    assert!(m.ready.records.is_empty());
    merge.give_back(m.ready);
    let m = read(&mut merge, &mut rings, false, t0 + GAP_PATIENCE);
    assert_eq!(seqs(&m), vec![2]);
    assert_eq!(m.skipped, 1);
    assert_eq!(merge.next(), 3);
}

#[test]
fn settling_skips_every_hole_at_once() {
    let mut rings = FakeRings::new(&[10]);
    for seq in [1, 4, 5, 9] {
        rings.malloc(0, seq, seq);
    }
    let mut merge = Merge::default();
    let m = read(&mut merge, &mut rings, true, Instant::now());
    assert_eq!(seqs(&m), vec![1, 4, 5, 9]);
    // 0, 2-3 and 6-8 were never seen.
    assert_eq!(m.skipped, 1 + 2 + 3);
    assert_eq!(merge.next(), 10);
}

#[test]
fn a_damaged_header_is_counted_and_the_ring_resynchronised() {
    let mut rings = FakeRings::new(&[10, 11]);
    rings.malloc(0, 0, 1);
    rings.malloc(0, 1, 2);
    let bad = rings.rings[0].head as usize;
    rings.malloc(0, 2, 3);
    rings.malloc(1, 3, 4);
    // The program writes over the third record's header: an op no probe
    // records.
    rings.rings[0].bytes[bad + 5] = 0xee;
    let mut merge = Merge::default();
    let m = read(&mut merge, &mut rings, true, Instant::now());
    // The records before it and the other ring's are kept; the rest of
    // the damaged ring is lost, and counted.
    assert_eq!(seqs(&m), vec![0, 1, 3]);
    assert_eq!(m.skipped, 1);
    assert_eq!(m.damaged.records, 1);
    assert!(
        m.damaged
            .first
            .as_deref()
            .unwrap()
            .starts_with("thread 10's ring: op code 238"),
        "{:?}",
        m.damaged.first
    );
    assert_eq!(rings.rings[0].tail, rings.rings[0].head);
    // Taken: the next reading reports no damage again.
    merge.give_back(m.ready);
    let m = read(&mut merge, &mut rings, true, Instant::now());
    assert_eq!(m.damaged, Damaged::default());
}

#[test]
fn a_record_that_claims_more_than_was_committed_is_refused() {
    let mut rings = FakeRings::new(&[10]);
    rings.malloc(0, 0, 1);
    // The head stops inside the record: it runs past it.
    rings.rings[0].head -= 8;
    let mut merge = Merge::default();
    let m = read(&mut merge, &mut rings, true, Instant::now());
    assert!(m.ready.records.is_empty());
    assert_eq!(m.damaged.records, 1);
    assert!(m.damaged.first.unwrap().contains("past the"));
}

#[test]
fn records_read_across_the_end_of_the_ring() {
    let mut rings = FakeRings::new(&[10]);
    // The ring has gone round almost once: the next record starts 24
    // bytes before its end and runs into the room past it.
    let start = RING_SIZE - 24;
    rings.rings[0].head = start;
    rings.rings[0].tail = start;
    for seq in 0..3 {
        rings.malloc(0, seq, seq + 1);
    }
    assert!(rings.rings[0].head > RING_SIZE);
    let mut merge = Merge::default();
    let m = read(&mut merge, &mut rings, false, Instant::now());
    assert_eq!(seqs(&m), vec![0, 1, 2]);
    assert_eq!(
        m.ready.frames(&m.ready.records[2]),
        &[0x5555_0002],
        "the third record, written at the ring's start"
    );
    assert_eq!(rings.rings[0].tail, rings.rings[0].head);
}

#[test]
fn numbers_far_ahead_or_twice_are_damage() {
    let mut rings = FakeRings::new(&[10, 11]);
    rings.malloc(0, 0, 1);
    rings.malloc(1, 0, 1);
    let far = decode::MAX_SEQ_AHEAD + 5;
    rings.malloc(1, far, 2);
    let mut merge = Merge::default();
    let m = read(&mut merge, &mut rings, true, Instant::now());
    assert_eq!(seqs(&m), vec![0]);
    assert_eq!(m.damaged.records, 2);
    assert_eq!(merge.next(), 1);
}

#[test]
fn a_mapping_call_is_merged_with_the_allocator_calls() {
    let mut rings = FakeRings::new(&[10]);
    rings.malloc(0, 0, 1);
    rings.rings[0].commit(2, 1, 2, 4096, &[0x5555_9999]);
    rings.seq_limit = 2;
    rings.malloc(0, 2, 3);
    let mut merge = Merge::default();
    let m = read(&mut merge, &mut rings, false, Instant::now());
    let whats: Vec<Called> = m.ready.records.iter().map(|r: &Record| r.what).collect();
    assert_eq!(
        whats,
        vec![
            Called::Alloc(Op::Malloc),
            Called::Map(MapOp::Mmap),
            Called::Alloc(Op::Malloc)
        ]
    );
    assert_eq!(m.ready.frames(&m.ready.records[1]), &[0x5555_9999]);
}

#[test]
fn the_buffer_given_back_serves_the_next_reading() {
    let mut rings = FakeRings::new(&[10]);
    for seq in 0..100 {
        rings.malloc(0, seq, seq);
    }
    let mut merge = Merge::default();
    let m = read(&mut merge, &mut rings, false, Instant::now());
    let room = m.ready.records.capacity();
    merge.give_back(m.ready);
    rings.malloc(0, 100, 100);
    let m = read(&mut merge, &mut rings, false, Instant::now());
    assert_eq!(seqs(&m), vec![100]);
    assert_eq!(m.ready.records.capacity(), room);
}

/// A clock at 2 ticks per nanosecond from tick 1000 at 0 ns.
fn clock() -> TscClock {
    TscClock {
        tsc0: 1000,
        ns0: 0,
        ticks_per_ns: 2.0,
        last_ns: 0,
    }
}

#[test]
fn the_clock_puts_ticks_on_the_trace_and_never_goes_back() {
    let mut c = clock();
    assert_eq!(c.ns_within(1000 + 2 * 500, 10_000), Some(500));
    // A tie: the same time again.
    assert_eq!(c.ns_within(1000 + 2 * 500, 10_000), Some(500));
    // A late record stamped before the last one: not before it.
    assert_eq!(c.ns_within(1000 + 2 * 100, 10_000), Some(500));
    // Stamped past the reading: the reading's time.
    assert_eq!(c.ns_within(1000 + 2 * 20_000, 10_000), Some(10_000));
    assert_eq!(c.ticks_in(Duration::from_nanos(7)), 14);
}

#[test]
fn a_time_far_outside_the_trace_is_the_programs_not_a_probes() {
    let mut c = clock();
    let slack_ticks = 2 * CLOCK_SLACK.as_nanos() as u64;
    assert_eq!(
        c.ns_within(1000 + 2 * 10_000 + slack_ticks + 2, 10_000),
        None
    );
    assert_eq!(c.ns_within(0, 10_000), Some(0), "within the slack before");
    assert_eq!(c.ns_within(u64::MAX, 10_000), None);
    // Refined over a longer span: the new rate is used.
    c.refine(1_000, 1000 + 4 * 1_000);
    assert_eq!(c.ns_within(1000 + 4 * 600, 10_000), Some(600));
}
