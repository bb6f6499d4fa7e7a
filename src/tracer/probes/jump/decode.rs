//! What a ring holds, decoded and checked: the traced program can write
//! every byte of the control area (by a stray pointer or on purpose), so
//! each word read from it is untrusted input, like a file from the
//! network. These functions work on plain bytes and numbers, never on the
//! shared mapping itself, so that they are tested (and fuzzed) on buffers.
//!
//! They never panic and never loop on what they read: a reading of a ring
//! looks at most at the `head - tail` bytes it was given, which are at most
//! [`layout::RING_SIZE`]; a record that fails a check ends the reading, and
//! the caller moves the ring's tail to its head (the ring is
//! resynchronised: what was behind the bad record is lost, and counted).

use super::control::{Pulled, Record};
use super::layout::{self, Called, RecordHead, record};
use crate::os::ptrace::Tid;

/// What was wrong with a ring or a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Damage {
    #[error("head {head} is not within a ring of tail {tail}")]
    Span { head: u64, tail: u64 },
    #[error("a record of {size} bytes with {frames} frames")]
    Size { size: u64, frames: u64 },
    #[error("a record runs {size} bytes past the {left} bytes before the head")]
    PastHead { size: u64, left: u64 },
    #[error("op code {0} is not one a probe records")]
    Op(u8),
    #[error("probe {0} is not one of this process's, or records another op")]
    Probe(u16),
    #[error("flags {0:#x} are not a probe's")]
    Flags(u8),
    #[error("sequence number {seq} beyond the counter {limit}")]
    Seq { seq: u64, limit: u64 },
    #[error("sequence number {seq} not above the ring's previous {before}")]
    SeqOrder { seq: u64, before: u64 },
    #[error("the ring cannot be read at {0}")]
    Unreadable(u64),
}

/// Bytes of one ring: the ring and the room past its end (a record is
/// never split), [`layout::RING_STRIDE`] bytes.
pub trait RingBytes {
    /// Copy `buf.len()` bytes at `at` from the ring's start; false (and
    /// nothing copied) when they are not all in the ring's stride.
    fn copy_at(&self, at: u64, buf: &mut [u8]) -> bool;

    /// Copy `out.len()` little-endian words at `at` (any alignment), as
    /// [`RingBytes::copy_at`] does bytes.
    fn copy_words(&self, at: u64, out: &mut [u64]) -> bool {
        let mut word = [0u8; 8];
        for (i, w) in out.iter_mut().enumerate() {
            if !self.copy_at(at + 8 * i as u64, &mut word) {
                return false;
            }
            *w = u64::from_le_bytes(word);
        }
        true
    }
}

impl RingBytes for [u8] {
    fn copy_at(&self, at: u64, buf: &mut [u8]) -> bool {
        let Ok(at) = usize::try_from(at) else {
            return false;
        };
        match at.checked_add(buf.len()).and_then(|end| self.get(at..end)) {
            Some(bytes) => {
                buf.copy_from_slice(bytes);
                true
            }
            None => false,
        }
    }
}

/// A record header's fields, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub size: u64,
    pub frames: u64,
    pub flags: u8,
    pub what: Called,
    pub probe: u16,
}

#[cfg(test)]
impl Header {
    /// The header word as the probe writes it.
    pub fn pack(&self) -> u64 {
        RecordHead {
            size: self.size as u16,
            frames: self.frames as u16,
            flags: self.flags,
            op: self.what.code(),
            probe: self.probe,
        }
        .pack()
    }
}

/// What a reading of one ring may accept.
pub struct Checks<'a> {
    /// Whether probe `id` of the space records calls of `what`.
    pub probe: &'a dyn Fn(u16, Called) -> bool,
    /// The space's sequence counter, read after the head: every committed
    /// record's number is below it.
    pub seq_limit: u64,
}

