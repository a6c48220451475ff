/* check_ops_reduce.c -- reductions: sum, mean, amax, max (+ argmax),
 * sum_all, sum_to, softmax, log_softmax.
 *
 * Every forward result is compared with a double-precision reference
 * written here (plain loops over row-major values read with tu_values), on
 * fresh random inputs of odd sizes, every axis (also given negative), with
 * and without keepdim, contiguous and not (tu_noncontig), and in sizes that
 * reach the kernels' row, column, general and multi-threaded paths.
 * Tolerances, |got - ref| <= atol + rtol|ref|:
 *  - sums, f64:  rtol 1e-12, atol 1e-12 -- only summation order differs;
 *  - sums, f32:  rtol 1e-5, atol 1e-5 -- accumulated in double, one f32
 *                rounding of the result (atol for sums that cancel);
 *  - sums, bf16: rtol 1e-2, atol 1e-2 -- one bf16 rounding (2^-9);
 *  - amax/max:   exact -- the result is one of the inputs; indices exact;
 *  - softmax:    f64 rtol 1e-12 atol 1e-15; f32 rtol 1e-5 atol 1e-7 (expf
 *                ulps); bf16 rtol 1e-2 atol 1e-3 (computed in f32, one
 *                bf16 rounding).  log_softmax uses atol 1e-6 in f32.
 * Gradients: tu_gradcheck in f64 with eps 1e-6, rtol 1e-5, atol 1e-6;
 * amax/max inputs are random normals, so ties have probability zero.
 */
#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers -------------------------------------------------------------
 */

static const epj_dtype float_dtypes[] = { EPJ_DTYPE_F32, EPJ_DTYPE_F64,
					  EPJ_DTYPE_BF16 };

/* Random normal tensor (scaled), non-contiguous when nc and nd >= 1. */
static epj_tensor *mk(epj_ctx *ctx, epj_dtype dt, int nd, const int64_t *shape,
		      double scale, bool nc)
{
	epj_tensor *t = tu_randn(ctx, dt, nd, shape);
	if (scale != 1.0) {
		epj_tensor *u = epj_mul_scalar(ctx, t, scale);
		tu_ok(ctx, u);
		epj_tensor_free(t);
		t = u;
	}
	return tu_maybe_noncontig(ctx, t, nc);
}

static void sum_tol(epj_dtype dt, double *rtol, double *atol)
{
	if (dt == EPJ_DTYPE_F64)
		*rtol = 1e-12, *atol = 1e-12;
	else if (dt == EPJ_DTYPE_BF16)
		*rtol = 1e-2, *atol = 1e-2;
	else
		*rtol = 1e-5, *atol = 1e-5;
}

/* ---- axis reductions -----------------------------------------------------
 */

enum rk { R_SUM, R_MEAN, R_AMAX, R_MAX };
static const char *const rk_name[] = { "sum", "mean", "amax", "max" };

/* Reference over axis of row-major v: out[o * inner + j] (and arg) with
 * the first maximum, a NaN winning at its first position. */
static void ref_reduce(const double *v, int nd, const int64_t *shape, int axis,
		       enum rk k, double *out, int64_t *arg)
{
	int64_t outer = tu_numel(axis, shape), r_n = shape[axis];
	int64_t inner = tu_numel(nd - axis - 1, shape + axis + 1);
	for (int64_t o = 0; o < outer; o++)
		for (int64_t j = 0; j < inner; j++) {
			double acc = k <= R_MEAN ? 0 : -INFINITY;
			int64_t best = 0;
			for (int64_t r = 0; r < r_n; r++) {
				double x = v[(o * r_n + r) * inner + j];
				if (k <= R_MEAN) {
					acc += x;
				} else if (isnan(x)) {
					if (!isnan(acc)) {
						acc = x;
						best = r;
					}
				} else if (!isnan(acc) && (r == 0 || x > acc)) {
					acc = x;
					best = r;
				}
			}
			if (k == R_MEAN)
				acc /= (double)r_n;
			out[o * inner + j] = acc;
			if (arg)
				arg[o * inner + j] = best;
		}
}

