/* SwiGLU, SwiGluGrad and RoPE through the C ABI (2.2): the two-phase calls
 * against a double-precision model written here, the CPU against the
 * reference backend, the split form against the two-tensor form, a foreign
 * table with the new entries and one built against ABI 2.0 (shorter: the new
 * operators run on the CPU), and bad input refused with nothing written. */
#include <stddef.h>

#include "common.h"

static npk_error_detail g_detail;

static npk_exec exec_of(npk_backend_kind kind) {
  npk_exec e;
  memset(&e, 0, sizeof e);
  e.backend = kind;
  e.detail = &g_detail;
  return e;
}

static size_t numel(const npk_tensor *t) {
  size_t n = 1;
  uint32_t i;
  for (i = 0; i < t->ndim; ++i) n *= (size_t)t->shape[i];
  return n;
}

static npk_tensor tensor(void *data, npk_dtype dt, uint32_t ndim, const int64_t *shape) {
  npk_tensor t;
  uint32_t i;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dt;
  t.ndim = ndim;
  for (i = 0; i < ndim; ++i) t.shape[i] = shape[i];
  return t;
}

static void fill(npk_tensor *t, double lo, double hi) {
  size_t i, n = numel(t);
  for (i = 0; i < n; ++i) put(t->data, t->dtype, i, urand(lo, hi));
}

/* |got - want| <= tol * |want| + abs_tol */
static int near(double got, double want, double tol, double abs_tol) {
  if (isnan(want)) return isnan(got);
  return fabs(got - want) <= tol * fabs(want) + abs_tol;
}

static double silu(double a) { return a / (1.0 + exp(-a)); }

/* ---- a fake NPU: counts the new entries and runs them on the CPU ---- */
static int g_calls[3];
static npk_exec g_cpu;

static npk_status fake_swiglu(void *ctx, const npk_swiglu_call *c) {
  npk_swiglu_options o;
  (void)ctx;
  g_calls[0]++;
  o.dim = -1;
  o.rounding = c->rounding;
  return npk_swiglu(&c->a, c->split ? NULL : &c->b, &o, &c->y, c->workspace, c->workspace_bytes, &g_cpu);
}

static npk_status fake_swiglu_grad(void *ctx, const npk_swiglu_grad_call *c) {
  (void)ctx;
  (void)c;
  g_calls[1]++;
  return (npk_status)7; /* reported as NPK_ERR_BACKEND with value 7 */
}

static npk_status fake_rope(void *ctx, const npk_rope_call *c) {
  npk_rope_options o;
  (void)ctx;
  g_calls[2]++;
  o.rounding = c->rounding;
  o.backward = c->backward;
  return npk_rope(&c->q, c->k.shape[0] ? &c->k : NULL, &c->cos, &c->sin, &o, &c->q_out,
                  c->k.shape[0] ? &c->k_out : NULL, c->workspace, c->workspace_bytes, &g_cpu);
}

