/* check_eager_sim.c -- eager ops on a cuda-sim context run as CUDA kernels
 * (kernels/eager_cuda.c through lib/dispatch.c's eager table) and match the
 * same ops on a cpu context.
 *
 * Every case draws fresh random inputs on a cpu context, copies their
 * values to a cuda-sim context (non-contiguous there where the case says
 * so: a permuted or strided storage), runs the same function on both, and
 * compares outputs and the gradients of sum(y * w) with the tolerances of
 * the op tests (bit for bit where the kernels promise it).  Around the
 * cuda-sim forward and backward it asserts that CUDA kernels ran
 * (kernels.eager_cuda; kernels.launched.eager_cuda or, for the template
 * adapters, kernels.launched.template, or on a cuda context cuBLASLt's
 * GEMMs) and that nothing fell back to a CPU kernel
 * (kernels.eager_cpu_fallback).  Sizes are tiny and odd (one element, one
 * row, tails) because cuda-sim is slow; the race check and poisoned
 * outputs are on.  The cases cover pointwise ops, casts, reductions,
 * shapes, indexing, the fused MoE rows and SwiGLU, and the template rows
 * of a decoder block: attention (causal and not, GQA, Dv != D, with
 * document ids), cross-entropy, embedding, linear and the
 * gated delta rule; and a row of packed documents against each document
 * alone, on the device itself (test_docs_alone).  The same
 * cases run on a cuda context over the stand-in (suite eager_cuda) and on
 * the machine's GPU (the gpu suite's gpu_eager, tools/gpu-check).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include "cc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eager_cuda.h"
#include "ops_moe.h"

static const epj_dtype dtypes[3] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16,
				     EPJ_DTYPE_F64 };

static double tol_of(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64   ? 1e-12
	       : dt == EPJ_DTYPE_F32 ? 1e-5
				     : 1.6e-2;
}

/* The context the cases run on besides cpu: "cuda-sim" (suite eager_sim)
 * or "cuda" on the stand-in driver (suite eager_cuda: device memory, NVRTC
 * cubins, kernels run by the fake through cuda-sim). */
static const char *target = "cuda-sim";

static epj_ctx *sim_ctx(void)
{
	epj_ctx *ctx = NULL;
	ck_assert_msg(epj_ctx_new(target, &ctx) == EPJ_OK,
		      "epj_ctx_new(\"%s\") failed", target);
	epj_ctx_seed(ctx, tu_seed());
	return ctx;
}

/* t's values in a new tensor of ctx (non-contiguous when nc and t has a
 * dim), exactly. */
static epj_tensor *copy_to(epj_ctx *ctx, const epj_tensor *t, bool nc)
{
	epj_tensor *r = epj_zeros(ctx, epj_tensor_dtype(t), epj_tensor_ndim(t),
				  epj_tensor_shape(t));
	tu_ok(ctx, r);
	if (nc && epj_tensor_ndim(t) >= 1) {
		epj_tensor *v = tu_noncontig(ctx, r);
		epj_tensor_free(r);
		r = v;
	}
	int64_t n = epj_tensor_numel(t);
	for (int64_t i = 0; i < n; i++)
		epj_tensor_set_f64(r, i, epj_tensor_get_f64(t, i));
	return r;
}

static int64_t ctr(epj_ctx *ctx, const char *name)
{
	return epj_counter_get(ctx, name);
}

/* The op-by-op names of what fell back, for a failure message. */
static void fallbacks(epj_ctx *ctx, char *buf, size_t n)
{
	size_t used = 0;
	buf[0] = 0;
	for (int op = 0; op < EJ_OP_COUNT; op++) {
		char name[96];
		snprintf(name, sizeof name, "kernels.eager_cpu_fallback.%s",
			 ej_ops[op].name);
		int64_t v = epj_counter_get(ctx, name);
		if (v > 0 && used + 1 < n) {
			int w = snprintf(buf + used, n - used, " %s=%lld",
					 ej_ops[op].name, (long long)v);
			if (w > 0)
				used += (size_t)w;
		}
	}
}

typedef struct snap {
	int64_t cuda, launches, fallback;
} snap;

static snap take(epj_ctx *ctx)
{
	/* launches: generated kernels, templates, and cuBLASLt GEMMs (a
	 * cuda context's GEMMs, which launch through the library) */
	snap s = { ctr(ctx, "kernels.eager_cuda"),
		   ctr(ctx, "kernels.launched.eager_cuda") +
		       ctr(ctx, "kernels.launched.template") +
		       ctr(ctx, "cublaslt.gemms"),
		   ctr(ctx, "kernels.eager_cpu_fallback") };
	return s;
}

/* Since s: CUDA kernels ran and no op fell back to the CPU. */
static void assert_cuda_since(epj_ctx *ctx, snap s, const char *what)
{
	snap n = take(ctx);
	char fb[512];
	fallbacks(ctx, fb, sizeof fb);
	ck_assert_msg(n.fallback == s.fallback,
		      "%s: %lld op(s) fell back to the CPU kernels:%s", what,
		      (long long)(n.fallback - s.fallback), fb);
	ck_assert_msg(n.cuda > s.cuda && n.launches > s.launches,
		      "%s: no eager CUDA kernel ran (%lld ops, %lld launches)",
		      what, (long long)(n.cuda - s.cuda),
		      (long long)(n.launches - s.launches));
}

typedef epj_tensor *(*efn)(epj_ctx *ctx, epj_tensor *const *in, int arg);

/* fn(in) on cpu and on cuda-sim (inputs copied; input i non-contiguous on
 * cuda-sim when bit i of nc is set), outputs compared; with grad, the
 * gradients of sum(y * w) of the float inputs too. */
static void check_case(epj_ctx *cpu, epj_ctx *sim, efn fn, int arg,
		       epj_tensor *const *in, int n_in, unsigned nc, bool grad,
		       double tol, const char *what)
{
	epj_tensor *si[8];
	ck_assert(n_in <= 8);
	for (int i = 0; i < n_in; i++) {
		si[i] = copy_to(sim, in[i], (nc >> i) & 1u);
		bool fl = epj_dtype_is_float(epj_tensor_dtype(in[i]));
		epj_tensor_set_requires_grad(in[i], grad && fl);
		epj_tensor_set_requires_grad(si[i], grad && fl);
	}
	epj_tensor *yc = fn(cpu, in, arg);
	tu_ok(cpu, yc);
	snap s0 = take(sim);
	epj_tensor *ys = fn(sim, si, arg);
	tu_ok(sim, ys);
	char buf[160];
	snprintf(buf, sizeof buf, "%s forward", what);
	assert_cuda_since(sim, s0, buf);
	tu_assert_tensors_close(cpu, ys, yc, tol, tol, buf);
	if (grad && epj_dtype_is_float(epj_tensor_dtype(yc))) {
		epj_tensor *w =
		    tu_randn(cpu, epj_tensor_dtype(yc), epj_tensor_ndim(yc),
			     epj_tensor_shape(yc));
		epj_tensor *ws = copy_to(sim, w, false);
		epj_tensor *mc = epj_mul(cpu, yc, w);
		epj_tensor *lc = epj_sum_all(cpu, mc);
		tu_ok(cpu, lc);
		ck_assert_msg(epj_backward(cpu, lc, NULL) == EPJ_OK, "%s",
			      epj_ctx_error(cpu));
		epj_tensor *m = epj_mul(sim, ys, ws);
		epj_tensor *ls = epj_sum_all(sim, m);
		tu_ok(sim, ls);
		snap s1 = take(sim);
		ck_assert_msg(epj_backward(sim, ls, NULL) == EPJ_OK, "%s",
			      epj_ctx_error(sim));
		snprintf(buf, sizeof buf, "%s backward", what);
		assert_cuda_since(sim, s1, buf);
		for (int i = 0; i < n_in; i++) {
			epj_tensor *gc = epj_tensor_grad(in[i]);
			epj_tensor *gs = epj_tensor_grad(si[i]);
			ck_assert_msg(!gc == !gs,
				      "%s: grad of input %d on one "
				      "side only",
				      what, i);
			if (!gc)
				continue;
			snprintf(buf, sizeof buf, "%s grad of input %d", what,
				 i);
			tu_assert_tensors_close(cpu, gs, gc, tol, tol, buf);
			epj_tensor_set_grad(in[i], NULL);
		}
		epj_tensor_free(m);
		epj_tensor_free(ls);
		epj_tensor_free(w);
		epj_tensor_free(ws);
		epj_tensor_free(mc);
		epj_tensor_free(lc);
	}
	for (int i = 0; i < n_in; i++) {
		epj_tensor_set_requires_grad(in[i], false);
		epj_tensor_free(si[i]);
	}
	epj_tensor_free(yc);
	epj_tensor_free(ys);
}

