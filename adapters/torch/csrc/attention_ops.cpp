// Attention (SDPA without a mask or dropout; aclnnFlashAttentionScore's
// analog) as ATen CPU kernels over the C ABI (npk_attention,
// npk_attention_backward): causal or not, grouped-query heads, f32 inside
// with each sum in one fixed order, the same bits on every ISA and thread
// count. q, k, v are read in BNSD ([B, H, S, D]) or, when they are the
// per-head view of a projection (transpose(1, 2) of a contiguous
// [B, S, H, D]: what Hugging Face's attention layers hand SDPA), in BSND
// without a copy; the outputs take q's (and k's) layout and strides.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "glue.h"
#include "ops.h"

namespace npk_torch {

namespace {

// The layout q, k and v can all be read in without a copy: BNSD when all
// are contiguous, BSND when all are the transpose(1, 2) of contiguous
// tensors; else BNSD copies.
struct Operands {
  at::Tensor q, k, v;
  uint32_t layout;
};

bool bsnd(const at::Tensor &t) { return t.dim() == 4 && t.transpose(1, 2).is_contiguous(); }

Operands operands(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const char *op) {
  check_cpu(q, op, "q");
  check_cpu(k, op, "k");
  check_cpu(v, op, "v");
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
                    ": q, k, v must be 4-D [batch, heads, seq, head_dim], got ", q.dim(), ", ", k.dim(), ", ",
                    v.dim(), " dims");
  // A contiguous tensor with one row or one head is both; prefer BNSD then.
  const bool all_bnsd = q.is_contiguous() && k.is_contiguous() && v.is_contiguous();
  if (!all_bnsd && bsnd(q) && bsnd(k) && bsnd(v))
    return {q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), NPK_ATTENTION_BSND};
  return {q.contiguous(), k.contiguous(), v.contiguous(), NPK_ATTENTION_BNSD};
}

// An output shaped as `like` (BNSD sizes) in `layout`, returned as a BNSD view.
at::Tensor output_like(const at::Tensor &stored, const at::Tensor &dtype_of) {
  return empty_output(stored.sizes(), dtype_of.scalar_type());
}

at::Tensor as_bnsd(const at::Tensor &t, uint32_t layout) { return layout == NPK_ATTENTION_BSND ? t.transpose(1, 2) : t; }

npk_attention_options options(bool causal, double scale, uint32_t layout) {
  return npk_attention_options{causal ? 1u : 0u, layout, static_cast<float>(scale), 0u};
}

double default_scale(const at::Tensor &q, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(q.size(-1), 1)));
}

// One block per torch thread: the forward's units are blocks of 84 query
// rows of a head, the backward's key/value heads; the bits do not depend on
// the blocks.
npk_exec threads_exec(const Call &call) {
  npk_exec e = *call.exec();
  e.blocks = static_cast<uint32_t>(std::max(1, at::get_num_threads()));
  return e;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention(const at::Tensor &q_in, const at::Tensor &k_in,
                                                         const at::Tensor &v_in, bool causal,
                                                         std::optional<double> scale_in) {
  const char *op = "npukern::attention";
  Operands o = operands(q_in, k_in, v_in, op);
  const double scale = default_scale(q_in, scale_in);
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  at::Tensor out = output_like(o.q, o.q);
  const int64_t b = q_in.size(0), h = q_in.size(1), s = q_in.size(2);
  at::Tensor mx = empty_output({b, h, s}, at::kFloat), sm = empty_output({b, h, s}, at::kFloat);
  npk_tensor qt = describe(o.q, op, "q"), kt = describe(o.k, op, "k"), vt = describe(o.v, op, "v");
  npk_tensor ot = describe(out, op, "out"), mt = describe(mx, op, "softmax_max"),
             st = describe(sm, op, "softmax_sum");
  const npk_attention_options opts = options(causal, scale, o.layout);
  Call call(op);
  call.tensors({&o.q, &o.k, &o.v, &out});
  npk_exec e = threads_exec(call);
  call.run([&](size_t *bytes) { return npk_attention_workspace_size(&qt, &kt, &vt, &opts, &e, bytes); },
           [&](void *ws, size_t bytes) {
             return npk_attention(&qt, &kt, &vt, &opts, &ot, &mt, &st, ws, bytes, &e);
           });
  return {as_bnsd(out, o.layout), mx, sm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor &dout_in, const at::Tensor &q_in, const at::Tensor &k_in, const at::Tensor &v_in,
    const at::Tensor &out_in, const at::Tensor &softmax_max, const at::Tensor &softmax_sum, bool causal,
    std::optional<double> scale_in) {
  const char *op = "npukern::attention_backward";
  Operands o = operands(q_in, k_in, v_in, op);
  const double scale = default_scale(q_in, scale_in);
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_cpu(out_in, op, "out");
  check_cpu(dout_in, op, "dout");
  TORCH_CHECK_VALUE(out_in.sizes() == q_in.sizes() && dout_in.sizes() == q_in.sizes(), op,
                    ": out and dout must have q's shape ", q_in.sizes(), ", got ", out_in.sizes(), " and ",
                    dout_in.sizes());
  // out and dout in q's layout (copies only when they are not).
  const auto stored = [&](const at::Tensor &t) {
    return o.layout == NPK_ATTENTION_BSND ? t.transpose(1, 2).contiguous() : t.contiguous();
  };
  const at::Tensor out = stored(out_in), dout = stored(dout_in.to(q_in.scalar_type()));
  const at::Tensor mx = cpu_contiguous(softmax_max, op, "softmax_max"),
                   sm = cpu_contiguous(softmax_sum, op, "softmax_sum");
  at::Tensor dq = output_like(o.q, o.q), dk = output_like(o.k, o.k), dv = output_like(o.v, o.v);
  npk_tensor qt = describe(o.q, op, "q"), kt = describe(o.k, op, "k"), vt = describe(o.v, op, "v");
  npk_tensor ot = describe(out, op, "out"), dot = describe(dout, op, "dout"),
             mt = describe(mx, op, "softmax_max"), st = describe(sm, op, "softmax_sum");
  npk_tensor dqt = describe(dq, op, "dq"), dkt = describe(dk, op, "dk"), dvt = describe(dv, op, "dv");
  const npk_attention_options opts = options(causal, scale, o.layout);
  Call call(op);
  call.tensors({&o.q, &o.k, &o.v, &dq});
  npk_exec e = threads_exec(call);
  call.run(
      [&](size_t *bytes) { return npk_attention_backward_workspace_size(&qt, &kt, &vt, &opts, &e, bytes); },
      [&](void *ws, size_t bytes) {
        return npk_attention_backward(&qt, &kt, &vt, &ot, &dot, &mt, &st, &opts, &dqt, &dkt, &dvt, ws, bytes, &e);
      });
  return {as_bnsd(dq, o.layout), as_bnsd(dk, o.layout), as_bnsd(dv, o.layout)};
}

}  // namespace npk_torch
