//! Planting, restoring and the areas, on a fake target: the C library's
//! real code in byte buffers, compared with the file's bytes.

use std::collections::HashSet;

use super::How;
use super::fake::{AREA, AREA_LEN, BASE, FakeSpace, PID};
use crate::memory::Memory;
use crate::os::ptrace::zeroed_regs;
use crate::tracer::probes::int3::{self, DISPLACED, INT3, SLOT_SIZE};
use crate::tracer::probes::{HookKind, Probe};
use crate::tracer::target::CodeMemory;
use crate::tracer::target::fake::FakeMemory;

#[test]
fn hooking_changes_one_byte_per_hook_and_nothing_else() {
    let mut fake = FakeSpace::libc(true);
    let changes = fake.hook();
    let hooks: Vec<_> = fake.space.hooks.iter().cloned().collect();
    // glibc: every allocator entry, the mapping functions, _dl_debug_state
    // only in ld.so (not here).
    let allocators = fake.module.image.allocators.len();
    let mappings = fake.module.image.mappings.len();
    assert_eq!(hooks.len(), allocators + mappings);
    assert_eq!(changes.planted.len(), allocators);
    assert!(changes.planted.iter().all(|p| p.how == How::Int3(None)));
    let changed = fake.changed_code();
    let at: HashSet<u64> = hooks.iter().map(|h| h.addr).collect();
    assert_eq!(changed.keys().copied().collect::<HashSet<_>>(), at);
    for hook in &hooks {
        let (was, is) = changed[&hook.addr];
        assert_eq!(is, INT3);
        assert_eq!(hook.orig, vec![was]);
    }
}

#[test]
fn each_slot_holds_exactly_the_relocated_entry() {
    let mut fake = FakeSpace::libc(true);
    fake.hook();
    for hook in fake.space.hooks.iter() {
        let Probe::Int3 {
            resume_at, stub, ..
        } = &hook.probe
        else {
            panic!("an int3 space plants int3 probes");
        };
        assert_eq!(*resume_at, stub + DISPLACED);
        // The plan, made from the file's bytes at the entry.
        let mut entry = [0u8; 16];
        let code = fake
            .code
            .iter()
            .find(|(at, b)| (*at..*at + b.len() as u64).contains(&hook.addr));
        let (at, bytes) = code.expect("the entry is in the image's code");
        let off = (hook.addr - at) as usize;
        entry.copy_from_slice(&bytes[off..off + 16]);
        let (want, _) = int3::slot_code(&entry, hook.addr, *stub).unwrap();
        assert_eq!(
            fake.mem.bytes(*stub, want.len()),
            want,
            "slot of {:#x}",
            hook.addr
        );
    }
}

#[test]
fn slots_lie_in_the_area_without_overlapping() {
    let mut fake = FakeSpace::libc(true);
    fake.hook();
    let mut stubs: Vec<u64> = fake
        .space
        .hooks
        .iter()
        .map(|h| match h.probe {
            Probe::Int3 { stub, .. } => stub,
            Probe::Jump { .. } => unreachable!("int3 space"),
        })
        .collect();
    stubs.sort_unstable();
    assert!(stubs.len() > 4);
    for pair in stubs.windows(2) {
        assert!(pair[1] - pair[0] >= SLOT_SIZE, "{pair:x?} overlap");
    }
    // The stub injected system calls go through comes first, then slots.
    assert!(stubs[0] >= AREA && *stubs.last().unwrap() + SLOT_SIZE <= AREA + AREA_LEN);
    assert!(stubs.iter().all(|s| fake.space.in_areas(*s)));
    assert!(!fake.space.in_areas(AREA + AREA_LEN));
    assert_eq!(fake.space.area_ranges(), vec![AREA..AREA + AREA_LEN]);
}

#[test]
fn restore_all_puts_every_byte_of_the_image_back() {
    let mut fake = FakeSpace::libc(true);
    fake.hook();
    assert!(!fake.changed_code().is_empty());
    fake.space.restore_all().unwrap();
    assert!(fake.changed_code().is_empty());
    assert_eq!(fake.space.hooks.iter().count(), 0);
    // A second restore has nothing left to write.
    fake.space.restore_all().unwrap();
    assert!(fake.changed_code().is_empty());
}

#[test]
fn put_back_code_restores_but_keeps_the_hooks_for_leaving() {
    let mut fake = FakeSpace::libc(true);
    fake.hook();
    let hooks = fake.space.hooks.iter().count();
    fake.space.put_back_code().unwrap();
    assert!(fake.changed_code().is_empty());
    assert_eq!(fake.space.hooks.iter().count(), hooks);
}

#[test]
fn a_forked_childs_copy_is_restored_and_the_parents_is_not() {
    let mut fake = FakeSpace::libc(true);
    fake.hook();
    let patched = fake.changed_code();
    // The child's memory: a copy of the parent's, patched code included.
    let child = FakeMemory::new();
    for (at, bytes) in &fake.code {
        child.map(*at, fake.mem.bytes(*at, bytes.len()));
    }
    fake.space.put_back_into(&child).unwrap();
    for (at, bytes) in &fake.code {
        assert_eq!(&child.bytes(*at, bytes.len()), bytes);
    }
    assert_eq!(fake.changed_code(), patched);
}

#[test]
fn a_fork_copy_keeps_the_hooks_and_renames_the_modules() {
    let mut fake = FakeSpace::libc(true);
    fake.hook();
    let child = FakeMemory::new();
    let mut next_id = 100;
    let copy = fake
        .space
        .fork_copy_in(PID + 1, Box::new(child), &mut next_id)
        .unwrap();
    assert_eq!(copy.pid, PID + 1);
    assert_eq!(next_id, 101);
    assert_eq!(copy.modules[&fake.module.range.start].id, 101);
    assert_eq!(copy.hooks.iter().count(), fake.space.hooks.iter().count());
    for hook in copy.hooks.iter() {
        if let HookKind::Allocator { module_id, .. } = hook.kind {
            assert_eq!(module_id, 101, "at {:#x}", hook.addr);
        }
    }
    assert_eq!(copy.area_ranges(), fake.space.area_ranges());
}

