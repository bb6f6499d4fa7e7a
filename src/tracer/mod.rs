//! The wait loop: every stop of every traced thread comes through here.
//!
//! The tracer owns the processes and threads it traces (`process`), their
//! address spaces (`space`) with the probes planted in them (`probes`). Its
//! parts, each over the OS port (`target`, faked in unit tests):
//!
//! - `engine`: the wait loop and its dispatch (`stop` classifies a stop,
//!   `stops` serves stopped threads in turn);
//! - `life`: the lifecycle: attaching, stopping every thread, children
//!   born, and the detach;
//! - `serve`: the stops a running trace still makes (int3 calls, signal
//!   handlers, mapping calls, a jump probe's thread without a slot);
//! - `booking`: calls made into events, with the book of live blocks
//!   (`ledger`), what the jump probes recorded (`rings`, put in order by
//!   `merge`), stacks the threads copied (`copies`), and everything handed
//!   to the pipeline thread in batches (`outbox`);
//! - `images` and `heapmaps`: the images found and hooked, and the heap
//!   maps taken.
//!
//! It never writes a database and never unwinds with framehop itself: the
//! stop path stays short.
//!
//! Rules it keeps (`ptrace(2)`): threads are seized, so group-stops are seen as
//! PTRACE_EVENT_STOP and answered with PTRACE_LISTEN; signals are re-injected
//! with their number, real-time ones included; a SIGTRAP that is not one of
//! memptrace's int3s is delivered to the program. Stopped threads are served
//! in turn (`stops`), so that a traced program's threads keep their relative
//! speeds.

mod booking;
mod engine;
mod heapmaps;
mod images;
mod inject;
mod life;
mod probes;
mod process;
mod running;
mod serve;
mod space;
mod stop;
mod stops;
mod target;

pub use life::pauses;

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::heap;
use crate::os::ptrace::Tid;
use crate::os::{procfs, signals};
use crate::progress::Progress;
use crate::sink::SinkError;
use crate::trace_msg::TraceMsg;
use crate::unwind::UnwinderKind;
use crate::unwind::pipeline::PipelineHandle;
use booking::Booking;
use booking::merge::TscClock;
use booking::outbox::Outbox;
use images::Images;
use life::Life;
use process::{Family, Process, Role};
use serve::calls::Serve;
use space::Catch;
use stops::Stops;
use target::Live;

pub use probes::int3::RelocateError;

/// How the calls of allocator functions are caught (`--probes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ProbeMode {
    /// A jump to code that records each call inside the target, with no
    /// stop (an int3 sends the thread there where a jump is not safe).
    #[default]
    Jump,
    /// An int3 on each entry: a ptrace stop per call (the reference).
    Int3,
}

impl ProbeMode {
    pub fn name(self) -> &'static str {
        match self {
            ProbeMode::Jump => "jump",
            ProbeMode::Int3 => "int3",
        }
    }
}

