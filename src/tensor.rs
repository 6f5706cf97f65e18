//! Tensor views. `TensorRef` / `TensorMut` are the safe Rust views (a slice
//! plus a shape); `RawTensor` is the C ABI's `npk_tensor`, the dtype-erased
//! descriptor every front end lowers to and every backend receives.

use core::ffi::c_void;

use crate::dtype::{DType, Element};
use crate::error::{invalid, invalid_fmt, Error, Result};

/// Most dimensions a tensor may have (`NPK_MAX_DIMS`).
pub const MAX_DIMS: usize = 8;

/// A shape of 1..=8 dimensions (displayed as `[2, 3, 4096]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    dims: [usize; MAX_DIMS],
    ndim: usize,
}

impl Shape {
    /// Builds a shape; rank must be 1..=8 and the element count must fit in
    /// `usize` (and `i64`, for the C ABI).
    pub fn new(dims: &[usize]) -> Result<Shape> {
        Self::new_named(dims, "shape")
    }

    pub(crate) fn new_named(dims: &[usize], arg: &'static str) -> Result<Shape> {
        if dims.is_empty() || dims.len() > MAX_DIMS {
            return Err(invalid_fmt!(arg, "rank {} is not in 1..=8", dims.len()));
        }
        let mut d = [0usize; MAX_DIMS];
        d[..dims.len()].copy_from_slice(dims);
        let s = Shape {
            dims: d,
            ndim: dims.len(),
        };
        s.checked_numel().ok_or(Error::SizeOverflow { arg })?;
        for &x in dims {
            if x > i64::MAX as usize {
                return Err(Error::SizeOverflow { arg });
            }
        }
        Ok(s)
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.ndim]
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.ndim
    }

    /// Element count (checked at construction, so this cannot overflow).
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or(usize::MAX)
    }

    fn checked_numel(&self) -> Option<usize> {
        self.dims()
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as usize)
    }
}

impl core::fmt::Display for Shape {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.dims().iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// A read-only contiguous row-major tensor.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a, T> {
    data: &'a [T],
    shape: Shape,
}

impl<'a, T: Element> TensorRef<'a, T> {
    /// A view of `data` with `dims`; the length must equal the element count.
    pub fn new(data: &'a [T], dims: &[usize]) -> Result<Self> {
        let shape = Shape::new(dims)?;
        if data.len() != shape.numel() {
            return Err(invalid_fmt!(
                "data",
                "slice of {} elements for shape {} ({} elements)",
                data.len(),
                shape,
                shape.numel()
            ));
        }
        Ok(TensorRef { data, shape })
    }

    /// The elements.
    pub fn data(&self) -> &'a [T] {
        self.data
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub(crate) fn raw(&self) -> RawTensor {
        RawTensor::from_parts(self.data.as_ptr() as *mut c_void, T::DTYPE, &self.shape)
    }
}

/// A writable contiguous row-major tensor.
#[derive(Debug)]
pub struct TensorMut<'a, T> {
    data: &'a mut [T],
    shape: Shape,
}

impl<'a, T: Element> TensorMut<'a, T> {
    /// A view of `data` with `dims`; the length must equal the element count.
    pub fn new(data: &'a mut [T], dims: &[usize]) -> Result<Self> {
        let shape = Shape::new(dims)?;
        if data.len() != shape.numel() {
            return Err(invalid_fmt!(
                "data",
                "slice of {} elements for shape {} ({} elements)",
                data.len(),
                shape,
                shape.numel()
            ));
        }
        Ok(TensorMut { data, shape })
    }

    /// The elements.
    pub fn data(&mut self) -> &mut [T] {
        self.data
    }

    /// A read-only view of the same tensor (e.g. for a `*_workspace_size`
    /// call before an in-place operator).
    pub fn as_ref(&self) -> TensorRef<'_, T> {
        TensorRef {
            data: self.data,
            shape: self.shape,
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub(crate) fn raw(&mut self) -> RawTensor {
        RawTensor::from_parts(self.data.as_mut_ptr() as *mut c_void, T::DTYPE, &self.shape)
    }
}

/// Describes the output slice `s` with the shape of `like_name` (`like`);
/// its length must be that shape's element count.
pub(crate) fn out_like<T: Element>(
    s: &mut [T],
    like: &Shape,
    name: &'static str,
    like_name: &'static str,
) -> Result<RawTensor> {
    if s.len() != like.numel() {
        return Err(invalid_fmt!(
            name,
            "slice of {} elements for {like_name}'s shape {like}",
            s.len()
        ));
    }
    Ok(RawTensor::from_parts(
        s.as_mut_ptr() as *mut c_void,
        T::DTYPE,
        like,
    ))
}

/// The C ABI's `npk_tensor`: a contiguous row-major tensor. `data` may be NULL
/// only when the tensor is empty.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawTensor {
    /// First element.
    pub data: *mut c_void,
    /// Element type.
    pub dtype: DType,
    /// Number of dimensions, 1..=8.
    pub ndim: u32,
    /// The first `ndim` entries are used; each is >= 0.
    pub shape: [i64; MAX_DIMS],
}

