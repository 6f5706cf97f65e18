//! Tensor lists, first-class: what the multi-tensor operators (gradient
//! health, AdamW) take, as aclnn's foreach calls take an `aclTensorList`.
//! Core, beside `tensor.rs`: it imports no operator and not the C layer
//! (the C descriptor arrays are `capi::list`'s).
//!
//! A list is validated element by element through a `ListSource` (Rust
//! slices, C descriptor arrays), then lowered into the caller's workspace as
//! a segment table: one `ListSeg` row per non-empty tensor, with its place
//! in the flat element sequence (list order, then row-major order). The plan
//! cuts that flat sequence into equal blocks, so a kernel's block walks the
//! table's rows it covers — the address list an NPU kernel's TensorList
//! argument carries. A call struct holds its lists as `TensorList`s (table
//! address, row count, dtype), so a foreign backend receives them like any
//! other tensor.
//!
//! Parallel lists (AdamW's params, grads, moments) have one table each, row
//! for row: row `k` of every table is the same flat range.

use core::ffi::c_void;

use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{invalid, Error, Result};
use crate::tensor::{RawTensor, TensorRef};

/// One read-only tensor of a list: its elements as a flat slice (the list
/// operators see elements, not shapes: every element counts once).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum FlatTensor<'a> {
    /// IEEE binary32 elements.
    F32(&'a [f32]),
    /// IEEE binary16 elements.
    F16(&'a [f16]),
    /// bfloat16 elements.
    BF16(&'a [bf16]),
    /// 16-bit integers (AdamW's split masters' low halves; the float
    /// operators refuse them).
    I16(&'a [i16]),
    /// Bytes (AdamW's 8-bit moment codes; the float operators refuse
    /// them).
    U8(&'a [u8]),
}

/// One writable tensor of a list (`clip_grad_norm` scales it in place;
/// AdamW's params and moments).
#[derive(Debug)]
#[non_exhaustive]
pub enum FlatTensorMut<'a> {
    /// IEEE binary32 elements.
    F32(&'a mut [f32]),
    /// IEEE binary16 elements.
    F16(&'a mut [f16]),
    /// bfloat16 elements.
    BF16(&'a mut [bf16]),
    /// 16-bit integers (AdamW's split masters' low halves; the float
    /// operators refuse them).
    I16(&'a mut [i16]),
    /// Bytes (AdamW's 8-bit moment codes; the float operators refuse
    /// them).
    U8(&'a mut [u8]),
}

impl FlatTensor<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            FlatTensor::F32(_) => DType::F32,
            FlatTensor::F16(_) => DType::F16,
            FlatTensor::BF16(_) => DType::BF16,
            FlatTensor::I16(_) => DType::I16,
            FlatTensor::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            FlatTensor::F32(s) => s.len(),
            FlatTensor::F16(s) => s.len(),
            FlatTensor::BF16(s) => s.len(),
            FlatTensor::I16(s) => s.len(),
            FlatTensor::U8(s) => s.len(),
        }
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl FlatTensorMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            FlatTensorMut::F32(_) => DType::F32,
            FlatTensorMut::F16(_) => DType::F16,
            FlatTensorMut::BF16(_) => DType::BF16,
            FlatTensorMut::I16(_) => DType::I16,
            FlatTensorMut::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            FlatTensorMut::F32(s) => s.len(),
            FlatTensorMut::F16(s) => s.len(),
            FlatTensorMut::BF16(s) => s.len(),
            FlatTensorMut::I16(s) => s.len(),
            FlatTensorMut::U8(s) => s.len(),
        }
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A read-only view of the same elements.
    pub fn as_ref(&self) -> FlatTensor<'_> {
        match self {
            FlatTensorMut::F32(s) => FlatTensor::F32(s),
            FlatTensorMut::F16(s) => FlatTensor::F16(s),
            FlatTensorMut::BF16(s) => FlatTensor::BF16(s),
            FlatTensorMut::I16(s) => FlatTensor::I16(s),
            FlatTensorMut::U8(s) => FlatTensor::U8(s),
        }
    }
}

macro_rules! flat_from {
    ($t:ty, $v:ident) => {
        impl<'a> From<&'a [$t]> for FlatTensor<'a> {
            fn from(s: &'a [$t]) -> Self {
                FlatTensor::$v(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for FlatTensorMut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                FlatTensorMut::$v(s)
            }
        }
        impl<'a> From<TensorRef<'a, $t>> for FlatTensor<'a> {
            fn from(t: TensorRef<'a, $t>) -> Self {
                FlatTensor::$v(t.data())
            }
        }
    };
}
flat_from!(f32, F32);
flat_from!(f16, F16);
flat_from!(bf16, BF16);
flat_from!(i16, I16);
flat_from!(u8, U8);

/// One row of a segment table (`npk_list_seg`): a non-empty tensor and where
/// it starts in its list's flat element sequence.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ListSeg {
    /// The tensor's first element.
    pub data: *mut c_void,
    /// Its first element's index in the flat sequence.
    pub start: usize,
    /// Its element count (> 0).
    pub numel: usize,
    /// Its element type.
    pub dtype: DType,
}

// SAFETY: a ListSeg is a descriptor of validated memory; kernels read the
// tensors from any block and write disjoint flat ranges of tensors validated
// not to overlap.
unsafe impl Sync for ListSeg {}
// SAFETY: as above.
unsafe impl Send for ListSeg {}

impl ListSeg {
    /// One past its last element's flat index.
    pub fn end(&self) -> usize {
        self.start + self.numel
    }
}

/// A lowered tensor list as a call struct carries it (`npk_tensor_list`):
/// its segment table (in the call's workspace) and the dtype every tensor
/// of it has. An absent optional list has `count == 0` and NULL `segs`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TensorList {
    /// `count` rows, in list order (empty tensors are left out).
    pub segs: *const ListSeg,
    /// Rows in the table.
    pub count: usize,
    /// Element type of every tensor in the list.
    pub dtype: DType,
}

impl TensorList {
    /// No list (an optional list left out).
    pub const NONE: TensorList = TensorList {
        segs: core::ptr::null(),
        count: 0,
        dtype: DType::F32,
    };

    /// True when the list is absent or has no non-empty tensor.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The table's rows.
    ///
    /// # Safety
    /// `segs` holds `count` rows (the front end wrote them), live for `'a`.
    pub(crate) unsafe fn rows<'a>(&self) -> &'a [ListSeg] {
        if self.count == 0 {
            return &[];
        }
        // SAFETY: the caller's contract.
        unsafe { core::slice::from_raw_parts(self.segs, self.count) }
    }
}

/// A list of tensors the front end lowers to a segment table. `get`
/// validates tensor `i` and returns its data pointer (with the provenance
/// the kernels may use: mutable for writable lists), dtype and element
/// count; `name` is the argument every error names.
pub(crate) trait ListSource {
    fn count(&self) -> usize;
    fn get(&mut self, i: usize) -> Result<(*mut c_void, DType, usize)>;
    fn name(&self) -> &'static str {
        ARG
    }
}

