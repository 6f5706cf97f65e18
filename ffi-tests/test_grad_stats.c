/* C11 test of npk_grad_stats_workspace_size / npk_grad_stats /
 * npk_clip_grad_norm (include/npukern.h): a mixed-dtype list checked against
 * a double computation here and against NPK_BACKEND_REFERENCE, bit-identity
 * of serial and npk_threads_parallel_for, the clipping rule element by
 * element, error_if_nonfinite leaving every byte alone, the foreign
 * entries grad_stats and clip_grad_norm (ABI 2.7: the lowered segment table,
 * a failure passed on, a 2.6 table running the CPU), and the error paths
 * with their npk_error_detail.
 *
 * Built and run by tests/grad_stats.rs (gcc -std=c11 -Wall -Wextra -Werror
 * -pedantic, against libnpukern.a). Exit status 0 = every check passed. */
#include <stddef.h>

#include "common.h"

_Static_assert(sizeof(npk_grad_summary) == 40, "npk_grad_summary layout");
_Static_assert(offsetof(npk_grad_summary, min) == 24, "npk_grad_summary layout");

#define DIMS(...) ((const int64_t[]){__VA_ARGS__})
#define NT 4

static buf g_b[NT];
static npk_tensor g_t[NT];

static void make_list(void) {
  g_b[0] = balloc(NPK_F32, 20);
  g_b[1] = balloc(NPK_BF16, 21);
  g_b[2] = balloc(NPK_F16, 1000);
  g_b[3] = balloc(NPK_F32, 0);
  bfill_rand(g_b[0], -3.0, 3.0);
  bfill_rand(g_b[1], -2.0, 2.5);
  bfill_rand(g_b[2], -0.5, 0.5);
  g_t[0] = btens(g_b[0], 2, DIMS(4, 5));
  g_t[1] = btens(g_b[1], 2, DIMS(3, 7));
  g_t[2] = btens(g_b[2], 3, DIMS(10, 10, 10));
  g_t[3] = tens(NULL, NPK_F32, 2, DIMS(0, 3)); /* empty: NULL data is fine */
}

/* Both phases over the list t[0..n]: the size call, then the run. */
static npk_status stats_of(const npk_tensor *t, size_t n, const npk_exec *ex, npk_grad_summary *out) {
  size_t ws = 0;
  npk_status s = npk_grad_stats_workspace_size(t, n, ex, &ws);
  if (s != NPK_OK) return s;
  void *w = malloc(ws ? ws : 1);
  s = npk_grad_stats(t, n, out, ws ? w : NULL, ws, ex);
  free(w);
  return s;
}

static npk_status clip_of(const npk_tensor *t, size_t n, const npk_exec *ex, double max_norm, int err,
                          double *norm) {
  size_t ws = 0;
  npk_status s = npk_grad_stats_workspace_size(t, n, ex, &ws);
  if (s != NPK_OK) return s;
  void *w = malloc(ws ? ws : 1);
  s = npk_clip_grad_norm(t, n, max_norm, (uint8_t)err, norm, w, ws, ex);
  free(w);
  return s;
}

static npk_status stats(const npk_exec *ex, npk_grad_summary *out) { return stats_of(g_t, NT, ex, out); }

static npk_status clip(const npk_exec *ex, double max_norm, int err, double *norm) {
  return clip_of(g_t, NT, ex, max_norm, err, norm);
}

static int same_summary(const npk_grad_summary *a, const npk_grad_summary *b) {
  return memcmp(&a->sum_sq, &b->sum_sq, 8) == 0 && a->nan_count == b->nan_count &&
         a->inf_count == b->inf_count && f2bits(a->min) == f2bits(b->min) &&
         f2bits(a->max) == f2bits(b->max) && f2bits(a->absmax) == f2bits(b->absmax);
}

