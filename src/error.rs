//! The one error type. Every variant maps to an aclnn-style status code of the
//! C ABI (`Error::status`), and every variant names the offending argument.

use core::fmt;

/// Why a call was refused (or, for `Backend`, failed). On any error no output
/// has been written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
        /// What is wrong, as a short phrase.
        reason: &'static str,
    },
    /// A dtype (or dtype pairing) the operator does not take.
    DtypeUnsupported {
        /// The argument's name.
        arg: &'static str,
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
    },
    /// The caller's workspace is smaller than `workspace_size` said.
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
    /// Non-finite values met where the caller asked for an error.
    NonFinite,
    /// A foreign (adapter) backend reported failure with this status.
    Backend {
        /// The status the foreign backend returned.
        status: i32,
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
            Error::Backend { .. } => 361001,
        }
    }

    /// The offending argument's name ("" when none applies).
    pub const fn argument(&self) -> &'static str {
        match self {
            Error::NullPointer { arg }
            | Error::InvalidParam { arg, .. }
            | Error::DtypeUnsupported { arg }
            | Error::IndexOutOfRange { arg, .. }
            | Error::SizeOverflow { arg } => arg,
            Error::WorkspaceTooSmall { .. } => "workspace",
            Error::IsaUnavailable => "isa",
            Error::NonFinite => "tensors",
            Error::Backend { .. } => "backend",
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NullPointer { arg } => write!(f, "{arg} is a NULL pointer"),
            Error::InvalidParam { arg, reason } => write!(f, "{arg}: {reason}"),
            Error::DtypeUnsupported { arg } => write!(f, "{arg} has an unsupported dtype"),
            Error::IndexOutOfRange {
                arg,
                position,
                value,
            } => write!(f, "{arg}[{position}] = {value} is out of range"),
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
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for Error {}

/// Shorthand used across the crate.
pub type Result<T> = core::result::Result<T, Error>;

pub(crate) const fn invalid(arg: &'static str, reason: &'static str) -> Error {
    Error::InvalidParam { arg, reason }
}