static void test_swiglu(npk_dtype dt) {
  enum { M = 3, L = 70 };
  static uint16_t buf16[6][M * 2 * L];
  static float buf32[6][M * 2 * L];
  void *b[6];
  int64_t xs[2] = {M, 2 * L}, hs[2] = {M, L};
  npk_tensor x, g, u, y, y2, dy, dx, dg, du;
  npk_swiglu_options o = {-1, NPK_ELEM_ROUNDING_FUSED};
  npk_exec cpu = exec_of(NPK_BACKEND_CPU), ref = exec_of(NPK_BACKEND_REFERENCE);
  size_t ws = 99, i, r, j;
  double tol = dt == NPK_F32 ? 1e-6 : dt == NPK_BF16 ? 1.0 / 128 : 1.0 / 1024;
  for (i = 0; i < 6; ++i) b[i] = dt == NPK_F32 ? (void *)buf32[i] : (void *)buf16[i];
  x = tensor(b[0], dt, 2, xs);
  fill(&x, -6, 6);
  g = tensor(b[1], dt, 2, hs);
  u = tensor((char *)b[1] + M * L * dsize(dt), dt, 2, hs);
  for (r = 0; r < M; ++r)
    for (j = 0; j < L; ++j) {
      put(g.data, dt, r * L + j, get(x.data, dt, r * 2 * L + j));
      put(u.data, dt, r * L + j, get(x.data, dt, r * 2 * L + L + j));
    }
  y = tensor(b[2], dt, 2, hs);
  y2 = tensor((char *)b[2] + M * L * dsize(dt), dt, 2, hs);
  CHECK(npk_swiglu_workspace_size(&x, NULL, &o, &cpu, &ws) == NPK_OK && ws == 0, "size %zu", ws);
  CHECK(npk_swiglu(&x, NULL, &o, &y, NULL, 0, &cpu) == NPK_OK, "%s", g_detail.message);
  CHECK(npk_swiglu(&g, &u, &o, &y2, NULL, 0, &ref) == NPK_OK, "%s", g_detail.message);
  for (i = 0; i < M * L; ++i) {
    double want = silu(get(g.data, dt, i)) * get(u.data, dt, i);
    CHECK(near(get(y.data, dt, i), want, tol, 1e-30), "%s y[%zu] %g vs %g", dname(dt), i, get(y.data, dt, i), want);
    CHECK(near(get(y2.data, dt, i), get(y.data, dt, i), tol, 1e-30), "%s ref y[%zu]", dname(dt), i);
  }
  /* Backward: split form on the CPU vs two tensors on the reference. */
  dy = tensor(b[3], dt, 2, hs);
  fill(&dy, -2, 2);
  dx = tensor(b[4], dt, 2, xs);
  dg = tensor(b[5], dt, 2, hs);
  du = tensor((char *)b[5] + M * L * dsize(dt), dt, 2, hs);
  CHECK(npk_swiglu_grad_workspace_size(&dy, &x, NULL, &o, &cpu, &ws) == NPK_OK && ws == 0, "grad size");
  CHECK(npk_swiglu_grad(&dy, &x, NULL, &o, &dx, NULL, NULL, 0, &cpu) == NPK_OK, "%s", g_detail.message);
  CHECK(npk_swiglu_grad(&dy, &g, &u, &o, &dg, &du, NULL, 0, &ref) == NPK_OK, "%s", g_detail.message);
  for (r = 0; r < M; ++r)
    for (j = 0; j < L; ++j) {
      double a = get(g.data, dt, r * L + j), bb = get(u.data, dt, r * L + j), d = get(dy.data, dt, r * L + j);
      double s = 1.0 / (1.0 + exp(-a));
      double wa = d * bb * s * (1.0 + a * (1.0 - s)), wb = d * silu(a);
      double sa = fabs(d * bb) * s * (1.0 + fabs(a) * (1.0 - s));
      CHECK(near(get(dx.data, dt, r * 2 * L + j), wa, tol, 1e-5 * sa + 1e-30), "%s da %zu,%zu", dname(dt), r, j);
      CHECK(near(get(dx.data, dt, r * 2 * L + L + j), wb, tol, 1e-30), "%s db %zu,%zu", dname(dt), r, j);
      CHECK(near(get(dg.data, dt, r * L + j), wa, tol, 1e-5 * sa + 1e-30), "%s ref da", dname(dt));
      CHECK(near(get(du.data, dt, r * L + j), wb, tol, 1e-30), "%s ref db", dname(dt));
    }
}

