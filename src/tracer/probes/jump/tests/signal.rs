//! Signal handlers in the probes' code: a walk through a signal frame,
//! and a handler's call made inside a probe of its thread, recorded in the
//! thread's signal slot.

use iced_x86::code_asm::*;

use super::{MALLOC, Rig};
use crate::event::Op;
use crate::os::local::thread_pointer;
use crate::tracer::probes::jump::layout::{self, record, rule, slot};
use crate::unwind::signal;

/// A handler entered as the kernel enters one: `[rsp]` returns into the
/// signal-return trampoline, the interrupted registers above it. The walk
/// reads them and goes on in the interrupted function (its address + 1).
#[test]
fn walks_through_a_signal_frame() {
    const SIGTEST: usize = 0x200;
    const HANDLER: usize = 0x300;
    const RESTORE: usize = 0x380;
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    let base = rig.code.addr();
    // The trampoline: a nop (the byte its row covers), then rt_sigreturn.
    rig.code.write(RESTORE, &[0x90]);
    rig.code.write(RESTORE + 1, &signal::SIGRETURN);
    let malloc = base + MALLOC as u64;
    rig.function(HANDLER, |a| {
        a.sub(rsp, 8)?;
        a.call(malloc)?;
        a.add(rsp, 8)?;
        a.jmp(rbx) // back into SIGTEST
    });
    let (handler, restore) = (base + HANDLER as u64, base + RESTORE as u64 + 1);
    let ctx = |at: u64| qword_ptr(rsp + 8 + at as i32);
    rig.function(SIGTEST, |a| {
        let mut interrupted = a.create_label();
        let mut back = a.create_label();
        a.push(rbp)?;
        a.mov(rbp, rsp)?;
        a.sub(rsp, 0x100)?;
        a.mov(qword_ptr(rbp - 8), rbx)?;
        a.mov(rax, restore)?;
        a.mov(qword_ptr(rsp), rax)?;
        a.lea(rax, ptr(interrupted))?;
        a.mov(ctx(signal::RIP), rax)?;
        a.mov(ctx(signal::RSP), rbp)?;
        a.mov(ctx(signal::RBP), rbp)?;
        a.lea(rbx, ptr(back))?;
        a.mov(rax, handler)?;
        a.jmp(rax)?;
        a.set_label(&mut interrupted)?;
        a.nop()?;
        a.set_label(&mut back)?;
        a.mov(rbx, qword_ptr(rbp - 8))?;
        a.mov(rsp, rbp)?;
        a.pop(rbp)?;
        a.ret()
    });
    let (s, h, r) = (SIGTEST as u32, HANDLER as u32, RESTORE as u32);
    let rbp_at_16 = 2 << rule::RBP_SHIFT;
    rig.directory(&[
        (s, 8),
        (s + 1, 16 | rbp_at_16),
        (s + 4, 16 | rule::RBP_BASED | rbp_at_16),
        (s + 0x80, rule::NONE),
        (h, 8),
        (h + 4, 16),
        (h + 0x20, rule::NONE),
        (r, rule::SIGNAL),
        (r + 1, rule::NONE),
    ]);
    assert_eq!(rig.call(SIGTEST, 6, 0, 0), 0x1006);
    let records = rig.records();
    assert_eq!(records.len(), 1);
    let f = &records[0].frames;
    assert_eq!(f.len(), 4, "{f:x?}");
    assert_eq!(f[0], handler + 9, "after the handler's call");
    assert_eq!(f[1], restore);
    // The interrupted nop, + 1; then the return address into the test.
    let mut nop = [0u8];
    rig.code.read((f[2] - 1 - base) as usize, &mut nop);
    assert_eq!(nop, [0x90], "{:x}", f[2] - base);
    assert!((base + SIGTEST as u64..base + HANDLER as u64).contains(&f[2]));
    assert!(!(base..base + rig.code.len() as u64).contains(&f[3]) && f[3] != 0);
}

impl Rig {
    /// This thread's signal slot, as memptrace makes one (see
    /// `Rig::new`): its offset in the control area.
    fn signal_slot(&self) -> usize {
        let key = layout::signal_key_of(thread_pointer());
        let i = layout::home_of_key(key);
        let at = layout::slot_offset(i) as usize;
        for field in [slot::STACK_LO, slot::STACK_HI] {
            self.control
                .write_u64(at + field as usize, self.slot_word(field));
        }
        let c = self.control.addr();
        self.control
            .write_u64(at + slot::RING as usize, c + layout::ring_offset(i));
        self.control
            .write_u64(at + slot::CACHE as usize, c + layout::cache_offset(i));
        self.control
            .write_u64(at + slot::CACHE_DIR as usize, u64::MAX);
        self.control.write_u64(at + slot::KEY as usize, key);
        at
    }

    /// A probe of this thread running higher up the stack, as a handler's
    /// probe finds it: its slot claimed with a stack pointer above ours.
    fn busy_above(&self) {
        let above = self.slot_word(slot::STACK_HI) - 8;
        self.control
            .write_u64(self.slot + slot::BUSY as usize, above);
    }
}

/// A handler's call inside a probe: recorded in the thread's signal slot;
/// the interrupted probe's slot is left as it was.
#[test]
fn a_handler_inside_a_probe_records_in_the_signal_slot() {
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    let sig = rig.signal_slot();
    rig.busy_above();
    assert_eq!(rig.call(MALLOC, 5, 0, 0), 0x1005);
    let word = |f: u64| rig.control.read_u64(sig + f as usize);
    assert_eq!(word(slot::NESTED), 0);
    assert_eq!(rig.slot_word(slot::NESTED), 0);
    assert_eq!(
        rig.slot_word(slot::HEAD),
        0,
        "nothing in the interrupted ring"
    );
    let ring = (word(slot::RING) - rig.control.addr()) as usize;
    let header = layout::RecordHead::unpack(rig.control.read_u64(ring));
    assert_eq!(header.op, Op::Malloc as u8);
    assert_eq!(
        word(slot::HEAD),
        u64::from(header.size),
        "one record committed"
    );
    assert_eq!(
        rig.control.read_u64(ring + record::ARG0 as usize),
        5,
        "its argument"
    );
    assert_eq!(word(slot::BUSY), 0);
    assert_eq!(word(slot::PENDING_SP), 0);
    // The signal slot busy too (a handler inside a handler's probe):
    // counted, not recorded.
    rig.control
        .write_u64(sig + slot::BUSY as usize, rig.slot_word(slot::STACK_HI) - 8);
    assert_eq!(rig.call(MALLOC, 6, 0, 0), 0x1006);
    assert_eq!(word(slot::NESTED), 1);
    assert_eq!(word(slot::HEAD), u64::from(header.size));
}

/// Without a signal slot (none was free), the call is counted as nested.
#[test]
fn a_handler_inside_a_probe_without_a_signal_slot_is_counted() {
    let mut rig = Rig::new();
    rig.plant(MALLOC, Op::Malloc, 1);
    rig.busy_above();
    assert_eq!(rig.call(MALLOC, 5, 0, 0), 0x1005);
    assert_eq!(rig.slot_word(slot::NESTED), 1);
    assert_eq!(rig.slot_word(slot::HEAD), 0);
}
