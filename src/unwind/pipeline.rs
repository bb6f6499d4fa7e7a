//! The pipeline thread: between the tracer and the recorder. It unwinds stack
//! copies (framehop), interns stacks, decides which frees are the allocator's
//! own housekeeping, and hands records to the recorder in batches — all after
//! the target has been resumed, so none of it is on the stop path.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use super::framehop::FramehopUnwinder;
use super::intern::Interner;
use super::vet::{Trust, vet};
use super::{MappedImage, StackSample, Unwinder, WalkEnd};
use crate::addr::Avma;
use crate::event::{Event, MapEvent};
use crate::sink::{ModuleRecord, Record, RecordSender, SinkError};
use crate::symbols::namer::NameSender;

/// Whole stacks seen (see `Pipeline::call`), by a hash of what the
/// unwinder returned.
#[derive(Default)]
struct StackCache {
    stacks: rustc_hash::FxHashMap<u64, SeenStack>,
}

/// A whole stack seen, and what became of it.
struct SeenStack {
    pid: u32,
    ips: Box<[u64]>,
    caller: u64,
    end: WalkEnd,
    truncated: bool,
    leaf: Option<u64>,
}

/// Stacks remembered at most (then the cache starts again).
const STACK_CACHE: usize = 1 << 20;

impl StackCache {
    fn key(pid: u32, ips: &[u64], caller: u64, end: WalkEnd) -> u64 {
        use std::hash::BuildHasher;
        rustc_hash::FxBuildHasher.hash_one((pid, ips, caller, end))
    }

    fn get(
        &self,
        key: u64,
        pid: u32,
        ips: &[u64],
        caller: u64,
        end: WalkEnd,
    ) -> Option<&SeenStack> {
        self.stacks
            .get(&key)
            .filter(|s| s.pid == pid && *s.ips == *ips && s.caller == caller && s.end == end)
    }

    #[allow(clippy::too_many_arguments)]
    fn insert(
        &mut self,
        key: u64,
        pid: u32,
        ips: Vec<u64>,
        caller: u64,
        end: WalkEnd,
        truncated: bool,
        leaf: Option<u64>,
    ) {
        if self.stacks.len() >= STACK_CACHE {
            self.stacks.clear();
        }
        let seen = SeenStack {
            pid,
            ips: ips.into(),
            caller,
            end,
            truncated,
            leaf,
        };
        self.stacks.insert(key, seen);
    }

    /// Forget the stacks of process `pid` (gone: its number may come back
    /// with other images), or every stack (an image went).
    fn forget(&mut self, pid: Option<u32>) {
        match pid {
            Some(pid) => self.stacks.retain(|_, s| s.pid != pid),
            None => self.stacks.clear(),
        }
    }
}

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
    /// Already unwound on the tracer thread (libunwind), and why the walk
    /// ended.
    Unwound { ips: Vec<u64>, end: WalkEnd },
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
    /// The trampoline areas memptrace mapped in process `pid`, all of them.
    Trampolines {
        pid: u32,
        areas: Vec<Range<u64>>,
    },
    Record(Record),
    Call(Box<RawCall>),
    /// Calls whose stacks were taken in the target (jump probes), their
    /// frames in one vector: no allocation per call on either side.
    Calls(Box<CallBatch>),
    /// A call of a mapping function (mmap, munmap, brk...).
    Map(Box<RawMap>),
}

/// A mapping call as the tracer saw it, before unwinding.
#[derive(Debug)]
pub struct RawMap {
    pub event: MapEvent,
    pub stack: CallStack,
}

/// Calls in order, with their frames in one vector.
#[derive(Debug, Default)]
pub struct CallBatch {
    pub calls: Vec<BatchedCall>,
    pub frames: Vec<u64>,
}

/// A call of a [`CallBatch`].
#[derive(Debug)]
pub struct BatchedCall {
    pub event: Event,
    /// Where its frames are in the batch's vector (innermost first).
    pub frames: Range<usize>,
    pub end: super::WalkEnd,
    /// Only the caller is wanted (`--no-stacks`, or skipped by
    /// `--stack-every`): the first frame.
    pub caller_only: bool,
    pub allocator_module: u64,
    pub unmatched_release: bool,
}

