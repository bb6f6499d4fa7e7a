//! The probe's stack walk (its machine code, run here) against the Rust
//! walker of the same rules ([`crate::unwind::step`]): every row of real
//! images' tables stepped both ways from a synthetic stack, and a walk of
//! this thread's own stack through the images it runs.

use std::cell::RefCell;
use std::time::Instant;

use iced_x86::code_asm::{rax, rbp, rbx, rdi, rdx, rsi, rsp};

use super::{FREE, Rig};
use crate::event::Op;
use crate::os::local::LocalMapping;
use crate::symbols::elf::ElfImage;
use crate::tracer::probes::jump::layout::{self, dir, record, rule, slot};
use crate::unwind::step::{self, End, Frame, Step};
use crate::unwind::tables::{self, UnwindTable};

/// An image as the probe's directory lists it: its range, its load bias,
/// its table.
struct Image<'t> {
    start: u64,
    end: u64,
    bias: u64,
    table: &'t UnwindTable,
}

/// The rule the probe finds for `ip` in `images` (sorted by start): the
/// last image starting at or below it, if it ends above it; there, the
/// last row at or below the SVMA of the call (`ip - 1 - bias`, 32 bits).
fn rule_for(images: &[Image], ip: u64) -> u32 {
    let Some(image) = images.iter().rev().find(|i| i.start <= ip) else {
        return rule::UNSUPPORTED;
    };
    if ip >= image.end {
        return rule::UNSUPPORTED;
    }
    let svma = ip.wrapping_sub(1).wrapping_sub(image.bias);
    let Ok(svma) = u32::try_from(svma) else {
        return rule::UNSUPPORTED;
    };
    image.table.rule_at(svma).unwrap_or(rule::NONE)
}

/// Offsets of the functions this file adds to the rig's code mapping.
const SWITCH: usize = 0x400;
const LAND: usize = 0x440;
const CAPTURE: usize = 0x480;

impl Rig {
    /// The directory: `images`, their tables copied into the control area.
    /// Returns where each image's rules are (offsets in the control area).
    fn set_images(&self, images: &[Image]) -> Vec<usize> {
        let mut at = layout::TABLES as usize;
        let mut rules_at = Vec::new();
        for (i, image) in images.iter().enumerate() {
            let rows = image.table.len();
            let words = |w: &[u32]| -> Vec<u8> { w.iter().flat_map(|x| x.to_le_bytes()).collect() };
            let keys = at;
            self.control.write(keys, &words(&image.table.keys));
            let rules = keys + 4 * rows;
            self.control.write(rules, &words(&image.table.rules));
            rules_at.push(rules);
            at = (rules + 4 * rows).next_multiple_of(64);
            let base = self.control.addr();
            for (field, value) in [
                (dir::START, image.start),
                (dir::END, image.end),
                (dir::BIAS, image.bias),
                (dir::KEYS, base + keys as u64),
                (dir::RULES, base + rules as u64),
                (dir::ROWS, rows as u64),
            ] {
                self.set_entry(i, field, value);
            }
        }
        self.control
            .write_u64(layout::DIRS as usize, images.len() as u64);
        rules_at
    }

    fn set_entry(&self, i: usize, field: u64, value: u64) {
        let entry = layout::DIRS + 16 + i as u64 * layout::DIR_ENTRY_SIZE;
        self.control.write_u64((entry + field) as usize, value);
    }

    /// Ready for a walk with the stack's end at `hi`: the ring empty, the
    /// thread's cache of rules stale.
    fn fresh(&self, hi: u64) {
        self.empty_ring();
        for (field, value) in [(slot::STACK_HI, hi), (slot::CACHE_DIR, u64::MAX)] {
            self.control.write_u64(self.slot + field as usize, value);
        }
    }

    /// The thread's ring read to its end and emptied.
    fn empty_ring(&self) {
        for field in [slot::HEAD, slot::TAIL] {
            self.control.write_u64(self.slot + field as usize, 0);
        }
    }

    /// The one record of the last call: its frames and how its walk ended.
    fn walked(&self) -> (Vec<u64>, End) {
        let records = self.records();
        assert_eq!(records.len(), 1, "{records:x?}");
        let r = &records[0];
        let end = if r.flags & record::FULL != 0 {
            End::Full
        } else if r.flags & record::TRUNCATED != 0 {
            End::Truncated
        } else {
            End::Outermost
        };
        (r.frames.clone(), end)
    }
}

