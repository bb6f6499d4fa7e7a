//! The stack trie, frames and modules of a trace, loaded whole (they are
//! small next to the events); the allocator's wrappers along each stack;
//! and the rule that charges an allocation to a module.
//!
//! # Call sites
//!
//! The *call site* of a stack is its first frame, innermost first, that is
//! not part of the allocator ([`crate::wrappers`]: the allocator's library,
//! `operator new`, `std::allocator` code, `__rust_alloc`..., and the user's
//! `--wrapper` expressions, those given to the trace and those given to the
//! report); the innermost frame when every frame is part of it. Its function
//! is the *caller*. The `call_sites` table gives the same for SQL.
//!
//! # Which module an allocation is charged to
//!
//! "Who ate my memory", by component: each allocation is charged to the
//! module of its call site. A frame outside every known image is charged as
//! `[unknown]`; events without a stack are `[no stack]`.

use serde::Serialize;

use super::scan::IdMap;
use super::{ReportError, Trace};
use crate::util::file_name;
use crate::wrappers::Wrappers;

/// One source location of a frame (several when calls were inlined).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Line {
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub ip: u64,
    pub module_id: Option<i64>,
    /// Innermost first; empty when nothing is known.
    pub lines: Vec<Line>,
    /// Part of the allocator: the allocator's library, or a wrapper.
    pub wrapper: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Module {
    pub path: String,
    pub start: u64,
    pub end: u64,
    pub base: u64,
    pub build_id: Option<String>,
}

impl Module {
    /// The file name, without directories.
    pub fn name(&self) -> &str {
        file_name(&self.path)
    }
}

/// One line of a stack as people read it (an inlined call is a line of its
/// own), innermost first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Location {
    /// The function, or `module+0xoffset`, or `0xaddress`, as `stack_text`.
    pub function: String,
    pub file: Option<String>,
    pub line: Option<i64>,
    /// The module's file name.
    pub module: Option<String>,
    /// The return address of the frame this line belongs to.
    pub address: u64,
    /// True when this call was inlined into the next line's function.
    pub inlined: bool,
    /// How the frame was found, when it is less certain than by CFI:
    /// `frame pointer` (on the frame's last line; see `stacks.trust`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub found_by: Option<String>,
    /// Part of the allocator: a line of a frame that is (the allocator's
    /// library, `operator new`, a `--wrapper`...), or an inlined wrapper
    /// (`std::__new_allocator<T>::allocate`).
    pub wrapper: bool,
    /// The caller: the function of the stack's call site (one line of a
    /// stack at most).
    pub caller: bool,
}

/// Where an allocation is charged (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    Module(i64),
    Unknown,
    NoStack,
}

pub struct StackTable {
    /// Stack node -> (parent, frame).
    nodes: IdMap<i64, (Option<i64>, i64)>,
    /// Stack nodes whose frame was found by a frame pointer.
    by_frame_pointer: std::collections::HashSet<i64>,
    /// The built-in wrappers, the trace's and the report's.
    wrappers: Wrappers,
    frames: IdMap<i64, Frame>,
    pub modules: IdMap<i64, Module>,
    owners: std::cell::RefCell<IdMap<i64, Owner>>,
    /// Frame id -> the id of its text: frames that read the same (the
    /// same functions, files and lines) share one.
    frame_texts: IdMap<i64, u32>,
}

/// Values of stacks that read the same, merged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Merged<T> {
    /// The stacks merged, smallest id first; `None` for calls without one.
    pub stacks: Vec<Option<i64>>,
    pub value: T,
}

/// Frames walked per stack, at most: the trie cannot be deeper than
/// `--max-depth` (4096), so a longer walk means a damaged file.
const MAX_WALK: usize = 1 << 16;