impl CallBatch {
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }
}

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
        names: Option<NameSender>,
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
            trust: Vec::with_capacity(max_depth),
            known: Default::default(),
            seen: StackCache::default(),
            meta_written: Default::default(),
            names,
            named: 0,
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

    /// Send `batch` if the queue has room; if not, it comes back.
    pub fn try_send(&self, batch: Vec<TraceMsg>) -> Result<Option<Vec<TraceMsg>>, SinkError> {
        if batch.is_empty() {
            return Ok(None);
        }
        match &self.tx {
            Some(tx) => match tx.try_send(batch) {
                Ok(()) => Ok(None),
                Err(TrySendError::Full(batch)) => Ok(Some(batch)),
                Err(TrySendError::Disconnected(_)) => {
                    Err(SinkError::Stopped("the unwinding thread stopped".into()))
                }
            },
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
            if let Some(names) = &self.names {
                let frames = self.interner.frames();
                names.frames(&frames[self.named..]);
                self.named = frames.len();
            }
        }
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
            TraceMsg::Calls(batch) => {
                for call in batch.calls {
                    let frames = &batch.frames[call.frames];
                    let caller = frames.first().copied().unwrap_or(0);
                    self.ips.clear();
                    if !call.caller_only {
                        self.ips.extend_from_slice(frames);
                    }
                    self.stacked(
                        call.event,
                        caller,
                        call.end,
                        call.allocator_module,
                        call.unmatched_release,
                    );
                }
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

    /// Record a call whose return addresses are in `self.ips` (empty: the
    /// caller alone).
    fn stacked(
        &mut self,
        mut event: Event,
        caller: u64,
        end: WalkEnd,
        allocator_module: u64,
        unmatched_release: bool,
    ) {
        let pid = event.pid;
        // A release of a block not known to be live is looked at whole (it
        // may be the allocator's housekeeping); every other call whose
        // stack was seen before is done.
        let key = (!unmatched_release && self.stacks)
            .then(|| StackCache::key(pid, &self.ips, caller, end));
        if let Some(seen) = key.and_then(|k| self.seen.get(k, pid, &self.ips, caller, end)) {
            if seen.truncated {
                self.result.truncated_stacks += 1;
            }
            event.stack_id = seen.leaf;
            self.result.events += 1;
            self.out.push(Record::Event(event));
            return;
        }
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

/// Return addresses to try, at most, when looking for an allocator call in
/// a stack copy word by word.
const SCAN: usize = 256;

/// The allocator call a stack copy shows a return address of: the
/// outermost word that is a return address (into an image's code, just
/// after a call) whose call instruction is inside an allocator function or
/// calls one, as [`allocator_frame`] tells of a walked frame. Not a stack:
/// only the fact that the thread was inside that call.
fn allocator_call_in_copy<'a>(
    sample: &StackSample,
    image_at: &impl Fn(u64) -> Option<&'a MappedImage>,
) -> Option<crate::event::Op> {
    sample
        .bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .filter(|&word| super::vet::is_return_address(word, image_at(word)))
        .take(SCAN)
        .filter_map(|word| allocator_frame(word, image_at))
        .last()
}

/// True when the last of the return addresses `ips` is in code that CFI
/// describes: a walk that stops there is at the outermost frame.
fn ends_in_cfi<'a>(ips: &[u64], image_at: impl Fn(u64) -> Option<&'a MappedImage>) -> bool {
    ips.last().is_some_and(|&ip| {
        image_at(ip).is_some_and(|m| {
            let svma = m.bias.to_svma(Avma(ip.wrapping_sub(1)));
            m.image.cfi.covers(svma.0)
        })
    })
}

/// The allocator function that return address `ip` is inside of (its
/// call instruction is), or that the call instruction before it calls.
fn allocator_frame<'a>(
    ip: u64,
    image_at: &impl Fn(u64) -> Option<&'a MappedImage>,
) -> Option<crate::event::Op> {
    let image = image_at(ip)?;
    image
        .image
        .allocator_containing(image.bias.to_svma(Avma(ip - 1)))
        .or_else(|| allocator_called_before(ip, image_at))
}

/// The allocator function (malloc, free, ...) that the call instruction
/// before return address `ip` calls, directly, through a jump (musl's
/// `malloc`, when a stripped binary's allocator is hooked at the body it
/// jumps to), or through a PLT stub or a GOT slot: a mapping call whose
/// stack has such a frame was made inside that allocator call, by the
/// allocator.
fn allocator_called_before<'a>(
    ip: u64,
    image_at: &impl Fn(u64) -> Option<&'a MappedImage>,
) -> Option<crate::event::Op> {
    use crate::symbols::callsite::{CallTarget, call_before, jump_target, plt_slot};
    let image = image_at(ip)?;
    let svma = image.bias.to_svma(Avma(ip)).0;
    let before: [u8; 6] = image
        .image
        .code_at(svma.checked_sub(6)?, 6)?
        .try_into()
        .ok()?;
    let slot = match call_before(&before, ip)? {
        CallTarget::Direct(target) => {
            let callee = image_at(target)?;
            let at = callee.bias.to_svma(Avma(target));
            let entry_at = |at| {
                let mut entries = callee.image.allocators.iter();
                entries.find(|a| a.svma == at).map(|a| a.default_op())
            };
            if let Some(op) = entry_at(at) {
                return Some(op);
            }
            let jump = (callee
                .image
                .code_at(at.0, 9)
                .or_else(|| callee.image.code_at(at.0, 5)))
            .and_then(|code| jump_target(code, target));
            if let Some(next) = jump.filter(|&next| callee.range.contains(&next)) {
                if let Some(op) = entry_at(callee.bias.to_svma(Avma(next))) {
                    return Some(op);
                }
            }
            if !callee.image.in_plt(at) {
                return None;
            }
            plt_slot(callee.image.code_at(at.0, 16)?, target)?
        }
        CallTarget::Slot(slot) => slot,
    };
    let owner = image_at(slot)?;
    owner
        .image
        .got_slots
        .get(&owner.bias.to_svma(Avma(slot)).0)
        .copied()
}
