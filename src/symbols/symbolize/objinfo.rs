//! What the symbolizer needs from one ELF file (an image or its debug file):
//! its build-id, whether it carries DWARF, where its debug data lives
//! elsewhere, and its function symbols. Read once with goblin, kept as owned
//! data; the file's bytes are dropped afterwards (addr2line maps the file with
//! the DWARF itself).
//!
//! Never fails loudly: a file that is missing, not a regular file, or not an
//! ELF file simply has no info.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use goblin::elf::{Elf, section_header, sym};

use super::symtab::{AliasRank, Binding, FuncSymbol, split_version};
use crate::symbols::elf::{build_id, check_header};

/// `.gnu_debuglink`: the file name of the debug file and the CRC-32 of its
/// whole contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DebugLink {
    pub name: PathBuf,
    pub crc: u32,
}

/// `.gnu_debugaltlink`: the supplementary file that `dwz -m` moved shared
/// DWARF into, and its build-id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AltLink {
    pub path: PathBuf,
    pub build_id: String,
}

#[derive(Debug, Default)]
pub struct ObjectInfo {
    pub build_id: Option<String>,
    /// A `.debug_info` with contents (not the NOBITS placeholder a stripped
    /// file can keep).
    pub has_dwarf: bool,
    pub debuglink: Option<DebugLink>,
    pub altlink: Option<AltLink>,
    pub symbols: Vec<FuncSymbol>,
}

/// The bytes of a regular file; None for anything else (a directory, a FIFO
/// that would block, `/dev/zero` that would never end).
pub fn read_regular_file(path: &Path) -> Option<Vec<u8>> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() {
        return None;
    }
    std::fs::read(path).ok()
}

/// Files below this size are read whole.
const SPARSE_FROM: u64 = 1 << 20;

