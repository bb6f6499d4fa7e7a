//! The wait loop: every stop of every traced thread comes through here.
//!
//! The tracer owns the processes and threads it traces, their address spaces
//! (`space`) and the book of live blocks (`ledger`). It turns breakpoint
//! stops into calls (`calls`) and hands them, with everything else it learns
//! (images, threads), to the pipeline thread in batches. It never writes a
//! database and never unwinds with framehop itself: the stop path stays short.
//!
//! Rules it keeps (`ptrace(2)`): threads are seized, so group-stops are seen as
//! PTRACE_EVENT_STOP and answered with PTRACE_LISTEN; signals are re-injected
//! with their number, real-time ones included; a SIGTRAP that is not one of
//! memptrace's int3s is delivered to the program.

mod attach;
mod calls;
mod callsite;
mod children;
mod copies;
mod detach;
mod images;
mod inject;
mod ledger;
mod space;
mod trampoline;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::event::Op;
use crate::os::ptrace::{self, Stop, Tid};
use crate::os::{procfs, signals};
use crate::sink::{Record, SinkError, ThreadRecord};
use crate::unwind::UnwinderKind;
use crate::unwind::libunwind::LibunwindUnwinder;
use crate::unwind::pipeline::{CallStack, PipelineHandle, TraceMsg};
use ledger::Ledger;
use space::Space;

pub use trampoline::RelocateError;

/// What to record.
#[derive(Clone, Debug)]
pub struct TraceOptions {
    pub max_depth: usize,
    pub unwinder: UnwinderKind,
    /// Take a stack for each call (`--no-stacks` turns it off).
    pub stacks: bool,
    /// With stacks: unwind every Nth call of each call site only (1: all).
    pub stack_every: u64,
    /// Trace forked children too (`-f`); otherwise they are released.
    pub follow_forks: bool,
    /// Detach once this much time has passed (`attach --duration`).
    pub duration: Option<Duration>,
}

/// How a trace ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The program exited with this status.
    Exited(i32),
    /// The program was killed by this signal.
    Killed { sig: i32, core: bool },
    /// memptrace stopped tracing and detached; the program runs on.
    Detached { reason: String },
}

/// Counters the progress line reads while the trace runs.
#[derive(Default)]
pub struct Progress {
    pub events: AtomicU64,
    pub live_bytes: AtomicU64,
}

/// Things worth telling the user after the trace.
#[derive(Clone, Debug, Default)]
pub struct TraceStats {
    /// Allocator entries while the same thread was already inside the allocator.
    pub nested_calls: u64,
    /// Calls whose return never came back through memptrace (longjmp out of the
    /// allocator, or in flight at detach).
    pub lost_returns: u64,
    /// Stack copies by the thread itself that ran into unmapped memory (read
    /// by memptrace instead; the program never saw the fault).
    pub copy_faults: u64,
    /// Images found, and the allocator functions hooked in them.
    pub images: u64,
    pub hooked_functions: u64,
    pub warnings: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("a ptrace request failed")]
    Ptrace(#[from] io::Error),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("no process {0}")]
    NoSuchProcess(Tid),
    #[error("{tid} is a thread of process {pid}: attach to the process")]
    NotAProcess { tid: Tid, pid: Tid },
    #[error("not permitted to trace process {pid}")]
    Denied {
        pid: Tid,
        source: io::Error,
        /// The process already tracing it, if any (`TracerPid`).
        tracer: Option<Tid>,
    },
    #[error("no allocator function (malloc, free, ...) in any image of process {0}")]
    NoAllocator(Tid),
}

/// The role of a traced process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Launched, not yet through its first execve.
    Prelaunch,
    Traced,
    /// A vfork child (or a clone sharing memory): it runs in its parent's
    /// address space, breakpoints included, until it execs. Its calls are not
    /// recorded; it is released when it execs or exits.
    Shares {
        parent: Tid,
    },
}

struct Process {
    role: Role,
    space: Option<Space>,
}

/// A call that entered the allocator and has not returned yet.
#[derive(Debug)]
struct PendingCall {
    op: Op,
    args: [u64; 3],
    /// rsp at entry: where the caller's return address sits.
    entry_sp: u64,
    /// The slot's call stub the thread went through (see
    /// `trampoline::slot_code`): the call returns to its int3.
    stub: u64,
    stack: CallStack,
    module_id: u64,
}

struct Thread {
    pid: Tid,
    in_call: Option<PendingCall>,
    /// The memory mapping that holds this thread's stack.
    stack: Option<Range<u64>>,
    start_ns: u64,
    /// A stack copy the thread was sent to make, not taken yet.
    copy: Option<copies::PendingCopy>,
}

