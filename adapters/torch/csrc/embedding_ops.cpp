// Embedding lookup (whole table or one vocab shard) and EmbeddingDenseGrad
// over the C ABI.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "glue.h"
#include "ops.h"

namespace npk_torch {
namespace {

// Flat position of the first index outside [0, num_embeddings), or -1.
template <class I>
int64_t first_out_of_range(const I *idx, int64_t n, int64_t num_embeddings) {
  for (int64_t i = 0; i < n; i++)
    if (idx[i] < 0 || static_cast<int64_t>(idx[i]) >= num_embeddings) return i;
  return -1;
}

// out[i] = weight[idx[i] - vocab_start] for ids inside the shard, zeros for
// the others (after every id was checked to lie in [0, num_embeddings)).
template <class I>
void gather_rows(const I *idx, int64_t n, const char *weight, int64_t rows, int64_t vocab_start,
                 size_t row_bytes, char *out) {
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(65536 / std::max<size_t>(row_bytes, 1)));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const int64_t r = static_cast<int64_t>(idx[i]) - vocab_start;
      char *dst = out + static_cast<size_t>(i) * row_bytes;
      if (r >= 0 && r < rows)
        std::memcpy(dst, weight + static_cast<size_t>(r) * row_bytes, row_bytes);
      else
        std::memset(dst, 0, row_bytes);
    }
  });
}

at::Tensor lookup(const char *op, const at::Tensor &weight_in, const at::Tensor &indices_in,
                  int64_t num_embeddings, int64_t vocab_start) {
  at::Tensor weight = cpu_contiguous(weight_in, op, "weight");
  TORCH_CHECK_VALUE(indices_in.defined(), op, ": indices is an undefined tensor");
  // Positions, not shapes (any rank torch accepts): the output takes indices_in's shape.
  at::Tensor indices = cpu_contiguous(indices_in.reshape({-1}), op, "indices");
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be 2-D [rows, embedding_dim], got shape ",
                    weight.sizes());
  TORCH_CHECK_TYPE(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt, op,
                   ": indices must be int64 or int32, got ", indices.scalar_type());
  const int64_t rows = weight.size(0);
  TORCH_CHECK_VALUE(vocab_start >= 0 && num_embeddings >= 0 && vocab_start <= num_embeddings &&
                        rows <= num_embeddings - vocab_start,
                    op, ": the shard [", vocab_start, ", ", vocab_start, " + ", rows,
                    ") does not lie in [0, num_embeddings = ", num_embeddings, ")");
  const int64_t n = indices.numel();
  const int64_t bad = indices.scalar_type() == at::kLong
                          ? first_out_of_range(indices.data_ptr<int64_t>(), n, num_embeddings)
                          : first_out_of_range(indices.data_ptr<int32_t>(), n, num_embeddings);
  if (bad >= 0) {
    const int64_t value = indices.reshape({-1})[bad].item<int64_t>();
    TORCH_CHECK_INDEX(false, op, ": indices[", bad, "] = ", value, " is out of range for num_embeddings ",
                      num_embeddings, " (flat position ", bad, ", value ", value, ")");
  }
  std::vector<int64_t> shape(indices_in.sizes().begin(), indices_in.sizes().end());
  shape.push_back(weight.size(1));
  at::Tensor out = empty_output(shape, weight.scalar_type());
  const size_t row_bytes = static_cast<size_t>(weight.size(1)) * weight.element_size();
  if (n == 0 || row_bytes == 0) return out;
  char *dst = static_cast<char *>(out.data_ptr());
  const char *src = rows ? static_cast<const char *>(weight.data_ptr()) : nullptr;
  if (indices.scalar_type() == at::kLong)
    gather_rows(indices.data_ptr<int64_t>(), n, src, rows, vocab_start, row_bytes, dst);
  else
    gather_rows(indices.data_ptr<int32_t>(), n, src, rows, vocab_start, row_bytes, dst);
  return out;
}

