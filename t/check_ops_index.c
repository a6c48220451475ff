/* check_ops_index.c -- indexing ops: embedding, index_select, index_add,
 * gather, scatter_add, topk, argsort.
 *
 * Each forward result is compared against a reference written here with
 * plain loops over row-major values (tu_values) on fresh random inputs of
 * odd sizes, contiguous and not (tu_noncontig), with i32 and i64 indices
 * that repeat.  Gradients are checked by finite differences in f64.  Bad
 * indices must fail with EPJ_ERR_INDEX and a message naming the op and the
 * value.
 */
#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- random inputs ---------------------------------------------------- */

/* Integers uniform in [lo, hi) of dtype dt (an index or small-int keys). */
static epj_tensor *rand_int(epj_ctx *ctx, epj_dtype dt, int nd,
			    const int64_t *shape, int64_t lo, int64_t hi,
			    bool nc)
{
	epj_tensor *t = epj_randint(ctx, dt, nd, shape, lo, hi);
	tu_ok(ctx, t);
	return tu_maybe_noncontig(ctx, t, nc);
}

/* A float tensor of small integers in [0, levels) (many ties), dtype dt. */
static epj_tensor *rand_ties(epj_ctx *ctx, epj_dtype dt, int nd,
			     const int64_t *shape, int64_t levels, bool nc)
{
	int64_t n = tu_numel(nd, shape);
	double *v = malloc(sizeof *v * (size_t)n);
	for (int64_t i = 0; i < n; i++)
		v[i] = (double)tu_randint(0, levels);
	epj_tensor *f = epj_zeros(ctx, dt, nd, shape);
	tu_ok(ctx, f);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, f, v), EPJ_OK);
	free(v);
	return tu_maybe_noncontig(ctx, f, nc);
}

static const epj_dtype idx_dts[2] = { EPJ_DTYPE_I32, EPJ_DTYPE_I64 };

/* ---- embedding ---------------------------------------------------------- */

