//! One command, timed by GNU time: its wall time, the CPU time of it and
//! the children it waited for, and its peak resident set.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

/// What one command cost.
#[derive(Clone, Debug, Default)]
pub struct Timed {
    pub wall_s: f64,
    /// User + system CPU of the command and the children it waited for.
    pub cpu_s: f64,
    /// The largest resident set of the command or one of those children.
    pub max_rss_kib: u64,
    pub stdout: String,
}

/// Run `program args` under `/usr/bin/time`, its stdout kept (and checked
/// to be a success), its stderr in `scratch/stderr`.
pub fn timed(
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    scratch: &Path,
) -> Result<Timed, String> {
    std::fs::create_dir_all(scratch).map_err(|e| e.to_string())?;
    let figures = scratch.join("time");
    let stderr = scratch.join("stderr");
    let started = Instant::now();
    let out = Command::new("/usr/bin/time")
        .arg("-f")
        .arg("%U %S %M")
        .arg("-o")
        .arg(&figures)
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        .env_remove("MEMPTRACE_PROBES")
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(&stderr).map_err(|e| e.to_string())?)
        .output()
        .map_err(|e| format!("/usr/bin/time (scripts/deps installs it): {e}"))?;
    let wall_s = started.elapsed().as_secs_f64();
    if !out.status.success() {
        let why = std::fs::read_to_string(&stderr).unwrap_or_default();
        return Err(format!(
            "{} {} failed ({}): {}",
            program.display(),
            args.join(" "),
            out.status,
            why.lines().last().unwrap_or("")
        ));
    }
    let text = std::fs::read_to_string(&figures).map_err(|e| e.to_string())?;
    // GNU time may write a line about the command's status before its own.
    let last = text.lines().last().unwrap_or("");
    let fields: Vec<f64> = last
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|_| format!("/usr/bin/time wrote {last:?}"))?;
    let [user, system, rss] = fields[..] else {
        return Err(format!("/usr/bin/time wrote {last:?}"));
    };
    Ok(Timed {
        wall_s,
        cpu_s: user + system,
        max_rss_kib: rss as u64,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
    })
}

/// The number after `key` on the line of `text` that starts with `key`.
pub fn figure(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}
