/* The C ABI's growth rule, tested against the built library (docs/c-api.md,
 * "Stability"):
 *  - npk_abi_version() matches the header's NPK_ABI_VERSION;
 *  - a foreign backend compiled against an older, shorter npk_foreign_backend
 *    (here: only the first entry, as if it predated the others) runs: its
 *    entry is called, and the operators it has no entry for run on the CPU
 *    with the CPU's bits. The table sits flush against a PROT_NONE page, so
 *    a read past its struct_size crashes the test;
 *  - a table from a newer header (more entries than this library knows)
 *    runs, its extra entries never called;
 *  - npk_isa_name names the ISAs of the library list;
 *  - a struct_size that cannot be a table is NPK_ERR_PARAM_INVALID "foreign",
 *    nothing written;
 *  - the store hint (2.3: NPK_OUTPUTS_* bits above npk_exec.backend's kind)
 *    changes no output bit on any backend, and bits outside it (or both
 *    hints) are NPK_ERR_PARAM_INVALID "backend", nothing written; a caller
 *    from before 2.3 sets none of them (the zeroed exec above).
 * Built and run by ffi-tests/run.sh; exit status 0 = every check passed. */
#define _DEFAULT_SOURCE
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"

/* A backend built against a header whose table had one entry. */
typedef struct old_backend {
  size_t struct_size;
  void *ctx;
  npk_status (*rms_norm)(void *ctx, const npk_rms_norm_call *call);
} old_backend;

/* A backend built against a future header with two more entries. */
typedef struct new_backend {
  npk_foreign_backend known;
  npk_status (*future_a)(void *ctx, const void *call);
  npk_status (*future_b)(void *ctx, const void *call);
} new_backend;

static int g_calls;
static npk_error_detail g_d;

static npk_status counting_rms_norm(void *ctx, const npk_rms_norm_call *c) {
  npk_exec cpu;
  npk_rms_norm_options o;
  (void)ctx;
  g_calls++;
  memset(&cpu, 0, sizeof cpu);
  o.eps = c->eps;
  o.gamma_offset = c->gamma_offset;
  o.rounding = c->rounding;
  return npk_rms_norm(&c->x, &c->gamma, &o, &c->y, c->has_rstd ? &c->rstd : NULL, c->workspace,
                      c->workspace_bytes, &cpu);
}

static npk_status never(void *ctx, const void *call) {
  (void)ctx;
  (void)call;
  fprintf(stderr, "FAIL: an entry beyond this library's table was called\n");
  exit(1);
}

/* `bytes` of memory ending exactly at a PROT_NONE page. */
static void *flush_against_guard(size_t bytes) {
  long page = sysconf(_SC_PAGESIZE);
  char *p = (char *)mmap(NULL, (size_t)page * 2, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    exit(2);
  }
  if (mprotect(p + page, (size_t)page, PROT_NONE) != 0) {
    perror("mprotect");
    exit(2);
  }
  return p + page - bytes;
}

enum { ROWS = 5, COLS = 67, VOCAB = 9 };

/* Runs RmsNorm, RmsNormGrad and EmbeddingDenseGrad on `e`; returns the outputs' bytes. */
static void run_all(const npk_exec *e, float *y, float *dx, float *dg, float *table) {
  static float x[ROWS * COLS], gamma[COLS], dy[ROWS * COLS], rstd[ROWS];
  static int64_t idx[ROWS];
  static unsigned char ws[1 << 20];
  const int64_t xs[2] = {ROWS, COLS}, gs[1] = {COLS}, rs[1] = {ROWS}, is[1] = {ROWS}, ts[2] = {VOCAB, COLS};
  npk_tensor xt = tens(x, NPK_F32, 2, xs), gt = tens(gamma, NPK_F32, 1, gs), yt = tens(y, NPK_F32, 2, xs),
             rt = tens(rstd, NPK_F32, 1, rs), dyt = tens(dy, NPK_F32, 2, xs), dxt = tens(dx, NPK_F32, 2, xs),
             dgt = tens(dg, NPK_F32, 1, gs), it = tens(idx, NPK_I64, 1, is), tt = tens(table, NPK_F32, 2, ts);
  size_t need = 0;
  int i;
  srand(7);
  for (i = 0; i < ROWS * COLS; i++) {
    x[i] = (float)rand() / (float)RAND_MAX * 4.0f - 2.0f;
    dy[i] = (float)rand() / (float)RAND_MAX - 0.5f;
  }
  for (i = 0; i < COLS; i++) gamma[i] = 0.5f + (float)i / COLS;
  for (i = 0; i < ROWS; i++) idx[i] = (i * 4) % VOCAB;
  CHECK(npk_rms_norm_workspace_size(&xt, &gt, NULL, e, &need) == NPK_OK && need <= sizeof ws, "ws %zu", need);
  CHECK(npk_rms_norm(&xt, &gt, NULL, &yt, &rt, ws, sizeof ws, e) == NPK_OK, "rms_norm: %s", g_d.message);
  CHECK(npk_rms_norm_grad(&dyt, &xt, &rt, &gt, NULL, NULL, &dxt, &dgt, NULL, ws, sizeof ws, e) == NPK_OK,
        "rms_norm_grad: %s", g_d.message);
  CHECK(npk_embedding_dense_grad(&dyt, &it, VOCAB, NULL, &tt, ws, sizeof ws, e) == NPK_OK, "embedding: %s",
        g_d.message);
}

