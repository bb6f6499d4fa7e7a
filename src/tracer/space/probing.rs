//! The probe mode of a space and the state that goes with it: int3 probes
//! need stack buffers (and may say why jump probes, asked for, do not
//! record here); jump probes need a control area and the list of what each
//! probe serves. A space is in one mode and holds only that mode's state
//! ([`Probing`]): a space whose jump probes cannot record becomes an int3
//! space for good, with the reason kept for `meta`.
//!
//! Plain data: making the control area and the buffers, which runs code in
//! the target, is the space's (`space::control`, `space::plant`).

use super::buffers::StackBuffers;
use crate::event::{MapOp, Op};
use crate::tracer::probes::jump::code::ProbeSpec;
use crate::tracer::probes::jump::control::Control;
use crate::tracer::probes::jump::layout::Called;
use crate::tracer::probes::jump::plan::Plan;

/// How the calls of a space's allocator functions are caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Catch {
    /// An int3 on each entry; `buffers`: threads copy their own stacks.
    Int3 { buffers: bool },
    /// A jump to a probe that records the call in the target, taking at
    /// most `max_frames` return addresses; its probes count memptrace as
    /// gone once its heartbeat is `alive_ticks` old (0: never; see
    /// [`crate::tracer::probes::jump::liveness`]).
    Jump { max_frames: u64, alive_ticks: u64 },
}

/// A space's probe mode, with what that mode needs.
pub enum Probing {
    Int3(Int3s),
    Jump(Jumps),
}

/// What the int3 probes of a space need.
pub struct Int3s {
    /// Where threads copy their own stacks.
    pub buffers: Buffers,
    /// Why jump probes, asked for, do not record in this space; `None`
    /// when int3 probes were asked for.
    pub fallback: Option<String>,
}

/// The stack buffers of a space with int3 probes.
pub enum Buffers {
    /// Wanted: made with the space's first trampoline area.
    ToMake,
    Made(StackBuffers),
    /// Not wanted; or tried and not made (stacks are then read with
    /// process_vm_readv); or gone with the trampoline areas; or, in a
    /// forked child, its copy of the mapping, which the parent still uses.
    Absent,
}

/// What the jump probes of a space need.
pub struct Jumps {
    pub control: ControlArea,
    max_frames: u64,
    alive_ticks: u64,
    fsgsbase: bool,
    /// What each probe serves, by its number.
    pub probes: Vec<ProbeInfo>,
}

/// The control area of a space's jump probes (see [`Control`]).
pub enum ControlArea {
    /// To be made with the space's first images.
    ToMake,
    /// Made (boxed: a space holds one, and the enum stays small).
    Made(Box<Control>),
    /// In a forked child, until it gets one of its own (its copy is shared
    /// with the parent, see `Space::adopt_control`); or gone with the
    /// trampoline areas.
    Absent,
}

/// What a jump probe serves.
#[derive(Clone, Debug)]
pub struct ProbeInfo {
    pub module_id: u64,
    /// The names sharing the function's address (see `callsite`); none for
    /// a mapping function.
    pub ops: Vec<Op>,
    /// The mapping function, for a mapping function's probe.
    pub map: Option<MapOp>,
}

impl ProbeInfo {
    /// Whether the probe records calls of `what`.
    pub fn records(&self, what: Called) -> bool {
        match what {
            Called::Alloc(op) => self.map.is_none() && self.ops.first() == Some(&op),
            Called::Map(op) => self.map == Some(op),
        }
    }
}

/// What the next jump probe of a space is made with: only a space whose
/// control area is made has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NextJump {
    /// The probe's number.
    pub id: u16,
    /// The control area's address in the target.
    pub control: u64,
    max_frames: u64,
    fsgsbase: bool,
    /// Attached: the probes give up once memptrace is gone, and no int3 may
    /// go where memptrace's death would make it fatal (see
    /// `tracer::failopen`).
    pub fail_open: bool,
}

impl NextJump {
    /// The probe finds a thread's slot by `rdfsbase`, which a thread whose
    /// thread pointer is not set yet (a static program's start, before its
    /// C library sets up TLS) executes safely; else it reads `fs:[0]`.
    pub fn reads_fs_base(&self) -> bool {
        self.fsgsbase
    }

    /// The probe for calls of `what` at the entry `plan` patches.
    pub fn spec(&self, what: Called, plan: &Plan) -> ProbeSpec {
        ProbeSpec {
            id: self.id,
            what,
            control: self.control,
            displaced: plan.displaced.clone(),
            resume: plan.resume,
            max_frames: self.max_frames,
            fsgsbase: self.fsgsbase,
        }
    }
}

impl Probing {
    /// The state of a new space whose calls are caught as `catch` says;
    /// `fsgsbase`: whether its threads may read their fs base themselves
    /// (asked only for jump probes).
    pub fn new(catch: Catch, fsgsbase: impl FnOnce() -> bool) -> Probing {
        match catch {
            Catch::Int3 { buffers } => Probing::Int3(Int3s {
                buffers: match buffers {
                    true => Buffers::ToMake,
                    false => Buffers::Absent,
                },
                fallback: None,
            }),
            Catch::Jump {
                max_frames,
                alive_ticks,
            } => Probing::Jump(Jumps {
                control: ControlArea::ToMake,
                max_frames,
                alive_ticks,
                fsgsbase: fsgsbase(),
                probes: Vec::new(),
            }),
        }
    }

