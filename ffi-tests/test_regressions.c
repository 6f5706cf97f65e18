/* C11 regression tests for the defects of issue 9, through the C ABI:
 *  1. rows of length 0: a call with nothing to write returns at once, whatever
 *     the row count (2^62 rows used to be walked one by one);
 *  3. a workspace overlapping any tensor is NPK_ERR_PARAM_INVALID "workspace"
 *     for every operator, before anything is written;
 *  4. a runner that runs a block twice, skips one or passes a block number out
 *     of range is an NPK_ERR_BACKEND error naming the runner, and a second run
 *     of a block never happens;
 *  7. error messages carry the offending values.
 * (Defect 2, padding lanes and an infinite rstd, is in tests/norm_regressions.rs.)
 *
 * Built and run by ffi-tests/run.sh (gcc -std=c11 -Wall -Wextra -Werror
 * -pedantic). Exit status 0 = every check passed. */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <unistd.h>

#include "common.h"

#define DIMS(...) ((const int64_t[]){__VA_ARGS__})

static npk_error_detail g_d;

static npk_exec exec_of(npk_backend_kind k) {
  npk_exec e;
  memset(&e, 0, sizeof e);
  e.backend = k;
  e.detail = &g_d;
  return e;
}

/* Status, argument and (if want_msg) the exact message. */
static void expect_(npk_status got, npk_status want, const char *arg, const char *want_msg, int line) {
  CHECK(got == want, "line %d: status %d, want %d (%s: %s)", line, (int)got, (int)want, g_d.argument, g_d.message);
  CHECK(strcmp(g_d.argument, arg) == 0, "line %d: argument '%s', want '%s'", line, g_d.argument, arg);
  if (want_msg) CHECK(strcmp(g_d.message, want_msg) == 0, "line %d: message '%s'\n  want '%s'", line, g_d.message, want_msg);
}
#define EXPECT(call, want, arg, msg) expect_((call), (want), (arg), (msg), __LINE__)

/* ---- 1. empty rows ---- */

static void on_alarm(int sig) {
  (void)sig;
  fprintf(stderr, "FAIL: a call over empty rows did not return (defect 1)\n");
  _exit(1);
}

static void test_empty_rows(void) {
  /* x = [2^31, 2^31, 0], gamma = [0], rstd NULL: nothing to write. */
  int64_t big = (int64_t)1 << 31;
  const int64_t xs[3] = {big, big, 0};
  npk_tensor x = tens(NULL, NPK_F32, 3, xs), g = tens(NULL, NPK_F32, 1, DIMS(0));
  npk_backend_kind kinds[2] = {NPK_BACKEND_CPU, NPK_BACKEND_REFERENCE};
  int k;
  signal(SIGALRM, on_alarm);
  alarm(20);
  for (k = 0; k < 2; k++) {
    npk_exec e = exec_of(kinds[k]);
    size_t ws = 1;
    void *w;
    EXPECT(npk_rms_norm_workspace_size(&x, &g, NULL, &e, &ws), NPK_OK, "", NULL);
    CHECK(ws == 0, "no workspace for empty rows: %zu", ws);
    w = malloc(ws + 1);
    EXPECT(npk_rms_norm(&x, &g, NULL, &x, NULL, w, ws, &e), NPK_OK, "", NULL);
    EXPECT(npk_add_rms_norm(&x, &x, &g, NULL, &x, NULL, NULL, w, ws, &e), NPK_OK, "", NULL);
    EXPECT(npk_add_rms_norm(&x, &x, &g, NULL, &x, NULL, &x, w, ws, &e), NPK_OK, "", NULL);
    free(w);
  }
  alarm(0);
  {
    /* With rstd: the rows' rstd is NaN (that is the work). */
    buf r = balloc(NPK_F32, 1000);
    npk_tensor x2 = tens(NULL, NPK_BF16, 3, DIMS(10, 100, 0)), g2 = tens(NULL, NPK_BF16, 1, DIMS(0));
    npk_tensor rt = btens(r, 1, DIMS(1000));
    npk_exec e = exec_of(NPK_BACKEND_CPU);
    size_t i, nan = 0;
    EXPECT(npk_rms_norm(&x2, &g2, NULL, &x2, &rt, NULL, 0, &e), NPK_OK, "", NULL);
    for (i = 0; i < r.n; i++) nan += isnan(((float *)r.p)[i]) != 0;
    CHECK(nan == r.n, "rstd of empty rows is NaN: %zu of %zu", nan, r.n);
    bfree(&r);
  }
}

