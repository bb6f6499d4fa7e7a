//! memptrace's side of a control area (see [`super::layout`]): made in the
//! target by injected system calls, mapped here, and kept: the unwind
//! tables and their directory, the threads' slots, and the rings read back.

use std::collections::BTreeMap;
use std::ops::Range;

use super::layout::{self, dir, record, slot};
use crate::event::Op;
use crate::os::ptrace::Tid;
use crate::os::sentinel::{Sentinel, TID_MASK};
use crate::os::shared::SharedMemory;
use crate::tracer::inject;
use crate::unwind::tables::UnwindTable;
use std::sync::atomic::Ordering;

pub use inject::SharedError as ControlError;

/// Records read from rings, their frames in one vector.
#[derive(Debug, Default)]
pub struct Pulled {
    pub records: Vec<Record>,
    pub frames: Vec<u64>,
}

impl Pulled {
    /// The frames of `record`.
    pub fn frames(&self, record: &Record) -> &[u64] {
        &self.frames[record.frames.clone()]
    }

    /// Copy `records` (read into `from`) and their frames to the end of
    /// this one.
    pub fn extend_from(&mut self, from: &Pulled, records: &[Record]) {
        for r in records {
            let start = self.frames.len();
            self.frames
                .extend_from_slice(&from.frames[r.frames.clone()]);
            self.records.push(Record {
                frames: start..self.frames.len(),
                ..r.clone()
            });
        }
    }

    /// Empty, keeping the room it has.
    pub fn clear(&mut self) {
        self.records.clear();
        self.frames.clear();
    }
}

/// One committed record, as read from a ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    pub tsc: u64,
    pub tid: Tid,
    pub op: Op,
    /// The probe that wrote it (its number in the space).
    pub probe: u16,
    pub flags: u8,
    pub args: [u64; 3],
    pub ret: u64,
    pub stored: u64,
    /// Where its return addresses (the caller first) are in the
    /// [`Pulled`] it was read into.
    pub frames: std::ops::Range<usize>,
}

/// An image in the directory.
#[derive(Clone, Copy, Debug)]
struct Entry {
    end: u64,
    bias: u64,
    keys: u64,
    rules: u64,
    rows: u64,
}

pub struct Control {
    /// Holds `ALIVE_WORD` while memptrace lives (see `os::sentinel`): made
    /// on the tracer thread, the one that creates every control area.
    sentinel: Option<Sentinel>,
    /// The area's address in the target.
    pub remote: u64,
    mem: SharedMemory,
    /// The thread owning each slot.
    owners: Vec<Option<Tid>>,
    /// The next free byte of the tables.
    tables_used: u64,
    images: BTreeMap<u64, Entry>,
    /// The directory written last (of `DIR_COUNT`, used in turn).
    dir_turn: u64,
    /// Calls not recorded (nested, or in a handler inside a probe),
    /// outermost calls left by a longjmp, and waits for room in a full
    /// ring, of slots given up so far.
    pub nested: u64,
    pub abandoned: u64,
    pub waits: u64,
}

impl Control {
    /// Make the control area in the process of the stopped thread `tid`,
    /// with the `syscall` instruction at `insn` and a NUL-terminated name
    /// at `name` in its memory. Signals that arrived meanwhile go to
    /// `signals`. `at`: map it there (a forked child's copy is replaced at
    /// its parent's address), or where the kernel likes.
    pub fn create(
        pid: Tid,
        tid: Tid,
        insn: u64,
        name: u64,
        at: Option<u64>,
        signals: &mut Vec<i32>,
    ) -> Result<Control, ControlError> {
        let (remote, mem) =
            inject::shared_memory(pid, tid, insn, name, layout::AREA_SIZE, at, signals)?;
        let mut control = Control {
            sentinel: None,
            remote,
            mem,
            owners: vec![None; (layout::SLOTS + layout::PROBES) as usize],
            tables_used: 0,
            images: BTreeMap::new(),
            dir_turn: 0,
            nested: 0,
            abandoned: 0,
            waits: 0,
        };
        control.mem.store(layout::MAGIC, layout::MAGIC_VALUE);
        control.mem.store(layout::WAIT_TIMESPEC + 8, 1_000_000);
        control
            .mem
            .store(layout::TRACER_PID, u64::from(std::process::id()));
        control
            .mem
            .store(layout::TRACER_TID, crate::os::local::thread_id() as u64);
        control.beat();
        control.sentinel = match Sentinel::hold(&control.mem, layout::ALIVE_WORD) {
            Ok(sentinel) => Some(sentinel),
            Err(_) => {
                // No word the kernel clears: an id nobody clears, and the
                // heartbeat alone tells when memptrace is gone.
                control
                    .mem
                    .word32(layout::ALIVE_WORD)
                    .store(std::process::id() & TID_MASK, Ordering::SeqCst);
                None
            }
        };
        control.publish_directory();
        Ok(control)
    }

    /// Let the probes count memptrace as gone once its heartbeat is `ticks`
    /// counter ticks old (0: never), and beat now (see
    /// [`super::liveness`]).
    pub fn fail_open(&self, ticks: u64) {
        self.beat();
        self.mem.store(layout::ALIVE_TICKS, ticks);
    }

