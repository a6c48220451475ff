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
 *    libcublas is off or a GEMM has a bias; empty experts skipped;
 *  - "no algorithm" as a real GPU says it (FAKE_CUBLASLT_NOT_SUPPORTED):
 *    CUBLAS_STATUS_NOT_SUPPORTED from the heuristic or from
 *    cublasLtMatmul is EPJ_ERR_UNSUPPORTED with nothing issued, counted
 *    (cublaslt.fallbacks) and remembered per shape, from the grouped GEMM
 *    a loop; other statuses stay hard errors; and a cuda context whose
 *    heuristic answers NOT_SUPPORTED trains a small MLP through the
 *    template with the cpu context's numbers.
 */
#include "check_util.h"

#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cublaslt.h"
#include "cuda_libs.h"

extern void ej_cuda_test_reset(void);
extern void ej_cublaslt_test_reset(void);

typedef struct fake_lt_stats {
	long long heuristics, matmuls, grouped, grouped_problems;
	long long refused;
	long long not_supported;
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
	unsetenv("FAKE_CUBLASLT_NOT_SUPPORTED");
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

/* ---- where the CUDA libraries are looked for (lib/cuda_libs.h) ----------
 * A library only in a Python environment's nvidia/<pkg>/lib (pip wheels)
 * or only in $CUDA_HOME/lib64 is found, the file loaded is the one
 * reported, $CUDA_HOME comes before the environments, and a library found
 * nowhere names every place it was looked for.  (A name of its own: the
 * real cuBLASLt may be on the loader's path here.) */
static void copy_file(const char *from, const char *to)
{
	FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
	ck_assert_msg(in && out, "copy %s -> %s", from, to);
	char buf[65536];
	size_t n;
	while ((n = fread(buf, 1, sizeof buf, in)) > 0)
		ck_assert(fwrite(buf, 1, n, out) == n);
	fclose(in);
	ck_assert_int_eq(fclose(out), 0);
}

START_TEST(test_cuda_lib_search)
{
	char lt[4096];
	if (!lib_path("libfakecublaslt.so", lt, sizeof lt))
		return;
	char *env = tu_tmpdir_new("pyenv"), *home = tu_tmpdir_new("cudahome");
	char d[4096], in_env[4200], in_home[4200];
	snprintf(d, sizeof d, "%s/lib", env);
	ck_assert_int_eq(mkdir(d, 0700), 0);
	snprintf(d, sizeof d, "%s/lib/python3.11", env);
	ck_assert_int_eq(mkdir(d, 0700), 0);
	snprintf(d, sizeof d, "%s/lib/python3.11/site-packages", env);
	ck_assert_int_eq(mkdir(d, 0700), 0);
	snprintf(d, sizeof d, "%s/lib/python3.11/site-packages/nvidia", env);
	ck_assert_int_eq(mkdir(d, 0700), 0);
	snprintf(d, sizeof d, "%s/lib/python3.11/site-packages/nvidia/cu13",
		 env);
	ck_assert_int_eq(mkdir(d, 0700), 0);
	snprintf(d, sizeof d, "%s/lib/python3.11/site-packages/nvidia/cu13/lib",
		 env);
	ck_assert_int_eq(mkdir(d, 0700), 0);
	snprintf(in_env, sizeof in_env, "%s/libepjsearch.so.3", d);
	copy_file(lt, in_env);
	static const char *const names[] = { "libepjsearch.so.4",
					     "libepjsearch.so.3" };
	char path[1024], why[1600];
	/* only in the environment (named among others) */
	setenv("CUDA_HOME", home, 1);
	unsetenv("VIRTUAL_ENV");
	unsetenv("CONDA_PREFIX");
	char envs[8300];
	snprintf(envs, sizeof envs, "/nonexistent/epjit-env:%s", env);
	setenv("EPJIT_PYTHON_ENVS", envs, 1);
	void *h =
	    ej_cuda_lib_open(names, 2, path, sizeof path, why, sizeof why);
	ck_assert_msg(h, "%s", why);
	ck_assert_str_eq(path, in_env);
	ck_assert_ptr_nonnull(dlsym(h, "cublasLtMatmul"));
	dlclose(h);
	/* VIRTUAL_ENV alone finds it too */
	unsetenv("EPJIT_PYTHON_ENVS");
	setenv("VIRTUAL_ENV", env, 1);
	h = ej_cuda_lib_open(names, 2, path, sizeof path, why, sizeof why);
	ck_assert_msg(h, "%s", why);
	ck_assert_str_eq(path, in_env);
	dlclose(h);
	/* $CUDA_HOME/lib64 before the environments */
	snprintf(d, sizeof d, "%s/lib64", home);
	ck_assert_int_eq(mkdir(d, 0700), 0);
	snprintf(in_home, sizeof in_home, "%s/libepjsearch.so.3", d);
	copy_file(lt, in_home);
	h = ej_cuda_lib_open(names, 2, path, sizeof path, why, sizeof why);
	ck_assert_msg(h, "%s", why);
	ck_assert_str_eq(path, in_home);
	dlclose(h);
	/* nowhere: every place is named */
	static const char *const none[] = { "libepjsearch-none.so.1" };
	h = ej_cuda_lib_open(none, 1, path, sizeof path, why, sizeof why);
	ck_assert_ptr_null(h);
	ck_assert_msg(strstr(why, "libepjsearch-none.so.1 not found") == why &&
			  strstr(why, home) && strstr(why, env) &&
			  strstr(why, "EPJIT_PYTHON_ENVS"),
		      "%s", why);
	unsetenv("VIRTUAL_ENV");
	unsetenv("CUDA_HOME");
	tu_tmpdir_free(env);
	tu_tmpdir_free(home);
}
END_TEST

/* The loaders report the file they loaded: cuBLASLt from an override
 * names the file, not only the name asked for. */
START_TEST(test_lt_loaded_path)
{
	char lt[4096];
	if (!lib_path("libfakecublaslt.so", lt, sizeof lt))
		return;
	ej_cublaslt_test_reset();
	setenv("EPJIT_CUBLASLT", lt, 1);
	ck_assert(ej_cublaslt_available(NULL));
	char want[4096];
	ck_assert_ptr_nonnull(realpath(lt, want));
	char got[4096];
	ck_assert_ptr_nonnull(realpath(ej_cublaslt_path(), got));
	ck_assert_str_eq(got, want);
	unsetenv("EPJIT_CUBLASLT");
	ej_cublaslt_test_reset();
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

/* ---- "no algorithm": CUBLAS_STATUS_NOT_SUPPORTED -------------------------
 * What a real GPU answers for a layout or type it has no kernel for. */

/* One bf16 GEMM d[m,n] = a[m,k] . b[n,k]^T on fresh device matrices. */
typedef struct plain {
	mat a, b, d;
	ej_lt_gemm g;
} plain;

static void plain_new(env *e, plain *p, int64_t m, int64_t n, int64_t k)
{
	mat_new(e, &p->a, m, k, 0, EPJ_DTYPE_BF16);
	mat_new(e, &p->b, n, k, 0, EPJ_DTYPE_BF16);
	mat_new(e, &p->d, m, n, 0, EPJ_DTYPE_BF16);
	p->g = (ej_lt_gemm){ .m = m,
			     .n = n,
			     .k = k,
			     .trans_b = true,
			     .ab_dtype = EPJ_DTYPE_BF16,
			     .cd_dtype = EPJ_DTYPE_BF16,
			     .a = p->a.dev,
			     .b = p->b.dev,
			     .d = p->d.dev,
			     .alpha = 1 };
}

static void plain_free(env *e, plain *p)
{
	mat_free(e, &p->a);
	mat_free(e, &p->b);
	mat_free(e, &p->d);
}

/* p's d on the device still holds its initial values: nothing ran. */
static void plain_untouched(env *e, const plain *p)
{
	size_t bytes = (size_t)(p->d.rows * p->d.ld) * 2;
	void *back = malloc(bytes);
	e->vt->copy(e->vt->self, back, p->d.dev, bytes);
	ck_assert_msg(memcmp(back, p->d.host, bytes) == 0,
		      "a refused GEMM wrote its output");
	free(back);
}

/* A GEMM answered "no algorithm": EPJ_ERR_UNSUPPORTED whose message says
 * why (needle) and names the shape. */
static void expect_no_algo(env *e, const plain *p, const char *needle)
{
	epj_status st = ej_cublaslt_gemm(e->ctx, e->lt, &p->g);
	ck_assert_msg(st == EPJ_ERR_UNSUPPORTED, "status %d: %s", (int)st,
		      epj_ctx_error(e->ctx));
	char shape[96];
	snprintf(shape, sizeof shape, "m=%lld n=%lld k=%lld", (long long)p->g.m,
		 (long long)p->g.n, (long long)p->g.k);
	const char *msg = epj_ctx_error(e->ctx);
	ck_assert_msg(strstr(msg, "no algorithm") && strstr(msg, needle) &&
			  strstr(msg, shape),
		      "%s", msg);
	epj_ctx_clear_error(e->ctx);
	plain_untouched(e, p);
}

/* The handle: NOT_SUPPORTED from the heuristic, then from cublasLtMatmul,
 * is "no algorithm" -- EPJ_ERR_UNSUPPORTED, no cublasLtMatmul run,
 * counted, and remembered for the shape (not asked again, even once the
 * library would answer); other shapes keep cuBLASLt; another status
 * (INTERNAL_ERROR) stays a hard EPJ_ERR_BACKEND and is not remembered. */
START_TEST(test_lt_not_supported)
{
	env e;
	if (!env_open(&e, true))
		return;
	int64_t m = tu_randint(2, 30) | 1, n = tu_randint(2, 30) | 1,
		k = tu_randint(3, 40) | 1;
	plain p, q, r, h;
	plain_new(&e, &p, m, n, k);
	plain_new(&e, &q, m, n, k + 2);
	plain_new(&e, &r, m, n, k + 4);
	plain_new(&e, &h, m, n, k + 6);
	fake_lt_stats s0 = lstats();
	ej_cublaslt_stats st;

	/* the heuristic: asked once, remembered */
	setenv("FAKE_CUBLASLT_NOT_SUPPORTED", "cublasLtMatmulAlgoGetHeuristic",
	       1);
	for (int t = 0; t < 2; t++)
		expect_no_algo(&e, &p,
			       "cublasLtMatmulAlgoGetHeuristic answered "
			       "CUBLAS_STATUS_NOT_SUPPORTED (15)");
	fake_lt_stats s1 = lstats();
	ck_assert_int_eq(s1.heuristics, s0.heuristics + 1);
	ck_assert_int_eq(s1.not_supported, s0.not_supported + 1);
	ck_assert_int_eq(s1.matmuls, s0.matmuls);
	ej_cublaslt_stats_get(e.lt, &st);
	ck_assert_int_eq(st.fallbacks, 2);
	ck_assert_int_eq(st.heuristic_calls, 1);
	ck_assert_int_eq(st.cache_entries, 1);
	ck_assert_int_eq(st.cache_hits, 0);
	ck_assert_int_eq(epj_counter_get(e.ctx, "cublaslt.fallbacks"), 2);
	ck_assert_int_eq(epj_counter_get(e.ctx, "cublaslt.gemms"), 0);
	/* the refusal is the handle's answer for that shape, as an algorithm
	 * would be; another shape runs through cuBLASLt */
	unsetenv("FAKE_CUBLASLT_NOT_SUPPORTED");
	expect_no_algo(&e, &p, "(remembered)");
	ck_assert_int_eq(lstats().heuristics, s0.heuristics + 1);
	ck_assert_msg(ej_cublaslt_gemm(e.ctx, e.lt, &q.g) == EPJ_OK, "%s",
		      epj_ctx_error(e.ctx));
	check_result(&e, &q.g, &q.a, &q.b, NULL, NULL, &q.d, "other shape");
	ck_assert_int_eq(lstats().matmuls, s0.matmuls + 1);

	/* cublasLtMatmul itself: the algorithm's entry becomes a refusal */
	setenv("FAKE_CUBLASLT_NOT_SUPPORTED", "cublasLtMatmul", 1);
	for (int t = 0; t < 2; t++)
		expect_no_algo(&e, &r,
			       "cublasLtMatmul answered "
			       "CUBLAS_STATUS_NOT_SUPPORTED (15)");
	s1 = lstats();
	ck_assert_int_eq(s1.heuristics, s0.heuristics + 3);
	ck_assert_int_eq(s1.not_supported, s0.not_supported + 2);
	ck_assert_int_eq(s1.matmuls, s0.matmuls + 1);
	unsetenv("FAKE_CUBLASLT_NOT_SUPPORTED");
	/* q's algorithm is still there: a cache hit with fresh numbers */
	ck_assert_msg(ej_cublaslt_gemm(e.ctx, e.lt, &q.g) == EPJ_OK, "%s",
		      epj_ctx_error(e.ctx));
	check_result(&e, &q.g, &q.a, &q.b, NULL, NULL, &q.d, "hit");
	ej_cublaslt_stats_get(e.lt, &st);
	ck_assert_int_eq(st.fallbacks, 5);
	ck_assert_int_eq(st.cache_entries, 3);
	ck_assert_int_eq(st.cache_hits, 1);
	ck_assert_int_eq(epj_counter_get(e.ctx, "cublaslt.fallbacks"), 5);

	/* any other status stays a hard error, and is not remembered */
	setenv("FAKE_CUBLASLT_FAIL", "cublasLtMatmulAlgoGetHeuristic", 1);
	expect_error(e.ctx, ej_cublaslt_gemm(e.ctx, e.lt, &h.g),
		     EPJ_ERR_BACKEND, "CUBLAS_STATUS_INTERNAL_ERROR (14)");
	unsetenv("FAKE_CUBLASLT_FAIL");
	ck_assert_msg(ej_cublaslt_gemm(e.ctx, e.lt, &h.g) == EPJ_OK, "%s",
		      epj_ctx_error(e.ctx));
	check_result(&e, &h.g, &h.a, &h.b, NULL, NULL, &h.d, "after a failure");
	ej_cublaslt_stats_get(e.lt, &st);
	ck_assert_int_eq(st.fallbacks, 5);
	plain_free(&e, &p);
	plain_free(&e, &q);
	plain_free(&e, &r);
	plain_free(&e, &h);
	env_close(&e);
}
END_TEST

/* The grouped GEMM answering NOT_SUPPORTED (a type combination it lacks):
 * the call loops over single GEMMs with the right numbers, and later bf16
 * calls loop without asking; f32 calls stay grouped. */
START_TEST(test_lt_grouped_not_supported)
{
	env e;
	if (!env_open(&e, true))
		return;
	int64_t N = tu_randint(3, 30) | 1, K = tu_randint(3, 40) | 1;
	fake_lt_stats s0 = lstats();
	for (int round = 0; round < 3; round++) {
		/* rounds 0, 1: bf16 (the first refused); 2: f32 */
		epj_dtype dt = round == 2 ? EPJ_DTYPE_F32 : EPJ_DTYPE_BF16;
		if (round == 0)
			setenv("FAKE_CUBLASLT_NOT_SUPPORTED",
			       "cublasGemmGroupedBatchedEx", 1);
		int ne = 4, live = 0;
		mat x[4], w[4], y[4];
		ej_lt_gemm g[4];
		for (int i = 0; i < ne; i++) {
			int64_t m = i == 2 ? 0 : tu_randint(1, 20);
			live += m > 0;
			mat_new(&e, &x[i], m, K, 0, dt);
			mat_new(&e, &w[i], N, K, 0, dt);
			mat_new(&e, &y[i], m, N, 0, dt);
			g[i] = (ej_lt_gemm){ .m = m,
					     .n = N,
					     .k = K,
					     .trans_b = true,
					     .ab_dtype = dt,
					     .cd_dtype = dt,
					     .a = x[i].dev,
					     .b = w[i].dev,
					     .d = y[i].dev,
					     .alpha = 1 };
		}
		fake_lt_stats a = lstats();
		ck_assert_msg(ej_cublaslt_gemm_grouped(e.ctx, e.lt, ne, g) ==
				  EPJ_OK,
			      "%s", epj_ctx_error(e.ctx));
		fake_lt_stats b = lstats();
		if (round < 2) {
			ck_assert_int_eq(b.grouped, a.grouped);
			ck_assert_int_eq(b.matmuls, a.matmuls + live);
		} else {
			ck_assert_int_eq(b.grouped, a.grouped + 1);
			ck_assert_int_eq(b.matmuls, a.matmuls);
		}
		for (int i = 0; i < ne; i++) {
			if (g[i].m)
				check_result(&e, &g[i], &x[i], &w[i], NULL,
					     NULL, &y[i], "expert");
			mat_free(&e, &x[i]);
			mat_free(&e, &w[i]);
			mat_free(&e, &y[i]);
		}
		unsetenv("FAKE_CUBLASLT_NOT_SUPPORTED");
	}
	ck_assert_int_eq(lstats().not_supported, s0.not_supported + 1);
	ej_cublaslt_stats st;
	ej_cublaslt_stats_get(e.lt, &st);
	ck_assert_int_eq(st.grouped_looped, 2);
	ck_assert_int_eq(st.grouped_native, 1);
	ck_assert_int_eq(st.fallbacks, 0);
	ck_assert_int_eq(epj_counter_get(e.ctx, "cublaslt.grouped_refused"), 1);
	env_close(&e);
}
END_TEST

/* The MLP step of test_lt_ctx_not_supported on ctx, from the cpu tensors
 * in[5] (x [T,fin], w1 [hid,fin], b1 [hid], w2 [fout,hid], target
 * [T,fout]):
 *
 *   loss = sum((linear(silu(linear(x, w1, b1)), w2) - target)^2)
 *
 * its backward and one SGD step (lr 0.001), then the loss again.  out[8]:
 * loss, dw1, db1, dw2, the updated w1, b1, w2, the loss after. */
enum { MLP_OUT = 8 };

static epj_tensor *mlp_loss(epj_ctx *ctx, epj_tensor *x, epj_tensor *w1,
			    epj_tensor *b1, epj_tensor *w2, epj_tensor *tgt)
{
	epj_tensor *l1 = epj_linear(ctx, x, w1, b1);
	epj_tensor *h = epj_silu(ctx, l1);
	epj_tensor *y = epj_linear(ctx, h, w2, NULL);
	epj_tensor *dy = epj_sub(ctx, y, tgt);
	epj_tensor *sq = epj_mul(ctx, dy, dy);
	epj_tensor *loss = epj_sum_all(ctx, sq);
	tu_ok(ctx, loss);
	epj_tensor *fr[] = { l1, h, y, dy, sq };
	for (size_t i = 0; i < EJ_ARRAY_LEN(fr); i++)
		epj_tensor_free(fr[i]);
	return loss;
}

static void mlp_step(epj_ctx *ctx, epj_tensor *const *in, epj_tensor **out)
{
	epj_tensor *t[5];
	for (int i = 0; i < 5; i++) {
		t[i] = epj_tensor_from_data(
		    ctx, EPJ_DTYPE_F32, epj_tensor_ndim(in[i]),
		    epj_tensor_shape(in[i]), epj_tensor_data(in[i]));
		tu_ok(ctx, t[i]);
	}
	for (int i = 1; i <= 3; i++)
		epj_tensor_set_requires_grad(t[i], true);
	out[0] = mlp_loss(ctx, t[0], t[1], t[2], t[3], t[4]);
	ck_assert_msg(epj_backward(ctx, out[0], NULL) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_tensor *nw[3];
	for (int i = 0; i < 3; i++) {
		epj_tensor *gr = epj_tensor_grad(t[i + 1]);
		tu_ok(ctx, gr);
		out[1 + i] = epj_tensor_ref(gr);
		epj_tensor *wd = epj_detach(ctx, t[i + 1]);
		epj_tensor *st = epj_mul_scalar(ctx, gr, 0.001);
		nw[i] = epj_sub(ctx, wd, st);
		tu_ok(ctx, nw[i]);
		out[4 + i] = epj_tensor_ref(nw[i]);
		epj_tensor_free(wd);
		epj_tensor_free(st);
	}
	out[7] = mlp_loss(ctx, t[0], nw[0], nw[1], nw[2], t[4]);
	for (int i = 0; i < 3; i++)
		epj_tensor_free(nw[i]);
	for (int i = 0; i < 5; i++)
		epj_tensor_free(t[i]);
}

/* A cuda context (the guarded stand-in driver) whose cuBLASLt heuristic
 * answers CUBLAS_STATUS_NOT_SUPPORTED for every GEMM, as a real GPU does
 * for layouts it has no kernel for: the forward, backward and SGD step of
 * a small MLP run their GEMMs on the template, never fail, and give the
 * cpu context's numbers; the fallback is counted. */
START_TEST(test_lt_ctx_not_supported)
{
	char lt[4096];
	if (!tu_fake_cuda_usable() ||
	    !lib_path("libfakecublaslt.so", lt, sizeof lt)) {
		fprintf(stderr, "check_cublaslt: stand-ins or NVRTC missing: "
				"case skipped\n");
		return;
	}
	epj_ctx *cpu = tu_ctx();
	int64_t T = tu_randint(2, 9), fin = tu_randint(2, 12) | 1,
		hid = tu_randint(2, 12) | 1, fout = tu_randint(2, 8) | 1;
	int64_t sh[5][2] = {
		{ T, fin }, { hid, fin }, { hid, 0 }, { fout, hid }, { T, fout }
	};
	epj_tensor *in[5];
	for (int i = 0; i < 5; i++) {
		in[i] = tu_randn(cpu, EPJ_DTYPE_F32, i == 2 ? 1 : 2, sh[i]);
		tu_ok(cpu, in[i]);
	}
	epj_tensor *ref[MLP_OUT], *got[MLP_OUT];
	mlp_step(cpu, in, ref);
	/* the step moved the weights (the loss may rise: random weights of
	 * std 1 can make even a small step overshoot) */
	ck_assert_msg(epj_tensor_get_f64(ref[7], 0) !=
			  epj_tensor_get_f64(ref[0], 0),
		      "the step did not change the loss");

	ej_cublaslt_test_reset();
	setenv("EPJIT_CUBLASLT", lt, 1);
	setenv("EPJIT_CUBLAS", lt, 1);
	setenv("FAKE_CUBLASLT_NOT_SUPPORTED", "cublasLtMatmulAlgoGetHeuristic",
	       1);
	ck_assert(tu_fake_cuda_begin());
	epj_ctx *g = NULL;
	ck_assert_msg(epj_ctx_new("cuda", &g) == EPJ_OK && g,
		      "epj_ctx_new(\"cuda\") on the fake driver failed");
	mlp_step(g, in, got);
	static const char *const what[MLP_OUT] = { "loss",     "dw1",
						   "db1",      "dw2",
						   "w1 after", "b1 after",
						   "w2 after", "loss after" };
	for (int i = 0; i < MLP_OUT; i++)
		tu_assert_tensors_close(cpu, got[i], ref[i], 1e-4, 1e-4,
					what[i]);
	/* every GEMM was refused by the heuristic and ran the template */
	ck_assert_int_gt(epj_counter_get(g, "cublaslt.fallbacks"), 0);
	ck_assert_int_gt(epj_counter_get(g, "gemm.cublaslt_refused"), 0);
	ck_assert_int_gt(epj_counter_get(g, "gemm.template"), 0);
	ck_assert_int_eq(epj_counter_get(g, "gemm.cublaslt"), 0);
	ck_assert_int_eq(epj_counter_get(g, "cublaslt.gemms"), 0);
	ck_assert_int_eq(epj_counter_get(g, "kernels.eager_cpu_fallback"), 0);
	for (int i = 0; i < MLP_OUT; i++) {
		epj_tensor_free(got[i]);
		epj_tensor_free(ref[i]);
	}
	for (int i = 0; i < 5; i++)
		epj_tensor_free(in[i]);
	epj_ctx_free(g);
	epj_ctx_free(cpu);
	tu_fake_cuda_end();
	unsetenv("FAKE_CUBLASLT_NOT_SUPPORTED");
	unsetenv("EPJIT_CUBLASLT");
	unsetenv("EPJIT_CUBLAS");
	ej_cublaslt_test_reset();
}
END_TEST

Suite *make_cublaslt_suite(void)
{
	Suite *s = suite_create("cublaslt");
	TCase *tc = tcase_create("cublaslt");
	tcase_set_timeout(tc, 120);
	tcase_add_loop_test(tc, test_lt_absent, 0, 2);
	tcase_add_test(tc, test_cuda_lib_search);
	tcase_add_test(tc, test_lt_loaded_path);
	tcase_add_loop_test(tc, test_lt_gemm, 0, 64);
	tcase_add_test(tc, test_lt_cache);
	tcase_add_test(tc, test_lt_refused);
	tcase_add_loop_test(tc, test_lt_grouped, 0, 3);
	tcase_add_test(tc, test_lt_not_supported);
	tcase_add_test(tc, test_lt_grouped_not_supported);
	tcase_add_test(tc, test_lt_ctx_not_supported);
	suite_add_tcase(s, tc);
	return s;
}
