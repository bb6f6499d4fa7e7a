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
use std::thread::JoinHandle;
use std::time::Instant;

use super::booking::Booking;
use super::booking::ledger::{CallFacts, Ledger};
use super::life::pauses::Pause;
use super::process::{Family, Role};
use super::{TraceMsg, TraceStats};
use crate::event::Op;
use crate::heap::{self, HeapCopy, HeapMap};
use crate::os::ptrace::Tid;
use crate::sink::{HeapSnapshot, Record};
use crate::trace_msg::CallStack;

/// The heap at attach, copied while the program waits, to be walked and
/// sent on once it runs again ([`HeapMaps::take_inventory`]).
pub(super) struct Inventory {
    pid: Tid,
    ts_ns: u64,
    copy: Result<HeapCopy, String>,
}

/// The attach's heap copy walked by a thread of its own (int3 probes), and
/// the calls completed meanwhile: booked after the inventory.
pub(super) struct Walking {
    pid: Tid,
    ts_ns: u64,
    walk: JoinHandle<Walked>,
    /// The attach's pause, stored once its inventory is booked.
    pause: Pause,
    started: Instant,
    calls: Vec<HeldCall>,
}

/// The heap at attach walked: its map, the ledger with its live blocks
/// booked (it was empty), and their `inventory` events.
struct Walked {
    pid: Tid,
    ts_ns: u64,
    map: Result<HeapMap, String>,
    ledger: Ledger,
    events: Vec<TraceMsg>,
}

impl Walked {
    /// No map: `why`. (The ledger was empty at attach, as this one is.)
    fn failed(pid: Tid, ts_ns: u64, why: String) -> Walked {
        Walked {
            pid,
            ts_ns,
            map: Err(why),
            ledger: Ledger::new(),
            events: Vec::new(),
        }
    }
}

/// A call completed while the heap was walked, to book after it.
pub(super) struct HeldCall {
    pub op: Op,
    pub facts: CallFacts,
    pub stack: CallStack,
    pub module_id: u64,
}

/// The heap maps of a trace: it owns what they need of C libraries (read
/// ahead by the namer) and the attach's walk while it runs; it books what
/// it maps through the trace's [`Booking`] and counts in its stats. Which
/// processes are traced is the caller's to say.
pub(super) struct HeapMaps {
    facts: heap::Facts,
    /// The attach's heap walked while the program runs (int3 probes).
    walking: Option<Walking>,
}

impl HeapMaps {
    pub fn new(facts: heap::Facts) -> HeapMaps {
        HeapMaps {
            facts,
            walking: None,
        }
    }

    /// At attach, every thread of `pid` stopped and the hooks in place:
    /// the heap as it is at this instant, copied.
    pub fn copy_heap(&self, book: &Booking, pid: Tid, buffers: heap::Buffers) -> Inventory {
        let ts_ns = book.now_ns();
        let copy =
            caught(|| heap::copy_process(pid, buffers, &self.facts).map_err(|e| e.to_string()));
        Inventory { pid, ts_ns, copy }
    }

    /// The program running again, before the wait loop books any call it
    /// made since: the copy walked, the blocks live at the attach enter the
    /// ledger first (their frees pair with them), and their events and the
    /// map go on. With jump probes the calls made meanwhile wait in the
    /// rings until the wait loop takes over. With int3 probes a call would
    /// wait at its breakpoint for all of it (150-250 ms of a 200 k-block
    /// heap): the walk and the ledger's inventory are made by a thread of
    /// their own ([`Walking`]), and the calls completed meanwhile are held
    /// back and booked after the inventory ([`HeapMaps::finish_inventory`]).
    /// Either way none is booked before the inventory and none is lost or
    /// counted twice: the copy is of the instant before any was recorded.
    pub fn take_inventory(
        &mut self,
        book: &mut Booking,
        stats: &mut TraceStats,
        inventory: Inventory,
        pause: Pause,
    ) {
        let started = Instant::now();
        if book.tsc.is_some() {
            let walked = walk_copy(inventory, std::mem::take(&mut book.ledger));
            book_inventory(book, stats, walked, pause, started);
            return;
        }
        let (pid, ts_ns) = (inventory.pid, inventory.ts_ns);
        // The ledger is empty at attach: the walk's thread fills it.
        let ledger = std::mem::take(&mut book.ledger);
        let walk = std::thread::Builder::new()
            .name("memptrace-walk".into())
            .spawn(move || walk_copy(inventory, ledger));
        match walk {
            Ok(walk) => {
                self.walking = Some(Walking {
                    pid,
                    ts_ns,
                    walk,
                    pause,
                    started,
                    calls: Vec::new(),
                });
            }
            Err(err) => {
                let why = format!("no thread to walk the heap: {err}");
                book_inventory(book, stats, Walked::failed(pid, ts_ns, why), pause, started);
            }
        }
    }

