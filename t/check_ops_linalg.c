/* check_ops_linalg.c -- MATMUL, LINEAR and SOLVE_TRIANGULAR against
 * double-precision loop references written here: odd sizes, broadcast batch
 * dims, transposed / strided / expanded views (the in-place BLAS layouts and
 * the packing path), f32 / f64 / bf16; gradients by finite differences in f64;
 * bad shapes and dtypes.
 *
 * bf16 tolerance: the references read the bf16 inputs as stored (exact), the
 * kernel accumulates in f32 (error ~K * 2^-24, negligible here) and rounds
 * once to bf16, at most 2^-8 relative.  Checked with rtol 1/250
 * (2^-8 plus a margin for the f32 sums), atol 1e-3; truncation instead of
 * rounding would fail it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "check_util.h"
#include "core_impl.h"
#include "ops_impl.h"

#define LEN(a) (sizeof(a) / sizeof((a)[0]))

static const epj_dtype float_dtypes[] = { EPJ_DTYPE_F32, EPJ_DTYPE_F64,
					  EPJ_DTYPE_BF16 };

static double rtol_of(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64    ? 1e-12
	       : dt == EPJ_DTYPE_BF16 ? 1.0 / 250
				      : 1e-5;
}

static double atol_of(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? 1e-12 : dt == EPJ_DTYPE_BF16 ? 1e-3 : 1e-5;
}

/* Reference a [..., M, K] @ b [..., K, N] with numpy broadcasting of the
 * batch dims, on row-major double arrays; out has shape osh (ndim no). */
static void ref_matmul(const double *a, int na, const int64_t *ash,
		       const double *b, int nb, const int64_t *bsh, double *out,
		       int no, const int64_t *osh)
{
	int64_t m = ash[na - 2], k = ash[na - 1], n = bsh[nb - 1];
	int nbd = no - 2;
	int64_t nbatch = 1;
	for (int d = 0; d < nbd; d++)
		nbatch *= osh[d];
	for (int64_t p = 0; p < nbatch; p++) {
		int64_t idx[8], rem = p;
		for (int d = nbd - 1; d >= 0; d--) {
			idx[d] = rem % osh[d];
			rem /= osh[d];
		}
		int64_t pa = 0, pb = 0;
		for (int d = 0; d < nbd; d++) {
			int da = d - (nbd - (na - 2)),
			    db = d - (nbd - (nb - 2));
			if (da >= 0)
				pa = pa * ash[da] + (ash[da] == 1 ? 0 : idx[d]);
			if (db >= 0)
				pb = pb * bsh[db] + (bsh[db] == 1 ? 0 : idx[d]);
		}
		const double *am = a + pa * m * k, *bm = b + pb * k * n;
		double *om = out + p * m * n;
		for (int64_t i = 0; i < m; i++)
			for (int64_t j = 0; j < n; j++) {
				double s = 0;
				for (int64_t l = 0; l < k; l++)
					s += am[i * k + l] * bm[l * n + j];
				om[i * n + j] = s;
			}
	}
}

/* Checks epj_matmul(a, b) against ref_matmul on the values a, b hold. */
static void check_matmul(epj_ctx *ctx, epj_tensor *a, epj_tensor *b,
			 const char *what)
{
	epj_tensor *o = epj_matmul(ctx, a, b);
	tu_ok(ctx, o);
	ck_assert_int_eq(epj_tensor_dtype(o), epj_tensor_dtype(a));
	int na = epj_tensor_ndim(a), nb = epj_tensor_ndim(b),
	    no = epj_tensor_ndim(o);
	ck_assert_int_eq(no, na > nb ? na : nb);
	ck_assert_int_eq(epj_tensor_dim(o, -2), epj_tensor_dim(a, -2));
	ck_assert_int_eq(epj_tensor_dim(o, -1), epj_tensor_dim(b, -1));
	double *av = tu_values(ctx, a), *bv = tu_values(ctx, b);
	double *ref = malloc(sizeof *ref * (size_t)epj_tensor_numel(o));
	ref_matmul(av, na, epj_tensor_shape(a), bv, nb, epj_tensor_shape(b),
		   ref, no, epj_tensor_shape(o));
	epj_dtype dt = epj_tensor_dtype(a);
	tu_assert_close(ctx, o, ref, rtol_of(dt), atol_of(dt), what);
	free(av);
	free(bv);
	free(ref);
	epj_tensor_free(o);
}

static void check_matmul_shapes(epj_ctx *ctx, epj_dtype dt, int na,
				const int64_t *ash, int nb, const int64_t *bsh,
				const char *what)
{
	epj_tensor *a = tu_randn(ctx, dt, na, ash);
	epj_tensor *b = tu_randn(ctx, dt, nb, bsh);
	check_matmul(ctx, a, b, what);
	epj_tensor_free(a);
	epj_tensor_free(b);
}

START_TEST(test_matmul_2d)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t i = 0; i < LEN(float_dtypes); i++) {
		int64_t as[2] = { 5, 7 }, bs[2] = { 7, 3 };
		check_matmul_shapes(ctx, float_dtypes[i], 2, as, 2, bs,
				    "matmul 5x7 @ 7x3");
		int64_t as1[2] = { 1, 13 }, bs1[2] = { 13, 1 };
		check_matmul_shapes(ctx, float_dtypes[i], 2, as1, 2, bs1,
				    "matmul 1x13 @ 13x1");
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_matmul_batched_broadcast)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t i = 0; i < LEN(float_dtypes); i++) {
		epj_dtype dt = float_dtypes[i];
		int64_t a4[4] = { 2, 3, 5, 7 }, b2[2] = { 7, 4 };
		check_matmul_shapes(ctx, dt, 4, a4, 2, b2,
				    "matmul [2,3,5,7] @ [7,4]");
		int64_t b4[4] = { 1, 3, 7, 4 };
		check_matmul_shapes(ctx, dt, 4, a4, 4, b4,
				    "matmul [2,3,5,7] @ [1,3,7,4]");
		int64_t a3[4] = { 3, 1, 5, 5 }, b3[4] = { 1, 2, 5, 3 };
		check_matmul_shapes(ctx, dt, 4, a3, 4, b3,
				    "matmul [3,1,5,5] @ [1,2,5,3]");
		int64_t a2[2] = { 3, 5 }, b5[3] = { 4, 5, 2 };
		check_matmul_shapes(ctx, dt, 2, a2, 3, b5,
				    "matmul [3,5] @ [4,5,2]");
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Many small matrices (OpenMP over batches) and one larger product (BLAS
 * threads). */
START_TEST(test_matmul_sizes)
{
	epj_ctx *ctx = tu_ctx();
	int64_t a[3] = { 17, 9, 11 }, b[3] = { 17, 11, 6 };
	check_matmul_shapes(ctx, EPJ_DTYPE_F32, 3, a, 3, b,
			    "matmul 17 x [9,11] @ [11,6]");
	int64_t a2[2] = { 67, 71 }, b2[2] = { 71, 73 };
	check_matmul_shapes(ctx, EPJ_DTYPE_F32, 2, a2, 2, b2,
			    "matmul 67x71 @ 71x73");
	check_matmul_shapes(ctx, EPJ_DTYPE_BF16, 2, a2, 2, b2,
			    "matmul bf16 67x71 @ 71x73");
	int64_t z1[2] = { 3, 0 }, z2[2] = { 0, 4 };
	epj_tensor *za = tu_randn(ctx, EPJ_DTYPE_F32, 2, z1);
	epj_tensor *zb = tu_randn(ctx, EPJ_DTYPE_F32, 2, z2);
	epj_tensor *zo = epj_matmul(ctx, za, zb);
	tu_ok(ctx, zo);
	double zeros[12] = { 0 };
	tu_assert_close(ctx, zo, zeros, 0, 0, "matmul with K = 0");
	epj_tensor_free(za);
	epj_tensor_free(zb);
	epj_tensor_free(zo);
	epj_ctx_free(ctx);
}
END_TEST

/* Transposed views (BLAS transpose flags), reversed-dim storage and strided
 * or expanded views (packed), row slices (ld > cols, in place). */
START_TEST(test_matmul_views)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t i = 0; i < LEN(float_dtypes); i++) {
		epj_dtype dt = float_dtypes[i];
		int64_t s75[2] = { 7, 5 }, s37[2] = { 3, 7 };
		epj_tensor *a0 = tu_randn(ctx, dt, 2, s75);
		epj_tensor *b0 = tu_randn(ctx, dt, 2, s37);
		epj_tensor *at = epj_transpose(ctx, a0, 0, 1); /* [5,7] */
		epj_tensor *bt = epj_transpose(ctx, b0, 0, 1); /* [7,3] */
		check_matmul(ctx, at, bt, "matmul transposed views");
		ck_assert(!epj_tensor_is_contiguous(at));

		/* batched transposed view: [2,3,7,5] -> [2,3,5,7] */
		int64_t s4[4] = { 2, 3, 7, 5 }, sb[4] = { 2, 1, 7, 4 };
		epj_tensor *q0 = tu_randn(ctx, dt, 4, s4);
		epj_tensor *qt = epj_transpose(ctx, q0, 2, 3);
		epj_tensor *bb = tu_randn(ctx, dt, 4, sb);
		epj_tensor *bbn = tu_noncontig(ctx, bb);
		check_matmul(ctx, qt, bb, "matmul batched transposed view");
		check_matmul(ctx, qt, bbn, "matmul reversed-dims storage");

		/* column steps and a row slice of a wider matrix */
		int64_t s514[2] = { 5, 14 }, s97[2] = { 9, 7 };
		epj_tensor *w = tu_randn(ctx, dt, 2, s514);
		epj_tensor *ws = epj_slice(ctx, w, 1, 0, 14, 2); /* [5,7] */
		epj_tensor *r = tu_randn(ctx, dt, 2, s97);
		epj_tensor *rs = epj_slice(ctx, r, 0, 1, 8, 1); /* [7,7] */
		check_matmul(ctx, ws, rs, "matmul strided views");
		epj_tensor *wrow = epj_slice(ctx, w, 1, 2, 9, 1); /* [5,7] */
		check_matmul(ctx, wrow, bt, "matmul ld > cols");

		/* stride-0 rows (expand) inside the matrix and over batches */
		int64_t s17[2] = { 1, 7 }, e[2] = { 5, 7 };
		epj_tensor *row = tu_randn(ctx, dt, 2, s17);
		epj_tensor *ex = epj_expand(ctx, row, 2, e);
		check_matmul(ctx, ex, bt, "matmul expanded rows");
		int64_t e3[3] = { 4, 7, 3 };
		epj_tensor *bex = epj_expand(ctx, bt, 3, e3);
		check_matmul(ctx, at, bex, "matmul expanded batch");

		epj_tensor *all[] = { a0, b0, at, bt, q0,   qt,	 bb, bbn,
				      w,  ws, r,  rs, wrow, row, ex, bex };
		for (size_t j = 0; j < LEN(all); j++)
			epj_tensor_free(all[j]);
	}
	epj_ctx_free(ctx);
}
END_TEST

