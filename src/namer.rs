//! Naming frames on a thread of their own while the trace runs.
//!
//! Naming needs each image's debug data: for a Python or a C library that
//! is megabytes of compressed DWARF to inflate and parse, 70 to 150 ms an
//! image here. Done after the program ended, that was half of what a short
//! trace spent after its program's exit, on one CPU while the other stood
//! idle. The pipeline hands each frame to the namer once it has passed the
//! frame on to the recorder, so an image's debug data is read when its
//! first frame shows up and each name reaches the recorder behind the row
//! it updates. The thread runs at the lowest priority: it takes the CPU
//! time the program and the tracer leave.
//!
//! The same thread reads ahead the C library's allocator layout for the
//! heap map taken at each process's exit ([`crate::heap::Facts::prepare`]),
//! into the `Facts` the session hands both it and the tracer.
//!
//! At the end the session waits for the namer briefly. A thread at the
//! lowest priority can starve (after a detach the program runs on, flat
//! out), and it cannot be given its priority back without privileges: then
//! the session takes over what is left, names it itself, and the namer's
//! late names are dropped.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::heap::{self, Facts};
use crate::sink::{FrameRecord, FrameSymbols, ModuleRecord, Record, RecordSender, SinkError};
use crate::symbols::debuginfod::Debuginfod;
use crate::symbols::symbolize::Symbolizer;
use crate::wrappers::Wrappers;

/// How long the end of a trace waits for the namer to finish.
const GRACE: Duration = Duration::from_millis(200);

/// What the namer and its producers share.
#[derive(Default)]
struct Queue {
    modules: HashMap<u64, ModuleRecord>,
    /// Frames handed over, oldest first.
    pending: VecDeque<Vec<FrameRecord>>,
    /// The frames the namer is naming now (cleared once their names are
    /// sent, under the `Out` lock).
    current: Vec<FrameRecord>,
    /// Nothing more will be handed over.
    closed: bool,
}

/// Where names go. A lock of its own: the namer holds it while the
/// recorder's queue is full, and the pipeline, which only hands frames over,
/// must never wait behind a thread of the lowest priority.
#[derive(Default)]
struct Out {
    /// Taken by the session when it takes over.
    records: Option<RecordSender>,
    /// Set at the first failure to send names (the recorder stopped).
    failed: Option<SinkError>,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    out: Mutex<Out>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn out(&self) -> MutexGuard<'_, Out> {
        self.out.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The producer side, held by the pipeline.
#[derive(Clone)]
pub struct NameSender {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NameSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NameSender")
    }
}

impl NameSender {
    pub fn module(&self, module: ModuleRecord) {
        self.shared.lock().modules.insert(module.id, module);
    }

    /// Frames the recorder has been sent (a name must not overtake the row
    /// it updates). Frames of no known image are left unnamed.
    pub fn frames(&self, frames: &[FrameRecord]) {
        let frames: Vec<FrameRecord> = frames
            .iter()
            .filter(|f| f.module_id.is_some())
            .cloned()
            .collect();
        if frames.is_empty() {
            return;
        }
        self.shared.lock().pending.push_back(frames);
        self.shared.ready.notify_one();
    }
}

/// The naming thread.
pub struct Namer {
    shared: Arc<Shared>,
    wrappers: Wrappers,
    /// The debuginfod servers, when `DEBUGINFOD_URLS` names some.
    debuginfod: Option<Debuginfod>,
    thread: Option<JoinHandle<()>>,
}

impl Namer {
    /// Start the thread; its names go to `records`; debug files found
    /// nowhere on disk are asked of `debuginfod`; what the heap maps will
    /// need of a C library is read ahead into `facts`.
    pub fn spawn(
        records: RecordSender,
        wrappers: Wrappers,
        debuginfod: Option<Debuginfod>,
        facts: Facts,
    ) -> Namer {
        let mut namer = Namer::idle(records, wrappers, debuginfod);
        let symbolizer = Symbolizer::new().with_debuginfod(namer.debuginfod.as_ref());
        let theirs = (namer.shared.clone(), namer.wrappers.clone());
        let thread = std::thread::Builder::new()
            .name("memptrace-names".into())
            .spawn(move || name_all(&theirs.0, &theirs.1, symbolizer, &facts))
            .expect("spawning the naming thread");
        namer.thread = Some(thread);
        namer
    }

