//! Which ISA the kernels run on. Auto-detection picks the best one this build
//! has an implementation for; a forced ISA the CPU (or this build) lacks is an
//! error, never a silent fallback.

use crate::error::{Error, Result};

/// An instruction-set implementation of `Lanes`. Values are the C ABI's `npk_isa`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// `wide` lanes: SSE2 on x86_64, NEON on aarch64, scalar elsewhere.
    Portable = 1,
    /// AVX2 + FMA + F16C (x86_64).
    Avx2 = 2,
    /// AVX-512F/BW (x86_64).
    Avx512 = 3,
}

impl Isa {
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// True when this build has kernels for `isa` and this CPU can run them.
pub fn available(isa: Isa) -> bool {
    matches!(isa, Isa::Portable)
}

/// What automatic selection picks on this machine.
pub fn detected() -> Isa {
    Isa::Portable
}

/// Resolves an optional forced ISA.
pub fn resolve(forced: Option<Isa>) -> Result<Isa> {
    match forced {
        None => Ok(detected()),
        Some(isa) if available(isa) => Ok(isa),
        Some(_) => Err(Error::IsaUnavailable),
    }
}