static epj_tensor *fn_matmul(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	(void)user;
	return epj_matmul(ctx, in[0], in[1]);
}

static void gradcheck_matmul(epj_ctx *ctx, int na, const int64_t *as, int nb,
			     const int64_t *bs, bool noncontig_a,
			     const char *what)
{
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F64, na, as);
	epj_tensor *b = tu_randn(ctx, EPJ_DTYPE_F64, nb, bs);
	if (noncontig_a) {
		epj_tensor *t = tu_noncontig(ctx, a);
		epj_tensor_free(a);
		a = t;
	}
	epj_tensor_set_requires_grad(a, true);
	epj_tensor_set_requires_grad(b, true);
	epj_tensor *in[2] = { a, b };
	tu_gradcheck(ctx, fn_matmul, in, 2, NULL, 1e-6, 1e-6, 1e-8, what);
	ck_assert_int_eq(epj_tensor_ndim(epj_tensor_grad(a)), na);
	ck_assert_int_eq(epj_tensor_ndim(epj_tensor_grad(b)), nb);
	epj_tensor_free(a);
	epj_tensor_free(b);
}

START_TEST(test_matmul_grad)
{
	epj_ctx *ctx = tu_ctx();
	int64_t a2[2] = { 3, 5 }, b2[2] = { 5, 4 };
	gradcheck_matmul(ctx, 2, a2, 2, b2, false, "matmul grad 2-D");
	gradcheck_matmul(ctx, 2, a2, 2, b2, true, "matmul grad noncontig");
	int64_t a3[3] = { 2, 3, 5 };
	gradcheck_matmul(ctx, 3, a3, 2, b2, false, "matmul grad broadcast b");
	int64_t a4[4] = { 2, 1, 3, 4 }, b3[3] = { 3, 4, 2 };
	gradcheck_matmul(ctx, 4, a4, 3, b3, true, "matmul grad broadcast both");
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_matmul_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t s57[2] = { 5, 7 }, s63[2] = { 6, 3 }, s73[2] = { 7, 3 };
	int64_t s7[1] = { 7 }, s257[3] = { 2, 5, 7 }, s374[3] = { 3, 7, 4 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 2, s57);
	epj_tensor *b = tu_randn(ctx, EPJ_DTYPE_F32, 2, s63);
	epj_tensor *b64 = tu_randn(ctx, EPJ_DTYPE_F64, 2, s73);
	epj_tensor *v = tu_randn(ctx, EPJ_DTYPE_F32, 1, s7);
	epj_tensor *a3 = tu_randn(ctx, EPJ_DTYPE_F32, 3, s257);
	epj_tensor *b3 = tu_randn(ctx, EPJ_DTYPE_F32, 3, s374);
	epj_tensor *ia = epj_randint(ctx, EPJ_DTYPE_I64, 2, s57, 0, 5);
	epj_tensor *ib = epj_randint(ctx, EPJ_DTYPE_I64, 2, s73, 0, 5);

	const char *inner[] = { "matmul", "[5,7]", "[6,3]" };
	tu_assert_error(ctx, epj_matmul(ctx, a, b), EPJ_ERR_SHAPE, inner, 3);
	const char *dtype[] = { "matmul", "f64" };
	tu_assert_error(ctx, epj_matmul(ctx, a, b64), EPJ_ERR_DTYPE, dtype, 2);
	const char *one_d[] = { "matmul", "[7]" };
	tu_assert_error(ctx, epj_matmul(ctx, v, b), EPJ_ERR_SHAPE, one_d, 2);
	const char *batch[] = { "matmul", "[2,5,7]", "[3,7,4]" };
	tu_assert_error(ctx, epj_matmul(ctx, a3, b3), EPJ_ERR_SHAPE, batch, 3);
	const char *ints[] = { "matmul", "i64" };
	tu_assert_error(ctx, epj_matmul(ctx, ia, ib), EPJ_ERR_DTYPE, ints, 2);

	epj_tensor *all[] = { a, b, b64, v, a3, b3, ia, ib };
	for (size_t j = 0; j < LEN(all); j++)
		epj_tensor_free(all[j]);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- linear ----------------------------------------------------------------
 */

/* out [rows, out] = x [rows, in] @ w[out, in]^T + bias */
static void ref_linear(const double *x, const double *w, const double *bias,
		       int64_t rows, int64_t fin, int64_t fout, double *out)
{
	for (int64_t r = 0; r < rows; r++)
		for (int64_t o = 0; o < fout; o++) {
			double s = bias ? bias[o] : 0;
			for (int64_t i = 0; i < fin; i++)
				s += x[r * fin + i] * w[o * fin + i];
			out[r * fout + o] = s;
		}
}

static void check_linear(epj_ctx *ctx, epj_tensor *x, epj_tensor *w,
			 epj_tensor *bias, const char *what)
{
	epj_tensor *o = epj_linear(ctx, x, w, bias);
	tu_ok(ctx, o);
	int nd = epj_tensor_ndim(x);
	ck_assert_int_eq(epj_tensor_ndim(o), nd);
	for (int d = 0; d < nd - 1; d++)
		ck_assert_int_eq(epj_tensor_dim(o, d), epj_tensor_dim(x, d));
	int64_t fout = epj_tensor_dim(w, 0), fin = epj_tensor_dim(w, 1);
	ck_assert_int_eq(epj_tensor_dim(o, -1), fout);
	int64_t rows = epj_tensor_numel(x) / fin;
	double *xv = tu_values(ctx, x), *wv = tu_values(ctx, w);
	double *bv = bias ? tu_values(ctx, bias) : NULL;
	double *ref = malloc(sizeof *ref * (size_t)(rows * fout));
	ref_linear(xv, wv, bv, rows, fin, fout, ref);
	epj_dtype dt = epj_tensor_dtype(x);
	tu_assert_close(ctx, o, ref, rtol_of(dt), atol_of(dt), what);
	free(xv);
	free(wv);
	free(bv);
	free(ref);
	epj_tensor_free(o);
}

START_TEST(test_linear_forward)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t i = 0; i < LEN(float_dtypes); i++) {
		epj_dtype dt = float_dtypes[i];
		int64_t xs[3] = { 2, 3, 7 }, wsh[2] = { 5, 7 }, bs[1] = { 5 };
		int64_t x1s[1] = { 7 };
		epj_tensor *x = tu_randn(ctx, dt, 3, xs);
		epj_tensor *w = tu_randn(ctx, dt, 2, wsh);
		epj_tensor *bias = tu_randn(ctx, dt, 1, bs);
		epj_tensor *x1 = tu_randn(ctx, dt, 1, x1s);
		check_linear(ctx, x, w, bias, "linear with bias");
		check_linear(ctx, x, w, NULL, "linear without bias");
		check_linear(ctx, x1, w, bias, "linear 1-D x");

		/* non-contiguous x, w and bias */
		epj_tensor *xn = tu_noncontig(ctx, x);
		epj_tensor *wn = tu_noncontig(ctx, w);
		epj_tensor *bn = tu_noncontig(ctx, bias);
		check_linear(ctx, xn, wn, bn, "linear noncontig");
		/* w as the transpose of a [in, out] matrix */
		int64_t wts[2] = { 7, 5 };
		epj_tensor *w0 = tu_randn(ctx, dt, 2, wts);
		epj_tensor *wt = epj_transpose(ctx, w0, 0, 1);
		check_linear(ctx, x, wt, bias, "linear transposed w");
		/* x rows with a gap (in place) and unmergeable rows (packed) */
		int64_t big[3] = { 2, 7, 7 };
		epj_tensor *xb = tu_randn(ctx, dt, 3, big);
		epj_tensor *xr = epj_slice(ctx, xb, 1, 0, 7, 2); /* [2,4,7] */
		check_linear(ctx, xr, w, bias,
			     "linear unmergeable rows (packed)");
		epj_tensor *xr2 = epj_slice(ctx, xb, 0, 1, 2, 1); /* [1,7,7] */
		epj_tensor *xr3 = epj_slice(ctx, xr2, 1, 1, 7, 2);
		check_linear(ctx, xr3, w, NULL, "linear rows with ld > in");

		epj_tensor *all[] = { x,  w,  bias, x1, xn,  wn, bn,
				      w0, wt, xb,   xr, xr2, xr3 };
		for (size_t j = 0; j < LEN(all); j++)
			epj_tensor_free(all[j]);
	}
	epj_ctx_free(ctx);
}
END_TEST

