/* GeGLU and GeGluGrad through the C ABI (2.5): the two-phase calls against
 * a double-precision model written here (both GELU forms, both halves
 * activated), the gelu output, the CPU against the reference backend, a
 * foreign table with the new entries and one built against ABI 2.4
 * (shorter: GeGLU runs on the CPU), and bad input refused with nothing
 * written. */
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

/* |got - want| <= tol * |want| + abs_tol */
static int near(double got, double want, double tol, double abs_tol) {
  if (isnan(want)) return isnan(got);
  return fabs(got - want) <= tol * fabs(want) + abs_tol;
}

/* gelu(x) and gelu'(x): tanh form (approximate 1) or erf form (0). */
/* M_PI is POSIX, not C11. */
#define K_PI 3.14159265358979323846

static double gelu(double x, int tanh_form, double *d) {
  if (tanh_form) {
    double beta = sqrt(2.0 / K_PI), k = 0.044715;
    double t = tanh(beta * (x + k * x * x * x));
    *d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * beta * (1 + 3 * k * x * x);
    return 0.5 * x * (1 + t);
  } else {
    double c = 0.5 * (1 + erf(x / sqrt(2.0)));
    *d = c + x * exp(-0.5 * x * x) / sqrt(2 * K_PI);
    return x * c;
  }
}

static void test_geglu(npk_dtype dt, int tanh_form, int left) {
  enum { M = 3, L = 70 };
  static uint16_t buf16[5][M * 2 * L];
  static float buf32[5][M * 2 * L];
  void *b[5];
  int64_t xs[2] = {M, 2 * L}, hs[2] = {M, L};
  npk_tensor x, y, act, dy, dx, g, u, y2, dg, du;
  npk_geglu_options o;
  npk_exec cpu = exec_of(NPK_BACKEND_CPU), ref = exec_of(NPK_BACKEND_REFERENCE);
  size_t ws = 99, i, r, j;
  double tol = dt == NPK_F32 ? 1e-6 : dt == NPK_BF16 ? 1.0 / 128 : 1.0 / 1024;
  size_t go = left ? 0 : L, uo = left ? L : 0; /* the gate's and up's column offsets in x */
  o.dim = -1;
  o.rounding = NPK_ELEM_ROUNDING_FUSED;
  o.approximate = tanh_form ? NPK_GELU_TANH : NPK_GELU_NONE;
  o.activate_left = (uint32_t)left;
  for (i = 0; i < 5; ++i) b[i] = dt == NPK_F32 ? (void *)buf32[i] : (void *)buf16[i];
  x = tensor(b[0], dt, 2, xs);
  for (i = 0; i < (size_t)M * 2 * L; ++i) put(x.data, dt, i, urand(-6, 6));
  y = tensor(b[1], dt, 2, hs);
  act = tensor((char *)b[1] + M * L * dsize(dt), dt, 2, hs);
  CHECK(npk_geglu_workspace_size(&x, NULL, &o, &cpu, &ws) == NPK_OK && ws == 0, "size %zu", ws);
  CHECK(npk_geglu(&x, NULL, &o, &y, &act, NULL, 0, &cpu) == NPK_OK, "%s", g_detail.message);
  dy = tensor(b[2], dt, 2, hs);
  for (i = 0; i < (size_t)M * L; ++i) put(dy.data, dt, i, urand(-2, 2));
  dx = tensor(b[3], dt, 2, xs);
  CHECK(npk_geglu_grad_workspace_size(&dy, &x, NULL, &o, &cpu, &ws) == NPK_OK && ws == 0, "grad size");
  CHECK(npk_geglu_grad(&dy, &x, NULL, &o, &dx, NULL, NULL, 0, &cpu) == NPK_OK, "%s", g_detail.message);
  for (r = 0; r < M; ++r)
    for (j = 0; j < L; ++j) {
      double a = get(x.data, dt, r * 2 * L + go + j), bb = get(x.data, dt, r * 2 * L + uo + j);
      double d = get(dy.data, dt, r * L + j), dg1, ga = gelu(a, tanh_form, &dg1);
      double sa = fabs(d * bb) * (1 + fabs(a) * (1 + 0.14 * a * a));
      CHECK(near(get(y.data, dt, r * L + j), ga * bb, tol, 1e-6 * fabs(a * bb) + 1e-30), "%s y %zu,%zu: %g vs %g",
            dname(dt), r, j, get(y.data, dt, r * L + j), ga * bb);
      CHECK(near(get(act.data, dt, r * L + j), ga, tol, 1e-6 * fabs(a) + 1e-30), "%s gelu %zu,%zu", dname(dt), r, j);
      CHECK(near(get(dx.data, dt, r * 2 * L + go + j), d * bb * dg1, tol, 1e-6 * sa + 1e-30), "%s da %zu,%zu",
            dname(dt), r, j);
      CHECK(near(get(dx.data, dt, r * 2 * L + uo + j), d * ga, tol, 1e-6 * fabs(a * d) + 1e-30), "%s db %zu,%zu",
            dname(dt), r, j);
    }
  /* The two-tensor form on the reference backend agrees. */
  g = tensor(b[4], dt, 2, hs);
  u = tensor((char *)b[4] + M * L * dsize(dt), dt, 2, hs);
  for (r = 0; r < M; ++r)
    for (j = 0; j < L; ++j) {
      put(g.data, dt, r * L + j, get(x.data, dt, r * 2 * L + go + j));
      put(u.data, dt, r * L + j, get(x.data, dt, r * 2 * L + uo + j));
    }
  y2 = tensor(b[2], dt, 2, hs); /* dy is no longer needed below */
  CHECK(npk_geglu(&g, &u, &o, &y2, NULL, NULL, 0, &ref) == NPK_OK, "%s", g_detail.message);
  for (i = 0; i < (size_t)M * L; ++i)
    CHECK(near(get(y2.data, dt, i), get(y.data, dt, i), 2 * tol,
               1e-6 * fabs(get(g.data, dt, i) * get(u.data, dt, i)) + 1e-30),
          "%s ref y[%zu]", dname(dt), i);
  dg = tensor(b[3], dt, 2, hs);
  du = tensor((char *)b[3] + M * L * dsize(dt), dt, 2, hs);
  CHECK(npk_geglu_grad(&y, &g, &u, &o, &dg, &du, NULL, 0, &cpu) == NPK_OK, "%s", g_detail.message);
}

