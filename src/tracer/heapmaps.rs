//! Heap maps the tracer takes ([`crate::heap`]), each stored as a
//! `heap_snapshots` row: at attach, where the blocks already live become
//! `inventory` events in the ledger (so their frees pair with them and
//! leaks and peak count them); at the exit of a traced process, stopped at
//! PTRACE_EVENT_EXIT with its memory still there (`ptrace(2)`); and at
//! detach, every thread stopped.
//!
//! A heap that cannot be mapped (musl, a stripped static binary, glibc
//! without symbols) is stored with its reason and changes nothing else: no
//! message, no failed trace. A heap that can, but whose arenas or mmapped
//! blocks do not read right (a program that wrote over its allocator's
//! state), is the program's damage, never memptrace's: each part not read
//! is counted (`heap_walk_errors`) and the map's first reason is a warning.

use std::panic::{AssertUnwindSafe, catch_unwind};

use super::process::Role;
use super::{TraceMsg, Tracer};
use crate::heap::{self, HeapMap};
use crate::os::ptrace::Tid;
use crate::sink::{HeapSnapshot, Record};

impl Tracer {
    /// At attach, every thread of `pid` stopped and the hooks in place:
    /// the blocks live now enter the trace, before any call it records.
    pub(super) fn take_inventory(&mut self, pid: Tid) {
        let ts_ns = self.now_ns();
        let map = read_heap(pid, true);
        if let Ok(map) = &map {
            let blocks = map.live_blocks();
            let events = self
                .ledger
                .inventory(pid as u32, pid as u32, ts_ns, &blocks);
            for event in events {
                self.send(TraceMsg::Record(Record::Event(event)));
            }
            self.progress.update(&self.ledger);
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
            let map = read_heap(tid, false);
            self.send_heap(tid, ts_ns, "exit", map);
        }
    }

    /// At detach, every thread of every traced process stopped.
    pub(super) fn map_heaps_at_detach(&mut self) {
        let mut pids: Vec<Tid> = self
            .family
            .processes
            .iter()
            .filter(|(_, p)| p.role == Role::Traced)
            .map(|(&pid, _)| pid)
            .collect();
        pids.sort_unstable();
        for pid in pids {
            let ts_ns = self.now_ns();
            let map = read_heap(pid, true);
            self.send_heap(pid, ts_ns, "detach", map);
        }
    }

    fn send_heap(&mut self, pid: Tid, ts_ns: u64, moment: &str, map: Result<HeapMap, String>) {
        if let Ok(map) = &map {
            let errors = walk_errors(map);
            if let Some(first) = errors.first() {
                self.stats.heap_walk_errors += errors.len() as u64;
                self.stats.warnings.push(format!(
                    "the heap map of process {pid} at {moment}: {} part(s) could not be read \
                     (the program's allocator state is damaged or was changing): {first}",
                    errors.len()
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

/// Map the heap of `pid`. The walk checks every word it reads; should it
/// panic all the same, the map is lost, never the trace.
fn read_heap(pid: Tid, stopped: bool) -> Result<HeapMap, String> {
    match catch_unwind(AssertUnwindSafe(|| heap::read_process(pid, stopped))) {
        Ok(map) => map.map_err(|e| e.to_string()),
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

/// Why each part of `map` was not read: its arenas, then its mmapped blocks.
fn walk_errors(map: &HeapMap) -> Vec<String> {
    map.arenas
        .iter()
        .filter_map(|a| Some(format!("arena {:#x}: {}", a.addr, a.error.as_deref()?)))
        .chain(
            map.mmapped_error
                .iter()
                .map(|e| format!("mmapped blocks: {e}")),
        )
        .collect()
}
