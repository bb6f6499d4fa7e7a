//! A target made of byte buffers and registers, for unit tests: each
//! address space is a set of regions of bytes (shared between the test
//! and the space that writes probes into it), each thread a register set
//! and a state; every request is logged, so a test checks what was asked
//! as well as what changed. Memory outside the regions reads as unmapped
//! and refuses writes, as /proc/PID/mem does.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io;
use std::ops::Range;
use std::rc::Rc;
use std::time::Instant;

use super::{CodeMemory, Target};
use crate::memory::Memory;
use crate::os::procfs::Mapping;
use crate::os::ptrace::{Regs, Stop, Tid, zeroed_regs};

/// The memory of one fake address space: regions of bytes by start, and
/// the memory map it says it has (set by the test; none at first).
#[derive(Clone, Debug, Default)]
pub struct FakeMemory {
    regions: Rc<RefCell<BTreeMap<u64, Vec<u8>>>>,
    maps: Rc<RefCell<Vec<Mapping>>>,
}

impl FakeMemory {
    pub fn new() -> FakeMemory {
        FakeMemory::default()
    }

    /// Map `bytes` at `addr` (not overlapping another region).
    pub fn map(&self, addr: u64, bytes: Vec<u8>) {
        let end = addr + bytes.len() as u64;
        let regions = self.regions.borrow();
        let clash = regions
            .iter()
            .any(|(&s, b)| s < end && addr < s + b.len() as u64);
        assert!(!clash, "fake regions overlap at {addr:#x}");
        drop(regions);
        self.regions.borrow_mut().insert(addr, bytes);
    }

    /// From now on the space's memory map is `maps`.
    pub fn set_maps(&self, maps: Vec<Mapping>) {
        *self.maps.borrow_mut() = maps;
    }

    /// `len` bytes at `addr`, which must be mapped.
    pub fn bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.read_exact(addr, &mut out).expect("mapped in the fake");
        out
    }

    /// The region starting at `addr`, whole.
    pub fn region(&self, addr: u64) -> Vec<u8> {
        self.regions.borrow()[&addr].clone()
    }

    fn locate(&self, addr: u64, len: usize) -> Option<(u64, usize)> {
        let regions = self.regions.borrow();
        let (&start, bytes) = regions.range(..=addr).next_back()?;
        let offset = usize::try_from(addr - start).ok()?;
        (offset.checked_add(len)? <= bytes.len()).then_some((start, offset))
    }
}

impl Memory for FakeMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            let at = addr + done as u64;
            let Some((start, offset)) = self.locate(at, 1) else {
                break;
            };
            let regions = self.regions.borrow();
            let bytes = &regions[&start];
            let n = (bytes.len() - offset).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&bytes[offset..offset + n]);
            done += n;
        }
        Ok(done)
    }
}

impl CodeMemory for FakeMemory {
    fn write_code(&self, addr: u64, bytes: &[u8]) -> io::Result<()> {
        let Some((start, offset)) = self.locate(addr, bytes.len()) else {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        };
        let mut regions = self.regions.borrow_mut();
        let region = regions.get_mut(&start).expect("located");
        region[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn maps(&self) -> io::Result<Vec<Mapping>> {
        Ok(self.maps.borrow().clone())
    }
}

/// What was asked of the fake, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    SetRegs(Tid),
    Cont(Tid, i32),
    Step(Tid, i32),
    Listen(Tid),
    Interrupt(Tid),
    Detach(Tid, i32),
    WriteData(Tid, u64, Vec<u8>),
    Seize(Tid),
    SetOptions(Tid, i32),
    Tgkill(Tid, i32),
}

/// A fake thread: its registers, whether it stands stopped, and the
/// `si_code` of the signal it is stopped with.
#[derive(Clone, Copy, Debug)]
pub struct FakeThread {
    pub regs: Regs,
    pub stopped: bool,
    pub si_code: i32,
}

/// Threads and address spaces as buffers.
#[derive(Default)]
pub struct FakeTarget {
    pub threads: HashMap<Tid, FakeThread>,
    pub spaces: HashMap<Tid, FakeMemory>,
    /// Each process's mappings, as `/proc/PID/maps` would give them.
    pub mappings: HashMap<Tid, Vec<Range<u64>>>,
    pub calls: Vec<Call>,
    /// Each process's threads, as `/proc/PID/task` would list them: a
    /// thread listed here and not in `threads` runs untraced.
    pub tasks: HashMap<Tid, Vec<Tid>>,
    /// Stops the kernel would report, in its order.
    pub pending: VecDeque<(Tid, Stop)>,
    /// Stops kept for the wait loop (`keep_for_later`).
    pub kept: Vec<(Tid, Stop)>,
    /// Threads another tracer holds (seizing them fails with EPERM).
    pub foreign: HashMap<Tid, Tid>,
    /// Dying threads (zombies: seizing them fails with EPERM).
    pub ending: HashSet<Tid>,
    /// Thread ids the kernel gives to a thread of another process (the
    /// value) just before memptrace seizes them: the thread listed exited
    /// in between.
    pub reused: HashMap<Tid, Tid>,
    /// The ptrace event each stopped thread is at, and its message.
    pub events: HashMap<Tid, (i32, u64)>,
    /// Signals queued for a thread and not reported yet (`SigPnd`).
    pub queued: HashSet<(Tid, i32)>,
    /// Where a thread let run is found at its next stop (the place it ran
    /// to); one not listed here stands where it was (it runs nothing).
    pub runs_to: HashMap<Tid, u64>,
    /// Threads a PTRACE_INTERRUPT never stops (uninterruptible sleep, a
    /// frozen cgroup): it is taken, and no stop follows.
    pub stuck: HashSet<Tid>,
    /// A wait with nothing to report is woken by memptrace's tick
    /// (`Ok(None)`), as while a traced thread runs on without stopping,
    /// instead of failing with ECHILD (no traced thread left).
    pub ticking: bool,
}

impl FakeTarget {
    pub fn new() -> FakeTarget {
        FakeTarget::default()
    }