/// The argument name gradient health's list errors carry.
pub(crate) const ARG: &str = "tensors";

/// A read-only Rust list.
pub(crate) struct RoList<'l, 'a>(pub &'l [FlatTensor<'a>], pub &'static str);
/// A writable Rust list.
pub(crate) struct RwList<'l, 'a>(pub &'l mut [FlatTensorMut<'a>], pub &'static str);
/// A Rust slice of C-style descriptors.
pub(crate) struct RawList<'l>(pub &'l [RawTensor], pub &'static str);

pub(crate) fn past(name: &'static str) -> Error {
    invalid(name, "index past the list")
}

impl ListSource for RoList<'_, '_> {
    fn count(&self) -> usize {
        self.0.len()
    }
    fn get(&mut self, i: usize) -> Result<(*mut c_void, DType, usize)> {
        let t = self.0.get(i).ok_or(past(self.1))?;
        // Read-only pointers: no kernel writes through a read-only list.
        let p = match t {
            FlatTensor::F32(s) => s.as_ptr() as *mut c_void,
            FlatTensor::F16(s) => s.as_ptr() as *mut c_void,
            FlatTensor::BF16(s) => s.as_ptr() as *mut c_void,
            FlatTensor::I16(s) => s.as_ptr() as *mut c_void,
            FlatTensor::U8(s) => s.as_ptr() as *mut c_void,
        };
        Ok((p, t.dtype(), t.len()))
    }
    fn name(&self) -> &'static str {
        self.1
    }
}

