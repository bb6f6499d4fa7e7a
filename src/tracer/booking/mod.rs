//! The booking part of the tracer: what it learns about calls, made into
//! events (`ledger`), stamped (the trace's clock, and the jump probes'
//! counter through `TscClock`), numbered (modules, mapping calls) and sent
//! to the pipeline thread in batches (`outbox`), with the progress line kept
//! up to date. It never stops, resumes or reads a thread: what it needs of
//! the traced processes (`Family`) and the trace's counts (`TraceStats`) is
//! handed to it by the caller.

pub(super) mod copies;
pub(super) mod ledger;
pub(super) mod merge;
pub(super) mod outbox;
pub(super) mod rings;

use std::sync::Arc;
use std::time::Instant;

use crate::tracer::TraceOptions;
use crate::tracer::booking::ledger::{CallFacts, Ledger};
use crate::tracer::booking::merge::TscClock;
use crate::tracer::booking::outbox::Outbox;
use crate::tracer::probes::jump::control::{Damaged, Record};
use crate::tracer::probes::jump::layout::{Called, record};
use crate::tracer::process::{Family, PendingCall, Thread};

use crate::event::Op;
use crate::os::procfs;
use crate::os::ptrace::Tid;
use crate::progress::Progress;
use crate::sink::ThreadRecord;
use crate::trace_msg::{CallStack, RawCall, TraceMsg, WalkEnd};

pub struct Booking {
    /// The trace's clock: every timestamp is taken from it.
    pub clock: Instant,
    /// The jump probes' clock in the trace's (jump probes only).
    pub tsc: Option<TscClock>,
    pub out: Outbox,
    pub ledger: Ledger,
    pub progress: Arc<Progress>,
    pub next_module_id: u64,
    /// Ids of mapping calls so far.
    pub next_map_id: u64,
    /// Stacks are taken (`--no-stacks` turns it off), of every Nth call of
    /// each call site (`--stack-every`).
    stacks: bool,
    stack_every: u64,
}

impl Booking {
    pub fn new(
        opts: &TraceOptions,
        clock: Instant,
        tsc: Option<TscClock>,
        out: Outbox,
        progress: Arc<Progress>,
    ) -> Booking {
        Booking {
            clock,
            tsc,
            out,
            ledger: Ledger::new(),
            progress,
            next_module_id: 0,
            next_map_id: 0,
            stacks: opts.stacks,
            stack_every: opts.stack_every,
        }
    }

