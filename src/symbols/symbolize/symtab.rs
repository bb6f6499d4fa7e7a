//! Function names from ELF symbol tables (`.symtab`, then `.dynsym`): the
//! fallback for code that has no DWARF, such as Debian's libc without its
//! debug package.
//!
//! Several symbols often name one address (glibc: `malloc` and
//! `__libc_malloc`; `open`, `open64`, `__open`, `__open64`). The index names an
//! address with one of them, chosen by [`AliasRank`], so that a frame reads the
//! way a programmer called the function.

use std::cmp::Ordering;

/// A function symbol, as kept by the index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuncSymbol {
    pub start: u64,
    /// `st_size`; 0 when the symbol does not say (hand-written assembly).
    pub size: u64,
    /// Where a size-0 symbol stops counting as the nearest one: the end of its
    /// section.
    pub limit: u64,
    /// As the symbol table spells it (mangled), without a `@VERSION` suffix.
    pub name: Box<str>,
    pub rank: AliasRank,
}

impl FuncSymbol {
    fn contains(&self, addr: u64) -> bool {
        self.size > 0 && addr >= self.start && addr - self.start < self.size
    }
}

/// How well a name suits an address that several symbols share; smaller is
/// better. In order of importance:
/// 1. exported (GLOBAL, WEAK, GNU_UNIQUE) before LOCAL: the public name;
/// 2. the default symbol version (`malloc@@GLIBC_2.2.5`) before a hidden
///    compatibility one (`cfree@GLIBC_2.2.5`);
/// 3. fewer leading underscores (`malloc` before `__libc_malloc`); a mangled
///    C++ or Rust name (`_Z…`, `_R…`) counts as having none;
/// 4. GLOBAL before WEAK;
/// 5. the shorter name (`open` before `open64`), then the alphabetically first,
///    so that the choice never depends on the order of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct AliasRank {
    local: bool,
    hidden_version: bool,
    underscores: usize,
    weak: bool,
}

/// A symbol's binding, as far as the alias rule cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    Global,
    Weak,
    Local,
}

impl AliasRank {
    pub fn new(binding: Binding, hidden_version: bool, name: &str) -> AliasRank {
        let mangled = name.starts_with("_Z") || name.starts_with("_R");
        AliasRank {
            local: binding == Binding::Local,
            hidden_version,
            underscores: if mangled {
                0
            } else {
                name.bytes().take_while(|&b| b == b'_').count()
            },
            weak: binding == Binding::Weak,
        }
    }
}

fn better(a: &FuncSymbol, b: &FuncSymbol) -> Ordering {
    a.rank
        .cmp(&b.rank)
        .then(a.name.len().cmp(&b.name.len()))
        .then(a.name.cmp(&b.name))
}

/// Splits a `.symtab` name such as `memcpy@GLIBC_2.2.5` (a hidden version) or
/// `memcpy@@GLIBC_2.14` (the default one) into the name and whether the
/// version is hidden. `.dynsym` names carry no suffix: their versions are in
/// `.gnu.version`.
pub fn split_version(name: &str) -> (&str, bool) {
    match name.split_once('@') {
        Some((base, rest)) if !base.is_empty() => (base, !rest.starts_with('@')),
        _ => (name, false),
    }
}

/// Function symbols sorted by address, for "which function holds this address".
#[derive(Debug, Default)]
pub struct SymbolIndex {
    symbols: Vec<FuncSymbol>,
    /// `max_end[i]`: the largest end of the sized symbols `symbols[..=i]`, so
    /// that a search for an enclosing symbol knows when to stop looking back.
    max_end: Vec<u64>,
}

