//! The engine: the wait loop, which takes the next stop (reading the jump
//! probes' rings between stops), dispatches it by kind and ends the trace
//! when the program is gone or memptrace is told to stop; and the trace's
//! end (wind-up), whatever ended it.

use std::io;
use std::time::{Duration, Instant};

use super::booking::Booking;
use super::life::detach::Detached;
use super::life::failure;
use super::stop::Stopped;
use super::target::Target;
use super::{Control, Ending, TraceError, TraceStats, Tracer, signal_name};
use crate::os::ptrace::{self, Stop, Tid};
use crate::os::signals;
use crate::unwind::pipeline::PipelineHandle;

/// How long the exit of a process's main thread waits for the ends of its
/// other threads, gone or dying, to be reported (see
/// `Tracer::reap_ended_siblings`).
const SIBLINGS_PATIENCE: Duration = Duration::from_millis(100);

impl Tracer {
    /// Trace until the program exits or memptrace is told to stop; then hand
    /// the pipeline everything still batched. Consumes the tracer's pipeline.
    pub fn run(mut self) -> Result<(Ending, TraceStats, PipelineHandle), TraceError> {
        failure::install_hook();
        let ending = failure::catch(|| self.wait_loop()).unwrap_or_else(failure::ending);
        let failed = matches!(ending, Err(_) | Ok(Ending::Failed { .. }));
        let (ending, flushed) = match failure::catch(|| self.wind_up(failed)) {
            Ok(flushed) => (ending, flushed),
            Err(panic) => (failure::ending(panic), Ok(())),
        };
        let ending = ending?;
        flushed?;
        let stats = std::mem::take(&mut self.stats);
        Ok((ending, stats, self.book.out.into_pipeline()))
    }

    /// After the wait loop, however it ended (`failed`: let the program go).
    fn wind_up(&mut self, failed: bool) -> Result<(), TraceError> {
        self.finish_inventory(true);
        let pids: Vec<Tid> = self.family.processes.keys().copied().collect();
        for pid in pids {
            self.images().0.warn_if_unhooked(pid);
        }
        if failed && !self.family.threads.is_empty() {
            // Whatever went wrong, the program is not left with memptrace's
            // bytes in it (nor killed by memptrace's exit): let it go.
            let _ = self.detach_all();
        }
        self.book
            .settle_all(&mut self.family, &mut self.target, false);
        self.book
            .drain_rings(&mut self.family, &mut self.stats, true);
        let pids: Vec<Tid> = self.family.processes.keys().copied().collect();
        for pid in pids {
            self.stats.count_probes(&mut self.family, pid);
        }
        self.stats.warn_let_through();
        if self.book.out.awaiting_copies() {
            self.book
                .settle_finished(&mut self.family, &mut self.target);
        }
        Ok(self.book.out.send_ready(true)?)
    }

    fn wait_loop(&mut self) -> Result<Ending, TraceError> {
        loop {
            if let Some(reason) = self.control.stop_requested(&self.book) {
                self.detach_all()?;
                return Ok(Ending::Detached { reason });
            }
            if self.family.is_empty() {
                break;
            }
            if self.ticked() {
                failure::panic_if_asked(self.book.ledger.events());
                self.family.beat();
                if let Some(clock) = self.book.tsc.as_mut() {
                    clock.refine(
                        self.book.clock.elapsed().as_nanos() as u64,
                        crate::os::local::tsc(),
                    );
                }
                self.flush()?;
            } else if self.book.out.full() {
                self.flush()?;
            }
            self.finish_inventory(false);
            match self.next_stop() {
                Ok(Some((tid, stop))) => self.dispatch(tid, stop)?,
                Ok(None) => {}
                Err(err) if ptrace::no_children(&err) => break,
                Err(err) => return Err(err.into()),
            }
        }
        Ok(self.control.ending.clone().unwrap_or(Ending::Exited(0)))
    }

    /// The next stop to serve (see [`super::stops::Stops`]); whatever is batched goes to
    /// the pipeline before the tracer sleeps.
    fn next_stop(&mut self) -> io::Result<Option<(Tid, Stop)>> {
        if self.jumps() {
            return self.next_stop_reading_rings();
        }
        if let Some(found) = self.stops.poll(&mut self.target)? {
            return Ok(Some(found));
        }
        // The pipeline is gone if this fails; the wait loop finds out when
        // it sends next.
        let _ = self.flush();
        self.stops.wait(&mut self.target)
    }

