//! The pipeline thread: between the tracer and the recorder. It unwinds stack
//! copies (framehop), interns stacks, decides which frees are the allocator's
//! own housekeeping, and hands records to the recorder in batches — all after
//! the target has been resumed, so none of it is on the stop path.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use super::framehop::FramehopUnwinder;
use super::intern::Interner;
use super::{MappedImage, StackSample, Unwinder};
use crate::addr::Avma;
use crate::event::Event;
use crate::sink::{FrameRecord, ModuleRecord, Record, RecordSender, SinkError};

/// A call as the tracer saw it, before unwinding.
#[derive(Debug)]
pub struct RawCall {
    pub event: Event,
    pub stack: CallStack,
    /// Module id of the image whose allocator function was called.
    pub allocator_module: u64,
    /// A free (or realloc) of a block that was not live: either a block from
    /// before the trace, a program bug, or the allocator's own housekeeping.
    pub unmatched_release: bool,
}

#[derive(Debug)]
pub enum CallStack {
    /// No stack wanted; the return address still identifies the caller.
    CallerOnly(u64),
    /// A copy to unwind here.
    Sample(StackSample),
    /// Already unwound on the tracer thread (libunwind).
    Unwound(Vec<u64>),
}

/// What the tracer sends the pipeline, in the order things happened.
#[derive(Debug)]
pub enum TraceMsg {
    Image {
        pid: u32,
        mapped: MappedImage,
        record: ModuleRecord,
    },
    ImageGone {
        pid: u32,
        module_id: u64,
        range: Range<u64>,
        ts_ns: u64,
    },
    ProcessGone {
        pid: u32,
    },
    Record(Record),
    Call(Box<RawCall>),
}

/// What the pipeline knew at the end, for symbolization.
#[derive(Debug, Default)]
pub struct PipelineResult {
    pub frames: Vec<FrameRecord>,
    pub modules: HashMap<u64, ModuleRecord>,
    pub events: u64,
    pub housekeeping_frees: u64,
    pub stack_nodes: u64,
}

#[derive(Default)]
struct ProcessImages {
    unwinder: FramehopUnwinder,
    /// start -> image
    images: BTreeMap<u64, MappedImage>,
}

impl ProcessImages {
    fn image_at(&self, ip: u64) -> Option<&MappedImage> {
        let (_, image) = self.images.range(..=ip).next_back()?;
        (ip < image.range.end).then_some(image)
    }
}

struct Pipeline {
    unwind_here: bool,
    max_depth: usize,
    stacks: bool,
    processes: HashMap<u32, ProcessImages>,
    modules_by_id: HashMap<u64, MappedImage>,
    interner: Interner,
    result: PipelineResult,
    out: Vec<Record>,
    ips: Vec<u64>,
}

/// The producer side, held by the tracer.
pub struct PipelineHandle {
    tx: Option<SyncSender<Vec<TraceMsg>>>,
    thread: Option<JoinHandle<Result<PipelineResult, SinkError>>>,
}

/// Batches in flight from the tracer (each up to a few thousand messages).
const QUEUE_BATCHES: usize = 32;

impl PipelineHandle {
    /// Start the pipeline thread. `unwind_here`: stack samples are unwound
    /// with framehop on this thread (false when the tracer unwinds itself).
    pub fn spawn(
        recorder: RecordSender,
        unwind_here: bool,
        stacks: bool,
        max_depth: usize,
    ) -> PipelineHandle {
        let (tx, rx) = sync_channel(QUEUE_BATCHES);
        let pipeline = Pipeline {
            unwind_here,
            max_depth,
            stacks,
            processes: HashMap::new(),
            modules_by_id: HashMap::new(),
            interner: Interner::new(),
            result: PipelineResult::default(),
            out: Vec::new(),
            ips: Vec::with_capacity(max_depth),
        };
        let thread = std::thread::Builder::new()
            .name("memptrace-unwind".into())
            .spawn(move || pipeline.run(rx, recorder))
            .expect("spawning the pipeline thread");
        PipelineHandle {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    pub fn send(&self, batch: Vec<TraceMsg>) -> Result<(), SinkError> {
        if batch.is_empty() {
            return Ok(());
        }
        match &self.tx {
            Some(tx) => tx
                .send(batch)
                .map_err(|_| SinkError::Stopped("the unwinding thread stopped".into())),
            None => Err(SinkError::Stopped("the pipeline is finished".into())),
        }
    }

    /// Wait for everything sent to be processed and handed to the recorder.
    pub fn finish(mut self) -> Result<PipelineResult, SinkError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<PipelineResult, SinkError> {
        drop(self.tx.take());
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| SinkError::Stopped("the unwinding thread panicked".into()))?,
            None => Ok(PipelineResult::default()),
        }
    }
}

