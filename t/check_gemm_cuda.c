/* check_gemm_cuda.c -- the GEMM path of a "cuda" context (kernels/tmpl_gemm.c):
 * cuBLASLt where it loaded and takes the problem, the NVRTC template
 * otherwise.
 *
 * The context runs on the stand-in driver t/fake_cuda.c with its guard on
 * (device memory inaccessible to the host outside driver calls) and
 * cuBLASLt on the stand-in t/fake_cublaslt.c (column-major semantics as
 * documented, written apart from lib/cublaslt.c).  Every GEMM path of the
 * eager table -- matmul with every transpose of its operands, batched and
 * broadcast matmul, linear with and without bias, GEMM_ADD (beta = 1 for
 * f32), the backward GEMMs of matmul and linear -- is checked against the
 * cpu context on fresh random odd shapes in f32 and bf16; the counters
 * prove which path ran; the same inputs without cuBLASLt (absent, forced
 * off, or refusing the problem) give the same results through the
 * template; a failing cuBLASLt call is an error naming the call.
 */
#include "check_util.h"

#include "core_impl.h"
#include "cublaslt.h"
#include "ops_moe.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

extern void ej_cublaslt_test_reset(void);

static bool fake_lt_path(char *buf, size_t n)
{
	const char *b = getenv("top_builddir");
	snprintf(buf, n, "%s/t/.libs/libfakecublaslt.so", b ? b : ".");
	struct stat st;
	return stat(buf, &st) == 0;
}

/* How the next cuda context finds cuBLASLt: 1 the stand-in (with the
 * grouped GEMM), 0 absent (a path that does not exist). */
static void lt_use(bool on)
{
	char p[4096];
	ej_cublaslt_test_reset();
	if (on && tu_gpu_on_machine()) {
		/* a real GPU: the machine's cuBLASLt and cuBLAS */
		unsetenv("EPJIT_CUBLASLT");
		unsetenv("EPJIT_CUBLAS");
	} else if (on) {
		ck_assert(fake_lt_path(p, sizeof p));
		setenv("EPJIT_CUBLASLT", p, 1);
		setenv("EPJIT_CUBLAS", p, 1);
	} else {
		setenv("EPJIT_CUBLASLT", "/nonexistent/epjit/libcublasLt.so",
		       1);
		setenv("EPJIT_CUBLAS", "0", 1);
	}
}

static void lt_env_clear(void)
{
	unsetenv("EPJIT_CUBLASLT");
	unsetenv("EPJIT_CUBLAS");
	unsetenv("EPJIT_GEMM");
	unsetenv("FAKE_CUBLASLT_FAIL");
	unsetenv("FAKE_CUBLASLT_NO_ALGO");
	ej_cublaslt_test_reset();
}

static bool usable(void)
{
	char p[4096];
	if (!tu_fake_cuda_usable() ||
	    (!tu_gpu_on_machine() && !fake_lt_path(p, sizeof p))) {
		fprintf(stderr, "check_gemm_cuda: stand-ins or NVRTC missing: "
				"case skipped\n");
		return false;
	}
	return true;
}

static epj_ctx *cuda_ctx(void)
{
	epj_ctx *c = NULL;
	ck_assert_msg(epj_ctx_new("cuda", &c) == EPJ_OK && c,
		      "epj_ctx_new(\"cuda\") on the fake driver failed");
	ck_assert(!c->dev->host_visible);
	return c;
}

static int64_t ctr(epj_ctx *ctx, const char *name)
{
	return epj_counter_get(ctx, name);
}

/* ---- the GEMM set ---------------------------------------------------------
 * One set of inputs (host tensors on the cpu context) and the ops run on
 * any context from copies of them. */

enum { N_IN = 13, N_OUT = 17 };

typedef struct gemm_set {
	epj_dtype dt;
	epj_tensor *in[N_IN]; /* on the cpu context */
} gemm_set;

static epj_tensor *rnd(epj_ctx *cpu, epj_dtype dt, int nd, int64_t a, int64_t b,
		       int64_t c)
{
	int64_t sh[3] = { a, b, c };
	epj_tensor *t = tu_randn(cpu, dt, nd, sh);
	tu_ok(cpu, t);
	return t;
}

