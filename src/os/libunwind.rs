//! libunwind-ptrace, wrapped: one address space with the global cache on, and
//! accessors that fill two gaps of `_UPT_accessors`.
//!
//! 1. Registers come from the snapshot memptrace already has, never from
//!    PTRACE_PEEKUSER, and describe the *caller* of the allocator (rip = the
//!    return address, rsp just above it): at a function's first instruction that
//!    state is exact, and the allocator's own code then needs no unwind info.
//!    Register writes are refused, so libunwind can never change the target.
//! 2. libunwind-ptrace finds unwind tables only through PT_GNU_EH_FRAME
//!    (.eh_frame_hdr), which `gcc -static` executables lack, and its
//!    `_UPT_find_proc_info` calls the address space's accessors back with *its*
//!    state as their argument, not ours. So memptrace registers a [`CfiTable`]
//!    built from .eh_frame for every image; `find_proc_info` searches those with
//!    libunwind's own `dwarf_search_unwind_table`, and `access_mem` serves the
//!    table's words from memptrace's memory at an address no process can map.
//!    An image's `.debug_frame`, rewritten in `.eh_frame`'s format
//!    (`unwind::debug_frame`), is a second table whose FDEs are served from
//!    memptrace's memory too: its `segbase` is a non-canonical address whose
//!    low 32 bits are the image's start, so that libunwind's 32-bit
//!    `ip - segbase` is the offset into the image and `segbase +
//!    fde_offset` is the FDE in the copy (Gfind_proc_info-lsb.c,
//!    `dwarf_search_unwind_table`).
//!    The list of dynamically registered unwind info (`_U_dyn_info_list`, for
//!    JITs that register with libunwind) is not consulted.

use std::collections::HashMap;
use std::ffi::c_void;
use std::io;

use libc::{c_char, c_int, size_t};
use unwind_sys::{
    _UPT_accessors, _UPT_create, _UPT_destroy, UNW_EREADONLYREG, UNW_REG_IP, unw_accessors_t,
    unw_addr_space_t, unw_caching_policy_t, unw_create_addr_space, unw_cursor_t,
    unw_destroy_addr_space, unw_flush_cache, unw_get_reg, unw_init_remote, unw_proc_info_t,
    unw_set_caching_policy, unw_step, unw_word_t,
};

use super::ptrace::{Regs, Tid};

/// libunwind-x86_64.h: UNW_X86_64_RBP.
const UNW_X86_64_RBP: libc::c_int = 6;

/// A binary-search table in .eh_frame_hdr's format (`(start_ip, fde)` pairs of
/// 32-bit offsets from `segbase`), for an image without .eh_frame_hdr.
#[derive(Clone, Debug)]
pub struct CfiTable {
    /// Runtime code range the table covers.
    pub start: u64,
    pub end: u64,
    pub segbase: u64,
    /// Sorted by start offset.
    pub entries: Vec<(i32, i32)>,
    /// FDEs that are not in the target's memory: served at `segbase`.
    pub section: Option<Vec<u8>>,
}

/// Where copies of CFI sections appear to libunwind: above the tables.
pub const SYNTHETIC_CFI_BASE: u64 = 0x9000_0000_0000_0000;
/// Room per copy (its segbase carries the image's low 32 bits).
pub const SYNTHETIC_CFI_STRIDE: u64 = 1 << 36;

/// Where synthetic tables appear to libunwind: non-canonical addresses, which
/// no x86-64 process can map.
const SYNTHETIC_BASE: u64 = 0x8000_0000_0000_0000;
const SYNTHETIC_STRIDE: u64 = 1 << 32;

const UNW_INFO_FORMAT_REMOTE_TABLE: i32 = 2;

#[repr(C)]
struct RemoteTableInfo {
    name_ptr: unw_word_t,
    segbase: unw_word_t,
    table_len: unw_word_t,
    table_data: unw_word_t,
}

/// `unw_dyn_info_t` (libunwind-dynamic.h) with the remote-table member of its
/// union; the union's other members are no larger.
#[repr(C)]
struct DynInfo {
    next: *mut c_void,
    prev: *mut c_void,
    start_ip: unw_word_t,
    end_ip: unw_word_t,
    gp: unw_word_t,
    format: i32,
    pad: i32,
    load_offset: unw_word_t,
    rti: RemoteTableInfo,
    _rest: [unw_word_t; 2],
}

