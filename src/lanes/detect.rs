//! Which ISA the kernels run on. `Isa` is generated from the ISA list in
//! `lanes/mod.rs` (`isa_list!`); each lanes type detects itself
//! (`Lanes::detect`: cpuid and xgetbv on x86_64, so an OS that does not save
//! the wide registers is respected, and it works without std). The answers
//! are cached; a forced ISA the CPU or the build lacks is an error, never a
//! silent fallback. With `std`, the environment variable `NPK_MAX_CPU_ISA`
//! caps what counts as available (see `ceiling`).

use core::sync::atomic::{AtomicU32, Ordering};

use super::Lanes;
use crate::error::{Error, Result};

/// Generates `Isa` and its list-driven methods from `isa_list!`.
macro_rules! define_isa {
    (() $($(#[$doc:meta])* $v:ident = $raw:literal, $name:literal, $t:ident, $cfg:meta;)*) => {
        /// An instruction-set implementation of `Lanes`. Values are the C
        /// ABI's `npk_isa`; order (`Isa::ALL`, `rank`) is the list's, not
        /// the values'.
        #[non_exhaustive]
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Isa {
            $($(#[$doc])* $v = $raw,)*
        }

        impl Isa {
            /// Every ISA, best last (automatic selection picks the last
            /// available).
            pub const ALL: [Isa; [$(Isa::$v),*].len()] = [$(Isa::$v),*];

            /// Lower-case name (`NPK_MAX_CPU_ISA`, `quick --isa`, the
            /// adapter's `isa=`).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Isa::$v => $name,)*
                }
            }

            /// `name()` NUL-terminated (for the C ABI's `npk_isa_name`).
            pub const fn c_name(self) -> &'static core::ffi::CStr {
                match self {
                    $(Isa::$v => match core::ffi::CStr::from_bytes_with_nul(concat!($name, "\0").as_bytes()) {
                        Ok(c) => c,
                        Err(_) => panic!("ISA names have no NUL"),
                    },)*
                }
            }

            /// Asks the lanes type (uncached).
            fn probe(self) -> bool {
                match self {
                    $(Isa::$v => {
                        #[cfg($cfg)]
                        let yes = <super::$t as Lanes>::detect();
                        #[cfg(not($cfg))]
                        let yes = false;
                        yes
                    })*
                }
            }
        }
    };
}
super::isa_list!([define_isa]());

impl Isa {
    /// The ISA of a C `npk_isa` value.
    pub fn from_raw(raw: u32) -> Option<Isa> {
        Isa::ALL.iter().copied().find(|&i| i as u32 == raw)
    }

    /// The ISA named `name` (as `name()`, any case).
    pub fn parse(name: &str) -> Option<Isa> {
        Isa::ALL
            .iter()
            .copied()
            .find(|i| i.name().eq_ignore_ascii_case(name))
    }

    /// Position in `Isa::ALL` (higher = preferred by automatic selection).
    pub fn rank(self) -> usize {
        Isa::ALL.iter().position(|&i| i == self).unwrap_or(0)
    }

    /// True when this build has kernels for this ISA, this CPU runs them and
    /// the `NPK_MAX_CPU_ISA` ceiling (with `std`) allows them.
    pub fn is_available(self) -> bool {
        available(self)
    }

    /// What automatic selection picks on this machine: the best available.
    pub fn detected() -> Isa {
        detected()
    }
}

impl core::fmt::Display for Isa {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// Bit `rank` set: that ISA is available; `KNOWN`: the cache is filled.
const KNOWN: u32 = 1 << 31;
static CACHE: AtomicU32 = AtomicU32::new(0);

fn features() -> u32 {
    let c = CACHE.load(Ordering::Relaxed);
    if c & KNOWN != 0 {
        return c;
    }
    let cap = ceiling().rank();
    let f = Isa::ALL
        .iter()
        .enumerate()
        .filter(|&(rank, isa)| rank <= cap && isa.probe())
        .fold(KNOWN, |f, (rank, _)| f | 1 << rank);
    CACHE.store(f, Ordering::Relaxed);
    f
}

/// The ISA ceiling: with `std`, the environment variable `NPK_MAX_CPU_ISA`
/// (an ISA name, `Isa::name`, any case; read once), like oneDNN's
/// `ONEDNN_MAX_CPU_ISA`. ISAs after it in `Isa::ALL` count as unavailable
/// for the Rust API and the C ABI alike: automatic selection picks the best
/// at or below it and forcing one above it is `Error::IsaUnavailable`
/// (`NPK_ERR_ISA_UNAVAILABLE`). It lets a test, or a user chasing a
/// CPU-specific problem, run the narrower kernels — e.g. the whole suite on
/// the portable lanes — on a machine that has every ISA. Unset or
/// unrecognized, and without `std`: no ceiling.
fn ceiling() -> Isa {
    let last = Isa::ALL[Isa::ALL.len() - 1];
    #[cfg(feature = "std")]
    let cap = std::env::var("NPK_MAX_CPU_ISA")
        .ok()
        .and_then(|v| Isa::parse(&v))
        .unwrap_or(last);
    #[cfg(not(feature = "std"))]
    let cap = last;
    cap
}

/// True when this build has kernels for `isa`, this CPU can run them and
/// the ceiling allows them.
pub fn available(isa: Isa) -> bool {
    features() & (1 << isa.rank()) != 0
}

/// What automatic selection picks on this machine: the best available.
pub fn detected() -> Isa {
    Isa::ALL
        .iter()
        .rev()
        .copied()
        .find(|&i| available(i))
        .unwrap_or(Isa::ALL[0])
}

/// An ISA proven available on this CPU. Only `resolve` makes one, and
/// `dispatch_isa!` — the one way from an `Isa` to its lanes type — takes
/// only this, so no kernel can run on lanes the CPU lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Available(Isa);

impl Available {
    /// The proven ISA.
    pub(crate) fn isa(self) -> Isa {
        self.0
    }
}

/// Resolves an optional forced ISA.
pub(crate) fn resolve(forced: Option<Isa>) -> Result<Available> {
    match forced {
        None => Ok(Available(detected())),
        Some(isa) if available(isa) => Ok(Available(isa)),
        Some(_) => Err(Error::IsaUnavailable),
    }
}
