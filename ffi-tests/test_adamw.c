/* AdamW through the C ABI (2.6): the two-phase calls against a
 * double-precision model written here (bf16 params + f32 masters + f32
 * moments with amsgrad; f32 everything with Adam's L2 decay, maximize and
 * AMP's grad scale), on the CPU and the reference backend; the clip inside
 * the step (its norm is npk_grad_stats' sqrt(sum_sq) to the bit; a NaN
 * gradient skips the step and writes nothing); found_inf; bad input refused
 * with every tensor left alone and the detail naming the list and the tensor;
 * a foreign table's adamw entry (lists lowered to segment tables) and one
 * built against ABI 2.5 (shorter: AdamW runs on the CPU); 8-bit moments
 * through npk_adamw_v2 (ABI 2.9).
 *
 * Tolerance against the model (per element, `want` exact in double):
 * |got - want| <= ulp_T(want) + 2^-20 * S, S the magnitudes the f32
 * arithmetic rounds (docs/operators.md, "AdamW": the Rust test's bound,
 * 16x looser). Built and run by ffi-tests/run.sh. */
#include <stddef.h>

#include "common.h"

#define NT 4
static const size_t g_len[NT] = {37, 0, 1000, 5};
static npk_error_detail g_detail;

typedef struct {
  npk_dtype pd, md; /* params' and grads' dtype; the moments' */
  int masters;
  uint32_t flags;
} cfg;

/* The six lists: params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters. */
enum { P, G, M, V, X, W, LISTS };
typedef struct {
  buf b[LISTS][NT];
  npk_tensor t[LISTS][NT];
  npk_adamw_tensors lists;
} state;

static npk_exec exec_of(npk_backend_kind kind, uint32_t blocks) {
  npk_exec e;
  memset(&e, 0, sizeof e);
  e.backend = kind;
  e.blocks = blocks;
  e.detail = &g_detail;
  return e;
}

static npk_dtype dtype_of(const cfg *c, int l) {
  return l == P || l == G ? c->pd : l == W ? NPK_F32 : c->md;
}

static void link_lists(state *s, const cfg *c) {
  npk_tensor_array *a[LISTS] = {&s->lists.params,      &s->lists.grads,           &s->lists.exp_avgs,
                                &s->lists.exp_avg_sqs, &s->lists.max_exp_avg_sqs, &s->lists.masters};
  int l;
  for (l = 0; l < LISTS; l++) {
    int on = l == X ? (c->flags & NPK_ADAMW_AMSGRAD) != 0 : l == W ? c->masters : 1;
    a[l]->tensors = s->t[l];
    a[l]->count = on ? NT : 0;
  }
}

static void make_state(state *s, const cfg *c) {
  double gs = c->flags & NPK_ADAMW_GRAD_SCALE ? 1024.0 : 1.0;
  int l;
  size_t k, i;
  for (l = 0; l < LISTS; l++)
    for (k = 0; k < NT; k++) {
      int64_t shape[2] = {10, 100}, flat[1];
      flat[0] = (int64_t)g_len[k];
      s->b[l][k] = balloc(dtype_of(c, l), g_len[k]);
      s->t[l][k] = g_len[k] == 1000 ? btens(s->b[l][k], 2, shape) : btens(s->b[l][k], 1, flat);
    }
  for (k = 0; k < NT; k++) {
    bfill_rand(s->b[W][k], -1, 1);
    for (i = 0; i < g_len[k]; i++) put(s->b[P][k].p, c->pd, i, get(s->b[W][k].p, NPK_F32, i));
    bfill_rand(s->b[G][k], -0.05 * gs, 0.05 * gs);
    bfill_rand(s->b[M][k], -1e-2, 1e-2);
    bfill_rand(s->b[V][k], 0, 1e-4);
    bfill_rand(s->b[X][k], 0, 2e-4);
  }
  link_lists(s, c);
}

static void copy_state(state *dst, const state *src, const cfg *c) {
  int l;
  size_t k;
  *dst = *src;
  for (l = 0; l < LISTS; l++)
    for (k = 0; k < NT; k++) {
      dst->b[l][k] = bclone(src->b[l][k]);
      dst->t[l][k].data = dst->b[l][k].p;
    }
  link_lists(dst, c);
}

static int same_state(const state *a, const state *b) {
  int l, ok = 1;
  size_t k;
  for (l = 0; l < LISTS; l++)
    for (k = 0; k < NT; k++) ok &= bsame(a->b[l][k], b->b[l][k]);
  return ok;
}

static void free_state(state *s) {
  int l;
  size_t k;
  for (l = 0; l < LISTS; l++)
    for (k = 0; k < NT; k++) bfree(&s->b[l][k]);
}

