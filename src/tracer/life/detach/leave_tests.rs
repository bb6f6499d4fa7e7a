//! A detach's threads on a fake target: calls in progress sent home,
//! threads moved out of the trampoline areas, pages kept where needed.

use std::collections::HashSet;

use super::*;
use crate::tracer::probes::Probe;
use crate::tracer::space::fake::{AREA, AREA_LEN, BASE, FakeSpace, PID};
use crate::tracer::target::fake::{Call, FakeTarget};

const TID: Tid = PID + 3;
const STACK: u64 = 0x7ffc_0000_0000;

/// A hooked fake space, a target whose process `PID` has its memory, and
/// the first hook's (entry, stub).
fn hooked() -> (FakeSpace, FakeTarget, u64, u64) {
    let mut fake = FakeSpace::libc(true);
    fake.hook();
    let hook = fake.space.hooks.iter().next().unwrap().clone();
    let Probe::Int3 { stub, .. } = hook.probe else {
        unreachable!("int3 space")
    };
    let mut target = FakeTarget::new();
    target.spaces.insert(PID, fake.mem.clone());
    fake.mem.map(STACK, vec![0xaa; 64]);
    (fake, target, hook.addr, stub)
}

fn word(fake: &FakeSpace, at: u64) -> u64 {
    u64::from_le_bytes(fake.mem.bytes(at, 8).try_into().unwrap())
}

#[test]
fn a_thread_stopped_in_a_slot_is_moved_to_the_entry() {
    let (fake, mut target, entry, stub) = hooked();
    target.stopped_at(TID, stub + int3::DISPLACED, STACK);
    let mut keep = HashSet::new();
    move_out(&mut target, TID, &fake.space, &mut keep).unwrap();
    assert_eq!(target.threads[&TID].regs.rip, entry);
    assert_eq!(target.calls, vec![Call::SetRegs(TID)]);
    assert!(keep.is_empty());
}

#[test]
fn a_thread_outside_the_areas_is_not_touched() {
    let (fake, mut target, _, _) = hooked();
    target.stopped_at(TID, BASE + 0x40, STACK);
    let mut keep = HashSet::new();
    move_out(&mut target, TID, &fake.space, &mut keep).unwrap();
    assert_eq!(target.threads[&TID].regs.rip, BASE + 0x40);
    assert!(target.calls.is_empty());
    assert!(keep.is_empty());
}

#[test]
fn a_thread_nowhere_the_program_knows_keeps_the_pages() {
    let (fake, mut target, _, _) = hooked();
    target.stopped_at(TID, AREA + AREA_LEN - 8, STACK);
    let mut keep = HashSet::new();
    move_out(&mut target, TID, &fake.space, &mut keep).unwrap();
    assert_eq!(keep, HashSet::from([PID]));
    assert!(target.calls.is_empty());
    assert_eq!(target.threads[&TID].regs.rip, AREA + AREA_LEN - 8);
}

#[test]
fn a_gone_thread_is_left_alone() {
    let (fake, mut target, _, _) = hooked();
    let mut keep = HashSet::new();
    move_out(&mut target, TID, &fake.space, &mut keep).unwrap();
    assert!(target.calls.is_empty() && keep.is_empty());
}

#[test]
fn a_call_in_the_function_returns_through_a_pop_ret() {
    let (fake, mut target, _, stub) = hooked();
    // Inside malloc's body, far from the stub.
    target.stopped_at(TID, BASE + 0x30_000, STACK);
    let call = Pending {
        tid: TID,
        pid: PID,
        entry_sp: STACK + 32,
        stub,
    };
    let mut keep = HashSet::new();
    let lost = send_calls_home(&mut target, &[call], |_| Some(&fake.space), &mut keep).unwrap();
    assert_eq!(lost, 1);
    let pop_ret = fake.space.pop_ret().unwrap();
    assert_eq!(word(&fake, STACK + 16), pop_ret);
    assert_eq!(
        target.calls,
        vec![Call::WriteData(
            PID,
            STACK + 16,
            pop_ret.to_le_bytes().to_vec()
        )]
    );
    assert!(keep.is_empty());
    // The words around it are the program's, untouched.
    assert_eq!(word(&fake, STACK + 8), 0xaaaa_aaaa_aaaa_aaaa);
    assert_eq!(word(&fake, STACK + 24), 0xaaaa_aaaa_aaaa_aaaa);
}

