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

namespace {

// SwiGLU's and GeGLU's C entry points, overloaded on the options type, so
// that each wrapper below is written once for both operators (their calls
// differ only in the options and GeGLU's optional gelu output).
npk_status fwd_size(const npk_tensor *a, const npk_tensor *b, const npk_swiglu_options *o, const npk_exec *e,
                    size_t *n) {
  return npk_swiglu_workspace_size(a, b, o, e, n);
}
npk_status fwd_size(const npk_tensor *a, const npk_tensor *b, const npk_geglu_options *o, const npk_exec *e,
                    size_t *n) {
  return npk_geglu_workspace_size(a, b, o, e, n);
}
// `act` is the activation's output: GeGLU's gelu (may be NULL); SwiGLU has none.
npk_status fwd(const npk_tensor *a, const npk_tensor *b, const npk_swiglu_options *o, const npk_tensor *y,
               const npk_tensor * /*act*/, void *ws, size_t n, const npk_exec *e) {
  return npk_swiglu(a, b, o, y, ws, n, e);
}
npk_status fwd(const npk_tensor *a, const npk_tensor *b, const npk_geglu_options *o, const npk_tensor *y,
               const npk_tensor *act, void *ws, size_t n, const npk_exec *e) {
  return npk_geglu(a, b, o, y, act, ws, n, e);
}
npk_status grad_size(const npk_tensor *dy, const npk_tensor *a, const npk_tensor *b, const npk_swiglu_options *o,
                     const npk_exec *e, size_t *n) {
  return npk_swiglu_grad_workspace_size(dy, a, b, o, e, n);
}
npk_status grad_size(const npk_tensor *dy, const npk_tensor *a, const npk_tensor *b, const npk_geglu_options *o,
                     const npk_exec *e, size_t *n) {
  return npk_geglu_grad_workspace_size(dy, a, b, o, e, n);
}
npk_status grad(const npk_tensor *dy, const npk_tensor *a, const npk_tensor *b, const npk_swiglu_options *o,
                const npk_tensor *da, const npk_tensor *db, void *ws, size_t n, const npk_exec *e) {
  return npk_swiglu_grad(dy, a, b, o, da, db, ws, n, e);
}
npk_status grad(const npk_tensor *dy, const npk_tensor *a, const npk_tensor *b, const npk_geglu_options *o,
                const npk_tensor *da, const npk_tensor *db, void *ws, size_t n, const npk_exec *e) {
  return npk_geglu_grad(dy, a, b, o, da, db, ws, n, e);
}

// The split form's forward: y (half of x along `dim`) and, when `with_act`,
// the activation's output laid out as y (GeGLU's gelu).
template <class Options>
std::tuple<at::Tensor, at::Tensor> gated_split(const char *op, const at::Tensor &x_in, int64_t dim,
                                               const Options &o, bool with_act) {
  at::Tensor x = cpu_contiguous(x_in, op, "x");
  auto shape = half_shape(x, dim, op);
  at::Tensor y = empty_output(shape, x.scalar_type());
  at::Tensor act = with_act ? empty_output(shape, x.scalar_type()) : at::Tensor();
  npk_tensor xt = describe(x, op, "x"), yt = describe(y, op, "y");
  npk_tensor at_ = with_act ? describe(act, op, "gelu") : npk_tensor{};
  const npk_tensor *act_t = with_act ? &at_ : nullptr;
  Call call(op);
  call.tensors({&x, &y, with_act ? &act : nullptr});
  call.outputs({&y, with_act ? &act : nullptr});  // just allocated: the store policy (glue.h)
  call.run([&](size_t *bytes) { return fwd_size(&xt, nullptr, &o, call.exec(), bytes); },
           [&](void *ws, size_t bytes) { return fwd(&xt, nullptr, &o, &yt, act_t, ws, bytes, call.exec()); });
  return {y, act};
}

// The split form's backward: dx, laid out as x.
template <class Options>
at::Tensor gated_split_backward(const char *op, const at::Tensor &dy_in, const at::Tensor &x_in, const Options &o) {
  at::Tensor dy = cpu_contiguous(dy_in, op, "dy"), x = cpu_contiguous(x_in, op, "x");
  at::Tensor dx = empty_output_like(x);
  npk_tensor dyt = describe(dy, op, "dy"), xt = describe(x, op, "x"), dxt = describe(dx, op, "dx");
  Call call(op);
  call.tensors({&dy, &x, &dx});
  call.outputs({&dx});  // just allocated: the store policy (glue.h)
  call.run([&](size_t *bytes) { return grad_size(&dyt, &xt, nullptr, &o, call.exec(), bytes); },
           [&](void *ws, size_t bytes) { return grad(&dyt, &xt, nullptr, &o, &dxt, nullptr, ws, bytes, call.exec()); });
  return dx;
}

// The two-tensor form's forward: `act(gate) * up`.
template <class Options>
at::Tensor gated_mul(const char *op, const at::Tensor &gate_in, const at::Tensor &up_in, const Options &o) {
  at::Tensor gate = cpu_contiguous(gate_in, op, "gate"), up = cpu_contiguous(up_in, op, "up");
  at::Tensor y = empty_output_like(gate);
  npk_tensor gt = describe(gate, op, "gate"), ut = describe(up, op, "up"), yt = describe(y, op, "y");
  Call call(op);
  call.tensors({&gate, &up, &y});
  call.outputs({&y});  // just allocated: the store policy (glue.h)
  call.run([&](size_t *bytes) { return fwd_size(&gt, &ut, &o, call.exec(), bytes); },
           [&](void *ws, size_t bytes) { return fwd(&gt, &ut, &o, &yt, nullptr, ws, bytes, call.exec()); });
  return y;
}

// The two-tensor form's backward: (dgate, dup).
template <class Options>
std::tuple<at::Tensor, at::Tensor> gated_mul_backward(const char *op, const at::Tensor &dy_in,
                                                      const at::Tensor &gate_in, const at::Tensor &up_in,
                                                      const Options &o) {
  at::Tensor dy = cpu_contiguous(dy_in, op, "dy"), gate = cpu_contiguous(gate_in, op, "gate");
  at::Tensor up = cpu_contiguous(up_in, op, "up");
  at::Tensor dgate = empty_output_like(gate);
  at::Tensor dup = empty_output_like(gate);
  npk_tensor dyt = describe(dy, op, "dy"), gt = describe(gate, op, "gate"), ut = describe(up, op, "up");
  npk_tensor dgt = describe(dgate, op, "dgate"), dut = describe(dup, op, "dup");
  Call call(op);
  call.tensors({&dy, &gate, &up, &dgate, &dup});
  call.outputs({&dgate, &dup});  // just allocated: the store policy (glue.h)
  call.run([&](size_t *bytes) { return grad_size(&dyt, &gt, &ut, &o, call.exec(), bytes); },
           [&](void *ws, size_t bytes) { return grad(&dyt, &gt, &ut, &o, &dgt, &dut, ws, bytes, call.exec()); });
  return {dgate, dup};
}

}  // namespace