START_TEST(test_embedding)
{
	epj_ctx *ctx = tu_ctx();
	for (int c = 0; c < 4; c++) {
		bool nc = c & 1, big = c & 2;
		int64_t V = big ? 37 : tu_randint(3, 8) * 2 + 1;
		int64_t D = big ? 1031 : 13;
		int64_t wsh[2] = { V, D };
		int64_t ish[2] = { big ? 41 : 3, big ? 1 : 5 };
		epj_tensor *w = tu_randn_nc(ctx, EPJ_DTYPE_F32, 2, wsh, nc);
		epj_tensor *ids =
		    rand_int(ctx, idx_dts[c & 1], 2, ish, 0, V, !nc);
		epj_tensor *e = epj_embedding(ctx, w, ids);
		tu_ok(ctx, e);
		int64_t esh[3] = { ish[0], ish[1], D };
		tu_assert_shape(e, 3, esh);
		double *vw = tu_values(ctx, w), *vi = tu_values(ctx, ids);
		int64_t n = tu_numel(2, ish);
		double *ref = malloc(sizeof *ref * (size_t)(n * D));
		for (int64_t i = 0; i < n; i++)
			for (int64_t d = 0; d < D; d++)
				ref[i * D + d] = vw[(int64_t)vi[i] * D + d];
		tu_assert_close(ctx, e, ref, 0, 0, "embedding");
		free(vw);
		free(vi);
		free(ref);
		epj_tensor_free(e);
		epj_tensor_free(w);
		epj_tensor_free(ids);
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_embedding_backward_f32)
{
	/* wide rows (several column blocks) and many repeated ids */
	epj_ctx *ctx = tu_ctx();
	int64_t V = 7, D = 1031, N = 37;
	int64_t wsh[2] = { V, D }, ish[1] = { N };
	epj_tensor *w = tu_randn(ctx, EPJ_DTYPE_F32, 2, wsh);
	epj_tensor_set_requires_grad(w, true);
	epj_tensor *ids = rand_int(ctx, EPJ_DTYPE_I64, 1, ish, 0, V, false);
	epj_tensor *e = epj_embedding(ctx, w, ids);
	tu_ok(ctx, e);
	int64_t gsh[2] = { N, D };
	epj_tensor *g = tu_randn(ctx, EPJ_DTYPE_F32, 2, gsh);
	ck_assert_int_eq(epj_backward(ctx, e, g), EPJ_OK);
	double *vg = tu_values(ctx, g), *vi = tu_values(ctx, ids);
	double *ref = calloc((size_t)(V * D), sizeof *ref);
	for (int64_t i = 0; i < N; i++)
		for (int64_t d = 0; d < D; d++)
			ref[(int64_t)vi[i] * D + d] += vg[i * D + d];
	epj_tensor *wg = epj_tensor_grad(w);
	ck_assert_ptr_nonnull(wg);
	tu_assert_close(ctx, wg, ref, 1e-5, 1e-5, "embedding backward");
	free(vg);
	free(vi);
	free(ref);
	epj_tensor_free(e);
	epj_tensor_free(g);
	epj_tensor_free(w);
	epj_tensor_free(ids);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_embedding_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t V = tu_randint(5, 12), wsh[2] = { V, 3 }, ish[2] = { 3, 5 };
	epj_tensor *w = tu_randn(ctx, EPJ_DTYPE_F32, 2, wsh);
	for (int d = 0; d < 2; d++) {
		epj_tensor *ids = rand_int(ctx, idx_dts[d], 2, ish, 0, V, d);
		int64_t pos = tu_randint(0, 15);
		char val[32];
		epj_tensor_set_f64(ids, pos, (double)V);
		snprintf(val, sizeof val, "value %lld", (long long)V);
		tu_assert_error(ctx, epj_embedding(ctx, w, ids), EPJ_ERR_INDEX,
				TU_STRS("embedding", val));
		epj_tensor_set_f64(ids, pos, -1);
		tu_assert_error(ctx, epj_embedding(ctx, w, ids), EPJ_ERR_INDEX,
				TU_STRS("embedding", "value -1"));
		epj_tensor_free(ids);
	}
	epj_tensor *fid = tu_randn(ctx, EPJ_DTYPE_F32, 2, ish);
	tu_assert_error(ctx, epj_embedding(ctx, w, fid), EPJ_ERR_DTYPE,
			TU_STRS("embedding"));
	epj_tensor *w1 = tu_randn(ctx, EPJ_DTYPE_F32, 1, wsh);
	epj_tensor *ids = rand_int(ctx, EPJ_DTYPE_I64, 2, ish, 0, V, false);
	tu_assert_error(ctx, epj_embedding(ctx, w1, ids), EPJ_ERR_SHAPE,
			TU_STRS("embedding"));
	epj_tensor_free(fid);
	epj_tensor_free(w1);
	epj_tensor_free(ids);
	epj_tensor_free(w);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- index_select / index_add ------------------------------------------ */

START_TEST(test_index_select)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[3] = { 5, 7, 3 };
	for (int axis = 0; axis < 3; axis++) {
		for (int nc = 0; nc < 2; nc++) {
			int64_t n = tu_randint(1, 10), nsh[1] = { n };
			epj_tensor *a =
			    tu_randn_nc(ctx, EPJ_DTYPE_F32, 3, sh, nc);
			epj_tensor *idx = rand_int(ctx, idx_dts[nc], 1, nsh, 0,
						   sh[axis], !nc);
			epj_tensor *o =
			    epj_index_select(ctx, a, axis - 3 * nc, idx);
			tu_ok(ctx, o);
			int64_t osh[3] = { 5, 7, 3 };
			osh[axis] = n;
			tu_assert_shape(o, 3, osh);
			double *va = tu_values(ctx, a),
			       *vi = tu_values(ctx, idx);
			int64_t no = tu_numel(3, osh);
			double *ref = malloc(sizeof *ref * (size_t)no);
			for (int64_t f = 0; f < no; f++) {
				int64_t m[3];
				tu_unflat(f, 3, osh, m);
				m[axis] = (int64_t)vi[m[axis]];
				ref[f] = va[tu_flat(3, sh, m)];
			}
			tu_assert_close(ctx, o, ref, 0, 0, "index_select");
			free(va);
			free(vi);
			free(ref);
			epj_tensor_free(o);
			epj_tensor_free(a);
			epj_tensor_free(idx);
		}
	}
	/* out of range, 2-D index */
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	int64_t four[1] = { 4 };
	epj_tensor *idx = rand_int(ctx, EPJ_DTYPE_I64, 1, four, 0, 7, false);
	epj_tensor_set_f64(idx, 2, 7);
	tu_assert_error(ctx, epj_index_select(ctx, a, 1, idx), EPJ_ERR_INDEX,
			TU_STRS("index_select", "value 7"));
	epj_tensor *idx2 = rand_int(ctx, EPJ_DTYPE_I64, 2, sh, 0, 3, false);
	tu_assert_error(ctx, epj_index_select(ctx, a, 1, idx2), EPJ_ERR_SHAPE,
			TU_STRS("index_select"));
	tu_assert_error(ctx, epj_index_select(ctx, a, 3, idx), EPJ_ERR_INVALID,
			TU_STRS("index_select"));
	epj_tensor_free(idx2);
	epj_tensor_free(idx);
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_index_add)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[3] = { 5, 7, 3 };
	epj_dtype dts[4] = { EPJ_DTYPE_F32, EPJ_DTYPE_F64, EPJ_DTYPE_BF16,
			     EPJ_DTYPE_I32 };
	for (int c = 0; c < 12; c++) {
		int axis = c % 3;
		epj_dtype dt = dts[c / 3];
		bool nc = c & 1;
		int64_t n = tu_randint(1, 12), nsh[1] = { n };
		int64_t ssh[3] = { 5, 7, 3 };
		ssh[axis] = n;
		epj_tensor *a, *src;
		if (dt == EPJ_DTYPE_I32) {
			a = rand_int(ctx, dt, 3, sh, -50, 50, nc);
			src = rand_int(ctx, dt, 3, ssh, -50, 50, !nc);
		} else {
			a = tu_randn_nc(ctx, dt, 3, sh, nc);
			src = tu_randn_nc(ctx, dt, 3, ssh, !nc);
		}
		epj_tensor *idx =
		    rand_int(ctx, idx_dts[c & 1], 1, nsh, 0, sh[axis], nc);
		epj_tensor *o = epj_index_add(ctx, a, axis, idx, src);
		tu_ok(ctx, o);
		tu_assert_shape(o, 3, sh);
		ck_assert_int_eq(epj_tensor_dtype(o), dt);
		double *ref = tu_values(ctx, a), *vs = tu_values(ctx, src),
		       *vi = tu_values(ctx, idx);
		for (int64_t f = 0; f < tu_numel(3, ssh); f++) {
			int64_t m[3];
			tu_unflat(f, 3, ssh, m);
			m[axis] = (int64_t)vi[m[axis]];
			ref[tu_flat(3, sh, m)] += vs[f];
		}
		double tol = dt == EPJ_DTYPE_BF16  ? 1e-2
			     : dt == EPJ_DTYPE_F32 ? 1e-5
						   : 0;
		tu_assert_close(ctx, o, ref, tol, tol, "index_add");
		free(ref);
		free(vs);
		free(vi);
		epj_tensor_free(o);
		epj_tensor_free(a);
		epj_tensor_free(src);
		epj_tensor_free(idx);
	}
	/* wrong src shape, dtype mismatch, bad index */
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	int64_t nsh[1] = { 4 }, ssh[3] = { 5, 5, 3 };
	epj_tensor *idx = rand_int(ctx, EPJ_DTYPE_I32, 1, nsh, 0, 7, false);
	epj_tensor *src = tu_randn(ctx, EPJ_DTYPE_F32, 3, ssh);
	tu_assert_error(ctx, epj_index_add(ctx, a, 1, idx, src), EPJ_ERR_SHAPE,
			TU_STRS("index_add"));
	epj_tensor_free(src);
	ssh[1] = 4;
	src = tu_randn(ctx, EPJ_DTYPE_F64, 3, ssh);
	tu_assert_error(ctx, epj_index_add(ctx, a, 1, idx, src), EPJ_ERR_DTYPE,
			TU_STRS("index_add"));
	epj_tensor_free(src);
	src = tu_randn(ctx, EPJ_DTYPE_F32, 3, ssh);
	epj_tensor_set_f64(idx, 3, -2);
	tu_assert_error(ctx, epj_index_add(ctx, a, 1, idx, src), EPJ_ERR_INDEX,
			TU_STRS("index_add", "value -2"));
	epj_tensor_free(src);
	epj_tensor_free(idx);
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- gather / scatter_add ----------------------------------------------- */

/* Index shape for gather/scatter along axis of a [4, 6, 5]: no larger
 * than a off the axis, any length on it. */
static void scatter_index_shape(const int64_t *ash, int axis, int64_t *ish)
{
	for (int d = 0; d < 3; d++)
		ish[d] =
		    d == axis ? tu_randint(1, 9) : tu_randint(1, ash[d] + 1);
}

/* gather against a double reference: every axis, contiguous and strided
 * inputs, i32 and i64 indices; every element size, a broadcast index, a
 * large one (the rows in parallel); out-of-range values named by their
 * first position. */
START_TEST(test_gather)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[3] = { 4, 6, 5 };
	for (int c = 0; c < 6; c++) {
		int axis = c % 3;
		bool nc = c >= 3;
		int64_t ish[3];
		scatter_index_shape(sh, axis, ish);
		epj_tensor *a = tu_randn_nc(ctx, EPJ_DTYPE_F32, 3, sh, nc);
		epj_tensor *idx =
		    rand_int(ctx, idx_dts[c & 1], 3, ish, 0, sh[axis], nc);
		epj_tensor *o = epj_gather(ctx, a, axis, idx);
		tu_ok(ctx, o);
		tu_assert_shape(o, 3, ish);
		double *va = tu_values(ctx, a), *vi = tu_values(ctx, idx);
		int64_t n = tu_numel(3, ish);
		double *ref = malloc(sizeof *ref * (size_t)n);
		for (int64_t f = 0; f < n; f++) {
			int64_t m[3];
			tu_unflat(f, 3, ish, m);
			m[axis] = (int64_t)vi[f];
			ref[f] = va[tu_flat(3, sh, m)];
		}
		tu_assert_close(ctx, o, ref, 0, 0, "gather");
		free(va);
		free(vi);
		free(ref);
		epj_tensor_free(o);
		epj_tensor_free(a);
		epj_tensor_free(idx);
	}
	/* every element size (bf16, f64, i64), an index broadcast along two
	 * dims (stride 0), and a gather past the parallel threshold */
	static const epj_dtype gdts[] = { EPJ_DTYPE_BF16, EPJ_DTYPE_F64,
					  EPJ_DTYPE_I64, EPJ_DTYPE_F32 };
	for (int c = 0; c < 4; c++) {
		bool big = c == 3;
		int64_t bsh[3] = { 40, 50, 21 }, gsh[3] = { 4, 6, 5 };
		int64_t *ash = big ? bsh : gsh;
		epj_tensor *a = c == 2 ? rand_int(ctx, EPJ_DTYPE_I64, 3, ash,
						  -1000000, 1000000, false)
				       : tu_randn(ctx, gdts[c], 3, ash);
		int64_t one[3] = { 1, ash[1], 1 },
			full[3] = { ash[0], ash[1], ash[2] };
		epj_tensor *i1 =
		    rand_int(ctx, idx_dts[c & 1], 3, one, 0, ash[2], false);
		epj_tensor *idx =
		    big ? rand_int(ctx, EPJ_DTYPE_I64, 3, full, 0, ash[2], true)
			: epj_expand(ctx, i1, 3, full);
		tu_ok(ctx, idx);
		epj_tensor *o = epj_gather(ctx, a, 2, idx);
		tu_ok(ctx, o);
		double *va = tu_values(ctx, a), *vi = tu_values(ctx, idx);
		int64_t n = tu_numel(3, full);
		double *ref = malloc(sizeof *ref * (size_t)n);
		for (int64_t f = 0; f < n; f++) {
			int64_t m[3];
			tu_unflat(f, 3, full, m);
			m[2] = (int64_t)vi[f];
			ref[f] = va[tu_flat(3, ash, m)];
		}
		tu_assert_close(ctx, o, ref, 0, 0, "gather");
		free(va);
		free(vi);
		free(ref);
		epj_tensor_free(o);
		epj_tensor_free(idx);
		epj_tensor_free(i1);
		epj_tensor_free(a);
	}
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	int64_t ish[3] = { 4, 3, 5 };
	epj_tensor *idx = rand_int(ctx, EPJ_DTYPE_I64, 3, ish, 0, 6, false);
	epj_tensor_set_f64(idx, 17, 6);
	tu_assert_error(ctx, epj_gather(ctx, a, 1, idx), EPJ_ERR_INDEX,
			TU_STRS("gather", "value 6", "flat 17"));
	epj_tensor_set_f64(idx, 17, 2);
	epj_tensor_set_f64(idx, 40, -1); /* the first bad one is named */
	epj_tensor_set_f64(idx, 50, 9);
	tu_assert_error(ctx, epj_gather(ctx, a, 1, idx), EPJ_ERR_INDEX,
			TU_STRS("gather", "value -1", "flat 40"));
	epj_tensor_free(idx);
	int64_t big[3] = { 5, 3, 5 };
	idx = rand_int(ctx, EPJ_DTYPE_I64, 3, big, 0, 6, false);
	tu_assert_error(ctx, epj_gather(ctx, a, 1, idx), EPJ_ERR_SHAPE,
			TU_STRS("gather"));
	epj_tensor_free(idx);
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_scatter_add)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[3] = { 4, 6, 5 };
	epj_dtype dts[3] = { EPJ_DTYPE_F64, EPJ_DTYPE_F32, EPJ_DTYPE_BF16 };
	for (int c = 0; c < 9; c++) {
		int axis = c % 3;
		epj_dtype dt = dts[c / 3];
		bool nc = c & 1;
		int64_t ish[3];
		scatter_index_shape(sh, axis, ish);
		epj_tensor *a = tu_randn_nc(ctx, dt, 3, sh, nc);
		epj_tensor *src = tu_randn_nc(ctx, dt, 3, ish, !nc);
		epj_tensor *idx =
		    rand_int(ctx, idx_dts[nc], 3, ish, 0, sh[axis], nc);
		epj_tensor *o = epj_scatter_add(ctx, a, axis - 3, idx, src);
		tu_ok(ctx, o);
		tu_assert_shape(o, 3, sh);
		double *ref = tu_values(ctx, a), *vs = tu_values(ctx, src),
		       *vi = tu_values(ctx, idx);
		for (int64_t f = 0; f < tu_numel(3, ish); f++) {
			int64_t m[3];
			tu_unflat(f, 3, ish, m);
			m[axis] = (int64_t)vi[f];
			ref[tu_flat(3, sh, m)] += vs[f];
		}
		double tol = dt == EPJ_DTYPE_BF16  ? 1e-2
			     : dt == EPJ_DTYPE_F32 ? 1e-5
						   : 1e-12;
		tu_assert_close(ctx, o, ref, tol, tol, "scatter_add");
		free(ref);
		free(vs);
		free(vi);
		epj_tensor_free(o);
		epj_tensor_free(a);
		epj_tensor_free(src);
		epj_tensor_free(idx);
	}
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	int64_t ish[3] = { 2, 6, 5 };
	epj_tensor *idx = rand_int(ctx, EPJ_DTYPE_I32, 3, ish, 0, 4, false);
	epj_tensor *src = tu_randn(ctx, EPJ_DTYPE_F32, 3, ish);
	epj_tensor_set_f64(idx, 31, -7);
	tu_assert_error(ctx, epj_scatter_add(ctx, a, 0, idx, src),
			EPJ_ERR_INDEX, TU_STRS("scatter_add", "value -7"));
	int64_t ssh[3] = { 2, 6, 4 };
	epj_tensor *src2 = tu_randn(ctx, EPJ_DTYPE_F32, 3, ssh);
	tu_assert_error(ctx, epj_scatter_add(ctx, a, 0, idx, src2),
			EPJ_ERR_SHAPE, TU_STRS("scatter_add"));
	epj_tensor_free(src2);
	epj_tensor_free(src);
	epj_tensor_free(idx);
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- topk ---------------------------------------------------------------- */

