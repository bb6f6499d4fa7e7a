//! Leaving the jump probes on a fake target: the C library hooked with
//! the real probe code, in byte buffers; its control area shared with the
//! test as with a target (the test writes what the probes would); threads
//! stopped in a probe's code, or in a call a probe made.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use crate::memory::Memory;
use crate::os::ptrace::Tid;
use crate::os::shared::SharedMemory;
use crate::tracer::life::tests::Rig;
use crate::tracer::probes::Probe;
use crate::tracer::probes::jump::code::ProbeCode;
use crate::tracer::probes::jump::layout::{self, slot};
use crate::tracer::space::fake::{BASE, FakeSpace, PID};
use crate::tracer::target::CodeMemory;
use crate::tracer::target::fake::{Call, FakeMemory};

const T1: Tid = PID + 1;
const T2: Tid = PID + 2;
const STACK: u64 = 0x7ffc_0000_0000;
/// A place in the program's code: where threads stand outside the probes,
/// and where a call to the allocator returns.
const OUTSIDE: u64 = BASE + 0x40;
/// The word the tests fill the stack with.
const FILL: u64 = 0xaaaa_aaaa_aaaa_aaaa;
const PATIENCE: Duration = Duration::from_millis(50);

/// Process [`PID`] with threads `tids`, its C library hooked with jump
/// probes, each thread stopped outside them on a stack of its own; the
/// probes' side of its control area; the file's code.
fn hooked(tids: &[Tid]) -> (Rig, SharedMemory, Vec<(u64, Vec<u8>)>) {
    let (fake, probes) = FakeSpace::libc_jumps();
    let code = fake.code.clone();
    fake.mem.map(STACK, vec![0xaa; 4096]);
    let mut rig = Rig::of(fake, tids);
    for &tid in tids {
        rig.target.stopped_at(tid, OUTSIDE, STACK);
    }
    (rig, probes, code)
}

/// The entry and the code of a jump probe whose function returns through
/// it (malloc's: it records the block).
fn probe(rig: &Rig) -> (u64, ProbeCode) {
    let space = rig.family.space_of(PID).expect("the rig's");
    let probe = space.hooks.iter().find_map(|h| match &h.probe {
        Probe::Jump { code, .. } if code.ret_path.is_some() => Some((h.addr, code.clone())),
        _ => None,
    });
    probe.expect("a jump probe with a return path")
}

/// Thread `tid` is in a call a probe made, as the probe says in the
/// thread's slot: the stack pointer at the function's entry was `sp`.
fn in_a_call(rig: &mut Rig, probes: &SharedMemory, tid: Tid, sp: u64) {
    let space = rig.family.space_mut(PID).expect("the rig's");
    let control = space.control_mut().expect("made");
    let tp = 0x7f20_0000_0000 + 0x1000 * tid as u64;
    let i = control
        .register(tid, tp, STACK..STACK + 4096)
        .expect("a slot");
    probes.store(layout::slot_offset(i as u64) + slot::PENDING_SP, sp);
}

fn word(mem: &FakeMemory, at: u64) -> u64 {
    mem.read_u64(at).expect("mapped")
}

fn put(mem: &FakeMemory, at: u64, value: u64) {
    mem.write_code(at, &value.to_le_bytes()).expect("mapped");
}

fn leave(rig: &mut Rig, deliver: &mut HashMap<Tid, i32>) -> (Vec<Tid>, HashSet<Tid>) {
    let mut keep_pages = HashSet::new();
    let running = rig
        .life()
        .leave_jump_probes(deliver, &mut keep_pages, PATIENCE)
        .expect("left");
    (running, keep_pages)
}

#[test]
fn a_call_a_probe_made_returns_straight_to_its_caller() {
    let (mut rig, probes, _) = hooked(&[PID, T1, T2]);
    let ret_path = probe(&rig).1.ret_path.expect("found so");
    let mem = rig.target.memory(PID);
    // T1 is in malloc, called by its probe: the caller's return address at
    // the entry's stack pointer, the word the probe pushed, then the
    // probe's return path.
    let sp = STACK + 64;
    put(&mem, sp, OUTSIDE);
    put(&mem, sp - 16, ret_path);
    in_a_call(&mut rig, &probes, T1, sp);
    // T2's slot says a call too, but no probe's return path is there.
    let sp2 = STACK + 256;
    put(&mem, sp2 - 16, OUTSIDE);
    in_a_call(&mut rig, &probes, T2, sp2);
    let (running, keep_pages) = leave(&mut rig, &mut HashMap::new());
    let pop_ret = (rig.family.space_of(PID).and_then(|s| s.pop_ret())).expect("in the library");
    let to = pop_ret.to_le_bytes().to_vec();
    assert_eq!(rig.target.calls, [Call::WriteData(PID, sp - 16, to)]);
    assert_eq!(word(&mem, sp - 16), pop_ret);
    // The pair pops the word the probe pushed and returns to the caller.
    assert!(matches!(
        mem.bytes(pop_ret, 2)[..],
        [0x59 | 0x5e | 0x5f, 0xc3]
    ));
    assert_eq!((word(&mem, sp - 8), word(&mem, sp)), (FILL, OUTSIDE));
    assert_eq!(word(&mem, sp2 - 16), OUTSIDE);
    assert_eq!(rig.stats.lost_returns, 1);
    assert!(running.is_empty() && keep_pages.is_empty());
    assert_eq!(rig.stats.in_probes_at_detach, Some(0));
}

