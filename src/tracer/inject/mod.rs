//! Running one system call inside the target: how trampoline pages get mapped.
//!
//! A stopped thread is pointed at a `syscall` instruction with the call's
//! arguments in its registers and resumed to the call's exit stop
//! (PTRACE_SYSCALL); then its registers are put back. No code of the
//! program is written and no breakpoint lifted, so the other threads,
//! running meanwhile, see nothing. A signal that arrives meanwhile is kept
//! and handed back to the caller to deliver afterwards.
//!
//! Every call goes through the [`stub`], after which the thread puts itself
//! back: a memptrace killed in the middle of a call (SIGKILL, the OOM
//! killer) leaves the thread running on as if nothing happened. The stub
//! lives in a trampoline area; the first call in a process, which maps that
//! area, and the last, which unmaps it at detach, run through a copy lent
//! for the call to the page padding after an image's code ([`through_stub_at`]):
//! bytes mapped with the code that no segment owns, put back afterwards.
//! Only where no image has padding wide enough does a call go through a
//! `syscall` instruction of the program's own code, and a death in its tens
//! of microseconds would leave the thread on with the call's registers. No
//! call leaves the trap flag set (no single step), which a thread let go by
//! a dead tracer would die of.

pub mod stub;

use std::io;
use std::time::{Duration, Instant};

use crate::memory::Memory;
use crate::os::mem::CodeWriter;
use crate::os::procfs;
use crate::os::ptrace::{self, Regs, Stop, SyscallStop, Tid};
use crate::os::seccomp as os_seccomp;
use crate::os::shared::{self, SharedMemory};
use crate::seccomp::{self, Call};

/// Where an injected call enters the kernel: the program's own `syscall`
/// instruction at `insn`, or memptrace's [`stub`] at `stub` once there is
/// one in the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Via {
    pub insn: u64,
    /// The stub's address and its save area's.
    pub stub: Option<(u64, u64)>,
}

impl Via {
    /// The same, through the program's own instruction.
    pub fn own(self) -> Via {
        Via {
            insn: self.insn,
            stub: None,
        }
    }
}

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

/// However loaded the machine, an injected call is given up after this
/// much wall time.
const STEP_PATIENCE_AT_MOST: Duration = Duration::from_secs(30);

/// The time an injected call has taken, not counting the time the thread or
/// memptrace waited for a CPU: on a machine loaded 30-40 times over a
/// thread waits seconds to run its microsecond `mmap`, and taking that for
/// a stuck call made a whole process fall back to int3 probes (27x slower).
/// A call is given up when it has taken [`STEP_PATIENCE`] so counted, or
/// [`STEP_PATIENCE_AT_MOST`] of wall time.
struct Patience {
    tid: Tid,
    start: Instant,
    waited: u64,
}

impl Patience {
    fn new(tid: Tid) -> Patience {
        Patience {
            tid,
            start: Instant::now(),
            waited: Patience::waiting(tid),
        }
    }

    /// Run-queue waits of the thread and of memptrace's own, so far.
    fn waiting(tid: Tid) -> u64 {
        let theirs = procfs::run_queue_wait_ns(Some(tid)).unwrap_or(0);
        let ours = procfs::run_queue_wait_ns(None).unwrap_or(0);
        theirs.saturating_add(ours)
    }

    fn over(&self) -> bool {
        let elapsed = self.start.elapsed();
        // Under STEP_PATIENCE of wall time it cannot be over: no /proc read
        // at each stop of a call that returns in microseconds.
        if elapsed < STEP_PATIENCE {
            return false;
        }
        if elapsed >= STEP_PATIENCE_AT_MOST {
            return true;
        }
        let waited = Patience::waiting(self.tid).saturating_sub(self.waited);
        elapsed.saturating_sub(Duration::from_nanos(waited)) >= STEP_PATIENCE
    }

    /// The thread's next stop, or `None` once patience is over.
    fn wait_step(&self) -> Result<Option<Stop>, InjectError> {
        loop {
            let round = Instant::now() + Duration::from_millis(100);
            if let Some(stop) = ptrace::wait_tid_until(self.tid, round)? {
                return Ok(Some(stop));
            }
            if self.over() {
                return Ok(None);
            }
        }
    }
}