/// A child announced by a clone/fork/vfork event, before its first stop.
#[derive(Clone, Copy, Debug)]
enum Child {
    Thread { pid: Tid },
    Fork { parent: Tid },
    Shared { parent: Tid },
}

/// How long the tracer polls for the next stop before it sleeps.
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// Messages per batch sent to the pipeline.
const BATCH: usize = 1024;

/// Bytes of stack copies per batch, at most (about 32 calls with deep
/// stacks): the pipeline's queue holds 32 batches, so what waits for
/// unwinding stays near 32 MiB however deep the program's stacks are.
const BATCH_BYTES: usize = 1 << 20;

pub struct Tracer {
    opts: TraceOptions,
    clock: Instant,
    pipeline: PipelineHandle,
    batch: Vec<TraceMsg>,
    /// Bytes of stack copies in `batch`.
    batch_bytes: usize,
    /// Calls in `batch` (by index) waiting for the copy their thread makes.
    awaiting: BTreeMap<usize, Tid>,
    processes: HashMap<Tid, Process>,
    threads: HashMap<Tid, Thread>,
    /// First stops of threads whose creation event has not been seen yet.
    early: HashMap<Tid, Stop>,
    /// Children announced whose first stop has not been seen yet.
    announced: HashMap<Tid, Child>,
    ledger: Ledger,
    next_module_id: u64,
    root: Tid,
    ending: Option<Ending>,
    /// libunwind's state per traced process (`--unwinder libunwind` only):
    /// images of different processes may share addresses.
    libunwind: HashMap<Tid, LibunwindUnwinder>,
    aliases: HashMap<(Tid, u64), Op>,
    /// Calls seen per call site (pid, return address), for `stack_every`.
    sites: HashMap<(Tid, u64), u64>,
    progress: Arc<Progress>,
    stats: TraceStats,
    last_tick: u32,
    /// memptrace attached to a running process (rather than launching it):
    /// the first Ctrl-C ends the trace, since it cannot reach the program.
    attached: bool,
    deadline: Option<Instant>,
}

impl Tracer {
    /// A tracer for the launched (seized, not yet exec'd) process `root`.
    pub fn new(
        opts: TraceOptions,
        pipeline: PipelineHandle,
        root: Tid,
        clock: Instant,
        progress: Arc<Progress>,
    ) -> io::Result<Tracer> {
        let mut tracer = Tracer::blank(opts, pipeline, root, clock, progress)?;
        tracer.processes.insert(
            root,
            Process {
                role: Role::Prelaunch,
                space: None,
            },
        );
        tracer.add_thread(root, root);
        Ok(tracer)
    }

    /// A tracer that traces nothing yet.
    fn blank(
        opts: TraceOptions,
        pipeline: PipelineHandle,
        root: Tid,
        clock: Instant,
        progress: Arc<Progress>,
    ) -> io::Result<Tracer> {
        let deadline = opts.duration.map(|d| Instant::now() + d);
        Ok(Tracer {
            opts,
            clock,
            pipeline,
            batch: Vec::with_capacity(BATCH),
            batch_bytes: 0,
            awaiting: BTreeMap::new(),
            processes: HashMap::new(),
            threads: HashMap::new(),
            early: HashMap::new(),
            announced: HashMap::new(),
            ledger: Ledger::new(),
            next_module_id: 0,
            root,
            ending: None,
            libunwind: HashMap::new(),
            aliases: HashMap::new(),
            sites: HashMap::new(),
            progress,
            stats: TraceStats::default(),
            last_tick: signals::ticks(),
            attached: false,
            deadline,
        })
    }

    pub fn stats(&self) -> &TraceStats {
        &self.stats
    }

    /// Trace until the program exits or memptrace is told to stop; then hand
    /// the pipeline everything still batched. Consumes the tracer's pipeline.
    pub fn run(mut self) -> Result<(Ending, TraceStats, PipelineHandle), TraceError> {
        let ending = self.wait_loop();
        self.settle_all(false);
        let flushed = self.flush();
        let ending = ending?;
        flushed?;
        let stats = std::mem::take(&mut self.stats);
        Ok((ending, stats, self.pipeline))
    }