static epj_tensor *positive(epj_ctx *ctx, epj_dtype dt, int nd,
			    const int64_t *shape)
{
	epj_tensor *r = tu_randn(ctx, dt, nd, shape);
	int64_t n = epj_tensor_numel(r);
	for (int64_t q = 0; q < n; q++)
		epj_tensor_set_f64(r, q, fabs(epj_tensor_get_f64(r, q)) + 0.25);
	return r;
}

/* ---- pointwise ------------------------------------------------------------
 * One function per op id, all taking (x, y) and using what they need. */

static epj_tensor *f_pointwise(epj_ctx *ctx, epj_tensor *const *in, int op)
{
	epj_tensor *x = in[0], *y = in[1];
	switch (op) {
	case EJ_OP_ADD:
		return epj_add(ctx, x, y);
	case EJ_OP_SUB:
		return epj_sub(ctx, x, y);
	case EJ_OP_MUL:
		return epj_mul(ctx, x, y);
	case EJ_OP_DIV:
		return epj_div(ctx, x, y);
	case EJ_OP_EQ:
		return epj_eq(ctx, x, y);
	case EJ_OP_WHERE: { /* x - 1.5 is 0 at x's first element */
		epj_tensor *c = epj_add_scalar(ctx, x, -1.5);
		epj_tensor *r = epj_where(ctx, c, x, y);
		epj_tensor_free(c);
		return r;
	}
	case EJ_OP_MAXIMUM:
		return epj_maximum(ctx, x, y);
	case EJ_OP_ADD_SCALAR:
		return epj_add_scalar(ctx, x, 0.75);
	case EJ_OP_MUL_SCALAR:
		return epj_mul_scalar(ctx, x, -1.25);
	case EJ_OP_POW_SCALAR:
		return epj_pow_scalar(ctx, x, 3.0);
	case EJ_OP_NEG:
		return epj_neg(ctx, x);
	case EJ_OP_EXP:
		return epj_exp(ctx, x);
	case EJ_OP_LOG:
		return epj_log(ctx, x);
	case EJ_OP_SQRT:
		return epj_sqrt(ctx, x);
	case EJ_OP_RSQRT:
		return epj_rsqrt(ctx, x);
	case EJ_OP_SILU:
		return epj_silu(ctx, x);
	case EJ_OP_SIGMOID:
		return epj_sigmoid(ctx, x);
	case EJ_OP_TANH:
		return epj_tanh(ctx, x);
	case EJ_OP_GELU:
		return epj_gelu(ctx, x);
	case EJ_OP_COS:
		return epj_cos(ctx, x);
	case EJ_OP_SIN:
		return epj_sin(ctx, x);
	case EJ_OP_LOG1P:
		return epj_log1p(ctx, x);
	default: {
		/* cast there and back */
		epj_dtype dt = epj_tensor_dtype(x);
		epj_tensor *c = epj_cast(ctx, x,
					 dt == EPJ_DTYPE_BF16 ? EPJ_DTYPE_F32
							      : EPJ_DTYPE_BF16);
		epj_tensor *r = epj_cast(ctx, c, dt);
		epj_tensor_free(c);
		return r;
	}
	}
}

static const int pw_ops[] = {
	EJ_OP_ADD,   EJ_OP_SUB,	       EJ_OP_MUL,	 EJ_OP_DIV,
	EJ_OP_EQ,    EJ_OP_ADD_SCALAR, EJ_OP_MUL_SCALAR, EJ_OP_POW_SCALAR,
	EJ_OP_NEG,   EJ_OP_EXP,	       EJ_OP_LOG,	 EJ_OP_SQRT,
	EJ_OP_RSQRT, EJ_OP_SILU,       EJ_OP_SIGMOID,	 EJ_OP_TANH,
	EJ_OP_GELU,  EJ_OP_COS,	       EJ_OP_SIN,	 EJ_OP_LOG1P,
	EJ_OP_CAST,  EJ_OP_WHERE,      EJ_OP_MAXIMUM,
};

/* x [R, C] (non-contiguous on cuda-sim), y broadcast [C] or [R, 1];
 * autograd through every differentiable op (backward formulas use the
 * backward helpers, sum_to, mul...). */
START_TEST(test_pointwise)
{
	epj_dtype dt = dtypes[_i];
	epj_ctx *cpu = tu_ctx(), *sim = sim_ctx();
	static const int64_t xs[2][2] = { { 1, 1 }, { 3, 37 } };
	/* one element in f32 only: every module costs a C++ compile */
	for (int s = dt == EPJ_DTYPE_F32 ? 0 : 1; s < 2; s++) {
		const int64_t *sh = xs[s];
		int64_t ys[2] = { sh[0], 1 };
		for (size_t k = 0; k < EJ_ARRAY_LEN(pw_ops); k++) {
			int op = pw_ops[k];
			epj_tensor *x = positive(cpu, dt, 2, sh);
			/* y: the row broadcast for binary ops at the larger
			 * size, [R, 1] for div, same shape otherwise */
			epj_tensor *y = s == 1 && op != EJ_OP_DIV
					    ? positive(cpu, dt, 1, sh + 1)
					: s == 1 ? positive(cpu, dt, 2, ys)
						 : positive(cpu, dt, 2, sh);
			if (op == EJ_OP_EQ) /* some equal elements */
				epj_tensor_set_f64(y, 0,
						   epj_tensor_get_f64(x, 0));
			if (op == EJ_OP_WHERE) /* one false condition */
				epj_tensor_set_f64(x, 0, 1.5);
			epj_tensor *in[2] = { x, y };
			char what[96];
			snprintf(what, sizeof what, "%s %s [%lld,%lld]",
				 ej_ops[op].name, epj_dtype_name(dt),
				 (long long)sh[0], (long long)sh[1]);
			check_case(cpu, sim, f_pointwise, op, in, 2, 1u,
				   op != EJ_OP_EQ, tol_of(dt), what);
			epj_tensor_free(x);
			epj_tensor_free(y);
		}
	}
	epj_ctx_free(cpu);
	epj_ctx_free(sim);
}
END_TEST

/* Integer pointwise ops and casts involving integers (template kernels),
 * bit for bit. */
static epj_tensor *f_int(epj_ctx *ctx, epj_tensor *const *in, int which)
{
	switch (which) {
	case 0:
		return epj_add(ctx, in[0], in[1]);
	case 1:
		return epj_sub(ctx, in[0], in[1]);
	case 2:
		return epj_mul(ctx, in[0], in[1]);
	case 3:
		return epj_eq(ctx, in[0], in[1]);
	case 4:
		return epj_neg(ctx, in[0]);
	case 5:
		return epj_cast(ctx, in[0], EPJ_DTYPE_F32);
	case 6: /* to the other integer dtype (i64 -> i32 wraps) */
		return epj_cast(ctx, in[0],
				epj_tensor_dtype(in[0]) == EPJ_DTYPE_I32
				    ? EPJ_DTYPE_I64
				    : EPJ_DTYPE_I32);
	case 7:
		return epj_maximum(ctx, in[0], in[1]);
	default:
		return epj_cast(ctx, in[2], EPJ_DTYPE_I64);
	}
}

