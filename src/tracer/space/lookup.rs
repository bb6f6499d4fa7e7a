//! What an address means in a space: the image it lies in, whether it is
//! in a trampoline area or the copy routine, and where a thread stopped
//! there goes on in the program's own code. Reads only: nothing here
//! changes the target but the registers it is handed.

use std::ops::Range;

use super::Space;
use super::buffers::{self, InCopy};
use super::images::LoadedModule;
use crate::addr::Svma;
use crate::os::procfs;
use crate::os::ptrace::{Regs, Tid};
use crate::tracer::inject;
use crate::tracer::probes::int3;

impl Space {
    pub fn module_at(&self, addr: u64) -> Option<&LoadedModule> {
        let (_, m) = self.modules.range(..=addr).next_back()?;
        m.range.contains(&addr).then_some(m)
    }

    /// Move a thread stopped with `regs` out of the trampoline areas, to the
    /// same place in the original code (see [`crate::tracer::probes::Hooks::leave`]); from the copy
    /// routine, to where the routine would have gone on. `Some(false)` when
    /// the thread is in no area, `Some(true)` when `regs` changed, `None`
    /// when it is somewhere in an area that cannot be mapped back.
    pub fn leave_areas(&self, regs: &mut Regs) -> Option<bool> {
        if !self.areas.contains(regs.rip) {
            return Some(false);
        }
        self.leave_copy(regs)?;
        match self.hooks.leave(regs, &*self.mem)? {
            true => Some(true),
            false => None,
        }
    }

    /// Move a thread stopped with `regs` in the copy routine to where the
    /// routine would have jumped, as if its copy were done: `Some(true)`
    /// when it was there, `Some(false)` when not, `None` when its
    /// continuation cannot be read.
    pub fn leave_copy(&self, regs: &mut Regs) -> Option<bool> {
        match self.in_copy(regs.rip) {
            Some(InCopy::Rax) => regs.rip = regs.rax,
            Some(InCopy::Stack) => {
                regs.rip = self.mem.read_u64(regs.rsp).ok()?;
                regs.rsp += 8;
            }
            None => return Some(false),
        }
        Some(true)
    }

    /// Where a thread at `rip` stands in the copy routine, if it is there.
    pub fn in_copy(&self, rip: u64) -> Option<InCopy> {
        buffers::in_copy(rip, self.buffers()?.routine)
    }

    /// True when `rip` lies in one of the trampoline areas.
    pub fn in_areas(&self, rip: u64) -> bool {
        self.areas.contains(rip)
    }

    /// The trampoline areas' address ranges.
    pub fn area_ranges(&self) -> Vec<Range<u64>> {
        self.areas.ranges().collect()
    }

    /// The address of a `pop` + `ret` pair in the program's own code (see
    /// [`int3::pop_ret`]): where a call still running through a stub is
    /// sent to return once the trampoline pages are gone.
    pub fn pop_ret(&self) -> Option<u64> {
        const CHUNK: u64 = 64 << 10;
        for module in self.modules.values() {
            let Some(text) = &module.image.text else {
                continue;
            };
            let start = module.bias.to_avma(Svma(text.start)).0;
            let end = module.bias.to_avma(Svma(text.end)).0;
            let mut at = start;
            let mut buf = vec![0u8; CHUNK as usize + 1];
            while at < end {
                let len = (end - at).min(CHUNK + 1) as usize;
                if self.mem.read_exact(at, &mut buf[..len]).is_err() {
                    break;
                }
                if let Some(offset) = int3::pop_ret(&buf[..len]) {
                    return Some(at + offset as u64);
                }
                at += CHUNK;
            }
        }
        None
    }

    /// How an injected call enters the kernel in this space: through the
    /// stub once there is one.
    pub(super) fn via(&self) -> Option<inject::Via> {
        Some(inject::Via {
            insn: self.syscall_insn()?,
            stub: self.stub,
        })
    }

    /// Run `call` in the stopped thread `tid` through a stub: the one in
    /// the trampoline areas, or, before there is one (and for the call that
    /// unmaps it), a copy lent to page padding ([`inject::through_stub_at`]);
    /// through the program's own instruction only where neither exists.
    pub(super) fn through_a_stub<T>(
        &self,
        tid: Tid,
        via: inject::Via,
        call: impl FnOnce(inject::Via) -> Result<T, inject::InjectError>,
    ) -> Result<T, inject::InjectError> {
        if via.stub.is_some() {
            return call(via);
        }
        match inject::stub::code().and_then(|stub| self.padding_room(tid, stub.len())) {
            Some(at) => inject::through_stub_at(tid, at, via, call),
            None => call(via),
        }
    }

