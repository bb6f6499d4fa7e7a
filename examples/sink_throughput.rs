//! How fast the recorder stores events, and how many bytes each costs on disk.
//!
//! ```text
//! cargo run --release --example sink_throughput -- [EVENTS] [PATH]
//! ```
//!
//! Writes EVENTS (default 2,000,000) synthetic allocator calls through a
//! [`Recorder`] running a [`SqliteSink`] into PATH (default a file in the
//! temp dir, removed afterwards), the way a trace does: batches of records
//! from another thread, commits every 500 ms, `finish` at the end. The
//! workload is malloc+free heavy: 4 threads, short-lived blocks with heap
//! (0x55...) and mmap/arena (0x7f...) pointers, a few thousand distinct
//! stacks, timestamps 5 µs apart (a trace of 200 k calls/s lasts seconds, so
//! `ts_ns` needs its full width). The records are generated before the clock
//! starts, so it measures the recorder alone. It prints events/s until the
//! last batch was taken (the queue holds 64 batches) and for the whole run
//! including `finish`; the recorder thread's CPU time, which a busy machine
//! blurs less than wall time; and the database size per event, indexes
//! included. With `SINK_AGGREGATE=1` the sink stores no row per event, as
//! `memptrace --aggregate`: the recorder's CPU is then the aggregator's
//! (docs/schema.md, "Aggregates"). Run it a few times: on a shared machine the figures vary by
//! 20 % from run to run.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use memptrace::event::{Event, Op};
use memptrace::sink::{
    EventSink, FrameRecord, ModuleRecord, Record, Recorder, SinkError, SqliteSink, StackNode,
};

const BATCH: usize = 1024;
const THREADS: u32 = 4;
const PID: u32 = 41_000;
const STACKS: u64 = 2000;

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The module, frames and stack trie a trace would send before its events:
/// STACKS leaves, 8 to 40 frames deep, sharing their outer frames.
fn stack_records(rng: &mut Rng) -> (Vec<Record>, Vec<u64>) {
    let base = 0x5555_5555_4000u64;
    let mut records = vec![Record::Module(ModuleRecord {
        id: 1,
        pid: PID,
        path: "/usr/bin/bench".into(),
        build_id: Some("0123456789abcdef".into()),
        start: base,
        end: base + 0x40_0000,
        base,
        loaded_ns: 0,
        static_exe: false,
    })];
    let mut leaves = Vec::new();
    let mut next_node = 1u64;
    let mut next_frame = 1u64;
    // Every stack starts at the same few frames (main, a dispatcher...).
    let mut spine: Vec<u64> = Vec::new();
    let mut parent = None;
    for depth in 0..4 {
        records.push(Record::Frame(FrameRecord {
            id: next_frame,
            ip: base + 0x1000 + next_frame * 0x40,
            module_id: Some(1),
        }));
        records.push(Record::StackNode(StackNode {
            id: next_node,
            parent_id: parent,
            frame_id: next_frame,
            depth,
            trust: memptrace::sink::Trust::Cfi,
        }));
        parent = Some(next_node);
        spine.push(next_node);
        next_node += 1;
        next_frame += 1;
    }
    for _ in 0..STACKS {
        let mut parent = *spine.last().expect("a spine");
        let depth = 8 + rng.below(32) as u32;
        for d in 4..depth {
            records.push(Record::Frame(FrameRecord {
                id: next_frame,
                ip: base + 0x1000 + next_frame * 0x40,
                module_id: Some(1),
            }));
            records.push(Record::StackNode(StackNode {
                id: next_node,
                parent_id: Some(parent),
                frame_id: next_frame,
                depth: d,
                trust: memptrace::sink::Trust::Cfi,
            }));
            parent = next_node;
            next_node += 1;
            next_frame += 1;
        }
        leaves.push(parent);
    }
    (records, leaves)
}

/// The sink, plus the CPU time of the thread driving it (from
/// `/proc/thread-self/stat`, in clock ticks of 10 ms), so a busy machine does
/// not blur the figure as much as wall time does.
struct Timed {
    sink: SqliteSink,
    cpu: Arc<Mutex<Option<(f64, f64)>>>,
}

fn thread_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // Fields after the ")" closing the name: utime and stime are the 12th and 13th.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

