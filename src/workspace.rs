//! The caller's workspace: checked against a plan's size, aligned inside, and
//! carved into disjoint per-block f32 regions. The library never allocates.

use core::ffi::c_void;

use crate::error::{Error, Result};
use crate::lanes::GROUP;
use crate::tiling::align_offset;

/// A checked, aligned view of the caller's workspace (raw, so blocks running
/// on different threads can each take their own disjoint region).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Workspace {
    base: *mut u8,
    bytes: usize,
}

// SAFETY: a Workspace only hands out regions through `region`, whose callers
// guarantee disjointness between concurrent users.
unsafe impl Send for Workspace {}
// SAFETY: as above.
unsafe impl Sync for Workspace {}

impl Workspace {
    /// Checks that `given` bytes at `ptr` hold a plan needing `needed` bytes
    /// (alignment slack included); NULL is fine only when `needed == 0`.
    pub fn new(ptr: *mut c_void, given: usize, needed: u64) -> Result<Workspace> {
        let needed =
            usize::try_from(needed).map_err(|_| Error::SizeOverflow { arg: "workspace" })?;
        if given < needed {
            return Err(Error::WorkspaceTooSmall { needed, given });
        }
        if needed == 0 {
            return Ok(Workspace {
                base: core::ptr::null_mut(),
                bytes: 0,
            });
        }
        if ptr.is_null() {
            return Err(Error::NullPointer { arg: "workspace" });
        }
        let p = ptr as *mut u8;
        if (p as usize).checked_add(given).is_none() {
            return Err(Error::SizeOverflow { arg: "workspace" });
        }
        let off = align_offset(p);
        Ok(Workspace {
            // SAFETY: off < 64 and `needed` includes 64 bytes of slack, so the
            // aligned base is inside the caller's buffer.
            base: unsafe { p.add(off) },
            bytes: given - off,
        })
    }

    /// `floats` f32 at byte `offset` from the aligned base.
    ///
    /// # Safety
    /// The range must lie within the plan's workspace and must not be used by
    /// anyone else while the returned slice lives.
    pub unsafe fn region<'a>(&self, offset: usize, floats: usize) -> &'a mut [f32] {
        debug_assert!(offset + floats * 4 <= self.bytes);
        debug_assert!(offset.is_multiple_of(4));
        if floats == 0 {
            return &mut [];
        }
        // SAFETY: the caller guarantees bounds and exclusivity; the base is
        // 64-aligned and offsets are multiples of 4.
        unsafe { core::slice::from_raw_parts_mut(self.base.add(offset) as *mut f32, floats) }
    }

    /// Like `region`, for u32 scratch (counting sorts).
    ///
    /// # Safety
    /// As for `region`.
    pub unsafe fn region_u32<'a>(&self, offset: usize, len: usize) -> &'a mut [u32] {
        debug_assert!(offset + len * 4 <= self.bytes);
        if len == 0 {
            return &mut [];
        }
        // SAFETY: as in `region`.
        unsafe { core::slice::from_raw_parts_mut(self.base.add(offset) as *mut u32, len) }
    }
}

/// A read-only raw buffer of `T` shared by blocks (which read disjoint or
/// read-only parts of it).
#[derive(Debug)]
pub(crate) struct Src<T>(pub *const T);
/// A raw output buffer of `T`; blocks write disjoint rows of it.
#[derive(Debug)]
pub(crate) struct Dst<T>(pub *mut T);

impl<T> Clone for Src<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Src<T> {}
impl<T> Clone for Dst<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Dst<T> {}

// SAFETY: Src/Dst are plain addresses; the kernels guarantee that concurrent
// blocks touch disjoint rows, and validation guarantees bounds.
unsafe impl<T> Send for Src<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Src<T> {}
// SAFETY: as above.
unsafe impl<T> Send for Dst<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Dst<T> {}

impl<T> Src<T> {
    /// Address of element `at` (may be past the tensor: only for prefetch hints).
    #[inline(always)]
    pub fn addr(&self, at: usize) -> *const u8 {
        self.0.wrapping_add(at) as *const u8
    }

    /// `len` elements from `start`.
    ///
    /// # Safety
    /// In bounds of the validated tensor, and not written while the slice lives.
    #[inline(always)]
    pub unsafe fn get<'a>(&self, start: usize, len: usize) -> &'a [T] {
        if len == 0 {
            return &[];
        }
        // SAFETY: guaranteed by the caller.
        unsafe { core::slice::from_raw_parts(self.0.add(start), len) }
    }
}

impl<T> Src<T> {
    /// The 16 elements from `start`.
    ///
    /// # Safety
    /// As for `get` with `len = GROUP`.
    #[inline(always)]
    pub unsafe fn group<'a>(&self, start: usize) -> &'a [T; GROUP] {
        // SAFETY: guaranteed by the caller.
        unsafe { &*(self.0.add(start) as *const [T; GROUP]) }
    }