    /// memptrace is here: the heartbeat the probes check.
    pub fn beat(&self) {
        self.mem.store(layout::ALIVE_TSC, crate::os::local::tsc());
    }

    /// Calls the probes let through unrecorded, memptrace looking gone.
    pub fn let_through(&self) -> u64 {
        self.mem.load(layout::LET_THROUGH)
    }

    /// The same images and tables as `parent` (a forked child's area,
    /// replacing the copy it shares with its parent).
    pub fn copy_tables_from(&mut self, parent: &Control) {
        let used = parent.tables_used as usize;
        let mut buf = vec![0u8; used];
        parent.mem.read(layout::TABLES, &mut buf);
        self.mem.write(layout::TABLES, &buf);
        self.tables_used = parent.tables_used;
        self.images = parent.images.clone();
        self.publish_directory();
    }

    /// Add an image's unwind table (no-op for an empty one, or when the
    /// tables are full: its frames end stacks).
    pub fn add_image(&mut self, range: Range<u64>, bias: u64, table: &UnwindTable) {
        if table.is_empty() {
            return;
        }
        let n = table.len() as u64;
        let need = (8 * n).next_multiple_of(64);
        if self.tables_used + need > layout::TABLES_SIZE
            || self.images.len() as u64 >= layout::DIR_ENTRIES
        {
            return;
        }
        let keys = layout::TABLES + self.tables_used;
        let rules = keys + 4 * n;
        let mut bytes = Vec::with_capacity(8 * n as usize);
        bytes.extend(table.keys.iter().flat_map(|k| k.to_le_bytes()));
        bytes.extend(table.rules.iter().flat_map(|r| r.to_le_bytes()));
        self.mem.write(keys, &bytes);
        self.tables_used += need;
        self.images.insert(
            range.start,
            Entry {
                end: range.end,
                bias,
                keys: self.remote + keys,
                rules: self.remote + rules,
                rows: n,
            },
        );
        self.publish_directory();
    }

    /// An image is gone: its frames end stacks from now on.
    pub fn remove_image(&mut self, start: u64) {
        if self.images.remove(&start).is_some() {
            self.publish_directory();
        }
    }

    /// Write the directory into the next buffer and make it the one in use.
    /// A probe still walking the one before keeps reading it whole: it is
    /// written again only `DIR_COUNT` changes later.
    fn publish_directory(&mut self) {
        self.dir_turn += 1;
        let at = layout::DIRS + (self.dir_turn % layout::DIR_COUNT) * layout::DIR_SIZE;
        let mut bytes = vec![0u8; 16];
        bytes[..4].copy_from_slice(&(self.images.len() as u32).to_le_bytes());
        for (&start, e) in &self.images {
            let mut entry = [0u8; layout::DIR_ENTRY_SIZE as usize];
            for (field, value) in [
                (dir::START, start),
                (dir::END, e.end),
                (dir::BIAS, e.bias),
                (dir::KEYS, e.keys),
                (dir::RULES, e.rules),
                (dir::ROWS, e.rows),
            ] {
                entry[field as usize..field as usize + 8].copy_from_slice(&value.to_le_bytes());
            }
            bytes.extend(entry);
        }
        self.mem.write(at, &bytes);
        self.mem.store(layout::DIRECTORY, self.remote + at);
    }

    /// Give thread `tid` (thread pointer `tp`, stack mapping `stack`) a
    /// slot where its probes find it; `None` when every slot it could use
    /// is taken.
    pub fn register(&mut self, tid: Tid, tp: u64, stack: Range<u64>) -> Option<usize> {
        let key = layout::key_of(tp);
        let home = layout::home_slot(tp) as usize;
        let i = (home..home + layout::PROBES as usize).find(|&i| {
            self.owners[i].is_none() || self.mem.load(Self::slot_at(i, slot::KEY)) == key
        })?;
        if let Some(old) = self.owners[i] {
            if old != tid {
                return None;
            }
        }
        let field = |f: u64| Self::slot_at(i, f);
        self.mem.store(field(slot::KEY), 0);
        self.mem.store(field(slot::FLAGS), 0);
        self.mem.store(field(slot::STACK_LO), stack.start);
        self.mem.store(field(slot::STACK_HI), stack.end);
        self.mem.store(
            field(slot::RING),
            self.remote + layout::ring_offset(i as u64),
        );
        self.mem.store(
            field(slot::CACHE),
            self.remote + layout::cache_offset(i as u64),
        );
        // An impossible directory: the thread empties its cache first.
        self.mem.store(field(slot::CACHE_DIR), u64::MAX);
        for f in [slot::BUSY, slot::PENDING_SP, slot::WAITING] {
            self.mem.store(field(f), 0);
        }
        self.mem.store(field(slot::KEY), key);
        self.owners[i] = Some(tid);
        Some(i)
    }

    /// The slots of thread `tid`.
    pub fn slots_of(&self, tid: Tid) -> Vec<usize> {
        (0..self.owners.len())
            .filter(|&i| self.owners[i] == Some(tid))
            .collect()
    }

