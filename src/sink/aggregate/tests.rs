//! The aggregator against hand-made sequences, and against a brute-force
//! replay that keeps every state of the heap, on random sequences.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

fn key(stack: u64, thread: u32, op: Op) -> CallKey {
    CallKey {
        stack: Some(stack),
        thread,
        op,
    }
}

#[test]
fn totals_leaks_peak_and_temporary() {
    let mut agg = Aggregator::new(100);
    // Stack 1 allocates 100 and 50; stack 2 allocates 30, freed at once
    // (temporary); the 100 is freed; the 50 leaks. A failed malloc.
    let events = [
        (
            Event::test(1, 10, 1, Op::Malloc, 0x1001, Some(100), Some(1)),
            0,
        ),
        (
            Event::test(2, 20, 1, Op::Malloc, 0x1002, Some(50), Some(1)),
            0,
        ),
        (
            Event::test(3, 30, 1, Op::Calloc, 0x1003, Some(30), Some(2)),
            1,
        ),
        (Event::test_free(4, 40, 1, 0x1000 + 3, 3, Some(9)), 1),
        (Event::test_free(5, 150, 1, 0x1000 + 1, 1, Some(9)), 0),
        (
            Event::test(6, 160, 1, Op::Malloc, 0, Some(1 << 40), Some(2)),
            0,
        ),
    ];
    for (e, thread) in &events {
        agg.add(e, *thread);
    }
    let a = agg.finish();
    let calls: BTreeMap<CallKey, CallStats> = a.calls.iter().copied().collect();
    assert_eq!(
        calls[&key(1, 0, Op::Malloc)],
        CallStats {
            calls: 2,
            blocks: 2,
            bytes: 150,
            ..CallStats::default()
        }
    );
    assert_eq!(
        calls[&key(2, 1, Op::Calloc)],
        CallStats {
            calls: 1,
            blocks: 1,
            bytes: 30,
            temporary: 1,
            ..CallStats::default()
        }
    );
    assert_eq!(
        calls[&key(9, 1, Op::Free)],
        CallStats {
            calls: 1,
            releases: 1,
            ..CallStats::default()
        }
    );
    assert_eq!(calls[&key(9, 0, Op::Free)].releases, 1);
    assert_eq!(
        calls[&key(2, 0, Op::Malloc)],
        CallStats {
            calls: 1,
            failed: 1,
            ..CallStats::default()
        }
    );
    assert_eq!(
        agg.live_blocks().collect::<Vec<_>>(),
        vec![LiveBlock {
            alloc_id: 2,
            ptr: 0x1002,
            size: 50,
            stack: Some(1),
            thread: 0,
            op: Op::Malloc,
            ts_ns: 20
        }]
    );
    assert_eq!(
        a.peak,
        PeakTotals {
            bytes: 180,
            blocks: 3,
            event: 3,
            ts_ns: 30
        }
    );
    assert_eq!(
        a.at_peak,
        vec![
            PeakRow {
                stack: Some(1),
                thread: 0,
                blocks: 2,
                bytes: 150
            },
            PeakRow {
                stack: Some(2),
                thread: 1,
                blocks: 1,
                bytes: 30
            },
        ]
    );
    assert_eq!(a.events, 6);
    assert_eq!(a.sizes[size_bucket(100)], 1);
    assert_eq!(a.sizes.iter().sum::<u64>(), 3);
    // Bucket 0 (0-99 ns): stacks 1 and 2 changed; bucket 1: stack 1.
    assert_eq!(
        agg.take_over_time(),
        vec![
            OverTimeRow {
                stack: Some(1),
                bucket_ns: 0,
                bytes: 150,
                blocks: 2
            },
            OverTimeRow {
                stack: Some(2),
                bucket_ns: 0,
                bytes: 0,
                blocks: 0
            },
            OverTimeRow {
                stack: Some(1),
                bucket_ns: 100,
                bytes: 50,
                blocks: 1
            },
        ]
    );
}

#[test]
fn exec_released_blocks_are_not_leaks_but_count_in_the_heap() {
    let mut agg = Aggregator::new(1_000);
    agg.exec_released(&[1]);
    agg.add(
        &Event::test(1, 1, 1, Op::Malloc, 0x1001, Some(64), Some(1)),
        0,
    );
    agg.add(
        &Event::test(2, 2, 1, Op::Malloc, 0x1002, Some(8), Some(1)),
        0,
    );
    let a = agg.finish();
    assert_eq!(a.exec_released_blocks, 1);
    assert_eq!(a.exec_released_bytes, 64);
    assert_eq!(agg.live_blocks().count(), 1);
    assert_eq!(a.peak.bytes, 72);
}

#[test]
fn a_block_live_at_attach_is_never_temporary() {
    let mut agg = Aggregator::new(1_000);
    let inventory = Event::test(1, 0, 1, Op::Inventory, 0x1001, Some(16), None);
    agg.add(&inventory, 0);
    agg.add(&Event::test_free(2, 1, 1, 0x1000 + 1, 1, Some(3)), 0);
    let a = agg.finish();
    assert!(a.calls.iter().all(|(_, s)| s.temporary == 0));
    assert!(agg.live_blocks().next().is_none());
}

