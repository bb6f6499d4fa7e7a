//! The narrow port through which the tracer changes a target: a thread's
//! registers, resuming it or asking it to stop, writing a word into its
//! data (a return address on its stack), and each address space's memory
//! read whole and written as code. [`Live`] is the real target, over
//! `os::ptrace` and `os::mem`; the tests' `fake` holds byte buffers and
//! registers and records what was asked of it, so that attach (planting),
//! detach (restoring, moving threads out of probe code, sending calls in
//! progress home) and space management run in unit tests without a process.
//!
//! Callers take `T: Target` (generic, not `dyn`): the tracer's real target
//! is a unit struct, so every call is the `os` call it stands for, inlined,
//! as before the port existed. The rings are read through `RingBytes` and
//! [`crate::tracer::booking::merge::Rings`], generic too: the hot path (reading
//! records) costs what it did. Only a space's code memory is a
//! `Box<dyn CodeMemory>`: it is written when probes are planted or
//! restored, never per call.
//!
//! Stops are waited for through the port too (`wait_any`, `poll_any`,
//! `wait_tid_until`), as they come from the kernel: one classifier
//! (`tracer::stop`) reads every stop, whatever target gave it. What /proc
//! says of threads (a process's threads, a thread's process, whether it is
//! dying or traced by someone else) is asked here as well, so that
//! attaching, stopping and detaching run on the fake as on a process. Only
//! the system calls memptrace runs inside a thread (`tracer::inject`) are
//! not behind the port.

#[cfg(test)]
pub mod fake;

use std::io;
use std::ops::Range;
use std::time::Instant;

use crate::memory::Memory;
use crate::os::mem::{self, CodeWriter};
use crate::os::procfs::{self, Mapping};
use crate::os::ptrace::{self, Regs, Stop, Tid};

/// One address space's memory as probes change it: read anything (code
/// included, whatever its protection), write code, and say what is mapped
/// where (the images to hook among it).
pub trait CodeMemory: Memory {
    /// Write `bytes` at `addr` (code or data), all or fail.
    fn write_code(&self, addr: u64, bytes: &[u8]) -> io::Result<()>;
    /// The space's memory map, as `/proc/PID/maps` gives it.
    fn maps(&self) -> io::Result<Vec<Mapping>>;
}

impl CodeMemory for CodeWriter {
    fn write_code(&self, addr: u64, bytes: &[u8]) -> io::Result<()> {
        self.write(addr, bytes)
    }

    fn maps(&self) -> io::Result<Vec<Mapping>> {
        Ok(procfs::read_maps(self.pid())?)
    }
}

/// The threads and address spaces the tracer changes.
pub trait Target {
    /// A stopped thread's registers (PTRACE_GETREGS).
    fn regs(&mut self, tid: Tid) -> io::Result<Regs>;
    /// Set a stopped thread's registers (PTRACE_SETREGS).
    fn set_regs(&mut self, tid: Tid, regs: &Regs) -> io::Result<()>;
    /// Resume a stopped thread, delivering `sig` (0: none).
    fn cont(&mut self, tid: Tid, sig: i32) -> io::Result<()>;
    /// Resume a stopped thread for one instruction, delivering `sig`
    /// (PTRACE_SINGLESTEP): into the signal's handler, if it has one.
    fn step(&mut self, tid: Tid, sig: i32) -> io::Result<()>;
    /// The `si_code` of the signal a stopped thread is stopped with
    /// (PTRACE_GETSIGINFO).
    fn si_code(&mut self, tid: Tid) -> io::Result<i32>;
    /// Resume a thread from a group-stop, leaving it stopped (PTRACE_LISTEN).
    fn listen(&mut self, tid: Tid) -> io::Result<()>;
    /// Ask a running thread to stop (PTRACE_INTERRUPT).
    fn interrupt(&mut self, tid: Tid) -> io::Result<()>;
    /// Let a stopped thread go, delivering `sig` (PTRACE_DETACH).
    fn detach(&mut self, tid: Tid, sig: i32) -> io::Result<()>;
    /// Read `len` bytes of process `pid`'s memory at `addr` into `out` (a
    /// stack), as far as they are mapped; the thread need not be stopped.
    fn read_data(&mut self, pid: Tid, addr: u64, len: usize, out: &mut Vec<u8>) -> io::Result<()>;
    /// The word at `addr` in process `pid`'s memory (a return address).
    fn read_word(&mut self, pid: Tid, addr: u64) -> io::Result<u64>;
    /// Write `bytes` into writable memory of process `pid` (a stack slot).
    fn write_data(&mut self, pid: Tid, addr: u64, bytes: &[u8]) -> io::Result<()>;
    /// The code memory of process `pid`, to read it and write probes.
    fn code(&mut self, pid: Tid) -> io::Result<Box<dyn CodeMemory>>;
    /// The mapping of process `pid` that holds `addr` (a thread's stack);
    /// `None` if none does or the maps cannot be read.
    fn mapping_at(&mut self, pid: Tid, addr: u64) -> Option<Range<u64>>;

