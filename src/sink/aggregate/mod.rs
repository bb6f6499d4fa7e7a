//! What the reports need, kept while the trace is recorded: the recorder
//! sees every event in the order the calls took effect, so it can keep the
//! totals a report would otherwise find by a pass over every event.
//!
//! An [`Aggregator`] is fed each event ([`Aggregator::add`]) and keeps,
//! exactly, the figures the report's pass over the events finds
//! (`report::scan`), with the same pairing (a release names its allocation
//! by `alloc_id`) and the same definitions (peak, temporary, failed):
//! - calls, failures, blocks and bytes per (stack, thread, op);
//! - every block live at the end;
//! - the peak of the heap in use, when it was first reached, and the blocks
//!   and bytes live at it per (stack, thread);
//! - the heap in use per stack over time, in buckets of a fixed length.
//!
//! Its memory is bounded by the stacks, threads and blocks live at a time
//! (and the rows of buckets not yet taken), never by the number of events.
//! It is pure data: no SQL, no process.

mod live;
mod old;
#[cfg(test)]
mod tests;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::event::{Event, Op};
use live::{Block, LiveBlocks};

/// Buckets of the size histogram: index 0 for 0 bytes, i for [2^(i-1), 2^i).
pub const SIZE_BUCKETS: usize = 65;

/// The size histogram's bucket of `size`.
pub fn size_bucket(size: u64) -> usize {
    (u64::BITS - size.leading_zeros()) as usize
}

/// What the calls of one function from one stack and thread add up to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallKey {
    pub stack: Option<u64>,
    /// The thread's code (`event_threads.code`).
    pub thread: u32,
    pub op: Op,
}

/// Totals of one [`CallKey`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallStats {
    pub calls: u64,
    /// Allocating calls that returned no block (but not `realloc(p, 0)`).
    pub failed: u64,
    /// Blocks returned, and the bytes requested for them.
    pub blocks: u64,
    pub bytes: u64,
    /// Calls that released a traced block.
    pub releases: u64,
    /// Blocks allocated by these calls and released by the very next
    /// allocator call of their thread (counted for the allocation).
    pub temporary: u64,
}

/// A block live at the end of the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    /// The event that allocated it.
    pub alloc_id: u64,
    pub ptr: u64,
    pub size: u64,
    pub stack: Option<u64>,
    pub thread: u32,
    pub op: Op,
    pub ts_ns: u64,
}

/// The heap's high-water mark: its first event, and the heap then.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeakTotals {
    pub bytes: u64,
    pub blocks: u64,
    /// The event after which the heap first held `bytes`; 0 when empty.
    pub event: u64,
    pub ts_ns: u64,
}

/// The blocks of one (stack, thread) live at the peak.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeakRow {
    pub stack: Option<u64>,
    pub thread: u32,
    pub blocks: u64,
    pub bytes: u64,
}

/// The heap in use by one stack at the end of a bucket in which it changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverTimeRow {
    pub stack: Option<u64>,
    /// The bucket's start, in nanoseconds since the trace started.
    pub bucket_ns: u64,
    pub bytes: u64,
    pub blocks: u64,
}

/// Everything kept, at the end, but the blocks live then (millions, perhaps:
/// they are read one by one, from [`Aggregator::live_blocks`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Aggregates {
    /// Ordered by key (stack, thread, op code).
    pub calls: Vec<(CallKey, CallStats)>,
    /// Live at the end, released by their process's exec.
    pub exec_released_blocks: u64,
    pub exec_released_bytes: u64,
    pub peak: PeakTotals,
    /// Only the (stack, thread) pairs with blocks at the peak, ordered.
    pub at_peak: Vec<PeakRow>,
    /// Blocks allocated by requested size ([`size_bucket`]).
    pub sizes: Vec<u64>,
    pub events: u64,
    /// The last event's id and time.
    pub last_event: u64,
    pub last_ns: u64,
}