#[test]
fn without_a_pop_ret_a_call_returns_past_the_int3_and_the_pages_stay() {
    let (mut fake, mut target, _, stub) = hooked();
    fake.space.modules.clear();
    target.stopped_at(TID, BASE + 0x30_000, STACK);
    let call = Pending {
        tid: TID,
        pid: PID,
        entry_sp: STACK + 32,
        stub,
    };
    let mut keep = HashSet::new();
    send_calls_home(&mut target, &[call], |_| Some(&fake.space), &mut keep).unwrap();
    assert_eq!(word(&fake, STACK + 16), stub + int3::stub().unlea);
    assert_eq!(keep, HashSet::from([PID]));
}

#[test]
fn a_call_whose_thread_stands_in_the_stub_is_left_to_move_out() {
    let (fake, mut target, _, stub) = hooked();
    let mut keep = HashSet::new();
    for rip in [stub, stub + 5, stub + int3::stub().return_int3, stub + 16] {
        target.stopped_at(TID, rip, STACK);
        let call = Pending {
            tid: TID,
            pid: PID,
            entry_sp: STACK + 32,
            stub,
        };
        let lost = send_calls_home(&mut target, &[call], |_| Some(&fake.space), &mut keep).unwrap();
        assert_eq!(lost, 1);
    }
    assert!(target.calls.is_empty());
    assert_eq!(word(&fake, STACK + 16), 0xaaaa_aaaa_aaaa_aaaa);
    assert!(keep.is_empty());
}

#[test]
fn calls_of_gone_threads_or_spaces_are_counted_and_written_nowhere() {
    let (fake, mut target, _, stub) = hooked();
    let gone = Pending {
        tid: TID,
        pid: PID,
        entry_sp: STACK + 32,
        stub,
    };
    let spaceless = Pending {
        tid: TID + 1,
        ..gone
    };
    target.stopped_at(TID + 1, BASE + 0x30_000, STACK);
    let mut keep = HashSet::new();
    let space_of = |tid| (tid == TID).then_some(&fake.space);
    let lost = send_calls_home(&mut target, &[gone, spaceless], space_of, &mut keep).unwrap();
    assert_eq!(lost, 2);
    assert!(target.calls.is_empty());
    assert!(keep.is_empty());
}

#[test]
fn a_stack_pointer_below_the_return_slot_keeps_the_pages() {
    let (fake, mut target, _, stub) = hooked();
    target.stopped_at(TID, BASE + 0x30_000, 8);
    let call = Pending {
        tid: TID,
        pid: PID,
        entry_sp: 8,
        stub,
    };
    let mut keep = HashSet::new();
    send_calls_home(&mut target, &[call], |_| Some(&fake.space), &mut keep).unwrap();
    assert_eq!(keep, HashSet::from([PID]));
    assert!(target.calls.is_empty());
}

#[test]
fn a_detach_leaves_the_image_as_the_file_has_it() {
    let (mut fake, mut target, entry, stub) = hooked();
    // One thread in a slot, one with a call in progress, one elsewhere.
    target.stopped_at(TID, stub + int3::DISPLACED, STACK);
    target.stopped_at(TID + 1, BASE + 0x30_000, STACK);
    target.stopped_at(TID + 2, BASE + 0x40, STACK);
    let call = Pending {
        tid: TID + 1,
        pid: PID,
        entry_sp: STACK + 32,
        stub,
    };
    let mut keep = HashSet::new();
    send_calls_home(&mut target, &[call], |_| Some(&fake.space), &mut keep).unwrap();
    for tid in [TID, TID + 1, TID + 2] {
        move_out(&mut target, tid, &fake.space, &mut keep).unwrap();
    }
    fake.space.restore_all().unwrap();
    assert!(fake.changed_code().is_empty());
    assert!(keep.is_empty(), "the pages can go");
    assert_eq!(target.threads[&TID].regs.rip, entry);
    assert_eq!(target.threads[&(TID + 1)].regs.rip, BASE + 0x30_000);
    assert_eq!(word(&fake, STACK + 16), fake.space.pop_ret().unwrap());
}