#[test]
fn without_a_pop_ret_a_call_keeps_its_return_path_and_the_pages_stay() {
    let (mut rig, probes, _) = hooked(&[PID, T1]);
    let ret_path = probe(&rig).1.ret_path.expect("found so");
    rig.family
        .space_mut(PID)
        .expect("the rig's")
        .modules
        .clear();
    let mem = rig.target.memory(PID);
    let sp = STACK + 64;
    put(&mem, sp - 16, ret_path);
    in_a_call(&mut rig, &probes, T1, sp);
    let (_, keep_pages) = leave(&mut rig, &mut HashMap::new());
    assert_eq!(keep_pages, HashSet::from([PID]));
    assert!(rig.target.calls.is_empty(), "{:?}", rig.target.calls);
    assert_eq!(word(&mem, sp - 16), ret_path);
    assert_eq!(rig.stats.lost_returns, 1);
}

#[test]
fn a_stack_pointer_the_program_wrote_below_the_slot_or_misaligned_is_no_call() {
    let (mut rig, probes, _) = hooked(&[PID, T1, T2]);
    let ret_path = probe(&rig).1.ret_path.expect("found so");
    let mem = rig.target.memory(PID);
    // Below 16 its return slot would underflow; misaligned, it is no stack
    // pointer a probe wrote, whatever the word there.
    in_a_call(&mut rig, &probes, T1, 8);
    let sp = STACK + 68;
    put(&mem, sp - 16, ret_path);
    in_a_call(&mut rig, &probes, T2, sp);
    let (_, keep_pages) = leave(&mut rig, &mut HashMap::new());
    assert!(rig.target.calls.is_empty(), "{:?}", rig.target.calls);
    assert_eq!(word(&mem, sp - 16), ret_path);
    assert_eq!(rig.stats.lost_returns, 0);
    assert!(keep_pages.is_empty());
}

#[test]
fn a_thread_in_a_probes_code_is_let_run_out_of_it_and_stopped_again() {
    let (mut rig, _, code) = hooked(&[PID, T1]);
    let (_, probe) = probe(&rig);
    // T1 stands at the probe's first instruction; let run, it reaches the
    // program's code (its call begun, or done).
    rig.target.stopped_at(T1, probe.entry, STACK);
    rig.target.runs_to.insert(T1, OUTSIDE + 0x10);
    let mut deliver = HashMap::from([(T1, libc::SIGUSR1)]);
    let (running, keep_pages) = leave(&mut rig, &mut deliver);
    assert!(running.is_empty() && keep_pages.is_empty());
    assert_eq!(rig.stats.in_probes_at_detach, Some(1));
    // Run once, with the signal it was owed, and stopped again.
    let moves: Vec<&Call> = (rig.target.calls.iter())
        .filter(|c| matches!(c, Call::Cont(..) | Call::Interrupt(_)))
        .collect();
    assert_eq!(
        moves,
        [&Call::Cont(T1, libc::SIGUSR1), &Call::Interrupt(T1)]
    );
    assert!(deliver.is_empty());
    assert!(rig.target.threads[&T1].stopped);
    assert_eq!(rig.target.threads[&T1].regs.rip, OUTSIDE + 0x10);
    assert!(rig.family.threads.contains_key(&T1));
    // The entries had their bytes back first: no call enters a probe now.
    let mem = rig.target.memory(PID);
    assert!(
        code.iter()
            .all(|(at, orig)| mem.bytes(*at, orig.len()) == *orig)
    );
}

#[test]
fn a_thread_at_a_probes_miss_begins_its_call_again_at_the_entry() {
    let (mut rig, _, _) = hooked(&[PID, T1]);
    let (entry, probe) = probe(&rig);
    // Stopped by the int3 of a thread without a slot: past it.
    rig.target.stopped_at(T1, probe.miss + 1, STACK);
    let (running, keep_pages) = leave(&mut rig, &mut HashMap::new());
    assert_eq!(rig.target.calls, [Call::SetRegs(T1)]);
    assert_eq!(rig.target.threads[&T1].regs.rip, entry);
    assert!(running.is_empty() && keep_pages.is_empty());
    assert_eq!(rig.stats.in_probes_at_detach, Some(0));
}
