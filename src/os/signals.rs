//! memptrace's own signals: Ctrl-C, SIGTERM, SIGHUP and a periodic tick.
//!
//! The tracer thread spends its time blocked in waitpid. Handlers here are
//! installed without SA_RESTART, so a signal makes waitpid fail with EINTR and
//! the tracer looks at the counters below. A 100 ms interval timer (SIGALRM)
//! bounds how long a signal that arrives just before waitpid goes unnoticed, and
//! drives periodic work (flushing records, --duration). The signals are blocked
//! in every other thread so the kernel always delivers them to the tracer.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

static INTERRUPTS: AtomicU32 = AtomicU32::new(0);
static TERMINATE: AtomicU32 = AtomicU32::new(0);
static TICKS: AtomicU32 = AtomicU32::new(0);

const HANDLED: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGALRM];

extern "C" fn on_signal(sig: libc::c_int) {
    let counter = match sig {
        libc::SIGINT => &INTERRUPTS,
        libc::SIGALRM => &TICKS,
        _ => {
            TERMINATE.store(sig as u32, Ordering::SeqCst);
            return;
        }
    };
    counter.fetch_add(1, Ordering::SeqCst);
}

fn handled_set() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a local.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in HANDLED {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

fn set_mask(how: libc::c_int) -> io::Result<()> {
    let set = handled_set();
    // SAFETY: valid set pointer; changes only the calling thread's mask.
    let ret = unsafe { libc::pthread_sigmask(how, &set, std::ptr::null_mut()) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(())
}

/// Install the handlers and block the signals in the calling thread; threads
/// spawned afterwards inherit the block. Call before spawning any thread.
/// SIGCHLD stays blocked everywhere: the tracer takes it with
/// [`wait_child`] when it has nothing else to do.
pub fn install() -> io::Result<()> {
    set_mask(libc::SIG_BLOCK)?;
    let mut child: libc::sigset_t = empty_set();
    // SAFETY: sigset manipulation on a local; changes this thread's mask.
    unsafe {
        libc::sigaddset(&mut child, libc::SIGCHLD);
        libc::pthread_sigmask(libc::SIG_BLOCK, &child, std::ptr::null_mut());
    }
    for sig in HANDLED {
        // SAFETY: installing a handler that only touches atomics.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as usize;
            action.sa_flags = 0; // no SA_RESTART: waitpid must return EINTR
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(sig, &action, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// Let the calling thread (the tracer) receive the signals, and start the tick.
pub fn unblock_here(tick: Duration) -> io::Result<()> {
    let interval = libc::timeval {
        tv_sec: tick.as_secs() as libc::time_t,
        tv_usec: tick.subsec_micros() as libc::suseconds_t,
    };
    let timer = libc::itimerval {
        it_interval: interval,
        it_value: interval,
    };
    // SAFETY: setitimer with valid pointers.
    if unsafe { libc::setitimer(libc::ITIMER_REAL, &timer, std::ptr::null_mut()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    set_mask(libc::SIG_UNBLOCK)
}

/// Stop the tick and block the signals again (the trace is over).
pub fn quiesce() {
    let zero = libc::itimerval {
        it_interval: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        it_value: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
    };
    // SAFETY: setitimer with valid pointers.
    unsafe { libc::setitimer(libc::ITIMER_REAL, &zero, std::ptr::null_mut()) };
    let _ = set_mask(libc::SIG_BLOCK);
}

fn empty_set() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a local.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        set
    }
}

/// Wait up to `timeout` for a SIGCHLD (a tracee stopped or exited: the
/// kernel tells its tracer so), taking it. True when one came.
pub fn wait_child(timeout: Duration) -> bool {
    let mut set = empty_set();
    let spec = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: sigtimedwait with a valid set and timeout; no siginfo wanted.
    unsafe {
        libc::sigaddset(&mut set, libc::SIGCHLD);
        libc::sigtimedwait(&set, std::ptr::null_mut(), &spec) == libc::SIGCHLD
    }
}

/// How many times Ctrl-C (SIGINT) was received so far.
pub fn interrupts() -> u32 {
    INTERRUPTS.load(Ordering::SeqCst)
}

/// The terminating signal received (SIGTERM or SIGHUP), if any.
pub fn terminate_signal() -> Option<i32> {
    match TERMINATE.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig as i32),
    }
}

/// Ticks of the interval timer so far.
pub fn ticks() -> u32 {
    TICKS.load(Ordering::SeqCst)
}