static void test_stats(void) {
  double ss = 0, mn = INFINITY, mx = -INFINITY;
  size_t k, i;
  for (k = 0; k < NT; k++)
    for (i = 0; i < g_b[k].n; i++) {
      double v = get(g_b[k].p, g_b[k].dt, i);
      ss += v * v;
      mn = v < mn ? v : mn;
      mx = v > mx ? v : mx;
    }
  npk_grad_summary s, r, p;
  npk_error_detail d;
  npk_exec ex;
  memset(&ex, 0, sizeof ex);
  ex.detail = &d;
  CHECK(stats(NULL, &s) == NPK_OK, "serial");
  CHECK(fabs(s.sum_sq - ss) <= 1e-6 * ss, "sum_sq %.17g vs %.17g", s.sum_sq, ss);
  CHECK(s.nan_count == 0 && s.inf_count == 0, "counts");
  CHECK(s.min == (float)mn && s.max == (float)mx, "min/max %g %g vs %g %g", s.min, s.max, mn, mx);
  CHECK(s.absmax == (float)fmax(-mn, mx), "absmax");
  ex.backend = NPK_BACKEND_REFERENCE;
  CHECK(stats(&ex, &r) == NPK_OK && d.status == NPK_OK, "reference");
  CHECK(fabs(r.sum_sq - ss) <= 1e-12 * ss && r.min == s.min && r.max == s.max, "reference agrees");
  ex.backend = NPK_BACKEND_CPU;
  ex.parallel_for = npk_threads_parallel_for;
  ex.blocks = 3;
  CHECK(stats(&ex, &p) == NPK_OK, "pool");
  ex.parallel_for = NULL;
  CHECK(stats(&ex, &r) == NPK_OK && same_summary(&p, &r), "pool and serial: same bits");
}

static void test_clip(void) {
  buf orig[NT];
  size_t k, i;
  double norm = -1, ss = 0;
  for (k = 0; k < NT; k++) {
    orig[k] = bclone(g_b[k]);
    for (i = 0; i < g_b[k].n; i++) ss += get(g_b[k].p, g_b[k].dt, i) * get(g_b[k].p, g_b[k].dt, i);
  }
  CHECK(clip(NULL, 0.5, 1, &norm) == NPK_OK, "clip");
  CHECK(fabs(norm - sqrt(ss)) <= 1e-6 * sqrt(ss), "norm %.17g vs %.17g", norm, sqrt(ss));
  float c = (float)fmin(1.0, 0.5 / (norm + 1e-6));
  int ok = 1;
  for (k = 0; k < NT; k++)
    for (i = 0; i < g_b[k].n; i++) {
      if (g_b[k].dt == NPK_F32) {
        float want = ((const float *)orig[k].p)[i] * c;
        ok &= f2bits(((const float *)g_b[k].p)[i]) == f2bits(want);
      } else if (g_b[k].dt == NPK_BF16) {
        uint16_t want = f2bf(bf2f(((const uint16_t *)orig[k].p)[i]) * c);
        ok &= ((const uint16_t *)g_b[k].p)[i] == want;
      } else {
        uint16_t want = f2h(h2f(((const uint16_t *)orig[k].p)[i]) * c);
        ok &= ((const uint16_t *)g_b[k].p)[i] == want;
      }
    }
  CHECK(ok, "every element is round(f32(x) * coef)");
  for (k = 0; k < NT; k++) bfree(&orig[k]);

  /* NaN with error_if_nonfinite: nothing changes, total_norm included. */
  ((float *)g_b[0].p)[7] = NAN;
  for (k = 0; k < NT; k++) orig[k] = bclone(g_b[k]);
  npk_error_detail d;
  npk_exec ex;
  memset(&ex, 0, sizeof ex);
  ex.detail = &d;
  norm = 42.0;
  CHECK(clip(&ex, 1.0, 1, &norm) == NPK_ERR_NONFINITE && d.status == NPK_ERR_NONFINITE, "nonfinite");
  CHECK(norm == 42.0, "total_norm untouched");
  for (k = 0; k < NT; k++) CHECK(bsame(g_b[k], orig[k]), "tensor %zu untouched", k);
  /* Without the error: a NaN norm and a NaN coefficient, applied. */
  CHECK(clip(&ex, 1.0, 0, &norm) == NPK_OK && isnan(norm), "NaN norm");
  CHECK(isnan(((const float *)g_b[0].p)[0]) && isnan(h2f(((const uint16_t *)g_b[2].p)[5])), "NaN applied");
  for (k = 0; k < NT; k++) bfree(&orig[k]);
}