/// `unw_accessors_t` with every field public (unwind-sys hides access_fpreg).
#[repr(C)]
#[derive(Clone, Copy)]
struct Accessors {
    find_proc_info: *const c_void,
    put_unwind_info: *const c_void,
    get_dyn_info_list_addr: *const c_void,
    access_mem: *const c_void,
    access_reg: *const c_void,
    access_fpreg: *const c_void,
    resume: *const c_void,
    get_proc_name: *const c_void,
}

unsafe extern "C" {
    fn _UPT_access_mem(
        asp: unw_addr_space_t,
        addr: unw_word_t,
        val: *mut unw_word_t,
        write: c_int,
        arg: *mut c_void,
    ) -> c_int;
    fn _UPT_get_proc_name(
        asp: unw_addr_space_t,
        addr: unw_word_t,
        buf: *mut c_char,
        len: size_t,
        off: *mut unw_word_t,
        arg: *mut c_void,
    ) -> c_int;
    #[link_name = "_Ux86_64_dwarf_search_unwind_table"]
    fn dwarf_search_unwind_table(
        asp: unw_addr_space_t,
        ip: unw_word_t,
        di: *mut DynInfo,
        pi: *mut unw_proc_info_t,
        need_unwind_info: c_int,
        arg: *mut c_void,
    ) -> c_int;
}

/// What every accessor receives as `arg` during one unwind.
struct CallContext<'a> {
    upt: *mut c_void,
    regs: &'a Regs,
    tables: &'a [CfiTable],
}

/// A libunwind remote address space for one traced process.
pub struct Libunwind {
    space: unw_addr_space_t,
    /// libunwind keeps a pointer to the accessors: boxed so it never moves.
    _accessors: Box<Accessors>,
    /// _UPT state per thread; it caches the last ELF image it opened.
    upt: HashMap<Tid, *mut c_void>,
    tables: Vec<CfiTable>,
    next_synthetic: u64,
}

// SAFETY: the address space and UPT handles are only used by the thread that
// owns the `Libunwind` (the tracer thread), one call at a time.
unsafe impl Send for Libunwind {}

impl Libunwind {
    pub fn new() -> io::Result<Libunwind> {
        // SAFETY: reading a static table of function pointers.
        let upt: &unw_accessors_t = unsafe { &_UPT_accessors };
        // SAFETY: unw_accessors_t and Accessors have the same C layout.
        let mut accessors: Accessors = unsafe { std::mem::transmute_copy(upt) };
        accessors.find_proc_info = find_proc_info as *const c_void;
        accessors.get_dyn_info_list_addr = get_dyn_info_list_addr as *const c_void;
        accessors.access_mem = access_mem as *const c_void;
        accessors.access_reg = access_reg as *const c_void;
        accessors.get_proc_name = get_proc_name as *const c_void;
        let accessors = Box::new(accessors);
        // SAFETY: the accessors outlive the address space (destroyed in Drop).
        let space = unsafe {
            unw_create_addr_space(&*accessors as *const Accessors as *mut unw_accessors_t, 0)
        };
        if space.is_null() {
            return Err(io::Error::other(
                "libunwind: cannot create an address space",
            ));
        }
        // SAFETY: valid address space.
        unsafe { unw_set_caching_policy(space, unw_caching_policy_t::UNW_CACHE_GLOBAL) };
        Ok(Libunwind {
            space,
            _accessors: accessors,
            upt: HashMap::new(),
            tables: Vec::new(),
            next_synthetic: 0,
        })
    }

    pub fn add_table(&mut self, table: CfiTable) {
        self.tables.push(table);
    }

    /// A `segbase` for a table with its own section, for an image starting
    /// at `start`: unused by any table so far.
    pub fn synthetic_segbase(&mut self, start: u64) -> u64 {
        self.next_synthetic += 1;
        SYNTHETIC_CFI_BASE + self.next_synthetic * SYNTHETIC_CFI_STRIDE + (start & 0xffff_ffff)
    }

    /// Forget what is cached about `range` (an image was unmapped).
    pub fn forget(&mut self, start: u64, end: u64) {
        self.tables.retain(|t| t.end <= start || t.start >= end);
        // SAFETY: valid address space.
        unsafe { unw_flush_cache(self.space, start, end) };
    }

