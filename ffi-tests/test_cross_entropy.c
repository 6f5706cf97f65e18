/* CrossEntropy through the C ABI (2.3): forward (every reduction), backward
 * and the fused in-place form against a double-precision model written
 * here; the fused gradient equals the backward's bits; a foreign table with
 * the cross_entropy entry; an out-of-range target refused, naming the row
 * and value, with nothing written. */
#include <stddef.h>

#include "common.h"

enum { N = 5, C = 37 };

static npk_error_detail g_detail;

static npk_exec exec_of(npk_backend_kind kind) {
  npk_exec e;
  memset(&e, 0, sizeof e);
  e.backend = kind;
  e.detail = &g_detail;
  return e;
}

static float g_x[N * C], g_w[C];
static int64_t g_t[N] = {3, -100, 36, 0, 17};

/* The model: per-row loss (label smoothing ls, z-loss zs) and lse. */
static void model(double ls, double zs, double *loss, double *lse) {
  int r, c;
  for (r = 0; r < N; ++r) {
    double m = -INFINITY, s = 0, sm = 0;
    for (c = 0; c < C; ++c) m = fmax(m, g_x[r * C + c]);
    for (c = 0; c < C; ++c) s += exp(g_x[r * C + c] - m);
    lse[r] = m + log(s);
    if (g_t[r] == -100) {
      loss[r] = 0;
      continue;
    }
    for (c = 0; c < C; ++c) sm += g_w[c] * (lse[r] - g_x[r * C + c]);
    loss[r] = (1 - ls) * g_w[g_t[r]] * (lse[r] - g_x[r * C + g_t[r]]) + ls / C * sm + zs * lse[r] * lse[r];
  }
}

static int g_entry_calls;
static npk_exec g_cpu;

static npk_status fake_cross_entropy(void *ctx, const npk_cross_entropy_call *c) {
  (void)ctx;
  (void)c;
  g_entry_calls++;
  return 0; /* a real NPU would run c->mode here */
}

