//! The C ABI (`include/npukern.h`, reference in `docs/c-api.md`): aclnn-shaped
//! two-phase calls — `npk_<op>_workspace_size(...)` then
//! `npk_<op>(..., workspace, workspace_bytes, exec)` — over the same front end
//! Rust callers use (`ops::*::{plan, prepare, launch}`), so validation exists
//! once. This module only reads C memory soundly (see `types`), turns
//! `npk_exec` into an `Exec` (see `exec`), and reports errors through
//! `npk_error_detail` (see `status`).
//!
//! Layout, one file per concern:
//! - `types`: the `#[repr(C)]` enums, descriptors and options, and the
//!   checked readers of C-provided structs;
//! - `status`: `Error` → `npk_status` + `npk_error_detail`, and the
//!   informational functions;
//! - `exec`: `npk_exec` → `Exec` (tiling, backend, host runner callback);
//! - `skin`: the shape every operator's two entry points share (read the
//!   inputs and options, plan; then read the outputs, prepare, launch),
//!   which each operator's `ops/<op>/capi.rs` fills with how its own
//!   arguments are read (`CapiOp`, `CapiCall`);
//! - `foreign`: the `npk_foreign_backend` table and the `Foreign` backend;
//! - `threads`: the pool behind `npk_threads_parallel_for`.
//!
//! `grad_stats` (npk_grad_stats / npk_clip_grad_norm) sizes through
//! `skin::workspace_size` like every operator; its runs, which have no
//! `OpCall`, use `exec::run` and `types::read_tensor` directly.
//!
//! No panic can cross the boundary: a panic that reached an `extern "C"`
//! function would abort the process there (Rust >= 1.81), and no input
//! reaches a panicking path (every size is computed with checked arithmetic
//! before anything is indexed).
//!
//! The header is generated from this module by cbindgen (`cbindgen.toml`);
//! `tests/header.rs` fails when the checked-in copy is stale.

pub mod exec;
pub mod foreign;
mod host_runner;
pub(crate) mod list;
pub(crate) mod skin;
pub mod status;
pub mod threads;
pub mod types;

pub use crate::ops::embedding_dense_grad::capi::npk_embedding_grad_options;
pub use foreign::{npk_foreign_backend, NPK_FOREIGN_BACKEND_MIN_SIZE};
pub use types::*;
