//! memptrace's side of a control area (see [`super::layout`]): made in the
//! target by injected system calls, mapped here, and kept: the unwind
//! tables and their directory, the threads' slots, and the rings read back.

use std::collections::BTreeMap;
use std::ops::Range;

use super::decode;
use super::layout::{self, Called, dir, slot};
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
    pub what: Called,
    /// The probe that wrote it (its number in the space).
    pub probe: u16,
    pub flags: u8,
    /// An allocator call's three arguments (then 0s), or a mapping call's
    /// six.
    pub args: [u64; 6],
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
    /// Damages seen in each slot since it was given to its thread; at
    /// [`DROP_AFTER`] the slot is dropped: its records are no longer read.
    strikes: Vec<u32>,
    /// What the program broke in this area (see [`Damaged`]).
    pub damaged: Damaged,
    /// Mapping functions have jump probes (attach): each thread gets a
    /// second slot, for its mapping calls (see [`layout::MAP_KEY`]).
    pub maps: bool,
}

/// Damage found in a control area: words the program wrote where only a
/// probe or memptrace should have (see [`super::decode`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Damaged {
    /// Records refused (a bad header, size, op, probe, sequence number or
    /// timestamp); a ring read no further after a bad record counts one.
    pub records: u64,
    /// Times a slot's own words were implausible: its head and tail, or a
    /// counter (not added to the trace's counts).
    pub slots: u64,
    /// Slots dropped after [`DROP_AFTER`] damages: their thread's calls are
    /// no longer recorded.
    pub dropped: u64,
    /// The first damage seen, for the warning.
    pub first: Option<String>,
}

impl Damaged {
    /// Add the damage found in another area.
    pub fn add(&mut self, d: &Damaged) {
        self.records = self.records.saturating_add(d.records);
        self.slots = self.slots.saturating_add(d.slots);
        self.dropped = self.dropped.saturating_add(d.dropped);
        if self.first.is_none() {
            self.first.clone_from(&d.first);
        }
    }

    /// The warning a damaged trace gets, if it is damaged.
    pub fn warning(&self) -> Option<String> {
        if self.records == 0 && self.slots == 0 && self.dropped == 0 {
            return None;
        }
        Some(format!(
            "the trace is damaged: the program wrote over the memory it shares with memptrace \
             ({} records refused, {} slot words implausible, {} threads' slots no longer read; \
             first: {}); calls it made may be missing",
            self.records,
            self.slots,
            self.dropped,
            self.first.as_deref().unwrap_or("unknown"),
        ))
    }

    pub fn note(&mut self, what: impl FnOnce() -> String) {
        if self.first.is_none() {
            self.first = Some(what());
        }
    }
}

/// Damages a slot may show before it is dropped: a program that keeps
/// writing over its slot gets its calls no longer recorded, rather than
/// records read from a ring it scribbles on.
pub const DROP_AFTER: u32 = 8;

impl Control {
    /// Make the control area in the process of the stopped thread `tid`,
    /// entering the kernel as `via` says, with a NUL-terminated name
    /// at `name` in its memory. Signals that arrived meanwhile go to
    /// `signals`. `at`: map it there (a forked child's copy is replaced at
    /// its parent's address), or where the kernel likes.
    pub fn create(
        pid: Tid,
        tid: Tid,
        via: inject::Via,
        name: u64,
        at: Option<u64>,
        signals: &mut Vec<i32>,
    ) -> Result<Control, ControlError> {
        let (remote, mem) =
            inject::shared_memory(pid, tid, via, name, layout::AREA_SIZE, at, signals)?;
        Ok(Control::over(remote, mem))
    }

    /// The control area at `remote` in the target, mapped here as `mem`,
    /// made ready for the probes.
    pub(in crate::tracer) fn over(remote: u64, mem: SharedMemory) -> Control {
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
            strikes: vec![0; (layout::SLOTS + layout::PROBES) as usize],
            damaged: Damaged::default(),
            maps: false,
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
        control
    }

