/* C11 test of the npukern C ABI (include/npukern.h).
 *
 * Covers: the four operators in every dtype combination through the
 * two-phase calls, checked against NPK_BACKEND_REFERENCE run through the same
 * calls; bit-identity of serial, pthread parallel_for, the library's own pool
 * (npk_threads_parallel_for) and a fake NPU backend (a C function table that
 * records the plans it receives and computes through the reference backend);
 * the CPU fallback for NULL table entries; and the error paths (NULL
 * pointers, ndim 0 and 9, negative shape entries, shape products that
 * overflow, mismatched shapes, unsupported dtypes, invalid enum values,
 * workspace NULL or too small, overlapping outputs, out-of-range indices with
 * their detail, forced ISA unavailable, foreign backend failure, a runner
 * that skips blocks), checking npk_error_detail and that outputs stay
 * untouched.
 *
 * Built by ffi-tests/run.sh with gcc -std=c11 -Wall -Wextra -Werror -pedantic,
 * once against libnpukern.a and once against libnpukern.so. Exit status 0 =
 * every check passed. */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

#include "common.h"

#ifndef NPK_EXPECTED_VERSION
#define NPK_EXPECTED_VERSION ""
#endif

/* The header's layout, as an adapter relies on it (enums are int-sized). */
_Static_assert(sizeof(npk_dtype) == 4, "npk_dtype is int-sized");
_Static_assert(sizeof(npk_status) == 4, "npk_status is int-sized");
_Static_assert(sizeof(npk_tensor) == 80, "npk_tensor layout");
_Static_assert(offsetof(npk_tensor, shape) == 16, "npk_tensor layout");
_Static_assert(sizeof(npk_exec) == 56, "npk_exec layout");
_Static_assert(offsetof(npk_error_detail, position) == 40, "npk_error_detail layout");
_Static_assert(sizeof(npk_error_detail) == 216, "npk_error_detail layout");

#define DIMS(...) ((const int64_t[]){__VA_ARGS__})

/* Stores a raw integer into an enum-typed field, as any C caller can. */
#define SET_RAW(field, v)             \
  do {                                \
    uint32_t raw_ = (v);              \
    memcpy(&(field), &raw_, 4);       \
  } while (0)

/* ======================= runners ======================= */

typedef struct {
  npk_task_fn task;
  void *task_ctx;
  size_t n;
  atomic_size_t next;
} pt_job;

static atomic_int g_pt_calls;

static void *pt_worker(void *arg) {
  pt_job *j = (pt_job *)arg;
  for (;;) {
    size_t b = atomic_fetch_add(&j->next, 1);
    if (b >= j->n) break;
    j->task(j->task_ctx, b);
  }
  return NULL;
}

/* A host runner on pthreads: runner_ctx is an int* thread count. */
static void pthread_parallel_for(void *runner_ctx, size_t n_blocks, npk_task_fn task, void *task_ctx) {
  pthread_t tid[16];
  int threads = runner_ctx ? *(const int *)runner_ctx : 4, started = 0, i;
  pt_job j;
  j.task = task;
  j.task_ctx = task_ctx;
  j.n = n_blocks;
  atomic_init(&j.next, 0);
  atomic_fetch_add(&g_pt_calls, 1);
  if (threads > 16) threads = 16;
  for (i = 1; i < threads; i++)
    if (pthread_create(&tid[started], NULL, pt_worker, &j) == 0) started++;
  pt_worker(&j);
  for (i = 0; i < started; i++) pthread_join(tid[i], NULL);
}

/* A broken runner: skips the last block. */
static void skipping_parallel_for(void *runner_ctx, size_t n_blocks, npk_task_fn task, void *task_ctx) {
  size_t b;
  (void)runner_ctx;
  for (b = 0; b + 1 < n_blocks; b++) task(task_ctx, b);
}

/* ======================= the fake NPU backend ======================= */

typedef struct {
  int calls[4];
  int fail_code; /* nonzero: return it without computing */
  npk_norm_tiling norm_plan;
  npk_embedding_tiling emb_plan;
  void *ws;
  size_t ws_bytes;
  npk_exec ref; /* the reference backend it computes through */
} fake_npu;

static npk_status fake_rms_norm(void *ctx, const npk_rms_norm_call *c) {
  fake_npu *f = (fake_npu *)ctx;
  npk_rms_norm_options o;
  f->calls[0]++;
  f->norm_plan = c->tiling;
  f->ws = c->workspace;
  f->ws_bytes = c->workspace_bytes;
  if (f->fail_code) return (npk_status)f->fail_code;
  o.eps = c->eps;
  o.gamma_offset = c->gamma_offset;
  o.rounding = c->rounding;
  return npk_rms_norm(&c->x, &c->gamma, &o, &c->y, c->has_rstd ? &c->rstd : NULL, c->workspace,
                      c->workspace_bytes, &f->ref);
}

static npk_status fake_add_rms_norm(void *ctx, const npk_add_rms_norm_call *c) {
  fake_npu *f = (fake_npu *)ctx;
  npk_rms_norm_options o;
  f->calls[1]++;
  f->norm_plan = c->tiling;
  f->ws = c->workspace;
  f->ws_bytes = c->workspace_bytes;
  if (f->fail_code) return (npk_status)f->fail_code;
  o.eps = c->eps;
  o.gamma_offset = c->gamma_offset;
  o.rounding = c->rounding;
  return npk_add_rms_norm(&c->x1, &c->x2, &c->gamma, &o, &c->y, c->has_rstd ? &c->rstd : NULL,
                          c->has_x_sum ? &c->x_sum : NULL, c->workspace, c->workspace_bytes, &f->ref);
}

static npk_status fake_rms_norm_grad(void *ctx, const npk_rms_norm_grad_call *c) {
  fake_npu *f = (fake_npu *)ctx;
  npk_rms_norm_grad_options o;
  f->calls[2]++;
  f->norm_plan = c->tiling;
  f->ws = c->workspace;
  f->ws_bytes = c->workspace_bytes;
  if (f->fail_code) return (npk_status)f->fail_code;
  o.gamma_offset = c->gamma_offset;
  o.accumulate_dgamma = (uint8_t)c->accumulate_dgamma;
  return npk_rms_norm_grad(&c->dy, &c->x, &c->rstd, &c->gamma, c->has_dres ? &c->dres : NULL, &o, &c->dx,
                           c->has_dgamma ? &c->dgamma : NULL, c->has_dgamma_cast ? &c->dgamma_cast : NULL,
                           c->workspace, c->workspace_bytes, &f->ref);
}

static npk_status fake_embedding(void *ctx, const npk_embedding_dense_grad_call *c) {
  fake_npu *f = (fake_npu *)ctx;
  npk_embedding_grad_options o;
  f->calls[3]++;
  f->emb_plan = c->tiling;
  f->ws = c->workspace;
  f->ws_bytes = c->workspace_bytes;
  if (f->fail_code) return (npk_status)f->fail_code;
  o.padding_idx = c->padding_idx;
  o.scale_grad_by_freq = (uint8_t)c->scale_grad_by_freq;
  o.vocab_start = c->vocab_start;
  o.out_of_range = c->out_of_range;
  o.accumulate = (uint8_t)c->accumulate;
  return npk_embedding_dense_grad(&c->grad, &c->indices, c->num_weights, &o, &c->out, c->workspace,
                                  c->workspace_bytes, &f->ref);
}

