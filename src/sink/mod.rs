//! Where recorded data goes. The tracer and the unwinder produce [`Record`]s; a
//! [`Recorder`] feeds them, on a thread of its own, to an [`EventSink`]: SQLite
//! for real traces, memory for tests. Nothing above this module knows SQL.

pub mod aggregate;
mod memory;
mod sqlite;

pub use memory::MemorySink;
pub use sqlite::{APPLICATION_ID, EventDecoder, RAW_PTR, SCHEMA_VERSION, SqliteSink};

use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::event::Event;
use crate::queue::{self, Receiver, Sender};
pub use crate::symbols::symbolize::SourceLine;

/// An ELF image mapped in a traced process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleRecord {
    pub id: u64,
    pub pid: u32,
    pub path: String,
    /// GNU build-id, lower-case hex.
    pub build_id: Option<String>,
    /// First and one-past-last address of the image's mappings.
    pub start: u64,
    pub end: u64,
    /// Load bias: runtime address minus the address the file states.
    pub base: u64,
    pub loaded_ns: u64,
    /// A static executable (static or static-pie): the C library is in it
    /// ([`crate::wrappers`]).
    pub static_exe: bool,
}

/// A thread seen while tracing. Sent again when its name or end becomes known;
/// the last record for a tid wins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadRecord {
    pub tid: u32,
    pub pid: u32,
    pub name: String,
    pub start_ns: u64,
    pub end_ns: Option<u64>,
}

/// One unique code address on some stack. `ip` is a return address (the
/// instruction after the call); symbolization looks up `ip - 1`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameRecord {
    pub id: u64,
    pub ip: u64,
    pub module_id: Option<u64>,
}

/// A node of the stack trie. A stack is its leaf node (the caller of the
/// allocator); following `parent_id` walks outwards to the root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackNode {
    pub id: u64,
    pub parent_id: Option<u64>,
    pub frame_id: u64,
    /// Number of frames from the outermost frame: the root has depth 0.
    pub depth: u32,
    /// How the frame was found.
    pub trust: Trust,
}

/// How a frame of a stack was found (`stacks.trust`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Trust {
    /// The return address at the allocator's entry: exact.
    Context,
    /// The callee's call frame information (`.eh_frame`, `.debug_frame`).
    Cfi,
    /// The callee's frame pointer (`rbp`), where no CFI covers it.
    FramePointer,
    /// The registers the kernel saved in a signal frame: the code a signal
    /// handler interrupted (the frame after the signal-return trampoline).
    Signal,
}

impl Trust {
    /// As stored in `stacks.trust`.
    pub fn name(self) -> &'static str {
        match self {
            Trust::Context => "context",
            Trust::Cfi => "cfi",
            Trust::FramePointer => "frame pointer",
            Trust::Signal => "signal",
        }
    }
}

/// The symbols of one frame, found after the trace: innermost first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameSymbols {
    pub frame_id: u64,
    pub lines: Vec<SourceLine>,
    /// The frame is part of the allocator: its module is the allocator's
    /// library, or its function one of the allocator's wrappers
    /// ([`crate::wrappers`]).
    pub wrapper: bool,
}

impl Record {
    /// About the bytes it holds beyond its own size: what weighs on the
    /// recorder's queue, which is bounded in bytes.
    pub fn heap_bytes(&self) -> usize {
        match self {
            Record::Meta { key, value } => key.len() + value.len(),
            Record::Module(m) => m.path.len() + m.build_id.as_ref().map_or(0, String::len),
            Record::Thread(t) => t.name.len(),
            Record::Symbols(s) => s.lines.len() * (size_of::<SourceLine>() + 64),
            Record::ExecReleased { alloc_ids, .. } => alloc_ids.len() * 8,
            Record::Heap(snap) => match &snap.map {
                Ok(map) => {
                    let chunks: usize = map.arenas.iter().map(|a| a.chunks.len()).sum();
                    (chunks + map.mmapped.len()) * size_of::<crate::heap::Chunk>()
                        + map.pages.len() * size_of::<crate::heap::PageRun>()
                }
                Err(why) => why.len(),
            },
            _ => 0,
        }
    }
}

/// A map of a process's heap ([`crate::heap`]), or why there is none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeapSnapshot {
    pub ts_ns: u64,
    pub pid: u32,
    /// When it was taken: `attach`, `exit` or `detach`.
    pub moment: String,
    pub map: Result<crate::heap::HeapMap, String>,
}

/// Everything a sink stores, in the order it must be stored: a module, frame or
/// stack node always arrives before the first record that refers to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    Meta {
        key: String,
        value: String,
    },
    Module(ModuleRecord),
    /// The module was unmapped (dlclose, exec or exit) at this time.
    ModuleUnloaded {
        id: u64,
        ts_ns: u64,
    },
    Thread(ThreadRecord),
    Frame(FrameRecord),
    StackNode(StackNode),
    Event(Event),
    /// A mapping call (mmap, munmap, brk...).
    Map(crate::event::MapEvent),
    /// A map of glibc's heap, taken at attach, exit or detach.
    Heap(Box<HeapSnapshot>),
    Symbols(FrameSymbols),
    /// A process's resident and mapped memory at one moment.
    Rss(RssSample),
    /// Process `pid` exec'd at `ts_ns`: the blocks allocated by these
    /// events, live then, went with its old image (`exec_releases`).
    ExecReleased {
        pid: u32,
        ts_ns: u64,
        alloc_ids: Vec<u64>,
    },
}

