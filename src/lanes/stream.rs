//! Byte-level streaming (non-temporal) fills and copies, for outputs too
//! large to be read back from cache: they skip the destination's
//! read-for-ownership. SSE2 16-byte stores (baseline on x86_64; the CPU's
//! write-combining buffers merge them into whole lines), ordinary stores
//! elsewhere and for the unaligned head and tail. Bits are those of
//! `fill(0)` / `copy_from_slice`; the caller issues `Lanes::stream_fence`
//! after its last streaming store.

/// Bytes before `p` is 16-byte aligned, at most `len`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn head(p: *const u8, len: usize) -> usize {
    (p.align_offset(16)).min(len)
}

/// `dst.fill(0)`.
#[inline(always)]
pub fn stream_zero(dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{__m128i, _mm_setzero_si128, _mm_stream_si128};
        let h = head(dst.as_ptr(), dst.len());
        let (a, rest) = dst.split_at_mut(h);
        a.fill(0);
        let (body, tail) = rest.as_chunks_mut::<16>();
        for c in body {
            // SAFETY: 16 writable bytes, 16-byte aligned (after the head);
            // SSE2 is baseline on x86_64.
            unsafe { _mm_stream_si128(c.as_mut_ptr() as *mut __m128i, _mm_setzero_si128()) };
        }
        tail.fill(0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.fill(0);
}

/// `dst.copy_from_slice(src)` (equal lengths; otherwise the shorter length).
#[inline(always)]
pub fn stream_copy(dst: &mut [u8], src: &[u8]) {
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let h = head(dst.as_ptr(), n);
        let (da, drest) = dst.split_at_mut(h);
        let (sa, srest) = src.split_at(h);
        da.copy_from_slice(sa);
        let (db, dt) = drest.as_chunks_mut::<16>();
        let (sb, st) = srest.as_chunks::<16>();
        for (d, s) in db.iter_mut().zip(sb) {
            // SAFETY: 16 readable and 16 writable (aligned) bytes; SSE2 is
            // baseline on x86_64.
            unsafe {
                let v = _mm_loadu_si128(s.as_ptr() as *const __m128i);
                _mm_stream_si128(d.as_mut_ptr() as *mut __m128i, v)
            };
        }
        dt.copy_from_slice(st);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_and_copies_every_alignment_and_length() {
        let src: [u8; 200] = core::array::from_fn(|i| (i * 7 + 1) as u8);
        for off in 0..20 {
            for len in [0, 1, 15, 16, 17, 31, 64, 100, 170] {
                let mut buf = [0xAAu8; 200];
                stream_copy(&mut buf[off..off + len], &src[..len]);
                assert_eq!(&buf[off..off + len], &src[..len]);
                assert!(buf[..off]
                    .iter()
                    .chain(&buf[off + len..])
                    .all(|&b| b == 0xAA));
                stream_zero(&mut buf[off..off + len]);
                assert!(buf[off..off + len].iter().all(|&b| b == 0));
                assert!(buf[..off]
                    .iter()
                    .chain(&buf[off + len..])
                    .all(|&b| b == 0xAA));
            }
        }
    }
}