static fake_npu g_fake;
static const npk_foreign_backend g_fake_table = {sizeof(npk_foreign_backend), &g_fake, fake_rms_norm, fake_add_rms_norm, fake_rms_norm_grad,
                                                 fake_embedding, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
/* All entries NULL: every operator falls back to the CPU backend. */
static const npk_foreign_backend g_empty_table = {sizeof(npk_foreign_backend), &g_fake, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};

/* ======================= execs ======================= */

enum { V_REF, V_CPU, V_PTHREAD, V_POOL, V_POOL3, V_FAKE, V_FALLBACK, V_NULL, NV };
static const char *const VNAME[NV] = {"reference", "cpu",  "pthread",  "pool",
                                      "pool(3)",   "fake", "fallback", "NULL exec"};
static npk_exec g_execs[NV];
static int g_four = 4;
static uint32_t g_three = 3;

static npk_exec mk_exec(npk_backend_kind k, uint32_t blocks, uint64_t ub) {
  npk_exec e;
  memset(&e, 0, sizeof e);
  e.ub_bytes = ub;
  e.blocks = blocks;
  e.isa = NPK_ISA_AUTO;
  e.backend = k;
  return e;
}

static void setup_execs(uint32_t blocks, uint64_t ub) {
  int v;
  for (v = 0; v < NV; v++) g_execs[v] = mk_exec(NPK_BACKEND_CPU, blocks, ub);
  g_execs[V_REF].backend = NPK_BACKEND_REFERENCE;
  g_execs[V_PTHREAD].parallel_for = pthread_parallel_for;
  g_execs[V_PTHREAD].runner_ctx = &g_four;
  g_execs[V_POOL].parallel_for = npk_threads_parallel_for;
  g_execs[V_POOL3].parallel_for = npk_threads_parallel_for;
  g_execs[V_POOL3].runner_ctx = &g_three;
  g_execs[V_FAKE].backend = NPK_BACKEND_FOREIGN;
  g_execs[V_FAKE].foreign = &g_fake_table;
  g_execs[V_FALLBACK].backend = NPK_BACKEND_FOREIGN;
  g_execs[V_FALLBACK].foreign = &g_empty_table;
  g_execs[V_FALLBACK].parallel_for = pthread_parallel_for;
  g_fake.ref = mk_exec(NPK_BACKEND_REFERENCE, blocks, ub);
  g_fake.fail_code = 0;
}

static const npk_exec *vexec(int v) { return v == V_NULL ? NULL : &g_execs[v]; }

/* The workspace of the last run (allocated one byte past malloc's alignment:
 * the library needs no particular alignment). */
static void *g_last_ws;
static size_t g_last_ws_bytes;

static unsigned char *ws_alloc(size_t n) {
  unsigned char *m = (unsigned char *)malloc(n + 1);
  if (!m) exit(2);
  g_last_ws = n ? m + 1 : NULL;
  g_last_ws_bytes = n;
  return m;
}

/* ======================= two-phase runners ======================= */

static npk_status run_rms_norm(const npk_tensor *x, const npk_tensor *g, const npk_rms_norm_options *o,
                               const npk_tensor *y, const npk_tensor *r, const npk_exec *e) {
  size_t ws = 0;
  unsigned char *m;
  npk_status s = npk_rms_norm_workspace_size(x, g, o, e, &ws);
  if (s != NPK_OK) return s;
  m = ws_alloc(ws);
  s = npk_rms_norm(x, g, o, y, r, g_last_ws, ws, e);
  free(m);
  return s;
}

static npk_status run_add_rms_norm(const npk_tensor *x1, const npk_tensor *x2, const npk_tensor *g,
                                   const npk_rms_norm_options *o, const npk_tensor *y, const npk_tensor *r,
                                   const npk_tensor *xs, const npk_exec *e) {
  size_t ws = 0;
  unsigned char *m;
  npk_status s = npk_add_rms_norm_workspace_size(x1, x2, g, o, e, &ws);
  if (s != NPK_OK) return s;
  m = ws_alloc(ws);
  s = npk_add_rms_norm(x1, x2, g, o, y, r, xs, g_last_ws, ws, e);
  free(m);
  return s;
}

static npk_status run_grad(const npk_tensor *dy, const npk_tensor *x, const npk_tensor *r, const npk_tensor *g,
                           const npk_tensor *dres, const npk_rms_norm_grad_options *o, const npk_tensor *dx,
                           const npk_tensor *dg, const npk_tensor *dgc, const npk_exec *e) {
  size_t ws = 0;
  unsigned char *m;
  npk_status s = npk_rms_norm_grad_workspace_size(dy, x, r, g, o, e, &ws);
  if (s != NPK_OK) return s;
  m = ws_alloc(ws);
  s = npk_rms_norm_grad(dy, x, r, g, dres, o, dx, dg, dgc, g_last_ws, ws, e);
  free(m);
  return s;
}

static npk_status run_emb(const npk_tensor *grad, const npk_tensor *idx, uint64_t nw,
                          const npk_embedding_grad_options *o, const npk_tensor *out, const npk_exec *e) {
  size_t ws = 0;
  unsigned char *m;
  npk_status s = npk_embedding_dense_grad_workspace_size(grad, idx, nw, o, e, &ws);
  if (s != NPK_OK) return s;
  m = ws_alloc(ws);
  s = npk_embedding_dense_grad(grad, idx, nw, o, out, g_last_ws, ws, e);
  free(m);
  return s;
}

/* The expected plan of a row-wise norm: min(blocks, rows) blocks of
 * ceil(rows / that) rows. */
static void check_norm_plan(const npk_norm_tiling *t, uint64_t rows, uint64_t cols, uint32_t blocks) {
  uint64_t b0 = blocks ? blocks : 64, rpb;
  if (b0 > rows) b0 = rows;
  rpb = (rows + b0 - 1) / b0;
  CHECK(t->rows == rows && t->cols == cols, "plan %llu x %llu", (unsigned long long)t->rows,
        (unsigned long long)t->cols);
  CHECK(t->rows_per_block == rpb, "rows_per_block %llu want %llu", (unsigned long long)t->rows_per_block,
        (unsigned long long)rpb);
  CHECK(t->blocks == (rows + rpb - 1) / rpb, "blocks %u", t->blocks);
  CHECK(t->workspace_bytes <= g_last_ws_bytes && g_fake.ws == g_last_ws && g_fake.ws_bytes == g_last_ws_bytes,
        "workspace handed to the backend");
}

/* Compares every variant's outputs: reference within tolerance of the CPU;
 * threads, pool and fallback bit-identical to the CPU; the fake NPU
 * bit-identical to the reference. `tols[k] < 0` marks an output that may
 * differ between block counts (dgamma: the NULL exec uses 64 blocks). */
static void compare_variants(buf out[NV][4], int nout, const double *tols, const char *what) {
  int v, k;
  for (k = 0; k < nout; k++) {
    double tol = tols[k] < 0 ? -tols[k] : tols[k];
    char name[96];
    snprintf(name, sizeof name, "%s out%d cpu~ref", what, k);
    CHECK(close_enough(out[V_CPU][k], out[V_REF][k], tol, 0.05, name), "%s", name);
    CHECK(bsame(out[V_FAKE][k], out[V_REF][k]), "%s out%d: fake NPU differs from the reference", what, k);
    for (v = V_PTHREAD; v < NV; v++) {
      if (v == V_FAKE) continue;
      if (v == V_NULL && tols[k] < 0) {
        snprintf(name, sizeof name, "%s out%d NULL exec~cpu", what, k);
        CHECK(close_enough(out[v][k], out[V_CPU][k], tol, 0.05, name), "%s", name);
      } else {
        CHECK(bsame(out[v][k], out[V_CPU][k]), "%s out%d: %s differs from serial cpu", what, k, VNAME[v]);
      }
    }
  }
}

/* ======================= operators ======================= */

typedef struct {
  npk_dtype x, g;
} dpair;
static const dpair PAIRS[5] = {
    {NPK_F32, NPK_F32}, {NPK_F16, NPK_F16}, {NPK_F16, NPK_F32}, {NPK_BF16, NPK_BF16}, {NPK_BF16, NPK_F32}};

typedef struct {
  uint32_t xnd, gnd;
  int64_t xs[4], gs[4];
  uint32_t blocks;
  uint64_t ub;
  int opts; /* 0: NULL options; 1: eps 1e-5, offset 1, cast-before-gamma */
} norm_cfg;

static const norm_cfg NCFG[3] = {
    {3, 1, {3, 5, 40, 0}, {40, 0, 0, 0}, 7, 0, 0},
    {4, 2, {2, 3, 4, 8}, {4, 8, 0, 0}, 4, 0, 1},
    {2, 1, {6, 700, 0, 0}, {700, 0, 0, 0}, 0, 4096, 0}, /* split-D: 700 f32 rows exceed a 4 KiB UB */
};

static size_t numel(uint32_t nd, const int64_t *s) {
  size_t n = 1;
  uint32_t i;
  for (i = 0; i < nd; i++) n *= (size_t)s[i];
  return n;
}

static void test_rms_norm(void) {
  int p, c, v, k;
  for (c = 0; c < 3; c++) {
    const norm_cfg *cf = &NCFG[c];
    size_t n = numel(cf->xnd, cf->xs), cols = numel(cf->gnd, cf->gs), rows = n / cols;
    npk_rms_norm_options o = {1e-5, 1.0f, NPK_ROUNDING_CAST_BEFORE_GAMMA};
    const npk_rms_norm_options *op = cf->opts ? &o : NULL;
    setup_execs(cf->blocks, cf->ub);
    for (p = 0; p < 5; p++) {
      buf x = balloc(PAIRS[p].x, n), g = balloc(PAIRS[p].g, cols), out[NV][4];
      npk_tensor xt, gt;
      double tols[2];
      char what[64];
      int pt0 = atomic_load(&g_pt_calls), fake0 = g_fake.calls[0];
      bfill_rand(x, -3, 3);
      bfill_rand(g, 0.5, 1.5);
      xt = btens(x, cf->xnd, cf->xs);
      gt = btens(g, cf->gnd, cf->gs);
      for (v = 0; v < NV; v++) {
        npk_tensor yt, rt;
        npk_status s;
        out[v][0] = balloc(PAIRS[p].x, n);
        out[v][1] = balloc(NPK_F32, rows);
        yt = btens(out[v][0], cf->xnd, cf->xs);
        rt = tens(out[v][1].p, NPK_F32, 1, DIMS((int64_t)rows));
        s = run_rms_norm(&xt, &gt, op, &yt, &rt, vexec(v));
        CHECK(s == NPK_OK, "rms_norm %s/%s cfg %d %s: status %d", dname(PAIRS[p].x), dname(PAIRS[p].g), c,
              VNAME[v], (int)s);
        if (v == V_FAKE) check_norm_plan(&g_fake.norm_plan, rows, cols, cf->blocks);
      }
      tols[0] = tol_of(PAIRS[p].x);
      tols[1] = 1e-5;
      snprintf(what, sizeof what, "rms_norm %s/%s cfg %d", dname(PAIRS[p].x), dname(PAIRS[p].g), c);
      compare_variants(out, 2, tols, what);
      CHECK(atomic_load(&g_pt_calls) > pt0, "%s: the pthread runner was used", what);
      CHECK(g_fake.calls[0] == fake0 + 1, "%s: the fake NPU ran once (the fallback table never)", what);
      for (v = 0; v < NV; v++)
        for (k = 0; k < 2; k++) bfree(&out[v][k]);
      bfree(&x);
      bfree(&g);
    }
  }
}

static void test_add_rms_norm(void) {
  int p, c, v, k;
  for (c = 0; c < 3; c++) {
    const norm_cfg *cf = &NCFG[c];
    size_t n = numel(cf->xnd, cf->xs), cols = numel(cf->gnd, cf->gs), rows = n / cols;
    npk_rms_norm_options o = {1e-5, 1.0f, NPK_ROUNDING_CAST_BEFORE_GAMMA};
    const npk_rms_norm_options *op = cf->opts ? &o : NULL;
    setup_execs(cf->blocks, cf->ub);
    for (p = 0; p < 5; p++) {
      buf x1 = balloc(PAIRS[p].x, n), x2 = balloc(PAIRS[p].x, n), g = balloc(PAIRS[p].g, cols), out[NV][4];
      npk_tensor x1t, x2t, gt, yt, rt, st;
      double tols[3];
      char what[64];
      int fake0 = g_fake.calls[1];
      bfill_rand(x1, -3, 3);
      bfill_rand(x2, -1, 1);
      bfill_rand(g, 0.5, 1.5);
      x1t = btens(x1, cf->xnd, cf->xs);
      x2t = btens(x2, cf->xnd, cf->xs);
      gt = btens(g, cf->gnd, cf->gs);
      for (v = 0; v < NV; v++) {
        npk_status s;
        out[v][0] = balloc(PAIRS[p].x, n);
        out[v][1] = balloc(NPK_F32, rows);
        out[v][2] = balloc(PAIRS[p].x, n);
        yt = btens(out[v][0], cf->xnd, cf->xs);
        rt = tens(out[v][1].p, NPK_F32, 1, DIMS((int64_t)rows));
        st = btens(out[v][2], cf->xnd, cf->xs);
        s = run_add_rms_norm(&x1t, &x2t, &gt, op, &yt, &rt, &st, vexec(v));
        CHECK(s == NPK_OK, "add_rms_norm %s/%s cfg %d %s: status %d", dname(PAIRS[p].x), dname(PAIRS[p].g), c,
              VNAME[v], (int)s);
        if (v == V_FAKE) check_norm_plan(&g_fake.norm_plan, rows, cols, cf->blocks);
      }
      tols[0] = tol_of(PAIRS[p].x);
      tols[1] = 1e-5;
      tols[2] = tol_of(PAIRS[p].x);
      snprintf(what, sizeof what, "add_rms_norm %s/%s cfg %d", dname(PAIRS[p].x), dname(PAIRS[p].g), c);
      compare_variants(out, 3, tols, what);
      CHECK(g_fake.calls[1] == fake0 + 1, "%s: the fake NPU ran once", what);
      {
        /* In place: x_sum over x1 (the residual stream), no rstd. */
        buf res = bclone(x1), y2 = balloc(PAIRS[p].x, n);
        npk_tensor rest = btens(res, cf->xnd, cf->xs), y2t = btens(y2, cf->xnd, cf->xs);
        npk_status s = run_add_rms_norm(&rest, &x2t, &gt, op, &y2t, NULL, &rest, &g_execs[V_POOL]);
        CHECK(s == NPK_OK, "%s in place: status %d", what, (int)s);
        CHECK(bsame(res, out[V_CPU][2]) && bsame(y2, out[V_CPU][0]), "%s: in place differs", what);
        bfree(&res);
        bfree(&y2);
      }
      for (v = 0; v < NV; v++)
        for (k = 0; k < 3; k++) bfree(&out[v][k]);
      bfree(&x1);
      bfree(&x2);
      bfree(&g);
    }
  }
}

static void test_rms_norm_grad(void) {
  int p, c, v, k;
  for (c = 0; c < 3; c++) {
    const norm_cfg *cf = &NCFG[c];
    size_t n = numel(cf->xnd, cf->xs), cols = numel(cf->gnd, cf->gs), rows = n / cols;
    /* cfg 1: dres, accumulate into dgamma, Gemma offset; others: dgamma_cast. */
    npk_rms_norm_grad_options o = {1.0f, 1};
    const npk_rms_norm_grad_options *op = cf->opts ? &o : NULL;
    int with_dres = cf->opts, with_cast = !cf->opts;
    setup_execs(cf->blocks, cf->ub);
    for (p = 0; p < 5; p++) {
      buf dy = balloc(PAIRS[p].x, n), x = balloc(PAIRS[p].x, n), r = balloc(NPK_F32, rows),
          g = balloc(PAIRS[p].g, cols), dres = balloc(PAIRS[p].x, n), out[NV][4];
      npk_tensor dyt, xt, rt, gt, drt;
      double tols[3];
      char what[64];
      int fake0 = g_fake.calls[2];
      bfill_rand(dy, -1, 1);
      bfill_rand(x, -3, 3);
      bfill_rand(r, 0.5, 1.5);
      bfill_rand(g, 0.5, 1.5);
      bfill_rand(dres, -1, 1);
      dyt = btens(dy, cf->xnd, cf->xs);
      xt = btens(x, cf->xnd, cf->xs);
      rt = tens(r.p, NPK_F32, 1, DIMS((int64_t)rows));
      gt = btens(g, cf->gnd, cf->gs);
      drt = btens(dres, cf->xnd, cf->xs);
      for (v = 0; v < NV; v++) {
        npk_tensor dxt, dgt, dct;
        npk_status s;
        out[v][0] = balloc(PAIRS[p].x, n);
        out[v][1] = balloc(NPK_F32, cols);
        out[v][2] = balloc(PAIRS[p].g, cols);
        bfill(out[v][1], 0.5); /* accumulated into under cfg 1 */
        dxt = btens(out[v][0], cf->xnd, cf->xs);
        dgt = btens(out[v][1], cf->gnd, cf->gs);
        dct = btens(out[v][2], cf->gnd, cf->gs);
        s = run_grad(&dyt, &xt, &rt, &gt, with_dres ? &drt : NULL, op, &dxt, &dgt, with_cast ? &dct : NULL,
                     vexec(v));
        CHECK(s == NPK_OK, "rms_norm_grad %s/%s cfg %d %s: status %d", dname(PAIRS[p].x), dname(PAIRS[p].g), c,
              VNAME[v], (int)s);
        if (v == V_FAKE) check_norm_plan(&g_fake.norm_plan, rows, cols, cf->blocks);
      }
      tols[0] = tol_of(PAIRS[p].x) * 2;
      tols[1] = -2e-4; /* dgamma: per-block partials, so NULL exec (64 blocks) only within tolerance */
      tols[2] = -tol_of(PAIRS[p].g) * 2;
      snprintf(what, sizeof what, "rms_norm_grad %s/%s cfg %d", dname(PAIRS[p].x), dname(PAIRS[p].g), c);
      compare_variants(out, 3, tols, what);
      CHECK(g_fake.calls[2] == fake0 + 1, "%s: the fake NPU ran once", what);
      {
        /* In place: dx over dy. */
        buf d = bclone(dy), dg = balloc(NPK_F32, cols);
        npk_tensor dt = btens(d, cf->xnd, cf->xs), dgt = btens(dg, cf->gnd, cf->gs);
        npk_status s;
        bfill(dg, 0.5);
        s = run_grad(&dt, &xt, &rt, &gt, with_dres ? &drt : NULL, op, &dt, &dgt, NULL, &g_execs[V_CPU]);
        CHECK(s == NPK_OK, "%s in place: status %d", what, (int)s);
        CHECK(bsame(d, out[V_CPU][0]) && bsame(dg, out[V_CPU][1]), "%s: in place differs", what);
        bfree(&d);
        bfree(&dg);
      }
      for (v = 0; v < NV; v++)
        for (k = 0; k < 3; k++) bfree(&out[v][k]);
      bfree(&dy);
      bfree(&x);
      bfree(&r);
      bfree(&g);
      bfree(&dres);
    }
  }
}

typedef struct {
  uint32_t gnd;
  int64_t gs[3];
  uint64_t nw;
  int64_t idx_lo, idx_hi;
  npk_embedding_grad_options o;
  uint32_t blocks;
  uint64_t ub;
} emb_cfg;

static const emb_cfg ECFG[4] = {
    {3, {4, 6, 24}, 10, 0, 10, {3, 0, 0, NPK_INDEX_ERROR, 0}, 3, 0},       /* padding_idx 3 */
    {2, {30, 16}, 8, 0, 8, {-1, 1, 0, NPK_INDEX_ERROR, 1}, 0, 0},          /* scale by freq, accumulate */
    {2, {20, 8}, 4, 0, 12, {-1, 0, 5, NPK_INDEX_IGNORE, 0}, 2, 0},         /* a shard: rows 5..8 */
    {2, {10, 300}, 7, 0, 7, {-1, 0, 0, NPK_INDEX_ERROR, 0}, 0, 1024},      /* split-D */
};

static void test_embedding(void) {
  static const npk_dtype G[3] = {NPK_F32, NPK_F16, NPK_BF16};
  static const npk_dtype I[2] = {NPK_I32, NPK_I64};
  int c, gi, ii, oi, v;
  for (c = 0; c < 4; c++) {
    const emb_cfg *cf = &ECFG[c];
    size_t n = numel(cf->gnd, cf->gs), h = (size_t)cf->gs[cf->gnd - 1], pos = n / h;
    setup_execs(cf->blocks, cf->ub);
    for (gi = 0; gi < 3; gi++)
      for (ii = 0; ii < 2; ii++)
        for (oi = 0; oi < 2; oi++) {
          npk_dtype od = oi ? NPK_F32 : G[gi];
          buf grad, idx, out[NV][4];
          npk_tensor gt, it;
          double tols[1];
          char what[64];
          size_t i;
          int fake0 = g_fake.calls[3];
          if (oi && G[gi] == NPK_F32) continue; /* f32 grad: out f32 is its own dtype */
          grad = balloc(G[gi], n);
          idx = balloc(I[ii], pos);
          bfill_rand(grad, -2, 2);
          for (i = 0; i < pos; i++) put(idx.p, I[ii], i, (double)(int64_t)urand((double)cf->idx_lo, (double)cf->idx_hi));
          gt = btens(grad, cf->gnd, cf->gs);
          it = tens(idx.p, I[ii], cf->gnd - 1, cf->gs);
          for (v = 0; v < NV; v++) {
            npk_tensor ot;
            npk_status s;
            out[v][0] = balloc(od, (size_t)cf->nw * h);
            bfill(out[v][0], 0.25); /* accumulated into under cfg 1, overwritten otherwise */
            ot = tens(out[v][0].p, od, 2, DIMS((int64_t)cf->nw, (int64_t)h));
            s = run_emb(&gt, &it, cf->nw, &cf->o, &ot, vexec(v));
            CHECK(s == NPK_OK, "embedding %s/%s->%s cfg %d %s: status %d", dname(G[gi]), dname(I[ii]), dname(od), c,
                  VNAME[v], (int)s);
            if (v == V_FAKE) {
              CHECK(g_fake.emb_plan.positions == pos && g_fake.emb_plan.cols == h && g_fake.emb_plan.num_weights == cf->nw,
                    "embedding plan %llu/%llu/%llu", (unsigned long long)g_fake.emb_plan.positions,
                    (unsigned long long)g_fake.emb_plan.cols, (unsigned long long)g_fake.emb_plan.num_weights);
              CHECK(g_fake.ws == g_last_ws && g_fake.ws_bytes == g_last_ws_bytes, "embedding workspace handed on");
            }
          }
          tols[0] = tol_of(od);
          snprintf(what, sizeof what, "embedding %s/%s->%s cfg %d", dname(G[gi]), dname(I[ii]), dname(od), c);
          compare_variants(out, 1, tols, what);
          CHECK(g_fake.calls[3] == fake0 + 1, "%s: the fake NPU ran once", what);
          if (cf->o.padding_idx >= 0) {
            for (i = 0; i < h; i++)
              if (get(out[V_CPU][0].p, od, (size_t)cf->o.padding_idx * h + i) != 0.0) break;
            CHECK(i == h, "%s: the padding row is zero", what);
          }
          for (v = 0; v < NV; v++) bfree(&out[v][0]);
          bfree(&grad);
          bfree(&idx);
        }
  }
}

/* ======================= errors ======================= */

static npk_error_detail g_detail;
static npk_exec E; /* serial CPU with a detail */

static void expect_err_(npk_status got, npk_status want, const char *arg, int line) {
  CHECK(got == want, "line %d: status %d, want %d (%s: %.160s)", line, (int)got, (int)want, g_detail.argument,
        g_detail.message);
  CHECK(g_detail.status == want, "line %d: detail.status %d", line, (int)g_detail.status);
  CHECK(memchr(g_detail.argument, 0, sizeof g_detail.argument) && strcmp(g_detail.argument, arg) == 0,
        "line %d: detail.argument '%.32s', want '%s'", line, g_detail.argument, arg);
  CHECK(memchr(g_detail.message, 0, sizeof g_detail.message) && g_detail.message[0] != 0,
        "line %d: detail.message is a NUL-terminated sentence", line);
  if (want != NPK_ERR_INDEX_OUT_OF_RANGE && want != NPK_ERR_BACKEND)
    CHECK(g_detail.position == -1 && g_detail.value == -1, "line %d: position/value -1", line);
  /* Poison it: the next call must fill it again. */
  memset(&g_detail, 0x5a, sizeof g_detail);
}
#define EXPECT_ERR(call, want, arg) expect_err_((call), (want), (arg), __LINE__)

/* Output bytes before an error call; they must be equal after it. */
typedef struct {
  buf *b[4];
  buf saved[4];
  int n;
} guard;

static guard guard_of(buf *a, buf *b, buf *c) {
  guard g;
  buf *all[3];
  int i;
  all[0] = a;
  all[1] = b;
  all[2] = c;
  g.n = 0;
  for (i = 0; i < 3; i++)
    if (all[i]) {
      memset(all[i]->p, 0xab, all[i]->n * dsize(all[i]->dt));
      g.b[g.n] = all[i];
      g.saved[g.n] = bclone(*all[i]);
      g.n++;
    }
  return g;
}

static void guard_check(guard *g, int line) {
  int i;
  for (i = 0; i < g->n; i++) CHECK(bsame(*g->b[i], g->saved[i]), "line %d: an output changed on error", line);
}

static void guard_free(guard *g) {
  int i;
  for (i = 0; i < g->n; i++) bfree(&g->saved[i]);
}

static void test_errors_rms_norm(void) {
  buf x = balloc(NPK_F32, 64), g = balloc(NPK_F32, 16), y = balloc(NPK_F32, 64), r = balloc(NPK_F32, 4);
  buf xh = balloc(NPK_F16, 64), gb = balloc(NPK_BF16, 16), yi = balloc(NPK_I32, 64);
  npk_tensor xt = btens(x, 2, DIMS(4, 16)), gt = btens(g, 1, DIMS(16)), yt = btens(y, 2, DIMS(4, 16)),
             rt = btens(r, 1, DIMS(4)), t;
  npk_rms_norm_options o = {1e-6, 0.0f, NPK_ROUNDING_FUSED};
  size_t ws = 0, sentinel = 12345, got;
  unsigned char *wsm;
  guard gd;
  npk_exec e;
  npk_isa isa;
  bfill_rand(x, -1, 1);
  bfill_rand(g, 0.5, 1.5);
  CHECK(npk_rms_norm_workspace_size(&xt, &gt, NULL, &E, &ws) == NPK_OK && ws > 0, "size call");
  CHECK(g_detail.status == NPK_OK && g_detail.argument[0] == 0 && g_detail.position == -1,
        "the detail is reset on success");
  wsm = (unsigned char *)malloc(ws);
  gd = guard_of(&y, &r, NULL);

  /* NULL pointers; the size output stays untouched on error. */
  got = sentinel;
  EXPECT_ERR(npk_rms_norm_workspace_size(NULL, &gt, NULL, &E, &got), NPK_ERR_NULLPTR, "x");
  CHECK(got == sentinel, "workspace_bytes untouched on error");
  EXPECT_ERR(npk_rms_norm_workspace_size(&xt, NULL, NULL, &E, &got), NPK_ERR_NULLPTR, "gamma");
  EXPECT_ERR(npk_rms_norm_workspace_size(&xt, &gt, NULL, &E, NULL), NPK_ERR_NULLPTR, "workspace_bytes");
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, NULL, &rt, wsm, ws, &E), NPK_ERR_NULLPTR, "y");
  t = xt;
  t.data = NULL;
  EXPECT_ERR(npk_rms_norm(&t, &gt, NULL, &yt, &rt, wsm, ws, &E), NPK_ERR_NULLPTR, "x");
  e = E;
  e.backend = NPK_BACKEND_FOREIGN;
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, wsm, ws, &e), NPK_ERR_NULLPTR, "foreign");

  /* Rank, shapes, sizes. */
  t = xt;
  t.ndim = 0;
  EXPECT_ERR(npk_rms_norm(&t, &gt, NULL, &yt, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "x");
  t.ndim = 9;
  EXPECT_ERR(npk_rms_norm(&t, &gt, NULL, &yt, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "x");
  EXPECT_ERR(npk_rms_norm_workspace_size(&t, &gt, NULL, &E, &got), NPK_ERR_PARAM_INVALID, "x");
  t = xt;
  t.shape[0] = -4;
  EXPECT_ERR(npk_rms_norm(&t, &gt, NULL, &yt, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "x");
  t = tens(x.p, NPK_F32, 1, DIMS((int64_t)1 << 62)); /* 2^62 elements x 4 bytes */
  EXPECT_ERR(npk_rms_norm_workspace_size(&t, &gt, NULL, &E, &got), NPK_ERR_SIZE_OVERFLOW, "x");
  t = tens(x.p, NPK_F32, 2, DIMS((int64_t)1 << 62, 16)); /* the element count itself overflows */
  EXPECT_ERR(npk_rms_norm(&t, &gt, NULL, &yt, &rt, wsm, ws, &E), NPK_ERR_SIZE_OVERFLOW, "x");
  t = tens(g.p, NPK_F32, 1, DIMS(15));
  EXPECT_ERR(npk_rms_norm(&xt, &t, NULL, &yt, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "gamma");
  t = tens(y.p, NPK_F32, 2, DIMS(4, 15));
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &t, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "y");
  t = tens(r.p, NPK_F32, 1, DIMS(3));
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &t, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "rstd");

  /* Dtypes: pairs the operator does not take, and values that are no dtype. */
  {
    npk_tensor xht = btens(xh, 2, DIMS(4, 16)), gbt = btens(gb, 1, DIMS(16));
    EXPECT_ERR(npk_rms_norm_workspace_size(&xht, &gbt, NULL, &E, &got), NPK_ERR_DTYPE_UNSUPPORTED, "gamma");
    t = btens(yi, 2, DIMS(4, 16));
    EXPECT_ERR(npk_rms_norm_workspace_size(&t, &gt, NULL, &E, &got), NPK_ERR_DTYPE_UNSUPPORTED, "x");
    EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &t, &rt, wsm, ws, &E), NPK_ERR_DTYPE_UNSUPPORTED, "y");
    t = xt;
    SET_RAW(t.dtype, 99u); /* what a C caller can store in an enum field */
    EXPECT_ERR(npk_rms_norm(&t, &gt, NULL, &yt, &rt, wsm, ws, &E), NPK_ERR_DTYPE_UNSUPPORTED, "x");
    t = tens(xh.p, NPK_BF16, 1, DIMS(4));
    EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &t, wsm, ws, &E), NPK_ERR_DTYPE_UNSUPPORTED, "rstd");
  }

  /* Options. */
  o.eps = -1.0;
  EXPECT_ERR(npk_rms_norm(&xt, &gt, &o, &yt, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "eps");
  o.eps = NAN;
  EXPECT_ERR(npk_rms_norm(&xt, &gt, &o, &yt, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "eps");
  o.eps = 1e-6;
  o.gamma_offset = INFINITY;
  EXPECT_ERR(npk_rms_norm(&xt, &gt, &o, &yt, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "gamma_offset");
  o.gamma_offset = 0.0f;
  SET_RAW(o.rounding, 7u);
  EXPECT_ERR(npk_rms_norm(&xt, &gt, &o, &yt, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "rounding");
  o.rounding = NPK_ROUNDING_FUSED;

  /* Workspace. */
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, NULL, ws, &E), NPK_ERR_NULLPTR, "workspace");
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, wsm, ws - 1, &E), NPK_ERR_WORKSPACE_TOO_SMALL, "workspace");
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, NULL, 0, &E), NPK_ERR_WORKSPACE_TOO_SMALL, "workspace");

  /* Overlaps and alignment. */
  t = tens(x.p, NPK_F32, 2, DIMS(4, 16));
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &t, &rt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "y");
  t = tens((char *)y.p + 8, NPK_F32, 1, DIMS(4));
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &t, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "rstd");
  t = tens((char *)xh.p + 1, NPK_F32, 1, DIMS(4));
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &t, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "rstd");

  /* The exec: invalid enum values, tiling, forced ISA, foreign failure. */
  e = E;
  SET_RAW(e.isa, 42u);
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, wsm, ws, &e), NPK_ERR_PARAM_INVALID, "isa");
  e = E;
  SET_RAW(e.backend, 9u);
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, wsm, ws, &e), NPK_ERR_PARAM_INVALID, "backend");
  e = E;
  e.ub_bytes = 100;
  EXPECT_ERR(npk_rms_norm_workspace_size(&xt, &gt, NULL, &e, &got), NPK_ERR_PARAM_INVALID, "ub_bytes");
  {
    int exercised = 0;
    for (isa = NPK_ISA_PORTABLE; isa <= NPK_ISA_NEON_BF16; isa = (npk_isa)(isa + 1)) {
      npk_status s;
      guard_free(&gd);
      gd = guard_of(&y, &r, NULL); /* a successful run below writes them */
      e = E;
      e.isa = isa;
      s = npk_rms_norm(&xt, &gt, NULL, &yt, &rt, wsm, ws, &e);
      if ((int)isa > (int)npk_detected_isa()) {
        /* Auto picks the best available, so anything above it is unavailable. */
        expect_err_(s, NPK_ERR_ISA_UNAVAILABLE, "isa", __LINE__);
        exercised = 1;
      } else {
        CHECK(s == NPK_OK || s == NPK_ERR_ISA_UNAVAILABLE, "forced isa %d: %d", (int)isa, (int)s);
        memset(&g_detail, 0x5a, sizeof g_detail);
      }
      if (s != NPK_OK) guard_check(&gd, __LINE__);
    }
    if (!exercised) {
      /* run.sh also runs this program under NPK_MAX_CPU_ISA=portable, which
       * sets NPK_REQUIRE_ISA_UNAVAILABLE so the path cannot go unexercised. */
      const char *req = getenv("NPK_REQUIRE_ISA_UNAVAILABLE");
      CHECK(!(req && strcmp(req, "1") == 0), "%s", "NPK_ERR_ISA_UNAVAILABLE was not exercised");
      printf("note: every ISA is available here; NPK_ERR_ISA_UNAVAILABLE not exercised in this run\n");
    }
    /* Restore the guarded outputs' sentinel after the successful runs. */
    guard_free(&gd);
    gd = guard_of(&y, &r, NULL);
  }
  e = E;
  e.backend = NPK_BACKEND_FOREIGN;
  e.foreign = &g_fake_table;
  g_fake.fail_code = 777;
  g_fake.ref = mk_exec(NPK_BACKEND_REFERENCE, 0, 0);
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, wsm, ws, &e), NPK_ERR_BACKEND, "backend");
  g_fake.fail_code = 777;
  npk_rms_norm(&xt, &gt, NULL, &yt, &rt, wsm, ws, &e);
  CHECK(g_detail.value == 777 && g_detail.position == -1, "the adapter's code is in detail.value: %lld",
        (long long)g_detail.value);
  g_fake.fail_code = 0;
  guard_check(&gd, __LINE__);

  /* A runner that breaks its contract is reported, not trusted. */
  e = E;
  e.parallel_for = skipping_parallel_for;
  e.blocks = 4;
  EXPECT_ERR(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, wsm, ws, &e), NPK_ERR_BACKEND, "parallel_for");

  /* Empty tensors: data may be NULL, and the workspace too when its size is 0. */
  {
    npk_tensor ex = tens(NULL, NPK_F32, 2, DIMS(0, 16)), ey = tens(NULL, NPK_F32, 2, DIMS(0, 16));
    got = sentinel;
    CHECK(npk_rms_norm_workspace_size(&ex, &gt, NULL, &E, &got) == NPK_OK && got == 0, "empty size %zu", got);
    CHECK(npk_rms_norm(&ex, &gt, NULL, &ey, NULL, NULL, 0, &E) == NPK_OK, "empty run");
  }

  /* Extreme tiling fields are a plan like any other, not an overflow. */
  {
    buf y2 = balloc(NPK_F32, 64), y3 = balloc(NPK_F32, 64);
    npk_tensor y2t = btens(y2, 2, DIMS(4, 16)), y3t = btens(y3, 2, DIMS(4, 16));
    e = E;
    e.ub_bytes = UINT64_MAX;
    e.blocks = UINT32_MAX;
    CHECK(run_rms_norm(&xt, &gt, NULL, &y2t, NULL, &e) == NPK_OK, "ub_bytes and blocks at their maximum: %s",
          g_detail.message);
    CHECK(run_rms_norm(&xt, &gt, NULL, &y3t, NULL, &E) == NPK_OK, "default tiling");
    CHECK(bsame(y2, y3), "%s", "results do not depend on the tiling");
    bfree(&y2);
    bfree(&y3);
  }

  guard_free(&gd);
  free(wsm);
  bfree(&x);
  bfree(&g);
  bfree(&y);
  bfree(&r);
  bfree(&xh);
  bfree(&gb);
  bfree(&yi);
}

