//! The one pass over the events that every report starts from.
//!
//! Events are read from `event_log` in id order (the order the calls took
//! effect), each release is paired with its allocation through the id the
//! tracer recorded (`id - alloc_dist`), and running sums are kept per op,
//! stack and thread. Memory is proportional to the blocks live at a time,
//! never to the number of events. The stacks live at the peak need a second,
//! shorter pass up to the peak event ([`Analysis::add_peak`]): the peak is
//! known only at the end of the first.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use indicatif::ProgressBar;
use rusqlite::types::ValueRef;

use super::{ReportError, Trace};
use crate::event::Op;

/// A map keyed by event or stack ids: the keys are trusted integers, so a
/// multiply-shift hash does (SipHash costs more than the rest of the pass).
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_i64(&mut self, n: i64) {
        self.write_u64(n as u64);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
}

/// One event as the analysis needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventRow {
    pub id: i64,
    pub ts_ns: i64,
    pub op: Op,
    /// `event_threads.code` of the calling thread.
    pub thread: u32,
    pub stack: Option<i64>,
    /// The call returned a block (an allocation that succeeded).
    pub allocated: bool,
    /// Bytes requested; `None` for free and when n*m overflowed.
    pub size: Option<u64>,
    /// The allocation this call released, if it released a traced block.
    pub released: Option<i64>,
}

/// Rows between two progress updates.
const PROGRESS_STEP: u64 = 1 << 16;

/// Call `f` on every event in id order, up to and including `upto`, and
/// only those with `ts_ns <= until` when given.
pub fn for_each_event(
    trace: &Trace,
    upto: Option<i64>,
    until: Option<i64>,
    bar: &ProgressBar,
    mut f: impl FnMut(&EventRow),
) -> Result<(), ReportError> {
    let decode = crate::sink::EventDecoder::load(&trace.conn).map_err(|e| trace.err(e))?;
    let until = until.unwrap_or(i64::MAX);
    let sql = "SELECT id, t, k, p, n, d FROM event_log WHERE id <= ?1 ORDER BY id";
    let mut stmt = trace.conn.prepare(sql).map_err(|e| trace.err(e))?;
    let mut rows = stmt
        .query([upto.unwrap_or(i64::MAX)])
        .map_err(|e| trace.err(e))?;
    let mut seen = 0u64;
    while let Some(row) = rows.next().map_err(|e| trace.err(e))? {
        let id: i64 = row.get(0).map_err(|e| trace.err(e))?;
        let k: i64 = row.get(2).map_err(|e| trace.err(e))?;
        // An op code this memptrace does not know cannot be analysed; the
        // schema version check makes it impossible short of a damaged file.
        let Some(op) = Op::from_code((k & 15) as u8) else {
            continue;
        };
        let Some(ts_ns) = decode.ts_ns(id, row.get(1).map_err(|e| trace.err(e))?) else {
            continue;
        };
        if ts_ns > until {
            continue;
        }
        let size = match row.get_ref(4).map_err(|e| trace.err(e))? {
            ValueRef::Integer(n) => Some(n.max(0) as u64),
            // Sizes above 2^63 - 1 are stored as REAL (docs/schema.md).
            ValueRef::Real(x) => Some(x as u64),
            _ => None,
        };
        let (thread, stack) = decode.site(k);
        // A stored pointer is 0 only when stored raw (docs/schema.md).
        let nonzero = match row.get_ref(3).map_err(|e| trace.err(e))? {
            ValueRef::Integer(0) => k & crate::sink::RAW_PTR == 0,
            ValueRef::Null => false,
            _ => true,
        };
        let dist: Option<i64> = row.get(5).map_err(|e| trace.err(e))?;
        let event = EventRow {
            id,
            ts_ns,
            op,
            thread,
            stack,
            allocated: op.allocates() && nonzero,
            size,
            released: dist.map(|d| id.wrapping_sub(d)),
        };
        f(&event);
        seen += 1;
        if seen % PROGRESS_STEP == 0 {
            bar.inc(PROGRESS_STEP);
        }
    }
    bar.inc(seen % PROGRESS_STEP);
    Ok(())
}

/// The largest event id: the length of a pass, for progress bars.
pub fn last_event_id(trace: &Trace) -> Result<i64, ReportError> {
    trace
        .conn
        .query_row("SELECT coalesce(max(id), 0) FROM event_log", [], |r| {
            r.get(0)
        })
        .map_err(|e| trace.err(e))
}

/// Calls, failures and bytes of one allocator function.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpStats {
    pub calls: u64,
    /// Allocating calls that returned no block (but not `realloc(p, 0)`).
    pub failed: u64,
    /// Bytes requested by the calls that returned a block.
    pub bytes: u64,
}

/// What happened at one stack (the allocations made from it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StackStats {
    /// Calls to the allocating functions, failed ones included.
    pub calls: u64,
    pub blocks: u64,
    pub bytes: u64,
    pub temporary: u64,
    pub leaked_blocks: u64,
    pub leaked_bytes: u64,
    pub peak_blocks: u64,
    pub peak_bytes: u64,
}