/// One step of a random sequence: allocate (size, stack, thread, time
/// step), or release the live block at an index (modulo the live count).
#[derive(Clone, Debug)]
enum Step {
    Alloc(u64, u64, u32, u64),
    Release(usize, u64, u32, u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u64..200, 1u64..6, 0u32..3, 0u64..40).prop_map(|(a, b, c, d)| Step::Alloc(a, b, c, d)),
        (0usize..64, 1u64..6, 0u32..3, 0u64..40).prop_map(|(a, b, c, d)| Step::Release(a, b, c, d)),
    ]
}

/// The events of `steps`; a release of an empty heap is a failed malloc.
fn events_of(steps: &[Step]) -> Vec<(Event, u32)> {
    let mut live: Vec<u64> = Vec::new();
    let mut out = Vec::new();
    let mut ts = 0;
    for (i, s) in steps.iter().enumerate() {
        let id = i as u64 + 1;
        match *s {
            Step::Alloc(size, stack, thread, dt) => {
                ts += dt;
                out.push((
                    Event::test(id, ts, 1, Op::Malloc, 0x1000 + id, Some(size), Some(stack)),
                    thread,
                ));
                live.push(id);
            }
            Step::Release(at, stack, thread, dt) => {
                ts += dt;
                if live.is_empty() {
                    out.push((
                        Event::test(id, ts, 1, Op::Malloc, 0, Some(8), Some(stack)),
                        thread,
                    ));
                } else {
                    let alloc = live.remove(at % live.len());
                    out.push((
                        Event::test_free(id, ts, 1, 0x1000 + alloc, alloc, Some(stack)),
                        thread,
                    ));
                }
            }
        }
    }
    out
}

/// The blocks live after an event: allocation id -> (stack, thread, size).
type Live = BTreeMap<u64, (Option<u64>, u32, u64)>;

/// The live blocks after each event, kept whole.
fn replay(events: &[(Event, u32)]) -> Vec<Live> {
    let mut live = BTreeMap::new();
    let mut states = Vec::new();
    for (e, thread) in events {
        if let Some(a) = e.alloc_id {
            live.remove(&a);
        }
        if e.op.allocates() && e.ptr != 0 {
            live.insert(e.id, (e.stack_id, *thread, e.size.unwrap_or(0)));
        }
        states.push(live.clone());
    }
    states
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn peak_and_over_time_match_a_replay(steps in proptest::collection::vec(step(), 0..300)) {
        let events = events_of(&steps);
        let resolution = 50;
        let mut agg = Aggregator::new(resolution);
        for (e, thread) in &events {
            agg.add(e, *thread);
        }
        let a = agg.finish();
        let states = replay(&events);
        let bytes = |s: &Live| s.values().map(|v| v.2).sum::<u64>();
        // The peak: the first state with the most bytes.
        let mut peak: Option<usize> = None;
        for (i, s) in states.iter().enumerate() {
            if bytes(s) > peak.map_or(0, |p| bytes(&states[p])) {
                peak = Some(i);
            }
        }
        let mut expected_rows = Vec::new();
        match peak {
            None => prop_assert_eq!(a.peak, PeakTotals::default()),
            Some(p) => {
                prop_assert_eq!(a.peak, PeakTotals {
                    bytes: bytes(&states[p]),
                    blocks: states[p].len() as u64,
                    event: events[p].0.id,
                    ts_ns: events[p].0.ts_ns,
                });
                let mut by: BTreeMap<(Option<u64>, u32), (u64, u64)> = BTreeMap::new();
                for &(stack, thread, size) in states[p].values() {
                    let cell = by.entry((stack, thread)).or_default();
                    cell.0 += 1;
                    cell.1 += size;
                }
                expected_rows = by
                    .into_iter()
                    .map(|((stack, thread), (blocks, bytes))| PeakRow { stack, thread, blocks, bytes })
                    .collect();
            }
        }
        prop_assert_eq!(&a.at_peak, &expected_rows);
        // Leaks: the last state.
        let last: Vec<u64> = states.last().map(|s| s.keys().copied().collect()).unwrap_or_default();
        prop_assert_eq!(agg.live_blocks().map(|b| b.alloc_id).collect::<Vec<_>>(), last);
        // Over time: per bucket, the stacks a block of which came or went,
        // at the bucket's last event.
        let mut expected = Vec::new();
        let mut i = 0;
        while i < events.len() {
            let bucket = events[i].0.ts_ns / resolution;
            let mut changed = BTreeSet::new();
            let mut order = Vec::new();
            let mut j = i;
            while j < events.len() && events[j].0.ts_ns / resolution == bucket {
                let before = if j == 0 { BTreeMap::new() } else { states[j - 1].clone() };
                let after = &states[j];
                for (id, v) in before.iter().chain(after.iter()) {
                    if before.contains_key(id) != after.contains_key(id) && changed.insert(v.0) {
                        order.push(v.0);
                    }
                }
                j += 1;
            }
            for stack in order {
                let held: Vec<u64> = states[j - 1].values().filter(|v| v.0 == stack).map(|v| v.2).collect();
                expected.push(OverTimeRow {
                    stack,
                    bucket_ns: bucket * resolution,
                    bytes: held.iter().sum(),
                    blocks: held.len() as u64,
                });
            }
            i = j;
        }
        let mut got = agg.take_over_time();
        // Within a bucket the order of stacks is not part of the contract.
        let sort = |rows: &mut Vec<OverTimeRow>| rows.sort_by_key(|r| (r.bucket_ns, r.stack));
        sort(&mut got);
        sort(&mut expected);
        prop_assert_eq!(got, expected);
    }
}
