//! The order of what the jump probes recorded: every record carries the
//! sequence number its probe took from the address space's counter just
//! before it committed it (see [`crate::tracer::booking::rings`]), so the records read from
//! all the rings of a space, sorted by number, are the calls in the order
//! they took effect. [`Merge`] holds back what comes after a number not
//! seen yet, and lets a hole go after [`GAP_PATIENCE`] or once every
//! thread stands still; [`TscClock`] puts the probes' timestamps on the
//! trace's clock, never going back.
//!
//! The rings are read through [`Rings`], generic: the real one is the
//! control area (`probes::jump::control`), read in place; the tests' is
//! made of byte buffers (`merge_tests`). Nothing here panics or waits on
//! what the program wrote: the numbers and times are checked, and what
//! fails a check is counted as damage.

use std::time::{Duration, Instant};

use crate::os::local;
use crate::tracer::probes::jump::control::{Control, Damaged, Pulled};
use crate::tracer::probes::jump::decode;
use crate::tracer::probes::jump::layout::Called;

/// The rings of one address space, as the merge reads them.
pub trait Rings {
    /// Read the committed records of every ring in use into `out` (their
    /// room freed); `probe`: whether a probe of the space records an op.
    /// Returns how many were read.
    fn read_rings(&mut self, probe: &dyn Fn(u16, Called) -> bool, out: &mut Pulled) -> usize;

    /// The damage found in the rings, to be taken and counted.
    fn damaged(&mut self) -> &mut Damaged;
}

impl Rings for Control {
    fn read_rings(&mut self, probe: &dyn Fn(u16, Called) -> bool, out: &mut Pulled) -> usize {
        self.used_slots()
            .into_iter()
            .map(|(slot, tid)| self.pull(slot, tid, probe, out))
            .sum()
    }

    fn damaged(&mut self) -> &mut Damaged {
        &mut self.damaged
    }
}

/// What one reading of a space's rings gives.
#[derive(Debug, Default)]
pub struct Merged {
    /// The records to book now, in the order the calls took effect.
    pub ready: Pulled,
    /// Records read from the rings by this reading.
    pub read: usize,
    /// Sequence numbers given up on (never seen).
    pub skipped: u64,
    /// Damage found by this reading (the rings', and numbers refused).
    pub damaged: Damaged,
}

/// How long records wait for a missing sequence number.
pub const GAP_PATIENCE: Duration = Duration::from_millis(500);

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

impl Merge {
    /// Read every ring of `rings` and take, in order, what can be booked:
    /// the records up to the first number not seen yet; the rest wait in
    /// the merge. `settle`: every thread stands outside the probes, or is
    /// gone, so a number not seen now never will be (every hole is
    /// skipped); otherwise one hole is skipped once it has waited
    /// [`GAP_PATIENCE`] at `now`. Give `ready` back when it is booked
    /// ([`Merge::give_back`]): its room serves the next reading.
    pub fn read<R: Rings + ?Sized>(
        &mut self,
        rings: &mut R,
        probe: &dyn Fn(u16, Called) -> bool,
        settle: bool,
        now: Instant,
    ) -> Merged {
        let mut pulled = std::mem::take(&mut self.spare);
        pulled.extend_from(&self.held, &self.held.records);
        self.held.clear();
        let before = pulled.records.len();
        rings.read_rings(probe, &mut pulled);
        let read = pulled.records.len() - before;
        if read > 0 {
            pulled.records.sort_unstable_by_key(|r| r.seq);
        }
        let screened = decode::screen_seqs(&mut pulled.records, self.next);
        let damaged = rings.damaged();
        if screened > 0 {
            damaged.records += screened;
            let next = self.next;
            damaged.note(|| {
                format!("{screened} records numbered far past the next number {next}, or twice")
            });
        }
        let damaged = std::mem::take(damaged);
        let gaps = if settle {
            usize::MAX
        } else {
            usize::from(
                self.gap_since
                    .is_some_and(|t| now.saturating_duration_since(t) >= GAP_PATIENCE),
            )
        };
        let order = decode::in_order(pulled.records.iter().map(|r| r.seq), self.next, gaps);
        self.next = order.next;
        if order.waiting {
            if order.take > 0 || order.skipped > 0 {
                self.gap_since = Some(now);
            } else {
                self.gap_since.get_or_insert(now);
            }
        } else {
            self.gap_since = None;
        }
        self.held
            .extend_from(&pulled, &pulled.records[order.take..]);
        pulled.records.truncate(order.take);
        Merged {
            ready: pulled,
            read,
            skipped: order.skipped,
            damaged,
        }
    }

    /// The buffer of a reading's ready records, booked: kept, with its
    /// room, for the next reading.
    pub fn give_back(&mut self, mut ready: Pulled) {
        ready.clear();
        self.spare = ready;
    }

    /// The next sequence number to book.
    #[cfg(test)]
    pub fn next(&self) -> u64 {
        self.next
    }

    /// Records read and waiting for a number not seen yet.
    pub fn held(&self) -> usize {
        self.held.records.len()
    }
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

#[cfg(test)]
#[path = "merge_tests.rs"]
mod tests;
