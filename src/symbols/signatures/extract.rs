//! A signature set from a `libc.a`: the code of the allocator functions as
//! the archive's object files hold it, with every byte the linker may change
//! masked, found from the object's relocations.
//!
//! What the linker writes, by relocation type (x86-64 psABI, "Relocation
//! Types", and its "Linker Optimization" of GOT and TLS accesses):
//! - A PC-relative field whose target is in the same section is a constant
//!   (the section is copied whole): kept, filled in here.
//! - A PC-relative call or jump to another function of the set is kept as a
//!   [`Ref`], checked once that function is found.
//! - Other absolute and PC-relative fields: the field is masked.
//! - GOT and initial-exec TLS accesses may be rewritten into other
//!   instructions (`mov foo@GOTPCREL(%rip)` into `lea` or `mov $imm`,
//!   `call *foo@GOTPCREL(%rip)` into `addr32 call`): the opcode bytes before
//!   the field are masked too; general- and local-dynamic TLS sequences are
//!   masked whole.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use goblin::elf::{Elf, header, reloc, section_header, sym};

use super::{Function, Library, Ref, SignatureError, ar};
use crate::event::Op;
use crate::symbols::names;

/// A function definition in one member of the archive.
struct Def {
    member: usize,
    section: usize,
    offset: u64,
    size: u64,
    /// Global names, then weak and local ones.
    strong: Vec<String>,
    others: Vec<String>,
}

impl Def {
    fn has(&self, name: &str) -> bool {
        self.strong.iter().chain(&self.others).any(|n| n == name)
    }
}

/// The set of the allocator functions of the archive `bytes`, its mapping
/// and housekeeping functions ([`names`]), and the functions those jump to.
pub fn from_archive(bytes: &[u8], path: &Path) -> Result<Library, SignatureError> {
    let members = ar::members(bytes).map_err(SignatureError::Archive)?;
    let objects: Vec<Option<Elf>> = members
        .iter()
        .map(|m| {
            let elf = Elf::parse(m.data).ok()?;
            (elf.header.e_type == header::ET_REL && elf.header.e_machine == header::EM_X86_64)
                .then_some(elf)
        })
        .collect();
    let defs = definitions(&objects);

    let mut wanted: Vec<String> = Op::ALL
        .iter()
        .map(|o| o.name())
        .chain(names::MAPPING_NAMES.iter().map(|&(n, _)| n))
        .chain(names::HOUSEKEEPING_NAMES)
        .map(str::to_string)
        .collect();
    let mut done: BTreeSet<String> = BTreeSet::new();
    let mut functions: Vec<Function> = Vec::new();
    let mut made: BTreeSet<(usize, usize, u64)> = BTreeSet::new();
    while let Some(name) = wanted.pop() {
        if !done.insert(name.clone()) {
            continue;
        }
        for def in defs.iter().filter(|d| d.has(&name)) {
            if !made.insert((def.member, def.section, def.offset)) {
                continue;
            }
            let Some(elf) = &objects[def.member] else {
                continue;
            };
            let Some(f) = function(elf, members[def.member].data, def) else {
                continue;
            };
            if let Some(t) = &f.tail {
                wanted.push(t.clone());
            }
            functions.push(f);
        }
    }
    if functions.is_empty() {
        return Err(SignatureError::Archive(format!(
            "{}: no allocator function in it",
            path.display()
        )));
    }
    // Keep only references to functions of the set: the others are masked.
    let names: BTreeSet<String> = functions
        .iter()
        .flat_map(|f| f.names.iter().cloned())
        .collect();
    for f in &mut functions {
        f.refs.retain(|r| names.contains(&r.target));
    }
    functions.sort_by(|a, b| a.names.cmp(&b.names));
    Ok(Library {
        label: label(bytes, &members, path),
        functions,
    })
}

