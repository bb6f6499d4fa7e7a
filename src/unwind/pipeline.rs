//! The pipeline thread: between the tracer and the recorder. It unwinds stack
//! copies (framehop), interns stacks, decides which frees are the allocator's
//! own housekeeping, and hands records to the recorder in batches — all after
//! the target has been resumed, so none of it is on the stop path.

use std::collections::{BTreeMap, HashMap};

use super::by_allocator::{allocator_call_in_copy, allocator_frame, ends_in_cfi};
use super::framehop::FramehopUnwinder;
use super::intern::Interner;
use super::seen::StackCache;
use super::vet::{Trust, vet};
use super::{MappedImage, StackSample, Unwinder, WalkEnd};
use crate::addr::Avma;
use crate::event::Event;
use crate::namer::NameSender;
use crate::queue::Receiver;
use crate::sink::{Record, RecordSender, SinkError};
use crate::trace_msg::{CallBatch, CallStack, RawCall, RawMap, SpareBatches, TraceMsg};

mod handle;
pub use handle::{PipelineHandle, weigh};

/// What the pipeline counted, for the `meta` rows of the end.
#[derive(Debug, Default)]
pub struct PipelineResult {
    pub events: u64,
    pub housekeeping_frees: u64,
    pub stack_nodes: u64,
    /// Events whose stack ended before its outermost frame: no unwind rule
    /// for an address, a frame that was not a return address, or the end of
    /// the stack copy.
    pub truncated_stacks: u64,
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
    trust: Vec<Trust>,
    /// Frames found to be return addresses (see [`vet`]).
    known: rustc_hash::FxHashSet<(u64, u64)>,
    /// Whole stacks as unwound, and what became of them: a program makes
    /// the same few stacks over and over, and then a call costs one hash of
    /// its addresses, not a check and a lookup per frame.
    seen: StackCache,
    /// `meta` keys written by the pipeline.
    meta_written: std::collections::HashSet<String>,
    /// Where modules and frames go to be named, once the recorder has them.
    names: Option<NameSender>,
    /// The interned frames handed to `names` so far.
    named: usize,
    /// Where emptied call batches go back to the tracer.
    spares: SpareBatches,
}

impl Pipeline {
    fn new(
        unwind_here: bool,
        stacks: bool,
        max_depth: usize,
        names: Option<NameSender>,
        spares: SpareBatches,
    ) -> Pipeline {
        Pipeline {
            unwind_here,
            max_depth,
            stacks,
            processes: HashMap::new(),
            modules_by_id: HashMap::new(),
            interner: Interner::new(),
            result: PipelineResult::default(),
            out: Vec::new(),
            ips: Vec::with_capacity(max_depth),
            trust: Vec::with_capacity(max_depth),
            known: Default::default(),
            seen: StackCache::default(),
            meta_written: Default::default(),
            names,
            named: 0,
            spares,
        }
    }

    fn run(
        mut self,
        rx: Receiver<Vec<TraceMsg>>,
        recorder: RecordSender,
    ) -> Result<PipelineResult, SinkError> {
        // The permit holds the batch's room until its records are handed on.
        for (batch, _permit) in &rx {
            for msg in batch {
                self.handle(msg);
            }
            recorder.send(self.take_out())?;
            if let Some(names) = &self.names {
                let frames = self.interner.frames();
                names.frames(&frames[self.named..]);
                self.named = frames.len();
            }
        }
        self.result.stack_nodes = self.interner.node_count();
        Ok(self.result)
    }

