//! The probe's machine code, run here: a control area and fake allocator
//! functions in memptrace's own memory, the probes planted on them as in a
//! target, and the calls made by this thread. What the ring holds afterwards
//! is checked field by field.
#![allow(unsafe_code)] // LocalMapping::call runs the generated code

use iced_x86::code_asm::*;

use super::code::{ProbeCode, ProbeSpec, probe};
use super::layout::{self, Called, RecordHead, dir, record, rule, slot};
use super::plan::{Plan, plan};
use crate::event::Op;
use crate::os::local::{LocalMapping, thread_pointer};

mod signal;
mod walker;

/// Offsets of the fake functions in the code mapping.
const MALLOC: usize = 0x000;
const FREE: usize = 0x040;
const REALLOC: usize = 0x080;
const CALLER: usize = 0x0c0;
const PROBES: usize = 0x1000;

struct Rig {
    control: LocalMapping,
    code: LocalMapping,
    /// This thread's slot (offset in the control area).
    slot: usize,
    next_probe: usize,
}

/// One record as read back from the ring.
#[derive(Debug)]
struct Rec {
    op: u8,
    probe: u16,
    flags: u8,
    seq: u64,
    args: [u64; 3],
    ret: u64,
    frames: Vec<u64>,
}

impl Rig {
    fn new() -> Rig {
        let control = LocalMapping::new(layout::AREA_SIZE as usize, false).unwrap();
        let code = LocalMapping::new(64 << 10, true).unwrap();
        control.write_u64(layout::MAGIC as usize, layout::MAGIC_VALUE);
        control.write_u64(layout::DIRECTORY as usize, control.addr() + layout::DIRS);
        control.write_u64(layout::WAIT_TIMESPEC as usize + 8, 1_000_000);
        // memptrace is there: a thread's id in the word the kernel clears.
        let tid = crate::os::local::thread_id() as u32;
        control.write(layout::ALIVE_WORD as usize, &tid.to_le_bytes());
        // This thread's slot, as memptrace makes one: fixed part, key last.
        let tp = thread_pointer();
        let i = layout::home_of_key(layout::key_of(tp));
        let slot = layout::slot_offset(i) as usize;
        let (lo, hi) = own_stack();
        control.write_u64(slot + slot::STACK_LO as usize, lo);
        control.write_u64(slot + slot::STACK_HI as usize, hi);
        control.write_u64(
            slot + slot::RING as usize,
            control.addr() + layout::ring_offset(i),
        );
        control.write_u64(
            slot + slot::CACHE as usize,
            control.addr() + layout::cache_offset(i),
        );
        control.write_u64(slot + slot::CACHE_DIR as usize, u64::MAX);
        control.write_u64(slot + slot::KEY as usize, layout::key_of(tp));

        let rig = Rig {
            control,
            code,
            slot,
            next_probe: PROBES,
        };
        rig.function(MALLOC, |a| {
            a.lea(rax, qword_ptr(rdi + 0x1000))?;
            a.ret()
        });
        rig.function(FREE, |a| {
            a.mov(rax, rdi)?;
            a.nop()?;
            a.nop()?;
            a.ret()
        });
        let malloc = rig.code.addr() + MALLOC as u64;
        rig.function(REALLOC, |a| {
            a.push(rbx)?;
            a.mov(rbx, rdi)?;
            a.mov(rdi, rsi)?;
            a.call(malloc)?;
            a.pop(rbx)?;
            a.ret()
        });
        rig.function(CALLER, |a| {
            a.push(rbp)?;
            a.mov(rbp, rsp)?;
            a.call(malloc)?;
            a.pop(rbp)?;
            a.ret()
        });
        rig
    }

    fn function(
        &self,
        offset: usize,
        body: impl FnOnce(&mut CodeAssembler) -> Result<(), IcedError>,
    ) {
        let mut a = CodeAssembler::new(64).unwrap();
        body(&mut a).unwrap();
        let bytes = a.assemble(self.code.addr() + offset as u64).unwrap();
        self.code.write(offset, &bytes);
    }

    /// Plant a probe for `op` on the function at `offset`.
    fn plant(&mut self, offset: usize, op: Op, id: u16) -> (Plan, ProbeCode) {
        self.plant_for(offset, Called::Alloc(op), id)
    }