/// Decode and check a record's header word.
pub fn decode_header(word: u64, checks: &Checks) -> Result<Header, Damage> {
    let RecordHead {
        size,
        frames,
        flags,
        op,
        probe,
    } = RecordHead::unpack(word);
    let (size, frames) = (u64::from(size), u64::from(frames));
    let what = Called::of_code(op).ok_or(Damage::Op(op))?;
    // The probe writes exactly a header and its frames.
    if frames > layout::MAX_FRAMES || size != what.frames_at() + 8 * frames {
        return Err(Damage::Size { size, frames });
    }
    if flags & !(record::TRUNCATED | record::FULL) != 0 {
        return Err(Damage::Flags(flags));
    }
    if !(checks.probe)(probe, what) {
        return Err(Damage::Probe(probe));
    }
    Ok(Header {
        size,
        frames,
        flags,
        what,
        probe,
    })
}

/// The bytes between `tail` and `head`, if they fit a ring.
pub fn span(head: u64, tail: u64) -> Result<u64, Damage> {
    head.checked_sub(tail)
        .filter(|&n| n <= layout::RING_SIZE)
        .ok_or(Damage::Span { head, tail })
}

/// What one reading of a ring did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingRead {
    /// Records added to the output.
    pub records: usize,
    /// The new tail: after the last record read, or the head when the
    /// ring was damaged (resynchronised).
    pub tail: u64,
    pub damage: Option<Damage>,
}

/// Read the records between `tail` and `head` of ring `ring` (owned by
/// thread `tid`) into `out`. Stops at the first damage: the records before
/// it are kept, the tail goes to the head.
pub fn read_ring<R: RingBytes + ?Sized>(
    ring: &R,
    head: u64,
    tail: u64,
    tid: Tid,
    checks: &Checks,
    out: &mut Pulled,
) -> RingRead {
    let mut read = RingRead {
        records: 0,
        tail,
        damage: None,
    };
    if let Err(damage) = span(head, tail) {
        read.tail = head;
        read.damage = Some(damage);
        return read;
    }
    let mut before: Option<u64> = None;
    while read.tail < head {
        match read_record(ring, head, read.tail, tid, checks, before, out) {
            Ok((size, seq)) => {
                read.tail += size;
                read.records += 1;
                before = Some(seq);
            }
            Err(damage) => {
                read.tail = head;
                read.damage = Some(damage);
                break;
            }
        }
    }
    read
}

/// Read the record at `tail` into `out`; its size and sequence number.
fn read_record<R: RingBytes + ?Sized>(
    ring: &R,
    head: u64,
    tail: u64,
    tid: Tid,
    checks: &Checks,
    before: Option<u64>,
    out: &mut Pulled,
) -> Result<(u64, u64), Damage> {
    let at = tail % layout::RING_SIZE;
    let mut bytes = [0u8; layout::MAP_RECORD_HEADER as usize];
    // An allocator call's header is the shorter: the words past it are
    // read only for a mapping call's.
    if !ring.copy_at(at, &mut bytes[..layout::RECORD_HEADER as usize]) {
        return Err(Damage::Unreadable(at));
    }
    let header = decode_header(word_at(&bytes, record::HEAD), checks)?;
    let left = head - tail;
    if header.size > left {
        return Err(Damage::PastHead {
            size: header.size,
            left,
        });
    }
    let frames_at = header.what.frames_at();
    if frames_at > layout::RECORD_HEADER {
        let (from, to) = (layout::RECORD_HEADER, frames_at);
        if !ring.copy_at(at + from, &mut bytes[from as usize..to as usize]) {
            return Err(Damage::Unreadable(at + from));
        }
    }
    let word = |f: u64| word_at(&bytes, f);
    let seq = word(record::SEQ);
    if seq >= checks.seq_limit {
        return Err(Damage::Seq {
            seq,
            limit: checks.seq_limit,
        });
    }
    if let Some(before) = before.filter(|&b| seq <= b) {
        return Err(Damage::SeqOrder { seq, before });
    }
    let start = out.frames.len();
    out.frames.resize(start + header.frames as usize, 0);
    if !ring.copy_words(at + frames_at, &mut out.frames[start..]) {
        out.frames.truncate(start);
        return Err(Damage::Unreadable(at + frames_at));
    }
    let (args, stored) = match header.what {
        Called::Alloc(_) => (
            [
                word(record::ARG0),
                word(record::ARG1),
                word(record::ARG2),
                0,
                0,
                0,
            ],
            word(record::STORED),
        ),
        Called::Map(_) => (
            [
                word(record::ARG0),
                word(record::ARG1),
                word(record::ARG2),
                word(record::ARG3),
                word(record::ARG4),
                word(record::ARG5),
            ],
            0,
        ),
    };
    out.records.push(Record {
        seq,
        tsc: word(record::TSC),
        tid,
        what: header.what,
        probe: header.probe,
        flags: header.flags,
        args,
        ret: word(record::RET),
        stored,
        frames: start..out.frames.len(),
    });
    Ok((header.size, seq))
}

