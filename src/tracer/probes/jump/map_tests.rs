//! The probes of mapping functions (attach): six arguments kept for the
//! function and recorded, a slot of their own so that a mapping call made
//! inside an allocator call is recorded, and only a thread's outermost
//! mapping call.

use iced_x86::code_asm::*;

use super::*;
use crate::event::MapOp;

/// Offsets of the fake mapping functions in the code mapping.
const MMAP: usize = 0x100;
const BRK: usize = 0x140;
const SBRK: usize = 0x180;
/// An allocator function that calls mmap.
const GROW: usize = 0x1c0;

/// Arguments whose sum tells each apart, and which the fake mmap returns.
const ARGS: [u64; 6] = [1, 0x10, 0x100, 0x1000, 0x1_0000, 0x10_0000];

/// One record as read back from a ring.
#[derive(Debug, PartialEq, Eq)]
struct MapRec {
    code: u8,
    probe: u16,
    seq: u64,
    args: [u64; 6],
    ret: u64,
    frames: usize,
}

impl Rig {
    /// The rig with the fake mapping functions, and this thread's slot for
    /// its mapping calls (offset in the control area).
    fn with_maps() -> (Rig, usize) {
        let rig = Rig::new();
        let tp = thread_pointer();
        let i = layout::home_of_key(layout::map_key_of(tp));
        let map_slot = layout::slot_offset(i) as usize;
        assert_ne!(map_slot, rig.slot);
        let c = &rig.control;
        let field = |f: u64| map_slot + f as usize;
        for f in [slot::STACK_LO, slot::STACK_HI, slot::CACHE_DIR] {
            c.write_u64(field(f), rig.slot_word(f));
        }
        c.write_u64(field(slot::RING), c.addr() + layout::ring_offset(i));
        c.write_u64(field(slot::CACHE), c.addr() + layout::cache_offset(i));
        c.write_u64(field(slot::KEY), layout::map_key_of(tp));
        rig.function(MMAP, |a| {
            a.mov(rax, rdi)?;
            for reg in [rsi, rdx, rcx, r8, r9] {
                a.add(rax, reg)?;
            }
            a.ret()
        });
        rig.function(BRK, |a| {
            a.mov(rax, rdi)?;
            a.add(rax, 1)?;
            a.ret()
        });
        let brk = rig.code.addr() + BRK as u64;
        rig.function(SBRK, |a| {
            a.push(rbx)?;
            a.mov(rbx, rdi)?;
            a.mov(rdi, rsi)?;
            a.call(brk)?;
            a.pop(rbx)?;
            a.ret()
        });
        let mmap = rig.code.addr() + MMAP as u64;
        rig.function(GROW, |a| {
            a.push(rbx)?;
            a.mov(rbx, rdi)?;
            a.mov(rsi, rdi)?;
            a.mov(edx, 3)?;
            a.mov(ecx, 4)?;
            a.mov(r8d, 5)?;
            a.mov(r9d, 6)?;
            a.call(mmap)?;
            a.pop(rbx)?;
            a.ret()
        });
        (rig, map_slot)
    }

    fn call6(&self, offset: usize, args: [u64; 6]) -> u64 {
        // SAFETY: as in Rig::call.
        unsafe { self.code.call6(offset, args) }
    }

    /// Every record committed in the ring of the slot at `at`.
    fn records_in(&self, at: usize) -> Vec<MapRec> {
        let word = |f: u64| self.control.read_u64(at + f as usize);
        let ring = (word(slot::RING) - self.control.addr()) as usize;
        let head = word(slot::HEAD) as usize;
        let mut pos = 0;
        let mut out = Vec::new();
        while pos < head {
            let r = ring + pos % layout::RING_SIZE as usize;
            let word = |f: u64| self.control.read_u64(r + f as usize);
            let h = layout::RecordHead::unpack(word(record::HEAD));
            let code = h.op;
            let what = layout::Called::of_code(code).expect("a recorded op");
            let frames = usize::from(h.frames);
            let size = usize::from(h.size);
            assert_eq!(size as u64, what.frames_at() + 8 * frames as u64);
            let args = match what {
                Called::Map(_) => [
                    record::ARG0,
                    record::ARG1,
                    record::ARG2,
                    record::ARG3,
                    record::ARG4,
                    record::ARG5,
                ]
                .map(word),
                Called::Alloc(_) => [
                    word(record::ARG0),
                    word(record::ARG1),
                    word(record::ARG2),
                    0,
                    0,
                    0,
                ],
            };
            out.push(MapRec {
                code,
                probe: h.probe,
                seq: word(record::SEQ),
                args,
                ret: word(record::RET),
                frames,
            });
            pos += size;
        }
        out
    }
}

fn map_code(op: MapOp) -> u8 {
    Called::Map(op).code()
}

