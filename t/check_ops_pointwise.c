/* check_ops_pointwise.c -- elementwise ops: add sub mul div eq (numpy
 * broadcasting), add_scalar mul_scalar pow_scalar, neg exp log sqrt rsqrt
 * silu sigmoid tanh gelu cos sin log1p, cast, and the silu/gelu backward
 * helpers.
 *
 * Every forward result is compared with a double-precision reference
 * written here (broadcast index mapping and math from libm, in forms that
 * differ from the kernels': sigmoid through tanh, gelu through erfc), on
 * fresh random inputs of odd sizes, contiguous and not (tu_noncontig).
 * The reference is computed from the input tensor's own values, so bf16
 * inputs are already rounded.  Tolerances, |got - ref| <= atol + rtol|ref|:
 *  - f64:  rtol 1e-12, atol 1e-14 -- same precision as the reference,
 *          only libm ulps and operation order differ;
 *  - f32:  rtol 1e-5, atol 1e-6 -- a few f32 ulps of expf/erff; the atol
 *          covers gelu's 1 + erf(x) cancellation near -4 (as in PyTorch);
 *  - bf16: rtol 1e-2, atol 1e-3 -- one bf16 rounding (2^-9 relative) of a
 *          result computed in f32.
 * Gradients: tu_gradcheck in f64, central differences with eps 1e-6,
 * rtol 1e-5, atol 1e-6 (truncation error ~eps^2, rounding ~1e-16/eps);
 * log/sqrt/rsqrt/div/pow inputs are kept in [0.5, 2.5], away from 0.
 */
#include "check_util.h"
#include "ops_expf.h"
#include "ops_impl.h"
#include "ops_vexp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers -------------------------------------------------------------
 */

enum gen { G_NORMAL, G_POS, G_SMALLINT };

static const epj_dtype float_dtypes[] = { EPJ_DTYPE_F32, EPJ_DTYPE_F64,
					  EPJ_DTYPE_BF16 };

static double gen_value(enum gen g)
{
	switch (g) {
	case G_POS:
		return tu_uniform(0.5, 2.5);
	case G_SMALLINT:
		return (double)tu_randint(-2, 3);
	default: { /* Box-Muller from the test RNG */
		double u = tu_uniform(1e-12, 1.0), v = tu_uniform(0.0, 1.0);
		return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
	}
	}
}

/* Fresh random tensor; non-contiguous (same values) when nc and nd >= 1. */
static epj_tensor *mk(epj_ctx *ctx, epj_dtype dt, int nd, const int64_t *shape,
		      enum gen g, bool nc)
{
	int64_t n = tu_numel(nd, shape);
	double *v = malloc(sizeof *v * (size_t)(n > 0 ? n : 1));
	ck_assert_ptr_nonnull(v);
	for (int64_t i = 0; i < n; i++)
		v[i] = gen_value(g);
	epj_tensor *t = epj_zeros(ctx, dt, nd, shape);
	tu_ok(ctx, t);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, t, v), EPJ_OK);
	free(v);
	return tu_maybe_noncontig(ctx, t, nc);
}

static void tol_for(epj_dtype dt, double *rtol, double *atol)
{
	switch (dt) {
	case EPJ_DTYPE_F64:
		*rtol = 1e-12, *atol = 1e-14;
		break;
	case EPJ_DTYPE_BF16:
		*rtol = 1e-2, *atol = 1e-3;
		break;
	default:
		*rtol = 1e-5, *atol = 1e-6;
	}
}

/* Flat index into a (nd, shape) input read through numpy broadcasting at
 * output multi-index oidx of an ond-dim output. */
static int64_t bcast_index(int ond, const int64_t *oidx, int nd,
			   const int64_t *shape)
{
	int64_t f = 0;
	for (int i = 0; i < nd; i++) {
		int64_t k = shape[i] == 1 ? 0 : oidx[ond - nd + i];
		f = f * shape[i] + k;
	}
	return f;
}

/* ---- binary ops ----------------------------------------------------------
 */

typedef epj_tensor *(*bin_fn)(epj_ctx *, epj_tensor *, epj_tensor *);

typedef struct bin_op {
	const char *name;
	bin_fn fn;
	enum gen ga, gb;
} bin_op;

static const bin_op bin_ops[] = {
	{ "add", epj_add, G_NORMAL, G_NORMAL },
	{ "sub", epj_sub, G_NORMAL, G_NORMAL },
	{ "mul", epj_mul, G_NORMAL, G_NORMAL },
	{ "div", epj_div, G_NORMAL, G_POS },
	{ "eq", epj_eq, G_SMALLINT, G_SMALLINT },
	{ "maximum", epj_maximum, G_SMALLINT, G_SMALLINT }, /* ties */
};

static double ref_bin(const char *name, double a, double b)
{
	if (strcmp(name, "maximum") == 0)
		return isnan(a) || isnan(b) ? NAN : a < b ? b : a;
	switch (name[0]) {
	case 'a':
		return a + b;
	case 's':
		return a - b;
	case 'm':
		return a * b;
	case 'd':
		return a / b;
	default:
		return a == b ? 1.0 : 0.0;
	}
}

typedef struct shape_pair {
	int na, nb;
	int64_t a[4], b[4];
} shape_pair;

static const shape_pair pairs[] = {
	{ 3, 2, { 5, 1, 7 }, { 3, 1 } }, /* -> [5,3,7] */
	{ 1, 1, { 13 }, { 13 } },
	{ 2, 1, { 3, 5 }, { 5 } },
	{ 2, 2, { 4, 1 }, { 1, 6 } },
	{ 0, 2, { 0 }, { 3, 2 } }, /* 0-d with [3,2] */
	{ 3, 3, { 2, 3, 5 }, { 2, 3, 5 } },
	{ 3, 3, { 3, 1, 5 }, { 1, 7, 5 } },
};