/* NaN is the largest value; equal values keep index order. */
static bool ref_greater(double x, double y)
{
	if (isnan(x))
		return !isnan(y);
	return !isnan(y) && x > y;
}

static void check_topk(epj_ctx *ctx, epj_tensor *a, int64_t k, const char *what)
{
	int nd = epj_tensor_ndim(a);
	int64_t n = epj_tensor_dim(a, -1), rows = epj_tensor_numel(a) / n;
	epj_tensor *v = NULL, *i = NULL;
	ck_assert_msg(epj_topk(ctx, a, k, &v, &i) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_tensor_dtype(v), epj_tensor_dtype(a));
	ck_assert_int_eq(epj_tensor_dtype(i), EPJ_DTYPE_I64);
	ck_assert_int_eq(epj_tensor_ndim(v), nd);
	ck_assert_int_eq(epj_tensor_dim(v, -1), k);
	ck_assert_int_eq(epj_tensor_dim(i, -1), k);
	double *va = tu_values(ctx, a);
	double *rv = malloc(sizeof *rv * (size_t)(rows * k));
	double *ri = malloc(sizeof *ri * (size_t)(rows * k));
	bool *used = malloc((size_t)n);
	for (int64_t r = 0; r < rows; r++) {
		memset(used, 0, (size_t)n);
		for (int64_t q = 0; q < k; q++) {
			int64_t best = -1;
			for (int64_t j = 0; j < n; j++)
				if (!used[j] &&
				    (best < 0 || ref_greater(va[r * n + j],
							     va[r * n + best])))
					best = j;
			used[best] = true;
			rv[r * k + q] = va[r * n + best];
			ri[r * k + q] = (double)best;
		}
	}
	tu_assert_close(ctx, v, rv, 0, 0, what);
	tu_assert_close(ctx, i, ri, 0, 0, what);
	free(va);
	free(rv);
	free(ri);
	free(used);
	epj_tensor_free(v);
	epj_tensor_free(i);
}

