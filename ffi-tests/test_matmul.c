/* Matmul through the C ABI (2.8): the two-phase calls against a
 * double-precision model written here (bf16 in, bf16 and f32 out, both
 * transposes, accumulate), the same bits from every ISA up to the detected
 * one and from the reference backend's rounding of a double sum within the
 * f32-chain bound, and bad input refused with nothing written. npk_matmul_v2
 * (2.10): NULL options are npk_matmul's bits; NPK_MATMUL_BF16_DOT equals a
 * VDPBF16PS model written here (pairs, the odd step first, flushed) bit for
 * bit on every ISA; a bad math refused. NPK_MATMUL_BF16_DOT_ARM (2.13):
 * rounded to odd, the same bits on every ISA. */
#include <float.h>
#include <stddef.h>

#include "common.h"

static npk_error_detail g_detail;

static npk_exec exec_of(npk_backend_kind kind, npk_isa isa, uint32_t blocks) {
  npk_exec e;
  memset(&e, 0, sizeof e);
  e.backend = kind;
  e.isa = isa;
  e.blocks = blocks;
  e.detail = &g_detail;
  return e;
}

static npk_tensor mat(void *data, npk_dtype dt, int64_t r, int64_t c) {
  npk_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dt;
  t.ndim = 2;
  t.shape[0] = r;
  t.shape[1] = c;
  return t;
}

/* One call, sized then run; returns the status of the run (or the size call). */
static npk_status run(const npk_tensor *a, const npk_tensor *b, const npk_matmul_options *o, const npk_tensor *c,
                      const npk_exec *e) {
  size_t bytes = 0;
  npk_status s = npk_matmul_workspace_size(a, b, o, c, e, &bytes);
  void *ws;
  if (s != NPK_OK) return s;
  ws = bytes ? malloc(bytes) : NULL;
  s = npk_matmul(a, b, o, c, ws, bytes, e);
  free(ws);
  return s;
}

enum { M = 37, N = 45, K = 300 };

/* x, or a zero of its sign when subnormal (VDPBF16PS's DAZ). */
static float flush(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }

/* One FMA of VDPBF16PS: x86's FTZ detects tininess after rounding to 24
   bits (unbounded exponent), decided here in double (tests/matmul_dot.rs's
   fma_ftz says why that is exact). */
static float fma_ftz(float a, float b, float c) {
  float r = fmaf(a, b, c);
  return fabs((double)c + (double)a * b) < (double)FLT_MIN * (1.0 - 0x1p-25) ? copysignf(0.0f, r) : r;
}