at::Tensor swiglu(const at::Tensor &x, int64_t dim, bool eager) {
  return std::get<0>(gated_split("npukern::swiglu", x, dim, swiglu_options(dim, eager), /*with_act=*/false));
}

at::Tensor swiglu_backward(const at::Tensor &dy, const at::Tensor &x, int64_t dim, bool eager) {
  return gated_split_backward("npukern::swiglu_backward", dy, x, swiglu_options(dim, eager));
}

at::Tensor silu_mul(const at::Tensor &gate, const at::Tensor &up, bool eager) {
  return gated_mul("npukern::silu_mul", gate, up, swiglu_options(-1, eager));
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor &dy, const at::Tensor &gate,
                                                     const at::Tensor &up, bool eager) {
  return gated_mul_backward("npukern::silu_mul_backward", dy, gate, up, swiglu_options(-1, eager));
}

std::tuple<at::Tensor, at::Tensor> geglu(const at::Tensor &x, int64_t dim, int64_t approximate, bool activate_left,
                                         bool eager) {
  return gated_split("npukern::geglu", x, dim, geglu_options(dim, approximate, activate_left, eager),
                     /*with_act=*/true);
}

at::Tensor geglu_backward(const at::Tensor &dy, const at::Tensor &x, int64_t dim, int64_t approximate,
                          bool activate_left, bool eager) {
  return gated_split_backward("npukern::geglu_backward", dy, x,
                              geglu_options(dim, approximate, activate_left, eager));
}

at::Tensor gelu_mul(const at::Tensor &gate, const at::Tensor &up, int64_t approximate, bool eager) {
  return gated_mul("npukern::gelu_mul", gate, up, geglu_options(-1, approximate, false, eager));
}

std::tuple<at::Tensor, at::Tensor> gelu_mul_backward(const at::Tensor &dy, const at::Tensor &gate,
                                                     const at::Tensor &up, int64_t approximate, bool eager) {
  return gated_mul_backward("npukern::gelu_mul_backward", dy, gate, up, geglu_options(-1, approximate, false, eager));
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
