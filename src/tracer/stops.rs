//! Which stop to serve next.
//!
//! `waitpid(-1)` reports stopped tracees in the order of the kernel's list
//! of them, not in the order they stopped. Served one `waitpid` at a time,
//! the threads it lists first are served first every time: with four
//! threads allocating flat out, the threads listed last ran 10-25 times
//! slower than the others. So every stop that is ready is taken at once and
//! the threads are served in turn, the one served longest ago first: a
//! traced program's threads keep their relative speeds.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::time::{Duration, Instant};

use super::target::Target;
use crate::os::ptrace::{Stop, Tid};

/// How long the tracer polls for the next stop before it sleeps: on
/// virtual machines, waking a tracer whose CPU went idle costs far more
/// than the stop itself (measured in docs/performance.md), and an
/// allocating program stops again within microseconds.
const SPIN: Duration = Duration::from_micros(200);

#[derive(Default)]
pub struct Stops {
    /// Stops taken from the kernel, not served yet, in serving order.
    ready: VecDeque<(Tid, Stop)>,
    /// The turn each thread was last served in.
    served: HashMap<Tid, u64>,
    turn: u64,
}

impl Stops {
    /// The next stop to serve, polling for a while; `None` when no thread
    /// stopped meanwhile.
    pub fn poll(&mut self, target: &mut impl Target) -> io::Result<Option<(Tid, Stop)>> {
        if let Some(found) = self.take() {
            return Ok(Some(found));
        }
        let deadline = Instant::now() + SPIN;
        loop {
            if self.gather(target)? {
                return Ok(self.take());
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::hint::spin_loop();
        }
    }

    /// The next stop to serve, sleeping until there is one; `None` when one
    /// of memptrace's own signals (or its tick) interrupted the sleep.
    pub fn wait(&mut self, target: &mut impl Target) -> io::Result<Option<(Tid, Stop)>> {
        if let Some(found) = self.take() {
            return Ok(Some(found));
        }
        let kept = target.take_kept();
        if !kept.is_empty() {
            self.queue(kept);
            return Ok(self.take());
        }
        let Some(first) = target.wait_any()? else {
            return Ok(None);
        };
        self.ready.push_back(first);
        self.gather(target)?;
        Ok(self.take())
    }

    /// A stop taken already, if any.
    pub fn ready(&mut self) -> Option<(Tid, Stop)> {
        self.take()
    }

    /// The stops ready now, if any, without waiting.
    pub fn poll_once(&mut self, target: &mut impl Target) -> io::Result<Option<(Tid, Stop)>> {
        self.gather(target)?;
        Ok(self.take())
    }

    /// A thread is gone: it has no turn any more.
    pub fn forget(&mut self, tid: Tid) {
        self.served.remove(&tid);
    }

    /// Take the stop of thread `tid` already taken from the kernel, if any
    /// (a wait for that thread alone would not see it).
    pub fn take_of(&mut self, tid: Tid) -> Option<Stop> {
        let at = self.ready.iter().position(|&(t, _)| t == tid)?;
        self.ready.remove(at).map(|(_, stop)| stop)
    }

    fn take(&mut self) -> Option<(Tid, Stop)> {
        let (tid, stop) = self.ready.pop_front()?;
        self.turn += 1;
        self.served.insert(tid, self.turn);
        Some((tid, stop))
    }

    /// Take every stop ready now, and queue them least recently served
    /// first. True when any was taken.
    fn gather(&mut self, target: &mut impl Target) -> io::Result<bool> {
        let mut found = target.take_kept();
        loop {
            match target.poll_any() {
                Ok(Some(stop)) => found.push(stop),
                Ok(None) => break,
                // Nothing left to wait for, once the last exit is taken.
                Err(_) if !found.is_empty() || !self.ready.is_empty() => break,
                Err(err) => return Err(err),
            }
        }
        let taken = !found.is_empty();
        self.queue(found);
        Ok(taken)
    }

    /// Queue stops taken together, in turn order.
    fn queue(&mut self, mut found: Vec<(Tid, Stop)>) {
        found.sort_by_key(|(tid, _)| self.served.get(tid).copied().unwrap_or(0));
        self.ready.extend(found);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracer::target::fake::FakeTarget;

    #[test]
    fn serves_the_thread_served_longest_ago_first() {
        let mut stops = Stops::default();
        let trap = Stop::Signal(libc::SIGTRAP);
        // The kernel lists 4, 3, 2, 1; all are new: served in that order.
        stops.queue(vec![(4, trap), (3, trap), (2, trap), (1, trap)]);
        let order: Vec<Tid> = std::iter::from_fn(|| stops.take().map(|(t, _)| t)).collect();
        assert_eq!(order, [4, 3, 2, 1]);
        // Listed in the same order again: the one served longest ago, 4,
        // still goes first, and 1, served last, goes last...
        stops.queue(vec![(1, trap), (4, trap)]);
        assert_eq!(stops.take().map(|(t, _)| t), Some(4));
        // ...and a thread never served goes ahead of those taken with it.
        stops.queue(vec![(2, trap), (9, trap)]);
        let order: Vec<Tid> = std::iter::from_fn(|| stops.take().map(|(t, _)| t)).collect();
        assert_eq!(order, [1, 9, 2]);
    }

    #[test]
    fn a_stop_of_one_thread_is_taken_out_of_turn() {
        let mut stops = Stops::default();
        let trap = Stop::Signal(libc::SIGTRAP);
        stops.queue(vec![(1, trap), (2, Stop::Exited(3)), (3, trap)]);
        assert_eq!(stops.take_of(2), Some(Stop::Exited(3)));
        assert_eq!(stops.take_of(2), None);
        let order: Vec<Tid> = std::iter::from_fn(|| stops.take().map(|(t, _)| t)).collect();
        assert_eq!(order, [1, 3]);
    }

    #[test]
    fn a_stop_kept_by_another_wait_is_served() {
        // How a thread killed during an injected system call ended: taken
        // by that call's wait, served by the wait loop all the same.
        let killed = Stop::Killed {
            sig: libc::SIGSYS,
            core: false,
        };
        let mut target = FakeTarget::new();
        target.keep_for_later(77, killed);
        target.report(78, Stop::Exited(0));
        let mut stops = Stops::default();
        // Taken before any stop the kernel reports.
        assert_eq!(stops.wait(&mut target).unwrap(), Some((77, killed)));
        assert_eq!(target.take_kept(), Vec::new());
        assert_eq!(
            stops.wait(&mut target).unwrap(),
            Some((78, Stop::Exited(0)))
        );
    }

    #[test]
    fn every_stop_ready_is_taken_and_served_in_turn() {
        let mut target = FakeTarget::new();
        let trap = Stop::Signal(libc::SIGTRAP);
        let mut stops = Stops::default();
        // 1 is served; then 2 and 1 stop together: 2, never served, first.
        target.report(1, trap);
        assert_eq!(stops.poll(&mut target).unwrap(), Some((1, trap)));
        target.report(1, trap);
        target.report(2, trap);
        assert_eq!(stops.poll(&mut target).unwrap(), Some((2, trap)));
        assert_eq!(stops.ready(), Some((1, trap)));
        assert_eq!(stops.poll_once(&mut target).unwrap(), None);
        // A sleeping wait serves the stop that woke it first, then the
        // others ready with it in turn.
        target.report(1, trap);
        target.report(3, trap);
        target.report(2, trap);
        assert_eq!(stops.wait(&mut target).unwrap(), Some((1, trap)));
        assert_eq!(stops.ready(), Some((3, trap)));
        assert_eq!(stops.ready(), Some((2, trap)));
        // Nothing is left to report: the blocking wait says so.
        assert!(
            stops
                .wait(&mut target)
                .is_err_and(|e| e.raw_os_error() == Some(libc::ECHILD))
        );
    }
}
