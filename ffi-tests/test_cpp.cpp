// C++17 test of the npukern C ABI, written the way a framework adapter would
// use it: RAII tensors, a two-phase call helper that throws on error (with
// npk_error_detail in the exception), a std::thread runner, and a fake NPU
// backend whose function table records the plans and computes through
// NPK_BACKEND_REFERENCE. Covers the four operators in every dtype combination
// (CPU vs reference within tolerance; threads, pool and fake NPU
// bit-identical) and a set of error paths.
//
// Built by ffi-tests/run.sh with g++ -std=c++17 -Wall -Wextra -Werror
// -pedantic, against libnpukern.a and libnpukern.so.
#include <atomic>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"

static_assert(sizeof(npk_tensor) == 80, "npk_tensor layout");
static_assert(sizeof(npk_isa) == 4, "enums are int-sized");

namespace {

// ---- errors as exceptions ----

struct NpkError : std::runtime_error {
  npk_status status;
  std::string argument;
  int64_t position, value;
  explicit NpkError(const npk_error_detail &d)
      : std::runtime_error(std::string(npk_status_string(d.status)) + ": " + d.message),
        status(d.status),
        argument(d.argument),
        position(d.position),
        value(d.value) {}
};

// ---- tensors ----

struct Tensor {
  buf b;
  std::vector<int64_t> shape;
  Tensor(npk_dtype dt, std::vector<int64_t> s) : shape(std::move(s)) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    b = balloc(dt, n);
  }
  Tensor(const Tensor &) = delete;
  Tensor &operator=(const Tensor &) = delete;
  ~Tensor() { bfree(&b); }
  npk_tensor t() const { return tens(b.p, b.dt, static_cast<uint32_t>(shape.size()), shape.data()); }
};

// ---- runners ----

extern "C" {
// Every block exactly once, on std::threads; runner_ctx: unsigned* count.
static void std_thread_parallel_for(void *runner_ctx, size_t n, npk_task_fn task, void *task_ctx) {
  unsigned threads = runner_ctx ? *static_cast<unsigned *>(runner_ctx) : 3;
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t b; (b = next.fetch_add(1)) < n;) task(task_ctx, b);
  };
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < threads; i++) pool.emplace_back(work);
  work();
  for (auto &t : pool) t.join();
}
}

// ---- the fake NPU ----

struct FakeNpu {
  int calls = 0;
  int fail_code = 0;
  npk_norm_tiling norm_plan{};
  npk_embedding_tiling emb_plan{};
  npk_exec ref{};
};

extern "C" {
static npk_status fake_rms_norm(void *ctx, const npk_rms_norm_call *c) {
  auto *f = static_cast<FakeNpu *>(ctx);
  f->calls++;
  f->norm_plan = c->tiling;
  if (f->fail_code) return static_cast<npk_status>(f->fail_code);
  npk_rms_norm_options o{c->eps, c->gamma_offset, c->rounding};
  return npk_rms_norm(&c->x, &c->gamma, &o, &c->y, c->has_rstd ? &c->rstd : nullptr, c->workspace,
                      c->workspace_bytes, &f->ref);
}
static npk_status fake_add_rms_norm(void *ctx, const npk_add_rms_norm_call *c) {
  auto *f = static_cast<FakeNpu *>(ctx);
  f->calls++;
  f->norm_plan = c->tiling;
  npk_rms_norm_options o{c->eps, c->gamma_offset, c->rounding};
  return npk_add_rms_norm(&c->x1, &c->x2, &c->gamma, &o, &c->y, c->has_rstd ? &c->rstd : nullptr,
                          c->has_x_sum ? &c->x_sum : nullptr, c->workspace, c->workspace_bytes, &f->ref);
}
static npk_status fake_rms_norm_grad(void *ctx, const npk_rms_norm_grad_call *c) {
  auto *f = static_cast<FakeNpu *>(ctx);
  f->calls++;
  f->norm_plan = c->tiling;
  npk_rms_norm_grad_options o{c->gamma_offset, static_cast<uint8_t>(c->accumulate_dgamma)};
  return npk_rms_norm_grad(&c->dy, &c->x, &c->rstd, &c->gamma, c->has_dres ? &c->dres : nullptr, &o, &c->dx,
                           c->has_dgamma ? &c->dgamma : nullptr, c->has_dgamma_cast ? &c->dgamma_cast : nullptr,
                           c->workspace, c->workspace_bytes, &f->ref);
}
static npk_status fake_embedding(void *ctx, const npk_embedding_dense_grad_call *c) {
  auto *f = static_cast<FakeNpu *>(ctx);
  f->calls++;
  f->emb_plan = c->tiling;
  npk_embedding_grad_options o{c->padding_idx, static_cast<uint8_t>(c->scale_grad_by_freq), c->vocab_start,
                               c->out_of_range, static_cast<uint8_t>(c->accumulate)};
  return npk_embedding_dense_grad(&c->grad, &c->indices, c->num_weights, &o, &c->out, c->workspace,
                                  c->workspace_bytes, &f->ref);
}
}

