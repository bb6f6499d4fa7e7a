//! The program to launch: found like a shell would find it, and refused
//! before anything starts if memptrace cannot trace it.

use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::symbols::elf::{ElfError, check_header};
use crate::symbols::locate;

/// Resolve `name` like execvp: a name with a slash is a path, anything else
/// is looked up in PATH.
pub fn resolve(name: &OsStr) -> Result<PathBuf, Error> {
    let path = Path::new(name);
    if name.as_encoded_bytes().contains(&b'/') {
        return if path.exists() {
            Ok(path.to_path_buf())
        } else {
            Err(Error::NoSuchFile(path.to_path_buf()))
        };
    }
    let search = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&search)
        .map(|dir| dir.join(path))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| Error::ProgramNotFound(path.display().to_string()))
}

/// Refuse what cannot be traced: not executable, not an x86-64 ELF (a `#!`
/// script is fine: the kernel runs its interpreter, which memptrace traces),
/// or a static executable whose allocator memptrace cannot find (no symbol,
/// no debug file, and no signature set matches its code).
pub fn check(path: &Path) -> Result<(), Error> {
    let not_exec = |reason: &str| Error::NotExecutable {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let meta = fs::metadata(path).map_err(|e| not_exec(&e.to_string()))?;
    if meta.is_dir() {
        return Err(not_exec("it is a directory"));
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err(not_exec("no execute permission"));
    }
    let mut head = [0u8; 64];
    let n = fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .map_err(|e| not_exec(&e.to_string()))?;
    let head = &head[..n];
    if head.starts_with(b"#!") {
        return Ok(());
    }
    check_header(head).map_err(|e| elf_error(path, e))?;
    let bytes = fs::read(path).map_err(|e| not_exec(&e.to_string()))?;
    check_image(path, &bytes)
}

/// Refuse an ELF image memptrace could not hook: not x86-64, or a static
/// executable without a single allocator function to hook. `path` names it
/// in the error; `bytes` is its content (a running process's image is read
/// through /proc/PID/exe, which works for deleted files too).
pub fn check_image(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    check_header(bytes).map_err(|e| elf_error(path, e))?;
    let image = locate::load(&path.display().to_string(), bytes).map_err(|e| elf_error(path, e))?;
    if image.is_static_exe && image.allocators.is_empty() {
        return Err(Error::NoAllocator {
            path: path.to_path_buf(),
            tried: image.signature_sets.join("; "),
        });
    }
    Ok(())
}

/// The interpreter a `#!` script names (its first word), if `path` is one.
pub fn interpreter(path: &Path) -> Option<String> {
    let mut head = [0u8; 256];
    let n = fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = line.split(|&b| b == b'\n').next()?;
    let text = String::from_utf8_lossy(line);
    text.split_whitespace().next().map(str::to_string)
}

fn elf_error(path: &Path, err: ElfError) -> Error {
    let path = path.to_path_buf();
    match err {
        ElfError::NotElf => Error::NotElf(path),
        ElfError::Not64Bit => Error::Not64Bit(path),
        other => Error::WrongMachine {
            path,
            reason: other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_programs_in_path() {
        let sh = resolve(OsStr::new("sh")).unwrap();
        assert!(sh.is_absolute());
        assert!(matches!(
            resolve(OsStr::new("no-such-program-memptrace")),
            Err(Error::ProgramNotFound(_))
        ));
        assert!(matches!(
            resolve(OsStr::new("./no/such/file")),
            Err(Error::NoSuchFile(_))
        ));
        assert!(matches!(
            resolve(OsStr::new("/no/such/program")),
            Err(Error::NoSuchFile(_))
        ));
    }

    #[test]
    fn accepts_elf_programs_and_refuses_the_rest() {
        check(Path::new("/bin/true")).unwrap();
        assert!(matches!(
            check(Path::new("/etc")),
            Err(Error::NotExecutable { .. })
        ));
        let dir = std::env::temp_dir().join(format!("memptrace-program-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let text = dir.join("notes.txt");
        fs::write(&text, "hello\n").unwrap();
        fs::set_permissions(&text, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(check(&text), Err(Error::NotExecutable { .. })));
        fs::set_permissions(&text, fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(check(&text), Err(Error::NotElf(_))));
        assert_eq!(interpreter(&text), None);
        fs::write(&text, "#!/no/such/interpreter -x\necho hi\n").unwrap();
        assert_eq!(interpreter(&text).as_deref(), Some("/no/such/interpreter"));
        fs::write(&text, "#! /bin/sh").unwrap();
        assert_eq!(interpreter(&text).as_deref(), Some("/bin/sh"));
        fs::remove_dir_all(&dir).unwrap();
    }
}
