/* Attention through the C ABI (2.11): npk_attention and
 * npk_attention_backward, two-phase, against a double-precision model
 * written here (bf16 q, k, v; 4 query heads on 2 key/value heads; 37
 * tokens, head dim 20; causal, BNSD; NULL options: not causal, scale
 * 1/sqrt(head_dim)), the same bits from every ISA up to the detected one
 * and every block count, and bad input (a layout, reserved bits, heads that
 * do not divide, a NULL output) refused with nothing written. */
#include <stddef.h>

#include "common.h"

static npk_error_detail g_detail;

enum { HQ = 4, HKV = 2, S = 37, D = 20 };

static npk_exec exec_of(npk_isa isa, uint32_t blocks) {
  npk_exec e;
  memset(&e, 0, sizeof e);
  e.backend = NPK_BACKEND_CPU;
  e.isa = isa;
  e.blocks = blocks;
  e.detail = &g_detail;
  return e;
}

static npk_tensor t4(void *p, npk_dtype dt, int64_t h, int64_t s) {
  const int64_t shape[4] = {1, h, s, D};
  return tens(p, dt, 4, shape);
}

static npk_tensor t3(void *p) {
  const int64_t shape[3] = {1, HQ, S};
  return tens(p, NPK_F32, 3, shape);
}

static uint16_t q[HQ * S * D], k[HKV * S * D], v[HKV * S * D], dout[HQ * S * D];
static uint16_t out[HQ * S * D], dq[HQ * S * D], dk[HKV * S * D], dv[HKV * S * D];
static uint16_t first_out[HQ * S * D], first_dq[HQ * S * D], first_dk[HKV * S * D], first_dv[HKV * S * D];
static float mx[HQ * S], sm[HQ * S];

/* The forward, then the backward; sized then run. */
static npk_status run(const npk_attention_options *o, const npk_exec *e) {
  npk_tensor qt = t4(q, NPK_BF16, HQ, S), kt = t4(k, NPK_BF16, HKV, S), vt = t4(v, NPK_BF16, HKV, S);
  npk_tensor ot = t4(out, NPK_BF16, HQ, S), dot = t4(dout, NPK_BF16, HQ, S), mt = t3(mx), st = t3(sm);
  npk_tensor dqt = t4(dq, NPK_BF16, HQ, S), dkt = t4(dk, NPK_BF16, HKV, S), dvt = t4(dv, NPK_BF16, HKV, S);
  size_t bytes = 0;
  void *ws;
  npk_status s = npk_attention_workspace_size(&qt, &kt, &vt, o, e, &bytes);
  if (s != NPK_OK) return s;
  ws = bytes ? malloc(bytes) : NULL;
  s = npk_attention(&qt, &kt, &vt, o, &ot, &mt, &st, ws, bytes, e);
  free(ws);
  if (s != NPK_OK) return s;
  s = npk_attention_backward_workspace_size(&qt, &kt, &vt, o, e, &bytes);
  if (s != NPK_OK) return s;
  ws = bytes ? malloc(bytes) : NULL;
  s = npk_attention_backward(&qt, &kt, &vt, &ot, &dot, &mt, &st, o, &dqt, &dkt, &dvt, ws, bytes, e);
  free(ws);
  return s;
}

/* The model's out and dv (double): the scores, softmax and sums. */
static void model(int causal, double scale, double *want_out, double *want_dv) {
  int h, i, j, x;
  memset(want_dv, 0, sizeof(double) * HKV * S * D);
  for (h = 0; h < HQ; ++h) {
    int hk = h / (HQ / HKV);
    for (i = 0; i < S; ++i) {
      double s[S], m = -1e300, l = 0;
      int n = causal ? i + 1 : S;
      for (j = 0; j < n; ++j) {
        double acc = 0;
        for (x = 0; x < D; ++x) acc += (double)bf2f(q[(h * S + i) * D + x]) * bf2f(k[(hk * S + j) * D + x]);
        s[j] = scale * acc;
        if (s[j] > m) m = s[j];
      }
      for (j = 0; j < n; ++j) l += s[j] = exp(s[j] - m);
      for (x = 0; x < D; ++x) {
        double o = 0;
        for (j = 0; j < n; ++j) o += s[j] * bf2f(v[(hk * S + j) * D + x]);
        want_out[(h * S + i) * D + x] = o / l;
      }
      for (j = 0; j < n; ++j)
        for (x = 0; x < D; ++x) want_dv[(hk * S + j) * D + x] += s[j] / l * bf2f(dout[(h * S + i) * D + x]);
    }
  }
}