START_TEST(test_int_and_casts)
{
	epj_ctx *cpu = tu_ctx(), *sim = sim_ctx();
	int64_t sh[2] = { 4, 9 }, bsh[1] = { 9 };
	for (int dti = 0; dti < 2; dti++) {
		epj_dtype dt = dti ? EPJ_DTYPE_I64 : EPJ_DTYPE_I32;
		epj_tensor *a = epj_zeros(cpu, dt, 2, sh);
		epj_tensor *b = epj_zeros(cpu, dt, 1, bsh);
		for (int64_t i = 0; i < 36; i++)
			epj_tensor_set_f64(a, i, (double)tu_randint(-50, 50));
		for (int64_t i = 0; i < 9; i++)
			epj_tensor_set_f64(b, i, (double)tu_randint(-3, 3));
		epj_tensor_set_f64(b, 0, epj_tensor_get_f64(a, 0));
		/* floats to truncate toward zero, NaN -> 0 */
		epj_tensor *f = tu_randn(cpu, EPJ_DTYPE_F32, 2, sh);
		for (int64_t i = 0; i < 36; i++)
			epj_tensor_set_f64(f, i, epj_tensor_get_f64(f, i) * 40);
		epj_tensor_set_f64(f, 1, NAN);
		epj_tensor *in[3] = { a, b, f };
		for (int w = 0; w < 9; w++) {
			char what[64];
			snprintf(what, sizeof what, "int case %d (%s)", w,
				 epj_dtype_name(dt));
			check_case(cpu, sim, f_int, w, in, 3, 5u, false, 0.0,
				   what);
		}
		epj_tensor_free(a);
		epj_tensor_free(b);
		epj_tensor_free(f);
	}
	epj_ctx_free(cpu);
	epj_ctx_free(sim);
}
END_TEST

/* ---- reductions and softmax -------------------------------------------- */

static epj_tensor *f_reduce(epj_ctx *ctx, epj_tensor *const *in, int which)
{
	epj_tensor *x = in[0];
	int last = epj_tensor_ndim(x) - 1;
	switch (which) {
	case 0:
		return epj_sum(ctx, x, last, true);
	case 1:
		return epj_sum(ctx, x, 0, false);
	case 2:
		return epj_mean(ctx, x, last, false);
	case 3:
		return epj_mean(ctx, x, 1, true);
	case 4:
		return epj_amax(ctx, x, last, true);
	case 5:
		return epj_amax(ctx, x, 0, false);
	case 6:
		return epj_sum_all(ctx, x);
	case 7: {
		/* sum_to over a leading dim and a middle one */
		int64_t t[2] = { 1, epj_tensor_dim(x, last) };
		return epj_sum_to(ctx, x, 2, t);
	}
	case 8:
		return epj_softmax(ctx, x, last);
	case 9:
		return epj_log_softmax(ctx, x, last);
	case 10:
		return epj_softmax(ctx, x, 1);
	default: {
		/* max with indices: values (differentiable) plus the indices
		 * folded in as floats so both are compared */
		epj_tensor *v = NULL, *i = NULL;
		if (epj_max(ctx, x, 1, false, &v, &i) != EPJ_OK)
			return NULL;
		epj_tensor *fi = epj_cast(ctx, i, epj_tensor_dtype(x));
		epj_tensor *r = epj_add(ctx, v, fi);
		epj_tensor_free(v);
		epj_tensor_free(i);
		epj_tensor_free(fi);
		return r;
	}
	}
}

START_TEST(test_reductions)
{
	/* tails over three dims in every dtype; one element in f32 */
	epj_dtype dt = _i < 3 ? dtypes[_i] : EPJ_DTYPE_F32;
	static const int64_t shs[2][3] = { { 2, 5, 37 }, { 1, 1, 1 } };
	const int64_t *sh = shs[_i / 3];
	epj_ctx *cpu = tu_ctx(), *sim = sim_ctx();
	for (int w = 0; w < 12; w++) {
		epj_tensor *x = tu_randn(cpu, dt, 3, sh);
		if (w == 11 && sh[1] > 1) /* a tie: the first index wins */
			epj_tensor_set_f64(x, 2 * sh[2],
					   epj_tensor_get_f64(x, 0) + 9);
		epj_tensor *in[1] = { x };
		char what[64];
		snprintf(what, sizeof what, "reduction %d %s [%lld,%lld,%lld]",
			 w, epj_dtype_name(dt), (long long)sh[0],
			 (long long)sh[1], (long long)sh[2]);
		/* sums reorder: bf16 gets its usual tolerance, f32 a little
		 * more than pointwise */
		double tol = dt == EPJ_DTYPE_F32 ? 2e-5 : tol_of(dt);
		check_case(cpu, sim, f_reduce, w, in, 1, w % 2 ? 1u : 0u, true,
			   tol, what);
		epj_tensor_free(x);
	}
	epj_ctx_free(cpu);
	epj_ctx_free(sim);
}
END_TEST

/* ---- shape and movement ------------------------------------------------ */

static epj_tensor *f_shape(epj_ctx *ctx, epj_tensor *const *in, int which)
{
	epj_tensor *x = in[0], *y = in[1];
	switch (which) {
	case 0: /* contiguous of a non-contiguous input */
		return epj_contiguous(ctx, x);
	case 1: { /* reshape that has to copy */
		int64_t s[1] = { -1 };
		return epj_reshape(ctx, x, 1, s);
	}
	case 2: { /* expand materialised */
		int64_t s[3] = { 3, epj_tensor_dim(y, 0),
				 epj_tensor_dim(y, 1) };
		epj_tensor *e = epj_expand(ctx, y, 3, s);
		epj_tensor *r = epj_contiguous(ctx, e);
		epj_tensor_free(e);
		return r;
	}
	case 3: { /* cat of three along the last axis (one of them sliced) */
		epj_tensor *s =
		    epj_slice(ctx, x, 1, 1, epj_tensor_dim(x, 1), 2);
		epj_tensor *t[3] = { x, s, x };
		epj_tensor *r = epj_cat(ctx, t, 3, 1);
		epj_tensor_free(s);
		return r;
	}
	case 4: { /* cat along axis 0 */
		epj_tensor *t[2] = { x, x };
		return epj_cat(ctx, t, 2, 0);
	}
	case 5: { /* slice (its backward is slice_backward) */
		epj_tensor *s =
		    epj_slice(ctx, x, 1, 1, epj_tensor_dim(x, 1), 3);
		epj_tensor *r = epj_mul_scalar(ctx, s, 2.0);
		epj_tensor_free(s);
		return r;
	}
	case 6: { /* full */
		epj_tensor *f = epj_full(ctx, epj_tensor_dtype(x), 2,
					 epj_tensor_shape(x), -2.5);
		epj_tensor *r = epj_mul(ctx, x, f);
		epj_tensor_free(f);
		return r;
	}
	default: { /* a strided slice, transposed, then made contiguous */
		epj_tensor *s =
		    epj_slice(ctx, x, 1, 0, epj_tensor_dim(x, 1), 2);
		epj_tensor *t = epj_transpose(ctx, s, 0, 1);
		epj_tensor_free(s);
		epj_tensor *r = epj_contiguous(ctx, t);
		epj_tensor_free(t);
		return r;
	}
	}
}

START_TEST(test_shape)
{
	epj_dtype dt = dtypes[_i];
	epj_ctx *cpu = tu_ctx(), *sim = sim_ctx();
	int64_t sh[2] = { 3, 7 }, ysh[2] = { 1, 7 };
	for (int w = 0; w < 8; w++) {
		epj_tensor *x = tu_randn(cpu, dt, 2, sh);
		epj_tensor *y = tu_randn(cpu, dt, 2, ysh);
		epj_tensor *in[2] = { x, y };
		char what[64];
		snprintf(what, sizeof what, "shape case %d %s", w,
			 epj_dtype_name(dt));
		check_case(cpu, sim, f_shape, w, in, 2, 1u, true, tol_of(dt),
			   what);
		epj_tensor_free(x);
		epj_tensor_free(y);
	}
	epj_ctx_free(cpu);
	epj_ctx_free(sim);
}
END_TEST