static epj_tensor *fn_linear(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	(void)user;
	return epj_linear(ctx, in[0], in[1], in[2]);
}

static void gradcheck_linear(epj_ctx *ctx, int nx, const int64_t *xs,
			     bool with_bias, bool noncontig, const char *what)
{
	int64_t ws[2] = { 4, xs[nx - 1] }, bs[1] = { 4 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F64, nx, xs);
	epj_tensor *w = tu_randn(ctx, EPJ_DTYPE_F64, 2, ws);
	epj_tensor *b = with_bias ? tu_randn(ctx, EPJ_DTYPE_F64, 1, bs) : NULL;
	if (noncontig) {
		epj_tensor *t = tu_noncontig(ctx, x);
		epj_tensor_free(x);
		x = t;
	}
	epj_tensor_set_requires_grad(x, true);
	epj_tensor_set_requires_grad(w, true);
	if (b)
		epj_tensor_set_requires_grad(b, true);
	epj_tensor *in[3] = { x, w, b };
	tu_gradcheck(ctx, fn_linear, in, 3, NULL, 1e-6, 1e-6, 1e-8, what);
	epj_tensor_free(x);
	epj_tensor_free(w);
	epj_tensor_free(b);
}

START_TEST(test_linear_grad)
{
	epj_ctx *ctx = tu_ctx();
	int64_t x3[3] = { 2, 3, 5 }, x1[1] = { 5 }, x2[2] = { 3, 5 };
	gradcheck_linear(ctx, 3, x3, true, false, "linear grad bias");
	gradcheck_linear(ctx, 3, x3, false, true, "linear grad noncontig");
	gradcheck_linear(ctx, 1, x1, true, false, "linear grad 1-D");
	gradcheck_linear(ctx, 2, x2, true, true, "linear grad 2-D");
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_linear_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t xs[2] = { 3, 7 }, ws[2] = { 5, 6 }, w7[2] = { 5, 7 };
	int64_t b4[1] = { 4 }, w3[3] = { 1, 5, 7 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 2, xs);
	epj_tensor *w = tu_randn(ctx, EPJ_DTYPE_F32, 2, ws);
	epj_tensor *wok = tu_randn(ctx, EPJ_DTYPE_F32, 2, w7);
	epj_tensor *w64 = tu_randn(ctx, EPJ_DTYPE_F64, 2, w7);
	epj_tensor *b = tu_randn(ctx, EPJ_DTYPE_F32, 1, b4);
	epj_tensor *wb = tu_randn(ctx, EPJ_DTYPE_F32, 3, w3);

	const char *feat[] = { "linear", "[3,7]", "[5,6]" };
	tu_assert_error(ctx, epj_linear(ctx, x, w, NULL), EPJ_ERR_SHAPE, feat,
			3);
	const char *bias[] = { "linear", "bias", "[4]" };
	tu_assert_error(ctx, epj_linear(ctx, x, wok, b), EPJ_ERR_SHAPE, bias,
			3);
	const char *dt[] = { "linear", "f64" };
	tu_assert_error(ctx, epj_linear(ctx, x, w64, NULL), EPJ_ERR_DTYPE, dt,
			2);
	const char *w3d[] = { "linear", "[1,5,7]" };
	tu_assert_error(ctx, epj_linear(ctx, x, wb, NULL), EPJ_ERR_SHAPE, w3d,
			2);

	epj_tensor *all[] = { x, w, wok, w64, b, wb };
	for (size_t j = 0; j < LEN(all); j++)
		epj_tensor_free(all[j]);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- bf16 products on AMX tiles (lib/gemm_amx.c) --------------------------
 * The tiles form each bf16 product exactly and add in f32, so against a
 * double reference an element may be off by (k + 2) f32 roundings of the
 * magnitudes it sums: |err| <= (k + 2) 2^-24 (|alpha| sum |a b| + |beta c|).
 * A wrong pair order, a lost block edge or a dropped beta is off by the
 * terms themselves. */

static uint16_t rand_bf16(void)
{
	return epj_f32_to_bf16((float)tu_uniform(-2, 2));
}

/* C = alpha op(A) op(B) + beta C through ej_gemm_bf16_amx for every layout
 * of A and B (row-major, transposed, every other column), checked against
 * double sums, the elements between n and ldc untouched. */
static void check_amx_gemm(int64_t m, int64_t n, int64_t k, float alpha,
			   float beta)
{
	int64_t big = (m > k ? m : k) * 2 + 2, bign = (n > k ? n : k) * 2 + 2;
	uint16_t *a = malloc(sizeof *a * (size_t)(big * big));
	uint16_t *b = malloc(sizeof *b * (size_t)(bign * bign));
	for (int64_t i = 0; i < big * big; i++)
		a[i] = rand_bf16();
	for (int64_t i = 0; i < bign * bign; i++)
		b[i] = rand_bf16();
	int64_t ldc = n + 3;
	float *c = malloc(sizeof *c * (size_t)(m * ldc));
	float *c0 = malloc(sizeof *c0 * (size_t)(m * ldc));
	void *scratch =
	    aligned_alloc(64, (ej_amx_scratch(m, n, k) + 63) / 64 * 64);
	/* A: [m, k] row-major (ld k + 1), transposed (ld m), every other
	 * column; B likewise with n */
	const int64_t sa[3][2] = { { k + 1, 1 }, { 1, m }, { 2 * k, 2 } };
	const int64_t sb[3][2] = { { n + 1, 1 }, { 1, k }, { 2 * n, 2 } };
	for (int la = 0; la < 3; la++)
		for (int lb = 0; lb < 3; lb++) {
			for (int64_t i = 0; i < m * ldc; i++)
				c[i] = c0[i] = (float)tu_uniform(-1, 1);
			ej_gemm_bf16_amx(m, n, k, alpha, a, sa[la][0],
					 sa[la][1], b, sb[lb][0], sb[lb][1],
					 beta, c, ldc, scratch);
			for (int64_t i = 0; i < m; i++)
				for (int64_t j = 0; j < ldc; j++) {
					double got = c[i * ldc + j];
					if (j >= n) {
						ck_assert_msg(
						    got == c0[i * ldc + j],
						    "amx %lldx%lldx%lld: C "
						    "(%lld, %lld) past n "
						    "written",
						    (long long)m, (long long)n,
						    (long long)k, (long long)i,
						    (long long)j);
						continue;
					}
					double sum = 0, mag = 0;
					for (int64_t p = 0; p < k; p++) {
						double x = epj_bf16_to_f32(
						    a[i * sa[la][0] +
						      p * sa[la][1]]);
						double y = epj_bf16_to_f32(
						    b[p * sb[lb][0] +
						      j * sb[lb][1]]);
						sum += x * y;
						mag += fabs(x * y);
					}
					double ref = alpha * sum +
						     beta * c0[i * ldc + j];
					double tol =
					    (double)(k + 2) * 0x1p-24 *
						(fabs(alpha) * mag +
						 fabs(beta * c0[i * ldc + j])) +
					    1e-30;
					ck_assert_msg(
					    fabs(got - ref) <= tol,
					    "amx %lldx%lldx%lld layouts %d,%d "
					    "alpha %g beta %g: C(%lld, %lld) "
					    "%.9g, reference %.9g",
					    (long long)m, (long long)n,
					    (long long)k, la, lb, alpha, beta,
					    (long long)i, (long long)j, got,
					    ref);
				}
		}
	free(scratch);
	free(a);
	free(b);
	free(c);
	free(c0);
}

START_TEST(test_amx_gemm)
{
	if (!ej_amx_usable()) {
		fprintf(stderr, "ops_linalg amx: this CPU or kernel offers no "
				"AMX-BF16 tiles; the AMX GEMM is not run\n");
		return;
	}
	/* edges of the 16-row tiles, 32 x 32 blocks and 32-deep k steps;
	 * alpha 1 with beta 0 or 1 has whole blocks load and store C in
	 * their tiles, other scales go through the block's own buffer */
	static const struct {
		int64_t m, n, k;
		float alpha, beta;
	} cases[] = {
		{ 1, 1, 1, 1, 0 },	  { 16, 16, 32, 1, 0.75f },
		{ 17, 15, 33, 0.5f, 0 },  { 31, 33, 31, 1, 0 },
		{ 32, 32, 64, 1, 1 },	  { 5, 70, 3, 0.5f, 0.75f },
		{ 65, 9, 97, 1, 0 },	  { 40, 47, 1, 0.5f, 1 },
		{ 64, 64, 40, 1, 1 },	  { 96, 64, 64, 1, 0 },
		{ 64, 96, 32, -1.5f, 0 },
	};
	for (size_t i = 0; i < LEN(cases); i++)
		check_amx_gemm(cases[i].m, cases[i].n, cases[i].k,
			       cases[i].alpha, cases[i].beta);
	int64_t m = tu_randint(1, 80), n = tu_randint(1, 80),
		k = tu_randint(1, 150);
	check_amx_gemm(m, n, k, (float)tu_uniform(-2, 2),
		       (float)tu_uniform(-1, 1));
}
END_TEST

/* bf16 matmul and linear, forward and backward, at sizes that take the
 * AMX path: on the tiles where the CPU has them (counted in
 * kernels.cpu_amx), never with EPJIT_CPU_AMX=0, and the same products
 * within bf16 rounding either way. */
START_TEST(test_amx_ops)
{
	setenv("EPJIT_CPU_AMX", "0", 1);
	epj_ctx *off = tu_ctx();
	unsetenv("EPJIT_CPU_AMX");
	epj_ctx *on = tu_ctx();
	epj_ctx *ctxs[2] = { on, off };
	int64_t as[3] = { 3, 37, 41 }, bs[2] = { 41, 29 };
	int64_t xs[3] = { 2, 45, 33 }, ws[2] = { 40, 33 }, bias_s[1] = { 40 };
	for (int v = 0; v < 2; v++) {
		epj_ctx *ctx = ctxs[v];
		check_matmul_shapes(ctx, EPJ_DTYPE_BF16, 3, as, 2, bs,
				    "amx matmul [3,37,41] @ [41,29]");
		epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_BF16, 3, xs);
		epj_tensor *w = tu_randn(ctx, EPJ_DTYPE_BF16, 2, ws);
		epj_tensor *bias = tu_randn(ctx, EPJ_DTYPE_BF16, 1, bias_s);
		check_linear(ctx, x, w, bias, "amx linear with bias");
		epj_tensor *wt0 =
		    tu_randn(ctx, EPJ_DTYPE_BF16, 2, (int64_t[2]){ 33, 19 });
		epj_tensor *wt = epj_transpose(ctx, wt0, 0, 1);
		check_linear(ctx, x, wt, NULL, "amx linear transposed w");
		/* backward: dx = g w, dw = g^T x, against the f64 products */
		epj_tensor_set_requires_grad(x, true);
		epj_tensor_set_requires_grad(w, true);
		epj_tensor *y = epj_linear(ctx, x, w, bias);
		tu_ok(ctx, y);
		epj_tensor *g =
		    tu_randn(ctx, EPJ_DTYPE_BF16, 3, (int64_t[3]){ 2, 45, 40 });
		ck_assert_int_eq(epj_backward(ctx, y, g), EPJ_OK);
		double *xv = tu_values(ctx, x), *wv = tu_values(ctx, w),
		       *gv = tu_values(ctx, g);
		double *dx = calloc(90 * 33, sizeof *dx),
		       *dw = calloc(40 * 33, sizeof *dw);
		for (int r = 0; r < 90; r++)
			for (int o = 0; o < 40; o++)
				for (int i = 0; i < 33; i++) {
					dx[r * 33 + i] +=
					    gv[r * 40 + o] * wv[o * 33 + i];
					dw[o * 33 + i] +=
					    gv[r * 40 + o] * xv[r * 33 + i];
				}
		tu_assert_close(ctx, epj_tensor_grad(x), dx, 1.0 / 250, 1e-2,
				"amx linear dx");
		tu_assert_close(ctx, epj_tensor_grad(w), dw, 1.0 / 250, 1e-2,
				"amx linear dw");
		free(xv);
		free(wv);
		free(gv);
		free(dx);
		free(dw);
		epj_tensor *all[] = { x, w, bias, wt0, wt, y, g };
		for (size_t j = 0; j < LEN(all); j++)
			epj_tensor_free(all[j]);
	}
	ck_assert_int_eq(epj_counter_get(off, "kernels.cpu_amx"), 0);
	if (ej_amx_usable())
		/* matmul, two linears, the backward's dx and dw */
		ck_assert_int_ge(epj_counter_get(on, "kernels.cpu_amx"), 5);
	else
		ck_assert_int_eq(epj_counter_get(on, "kernels.cpu_amx"), 0);
	epj_ctx_free(on);
	epj_ctx_free(off);
}
END_TEST