FakeNpu g_fake;
const npk_foreign_backend g_table{sizeof(npk_foreign_backend), &g_fake, fake_rms_norm, fake_add_rms_norm, fake_rms_norm_grad, fake_embedding, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};

// ---- execs and the two-phase helper ----

struct Exec {
  npk_exec e{};
  npk_error_detail d{};
  Exec(npk_backend_kind k, uint32_t blocks) {
    e.backend = k;
    e.blocks = blocks;
    e.isa = NPK_ISA_AUTO;
    e.detail = &d;
  }
  Exec(const Exec &o) : e(o.e), d() { e.detail = &d; }
  Exec &operator=(const Exec &) = delete;
};

// Sizes the workspace with `size(exec, &bytes)`, then runs `run(exec, ws, bytes)`.
template <class Size, class Run>
void two_phase(const Exec &x, Size size, Run run) {
  size_t bytes = 0;
  if (size(&x.e, &bytes) != NPK_OK) throw NpkError(x.d);
  std::vector<unsigned char> ws(bytes + 1);
  if (run(&x.e, bytes ? ws.data() + 1 : nullptr, bytes) != NPK_OK) throw NpkError(x.d);
}

enum { REF, CPU, THREADS, POOL, FAKE, NVAR };
const char *const VN[NVAR] = {"reference", "cpu", "std::thread", "pool", "fake npu"};

std::vector<Exec> make_execs(uint32_t blocks) {
  static unsigned three = 3;
  std::vector<Exec> v;
  v.emplace_back(NPK_BACKEND_REFERENCE, blocks);
  v.emplace_back(NPK_BACKEND_CPU, blocks);
  v.emplace_back(NPK_BACKEND_CPU, blocks);
  v.back().e.parallel_for = std_thread_parallel_for;
  v.back().e.runner_ctx = &three;
  v.emplace_back(NPK_BACKEND_CPU, blocks);
  v.back().e.parallel_for = npk_threads_parallel_for;
  v.emplace_back(NPK_BACKEND_FOREIGN, blocks);
  v.back().e.foreign = &g_table;
  g_fake.ref = npk_exec{};
  g_fake.ref.backend = NPK_BACKEND_REFERENCE;
  g_fake.ref.blocks = blocks;
  return v;
}

// Runs `op(exec, outputs)` under every variant and compares the outputs.
void run_variants(const std::string &what, uint32_t blocks, const std::vector<std::pair<npk_dtype, size_t>> &outs,
                  const std::vector<double> &tols,
                  const std::function<void(const Exec &, std::vector<buf> &)> &op) {
  auto execs = make_execs(blocks);
  std::vector<std::vector<buf>> res(NVAR);
  int fake0 = g_fake.calls;
  for (int v = 0; v < NVAR; v++) {
    for (auto &o : outs) res[v].push_back(balloc(o.first, o.second));
    try {
      op(execs[v], res[v]);
      CHECK(true, "%s", "");
    } catch (const NpkError &e) {
      CHECK(false, "%s %s: %s", what.c_str(), VN[v], e.what());
    }
  }
  CHECK(g_fake.calls == fake0 + 1, "%s: the fake NPU ran once", what.c_str());
  for (size_t k = 0; k < outs.size(); k++) {
    CHECK(close_enough(res[CPU][k], res[REF][k], tols[k], 0.05, what.c_str()), "%s out%zu cpu~ref", what.c_str(), k);
    CHECK(bsame(res[FAKE][k], res[REF][k]), "%s out%zu fake npu == reference", what.c_str(), k);
    CHECK(bsame(res[THREADS][k], res[CPU][k]) && bsame(res[POOL][k], res[CPU][k]), "%s out%zu threads == serial",
          what.c_str(), k);
  }
  for (auto &r : res)
    for (auto &b : r) bfree(&b);
}

struct Pair {
  npk_dtype x, g;
};
const Pair kPairs[] = {
    {NPK_F32, NPK_F32}, {NPK_F16, NPK_F16}, {NPK_F16, NPK_F32}, {NPK_BF16, NPK_BF16}, {NPK_BF16, NPK_F32}};