/* Runs reduction k of x along axis (passed as given, maybe negative) and
 * checks shape, values and (max) indices. */
static void check_reduce(epj_ctx *ctx, epj_tensor *x, enum rk k, int axis,
			 bool keep)
{
	int nd = epj_tensor_ndim(x);
	int ax = axis < 0 ? axis + nd : axis;
	epj_dtype dt = epj_tensor_dtype(x);
	epj_tensor *y = NULL, *idx = NULL;
	switch (k) {
	case R_SUM:
		y = epj_sum(ctx, x, axis, keep);
		break;
	case R_MEAN:
		y = epj_mean(ctx, x, axis, keep);
		break;
	case R_AMAX:
		y = epj_amax(ctx, x, axis, keep);
		break;
	case R_MAX:
		ck_assert_int_eq(epj_max(ctx, x, axis, keep, &y, &idx), EPJ_OK);
		break;
	}
	tu_ok(ctx, y);
	ck_assert_int_eq(epj_tensor_dtype(y), dt);
	int64_t shape[8] = { 0 };
	int ond = 0;
	for (int d = 0; d < nd; d++)
		if (d != ax || keep)
			shape[ond++] = d == ax ? 1 : epj_tensor_dim(x, d);
	tu_assert_shape(y, ond, shape);
	double *v = tu_values(ctx, x);
	int64_t n = tu_numel(ond, shape);
	double *ref = malloc(sizeof *ref * (size_t)(n + 1));
	int64_t *arg = malloc(sizeof *arg * (size_t)(n + 1));
	ref_reduce(v, nd, epj_tensor_shape(x), ax, k, ref, arg);
	double rtol = 0, atol = 0;
	if (k <= R_MEAN)
		sum_tol(dt, &rtol, &atol);
	char what[96];
	snprintf(what, sizeof what, "%s %s axis %d keep %d", rk_name[k],
		 epj_dtype_name(dt), axis, keep);
	tu_assert_close(ctx, y, ref, rtol, atol, what);
	if (idx) {
		ck_assert_int_eq(epj_tensor_dtype(idx), EPJ_DTYPE_I64);
		tu_assert_shape(idx, ond, shape);
		for (int64_t i = 0; i < n; i++)
			ref[i] = (double)arg[i];
		tu_assert_close(ctx, idx, ref, 0, 0, what);
	}
	free(arg);
	free(ref);
	free(v);
	epj_tensor_free(idx);
	epj_tensor_free(y);
}

static const int64_t red_shapes[][3] = {
	{ 5, 7, 3 }, { 13, 0, 0 }, { 3, 1, 5 }, { 4, 9, 0 }
};
static const int red_nds[] = { 3, 1, 3, 2 };

START_TEST(test_reduce_axes)
{
	epj_ctx *ctx = tu_ctx();
	for (int k = R_SUM; k <= R_MAX; k++)
		for (int d = 0; d < 3; d++)
			for (int s = 0; s < 4; s++)
				for (int nc = 0; nc < 2; nc++) {
					int nd = red_nds[s];
					epj_tensor *x =
					    mk(ctx, float_dtypes[d], nd,
					       red_shapes[s], 1.0, nc);
					for (int ax = 0; ax < nd; ax++)
						for (int keep = 0; keep < 2;
						     keep++)
							check_reduce(
							    ctx, x, (enum rk)k,
							    (ax + keep) % 2
								? ax - nd
								: ax,
							    keep);
					epj_tensor_free(x);
				}
	epj_ctx_free(ctx);
}
END_TEST

/* Sizes over the threading threshold, the column path's block size and
 * rows long enough for the lane split: [211, 199] over each axis. */