static void set_new(gemm_set *s, epj_ctx *cpu, epj_dtype dt)
{
	/* odd sizes, and one of each that is 1 now and then */
	int64_t m = 2 * tu_randint(1, 12) + 1, n = 2 * tu_randint(1, 12) + 1;
	int64_t k = 2 * tu_randint(1, 14) + 1, B = tu_randint(2, 4);
	int64_t t = tu_randint(1, 6), fin = 2 * tu_randint(1, 10) + 1;
	int64_t fout = 2 * tu_randint(1, 10) + 1;
	if (tu_randint(0, 4) == 0)
		m = 1;
	s->dt = dt;
	s->in[0] = rnd(cpu, dt, 2, m, k, 0);	  /* a */
	s->in[1] = rnd(cpu, dt, 2, k, n, 0);	  /* b */
	s->in[2] = rnd(cpu, dt, 2, k, m, 0);	  /* a stored transposed */
	s->in[3] = rnd(cpu, dt, 2, n, k, 0);	  /* b stored transposed */
	s->in[4] = rnd(cpu, dt, 3, B, m, k);	  /* batched a */
	s->in[5] = rnd(cpu, dt, 3, B, k, n);	  /* batched b */
	s->in[6] = rnd(cpu, dt, 3, 2, t, fin);	  /* x */
	s->in[7] = rnd(cpu, dt, 2, fout, fin, 0); /* w [out, in] */
	s->in[8] = rnd(cpu, dt, 1, fout, 0, 0);	  /* bias */
	s->in[9] = rnd(cpu, dt, 3, 2, t, fout);	  /* residual of linear */
	s->in[10] = rnd(cpu, dt, 2, m, n, 0);	  /* residual of a @ b */
	s->in[11] = rnd(cpu, dt, 3, 2, t, fout);  /* dL/dy of linear */
	s->in[12] = rnd(cpu, dt, 2, m, n, 0);	  /* dL/dy of a @ b */
}

static void set_free(gemm_set *s)
{
	for (int i = 0; i < N_IN; i++)
		epj_tensor_free(s->in[i]);
}

static epj_tensor *gemm_add(epj_ctx *ctx, epj_tensor *a, epj_tensor *b,
			    epj_tensor *r, bool lin)
{
	epj_tensor *in[3] = { a, b, r };
	ej_attrs at = ej_attrs_none();
	at.i[0] = lin;
	at.n_i = 1;
	return ej_call1(ctx, EJ_OP_GEMM_ADD, in, 3, &at);
}

/* Runs the set on ctx: out[N_OUT] new tensors of ctx. */
static void set_run(const gemm_set *s, epj_ctx *ctx, epj_tensor **out,
		    const char *what)
{
	epj_tensor *x[N_IN];
	for (int i = 0; i < N_IN; i++) {
		epj_tensor *h = s->in[i];
		x[i] = epj_tensor_from_data(ctx, s->dt, epj_tensor_ndim(h),
					    epj_tensor_shape(h),
					    epj_tensor_data(h));
		tu_ok(ctx, x[i]);
	}
	epj_tensor *at = epj_transpose(ctx, x[2], 0, 1);
	epj_tensor *bt = epj_transpose(ctx, x[3], 0, 1);
	int o = 0;
	out[o++] = epj_matmul(ctx, x[0], x[1]);
	out[o++] = epj_matmul(ctx, at, x[1]);
	out[o++] = epj_matmul(ctx, x[0], bt);
	out[o++] = epj_matmul(ctx, at, bt);
	out[o++] = epj_matmul(ctx, x[4], x[5]);
	out[o++] = epj_matmul(ctx, x[4], x[1]); /* b broadcast */
	out[o++] = epj_linear(ctx, x[6], x[7], x[8]);
	out[o++] = epj_linear(ctx, x[6], x[7], NULL);
	out[o++] = gemm_add(ctx, x[6], x[7], x[9], true);
	out[o++] = gemm_add(ctx, x[0], x[1], x[10], false);
	/* backward GEMMs: linear (dx, dw, dbias) and matmul (da, db) */
	epj_tensor *leaf[5] = { x[6], x[7], x[8], x[0], x[1] };
	for (int i = 0; i < 5; i++)
		epj_tensor_set_requires_grad(leaf[i], true);
	epj_tensor *y = epj_linear(ctx, x[6], x[7], x[8]);
	epj_tensor *p = epj_matmul(ctx, x[0], x[1]);
	tu_ok(ctx, y);
	tu_ok(ctx, p);
	ck_assert_msg(epj_backward(ctx, y, x[11]) == EPJ_OK, "%s: %s", what,
		      epj_ctx_error(ctx));
	ck_assert_msg(epj_backward(ctx, p, x[12]) == EPJ_OK, "%s: %s", what,
		      epj_ctx_error(ctx));
	for (int i = 0; i < 5; i++)
		out[o++] = epj_tensor_ref(epj_tensor_grad(leaf[i]));
	ck_assert_int_eq(o, N_OUT - 2);
	/* the same product twice: the second finds its choice cached */
	out[o++] = epj_matmul(ctx, x[0], x[1]);
	out[o++] = epj_linear(ctx, x[6], x[7], x[8]);
	for (int i = 0; i < N_OUT; i++)
		ck_assert_msg(out[i] != NULL, "%s: output %d: %s", what, i,
			      epj_ctx_error(ctx));
	epj_tensor_free(y);
	epj_tensor_free(p);
	epj_tensor_free(at);
	epj_tensor_free(bt);
	for (int i = 0; i < N_IN; i++)
		epj_tensor_free(x[i]);
}

