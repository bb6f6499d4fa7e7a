//! The analysis from the aggregate tables (docs/schema.md, "Aggregates"):
//! what memptrace kept while recording, read in a few small queries instead
//! of a pass over every event. The figures are the pass's own
//! ([`Analysis::run`] and [`Analysis::add_peak`]), found the same way as the
//! events went by; only the timeline of `plot` is not among them.

use super::scan::{Analysis, IdMap, Peak, Slice, size_bucket};
use super::{ReportError, Trace};
use crate::event::Op;

/// How a trace was recorded: `meta.trace_mode` (absent before aggregates
/// existed: full).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceMode {
    Full,
    /// `--aggregate`, with buckets over time of this many nanoseconds.
    Aggregate {
        resolution_ns: u64,
    },
}

impl TraceMode {
    pub fn of(trace: &Trace) -> Result<TraceMode, ReportError> {
        if trace.meta("trace_mode")?.as_deref() != Some("aggregate") {
            return Ok(TraceMode::Full);
        }
        let resolution_ns = trace
            .meta("agg_resolution_ns")?
            .and_then(|r| r.parse().ok())
            .unwrap_or(0);
        Ok(TraceMode::Aggregate { resolution_ns })
    }
}

/// An op by its stored name, `inventory` included.
fn op_named(name: &str) -> Option<Op> {
    Op::RECORDED.into_iter().find(|op| op.name() == name)
}

impl Analysis {
    /// The analysis of a trace, peak included: from the aggregate tables
    /// when the trace has them, else by the passes over the events.
    pub fn load(trace: &Trace) -> Result<Analysis, ReportError> {
        match Analysis::from_aggregates(trace)? {
            Some(a) => Ok(a),
            None => Analysis::full(trace),
        }
    }