/* ---- indexing ------------------------------------------------------------
 * in: a [R, C], idx [n] (i64, repeats, in [0, R)), src [n, C], gidx [R, C]
 * (i32, in [0, R)) */

static epj_tensor *f_index(epj_ctx *ctx, epj_tensor *const *in, int which)
{
	epj_tensor *a = in[0], *idx = in[1], *src = in[2], *gidx = in[3];
	switch (which) {
	case 0:
		return epj_index_select(ctx, a, 0, idx);
	case 1:
		return epj_index_add(ctx, a, 0, idx, src);
	case 2:
		return epj_gather(ctx, a, 0, gidx);
	case 3: {
		epj_tensor *z = epj_mul_scalar(ctx, a, 0.5);
		epj_tensor *r = epj_scatter_add(ctx, z, 0, gidx, a);
		epj_tensor_free(z);
		return r;
	}
	case 4: {
		epj_tensor *v = NULL, *i = NULL;
		if (epj_topk(ctx, a, 3, &v, &i) != EPJ_OK)
			return NULL;
		epj_tensor *fi = epj_cast(ctx, i, epj_tensor_dtype(a));
		epj_tensor *r = epj_add(ctx, v, fi);
		epj_tensor_free(v);
		epj_tensor_free(i);
		epj_tensor_free(fi);
		return r;
	}
	case 5: {
		epj_tensor *s = epj_argsort(ctx, a, 1);
		epj_tensor *r = epj_cast(ctx, s, epj_tensor_dtype(a));
		epj_tensor_free(s);
		return r;
	}
	default: {
		epj_tensor *s = epj_argsort(ctx, a, 0);
		epj_tensor *r = epj_cast(ctx, s, epj_tensor_dtype(a));
		epj_tensor_free(s);
		return r;
	}
	}
}

START_TEST(test_index)
{
	epj_dtype dt = dtypes[_i];
	epj_ctx *cpu = tu_ctx(), *sim = sim_ctx();
	const int64_t R = 5, C = 9, n = 7;
	int64_t ash[2] = { R, C }, ish[1] = { n }, ssh[2] = { n, C };
	for (int w = 0; w < 7; w++) {
		epj_tensor *a = tu_randn(cpu, dt, 2, ash);
		/* ties for topk and argsort (stable, lower index first) */
		for (int64_t q = 0; q < R * C; q += 4)
			epj_tensor_set_f64(a, q + 1, epj_tensor_get_f64(a, q));
		epj_tensor *idx = epj_zeros(cpu, EPJ_DTYPE_I64, 1, ish);
		for (int64_t i = 0; i < n; i++)
			epj_tensor_set_f64(idx, i,
					   (double)tu_randint(0, R - 1));
		epj_tensor_set_f64(idx, n - 1, epj_tensor_get_f64(idx, 0));
		epj_tensor *src = tu_randn(cpu, dt, 2, ssh);
		epj_tensor *gidx = epj_zeros(cpu, EPJ_DTYPE_I32, 2, ash);
		for (int64_t i = 0; i < R * C; i++)
			epj_tensor_set_f64(gidx, i,
					   (double)tu_randint(0, R - 1));
		epj_tensor *in[4] = { a, idx, src, gidx };
		char what[64];
		snprintf(what, sizeof what, "index case %d %s", w,
			 epj_dtype_name(dt));
		/* accumulation in index order: bit for bit with the CPU */
		double tol = w == 1 || w == 3 ? 0.0 : tol_of(dt);
		check_case(cpu, sim, f_index, w, in, 4, w % 2 ? 0xfu : 0x5u,
			   w <= 4, tol, what);
		epj_tensor_free(a);
		epj_tensor_free(idx);
		epj_tensor_free(src);
		epj_tensor_free(gidx);
	}
	epj_ctx_free(cpu);
	epj_ctx_free(sim);
}
END_TEST

/* ---- the fused MoE ops (the AutoEP layer's data path) --------------------
 * in: logits [N, E], idx [N, k] i64, x [N, H], y [N k, H], w [N, k] (f32,
 * f64 for f64), pos [N, k] (a permutation of [0, N k)), gate and up [N k,
 * H].  Index outputs come back cast to the float dtype (exact). */
enum { MOE_E = 5, MOE_K = 2 };

static epj_tensor *f_moe(epj_ctx *ctx, epj_tensor *const *in, int which)
{
	epj_tensor *w = NULL, *ix = NULL, *xs = NULL, *pos = NULL, *cnt = NULL;
	epj_tensor *r = NULL;
	const epj_dtype dt = epj_tensor_dtype(in[2]);
	switch (which) {
	case 0: /* weights, renormalised */
	case 1: /* weights, not renormalised */
		if (ej_moe_route(ctx, in[0], MOE_K, which == 0, false, &w,
				 &ix) == EPJ_OK)
			r = epj_tensor_ref(w);
		break;
	case 2: /* the experts chosen */
		if (ej_moe_route(ctx, in[0], MOE_K, true, false, &w, &ix) ==
		    EPJ_OK)
			r = epj_cast(ctx, ix, EPJ_DTYPE_F64);
		break;
	case 3: /* the routed rows in expert order */
		if (ej_moe_permute(ctx, in[2], in[1], MOE_E, &xs, &pos, &cnt) ==
		    EPJ_OK)
			r = epj_tensor_ref(xs);
		break;
	case 4: { /* positions and counts */
		if (ej_moe_permute(ctx, in[2], in[1], MOE_E, &xs, &pos, &cnt) !=
		    EPJ_OK)
			break;
		int64_t R = epj_tensor_numel(pos);
		epj_tensor *pf = epj_reshape(ctx, pos, 1, &R);
		epj_tensor *parts[2] = { pf, cnt };
		epj_tensor *c = pf ? epj_cat(ctx, parts, 2, 0) : NULL;
		r = c ? epj_cast(ctx, c, dt) : NULL;
		epj_tensor_free(pf);
		epj_tensor_free(c);
		break;
	}
	case 5: /* the weighted combine */
		r = ej_moe_unpermute(ctx, in[3], in[4], in[5]);
		break;
	case 6:
		r = ej_swiglu(ctx, in[6], in[7]);
		break;
	default: /* the fixed assignment's weights and experts */
		if (ej_moe_route(ctx, in[0], MOE_K, true, true, &w, &ix) ==
		    EPJ_OK) {
			epj_tensor *fi = epj_cast(ctx, ix, epj_tensor_dtype(w));
			r = fi ? epj_add(ctx, w, fi) : NULL;
			epj_tensor_free(fi);
		}
		break;
	}
	epj_tensor *t[] = { w, ix, xs, pos, cnt };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return r;
}

/* Every fused MoE op and its backward runs as CUDA kernels (nothing falls
 * back) and gives the CPU kernel's values: each dtype, odd sizes, the
 * float inputs non-contiguous on the device in half the cases. */
