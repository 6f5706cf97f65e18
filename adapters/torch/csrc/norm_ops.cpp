// RmsNorm, AddRmsNorm and RmsNormGrad as ATen CPU kernels over the C ABI
// (two-phase calls: size the workspace, take it (glue.h), run).

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x1_in, const at::Tensor &x2_in,
                                                            const at::Tensor &gamma_in, double epsilon,
                                                            double gamma_offset, bool cast_before_gamma) {
  const char *op = "npukern::add_rms_norm";
  at::Tensor x1 = cpu_contiguous(x1_in, op, "x1"), x2 = cpu_contiguous(x2_in, op, "x2");
  at::Tensor gamma = cpu_contiguous(gamma_in, op, "gamma");
  check_gamma_rank(x1, gamma, op);
  at::Tensor y = empty_output_like(x1);
  at::Tensor x_sum = empty_output_like(x1);
  at::Tensor rstd = empty_output(reduced_shape(x1, gamma.dim()), at::kFloat);
  npk_tensor x1t = describe(x1, op, "x1"), x2t = describe(x2, op, "x2"), gt = describe(gamma, op, "gamma");
  npk_tensor yt = describe(y, op, "y"), rt = describe(rstd, op, "rstd"), st = describe(x_sum, op, "x_sum");
  const npk_rms_norm_options opts = norm_options(op, epsilon, gamma_offset, cast_before_gamma);

  Call call(op);
  call.tensors({&x1, &x2, &gamma, &y, &x_sum});
  call.outputs({&y, &x_sum});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_add_rms_norm_workspace_size(&x1t, &x2t, &gt, &opts, call.exec(), bytes); },
      [&](void *ws, size_t bytes) {
        return npk_add_rms_norm(&x1t, &x2t, &gt, &opts, &yt, &rt, &st, ws, bytes, call.exec());
      });
  return {y, rstd, x_sum};
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
