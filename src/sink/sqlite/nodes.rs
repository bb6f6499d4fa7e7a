//! Stack nodes, stored many rows per statement: `-f -- make -j2` writes
//! about one node for every three events (37 `cc1`s, each with its own
//! modules and so its own frames and trie), and a node is two rows
//! (`stacks`, and its own `call_sites` row until the finish rewrites them).
//! One statement per row cost a third of the recorder's time there.
//!
//! Nodes wait here until a chunk is full or the transaction commits, like
//! events: readers see them with the events that refer to them.

use rusqlite::Connection;
use rusqlite::types::{ToSqlOutput, ValueRef};

use super::rows::{Num, int};
use crate::sink::StackNode;

/// Nodes per statement: 5 parameters a row, far below SQLite's limit.
const NODES: usize = 128;

/// `rows` inserted by `insert` (`INSERT INTO t(a, b)`), `chunk` rows to a
/// statement (from the statement cache), `values` giving a row's.
pub(super) fn insert_many<T, const N: usize>(
    conn: &Connection,
    insert: &str,
    rows: &[T],
    chunk: usize,
    values: impl Fn(&T) -> [ValueRef<'static>; N],
) -> rusqlite::Result<()> {
    let row = format!("({})", vec!["?"; N].join(","));
    for part in rows.chunks(chunk) {
        let sql = format!(
            "{insert} VALUES {}",
            vec![row.as_str(); part.len()].join(",")
        );
        let mut stmt = conn.prepare_cached(&sql)?;
        for (at, value) in part.iter().flat_map(&values).enumerate() {
            stmt.raw_bind_parameter(at + 1, ToSqlOutput::Borrowed(value))?;
        }
        stmt.raw_execute()?;
    }
    Ok(())
}

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
        insert_many(
            conn,
            "INSERT OR REPLACE INTO stacks(id, parent_id, frame_id, depth, trust)",
            &self.pending,
            NODES,
            |s| {
                [
                    int(s.id).into(),
                    s.parent_id.map_or(Num::Null, int).into(),
                    int(s.frame_id).into(),
                    ValueRef::Integer(s.depth.into()),
                    ValueRef::Text(s.trust.name().as_bytes()),
                ]
            },
        )?;
        // Until frames are marked at the end, a stack's own frame.
        insert_many(
            conn,
            "INSERT OR REPLACE INTO call_sites(stack_id, frame_id, site_id)",
            &self.pending,
            NODES,
            |s| [int(s.id).into(), int(s.frame_id).into(), int(s.id).into()],
        )?;
        self.pending.clear();
        Ok(())
    }

    /// Forget the nodes waiting (their transaction was dropped).
    pub fn clear(&mut self) {
        self.pending.clear();
    }
}