    // Holding threads.

    /// Trace a running thread with `options` (PTRACE_SEIZE), not stopping it.
    fn seize(&mut self, tid: Tid, options: i32) -> io::Result<()>;
    /// Change a stopped thread's ptrace options (PTRACE_SETOPTIONS).
    fn set_options(&mut self, tid: Tid, options: i32) -> io::Result<()>;
    /// The message of the ptrace event a thread is stopped at (a new
    /// thread's or child's id: PTRACE_GETEVENTMSG).
    fn event_msg(&mut self, tid: Tid) -> io::Result<u64>;
    /// The ptrace event a thread is stopped at (`PTRACE_EVENT_*`), 0 at a
    /// signal-delivery-stop, `None` when it cannot be read (a group-stop).
    fn event_of(&mut self, tid: Tid) -> Option<i32>;
    /// Send signal `sig` to thread `tid` of process `pid` (tgkill).
    fn tgkill(&mut self, pid: Tid, tid: Tid, sig: i32) -> io::Result<()>;

    // Stops.

    /// The next stop of any traced thread, sleeping until there is one;
    /// `Ok(None)` when one of memptrace's signals ended the sleep, ECHILD
    /// when no traced thread is left.
    fn wait_any(&mut self) -> io::Result<Option<(Tid, Stop)>>;
    /// A stop of any traced thread if one is ready, without waiting.
    fn poll_any(&mut self) -> io::Result<Option<(Tid, Stop)>>;
    /// Thread `tid`'s next stop, not waiting past `deadline` (`Ok(None)`).
    fn wait_tid_until(&mut self, tid: Tid, deadline: Instant) -> io::Result<Option<Stop>>;
    /// Keep a stop taken by a wait for one thread, for the wait loop.
    fn keep_for_later(&mut self, tid: Tid, stop: Stop);
    /// The stops kept, oldest first.
    fn take_kept(&mut self) -> Vec<(Tid, Stop)>;

    // What /proc says of threads.

    /// The threads of process `pid`, sorted.
    fn threads(&mut self, pid: Tid) -> io::Result<Vec<Tid>>;
    /// The process thread `tid` belongs to (`Tgid`).
    fn tgid(&mut self, tid: Tid) -> Option<Tid>;
    /// Thread `tid` of `pid` is gone or dying (a zombie).
    fn thread_ending(&mut self, pid: Tid, tid: Tid) -> bool;
    /// The tracer of thread `tid` of `pid` (0 for none).
    fn thread_tracer(&mut self, pid: Tid, tid: Tid) -> Option<Tid>;
    /// Thread `tid` of `pid` has signal `sig` queued, not reported yet
    /// (`SigPnd`: a trap an int3 raised behind a PTRACE_INTERRUPT stop).
    fn signal_pending(&mut self, pid: Tid, tid: Tid, sig: i32) -> bool;
}

/// The real target: every call is the `os` call it names.
#[derive(Clone, Copy, Debug, Default)]
pub struct Live;

impl Target for Live {
    fn regs(&mut self, tid: Tid) -> io::Result<Regs> {
        ptrace::get_regs(tid)
    }