/* Output of op(a, b) checked against the reference, elementwise. */
static void check_binary(epj_ctx *ctx, const bin_op *op, epj_tensor *a,
			 epj_tensor *b, epj_dtype dt)
{
	epj_tensor *y = op->fn(ctx, a, b);
	tu_ok(ctx, y);
	ck_assert_int_eq(epj_tensor_dtype(y), dt);
	int na = epj_tensor_ndim(a), nb = epj_tensor_ndim(b);
	int nd = na > nb ? na : nb;
	int64_t shape[8] = { 0 };
	for (int i = 0; i < nd; i++) {
		int ia = na - nd + i, ib = nb - nd + i;
		int64_t da = ia >= 0 ? epj_tensor_dim(a, ia) : 1;
		int64_t db = ib >= 0 ? epj_tensor_dim(b, ib) : 1;
		shape[i] = da == 1 ? db : da;
	}
	tu_assert_shape(y, nd, shape);
	double *va = tu_values(ctx, a), *vb = tu_values(ctx, b);
	int64_t n = tu_numel(nd, shape);
	double *ref = malloc(sizeof *ref * (size_t)n);
	int64_t idx[8] = { 0 };
	for (int64_t i = 0; i < n; i++) {
		double x = va[bcast_index(nd, idx, na, epj_tensor_shape(a))];
		double z = vb[bcast_index(nd, idx, nb, epj_tensor_shape(b))];
		ref[i] = ref_bin(op->name, x, z);
		tu_next_index(nd, shape, idx);
	}
	double rtol, atol;
	tol_for(dt, &rtol, &atol);
	char what[96];
	snprintf(what, sizeof what, "%s %s", op->name, epj_dtype_name(dt));
	tu_assert_close(ctx, y, ref, rtol, atol, what);
	free(ref);
	free(va);
	free(vb);
	epj_tensor_free(y);
}

START_TEST(test_binary_broadcast)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t o = 0; o < sizeof bin_ops / sizeof bin_ops[0]; o++)
		for (size_t d = 0; d < 3; d++)
			for (size_t p = 0; p < sizeof pairs / sizeof pairs[0];
			     p++)
				for (int nc = 0; nc < 2; nc++) {
					const bin_op *op = &bin_ops[o];
					const shape_pair *sp = &pairs[p];
					epj_dtype dt = float_dtypes[d];
					epj_tensor *a =
					    mk(ctx, dt, sp->na, sp->a, op->ga,
					       nc && sp->na > 0 && p % 2 == 0);
					epj_tensor *b = mk(ctx, dt, sp->nb,
							   sp->b, op->gb, nc);
					check_binary(ctx, op, a, b, dt);
					epj_tensor_free(a);
					epj_tensor_free(b);
				}
	epj_ctx_free(ctx);
}
END_TEST