    pub fn now_ns(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    pub fn send(&mut self, msg: TraceMsg) {
        self.out.push(msg);
    }

    /// A new traced thread of process `pid`: known from now, and its row sent.
    pub fn add_thread(&mut self, family: &mut Family, tid: Tid, pid: Tid) {
        let start_ns = self.now_ns();
        family.threads.insert(tid, Thread::new(pid, start_ns));
        self.send_thread(family, tid, None);
    }

    /// Send thread `tid`'s row (its name read now), ended at `end_ns` if it has.
    pub fn send_thread(&mut self, family: &Family, tid: Tid, end_ns: Option<u64>) {
        let Some(thread) = family.threads.get(&tid) else {
            return;
        };
        let record = ThreadRecord {
            tid: tid as u32,
            pid: thread.pid as u32,
            name: procfs::thread_name(thread.pid, tid).unwrap_or_default(),
            start_ns: thread.start_ns,
            end_ns,
        };
        self.send(TraceMsg::Record(crate::sink::Record::Thread(record)));
    }

    /// Whether a call of process `pid` from call site `ret` keeps its
    /// stack: not with `--no-stacks`; with `--stack-every N`, every Nth
    /// call of the site, and every call that must (`always`).
    pub fn keeps_stack(&self, family: &mut Family, pid: Tid, ret: u64, always: bool) -> bool {
        self.stacks && (always || family.sampled(pid, ret, self.stack_every))
    }

    /// The facts of a call of thread `tid` of `pid`, stamped now.
    pub fn facts(&self, pid: Tid, tid: Tid, args: [u64; 3], ret: u64, stored: u64) -> CallFacts {
        CallFacts {
            pid: pid as u32,
            tid: tid as u32,
            ts_ns: self.now_ns(),
            args,
            ret,
            stored_ptr: stored,
        }
    }

    /// Book now a call that returned `rax` (and, for posix_memalign,
    /// `stored`) and send it: no heap walk holds calls back any more (a
    /// detach's stops; see `Serve::record_return` for the wait loop's).
    pub fn record_return(&mut self, pid: Tid, tid: Tid, call: PendingCall, rax: u64, stored: u64) {
        let facts = self.facts(pid, tid, call.args, rax, stored);
        let msg = self.completed(call.op, &facts, call.stack, call.module_id);
        self.send(msg);
    }

    /// Book a finished call: its message for the pipeline.
    pub fn completed(
        &mut self,
        op: Op,
        facts: &CallFacts,
        stack: CallStack,
        module_id: u64,
    ) -> TraceMsg {
        let done = self.ledger.complete(op, facts);
        self.progress
            .update(self.ledger.events(), self.ledger.live_bytes());
        TraceMsg::Call(Box::new(RawCall {
            event: done.event,
            stack,
            allocator_module: module_id,
            unmatched_release: done.unmatched_release,
        }))
    }

    /// Book one record a jump probe of process `pid` wrote, with its frames.
    pub fn book_record(
        &mut self,
        family: &mut Family,
        damaged: &mut Damaged,
        pid: Tid,
        r: &Record,
        frames: &[u64],
        now_ns: u64,
    ) {
        let Some(space) = family.processes.get(&pid).and_then(|p| p.space.as_ref()) else {
            return;
        };
        let Some(info) = space.probe_info(r.probe) else {
            return;
        };
        let module_id = info.module_id;
        let ops = (info.ops.len() > 1).then(|| info.ops.clone());
        let caller = frames.first().copied().unwrap_or(0);
        let ts_ns = match self.tsc.as_mut() {
            Some(clock) => match clock.ns_within(r.tsc, now_ns) {
                Some(ns) => ns,
                None => {
                    damaged.add(&Damaged {
                        records: 1,
                        first: Some(format!(
                            "thread {}: a record stamped outside the trace (counter {})",
                            r.tid, r.tsc
                        )),
                        ..Damaged::default()
                    });
                    return;
                }
            },
            None => now_ns,
        };
        let op = match (r.what, ops) {
            (Called::Map(op), _) => return self.book_map(family, pid, r, op, frames, ts_ns),
            (Called::Alloc(_), Some(ops)) => family.alias(pid, &ops, caller),
            (Called::Alloc(op), None) => op,
        };
        let facts = CallFacts {
            pid: pid as u32,
            tid: r.tid as u32,
            ts_ns,
            args: [r.args[0], r.args[1], r.args[2]],
            ret: r.ret,
            stored_ptr: r.stored,
        };
        // `--stack-every N`: every Nth call of a call site keeps its stack
        // (as the int3 probes unwind it), and so does every release of a
        // block not known to be live, which may be the allocator's own
        // housekeeping (told apart by its whole stack).
        // (The ledger's lookup only when it decides: a free's block is looked
        // up once more in `complete`, and these lookups miss the cache.)
        let whole = self.stacks
            && (self.stack_every <= 1
                || (op.takes_block()
                    && r.args[0] != 0
                    && !self.ledger.is_live(pid as u32, r.args[0]))
                || family.sampled(pid, caller, self.stack_every));
        let end = if r.flags & record::TRUNCATED != 0 {
            WalkEnd::Failed
        } else {
            WalkEnd::Outermost
        };
        let done = self.ledger.complete(op, &facts);
        self.progress
            .update(self.ledger.events(), self.ledger.live_bytes());
        self.out.push_frames(
            done.event,
            frames,
            end,
            !whole,
            module_id,
            done.unmatched_release,
        );
    }
}

#[cfg(test)]
impl Booking {
    /// A booking for unit tests whose batches go to the queue returned
    /// (`tsc`: jump probes catch the calls).
    pub fn for_tests(tsc: Option<TscClock>) -> (Booking, crate::queue::Receiver<Vec<TraceMsg>>) {
        let (tx, rx) = crate::queue::bounded(16, |_| 1);
        let opts = TraceOptions {
            probes: crate::tracer::ProbeMode::Int3,
            max_depth: 8,
            unwinder: Default::default(),
            stacks: false,
            stack_every: 1,
            follow_forks: false,
            duration: None,
        };
        let out = Outbox::new(crate::unwind::pipeline::PipelineHandle::to_channel(tx));
        let book = Booking::new(&opts, Instant::now(), tsc, out, Arc::default());
        (book, rx)
    }
}