impl EventSink for Timed {
    fn write(&mut self, record: &Record) -> Result<(), SinkError> {
        self.sink.write(record)
    }
    fn commit(&mut self) -> Result<(), SinkError> {
        self.sink.commit()
    }
    fn finish(&mut self) -> Result<(), SinkError> {
        let before = thread_cpu_seconds();
        self.sink.finish()?;
        if let Ok(mut cpu) = self.cpu.lock() {
            *cpu = Some((before, thread_cpu_seconds() - before));
        }
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let events: u64 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(2_000_000);
    let (path, temporary) = match args.next() {
        Some(p) => (PathBuf::from(p), false),
        None => (
            std::env::temp_dir().join(format!("sink-throughput-{}.db", std::process::id())),
            true,
        ),
    };
    if path.exists() {
        return Err(format!("{} exists; pick a new path", path.display()).into());
    }

    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let (stack_records, leaves) = stack_records(&mut rng);
    let mut batches = vec![stack_records];

    // Live blocks per thread: (ptr, alloc id). Frees take a recent one.
    let mut live: Vec<Vec<(u64, u64)>> = vec![Vec::new(); THREADS as usize];
    let mut heap_top = 0x5555_5560_0000u64;
    let mut arena_top = 0x7f3a_2000_0000u64;
    let mut batch = Vec::with_capacity(BATCH);
    let mut ts = 1_000_000u64;
    for id in 1..=events {
        ts += 4000 + rng.below(2000);
        let t = if rng.below(4) == 0 {
            1 + rng.below(u64::from(THREADS) - 1) as usize
        } else {
            0
        };
        let stack = leaves[(rng.below(leaves.len() as u64) * rng.below(100) / 100) as usize];
        let mut e = Event {
            id,
            ts_ns: ts,
            pid: PID,
            tid: PID + t as u32,
            op: Op::Malloc,
            ptr: 0,
            size: None,
            old_ptr: None,
            align: None,
            alloc_id: None,
            stack_id: Some(stack),
        };
        let pool = &mut live[t];
        let roll = rng.below(100);
        if pool.is_empty() || roll < 49 || (pool.len() < 8 && roll < 60) {
            let size = match rng.below(10) {
                0 => 4096 + rng.below(60_000),
                1..=3 => 128 + rng.below(1024),
                _ => 8 + rng.below(120),
            };
            e.op = if rng.below(20) == 0 {
                Op::Calloc
            } else {
                Op::Malloc
            };
            e.size = Some(size);
            e.ptr = if t == 0 {
                heap_top += (size + 31) & !15;
                heap_top
            } else {
                arena_top += (size + 31) & !15;
                arena_top
            };
            pool.push((e.ptr, id));
        } else {
            // Mostly the newest blocks: short lifetimes, as in real programs.
            let back = (rng.below(pool.len() as u64).min(rng.below(16))) as usize;
            let (ptr, alloc) = pool.swap_remove(pool.len() - 1 - back);
            e.alloc_id = Some(alloc);
            if roll < 95 {
                e.op = Op::Free;
                e.ptr = ptr;
            } else {
                let size = 16 + rng.below(4096);
                e.op = Op::Realloc;
                e.old_ptr = Some(ptr);
                e.size = Some(size);
                heap_top += (size + 31) & !15;
                e.ptr = heap_top;
                pool.push((e.ptr, id));
            }
        }
        batch.push(Record::Event(e));
        if batch.len() == BATCH {
            batches.push(std::mem::replace(&mut batch, Vec::with_capacity(BATCH)));
        }
    }
    batches.push(batch);

    // Generated beforehand, so the clock sees the recorder alone.
    let mut sink = SqliteSink::create(&path)?;
    // `SINK_AGGREGATE=1`: as `memptrace --aggregate`, no row per event.
    let aggregate = std::env::var_os("SINK_AGGREGATE").is_some_and(|v| v == "1");
    sink.aggregate(aggregate, 100_000_000);
    let started = Instant::now();
    let cpu = Arc::new(Mutex::new(None));
    let recorder = Recorder::spawn(Box::new(Timed {
        sink,
        cpu: cpu.clone(),
    }));
    let sender = recorder.sender();
    for batch in batches {
        sender.send(batch)?;
    }
    drop(sender);
    let sent = started.elapsed();
    // finish() commits what is left, then builds indexes and closes.
    let stats = recorder.finish()?;
    let total = started.elapsed();
    let bytes = std::fs::metadata(&path)?.len();

    let per_sec = |d: std::time::Duration| events as f64 / d.as_secs_f64();
    println!("events:              {events}");
    println!("commits:             {}", stats.commits);
    println!(
        "all sent:            {:.2} s ({:.2} M events/s)",
        sent.as_secs_f64(),
        per_sec(sent) / 1e6
    );
    println!(
        "written and closed:  {:.2} s ({:.2} M events/s)",
        total.as_secs_f64(),
        per_sec(total) / 1e6
    );
    println!(
        "database:            {bytes} bytes, {:.1} bytes/event",
        bytes as f64 / events as f64
    );
    if let Ok(Some((writing, finishing))) = cpu.lock().map(|c| *c) {
        println!(
            "recorder CPU:        {writing:.2} s writing ({:.2} M events/s), {finishing:.2} s in finish",
            events as f64 / writing / 1e6
        );
    }
    if temporary {
        std::fs::remove_file(&path)?;
    } else {
        println!("kept:                {}", path.display());
    }
    Ok(())
}
