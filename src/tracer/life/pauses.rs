//! How long the program stood still for memptrace: every thread is stopped
//! while memptrace attaches (hooks and copies the heap) and while it
//! detaches (leaves the probes, puts the code back). Each such pause is
//! timed phase by phase, and the longest of each kind goes to `meta`
//! (`attach_pause_ms`, `detach_pause_ms` and their phases), so that a
//! slow one can be told from a trace.

use std::time::{Duration, Instant};

/// One pause: the program's threads stopped from its start to its end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pause {
    /// `attach` or `detach`.
    pub kind: &'static str,
    pub total: Duration,
    /// Each phase in order, with its length.
    pub phases: Vec<(&'static str, Duration)>,
    /// Work done for this pause once every thread ran again, before
    /// memptrace read the calls made meanwhile (the attach's inventory),
    /// with its length: no thread stood still for it, but a call waited
    /// for it at an int3 probe, or in a full ring.
    pub after: Option<(&'static str, Duration)>,
}

/// A pause being timed.
pub(in crate::tracer) struct PauseClock {
    kind: &'static str,
    start: Instant,
    last: Instant,
    phases: Vec<(&'static str, Duration)>,
}

impl PauseClock {
    /// Start timing a pause now: the first thread is about to be stopped.
    pub(in crate::tracer) fn start(kind: &'static str) -> PauseClock {
        let now = Instant::now();
        PauseClock {
            kind,
            start: now,
            last: now,
            phases: Vec::new(),
        }
    }

    /// The phase `name` ends now.
    pub(in crate::tracer) fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        self.phases.push((name, now - self.last));
        self.last = now;
    }

    /// Every thread runs again: the pause ends at the last lap.
    pub(in crate::tracer) fn finish(self) -> Pause {
        Pause {
            kind: self.kind,
            total: self.last - self.start,
            phases: self.phases,
            after: None,
        }
    }
}

/// `meta` rows for the longest pause of each kind: `<kind>_pause_ms`,
/// `<kind>_pause.<phase>_ms` for each of its phases, and `<kind>_<work>_ms`
/// for what was done after it (milliseconds, three decimals).
pub fn meta_rows(pauses: &[Pause]) -> Vec<(String, String)> {
    let ms = |d: Duration| format!("{:.3}", d.as_secs_f64() * 1e3);
    let mut rows = Vec::new();
    for kind in ["attach", "detach"] {
        let Some(longest) = pauses
            .iter()
            .filter(|p| p.kind == kind)
            .max_by_key(|p| p.total)
        else {
            continue;
        };
        rows.push((format!("{kind}_pause_ms"), ms(longest.total)));
        for (phase, d) in &longest.phases {
            rows.push((format!("{kind}_pause.{phase}_ms"), ms(*d)));
        }
        if let Some((work, d)) = longest.after {
            rows.push((format!("{kind}_{work}_ms"), ms(d)));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_pause_of_each_kind_with_its_phases() {
        let pause = |kind, ms: &[u64]| Pause {
            kind,
            total: Duration::from_millis(ms.iter().sum()),
            phases: ["stop", "hook"]
                .into_iter()
                .zip(ms.iter().map(|&m| Duration::from_millis(m)))
                .collect(),
            after: (kind == "attach").then(|| ("inventory", Duration::from_millis(ms[0] * 10))),
        };
        let rows = meta_rows(&[
            pause("attach", &[1, 2]),
            pause("attach", &[3, 4]),
            pause("detach", &[0, 1]),
        ]);
        let rows: Vec<(&str, &str)> = rows.iter().map(|(k, v)| (&k[..], &v[..])).collect();
        assert_eq!(
            rows,
            [
                ("attach_pause_ms", "7.000"),
                ("attach_pause.stop_ms", "3.000"),
                ("attach_pause.hook_ms", "4.000"),
                ("attach_inventory_ms", "30.000"),
                ("detach_pause_ms", "1.000"),
                ("detach_pause.stop_ms", "0.000"),
                ("detach_pause.hook_ms", "1.000"),
            ]
        );
        assert_eq!(meta_rows(&[]), []);
    }

    #[test]
    fn a_pause_is_the_sum_of_its_phases() {
        let mut clock = PauseClock::start("attach");
        clock.lap("stop");
        clock.lap("resume");
        let pause = clock.finish();
        assert_eq!(pause.kind, "attach");
        assert_eq!(pause.phases.len(), 2);
        assert_eq!(pause.total, pause.phases[0].1 + pause.phases[1].1);
    }
}
