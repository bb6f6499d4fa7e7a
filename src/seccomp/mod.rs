//! May memptrace add this system call to that thread? A program under a
//! seccomp filter (browsers, systemd services, OpenSSH, sandboxed workers)
//! is killed, or sees an error, for a call its filter does not allow, and a
//! call memptrace injects, or one its probes make, is no exception. So
//! before adding one, memptrace reads the thread's filters (`os::seccomp`)
//! and runs them here ([`bpf`]) on the exact call it would make.
//!
//! It must never let a call through on a guess: only a call that every
//! filter answers `SECCOMP_RET_ALLOW` (or `SECCOMP_RET_LOG`) for is made;
//! strict mode allows nothing memptrace adds; a filter that cannot be read
//! (no `CAP_SYS_ADMIN`) or that reads a field whose value is not known in
//! advance forbids the call. Pure data: no system call here.

pub mod bpf;

use bpf::{Action, Data, Insn};

/// `AUDIT_ARCH_X86_64`: what `seccomp_data.arch` holds for a 64-bit call.
pub const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;

/// A thread's seccomp state, as memptrace could read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Filters {
    /// Mode 0: any call may be made.
    Off,
    /// Mode 1 (`SECCOMP_MODE_STRICT`): read, write, exit and sigreturn only.
    Strict,
    /// Mode 2: the thread's filters, most recent first.
    Filter(Vec<Vec<Insn>>),
    /// Mode 2, but the filters could not be read (why).
    Unreadable(String),
}

/// One system call as its filter would see it; `None`: not known in
/// advance (a register the probe's code leaves as it finds it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub nr: i64,
    pub args: [Option<u64>; 6],
    /// The address after the `syscall` instruction.
    pub instruction_pointer: Option<u64>,
}

impl Call {
    /// A call with all six argument registers known (an injected call).
    pub fn known(nr: i64, args: [u64; 6], instruction_pointer: u64) -> Call {
        Call {
            nr,
            args: args.map(Some),
            instruction_pointer: Some(instruction_pointer),
        }
    }
}

