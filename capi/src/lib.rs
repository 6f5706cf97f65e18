//! The npukern C libraries. The `npk_*` functions live in `npukern::capi`
//! (compiled with the `capi` feature); this crate only links them into
//! `libnpukern.a` and `libnpukern.so`, so that Rust users of the `npukern`
//! crate never build the C libraries. Header: `include/npukern.h`.
#![deny(missing_docs)]

pub use kernels::capi;
