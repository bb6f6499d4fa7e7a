//! ptrace(2) and waitpid(2), called through libc.
//!
//! nix's `waitpid` rejects the status of a real-time-signal stop (EINVAL) and
//! loses that stop, and nix has no PTRACE_LISTEN: every request here goes
//! through `libc::ptrace` directly, with the tid as a plain `i32`.

use std::io;

pub use libc::user_regs_struct as Regs;

/// A thread id, as the kernel uses it (a process id is its leader's thread id).
pub type Tid = i32;

const PTRACE_EVENT_STOP: i32 = 128;

/// Options set on a launched program (`ptrace(2)`, PTRACE_SETOPTIONS). EXITKILL
/// makes the kernel kill it when memptrace dies: it was started under
/// memptrace, and is never left running with int3 bytes in it and nobody to
/// handle them.
pub const OPTIONS: libc::c_int = libc::PTRACE_O_TRACESYSGOOD
    | libc::PTRACE_O_EXITKILL
    | libc::PTRACE_O_TRACECLONE
    | libc::PTRACE_O_TRACEFORK
    | libc::PTRACE_O_TRACEVFORK
    | libc::PTRACE_O_TRACEVFORKDONE
    | libc::PTRACE_O_TRACEEXEC
    | libc::PTRACE_O_TRACEEXIT;

/// Options set on a process memptrace attaches to: the same without EXITKILL.
/// memptrace's death must not kill a process the user did not start under it
/// (its probes fail open: see `tracer::failopen`). Threads and children the
/// kernel attaches automatically get their parent's options, so none of the
/// process's own threads or children gets EXITKILL either.
pub const ATTACH_OPTIONS: libc::c_int = OPTIONS & !libc::PTRACE_O_EXITKILL;

/// Options left on a thread memptrace is letting go but may still run a
/// system call in (a vfork parent at detach): nothing it makes is attached
/// any more, but a syscall-stop still reads as one. Without TRACESYSGOOD
/// a syscall-stop is a plain SIGTRAP stop, and a thread the kernel lets go
/// from it, when memptrace dies, is sent that SIGTRAP (`ptrace_report_syscall`
/// sends the stop's code as a signal; SIGTRAP | 0x80 is no signal).
pub const RELEASE_OPTIONS: libc::c_int = libc::PTRACE_O_TRACESYSGOOD;

fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn request(req: libc::c_uint, tid: Tid, addr: usize, data: usize) -> io::Result<libc::c_long> {
    // SAFETY: ptrace with integer arguments; pointers passed as `data` by the
    // callers below point to live, correctly sized buffers.
    check(unsafe { libc::ptrace(req, tid, addr, data) })
}

/// PTRACE_SEIZE with `options`: attach without stopping the thread.
pub fn seize(tid: Tid, options: libc::c_int) -> io::Result<()> {
    request(libc::PTRACE_SEIZE, tid, 0, options as usize).map(drop)
}

/// PTRACE_SETOPTIONS (the thread must be stopped).
pub fn set_options(tid: Tid, options: libc::c_int) -> io::Result<()> {
    request(libc::PTRACE_SETOPTIONS, tid, 0, options as usize).map(drop)
}

/// PTRACE_INTERRUPT: make a seized thread report a PTRACE_EVENT_STOP.
pub fn interrupt(tid: Tid) -> io::Result<()> {
    request(libc::PTRACE_INTERRUPT, tid, 0, 0).map(drop)
}

/// Resume a stopped thread, delivering `sig` (0 for none).
pub fn cont(tid: Tid, sig: i32) -> io::Result<()> {
    request(libc::PTRACE_CONT, tid, 0, sig as usize).map(drop)
}

/// Leave a thread in group-stop but let the tracer hear when it ends
/// (`ptrace(2)`, "Group-stop": PTRACE_LISTEN, for seized tracees only).
pub fn listen(tid: Tid) -> io::Result<()> {
    request(libc::PTRACE_LISTEN, tid, 0, 0).map(drop)
}

/// Resume a stopped thread until it enters or leaves a system call
/// (PTRACE_SYSCALL; with TRACESYSGOOD, a [`Stop::Syscall`]). Unlike a
/// single step it leaves no trap flag behind: a thread the kernel lets go
/// when memptrace dies runs on without a SIGTRAP.
pub fn syscall(tid: Tid) -> io::Result<()> {
    request(libc::PTRACE_SYSCALL, tid, 0, 0).map(drop)
}

/// Where a thread stopped after [`syscall`] stands: entering a system call,
/// leaving one, or neither (a signal-delivery-stop). Told by
/// PTRACE_GET_SYSCALL_INFO, which needs no TRACESYSGOOD (a thread memptrace
/// is letting go may have had its options cleared).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyscallStop {
    Entry,
    Exit,
    Neither,
}