START_TEST(test_moe)
{
	const epj_dtype dt = dtypes[_i];
	const epj_dtype rdt =
	    dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
	epj_ctx *cpu = tu_ctx(), *sim = sim_ctx();
	const int64_t N = tu_randint(1, 8), H = tu_randint(1, 12);
	const int64_t R = N * MOE_K;
	int64_t lsh[2] = { N, MOE_E }, ksh[2] = { N, MOE_K }, xsh[2] = { N, H },
		ysh[2] = { R, H };
	epj_tensor *in[8];
	in[0] = tu_randn(cpu, dt, 2, lsh);
	in[1] = epj_zeros(cpu, EPJ_DTYPE_I64, 2, ksh);
	for (int64_t q = 0; q < R; q++) /* repeats: the sort is stable */
		epj_tensor_set_f64(in[1], q, (double)tu_randint(0, MOE_E));
	in[2] = tu_randn(cpu, dt, 2, xsh);
	in[3] = tu_randn(cpu, dt, 2, ysh);
	in[4] = tu_randn(cpu, rdt, 2, ksh);
	in[5] = epj_zeros(cpu, EPJ_DTYPE_I64, 2, ksh);
	int64_t *perm = malloc(sizeof *perm * (size_t)R);
	ck_assert_ptr_nonnull(perm);
	for (int64_t q = 0; q < R; q++)
		perm[q] = q;
	for (int64_t q = R - 1; q > 0; q--) {
		int64_t j = tu_randint(0, q + 1), t = perm[q];
		perm[q] = perm[j];
		perm[j] = t;
	}
	for (int64_t q = 0; q < R; q++)
		epj_tensor_set_f64(in[5], q, (double)perm[q]);
	free(perm);
	in[6] = tu_randn(cpu, dt, 2, ysh);
	in[7] = tu_randn(cpu, dt, 2, ysh);
	for (int which = 0; which < 8; which++) {
		char what[64];
		snprintf(what, sizeof what, "moe case %d %s N=%lld H=%lld",
			 which, epj_dtype_name(dt), (long long)N, (long long)H);
		/* routing weights are f32 whatever the logits: f32 rounding */
		double tol = which <= 1 || which == 7
				 ? (dt == EPJ_DTYPE_F64 ? 1e-12 : 1e-5)
			     : which == 2 || which == 4 ? 0.0
							: tol_of(dt);
		unsigned nc = which % 2 ? 0xdcu : 0u;
		check_case(cpu, sim, f_moe, which, in, 8, nc,
			   which != 2 && which != 4, tol, what);
	}
	for (int i = 0; i < 8; i++)
		epj_tensor_free(in[i]);
	epj_ctx_free(cpu);
	epj_ctx_free(sim);
}
END_TEST

/* ---- attention, cross-entropy, embedding, GEMM, the gated delta rule ----
 * The rows of a decoder block that are templates on a CUDA device (the
 * attention, loss, embedding, GEMM and delta-rule templates of
 * templates/), each against the CPU kernel, forward and backward, at odd
 * sizes: GQA heads, causal and not, T != S and Dv != D (latent attention's
 * shape class), ignored targets, repeated ids, m = 1 rows. */
static epj_tensor *f_nn(epj_ctx *ctx, epj_tensor *const *in, int which)
{
	switch (which) {
	case 0:
		return epj_sdpa(ctx, in[0], in[1], in[2], true, 0.0);
	case 1:
		return epj_sdpa(ctx, in[0], in[1], in[2], false, 0.3);
	case 2:
		return epj_cross_entropy(ctx, in[0], in[1], -100);
	case 3:
		return epj_embedding(ctx, in[0], in[1]);
	case 4:
		return epj_linear(ctx, in[0], in[1], in[2]);
	case 6: /* packed documents (in[3] the ids) */
		return epj_sdpa_docs(ctx, in[0], in[1], in[2], in[3], true,
				     0.0);
	case 7:
		return epj_sdpa_docs(ctx, in[0], in[1], in[2], in[3], false,
				     0.4);
	default:
		return epj_gated_delta(ctx, in[0], in[1], in[2], in[3], in[4]);
	}
}

static void nn_case(epj_ctx *cpu, epj_ctx *dev, int which, epj_tensor **in,
		    int n, double tol, const char *what)
{
	check_case(cpu, dev, f_nn, which, in, n, 0u, true, tol, what);
	for (int i = 0; i < n; i++)
		epj_tensor_free(in[i]);
}

START_TEST(test_nn)
{
	const epj_dtype dt = dtypes[_i];
	const double tol = dt == EPJ_DTYPE_F32 ? 3e-5 : tol_of(dt);
	epj_ctx *cpu = tu_ctx(), *dev = sim_ctx();
	char what[96];
	for (int causal = 1; causal >= 0; causal--) {
		/* q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] */
		int64_t B = tu_randint(1, 3), Hkv = tu_randint(1, 3),
			Hq = Hkv * tu_randint(1, 4), T = tu_randint(1, 20),
			S = causal ? T : tu_randint(1, 20),
			D = 2 * tu_randint(2, 12) + 1,
			Dv = causal ? D : 2 * tu_randint(1, 8);
		int64_t qs[4] = { B, Hq, T, D }, ks[4] = { B, Hkv, S, D },
			vs[4] = { B, Hkv, S, Dv };
		epj_tensor *in[3] = { tu_randn(cpu, dt, 4, qs),
				      tu_randn(cpu, dt, 4, ks),
				      tu_randn(cpu, dt, 4, vs) };
		snprintf(what, sizeof what,
			 "sdpa %s %s B=%lld Hq=%lld Hkv=%lld T=%lld S=%lld "
			 "D=%lld Dv=%lld",
			 causal ? "causal" : "full", epj_dtype_name(dt),
			 (long long)B, (long long)Hq, (long long)Hkv,
			 (long long)T, (long long)S, (long long)D,
			 (long long)Dv);
		nn_case(cpu, dev, causal ? 0 : 1, in, 3, tol, what);
	}
	for (int causal = 1; causal >= 0; causal--) {
		/* document ids [B, T]: runs (packed documents) when causal,
		 * ids in any order when not; i32 or i64 */
		int64_t B = tu_randint(1, 3), Hkv = tu_randint(1, 3),
			Hq = Hkv * tu_randint(1, 3), T = tu_randint(1, 40),
			D = 2 * tu_randint(2, 12) + 1;
		int64_t qs[4] = { B, Hq, T, D }, ks[4] = { B, Hkv, T, D },
			is[2] = { B, T };
		epj_dtype idt =
		    tu_randint(0, 2) ? EPJ_DTYPE_I64 : EPJ_DTYPE_I32;
		epj_tensor *in[4] = { tu_randn(cpu, dt, 4, qs),
				      tu_randn(cpu, dt, 4, ks),
				      tu_randn(cpu, dt, 4, ks),
				      epj_zeros(cpu, idt, 2, is) };
		for (int64_t b = 0, doc = 0; b < B; b++)
			for (int64_t j = 0; j < T; j++) {
				if (!causal)
					doc = tu_randint(0, 3);
				else if (j > 0 && tu_randint(0, 6) == 0)
					doc++;
				epj_tensor_set_f64(in[3], b * T + j,
						   (double)doc);
			}
		snprintf(what, sizeof what,
			 "sdpa documents %s %s B=%lld Hq=%lld Hkv=%lld T=%lld "
			 "D=%lld ids %s",
			 causal ? "causal" : "full", epj_dtype_name(dt),
			 (long long)B, (long long)Hq, (long long)Hkv,
			 (long long)T, (long long)D, epj_dtype_name(idt));
		check_case(cpu, dev, f_nn, causal ? 6 : 7, in, 4,
			   tu_randint(0, 2) ? 8u : 0u, true, tol, what);
		for (int i = 0; i < 4; i++)
			epj_tensor_free(in[i]);
	}
	{ /* cross-entropy with ignored rows */
		int64_t N = tu_randint(2, 30), V = tu_randint(2, 70);
		int64_t ls[2] = { N, V }, ts[1] = { N };
		epj_tensor *in[2] = { tu_randn(cpu, dt, 2, ls),
				      epj_zeros(cpu, EPJ_DTYPE_I64, 1, ts) };
		for (int64_t q = 0; q < N; q++)
			epj_tensor_set_f64(in[1], q,
					   q == 0 || tu_randint(0, 4)
					       ? (double)tu_randint(0, V)
					       : -100.0);
		snprintf(what, sizeof what, "cross_entropy %s N=%lld V=%lld",
			 epj_dtype_name(dt), (long long)N, (long long)V);
		nn_case(cpu, dev, 2, in, 2, tol, what);
	}
	{ /* embedding with repeated ids */
		int64_t V = tu_randint(1, 20), H = tu_randint(1, 40),
			N = tu_randint(1, 30);
		int64_t ws[2] = { V, H }, is[1] = { N };
		epj_tensor *in[2] = { tu_randn(cpu, dt, 2, ws),
				      epj_zeros(cpu, EPJ_DTYPE_I64, 1, is) };
		for (int64_t q = 0; q < N; q++)
			epj_tensor_set_f64(in[1], q, (double)tu_randint(0, V));
		snprintf(what, sizeof what, "embedding %s V=%lld H=%lld N=%lld",
			 epj_dtype_name(dt), (long long)V, (long long)H,
			 (long long)N);
		nn_case(cpu, dev, 3, in, 2, tol, what);
	}
	{ /* linear with bias, one row sometimes */
		int64_t N = tu_randint(0, 2) ? 1 : tu_randint(2, 40),
			K = tu_randint(1, 50), M = tu_randint(1, 50);
		int64_t xs[2] = { N, K }, ws[2] = { M, K }, bs[1] = { M };
		epj_tensor *in[3] = { tu_randn(cpu, dt, 2, xs),
				      tu_randn(cpu, dt, 2, ws),
				      tu_randn(cpu, dt, 1, bs) };
		snprintf(what, sizeof what, "linear %s N=%lld K=%lld M=%lld",
			 epj_dtype_name(dt), (long long)N, (long long)K,
			 (long long)M);
		nn_case(cpu, dev, 4, in, 3, dt == EPJ_DTYPE_F32 ? 1e-4 : tol,
			what);
	}
	{ /* the gated delta rule: q, k [B, T, H, Dk], v [B, T, H, Dv], g <=
	     0, beta in (0, 1) [B, T, H] */
		int64_t B = tu_randint(1, 3), T = tu_randint(1, 12),
			H = tu_randint(1, 3), Dk = tu_randint(1, 9),
			Dv = tu_randint(1, 9);
		int64_t ks[4] = { B, T, H, Dk }, vs[4] = { B, T, H, Dv },
			gs[3] = { B, T, H };
		epj_tensor *in[5] = { tu_randn(cpu, dt, 4, ks),
				      tu_randn(cpu, dt, 4, ks),
				      tu_randn(cpu, dt, 4, vs),
				      epj_zeros(cpu, dt, 3, gs),
				      epj_zeros(cpu, dt, 3, gs) };
		for (int64_t q = 0; q < B * T * H; q++) {
			epj_tensor_set_f64(in[3], q, -tu_uniform(0.01, 1.0));
			epj_tensor_set_f64(in[4], q, tu_uniform(0.05, 0.95));
		}
		snprintf(what, sizeof what,
			 "gated_delta %s B=%lld T=%lld H=%lld Dk=%lld Dv=%lld",
			 epj_dtype_name(dt), (long long)B, (long long)T,
			 (long long)H, (long long)Dk, (long long)Dv);
		nn_case(cpu, dev, 5, in, 5, dt == EPJ_DTYPE_F32 ? 1e-4 : tol,
			what);
	}
	epj_ctx_free(cpu);
	epj_ctx_free(dev);
}
END_TEST