    /// A stopped thread `tid` at `rip` with stack pointer `rsp`.
    pub fn stopped_at(&mut self, tid: Tid, rip: u64, rsp: u64) {
        let mut regs = zeroed_regs();
        regs.rip = rip;
        regs.rsp = rsp;
        self.threads.insert(
            tid,
            FakeThread {
                regs,
                stopped: true,
                si_code: 0,
            },
        );
    }

    /// Process `pid` runs threads `tids` (the first is `pid` itself),
    /// untraced.
    pub fn process(&mut self, pid: Tid, tids: &[Tid]) {
        self.tasks.insert(pid, tids.to_vec());
    }

    /// The kernel will report `stop` of thread `tid`.
    pub fn report(&mut self, tid: Tid, stop: Stop) {
        self.pending.push_back((tid, stop));
    }

    /// A stop reported: the thread stands stopped, or is gone.
    fn taken(&mut self, tid: Tid, stop: Stop) -> (Tid, Stop) {
        match stop {
            Stop::Exited(_) | Stop::Killed { .. } => {
                self.threads.remove(&tid);
            }
            _ => {
                if let Some(t) = self.threads.get_mut(&tid) {
                    t.stopped = true;
                }
            }
        }
        (tid, stop)
    }

    /// The memory of process `pid`, made empty the first time.
    pub fn memory(&mut self, pid: Tid) -> FakeMemory {
        self.spaces.entry(pid).or_default().clone()
    }

    fn stopped(&mut self, tid: Tid) -> io::Result<&mut FakeThread> {
        match self.threads.get_mut(&tid) {
            Some(t) if t.stopped => Ok(t),
            // ptrace(2): a request on a thread that is not stopped, or not
            // traced, fails with ESRCH.
            _ => Err(io::Error::from_raw_os_error(libc::ESRCH)),
        }
    }
}

impl Target for FakeTarget {
    fn regs(&mut self, tid: Tid) -> io::Result<Regs> {
        Ok(self.stopped(tid)?.regs)
    }

    fn set_regs(&mut self, tid: Tid, regs: &Regs) -> io::Result<()> {
        self.stopped(tid)?.regs = *regs;
        self.calls.push(Call::SetRegs(tid));
        Ok(())
    }

    fn cont(&mut self, tid: Tid, sig: i32) -> io::Result<()> {
        let ran_to = self.runs_to.get(&tid).copied();
        let thread = self.stopped(tid)?;
        thread.stopped = false;
        if let Some(rip) = ran_to {
            thread.regs.rip = rip;
            self.runs_to.remove(&tid);
        }
        self.calls.push(Call::Cont(tid, sig));
        Ok(())
    }

    fn step(&mut self, tid: Tid, sig: i32) -> io::Result<()> {
        self.stopped(tid)?.stopped = false;
        self.calls.push(Call::Step(tid, sig));
        Ok(())
    }

    fn si_code(&mut self, tid: Tid) -> io::Result<i32> {
        Ok(self.stopped(tid)?.si_code)
    }

    fn listen(&mut self, tid: Tid) -> io::Result<()> {
        self.stopped(tid)?;
        self.calls.push(Call::Listen(tid));
        Ok(())
    }

    fn interrupt(&mut self, tid: Tid) -> io::Result<()> {
        let thread = self
            .threads
            .get_mut(&tid)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
        // A running thread stops and reports it; a stopped one already has.
        if !thread.stopped && !self.stuck.contains(&tid) {
            thread.stopped = true;
            self.pending
                .push_back((tid, Stop::EventStop(libc::SIGTRAP)));
        }
        self.calls.push(Call::Interrupt(tid));
        Ok(())
    }

    fn detach(&mut self, tid: Tid, sig: i32) -> io::Result<()> {
        self.stopped(tid)?;
        self.threads.remove(&tid);
        self.calls.push(Call::Detach(tid, sig));
        Ok(())
    }

