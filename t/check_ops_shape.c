/* check_ops_shape.c -- shape and movement ops: reshape, transpose, permute,
 * slice, expand, contiguous, cat, split, full/zeros.
 *
 * Every forward result is compared against an index-mapping reference
 * written here with plain loops over row-major values (read with
 * tu_values); inputs are fresh random tensors of odd sizes, also given
 * non-contiguous (tu_noncontig).  Views are checked to share storage in
 * both directions of a write; gradients are checked by finite differences
 * in f64.
 */
#include "check_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- random inputs ---------------------------------------------------- */

/* Random tensor, or its non-contiguous copy (checked to be one) when
 * noncontig; nd >= 1. */
static epj_tensor *rand_input(epj_ctx *ctx, epj_dtype dt, int nd,
			      const int64_t *shape, bool noncontig)
{
	epj_tensor *t = tu_randn_nc(ctx, dt, nd, shape, noncontig);
	if (noncontig)
		ck_assert(!epj_tensor_is_contiguous(t));
	return t;
}

/* ---- reshape ----------------------------------------------------------- */

START_TEST(test_reshape_view)
{
	epj_ctx *ctx = tu_ctx();
	int64_t a_sh[3] = { 3, tu_randint(2, 6) * 2 + 1, 7 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 3, a_sh);
	int64_t n = tu_numel(3, a_sh);
	int64_t want[3] = { 7, -1, 3 };
	epj_tensor *r = epj_reshape(ctx, a, 3, want);
	tu_ok(ctx, r);
	int64_t r_sh[3] = { 7, a_sh[1], 3 };
	tu_assert_shape(r, 3, r_sh);
	ck_assert(epj_tensor_shares_storage(a, r));
	double *va = tu_values(ctx, a);
	tu_assert_close(ctx, r, va, 0, 0, "reshape view values");
	/* write through the view, read in the base; and back */
	int64_t k = tu_randint(0, n);
	epj_tensor_set_f64(r, k, 42.5);
	ck_assert(epj_tensor_get_f64(a, k) == 42.5);
	k = tu_randint(0, n);
	epj_tensor_set_f64(a, k, -3.25);
	ck_assert(epj_tensor_get_f64(r, k) == -3.25);

	/* a row-strided slice keeps rows apart: [3, 5] with row stride 10
	 * views as [3, 1, 5] but must copy to [15] */
	int64_t b_sh[2] = { 6, 5 };
	epj_tensor *b = tu_randn(ctx, EPJ_DTYPE_F32, 2, b_sh);
	epj_tensor *s = epj_slice(ctx, b, 0, 0, 6, 2);
	tu_ok(ctx, s);
	int64_t v_sh[3] = { 3, 1, 5 }, f_sh[1] = { 15 };
	epj_tensor *v = epj_reshape(ctx, s, 3, v_sh);
	epj_tensor *f = epj_reshape(ctx, s, 1, f_sh);
	tu_ok(ctx, v);
	tu_ok(ctx, f);
	ck_assert(epj_tensor_shares_storage(v, b));
	ck_assert(!epj_tensor_shares_storage(f, b));
	double *vs = tu_values(ctx, s);
	tu_assert_close(ctx, v, vs, 0, 0, "reshape of a strided slice");
	tu_assert_close(ctx, f, vs, 0, 0, "reshape copy of a strided slice");

	/* an expanded tensor reshapes as a view with stride 0 */
	int64_t e_sh[2] = { 4, 6 }, e2_sh[3] = { 2, 2, 6 },
		one_sh[2] = { 1, 6 };
	epj_tensor *o = tu_randn(ctx, EPJ_DTYPE_F32, 2, one_sh);
	epj_tensor *e = epj_expand(ctx, o, 2, e_sh);
	epj_tensor *e2 = epj_reshape(ctx, e, 3, e2_sh);
	tu_ok(ctx, e2);
	ck_assert(epj_tensor_shares_storage(e2, o));
	ck_assert_int_eq(epj_tensor_strides(e2)[0], 0);
	ck_assert_int_eq(epj_tensor_strides(e2)[1], 0);
	double *ve = tu_values(ctx, e);
	tu_assert_close(ctx, e2, ve, 0, 0, "reshape of expanded");

	free(va);
	free(vs);
	free(ve);
	epj_tensor_free(a);
	epj_tensor_free(r);
	epj_tensor_free(b);
	epj_tensor_free(s);
	epj_tensor_free(v);
	epj_tensor_free(f);
	epj_tensor_free(o);
	epj_tensor_free(e);
	epj_tensor_free(e2);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_scalar_shapes)
{
	/* 0-dim tensors: reshape to and from [1, 1], expand with new dims */
	epj_ctx *ctx = tu_ctx();
	epj_tensor *s = tu_randn(ctx, EPJ_DTYPE_F64, 0, NULL);
	double v = epj_tensor_get_f64(s, 0);
	int64_t one[2] = { 1, 1 }, big[2] = { 3, tu_randint(2, 8) };
	epj_tensor *r = epj_reshape(ctx, s, 2, one);
	tu_ok(ctx, r);
	ck_assert(epj_tensor_shares_storage(r, s));
	epj_tensor *back = epj_reshape(ctx, r, 0, NULL);
	tu_ok(ctx, back);
	ck_assert_int_eq(epj_tensor_ndim(back), 0);
	ck_assert(epj_tensor_get_f64(back, 0) == v);
	epj_tensor *e = epj_expand(ctx, s, 2, big);
	tu_ok(ctx, e);
	tu_assert_shape(e, 2, big);
	for (int64_t i = 0; i < big[0] * big[1]; i++)
		ck_assert(epj_tensor_get_f64(e, i) == v);
	epj_tensor_free(s);
	epj_tensor_free(r);
	epj_tensor_free(back);
	epj_tensor_free(e);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_reshape_copy_of_transpose)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[2] = { 5, tu_randint(3, 9) * 2 + 1 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	epj_tensor *t = epj_transpose(ctx, a, 0, 1);
	tu_ok(ctx, t);
	int64_t flat[1] = { -1 };
	epj_tensor *r = epj_reshape(ctx, t, 1, flat);
	tu_ok(ctx, r);
	ck_assert(!epj_tensor_shares_storage(r, a));
	ck_assert(epj_tensor_is_contiguous(r));
	/* reference: row-major order of a^T */
	double *va = tu_values(ctx, a);
	double *ref = malloc(sizeof *ref * (size_t)(sh[0] * sh[1]));
	for (int64_t i = 0; i < sh[1]; i++)
		for (int64_t j = 0; j < sh[0]; j++)
			ref[i * sh[0] + j] = va[j * sh[1] + i];
	tu_assert_close(ctx, r, ref, 0, 0, "reshape(transpose)");
	/* the copy is independent of the base */
	epj_tensor_set_f64(a, 0, 1e6);
	ck_assert(epj_tensor_get_f64(r, 0) == ref[0]);

	/* 3-D permuted input flattened pairwise: [A,B,C] -> perm (2,0,1)
	 * -> reshape [C, A*B] is a view (A,B stay adjacent) while
	 * [C*A, B] must copy */
	int64_t s3[3] = { 3, 5, 7 };
	epj_tensor *b = tu_randn(ctx, EPJ_DTYPE_F32, 3, s3);
	int perm[3] = { 2, 0, 1 };
	epj_tensor *p = epj_permute(ctx, b, perm);
	int64_t w1[2] = { 7, 15 }, w2[2] = { 21, 5 };
	epj_tensor *r1 = epj_reshape(ctx, p, 2, w1);
	epj_tensor *r2 = epj_reshape(ctx, p, 2, w2);
	tu_ok(ctx, r1);
	tu_ok(ctx, r2);
	ck_assert(epj_tensor_shares_storage(r1, b));
	ck_assert(!epj_tensor_shares_storage(r2, b));
	double *vp = tu_values(ctx, p);
	tu_assert_close(ctx, r1, vp, 0, 0, "reshape view of permuted");
	tu_assert_close(ctx, r2, vp, 0, 0, "reshape copy of permuted");

	free(va);
	free(ref);
	free(vp);
	epj_tensor_free(a);
	epj_tensor_free(t);
	epj_tensor_free(r);
	epj_tensor_free(b);
	epj_tensor_free(p);
	epj_tensor_free(r1);
	epj_tensor_free(r2);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_reshape_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[2] = { 3, 5 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	int64_t bad[2] = { 4, 4 };
	epj_tensor *r = epj_reshape(ctx, a, 2, bad);
	ck_assert_ptr_null(r);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_SHAPE);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "reshape") && strstr(msg, "[4,4]") &&
			  strstr(msg, "[3,5]"),
		      "message: %s", msg);
	epj_ctx_clear_error(ctx);
	int64_t two[3] = { -1, -1, 15 };
	tu_assert_error(ctx, epj_reshape(ctx, a, 3, two), EPJ_ERR_SHAPE,
			TU_STRS("reshape"));
	int64_t nodiv[2] = { 4, -1 };
	tu_assert_error(ctx, epj_reshape(ctx, a, 2, nodiv), EPJ_ERR_SHAPE,
			TU_STRS("reshape"));
	int64_t zero[2] = { 0, -1 };
	tu_assert_error(ctx, epj_reshape(ctx, a, 2, zero), EPJ_ERR_SHAPE,
			TU_STRS("reshape"));
	int64_t neg[2] = { -3, -5 };
	tu_assert_error(ctx, epj_reshape(ctx, a, 2, neg), EPJ_ERR_SHAPE,
			TU_STRS("reshape"));
	/* NULL propagates without a new message */
	ck_assert_ptr_null(epj_reshape(ctx, NULL, 2, sh));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_OK);
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- transpose / permute --------------------------------------------- */