static void test_all(void) {
  npk_exec cpu = exec_of(NPK_BACKEND_CPU);
  int64_t xs[2] = {N, C}, ns[1] = {N}, cs[1] = {C}, one[1] = {1};
  npk_tensor xt = tens(g_x, NPK_F32, 2, xs), tt = tens(g_t, NPK_I64, 1, ns), wt = tens(g_w, NPK_F32, 1, cs);
  float loss[N], lse[N], scalar, g[N], dx[N * C], fx[N * C], floss[N], flse[N];
  double mloss[N], mlse[N], sum = 0, den = 0;
  npk_cross_entropy_options o;
  size_t ws = 99, i;
  void *wbuf;
  int r, c;
  npk_tensor lt = tens(loss, NPK_F32, 1, ns), st = tens(&scalar, NPK_F32, 1, one), et = tens(lse, NPK_F32, 1, ns);
  for (i = 0; i < N * C; ++i) g_x[i] = (float)urand(-4, 4);
  for (i = 0; i < C; ++i) g_w[i] = (float)urand(0.5, 2);
  o.reduction = NPK_REDUCTION_NONE;
  o.ignore_index = -100;
  o.label_smoothing = 0.1f;
  o.lse_square_scale = 1e-3f;
  o.softcap = 0;
  model(0.1, 1e-3, mloss, mlse);
  CHECK(npk_cross_entropy_workspace_size(&xt, &tt, &wt, &o, &cpu, &ws) == NPK_OK && ws == 0, "ws %zu", ws);
  CHECK(npk_cross_entropy(&xt, &tt, &wt, &o, &lt, &et, NULL, 0, &cpu) == NPK_OK, "forward: %s", g_detail.message);
  for (r = 0; r < N; ++r) {
    CHECK(fabs(loss[r] - mloss[r]) <= 1e-5 * (1 + fabs(mloss[r])), "loss[%d] %g vs %g", r, loss[r], mloss[r]);
    CHECK(fabs(lse[r] - mlse[r]) <= 1e-6 * (1 + fabs(mlse[r])), "lse[%d] %g vs %g", r, lse[r], mlse[r]);
    if (g_t[r] != -100) {
      sum += mloss[r];
      den += g_w[g_t[r]];
    }
  }
  /* Mean: the weighted mean (N f32 of workspace). */
  o.reduction = NPK_REDUCTION_MEAN;
  CHECK(npk_cross_entropy_workspace_size(&xt, &tt, &wt, &o, &cpu, &ws) == NPK_OK && ws == N * 4 + 64, "ws %zu", ws);
  wbuf = malloc(ws);
  CHECK(npk_cross_entropy(&xt, &tt, &wt, &o, &st, NULL, wbuf, ws, &cpu) == NPK_OK, "mean: %s", g_detail.message);
  CHECK(fabs(scalar - sum / den) <= 1e-5 * fabs(sum / den), "mean %g vs %g", scalar, sum / den);
  free(wbuf);
  {
    /* ABI 2.4: the same reduction over the per-row losses, bit for bit, and
       the mean's gradient factor 2 / den rounded once. */
    float again = -1.0f, factor = -1.0f;
    npk_tensor rows = tens(loss, NPK_F32, 1, ns);
    CHECK(npk_cross_entropy_reduce(&rows, &tt, &wt, &o, &again, &cpu) == NPK_OK && again == scalar,
          "reduce %g vs %g: %s", again, scalar, g_detail.message);
    CHECK(npk_cross_entropy_grad_scale(&tt, &wt, &o, 2.0f, &factor, &cpu) == NPK_OK && factor == (float)(2.0 / den),
          "grad_scale %g vs %g", factor, 2.0 / den);
    o.reduction = NPK_REDUCTION_NONE;
    CHECK(npk_cross_entropy_reduce(&rows, &tt, &wt, &o, &again, &cpu) == NPK_ERR_PARAM_INVALID &&
              !strcmp(g_detail.argument, "reduction"),
          "reduce of none: %s", g_detail.message);
    o.reduction = NPK_REDUCTION_MEAN;
    o.lse_square_scale = -0.5f;
    CHECK(npk_cross_entropy(&xt, &tt, &wt, &o, &st, NULL, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID &&
              !strcmp(g_detail.argument, "lse_square_scale"),
          "negative z-loss: %s", g_detail.message);
    o.lse_square_scale = 1e-3f;
  }
  /* Backward of the per-row loss, then the fused form in place: same bits. */
  o.reduction = NPK_REDUCTION_NONE;
  for (r = 0; r < N; ++r) g[r] = (float)urand(0.5, 1.5);
  {
    npk_tensor gt = tens(g, NPK_F32, 1, ns), dt = tens(dx, NPK_F32, 2, xs);
    npk_tensor fxt = tens(fx, NPK_F32, 2, xs), flt = tens(floss, NPK_F32, 1, ns), fet = tens(flse, NPK_F32, 1, ns);
    CHECK(npk_cross_entropy_grad(&xt, &tt, &wt, &et, &gt, &o, &dt, NULL, 0, &cpu) == NPK_OK, "grad: %s",
          g_detail.message);
    for (r = 0; r < N; ++r)
      for (c = 0; c < C; ++c) {
        double p = exp(g_x[r * C + c] - mlse[r]), want = 0;
        if (g_t[r] != -100) {
          double a = 0.9 * g_w[g_t[r]] + 2e-3 * mlse[r], wsum = 0;
          int k;
          for (k = 0; k < C; ++k) wsum += g_w[k];
          want = p * (a + 0.1 * wsum / C) - 0.1 * g_w[c] / C - (c == g_t[r] ? 0.9 * g_w[g_t[r]] : 0);
          want *= g[r];
        }
        CHECK(fabs(dx[r * C + c] - want) <= 1e-5 * (fabs(want) + 1e-2), "d[%d,%d] %g vs %g", r, c, dx[r * C + c],
              want);
      }
    memcpy(fx, g_x, sizeof fx);
    /* The fused workspace is an exp cache (a speed-up): with it and
       without it (as ABI 2.3 callers passed none) the same bits. */
    CHECK(npk_cross_entropy_fused_workspace_size(&fxt, &tt, &wt, &o, &cpu, &ws) == NPK_OK && ws > 0, "fused ws %zu",
          ws);
    {
      void *fws = malloc(ws);
      int pass;
      for (pass = 0; pass < 2; ++pass) {
        memcpy(fx, g_x, sizeof fx);
        CHECK(npk_cross_entropy_fused(&fxt, &tt, &wt, &gt, &o, &flt, &fet, &fxt, pass ? fws : NULL, pass ? ws : 0,
                                      &cpu) == NPK_OK,
              "fused (workspace %d): %s", pass, g_detail.message);
        CHECK(!memcmp(fx, dx, sizeof dx), "fused dlogits = backward's bits (workspace %d)", pass);
        CHECK(!memcmp(floss, loss, sizeof loss) && !memcmp(flse, lse, sizeof lse), "fused loss and lse (workspace %d)",
              pass);
      }
      free(fws);
    }
    /* A foreign table with the new entry receives the call. */
    {
      npk_foreign_backend fb;
      npk_exec f = exec_of(NPK_BACKEND_FOREIGN);
      memset(&fb, 0, sizeof fb);
      fb.struct_size = sizeof fb;
      fb.cross_entropy = fake_cross_entropy;
      f.foreign = &fb;
      g_cpu = cpu;
      CHECK(npk_cross_entropy_fused(&xt, &tt, &wt, &gt, &o, &flt, &fet, &fxt, NULL, 0, &f) == NPK_OK &&
                g_entry_calls == 1,
            "foreign entry: %d calls", g_entry_calls);
    }
    /* An out-of-range target: the row and value, nothing written. */
    g_t[2] = C;
    memcpy(fx, g_x, sizeof fx);
    for (r = 0; r < N; ++r) floss[r] = -7.0f;
    CHECK(npk_cross_entropy_fused(&fxt, &tt, &wt, &gt, &o, &flt, &fet, &fxt, NULL, 0, &cpu) ==
                  NPK_ERR_INDEX_OUT_OF_RANGE &&
              g_detail.position == 2 && g_detail.value == C && !strcmp(g_detail.argument, "target") &&
              strstr(g_detail.message, "0 <= target <") != NULL,
          "bad target: %s", g_detail.message);
    CHECK(!memcmp(fx, g_x, sizeof fx), "%s", "logits untouched on error");
    for (r = 0; r < N; ++r) CHECK(floss[r] == -7.0f, "loss[%d] untouched", r);
    g_t[2] = 36;
    o.reduction = 7;
    CHECK(npk_cross_entropy(&xt, &tt, &wt, &o, &lt, NULL, NULL, 0, &cpu) == NPK_ERR_PARAM_INVALID &&
              !strcmp(g_detail.argument, "reduction"),
          "bad reduction: %s", g_detail.message);
  }
}

int main(void) {
  CHECK(npk_abi_version() == NPK_ABI_VERSION && NPK_ABI_VERSION_MINOR >= 4, "ABI %#x", npk_abi_version());
  test_all();
  printf("test_cross_entropy: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