START_TEST(test_topk)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[2] = { 7, 13 };
	for (int nc = 0; nc < 2; nc++) {
		epj_tensor *a = tu_randn_nc(ctx, EPJ_DTYPE_F32, 2, sh, nc);
		int64_t ks[4] = { 1, 4, tu_randint(1, 14), 13 };
		for (int q = 0; q < 4; q++)
			check_topk(ctx, a, ks[q], "topk");
		epj_tensor_free(a);
		/* ties: small integers, lower index first */
		a = rand_ties(ctx, EPJ_DTYPE_F32, 2, sh, 3, nc);
		for (int q = 0; q < 4; q++)
			check_topk(ctx, a, ks[q], "topk ties");
		epj_tensor_free(a);
	}
	/* long rows with a large k (full sort path), ties, 3-D, bf16 */
	int64_t s3[3] = { 3, 2, 45 };
	epj_tensor *a = rand_ties(ctx, EPJ_DTYPE_BF16, 3, s3, 5, true);
	check_topk(ctx, a, 41, "topk large k");
	check_topk(ctx, a, 7, "topk 3-D");
	/* NaN ranks first */
	epj_tensor_set_f64(a, 50, NAN);
	check_topk(ctx, a, 3, "topk NaN");
	epj_tensor *v, *i;
	ck_assert_int_eq(epj_topk(ctx, a, 0, &v, &i), EPJ_ERR_INVALID);
	ck_assert_ptr_null(v);
	ck_assert_ptr_null(i);
	ck_assert(strstr(epj_ctx_error(ctx), "topk") != NULL);
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_topk(ctx, a, 46, &v, &i), EPJ_ERR_INVALID);
	epj_ctx_clear_error(ctx);
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- argsort --------------------------------------------------------------
 */