    /// The 32 elements from `start`.
    ///
    /// # Safety
    /// As for `get` with `len = 2 * GROUP`.
    #[inline(always)]
    pub unsafe fn pair<'a>(&self, start: usize) -> &'a [T; 2 * GROUP] {
        // SAFETY: guaranteed by the caller.
        unsafe { &*(self.0.add(start) as *const [T; 2 * GROUP]) }
    }
}

impl<T> Dst<T> {
    /// The 16 elements from `start`.
    ///
    /// # Safety
    /// As for `get` with `len = GROUP`.
    #[inline(always)]
    pub unsafe fn group<'a>(&self, start: usize) -> &'a mut [T; GROUP] {
        // SAFETY: guaranteed by the caller.
        unsafe { &mut *(self.0.add(start) as *mut [T; GROUP]) }
    }

    /// The 32 elements from `start`.
    ///
    /// # Safety
    /// As for `get` with `len = 2 * GROUP`.
    #[inline(always)]
    pub unsafe fn pair<'a>(&self, start: usize) -> &'a mut [T; 2 * GROUP] {
        // SAFETY: guaranteed by the caller.
        unsafe { &mut *(self.0.add(start) as *mut [T; 2 * GROUP]) }
    }

    /// Elements to write before element `start` begins a 64-byte line (the
    /// unit of a streaming store), at most `len`; 0 when no element can
    /// (a misaligned tensor: its stores are then ordinary ones).
    #[inline(always)]
    pub fn line_head(&self, start: usize, len: usize) -> usize {
        let size = core::mem::size_of::<T>().max(1);
        let addr = self.0.wrapping_add(start) as usize;
        let mis = addr % 64;
        if mis == 0 || !mis.is_multiple_of(size) {
            0
        } else {
            ((64 - mis) / size).min(len)
        }
    }
}

impl<T> Dst<T> {
    /// `len` elements from `start`.
    ///
    /// # Safety
    /// In bounds of the validated tensor, and no other live reference to the range.
    #[inline(always)]
    pub unsafe fn get<'a>(&self, start: usize, len: usize) -> &'a mut [T] {
        if len == 0 {
            return &mut [];
        }
        // SAFETY: guaranteed by the caller.
        unsafe { core::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// Hands out the plan's per-block arenas to the blocks that are *running*:
/// a block claims the lowest free arena and releases it when done. On an NPU
/// every AI core has its own UB; on a CPU a worker reusing one arena keeps it
/// in L2, where a fresh arena per block would stream `blocks * ub_bytes`
/// through the caches. Arena contents never carry over between blocks (each
/// block writes before it reads), so results do not depend on the claim.
/// Targets without compare-and-swap (Cortex-M0) use each block's own arena.
#[derive(Debug)]
pub(crate) struct ArenaSlots {
    #[cfg(target_has_atomic = "ptr")]
    used: core::sync::atomic::AtomicUsize,
    #[cfg(target_has_atomic = "ptr")]
    slots: u32,
}

/// A claimed arena index; released on drop.
pub(crate) struct ArenaClaim<'a> {
    #[cfg_attr(not(target_has_atomic = "ptr"), allow(dead_code))]
    slots: &'a ArenaSlots,
    /// The arena to use.
    pub index: usize,
}

#[cfg(target_has_atomic = "ptr")]
impl ArenaSlots {
    /// Slots for a plan with `blocks` arenas (at most one per bit of a
    /// `usize` are ever handed out).
    pub fn new(blocks: usize) -> Self {
        ArenaSlots {
            used: core::sync::atomic::AtomicUsize::new(0),
            slots: blocks.min(usize::BITS as usize) as u32,
        }
    }

    /// Claims a free arena for block `_b`, waiting (spinning) only when more
    /// than `usize::BITS` blocks run at once.
    pub fn claim(&self, _b: usize) -> ArenaClaim<'_> {
        use core::sync::atomic::Ordering::{AcqRel, Acquire};
        let mask = if self.slots >= usize::BITS {
            usize::MAX
        } else {
            (1usize << self.slots) - 1
        };
        loop {
            let cur = self.used.load(Acquire);
            let free = !cur & mask;
            if free == 0 {
                core::hint::spin_loop();
                continue;
            }
            let bit = free.trailing_zeros();
            if self
                .used
                .compare_exchange_weak(cur, cur | (1usize << bit), AcqRel, Acquire)
                .is_ok()
            {
                return ArenaClaim {
                    slots: self,
                    index: bit as usize,
                };
            }
        }
    }
}

#[cfg(target_has_atomic = "ptr")]
impl Drop for ArenaClaim<'_> {
    fn drop(&mut self) {
        self.slots.used.fetch_and(
            !(1usize << self.index),
            core::sync::atomic::Ordering::Release,
        );
    }
}

#[cfg(not(target_has_atomic = "ptr"))]
impl ArenaSlots {
    /// Without compare-and-swap every block keeps its own arena.
    pub fn new(_blocks: usize) -> Self {
        ArenaSlots {}
    }

    /// Block `b`'s own arena.
    pub fn claim(&self, b: usize) -> ArenaClaim<'_> {
        ArenaClaim {
            slots: self,
            index: b,
        }
    }
}
