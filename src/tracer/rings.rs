//! What the jump probes recorded: read from every thread's ring, put back
//! in the order the calls took effect, and booked like the calls the int3
//! probes catch.
//!
//! Each record carries a sequence number the probe took from the address
//! space's counter (`lock xadd`) just before it committed the record, so
//! the numbers of one address space have no holes, each thread's records
//! come in increasing order, and sorting by number gives the order in
//! which the calls took effect (a block is freed before another thread can
//! get it from malloc). A number not seen yet is a record some thread is
//! committing: the records after it wait for it, briefly. Only a thread
//! stopped for good between the two instructions can keep a number away
//! (a signal handler that longjmps out of a probe): after a while, or once
//! every thread stands still outside the probes, the hole is skipped.

use std::time::{Duration, Instant};

use super::Tracer;
use super::ledger::CallFacts;
use super::probes::jump::control::{Damaged, Pulled, Record};
use super::probes::jump::decode;
use super::probes::jump::layout::{Called, record};
use crate::os::local;
use crate::os::ptrace::Tid;
use crate::trace_msg::WalkEnd;

/// How long records wait for a missing sequence number.
const GAP_PATIENCE: Duration = Duration::from_millis(500);

/// How far outside the trace a probe's timestamp may seem to lie (the
/// counter's rate is measured, and the cores' counters may differ a
/// little) before it is taken as written by the program.
pub const CLOCK_SLACK: Duration = Duration::from_secs(1);

/// Records of one address space waiting for their turn.
#[derive(Debug, Default)]
pub struct Merge {
    /// Sorted by sequence number; the first is above `next`.
    held: Pulled,
    /// The buffer records are read into, kept with its room from one
    /// reading to the next (a fresh one grew, and faulted in its pages,
    /// every time: a tenth of the tracer thread's time).
    spare: Pulled,
    /// The next sequence number to record.
    next: u64,
    /// Since when the first held record waits for a missing number.
    gap_since: Option<Instant>,
}

/// The probes' clock (the CPU's time-stamp counter) in the trace's
/// nanoseconds: measured against the trace's clock at the start and again
/// as the trace goes on, and never going back.
#[derive(Debug)]
pub struct TscClock {
    tsc0: u64,
    ns0: u64,
    ticks_per_ns: f64,
    last_ns: u64,
}

impl TscClock {
    /// Calibrate against `now_ns` (the trace's clock), over a few
    /// milliseconds.
    pub fn calibrate(now_ns: impl Fn() -> u64) -> TscClock {
        let (ns0, tsc0) = (now_ns(), local::tsc());
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(5) {
            std::hint::spin_loop();
        }
        let mut clock = TscClock {
            tsc0,
            ns0,
            ticks_per_ns: 1.0,
            last_ns: 0,
        };
        clock.refine(now_ns(), local::tsc());
        clock
    }

    /// Measure the rate again over the whole trace so far.
    pub fn refine(&mut self, now_ns: u64, tsc: u64) {
        let (ns, ticks) = (
            now_ns.saturating_sub(self.ns0),
            tsc.saturating_sub(self.tsc0),
        );
        if ns > 0 && ticks > 0 {
            self.ticks_per_ns = ticks as f64 / ns as f64;
        }
    }

    /// Counter ticks in `d`, at the rate measured so far.
    pub fn ticks_in(&self, d: Duration) -> u64 {
        (self.ticks_per_ns * d.as_nanos() as f64) as u64
    }

    /// The trace time of counter value `tsc`, read by memptrace at trace
    /// time `now_ns` (or later): never past `now_ns`, nor before the last
    /// time given. `None` for a value that lies more than [`CLOCK_SLACK`]
    /// outside the trace: a time the program wrote, not a probe.
    pub fn ns_within(&mut self, tsc: u64, now_ns: u64) -> Option<u64> {
        let ticks = i128::from(tsc) - i128::from(self.tsc0);
        let ns = self.ns0 as f64 + ticks as f64 / self.ticks_per_ns;
        let slack = CLOCK_SLACK.as_nanos() as f64;
        if !(ns >= self.ns0 as f64 - slack && ns <= now_ns as f64 + slack) {
            return None;
        }
        // In range: the float fits (saturating `as` for the rest).
        let ns = (ns.max(0.0) as u64).min(now_ns).max(self.last_ns);
        self.last_ns = ns;
        Some(ns)
    }
}