/* Many blocks, threads and a broadcast row: [211, 197] op [197]. */
START_TEST(test_binary_large)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sa[2] = { 211, 197 + 2 * tu_randint(0, 3) }, sb[1] = { sa[1] };
	for (size_t o = 0; o < sizeof bin_ops / sizeof bin_ops[0]; o++) {
		const bin_op *op = &bin_ops[o];
		epj_tensor *a = mk(ctx, EPJ_DTYPE_F32, 2, sa, op->ga, false);
		epj_tensor *b = mk(ctx, EPJ_DTYPE_F32, 1, sb, op->gb, false);
		check_binary(ctx, op, a, b, EPJ_DTYPE_F32);
		check_binary(ctx, op, a, a, EPJ_DTYPE_F32);
		epj_tensor *an = tu_noncontig(ctx, a);
		check_binary(ctx, op, an, b, EPJ_DTYPE_F32);
		epj_tensor_free(an);
		epj_tensor_free(a);
		epj_tensor_free(b);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- unary and scalar ops ------------------------------------------------
 */

enum uop {
	U_NEG,
	U_EXP,
	U_LOG,
	U_SQRT,
	U_RSQRT,
	U_SILU,
	U_SIGMOID,
	U_TANH,
	U_GELU,
	U_COS,
	U_SIN,
	U_LOG1P,
	U_ADDS,
	U_MULS,
	U_POW,
};

typedef struct un_op {
	const char *name;
	enum uop op;
	enum gen g;
	double s; /* scalar / exponent */
} un_op;

static const un_op un_ops[] = {
	{ "neg", U_NEG, G_NORMAL, 0 },
	{ "exp", U_EXP, G_NORMAL, 0 },
	{ "log", U_LOG, G_POS, 0 },
	{ "sqrt", U_SQRT, G_POS, 0 },
	{ "rsqrt", U_RSQRT, G_POS, 0 },
	{ "silu", U_SILU, G_NORMAL, 0 },
	{ "sigmoid", U_SIGMOID, G_NORMAL, 0 },
	{ "tanh", U_TANH, G_NORMAL, 0 },
	{ "gelu", U_GELU, G_NORMAL, 0 },
	{ "cos", U_COS, G_NORMAL, 0 },
	{ "sin", U_SIN, G_NORMAL, 0 },
	{ "log1p", U_LOG1P, G_POS, 0 },
	{ "add_scalar", U_ADDS, G_NORMAL, 0.37 },
	{ "mul_scalar", U_MULS, G_NORMAL, -1.7 },
	{ "pow_scalar 2", U_POW, G_NORMAL, 2.0 },
	{ "pow_scalar 3", U_POW, G_NORMAL, 3.0 },
	{ "pow_scalar 1", U_POW, G_NORMAL, 1.0 },
	{ "pow_scalar 0.5", U_POW, G_POS, 0.5 },
	{ "pow_scalar -1.5", U_POW, G_POS, -1.5 },
};

static epj_tensor *run_un(epj_ctx *ctx, const un_op *u, epj_tensor *x)
{
	switch (u->op) {
	case U_NEG:
		return epj_neg(ctx, x);
	case U_EXP:
		return epj_exp(ctx, x);
	case U_LOG:
		return epj_log(ctx, x);
	case U_SQRT:
		return epj_sqrt(ctx, x);
	case U_RSQRT:
		return epj_rsqrt(ctx, x);
	case U_SILU:
		return epj_silu(ctx, x);
	case U_SIGMOID:
		return epj_sigmoid(ctx, x);
	case U_TANH:
		return epj_tanh(ctx, x);
	case U_GELU:
		return epj_gelu(ctx, x);
	case U_COS:
		return epj_cos(ctx, x);
	case U_SIN:
		return epj_sin(ctx, x);
	case U_LOG1P:
		return epj_log1p(ctx, x);
	case U_ADDS:
		return epj_add_scalar(ctx, x, u->s);
	case U_MULS:
		return epj_mul_scalar(ctx, x, u->s);
	default:
		return epj_pow_scalar(ctx, x, u->s);
	}
}

static double sigmoid_ref(double x)
{
	return 0.5 * (1.0 + tanh(0.5 * x));
}

static double ref_un(const un_op *u, double x)
{
	switch (u->op) {
	case U_NEG:
		return -x;
	case U_EXP:
		return exp(x);
	case U_LOG:
		return log(x);
	case U_SQRT:
		return sqrt(x);
	case U_RSQRT:
		return 1.0 / sqrt(x);
	case U_SILU:
		return x * sigmoid_ref(x);
	case U_SIGMOID:
		return sigmoid_ref(x);
	case U_TANH:
		return tanh(x);
	case U_GELU:
		return 0.5 * x * erfc(-x / sqrt(2.0));
	case U_COS: /* through sin, not the kernels' cos */
		return sin(x + 1.57079632679489661923);
	case U_SIN:
		return -cos(x + 1.57079632679489661923);
	case U_LOG1P: /* log(1 + x) = 2 atanh(x / (2 + x)), exact near 0 */
		return 2.0 * atanh(x / (2.0 + x));
	case U_ADDS:
		return x + u->s;
	case U_MULS:
		return x * u->s;
	default:
		return pow(x, u->s);
	}
}

static void check_unary(epj_ctx *ctx, const un_op *u, epj_tensor *x,
			epj_dtype dt)
{
	epj_tensor *y = run_un(ctx, u, x);
	tu_ok(ctx, y);
	ck_assert_int_eq(epj_tensor_dtype(y), dt);
	tu_assert_shape(y, epj_tensor_ndim(x), epj_tensor_shape(x));
	int64_t n = epj_tensor_numel(x);
	double *v = tu_values(ctx, x);
	for (int64_t i = 0; i < n; i++)
		v[i] = ref_un(u, v[i]);
	double rtol, atol;
	tol_for(dt, &rtol, &atol);
	char what[96];
	snprintf(what, sizeof what, "%s %s", u->name, epj_dtype_name(dt));
	tu_assert_close(ctx, y, v, rtol, atol, what);
	free(v);
	epj_tensor_free(y);
}

START_TEST(test_unary)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t shapes[][3] = { { 13, 0, 0 }, { 3, 5, 7 }, { 1, 9, 1 } };
	const int nds[] = { 1, 3, 3 };
	for (size_t o = 0; o < sizeof un_ops / sizeof un_ops[0]; o++)
		for (size_t d = 0; d < 3; d++)
			for (size_t s = 0; s < 3; s++)
				for (int nc = 0; nc < 2; nc++) {
					epj_tensor *x =
					    mk(ctx, float_dtypes[d], nds[s],
					       shapes[s], un_ops[o].g, nc);
					check_unary(ctx, &un_ops[o], x,
						    float_dtypes[d]);
					epj_tensor_free(x);
				}
	/* 0-d and a large odd size (threads, block tails) */
	for (size_t o = 0; o < sizeof un_ops / sizeof un_ops[0]; o++) {
		epj_tensor *x = mk(ctx, EPJ_DTYPE_F32, 0, NULL, un_ops[o].g, 0);
		check_unary(ctx, &un_ops[o], x, EPJ_DTYPE_F32);
		epj_tensor_free(x);
		int64_t big[1] = { 40000 + 2 * tu_randint(0, 50) + 1 };
		x = mk(ctx, EPJ_DTYPE_F32, 1, big, un_ops[o].g, 0);
		check_unary(ctx, &un_ops[o], x, EPJ_DTYPE_F32);
		epj_tensor_free(x);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Special values follow the IEEE/libm definitions. */
START_TEST(test_unary_special)
{
	epj_ctx *ctx = tu_ctx();
	const double in[6] = { -INFINITY, INFINITY, NAN, 0.0, -100.0, 100.0 };
	int64_t n = 6;
	epj_tensor *x = epj_tensor_from_data(ctx, EPJ_DTYPE_F64, 1, &n, in);
	tu_ok(ctx, x);
	epj_tensor *s = epj_sigmoid(ctx, x), *e = epj_exp(ctx, x);
	tu_ok(ctx, s);
	tu_ok(ctx, e);
	const double rs[6] = { 0, 1, NAN, 0.5, 1 / (1 + exp(100.0)), 1 };
	const double re[6] = { 0, INFINITY, NAN, 1, exp(-100.0), exp(100.0) };
	tu_assert_close(ctx, s, rs, 1e-12, 0, "sigmoid special");
	tu_assert_close(ctx, e, re, 1e-12, 0, "exp special");
	epj_tensor_free(s);
	epj_tensor_free(e);
	epj_tensor_free(x);
	/* log1p keeps the small values that log(1 + x) rounds to 0 in f32 */
	const float small[3] = { 1e-10f, -3e-8f, 5e-9f };
	int64_t n3 = 3;
	epj_tensor *xs =
	    epj_tensor_from_data(ctx, EPJ_DTYPE_F32, 1, &n3, small);
	tu_ok(ctx, xs);
	epj_tensor *l = epj_log1p(ctx, xs);
	tu_ok(ctx, l);
	double rl[3];
	for (int i = 0; i < 3; i++)
		rl[i] = 2.0 * atanh((double)small[i] / (2.0 + small[i]));
	tu_assert_close(ctx, l, rl, 1e-6, 0, "log1p near 0");
	epj_tensor_free(l);
	epj_tensor_free(xs);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- integers ------------------------------------------------------------
 */

START_TEST(test_int_ops)
{
	epj_ctx *ctx = tu_ctx();
	const epj_dtype dts[2] = { EPJ_DTYPE_I32, EPJ_DTYPE_I64 };
	for (int d = 0; d < 2; d++) {
		int64_t sa[3] = { 5, 1, 7 }, sb[2] = { 3, 1 };
		epj_tensor *a = epj_randint(ctx, dts[d], 3, sa, -1000, 1000);
		epj_tensor *b = epj_randint(ctx, dts[d], 2, sb, -3, 3);
		tu_ok(ctx, a);
		tu_ok(ctx, b);
		/* exact: the tolerance is zero */
		const bin_op int_ops[5] = { bin_ops[0], bin_ops[1], bin_ops[2],
					    bin_ops[4], bin_ops[5] };
		for (int o = 0; o < 5; o++) {
			epj_tensor *y = int_ops[o].fn(ctx, a, b);
			tu_ok(ctx, y);
			ck_assert_int_eq(epj_tensor_dtype(y), dts[d]);
			double *va = tu_values(ctx, a), *vb = tu_values(ctx, b);
			int64_t shape[3] = { 5, 3, 7 }, idx[3] = { 0 };
			double ref[105];
			for (int64_t i = 0; i < 105; i++) {
				ref[i] =
				    ref_bin(int_ops[o].name,
					    va[bcast_index(3, idx, 3, sa)],
					    vb[bcast_index(3, idx, 2, sb)]);
				tu_next_index(3, shape, idx);
			}
			tu_assert_close(ctx, y, ref, 0, 0, int_ops[o].name);
			free(va);
			free(vb);
			epj_tensor_free(y);
		}
		epj_tensor *ng = epj_neg(ctx, a);
		tu_ok(ctx, ng);
		double *va = tu_values(ctx, a);
		for (int i = 0; i < 35; i++)
			va[i] = -va[i];
		tu_assert_close(ctx, ng, va, 0, 0, "neg int");
		free(va);
		epj_tensor_free(ng);
		epj_tensor_free(a);
		epj_tensor_free(b);
	}
	/* i32 wraps like two's complement */
	int64_t one = 1;
	int32_t mx = INT32_MAX, onev = 1;
	epj_tensor *a = epj_tensor_from_data(ctx, EPJ_DTYPE_I32, 1, &one, &mx);
	epj_tensor *b =
	    epj_tensor_from_data(ctx, EPJ_DTYPE_I32, 1, &one, &onev);
	epj_tensor *s = epj_add(ctx, a, b);
	tu_ok(ctx, s);
	ck_assert_int_eq(((int32_t *)epj_tensor_data(s))[0], INT32_MIN);
	epj_tensor_free(s);

	/* float-only ops reject integers, naming the op and the dtype */
	tu_assert_error(ctx, epj_exp(ctx, a), EPJ_ERR_DTYPE,
			TU_STRS("exp", "i32"));
	tu_assert_error(ctx, epj_div(ctx, a, b), EPJ_ERR_DTYPE,
			TU_STRS("div", "i32"));
	tu_assert_error(ctx, epj_mul_scalar(ctx, a, 2.0), EPJ_ERR_DTYPE,
			TU_STRS("mul_scalar", "i32"));
	tu_assert_error(ctx, epj_gelu(ctx, a), EPJ_ERR_DTYPE, TU_STRS("gelu"));
	epj_tensor_free(a);
	epj_tensor_free(b);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- cast ----------------------------------------------------------------
 */

START_TEST(test_cast_values)
{
	epj_ctx *ctx = tu_ctx();
	const double in[9] = { -2.7, 2.7,   -0.5,
			       0.0,  1e10,  -1e10,
			       NAN,  3.999, tu_uniform(-50, 50) };
	int64_t n = 9;
	epj_tensor *x = epj_tensor_from_data(ctx, EPJ_DTYPE_F64, 1, &n, in);
	tu_ok(ctx, x);
	/* float -> int: truncation toward zero, NaN -> 0, saturation */
	epj_tensor *i32 = epj_cast(ctx, x, EPJ_DTYPE_I32);
	epj_tensor *i64 = epj_cast(ctx, x, EPJ_DTYPE_I64);
	tu_ok(ctx, i32);
	tu_ok(ctx, i64);
	const double r32[9] = { -2,	   2, 0, 0,	      INT32_MAX,
				INT32_MIN, 0, 3, trunc(in[8]) };
	const double r64[9] = { -2, 2, 0, 0, 1e10, -1e10, 0, 3, trunc(in[8]) };
	tu_assert_close(ctx, i32, r32, 0, 0, "cast f64->i32");
	tu_assert_close(ctx, i64, r64, 0, 0, "cast f64->i64");
	/* i64 -> i32 keeps the low 32 bits; i32 -> f32 exact */
	int64_t big = (INT64_C(1) << 32) + 5;
	int64_t one = 1;
	epj_tensor *b = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 1, &one, &big);
	epj_tensor *b32 = epj_cast(ctx, b, EPJ_DTYPE_I32);
	tu_ok(ctx, b32);
	ck_assert_int_eq(((int32_t *)epj_tensor_data(b32))[0], 5);
	epj_tensor *f = epj_cast(ctx, i32, EPJ_DTYPE_F32);
	tu_ok(ctx, f);
	tu_assert_close(ctx, f, r32, 1e-7, 0, "cast i32->f32");
	/* f64 -> f32 rounds once */
	epj_tensor *x32 = epj_cast(ctx, x, EPJ_DTYPE_F32);
	tu_ok(ctx, x32);
	float *p = epj_tensor_data(x32);
	for (int i = 0; i < 9; i++)
		if (!isnan(in[i]))
			ck_assert(p[i] == (float)in[i]);
	ck_assert(isnan(p[6]));
	/* cast to the same dtype is the identity */
	epj_tensor *same = epj_cast(ctx, x, EPJ_DTYPE_F64);
	ck_assert_ptr_eq(same, x);
	epj_tensor_free(same);
	tu_assert_error(ctx, epj_cast(ctx, x, EPJ_DTYPE_COUNT), EPJ_ERR_DTYPE,
			TU_STRS("cast"));
	epj_tensor_free(x32);
	epj_tensor_free(f);
	epj_tensor_free(b32);
	epj_tensor_free(b);
	epj_tensor_free(i32);
	epj_tensor_free(i64);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* f32 <-> bf16 (fast path and strided path) against the library's scalar
 * conversion, bit for bit; every dtype pair round-trips small integers. */
START_TEST(test_cast_bf16)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[2] = { 181, 2 * tu_randint(90, 110) + 1 }; /* > 32768 */
	epj_tensor *x = mk(ctx, EPJ_DTYPE_F32, 2, shape, G_NORMAL, false);
	epj_tensor *xn = tu_noncontig(ctx, x);
	for (int nc = 0; nc < 2; nc++) {
		epj_tensor *src = nc ? xn : x;
		epj_tensor *h = epj_cast(ctx, src, EPJ_DTYPE_BF16);
		tu_ok(ctx, h);
		float *xs = epj_tensor_data(x);
		uint16_t *hs = epj_tensor_data(h);
		int64_t n = shape[0] * shape[1];
		for (int64_t i = 0; i < n; i++)
			ck_assert_msg(hs[i] == epj_f32_to_bf16(xs[i]),
				      "bf16 of %.9g at %lld", xs[i],
				      (long long)i);
		epj_tensor *hn = tu_noncontig(ctx, h);
		epj_tensor *back = epj_cast(ctx, nc ? hn : h, EPJ_DTYPE_F32);
		tu_ok(ctx, back);
		float *bs = epj_tensor_data(back);
		for (int64_t i = 0; i < n; i++)
			ck_assert(bs[i] == epj_bf16_to_f32(hs[i]));
		epj_tensor_free(back);
		epj_tensor_free(hn);
		epj_tensor_free(h);
	}
	epj_tensor_free(xn);
	epj_tensor_free(x);

	int64_t s3[2] = { 3, 5 };
	for (int from = 0; from < EPJ_DTYPE_COUNT; from++)
		for (int to = 0; to < EPJ_DTYPE_COUNT; to++) {
			epj_tensor *a = mk(ctx, (epj_dtype)from, 2, s3,
					   G_SMALLINT, (from + to) % 2);
			epj_tensor *c = epj_cast(ctx, a, (epj_dtype)to);
			tu_ok(ctx, c);
			ck_assert_int_eq(epj_tensor_dtype(c), to);
			double *v = tu_values(ctx, a);
			tu_assert_close(ctx, c, v, 0, 0, "cast small ints");
			free(v);
			epj_tensor_free(c);
			epj_tensor_free(a);
		}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- where ---------------------------------------------------------------
 */

/* A value of dtype dt as where's condition sees it: zeros (both signs), NaN
 * (true), tiny and negative values; integers 0, 1 and -3. */
static double cond_value(epj_dtype dt)
{
	static const double fv[] = { 0.0, -0.0, NAN, 1e-30, -2.5, 1.0 };
	static const double iv[] = { 0.0, 1.0, -3.0 };
	if (dt == EPJ_DTYPE_I32 || dt == EPJ_DTYPE_I64)
		return iv[tu_randint(0, 3)];
	return fv[tu_randint(0, 6)];
}

/* A value of a branch: normal, with Inf and NaN now and then (they must not
 * leak from the branch not taken); integers up to 2^40 for i64. */
static double branch_value(epj_dtype dt)
{
	int64_t r = tu_randint(0, 10);
	if (dt == EPJ_DTYPE_I32)
		return (double)tu_randint(-100000, 100000);
	if (dt == EPJ_DTYPE_I64)
		return (double)tu_randint(-(1ll << 40), 1ll << 40);
	if (r == 0)
		return INFINITY;
	if (r == 1)
		return NAN;
	return gen_value(G_NORMAL);
}

static epj_tensor *mk_where(epj_ctx *ctx, epj_dtype dt, int nd,
			    const int64_t *shape, bool cond, bool nc)
{
	int64_t n = tu_numel(nd, shape);
	double *v = malloc(sizeof *v * (size_t)(n > 0 ? n : 1));
	ck_assert_ptr_nonnull(v);
	for (int64_t i = 0; i < n; i++)
		v[i] = cond ? cond_value(dt) : branch_value(dt);
	epj_tensor *t = epj_zeros(ctx, dt, nd, shape);
	tu_ok(ctx, t);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, t, v), EPJ_OK);
	free(v);
	return tu_maybe_noncontig(ctx, t, nc);
}

typedef struct where_shapes {
	int n[3];
	int64_t s[3][3];
} where_shapes;

static const where_shapes where_cases[] = {
	{ { 2, 2, 2 }, { { 5, 7 }, { 5, 7 }, { 5, 7 } } },
	{ { 3, 3, 1 }, { { 3, 1, 5 }, { 1, 4, 5 }, { 5 } } },
	{ { 2, 0, 2 }, { { 6, 1 }, { 0 }, { 1, 9 } } }, /* 0-d a */
	{ { 1, 2, 2 }, { { 4 }, { 3, 1 }, { 3, 4 } } },
	{ { 0, 0, 0 }, { { 0 }, { 0 }, { 0 } } },
	{ { 2, 2, 2 }, { { 3, 0 }, { 1, 0 }, { 3, 1 } } }, /* empty */
	{ { 2, 2, 2 }, { { 129, 1 }, { 1, 1031 }, { 129, 1031 } } },
};

static const epj_dtype all_dtypes[] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16,
					EPJ_DTYPE_F64, EPJ_DTYPE_I32,
					EPJ_DTYPE_I64 };

/* where(c, a, b) against a reference that broadcasts by index: every
 * element equal to the branch the condition picks (NaN to NaN), for every
 * dtype of the branches and of the condition, layouts contiguous or not. */
START_TEST(test_where)
{
	epj_ctx *ctx = tu_ctx();
	int ncase = (int)(sizeof where_cases / sizeof where_cases[0]);
	for (int w = 0; w < ncase; w++)
		for (int di = 0; di < 5; di++)
			for (int ci = 0; ci < 5; ci++) {
				const where_shapes *ws = &where_cases[w];
				epj_dtype dt = all_dtypes[di];
				epj_dtype ct = all_dtypes[(di + ci) % 5];
				bool nc = (w + ci) % 2 == 1;
				epj_tensor *c = mk_where(ctx, ct, ws->n[0],
							 ws->s[0], true, nc);
				epj_tensor *a = mk_where(ctx, dt, ws->n[1],
							 ws->s[1], false, !nc);
				epj_tensor *b = mk_where(ctx, dt, ws->n[2],
							 ws->s[2], false, nc);
				epj_tensor *y = epj_where(ctx, c, a, b);
				tu_ok(ctx, y);
				ck_assert_int_eq(epj_tensor_dtype(y), dt);
				int nd = 0;
				for (int k = 0; k < 3; k++)
					if (ws->n[k] > nd)
						nd = ws->n[k];
				int64_t shape[8] = { 0 };
				for (int i = 0; i < nd; i++) {
					shape[i] = 1;
					for (int k = 0; k < 3; k++) {
						int j = ws->n[k] - nd + i;
						if (j >= 0 && ws->s[k][j] != 1)
							shape[i] = ws->s[k][j];
					}
				}
				tu_assert_shape(y, nd, shape);
				double *vc = tu_values(ctx, c),
				       *va = tu_values(ctx, a),
				       *vb = tu_values(ctx, b),
				       *vy = tu_values(ctx, y);
				int64_t idx[8] = { 0 };
				int64_t n = tu_numel(nd, shape);
				for (int64_t i = 0; i < n; i++) {
					double cv = vc[bcast_index(
					    nd, idx, ws->n[0], ws->s[0])];
					double want =
					    cv != 0 ? va[bcast_index(nd, idx,
								     ws->n[1],
								     ws->s[1])]
						    : vb[bcast_index(nd, idx,
								     ws->n[2],
								     ws->s[2])];
					if (!(vy[i] == want ||
					      (isnan(want) && isnan(vy[i]))))
						ck_abort_msg(
						    "where case %d %s cond %s "
						    "elem %lld: %g, want %g "
						    "(cond %g)",
						    w, epj_dtype_name(dt),
						    epj_dtype_name(ct),
						    (long long)i, vy[i], want,
						    cv);
					tu_next_index(nd, shape, idx);
				}
				free(vc);
				free(va);
				free(vb);
				free(vy);
				epj_tensor_free(y);
				epj_tensor_free(a);
				epj_tensor_free(b);
				epj_tensor_free(c);
			}
	epj_ctx_free(ctx);
}
END_TEST

static epj_tensor *fn_where(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	return epj_where(ctx, user, in[0], in[1]);
}

/* Gradients of both branches through broadcasting (central differences in
 * f64: where is linear in them), and a condition that requires grad gets
 * zeros. */
START_TEST(test_grad_where)
{
	epj_ctx *ctx = tu_ctx();
	for (int w = 0; w < 4; w++) {
		const where_shapes *ws = &where_cases[w];
		epj_tensor *c = mk_where(ctx, EPJ_DTYPE_F64, ws->n[0], ws->s[0],
					 true, false);
		epj_tensor *in[2] = {
			mk(ctx, EPJ_DTYPE_F64, ws->n[1], ws->s[1], G_NORMAL,
			   w == 1),
			mk(ctx, EPJ_DTYPE_F64, ws->n[2], ws->s[2], G_NORMAL,
			   false),
		};
		for (int i = 0; i < 2; i++)
			epj_tensor_set_requires_grad(in[i], true);
		char what[64];
		snprintf(what, sizeof what, "grad where case %d", w);
		tu_gradcheck(ctx, fn_where, in, 2, c, 1e-6, 1e-5, 1e-6, what);
		epj_tensor_set_requires_grad(c, true);
		epj_tensor *y = epj_where(ctx, c, in[0], in[1]);
		epj_tensor *s = epj_sum_all(ctx, y);
		tu_ok(ctx, s);
		ck_assert_int_eq(epj_backward(ctx, s, NULL), EPJ_OK);
		const epj_tensor *gc = epj_tensor_grad(c);
		ck_assert_ptr_nonnull(gc);
		tu_assert_shape(gc, ws->n[0], ws->s[0]);
		double *v = tu_values(ctx, gc);
		for (int64_t i = 0; i < tu_numel(ws->n[0], ws->s[0]); i++)
			ck_assert(v[i] == 0.0);
		free(v);
		epj_tensor_free(s);
		epj_tensor_free(y);
		epj_tensor_free(c);
		epj_tensor_free(in[0]);
		epj_tensor_free(in[1]);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- errors --------------------------------------------------------------
 */

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t s23[2] = { 2, 3 }, s4[1] = { 4 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 2, s23);
	epj_tensor *b = tu_randn(ctx, EPJ_DTYPE_F32, 1, s4);
	epj_tensor *c = tu_randn(ctx, EPJ_DTYPE_F64, 2, s23);
	tu_assert_error(ctx, epj_add(ctx, a, b), EPJ_ERR_SHAPE,
			TU_STRS("add", "[2,3]", "[4]"));
	tu_assert_error(ctx, epj_mul(ctx, b, a), EPJ_ERR_SHAPE,
			TU_STRS("mul", "[2,3]", "[4]"));
	tu_assert_error(ctx, epj_add(ctx, a, c), EPJ_ERR_DTYPE,
			TU_STRS("add", "f32", "f64"));
	tu_assert_error(ctx, epj_eq(ctx, c, a), EPJ_ERR_DTYPE,
			TU_STRS("eq", "f32", "f64"));
	/* NULL propagates without touching the message */
	ck_assert_ptr_null(epj_add(ctx, NULL, a));
	ck_assert_ptr_null(epj_exp(ctx, NULL));
	ck_assert_ptr_null(epj_cast(ctx, NULL, EPJ_DTYPE_F32));
	/* where: b that does not broadcast, branches of two dtypes */
	int64_t s31[2] = { 3, 1 };
	epj_tensor *c31 = tu_randn(ctx, EPJ_DTYPE_F32, 2, s31);
	tu_assert_error(ctx, epj_where(ctx, c31, b, a), EPJ_ERR_SHAPE,
			TU_STRS("where", "[2,3]"));
	tu_assert_error(ctx, epj_where(ctx, a, a, c), EPJ_ERR_DTYPE,
			TU_STRS("where", "f32", "f64"));
	ck_assert_ptr_null(epj_where(ctx, NULL, a, a));
	epj_tensor_free(c31);
	epj_tensor_free(a);
	epj_tensor_free(b);
	epj_tensor_free(c);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- gradients -----------------------------------------------------------
 */

static epj_tensor *fn_bin(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	return ((const bin_op *)user)->fn(ctx, in[0], in[1]);
}

START_TEST(test_grad_binary)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t o = 0; o < 4; o++) /* eq has no gradient */
		for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
			const bin_op *op = &bin_ops[o];
			const shape_pair *sp = &pairs[p];
			epj_tensor *in[2] = {
				mk(ctx, EPJ_DTYPE_F64, sp->na, sp->a, op->ga,
				   p == 5),
				mk(ctx, EPJ_DTYPE_F64, sp->nb, sp->b, op->gb,
				   false),
			};
			for (int i = 0; i < 2; i++)
				epj_tensor_set_requires_grad(in[i], true);
			char what[64];
			snprintf(what, sizeof what, "grad %s pair %zu",
				 op->name, p);
			tu_gradcheck(ctx, fn_bin, in, 2, (void *)op, 1e-6, 1e-5,
				     1e-6, what);
			epj_tensor_free(in[0]);
			epj_tensor_free(in[1]);
		}
	epj_ctx_free(ctx);
}
END_TEST

