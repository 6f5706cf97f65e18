// oneDNN vs npukern RMS normalization, side by side in one process.
// Build: see run.sh.  Run pinned: taskset -c 0 ./bench
#include <oneapi/dnnl/dnnl.hpp>
#include "npukern.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <time.h>

using namespace dnnl;
using clk = std::chrono::steady_clock;

static const size_t LLC = 48ull << 20;
static int REPS = 21, WARM = 2;

static void die(const char *what) { fprintf(stderr, "FATAL: %s\n", what); exit(1); }

static void *aalloc(size_t bytes) {
  size_t b = (bytes + 63) / 64 * 64;
  void *p = aligned_alloc(64, b ? b : 64);
  if (!p) die("aligned_alloc");
  memset(p, 0, b ? b : 64);  // fault the pages in
  return p;
}

static inline uint16_t f2bf(float f) {  // round to nearest even
  uint32_t u; memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
static inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  float next() {  // uniform [-2, 2)
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((s >> 40) * (1.0 / 16777216.0)) * 4.0f - 2.0f;
  }
};

static void fill(void *p, size_t n, bool bf16, uint64_t seed) {
  Rng r(seed);
  if (bf16) { uint16_t *q = (uint16_t *)p; for (size_t i = 0; i < n; ++i) q[i] = f2bf(r.next()); }
  else { float *q = (float *)p; for (size_t i = 0; i < n; ++i) q[i] = r.next(); }
}
static float getf(const void *p, size_t i, bool bf16) {
  return bf16 ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static double cpu_ms(clockid_t id) { timespec t; clock_gettime(id, &t); return t.tv_sec * 1e3 + t.tv_nsec * 1e-6; }
static double pct(std::vector<double> v, double p) { std::sort(v.begin(), v.end()); return v[(size_t)(p * (v.size() - 1) + 0.5)]; }
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
static double vmin(const std::vector<double> &v) { return *std::min_element(v.begin(), v.end()); }

static void npk_check(npk_status s, const npk_error_detail &e, const char *what) {
  if (s != NPK_OK) { fprintf(stderr, "npukern %s: %s (%s): %s\n", what, npk_status_string(s), e.argument, e.message); exit(1); }
}

// ulp distance between two bf16 / f32 values (monotone integer mapping)
static int64_t ord(float f, bool bf16) {
  if (bf16) { uint16_t b = f2bf(f); int32_t v = b & 0x7fff; return (b & 0x8000) ? -v : v; }
  int32_t u; memcpy(&u, &f, 4); int64_t v = u & 0x7fffffff; return (u < 0) ? -v : v;
}

struct Cmp { double max_abs = 0, ref_absmax = 0; int64_t max_ulp = 0; size_t n_gt1ulp = 0; };
static Cmp compare(const void *a, const void *b, size_t n, bool bf16_a, bool bf16_b) {
  Cmp c;
  for (size_t i = 0; i < n; ++i) {
    float x = getf(a, i, bf16_a), y = getf(b, i, bf16_b);
    c.max_abs = std::max(c.max_abs, (double)std::fabs(x - y));
    c.ref_absmax = std::max(c.ref_absmax, (double)std::fabs(y));
    int64_t u = std::llabs(ord(x, bf16_a) - ord(y, bf16_b));
    c.max_ulp = std::max(c.max_ulp, u);
    if (u > 1) c.n_gt1ulp++;
  }
  return c;
}

struct Result { double d_fwd, n_fwd, m_fwd, d_bwd, n_bwd, m_bwd; double d_fwd_min, n_fwd_min, m_fwd_min, d_bwd_min, n_bwd_min, m_bwd_min; };

static Result run_case(engine &eng, stream &strm, int64_t M, int64_t N, bool bf16, const char *label) {
  const size_t es = bf16 ? 2 : 4;
  const size_t xb = (size_t)M * N * es;
  const memory::data_type dt = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  const npk_dtype ndt = bf16 ? NPK_BF16 : NPK_F32;
  const float eps = 1e-6f;

  // Buffer sets: in = [x | dy], out = [dnnl out | npk out], per-set stats.
  // Every op call uses the next set, so between two touches of one set at
  // least (K-1) * 2 * xb bytes of other data stream through the caches.
  int K = (int)std::max<size_t>(4, (2 * LLC + xb - 1) / xb + 1);
  size_t ws_bytes_rot = (size_t)K * 4 * xb;
  struct Set { char *in, *out; float *var, *mean, *rstd; };
  std::vector<Set> sets(K);
  for (int k = 0; k < K; ++k) {
    sets[k].in = (char *)aalloc(2 * xb);
    sets[k].out = (char *)aalloc(2 * xb);
    sets[k].var = (float *)aalloc(M * 4);
    sets[k].mean = (float *)aalloc(M * 4);
    sets[k].rstd = (float *)aalloc(M * 4);
    fill(sets[k].in, (size_t)M * N, bf16, 1000 + 2 * k);            // x
    fill(sets[k].in + xb, (size_t)M * N, bf16, 1001 + 2 * k);       // dy
  }
  float *gamma = (float *)aalloc(N * 4);
  { Rng r(7); for (int64_t j = 0; j < N; ++j) gamma[j] = r.next(); }
  float *dscale_d = (float *)aalloc(N * 4), *dgamma_n = (float *)aalloc(N * 4);

  // ---------------- oneDNN primitives ----------------
  memory::desc x_md({M, N}, dt, memory::format_tag::ab);
  memory::desc st_md({M}, memory::data_type::f32, memory::format_tag::a);
  memory::desc sc_md({N}, memory::data_type::f32, memory::format_tag::a);
  auto flags = normalization_flags::rms_norm | normalization_flags::use_scale;
  layer_normalization_forward::primitive_desc fpd(eng, prop_kind::forward_training, x_md, x_md, st_md, eps, flags);
  layer_normalization_backward::primitive_desc bpd(eng, prop_kind::backward, x_md, x_md, x_md, st_md, eps, flags, fpd);
  layer_normalization_forward fwd(fpd);
  layer_normalization_backward bwd(bpd);
  printf("[%s] oneDNN impl fwd=%s bwd=%s  K=%d sets, rotation working set %.0f MiB\n", label,
         fpd.impl_info_str(), bpd.impl_info_str(), K, ws_bytes_rot / 1048576.0);

  memory gamma_m(sc_md, eng, gamma), dscale_m(sc_md, eng, dscale_d);
  struct DSet { memory x, dy, y, dx, var, mean; };
  std::vector<DSet> dm(K);
  for (int k = 0; k < K; ++k) {
    dm[k].x = memory(x_md, eng, sets[k].in);
    dm[k].dy = memory(x_md, eng, sets[k].in + xb);
    dm[k].y = memory(x_md, eng, sets[k].out);
    dm[k].dx = memory(x_md, eng, sets[k].out);
    dm[k].var = memory(st_md, eng, sets[k].var);
    dm[k].mean = memory(st_md, eng, sets[k].mean);
  }
  auto d_fwd = [&](int k) {
    fwd.execute(strm, {{DNNL_ARG_SRC, dm[k].x}, {DNNL_ARG_DST, dm[k].y}, {DNNL_ARG_SCALE, gamma_m},
                       {DNNL_ARG_MEAN, dm[k].mean}, {DNNL_ARG_VARIANCE, dm[k].var}});
    strm.wait();
  };
  auto d_bwd = [&](int k) {
    bwd.execute(strm, {{DNNL_ARG_SRC, dm[k].x}, {DNNL_ARG_DIFF_DST, dm[k].dy}, {DNNL_ARG_SCALE, gamma_m},
                       {DNNL_ARG_MEAN, dm[k].mean}, {DNNL_ARG_VARIANCE, dm[k].var},
                       {DNNL_ARG_DIFF_SRC, dm[k].dx}, {DNNL_ARG_DIFF_SCALE, dscale_m}});
    strm.wait();
  };

  // ---------------- npukern ----------------
  npk_error_detail err;
  npk_exec ex; memset(&ex, 0, sizeof ex);  // CPU backend, ISA auto, parallel_for NULL = serial
  ex.detail = &err;
  npk_tensor gt = npk_tensor_make(gamma, NPK_F32, N);
  npk_tensor dgt = npk_tensor_make(dgamma_n, NPK_F32, N);
  size_t fws = 0, bws = 0;
  {
    npk_tensor xt = npk_tensor_make(sets[0].in, ndt, M, N);
    npk_tensor rt = npk_tensor_make(sets[0].rstd, NPK_F32, M);
    npk_check(npk_rms_norm_workspace_size(&xt, &gt, NULL, &ex, &fws), err, "fwd ws size");
    npk_check(npk_rms_norm_grad_workspace_size(&xt, &xt, &rt, &gt, NULL, &ex, &bws), err, "bwd ws size");
  }
  void *fwsp = aalloc(fws), *bwsp = aalloc(bws);
  auto n_fwd = [&](int k) {
    npk_tensor xt = npk_tensor_make(sets[k].in, ndt, M, N);
    npk_tensor yt = npk_tensor_make(sets[k].out + xb, ndt, M, N);
    npk_tensor rt = npk_tensor_make(sets[k].rstd, NPK_F32, M);
    npk_check(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, fwsp, fws, &ex), err, "rms_norm");
  };
  auto n_bwd = [&](int k) {
    npk_tensor xt = npk_tensor_make(sets[k].in, ndt, M, N);
    npk_tensor dyt = npk_tensor_make(sets[k].in + xb, ndt, M, N);
    npk_tensor dxt = npk_tensor_make(sets[k].out + xb, ndt, M, N);
    npk_tensor rt = npk_tensor_make(sets[k].rstd, NPK_F32, M);
    npk_check(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &dxt, &dgt, NULL, bwsp, bws, &ex), err, "rms_norm_grad");
  };
  auto m_fwd = [&](int k) { memcpy(sets[k].out, sets[k].in, xb); };
  auto m_bwd = [&](int k) { memcpy(sets[k].out, sets[k].in, xb + xb / 2); };

  // ---------------- sanity: same computation ----------------
  {
    d_fwd(0); n_fwd(0);
    Cmp cy = compare(sets[0].out + xb, sets[0].out, (size_t)M * N, bf16, bf16);
    double rmax = 0;
    for (int64_t i = 0; i < M; ++i) {
      double r_d = 1.0 / std::sqrt((double)sets[0].var[i] + eps);
      rmax = std::max(rmax, std::fabs(sets[0].rstd[i] - r_d) / r_d);
    }
    printf("[%s] check fwd: y npk vs dnnl max_ulp=%lld (#>1ulp=%zu) max_abs=%.3g (|y|max %.3g); rstd vs 1/sqrt(var+eps) max_rel=%.3g\n",
           label, (long long)cy.max_ulp, cy.n_gt1ulp, cy.max_abs, cy.ref_absmax, rmax);
    d_bwd(0); n_bwd(0);
    Cmp cx = compare(sets[0].out + xb, sets[0].out, (size_t)M * N, bf16, bf16);
    Cmp cg = compare(dgamma_n, dscale_d, N, false, false);
    printf("[%s] check bwd: dx max_ulp=%lld (#>1ulp=%zu of %lld) max_abs=%.3g (rel to |dx|max %.3g); dgamma max_abs=%.3g rel-to-max %.3g\n",
           label, (long long)cx.max_ulp, cx.n_gt1ulp, (long long)(M * N), cx.max_abs, cx.max_abs / cx.ref_absmax,
           cg.max_abs, cg.max_abs / cg.ref_absmax);
    // float64 reference of the exact RMSNorm gradient on the first rows:
    // dx = rstd * (g - xh * mean(g * xh)), g = dy * gamma, xh = x * rstd
    {
      const int64_t R = std::min<int64_t>(M, 16);
      double e_d = 0, e_n = 0, e_d_ln = 0, amax = 0;
      for (int64_t i = 0; i < R; ++i) {
        const void *x = sets[0].in, *dy = sets[0].in + xb;
        double ss = 0;
        for (int64_t j = 0; j < N; ++j) { double v = getf(x, i * N + j, bf16); ss += v * v; }
        double rs = 1.0 / std::sqrt(ss / N + eps), c = 0, mg = 0;
        for (int64_t j = 0; j < N; ++j) {
          double g = getf(dy, i * N + j, bf16) * (double)gamma[j];
          c += g * getf(x, i * N + j, bf16) * rs; mg += g;
        }
        c /= N; mg /= N;
        for (int64_t j = 0; j < N; ++j) {
          double g = getf(dy, i * N + j, bf16) * (double)gamma[j], xh = getf(x, i * N + j, bf16) * rs;
          double ref = rs * (g - xh * c), ref_ln = rs * (g - mg - xh * c);
          amax = std::max(amax, std::fabs(ref));
          e_d = std::max(e_d, std::fabs(getf(sets[0].out, i * N + j, bf16) - ref));
          e_n = std::max(e_n, std::fabs(getf(sets[0].out + xb, i * N + j, bf16) - ref));
          e_d_ln = std::max(e_d_ln, std::fabs(getf(sets[0].out, i * N + j, bf16) - ref_ln));
        }
      }
      printf("[%s] check bwd vs f64 (first %lld rows), max_abs/|dx|max: exact RMSNorm grad rstd*(g - xh*mean(g*xh)): "
             "oneDNN %.3g, npukern %.3g; oneDNN vs rstd*(g - mean(g) - xh*mean(g*xh)) %.3g\n",
             label, (long long)R, e_d / amax, e_n / amax, e_d_ln / amax);
    }
    // backward inputs for every set: each library's own forward stats
    for (int k = 0; k < K; ++k) { d_fwd(k); n_fwd(k); }
  }

  // ---------------- timing ----------------
  auto ms = [](clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  std::vector<double> tdf, tnf, tmf, tdb, tnb, tmb;
  std::vector<double> cpu_main[6], cpu_proc[6];  // per (phase*3+which): main-thread / whole-process CPU ms
  int ctr = 0;
  for (int phase = 0; phase < 2; ++phase) {          // 0 = forward, 1 = backward
    for (int r = 0; r < WARM + REPS; ++r) {
      for (int j = 0; j < 3; ++j) {
        int which = (j + r) % 3;                      // rotate the order each rep
        int k = ctr++ % K;
        double c0 = cpu_ms(CLOCK_THREAD_CPUTIME_ID), p0 = cpu_ms(CLOCK_PROCESS_CPUTIME_ID);
        auto t0 = clk::now();
        if (phase == 0) { if (which == 0) d_fwd(k); else if (which == 1) n_fwd(k); else m_fwd(k); }
        else { if (which == 0) d_bwd(k); else if (which == 1) n_bwd(k); else m_bwd(k); }
        auto t1 = clk::now();
        double c1 = cpu_ms(CLOCK_THREAD_CPUTIME_ID), p1 = cpu_ms(CLOCK_PROCESS_CPUTIME_ID);
        if (r < WARM) continue;
        cpu_main[phase * 3 + which].push_back(c1 - c0);
        cpu_proc[phase * 3 + which].push_back(p1 - p0);
        double t = ms(t0, t1);
        auto &v = phase == 0 ? (which == 0 ? tdf : which == 1 ? tnf : tmf) : (which == 0 ? tdb : which == 1 ? tnb : tmb);
        v.push_back(t);
      }
    }
  }
  {
    const char *nm[6] = {"dnnl fwd", "npk fwd", "memcpy fwd", "dnnl bwd", "npk bwd", "memcpy bwd"};
    std::vector<double> *tv[6] = {&tdf, &tnf, &tmf, &tdb, &tnb, &tmb};
    printf("[%s] spread (wall ms min/p25/med/p75/max; median CPU ms main-thread/process):\n", label);
    for (int i = 0; i < 6; ++i)
      printf("    %-10s %8.3f %8.3f %8.3f %8.3f %8.3f | cpu %8.3f %8.3f\n", nm[i], vmin(*tv[i]), pct(*tv[i], .25),
             median(*tv[i]), pct(*tv[i], .75), pct(*tv[i], 1.0), median(cpu_main[i]), median(cpu_proc[i]));
  }
  Result R{median(tdf), median(tnf), median(tmf), median(tdb), median(tnb), median(tmb),
           vmin(tdf), vmin(tnf), vmin(tmf), vmin(tdb), vmin(tnb), vmin(tmb)};

  for (auto &s : sets) { free(s.in); free(s.out); free(s.var); free(s.mean); free(s.rstd); }
  free(gamma); free(dscale_d); free(dgamma_n); free(fwsp); free(bwsp);
  return R;
}