int main(void) {
  static float y0[ROWS * COLS], dx0[ROWS * COLS], dg0[COLS], t0[VOCAB * COLS];
  static float y1[ROWS * COLS], dx1[ROWS * COLS], dg1[COLS], t1[VOCAB * COLS];
  npk_exec cpu, e;
  old_backend *old;
  new_backend *nb;
  npk_foreign_backend *min;
  size_t bad[4] = {0, sizeof(size_t), NPK_FOREIGN_BACKEND_MIN_SIZE + 3, NPK_FOREIGN_BACKEND_MIN_SIZE - 1};
  int i;

  CHECK(npk_abi_version() == NPK_ABI_VERSION, "library ABI %#x, header %#x", npk_abi_version(),
        (unsigned)NPK_ABI_VERSION);
  CHECK(npk_abi_version() >> 16 == NPK_ABI_VERSION_MAJOR, "%s", "major");
  CHECK(NPK_FOREIGN_BACKEND_MIN_SIZE == 2 * sizeof(void *), "%s", "min size");
  /* ISA names come from the library's one ISA list. */
  CHECK(strcmp(npk_isa_name(NPK_ISA_AVX2), "avx2") == 0 && strcmp(npk_isa_name(NPK_ISA_AUTO), "auto") == 0 &&
            strcmp(npk_isa_name(NPK_ISA_AVX512_BF16), "avx512bf16") == 0 &&
            strcmp(npk_isa_name(NPK_ISA_NEON_BF16), "neonbf16") == 0 &&
            strcmp(npk_isa_name((npk_isa)99), "unknown") == 0,
        "%s", "npk_isa_name");

  memset(&cpu, 0, sizeof cpu);
  cpu.detail = &g_d;
  run_all(&cpu, y0, dx0, dg0, t0);

  /* An older, one-entry table flush against a guard page. */
  old = (old_backend *)flush_against_guard(sizeof *old);
  old->struct_size = sizeof *old;
  old->ctx = NULL;
  old->rms_norm = counting_rms_norm;
  e = cpu;
  e.backend = NPK_BACKEND_FOREIGN;
  e.foreign = (const npk_foreign_backend *)(void *)old;
  g_calls = 0;
  run_all(&e, y1, dx1, dg1, t1);
  CHECK(g_calls == 1, "the old table's entry ran %d times", g_calls);
  CHECK(memcmp(y0, y1, sizeof y0) == 0 && memcmp(dx0, dx1, sizeof dx0) == 0 && memcmp(dg0, dg1, sizeof dg0) == 0 &&
            memcmp(t0, t1, sizeof t0) == 0,
        "%s", "the old table's missing entries ran on the CPU with the CPU's bits");

  /* struct_size and ctx only. */
  min = (npk_foreign_backend *)flush_against_guard(NPK_FOREIGN_BACKEND_MIN_SIZE);
  min->struct_size = NPK_FOREIGN_BACKEND_MIN_SIZE;
  min->ctx = NULL;
  e.foreign = min;
  memset(y1, 0, sizeof y1);
  run_all(&e, y1, dx1, dg1, t1);
  CHECK(memcmp(y0, y1, sizeof y0) == 0 && memcmp(t0, t1, sizeof t0) == 0, "%s", "an entry-less table runs the CPU");

  /* A newer, longer table. */
  nb = (new_backend *)calloc(1, sizeof *nb);
  nb->known.struct_size = sizeof *nb;
  nb->known.rms_norm = counting_rms_norm;
  nb->future_a = never;
  nb->future_b = never;
  e.foreign = &nb->known;
  g_calls = 0;
  run_all(&e, y1, dx1, dg1, t1);
  CHECK(g_calls == 1 && memcmp(dx0, dx1, sizeof dx0) == 0, "%s", "a newer table runs");

  /* Sizes no table can have: refused before anything is written. */
  for (i = 0; i < 4; i++) {
    const int64_t xs[2] = {ROWS, COLS}, gs[1] = {COLS};
    static float x[ROWS * COLS], gamma[COLS], y[ROWS * COLS];
    npk_tensor xt = tens(x, NPK_F32, 2, xs), gt = tens(gamma, NPK_F32, 1, gs), yt = tens(y, NPK_F32, 2, xs);
    static unsigned char ws[1 << 16];
    nb->known.struct_size = bad[i];
    memset(y, 0x5a, sizeof y);
    CHECK(npk_rms_norm(&xt, &gt, NULL, &yt, NULL, ws, sizeof ws, &e) == NPK_ERR_PARAM_INVALID &&
              strcmp(g_d.argument, "foreign") == 0,
          "struct_size %zu: status %s", bad[i], g_d.message);
    CHECK(y[0] == bits2f(0x5a5a5a5au), "%s", "nothing written");
  }

  /* The store hint: the same bits with either hint, on the CPU, the
   * reference and a foreign table. */
  {
    static float y2[ROWS * COLS], dx2[ROWS * COLS], dg2[COLS], t2[VOCAB * COLS];
    static float y3[ROWS * COLS], dx3[ROWS * COLS], dg3[COLS], t3[VOCAB * COLS];
    const unsigned hints[2] = {NPK_OUTPUTS_FRESH, NPK_OUTPUTS_RESIDENT};
    const unsigned bad_hints[3] = {NPK_OUTPUTS_FRESH | NPK_OUTPUTS_RESIDENT, 0x400u, 0x80000000u};
    npk_exec r = cpu;
    r.backend = NPK_BACKEND_REFERENCE;
    run_all(&r, y3, dx3, dg3, t3);
    nb->known.struct_size = sizeof *nb;
    for (i = 0; i < 2; i++) {
      e = cpu;
      e.backend = (npk_backend_kind)(NPK_BACKEND_CPU | hints[i]);
      memset(y2, 0, sizeof y2);
      run_all(&e, y2, dx2, dg2, t2);
      CHECK(memcmp(y0, y2, sizeof y0) == 0 && memcmp(dx0, dx2, sizeof dx0) == 0 && memcmp(dg0, dg2, sizeof dg0) == 0 &&
                memcmp(t0, t2, sizeof t0) == 0,
            "hint %#x: the CPU's bits", hints[i]);
      e.backend = (npk_backend_kind)(NPK_BACKEND_FOREIGN | hints[i]);
      e.foreign = &nb->known;
      memset(y2, 0, sizeof y2);
      run_all(&e, y2, dx2, dg2, t2);
      CHECK(memcmp(dx0, dx2, sizeof dx0) == 0 && memcmp(t0, t2, sizeof t0) == 0, "hint %#x: a foreign table", hints[i]);
      e = r;
      e.backend = (npk_backend_kind)(NPK_BACKEND_REFERENCE | hints[i]);
      memset(y2, 0, sizeof y2);
      run_all(&e, y2, dx2, dg2, t2);
      CHECK(memcmp(y3, y2, sizeof y3) == 0 && memcmp(dx3, dx2, sizeof dx3) == 0 && memcmp(t3, t2, sizeof t3) == 0,
            "hint %#x: the reference's bits", hints[i]);
    }
    for (i = 0; i < 3; i++) {
      const int64_t xs[2] = {ROWS, COLS}, gs[1] = {COLS};
      static float x[ROWS * COLS], gamma[COLS], y[ROWS * COLS];
      npk_tensor xt = tens(x, NPK_F32, 2, xs), gt = tens(gamma, NPK_F32, 1, gs), yt = tens(y, NPK_F32, 2, xs);
      static unsigned char ws[1 << 16];
      e = cpu;
      e.backend = (npk_backend_kind)(NPK_BACKEND_CPU | bad_hints[i]);
      memset(y, 0x5a, sizeof y);
      CHECK(npk_rms_norm(&xt, &gt, NULL, &yt, NULL, ws, sizeof ws, &e) == NPK_ERR_PARAM_INVALID &&
                strcmp(g_d.argument, "backend") == 0,
            "backend %#x: %s", bad_hints[i], g_d.message);
      CHECK(y[0] == bits2f(0x5a5a5a5au), "%s", "nothing written");
    }
  }
  free(nb);
  printf("test_abi (ABI %u.%u): %d passed, %d failed\n", npk_abi_version() >> 16, npk_abi_version() & 0xffff,
         g_passed, g_failed);
  return g_failed ? 1 : 0;
}