/* The two-phase call. */
static npk_status step(state *s, const npk_adamw_options *o, npk_adamw_result *r, const npk_exec *e) {
  size_t ws = 0;
  void *w;
  npk_status st = npk_adamw_workspace_size(&s->lists, o, e, &ws);
  if (st != NPK_OK) return st;
  w = malloc(ws ? ws : 1);
  st = npk_adamw(&s->lists, o, r, ws ? w : NULL, ws, e);
  free(w);
  return st;
}

static double ulp_of(npk_dtype dt, double x) {
  int p = dt == NPK_F32 ? 24 : dt == NPK_F16 ? 11 : 8, emin = dt == NPK_F16 ? -14 : -126, e = 0;
  frexp(fabs(x), &e);
  e -= 1; /* |x| in [2^e, 2^(e+1)) */
  if (x == 0 || e < emin) e = emin;
  return ldexp(1.0, e - (p - 1));
}

static int within(double got, double want, npk_dtype dt, double s) {
  return fabs(got - want) <= ulp_of(dt, want) + ldexp(s, -20);
}

/* The global norm of the unscaled gradients, in double. */
static double model_norm(const state *s, const npk_adamw_options *o) {
  double ss = 0, sc = o->flags & NPK_ADAMW_GRAD_SCALE ? fabs((double)o->grad_scale) : 1.0;
  size_t k, i;
  for (k = 0; k < NT; k++)
    for (i = 0; i < g_len[k]; i++) {
      double g = get(s->b[G][k].p, s->b[G][k].dt, i);
      ss += g * g;
    }
  return sqrt(ss) / sc;
}

/* Checks `after` against one step of the model from `before`. */
static void check_step(const char *what, const state *before, const state *after, const cfg *c,
                       const npk_adamw_options *o) {
  uint32_t f = o->flags;
  double sc = f & NPK_ADAMW_GRAD_SCALE ? o->grad_scale : 1.0, coef = 1.0;
  double bc1 = 1 - pow(o->beta1, (double)o->step), bc2s = sqrt(1 - pow(o->beta2, (double)o->step));
  double ss = o->lr / bc1, wd = o->weight_decay;
  int bad[LISTS] = {0, 0, 0, 0, 0, 0}, l;
  size_t k, i;
  if (f & NPK_ADAMW_CLIP) coef = fmin(1.0, o->max_grad_norm / (model_norm(before, o) + 1e-6));
  if (f & NPK_ADAMW_CLIP_COEF) coef = o->clip_coef;
  for (k = 0; k < NT; k++)
    for (i = 0; i < g_len[k]; i++) {
      double g = get(before->b[G][k].p, c->pd, i) / sc * coef, gmag;
      double p = c->masters ? get(before->b[W][k].p, NPK_F32, i) : get(before->b[P][k].p, c->pd, i);
      double m0 = get(before->b[M][k].p, c->md, i), v0 = get(before->b[V][k].p, c->md, i), m, v, vh, den, up;
      double x0 = get(before->b[X][k].p, c->md, i);
      if (f & NPK_ADAMW_MAXIMIZE) g = -g;
      gmag = fabs(g);
      if (f & NPK_ADAMW_L2) {
        gmag += fabs(p * wd);
        g += p * wd;
      } else {
        p *= 1 - o->lr * wd;
      }
      m = m0 * o->beta1 + g * (1 - o->beta1);
      v = v0 * o->beta2 + g * g * (1 - o->beta2);
      vh = f & NPK_ADAMW_AMSGRAD ? fmax(x0, v) : v;
      den = sqrt(vh) / bc2s + o->eps;
      up = ss * m / den;
      bad[M] |= !within(get(after->b[M][k].p, c->md, i), m, c->md, fabs(m0 * o->beta1) + gmag * (1 - o->beta1));
      bad[V] |= !within(get(after->b[V][k].p, c->md, i), v, c->md, fabs(v0 * o->beta2) + gmag * gmag * (1 - o->beta2));
      if (f & NPK_ADAMW_AMSGRAD) bad[X] |= !within(get(after->b[X][k].p, c->md, i), vh, c->md, vh);
      {
        double sp = fabs(p) + fabs(up) + ss * (fabs(m0 * o->beta1) + gmag * (1 - o->beta1)) / den;
        double want = p - up;
        if (c->masters) bad[W] |= !within(get(after->b[W][k].p, NPK_F32, i), want, NPK_F32, sp);
        bad[P] |= !within(get(after->b[P][k].p, c->pd, i), want, c->pd, sp);
      }
    }
  for (l = 0; l < LISTS; l++) CHECK(!bad[l], "%s: list %d within the tolerance", what, l);
  for (k = 0; k < NT; k++) CHECK(bsame(before->b[G][k], after->b[G][k]), "%s: grads[%zu] read only", what, k);
}

