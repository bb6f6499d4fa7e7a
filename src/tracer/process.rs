//! The processes and threads being traced, and everything memptrace keeps
//! about each: one [`Process`] per traced process (its role, its address
//! space, its unwinder state, what it learnt about its call sites), one
//! [`Thread`] per traced thread, and the children announced but not yet
//! seen. What belongs to a process goes with it: at its exit or exec,
//! nothing of it stays behind.

use rustc_hash::FxHashMap;
use std::ops::Range;

use super::booking::copies::PendingCopy;
use super::serve::callsite;
use super::serve::handlers::HandlerFrame;
use super::space::Space;
use super::space::buffers::STACK_COPY;
use super::target::Target;
use crate::event::Op;
use crate::os::mem::ProcessMemory;
use crate::os::ptrace::{Stop, Tid};
use crate::trace_msg::CallStack;
use crate::unwind::libunwind::LibunwindUnwinder;

/// The role of a traced process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Launched, not yet through its first execve.
    Prelaunch,
    Traced,
    /// A vfork child (or a clone sharing memory): it runs in its parent's
    /// address space, hooks included, until it execs. Its calls are not
    /// recorded; it is released when it execs or exits.
    Shares {
        parent: Tid,
    },
}

/// One traced process.
pub struct Process {
    pub role: Role,
    pub space: Option<Space>,
    /// libunwind's state (`--unwinder libunwind` only): images of different
    /// processes may share addresses.
    pub libunwind: Option<LibunwindUnwinder>,
    /// Which of several names sharing an address each call site used (see
    /// `callsite`), by return address.
    pub aliases: FxHashMap<u64, Op>,
    /// Calls seen per call site (return address), for `--stack-every`.
    pub sites: FxHashMap<u64, u64>,
    /// The user was told its program has nothing to hook.
    pub warned: bool,
    /// Records of its jump probes waiting for their turn.
    pub merge: super::booking::merge::Merge,
    /// A vfork child: the thread of its parent whose slot records nothing
    /// while the child runs on the parent's stack.
    pub paused: Option<Tid>,
}

impl Process {
    pub fn new(role: Role, space: Option<Space>) -> Process {
        Process {
            role,
            space,
            libunwind: None,
            aliases: FxHashMap::default(),
            sites: FxHashMap::default(),
            warned: false,
            merge: Default::default(),
            paused: None,
        }
    }

    /// Its calls are recorded (it is not running in another's memory).
    pub fn recorded(&self) -> bool {
        matches!(self.role, Role::Traced | Role::Prelaunch)
    }

    /// A new program replaced the old one: what was learnt of the old code
    /// goes.
    pub fn exec(&mut self, space: Space) {
        self.role = Role::Traced;
        self.space = Some(space);
        self.libunwind = None;
        self.aliases.clear();
        self.sites.clear();
        self.warned = false;
    }
}

/// A call that entered the allocator and has not returned yet.
#[derive(Debug)]
pub struct PendingCall {
    pub op: Op,
    pub args: [u64; 3],
    /// rsp at entry: where the caller's return address sits.
    pub entry_sp: u64,
    /// The slot's call stub the thread went through (see
    /// `probes::int3::slot_code`): the call returns to its int3.
    pub stub: u64,
    pub stack: CallStack,
    pub module_id: u64,
}

/// One traced thread.
pub struct Thread {
    pub pid: Tid,
    /// The thread's innermost call pending (of the handler running, if one
    /// interrupted a call).
    pub in_call: Option<PendingCall>,
    /// Signal handlers that interrupted a pending call, innermost last
    /// (see [`super::serve::handlers`]).
    pub handlers: Vec<HandlerFrame>,
    /// Sent into a signal with a single step: its next SIGTRAP may be the
    /// step's (see [`super::serve::handlers`]).
    pub stepping: bool,
    /// The memory mapping that holds this thread's stack.
    pub stack: Option<Range<u64>>,
    pub start_ns: u64,
    /// A stack copy the thread was sent to make, not taken yet.
    pub copy: Option<PendingCopy>,
    /// A copy taken at a stop before the thread's routine was done with it
    /// (buffer, number): the routine may still write the buffer.
    pub unfinished_copy: Option<(usize, u64)>,
    /// A mapping call (mmap, munmap...) that entered and has not returned.
    pub in_map: Option<PendingMap>,
}

