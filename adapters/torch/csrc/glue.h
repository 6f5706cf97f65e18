// The adapter's glue between ATen and the npukern C ABI (include/npukern.h):
// tensor descriptors, the exec (at::parallel_for as the runner, or the
// calling thread for small calls), the outputs and the workspace, and
// npk_error_detail turned into the exception types PyTorch maps to
// IndexError / TypeError / ValueError.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <cstddef>
#include <initializer_list>

#include "npukern.h"

namespace npk_torch {

// Checks that `t` is a defined, dense CPU tensor with at most NPK_MAX_DIMS
// dims. `op` and `arg` name it in the error message.
void check_cpu(const at::Tensor &t, const char *op, const char *arg);

// `t` made contiguous, after check_cpu.
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

  // Every tensor the call reads or writes: when each has fewer elements than
  // torch's own grain (at::internal::GRAIN_SIZE, 32768: the size under
  // which torch's elementwise kernels stay on one thread), the call runs on
  // the calling thread (no runner: the library runs the same blocks in
  // order, so the same bits). An OpenMP fork-join costs more than such a
  // call saves (RmsNorm of 2 x 4096 bf16 on 2 threads of an idle Zen 4:
  // 4.5 us on one, 5.8 us on both; 8 x 4096: 8.2 and 7.2), and far more
  // when another process holds a core (13-30 us, tails of 60-190 us).
  void tensors(std::initializer_list<const at::Tensor *> ts);

  // Runs one operator: `launch(ws, bytes)` (npk_<op>) is first given the
  // workspace buffer this thread keeps, whatever its size (docs/c-api.md: a
  // larger workspace than the plan needs is fine, and a call that refuses
  // writes nothing), so the plan is cut once (0.1 us of a 1 x 4096 RmsNorm)
  // and nothing is allocated; only when that is too small
  // (NPK_ERR_WORKSPACE_TOO_SMALL), the two phases: `size(&bytes)`
  // (npk_<op>_workspace_size), `workspace(bytes)`, `launch`. Either way a
  // non-OK status throws (`check`).
  template <class Size, class Launch>
  void run(Size &&size, Launch &&launch) {
    size_t have = 0;
    void *ws = nullptr;
    if (claim_thread_workspace(&ws, &have)) {
      const npk_status status = launch(ws, have);
      if (status != NPK_ERR_WORKSPACE_TOO_SMALL) return check(status);
      release_thread_workspace();
    }
    run_sized(size, launch);
  }

  // The two phases alone, for an operator whose workspace is optional (a
  // speed-up it would run without rather than refuse: the fused
  // cross-entropy's exp cache).
  template <class Size, class Launch>
  void run_sized(Size &&size, Launch &&launch) {
    size_t bytes = 0;
    check(size(&bytes));
    void *sized = workspace(bytes);
    check(launch(sized, bytes));
  }

  // A workspace of `bytes` for this call (NULL when bytes == 0), alive until
  // the Call is destroyed: up to 1 MiB (decode-size calls: a norm's
  // per-block arenas, a loss's row sums) the thread's buffer, grown to fit
  // (a 32 KiB at::empty and its free cost 1.1 us of a 1 x 4096 RmsNorm's
  // 4.9); larger ones come from PyTorch's CPU allocator.
  void *workspace(size_t bytes);
  ~Call();

 private:
  // The thread's buffer (NULL and 0 bytes before its first use) for this
  // call; false when another call on this thread holds it.
  bool claim_thread_workspace(void **ws, size_t *bytes);
  void release_thread_workspace();

  const char *op_;
  at::Tensor ws_;                 // a workspace too large for the thread's buffer
  bool holds_thread_ws_ = false;  // this call holds the thread's buffer
  const char *renames_[4] = {nullptr, nullptr, nullptr, nullptr};
  npk_error_detail detail_{};
  npk_exec exec_{};
};

// A new contiguous CPU tensor for an op's output, without the dispatcher's
// trip through empty_like / empty (the kernels run below every other key;
// 0.15 us an output). Under 8 MiB: ATen's CPU allocator. 8 MiB or more: a
// block a dead output left (its pages mapped: no page fault, no zeroing),
// else a fresh 2 MiB-aligned mapping on huge pages when THP allows. A fresh
// output's first touch is most of a fast kernel's time, and more under a
// hypervisor that takes free memory back (a balloon with free page
// reporting: the host unmaps each free 2 MiB block soon after it is freed,
// and the next touch faults it in from the host: 4096 x 32000 bf16 dlogits
// on a Sapphire Rapids guest took 145-1069 ms where the kernel takes 60 and
// reused pages 100). Kept blocks: at most 16 and 256 MiB
// (NPK_TORCH_OUTPUT_CACHE_MB; the last one given back is kept whatever its
// size), the oldest unmapped first, MADV_FREE while kept (the OS reclaims
// them under memory pressure); a block serves an output of at least three
// quarters its size. The storage is resizable, through the same allocator.
at::Tensor empty_output(c10::IntArrayRef sizes, at::ScalarType dtype);

// A zero-filled output for an op that writes at most `written_bytes` of it,
// scattered (EmbeddingDenseGrad: the rows its indices hit), or an undefined
// tensor when that is not a small part of a large output (the op then
// allocates with empty_output and writes every byte). Fresh anonymous
// memory the OS maps as zeros on first touch, in 4 KiB pages (not huge:
// only the pages written are ever faulted and zeroed; a 131 MB table
// gradient of 1024 tokens touches 3% of them), freed by munmap.
at::Tensor sparse_zeros(c10::IntArrayRef sizes, at::ScalarType dtype, size_t written_bytes);
inline at::Tensor empty_output_like(const at::Tensor &t) { return empty_output(t.sizes(), t.scalar_type()); }

// x's shape with its trailing `normalized_dims` dims set to 1 (torch_npu's rstd).
c10::SmallVector<int64_t, NPK_MAX_DIMS> reduced_shape(const at::Tensor &x, int64_t normalized_dims);

// Rejects a gamma that cannot cover x's trailing dims before any output is
// allocated from its shape (the library checks the dims themselves).
void check_gamma_rank(const at::Tensor &x, const at::Tensor &gamma, const char *op);

}  // namespace npk_torch