    /// The heap is being walked at attach (int3 probes): the calls
    /// completed until the inventory is booked wait in [`Walking`].
    pub fn walking(&self) -> bool {
        self.walking.is_some()
    }

    /// Hold back a call completed while the heap is walked; `None` if none
    /// is (the caller books it).
    pub fn hold_back(&mut self, call: HeldCall) -> Option<HeldCall> {
        match self.walking.as_mut() {
            Some(walking) => {
                walking.calls.push(call);
                None
            }
            None => Some(call),
        }
    }

    /// The attach's heap walk, if one runs: book it once done (`wait`:
    /// wait for it). Returns the calls held back meanwhile, in order, for
    /// the caller to book now.
    pub fn finish_inventory(
        &mut self,
        book: &mut Booking,
        stats: &mut TraceStats,
        wait: bool,
    ) -> Vec<HeldCall> {
        let done = self
            .walking
            .as_ref()
            .is_some_and(|w| wait || w.walk.is_finished());
        if !done {
            return Vec::new();
        }
        let Some(walking) = self.walking.take() else {
            return Vec::new();
        };
        let Walking {
            pid,
            ts_ns,
            walk,
            pause,
            started,
            calls,
        } = walking;
        // A walk that panicked is caught inside; a thread that died all
        // the same took the (empty) ledger with it.
        let walked = walk
            .join()
            .unwrap_or_else(|_| Walked::failed(pid, ts_ns, "the heap walk failed".into()));
        book_inventory(book, stats, walked, pause, started);
        calls
    }

    /// The main thread of traced process `pid` is exiting: its heap as it
    /// was left. Other threads may still be on their way out (and may have
    /// died inside the allocator), so arenas are read as in a live process.
    /// `done`: no call of it can be booked any more ([`Family::done_calling`]):
    /// its live blocks leave the ledger first, as they would once it is gone,
    /// so that the ledger and the map are not both held (71 MB and 134 MB of
    /// a 2.5 M-block heap).
    pub fn map_heap_at_exit(
        &self,
        book: &mut Booking,
        stats: &mut TraceStats,
        pid: Tid,
        done: bool,
    ) {
        if done {
            book.ledger.drop_process(pid as u32);
            // Its tables' pages, for the map's chunks.
            crate::os::own_heap::give_back_freed();
        }
        let ts_ns = book.now_ns();
        let map = read_heap(pid, &self.facts);
        send_heap(book, stats, pid, ts_ns, "exit", map);
    }

    /// Just after the detach, the processes `pids` running again. A
    /// running process changes its heap as memptrace reads it: an arena
    /// that looks damaged though no thread held it may have been read
    /// half-changed (a thread between its lock and the read, or in a
    /// `free` whose trim shrank the heap before `system_mem`), so it is read
    /// again, twice at most, before the damage is believed. The processes
    /// are let go and book no call again: their live blocks leave the
    /// ledger first, so that it and the maps are not both held.
    pub fn map_heaps_after_detach(
        &self,
        book: &mut Booking,
        stats: &mut TraceStats,
        pids: Vec<Tid>,
    ) {
        for &pid in &pids {
            book.ledger.drop_process(pid as u32);
        }
        crate::os::own_heap::give_back_freed();
        for pid in pids {
            let mut ts_ns = book.now_ns();
            let mut map = read_heap(pid, &self.facts);
            for _ in 0..2 {
                if !map.as_ref().is_ok_and(|m| damaged(m).is_some()) {
                    break;
                }
                ts_ns = book.now_ns();
                map = read_heap(pid, &self.facts);
            }
            send_heap(book, stats, pid, ts_ns, "detach", map);
        }
    }
}