impl RawTensor {
    pub(crate) fn from_parts(data: *mut c_void, dtype: DType, shape: &Shape) -> RawTensor {
        let mut s = [0i64; MAX_DIMS];
        for (o, &d) in s.iter_mut().zip(shape.dims()) {
            *o = d as i64; // Shape::new keeps every dim <= i64::MAX
        }
        RawTensor {
            data,
            dtype,
            ndim: shape.ndim() as u32,
            shape: s,
        }
    }

    /// A 1-D descriptor of `len` elements.
    pub(crate) fn flat(data: *mut c_void, dtype: DType, len: usize) -> RawTensor {
        let mut s = [0i64; MAX_DIMS];
        s[0] = len as i64;
        RawTensor {
            data,
            dtype,
            ndim: 1,
            shape: s,
        }
    }

    /// True when this tensor's bytes share a byte with `[addr, addr + bytes)`
    /// (for a descriptor whose shape has been validated).
    pub(crate) fn overlaps(&self, addr: usize, bytes: usize) -> bool {
        let nd = (self.ndim as usize).min(MAX_DIMS);
        if self.shape[..nd].contains(&0) {
            return false; // empty, whatever the other dims
        }
        let own = self.shape[..nd]
            .iter()
            .try_fold(self.dtype.size_bytes(), |acc, &d| {
                usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
            })
            .unwrap_or(usize::MAX);
        let a = self.data as usize;
        own > 0 && bytes > 0 && a < addr.saturating_add(bytes) && addr < a.saturating_add(own)
    }

    /// Validates rank, dims and the element/byte counts; returns the shape.
    /// Does not check `data` (see `Checked`).
    pub(crate) fn checked_shape(&self, arg: &'static str) -> Result<Shape> {
        let nd = self.ndim as usize;
        if nd == 0 || nd > MAX_DIMS {
            return Err(invalid_fmt!(arg, "rank {} is not in 1..=8", self.ndim));
        }
        let mut dims = [0usize; MAX_DIMS];
        for (i, (o, &d)) in dims.iter_mut().zip(&self.shape[..nd]).enumerate() {
            if d < 0 {
                return Err(invalid_fmt!(arg, "shape[{i}] = {d} is negative"));
            }
            *o = usize::try_from(d).map_err(|_| Error::SizeOverflow { arg })?;
        }
        let shape = Shape::new_named(&dims[..nd], arg)?;
        shape
            .numel()
            .checked_mul(self.dtype.size_bytes())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(Error::SizeOverflow { arg })?;
        Ok(shape)
    }

    /// Full check of one descriptor: shape, and `data` non-NULL unless empty.
    pub(crate) fn check(&self, arg: &'static str) -> Result<Checked> {
        let shape = self.checked_shape(arg)?;
        let numel = shape.numel();
        if numel > 0 && self.data.is_null() {
            return Err(Error::NullPointer { arg });
        }
        let bytes = numel * self.dtype.size_bytes();
        if numel > 0 && (self.data as usize).checked_add(bytes).is_none() {
            return Err(Error::SizeOverflow { arg });
        }
        if numel > 0 && !(self.data as usize).is_multiple_of(self.dtype.size_bytes()) {
            return Err(invalid(arg, "data is not aligned to its element size"));
        }
        Ok(Checked {
            shape,
            numel,
            addr: self.data as usize,
            bytes,
            name: arg,
        })
    }
}

/// A validated descriptor's facts, used for overlap checks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Checked {
    pub shape: Shape,
    pub numel: usize,
    pub addr: usize,
    pub bytes: usize,
    pub name: &'static str,
}

impl Checked {
    /// True when the two byte ranges share a byte.
    pub fn overlaps(&self, other: &Checked) -> bool {
        self.bytes > 0
            && other.bytes > 0
            && self.addr < other.addr + other.bytes
            && other.addr < self.addr + self.bytes
    }

    /// Same first byte and same length: an exact in-place alias.
    pub fn same_range(&self, other: &Checked) -> bool {
        self.addr == other.addr && self.bytes == other.bytes
    }
}

/// Rejects `out` if it overlaps any of `others`.
pub(crate) fn no_overlap<'a>(
    out: &Checked,
    others: impl IntoIterator<Item = &'a Checked>,
) -> Result<()> {
    for o in others {
        if out.overlaps(o) {
            return Err(invalid_fmt!(out.name, "buffer overlaps {}'s", o.name));
        }
    }
    Ok(())
}
