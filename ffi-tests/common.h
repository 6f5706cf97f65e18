/* Helpers shared by the C11 and C++17 tests (test_c.c, test_cpp.cpp): element conversion, random
 * data, tensor descriptors, tolerant comparison and a tiny check counter.
 * Plain C11 that is also valid C++17; no compiler extensions (the tests
 * build with -pedantic). */
#ifndef NPK_FFI_COMMON_H
#define NPK_FFI_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npukern.h"

static int g_passed = 0;
static int g_failed = 0;

#define CHECK(cond, ...)                                                \
  do {                                                                  \
    if (cond) {                                                         \
      g_passed++;                                                       \
    } else {                                                            \
      g_failed++;                                                       \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);   \
      fprintf(stderr, __VA_ARGS__);                                     \
      fprintf(stderr, "\n");                                            \
    }                                                                   \
  } while (0)

/* ---- element conversion ---- */

static inline uint32_t f2bits(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  return x;
}

static inline float bits2f(uint32_t x) {
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static inline uint16_t f2bf(float f) {
  uint32_t x = f2bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static inline float bf2f(uint16_t h) { return bits2f((uint32_t)h << 16); }

/* f32 -> f16, round to nearest even (finite inputs of moderate size). */
static inline uint16_t f2h(float f) {
  uint32_t x = f2bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  int32_t e = (int32_t)((x >> 23) & 0xffu) - 127 + 15;
  uint32_t m = x & 0x7fffffu;
  if (((x >> 23) & 0xffu) == 0xffu) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0u));
  if (((x >> 23) & 0xffu) == 0) return (uint16_t)sign;
  if (e >= 31) return (uint16_t)(sign | 0x7c00u);
  if (e <= 0) {
    uint32_t shift, h, rem, half;
    if (e < -10) return (uint16_t)sign;
    m |= 0x800000u;
    shift = (uint32_t)(14 - e);
    h = m >> shift;
    rem = m & ((1u << shift) - 1u);
    half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
  } else {
    uint32_t h = ((uint32_t)e << 10) | (m >> 13);
    uint32_t rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
  }
}

static inline float h2f(uint16_t h) {
  uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  uint32_t e = ((uint32_t)h >> 10) & 0x1fu;
  uint32_t m = (uint32_t)h & 0x3ffu;
  if (e == 0) {
    float v = (float)m / 16777216.0f; /* m * 2^-24 */
    return sign ? -v : v;
  }
  if (e == 31) return bits2f(sign | 0x7f800000u | (m << 13));
  return bits2f(sign | ((e - 15u + 127u) << 23) | (m << 13));
}

static inline size_t dsize(npk_dtype dt) {
  switch (dt) {
    case NPK_F16:
    case NPK_BF16: return 2;
    case NPK_I64: return 8;
    default: return 4;
  }
}

static inline const char *dname(npk_dtype dt) {
  switch (dt) {
    case NPK_F32: return "f32";
    case NPK_F16: return "f16";
    case NPK_BF16: return "bf16";
    case NPK_I32: return "i32";
    default: return "i64";
  }
}

static inline double get(const void *p, npk_dtype dt, size_t i) {
  switch (dt) {
    case NPK_F32: return ((const float *)p)[i];
    case NPK_F16: return h2f(((const uint16_t *)p)[i]);
    case NPK_BF16: return bf2f(((const uint16_t *)p)[i]);
    case NPK_I32: return ((const int32_t *)p)[i];
    default: return (double)((const int64_t *)p)[i];
  }
}

static inline void put(void *p, npk_dtype dt, size_t i, double v) {
  switch (dt) {
    case NPK_F32: ((float *)p)[i] = (float)v; break;
    case NPK_F16: ((uint16_t *)p)[i] = f2h((float)v); break;
    case NPK_BF16: ((uint16_t *)p)[i] = f2bf((float)v); break;
    case NPK_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    default: ((int64_t *)p)[i] = (int64_t)v; break;
  }
}

/* ---- random data ---- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static inline double urand(double lo, double hi) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return lo + (hi - lo) * (double)(g_rng >> 11) / 9007199254740992.0;
}

/* ---- buffers and descriptors ---- */

typedef struct {
  void *p;
  npk_dtype dt;
  size_t n;
} buf;

static inline buf balloc(npk_dtype dt, size_t n) {
  buf b;
  b.dt = dt;
  b.n = n;
  b.p = calloc(n ? n : 1, dsize(dt));
  if (!b.p) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  return b;
}

static inline buf bclone(buf src) {
  buf b = balloc(src.dt, src.n);
  memcpy(b.p, src.p, src.n * dsize(src.dt));
  return b;
}

static inline void bfree(buf *b) {
  free(b->p);
  b->p = NULL;
}

static inline void bfill_rand(buf b, double lo, double hi) {
  size_t i;
  for (i = 0; i < b.n; i++) put(b.p, b.dt, i, urand(lo, hi));
}

static inline void bfill(buf b, double v) {
  size_t i;
  for (i = 0; i < b.n; i++) put(b.p, b.dt, i, v);
}

static inline int bsame(buf a, buf b) { return a.n == b.n && memcmp(a.p, b.p, a.n * dsize(a.dt)) == 0; }

static inline npk_tensor tens(void *data, npk_dtype dt, uint32_t ndim, const int64_t *shape) {
  npk_tensor t;
  uint32_t i;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dt;
  t.ndim = ndim;
  for (i = 0; i < ndim && i < NPK_MAX_DIMS; i++) t.shape[i] = shape[i];
  return t;
}

static inline npk_tensor btens(buf b, uint32_t ndim, const int64_t *shape) { return tens(b.p, b.dt, ndim, shape); }

/* Relative tolerance of one rounding to dt, with slack for f32 arithmetic. */
static inline double tol_of(npk_dtype dt) {
  switch (dt) {
    case NPK_F16: return 2.5e-3;
    case NPK_BF16: return 2e-2;
    default: return 2e-5;
  }
}

/* |a - b| <= tol * max(|b|, floor_frac * max|b|) for every element; prints
 * the worst element when it fails. */
static inline int close_enough(buf got, buf want, double tol, double floor_frac, const char *what) {
  size_t i, worst = 0;
  double scale = 0, worst_err = -1;
  int ok = 1;
  if (got.n != want.n) return 0;
  for (i = 0; i < want.n; i++) scale = fmax(scale, fabs(get(want.p, want.dt, i)));
  for (i = 0; i < want.n; i++) {
    double a = get(got.p, got.dt, i), b = get(want.p, want.dt, i);
    double lim = tol * fmax(fabs(b), floor_frac * scale) + 1e-30;
    double err = fabs(a - b);
    if (!(err <= lim)) {
      if (ok || err > worst_err) {
        worst = i;
        worst_err = err;
      }
      ok = 0;
    }
  }
  if (!ok)
    fprintf(stderr, "  %s: element %zu: got %.9g want %.9g\n", what, worst, get(got.p, got.dt, worst),
            get(want.p, want.dt, worst));
  return ok;
}

#endif
