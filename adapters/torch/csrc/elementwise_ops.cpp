// SwiGLU, GeGLU and RoPE as ATen CPU kernels over the C ABI (two-phase calls; these
// operators need no workspace, but the size call validates like any other).

#include <tuple>

#include "glue.h"
#include "ops.h"

namespace npk_torch {

namespace {

npk_swiglu_options swiglu_options(int64_t dim, bool eager) {
  npk_swiglu_options o{};
  o.dim = dim;
  o.rounding = eager ? NPK_ELEM_ROUNDING_EAGER : NPK_ELEM_ROUNDING_FUSED;
  return o;
}

npk_geglu_options geglu_options(int64_t dim, int64_t approximate, bool activate_left, bool eager) {
  npk_geglu_options o{};
  o.dim = dim;
  o.rounding = eager ? NPK_ELEM_ROUNDING_EAGER : NPK_ELEM_ROUNDING_FUSED;
  // Anything but 0 or 1 (which a cast to 32 bits could make so) reaches the
  // library as 2, which it refuses by name.
  o.approximate = static_cast<npk_gelu_approximate>(approximate == 0 || approximate == 1 ? approximate : 2);
  o.activate_left = activate_left ? 1u : 0u;
  return o;
}

// x's shape with `dim` halved (the library checks dim and evenness).
c10::SmallVector<int64_t, NPK_MAX_DIMS> half_shape(const at::Tensor &x, int64_t dim, const char *op) {
  c10::SmallVector<int64_t, NPK_MAX_DIMS> s(x.sizes().begin(), x.sizes().end());
  int64_t d = dim < 0 ? dim + x.dim() : dim;
  TORCH_CHECK_INDEX(d >= 0 && d < x.dim(), op, ": dim ", dim, " is out of range for x of rank ", x.dim());
  s[static_cast<size_t>(d)] /= 2;
  return s;
}

// Runs the RoPE C call: k and k_out may be null (rotary_mul: its x and y
// are named so in errors, not q and q_out).
void rope_call(const char *op, const at::Tensor &q, const at::Tensor *k, const at::Tensor &cos,
               const at::Tensor &sin, bool eager, bool backward, at::Tensor &q_out, at::Tensor *k_out) {
  const char *q_name = k ? "q" : "x", *q_out_name = k ? "q_out" : "y";
  npk_tensor qt = describe(q, op, q_name), ct = describe(cos, op, "cos"), st = describe(sin, op, "sin");
  npk_tensor qot = describe(q_out, op, q_out_name);
  npk_tensor kt{}, kot{};
  if (k) {
    kt = describe(*k, op, "k");
    kot = describe(*k_out, op, "k_out");
  }
  npk_rope_options o{};
  o.rounding = eager ? NPK_ELEM_ROUNDING_EAGER : NPK_ELEM_ROUNDING_FUSED;
  o.backward = backward ? 1u : 0u;
  Call call(op);
  if (!k) call.rename("q", "x", "q_out", "y");
  call.tensors({&q, k, &cos, &sin, &q_out, k_out});
  call.outputs({&q_out, k_out});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) {
        return npk_rope_workspace_size(&qt, k ? &kt : nullptr, &ct, &st, &o, call.exec(), bytes);
      },
      [&](void *ws, size_t bytes) {
        return npk_rope(&qt, k ? &kt : nullptr, &ct, &st, &o, &qot, k ? &kot : nullptr, ws, bytes, call.exec());
      });
}

}  // namespace

at::Tensor swiglu(const at::Tensor &x_in, int64_t dim, bool eager) {
  const char *op = "npukern::swiglu";
  at::Tensor x = cpu_contiguous(x_in, op, "x");
  at::Tensor y = empty_output(half_shape(x, dim, op), x.scalar_type());
  npk_tensor xt = describe(x, op, "x"), yt = describe(y, op, "y");
  const npk_swiglu_options o = swiglu_options(dim, eager);
  Call call(op);
  call.tensors({&x, &y});
  call.outputs({&y});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_swiglu_workspace_size(&xt, nullptr, &o, call.exec(), bytes); },
      [&](void *ws, size_t bytes) { return npk_swiglu(&xt, nullptr, &o, &yt, ws, bytes, call.exec()); });
  return y;
}