static void check_argsort(epj_ctx *ctx, epj_tensor *a, int axis,
			  const char *what)
{
	int nd = epj_tensor_ndim(a);
	const int64_t *sh = epj_tensor_shape(a);
	int ax = axis < 0 ? axis + nd : axis;
	epj_tensor *o = epj_argsort(ctx, a, axis);
	tu_ok(ctx, o);
	ck_assert_int_eq(epj_tensor_dtype(o), EPJ_DTYPE_I64);
	tu_assert_shape(o, nd, sh);
	double *va = tu_values(ctx, a);
	int64_t n = epj_tensor_numel(a), A = sh[ax];
	double *ref = malloc(sizeof *ref * (size_t)n);
	int64_t *lane = malloc(sizeof *lane * (size_t)A);
	int64_t *pos = malloc(sizeof *pos * (size_t)A);
	for (int64_t f = 0; f < n; f++) {
		int64_t m[EPJ_MAX_DIMS] = { 0 };
		tu_unflat(f, nd, sh, m);
		if (m[ax] != 0)
			continue;
		/* stable insertion sort of the lane (NaN last) */
		for (int64_t j = 0; j < A; j++) {
			m[ax] = j;
			pos[j] = tu_flat(nd, sh, m);
			int64_t p = j;
			while (p > 0 &&
			       ref_greater(va[pos[lane[p - 1]]], va[pos[j]])) {
				lane[p] = lane[p - 1];
				p--;
			}
			lane[p] = j;
		}
		for (int64_t j = 0; j < A; j++)
			ref[pos[j]] = (double)lane[j];
	}
	tu_assert_close(ctx, o, ref, 0, 0, what);
	free(va);
	free(ref);
	free(lane);
	free(pos);
	epj_tensor_free(o);
}