    /// A namer without its thread: everything is left to [`Namer::finish`],
    /// as when the thread starves.
    fn idle(records: RecordSender, wrappers: Wrappers, debuginfod: Option<Debuginfod>) -> Namer {
        let shared = Arc::new(Shared::default());
        shared.out().records = Some(records);
        Namer {
            shared,
            wrappers,
            debuginfod,
            thread: None,
        }
    }

    pub fn sender(&self) -> NameSender {
        NameSender {
            shared: self.shared.clone(),
        }
    }

    /// Every frame handed over named and its names with the recorder: by the
    /// namer if it finishes within 200 ms, else by this thread (with a
    /// bar on a terminal). Call it once the producers are done.
    pub fn finish(mut self, draw: bool) -> Result<(), SinkError> {
        self.close();
        let deadline = Instant::now() + GRACE;
        let thread = self.thread.take();
        if let Some(thread) = thread {
            while !thread.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
            // Otherwise it is left to end by itself, without a way to send.
        }
        // Once `records` is taken the namer sends nothing more, and what it
        // did send is no longer in `current`.
        let records = {
            let mut out = self.shared.out();
            if let Some(err) = out.failed.take() {
                return Err(err);
            }
            out.records.take()
        };
        let (modules, left) = {
            let mut q = self.shared.lock();
            let mut left = std::mem::take(&mut q.current);
            left.extend(q.pending.drain(..).flatten());
            (q.modules.clone(), left)
        };
        let Some(records) = records.filter(|_| !left.is_empty()) else {
            return Ok(());
        };
        let bar = crate::progress::bar_if(draw, left.len() as u64, "naming code addresses");
        let mut symbolizer = Symbolizer::new().with_debuginfod(self.debuginfod.as_ref());
        for chunk in left.chunks(256) {
            records.send(name(&mut symbolizer, &modules, chunk, &self.wrappers))?;
            bar.inc(chunk.len() as u64);
        }
        bar.finish_and_clear();
        Ok(())
    }

    fn close(&self) {
        self.shared.lock().closed = true;
        self.shared.ready.notify_all();
    }
}

impl Drop for Namer {
    /// An abandoned trace: the namer stops sending at once.
    fn drop(&mut self) {
        self.shared.out().records = None;
        let mut q = self.shared.lock();
        q.closed = true;
        q.pending.clear();
        drop(q);
        self.shared.ready.notify_all();
    }
}

