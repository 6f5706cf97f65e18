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
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#elif defined(__linux__)
constexpr int kPopulateWrite = 23;  // Linux's value; an older kernel refuses it (EINVAL)
#endif
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

// NPK_TORCH_HUGE_PAGES=0: fresh large outputs on 4 KiB pages, never huge
// ones. Unset or anything else: huge pages when free ones are at hand. In a
// guest whose host takes freed memory back (a virtio balloon with free page
// reporting: Firecracker, QEMU) a fresh huge page may be one the host must
// fault in again; measured there (Sapphire Rapids guest, calls 3 s apart,
// docs/performance.md "Fresh pages in a guest") huge pages were still the
// faster choice on most runs (rms_norm 2048x5120 f32 0.64x IPEX, 4 KiB
// pages 1.49x), and kept blocks (empty_output's pool) avoid the question
// in a training loop. Read once.
bool huge_pages_allowed() {
  static const bool allowed = [] {
    const char *v = std::getenv("NPK_TORCH_HUGE_PAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return allowed;
}

// Whether fresh memory of `bytes` (2 MiB-aligned within) should be made of
// huge pages: THP usable, not turned off, and free huge pages at hand.
bool use_huge_pages(size_t bytes, uintptr_t page) {
  const size_t huge = bytes / kHugePage;
  if (!huge_pages_allowed() || huge == 0 || !thp_usable()) return false;
  return huge_pages_free(huge, page);
}
#endif

#ifdef __linux__
// Whether `t`'s memory is a block of empty_output's pool, and then (`huge`)
// whether it was mapped on huge pages: the page size was chosen when it was
// mapped (map_aligned).
bool pooled_pages(const at::Tensor &t, bool *huge);
#endif

// What an output just allocated is, preparing a fresh one for huge pages
// when it can (empty_output's pool chose when it mapped the block). Small
// outputs are never streamed: "resident".
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
  bool huge = false;
  if (pooled_pages(t, &huge)) return huge ? Pages::FreshHuge : Pages::Fresh;
  const uintptr_t a = (lo + kHugePage - 1) & ~(kHugePage - 1), b = hi & ~(kHugePage - 1);
  if (b > a && use_huge_pages(b - a, page) &&
      madvise(reinterpret_cast<void *>(a), b - a, MADV_HUGEPAGE) == 0)
    return Pages::FreshHuge;
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


#ifdef __linux__
namespace {

// An anonymous mapping with room to start `bytes` on a 2 MiB boundary.
struct Mapping {
  void *base = nullptr;  // what munmap takes, with `mapped`
  size_t mapped = 0;
  void *data = nullptr;  // 2 MiB-aligned, `bytes` long
  bool huge = false;     // madvised to huge pages
};

// A fresh mapping for `bytes` (one huge page more than asked, so the data
// can start on a huge page), its pages' kind chosen by use_huge_pages: 4 KiB
// pages are asked for explicitly when huge ones are not wanted, as THP
// "always" would otherwise fault 2 MiB per first touch. {} on failure.
Mapping map_aligned(size_t bytes) {
  const long ps = sysconf(_SC_PAGESIZE);
  size_t mapped = 0;
  if (ps <= 0 || __builtin_add_overflow(bytes, size_t{kHugePage}, &mapped)) return {};
  void *base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return {};
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base);
  void *data = reinterpret_cast<void *>((lo + kHugePage - 1) & ~(kHugePage - 1));
  const bool huge = use_huge_pages(bytes, static_cast<uintptr_t>(ps));
  (void)madvise(data, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  // Huge pages first touched by several threads at once were 15-20x slower
  // than by one in a Firecracker guest (64 MiB, 2 threads: 65-72 ms against
  // 4 ms faulted from one thread first; benches/hf_step.py's step on two
  // threads spent 68 ms of ~300 in the embedding gradient's fresh table):
  // a kernel that will run on several threads gets its huge pages faulted
  // here, from this thread, in one call (Linux 5.14+; elsewhere the kernel's
  // threads fault them as before).
  if (huge && at::get_num_threads() > 1) (void)madvise(data, bytes, kPopulateWrite);
  return Mapping{base, mapped, data, huge};
}

}  // namespace
#endif

at::Tensor sparse_zeros(c10::IntArrayRef sizes, at::ScalarType dtype, size_t written_bytes) {
#ifdef __linux__
  size_t bytes = c10::elementSize(dtype);
  for (int64_t d : sizes)
    if (d < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes)) return at::Tensor();
  if (bytes < kStreamMinBytes || written_bytes > bytes / 4) return at::Tensor();
  // Whoever writes the untouched rows first (the clip's mul_, an optimizer's
  // decay of the grad) pays its page faults: 2 MiB pages make that about a
  // memset's cost (4 KiB pages: 3-4x one), and the kernel's hit rows fault
  // at most the whole table once, what torch's zeros cost anyway. Read-only
  // consumers (a norm, npukern's AdamW) see the zero page either way. (With
  // more than one intra-op thread, map_aligned populates huge pages here:
  // their zeroing is then this call's, on this thread.)
  const Mapping m = map_aligned(bytes);
  if (m.base == nullptr) return at::Tensor();
  return at::from_blob(
      m.data, sizes, [m](void *) { munmap(m.base, m.mapped); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
#else
  (void)sizes;
  (void)dtype;
  (void)written_bytes;
  return at::Tensor();
#endif
}

namespace {

// Large outputs' memory (empty_output, 8 MiB or more): blocks kept after
// their tensors died, handed to the next output that fits. Each block is a
// 2 MiB-aligned mapping (map_aligned); a kept one's pages stay mapped
// (MADV_FREE: the OS may still reclaim them under memory pressure), so the
// output that reuses it takes no page fault and no zeroing. That is what a
// training step does: each step allocates the outputs the last one freed,
// and backward's gradients the size of the activations it frees.
struct Kept {
  void *base = nullptr;
  size_t mapped = 0;
  void *data = nullptr;
  size_t bytes = 0;  // usable from data
  uint64_t when = 0;  // when it was given back: the oldest goes first
  bool huge = false;  // mapped on huge pages
};

constexpr size_t kMaxKept = 16;

// NPK_TORCH_OUTPUT_CACHE_MB: the bytes kept at most (default 256 MiB; 0: no
// block is kept, every large output a fresh mapping). The block given back
// last is kept whatever its size (cross-entropy's dlogits: 262 MB at 4096 x
// 32000 bf16, reused by the next step's). Read once.
size_t kept_cap() {
  static const size_t cap = [] {
    const char *v = std::getenv("NPK_TORCH_OUTPUT_CACHE_MB");
    if (v == nullptr || *v == '\0') return size_t{256} << 20;
    char *end = nullptr;
    const unsigned long long mb = std::strtoull(v, &end, 10);
    if (end == v || *end != '\0' || mb > (SIZE_MAX >> 20)) return size_t{256} << 20;
    return static_cast<size_t>(mb) << 20;
  }();
  return cap;
}

std::mutex kept_mu;
Kept kept[kMaxKept];  // empty: base == nullptr
uint64_t kept_clock = 0;

void unmap(const Kept &k) {
#ifdef __linux__
  if (k.base != nullptr) munmap(k.base, k.mapped);
#else
  (void)k;
#endif
}

// The kept block that fits `bytes` best (at least `bytes`, at most a
// quarter more; of equal ones the last given back, its pages the likeliest
// in cache), taken out of the pool; {} when none does.
Kept take(size_t bytes) {
  std::lock_guard<std::mutex> lock(kept_mu);
  Kept *best = nullptr;
  for (Kept &k : kept)
    if (k.base != nullptr && k.bytes >= bytes && k.bytes - bytes <= k.bytes / 4 &&
        (best == nullptr || k.bytes < best->bytes || (k.bytes == best->bytes && k.when > best->when)))
      best = &k;
  if (best == nullptr) return {};
  const Kept k = *best;
  *best = Kept{};
  return k;
}

// A dead output's block back into the pool, the oldest kept ones unmapped
// while the pool is over its cap or full.
void give_back(Kept k) {
  const size_t cap = kept_cap();
  Kept drop[kMaxKept];
  size_t n_drop = 0;
  if (cap == 0) {
    unmap(k);
    return;
  }
#if defined(__linux__) && defined(MADV_FREE)
  (void)madvise(k.data, k.bytes, MADV_FREE);
#endif
  {
    std::lock_guard<std::mutex> lock(kept_mu);
    k.when = ++kept_clock;
    for (;;) {
      size_t total = k.bytes, used = 0;
      Kept *oldest = nullptr;
      for (Kept &o : kept) {
        if (o.base == nullptr) continue;
        total += o.bytes;
        ++used;
        if (oldest == nullptr || o.when < oldest->when) oldest = &o;
      }
      if (oldest == nullptr || (total <= cap && used < kMaxKept)) break;
      drop[n_drop++] = *oldest;
      *oldest = Kept{};
    }
    for (Kept &o : kept)
      if (o.base == nullptr) {
        o = k;
        break;
      }
  }
  for (size_t i = 0; i < n_drop; i++) unmap(drop[i]);  // outside the lock: munmap is slow
}

void release(void *ctx) {
  Kept *k = static_cast<Kept *>(ctx);
  give_back(*k);
  delete k;
}

#ifdef __linux__
bool pooled_pages(const at::Tensor &t, bool *huge) {
  const c10::DataPtr &dp = t.storage().data_ptr();
  if (dp.get_deleter() != &release) return false;
  *huge = static_cast<const Kept *>(dp.get_context())->huge;
  return true;
}
#endif

// PyTorch's allocator interface over the pool: a tensor's storage stays
// resizable (a resize allocates through it again), and blocks under 8 MiB
// come from PyTorch's own CPU allocator.
struct LargeOutputAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
#ifdef __linux__
    if (bytes >= kStreamMinBytes) {
      Kept k = take(bytes);
      if (k.base == nullptr) {
        const Mapping m = map_aligned(bytes);
        if (m.base != nullptr) k = Kept{m.base, m.mapped, m.data, bytes, 0, m.huge};
      }
      if (k.base != nullptr) {
        void *data = k.data;
        return {data, new Kept(k), &release, c10::Device(c10::DeviceType::CPU)};
      }
    }
#endif
    return c10::GetDefaultCPUAllocator()->allocate(bytes);
  }
  void copy_data(void *dest, const void *src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

LargeOutputAllocator large_output_allocator;

}  // namespace

at::Tensor empty_output(c10::IntArrayRef sizes, at::ScalarType dtype) {
  size_t bytes = c10::elementSize(dtype);
  bool large = true;
  for (int64_t d : sizes)
    if (d < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes)) large = false;
  if (large && bytes >= kStreamMinBytes)
    return at::detail::empty_generic(sizes, &large_output_allocator, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                     at::MemoryFormat::Contiguous);
  return at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false, at::MemoryFormat::Contiguous);
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
