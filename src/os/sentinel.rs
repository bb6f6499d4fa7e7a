//! A word in shared memory that the kernel clears when memptrace dies, so
//! that the probes memptrace leaves in a process it attached to learn it at
//! once (and let calls through rather than trap for a tracer that is gone).
//!
//! The kernel's robust futexes (`futex(2)`, "Robust futexes";
//! `set_robust_list(2)`): when a thread exits, however it exits (SIGKILL and
//! the OOM killer included), the kernel walks the list of futex words the
//! thread registered and, in each word that holds the thread's id, puts
//! FUTEX_OWNER_DIED in place of the id. A sentinel thread per word stores its
//! id in the word and registers a one-entry list of its own: the list lives
//! in memptrace's private memory (the target can write the word, never the
//! list the kernel follows), and the C library's own list is put back
//! before the thread ends.
//!
//! Must never: leave the kernel a list pointing at freed memory (the list
//! is the thread's until it ends, and the C library's is restored first),
//! or let the word outlive its mapping in a live list (dropping the
//! sentinel clears the word and ends the thread before the mapping goes).

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use super::shared::SharedMemory;

/// The bits of a robust futex word that hold the owner's thread id.
pub const TID_MASK: u32 = 0x3fff_ffff;

/// `struct robust_list` and `struct robust_list_head` (linux/futex.h).
#[repr(C)]
struct RobustList {
    next: *const RobustList,
}

#[repr(C)]
struct RobustListHead {
    list: RobustList,
    futex_offset: libc::c_long,
    list_op_pending: *const RobustList,
}

/// A thread holding a word of a shared mapping until it is dropped (or
/// memptrace dies).
pub struct Sentinel {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    word: usize,
}

impl Sentinel {
    /// Hold the 4-byte word at `offset` of `mem` (which must outlive the
    /// sentinel): on return it holds the sentinel thread's id.
    pub fn hold(mem: &SharedMemory, offset: u64) -> io::Result<Sentinel> {
        let word = mem.word32(offset) as *const AtomicU32 as usize;
        let (ready_tx, ready) = mpsc::channel::<io::Result<()>>();
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("memptrace-sentinel".into())
            .spawn(move || watch(word, ready_tx, stopped))?;
        let started = ready
            .recv()
            .unwrap_or_else(|_| Err(io::Error::other("the sentinel thread ended")));
        let sentinel = Sentinel {
            stop: Some(stop),
            thread: Some(thread),
            word,
        };
        started.map(|()| sentinel)
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        // SAFETY: the word lies in a mapping that outlives the sentinel (see
        // `hold`), 4-byte aligned (checked by `word32`).
        let word = unsafe { &*(self.word as *const AtomicU32) };
        word.store(0, Ordering::SeqCst);
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The sentinel thread: register the word, store the thread's id in it,
/// say so, and wait until told to end.
fn watch(word: usize, ready: mpsc::Sender<io::Result<()>>, stopped: mpsc::Receiver<()>) {
    // memptrace's own signals go to its tracer thread, never here.
    // SAFETY: a signal set of our own, filled and installed as this
    // thread's mask.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
    }
    let mut old_head: *const RobustListHead = std::ptr::null();
    let mut old_len: libc::size_t = 0;
    // SAFETY: get_robust_list(2) for this thread (pid 0) into two locals.
    let got = unsafe {
        libc::syscall(
            libc::SYS_get_robust_list,
            0,
            &mut old_head as *mut *const RobustListHead,
            &mut old_len as *mut libc::size_t,
        )
    };
    if got != 0 {
        let _ = ready.send(Err(io::Error::last_os_error()));
        return;
    }
    // The list: head -> entry -> head, the entry's futex word at
    // entry + futex_offset. Both live on this thread's stack until the
    // C library's list is back in place.
    let mut head = RobustListHead {
        list: RobustList {
            next: std::ptr::null(),
        },
        futex_offset: 0,
        list_op_pending: std::ptr::null(),
    };
    let mut entry = RobustList {
        next: &head.list as *const RobustList,
    };
    head.list.next = &entry as *const RobustList;
    head.futex_offset =
        (word as libc::c_long).wrapping_sub(&entry as *const RobustList as libc::c_long);
    // SAFETY: the head and its entry are valid until the old head is put
    // back below, before this function returns.
    let set = unsafe {
        libc::syscall(
            libc::SYS_set_robust_list,
            &head as *const RobustListHead,
            std::mem::size_of::<RobustListHead>(),
        )
    };
    if set != 0 {
        let _ = ready.send(Err(io::Error::last_os_error()));
        return;
    }
    // SAFETY: the word is valid while the sentinel lives (see `hold`), and
    // `hold` waits for this message before it returns.
    let held = unsafe { &*(word as *const AtomicU32) };
    held.store(
        super::local::thread_id() as u32 & TID_MASK,
        Ordering::SeqCst,
    );
    let _ = ready.send(Ok(()));
    // Until the sender is dropped.
    let _ = stopped.recv();
    // SAFETY: the C library's head, as the kernel had it.
    unsafe {
        libc::syscall(libc::SYS_set_robust_list, old_head, old_len);
    }
    // The list is no longer the kernel's: the locals may go.
    entry.next = std::ptr::null();
    let _ = (&head, &entry);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{FromRawFd, OwnedFd};

    #[test]
    fn holds_the_word_with_its_thread_id_until_dropped() {
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor
        // is owned from here on.
        let fd = unsafe {
            let fd = libc::memfd_create(c"sentinel-test".as_ptr(), 0);
            assert!(fd >= 0, "{}", io::Error::last_os_error());
            OwnedFd::from_raw_fd(fd)
        };
        // SAFETY: ftruncate of our own memfd.
        assert_eq!(
            unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), 4096) },
            0
        );
        let mem = SharedMemory::map(&fd, 4096).unwrap();
        let sentinel = Sentinel::hold(&mem, 64).unwrap();
        let tid = mem.word32(64).load(Ordering::SeqCst);
        assert_ne!(tid & TID_MASK, 0);
        assert_ne!(
            tid,
            super::super::local::thread_id() as u32,
            "its own thread's"
        );
        assert!(std::path::Path::new(&format!("/proc/self/task/{tid}")).exists());
        drop(sentinel);
        assert_eq!(mem.word32(64).load(Ordering::SeqCst), 0);
    }
}