/// A mapping call that entered and has not returned yet.
#[derive(Debug)]
pub struct PendingMap {
    pub op: crate::event::MapOp,
    pub args: [u64; 6],
    /// rsp at entry, and the stub it returns through (see [`PendingCall`]).
    pub entry_sp: u64,
    pub stub: u64,
    pub stack: CallStack,
}

impl Thread {
    pub fn new(pid: Tid, start_ns: u64) -> Thread {
        Thread {
            pid,
            in_call: None,
            handlers: Vec::new(),
            stepping: false,
            stack: None,
            start_ns,
            copy: None,
            unfinished_copy: None,
            in_map: None,
        }
    }
}

/// A child announced by a clone/fork/vfork event, before its first stop.
#[derive(Clone, Copy, Debug)]
pub enum Child {
    Thread { pid: Tid },
    Fork { parent: Tid },
    Shared { parent: Tid, by: Tid },
}

/// Every traced process and thread.
#[derive(Default)]
pub struct Family {
    pub processes: FxHashMap<Tid, Process>,
    pub threads: FxHashMap<Tid, Thread>,
    /// First stops of threads whose creation event has not been seen yet.
    pub early: FxHashMap<Tid, Stop>,
    /// Children announced whose first stop has not been seen yet.
    pub announced: FxHashMap<Tid, Child>,
}

impl Family {
    /// The end of the mapping holding a thread's stack, learnt once per thread
    /// (and again if the thread moves to another stack).
    pub fn stack_top<T: Target>(&mut self, target: &mut T, tid: Tid, pid: Tid, sp: u64) -> u64 {
        let known = self.threads.get(&tid).and_then(|t| t.stack.clone());
        if let Some(range) = known.filter(|r| r.contains(&sp)) {
            return range.end;
        }
        match target.mapping_at(pid, sp) {
            Some(stack) => {
                let end = stack.end;
                if let Some(thread) = self.threads.get_mut(&tid) {
                    thread.stack = Some(stack);
                }
                end
            }
            None => sp.saturating_add(STACK_COPY),
        }
    }

    /// The mapping holding a thread's stack (the probes read nothing else).
    pub fn stack_range<T: Target>(
        &mut self,
        target: &mut T,
        tid: Tid,
        pid: Tid,
        sp: u64,
    ) -> std::ops::Range<u64> {
        let end = self.stack_top(target, tid, pid, sp);
        let start = self
            .threads
            .get(&tid)
            .and_then(|t| t.stack.clone())
            .filter(|r| r.end == end)
            .map_or(sp, |r| r.start);
        start..end
    }

    /// The process a thread belongs to.
    pub fn pid_of(&self, tid: Tid) -> Option<Tid> {
        Some(self.threads.get(&tid)?.pid)
    }

    /// The process whose address space the thread runs in: its own, or
    /// its parent's for a vfork child.
    pub fn owner_of(&self, tid: Tid) -> Option<Tid> {
        let pid = self.pid_of(tid)?;
        Some(match self.processes.get(&pid)?.role {
            Role::Shares { parent } => parent,
            _ => pid,
        })
    }

    /// The address space of process `pid`, if it has one of its own.
    pub fn space(&self, pid: Tid) -> Option<&Space> {
        self.processes.get(&pid)?.space.as_ref()
    }

    pub fn space_mut(&mut self, pid: Tid) -> Option<&mut Space> {
        self.processes.get_mut(&pid)?.space.as_mut()
    }