/* Rows [lo, hi) of the time axis (dim 2) of batch b of x [B, H, T, D], as
 * a new contiguous leaf [1, H, hi - lo, D] (requires_grad when rg). */
static epj_tensor *doc_rows(epj_ctx *ctx, epj_tensor *x, int64_t b, int64_t lo,
			    int64_t hi, bool rg)
{
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *xb = epj_slice(ctx, x, 0, b, b + 1, 1);
	epj_tensor *r = epj_slice(ctx, xb, 2, lo, hi, 1);
	epj_tensor *c = epj_contiguous(ctx, r);
	epj_tensor *d = c ? epj_detach(ctx, c) : NULL;
	epj_no_grad_exit(ctx, prev);
	tu_ok(ctx, d);
	epj_tensor_set_requires_grad(d, rg);
	epj_tensor_free(xb);
	epj_tensor_free(r);
	epj_tensor_free(c);
	return d;
}

/* A row of packed documents on the device gives, for each document, what
 * the device gives on that document alone: attention's output and the
 * gradients of q, k and v (of sum(out * w)), causal, with document ids;
 * no CPU kernel on the way. */
START_TEST(test_docs_alone)
{
	const epj_dtype dt = dtypes[_i];
	const double tol = dt == EPJ_DTYPE_F64	 ? 1e-12
			   : dt == EPJ_DTYPE_F32 ? 2e-5
						 : 1.0 / 60;
	epj_ctx *dev = sim_ctx();
	const int64_t B = 2, Hq = 4, Hkv = 2, T = 29, D = 12;
	int64_t qs[4] = { B, Hq, T, D }, ks[4] = { B, Hkv, T, D },
		is[2] = { B, T };
	epj_tensor *q = tu_randn(dev, dt, 4, qs), *k = tu_randn(dev, dt, 4, ks),
		   *v = tu_randn(dev, dt, 4, ks), *w = tu_randn(dev, dt, 4, qs);
	epj_tensor *ids = epj_zeros(dev, EPJ_DTYPE_I64, 2, is);
	tu_ok(dev, ids);
	int64_t doc[2 * 29];
	for (int64_t b = 0, d = 0; b < B; b++)
		for (int64_t j = 0; j < T; j++) {
			if (j > 0 && tu_randint(0, 5) == 0)
				d++;
			doc[b * T + j] = d;
			epj_tensor_set_f64(ids, b * T + j, (double)d);
		}
	epj_tensor *x[3] = { q, k, v };
	for (int i = 0; i < 3; i++)
		epj_tensor_set_requires_grad(x[i], true);
	snap s0 = take(dev);
	epj_tensor *o = epj_sdpa_docs(dev, q, k, v, ids, true, 0.0);
	epj_tensor *ow = epj_mul(dev, o, w);
	epj_tensor *l = epj_sum_all(dev, ow);
	tu_ok(dev, l);
	ck_assert_msg(epj_backward(dev, l, NULL) == EPJ_OK, "%s",
		      epj_ctx_error(dev));
	assert_cuda_since(dev, s0, "packed documents");
	int docs = 0;
	for (int64_t b = 0; b < B; b++)
		for (int64_t lo = 0; lo < T; docs++) {
			int64_t hi = lo + 1;
			while (hi < T && doc[b * T + hi] == doc[b * T + lo])
				hi++;
			epj_tensor *a[4], *ga[3];
			for (int i = 0; i < 3; i++) {
				a[i] = doc_rows(dev, x[i], b, lo, hi, true);
				ga[i] = doc_rows(dev, epj_tensor_grad(x[i]), b,
						 lo, hi, false);
			}
			a[3] = doc_rows(dev, w, b, lo, hi, false);
			epj_tensor *po = doc_rows(dev, o, b, lo, hi, false);
			epj_tensor *ao =
			    epj_sdpa(dev, a[0], a[1], a[2], true, 0.0);
			epj_tensor *aw = epj_mul(dev, ao, a[3]);
			epj_tensor *al = epj_sum_all(dev, aw);
			tu_ok(dev, al);
			ck_assert_msg(epj_backward(dev, al, NULL) == EPJ_OK,
				      "%s", epj_ctx_error(dev));
			char what[128];
			snprintf(what, sizeof what,
				 "%s row %lld, document [%lld, %lld) alone",
				 epj_dtype_name(dt), (long long)b,
				 (long long)lo, (long long)hi);
			tu_assert_tensors_close(dev, po, ao, tol, tol, what);
			for (int i = 0; i < 3; i++)
				tu_assert_tensors_close(dev, ga[i],
							epj_tensor_grad(a[i]),
							tol, tol, what);
			epj_tensor *all[] = { a[0],  a[1],  a[2],  a[3],
					      ga[0], ga[1], ga[2], po,
					      ao,    aw,    al };
			for (size_t i = 0; i < sizeof all / sizeof *all; i++)
				epj_tensor_free(all[i]);
			lo = hi;
		}
	ck_assert_int_ge(docs, 3);
	epj_tensor *all[] = { q, k, v, w, ids, o, ow, l };
	for (size_t i = 0; i < sizeof all / sizeof *all; i++)
		epj_tensor_free(all[i]);
	epj_ctx_free(dev);
}
END_TEST

