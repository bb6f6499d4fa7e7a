//! A process named by a pidfd (`pidfd_open(2)`). A pid names a process only
//! until its parent reaps it: the kernel may then give the number to a new
//! process. A pidfd names the one process it was opened on, whatever
//! becomes of its number.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::ptrace::Tid;

/// The process a pid named when this was opened.
#[derive(Debug)]
pub struct Pidfd(OwnedFd);

impl Pidfd {
    /// The process `pid` names now (ESRCH: none).
    pub fn open(pid: Tid) -> io::Result<Pidfd> {
        // SAFETY: a plain system call with integer arguments; the returned
        // descriptor is owned here from the moment it exists.
        unsafe {
            let fd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(Pidfd(OwnedFd::from_raw_fd(fd as i32)))
        }
    }

    /// The process has not been reaped (a zombie still is this process):
    /// its pid still names it, and no other process has that number.
    pub fn unreaped(&self) -> bool {
        // Signal 0 only checks (`pidfd_send_signal(2)`): ESRCH once the
        // process is gone; EPERM would mean it is there, not ours to signal.
        // SAFETY: a plain system call; no siginfo is passed.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                0,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        ret == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }

    /// The descriptor, for calls that take a pidfd.
    pub fn fd(&self) -> i32 {
        self.0.as_raw_fd()
    }
}