static void test_errors(void) {
  npk_error_detail d;
  npk_exec ex;
  size_t ws = 0;
  npk_grad_summary s;
  double norm = 7.0;
  memset(&ex, 0, sizeof ex);
  ex.detail = &d;
  int32_t idx[4] = {1, 2, 3, 4};
  npk_tensor list[3];
  list[0] = g_t[0];
  list[1] = g_t[2];
  list[2] = tens(idx, NPK_I32, 1, DIMS(4));
  CHECK(npk_grad_stats_workspace_size(list, 3, &ex, &ws) == NPK_ERR_DTYPE_UNSUPPORTED, "i32");
  CHECK(strcmp(d.argument, "tensors") == 0 && d.position == 2, "detail names tensor 2: %s %lld", d.argument,
        (long long)d.position);
  CHECK(npk_grad_stats_workspace_size(NULL, 2, &ex, &ws) == NPK_ERR_NULLPTR, "NULL list");
  CHECK(npk_grad_stats_workspace_size(NULL, 0, &ex, &ws) == NPK_OK && ws == 0, "empty list");
  CHECK(npk_grad_stats(NULL, 0, &s, NULL, 0, &ex) == NPK_OK && s.sum_sq == 0 && isnan(s.min), "empty stats");
  list[2] = tens(g_b[0].p, NPK_F32, 2, DIMS((int64_t)1 << 62, 8));
  CHECK(npk_grad_stats_workspace_size(list, 3, &ex, &ws) == NPK_ERR_SIZE_OVERFLOW, "overflow");
  CHECK(npk_grad_stats_workspace_size(g_t, NT, &ex, &ws) == NPK_OK && ws > 0, "size");
  void *w = malloc(ws);
  CHECK(npk_grad_stats(g_t, NT, &s, w, ws - 1, &ex) == NPK_ERR_WORKSPACE_TOO_SMALL, "small workspace");
  CHECK(npk_grad_stats(g_t, NT, NULL, w, ws, &ex) == NPK_ERR_NULLPTR && strcmp(d.argument, "out") == 0, "NULL out");
  CHECK(npk_clip_grad_norm(g_t, NT, -1.0, 0, &norm, w, ws, &ex) == NPK_ERR_PARAM_INVALID, "negative max_norm");
  CHECK(npk_clip_grad_norm(g_t, NT, 1.0, 0, NULL, w, ws, &ex) == NPK_ERR_NULLPTR, "NULL total_norm");
  /* The same tensor twice would be scaled twice: rejected for clipping. */
  list[0] = g_t[0];
  list[1] = g_t[0];
  CHECK(npk_grad_stats_workspace_size(list, 2, &ex, &ws) == NPK_OK, "size of a repeated list");
  CHECK(npk_clip_grad_norm(list, 2, 1.0, 0, &norm, w, ws, &ex) == NPK_ERR_PARAM_INVALID, "overlap");
  CHECK(norm == 7.0, "total_norm untouched");
  CHECK(npk_grad_stats(list, 2, &s, w, ws, &ex) == NPK_OK, "stats may read a tensor twice");
  free(w);
}

/* ---- a fake NPU: its entries read the segment table and run the CPU ---- */
static int g_fcalls;

/* The call's segment table back as descriptors (rows carry their dtypes). */
static size_t unlower(const npk_tensor_list *l, npk_tensor *t, int64_t *shapes) {
  size_t j, start = 0;
  for (j = 0; j < l->count && j < NT; j++) {
    const npk_list_seg *s = &l->segs[j];
    CHECK(s->start == start && s->numel > 0, "row %zu: start %zu numel %zu", j, s->start, s->numel);
    CHECK(j > 0 || s->dtype == l->dtype, "the list's dtype is its first row's");
    start += s->numel;
    shapes[j] = (int64_t)s->numel;
    t[j] = tens(s->data, s->dtype, 1, &shapes[j]);
  }
  return j;
}

static npk_status fake_grad_stats(void *ctx, const npk_grad_stats_call *c) {
  npk_tensor t[NT];
  int64_t shapes[NT];
  size_t n = unlower(&c->tensors, t, shapes);
  (void)ctx;
  g_fcalls++;
  CHECK(c->tiling.tensors == n && c->tiling.blocks > 0 && c->workspace != NULL, "plan");
  return stats_of(t, n, NULL, c->summary);
}

