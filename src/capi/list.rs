//! Tensor lists as the C ABI passes them: `const npk_tensor* tensors,
//! size_t count`, read one descriptor at a time, and the error detail's
//! position of a list's first bad tensor. The lists themselves are the
//! core's (`crate::tensor_list`).

use core::ffi::c_void;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::RawTensor;
use crate::tensor_list::{check_raw, first_bad, ListSource};

/// The C ABI's `const npk_tensor* tensors, size_t count` as a list named
/// `name` (descriptors read one at a time: an invalid dtype value never
/// becomes a Rust enum).
#[derive(Clone, Copy)]
pub(crate) struct CList {
    p: *const RawTensor,
    n: usize,
    name: &'static str,
}

impl CList {
    /// Checks the array's pointer and extent (not its descriptors).
    pub(crate) fn new(p: *const RawTensor, n: usize, name: &'static str) -> Result<CList> {
        if n == 0 {
            return Ok(CList { p, n, name });
        }
        if p.is_null() {
            return Err(Error::NullPointer { arg: name });
        }
        n.checked_mul(core::mem::size_of::<RawTensor>())
            .filter(|&b| b <= isize::MAX as usize)
            .and_then(|b| (p as usize).checked_add(b))
            .ok_or(Error::SizeOverflow { arg: name })?;
        Ok(CList { p, n, name })
    }
}

impl ListSource for CList {
    fn count(&self) -> usize {
        self.n
    }
    fn get(&mut self, i: usize) -> Result<(*mut c_void, DType, usize)> {
        if i >= self.n {
            return Err(crate::tensor_list::past(self.name));
        }
        // SAFETY: `CList::new` checked the array's extent; the caller of the
        // exported function promises `count` readable descriptors.
        let t = unsafe { super::types::read_tensor(self.p.add(i), self.name)? };
        check_raw(&t, self.name, i)
    }
    fn name(&self) -> &'static str {
        self.name
    }
}

/// After a failed call: when one of `lists` is the argument the error
/// names, points `detail->position` at its first bad tensor.
///
/// # Safety
/// `exec` is NULL or readable with a NULL or writable `detail`; each list
/// as for the exported function that read it.
pub(crate) unsafe fn mark_first_bad(exec: *const super::types::npk_exec, lists: &mut [CList]) {
    // SAFETY: forwarded.
    let Some(detail) = (unsafe { detail_of(exec) }) else {
        return;
    };
    // SAFETY: readable (caller); plain bytes.
    let arg = unsafe { core::ptr::addr_of!((*detail).argument).read_unaligned() };
    for l in lists {
        let named = l
            .name
            .bytes()
            .chain([0])
            .zip(arg)
            .all(|(a, b)| a as core::ffi::c_char == b);
        if named {
            if let Some(i) = first_bad(l) {
                // SAFETY: forwarded.
                unsafe { set_position(exec, i) };
            }
            return;
        }
    }
}

/// `exec->detail`, when both are non-NULL.
///
/// # Safety
/// `exec` is NULL or readable.
unsafe fn detail_of(
    exec: *const super::types::npk_exec,
) -> Option<*mut super::types::npk_error_detail> {
    if exec.is_null() {
        return None;
    }
    // SAFETY: readable (caller).
    let d = unsafe { core::ptr::addr_of!((*exec).detail).read_unaligned() };
    (!d.is_null()).then_some(d)
}

/// After a failed call: `detail->position = i` (the bad tensor's index in
/// the list the error names).
///
/// # Safety
/// `exec` is NULL or readable with a NULL or writable `detail`.
pub(crate) unsafe fn set_position(exec: *const super::types::npk_exec, i: usize) {
    // SAFETY: forwarded.
    if let Some(d) = unsafe { detail_of(exec) } {
        // SAFETY: writable (caller); a plain integer field.
        unsafe { core::ptr::addr_of_mut!((*d).position).write_unaligned(i as i64) };
    }
}
