// Matmul and the Linear layer's three products as ATen CPU kernels over the
// C ABI (npk_matmul_v2: with math 0, npk_matmul's f32 FMA chains with k
// ascending, one rounding; with math 1, bf16 only, VDPBF16PS's pair dot:
// pairs of k steps, the odd one first, subnormals flushed; with math 2, bf16
// only, Arm's BFDOT sums, rounded to odd. Each gives the same bits on every
// ISA and thread count).

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

#include "glue.h"
#include "ops.h"

namespace npk_torch {

namespace {

// A 2-D operand as the C ABI reads it: contiguous as given, or a transposed
// view of a contiguous tensor (weight.t(), x.mT) read through the opposite
// trans flag without a copy; anything else copied once.
std::pair<at::Tensor, bool> operand(const at::Tensor &t, bool trans, const char *op, const char *arg) {
  check_cpu(t, op, arg);
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": ", arg, " must be 2-D, got ", t.dim(), " dims");
  if (t.is_contiguous()) return {t, trans};
  at::Tensor tt = t.t();
  if (tt.is_contiguous()) return {tt, !trans};
  return {t.contiguous(), trans};
}

npk_matmul_v2_options options(bool trans_a, bool trans_b, bool accumulate, int64_t math) {
  return npk_matmul_v2_options{trans_a ? 1u : 0u, trans_b ? 1u : 0u, accumulate ? 1u : 0u,
                               static_cast<uint32_t>(math)};
}

// `math` is an npk_matmul_math: 0 (NPK_MATMUL_CHAIN), 1
// (NPK_MATMUL_BF16_DOT) or 2 (NPK_MATMUL_BF16_DOT_ARM), the pair dots with
// bf16 operands only, checked before any output is allocated (the library
// checks it again).
void check_math(const char *op, int64_t math, const at::Tensor &a, const at::Tensor &b) {
  TORCH_CHECK_VALUE(math == NPK_MATMUL_CHAIN || math == NPK_MATMUL_BF16_DOT || math == NPK_MATMUL_BF16_DOT_ARM, op,
                    ": math must be 0 (the FMA chain), 1 (the bf16 pair dot) or 2 (Arm's bf16 pair dot), got ",
                    math);
  TORCH_CHECK_TYPE(math == NPK_MATMUL_CHAIN || (a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16),
                   op, ": math=", math, " (a bf16 pair dot) takes bfloat16 operands, got ", a.scalar_type(), " and ",
                   b.scalar_type());
}

// c = op(a) op(b) into `c` (allocated by the caller, or accumulated into).
void run_matmul(const char *op, const at::Tensor &a, bool trans_a, const at::Tensor &b, bool trans_b,
                const at::Tensor &c, bool accumulate, bool fresh, int64_t math) {
  npk_tensor at_ = describe(a, op, "a"), bt = describe(b, op, "b"), ct = describe(c, op, "c");
  const npk_matmul_v2_options o = options(trans_a, trans_b, accumulate, math);
  Call call(op);
  call.tensors({&a, &b, &c});
  if (fresh) call.outputs({&c});
  // One block per torch thread: the plan cuts as many output tiles as there
  // are blocks, and each tile packs its own b; the default 64 blocks cut
  // 168-row tiles that repacked b four times as often (and took 64 arenas)
  // on one thread. The bits do not depend on the blocks (k runs in one order).
  npk_exec e = *call.exec();
  e.blocks = static_cast<uint32_t>(std::max(1, at::get_num_threads()));
  call.run([&](size_t *bytes) { return npk_matmul_v2_workspace_size(&at_, &bt, &o, &ct, &e, bytes); },
           [&](void *ws, size_t bytes) { return npk_matmul_v2(&at_, &bt, &o, &ct, ws, bytes, &e); });
}

// The rows and columns of op(a) op(b), checked before c is allocated (the
// library checks them again, with the dtypes).
std::pair<int64_t, int64_t> product_shape(const char *op, const at::Tensor &a, bool trans_a, const at::Tensor &b,
                                          bool trans_b) {
  const int64_t m = trans_a ? a.size(1) : a.size(0), ka = trans_a ? a.size(0) : a.size(1);
  const int64_t kb = trans_b ? b.size(1) : b.size(0), n = trans_b ? b.size(0) : b.size(1);
  TORCH_CHECK_VALUE(ka == kb, op, ": a's summed dimension is ", ka, " and b's ", kb, " (shapes ", a.sizes(),
                    trans_a ? " transposed" : "", " and ", b.sizes(), trans_b ? " transposed" : "", ")");
  return {m, n};
}

}  // namespace

