//! Statuses and `npk_error_detail`: turning an `Error` into what C sees, and
//! the small informational functions (`npk_status_string`, `npk_version`,
//! `npk_detected_isa`).

use core::ffi::c_char;
use core::fmt::{self, Write};

use super::types::{npk_error_detail, npk_isa, npk_status, RawIsa, RawStatus};
use crate::error::{Error, Result};

/// The C status of an error. `Error::status` is the one table of codes; this
/// only turns a code into the enum.
pub(crate) fn status_of(e: &Error) -> npk_status {
    status_from_code(e.status()).unwrap_or(npk_status::NPK_ERR_PARAM_INVALID)
}

/// The enum value with code `code`, if there is one.
fn status_from_code(code: RawStatus) -> Option<npk_status> {
    use npk_status::*;
    Some(match code {
        0 => NPK_OK,
        161001 => NPK_ERR_NULLPTR,
        161002 => NPK_ERR_PARAM_INVALID,
        161003 => NPK_ERR_DTYPE_UNSUPPORTED,
        161004 => NPK_ERR_INDEX_OUT_OF_RANGE,
        161005 => NPK_ERR_WORKSPACE_TOO_SMALL,
        161006 => NPK_ERR_SIZE_OVERFLOW,
        161007 => NPK_ERR_ISA_UNAVAILABLE,
        161008 => NPK_ERR_NONFINITE,
        361001 => NPK_ERR_BACKEND,
        _ => return None,
    })
}

/// Writes into a fixed C string buffer, dropping whatever does not fit (whole
/// characters only, so the result stays valid UTF-8) and keeping room for the
/// terminating NUL.
struct CBuf<'a> {
    out: &'a mut [c_char],
    len: usize,
}

impl<'a> CBuf<'a> {
    fn new(out: &'a mut [c_char]) -> Self {
        out.fill(0);
        CBuf { out, len: 0 }
    }
}

impl Write for CBuf<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let cap = self.out.len().saturating_sub(1); // the NUL
        for ch in s.chars() {
            let mut tmp = [0u8; 4];
            let bytes = ch.encode_utf8(&mut tmp).as_bytes();
            let Some(dst) = self.out.get_mut(self.len..self.len + bytes.len()) else {
                break;
            };
            if self.len + bytes.len() > cap {
                break;
            }
            for (d, &b) in dst.iter_mut().zip(bytes) {
                *d = b as c_char;
            }
            self.len += bytes.len();
        }
        // Never report an error: a truncated message is still a message.
        Ok(())
    }
}

/// Turns a call's result into its status and fills `detail` (if non-NULL):
/// the error's status, argument, position/value and message, or a reset
/// record on success.
///
/// # Safety
/// `detail` is NULL or points to a writable `npk_error_detail`.
pub(crate) unsafe fn report(detail: *mut npk_error_detail, r: &Result<()>) -> npk_status {
    let status = match r {
        Ok(()) => npk_status::NPK_OK,
        Err(e) => status_of(e),
    };
    if detail.is_null() {
        return status;
    }
    let mut d = npk_error_detail {
        status,
        argument: [0; 32],
        position: -1,
        value: -1,
        message: [0; 160],
    };
    if let Err(e) = r {
        let _ = CBuf::new(&mut d.argument).write_str(e.argument());
        let _ = write!(CBuf::new(&mut d.message), "{e}");
        match *e {
            Error::IndexOutOfRange {
                position, value, ..
            } => {
                d.position = i64::try_from(position).unwrap_or(i64::MAX);
                d.value = value;
            }
            // Keep the adapter's own code where a C caller can find it.
            Error::Backend { status } => d.value = i64::from(status),
            _ => {}
        }
    }
    // SAFETY: non-NULL and writable (caller); unaligned write for robustness.
    unsafe { detail.write_unaligned(d) };
    status
}