    fn wait_loop(&mut self) -> Result<Ending, TraceError> {
        loop {
            if let Some(reason) = self.stop_requested() {
                self.detach_all()?;
                return Ok(Ending::Detached { reason });
            }
            if self.processes.is_empty() && self.announced.is_empty() {
                break;
            }
            if self.batch.len() >= BATCH || self.batch_bytes >= BATCH_BYTES || self.ticked() {
                self.flush()?;
            }
            match self.next_stop() {
                Ok(Some((tid, stop))) => self.dispatch(tid, stop)?,
                Ok(None) => {}
                Err(err) if ptrace::no_children(&err) => break,
                Err(err) => return Err(err.into()),
            }
        }
        Ok(self.ending.clone().unwrap_or(Ending::Exited(0)))
    }

    /// The next stop of any traced thread. Polls for a while before sleeping
    /// in waitpid: on virtual machines, waking a tracer whose CPU went idle
    /// costs far more than the stop itself (measured in docs/performance.md),
    /// and an allocating program stops again within microseconds. Whatever is
    /// batched goes to the pipeline before sleeping.
    fn next_stop(&mut self) -> io::Result<Option<(Tid, Stop)>> {
        let deadline = Instant::now() + SPIN;
        loop {
            if let Some(found) = ptrace::poll_any()? {
                return Ok(Some(found));
            }
            if Instant::now() >= deadline {
                break;
            }
            std::hint::spin_loop();
        }
        if self.flush().is_err() {
            // The pipeline is gone; the wait loop finds out when it sends next.
        }
        ptrace::wait_any()
    }

