#include "glue.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace npk_torch {
namespace {

// The runner: npukern's blocks on PyTorch's intra-op thread pool. The C ABI
// requires every block to run exactly once and nothing to unwind into it;
// at::parallel_for runs each index of [0, n) once, and should it throw (it
// does not for a non-throwing body), the library sees the missing blocks and
// reports NPK_ERR_BACKEND naming "parallel_for". Each Call has its own
// npk_exec and detail, so concurrent calls never share an error detail.
extern "C" void aten_parallel_for(void * /*runner_ctx*/, size_t n_blocks, npk_task_fn task,
                                  void *task_ctx) {
  if (n_blocks == 1) {  // nothing to share out
    task(task_ctx, 0);
    return;
  }
  try {
    at::parallel_for(0, static_cast<int64_t>(n_blocks), 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; b++) task(task_ctx, static_cast<size_t>(b));
    });
  } catch (...) {
  }
}

npk_dtype dtype_of(const at::Tensor &t, const char *op, const char *arg) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return NPK_F32;
    case at::kHalf:
      return NPK_F16;
    case at::kBFloat16:
      return NPK_BF16;
    case at::kInt:
      return NPK_I32;
    case at::kLong:
      return NPK_I64;
    case at::kShort:
      return NPK_I16;  // AdamW's split masters' low halves
    case at::kByte:
      return NPK_U8;  // AdamW's 8-bit moments' codes
    default:
      TORCH_CHECK_TYPE(false, op, ": ", arg, " has dtype ", t.scalar_type(),
                       "; npukern takes float32, float16, bfloat16 (data), int32, int64 (indices) and int16, uint8 "
                       "(AdamW's compact state)");
      return NPK_F32;  // unreachable: TORCH_CHECK_TYPE(false) throws
  }
}

}  // namespace

void check_cpu(const at::Tensor &t, const char *op, const char *arg) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", arg, " is on ", t.device(),
                    "; npukern's kernels run on CPU tensors");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", arg, " must be a dense (strided) tensor");
  TORCH_CHECK_VALUE(t.dim() <= NPK_MAX_DIMS, op, ": ", arg, " has ", t.dim(), " dims; npukern takes at most ",
                    NPK_MAX_DIMS);
}

at::Tensor cpu_contiguous(const at::Tensor &t, const char *op, const char *arg) {
  check_cpu(t, op, arg);
  return t.contiguous();
}

npk_tensor describe(const at::Tensor &t, const char *op, const char *arg) {
  npk_tensor d;
  std::memset(&d, 0, sizeof d);
  d.dtype = dtype_of(t, op, arg);
  d.data = t.numel() ? t.data_ptr() : nullptr;
  d.ndim = static_cast<uint32_t>(t.dim());
  for (int64_t i = 0; i < t.dim(); i++) d.shape[i] = t.size(i);
  return d;
}

namespace {

// The store policy's inputs (docs/performance.md "Store policy").
constexpr size_t kStreamMinBytes = size_t{8} << 20;  // STREAM_MIN_BYTES, src/tiling.rs
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
constexpr int64_t kGrainSize = 32768;  // at::internal::GRAIN_SIZE (ATen/TensorIterator.h)

enum class Pages { Resident, FreshHuge, Fresh };

#ifdef __linux__
// Whether madvise(MADV_HUGEPAGE) gives huge pages here (read once).
bool thp_usable() {
  static const bool usable = [] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string s;
    std::getline(f, s);
    return s.find("[always]") != std::string::npos || s.find("[madvise]") != std::string::npos;
  }();
  return usable;
}

