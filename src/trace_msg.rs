//! What the tracer hands the pipeline thread (`unwind::pipeline`): calls and
//! mapping calls as a stop or a ring showed them, with the caller's registers
//! and a copy of the stack or the frames already taken, and the images,
//! processes and records around them, in the order things happened.
//!
//! Plain values, no process handles: the tracer makes them, the pipeline
//! consumes them, and neither module's code is needed to read them. They sit
//! here, below both, so that the producer does not depend on its consumer for
//! its own output and the consumer can be driven by tests without a tracer.

use std::ops::Range;
use std::sync::Arc;

use crate::addr::LoadBias;
use crate::event::{Event, MapEvent};
use crate::sink::{ModuleRecord, Record};
use crate::symbols::elf::ElfImage;

/// The caller's registers at an allocator entry, and a copy of the stack from
/// the allocator's stack pointer up.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StackSample {
    /// The return address into the caller.
    pub ip: u64,
    /// The caller's stack pointer (the allocator's rsp + 8).
    pub sp: u64,
    pub bp: u64,
    /// Address of `bytes[0]`.
    pub base: u64,
    pub bytes: Vec<u8>,
}

impl StackSample {
    /// Read a word of the copied stack.
    pub fn read_u64(&self, addr: u64) -> Option<u64> {
        let offset = usize::try_from(addr.checked_sub(self.base)?).ok()?;
        let word = self.bytes.get(offset..offset.checked_add(8)?)?;
        Some(u64::from_le_bytes(word.try_into().ok()?))
    }
}

/// An image mapped in a process, as unwinders need it.
#[derive(Clone, Debug)]
pub struct MappedImage {
    pub module_id: u64,
    pub image: Arc<ElfImage>,
    pub bias: LoadBias,
    pub range: Range<u64>,
    /// The process's main executable (as opposed to a shared library).
    pub is_main: bool,
}

/// Why an unwinder stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WalkEnd {
    /// At the outermost frame (CFI that says there is no caller, a zero
    /// return address or frame pointer: the ABI's end of the chain), or at
    /// the depth limit.
    Outermost,
    /// It could not go on: no rule for an address, or the end of the stack
    /// copy. The stack is truncated.
    Failed,
    /// It stopped without saying why (libunwind's end of a walk): outermost
    /// if CFI describes the last frame's code, else truncated.
    Stopped,
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
    pub end: WalkEnd,
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

    /// The memory its vectors hold, in bytes.
    pub fn room(&self) -> usize {
        self.calls.capacity() * size_of::<BatchedCall>() + self.frames.capacity() * 8
    }
}

/// Call batches the pipeline has emptied, handed back for the tracer's next
/// ones: a batch made on one thread and freed on another left glibc's
/// arenas consolidating and faulting in fresh pages for every batch
/// (`malloc_consolidate` and `_int_malloc`, a ninth of the tracer thread's
/// samples on python3). A few are kept, each
/// at most [`SpareBatches::ROOM`] bytes: what waits here is bounded.
#[derive(Clone, Debug, Default)]
pub struct SpareBatches(Arc<std::sync::Mutex<Vec<CallBatch>>>);

impl SpareBatches {
    /// Batches kept at most.
    const KEEP: usize = 4;
    /// The largest batch kept, in bytes of its vectors.
    pub const ROOM: usize = 2 << 20;

    /// An emptied batch, if one was handed back.
    pub fn take(&self) -> Option<Box<CallBatch>> {
        self.0.lock().ok()?.pop().map(Box::new)
    }

    /// `batch` is done with: emptied, it serves again (if few wait).
    pub fn give(&self, mut batch: CallBatch) {
        if batch.room() > Self::ROOM {
            return;
        }
        batch.calls.clear();
        batch.frames.clear();
        if let Ok(mut spares) = self.0.lock() {
            if spares.len() < Self::KEEP {
                spares.push(batch);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StackSample {
        StackSample {
            ip: 0x401000,
            sp: 0x7ff0_0008,
            bp: 0,
            base: 0x7ff0_0000,
            bytes: (0u8..24).collect(),
        }
    }

    #[test]
    fn a_sample_reads_whole_words_of_its_copy_only() {
        let s = sample();
        assert_eq!(s.read_u64(0x7ff0_0000), Some(0x0706_0504_0302_0100));
        assert_eq!(s.read_u64(0x7ff0_0010), Some(0x1716_1514_1312_1110));
        // Unaligned, still inside.
        assert_eq!(s.read_u64(0x7ff0_0001), Some(0x0807_0605_0403_0201));
        // A word that runs past the end, below the start, or far away.
        assert_eq!(s.read_u64(0x7ff0_0011), None);
        assert_eq!(s.read_u64(0x7fef_ffff), None);
        assert_eq!(s.read_u64(u64::MAX), None);
        assert_eq!(s.read_u64(0), None);
        // A copy based so high that the arithmetic would overflow.
        let high = StackSample {
            base: u64::MAX - 3,
            bytes: vec![0; 16],
            ..sample()
        };
        assert_eq!(high.read_u64(u64::MAX - 3), Some(0));
        assert_eq!(high.read_u64(u64::MAX), Some(0));
        assert_eq!(StackSample::default().read_u64(0), None);
    }

    #[test]
    fn a_batch_holds_each_calls_frames_in_one_vector() {
        let mut batch = CallBatch::default();
        assert!(batch.is_empty());
        for (n, frames) in [&[0x10u64, 0x20][..], &[0x30], &[]].into_iter().enumerate() {
            let start = batch.frames.len();
            batch.frames.extend_from_slice(frames);
            batch.calls.push(BatchedCall {
                event: Event {
                    id: n as u64,
                    ts_ns: n as u64,
                    pid: 1,
                    tid: 1,
                    op: crate::event::Op::Malloc,
                    ptr: 0x1000,
                    size: Some(8),
                    old_ptr: None,
                    align: None,
                    alloc_id: None,
                    stack_id: None,
                },
                frames: start..batch.frames.len(),
                end: WalkEnd::Outermost,
                caller_only: false,
                allocator_module: 1,
                unmatched_release: false,
            });
        }
        assert!(!batch.is_empty());
        let frames: Vec<&[u64]> = batch
            .calls
            .iter()
            .map(|c| &batch.frames[c.frames.clone()])
            .collect();
        assert_eq!(frames, [&[0x10, 0x20][..], &[0x30], &[]]);
    }

    #[test]
    fn spare_batches_come_back_empty_with_their_room_and_are_few() {
        let spares = SpareBatches::default();
        assert!(spares.take().is_none());
        let used = CallBatch {
            calls: Vec::with_capacity(64),
            frames: vec![1, 2, 3],
        };
        let frames_room = used.frames.capacity();
        spares.give(used);
        let back = spares.take().expect("the batch given back");
        assert!(back.is_empty() && back.frames.is_empty());
        assert!(back.calls.capacity() >= 64 && back.frames.capacity() == frames_room);
        assert!(spares.take().is_none());
        // Too large to keep, and no more than a few.
        spares.give(CallBatch {
            calls: Vec::new(),
            frames: Vec::with_capacity(SpareBatches::ROOM / 8 + 1),
        });
        assert!(spares.take().is_none());
        for _ in 0..10 {
            spares.give(CallBatch::default());
        }
        let kept = std::iter::from_fn(|| spares.take()).count();
        assert_eq!(kept, SpareBatches::KEEP);
    }
}
