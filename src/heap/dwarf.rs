//! The layout of glibc's allocator structures as its own DWARF states it:
//! `malloc_state`, `malloc_par` and `tcache_perthread_struct` in the
//! compile unit of `malloc.c` of libc's debug file. Preferred to the
//! known layouts of [`super::Layout::for_sizes`], which is the fallback
//! when there is no DWARF (a static binary's libc.a has none).
//!
//! Debug sections may be zlib-compressed (`SHF_COMPRESSED`, an
//! `Elf64_Chdr` before the stream: gABI "Section Compression").

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Read;

use gimli::{AttributeValue, EndianSlice, LittleEndian, UnitOffset};
use goblin::elf::Elf;

use super::Layout;

const SHF_COMPRESSED: u64 = 0x800;
const ELFCOMPRESS_ZLIB: u32 = 1;

/// A section's bytes, decompressed; empty when absent or unreadable.
fn section<'a>(elf: &Elf, bytes: &'a [u8], name: &str) -> Cow<'a, [u8]> {
    let Some(sh) = elf
        .section_headers
        .iter()
        .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(name))
    else {
        return Cow::Borrowed(&[]);
    };
    let Some(data) = sh.file_range().and_then(|r| bytes.get(r)) else {
        return Cow::Borrowed(&[]);
    };
    if sh.sh_flags & SHF_COMPRESSED == 0 {
        return Cow::Borrowed(data);
    }
    let word = |at: usize, n: usize| data.get(at..at + n);
    let (Some(kind), Some(size)) = (word(0, 4), word(8, 8)) else {
        return Cow::Borrowed(&[]);
    };
    let kind = u32::from_le_bytes(kind.try_into().expect("4 bytes"));
    let size = u64::from_le_bytes(size.try_into().expect("8 bytes"));
    if kind != ELFCOMPRESS_ZLIB || size > (1 << 32) {
        return Cow::Borrowed(&[]);
    }
    let mut out = Vec::with_capacity(size as usize);
    match flate2::read::ZlibDecoder::new(&data[24..]).read_to_end(&mut out) {
        Ok(_) => Cow::Owned(out),
        Err(_) => Cow::Borrowed(&[]),
    }
}

/// A member of a structure: its offset and its type.
struct Member {
    offset: u64,
    ty: Option<UnitOffset>,
}

/// A structure: its size and members by name.
struct Struct {
    size: u64,
    members: HashMap<String, Member>,
}

type R<'a> = EndianSlice<'a, LittleEndian>;

/// The layout the DWARF of the ELF file `bytes` states, if it has
/// malloc.c's structures.
pub fn layout(bytes: &[u8]) -> Option<Layout> {
    let elf = Elf::parse(bytes).ok()?;
    // Only what units, names and types need (a unit reads its line
    // program's header): inflating the location and range lists too took a
    // third more time.
    let needed = [
        gimli::SectionId::DebugInfo,
        gimli::SectionId::DebugAbbrev,
        gimli::SectionId::DebugStr,
        gimli::SectionId::DebugStrOffsets,
        gimli::SectionId::DebugLineStr,
        gimli::SectionId::DebugLine,
        gimli::SectionId::DebugAddr,
    ];
    let sections = gimli::DwarfSections::load(|id| {
        Ok::<_, gimli::Error>(match needed.contains(&id) {
            true => section(&elf, bytes, id.name()),
            false => Cow::Borrowed(&[][..]),
        })
    })
    .ok()?;
    let dwarf = sections.borrow(|s| EndianSlice::new(s, LittleEndian));
    let mut units = dwarf.units();
    while let Ok(Some(header)) = units.next() {
        let Ok(unit) = dwarf.unit(header) else {
            continue;
        };
        let mut cursor = unit.entries();
        let Ok(Some(root)) = cursor.next_dfs() else {
            continue;
        };
        let name = root
            .attr_value(gimli::DW_AT_name)
            .and_then(|v| dwarf.attr_string(&unit, v).ok());
        if !name.is_some_and(|n| n.slice().ends_with(b"malloc.c")) {
            continue;
        }
        return from_unit(&dwarf, &unit);
    }
    None
}