START_TEST(test_argsort)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[2] = { 9, 37 };
	for (int nc = 0; nc < 2; nc++) {
		epj_tensor *a = tu_randn_nc(ctx, EPJ_DTYPE_F32, 2, sh, nc);
		check_argsort(ctx, a, 1, "argsort");
		check_argsort(ctx, a, 0, "argsort axis 0");
		epj_tensor_free(a);
		/* many equal keys: stability decides the order */
		a = rand_ties(ctx, EPJ_DTYPE_F64, 2, sh, 4, nc);
		epj_tensor_set_f64(a, 5, NAN);
		epj_tensor_set_f64(a, 40, NAN);
		check_argsort(ctx, a, -1, "argsort ties");
		check_argsort(ctx, a, -2, "argsort ties axis 0");
		epj_tensor_free(a);
		a = rand_int(ctx, idx_dts[nc], 2, sh, -3, 3, nc);
		check_argsort(ctx, a, 1, "argsort ints");
		epj_tensor_free(a);
	}
	/* i64 keys beyond 2^53 must not collapse into ties */
	int64_t big[3] = { (1LL << 60) + 1, 1LL << 60, (1LL << 60) + 1 };
	int64_t three[1] = { 3 };
	epj_tensor *a = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 1, three, big);
	epj_tensor *o = epj_argsort(ctx, a, 0);
	tu_ok(ctx, o);
	const int64_t *po = epj_tensor_data(o);
	ck_assert_int_eq(po[0], 1);
	ck_assert_int_eq(po[1], 0);
	ck_assert_int_eq(po[2], 2);
	epj_tensor_free(o);
	ck_assert_ptr_null(epj_argsort(ctx, a, 1));
	ck_assert(strstr(epj_ctx_error(ctx), "argsort") != NULL);
	epj_ctx_clear_error(ctx);
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- gradients ------------------------------------------------------------
 */

