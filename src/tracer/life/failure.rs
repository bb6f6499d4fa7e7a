//! A panic of memptrace's tracer thread, if one is ever left, is caught: the
//! program is let go as after any other failure (detached, its bytes put
//! back), and the trace still gets its end rows, saying where memptrace
//! failed (`end_reason` = `memptrace failed: panicked at FILE:LINE: ...`).
//!
//! The panic's place is only known to the panic hook, so the hook installed
//! here keeps the last one's text (and still prints it, as the default hook
//! does) for [`catch`] to hand on.

use std::cell::RefCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

use crate::tracer::{Ending, TraceError};

thread_local! {
    /// The last panic's text on this thread, as the hook saw it (the hook
    /// runs on the panicking thread, as [`catch`] does).
    static LAST: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Keep each panic's text and place (once per process; the hook installed
/// before, the default one, still runs).
pub fn install_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let before = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            // "panicked at FILE:LINE:COL:\nMESSAGE", on one line.
            let text = info.to_string().replace('\n', " ");
            let _ = LAST.try_with(|last| last.replace(Some(text)));
            before(info);
        }));
    });
}

/// Run `f`; a panic inside it becomes `Err` with its text: `panicked at
/// FILE:LINE:COL: MESSAGE` when the hook saw it, the message otherwise.
///
/// `f` is taken as unwind-safe: after a panic the caller only lets the
/// program go and writes what it has, it does not go on tracing.
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".to_string());
        let place = LAST.try_with(|last| last.take()).ok().flatten();
        place.unwrap_or(message)
    })
}

/// The ending of a trace whose tracer thread panicked with `panic`.
pub fn ending(panic: String) -> Result<Ending, TraceError> {
    Ok(Ending::Failed {
        reason: format!("memptrace failed: {panic}"),
    })
}

/// Debug builds only, for the tests of this path: panic once `events`
/// reaches `MEMPTRACE_PANIC_AFTER` (an event count), if it is set.
pub fn panic_if_asked(events: u64) {
    #[cfg(debug_assertions)]
    {
        static AFTER: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
        let after = AFTER.get_or_init(|| std::env::var("MEMPTRACE_PANIC_AFTER").ok()?.parse().ok());
        if after.is_some_and(|n| events >= n) {
            panic!("MEMPTRACE_PANIC_AFTER: {events} events");
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = events;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_caught_with_its_place() {
        install_hook();
        assert_eq!(catch(|| 7), Ok(7));
        let err = catch(|| -> u32 { panic!("bad word {}", 3) }).unwrap_err();
        assert!(
            err.starts_with("panicked at src/tracer/life/failure.rs:"),
            "{err}"
        );
        assert!(err.ends_with(": bad word 3"), "{err}");
    }
}
