//! Running one system call inside the target: how trampoline pages get mapped.
//!
//! A stopped thread is pointed at an existing `syscall` instruction with the
//! call's arguments in its registers and single-stepped over it; then every
//! register is put back. No code is written and no breakpoint lifted, so the
//! other threads, running meanwhile, see nothing. A signal that arrives during
//! the step is kept and handed back to the caller to deliver afterwards.

use std::io;
use std::time::{Duration, Instant};

use crate::os::ptrace::{self, Stop, Tid};
use crate::os::seccomp as os_seccomp;
use crate::os::shared::{self, SharedMemory};
use crate::seccomp::{self, Call};

#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("ptrace: {0}")]
    Ptrace(#[from] io::Error),
    #[error("the thread exited while running an injected system call")]
    Gone,
    #[error("the thread is a vfork parent waiting for its child")]
    InVfork,
    #[error(
        "the thread did not come back from an injected system call in time; its registers were put back"
    )]
    Timeout,
    #[error("the thread did not come back from an injected system call and could not be stopped")]
    Stuck,
    #[error("the injected system call failed with errno {0}")]
    Errno(i32),
    #[error(transparent)]
    Forbidden(#[from] seccomp::Refusal),
}

/// The outcome of an injected call: its result and the signals that arrived
/// meanwhile (to be delivered when the thread is resumed).
pub struct Injected {
    pub value: u64,
    pub signals: Vec<i32>,
}

/// How long one step of an injected call may take before memptrace stops
/// waiting for it (a `syscall` instruction of memfd_create, mmap or close
/// returns in microseconds; a thread that does not is not waited for
/// forever).
const STEP_PATIENCE: Duration = Duration::from_secs(2);

/// Run `syscall(nr, args...)` in the stopped thread `tid` using the `syscall`
/// instruction bytes at `insn`.
///
/// The thread's registers are saved and put back under the kernel's rules
/// for a thread stopped in a system call (see [`leave_system_call`]): at a
/// signal-delivery-stop or a PTRACE_EVENT_STOP, `orig_rax` and an
/// `-ERESTART*` code in `rax` are put back as they were, so the kernel
/// restarts (or not) the call the thread was in exactly as it would have.
pub fn syscall(tid: Tid, insn: u64, nr: u64, args: [u64; 6]) -> Result<Injected, InjectError> {
    // A call the thread's seccomp filter does not allow is not made: it
    // could kill the program (the filter sees the address after `syscall`).
    let call = Call::known(nr as i64, args, insn.wrapping_add(2));
    seccomp::check(&os_seccomp::filters(tid), &call)?;
    let mut signals = Vec::new();
    leave_system_call(tid, &mut signals)?;
    let saved = ptrace::get_regs(tid)?;
    let mut regs = saved;
    regs.rax = nr;
    regs.rdi = args[0];
    regs.rsi = args[1];
    regs.rdx = args[2];
    regs.r10 = args[3];
    regs.r8 = args[4];
    regs.r9 = args[5];
    regs.rip = insn;
    // orig_rax = -1: the kernel must not treat the stop we came from as an
    // interrupted system call to restart (`syscall(2)` restart logic) while
    // our call runs; `saved` brings it back for the thread's own call.
    regs.orig_rax = u64::MAX;

    let result = loop {
        ptrace::set_regs(tid, &regs)?;
        ptrace::single_step(tid)?;
        let after = match wait_step(tid)? {
            Some(stop) => stop,
            None => {
                // Still running our call: stop it and put its registers back.
                let _ = ptrace::interrupt(tid);
                if let Ok(Some(_)) = wait_step(tid) {
                    let _ = ptrace::set_regs(tid, &saved);
                    return Err(InjectError::Timeout);
                }
                return Err(InjectError::Stuck);
            }
        };
        match after {
            Stop::Signal(libc::SIGTRAP) => {}
            Stop::Signal(sig) => signals.push(sig),
            // The wait loop must still see how the thread ended: for the
            // program's leader, that is how the trace ends.
            Stop::Exited(_) | Stop::Killed { .. } | Stop::Event(libc::PTRACE_EVENT_EXIT) => {
                ptrace::keep_for_later(tid, after);
                return Err(InjectError::Gone);
            }
            _ => {}
        }
        let now = ptrace::get_regs(tid)?;
        if now.rip != insn {
            break now.rax;
        }
    };
    ptrace::set_regs(tid, &saved)?;
    let as_signed = result as i64;
    if (-4095..0).contains(&as_signed) {
        return Err(InjectError::Errno(-as_signed as i32));
    }
    Ok(Injected {
        value: result,
        signals,
    })
}