// Whether `want` huge pages are free right now, twice over: free blocks of
// a huge page's order or larger in /proc/buddyinfo (every zone). With
// MADV_HUGEPAGE and THP's defrag at `madvise` (the default), a fault that
// finds no free huge page reclaims and compacts memory synchronously: on a
// machine whose free memory is page cache (after a build, say) that made
// fresh outputs 2-4x slower than 4 KiB pages (silu_mul 4096x14336 f32 on
// Zen 3: 114 ms with huge pages at hand, 437 ms without; 4 KiB pages and
// ordinary stores about 190). Reading the file costs tens of us, beside
// milliseconds of writing an output of 8 MiB or more.
// `page` is the base page size (a huge page is 2^order of them).
bool huge_pages_free(size_t want, uintptr_t page) {
  int order = 0;
  while ((page << order) < kHugePage) ++order;
  std::ifstream f("/proc/buddyinfo");
  std::string line;
  size_t have = 0;
  while (std::getline(f, line)) {
    // "Node 0, zone   Normal  c0 c1 ... c10": free blocks by order.
    const size_t z = line.find("zone");
    if (z == std::string::npos) continue;
    size_t i = line.find_first_not_of(' ', z + 4);
    i = line.find(' ', i);  // past the zone's name
    int k = 0;
    while (i != std::string::npos && i < line.size()) {
      char *end = nullptr;
      const unsigned long long n = std::strtoull(line.c_str() + i, &end, 10);
      if (end == line.c_str() + i) break;
      if (k >= order && k - order < 20) have += static_cast<size_t>(n) << (k - order);
      i = static_cast<size_t>(end - line.c_str());
      ++k;
    }
  }
  return have / 2 >= want;
}
#endif

// What an output just allocated by at::empty is, preparing a fresh one for
// huge pages when it can. Small outputs are never streamed: "resident".
Pages prepare_output(const at::Tensor &t) {
#ifdef __linux__
  const size_t bytes = t.nbytes();
  if (bytes < kStreamMinBytes || t.data_ptr() == nullptr) return Pages::Resident;
  const long ps = sysconf(_SC_PAGESIZE);
  if (ps <= 0) return Pages::Resident;
  const uintptr_t page = static_cast<uintptr_t>(ps);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t hi = lo + bytes;
  // The last whole page: the allocator wrote its header at the start, never there.
  const uintptr_t last = (hi & ~(page - 1)) - page;
  unsigned char in_core = 1;
  if (last < lo || mincore(reinterpret_cast<void *>(last), page, &in_core) != 0 || (in_core & 1))
    return Pages::Resident;
  if (thp_usable()) {
    const uintptr_t a = (lo + kHugePage - 1) & ~(kHugePage - 1), b = hi & ~(kHugePage - 1);
    if (b > a && huge_pages_free((b - a) / kHugePage, page) &&
        madvise(reinterpret_cast<void *>(a), b - a, MADV_HUGEPAGE) == 0)
      return Pages::FreshHuge;
  }
  return Pages::Fresh;
#else
  (void)t;
  return Pages::Resident;
#endif
}

}  // namespace

Call::Call(const char *op) : op_(op) {
  exec_.parallel_for = aten_parallel_for;
  exec_.detail = &detail_;
}

void Call::rename(const char *from, const char *to, const char *from_out, const char *to_out) {
  renames_[0] = from;
  renames_[1] = to;
  renames_[2] = from_out;
  renames_[3] = to_out;
}

namespace {

bool word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// `text` with every whole-word `from` replaced by `to`.
std::string replace_word(const std::string &text, const char *from, const char *to) {
  std::string out;
  const size_t n = std::strlen(from);
  for (size_t i = 0; i < text.size();) {
    const bool at_word = text.compare(i, n, from) == 0 && (i == 0 || !word_char(text[i - 1])) &&
                         (i + n == text.size() || !word_char(text[i + n]));
    if (at_word) {
      out += to;
      i += n;
    } else {
      out += text[i++];
    }
  }
  return out;
}

}  // namespace

void Call::outputs(std::initializer_list<const at::Tensor *> ts) {
  bool large = false, fresh = false;
  for (const at::Tensor *t : ts) {
    if (t == nullptr || !t->defined() || t->nbytes() < kStreamMinBytes) continue;
    large = true;
    if (prepare_output(*t) == Pages::Fresh) fresh = true;
  }
  // Small outputs: no hint (nothing is streamed). Any output on fresh 4 KiB
  // pages: ordinary stores for the call; else streaming.
  if (!large) return;
  const unsigned hint = fresh ? NPK_OUTPUTS_FRESH : NPK_OUTPUTS_RESIDENT;
  exec_.backend = static_cast<npk_backend_kind>(static_cast<unsigned>(NPK_BACKEND_CPU) | hint);
}