/// The bytes of the regular file at `path` that [`ObjectInfo::parse`]
/// reads, at their offsets in a buffer of the file's size: its headers,
/// the sections that name things (symbols, strings, notes, hashes,
/// versions, dynamic, links) and the segments that locate them. The rest
/// (code, data, DWARF) is never read, and the buffer's pages there never
/// touched: a zeroed allocation this large is fresh pages, which take no
/// memory until written. node's executable is 99 MB, of which naming it
/// reads a few. A small file, or one whose headers cannot be read so, is
/// read whole.
pub fn read_for_info(path: &Path) -> Option<Vec<u8>> {
    use goblin::container::Ctx;
    use goblin::elf::{Elf, ProgramHeader, SectionHeader, program_header};
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path).ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() {
        return None;
    }
    let whole = || read_regular_file(path);
    let Ok(len) = usize::try_from(meta.len()) else {
        return whole();
    };
    if meta.len() < SPARSE_FROM {
        return whole();
    }
    let mut bytes = vec![0u8; len];
    let read = |bytes: &mut Vec<u8>, at: u64, size: u64| -> Option<()> {
        let start = usize::try_from(at).ok()?;
        let end = start.checked_add(usize::try_from(size).ok()?)?;
        file.read_exact_at(bytes.get_mut(start..end)?, at).ok()
    };
    read(&mut bytes, 0, 64)?;
    let header = Elf::parse_header(&bytes).ok()?;
    let ctx = Ctx::new(header.container().ok()?, header.endianness().ok()?);
    let table = |offset: u64, count: u16, size: u16| (offset, u64::from(count) * u64::from(size));
    let (ph_at, ph_size) = table(header.e_phoff, header.e_phnum, header.e_phentsize);
    let (sh_at, sh_size) = table(header.e_shoff, header.e_shnum, header.e_shentsize);
    // Extended numbering (the section count or the names' index kept in
    // the first section header) is left to the whole file's parse.
    let extended = header.e_shnum == 0 || header.e_shstrndx >= header.e_shnum;
    if extended
        || read(&mut bytes, ph_at, ph_size).is_none()
        || read(&mut bytes, sh_at, sh_size).is_none()
    {
        return whole();
    }
    let tables = ProgramHeader::parse(&bytes, ph_at as usize, usize::from(header.e_phnum), ctx)
        .and_then(|ph| {
            SectionHeader::parse(&bytes, sh_at as usize, usize::from(header.e_shnum), ctx)
                .map(|sh| (ph, sh))
        });
    let Ok((segments, sections)) = tables else {
        return whole();
    };
    let mut parts: Vec<(u64, u64)> = segments
        .iter()
        .filter(|ph| {
            matches!(
                ph.p_type,
                program_header::PT_DYNAMIC | program_header::PT_INTERP | program_header::PT_NOTE
            )
        })
        .map(|ph| (ph.p_offset, ph.p_filesz))
        .collect();
    let named = |sh: &SectionHeader| {
        matches!(
            sh.sh_type,
            section_header::SHT_SYMTAB
                | section_header::SHT_DYNSYM
                | section_header::SHT_STRTAB
                | section_header::SHT_NOTE
                | section_header::SHT_DYNAMIC
                | section_header::SHT_HASH
                | section_header::SHT_GNU_HASH
                | section_header::SHT_GNU_VERSYM
                | section_header::SHT_GNU_VERDEF
                | section_header::SHT_GNU_VERNEED
                | section_header::SHT_SYMTAB_SHNDX
        )
    };
    parts.extend(
        sections
            .iter()
            .filter(|sh| sh.sh_type != section_header::SHT_NOBITS && named(sh))
            .map(|sh| (sh.sh_offset, sh.sh_size)),
    );
    for (at, size) in parts {
        if read(&mut bytes, at, size).is_none() {
            return whole();
        }
    }
    // The links are PROGBITS sections known by their names, which are in
    // the string table just read.
    let names = sections
        .get(usize::from(header.e_shstrndx))
        .map(|sh| sh.sh_offset);
    let name_of = |sh: &SectionHeader| {
        let at = usize::try_from(names?).ok()?.checked_add(sh.sh_name)?;
        let tail = bytes.get(at..)?;
        Some(&tail[..tail.iter().position(|&b| b == 0)?])
    };
    let links: Vec<(u64, u64)> = sections
        .iter()
        .filter(|sh| {
            matches!(
                name_of(sh),
                Some(b".gnu_debuglink" | b".gnu_debugaltlink" | b".interp")
            )
        })
        .map(|sh| (sh.sh_offset, sh.sh_size))
        .collect();
    for (at, size) in links {
        if read(&mut bytes, at, size).is_none() {
            return whole();
        }
    }
    Some(bytes)
}

impl ObjectInfo {
    pub fn parse(bytes: &[u8]) -> Option<ObjectInfo> {
        check_header(bytes).ok()?;
        let elf = Elf::parse(bytes).ok()?;
        let section = |name: &str| {
            elf.section_headers.iter().find(|sh| {
                sh.sh_type != section_header::SHT_NOBITS
                    && sh.sh_size > 0
                    && elf.shdr_strtab.get_at(sh.sh_name) == Some(name)
            })
        };
        let section_data = |name: &str| bytes.get(section(name)?.file_range()?);
        Some(ObjectInfo {
            build_id: build_id(&elf, bytes),
            has_dwarf: section(".debug_info").is_some() || section(".zdebug_info").is_some(),
            debuglink: section_data(".gnu_debuglink").and_then(parse_debuglink),
            altlink: section_data(".gnu_debugaltlink").and_then(parse_altlink),
            symbols: function_symbols(&elf),
        })
    }
}

/// A NUL-terminated file name, padding to a multiple of 4, then the CRC in the
/// file's byte order (little-endian: memptrace reads x86-64 files only).
pub(crate) fn parse_debuglink(data: &[u8]) -> Option<DebugLink> {
    let name_len = data.iter().position(|&b| b == 0)?;
    let crc_at = (name_len + 4) & !3;
    let crc = data.get(crc_at..crc_at + 4)?;
    Some(DebugLink {
        name: path_from_bytes(&data[..name_len])?,
        crc: u32::from_le_bytes(crc.try_into().ok()?),
    })
}