typedef struct index_args {
	int kind;
	int axis;
	int64_t k;
} index_args;

enum { G_EMB, G_SELECT, G_ADD, G_GATHER, G_SCATTER, G_TOPK };

/* in[0] = a/weight, in[1] = index, in[2] = src (when used). */
static epj_tensor *index_fn(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	index_args *u = user;
	switch (u->kind) {
	case G_EMB:
		return epj_embedding(ctx, in[0], in[1]);
	case G_SELECT:
		return epj_index_select(ctx, in[0], u->axis, in[1]);
	case G_ADD:
		return epj_index_add(ctx, in[0], u->axis, in[1], in[2]);
	case G_GATHER:
		return epj_gather(ctx, in[0], u->axis, in[1]);
	case G_SCATTER:
		return epj_scatter_add(ctx, in[0], u->axis, in[1], in[2]);
	case G_TOPK: {
		epj_tensor *v = NULL, *i = NULL;
		epj_topk(ctx, in[0], u->k, &v, &i);
		epj_tensor_free(i);
		return v;
	}
	}
	return NULL;
}

static void run_gradcheck(epj_ctx *ctx, index_args *u, epj_tensor **in,
			  int n_in, const char *what)
{
	epj_tensor_set_requires_grad(in[0], true);
	if (n_in > 2)
		epj_tensor_set_requires_grad(in[2], true);
	tu_gradcheck(ctx, index_fn, in, n_in, u, 1e-6, 1e-6, 1e-7, what);
	for (int i = 0; i < n_in; i++)
		epj_tensor_free(in[i]);
}

