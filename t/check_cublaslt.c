/* check_cublaslt.c -- GEMMs through cuBLASLt (lib/cublaslt.c) on machines
 * without a GPU.
 *
 * The cuda device runs on t/fake_cuda.c ($EPJIT_CUDA_DRIVER) and cuBLASLt
 * and cuBLAS's grouped GEMM on t/fake_cublaslt.c ($EPJIT_CUBLASLT,
 * $EPJIT_CUBLAS): a CPU implementation of the column-major semantics the
 * libraries document, which refuses what they refuse.  So every row-major
 * GEMM here checks lib/cublaslt.c's mapping (operand swap, transposes,
 * layouts, leading dimensions, bias vector, beta) against an independent
 * reading of the documentation, and the numbers against a double-precision
 * CPU reference, on fresh random odd shapes.
 *
 *  - absence: a missing or disabled library is a clear EPJ_ERR_UNSUPPORTED
 *    and ej_cublaslt_available false (the NVRTC template's cue); the cuda
 *    device keeps working;
 *  - every transpose combination, bf16 and f32, bias, beta = 1 (the fused
 *    residual add) in place and from a separate c, padded strides;
 *  - the per-shape algorithm table: one heuristic call per shape, later
 *    GEMMs of the shape are cache hits (and still compute fresh numbers);
 *  - refusals before the library (bad strides, dtypes, shapes), the check
 *    macro's message, the stand-in's own refusals of bad layouts;
 *  - grouped expert GEMMs: one cublasGemmGroupedBatchedEx, or a loop when
 *    libcublas is off or a GEMM has a bias; empty experts skipped.
 */
#include "check_util.h"

#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cublaslt.h"

extern void ej_cuda_test_reset(void);
extern void ej_cublaslt_test_reset(void);

typedef struct fake_lt_stats {
	long long heuristics, matmuls, grouped, grouped_problems;
	long long refused;
	void *last_stream;
	uint64_t last_m, last_n, last_k;
	int last_transa, last_transb, last_epilogue;
	size_t last_workspace;
} fake_lt_stats;

static void (*lt_stats_get)(fake_lt_stats *);

static char *lib_path(const char *name, char *buf, size_t n)
{
	const char *b = getenv("top_builddir");
	snprintf(buf, n, "%s/t/.libs/%s", b ? b : ".", name);
	struct stat st;
	return stat(buf, &st) == 0 ? buf : NULL;
}

/* The cuda device and the allocator on the stand-ins; false (the test
 * returns) when they were not built. */
typedef struct env {
	epj_ctx *ctx;
	ej_cuda_dev *dev;
	const ej_device *vt;
	ej_allocator *a;
	ej_cublaslt *lt;
	void *fake; /* the stand-in, for its statistics and entry points */
} env;

static bool env_open(env *e, bool blas)
{
	memset(e, 0, sizeof *e);
	ej_cuda_test_reset();
	ej_cublaslt_test_reset();
	char cu[4096], lt[4096];
	if (!lib_path("libfakecuda.so", cu, sizeof cu) ||
	    !lib_path("libfakecublaslt.so", lt, sizeof lt)) {
		fprintf(stderr, "check_cublaslt: stand-in libraries missing: "
				"cases skipped\n");
		return false;
	}
	setenv("EPJIT_CUDA_DRIVER", cu, 1);
	setenv("EPJIT_CUBLASLT", lt, 1);
	if (blas)
		setenv("EPJIT_CUBLAS", lt, 1);
	else
		setenv("EPJIT_CUBLAS", "0", 1);
	e->fake = dlopen(lt, RTLD_NOW | RTLD_LOCAL);
	ck_assert_msg(e->fake, "dlopen %s: %s", lt, dlerror());
	void *p = dlsym(e->fake, "fake_cublaslt_stats_get");
	memcpy(&lt_stats_get, &p, sizeof p);
	ck_assert(lt_stats_get);
	e->ctx = tu_ctx();
	ck_assert_msg(ej_cuda_open(e->ctx, &e->dev) == EPJ_OK, "%s",
		      epj_ctx_error(e->ctx));
	e->vt = ej_cuda_device(e->dev);
	e->a = ej_allocator_new(e->vt);
	ck_assert_msg(ej_cublaslt_new(e->ctx, e->dev, e->a, &e->lt) == EPJ_OK,
		      "%s", epj_ctx_error(e->ctx));
	return true;
}

