//! The tracer's end of the pipeline: the queue of batches, bounded by what
//! they hold, and the thread behind it.

use std::thread::JoinHandle;

use super::{Pipeline, PipelineResult};
use crate::namer::NameSender;
use crate::queue::{self, Sender, TrySendError};
use crate::sink::{RecordSender, SinkError};
use crate::trace_msg::{CallBatch, CallStack, RawCall, RawMap, SpareBatches, TraceMsg};

/// The producer side, held by the tracer.
pub struct PipelineHandle {
    tx: Option<Sender<Vec<TraceMsg>>>,
    thread: Option<JoinHandle<Result<PipelineResult, SinkError>>>,
    /// Call batches the pipeline emptied, for the next ones.
    spares: SpareBatches,
}

/// What the queue from the tracer holds at most, in bytes of messages (see
/// [`weigh`]), the batch being unwound included: a batch is anything from
/// one message to tens of thousands of calls, and a bound of 32 batches let
/// about 1 GB of calls wait under `-f -- make -j2`. Like the recorder's
/// queue, 8 MiB: what waits here and there is most of memptrace's heap
/// while the target allocates faster than the trace is written (at 32 MiB,
/// 60-100 MB more at its peak, at 16 MiB about 30 MB; docs/performance.md,
/// issue 19 item 4).
const QUEUE_BYTES: u64 = 8 << 20;

/// About the bytes a batch holds: its messages and what they point to
/// (stack copies, frames), not the images they share. Vectors count by
/// their capacity, the memory they hold, not by their length.
#[allow(clippy::ptr_arg)] // the queue's items are `Vec`s
pub fn weigh(batch: &Vec<TraceMsg>) -> u64 {
    let each = |msg: &TraceMsg| {
        let stack = |stack: &CallStack| match stack {
            CallStack::CallerOnly(_) => 0,
            CallStack::Unwound { ips, .. } => ips.capacity() * 8,
            CallStack::Sample(sample) => sample.bytes.capacity(),
        };
        match msg {
            TraceMsg::Call(call) => size_of::<RawCall>() + stack(&call.stack),
            TraceMsg::Map(map) => size_of::<RawMap>() + stack(&map.stack),
            TraceMsg::Calls(batch) => {
                size_of::<crate::trace_msg::CallBatch>()
                    + batch.calls.capacity() * size_of::<crate::trace_msg::BatchedCall>()
                    + batch.frames.capacity() * 8
            }
            TraceMsg::Trampolines { areas, .. } => areas.capacity() * 16,
            TraceMsg::Record(record) => record.heap_bytes(),
            _ => 0,
        }
    };
    let held: usize = batch.iter().map(each).sum();
    (batch.capacity() * size_of::<TraceMsg>() + held) as u64
}

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
        let (tx, rx) = queue::bounded(QUEUE_BYTES, weigh);
        let spares = SpareBatches::default();
        let pipeline = Pipeline::new(unwind_here, stacks, max_depth, names, spares.clone());
        let thread = std::thread::Builder::new()
            .name("memptrace-unwind".into())
            .spawn(move || pipeline.run(rx, recorder))
            .expect("spawning the pipeline thread");
        PipelineHandle {
            tx: Some(tx),
            thread: Some(thread),
            spares,
        }
    }

    /// A handle whose batches go to `tx`, with no thread behind it: for
    /// unit tests of what sends them.
    #[cfg(test)]
    pub fn to_channel(tx: Sender<Vec<TraceMsg>>) -> PipelineHandle {
        PipelineHandle {
            tx: Some(tx),
            thread: None,
            spares: SpareBatches::default(),
        }
    }

    /// A call batch the pipeline emptied, to fill again.
    pub fn spare_batch(&self) -> Option<Box<CallBatch>> {
        self.spares.take()
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
