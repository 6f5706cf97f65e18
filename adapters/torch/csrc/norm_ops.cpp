// RmsNorm, AddRmsNorm and RmsNormGrad as ATen CPU kernels over the C ABI
// (two-phase calls: size the workspace, take it (glue.h), run).

#include <ATen/MemoryOverlap.h>

#include <tuple>

#include "glue.h"
#include "ops.h"

namespace npk_torch {

namespace {

// gamma's offset is an f32 in the C ABI: a double that does not narrow
// exactly is refused rather than silently rounded (the library refuses inf).
float offset_f32(const char *op, double gamma_offset) {
  TORCH_CHECK_VALUE(static_cast<double>(static_cast<float>(gamma_offset)) == gamma_offset, op, ": gamma_offset ",
                    gamma_offset, " is not a float32 value");
  return static_cast<float>(gamma_offset);
}

// The forward options: eps, gamma's offset and where y is rounded.
npk_rms_norm_options norm_options(const char *op, double epsilon, double gamma_offset, bool cast_before_gamma) {
  return npk_rms_norm_options{epsilon, offset_f32(op, gamma_offset),
                              cast_before_gamma ? NPK_ROUNDING_CAST_BEFORE_GAMMA : NPK_ROUNDING_FUSED};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor &x_in, const at::Tensor &gamma_in, double epsilon,
                                            double gamma_offset, bool cast_before_gamma) {
  const char *op = "npukern::rms_norm";
  at::Tensor x = cpu_contiguous(x_in, op, "x"), gamma = cpu_contiguous(gamma_in, op, "gamma");
  check_gamma_rank(x, gamma, op);
  at::Tensor y = empty_output_like(x);
  at::Tensor rstd = empty_output(reduced_shape(x, gamma.dim()), at::kFloat);
  npk_tensor xt = describe(x, op, "x"), gt = describe(gamma, op, "gamma");
  npk_tensor yt = describe(y, op, "y"), rt = describe(rstd, op, "rstd");
  const npk_rms_norm_options opts = norm_options(op, epsilon, gamma_offset, cast_before_gamma);

  Call call(op);
  call.tensors({&x, &gamma, &y});
  call.outputs({&y});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_rms_norm_workspace_size(&xt, &gt, &opts, call.exec(), bytes); },
      [&](void *ws, size_t bytes) { return npk_rms_norm(&xt, &gt, &opts, &yt, &rt, ws, bytes, call.exec()); });
  return {y, rstd};
}

namespace {

// AddRmsNorm of a contiguous x1 into new y and rstd, and into x_sum: a new
// tensor, or x1 itself (the C ABI's in-place pair: the library reads each
// element of x1 before writing its sum there). Both ops share it so their
// bits are the same.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_into(const char *op, const at::Tensor &x1,
                                                                 const at::Tensor &x2_in, const at::Tensor &gamma_in,
                                                                 bool in_place, double epsilon, double gamma_offset,
                                                                 bool cast_before_gamma) {
  at::Tensor x2 = cpu_contiguous(x2_in, op, "x2"), gamma = cpu_contiguous(gamma_in, op, "gamma");
  check_gamma_rank(x1, gamma, op);
  at::Tensor y = empty_output_like(x1);
  at::Tensor x_sum = in_place ? x1 : empty_output_like(x1);
  at::Tensor rstd = empty_output(reduced_shape(x1, gamma.dim()), at::kFloat);
  npk_tensor x1t = describe(x1, op, "x1"), x2t = describe(x2, op, "x2"), gt = describe(gamma, op, "gamma");
  npk_tensor yt = describe(y, op, "y"), rt = describe(rstd, op, "rstd"), st = describe(x_sum, op, "x_sum");
  const npk_rms_norm_options opts = norm_options(op, epsilon, gamma_offset, cast_before_gamma);

  Call call(op);
  call.tensors({&x1, &x2, &gamma, &y, &x_sum});
  call.outputs({&y, in_place ? nullptr : &x_sum});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_add_rms_norm_workspace_size(&x1t, &x2t, &gt, &opts, call.exec(), bytes); },
      [&](void *ws, size_t bytes) {
        return npk_add_rms_norm(&x1t, &x2t, &gt, &opts, &yt, &rt, &st, ws, bytes, call.exec());
      });
  return {y, rstd, x_sum};
}

