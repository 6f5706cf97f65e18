//! `npk_adamw_workspace_size` / `npk_adamw`: a skin over `ops::adamw` (the
//! same validation, plan and kernels as the Rust API). Lists are
//! `npk_tensor_array`s, aclnn's foreach calls' `aclTensorList`s; on a list
//! error the detail's `position` is the index of the first bad tensor of
//! the list it names.

use core::ffi::c_void;
use core::mem::size_of;

use super::{plan, AdamWFormats, AdamWOptions, AdamWReport, Lists};
use crate::capi::exec::{run, run_size};
use crate::capi::list::{mark_first_bad, set_position, CList};
use crate::capi::types::{npk_exec, npk_status};
use crate::error::{Error, Result};
use crate::tensor::RawTensor;

/// A tensor list: `count` descriptors at `tensors` (NULL only when
/// `count == 0`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_tensor_array {
    /// The first descriptor.
    pub tensors: *const RawTensor,
    /// How many.
    pub count: usize,
}

/// The lists of one AdamW step, tensor `i` of each having the same element
/// count (see `npk_adamw`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_adamw_tensors {
    /// Parameters (updated in place).
    pub params: npk_tensor_array,
    /// Gradients (read only).
    pub grads: npk_tensor_array,
    /// First moments (updated in place).
    pub exp_avgs: npk_tensor_array,
    /// Second moments (updated in place).
    pub exp_avg_sqs: npk_tensor_array,
    /// amsgrad's running maxima (`NPK_ADAMW_AMSGRAD`), else empty.
    pub max_exp_avg_sqs: npk_tensor_array,
    /// f32 master weights, or empty.
    pub masters: npk_tensor_array,
}

/// How one step stores its state (`npk_adamw_v2`, ABI 2.9): split masters,
/// stochastic rounding. NULL, or every field but `struct_size` zero, is
/// `npk_adamw`'s: f32 masters, moments rounded to nearest.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_adamw_formats {
    /// `sizeof(npk_adamw_formats)` (lets the struct grow: a library reads
    /// the fields a caller was built with; the size before
    /// `quantized_moments`, `offsetof(npk_adamw_formats,
    /// quantized_moments)`, reads as no 8-bit moments).
    pub struct_size: usize,
    /// 1: the masters list holds the i16 low halves of bf16 params' split
    /// masters (master = param bits << 16 + low, exact); 0: f32 masters.
    pub split_masters: u32,
    /// `NPK_ADAMW_SR_*` bits: bf16 moments / bf16 params without masters
    /// rounded stochastically.
    pub rounding: u32,
    /// The stochastic rounding hash's seed.
    pub seed: u64,
    /// NULL, or `keys_count` (= the params' count) keys: tensor `t`'s
    /// element `i` has key `keys[t] + i` (NULL: its flat index in the
    /// lists). A shard of a tensor passes its offset in the whole.
    pub keys: *const u64,
    /// How many keys.
    pub keys_count: usize,
    /// 1: 8-bit moments. exp_avgs, exp_avg_sqs (and max_exp_avg_sqs) are
    /// `NPK_U8` codes, one per element, and the three scale lists below
    /// hold one `NPK_F32` scale per block of 256 elements of each tensor
    /// (`ceil(numel / 256)` per param). Not with `NPK_ADAMW_SR_MOMENTS`.
    pub quantized_moments: u32,
    /// exp_avgs' block scales (8-bit moments; else empty).
    pub exp_avg_scales: npk_tensor_array,
    /// exp_avg_sqs' block scales (8-bit moments; else empty).
    pub exp_avg_sq_scales: npk_tensor_array,
    /// max_exp_avg_sqs' block scales (8-bit moments with amsgrad; else
    /// empty).
    pub max_exp_avg_sq_scales: npk_tensor_array,
    /// NULL, or `q8_rows_count` (= the params' count) row lengths (ABI
    /// 2.12; 8-bit moments only): tensor `t` is cut into rows of
    /// `q8_rows[t]` elements (0: one row), which must divide its elements,
    /// and each row into blocks of 256 from its first element, scales row
    /// by row (`(numel / row) * ceil(row / 256)` of them). No block crosses
    /// a row: shards of whole rows (FSDP2's dim-0 shards, the row a dim-0
    /// slice) quantize as one process wherever the cut falls. A struct
    /// ending before this field reads as NULL.
    pub q8_rows: *const u64,
    /// How many row lengths.
    pub q8_rows_count: usize,
}