static npk_adamw_options options(uint32_t flags) {
  npk_adamw_options o;
  memset(&o, 0, sizeof o);
  o.lr = 1e-3;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.weight_decay = 0.01;
  o.step = 5;
  o.max_grad_norm = INFINITY;
  o.grad_scale = 1024.0f;
  o.found_inf = 0.0f;
  o.flags = flags;
  o.clip_coef = 1.0f;
  return o;
}

/* One step on the CPU (serial and 3 blocks on the pool: the same bits) and
 * on the reference backend, each against the model. */
static void test_model(const char *what, const cfg *c, double max_norm) {
  state s0, cpu, pool, ref;
  npk_adamw_options o = options(c->flags);
  npk_adamw_result r, rp;
  npk_exec e = exec_of(NPK_BACKEND_CPU, 0), ep = exec_of(NPK_BACKEND_CPU, 3), er = exec_of(NPK_BACKEND_REFERENCE, 0);
  o.max_grad_norm = max_norm;
  ep.parallel_for = npk_threads_parallel_for;
  make_state(&s0, c);
  copy_state(&cpu, &s0, c);
  copy_state(&pool, &s0, c);
  copy_state(&ref, &s0, c);
  memset(&r, 0xa5, sizeof r);
  CHECK(step(&cpu, &o, &r, &e) == NPK_OK && r.stepped == 1, "%s: %s", what, g_detail.message);
  CHECK((c->flags & NPK_ADAMW_CLIP) ? fabs(r.grad_norm - model_norm(&s0, &o)) <= 1e-9 * r.grad_norm
                                    : isnan(r.grad_norm),
        "%s: grad_norm %.17g", what, r.grad_norm);
  check_step(what, &s0, &cpu, c, &o);
  CHECK(step(&pool, &o, &rp, &ep) == NPK_OK && rp.stepped == 1, "%s pool: %s", what, g_detail.message);
  ep.parallel_for = NULL;
  CHECK(step(&ref, &o, NULL, &ep) == NPK_OK, "%s serial, 3 blocks: %s", what, g_detail.message);
  CHECK(same_state(&pool, &ref), "%s: pool and serial, the same bits", what);
  free_state(&ref);
  copy_state(&ref, &s0, c);
  CHECK(step(&ref, &o, NULL, &er) == NPK_OK, "%s reference: %s", what, g_detail.message);
  check_step(what, &s0, &ref, c, &o);
  free_state(&s0);
  free_state(&cpu);
  free_state(&pool);
  free_state(&ref);
}

/* The clip's norm is grad_stats' sqrt(sum_sq) bit for bit (same grads, same
 * exec); a NaN gradient or found_inf skips the step, writing nothing. */
static void test_clip_and_skip(void) {
  cfg c = {NPK_BF16, NPK_F32, 1, NPK_ADAMW_CLIP | NPK_ADAMW_AMSGRAD};
  state s, s0;
  npk_adamw_options o = options(c.flags);
  npk_adamw_result r;
  npk_grad_summary gs;
  uint32_t blocks[2] = {0, 3};
  int b;
  size_t ws = 0;
  void *w;
  o.max_grad_norm = 0.1;
  make_state(&s, &c);
  for (b = 0; b < 2; b++) {
    npk_exec e = exec_of(NPK_BACKEND_CPU, blocks[b]);
    double norm;
    copy_state(&s0, &s, &c);
    CHECK(npk_grad_stats_workspace_size(s.t[G], NT, &e, &ws) == NPK_OK, "grad_stats size");
    w = malloc(ws ? ws : 1);
    CHECK(npk_grad_stats(s.t[G], NT, &gs, w, ws, &e) == NPK_OK, "grad_stats");
    free(w);
    norm = sqrt(gs.sum_sq);
    CHECK(step(&s0, &o, &r, &e) == NPK_OK && r.stepped == 1, "clip step: %s", g_detail.message);
    CHECK(memcmp(&r.grad_norm, &norm, sizeof norm) == 0, "blocks %u: grad_norm %.17g, grad_stats %.17g", blocks[b],
          r.grad_norm, norm);
    free_state(&s0);
  }
  /* A NaN gradient: the norm is NaN, the step skipped, nothing written. */
  put(s.b[G][2].p, NPK_BF16, 77, NAN);
  copy_state(&s0, &s, &c);
  memset(&r, 0, sizeof r);
  r.stepped = 7;
  CHECK(step(&s, &o, &r, NULL) == NPK_OK && r.stepped == 0 && isnan(r.grad_norm), "NaN grad: stepped %u norm %g",
        r.stepped, r.grad_norm);
  CHECK(same_state(&s, &s0), "NaN grad: every tensor unchanged");
  put(s.b[G][2].p, NPK_BF16, 77, 0.01);
  free_state(&s0);
  /* found_inf != 0 skips; 0 steps. */
  o.flags = NPK_ADAMW_FOUND_INF | NPK_ADAMW_AMSGRAD;
  o.found_inf = 1.0f;
  copy_state(&s0, &s, &c);
  CHECK(step(&s, &o, &r, NULL) == NPK_OK && r.stepped == 0 && isnan(r.grad_norm), "found_inf: stepped %u",
        r.stepped);
  CHECK(same_state(&s, &s0), "found_inf: every tensor unchanged");
  o.found_inf = 0.0f;
  CHECK(step(&s, &o, &r, NULL) == NPK_OK && r.stepped == 1, "found_inf 0: stepped %u", r.stepped);
  CHECK(!same_state(&s, &s0), "found_inf 0: the step ran");
  free_state(&s0);
  free_state(&s);
}