    /// The analysis from the aggregate tables; `None` when the trace has
    /// none (an earlier memptrace, a trace not finished, or a full trace
    /// whose database stopped growing).
    pub fn from_aggregates(trace: &Trace) -> Result<Option<Analysis>, ReportError> {
        // Debug builds: tests compare the two ways of finding the figures.
        if cfg!(debug_assertions) && std::env::var_os("MEMPTRACE_REPORT_FROM_EVENTS").is_some() {
            return Ok(None);
        }
        let err = |e| trace.err(e);
        let present: i64 = trace
            .conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'agg_totals'",
                [],
                |r| r.get(0),
            )
            .map_err(err)?;
        if present == 0 {
            return Ok(None);
        }
        let totals = trace
            .conn
            .query_row(
                "SELECT events, last_ns, peak_bytes, peak_blocks, peak_event, peak_ns,
                        exec_released_blocks, exec_released_bytes FROM agg_totals",
                [],
                |r| {
                    Ok((
                        (r.get::<_, i64>(0)?, r.get::<_, i64>(1)?),
                        Peak {
                            bytes: r.get::<_, i64>(2)? as u64,
                            blocks: r.get::<_, i64>(3)? as u64,
                            event: r.get(4)?,
                            ts_ns: r.get(5)?,
                        },
                        (r.get::<_, i64>(6)? as u64, r.get::<_, i64>(7)? as u64),
                    ))
                },
            )
            .map(Some)
            .or_else(|e| match e {
                rusqlite::Error::QueryReturnedNoRows => Ok(None),
                e => Err(e),
            })
            .map_err(err)?;
        let Some(((events, last_ns), peak, (exec_blocks, exec_bytes))) = totals else {
            return Ok(None);
        };
        let mut a = Analysis {
            events: events as u64,
            last_ns,
            peak,
            exec_released_blocks: exec_blocks,
            exec_released_bytes: exec_bytes,
            sizes: vec![0; size_bucket(u64::MAX) + 1],
            ..Analysis::default()
        };
        let mut stmt = trace
            .conn
            .prepare(
                "SELECT stack_id, thread, op, calls, failed, blocks, bytes, releases, temporary
                 FROM agg_calls",
            )
            .map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            let name: String = r.get(2).map_err(err)?;
            let Some(op) = op_named(&name) else {
                continue;
            };
            let stack: Option<i64> = r.get(0).map_err(err)?;
            let thread = r.get::<_, i64>(1).map_err(err)? as u32;
            let n = |i| r.get::<_, i64>(i).map(|v| v.max(0) as u64).map_err(err);
            let (calls, failed, blocks, bytes, releases, temporary) =
                (n(3)?, n(4)?, n(5)?, n(6)?, n(7)?, n(8)?);
            let o = &mut a.ops[op as usize];
            o.calls += calls;
            o.failed += failed;
            o.bytes += bytes;
            a.blocks += blocks;
            a.bytes += bytes;
            a.releases += releases;
            a.temporary += temporary;
            let t = a.threads.entry(thread).or_default();
            t.calls += calls;
            t.blocks += blocks;
            t.bytes += bytes;
            t.temporary += temporary;
            if op.allocates() {
                let s = a.stacks.entry(stack).or_default();
                s.calls += calls;
                s.blocks += blocks;
                s.bytes += bytes;
                s.temporary += temporary;
            }
        }
        let mut stmt = trace
            .conn
            .prepare("SELECT stack_id, thread, op, size FROM agg_live")
            .map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            let stack: Option<i64> = r.get(0).map_err(err)?;
            let thread = r.get::<_, i64>(1).map_err(err)? as u32;
            let op: String = r.get(2).map_err(err)?;
            let size = r.get::<_, i64>(3).map_err(err)?.max(0) as u64;
            a.leaked_blocks += 1;
            a.leaked_bytes += size;
            if op == Op::Inventory.name() {
                a.inventory_live_blocks += 1;
                a.inventory_live_bytes += size;
            }
            let s = a.stacks.entry(stack).or_default();
            s.leaked_blocks += 1;
            s.leaked_bytes += size;
            let t = a.threads.entry(thread).or_default();
            t.leaked_blocks += 1;
            t.leaked_bytes += size;
        }
        let mut stmt = trace
            .conn
            .prepare("SELECT stack_id, thread, blocks, bytes FROM agg_peak")
            .map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            let stack: Option<i64> = r.get(0).map_err(err)?;
            let thread = r.get::<_, i64>(1).map_err(err)? as u32;
            let blocks = r.get::<_, i64>(2).map_err(err)?.max(0) as u64;
            let bytes = r.get::<_, i64>(3).map_err(err)?.max(0) as u64;
            let s = a.stacks.entry(stack).or_default();
            s.peak_blocks += blocks;
            s.peak_bytes += bytes;
            a.threads.entry(thread).or_default().peak_bytes += bytes;
        }
        let mut stmt = trace
            .conn
            .prepare("SELECT bucket, blocks FROM agg_sizes")
            .map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            let bucket = r.get::<_, i64>(0).map_err(err)?;
            let blocks = r.get::<_, i64>(1).map_err(err)?.max(0) as u64;
            if let Some(slot) = usize::try_from(bucket)
                .ok()
                .and_then(|b| a.sizes.get_mut(b))
            {
                *slot += blocks;
            }
        }
        Ok(Some(a))
    }

    /// The heap over time of an aggregate trace, at its resolution, from
    /// `agg_over_time`: a slice per bucket in which the heap changed, its
    /// value at the bucket's end (and the peak in the peak's bucket).
    pub fn add_timeline(&mut self, trace: &Trace, resolution_ns: u64) -> Result<(), ReportError> {
        let err = |e| trace.err(e);
        let mut stmt = trace
            .conn
            .prepare("SELECT bucket_ns, stack_id, bytes FROM agg_over_time ORDER BY bucket_ns")
            .map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        let mut held: IdMap<Option<i64>, u64> = IdMap::default();
        let mut total: u64 = 0;
        let mut slices: Vec<Slice> = Vec::new();
        let width = resolution_ns.clamp(1, i64::MAX as u64) as i64;
        while let Some(r) = rows.next().map_err(err)? {
            let bucket: i64 = r.get(0).map_err(err)?;
            let stack: Option<i64> = r.get(1).map_err(err)?;
            let bytes = r.get::<_, i64>(2).map_err(err)?.max(0) as u64;
            let before = held.insert(stack, bytes).unwrap_or(0);
            total = total.saturating_sub(before).saturating_add(bytes);
            let last_ns = bucket
                .saturating_add(width - 1)
                .min(self.last_ns.max(bucket));
            match slices.last_mut() {
                Some(slice) if slice.first_ns == bucket => {
                    slice.last_bytes = total;
                    slice.max_bytes = total;
                }
                _ => slices.push(Slice {
                    first_ns: bucket,
                    last_ns,
                    max_bytes: total,
                    last_bytes: total,
                }),
            }
        }
        for slice in &mut slices {
            if (slice.first_ns..=slice.last_ns).contains(&self.peak.ts_ns) {
                slice.max_bytes = slice.max_bytes.max(self.peak.bytes);
            }
        }
        self.timeline = slices;
        Ok(())
    }
}