at::Tensor matmul(const at::Tensor &a_in, const at::Tensor &b_in, bool trans_a, bool trans_b,
                  std::optional<at::ScalarType> out_dtype, int64_t math) {
  const char *op = "npukern::matmul";
  auto [a, ta] = operand(a_in, trans_a, op, "a");
  auto [b, tb] = operand(b_in, trans_b, op, "b");
  auto [m, n] = product_shape(op, a, ta, b, tb);
  check_math(op, math, a, b);
  const at::ScalarType dt = out_dtype.value_or(a.scalar_type());
  TORCH_CHECK_TYPE(dt == a.scalar_type() || dt == at::kFloat, op, ": out_dtype ", dt, " must be a's dtype (",
                   a.scalar_type(), ") or float32");
  at::Tensor c = empty_output({m, n}, dt);
  run_matmul(op, a, ta, b, tb, c, false, true, math);
  return c;
}

void matmul_accumulate_(at::Tensor &c, const at::Tensor &a_in, const at::Tensor &b_in, bool trans_a,
                        bool trans_b, int64_t math) {
  const char *op = "npukern::matmul_accumulate_";
  check_cpu(c, op, "c");
  TORCH_CHECK_TYPE(c.scalar_type() == at::kFloat, op, ": c must be float32 (the f32 sums a weight gradient "
                   "accumulates in), got ", c.scalar_type());
  TORCH_CHECK_VALUE(c.is_contiguous(), op, ": c must be contiguous (it is written in place)");
  TORCH_CHECK_VALUE(at::has_internal_overlap(c) != at::MemOverlap::Yes, op, ": c overlaps itself");
  auto [a, ta] = operand(a_in, trans_a, op, "a");
  auto [b, tb] = operand(b_in, trans_b, op, "b");
  auto [m, n] = product_shape(op, a, ta, b, tb);
  check_math(op, math, a, b);
  TORCH_CHECK_VALUE(c.dim() == 2 && c.size(0) == m && c.size(1) == n, op, ": c has shape ", c.sizes(),
                    "; the product is [", m, ", ", n, "]");
  for (const at::Tensor *x : {&a, &b}) {
    TORCH_CHECK_VALUE(at::get_overlap_status(c, *x) == at::MemOverlapStatus::No, op,
                      ": c shares memory with an operand");
  }
  run_matmul(op, a, ta, b, tb, c, true, false, math);
}

at::Tensor linear(const at::Tensor &input, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                  int64_t math) {
  const char *op = "npukern::linear";
  check_cpu(input, op, "input");
  TORCH_CHECK_VALUE(input.dim() >= 1, op, ": input must have at least 1 dim");
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be 2-D [out_features, in_features], got ",
                    weight.dim(), " dims");
  TORCH_CHECK_TYPE(input.scalar_type() == weight.scalar_type(), op, ": input is ", input.scalar_type(),
                   " and weight ", weight.scalar_type(), " (the same dtype, as F.linear wants)");
  const int64_t in = weight.size(1), out = weight.size(0);
  TORCH_CHECK_VALUE(input.size(-1) == in, op, ": input's last dim is ", input.size(-1),
                    " and weight's in_features ", in);
  c10::SmallVector<int64_t, NPK_MAX_DIMS> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = out;
  at::Tensor x = input.reshape({-1, in});
  if (!bias.has_value() || !bias->defined()) return matmul(x, weight, false, true, std::nullopt, math).view(shape);
  const at::Tensor &b = *bias;
  check_cpu(b, op, "bias");
  TORCH_CHECK_TYPE(b.scalar_type() == input.scalar_type(), op, ": bias is ", b.scalar_type(), " and input ",
                   input.scalar_type());
  TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == out, op, ": bias has shape ", b.sizes(), "; want [", out, "]");
  // The bias starts each f32 sum, so y is still rounded once.
  at::Tensor acc = b.to(at::kFloat).expand({x.size(0), out}).contiguous();
  matmul_accumulate_(acc, x, weight, false, true, math);
  return (input.scalar_type() == at::kFloat ? acc : acc.to(input.scalar_type())).view(shape);
}

}  // namespace npk_torch