static void outs_free(epj_tensor **o)
{
	for (int i = 0; i < N_OUT; i++)
		epj_tensor_free(o[i]);
}

/* got (any context) against ref (cpu), element by element */
static void outs_close(epj_ctx *cpu, epj_tensor **got, epj_tensor **ref,
		       double tol, const char *what)
{
	for (int i = 0; i < N_OUT; i++) {
		char w[96];
		snprintf(w, sizeof w, "%s: output %d", what, i);
		tu_assert_tensors_close(cpu, got[i], ref[i], tol, tol, w);
	}
}

/* The products in double from the set's (rounded) inputs: a @ b for the
 * first output, the plain reference the cpu context is checked against. */
static void check_cpu_reference(epj_ctx *cpu, const gemm_set *s,
				epj_tensor *const *ref, double tol)
{
	const epj_tensor *a = s->in[0], *b = s->in[1];
	int64_t m = epj_tensor_dim(a, 0), k = epj_tensor_dim(a, 1);
	int64_t n = epj_tensor_dim(b, 1);
	double *av = malloc(sizeof(double) * (size_t)(m * k));
	double *bv = malloc(sizeof(double) * (size_t)(k * n));
	double *cv = malloc(sizeof(double) * (size_t)(m * n));
	ck_assert(epj_tensor_to_f64(cpu, a, av) == EPJ_OK);
	ck_assert(epj_tensor_to_f64(cpu, b, bv) == EPJ_OK);
	ck_assert(epj_tensor_to_f64(cpu, ref[0], cv) == EPJ_OK);
	for (int64_t i = 0; i < m; i++)
		for (int64_t j = 0; j < n; j++) {
			double acc = 0, mag = 0;
			for (int64_t q = 0; q < k; q++) {
				acc += av[i * k + q] * bv[q * n + j];
				mag += fabs(av[i * k + q] * bv[q * n + j]);
			}
			ck_assert_msg(
			    fabs(cv[i * n + j] - acc) <= tol * (1 + mag),
			    "a @ b [%lld, %lld]: %.9g vs %.9g", (long long)i,
			    (long long)j, cv[i * n + j], acc);
		}
	free(av);
	free(bv);
	free(cv);
}

/* _i 0: f32, 1: bf16.  cuBLASLt takes every GEMM of the set (counted,
 * the template never runs); without it (absent) the template does, with
 * the same results. */
