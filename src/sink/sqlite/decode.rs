//! Reading `event_log` rows back without the views: what a report's pass
//! over millions of events needs of `event_epochs` and `event_sites`, held
//! in memory (see docs/schema.md, "How events are stored").

use std::collections::HashMap;

use rusqlite::Connection;

use super::rows::{EPOCH_BITS, SITE_SHIFT};

/// The epochs' base times and the sites' threads and stacks of a trace.
pub struct EventDecoder {
    epochs: HashMap<i64, i64>,
    /// Indexed by site code: (thread code, stack id).
    sites: Vec<Option<(u32, Option<i64>)>>,
}

impl EventDecoder {
    /// Read the epochs and sites of the trace open on `conn`.
    pub fn load(conn: &Connection) -> rusqlite::Result<EventDecoder> {
        let mut epochs = HashMap::new();
        let mut stmt = conn.prepare("SELECT epoch, ts_ns FROM event_epochs")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            epochs.insert(row.get(0)?, row.get(1)?);
        }
        let mut sites = Vec::new();
        let mut stmt = conn.prepare("SELECT code, thread, stack_id FROM event_sites")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let code: i64 = row.get(0)?;
            // Codes are 0, 1, 2...: one too large is a damaged file.
            let Some(index) = usize::try_from(code).ok().filter(|&c| c <= 1 << 32) else {
                continue;
            };
            if sites.len() <= index {
                sites.resize(index + 1, None);
            }
            let thread: i64 = row.get(1)?;
            sites[index] = Some((thread as u32, row.get(2)?));
        }
        Ok(EventDecoder { epochs, sites })
    }

    /// `ts_ns` of event `id` stored with time `t` in its epoch; `None` when
    /// the epoch is missing (a damaged file).
    pub fn ts_ns(&self, id: i64, t: i64) -> Option<i64> {
        let base = self.epochs.get(&(id >> EPOCH_BITS))?;
        base.checked_add(t)
    }

    /// The thread code and stack of an event with `k`; thread 0 and no
    /// stack for a site not stored (a damaged file).
    pub fn site(&self, k: i64) -> (u32, Option<i64>) {
        usize::try_from(k >> SITE_SHIFT)
            .ok()
            .and_then(|code| self.sites.get(code).copied().flatten())
            .unwrap_or((0, None))
    }
}