void Call::check(npk_status status) const {
  if (status == NPK_OK) return;
  // The detail was filled by this call; fall back to the status string if a
  // future library version leaves it empty.
  std::string message = detail_.message[0] ? detail_.message : npk_status_string(status);
  std::string argument = detail_.argument;
  for (int i = 0; i < 4 && renames_[i]; i += 2) {
    message = replace_word(message, renames_[i], renames_[i + 1]);
    argument = replace_word(argument, renames_[i], renames_[i + 1]);
  }
  const char *msg = message.c_str();
  const char *name = npk_status_string(status);
  switch (status) {
    case NPK_ERR_INDEX_OUT_OF_RANGE:
      TORCH_CHECK_INDEX(false, op_, ": ", msg, " (argument '", argument, "', flat position ",
                        detail_.position, ", value ", detail_.value, ")");
    case NPK_ERR_DTYPE_UNSUPPORTED:
      TORCH_CHECK_TYPE(false, op_, ": ", msg, " (argument '", argument, "'; ", name, ")");
    case NPK_ERR_PARAM_INVALID:
    case NPK_ERR_NULLPTR:
    case NPK_ERR_SIZE_OVERFLOW:
      TORCH_CHECK_VALUE(false, op_, ": ", msg, " (argument '", argument, "'; ", name, ")");
    default:
      TORCH_CHECK(false, op_, ": ", msg, " (", name, ")");
  }
}

void Call::tensors(std::initializer_list<const at::Tensor *> ts) {
  for (const at::Tensor *t : ts)
    if (t != nullptr && t->defined() && t->numel() >= kGrainSize) return;
  exec_.parallel_for = nullptr;  // the library runs the blocks in order on this thread
}

namespace {

// The workspace buffer each thread keeps (grown to the largest request up to
// kThreadWorkspaceBytes); `busy` while a call on this thread uses it (a call
// never starts another on its thread, but a second one would get its own).
constexpr size_t kThreadWorkspaceBytes = size_t{1} << 20;

struct ThreadWorkspace {
  at::DataPtr data;
  size_t bytes = 0;
  bool busy = false;
};

thread_local ThreadWorkspace thread_ws;

}  // namespace

bool Call::claim_thread_workspace(void **ws, size_t *bytes) {
  if (thread_ws.busy) return false;
  thread_ws.busy = holds_thread_ws_ = true;
  *ws = thread_ws.data.get();
  *bytes = thread_ws.bytes;
  return true;
}

void Call::release_thread_workspace() {
  if (holds_thread_ws_) thread_ws.busy = holds_thread_ws_ = false;
}

void *Call::workspace(size_t bytes) {
  if (bytes == 0) return nullptr;
  if (bytes <= kThreadWorkspaceBytes && !thread_ws.busy) {
    if (thread_ws.bytes < bytes) {
      const size_t grown = std::max<size_t>(bytes, size_t{64} << 10);
      thread_ws.data = at::DataPtr();  // free the old one first
      thread_ws.bytes = 0;
      thread_ws.data = c10::GetCPUAllocator()->allocate(grown);
      thread_ws.bytes = grown;
    }
    thread_ws.busy = holds_thread_ws_ = true;
    return thread_ws.data.get();
  }
  TORCH_CHECK(bytes <= static_cast<size_t>(INT64_MAX), "npukern: workspace of ", bytes, " bytes");
  ws_ = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  return ws_.data_ptr();
}

Call::~Call() { release_thread_workspace(); }

at::Tensor empty_output(c10::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false, at::MemoryFormat::Contiguous);
}