int main(void) {
  static double want_out[HQ * S * D], want_dv[HKV * S * D];
  int i, isa, form;
  uint32_t seed = 91;
  for (i = 0; i < HQ * S * D; ++i) {
    seed = seed * 1664525u + 1013904223u;
    q[i] = f2bf((float)((seed >> 8) % 4001) / 1000.0f - 2.0f);
    seed = seed * 1664525u + 1013904223u;
    dout[i] = f2bf((float)((seed >> 8) % 2001) / 1000.0f - 1.0f);
  }
  for (i = 0; i < HKV * S * D; ++i) {
    seed = seed * 1664525u + 1013904223u;
    k[i] = f2bf((float)((seed >> 8) % 4001) / 1000.0f - 2.0f);
    seed = seed * 1664525u + 1013904223u;
    v[i] = f2bf((float)((seed >> 8) % 2001) / 1000.0f - 1.0f);
  }
  for (form = 0; form < 2; ++form) {
    /* form 0: causal with an explicit scale; 1: NULL options. */
    npk_attention_options causal = {1, NPK_ATTENTION_BNSD, 0.25f, 0};
    const npk_attention_options *o = form == 0 ? &causal : NULL;
    model(form == 0, form == 0 ? 0.25 : 1.0 / sqrt((double)D), want_out, want_dv);
    for (isa = NPK_ISA_PORTABLE; isa <= (int)npk_detected_isa(); ++isa) {
      uint32_t blocks;
      for (blocks = 1; blocks <= 3; blocks += 2) {
        npk_exec e = exec_of((npk_isa)isa, blocks);
        int bad = 0;
        npk_status st = run(o, &e);
        if (st == NPK_ERR_ISA_UNAVAILABLE) break; /* another architecture's level */
        CHECK(st == NPK_OK, "form %d isa %d: %s", form, isa, g_detail.argument);
        /* bf16: within one bf16 ulp plus 2^-16 of the largest value. */
        for (i = 0; i < HQ * S * D; ++i)
          if (fabs(bf2f(out[i]) - want_out[i]) > fabs(want_out[i]) / 128.0 + 1.0 / 65536.0) bad++;
        for (i = 0; i < HKV * S * D; ++i)
          if (fabs(bf2f(dv[i]) - want_dv[i]) > fabs(want_dv[i]) / 128.0 + 1.0 / 2048.0) bad++;
        CHECK(bad == 0, "form %d isa %d blocks %u: %d elements off the model", form, isa, blocks, bad);
        if (isa == NPK_ISA_PORTABLE && blocks == 1) {
          memcpy(first_out, out, sizeof out);
          memcpy(first_dq, dq, sizeof dq);
          memcpy(first_dk, dk, sizeof dk);
          memcpy(first_dv, dv, sizeof dv);
        } else {
          CHECK(memcmp(first_out, out, sizeof out) == 0 && memcmp(first_dq, dq, sizeof dq) == 0 &&
                    memcmp(first_dk, dk, sizeof dk) == 0 && memcmp(first_dv, dv, sizeof dv) == 0,
                "form %d isa %d blocks %u: bits differ from portable", form, isa, blocks);
        }
      }
    }
  }
  /* Bad input: refused, the argument named, nothing written. */
  {
    npk_exec e = exec_of(NPK_ISA_AUTO, 0);
    npk_attention_options bad_layout = {1, 7, 0.25f, 0}, reserved = {1, 0, 0.25f, 1}, nan_scale = {1, 0, NAN, 0};
    npk_tensor qt = t4(q, NPK_BF16, HQ, S), kt3 = t4(k, NPK_BF16, 3, S), vt3 = t4(v, NPK_BF16, 3, S);
    npk_tensor kt = t4(k, NPK_BF16, HKV, S), vt = t4(v, NPK_BF16, HKV, S), ot = t4(out, NPK_BF16, HQ, S);
    npk_tensor mt = t3(mx), st = t3(sm);
    size_t bytes = 0;
    for (i = 0; i < HQ * S * D; ++i) out[i] = 0x7fc1;
    CHECK(run(&bad_layout, &e) == NPK_ERR_PARAM_INVALID && strcmp(g_detail.argument, "layout") == 0,
          "layout 7: %s", g_detail.argument);
    CHECK(run(&reserved, &e) == NPK_ERR_PARAM_INVALID && strcmp(g_detail.argument, "reserved") == 0,
          "reserved: %s", g_detail.argument);
    CHECK(run(&nan_scale, &e) == NPK_ERR_PARAM_INVALID && strcmp(g_detail.argument, "scale") == 0,
          "NaN scale: %s", g_detail.argument);
    CHECK(npk_attention_workspace_size(&qt, &kt3, &vt3, NULL, &e, &bytes) == NPK_ERR_PARAM_INVALID &&
              strcmp(g_detail.argument, "k") == 0,
          "3 key/value heads for 4: %s", g_detail.argument);
    CHECK(npk_attention_workspace_size(&qt, &kt, &vt, NULL, &e, &bytes) == NPK_OK && bytes > 64, "size");
    CHECK(npk_attention(&qt, &kt, &vt, NULL, &ot, &mt, NULL, NULL, bytes, &e) == NPK_ERR_NULLPTR,
          "NULL softmax_sum");
    CHECK(npk_attention(&qt, &kt, &vt, NULL, &ot, &mt, &st, NULL, bytes, &e) == NPK_ERR_NULLPTR,
          "NULL workspace");
    for (i = 0; i < HQ * S * D; ++i) {
      if (out[i] != 0x7fc1) {
        CHECK(0, "out written on error at %d", i);
        break;
      }
    }
  }
  printf("test_attention: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