/* ---- a fake NPU: its adamw entry reads the segment tables and runs the
 * step on the CPU ---- */
static int g_calls;
static npk_exec g_cpu;

static npk_status fake_adamw(void *ctx, const npk_adamw_call *c) {
  const npk_tensor_list *in[LISTS] = {&c->params,      &c->grads,           &c->exp_avgs,
                                      &c->exp_avg_sqs, &c->max_exp_avg_sqs, &c->masters};
  npk_tensor t[LISTS][NT];
  npk_adamw_tensors lists;
  npk_tensor_array *out[LISTS] = {&lists.params,      &lists.grads,           &lists.exp_avgs,
                                  &lists.exp_avg_sqs, &lists.max_exp_avg_sqs, &lists.masters};
  double want = c->options.lr / (1 - pow(c->options.beta1, (double)c->options.step));
  size_t j, start, ws = 0;
  int l;
  void *w;
  npk_status st;
  (void)ctx;
  g_calls++;
  CHECK(fabs(c->consts.step_size - want) <= 1e-6 * want, "consts.step_size %g, want %g", c->consts.step_size, want);
  for (l = 0; l < LISTS; l++) {
    CHECK(in[l]->count <= NT, "list %d: %zu rows", l, in[l]->count);
    for (j = 0, start = 0; j < in[l]->count && j < NT; j++) {
      const npk_list_seg *s = &in[l]->segs[j];
      int64_t shape[1];
      shape[0] = (int64_t)s->numel;
      CHECK(s->start == start && s->numel > 0 && s->dtype == in[l]->dtype, "list %d row %zu", l, j);
      start += s->numel;
      t[l][j] = tens(s->data, s->dtype, 1, shape);
    }
    out[l]->tensors = t[l];
    out[l]->count = in[l]->count;
  }
  st = npk_adamw_workspace_size(&lists, &c->options, &g_cpu, &ws);
  if (st != NPK_OK) return st;
  w = malloc(ws ? ws : 1);
  st = npk_adamw(&lists, &c->options, c->report, w, ws, &g_cpu);
  free(w);
  return st;
}

static npk_status failing_adamw(void *ctx, const npk_adamw_call *c) {
  (void)ctx;
  (void)c;
  return (npk_status)9;
}

static void test_foreign(void) {
  cfg c = {NPK_BF16, NPK_F32, 1, NPK_ADAMW_CLIP | NPK_ADAMW_AMSGRAD};
  state s, cpu, f;
  npk_adamw_options o = options(c.flags);
  npk_adamw_result r0, r1;
  npk_foreign_backend t;
  npk_exec e = exec_of(NPK_BACKEND_FOREIGN, 0);
  g_cpu = exec_of(NPK_BACKEND_CPU, 0);
  o.max_grad_norm = 0.1;
  make_state(&s, &c);
  copy_state(&cpu, &s, &c);
  copy_state(&f, &s, &c);
  CHECK(step(&cpu, &o, &r0, &g_cpu) == NPK_OK, "CPU adamw: %s", g_detail.message);
  memset(&t, 0, sizeof t);
  t.struct_size = sizeof t;
  t.adamw = fake_adamw;
  e.foreign = &t;
  CHECK(step(&f, &o, &r1, &e) == NPK_OK && g_calls == 1, "foreign adamw: %s", g_detail.message);
  CHECK(same_state(&f, &cpu) && r1.stepped == 1 && memcmp(&r1.grad_norm, &r0.grad_norm, 8) == 0,
        "foreign adamw: the CPU's bits and report");
  t.adamw = failing_adamw;
  CHECK(step(&f, &o, &r1, &e) == NPK_ERR_BACKEND && g_detail.value == 9, "failure passed on: value %lld",
        (long long)g_detail.value);
  /* A backend compiled against ABI 2.5 ends before the adamw entry. */
  t.struct_size = offsetof(npk_foreign_backend, adamw);
  free_state(&f);
  copy_state(&f, &s, &c);
  CHECK(step(&f, &o, &r1, &e) == NPK_OK && g_calls == 1, "2.5 table: CPU adamw: %s", g_detail.message);
  CHECK(same_state(&f, &cpu), "2.5 table: the CPU's bits");
  free_state(&s);
  free_state(&cpu);
  free_state(&f);
}