/* ---- a fake NPU: counts the new entries and runs them on the CPU ---- */
static int g_calls[2];
static npk_exec g_cpu;

static npk_status fake_geglu(void *ctx, const npk_geglu_call *c) {
  npk_geglu_options o;
  (void)ctx;
  g_calls[0]++;
  o.dim = -1;
  o.rounding = c->rounding;
  o.approximate = c->approximate;
  o.activate_left = c->activate_left;
  return npk_geglu(&c->a, c->split ? NULL : &c->b, &o, &c->y, c->gelu.data ? &c->gelu : NULL, c->workspace,
                   c->workspace_bytes, &g_cpu);
}

static npk_status fake_geglu_grad(void *ctx, const npk_geglu_grad_call *c) {
  (void)ctx;
  (void)c;
  g_calls[1]++;
  return (npk_status)9;
}

static void test_foreign(void) {
  enum { N = 64 };
  static uint16_t x[2 * N], y[N], y0[N], dy[N], dx[2 * N];
  int64_t xs[1] = {2 * N}, hs[1] = {N};
  npk_tensor xt = tensor(x, NPK_BF16, 1, xs), yt = tensor(y, NPK_BF16, 1, hs), y0t = tensor(y0, NPK_BF16, 1, hs);
  npk_tensor dyt = tensor(dy, NPK_BF16, 1, hs), dxt = tensor(dx, NPK_BF16, 1, xs);
  npk_foreign_backend t;
  npk_exec e = exec_of(NPK_BACKEND_FOREIGN);
  size_t i;
  g_cpu = exec_of(NPK_BACKEND_CPU);
  for (i = 0; i < 2 * N; ++i) put(x, NPK_BF16, i, urand(-3, 3));
  for (i = 0; i < N; ++i) put(dy, NPK_BF16, i, urand(-1, 1));
  CHECK(npk_geglu(&xt, NULL, NULL, &y0t, NULL, NULL, 0, &g_cpu) == NPK_OK, "CPU geglu");
  memset(&t, 0, sizeof t);
  t.struct_size = sizeof t;
  t.geglu = fake_geglu;
  t.geglu_grad = fake_geglu_grad;
  e.foreign = &t;
  CHECK(npk_geglu(&xt, NULL, NULL, &yt, NULL, NULL, 0, &e) == NPK_OK && g_calls[0] == 1, "foreign geglu");
  CHECK(!memcmp(y, y0, sizeof y), "foreign geglu's bits");
  CHECK(npk_geglu_grad(&dyt, &xt, NULL, NULL, &dxt, NULL, NULL, 0, &e) == NPK_ERR_BACKEND && g_detail.value == 9 &&
            g_calls[1] == 1,
        "foreign geglu_grad failure passed on: value %lld", (long long)g_detail.value);
  /* A backend compiled against ABI 2.4 ends before the GeGLU entries. */
  t.struct_size = offsetof(npk_foreign_backend, geglu);
  memset(y, 0, sizeof y);
  CHECK(npk_geglu(&xt, NULL, NULL, &yt, NULL, NULL, 0, &e) == NPK_OK && g_calls[0] == 1, "2.4 table: CPU geglu");
  CHECK(!memcmp(y, y0, sizeof y), "2.4 table: the CPU's bits");
  CHECK(npk_geglu_grad(&dyt, &xt, NULL, NULL, &dxt, NULL, NULL, 0, &e) == NPK_OK && g_calls[1] == 1,
        "2.4 table: CPU geglu_grad");
}