/// The synthetic stack: a mapping whose every word holds another of its
/// addresses (its own, `ROTATE` bytes on, wrapping): a return address or a
/// saved rbp read from it names the word it was read from.
const SIZE: u64 = 0x4_0000;
const ROTATE: u64 = 0x1000;
/// Where the walk starts: the frame's CFA (the probe runs below it), its
/// rbp, and the stack's end (every rule's CFA, rsp or rbp + 0..0xffff, and
/// every read inside; the rest of the mapping, above, never read).
const SP: u64 = 0x2000;
const BP: u64 = SP + 0x200;
const HI: u64 = BP + 0x1_0000 + 8;

/// Figures of a comparison, for its report.
#[derive(Debug, Default)]
struct Counts {
    rows: usize,
    cfa_rows: usize,
    stepped: usize,
    /// Rows where the caller's rbp was shown by the next step.
    rbp_shown: usize,
    refused: usize,
    /// Rows stepped with the whole stack and with the stack ending at the
    /// caller's CFA, refused when it ends one byte short of it.
    refused_short: usize,
    outermost: usize,
    /// Rows stepped, walked again with a zero return address (but the
    /// signal frame's row).
    zero_ip: usize,
}

/// Every row of `path`'s table, from a return address it covers on the
/// synthetic stack: the probe's walk and [`step::walk`] take the same
/// frames and end alike. The caller's CFA shows in its return address; its
/// rbp in the next one, read by a rule based on rbp whose offset puts the
/// CFA just above the caller's (so either rbp would be read). Each row is
/// walked again with the stack ending one byte short of where its step
/// went (both must refuse), and ending right there (both must step); and
/// with rbp misaligned, and below the frame; and with a zero return
/// address (both must end the stack there, whole).
fn compare_rows(rig: &Rig, stack: &LocalMapping, path: &str) -> Counts {
    let image = ElfImage::parse(path, &std::fs::read(path).unwrap()).unwrap();
    let table = tables::build(&image);
    let lo = stack.addr();
    let (sp, bp, hi) = (lo + SP, lo + BP, lo + HI);
    let land = rig.code.addr() + LAND as u64;
    let free = rig.code.addr() + FREE as u64;
    // The stack's return address, into LAND, which switches back.
    stack.write_u64((SP - 8) as usize, land);
    let mut reveal = UnwindTable {
        keys: vec![0],
        rules: vec![0],
    };
    // Image 0: the stack (its words are return addresses into it), one row
    // (its rule set for each row below). Image 1: one byte, LAND, at the
    // bias that makes LAND's call the row's key (set for each row below).
    let rules = rig.set_images(&[
        Image {
            start: lo,
            end: lo + SIZE,
            bias: lo - 1,
            table: &reveal,
        },
        Image {
            start: land,
            end: land + 1,
            bias: land,
            table: &table,
        },
    ]);
    let read_below = |hi: u64| {
        move |at: u64| {
            let inside = at >= sp && at.checked_add(8).is_some_and(|e| e <= hi);
            inside.then(|| stack.read_u64((at - lo) as usize))
        }
    };
    let frame = Frame {
        ip: land,
        cfa: sp,
        bp,
    };
    let mut n = Counts::default();
    let mut differ = Vec::new();
    for (&key, &row) in table.keys.iter().zip(&table.rules) {
        n.rows += 1;
        n.cfa_rows += usize::from(row & rule::NONE == 0);
        let bias = land - 1 - u64::from(key);
        let model = |reveal: &UnwindTable, ip: u64| {
            let dir = [
                Image {
                    start: lo,
                    end: lo + SIZE,
                    bias: lo - 1,
                    table: reveal,
                },
                Image {
                    start: land,
                    end: land + 1,
                    bias,
                    table: &table,
                },
            ];
            rule_for(&dir, ip)
        };
        assert_eq!(model(&reveal, land), row);
        let first = step::step(row, frame, hi, read_below(hi));
        reveal.rules[0] = match first {
            Step::Caller(caller) => {
                let offset = (caller.cfa + 8).saturating_sub(caller.bp).clamp(8, 0xffff);
                rule::RBP_BASED | offset as u32
            }
            _ => 8,
        };
        rig.set_entry(1, dir::BIAS, bias);
        rig.control.write(rules[0], &reveal.rules[0].to_le_bytes());
        let mut walk_with = |bp: u64, hi: u64| {
            let ours = step::walk(
                Frame { bp, ..frame },
                layout::MAX_FRAMES as usize,
                hi,
                |ip| model(&reveal, ip),
                read_below(hi),
            );
            rig.fresh(hi);
            rig.call(SWITCH, sp - 8, bp, free);
            let probe = rig.walked();
            if ours != probe {
                let first = |(ips, end): &(Vec<u64>, End)| (ips[..ips.len().min(3)].to_vec(), *end);
                differ.push((key, row, bp - lo, hi - lo, first(&ours), first(&probe)));
            }
            ours
        };
        let (ips, end) = walk_with(bp, hi);
        // rbp misaligned, and below the frame.
        walk_with(bp + 4, hi);
        walk_with(sp - 16, hi);
        match first {
            Step::Caller(caller) => {
                n.stepped += 1;
                n.rbp_shown += usize::from(ips.len() > 2);
                // The stack ending at the caller's CFA: still inside.
                let (exact, _) = walk_with(bp, caller.cfa);
                assert_eq!(exact.get(1), Some(&caller.ip));
                let (short, end) = walk_with(bp, caller.cfa - 1);
                assert_eq!((short.len(), end), (1, End::Truncated));
                n.refused_short += 1;
                if row != rule::SIGNAL {
                    // A zero return address: the outermost frame.
                    let at = (caller.cfa - 8 - lo) as usize;
                    let word = stack.read_u64(at);
                    stack.write_u64(at, 0);
                    let (last, end) = walk_with(bp, hi);
                    stack.write_u64(at, word);
                    assert_eq!((last.len(), end), (1, End::Outermost));
                    n.zero_ip += 1;
                }
            }
            Step::Truncated => n.refused += 1,
            Step::Outermost => n.outermost += 1,
        }
        assert_eq!(ips.len() == 1, !matches!(first, Step::Caller(_)), "{end:?}");
    }
    assert!(
        differ.is_empty(),
        "{path}: {} walks of {} rows differ, first (key, rule, rbp - lo, stack end - lo, ours, probe's): {:x?}",
        differ.len(),
        n.rows,
        &differ[..differ.len().min(3)]
    );
    n
}