std::string label(const char *op, npk_dtype a, npk_dtype b) { return std::string(op) + " " + dname(a) + "/" + dname(b); }

void test_norms() {
  const std::vector<int64_t> xs{4, 3, 64}, gs{64};
  const size_t n = 4 * 3 * 64, rows = 12, cols = 64;
  for (const Pair &p : kPairs) {
    Tensor x(p.x, xs), x2(p.x, xs), g(p.g, gs), dy(p.x, xs), r(NPK_F32, {12});
    bfill_rand(x.b, -3, 3);
    bfill_rand(x2.b, -1, 1);
    bfill_rand(g.b, 0.5, 1.5);
    bfill_rand(dy.b, -1, 1);
    bfill_rand(r.b, 0.5, 1.5);
    const npk_tensor xt = x.t(), x2t = x2.t(), gt = g.t(), dyt = dy.t(), rt = r.t();
    const npk_rms_norm_options opts{1e-6, 0.0f, NPK_ROUNDING_FUSED};

    run_variants(label("rms_norm", p.x, p.g), 5, {{p.x, n}, {NPK_F32, rows}}, {tol_of(p.x), 1e-5},
                 [&](const Exec &e, std::vector<buf> &o) {
                   npk_tensor y = btens(o[0], 3, xs.data()), rs = tens(o[1].p, NPK_F32, 1, r.shape.data());
                   two_phase(
                       e, [&](const npk_exec *ex, size_t *b) { return npk_rms_norm_workspace_size(&xt, &gt, &opts, ex, b); },
                       [&](const npk_exec *ex, void *ws, size_t b) { return npk_rms_norm(&xt, &gt, &opts, &y, &rs, ws, b, ex); });
                 });
    CHECK(g_fake.norm_plan.rows == rows && g_fake.norm_plan.cols == cols && g_fake.norm_plan.blocks == 4,
          "the fake NPU got the plan: %llu rows, %u blocks", static_cast<unsigned long long>(g_fake.norm_plan.rows),
          g_fake.norm_plan.blocks);

    run_variants(label("add_rms_norm", p.x, p.g), 5, {{p.x, n}, {NPK_F32, rows}, {p.x, n}},
                 {tol_of(p.x), 1e-5, tol_of(p.x)}, [&](const Exec &e, std::vector<buf> &o) {
                   npk_tensor y = btens(o[0], 3, xs.data()), rs = tens(o[1].p, NPK_F32, 1, r.shape.data()),
                              s = btens(o[2], 3, xs.data());
                   two_phase(
                       e,
                       [&](const npk_exec *ex, size_t *b) {
                         return npk_add_rms_norm_workspace_size(&xt, &x2t, &gt, nullptr, ex, b);
                       },
                       [&](const npk_exec *ex, void *ws, size_t b) {
                         return npk_add_rms_norm(&xt, &x2t, &gt, nullptr, &y, &rs, &s, ws, b, ex);
                       });
                 });

    run_variants(label("rms_norm_grad", p.x, p.g), 5, {{p.x, n}, {NPK_F32, cols}, {p.g, cols}},
                 {2 * tol_of(p.x), 2e-4, 2 * tol_of(p.g)}, [&](const Exec &e, std::vector<buf> &o) {
                   npk_tensor dx = btens(o[0], 3, xs.data()), dg = btens(o[1], 1, gs.data()),
                              dgc = btens(o[2], 1, gs.data());
                   two_phase(
                       e,
                       [&](const npk_exec *ex, size_t *b) {
                         return npk_rms_norm_grad_workspace_size(&dyt, &xt, &rt, &gt, nullptr, ex, b);
                       },
                       [&](const npk_exec *ex, void *ws, size_t b) {
                         return npk_rms_norm_grad(&dyt, &xt, &rt, &gt, &x2t, nullptr, &dx, &dg, &dgc, ws, b, ex);
                       });
                 });
  }
}