START_TEST(test_gemm_cublaslt)
{
	if (!usable())
		return;
	epj_dtype dt = _i ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32;
	double tol = _i ? 2e-2 : 1e-4;
	epj_ctx *cpu = tu_ctx();
	gemm_set s;
	set_new(&s, cpu, dt);
	epj_tensor *ref[N_OUT], *lt[N_OUT], *tp[N_OUT];
	set_run(&s, cpu, ref, "cpu");
	check_cpu_reference(cpu, &s, ref, _i ? 1e-2 : 1e-5);

	lt_use(true);
	ck_assert(tu_fake_cuda_begin());
	epj_ctx *g = cuda_ctx();
	set_run(&s, g, lt, "cuda with cuBLASLt");
	outs_close(cpu, lt, ref, tol, "cuBLASLt vs cpu");
	ck_assert_int_gt(ctr(g, "cublaslt.gemms"), 0);
	ck_assert_int_gt(ctr(g, "gemm.cublaslt"), 0);
	ck_assert_int_gt(ctr(g, "cublaslt.cache_hits"), 0);
	ck_assert_int_eq(ctr(g, "gemm.template"), 0);
	ck_assert_int_eq(ctr(g, "gemm.cublaslt_refused"), 0);
	ck_assert_int_eq(ctr(g, "kernels.eager_cpu_fallback"), 0);

	/* the results to the host, and the context with its handle freed
	 * before the library is reset */
	for (int i = 0; i < N_OUT; i++) {
		epj_tensor *hc =
		    epj_zeros(cpu, epj_tensor_dtype(lt[i]),
			      epj_tensor_ndim(lt[i]), epj_tensor_shape(lt[i]));
		ck_assert_int_eq(epj_tensor_copy_(cpu, hc, lt[i]), EPJ_OK);
		epj_tensor_free(lt[i]);
		lt[i] = hc;
	}
	epj_ctx_free(g);
	/* cuBLASLt absent: the template, the same numbers */
	lt_use(false);
	epj_ctx *h = cuda_ctx();
	set_run(&s, h, tp, "cuda without cuBLASLt");
	outs_close(cpu, tp, ref, tol, "template vs cpu");
	outs_close(cpu, tp, lt, tol, "template vs cuBLASLt");
	ck_assert_int_gt(ctr(h, "gemm.template"), 0);
	ck_assert_int_eq(ctr(h, "gemm.cublaslt"), 0);
	ck_assert_int_eq(ctr(h, "cublaslt.gemms"), 0);

	outs_free(ref);
	outs_free(lt);
	outs_free(tp);
	set_free(&s);
	epj_ctx_free(h);
	epj_ctx_free(cpu);
	tu_fake_cuda_end();
	lt_env_clear();
}
END_TEST

/* The template where cuBLASLt is loaded but not used: forced with
 * EPJIT_GEMM=template, or a problem the heuristic finds no algorithm for
 * (chosen once: the shape is not tried again); an unknown EPJIT_GEMM is
 * an error naming it. */
START_TEST(test_gemm_template_choice)
{
	if (!usable())
		return;
	epj_ctx *cpu = tu_ctx();
	gemm_set s;
	set_new(&s, cpu, EPJ_DTYPE_F32);
	epj_tensor *ref[N_OUT], *o[N_OUT];
	set_run(&s, cpu, ref, "cpu");
	lt_use(true);
	ck_assert(tu_fake_cuda_begin());

	setenv("EPJIT_GEMM", "template", 1);
	epj_ctx *g = cuda_ctx();
	set_run(&s, g, o, "EPJIT_GEMM=template");
	outs_close(cpu, o, ref, 1e-4, "forced template vs cpu");
	ck_assert_int_gt(ctr(g, "gemm.template"), 0);
	ck_assert_int_eq(ctr(g, "cublaslt.gemms"), 0);
	outs_free(o);
	epj_ctx_free(g);
	unsetenv("EPJIT_GEMM");

	setenv("FAKE_CUBLASLT_NO_ALGO", "1", 1);
	g = cuda_ctx();
	set_run(&s, g, o, "no algorithm");
	outs_close(cpu, o, ref, 1e-4, "refused by cuBLASLt vs cpu");
	int64_t refused = ctr(g, "gemm.cublaslt_refused");
	ck_assert_int_gt(refused, 0);
	ck_assert_int_gt(ctr(g, "gemm.template"), refused);
	ck_assert_int_eq(ctr(g, "cublaslt.gemms"), 0);
	/* the refusal is remembered per shape: no second heuristic call */
	epj_tensor *x0 =
	    epj_tensor_from_data(g, EPJ_DTYPE_F32, 2, epj_tensor_shape(s.in[0]),
				 epj_tensor_data(s.in[0]));
	epj_tensor *x1 =
	    epj_tensor_from_data(g, EPJ_DTYPE_F32, 2, epj_tensor_shape(s.in[1]),
				 epj_tensor_data(s.in[1]));
	epj_tensor *y = epj_matmul(g, x0, x1);
	tu_ok(g, y);
	tu_assert_tensors_close(cpu, y, ref[0], 1e-4, 1e-4, "again");
	ck_assert_int_eq(ctr(g, "gemm.cublaslt_refused"), refused);
	outs_free(o);
	epj_tensor_free(y);
	unsetenv("FAKE_CUBLASLT_NO_ALGO");

	/* an unknown path */
	setenv("EPJIT_GEMM", "cublas", 1);
	epj_ctx *b = cuda_ctx();
	epj_tensor *x0b =
	    epj_tensor_from_data(b, EPJ_DTYPE_F32, 2, epj_tensor_shape(s.in[0]),
				 epj_tensor_data(s.in[0]));
	epj_tensor *x1b =
	    epj_tensor_from_data(b, EPJ_DTYPE_F32, 2, epj_tensor_shape(s.in[1]),
				 epj_tensor_data(s.in[1]));
	ck_assert_ptr_null(epj_matmul(b, x0b, x1b));
	ck_assert_msg(strstr(epj_ctx_error(b), "EPJIT_GEMM=\"cublas\"") &&
			  strstr(epj_ctx_error(b), "auto, template"),
		      "%s", epj_ctx_error(b));
	unsetenv("EPJIT_GEMM");

	epj_tensor *fr[] = { x0, x1, x0b, x1b };
	for (size_t i = 0; i < EJ_ARRAY_LEN(fr); i++)
		epj_tensor_free(fr[i]);
	outs_free(ref);
	set_free(&s);
	epj_ctx_free(g);
	epj_ctx_free(b);
	epj_ctx_free(cpu);
	tu_fake_cuda_end();
	lt_env_clear();
}
END_TEST

