//! Finding an image's separate debug file, the way gdb does ("Debugging
//! Information in Separate Files" in the gdb manual): Debian's `-dbgsym` and
//! `-dbg` packages install DWARF for stripped libraries under
//! `/usr/lib/debug`.
//!
//! A debug file is only used when it belongs to the image: its build-id must
//! match, and a file found through `.gnu_debuglink` must have the CRC-32 the
//! link records. A wrong debug file would name every frame wrongly, which is
//! worse than naming none.

use std::path::{Path, PathBuf};

use super::objinfo::{AltLink, DebugLink, ObjectInfo, read_for_info, read_regular_file};
use crate::symbols::debuginfod::Fetcher;

/// A debug file that belongs to the image.
#[derive(Debug)]
pub struct DebugFile {
    pub path: PathBuf,
    pub info: ObjectInfo,
}

/// `<root>/.build-id/ab/cdef….debug` for build-id `abcdef…`.
fn build_id_path(root: &Path, build_id: &str) -> Option<PathBuf> {
    if build_id.len() < 3 || !build_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let id = build_id.to_ascii_lowercase();
    Some(
        root.join(".build-id")
            .join(&id[..2])
            .join(format!("{}.debug", &id[2..])),
    )
}

/// False only when both build-ids are known and differ.
pub fn same_build(a: Option<&str>, b: Option<&str>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.eq_ignore_ascii_case(b),
        _ => true,
    }
}

/// The image's debug file: by build-id, else by `.gnu_debuglink`.
pub fn find(
    image: &Path,
    build_id: Option<&str>,
    link: Option<&DebugLink>,
    roots: &[PathBuf],
) -> Option<DebugFile> {
    build_id
        .and_then(|id| by_build_id(roots, id))
        .or_else(|| by_debuglink(image, build_id, link?, roots))
}

/// The debug file named by the image's build-id under one of `roots`.
pub fn by_build_id(roots: &[PathBuf], build_id: &str) -> Option<DebugFile> {
    roots.iter().find_map(|root| {
        let path = build_id_path(root, build_id)?;
        let info = ObjectInfo::parse(&read_for_info(&path)?)?;
        same_build(info.build_id.as_deref(), Some(build_id)).then_some(DebugFile { path, info })
    })
}

/// The debug file of `build_id` from a debuginfod server or its client
/// cache: the last place to look. The file is the server's word, so it is
/// used only when it carries that very build-id.
pub fn from_server(fetcher: &mut Fetcher, build_id: &str) -> Option<DebugFile> {
    let path = fetcher.debuginfo(build_id)?;
    let info = ObjectInfo::parse(&read_for_info(&path)?)?;
    let ours = info
        .build_id
        .as_deref()
        .is_some_and(|id| id.eq_ignore_ascii_case(build_id));
    ours.then_some(DebugFile { path, info })
}

/// The debug file named by the image's `.gnu_debuglink`, looked for in the
/// image's directory, its `.debug/` subdirectory, and the image's directory
/// under each of `roots`; the first with the right CRC wins.
pub fn by_debuglink(
    image: &Path,
    image_build_id: Option<&str>,
    link: &DebugLink,
    roots: &[PathBuf],
) -> Option<DebugFile> {
    let real = std::fs::canonicalize(image).unwrap_or_else(|_| image.to_path_buf());
    let dir = real.parent()?;
    let mut candidates = vec![dir.join(&link.name), dir.join(".debug").join(&link.name)];
    let relative_dir = dir.strip_prefix("/").unwrap_or(dir);
    candidates.extend(
        roots
            .iter()
            .map(|root| root.join(relative_dir).join(&link.name)),
    );
    candidates.into_iter().find_map(|path| {
        // A link naming the image itself (a file that was not stripped).
        if std::fs::canonicalize(&path).is_ok_and(|p| p == real) {
            return None;
        }
        let bytes = read_regular_file(&path)?;
        if crc32fast::hash(&bytes) != link.crc {
            return None;
        }
        let info = ObjectInfo::parse(&bytes)?;
        same_build(info.build_id.as_deref(), image_build_id).then_some(DebugFile { path, info })
    })
}

/// The `dwz` supplementary file that `debug_file`'s `.gnu_debugaltlink`
/// names: the path as written (relative to `debug_file`'s directory when not
/// absolute), else by its build-id under `roots`. Only a file with the
/// build-id the link records.
pub fn supplementary(debug_file: &Path, link: &AltLink, roots: &[PathBuf]) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if link.path.is_absolute() {
        candidates.push(link.path.clone());
    } else {
        let real = std::fs::canonicalize(debug_file).unwrap_or_else(|_| debug_file.to_path_buf());
        if let Some(dir) = real.parent() {
            candidates.push(dir.join(&link.path));
        }
    }
    candidates.extend(
        roots
            .iter()
            .filter_map(|root| build_id_path(root, &link.build_id)),
    );
    candidates.into_iter().find(|path| {
        read_for_info(path)
            .and_then(|bytes| ObjectInfo::parse(&bytes))
            .is_some_and(|info| {
                info.has_dwarf && same_build(info.build_id.as_deref(), Some(&link.build_id))
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_id_paths() {
        assert_eq!(
            build_id_path(Path::new("/usr/lib/debug"), "93AC61ec5a"),
            Some(PathBuf::from("/usr/lib/debug/.build-id/93/ac61ec5a.debug"))
        );
        assert_eq!(build_id_path(Path::new("/d"), "ab"), None);
        assert_eq!(build_id_path(Path::new("/d"), "../../etc/x"), None);
    }

    #[test]
    fn missing_files_are_not_found() {
        let roots = vec![PathBuf::from("/nonexistent/memptrace-debug")];
        assert!(by_build_id(&roots, "0123456789abcdef").is_none());
        let link = DebugLink {
            name: "nothing-here.debug".into(),
            crc: 0,
        };
        assert!(by_debuglink(Path::new("/nonexistent/prog"), None, &link, &roots).is_none());
    }
}