pub fn syscall_stop(tid: Tid) -> io::Result<SyscallStop> {
    // SAFETY: an all-zero ptrace_syscall_info is a valid value (integers
    // and a union of integer arrays).
    let mut info: libc::ptrace_syscall_info = unsafe { std::mem::zeroed() };
    request(
        libc::PTRACE_GET_SYSCALL_INFO,
        tid,
        std::mem::size_of_val(&info),
        &mut info as *mut _ as usize,
    )?;
    Ok(match info.op {
        libc::PTRACE_SYSCALL_INFO_ENTRY => SyscallStop::Entry,
        libc::PTRACE_SYSCALL_INFO_EXIT => SyscallStop::Exit,
        _ => SyscallStop::Neither,
    })
}

/// Resume a stopped thread for one instruction, delivering `sig` (0 for
/// none). With a signal that has a handler, the thread stops at the
/// handler's first instruction instead (`ptrace(2)`, PTRACE_SINGLESTEP).
pub fn single_step(tid: Tid, sig: i32) -> io::Result<()> {
    request(libc::PTRACE_SINGLESTEP, tid, 0, sig as usize).map(drop)
}

pub fn detach(tid: Tid, sig: i32) -> io::Result<()> {
    request(libc::PTRACE_DETACH, tid, 0, sig as usize).map(drop)
}

/// A register file of zeros (a valid value: plain integers).
pub fn zeroed_regs() -> Regs {
    // SAFETY: user_regs_struct is plain integers; zero is a valid value.
    unsafe { std::mem::zeroed() }
}

pub fn get_regs(tid: Tid) -> io::Result<Regs> {
    let mut regs = std::mem::MaybeUninit::<Regs>::uninit();
    request(libc::PTRACE_GETREGS, tid, 0, regs.as_mut_ptr() as usize)?;
    // SAFETY: the kernel filled the whole struct when the call succeeded.
    Ok(unsafe { regs.assume_init() })
}

pub fn set_regs(tid: Tid, regs: &Regs) -> io::Result<()> {
    request(libc::PTRACE_SETREGS, tid, 0, regs as *const Regs as usize).map(drop)
}

/// PTRACE_GETEVENTMSG: the new tid after a clone/fork event, the former tid
/// after exec, the exit status at PTRACE_EVENT_EXIT.
pub fn event_msg(tid: Tid) -> io::Result<u64> {
    let mut msg: libc::c_ulong = 0;
    request(
        libc::PTRACE_GETEVENTMSG,
        tid,
        0,
        &mut msg as *mut libc::c_ulong as usize,
    )?;
    Ok(msg)
}

pub fn siginfo(tid: Tid) -> io::Result<libc::siginfo_t> {
    let mut info = std::mem::MaybeUninit::<libc::siginfo_t>::zeroed();
    request(libc::PTRACE_GETSIGINFO, tid, 0, info.as_mut_ptr() as usize)?;
    // SAFETY: zero-initialised and filled by the kernel.
    Ok(unsafe { info.assume_init() })
}

/// Write one machine word of the tracee (PTRACE_POKEDATA writes through
/// read-only code mappings, which process_vm_writev cannot).
pub fn poke(tid: Tid, addr: u64, word: u64) -> io::Result<()> {
    request(libc::PTRACE_POKEDATA, tid, addr as usize, word as usize).map(drop)
}

/// What waitpid reported about one thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The thread (or, for a leader, the whole process) exited with this code.
    Exited(i32),
    /// It was killed by this signal.
    Killed { sig: i32, core: bool },
    /// Signal-delivery-stop: the thread is about to receive `sig`.
    Signal(i32),
    /// PTRACE_EVENT_{FORK,VFORK,CLONE,EXEC,EXIT} stop.
    Event(i32),
    /// PTRACE_EVENT_STOP: group-stop (sig is the stopping signal), the first stop of
    /// an auto-attached thread, or a PTRACE_INTERRUPT.
    EventStop(i32),
    /// Syscall-stop: only while memptrace runs a system call in the thread
    /// (see `tracer::inject`).
    Syscall,
}

impl Stop {
    /// Decode a waitpid status word (`wait(2)`, `ptrace(2)` "Stopped states").
    pub fn decode(status: i32) -> Stop {
        if libc::WIFEXITED(status) {
            return Stop::Exited(libc::WEXITSTATUS(status));
        }
        if libc::WIFSIGNALED(status) {
            return Stop::Killed {
                sig: libc::WTERMSIG(status),
                core: libc::WCOREDUMP(status),
            };
        }
        let sig = libc::WSTOPSIG(status);
        let event = (status >> 16) & 0xff;
        if event == PTRACE_EVENT_STOP {
            Stop::EventStop(sig)
        } else if event != 0 {
            Stop::Event(event)
        } else if sig == (libc::SIGTRAP | 0x80) {
            Stop::Syscall
        } else {
            Stop::Signal(sig)
        }
    }
}

/// waitpid for any traced thread (`__WALL`: threads and processes alike). An
/// interrupted wait (one of memptrace's own signals) returns `Ok(None)`, and so
/// does ECHILD, which means nothing is left to wait for: callers tell the two
/// apart with [`no_children`] semantics via their own bookkeeping.
pub fn wait_any() -> io::Result<Option<(Tid, Stop)>> {
    wait(-1, 0)
}