static const bin_op max_normal = { "maximum", epj_maximum, G_NORMAL, G_NORMAL };

/* maximum away from ties (normal inputs): the gradient goes to the larger
 * input, through broadcasting. */
START_TEST(test_grad_maximum)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
		const shape_pair *sp = &pairs[p];
		epj_tensor *in[2] = {
			mk(ctx, EPJ_DTYPE_F64, sp->na, sp->a, G_NORMAL, p == 5),
			mk(ctx, EPJ_DTYPE_F64, sp->nb, sp->b, G_NORMAL, false),
		};
		for (int i = 0; i < 2; i++)
			epj_tensor_set_requires_grad(in[i], true);
		char what[64];
		snprintf(what, sizeof what, "grad maximum pair %zu", p);
		tu_gradcheck(ctx, fn_bin, in, 2, (void *)&max_normal, 1e-6,
			     1e-5, 1e-6, what);
		epj_tensor_free(in[0]);
		epj_tensor_free(in[1]);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* maximum at NaN, ties and signed zeros, forward (bits: a's zero on a tie)
 * and backward (torch's: halves between equal inputs, the whole gradient
 * to both where either is NaN), in every float dtype. */
START_TEST(test_maximum_special)
{
	static const double va[7] = { NAN, 1, 2, 0.0, -0.0, 3, -4 };
	static const double vb[7] = { 1, NAN, 2, -0.0, 0.0, NAN, 5 };
	static const double want[7] = { NAN, NAN, 2, 0.0, -0.0, NAN, 5 };
	static const double ga[7] = { 1, 1, 0.5, 0.5, 0.5, 1, 0 };
	static const double gb[7] = { 1, 1, 0.5, 0.5, 0.5, 1, 1 };
	epj_ctx *ctx = tu_ctx();
	for (size_t d = 0; d < 3; d++) {
		epj_dtype dt = float_dtypes[d];
		int64_t n = 7;
		epj_tensor *a = epj_zeros(ctx, dt, 1, &n);
		epj_tensor *b = epj_zeros(ctx, dt, 1, &n);
		ck_assert_int_eq(epj_tensor_from_f64(ctx, a, va), EPJ_OK);
		ck_assert_int_eq(epj_tensor_from_f64(ctx, b, vb), EPJ_OK);
		epj_tensor_set_requires_grad(a, true);
		epj_tensor_set_requires_grad(b, true);
		epj_tensor *y = epj_maximum(ctx, a, b);
		tu_ok(ctx, y);
		double *v = tu_values(ctx, y);
		for (int i = 0; i < 7; i++) {
			ck_assert_msg(
			    isnan(want[i]) ? isnan(v[i]) : v[i] == want[i],
			    "%s maximum[%d] = %g", epj_dtype_name(dt), i, v[i]);
			ck_assert_msg(isnan(want[i]) ||
					  signbit(v[i]) == signbit(want[i]),
				      "%s maximum[%d]: the sign of zero",
				      epj_dtype_name(dt), i);
		}
		free(v);
		epj_tensor *s = epj_sum_all(ctx, y);
		tu_ok(ctx, s);
		ck_assert_int_eq(epj_backward(ctx, s, NULL), EPJ_OK);
		tu_assert_close(ctx, epj_tensor_grad(a), ga, 0, 0,
				"maximum grad a");
		tu_assert_close(ctx, epj_tensor_grad(b), gb, 0, 0,
				"maximum grad b");
		epj_tensor_free(s);
		epj_tensor_free(y);
		epj_tensor_free(a);
		epj_tensor_free(b);
	}
	epj_ctx_free(ctx);
}
END_TEST

static epj_tensor *fn_un(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	return run_un(ctx, user, in[0]);
}

static const un_op pow0 = { "pow_scalar 0", U_POW, G_NORMAL, 0.0 };

START_TEST(test_grad_unary)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[3] = { 3, 5, 7 };
	for (size_t o = 0; o <= sizeof un_ops / sizeof un_ops[0]; o++) {
		const un_op *u =
		    o < sizeof un_ops / sizeof un_ops[0] ? &un_ops[o] : &pow0;
		epj_tensor *x = mk(ctx, EPJ_DTYPE_F64, 3, shape, u->g, o % 2);
		epj_tensor_set_requires_grad(x, true);
		tu_gradcheck(ctx, fn_un, &x, 1, (void *)u, 1e-6, 1e-5, 1e-6,
			     u->name);
		epj_tensor_free(x);
	}
	epj_ctx_free(ctx);
}
END_TEST