static void env_close(env *e)
{
	ej_cublaslt_free(e->lt);
	ej_allocator_free(e->a);
	epj_ctx_free(e->ctx);
	unsetenv("EPJIT_CUBLASLT");
	unsetenv("EPJIT_CUBLAS");
	unsetenv("EPJIT_CUDA_DRIVER");
	unsetenv("EPJIT_CUBLASLT_WORKSPACE_MB");
	unsetenv("FAKE_CUBLASLT_FAIL");
}

static fake_lt_stats lstats(void)
{
	fake_lt_stats s;
	lt_stats_get(&s);
	return s;
}

/* ---- host matrices and the reference ------------------------------------- */

/* A host matrix of rows x ld elements of dt (only the first cols of each
 * row used), random values, and its device copy. */
typedef struct mat {
	int64_t rows, cols, ld;
	epj_dtype dt;
	double *v; /* the values as stored (bf16-rounded for bf16) */
	void *host, *dev;
} mat;

static size_t esize(epj_dtype dt)
{
	return dt == EPJ_DTYPE_BF16 ? 2 : 4;
}

static void mat_new(env *e, mat *m, int64_t rows, int64_t cols, int64_t pad,
		    epj_dtype dt)
{
	m->rows = rows;
	m->cols = cols;
	m->ld = cols + pad;
	m->dt = dt;
	size_t n = (size_t)(rows * m->ld);
	m->v = calloc(n ? n : 1, sizeof(double));
	m->host = calloc(n ? n : 1, esize(dt));
	for (size_t i = 0; i < n; i++) {
		float f = (float)tu_uniform(-1, 1);
		if (dt == EPJ_DTYPE_BF16) {
			uint16_t b = epj_f32_to_bf16(f);
			((uint16_t *)m->host)[i] = b;
			m->v[i] = epj_bf16_to_f32(b);
		} else {
			((float *)m->host)[i] = f;
			m->v[i] = f;
		}
	}
	m->dev = ej_alloc(e->a, n * esize(dt) + 1);
	ck_assert_ptr_nonnull(m->dev);
	e->vt->copy(e->vt->self, m->dev, m->host, n * esize(dt));
}

static void mat_free(env *e, mat *m)
{
	ej_dealloc(e->a, m->dev);
	free(m->v);
	free(m->host);
}

static double mat_at(const mat *m, int64_t r, int64_t c)
{
	return m->v[r * m->ld + c];
}

/* d read back from the device */
static double dev_at(env *e, const mat *m, int64_t r, int64_t c, void *buf)
{
	(void)e;
	size_t i = (size_t)(r * m->ld + c);
	if (m->dt == EPJ_DTYPE_BF16)
		return epj_bf16_to_f32(((uint16_t *)buf)[i]);
	return ((float *)buf)[i];
}

/* g's result in d (device) against the double reference computed from the
 * inputs' stored values: alpha op(a) op(b) + beta c + bias. */
