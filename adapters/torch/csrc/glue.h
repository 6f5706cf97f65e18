// The adapter's glue between ATen and the npukern C ABI (include/npukern.h):
// tensor descriptors, the exec (at::parallel_for as the runner), the
// workspace from PyTorch's allocator, and npk_error_detail turned into the
// exception types PyTorch maps to IndexError / TypeError / ValueError.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <initializer_list>
#include <vector>

#include "npukern.h"

namespace npk_torch {

// `t` made contiguous, after checking it is a CPU tensor with at most
// NPK_MAX_DIMS dims. `op` and `arg` name it in the error message.
at::Tensor cpu_contiguous(const at::Tensor &t, const char *op, const char *arg);

// The npk_tensor describing a contiguous CPU tensor (no copy). Dtypes the C
// ABI has no name for raise TypeError; the library rejects the rest.
npk_tensor describe(const at::Tensor &t, const char *op, const char *arg);

// One C ABI call's context: the exec (PyTorch's thread pool as the runner)
// and its error detail; `check` throws on a non-OK status.
class Call {
 public:
  explicit Call(const char *op);
  Call(const Call &) = delete;
  Call &operator=(const Call &) = delete;

  const npk_exec *exec() const { return &exec_; }
  void check(npk_status status) const;

  // Errors name the library's argument `from` (and `from_out`) as the
  // caller's `to` (`to_out`): one C call serving an op whose arguments are
  // named otherwise (rotary_mul's x is RoPE's q).
  void rename(const char *from, const char *to, const char *from_out, const char *to_out);

  // Tells the library what is known of the outputs this op just allocated
  // with at::empty (the store policy, docs/performance.md "Store policy";
  // ABI 2.3). An output of 8 MiB or more (STREAM_MIN_BYTES) whose last page
  // the OS has not yet mapped (mincore) is fresh: it gets transparent huge
  // pages (madvise(MADV_HUGEPAGE) on its 2 MiB-aligned interior, where THP
  // is "always" or "madvise"), which measured 2.3-3.5x faster than
  // faulting 4 KiB pages during the call, and is then stored like a
  // resident one (NPK_OUTPUTS_RESIDENT: streaming). Without THP it is
  // NPK_OUTPUTS_FRESH (ordinary stores, which overwrite the zeroed lines in
  // cache). glibc hands large blocks back resident as often as fresh, so
  // the pages are asked, not assumed. Changes no output bit.
  void outputs(std::initializer_list<const at::Tensor *> ts);

  // A workspace of `bytes` from PyTorch's CPU allocator (kept alive by the
  // returned tensor); `data(ws)` is NULL when bytes == 0.
  static at::Tensor workspace(size_t bytes);
  static void *data(at::Tensor &ws);

 private:
  const char *op_;
  const char *renames_[4] = {nullptr, nullptr, nullptr, nullptr};
  npk_error_detail detail_{};
  npk_exec exec_{};
};

// x's shape with its trailing `normalized_dims` dims set to 1 (torch_npu's rstd).
std::vector<int64_t> reduced_shape(const at::Tensor &x, int64_t normalized_dims);

// Rejects a gamma that cannot cover x's trailing dims before any output is
// allocated from its shape (the library checks the dims themselves).
void check_gamma_rank(const at::Tensor &x, const at::Tensor &gamma, const char *op);

}  // namespace npk_torch