    /// With jump probes: read the rings between stops; with nothing to read
    /// and no stop, sleep until a tracee stops (SIGCHLD), 1 ms at most.
    fn next_stop_reading_rings(&mut self) -> io::Result<Option<(Tid, Stop)>> {
        if let Some(found) = self.stops.ready() {
            return Ok(Some(found));
        }
        let read = self
            .book
            .drain_rings(&mut self.family, &mut self.stats, false);
        if let Some(found) = self.stops.poll_once(&mut self.target)? {
            return Ok(Some(found));
        }
        if read == 0 {
            let _ = self.flush();
            signals::wait_child(Duration::from_millis(1));
            return self.stops.poll_once(&mut self.target);
        }
        Ok(None)
    }

    fn ticked(&mut self) -> bool {
        let now = signals::ticks();
        let ticked = now != self.control.last_tick;
        self.control.last_tick = now;
        ticked
    }

    /// Hand the batch to the pipeline, up to the first call still waiting for
    /// its thread's stack copy (see [`super::booking::copies`]).
    /// While the pipeline is busy the batch grows instead (see [`super::booking::outbox`]).
    pub(super) fn flush(&mut self) -> Result<(), TraceError> {
        if self.book.out.awaiting_copies() {
            self.book
                .settle_finished(&mut self.family, &mut self.target);
        }
        Ok(self.book.out.send_ready(false)?)
    }

    fn dispatch(&mut self, tid: Tid, stop: Stop) -> Result<(), TraceError> {
        let Some(thread) = self.family.threads.get(&tid) else {
            return self.unknown(tid, stop);
        };
        if thread.copy.is_some() {
            self.book
                .settle_at_stop(&mut self.family, &mut self.target, tid, &stop);
        }
        let stopped = Stopped::of(stop);
        // Only calls and signals are served while the attach's heap is
        // walked: an exit, an exec or a thread's end books it first.
        if matches!(stopped, Stopped::Gone | Stopped::Exec | Stopped::Exiting) {
            self.finish_inventory(true);
        }
        match stopped {
            Stopped::Gone => self.life().thread_gone(tid, stop),
            Stopped::Trap if self.family.step_ended(&mut self.target, tid) => self.resume(tid, 0),
            Stopped::Trap => self.serve().trap(tid),
            Stopped::Fault(_) if self.family.copy_faulted(&mut self.target, tid) => Ok(self
                .family
                .recover_copy(&mut self.target, &mut self.stats, tid)?),
            Stopped::Fault(sig) if self.jumps() => {
                match self.family.walk_faulted(&mut self.target, tid) {
                    Some(to) => {
                        Ok(self
                            .family
                            .recover_walk(&mut self.target, &mut self.stats, tid, to)?)
                    }
                    None => self.resume(tid, sig),
                }
            }
            Stopped::Fault(sig) | Stopped::Signal(sig) => {
                Ok(self.family.deliver(&mut self.target, tid, sig)?)
            }
            Stopped::Birth(event) => {
                self.life().announce_child(tid, event, false)?;
                self.resume(tid, 0)
            }
            Stopped::Exec => {
                let catch = self.life().catch();
                let (mut images, target) = self.images();
                images.exec(target, tid, catch)
            }
            Stopped::Exiting => {
                self.book
                    .release_slots(&mut self.family, &mut self.stats, tid);
                if self.family.is_traced(tid) {
                    self.reap_ended_siblings(tid)?;
                    let done = self.family.done_calling(tid);
                    self.heaps
                        .map_heap_at_exit(&mut self.book, &mut self.stats, tid, done);
                }
                let end = self.now_ns();
                self.send_thread(tid, Some(end));
                if let Some(thread) = self.family.threads.get_mut(&tid) {
                    self.stats.lost_returns += thread.take_calls().len() as u64;
                }
                self.resume(tid, 0)
            }
            Stopped::GroupStop(_) => Ok(ptrace::unless_gone(self.target.listen(tid))?),
            Stopped::VforkDone => {
                self.family.vfork_done(tid);
                self.resume(tid, 0)
            }
            Stopped::Interrupt => self.resume(tid, 0),
        }
    }