/// Every defined function symbol of every object, grouped by address: one
/// [`Def`] per (member, section, offset) with all its names, strong first.
fn definitions(objects: &[Option<Elf>]) -> Vec<Def> {
    let mut by_place: BTreeMap<(usize, usize, u64), Def> = BTreeMap::new();
    for (member, elf) in objects.iter().enumerate() {
        let Some(elf) = elf else { continue };
        for s in elf.syms.iter() {
            if s.st_type() != sym::STT_FUNC || s.st_shndx == section_header::SHN_UNDEF as usize {
                continue;
            }
            let Some(name) = elf.strtab.get_at(s.st_name).filter(|n| !n.is_empty()) else {
                continue;
            };
            let def = by_place
                .entry((member, s.st_shndx, s.st_value))
                .or_insert(Def {
                    member,
                    section: s.st_shndx,
                    offset: s.st_value,
                    size: 0,
                    strong: Vec::new(),
                    others: Vec::new(),
                });
            def.size = def.size.max(s.st_size);
            if s.st_bind() == sym::STB_GLOBAL {
                def.strong.push(name.to_string());
            } else {
                def.others.push(name.to_string());
            }
        }
    }
    by_place
        .into_values()
        .filter(|d| d.size > 0)
        .map(|mut d| {
            // The op's name first: it is the function's own.
            for names in [&mut d.strong, &mut d.others] {
                names.sort_by_key(|n| (Op::from_name(n).is_none(), n.clone()));
            }
            d
        })
        .collect()
}

/// The signature of one definition.
fn function(elf: &Elf, bytes: &[u8], def: &Def) -> Option<Function> {
    let sh = elf.section_headers.get(def.section)?;
    let start = sh.sh_offset.checked_add(def.offset)? as usize;
    let end = start.checked_add(usize::try_from(def.size).ok()?)?;
    let mut code = bytes.get(start..end)?.to_vec();
    let mut mask = vec![0xffu8; code.len()];
    let mut refs = Vec::new();
    let len = code.len() as i64;
    let clear = |mask: &mut Vec<u8>, from: i64, to: i64| {
        for i in from.max(0)..to.min(len) {
            mask[i as usize] = 0;
        }
    };
    for (rela_index, relocs) in &elf.shdr_relocs {
        let target_section = elf.section_headers.get(*rela_index)?.sh_info as usize;
        if target_section != def.section {
            continue;
        }
        for r in relocs.iter() {
            if r.r_offset < def.offset || r.r_offset - def.offset >= def.size {
                continue;
            }
            let at = (r.r_offset - def.offset) as i64;
            let addend = r.r_addend.unwrap_or(0);
            let target = elf.syms.get(r.r_sym);
            match r.r_type {
                reloc::R_X86_64_PC32 | reloc::R_X86_64_PLT32 => {
                    let Some(t) = target else {
                        clear(&mut mask, at, at + 4);
                        continue;
                    };
                    let local = t.st_bind() == sym::STB_LOCAL || t.st_bind() == sym::STB_GLOBAL;
                    if t.st_shndx == def.section && local && at + 4 <= len {
                        // The section is copied whole: the distance is fixed.
                        let value = (t.st_value as i64)
                            .wrapping_add(addend)
                            .wrapping_sub(r.r_offset as i64);
                        code[at as usize..at as usize + 4]
                            .copy_from_slice(&(value as i32).to_le_bytes());
                        continue;
                    }
                    clear(&mut mask, at, at + 4);
                    let name = elf.strtab.get_at(t.st_name).unwrap_or("");
                    if !name.is_empty() && t.st_type() != sym::STT_SECTION {
                        refs.push(Ref {
                            offset: at as u32,
                            addend,
                            target: name.to_string(),
                        });
                    }
                }
                reloc::R_X86_64_64 | reloc::R_X86_64_PC64 => clear(&mut mask, at, at + 8),
                reloc::R_X86_64_32 | reloc::R_X86_64_32S | reloc::R_X86_64_TPOFF32 => {
                    clear(&mut mask, at, at + 4)
                }
                reloc::R_X86_64_GOTPCREL
                | reloc::R_X86_64_GOTPCRELX
                | reloc::R_X86_64_REX_GOTPCRELX
                | reloc::R_X86_64_GOTTPOFF => clear(&mut mask, at - 3, at + 4),
                _ => clear(&mut mask, at - 4, at + 12),
            }
        }
    }
    for (b, m) in code.iter_mut().zip(&mask) {
        if *m == 0 {
            *b = 0;
        }
    }
    let tail = tail_target(&code, &mask, &refs);
    let mut f = Function {
        names: [def.strong.clone(), def.others.clone()].concat(),
        strong: def.strong.len(),
        ops: Vec::new(),
        maps: Vec::new(),
        housekeeping: false,
        code,
        mask,
        refs,
        tail,
    };
    f.classify();
    Some(f)
}