static epj_tensor *fn_cast_chain(epj_ctx *ctx, epj_tensor *const *in,
				 void *user)
{
	(void)user;
	return epj_cast(ctx, in[0], EPJ_DTYPE_F64);
}

/* cast's gradient comes back in the input's dtype: f32 input, f64 output;
 * the map is linear, so a wide step (1e-2) makes the f32 rounding of x +/-
 * eps negligible (rtol 1e-3). */
START_TEST(test_grad_cast)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[2] = { 5, 3 };
	epj_tensor *x = mk(ctx, EPJ_DTYPE_F32, 2, shape, G_NORMAL, true);
	epj_tensor_set_requires_grad(x, true);
	tu_gradcheck(ctx, fn_cast_chain, &x, 1, NULL, 1e-2, 1e-3, 1e-4, "cast");
	ck_assert_int_eq(epj_tensor_dtype(epj_tensor_grad(x)), EPJ_DTYPE_F32);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* silu/gelu backward helpers in f32 and bf16 against the analytic
 * derivatives in double (tolerances of the forward tables). */
START_TEST(test_silu_gelu_backward)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[2] = { 7, 9 };
	for (int d = 0; d < 3; d++)
		for (int which = 0; which < 2; which++) {
			epj_dtype dt = float_dtypes[d];
			epj_tensor *x = mk(ctx, dt, 2, shape, G_NORMAL, d == 0);
			epj_tensor_set_requires_grad(x, true);
			epj_tensor *y =
			    which ? epj_gelu(ctx, x) : epj_silu(ctx, x);
			epj_tensor *l = epj_sum_all(ctx, y);
			tu_ok(ctx, l);
			ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
			double *v = tu_values(ctx, x);
			for (int i = 0; i < 63; i++) {
				double s = sigmoid_ref(v[i]);
				double cdf = 0.5 * erfc(-v[i] / sqrt(2.0));
				double pdf = exp(-0.5 * v[i] * v[i]) /
					     sqrt(2.0 * 3.141592653589793);
				v[i] = which ? cdf + v[i] * pdf
					     : s * (1 + v[i] * (1 - s));
			}
			double rtol, atol;
			tol_for(dt, &rtol, &atol);
			tu_assert_close(ctx, epj_tensor_grad(x), v, rtol, atol,
					which ? "gelu'" : "silu'");
			free(v);
			epj_tensor_free(l);
			epj_tensor_free(y);
			epj_tensor_free(x);
		}
	epj_ctx_free(ctx);
}
END_TEST