/* ---- solve_triangular ---------------------------------------------------
 * The references are written another way than the kernel's BLAS trsm: a
 * plain substitution loop in double over the values the inputs hold, and
 * the product A X multiplied back against B.  A is well conditioned (its
 * diagonal 1.5 to 2.5 in magnitude, its other entries N(0, 1) / n) so that
 * an f32 solve of 67 rows stays within 1e-4; the triangle A must not read
 * holds large values (and the diagonal too when unitriangular), so that a
 * kernel reading them fails. */

typedef struct tri_case {
	bool upper, unit;
} tri_case;

static bool tri_in(bool upper, bool unit, int64_t i, int64_t j)
{
	return upper ? (unit ? j > i : j >= i) : (unit ? j < i : j <= i);
}

/* Values of a batch of nb matrices A [n, n] for case tc (row-major). */
static double *tri_values(int64_t nb, int64_t n, tri_case tc)
{
	double *v = malloc(sizeof *v * (size_t)(nb * n * n + 1));
	for (int64_t p = 0; p < nb; p++)
		for (int64_t i = 0; i < n; i++)
			for (int64_t j = 0; j < n; j++) {
				double *e = &v[(p * n + i) * n + j];
				if (i == j && !tc.unit)
					*e = (tu_uniform(0, 1) < 0.5 ? -1 : 1) *
					     tu_uniform(1.5, 2.5);
				else if (tri_in(tc.upper, tc.unit, i, j))
					*e = tu_uniform(-1.7, 1.7) / (double)n;
				else
					*e = tu_uniform(50, 100);
			}
	return v;
}