/* ---- 3. workspace overlapping a tensor ---- */

static void test_workspace_overlap(void) {
  enum { M = 4, N = 40, H = 8, V = 6 };
  npk_exec e = exec_of(NPK_BACKEND_CPU);
  buf x = balloc(NPK_F32, M * N), x2 = balloc(NPK_F32, M * N), g = balloc(NPK_F32, N), y = balloc(NPK_F32, M * N);
  buf r = balloc(NPK_F32, M), dg = balloc(NPK_F32, N), big = balloc(NPK_F32, 1 << 16);
  buf grad = balloc(NPK_F32, M * H), idx = balloc(NPK_I64, 1 << 14), out = balloc(NPK_F32, V * H);
  npk_tensor xt = btens(x, 2, DIMS(M, N)), x2t = btens(x2, 2, DIMS(M, N)), gt = btens(g, 1, DIMS(N));
  npk_tensor yt = btens(y, 2, DIMS(M, N)), rt = btens(r, 1, DIMS(M)), dgt = btens(dg, 1, DIMS(N));
  npk_tensor gradt = btens(grad, 2, DIMS(M, H)), it, outt = btens(out, 2, DIMS(V, H));
  buf ysave, xsave, isave;
  size_t ws = 0, i;
  bfill_rand(x, -1, 1);
  bfill_rand(x2, -1, 1);
  bfill_rand(g, 0.5, 1.5);
  bfill(r, 1.0);
  bfill(y, 7.0);
  bfill(dg, 7.0);
  for (i = 0; i < idx.n; i++) ((int64_t *)idx.p)[i] = (int64_t)(i % V);
  it = btens(idx, 1, DIMS(M));
  ysave = bclone(y);
  xsave = bclone(x);

  /* RmsNorm with the workspace on x's buffer (a big x, so the workspace fits in it). */
  {
    npk_tensor bx = btens(big, 2, DIMS(1 << 10, 64)), bg = tens(g.p, NPK_F32, 1, DIMS(64));
    buf by = balloc(NPK_F32, 1 << 16), bcopy = bclone(big);
    npk_tensor byt = btens(by, 2, DIMS(1 << 10, 64));
    npk_exec small = e; /* small arenas, so the workspace fits inside x */
    small.ub_bytes = 4096;
    small.blocks = 4;
    bfill_rand(big, -1, 1);
    bfree(&bcopy);
    bcopy = bclone(big);
    bfill(by, 7.0);
    {
      buf bysave = bclone(by);
      EXPECT(npk_rms_norm_workspace_size(&bx, &bg, NULL, &small, &ws), NPK_OK, "", NULL);
      CHECK(ws > 0 && ws <= big.n * 4, "workspace %zu fits in x", ws);
      EXPECT(npk_rms_norm(&bx, &bg, NULL, &byt, NULL, big.p, ws, &small), NPK_ERR_PARAM_INVALID, "workspace", NULL);
      CHECK(strstr(g_d.message, "overlap x") != NULL, "message names x: %s", g_d.message);
      CHECK(bsame(big, bcopy) && bsame(by, bysave), "x and y untouched");
      /* Overlapping y (an output) is refused too. */
      EXPECT(npk_rms_norm(&bx, &bg, NULL, &byt, NULL, by.p, ws, &small), NPK_ERR_PARAM_INVALID, "workspace", NULL);
      CHECK(bsame(by, bysave), "y untouched");
      bfree(&bysave);
    }
    bfree(&by);
    bfree(&bcopy);
  }
  /* AddRmsNorm with the workspace on x2. */
  EXPECT(npk_add_rms_norm_workspace_size(&xt, &x2t, &gt, NULL, &e, &ws), NPK_OK, "", NULL);
  {
    buf w = balloc(NPK_F32, ws / 4 + M * N); /* a buffer holding both x2 and the workspace */
    npk_tensor wx2 = tens(w.p, NPK_F32, 2, DIMS(M, N));
    buf wsave;
    memcpy(w.p, x2.p, (size_t)M * N * 4);
    wsave = bclone(w);
    EXPECT(npk_add_rms_norm(&xt, &wx2, &gt, NULL, &yt, &rt, NULL, (char *)w.p + 8, ws, &e), NPK_ERR_PARAM_INVALID,
           "workspace", NULL);
    CHECK(bsame(w, wsave) && bsame(y, ysave), "x2 and y untouched");
    /* RmsNormGrad with the workspace on dy (the same buffer). */
    EXPECT(npk_rms_norm_grad_workspace_size(&wx2, &xt, &rt, &gt, NULL, &e, &ws), NPK_OK, "", NULL);
    bfree(&w);
    w = balloc(NPK_F32, ws / 4 + M * N);
    wx2 = tens(w.p, NPK_F32, 2, DIMS(M, N));
    bfill_rand(w, -1, 1);
    bfree(&wsave);
    wsave = bclone(w);
    EXPECT(npk_rms_norm_grad(&wx2, &xt, &rt, &gt, NULL, NULL, &yt, &dgt, NULL, (char *)w.p + 4, ws, &e),
           NPK_ERR_PARAM_INVALID, "workspace", NULL);
    CHECK(bsame(w, wsave) && bsame(y, ysave), "dy and dx untouched");
    bfree(&w);
    bfree(&wsave);
  }
  /* EmbeddingDenseGrad with the workspace on the indices (it used to overwrite them). */
  EXPECT(npk_embedding_dense_grad_workspace_size(&gradt, &it, V, NULL, &e, &ws), NPK_OK, "", NULL);
  CHECK(ws <= idx.n * 8, "workspace %zu fits in the index buffer", ws);
  isave = bclone(idx);
  {
    buf osave = bclone(out);
    EXPECT(npk_embedding_dense_grad(&gradt, &it, V, NULL, &outt, idx.p, ws, &e), NPK_ERR_PARAM_INVALID, "workspace",
           NULL);
    CHECK(bsame(idx, isave) && bsame(out, osave), "indices and out untouched");
    /* Beside the tensors it is fine. */
    EXPECT(npk_embedding_dense_grad(&gradt, &it, V, NULL, &outt, (int64_t *)idx.p + M, ws, &e), NPK_OK, "", NULL);
    bfree(&osave);
  }
  CHECK(bsame(x, xsave), "x untouched throughout");
  bfree(&x);
  bfree(&x2);
  bfree(&g);
  bfree(&y);
  bfree(&r);
  bfree(&dg);
  bfree(&big);
  bfree(&grad);
  bfree(&idx);
  bfree(&out);
  bfree(&ysave);
  bfree(&xsave);
  bfree(&isave);
}