/// Run `syscall(nr, args...)` in the stopped thread `tid`, entering the
/// kernel as `via` says.
///
/// The thread's registers are saved and put back under the kernel's rules
/// for a thread stopped in a system call (see [`leave_system_call`] and
/// [`resume_state`]): a call of its own that a stop interrupted
/// (`-ERESTART*` in `rax`) is set up to run again, as the kernel would
/// have when it resumed the thread.
pub fn syscall(tid: Tid, via: Via, nr: u64, args: [u64; 6]) -> Result<Injected, InjectError> {
    let entry = via.stub.map_or(via.insn, |(at, _)| at);
    // A call the thread's seccomp filter does not allow is not made: it
    // could kill the program (the filter sees the address after `syscall`).
    let call = Call::known(nr as i64, args, entry.wrapping_add(2));
    seccomp::check(&os_seccomp::filters(tid), &call)?;
    let mut signals = Vec::new();
    leave_system_call(tid, &mut signals)?;
    let resume = resume_state(&ptrace::get_regs(tid)?);
    if let Some((_, save)) = via.stub {
        // Before the registers change: the thread goes on from the stub
        // with these if memptrace is gone.
        CodeWriter::open(tid)?.write(save, &stub::save_area(&resume))?;
    }
    let mut regs = resume;
    regs.rax = nr;
    regs.rdi = args[0];
    regs.rsi = args[1];
    regs.rdx = args[2];
    regs.r10 = args[3];
    regs.r8 = args[4];
    regs.r9 = args[5];
    regs.rip = entry;
    ptrace::set_regs(tid, &regs)?;
    super::life::dying::in_call();

    let mut entered = false;
    let patience = Patience::new(tid);
    let result = loop {
        ptrace::syscall(tid)?;
        let Some(stop) = patience.wait_step()? else {
            // Still running our call: stop it and put its registers back.
            let _ = ptrace::interrupt(tid);
            if let Ok(Some(_)) = wait_step(tid) {
                let _ = ptrace::set_regs(tid, &resume);
                return Err(InjectError::Timeout);
            }
            return Err(InjectError::Stuck);
        };
        // Bounded however the thread answers (stops that are neither the
        // call's entry nor its exit, again and again, included).
        if patience.over() && !gone(stop) {
            let _ = ptrace::set_regs(tid, &resume);
            requeue(tid, stop, &signals);
            return Err(InjectError::Timeout);
        }
        match (stop, at_syscall(tid, stop)?) {
            (_, SyscallStop::Entry) => {
                entered = true;
                super::life::dying::in_call();
            }
            (_, SyscallStop::Exit) if entered => break ptrace::get_regs(tid)?.rax,
            // A signal that came before the call: kept, delivered after it.
            (Stop::Signal(sig), SyscallStop::Neither) => signals.push(sig),
            // The wait loop must still see how the thread ended: for the
            // program's leader, that is how the trace ends.
            (stop, _) if gone(stop) => {
                ptrace::keep_for_later(tid, stop);
                return Err(InjectError::Gone);
            }
            _ => {}
        }
    };
    super::life::dying::in_call();
    ptrace::set_regs(tid, &resume)?;
    let as_signed = result as i64;
    if (-4095..0).contains(&as_signed) {
        return Err(InjectError::Errno(-as_signed as i32));
    }
    Ok(Injected {
        value: result,
        signals,
    })
}