int main(void) {
  static uint16_t a[M * K], b[K * N], c16[M * N], ref16[M * N];
  static float c32[M * N], acc0[M * N], first[M * N];
  static double want[M * N], absum[M * N];
  int ta, tb, i, j, p, isa;
  uint32_t seed = 57;
  for (i = 0; i < M * K; ++i) {
    seed = seed * 1664525u + 1013904223u;
    a[i] = f2bf((float)((seed >> 8) % 4001) / 1000.0f - 2.0f);
  }
  for (i = 0; i < K * N; ++i) {
    seed = seed * 1664525u + 1013904223u;
    b[i] = f2bf((float)((seed >> 8) % 4001) / 1000.0f - 2.0f);
  }
  for (i = 0; i < M * N; ++i) acc0[i] = (float)(i % 17) - 8.0f;
  for (ta = 0; ta < 2; ++ta) {
    for (tb = 0; tb < 2; ++tb) {
      npk_matmul_options o = {(uint32_t)ta, (uint32_t)tb, 0};
      npk_matmul_options oacc = {(uint32_t)ta, (uint32_t)tb, 1};
      npk_tensor at = ta ? mat(a, NPK_BF16, K, M) : mat(a, NPK_BF16, M, K);
      npk_tensor bt = tb ? mat(b, NPK_BF16, N, K) : mat(b, NPK_BF16, K, N);
      npk_tensor ct16 = mat(c16, NPK_BF16, M, N), ct32 = mat(c32, NPK_F32, M, N);
      npk_tensor rt16 = mat(ref16, NPK_BF16, M, N);
      npk_exec ref = exec_of(NPK_BACKEND_REFERENCE, NPK_ISA_AUTO, 0);
      /* The model: a double sum, with the operands read as stored. */
      for (i = 0; i < M; ++i) {
        for (j = 0; j < N; ++j) {
          double s = 0, t = 0;
          for (p = 0; p < K; ++p) {
            double x = bf2f(a[ta ? p * M + i : i * K + p]);
            double y = bf2f(b[tb ? j * K + p : p * N + j]);
            s += x * y;
            t += fabs(x * y);
          }
          want[i * N + j] = s;
          absum[i * N + j] = t;
        }
      }
      CHECK(run(&at, &bt, &o, &rt16, &ref) == NPK_OK, "reference %s", g_detail.argument);
      for (isa = NPK_ISA_PORTABLE; isa <= (int)npk_detected_isa(); ++isa) {
        uint32_t blocks;
        for (blocks = 1; blocks <= 3; blocks += 2) {
          npk_exec e = exec_of(NPK_BACKEND_CPU, (npk_isa)isa, blocks);
          int bad = 0;
          npk_status st = run(&at, &bt, &o, &ct16, &e);
          if (st == NPK_ERR_ISA_UNAVAILABLE) break; /* another architecture's level */
          CHECK(st == NPK_OK, "bf16 out: %s", g_detail.argument);
          CHECK(run(&at, &bt, &o, &ct32, &e) == NPK_OK, "f32 out: %s", g_detail.argument);
          for (i = 0; i < M * N; ++i) {
            double tol = (K + 1) * absum[i] / 16777216.0;
            float r16 = bf2f(ref16[i]);
            /* bf16: within one bf16 ulp of the reference's rounding plus the chain's bound. */
            if (fabs(bf2f(c16[i]) - r16) > fabs(r16) / 128.0 + tol) bad++;
            if (fabs(c32[i] - want[i]) > fabs(want[i]) / 8388608.0 + tol) bad++;
            if (c16[i] != f2bf(c32[i])) bad++; /* one rounding of the same f32 sum */
          }
          CHECK(bad == 0, "isa %d blocks %u ta %d tb %d: %d elements off", isa, blocks, ta, tb, bad);
          if (isa == NPK_ISA_PORTABLE && blocks == 1) {
            memcpy(first, c32, sizeof c32);
          } else {
            CHECK(memcmp(first, c32, sizeof c32) == 0, "isa %d blocks %u: bits differ from portable", isa, blocks);
          }
          /* accumulate: c's value starts each sum. */
          memcpy(c32, acc0, sizeof c32);
          CHECK(run(&at, &bt, &oacc, &ct32, &e) == NPK_OK, "accumulate: %s", g_detail.argument);
          bad = 0;
          for (i = 0; i < M * N; ++i) {
            double w = acc0[i] + want[i];
            if (fabs(c32[i] - w) > fabs(w) / 8388608.0 + (K + 2) * (absum[i] + fabs(acc0[i])) / 16777216.0) bad++;
          }
          CHECK(bad == 0, "accumulate isa %d: %d elements off", isa, bad);
        }
      }
    }
  }
  /* Bad input: nothing written, the argument named. */
  {
    npk_exec e = exec_of(NPK_BACKEND_CPU, NPK_ISA_AUTO, 0);
    npk_tensor at = mat(a, NPK_BF16, M, K), bt = mat(b, NPK_BF16, K + 1, N - 1);
    npk_tensor ct = mat(c16, NPK_BF16, M, N), ct16f = mat(c16, NPK_F16, M, N);
    npk_matmul_options acc = {0, 0, 1};
    size_t bytes = 0;
    for (i = 0; i < M * N; ++i) c16[i] = 0x7fc1;
    CHECK(run(&at, &bt, NULL, &ct, &e) == NPK_ERR_PARAM_INVALID && strcmp(g_detail.argument, "b") == 0,
          "K mismatch: %s", g_detail.argument);
    bt = mat(b, NPK_BF16, K, N);
    CHECK(run(&at, &bt, &acc, &ct, &e) == NPK_ERR_DTYPE_UNSUPPORTED && strcmp(g_detail.argument, "c") == 0,
          "accumulate into bf16: %s", g_detail.argument);
    CHECK(run(&at, &bt, NULL, &ct16f, &e) == NPK_ERR_DTYPE_UNSUPPORTED, "f16 c for bf16 a");
    CHECK(npk_matmul_workspace_size(&at, &bt, NULL, &ct, &e, &bytes) == NPK_OK && bytes > 64, "size");
    CHECK(npk_matmul(&at, &bt, NULL, &ct, NULL, bytes, &e) == NPK_ERR_NULLPTR, "NULL workspace");
    CHECK(npk_matmul(&at, &bt, NULL, NULL, NULL, 0, &e) == NPK_ERR_NULLPTR, "NULL c");
    for (i = 0; i < M * N; ++i) {
      if (c16[i] != 0x7fc1) {
        CHECK(0, "c written on error at %d", i);
        break;
      }
    }
  }
  /* npk_matmul_v2: the pair dot against its model, every ISA. */
  {
    npk_tensor at = mat(a, NPK_BF16, M, K), bt = mat(b, NPK_BF16, N, K), ct32 = mat(c32, NPK_F32, M, N);
    npk_matmul_v2_options dot = {0, 1, 0, NPK_MATMUL_BF16_DOT}, bad_math = {0, 1, 0, 3};
    static float model[M * N], chain[M * N];
    size_t bytes = 0;
    void *ws;
    for (i = 0; i < M; ++i) {
      for (j = 0; j < N; ++j) {
        float s = 0;
        for (p = 0; p < K; p += 2) {
          /* K is even: no zero step. Inputs flushed, each sum as x86 flushes. */
          float x0 = flush(bf2f(a[i * K + p])), y0 = flush(bf2f(b[j * K + p]));
          float x1 = flush(bf2f(a[i * K + p + 1])), y1 = flush(bf2f(b[j * K + p + 1]));
          s = fma_ftz(x1, y1, s);
          s = fma_ftz(x0, y0, s);
        }
        model[i * N + j] = s;
      }
    }
    for (isa = NPK_ISA_PORTABLE; isa <= (int)npk_detected_isa(); ++isa) {
      npk_exec e = exec_of(NPK_BACKEND_CPU, (npk_isa)isa, 2);
      npk_status st = npk_matmul_v2_workspace_size(&at, &bt, &dot, &ct32, &e, &bytes);
      if (st == NPK_ERR_ISA_UNAVAILABLE) continue;
      CHECK(st == NPK_OK, "v2 size: %s", g_detail.argument);
      ws = malloc(bytes);
      CHECK(npk_matmul_v2(&at, &bt, &dot, &ct32, ws, bytes, &e) == NPK_OK, "v2 dot: %s", g_detail.argument);
      CHECK(memcmp(c32, model, sizeof c32) == 0, "isa %d: the pair dot differs from its model", isa);
      /* NULL options: the chain, npk_matmul's bits. */
      CHECK(npk_matmul_v2(&at, &bt, NULL, &ct32, ws, bytes, &e) == NPK_ERR_PARAM_INVALID, "v2 NULL: b is [N, K]");
      free(ws);
    }
    {
      npk_exec e = exec_of(NPK_BACKEND_CPU, NPK_ISA_AUTO, 1);
      npk_matmul_options tb1 = {0, 1, 0};
      npk_matmul_v2_options chain_opts = {0, 1, 0, NPK_MATMUL_CHAIN};
      CHECK(run(&at, &bt, &tb1, &ct32, &e) == NPK_OK, "chain: %s", g_detail.argument);
      memcpy(chain, c32, sizeof c32);
      CHECK(npk_matmul_v2_workspace_size(&at, &bt, &chain_opts, &ct32, &e, &bytes) == NPK_OK, "v2 chain size");
      ws = malloc(bytes);
      CHECK(npk_matmul_v2(&at, &bt, &chain_opts, &ct32, ws, bytes, &e) == NPK_OK, "v2 chain");
      CHECK(memcmp(c32, chain, sizeof c32) == 0, "v2 with NPK_MATMUL_CHAIN is npk_matmul");
      free(ws);
      for (i = 0; i < M * N; ++i) chain[i] = -7.25f;
      CHECK(npk_matmul_v2_workspace_size(&at, &bt, &bad_math, &ct32, &e, &bytes) == NPK_ERR_PARAM_INVALID &&
                strcmp(g_detail.argument, "math") == 0,
            "math 3: %s", g_detail.argument);
      at = mat(c32, NPK_F32, M, N);
      bt = mat(model, NPK_F32, N, N);
      ct32 = mat(chain, NPK_F32, M, N);
      CHECK(npk_matmul_v2_workspace_size(&at, &bt, &dot, &ct32, &e, &bytes) == NPK_ERR_PARAM_INVALID &&
                strcmp(g_detail.argument, "math") == 0,
            "f32 with the pair dot: %s", g_detail.argument);
      CHECK(npk_matmul_v2(&at, &bt, &dot, &ct32, NULL, 0, &e) == NPK_ERR_PARAM_INVALID, "f32 with the pair dot, run");
      for (i = 0; i < M * N; ++i) {
        if (chain[i] != -7.25f) {
          CHECK(0, "c written on error at %d", i);
          break;
        }
      }
    }
  }
  /* NPK_MATMUL_BF16_DOT_ARM (2.13): BFDOT's sums, rounded to odd. 1 x 1 x
   * 4: (1 + 2^-30) then + 2^-30 keeps a last bit (0x3f800001) where
   * nearest-even gives 1; and the same bits on every ISA. */
  {
    static uint16_t a4[4] = {0x3f80, 0x3800, 0x3800, 0}, b4[4] = {0x3f80, 0x3800, 0x3800, 0};
    float c1 = -7.25f, first[M * N];
    npk_tensor at = mat(a4, NPK_BF16, 1, 4), bt = mat(b4, NPK_BF16, 4, 1), ct = mat(&c1, NPK_F32, 1, 1);
    npk_matmul_v2_options arm = {0, 0, 0, NPK_MATMUL_BF16_DOT_ARM}, arm_t = {0, 1, 0, NPK_MATMUL_BF16_DOT_ARM};
    npk_exec e = exec_of(NPK_BACKEND_CPU, NPK_ISA_AUTO, 1);
    size_t bytes = 0;
    void *ws;
    uint32_t bits;
    int seen = 0;
    CHECK(npk_matmul_v2_workspace_size(&at, &bt, &arm, &ct, &e, &bytes) == NPK_OK, "arm size: %s", g_detail.argument);
    ws = malloc(bytes);
    CHECK(npk_matmul_v2(&at, &bt, &arm, &ct, ws, bytes, &e) == NPK_OK, "arm: %s", g_detail.argument);
    memcpy(&bits, &c1, 4);
    CHECK(bits == 0x3f800001u, "arm dot 1 + 2^-30 + 2^-30: %#x", (unsigned)bits);
    free(ws);
    at = mat(a, NPK_BF16, M, K);
    bt = mat(b, NPK_BF16, N, K);
    ct = mat(c32, NPK_F32, M, N);
    for (isa = NPK_ISA_PORTABLE; isa <= (int)npk_detected_isa(); ++isa) {
      npk_exec ei = exec_of(NPK_BACKEND_CPU, (npk_isa)isa, 2);
      npk_status st = npk_matmul_v2_workspace_size(&at, &bt, &arm_t, &ct, &ei, &bytes);
      if (st == NPK_ERR_ISA_UNAVAILABLE) continue;
      CHECK(st == NPK_OK, "arm v2 size: %s", g_detail.argument);
      ws = malloc(bytes);
      CHECK(npk_matmul_v2(&at, &bt, &arm_t, &ct, ws, bytes, &ei) == NPK_OK, "arm v2: %s", g_detail.argument);
      if (!seen) memcpy(first, c32, sizeof c32);
      CHECK(memcmp(c32, first, sizeof c32) == 0, "isa %d: the arm pair dot differs across ISAs", isa);
      seen = 1;
      free(ws);
    }
  }
  printf("test_matmul: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