static void test_errors_add_rms_norm(void) {
  buf x1 = balloc(NPK_BF16, 49), x2 = balloc(NPK_BF16, 48), g = balloc(NPK_BF16, 16), y = balloc(NPK_BF16, 48),
      s = balloc(NPK_BF16, 48), xf = balloc(NPK_F32, 48);
  npk_tensor x1t = btens(x1, 2, DIMS(3, 16)), x2t = btens(x2, 2, DIMS(3, 16)), gt = btens(g, 1, DIMS(16)),
             yt = btens(y, 2, DIMS(3, 16)), st = btens(s, 2, DIMS(3, 16)), t;
  size_t ws = 0;
  unsigned char *wsm;
  guard gd;
  bfill_rand(x1, -1, 1);
  bfill_rand(x2, -1, 1);
  bfill_rand(g, 0.5, 1.5);
  CHECK(npk_add_rms_norm_workspace_size(&x1t, &x2t, &gt, NULL, &E, &ws) == NPK_OK, "size call");
  wsm = (unsigned char *)malloc(ws);
  gd = guard_of(&y, &s, NULL);
  EXPECT_ERR(npk_add_rms_norm(&x1t, NULL, &gt, NULL, &yt, NULL, &st, wsm, ws, &E), NPK_ERR_NULLPTR, "x2");
  t = tens(x2.p, NPK_BF16, 2, DIMS(16, 3));
  EXPECT_ERR(npk_add_rms_norm(&x1t, &t, &gt, NULL, &yt, NULL, &st, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "x2");
  t = btens(xf, 2, DIMS(3, 16));
  EXPECT_ERR(npk_add_rms_norm(&x1t, &t, &gt, NULL, &yt, NULL, &st, wsm, ws, &E), NPK_ERR_DTYPE_UNSUPPORTED, "x2");
  t = tens((char *)x1.p + 2, NPK_BF16, 2, DIMS(3, 16)); /* x_sum one element into x1: not in place */
  EXPECT_ERR(npk_add_rms_norm(&x1t, &x2t, &gt, NULL, &yt, NULL, &t, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "x_sum");
  EXPECT_ERR(npk_add_rms_norm(&x1t, &x2t, &gt, NULL, &yt, NULL, &x2t, wsm, ws, &E), NPK_ERR_PARAM_INVALID,
             "x_sum");
  EXPECT_ERR(npk_add_rms_norm(&x1t, &x2t, &gt, NULL, &yt, NULL, &yt, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "x_sum");
  t = tens(y.p, NPK_F32, 1, DIMS(3));
  EXPECT_ERR(npk_add_rms_norm(&x1t, &x2t, &gt, NULL, &yt, &t, &st, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "rstd");
  EXPECT_ERR(npk_add_rms_norm(&x1t, &x2t, &gt, NULL, &yt, NULL, &st, wsm, 1, &E), NPK_ERR_WORKSPACE_TOO_SMALL,
             "workspace");
  guard_check(&gd, __LINE__);
  /* In place over x1 is the one allowed overlap. */
  CHECK(npk_add_rms_norm(&x1t, &x2t, &gt, NULL, &yt, NULL, &x1t, wsm, ws, &E) == NPK_OK, "x_sum in place");
  guard_free(&gd);
  free(wsm);
  bfree(&x1);
  bfree(&x2);
  bfree(&g);
  bfree(&y);
  bfree(&s);
  bfree(&xf);
}

static void test_errors_grad(void) {
  buf dy = balloc(NPK_F16, 32), x = balloc(NPK_F16, 32), r = balloc(NPK_F32, 4), g = balloc(NPK_F32, 8),
      dx = balloc(NPK_F16, 32), dg = balloc(NPK_F32, 8), dgh = balloc(NPK_F16, 8);
  npk_tensor dyt = btens(dy, 2, DIMS(4, 8)), xt = btens(x, 2, DIMS(4, 8)), rt = btens(r, 1, DIMS(4)),
             gt = btens(g, 1, DIMS(8)), dxt = btens(dx, 2, DIMS(4, 8)), dgt = btens(dg, 1, DIMS(8)), t;
  npk_rms_norm_grad_options acc = {0.0f, 1};
  size_t ws = 0;
  unsigned char *wsm;
  guard gd;
  bfill_rand(dy, -1, 1);
  bfill_rand(x, -1, 1);
  bfill_rand(r, 0.5, 1.5);
  bfill_rand(g, 0.5, 1.5);
  CHECK(npk_rms_norm_grad_workspace_size(&dyt, &xt, &rt, &gt, NULL, &E, &ws) == NPK_OK, "size call");
  wsm = (unsigned char *)malloc(ws);
  gd = guard_of(&dx, &dg, &dgh);
  EXPECT_ERR(npk_rms_norm_grad_workspace_size(&dyt, &xt, NULL, &gt, NULL, &E, &ws), NPK_ERR_NULLPTR, "rstd");
  t = tens(r.p, NPK_F32, 1, DIMS(3));
  EXPECT_ERR(npk_rms_norm_grad(&dyt, &xt, &t, &gt, NULL, NULL, &dxt, &dgt, NULL, wsm, ws, &E),
             NPK_ERR_PARAM_INVALID, "rstd");
  t = tens(dy.p, NPK_F16, 2, DIMS(8, 4));
  EXPECT_ERR(npk_rms_norm_grad(&t, &xt, &rt, &gt, NULL, NULL, &dxt, &dgt, NULL, wsm, ws, &E),
             NPK_ERR_PARAM_INVALID, "dy");
  EXPECT_ERR(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &xt, &dgt, NULL, wsm, ws, &E),
             NPK_ERR_PARAM_INVALID, "dx");
  t = btens(dgh, 1, DIMS(8));
  EXPECT_ERR(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &dxt, &t, NULL, wsm, ws, &E),
             NPK_ERR_DTYPE_UNSUPPORTED, "dgamma");
  t = tens(dg.p, NPK_F32, 1, DIMS(4));
  EXPECT_ERR(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &dxt, &t, NULL, wsm, ws, &E),
             NPK_ERR_PARAM_INVALID, "dgamma");
  t = tens(dx.p, NPK_F32, 1, DIMS(8)); /* dgamma inside dx */
  EXPECT_ERR(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &dxt, &t, NULL, wsm, ws, &E),
             NPK_ERR_PARAM_INVALID, "dgamma");
  EXPECT_ERR(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, &acc, &dxt, NULL, NULL, wsm, ws, &E),
             NPK_ERR_PARAM_INVALID, "dgamma");
  t = btens(dgh, 1, DIMS(8)); /* gamma is f32, so dgamma_cast must be too */
  EXPECT_ERR(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &dxt, &dgt, &t, wsm, ws, &E),
             NPK_ERR_DTYPE_UNSUPPORTED, "dgamma_cast");
  /* dres is dx's buffer: dx would overwrite an input. */
  EXPECT_ERR(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, &dxt, NULL, &dxt, &dgt, NULL, wsm, ws, &E),
             NPK_ERR_PARAM_INVALID, "dx");
  EXPECT_ERR(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &dxt, &dgt, NULL, wsm, ws - 1, &E),
             NPK_ERR_WORKSPACE_TOO_SMALL, "workspace");
  guard_check(&gd, __LINE__);
  {
    npk_exec big = E;
    big.ub_bytes = UINT64_MAX;
    big.blocks = UINT32_MAX;
    CHECK(run_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &dxt, &dgt, NULL, &big) == NPK_OK,
          "rms_norm_grad with extreme tiling: %s", g_detail.message);
    guard_free(&gd);
    gd = guard_of(&dx, &dg, &dgh);
  }
  /* dx == dy is the other allowed overlap. */
  CHECK(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &dyt, &dgt, NULL, wsm, ws, &E) == NPK_OK, "dx in place");
  guard_free(&gd);
  free(wsm);
  bfree(&dy);
  bfree(&x);
  bfree(&r);
  bfree(&g);
  bfree(&dx);
  bfree(&dg);
  bfree(&dgh);
}