impl SymbolIndex {
    /// Builds the index; the same name at the same address (a symbol in both
    /// `.symtab` and `.dynsym`, or in a file and its debug file) is kept once,
    /// with its better rank.
    pub fn new(mut symbols: Vec<FuncSymbol>) -> SymbolIndex {
        symbols.sort_by(|a, b| {
            (a.start, &a.name, a.rank, std::cmp::Reverse(a.size)).cmp(&(
                b.start,
                &b.name,
                b.rank,
                std::cmp::Reverse(b.size),
            ))
        });
        symbols.dedup_by(|later, kept| later.start == kept.start && later.name == kept.name);
        let mut max_end = Vec::with_capacity(symbols.len());
        let mut end = 0;
        for s in &symbols {
            end = end.max(s.start.saturating_add(s.size));
            max_end.push(end);
        }
        SymbolIndex { symbols, max_end }
    }

    /// The symbol that names `addr`: the best-ranked alias among
    /// - the symbols at the nearest address at or below `addr`, if one of them
    ///   has a size that covers `addr`, or has no size and `addr` is still in
    ///   its section;
    /// - otherwise the sized symbols with the nearest start that enclose `addr`
    ///   (a function with a smaller symbol inside it).
    ///
    /// None when `addr` lies in no function: padding after one, or a section
    /// without symbols.
    pub fn find(&self, addr: u64) -> Option<&FuncSymbol> {
        let end = self.symbols.partition_point(|s| s.start <= addr);
        let nearest = self.symbols.get(end.checked_sub(1)?)?.start;
        let at_nearest = self.symbols[..end]
            .iter()
            .rev()
            .take_while(|s| s.start == nearest)
            .filter(|s| s.contains(addr) || (s.size == 0 && addr < s.limit));
        if let Some(best) = at_nearest.min_by(|a, b| better(a, b)) {
            return Some(best);
        }
        let mut enclosing: Option<&FuncSymbol> = None;
        for i in (0..end).rev() {
            if self.max_end[i] <= addr {
                break;
            }
            let s = &self.symbols[i];
            if enclosing.is_some_and(|e| e.start != s.start) {
                break;
            }
            if s.contains(addr) && enclosing.is_none_or(|e| better(s, e).is_lt()) {
                enclosing = Some(s);
            }
        }
        enclosing
    }

    /// The symbols that start at `start`.
    fn at(&self, start: u64) -> &[FuncSymbol] {
        let low = self.symbols.partition_point(|s| s.start < start);
        let high = self.symbols.partition_point(|s| s.start <= start);
        &self.symbols[low..high]
    }