    /// The probes must not wake memptrace with `tgkill` (the program's
    /// seccomp filter forbids it; see `layout::NO_WAKE`).
    pub fn forbid_wake(&mut self) {
        self.mem.store(layout::NO_WAKE, 1);
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
        if !parent.mem.read(layout::TABLES, &mut buf) || !self.mem.write(layout::TABLES, &buf) {
            return; // cannot be: `tables_used` stays within the tables
        }
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
    /// slot where its probes find it, one for its mapping calls when they
    /// have probes, and one for its signal handlers' calls made inside a
    /// probe (see [`layout::SIGNAL_KEY`]) while slots are plenty; `None`
    /// when every slot it could use is taken. A slot it has already is left
    /// as it is (a call may be in progress).
    pub fn register(&mut self, tid: Tid, tp: u64, stack: Range<u64>) -> Option<usize> {
        let calls = self.register_key(tid, layout::key_of(tp), stack.clone());
        if self.maps {
            self.register_key(tid, layout::map_key_of(tp), stack.clone())?;
        }
        // Without it, a handler's call inside a probe is counted as nested;
        // without a first slot, a thread waits in memptrace's stop. The
        // signal slot is taken only while a quarter of the slots or fewer
        // are in use, so that it never keeps a thread from its first slot
        // (a slot is found within `PROBES` places of its hash).
        let used = self.owners.iter().filter(|o| o.is_some()).count();
        if used < layout::SLOTS as usize / 4 {
            let _ = self.register_key(tid, layout::signal_key_of(tp), stack);
        }
        calls
    }

    fn register_key(&mut self, tid: Tid, key: u64, stack: Range<u64>) -> Option<usize> {
        let home = layout::home_of_key(key) as usize;
        let i = (home..home + layout::PROBES as usize).find(|&i| {
            self.owners[i].is_none() || self.mem.load(Self::slot_at(i, slot::KEY)) == key
        })?;
        if let Some(old) = self.owners[i] {
            if old != tid {
                return None;
            }
            return Some(i);
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
        if self.owners[i].is_none() {
            self.strikes[i] = 0;
        }
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
        let (nested, abandoned, waits) = self.counts(i);
        self.nested = self.nested.saturating_add(nested);
        self.abandoned = self.abandoned.saturating_add(abandoned);
        self.waits = self.waits.saturating_add(waits);
        for field in [slot::NESTED, slot::ABANDONED, slot::WAITS] {
            self.mem.store(Self::slot_at(i, field), 0);
        }
        self.mem.store(Self::slot_at(i, slot::KEY), 0);
        self.owners[i] = None;
        self.strikes[i] = 0;
    }

    /// Slot `i`'s counters (calls not recorded, left by a longjmp, waits),
    /// each 0 and counted as damage when implausible.
    fn counts(&mut self, i: usize) -> (u64, u64, u64) {
        let mut count = |field| {
            let value = self.mem.load(Self::slot_at(i, field));
            decode::plausible_count(value).unwrap_or_else(|| {
                self.damaged.slots += 1;
                self.damaged
                    .note(|| format!("a slot counter of {value} (over {})", decode::MAX_COUNT));
                0
            })
        };
        (
            count(slot::NESTED),
            count(slot::ABANDONED),
            count(slot::WAITS),
        )
    }

    /// Release every slot thread (or vfork child) `tid` holds.
    pub fn release_all_of(&mut self, tid: Tid) {
        for i in self.slots_of(tid) {
            self.release(i);
        }
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
    /// Implausible counters count as damage and add nothing.
    pub fn live_counts(&mut self) -> (u64, u64, u64) {
        self.used_slots()
            .iter()
            .fold((0, 0, 0), |(n, a, w): (u64, u64, u64), &(i, _)| {
                let (nested, abandoned, waits) = self.counts(i);
                (
                    n.saturating_add(nested),
                    a.saturating_add(abandoned),
                    w.saturating_add(waits),
                )
            })
    }

    /// Read slot `i`'s committed records (owned by `tid`) into `out`, free
    /// their room, and wake the thread if it waits for room. `probe`: whether
    /// a probe of the space records an op. Returns how many were read: at
    /// most a ring's worth, whatever the slot's words say. A damaged ring
    /// is counted and resynchronised (its tail moved to its head); a slot
    /// damaged [`DROP_AFTER`] times is dropped: its thread's calls are no
    /// longer recorded, and its ring only emptied.
    pub fn pull(
        &mut self,
        i: usize,
        tid: Tid,
        probe: &dyn Fn(u16, Called) -> bool,
        out: &mut Pulled,
    ) -> usize {
        let head = self.mem.load(Self::slot_at(i, slot::HEAD));
        let tail = self.mem.load(Self::slot_at(i, slot::TAIL));
        if head == tail {
            return 0;
        }
        // Read after the head: every record before it took its number.
        let seq_limit = self.mem.load(layout::SEQ);
        let read = if self.strikes[i] >= DROP_AFTER {
            self.mem.store(Self::slot_at(i, slot::FLAGS), 1);
            decode::RingRead {
                records: 0,
                tail: head,
                damage: None,
            }
        } else {
            let ring = RingOf {
                mem: &self.mem,
                at: layout::ring_offset(i as u64),
            };
            let checks = decode::Checks { probe, seq_limit };
            decode::read_ring(&ring, head, tail, tid, &checks, out)
        };
        if let Some(damage) = read.damage {
            self.damage(i, tid, damage);
        }
        self.mem.store(Self::slot_at(i, slot::TAIL), read.tail);
        // The other half of the probe's barrier (see its wait): the tail
        // is seen before WAITING is read.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.mem.load(Self::slot_at(i, slot::WAITING)) != 0 {
            self.mem.store(Self::slot_at(i, slot::WAITING), 0);
            self.mem.wake(Self::slot_at(i, slot::TAIL));
        }
        read.records
    }

    /// Count `damage` found in slot `i` (of thread `tid`), and drop the slot
    /// when it has had too much.
    fn damage(&mut self, i: usize, tid: Tid, damage: decode::Damage) {
        match damage {
            decode::Damage::Span { .. } => self.damaged.slots += 1,
            _ => self.damaged.records += 1,
        }
        self.damaged
            .note(|| format!("thread {tid}'s ring: {damage}"));
        let strikes = &mut self.strikes[i];
        *strikes += 1;
        if *strikes == DROP_AFTER {
            self.damaged.dropped += 1;
            // Its calls are no longer recorded (the thread can write this
            // too: the ring is emptied whatever it holds).
            self.mem.store(Self::slot_at(i, slot::FLAGS), 1);
        }
    }

    /// The stack pointer at the entry of the outermost call in progress on
    /// slot `i` (0: none).
    /// The program can write it: one below 16, or misaligned, is taken
    /// as none.
    pub fn pending_sp(&self, i: usize) -> u64 {
        let sp = self.mem.load(Self::slot_at(i, slot::PENDING_SP));
        if sp < 16 || sp % 8 != 0 { 0 } else { sp }
    }

    fn slot_at(i: usize, field: u64) -> u64 {
        layout::slot_offset(i as u64) + field
    }
}

/// One ring of the shared memory, as [`decode`] reads it.
struct RingOf<'a> {
    mem: &'a SharedMemory,
    at: u64,
}

impl decode::RingBytes for RingOf<'_> {
    fn copy_at(&self, at: u64, buf: &mut [u8]) -> bool {
        let in_stride = at
            .checked_add(buf.len() as u64)
            .is_some_and(|end| end <= layout::RING_STRIDE);
        in_stride && self.mem.read(self.at + at, buf)
    }

    fn copy_words(&self, at: u64, out: &mut [u64]) -> bool {
        let in_stride = at
            .checked_add(8 * out.len() as u64)
            .is_some_and(|end| end <= layout::RING_STRIDE);
        in_stride && self.mem.read_words(self.at + at, out)
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
