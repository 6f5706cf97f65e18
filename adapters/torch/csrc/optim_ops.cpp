// AdamW / Adam over tensor lists: npk_adamw over the C ABI (what
// npukern_torch.optim.AdamW steps with). One call updates a bucket of
// params that share dtypes and a step count.
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "glue.h"
#include "ops.h"

namespace npk_torch {
namespace {

// A list as flat npk_tensors (the operator sees elements, not shapes). A
// non-contiguous tensor is copied to a contiguous buffer (`work`), copied
// back after the call when the list is written.
struct FlatList {
  at::TensorList orig;
  std::vector<at::Tensor> work;
  std::vector<npk_tensor> desc;

  FlatList(const char *op, const char *arg, at::TensorList ts) : orig(ts) {
    work.reserve(ts.size());
    desc.reserve(ts.size());
    for (const at::Tensor &t : ts) {
      at::Tensor c = cpu_contiguous(t, op, arg);
      npk_tensor d = describe(c, op, arg);
      d.ndim = 1;
      d.shape[0] = c.numel();
      work.push_back(c);
      desc.push_back(d);
    }
  }
  npk_tensor_array array() const { return {desc.empty() ? nullptr : desc.data(), desc.size()}; }
  void copy_back() const {
    for (size_t i = 0; i < orig.size(); i++)
      if (!work[i].is_same(orig[i])) orig[i].copy_(work[i]);
  }
};

// One tensor's bytes: from its lowest to one past its highest element.
struct Span {
  uintptr_t lo, hi;
  const char *list;
  size_t index;
  const at::Tensor *t;
  bool written;
};

// Refuses, before anything is copied or written, a written tensor that
// overlaps itself (an expanded view: its elements would be updated more
// than once) or any other tensor of the call (two lists, or one param
// listed twice: one update would be lost), strided views included (their
// copies would hide the overlap from the library's own check). Reads may
// share memory with reads. Spans sorted by their start; only pairs whose
// spans intersect are asked exactly (at::get_overlap_status).
void check_overlaps(const char *op, std::initializer_list<std::pair<const char *, at::TensorList>> lists,
                    size_t written_lists) {
  std::vector<Span> spans;
  size_t li = 0;
  for (const auto &[name, ts] : lists) {
    const bool written = li++ < written_lists;
    for (size_t i = 0; i < ts.size(); i++) {
      const at::Tensor &t = ts[i];
      check_cpu(t, op, name);
      if (t.numel() == 0) continue;
      if (written)
        TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name, "[", i,
                          "] overlaps itself (an expanded or self-overlapping view); every element it updates "
                          "must be its own");
      int64_t last = 0;
      for (int64_t d = 0; d < t.dim(); d++) last += (t.size(d) - 1) * std::max<int64_t>(t.stride(d), 0);
      const uintptr_t lo = reinterpret_cast<uintptr_t>(t.data_ptr());
      spans.push_back({lo, lo + static_cast<uintptr_t>((last + 1) * t.element_size()), name, i, &t, written});
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span &a, const Span &b) { return a.lo < b.lo; });
  for (size_t i = 0; i < spans.size(); i++) {
    for (size_t j = i + 1; j < spans.size() && spans[j].lo < spans[i].hi; j++) {
      const Span &a = spans[i], &b = spans[j];
      if (!a.written && !b.written) continue;
      const at::MemOverlapStatus st = at::get_overlap_status(*a.t, *b.t);
      TORCH_CHECK_VALUE(st == at::MemOverlapStatus::No, op, ": ", a.list, "[", a.index, "] and ", b.list, "[",
                        b.index, "] share memory", st == at::MemOverlapStatus::TooHard ? " (interleaved views)" : "",
                        "; each param, grad and state tensor must have its own");
    }
  }
}

}  // namespace