/// A NUL-terminated path, then the supplementary file's build-id bytes.
fn parse_altlink(data: &[u8]) -> Option<AltLink> {
    let path_len = data.iter().position(|&b| b == 0)?;
    let id = &data[path_len + 1..];
    Some(AltLink {
        path: path_from_bytes(&data[..path_len])?,
        build_id: id.iter().map(|b| format!("{b:02x}")).collect(),
    })
}

fn path_from_bytes(bytes: &[u8]) -> Option<PathBuf> {
    (!bytes.is_empty()).then(|| PathBuf::from(OsString::from_vec(bytes.to_vec())))
}

/// Defined FUNC and GNU_IFUNC symbols of `.symtab` and `.dynsym`. An IFUNC
/// symbol's address is its resolver's, which is code worth naming too.
fn function_symbols(elf: &Elf) -> Vec<FuncSymbol> {
    let mut out = Vec::new();
    let tables = [
        (&elf.syms, &elf.strtab, false),
        (&elf.dynsyms, &elf.dynstrtab, true),
    ];
    for (syms, strtab, dynamic) in tables {
        for (index, s) in syms.iter().enumerate() {
            let kind = s.st_type();
            if kind != sym::STT_FUNC && kind != sym::STT_GNU_IFUNC {
                continue;
            }
            if s.st_shndx == section_header::SHN_UNDEF as usize || s.st_value == 0 {
                continue;
            }
            let Some(raw) = strtab.get_at(s.st_name).filter(|n| !n.is_empty()) else {
                continue;
            };
            let (name, mut hidden) = split_version(raw);
            if dynamic {
                hidden = elf
                    .versym
                    .as_ref()
                    .and_then(|v| v.get_at(index))
                    .is_some_and(|v| v.is_hidden());
            }
            let binding = match s.st_bind() {
                sym::STB_LOCAL => Binding::Local,
                sym::STB_WEAK => Binding::Weak,
                _ => Binding::Global,
            };
            let section_end = elf
                .section_headers
                .get(s.st_shndx)
                .map(|sh| sh.sh_addr.saturating_add(sh.sh_size));
            out.push(FuncSymbol {
                start: s.st_value,
                size: s.st_size,
                limit: section_end.unwrap_or(s.st_value.saturating_add(s.st_size)),
                name: name.into(),
                rank: AliasRank::new(binding, hidden, name),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_link_sections() {
        // The name and its NUL take 9 bytes: 3 bytes of padding, then the CRC.
        let mut data = b"ab.debug\0\0\0\0".to_vec();
        data.extend_from_slice(&0x1aab_a8f7u32.to_le_bytes());
        assert_eq!(
            parse_debuglink(&data),
            Some(DebugLink {
                name: "ab.debug".into(),
                crc: 0x1aab_a8f7
            })
        );
        assert_eq!(parse_debuglink(b"x.debug\0\x01\x02"), None);
        let alt = parse_altlink(b"/usr/lib/debug/.dwz/x.debug\0\xab\xcd").unwrap();
        assert_eq!(alt.path, Path::new("/usr/lib/debug/.dwz/x.debug"));
        assert_eq!(alt.build_id, "abcd");
        assert_eq!(parse_altlink(b"no terminator"), None);
    }

    #[test]
    fn refuses_what_is_not_a_regular_elf_file() {
        assert!(read_regular_file(Path::new("/nonexistent/memptrace/file")).is_none());
        assert!(read_regular_file(Path::new("/dev/zero")).is_none());
        assert!(read_regular_file(Path::new("/tmp")).is_none());
        assert!(ObjectInfo::parse(b"#!/bin/sh\n").is_none());
        assert!(ObjectInfo::parse(b"\x7fELF\x02\x01\x01garbage that is too short").is_none());
    }
}