/* The dense conversion loops (built per instruction set, lib/dtype.c) give
 * the bits of the scalar conversions: ties, NaN payloads, subnormals,
 * infinities, the largest finite values, at lengths with vector tails and
 * from unaligned starts. */
START_TEST(test_cvt_bits)
{
	static const uint32_t special[] = {
		0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu,
		0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f7fffffu,
		0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u,
		0x7f800001u, 0xffa5a5a5u, 0x7fbfffffu, 0x00008000u,
	};
	for (int rep = 0; rep < 8; rep++) {
		int64_t n = tu_randint(1, 300);
		int64_t skew = tu_randint(0, 7);
		float *f = malloc(sizeof *f * (size_t)(n + skew));
		uint16_t *b = malloc(sizeof *b * (size_t)(n + skew));
		float *back = malloc(sizeof *back * (size_t)(n + skew));
		ck_assert(f && b && back);
		for (int64_t i = 0; i < n; i++) {
			uint32_t u =
			    tu_randint(0, 3) == 0
				? special[tu_randint(0, 15)]
				: (uint32_t)tu_randint(0, 0xffffffffLL);
			memcpy(&f[skew + i], &u, sizeof u);
		}
		ej_cvt_f32_to_bf16(f + skew, b + skew, n);
		ej_cvt_bf16_to_f32(b + skew, back + skew, n);
		for (int64_t i = 0; i < n; i++) {
			ck_assert_uint_eq(b[skew + i],
					  epj_f32_to_bf16(f[skew + i]));
			float want = epj_bf16_to_f32(b[skew + i]);
			ck_assert_int_eq(
			    memcmp(&back[skew + i], &want, sizeof want), 0);
		}
		free(f);
		free(b);
		free(back);
	}
}
END_TEST