/* Expects `st` and the detail naming `arg` (and `pos`), every tensor as in `s0`. */
static void refused(const char *what, npk_status got, npk_status want, const char *arg, int64_t pos,
                    const state *s, const state *s0) {
  CHECK(got == want && g_detail.status == want, "%s: status %d, want %d (%s)", what, (int)got, (int)want,
        g_detail.message);
  CHECK(!strcmp(g_detail.argument, arg) && g_detail.position == pos, "%s: detail %s position %lld", what,
        g_detail.argument, (long long)g_detail.position);
  CHECK(same_state(s, s0), "%s: every tensor unchanged", what);
}

static void test_errors(void) {
  cfg c = {NPK_BF16, NPK_F32, 1, NPK_ADAMW_AMSGRAD};
  state s, s0;
  npk_adamw_options o = options(c.flags), bad = options(c.flags);
  npk_adamw_result r;
  npk_exec e = exec_of(NPK_BACKEND_CPU, 0);
  npk_tensor keep;
  size_t ws = 0, ws2 = 12345;
  void *w;
  make_state(&s, &c);
  copy_state(&s0, &s, &c);
  CHECK(npk_adamw_workspace_size(&s.lists, &o, &e, &ws) == NPK_OK && ws > 0, "size");
  w = malloc(ws);
  refused("NULL tensors", npk_adamw(NULL, &o, &r, w, ws, &e), NPK_ERR_NULLPTR, "tensors", -1, &s, &s0);
  refused("NULL options", npk_adamw(&s.lists, NULL, &r, w, ws, &e), NPK_ERR_NULLPTR, "options", -1, &s, &s0);
  refused("size, NULL options", npk_adamw_workspace_size(&s.lists, NULL, &e, &ws2), NPK_ERR_NULLPTR, "options", -1,
          &s, &s0);
  CHECK(ws2 == 12345, "a refused size call leaves the size");
  bad.beta1 = 1.0;
  refused("beta1 1", npk_adamw(&s.lists, &bad, &r, w, ws, &e), NPK_ERR_PARAM_INVALID, "beta1", -1, &s, &s0);
  s.lists.exp_avg_sqs.count = NT - 1;
  refused("3 exp_avg_sqs", npk_adamw(&s.lists, &o, &r, w, ws, &e), NPK_ERR_PARAM_INVALID, "exp_avg_sqs", -1, &s, &s0);
  s.lists.exp_avg_sqs.count = NT;
  /* A bf16 moment among f32 ones, at index 2. */
  keep = s.t[M][2];
  s.t[M][2].dtype = NPK_BF16;
  refused("size, exp_avgs[2] bf16", npk_adamw_workspace_size(&s.lists, &o, &e, &ws2), NPK_ERR_DTYPE_UNSUPPORTED,
          "exp_avgs", 2, &s, &s0);
  refused("exp_avgs[2] bf16", npk_adamw(&s.lists, &o, &r, w, ws, &e), NPK_ERR_DTYPE_UNSUPPORTED, "exp_avgs", 2, &s,
          &s0);
  s.t[M][2] = keep;
  /* masters[3] one element short; grads[3] an integer tensor. */
  keep = s.t[W][3];
  s.t[W][3].shape[0] = 4;
  refused("masters[3] short", npk_adamw(&s.lists, &o, &r, w, ws, &e), NPK_ERR_PARAM_INVALID, "masters", 3, &s, &s0);
  s.t[W][3] = keep;
  keep = s.t[G][3];
  s.t[G][3].dtype = NPK_I32;
  refused("grads[3] i32", npk_adamw(&s.lists, &o, &r, w, ws, &e), NPK_ERR_DTYPE_UNSUPPORTED, "grads", 3, &s, &s0);
  s.t[G][3] = keep;
  refused("small workspace", npk_adamw(&s.lists, &o, &r, w, ws - 1, &e), NPK_ERR_WORKSPACE_TOO_SMALL, "workspace", -1,
          &s, &s0);
  /* grads[0] is params[0]. */
  keep = s.t[G][0];
  s.t[G][0].data = s.t[P][0].data;
  refused("grads[0] = params[0]", npk_adamw(&s.lists, &o, &r, w, ws, &e), NPK_ERR_PARAM_INVALID, "params", -1, &s,
          &s0);
  s.t[G][0] = keep;
  CHECK(npk_adamw(&s.lists, &o, &r, w, ws, &e) == NPK_OK && !same_state(&s, &s0), "valid again: %s",
        g_detail.message);
  free(w);
  free_state(&s);
  free_state(&s0);
}


