//! What a stop means: one classifier for every loop that waits for stops
//! (the trace, the attach and the detach), so that each decides what to do
//! about a kind of stop, never what the kind is.
//!
//! `ptrace(2)`, "Stopped states": a seized thread reports group-stops and
//! PTRACE_INTERRUPT as PTRACE_EVENT_STOP (the first is told apart by its
//! stopping signal), signal-delivery-stops with the signal, and the events
//! asked for with PTRACE_SETOPTIONS.

use crate::os::ptrace::Stop;

/// A stop, as the tracer acts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// The thread exited or was killed (for a leader reported last, the
    /// whole process).
    Gone,
    /// A SIGTRAP about to be delivered: one of memptrace's int3s, or the
    /// program's own.
    Trap,
    /// A SIGSEGV or SIGBUS about to be delivered (possibly raised by code
    /// of memptrace's in the target).
    Fault(i32),
    /// Any other signal about to be delivered.
    Signal(i32),
    /// PTRACE_EVENT_CLONE, _FORK or _VFORK: a child was born.
    Birth(i32),
    /// PTRACE_EVENT_EXEC: the process has a new program.
    Exec,
    /// PTRACE_EVENT_EXIT: the thread is about to exit.
    Exiting,
    /// PTRACE_EVENT_VFORK_DONE: the thread's vfork child exec'd or exited,
    /// and no longer runs in its memory; reported before the thread runs
    /// on.
    VforkDone,
    /// A group-stop for this stopping signal (SIGSTOP, SIGTSTP, SIGTTIN,
    /// SIGTTOU): the thread stays stopped (PTRACE_LISTEN) until SIGCONT.
    GroupStop(i32),
    /// Any other PTRACE_EVENT_STOP (an interrupt, a new thread's first
    /// stop), a syscall-stop or an event memptrace does not act on.
    Interrupt,
}

impl Stopped {
    /// The signal a thread let go at this stop must get (0 for none): the
    /// one it was about to receive.
    pub fn signal(self) -> i32 {
        match self {
            Stopped::Signal(sig) | Stopped::Fault(sig) => sig,
            _ => 0,
        }
    }

    pub fn of(stop: Stop) -> Stopped {
        match stop {
            Stop::Exited(_) | Stop::Killed { .. } => Stopped::Gone,
            Stop::Signal(libc::SIGTRAP) => Stopped::Trap,
            Stop::Signal(sig @ (libc::SIGSEGV | libc::SIGBUS)) => Stopped::Fault(sig),
            Stop::Signal(sig) => Stopped::Signal(sig),
            Stop::Event(
                event @ (libc::PTRACE_EVENT_CLONE
                | libc::PTRACE_EVENT_FORK
                | libc::PTRACE_EVENT_VFORK),
            ) => Stopped::Birth(event),
            Stop::Event(libc::PTRACE_EVENT_EXEC) => Stopped::Exec,
            Stop::Event(libc::PTRACE_EVENT_EXIT) => Stopped::Exiting,
            Stop::Event(libc::PTRACE_EVENT_VFORK_DONE) => Stopped::VforkDone,
            Stop::EventStop(sig) if is_stopping_signal(sig) => Stopped::GroupStop(sig),
            Stop::Event(_) | Stop::EventStop(_) | Stop::Syscall => Stopped::Interrupt,
        }
    }
}

/// The signals whose default action stops the process (`signal(7)`).
pub fn is_stopping_signal(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_every_kind_of_stop() {
        assert_eq!(Stopped::of(Stop::Exited(3)), Stopped::Gone);
        let killed = Stop::Killed {
            sig: libc::SIGKILL,
            core: false,
        };
        assert_eq!(Stopped::of(killed), Stopped::Gone);
        assert_eq!(Stopped::of(Stop::Signal(libc::SIGTRAP)), Stopped::Trap);
        assert_eq!(
            Stopped::of(Stop::Signal(libc::SIGBUS)),
            Stopped::Fault(libc::SIGBUS)
        );
        assert_eq!(
            Stopped::of(Stop::Signal(libc::SIGUSR1)),
            Stopped::Signal(libc::SIGUSR1)
        );
        assert_eq!(
            Stopped::of(Stop::Event(libc::PTRACE_EVENT_VFORK)),
            Stopped::Birth(libc::PTRACE_EVENT_VFORK)
        );
        assert_eq!(
            Stopped::of(Stop::Event(libc::PTRACE_EVENT_EXEC)),
            Stopped::Exec
        );
        assert_eq!(
            Stopped::of(Stop::Event(libc::PTRACE_EVENT_EXIT)),
            Stopped::Exiting
        );
        assert_eq!(
            Stopped::of(Stop::Event(libc::PTRACE_EVENT_VFORK_DONE)),
            Stopped::VforkDone
        );
        assert_eq!(
            Stopped::of(Stop::EventStop(libc::SIGTSTP)),
            Stopped::GroupStop(libc::SIGTSTP)
        );
        assert_eq!(
            Stopped::of(Stop::EventStop(libc::SIGTRAP)),
            Stopped::Interrupt
        );
        assert_eq!(Stopped::of(Stop::Syscall), Stopped::Interrupt);
    }
}