at::Tensor swiglu_backward(const at::Tensor &dy_in, const at::Tensor &x_in, int64_t dim, bool eager) {
  const char *op = "npukern::swiglu_backward";
  at::Tensor dy = cpu_contiguous(dy_in, op, "dy"), x = cpu_contiguous(x_in, op, "x");
  at::Tensor dx = empty_output_like(x);
  npk_tensor dyt = describe(dy, op, "dy"), xt = describe(x, op, "x"), dxt = describe(dx, op, "dx");
  const npk_swiglu_options o = swiglu_options(dim, eager);
  Call call(op);
  call.tensors({&dy, &x, &dx});
  call.outputs({&dx});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_swiglu_grad_workspace_size(&dyt, &xt, nullptr, &o, call.exec(), bytes); },
      [&](void *ws, size_t bytes) {
        return npk_swiglu_grad(&dyt, &xt, nullptr, &o, &dxt, nullptr, ws, bytes, call.exec());
      });
  return dx;
}

at::Tensor silu_mul(const at::Tensor &gate_in, const at::Tensor &up_in, bool eager) {
  const char *op = "npukern::silu_mul";
  at::Tensor gate = cpu_contiguous(gate_in, op, "gate"), up = cpu_contiguous(up_in, op, "up");
  at::Tensor y = empty_output_like(gate);
  npk_tensor gt = describe(gate, op, "gate"), ut = describe(up, op, "up"), yt = describe(y, op, "y");
  const npk_swiglu_options o = swiglu_options(-1, eager);
  Call call(op);
  call.tensors({&gate, &up, &y});
  call.outputs({&y});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_swiglu_workspace_size(&gt, &ut, &o, call.exec(), bytes); },
      [&](void *ws, size_t bytes) { return npk_swiglu(&gt, &ut, &o, &yt, ws, bytes, call.exec()); });
  return y;
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor &dy_in, const at::Tensor &gate_in,
                                                     const at::Tensor &up_in, bool eager) {
  const char *op = "npukern::silu_mul_backward";
  at::Tensor dy = cpu_contiguous(dy_in, op, "dy"), gate = cpu_contiguous(gate_in, op, "gate");
  at::Tensor up = cpu_contiguous(up_in, op, "up");
  at::Tensor dgate = empty_output_like(gate);
  at::Tensor dup = empty_output_like(gate);
  npk_tensor dyt = describe(dy, op, "dy"), gt = describe(gate, op, "gate"), ut = describe(up, op, "up");
  npk_tensor dgt = describe(dgate, op, "dgate"), dut = describe(dup, op, "dup");
  const npk_swiglu_options o = swiglu_options(-1, eager);
  Call call(op);
  call.tensors({&dy, &gate, &up, &dgate, &dup});
  call.outputs({&dgate, &dup});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_swiglu_grad_workspace_size(&dyt, &gt, &ut, &o, call.exec(), bytes); },
      [&](void *ws, size_t bytes) { return npk_swiglu_grad(&dyt, &gt, &ut, &o, &dgt, &dut, ws, bytes, call.exec()); });
  return {dgate, dup};
}

std::tuple<at::Tensor, at::Tensor> geglu(const at::Tensor &x_in, int64_t dim, int64_t approximate,
                                         bool activate_left, bool eager) {
  const char *op = "npukern::geglu";
  at::Tensor x = cpu_contiguous(x_in, op, "x");
  auto shape = half_shape(x, dim, op);
  at::Tensor y = empty_output(shape, x.scalar_type());
  at::Tensor gelu = empty_output(shape, x.scalar_type());
  npk_tensor xt = describe(x, op, "x"), yt = describe(y, op, "y"), gt = describe(gelu, op, "gelu");
  const npk_geglu_options o = geglu_options(dim, approximate, activate_left, eager);
  Call call(op);
  call.tensors({&x, &y, &gelu});
  call.outputs({&y, &gelu});  // just allocated: the store policy (glue.h)
  call.run([&](size_t *bytes) { return npk_geglu_workspace_size(&xt, nullptr, &o, call.exec(), bytes); },
           [&](void *ws, size_t bytes) { return npk_geglu(&xt, nullptr, &o, &yt, &gt, ws, bytes, call.exec()); });
  return {y, gelu};
}