/* A tensor of dtype dt holding nb [n, n] matrices for tc, shaped
 * [shape..., n, n] (nd dims in all). */
static epj_tensor *tri_tensor(epj_ctx *ctx, epj_dtype dt, int nd,
			      const int64_t *shape, tri_case tc)
{
	int64_t n = shape[nd - 1], nb = tu_numel(nd - 2, shape);
	double *v = tri_values(nb, n, tc);
	epj_tensor *d = epj_tensor_from_data(ctx, EPJ_DTYPE_F64, nd, shape, v);
	free(v);
	tu_ok(ctx, d);
	epj_tensor *t = epj_cast(ctx, d, dt);
	tu_ok(ctx, t);
	epj_tensor_free(d);
	return t;
}

/* Row-major batch offset of output batch p in an input of batch shape
 * ish (ni dims) broadcast to osh (no dims). */
static int64_t tri_bcast(int64_t p, int no, const int64_t *osh, int ni,
			 const int64_t *ish)
{
	int64_t idx[8], off = 0;
	for (int d = no - 1; d >= 0; d--) {
		idx[d] = p % osh[d];
		p /= osh[d];
	}
	for (int d = 0; d < ni; d++) {
		int od = d + no - ni;
		off = off * ish[d] + (ish[d] == 1 ? 0 : idx[od]);
	}
	return off;
}

/* Checks X = solve_triangular(a, b) against a substitution in double and
 * against A X = B (both on the values the inputs hold). */
static void check_solve(epj_ctx *ctx, epj_tensor *a, epj_tensor *b, tri_case tc,
			const char *what)
{
	epj_tensor *x =
	    epj_solve_triangular(ctx, a, b, tc.upper, tc.unit, true);
	tu_ok(ctx, x);
	epj_dtype dt = epj_tensor_dtype(a);
	ck_assert_int_eq(epj_tensor_dtype(x), dt);
	int na = epj_tensor_ndim(a), nb = epj_tensor_ndim(b),
	    no = epj_tensor_ndim(x);
	const int64_t *ash = epj_tensor_shape(a), *bsh = epj_tensor_shape(b),
		      *osh = epj_tensor_shape(x);
	int64_t n = osh[no - 2], k = osh[no - 1];
	ck_assert_int_eq(n, ash[na - 1]);
	ck_assert_int_eq(k, bsh[nb - 1]);
	double *av = tu_values(ctx, a), *bv = tu_values(ctx, b);
	double *xv = tu_values(ctx, x);
	int64_t nbatch = tu_numel(no - 2, osh);
	double *ref = malloc(sizeof *ref * (size_t)(nbatch * n * k + 1));
	double worst = 0;
	for (int64_t p = 0; p < nbatch; p++) {
		const double *am =
		    av + tri_bcast(p, no - 2, osh, na - 2, ash) * n * n;
		const double *bm =
		    bv + tri_bcast(p, no - 2, osh, nb - 2, bsh) * n * k;
		double *rm = ref + p * n * k, *xm = xv + p * n * k;
		for (int64_t c = 0; c < k; c++)
			for (int64_t s = 0; s < n; s++) {
				int64_t i = tc.upper ? n - 1 - s : s;
				double acc = bm[i * k + c];
				for (int64_t j = 0; j < n; j++)
					if (j != i &&
					    tri_in(tc.upper, false, i, j))
						acc -= am[i * n + j] *
						       rm[j * k + c];
				rm[i * k + c] =
				    tc.unit ? acc : acc / am[i * n + i];
			}
		/* multiplied back: A X against B, from the kernel's X */
		for (int64_t i = 0; i < n; i++)
			for (int64_t c = 0; c < k; c++) {
				double acc = 0;
				for (int64_t j = 0; j < n; j++)
					if (tri_in(tc.upper, false, i, j))
						acc += (i == j && tc.unit
							    ? 1
							    : am[i * n + j]) *
						       xm[j * k + c];
				double e = fabs(acc - bm[i * k + c]);
				worst = e > worst ? e : worst;
			}
	}
	double back = dt == EPJ_DTYPE_F64   ? 1e-12
		      : dt == EPJ_DTYPE_F32 ? 1e-4
					    : 0.1;
	ck_assert_msg(worst <= back, "%s: |A X - B| reaches %g (> %g)", what,
		      worst, back);
	double rtol = dt == EPJ_DTYPE_F64   ? 1e-10
		      : dt == EPJ_DTYPE_F32 ? 1e-4
					    : 1.0 / 128;
	double atol = dt == EPJ_DTYPE_F64   ? 1e-12
		      : dt == EPJ_DTYPE_F32 ? 1e-5
					    : 1e-2;
	tu_assert_close(ctx, x, ref, rtol, atol, what);
	free(av);
	free(bv);
	free(xv);
	free(ref);
	epj_tensor_free(x);
}

static const tri_case tri_cases[] = {
	{ false, false }, { false, true }, { true, false }, { true, true }
};

START_TEST(test_solve_tri_sizes)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t ns[] = { 1, 5, 64, 67 }, ks[] = { 1, 3, 33 };
	for (size_t d = 0; d < LEN(float_dtypes); d++)
		for (size_t c = 0; c < LEN(tri_cases); c++)
			for (size_t i = 0; i < LEN(ns); i++)
				for (size_t j = 0; j < LEN(ks); j++) {
					epj_dtype dt = float_dtypes[d];
					int64_t as[3] = { 2, ns[i], ns[i] };
					int64_t bs[3] = { 2, ns[i], ks[j] };
					epj_tensor *a = tri_tensor(
					    ctx, dt, 3, as, tri_cases[c]);
					epj_tensor *b =
					    tu_randn(ctx, dt, 3, bs);
					char what[96];
					snprintf(
					    what, sizeof what,
					    "solve %s n=%lld k=%lld upper=%d "
					    "unit=%d",
					    epj_dtype_name(dt),
					    (long long)ns[i], (long long)ks[j],
					    tri_cases[c].upper,
					    tri_cases[c].unit);
					check_solve(ctx, a, b, tri_cases[c],
						    what);
					epj_tensor_free(a);
					epj_tensor_free(b);
				}
	epj_ctx_free(ctx);
}
END_TEST

/* Broadcast batch dims, transposed and strided A and B, expanded batches. */
START_TEST(test_solve_tri_views)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t d = 0; d < LEN(float_dtypes); d++)
		for (size_t c = 0; c < LEN(tri_cases); c++) {
			epj_dtype dt = float_dtypes[d];
			tri_case tc = tri_cases[c];
			/* A [2, 1, 5, 5] against B [3, 5, 4] -> [2, 3, 5, 4] */
			int64_t as[4] = { 2, 1, 5, 5 }, bs[3] = { 3, 5, 4 };
			epj_tensor *a = tri_tensor(ctx, dt, 4, as, tc);
			epj_tensor *b = tu_randn(ctx, dt, 3, bs);
			check_solve(ctx, a, b, tc, "solve broadcast batch");
			/* A^T of the other triangle, B stored non-contiguous */
			tri_case flip = { !tc.upper, tc.unit };
			int64_t fs[3] = { 3, 7, 7 }, gs[3] = { 3, 7, 6 };
			epj_tensor *f = tri_tensor(ctx, dt, 3, fs, flip);
			epj_tensor *ft = epj_transpose(ctx, f, 1, 2);
			ck_assert(!epj_tensor_is_contiguous(ft));
			epj_tensor *g = tu_randn(ctx, dt, 3, gs);
			epj_tensor *gn = tu_noncontig(ctx, g);
			check_solve(ctx, ft, gn, tc, "solve transposed A");
			/* one A expanded over a batch, a strided slice of B */
			int64_t es[3] = { 4, 7, 7 }, hs[3] = { 4, 7, 13 };
			epj_tensor *f0 = epj_slice(ctx, f, 0, 0, 1, 1);
			epj_tensor *fe = epj_expand(ctx, f0, 3, es);
			epj_tensor *h = tu_randn(ctx, dt, 3, hs);
			epj_tensor *hs2 = epj_slice(ctx, h, 2, 0, 13, 2);
			check_solve(ctx, fe, hs2, flip, "solve expanded A");
			epj_tensor *all[] = {
				a, b, f, ft, g, gn, f0, fe, h, hs2
			};
			for (size_t j = 0; j < LEN(all); j++)
				epj_tensor_free(all[j]);
		}
	epj_ctx_free(ctx);
}
END_TEST