/// What to record.
#[derive(Clone, Debug)]
pub struct TraceOptions {
    pub probes: ProbeMode,
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

#[cfg(test)]
impl TraceOptions {
    /// Options for unit tests: int3 probes, stacks (`stacks`) of every
    /// call unwound by framehop.
    pub(crate) fn for_tests(stacks: bool) -> TraceOptions {
        TraceOptions {
            probes: ProbeMode::Int3,
            max_depth: 8,
            unwinder: UnwinderKind::Framehop,
            stacks,
            stack_every: 1,
            follow_forks: false,
            duration: None,
        }
    }
}

impl TraceOptions {
    /// How the allocator functions of a new address space are caught: jump
    /// probes unless int3 probes are asked for (or libunwind, which walks a
    /// stopped thread's stack, unwinds); `alive_ticks`: see [`life::failopen`].
    fn catch(&self, alive_ticks: u64) -> Catch {
        let libunwind = self.stacks && self.unwinder == UnwinderKind::Libunwind;
        if self.probes == ProbeMode::Jump && !libunwind {
            let max_frames = if self.stacks {
                self.max_depth as u64
            } else {
                1
            };
            Catch::Jump {
                max_frames,
                alive_ticks,
            }
        } else {
            Catch::Int3 {
                buffers: booking::copies::wanted(self),
            }
        }
    }
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
    /// memptrace failed (a panic): it let the program go as it could.
    Failed { reason: String },
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
    /// Stack walks of jump probes that ran into unmapped memory (the stack
    /// ends there; the program never saw the fault).
    pub walk_faults: u64,
    /// Times a thread found its ring full and waited for memptrace to read
    /// it (jump probes): the program waits, no call is dropped.
    pub ring_waits: u64,
    /// Images found, and the allocator functions hooked in them.
    pub images: u64,
    pub hooked_functions: u64,
    pub warnings: Vec<String>,
    /// How each allocator function was hooked: (`<image>:<function>`,
    /// `jump` or `int3` and why).
    pub probes: Vec<(String, String)>,
    /// What a detach could not finish (a thread that never stopped to be
    /// let go): memptrace then exits non-zero and says so.
    pub detach_left: Vec<String>,
    /// Calls jump probes let through unrecorded because memptrace did not
    /// answer for about a second (attach: see `failopen`).
    pub let_through: u64,
    /// Sequence numbers of jump probes never seen (a thread that left a
    /// probe halfway through committing a record).
    pub skipped_records: u64,
    /// Damage the program did to the memory it shares with memptrace.
    pub damaged: probes::jump::control::Damaged,
    /// Arenas and sets of mmapped blocks the heap maps could not read
    /// (each map's first reason is a warning).
    pub heap_walk_errors: u64,
    /// Every stop of the whole program by memptrace (attach, detach), timed.
    pub pauses: Vec<pauses::Pause>,
    /// Threads that stood in a jump probe's code when the detach stopped
    /// them, and were let run out of it; `None` before a detach.
    pub in_probes_at_detach: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("a ptrace request failed")]
    Ptrace(#[source] io::Error),
    /// A /proc file, read on the way (`io::Error`s that carry a
    /// `ReadError` become this one; the rest, `Write` aside, `Ptrace`).
    #[error(transparent)]
    Read(#[from] procfs::ReadError),
    /// Writing into the traced process's memory (a probe, a stack slot):
    /// `io::Error`s that carry a `WriteError` become this one.
    #[error(transparent)]
    Write(#[from] crate::os::mem::WriteError),
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
    /// Its main thread has exited (the process is a zombie, or its other
    /// threads, `running` of them, run on without it).
    #[error("the main thread of process {pid} has exited")]
    Exited { pid: Tid, running: usize },
    #[error("no allocator function (malloc, free, ...) in any image of process {0}")]
    NoAllocator(Tid),
    #[error("attaching to process {pid} given up ({reason}); the process was left as it was")]
    AttachAbandoned { pid: Tid, reason: String },
}

impl From<io::Error> for TraceError {
    fn from(err: io::Error) -> TraceError {
        let err = match procfs::ReadError::from_io(err) {
            Ok(read) => return TraceError::Read(read),
            Err(err) => err,
        };
        match crate::os::mem::WriteError::from_io(err) {
            Ok(write) => TraceError::Write(write),
            Err(err) => TraceError::Ptrace(err),
        }
    }
}

/// How long stopping every thread (to attach or detach) may go without a
/// single thread reporting its stop before memptrace stops waiting: a thread
/// that does not stop in that time (uninterruptible sleep, a frozen cgroup)
/// is not waited for forever.
const PATIENCE: Duration = Duration::from_secs(2);

/// How long a detach keeps asking a thread that has not stopped (in the
/// kernel: a vfork parent, uninterruptible sleep) before it says what it
/// left, unless memptrace is told to stop once more.
const DETACH_PATIENCE: Duration = Duration::from_secs(10);

/// How the trace is going: its root, how it ends, and what ends it.
struct Control {
    /// The process launched or attached to: its end is the trace's.
    root: Tid,
    ending: Option<Ending>,
    last_tick: u32,
    /// Threads memptrace stopped and has not resumed (while attaching), with
    /// the signal each must get when let go (0 for none).
    held: HashMap<Tid, i32>,
    /// memptrace attached to a running process (rather than launching it):
    /// the first Ctrl-C ends the trace, since it cannot reach the program.
    attached: bool,
    deadline: Option<Instant>,
}

impl Control {
    /// The trace of `root`, launched (an attach says so), ended at
    /// `deadline` if one is set.
    fn new(root: Tid, deadline: Option<Instant>) -> Control {
        Control {
            root,
            ending: None,
            last_tick: signals::ticks(),
            held: HashMap::new(),
            attached: false,
            deadline,
        }
    }
}

pub struct Tracer {
    opts: TraceOptions,
    family: Family,
    stops: Stops,
    /// Events made, stamped and sent down the pipeline (see [`booking`]).
    book: Booking,
    /// The heap maps, and what they need of C libraries (see [`heapmaps`]).
    heaps: heapmaps::HeapMaps,
    stats: TraceStats,
    control: Control,
    /// What the tracer changes threads and memory through (see [`target`]).
    target: Live,
}

impl Tracer {
    /// A tracer for the launched (seized, not yet exec'd) process `root`.
    pub fn new(
        opts: TraceOptions,
        pipeline: PipelineHandle,
        root: Tid,
        clock: Instant,
        progress: Arc<Progress>,
        heap_facts: heap::Facts,
    ) -> io::Result<Tracer> {
        let mut tracer = Tracer::blank(opts, pipeline, root, clock, progress, heap_facts);
        tracer
            .family
            .processes
            .insert(root, Process::new(Role::Prelaunch, None));
        tracer.add_thread(root, root);
        Ok(tracer)
    }

    /// Attach to the running process `pid` and hook it. On return every
    /// thread runs again (or stays in the group-stop it was found in); on
    /// error nothing of the process was changed (see `attach.rs`).
    /// `origin`: the process `pid` named when the command was checked (a
    /// pid reused since is not traced in its place).
    pub fn attach(
        opts: TraceOptions,
        pipeline: PipelineHandle,
        pid: Tid,
        origin: Option<&crate::os::pidfd::Pidfd>,
        clock: Instant,
        progress: Arc<Progress>,
        heap_facts: heap::Facts,
    ) -> Result<Tracer, TraceError> {
        life::attach::attach(opts, pipeline, pid, origin, clock, progress, heap_facts)
    }

    /// A tracer that traces nothing yet.
    fn blank(
        opts: TraceOptions,
        pipeline: PipelineHandle,
        root: Tid,
        clock: Instant,
        progress: Arc<Progress>,
        heap_facts: heap::Facts,
    ) -> Tracer {
        let deadline = opts.duration.map(|d| Instant::now() + d);
        let tsc = (opts.probes == ProbeMode::Jump)
            .then(|| TscClock::calibrate(|| clock.elapsed().as_nanos() as u64));
        let book = Booking::new(&opts, clock, tsc, Outbox::new(pipeline), progress);
        Tracer {
            opts,
            family: Family::default(),
            stops: Stops::default(),
            book,
            heaps: heapmaps::HeapMaps::new(heap_facts),
            stats: TraceStats::default(),
            control: Control::new(root, deadline),
            target: Live,
        }
    }

    pub fn stats(&self) -> &TraceStats {
        &self.stats
    }

    /// What memptrace's death would do to process `pid` now: `None` when it
    /// runs on, else which int3s would kill it.
    pub fn int3s_left(&self, pid: Tid) -> Option<String> {
        let space = self.family.processes.get(&pid)?.space.as_ref()?;
        space.int3s_left(pid)
    }

    /// Jump probes catch the calls of this trace.
    fn jumps(&self) -> bool {
        self.book.tsc.is_some()
    }

    fn now_ns(&self) -> u64 {
        self.book.now_ns()
    }

    fn add_thread(&mut self, tid: Tid, pid: Tid) {
        self.book.add_thread(&mut self.family, tid, pid);
    }

    fn send_thread(&mut self, tid: Tid, end_ns: Option<u64>) {
        self.book.send_thread(&self.family, tid, end_ns);
    }

    /// Resume a thread, delivering `sig` (see [`running`]).
    fn resume(&mut self, tid: Tid, sig: i32) -> Result<(), TraceError> {
        Ok(self.family.resume(&mut self.target, tid, sig)?)
    }

    /// The parts images concern (see [`images`]), and the target.
    fn images(&mut self) -> (Images<'_>, &mut Live) {
        let images = Images {
            opts: &self.opts,
            family: &mut self.family,
            book: &mut self.book,
            stats: &mut self.stats,
        };
        (images, &mut self.target)
    }

    /// The parts a lifecycle step concerns (see [`life`]).
    fn life(&mut self) -> Life<'_, Live> {
        Life {
            opts: &self.opts,
            family: &mut self.family,
            stops: &mut self.stops,
            book: &mut self.book,
            stats: &mut self.stats,
            control: &mut self.control,
            target: &mut self.target,
        }
    }

    /// The parts serving a breakpoint stop concerns (see [`serve::calls`]).
    fn serve(&mut self) -> Serve<'_, Live> {
        Serve {
            opts: &self.opts,
            family: &mut self.family,
            book: &mut self.book,
            heaps: &mut self.heaps,
            stats: &mut self.stats,
            target: &mut self.target,
        }
    }
}

/// "SIGTERM" for 15, and so on.
pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {sig}"))
}