at::Tensor adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters, double lr,
                  double beta1, double beta2, double eps, double weight_decay, int64_t step, int64_t flags,
                  double max_grad_norm, double grad_scale, double found_inf, double clip_coef,
                  at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                  at::TensorList max_exp_avg_sq_scales, int64_t split_masters, int64_t rounding, int64_t seed,
                  at::IntArrayRef keys, int64_t quantized_moments, at::IntArrayRef q8_rows) {
  const char *op = "npukern::adamw_";
  TORCH_CHECK_VALUE(split_masters == 0 || split_masters == 1, op, ": split_masters ", split_masters,
                    " is not 0 or 1");
  // Everything else about 8-bit moments (codes' and scales' dtypes and
  // lengths, the lists' counts, the mode's pairings) is the library's to
  // check: only what the C types cannot carry is refused here.
  TORCH_CHECK_VALUE(quantized_moments >= 0 && quantized_moments <= 0xffffffffLL, op, ": quantized_moments ",
                    quantized_moments, " out of range");
  TORCH_CHECK_VALUE(rounding >= 0 && rounding <= 0xffffffffLL, op, ": rounding ", rounding, " out of range");
  for (int64_t k : keys) TORCH_CHECK_VALUE(k >= 0, op, ": key ", k, " is negative");
  for (int64_t r : q8_rows) TORCH_CHECK_VALUE(r >= 0, op, ": row length ", r, " is negative");
  TORCH_CHECK(step >= 1, op, ": step ", step, " is not >= 1");
  TORCH_CHECK(flags >= 0 && flags <= 0xffffffffLL, op, ": flags ", flags, " out of range");
  check_overlaps(op,
                 {{"params", params},
                  {"exp_avgs", exp_avgs},
                  {"exp_avg_sqs", exp_avg_sqs},
                  {"max_exp_avg_sqs", max_exp_avg_sqs},
                  {"masters", masters},
                  {"exp_avg_scales", exp_avg_scales},
                  {"exp_avg_sq_scales", exp_avg_sq_scales},
                  {"max_exp_avg_sq_scales", max_exp_avg_sq_scales},
                  {"grads", grads}},
                 8);
  FlatList p(op, "params", params), g(op, "grads", grads), m(op, "exp_avgs", exp_avgs),
      v(op, "exp_avg_sqs", exp_avg_sqs), x(op, "max_exp_avg_sqs", max_exp_avg_sqs), w(op, "masters", masters),
      ms(op, "exp_avg_scales", exp_avg_scales), vs(op, "exp_avg_sq_scales", exp_avg_sq_scales),
      xs(op, "max_exp_avg_sq_scales", max_exp_avg_sq_scales);
  npk_adamw_tensors t{};
  t.params = p.array();
  t.grads = g.array();
  t.exp_avgs = m.array();
  t.exp_avg_sqs = v.array();
  t.max_exp_avg_sqs = x.array();
  t.masters = w.array();
  npk_adamw_options o{};
  o.lr = lr;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.eps = eps;
  o.weight_decay = weight_decay;
  o.step = static_cast<uint64_t>(step);
  o.max_grad_norm = max_grad_norm;
  o.grad_scale = static_cast<float>(grad_scale);
  o.found_inf = static_cast<float>(found_inf);
  o.flags = static_cast<uint32_t>(flags);
  o.clip_coef = static_cast<float>(clip_coef);
  Call call(op);
  npk_adamw_result r{};
  // The state's formats (ABI 2.9, 2.12): split masters, stochastic rounding,
  // 8-bit moments (u8 codes in the moment lists, f32 block scales).
  npk_adamw_formats f{};
  f.struct_size = sizeof(npk_adamw_formats);
  f.split_masters = static_cast<uint32_t>(split_masters);
  f.rounding = static_cast<uint32_t>(rounding);
  f.seed = static_cast<uint64_t>(seed);
  static_assert(sizeof(int64_t) == sizeof(uint64_t), "keys pass as they are");
  f.keys = keys.empty() ? nullptr : reinterpret_cast<const uint64_t *>(keys.data());
  f.keys_count = keys.size();
  f.quantized_moments = static_cast<uint32_t>(quantized_moments);
  // 8-bit moments' row lengths (ABI 2.12): blocks never cross a row.
  f.q8_rows = q8_rows.empty() ? nullptr : reinterpret_cast<const uint64_t *>(q8_rows.data());
  f.q8_rows_count = q8_rows.size();
  f.exp_avg_scales = ms.array();
  f.exp_avg_sq_scales = vs.array();
  f.max_exp_avg_sq_scales = xs.array();
  call.run([&](size_t *bytes) { return npk_adamw_v2_workspace_size(&t, &o, &f, call.exec(), bytes); },
           [&](void *ws, size_t bytes) { return npk_adamw_v2(&t, &o, &f, &r, ws, bytes, call.exec()); });
  for (const FlatList *l : {&p, &m, &v, &x, &w, &ms, &vs, &xs}) l->copy_back();
  at::Tensor out = at::empty({2}, at::TensorOptions().dtype(at::kDouble));
  // Without CLIP no norm is taken: 0, not the C ABI's NaN (a NaN output
  // compares unequal to itself, and torch.library.opcheck's AOT check of the
  // op failed on it).
  out.data_ptr<double>()[0] = (flags & NPK_ADAMW_CLIP) ? r.grad_norm : 0.0;
  out.data_ptr<double>()[1] = static_cast<double>(r.stepped);
  return out;
}

}  // namespace npk_torch