/// What one (stack, thread) holds now, and at the peak (saved lazily: see
/// [`Aggregator::change`]).
#[derive(Clone, Copy, Debug, Default)]
struct Cell {
    stack: Option<u64>,
    thread: u32,
    /// Its stack's index in `Aggregator::stacks`.
    stack_slot: u32,
    bytes: u64,
    blocks: u64,
    /// The sequence number of the event that last changed it.
    changed: u64,
    /// Its value at the peak of sequence number `saved_for`.
    saved_for: u64,
    saved_bytes: u64,
    saved_blocks: u64,
}

/// A stack's heap in use, for the buckets over time.
#[derive(Clone, Copy, Debug, Default)]
struct StackNow {
    stack: Option<u64>,
    bytes: u64,
    blocks: u64,
    /// Changed in the current bucket (and listed in `dirty`).
    dirty: bool,
}

/// The totals of one [`CallKey`], and the index of its (stack, thread) in
/// `Aggregator::cells`.
#[derive(Clone, Copy, Debug, Default)]
struct CallSlot {
    stats: CallStats,
    cell: u32,
}

/// Fed every event in order; see the module's documentation.
///
/// Per event it hashes once, to find the totals of (stack, thread, op),
/// which hold the index of their (stack, thread) cell: a live block keeps
/// that index and its op, so a release finds its cell by index (and hashes
/// again only for a temporary block, to count it for its allocation).
#[derive(Debug)]
pub struct Aggregator {
    resolution_ns: u64,
    calls: FxHashMap<CallKey, CallSlot>,
    live: LiveBlocks,
    heap_bytes: u64,
    /// Events seen: their sequence numbers are 1, 2, ...
    seq: u64,
    peak: PeakTotals,
    /// The sequence number of the peak's event (0: no peak yet).
    peak_seq: u64,
    cell_slots: FxHashMap<(Option<u64>, u32), u32>,
    cells: Vec<Cell>,
    /// The last event of each thread (by code), for temporary blocks.
    last_of_thread: Vec<u64>,
    sizes: Vec<u64>,
    exec_released: FxHashSet<u64>,
    stack_slots: FxHashMap<Option<u64>, u32>,
    stacks: Vec<StackNow>,
    /// Indexes in `stacks`.
    dirty: Vec<u32>,
    /// The bucket events go to now.
    bucket: Option<u64>,
    closed: Vec<OverTimeRow>,
    last_event: u64,
    last_ns: u64,
}

impl Aggregator {
    /// An aggregator whose heap over time has buckets of `resolution_ns`
    /// (at least 1).
    pub fn new(resolution_ns: u64) -> Aggregator {
        Aggregator {
            resolution_ns: resolution_ns.max(1),
            calls: FxHashMap::default(),
            live: LiveBlocks::default(),
            heap_bytes: 0,
            seq: 0,
            peak: PeakTotals::default(),
            peak_seq: 0,
            cell_slots: FxHashMap::default(),
            cells: Vec::new(),
            last_of_thread: Vec::new(),
            sizes: vec![0; SIZE_BUCKETS],
            exec_released: FxHashSet::default(),
            stack_slots: FxHashMap::default(),
            stacks: Vec::new(),
            dirty: Vec::new(),
            bucket: None,
            closed: Vec::new(),
            last_event: 0,
            last_ns: 0,
        }
    }

    pub fn resolution_ns(&self) -> u64 {
        self.resolution_ns
    }

    /// The index of the cell of (stack, thread), made when new (with its
    /// stack's slot, when new).
    fn cell(&mut self, stack: Option<u64>, thread: u32) -> u32 {
        if let Some(&cell) = self.cell_slots.get(&(stack, thread)) {
            return cell;
        }
        let stack_slot = match self.stack_slots.get(&stack) {
            Some(&slot) => slot,
            None => {
                let slot = self.stacks.len() as u32;
                self.stacks.push(StackNow {
                    stack,
                    ..StackNow::default()
                });
                self.stack_slots.insert(stack, slot);
                slot
            }
        };
        let cell = self.cells.len() as u32;
        self.cells.push(Cell {
            stack,
            thread,
            stack_slot,
            ..Cell::default()
        });
        self.cell_slots.insert((stack, thread), cell);
        cell
    }

