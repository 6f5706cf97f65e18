// CrossEntropy (forward, backward, and the fused per-chunk step of the
// linear cross-entropy) as ATen CPU kernels over the C ABI.

#include <tuple>

#include "glue.h"
#include "ops.h"

namespace npk_torch {

namespace {

npk_cross_entropy_options ce_options(int64_t reduction, int64_t ignore_index, double label_smoothing,
                                     double lse_square_scale, double softcap) {
  npk_cross_entropy_options o{};
  o.reduction = static_cast<npk_reduction>(reduction);
  o.ignore_index = ignore_index;
  o.label_smoothing = static_cast<float>(label_smoothing);
  o.lse_square_scale = static_cast<float>(lse_square_scale);
  o.softcap = static_cast<float>(softcap);
  return o;
}

void check_reduction(const char *op, int64_t reduction) {
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2, op, ": reduction ", reduction,
                    " is not 0 (none), 1 (sum) or 2 (mean)");
}

// The optional weight: a contiguous CPU tensor's descriptor, or none.
struct Optional {
  at::Tensor t;
  npk_tensor d{};
  const npk_tensor *ptr() const { return t.defined() ? &d : nullptr; }
};

Optional optional(const std::optional<at::Tensor> &in, const char *op, const char *arg) {
  Optional o;
  if (in.has_value() && in->defined()) {
    o.t = cpu_contiguous(*in, op, arg);
    o.d = describe(o.t, op, arg);
  }
  return o;
}

// The logits are [N, C]: the rows are every dim but the last.
int64_t rows_of(const at::Tensor &logits, const char *op) {
  TORCH_CHECK_VALUE(logits.dim() == 2, op, ": logits must be [N, C], got shape ", logits.sizes());
  return logits.size(0);
}

// A 0-dim float32 tensor holding v.
at::Tensor scalar_f32(float v) {
  at::Tensor out = empty_output({}, at::kFloat);
  *out.data_ptr<float>() = v;
  return out;
}

// The crate's reduction of per-row losses (npk_cross_entropy_reduce: the
// f32 rows summed in float64 in row order, a mean over the float64 weight
// sum of the rows not ignored, rounded once) -- the one definition every
// path uses (the forward alone, the training forward, the fused LM head's
// chunks), so a loss has the same bits with and without grad, from C and
// from PyTorch; N = 0 or every row ignored give torch's answers (0 for a
// sum, NaN for a mean).
at::Tensor reduce_rows(const char *op, const at::Tensor &rows, const at::Tensor &target, const Optional &weight,
                       const npk_cross_entropy_options &o) {
  npk_tensor rt = describe(rows, op, "loss_rows"), tt = describe(target, op, "target");
  Call call(op);
  float out = 0.0f;
  call.check(npk_cross_entropy_reduce(&rt, &tt, weight.ptr(), &o, &out, call.exec()));
  return scalar_f32(out);
}

// The factor dlogits get from an upstream gradient g of the reduced loss
// (npk_cross_entropy_grad_scale: g, or g over the mean's denominator).
float grad_scale_of(const char *op, const at::Tensor &target, const Optional &weight,
                    const npk_cross_entropy_options &o, float g) {
  npk_tensor tt = describe(target, op, "target");
  Call call(op);
  float out = 0.0f;
  call.check(npk_cross_entropy_grad_scale(&tt, weight.ptr(), &o, g, &out, call.exec()));
  return out;
}

// The kernel's forward with per-row losses (reduction none) into `loss`.
void forward_rows(const char *op, const at::Tensor &logits, const at::Tensor &target, const Optional &weight,
                  const npk_cross_entropy_options &o, at::Tensor &loss, at::Tensor &lse) {
  npk_tensor lt = describe(logits, op, "logits"), tt = describe(target, op, "target");
  npk_tensor losst = describe(loss, op, "loss"), lset = describe(lse, op, "lse");
  if (loss.dim() == 0) {  // a reduced loss: the C ABI's one element
    losst.ndim = 1;
    losst.shape[0] = 1;
  }
  Call call(op);
  call.tensors({&logits, &target, &weight.t, &loss, &lse});
  call.run(
      [&](size_t *bytes) { return npk_cross_entropy_workspace_size(&lt, &tt, weight.ptr(), &o, call.exec(), bytes); },
      [&](void *ws, size_t bytes) {
        return npk_cross_entropy(&lt, &tt, weight.ptr(), &o, &losst, &lset, ws, bytes, call.exec());
      });
}

// The kernel's fused form: per-row losses and lse into `loss` and `lse`,
// dlogits (scaled by `grad_scale`, 0-dim or one per row) into `dlogits`,
// which is the logits themselves (in place) or a fresh output. Its
// workspace is the exp cache: taken at its size, not merely tried.
void fused_rows(const char *op, const at::Tensor &logits, const at::Tensor &target, const Optional &weight,
                const at::Tensor &grad_scale, const npk_cross_entropy_options &o, at::Tensor &loss, at::Tensor &lse,
                at::Tensor &dlogits) {
  npk_tensor lt = describe(logits, op, "logits"), tt = describe(target, op, "target");
  npk_tensor st = describe(grad_scale, op, "grad_scale"), dt = describe(dlogits, op, "dlogits");
  if (grad_scale.dim() == 0) {  // the C ABI's scalar is one element
    st.ndim = 1;
    st.shape[0] = 1;
  }
  npk_tensor losst = describe(loss, op, "loss"), lset = describe(lse, op, "lse");
  const bool in_place = dlogits.data_ptr() == logits.data_ptr();
  Call call(op);
  call.tensors({&logits, &target, &weight.t, &grad_scale, &loss, &lse, &dlogits});
  if (!in_place) call.outputs({&dlogits});  // just allocated: the store policy (glue.h)
  call.run_sized(
      [&](size_t *bytes) {
        return npk_cross_entropy_fused_workspace_size(&lt, &tt, weight.ptr(), &o, call.exec(), bytes);
      },
      [&](void *ws, size_t bytes) {
        return npk_cross_entropy_fused(&lt, &tt, weight.ptr(), &st, &o, &losst, &lset, &dt, ws, bytes, call.exec());
      });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy(const at::Tensor &logits_in, const at::Tensor &target_in,
                                                 const std::optional<at::Tensor> &weight_in, int64_t reduction,
                                                 int64_t ignore_index, double label_smoothing,
                                                 double lse_square_scale, double softcap) {
  const char *op = "npukern::cross_entropy";
  check_reduction(op, reduction);
  at::Tensor logits = cpu_contiguous(logits_in, op, "logits"), target = cpu_contiguous(target_in, op, "target");
  const int64_t n = rows_of(logits, op);
  Optional weight = optional(weight_in, op, "weight");
  // The kernel reduces itself (its one definition) for a sum or mean.
  at::Tensor loss = empty_output(reduction == 0 ? c10::IntArrayRef{n} : c10::IntArrayRef{}, at::kFloat);
  at::Tensor lse = empty_output({n}, at::kFloat);
  forward_rows(op, logits, target, weight,
               ce_options(reduction, ignore_index, label_smoothing, lse_square_scale, softcap), loss, lse);
  return {loss, lse};
}

at::Tensor cross_entropy_backward(const at::Tensor &grad_in, const at::Tensor &logits_in, const at::Tensor &target_in,
                                  const std::optional<at::Tensor> &weight_in, const at::Tensor &lse_in,
                                  int64_t reduction, int64_t ignore_index, double label_smoothing,
                                  double lse_square_scale, double softcap) {
  const char *op = "npukern::cross_entropy_backward";
  check_reduction(op, reduction);
  at::Tensor logits = cpu_contiguous(logits_in, op, "logits"), target = cpu_contiguous(target_in, op, "target");
  at::Tensor lse = cpu_contiguous(lse_in, op, "lse");
  at::Tensor grad = cpu_contiguous(grad_in, op, "grad");
  rows_of(logits, op);
  Optional weight = optional(weight_in, op, "weight");
  at::Tensor dlogits = empty_output(logits.sizes(), logits.scalar_type());
  npk_tensor lt = describe(logits, op, "logits"), tt = describe(target, op, "target");
  npk_tensor lset = describe(lse, op, "lse"), gt = describe(grad, op, "grad");
  npk_tensor dt = describe(dlogits, op, "dlogits");
  if (grad.dim() == 0) {
    gt.ndim = 1;
    gt.shape[0] = 1;
  }
  const npk_cross_entropy_options o = ce_options(reduction, ignore_index, label_smoothing, lse_square_scale, softcap);
  Call call(op);
  call.tensors({&grad, &logits, &target, &weight.t, &lse, &dlogits});
  call.outputs({&dlogits});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) {
        return npk_cross_entropy_grad_workspace_size(&lt, &tt, weight.ptr(), &o, call.exec(), bytes);
      },
      [&](void *ws, size_t bytes) {
        return npk_cross_entropy_grad(&lt, &tt, weight.ptr(), &lset, &gt, &o, &dt, ws, bytes, call.exec());
      });
  return dlogits;
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_fused_(at::Tensor &logits, const at::Tensor &target_in,
                                                        const std::optional<at::Tensor> &weight_in,
                                                        const at::Tensor &grad_scale_in, int64_t ignore_index,
                                                        double label_smoothing, double lse_square_scale,
                                                        double softcap) {
  const char *op = "npukern::cross_entropy_fused_";
  cpu_contiguous(logits, op, "logits");
  TORCH_CHECK_VALUE(logits.is_contiguous(), op, ": logits must be contiguous (dlogits are written over them)");
  at::Tensor target = cpu_contiguous(target_in, op, "target");
  at::Tensor grad_scale = cpu_contiguous(grad_scale_in, op, "grad_scale");
  const int64_t n = rows_of(logits, op);
  Optional weight = optional(weight_in, op, "weight");
  at::Tensor loss = empty_output({n}, at::kFloat), lse = empty_output({n}, at::kFloat);
  fused_rows(op, logits, target, weight, grad_scale,
             ce_options(0, ignore_index, label_smoothing, lse_square_scale, softcap), loss, lse, logits);
  return {loss, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_train(
    const at::Tensor &logits_in, const at::Tensor &target_in, const std::optional<at::Tensor> &weight_in,
    int64_t reduction, int64_t ignore_index, double label_smoothing, double lse_square_scale, double softcap) {
  const char *op = "npukern::cross_entropy_train";
  TORCH_CHECK_VALUE(reduction == 1 || reduction == 2, op, ": reduction ", reduction, " is not 1 (sum) or 2 (mean)");
  at::Tensor logits = cpu_contiguous(logits_in, op, "logits"), target = cpu_contiguous(target_in, op, "target");
  const int64_t n = rows_of(logits, op);
  Optional weight = optional(weight_in, op, "weight");
  // d loss / d logits for an upstream gradient of 1: the backward's own
  // factor (the crate's), so these are the backward op's bits.
  const npk_cross_entropy_options o = ce_options(reduction, ignore_index, label_smoothing, lse_square_scale, softcap);
  const at::Tensor scale = scalar_f32(grad_scale_of(op, target, weight, o, 1.0f));
  at::Tensor rows = empty_output({n}, at::kFloat), lse = empty_output({n}, at::kFloat);
  at::Tensor dlogits = empty_output(logits.sizes(), logits.scalar_type());
  fused_rows(op, logits, target, weight, scale,
             ce_options(0, ignore_index, label_smoothing, lse_square_scale, softcap), rows, lse, dlogits);
  return {reduce_rows(op, rows, target, weight, o), lse, dlogits};
}

at::Tensor cross_entropy_reduce(const at::Tensor &loss_rows_in, const at::Tensor &target_in,
                                const std::optional<at::Tensor> &weight_in, int64_t reduction, int64_t ignore_index) {
  const char *op = "npukern::cross_entropy_reduce";
  check_reduction(op, reduction);
  at::Tensor rows = cpu_contiguous(loss_rows_in, op, "loss_rows"), target = cpu_contiguous(target_in, op, "target");
  Optional weight = optional(weight_in, op, "weight");
  return reduce_rows(op, rows, target, weight, ce_options(reduction, ignore_index, 0.0, 0.0, 0.0));
}

at::Tensor cross_entropy_grad_scale(const at::Tensor &target_in, const std::optional<at::Tensor> &weight_in,
                                    int64_t reduction, int64_t ignore_index, double grad) {
  const char *op = "npukern::cross_entropy_grad_scale";
  check_reduction(op, reduction);
  at::Tensor target = cpu_contiguous(target_in, op, "target");
  Optional weight = optional(weight_in, op, "weight");
  return scalar_f32(grad_scale_of(op, target, weight, ce_options(reduction, ignore_index, 0.0, 0.0, 0.0),
                                  static_cast<float>(grad)));
}

}  // namespace npk_torch
