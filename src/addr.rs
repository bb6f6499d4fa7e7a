//! Two kinds of address live side by side in a tracer, and mixing them up is the
//! classic bug: an AVMA ("actual virtual memory address") is where a byte sits in
//! the traced process right now; an SVMA ("stated virtual memory address") is the
//! address the ELF file gives it. For an image loaded with load bias `b`,
//! `avma = svma + b`. Symbol tables, DWARF and CFI speak SVMA; registers, stacks
//! and /proc/PID/maps speak AVMA. (framehop uses the same names.)

use std::fmt;

/// An address in the traced process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Avma(pub u64);

/// An address as the ELF file states it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Svma(pub u64);

/// The difference between where an image sits and where its file says it sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct LoadBias(pub u64);

impl LoadBias {
    pub fn to_avma(self, svma: Svma) -> Avma {
        Avma(svma.0.wrapping_add(self.0))
    }

    pub fn to_svma(self, avma: Avma) -> Svma {
        Svma(avma.0.wrapping_sub(self.0))
    }
}

impl fmt::Display for Avma {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for Svma {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_round_trips() {
        let bias = LoadBias(0x7f00_0000_0000);
        let svma = Svma(0x98930);
        assert_eq!(bias.to_avma(svma), Avma(0x7f00_0009_8930));
        assert_eq!(bias.to_svma(bias.to_avma(svma)), svma);
    }
}