/// Finish the system call a thread is stopped in, when it is stopped at a
/// ptrace event inside one (`ptrace(2)`: the clone, fork, exec and
/// vfork-done events are reported from within the call).
///
/// There the call is still in progress: `rax` holds -ENOSYS, and the call's
/// result (a new thread's id, 0 after an exec) is stored into `rax` on the
/// way out. Registers saved at that stop and put back after an injected call
/// would replace the result with -ENOSYS: a clone3 that made a thread would
/// return ENOSYS, and glibc would make the thread again with clone (a start
/// routine run twice). So the call is finished first: one step, and the
/// thread stops at a signal-delivery-stop (the step's SIGTRAP, or a signal
/// that came first, kept for delivery) with the call's result in `rax`.
/// Registers saved there are the thread's own, and the kernel's restart rules
/// apply to them when it resumes. A vfork parent is not stepped: it would
/// wait in the kernel for its child, which memptrace may hold.
fn leave_system_call(tid: Tid, signals: &mut Vec<i32>) -> Result<(), InjectError> {
    match ptrace::event_of(tid) {
        Some(
            libc::PTRACE_EVENT_CLONE
            | libc::PTRACE_EVENT_FORK
            | libc::PTRACE_EVENT_EXEC
            | libc::PTRACE_EVENT_VFORK_DONE,
        ) => {}
        Some(libc::PTRACE_EVENT_VFORK) => return Err(InjectError::InVfork),
        Some(libc::PTRACE_EVENT_EXIT) => return Err(InjectError::Gone),
        _ => return Ok(()),
    }
    ptrace::single_step(tid)?;
    match wait_step(tid)? {
        Some(Stop::Signal(libc::SIGTRAP)) => Ok(()),
        Some(Stop::Signal(sig)) => {
            signals.push(sig);
            Ok(())
        }
        // The wait loop must still see how the thread ended (see `syscall`).
        Some(
            stop @ (Stop::Exited(_) | Stop::Killed { .. } | Stop::Event(libc::PTRACE_EVENT_EXIT)),
        ) => {
            ptrace::keep_for_later(tid, stop);
            Err(InjectError::Gone)
        }
        Some(_) => Ok(()),
        None => {
            let _ = ptrace::interrupt(tid);
            match wait_step(tid)? {
                Some(_) => Err(InjectError::Timeout),
                None => Err(InjectError::Stuck),
            }
        }
    }
}

/// The next stop of a thread memptrace stepped, within [`STEP_PATIENCE`].
fn wait_step(tid: Tid) -> Result<Option<Stop>, InjectError> {
    Ok(ptrace::wait_tid_until(tid, Instant::now() + STEP_PATIENCE)?)
}

/// Make `len` bytes of memory shared between the process of the stopped
/// thread `tid` and memptrace: a memfd made in the target (`name` is a
/// NUL-terminated name in its memory), mapped there `MAP_SHARED` (at `at`,
/// replacing what is there, or where the kernel likes), taken here with
/// `pidfd_getfd` (see [`crate::os::shared`]: no privilege beyond ptrace
/// rights), and closed in the target. Returns its address in the target and
/// memptrace's mapping; signals that arrived meanwhile go to `signals`.
pub fn shared_memory(
    pid: Tid,
    tid: Tid,
    insn: u64,
    name: u64,
    len: u64,
    at: Option<u64>,
    signals: &mut Vec<i32>,
) -> Result<(u64, SharedMemory), SharedError> {
    let mut call = |nr: i64, args: [u64; 6]| -> Result<u64, InjectError> {
        let done = syscall(tid, insn, nr as u64, args)?;
        signals.extend(done.signals);
        Ok(done.value)
    };
    let fd = call(
        libc::SYS_memfd_create,
        [name, libc::MFD_CLOEXEC as u64, 0, 0, 0, 0],
    )?;
    let made = (|| -> Result<(u64, SharedMemory), SharedError> {
        call(libc::SYS_ftruncate, [fd, len, 0, 0, 0, 0])?;
        let flags = match at {
            Some(_) => libc::MAP_SHARED | libc::MAP_FIXED,
            None => libc::MAP_SHARED,
        };
        let remote = call(
            libc::SYS_mmap,
            [
                at.unwrap_or(0),
                len,
                (libc::PROT_READ | libc::PROT_WRITE) as u64,
                (flags | libc::MAP_NORESERVE) as u64,
                fd,
                0,
            ],
        )?;
        // The descriptor is in the table of the process whose thread made
        // it (a vfork child running the calls for its parent has its own).
        let owner = crate::os::procfs::tgid(tid).unwrap_or(pid);
        let local = shared::take_fd(owner, fd as i32)
            .and_then(|owned| SharedMemory::map(&owned, len as usize));
        match local {
            Ok(mem) => Ok((remote, mem)),
            Err(err) => {
                let _ = call(libc::SYS_munmap, [remote, len, 0, 0, 0, 0]);
                Err(err.into())
            }
        }
    })();
    let _ = call(libc::SYS_close, [fd, 0, 0, 0, 0, 0]);
    made
}

#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error("cannot make the shared memory in the target")]
    Inject(#[from] InjectError),
    #[error("cannot map the target's shared memory here")]
    Map(#[from] io::Error),
}

/// mmap an anonymous read+execute page range at exactly `addr`.
pub fn map_code(tid: Tid, insn: u64, addr: u64, len: u64) -> Result<Injected, InjectError> {
    const MAP_FIXED_NOREPLACE: u64 = 0x100000;
    let prot = (libc::PROT_READ | libc::PROT_EXEC) as u64;
    let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64 | MAP_FIXED_NOREPLACE;
    syscall(
        tid,
        insn,
        libc::SYS_mmap as u64,
        [addr, len, prot, flags, u64::MAX, 0],
    )
}
