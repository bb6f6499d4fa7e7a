//! The book of live blocks: turns a completed call into an [`Event`], pairs
//! each release with the allocation it ends, and keeps the live-heap total.
//! Pure bookkeeping, in the order calls took effect.

mod blocks;

use crate::event::{Event, Op};
use crate::heap::LiveBlock;
use blocks::LiveBlocks;

/// The raw facts of one call: its registers at entry and its result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallFacts {
    pub pid: u32,
    pub tid: u32,
    pub ts_ns: u64,
    /// rdi, rsi, rdx at entry (System V AMD64 ABI: the first three arguments).
    pub args: [u64; 3],
    /// rax at return (0 for free, which has no return stop).
    pub ret: u64,
    /// posix_memalign: the pointer it stored through its first argument.
    pub stored_ptr: u64,
}

#[derive(Default)]
pub struct Ledger {
    /// (pid, block) -> (event id of its allocation, size)
    live: LiveBlocks,
    next_id: u64,
    live_bytes: u64,
    events: u64,
}

/// The event for a call, and whether it released a block the ledger did not
/// know (allocated before the trace, a double free, or allocator housekeeping).
pub struct Completed {
    pub event: Event,
    pub unmatched_release: bool,
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    pub fn events(&self) -> u64 {
        self.events
    }

    /// True when `block` is a live block of process `pid`.
    pub fn is_live(&self, pid: u32, block: u64) -> bool {
        self.live.contains(pid, block)
    }

    pub fn complete(&mut self, op: Op, facts: &CallFacts) -> Completed {
        self.next_id += 1;
        self.events += 1;
        let [a0, a1, a2] = facts.args;
        let mut event = Event {
            id: self.next_id,
            ts_ns: facts.ts_ns,
            pid: facts.pid,
            tid: facts.tid,
            op,
            ptr: facts.ret,
            size: None,
            old_ptr: None,
            align: None,
            alloc_id: None,
            stack_id: None,
        };
        match op {
            Op::Malloc | Op::Valloc | Op::Pvalloc | Op::Inventory => event.size = Some(a0),
            Op::Calloc => event.size = a0.checked_mul(a1),
            Op::Realloc => {
                event.old_ptr = Some(a0);
                event.size = Some(a1);
            }
            Op::Reallocarray => {
                event.old_ptr = Some(a0);
                event.size = a1.checked_mul(a2);
            }
            Op::Free => event.ptr = a0,
            Op::PosixMemalign => {
                event.align = Some(a1);
                event.size = Some(a2);
                // It returns an error number; the block goes through *memptr.
                event.ptr = if facts.ret as u32 == 0 {
                    facts.stored_ptr
                } else {
                    0
                };
            }
            Op::AlignedAlloc | Op::Memalign => {
                event.align = Some(a0);
                event.size = Some(a1);
            }
        }

        let mut unmatched_release = false;
        let released = match op {
            Op::Free => (event.ptr != 0).then_some(event.ptr),
            Op::Realloc | Op::Reallocarray => event.released_old().then_some(a0),
            _ => None,
        };
        if let Some(block) = released {
            match self.live.remove(facts.pid, block) {
                Some((id, size)) => {
                    event.alloc_id = Some(id);
                    self.live_bytes = self.live_bytes.wrapping_sub(size);
                }
                None => unmatched_release = true,
            }
        }
        if op.allocates() && event.ptr != 0 {
            let size = event.size.unwrap_or(0);
            if let Some((_, old)) = self.live.insert(facts.pid, event.ptr, event.id, size) {
                // Handed out again without a traced release in between.
                self.live_bytes = self.live_bytes.wrapping_sub(old);
            }
            // Sizes come from the program (a record it wrote itself may
            // claim any): the sum wraps rather than panics, and what is
            // added is taken away again exactly.
            self.live_bytes = self.live_bytes.wrapping_add(size);
        }
        Completed {
            event,
            unmatched_release,
        }
    }

    /// The blocks live in process `pid` when memptrace attached, found by
    /// walking its heap: one `inventory` event each (size: the usable size;
    /// no stack), live from now on, so their frees pair with them.
    pub fn inventory(
        &mut self,
        pid: u32,
        tid: u32,
        ts_ns: u64,
        blocks: &[LiveBlock],
    ) -> Vec<Event> {
        // One growth, not twenty rehashes of a table of 100 000s.
        self.live.reserve(pid, blocks.len());
        blocks
            .iter()
            .map(|b| {
                let facts = CallFacts {
                    pid,
                    tid,
                    ts_ns,
                    args: [b.usable, 0, 0],
                    ret: b.addr,
                    stored_ptr: 0,
                };
                self.complete(Op::Inventory, &facts).event
            })
            .collect()
    }

    /// A process is gone: its blocks go with it. Returns how many there
    /// were ([`Ledger::forget_process`] without their ids).
    pub fn drop_process(&mut self, pid: u32) -> u64 {
        let (blocks, bytes) = self.live.drop_process(pid);
        self.live_bytes = self.live_bytes.wrapping_sub(bytes);
        blocks
    }