START_TEST(test_transpose)
{
	epj_ctx *ctx = tu_ctx();
	for (int nc = 0; nc < 2; nc++) {
		int64_t sh[3] = { 3, tu_randint(2, 7), 7 };
		epj_tensor *a = rand_input(ctx, EPJ_DTYPE_F32, 3, sh, nc);
		epj_tensor *t = epj_transpose(ctx, a, -1, 0);
		tu_ok(ctx, t);
		int64_t tsh[3] = { sh[2], sh[1], sh[0] };
		tu_assert_shape(t, 3, tsh);
		ck_assert(epj_tensor_shares_storage(a, t));
		double *va = tu_values(ctx, a);
		int64_t n = tu_numel(3, sh);
		double *ref = malloc(sizeof *ref * (size_t)n);
		for (int64_t f = 0; f < n; f++) {
			int64_t m[3], src[3];
			tu_unflat(f, 3, tsh, m);
			src[0] = m[2];
			src[1] = m[1];
			src[2] = m[0];
			ref[f] = va[tu_flat(3, sh, src)];
		}
		tu_assert_close(ctx, t, ref, 0, 0, "transpose");
		/* write through the transposed view */
		int64_t m[3] = { 1, 0, 2 }, src[3] = { 2, 0, 1 };
		epj_tensor_set_f64(t, tu_flat(3, tsh, m), 7.75);
		ck_assert(epj_tensor_get_f64(a, tu_flat(3, sh, src)) == 7.75);
		free(va);
		free(ref);
		epj_tensor_free(a);
		epj_tensor_free(t);
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_permute)
{
	epj_ctx *ctx = tu_ctx();
	for (int nc = 0; nc < 2; nc++) {
		int64_t sh[4] = { 2, 3, tu_randint(1, 6), 5 };
		int perm[4] = { 0, 1, 2, 3 };
		for (int i = 3; i > 0; i--) { /* random permutation */
			int j = (int)tu_randint(0, i + 1), x = perm[i];
			perm[i] = perm[j];
			perm[j] = x;
		}
		epj_tensor *a = rand_input(ctx, EPJ_DTYPE_F32, 4, sh, nc);
		epj_tensor *p = epj_permute(ctx, a, perm);
		tu_ok(ctx, p);
		int64_t psh[4];
		for (int i = 0; i < 4; i++)
			psh[i] = sh[perm[i]];
		tu_assert_shape(p, 4, psh);
		ck_assert(epj_tensor_shares_storage(a, p));
		double *va = tu_values(ctx, a);
		int64_t n = tu_numel(4, sh);
		double *ref = malloc(sizeof *ref * (size_t)n);
		for (int64_t f = 0; f < n; f++) {
			int64_t m[4], src[4];
			tu_unflat(f, 4, psh, m);
			for (int i = 0; i < 4; i++)
				src[perm[i]] = m[i];
			ref[f] = va[tu_flat(4, sh, src)];
		}
		tu_assert_close(ctx, p, ref, 0, 0, "permute");
		free(va);
		free(ref);
		epj_tensor_free(a);
		epj_tensor_free(p);
	}
	/* bad permutations */
	int64_t sh[3] = { 2, 3, 5 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	int dup[3] = { 0, 1, 1 }, range[3] = { 0, 3, 1 };
	tu_assert_error(ctx, epj_permute(ctx, a, dup), EPJ_ERR_INVALID,
			TU_STRS("permute"));
	tu_assert_error(ctx, epj_permute(ctx, a, range), EPJ_ERR_INVALID,
			TU_STRS("permutation"));
	tu_assert_error(ctx, epj_transpose(ctx, a, 0, 3), EPJ_ERR_INVALID,
			TU_STRS("transpose"));
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- slice / split ------------------------------------------------------ */

static int64_t py_bound(int64_t v, int64_t n)
{
	if (v < 0)
		v = v + n < 0 ? 0 : v + n;
	return v > n ? n : v;
}

START_TEST(test_slice)
{
	epj_ctx *ctx = tu_ctx();
	static const int64_t cases[][3] = {
		{ 0, 13, 1 },	{ -5, -1, 2 }, { 2, 100, 3 },
		{ -100, 4, 1 }, { 7, 3, 1 },   { 12, 13, 5 },
		{ -1, 13, 1 },	{ 1, -2, 4 },  { -13, -13, 1 },
	};
	for (int nc = 0; nc < 2; nc++) {
		int64_t sh[3] = { 3, 13, tu_randint(2, 5) * 2 + 1 };
		epj_tensor *a = rand_input(ctx, EPJ_DTYPE_F32, 3, sh, nc);
		double *va = tu_values(ctx, a);
		for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
			int64_t st = cases[ci][0], en = cases[ci][1],
				step = cases[ci][2];
			epj_tensor *s = epj_slice(ctx, a, 1, st, en, step);
			tu_ok(ctx, s);
			/* reference: python's range over clamped bounds */
			int64_t b = py_bound(st, 13), e = py_bound(en, 13);
			int64_t pick[13], np = 0;
			for (int64_t i = b; i < e; i += step)
				pick[np++] = i;
			int64_t ssh[3] = { sh[0], np, sh[2] };
			tu_assert_shape(s, 3, ssh);
			double *ref = malloc(sizeof *ref *
					     (size_t)(tu_numel(3, ssh) + 1));
			for (int64_t f = 0; f < tu_numel(3, ssh); f++) {
				int64_t m[3];
				tu_unflat(f, 3, ssh, m);
				m[1] = pick[m[1]];
				ref[f] = va[tu_flat(3, sh, m)];
			}
			tu_assert_close(ctx, s, ref, 0, 0, "slice");
			if (np > 0) {
				ck_assert(epj_tensor_shares_storage(a, s));
				/* view <-> base writes */
				int64_t m[3] = { sh[0] - 1, np - 1, 1 };
				epj_tensor_set_f64(s, tu_flat(3, ssh, m), 9.5);
				m[1] = pick[np - 1];
				ck_assert(epj_tensor_get_f64(
					      a, tu_flat(3, sh, m)) == 9.5);
				epj_tensor_set_f64(a, tu_flat(3, sh, m), -1.5);
				m[1] = np - 1;
				ck_assert(epj_tensor_get_f64(
					      s, tu_flat(3, ssh, m)) == -1.5);
				m[1] = pick[np - 1];
				epj_tensor_set_f64(a, tu_flat(3, sh, m),
						   va[tu_flat(3, sh, m)]);
			}
			free(ref);
			epj_tensor_free(s);
		}
		/* negative axis, last dim with a step */
		epj_tensor *s = epj_slice(ctx, a, -1, 1, sh[2], 2);
		tu_ok(ctx, s);
		ck_assert_int_eq(epj_tensor_dim(s, 2), sh[2] / 2);
		ck_assert(epj_tensor_get_f64(s, 0) == va[1]);
		epj_tensor_free(s);
		free(va);
		epj_tensor_free(a);
	}
	int64_t sh[2] = { 3, 5 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	tu_assert_error(ctx, epj_slice(ctx, a, 0, 0, 3, 0), EPJ_ERR_INVALID,
			TU_STRS("slice"));
	tu_assert_error(ctx, epj_slice(ctx, a, 2, 0, 3, 1), EPJ_ERR_INVALID,
			TU_STRS("slice"));
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_split)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[2] = { 5, 12 };
	epj_tensor *a = rand_input(ctx, EPJ_DTYPE_F32, 2, sh, true);
	double *va = tu_values(ctx, a);
	int64_t sizes[4] = { 3, 0, 7, 2 };
	epj_tensor *outs[4];
	ck_assert_int_eq(epj_split(ctx, a, -1, 4, sizes, outs), EPJ_OK);
	int64_t at = 0;
	for (int i = 0; i < 4; i++) {
		ck_assert_int_eq(epj_tensor_dim(outs[i], 0), 5);
		ck_assert_int_eq(epj_tensor_dim(outs[i], 1), sizes[i]);
		double ref[5 * 12];
		for (int64_t r = 0; r < 5; r++)
			for (int64_t c = 0; c < sizes[i]; c++)
				ref[r * sizes[i] + c] = va[r * 12 + at + c];
		tu_assert_close(ctx, outs[i], ref, 0, 0, "split piece");
		if (sizes[i] > 0)
			ck_assert(epj_tensor_shares_storage(outs[i], a));
		at += sizes[i];
		epj_tensor_free(outs[i]);
	}
	int64_t bad[2] = { 3, 8 };
	outs[0] = outs[1] = (epj_tensor *)a; /* must be reset to NULL */
	ck_assert_int_eq(epj_split(ctx, a, 1, 2, bad, outs), EPJ_ERR_SHAPE);
	ck_assert_ptr_null(outs[0]);
	ck_assert_ptr_null(outs[1]);
	ck_assert(strstr(epj_ctx_error(ctx), "split") != NULL);
	epj_ctx_clear_error(ctx);
	free(va);
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- expand / contiguous ----------------------------------------------- */

START_TEST(test_expand)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[3] = { 3, 1, 5 };
	for (int nc = 0; nc < 2; nc++) {
		epj_tensor *a = rand_input(ctx, EPJ_DTYPE_F32, 3, sh, nc);
		int64_t k = tu_randint(2, 6);
		int64_t want[4] = { 2, -1, k, -1 };
		epj_tensor *e = epj_expand(ctx, a, 4, want);
		tu_ok(ctx, e);
		int64_t esh[4] = { 2, 3, k, 5 };
		tu_assert_shape(e, 4, esh);
		ck_assert(epj_tensor_shares_storage(a, e));
		ck_assert_int_eq(epj_tensor_strides(e)[0], 0);
		ck_assert_int_eq(epj_tensor_strides(e)[2], 0);
		double *va = tu_values(ctx, a);
		int64_t n = tu_numel(4, esh);
		double *ref = malloc(sizeof *ref * (size_t)n);
		for (int64_t f = 0; f < n; f++) {
			int64_t m[4], src[3];
			tu_unflat(f, 4, esh, m);
			src[0] = m[1];
			src[1] = 0;
			src[2] = m[3];
			ref[f] = va[tu_flat(3, sh, src)];
		}
		tu_assert_close(ctx, e, ref, 0, 0, "expand");
		/* a write in the base shows in every expanded copy */
		epj_tensor_set_f64(a, 0, 11.0);
		ck_assert(epj_tensor_get_f64(e, 0) == 11.0);
		ck_assert(epj_tensor_get_f64(e, n - tu_numel(3, esh + 1)) ==
			  11.0);
		/* contiguous() materialises the stride-0 dims */
		epj_tensor *c = epj_contiguous(ctx, e);
		tu_ok(ctx, c);
		ck_assert(epj_tensor_is_contiguous(c));
		ck_assert(!epj_tensor_shares_storage(c, a));
		ref[0] = 11.0;
		for (int64_t f = 0; f < n; f++) {
			int64_t m[4];
			tu_unflat(f, 4, esh, m);
			if (m[1] == 0 && m[3] == 0)
				ref[f] = 11.0;
		}
		tu_assert_close(ctx, c, ref, 0, 0, "contiguous(expand)");
		free(va);
		free(ref);
		epj_tensor_free(c);
		epj_tensor_free(e);
		epj_tensor_free(a);
	}
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	int64_t bad[3] = { 4, 1, 5 };
	tu_assert_error(ctx, epj_expand(ctx, a, 3, bad), EPJ_ERR_SHAPE,
			TU_STRS("expand"));
	int64_t lead[4] = { -1, 3, 1, 5 };
	tu_assert_error(ctx, epj_expand(ctx, a, 4, lead), EPJ_ERR_SHAPE,
			TU_STRS("expand"));
	tu_assert_error(ctx, epj_expand(ctx, a, 2, bad), EPJ_ERR_SHAPE,
			TU_STRS("expand"));
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_contiguous)
{
	epj_ctx *ctx = tu_ctx();
	/* large enough for the threaded copy path */
	int64_t sh[3] = { 7, 91, tu_randint(100, 140) };
	epj_dtype dts[3] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16, EPJ_DTYPE_F64 };
	for (int d = 0; d < 3; d++) {
		epj_tensor *a = tu_randn(ctx, dts[d], 3, sh);
		epj_tensor *same = epj_contiguous(ctx, a);
		ck_assert_ptr_eq(same, a);
		epj_tensor_free(same);
		epj_tensor *t = epj_transpose(ctx, a, 0, 2);
		epj_tensor *c = epj_contiguous(ctx, t);
		tu_ok(ctx, c);
		ck_assert(epj_tensor_is_contiguous(c));
		ck_assert(!epj_tensor_shares_storage(c, a));
		tu_assert_tensors_close(ctx, c, t, 0, 0, "contiguous");
		epj_tensor_free(c);
		epj_tensor_free(t);
		epj_tensor_free(a);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- cat --------------------------------------------------------------- */

START_TEST(test_cat)
{
	epj_ctx *ctx = tu_ctx();
	for (int axis = 0; axis < 3; axis++) {
		epj_tensor *ts[3];
		double *vals[3];
		int64_t shs[3][3], total = 0;
		for (int k = 0; k < 3; k++) {
			int64_t sh[3] = { 3, 5, 7 };
			sh[axis] = tu_randint(1, 6);
			memcpy(shs[k], sh, sizeof sh);
			total += sh[axis];
			ts[k] = rand_input(ctx, EPJ_DTYPE_F32, 3, sh, k == 1);
			vals[k] = tu_values(ctx, ts[k]);
		}
		epj_tensor *c = epj_cat(ctx, ts, 3, axis - 3);
		tu_ok(ctx, c);
		int64_t csh[3] = { 3, 5, 7 };
		csh[axis] = total;
		tu_assert_shape(c, 3, csh);
		int64_t n = tu_numel(3, csh);
		double *ref = malloc(sizeof *ref * (size_t)n);
		for (int64_t f = 0; f < n; f++) {
			int64_t m[3];
			tu_unflat(f, 3, csh, m);
			int k = 0;
			while (m[axis] >= shs[k][axis])
				m[axis] -= shs[k++][axis];
			ref[f] = vals[k][tu_flat(3, shs[k], m)];
		}
		tu_assert_close(ctx, c, ref, 0, 0, "cat");
		free(ref);
		epj_tensor_free(c);
		for (int k = 0; k < 3; k++) {
			free(vals[k]);
			epj_tensor_free(ts[k]);
		}
	}
	/* errors: shapes differ off the axis, dtypes differ, no inputs */
	int64_t s1[2] = { 3, 5 }, s2[2] = { 4, 5 };
	epj_tensor *pair[2] = { tu_randn(ctx, EPJ_DTYPE_F32, 2, s1),
				tu_randn(ctx, EPJ_DTYPE_F32, 2, s2) };
	epj_tensor *c = epj_cat(ctx, pair, 2, 1);
	ck_assert_ptr_null(c);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_SHAPE);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "cat") &&
			  strstr(epj_ctx_error(ctx), "[4,5]"),
		      "%s", epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	c = epj_cat(ctx, pair, 2, 0);
	tu_ok(ctx, c);
	epj_tensor_free(c);
	epj_tensor_free(pair[1]);
	pair[1] = tu_randn(ctx, EPJ_DTYPE_F64, 2, s1);
	tu_assert_error(ctx, epj_cat(ctx, pair, 2, 0), EPJ_ERR_DTYPE,
			TU_STRS("cat"));
	tu_assert_error(ctx, epj_cat(ctx, pair, 0, 0), EPJ_ERR_INVALID,
			TU_STRS("cat"));
	epj_tensor_free(pair[0]);
	epj_tensor_free(pair[1]);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- full / zeros ------------------------------------------------------- */

START_TEST(test_full)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[2] = { 3, tu_randint(2, 9) };
	double v = tu_uniform(-100, 100);
	epj_dtype dts[5] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16, EPJ_DTYPE_F64,
			     EPJ_DTYPE_I32, EPJ_DTYPE_I64 };
	for (int d = 0; d < 5; d++) {
		epj_tensor *f = epj_full(ctx, dts[d], 2, sh, v);
		tu_ok(ctx, f);
		ck_assert_int_eq(epj_tensor_dtype(f), dts[d]);
		tu_assert_shape(f, 2, sh);
		double want = dts[d] == EPJ_DTYPE_I32 || dts[d] == EPJ_DTYPE_I64
				  ? trunc(v)
				  : v;
		double ref[3 * 9];
		for (int i = 0; i < 3 * sh[1]; i++)
			ref[i] = want;
		tu_assert_close(ctx, f, ref,
				dts[d] == EPJ_DTYPE_BF16  ? 1e-2
				: dts[d] == EPJ_DTYPE_F32 ? 1e-7
							  : 0,
				0, "full");
		epj_tensor *z = epj_zeros(ctx, dts[d], 2, sh);
		tu_ok(ctx, z);
		for (int i = 0; i < 3 * sh[1]; i++)
			ref[i] = 0;
		tu_assert_close(ctx, z, ref, 0, 0, "zeros");
		epj_tensor_free(f);
		epj_tensor_free(z);
	}
	epj_tensor *s = epj_full(ctx, EPJ_DTYPE_F32, 0, NULL, 2.5);
	tu_ok(ctx, s);
	ck_assert_int_eq(epj_tensor_numel(s), 1);
	ck_assert(epj_tensor_get_f64(s, 0) == 2.5);
	epj_tensor_free(s);
	int64_t neg[2] = { 3, -1 };
	tu_assert_error(ctx, epj_zeros(ctx, EPJ_DTYPE_F32, 2, neg),
			EPJ_ERR_SHAPE, TU_STRS("full"));
	tu_assert_error(ctx, epj_full(ctx, EPJ_DTYPE_I32, 2, sh, NAN),
			EPJ_ERR_INVALID, TU_STRS("full"));
	epj_ctx_free(ctx);
}
END_TEST