/* ---- 4. runners that break the contract ---- */

static int g_runs[64];

static void count_task(size_t n_blocks, npk_task_fn task, void *task_ctx, size_t b) {
  if (b < n_blocks) g_runs[b]++;
  task(task_ctx, b);
}

/* Runs block 0 twice and never block 1. */
static void dup_runner(void *ctx, size_t n_blocks, npk_task_fn task, void *task_ctx) {
  size_t b;
  (void)ctx;
  for (b = 0; b < n_blocks; b++) count_task(n_blocks, task, task_ctx, b == 1 ? 0 : b);
}

/* Passes a block number past the end instead of the last block. */
static void oob_runner(void *ctx, size_t n_blocks, npk_task_fn task, void *task_ctx) {
  size_t b;
  (void)ctx;
  for (b = 0; b + 1 < n_blocks; b++) task(task_ctx, b);
  task(task_ctx, n_blocks);
}

static void test_runner_faults(void) {
  enum { M = 8, N = 24, H = 4, V = 8 };
  buf x = balloc(NPK_F32, M * N), g = balloc(NPK_F32, N), y = balloc(NPK_F32, M * N);
  buf grad = balloc(NPK_F32, M * H), idx = balloc(NPK_I32, M), out = balloc(NPK_F32, V * H);
  npk_tensor xt = btens(x, 2, DIMS(M, N)), gt = btens(g, 1, DIMS(N)), yt = btens(y, 2, DIMS(M, N));
  npk_tensor gradt = btens(grad, 2, DIMS(M, H)), it = btens(idx, 1, DIMS(M)), outt = btens(out, 2, DIMS(V, H));
  npk_embedding_grad_options eo = {-1, 0, 0, NPK_INDEX_ERROR, 1};
  npk_exec e = exec_of(NPK_BACKEND_CPU);
  size_t ws = 0, i;
  void *w;
  e.blocks = 4;
  e.parallel_for = dup_runner;
  bfill_rand(x, -1, 1);
  bfill(g, 1.0);
  bfill(grad, 1.0);
  for (i = 0; i < M; i++) ((int32_t *)idx.p)[i] = (int32_t)i; /* one row per block */
  EXPECT(npk_rms_norm_workspace_size(&xt, &gt, NULL, &e, &ws), NPK_OK, "", NULL);
  w = malloc(ws);
  memset(g_runs, 0, sizeof g_runs);
  EXPECT(npk_rms_norm(&xt, &gt, NULL, &yt, NULL, w, ws, &e), NPK_ERR_BACKEND, "parallel_for",
         "parallel_for: the host runner ran block 0 of 4 twice");
  free(w);
  /* With accumulate, a block run twice would add its rows twice: the second
     run is refused, so row 0 got its gradient once and row 2 and 3 (block 1)
     none. */
  EXPECT(npk_embedding_dense_grad_workspace_size(&gradt, &it, V, &eo, &e, &ws), NPK_OK, "", NULL);
  w = malloc(ws ? ws : 1);
  bfill(out, 0.0);
  EXPECT(npk_embedding_dense_grad(&gradt, &it, V, &eo, &outt, w, ws, &e), NPK_ERR_BACKEND, "parallel_for", NULL);
  CHECK(((float *)out.p)[0] == 1.0f, "row 0 accumulated once, not twice: %g", ((float *)out.p)[0]);
  CHECK(((float *)out.p)[2 * H] == 0.0f, "block 1's rows were skipped: %g", ((float *)out.p)[2 * H]);
  e.parallel_for = oob_runner;
  EXPECT(npk_embedding_dense_grad(&gradt, &it, V, &eo, &outt, w, ws, &e), NPK_ERR_BACKEND, "parallel_for",
         "parallel_for: the host runner passed block 4, beyond the 4 blocks");
  free(w);
  CHECK(strcmp(npk_status_string(NPK_ERR_BACKEND), "") != 0, "status string");
  bfree(&x);
  bfree(&g);
  bfree(&y);
  bfree(&grad);
  bfree(&idx);
  bfree(&out);
}