static void test_errors(void) {
  static uint16_t x[12], y[12], act[12];
  int64_t odd[2] = {4, 3}, xs[2] = {2, 6}, hs[2] = {2, 3}, h4[2] = {2, 4};
  npk_tensor xt = tensor(x, NPK_BF16, 2, odd), yt = tensor(y, NPK_BF16, 2, hs), at = tensor(act, NPK_BF16, 2, h4);
  npk_geglu_options bad_approx = {-1, NPK_ELEM_ROUNDING_FUSED, (npk_gelu_approximate)2, 0};
  npk_geglu_options bad_left = {-1, NPK_ELEM_ROUNDING_FUSED, NPK_GELU_TANH, 2};
  npk_geglu_options bad_round = {-1, (npk_elem_rounding)7, NPK_GELU_TANH, 0};
  npk_exec cpu = exec_of(NPK_BACKEND_CPU);
  size_t i, ws = 5;
  for (i = 0; i < 12; ++i) y[i] = act[i] = 0x7fa5;
  CHECK(npk_geglu(&xt, NULL, NULL, &yt, NULL, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID && !strcmp(g_detail.argument, "x"),
        "odd split: %s", g_detail.message);
  xt = tensor(x, NPK_BF16, 2, xs);
  CHECK(npk_geglu(&xt, NULL, &bad_approx, &yt, NULL, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID &&
            !strcmp(g_detail.argument, "approximate"),
        "bad approximate: %s", g_detail.message);
  CHECK(npk_geglu(&xt, NULL, &bad_left, &yt, NULL, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID &&
            !strcmp(g_detail.argument, "activate_left"),
        "bad activate_left: %s", g_detail.message);
  CHECK(npk_geglu(&xt, NULL, &bad_round, &yt, NULL, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID &&
            !strcmp(g_detail.argument, "rounding"),
        "bad rounding: %s", g_detail.message);
  CHECK(npk_geglu(&xt, NULL, NULL, &yt, &at, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID &&
            !strcmp(g_detail.argument, "gelu"),
        "gelu of the wrong shape: %s", g_detail.message);
  CHECK(npk_geglu(NULL, NULL, NULL, &yt, NULL, NULL, 0, &cpu) == NPK_ERR_NULLPTR, "NULL x");
  CHECK(npk_geglu_workspace_size(&xt, NULL, NULL, &cpu, NULL) == NPK_ERR_NULLPTR, "NULL size out");
  CHECK(npk_geglu_workspace_size(&xt, NULL, &bad_approx, &cpu, &ws) == NPK_ERR_PARAM_INVALID && ws == 5,
        "size call refuses too, leaving the size");
  CHECK(npk_geglu_grad(&yt, &xt, NULL, NULL, &xt, &yt, NULL, 0, &cpu) != NPK_OK, "db in split form");
  for (i = 0; i < 12; ++i) CHECK(y[i] == 0x7fa5 && act[i] == 0x7fa5, "output %zu written on error", i);
}

int main(void) {
  npk_dtype dts[3] = {NPK_F32, NPK_BF16, NPK_F16};
  int k;
  CHECK(npk_abi_version() == NPK_ABI_VERSION && NPK_ABI_VERSION_MINOR >= 5, "ABI %#x", npk_abi_version());
  for (k = 0; k < 3; ++k) {
    test_geglu(dts[k], 1, 0);
    test_geglu(dts[k], 1, 1);
    test_geglu(dts[k], 0, 0);
  }
  test_foreign();
  test_errors();
  printf("test_geglu: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