fn from_unit(dwarf: &gimli::Dwarf<R>, unit: &gimli::Unit<R>) -> Option<Layout> {
    let wanted = ["malloc_state", "malloc_par", "tcache_perthread_struct"];
    let mut structs: HashMap<String, Struct> = HashMap::new();
    let mut current: Option<(String, isize)> = None;
    let mut cursor = unit.entries();
    while let Ok(Some(die)) = cursor.next_dfs() {
        let depth = die.depth();
        if current.as_ref().is_some_and(|(_, d)| depth <= *d) {
            current = None;
        }
        let name = || {
            die.attr_value(gimli::DW_AT_name)
                .and_then(|v| dwarf.attr_string(unit, v).ok())
                .map(|s| s.to_string_lossy().into_owned())
        };
        match die.tag() {
            gimli::DW_TAG_structure_type => {
                let size = die
                    .attr_value(gimli::DW_AT_byte_size)
                    .and_then(|v| v.udata_value());
                if let (Some(name), Some(size)) = (name(), size) {
                    if wanted.contains(&name.as_str()) && !structs.contains_key(&name) {
                        structs.insert(
                            name.clone(),
                            Struct {
                                size,
                                members: HashMap::new(),
                            },
                        );
                        current = Some((name, depth));
                    }
                }
            }
            gimli::DW_TAG_member => {
                let Some((owner, d)) = &current else {
                    continue;
                };
                if depth != d + 1 {
                    continue;
                }
                let offset = die
                    .attr_value(gimli::DW_AT_data_member_location)
                    .and_then(|v| v.udata_value());
                let ty = match die.attr_value(gimli::DW_AT_type) {
                    Some(AttributeValue::UnitRef(o)) => Some(o),
                    _ => None,
                };
                if let (Some(name), Some(offset)) = (name(), offset) {
                    if let Some(s) = structs.get_mut(owner) {
                        s.members.insert(name, Member { offset, ty });
                    }
                }
            }
            _ => {}
        }
    }
    let state = structs.get("malloc_state")?;
    let par = structs.get("malloc_par")?;
    let field = |s: &Struct, name: &str| s.members.get(name).map(|m| m.offset);
    let count = |s: &Struct, name: &str| {
        s.members
            .get(name)
            .and_then(|m| m.ty)
            .and_then(|ty| array(unit, ty))
    };
    let nfastbins = count(state, "fastbinsY")?.0 as usize;
    let nbins = (count(state, "bins")?.0 / 2 + 1) as usize;
    let tcache = structs
        .get("tcache_perthread_struct")
        .and_then(|t| {
            let (_, count_bytes) = count(t, "counts")?;
            // request2size: the header word, rounded up to 16.
            Some(vec![((t.size + 8 + 15) & !15, count_bytes)])
        })
        .unwrap_or_default();
    Some(Layout {
        state_size: state.size,
        fastbins: field(state, "fastbinsY")?,
        nfastbins,
        top: field(state, "top")?,
        bins: field(state, "bins")?,
        nbins,
        next: field(state, "next")?,
        system_mem: field(state, "system_mem")?,
        n_mmaps: field(par, "n_mmaps")?,
        mmapped_mem: field(par, "mmapped_mem")?,
        sbrk_base: field(par, "sbrk_base")?,
        // Huge-page fields came in 2.35, after safe-linking (2.32).
        safe_linking: par.members.contains_key("hp_pagesize").then_some(true),
        tcache,
        heap_max: 64 << 20,
    })
}

/// An array type's element count and element size.
fn array(unit: &gimli::Unit<R>, ty: UnitOffset) -> Option<(u64, u64)> {
    let mut cursor = unit.entries_at_offset(ty).ok()?;
    let die = cursor.next_dfs().ok()??;
    if die.tag() != gimli::DW_TAG_array_type {
        return None;
    }
    let element = match die.attr_value(gimli::DW_AT_type)? {
        AttributeValue::UnitRef(o) => o,
        _ => return None,
    };
    let depth = die.depth();
    let sub = cursor.next_dfs().ok()??;
    if sub.tag() != gimli::DW_TAG_subrange_type || sub.depth() != depth + 1 {
        return None;
    }
    let n = match sub
        .attr_value(gimli::DW_AT_count)
        .and_then(|v| v.udata_value())
    {
        Some(n) => n,
        None => sub.attr_value(gimli::DW_AT_upper_bound)?.udata_value()? + 1,
    };
    Some((n, size_of(unit, element)?))
}

/// The size of a type, through typedefs and qualifiers.
fn size_of(unit: &gimli::Unit<R>, mut ty: UnitOffset) -> Option<u64> {
    for _ in 0..16 {
        let die = unit.entry(ty).ok()?;
        if let Some(size) = die
            .attr_value(gimli::DW_AT_byte_size)
            .and_then(|v| v.udata_value())
        {
            return Some(size);
        }
        ty = match die.attr_value(gimli::DW_AT_type)? {
            AttributeValue::UnitRef(o) => o,
            _ => return None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    /// The debug file of this machine's libc (Debian: libc6-dbg, installed
    /// by scripts/deps) states glibc 2.36's layout, the one known by size.
    #[test]
    fn libc_debug_file_states_the_known_layout() {
        let maps = crate::os::procfs::read_maps(std::process::id() as i32).unwrap();
        let libc = maps
            .iter()
            .find(|m| m.path.contains("/libc.so"))
            .expect("the test binary links libc.so.6")
            .path
            .clone();
        let bytes = std::fs::read(&libc).unwrap();
        let elf = goblin::elf::Elf::parse(&bytes).unwrap();
        let id = crate::symbols::elf::build_id(&elf, &bytes).unwrap();
        let debug = crate::symbols::symbolize::debug_file::by_build_id(
            &[std::path::PathBuf::from("/usr/lib/debug")],
            &id,
        )
        .expect("libc's debug file (scripts/deps installs libc6-dbg)");
        let layout = super::layout(&std::fs::read(debug.path).unwrap()).unwrap();
        let sizes = super::super::Layout::for_sizes(layout.state_size, 136).unwrap();
        assert_eq!(layout, sizes);
    }
}