START_TEST(test_reduce_large)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[2] = { 211, 1025 + 2 * tu_randint(0, 5) };
	for (int nc = 0; nc < 2; nc++) {
		epj_tensor *x = mk(ctx, EPJ_DTYPE_F32, 2, shape, 1.0, nc);
		for (int k = R_SUM; k <= R_MAX; k++)
			for (int ax = 0; ax < 2; ax++)
				check_reduce(ctx, x, (enum rk)k, ax, false);
		epj_tensor_free(x);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* max/amax: ties go to the first index; NaN propagates with its index. */
START_TEST(test_max_ties_nan)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[2] = { 5, 9 };
	epj_tensor *x = epj_randint(ctx, EPJ_DTYPE_I64, 2, shape, -2, 2);
	tu_ok(ctx, x);
	epj_tensor *xf = epj_cast(ctx, x, EPJ_DTYPE_F32);
	tu_ok(ctx, xf);
	for (int ax = 0; ax < 2; ax++) {
		check_reduce(ctx, x, R_MAX, ax, false); /* integer max */
		check_reduce(ctx, x, R_AMAX, ax, true);
		check_reduce(ctx, x, R_SUM, ax, false); /* integer sum */
	}
	epj_tensor_set_f64(xf, 9 + 3, NAN);
	epj_tensor_set_f64(xf, 9 + 6, NAN);
	epj_tensor_set_f64(xf, 4 * 9 + 8, NAN);
	epj_tensor *xn = tu_noncontig(ctx, xf);
	for (int ax = 0; ax < 2; ax++)
		for (int nc = 0; nc < 2; nc++) {
			check_reduce(ctx, nc ? xn : xf, R_MAX, ax, ax);
			check_reduce(ctx, nc ? xn : xf, R_AMAX, ax, false);
		}
	epj_tensor_free(xn);
	epj_tensor_free(xf);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* Empty axes, 0-d inputs. */
START_TEST(test_reduce_edges)
{
	epj_ctx *ctx = tu_ctx();
	int64_t s30[2] = { 3, 0 };
	epj_tensor *e = epj_zeros(ctx, EPJ_DTYPE_F32, 2, s30);
	tu_ok(ctx, e);
	epj_tensor *s = epj_sum(ctx, e, 1, false);
	epj_tensor *m = epj_mean(ctx, e, 1, false);
	tu_ok(ctx, s);
	tu_ok(ctx, m);
	const double zeros[3] = { 0, 0, 0 }, nans[3] = { NAN, NAN, NAN };
	tu_assert_close(ctx, s, zeros, 0, 0, "sum over empty axis");
	tu_assert_close(ctx, m, nans, 0, 0, "mean over empty axis");
	tu_assert_error(ctx, epj_amax(ctx, e, 1, false), EPJ_ERR_SHAPE,
			TU_STRS("amax", "size 0"));
	epj_tensor_free(s);
	epj_tensor_free(m);
	epj_tensor_free(e);

	double v = tu_uniform(-3, 3);
	int64_t none[1] = { 0 };
	epj_tensor *z = epj_full(ctx, EPJ_DTYPE_F64, 0, none, v);
	tu_ok(ctx, z);
	epj_tensor *zs = epj_sum(ctx, z, -1, false);
	epj_tensor *za = epj_sum_all(ctx, z);
	epj_tensor *zm = epj_softmax(ctx, z, 0);
	tu_ok(ctx, zs);
	tu_ok(ctx, za);
	tu_ok(ctx, zm);
	ck_assert_int_eq(epj_tensor_ndim(zs), 0);
	const double one = 1.0;
	tu_assert_close(ctx, zs, &v, 0, 0, "sum of 0-d");
	tu_assert_close(ctx, za, &v, 0, 0, "sum_all of 0-d");
	tu_assert_close(ctx, zm, &one, 0, 0, "softmax of 0-d");
	/* 0-d max/amax: the element, index 0, gradient 1 */
	epj_tensor_set_requires_grad(z, true);
	epj_tensor *mv = NULL, *mi = NULL;
	ck_assert_int_eq(epj_max(ctx, z, 0, true, &mv, &mi), EPJ_OK);
	epj_tensor *am = epj_amax(ctx, z, -1, false);
	tu_ok(ctx, am);
	const double zero = 0.0;
	tu_assert_close(ctx, mv, &v, 0, 0, "max of 0-d");
	tu_assert_close(ctx, mi, &zero, 0, 0, "argmax of 0-d");
	tu_assert_close(ctx, am, &v, 0, 0, "amax of 0-d");
	epj_tensor *l = epj_add(ctx, mv, am);
	tu_ok(ctx, l);
	ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
	const double two = 2.0;
	tu_assert_close(ctx, epj_tensor_grad(z), &two, 0, 0, "0-d max grad");
	epj_tensor_free(l);
	epj_tensor_free(am);
	epj_tensor_free(mv);
	epj_tensor_free(mi);
	epj_tensor_free(zs);
	epj_tensor_free(za);
	epj_tensor_free(zm);
	epj_tensor_free(z);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- sum_all / sum_to ----------------------------------------------------
 */

/* Sums x into target (right-aligned broadcast) in double. */
static double *ref_sum_to(epj_ctx *ctx, epj_tensor *x, int nt, const int64_t *t)
{
	int nd = epj_tensor_ndim(x);
	const int64_t *sh = epj_tensor_shape(x);
	double *v = tu_values(ctx, x);
	double *out = calloc((size_t)tu_numel(nt, t) + 1, sizeof *out);
	int64_t idx[8] = { 0 };
	for (int64_t i = 0; i < tu_numel(nd, sh); i++) {
		int64_t f = 0;
		for (int k = 0; k < nt; k++)
			f = f * t[k] + (t[k] == 1 ? 0 : idx[nd - nt + k]);
		out[f] += v[i];
		tu_next_index(nd, sh, idx);
	}
	free(v);
	return out;
}

static void check_sum_to(epj_ctx *ctx, epj_tensor *x, int nt, const int64_t *t)
{
	epj_dtype dt = epj_tensor_dtype(x);
	epj_tensor *y = epj_sum_to(ctx, x, nt, t);
	tu_ok(ctx, y);
	tu_assert_shape(y, nt, t);
	ck_assert_int_eq(epj_tensor_dtype(y), dt);
	double *ref = ref_sum_to(ctx, x, nt, t);
	double rtol, atol;
	sum_tol(dt, &rtol, &atol);
	tu_assert_close(ctx, y, ref, rtol, atol, "sum_to");
	free(ref);
	epj_tensor_free(y);
}

START_TEST(test_sum_to)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[3] = { 5, 3, 7 };
	const int64_t targets[][3] = { { 3, 1 },    { 7 },   { 1, 1, 1 },
				       { 5, 1, 7 }, { 0 },   { 1, 3, 1 },
				       { 3, 7 },    { 1, 7 } };
	const int nts[] = { 2, 1, 3, 3, 0, 3, 2, 2 };
	for (int d = 0; d < 3; d++)
		for (int nc = 0; nc < 2; nc++) {
			epj_tensor *x =
			    mk(ctx, float_dtypes[d], 3, shape, 1.0, nc);
			for (size_t k = 0; k < sizeof nts / sizeof nts[0]; k++)
				check_sum_to(ctx, x, nts[k], targets[k]);
			epj_tensor *same = epj_sum_to(ctx, x, 3, shape);
			ck_assert_ptr_eq(same, x); /* identity: a new ref */
			epj_tensor_free(same);
			epj_tensor_free(x);
		}
	/* the column path: [R, D] -> [D] with D over one block, threaded */
	int64_t big[3] = { 3, 13, 1031 }, tb[2] = { 1, 1031 };
	for (int nc = 0; nc < 2; nc++) {
		epj_tensor *x = mk(ctx, EPJ_DTYPE_F32, 3, big, 1.0, nc);
		check_sum_to(ctx, x, 1, tb + 1);
		check_sum_to(ctx, x, 2, tb);
		epj_tensor_free(x);
	}
	int64_t big2[2] = { 37, 1031 };
	epj_tensor *x = mk(ctx, EPJ_DTYPE_F32, 2, big2, 1.0, false);
	check_sum_to(ctx, x, 1, tb + 1);
	epj_tensor_free(x);

	/* integers sum exactly */
	epj_tensor *xi = epj_randint(ctx, EPJ_DTYPE_I32, 3, shape, -50, 50);
	tu_ok(ctx, xi);
	epj_tensor *yi = epj_sum_to(ctx, xi, 2, targets[0]);
	tu_ok(ctx, yi);
	double *ref = ref_sum_to(ctx, xi, 2, targets[0]);
	tu_assert_close(ctx, yi, ref, 0, 0, "sum_to i32");
	free(ref);
	epj_tensor_free(yi);
	epj_tensor_free(xi);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_sum_all)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t shapes[][2] = { { 5, 7 }, { 13, 1 }, { 211, 199 } };
	for (int d = 0; d < 3; d++)
		for (int s = 0; s < 3; s++)
			for (int nc = 0; nc < 2; nc++) {
				epj_tensor *x = mk(ctx, float_dtypes[d], 2,
						   shapes[s], 1.0, nc);
				epj_tensor *y = epj_sum_all(ctx, x);
				tu_ok(ctx, y);
				ck_assert_int_eq(epj_tensor_ndim(y), 0);
				double *ref = ref_sum_to(ctx, x, 0, NULL);
				double rtol, atol;
				sum_tol(float_dtypes[d], &rtol, &atol);
				tu_assert_close(ctx, y, ref, rtol, atol,
						"sum_all");
				free(ref);
				epj_tensor_free(y);
				epj_tensor_free(x);
			}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- softmax -------------------------------------------------------------
 */

static void check_softmax(epj_ctx *ctx, epj_tensor *x, int axis, bool logsm)
{
	int nd = epj_tensor_ndim(x);
	int ax = axis < 0 ? axis + nd : axis;
	epj_dtype dt = epj_tensor_dtype(x);
	epj_tensor *y =
	    logsm ? epj_log_softmax(ctx, x, axis) : epj_softmax(ctx, x, axis);
	tu_ok(ctx, y);
	ck_assert_int_eq(epj_tensor_dtype(y), dt);
	const int64_t *sh = epj_tensor_shape(x);
	tu_assert_shape(y, nd, sh);
	double *v = tu_values(ctx, x);
	int64_t outer = tu_numel(ax, sh), rn = sh[ax];
	int64_t inner = tu_numel(nd - ax - 1, sh + ax + 1);
	for (int64_t o = 0; o < outer; o++)
		for (int64_t j = 0; j < inner; j++) {
			double m = -INFINITY, s = 0;
			for (int64_t r = 0; r < rn; r++)
				m = fmax(m, v[(o * rn + r) * inner + j]);
			for (int64_t r = 0; r < rn; r++)
				s += exp(v[(o * rn + r) * inner + j] - m);
			for (int64_t r = 0; r < rn; r++) {
				double *p = &v[(o * rn + r) * inner + j];
				*p = logsm ? *p - m - log(s) : exp(*p - m) / s;
			}
		}
	double rtol = 1e-5, atol = logsm ? 1e-6 : 1e-7;
	if (dt == EPJ_DTYPE_F64)
		rtol = 1e-12, atol = 1e-15;
	else if (dt == EPJ_DTYPE_BF16)
		rtol = 1e-2, atol = 1e-3;
	char what[96];
	snprintf(what, sizeof what, "%s %s axis %d",
		 logsm ? "log_softmax" : "softmax", epj_dtype_name(dt), axis);
	tu_assert_close(ctx, y, v, rtol, atol, what);
	free(v);
	epj_tensor_free(y);
}

START_TEST(test_softmax)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t shapes[][3] = { { 5, 7, 3 }, { 13, 37, 0 }, { 1, 9, 1 } };
	const int nds[] = { 3, 2, 3 };
	for (int logsm = 0; logsm < 2; logsm++)
		for (int d = 0; d < 3; d++)
			for (int s = 0; s < 3; s++)
				for (int nc = 0; nc < 2; nc++) {
					/* scale 30: exp overflows in f32
					 * unless the max is subtracted */
					epj_tensor *x =
					    mk(ctx, float_dtypes[d], nds[s],
					       shapes[s], nc ? 30.0 : 1.0, nc);
					for (int ax = 0; ax < nds[s]; ax++)
						check_softmax(
						    ctx, x,
						    ax % 2 ? ax - nds[s] : ax,
						    logsm);
					epj_tensor_free(x);
				}
	/* threaded: long rows (fast path) and a strided axis (row buffers) */
	int64_t rows[2] = { 3, 20001 }, cols[2] = { 37, 1001 };
	for (int logsm = 0; logsm < 2; logsm++) {
		epj_tensor *x = mk(ctx, EPJ_DTYPE_F32, 2, rows, 3.0, false);
		check_softmax(ctx, x, 1, logsm);
		epj_tensor_free(x);
		x = mk(ctx, EPJ_DTYPE_F32, 2, cols, 3.0, false);
		check_softmax(ctx, x, 0, logsm);
		epj_tensor_free(x);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- errors --------------------------------------------------------------
 */

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[3] = { 5, 3, 7 }, bad[1] = { 4 },
		more[4] = { 2, 5, 3, 7 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, shape);
	epj_tensor *xi = epj_randint(ctx, EPJ_DTYPE_I32, 3, shape, 0, 5);
	tu_ok(ctx, xi);
	tu_assert_error(ctx, epj_sum(ctx, x, 3, false), EPJ_ERR_INVALID,
			TU_STRS("sum", "axis 3"));
	tu_assert_error(ctx, epj_amax(ctx, x, -4, true), EPJ_ERR_INVALID,
			TU_STRS("amax", "axis -4"));
	tu_assert_error(ctx, epj_softmax(ctx, x, 5), EPJ_ERR_INVALID,
			TU_STRS("softmax", "[5,3,7]"));
	tu_assert_error(ctx, epj_log_softmax(ctx, xi, 0), EPJ_ERR_DTYPE,
			TU_STRS("log_softmax", "i32"));
	tu_assert_error(ctx, epj_mean(ctx, xi, 0, false), EPJ_ERR_DTYPE,
			TU_STRS("mean", "i32"));
	tu_assert_error(ctx, epj_sum_to(ctx, x, 1, bad), EPJ_ERR_SHAPE,
			TU_STRS("sum_to", "[4]"));
	tu_assert_error(ctx, epj_sum_to(ctx, x, 4, more), EPJ_ERR_SHAPE,
			TU_STRS("sum_to", "[2,5,3,7]"));
	epj_tensor *v = NULL, *i = NULL;
	ck_assert_int_eq(epj_max(ctx, x, 7, false, &v, &i), EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID, TU_STRS("max", "axis 7"));
	ck_assert_ptr_null(v);
	ck_assert_ptr_null(i);
	ck_assert_int_eq(epj_max(ctx, x, 0, false, NULL, &i), EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID, TU_STRS("max"));
	/* NULL input propagates */
	ck_assert_ptr_null(epj_sum(ctx, NULL, 0, false));
	ck_assert_ptr_null(epj_sum_to(ctx, NULL, 1, bad));
	ck_assert_ptr_null(epj_softmax(ctx, NULL, 0));
	epj_tensor_free(xi);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- gradients -----------------------------------------------------------
 */

typedef struct red_case {
	int kind; /* enum rk, or 4 sum_all, 5 sum_to, 6 softmax, 7 log_sm */
	int axis;
	bool keep;
	int nt;
	int64_t t[3];
} red_case;

static epj_tensor *fn_red(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	const red_case *rc = user;
	epj_tensor *y = NULL, *idx = NULL;
	switch (rc->kind) {
	case R_SUM:
		return epj_sum(ctx, in[0], rc->axis, rc->keep);
	case R_MEAN:
		return epj_mean(ctx, in[0], rc->axis, rc->keep);
	case R_AMAX:
		return epj_amax(ctx, in[0], rc->axis, rc->keep);
	case R_MAX:
		epj_max(ctx, in[0], rc->axis, rc->keep, &y, &idx);
		epj_tensor_free(idx);
		return y;
	case 4:
		return epj_sum_all(ctx, in[0]);
	case 5:
		return epj_sum_to(ctx, in[0], rc->nt, rc->t);
	case 6:
		return epj_softmax(ctx, in[0], rc->axis);
	default:
		return epj_log_softmax(ctx, in[0], rc->axis);
	}
}

START_TEST(test_grad)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[3] = { 3, 5, 7 };
	for (int kind = 0; kind < 8; kind++)
		for (int axis = -1; axis < 3; axis++)
			for (int keep = 0; keep < 2; keep++) {
				if ((kind == 4 || kind == 5) && axis > 0)
					continue;
				if (kind >= 4 && keep)
					continue;
				red_case rc = { kind, axis, keep, 2, { 5, 1 } };
				if (axis == 0)
					rc.nt = 1, rc.t[0] = 7;
				epj_tensor *x = mk(ctx, EPJ_DTYPE_F64, 3, shape,
						   1.0, (axis + keep) % 2);
				epj_tensor_set_requires_grad(x, true);
				char what[64];
				snprintf(what, sizeof what,
					 "grad kind %d axis %d keep %d", kind,
					 axis, keep);
				tu_gradcheck(ctx, fn_red, &x, 1, &rc, 1e-6,
					     1e-5, 1e-6, what);
				epj_tensor_free(x);
			}
	epj_ctx_free(ctx);
}
END_TEST

/* amax splits the gradient evenly among ties; max gives it to the first. */
START_TEST(test_grad_ties)
{
	epj_ctx *ctx = tu_ctx();
	const double v[6] = { 1, 3, 3, 2, 3, 0 };
	int64_t n = 6;
	for (int which = 0; which < 2; which++) {
		epj_tensor *x =
		    epj_tensor_from_data(ctx, EPJ_DTYPE_F64, 1, &n, v);
		tu_ok(ctx, x);
		epj_tensor_set_requires_grad(x, true);
		epj_tensor *y = NULL, *idx = NULL;
		if (which)
			ck_assert_int_eq(epj_max(ctx, x, 0, false, &y, &idx),
					 EPJ_OK);
		else
			y = epj_amax(ctx, x, 0, false);
		tu_ok(ctx, y);
		ck_assert_int_eq(epj_backward(ctx, y, NULL), EPJ_OK);
		const double ga[6] = { 0, 1.0 / 3, 1.0 / 3, 0, 1.0 / 3, 0 };
		const double gm[6] = { 0, 1, 0, 0, 0, 0 };
		tu_assert_close(ctx, epj_tensor_grad(x), which ? gm : ga, 1e-15,
				0, which ? "max ties" : "amax ties");
		epj_tensor_free(idx);
		epj_tensor_free(y);
		epj_tensor_free(x);
	}
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_ops_reduce_suite(void)
{
	Suite *s = suite_create("ops_reduce");
	TCase *tc = tcase_create("forward");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_reduce_axes);
	tcase_add_test(tc, test_reduce_large);
	tcase_add_test(tc, test_max_ties_nan);
	tcase_add_test(tc, test_reduce_edges);
	tcase_add_test(tc, test_sum_to);
	tcase_add_test(tc, test_sum_all);
	tcase_add_test(tc, test_softmax);
	tcase_add_test(tc, test_errors);
	suite_add_tcase(s, tc);
	TCase *tg = tcase_create("grad");
	tcase_set_timeout(tg, 60);
	tcase_add_test(tg, test_grad);
	tcase_add_test(tg, test_grad_ties);
	suite_add_tcase(s, tg);
	return s;
}
