//! Letting traced threads run again: continue with a signal, listen at a
//! group-stop, queue further signals. Every part that ends a stop resumes
//! through here, so the heartbeat the probes watch (see [`super::life::failopen`])
//! is fresh whenever a thread runs, and a thread that vanished meanwhile
//! (killed) is not an error: waitpid reports its end.

use std::io;

use super::process::Family;
use super::stop::Stopped;
use super::target::Target;
use crate::os::ptrace::{self, Stop, Tid};

impl Family {
    /// Resume a thread, delivering `sig` (0 for none).
    pub fn resume<T: Target>(&self, target: &mut T, tid: Tid, sig: i32) -> io::Result<()> {
        // The heartbeat is fresh whenever a thread runs (after an attach
        // that kept every thread stopped for longer than a beat, too).
        self.beat();
        ptrace::unless_gone(target.cont(tid, sig))
    }

    /// Resume a thread from its first stop: a group-stop is not ended (the
    /// thread stays stopped, listening for SIGCONT, as it would untraced).
    pub fn resume_from<T: Target>(&self, target: &mut T, tid: Tid, stop: Stop) -> io::Result<()> {
        match Stopped::of(stop) {
            Stopped::GroupStop(_) => ptrace::unless_gone(target.listen(tid)),
            _ => self.resume(target, tid, 0),
        }
    }

    /// Resume a thread delivering the first signal now and queueing the rest.
    pub fn resume_with<T: Target>(
        &self,
        target: &mut T,
        tid: Tid,
        signals: &[i32],
    ) -> io::Result<()> {
        let pid = self.pid_of(tid).unwrap_or(tid);
        for &sig in signals.iter().skip(1) {
            let _ = target.tgkill(pid, tid, sig);
        }
        self.resume(target, tid, signals.first().copied().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracer::target::fake::{Call, FakeTarget};

    #[test]
    fn a_group_stop_is_listened_to_and_any_other_first_stop_continued() {
        let family = Family::default();
        let mut target = FakeTarget::new();
        for tid in [7, 8, 9] {
            target.stopped_at(tid, 0x1000, 0x7000);
        }
        family
            .resume_from(&mut target, 7, Stop::EventStop(libc::SIGSTOP))
            .unwrap();
        family
            .resume_from(&mut target, 8, Stop::EventStop(0))
            .unwrap();
        family.resume_with(&mut target, 9, &[]).unwrap();
        assert_eq!(
            target.calls,
            vec![Call::Listen(7), Call::Cont(8, 0), Call::Cont(9, 0)]
        );
    }

    #[test]
    fn signals_beyond_the_first_are_queued_by_tgkill_before_it_runs() {
        let family = Family::default();
        let mut target = FakeTarget::new();
        target.process(9, &[9]);
        target.stopped_at(9, 0x1000, 0x7000);
        family
            .resume_with(
                &mut target,
                9,
                &[libc::SIGUSR1, libc::SIGUSR2, libc::SIGRTMIN()],
            )
            .unwrap();
        assert_eq!(
            target.calls,
            vec![
                Call::Tgkill(9, libc::SIGUSR2),
                Call::Tgkill(9, libc::SIGRTMIN()),
                Call::Cont(9, libc::SIGUSR1)
            ]
        );
    }

    #[test]
    fn a_thread_gone_meanwhile_is_not_an_error() {
        let family = Family::default();
        let mut target = FakeTarget::new();
        family.resume(&mut target, 5, libc::SIGUSR1).unwrap();
        assert!(target.calls.is_empty());
    }
}