    /// SIGTERM or SIGHUP ends the trace, and so does Ctrl-C: the second one
    /// for a launched program (the first reaches the program, in the same
    /// process group, which decides), the first one when attached. So does
    /// the end of `--duration`.
    fn stop_requested(&self) -> Option<String> {
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

    fn ticked(&mut self) -> bool {
        let now = signals::ticks();
        let ticked = now != self.last_tick;
        self.last_tick = now;
        ticked
    }

    /// Hand the batch to the pipeline, up to the first call still waiting for
    /// its thread's stack copy (see [`copies`]).
    fn flush(&mut self) -> Result<(), TraceError> {
        if !self.awaiting.is_empty() {
            self.settle_finished();
        }
        let n = self.sendable();
        if n == 0 && !self.batch.is_empty() {
            return Ok(());
        }
        let rest = self.batch.split_off(n);
        let batch = std::mem::replace(&mut self.batch, rest);
        self.shift_awaiting(n);
        self.batch_bytes = 0;
        self.pipeline.send(batch)?;
        Ok(())
    }

    fn now_ns(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    fn send(&mut self, msg: TraceMsg) {
        self.batch.push(msg);
    }

    fn add_thread(&mut self, tid: Tid, pid: Tid) {
        let start_ns = self.now_ns();
        self.threads.insert(
            tid,
            Thread {
                pid,
                in_call: None,
                stack: None,
                start_ns,
                copy: None,
            },
        );
        self.send_thread(tid, None);
    }

    fn send_thread(&mut self, tid: Tid, end_ns: Option<u64>) {
        let Some(thread) = self.threads.get(&tid) else {
            return;
        };
        let record = ThreadRecord {
            tid: tid as u32,
            pid: thread.pid as u32,
            name: procfs::thread_name(thread.pid, tid).unwrap_or_default(),
            start_ns: thread.start_ns,
            end_ns,
        };
        self.send(TraceMsg::Record(Record::Thread(record)));
    }

    /// Resume a thread, delivering `sig`. A thread that vanished meanwhile
    /// (killed) is not an error: its exit is reported by waitpid.
    fn resume(&mut self, tid: Tid, sig: i32) -> Result<(), TraceError> {
        match ptrace::cont(tid, sig) {
            Err(err) if err.raw_os_error() == Some(libc::ESRCH) => Ok(()),
            other => Ok(other?),
        }
    }

    fn dispatch(&mut self, tid: Tid, stop: Stop) -> Result<(), TraceError> {
        let Some(thread) = self.threads.get(&tid) else {
            return self.unknown(tid, stop);
        };
        if thread.copy.is_some() {
            self.settle_at_stop(tid, &stop);
        }
        match stop {
            Stop::Exited(_) | Stop::Killed { .. } => self.thread_gone(tid, stop),
            Stop::Signal(libc::SIGTRAP) => self.trap(tid),
            Stop::Signal(libc::SIGSEGV | libc::SIGBUS) if self.copy_faulted(tid) => {
                self.recover_copy(tid)
            }
            Stop::Signal(sig) => self.resume(tid, sig),
            Stop::Event(event) => self.ptrace_event(tid, event),
            Stop::EventStop(_) | Stop::Syscall => self.resume_from(tid, stop),
        }
    }

    /// A stop of a thread we do not know yet: a new thread or child whose
    /// creation event is still queued behind it.
    fn unknown(&mut self, tid: Tid, stop: Stop) -> Result<(), TraceError> {
        if matches!(stop, Stop::Exited(_) | Stop::Killed { .. }) {
            // A thread that vanished in an exec, or a released child.
            self.announced.remove(&tid);
            return Ok(());
        }
        match self.announced.remove(&tid) {
            Some(child) => self.adopt(tid, child, stop),
            None => {
                self.early.insert(tid, stop);
                Ok(())
            }
        }
    }

    fn ptrace_event(&mut self, tid: Tid, event: i32) -> Result<(), TraceError> {
        match event {
            libc::PTRACE_EVENT_CLONE | libc::PTRACE_EVENT_FORK | libc::PTRACE_EVENT_VFORK => {
                self.announce_child(tid, event, false)?;
                self.resume(tid, 0)
            }
            libc::PTRACE_EVENT_EXEC => self.exec(tid),
            libc::PTRACE_EVENT_EXIT => {
                let end = self.now_ns();
                self.send_thread(tid, Some(end));
                if let Some(thread) = self.threads.get_mut(&tid) {
                    if thread.in_call.take().is_some() {
                        self.stats.lost_returns += 1;
                    }
                }
                self.resume(tid, 0)
            }
            _ => self.resume(tid, 0),
        }
    }

    /// Resume a thread from a PTRACE_EVENT_STOP (or a syscall stop). A
    /// group-stop (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU) is not ended: the
    /// thread stays stopped, listening for SIGCONT, as it would untraced.
    fn resume_from(&mut self, tid: Tid, stop: Stop) -> Result<(), TraceError> {
        match stop {
            Stop::EventStop(sig) if is_stopping_signal(sig) => match ptrace::listen(tid) {
                Err(err) if err.raw_os_error() == Some(libc::ESRCH) => Ok(()),
                other => Ok(other?),
            },
            _ => self.resume(tid, 0),
        }
    }

    /// Resume a thread delivering the first signal now and queueing the rest.
    fn resume_with(&mut self, tid: Tid, signals: Vec<i32>) -> Result<(), TraceError> {
        let pid = self.threads.get(&tid).map_or(tid, |t| t.pid);
        for &sig in signals.iter().skip(1) {
            let _ = ptrace::tgkill(pid, tid, sig);
        }
        self.resume(tid, signals.first().copied().unwrap_or(0))
    }

    fn thread_gone(&mut self, tid: Tid, stop: Stop) -> Result<(), TraceError> {
        self.settle_copy(tid, false);
        if let Some(b) = self.space_of_mut(tid).and_then(|s| s.buffers.as_mut()) {
            b.release(tid);
        }
        let Some(thread) = self.threads.remove(&tid) else {
            return Ok(());
        };
        if let Some(lu) = self.libunwind.get_mut(&thread.pid) {
            lu.forget_thread(tid);
        }
        if thread.in_call.is_some() {
            self.stats.lost_returns += 1;
        }
        if tid != thread.pid {
            return Ok(());
        }
        // The leader's exit is reported last: the whole process is gone.
        let others: Vec<Tid> = self
            .threads
            .iter()
            .filter(|(_, t)| t.pid == tid)
            .map(|(&t, _)| t)
            .collect();
        for t in others {
            self.settle_copy(t, false);
        }
        let process = self.processes.remove(&tid);
        self.threads.retain(|_, t| t.pid != tid);
        self.libunwind.remove(&tid);
        if let Some(process) = process {
            if matches!(process.role, Role::Traced | Role::Prelaunch) {
                self.send(TraceMsg::ProcessGone { pid: tid as u32 });
                self.ledger.forget_process(tid as u32);
            }
            if let Some(space) = process.space {
                self.release_sharers(tid, space)?;
            }
        }
        if tid == self.root {
            self.ending = Some(match stop {
                Stop::Killed { sig, core } => Ending::Killed { sig, core },
                Stop::Exited(code) => Ending::Exited(code),
                _ => Ending::Exited(0),
            });
        }
        Ok(())
    }
}

fn is_stopping_signal(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
    )
}

/// "SIGTERM" for 15, and so on.
pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {sig}"))
}

impl Progress {
    fn update(&self, ledger: &Ledger) {
        self.events.store(ledger.events(), Ordering::Relaxed);
        self.live_bytes
            .store(ledger.live_bytes(), Ordering::Relaxed);
    }
}