/// A static, NUL-terminated name and explanation of `status`; never NULL
/// (unknown values give "unknown status").
#[no_mangle]
pub extern "C" fn npk_status_string(status: RawStatus) -> *const c_char {
    use npk_status::*;
    let s: &'static core::ffi::CStr = match status_from_code(status) {
        Some(NPK_OK) => c"NPK_OK: success",
        Some(NPK_ERR_NULLPTR) => c"NPK_ERR_NULLPTR: a required pointer is NULL",
        Some(NPK_ERR_PARAM_INVALID) => {
            c"NPK_ERR_PARAM_INVALID: invalid rank, shape, eps, option or overlapping buffers"
        }
        Some(NPK_ERR_DTYPE_UNSUPPORTED) => c"NPK_ERR_DTYPE_UNSUPPORTED: unsupported dtype",
        Some(NPK_ERR_INDEX_OUT_OF_RANGE) => c"NPK_ERR_INDEX_OUT_OF_RANGE: an index is out of range",
        Some(NPK_ERR_WORKSPACE_TOO_SMALL) => {
            c"NPK_ERR_WORKSPACE_TOO_SMALL: the workspace is smaller than the size call said"
        }
        Some(NPK_ERR_SIZE_OVERFLOW) => c"NPK_ERR_SIZE_OVERFLOW: a size or byte count does not fit",
        Some(NPK_ERR_ISA_UNAVAILABLE) => {
            c"NPK_ERR_ISA_UNAVAILABLE: the forced ISA is not available on this CPU"
        }
        Some(NPK_ERR_NONFINITE) => c"NPK_ERR_NONFINITE: a tensor holds NaN or Inf",
        Some(NPK_ERR_BACKEND) => {
            c"NPK_ERR_BACKEND: a foreign backend's entry or the host parallel_for failed"
        }
        None => c"unknown status",
    };
    s.as_ptr()
}

/// The library version, "MAJOR.MINOR.PATCH" (static, NUL-terminated).
#[no_mangle]
pub extern "C" fn npk_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The C ABI's major version: bumped only by a change that breaks callers
/// or backends compiled against an earlier header (see docs/c-api.md,
/// "Stability"). 2 = the growable foreign table (`struct_size`).
pub const NPK_ABI_VERSION_MAJOR: u32 = 2;
/// The C ABI's minor version: bumped by additions (functions, enum values,
/// options with a zero default, foreign-table entries appended at its end).
pub const NPK_ABI_VERSION_MINOR: u32 = 13;
/// `(NPK_ABI_VERSION_MAJOR << 16) | NPK_ABI_VERSION_MINOR`, what
/// `npk_abi_version` returns for the header the library was built from.
pub const NPK_ABI_VERSION: u32 = 0x2000d;
const _: () = assert!(NPK_ABI_VERSION == (NPK_ABI_VERSION_MAJOR << 16) | NPK_ABI_VERSION_MINOR);

/// The library's C ABI version, `(major << 16) | minor`. A caller built
/// against header `NPK_ABI_VERSION` runs on this library when the majors are
/// equal and the library's minor is at least the header's.
#[no_mangle]
pub extern "C" fn npk_abi_version() -> u32 {
    NPK_ABI_VERSION
}

/// The lower-case name of an `npk_isa` value ("portable", "avx2", "avx512",
/// "avx512bf16", ...; "auto" for `NPK_ISA_AUTO`; "unknown" otherwise), as
/// `NPK_MAX_CPU_ISA` takes it. Static, NUL-terminated.
#[no_mangle]
pub extern "C" fn npk_isa_name(isa: RawIsa) -> *const c_char {
    let name: &'static core::ffi::CStr = match crate::lanes::Isa::from_raw(isa) {
        Some(i) => i.c_name(),
        None if isa == 0 => c"auto",
        None => c"unknown",
    };
    name.as_ptr()
}

/// What `NPK_ISA_AUTO` picks on this machine (at or below the environment's
/// `NPK_MAX_CPU_ISA` ceiling, if set).
#[no_mangle]
pub extern "C" fn npk_detected_isa() -> npk_isa {
    npk_isa::of(crate::lanes::Isa::detected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_its_status() {
        let all = [
            Error::NullPointer { arg: "x" },
            crate::error::invalid("x", "r"),
            crate::error::dtype_err!("x", "r"),
            Error::IndexOutOfRange {
                arg: "indices",
                position: 3,
                value: -7,
                start: 0,
                end: 4,
            },
            Error::WorkspaceTooSmall {
                needed: 10,
                given: 1,
            },
            Error::SizeOverflow { arg: "x" },
            Error::IsaUnavailable,
            Error::NonFinite,
            Error::Backend { status: 5 },
            Error::Runner {
                reason: crate::error::Reason::new("r"),
            },
        ];
        for e in all {
            assert_eq!(status_of(&e) as i32, e.status(), "{e:?}");
        }
    }

    #[test]
    fn detail_is_truncated_and_terminated() {
        let mut buf = [1 as c_char; 8];
        let _ = CBuf::new(&mut buf).write_str("abcdéfghijk");
        let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).collect();
        // "abcdé" is 6 bytes; "f" fits in the 7th; the 8th is the NUL.
        assert_eq!(&bytes, b"abcd\xc3\xa9f\0");
    }
}