impl StackTable {
    /// Load the trace's stacks, with the wrappers the trace was given
    /// (`meta` rows `wrapper.N`) and `extra` ones.
    pub fn load(trace: &Trace, extra: &[String]) -> Result<StackTable, ReportError> {
        let err = |e| trace.err(e);
        let expressions = [trace.numbered_meta("wrapper")?, extra.to_vec()].concat();
        let wrappers = Wrappers::new(&expressions).map_err(|source| ReportError::Wrapper {
            path: trace.path.clone(),
            source,
        })?;
        let mut nodes = IdMap::default();
        let mut by_frame_pointer = std::collections::HashSet::new();
        // Traces older than `stacks.trust` have no such column.
        let sql = match trace.conn.prepare("SELECT trust FROM stacks LIMIT 0") {
            Ok(_) => "SELECT id, parent_id, frame_id, trust = 'frame pointer' FROM stacks",
            Err(_) => "SELECT id, parent_id, frame_id, 0 FROM stacks",
        };
        let mut stmt = trace.conn.prepare(sql).map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            let id: i64 = r.get(0).map_err(err)?;
            nodes.insert(id, (r.get(1).map_err(err)?, r.get(2).map_err(err)?));
            if r.get::<_, Option<bool>>(3).map_err(err)? == Some(true) {
                by_frame_pointer.insert(id);
            }
        }