impl Family {
    /// Process `pid`, its leader stopped at its exit with its rings drained,
    /// will book no call again: no other thread of it is left, no process
    /// runs in its memory (a vfork child), and no record of its probes is
    /// held back for one of another thread.
    pub fn done_calling(&self, pid: Tid) -> bool {
        let threads = self.threads.values().filter(|t| t.pid == pid).count();
        let sharers = self
            .processes
            .values()
            .any(|p| p.role == Role::Shares { parent: pid });
        let held = self.processes.get(&pid).map_or(0, |p| p.merge.held());
        threads <= 1 && !sharers && held == 0
    }

    /// The traced processes, whose heaps are mapped once they are let go.
    pub fn heaps_to_map(&self) -> Vec<Tid> {
        let mut pids: Vec<Tid> = self.traced().map(|(pid, _)| pid).collect();
        pids.sort_unstable();
        pids
    }
}

fn book_inventory(
    book: &mut Booking,
    stats: &mut TraceStats,
    walked: Walked,
    mut pause: Pause,
    started: Instant,
) {
    let Walked {
        pid,
        ts_ns,
        map,
        ledger,
        events,
    } = walked;
    book.ledger = ledger;
    book.progress
        .update(book.ledger.events(), book.ledger.live_bytes());
    // 150 000 events in one piece: pushed one by one, the batch grew
    // by copies (and before, handing them over waited for the
    // pipeline: a third of the attach's stop when it was in it).
    book.out.append(events);
    send_heap(book, stats, pid, ts_ns, "attach", map);
    pause.after = Some(("inventory", started.elapsed()));
    stats.pauses.push(pause);
}

