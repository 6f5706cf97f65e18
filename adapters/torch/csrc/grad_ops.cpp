// Gradient health over a list of tensors: npk_grad_stats and
// npk_clip_grad_norm (torch.nn.utils.clip_grad_norm_, L2) over the C ABI.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <vector>

#include "glue.h"
#include "ops.h"

namespace npk_torch {
namespace {

// The list as flat npk_tensors. A non-contiguous gradient is copied to a
// contiguous buffer (`work`), which the caller copies back after an in-place
// call.
struct GradList {
  std::vector<at::Tensor> work;
  std::vector<npk_tensor> desc;

  GradList(const char *op, at::TensorList grads) {
    work.reserve(grads.size());
    desc.reserve(grads.size());
    for (const at::Tensor &g : grads) {
      at::Tensor c = cpu_contiguous(g, op, "grads");
      npk_tensor d = describe(c, op, "grads");
      d.ndim = 1;  // stats see elements, not shapes (0-dim gradients included)
      d.shape[0] = c.numel();
      work.push_back(c);
      desc.push_back(d);
    }
  }
  const npk_tensor *data() const { return desc.empty() ? nullptr : desc.data(); }

  // Phase one: the workspace npk_grad_stats and npk_clip_grad_norm need.
  void *workspace(Call &call, size_t *bytes) const {
    *bytes = 0;
    call.check(npk_grad_stats_workspace_size(data(), desc.size(), call.exec(), bytes));
    return call.workspace(*bytes);
  }
};

}  // namespace

at::Tensor grad_stats(at::TensorList grads) {
  const char *op = "npukern::grad_stats";
  GradList list(op, grads);
  Call call(op);
  size_t bytes = 0;
  void *ws = list.workspace(call, &bytes);
  npk_grad_summary s{};
  call.check(npk_grad_stats(list.data(), list.desc.size(), &s, ws, bytes, call.exec()));
  at::Tensor out = at::empty({6}, at::TensorOptions().dtype(at::kDouble));
  double *o = out.data_ptr<double>();
  o[0] = s.sum_sq;
  o[1] = static_cast<double>(s.nan_count);
  o[2] = static_cast<double>(s.inf_count);
  o[3] = s.min;
  o[4] = s.max;
  o[5] = s.absmax;
  return out;
}

at::Tensor clip_grad_norm_(at::TensorList grads, double max_norm, bool error_if_nonfinite) {
  const char *op = "npukern::clip_grad_norm_";
  GradList list(op, grads);
  Call call(op);
  size_t bytes = 0;
  void *ws = list.workspace(call, &bytes);
  double total = 0.0;
  call.check(npk_clip_grad_norm(list.data(), list.desc.size(), max_norm, error_if_nonfinite ? 1 : 0, &total,
                                ws, bytes, call.exec()));
  for (size_t i = 0; i < grads.size(); i++)
    if (!list.work[i].is_same(grads[i])) grads[i].copy_(list.work[i]);
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(at::kDouble));
  *out.data_ptr<double>() = total;
  return out;
}

}  // namespace npk_torch