    /// The main thread of process `pid` is exiting: the ends of its other
    /// threads are taken first, those gone or dying (a program that joined
    /// its threads before it returned: their ends are still queued behind
    /// this stop) and those at their exit stop (an `exit_group` ends them
    /// all), so that the process is found done calling
    /// ([`super::process::Family::done_calling`]) and its live blocks leave
    /// the ledger before its heap is mapped: the ledger and the map are not
    /// both held (at 100 M calls of the scale workload, 72 MB and 64 MB).
    /// Any other stop of theirs is kept for the wait loop. Given up after
    /// [`SIBLINGS_PATIENCE`].
    fn reap_ended_siblings(&mut self, pid: Tid) -> Result<(), TraceError> {
        let deadline = Instant::now() + SIBLINGS_PATIENCE;
        let mut kept: Vec<(Tid, Stop)> = Vec::new();
        loop {
            let siblings: Vec<Tid> = self
                .family
                .threads
                .iter()
                .filter(|&(&t, thread)| thread.pid == pid && t != pid)
                .map(|(&t, _)| t)
                .filter(|t| !kept.iter().any(|(k, _)| k == t))
                .collect();
            let mut ended = false;
            let mut waiting = false;
            for t in siblings {
                let ending = self.target.thread_ending(pid, t);
                let until = if ending { deadline } else { Instant::now() };
                let stop = match self.stops.take_of(t) {
                    Some(stop) => Ok(Some(stop)),
                    None => self.target.wait_tid_until(t, until),
                };
                match stop {
                    Ok(Some(stop))
                        if matches!(Stopped::of(stop), Stopped::Exiting | Stopped::Gone) =>
                    {
                        self.dispatch(t, stop)?;
                        ended = true;
                    }
                    Ok(Some(stop)) => kept.push((t, stop)),
                    Ok(None) => waiting |= ending,
                    // Nothing to wait for (reaped meanwhile): the wait loop
                    // hears of the thread's end.
                    Err(_) => {}
                }
            }
            if !ended && (!waiting || Instant::now() >= deadline) {
                break;
            }
        }
        for (t, stop) in kept {
            self.target.keep_for_later(t, stop);
        }
        Ok(())
    }

    /// The attach's heap walk, if one runs: book it once done (`wait`:
    /// wait for it), then the calls held back meanwhile, in order.
    pub(super) fn finish_inventory(&mut self, wait: bool) {
        let held = self
            .heaps
            .finish_inventory(&mut self.book, &mut self.stats, wait);
        let mut serve = self.serve();
        for call in held {
            serve.complete(call.op, &call.facts, call.stack, call.module_id);
        }
    }

    /// Let every thread go (see [`super::life::detach`]): the calls held back for
    /// the attach's inventory are booked first, and the heaps mapped once
    /// the threads run again.
    pub(super) fn detach_all(&mut self) -> Result<(), TraceError> {
        self.finish_inventory(true);
        let detached = self.life().detach_all(super::PATIENCE)?;
        self.after_detach(detached);
        Ok(())
    }

    /// Let go the threads an attach stopped (see [`super::life::detach`]).
    pub(super) fn let_go_held(&mut self) -> Result<(), TraceError> {
        let detached = self.life().let_go_held(super::PATIENCE)?;
        self.after_detach(detached);
        Ok(())
    }

    /// The heaps of a detach mapped, then the threads that had not
    /// stopped let go as each stops.
    fn after_detach(&mut self, mut detached: Detached) {
        let heaps = std::mem::take(&mut detached.heaps);
        self.heaps
            .map_heaps_after_detach(&mut self.book, &mut self.stats, heaps);
        self.life().finish_detach(detached, super::DETACH_PATIENCE);
    }

    /// A stop of a thread we do not know yet: a new thread or child whose
    /// creation event is still queued behind it.
    fn unknown(&mut self, tid: Tid, stop: Stop) -> Result<(), TraceError> {
        if Stopped::of(stop) == Stopped::Gone {
            // A thread that vanished in an exec, or a released child.
            self.family.announced.remove(&tid);
            return Ok(());
        }
        match self.family.announced.remove(&tid) {
            Some(child) => self.life().adopt(tid, child, stop),
            None => {
                self.family.early.insert(tid, stop);
                Ok(())
            }
        }
    }
}

impl Control {
    /// SIGTERM or SIGHUP ends the trace, and so does Ctrl-C: the second one
    /// for a launched program (the first reaches the program, in the same
    /// process group, which decides), the first one when attached. So do
    /// the end of `--duration` and a database that cannot grow.
    pub(super) fn stop_requested(&self, book: &Booking) -> Option<String> {
        if let Some(reason) = book.progress.halt.get() {
            return Some(reason.clone());
        }
        if let Some(sig) = signals::terminate_signal() {
            return Some(format!("memptrace received {}", signal_name(sig)));
        }
        match signals::interrupts() {
            1 if self.attached => return Some("interrupted (Ctrl-C)".to_string()),
            n if n >= 2 => return Some("interrupted (Ctrl-C twice)".to_string()),
            _ => {}
        }
        let deadline = self.deadline?;
        (Instant::now() >= deadline).then(|| "the --duration elapsed".to_string())
    }
}
