//! What memptrace knows about the code in a process: ELF images and their
//! allocator entry points ([`elf`], found by [`locate`]: symbols, separate
//! debug files, or the machine code itself through [`signatures`]), and
//! source-level names for code addresses ([`symbolize`]), with debug files
//! from debuginfod servers ([`debuginfod`]).

pub mod callsite;
pub mod cfi;
pub mod debuginfod;
pub mod elf;
pub mod height;
pub mod locate;
pub mod names;
mod room;
pub mod signatures;
pub mod symbolize;
