//! A heap profile in pprof's format (profile.proto, gzipped), with the four
//! sample types of a Go heap profile: `alloc_objects` and `alloc_space`
//! (every block allocated during the trace), `inuse_objects` and
//! `inuse_space` (the blocks still live at its end: the leaks). One sample
//! per stack; locations are frames, with inlined calls as extra lines
//! (innermost first, as profile.proto wants them).
//!
//! The messages are written out by hand with prost's derive (the subset of
//! profile.proto memptrace fills), so no protoc is needed to build.

use std::collections::HashMap;
use std::io::Write;

use flate2::Compression;
use flate2::write::GzEncoder;

use super::scan::Analysis;
use super::stacks::StackTable;
use super::{ReportError, Trace};

#[derive(Clone, PartialEq, prost::Message)]
pub struct Profile {
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    pub period: i64,
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Mapping {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    #[prost(int64, tag = "5")]
    pub filename: i64,
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Location {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    #[prost(uint64, tag = "3")]
    pub address: u64,
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Line {
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    #[prost(int64, tag = "2")]
    pub line: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(int64, tag = "2")]
    pub name: i64,
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    #[prost(int64, tag = "4")]
    pub filename: i64,
}

/// The names of the sample values, in order.
pub const SAMPLE_TYPES: [(&str, &str); 4] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
];

/// profile.proto's string table: index 0 is the empty string.
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Strings {
        let mut s = Strings::default();
        s.get("");
        s
    }

    fn get(&mut self, text: &str) -> i64 {
        if let Some(&i) = self.index.get(text) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(text.to_string());
        self.index.insert(text.to_string(), i);
        i
    }
}

/// Build the profile.
pub fn profile(
    trace: &Trace,
    analysis: &Analysis,
    table: &StackTable,
) -> Result<Profile, ReportError> {
    let mut strings = Strings::new();
    let mut p = Profile {
        sample_type: SAMPLE_TYPES
            .iter()
            .map(|(t, u)| ValueType {
                r#type: strings.get(t),
                unit: strings.get(u),
            })
            .collect(),
        period_type: Some(ValueType {
            r#type: strings.get("space"),
            unit: strings.get("bytes"),
        }),
        // Every call is recorded: nothing is sampled.
        period: 1,
        default_sample_type: strings.get("inuse_space"),
        ..Profile::default()
    };
    if let Some(command) = trace.meta("command")? {
        p.comment
            .push(strings.get(&format!("memptrace: {command}")));
    }
    p.time_nanos = trace
        .meta("started_at")?
        .as_deref()
        .and_then(parse_rfc3339_ns)
        .unwrap_or(0);
    p.duration_nanos = trace
        .meta("duration_ns")?
        .and_then(|d| d.parse().ok())
        .unwrap_or(analysis.last_ns);

    let mut mappings: HashMap<i64, u64> = HashMap::new();
    let mut module_ids: Vec<&i64> = table.modules.keys().collect();
    module_ids.sort();
    for id in module_ids {
        let m = &table.modules[id];
        let mapping_id = p.mapping.len() as u64 + 1;
        p.mapping.push(Mapping {
            id: mapping_id,
            memory_start: m.start,
            memory_limit: m.end,
            file_offset: 0,
            filename: strings.get(&m.path),
            build_id: strings.get(m.build_id.as_deref().unwrap_or("")),
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: true,
        });
        mappings.insert(*id, mapping_id);
    }

    let mut functions: HashMap<(String, String), u64> = HashMap::new();
    let mut function_id = |p: &mut Profile, strings: &mut Strings, name: &str, file: &str| {
        *functions
            .entry((name.to_string(), file.to_string()))
            .or_insert_with(|| {
                let id = p.function.len() as u64 + 1;
                let name = strings.get(name);
                p.function.push(Function {
                    id,
                    name,
                    system_name: name,
                    filename: strings.get(file),
                });
                id
            })
    };
    let mut locations: HashMap<i64, u64> = HashMap::new();
    let mut no_stack: Option<u64> = None;

    let mut stacks: Vec<(&Option<i64>, _)> = analysis
        .stacks
        .iter()
        .filter(|(_, s)| s.blocks > 0 || s.leaked_blocks > 0)
        .collect();
    stacks.sort_by_key(|(id, _)| **id);
    for (stack, s) in stacks {
        let mut location_id = Vec::new();
        match stack {
            Some(stack) => {
                for frame_id in table.frame_ids(*stack) {
                    if let Some(&id) = locations.get(&frame_id) {
                        location_id.push(id);
                        continue;
                    }
                    let Some(frame) = table.frame(frame_id) else {
                        continue;
                    };
                    let lines = table
                        .frame_locations(frame)
                        .iter()
                        .map(|l| Line {
                            function_id: function_id(
                                &mut p,
                                &mut strings,
                                &l.function,
                                l.file.as_deref().unwrap_or(""),
                            ),
                            line: l.line.unwrap_or(0),
                        })
                        .collect();
                    let id = p.location.len() as u64 + 1;
                    p.location.push(Location {
                        id,
                        mapping_id: frame
                            .module_id
                            .and_then(|m| mappings.get(&m).copied())
                            .unwrap_or(0),
                        address: frame.ip,
                        line: lines,
                    });
                    locations.insert(frame_id, id);
                    location_id.push(id);
                }
            }
            None => {
                let id = *no_stack.get_or_insert_with(|| {
                    let id = p.location.len() as u64 + 1;
                    let function_id = function_id(&mut p, &mut strings, "[no stack]", "");
                    p.location.push(Location {
                        id,
                        mapping_id: 0,
                        address: 0,
                        line: vec![Line {
                            function_id,
                            line: 0,
                        }],
                    });
                    id
                });
                location_id.push(id);
            }
        }
        p.sample.push(Sample {
            location_id,
            value: vec![
                s.blocks as i64,
                s.bytes as i64,
                s.leaked_blocks as i64,
                s.leaked_bytes as i64,
            ],
        });
    }
    p.string_table = strings.table;
    Ok(p)
}

/// The profile, encoded and gzipped as `pprof` reads it.
pub fn encode(profile: &Profile) -> Result<Vec<u8>, std::io::Error> {
    use prost::Message;
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&profile.encode_to_vec())?;
    gz.finish()
}

/// `2026-11-22T13:30:54.123Z` as nanoseconds since the Unix epoch (the
/// format `meta.started_at` is written in).
pub fn parse_rfc3339_ns(text: &str) -> Option<i64> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|x| x.parse::<i64>().ok());
    let (h, m, s) = (t.next()??, t.next()??, t.next()??);
    let digits = frac.len().min(9);
    let nanos = frac.get(..digits)?.parse::<i64>().ok()? * 10i64.pow(9 - digits as u32);
    // Days since 1970-01-01 from a civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + h * 3600 + m * 60 + s) * 1_000_000_000) + nanos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    #[test]
    fn reads_the_start_time_back() {
        for ms in [0u64, 951_782_400_000, 1_795_354_254_123] {
            let t = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
            let text = crate::time::rfc3339(t);
            assert_eq!(
                parse_rfc3339_ns(&text),
                Some(ms as i64 * 1_000_000),
                "{text}"
            );
        }
        assert_eq!(parse_rfc3339_ns("yesterday"), None);
    }

    #[test]
    fn strings_start_empty_and_are_shared() {
        let mut s = Strings::new();
        assert_eq!(s.get("a"), 1);
        assert_eq!(s.get(""), 0);
        assert_eq!(s.get("a"), 1);
        assert_eq!(s.table, vec!["".to_string(), "a".to_string()]);
    }
}
