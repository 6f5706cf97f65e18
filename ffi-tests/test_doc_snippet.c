/* A document's C snippet, as the document has it: ffi-tests/run.sh extracts
 * the first ```c block of README.md (and of docs/c.md) into snippet.inc, in a
 * directory of its own per document, and this program runs it inside a
 * function that declares what the snippet takes as given (rows, cols and
 * the four buffers), then checks y and rstd against a double computation.
 * An edit to the document is what is compiled, so the snippet cannot drift
 * from the header.
 *
 * Built and run by ffi-tests/run.sh (gcc -std=c11 -Wall -Wextra -Werror
 * -pedantic). Exit status 0 = every check passed. */
#include "common.h"

/* The snippet's own `#include "npukern.h"` is a no-op here (include guard). */
static void doc_snippet(int64_t rows, int64_t cols, void *x_data, void *g_data, void *y_data, void *r_data) {
#include "snippet.inc"
}

int main(void) {
  const int64_t rows = 5, cols = 300;
  buf x = balloc(NPK_BF16, (size_t)(rows * cols)), g = balloc(NPK_BF16, (size_t)cols);
  buf y = balloc(NPK_BF16, (size_t)(rows * cols)), r = balloc(NPK_F32, (size_t)rows);
  bfill_rand(x, -2.0, 2.0);
  bfill_rand(g, 0.5, 1.5);
  doc_snippet(rows, cols, x.p, g.p, y.p, r.p);
  int64_t i, j;
  for (i = 0; i < rows; i++) {
    double ss = 0.0;
    for (j = 0; j < cols; j++) ss += get(x.p, NPK_BF16, (size_t)(i * cols + j)) * get(x.p, NPK_BF16, (size_t)(i * cols + j));
    double rstd = 1.0 / sqrt(ss / (double)cols + 1e-6);
    double got_r = get(r.p, NPK_F32, (size_t)i);
    CHECK(fabs(got_r - rstd) <= 1e-6 * rstd, "rstd[%d] = %.9g, f64 %.9g", (int)i, got_r, rstd);
    for (j = 0; j < cols; j++) {
      size_t k = (size_t)(i * cols + j);
      double want = get(x.p, NPK_BF16, k) * rstd * get(g.p, NPK_BF16, (size_t)j);
      double got = get(y.p, NPK_BF16, k);
      /* One bf16 rounding of the f32 result: within 2^-8 of the value. */
      CHECK(fabs(got - want) <= fabs(want) * 0x1p-8 + 1e-30, "y[%d][%d] = %.9g, f64 %.9g", (int)i, (int)j, got, want);
    }
  }
  bfree(&x);
  bfree(&g);
  bfree(&y);
  bfree(&r);
  printf("test_doc_snippet (" NPK_SNIPPET_OF "): %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
