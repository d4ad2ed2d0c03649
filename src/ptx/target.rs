//! What a module's `.target` offers: a set of instruction families, not a rank.
//!
//! Architectures are not totally ordered by capability: `sm_90a` has `wgmma` and
//! `setmaxnreg`, `sm_100a` keeps `setmaxnreg` and the bulk tensor copies but has no
//! `wgmma`, and a plain `sm_90` module may use neither. So every instruction method
//! records the [`Feature`] it needs, and [`super::Module::push`] checks the kernel's set
//! against [`Target::features`].

use std::fmt;

/// An instruction family that only some targets have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Feature {
    /// `mma.sync` f16/bf16, `ldmatrix`, `cp.async` (sm_80).
    Ampere = 0,
    /// `mma.sync` with e4m3 inputs and `cvt ... e4m3x2` (sm_89).
    Fp8 = 1,
    /// mbarrier `try_wait` and transaction counts, `cp.async.bulk.tensor`, `elect.sync`,
    /// `fence.proxy.async`, `stmatrix`, `griddepcontrol` (sm_90).
    Hopper = 2,
    /// Warpgroup MMA (`wgmma.*`): sm_90a only.
    Wgmma = 3,
    /// Register reallocation (`setmaxnreg`): sm_90a and the sm_100a family.
    Setmaxnreg = 4,
}

impl Feature {
    /// What the feature stands for, for error messages.
    pub fn name(self) -> &'static str {
        match self {
            Feature::Ampere => "mma.sync/ldmatrix/cp.async",
            Feature::Fp8 => "fp8 mma.sync and cvt e4m3x2",
            Feature::Hopper => "mbarrier try_wait, TMA, elect.sync, stmatrix",
            Feature::Wgmma => "wgmma",
            Feature::Setmaxnreg => "setmaxnreg",
        }
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of [`Feature`]s (a bit per feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Features(u32);

impl Features {
    pub const NONE: Features = Features(0);

    pub const fn of(list: &[Feature]) -> Features {
        let mut bits = 0;
        let mut i = 0;
        while i < list.len() {
            bits |= 1 << list[i] as u32;
            i += 1;
        }
        Features(bits)
    }

    pub fn with(self, f: Feature) -> Features {
        Features(self.0 | 1 << f as u32)
    }

    pub fn contains(self, f: Feature) -> bool {
        self.0 & (1 << f as u32) != 0
    }

    /// Every feature, in a stable order.
    pub fn iter(self) -> impl Iterator<Item = Feature> {
        [
            Feature::Ampere,
            Feature::Fp8,
            Feature::Hopper,
            Feature::Wgmma,
            Feature::Setmaxnreg,
        ]
        .into_iter()
        .filter(move |&f| self.contains(f))
    }

    /// The first feature of `self` that `other` lacks.
    pub fn first_missing_from(self, other: Features) -> Option<Feature> {
        self.iter().find(|&f| !other.contains(f))
    }
}

/// The `.target` of a module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Ampere and up: `mma.sync`, `cp.async`, `ldmatrix`. Runs on sm_80 through sm_90.
    Sm80,
    /// Ada: adds FP8 `mma.sync` and `cvt ... e4m3x2`.
    Sm89,
    /// Hopper, portable subset: TMA, mbarrier transactions, `stmatrix`; no `wgmma`.
    Sm90,
    /// Hopper with arch-specific features (`wgmma`, `setmaxnreg`); runs only on CC 9.0.
    Sm90a,
    /// Blackwell datacenter, arch-specific: `setmaxnreg` and TMA, but no `wgmma`.
    Sm100a,
}

impl Target {
    /// The spelling in `.target` and in `ptxas -arch`.
    pub fn name(self) -> &'static str {
        match self {
            Target::Sm80 => "sm_80",
            Target::Sm89 => "sm_89",
            Target::Sm90 => "sm_90",
            Target::Sm90a => "sm_90a",
            Target::Sm100a => "sm_100a",
        }
    }

    /// The instruction families a module of this target may use.
    pub fn features(self) -> Features {
        use Feature::*;
        match self {
            Target::Sm80 => Features::of(&[Ampere]),
            Target::Sm89 => Features::of(&[Ampere, Fp8]),
            Target::Sm90 => Features::of(&[Ampere, Fp8, Hopper]),
            Target::Sm90a => Features::of(&[Ampere, Fp8, Hopper, Wgmma, Setmaxnreg]),
            Target::Sm100a => Features::of(&[Ampere, Fp8, Hopper, Setmaxnreg]),
        }
    }

    /// The PTX ISA version the module declares: the lowest that has the target and
    /// every family flashcore emits for it (fp8 `mma.sync` needs 8.4; sm_100a 8.6).
    /// Drivers from CUDA 12.4 (12.7 for sm_100a) accept it.
    pub fn ptx_version(self) -> (u32, u32) {
        match self {
            Target::Sm100a => (8, 6),
            _ => (8, 4),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_feature_sets_not_a_rank() {
        assert!(Target::Sm90a.features().contains(Feature::Wgmma));
        assert!(!Target::Sm100a.features().contains(Feature::Wgmma));
        assert!(Target::Sm100a.features().contains(Feature::Setmaxnreg));
        assert!(!Target::Sm90.features().contains(Feature::Setmaxnreg));
        assert!(!Target::Sm80.features().contains(Feature::Fp8));
        let wg = Features::NONE.with(Feature::Ampere).with(Feature::Wgmma);
        assert_eq!(
            wg.first_missing_from(Target::Sm100a.features()),
            Some(Feature::Wgmma)
        );
        assert_eq!(wg.first_missing_from(Target::Sm90a.features()), None);
    }
}
