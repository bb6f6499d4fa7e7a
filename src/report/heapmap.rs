//! `memptrace heapmap`: the numbers of glibc's heap per arena, read live
//! from a process or from a snapshot stored in a trace (`heap_snapshots`
//! and the tables beside it), as text or JSON, and a picture of its pages
//! (`heapdraw`).

use std::path::PathBuf;

use rusqlite::OptionalExtension;
use serde::Serialize;

use super::text::bytes;
use super::{Format, ReportError, Trace};
use crate::heap::{ArenaSummary, HeapMap, MallInfo, PageRun, PageState};

/// What `heapmap` reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeapSource {
    /// A live process, not stopped.
    Pid(i32),
    /// A stored snapshot: the one given, or the trace's last.
    Trace {
        path: PathBuf,
        snapshot: Option<i64>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeapmapOptions {
    pub format: Format,
    /// A picture of the pages, .png or .svg.
    pub output: Option<PathBuf>,
}

/// One arena's row.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ArenaRow {
    pub arena: u64,
    /// `main` or `thread`.
    pub kind: String,
    #[serde(flatten)]
    pub numbers: ArenaSummary,
    pub locked: bool,
    pub error: Option<String>,
}

/// A heap as `heapmap` shows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HeapReport {
    pub pid: i64,
    /// The stored snapshot shown, and when it was taken.
    pub snapshot: Option<i64>,
    pub moment: Option<String>,
    /// Why there is no map (a snapshot that failed as a whole).
    pub error: Option<String>,
    pub arenas: Vec<ArenaRow>,
    pub mmapped_blocks: u64,
    pub mmapped_bytes: u64,
    pub mmapped_error: Option<String>,
    /// glibc's count of arenas, when known.
    pub narenas: Option<u64>,
    /// Blocks the program holds (in-use chunks and mmapped blocks).
    pub live_blocks: u64,
    pub live_bytes: u64,
    pub mallinfo: MallInfo,
    #[serde(skip)]
    pub pages: Vec<PageRun>,
    /// The arenas' heaps, for naming the pages' owners in the picture.
    #[serde(skip)]
    pub heaps: Vec<ArenaHeap>,
}

/// One heap of an arena: the memory from `start` to `end` is carved by the
/// arena at `arena`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaHeap {
    pub start: u64,
    pub end: u64,
    pub arena: u64,
    pub main: bool,
}

impl ArenaHeap {
    /// How the picture names it.
    pub fn label(&self) -> String {
        if self.main {
            "main arena".to_string()
        } else {
            format!("arena {:#x}", self.arena)
        }
    }
}

/// Chunks `(arena, main, addr, size)` sorted by arena then address, as the
/// heaps they make: chunks of one arena that follow each other.
pub(super) fn heaps_of_chunks(
    chunks: impl IntoIterator<Item = (u64, bool, u64, u64)>,
) -> Vec<ArenaHeap> {
    let mut heaps: Vec<ArenaHeap> = Vec::new();
    for (arena, main, addr, size) in chunks {
        let end = addr.saturating_add(size);
        match heaps.last_mut() {
            Some(h) if h.arena == arena && h.end == addr => h.end = end,
            _ => heaps.push(ArenaHeap {
                start: addr,
                end,
                arena,
                main,
            }),
        }
    }
    heaps
}

impl HeapReport {
    /// The report of a heap just read.
    pub fn of(pid: i64, map: &HeapMap) -> HeapReport {
        let live = map.live_blocks();
        HeapReport {
            pid,
            arenas: map
                .arenas
                .iter()
                .map(|a| ArenaRow {
                    arena: a.addr,
                    kind: if a.main { "main" } else { "thread" }.to_string(),
                    numbers: a.summary(),
                    locked: a.locked,
                    error: a.error.clone(),
                })
                .collect(),
            mmapped_blocks: map.mmapped.len() as u64,
            mmapped_bytes: map.mmapped.iter().map(|c| c.size).sum(),
            mmapped_error: map.mmapped_error.clone(),
            narenas: map.narenas,
            live_blocks: live.len() as u64,
            live_bytes: live.iter().map(|b| b.usable).sum(),
            mallinfo: map.mallinfo(),
            pages: map.pages.clone(),
            heaps: map
                .arenas
                .iter()
                .flat_map(|a| {
                    a.heaps.iter().map(|h| ArenaHeap {
                        start: h.start,
                        end: h.end,
                        arena: a.addr,
                        main: a.main,
                    })
                })
                .collect(),
            ..HeapReport::default()
        }
    }