/* 8-bit moments through npk_adamw_v2 (ABI 2.9): two tensors (300 and 5
 * elements) of f32 params, NPK_U8 codes, f32 scales (2 and 1 per list);
 * the same bytes on 1 and 7 blocks and on the reference backend's scales
 * and codes but for rare f32-vs-f64 threshold crossings; the scale lists
 * go through the same validation (dtype, length, overlap: nothing
 * written). */
enum { QN = 2, QL = 9 }; /* p, g, m, v, x, sm, sv, sx, w(unused) */
static const size_t q_len[QN] = {300, 5};
typedef struct {
  void *b[QL][QN];
  npk_tensor t[QL][QN];
  npk_adamw_tensors lists;
  npk_adamw_formats f;
} qstate;

static size_t q_count(int l, size_t i) { return l >= 5 ? (q_len[i] + 255) / 256 : q_len[i]; }
static npk_dtype q_dtype(int l) { return l <= 1 || l >= 5 ? NPK_F32 : NPK_U8; }
static size_t q_bytes(int l, size_t i) { return q_count(l, i) * (q_dtype(l) == NPK_U8 ? 1 : 4); }

static void q_link(qstate *s) {
  int l;
  size_t i;
  for (l = 0; l < 8; l++)
    for (i = 0; i < QN; i++) {
      int64_t shape[1];
      shape[0] = (int64_t)q_count(l, i);
      s->t[l][i] = tens(s->b[l][i], q_dtype(l), 1, shape);
    }
  memset(&s->lists, 0, sizeof s->lists);
  s->lists.params.tensors = s->t[0], s->lists.params.count = QN;
  s->lists.grads.tensors = s->t[1], s->lists.grads.count = QN;
  s->lists.exp_avgs.tensors = s->t[2], s->lists.exp_avgs.count = QN;
  s->lists.exp_avg_sqs.tensors = s->t[3], s->lists.exp_avg_sqs.count = QN;
  s->lists.max_exp_avg_sqs.tensors = s->t[4], s->lists.max_exp_avg_sqs.count = QN;
  memset(&s->f, 0, sizeof s->f);
  s->f.struct_size = sizeof s->f;
  s->f.quantized_moments = 1;
  s->f.seed = 7;
  s->f.exp_avg_scales.tensors = s->t[5], s->f.exp_avg_scales.count = QN;
  s->f.exp_avg_sq_scales.tensors = s->t[6], s->f.exp_avg_sq_scales.count = QN;
  s->f.max_exp_avg_sq_scales.tensors = s->t[7], s->f.max_exp_avg_sq_scales.count = QN;
}

static void q_make(qstate *s, const qstate *from) {
  int l;
  size_t i, k;
  for (l = 0; l < 8; l++)
    for (i = 0; i < QN; i++) {
      s->b[l][i] = calloc(q_bytes(l, i) ? q_bytes(l, i) : 1, 1);
      if (from) {
        memcpy(s->b[l][i], from->b[l][i], q_bytes(l, i));
      } else if (l <= 1) {
        for (k = 0; k < q_len[i]; k++) ((float *)s->b[l][i])[k] = (float)urand(-1.0, 1.0) * (l ? 1e-2f : 1.0f);
      }
    }
  q_link(s);
}

static int q_same(const qstate *a, const qstate *b) {
  int l;
  size_t i;
  for (l = 0; l < 8; l++)
    for (i = 0; i < QN; i++)
      if (memcmp(a->b[l][i], b->b[l][i], q_bytes(l, i))) return 0;
  return 1;
}

static void q_free(qstate *s) {
  int l;
  size_t i;
  for (l = 0; l < 8; l++)
    for (i = 0; i < QN; i++) free(s->b[l][i]);
}

