//! The lifecycle of what is traced: threads attached and stopped, children
//! born, forked and exec'd, and everything let go at the detach. It runs
//! over the [`Target`] port, so each step is tested on the fake target.
//!
//! [`Life`] borrows what a lifecycle step touches for one stop: the
//! processes and threads, the stops queued, the events booked, the stats,
//! how the trace is going (`Control`), and the target. It leaves out the
//! heap maps, which are read once the threads are let go.

pub(super) mod attach;
pub(super) mod children;
#[cfg(test)]
mod children_tests;
pub(super) mod detach;
pub(super) mod dying;
pub(super) mod failopen;
pub(super) mod failure;
pub mod pauses;
pub(super) mod stopping;
#[cfg(test)]
mod tests;

use crate::os::ptrace::{Stop, Tid};
use crate::trace_msg::TraceMsg;
use crate::tracer::booking::Booking;
use crate::tracer::images::Images;
use crate::tracer::process::Family;
use crate::tracer::space::Catch;
use crate::tracer::stops::Stops;
use crate::tracer::target::Target;
use crate::tracer::{Control, Ending, TraceError, TraceOptions, TraceStats};

/// The parts a lifecycle step concerns, borrowed for one step.
pub(super) struct Life<'a, T: Target> {
    pub opts: &'a TraceOptions,
    pub family: &'a mut Family,
    pub stops: &'a mut Stops,
    pub book: &'a mut Booking,
    pub stats: &'a mut TraceStats,
    pub control: &'a mut Control,
    pub target: &'a mut T,
}

impl<T: Target> Life<'_, T> {
    /// The parts images concern (see [`crate::tracer::images`]).
    pub fn images(&mut self) -> Images<'_> {
        Images {
            opts: self.opts,
            family: self.family,
            book: self.book,
            stats: self.stats,
        }
    }

    /// The age of a heartbeat at which the probes count memptrace as gone
    /// (see [`crate::tracer::life::failopen`]).
    pub fn alive_ticks(&self) -> u64 {
        failopen::alive_ticks(self.book.tsc.as_ref(), self.control.attached)
    }

    /// How the allocator functions of a new address space are caught.
    pub fn catch(&self) -> Catch {
        self.opts.catch(self.alive_ticks())
    }

    /// Thread `tid` is gone (`stop`: how it ended). When it is a process's
    /// leader, the process is: its calls are drained, its probes counted,
    /// its blocks forgotten and the memory it shared released; when it is
    /// the root, the trace ends as it did.
    pub fn thread_gone(&mut self, tid: Tid, stop: Stop) -> Result<(), TraceError> {
        self.book.settle_copy(self.family, self.target, tid, false);
        self.stops.forget(tid);
        if let Some(b) = self.family.space_of_mut(tid).and_then(|s| s.buffers_mut()) {
            b.release(tid);
        }
        if self.family.pid_of(tid) == Some(tid) {
            self.family.end_sharing(tid);
        }
        let Some(mut thread) = self.family.threads.remove(&tid) else {
            return Ok(());
        };
        if let Some(lu) = self
            .family
            .processes
            .get_mut(&thread.pid)
            .and_then(|p| p.libunwind.as_mut())
        {
            lu.forget_thread(tid);
        }
        self.stats.lost_returns += thread.take_calls().len() as u64;
        if tid != thread.pid {
            return Ok(());
        }
        // The leader's exit is reported last: the whole process is gone.
        self.images().warn_if_unhooked(tid);
        self.book.drain_process(self.family, self.stats, tid, true);
        self.stats.count_probes(self.family, tid);
        for t in self.family.threads_of(tid) {
            self.book.settle_copy(self.family, self.target, t, false);
            self.family.threads.remove(&t);
        }
        if let Some(process) = self.family.processes.remove(&tid) {
            if process.recorded() {
                self.book.send(TraceMsg::ProcessGone { pid: tid as u32 });
                self.book.ledger.drop_process(tid as u32);
            }
            if let Some(space) = process.space {
                self.family
                    .release_sharers(self.target, tid, space, &mut self.stats.warnings);
            }
        }
        if tid == self.control.root {
            self.control.ending = Some(match stop {
                Stop::Killed { sig, core } => Ending::Killed { sig, core },
                Stop::Exited(code) => Ending::Exited(code),
                _ => Ending::Exited(0),
            });
        }
        Ok(())
    }
}