impl StackStats {
    pub fn add(&mut self, o: StackStats) {
        self.calls += o.calls;
        self.blocks += o.blocks;
        self.bytes += o.bytes;
        self.temporary += o.temporary;
        self.leaked_blocks += o.leaked_blocks;
        self.leaked_bytes += o.leaked_bytes;
        self.peak_blocks += o.peak_blocks;
        self.peak_bytes += o.peak_bytes;
    }
}

/// What one thread did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ThreadStats {
    /// Every allocator call, frees included.
    pub calls: u64,
    pub blocks: u64,
    pub bytes: u64,
    pub temporary: u64,
    pub leaked_blocks: u64,
    pub leaked_bytes: u64,
    pub peak_bytes: u64,
}

/// The heap's high-water mark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peak {
    pub bytes: u64,
    pub blocks: u64,
    /// The first event after which the heap held `bytes`; 0 when empty.
    pub event: i64,
    pub ts_ns: i64,
}

/// Buckets of the heap timeline: enough for any plot width.
pub const TIMELINE_BUCKETS: usize = 2048;

/// The heap in use during one slice of time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slice {
    pub first_ns: i64,
    pub last_ns: i64,
    /// Largest and last value after an event in the slice.
    pub max_bytes: u64,
    pub last_bytes: u64,
}

/// A live block, as the pass remembers it.
#[derive(Clone, Copy, Debug)]
struct Block {
    size: u64,
    stack: Option<i64>,
    thread: u32,
    /// Live at attach (an `Op::Inventory` event), not allocated while traced.
    inventory: bool,
}

/// Everything one pass finds.
#[derive(Clone, Debug, Default)]
pub struct Analysis {
    pub events: u64,
    /// Indexed by op code.
    pub ops: [OpStats; Op::RECORDED.len()],
    /// Blocks allocated, and the bytes requested for them.
    pub blocks: u64,
    pub bytes: u64,
    /// Calls that released a traced block.
    pub releases: u64,
    pub peak: Peak,
    /// Blocks live at the end of the trace (the `leaks` view's), ...
    pub leaked_blocks: u64,
    pub leaked_bytes: u64,
    /// ... of which live since the attach (the inventory).
    pub inventory_live_blocks: u64,
    pub inventory_live_bytes: u64,
    /// Blocks live when their process exec'd: released by the exec, not
    /// counted above (`exec_releases`).
    pub exec_released_blocks: u64,
    pub exec_released_bytes: u64,
    pub temporary: u64,
    pub stacks: IdMap<Option<i64>, StackStats>,
    pub threads: IdMap<u32, ThreadStats>,
    /// Blocks by requested size: index 0 for 0 bytes, i for [2^(i-1), 2^i);
    /// 65 buckets.
    pub sizes: Vec<u64>,
    /// The heap over time, in [`TIMELINE_BUCKETS`] slices of the trace.
    pub timeline: Vec<Slice>,
    pub last_ns: i64,
}

/// The size histogram's bucket of `size`.
pub fn size_bucket(size: u64) -> usize {
    (u64::BITS - size.leading_zeros()) as usize
}

/// The blocks live after each event, with running totals.
#[derive(Default)]
struct Heap {
    live: IdMap<i64, Block>,
    bytes: u64,
}

impl Heap {
    /// Apply an event; returns the block it released, if any.
    fn apply(&mut self, e: &EventRow) -> Option<Block> {
        let released = e.released.and_then(|id| self.live.remove(&id));
        if let Some(block) = released {
            self.bytes -= block.size;
        }
        if e.allocated {
            let size = e.size.unwrap_or(0);
            self.live.insert(
                e.id,
                Block {
                    size,
                    stack: e.stack,
                    thread: e.thread,
                    inventory: e.op == Op::Inventory,
                },
            );
            self.bytes += size;
        }
        released
    }
}

/// The allocations an exec released (their process's image replaced);
/// none in a trace written before memptrace recorded them.
fn exec_released(trace: &Trace) -> Result<std::collections::HashSet<i64>, ReportError> {
    let recorded: i64 = trace
        .conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'exec_releases'",
            [],
            |r| r.get(0),
        )
        .map_err(|e| trace.err(e))?;
    if recorded == 0 {
        return Ok(Default::default());
    }
    let mut stmt = trace
        .conn
        .prepare("SELECT alloc_id FROM exec_releases")
        .map_err(|e| trace.err(e))?;
    let ids = stmt
        .query_map([], |r| r.get(0))
        .map_err(|e| trace.err(e))?
        .collect::<Result<_, _>>()
        .map_err(|e| trace.err(e))?;
    Ok(ids)
}