/// The little-endian word at `f` of a record's header `bytes`.
fn word_at(bytes: &[u8; layout::MAP_RECORD_HEADER as usize], f: u64) -> u64 {
    let f = f as usize;
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[f..f + 8]);
    u64::from_le_bytes(w)
}

/// The bytes of `record` (with `frames`) as a probe writes them.
#[cfg(test)]
pub fn encode_record(r: &Record, frames: &[u64]) -> Vec<u8> {
    let header = Header {
        size: r.what.frames_at() + 8 * frames.len() as u64,
        frames: frames.len() as u64,
        flags: r.flags,
        what: r.what,
        probe: r.probe,
    };
    let mut bytes = Vec::with_capacity(header.size as usize);
    let words = match r.what {
        Called::Alloc(_) => vec![r.args[0], r.args[1], r.args[2], r.ret, r.stored],
        Called::Map(_) => vec![
            r.args[0], r.args[1], r.args[2], r.ret, r.args[3], r.args[4], r.args[5],
        ],
    };
    for word in [header.pack(), r.seq, r.tsc]
        .into_iter()
        .chain(words)
        .chain(frames.iter().copied())
    {
        bytes.extend(word.to_le_bytes());
    }
    bytes
}

/// The most a slot's counter (calls nested, left by a longjmp, waits for
/// room) can plausibly reach: 2^40 calls is over a day at ten million a
/// second. A larger value was written by the program, not by a probe.
pub const MAX_COUNT: u64 = 1 << 40;

/// A slot's counter, if plausible.
pub fn plausible_count(value: u64) -> Option<u64> {
    (value <= MAX_COUNT).then_some(value)
}

/// How far past the next number to record a record's number can be: every
/// record not yet read is in a ring, and the rings hold at most this many.
pub const MAX_SEQ_AHEAD: u64 =
    (layout::SLOTS + layout::PROBES) * (layout::RING_SIZE / layout::RECORD_HEADER);

/// Remove from `records` (sorted by sequence number) those whose number is
/// implausible: too far past `next`, the next number to record, or a
/// duplicate of another. Returns how many were removed. Numbers below
/// `next` (a record late after its number was skipped) stay.
pub fn screen_seqs(records: &mut Vec<Record>, next: u64) -> u64 {
    let before = records.len();
    let mut last: Option<u64> = None;
    records.retain(|r| {
        let ahead = r.seq.checked_sub(next).is_some_and(|d| d > MAX_SEQ_AHEAD);
        let again = last == Some(r.seq);
        last = Some(r.seq);
        !ahead && !again
    });
    (before - records.len()) as u64
}

/// Of `seqs` (sorted, screened), how many can be recorded now, given the
/// next number to record; `gaps`: how many runs of missing numbers are
/// skipped rather than waited for. Returns the count, the numbers skipped,
/// and the next number after them.
pub fn in_order(seqs: impl Iterator<Item = u64>, mut next: u64, mut gaps: usize) -> InOrder {
    let mut take = 0;
    let mut skipped = 0u64;
    for seq in seqs {
        if seq > next {
            if gaps == 0 {
                return InOrder {
                    take,
                    skipped,
                    next,
                    waiting: true,
                };
            }
            gaps -= 1;
            skipped = skipped.saturating_add(seq - next);
            next = seq;
        }
        next = next.max(seq.saturating_add(1));
        take += 1;
    }
    InOrder {
        take,
        skipped,
        next,
        waiting: false,
    }
}

/// See [`in_order`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InOrder {
    pub take: usize,
    pub skipped: u64,
    pub next: u64,
    /// The first record not taken waits for a missing number.
    pub waiting: bool,
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