/// An empty list.
const EMPTY: npk_tensor_array = npk_tensor_array {
    tensors: core::ptr::null(),
    count: 0,
};

/// # Safety
/// `f` is NULL or readable for `struct_size` bytes, its keys for their count.
unsafe fn read_formats<'a>(
    f: *const npk_adamw_formats,
) -> Result<(AdamWFormats<'a>, [npk_tensor_array; 3])> {
    if f.is_null() {
        return Ok((AdamWFormats::default(), [EMPTY; 3]));
    }
    // SAFETY: readable (caller); the size is read alone first.
    let size = unsafe { core::ptr::addr_of!((*f).struct_size).read_unaligned() };
    // The struct before 8-bit moments (its fields up to `keys_count`) is
    // read as it was, the rest zero: no 8-bit moments.
    let before_q8 = core::mem::offset_of!(npk_adamw_formats, quantized_moments);
    // ABI 2.9-2.11's struct: no row lengths.
    let before_rows = core::mem::offset_of!(npk_adamw_formats, q8_rows);
    if size != size_of::<npk_adamw_formats>() && size != before_q8 && size != before_rows {
        return Err(crate::error::invalid_fmt!(
            "formats",
            "struct_size {size}: want sizeof(npk_adamw_formats) = {}",
            size_of::<npk_adamw_formats>()
        ));
    }
    let mut out = npk_adamw_formats {
        struct_size: size,
        split_masters: 0,
        rounding: 0,
        seed: 0,
        keys: core::ptr::null(),
        keys_count: 0,
        quantized_moments: 0,
        exp_avg_scales: EMPTY,
        exp_avg_sq_scales: EMPTY,
        max_exp_avg_sq_scales: EMPTY,
        q8_rows: core::ptr::null(),
        q8_rows_count: 0,
    };
    // SAFETY: as above, the caller's `size` bytes (at most the struct's);
    // plain numbers and pointers, any bytes valid.
    unsafe {
        core::ptr::copy_nonoverlapping(
            f.cast::<u8>(),
            core::ptr::addr_of_mut!(out).cast::<u8>(),
            size,
        )
    };
    let f = out;
    // SAFETY: the caller's pointers, readable for their counts.
    let (keys, q8_rows) = unsafe {
        (
            u64s(f.keys, f.keys_count, "keys")?,
            u64s(f.q8_rows, f.q8_rows_count, "q8_rows")?,
        )
    };
    if f.split_masters > 1 {
        return Err(crate::error::invalid_fmt!(
            "split_masters",
            "{} is not 0 or 1",
            f.split_masters
        ));
    }
    if f.quantized_moments > 1 {
        return Err(crate::error::invalid_fmt!(
            "quantized_moments",
            "{} is not 0 or 1",
            f.quantized_moments
        ));
    }
    Ok((
        AdamWFormats {
            split_masters: f.split_masters == 1,
            rounding: f.rounding,
            quantized_moments: f.quantized_moments == 1,
            seed: f.seed,
            keys,
            q8_rows,
        },
        [
            f.exp_avg_scales,
            f.exp_avg_sq_scales,
            f.max_exp_avg_sq_scales,
        ],
    ))
}

