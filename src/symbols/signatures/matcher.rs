//! Looking for a [`Library`]'s functions in an image's code.
//!
//! Each function of the set is searched for by its longest run of fixed
//! bytes (a `memmem` over the executable segments: about a millisecond per
//! megabyte), and each hit is compared whole, masked bytes excepted. A
//! function whose fixed bytes are too few to search for (a jump wrapper is one
//! opcode byte and a masked address) is searched for once a function it
//! references is found, and then only hits that reference it count. A
//! function is *identified* only when exactly one place in the image matches.
//!
//! An op is hooked at the function that carries its name when that function
//! is identified; when it is a jump wrapper that is not (musl's `malloc` and
//! `__libc_malloc` are the same five bytes), at the function it jumps to:
//! the jump leaves the caller's return address as it was, so the call is
//! recorded the same.
//!
//! A function found spans the length of its code in the set: the extent a
//! symbol would give it (for the allocator bodies and housekeeping ranges).

use std::collections::HashMap;
use std::ops::Range;

use super::{Function, Library};
use crate::event::{MapOp, Op};
use crate::symbols::names;

/// An executable segment of the image: its address and file bytes.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    pub svma: u64,
    pub bytes: &'a [u8],
}

/// Fewest fixed bytes for a function identified by its bytes alone.
const MIN_FIXED: usize = 12;
/// Shortest run of fixed bytes worth a `memmem` search.
const MIN_ANCHOR: usize = 8;

/// An op found: where to hook it, and through which function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hook {
    pub op: Op,
    pub svma: u64,
    /// The set's function found at `svma`.
    pub function: String,
    /// The op's own function, when it is a jump wrapper that could not be
    /// told apart and the hook is on its target.
    pub via: Option<String>,
    /// The length of the code of `function`.
    pub len: u64,
}

/// A mapping function found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapHook {
    pub op: MapOp,
    pub svma: u64,
    pub function: String,
}

/// What one library's set found in an image.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Matches {
    pub hooks: Vec<Hook>,
    pub maps: Vec<MapHook>,
    /// The code of the housekeeping functions found.
    pub housekeeping: Vec<Range<u64>>,
    /// The code of the allocator bodies found ([`names::BODY_NAMES`]).
    pub bodies: Vec<(Range<u64>, Op)>,
    /// Every function of the set found, by name, and how many functions
    /// of the set were searched.
    pub identified: Vec<(String, u64)>,
    pub searched: usize,
}

struct State<'a> {
    lib: &'a Library,
    segments: &'a [Segment<'a>],
    /// Places each function matches at, once searched.
    candidates: Vec<Option<Vec<u64>>>,
    found: Vec<Option<u64>>,
}