void test_embedding() {
  const npk_dtype grads[] = {NPK_F32, NPK_F16, NPK_BF16};
  const npk_dtype idxs[] = {NPK_I32, NPK_I64};
  const uint64_t nw = 9;
  for (npk_dtype gd : grads)
    for (npk_dtype id : idxs)
      for (npk_dtype od : gd == NPK_F32 ? std::vector<npk_dtype>{gd} : std::vector<npk_dtype>{gd, NPK_F32}) {
        Tensor grad(gd, {5, 4, 32}), idx(id, {5, 4});
        bfill_rand(grad.b, -2, 2);
        for (size_t i = 0; i < idx.b.n; i++) put(idx.b.p, id, i, static_cast<double>(static_cast<int64_t>(urand(0, 9))));
        const npk_tensor gt = grad.t(), it = idx.t();
        const npk_embedding_grad_options opts{2, 1, 0, NPK_INDEX_ERROR, 0};
        const std::vector<int64_t> os{static_cast<int64_t>(nw), 32};
        run_variants(std::string("embedding ") + dname(gd) + "/" + dname(id) + "->" + dname(od), 4,
                     {{od, nw * 32}}, {tol_of(od)}, [&](const Exec &e, std::vector<buf> &o) {
                       npk_tensor out = btens(o[0], 2, os.data());
                       two_phase(
                           e,
                           [&](const npk_exec *ex, size_t *b) {
                             return npk_embedding_dense_grad_workspace_size(&gt, &it, nw, &opts, ex, b);
                           },
                           [&](const npk_exec *ex, void *ws, size_t b) {
                             return npk_embedding_dense_grad(&gt, &it, nw, &opts, &out, ws, b, ex);
                           });
                     });
        CHECK(g_fake.emb_plan.positions == 20 && g_fake.emb_plan.cols == 32 && g_fake.emb_plan.num_weights == nw,
              "%s", "the fake NPU got the embedding plan");
      }
}

// Expects `f()` to throw NpkError with `status` naming `arg`.
void expect_error(int line, npk_status status, const char *arg, const std::function<void()> &f) {
  try {
    f();
    CHECK(false, "line %d: no error", line);
  } catch (const NpkError &e) {
    CHECK(e.status == status && e.argument == arg, "line %d: got %d '%s' (%s), want %d '%s'", line,
          static_cast<int>(e.status), e.argument.c_str(), e.what(), static_cast<int>(status), arg);
  }
}

void test_errors() {
  Exec e(NPK_BACKEND_CPU, 0);
  Tensor x(NPK_F32, {2, 8}), g(NPK_F32, {8}), y(NPK_F32, {2, 8}), gh(NPK_F16, {8});
  const npk_tensor xt = x.t(), gt = g.t(), yt = y.t(), ght = gh.t();
  auto rms = [&](const Exec &ex, const npk_tensor *xp, const npk_tensor *gp, const npk_tensor *yp) {
    two_phase(
        ex, [&](const npk_exec *p, size_t *b) { return npk_rms_norm_workspace_size(xp, gp, nullptr, p, b); },
        [&](const npk_exec *p, void *ws, size_t b) { return npk_rms_norm(xp, gp, nullptr, yp, nullptr, ws, b, p); });
  };
  expect_error(__LINE__, NPK_ERR_NULLPTR, "x", [&] { rms(e, nullptr, &gt, &yt); });
  expect_error(__LINE__, NPK_ERR_NULLPTR, "y", [&] { rms(e, &xt, &gt, nullptr); });
  npk_tensor t = xt;
  t.ndim = 9;
  expect_error(__LINE__, NPK_ERR_PARAM_INVALID, "x", [&] { rms(e, &t, &gt, &yt); });
  t = xt;
  t.shape[1] = -8;
  expect_error(__LINE__, NPK_ERR_PARAM_INVALID, "x", [&] { rms(e, &t, &gt, &yt); });
  const int64_t huge[1] = {int64_t{1} << 62};
  t = tens(x.b.p, NPK_F32, 1, huge);
  expect_error(__LINE__, NPK_ERR_SIZE_OVERFLOW, "x", [&] { rms(e, &t, &gt, &yt); });
  expect_error(__LINE__, NPK_ERR_DTYPE_UNSUPPORTED, "gamma", [&] { rms(e, &xt, &ght, &yt); });
  expect_error(__LINE__, NPK_ERR_PARAM_INVALID, "y", [&] { rms(e, &xt, &gt, &xt); });
  {
    size_t bytes = 0;
    npk_rms_norm_workspace_size(&xt, &gt, nullptr, &e.e, &bytes);
    std::vector<unsigned char> ws(bytes);
    CHECK(npk_rms_norm(&xt, &gt, nullptr, &yt, nullptr, ws.data(), bytes - 1, &e.e) == NPK_ERR_WORKSPACE_TOO_SMALL &&
              e.d.status == NPK_ERR_WORKSPACE_TOO_SMALL,
          "%s", "workspace too small");
  }
  if (npk_detected_isa() != NPK_ISA_AVX512_BF16) {  // the best level: any other CPU lacks it
    Exec forced(NPK_BACKEND_CPU, 0);
    forced.e.isa = NPK_ISA_AVX512_BF16;
    expect_error(__LINE__, NPK_ERR_ISA_UNAVAILABLE, "isa", [&] { rms(forced, &xt, &gt, &yt); });
  }
  {
    Exec f(NPK_BACKEND_FOREIGN, 0);
    f.e.foreign = &g_table;
    g_fake.fail_code = 561002;  // an aclnn-style code from the adapter's own launch
    try {
      rms(f, &xt, &gt, &yt);
      CHECK(false, "%s", "foreign failure not reported");
    } catch (const NpkError &err) {
      CHECK(err.status == NPK_ERR_BACKEND && err.value == 561002, "backend error: %d value %lld",
            static_cast<int>(err.status), static_cast<long long>(err.value));
    }
    g_fake.fail_code = 0;
  }
  {
    Tensor grad(NPK_BF16, {3, 4}), idx(NPK_I32, {3}), out(NPK_F32, {5, 4});
    static_cast<int32_t *>(idx.b.p)[0] = 1;
    static_cast<int32_t *>(idx.b.p)[1] = 5;
    static_cast<int32_t *>(idx.b.p)[2] = 2;
    bfill(out.b, 7.0);
    const npk_tensor gt2 = grad.t(), it = idx.t(), ot = out.t();
    try {
      two_phase(
          e,
          [&](const npk_exec *p, size_t *b) {
            return npk_embedding_dense_grad_workspace_size(&gt2, &it, 5, nullptr, p, b);
          },
          [&](const npk_exec *p, void *ws, size_t b) {
            return npk_embedding_dense_grad(&gt2, &it, 5, nullptr, &ot, ws, b, p);
          });
      CHECK(false, "%s", "index out of range not reported");
    } catch (const NpkError &err) {
      CHECK(err.status == NPK_ERR_INDEX_OUT_OF_RANGE && err.argument == "indices" && err.position == 1 &&
                err.value == 5,
            "index error: %s position %lld value %lld", err.what(), static_cast<long long>(err.position),
            static_cast<long long>(err.value));
    }
    bool untouched = true;
    for (size_t i = 0; i < out.b.n; i++) untouched &= get(out.b.p, NPK_F32, i) == 7.0;
    CHECK(untouched, "%s", "out untouched on error");
  }
}

