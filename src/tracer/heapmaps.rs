//! Heap maps the tracer takes ([`crate::heap`]), each stored as a
//! `heap_snapshots` row: at attach, where the blocks already live become
//! `inventory` events in the ledger (so their frees pair with them and
//! leaks and peak count them), copied while every thread is stopped and
//! walked once they run again, before any call is read; at the exit of a
//! traced process, stopped at PTRACE_EVENT_EXIT with its memory still
//! there (`ptrace(2)`); and just after the detach, the program running
//! again: read as a live process's heap (each arena copied while its mutex
//! is free), so that a large heap does not lengthen the detach's stop (it
//! took 220-330 ms of a 200 k-block heap's, docs/performance.md).
//!
//! A heap that cannot be mapped (musl, a stripped static binary, glibc
//! without symbols) is stored with its reason and changes nothing else: no
//! message, no failed trace. A heap that can, but whose arenas or mmapped
//! blocks do not read right, is the program's business, never memptrace's
//! failure: each part not read is counted (`heap_walk_errors`). Most are a
//! call in flight (a thread stopped inside the allocator holds its arena's
//! mutex); an arena that fails while no thread held it was damaged (a
//! program that wrote over its allocator's state), and that is a warning.

use std::panic::{AssertUnwindSafe, catch_unwind};

use super::process::Role;
use super::{TraceMsg, Tracer};
use crate::heap::{self, HeapCopy, HeapMap};
use crate::os::ptrace::Tid;
use crate::sink::{HeapSnapshot, Record};

/// The heap at attach, copied while the program waits, to be walked and
/// sent on once it runs again ([`Tracer::take_inventory`]).
pub(super) struct Inventory {
    pid: Tid,
    ts_ns: u64,
    copy: Result<HeapCopy, String>,
}

impl Tracer {
    /// At attach, every thread of `pid` stopped and the hooks in place:
    /// the heap as it is at this instant, copied.
    pub(super) fn copy_heap(&mut self, pid: Tid, buffers: heap::Buffers) -> Inventory {
        let ts_ns = self.now_ns();
        let copy = caught(|| heap::copy_process(pid, buffers).map_err(|e| e.to_string()));
        Inventory { pid, ts_ns, copy }
    }

    /// The program running again, before the wait loop reads any call it
    /// made since: the copy walked, the blocks live at the attach enter the
    /// ledger first (their frees pair with them), and their events and the
    /// map go on. The calls made meanwhile wait in the rings (jump probes)
    /// or at their breakpoint (int3) until the wait loop takes over, so
    /// none is booked before the inventory and none is lost or counted
    /// twice: the copy is of the instant before any was recorded.
    pub(super) fn take_inventory(&mut self, inventory: Inventory) {
        let Inventory { pid, ts_ns, copy } = inventory;
        let map = copy.and_then(|copy| caught(|| Ok(copy.walk())));
        if let Ok(map) = &map {
            let blocks = map.live_blocks();
            let events = self
                .ledger
                .inventory(pid as u32, pid as u32, ts_ns, &blocks);
            self.progress.update(&self.ledger);
            // Handing 200 k events to the pipeline waits for it to make
            // room: a third of the attach's stop when it was in it.
            for event in events {
                self.send(TraceMsg::Record(Record::Event(event)));
            }
        }
        self.send_heap(pid, ts_ns, "attach", map);
    }

    /// The main thread of a traced process is exiting: its heap as it was
    /// left. Other threads may still be on their way out (and may have
    /// died inside the allocator), so arenas are read as in a live process.
    pub(super) fn map_heap_at_exit(&mut self, tid: Tid) {
        let traced = self
            .family
            .processes
            .get(&tid)
            .is_some_and(|p| p.role == Role::Traced);
        if traced {
            let ts_ns = self.now_ns();
            let map = read_heap(tid);
            self.send_heap(tid, ts_ns, "exit", map);
        }
    }

    /// The traced processes, whose heaps are mapped once they are let go.
    pub(super) fn heaps_to_map(&self) -> Vec<Tid> {
        let mut pids: Vec<Tid> = self
            .family
            .processes
            .iter()
            .filter(|(_, p)| p.role == Role::Traced)
            .map(|(&pid, _)| pid)
            .collect();
        pids.sort_unstable();
        pids
    }

    /// Just after the detach, the processes `pids` running again.
    pub(super) fn map_heaps_after_detach(&mut self, pids: Vec<Tid>) {
        for pid in pids {
            let ts_ns = self.now_ns();
            let map = read_heap(pid);
            self.send_heap(pid, ts_ns, "detach", map);
        }
    }

    fn send_heap(&mut self, pid: Tid, ts_ns: u64, moment: &str, map: Result<HeapMap, String>) {
        if let Ok(map) = &map {
            let errors = walk_errors(map);
            self.stats.heap_walk_errors += errors;
            // A free mutex proves nothing where glibc takes none: a process
            // that never made a thread (it has no arena but the main one)
            // runs the allocator unlocked, and a thread stopped inside it
            // leaves the main arena half-changed, not damaged.
            let locks = map.arenas.len() > 1;
            let damaged = map
                .arenas
                .iter()
                .find(|a| a.error.is_some() && !a.locked && !a.changing && (locks || !a.main));
            if let Some(a) = damaged {
                self.stats.warnings.push(format!(
                    "the heap map of process {pid} at {moment}: {errors} part(s) could not be read; \
                     arena {:#x}, which no thread held, is damaged: {}",
                    a.addr,
                    a.error.as_deref().unwrap_or_default()
                ));
            }
        }
        let snapshot = HeapSnapshot {
            ts_ns,
            pid: pid as u32,
            moment: moment.to_string(),
            map,
        };
        self.send(TraceMsg::Record(Record::Heap(Box::new(snapshot))));
    }
}

/// Map the heap of `pid`, read as a running process's.
fn read_heap(pid: Tid) -> Result<HeapMap, String> {
    caught(|| heap::read_process(pid, false).map_err(|e| e.to_string()))
}

/// What `f` returns. The walk checks every word it reads; should it panic
/// all the same, the map is lost, never the trace.
fn caught<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(done) => done,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(format!("the heap walk failed: {what}"))
        }
    }
}

/// Parts of `map` not read: its arenas that failed, and its mmapped blocks.
fn walk_errors(map: &HeapMap) -> u64 {
    let arenas = map.arenas.iter().filter(|a| a.error.is_some()).count() as u64;
    arenas + u64::from(map.mmapped_error.is_some())
}
