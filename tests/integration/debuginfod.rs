//! Debug files from a debuginfod server: elfutils' `debuginfod` started here,
//! on this machine, serving the debug file of a stripped static tracee
//! (`split/deep.debug`, by its build-id). The stripped tracee traced with
//! `DEBUGINFOD_URLS` pointing at it names its frames as the unstripped build
//! does; a second run with the server stopped is served from the client
//! cache; a server that cannot be reached, or never answers, costs one
//! warning line and the trace goes on.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{Child, Trace, Variant, memptrace, open_trace, run, scratch, tracee};

/// How long the server may take to index its directory.
const INDEX_LIMIT: Duration = Duration::from_secs(60);

/// A port nothing listens on (bound, then released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// elfutils' `debuginfod` serving the ELF and DWARF files of a directory on
/// a port of 127.0.0.1; killed on drop.
struct Server {
    _child: Child,
    url: String,
}

impl Server {
    /// Start it and wait until it serves the debug file of `build_id`.
    fn start(files: &Path, work: &Path, build_id: &str) -> Server {
        let port = free_port();
        let log = std::fs::File::create(work.join("debuginfod.log")).unwrap();
        let child = Command::new("debuginfod")
            .arg("-p")
            .arg(port.to_string())
            .arg("-d")
            .arg(work.join("debuginfod.sqlite"))
            .args(["-t", "0", "-g", "0", "-F"])
            .arg(files)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start debuginfod: {e} (scripts/deps installs it)"));
        let server = Server {
            _child: Child(child),
            url: format!("http://127.0.0.1:{port}"),
        };
        let start = Instant::now();
        while http_status(port, &format!("/buildid/{build_id}/debuginfo")) != Some(200) {
            assert!(
                start.elapsed() < INDEX_LIMIT,
                "debuginfod did not serve {build_id} within {INDEX_LIMIT:?}: {}",
                std::fs::read_to_string(work.join("debuginfod.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }
}

/// The status code of an HTTP GET of `path` on 127.0.0.1:`port`.
fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let head = String::from_utf8_lossy(&response[..response.len().min(64)]).into_owned();
    head.split_whitespace().nth(1)?.parse().ok()
}

/// Trace `program` with the debuginfod variables given (and no other); its
/// stderr must be `stderr` exactly, and the trace sound.
fn trace_with(program: &Path, urls: &str, cache: &Path, stderr: &str) -> Trace {
    let dir = scratch("debuginfod-trace");
    let path = dir.join("trace.db");
    let out = run(
        memptrace()
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("DEBUGINFOD_TIMEOUT")
            .env("DEBUGINFOD_URLS", urls)
            .env("DEBUGINFOD_CACHE_PATH", cache)
            .arg("-o")
            .arg(&path)
            .arg("--")
            .arg(program),
        b"",
    );
    let mut t = open_trace(&path, out);
    assert_eq!(t.run.stderr, stderr);
    t.run.stderr.clear();
    t.assert_sound();
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    t
}

/// The frames in `program`'s own code: offset in the image, function, file
/// and line, sorted.
type Frame = (i64, Option<String>, Option<String>, Option<i64>);

fn frames_of(t: &Trace, program: &Path) -> Vec<Frame> {
    let mut stmt =
        t.db.prepare(
            "SELECT DISTINCT f.ip - m.base, f.function, f.file, f.line
             FROM frames f JOIN modules m ON m.id = f.module_id
             WHERE m.path = ?1 ORDER BY 1",
        )
        .unwrap();
    let frames: Vec<Frame> = stmt
        .query_map([program.to_str().unwrap()], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(!frames.is_empty(), "no frame in {program:?}");
    frames
}

fn build_id_of(t: &Trace, program: &Path) -> String {
    t.db.query_row(
        "SELECT build_id FROM modules WHERE path = ?1",
        [program.to_str().unwrap()],
        |r| r.get(0),
    )
    .unwrap_or_else(|e| panic!("no build-id for {program:?}: {e}"))
}

/// The stripped binary's frames `got` are those of its run without debug
/// file (`unnamed`: the same addresses), each named exactly as the
/// unstripped build names it (`expected`; that build hooks a few more
/// functions by their symbols, so it has a few more frames).
fn assert_named_as(got: &[Frame], unnamed: &[Frame], expected: &[Frame]) {
    let offsets = |frames: &[Frame]| frames.iter().map(|f| f.0).collect::<Vec<_>>();
    assert_eq!(offsets(got), offsets(unnamed));
    for frame in got {
        assert!(expected.contains(frame), "{frame:?} not in {expected:?}");
    }
}

/// An empty directory for a client cache.
fn empty_cache(work: &Path, name: &str) -> PathBuf {
    let cache = work.join(name);
    std::fs::create_dir_all(&cache).unwrap();
    cache
}

#[test]
fn stripped_binary_named_from_a_debuginfod_server() {
    let variant = Variant::Static;
    let unstripped = tracee(variant, "deep");
    let stripped = tracee(variant, "stripped-deep");
    let work = scratch("debuginfod");

    // What the unstripped build's frames are called.
    let reference = trace_with(&unstripped, "", &empty_cache(&work, "unused"), "");
    let expected = frames_of(&reference, &unstripped);
    assert!(
        expected
            .iter()
            .any(|(_, f, file, line)| f.as_deref() == Some("deep_inner")
                && file.as_deref().is_some_and(|f| f.ends_with("deep.c"))
                && line.is_some()),
        "{expected:?}"
    );
    let build_id = build_id_of(&reference, &unstripped);

    // No server listens: one warning (also in `meta`), the trace goes on,
    // its frames unnamed (nothing on disk names them).
    let down = format!("http://127.0.0.1:{}", free_port());
    let cache = empty_cache(&work, "cache-down");
    let warning = format!(
        "memptrace: warning: debuginfod server {down} failed (Connection refused): no debug file was downloaded after that, the client cache was read\n"
    );
    let t = trace_with(&stripped, &down, &cache, &warning);
    assert_eq!(
        t.meta("warning.1")
            .map(|w| format!("memptrace: warning: {w}\n")),
        Some(warning)
    );
    let unnamed = frames_of(&t, &stripped);
    assert!(
        unnamed
            .iter()
            .all(|(_, f, file, _)| f.is_none() && file.is_none()),
        "{unnamed:?}"
    );

    // The server has the debug file: the frames are named as the
    // unstripped build's, and the file is in the empty cache given.
    let served = work.join("served");
    std::fs::create_dir_all(&served).unwrap();
    std::fs::copy(
        stripped.with_file_name("split").join("deep.debug"),
        served.join("deep.debug"),
    )
    .unwrap();
    let cache = empty_cache(&work, "cache");
    let server = Server::start(&served, &work, &build_id);
    let t = trace_with(&stripped, &server.url, &cache, "");
    assert_named_as(&frames_of(&t, &stripped), &unnamed, &expected);
    t.assert_truth();
    t.assert_deep_stacks("from the server");
    let downloaded = cache.join(&build_id).join("debuginfo");
    assert_eq!(
        std::fs::read(&downloaded).unwrap(),
        std::fs::read(served.join("deep.debug")).unwrap()
    );

    // The server stopped: the cache serves the same names, without a word.
    let url = server.url.clone();
    drop(server);
    assert_eq!(
        http_status(url.rsplit(':').next().unwrap().parse().unwrap(), "/"),
        None
    );
    let t = trace_with(&stripped, &url, &cache, "");
    assert_named_as(&frames_of(&t, &stripped), &unnamed, &expected);
    t.assert_truth();
    t.assert_deep_stacks("from the cache");
}

/// A server that takes connections and never answers (a listening socket
/// nobody accepts on: the kernel completes the handshakes) is given up
/// after memptrace's limit on the first byte, as `DEBUGINFOD_TIMEOUT` is
/// not set: one warning, the trace goes on.
#[test]
fn a_server_that_never_answers_is_given_up() {
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let stripped = tracee(Variant::Static, "stripped-deep");
    let cache = empty_cache(&scratch("debuginfod-silent"), "cache");
    let warning = format!(
        "memptrace: warning: debuginfod server {url} failed (no answer within 10 s): no debug file was downloaded after that, the client cache was read\n"
    );
    let t = trace_with(&stripped, &url, &cache, &warning);
    let frames = frames_of(&t, &stripped);
    assert!(frames.iter().all(|(_, f, _, _)| f.is_none()), "{frames:?}");
    drop(silent);
}