static npk_status q_step(qstate *s, npk_exec *e, const npk_adamw_options *o) {
  size_t ws = 0;
  void *w;
  npk_adamw_result r;
  npk_status st = npk_adamw_v2_workspace_size(&s->lists, o, &s->f, e, &ws);
  if (st != NPK_OK) return st;
  w = malloc(ws ? ws : 1);
  st = npk_adamw_v2(&s->lists, o, &s->f, &r, w, ws, e);
  free(w);
  return st;
}

/* Row lengths (ABI 2.12): tensor 0's 300 elements in rows of 150 have two
 * scales, as on the flat grid, in other blocks (150 + 150, not 256 + 44);
 * the same bytes on 1 and 7 blocks, the reference's codes; refusals:
 * a row that does not divide, a count other than the params', NULL. */
static void q_rows(const qstate *flat, const qstate *s0, npk_exec *e1, npk_exec *er, const npk_adamw_options *o) {
  static const uint64_t rows[QN] = {150, 0}, bad[QN] = {120, 0};
  npk_exec e7 = exec_of(NPK_BACKEND_CPU, 7);
  qstate a, b, c;
  size_t i, differ = 0;
  q_make(&a, s0);
  q_make(&b, s0);
  q_make(&c, s0);
  a.f.q8_rows = b.f.q8_rows = c.f.q8_rows = rows;
  a.f.q8_rows_count = b.f.q8_rows_count = c.f.q8_rows_count = QN;
  CHECK(q_step(&a, e1, o) == NPK_OK && !q_same(&a, flat), "q8 rows: a step in other blocks (%s)", g_detail.message);
  CHECK(q_step(&b, &e7, o) == NPK_OK && q_same(&a, &b), "q8 rows: the same bytes on 1 and 7 blocks");
  CHECK(q_step(&c, er, o) == NPK_OK, "q8 rows reference: %s", g_detail.message);
  for (i = 0; i < q_len[0]; i++) differ += ((uint8_t *)a.b[2][0])[i] != ((uint8_t *)c.b[2][0])[i];
  CHECK(differ <= 2, "q8 rows: %zu of 300 codes differ from the reference", differ);
  q_free(&b);
  q_make(&b, s0);
  b.f.q8_rows = bad;
  b.f.q8_rows_count = QN;
  CHECK(q_step(&b, e1, o) == NPK_ERR_PARAM_INVALID && !strcmp(g_detail.argument, "q8_rows") && q_same(&b, s0),
        "q8 rows: 120 does not divide 300 (%s)", g_detail.message);
  b.f.q8_rows = rows;
  b.f.q8_rows_count = 1;
  CHECK(q_step(&b, e1, o) == NPK_ERR_PARAM_INVALID && !strcmp(g_detail.argument, "q8_rows") && q_same(&b, s0),
        "q8 rows: one length for two params (%s)", g_detail.message);
  b.f.q8_rows = NULL;
  b.f.q8_rows_count = QN;
  CHECK(q_step(&b, e1, o) == NPK_ERR_NULLPTR && q_same(&b, s0), "q8 rows: NULL refused (%s)",
        g_detail.message);
  q_free(&a);
  q_free(&b);
  q_free(&c);
}

