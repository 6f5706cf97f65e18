//! `npk_exec` → `Exec`: the tiling machine model, the backend, and the host
//! runner callback adapted into a `Runner`. Every exported operator goes
//! through `run`, which also fills `npk_error_detail`.

use super::foreign::{npk_foreign_backend, Foreign};
use super::host_runner::HostRunner;
use super::status::report;
use super::types::{
    npk_error_detail, npk_exec, npk_status, NPK_OUTPUTS_FRESH, NPK_OUTPUTS_RESIDENT,
};
use crate::backend::{Backend, Cpu, Reference};
use crate::error::{invalid, Error, Result};
use crate::lanes::{detect, Isa};
use crate::ops::Exec;
use crate::tiling::{OutputPages, UbConfig, DEFAULT_BLOCKS, DEFAULT_UB_BYTES};

/// Which backend `npk_exec.backend` names.
#[derive(Clone, Copy)]
enum Kind {
    Cpu,
    Reference,
    Foreign(npk_foreign_backend),
}

/// A validated copy of an `npk_exec`.
pub(crate) struct ExecConfig {
    ub: UbConfig,
    isa: Option<Isa>,
    kind: Kind,
    runner: HostRunner,
    outputs: OutputPages,
}

/// Reads `exec->detail` (NULL exec: none).
///
/// # Safety
/// `exec` is NULL or points to a readable `npk_exec`.
unsafe fn detail_of(exec: *const npk_exec) -> *mut npk_error_detail {
    if exec.is_null() {
        return core::ptr::null_mut();
    }
    // SAFETY: non-NULL and readable (caller).
    unsafe { core::ptr::addr_of!((*exec).detail).read_unaligned() }
}

impl ExecConfig {
    /// Validates an `npk_exec`; NULL is the serial CPU backend with defaults.
    ///
    /// # Safety
    /// `exec` is NULL or points to a readable `npk_exec` whose `foreign` is
    /// NULL or points to an `npk_foreign_backend` readable for its
    /// `struct_size` bytes.
    unsafe fn read(exec: *const npk_exec) -> Result<ExecConfig> {
        let mut cfg = ExecConfig {
            ub: UbConfig::default(),
            isa: None,
            kind: Kind::Cpu,
            runner: HostRunner::new(None, core::ptr::null_mut()),
            outputs: OutputPages::Unknown,
        };
        if exec.is_null() {
            return Ok(cfg);
        }
        // SAFETY: non-NULL and readable (caller). All fields are integers,
        // pointers or `Option<fn>`, valid for every bit pattern C can store
        // (a C function pointer is NULL or non-NULL).
        let e = unsafe { exec.read_unaligned() };
        if e.ub_bytes != 0 {
            cfg.ub.ub_bytes =
                usize::try_from(e.ub_bytes).map_err(|_| Error::SizeOverflow { arg: "ub_bytes" })?;
        } else {
            cfg.ub.ub_bytes = DEFAULT_UB_BYTES;
        }
        cfg.ub.blocks = if e.blocks == 0 {
            DEFAULT_BLOCKS
        } else {
            e.blocks
        };
        let forced = match e.isa {
            0 => None,
            raw => Some(Isa::from_raw(raw).ok_or_else(|| invalid("isa", "not an npk_isa value"))?),
        };
        // A forced ISA is checked whichever backend runs, so the same exec
        // fails the same way everywhere (one above the NPK_MAX_CPU_ISA
        // ceiling is unavailable, like one the CPU lacks); `None` lets the
        // CPU backend detect.
        cfg.isa = match forced {
            None => None,
            Some(i) => Some(detect::resolve(Some(i))?.isa()),
        };
        // Bits 8.. of `backend` are the store hint (ABI 2.3); an older
        // caller's value has none (the library before 2.3 refused them).
        cfg.outputs = match e.backend & !0xff {
            0 => OutputPages::Unknown,
            NPK_OUTPUTS_FRESH => OutputPages::Fresh,
            NPK_OUTPUTS_RESIDENT => OutputPages::Resident,
            _ => {
                return Err(invalid(
                    "backend",
                    "not an npk_backend_kind with at most one NPK_OUTPUTS_* bit",
                ))
            }
        };
        cfg.kind = match e.backend & 0xff {
            0 => Kind::Cpu,
            1 => Kind::Reference,
            2 => {
                if e.foreign.is_null() {
                    return Err(Error::NullPointer { arg: "foreign" });
                }
                // SAFETY: non-NULL and readable for its struct_size (caller).
                Kind::Foreign(unsafe { npk_foreign_backend::read(e.foreign) }?)
            }
            _ => return Err(invalid("backend", "not an npk_backend_kind value")),
        };
        cfg.runner = HostRunner::new(e.parallel_for, e.runner_ctx);
        Ok(cfg)
    }

    /// Builds the backend on the stack and runs `f` with it.
    fn run(&self, f: impl FnOnce(&Exec<'_>) -> Result<()>) -> Result<()> {
        let cpu = Cpu {
            runner: &self.runner,
            isa: self.isa,
        };
        let foreign;
        let backend: &dyn Backend = match self.kind {
            Kind::Cpu => &cpu,
            Kind::Reference => &Reference,
            Kind::Foreign(table) => {
                foreign = Foreign {
                    table,
                    fallback: &cpu,
                };
                &foreign
            }
        };
        let r = f(&Exec {
            ub: self.ub,
            backend,
            outputs: self.outputs,
        });
        // A broken runner outranks whatever the call returned.
        match self.runner.fault() {
            Some(e) => Err(e),
            None => r,
        }
    }
}

/// The body of every exported operator: validates `exec`, runs `f` on the
/// backend it names, and reports the result (status + detail).
///
/// # Safety
/// `exec` is NULL or a valid `npk_exec` (see `ExecConfig::read`); `f` upholds
/// its own contract.
pub(crate) unsafe fn run(
    exec: *const npk_exec,
    f: impl FnOnce(&Exec<'_>) -> Result<()>,
) -> npk_status {
    // SAFETY: forwarded from the caller.
    let detail = unsafe { detail_of(exec) };
    // SAFETY: forwarded from the caller.
    let r = unsafe { ExecConfig::read(exec) }.and_then(|cfg| cfg.run(f));
    // SAFETY: `detail` came from a valid `npk_exec` (NULL or writable).
    unsafe { report(detail, &r) }
}

/// The body of every `*_workspace_size` function: `run`, with the caller's
/// `size_t*` checked for NULL first and `f`'s answer (the plan's workspace
/// bytes) written to it.
///
/// # Safety
/// As for `run`; `out` is NULL or writable.
pub(crate) unsafe fn run_size(
    exec: *const npk_exec,
    out: *mut usize,
    f: impl FnOnce(&Exec<'_>) -> Result<u64>,
) -> npk_status {
    // SAFETY: forwarded from the caller.
    unsafe {
        run(exec, |e| {
            if out.is_null() {
                return Err(Error::NullPointer {
                    arg: "workspace_bytes",
                });
            }
            let bytes = f(e)?;
            let n = usize::try_from(bytes).map_err(|_| Error::SizeOverflow { arg: "workspace" })?;
            // SAFETY: non-NULL (checked) and writable (caller).
            out.write_unaligned(n);
            Ok(())
        })
    }
}