/// Search `lib`'s functions in `segments`.
pub fn find(lib: &Library, segments: &[Segment]) -> Matches {
    let n = lib.functions.len();
    let mut state = State {
        lib,
        segments,
        candidates: vec![None; n],
        found: vec![None; n],
    };
    for i in 0..n {
        if let Some((at, len)) = anchor(&lib.functions[i]) {
            if len >= MIN_ANCHOR {
                state.candidates[i] = Some(state.search_anchor(i, at, len));
            }
        }
    }
    loop {
        let mut changed = false;
        for i in 0..n {
            if state.found[i].is_some() {
                continue;
            }
            let f = &lib.functions[i];
            let resolved: Vec<(usize, u64)> = f
                .refs
                .iter()
                .enumerate()
                .filter_map(|(r, re)| Some((r, state.address_of(&re.target)?)))
                .collect();
            if state.candidates[i].is_none() {
                if resolved.is_empty() {
                    continue;
                }
                state.candidates[i] = Some(state.search_all(i));
            }
            let kept: Vec<u64> = state.candidates[i]
                .as_ref()
                .into_iter()
                .flatten()
                .copied()
                .filter(|&at| {
                    resolved
                        .iter()
                        .all(|&(r, target)| state.reference_at(at, &f.refs[r]) == Some(target))
                })
                .collect();
            let evidence = f.fixed_bytes() >= MIN_FIXED || !resolved.is_empty();
            if kept.len() == 1 && evidence {
                state.found[i] = Some(kept[0]);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    state.result()
}

/// The longest run of fixed bytes (at most 32): `(offset, length)`.
fn anchor(f: &Function) -> Option<(usize, usize)> {
    let mut best = None;
    let mut run_start = 0;
    for i in 0..=f.mask.len() {
        if i == f.mask.len() || f.mask[i] == 0 {
            let len = i - run_start;
            if len > best.map_or(0, |(_, l)| l) {
                best = Some((run_start, len));
            }
            run_start = i + 1;
        }
    }
    best.map(|(at, len)| (at, len.min(32)))
}

impl State<'_> {
    fn matches_at(&self, i: usize, seg: &Segment, pos: usize) -> bool {
        let f = &self.lib.functions[i];
        let Some(code) = seg.bytes.get(pos..pos + f.code.len()) else {
            return false;
        };
        code.iter()
            .zip(&f.code)
            .zip(&f.mask)
            .all(|((b, want), m)| b & m == *want)
    }

    fn search_anchor(&self, i: usize, at: usize, len: usize) -> Vec<u64> {
        let f = &self.lib.functions[i];
        let needle = &f.code[at..at + len];
        let finder = memchr::memmem::Finder::new(needle);
        let mut out = Vec::new();
        for seg in self.segments {
            for hit in finder.find_iter(seg.bytes) {
                if hit >= at && self.matches_at(i, seg, hit - at) {
                    out.push(seg.svma + (hit - at) as u64);
                }
            }
        }
        out
    }

    /// Every place matching, found from the first fixed byte.
    fn search_all(&self, i: usize) -> Vec<u64> {
        let f = &self.lib.functions[i];
        let Some(first) = f.mask.iter().position(|&m| m != 0) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for seg in self.segments {
            for hit in memchr::memchr_iter(f.code[first], seg.bytes) {
                if hit >= first && self.matches_at(i, seg, hit - first) {
                    out.push(seg.svma + (hit - first) as u64);
                }
            }
        }
        out
    }

    /// The address a reference of the function placed at `at` holds.
    fn reference_at(&self, at: u64, r: &super::Ref) -> Option<u64> {
        let place = at.checked_add(r.offset as u64)?;
        let seg = self.segments.iter().find(|s| {
            place >= s.svma && place.saturating_add(4) <= s.svma + s.bytes.len() as u64
        })?;
        let o = (place - seg.svma) as usize;
        let value = i32::from_le_bytes(seg.bytes[o..o + 4].try_into().ok()?) as i64;
        // value = target + addend - place
        Some((place as i64).wrapping_add(value).wrapping_sub(r.addend) as u64)
    }

    /// The address of the function named `name`: of its strong definition
    /// when one is found, else of its only other one.
    fn address_of(&self, name: &str) -> Option<u64> {
        let mut strong = Vec::new();
        let mut other = Vec::new();
        for (f, at) in self.lib.functions.iter().zip(&self.found) {
            let Some(at) = *at else { continue };
            match f.names.iter().position(|n| n == name) {
                Some(i) if i < f.strong => strong.push(at),
                Some(_) => other.push(at),
                None => {}
            }
        }
        let pick = if strong.is_empty() { other } else { strong };
        let first = *pick.first()?;
        pick.iter().all(|&a| a == first).then_some(first)
    }

    fn result(&self) -> Matches {
        let mut identified: Vec<(String, u64)> = self
            .lib
            .functions
            .iter()
            .zip(&self.found)
            .filter_map(|(f, at)| Some((f.name().to_string(), (*at)?)))
            .collect();
        identified.sort();
        let mut hooks = Vec::new();
        for op in Op::ALL {
            let with_op: Vec<usize> = (0..self.lib.functions.len())
                .filter(|&i| self.lib.functions[i].ops.contains(&op))
                .collect();
            let direct: Vec<(u64, &str)> = with_op
                .iter()
                .filter_map(|&i| Some((self.found[i]?, self.lib.functions[i].name())))
                .collect();
            if let Some(&(svma, name)) = direct.first() {
                if direct.iter().all(|&(a, _)| a == svma) {
                    hooks.push(Hook {
                        op,
                        svma,
                        function: name.to_string(),
                        via: None,
                        len: self.len_at(svma),
                    });
                }
                continue;
            }
            // A wrapper not told apart: hook where it jumps.
            let mut targets: HashMap<u64, (String, String)> = HashMap::new();
            for &i in &with_op {
                let f = &self.lib.functions[i];
                if let Some((svma, name)) = self.follow(f, 0) {
                    targets.insert(svma, (name, f.name().to_string()));
                }
            }
            if targets.len() == 1 {
                let (svma, (function, via)) = targets.into_iter().next().unwrap_or_default();
                hooks.push(Hook {
                    op,
                    svma,
                    function,
                    via: Some(via),
                    len: self.len_at(svma),
                });
            }
        }
        let mut matches = Matches {
            hooks,
            identified,
            searched: self.lib.functions.len(),
            ..Matches::default()
        };
        self.extents(&mut matches);
        matches
    }

    /// The mapping functions, housekeeping functions and allocator bodies
    /// found: each only where the set's functions that carry it agree on
    /// one place.
    fn extents(&self, m: &mut Matches) {
        let found = || {
            self.lib
                .functions
                .iter()
                .zip(&self.found)
                .filter_map(|(f, at)| Some((f, (*at)?)))
        };
        for op in MapOp::ALL {
            let places: Vec<(&Function, u64)> =
                found().filter(|(f, _)| f.maps.contains(&op)).collect();
            if let Some(&(f, svma)) = places.first() {
                if places.iter().all(|&(_, a)| a == svma) {
                    m.maps.push(MapHook {
                        op,
                        svma,
                        function: f.name().to_string(),
                    });
                }
            }
        }
        for (f, svma) in found() {
            let range = svma..svma.saturating_add(f.code.len() as u64);
            if f.housekeeping && !m.housekeeping.contains(&range) {
                m.housekeeping.push(range);
            }
        }
        // A body by the definition the linker chose, as a symbol table
        // would name it (musl's lite_malloc defines `__libc_malloc_impl`
        // weakly, mallocng strongly).
        for &(name, op) in &names::BODY_NAMES {
            if let Some(svma) = self.address_of(name) {
                let range = svma..svma.saturating_add(self.len_at(svma));
                if !m.bodies.contains(&(range.clone(), op)) {
                    m.bodies.push((range, op));
                }
            }
        }
    }

    /// The length of the code of the function found at `svma` (the longest,
    /// should two of the set be found there).
    fn len_at(&self, svma: u64) -> u64 {
        self.lib
            .functions
            .iter()
            .zip(&self.found)
            .filter(|(_, at)| **at == Some(svma))
            .map(|(f, _)| f.code.len() as u64)
            .max()
            .unwrap_or(0)
    }

    /// Where the jump wrapper `f` leads: the first function along its chain
    /// of jumps that is found.
    fn follow(&self, f: &Function, depth: usize) -> Option<(u64, String)> {
        let target = f.tail.as_ref()?;
        if let Some(at) = self.address_of(target) {
            return Some((at, target.clone()));
        }
        if depth > 4 {
            return None;
        }
        let i = self.lib.function(target)?;
        self.follow(&self.lib.functions[i], depth + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::super::Ref;
    use super::*;

    fn function(names: &[&str], ops: &[Op], code: &[u8], mask: &[u8]) -> Function {
        Function {
            names: names.iter().map(|s| s.to_string()).collect(),
            strong: names.len(),
            ops: ops.to_vec(),
            maps: Vec::new(),
            housekeeping: false,
            code: code.to_vec(),
            mask: mask.to_vec(),
            refs: Vec::new(),
            tail: None,
        }
    }

    /// A body of 16 distinct bytes, and two identical jump wrappers to it:
    /// the body is found, the wrappers are not told apart, so the op goes
    /// to the body.
    #[test]
    fn ambiguous_wrappers_hook_their_target() {
        let body: Vec<u8> = (0x40..0x50).collect();
        let mut wrapper = function(
            &["malloc"],
            &[Op::Malloc],
            &[0xe9, 0, 0, 0, 0],
            &[0xff, 0, 0, 0, 0],
        );
        wrapper.refs.push(Ref {
            offset: 1,
            addend: -4,
            target: "impl".into(),
        });
        wrapper.tail = Some("impl".into());
        let mut other = wrapper.clone();
        other.names = vec!["__libc_malloc".into()];
        other.ops.clear();
        let lib = Library {
            label: "test".into(),
            functions: vec![wrapper, other, function(&["impl"], &[], &body, &[0xff; 16])],
        };
        // 0x1000: body; 0x1010: jmp body; 0x1015: jmp body; 0x101a: a jmp elsewhere.
        let mut code = body.clone();
        for at in [0x10i32, 0x15] {
            code.push(0xe9);
            code.extend((-(at + 5)).to_le_bytes());
        }
        code.extend([0xe9, 0, 0, 0, 0]);
        let seg = [Segment {
            svma: 0x1000,
            bytes: &code,
        }];
        let m = find(&lib, &seg);
        assert_eq!(m.identified, vec![("impl".to_string(), 0x1000)]);
        assert_eq!(
            m.hooks,
            vec![Hook {
                op: Op::Malloc,
                svma: 0x1000,
                function: "impl".into(),
                via: Some("malloc".into()),
                len: 16,
            }]
        );

        // One wrapper only: it is identified, and hooked itself.
        let one = &code[..0x15];
        let m = find(
            &lib,
            &[Segment {
                svma: 0x1000,
                bytes: one,
            }],
        );
        assert_eq!(m.hooks[0].svma, 0x1010);
        assert_eq!(m.hooks[0].via, None);
    }

    #[test]
    fn a_function_found_twice_is_not_hooked() {
        let body: Vec<u8> = (0x40..0x50).collect();
        let lib = Library {
            label: "test".into(),
            functions: vec![function(&["free"], &[Op::Free], &body, &[0xff; 16])],
        };
        let twice = [body.clone(), body].concat();
        let m = find(
            &lib,
            &[Segment {
                svma: 0,
                bytes: &twice,
            }],
        );
        assert!(m.hooks.is_empty() && m.identified.is_empty());
    }
}
