/* C11 regression tests for what the `capi` fuzz target (fuzz/fuzz_targets/capi.rs) found:
 *
 * 1. A workspace overlapping a tensor was accepted by RmsNorm, AddRmsNorm,
 *    RmsNormGrad and EmbeddingDenseGrad (the kernels then wrote scratch over
 *    their own inputs/outputs). It is now NPK_ERR_PARAM_INVALID naming
 *    "workspace", with nothing written.
 * 2. A parallel_for that ran one block twice in place of another (so the
 *    call count was still n_blocks) got NPK_OK. It is now caught
 *    (NPK_ERR_BACKEND naming "parallel_for"; the repeat is refused unrun).
 *
 * (Both were also fixed independently on main, from review; these tests
 * replay the fuzzer's own cases: every operator, CPU and Reference.)
 *
 * Built and run by ffi-tests/run.sh (also under -fsanitize=address,undefined
 * with NPK_SANITIZE=1). Exit status 0 = every check passed. */
#include <stddef.h>

#include "common.h"

#define DIMS(...) ((const int64_t[]){__VA_ARGS__})

static npk_error_detail g_detail;

static void expect(npk_status got, npk_status want, const char *arg, int line) {
  CHECK(got == want, "line %d: status %d, want %d (%s: %.160s)", line, (int)got, (int)want, g_detail.argument,
        g_detail.message);
  if (want != NPK_OK)
    CHECK(strcmp(g_detail.argument, arg) == 0, "line %d: detail.argument '%.32s', want '%s'", line,
          g_detail.argument, arg);
}
#define EXPECT(call, want, arg) expect((call), (want), (arg), __LINE__)

/* One buffer holds every tensor and the workspace, so the workspace can be
 * made to overlap each tensor in turn; after a rejected call the whole buffer
 * must be as it was. */
enum { POOL = 1 << 16 };
static unsigned char g_pool[POOL], g_saved[POOL];

static void save(void) { memcpy(g_saved, g_pool, POOL); }
static int unchanged(void) { return memcmp(g_saved, g_pool, POOL) == 0; }

static void fill_pool(void) {
  size_t i;
  float *f = (float *)(void *)g_pool;
  for (i = 0; i < POOL / 4; i++) f[i] = (float)(i % 97) * 0.01f + 0.5f;
}

/* Runs `call` with the workspace placed at each of `n` offsets (each one over
 * a tensor) and expects the overlap error with the buffer untouched. */
#define OVERLAPS(offsets, call)                                                 \
  do {                                                                          \
    size_t k_;                                                                  \
    for (k_ = 0; k_ < sizeof offsets / sizeof offsets[0]; k_++) {              \
      unsigned char *ws = g_pool + offsets[k_];                                 \
      save();                                                                   \
      EXPECT(call, NPK_ERR_PARAM_INVALID, "workspace");                         \
      CHECK(unchanged(), "line %d: offset %zu: a byte changed", __LINE__, offsets[k_]); \
    }                                                                           \
  } while (0)