static void test_rope(npk_dtype dt) {
  enum { B = 2, H = 3, KH = 1, S = 5, D = 64 };
  static float q[B * H * S * D], k[B * KH * S * D], c[S * D], s[S * D];
  static float qo[B * H * S * D], ko[B * KH * S * D], qb[B * H * S * D];
  static uint16_t q16[B * H * S * D], k16[B * KH * S * D], qo16[B * H * S * D], ko16[B * KH * S * D];
  static uint16_t qb16[B * H * S * D];
  int64_t qs[4] = {B, H, S, D}, ks[4] = {B, KH, S, D}, cs[2] = {S, D};
  int f32 = dt == NPK_F32;
  npk_tensor qt = tensor(f32 ? (void *)q : (void *)q16, dt, 4, qs);
  npk_tensor kt = tensor(f32 ? (void *)k : (void *)k16, dt, 4, ks);
  npk_tensor qot = tensor(f32 ? (void *)qo : (void *)qo16, dt, 4, qs);
  npk_tensor kot = tensor(f32 ? (void *)ko : (void *)ko16, dt, 4, ks);
  npk_tensor qbt = tensor(f32 ? (void *)qb : (void *)qb16, dt, 4, qs);
  npk_tensor ct = tensor(c, NPK_F32, 2, cs), st = tensor(s, NPK_F32, 2, cs);
  npk_rope_options fwd = {NPK_ELEM_ROUNDING_FUSED, 0}, bwd = {NPK_ELEM_ROUNDING_FUSED, 1};
  npk_exec cpu = exec_of(NPK_BACKEND_CPU);
  size_t ws = 99, row, j, h = D / 2;
  double tol = dt == NPK_F32 ? 1e-6 : dt == NPK_BF16 ? 1.0 / 128 : 1.0 / 1024;
  fill(&qt, -2, 2);
  fill(&kt, -2, 2);
  fill(&ct, -1, 1);
  fill(&st, -1, 1);
  CHECK(npk_rope_workspace_size(&qt, &kt, &ct, &st, &fwd, &cpu, &ws) == NPK_OK && ws == 0, "size");
  CHECK(npk_rope(&qt, &kt, &ct, &st, &fwd, &qot, &kot, NULL, 0, &cpu) == NPK_OK, "%s", g_detail.message);
  for (row = 0; row < B * H * S; ++row) {
    size_t cr = row % S;
    for (j = 0; j < h; ++j) {
      double x1 = get(qt.data, dt, row * D + j), x2 = get(qt.data, dt, row * D + h + j);
      double w1 = x1 * c[cr * D + j] - x2 * s[cr * D + j];
      double w2 = x2 * c[cr * D + h + j] + x1 * s[cr * D + h + j];
      CHECK(near(get(qot.data, dt, row * D + j), w1, tol, 1e-6 * (fabs(x1) + fabs(x2))), "%s q1 %zu %zu", dname(dt), row, j);
      CHECK(near(get(qot.data, dt, row * D + h + j), w2, tol, 1e-6 * (fabs(x1) + fabs(x2))), "%s q2", dname(dt));
    }
  }
  for (row = 0; row < B * KH * S; ++row) {
    size_t cr = row % S;
    double x1 = get(kt.data, dt, row * D), x2 = get(kt.data, dt, row * D + h);
    double w1 = x1 * c[cr * D] - x2 * s[cr * D];
    CHECK(near(get(kot.data, dt, row * D), w1, tol, 1e-6 * (fabs(x1) + fabs(x2))), "%s k1 %zu", dname(dt), row);
  }
  /* Backward of the forward with sin halves equal is the inverse rotation
   * when cos^2 + sin^2 = 1: make it so and check the round trip. */
  for (j = 0; j < S * h; ++j) {
    size_t r0 = j / h, col = j % h;
    double t = urand(-3, 3);
    c[r0 * D + col] = c[r0 * D + h + col] = (float)cos(t);
    s[r0 * D + col] = s[r0 * D + h + col] = (float)sin(t);
  }
  CHECK(npk_rope(&qt, NULL, &ct, &st, &fwd, &qot, NULL, NULL, 0, &cpu) == NPK_OK, "%s", g_detail.message);
  CHECK(npk_rope(&qot, NULL, &ct, &st, &bwd, &qbt, NULL, NULL, 0, &cpu) == NPK_OK, "%s", g_detail.message);
  for (j = 0; j < B * H * S * D; ++j)
    CHECK(near(get(qbt.data, dt, j), get(qt.data, dt, j), 3 * tol, 3 * tol), "%s round trip %zu", dname(dt), j);
}