static epj_tensor *fn_solve(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	const tri_case *tc = user;
	return epj_solve_triangular(ctx, in[0], in[1], tc->upper, tc->unit,
				    true);
}

/* Central differences over every element of A (those outside its
 * triangle, and its diagonal when unitriangular, must get no gradient) and
 * of B. */
static void gradcheck_solve(epj_ctx *ctx, int na, const int64_t *as, int nb,
			    const int64_t *bs, tri_case tc, bool nc,
			    const char *what)
{
	epj_tensor *a = tri_tensor(ctx, EPJ_DTYPE_F64, na, as, tc);
	epj_tensor *b = tu_randn_nc(ctx, EPJ_DTYPE_F64, nb, bs, nc);
	epj_tensor_set_requires_grad(a, true);
	epj_tensor_set_requires_grad(b, true);
	epj_tensor *in[2] = { a, b };
	tu_gradcheck(ctx, fn_solve, in, 2, &tc, 1e-6, 1e-6, 1e-8, what);
	tu_assert_shape(epj_tensor_grad(a), na, as);
	tu_assert_shape(epj_tensor_grad(b), nb, bs);
	epj_tensor_free(a);
	epj_tensor_free(b);
}

START_TEST(test_solve_tri_grad)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t c = 0; c < LEN(tri_cases); c++) {
		tri_case tc = tri_cases[c];
		int64_t a2[2] = { 5, 5 }, b2[2] = { 5, 3 };
		gradcheck_solve(ctx, 2, a2, 2, b2, tc, false, "solve grad 5x3");
		int64_t a1[2] = { 1, 1 }, b1[2] = { 1, 2 };
		gradcheck_solve(ctx, 2, a1, 2, b1, tc, false, "solve grad n=1");
		int64_t a4[4] = { 2, 1, 4, 4 }, b3[3] = { 3, 4, 2 };
		gradcheck_solve(ctx, 4, a4, 3, b3, tc, true,
				"solve grad broadcast");
	}
	epj_ctx_free(ctx);
}
END_TEST

/* The f32 and bf16 backward against the f64 backward on the same values. */
START_TEST(test_solve_tri_grad_dtypes)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t c = 0; c < LEN(tri_cases); c++)
		for (int d = 0; d < 2; d++) {
			epj_dtype dt = d ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32;
			int64_t as[3] = { 2, 67, 67 }, bs[3] = { 2, 67, 33 };
			epj_tensor *a =
			    tri_tensor(ctx, dt, 3, as, tri_cases[c]);
			epj_tensor *b = tu_randn(ctx, dt, 3, bs);
			epj_tensor *w = tu_randn(ctx, dt, 3, bs);
			epj_tensor *grads[2][2];
			for (int r = 0; r < 2; r++) {
				epj_dtype rd = r ? EPJ_DTYPE_F64 : dt;
				bool prev = epj_no_grad_enter(ctx);
				epj_tensor *in[3] = { epj_cast(ctx, a, rd),
						      epj_cast(ctx, b, rd),
						      epj_cast(ctx, w, rd) };
				epj_no_grad_exit(ctx, prev);
				epj_tensor_set_requires_grad(in[0], true);
				epj_tensor_set_requires_grad(in[1], true);
				epj_tensor *x =
				    fn_solve(ctx, in, (void *)&tri_cases[c]);
				tu_ok(ctx, x);
				ck_assert_int_eq(epj_backward(ctx, x, in[2]),
						 EPJ_OK);
				for (int i = 0; i < 2; i++) {
					grads[r][i] = epj_cast(
					    ctx, epj_tensor_grad(in[i]),
					    EPJ_DTYPE_F64);
					tu_ok(ctx, grads[r][i]);
				}
				epj_tensor_free(x);
				for (int i = 0; i < 3; i++)
					epj_tensor_free(in[i]);
			}
			/* bf16: each dA element sums k = 33 products of two
			 * bf16-rounded factors of magnitude ~1 (dB and the
			 * saved X), an error of about sqrt(33) 2^-8 = 0.02 per
			 * element and 4x that at worst over 9000 of them */
			double rtol = d ? 1.0 / 64 : 1e-4;
			double atol = d ? 8e-2 : 1e-4;
			tu_assert_tensors_close(ctx, grads[0][0], grads[1][0],
						rtol, atol, "solve dA");
			tu_assert_tensors_close(ctx, grads[0][1], grads[1][1],
						rtol, atol, "solve dB");
			for (int r = 0; r < 2; r++)
				for (int i = 0; i < 2; i++)
					epj_tensor_free(grads[r][i]);
			epj_tensor_free(a);
			epj_tensor_free(b);
			epj_tensor_free(w);
		}
	epj_ctx_free(ctx);
}
END_TEST

/* t's values (a tensor of another context) in a new tensor of ctx. */
static epj_tensor *tri_move(epj_ctx *from, epj_ctx *ctx, const epj_tensor *t)
{
	double *v = tu_values(from, t);
	epj_tensor *d = epj_tensor_from_data(
	    ctx, EPJ_DTYPE_F64, epj_tensor_ndim(t), epj_tensor_shape(t), v);
	free(v);
	tu_ok(ctx, d);
	epj_tensor *r = epj_cast(ctx, d, epj_tensor_dtype(t));
	tu_ok(ctx, r);
	epj_tensor_free(d);
	return r;
}

/* Solution and gradients of solve(a, b) weighted by w in ctx: out[0] = X,
 * out[1] = dA, out[2] = dB.  transpose_a: solve with a^T (a strided A). */
static void tri_run(epj_ctx *ctx, epj_tensor *a, epj_tensor *b, epj_tensor *w,
		    tri_case tc, bool transpose_a, epj_tensor **out)
{
	epj_tensor_set_requires_grad(a, true);
	epj_tensor_set_requires_grad(b, true);
	int nd = epj_tensor_ndim(a);
	epj_tensor *at = transpose_a ? epj_transpose(ctx, a, nd - 2, nd - 1)
				     : epj_tensor_ref(a);
	tu_ok(ctx, at);
	out[0] = epj_solve_triangular(ctx, at, b, tc.upper, tc.unit, true);
	tu_ok(ctx, out[0]);
	ck_assert_int_eq(epj_backward(ctx, out[0], w), EPJ_OK);
	out[1] = epj_tensor_ref(epj_tensor_grad(a));
	out[2] = epj_tensor_ref(epj_tensor_grad(b));
	tu_ok(ctx, out[1]);
	tu_ok(ctx, out[2]);
	epj_tensor_free(at);
}

/* The CUDA template (kernels/tmpl_trsm.c) on cuda-sim against the CPU
 * kernel on the same values: forward and backward, every dtype and
 * triangle, broadcast batches, a transposed A; no CPU fallback. */
