//! The no_std proof: every npukern operator, run on stack buffers with
//! fixed-seed data, checked against the library's f64 reference model (within
//! the documented tolerances) or against values computed here, and hashed bit
//! for bit against `expected_hashes.txt` (produced on x86_64, compared on
//! every target: the bits must not depend on the architecture).
//!
//! `#![no_std]`, no `alloc`: the library is linked with default features off.
#![no_std]
#![deny(missing_docs)]

mod adamw;
pub mod api;
mod ce_options;
mod cross_entropy;
pub mod data;
mod elementwise;
mod embedding;
mod grad_health;
pub mod hash;
mod norms;
pub mod report;

pub use report::{Checker, Outcome};

/// Runs every check, printing one line per check to `out`. With `bless`, a
/// hash that differs from `expected_hashes.txt` is printed, not counted as a
/// failure.
pub fn run_all(out: &mut dyn core::fmt::Write, bless: bool) -> Outcome {
    let mut c = Checker::new(out, bless);
    norms::run(&mut c);
    embedding::run(&mut c);
    grad_health::run(&mut c);
    elementwise::run(&mut c);
    cross_entropy::run(&mut c);
    adamw::run(&mut c);
    c.outcome()
}
