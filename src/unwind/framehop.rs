//! framehop over a stack copy: DWARF CFI from each image's .eh_frame (with or
//! without .eh_frame_hdr, which `gcc -static` binaries lack: framehop indexes
//! the FDEs itself) and .debug_frame (appended to .eh_frame in its format:
//! framehop would read .debug_frame only for an image without .eh_frame),
//! frame pointers where no CFI covers an address, and through signal
//! frames by the context the kernel saved (see [`super::signal`]).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder as _};

use super::debug_frame::{eh_frame_end, to_eh_frame};
use super::signal;
use super::{MappedImage, StackSample, Unwinder, WalkEnd};

pub struct FramehopUnwinder {
    unwinder: UnwinderX86_64<Arc<[u8]>>,
    cache: CacheX86_64,
    /// Start of each image's range, to remove it by range.
    starts: BTreeMap<u64, u64>,
    /// memptrace's trampoline areas in the process: a return address in one
    /// is a probe's call stub, to step over (see [`FramehopUnwinder::unwind`]).
    trampolines: Vec<Range<u64>>,
    /// The signal-return trampolines of the images (runtime addresses).
    sigreturns: BTreeSet<u64>,
}

impl Default for FramehopUnwinder {
    fn default() -> Self {
        FramehopUnwinder::new()
    }
}

impl FramehopUnwinder {
    pub fn new() -> FramehopUnwinder {
        FramehopUnwinder {
            unwinder: UnwinderX86_64::new(),
            cache: CacheX86_64::new(),
            starts: BTreeMap::new(),
            trampolines: Vec::new(),
            sigreturns: BTreeSet::new(),
        }
    }

    /// The process's trampoline areas, as they are now.
    pub fn set_trampolines(&mut self, areas: Vec<Range<u64>>) {
        self.trampolines = areas;
    }
}

impl Unwinder for FramehopUnwinder {
    fn add_image(&mut self, mapped: &MappedImage) {
        let image = &mapped.image;
        let mut info = ExplicitModuleSectionInfo {
            // ELF: SVMAs are relative to 0; avma = svma + bias.
            base_svma: 0,
            text_svma: image.text.clone(),
            got_svma: image.got.clone(),
            eh_frame_svma: image.eh_frame.as_ref().map(|s| s.svma.clone()),
            eh_frame: image.eh_frame.as_ref().map(|s| s.data.clone()),
            eh_frame_hdr_svma: image.eh_frame_hdr.as_ref().map(|s| s.svma.clone()),
            eh_frame_hdr: image.eh_frame_hdr.as_ref().map(|s| s.data.clone()),
            ..Default::default()
        };
        if let Some(debug_frame) = &image.debug_frame {
            let converted = to_eh_frame(&debug_frame.data, 0);
            if !converted.fdes.is_empty() {
                // The image's own entries keep their place (their pointers
                // are relative to it); the converted ones are absolute.
                let (svma, mut data) = match &image.eh_frame {
                    Some(eh) => (eh.svma.start, eh.data[..eh_frame_end(&eh.data)].to_vec()),
                    None => (0, Vec::new()),
                };
                data.extend(&converted.data);
                data.extend([0; 4]);
                info.eh_frame_svma = Some(svma..svma + data.len() as u64);
                info.eh_frame = Some(Arc::from(data));
                // Its search table knows only the image's own entries.
                info.eh_frame_hdr = None;
                info.eh_frame_hdr_svma = None;
            }
        }
        let module = Module::new(
            image.path.clone(),
            mapped.range.clone(),
            mapped.bias.0,
            info,
        );
        self.unwinder.add_module(module);
        self.starts.insert(mapped.range.start, mapped.range.end);
        let bias = mapped.bias.0;
        self.sigreturns.extend(
            signal::trampolines(image)
                .into_iter()
                .map(|svma| svma.wrapping_add(bias)),
        );
    }

    fn remove_image(&mut self, range: Range<u64>) {
        if self.starts.remove(&range.start).is_some() {
            self.unwinder.remove_module(range.start);
            let gone: Vec<u64> = self.sigreturns.range(range).copied().collect();
            for at in gone {
                self.sigreturns.remove(&at);
            }
        }
    }

    fn unwind(
        &mut self,
        _tid: i32,
        sample: &StackSample,
        out: &mut Vec<u64>,
        max: usize,
    ) -> WalkEnd {
        if max == 0 || sample.ip == 0 {
            return WalkEnd::Outermost;
        }
        let mut regs = UnwindRegsX86_64::new(sample.ip, sample.sp, sample.bp);
        let mut read = |addr: u64| sample.read_u64(addr).ok_or(());
        let mut ip = sample.ip;
        let mut taken = 0;
        // The frame at `ip` is one a signal interrupted: `ip` is its
        // address + 1, exact, not a return address.
        let mut interrupted = false;
        while taken < max {
            if self.trampolines.iter().any(|a| a.contains(&ip)) {
                if interrupted {
                    // memptrace's own code, interrupted: no rule for it.
                    return WalkEnd::Failed;
                }
                // A hooked function called through a probe's stub (`lea rsp,
                // [rsp-8]; call`) returns here, into memptrace's code: the
                // word below the caller's return address is the stub's, the
                // caller's return address is above it. Not a frame of the
                // program's: step over it.
                let sp = regs.sp();
                let Some(caller) = sample.read_u64(sp + 8) else {
                    return WalkEnd::Failed;
                };
                regs.set_sp(sp + 16);
                ip = caller;
                continue;
            }
            out.push(ip);
            taken += 1;
            if self.sigreturns.contains(&ip) {
                // A handler returns here: the interrupted code's registers
                // are above its frame, the CFA framehop found for it.
                let Some((next, sp, bp)) = signal::interrupted(regs.sp(), |a| sample.read_u64(a))
                else {
                    return WalkEnd::Failed;
                };
                regs = UnwindRegsX86_64::new(next - 1, sp, bp);
                ip = next;
                interrupted = true;
                continue;
            }
            let address = if std::mem::take(&mut interrupted) {
                FrameAddress::from_instruction_pointer(ip - 1)
            } else {
                match FrameAddress::from_return_address(ip) {
                    Some(address) => address,
                    None => return WalkEnd::Failed,
                }
            };
            match self
                .unwinder
                .unwind_frame(address, &mut regs, &mut self.cache, &mut read)
            {
                Ok(Some(next)) if next != 0 => ip = next,
                // The outermost frame (a zero frame pointer or return
                // address, or CFI that says there is no caller).
                Ok(_) => return WalkEnd::Outermost,
                Err(_) => return WalkEnd::Failed,
            }
        }
        WalkEnd::Outermost
    }
}