/// A caller's `u64` array of `count` (none when 0), checked for NULL and
/// alignment.
///
/// # Safety
/// `p` is NULL or readable for `count` values.
unsafe fn u64s<'a>(p: *const u64, count: usize, arg: &'static str) -> Result<&'a [u64]> {
    if count == 0 {
        Ok(&[])
    } else if p.is_null() {
        Err(Error::NullPointer { arg })
    } else if count > isize::MAX as usize / 8 || !(p as usize).is_multiple_of(8) {
        Err(crate::error::invalid(arg, "misaligned or too many"))
    } else {
        // SAFETY: readable for its count (caller), aligned (checked).
        Ok(unsafe { core::slice::from_raw_parts(p, count) })
    }
}

/// The nine lists (the six of `npk_adamw_tensors`, then the formats' three
/// scale lists), read.
struct CLists([CList; 9]);

impl CLists {
    /// # Safety
    /// `t` is NULL or readable; `scales` are arrays as `read_formats` found
    /// them.
    unsafe fn read(t: *const npk_adamw_tensors, scales: [npk_tensor_array; 3]) -> Result<CLists> {
        if t.is_null() {
            return Err(Error::NullPointer { arg: "tensors" });
        }
        // SAFETY: non-NULL and readable (caller); plain pointers and sizes.
        let t = unsafe { t.read_unaligned() };
        let l = |a: npk_tensor_array, name| CList::new(a.tensors, a.count, name);
        Ok(CLists([
            l(t.params, "params")?,
            l(t.grads, "grads")?,
            l(t.exp_avgs, "exp_avgs")?,
            l(t.exp_avg_sqs, "exp_avg_sqs")?,
            l(t.max_exp_avg_sqs, "max_exp_avg_sqs")?,
            l(t.masters, "masters")?,
            l(scales[0], "exp_avg_scales")?,
            l(scales[1], "exp_avg_sq_scales")?,
            l(scales[2], "max_exp_avg_sq_scales")?,
        ]))
    }