static void check_result(env *e, const ej_lt_gemm *g, const mat *a,
			 const mat *b, const mat *c, const mat *bias,
			 const mat *d, const char *what)
{
	size_t bytes = (size_t)(d->rows * d->ld) * esize(d->dt);
	void *back = malloc(bytes ? bytes : 1);
	e->vt->copy(e->vt->self, back, d->dev, bytes);
	double worst = 0;
	for (int64_t i = 0; i < g->m; i++)
		for (int64_t j = 0; j < g->n; j++) {
			double s = 0, mag = 0;
			for (int64_t q = 0; q < g->k; q++) {
				double x = g->trans_a ? mat_at(a, q, i)
						      : mat_at(a, i, q);
				double y = g->trans_b ? mat_at(b, j, q)
						      : mat_at(b, q, j);
				s += x * y;
				mag += fabs(x * y);
			}
			double ref = g->alpha * s;
			if (g->beta != 0)
				ref += g->beta * mat_at(c, i, j);
			if (bias)
				ref += mat_at(bias, 0, j);
			double got = dev_at(e, d, i, j, back);
			double tol =
			    1e-5 * (mag + 1) +
			    (d->dt == EPJ_DTYPE_BF16 ? 4e-3 : 1e-6) * fabs(ref);
			ck_assert_msg(fabs(got - ref) <= tol,
				      "%s: d[%lld,%lld] = %.7g, reference "
				      "%.7g (m=%lld n=%lld k=%lld ta=%d tb=%d)",
				      what, (long long)i, (long long)j, got,
				      ref, (long long)g->m, (long long)g->n,
				      (long long)g->k, g->trans_a, g->trans_b);
			if (fabs(got - ref) > worst)
				worst = fabs(got - ref);
		}
	free(back);
}