/* ---- the 8-lane exp of ops_vexp.h ---------------------------------------
 * Against exp in double rounded to f32 (the correctly rounded result but
 * for double rounding, far rarer than the 1 ulp allowed): at most 1 ulp on
 * a window of 2^20 consecutive floats at a random place in [-87.3, 88.72],
 * 2^18 random points, both ends and the integers; then the edges: 0 below
 * -87.3, +inf from the overflow threshold, NaN kept, every lane alike. */

/* the clone the library's callers get on this CPU */
EJ_V8_CLONES static void vexp8(float *x)
{
	ej_v8f v;
	memcpy(&v, x, sizeof v);
	ej_v8_exp(&v);
	memcpy(x, &v, sizeof v);
}

/* ulps between two finite floats of one sign or zero */
static int64_t ulp_dist(float a, float b)
{
	int32_t ia, ib;
	memcpy(&ia, &a, sizeof ia);
	memcpy(&ib, &b, sizeof ib);
	return ia > ib ? (int64_t)ia - ib : (int64_t)ib - ia;
}

/* lib/ops_expf.h's scalar exp, the one of the op table and generated C */
EJ_EXPF_DEFINE(static)

/* The worst ulp distance of the vector exp from exp in double; the scalar
 * exp gives the vector's bits (NaN for NaN) lane by lane. */
