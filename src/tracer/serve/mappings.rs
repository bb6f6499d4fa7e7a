//! Mapping calls: mmap, munmap, mremap, brk, sbrk, madvise and mprotect.
//! With jump probes they get jump probes too, which record them into the
//! rings (see `probes::jump::code`), booked here: a program with thread
//! arenas grows and shrinks their heaps with an mprotect every few hundred
//! allocator calls, and a stop each (two, with the return) cost the
//! program more than the calls themselves. Where a jump is not safe, and
//! with int3 probes, an int3 probe catches them, entered through the
//! slot's call stub so that their result is seen, and records them with
//! their stack as allocator calls are; attached with jump probes, where an
//! int3 would kill the process if memptrace died, such a function is left
//! unhooked. Only a thread's outermost mapping call is recorded (glibc's
//! sbrk calls brk). Whether the allocator made the call (arena growth, a
//! large block) is told by the pipeline, from the stack.

use crate::event::{MapEvent, MapOp};
use crate::os::ptrace::Tid;
use crate::trace_msg::{CallStack, RawMap, TraceMsg, WalkEnd};
use crate::tracer::booking::Booking;
use crate::tracer::probes::jump::control::Record;
use crate::tracer::probes::jump::layout::record;
use crate::tracer::process::{Family, PendingMap};

impl Booking {
    /// Book a mapping call a jump probe recorded (attach), with its
    /// `frames`, made at `ts_ns`, as [`Booking::record_map`] does one an
    /// int3 probe caught.
    pub(in crate::tracer) fn book_map(
        &mut self,
        family: &Family,
        pid: Tid,
        r: &Record,
        op: MapOp,
        frames: &[u64],
        ts_ns: u64,
    ) {
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
        let space = family.processes.get(&pid).and_then(|p| p.space.as_ref());
        let ips = frames
            .iter()
            .copied()
            .filter(|&ip| !space.is_some_and(|s| s.in_areas(ip)))
            .collect();
        let stack = CallStack::Unwound { ips, end };
        self.send(TraceMsg::Map(Box::new(RawMap { event, stack })));
    }

    /// Send a mapping call that returned `result` down the pipeline.
    pub(in crate::tracer) fn record_map(
        &mut self,
        pid: Tid,
        tid: Tid,
        map: PendingMap,
        result: u64,
    ) {
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
