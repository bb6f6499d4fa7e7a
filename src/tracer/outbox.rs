//! What the tracer has to say, batched for the pipeline thread: one channel
//! send per batch, not per call.
//!
//! A `free` whose thread copies its own stack is recorded at its entry,
//! before its copy is made (see `copies`): it waits in the batch, and the
//! batch goes to the pipeline only up to the first call still waiting, so
//! the pipeline sees every message in order.

use std::collections::BTreeMap;

use crate::event::Event;
use crate::os::ptrace::Tid;
use crate::sink::SinkError;
use crate::trace_msg::{BatchedCall, CallBatch, CallStack, TraceMsg, WalkEnd};
use crate::unwind::pipeline::PipelineHandle;

/// Messages per batch sent to the pipeline.
const BATCH: usize = 1024;

/// Bytes of stack copies per batch, at most (about 32 calls with deep
/// stacks). What waits in the pipeline's queue is bounded in bytes
/// (`pipeline::QUEUE_BYTES`), however deep the program's stacks are.
const BATCH_BYTES: usize = 1 << 20;

/// While the pipeline's queue is full, a batch grows (the tracer goes on
/// serving stops: a thread at an int3 probe would wait for it) up to this
/// many batches' worth of messages, or `BACKLOG_BYTES` of stack copies;
/// then the tracer waits for room. So what waits for unwinding stays under
/// the queue's bound and this batch.
const BACKLOG: usize = 64;
const BACKLOG_BYTES: usize = 32 * BATCH_BYTES;

pub struct Outbox {
    pipeline: PipelineHandle,
    batch: Vec<TraceMsg>,
    /// Bytes of stack copies in `batch`.
    bytes: usize,
    /// Messages sent so far: `batch[i]` is message number `sent + i`.
    sent: u64,
    /// Calls in `batch` (by message number) waiting for the copy their
    /// thread makes.
    awaiting: BTreeMap<u64, Tid>,
    /// Calls with their frames (jump probes), gathered into one message.
    open: Box<CallBatch>,
    /// Calls with their frames in `batch` and `open`.
    calls: usize,
}

impl Outbox {
    pub fn new(pipeline: PipelineHandle) -> Outbox {
        Outbox {
            pipeline,
            batch: Vec::with_capacity(BATCH),
            bytes: 0,
            sent: 0,
            awaiting: BTreeMap::new(),
            open: Box::default(),
            calls: 0,
        }
    }

    pub fn into_pipeline(self) -> PipelineHandle {
        self.pipeline
    }

    pub fn push(&mut self, msg: TraceMsg) {
        self.close_calls();
        if let TraceMsg::Call(call) = &msg {
            if let CallStack::Sample(sample) = &call.stack {
                self.bytes += sample.bytes.len();
            }
        }
        self.batch.push(msg);
    }

    /// Push a call with its frames (innermost first), into the open batch
    /// of such calls.
    pub fn push_frames(
        &mut self,
        event: Event,
        frames: &[u64],
        end: WalkEnd,
        caller_only: bool,
        allocator_module: u64,
        unmatched_release: bool,
    ) {
        let start = self.open.frames.len();
        self.open.frames.extend_from_slice(frames);
        self.open.calls.push(BatchedCall {
            event,
            frames: start..self.open.frames.len(),
            end,
            caller_only,
            allocator_module,
            unmatched_release,
        });
        self.calls += 1;
    }

    /// The open batch of calls becomes a message, in its place in order.
    /// The next one starts with the room this one took (growing a batch
    /// call by call was a tenth of the tracer thread's time).
    fn close_calls(&mut self) {
        if !self.open.is_empty() {
            let next = CallBatch {
                calls: Vec::with_capacity(self.open.calls.len()),
                frames: Vec::with_capacity(self.open.frames.len()),
            };
            let calls = std::mem::replace(&mut self.open, Box::new(next));
            self.batch.push(TraceMsg::Calls(calls));
        }
    }

    /// Push a call that waits for its thread's stack copy; returns its
    /// message number.
    pub fn push_awaiting(&mut self, msg: TraceMsg, tid: Tid) -> u64 {
        self.close_calls();
        let number = self.sent + self.batch.len() as u64;
        self.push(msg);
        self.awaiting.insert(number, tid);
        number
    }

    /// `n` bytes of stack copy were added to a call in the batch.
    pub fn add_bytes(&mut self, n: usize) {
        self.bytes += n;
    }

    /// The batch is worth sending.
    pub fn full(&self) -> bool {
        self.batch.len() >= BATCH || self.bytes >= BATCH_BYTES || self.calls >= BATCH
    }

    pub fn awaiting_copies(&self) -> bool {
        !self.awaiting.is_empty()
    }

    /// The calls waiting for copies: (message number, thread).
    pub fn awaiting(&self) -> Vec<(u64, Tid)> {
        self.awaiting.iter().map(|(&n, &t)| (n, t)).collect()
    }

    /// Message `number`, no longer waiting.
    pub fn take_awaiting(&mut self, number: u64) -> Option<&mut TraceMsg> {
        self.awaiting.remove(&number);
        let at = usize::try_from(number.checked_sub(self.sent)?).ok()?;
        self.batch.get_mut(at)
    }

    /// Append many messages at once (the attach's inventory).
    pub fn append(&mut self, mut msgs: Vec<TraceMsg>) {
        self.close_calls();
        if self.batch.is_empty() {
            self.batch = msgs;
        } else {
            self.batch.append(&mut msgs);
        }
    }

    /// Extend a batch with messages that belong in order where they are.
    pub fn extend(&mut self, msgs: impl IntoIterator<Item = TraceMsg>) {
        for msg in msgs {
            self.push(msg);
        }
    }

    /// The batch has grown as far as it may while the queue is full.
    fn overfull(&self) -> bool {
        self.batch.len() >= BACKLOG * BATCH
            || self.bytes >= BACKLOG_BYTES
            || self.calls >= BACKLOG * BATCH
    }

    /// Send the batch up to the first call still waiting for its copy;
    /// unless `wait` or the batch is overfull, only if the pipeline's queue
    /// has room (if not, the batch stays and grows).
    pub fn send_ready(&mut self, wait: bool) -> Result<(), SinkError> {
        self.close_calls();
        let n = match self.awaiting.keys().next() {
            Some(&first) => (first - self.sent) as usize,
            None => self.batch.len(),
        };
        if n == 0 {
            return Ok(());
        }
        // Judged on the whole batch, before it is split.
        let wait = wait || self.overfull();
        let rest = self.batch.split_off(n);
        let batch = std::mem::replace(&mut self.batch, rest);
        if wait {
            self.pipeline.send(batch)?;
        } else if let Some(mut back) = self.pipeline.try_send(batch)? {
            back.append(&mut self.batch);
            self.batch = back;
            return Ok(());
        }
        self.sent += n as u64;
        self.bytes = 0;
        self.calls = 0;
        Ok(())
    }
}