static void expect_error(epj_ctx *ctx, epj_status got, epj_status want,
			 const char *needle)
{
	ck_assert_int_eq(got, want);
	ck_assert_msg(strstr(epj_ctx_error(ctx), needle), "%s",
		      epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
}

/* ---- absence ------------------------------------------------------------- */

START_TEST(test_lt_absent)
{
	ej_cuda_test_reset();
	ej_cublaslt_test_reset();
	epj_ctx *ctx = tu_ctx();
	if (_i == 0)
		setenv("EPJIT_CUBLASLT", "/nonexistent/epjit/libcublasLt.so",
		       1);
	else
		setenv("EPJIT_CUBLASLT", "0", 1);
	ck_assert(!ej_cublaslt_available(ctx));
	const char *msg = epj_ctx_error(ctx);
	if (_i == 0)
		ck_assert_msg(strstr(msg,
				     "no cuBLASLt (/nonexistent/epjit/"
				     "libcublasLt.so not found: ") == msg &&
				  strstr(msg, "NVRTC template"),
			      "%s", msg);
	else
		ck_assert_msg(strstr(msg, "cuBLASLt disabled (EPJIT_CUBLASLT="
					  "0)") == msg,
			      "%s", msg);
	char saved[1024];
	snprintf(saved, sizeof saved, "%s", msg);
	/* remembered: the same answer from ej_cublaslt_new, no handle */
	epj_ctx_clear_error(ctx);
	ej_cublaslt *lt = (ej_cublaslt *)&saved; /* must be reset to NULL */
	ck_assert_int_eq(ej_cublaslt_new(ctx, NULL, NULL, &lt),
			 EPJ_ERR_UNSUPPORTED);
	ck_assert_ptr_null(lt);
	ck_assert_str_eq(epj_ctx_error(ctx), saved);
	/* and the cuda device still works where its driver is */
	char cu[4096];
	if (lib_path("libfakecuda.so", cu, sizeof cu)) {
		setenv("EPJIT_CUDA_DRIVER", cu, 1);
		epj_ctx_clear_error(ctx);
		ej_cuda_dev *d = NULL;
		ck_assert_int_eq(ej_cuda_open(ctx, &d), EPJ_OK);
		const ej_device *vt = ej_cuda_device(d);
		ej_allocator *a = ej_allocator_new(vt);
		float x[5] = { 1, 2, 3, 4, 5 }, y[5] = { 0 };
		void *p = ej_alloc(a, sizeof x);
		vt->copy(vt->self, p, x, sizeof x);
		vt->copy(vt->self, y, p, sizeof y);
		ck_assert(memcmp(x, y, sizeof x) == 0);
		ej_dealloc(a, p);
		ej_allocator_free(a);
	}
	unsetenv("EPJIT_CUBLASLT");
	unsetenv("EPJIT_CUDA_DRIVER");
	epj_ctx_free(ctx);
}
END_TEST

/* ---- one GEMM ------------------------------------------------------------ */

/* _i: bits 0-1 the transposes, bit 2 f32 (else bf16), bit 3 bias, bit 4
 * beta = 1 (in place when bit 5 is clear, else from a separate c), bit 5
 * padded strides; mixed bf16 in / f32 out on some. */
START_TEST(test_lt_gemm)
{
	env e;
	if (!env_open(&e, false))
		return;
	bool ta = _i & 1, tb = _i & 2, f32 = _i & 4, has_bias = _i & 8,
	     beta1 = _i & 16, sep = _i & 32;
	epj_dtype ab = f32 ? EPJ_DTYPE_F32 : EPJ_DTYPE_BF16;
	epj_dtype cd =
	    f32 || tu_randint(0, 3) == 0 ? EPJ_DTYPE_F32 : EPJ_DTYPE_BF16;
	int64_t m = tu_randint(1, 48) | 1, n = tu_randint(1, 48) | 1,
		k = tu_randint(1, 80) | 1;
	int64_t pad = sep ? tu_randint(1, 6) : 0;
	mat a, b, c, d, bias;
	mat_new(&e, &a, ta ? k : m, ta ? m : k, pad, ab);
	mat_new(&e, &b, tb ? n : k, tb ? k : n, pad, ab);
	mat_new(&e, &d, m, n, pad, cd); /* random: the residual when in place */
	mat_new(&e, &c, m, n, pad ? pad + 1 : 0, cd);
	mat_new(&e, &bias, 1, n, 0, cd);
	ej_lt_gemm g = { .m = m,
			 .n = n,
			 .k = k,
			 .trans_a = ta,
			 .trans_b = tb,
			 .ab_dtype = ab,
			 .cd_dtype = cd,
			 .a = a.dev,
			 .b = b.dev,
			 .c = sep ? c.dev : NULL,
			 .d = d.dev,
			 .bias = has_bias ? bias.dev : NULL,
			 .lda = a.ld,
			 .ldb = b.ld,
			 .ldc = sep ? c.ld : 0,
			 .ldd = d.ld,
			 .alpha = (float)tu_uniform(0.5, 1.5),
			 .beta = beta1 ? 1.0f : 0.0f };
	fake_lt_stats s0 = lstats();
	ck_assert_msg(ej_cublaslt_gemm(e.ctx, e.lt, &g) == EPJ_OK, "%s",
		      epj_ctx_error(e.ctx));
	ej_cuda_sync(e.ctx, e.dev);
	fake_lt_stats s1 = lstats();
	ck_assert_int_eq(s1.matmuls, s0.matmuls + 1);
	ck_assert_int_eq(s1.heuristics, s0.heuristics + 1);
	ck_assert_ptr_eq(s1.last_stream, ej_cuda_compute_stream(e.dev));
	/* column-major: cuBLASLt computes d^T, n x m */
	ck_assert_int_eq(s1.last_m, n);
	ck_assert_int_eq(s1.last_n, m);
	ck_assert_int_eq(s1.last_epilogue, has_bias ? 4 : 1);
	/* in place the reference's c is d as it was */
	check_result(&e, &g, &a, &b, sep ? &c : &d, has_bias ? &bias : NULL, &d,
		     "gemm");
	mat_free(&e, &a);
	mat_free(&e, &b);
	mat_free(&e, &c);
	mat_free(&e, &d);
	mat_free(&e, &bias);
	env_close(&e);
}
END_TEST

/* The algorithm table: one heuristic per shape; a hit computes fresh
 * numbers; a new k, a transpose or an alignment is a new shape. */
START_TEST(test_lt_cache)
{
	env e;
	if (!env_open(&e, false))
		return;
	setenv("EPJIT_CUBLASLT_WORKSPACE_MB", "1", 1);
	ej_cublaslt_free(e.lt);
	ck_assert_int_eq(ej_cublaslt_new(e.ctx, e.dev, e.a, &e.lt), EPJ_OK);
	int64_t m = tu_randint(3, 40) | 1, n = tu_randint(3, 40) | 1,
		k = tu_randint(17, 60) | 1;
	fake_lt_stats s0 = lstats();
	for (int r = 0; r < 3; r++) {
		mat a, b, d;
		/* rows of k + 2 elements: the k + 2 variant below differs
		 * in k alone */
		mat_new(&e, &a, m, k, 2, EPJ_DTYPE_BF16);
		mat_new(&e, &b, n, k, 2, EPJ_DTYPE_BF16);
		mat_new(&e, &d, m, n, 1, EPJ_DTYPE_BF16);
		ej_lt_gemm g = { .m = m,
				 .n = n,
				 .k = k,
				 .ldd = n + 1,
				 .trans_b = true,
				 .ab_dtype = EPJ_DTYPE_BF16,
				 .cd_dtype = EPJ_DTYPE_BF16,
				 .a = a.dev,
				 .b = b.dev,
				 .d = d.dev,
				 .lda = k + 2,
				 .ldb = k + 2,
				 .alpha = 1 };
		ck_assert_msg(ej_cublaslt_gemm(e.ctx, e.lt, &g) == EPJ_OK, "%s",
			      epj_ctx_error(e.ctx));
		check_result(&e, &g, &a, &b, NULL, NULL, &d, "cached gemm");
		mat_free(&e, &a);
		mat_free(&e, &b);
		mat_free(&e, &d);
	}
	fake_lt_stats s1 = lstats();
	ck_assert_int_eq(s1.heuristics, s0.heuristics + 1);
	ck_assert_int_eq(s1.matmuls, s0.matmuls + 3);
	/* the workspace the handle holds is what the library was given */
	ck_assert_int_eq(s1.last_workspace, 1 << 20);
	ej_cublaslt_stats st;
	ej_cublaslt_stats_get(e.lt, &st);
	ck_assert_int_eq(st.cache_hits, 2);
	ck_assert_int_eq(st.cache_entries, 1);
	ck_assert_int_eq(st.heuristic_calls, 1);
	ck_assert_int_eq(epj_counter_get(e.ctx, "cublaslt.cache_hits"), 2);
	ck_assert_int_eq(epj_counter_get(e.ctx, "cublaslt.gemms"), 3);
	/* another k, another transpose, another alignment: new entries, each
	 * right (the stand-in refuses an algorithm chosen for another
	 * problem or alignment) */
	for (int v = 0; v < 3; v++) {
		mat a, b, d;
		int64_t kk = v == 0 ? k + 2 : k;
		mat_new(&e, &a, m, kk, k + 2 - kk, EPJ_DTYPE_BF16);
		mat_new(&e, &b, v == 1 ? kk : n, v == 1 ? n : kk,
			v == 1 ? 0 : k + 2 - kk, EPJ_DTYPE_BF16);
		mat_new(&e, &d, m, n + 1, 0, EPJ_DTYPE_BF16);
		ej_lt_gemm g = { .m = m,
				 .n = n,
				 .k = kk,
				 .trans_b = v != 1,
				 .ab_dtype = EPJ_DTYPE_BF16,
				 .cd_dtype = EPJ_DTYPE_BF16,
				 .a = a.dev,
				 .b = b.dev,
				 .d = d.dev,
				 .lda = k + 2,
				 .ldb = v == 1 ? n : k + 2,
				 .ldd = n + 1,
				 .alpha = 1 };
		if (v == 2) /* d one element in: 2-byte aligned */
			g.d = (char *)d.dev + 2;
		ck_assert_msg(ej_cublaslt_gemm(e.ctx, e.lt, &g) == EPJ_OK, "%s",
			      epj_ctx_error(e.ctx));
		size_t bytes = (size_t)(m * (n + 1)) * 2;
		uint16_t *back = malloc(bytes);
		e.vt->copy(e.vt->self, back, d.dev, bytes);
		for (int64_t i = 0; i < m; i++)
			for (int64_t j = 0; j < n; j++) {
				double s = 0;
				for (int64_t q = 0; q < kk; q++)
					s += mat_at(&a, i, q) *
					     (v == 1 ? mat_at(&b, q, j)
						     : mat_at(&b, j, q));
				double got = epj_bf16_to_f32(
				    back[i * (n + 1) + j + (v == 2)]);
				ck_assert_msg(
				    fabs(got - s) <= 1e-4 * kk + 4e-3 * fabs(s),
				    "variant %d d[%lld,%lld] %g vs %g", v,
				    (long long)i, (long long)j, got, s);
			}
		free(back);
		mat_free(&e, &a);
		mat_free(&e, &b);
		mat_free(&e, &d);
	}
	ej_cublaslt_stats_get(e.lt, &st);
	ck_assert_int_eq(st.cache_entries, 4);
	ck_assert_int_eq(st.heuristic_calls, 4);
	ck_assert_int_eq(st.cache_hits, 2);
	ck_assert_int_eq(lstats().refused, s0.refused);
	env_close(&e);
}
END_TEST

typedef int (*layout_create_fn)(void **, int, uint64_t, uint64_t, int64_t);
typedef int (*layout_destroy_fn)(void *);
typedef int (*desc_create_fn)(void **, int, int);
typedef int (*desc_destroy_fn)(void *);
typedef int (*create_fn)(void **);
typedef int (*heur_fn)(void *, void *, void *, void *, void *, void *, void *,
		       int, void *, int *);

/* Refusals: ours before the library (naming the field), the stand-in's of
 * bad layouts (as the real library's), the check macro's message. */
START_TEST(test_lt_refused)
{
	env e;
	if (!env_open(&e, false))
		return;
	mat a, b, d;
	int64_t m = 7, n = 5, k = 9;
	mat_new(&e, &a, m, k, 0, EPJ_DTYPE_BF16);
	mat_new(&e, &b, k, n, 0, EPJ_DTYPE_BF16);
	mat_new(&e, &d, m, n, 0, EPJ_DTYPE_BF16);
	ej_lt_gemm g = { .m = m,
			 .n = n,
			 .k = k,
			 .ab_dtype = EPJ_DTYPE_BF16,
			 .cd_dtype = EPJ_DTYPE_BF16,
			 .a = a.dev,
			 .b = b.dev,
			 .d = d.dev,
			 .alpha = 1 };
	fake_lt_stats s0 = lstats();
	ej_lt_gemm x = g;
	x.lda = k - 1;
	expect_error(e.ctx, ej_cublaslt_gemm(e.ctx, e.lt, &x), EPJ_ERR_INVALID,
		     "lda=8 is below the stored row "
		     "width 9");
	x = g;
	x.ab_dtype = EPJ_DTYPE_F32;
	expect_error(e.ctx, ej_cublaslt_gemm(e.ctx, e.lt, &x), EPJ_ERR_DTYPE,
		     "a/b f32 and c/d bf16");
	x = g;
	x.k = 0;
	expect_error(e.ctx, ej_cublaslt_gemm(e.ctx, e.lt, &x), EPJ_ERR_SHAPE,
		     "k in [1, 2^31)");
	x = g;
	x.m = 0; /* nothing to do */
	ck_assert_int_eq(ej_cublaslt_gemm(e.ctx, e.lt, &x), EPJ_OK);
	ck_assert_int_eq(lstats().matmuls, s0.matmuls);
	ck_assert_int_eq(lstats().heuristics, s0.heuristics);
	/* a failing call: the check macro's text, file:line, the library's
	 * status name and string, and the GEMM */
	setenv("FAKE_CUBLASLT_FAIL", "cublasLtMatmul", 1);
	epj_status st = ej_cublaslt_gemm(e.ctx, e.lt, &g);
	ck_assert_int_eq(st, EPJ_ERR_BACKEND);
	const char *msg = epj_ctx_error(e.ctx);
	ck_assert_msg(strstr(msg, "cublasLtMatmul(") &&
			  strstr(msg, "cublaslt.c:") &&
			  strstr(msg, "CUBLAS_STATUS_INTERNAL_ERROR (14)") &&
			  strstr(msg, "an internal operation failed") &&
			  strstr(msg, "m=7 n=5 k=9"),
		      "%s", msg);
	unsetenv("FAKE_CUBLASLT_FAIL");
	epj_ctx_clear_error(e.ctx);
	/* the failure left the handle usable: the algorithm was kept */
	ck_assert_int_eq(ej_cublaslt_gemm(e.ctx, e.lt, &g), EPJ_OK);
	check_result(&e, &g, &a, &b, NULL, NULL, &d, "after a failure");
	/* the stand-in refuses layouts that do not agree, as cuBLASLt does:
	 * op(A) 5 x 9 against B 7 x 9 (not 9 x 7) */
	layout_create_fn lc;
	layout_destroy_fn ldestroy;
	desc_create_fn dc;
	desc_destroy_fn dd;
	create_fn hc, pc;
	heur_fn hf;
	void *p;
	p = dlsym(e.fake, "cublasLtMatrixLayoutCreate");
	memcpy(&lc, &p, sizeof p);
	p = dlsym(e.fake, "cublasLtMatrixLayoutDestroy");
	memcpy(&ldestroy, &p, sizeof p);
	p = dlsym(e.fake, "cublasLtMatmulDescCreate");
	memcpy(&dc, &p, sizeof p);
	p = dlsym(e.fake, "cublasLtMatmulDescDestroy");
	memcpy(&dd, &p, sizeof p);
	p = dlsym(e.fake, "cublasLtCreate");
	memcpy(&hc, &p, sizeof p);
	p = dlsym(e.fake, "cublasLtMatmulPreferenceCreate");
	memcpy(&pc, &p, sizeof p);
	p = dlsym(e.fake, "cublasLtMatmulAlgoGetHeuristic");
	memcpy(&hf, &p, sizeof p);
	void *h, *op, *pref, *la, *lb, *lcd, *lbad;
	ck_assert_int_eq(hc(&h), 0);
	ck_assert_int_eq(dc(&op, 68, 0), 0);
	ck_assert_int_eq(pc(&pref), 0);
	ck_assert_int_eq(lc(&la, 14, 5, 9, 5), 0);
	ck_assert_int_eq(lc(&lb, 14, 9, 7, 9), 0);
	ck_assert_int_eq(lc(&lcd, 14, 5, 7, 5), 0);
	ck_assert_int_eq(lc(&lbad, 14, 7, 9, 7), 0);
	char res[256];
	int got = 0;
	ck_assert_int_eq(hf(h, op, la, lb, lcd, lcd, pref, 1, res, &got), 0);
	ck_assert_int_eq(hf(h, op, la, lbad, lcd, lcd, pref, 1, res, &got), 7);
	void *lshort; /* ld below the row count */
	ck_assert_int_eq(lc(&lshort, 14, 5, 9, 4), 0);
	ck_assert_int_eq(hf(h, op, lshort, lb, lcd, lcd, pref, 1, res, &got),
			 7);
	void *lf32; /* A and B of different types */
	ck_assert_int_eq(lc(&lf32, 0, 9, 7, 9), 0);
	ck_assert_int_eq(hf(h, op, la, lf32, lcd, lcd, pref, 1, res, &got), 7);
	ldestroy(la);
	ldestroy(lb);
	ldestroy(lcd);
	ldestroy(lbad);
	ldestroy(lshort);
	ldestroy(lf32);
	dd(op);
	int (*destroy)(void *);
	p = dlsym(e.fake, "cublasLtMatmulPreferenceDestroy");
	memcpy(&destroy, &p, sizeof p);
	destroy(pref);
	p = dlsym(e.fake, "cublasLtDestroy");
	memcpy(&destroy, &p, sizeof p);
	destroy(h);
	mat_free(&e, &a);
	mat_free(&e, &b);
	mat_free(&e, &d);
	env_close(&e);
}
END_TEST

/* ---- grouped ------------------------------------------------------------- */

/* Expert GEMMs: y_e[m_e, N] = x_e[m_e, K] . w_e[N, K]^T (+ y_e with beta 1),
 * m_e random with empty experts.  _i = 0: one grouped call; 1: libcublas
 * off, a loop; 2: a bias makes it a loop. */
START_TEST(test_lt_grouped)
{
	env e;
	if (!env_open(&e, _i != 1))
		return;
	int ne = (int)tu_randint(3, 7);
	int64_t N = tu_randint(3, 30) | 1, K = tu_randint(3, 40) | 1;
	mat x[8], w[8], y[8], bias;
	ej_lt_gemm g[8];
	int live = 0;
	mat_new(&e, &bias, 1, N, 0, EPJ_DTYPE_BF16);
	float beta = tu_randint(0, 2) ? 1.0f : 0.0f;
	for (int i = 0; i < ne; i++) {
		int64_t m = i == 1 ? 0 : tu_randint(1, 20);
		live += m > 0;
		mat_new(&e, &x[i], m, K, 0, EPJ_DTYPE_BF16);
		mat_new(&e, &w[i], N, K, 0, EPJ_DTYPE_BF16);
		mat_new(&e, &y[i], m, N, 0, EPJ_DTYPE_BF16);
		g[i] = (ej_lt_gemm){ .m = m,
				     .n = N,
				     .k = K,
				     .trans_b = true,
				     .ab_dtype = EPJ_DTYPE_BF16,
				     .cd_dtype = EPJ_DTYPE_BF16,
				     .a = x[i].dev,
				     .b = w[i].dev,
				     .d = y[i].dev,
				     .bias = _i == 2 ? bias.dev : NULL,
				     .alpha = 1,
				     .beta = beta };
	}
	fake_lt_stats s0 = lstats();
	ck_assert_msg(ej_cublaslt_gemm_grouped(e.ctx, e.lt, ne, g) == EPJ_OK,
		      "%s", epj_ctx_error(e.ctx));
	fake_lt_stats s1 = lstats();
	ej_cublaslt_stats st;
	ej_cublaslt_stats_get(e.lt, &st);
	if (_i == 0) {
		ck_assert(st.grouped_available);
		ck_assert_int_eq(s1.grouped, s0.grouped + 1);
		ck_assert_int_eq(s1.grouped_problems,
				 s0.grouped_problems + live);
		ck_assert_int_eq(s1.matmuls, s0.matmuls);
		ck_assert_int_eq(st.grouped_native, 1);
		ck_assert_ptr_eq(s1.last_stream, ej_cuda_compute_stream(e.dev));
	} else {
		ck_assert(_i == 2 || !st.grouped_available);
		ck_assert_int_eq(s1.grouped, s0.grouped);
		ck_assert_int_eq(s1.matmuls, s0.matmuls + live);
		ck_assert_int_eq(st.grouped_looped, 1);
	}
	for (int i = 0; i < ne; i++) {
		if (g[i].m)
			check_result(&e, &g[i], &x[i], &w[i], &y[i],
				     _i == 2 ? &bias : NULL, &y[i], "expert");
		mat_free(&e, &x[i]);
		mat_free(&e, &w[i]);
		mat_free(&e, &y[i]);
	}
	mat_free(&e, &bias);
	env_close(&e);
}
END_TEST

Suite *make_cublaslt_suite(void)
{
	Suite *s = suite_create("cublaslt");
	TCase *tc = tcase_create("cublaslt");
	tcase_set_timeout(tc, 120);
	tcase_add_loop_test(tc, test_lt_absent, 0, 2);
	tcase_add_loop_test(tc, test_lt_gemm, 0, 64);
	tcase_add_test(tc, test_lt_cache);
	tcase_add_test(tc, test_lt_refused);
	tcase_add_loop_test(tc, test_lt_grouped, 0, 3);
	suite_add_tcase(s, tc);
	return s;
}
