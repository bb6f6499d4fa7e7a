//! Source-level names for code addresses, found once per unique address at the
//! end of a trace (being written).

use std::path::Path;

use crate::sink::SourceLine;

/// Names addresses of ELF images; keeps each image's debug data loaded while
/// it lives.
#[derive(Default)]
pub struct Symbolizer {}

impl Symbolizer {
    pub fn new() -> Symbolizer {
        Symbolizer::default()
    }

    /// The source lines of each probe (an SVMA of `path`), innermost first;
    /// an empty list where nothing is known.
    pub fn symbolize(
        &mut self,
        _path: &Path,
        _build_id: Option<&str>,
        probes: &[u64],
    ) -> Vec<Vec<SourceLine>> {
        vec![Vec::new(); probes.len()]
    }
}