fn send_heap(
    book: &mut Booking,
    stats: &mut TraceStats,
    pid: Tid,
    ts_ns: u64,
    moment: &str,
    map: Result<HeapMap, String>,
) {
    if let Ok(map) = &map {
        let errors = walk_errors(map);
        stats.heap_walk_errors += errors;
        if let Some(a) = damaged(map) {
            stats.warnings.push(format!(
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
    book.send(TraceMsg::Record(Record::Heap(Box::new(snapshot))));
}

/// An arena of `map` that could not be read though no thread held it: its
/// heap is damaged. A free mutex proves nothing where glibc takes none: a
/// process that never made a thread (it has no arena but the main one) runs
/// the allocator unlocked, and a thread stopped inside it leaves the main
/// arena half-changed, not damaged.
fn damaged(map: &HeapMap) -> Option<&crate::heap::Arena> {
    let locks = map.arenas.len() > 1;
    map.arenas
        .iter()
        .find(|a| a.error.is_some() && !a.locked && !a.changing && (locks || !a.main))
}

/// Walk the heap copied at attach and book the blocks live in it in
/// `ledger` (the tracer's, empty at attach).
fn walk_copy(inventory: Inventory, mut ledger: Ledger) -> Walked {
    let Inventory { pid, ts_ns, copy } = inventory;
    let map = copy.and_then(|copy| caught(|| Ok(copy.walk())));
    let events = match &map {
        Ok(map) => ledger
            .inventory(pid as u32, pid as u32, ts_ns, &map.live_blocks())
            .into_iter()
            .map(|event| TraceMsg::Record(Record::Event(event)))
            .collect(),
        Err(_) => Vec::new(),
    };
    Walked {
        pid,
        ts_ns,
        map,
        ledger,
        events,
    }
}

/// Map the heap of `pid`, read as a running process's.
fn read_heap(pid: Tid, facts: &heap::Facts) -> Result<HeapMap, String> {
    caught(|| heap::read_process(pid, false, facts).map_err(|e| e.to_string()))
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::tracer::booking::merge::TscClock;

    const PID: Tid = 4242;

    fn pause() -> Pause {
        Pause {
            kind: "attach",
            total: Duration::from_millis(3),
            phases: Vec::new(),
            after: None,
        }
    }

    /// A heap that could not be copied at attach (`why`).
    fn uncopied(why: &str) -> Inventory {
        Inventory {
            pid: PID,
            ts_ns: 77,
            copy: Err(why.to_string()),
        }
    }

    fn call(ptr: u64) -> HeldCall {
        HeldCall {
            op: Op::Malloc,
            facts: CallFacts {
                pid: PID as u32,
                tid: PID as u32,
                ts_ns: 100,
                args: [16, 0, 0],
                ret: ptr,
                stored_ptr: 0,
            },
            stack: CallStack::CallerOnly(0x401000),
            module_id: 1,
        }
    }

    /// The heap snapshots sent to the pipeline, as (pid, ts, moment, error).
    fn snapshots(
        book: &mut Booking,
        rx: &crate::queue::Receiver<Vec<TraceMsg>>,
    ) -> Vec<(u32, u64, String, Option<String>)> {
        book.out.send_ready(true).expect("the queue is open");
        let (msgs, _permit) = rx.recv().expect("a batch");
        msgs.into_iter()
            .filter_map(|msg| match msg {
                TraceMsg::Record(Record::Heap(s)) => Some((s.pid, s.ts_ns, s.moment, s.map.err())),
                _ => None,
            })
            .collect()
    }

    /// The one snapshot of a heap [`uncopied`] at attach.
    fn not_mapped_at_attach() -> Vec<(u32, u64, String, Option<String>)> {
        let why = Some("no glibc".to_string());
        vec![(PID as u32, 77, "attach".to_string(), why)]
    }

    #[test]
    fn without_a_walk_a_call_is_not_held_back() {
        let mut heaps = HeapMaps::new(heap::Facts::default());
        assert!(!heaps.walking());
        let (mut book, _rx) = Booking::for_tests(None);
        let mut stats = TraceStats::default();
        assert!(
            heaps
                .finish_inventory(&mut book, &mut stats, true)
                .is_empty()
        );
        assert_eq!(
            heaps.hold_back(call(0x1000)).map(|c| c.facts.ret),
            Some(0x1000)
        );
        assert!(stats.pauses.is_empty());
    }

    #[test]
    fn with_jump_probes_the_inventory_is_booked_at_once() {
        let mut heaps = HeapMaps::new(heap::Facts::default());
        let (mut book, rx) = Booking::for_tests(Some(TscClock::calibrate(|| 0)));
        let mut stats = TraceStats::default();
        heaps.take_inventory(&mut book, &mut stats, uncopied("no glibc"), pause());
        assert!(!heaps.walking(), "the calls wait in the rings instead");
        assert_eq!(stats.pauses.len(), 1);
        assert_eq!(
            stats.pauses[0].after.map(|(what, _)| what),
            Some("inventory")
        );
        assert_eq!(snapshots(&mut book, &rx), not_mapped_at_attach());
        assert_eq!(
            stats.heap_walk_errors, 0,
            "a heap not mapped is no walk error"
        );
    }

    #[test]
    fn with_int3_probes_calls_wait_for_the_walk_and_come_back_in_order() {
        let mut heaps = HeapMaps::new(heap::Facts::default());
        let (mut book, rx) = Booking::for_tests(None);
        let mut stats = TraceStats::default();
        heaps.take_inventory(&mut book, &mut stats, uncopied("no glibc"), pause());
        assert!(heaps.walking());
        assert!(heaps.hold_back(call(0x1000)).is_none());
        assert!(heaps.hold_back(call(0x2000)).is_none());
        assert!(stats.pauses.is_empty(), "booked once the walk is done");
        let held = heaps.finish_inventory(&mut book, &mut stats, true);
        let rets: Vec<u64> = held.iter().map(|c| c.facts.ret).collect();
        assert_eq!(rets, [0x1000, 0x2000]);
        assert!(!heaps.walking());
        assert_eq!(stats.pauses.len(), 1);
        assert_eq!(snapshots(&mut book, &rx), not_mapped_at_attach());
        // The walk is over: a call is booked by the caller again.
        assert!(heaps.hold_back(call(0x3000)).is_some());
    }
}