impl Tracer {
    /// Read the rings of every process and book what can be booked in order.
    /// `settle`: every thread stands outside the probes, or is gone, so a
    /// number not seen now never will be. Returns the records read.
    pub(super) fn drain_rings(&mut self, settle: bool) -> usize {
        let pids: Vec<Tid> = self
            .family
            .processes
            .iter()
            .filter(|(_, p)| p.space.as_ref().is_some_and(|s| s.control().is_some()))
            .map(|(&pid, _)| pid)
            .collect();
        pids.into_iter()
            .map(|pid| self.drain_process(pid, settle))
            .sum()
    }

    /// [`Tracer::drain_rings`] for one process.
    pub(super) fn drain_process(&mut self, pid: Tid, settle: bool) -> usize {
        let Some(process) = self.family.processes.get_mut(&pid) else {
            return 0;
        };
        let Some((control, probes)) = process.space.as_mut().and_then(|s| s.recording_mut()) else {
            return 0;
        };
        let probe = |id: u16, what| probes.get(usize::from(id)).is_some_and(|p| p.records(what));
        let merge = &mut process.merge;
        let mut pulled = std::mem::take(&mut merge.spare);
        pulled.extend_from(&merge.held, &merge.held.records);
        merge.held.clear();
        let before = pulled.records.len();
        for (slot, tid) in control.used_slots() {
            control.pull(slot, tid, &probe, &mut pulled);
        }
        let read = pulled.records.len() - before;
        if read > 0 {
            pulled.records.sort_unstable_by_key(|r| r.seq);
        }
        let screened = decode::screen_seqs(&mut pulled.records, merge.next);
        if screened > 0 {
            control.damaged.records += screened;
            let next = merge.next;
            control.damaged.note(|| {
                format!("{screened} records numbered far past the next number {next}, or twice")
            });
        }
        let damaged = std::mem::take(&mut control.damaged);
        // Every gap is skipped once the threads stand still; else one, once
        // it has waited long enough.
        let gaps = if settle {
            usize::MAX
        } else {
            usize::from(merge.gap_since.is_some_and(|t| t.elapsed() >= GAP_PATIENCE))
        };
        let order = decode::in_order(pulled.records.iter().map(|r| r.seq), merge.next, gaps);
        merge.next = order.next;
        if order.waiting {
            if order.take > 0 || order.skipped > 0 {
                merge.gap_since = Some(Instant::now());
            } else {
                merge.gap_since.get_or_insert_with(Instant::now);
            }
        } else {
            merge.gap_since = None;
        }
        merge
            .held
            .extend_from(&pulled, &pulled.records[order.take..]);
        pulled.records.truncate(order.take);
        self.stats.skipped_records = self.stats.skipped_records.saturating_add(order.skipped);
        self.stats.damaged.add(&damaged);
        // Every record read was committed before now.
        let now_ns = self.now_ns();
        for record in &pulled.records {
            self.book_record(pid, record, pulled.frames(record), now_ns);
            // One reading can bring thousands of calls (a ring holds 1 MiB):
            // they go in batches of the usual size, so that what waits for
            // the pipeline and the recorder stays bounded. (If the pipeline
            // is gone, the wait loop's next flush says so.)
            if self.out.full() {
                let _ = self.flush();
            }
        }
        pulled.clear();
        if let Some(process) = self.family.processes.get_mut(&pid) {
            process.merge.spare = pulled;
        }
        read
    }