    /// A better name for the function DWARF calls `name` (its linkage name, as
    /// mangled) at `addr`: the alias [`find`](Self::find) chooses, when `name`
    /// is a symbol at the same address and that alias ranks strictly better.
    /// glibc's DWARF names `puts` by its internal asm label `__GI__IO_puts`
    /// and `malloc` as `__libc_malloc`; with this a frame reads the same with
    /// or without the debug package. A rank tie is not enough: Rust and C++
    /// merge identical functions under aliases that name different things,
    /// and there DWARF knows which one the code was compiled as.
    pub fn public_alias(&self, addr: u64, name: &str) -> Option<&FuncSymbol> {
        let best = self.find(addr)?;
        let named = self.at(best.start).iter().find(|s| &*s.name == name)?;
        (best.rank < named.rank).then_some(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sym(start: u64, size: u64, name: &str, binding: Binding) -> FuncSymbol {
        FuncSymbol {
            start,
            size,
            limit: 0x10000,
            name: name.into(),
            rank: AliasRank::new(binding, false, name),
        }
    }

    fn name(index: &SymbolIndex, addr: u64) -> Option<&str> {
        index.find(addr).map(|s| &*s.name)
    }

    #[test]
    fn public_names_win_among_aliases() {
        let index = SymbolIndex::new(vec![
            sym(0x100, 0x20, "__libc_malloc", Binding::Global),
            sym(0x100, 0x20, "malloc", Binding::Global),
            sym(0x200, 0x20, "__open64", Binding::Weak),
            sym(0x200, 0x20, "open64", Binding::Weak),
            sym(0x200, 0x20, "open", Binding::Weak),
            sym(0x200, 0x20, "__open", Binding::Global),
            sym(0x300, 0x20, "helper", Binding::Local),
            sym(0x300, 0x20, "__helper", Binding::Global),
            sym(0x400, 0x20, "_ZN2ns4growEi", Binding::Global),
            sym(0x400, 0x20, "__grow_alias", Binding::Global),
        ]);
        assert_eq!(name(&index, 0x110), Some("malloc"));
        assert_eq!(name(&index, 0x200), Some("open"));
        // Exported beats local, even with underscores.
        assert_eq!(name(&index, 0x31f), Some("__helper"));
        assert_eq!(name(&index, 0x401), Some("_ZN2ns4growEi"));
    }

    #[test]
    fn the_default_version_wins() {
        let (base, hidden) = split_version("cfree@GLIBC_2.2.5");
        assert_eq!((base, hidden), ("cfree", true));
        assert_eq!(split_version("memcpy@@GLIBC_2.14"), ("memcpy", false));
        assert_eq!(split_version("plain"), ("plain", false));
        let mut cfree = sym(0x100, 0x20, "cfree", Binding::Global);
        cfree.rank = AliasRank::new(Binding::Global, true, "cfree");
        let index = SymbolIndex::new(vec![cfree, sym(0x100, 0x20, "free_it", Binding::Global)]);
        assert_eq!(name(&index, 0x100), Some("free_it"));
    }

    #[test]
    fn sizes_bound_functions() {
        let index = SymbolIndex::new(vec![
            sym(0x100, 0x10, "first", Binding::Global),
            sym(0x200, 0, "asm_entry", Binding::Global),
            sym(0x300, 0x100, "outer", Binding::Local),
            sym(0x340, 0x10, "inner_part", Binding::Local),
        ]);
        assert_eq!(name(&index, 0xff), None);
        assert_eq!(name(&index, 0x10f), Some("first"));
        // Padding after a sized function belongs to nobody.
        assert_eq!(name(&index, 0x110), None);
        // A size-0 symbol names everything up to the next symbol.
        assert_eq!(name(&index, 0x2ff), Some("asm_entry"));
        assert_eq!(name(&index, 0x345), Some("inner_part"));
        // Past the inner symbol, the enclosing one.
        assert_eq!(name(&index, 0x360), Some("outer"));
        assert_eq!(name(&index, 0x400), None);
    }

    #[test]
    fn size_zero_symbols_stop_at_their_section() {
        let mut entry = sym(0x100, 0, "_start", Binding::Global);
        entry.limit = 0x180;
        let index = SymbolIndex::new(vec![entry]);
        assert_eq!(name(&index, 0x17f), Some("_start"));
        assert_eq!(name(&index, 0x180), None);
    }

    #[test]
    fn dwarf_names_give_way_to_better_aliases_only() {
        let index = SymbolIndex::new(vec![
            sym(0x100, 0x20, "__GI__IO_puts", Binding::Local),
            sym(0x100, 0x20, "_IO_puts", Binding::Global),
            sym(0x100, 0x20, "puts", Binding::Weak),
            sym(
                0x200,
                0x20,
                "_ZN4core3ptr13drop_in_place1aE",
                Binding::Local,
            ),
            sym(
                0x200,
                0x20,
                "_ZN4core3ptr13drop_in_place1bE",
                Binding::Local,
            ),
        ]);
        let alias = |addr, name| index.public_alias(addr, name).map(|s| &*s.name);
        assert_eq!(alias(0x110, "__GI__IO_puts"), Some("puts"));
        assert_eq!(alias(0x110, "_IO_puts"), Some("puts"));
        assert_eq!(alias(0x110, "puts"), None);
        // Not a symbol here: DWARF knows something the tables do not.
        assert_eq!(alias(0x110, "helper"), None);
        assert_eq!(alias(0x210, "_ZN4core3ptr13drop_in_place1bE"), None);
    }

    #[test]
    fn duplicates_from_two_tables_are_kept_once() {
        let index = SymbolIndex::new(vec![
            sym(0x100, 0x20, "f", Binding::Global),
            sym(0x100, 0x20, "f", Binding::Global),
        ]);
        assert_eq!(index.symbols.len(), 1);
        assert!(SymbolIndex::new(Vec::new()).find(5).is_none());
    }
}
