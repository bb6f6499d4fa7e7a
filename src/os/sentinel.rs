//! A word in shared memory that the kernel clears when memptrace dies, so
//! that the probes memptrace leaves in a process it attached to learn it at
//! once (and let calls through rather than trap for a tracer that is gone).
//!
//! The kernel's robust futexes (`futex(2)`, "Robust futexes";
//! `set_robust_list(2)`): when a thread exits, however it exits (SIGKILL and
//! the OOM killer included), the kernel walks the list of futex words the
//! thread registered and, in each word that holds the thread's id, puts
//! FUTEX_OWNER_DIED in place of the id. The thread that holds the words is
//! the tracer thread itself: the kernel walks a dying thread's list (in
//! `exit_mm`) before it detaches the thread's tracees (`exit_notify`), so a
//! probe never runs untraced while the word still names memptrace.
//!
//! The list is the thread's own, in place of the C library's (memptrace
//! takes no robust pthread mutex; the C library's head is put back when the
//! list empties). Its entries live in memptrace's private memory, in the
//! page just before each shared mapping (`SharedMemory::private_page`), so
//! the target can write a word but never the list the kernel follows; one
//! list has one distance from entry to word, so every word is at the same
//! offset of its mapping.
//!
//! Must never: leave the kernel a list entry whose memory is gone (an entry
//! is unlinked when its sentinel drops, before its mapping goes).

use std::cell::RefCell;
use std::io;
use std::sync::atomic::{AtomicU32, Ordering};

use super::shared::{PRIVATE_PAGE, SharedMemory};

/// The bits of a robust futex word that hold the owner's thread id.
pub const TID_MASK: u32 = 0x3fff_ffff;

/// `struct robust_list` and `struct robust_list_head` (linux/futex.h).
#[repr(C)]
struct RobustList {
    next: *mut RobustList,
}

#[repr(C)]
struct RobustListHead {
    list: RobustList,
    futex_offset: libc::c_long,
    list_op_pending: *mut RobustList,
}

/// This thread's list, once it holds a word: its head (leaked: the kernel
/// reads it until the thread ends) and the C library's head to put back.
struct ThreadList {
    head: *mut RobustListHead,
    libc_head: *mut libc::c_void,
    libc_len: libc::size_t,
    entries: usize,
}

thread_local! {
    static LIST: RefCell<Option<ThreadList>> = const { RefCell::new(None) };
}

/// A word of a shared mapping held by the calling thread until dropped (on
/// the same thread) or until the thread dies.
pub struct Sentinel {
    entry: *mut RobustList,
    word: *const AtomicU32,
    owner: std::thread::ThreadId,
}

impl Sentinel {
    /// Hold the 4-byte word at `offset` of `mem` (which must outlive the
    /// sentinel) on the calling thread: on return it holds the thread's id.
    /// Every word a thread holds is at the same `offset` of its mapping.
    pub fn hold(mem: &SharedMemory, offset: u64) -> io::Result<Sentinel> {
        let word = mem.word32(offset) as *const AtomicU32;
        let entry = mem.private_page().cast::<RobustList>();
        let distance = (PRIVATE_PAGE as u64 + offset) as libc::c_long;
        LIST.with(|list| {
            let mut list = list.borrow_mut();
            if list.is_none() {
                *list = Some(take_over(distance)?);
            }
            let l = list.as_mut().expect("made above");
            // SAFETY: the head is this thread's, leaked; the entry is the
            // first word of the private page of a live mapping.
            unsafe {
                if (*l.head).futex_offset != distance {
                    return Err(io::Error::other("a word at another offset"));
                }
                (*entry).next = (*l.head).list.next;
                (*l.head).list.next = entry;
            }
            l.entries += 1;
            Ok(())
        })?;
        // SAFETY: in the live mapping (checked by `word32`).
        let held = unsafe { &*word };
        held.store(
            super::local::thread_id() as u32 & TID_MASK,
            Ordering::SeqCst,
        );
        Ok(Sentinel {
            entry,
            word,
            owner: std::thread::current().id(),
        })
    }
}