    fn set_regs(&mut self, tid: Tid, regs: &Regs) -> io::Result<()> {
        ptrace::set_regs(tid, regs)
    }

    fn cont(&mut self, tid: Tid, sig: i32) -> io::Result<()> {
        ptrace::cont(tid, sig)
    }

    fn step(&mut self, tid: Tid, sig: i32) -> io::Result<()> {
        ptrace::single_step(tid, sig)
    }

    fn si_code(&mut self, tid: Tid) -> io::Result<i32> {
        Ok(ptrace::siginfo(tid)?.si_code)
    }

    fn listen(&mut self, tid: Tid) -> io::Result<()> {
        ptrace::listen(tid)
    }

    fn interrupt(&mut self, tid: Tid) -> io::Result<()> {
        ptrace::interrupt(tid)
    }

    fn detach(&mut self, tid: Tid, sig: i32) -> io::Result<()> {
        ptrace::detach(tid, sig)
    }

    fn read_data(&mut self, pid: Tid, addr: u64, len: usize, out: &mut Vec<u8>) -> io::Result<()> {
        mem::read_mapped_into(pid, addr, len, out)
    }

    fn read_word(&mut self, pid: Tid, addr: u64) -> io::Result<u64> {
        mem::ProcessMemory(pid).read_u64(addr)
    }

    fn write_data(&mut self, pid: Tid, addr: u64, bytes: &[u8]) -> io::Result<()> {
        mem::write_data(pid, addr, bytes)
    }

    fn code(&mut self, pid: Tid) -> io::Result<Box<dyn CodeMemory>> {
        Ok(Box::new(CodeWriter::open(pid)?))
    }

    fn mapping_at(&mut self, pid: Tid, addr: u64) -> Option<Range<u64>> {
        let maps = procfs::read_maps(pid).ok()?;
        let m = maps.into_iter().find(|m| m.start <= addr && addr < m.end)?;
        Some(m.start..m.end)
    }

    fn seize(&mut self, tid: Tid, options: i32) -> io::Result<()> {
        ptrace::seize(tid, options)
    }

    fn set_options(&mut self, tid: Tid, options: i32) -> io::Result<()> {
        ptrace::set_options(tid, options)
    }

    fn event_msg(&mut self, tid: Tid) -> io::Result<u64> {
        ptrace::event_msg(tid)
    }

    fn event_of(&mut self, tid: Tid) -> Option<i32> {
        ptrace::event_of(tid)
    }

    fn tgkill(&mut self, pid: Tid, tid: Tid, sig: i32) -> io::Result<()> {
        ptrace::tgkill(pid, tid, sig)
    }

    fn wait_any(&mut self) -> io::Result<Option<(Tid, Stop)>> {
        ptrace::wait_any()
    }

    fn poll_any(&mut self) -> io::Result<Option<(Tid, Stop)>> {
        ptrace::poll_any()
    }

    fn wait_tid_until(&mut self, tid: Tid, deadline: Instant) -> io::Result<Option<Stop>> {
        ptrace::wait_tid_until(tid, deadline)
    }

    fn keep_for_later(&mut self, tid: Tid, stop: Stop) {
        ptrace::keep_for_later(tid, stop)
    }

    fn take_kept(&mut self) -> Vec<(Tid, Stop)> {
        ptrace::take_kept()
    }

    fn threads(&mut self, pid: Tid) -> io::Result<Vec<Tid>> {
        procfs::threads(pid)
    }

    fn tgid(&mut self, tid: Tid) -> Option<Tid> {
        procfs::tgid(tid)
    }

    fn thread_ending(&mut self, pid: Tid, tid: Tid) -> bool {
        procfs::thread_ending(pid, tid)
    }

    fn thread_tracer(&mut self, pid: Tid, tid: Tid) -> Option<Tid> {
        procfs::thread_tracer(pid, tid)
    }

    fn signal_pending(&mut self, pid: Tid, tid: Tid, sig: i32) -> bool {
        procfs::signal_pending(pid, tid, sig)
    }
}