static npk_status fake_clip(void *ctx, const npk_clip_grad_norm_call *c) {
  npk_tensor t[NT];
  int64_t shapes[NT];
  size_t n = unlower(&c->tensors, t, shapes);
  npk_status st;
  (void)ctx;
  g_fcalls++;
  c->report->refused = 0;
  st = clip_of(t, n, NULL, c->max_norm, (int)c->error_if_nonfinite, &c->report->total_norm);
  if (st == NPK_ERR_NONFINITE) {
    c->report->refused = 1;
    return NPK_OK;
  }
  return st;
}

static npk_status failing_grad_stats(void *ctx, const npk_grad_stats_call *c) {
  (void)ctx;
  (void)c;
  return (npk_status)9;
}

static void test_foreign(void) {
  npk_foreign_backend tb;
  npk_error_detail d;
  npk_exec e;
  npk_grad_summary s0, s1;
  buf saved[NT], cpu[NT];
  double n0 = 0, n1 = 0;
  size_t k;
  memset(&e, 0, sizeof e);
  memset(&tb, 0, sizeof tb);
  e.backend = NPK_BACKEND_FOREIGN;
  e.foreign = &tb;
  e.detail = &d;
  tb.struct_size = sizeof tb;
  tb.grad_stats = fake_grad_stats;
  tb.clip_grad_norm = fake_clip;
  CHECK(stats(NULL, &s0) == NPK_OK && stats(&e, &s1) == NPK_OK && g_fcalls == 1, "foreign grad_stats: %s", d.message);
  CHECK(same_summary(&s0, &s1), "foreign grad_stats: the CPU's bits");
  for (k = 0; k < NT; k++) saved[k] = bclone(g_b[k]);
  CHECK(clip(NULL, 0.25, 0, &n0) == NPK_OK, "CPU clip");
  for (k = 0; k < NT; k++) {
    cpu[k] = bclone(g_b[k]);
    memcpy(g_b[k].p, saved[k].p, g_b[k].n * dsize(g_b[k].dt));
  }
  CHECK(clip(&e, 0.25, 0, &n1) == NPK_OK && g_fcalls == 2, "foreign clip: %s", d.message);
  CHECK(memcmp(&n0, &n1, 8) == 0, "foreign clip: the CPU's norm");
  for (k = 0; k < NT; k++) CHECK(bsame(g_b[k], cpu[k]), "foreign clip: tensor %zu has the CPU's bits", k);
  /* Refused under error_if_nonfinite: NPK_ERR_NONFINITE, nothing changed. */
  ((float *)g_b[0].p)[3] = INFINITY;
  for (k = 0; k < NT; k++) {
    bfree(&cpu[k]);
    cpu[k] = bclone(g_b[k]);
  }
  n1 = 5.0;
  CHECK(clip(&e, 0.25, 1, &n1) == NPK_ERR_NONFINITE && g_fcalls == 3 && n1 == 5.0, "foreign clip refused");
  for (k = 0; k < NT; k++) CHECK(bsame(g_b[k], cpu[k]), "refused: tensor %zu untouched", k);
  tb.grad_stats = failing_grad_stats;
  CHECK(stats(&e, &s1) == NPK_ERR_BACKEND && d.value == 9, "failure passed on: value %lld", (long long)d.value);
  /* A backend compiled against ABI 2.6 ends before the grad_stats entry. */
  tb.struct_size = offsetof(npk_foreign_backend, grad_stats);
  CHECK(stats(&e, &s1) == NPK_OK && g_fcalls == 3, "2.6 table: CPU grad_stats: %s", d.message);
  for (k = 0; k < NT; k++) {
    memcpy(g_b[k].p, saved[k].p, g_b[k].n * dsize(g_b[k].dt));
    bfree(&saved[k]);
    bfree(&cpu[k]);
  }
}

int main(void) {
  make_list();
  test_stats();
  test_foreign();
  test_clip();
  test_errors();
  size_t k;
  for (k = 0; k < NT; k++) bfree(&g_b[k]);
  printf("test_grad_stats: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