/* ---- gradients ---------------------------------------------------------- */

typedef struct shape_args {
	int kind;
	int64_t shape[4];
	int ndim;
	int perm[4];
} shape_args;

enum {
	G_RESHAPE,
	G_TRANSPOSE,
	G_PERMUTE,
	G_SLICE,
	G_EXPAND,
	G_CONTIGUOUS,
	G_CAT,
	G_SLICE_TWICE,
};

static epj_tensor *shape_fn(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	shape_args *u = user;
	switch (u->kind) {
	case G_RESHAPE:
		return epj_reshape(ctx, in[0], u->ndim, u->shape);
	case G_TRANSPOSE:
		return epj_transpose(ctx, in[0], 0, -1);
	case G_PERMUTE:
		return epj_permute(ctx, in[0], u->perm);
	case G_SLICE:
		return epj_slice(ctx, in[0], 1, -6, 100, 2);
	case G_EXPAND:
		return epj_expand(ctx, in[0], u->ndim, u->shape);
	case G_CONTIGUOUS: {
		epj_tensor *t = epj_transpose(ctx, in[0], 0, 1);
		epj_tensor *c = epj_contiguous(ctx, t);
		epj_tensor_free(t);
		return c;
	}
	case G_CAT:
		return epj_cat(ctx, in, 3, 1);
	case G_SLICE_TWICE: {
		/* overlapping slices: gradients of both must add up */
		epj_tensor *a = epj_slice(ctx, in[0], 2, 0, 3, 1);
		epj_tensor *b = epj_slice(ctx, in[0], 2, 1, 4, 1);
		epj_tensor *s = epj_mul(ctx, a, b);
		epj_tensor_free(a);
		epj_tensor_free(b);
		return s;
	}
	}
	return NULL;
}