    /// The slots in use.
    pub fn used_slots(&self) -> Vec<(usize, Tid)> {
        (0..self.owners.len())
            .filter_map(|i| Some((i, self.owners[i]?)))
            .collect()
    }

    /// Free slot `i` (its ring read to the end by the caller).
    pub fn release(&mut self, i: usize) {
        self.nested += self.mem.load(Self::slot_at(i, slot::NESTED));
        self.abandoned += self.mem.load(Self::slot_at(i, slot::ABANDONED));
        self.waits += self.mem.load(Self::slot_at(i, slot::WAITS));
        for field in [slot::NESTED, slot::ABANDONED, slot::WAITS] {
            self.mem.store(Self::slot_at(i, field), 0);
        }
        self.mem.store(Self::slot_at(i, slot::KEY), 0);
        self.owners[i] = None;
    }

    /// Record nothing of thread `tid`'s calls (`paused`), or again.
    pub fn pause(&self, tid: Tid, paused: bool) {
        for i in self.slots_of(tid) {
            self.mem
                .store(Self::slot_at(i, slot::FLAGS), u64::from(paused));
        }
    }

    /// The stack mapping of thread `tid`, read again.
    pub fn set_stack(&self, tid: Tid, stack: Range<u64>) {
        for i in self.slots_of(tid) {
            self.mem
                .store(Self::slot_at(i, slot::STACK_LO), stack.start);
            self.mem.store(Self::slot_at(i, slot::STACK_HI), stack.end);
        }
    }

    /// Calls not recorded, outermost calls left by a longjmp, and waits
    /// for room, counted so far in slots still in use.
    pub fn live_counts(&self) -> (u64, u64, u64) {
        self.used_slots()
            .iter()
            .fold((0, 0, 0), |(n, a, w), &(i, _)| {
                let count = |field| self.mem.load(Self::slot_at(i, field));
                (
                    n + count(slot::NESTED),
                    a + count(slot::ABANDONED),
                    w + count(slot::WAITS),
                )
            })
    }

    /// Read slot `i`'s committed records (owned by `tid`) into `out`, free
    /// their room, and wake the thread if it waits for room. Returns how
    /// many were read.
    pub fn pull(&self, i: usize, tid: Tid, out: &mut Pulled) -> usize {
        let head = self.mem.load(Self::slot_at(i, slot::HEAD));
        let mut tail = self.mem.load(Self::slot_at(i, slot::TAIL));
        let ring = layout::ring_offset(i as u64);
        let mut read = 0;
        let mut header = [0u8; layout::RECORD_HEADER as usize];
        while tail < head {
            let at = ring + tail % layout::RING_SIZE;
            self.mem.read(at, &mut header);
            let word = |f: u64| {
                u64::from_le_bytes(header[f as usize..f as usize + 8].try_into().expect("8"))
            };
            let h = word(record::HEAD);
            let size = h & 0xffff;
            let frames = ((h >> 16) & 0xffff) as usize;
            if size < layout::RECORD_HEADER || frames > layout::MAX_FRAMES as usize {
                break; // cannot happen: the probe writes whole records
            }
            let start = out.frames.len();
            out.frames.resize(start + frames, 0);
            self.mem
                .read_words(at + record::FRAMES, &mut out.frames[start..]);
            if let Some(op) = Op::from_code((h >> 40) as u8) {
                out.records.push(Record {
                    seq: word(record::SEQ),
                    tsc: word(record::TSC),
                    tid,
                    op,
                    probe: (h >> 48) as u16,
                    flags: (h >> 32) as u8,
                    args: [word(record::ARG0), word(record::ARG1), word(record::ARG2)],
                    ret: word(record::RET),
                    stored: word(record::STORED),
                    frames: start..start + frames,
                });
            }
            tail += size;
            read += 1;
        }
        if read > 0 {
            self.mem.store(Self::slot_at(i, slot::TAIL), tail);
            // The other half of the probe's barrier (see its wait): the tail
            // is seen before WAITING is read.
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            if self.mem.load(Self::slot_at(i, slot::WAITING)) != 0 {
                self.mem.store(Self::slot_at(i, slot::WAITING), 0);
                self.mem.wake(Self::slot_at(i, slot::TAIL));
            }
        }
        read
    }

    /// The stack pointer at the entry of the outermost call in progress on
    /// slot `i` (0: none).
    pub fn pending_sp(&self, i: usize) -> u64 {
        self.mem.load(Self::slot_at(i, slot::PENDING_SP))
    }

    fn slot_at(i: usize, field: u64) -> u64 {
        layout::slot_offset(i as u64) + field
    }
}

impl Drop for Control {
    /// Nobody reads this area any more (the trace ended, the process went,
    /// or memptrace unwinds from a panic): probes still planted, if any,
    /// let every call through rather than trap or wait for memptrace.
    fn drop(&mut self) {
        self.mem.store(layout::GONE, 1);
        // Clears the word and leaves the kernel's list, before the mapping
        // goes.
        self.sentinel = None;
        self.mem
            .word32(layout::ALIVE_WORD)
            .store(0, Ordering::SeqCst);
    }
}
