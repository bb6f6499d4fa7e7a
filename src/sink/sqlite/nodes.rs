//! Stack nodes, stored many rows per statement: `-f -- make -j2` writes
//! about one node for every three events (37 `cc1`s, each with its own
//! modules and so its own frames and trie), and a node is two rows
//! (`stacks`, and its own `call_sites` row until the finish rewrites them).
//! One statement per row cost a third of the recorder's time there.
//!
//! Nodes wait here until a chunk is full or the transaction commits, like
//! events: readers see them with the events that refer to them.

use rusqlite::Connection;

use super::rows::int;
use crate::sink::StackNode;

/// Nodes per statement: 5 parameters a row, far below SQLite's limit.
const NODES: usize = 128;

#[derive(Default)]
pub(super) struct NodeRows {
    pending: Vec<StackNode>,
}

impl NodeRows {
    /// Store `node`, with the nodes before it once a chunk is full.
    pub fn push(&mut self, conn: &Connection, node: &StackNode) -> rusqlite::Result<()> {
        self.pending.push(node.clone());
        if self.pending.len() >= NODES {
            self.flush(conn)?;
        }
        Ok(())
    }

    /// Store every node waiting.
    pub fn flush(&mut self, conn: &Connection) -> rusqlite::Result<()> {
        for chunk in self.pending.chunks(NODES) {
            let rows = |row: &str| vec![row; chunk.len()].join(",");
            let mut stacks = conn.prepare_cached(&format!(
                "INSERT OR REPLACE INTO stacks(id, parent_id, frame_id, depth, trust) VALUES {}",
                rows("(?,?,?,?,?)")
            ))?;
            for (i, s) in chunk.iter().enumerate() {
                let at = i * 5;
                stacks.raw_bind_parameter(at + 1, int(s.id))?;
                stacks.raw_bind_parameter(at + 2, s.parent_id.map(int))?;
                stacks.raw_bind_parameter(at + 3, int(s.frame_id))?;
                stacks.raw_bind_parameter(at + 4, s.depth)?;
                stacks.raw_bind_parameter(at + 5, s.trust.name())?;
            }
            stacks.raw_execute()?;
            // Until frames are marked at the end, a stack's own frame.
            let mut sites = conn.prepare_cached(&format!(
                "INSERT OR REPLACE INTO call_sites(stack_id, frame_id, site_id) VALUES {}",
                rows("(?,?,?)")
            ))?;
            for (i, s) in chunk.iter().enumerate() {
                let at = i * 3;
                sites.raw_bind_parameter(at + 1, int(s.id))?;
                sites.raw_bind_parameter(at + 2, int(s.frame_id))?;
                sites.raw_bind_parameter(at + 3, int(s.id))?;
            }
            sites.raw_execute()?;
        }
        self.pending.clear();
        Ok(())
    }

    /// Forget the nodes waiting (their transaction was dropped).
    pub fn clear(&mut self) {
        self.pending.clear();
    }
}