    /// Book one record of process `pid`, with its frames.
    fn book_record(&mut self, pid: Tid, r: &Record, frames: &[u64], now_ns: u64) {
        let Some(space) = self
            .family
            .processes
            .get(&pid)
            .and_then(|p| p.space.as_ref())
        else {
            return;
        };
        let Some(info) = space.probe_info(r.probe) else {
            return;
        };
        let module_id = info.module_id;
        let ops = (info.ops.len() > 1).then(|| info.ops.clone());
        let caller = frames.first().copied().unwrap_or(0);
        let ts_ns = match self.tsc.as_mut() {
            Some(clock) => match clock.ns_within(r.tsc, now_ns) {
                Some(ns) => ns,
                None => {
                    self.stats.damaged.add(&Damaged {
                        records: 1,
                        first: Some(format!(
                            "thread {}: a record stamped outside the trace (counter {})",
                            r.tid, r.tsc
                        )),
                        ..Damaged::default()
                    });
                    return;
                }
            },
            None => now_ns,
        };
        let op = match (r.what, ops) {
            (Called::Map(op), _) => return self.book_map(pid, r, op, frames, ts_ns),
            (Called::Alloc(_), Some(ops)) => self.alias(pid, &ops, caller),
            (Called::Alloc(op), None) => op,
        };
        let facts = CallFacts {
            pid: pid as u32,
            tid: r.tid as u32,
            ts_ns,
            args: [r.args[0], r.args[1], r.args[2]],
            ret: r.ret,
            stored_ptr: r.stored,
        };
        // `--stack-every N`: every Nth call of a call site keeps its stack
        // (as the int3 probes unwind it), and so does every release of a
        // block not known to be live, which may be the allocator's own
        // housekeeping (told apart by its whole stack).
        // (The ledger's lookup only when it decides: a free's block is looked
        // up once more in `complete`, and these lookups miss the cache.)
        let whole = self.opts.stacks
            && (self.opts.stack_every <= 1
                || (op.takes_block()
                    && r.args[0] != 0
                    && !self.ledger.is_live(pid as u32, r.args[0]))
                || self.sampled(pid, caller));
        let end = if r.flags & record::TRUNCATED != 0 {
            WalkEnd::Failed
        } else {
            WalkEnd::Outermost
        };
        let done = self.ledger.complete(op, &facts);
        self.progress
            .update(self.ledger.events(), self.ledger.live_bytes());
        self.out.push_frames(
            done.event,
            frames,
            end,
            !whole,
            module_id,
            done.unmatched_release,
        );
    }

    /// A thread is about to exit: what it recorded is read, and its slots
    /// go to the threads to come.
    pub(super) fn release_slots(&mut self, tid: Tid) {
        let Some(pid) = self.family.owner_of(tid) else {
            return;
        };
        self.drain_process(pid, false);
        let control = self
            .family
            .processes
            .get_mut(&pid)
            .and_then(|p| p.space.as_mut())
            .and_then(|s| s.control_mut());
        if let Some(control) = control {
            for slot in control.slots_of(tid) {
                control.release(slot);
            }
        }
    }

    /// Add what the control area of process `pid` counted to the trace's
    /// counts (the process is going, or the trace ends): calls seen but not
    /// recorded (nested in a call), and calls left by a longjmp.
    pub(super) fn count_probes(&mut self, pid: Tid) {
        let control = self
            .family
            .processes
            .get_mut(&pid)
            .and_then(|p| p.space.as_mut()?.control_mut());
        if let Some(c) = control {
            let (nested, abandoned, waits) = c.live_counts();
            let damaged = std::mem::take(&mut c.damaged);
            let stats = &mut self.stats;
            stats.nested_calls = stats
                .nested_calls
                .saturating_add(c.nested.saturating_add(nested));
            stats.lost_returns = stats
                .lost_returns
                .saturating_add(c.abandoned.saturating_add(abandoned));
            stats.ring_waits = stats
                .ring_waits
                .saturating_add(c.waits.saturating_add(waits));
            stats.damaged.add(&damaged);
            stats.let_through = stats.let_through.saturating_add(c.let_through());
        }
    }
}