    /// Where the process of `tid` has `len` bytes of page padding after an
    /// image's code (see [`crate::symbols::elf::ElfImage::code_padding`]),
    /// 16-aligned, in an executable mapping of the image's file: room to lend
    /// the stub to a call made before there is a trampoline area or after it
    /// is gone.
    pub(super) fn padding_room(&self, tid: Tid, len: u64) -> Option<u64> {
        let pid = procfs::tgid(tid).unwrap_or(tid);
        let maps = procfs::read_maps(pid).ok()?;
        self.modules.values().find_map(|m| {
            let padding = m.image.code_padding.as_ref()?;
            let start = m
                .bias
                .to_avma(Svma(padding.start))
                .0
                .checked_next_multiple_of(16)?;
            let end = m.bias.to_avma(Svma(padding.end)).0;
            let stop = start.checked_add(len).filter(|&stop| stop <= end)?;
            maps.iter()
                .any(|map| {
                    map.exec && map.inode == m.inode && map.start <= start && stop <= map.end
                })
                .then_some(start)
        })
    }

    fn syscall_insn(&self) -> Option<u64> {
        self.modules
            .values()
            .find_map(|m| m.image.syscall_insn.map(|s| m.bias.to_avma(s).0))
    }
}

#[cfg(test)]
mod tests {
    use super::super::Catch;
    use super::super::areas::AREA_SIZE;
    use super::super::images;
    use super::*;
    use crate::event::Op;
    use crate::os::ptrace::zeroed_regs;
    use crate::tracer::probes::int3::{self, DISPLACED, SLOT_SIZE};
    use crate::tracer::probes::{Hook, HookKind, Probe};

    /// A space of this test's own process, with no image, area or hook:
    /// nothing is ever written through it.
    fn own_space() -> Space {
        Space::new(std::process::id() as Tid, Catch::Int3 { buffers: false }).unwrap()
    }

    /// The same, with the libc this test runs on read as `refresh` reads
    /// it (and hooked nowhere).
    fn with_libc() -> (Space, LoadedModule) {
        let mut space = own_space();
        let maps = procfs::read_maps(space.pid).unwrap();
        let mut next_id = 40;
        let libc = images::image_mappings(&maps)
            .into_iter()
            .find(|f| f.path.ends_with("/libc.so.6"))
            .expect("libc mapped in the test process");
        let module = space.add_image(&libc, &mut next_id).unwrap().unwrap();
        assert_eq!(module.id, 41);
        (space, module)
    }

    fn read(space: &Space, at: u64, len: usize) -> Vec<u8> {
        let mut bytes = vec![0; len];
        space.mem.read_exact(at, &mut bytes).unwrap();
        bytes
    }

    #[test]
    fn an_empty_space_knows_no_address() {
        let space = own_space();
        let mut regs = zeroed_regs();
        regs.rip = 0x1000;
        assert!(space.module_at(0x1000).is_none());
        assert!(!space.in_areas(0x1000));
        assert!(space.area_ranges().is_empty());
        assert_eq!(space.in_copy(0x1000), None);
        assert_eq!(space.leave_copy(&mut regs), Some(false));
        assert_eq!(space.leave_areas(&mut regs), Some(false));
        assert_eq!(regs.rip, 0x1000);
        // No image: no syscall instruction to inject calls with, no
        // pop + ret to send a call to.
        assert!(space.via().is_none());
        assert_eq!(space.pop_ret(), None);
    }

    #[test]
    fn finds_the_image_of_an_address() {
        let (space, libc) = with_libc();
        let range = libc.range.clone();
        assert!(range.start < range.end);
        let id = |addr| space.module_at(addr).map(|m| m.id);
        assert_eq!(id(range.start), Some(41));
        assert_eq!(id(range.end - 1), Some(41));
        assert_eq!(id(range.start + (range.end - range.start) / 2), Some(41));
        assert_eq!(id(range.end), None);
        assert_eq!(id(range.start - 1), None);
        assert_eq!(id(0), None);
        assert_eq!(id(u64::MAX), None);
    }