/// A process's memory at one moment, in bytes (the `rss` table). Samples
/// of one round of the sampler share their `ts_ns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RssSample {
    pub ts_ns: u64,
    pub pid: u32,
    pub rss: u64,
    pub anon: u64,
    pub file: u64,
    pub shmem: u64,
    pub mapped: u64,
}

/// Storage for a trace. Implementations are driven from one thread (the
/// [`Recorder`]) and may buffer freely between [`EventSink::commit`] calls.
pub trait EventSink: Send {
    fn write(&mut self, record: &Record) -> Result<(), SinkError>;

    /// Make everything written so far durable and visible to readers.
    fn commit(&mut self) -> Result<(), SinkError>;

    /// The trace is over: build indexes, fold logs back, close.
    fn finish(&mut self) -> Result<(), SinkError>;

    /// A write or commit failed with `err`. When it says that the storage
    /// cannot grow (a full disk, a quota, `--max-size`), the sink drops the
    /// transaction that failed, gives back any room it kept for the end, and
    /// returns why; it then takes the end's rows ([`Record::Meta`], names of
    /// frames already stored). `None`: the error stands.
    fn cannot_grow(&mut self, _err: &SinkError) -> Option<String> {
        None
    }
}

/// Where the recorder says that the trace must end because its storage
/// cannot grow, and why (set once); the tracer looks at it.
pub type Halt = Arc<OnceLock<String>>;

/// The records a sink that cannot grow still takes: the end's.
fn kept_when_full(record: &Record) -> bool {
    matches!(record, Record::Meta { .. } | Record::Symbols(_))
}

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("database error")]
    Sqlite(#[from] rusqlite::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("the recorder thread stopped: {0}")]
    Stopped(String),
}

/// How often the recorder commits when data keeps coming, so that `sqlite3
/// trace.db` sees a running trace grow.
const COMMIT_INTERVAL: Duration = Duration::from_millis(500);

/// How often the recorder gives memptrace's freed memory back to the kernel
/// ([`crate::os::own_heap`]).
const GIVE_BACK_INTERVAL: Duration = Duration::from_secs(1);

/// Records after which the recorder commits even before [`COMMIT_INTERVAL`]:
/// a transaction that fails on a full disk is rolled back whole, so this
/// bounds what such a disk loses (about 1 MiB of rows) whatever the rate.
const COMMIT_RECORDS: u64 = 32 * 1024;

/// Bytes of records in flight between producers and the recorder thread,
/// the batch being written included. Bounded by bytes, not batches (a
/// batch is one record or tens of thousands), so a target that allocates
/// faster than the disk writes is slowed down rather than memptrace
/// growing without limit. 8 MiB is about 65 000 events, a sixteenth of a
/// second at a million calls a second, and the largest batch (`BACKLOG`
/// calls of the outbox) stays under it. At 32 MiB, this queue, the
/// pipeline's and the tracer's backlog held 60-100 MB more at memptrace's
/// peak (30 M calls of the scale workload, issue 19 item 4), for no less
/// CPU or fewer ring waits; at 16 MiB, about 30 MB more at 100 M calls
/// (docs/performance.md, "Mapping calls by jump probes, and smaller
/// queues").
const QUEUE_BYTES: u64 = 8 << 20;

/// About the bytes a batch of records holds: its vector's whole capacity,
/// not only the records in it (a vector grown by doubling holds up to twice
/// its length: weighed by length, the queue held about 96 MiB at its 48 MiB
/// bound).
#[allow(clippy::ptr_arg)] // the queue's items are `Vec`s
fn weigh(batch: &Vec<Record>) -> u64 {
    let heap: usize = batch.iter().map(Record::heap_bytes).sum();
    (batch.capacity() * size_of::<Record>() + heap) as u64
}

/// Called on the recorder's thread with every record before it is
/// written: how others (the RSS sampler) learn what the trace sees. It must
/// return quickly and never wait for a producer.
pub type Observer = Box<dyn FnMut(&Record) + Send>;

/// Runs an [`EventSink`] on its own thread; producers send batches of records.
pub struct Recorder {
    tx: Option<Sender<Vec<Record>>>,
    thread: Option<JoinHandle<Result<RecorderStats, SinkError>>>,
    halt: Halt,
}

/// What the recorder did, for the closing summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecorderStats {
    pub records: u64,
    pub events: u64,
    pub commits: u64,
    /// Records dropped once the storage could not grow.
    pub dropped: u64,
}