    /// Plant a probe recording `what` on the function at `offset`.
    fn plant_for(&mut self, offset: usize, what: Called, id: u16) -> (Plan, ProbeCode) {
        let addr = self.code.addr() + offset as u64;
        let mut bytes = vec![0u8; 64];
        self.code.read(offset, &mut bytes);
        let plan = plan(&bytes, addr);
        assert!(plan.is_jump(), "{:?}", plan.int3);
        let at = self.code.addr() + self.next_probe as u64;
        let spec = ProbeSpec {
            id,
            what,
            control: self.control.addr(),
            displaced: plan.displaced.clone(),
            resume: plan.resume,
            max_frames: layout::MAX_FRAMES,
            fsgsbase: crate::os::procfs::fsgsbase(std::process::id() as i32),
        };
        let code = probe(&spec, at).unwrap();
        self.code.write(self.next_probe, &code.bytes);
        self.next_probe += code.bytes.len().next_multiple_of(64);
        let jump = super::plan::jump(plan.at, code.entry).unwrap();
        self.code
            .write((plan.at - self.code.addr()) as usize, &jump);
        (plan, code)
    }

    fn call(&self, offset: usize, a: u64, b: u64, c: u64) -> u64 {
        // SAFETY: the fake functions and their probes follow the ABI and
        // touch only their arguments' arithmetic, the stack and the control
        // area (see Rig::new); walker.rs's SWITCH runs one on a stack of a
        // live mapping of the test's and comes back to its own, its CAPTURE
        // goes on in an `extern "C"` Rust function.
        unsafe { self.code.call(offset, a, b, c) }
    }

    fn slot_word(&self, field: u64) -> u64 {
        self.control.read_u64(self.slot + field as usize)
    }

    /// Every record committed so far.
    fn records(&self) -> Vec<Rec> {
        let ring = (self.slot_word(slot::RING) - self.control.addr()) as usize;
        let head = self.slot_word(slot::HEAD) as usize;
        let mut at = 0;
        let mut out = Vec::new();
        while at < head {
            let r = ring + at % layout::RING_SIZE as usize;
            let word = |f: u64| self.control.read_u64(r + f as usize);
            // The header the probe packed, unpacked the one way memptrace does.
            let h = RecordHead::unpack(word(record::HEAD));
            let (size, frames) = (usize::from(h.size), usize::from(h.frames));
            out.push(Rec {
                op: h.op,
                probe: h.probe,
                flags: h.flags,
                seq: word(record::SEQ),
                args: [word(record::ARG0), word(record::ARG1), word(record::ARG2)],
                ret: word(record::RET),
                frames: (0..frames)
                    .map(|i| word(record::FRAMES + 8 * i as u64))
                    .collect(),
            });
            assert_eq!(size, 64 + 8 * frames);
            at += size;
        }
        out
    }

    /// A directory with one image: the code mapping, with `rows` (key =
    /// offset in the mapping, rule).
    fn directory(&self, rows: &[(u32, u32)]) {
        let tables = layout::TABLES as usize;
        for (i, (key, rule)) in rows.iter().enumerate() {
            self.control.write(tables + 4 * i, &key.to_le_bytes());
            self.control
                .write(tables + 0x1000 + 4 * i, &rule.to_le_bytes());
        }
        let d = layout::DIRS as usize;
        let e = d + 16;
        let base = self.code.addr();
        self.control.write_u64(e + dir::START as usize, base);
        self.control
            .write_u64(e + dir::END as usize, base + self.code.len() as u64);
        self.control.write_u64(e + dir::BIAS as usize, base);
        self.control
            .write_u64(e + dir::KEYS as usize, self.control.addr() + tables as u64);
        self.control.write_u64(
            e + dir::RULES as usize,
            self.control.addr() + tables as u64 + 0x1000,
        );
        self.control
            .write_u64(e + dir::ROWS as usize, rows.len() as u64);
        self.control.write_u64(d, 1);
    }
}

/// The bounds of the mapping holding this thread's stack.
fn own_stack() -> (u64, u64) {
    let here = 0u8;
    let at = &here as *const u8 as u64;
    let maps = crate::os::procfs::read_maps(std::process::id() as i32).unwrap();
    let m = maps.iter().find(|m| m.start <= at && at < m.end).unwrap();
    (m.start, m.end)
}