    fn read_data(&mut self, pid: Tid, addr: u64, len: usize, out: &mut Vec<u8>) -> io::Result<()> {
        out.clear();
        out.resize(len, 0);
        // As far as it is mapped: nothing, if nothing is.
        let n = self.memory(pid).read(addr, out)?;
        out.truncate(n);
        Ok(())
    }

    fn read_word(&mut self, pid: Tid, addr: u64) -> io::Result<u64> {
        self.memory(pid).read_u64(addr)
    }

    fn write_data(&mut self, pid: Tid, addr: u64, bytes: &[u8]) -> io::Result<()> {
        self.memory(pid).write_code(addr, bytes)?;
        self.calls.push(Call::WriteData(pid, addr, bytes.to_vec()));
        Ok(())
    }

    fn code(&mut self, pid: Tid) -> io::Result<Box<dyn CodeMemory>> {
        Ok(Box::new(self.memory(pid)))
    }

    fn mapping_at(&mut self, pid: Tid, addr: u64) -> Option<Range<u64>> {
        let maps = self.mappings.get(&pid)?;
        maps.iter().find(|m| m.contains(&addr)).cloned()
    }

    fn seize(&mut self, tid: Tid, _options: i32) -> io::Result<()> {
        if let Some(owner) = self.reused.remove(&tid) {
            for tids in self.tasks.values_mut() {
                tids.retain(|&t| t != tid);
            }
            self.tasks.entry(owner).or_default().push(tid);
        }
        let known = self.tasks.values().any(|tids| tids.contains(&tid));
        if !known {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        if self.foreign.contains_key(&tid) || self.ending.contains(&tid) {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        self.threads.entry(tid).or_insert(FakeThread {
            regs: zeroed_regs(),
            stopped: false,
            si_code: 0,
        });
        self.calls.push(Call::Seize(tid));
        Ok(())
    }

    fn set_options(&mut self, tid: Tid, options: i32) -> io::Result<()> {
        self.stopped(tid)?;
        self.calls.push(Call::SetOptions(tid, options));
        Ok(())
    }

    fn event_msg(&mut self, tid: Tid) -> io::Result<u64> {
        self.stopped(tid)?;
        Ok(self.events.get(&tid).map_or(0, |&(_, msg)| msg))
    }

    fn event_of(&mut self, tid: Tid) -> Option<i32> {
        self.stopped(tid).ok()?;
        Some(self.events.get(&tid).map_or(0, |&(event, _)| event))
    }

    fn tgkill(&mut self, pid: Tid, tid: Tid, sig: i32) -> io::Result<()> {
        if !self.tasks.get(&pid).is_some_and(|tids| tids.contains(&tid)) {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        self.calls.push(Call::Tgkill(tid, sig));
        Ok(())
    }

    fn wait_any(&mut self) -> io::Result<Option<(Tid, Stop)>> {
        // Nothing left to report would block forever: ECHILD instead, as
        // when no traced thread is left.
        match self.pending.pop_front() {
            Some((tid, stop)) => Ok(Some(self.taken(tid, stop))),
            None if self.ticking => Ok(None),
            None => Err(io::Error::from_raw_os_error(libc::ECHILD)),
        }
    }

    fn poll_any(&mut self) -> io::Result<Option<(Tid, Stop)>> {
        Ok(self
            .pending
            .pop_front()
            .map(|(tid, stop)| self.taken(tid, stop)))
    }

    fn wait_tid_until(&mut self, tid: Tid, _deadline: Instant) -> io::Result<Option<Stop>> {
        let Some(at) = self.pending.iter().position(|&(t, _)| t == tid) else {
            return Ok(None);
        };
        let (tid, stop) = self.pending.remove(at).expect("found");
        Ok(Some(self.taken(tid, stop).1))
    }

    fn keep_for_later(&mut self, tid: Tid, stop: Stop) {
        self.kept.push((tid, stop));
    }

    fn take_kept(&mut self) -> Vec<(Tid, Stop)> {
        std::mem::take(&mut self.kept)
    }

    fn threads(&mut self, pid: Tid) -> io::Result<Vec<Tid>> {
        let mut tids = self
            .tasks
            .get(&pid)
            .cloned()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
        tids.sort_unstable();
        Ok(tids)
    }

    fn tgid(&mut self, tid: Tid) -> Option<Tid> {
        self.tasks
            .iter()
            .find(|(_, tids)| tids.contains(&tid))
            .map(|(&pid, _)| pid)
    }

    fn thread_ending(&mut self, pid: Tid, tid: Tid) -> bool {
        self.ending.contains(&tid) || self.tgid(tid) != Some(pid)
    }

    fn thread_tracer(&mut self, pid: Tid, tid: Tid) -> Option<Tid> {
        (self.tgid(tid) == Some(pid)).then(|| self.foreign.get(&tid).copied().unwrap_or(0))
    }

    fn signal_pending(&mut self, pid: Tid, tid: Tid, sig: i32) -> bool {
        self.tgid(tid) == Some(pid) && self.queued.contains(&(tid, sig))
    }
}