/// Run `call` through a copy of the [`stub`] written at `at` (page padding
/// after an image's code, in the process of `tid`) for the time of the
/// call, and put the bytes that were there back afterwards, however the call
/// went. Where the copy cannot be written, `call` goes through `via`'s own
/// instruction.
pub fn through_stub_at<T>(
    tid: Tid,
    at: u64,
    via: Via,
    call: impl FnOnce(Via) -> Result<T, InjectError>,
) -> Result<T, InjectError> {
    let Some(stub) = stub::code() else {
        return call(via.own());
    };
    let Ok(mem) = CodeWriter::open(tid) else {
        return call(via.own());
    };
    let mut original = vec![0u8; stub.code.len()];
    if mem.read_exact(at, &mut original).is_err() {
        return call(via.own());
    }
    if mem.write(at, &stub.code).is_err() {
        let _ = mem.write(at, &original);
        return call(via.own());
    }
    let lent = Via {
        insn: via.insn,
        stub: Some((at, at + stub.save)),
    };
    super::life::dying::lending(true);
    let done = call(lent);
    super::life::dying::lending(false);
    // The thread is out of the stub (its registers are its own again, or it
    // is gone): nothing runs these bytes now.
    let _ = mem.write(at, &original);
    done
}

/// The registers a thread stopped with `regs` goes on with: the same, but
/// a system call of its own that the stop interrupted is set up to run
/// again (`rip` back on its `syscall` instruction, its number in `rax`: what
/// the kernel does on the way out of the stop when no signal handler runs,
/// and `restart_syscall` for a call that left a restart block), no system
/// call counted as in progress (`orig_rax` = -1), and no trap flag.
///
/// A signal memptrace delivers afterwards then finds the thread about to
/// enter its call again, as if it had arrived an instant later; under the
/// stop a handler without SA_RESTART would have seen EINTR. Both are
/// orders in which the program could have run.
pub fn resume_state(regs: &Regs) -> Regs {
    const ERESTARTSYS: i64 = 512;
    const ERESTARTNOINTR: i64 = 513;
    const ERESTARTNOHAND: i64 = 514;
    const ERESTART_RESTARTBLOCK: i64 = 516;
    const TRAP_FLAG: u64 = 1 << 8;
    let mut out = *regs;
    if (regs.orig_rax as i64) >= 0 {
        match -(regs.rax as i64) {
            ERESTARTSYS | ERESTARTNOINTR | ERESTARTNOHAND => {
                out.rax = regs.orig_rax;
                out.rip = regs.rip.wrapping_sub(2);
            }
            ERESTART_RESTARTBLOCK => {
                out.rax = libc::SYS_restart_syscall as u64;
                out.rip = regs.rip.wrapping_sub(2);
            }
            _ => {}
        }
    }
    out.orig_rax = u64::MAX;
    out.eflags &= !TRAP_FLAG;
    out
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
/// routine run twice). So the call is finished first: the thread runs to
/// the call's exit stop, with its result in `rax`. A vfork parent is not
/// let go: it would wait in the kernel for its child, which memptrace may
/// hold.
fn leave_system_call(tid: Tid, signals: &mut Vec<i32>) -> Result<(), InjectError> {
    match ptrace::event_of(tid) {
        Some(
            libc::PTRACE_EVENT_CLONE
            | libc::PTRACE_EVENT_FORK
            | libc::PTRACE_EVENT_EXEC
            | libc::PTRACE_EVENT_VFORK_DONE,
        ) => {}
        Some(libc::PTRACE_EVENT_VFORK) => return Err(InjectError::InVfork),
        Some(libc::PTRACE_EVENT_EXIT) => {
            return Err(InjectError::Gone);
        }
        _ => return Ok(()),
    }
    let patience = Patience::new(tid);
    loop {
        ptrace::syscall(tid)?;
        let stop = patience.wait_step()?;
        if let Some(stop) = stop.filter(|&s| patience.over() && !gone(s)) {
            requeue(tid, stop, signals);
            return Err(InjectError::Timeout);
        }
        let at = match stop {
            Some(stop) => at_syscall(tid, stop)?,
            None => SyscallStop::Neither,
        };
        match stop {
            Some(_) if at == SyscallStop::Exit => return Ok(()),
            Some(Stop::Signal(sig)) if at == SyscallStop::Neither => signals.push(sig),
            // The wait loop must still see how the thread ended (see `syscall`).
            Some(
                stop @ (Stop::Exited(_)
                | Stop::Killed { .. }
                | Stop::Event(libc::PTRACE_EVENT_EXIT)),
            ) => {
                ptrace::keep_for_later(tid, stop);
                return Err(InjectError::Gone);
            }
            Some(_) => {}
            None => {
                let _ = ptrace::interrupt(tid);
                return match wait_step(tid)? {
                    Some(_) => Err(InjectError::Timeout),
                    None => Err(InjectError::Stuck),
                };
            }
        }
    }
}

/// The thread ended (the stop is the wait loop's to see).
fn gone(stop: Stop) -> bool {
    matches!(
        stop,
        Stop::Exited(_) | Stop::Killed { .. } | Stop::Event(libc::PTRACE_EVENT_EXIT)
    )
}

/// Signals a call that gives up took from the thread (`kept`, and `stop`'s
/// own), queued to it again: nothing is lost.
fn requeue(tid: Tid, stop: Stop, kept: &[i32]) {
    let pid = crate::os::procfs::tgid(tid).unwrap_or(tid);
    let own = match stop {
        Stop::Signal(sig) => Some(sig),
        _ => None,
    };
    for &sig in kept.iter().chain(own.iter()) {
        let _ = ptrace::tgkill(pid, tid, sig);
    }
}

/// Whether a thread that reported `stop` after [`ptrace::syscall`] is at a
/// system call's entry or exit. Every thread memptrace runs calls in has
/// TRACESYSGOOD (see [`ptrace::RELEASE_OPTIONS`]), so those stops are
/// [`Stop::Syscall`], never a SIGTRAP.
fn at_syscall(tid: Tid, stop: Stop) -> Result<SyscallStop, InjectError> {
    Ok(match stop {
        Stop::Syscall => ptrace::syscall_stop(tid)?,
        _ => SyscallStop::Neither,
    })
}

/// The next stop of a thread memptrace resumed, within [`STEP_PATIENCE`].
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
    via: Via,
    name: u64,
    len: u64,
    at: Option<u64>,
    signals: &mut Vec<i32>,
) -> Result<(u64, SharedMemory), SharedError> {
    let mut call = |nr: i64, args: [u64; 6]| -> Result<u64, InjectError> {
        let done = syscall(tid, via, nr as u64, args)?;
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
pub fn map_code(tid: Tid, via: Via, addr: u64, len: u64) -> Result<Injected, InjectError> {
    const MAP_FIXED_NOREPLACE: u64 = 0x100000;
    let prot = (libc::PROT_READ | libc::PROT_EXEC) as u64;
    let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64 | MAP_FIXED_NOREPLACE;
    syscall(
        tid,
        via,
        libc::SYS_mmap as u64,
        [addr, len, prot, flags, u64::MAX, 0],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regs(rip: u64, rax: i64, orig_rax: i64) -> Regs {
        let mut r = ptrace::zeroed_regs();
        r.rip = rip;
        r.rax = rax as u64;
        r.orig_rax = orig_rax as u64;
        r.eflags = 0x246 | 0x100;
        r
    }

    #[test]
    fn an_interrupted_call_is_set_up_to_run_again() {
        // read(2) interrupted by the stop: -ERESTARTSYS, its number kept.
        for code in [512, 513, 514] {
            let out = resume_state(&regs(0x1002, -code, 0));
            assert_eq!((out.rip, out.rax, out.orig_rax), (0x1000, 0, u64::MAX));
            assert_eq!(out.eflags, 0x246, "no trap flag");
        }
        // nanosleep: through restart_syscall.
        let out = resume_state(&regs(0x1002, -516, 35));
        assert_eq!(
            (out.rip, out.rax),
            (0x1000, libc::SYS_restart_syscall as u64)
        );
    }

    #[test]
    fn anything_else_goes_on_as_it_was() {
        // A call that returned (a clone's child id), an error that is no
        // restart, a stop outside any call.
        for (rax, orig) in [(4242, 56), (-4, 0), (-512, -1), (7, -1)] {
            let out = resume_state(&regs(0x1002, rax, orig));
            assert_eq!((out.rip, out.rax as i64), (0x1002, rax));
            assert_eq!(out.orig_rax, u64::MAX);
        }
    }
}