/// SWITCH(sp, bp, function): a jump to `function` with rsp = `sp`, rbp =
/// `bp`; it returns into LAND (`[sp]`), which switches back (rbx holds the
/// rsp to return with, callee-saved through the probe and the function).
fn switch_and_land(rig: &Rig) {
    rig.function(SWITCH, |a| {
        a.push(rbp)?;
        a.push(rbx)?;
        a.mov(rbx, rsp)?;
        a.mov(rsp, rdi)?;
        a.mov(rbp, rsi)?;
        a.jmp(rdx)
    });
    rig.function(LAND, |a| {
        a.mov(rsp, rbx)?;
        a.pop(rbx)?;
        a.pop(rbp)?;
        a.ret()
    });
}

#[test]
fn the_probe_walks_every_row_of_real_images_as_the_rust_walker_does() {
    let mut rig = Rig::new();
    rig.plant(FREE, Op::Free, 2);
    switch_and_land(&rig);
    let stack = LocalMapping::new(SIZE as usize, false).unwrap();
    for i in 0..SIZE / 8 {
        let at = 8 * i;
        stack.write_u64(at as usize, stack.addr() + (at + ROTATE) % SIZE);
    }
    rig.control
        .write_u64(rig.slot + slot::STACK_LO as usize, stack.addr());
    for path in step::real_images() {
        let started = Instant::now();
        let n = compare_rows(&rig, &stack, &path);
        // Each row walked 3 times, each row stepped 2 or 3 more.
        let walks = 3 * n.rows + 2 * n.stepped + n.zero_ip;
        eprintln!(
            "{path}: {walks} walks of {} rows ({} CFA rows) alike by the probe and step::walk in {:.1?}: {n:?}",
            n.rows,
            n.cfa_rows,
            started.elapsed()
        );
        assert!(n.cfa_rows > 1000, "{n:?}");
        assert!(n.stepped * 2 > n.cfa_rows, "{n:?}");
        assert!(n.rbp_shown * 2 > n.stepped, "{n:?}");
        assert!(n.refused > 0 && n.outermost > 0 && n.zero_ip > 0, "{n:?}");
    }
}