// fixed per-call overhead of a oneDNN execute + stream.wait() on a tiny problem
static double dnnl_overhead(engine &eng, stream &strm) {
  const int64_t M = 1, N = 16;
  memory::desc x_md({M, N}, memory::data_type::f32, memory::format_tag::ab);
  memory::desc st_md({M}, memory::data_type::f32, memory::format_tag::a);
  memory::desc sc_md({N}, memory::data_type::f32, memory::format_tag::a);
  layer_normalization_forward::primitive_desc fpd(eng, prop_kind::forward_training, x_md, x_md, st_md, 1e-6f,
                                                  normalization_flags::rms_norm | normalization_flags::use_scale);
  layer_normalization_forward fwd(fpd);
  float *x = (float *)aalloc(64 * 4), *y = (float *)aalloc(64 * 4), *g = (float *)aalloc(64 * 4), *v = (float *)aalloc(64), *m = (float *)aalloc(64);
  fill(x, N, false, 3); fill(g, N, false, 4);
  memory xm(x_md, eng, x), ym(x_md, eng, y), gm(sc_md, eng, g), vm(st_md, eng, v), mm(st_md, eng, m);
  std::vector<double> t;
  for (int i = 0; i < 1000; ++i) {
    auto t0 = clk::now();
    fwd.execute(strm, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_DST, ym}, {DNNL_ARG_SCALE, gm}, {DNNL_ARG_MEAN, mm}, {DNNL_ARG_VARIANCE, vm}});
    strm.wait();
    auto t1 = clk::now();
    if (i >= 100) t.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  free(x); free(y); free(g); free(v); free(m);
  return median(t);
}