static void grad_case(epj_ctx *ctx, shape_args *u, int n_in,
		      const int64_t (*shapes)[3], const char *what)
{
	for (int nc = 0; nc < 2; nc++) {
		epj_tensor *in[3];
		for (int i = 0; i < n_in; i++) {
			in[i] =
			    rand_input(ctx, EPJ_DTYPE_F64, 3, shapes[i], nc);
			epj_tensor_set_requires_grad(in[i], true);
		}
		tu_gradcheck(ctx, shape_fn, in, n_in, u, 1e-6, 1e-6, 1e-7,
			     what);
		for (int i = 0; i < n_in; i++)
			epj_tensor_free(in[i]);
	}
}

START_TEST(test_grad_views)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t sh[1][3] = { { 3, 5, 4 } };
	shape_args u = { .kind = G_RESHAPE, .ndim = 2, .shape = { 4, -1 } };
	grad_case(ctx, &u, 1, sh, "grad reshape");
	u = (shape_args){ .kind = G_TRANSPOSE };
	grad_case(ctx, &u, 1, sh, "grad transpose");
	u = (shape_args){ .kind = G_PERMUTE, .perm = { 1, 2, 0 } };
	grad_case(ctx, &u, 1, sh, "grad permute");
	u = (shape_args){ .kind = G_SLICE };
	grad_case(ctx, &u, 1, sh, "grad slice");
	u = (shape_args){ .kind = G_SLICE_TWICE };
	grad_case(ctx, &u, 1, sh, "grad overlapping slices");
	u = (shape_args){ .kind = G_CONTIGUOUS };
	grad_case(ctx, &u, 1, sh, "grad contiguous");
	const int64_t one[1][3] = { { 3, 1, 4 } };
	u = (shape_args){ .kind = G_EXPAND,
			  .ndim = 4,
			  .shape = { 2, 3, 5, -1 } };
	grad_case(ctx, &u, 1, one, "grad expand");
	const int64_t three[3][3] = { { 2, 3, 3 }, { 2, 1, 3 }, { 2, 5, 3 } };
	u = (shape_args){ .kind = G_CAT };
	grad_case(ctx, &u, 3, three, "grad cat");
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_ops_shape_suite(void)
{
	Suite *s = suite_create("ops_shape");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_reshape_view);
	tcase_add_test(tc, test_scalar_shapes);
	tcase_add_test(tc, test_reshape_copy_of_transpose);
	tcase_add_test(tc, test_reshape_errors);
	tcase_add_test(tc, test_transpose);
	tcase_add_test(tc, test_permute);
	tcase_add_test(tc, test_slice);
	tcase_add_test(tc, test_split);
	tcase_add_test(tc, test_expand);
	tcase_add_test(tc, test_contiguous);
	tcase_add_test(tc, test_cat);
	tcase_add_test(tc, test_full);
	tcase_add_test(tc, test_grad_views);
	suite_add_tcase(s, tc);
	return s;
}