static void test_foreign(void) {
  enum { N = 64 };
  static uint16_t x[2 * N], y[N], dy[N], dx[2 * N], q[N], qo[N];
  static float c[N], s[N];
  int64_t xs[1] = {2 * N}, hs[1] = {N}, qs[2] = {1, N};
  npk_tensor xt = tensor(x, NPK_BF16, 1, xs), yt = tensor(y, NPK_BF16, 1, hs);
  npk_tensor dyt = tensor(dy, NPK_BF16, 1, hs), dxt = tensor(dx, NPK_BF16, 1, xs);
  npk_tensor qt = tensor(q, NPK_BF16, 2, qs), qot = tensor(qo, NPK_BF16, 2, qs);
  npk_tensor ct = tensor(c, NPK_F32, 2, qs), st = tensor(s, NPK_F32, 2, qs);
  npk_foreign_backend t;
  npk_exec e = exec_of(NPK_BACKEND_FOREIGN);
  g_cpu = exec_of(NPK_BACKEND_CPU);
  fill(&xt, -3, 3);
  fill(&dyt, -1, 1);
  fill(&qt, -1, 1);
  fill(&ct, -1, 1);
  fill(&st, -1, 1);
  memset(&t, 0, sizeof t);
  t.struct_size = sizeof t;
  t.swiglu = fake_swiglu;
  t.swiglu_grad = fake_swiglu_grad;
  t.rope = fake_rope;
  e.foreign = &t;
  CHECK(npk_swiglu(&xt, NULL, NULL, &yt, NULL, 0, &e) == NPK_OK && g_calls[0] == 1, "foreign swiglu");
  CHECK(npk_rope(&qt, NULL, &ct, &st, NULL, &qot, NULL, NULL, 0, &e) == NPK_OK && g_calls[2] == 1, "foreign rope");
  CHECK(npk_swiglu_grad(&dyt, &xt, NULL, NULL, &dxt, NULL, NULL, 0, &e) == NPK_ERR_BACKEND && g_detail.value == 7 &&
            g_calls[1] == 1,
        "foreign swiglu_grad failure passed on: value %lld", (long long)g_detail.value);
  /* A backend compiled against ABI 2.0 ends before the new entries: the new
   * operators run on the CPU and never touch its (absent) entries. */
  t.struct_size = offsetof(npk_foreign_backend, swiglu);
  CHECK(npk_swiglu(&xt, NULL, NULL, &yt, NULL, 0, &e) == NPK_OK && g_calls[0] == 1, "2.0 table: CPU swiglu");
  CHECK(npk_swiglu_grad(&dyt, &xt, NULL, NULL, &dxt, NULL, NULL, 0, &e) == NPK_OK && g_calls[1] == 1,
        "2.0 table: CPU swiglu_grad");
  CHECK(npk_rope(&qt, NULL, &ct, &st, NULL, &qot, NULL, NULL, 0, &e) == NPK_OK && g_calls[2] == 1, "2.0 table: CPU rope");
}

static void test_errors(void) {
  static uint16_t x[12], y[12], q[12], qo[12];
  static float c[12];
  int64_t odd[2] = {4, 3}, xs[2] = {2, 6}, hs[2] = {2, 3}, q9[2] = {1, 9}, c9[2] = {1, 9};
  npk_tensor xt = tensor(x, NPK_BF16, 2, odd), yt = tensor(y, NPK_BF16, 2, hs);
  npk_tensor qt = tensor(q, NPK_BF16, 2, q9), qot = tensor(qo, NPK_BF16, 2, q9), ct = tensor(c, NPK_F32, 2, c9);
  npk_swiglu_options bad = {-1, (npk_elem_rounding)7};
  npk_exec cpu = exec_of(NPK_BACKEND_CPU);
  size_t i, ws = 5;
  for (i = 0; i < 12; ++i) y[i] = qo[i] = 0x7fa5;
  CHECK(npk_swiglu(&xt, NULL, NULL, &yt, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID && !strcmp(g_detail.argument, "x"),
        "odd split: %s", g_detail.message);
  xt = tensor(x, NPK_BF16, 2, xs);
  CHECK(npk_swiglu(&xt, NULL, &bad, &yt, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID &&
            !strcmp(g_detail.argument, "rounding"),
        "bad rounding: %s", g_detail.message);
  CHECK(npk_swiglu(NULL, NULL, NULL, &yt, NULL, 0, &cpu) == NPK_ERR_NULLPTR, "NULL x");
  CHECK(npk_swiglu_workspace_size(&xt, NULL, NULL, &cpu, NULL) == NPK_ERR_NULLPTR, "NULL size out");
  CHECK(npk_swiglu_grad(&yt, &xt, NULL, NULL, &xt, &yt, NULL, 0, &cpu) != NPK_OK, "db in split form");
  CHECK(npk_rope(&qt, NULL, &ct, &ct, NULL, &qot, NULL, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID &&
            !strcmp(g_detail.argument, "q"),
        "odd head_dim: %s", g_detail.message);
  CHECK(npk_rope_workspace_size(&qt, NULL, &ct, &ct, NULL, &cpu, &ws) == NPK_ERR_PARAM_INVALID && ws == 5,
        "size call refuses too, leaving the size");
  for (i = 0; i < 12; ++i) CHECK(y[i] == 0x7fa5 && qo[i] == 0x7fa5, "output %zu written on error", i);
}

int main(void) {
  CHECK(npk_abi_version() == NPK_ABI_VERSION && NPK_ABI_VERSION_MINOR >= 2, "ABI %#x", npk_abi_version());
  test_swiglu(NPK_F32);
  test_swiglu(NPK_BF16);
  test_swiglu(NPK_F16);
  test_rope(NPK_F32);
  test_rope(NPK_BF16);
  test_rope(NPK_F16);
  test_foreign();
  test_errors();
  printf("test_elementwise: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