    /// A process is gone (or exec'd): its blocks go with it. Returns the
    /// event ids of their allocations, in id order.
    pub fn forget_process(&mut self, pid: u32) -> Vec<u64> {
        let mut ids = Vec::new();
        for (id, size) in self.live.forget(pid) {
            self.live_bytes = self.live_bytes.wrapping_sub(size);
            ids.push(id);
        }
        ids.sort_unstable();
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(args: [u64; 3], ret: u64) -> CallFacts {
        CallFacts {
            pid: 1,
            tid: 1,
            ts_ns: 0,
            args,
            ret,
            stored_ptr: 0,
        }
    }

    #[test]
    fn pairs_frees_and_reallocs() {
        let mut l = Ledger::new();
        let m = l.complete(Op::Malloc, &facts([100, 0, 0], 0x1000)).event;
        assert_eq!((m.size, m.ptr), (Some(100), 0x1000));
        assert!(l.is_live(1, 0x1000));
        assert!(!l.is_live(2, 0x1000));
        assert_eq!(l.live_bytes(), 100);

        // realloc moving the block releases the old one and allocates anew.
        let r = l
            .complete(Op::Realloc, &facts([0x1000, 200, 0], 0x2000))
            .event;
        assert_eq!(r.alloc_id, Some(m.id));
        assert_eq!(r.old_ptr, Some(0x1000));
        assert_eq!(l.live_bytes(), 200);

        // A failed realloc leaves the block alone.
        let f = l
            .complete(Op::Realloc, &facts([0x2000, u64::MAX, 0], 0))
            .event;
        assert_eq!(f.alloc_id, None);
        assert_eq!(l.live_bytes(), 200);

        // realloc(p, 0) returning NULL freed p (glibc).
        let z = l.complete(Op::Realloc, &facts([0x2000, 0, 0], 0));
        assert_eq!(z.event.alloc_id, Some(r.id));
        assert!(!z.unmatched_release);
        assert_eq!(l.live_bytes(), 0);

        let free_null = l.complete(Op::Free, &facts([0, 0, 0], 0));
        assert!(!free_null.unmatched_release);
        let unknown = l.complete(Op::Free, &facts([0x9000, 0, 0], 0));
        assert!(unknown.unmatched_release);
        assert_eq!(unknown.event.alloc_id, None);
    }

    #[test]
    fn records_sizes_per_op() {
        let mut l = Ledger::new();
        let c = l.complete(Op::Calloc, &facts([10, 24, 0], 0x10)).event;
        assert_eq!(c.size, Some(240));
        let overflow = l.complete(Op::Calloc, &facts([u64::MAX, 2, 0], 0)).event;
        assert_eq!(overflow.size, None);
        assert_eq!(overflow.ptr, 0);
        let mut pm = facts([0x7ff0, 64, 1000], 0);
        pm.stored_ptr = 0x40;
        let p = l.complete(Op::PosixMemalign, &pm).event;
        assert_eq!((p.ptr, p.size, p.align), (0x40, Some(1000), Some(64)));
        let mut failed = facts([0x7ff0, 3, 1000], libc::EINVAL as u64);
        failed.stored_ptr = 0x40;
        assert_eq!(l.complete(Op::PosixMemalign, &failed).event.ptr, 0);
        let a = l
            .complete(Op::AlignedAlloc, &facts([32, 64, 0], 0x80))
            .event;
        assert_eq!((a.size, a.align), (Some(64), Some(32)));
        let ra = l
            .complete(Op::Reallocarray, &facts([0x80, 4, 8], 0x100))
            .event;
        assert_eq!(ra.size, Some(32));
        assert_eq!(ra.alloc_id, Some(a.id));
        assert_eq!(l.live_bytes(), 240 + 1000 + 32);
        assert_eq!(l.forget_process(1), [c.id, p.id, ra.id]);
        assert_eq!(l.live_bytes(), 0);
    }

    #[test]
    fn a_process_dropped_leaves_the_ledger() {
        let mut l = Ledger::new();
        l.complete(Op::Malloc, &facts([100, 0, 0], 0x1000));
        l.complete(Op::Calloc, &facts([4, 10, 0], 0x2000));
        let mut other = facts([7, 0, 0], 0x1000);
        other.pid = 2;
        l.complete(Op::Malloc, &other);
        assert_eq!(l.live_bytes(), 147);
        assert_eq!(l.drop_process(1), 2);
        assert_eq!(l.live_bytes(), 7);
        assert!(!l.is_live(1, 0x1000) && l.is_live(2, 0x1000));
        assert_eq!(l.drop_process(1), 0);
    }

    #[test]
    fn inventory_blocks_pair_with_their_frees() {
        let mut l = Ledger::new();
        let blocks = [
            LiveBlock {
                addr: 0x1000,
                usable: 24,
            },
            LiveBlock {
                addr: 0x2000,
                usable: 1000,
            },
        ];
        let events = l.inventory(1, 1, 5, &blocks);
        assert_eq!(events.len(), 2);
        assert_eq!(
            (events[0].op, events[0].ptr, events[0].size),
            (Op::Inventory, 0x1000, Some(24))
        );
        assert_eq!(events[1].stack_id, None);
        assert_eq!(l.live_bytes(), 1024);
        let free = l.complete(Op::Free, &facts([0x2000, 0, 0], 0));
        assert_eq!(free.event.alloc_id, Some(events[1].id));
        assert!(!free.unmatched_release);
        assert_eq!(l.live_bytes(), 24);
        assert!(Op::ALL.iter().all(|&op| op != Op::Inventory));
        assert_eq!(Op::from_code(10), Some(Op::Inventory));
    }
}