at::Tensor sparse_zeros(c10::IntArrayRef sizes, at::ScalarType dtype, size_t written_bytes) {
#ifdef __linux__
  size_t bytes = c10::elementSize(dtype);
  for (int64_t d : sizes)
    if (d < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes)) return at::Tensor();
  if (bytes < kStreamMinBytes || written_bytes > bytes / 4) return at::Tensor();
  const long ps = sysconf(_SC_PAGESIZE);
  // One huge page more than asked, so the table can start on a huge page.
  size_t mapped = 0;
  if (ps <= 0 || __builtin_add_overflow(bytes, size_t{kHugePage}, &mapped)) return at::Tensor();
  void *base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return at::Tensor();
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base);
  void *p = reinterpret_cast<void *>((lo + kHugePage - 1) & ~(kHugePage - 1));
  // Whoever writes the untouched rows first (the clip's mul_, an optimizer's
  // decay of the grad) pays its page faults: 2 MiB pages make that about a
  // memset's cost (4 KiB pages: 3-4x one), and the kernel's hit rows fault
  // at most the whole table once, what torch's zeros cost anyway. Read-only
  // consumers (a norm, npukern's AdamW) see the zero page either way.
  // Without huge pages at hand (a fault would compact memory inside the
  // call), 4 KiB pages: THP "always" would otherwise fault 2 MiB per row.
  const size_t huge = bytes / kHugePage;
  const bool use_huge =
      thp_usable() && huge > 0 && huge_pages_free(huge, static_cast<uintptr_t>(ps));
  (void)madvise(p, bytes, use_huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  return at::from_blob(
      p, sizes, [base, mapped](void *) { munmap(base, mapped); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
#else
  (void)sizes;
  (void)dtype;
  (void)written_bytes;
  return at::Tensor();
#endif
}

namespace {

// The one large output kept after its tensor died (recycled_output): the
// mapping, and the 2 MiB-aligned bytes inside it the tensor used.
struct Kept {
  void *base = nullptr;
  size_t mapped = 0;
  void *data = nullptr;
  size_t bytes = 0;
};

std::mutex kept_mu;
Kept kept;

void unmap(const Kept &k) {
#ifdef __linux__
  if (k.base != nullptr) munmap(k.base, k.mapped);
#else
  (void)k;
#endif
}

// Back into the slot when it is empty (the pages handed to the kernel
// lazily: MADV_FREE, reclaimed only under memory pressure), else unmapped.
void give_back(const Kept &k) {
  {
    std::lock_guard<std::mutex> lock(kept_mu);
    if (kept.base == nullptr) {
#if defined(__linux__) && defined(MADV_FREE)
      (void)madvise(k.data, k.bytes, MADV_FREE);
#endif
      kept = k;
      return;
    }
  }
  unmap(k);
}

}  // namespace

at::Tensor recycled_output(c10::IntArrayRef sizes, at::ScalarType dtype) {
#ifdef __linux__
  size_t bytes = c10::elementSize(dtype);
  for (int64_t d : sizes)
    if (d < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes)) return empty_output(sizes, dtype);
  if (bytes < kStreamMinBytes) return empty_output(sizes, dtype);
  Kept k;
  {
    std::lock_guard<std::mutex> lock(kept_mu);
    if (kept.base != nullptr && kept.bytes >= bytes && kept.bytes - bytes <= kept.bytes / 4) {
      k = kept;  // its pages are mapped: no fault, no zeroing
      kept = Kept{};
    } else if (kept.base != nullptr) {
      unmap(kept);  // another size now: the memory back to the OS
      kept = Kept{};
    }
  }
  if (k.base == nullptr) {
    const long ps = sysconf(_SC_PAGESIZE);
    size_t mapped = 0;
    if (ps <= 0 || __builtin_add_overflow(bytes, size_t{kHugePage}, &mapped)) return empty_output(sizes, dtype);
    void *base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return empty_output(sizes, dtype);
    const uintptr_t lo = reinterpret_cast<uintptr_t>(base);
    void *p = reinterpret_cast<void *>((lo + kHugePage - 1) & ~(kHugePage - 1));
    // As a fresh output's (prepare_output): huge pages when free ones cover
    // it twice over, else 4 KiB (THP "always" would compact inside the call).
    const size_t huge = bytes / kHugePage;
    const bool use_huge =
        thp_usable() && huge > 0 && huge_pages_free(huge, static_cast<uintptr_t>(ps));
    (void)madvise(p, bytes, use_huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    k = Kept{base, mapped, p, bytes};
  }
  return at::from_blob(
      k.data, sizes, [k](void *) { give_back(k); }, at::TensorOptions().dtype(dtype).device(at::kCPU));
#else
  return empty_output(sizes, dtype);
#endif
}

c10::SmallVector<int64_t, NPK_MAX_DIMS> reduced_shape(const at::Tensor &x, int64_t normalized_dims) {
  c10::SmallVector<int64_t, NPK_MAX_DIMS> shape(x.sizes().begin(), x.sizes().end());
  for (int64_t i = x.dim() - normalized_dims; i < x.dim(); i++) shape[i] = 1;
  return shape;
}

void check_gamma_rank(const at::Tensor &x, const at::Tensor &gamma, const char *op) {
  TORCH_CHECK_VALUE(gamma.dim() >= 1 && gamma.dim() <= x.dim(), op, ": gamma has ", gamma.dim(),
                    " dims; it must cover 1..", x.dim(), " trailing dims of x (shape ", x.sizes(), ")");
}

}  // namespace npk_torch
