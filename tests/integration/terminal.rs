//! memptrace on a terminal of 40 columns, as a pseudo-terminal the test
//! reads every byte of: a launched program's output arrives exactly as the
//! program wrote it (no progress line drawn over it, none left between its
//! lines), followed by where the trace went; an attach draws its progress line when the process writes
//! elsewhere, never wider than the terminal, and nothing when the process
//! writes to that same terminal.

use std::fs::File;
use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{Background, Child, Variant, memptrace, scratch, tracee};

const COLUMNS: u16 = 40;

/// A pseudo-terminal of [`COLUMNS`] x 20; everything written to it is
/// collected from its master side.
struct Pty {
    slave: OwnedFd,
    output: Arc<Mutex<Vec<u8>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Pty {
    fn open() -> Pty {
        // Both ends close-on-exec from the start (posix_openpt and open with
        // O_CLOEXEC, not openpty): a process another test spawns meanwhile
        // must not inherit them, or the terminal would stay open after the
        // test's own processes end.
        let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
        // SAFETY: posix_openpt(3), grantpt, unlockpt, ptsname_r with a
        // buffer of the size given; open(2) of the name it wrote; ioctl
        // TIOCSWINSZ with a valid winsize. Every fd is checked, then owned.
        let (master, slave) = unsafe {
            let master = libc::posix_openpt(flags);
            assert!(
                master >= 0,
                "posix_openpt: {}",
                std::io::Error::last_os_error()
            );
            assert_eq!(libc::grantpt(master), 0);
            assert_eq!(libc::unlockpt(master), 0);
            let mut name = [0 as libc::c_char; 128];
            assert_eq!(libc::ptsname_r(master, name.as_mut_ptr(), name.len()), 0);
            let slave = libc::open(name.as_ptr(), flags);
            assert!(
                slave >= 0,
                "open the pty: {}",
                std::io::Error::last_os_error()
            );
            let size = libc::winsize {
                ws_row: 20,
                ws_col: COLUMNS,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            assert_eq!(libc::ioctl(master, libc::TIOCSWINSZ, &size), 0);
            (File::from_raw_fd(master), OwnedFd::from_raw_fd(slave))
        };
        let output = Arc::new(Mutex::new(Vec::new()));
        let sink = output.clone();
        let reader = std::thread::spawn(move || {
            let mut master = master;
            let mut buf = [0u8; 4096];
            // EIO once every slave descriptor is closed.
            while let Ok(n) = master.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Pty {
            slave,
            output,
            reader: Some(reader),
        }
    }

    fn stdio(&self) -> Stdio {
        Stdio::from(self.slave.try_clone().unwrap())
    }

    /// `cmd` with stdin, stdout and stderr on the terminal.
    fn attach(&self, cmd: &mut Command) {
        cmd.stdin(self.stdio())
            .stdout(self.stdio())
            .stderr(self.stdio());
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// Wait until the terminal shows something `cond` accepts.
    fn wait_for(&self, what: &str, cond: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !cond(&self.text()) {
            assert!(
                Instant::now() < deadline,
                "the terminal never showed {what}: {:?}",
                tail(&self.text())
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Everything written to the terminal, once nobody has it open any more.
    fn close(mut self) -> String {
        drop(self.slave);
        if let Some(reader) = self.reader.take() {
            reader.join().unwrap();
        }
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }
}

/// Start `cmd`, and drop it: it holds copies of the terminal's descriptor.
fn spawn(mut cmd: Command) -> Child {
    Child(cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}")))
}

/// Wait for a child within the time limit.
fn wait(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "memptrace did not end");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The end of a long output, for a message.
fn tail(text: &str) -> &str {
    let start = text.char_indices().rev().nth(600).map_or(0, |(i, _)| i);
    &text[start..]
}

/// The text of each line as the terminal shows it: split at line ends and
/// carriage returns, with the escape sequences (`ESC [ ... letter`) removed.
fn visible_lines(text: &str) -> Vec<String> {
    let escape = regex::Regex::new(r"\x1b\[[0-9;?]*[A-Za-z]").unwrap();
    escape
        .replace_all(text, "")
        .split(['\r', '\n'])
        .map(str::to_string)
        .collect()
}

/// A program printing five lines over about a second and a half, launched
/// under memptrace: the terminal receives its lines, byte for byte, and
/// after them the one line where memptrace says where the trace is and how
/// to read it (before, a progress line was drawn every 200 ms and redrawn
/// by moving up and erasing, which took the program's lines with it).
#[test]
fn launch_leaves_the_programs_lines_alone() {
    let pty = Pty::open();
    let db = scratch("pty-launch").join("trace.db");
    let mut cmd = memptrace();
    cmd.arg("-o").arg(&db).args([
        "--",
        "sh",
        "-c",
        "for i in 1 2 3 4 5; do echo line $i; sleep 0.3; done",
    ]);
    pty.attach(&mut cmd);
    let mut child = spawn(cmd);
    let status = wait(&mut child);
    drop(child);
    let text = pty.close();
    assert_eq!(status.code(), Some(0), "{text:?}");
    assert_eq!(
        text,
        format!(
            "line 1\r\nline 2\r\nline 3\r\nline 4\r\nline 5\r\n\
             memptrace: trace written to {db}; read it with: memptrace report {db}\r\n",
            db = db.display()
        ),
        "the terminal shows the program's lines, then where the trace is"
    );
}

/// Attached to a process whose output goes to a pipe, memptrace draws its
/// progress line on its terminal, never wider than the terminal.
#[test]
fn attach_draws_progress_within_the_terminal() {
    let mut victim = Background::start(Command::new(tracee(Variant::Dynamic, "victim")).arg("2"));
    let pid = victim.wait_for("ready");
    let pty = Pty::open();
    let db = scratch("pty-attach").join("trace.db");
    let mut cmd = memptrace();
    cmd.arg("-o").arg(&db).args(["attach", &pid]);
    pty.attach(&mut cmd);
    let mut child = spawn(cmd);
    // At 40 columns the line is cut: "⠁ memptrace: 9,705 events, 48,498/s, 6.7".
    pty.wait_for("a progress line", |text| text.contains(" events, "));
    crate::support::signal(child.0.id() as i32, libc::SIGINT);
    let status = wait(&mut child);
    drop(child);
    let text = pty.close();
    assert_eq!(status.code(), Some(0), "{text:?}");
    // memptrace's one warning line, with int3 probes, is not a progress line.
    for line in visible_lines(&crate::support::without_death_warning(&text)) {
        assert!(
            line.chars().count() <= COLUMNS as usize,
            "{} columns: {line:?} in {:?}",
            line.chars().count(),
            tail(&text)
        );
    }
    victim.signal(libc::SIGTERM);
    let end = victim.finish();
    assert_eq!(end.code(), 0, "{}{}", end.stdout, end.stderr);
}

/// Attached to a process that writes to the same terminal, memptrace draws
/// nothing: the terminal shows the process's own lines only.
#[test]
fn attach_to_a_process_on_the_same_terminal_draws_nothing() {
    let pty = Pty::open();
    let mut cmd = Command::new(tracee(Variant::Dynamic, "victim"));
    cmd.arg("2");
    pty.attach(&mut cmd);
    let mut victim = spawn(cmd);
    let pid = victim.0.id();
    pty.wait_for("the victim's ready line", |text| text.contains("ready"));
    let db = scratch("pty-same").join("trace.db");
    let mut tracer = memptrace();
    // memptrace's own stderr is that terminal too; --duration ends it after
    // several redraws of a progress line would have happened.
    tracer
        .arg("-o")
        .arg(&db)
        .args(["attach", &pid.to_string(), "--duration", "1"]);
    pty.attach(&mut tracer);
    let mut tracer = spawn(tracer);
    let status = wait(&mut tracer);
    assert_eq!(status.code(), Some(0));
    crate::support::signal(pid as i32, libc::SIGTERM);
    let victim_status = wait(&mut victim);
    drop(victim);
    drop(tracer);
    let text = pty.close();
    assert_eq!(victim_status.code(), Some(0), "{text:?}");
    // memptrace's one warning line, with int3 probes, is not drawing.
    let drawn = crate::support::without_death_warning(&text);
    assert!(
        !drawn.contains('\x1b') && !drawn.contains("memptrace"),
        "memptrace drew on the process's terminal: {text:?}"
    );
    assert!(text.starts_with(&format!("ready {pid}\r\n")), "{text:?}");
    assert!(text.contains("0 damaged"), "{text:?}");
}
