//! Mapping calls: mmap, munmap, mremap, brk, sbrk, madvise and mprotect,
//! caught by int3 probes whatever `--probes` says (a program makes few of
//! them, and they take up to six arguments), entered through the slot's call
//! stub so that their result is seen, and recorded with their stack as
//! allocator calls are; but in an attach with jump probes, where an int3
//! would kill the process if memptrace died, by jump probes that record
//! them into the rings (see `probes::jump::code`), booked here. Only a thread's outermost mapping call is recorded
//! (glibc's sbrk calls brk). Whether the allocator made the call (arena
//! growth, a large block) is told by the pipeline, from the stack.

use super::probes::jump::control::Record;
use super::probes::jump::layout::record;
use super::process::PendingMap;
use super::{TraceError, Tracer};
use crate::event::{MapEvent, MapOp};
use crate::os::ptrace::{Regs, Tid};
use crate::trace_msg::{CallStack, RawMap, TraceMsg, WalkEnd};

impl Tracer {
    /// The entry of a mapping function: take its arguments and stack, and
    /// send the thread through the slot's stub (`stub`) to see its result;
    /// a call inside the thread's mapping call in progress goes straight on
    /// (`resume_at`).
    pub(super) fn on_map_entry(
        &mut self,
        tid: Tid,
        pid: Tid,
        regs: Regs,
        resume_at: u64,
        stub: u64,
        op: MapOp,
    ) -> Result<(), TraceError> {
        let thread = self.family.threads.get_mut(&tid).expect("known thread");
        if let Some(pending) = &thread.in_map {
            if regs.rsp < pending.entry_sp {
                return self.redirect(tid, regs, resume_at, Vec::new());
            }
            // Left by a longjmp.
            thread.in_map = None;
        }
        let (_, stack) = self.capture(tid, pid, &regs, true);
        let args = [regs.rdi, regs.rsi, regs.rdx, regs.rcx, regs.r8, regs.r9];
        if let Some(thread) = self.family.threads.get_mut(&tid) {
            thread.in_map = Some(PendingMap {
                op,
                args,
                entry_sp: regs.rsp,
                stub,
                stack,
            });
        }
        self.redirect(tid, regs, stub, Vec::new())
    }

    /// The pending mapping call of `tid` that a stop at a return int3 with
    /// stack pointer `rsp` completes (see `returning_call`).
    pub(super) fn returning_map(&mut self, tid: Tid, rsp: u64) -> Option<PendingMap> {
        let thread = self.family.threads.get_mut(&tid)?;
        let ours = thread
            .in_map
            .as_ref()
            .is_some_and(|m| m.entry_sp.wrapping_sub(8) == rsp);
        if ours { thread.in_map.take() } else { None }
    }

    /// Book a mapping call a jump probe recorded (attach), with its
    /// `frames`, made at `ts_ns`, as [`Tracer::record_map`] does one an
    /// int3 probe caught.
    pub(super) fn book_map(&mut self, pid: Tid, r: &Record, op: MapOp, frames: &[u64], ts_ns: u64) {
        self.next_map_id += 1;
        let event = MapEvent {
            id: self.next_map_id,
            ts_ns,
            pid: pid as u32,
            tid: r.tid as u32,
            op,
            args: r.args,
            result: r.ret,
            stack_id: None,
            by_allocator: None,
        };
        let end = if r.flags & record::TRUNCATED != 0 {
            WalkEnd::Failed
        } else {
            WalkEnd::Outermost
        };
        // Without the allocator probes' return paths the walk went through
        // (see `space::retpaths`): the program's frames.
        let space = self
            .family
            .processes
            .get(&pid)
            .and_then(|p| p.space.as_ref());
        let ips = frames
            .iter()
            .copied()
            .filter(|&ip| !space.is_some_and(|s| s.in_areas(ip)))
            .collect();
        let stack = CallStack::Unwound { ips, end };
        self.send(TraceMsg::Map(Box::new(RawMap { event, stack })));
    }

    /// Send a mapping call that returned `result` down the pipeline.
    pub(super) fn record_map(&mut self, pid: Tid, tid: Tid, map: PendingMap, result: u64) {
        self.next_map_id += 1;
        let event = MapEvent {
            id: self.next_map_id,
            ts_ns: self.now_ns(),
            pid: pid as u32,
            tid: tid as u32,
            op: map.op,
            args: map.args,
            result,
            stack_id: None,
            by_allocator: None,
        };
        self.send(TraceMsg::Map(Box::new(RawMap {
            event,
            stack: map.stack,
        })));
    }
}
