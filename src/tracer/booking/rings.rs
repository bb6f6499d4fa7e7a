//! What the jump probes recorded: read from every thread's ring, put back
//! in the order the calls took effect ([`crate::tracer::booking::merge`]), and booked like
//! the calls the int3 probes catch.
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

use std::time::Instant;

use crate::os::ptrace::Tid;
use crate::tracer::TraceStats;
use crate::tracer::booking::Booking;
use crate::tracer::process::Family;

impl Booking {
    /// Read the rings of every process and book what can be booked in order.
    /// `settle`: every thread stands outside the probes, or is gone, so a
    /// number not seen now never will be. Returns the records read.
    pub(in crate::tracer) fn drain_rings(
        &mut self,
        family: &mut Family,
        stats: &mut TraceStats,
        settle: bool,
    ) -> usize {
        let pids: Vec<Tid> = family
            .processes
            .iter()
            .filter(|(_, p)| p.space.as_ref().is_some_and(|s| s.control().is_some()))
            .map(|(&pid, _)| pid)
            .collect();
        pids.into_iter()
            .map(|pid| self.drain_process(family, stats, pid, settle))
            .sum()
    }

    /// [`Booking::drain_rings`] for one process.
    pub(in crate::tracer) fn drain_process(
        &mut self,
        family: &mut Family,
        stats: &mut TraceStats,
        pid: Tid,
        settle: bool,
    ) -> usize {
        let Some(process) = family.processes.get_mut(&pid) else {
            return 0;
        };
        let Some((control, probes)) = process.space.as_mut().and_then(|s| s.recording_mut()) else {
            return 0;
        };
        let probe = |id: u16, what| probes.get(usize::from(id)).is_some_and(|p| p.records(what));
        let mut merged = process.merge.read(control, &probe, settle, Instant::now());
        stats.skipped_records = stats.skipped_records.saturating_add(merged.skipped);
        stats.damaged.add(&merged.damaged);
        // Every record read was committed before now.
        let now_ns = self.now_ns();
        for record in &merged.ready.records {
            self.book_record(
                family,
                &mut stats.damaged,
                pid,
                record,
                merged.ready.frames(record),
                now_ns,
            );
            // One reading can bring thousands of calls (a ring holds 1 MiB):
            // what is ready goes in batches of the usual size, so that what
            // waits for the pipeline and the recorder stays bounded. (If the
            // pipeline is gone, the wait loop's next flush says so; calls
            // of int3 probes waiting for their stack copies are settled
            // there too.)
            if self.out.full() {
                let _ = self.out.send_ready(false);
            }
        }
        merged.ready.clear();
        if let Some(process) = family.processes.get_mut(&pid) {
            process.merge.give_back(merged.ready);
        }
        merged.read
    }

    /// A thread is about to exit: what it recorded is read, and its slots
    /// go to the threads to come.
    pub(in crate::tracer) fn release_slots(
        &mut self,
        family: &mut Family,
        stats: &mut TraceStats,
        tid: Tid,
    ) {
        let Some(pid) = family.owner_of(tid) else {
            return;
        };
        self.drain_process(family, stats, pid, false);
        if let Some(control) = family.space_mut(pid).and_then(|s| s.control_mut()) {
            control.release_all_of(tid);
        }
    }
}

impl TraceStats {
    /// Add what the control area of process `pid` counted to the trace's
    /// counts (the process is going, or the trace ends): calls seen but not
    /// recorded (nested in a call), and calls left by a longjmp.
    pub(in crate::tracer) fn count_probes(&mut self, family: &mut Family, pid: Tid) {
        let control = family
            .processes
            .get_mut(&pid)
            .and_then(|p| p.space.as_mut()?.control_mut());
        if let Some(c) = control {
            let (nested, abandoned, waits) = c.live_counts();
            let damaged = std::mem::take(&mut c.damaged);
            self.nested_calls = self
                .nested_calls
                .saturating_add(c.nested.saturating_add(nested));
            self.lost_returns = self
                .lost_returns
                .saturating_add(c.abandoned.saturating_add(abandoned));
            self.ring_waits = self
                .ring_waits
                .saturating_add(c.waits.saturating_add(waits));
            self.damaged.add(&damaged);
            self.let_through = self.let_through.saturating_add(c.let_through());
        }
    }
}
