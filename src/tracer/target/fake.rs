//! A target made of byte buffers and registers, for unit tests: each
//! address space is a set of regions of bytes (shared between the test
//! and the space that writes probes into it), each thread a register set
//! and a state; every request is logged, so a test checks what was asked
//! as well as what changed. Memory outside the regions reads as unmapped
//! and refuses writes, as /proc/PID/mem does.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::Range;
use std::rc::Rc;

use super::{CodeMemory, Target};
use crate::memory::Memory;
use crate::os::ptrace::{Regs, Tid, zeroed_regs};

/// The memory of one fake address space: regions of bytes by start.
#[derive(Clone, Debug, Default)]
pub struct FakeMemory {
    regions: Rc<RefCell<BTreeMap<u64, Vec<u8>>>>,
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
        self.stopped(tid)?.stopped = false;
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
        thread.stopped = true;
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
}
