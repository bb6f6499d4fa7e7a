//! Starting the target: fork, stop, seize, exec.
//!
//! The child stops itself with SIGSTOP before execve so that memptrace can
//! PTRACE_SEIZE it (seized tracees support PTRACE_LISTEN and PTRACE_INTERRUPT,
//! which group-stop handling and detaching need) and see the exec as its first
//! traced event, before a single instruction of the program has run.

use std::ffi::{CString, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::ptrace::{self, Tid};

/// A child stopped before exec, seized, and told to continue into execve.
pub struct Launched {
    pub pid: Tid,
    /// Read end of a close-on-exec pipe: the child writes its errno here when
    /// execve fails; it reads as EOF once the exec succeeded.
    exec_error: libc::c_int,
}

impl Launched {
    /// The errno of a failed execve, if the child reported one. Call after the
    /// child has exited or exec'd; never blocks then.
    pub fn exec_error(&self) -> Option<io::Error> {
        let mut buf = [0u8; 4];
        // SAFETY: reading into a local buffer from our own pipe.
        let n = unsafe { libc::read(self.exec_error, buf.as_mut_ptr().cast(), 4) };
        (n == 4).then(|| io::Error::from_raw_os_error(i32::from_ne_bytes(buf)))
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        // SAFETY: closing our own descriptor once.
        unsafe { libc::close(self.exec_error) };
    }
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in argument"))
}

/// Fork a child that will execve `program` with `args` (`args[0]` included) and
/// the current environment, and seize it. The child keeps memptrace's stdin,
/// stdout and stderr. On return the child is running towards execve; the
/// caller's wait loop sees a PTRACE_EVENT_EXEC stop (or the child's exit with
/// status 127 when execve failed, see [`Launched::exec_error`]).
pub fn spawn(program: &Path, args: &[OsString]) -> io::Result<Launched> {
    // Everything the child needs is allocated before fork: after fork, in a
    // multi-threaded parent, the child may only make async-signal-safe calls.
    let path = cstring(program.as_os_str().as_bytes())?;
    let argv_owned: Vec<CString> = args
        .iter()
        .map(|a| cstring(a.as_bytes()))
        .collect::<io::Result<_>>()?;
    let mut argv: Vec<*const libc::c_char> = argv_owned.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());

    let mut fds = [0; 2];
    // SAFETY: pipe2 with a valid array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let [read_end, write_end] = fds;

    // SAFETY: fork; the child branch below only calls async-signal-safe functions.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let err = io::Error::last_os_error();
        // SAFETY: closing our own descriptors.
        unsafe {
            libc::close(read_end);
            libc::close(write_end);
        }
        return Err(err);
    }
    if pid == 0 {
        // SAFETY: async-signal-safe calls only; never returns.
        unsafe { child(&path, &argv, write_end) }
    }
    // SAFETY: closing our copy of the write end.
    unsafe { libc::close(write_end) };
    let launched = Launched {
        pid,
        exec_error: read_end,
    };

    // Wait for the child's self-inflicted SIGSTOP, then seize it while stopped.
    let mut status = 0;
    // SAFETY: waitpid on our own child.
    let ret = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
    if ret != pid || !libc::WIFSTOPPED(status) {
        return Err(io::Error::other("the child did not stop before exec"));
    }
    if let Err(err) = ptrace::seize(pid, ptrace::OPTIONS) {
        // SAFETY: kill our own child, which cannot be traced.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, &mut status, 0);
        }
        return Err(err);
    }
    // End the group-stop; the seized child now reports its stops to us.
    // SAFETY: signal our own child.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    Ok(launched)
}

/// The child side of [`spawn`].
///
/// # Safety
/// Called only in the child right after fork.
unsafe fn child(path: &CString, argv: &[*const libc::c_char], error_fd: libc::c_int) -> ! {
    unsafe {
        // The target must start as it would without memptrace: no signal blocked
        // (the mask survives execve), SIGPIPE at its default (the Rust runtime
        // ignores it, and an ignored signal stays ignored across execve).
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);

        libc::kill(libc::getpid(), libc::SIGSTOP);
        libc::execv(path.as_ptr(), argv.as_ptr());

        let errno = *libc::__errno_location();
        let bytes = errno.to_ne_bytes();
        libc::write(error_fd, bytes.as_ptr().cast(), bytes.len());
        libc::_exit(127);
    }
}