static void test_workspace_overlaps(const npk_exec *e) {
  /* Layout (bytes): x [0, 4096), gamma [4096, 4352), y [8192, 12288),
   * rstd [12288, 12352), x2/dy [16384, 20480), dx [20480, 24576),
   * dgamma [24576, 24832), free space from 32768. */
  npk_tensor x = tens(g_pool, NPK_F32, 2, DIMS(16, 64)), g = tens(g_pool + 4096, NPK_F32, 1, DIMS(64));
  npk_tensor y = tens(g_pool + 8192, NPK_F32, 2, DIMS(16, 64)), r = tens(g_pool + 12288, NPK_F32, 1, DIMS(16));
  npk_tensor x2 = tens(g_pool + 16384, NPK_F32, 2, DIMS(16, 64));
  npk_tensor dx = tens(g_pool + 20480, NPK_F32, 2, DIMS(16, 64)), dg = tens(g_pool + 24576, NPK_F32, 1, DIMS(64));
  npk_tensor idx = tens(g_pool + 24576, NPK_I32, 1, DIMS(16)), out = tens(g_pool + 8192, NPK_F32, 2, DIMS(8, 64));
  size_t need = 0;
  int32_t *ids = (int32_t *)(void *)(g_pool + 24576);
  int i;
  static const size_t norm_at[] = {0, 2048, 4096 + 100, 8192, 12288 - 8, 12288 + 16};
  static const size_t add_at[] = {16384 + 4000, 8192 + 64};
  static const size_t grad_at[] = {16384, 20480 - 16, 12288, 24576 + 200, 4096};
  static const size_t emb_at[] = {24576, 8192 + 1024, 100};

  fill_pool();
  CHECK(npk_rms_norm_workspace_size(&x, &g, NULL, e, &need) == NPK_OK && need > 0 && need < 16384,
        "rms_norm size %zu", need);
  EXPECT(npk_rms_norm(&x, &g, NULL, &y, &r, g_pool + 32768, need, e), NPK_OK, "");
  OVERLAPS(norm_at, npk_rms_norm(&x, &g, NULL, &y, &r, ws, need, e));

  CHECK(npk_add_rms_norm_workspace_size(&x, &x2, &g, NULL, e, &need) == NPK_OK, "add size");
  EXPECT(npk_add_rms_norm(&x, &x2, &g, NULL, &y, &r, &x, g_pool + 32768, need, e), NPK_OK, "");
  OVERLAPS(add_at, npk_add_rms_norm(&x, &x2, &g, NULL, &y, &r, &x, ws, need, e));

  fill_pool();
  CHECK(npk_rms_norm_grad_workspace_size(&x2, &x, &r, &g, NULL, e, &need) == NPK_OK, "grad size");
  EXPECT(npk_rms_norm_grad(&x2, &x, &r, &g, NULL, NULL, &dx, &dg, NULL, g_pool + 32768, need, e), NPK_OK, "");
  OVERLAPS(grad_at, npk_rms_norm_grad(&x2, &x, &r, &g, NULL, NULL, &dx, &dg, NULL, ws, need, e));

  fill_pool();
  for (i = 0; i < 16; i++) ids[i] = i % 8;
  {
    npk_tensor gr = tens(g_pool, NPK_F32, 2, DIMS(16, 64));
    CHECK(npk_embedding_dense_grad_workspace_size(&gr, &idx, 8, NULL, e, &need) == NPK_OK, "emb size");
    EXPECT(npk_embedding_dense_grad(&gr, &idx, 8, NULL, &out, g_pool + 32768, need, e), NPK_OK, "");
    OVERLAPS(emb_at, npk_embedding_dense_grad(&gr, &idx, 8, NULL, &out, ws, need, e));
  }
}

/* Runs every block except the last, and block 0 once more: n calls in all. */
static void swapping_parallel_for(void *ctx, size_t n, npk_task_fn task, void *task_ctx) {
  size_t b;
  (void)ctx;
  for (b = 0; b + 1 < n; b++) task(task_ctx, b);
  if (n > 0) task(task_ctx, 0);
}

static void test_runner_repeats_a_block(void) {
  npk_exec e;
  npk_tensor x = tens(g_pool, NPK_F32, 2, DIMS(16, 64)), g = tens(g_pool + 4096, NPK_F32, 1, DIMS(64));
  npk_tensor y = tens(g_pool + 8192, NPK_F32, 2, DIMS(16, 64));
  size_t need = 0;
  memset(&e, 0, sizeof e);
  e.detail = &g_detail;
  e.blocks = 4;
  e.parallel_for = swapping_parallel_for;
  fill_pool();
  CHECK(npk_rms_norm_workspace_size(&x, &g, NULL, &e, &need) == NPK_OK, "size");
  EXPECT(npk_rms_norm(&x, &g, NULL, &y, NULL, g_pool + 32768, need, &e), NPK_ERR_BACKEND, "parallel_for");
}

int main(void) {
  npk_exec e;
  memset(&e, 0, sizeof e);
  e.detail = &g_detail;
  test_workspace_overlaps(&e);
  e.backend = NPK_BACKEND_REFERENCE;
  test_workspace_overlaps(&e);
  test_runner_repeats_a_block();
  printf("test_fuzz_regressions: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