    /// The records of a batch, for the recorder: in a vector no larger
    /// than they are (the queue weighs it by its capacity), the next batch's
    /// begun with room for as many (not grown again by doubling, each step
    /// a copy into fresh pages).
    fn take_out(&mut self) -> Vec<Record> {
        let next = Vec::with_capacity(self.out.len());
        let mut out = std::mem::replace(&mut self.out, next);
        out.shrink_to_fit();
        out
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
                self.allocator_meta(&record.path, &mapped);
                self.modules_by_id.insert(mapped.module_id, mapped);
                if let Some(names) = &self.names {
                    names.module(record.clone());
                }
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
                self.seen.forget(None);
            }
            TraceMsg::ProcessGone { pid } => {
                self.processes.remove(&pid);
                self.seen.forget(Some(pid));
            }
            TraceMsg::Record(record) => {
                // Events with no stack to unwind (the inventory at attach).
                if matches!(record, Record::Event(_)) {
                    self.result.events += 1;
                }
                self.out.push(record)
            }
            TraceMsg::Map(map) => self.map(*map),
            TraceMsg::Trampolines { pid, areas } => {
                let process = self.processes.entry(pid).or_default();
                process.unwinder.set_trampolines(areas);
            }
            TraceMsg::Call(call) => self.call(*call),
            TraceMsg::Calls(mut batch) => {
                let CallBatch { calls, frames } = &mut *batch;
                for call in calls.drain(..) {
                    let frames = &frames[call.frames];
                    let caller = frames.first().copied().unwrap_or(0);
                    let ips = if call.caller_only { &[][..] } else { frames };
                    // A stack seen before is looked up where it lies, not
                    // copied first (Python's run 30 to 128 frames deep).
                    let Err(event) =
                        self.seen_before(call.event, ips, caller, call.end, call.unmatched_release)
                    else {
                        continue;
                    };
                    self.ips.clear();
                    self.ips.extend_from_slice(ips);
                    self.stacked(
                        event,
                        caller,
                        call.end,
                        call.allocator_module,
                        call.unmatched_release,
                    );
                }
                self.spares.give(*batch);
            }
        }
    }

    fn call(&mut self, call: RawCall) {
        let RawCall {
            event,
            stack,
            allocator_module,
            unmatched_release,
        } = call;
        let (caller, end, _) = self.take_stack(event.pid, event.tid, stack);
        self.stacked(event, caller, end, allocator_module, unmatched_release);
    }

    /// Put the return addresses of thread `tid`'s `stack` in `self.ips`,
    /// unwinding a stack copy here when that is the pipeline's job: the
    /// caller, how the walk ended, and the copy, if there was one.
    fn take_stack(
        &mut self,
        pid: u32,
        tid: u32,
        stack: CallStack,
    ) -> (u64, WalkEnd, Option<StackSample>) {
        self.ips.clear();
        match stack {
            CallStack::CallerOnly(ip) => (ip, WalkEnd::Outermost, None),
            CallStack::Unwound { ips, end } => {
                self.ips = ips;
                (self.ips.first().copied().unwrap_or(0), end, None)
            }
            CallStack::Sample(sample) => {
                let mut end = WalkEnd::Outermost;
                if self.unwind_here {
                    if let Some(process) = self.processes.get_mut(&pid) {
                        end = process.unwinder.unwind(
                            tid as i32,
                            &sample,
                            &mut self.ips,
                            self.max_depth,
                        );
                    }
                }
                (sample.ip, end, Some(sample))
            }
        }
    }

    /// Record a call whose stack, return addresses `ips` (empty: the caller
    /// alone), was seen before; else give the event back. A release of a
    /// block not known to be live is looked at whole (it may be the
    /// allocator's housekeeping).
    fn seen_before(
        &mut self,
        mut event: Event,
        ips: &[u64],
        caller: u64,
        end: WalkEnd,
        unmatched_release: bool,
    ) -> Result<(), Event> {
        if unmatched_release || !self.stacks {
            return Err(event);
        }
        let key = StackCache::key(event.pid, ips, caller, end);
        let Some(seen) = self.seen.get(key, event.pid, ips, caller, end) else {
            return Err(event);
        };
        if seen.truncated {
            self.result.truncated_stacks += 1;
        }
        event.stack_id = seen.leaf;
        self.result.events += 1;
        self.out.push(Record::Event(event));
        Ok(())
    }

    /// Record a call whose return addresses are in `self.ips` (empty: the
    /// caller alone).
    fn stacked(
        &mut self,
        event: Event,
        caller: u64,
        end: WalkEnd,
        allocator_module: u64,
        unmatched_release: bool,
    ) {
        let pid = event.pid;
        let ips = std::mem::take(&mut self.ips);
        let seen = self.seen_before(event, &ips, caller, end, unmatched_release);
        self.ips = ips;
        let Err(mut event) = seen else {
            return;
        };
        let key = (!unmatched_release && self.stacks)
            .then(|| StackCache::key(pid, &self.ips, caller, end));
        let raw = key.map(|_| self.ips.clone());
        let images = self.processes.get(&pid);
        let image_at = |ip| images.and_then(|p| p.image_at(ip));
        let cut = vet(&mut self.ips, &mut self.trust, &mut self.known, image_at);
        // libunwind ends a walk where it finds no rule too: that is the
        // outermost frame only if CFI says so.
        let ends_in_cfi = ends_in_cfi(&self.ips, image_at);
        let truncated = (cut || end == WalkEnd::Failed || end == WalkEnd::Stopped && !ends_in_cfi)
            && self.ips.len() < self.max_depth;
        if unmatched_release && self.is_housekeeping(allocator_module, caller) {
            self.result.housekeeping_frees += 1;
            return;
        }
        if self.stacks {
            if self.ips.is_empty() && caller != 0 {
                self.ips.push(caller);
            }
            let truncated = truncated && !self.ips.is_empty();
            if truncated {
                self.result.truncated_stacks += 1;
            }
            let images = self.processes.get(&pid);
            let module_of = |ip: u64| images.and_then(|p| p.image_at(ip)).map(|m| m.module_id);
            event.stack_id = self
                .interner
                .intern(&self.ips, &self.trust, module_of, &mut self.out);
            if let (Some(key), Some(raw)) = (key, raw) {
                self.seen
                    .insert(key, pid, raw, caller, end, truncated, event.stack_id);
            }
        }
        self.result.events += 1;
        self.out.push(Record::Event(event));
    }

    /// Record a mapping call: its stack unwound, vetted and interned as an
    /// allocator call's is, and the allocator call it was made in, if any.
    fn map(&mut self, raw: RawMap) {
        let RawMap { mut event, stack } = raw;
        let pid = event.pid;
        let (caller, _, copy) = self.take_stack(pid, event.tid, stack);
        let images = self.processes.get(&pid);
        let image_at = |ip| images.and_then(|p| p.image_at(ip));
        let cut = vet(&mut self.ips, &mut self.trust, &mut self.known, image_at);
        // The walk is the whole stack when it ends in code that CFI
        // describes (`_start`); else it may have stopped in the allocator.
        let whole = !cut && ends_in_cfi(&self.ips, image_at);
        if self.ips.is_empty() && caller != 0 {
            self.ips.push(caller);
        }
        // The allocator call it was made in, the outermost: by a frame
        // inside an allocator function or just after a call of one, or,
        // where the stack ends early (code without unwind tables: musl's
        // malloc, whose helpers a stripped binary names no extent of), by
        // the return addresses left in the stack copy.
        event.by_allocator = self
            .ips
            .iter()
            .rev()
            .find_map(|&ip| allocator_frame(ip, &image_at))
            .or_else(|| {
                let copy = copy.filter(|_| !whole)?;
                allocator_call_in_copy(&copy, &image_at)
            });
        if self.stacks {
            let module_of = |ip: u64| images.and_then(|p| p.image_at(ip)).map(|m| m.module_id);
            event.stack_id = self
                .interner
                .intern(&self.ips, &self.trust, module_of, &mut self.out);
        }
        self.out.push(Record::Map(event));
    }

    /// One `meta` row per allocator function of an image, saying how it was
    /// found: `allocator.<path>.<function>` = `symbol at 0x…`, `debug file
    /// <path> at 0x…` or `signature <function> of <library> at 0x…`.
    /// Written once per path and function (forked children share them).
    fn allocator_meta(&mut self, path: &str, mapped: &MappedImage) {
        for entry in &mapped.image.allocators {
            for op in &entry.ops {
                let key = format!("allocator.{path}.{op}");
                if self.meta_written.insert(key.clone()) {
                    self.out.push(Record::Meta {
                        key,
                        value: format!("{} at {:#x}", entry.found_by, entry.svma.0),
                    });
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Op;
    use crate::sink::{MemorySink, Recorder, StackNode};
    use crate::trace_msg::{BatchedCall, CallBatch};

    fn event(id: u64) -> Event {
        Event {
            id,
            ts_ns: id,
            pid: 10,
            tid: 11,
            op: Op::Malloc,
            ptr: 0x5000 + id * 16,
            size: Some(16),
            old_ptr: None,
            align: None,
            alloc_id: None,
            stack_id: None,
        }
    }

    /// Run `batches` through a pipeline (stacks kept, no unwinding of its
    /// own, no image known) into memory: what it counted and recorded.
    fn run(batches: Vec<Vec<TraceMsg>>) -> (PipelineResult, Vec<Record>) {
        let sink = MemorySink::new();
        let recorder = Recorder::spawn(Box::new(sink.clone()));
        let pipeline = PipelineHandle::spawn(recorder.sender(), false, true, 64, None);
        for batch in batches {
            pipeline.send(batch).unwrap();
        }
        let result = pipeline.finish().unwrap();
        recorder.finish().unwrap();
        (result, sink.records())
    }

    #[test]
    fn batched_calls_become_events_on_interned_stacks() {
        let mut batch = CallBatch::default();
        // The same two frames three times, the second time the caller only.
        for (id, caller_only) in [(1, false), (2, true), (3, false)] {
            let start = batch.frames.len();
            batch.frames.extend_from_slice(&[0x1000, 0x2000]);
            batch.calls.push(BatchedCall {
                event: event(id),
                frames: start..batch.frames.len(),
                end: WalkEnd::Outermost,
                caller_only,
                allocator_module: 1,
                unmatched_release: false,
            });
        }
        let meta = Record::Meta {
            key: "k".into(),
            value: "v".into(),
        };
        let (result, records) = run(vec![
            vec![TraceMsg::Record(meta.clone())],
            vec![TraceMsg::Calls(Box::new(batch))],
        ]);
        // In order, and the record passed on as it came.
        assert_eq!(records.first(), Some(&meta));
        let events: Vec<&Event> = records
            .iter()
            .filter_map(|r| match r {
                Record::Event(e) => Some(e),
                _ => None,
            })
            .collect();
        assert_eq!(events.iter().map(|e| e.id).collect::<Vec<_>>(), [1, 2, 3]);
        let nodes: Vec<&StackNode> = records
            .iter()
            .filter_map(|r| match r {
                Record::StackNode(n) => Some(n),
                _ => None,
            })
            .collect();
        // No image is known: the second frame is no return address and is
        // cut, so every call has the one-frame stack of its caller, and
        // the two full walks count as truncated (the second from the cache).
        assert_eq!(nodes.len(), 1);
        assert_eq!((nodes[0].parent_id, nodes[0].depth), (None, 0));
        for e in &events {
            assert_eq!(e.stack_id, Some(nodes[0].id), "event {}", e.id);
        }
        assert_eq!(result.events, 3);
        assert_eq!(result.truncated_stacks, 2);
        assert_eq!(result.housekeeping_frees, 0);
        assert_eq!(result.stack_nodes, 1);
    }

    /// The records go to the recorder's queue in a vector no larger than
    /// they are (the queue weighs its capacity), and the next batch starts
    /// with room for as many.
    #[test]
    fn records_leave_in_a_vector_of_their_own_size() {
        let mut pipeline = Pipeline::new(false, true, 64, None, SpareBatches::default());
        for id in 0..1000 {
            pipeline.out.push(Record::Event(event(id)));
        }
        assert!(pipeline.out.capacity() > 1000, "grown by doubling");
        let out = pipeline.take_out();
        assert_eq!((out.len(), out.capacity()), (1000, 1000));
        assert!(pipeline.out.is_empty());
        assert!(pipeline.out.capacity() >= 1000);
        // A smaller batch next: still no room sent beyond its records.
        pipeline.out.push(Record::Event(event(1000)));
        assert_eq!(pipeline.take_out().capacity(), 1);
        let weight = handle::weigh(&vec![TraceMsg::Record(Record::Event(event(0)))]);
        assert_eq!(weight, size_of::<TraceMsg>() as u64);
    }

    /// A batch from the tracer weighs the memory its vectors hold, spare
    /// room included: by their lengths, a queue at its bound held up to
    /// twice its bound.
    #[test]
    fn a_batch_of_calls_weighs_its_capacity() {
        let mut calls = CallBatch {
            calls: Vec::with_capacity(100),
            frames: Vec::with_capacity(4096),
        };
        calls.frames.extend_from_slice(&[0x1000, 0x2000]);
        calls.calls.push(BatchedCall {
            event: event(1),
            frames: 0..2,
            end: WalkEnd::Outermost,
            caller_only: false,
            allocator_module: 0,
            unmatched_release: false,
        });
        let mut batch = Vec::with_capacity(16);
        batch.push(TraceMsg::Calls(Box::new(calls)));
        let expected = 16 * size_of::<TraceMsg>()
            + size_of::<CallBatch>()
            + 100 * size_of::<BatchedCall>()
            + 4096 * 8;
        assert_eq!(weigh(&batch), expected as u64);
    }

    #[test]
    fn a_call_with_its_caller_only_and_a_gone_process() {
        let call = RawCall {
            event: event(7),
            stack: CallStack::CallerOnly(0x3000),
            allocator_module: 1,
            unmatched_release: false,
        };
        let (result, records) = run(vec![vec![
            TraceMsg::Call(Box::new(call)),
            TraceMsg::ProcessGone { pid: 10 },
            TraceMsg::Record(Record::Event(event(8))),
        ]]);
        let ids: Vec<(u64, bool)> = records
            .iter()
            .filter_map(|r| match r {
                Record::Event(e) => Some((e.id, e.stack_id.is_some())),
                _ => None,
            })
            .collect();
        // The inventory-like record keeps no stack; the call has its caller.
        assert_eq!(ids, [(7, true), (8, false)]);
        assert_eq!(result.events, 2);
        assert_eq!(result.truncated_stacks, 0);
    }
}