        let mut frames: IdMap<i64, Frame> = IdMap::default();
        // The trace's own marks count too: it knew which modules were static
        // executables (traces older than `frames.wrapper` have none).
        let sql = match trace.conn.prepare("SELECT wrapper FROM frames LIMIT 0") {
            Ok(_) => "SELECT id, ip, module_id, function, file, line, wrapper FROM frames",
            Err(_) => "SELECT id, ip, module_id, function, file, line, NULL FROM frames",
        };
        let mut stmt = trace.conn.prepare(sql).map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            let line = Line {
                function: r.get(3).map_err(err)?,
                file: r.get(4).map_err(err)?,
                line: r.get(5).map_err(err)?,
            };
            let known = line.function.is_some() || line.file.is_some();
            frames.insert(
                r.get(0).map_err(err)?,
                Frame {
                    ip: r.get::<_, i64>(1).map_err(err)? as u64,
                    module_id: r.get(2).map_err(err)?,
                    lines: if known { vec![line] } else { Vec::new() },
                    wrapper: r.get::<_, Option<bool>>(6).map_err(err)? == Some(true),
                },
            );
        }
        // frame_lines, when present, has every inlined level: it replaces
        // the single innermost line of `frames`.
        let mut inlined: IdMap<i64, Vec<Line>> = IdMap::default();
        let mut stmt = trace
            .conn
            .prepare(
                "SELECT frame_id, function, file, line FROM frame_lines ORDER BY frame_id, idx",
            )
            .map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            inlined
                .entry(r.get(0).map_err(err)?)
                .or_default()
                .push(Line {
                    function: r.get(1).map_err(err)?,
                    file: r.get(2).map_err(err)?,
                    line: r.get(3).map_err(err)?,
                });
        }
        for (id, lines) in inlined {
            if let Some(frame) = frames.get_mut(&id) {
                frame.lines = lines;
            }
        }

        let mut modules = IdMap::default();
        let mut stmt = trace
            .conn
            .prepare("SELECT id, path, start, \"end\", base, build_id FROM modules")
            .map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            modules.insert(
                r.get(0).map_err(err)?,
                Module {
                    path: r.get(1).map_err(err)?,
                    start: r.get::<_, i64>(2).map_err(err)? as u64,
                    end: r.get::<_, i64>(3).map_err(err)? as u64,
                    base: r.get::<_, i64>(4).map_err(err)? as u64,
                    build_id: r.get(5).map_err(err)?,
                },
            );
        }
        // The function whose machine code holds the call is the outermost
        // line's (an allocator helper inlined into the caller is the caller);
        // the report's own `--wrapper`s add to what the trace marked.
        for frame in frames.values_mut() {
            let module = frame
                .module_id
                .and_then(|m| modules.get(&m))
                .map(Module::name);
            let function = frame.lines.last().and_then(|l| l.function.as_deref());
            frame.wrapper |= wrappers.is_allocator_frame(module, function);
        }
        let mut table = StackTable {
            nodes,
            by_frame_pointer,
            wrappers,
            frames,
            modules,
            owners: Default::default(),
            frame_texts: IdMap::default(),
        };
        let mut texts: std::collections::HashMap<String, u32> = Default::default();
        let mut frame_texts = IdMap::default();
        for (id, frame) in &table.frames {
            let text = table
                .frame_locations(frame)
                .iter()
                .map(|l| format!("{}\t{:?}\t{:?}\t{:?}", l.function, l.file, l.line, l.module))
                .collect::<Vec<_>>()
                .join("\n");
            let next = texts.len() as u32;
            frame_texts.insert(*id, *texts.entry(text).or_insert(next));
        }
        table.frame_texts = frame_texts;
        Ok(table)
    }

    /// Merge the values of stacks that read the same all the way out (the
    /// call sites of an unrolled loop, or of one line calling twice): people
    /// cannot tell them apart, so a ranking shows them as one.
    pub fn merge<T: Default>(
        &self,
        items: impl IntoIterator<Item = (Option<i64>, T)>,
        mut add: impl FnMut(&mut T, T),
    ) -> Vec<Merged<T>> {
        let mut by_text: std::collections::HashMap<Option<Vec<u32>>, Merged<T>> =
            Default::default();
        for (stack, value) in items {
            let key = stack.map(|s| {
                self.frame_ids(s)
                    .iter()
                    .map(|f| self.frame_texts.get(f).copied().unwrap_or(u32::MAX))
                    .collect()
            });
            let merged = by_text.entry(key).or_insert_with(|| Merged {
                stacks: Vec::new(),
                value: T::default(),
            });
            merged.stacks.push(stack);
            add(&mut merged.value, value);
        }
        let mut out: Vec<Merged<T>> = by_text.into_values().collect();
        for m in &mut out {
            m.stacks.sort_unstable();
        }
        out.sort_by(|a, b| a.stacks.cmp(&b.stacks));
        out
    }

    /// The frame ids of a stack, innermost first.
    pub fn frame_ids(&self, stack: i64) -> Vec<i64> {
        self.walk(stack)
            .into_iter()
            .map(|(_, frame)| frame)
            .collect()
    }

    /// The (node, frame) pairs of a stack, innermost first.
    fn walk(&self, stack: i64) -> Vec<(i64, i64)> {
        let mut out = Vec::new();
        let mut node = Some(stack);
        while let Some(n) = node {
            let Some((parent, frame)) = self.nodes.get(&n) else {
                break;
            };
            out.push((n, *frame));
            node = *parent;
            if out.len() > MAX_WALK {
                break;
            }
        }
        out
    }

    pub fn frame(&self, id: i64) -> Option<&Frame> {
        self.frames.get(&id)
    }

    /// `module+0xoffset` or `0xaddress`: a frame without a function name.
    pub fn address_name(&self, frame: &Frame) -> String {
        match frame.module_id.and_then(|m| self.modules.get(&m)) {
            Some(m) => format!("{}+{:#x}", m.name(), frame.ip.wrapping_sub(m.base)),
            None => format!("{:#x}", frame.ip),
        }
    }

    /// The lines of one frame, innermost first, as people read them.
    pub fn frame_locations(&self, frame: &Frame) -> Vec<Location> {
        let module = frame
            .module_id
            .and_then(|m| self.modules.get(&m))
            .map(|m| m.name().to_string());
        if frame.lines.is_empty() {
            return vec![Location {
                function: self.address_name(frame),
                file: None,
                line: None,
                module,
                address: frame.ip,
                inlined: false,
                found_by: None,
                wrapper: frame.wrapper,
                caller: false,
            }];
        }
        let last = frame.lines.len() - 1;
        frame
            .lines
            .iter()
            .enumerate()
            .map(|(i, l)| Location {
                function: l
                    .function
                    .clone()
                    .unwrap_or_else(|| self.address_name(frame)),
                file: l.file.clone(),
                line: l.line,
                module: module.clone(),
                address: frame.ip,
                inlined: i < last,
                found_by: None,
                wrapper: frame.wrapper
                    || l.function
                        .as_deref()
                        .is_some_and(|f| self.wrappers.is_wrapper(f)),
                caller: false,
            })
            .collect()
    }

    /// The index in `ids` (frame ids, innermost first) of the call site:
    /// the first frame outside the allocator, or the innermost.
    fn call_site(&self, ids: &[i64]) -> usize {
        ids.iter()
            .position(|id| self.frames.get(id).is_none_or(|f| !f.wrapper))
            .unwrap_or(0)
    }

    /// Every line of a stack, innermost first, the caller marked.
    pub fn locations(&self, stack: Option<i64>) -> Vec<Location> {
        let Some(stack) = stack else {
            return Vec::new();
        };
        let walk = self.walk(stack);
        let ids: Vec<i64> = walk.iter().map(|&(_, frame)| frame).collect();
        let site = self.call_site(&ids);
        let mut out = Vec::new();
        for (i, (node, id)) in walk.iter().enumerate() {
            let Some(frame) = self.frames.get(id) else {
                continue;
            };
            let mut lines = self.frame_locations(frame);
            if self.by_frame_pointer.contains(node) {
                if let Some(last) = lines.last_mut() {
                    last.found_by = Some("frame pointer".to_string());
                }
            }
            if i == site {
                // The function whose code holds the call: the last line.
                if let Some(last) = lines.last_mut() {
                    last.caller = true;
                }
            }
            out.extend(lines);
        }
        out
    }

    /// The caller of the allocator in `stack` (see the module docs), as a
    /// line of it: `None` for calls without a stack.
    pub fn caller(&self, stack: Option<i64>) -> Option<Location> {
        self.locations(stack).into_iter().find(|l| l.caller)
    }

    /// The function names along a stack, outermost first (inlined calls
    /// included), as a flame graph draws them: down to the call site, the
    /// allocator's wrappers left out, so each leaf is named after code that
    /// called the allocator (the whole stack when it is all allocator).
    pub fn flame_names(&self, stack: i64) -> Vec<String> {
        let locations = self.locations(Some(stack));
        let first = locations.iter().position(|l| !l.wrapper).unwrap_or(0);
        let mut names: Vec<String> = locations
            .into_iter()
            .skip(first)
            .map(|l| l.function)
            .collect();
        names.reverse();
        names
    }

    /// The module an allocation from `stack` is charged to: its call site's.
    pub fn owner(&self, stack: Option<i64>) -> Owner {
        let Some(stack) = stack else {
            return Owner::NoStack;
        };
        if let Some(owner) = self.owners.borrow().get(&stack) {
            return owner.clone();
        }
        let ids = self.frame_ids(stack);
        let charged = ids
            .get(self.call_site(&ids))
            .and_then(|id| self.frames.get(id));
        let owner = match charged.and_then(|f| f.module_id) {
            Some(module) => Owner::Module(module),
            None => Owner::Unknown,
        };
        self.owners.borrow_mut().insert(stack, owner.clone());
        owner
    }

    /// A module name for an owner; modules mapped in several processes are
    /// one name.
    pub fn owner_name(&self, owner: &Owner) -> String {
        match owner {
            Owner::Module(id) => self
                .modules
                .get(id)
                .map_or_else(|| "[unknown]".to_string(), |m| m.name().to_string()),
            Owner::Unknown => "[unknown]".to_string(),
            Owner::NoStack => "[no stack]".to_string(),
        }
    }

    /// The full path of an owner's module, when it has one.
    pub fn owner_path(&self, owner: &Owner) -> Option<String> {
        match owner {
            Owner::Module(id) => self.modules.get(id).map(|m| m.path.clone()),
            _ => None,
        }
    }
}