START_TEST(test_grad_index)
{
	epj_ctx *ctx = tu_ctx();
	for (int nc = 0; nc < 2; nc++) {
		int64_t wsh[2] = { 5, 3 }, ish[2] = { 3, 4 };
		epj_tensor *in[3];
		index_args u = { .kind = G_EMB };
		in[0] = tu_randn_nc(ctx, EPJ_DTYPE_F64, 2, wsh, nc);
		in[1] = rand_int(ctx, EPJ_DTYPE_I32, 2, ish, 0, 5, nc);
		run_gradcheck(ctx, &u, in, 2, "grad embedding");

		int64_t ash[3] = { 3, 5, 4 }, nsh[1] = { 7 };
		int axis = (int)tu_randint(0, 3);
		u = (index_args){ .kind = G_SELECT, .axis = axis };
		in[0] = tu_randn_nc(ctx, EPJ_DTYPE_F64, 3, ash, nc);
		in[1] = rand_int(ctx, EPJ_DTYPE_I64, 1, nsh, 0, ash[axis], nc);
		run_gradcheck(ctx, &u, in, 2, "grad index_select");

		int64_t ssh[3] = { 3, 5, 4 };
		ssh[axis] = 7;
		u = (index_args){ .kind = G_ADD, .axis = axis };
		in[0] = tu_randn_nc(ctx, EPJ_DTYPE_F64, 3, ash, nc);
		in[1] = rand_int(ctx, EPJ_DTYPE_I64, 1, nsh, 0, ash[axis], nc);
		in[2] = tu_randn_nc(ctx, EPJ_DTYPE_F64, 3, ssh, !nc);
		run_gradcheck(ctx, &u, in, 3, "grad index_add");

		int64_t gsh[3];
		scatter_index_shape(ash, axis, gsh);
		u = (index_args){ .kind = G_GATHER, .axis = axis };
		in[0] = tu_randn_nc(ctx, EPJ_DTYPE_F64, 3, ash, nc);
		in[1] = rand_int(ctx, EPJ_DTYPE_I64, 3, gsh, 0, ash[axis], nc);
		run_gradcheck(ctx, &u, in, 2, "grad gather");

		u = (index_args){ .kind = G_SCATTER, .axis = axis };
		in[0] = tu_randn_nc(ctx, EPJ_DTYPE_F64, 3, ash, nc);
		in[1] = rand_int(ctx, EPJ_DTYPE_I32, 3, gsh, 0, ash[axis], nc);
		in[2] = tu_randn_nc(ctx, EPJ_DTYPE_F64, 3, gsh, !nc);
		run_gradcheck(ctx, &u, in, 3, "grad scatter_add");

		int64_t tsh[3] = { 2, 3, 7 };
		u = (index_args){ .kind = G_TOPK, .k = tu_randint(1, 8) };
		in[0] = tu_randn_nc(ctx, EPJ_DTYPE_F64, 3, tsh, nc);
		run_gradcheck(ctx, &u, in, 1, "grad topk");
	}
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_ops_index_suite(void)
{
	Suite *s = suite_create("ops_index");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_embedding);
	tcase_add_test(tc, test_embedding_backward_f32);
	tcase_add_test(tc, test_embedding_errors);
	tcase_add_test(tc, test_index_select);
	tcase_add_test(tc, test_index_add);
	tcase_add_test(tc, test_gather);
	tcase_add_test(tc, test_scatter_add);
	tcase_add_test(tc, test_topk);
	tcase_add_test(tc, test_argsort);
	tcase_add_test(tc, test_grad_index);
	suite_add_tcase(s, tc);
	return s;
}