    /// A snapshot stored in a trace: `id`, or the last one.
    pub fn load(trace: &Trace, id: Option<i64>) -> Result<HeapReport, ReportError> {
        let conn = &trace.conn;
        let q = |e| trace.err(e);
        let row = conn
            .query_row(
                "SELECT id, pid, moment, error FROM heap_snapshots
                 WHERE ?1 IS NULL OR id = ?1 ORDER BY id DESC LIMIT 1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .optional()
            .map_err(q)?;
        let Some((snapshot, pid, moment, error)) = row else {
            let mut stmt = conn
                .prepare("SELECT id || ' at ' || moment FROM heap_snapshots ORDER BY id")
                .map_err(q)?;
            let ids = stmt
                .query_map([], |r| r.get::<_, String>(0))
                .map_err(q)?
                .collect::<Result<Vec<_>, _>>()
                .map_err(q)?;
            let what = match id {
                Some(id) if !ids.is_empty() => {
                    format!("no heap snapshot {id}; its snapshots: {}", ids.join(", "))
                }
                _ => "no heap snapshot (heap maps are taken at attach, detach and exit of glibc programs)".to_string(),
            };
            return Err(ReportError::NotInTrace {
                path: trace.path.clone(),
                what,
            });
        };
        let mut report = HeapReport {
            pid,
            snapshot: Some(snapshot),
            moment: Some(moment),
            error,
            ..HeapReport::default()
        };
        let mut stmt = conn
            .prepare(
                "SELECT arena, kind, heaps, system, in_use, free, top, largest_free, fragmentation,
                        blocks, cached, resident, locked, error
                 FROM heap_arenas WHERE snapshot_id = ?1 ORDER BY kind, arena",
            )
            .map_err(q)?;
        report.arenas = stmt
            .query_map([snapshot], |r| {
                let u = |i| r.get::<_, i64>(i).map(|v| v as u64);
                Ok(ArenaRow {
                    arena: r.get::<_, i64>(0)? as u64,
                    kind: r.get(1)?,
                    numbers: ArenaSummary {
                        heaps: u(2)?,
                        system: u(3)?,
                        in_use: u(4)?,
                        free: u(5)?,
                        top: u(6)?,
                        largest_free: u(7)?,
                        fragmentation: r.get(8)?,
                        blocks: u(9)?,
                        cached: u(10)?,
                        resident: r.get::<_, Option<i64>>(11)?.map(|v| v as u64),
                    },
                    locked: r.get(12)?,
                    error: r.get(13)?,
                })
            })
            .map_err(q)?
            .collect::<Result<_, _>>()
            .map_err(q)?;
        let (blocks, bytes, mblocks, mbytes): (i64, i64, i64, i64) = conn
            .query_row(
                "SELECT count(*) FILTER (WHERE state IN ('in use', 'mmapped')),
                        coalesce(sum(size - CASE state WHEN 'mmapped' THEN 16 ELSE 8 END)
                                 FILTER (WHERE state IN ('in use', 'mmapped')), 0),
                        count(*) FILTER (WHERE state = 'mmapped'),
                        coalesce(sum(size) FILTER (WHERE state = 'mmapped'), 0)
                 FROM heap_chunks WHERE snapshot_id = ?1",
                [snapshot],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .map_err(q)?;
        report.live_blocks = blocks as u64;
        report.live_bytes = bytes as u64;
        report.mmapped_blocks = mblocks as u64;
        report.mmapped_bytes = mbytes as u64;
        (report.mmapped_error, report.narenas) = conn
            .query_row(
                "SELECT mmapped_error, narenas FROM heap_snapshots WHERE id = ?1",
                [snapshot],
                |r| Ok((r.get(0)?, r.get::<_, Option<i64>>(1)?.map(|n| n as u64))),
            )
            .map_err(q)?;
        report.mallinfo = conn
            .query_row(
                "SELECT arena, ordblks, smblks, hblks, hblkhd, usmblks, fsmblks, uordblks,
                        fordblks, keepcost FROM heap_mallinfo WHERE snapshot_id = ?1",
                [snapshot],
                |r| {
                    let u = |i| r.get::<_, i64>(i).map(|v| v as u64);
                    Ok(MallInfo {
                        arena: u(0)?,
                        ordblks: u(1)?,
                        smblks: u(2)?,
                        hblks: u(3)?,
                        hblkhd: u(4)?,
                        usmblks: u(5)?,
                        fsmblks: u(6)?,
                        uordblks: u(7)?,
                        fordblks: u(8)?,
                        keepcost: u(9)?,
                    })
                },
            )
            .optional()
            .map_err(q)?
            .unwrap_or_default();
        let mut stmt = conn
            .prepare(
                "SELECT addr, pages, state, resident FROM heap_pages
                 WHERE snapshot_id = ?1 ORDER BY addr",
            )
            .map_err(q)?;
        report.pages = stmt
            .query_map([snapshot], |r| {
                let state: String = r.get(2)?;
                Ok(PageRun {
                    addr: r.get::<_, i64>(0)? as u64,
                    pages: r.get::<_, i64>(1)? as u64,
                    state: match state.as_str() {
                        "free" => PageState::Free,
                        "top" => PageState::Top,
                        "mmapped" => PageState::Mmapped,
                        _ => PageState::InUse,
                    },
                    resident: r.get(3)?,
                })
            })
            .map_err(q)?
            .collect::<Result<_, _>>()
            .map_err(q)?;
        let mut stmt = conn
            .prepare(
                "SELECT c.arena, a.kind = 'main', c.addr, c.size FROM heap_chunks c
                 JOIN heap_arenas a ON a.snapshot_id = c.snapshot_id AND a.arena = c.arena
                 WHERE c.snapshot_id = ?1 ORDER BY c.arena, c.addr",
            )
            .map_err(q)?;
        let chunks = stmt
            .query_map([snapshot], |r| {
                let u = |i| r.get::<_, i64>(i).map(|v| v as u64);
                Ok((u(0)?, r.get::<_, bool>(1)?, u(2)?, u(3)?))
            })
            .map_err(q)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(q)?;
        report.heaps = heaps_of_chunks(chunks);
        Ok(report)
    }

    pub fn render(&self, format: Format) -> Result<String, ReportError> {
        match format {
            Format::Json => {
                let mut text = serde_json::to_string_pretty(self).map_err(ReportError::Json)?;
                text.push('\n');
                Ok(text)
            }
            Format::Text => Ok(self.text()),
        }
    }

    fn text(&self) -> String {
        let mut out = String::new();
        let when = match (&self.snapshot, &self.moment) {
            (Some(id), Some(moment)) => format!(" (snapshot {id}, at {moment})"),
            _ => String::new(),
        };
        out.push_str(&format!("glibc heap of process {}{when}\n", self.pid));
        if let Some(error) = &self.error {
            out.push_str(&format!("not mapped: {error}\n"));
            return out;
        }
        let header = [
            "arena",
            "kind",
            "heaps",
            "system",
            "in use",
            "free",
            "top",
            "largest free",
            "frag",
            "blocks",
            "cached",
            "resident",
        ];
        let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
        let mut notes = Vec::new();
        for a in &self.arenas {
            if let Some(error) = &a.error {
                notes.push(format!("arena {:#x}: not read: {error}", a.arena));
                rows.push(vec![format!("{:#x}", a.arena), a.kind.clone(), "-".into()]);
                continue;
            }
            if a.locked {
                notes.push(format!(
                    "arena {:#x}: locked (a call was in flight inside the allocator)",
                    a.arena
                ));
            }
            let n = &a.numbers;
            rows.push(vec![
                format!("{:#x}", a.arena),
                a.kind.clone(),
                n.heaps.to_string(),
                bytes(n.system),
                bytes(n.in_use),
                bytes(n.free),
                bytes(n.top),
                bytes(n.largest_free),
                format!("{:.0}%", n.fragmentation * 100.0),
                n.blocks.to_string(),
                bytes(n.cached),
                n.resident.map_or("?".into(), bytes),
            ]);
        }
        let widths: Vec<usize> = (0..header.len())
            .map(|i| {
                rows.iter()
                    .filter_map(|r| r.get(i))
                    .map(String::len)
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for row in &rows {
            let cells: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    if i < 2 {
                        format!("{c:<w$}", w = widths[i])
                    } else {
                        format!("{c:>w$}", w = widths[i])
                    }
                })
                .collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        out.push_str(&format!(
            "mmapped: {} blocks, {}\n",
            self.mmapped_blocks,
            bytes(self.mmapped_bytes)
        ));
        if let Some(error) = &self.mmapped_error {
            notes.push(format!("mmapped blocks: {error}"));
        }
        if let Some(n) = self.narenas.filter(|&n| n > self.arenas.len() as u64) {
            notes.push(format!(
                "glibc counts {n} arenas, {} were found: one was being made",
                self.arenas.len()
            ));
        }
        out.push_str(&format!(
            "live blocks: {}, {}\n",
            self.live_blocks,
            bytes(self.live_bytes)
        ));
        let m = &self.mallinfo;
        out.push_str(&format!(
            "mallinfo2: arena {} ordblks {} smblks {} hblks {} hblkhd {} usmblks {} fsmblks {} uordblks {} fordblks {} keepcost {}\n",
            m.arena, m.ordblks, m.smblks, m.hblks, m.hblkhd, m.usmblks, m.fsmblks, m.uordblks, m.fordblks, m.keepcost
        ));
        for note in notes {
            out.push_str(&format!("note: {note}\n"));
        }
        out
    }
}