// npk_tensor_make: size_t (and other integer) dimensions without narrowing
// (this file builds with -Wnarrowing -Werror), and a working call with it.
void test_tensor_make() {
  const size_t rows = 3, cols = 40;
  std::vector<float> x(rows * cols, 0.5f), g(cols, 1.0f), y(rows * cols, 0.0f);
  npk_tensor xt = npk_tensor_make(x.data(), NPK_F32, rows, cols);
  npk_tensor gt = npk_tensor_make(g.data(), NPK_F32, cols);
  npk_tensor yt = npk_tensor_make(y.data(), NPK_F32, int64_t(rows), int(cols));
  CHECK(xt.ndim == 2 && xt.shape[0] == 3 && xt.shape[1] == 40 && xt.data == x.data() && xt.dtype == NPK_F32,
        "%s", "npk_tensor_make fills the descriptor");
  CHECK(yt.ndim == 2 && yt.shape[0] == 3 && yt.shape[1] == 40, "%s", "mixed integer types");
  CHECK(npk_dim(size_t(-1)) == -1 && npk_dim(-5) == -1 && npk_dim(uint8_t(7)) == 7, "%s",
        "out-of-range dimensions become -1");
  npk_tensor bad = npk_tensor_make(x.data(), NPK_F32, size_t(-1), cols);
  npk_error_detail d;
  npk_exec e = {};
  e.detail = &d;
  size_t ws = 0;
  CHECK(npk_rms_norm_workspace_size(&bad, &gt, nullptr, &e, &ws) == NPK_ERR_PARAM_INVALID, "%s",
        "a dimension above INT64_MAX is rejected, not wrapped");
  CHECK(npk_rms_norm_workspace_size(&xt, &gt, nullptr, &e, &ws) == NPK_OK, "%s", "size call");
  std::vector<unsigned char> w(ws + 1);
  CHECK(npk_rms_norm(&xt, &gt, nullptr, &yt, nullptr, w.data(), ws, &e) == NPK_OK, "%s", "run");
  CHECK(y[0] > 0.99f && y[0] < 1.01f, "y = x / rms(x) = 1: %g", double(y[0]));
}

}  // namespace

int main() {
  test_tensor_make();
  test_norms();
  test_embedding();
  test_errors();
  std::printf("test_cpp (npukern %s): %d passed, %d failed\n", npk_version(), g_passed, g_failed);
  return g_failed ? 1 : 0;
}