/* A cuBLASLt call that fails is an error naming the call and the status,
 * never a result. */
START_TEST(test_gemm_cublaslt_error)
{
	if (!usable())
		return;
	epj_ctx *cpu = tu_ctx();
	epj_tensor *a = rnd(cpu, EPJ_DTYPE_BF16, 2, 7, 9, 0);
	epj_tensor *b = rnd(cpu, EPJ_DTYPE_BF16, 2, 9, 5, 0);
	lt_use(true);
	ck_assert(tu_fake_cuda_begin());
	epj_ctx *g = cuda_ctx();
	epj_tensor *ga = epj_tensor_from_data(
	    g, EPJ_DTYPE_BF16, 2, epj_tensor_shape(a), epj_tensor_data(a));
	epj_tensor *gb = epj_tensor_from_data(
	    g, EPJ_DTYPE_BF16, 2, epj_tensor_shape(b), epj_tensor_data(b));
	/* the heuristic first (nothing is kept of the failure), then the
	 * GEMM itself with the algorithm chosen */
	static const char *const calls[] = { "cublasLtMatmulAlgoGetHeuristic",
					     "cublasLtMatmul" };
	for (int i = 0; i < 2; i++) {
		setenv("FAKE_CUBLASLT_FAIL", calls[i], 1);
		epj_tensor *y = epj_matmul(g, ga, gb);
		ck_assert_ptr_null(y);
		ck_assert_int_eq(epj_ctx_status(g), EPJ_ERR_BACKEND);
		const char *msg = epj_ctx_error(g);
		char want[64];
		snprintf(want, sizeof want, "%s(", calls[i]);
		ck_assert_msg(strstr(msg, want) &&
				  strstr(msg, "CUBLAS_STATUS_INTERNAL_ERROR") &&
				  strstr(msg, "m=7 n=5 k=9"),
			      "%s", msg);
		epj_ctx_clear_error(g);
	}
	ck_assert_int_eq(ctr(g, "gemm.template"), 0);
	/* the context goes on once the library does */
	unsetenv("FAKE_CUBLASLT_FAIL");
	epj_tensor *y = epj_matmul(g, ga, gb);
	tu_ok(g, y);
	epj_tensor *r = epj_matmul(cpu, a, b);
	tu_assert_tensors_close(cpu, y, r, 2e-2, 2e-2, "after the error");
	ck_assert_int_gt(ctr(g, "cublaslt.gemms"), 0);
	epj_tensor *fr[] = { a, b, ga, gb, y, r };
	for (size_t i = 0; i < EJ_ARRAY_LEN(fr); i++)
		epj_tensor_free(fr[i]);
	epj_ctx_free(g);
	epj_ctx_free(cpu);
	tu_fake_cuda_end();
	lt_env_clear();
}
END_TEST

/* ---- expert GEMMs --------------------------------------------------------
 * _i bit 0: bf16, bit 1: w_trans.  ej_moe_grouped_mm over G experts (one
 * without rows) and its backward (dx a grouped GEMM, dw the weight
 * gradient op) on a cuda context: one cuBLASLt grouped call per op with
 * the stand-in's cublasGemmGroupedBatchedEx, the template without
 * cuBLASLt, both against the cpu context. */

