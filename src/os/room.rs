//! Room kept on the trace database's filesystem for the trace's end.
//!
//! When the disk fills up (or a quota is reached), the database cannot take
//! the rows that end a trace. So the trace starts by taking a few MiB on the
//! same filesystem, in a file that has no name (`O_TMPFILE`, or a name
//! removed at once) and is allocated for real (`fallocate(2)`); dropping it
//! gives the room back for the end rows. Nothing is left behind however
//! memptrace ends: the kernel frees an unnamed file when its last
//! descriptor closes.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// `bytes` allocated on the filesystem of directory `dir`, in a file with no
/// name: held while the value lives.
pub fn keep(dir: &Path, bytes: u64) -> io::Result<File> {
    let file = match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o600)
        .open(dir)
    {
        Ok(file) => file,
        // No O_TMPFILE on this filesystem: a name, removed at once.
        Err(_) => {
            let path = dir.join(format!(".memptrace-room-{}", std::process::id()));
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)?;
            std::fs::remove_file(&path)?;
            file
        }
    };
    let len = i64::try_from(bytes).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    nix::fcntl::fallocate(&file, nix::fcntl::FallocateFlags::empty(), 0, len)?;
    Ok(file)
}

/// Bytes an unprivileged user can still write on the filesystem of `dir`.
pub fn available(dir: &Path) -> io::Result<u64> {
    let stat = nix::sys::statvfs::statvfs(dir)?;
    Ok(stat.blocks_available().saturating_mul(stat.fragment_size()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn the_room_is_allocated_and_has_no_name() {
        let dir = std::env::temp_dir().join(format!("memptrace-room-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let room = keep(&dir, 1 << 20).unwrap();
        let meta = room.metadata().unwrap();
        assert_eq!(meta.len(), 1 << 20);
        // Allocated, not sparse: 512-byte blocks.
        assert!(meta.blocks() * 512 >= 1 << 20, "{} blocks", meta.blocks());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        drop(room);
        std::fs::remove_dir(&dir).unwrap();
    }
}