impl Recorder {
    pub fn spawn(sink: Box<dyn EventSink>) -> Recorder {
        Recorder::spawn_observed(sink, Box::new(|_| {}))
    }

    /// A recorder that shows `observer` every record it writes.
    pub fn spawn_observed(sink: Box<dyn EventSink>, observer: Observer) -> Recorder {
        let (tx, rx) = queue::bounded(QUEUE_BYTES, weigh);
        let halt = Halt::default();
        let theirs = halt.clone();
        let thread = std::thread::Builder::new()
            .name("memptrace-recorder".into())
            .spawn(move || record_loop(sink, observer, rx, &theirs))
            .expect("spawning the recorder thread");
        Recorder {
            tx: Some(tx),
            thread: Some(thread),
            halt,
        }
    }

    /// Set, with the reason, once the storage cannot grow: the trace must
    /// end (see [`EventSink::cannot_grow`]).
    pub fn halt(&self) -> Halt {
        self.halt.clone()
    }

    /// A handle producers on other threads can send through.
    pub fn sender(&self) -> RecordSender {
        RecordSender {
            tx: self.tx.clone().expect("recorder already finished"),
        }
    }

    /// Wait until every record sent has been written, then finish the sink.
    pub fn finish(mut self) -> Result<RecorderStats, SinkError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<RecorderStats, SinkError> {
        drop(self.tx.take());
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| SinkError::Stopped("the recorder thread panicked".into()))?,
            None => Ok(RecorderStats::default()),
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// The producer side of a [`Recorder`].
#[derive(Clone)]
pub struct RecordSender {
    tx: Sender<Vec<Record>>,
}

impl RecordSender {
    /// Send a batch; fails only when the recorder has stopped on an error.
    pub fn send(&self, batch: Vec<Record>) -> Result<(), SinkError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.tx
            .send(batch)
            .map_err(|_| SinkError::Stopped("it stopped after an error".into()))
    }
}

fn record_loop(
    mut sink: Box<dyn EventSink>,
    mut observer: Observer,
    rx: Receiver<Vec<Record>>,
    halt: &OnceLock<String>,
) -> Result<RecorderStats, SinkError> {
    let mut stats = RecorderStats::default();
    let mut dirty = false;
    let mut last_commit = Instant::now();
    let mut uncommitted: u64 = 0;
    let mut last_give_back = Instant::now();
    loop {
        let wait = COMMIT_INTERVAL.saturating_sub(last_commit.elapsed());
        match rx.recv_timeout(wait) {
            // The permit holds the batch's room until it is written.
            Ok((batch, _permit)) => {
                for record in &batch {
                    observer(record);
                    if halt.get().is_some() && !kept_when_full(record) {
                        stats.dropped += 1;
                        continue;
                    }
                    if let Err(err) = sink.write(record) {
                        survive(sink.as_mut(), halt, err)?;
                        continue;
                    }
                    if matches!(record, Record::Event(_)) {
                        stats.events += 1;
                    }
                }
                stats.records += batch.len() as u64;
                uncommitted += batch.len() as u64;
                dirty = true;
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if dirty && (last_commit.elapsed() >= COMMIT_INTERVAL || uncommitted >= COMMIT_RECORDS) {
            if let Err(err) = sink.commit() {
                survive(sink.as_mut(), halt, err)?;
            }
            stats.commits += 1;
            dirty = false;
            uncommitted = 0;
            last_commit = Instant::now();
        } else if !dirty {
            last_commit = Instant::now();
        }
        if last_give_back.elapsed() >= GIVE_BACK_INTERVAL {
            crate::os::own_heap::give_back_freed();
            last_give_back = Instant::now();
        }
    }
    if let Err(err) = sink.commit() {
        survive(sink.as_mut(), halt, err)?;
    }
    stats.commits += 1;
    if let Err(err) = sink.finish() {
        survive(sink.as_mut(), halt, err)?;
    }
    Ok(stats)
}

/// A failure that says the storage cannot grow ends the trace, not the
/// recorder: the first sets `halt` (from then on only the end's rows are
/// written), and a later one drops what failed: nothing more can be done
/// for it. Any other failure stands.
fn survive(
    sink: &mut dyn EventSink,
    halt: &OnceLock<String>,
    err: SinkError,
) -> Result<(), SinkError> {
    match sink.cannot_grow(&err) {
        Some(reason) => {
            let _ = halt.set(reason);
            Ok(())
        }
        None => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch weighs the memory its vector holds, spare room included: by
    /// its length, the recorder's queue at its bound held up to twice it.
    #[test]
    fn a_batch_of_records_weighs_its_capacity() {
        let mut batch = Vec::with_capacity(1000);
        batch.push(Record::ModuleUnloaded { id: 1, ts_ns: 2 });
        batch.push(Record::Thread(ThreadRecord {
            tid: 2,
            pid: 1,
            name: "worker".into(),
            start_ns: 0,
            end_ns: None,
        }));
        let expected = 1000 * size_of::<Record>() + "worker".len();
        assert_eq!(weigh(&batch), expected as u64);
    }
}
