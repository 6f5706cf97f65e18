//! Nothing to link: this package holds the header check (`tests/header.rs`)
//! and the driver of the C/C++ programs (`tests/ffi.rs`), so that their
//! dependencies (cbindgen) stay out of the kernel crate's graph.