    #[test]
    fn injects_through_the_images_own_syscall_and_returns_through_its_pop_ret() {
        let (space, libc) = with_libc();
        let via = space.via().expect("libc has a syscall instruction");
        assert!(libc.range.contains(&via.insn));
        assert_eq!(read(&space, via.insn, 2), [0x0f, 0x05]);
        // No trampoline area: no stub yet.
        assert_eq!(via.stub, None);
        let at = space.pop_ret().expect("libc has a pop + ret");
        assert!(libc.range.contains(&at));
        assert_eq!(int3::pop_ret(&read(&space, at, 2)), Some(0));
    }

    #[test]
    fn lends_the_stub_the_padding_after_libcs_code() {
        let (space, libc) = with_libc();
        let tid = std::process::id() as Tid;
        let len = inject::stub::code().expect("the stub assembles").len();
        let at = space
            .padding_room(tid, len)
            .expect("libc's code page has room");
        assert_eq!(at % 16, 0);
        assert!(libc.range.contains(&at) && libc.range.contains(&(at + len - 1)));
        // Past the end of libc's executable segment, within its last page.
        let padding = libc.image.code_padding.clone().unwrap();
        let (start, end) = (
            libc.bias.to_avma(Svma(padding.start)).0,
            libc.bias.to_avma(Svma(padding.end)).0,
        );
        assert!(start <= at && at + len <= end && end % 4096 == 0);
        let maps = procfs::read_maps(space.pid).unwrap();
        assert!(
            maps.iter()
                .any(|m| m.exec && m.start <= at && at + len <= m.end && m.inode == libc.inode)
        );
        // Room for no more than the padding holds.
        assert_eq!(space.padding_room(tid, end - start + 1), None);
    }

    #[test]
    fn a_thread_in_an_int3_slot_goes_back_to_the_original_code() {
        let mut space = own_space();
        // `push rbp; mov rbp, rsp` at `addr`, its slot in an area 16 MiB
        // above (booked, never written).
        let addr = 0x4000_0000;
        let area = 0x4100_0000;
        let slot = area;
        let mut code = [0x90; 16];
        code[..4].copy_from_slice(&[0x55, 0x48, 0x89, 0xe5]);
        let (_, displaced) = int3::slot_code(&code, addr, slot).unwrap();
        let copy_len = displaced.copy_len as u64;
        space.hooks.book(Hook {
            addr,
            orig: vec![0x55],
            probe: Probe::Int3 {
                resume_at: slot + DISPLACED,
                stub: slot,
                displaced,
            },
            kind: HookKind::Allocator {
                module_id: 1,
                ops: vec![Op::Malloc],
            },
        });
        space.areas.add(area, AREA_SIZE, SLOT_SIZE);
        assert!(space.in_areas(slot + DISPLACED));
        assert!(!space.in_areas(area + AREA_SIZE));
        assert_eq!(space.area_ranges().len(), 1);
        assert_eq!(space.area_ranges()[0], area..area + AREA_SIZE);

        // The caller's return address where a call through the stub that
        // has returned keeps it (read through the space's memory: here).
        let stack: [u64; 3] = [0, 0xdead_beef, 0];
        let rsp = stack.as_ptr() as u64;
        let leave = |rip: u64| {
            let mut regs = zeroed_regs();
            regs.rip = rip;
            regs.rsp = rsp;
            let moved = space.leave_areas(&mut regs);
            (moved, regs.rip, regs.rsp - rsp)
        };
        // Before the displaced instruction, and after it.
        assert_eq!(leave(slot + DISPLACED), (Some(true), addr, 0));
        assert_eq!(
            leave(slot + DISPLACED + copy_len),
            (Some(true), addr + 1, 0)
        );
        // In the stub, not called yet: back at the entry.
        assert_eq!(leave(slot), (Some(true), addr, 0));
        // Returned to the stub's int3: on to the caller.
        assert_eq!(
            leave(slot + int3::stub().return_int3),
            (Some(true), 0xdead_beef, 16)
        );
        // Not in an area: left alone.
        assert_eq!(leave(addr), (Some(false), addr, 0));
        // In an area, where no probe can be mapped back.
        assert_eq!(leave(area + 2048), (None, area + 2048, 0));
        // Read from outside the compiler's sight: keep it written.
        std::hint::black_box(&stack);
    }
}
