//! The one error type. Every variant maps to an aclnn-style status code of the
//! C ABI (`Error::status`), names the offending argument, and (where there is
//! one) carries a short reason with the offending values, built without
//! allocation (`Reason`).

use core::fmt;

/// Bytes a `Reason` holds; longer text is cut at a character boundary.
/// (Kept small so `Result<T, Error>` stays a few cache lines.)
pub const REASON_CAPACITY: usize = 100;

/// A short explanation, with values (`"rank 9 is not in 1..=8"`), in a
/// fixed-capacity buffer: errors are built without allocation (`no_std`, no
/// `alloc`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Reason {
    buf: [u8; REASON_CAPACITY],
    len: u8,
}

impl Reason {
    /// A reason from static text (cut to `REASON_CAPACITY` bytes).
    pub const fn new(s: &'static str) -> Reason {
        let b = s.as_bytes();
        let mut n = if b.len() < REASON_CAPACITY {
            b.len()
        } else {
            REASON_CAPACITY
        };
        // Back off to a character boundary.
        while n < b.len() && n > 0 && (b[n] & 0xc0) == 0x80 {
            n -= 1;
        }
        let mut buf = [0u8; REASON_CAPACITY];
        let mut i = 0;
        while i < n {
            buf[i] = b[i];
            i += 1;
        }
        Reason { buf, len: n as u8 }
    }

    /// A reason formatted from `args` (what does not fit is dropped).
    pub fn format(args: fmt::Arguments<'_>) -> Reason {
        let mut r = Reason {
            buf: [0; REASON_CAPACITY],
            len: 0,
        };
        let _ = fmt::write(&mut r, args);
        r
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        // Only whole UTF-8 characters are ever stored.
        core::str::from_utf8(&self.buf[..self.len as usize]).unwrap_or("")
    }
}

impl fmt::Write for Reason {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for ch in s.chars() {
            let mut tmp = [0u8; 4];
            let bytes = ch.encode_utf8(&mut tmp).as_bytes();
            let at = self.len as usize;
            let Some(dst) = self.buf.get_mut(at..at + bytes.len()) else {
                break;
            };
            dst.copy_from_slice(bytes);
            self.len += bytes.len() as u8;
        }
        Ok(())
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl PartialEq<str> for Reason {
    fn eq(&self, o: &str) -> bool {
        self.as_str() == o
    }
}

impl PartialEq<&str> for Reason {
    fn eq(&self, o: &&str) -> bool {
        self.as_str() == *o
    }
}

/// Why a call was refused (or, for `Backend` and `Runner`, failed). On a
/// refusal no output has been written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A required pointer is NULL (C ABI only).
    NullPointer {
        /// The argument's name.
        arg: &'static str,
    },
    /// Rank, shape mismatch, eps, an option, overlapping buffers, a length.
    InvalidParam {
        /// The argument's name.
        arg: &'static str,
        /// What is wrong, with the values involved.
        reason: Reason,
    },
    /// A dtype (or dtype pairing) the operator does not take, or (C ABI) a
    /// dtype code outside `npk_dtype`.
    DtypeUnsupported {
        /// The argument's name.
        arg: &'static str,
        /// Which dtype, and what was expected.
        reason: Reason,
    },
    /// An index outside `[vocab_start, vocab_start + num_weights)` under the
    /// `Error` policy.
    IndexOutOfRange {
        /// The argument's name (`"indices"`).
        arg: &'static str,
        /// Flat position of the first bad index.
        position: u64,
        /// Its value.
        value: i64,
        /// The valid range's first value.
        start: i64,
        /// One past the valid range's last value.
        end: i64,
    },
    /// The caller's workspace is smaller than `*_workspace_size` said.
    WorkspaceTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes given.
        given: usize,
    },
    /// A size or byte count does not fit in `usize` / `i64`.
    SizeOverflow {
        /// The argument whose size overflowed.
        arg: &'static str,
    },
    /// A forced ISA this CPU lacks.
    IsaUnavailable,
    /// Non-finite values met where the caller asked for an error
    /// (`clip_grad_norm` with `error_if_nonfinite`).
    NonFinite,
    /// A foreign (adapter) backend reported failure with this status.
    Backend {
        /// The status the foreign backend returned.
        status: i32,
    },
    /// A runner broke its contract (skipped a block, ran one twice, or
    /// passed a block number out of range). Reported in the backend class
    /// (`NPK_ERR_BACKEND`): outputs may have been partly written.
    Runner {
        /// What the runner did.
        reason: Reason,
    },
}