    /// A thread is gone: release its state.
    pub fn forget_thread(&mut self, tid: Tid) {
        if let Some(upt) = self.upt.remove(&tid) {
            // SAFETY: created by _UPT_create, destroyed once.
            unsafe { _UPT_destroy(upt) };
        }
    }

    /// Unwind the stopped thread `tid` from the caller state in `caller`
    /// (rip = a return address), appending up to `max` return addresses.
    /// Some(true) at the outermost frame (a zero return address or frame
    /// pointer) or `max`, Some(false) when a step failed, None when
    /// libunwind ended the walk with the frame pointer still set.
    pub fn unwind(
        &mut self,
        tid: Tid,
        caller: &Regs,
        out: &mut Vec<u64>,
        max: usize,
    ) -> Option<bool> {
        let upt = *self.upt.entry(tid).or_insert_with(|| {
            // SAFETY: plain allocation of libunwind's per-thread state.
            unsafe { _UPT_create(tid) }
        });
        if upt.is_null() {
            return Some(false);
        }
        let mut ctx = CallContext {
            upt,
            regs: caller,
            tables: &self.tables,
        };
        let arg = &mut ctx as *mut CallContext as *mut c_void;
        let mut cursor = std::mem::MaybeUninit::<unw_cursor_t>::uninit();
        // SAFETY: the cursor is initialised by unw_init_remote before use; `ctx`
        // outlives every accessor call made through the cursor.
        unsafe {
            if unw_init_remote(cursor.as_mut_ptr(), self.space, arg) < 0 {
                return Some(false);
            }
            let cursor = cursor.assume_init_mut();
            while out.len() < max {
                let mut ip: unw_word_t = 0;
                // Past the outermost frame its frame-pointer fallback can
                // produce garbage: no user-space code lies at or above 2^56
                // (the limit with 5-level paging).
                if unw_get_reg(cursor, UNW_REG_IP, &mut ip) < 0 || ip >= 1 << 56 {
                    return Some(false);
                }
                if ip == 0 {
                    return Some(true);
                }
                out.push(ip);
                match unw_step(cursor) {
                    0 => {
                        let mut bp: unw_word_t = 0;
                        let read = unw_get_reg(cursor, UNW_X86_64_RBP, &mut bp);
                        return (read == 0 && bp == 0).then_some(true);
                    }
                    n if n < 0 => return Some(false),
                    _ => {}
                }
            }
        }
        Some(true)
    }
}

impl Drop for Libunwind {
    fn drop(&mut self) {
        for (_, upt) in self.upt.drain() {
            // SAFETY: created by _UPT_create, destroyed once.
            unsafe { _UPT_destroy(upt) };
        }
        // SAFETY: created in new(), destroyed once.
        unsafe { unw_destroy_addr_space(self.space) };
    }
}

/// # Safety
/// `arg` is the `CallContext` passed to unw_init_remote.
unsafe fn context<'a>(arg: *mut c_void) -> &'a CallContext<'a> {
    unsafe { &*(arg as *const CallContext) }
}

unsafe extern "C" fn find_proc_info(
    asp: unw_addr_space_t,
    ip: unw_word_t,
    pi: *mut unw_proc_info_t,
    need_unwind_info: c_int,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: libunwind passes back our own arg.
    let ctx = unsafe { context(arg) };
    // An image may have two tables (.eh_frame, .debug_frame): the first
    // that knows the address.
    for (i, table) in ctx
        .tables
        .iter()
        .enumerate()
        .filter(|(_, t)| t.start <= ip && ip < t.end)
    {
        let mut di = DynInfo {
            next: std::ptr::null_mut(),
            prev: std::ptr::null_mut(),
            start_ip: table.start,
            end_ip: table.end,
            gp: 0,
            format: UNW_INFO_FORMAT_REMOTE_TABLE,
            pad: 0,
            load_offset: 0,
            rti: RemoteTableInfo {
                name_ptr: 0,
                segbase: table.segbase,
                // In words; one (i32, i32) entry is one 64-bit word.
                table_len: table.entries.len() as unw_word_t,
                table_data: SYNTHETIC_BASE + i as u64 * SYNTHETIC_STRIDE,
            },
            _rest: [0; 2],
        };
        // SAFETY: forwarding libunwind's own pointers with a valid DynInfo.
        let found =
            unsafe { dwarf_search_unwind_table(asp, ip, &mut di, pi, need_unwind_info, arg) };
        if found != -unwind_sys::UNW_ENOINFO {
            return found;
        }
    }
    -unwind_sys::UNW_ENOINFO
}