/// Put this thread's own list in place of the C library's.
fn take_over(distance: libc::c_long) -> io::Result<ThreadList> {
    let mut libc_head: *mut libc::c_void = std::ptr::null_mut();
    let mut libc_len: libc::size_t = 0;
    // SAFETY: get_robust_list(2) for this thread (pid 0) into two locals.
    let got = unsafe {
        libc::syscall(
            libc::SYS_get_robust_list,
            0,
            &mut libc_head as *mut *mut libc::c_void,
            &mut libc_len as *mut libc::size_t,
        )
    };
    if got != 0 {
        return Err(io::Error::last_os_error());
    }
    let head = Box::leak(Box::new(RobustListHead {
        list: RobustList {
            next: std::ptr::null_mut(),
        },
        futex_offset: distance,
        list_op_pending: std::ptr::null_mut(),
    })) as *mut RobustListHead;
    // SAFETY: the head is leaked, so valid for the thread's life; an empty
    // list points at itself.
    let set = unsafe {
        (*head).list.next = &mut (*head).list;
        libc::syscall(
            libc::SYS_set_robust_list,
            head,
            std::mem::size_of::<RobustListHead>(),
        )
    };
    if set != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ThreadList {
        head,
        libc_head,
        libc_len,
        entries: 0,
    })
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        // SAFETY: the word's mapping outlives the sentinel (see `hold`).
        unsafe { &*self.word }.store(0, Ordering::SeqCst);
        if std::thread::current().id() != self.owner {
            // Not the holder's list: left to it (its entry still reads a
            // word that no longer names a thread).
            return;
        }
        LIST.with(|list| {
            let mut list = list.borrow_mut();
            let Some(l) = list.as_mut() else {
                return;
            };
            // SAFETY: this thread's list, changed only here and in `hold`;
            // every entry in it is in a live mapping.
            unsafe {
                let end: *mut RobustList = &mut (*l.head).list;
                let mut at = end;
                while !std::ptr::eq((*at).next, end) {
                    if std::ptr::eq((*at).next, self.entry) {
                        (*at).next = (*self.entry).next;
                        l.entries -= 1;
                        break;
                    }
                    at = (*at).next;
                }
                if l.entries == 0 {
                    // The C library's list back; the head stays leaked.
                    libc::syscall(libc::SYS_set_robust_list, l.libc_head, l.libc_len);
                    *list = None;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{FromRawFd, OwnedFd};

    fn mapping() -> SharedMemory {
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor
        // is owned from here on; ftruncate of our own memfd.
        let fd = unsafe {
            let fd = libc::memfd_create(c"sentinel-test".as_ptr(), 0);
            assert!(fd >= 0, "{}", io::Error::last_os_error());
            assert_eq!(libc::ftruncate(fd, 4096), 0);
            OwnedFd::from_raw_fd(fd)
        };
        SharedMemory::map(&fd, 4096).unwrap()
    }

    #[test]
    fn holds_words_with_the_threads_id_until_dropped() {
        let (a, b) = (mapping(), mapping());
        let held_a = Sentinel::hold(&a, 64).unwrap();
        let held_b = Sentinel::hold(&b, 64).unwrap();
        let tid = super::super::local::thread_id() as u32;
        assert_eq!(a.word32(64).load(Ordering::SeqCst), tid);
        assert_eq!(b.word32(64).load(Ordering::SeqCst), tid);
        // Another offset cannot share this thread's list.
        assert!(Sentinel::hold(&a, 128).is_err());
        drop(held_a);
        assert_eq!(a.word32(64).load(Ordering::SeqCst), 0);
        assert_eq!(b.word32(64).load(Ordering::SeqCst), tid);
        drop(held_b);
        assert_eq!(b.word32(64).load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_kernel_clears_the_word_when_the_thread_dies() {
        let mem = mapping();
        let word = mem.word32(64) as *const AtomicU32 as usize;
        let addr = &mem as *const SharedMemory as usize;
        let tid = std::thread::spawn(move || {
            // SAFETY: `mem` outlives this thread (joined below).
            let mem = unsafe { &*(addr as *const SharedMemory) };
            let held = Sentinel::hold(mem, 64).unwrap();
            // The thread ends holding it, as a killed memptrace would.
            std::mem::forget(held);
            super::super::local::thread_id() as u32
        })
        .join()
        .unwrap();
        // SAFETY: in `mem`, alive here.
        let now = unsafe { &*(word as *const AtomicU32) }.load(Ordering::SeqCst);
        assert_ne!(tid, 0);
        assert_eq!(now & TID_MASK, 0, "{now:#x}");
        assert_eq!(now & 0x4000_0000, 0x4000_0000, "FUTEX_OWNER_DIED: {now:#x}");
    }
}