/* An out-of-range index is the CPU kernel's error, not a launch. */
START_TEST(test_index_errors)
{
	epj_ctx *cpu = tu_ctx(), *sim = sim_ctx();
	int64_t ash[2] = { 3, 4 }, ish[1] = { 2 };
	epj_tensor *a = tu_randn(cpu, EPJ_DTYPE_F32, 2, ash);
	epj_tensor *idx = epj_zeros(cpu, EPJ_DTYPE_I64, 1, ish);
	epj_tensor_set_f64(idx, 1, 3.0);
	epj_tensor *as = copy_to(sim, a, false), *is = copy_to(sim, idx, false);
	epj_tensor *rc = epj_index_select(cpu, a, 0, idx);
	ck_assert_ptr_null(rc);
	char want[1024];
	snprintf(want, sizeof want, "%s", epj_ctx_error(cpu));
	int64_t l0 = ctr(sim, "kernels.launched.eager_cuda");
	epj_tensor *rs = epj_index_select(sim, as, 0, is);
	ck_assert_ptr_null(rs);
	ck_assert_int_eq(epj_ctx_status(sim), EPJ_ERR_INDEX);
	ck_assert_str_eq(epj_ctx_error(sim), want);
	ck_assert_int_eq(ctr(sim, "kernels.launched.eager_cuda"), l0);
	epj_tensor_free(a);
	epj_tensor_free(idx);
	epj_tensor_free(as);
	epj_tensor_free(is);
	epj_ctx_free(cpu);
	epj_ctx_free(sim);
}
END_TEST

/* index_add and scatter_add add in index order: with values whose sum
 * depends on the order (1e8, 1, -1e8 in f32), the CUDA kernel matches the
 * CPU kernel bit for bit. */
START_TEST(test_accumulation_order)
{
	epj_ctx *cpu = tu_ctx(), *sim = sim_ctx();
	int64_t ash[2] = { 2, 3 }, ish[1] = { 4 }, ssh[2] = { 4, 3 };
	epj_tensor *a = epj_zeros(cpu, EPJ_DTYPE_F32, 2, ash);
	epj_tensor *idx = epj_zeros(cpu, EPJ_DTYPE_I64, 1, ish);
	epj_tensor *src = epj_zeros(cpu, EPJ_DTYPE_F32, 2, ssh);
	static const double v[4] = { 1e8, 1.0, -1e8, 1.0 };
	for (int i = 0; i < 4; i++) {
		epj_tensor_set_f64(idx, i, 1.0);
		for (int j = 0; j < 3; j++)
			epj_tensor_set_f64(src, i * 3 + j, v[i] * (j + 1));
	}
	epj_tensor *in[3] = { a, idx, src };
	epj_tensor *si[3] = { copy_to(sim, a, false), copy_to(sim, idx, false),
			      copy_to(sim, src, false) };
	epj_tensor *rc = epj_index_add(cpu, in[0], 0, in[1], in[2]);
	epj_tensor *rs = epj_index_add(sim, si[0], 0, si[1], si[2]);
	tu_ok(cpu, rc);
	tu_ok(sim, rs);
	for (int64_t q = 0; q < 6; q++)
		ck_assert_msg(
		    epj_tensor_get_f64(rs, q) == epj_tensor_get_f64(rc, q),
		    "index_add element %lld: %.9g vs %.9g", (long long)q,
		    epj_tensor_get_f64(rs, q), epj_tensor_get_f64(rc, q));
	/* the order-dependent value itself: 1e8 + 1 - 1e8 + 1 in f32 */
	ck_assert_double_eq(epj_tensor_get_f64(rs, 3), 1.0);
	epj_tensor_free(rc);
	epj_tensor_free(rs);
	for (int i = 0; i < 3; i++) {
		epj_tensor_free(in[i]);
		epj_tensor_free(si[i]);
	}
	epj_ctx_free(cpu);
	epj_ctx_free(sim);
}
END_TEST

/* A repeated eager call builds nothing: the single-op module comes from
 * the process table (fresh inputs of the same signature, other strides). */
/* The single-op kernels compile under NVRTC for sm_80, sm_90 and sm_100
 * with an empty log: the units the eager ops built on cuda-sim (pointwise
 * with broadcasting, casts, a row and a column reduction, softmax and
 * log-softmax, f32, bf16 and f64) are the text the cuda device would hand
 * NVRTC. */
typedef struct nv_check {
	int units, fails;
	char first[1024];
} nv_check;

static void nvrtc_one(void *user, const char *name, const char *cuda)
{
	nv_check *nc = user;
	static const char *const archs[] = { "sm_80", "sm_90", "sm_100" };
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return;
	for (int a = 0; a < 3; a++) {
		ej_nvrtc_result r = { 0 };
		epj_status st =
		    ej_nvrtc_compile(ctx, cuda, name, archs[a], NULL, 0, &r);
		if ((st != EPJ_OK || (r.log && *r.log)) && !nc->fails++)
			snprintf(nc->first, sizeof nc->first, "%s %s: %s%s",
				 name, archs[a],
				 st != EPJ_OK ? epj_ctx_error(ctx) : "",
				 r.log ? r.log : "");
		ej_nvrtc_result_free(&r);
	}
	nc->units++;
	epj_ctx_free(ctx);
}

START_TEST(test_nvrtc_units)
{
	int maj = 0, min = 0;
	if (!ej_nvrtc_version(&maj, &min)) {
		printf("test_nvrtc_units: built without NVRTC, skipped\n");
		return;
	}
	epj_ctx *sim = sim_ctx();
	static const epj_dtype dts[] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16,
					 EPJ_DTYPE_F64 };
	for (int d = 0; d < 3; d++) {
		int64_t sh[2] = { 3, 13 }, row[1] = { 13 };
		epj_tensor *x = tu_randn(sim, dts[d], 2, sh);
		epj_tensor *b = tu_randn(sim, dts[d], 1, row);
		epj_tensor *y[] = {
			epj_add(sim, x, b),
			epj_silu(sim, x),
			epj_sum(sim, x, 1, true),
			epj_mean(sim, x, 0, false),
			epj_softmax(sim, x, 1),
			epj_log_softmax(sim, x, 1),
			epj_cast(sim, x,
				 d == 1 ? EPJ_DTYPE_F32 : EPJ_DTYPE_BF16),
		};
		for (size_t i = 0; i < EJ_ARRAY_LEN(y); i++) {
			tu_ok(sim, y[i]);
			epj_tensor_free(y[i]);
		}
		epj_tensor_free(x);
		epj_tensor_free(b);
	}
	nv_check nc = { 0 };
	int n = ej_eager_cuda_each_source(nvrtc_one, &nc);
	ck_assert_int_ge(n, 12);
	ck_assert_int_eq(nc.units, n);
	ck_assert_msg(nc.fails == 0, "%d NVRTC failures, first: %s", nc.fails,
		      nc.first);
	epj_ctx_free(sim);
}
END_TEST

START_TEST(test_module_cache)
{
	epj_ctx *sim = sim_ctx();
	int64_t sh[2] = { 3, 11 };
	epj_tensor *x = tu_randn(sim, EPJ_DTYPE_F32, 2, sh);
	epj_tensor *y = epj_tanh(sim, x);
	tu_ok(sim, y);
	int n0 = ej_eager_cuda_modules();
	int64_t b0 = ctr(sim, "codegen.eager_modules");
	ck_assert_int_ge(n0, 1);
	epj_tensor *x2 = tu_randn_nc(sim, EPJ_DTYPE_F32, 2, sh, true);
	snap s = take(sim);
	epj_tensor *y2 = epj_tanh(sim, x2);
	tu_ok(sim, y2);
	assert_cuda_since(sim, s, "tanh again");
	ck_assert_int_eq(ej_eager_cuda_modules(), n0);
	ck_assert_int_eq(ctr(sim, "codegen.eager_modules"), b0);
	for (int64_t i = 0; i < 33; i++)
		ck_assert_double_eq_tol(epj_tensor_get_f64(y2, i),
					tanh(epj_tensor_get_f64(x2, i)), 1e-6);
	/* a new shape is a new module */
	int64_t sh3[2] = { 3, 12 };
	epj_tensor *x3 = tu_randn(sim, EPJ_DTYPE_F32, 2, sh3);
	epj_tensor *y3 = epj_tanh(sim, x3);
	tu_ok(sim, y3);
	ck_assert_int_eq(ej_eager_cuda_modules(), n0 + 1);
	epj_tensor *t[] = { x, y, x2, y2, x3, y3 };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	epj_ctx_free(sim);
}
END_TEST

