//! Which ISA the kernels run on. Detection works without std (cpuid and
//! xgetbv, so an OS that does not save the wide registers is respected) and is
//! cached; a forced ISA the CPU or the build lacks is an error, never a silent
//! fallback.

use core::sync::atomic::{AtomicU8, Ordering};

use crate::error::{Error, Result};

/// An instruction-set implementation of `Lanes`. Values are the C ABI's `npk_isa`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// `wide` lanes: SSE2 on x86_64, NEON on aarch64, scalar elsewhere.
    Portable = 1,
    /// AVX2 + FMA + F16C (x86_64); FMA is enabled but never used.
    Avx2 = 2,
    /// AVX-512F and BW (with AVX2, FMA, F16C) on x86_64.
    Avx512 = 3,
    /// `Avx512` with AVX512-BF16 (and DQ, VL): bf16 rounding in hardware
    /// (Zen 4, Sapphire Rapids and later), the same bits.
    Avx512Bf16 = 4,
}

impl Isa {
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    /// Every ISA, best last (automatic selection picks the last available).
    pub const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

    /// The ISA of a C `npk_isa` value (1..=4).
    pub fn from_raw(raw: u32) -> Option<Isa> {
        Isa::ALL.into_iter().find(|&i| i as u32 == raw)
    }

    /// The ISA named `name` (as `name()`, any case).
    pub fn parse(name: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(name))
    }

    /// True when this build has kernels for this ISA and this CPU runs them.
    pub fn is_available(self) -> bool {
        available(self)
    }

    /// What automatic selection picks on this machine: the widest available.
    pub fn detected() -> Isa {
        detected()
    }
}

const AVX2: u8 = 1;
const AVX512: u8 = 2;
const AVX512BF16: u8 = 4;
const KNOWN: u8 = 0x80;
static CACHE: AtomicU8 = AtomicU8::new(0);

#[cfg(target_arch = "x86_64")]
fn probe() -> u8 {
    use core::arch::x86_64::{__cpuid, __cpuid_count, _xgetbv};
    let (max, l1) = (__cpuid(0).eax, __cpuid(1));
    let osxsave = l1.ecx & (1 << 27) != 0;
    if max < 7 || !osxsave {
        return 0;
    }
    // SAFETY: OSXSAVE is set, so xgetbv is enabled by the OS.
    let xcr0 = unsafe { _xgetbv(0) };
    let ymm_saved = xcr0 & 0b110 == 0b110;
    let zmm_saved = ymm_saved && xcr0 & 0xe0 == 0xe0;
    let (fma, avx, f16c) = (
        l1.ecx & (1 << 12) != 0,
        l1.ecx & (1 << 28) != 0,
        l1.ecx & (1 << 29) != 0,
    );
    let l7 = __cpuid_count(7, 0); // leaf 7 exists: max >= 7
    let (avx2, avx512f, avx512bw) = (
        l7.ebx & (1 << 5) != 0,
        l7.ebx & (1 << 16) != 0,
        l7.ebx & (1 << 30) != 0,
    );
    let (avx512dq, avx512vl) = (l7.ebx & (1 << 17) != 0, l7.ebx & (1 << 31) != 0);
    // AVX512_BF16 is leaf 7, sub-leaf 1, EAX bit 5 (when that sub-leaf exists).
    let avx512bf16 = l7.eax >= 1 && __cpuid_count(7, 1).eax & (1 << 5) != 0;
    let mut f = 0;
    if ymm_saved && avx && fma && f16c && avx2 {
        f |= AVX2;
        if zmm_saved && avx512f && avx512bw {
            f |= AVX512;
            if avx512dq && avx512vl && avx512bf16 {
                f |= AVX512BF16;
            }
        }
    }
    f
}

#[cfg(not(target_arch = "x86_64"))]
fn probe() -> u8 {
    0
}

fn features() -> u8 {
    let c = CACHE.load(Ordering::Relaxed);
    if c & KNOWN != 0 {
        return c;
    }
    let f = probe() | KNOWN;
    CACHE.store(f, Ordering::Relaxed);
    f
}

/// True when this build has kernels for `isa` and this CPU can run them.
pub fn available(isa: Isa) -> bool {
    match isa {
        Isa::Portable => true,
        Isa::Avx2 => cfg!(target_arch = "x86_64") && features() & AVX2 != 0,
        Isa::Avx512 => cfg!(target_arch = "x86_64") && features() & AVX512 != 0,
        Isa::Avx512Bf16 => cfg!(target_arch = "x86_64") && features() & AVX512BF16 != 0,
    }
}

/// What automatic selection picks on this machine: the best available.
pub fn detected() -> Isa {
    Isa::ALL
        .into_iter()
        .rev()
        .find(|&i| available(i))
        .unwrap_or(Isa::Portable)
}

/// Resolves an optional forced ISA.
pub fn resolve(forced: Option<Isa>) -> Result<Isa> {
    match forced {
        None => Ok(detected()),
        Some(isa) if available(isa) => Ok(isa),
        Some(_) => Err(Error::IsaUnavailable),
    }
}