START_TEST(test_solve_tri_sim)
{
	epj_ctx *cpu = tu_ctx(), *sim = NULL;
	ck_assert_int_eq(epj_ctx_new("cuda-sim", &sim), EPJ_OK);
	const int64_t shapes[][2][3] = { { { 1, 5, 5 }, { 3, 5, 3 } },
					 { { 2, 67, 67 }, { 2, 67, 33 } },
					 { { 1, 1, 1 }, { 1, 1, 2 } } };
	for (size_t d = 0; d < LEN(float_dtypes); d++)
		for (size_t c = 0; c < LEN(tri_cases); c++)
			for (size_t sh = 0; sh < LEN(shapes); sh++) {
				epj_dtype dt = float_dtypes[d];
				bool tr = sh == 0;
				tri_case tc = tri_cases[c];
				tri_case made = { tr ? !tc.upper : tc.upper,
						  tc.unit };
				epj_tensor *a =
				    tri_tensor(cpu, dt, 3, shapes[sh][0], made);
				epj_tensor *b =
				    tu_randn(cpu, dt, 3, shapes[sh][1]);
				epj_tensor *w =
				    tu_randn(cpu, dt, 3, shapes[sh][1]);
				epj_tensor *sa = tri_move(cpu, sim, a);
				epj_tensor *sb = tri_move(cpu, sim, b);
				epj_tensor *sw = tri_move(cpu, sim, w);
				epj_tensor *want[3], *got[3];
				tri_run(cpu, a, b, w, tc, tr, want);
				int64_t fb0 = epj_counter_get(
				    sim, "kernels.eager_cpu_fallback");
				tri_run(sim, sa, sb, sw, tc, tr, got);
				ck_assert_int_eq(
				    epj_counter_get(
					sim, "kernels.eager_cpu_fallback"),
				    fb0);
				double rtol = dt == EPJ_DTYPE_F64   ? 1e-10
					      : dt == EPJ_DTYPE_F32 ? 1e-4
								    : 1.0 / 64;
				double atol = dt == EPJ_DTYPE_F64   ? 1e-12
					      : dt == EPJ_DTYPE_F32 ? 1e-4
								    : 8e-2;
				static const char *const what[3] = {
					"sim solve X", "sim solve dA",
					"sim solve dB"
				};
				for (int i = 0; i < 3; i++) {
					epj_tensor *g =
					    tri_move(sim, cpu, got[i]);
					tu_assert_tensors_close(cpu, g, want[i],
								rtol, atol,
								what[i]);
					epj_tensor_free(g);
					epj_tensor_free(got[i]);
					epj_tensor_free(want[i]);
				}
				epj_tensor *all[] = { a, b, w, sa, sb, sw };
				for (size_t j = 0; j < LEN(all); j++)
					epj_tensor_free(all[j]);
			}
	epj_ctx_free(sim);
	epj_ctx_free(cpu);
}
END_TEST

/* No columns (k = 0) and no rows (n = 0): empty solutions, and a dA of
 * zeros when B has no columns. */