unsafe extern "C" fn get_dyn_info_list_addr(
    _asp: unw_addr_space_t,
    _addr: *mut unw_word_t,
    _arg: *mut c_void,
) -> c_int {
    -unwind_sys::UNW_ENOINFO
}

unsafe extern "C" fn access_mem(
    asp: unw_addr_space_t,
    addr: unw_word_t,
    val: *mut unw_word_t,
    write: c_int,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: libunwind passes back our own arg.
    let ctx = unsafe { context(arg) };
    if write != 0 {
        return -UNW_EREADONLYREG;
    }
    if addr >= SYNTHETIC_CFI_BASE {
        let section = ctx.tables.iter().find_map(|t| {
            let data = t.section.as_ref()?;
            let at = usize::try_from(addr.checked_sub(t.segbase)?).ok()?;
            (at < data.len()).then_some((data, at))
        });
        let Some((data, at)) = section else {
            return -unwind_sys::UNW_EINVAL;
        };
        let mut word = [0u8; 8];
        let n = (data.len() - at).min(8);
        word[..n].copy_from_slice(&data[at..at + n]);
        // SAFETY: libunwind gives a valid out pointer.
        unsafe { *val = u64::from_le_bytes(word) };
        return 0;
    }
    if addr >= SYNTHETIC_BASE {
        let index = ((addr - SYNTHETIC_BASE) / SYNTHETIC_STRIDE) as usize;
        let word = ((addr - SYNTHETIC_BASE) % SYNTHETIC_STRIDE / 8) as usize;
        let Some(&(start, fde)) = ctx.tables.get(index).and_then(|t| t.entries.get(word)) else {
            return -unwind_sys::UNW_EINVAL;
        };
        // SAFETY: libunwind gives a valid out pointer.
        unsafe { *val = (start as u32 as u64) | ((fde as u32 as u64) << 32) };
        return 0;
    }
    // SAFETY: forwarding to libunwind-ptrace with its own state.
    unsafe { _UPT_access_mem(asp, addr, val, 0, ctx.upt) }
}

/// libunwind's x86-64 register numbers (libunwind-x86_64.h, UNW_X86_64_*).
fn register(regs: &Regs, num: c_int) -> Option<u64> {
    Some(match num {
        0 => regs.rax,
        1 => regs.rdx,
        2 => regs.rcx,
        3 => regs.rbx,
        4 => regs.rsi,
        5 => regs.rdi,
        6 => regs.rbp,
        7 => regs.rsp,
        8 => regs.r8,
        9 => regs.r9,
        10 => regs.r10,
        11 => regs.r11,
        12 => regs.r12,
        13 => regs.r13,
        14 => regs.r14,
        15 => regs.r15,
        16 => regs.rip,
        _ => return None,
    })
}

unsafe extern "C" fn access_reg(
    _asp: unw_addr_space_t,
    num: c_int,
    val: *mut unw_word_t,
    write: c_int,
    arg: *mut c_void,
) -> c_int {
    if write != 0 {
        return -UNW_EREADONLYREG;
    }
    // SAFETY: libunwind passes back our own arg.
    let ctx = unsafe { context(arg) };
    match register(ctx.regs, num) {
        Some(v) => {
            // SAFETY: libunwind gives a valid out pointer.
            unsafe { *val = v };
            0
        }
        None => -unwind_sys::UNW_EBADREG,
    }
}

unsafe extern "C" fn get_proc_name(
    asp: unw_addr_space_t,
    addr: unw_word_t,
    buf: *mut c_char,
    len: size_t,
    off: *mut unw_word_t,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: libunwind passes back our own arg.
    let ctx = unsafe { context(arg) };
    // SAFETY: forwarding to libunwind-ptrace with its own state.
    unsafe { _UPT_get_proc_name(asp, addr, buf, len, off, ctx.upt) }
}