#[test]
fn a_mapping_call_is_recorded_with_six_arguments_in_its_own_slot() {
    let (mut rig, map_slot) = Rig::with_maps();
    rig.plant_for(MMAP, Called::Map(MapOp::Mmap), 1);
    let sum = ARGS.iter().sum::<u64>();
    assert_eq!(rig.call6(MMAP, ARGS), sum, "the function gets its six");
    let records = rig.records_in(map_slot);
    assert_eq!(
        records,
        [MapRec {
            code: map_code(MapOp::Mmap),
            probe: 1,
            seq: 0,
            args: ARGS,
            ret: sum,
            frames: 1,
        }]
    );
    assert!(rig.records().is_empty(), "nothing in the allocator slot");
    let word = |f: u64| rig.control.read_u64(map_slot + f as usize);
    assert_eq!((word(slot::BUSY), word(slot::PENDING_SP)), (0, 0));
}

#[test]
fn only_the_outermost_mapping_call_is_recorded() {
    let (mut rig, map_slot) = Rig::with_maps();
    rig.plant_for(BRK, Called::Map(MapOp::Brk), 1);
    rig.plant_for(SBRK, Called::Map(MapOp::Sbrk), 2);
    // sbrk(0x77, 9) calls brk(9) from its displaced instructions.
    assert_eq!(rig.call(SBRK, 0x77, 9, 0), 10);
    assert_eq!(rig.call(BRK, 20, 0, 0), 21);
    let records = rig.records_in(map_slot);
    let got: Vec<_> = records.iter().map(|r| (r.code, r.args[0], r.ret)).collect();
    assert_eq!(
        got,
        [
            (map_code(MapOp::Sbrk), 0x77, 10),
            (map_code(MapOp::Brk), 20, 21)
        ]
    );
    // The inner brk is left out by design, not counted as a call lost
    // (`nested_calls` counts allocator calls).
    let word = |f: u64| rig.control.read_u64(map_slot + f as usize);
    assert_eq!((word(slot::NESTED), word(slot::PENDING_SP)), (0, 0));
}

#[test]
fn a_mapping_call_inside_an_allocator_call_is_recorded() {
    let (mut rig, map_slot) = Rig::with_maps();
    rig.plant_for(MMAP, Called::Map(MapOp::Mmap), 1);
    rig.plant(GROW, Op::Malloc, 2);
    assert_eq!(rig.call(GROW, 7, 0, 0), 7 + 7 + 3 + 4 + 5 + 6);
    let maps = rig.records_in(map_slot);
    let calls = rig.records_in(rig.slot);
    assert_eq!(maps.len(), 1, "{maps:?}");
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(
        (maps[0].args, maps[0].ret, maps[0].seq),
        ([7, 7, 3, 4, 5, 6], 32, 0)
    );
    // The mmap's frames: its caller (GROW's body), then the malloc probe's
    // return path, where the walk ends (no unwind table here).
    assert!(maps[0].frames >= 1);
    assert_eq!(
        (calls[0].code, calls[0].args[0], calls[0].ret, calls[0].seq),
        (Op::Malloc as u8, 7, 32, 1)
    );
    assert_eq!(rig.slot_word(slot::NESTED), 0);
}

#[test]
fn without_memptrace_a_mapping_call_keeps_its_arguments() {
    // No slot for mapping calls, and memptrace gone: the call goes through
    // unrecorded, with rcx, r8 and r9 as they were.
    let rig = {
        let (mut rig, map_slot) = Rig::with_maps();
        rig.control.write_u64(map_slot + slot::KEY as usize, 0);
        rig.set_header(layout::GONE, 1);
        rig.plant_for(MMAP, Called::Map(MapOp::Mmap), 1);
        rig
    };
    let sum = ARGS.iter().sum::<u64>();
    assert_eq!(rig.call6(MMAP, ARGS), sum);
    assert_eq!(rig.header(layout::LET_THROUGH), 1);
}

#[test]
fn a_full_ring_lets_a_mapping_call_through_with_its_arguments() {
    let (mut rig, map_slot) = Rig::with_maps();
    rig.plant_for(MMAP, Called::Map(MapOp::Mmap), 1);
    rig.control
        .write_u64(map_slot + slot::HEAD as usize, layout::RING_SIZE);
    rig.set_header(layout::GONE, 1);
    let sum = ARGS.iter().sum::<u64>();
    assert_eq!(rig.call6(MMAP, ARGS), sum);
    assert_eq!(rig.header(layout::LET_THROUGH), 1);
    let word = |f: u64| rig.control.read_u64(map_slot + f as usize);
    assert_eq!((word(slot::HEAD), word(slot::BUSY)), (layout::RING_SIZE, 0));
}