    /// The address space the thread runs in.
    pub fn space_of(&self, tid: Tid) -> Option<&Space> {
        self.space(self.owner_of(tid)?)
    }

    pub fn space_of_mut(&mut self, tid: Tid) -> Option<&mut Space> {
        let owner = self.owner_of(tid)?;
        self.space_mut(owner)
    }

    /// Process `pid` is traced in an address space of its own: launched and
    /// past its first execve, forked, or attached to (not a vfork child
    /// running in its parent's memory).
    pub fn is_traced(&self, pid: Tid) -> bool {
        self.processes
            .get(&pid)
            .is_some_and(|p| p.role == Role::Traced)
    }

    /// The processes traced in address spaces of their own (see
    /// [`Family::is_traced`]), in no order.
    pub fn traced(&self) -> impl Iterator<Item = (Tid, &Process)> {
        self.processes
            .iter()
            .filter(|(_, p)| p.role == Role::Traced)
            .map(|(&pid, p)| (pid, p))
    }

    /// The threads of process `pid`.
    pub fn threads_of(&self, pid: Tid) -> Vec<Tid> {
        self.threads
            .iter()
            .filter(|(_, t)| t.pid == pid)
            .map(|(&tid, _)| tid)
            .collect()
    }

    /// Nothing is traced any more, and no child is on its way.
    pub fn is_empty(&self) -> bool {
        self.processes.is_empty() && self.announced.is_empty()
    }

    /// The pending mapping call of `tid` that a stop at a return int3 with
    /// stack pointer `rsp` completes (see `Tracer::returning_call`).
    pub fn returning_map(&mut self, tid: Tid, rsp: u64) -> Option<PendingMap> {
        let thread = self.threads.get_mut(&tid)?;
        let ours = thread
            .in_map
            .as_ref()
            .is_some_and(|m| m.entry_sp.wrapping_sub(8) == rsp);
        if ours { thread.in_map.take() } else { None }
    }

    /// Whether this call of the call site `ret` gets its stack under
    /// `--stack-every N` (`every`): every Nth call of each site, the first
    /// included.
    pub fn sampled(&mut self, pid: Tid, ret: u64, every: u64) -> bool {
        if every <= 1 {
            return true;
        }
        let Some(process) = self.processes.get_mut(&pid) else {
            return true;
        };
        let seen = process.sites.entry(ret).or_insert(0);
        let sampled = *seen % every == 0;
        *seen += 1;
        sampled
    }

    /// Which of several names sharing an address the caller used, from the
    /// call instruction before `ret` (see [`callsite::named`]), decoded once
    /// per call site.
    pub fn alias(&mut self, pid: Tid, ops: &[Op], ret: u64) -> Op {
        let Some(process) = self.processes.get_mut(&pid) else {
            return ops[0];
        };
        if let Some(op) = process.aliases.get(&ret) {
            return *op;
        }
        let op = process
            .space
            .as_ref()
            .and_then(|space| {
                let module_at = |addr| space.module_at(addr);
                callsite::named(&ProcessMemory(pid), &module_at, ops, ret)
            })
            .unwrap_or(ops[0]);
        process.aliases.insert(ret, op);
        op
    }
}