/// The function a pure jump wrapper (`[endbr64] jmp target`) goes to.
fn tail_target(code: &[u8], mask: &[u8], refs: &[Ref]) -> Option<String> {
    const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
    let at = if code.starts_with(&ENDBR64) { 4 } else { 0 };
    if code.len() != at + 5 || code[at] != 0xe9 || mask[at] == 0 {
        return None;
    }
    refs.iter()
        .find(|r| r.offset as usize == at + 1 && r.addend == -4)
        .map(|r| r.target.clone())
}

/// A name for the library: its version string when it has one (glibc's
/// `version.o`: "GNU C Library (Debian GLIBC 2.36-9) stable release version
/// 2.36"; musl's `version.lo` holds the bare version), else the path.
fn label(bytes: &[u8], members: &[ar::Member], path: &Path) -> String {
    const GLIBC: &[u8] = b"GNU C Library (";
    if let Some(at) = memchr::memmem::find(bytes, GLIBC) {
        let rest = &bytes[at + GLIBC.len()..];
        if let Some(end) = rest.iter().take(80).position(|&b| b == b')') {
            let vendor = String::from_utf8_lossy(&rest[..end]);
            let version = vendor.rsplit(' ').next().unwrap_or("").to_string();
            let short = version.split('-').next().unwrap_or("");
            return format!("glibc {short} ({vendor}, {})", path.display());
        }
    }
    let musl = members
        .iter()
        .find(|m| m.name == "version.lo")
        .and_then(|m| {
            let elf = Elf::parse(m.data).ok()?;
            let sh = elf.section_headers.iter().find(|sh| {
                elf.shdr_strtab
                    .get_at(sh.sh_name)
                    .is_some_and(|n| n.starts_with(".rodata"))
            })?;
            let data = m.data.get(sh.file_range()?)?;
            let end = data.iter().position(|&b| b == 0)?;
            Some(String::from_utf8_lossy(&data[..end]).into_owned())
        });
    match musl {
        Some(v) => format!("musl {v} ({})", path.display()),
        None => path.display().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(path: &str) -> Library {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e} (scripts/deps)"));
        from_archive(&bytes, Path::new(path)).unwrap()
    }

    #[test]
    fn refuses_what_is_not_a_libc_archive() {
        let path = Path::new("x.a");
        assert!(from_archive(b"not an archive", path).is_err());
        assert!(from_archive(b"!<arch>\n", path).is_err());
        // A member cut short, and one that is no object file.
        let mut ar = b"!<arch>\n".to_vec();
        ar.extend(format!("{:<16}{:<32}{:<10}`\n", "x.o/", "", 10).as_bytes());
        ar.extend(b"\x7fELF\x02\x01\x01");
        assert!(from_archive(&ar, path).is_err());
    }

    #[test]
    fn glibc_allocator_from_libc_a() {
        let lib = read(super::super::MACHINE_LIBCS[0]);
        assert!(lib.label.starts_with("glibc 2."), "{}", lib.label);
        let malloc = &lib.functions[lib.function("malloc").unwrap()];
        assert!(malloc.names.contains(&"__libc_malloc".to_string()));
        assert!(malloc.fixed_bytes() > 100, "{}", malloc.fixed_bytes());
        // memalign and aligned_alloc: one function, two ops.
        let memalign = &lib.functions[lib.function("memalign").unwrap()];
        assert!(memalign.ops.contains(&Op::AlignedAlloc));
        // reallocarray jumps to realloc: a reference to check.
        let ra = &lib.functions[lib.function("reallocarray").unwrap()];
        assert!(ra.refs.iter().any(|r| r.target == "realloc"), "{ra:?}");
    }

    #[test]
    fn musl_wrappers_lead_to_their_bodies() {
        let lib = read(super::super::MACHINE_LIBCS[1]);
        assert!(lib.label.starts_with("musl 1."), "{}", lib.label);
        let free = &lib.functions[lib.function("free").unwrap()];
        assert_eq!(free.tail.as_deref(), Some("__libc_free"));
        assert!(lib.function("__libc_free").is_some());
        // malloc is lite_malloc's jump to __libc_malloc_impl, which mallocng
        // defines too: both bodies are in the set.
        let impls = lib
            .functions
            .iter()
            .filter(|f| f.names.iter().any(|n| n == "__libc_malloc_impl"))
            .count();
        assert_eq!(impls, 2);
    }
}