static int64_t vexp_worst(const float *x, int64_t n, float *at)
{
	int64_t worst = 0;
	for (int64_t i = 0; i < n; i += 8) {
		float v[8];
		for (int l = 0; l < 8; l++)
			v[l] = x[i + l < n ? i + l : n - 1];
		float in[8];
		memcpy(in, v, sizeof in);
		vexp8(v);
		for (int l = 0; l < 8; l++) {
			float sc = ej_expf(in[l]);
			ck_assert_msg((isnan(sc) && isnan(v[l])) ||
					  memcmp(&sc, &v[l], sizeof sc) == 0,
				      "exp(%.9g): %.9g scalar, %.9g vector",
				      in[l], sc, v[l]);
			int64_t d = ulp_dist(v[l], (float)exp((double)in[l]));
			if (d > worst) {
				worst = d;
				*at = in[l];
			}
		}
	}
	return worst;
}

START_TEST(test_vexp)
{
	const float lo = EJ_VEXP_UNDERFLOW;
	const float hi = nextafterf(EJ_VEXP_OVERFLOW, 0.0f);
	const int64_t n = (int64_t)1 << 20;
	float *x = malloc(sizeof *x * (size_t)n);
	float at = 0;
	/* a window of consecutive floats */
	float f = (float)tu_uniform(lo, hi);
	for (int64_t i = 0; i < n; i++) {
		x[i] = f < hi ? f : hi;
		f = nextafterf(f, INFINITY);
	}
	int64_t w = vexp_worst(x, n, &at);
	ck_assert_msg(w <= 1, "vexp: %lld ulp at %.9g (window, seed %llu)",
		      (long long)w, at, (unsigned long long)tu_seed());
	/* random points, the ends, the integers */
	const int64_t m = (int64_t)1 << 18;
	for (int64_t i = 0; i < m; i++)
		x[i] = (float)tu_uniform(lo, hi);
	x[0] = lo;
	x[1] = hi;
	for (int k = -87; k <= 88; k++)
		x[2 + k + 87] = (float)k;
	w = vexp_worst(x, m, &at);
	ck_assert_msg(w <= 1, "vexp: %lld ulp at %.9g (points, seed %llu)",
		      (long long)w, at, (unsigned long long)tu_seed());
	free(x);
	/* the edges */
	float e[8] = { nextafterf(lo, -INFINITY),
		       -1000.0f,
		       -INFINITY,
		       EJ_VEXP_OVERFLOW,
		       1000.0f,
		       INFINITY,
		       NAN,
		       0.0f };
	float es[8];
	for (int l = 0; l < 8; l++)
		es[l] = ej_expf(e[l]);
	vexp8(e);
	for (int l = 0; l < 8; l++)
		ck_assert_msg((isnan(es[l]) && isnan(e[l])) ||
				  memcmp(&es[l], &e[l], sizeof e[l]) == 0,
			      "edge lane %d: %g scalar, %g vector", l, es[l],
			      e[l]);
	for (int l = 0; l < 3; l++)
		ck_assert_msg(e[l] == 0 && !signbit(e[l]), "lane %d: %g", l,
			      e[l]);
	for (int l = 3; l < 6; l++)
		ck_assert_msg(isinf(e[l]) && e[l] > 0, "lane %d: %g", l, e[l]);
	ck_assert(isnan(e[6]));
	ck_assert(e[7] == 1.0f);
	float top[8] = { hi, hi, hi, hi, hi, hi, hi, hi };
	vexp8(top);
	ck_assert_msg(isfinite(top[0]) && top[0] > 3.4e38f, "exp(%.9g) = %g",
		      hi, top[0]);
	/* one value in each lane gives one result */
	const float v = (float)tu_uniform(-20, 20);
	float ref[8] = { v, v, v, v, v, v, v, v };
	vexp8(ref);
	for (int l = 0; l < 8; l++) {
		float y[8] = { 0, -3, 7, 0.5f, -80, 80, 1, 2 };
		y[l] = v;
		vexp8(y);
		ck_assert(y[l] == ref[0]);
	}
}
END_TEST

Suite *make_ops_pointwise_suite(void)
{
	Suite *s = suite_create("ops_pointwise");
	TCase *tc = tcase_create("forward");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_binary_broadcast);
	tcase_add_test(tc, test_binary_large);
	tcase_add_test(tc, test_unary);
	tcase_add_test(tc, test_unary_special);
	tcase_add_test(tc, test_int_ops);
	tcase_add_test(tc, test_cast_values);
	tcase_add_test(tc, test_cast_bf16);
	tcase_add_test(tc, test_cvt_bits);
	tcase_add_test(tc, test_where);
	tcase_add_test(tc, test_maximum_special);
	tcase_add_test(tc, test_errors);
	suite_add_tcase(s, tc);
	TCase *tv = tcase_create("vexp");
	tcase_set_timeout(tv, 60);
	tcase_add_test(tv, test_vexp);
	suite_add_tcase(s, tv);
	TCase *tg = tcase_create("grad");
	tcase_set_timeout(tg, 60);
	tcase_add_test(tg, test_grad_binary);
	tcase_add_test(tg, test_grad_unary);
	tcase_add_test(tg, test_grad_cast);
	tcase_add_test(tg, test_silu_gelu_backward);
	tcase_add_test(tg, test_grad_where);
	tcase_add_test(tg, test_grad_maximum);
	suite_add_tcase(s, tg);
	return s;
}