impl Analysis {
    /// The whole first pass.
    pub fn run(trace: &Trace) -> Result<Analysis, ReportError> {
        let last_id = last_event_id(trace)?;
        let last_ns: i64 = trace
            .conn
            .query_row(
                "SELECT coalesce((SELECT ts_ns FROM events ORDER BY id DESC LIMIT 1), 0)",
                [],
                |r| r.get(0),
            )
            .map_err(|e| trace.err(e))?;
        let bar = crate::progress::bar(last_id.max(0) as u64, "reading events");
        let mut a = Analysis {
            last_ns,
            sizes: vec![0; 65],
            ..Analysis::default()
        };
        let mut heap = Heap::default();
        // The last event of each thread, for temporary blocks.
        let mut last_of_thread: IdMap<u32, i64> = IdMap::default();
        let mut slices: Vec<Option<Slice>> = vec![None; TIMELINE_BUCKETS];
        for_each_event(trace, None, None, &bar, |e| {
            a.events += 1;
            let op = &mut a.ops[e.op as usize];
            op.calls += 1;
            let thread = a.threads.entry(e.thread).or_default();
            thread.calls += 1;
            let previous = last_of_thread.insert(e.thread, e.id);
            if let Some(block) = heap.apply(e) {
                a.releases += 1;
                // A block live at attach was not allocated by a call.
                if previous == e.released && !block.inventory {
                    a.temporary += 1;
                    a.stacks.entry(block.stack).or_default().temporary += 1;
                    a.threads.entry(block.thread).or_default().temporary += 1;
                }
            }
            if e.op.allocates() {
                let stack = a.stacks.entry(e.stack).or_default();
                stack.calls += 1;
                let size = e.size.unwrap_or(0);
                if e.allocated {
                    op.bytes += size;
                    a.blocks += 1;
                    a.bytes += size;
                    stack.blocks += 1;
                    stack.bytes += size;
                    let thread = a.threads.entry(e.thread).or_default();
                    thread.blocks += 1;
                    thread.bytes += size;
                    a.sizes[size_bucket(size)] += 1;
                } else if e.size != Some(0) && e.released.is_none() {
                    op.failed += 1;
                }
            }
            if heap.bytes > a.peak.bytes {
                a.peak = Peak {
                    bytes: heap.bytes,
                    blocks: heap.live.len() as u64,
                    event: e.id,
                    ts_ns: e.ts_ns,
                };
            }
            let at = (e.ts_ns.max(0) as u128 * TIMELINE_BUCKETS as u128
                / (last_ns.max(1) as u128 + 1)) as usize;
            let slice = slices[at.min(TIMELINE_BUCKETS - 1)].get_or_insert(Slice {
                first_ns: e.ts_ns,
                last_ns: e.ts_ns,
                max_bytes: heap.bytes,
                last_bytes: heap.bytes,
            });
            slice.last_ns = e.ts_ns;
            slice.max_bytes = slice.max_bytes.max(heap.bytes);
            slice.last_bytes = heap.bytes;
        })?;
        bar.finish_and_clear();
        let exec_released = exec_released(trace)?;
        for (id, block) in &heap.live {
            if exec_released.contains(id) {
                a.exec_released_blocks += 1;
                a.exec_released_bytes += block.size;
                continue;
            }
            a.leaked_blocks += 1;
            a.leaked_bytes += block.size;
            if block.inventory {
                a.inventory_live_blocks += 1;
                a.inventory_live_bytes += block.size;
            }
            let stack = a.stacks.entry(block.stack).or_default();
            stack.leaked_blocks += 1;
            stack.leaked_bytes += block.size;
            let thread = a.threads.entry(block.thread).or_default();
            thread.leaked_blocks += 1;
            thread.leaked_bytes += block.size;
        }
        a.timeline = slices.into_iter().flatten().collect();
        Ok(a)
    }

    /// The second pass: which stacks (and threads) hold the blocks live at
    /// the peak.
    pub fn add_peak(&mut self, trace: &Trace) -> Result<(), ReportError> {
        if self.peak.event == 0 {
            return Ok(());
        }
        let bar = crate::progress::bar(self.peak.event as u64, "finding the peak's stacks");
        let mut heap = Heap::default();
        for_each_event(trace, Some(self.peak.event), None, &bar, |e| {
            heap.apply(e);
        })?;
        bar.finish_and_clear();
        for block in heap.live.values() {
            let stack = self.stacks.entry(block.stack).or_default();
            stack.peak_blocks += 1;
            stack.peak_bytes += block.size;
            self.threads.entry(block.thread).or_default().peak_bytes += block.size;
        }
        Ok(())
    }

    /// Both passes.
    pub fn full(trace: &Trace) -> Result<Analysis, ReportError> {
        let mut a = Analysis::run(trace)?;
        a.add_peak(trace)?;
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_buckets_are_powers_of_two() {
        assert_eq!(size_bucket(0), 0);
        assert_eq!(size_bucket(1), 1);
        assert_eq!(size_bucket(2), 2);
        assert_eq!(size_bucket(3), 2);
        assert_eq!(size_bucket(4), 3);
        assert_eq!(size_bucket(1 << 20), 21);
        assert_eq!(size_bucket(u64::MAX), 64);
    }
}