#[test]
fn records_calls_in_order_with_their_results() {
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    rig.plant(FREE, Op::Free, 2);
    assert_eq!(
        rig.call(MALLOC, 5, 0, 0),
        0x1005,
        "the function still works"
    );
    assert_eq!(rig.call(FREE, 0x1005, 0, 0), 0x1005);
    assert_eq!(rig.call(MALLOC, 70, 0, 0), 0x1046);
    let records = rig.records();
    assert_eq!(records.len(), 3, "{records:?}");
    let (m, f) = (&records[0], &records[1]);
    assert_eq!(
        (m.op, m.probe, m.args[0], m.ret),
        (Op::Malloc as u8, 1, 5, 0x1005)
    );
    assert_eq!(
        (f.op, f.probe, f.args[0], f.ret),
        (Op::Free as u8, 2, 0x1005, 0)
    );
    assert_eq!(records.iter().map(|r| r.seq).collect::<Vec<_>>(), [0, 1, 2]);
    // No unwind table: the caller only, and the stack marked incomplete.
    for r in &records {
        assert_eq!(r.frames.len(), 1);
        assert_ne!(r.frames[0], 0);
        assert_eq!(r.flags & record::TRUNCATED, record::TRUNCATED);
    }
    // Nothing left claimed.
    assert_eq!(rig.slot_word(slot::BUSY), 0);
    assert_eq!(rig.slot_word(slot::PENDING_SP), 0);
    assert_eq!(rig.slot_word(slot::NESTED), 0);
}

#[test]
fn a_call_inside_a_call_is_not_recorded() {
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    rig.plant(REALLOC, Op::Realloc, 3);
    // realloc(0x77, 9) calls malloc(9) from its displaced call instruction.
    assert_eq!(rig.call(REALLOC, 0x77, 9, 0), 0x1009);
    let records = rig.records();
    assert_eq!(records.len(), 1, "{records:?}");
    let r = &records[0];
    assert_eq!(
        (r.op, r.args[0], r.args[1], r.ret),
        (Op::Realloc as u8, 0x77, 9, 0x1009)
    );
    assert_eq!(rig.slot_word(slot::NESTED), 1);
    assert_eq!(rig.slot_word(slot::PENDING_SP), 0);
}

#[test]
fn walks_the_stack_with_the_unwind_table() {
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    let c = CALLER as u32;
    let rbp_at_16 = 2 << rule::RBP_SHIFT;
    rig.directory(&[
        (c, 8),                                    // at the entry
        (c + 1, 16 | rbp_at_16),                   // after push rbp
        (c + 4, 16 | rule::RBP_BASED | rbp_at_16), // after mov rbp, rsp
        (c + 0x20, rule::NONE),
    ]);
    assert_eq!(rig.call(CALLER, 3, 0, 0), 0x1003);
    // Again: the rules come from the thread's cache this time.
    assert_eq!(rig.call(CALLER, 4, 0, 0), 0x1004);
    let records = rig.records();
    assert_eq!(records.len(), 2);
    // The same frames, but for the test's own return address (another
    // call site in this function).
    assert_eq!(records[0].frames.len(), records[1].frames.len());
    assert_eq!(records[0].frames[0], records[1].frames[0]);
    assert_eq!(records[0].flags, records[1].flags);
    let r = &records[0];
    let code = rig.code.addr()..rig.code.addr() + rig.code.len() as u64;
    // The caller's return address into CALLER, then the one into the test
    // (outside any image: the stack ends there).
    assert_eq!(r.frames.len(), 2, "{r:?}");
    assert_eq!(r.frames[0], rig.code.addr() + CALLER as u64 + 9);
    assert!(!code.contains(&r.frames[1]) && r.frames[1] != 0);
    assert_eq!(r.flags & record::TRUNCATED, record::TRUNCATED);
}

#[test]
fn the_displaced_instructions_are_mapped_back() {
    let mut rig = Rig::new();
    let (plan, code) = rig.plant(REALLOC, Op::Realloc, 3);
    let addr = rig.code.addr() + REALLOC as u64;
    let originals: Vec<u64> = code.displaced_map.iter().map(|&(_, orig)| orig).collect();
    // push rbx; mov rbx, rdi (4 bytes, short of a jump), mov rdi, rsi: 7.
    assert_eq!(originals, [addr, addr + 1, addr + 4, addr + 7]);
    assert_eq!(plan.resume, addr + 7);
    assert_eq!(code.displaced_map[0].0, code.displaced);
    assert!(code.displaced_map.windows(2).all(|w| w[0].0 < w[1].0));
    assert!(code.entry < code.miss && code.miss < code.displaced && code.displaced < code.end);
}