impl Error {
    /// The C ABI status code (`npk_status`), numbered like aclnn's.
    pub const fn status(&self) -> i32 {
        match self {
            Error::NullPointer { .. } => 161001,
            Error::InvalidParam { .. } => 161002,
            Error::DtypeUnsupported { .. } => 161003,
            Error::IndexOutOfRange { .. } => 161004,
            Error::WorkspaceTooSmall { .. } => 161005,
            Error::SizeOverflow { .. } => 161006,
            Error::IsaUnavailable => 161007,
            Error::NonFinite => 161008,
            Error::Backend { .. } | Error::Runner { .. } => 361001,
        }
    }

    /// The offending argument's name ("" when none applies).
    pub const fn argument(&self) -> &'static str {
        match self {
            Error::NullPointer { arg }
            | Error::InvalidParam { arg, .. }
            | Error::DtypeUnsupported { arg, .. }
            | Error::IndexOutOfRange { arg, .. }
            | Error::SizeOverflow { arg } => arg,
            Error::WorkspaceTooSmall { .. } => "workspace",
            Error::IsaUnavailable => "isa",
            Error::NonFinite => "tensors",
            Error::Backend { .. } => "backend",
            Error::Runner { .. } => "parallel_for",
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NullPointer { arg } => write!(f, "{arg} is a NULL pointer"),
            Error::InvalidParam { arg, reason } | Error::DtypeUnsupported { arg, reason } => {
                write!(f, "{arg}: {reason}")
            }
            Error::IndexOutOfRange {
                arg,
                position,
                value,
                start,
                end,
            } => write!(
                f,
                "{arg}[{position}] = {value} is out of range (want {start} <= {arg} < {end})"
            ),
            Error::WorkspaceTooSmall { needed, given } => {
                write!(
                    f,
                    "workspace of {given} bytes is smaller than the {needed} needed"
                )
            }
            Error::SizeOverflow { arg } => write!(f, "the size of {arg} overflows"),
            Error::IsaUnavailable => write!(f, "the forced ISA is not available on this CPU"),
            Error::NonFinite => write!(f, "a tensor holds NaN or Inf"),
            Error::Backend { status } => {
                write!(f, "the foreign backend failed with status {status}")
            }
            Error::Runner { reason } => write!(f, "parallel_for: {reason}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for Error {}

/// `Result` with this crate's `Error` as the default error type (so
/// `use npukern::*` leaves `Result<T, E>` usable as usual).
pub type Result<T, E = Error> = core::result::Result<T, E>;

/// `InvalidParam` with a static reason.
pub(crate) const fn invalid(arg: &'static str, reason: &'static str) -> Error {
    Error::InvalidParam {
        arg,
        reason: Reason::new(reason),
    }
}

/// `InvalidParam` with a formatted reason: `invalid_fmt!("x", "rank {} ...", r)`.
macro_rules! invalid_fmt {
    ($arg:expr, $($t:tt)*) => {
        $crate::error::Error::InvalidParam {
            arg: $arg,
            reason: $crate::error::Reason::format(format_args!($($t)*)),
        }
    };
}
pub(crate) use invalid_fmt;

/// `DtypeUnsupported` with a formatted reason.
macro_rules! dtype_err {
    ($arg:expr, $($t:tt)*) => {
        $crate::error::Error::DtypeUnsupported {
            arg: $arg,
            reason: $crate::error::Reason::format(format_args!($($t)*)),
        }
    };
}
pub(crate) use dtype_err;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_cut_at_char_boundaries() {
        let long = "é".repeat(100);
        let r = Reason::format(format_args!("{long}"));
        assert_eq!(r.as_str().len(), REASON_CAPACITY);
        let s: &'static str =
            "ééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééé";
        let r = Reason::new(s);
        assert!(r.as_str().len() <= REASON_CAPACITY && s.starts_with(r.as_str()));
        let e = invalid_fmt!("x", "rank {} is not in 1..=8", 9);
        assert_eq!(format!("{e}"), "x: rank 9 is not in 1..=8");
    }
}