    /// Runs `f` on the lists; `bad` receives the index of the tensor a
    /// refusal was about.
    fn with<R>(&mut self, bad: &mut Option<usize>, f: impl FnOnce(&mut Lists<'_>) -> R) -> R {
        let [p, g, m, v, x, w, sm, sv, sx] = &mut self.0;
        let mut l = Lists {
            params: p,
            grads: g,
            exp_avgs: m,
            exp_avg_sqs: v,
            max_exp_avg_sqs: x,
            masters: w,
            exp_avg_scales: sm,
            exp_avg_sq_scales: sv,
            max_exp_avg_sq_scales: sx,
            bad: None,
        };
        let r = f(&mut l);
        *bad = l.bad;
        r
    }
}

/// # Safety
/// `o` is NULL or readable.
unsafe fn read_options(o: *const AdamWOptions) -> Result<AdamWOptions> {
    if o.is_null() {
        return Err(Error::NullPointer { arg: "options" });
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    Ok(unsafe { o.read_unaligned() })
}

/// On failure, marks the tensor of the list the error names: the one the
/// validation refused (`bad`), else the first whose descriptor is invalid.
///
/// # Safety
/// As for the exported functions.
unsafe fn marked(
    s: npk_status,
    exec: *const npk_exec,
    t: *const npk_adamw_tensors,
    formats: *const npk_adamw_formats,
    bad: Option<usize>,
) -> npk_status {
    if s != npk_status::NPK_OK {
        match bad {
            // SAFETY: forwarded.
            Some(i) => unsafe { set_position(exec, i) },
            None => {
                // SAFETY: forwarded.
                let scales = unsafe { read_formats(formats) }.map_or([EMPTY; 3], |f| f.1);
                // SAFETY: forwarded.
                if let Ok(mut l) = unsafe { CLists::read(t, scales) } {
                    // SAFETY: forwarded.
                    unsafe { mark_first_bad(exec, &mut l.0) };
                }
            }
        }
    }
    s
}

/// Workspace bytes `npk_adamw` needs for these lists and options (the same
/// `exec` must be passed to both calls: the plan depends on its `blocks`).
///
/// # Safety
/// `tensors` and `options` are NULL or readable, each array of descriptors
/// readable for its count; the other pointers NULL or valid. Data is not
/// read.
#[no_mangle]
pub unsafe extern "C" fn npk_adamw_workspace_size(
    tensors: *const npk_adamw_tensors,
    options: *const AdamWOptions,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: forwarded (NULL formats: the defaults).
    unsafe {
        npk_adamw_v2_workspace_size(tensors, options, core::ptr::null(), exec, workspace_bytes)
    }
}

/// Workspace bytes `npk_adamw_v2` needs (ABI 2.9; as
/// `npk_adamw_workspace_size`, with the state's formats).
///
/// # Safety
/// As for `npk_adamw_workspace_size`; `formats` is NULL or readable.
#[no_mangle]
pub unsafe extern "C" fn npk_adamw_v2_workspace_size(
    tensors: *const npk_adamw_tensors,
    options: *const AdamWOptions,
    formats: *const npk_adamw_formats,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        let mut bad = None;
        let s = run_size(exec, workspace_bytes, |e| {
            let o = read_options(options)?;
            let (f, scales) = read_formats(formats)?;
            CLists::read(tensors, scales)?.with(&mut bad, |l| {
                Ok(plan::plan_lists(l, &o, &f, &e.ub)?.workspace_bytes)
            })
        });
        marked(s, exec, tensors, formats, bad)
    }
}

/// One AdamW / Adam step over the lists (docs/operators.md, "AdamW"): params,
/// moments, maxima and masters updated in place, gradients read only. Params
/// and grads: f32 | f16 | bf16, one dtype per list; moments f32 or the
/// params' dtype; masters f32. No two tensors, the workspace and `*result`
/// may overlap. `result` (NULL: not wanted) receives the clip's norm and
/// whether the step ran. On error nothing is written.
///
/// # Safety
/// As for the size call, and every tensor's `data` is valid for reads (and,
/// but for grads, writes) of its shape and dtype, live for the call;
/// `result` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn npk_adamw(
    tensors: *const npk_adamw_tensors,
    options: *const AdamWOptions,
    result: *mut AdamWReport,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: forwarded (NULL formats: the defaults).
    unsafe {
        npk_adamw_v2(
            tensors,
            options,
            core::ptr::null(),
            result,
            workspace,
            workspace_bytes,
            exec,
        )
    }
}

/// One step with the state in `formats` (ABI 2.9; NULL: `npk_adamw`):
/// split masters (the masters list is `NPK_I16`, one low half per bf16
/// param), stochastically rounded bf16 moments (`NPK_ADAMW_SR_MOMENTS`),
/// bf16 params without masters (`NPK_ADAMW_SR_PARAMS`) or 8-bit moments
/// (`quantized_moments`: `NPK_U8` moment lists and the formats' f32 scale
/// lists). On error nothing is written.
///
/// # Safety
/// As for `npk_adamw`; `formats` is NULL or readable, its keys for their
/// count.
#[no_mangle]
pub unsafe extern "C" fn npk_adamw_v2(
    tensors: *const npk_adamw_tensors,
    options: *const AdamWOptions,
    formats: *const npk_adamw_formats,
    result: *mut AdamWReport,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        let mut bad = None;
        let s = run(exec, |e| {
            let o = read_options(options)?;
            let (f, scales) = read_formats(formats)?;
            let out = (!result.is_null()).then_some((result as usize, size_of::<AdamWReport>()));
            let r = CLists::read(tensors, scales)?.with(&mut bad, |l| {
                plan::launch(e, l, &o, &f, workspace, workspace_bytes, out)
            })?;
            if !result.is_null() {
                result.write_unaligned(r);
            }
            Ok(())
        });
        marked(s, exec, tensors, formats, bad)
    }
}