enum { EG = 4, EOUT = 2 + EG };

static void experts_run(epj_ctx *ctx, epj_ctx *cpu, epj_tensor *const *hin,
			const int64_t *cnt, bool tr, epj_tensor **out)
{
	epj_tensor *x[EG + 2];
	for (int i = 0; i < EG + 2; i++) {
		x[i] = epj_tensor_from_data(
		    ctx, epj_tensor_dtype(hin[i]), epj_tensor_ndim(hin[i]),
		    epj_tensor_shape(hin[i]), epj_tensor_data(hin[i]));
		tu_ok(ctx, x[i]);
		epj_tensor_set_requires_grad(x[i], i != 1);
	}
	int64_t g = EG;
	epj_tensor *ct = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 1, &g, cnt);
	tu_ok(ctx, ct);
	epj_tensor *y = ej_moe_grouped_mm(ctx, x[0], ct, x + 2, EG, tr);
	tu_ok(ctx, y);
	epj_tensor *dy = epj_tensor_from_data(
	    ctx, epj_tensor_dtype(hin[1]), epj_tensor_ndim(hin[1]),
	    epj_tensor_shape(hin[1]), epj_tensor_data(hin[1]));
	tu_ok(ctx, dy);
	ck_assert_msg(epj_backward(ctx, y, dy) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	/* y, dx, dw_0 .. dw_{G-1} copied to the cpu context */
	epj_tensor *src[EOUT] = { y, epj_tensor_grad(x[0]) };
	for (int i = 0; i < EG; i++)
		src[2 + i] = epj_tensor_grad(x[2 + i]);
	for (int i = 0; i < EOUT; i++) {
		ck_assert_msg(src[i] != NULL, "output %d", i);
		out[i] = epj_zeros(cpu, epj_tensor_dtype(src[i]),
				   epj_tensor_ndim(src[i]),
				   epj_tensor_shape(src[i]));
		ck_assert_int_eq(epj_tensor_copy_(cpu, out[i], src[i]), EPJ_OK);
	}
	epj_tensor_free(y);
	epj_tensor_free(dy);
	epj_tensor_free(ct);
	for (int i = 0; i < EG + 2; i++)
		epj_tensor_free(x[i]);
}

START_TEST(test_gemm_grouped)
{
	if (!usable())
		return;
	epj_dtype dt = _i & 1 ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32;
	bool tr = _i & 2;
	double tol = _i & 1 ? 2e-2 : 1e-4;
	int64_t K = 2 * tu_randint(1, 10) + 1, M = 2 * tu_randint(1, 10) + 1;
	int64_t cnt[EG], R = 0;
	int empty = (int)tu_randint(0, EG);
	for (int i = 0; i < EG; i++) {
		cnt[i] = i == empty ? 0 : tu_randint(1, 9);
		R += cnt[i];
	}
	epj_ctx *cpu = tu_ctx();
	/* x [R, K], dy [R, M], w_g [M, K] (w_trans) or [K, M] */
	epj_tensor *hin[EG + 2];
	hin[0] = rnd(cpu, dt, 2, R, K, 0);
	hin[1] = rnd(cpu, dt, 2, R, M, 0);
	for (int i = 0; i < EG; i++)
		hin[2 + i] =
		    tr ? rnd(cpu, dt, 2, M, K, 0) : rnd(cpu, dt, 2, K, M, 0);
	epj_tensor *ref[EOUT], *lt[EOUT], *tp[EOUT];
	experts_run(cpu, cpu, hin, cnt, tr, ref);

	lt_use(true);
	ck_assert(tu_fake_cuda_begin());
	epj_ctx *g = cuda_ctx();
	experts_run(g, cpu, hin, cnt, tr, lt);
	/* forward, dx and dw: three grouped calls, each native */
	ck_assert_int_eq(ctr(g, "gemm.cublaslt_grouped"), 3);
	ck_assert_int_eq(ctr(g, "cublaslt.grouped"), 3);
	ck_assert_int_eq(ctr(g, "gemm.cublaslt"), 0);
	/* the empty expert's weight gradient: a zero fill, no GEMM */
	ck_assert_int_eq(ctr(g, "gemm.template"), 0);
	epj_ctx_free(g);
	lt_use(false);
	epj_ctx *h = cuda_ctx();
	experts_run(h, cpu, hin, cnt, tr, tp);
	ck_assert_int_eq(ctr(h, "gemm.cublaslt_grouped"), 0);
	ck_assert_int_gt(ctr(h, "gemm.template"), 2 * (EG - 1));
	for (int i = 0; i < EOUT; i++) {
		char w[64];
		snprintf(w, sizeof w, "expert output %d (cuBLASLt)", i);
		tu_assert_tensors_close(cpu, lt[i], ref[i], tol, tol, w);
		snprintf(w, sizeof w, "expert output %d (template)", i);
		tu_assert_tensors_close(cpu, tp[i], ref[i], tol, tol, w);
	}
	/* the empty expert's gradient is zero, the others are not */
	for (int i = 0; i < EG; i++) {
		double *v = tu_values(cpu, lt[2 + i]);
		double mx = 0;
		for (int64_t q = 0; q < epj_tensor_numel(lt[2 + i]); q++)
			mx = fmax(mx, fabs(v[q]));
		free(v);
		if (i == empty)
			ck_assert_double_eq(mx, 0);
		else
			ck_assert_double_gt(mx, 1e-3);
	}
	for (int i = 0; i < EOUT; i++) {
		epj_tensor_free(ref[i]);
		epj_tensor_free(lt[i]);
		epj_tensor_free(tp[i]);
	}
	for (int i = 0; i < EG + 2; i++)
		epj_tensor_free(hin[i]);
	epj_ctx_free(h);
	epj_ctx_free(cpu);
	tu_fake_cuda_end();
	lt_env_clear();
}
END_TEST