static void test_errors_embedding(void) {
  buf grad = balloc(NPK_F16, 10 * 8), idx = balloc(NPK_I64, 6), out = balloc(NPK_F32, 10 * 8),
      outb = balloc(NPK_BF16, 10 * 8), gi = balloc(NPK_I32, 48), fi = balloc(NPK_F32, 6);
  npk_tensor gt = btens(grad, 2, DIMS(6, 8)), it = btens(idx, 1, DIMS(6)), ot = btens(out, 2, DIMS(10, 8)), t;
  npk_embedding_grad_options o = {-1, 0, 0, NPK_INDEX_ERROR, 0};
  static const int64_t ids[6] = {0, 1, 12, -3, 4, 5};
  size_t ws = 0, i;
  unsigned char *wsm;
  guard gd;
  bfill_rand(grad, -1, 1);
  for (i = 0; i < 6; i++) ((int64_t *)idx.p)[i] = ids[i];
  CHECK(npk_embedding_dense_grad_workspace_size(&gt, &it, 10, NULL, &E, &ws) == NPK_OK, "size call");
  wsm = (unsigned char *)malloc(ws + 1);
  gd = guard_of(&out, &outb, NULL);
  EXPECT_ERR(npk_embedding_dense_grad(&gt, &it, 10, NULL, &ot, wsm, ws, &E), NPK_ERR_INDEX_OUT_OF_RANGE, "indices");
  npk_embedding_dense_grad(&gt, &it, 10, NULL, &ot, wsm, ws, &E);
  CHECK(g_detail.position == 2 && g_detail.value == 12, "first bad index: position %lld value %lld",
        (long long)g_detail.position, (long long)g_detail.value);
  ((int64_t *)idx.p)[2] = 2;
  npk_embedding_dense_grad(&gt, &it, 10, NULL, &ot, wsm, ws, &E);
  CHECK(g_detail.status == NPK_ERR_INDEX_OUT_OF_RANGE && g_detail.position == 3 && g_detail.value == -3,
        "negative index: position %lld value %lld", (long long)g_detail.position, (long long)g_detail.value);
  guard_check(&gd, __LINE__);
  SET_RAW(o.out_of_range, 5u);
  EXPECT_ERR(npk_embedding_dense_grad(&gt, &it, 10, &o, &ot, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "out_of_range");
  o.out_of_range = NPK_INDEX_ERROR;
  o.vocab_start = -1;
  EXPECT_ERR(npk_embedding_dense_grad_workspace_size(&gt, &it, 10, &o, &E, &ws), NPK_ERR_PARAM_INVALID,
             "vocab_start");
  o.vocab_start = 0;
  EXPECT_ERR(npk_embedding_dense_grad_workspace_size(&gt, &it, (uint64_t)1 << 63, NULL, &E, &ws),
             NPK_ERR_SIZE_OVERFLOW, "num_weights");
  EXPECT_ERR(npk_embedding_dense_grad_workspace_size(&gt, NULL, 10, NULL, &E, &ws), NPK_ERR_NULLPTR, "indices");
  t = btens(gi, 2, DIMS(6, 8));
  EXPECT_ERR(npk_embedding_dense_grad_workspace_size(&t, &it, 10, NULL, &E, &ws), NPK_ERR_DTYPE_UNSUPPORTED,
             "grad");
  t = btens(fi, 1, DIMS(6));
  EXPECT_ERR(npk_embedding_dense_grad_workspace_size(&gt, &t, 10, NULL, &E, &ws), NPK_ERR_DTYPE_UNSUPPORTED,
             "indices");
  t = tens(idx.p, NPK_I64, 1, DIMS(5));
  EXPECT_ERR(npk_embedding_dense_grad_workspace_size(&gt, &t, 10, NULL, &E, &ws), NPK_ERR_PARAM_INVALID, "indices");
  o.out_of_range = NPK_INDEX_IGNORE; /* from here on the index values are fine */
  t = btens(outb, 2, DIMS(10, 8));  /* bf16 out for f16 grad */
  EXPECT_ERR(npk_embedding_dense_grad(&gt, &it, 10, &o, &t, wsm, ws, &E), NPK_ERR_DTYPE_UNSUPPORTED, "out");
  t = tens(out.p, NPK_F32, 2, DIMS(8, 10));
  EXPECT_ERR(npk_embedding_dense_grad(&gt, &it, 10, &o, &t, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "out");
  t = tens(grad.p, NPK_F16, 2, DIMS(10, 8));
  EXPECT_ERR(npk_embedding_dense_grad(&gt, &it, 10, &o, &t, wsm, ws, &E), NPK_ERR_PARAM_INVALID, "out");
  if (ws > 0) {
    EXPECT_ERR(npk_embedding_dense_grad(&gt, &it, 10, &o, &ot, wsm, ws - 1, &E), NPK_ERR_WORKSPACE_TOO_SMALL,
               "workspace");
    EXPECT_ERR(npk_embedding_dense_grad(&gt, &it, 10, &o, &ot, NULL, ws, &E), NPK_ERR_NULLPTR, "workspace");
  }
  guard_check(&gd, __LINE__);
  /* Ignore: the bad index is skipped. Unaligned workspace is fine. */
  CHECK(npk_embedding_dense_grad(&gt, &it, 10, &o, &ot, wsm + 1, ws, &E) == NPK_OK, "ignore policy");
  {
    npk_exec big = E;
    big.ub_bytes = UINT64_MAX;
    big.blocks = UINT32_MAX;
    CHECK(run_emb(&gt, &it, 10, &o, &ot, &big) == NPK_OK, "embedding with extreme tiling: %s", g_detail.message);
  }
  guard_free(&gd);
  free(wsm);
  bfree(&grad);
  bfree(&idx);
  bfree(&out);
  bfree(&outb);
  bfree(&gi);
  bfree(&fi);
}

/* ======================= misc ======================= */

static atomic_int g_hits[1000];

static void count_task(void *ctx, size_t b) {
  (void)ctx;
  atomic_fetch_add(&g_hits[b], 1);
}

static void nested_task(void *ctx, size_t b) {
  /* A task that itself uses the pool: must not deadlock. */
  uint32_t two = 2;
  (void)b;
  npk_threads_parallel_for(&two, 10, count_task, ctx);
}

static void *pool_from_thread(void *arg) {
  npk_threads_parallel_for(NULL, 1000, count_task, arg);
  return NULL;
}

static void test_pool(void) {
  uint32_t counts[4] = {0, 1, 3, 64};
  int i, k, ok;
  pthread_t t1, t2;
  for (k = 0; k < 5; k++) {
    for (i = 0; i < 1000; i++) atomic_store(&g_hits[i], 0);
    npk_threads_parallel_for(k < 4 ? &counts[k] : NULL, 1000, count_task, NULL);
    for (ok = 1, i = 0; i < 1000; i++) ok &= atomic_load(&g_hits[i]) == 1;
    CHECK(ok, "pool: every block exactly once (threads %d)", k < 4 ? (int)counts[k] : -1);
  }
  npk_threads_parallel_for(NULL, 0, count_task, NULL);
  npk_threads_parallel_for(NULL, 5, NULL, NULL);
  /* Two host threads at once: one gets the pool, the other runs serially. */
  for (i = 0; i < 1000; i++) atomic_store(&g_hits[i], 0);
  pthread_create(&t1, NULL, pool_from_thread, NULL);
  pthread_create(&t2, NULL, pool_from_thread, NULL);
  pthread_join(t1, NULL);
  pthread_join(t2, NULL);
  for (ok = 1, i = 0; i < 1000; i++) ok &= atomic_load(&g_hits[i]) == 2;
  CHECK(ok, "pool: two concurrent callers");
  for (i = 0; i < 1000; i++) atomic_store(&g_hits[i], 0);
  npk_threads_parallel_for(NULL, 8, nested_task, NULL);
  for (ok = 1, i = 0; i < 10; i++) ok &= atomic_load(&g_hits[i]) == 8;
  CHECK(ok, "pool: nested calls");
}

static void test_misc(void) {
  static const npk_status all[] = {NPK_OK,
                                   NPK_ERR_NULLPTR,
                                   NPK_ERR_PARAM_INVALID,
                                   NPK_ERR_DTYPE_UNSUPPORTED,
                                   NPK_ERR_INDEX_OUT_OF_RANGE,
                                   NPK_ERR_WORKSPACE_TOO_SMALL,
                                   NPK_ERR_SIZE_OVERFLOW,
                                   NPK_ERR_ISA_UNAVAILABLE,
                                   NPK_ERR_NONFINITE,
                                   NPK_ERR_BACKEND};
  static const char *names[] = {"NPK_OK",
                                "NPK_ERR_NULLPTR",
                                "NPK_ERR_PARAM_INVALID",
                                "NPK_ERR_DTYPE_UNSUPPORTED",
                                "NPK_ERR_INDEX_OUT_OF_RANGE",
                                "NPK_ERR_WORKSPACE_TOO_SMALL",
                                "NPK_ERR_SIZE_OVERFLOW",
                                "NPK_ERR_ISA_UNAVAILABLE",
                                "NPK_ERR_NONFINITE",
                                "NPK_ERR_BACKEND"};
  size_t i;
  const char *v = npk_version();
  unsigned a, b, c;
  char tail;
  for (i = 0; i < sizeof all / sizeof all[0]; i++) {
    const char *s = npk_status_string(all[i]);
    CHECK(s && strncmp(s, names[i], strlen(names[i])) == 0, "status string of %s: %s", names[i], s ? s : "(null)");
  }
  CHECK(strcmp(npk_status_string((npk_status)12345), "unknown status") == 0, "unknown status string");
  CHECK(v && sscanf(v, "%u.%u.%u%c", &a, &b, &c, &tail) == 3, "version '%s' is MAJOR.MINOR.PATCH", v ? v : "");
  CHECK(NPK_EXPECTED_VERSION[0] == 0 || strcmp(v, NPK_EXPECTED_VERSION) == 0, "version %s want %s", v,
        NPK_EXPECTED_VERSION);
  CHECK(npk_detected_isa() >= NPK_ISA_PORTABLE && npk_detected_isa() <= NPK_ISA_NEON_BF16, "detected isa %d",
        (int)npk_detected_isa());
}

int main(void) {
  E = mk_exec(NPK_BACKEND_CPU, 0, 0);
  E.detail = &g_detail;
  test_misc();
  test_rms_norm();
  test_add_rms_norm();
  test_rms_norm_grad();
  test_embedding();
  test_errors_rms_norm();
  test_errors_add_rms_norm();
  test_errors_grad();
  test_errors_embedding();
  test_pool();
  printf("test_c (npukern %s, isa %d): %d passed, %d failed\n", npk_version(), (int)npk_detected_isa(), g_passed,
         g_failed);
  return g_failed ? 1 : 0;
}