    /// One event, made by the thread of code `thread`.
    pub fn add(&mut self, e: &Event, thread: u32) {
        self.seq += 1;
        self.last_event = e.id;
        self.last_ns = e.ts_ns;
        self.enter_bucket(e.ts_ns / self.resolution_ns);
        let t = thread as usize;
        if t >= self.last_of_thread.len() {
            self.last_of_thread.resize(t + 1, 0);
        }
        let previous = std::mem::replace(&mut self.last_of_thread[t], e.id);
        let released = e.alloc_id.and_then(|id| self.live.remove(id));
        if let Some(block) = released {
            self.heap_bytes = self.heap_bytes.saturating_sub(block.size);
            // A block live at attach was not allocated by a call.
            if previous != 0 && Some(previous) == e.alloc_id && block.op != Op::Inventory {
                let cell = &self.cells[block.cell as usize];
                let owner = CallKey {
                    stack: cell.stack,
                    thread: cell.thread,
                    op: block.op,
                };
                if let Some(owner) = self.calls.get_mut(&owner) {
                    owner.stats.temporary += 1;
                }
            }
            self.change(block.cell, block.size, false);
        }
        let key = CallKey {
            stack: e.stack_id,
            thread,
            op: e.op,
        };
        let call = match self.calls.get_mut(&key) {
            Some(call) => call,
            None => {
                let cell = self.cell(e.stack_id, thread);
                self.calls.entry(key).or_insert(CallSlot {
                    cell,
                    ..CallSlot::default()
                })
            }
        };
        let allocated = e.op.allocates() && e.ptr != 0;
        let size = e.size.unwrap_or(0);
        let stats = &mut call.stats;
        stats.calls += 1;
        stats.releases += u64::from(released.is_some());
        if allocated {
            stats.blocks += 1;
            stats.bytes = stats.bytes.saturating_add(size);
            self.sizes[size_bucket(size)] += 1;
        } else if e.op.allocates() && e.size != Some(0) && e.alloc_id.is_none() {
            stats.failed += 1;
        }
        if allocated {
            let cell = call.cell;
            self.live.insert(
                e.id,
                Block {
                    ptr: e.ptr,
                    size,
                    ts_ns: e.ts_ns,
                    cell,
                    op: e.op,
                },
            );
            self.heap_bytes = self.heap_bytes.saturating_add(size);
            self.change(cell, size, true);
        }
        if self.heap_bytes > self.peak.bytes {
            self.peak = PeakTotals {
                bytes: self.heap_bytes,
                blocks: self.live.len() as u64,
                event: e.id,
                ts_ns: e.ts_ns,
            };
            self.peak_seq = self.seq;
        }
    }

    /// The blocks allocated by these events went with their process's old
    /// image when it exec'd: not leaks (they stay in the heap's figures, as
    /// in the report's pass).
    pub fn exec_released(&mut self, alloc_ids: &[u64]) {
        self.exec_released.extend(alloc_ids);
    }

    /// A block of `size` of (stack, thread) was allocated (`grow`) or
    /// released. Before a cell changes, its value at the peak is saved if
    /// it still holds it: it last changed at or before the peak's event and
    /// has no value saved for that peak. A cell not changed since the peak
    /// holds its value then.
    fn change(&mut self, cell: u32, size: u64, grow: bool) {
        let cell = &mut self.cells[cell as usize];
        if cell.changed <= self.peak_seq && cell.saved_for != self.peak_seq {
            cell.saved_for = self.peak_seq;
            cell.saved_bytes = cell.bytes;
            cell.saved_blocks = cell.blocks;
        }
        cell.changed = self.seq;
        let slot = cell.stack_slot;
        let now = &mut self.stacks[slot as usize];
        if grow {
            cell.bytes = cell.bytes.saturating_add(size);
            cell.blocks += 1;
            now.bytes = now.bytes.saturating_add(size);
            now.blocks += 1;
        } else {
            cell.bytes = cell.bytes.saturating_sub(size);
            cell.blocks = cell.blocks.saturating_sub(1);
            now.bytes = now.bytes.saturating_sub(size);
            now.blocks = now.blocks.saturating_sub(1);
        }
        if !now.dirty {
            now.dirty = true;
            self.dirty.push(slot);
        }
    }

