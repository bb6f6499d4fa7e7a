//! A way to test that memptrace's death harms no process: memptrace kills
//! itself with SIGKILL, as the OOM killer could, at the `n`th moment of a
//! kind (debug builds only):
//! - `MEMPTRACE_DIE_IN_CALL=n`: a moment at which a thread holds an
//!   injected system call's registers (three per call, see `inject`);
//! - `MEMPTRACE_DIE_IN_LENT_STUB=n`: such a moment of a call that runs
//!   through a copy of the stub lent to page padding (the first call of an
//!   attach, moments 1-3, and the detach's last, which unmaps the stub's
//!   area);
//! - `MEMPTRACE_DIE_IN_DETACH=n`: a moment of the detach's way out of the
//!   jump probes: every thread stopped, the probes' entries put back (the
//!   first), threads let run out of the probes' code, stopped again. So
//!   that there are such moments, the detach first lets the threads run
//!   until one is stopped in a probe's code.

#[cfg(debug_assertions)]
mod knobs {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    struct Knob {
        name: &'static str,
        at: OnceLock<Option<u64>>,
        seen: AtomicU64,
    }

    impl Knob {
        const fn new(name: &'static str) -> Knob {
            Knob {
                name,
                at: OnceLock::new(),
                seen: AtomicU64::new(0),
            }
        }

        fn count(&self) {
            let at = self
                .at
                .get_or_init(|| std::env::var(self.name).ok()?.parse().ok());
            if let Some(at) = *at {
                if self.seen.fetch_add(1, Ordering::Relaxed) + 1 == at {
                    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
    }

    static CALL: Knob = Knob::new("MEMPTRACE_DIE_IN_CALL");
    static DETACH: Knob = Knob::new("MEMPTRACE_DIE_IN_DETACH");
    static LENT: Knob = Knob::new("MEMPTRACE_DIE_IN_LENT_STUB");
    static DETACHING: AtomicBool = AtomicBool::new(false);
    static LENDING: AtomicBool = AtomicBool::new(false);

    pub fn lending(on: bool) {
        LENDING.store(on, Ordering::Relaxed);
    }

    pub fn detaching() {
        DETACHING.store(true, Ordering::Relaxed);
    }

    pub fn in_call() {
        CALL.count();
        if LENDING.load(Ordering::Relaxed) {
            LENT.count();
        }
        if DETACHING.load(Ordering::Relaxed) {
            DETACH.count();
        }
    }

    pub fn in_detach() {
        DETACH.count();
    }

    pub fn wants_threads_in_probes() -> bool {
        std::env::var_os(DETACH.name).is_some()
    }
}

#[cfg(not(debug_assertions))]
mod knobs {
    pub fn detaching() {}
    pub fn lending(_: bool) {}
    pub fn in_call() {}
    pub fn in_detach() {}
    pub fn wants_threads_in_probes() -> bool {
        false
    }
}

/// The detach begins: its moments count from now.
pub(in crate::tracer) use knobs::detaching;
/// A thread holds an injected call's registers.
pub(in crate::tracer) use knobs::in_call;
/// A moment of the detach.
pub(in crate::tracer) use knobs::in_detach;
/// Calls run through a stub lent to page padding (`true`), or no longer.
pub(in crate::tracer) use knobs::lending;
/// The detach is to find a thread in a probe's code.
pub(in crate::tracer) use knobs::wants_threads_in_probes;