// The kernel sees positions, not shapes: indices of any rank torch accepts
// (0-dim included) and grad of shape [*indices.shape, H] are flattened to
// [n] and [n, H], so a rank-0 or rank-8 lookup (grad of 9 dims) has a backward.
at::Tensor dense_grad(const char *op, const at::Tensor &grad_in, const at::Tensor &indices_in, int64_t num_weights,
                      const npk_embedding_grad_options &opts) {
  TORCH_CHECK_VALUE(grad_in.defined() && indices_in.defined(), op, ": grad and indices must be defined tensors");
  TORCH_CHECK_VALUE(grad_in.dim() >= 1, op, ": grad must have a last (embedding) dim, got a 0-dim tensor");
  TORCH_CHECK_VALUE(grad_in.dim() == indices_in.dim() + 1 &&
                        grad_in.sizes().slice(0, indices_in.dim()) == indices_in.sizes(),
                    op, ": grad of shape ", grad_in.sizes(), " is not [*indices.shape, embedding_dim] for indices of shape ",
                    indices_in.sizes());
  at::Tensor grad = cpu_contiguous(grad_in.reshape({indices_in.numel(), grad_in.size(-1)}), op, "grad");
  at::Tensor indices = cpu_contiguous(indices_in.reshape({-1}), op, "indices");
  TORCH_CHECK_VALUE(num_weights >= 0, op, ": num_weights must be >= 0, got ", num_weights);
  // Few indices into a large table: zeros from the OS, and the kernel
  // adds into the rows it hits (accumulate), never touching the rest.
  // 0 + sum is sum (a -0 sum becomes +0, as aten's index_add onto zeros).
  // Bytes a hit row can make the OS zero: the row and the page it may straddle.
  const size_t row_span = static_cast<size_t>(grad.size(-1)) * grad.element_size() + 4096;
  const size_t hit = static_cast<size_t>(std::min<int64_t>(indices.numel(), num_weights));
  size_t written = 0;
  if (__builtin_mul_overflow(hit, row_span, &written)) written = SIZE_MAX;
  npk_embedding_grad_options o = opts;
  at::Tensor out = opts.accumulate ? at::Tensor() : sparse_zeros({num_weights, grad.size(-1)}, grad.scalar_type(), written);
  const bool sparse = out.defined();
  if (sparse)
    o.accumulate = 1;
  else
    out = empty_output({num_weights, grad.size(-1)}, grad.scalar_type());
  npk_tensor gt = describe(grad, op, "grad"), it = describe(indices, op, "indices"), ot = describe(out, op, "out");
  const uint64_t nw = static_cast<uint64_t>(num_weights);

  Call call(op);
  call.tensors({&grad, &indices, &out});
  if (!sparse) call.outputs({&out});  // just allocated: the store policy (glue.h)
  call.run(
      [&](size_t *bytes) { return npk_embedding_dense_grad_workspace_size(&gt, &it, nw, &o, call.exec(), bytes); },
      [&](void *ws, size_t bytes) {
        return npk_embedding_dense_grad(&gt, &it, nw, &o, &ot, ws, bytes, call.exec());
      });
  return out;
}

}  // namespace

// The ops' padding_idx is aten::embedding's: -1 (none) or a row id; anything
// else is refused here, in the op, with torch's words (the functional form
// normalizes negative ids first, as torch.nn.functional.embedding does).
static void check_padding_idx(const char *op, int64_t padding_idx, int64_t num_embeddings) {
  TORCH_CHECK_VALUE(padding_idx == -1 || (padding_idx >= 0 && padding_idx < num_embeddings), op,
                    ": Padding_idx must be within num_embeddings: padding_idx ", padding_idx,
                    " is neither -1 (none) nor in [0, num_embeddings = ", num_embeddings, ")");
}

at::Tensor embedding(const at::Tensor &weight, const at::Tensor &indices, int64_t padding_idx,
                     bool /*scale_grad_by_freq*/) {
  const char *op = "npukern::embedding";
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be 2-D [num_embeddings, embedding_dim], got shape ",
                    weight.sizes());
  check_padding_idx(op, padding_idx, weight.size(0));
  return lookup(op, weight, indices, weight.size(0), 0);
}

at::Tensor embedding_shard(const at::Tensor &weight, const at::Tensor &indices, int64_t num_embeddings,
                           int64_t vocab_start, int64_t padding_idx, bool /*scale_grad_by_freq*/) {
  const char *op = "npukern::embedding_shard";
  check_padding_idx(op, padding_idx, num_embeddings);
  return lookup(op, weight, indices, num_embeddings, vocab_start);
}

at::Tensor embedding_dense_backward(const at::Tensor &grad, const at::Tensor &indices, int64_t num_weights,
                                    int64_t padding_idx, bool scale_grad_by_freq) {
  npk_embedding_grad_options opts{};
  opts.padding_idx = padding_idx;
  opts.scale_grad_by_freq = scale_grad_by_freq ? 1 : 0;
  opts.vocab_start = 0;
  opts.out_of_range = NPK_INDEX_ERROR;
  return dense_grad("npukern::embedding_dense_backward", grad, indices, num_weights, opts);
}

at::Tensor embedding_dense_backward_shard(const at::Tensor &grad, const at::Tensor &indices, int64_t num_weights,
                                          int64_t vocab_start, int64_t padding_idx, bool scale_grad_by_freq) {
  npk_embedding_grad_options opts{};
  opts.padding_idx = padding_idx;
  opts.scale_grad_by_freq = scale_grad_by_freq ? 1 : 0;
  opts.vocab_start = vocab_start;
  opts.out_of_range = NPK_INDEX_IGNORE;
  return dense_grad("npukern::embedding_dense_backward_shard", grad, indices, num_weights, opts);
}

}  // namespace npk_torch