START_TEST(test_solve_tri_empty)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t d = 0; d < LEN(float_dtypes); d++) {
		epj_dtype dt = float_dtypes[d];
		int64_t as[3] = { 2, 3, 3 }, bs[3] = { 2, 3, 0 };
		int64_t zs[3] = { 2, 0, 0 }, ys[3] = { 2, 0, 4 };
		epj_tensor *a = tu_randn(ctx, dt, 3, as);
		epj_tensor *b = epj_zeros(ctx, dt, 3, bs);
		epj_tensor *z = epj_zeros(ctx, dt, 3, zs);
		epj_tensor *y = epj_zeros(ctx, dt, 3, ys);
		tu_ok(ctx, y);
		epj_tensor_set_requires_grad(a, true);
		epj_tensor_set_requires_grad(b, true);
		epj_tensor *x =
		    epj_solve_triangular(ctx, a, b, false, false, 1);
		tu_ok(ctx, x);
		tu_assert_shape(x, 3, bs);
		epj_tensor *w = epj_zeros(ctx, dt, 3, bs);
		ck_assert_int_eq(epj_backward(ctx, x, w), EPJ_OK);
		tu_assert_shape(epj_tensor_grad(a), 3, as);
		tu_assert_shape(epj_tensor_grad(b), 3, bs);
		double zero[18] = { 0 };
		tu_assert_close(ctx, epj_tensor_grad(a), zero, 0, 0,
				"solve dA with k = 0");
		epj_tensor *x0 = epj_solve_triangular(ctx, z, y, true, true, 1);
		tu_ok(ctx, x0);
		tu_assert_shape(x0, 3, ys);
		epj_tensor *all[] = { a, b, z, y, x, w, x0 };
		for (size_t j = 0; j < LEN(all); j++)
			epj_tensor_free(all[j]);
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_solve_tri_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t s55[2] = { 5, 5 }, s56[2] = { 5, 6 }, s63[2] = { 6, 3 };
	int64_t s53[2] = { 5, 3 }, s5[1] = { 5 }, s255[3] = { 2, 5, 5 };
	int64_t s353[3] = { 3, 5, 3 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 2, s55);
	epj_tensor *rect = tu_randn(ctx, EPJ_DTYPE_F32, 2, s56);
	epj_tensor *b = tu_randn(ctx, EPJ_DTYPE_F32, 2, s53);
	epj_tensor *b6 = tu_randn(ctx, EPJ_DTYPE_F32, 2, s63);
	epj_tensor *b64 = tu_randn(ctx, EPJ_DTYPE_F64, 2, s53);
	epj_tensor *v = tu_randn(ctx, EPJ_DTYPE_F32, 1, s5);
	epj_tensor *a3 = tu_randn(ctx, EPJ_DTYPE_F32, 3, s255);
	epj_tensor *b3 = tu_randn(ctx, EPJ_DTYPE_F32, 3, s353);
	epj_tensor *ia = epj_randint(ctx, EPJ_DTYPE_I64, 2, s55, 0, 5);
	epj_tensor *ib = epj_randint(ctx, EPJ_DTYPE_I64, 2, s53, 0, 5);

	const char *sq[] = { "solve_triangular", "square", "[5,6]" };
	tu_assert_error(ctx, epj_solve_triangular(ctx, rect, b, 0, 0, 1),
			EPJ_ERR_SHAPE, sq, 3);
	const char *rows[] = { "solve_triangular", "B has 6 rows", "[6,3]" };
	tu_assert_error(ctx, epj_solve_triangular(ctx, a, b6, 0, 0, 1),
			EPJ_ERR_SHAPE, rows, 3);
	const char *dtype[] = { "solve_triangular", "f64" };
	tu_assert_error(ctx, epj_solve_triangular(ctx, a, b64, 0, 0, 1),
			EPJ_ERR_DTYPE, dtype, 2);
	const char *one_d[] = { "solve_triangular", "[5]" };
	tu_assert_error(ctx, epj_solve_triangular(ctx, a, v, 0, 0, 1),
			EPJ_ERR_SHAPE, one_d, 2);
	const char *batch[] = { "solve_triangular", "broadcast", "[2,5,5]" };
	tu_assert_error(ctx, epj_solve_triangular(ctx, a3, b3, 0, 0, 1),
			EPJ_ERR_SHAPE, batch, 3);
	const char *ints[] = { "solve_triangular", "i64" };
	tu_assert_error(ctx, epj_solve_triangular(ctx, ia, ib, 0, 0, 1),
			EPJ_ERR_DTYPE, ints, 2);
	const char *left[] = { "solve_triangular", "left=false",
			       "not implemented" };
	tu_assert_error(ctx, epj_solve_triangular(ctx, a, b, 0, 0, 0),
			EPJ_ERR_UNSUPPORTED, left, 3);

	epj_tensor *all[] = { a, rect, b, b6, b64, v, a3, b3, ia, ib };
	for (size_t j = 0; j < LEN(all); j++)
		epj_tensor_free(all[j]);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- OpenBLAS's kernels on a CPU newer than its release ----------------- */

START_TEST(test_blas_core_pick)
{
	const unsigned avx = EJ_CPU_AVX, avx2 = avx | EJ_CPU_AVX2_FMA,
		       avx512 = avx2 | EJ_CPU_AVX512,
		       bf16 = avx512 | EJ_CPU_AVX512_BF16;
	static const struct {
		const char *chosen;
		unsigned feats;
		const char *want; /* NULL: keep OpenBLAS's choice */
	} cases[] = {
		/* OpenBLAS's fallbacks without AVX, on CPUs that have more */
		{ "Prescott", bf16, "Cooperlake" },
		{ "Prescott", avx512, "SkylakeX" },
		{ "PRESCOTT", avx2, "Haswell" },
		{ "Nehalem", avx, "Sandybridge" },
		{ "Core2", avx512, "SkylakeX" },
		{ "Sandybridge", avx2, "Haswell" },
		{ "Sandybridge", bf16, "Cooperlake" },
		/* nothing better to pick */
		{ "Prescott", 0, NULL },
		{ "Sandybridge", avx, NULL },
		/* features that need their base: no AVX2 without AVX, no
		 * AVX-512 without AVX2, no BF16 without AVX-512 */
		{ "Prescott", EJ_CPU_AVX2_FMA | EJ_CPU_AVX512, NULL },
		{ "Prescott", avx | EJ_CPU_AVX512 | EJ_CPU_AVX512_BF16,
		  "Sandybridge" },
		{ "Prescott", avx2 | EJ_CPU_AVX512_BF16, "Haswell" },
		/* OpenBLAS knew the CPU (AVX2 and better), or a core this file
		 * does not rank (another architecture, a newer name) */
		{ "Haswell", bf16, NULL },
		{ "Zen", bf16, NULL },
		{ "SkylakeX", bf16, NULL },
		{ "Cooperlake", bf16, NULL },
		{ "SapphireRapids", bf16, NULL },
		{ "NeoverseN1", bf16, NULL },
		{ "", bf16, NULL },
		{ NULL, bf16, NULL },
	};
	for (size_t i = 0; i < LEN(cases); i++) {
		const char *got =
		    ej_blas_core_pick(cases[i].chosen, cases[i].feats);
		if (!cases[i].want)
			ck_assert_msg(!got, "case %zu (%s, %#x): picked %s", i,
				      cases[i].chosen ? cases[i].chosen : "-",
				      cases[i].feats, got);
		else
			ck_assert_msg(got && !strcmp(got, cases[i].want),
				      "case %zu (%s, %#x): picked %s, want %s",
				      i, cases[i].chosen, cases[i].feats,
				      got ? got : "(none)", cases[i].want);
	}
	/* the CPU's features are each other's bases, as the pick assumes */
	unsigned f = ej_cpu_features();
	if (f & EJ_CPU_AVX512_BF16)
		ck_assert(f & EJ_CPU_AVX512);
	if (f & EJ_CPU_AVX512)
		ck_assert(f & EJ_CPU_AVX2_FMA);
	if (f & EJ_CPU_AVX2_FMA)
		ck_assert(f & EJ_CPU_AVX);
}
END_TEST

/* c = a[m, k] @ b[k, n] through ej_linalg_gemm (f32), against a double
 * reference; the first GEMM after ej_blas_ready_reset selects the core. */
static void blas_gemm_check(int64_t m, int64_t n, int64_t k)
{
	float *a = malloc(sizeof(float) * (size_t)(m * k));
	float *b = malloc(sizeof(float) * (size_t)(k * n));
	float *c = malloc(sizeof(float) * (size_t)(m * n));
	ck_assert(a && b && c);
	for (int64_t i = 0; i < m * k; i++)
		a[i] = (float)tu_uniform(-1, 1);
	for (int64_t i = 0; i < k * n; i++)
		b[i] = (float)tu_uniform(-1, 1);
	ej_linalg_gemm(EPJ_DTYPE_F32, false, false, m, n, k, 1.0, a, k, b, n,
		       0.0, c, n);
	for (int64_t i = 0; i < m; i++)
		for (int64_t j = 0; j < n; j++) {
			double r = 0;
			for (int64_t p = 0; p < k; p++)
				r += (double)a[i * k + p] * b[p * n + j];
			ck_assert_msg(fabs(c[i * n + j] - r) <= 1e-5 * k,
				      "gemm [%lld, %lld]: %g, want %g",
				      (long long)i, (long long)j,
				      (double)c[i * n + j], r);
		}
	free(a);
	free(b);
	free(c);
}

/* OpenBLAS's core is `want` (its names' case as OpenBLAS spells them). */
static void blas_core_is(const char *want)
{
	const char *now = ej_blas_core_name();
	ck_assert_msg(now && !strcasecmp(now, want),
		      "OpenBLAS core %s, want %s", now ? now : "(none)", want);
}

START_TEST(test_blas_core_select)
{
	const char *user = getenv("OPENBLAS_CORETYPE");
	if (user && *user) {
		/* the user's choice is OpenBLAS's and stays */
		blas_gemm_check(37, 29, 41);
		return;
	}
	unsetenv("EPJIT_OPENBLAS_CORE");
	/* this process as it is: OpenBLAS's choice, re-selected when it
	 * lacks what the CPU has */
	ej_blas_ready_reset();
	blas_gemm_check(37, 29, 41);
	const char *name = ej_blas_core_name();
	unsigned f = ej_cpu_features();
	if (!name || !ej_blas_core_select(name))
		return; /* not a DYNAMIC_ARCH OpenBLAS: nothing to select */
	ck_assert_msg(!ej_blas_core_pick(name, f),
		      "after the first GEMM OpenBLAS runs %s; this CPU "
		      "(features %#x) runs %s",
		      name, f, ej_blas_core_pick(name, f));
	const char *best = ej_blas_core_pick("Prescott", f);
	char keep[32];
	snprintf(keep, sizeof keep, "%s", name);

	/* OpenBLAS fell back to Prescott (a model it does not know) */
	ck_assert(ej_blas_core_select("Prescott"));
	blas_core_is("Prescott");
	ej_blas_ready_reset();
	blas_gemm_check(64, 70, 130);
	blas_core_is(best ? best : "Prescott");
	ck_assert_ptr_null(getenv("OPENBLAS_CORETYPE"));

	/* EPJIT_OPENBLAS_CORE=0 keeps OpenBLAS's choice */
	ck_assert(ej_blas_core_select("Prescott"));
	setenv("EPJIT_OPENBLAS_CORE", "0", 1);
	ej_blas_ready_reset();
	blas_gemm_check(64, 70, 130);
	blas_core_is("Prescott");
	unsetenv("EPJIT_OPENBLAS_CORE");

	/* so does the user's OPENBLAS_CORETYPE */
	setenv("OPENBLAS_CORETYPE", "Prescott", 1);
	ej_blas_ready_reset();
	blas_gemm_check(64, 70, 130);
	blas_core_is("Prescott");
	unsetenv("OPENBLAS_CORETYPE");

	/* an unknown value is auto, with a warning */
	setenv("EPJIT_OPENBLAS_CORE", "fastest", 1);
	ej_blas_ready_reset();
	blas_gemm_check(5, 3, 7);
	blas_core_is(best ? best : "Prescott");
	unsetenv("EPJIT_OPENBLAS_CORE");

	/* the process as it was */
	ck_assert(ej_blas_core_select(keep));
	ej_blas_ready_reset();
	blas_gemm_check(3, 5, 2);
}
END_TEST

Suite *make_ops_linalg_suite(void)
{
	Suite *s = suite_create("ops_linalg");
	TCase *tc = tcase_create("matmul");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_matmul_2d);
	tcase_add_test(tc, test_matmul_batched_broadcast);
	tcase_add_test(tc, test_matmul_sizes);
	tcase_add_test(tc, test_matmul_views);
	tcase_add_test(tc, test_matmul_grad);
	tcase_add_test(tc, test_matmul_errors);
	suite_add_tcase(s, tc);
	TCase *tl = tcase_create("linear");
	tcase_set_timeout(tl, 30);
	tcase_add_test(tl, test_linear_forward);
	tcase_add_test(tl, test_linear_grad);
	tcase_add_test(tl, test_linear_errors);
	suite_add_tcase(s, tl);
	TCase *ts = tcase_create("solve_triangular");
	tcase_set_timeout(ts, 60);
	tcase_add_test(ts, test_solve_tri_sizes);
	tcase_add_test(ts, test_solve_tri_views);
	tcase_add_test(ts, test_solve_tri_grad);
	tcase_add_test(ts, test_solve_tri_grad_dtypes);
	tcase_add_test(ts, test_solve_tri_empty);
	tcase_add_test(ts, test_solve_tri_errors);
	suite_add_tcase(s, ts);

	TCase *tsim = tcase_create("solve_triangular_sim");
	tcase_set_timeout(tsim, 240);
	tcase_add_test(tsim, test_solve_tri_sim);
	suite_add_tcase(s, tsim);

	TCase *ta = tcase_create("amx");
	tcase_set_timeout(ta, 60);
	tcase_add_test(ta, test_amx_gemm);
	tcase_add_test(ta, test_amx_ops);
	suite_add_tcase(s, ta);

	TCase *tb = tcase_create("blas_core");
	tcase_set_timeout(tb, 60);
	tcase_add_test(tb, test_blas_core_pick);
	tcase_add_test(tb, test_blas_core_select);
	suite_add_tcase(s, tb);
	return s;
}