/* The cpu device has no eager table and counts nothing; on cuda-sim a
 * matmul runs as CUDA kernels (the GEMM template), and a case an entry has
 * no kernel for (an integer sum) falls back to the CPU kernel, counted per
 * op. */
START_TEST(test_fallback_counted)
{
	epj_ctx *cpu = tu_ctx(), *sim = sim_ctx();
	ck_assert_ptr_null(ej_eager_table(cpu->dev));
	ck_assert_ptr_nonnull(ej_eager_table(sim->dev));
	int64_t a[2] = { 3, 4 }, b[2] = { 4, 5 };
	epj_tensor *x = tu_randn(cpu, EPJ_DTYPE_F32, 2, a);
	epj_tensor *w = tu_randn(cpu, EPJ_DTYPE_F32, 2, b);
	epj_tensor *y = epj_matmul(cpu, x, w);
	tu_ok(cpu, y);
	ck_assert_int_eq(ctr(cpu, "kernels.eager_cpu_fallback"), 0);
	ck_assert_int_eq(ctr(cpu, "kernels.eager_cuda"), 0);
	epj_tensor *xs = copy_to(sim, x, false), *ws = copy_to(sim, w, false);
	int64_t f0 = ctr(sim, "kernels.eager_cpu_fallback");
	int64_t c0 = ctr(sim, "kernels.eager_cuda");
	epj_tensor *ys = epj_matmul(sim, xs, ws);
	tu_ok(sim, ys);
	tu_assert_tensors_close(cpu, ys, y, 1e-5, 1e-5, "matmul on cuda-sim");
	ck_assert_int_eq(ctr(sim, "kernels.eager_cpu_fallback"), f0);
	ck_assert_int_eq(ctr(sim, "kernels.eager_cuda"), c0 + 1);
	epj_tensor *ic = epj_randint(cpu, EPJ_DTYPE_I64, 2, a, -50, 50);
	tu_ok(cpu, ic);
	epj_tensor *is = copy_to(sim, ic, false);
	epj_tensor *sc = epj_sum(cpu, ic, 1, false);
	epj_tensor *ss = epj_sum(sim, is, 1, false);
	tu_ok(sim, ss);
	for (int64_t r = 0; r < a[0]; r++)
		ck_assert_int_eq(epj_tensor_get_f64(ss, r),
				 epj_tensor_get_f64(sc, r));
	ck_assert_int_eq(ctr(sim, "kernels.eager_cpu_fallback"), f0 + 1);
	ck_assert_int_eq(ctr(sim, "kernels.eager_cpu_fallback.sum"), 1);
	epj_tensor *t[] = { x, w, y, xs, ws, ys, ic, is, sc, ss };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	epj_ctx_free(cpu);
	epj_ctx_free(sim);
}
END_TEST

/* Every op of the op table has an eager CUDA entry (the list of any
 * missing one is printed and fails). */
START_TEST(test_coverage)
{
	char list[1024];
	size_t used = 0;
	int missing = 0;
	list[0] = 0;
	for (int op = 0; op < EJ_OP_COUNT; op++) {
		if (ej_eager_cuda_table[op])
			continue;
		int w = snprintf(list + used, sizeof list - used, " %s",
				 ej_ops[op].name);
		if (w > 0 && (size_t)w < sizeof list - used)
			used += (size_t)w;
		missing++;
	}
	printf("eager_sim: %d of %d ops have no eager CUDA entry:%s\n", missing,
	       EJ_OP_COUNT, missing ? list : " (none)");
	ck_assert_msg(missing == 0, "ops without an eager CUDA entry:%s", list);
	/* the table is what cuda-sim contexts dispatch through */
	ck_assert_ptr_eq(ej_eager_table(&ej_device_sim), ej_eager_cuda_table);
	/* and cuda contexts (by the device's name) */
	ej_device named = { .name = "cuda" };
	ck_assert_ptr_eq(ej_eager_table(&named), ej_eager_cuda_table);
}
END_TEST

Suite *make_eager_sim_suite(void)
{
	Suite *s = suite_create("eager_sim");
	TCase *tc = tcase_create("eager_sim");
	tcase_set_timeout(tc, 600);
	tcase_add_test(tc, test_coverage);
	tcase_add_test(tc, test_fallback_counted);
	tcase_add_test(tc, test_module_cache);
	tcase_add_test(tc, test_nvrtc_units);
	tcase_add_test(tc, test_index_errors);
	tcase_add_test(tc, test_accumulation_order);
	tu_add_loop_test(tc, test_pointwise, 3);
	tcase_add_test(tc, test_int_and_casts);
	tu_add_loop_test(tc, test_reductions, 4);
	tu_add_loop_test(tc, test_shape, 3);
	tu_add_loop_test(tc, test_index, 3);
	tu_add_loop_test(tc, test_moe, 3);
	tu_add_loop_test(tc, test_nn, 3);
	tu_add_loop_test(tc, test_docs_alone, 3);
	suite_add_tcase(s, tc);
	return s;
}

/* The same cases on a "cuda" context over the stand-in driver
 * (t/fake_cuda.c; FAKE_CUDA_GUARD keeps its device memory inaccessible to
 * the host outside driver calls, so a host read of a device pointer
 * crashes the case): tensors in device memory, every eager op an NVRTC
 * cubin launched through cuLaunchKernel. */
static void cuda_setup(void)
{
	target = "cuda";
	ck_assert_msg(tu_fake_cuda_begin(), "the fake driver is missing");
}

static void cuda_teardown(void)
{
	tu_fake_cuda_end();
	target = "cuda-sim";
}

/* The cases of a cuda context (the stand-in's suite eager_cuda, the gpu
 * suite's gpu_eager): f32 and bf16 (f64 takes the same device paths as
 * f32). */
static void add_cuda_cases(TCase *tc)
{
	tcase_add_test(tc, test_fallback_counted);
	tcase_add_test(tc, test_index_errors);
	tcase_add_test(tc, test_accumulation_order);
	tu_add_loop_test(tc, test_pointwise, 2);
	tcase_add_test(tc, test_int_and_casts);
	tu_add_loop_test(tc, test_reductions, 2);
	tu_add_loop_test(tc, test_shape, 2);
	tu_add_loop_test(tc, test_index, 2);
	tu_add_loop_test(tc, test_moe, 2);
	tu_add_loop_test(tc, test_nn, 2);
	tu_add_loop_test(tc, test_docs_alone, 2);
}

/* The same cases in the gpu suite, on the machine's driver. */
static void gpu_setup(void)
{
	target = "cuda";
	tu_gpu_setup();
	ck_assert_msg(!tu_fake_cuda_usable() || tu_fake_cuda_begin(),
		      "the machine's driver did not open again");
}

static void gpu_teardown(void)
{
	if (tu_fake_cuda_usable())
		tu_fake_cuda_end();
	tu_gpu_teardown();
	target = "cuda-sim";
}

void tu_add_gpu_eager_cases(Suite *s)
{
	TCase *tc = tcase_create("gpu_eager");
	tcase_set_timeout(tc, 600);
	suite_add_tcase(s, tc);
	if (!tu_gpu_wanted())
		return;
	tcase_add_checked_fixture(tc, gpu_setup, gpu_teardown);
	add_cuda_cases(tc);
}

Suite *make_eager_cuda_suite(void)
{
	Suite *s = suite_create("eager_cuda");
	TCase *tc = tcase_create("eager_cuda");
	tcase_set_timeout(tc, 600);
	if (!tu_fake_cuda_usable()) {
		suite_add_tcase(s, tc);
		return s;
	}
	tcase_add_checked_fixture(tc, cuda_setup, cuda_teardown);
	add_cuda_cases(tc);
	suite_add_tcase(s, tc);
	return s;
}