/// For tests of the parts that serve a family on the fake target.
#[cfg(test)]
impl Family {
    /// One traced process `pid` in `space`, with the threads `tids`.
    pub fn of_one(pid: Tid, space: Space, tids: &[Tid]) -> Family {
        let mut family = Family::default();
        family
            .processes
            .insert(pid, Process::new(Role::Traced, Some(space)));
        for &tid in tids {
            family.threads.insert(tid, Thread::new(pid, 0));
        }
        family
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracer::target::fake::FakeTarget;

    /// A launched process before its execve (1), a traced one (2) with a
    /// vfork child in its memory (3), and a traced fork (4).
    fn family() -> Family {
        let mut family = Family::default();
        let roles = [
            (1, Role::Prelaunch),
            (2, Role::Traced),
            (3, Role::Shares { parent: 2 }),
            (4, Role::Traced),
        ];
        for (pid, role) in roles {
            family.processes.insert(pid, Process::new(role, None));
            family.threads.insert(pid, Thread::new(pid, 0));
        }
        // A second thread of process 2.
        family.threads.insert(20, Thread::new(2, 0));
        family
    }

    #[test]
    fn traced_means_in_a_space_of_its_own() {
        let family = family();
        let traced: Vec<bool> = (1..=5).map(|pid| family.is_traced(pid)).collect();
        assert_eq!(traced, [false, true, false, true, false]);
        let mut pids: Vec<Tid> = family.traced().map(|(pid, _)| pid).collect();
        pids.sort_unstable();
        assert_eq!(pids, [2, 4]);
        // A thread's number is not its process's.
        assert!(!family.is_traced(20));
    }

    #[test]
    fn a_vfork_child_runs_in_its_parents_space() {
        let family = family();
        assert_eq!(family.pid_of(20), Some(2));
        assert_eq!(family.owner_of(20), Some(2));
        assert_eq!(family.owner_of(3), Some(2));
        assert_eq!(family.owner_of(4), Some(4));
        assert_eq!(family.owner_of(99), None);
        // No space made yet: none found, whoever asks.
        assert!(family.space_of(3).is_none());
        let mut threads = family.threads_of(2);
        threads.sort_unstable();
        assert_eq!(threads, [2, 20]);
    }

    #[test]
    fn recorded_and_empty() {
        let mut family = family();
        let recorded: Vec<bool> = (1..=4)
            .map(|pid| family.processes[&pid].recorded())
            .collect();
        assert_eq!(recorded, [true, true, false, true]);
        assert!(!family.is_empty());
        family.processes.clear();
        family.announced.insert(7, Child::Thread { pid: 2 });
        // A child on its way: not empty yet.
        assert!(!family.is_empty());
        family.announced.clear();
        assert!(family.is_empty());
    }

    #[test]
    fn a_known_stack_is_not_looked_up_again() {
        let mut family = family();
        let mut target = FakeTarget::new();
        // The process has no mappings: the thread's stack is known.
        family.threads.get_mut(&2).unwrap().stack = Some(0x1000..0xa000);
        assert_eq!(family.stack_top(&mut target, 2, 2, 0x8000), 0xa000);
        assert_eq!(
            family.stack_range(&mut target, 2, 2, 0x8000),
            0x1000..0xa000
        );
    }

    #[test]
    fn a_stack_is_learnt_through_the_port_and_again_when_the_thread_moves() {
        let mut family = family();
        let mut target = FakeTarget::new();
        target
            .mappings
            .insert(2, vec![0x1000..0xa000, 0x20000..0x30000]);
        assert_eq!(
            family.stack_range(&mut target, 2, 2, 0x8000),
            0x1000..0xa000
        );
        assert_eq!(family.threads[&2].stack, Some(0x1000..0xa000));
        // A signal stack elsewhere: looked up again, and kept.
        assert_eq!(
            family.stack_range(&mut target, 2, 2, 0x28000),
            0x20000..0x30000
        );
        assert_eq!(family.threads[&2].stack, Some(0x20000..0x30000));
        // Unmapped (a stack pointer the program set to garbage): a copy's
        // length past it, no stale start, no overflow.
        assert_eq!(
            family.stack_range(&mut target, 2, 2, 0x50000),
            0x50000..0x50000 + STACK_COPY
        );
        assert_eq!(family.stack_top(&mut target, 2, 2, u64::MAX - 8), u64::MAX);
        // A thread memptrace does not know (gone meanwhile): no panic.
        assert_eq!(family.stack_top(&mut target, 99, 2, 0x8000), 0xa000);
    }
}
