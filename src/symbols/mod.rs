//! What memptrace knows about the code in a process: ELF images and their
//! allocator entry points ([`elf`]), and source-level names for code addresses
//! ([`symbolize`]).

pub mod elf;
pub mod symbolize;