impl Drop for PipelineHandle {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

impl Pipeline {
    fn run(
        mut self,
        rx: Receiver<Vec<TraceMsg>>,
        recorder: RecordSender,
    ) -> Result<PipelineResult, SinkError> {
        for batch in rx {
            for msg in batch {
                self.handle(msg);
            }
            recorder.send(std::mem::take(&mut self.out))?;
        }
        self.result.frames = self.interner.frames().to_vec();
        self.result.stack_nodes = self.interner.node_count();
        Ok(self.result)
    }

    fn handle(&mut self, msg: TraceMsg) {
        match msg {
            TraceMsg::Image {
                pid,
                mapped,
                record,
            } => {
                let process = self.processes.entry(pid).or_default();
                if self.unwind_here {
                    process.unwinder.add_image(&mapped);
                }
                process.images.insert(mapped.range.start, mapped.clone());
                self.modules_by_id.insert(mapped.module_id, mapped);
                self.result.modules.insert(record.id, record.clone());
                self.out.push(Record::Module(record));
            }
            TraceMsg::ImageGone {
                pid,
                module_id,
                range,
                ts_ns,
            } => {
                if let Some(process) = self.processes.get_mut(&pid) {
                    if process.images.get(&range.start).map(|m| m.module_id) == Some(module_id) {
                        process.images.remove(&range.start);
                        process.unwinder.remove_image(range);
                    }
                }
                self.out.push(Record::ModuleUnloaded {
                    id: module_id,
                    ts_ns,
                });
                // Its addresses may serve another image from now on.
                self.interner.forget_stacks(None);
            }
            TraceMsg::ProcessGone { pid } => {
                self.processes.remove(&pid);
                self.interner.forget_stacks(Some(u64::from(pid)));
            }
            TraceMsg::Record(record) => self.out.push(record),
            TraceMsg::Call(call) => self.call(*call),
        }
    }

    fn call(&mut self, call: RawCall) {
        let RawCall {
            mut event,
            stack,
            allocator_module,
            unmatched_release,
        } = call;
        let pid = event.pid;
        self.ips.clear();
        let caller = match stack {
            CallStack::CallerOnly(ip) => ip,
            CallStack::Unwound(ips) => {
                self.ips = ips;
                self.ips.first().copied().unwrap_or(0)
            }
            CallStack::Sample(sample) => {
                if self.unwind_here {
                    if let Some(process) = self.processes.get_mut(&pid) {
                        process.unwinder.unwind(
                            event.tid as i32,
                            &sample,
                            &mut self.ips,
                            self.max_depth,
                        );
                    }
                }
                sample.ip
            }
        };
        if unmatched_release && self.is_housekeeping(allocator_module, caller) {
            self.result.housekeeping_frees += 1;
            return;
        }
        if self.stacks {
            if self.ips.is_empty() && caller != 0 {
                self.ips.push(caller);
            }
            let images = self.processes.get(&pid);
            let module_of = |ip: u64| images.and_then(|p| p.image_at(ip)).map(|m| m.module_id);
            event.stack_id =
                self.interner
                    .intern(u64::from(pid), &self.ips, module_of, &mut self.out);
        }
        self.result.events += 1;
        self.out.push(Record::Event(event));
    }

    /// A release of an unknown block is the allocator's housekeeping (glibc's
    /// tcache_thread_shutdown handing a dead thread's cached blocks back through
    /// the public free) when it comes from a known housekeeping function, or,
    /// for an allocator in a shared library, when every frame of the stack is
    /// inside that library (no program code asked for it).
    fn is_housekeeping(&self, allocator_module: u64, caller: u64) -> bool {
        let Some(alloc) = self.modules_by_id.get(&allocator_module) else {
            return false;
        };
        let inside = |ip: u64| alloc.range.contains(&ip);
        if inside(caller)
            && alloc
                .image
                .is_housekeeping(alloc.bias.to_svma(Avma(caller - 1)))
        {
            return true;
        }
        if alloc.is_main || !alloc.image.housekeeping.is_empty() {
            return false;
        }
        inside(caller) && self.ips.iter().all(|&ip| inside(ip))
    }
}