/* ---- on a GPU (the gpu suite, tools/gpu-check) ----------------------------
 * The GEMM set on a cuda context over the machine's driver and cuBLASLt,
 * against the cpu context: through cuBLASLt, the template only for a
 * problem it found no algorithm for.  i 0: f32, 1:
 * bf16.  Called by check_cuda.c's gpu suite once a real driver opened;
 * without cuBLASLt it says so and returns. */
void tu_gpu_gemm_run(int i)
{
	ej_cublaslt_test_reset();
	if (!ej_cublaslt_available(NULL)) {
		tu_gpu_skip("no cuBLASLt");
		return;
	}
	epj_dtype dt = i ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32;
	double tol = i ? 2e-2 : 1e-4;
	epj_ctx *cpu = tu_ctx();
	gemm_set s;
	set_new(&s, cpu, dt);
	epj_tensor *ref[N_OUT], *got[N_OUT];
	set_run(&s, cpu, ref, "cpu");
	epj_ctx *g = cuda_ctx();
	set_run(&s, g, got, "GPU");
	outs_close(cpu, got, ref, tol, "GPU cuBLASLt vs cpu");
	ck_assert_int_gt(ctr(g, "cublaslt.gemms"), 0);
	/* a template GEMM only where the library found no algorithm */
	if (ctr(g, "gemm.template") > 0)
		ck_assert_int_gt(ctr(g, "gemm.cublaslt_refused"), 0);
	outs_free(got);
	outs_free(ref);
	set_free(&s);
	epj_ctx_free(g);
	epj_ctx_free(cpu);
}

/* In the gpu suite: the grouped expert GEMMs on the machine's driver
 * (native grouped calls through its cuBLAS, and the template). */
void tu_add_gpu_gemm_cases(Suite *s)
{
	TCase *tc = tcase_create("gpu_gemm");
	tcase_set_timeout(tc, 300);
	tcase_add_checked_fixture(tc, tu_gpu_setup, tu_gpu_teardown);
	if (tu_gpu_wanted())
		tcase_add_loop_test(tc, test_gemm_grouped, 0, 4);
	suite_add_tcase(s, tc);
}

Suite *make_gemm_cuda_suite(void)
{
	Suite *s = suite_create("gemm_cuda");
	TCase *tc = tcase_create("gemm_cuda");
	tcase_set_timeout(tc, 300);
	tcase_add_loop_test(tc, test_gemm_cublaslt, 0, 2);
	tcase_add_test(tc, test_gemm_template_choice);
	tcase_add_test(tc, test_gemm_cublaslt_error);
	tcase_add_loop_test(tc, test_gemm_grouped, 0, 4);
	suite_add_tcase(s, tc);
	return s;
}