/// The word at `offset` of the mapping at `base`, shared with the thread
/// running the probes.
fn shared_word(base: u64, offset: u64) -> &'static std::sync::atomic::AtomicU64 {
    // SAFETY: `base` is a live LocalMapping of AREA_SIZE bytes (the rig's
    // control area) that outlives the scoped threads using the word; the
    // offset is a header or slot field, 8-byte aligned, inside it.
    unsafe { &*((base + offset) as *const std::sync::atomic::AtomicU64) }
}

impl Rig {
    fn header(&self, field: u64) -> u64 {
        self.control.read_u64(field as usize)
    }

    fn set_header(&self, field: u64, value: u64) {
        self.control.write_u64(field as usize, value);
    }

    /// This thread's slot taken away: its probes look for memptrace.
    fn no_slot(&self) {
        self.control.write_u64(self.slot + slot::KEY as usize, 0);
    }

    /// Its ring full: head a ring ahead of the tail.
    fn fill_ring(&self) {
        self.control
            .write_u64(self.slot + slot::HEAD as usize, layout::RING_SIZE);
    }

    /// Call `offset` with a full ring while memptrace is there (heartbeat
    /// `beat`, `ALIVE_TICKS` as set): once the thread has waited for room,
    /// another thread does to the header what `leave` says, and the call
    /// must come back.
    fn call_waiting(&self, offset: usize, arg: u64, beat: u64, leave: impl Fn(u64) + Send) -> u64 {
        self.fill_ring();
        self.set_header(layout::ALIVE_TSC, beat);
        let base = self.control.addr();
        let waits = self.slot as u64 + slot::WAITS;
        std::thread::scope(|s| {
            s.spawn(move || {
                let waits = shared_word(base, waits);
                while waits.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                leave(base);
            });
            self.call(offset, arg, 0, 0)
        })
    }
}

#[test]
fn a_thread_without_a_slot_goes_through_once_memptrace_is_gone() {
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    rig.plant(FREE, Op::Free, 2);
    rig.no_slot();
    rig.set_header(layout::GONE, 1);
    assert_eq!(rig.call(MALLOC, 5, 0, 0), 0x1005);
    assert_eq!(rig.call(FREE, 0x1005, 0, 0), 0x1005);
    assert_eq!(rig.header(layout::LET_THROUGH), 2);
    assert_eq!(rig.slot_word(slot::HEAD), 0, "nothing recorded");
    assert_eq!(rig.slot_word(slot::BUSY), 0);
}

#[test]
fn an_old_heartbeat_is_memptrace_gone() {
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    rig.no_slot();
    let second = 3_000_000_000;
    rig.set_header(layout::ALIVE_TICKS, second);
    rig.set_header(layout::ALIVE_TSC, crate::os::local::tsc() - 10 * second);
    assert_eq!(rig.call(MALLOC, 7, 0, 0), 0x1007);
    assert_eq!(rig.header(layout::LET_THROUGH), 1);
    assert_eq!(rig.slot_word(slot::HEAD), 0);
}

#[test]
fn a_full_ring_stops_waiting_when_memptrace_says_it_is_gone() {
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    // No limit on the heartbeat's age: only GONE ends the wait.
    let now = crate::os::local::tsc();
    let ret = rig.call_waiting(MALLOC, 9, now, |base| {
        shared_word(base, layout::GONE).store(1, std::sync::atomic::Ordering::SeqCst)
    });
    assert_eq!(ret, 0x1009);
    assert!(rig.slot_word(slot::WAITS) >= 1);
    assert_eq!(rig.header(layout::LET_THROUGH), 1);
    assert_eq!(
        rig.slot_word(slot::HEAD),
        layout::RING_SIZE,
        "nothing recorded"
    );
    assert_eq!(rig.slot_word(slot::BUSY), 0);
    assert_eq!(rig.slot_word(slot::PENDING_SP), 0);
}

