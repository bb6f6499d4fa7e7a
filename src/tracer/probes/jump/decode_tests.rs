//! Rings as byte buffers: well-formed records read back exactly, and every
//! kind of damage a program can do is refused, counted, and bounded.

use proptest::prelude::*;

use super::*;
use crate::event::{MapOp, Op};

const TID: Tid = 77;

/// Probes 0..7: probe `i` < 4 records op `Op::ALL[i]`, probe 4 + `i` the
/// mapping call `MapOp::ALL[i]`.
fn probe(id: u16, what: Called) -> bool {
    called(id) == Some(what)
}

fn called(id: u16) -> Option<Called> {
    match id {
        0..4 => Some(Called::Alloc(Op::ALL[usize::from(id)])),
        4..7 => Some(Called::Map(MapOp::ALL[usize::from(id - 4)])),
        _ => None,
    }
}

/// A record of probe `probe` with `args` (three used by an allocator
/// call's) and `stored` (an allocator call's only).
fn record_of(
    seq: u64,
    tsc: u64,
    probe: u16,
    flags: u8,
    args: [u64; 6],
    ret: u64,
    stored: u64,
) -> Record {
    let what = called(probe).expect("a probe of the tests");
    let (args, stored) = match what {
        Called::Alloc(_) => ([args[0], args[1], args[2], 0, 0, 0], stored),
        Called::Map(_) => (args, 0),
    };
    Record {
        seq,
        tsc,
        tid: TID,
        what,
        probe,
        flags,
        args,
        ret,
        stored,
        frames: 0..0,
    }
}

fn checks() -> Checks<'static> {
    Checks {
        probe: &probe,
        seq_limit: 1 << 20,
    }
}

fn ring() -> Vec<u8> {
    vec![0u8; layout::RING_STRIDE as usize]
}

fn record(seq: u64, probe: u16, frames: usize) -> (Record, Vec<u64>) {
    let args: [u64; 6] = std::array::from_fn(|i| seq.wrapping_mul(i as u64 + 1));
    let r = record_of(
        seq,
        seq.wrapping_add(1000),
        probe,
        (seq % 3) as u8 & (record::TRUNCATED | record::FULL),
        args,
        seq.wrapping_add(0x5000),
        seq ^ 0xff,
    );
    let frames = (0..frames as u64)
        .map(|f| seq.wrapping_add(0x40_0000 + 16 * f))
        .collect();
    (r, frames)
}

/// Write records from byte `start` on (as the probes would, wrapping at
/// the ring's size); returns the head.
fn write_ring(ring: &mut [u8], start: u64, records: &[(Record, Vec<u64>)]) -> u64 {
    let mut head = start;
    for (r, frames) in records {
        let bytes = encode_record(r, frames);
        let at = (head % layout::RING_SIZE) as usize;
        ring[at..at + bytes.len()].copy_from_slice(&bytes);
        head += bytes.len() as u64;
    }
    head
}

fn read(ring: &[u8], head: u64, tail: u64) -> (RingRead, Pulled) {
    let mut out = Pulled::default();
    let read = read_ring(ring, head, tail, TID, &checks(), &mut out);
    (read, out)
}