/// Why a call may not be added.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the thread is in strict seccomp mode, which allows no call memptrace needs")]
    Strict,
    #[error("the thread has a seccomp filter memptrace cannot read ({0}), so {1} may be forbidden")]
    Unreadable(String, &'static str),
    #[error("the thread's seccomp filter answers {action} to {call}")]
    Denied { call: &'static str, action: String },
    #[error("the thread's seccomp filter cannot be evaluated for {0}: {1}")]
    Unknown(&'static str, bpf::BpfError),
}

/// Whether `call` may be made by a thread whose seccomp state is `filters`.
pub fn check(filters: &Filters, call: &Call) -> Result<(), Refusal> {
    let name = name_of(call.nr);
    let programs = match filters {
        Filters::Off => return Ok(()),
        Filters::Strict => return Err(Refusal::Strict),
        Filters::Unreadable(why) => return Err(Refusal::Unreadable(why.clone(), name)),
        Filters::Filter(programs) => programs,
    };
    let data = Data {
        nr: call.nr as i32,
        arch: AUDIT_ARCH_X86_64,
        instruction_pointer: call.instruction_pointer,
        args: call.args,
    };
    let mut results = Vec::with_capacity(programs.len());
    for prog in programs {
        results.push(bpf::run(prog, &data).map_err(|e| Refusal::Unknown(name, e))?);
    }
    match bpf::strictest(results) {
        None => Ok(()),
        Some(ret) if Action::of(ret).allows() => Ok(()),
        Some(ret) => Err(Refusal::Denied {
            call: name,
            action: describe(Action::of(ret)),
        }),
    }
}

/// The action as the kernel's documentation names it.
fn describe(action: Action) -> String {
    match action {
        Action::KillProcess => "SECCOMP_RET_KILL_PROCESS".into(),
        Action::KillThread => "SECCOMP_RET_KILL_THREAD".into(),
        Action::Trap => "SECCOMP_RET_TRAP".into(),
        Action::Errno(e) => format!("SECCOMP_RET_ERRNO({e})"),
        Action::UserNotif => "SECCOMP_RET_USER_NOTIF".into(),
        Action::Trace => "SECCOMP_RET_TRACE".into(),
        Action::Log => "SECCOMP_RET_LOG".into(),
        Action::Allow => "SECCOMP_RET_ALLOW".into(),
        Action::Other(v) => format!("{v:#x}"),
    }
}

/// The name of one of the calls memptrace adds.
pub fn name_of(nr: i64) -> &'static str {
    match nr {
        libc::SYS_memfd_create => "memfd_create",
        libc::SYS_ftruncate => "ftruncate",
        libc::SYS_mmap => "mmap",
        libc::SYS_munmap => "munmap",
        libc::SYS_close => "close",
        libc::SYS_tgkill => "tgkill",
        libc::SYS_futex => "futex",
        _ => "a system call",
    }
}

/// The call a jump probe makes when its ring is full, as its filter sees
/// it (see `tracer::probes::jump::code`): `futex(FUTEX_WAIT)` on the ring's
/// tail for 1 ms. Pointers and the tail's value differ from thread to
/// thread, and so does the probe's address.
pub fn probe_wait() -> Call {
    Call {
        nr: libc::SYS_futex,
        args: [None, Some(0), None, None, Some(0), Some(0)],
        instruction_pointer: None,
    }
}

#[cfg(test)]
mod tests {
    use super::bpf::tests::{jump, stmt};
    use super::*;

    /// `nr == n ? action : ALLOW`.
    fn on(n: i64, action: u32) -> Vec<Insn> {
        vec![
            stmt(0x20, 0),
            jump(0x15, n as u32, 0, 1),
            stmt(0x06, action),
            stmt(0x06, 0x7fff_0000),
        ]
    }

    fn memfd() -> Call {
        Call::known(libc::SYS_memfd_create, [0x1000, 1, 0, 0, 0, 0], 0x7000)
    }

    #[test]
    fn modes_and_filters() {
        assert_eq!(check(&Filters::Off, &memfd()), Ok(()));
        assert_eq!(check(&Filters::Strict, &memfd()), Err(Refusal::Strict));
        assert_eq!(
            check(&Filters::Unreadable("EPERM".into()), &memfd()),
            Err(Refusal::Unreadable("EPERM".into(), "memfd_create"))
        );
        let filters = Filters::Filter(vec![
            on(libc::SYS_tgkill, 0x7ffc_0000),
            on(libc::SYS_memfd_create, 0x0005_0001),
        ]);
        assert_eq!(
            check(&filters, &memfd()),
            Err(Refusal::Denied {
                call: "memfd_create",
                action: "SECCOMP_RET_ERRNO(1)".into()
            })
        );
        // LOG lets the call through.
        let tgkill = Call::known(libc::SYS_tgkill, [1, 2, 17, 0, 0, 0], 0x7000);
        assert_eq!(check(&filters, &tgkill), Ok(()));
        assert_eq!(
            check(
                &Filters::Filter(vec![on(libc::SYS_tgkill, 0x8000_0000)]),
                &tgkill
            )
            .unwrap_err()
            .to_string(),
            "the thread's seccomp filter answers SECCOMP_RET_KILL_PROCESS to tgkill"
        );
    }

    #[test]
    fn a_filter_reading_an_unknown_field_forbids_the_call() {
        // Allow futex only with args[0] == 0: the probe's address is not known.
        let prog = vec![
            stmt(0x20, 16),
            Insn {
                code: 0x15,
                jt: 0,
                jf: 1,
                k: 0,
            },
            stmt(0x06, 0x7fff_0000),
            stmt(0x06, 0),
        ];
        let got = check(&Filters::Filter(vec![prog]), &probe_wait());
        assert_eq!(
            got,
            Err(Refusal::Unknown("futex", bpf::BpfError::Unknown("args[0]")))
        );
    }
}