/* ---- 7. messages with values ---- */

static void test_messages(void) {
  npk_exec e = exec_of(NPK_BACKEND_CPU);
  buf x = balloc(NPK_F32, 2 * 3 * 4095), g = balloc(NPK_F32, 4096), y = balloc(NPK_F32, 2 * 3 * 4095);
  npk_tensor xt = btens(x, 3, DIMS(2, 3, 4095)), gt = btens(g, 1, DIMS(4096)), yt = btens(y, 3, DIMS(2, 3, 4095));
  npk_tensor bad = xt;
  npk_rms_norm_options o = {1e300, 0.0f, NPK_ROUNDING_FUSED};
  size_t ws = 0;
  EXPECT(npk_rms_norm_workspace_size(&xt, &gt, NULL, &e, &ws), NPK_ERR_PARAM_INVALID, "gamma",
         "gamma: shape [4096] is not the trailing dims of x [2, 3, 4095]");
  bad.ndim = 9;
  EXPECT(npk_rms_norm(&bad, &gt, NULL, &yt, NULL, NULL, 0, &e), NPK_ERR_PARAM_INVALID, "x", "x: rank 9 is not in 1..=8");
  bad = xt;
  bad.shape[1] = -3;
  EXPECT(npk_rms_norm(&bad, &gt, NULL, &yt, NULL, NULL, 0, &e), NPK_ERR_PARAM_INVALID, "x", "x: shape[1] = -3 is negative");
  {
    /* An out-of-enum dtype code, written through the raw bytes. */
    uint32_t code = 7;
    bad = xt;
    memcpy(&bad.dtype, &code, sizeof code);
    EXPECT(npk_rms_norm(&bad, &gt, NULL, &yt, NULL, NULL, 0, &e), NPK_ERR_DTYPE_UNSUPPORTED, "x",
           "x: dtype code 7 is not an npk_dtype value");
  }
  gt = btens(g, 1, DIMS(4095));
  bad = tens(y.p, NPK_F16, 3, DIMS(2, 3, 4095));
  EXPECT(npk_rms_norm(&xt, &gt, NULL, &bad, NULL, NULL, 0, &e), NPK_ERR_DTYPE_UNSUPPORTED, "y",
         "y: dtype f16 differs from x's f32");
  EXPECT(npk_rms_norm_workspace_size(&xt, &gt, &o, &e, &ws), NPK_ERR_PARAM_INVALID, "eps", NULL);
  CHECK(strstr(g_d.message, "eps: 1") == g_d.message, "eps message carries the value: %s", g_d.message);
  bfree(&x);
  bfree(&g);
  bfree(&y);
}

int main(void) {
  test_empty_rows();
  test_workspace_overlap();
  test_runner_faults();
  test_messages();
  printf("test_regressions: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