at::Tensor geglu_backward(const at::Tensor &dy_in, const at::Tensor &x_in, int64_t dim, int64_t approximate,
                          bool activate_left, bool eager) {
  const char *op = "npukern::geglu_backward";
  at::Tensor dy = cpu_contiguous(dy_in, op, "dy"), x = cpu_contiguous(x_in, op, "x");
  at::Tensor dx = empty_output_like(x);
  npk_tensor dyt = describe(dy, op, "dy"), xt = describe(x, op, "x"), dxt = describe(dx, op, "dx");
  const npk_geglu_options o = geglu_options(dim, approximate, activate_left, eager);
  Call call(op);
  call.tensors({&dy, &x, &dx});
  call.outputs({&dx});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_geglu_grad_workspace_size(&dyt, &xt, nullptr, &o, call.exec(), bytes); },
      [&](void *ws, size_t bytes) {
        return npk_geglu_grad(&dyt, &xt, nullptr, &o, &dxt, nullptr, ws, bytes, call.exec());
      });
  return dx;
}

at::Tensor gelu_mul(const at::Tensor &gate_in, const at::Tensor &up_in, int64_t approximate, bool eager) {
  const char *op = "npukern::gelu_mul";
  at::Tensor gate = cpu_contiguous(gate_in, op, "gate"), up = cpu_contiguous(up_in, op, "up");
  at::Tensor y = empty_output_like(gate);
  npk_tensor gt = describe(gate, op, "gate"), ut = describe(up, op, "up"), yt = describe(y, op, "y");
  const npk_geglu_options o = geglu_options(-1, approximate, false, eager);
  Call call(op);
  call.tensors({&gate, &up, &y});
  call.outputs({&y});  // just allocated: the store policy (glue.h)
  call.run([&](size_t *bytes) { return npk_geglu_workspace_size(&gt, &ut, &o, call.exec(), bytes); },
           [&](void *ws, size_t bytes) { return npk_geglu(&gt, &ut, &o, &yt, nullptr, ws, bytes, call.exec()); });
  return y;
}

std::tuple<at::Tensor, at::Tensor> gelu_mul_backward(const at::Tensor &dy_in, const at::Tensor &gate_in,
                                                     const at::Tensor &up_in, int64_t approximate, bool eager) {
  const char *op = "npukern::gelu_mul_backward";
  at::Tensor dy = cpu_contiguous(dy_in, op, "dy"), gate = cpu_contiguous(gate_in, op, "gate");
  at::Tensor up = cpu_contiguous(up_in, op, "up");
  at::Tensor dgate = empty_output_like(gate);
  at::Tensor dup = empty_output_like(gate);
  npk_tensor dyt = describe(dy, op, "dy"), gt = describe(gate, op, "gate"), ut = describe(up, op, "up");
  npk_tensor dgt = describe(dgate, op, "dgate"), dut = describe(dup, op, "dup");
  const npk_geglu_options o = geglu_options(-1, approximate, false, eager);
  Call call(op);
  call.tensors({&dy, &gate, &up, &dgate, &dup});
  call.outputs({&dgate, &dup});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_geglu_grad_workspace_size(&dyt, &gt, &ut, &o, call.exec(), bytes); },
      [&](void *ws, size_t bytes) { return npk_geglu_grad(&dyt, &gt, &ut, &o, &dgt, &dut, ws, bytes, call.exec()); });
  return {dgate, dup};
}

at::Tensor rotary_mul(const at::Tensor &x_in, const at::Tensor &cos_in, const at::Tensor &sin_in, bool eager,
                      bool backward) {
  const char *op = "npukern::rotary_mul";
  at::Tensor x = cpu_contiguous(x_in, op, "x"), cos = cpu_contiguous(cos_in, op, "cos");
  at::Tensor sin = cpu_contiguous(sin_in, op, "sin");
  at::Tensor y = empty_output_like(x);
  rope_call(op, x, nullptr, cos, sin, eager, backward, y, nullptr);
  return y;
}

std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor &q_in, const at::Tensor &k_in, const at::Tensor &cos_in,
                                           const at::Tensor &sin_in, bool eager, bool backward) {
  const char *op = "npukern::rope_qk";
  at::Tensor q = cpu_contiguous(q_in, op, "q"), k = cpu_contiguous(k_in, op, "k");
  at::Tensor cos = cpu_contiguous(cos_in, op, "cos"), sin = cpu_contiguous(sin_in, op, "sin");
  at::Tensor qo = empty_output_like(q), ko = empty_output_like(k);
  rope_call(op, q, &k, cos, sin, eager, backward, qo, &ko);
  return {qo, ko};
}

}  // namespace npk_torch