    /// The state of a forked child's copy of this space: the same probes,
    /// and neither buffers nor control area of its own yet.
    pub fn fork_copy(&self) -> Probing {
        match self {
            Probing::Int3(int3s) => Probing::Int3(Int3s {
                buffers: Buffers::Absent,
                fallback: int3s.fallback.clone(),
            }),
            Probing::Jump(jumps) => Probing::Jump(Jumps {
                control: ControlArea::Absent,
                max_frames: jumps.max_frames,
                alive_ticks: jumps.alive_ticks,
                fsgsbase: jumps.fsgsbase,
                probes: jumps.probes.clone(),
            }),
        }
    }

    /// From here on int3 probes catch the space's calls, as jump probes
    /// cannot record: `why`.
    pub fn fall_back(&mut self, why: String) {
        *self = Probing::Int3(Int3s {
            buffers: Buffers::Absent,
            fallback: Some(why),
        });
    }

    /// The trampoline areas are gone, and the mappings with them.
    pub fn unmapped(&mut self) {
        match self {
            Probing::Int3(int3s) => int3s.buffers = Buffers::Absent,
            Probing::Jump(jumps) => jumps.control = ControlArea::Absent,
        }
    }

    /// Jump probes were asked for (their areas are larger).
    pub fn is_jump(&self) -> bool {
        matches!(self, Probing::Jump(_))
    }

    /// Why jump probes, asked for, do not record here.
    pub fn fallback(&self) -> Option<&str> {
        match self {
            Probing::Int3(int3s) => int3s.fallback.as_deref(),
            Probing::Jump(_) => None,
        }
    }

    /// The control area is still to be made.
    pub fn control_to_make(&self) -> bool {
        matches!(
            self,
            Probing::Jump(Jumps {
                control: ControlArea::ToMake,
                ..
            })
        )
    }

    /// The stack buffers are still to be made.
    pub fn buffers_to_make(&self) -> bool {
        matches!(
            self,
            Probing::Int3(Int3s {
                buffers: Buffers::ToMake,
                ..
            })
        )
    }

    /// The control area of the jump probes, once made.
    pub fn control(&self) -> Option<&Control> {
        match self {
            Probing::Jump(Jumps {
                control: ControlArea::Made(control),
                ..
            }) => Some(control),
            _ => None,
        }
    }

    pub fn control_mut(&mut self) -> Option<&mut Control> {
        self.recording_mut().map(|(control, _)| control)
    }

    /// The control area, once made, and what each probe serves.
    pub fn recording_mut(&mut self) -> Option<(&mut Control, &[ProbeInfo])> {
        match self {
            Probing::Jump(Jumps {
                control: ControlArea::Made(control),
                probes,
                ..
            }) => Some((control, probes)),
            _ => None,
        }
    }

    /// What jump probe `id` serves.
    pub fn probe_info(&self, id: u16) -> Option<&ProbeInfo> {
        match self {
            Probing::Jump(jumps) => jumps.probes.get(usize::from(id)),
            Probing::Int3(_) => None,
        }
    }

    /// The stack buffers, once made.
    pub fn buffers(&self) -> Option<&StackBuffers> {
        match self {
            Probing::Int3(Int3s {
                buffers: Buffers::Made(buffers),
                ..
            }) => Some(buffers),
            _ => None,
        }
    }

    pub fn buffers_mut(&mut self) -> Option<&mut StackBuffers> {
        match self {
            Probing::Int3(Int3s {
                buffers: Buffers::Made(buffers),
                ..
            }) => Some(buffers),
            _ => None,
        }
    }

    /// The stack buffers were tried: `made` when they were made.
    pub fn set_buffers(&mut self, made: Option<StackBuffers>) {
        if let Probing::Int3(int3s) = self {
            int3s.buffers = made.map_or(Buffers::Absent, Buffers::Made);
        }
    }

    /// Make `control` the control area of the jump probes; where memptrace
    /// attached, its probes give up on memptrace once its heartbeat stops.
    pub fn install_control(&mut self, control: Control) {
        if let Probing::Jump(jumps) = self {
            control.fail_open(jumps.alive_ticks);
            jumps.control = ControlArea::Made(Box::new(control));
        }
    }

    /// What the next jump probe is made with, once the control area is.
    pub fn next_jump(&self) -> Option<NextJump> {
        match self {
            Probing::Jump(Jumps {
                control: ControlArea::Made(control),
                probes,
                max_frames,
                alive_ticks,
                fsgsbase,
            }) => Some(NextJump {
                id: probes.len() as u16,
                control: control.remote,
                max_frames: *max_frames,
                fsgsbase: *fsgsbase,
                fail_open: *alive_ticks != 0,
            }),
            _ => None,
        }
    }

