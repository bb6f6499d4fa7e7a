//! The part of a detach that changes threads, not code: each call still
//! in progress through an int3 probe's stub is sent home to its caller,
//! and each thread standing in a trampoline area is moved to the same
//! place in the program's own code. Through the target port ([`Target`]),
//! so that it runs on a fake target in the tests.
//!
//! It never leaves a thread where memptrace's code will be gone: where no
//! place in the program's code stands for the thread's, or no `pop` +
//! `ret` pair can send a call home, the process's trampoline pages are
//! kept (`keep_pages`) rather than unmapped under it.

use std::collections::{HashMap, HashSet};
use std::io;

use crate::os::ptrace::Tid;
use crate::tracer::probes::int3::{self, InStub};
use crate::tracer::space::Space;
use crate::tracer::target::Target;

/// An allocator (or mapping) call in progress through a stub when the
/// detach stopped its thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pending {
    pub tid: Tid,
    /// The thread's process, whose stack holds the call's return address.
    pub pid: Tid,
    /// The stack pointer at the function's entry.
    pub entry_sp: u64,
    /// The stub the call returns to.
    pub stub: u64,
}

/// Send each call of `pending` home: a thread still in its function will
/// return to a `pop` + `ret` pair of the program's code (the return
/// address the stub pushed, at `entry_sp - 16`, is overwritten), which
/// returns to the caller as the stub would have; without such a pair, past
/// the stub's int3, and the owner's pages stay (`keep_pages`). A thread in
/// the stub itself, or whose registers cannot be read, is left to
/// [`move_out`]. `space_of`: the space of a thread. None of these calls is
/// recorded: returns how many there were.
pub fn send_calls_home<'s, T: Target + ?Sized>(
    target: &mut T,
    pending: &[Pending],
    space_of: impl Fn(Tid) -> Option<&'s Space>,
    keep_pages: &mut HashSet<Tid>,
) -> io::Result<u64> {
    let mut pop_rets: HashMap<Tid, Option<u64>> = HashMap::new();
    for call in pending {
        let Some(space) = space_of(call.tid) else {
            continue;
        };
        let owner = space.pid;
        let in_stub = target.regs(call.tid).map_or(true, |regs| {
            int3::in_stub(regs.rip, call.stub) != InStub::No || space.in_copy(regs.rip).is_some()
        });
        if in_stub {
            continue; // moved out with every thread
        }
        let Some(slot) = call.entry_sp.checked_sub(16) else {
            keep_pages.insert(owner);
            continue;
        };
        let pop_ret = *pop_rets.entry(owner).or_insert_with(|| space.pop_ret());
        let to = pop_ret.unwrap_or_else(|| {
            keep_pages.insert(owner);
            call.stub + int3::stub().unlea
        });
        target.write_data(call.pid, slot, &to.to_le_bytes())?;
    }
    Ok(pending.len() as u64)
}

/// Move the stopped thread `tid` of `space` out of the trampoline areas
/// (see [`Space::leave_areas`]); where it stands somewhere that cannot be
/// mapped back, the space's pages stay (`keep_pages`). A thread whose
/// registers cannot be read (gone) is left as it is.
pub fn move_out<T: Target + ?Sized>(
    target: &mut T,
    tid: Tid,
    space: &Space,
    keep_pages: &mut HashSet<Tid>,
) -> io::Result<()> {
    let Ok(mut regs) = target.regs(tid) else {
        return Ok(());
    };
    match space.leave_areas(&mut regs) {
        Some(false) => {}
        Some(true) => target.set_regs(tid, &regs)?,
        None => {
            keep_pages.insert(space.pid);
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "leave_tests.rs"]
mod tests;