    /// Events now go to `bucket` (never back: a time earlier than the
    /// current bucket's counts in it); the buckets before it are closed.
    fn enter_bucket(&mut self, bucket: u64) {
        match self.bucket {
            Some(current) if bucket <= current => {}
            Some(current) => {
                self.close_bucket(current);
                self.bucket = Some(bucket);
            }
            None => self.bucket = Some(bucket),
        }
    }

    fn close_bucket(&mut self, bucket: u64) {
        let bucket_ns = bucket.saturating_mul(self.resolution_ns);
        for slot in self.dirty.drain(..) {
            if let Some(now) = self.stacks.get_mut(slot as usize) {
                now.dirty = false;
                self.closed.push(OverTimeRow {
                    stack: now.stack,
                    bucket_ns,
                    bytes: now.bytes,
                    blocks: now.blocks,
                });
            }
        }
    }

    /// The rows of the buckets closed since the last call, oldest first.
    pub fn take_over_time(&mut self) -> Vec<OverTimeRow> {
        std::mem::take(&mut self.closed)
    }

    /// Close the last bucket (its rows then come from
    /// [`Aggregator::take_over_time`]) and give everything else.
    pub fn finish(&mut self) -> Aggregates {
        if let Some(current) = self.bucket {
            self.close_bucket(current);
        }
        let mut calls: Vec<(CallKey, CallStats)> =
            self.calls.iter().map(|(k, c)| (*k, c.stats)).collect();
        calls.sort_by_key(|(k, _)| *k);
        let mut out = Aggregates {
            calls,
            peak: self.peak,
            sizes: self.sizes.clone(),
            events: self.seq,
            last_event: self.last_event,
            last_ns: self.last_ns,
            ..Aggregates::default()
        };
        for (alloc_id, b) in self.live.iter() {
            if !self.exec_released.is_empty() && self.exec_released.contains(&alloc_id) {
                out.exec_released_blocks += 1;
                out.exec_released_bytes = out.exec_released_bytes.saturating_add(b.size);
            }
        }
        if self.peak_seq > 0 {
            for cell in &self.cells {
                let (blocks, bytes) = if cell.saved_for == self.peak_seq {
                    (cell.saved_blocks, cell.saved_bytes)
                } else {
                    (cell.blocks, cell.bytes)
                };
                if blocks > 0 || bytes > 0 {
                    out.at_peak.push(PeakRow {
                        stack: cell.stack,
                        thread: cell.thread,
                        blocks,
                        bytes,
                    });
                }
            }
        }
        out.at_peak.sort_by_key(|r| (r.stack, r.thread));
        out
    }

    /// The blocks live now and not released by an exec, by `alloc_id`:
    /// at the end, the leaks.
    pub fn live_blocks(&self) -> impl Iterator<Item = LiveBlock> + '_ {
        self.live
            .iter()
            .filter(|(alloc_id, _)| !self.exec_released.contains(alloc_id))
            .map(|(alloc_id, b)| {
                let cell = &self.cells[b.cell as usize];
                LiveBlock {
                    alloc_id,
                    ptr: b.ptr,
                    size: b.size,
                    stack: cell.stack,
                    thread: cell.thread,
                    op: b.op,
                    ts_ns: b.ts_ns,
                }
            })
    }
}
