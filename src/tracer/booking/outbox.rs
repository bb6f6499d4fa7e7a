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
const BACKLOG: usize = 16;
const BACKLOG_BYTES: usize = 8 * BATCH_BYTES;

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
    /// How far the batch grows before it is worth sending: one batch's
    /// worth, or, after the pipeline's queue was found full, one more
    /// batch's worth than it held then. (Trying again at every call closed
    /// the open batch of calls each time: a message of one or two calls,
    /// three allocations each, most of the tracer thread's time.)
    due: Due,
}

/// Sizes at which the batch is worth sending (see [`Outbox::full`]).
#[derive(Clone, Copy)]
struct Due {
    messages: usize,
    calls: usize,
    bytes: usize,
}

impl Due {
    const FIRST: Due = Due {
        messages: BATCH,
        calls: BATCH,
        bytes: BATCH_BYTES,
    };
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
            due: Due::FIRST,
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
            // One the pipeline emptied, its memory faulted in already.
            let next = self.pipeline.spare_batch().unwrap_or_else(|| {
                Box::new(CallBatch {
                    calls: Vec::with_capacity(self.open.calls.len()),
                    frames: Vec::with_capacity(self.open.frames.len()),
                })
            });
            let calls = std::mem::replace(&mut self.open, next);
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
        self.batch.len() >= self.due.messages
            || self.bytes >= self.due.bytes
            || self.calls >= self.due.calls
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
            self.due = Due {
                messages: self.batch.len() + BATCH,
                calls: self.calls + BATCH,
                bytes: self.bytes + BATCH_BYTES,
            };
            return Ok(());
        }
        self.sent += n as u64;
        self.bytes = 0;
        self.calls = 0;
        self.due = Due::FIRST;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Op;
    use crate::queue;

    /// While the pipeline's queue is full the tracer offers the batch after
    /// every call it reads (rings.rs): the calls must still travel in
    /// batches of about `BATCH`, not in messages of one call each, and
    /// none may be lost or reordered.
    #[test]
    fn a_full_queue_keeps_calls_in_whole_batches() {
        // Room for one batch, taken.
        let (tx, rx) = queue::bounded(1, |_| 1);
        tx.send(vec![TraceMsg::Calls(Box::default())]).unwrap();
        let mut out = Outbox::new(PipelineHandle::to_channel(tx));
        let calls = 3 * BATCH as u64;
        for id in 0..calls {
            out.push_frames(
                Event::test(id, id, 1, Op::Malloc, 0x1000 + 16 * id, Some(16), None),
                &[0x401000, 0x402000],
                WalkEnd::Outermost,
                false,
                0,
                false,
            );
            if out.full() {
                out.send_ready(false).unwrap();
            }
        }
        let (first, permit) = rx.recv().expect("the batch that filled the queue");
        assert_eq!(first.len(), 1);
        drop(permit);
        out.send_ready(true).unwrap();
        let (sent, _permit) = rx.recv().expect("the calls");
        let batches: Vec<&CallBatch> = sent
            .iter()
            .map(|msg| match msg {
                TraceMsg::Calls(batch) => batch.as_ref(),
                _ => panic!("only calls were pushed"),
            })
            .collect();
        assert_eq!(batches.len(), 3, "one message per BATCH calls");
        let ids: Vec<u64> = batches
            .iter()
            .flat_map(|b| b.calls.iter().map(|c| c.event.id))
            .collect();
        assert_eq!(ids, (0..calls).collect::<Vec<_>>());
        for batch in batches {
            for call in &batch.calls {
                assert_eq!(batch.frames[call.frames.clone()], [0x401000, 0x402000]);
            }
        }
        drop(out);
    }
}