fn name_all(shared: &Shared, wrappers: &Wrappers, mut symbolizer: Symbolizer, facts: &Facts) {
    crate::os::local::lower_own_priority();
    let mut prepared = Vec::new();
    loop {
        let (frames, modules) = {
            let mut q = shared.lock();
            while q.pending.is_empty() && !q.closed {
                q = shared.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            let Some(frames) = q.pending.pop_front() else {
                return;
            };
            q.current = frames.clone();
            let modules: HashMap<u64, ModuleRecord> = frames
                .iter()
                .filter_map(|f| f.module_id)
                .filter_map(|id| Some((id, q.modules.get(&id)?.clone())))
                .collect();
            (frames, modules)
        };
        // The heap map at a process's exit will need its C library's
        // layout: read it now, not while the process waits.
        for module in modules.values() {
            if heap::is_c_library(&module.path) && !prepared.contains(&module.path) {
                facts.prepare(Path::new(&module.path));
                prepared.push(module.path.clone());
            }
        }
        let names = name(&mut symbolizer, &modules, &frames, wrappers);
        let mut out = shared.out();
        let Some(records) = out.records.as_ref() else {
            return;
        };
        if let Err(err) = records.send(names) {
            out.failed = Some(err);
            out.records = None;
            return;
        }
        shared.lock().current.clear();
    }
}

/// The names of `frames`, image by image.
fn name(
    symbolizer: &mut Symbolizer,
    modules: &HashMap<u64, ModuleRecord>,
    frames: &[FrameRecord],
    wrappers: &Wrappers,
) -> Vec<Record> {
    let mut by_module: HashMap<u64, Vec<&FrameRecord>> = HashMap::new();
    for frame in frames {
        if let Some(module) = frame.module_id {
            by_module.entry(module).or_default().push(frame);
        }
    }
    let mut out = Vec::new();
    for (module_id, frames) in by_module {
        let Some(module) = modules.get(&module_id) else {
            continue;
        };
        // Return addresses point after the call: look up the call itself.
        let probes: Vec<u64> = frames
            .iter()
            .map(|f| f.ip.wrapping_sub(1).wrapping_sub(module.base))
            .collect();
        let path = module.path.trim_end_matches(" (deleted)");
        let mut names = symbolizer.symbolize(Path::new(path), module.build_id.as_deref(), &probes);
        // A frame nothing covers just before it, but something at it: the
        // signal-return trampoline (`__restore_rt`), where a handler
        // returns to without a call, preceded by padding no symbol covers.
        let unnamed: Vec<usize> = (0..names.len()).filter(|&i| names[i].is_empty()).collect();
        if !unnamed.is_empty() {
            let at: Vec<u64> = unnamed.iter().map(|&i| probes[i].wrapping_add(1)).collect();
            let again = symbolizer.symbolize(Path::new(path), module.build_id.as_deref(), &at);
            for (i, lines) in unnamed.into_iter().zip(again) {
                names[i] = lines;
            }
        }
        let file = crate::util::file_name(&module.path);
        out.extend(frames.iter().zip(names).filter_map(|(frame, lines)| {
            // The function whose machine code holds the call: the
            // outermost line.
            let outer = lines.last();
            let function = outer.and_then(|l| l.function.as_deref());
            let wrapper = if module.static_exe {
                let source = outer.and_then(|l| l.file.as_deref());
                wrappers.is_allocator_frame_of_static(Some(file), function, source)
            } else {
                wrappers.is_allocator_frame(Some(file), function)
            };
            (wrapper || !lines.is_empty()).then_some(Record::Symbols(FrameSymbols {
                frame_id: frame.id,
                lines,
                wrapper,
            }))
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::{MemorySink, Recorder};
    use crate::symbols::symbolize::tests::{CHAIN_C, TempDir, build, first_call_in};

    /// `level_two`'s call in a program built here, as a frame of module 1
    /// (loaded at its file addresses), and the names a namer gave it.
    fn named(dir: &str, start: impl FnOnce(RecordSender, Wrappers) -> Namer) -> Vec<FrameSymbols> {
        let dir = TempDir::new(dir);
        build(&dir, "gcc", "chain.c", CHAIN_C, &["-g", "-O1"], "chain");
        let binary = dir.path("chain");
        let sink = MemorySink::new();
        let recorder = Recorder::spawn(Box::new(sink.clone()));
        let namer = start(recorder.sender(), Wrappers::new(&[]).unwrap());
        let names = namer.sender();
        names.module(ModuleRecord {
            id: 1,
            pid: 1,
            path: binary.to_string_lossy().into_owned(),
            build_id: None,
            start: 0,
            end: u64::MAX,
            base: 0,
            loaded_ns: 0,
            static_exe: false,
        });
        let ip = first_call_in(&binary, "level_two") + 1;
        names.frames(&[
            FrameRecord {
                id: 7,
                ip,
                module_id: Some(1),
            },
            // Outside every image: left unnamed, and not an error.
            FrameRecord {
                id: 8,
                ip: 0x10,
                module_id: None,
            },
        ]);
        drop(names);
        namer.finish(false).unwrap();
        recorder.finish().unwrap();
        sink.records()
            .into_iter()
            .filter_map(|r| match r {
                Record::Symbols(s) => Some(s),
                _ => None,
            })
            .collect()
    }

    fn assert_level_two(names: &[FrameSymbols]) {
        assert_eq!(names.len(), 1, "{names:?}");
        assert_eq!(names[0].frame_id, 7);
        let function = names[0].lines.last().and_then(|l| l.function.as_deref());
        assert_eq!(function, Some("level_two"), "{names:?}");
        assert!(!names[0].wrapper);
    }

    #[test]
    fn names_the_frames_it_is_handed() {
        assert_level_two(&named("namer", |r, w| {
            Namer::spawn(r, w, None, Facts::default())
        }));
    }

    /// The namer's thread never got the CPU: the end of the trace names
    /// what it was handed.
    #[test]
    fn the_end_names_what_a_starved_namer_left() {
        assert_level_two(&named("namer-idle", |r, w| Namer::idle(r, w, None)));
    }
}