impl ListSource for RwList<'_, '_> {
    fn count(&self) -> usize {
        self.0.len()
    }
    fn get(&mut self, i: usize) -> Result<(*mut c_void, DType, usize)> {
        let name = self.1;
        let t = self.0.get_mut(i).ok_or(past(name))?;
        let (dt, n) = (t.dtype(), t.len());
        let p = match t {
            FlatTensorMut::F32(s) => s.as_mut_ptr() as *mut c_void,
            FlatTensorMut::F16(s) => s.as_mut_ptr() as *mut c_void,
            FlatTensorMut::BF16(s) => s.as_mut_ptr() as *mut c_void,
            FlatTensorMut::I16(s) => s.as_mut_ptr() as *mut c_void,
            FlatTensorMut::U8(s) => s.as_mut_ptr() as *mut c_void,
        };
        Ok((p, dt, n))
    }
    fn name(&self) -> &'static str {
        self.1
    }
}

/// Validates one C-style descriptor of list `name` at index `i`.
pub(crate) fn check_raw(
    t: &RawTensor,
    name: &'static str,
    i: usize,
) -> Result<(*mut c_void, DType, usize)> {
    let c = t.check(name)?;
    // i16: split masters' low halves (AdamW's masters list); u8: 8-bit
    // moments' codes; each operator checks which dtypes each of its lists
    // takes.
    if !t.dtype.is_float() && t.dtype != DType::I16 && t.dtype != DType::U8 {
        return Err(crate::error::dtype_err!(
            name,
            "tensor {i} has dtype {}, not f32, f16 or bf16",
            t.dtype
        ));
    }
    Ok((t.data, t.dtype, c.numel))
}

impl ListSource for RawList<'_> {
    fn count(&self) -> usize {
        self.0.len()
    }
    fn get(&mut self, i: usize) -> Result<(*mut c_void, DType, usize)> {
        let t = self.0.get(i).ok_or(past(self.1))?;
        check_raw(t, self.1, i)
    }
    fn name(&self) -> &'static str {
        self.1
    }
}

/// Index of the first tensor `get` rejects (for the C ABI's error detail).
#[cfg_attr(not(feature = "capi"), allow(dead_code))] // used by the C ABI
pub(crate) fn first_bad<S: ListSource + ?Sized>(src: &mut S) -> Option<usize> {
    (0..src.count()).find(|&i| src.get(i).is_err())
}

/// True when the byte ranges `[a, a + an)` and `[b, b + bn)` share a byte.
pub(crate) fn overlaps(a: usize, an: usize, b: usize, bn: usize) -> bool {
    an > 0 && bn > 0 && a < b.saturating_add(bn) && b < a.saturating_add(an)
}

/// Checks that no two of `ranges` (address, bytes) share a byte, without
/// allocating: sorts them by address and compares neighbours.
pub(crate) fn disjoint(ranges: &mut [(usize, usize)]) -> bool {
    ranges.sort_unstable_by_key(|r| r.0);
    ranges
        .windows(2)
        .all(|w| w[0].1 == 0 || w[1].1 == 0 || w[0].0.saturating_add(w[0].1) <= w[1].0)
}

/// A lowered table read back as a list (the reference models' view).
pub(crate) struct TableList<'a>(pub &'a [ListSeg]);

impl ListSource for TableList<'_> {
    fn count(&self) -> usize {
        self.0.len()
    }
    fn get(&mut self, i: usize) -> Result<(*mut c_void, DType, usize)> {
        let s = self.0.get(i).ok_or(past("tensors"))?;
        Ok((s.data, s.dtype, s.numel))
    }
}