#[test]
fn hooking_twice_plants_nothing_more() {
    let mut fake = FakeSpace::libc(true);
    fake.hook();
    let before = fake.changed_code();
    let area = fake.mem.region(AREA);
    let again = fake.hook();
    assert!(again.planted.is_empty());
    assert_eq!(fake.changed_code(), before);
    assert_eq!(fake.mem.region(AREA), area);
}

#[test]
fn an_entry_that_is_an_int3_already_is_left_alone() {
    let mut fake = FakeSpace::libc(true);
    let (malloc, _) = fake
        .module
        .image
        .allocator_avmas(fake.module.bias)
        .next()
        .map(|(a, e)| (a.0, e.clone()))
        .unwrap();
    fake.mem.write_code(malloc, &[INT3]).unwrap();
    fake.hook();
    assert!(!fake.space.hooks.contains(malloc));
    assert_eq!(fake.mem.bytes(malloc, 1), vec![INT3]);
}

#[test]
fn hooking_without_an_area_or_a_syscall_fails_and_changes_no_byte() {
    let mut fake = FakeSpace::libc(false);
    // No area, and no syscall instruction known to map one with (the
    // image is not among the space's modules).
    fake.space.modules.clear();
    let module = fake.module.clone();
    let mut changes = super::Changes::default();
    let err = fake
        .space
        .hook(PID, &module, &[], true, &mut changes)
        .unwrap_err();
    assert!(
        matches!(err, super::SpaceError::NoSyscall("map a page")),
        "{err}"
    );
    assert!(fake.changed_code().is_empty());
    assert_eq!(fake.space.hooks.iter().count(), 0);
}

#[test]
fn a_thread_in_a_slot_or_stub_is_mapped_back_to_the_program() {
    let mut fake = FakeSpace::libc(true);
    fake.hook();
    let hook = fake.space.hooks.iter().next().unwrap().clone();
    let Probe::Int3 { stub, .. } = hook.probe else {
        unreachable!()
    };
    let stack = 0x7ffc_0000_0000;
    fake.mem.map(stack, 0x5555_1234u64.to_le_bytes().repeat(4));
    let leave = |rip: u64, rsp: u64| {
        let mut regs = zeroed_regs();
        regs.rip = rip;
        regs.rsp = rsp;
        let moved = fake.space.leave_areas(&mut regs);
        (moved, regs.rip, regs.rsp)
    };
    // At the displaced instruction: its entry, not yet run.
    assert_eq!(
        leave(stub + DISPLACED, stack),
        (Some(true), hook.addr, stack)
    );
    // In the stub, not yet called: the entry, the stub's word undone.
    assert_eq!(leave(stub + 5, stack), (Some(true), hook.addr, stack + 8));
    // At the stub's return int3: to the caller, read from the stack.
    assert_eq!(
        leave(stub + int3::stub().return_int3, stack),
        (Some(true), 0x5555_1234, stack + 16)
    );
    // Elsewhere in the area: nowhere in the program stands for it.
    assert_eq!(leave(AREA + AREA_LEN - 8, stack).0, None);
    // Outside the areas: nothing to do.
    assert_eq!(
        leave(BASE + 0x100, stack),
        (Some(false), BASE + 0x100, stack)
    );
}

#[test]
fn pop_ret_is_found_in_the_images_own_code() {
    let fake = FakeSpace::libc(true);
    let at = fake.space.pop_ret().expect("glibc has a pop + ret");
    let mut pair = [0u8; 2];
    fake.mem.read_exact(at, &mut pair).unwrap();
    assert_eq!(int3::pop_ret(&pair), Some(0));
    assert!(fake.module.range.contains(&at));
    // A space whose code cannot be read has none.
    let mut empty = FakeSpace::libc(false);
    empty.space.modules.clear();
    assert_eq!(empty.space.pop_ret(), None);
}

#[test]
fn a_write_outside_the_mapped_memory_is_an_error() {
    let fake = FakeSpace::libc(true);
    let err = fake
        .mem
        .write_code(AREA + AREA_LEN - 1, &[1, 2])
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    assert_eq!(fake.mem.bytes(AREA + AREA_LEN - 1, 1), vec![0]);
}

/// What `meta` says of each way a function was hooked: the text users read
/// and tests match (`jump; in process N: int3: ...`).
#[test]
fn each_way_of_hooking_reads_as_meta_says_it() {
    use super::{Int3Why, Unhooked};
    use crate::tracer::probes::jump::plan::NoJump;
    let cases = [
        (How::Jump, "jump"),
        (How::Int3(None), "int3"),
        (
            How::Int3(Some(Int3Why::Plan(NoJump::BranchInto(0x1007)))),
            "int3: a branch at 0x1007 lands inside the bytes a jump would cover",
        ),
        (
            How::Int3(Some(Int3Why::FellBack("seccomp".into()))),
            "int3: seccomp",
        ),
        (How::Unhooked(Unhooked::DebugState), "none"),
        (
            How::Unhooked(Unhooked::EntryIsInt3),
            "none: the entry is an int3 already",
        ),
        (
            How::Unhooked(Unhooked::NeedsJump(NoJump::TooShort)),
            "none: the function is shorter than a jump (an int3 would kill the process \
             if memptrace died; its calls are not recorded)",
        ),
    ];
    for (how, text) in cases {
        assert_eq!(how.to_string(), text);
    }
}