    /// A jump probe was planted, serving `info`: a mapping function's
    /// probe gives each thread a second slot.
    pub fn add_probe(&mut self, info: ProbeInfo) {
        if let Probing::Jump(jumps) = self {
            if info.map.is_some() {
                if let ControlArea::Made(control) = &mut jumps.control {
                    control.maps = true;
                }
            }
            jumps.probes.push(info);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const JUMP: Catch = Catch::Jump {
        max_frames: 128,
        alive_ticks: 0,
    };

    fn info(op: Op) -> ProbeInfo {
        ProbeInfo {
            module_id: 7,
            ops: vec![op],
            map: None,
        }
    }

    #[test]
    fn int3_with_buffers_wants_them_once() {
        let mut probing = Probing::new(Catch::Int3 { buffers: true }, || unreachable!());
        assert!(!probing.is_jump());
        assert!(probing.buffers_to_make());
        assert!(!probing.control_to_make());
        assert_eq!(probing.fallback(), None);
        // Tried and not made: never tried again.
        probing.set_buffers(None);
        assert!(!probing.buffers_to_make());
        assert!(probing.buffers().is_none());
        assert!(probing.next_jump().is_none());
    }

    #[test]
    fn int3_without_buffers_wants_none() {
        let probing = Probing::new(Catch::Int3 { buffers: false }, || unreachable!());
        assert!(!probing.buffers_to_make());
        assert!(probing.buffers().is_none());
    }

    #[test]
    fn jump_wants_a_control_area_and_no_buffers() {
        let mut asked = false;
        let mut probing = Probing::new(JUMP, || {
            asked = true;
            true
        });
        assert!(asked);
        assert!(probing.is_jump());
        assert!(probing.control_to_make());
        assert!(!probing.buffers_to_make());
        // No control area yet: no probe can be made, none recorded.
        assert!(probing.control().is_none());
        assert!(probing.control_mut().is_none());
        assert!(probing.recording_mut().is_none());
        assert_eq!(probing.next_jump(), None);
        // A probe booked before (a forked child's, say) is still known.
        probing.add_probe(info(Op::Malloc));
        assert!(
            probing
                .probe_info(0)
                .is_some_and(|p| p.records(Called::Alloc(Op::Malloc)))
        );
        assert!(probing.probe_info(1).is_none());
    }

    #[test]
    fn falling_back_makes_an_int3_space_for_good() {
        let mut probing = Probing::new(JUMP, || false);
        probing.add_probe(info(Op::Free));
        probing.fall_back("seccomp".into());
        assert!(!probing.is_jump());
        assert_eq!(probing.fallback(), Some("seccomp"));
        assert!(!probing.control_to_make());
        assert!(!probing.buffers_to_make());
        assert!(probing.probe_info(0).is_none());
        // No jump probe is made from here on.
        assert!(probing.next_jump().is_none());
        // Its forked children keep the reason.
        assert_eq!(probing.fork_copy().fallback(), Some("seccomp"));
    }

    #[test]
    fn a_fork_copy_has_the_probes_but_no_area_of_its_own() {
        let mut probing = Probing::new(JUMP, || true);
        probing.add_probe(info(Op::Malloc));
        probing.add_probe(ProbeInfo {
            module_id: 7,
            ops: Vec::new(),
            map: Some(MapOp::Mmap),
        });
        let copy = probing.fork_copy();
        assert!(copy.is_jump());
        // Not made again: its parent's is adopted or the child falls back.
        assert!(!copy.control_to_make());
        assert!(copy.control().is_none());
        assert!(
            copy.probe_info(1)
                .is_some_and(|p| p.records(Called::Map(MapOp::Mmap)))
        );
        assert!(
            copy.probe_info(1)
                .is_some_and(|p| !p.records(Called::Alloc(Op::Malloc)))
        );
        assert!(copy.probe_info(2).is_none());

        let int3 = Probing::new(Catch::Int3 { buffers: true }, || false);
        let copy = int3.fork_copy();
        assert!(!copy.buffers_to_make());
        assert_eq!(copy.fallback(), None);
    }

    #[test]
    fn unmapping_leaves_nothing_to_make() {
        let mut probing = Probing::new(JUMP, || false);
        probing.unmapped();
        assert!(!probing.control_to_make());
        let mut probing = Probing::new(Catch::Int3 { buffers: true }, || false);
        probing.unmapped();
        assert!(!probing.buffers_to_make());
    }

    #[test]
    fn next_jump_spec_takes_the_plan() {
        let next = NextJump {
            id: 3,
            control: 0x7000_0000,
            max_frames: 64,
            fsgsbase: true,
            fail_open: false,
        };
        let plan = Plan {
            at: 0x1000,
            displaced: Vec::new(),
            resume: 0x1005,
            int3: None,
        };
        let spec = next.spec(Called::Alloc(Op::Calloc), &plan);
        assert_eq!(
            (
                spec.id,
                spec.control,
                spec.resume,
                spec.max_frames,
                spec.fsgsbase
            ),
            (3, 0x7000_0000, 0x1005, 64, true)
        );
        assert_eq!(spec.what, Called::Alloc(Op::Calloc));
    }
}