fn set_word(ring: &mut [u8], at: u64, value: u64) {
    let at = at as usize;
    ring[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

#[test]
fn well_formed_records_read_back_exactly_across_the_wrap() {
    let mut buf = ring();
    let records: Vec<_> = (0..40)
        .map(|s| record(s, (s % 7) as u16, (s % 5) as usize))
        .collect();
    let start = 2 * layout::RING_SIZE - 300;
    let head = write_ring(&mut buf, start, &records);
    let (read, out) = read(&buf, head, start);
    assert_eq!(
        read,
        RingRead {
            records: 40,
            tail: head,
            damage: None
        }
    );
    for (got, (want, frames)) in out.records.iter().zip(&records) {
        assert_eq!(out.frames(got), frames.as_slice());
        assert_eq!(
            Record {
                frames: 0..0,
                ..got.clone()
            },
            *want
        );
    }
}

#[test]
fn a_bad_header_ends_the_reading_and_the_ring_is_resynchronised() {
    let records: Vec<_> = (0..3).map(|s| record(s, 0, 2)).collect();
    let size = layout::RECORD_HEADER + 16;
    for (what, word, damage) in [
        (
            "size 65",
            65 | 2 << 16,
            Damage::Size {
                size: 65,
                frames: 2,
            },
        ),
        (
            "size and frames 0xffff",
            0xffff | 0xffff << 16,
            Damage::Size {
                size: 0xffff,
                frames: 0xffff,
            },
        ),
        ("no frames, size 0", 0, Damage::Size { size: 0, frames: 0 }),
        ("inventory", size | 2 << 16 | 10 << 40, Damage::Op(10)),
        ("op 200", size | 2 << 16 | 200 << 40, Damage::Op(200)),
        ("probe 9", size | 2 << 16 | 9 << 48, Damage::Probe(9)),
        (
            "probe of another op",
            size | 2 << 16 | 1 << 48,
            Damage::Probe(1),
        ),
        ("flags", size | 2 << 16 | 0x80 << 32, Damage::Flags(0x80)),
    ] {
        let mut buf = ring();
        let head = write_ring(&mut buf, 0, &records);
        set_word(&mut buf, size + record::HEAD, word);
        let (read, out) = read(&buf, head, 0);
        assert_eq!(
            read,
            RingRead {
                records: 1,
                tail: head,
                damage: Some(damage)
            },
            "{what}"
        );
        assert_eq!(out.records.len(), 1, "{what}");
    }
}

#[test]
fn heads_and_tails_out_of_a_ring_are_refused() {
    let buf = ring();
    for (head, tail) in [
        (1 << 40, 0),
        (0, 64),
        (layout::RING_SIZE + 64, 0),
        (u64::MAX, 3),
    ] {
        let (read, out) = read(&buf, head, tail);
        assert_eq!(read.damage, Some(Damage::Span { head, tail }));
        assert_eq!((read.records, read.tail), (0, head));
        assert!(out.records.is_empty());
    }
    // A full ring is not damage.
    let records: Vec<_> = (0..layout::RING_SIZE / 64)
        .map(|s| record(s, 0, 0))
        .collect();
    let mut buf = ring();
    let head = write_ring(&mut buf, 0, &records);
    assert_eq!(head, layout::RING_SIZE);
    assert_eq!(read(&buf, head, 0).0.records, records.len());
}

#[test]
fn a_record_past_the_head_or_an_unaligned_tail_is_refused() {
    let mut buf = ring();
    let head = write_ring(&mut buf, 0, &[record(0, 0, 4)]);
    let (read1, _) = read(&buf, head - 8, 0);
    assert_eq!(read1.damage, Some(Damage::PastHead { size: 96, left: 88 }));
    // A tail moved by 3 bytes: what is there is no header.
    let (read2, _) = read(&buf, head, 3);
    assert!(read2.damage.is_some());
    assert_eq!(read2.tail, head);
}

#[test]
fn sequence_numbers_beyond_the_counter_or_not_increasing_are_refused() {
    let mut buf = ring();
    let records: Vec<_> = [5u64, 3, 3].iter().map(|&s| record(s, 0, 0)).collect();
    let head = write_ring(&mut buf, 0, &records);
    let (read1, _) = read(&buf, head, 0);
    assert_eq!(read1.records, 1);
    assert_eq!(read1.damage, Some(Damage::SeqOrder { seq: 3, before: 5 }));
    let head = write_ring(&mut buf, 0, &[record(u64::MAX - 1, 0, 0)]);
    let (read2, _) = read(&buf, head, 0);
    assert_eq!(
        read2.damage,
        Some(Damage::Seq {
            seq: u64::MAX - 1,
            limit: 1 << 20
        })
    );
}

#[test]
fn the_merge_screens_duplicates_and_numbers_far_ahead() {
    let mut records: Vec<Record> = [0u64, 1, 1, 2, 7, MAX_SEQ_AHEAD + 5, u64::MAX - 1]
        .iter()
        .map(|&s| record(s, 0, 0).0)
        .collect();
    assert_eq!(screen_seqs(&mut records, 4), 3);
    let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, [0, 1, 2, 7]);
    // Late numbers go through; the gap before 7 is waited for, or skipped.
    let wait = in_order(seqs.iter().copied(), 4, 0);
    assert_eq!(
        wait,
        InOrder {
            take: 3,
            skipped: 0,
            next: 4,
            waiting: true
        }
    );
    let skip = in_order(seqs.iter().copied(), 4, 1);
    assert_eq!(
        skip,
        InOrder {
            take: 4,
            skipped: 3,
            next: 8,
            waiting: false
        }
    );
    let at_end = in_order([u64::MAX].into_iter(), u64::MAX, 0);
    assert_eq!(
        at_end,
        InOrder {
            take: 1,
            skipped: 0,
            next: u64::MAX,
            waiting: false
        }
    );
}

#[test]
fn a_mapping_call_has_six_arguments_and_its_own_size() {
    let mut buf = ring();
    let (map, frames) = record(5, 4, 3);
    assert_eq!(map.what, Called::Map(MapOp::Mmap));
    assert_eq!(map.args, [5, 10, 15, 20, 25, 30]);
    let head = write_ring(&mut buf, 0, &[(map.clone(), frames.clone())]);
    assert_eq!(head, layout::MAP_RECORD_HEADER + 24);
    let (got, out) = read(&buf, head, 0);
    assert_eq!((got.records, got.damage), (1, None));
    assert_eq!(out.frames(&out.records[0]), frames.as_slice());
    assert_eq!(out.records[0].args, map.args);
    assert_eq!(out.records[0].ret, map.ret);
    // A mapping op with an allocator call's size, an allocator op with a
    // mapping call's, a mapping op past the last: refused.
    let op = |what: Called| u64::from(what.code()) << 40;
    for (word, damage) in [
        (
            (layout::RECORD_HEADER + 24) | 3 << 16 | op(map.what) | 4 << 48,
            Damage::Size {
                size: layout::RECORD_HEADER + 24,
                frames: 3,
            },
        ),
        (
            (layout::MAP_RECORD_HEADER + 24) | 3 << 16 | 1 << 48,
            Damage::Size {
                size: layout::MAP_RECORD_HEADER + 24,
                frames: 3,
            },
        ),
        (
            (layout::MAP_RECORD_HEADER + 24) | 3 << 16 | u64::from(record::MAP_OPS + 7) << 40,
            Damage::Op(record::MAP_OPS + 7),
        ),
    ] {
        let mut bad = buf.clone();
        set_word(&mut bad, 0, word);
        let (got, out) = read(&bad, head, 0);
        assert_eq!((got.records, got.damage), (0, Some(damage)));
        assert!(out.records.is_empty());
    }
    // Probe 4 records mmap, not munmap.
    let mut bad = buf.clone();
    set_word(
        &mut bad,
        0,
        (layout::MAP_RECORD_HEADER + 24) | 3 << 16 | op(Called::Map(MapOp::Munmap)) | 4 << 48,
    );
    assert_eq!(read(&bad, head, 0).0.damage, Some(Damage::Probe(4)));
}

#[test]
fn every_recorded_code_round_trips() {
    for what in Op::ALL
        .map(Called::Alloc)
        .into_iter()
        .chain(MapOp::ALL.map(Called::Map))
    {
        assert_eq!(Called::of_code(what.code()), Some(what));
    }
    assert_eq!(Called::of_code(Op::ALL.len() as u8), None);
    assert_eq!(
        Called::of_code(record::MAP_OPS + MapOp::ALL.len() as u8),
        None
    );
}

#[test]
fn counters_beyond_a_day_of_calls_are_implausible() {
    assert_eq!(plausible_count(0), Some(0));
    assert_eq!(plausible_count(MAX_COUNT), Some(MAX_COUNT));
    assert_eq!(plausible_count(u64::MAX), None);
}

fn arb_record() -> impl Strategy<Value = (Record, Vec<u64>)> {
    (
        0u16..7,
        any::<[u64; 9]>(),
        0u8..4,
        proptest::collection::vec(any::<u64>(), 0..=128),
    )
        .prop_map(|(probe, w, flags, frames)| {
            let args = [w[1], w[2], w[3], w[4], w[5], w[6]];
            (record_of(0, w[0], probe, flags, args, w[7], w[8]), frames)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Whatever the ring's bytes, head and tail: no panic, no more records
    /// than the bytes before the head can hold, and a tail within the ring.
    #[test]
    fn any_ring_is_read_within_bounds(
        bytes in proptest::collection::vec(any::<u8>(), 0..4096),
        at in 0u64..layout::RING_SIZE,
        head in any::<u64>(),
        span in 0u64..=layout::RING_SIZE,
        exact in any::<bool>(),
        limit in any::<u64>(),
    ) {
        let mut buf = ring();
        let from = at as usize;
        let n = bytes.len().min(buf.len() - from);
        buf[from..from + n].copy_from_slice(&bytes[..n]);
        let tail = if exact { head.wrapping_sub(span) } else { head.wrapping_sub(span ^ 0x5a5a) };
        let mut out = Pulled::default();
        let checks = Checks { probe: &probe, seq_limit: limit };
        let read = read_ring(buf.as_slice(), head, tail, TID, &checks, &mut out);
        prop_assert_eq!(read.records, out.records.len());
        prop_assert!(read.records as u64 <= layout::RING_SIZE / layout::RECORD_HEADER);
        prop_assert!(out.frames.len() as u64 <= read.records as u64 * layout::MAX_FRAMES);
        // Read to the head, or resynchronised to it.
        prop_assert_eq!(read.tail, head);
        for r in &out.records {
            prop_assert!(r.seq < limit);
            prop_assert!(probe(r.probe, r.what));
            prop_assert_eq!(r.tid, TID);
        }
    }

    /// Records as the probes write them, anywhere in the ring, read back
    /// exactly.
    #[test]
    fn well_formed_records_round_trip(
        records in proptest::collection::vec(arb_record(), 1..24),
        start in any::<u64>(),
        first_seq in 0u64..1 << 40,
    ) {
        let start = start % (1 << 50);
        let records: Vec<_> = records
            .into_iter()
            .enumerate()
            .map(|(i, (r, f))| (Record { seq: first_seq + 2 * i as u64, ..r }, f))
            .collect();
        let mut buf = ring();
        let head = write_ring(&mut buf, start, &records);
        let mut out = Pulled::default();
        let checks = Checks { probe: &probe, seq_limit: u64::MAX };
        let read = read_ring(buf.as_slice(), head, start, TID, &checks, &mut out);
        prop_assert_eq!(read, RingRead { records: records.len(), tail: head, damage: None });
        for (got, (want, frames)) in out.records.iter().zip(&records) {
            prop_assert_eq!(out.frames(got), frames.as_slice());
            prop_assert_eq!(&Record { frames: 0..0, ..got.clone() }, want);
        }
    }

    /// The merge of any numbers: bounded, never going back, each taken once.
    #[test]
    fn any_numbers_merge_in_bounds(
        seqs in proptest::collection::vec(any::<u64>(), 0..64),
        next in any::<u64>(),
        gaps in 0usize..3,
    ) {
        let mut records: Vec<Record> = seqs.iter().map(|&s| record(s, 0, 0).0).collect();
        records.sort_unstable_by_key(|r| r.seq);
        let removed = screen_seqs(&mut records, next);
        prop_assert_eq!(removed as usize + records.len(), seqs.len());
        let order = in_order(records.iter().map(|r| r.seq), next, gaps);
        prop_assert!(order.take <= records.len());
        prop_assert!(order.next >= next);
        prop_assert!(order.skipped <= gaps as u64 * MAX_SEQ_AHEAD);
        prop_assert!(order.next - next <= MAX_SEQ_AHEAD + 1);
    }
}
