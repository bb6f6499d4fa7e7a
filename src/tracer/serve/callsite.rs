//! Which of several names sharing an address the caller used: glibc's
//! `aligned_alloc` and `memalign` are one function at one address, so the
//! hook cannot tell them apart; the call instruction can (see
//! [`crate::symbols::callsite`]).

use crate::addr::Avma;
use crate::event::Op;
use crate::memory::Memory;
use crate::symbols::callsite::{CallTarget, call_before, plt_slot};
use crate::tracer::space::images::LoadedModule;

/// Which of `ops` (names sharing one address) the call that returns to
/// `ret` used: the symbol of the GOT slot it called through, directly or by
/// a PLT stub. `None` when the call tells nothing (a direct call, as in a
/// static binary) or the slot names none of `ops`.
pub fn named<'a>(
    mem: &dyn Memory,
    module_at: &dyn Fn(u64) -> Option<&'a LoadedModule>,
    ops: &[Op],
    ret: u64,
) -> Option<Op> {
    let mut before = [0u8; 6];
    mem.read_exact(ret.checked_sub(6)?, &mut before).ok()?;
    let slot = match call_before(&before, ret)? {
        CallTarget::Slot(slot) => slot,
        CallTarget::Direct(target) => {
            let module = module_at(target)?;
            if !module.image.in_plt(module.bias.to_svma(Avma(target))) {
                return None;
            }
            let mut stub = [0u8; 16];
            mem.read_exact(target, &mut stub).ok()?;
            plt_slot(&stub, target)?
        }
    };
    let module = module_at(slot)?;
    let svma = module.bias.to_svma(Avma(slot));
    let op = *module.image.got_slots.get(&svma.0)?;
    ops.contains(&op).then_some(op)
}