thread_local! {
    /// What CAPTURE found: rsp and rbp at its entry, and the stack from
    /// rsp to its end.
    static CAPTURED: RefCell<Option<(u64, u64, Vec<u8>)>> = const { RefCell::new(None) };
}

/// Called by CAPTURE (rdi = its rsp, rsi = its rbp, rdx = the stack's end):
/// keeps a copy of the stack the probe has just walked.
/// (Nothing here may panic: a panic cannot unwind out of an `extern "C"`
/// function; the test finds nothing kept instead.)
extern "C" fn capture(sp: u64, bp: u64, hi: u64) -> u64 {
    let mut bytes = vec![0u8; hi.saturating_sub(sp) as usize];
    let read = crate::os::mem::read(std::process::id() as i32, sp, &mut bytes);
    if matches!(read, Ok(n) if n == bytes.len()) {
        CAPTURED.with(|c| *c.borrow_mut() = Some((sp, bp, bytes)));
    }
    0
}

/// The probe of CAPTURE walks this thread's stack, through the images
/// mapped here (their tables at their load biases); CAPTURE, run next,
/// keeps a copy of the stack walked; [`step::walk`] walks the copy.
#[test]
fn the_probe_walks_this_threads_stack_as_the_rust_walker_does() {
    let mut rig = Rig::new();
    let target = capture as extern "C" fn(u64, u64, u64) -> u64 as usize as u64;
    rig.function(CAPTURE, |a| {
        a.mov(rdi, rsp)?;
        a.mov(rsi, rbp)?;
        a.mov(rax, target)?;
        a.jmp(rax)
    });
    rig.plant(CAPTURE, Op::Free, 4);
    let maps = crate::os::procfs::read_maps(std::process::id() as i32).unwrap();
    let mut loaded: Vec<(u64, u64, u64, UnwindTable)> = Vec::new();
    let mut paths: Vec<&str> = Vec::new();
    for m in maps.iter().filter(|m| m.exec && m.path.starts_with('/')) {
        if paths.contains(&m.path.as_str()) {
            continue;
        }
        paths.push(&m.path);
        let Ok(bytes) = std::fs::read(&m.path) else {
            continue;
        };
        let Ok(image) = ElfImage::parse(&m.path, &bytes) else {
            continue;
        };
        let Some(bias) = image.load_bias(m.start, m.offset) else {
            continue;
        };
        let range = image.avma_range(bias);
        loaded.push((range.start, range.end, bias.0, tables::build(&image)));
    }
    loaded.sort_by_key(|l| l.0);
    let images: Vec<Image> = loaded
        .iter()
        .map(|(start, end, bias, table)| Image {
            start: *start,
            end: *end,
            bias: *bias,
            table,
        })
        .collect();
    rig.set_images(&images);
    let hi = rig.slot_word(slot::STACK_HI);
    rig.fresh(hi);
    // Twice: the second walk finds its rules in the thread's cache.
    for walk in ["first", "from the cache"] {
        rig.empty_ring();
        rig.call(CAPTURE, 0, 0, hi);
        let probe = rig.walked();
        compare_stack(&images, hi, probe, walk);
    }
}

/// What [`step::walk`] finds on the stack CAPTURE kept, with `images`'
/// tables, is `probe`, the probe's walk of it.
fn compare_stack(images: &[Image], hi: u64, probe: (Vec<u64>, End), walk: &str) {
    let (sp, bp, bytes) = CAPTURED
        .with(|c| c.borrow_mut().take())
        .expect("CAPTURE kept the stack");
    let read = |at: u64| {
        let i = usize::try_from(at.checked_sub(sp)?).ok()?;
        let word = bytes.get(i..i.checked_add(8)?)?;
        Some(u64::from_le_bytes(word.try_into().ok()?))
    };
    let frame = Frame {
        ip: read(sp).unwrap(),
        cfa: sp + 8,
        bp,
    };
    let ours = step::walk(
        frame,
        layout::MAX_FRAMES as usize,
        hi,
        |ip| rule_for(images, ip),
        read,
    );
    eprintln!(
        "this thread's stack, {walk}: {} frames, {:?}, through {} images",
        ours.0.len(),
        ours.1,
        images.len()
    );
    assert_eq!(ours, probe, "{walk}");
    assert!(ours.0.len() >= 5, "{ours:x?}");
}