// Whether a and b share memory (at::get_overlap_status: TooHard, a strided
// view it cannot decide, is read through a contiguous copy anyway).
bool shares_memory(const at::Tensor &a, const at::Tensor &b) {
  if (!b.defined()) return false;
  const at::MemOverlapStatus s = at::get_overlap_status(a, b);
  return s == at::MemOverlapStatus::Full || s == at::MemOverlapStatus::Partial;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x1, const at::Tensor &x2,
                                                            const at::Tensor &gamma, double epsilon,
                                                            double gamma_offset, bool cast_before_gamma) {
  const char *op = "npukern::add_rms_norm";
  return add_rms_norm_into(op, cpu_contiguous(x1, op, "x1"), x2, gamma, /*in_place=*/false, epsilon, gamma_offset,
                           cast_before_gamma);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_(at::Tensor &x1, const at::Tensor &x2, const at::Tensor &gamma,
                                                 double epsilon, double gamma_offset, bool cast_before_gamma) {
  const char *op = "npukern::add_rms_norm_";
  // The sum is written into x1's own memory, so no contiguous copy may stand
  // in for it, and the library must see every overlap the caller made.
  check_cpu(x1, op, "x1");
  TORCH_CHECK_VALUE(at::has_internal_overlap(x1) != at::MemOverlap::Yes, op,
                    ": x1 has elements sharing memory (expanded?); x1 + x2 is written over x1, so clone it first");
  TORCH_CHECK_VALUE(x1.is_contiguous(), op, ": x1 must be contiguous (x1 + x2 is written over it); got strides ",
                    x1.strides(), " for shape ", x1.sizes());
  TORCH_CHECK_VALUE(!shares_memory(x1, x2), op, ": x1 shares memory with x2; x1 + x2 is written over x1");
  TORCH_CHECK_VALUE(!shares_memory(x1, gamma), op, ": x1 shares memory with gamma; x1 + x2 is written over x1");
  auto [y, rstd, x_sum] =
      add_rms_norm_into(op, x1, x2, gamma, /*in_place=*/true, epsilon, gamma_offset, cast_before_gamma);
  return {y, rstd};
}

namespace {

// dx (x's dtype) and the f32 dgamma (gamma's shape); dres, when defined, is
// added to dx inside the same pass (the backward of AddRmsNorm).
std::tuple<at::Tensor, at::Tensor> norm_grad(const char *op, const at::Tensor &dy_in, const at::Tensor &x_in,
                                             const at::Tensor &gamma_in, const at::Tensor &rstd_in,
                                             const at::Tensor *dres_in, double gamma_offset) {
  at::Tensor dy = cpu_contiguous(dy_in, op, "dy"), x = cpu_contiguous(x_in, op, "x");
  at::Tensor gamma = cpu_contiguous(gamma_in, op, "gamma"), rstd = cpu_contiguous(rstd_in, op, "rstd");
  at::Tensor dres = dres_in ? cpu_contiguous(*dres_in, op, "dres") : at::Tensor();
  at::Tensor dx = empty_output_like(x);
  at::Tensor dgamma = empty_output(gamma.sizes(), at::kFloat);
  npk_tensor dyt = describe(dy, op, "dy"), xt = describe(x, op, "x"), gt = describe(gamma, op, "gamma");
  npk_tensor rt = describe(rstd, op, "rstd"), dxt = describe(dx, op, "dx"), dgt = describe(dgamma, op, "dgamma");
  npk_tensor drt{};
  if (dres_in) drt = describe(dres, op, "dres");
  const npk_tensor *drp = dres_in ? &drt : nullptr;

  npk_rms_norm_grad_options opts{};
  opts.gamma_offset = offset_f32(op, gamma_offset);

  Call call(op);
  call.tensors({&dy, &x, &gamma, &rstd, &dres, &dx, &dgamma});
  call.outputs({&dx});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_rms_norm_grad_workspace_size(&dyt, &xt, &rt, &gt, &opts, call.exec(), bytes); },
      [&](void *ws, size_t bytes) {
        return npk_rms_norm_grad(&dyt, &xt, &rt, &gt, drp, &opts, &dxt, &dgt, nullptr, ws, bytes, call.exec());
      });
  return {dx, dgamma};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor &dy, const at::Tensor &x,
                                                     const at::Tensor &gamma, const at::Tensor &rstd,
                                                     double gamma_offset) {
  return norm_grad("npukern::rms_norm_backward", dy, x, gamma, rstd, nullptr, gamma_offset);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_backward(const at::Tensor &dy, const at::Tensor &x_sum,
                                                         const at::Tensor &gamma, const at::Tensor &rstd,
                                                         const at::Tensor &dx_sum, double gamma_offset) {
  return norm_grad("npukern::add_rms_norm_backward", dy, x_sum, gamma, rstd, &dx_sum, gamma_offset);
}

}  // namespace npk_torch
