//! Stacks as a trie, interned in memory: each distinct stack is stored once,
//! and each distinct code address once, however many events share them. A
//! trace's memory grows with its distinct stacks, not with its events.

use rustc_hash::FxHashMap;

use crate::sink::{FrameRecord, Record, StackNode, Trust};

/// Interns frames (unique `(module, ip)`) and trie nodes (unique
/// `(parent, frame, trust)`), emitting a record for each new one.
#[derive(Default)]
pub struct Interner {
    frame_ids: FxHashMap<(u64, u64), u64>,
    node_ids: FxHashMap<(u64, u64, Trust), u64>,
    frames: Vec<FrameRecord>,
    nodes: u64,
}

/// Key for addresses outside every known module.
const NO_MODULE: u64 = u64::MAX;

impl Interner {
    pub fn new() -> Interner {
        Interner::default()
    }

    /// Intern a stack given innermost first, with how each frame was found
    /// (`trust[i]` for `ips[i]`; missing entries count as exact); returns its
    /// leaf node (the innermost frame), or `None` for an empty stack. New
    /// frames and nodes are appended to `out` before the caller uses the
    /// returned id.
    pub fn intern(
        &mut self,
        ips: &[u64],
        trust: &[Trust],
        module_of: impl Fn(u64) -> Option<u64>,
        out: &mut Vec<Record>,
    ) -> Option<u64> {
        let mut parent = 0;
        for (depth, (i, &ip)) in ips.iter().enumerate().rev().enumerate() {
            let how = trust.get(i).copied().unwrap_or(Trust::Context);
            let module_id = module_of(ip);
            let frame_key = (module_id.unwrap_or(NO_MODULE), ip);
            let frame_id = match self.frame_ids.get(&frame_key) {
                Some(&id) => id,
                None => {
                    let record = FrameRecord {
                        id: self.frames.len() as u64 + 1,
                        ip,
                        module_id,
                    };
                    self.frame_ids.insert(frame_key, record.id);
                    out.push(Record::Frame(record.clone()));
                    let id = record.id;
                    self.frames.push(record);
                    id
                }
            };
            parent = match self.node_ids.get(&(parent, frame_id, how)) {
                Some(&id) => id,
                None => {
                    self.nodes += 1;
                    let id = self.nodes;
                    self.node_ids.insert((parent, frame_id, how), id);
                    out.push(Record::StackNode(StackNode {
                        id,
                        parent_id: (parent != 0).then_some(parent),
                        frame_id,
                        depth: depth as u32,
                        trust: how,
                    }));
                    id
                }
            };
        }
        (parent != 0).then_some(parent)
    }

    /// Every frame interned so far, by id order.
    pub fn frames(&self) -> &[FrameRecord] {
        &self.frames
    }

    pub fn node_count(&self) -> u64 {
        self.nodes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_prefixes_and_keeps_order() {
        let mut interner = Interner::new();
        let mut out = Vec::new();
        let module = |ip: u64| (ip >= 0x1000).then_some(7);
        // innermost first: leaf 0x1003 called from 0x1002, from 0x1001 (outermost).
        let a = interner
            .intern(&[0x1003, 0x1002, 0x1001], &[], module, &mut out)
            .unwrap();
        assert_eq!(out.len(), 6, "three frames, three nodes");
        let b = interner
            .intern(&[0x1004, 0x1002, 0x1001], &[], module, &mut out)
            .unwrap();
        assert_eq!(out.len(), 8, "one new frame, one new node");
        assert_ne!(a, b);
        let again = interner
            .intern(&[0x1003, 0x1002, 0x1001], &[], module, &mut out)
            .unwrap();
        assert_eq!(again, a);
        assert_eq!(out.len(), 8);
        // The root is the outermost frame, at depth 0; the leaf is deepest.
        let nodes: Vec<&StackNode> = out
            .iter()
            .filter_map(|r| match r {
                Record::StackNode(n) => Some(n),
                _ => None,
            })
            .collect();
        assert_eq!(nodes[0].parent_id, None);
        assert_eq!(nodes[0].depth, 0);
        let leaf = nodes.iter().find(|n| n.id == a).unwrap();
        assert_eq!(leaf.depth, 2);
        let leaf_frame = &interner.frames()[leaf.frame_id as usize - 1];
        assert_eq!(leaf_frame.ip, 0x1003);
        assert_eq!(leaf_frame.module_id, Some(7));
        assert_eq!(interner.intern(&[], &[], module, &mut out), None);
    }
}