int main(int argc, char **argv) {
  if (argc > 1) REPS = atoi(argv[1]);
  const dnnl_version_t *v = dnnl_version();
  printf("dnnl_version: %d.%d.%d (hash %s) cpu_runtime=%u gpu_runtime=%u\n", v->major, v->minor, v->patch, v->hash,
         v->cpu_runtime, v->gpu_runtime);
  printf("npukern: %s, detected isa=%d (3=AVX512, 4=AVX512-BF16), exec=serial (parallel_for NULL)\n", npk_version(), (int)npk_detected_isa());
  engine eng;
  try { eng = engine(engine::kind::cpu, 0); }
  catch (dnnl::error &e) { fprintf(stderr, "oneDNN cpu engine creation failed: %s (status %d)\n", e.what(), (int)e.status); return 2; }
  printf("engine kind: %s\n", eng.get_kind() == engine::kind::cpu ? "cpu" : "other");
  stream strm(eng);
  printf("reps=%d (median), warm-up=%d; tiny-problem oneDNN execute+wait overhead: %.4f ms\n", REPS, WARM, dnnl_overhead(eng, strm));

  struct Case { int64_t a, b, h; };
  const Case cases[] = {{1024, 1, 12288}, {512, 4, 4096}, {4, 2048, 5120}, {2, 2048, 4096}};
  std::vector<std::string> rows;
  for (int d = 0; d < 2; ++d) {
    bool bf16 = d == 0;
    for (auto &c : cases) {
      char label[96];
      snprintf(label, sizeof label, "%s [%lld*%lld, %lld]", bf16 ? "bf16" : "f32", (long long)c.a, (long long)c.b, (long long)c.h);
      Result R = run_case(eng, strm, c.a * c.b, c.h, bf16, label);
      char row[512];
      snprintf(row, sizeof row,
               "| %s | %.3f | %.3f | %.3f | %.2f | %.3f | %.3f | %.3f | %.2f | %.2f / %.2f | %.2f / %.2f |", label,
               R.d_fwd, R.n_fwd, R.m_fwd, R.n_fwd / R.d_fwd, R.d_bwd, R.n_bwd, R.m_bwd, R.n_bwd / R.d_bwd,
               R.d_fwd / R.m_fwd, R.n_fwd / R.m_fwd, R.d_bwd / R.m_bwd, R.n_bwd / R.m_bwd);
      rows.push_back(row);
      printf("[%s] min ms: dnnl fwd %.3f npk fwd %.3f memcpy %.3f | dnnl bwd %.3f npk bwd %.3f memcpy1.5x %.3f\n", label,
             R.d_fwd_min, R.n_fwd_min, R.m_fwd_min, R.d_bwd_min, R.n_bwd_min, R.m_bwd_min);
      fflush(stdout);
    }
  }
  printf("\n| case | oneDNN fwd ms | npk fwd ms | memcpy x ms | fwd npk/oneDNN | oneDNN bwd ms | npk bwd ms | memcpy 1.5x ms | bwd npk/oneDNN | fwd oneDNN/memcpy , npk/memcpy | bwd oneDNN/memcpy , npk/memcpy |\n");
  printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (auto &r : rows) printf("%s\n", r.c_str());
  return 0;
}