static void test_q8(void) {
  qstate s0, a, b, c;
  npk_adamw_options o = options(NPK_ADAMW_AMSGRAD);
  npk_exec e1 = exec_of(NPK_BACKEND_CPU, 1), e7 = exec_of(NPK_BACKEND_CPU, 7);
  npk_exec er = exec_of(NPK_BACKEND_REFERENCE, 0);
  npk_tensor keep;
  size_t i, nz = 0, differ = 0;
  o.flags = NPK_ADAMW_AMSGRAD;
  q_make(&s0, NULL);
  q_make(&a, &s0);
  q_make(&b, &s0);
  q_make(&c, &s0);
  CHECK(q_step(&a, &e1, &o) == NPK_OK, "q8 step: %s", g_detail.message);
  CHECK(q_step(&b, &e7, &o) == NPK_OK && q_same(&a, &b), "q8: the same bytes on 1 and 7 blocks");
  CHECK(q_step(&c, &er, &o) == NPK_OK, "q8 reference: %s", g_detail.message);
  for (i = 0; i < q_len[0]; i++) {
    nz += ((uint8_t *)a.b[2][0])[i] != 0;
    differ += ((uint8_t *)a.b[2][0])[i] != ((uint8_t *)c.b[2][0])[i];
  }
  CHECK(nz > 250 && differ <= 2, "q8: %zu of 300 codes nonzero, %zu differ from the reference", nz, differ);
  CHECK(((float *)a.b[5][0])[0] > 0 && ((float *)a.b[6][1])[0] > 0, "q8: scales set");
  q_free(&b);
  q_free(&c);
  /* Refusals: every tensor as before. */
  q_make(&b, &s0);
  keep = b.t[5][1];
  b.t[5][1].dtype = NPK_BF16;
  CHECK(q_step(&b, &e1, &o) == NPK_ERR_DTYPE_UNSUPPORTED && !strcmp(g_detail.argument, "exp_avg_scales") &&
            g_detail.position == 1 && q_same(&b, &s0),
        "q8: a bf16 scale list refused (%s)", g_detail.message);
  b.t[5][1] = keep;
  keep = b.t[6][0];
  b.t[6][0].shape[0] = 1;
  CHECK(q_step(&b, &e1, &o) == NPK_ERR_PARAM_INVALID && !strcmp(g_detail.argument, "exp_avg_sq_scales") &&
            g_detail.position == 0 && q_same(&b, &s0),
        "q8: a short scale tensor refused (%s)", g_detail.message);
  b.t[6][0] = keep;
  keep = b.t[7][0];
  b.t[7][0].data = b.b[6][0];
  CHECK(q_step(&b, &e1, &o) == NPK_ERR_PARAM_INVALID && q_same(&b, &s0),
        "q8: scales over another list's refused (%s)", g_detail.message);
  b.t[7][0].data = b.b[4][0];
  CHECK(q_step(&b, &e1, &o) == NPK_ERR_PARAM_INVALID && q_same(&b, &s0),
        "q8: scales over codes refused (%s)", g_detail.message);
  b.t[7][0] = keep;
  b.t[3][1].dtype = NPK_F32;
  CHECK(q_step(&b, &e1, &o) != NPK_OK && q_same(&b, &s0), "q8: f32 exp_avg_sqs refused (%s)", g_detail.message);
  b.t[3][1].dtype = NPK_U8;
  b.f.quantized_moments = 2;
  CHECK(q_step(&b, &e1, &o) == NPK_ERR_PARAM_INVALID && !strcmp(g_detail.argument, "quantized_moments") &&
            q_same(&b, &s0),
        "q8: quantized_moments 2 refused (%s)", g_detail.message);
  b.f.quantized_moments = 1;
  /* A caller built before 8-bit moments: its struct_size ends at keys_count
   * (no 8-bit moments: the u8 lists are refused, not the formats). */
  b.f.struct_size = offsetof(npk_adamw_formats, quantized_moments);
  CHECK(q_step(&b, &e1, &o) == NPK_ERR_DTYPE_UNSUPPORTED && !strcmp(g_detail.argument, "exp_avgs") &&
            q_same(&b, &s0),
        "q8: the shorter formats read as no 8-bit moments (%s)", g_detail.message);
  b.f.struct_size = sizeof b.f - 8;
  CHECK(q_step(&b, &e1, &o) == NPK_ERR_PARAM_INVALID && !strcmp(g_detail.argument, "formats"),
        "q8: another struct_size refused (%s)", g_detail.message);
  /* A caller built for ABI 2.9-2.11: its struct ends before q8_rows (one
   * row a tensor, whatever the fields past it hold). */
  b.f.struct_size = offsetof(npk_adamw_formats, q8_rows);
  b.f.q8_rows = (const uint64_t *)&o;
  b.f.q8_rows_count = 99;
  CHECK(q_step(&b, &e1, &o) == NPK_OK && q_same(&a, &b), "q8: the 2.9 struct runs as before (%s)",
        g_detail.message);
  q_free(&b);
  q_rows(&a, &s0, &e1, &er, &o);
  q_free(&a);
  q_free(&s0);
}

int main(void) {
  cfg mixed = {NPK_BF16, NPK_F32, 1, NPK_ADAMW_AMSGRAD};
  cfg mixed_clip = {NPK_BF16, NPK_F32, 1, NPK_ADAMW_AMSGRAD | NPK_ADAMW_CLIP};
  cfg f32 = {NPK_F32, NPK_F32, 0, 0};
  cfg f32_l2 = {NPK_F32, NPK_F32, 0, NPK_ADAMW_L2 | NPK_ADAMW_MAXIMIZE | NPK_ADAMW_GRAD_SCALE | NPK_ADAMW_CLIP};
  CHECK(npk_abi_version() == NPK_ABI_VERSION && NPK_ABI_VERSION_MINOR >= 6, "ABI %#x", npk_abi_version());
  test_model("bf16 + masters + amsgrad", &mixed, INFINITY);
  test_model("bf16 + masters + amsgrad + clip", &mixed_clip, 0.1);
  test_model("f32", &f32, INFINITY);
  test_model("f32 L2 + maximize + scale + clip", &f32_l2, 0.5);
  test_clip_and_skip();
  test_foreign();
  test_errors();
  test_q8();
  printf("test_adamw: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