#[test]
fn a_full_ring_stops_waiting_when_the_heartbeat_gets_old() {
    let mut rig = Rig::new();
    rig.plant(FREE, Op::Free, 2);
    // A heartbeat ahead of this CPU's counter is a fresh one: the thread
    // waits; then the heartbeat is a second old.
    let second = 3_000_000_000;
    rig.set_header(layout::ALIVE_TICKS, second);
    let ahead = crate::os::local::tsc() + 100 * second;
    let ret = rig.call_waiting(FREE, 0x1005, ahead, |base| {
        shared_word(base, layout::ALIVE_TSC).store(
            crate::os::local::tsc() - 2 * second,
            std::sync::atomic::Ordering::SeqCst,
        );
    });
    assert_eq!(ret, 0x1005);
    assert!(rig.slot_word(slot::WAITS) >= 1);
    assert_eq!(rig.header(layout::LET_THROUGH), 1);
    assert_eq!(rig.slot_word(slot::HEAD), layout::RING_SIZE);
}

#[test]
fn a_probe_goes_straight_on_once_memptrace_died() {
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    rig.plant(REALLOC, Op::Realloc, 3);
    assert_eq!(rig.call(MALLOC, 1, 0, 0), 0x1001);
    // The kernel's mark of a dead owner: no thread id left.
    let died: u32 = 0x4000_0000;
    rig.control
        .write(layout::ALIVE_WORD as usize, &died.to_le_bytes());
    assert_eq!(rig.call(MALLOC, 2, 0, 0), 0x1002);
    assert_eq!(rig.call(REALLOC, 0x77, 3, 0), 0x1003);
    // Even a thread with no slot (which would trap for memptrace).
    rig.no_slot();
    assert_eq!(rig.call(MALLOC, 4, 0, 0), 0x1004);
    let records = rig.records();
    assert_eq!(records.len(), 1, "only the call before: {records:?}");
    assert_eq!(records[0].args[0], 1);
    assert_eq!(
        rig.header(layout::LET_THROUGH),
        0,
        "not counted: nobody reads it"
    );
    assert_eq!(rig.slot_word(slot::BUSY), 0);
    assert_eq!(rig.slot_word(slot::NESTED), 0);
}

#[test]
fn the_gate_of_dl_debug_state_goes_straight_on_without_memptrace() {
    let mut rig = Rig::new();
    const DEBUG_STATE: usize = 0x100;
    // ld.so's: ret, then padding.
    rig.function(DEBUG_STATE, |a| {
        a.ret()?;
        for _ in 0..4 {
            a.nop()?;
        }
        a.nop()
    });
    let addr = rig.code.addr() + DEBUG_STATE as u64;
    let mut bytes = vec![0u8; 16];
    rig.code.read(DEBUG_STATE, &mut bytes);
    let plan = super::plan::over_padding(&bytes, addr).unwrap();
    let at = rig.code.addr() + rig.next_probe as u64;
    let gate = super::liveness::gate(rig.control.addr(), &plan.displaced, plan.resume, at).unwrap();
    rig.code.write(rig.next_probe, &gate.bytes);
    rig.next_probe += gate.bytes.len().next_multiple_of(64);
    let jump = super::plan::jump(plan.at, gate.entry).unwrap();
    rig.code.write(DEBUG_STATE, &jump);
    assert!(gate.entry < gate.miss && gate.miss < gate.displaced);
    assert_eq!(gate.displaced_map[0], (gate.displaced, addr));
    // Dead (no thread id), said gone, or silent for too long: no stop.
    rig.control
        .write(layout::ALIVE_WORD as usize, &0x4000_0000u32.to_le_bytes());
    // (Each call coming back is the test: `ret` returns nothing.)
    rig.call(DEBUG_STATE, 0, 0, 0);
    let tid = crate::os::local::thread_id() as u32;
    rig.control
        .write(layout::ALIVE_WORD as usize, &tid.to_le_bytes());
    rig.set_header(layout::GONE, 1);
    rig.call(DEBUG_STATE, 0, 0, 0);
    rig.set_header(layout::GONE, 0);
    rig.set_header(layout::ALIVE_TICKS, 1);
    rig.set_header(layout::ALIVE_TSC, 1);
    rig.call(DEBUG_STATE, 0, 0, 0);
    assert_eq!(rig.header(layout::LET_THROUGH), 0, "not an allocator call");
}

/// Mapping calls' probes: six arguments, a slot of their own.
#[path = "map_tests.rs"]
mod maps;