/// Wait for the end of process `pid`, a child of memptrace's that it no
/// longer traces (only its exit is reported then).
pub fn wait_exit(pid: Tid) -> io::Result<Stop> {
    loop {
        if let Some((_, stop @ (Stop::Exited(_) | Stop::Killed { .. }))) = wait(pid, 0)? {
            return Ok(stop);
        }
    }
}

/// Non-blocking wait for any traced thread.
pub fn poll_any() -> io::Result<Option<(Tid, Stop)>> {
    wait(-1, libc::WNOHANG)
}

/// Stops taken by a wait for one thread that the wait loop must still serve
/// (a thread that exited, or was killed, while memptrace ran a system call
/// in it): its exit status is how the program ended.
static KEPT: std::sync::Mutex<Vec<(Tid, Stop)>> = std::sync::Mutex::new(Vec::new());

/// Keep `stop` of `tid` for the wait loop (see [`take_kept`]).
pub fn keep_for_later(tid: Tid, stop: Stop) {
    KEPT.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((tid, stop));
}

/// The stops kept by [`keep_for_later`], oldest first.
pub fn take_kept() -> Vec<(Tid, Stop)> {
    std::mem::take(&mut *KEPT.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Wait for one thread's next stop, but not past `deadline`: `Ok(None)`
/// when it has not stopped by then. It polls (a stop is usually there
/// within microseconds: a single step, an injected call) and then sleeps in
/// short steps, so that no wait of memptrace's can last forever, whatever
/// the thread does (blocks in the kernel, or is never scheduled).
pub fn wait_tid_until(tid: Tid, deadline: std::time::Instant) -> io::Result<Option<Stop>> {
    let mut round = 0u32;
    loop {
        if let Some((_, stop)) = wait(tid, libc::WNOHANG)? {
            return Ok(Some(stop));
        }
        if std::time::Instant::now() >= deadline {
            return Ok(None);
        }
        round += 1;
        if round < 64 {
            std::thread::yield_now();
        } else {
            let pause = if round < 256 { 20 } else { 200 };
            std::thread::sleep(std::time::Duration::from_micros(pause));
        }
    }
}

/// The ptrace event a thread is stopped at (`PTRACE_EVENT_*`, from the
/// `si_code` of its stop), 0 for a signal-delivery-stop, `None` when it
/// cannot be read (a group-stop has no siginfo).
pub fn event_of(tid: Tid) -> Option<i32> {
    let info = siginfo(tid).ok()?;
    Some(if info.si_signo == libc::SIGTRAP {
        info.si_code >> 8
    } else {
        0
    })
}

fn wait(pid: Tid, flags: i32) -> io::Result<Option<(Tid, Stop)>> {
    let mut status = 0;
    // SAFETY: waitpid with a valid out pointer.
    let ret = unsafe { libc::waitpid(pid, &mut status, libc::__WALL | flags) };
    match ret {
        0 => Ok(None),
        -1 => {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => Ok(None),
                _ => Err(err),
            }
        }
        tid => Ok(Some((tid, Stop::decode(status)))),
    }
}

/// A request's result, with ESRCH taken as done: the thread vanished
/// (killed, or exited meanwhile), which waitpid reports in its own time.
pub fn unless_gone(result: io::Result<()>) -> io::Result<()> {
    match result {
        Err(err) if err.raw_os_error() == Some(libc::ESRCH) => Ok(()),
        other => other,
    }
}

/// True when an error from a wait means "no traced thread is left".
pub fn no_children(err: &io::Error) -> bool {
    err.raw_os_error() == Some(libc::ECHILD)
}

/// Send a signal to one thread (tgkill).
pub fn tgkill(pid: Tid, tid: Tid, sig: i32) -> io::Result<()> {
    // SAFETY: plain syscall with integer arguments.
    check(unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, sig) }).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_wait_statuses() {
        assert_eq!(Stop::decode(3 << 8), Stop::Exited(3));
        assert_eq!(
            Stop::decode(libc::SIGSEGV),
            Stop::Killed {
                sig: libc::SIGSEGV,
                core: false
            }
        );
        let stopped = |sig: i32, event: i32| (event << 16) | (sig << 8) | 0x7f;
        assert_eq!(
            Stop::decode(stopped(libc::SIGTRAP, 0)),
            Stop::Signal(libc::SIGTRAP)
        );
        // Real-time signals must survive decoding: nix loses them.
        assert_eq!(
            Stop::decode(stopped(libc::SIGRTMIN() + 3, 0)),
            Stop::Signal(libc::SIGRTMIN() + 3)
        );
        assert_eq!(
            Stop::decode(stopped(libc::SIGTRAP, libc::PTRACE_EVENT_CLONE)),
            Stop::Event(libc::PTRACE_EVENT_CLONE)
        );
        assert_eq!(
            Stop::decode(stopped(libc::SIGSTOP, PTRACE_EVENT_STOP)),
            Stop::EventStop(libc::SIGSTOP)
        );
        assert_eq!(
            Stop::decode(stopped(libc::SIGTRAP | 0x80, 0)),
            Stop::Syscall
        );
    }
}
