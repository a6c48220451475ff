/* check_ops_attention.c -- SDPA and CROSS_ENTROPY against straightforward
 * double-precision references written here.
 *
 * SDPA: grouped-query heads, causal and not, T != S (the causal mask is
 * bottom-right aligned: key j is hidden from query i when j > i + S - T; with
 * T > S the first queries see nothing and give 0 and lse -inf), odd head dims,
 * Dv != D, more than one 64-query block, transposed / packed input views;
 * out and lse (read through the internal dispatch), gradients against a
 * double reference (f32, bf16) and by finite differences (f64).  Document
 * ids (packed documents): both kernels against the reference with the ids'
 * mask, for contiguous documents and for ids in any order; a packed row
 * against each of its documents run alone (out, lse, dq, dk, dv).
 *
 * Tolerances: f32 compares with rtol 1e-4 (forward) / 1e-3 (backward).  bf16
 * inputs are exact in the references and the kernels compute in f32, so the
 * forward error is the final rounding (2^-8 relative): rtol 1/250, atol 2e-3.
 * The bf16 backward uses the bf16-rounded out in rowsum(dO * O), and so
 * does its reference (with the exact out the difference reaches ~0.05 for
 * sharp softmaxes): rtol 1/250, atol 5e-3.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"
#include "core_impl.h"
#include "eager_cuda.h"
#include "jit_impl.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define LEN(a) (sizeof(a) / sizeof((a)[0]))

typedef struct cfg {
	int64_t b, hq, hkv, t, s, d, dv;
	bool causal;
	double scale; /* <= 0: 1/sqrt(D) */
} cfg;

/* The document ids of the case that runs (the tests of documents set them
 * and clear them): [B, S] (T == S) values for the references, and the same
 * as the ops' input (i32 or i64); NULL: none. */
static const int64_t *docs_ids;
static epj_tensor *docs_t;

static double cfg_scale(const cfg *c)
{
	return c->scale > 0 ? c->scale : 1.0 / sqrt((double)c->d);
}

/* Keys [0, key_end) are visible to query i. */
static int64_t ref_key_end(const cfg *c, int64_t i)
{
	int64_t e = c->causal ? i + 1 + c->s - c->t : c->s;
	return e < 0 ? 0 : (e > c->s ? c->s : e);
}

/* Softmax probabilities p[S] of query (b, h, i) and their log-sum-exp. */
static double ref_probs(const cfg *c, const double *q, const double *k,
			int64_t b, int64_t h, int64_t i, double *p)
{
	int64_t g = h / (c->hq / c->hkv), je = ref_key_end(c, i);
	const double *qi = q + ((b * c->hq + h) * c->t + i) * c->d;
	double mx = -INFINITY;
	for (int64_t j = 0; j < c->s; j++) {
		const double *kj = k + ((b * c->hkv + g) * c->s + j) * c->d;
		double s = 0;
		for (int64_t e = 0; e < c->d; e++)
			s += qi[e] * kj[e];
		bool vis = j < je && (!docs_ids || docs_ids[b * c->s + j] ==
						       docs_ids[b * c->s + i]);
		p[j] = vis ? s * cfg_scale(c) : -INFINITY;
		mx = p[j] > mx ? p[j] : mx;
	}
	if (mx == -INFINITY) { /* no visible key */
		for (int64_t j = 0; j < c->s; j++)
			p[j] = 0;
		return -INFINITY;
	}
	double sum = 0;
	for (int64_t j = 0; j < c->s; j++)
		sum += exp(p[j] - mx);
	for (int64_t j = 0; j < c->s; j++)
		p[j] = exp(p[j] - mx) / sum;
	return mx + log(sum);
}

static void ref_sdpa(const cfg *c, const double *q, const double *k,
		     const double *v, double *out, double *lse)
{
	double *p = malloc(sizeof *p * (size_t)(c->s + 1));
	for (int64_t b = 0; b < c->b; b++)
		for (int64_t h = 0; h < c->hq; h++)
			for (int64_t i = 0; i < c->t; i++) {
				int64_t row = (b * c->hq + h) * c->t + i;
				int64_t g = h / (c->hq / c->hkv);
				lse[row] = ref_probs(c, q, k, b, h, i, p);
				for (int64_t e = 0; e < c->dv; e++) {
					double s = 0;
					for (int64_t j = 0; j < c->s; j++)
						s +=
						    p[j] *
						    v[((b * c->hkv + g) * c->s +
						       j) *
							  c->dv +
						      e];
					out[row * c->dv + e] = s;
				}
			}
	free(p);
}

/* Gradients of sum(out * dout) with respect to q, k, v (zeroed here).
 * Di = sum_j p_ij dp_ij, or rowsum(dout * o) over the given out o (the
 * bf16-rounded out that a bf16 kernel has to use) when o is not NULL. */
static void ref_sdpa_backward(const cfg *c, const double *q, const double *k,
			      const double *v, const double *dout,
			      const double *o, double *dq, double *dk,
			      double *dv)
{
	memset(dq, 0, sizeof *dq * (size_t)(c->b * c->hq * c->t * c->d));
	memset(dk, 0, sizeof *dk * (size_t)(c->b * c->hkv * c->s * c->d));
	memset(dv, 0, sizeof *dv * (size_t)(c->b * c->hkv * c->s * c->dv));
	double *p = malloc(sizeof *p * (size_t)(c->s + 1));
	double *dp = malloc(sizeof *dp * (size_t)(c->s + 1));
	double sc = cfg_scale(c);
	for (int64_t b = 0; b < c->b; b++)
		for (int64_t h = 0; h < c->hq; h++)
			for (int64_t i = 0; i < c->t; i++) {
				int64_t g = h / (c->hq / c->hkv);
				int64_t row = (b * c->hq + h) * c->t + i;
				const double *go = dout + row * c->dv;
				ref_probs(c, q, k, b, h, i, p);
				double di = 0;
				for (int64_t j = 0; j < c->s; j++) {
					int64_t kv =
					    (b * c->hkv + g) * c->s + j;
					dp[j] = 0;
					for (int64_t e = 0; e < c->dv; e++) {
						dp[j] +=
						    go[e] * v[kv * c->dv + e];
						dv[kv * c->dv + e] +=
						    p[j] * go[e];
					}
					di += p[j] * dp[j];
				}
				if (o) {
					di = 0;
					for (int64_t e = 0; e < c->dv; e++)
						di +=
						    go[e] * o[row * c->dv + e];
				}
				for (int64_t j = 0; j < c->s; j++) {
					int64_t kv =
					    (b * c->hkv + g) * c->s + j;
					double ds = p[j] * (dp[j] - di) * sc;
					for (int64_t e = 0; e < c->d; e++) {
						dq[row * c->d + e] +=
						    ds * k[kv * c->d + e];
						dk[kv * c->d + e] +=
						    ds * q[row * c->d + e];
					}
				}
			}
	free(p);
	free(dp);
}

static const cfg fw_cfgs[] = {
	{ 2, 6, 2, 5, 7, 5, 3, false, 0 },   /* GQA 3:1, Dv != D */
	{ 2, 6, 3, 5, 7, 5, 5, true, 0 },    /* causal, offset S - T = 2 */
	{ 1, 4, 4, 7, 5, 4, 6, true, 0.3 },  /* T > S: 2 queries see nothing */
	{ 1, 3, 1, 70, 75, 8, 8, true, 0 },  /* two query blocks, MQA */
	{ 1, 2, 2, 1, 1, 3, 2, false, 0 },   /* one key */
	{ 1, 2, 1, 67, 67, 4, 3, false, 2 }, /* two blocks, not causal */
	/* above the kernels' serial threshold (B*Hq*T*S*D >= 2^18): the
	 * OpenMP path over (batch, head, query block) */
	{ 2, 4, 2, 70, 72, 16, 16, true, 0 },
};

static const epj_dtype float_dtypes[] = { EPJ_DTYPE_F32, EPJ_DTYPE_F64,
					  EPJ_DTYPE_BF16 };

typedef struct tol {
	double rtol, atol;
} tol;

static tol fw_tol(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64    ? (tol){ 1e-10, 1e-12 }
	       : dt == EPJ_DTYPE_BF16 ? (tol){ 1.0 / 250, 2e-3 }
				      : (tol){ 1e-4, 1e-5 };
}

static tol bw_tol(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64    ? (tol){ 1e-9, 1e-11 }
	       : dt == EPJ_DTYPE_BF16 ? (tol){ 1.0 / 250, 5e-3 }
				      : (tol){ 1e-3, 1e-4 };
}

/* Runs the SDPA op on (q, k, v) through the dispatcher: out and lse. */
static void run_sdpa(epj_ctx *ctx, const cfg *c, epj_tensor *q, epj_tensor *k,
		     epj_tensor *v, epj_tensor **out, epj_tensor **lse)
{
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, c->causal);
	ej_attrs_push_f(&at, c->scale);
	epj_tensor *in[4] = { q, k, v, docs_t }, *outs[2] = { NULL, NULL };
	ck_assert_msg(ej_dispatch(ctx, EJ_OP_SDPA, in, docs_t ? 4 : 3, &at,
				  outs, 2) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	*out = outs[0];
	*lse = outs[1];
}

/* Compares out and lse of sdpa(q, k, v) with the reference. */
static void check_sdpa(epj_ctx *ctx, const cfg *c, epj_tensor *q, epj_tensor *k,
		       epj_tensor *v, const char *what)
{
	epj_dtype dt = epj_tensor_dtype(q);
	epj_tensor *out, *lse;
	run_sdpa(ctx, c, q, k, v, &out, &lse);
	ck_assert_int_eq(epj_tensor_dtype(out), dt);
	ck_assert_int_eq(epj_tensor_dtype(lse),
			 dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32);
	int64_t os[4] = { c->b, c->hq, c->t, c->dv };
	ck_assert_int_eq(epj_tensor_ndim(out), 4);
	ck_assert_int_eq(epj_tensor_ndim(lse), 3);
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(epj_tensor_dim(out, i), os[i]);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(epj_tensor_dim(lse, i), os[i]);

	double *qv = tu_values(ctx, q), *kv = tu_values(ctx, k),
	       *vv = tu_values(ctx, v);
	double *ro = malloc(sizeof *ro * (size_t)epj_tensor_numel(out));
	double *rl = malloc(sizeof *rl * (size_t)epj_tensor_numel(lse));
	ref_sdpa(c, qv, kv, vv, ro, rl);
	tol t = fw_tol(dt);
	tu_assert_close(ctx, out, ro, t.rtol, t.atol, what);
	tu_assert_close(ctx, lse, rl, dt == EPJ_DTYPE_F64 ? 1e-12 : 1e-5,
			dt == EPJ_DTYPE_F64 ? 1e-12 : 1e-5, what);
	/* the public wrapper computes the same out */
	epj_tensor *o2 = epj_sdpa(ctx, q, k, v, c->causal, c->scale);
	tu_ok(ctx, o2);
	tu_assert_tensors_close(ctx, o2, out, 0, 0, what);
	free(qv);
	free(kv);
	free(vv);
	free(ro);
	free(rl);
	epj_tensor_free(o2);
	epj_tensor_free(out);
	epj_tensor_free(lse);
}

static void make_qkv(epj_ctx *ctx, const cfg *c, epj_dtype dt, epj_tensor **q,
		     epj_tensor **k, epj_tensor **v)
{
	int64_t qs[4] = { c->b, c->hq, c->t, c->d };
	int64_t ks[4] = { c->b, c->hkv, c->s, c->d };
	int64_t vs[4] = { c->b, c->hkv, c->s, c->dv };
	*q = tu_randn(ctx, dt, 4, qs);
	*k = tu_randn(ctx, dt, 4, ks);
	*v = tu_randn(ctx, dt, 4, vs);
}

START_TEST(test_sdpa_forward)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t i = 0; i < LEN(fw_cfgs); i++)
		for (size_t j = 0; j < LEN(float_dtypes); j++) {
			epj_tensor *q, *k, *v;
			make_qkv(ctx, &fw_cfgs[i], float_dtypes[j], &q, &k, &v);
			char what[64];
			snprintf(what, sizeof what, "sdpa cfg %zu %s", i,
				 epj_dtype_name(float_dtypes[j]));
			check_sdpa(ctx, &fw_cfgs[i], q, k, v, what);
			epj_tensor_free(q);
			epj_tensor_free(k);
			epj_tensor_free(v);
		}
	epj_ctx_free(ctx);
}
END_TEST

/* q as the [B, T, H, D] -> [B, H, T, D] transpose a projection produces (in
 * place), k with reversed-dim storage (packed), v as a transposed [.., Dv, S]
 * matrix (BLAS transpose flag). */
START_TEST(test_sdpa_views)
{
	epj_ctx *ctx = tu_ctx();
	const cfg c = { 2, 6, 2, 5, 7, 5, 3, true, 0 };
	for (size_t j = 0; j < LEN(float_dtypes); j++) {
		epj_dtype dt = float_dtypes[j];
		int64_t qs[4] = { c.b, c.t, c.hq, c.d };
		int64_t ks[4] = { c.b, c.hkv, c.s, c.d };
		int64_t vs[4] = { c.b, c.hkv, c.dv, c.s };
		epj_tensor *q0 = tu_randn(ctx, dt, 4, qs);
		epj_tensor *k0 = tu_randn(ctx, dt, 4, ks);
		epj_tensor *v0 = tu_randn(ctx, dt, 4, vs);
		epj_tensor *q = epj_transpose(ctx, q0, 1, 2);
		epj_tensor *k = tu_noncontig(ctx, k0);
		epj_tensor *v = epj_transpose(ctx, v0, 2, 3);
		tu_ok(ctx, q);
		tu_ok(ctx, v);
		check_sdpa(ctx, &c, q, k, v, "sdpa views");
		epj_tensor *all[] = { q0, k0, v0, q, k, v };
		for (size_t i = 0; i < LEN(all); i++)
			epj_tensor_free(all[i]);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Autograd through epj_sdpa against ref_sdpa_backward. */
static void check_sdpa_backward(epj_ctx *ctx, const cfg *c, epj_dtype dt,
				bool views, const char *what)
{
	epj_tensor *q, *k, *v;
	make_qkv(ctx, c, dt, &q, &k, &v);
	if (views) {
		epj_tensor *t = tu_noncontig(ctx, q);
		epj_tensor_free(q);
		q = t;
	}
	epj_tensor_set_requires_grad(q, true);
	epj_tensor_set_requires_grad(k, true);
	epj_tensor_set_requires_grad(v, true);
	epj_tensor *out = epj_sdpa(ctx, q, k, v, c->causal, c->scale);
	tu_ok(ctx, out);
	epj_tensor *w = tu_randn(ctx, dt, 4, epj_tensor_shape(out));
	epj_tensor *w_use = views ? tu_noncontig(ctx, w) : epj_tensor_ref(w);
	epj_tensor *prod = epj_mul(ctx, out, w_use);
	epj_tensor *loss = epj_sum_all(ctx, prod);
	tu_ok(ctx, loss);
	ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));

	double *qv = tu_values(ctx, q), *kv = tu_values(ctx, k),
	       *vv = tu_values(ctx, v), *wv = tu_values(ctx, w);
	double *dq = malloc(sizeof *dq * (size_t)epj_tensor_numel(q));
	double *dk = malloc(sizeof *dk * (size_t)epj_tensor_numel(k));
	double *dv = malloc(sizeof *dv * (size_t)epj_tensor_numel(v));
	double *ov = dt == EPJ_DTYPE_BF16 ? tu_values(ctx, out) : NULL;
	ref_sdpa_backward(c, qv, kv, vv, wv, ov, dq, dk, dv);
	tol t = bw_tol(dt);
	ck_assert_ptr_nonnull(epj_tensor_grad(q));
	ck_assert_ptr_nonnull(epj_tensor_grad(k));
	ck_assert_ptr_nonnull(epj_tensor_grad(v));
	ck_assert_int_eq(epj_tensor_dtype(epj_tensor_grad(q)), dt);
	tu_assert_close(ctx, epj_tensor_grad(q), dq, t.rtol, t.atol, what);
	tu_assert_close(ctx, epj_tensor_grad(k), dk, t.rtol, t.atol, what);
	tu_assert_close(ctx, epj_tensor_grad(v), dv, t.rtol, t.atol, what);
	free(qv);
	free(kv);
	free(vv);
	free(wv);
	free(ov);
	free(dq);
	free(dk);
	free(dv);
	epj_tensor *all[] = { q, k, v, out, w, w_use, prod, loss };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
}

START_TEST(test_sdpa_backward)
{
	epj_ctx *ctx = tu_ctx();
	const size_t picks[] = { 0, 1, 2, 3, 5, 6 };
	for (size_t i = 0; i < LEN(picks); i++)
		for (size_t j = 0; j < LEN(float_dtypes); j++) {
			char what[64];
			snprintf(what, sizeof what, "sdpa backward cfg %zu %s",
				 picks[i], epj_dtype_name(float_dtypes[j]));
			check_sdpa_backward(ctx, &fw_cfgs[picks[i]],
					    float_dtypes[j], i % 2 == 1, what);
		}
	epj_ctx_free(ctx);
}
END_TEST

static epj_tensor *fn_sdpa(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	const cfg *c = user;
	return epj_sdpa(ctx, in[0], in[1], in[2], c->causal, c->scale);
}

START_TEST(test_sdpa_gradcheck)
{
	epj_ctx *ctx = tu_ctx();
	const cfg cfgs[] = {
		{ 1, 4, 2, 3, 4, 3, 2, false, 0 },
		{ 1, 2, 1, 4, 3, 3, 3, true, 0 },   /* T > S */
		{ 2, 2, 2, 3, 5, 2, 2, true, 0.7 }, /* T < S */
		/* two query tiles and two key tiles of the flash kernels */
		{ 1, 2, 1, 66, 66, 1, 1, true, 0 },
	};
	for (size_t i = 0; i < LEN(cfgs); i++) {
		epj_tensor *q, *k, *v;
		make_qkv(ctx, &cfgs[i], EPJ_DTYPE_F64, &q, &k, &v);
		epj_tensor_set_requires_grad(q, true);
		epj_tensor_set_requires_grad(k, true);
		epj_tensor_set_requires_grad(v, true);
		epj_tensor *in[3] = { q, k, v };
		char what[48];
		snprintf(what, sizeof what, "sdpa gradcheck cfg %zu", i);
		tu_gradcheck(ctx, fn_sdpa, in, 3, (void *)&cfgs[i], 1e-6, 1e-5,
			     1e-7, what);
		epj_tensor_free(q);
		epj_tensor_free(k);
		epj_tensor_free(v);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* lse is not differentiable: a loss on lse alone gives zero gradients. */
START_TEST(test_sdpa_lse_no_grad)
{
	epj_ctx *ctx = tu_ctx();
	const cfg c = { 1, 2, 1, 3, 4, 3, 2, false, 0 };
	epj_tensor *q, *k, *v, *out, *lse;
	make_qkv(ctx, &c, EPJ_DTYPE_F64, &q, &k, &v);
	epj_tensor_set_requires_grad(q, true);
	run_sdpa(ctx, &c, q, k, v, &out, &lse);
	epj_tensor *loss = epj_sum_all(ctx, lse);
	tu_ok(ctx, loss);
	ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_tensor *g = epj_tensor_grad(q);
	if (g) {
		double zero[18] = { 0 };
		tu_assert_close(ctx, g, zero, 0, 0, "sdpa grad through lse");
	}
	epj_tensor *all[] = { q, k, v, out, lse, loss };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_sdpa_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t qs[4] = { 1, 6, 3, 5 }, k4[4] = { 1, 4, 3, 5 };
	int64_t k2[4] = { 1, 2, 3, 5 }, kd[4] = { 1, 2, 3, 4 };
	int64_t q3[3] = { 6, 3, 5 }, v2[4] = { 1, 2, 4, 5 };
	epj_tensor *q = tu_randn(ctx, EPJ_DTYPE_F32, 4, qs);
	epj_tensor *kbad = tu_randn(ctx, EPJ_DTYPE_F32, 4, k4);
	epj_tensor *k = tu_randn(ctx, EPJ_DTYPE_F32, 4, k2);
	epj_tensor *k64 = tu_randn(ctx, EPJ_DTYPE_F64, 4, k2);
	epj_tensor *kdd = tu_randn(ctx, EPJ_DTYPE_F32, 4, kd);
	epj_tensor *qbad = tu_randn(ctx, EPJ_DTYPE_F32, 3, q3);
	epj_tensor *vs = tu_randn(ctx, EPJ_DTYPE_F32, 4, v2);

	const char *heads[] = { "sdpa", "Hq=6", "Hkv=4" };
	tu_assert_error(ctx, epj_sdpa(ctx, q, kbad, kbad, false, 0),
			EPJ_ERR_SHAPE, heads, 3);
	const char *dt[] = { "sdpa", "f64" };
	tu_assert_error(ctx, epj_sdpa(ctx, q, k64, k, true, 0), EPJ_ERR_DTYPE,
			dt, 2);
	const char *dd[] = { "sdpa", "D=5", "D=4" };
	tu_assert_error(ctx, epj_sdpa(ctx, q, kdd, kdd, false, 0),
			EPJ_ERR_SHAPE, dd, 3);
	const char *nd[] = { "sdpa", "4-D" };
	tu_assert_error(ctx, epj_sdpa(ctx, qbad, k, k, false, 0), EPJ_ERR_SHAPE,
			nd, 2);
	const char *sv[] = { "sdpa", "[1,2,4,5]" };
	tu_assert_error(ctx, epj_sdpa(ctx, q, k, vs, false, 0), EPJ_ERR_SHAPE,
			sv, 2);

	epj_tensor *all[] = { q, kbad, k, k64, kdd, qbad, vs };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- flash kernels against the reference kernels ---------------------------
 * Both kernels of one context are selected through ctx->sdpa_reference
 * (EPJIT_SDPA in the environment sets it when a context is made). */

/* Runs SDPA_BACKWARD on (dout, q, k, v, out, lse): dq, dk, dv in g. */
static void run_sdpa_bw(epj_ctx *ctx, const cfg *c, epj_tensor *dout,
			epj_tensor *q, epj_tensor *k, epj_tensor *v,
			epj_tensor *out, epj_tensor *lse, epj_tensor **g)
{
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, c->causal);
	ej_attrs_push_f(&at, cfg_scale(c));
	epj_tensor *in[7] = { dout, q, k, v, out, lse, docs_t };
	g[0] = g[1] = g[2] = NULL;
	ck_assert_msg(ej_dispatch(ctx, EJ_OP_SDPA_BACKWARD, in, docs_t ? 7 : 6,
				  &at, g, 3) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
}

/* out, lse, dq, dk, dv of one kernel on given inputs. */
typedef struct sdpa_res {
	epj_tensor *t[5];
} sdpa_res;

static sdpa_res sdpa_run_kernel(epj_ctx *ctx, const cfg *c, bool reference,
				epj_tensor *q, epj_tensor *k, epj_tensor *v,
				epj_tensor *dout)
{
	sdpa_res r;
	bool prev = ctx->sdpa_reference;
	ctx->sdpa_reference = reference;
	cfg cs = *c;
	cs.scale = cfg_scale(c);
	run_sdpa(ctx, &cs, q, k, v, &r.t[0], &r.t[1]);
	run_sdpa_bw(ctx, c, dout, q, k, v, r.t[0], r.t[1], r.t + 2);
	ctx->sdpa_reference = prev;
	return r;
}

static void sdpa_res_free(sdpa_res *r)
{
	for (int i = 0; i < 5; i++)
		epj_tensor_free(r->t[i]);
}

/* Flash and reference kernels against the double reference (forward, lse,
 * backward) and against each other. */
static void check_flash_case(epj_ctx *ctx, const cfg *c, epj_dtype dt,
			     const char *what)
{
	epj_tensor *q, *k, *v;
	make_qkv(ctx, c, dt, &q, &k, &v);
	int64_t os[4] = { c->b, c->hq, c->t, c->dv };
	epj_tensor *dout = tu_randn(ctx, dt, 4, os);
	sdpa_res fl = sdpa_run_kernel(ctx, c, false, q, k, v, dout);
	sdpa_res rf = sdpa_run_kernel(ctx, c, true, q, k, v, dout);

	double *qv = tu_values(ctx, q), *kv = tu_values(ctx, k),
	       *vv = tu_values(ctx, v), *gv = tu_values(ctx, dout);
	double *ro = malloc(sizeof *ro * (size_t)epj_tensor_numel(fl.t[0]));
	double *rl = malloc(sizeof *rl * (size_t)(epj_tensor_numel(fl.t[1])));
	double *dq = malloc(sizeof *dq * (size_t)epj_tensor_numel(q));
	double *dk = malloc(sizeof *dk * (size_t)epj_tensor_numel(k));
	double *dv = malloc(sizeof *dv * (size_t)epj_tensor_numel(v));
	ref_sdpa(c, qv, kv, vv, ro, rl);
	tol ft = fw_tol(dt), bt = bw_tol(dt);
	double lt = dt == EPJ_DTYPE_F64 ? 1e-12 : 1e-5;
	sdpa_res *both[2] = { &fl, &rf };
	for (int a = 0; a < 2; a++) {
		char w2[96];
		snprintf(w2, sizeof w2, "%s %s", what,
			 a ? "reference" : "flash");
		tu_assert_close(ctx, both[a]->t[0], ro, ft.rtol, ft.atol, w2);
		tu_assert_close(ctx, both[a]->t[1], rl, lt, lt, w2);
		/* bf16: Di from the bf16-rounded out of this kernel */
		double *ov =
		    dt == EPJ_DTYPE_BF16 ? tu_values(ctx, both[a]->t[0]) : NULL;
		ref_sdpa_backward(c, qv, kv, vv, gv, ov, dq, dk, dv);
		tu_assert_close(ctx, both[a]->t[2], dq, bt.rtol, bt.atol, w2);
		tu_assert_close(ctx, both[a]->t[3], dk, bt.rtol, bt.atol, w2);
		tu_assert_close(ctx, both[a]->t[4], dv, bt.rtol, bt.atol, w2);
		free(ov);
	}
	/* the two kernels agree more closely than either with the truth
	 * (bf16 outputs may differ by one rounding) */
	for (int i = 0; i < 5; i++) {
		double r = dt == EPJ_DTYPE_F64	  ? 1e-11
			   : dt == EPJ_DTYPE_BF16 ? 1.0 / 120
						  : 2e-4;
		tu_assert_tensors_close(ctx, fl.t[i], rf.t[i], r, r, what);
	}
	free(qv);
	free(kv);
	free(vv);
	free(gv);
	free(ro);
	free(rl);
	free(dq);
	free(dk);
	free(dv);
	sdpa_res_free(&fl);
	sdpa_res_free(&rf);
	epj_tensor *all[] = { q, k, v, dout };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
}

/* T = S in 1, 7, 33, 129 (one row; tails of the 64-row query and 64-key
 * tiles: partial first tile, two full tiles + 1), D in 8, 24, 64, heads
 * Hq/Hkv 4/2, 6/3, 2/2, causal and not, every float dtype; plus T != S. */
START_TEST(test_sdpa_flash_vs_reference)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t ts[] = { 1, 7, 33, 129 }, ds[] = { 8, 24, 64 };
	const int64_t hs[][2] = { { 4, 2 }, { 6, 3 }, { 2, 2 } };
	int n = 0;
	for (size_t it = 0; it < LEN(ts); it++)
		for (int causal = 0; causal < 2; causal++)
			for (size_t j = 0; j < LEN(float_dtypes); j++, n++) {
				int64_t d = ds[n % 3];
				const int64_t *h = hs[(n / 3) % 3];
				cfg c = { 1 + n % 2, h[0],   h[1],
					  ts[it],    ts[it], d,
					  d,	     causal, 0 };
				char what[96];
				snprintf(what, sizeof what,
					 "flash T %lld D %lld H %lld/%lld%s %s",
					 (long long)c.t, (long long)d,
					 (long long)h[0], (long long)h[1],
					 causal ? " causal" : "",
					 epj_dtype_name(float_dtypes[j]));
				check_flash_case(ctx, &c, float_dtypes[j],
						 what);
			}
	const cfg odd[] = {
		{ 1, 6, 3, 129, 70, 24, 8, true, 0 }, /* T > S, Dv != D */
		{ 2, 4, 2, 33, 129, 8, 24, true, 0 }, /* T < S */
		{ 1, 2, 1, 65, 130, 8, 8, false, 0.5 },
	};
	for (size_t i = 0; i < LEN(odd); i++)
		for (size_t j = 0; j < LEN(float_dtypes); j++) {
			char what[64];
			snprintf(what, sizeof what, "flash odd cfg %zu %s", i,
				 epj_dtype_name(float_dtypes[j]));
			check_flash_case(ctx, &odd[i], float_dtypes[j], what);
		}
	epj_ctx_free(ctx);
}
END_TEST

/* The flash kernels give the same bits on 1 and 3 threads (the shapes are
 * above the kernels' serial threshold, so 3 threads do run). */
START_TEST(test_sdpa_flash_threads)
{
#ifdef _OPENMP
	epj_ctx *ctx = tu_ctx();
	const cfg cs[] = {
		{ 2, 6, 3, 129, 129, 24, 24, true, 0 },
		{ 2, 4, 2, 100, 90, 16, 8, false, 0 },
	};
	const epj_dtype dts[] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16 };
	int prev = omp_get_max_threads();
	for (size_t i = 0; i < LEN(cs); i++)
		for (size_t j = 0; j < LEN(dts); j++) {
			epj_tensor *q, *k, *v;
			make_qkv(ctx, &cs[i], dts[j], &q, &k, &v);
			int64_t os[4] = { cs[i].b, cs[i].hq, cs[i].t,
					  cs[i].dv };
			epj_tensor *dout = tu_randn(ctx, dts[j], 4, os);
			omp_set_num_threads(1);
			sdpa_res r1 =
			    sdpa_run_kernel(ctx, &cs[i], false, q, k, v, dout);
			omp_set_num_threads(3);
			sdpa_res r3 =
			    sdpa_run_kernel(ctx, &cs[i], false, q, k, v, dout);
			for (int x = 0; x < 5; x++)
				tu_assert_tensors_close(ctx, r1.t[x], r3.t[x],
							0, 0,
							"flash 1 vs 3 threads");
			sdpa_res_free(&r1);
			sdpa_res_free(&r3);
			epj_tensor *all[] = { q, k, v, dout };
			for (size_t x = 0; x < LEN(all); x++)
				epj_tensor_free(all[x]);
		}
	omp_set_num_threads(prev);
	epj_ctx_free(ctx);
#endif
}
END_TEST

/* EPJIT_SDPA picks the kernels when a context is made; a bad value is an
 * error of epj_ctx_new. */
START_TEST(test_sdpa_env)
{
	const char *old = getenv("EPJIT_SDPA");
	char *keep = old ? strdup(old) : NULL;
	epj_ctx *ctx = NULL;
	setenv("EPJIT_SDPA", "reference", 1);
	ck_assert_int_eq(epj_ctx_new("cpu", &ctx), EPJ_OK);
	ck_assert(ctx->sdpa_reference);
	epj_ctx_free(ctx);
	setenv("EPJIT_SDPA", "flash", 1);
	ck_assert_int_eq(epj_ctx_new("cpu", &ctx), EPJ_OK);
	ck_assert(!ctx->sdpa_reference);
	epj_ctx_free(ctx);
	setenv("EPJIT_SDPA", "fast", 1);
	ck_assert_int_eq(epj_ctx_new("cpu", &ctx), EPJ_ERR_INVALID);
	ck_assert_ptr_null(ctx);
	if (keep)
		setenv("EPJIT_SDPA", keep, 1);
	else
		unsetenv("EPJIT_SDPA");
	free(keep);
}
END_TEST

/* ---- documents --------------------------------------------------------------
 * Document ids [B, S]: contiguous documents of random lengths per row (the
 * packed rows of a dataset), or ids drawn at random from a few values (any
 * order: the kernels compare ids, they do not assume runs). */

/* Fills ids [B, S]: runs of 1..maxlen positions (contiguous) or random
 * values in [0, 3). */
static void make_doc_ids(int64_t *ids, int64_t B, int64_t S, bool runs,
			 int64_t maxlen)
{
	for (int64_t b = 0; b < B; b++) {
		int64_t doc = 10 * b, left = tu_randint(1, maxlen + 1);
		for (int64_t j = 0; j < S; j++) {
			if (!runs) {
				ids[b * S + j] = tu_randint(0, 3);
				continue;
			}
			if (left == 0) {
				doc++;
				left = tu_randint(1, maxlen + 1);
			}
			ids[b * S + j] = doc;
			left--;
		}
	}
}

static epj_tensor *ids_tensor(epj_ctx *ctx, const int64_t *ids, int64_t B,
			      int64_t S, epj_dtype dt)
{
	int64_t shp[2] = { B, S };
	epj_tensor *t = epj_zeros(ctx, dt, 2, shp);
	tu_ok(ctx, t);
	for (int64_t i = 0; i < B * S; i++)
		epj_tensor_set_f64(t, i, (double)ids[i]);
	return t;
}

/* Both kernels with document ids against the double reference with the
 * ids' mask (check_flash_case), contiguous documents and ids in any order,
 * i64 and i32 ids, every dtype; lengths across the 64-row and 64-key
 * tiles, so that tile pairs of other documents are skipped and mixed tiles
 * are masked per element. */
START_TEST(test_sdpa_docs)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t ts[] = { 7, 70, 129 };
	int n = 0;
	for (size_t it = 0; it < LEN(ts); it++)
		for (int runs = 1; runs >= 0; runs--)
			for (int causal = 1; causal >= 0; causal--, n++) {
				int64_t T = ts[it], B = 2;
				int64_t *ids = malloc(sizeof *ids * B * T);
				make_doc_ids(ids, B, T, runs, T < 20 ? 3 : 40);
				epj_dtype idt =
				    n % 2 ? EPJ_DTYPE_I32 : EPJ_DTYPE_I64;
				cfg c = { B, 4,	     2, T, T, 8 + 16 * (n % 2),
					  8, causal, 0 };
				docs_ids = ids;
				docs_t = ids_tensor(ctx, ids, B, T, idt);
				epj_dtype dt = float_dtypes[n % 3];
				char what[96];
				snprintf(
				    what, sizeof what,
				    "docs T %lld %s%s %s ids %s", (long long)T,
				    runs ? "contiguous" : "any order",
				    causal ? " causal" : "", epj_dtype_name(dt),
				    epj_dtype_name(idt));
				check_flash_case(ctx, &c, dt, what);
				epj_tensor_free(docs_t);
				docs_t = NULL;
				docs_ids = NULL;
				free(ids);
			}
	epj_ctx_free(ctx);
}
END_TEST

/* Rows [lo, hi) of the time axis (dim 2) of batch b of x [B, H, T, D]:
 * [1, H, hi - lo, D]. */
static epj_tensor *doc_rows(epj_ctx *ctx, epj_tensor *x, int64_t b, int64_t lo,
			    int64_t hi)
{
	epj_tensor *xb = epj_slice(ctx, x, 0, b, b + 1, 1);
	epj_tensor *r = epj_slice(ctx, xb, 2, lo, hi, 1);
	epj_tensor *c = epj_contiguous(ctx, r);
	tu_ok(ctx, c);
	epj_tensor_free(xb);
	epj_tensor_free(r);
	return c;
}

/* A packed row of contiguous documents gives, for every document, what the
 * same kernel gives on that document alone: out, lse, dq, dk, dv (flash
 * and reference kernels, causal, every dtype). */
START_TEST(test_sdpa_docs_alone)
{
	epj_ctx *ctx = tu_ctx();
	for (int n = 0; n < 6; n++) {
		bool reference = n >= 3;
		epj_dtype dt = float_dtypes[n % 3];
		int64_t B = 2, T = 97;
		int64_t *ids = malloc(sizeof *ids * B * T);
		make_doc_ids(ids, B, T, true, 60);
		cfg c = { B, 4, 2, T, T, 16, 12, true, 0 };
		docs_ids = ids;
		docs_t = ids_tensor(ctx, ids, B, T, EPJ_DTYPE_I64);
		epj_tensor *q, *k, *v;
		make_qkv(ctx, &c, dt, &q, &k, &v);
		int64_t os[4] = { B, c.hq, T, c.dv };
		epj_tensor *dout = tu_randn(ctx, dt, 4, os);
		sdpa_res pk =
		    sdpa_run_kernel(ctx, &c, reference, q, k, v, dout);
		epj_tensor *ids_t = docs_t;
		docs_ids = NULL; /* each document alone: no ids */
		docs_t = NULL;
		/* f32 and bf16: the tiles of a document alone start at
		 * other rows than in the packed row (other summation) */
		double r = dt == EPJ_DTYPE_F64	  ? 1e-12
			   : dt == EPJ_DTYPE_BF16 ? 1.0 / 120
						  : 2e-5;
		int docs = 0;
		for (int64_t b = 0; b < B; b++)
			for (int64_t lo = 0; lo < T;) {
				int64_t hi = lo + 1;
				while (hi < T &&
				       ids[b * T + hi] == ids[b * T + lo])
					hi++;
				cfg a = { 1,   c.hq, c.hkv, hi - lo, hi - lo,
					  c.d, c.dv, true,  0 };
				epj_tensor *in[4] = {
					doc_rows(ctx, q, b, lo, hi),
					doc_rows(ctx, k, b, lo, hi),
					doc_rows(ctx, v, b, lo, hi),
					doc_rows(ctx, dout, b, lo, hi)
				};
				sdpa_res al =
				    sdpa_run_kernel(ctx, &a, reference, in[0],
						    in[1], in[2], in[3]);
				char what[96];
				snprintf(what, sizeof what,
					 "%s %s row %lld document [%lld, %lld)",
					 reference ? "reference" : "flash",
					 epj_dtype_name(dt), (long long)b,
					 (long long)lo, (long long)hi);
				for (int x = 0; x < 5; x++) {
					epj_tensor *part;
					if (x == 1) { /* lse [B, H, T] */
						epj_tensor *l3 = epj_reshape(
						    ctx, pk.t[1], 4,
						    (int64_t[]){ B, c.hq, T,
								 1 });
						epj_tensor *l4 = doc_rows(
						    ctx, l3, b, lo, hi);
						part = epj_reshape(
						    ctx, l4, 3,
						    (int64_t[]){ 1, c.hq,
								 hi - lo });
						epj_tensor_free(l3);
						epj_tensor_free(l4);
					} else {
						part = doc_rows(ctx, pk.t[x], b,
								lo, hi);
					}
					tu_ok(ctx, part);
					tu_assert_tensors_close(
					    ctx, part, al.t[x], r, r, what);
					epj_tensor_free(part);
				}
				sdpa_res_free(&al);
				for (int x = 0; x < 4; x++)
					epj_tensor_free(in[x]);
				docs++;
				lo = hi;
			}
		ck_assert_int_ge(docs, 3);
		sdpa_res_free(&pk);
		epj_tensor *all[] = { q, k, v, dout, ids_t };
		for (size_t x = 0; x < LEN(all); x++)
			epj_tensor_free(all[x]);
		free(ids);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Document ids: [B, S] integers, T == S, at most one more input. */
START_TEST(test_sdpa_docs_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t qs[4] = { 2, 2, 5, 4 }, k3[4] = { 2, 2, 3, 4 };
	int64_t s5[2] = { 2, 5 }, s4[2] = { 2, 4 }, s3[2] = { 2, 3 };
	epj_tensor *q = tu_randn(ctx, EPJ_DTYPE_F32, 4, qs);
	epj_tensor *k3t = tu_randn(ctx, EPJ_DTYPE_F32, 4, k3);
	epj_tensor *ids = epj_zeros(ctx, EPJ_DTYPE_I64, 2, s5);
	epj_tensor *ids4 = epj_zeros(ctx, EPJ_DTYPE_I64, 2, s4);
	epj_tensor *ids3 = epj_zeros(ctx, EPJ_DTYPE_I64, 2, s3);
	epj_tensor *fids = epj_zeros(ctx, EPJ_DTYPE_F32, 2, s5);
	const char *sh[] = { "sdpa", "document ids", "[2, 5]" };
	tu_assert_error(ctx, epj_sdpa_docs(ctx, q, q, q, ids4, true, 0),
			EPJ_ERR_SHAPE, sh, 3);
	const char *ts[] = { "sdpa", "T=5", "S=3" };
	tu_assert_error(ctx, epj_sdpa_docs(ctx, q, k3t, k3t, ids3, false, 0),
			EPJ_ERR_SHAPE, ts, 3);
	const char *dt[] = { "sdpa", "i32 or i64" };
	tu_assert_error(ctx, epj_sdpa_docs(ctx, q, q, q, fids, true, 0),
			EPJ_ERR_DTYPE, dt, 2);
	epj_tensor *five[5] = { q, q, q, ids, ids }, *outs[2] = { 0 };
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, 1);
	ej_attrs_push_f(&at, 0.5);
	ck_assert_int_eq(ej_dispatch(ctx, EJ_OP_SDPA, five, 5, &at, outs, 2),
			 EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "at most 4 inputs"));
	epj_tensor *all[] = { q, k3t, ids, ids4, ids3, fids };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- additive masks
 * ---------------------------------------------------------- The optional mask
 * input (attr i[1] bit 1; bit 2 aligns causal top-left): both kernels against a
 * double reference written from whole score rows (scale q k^T + mask, -inf
 * above the diagonal, softmax; a row whose keys are all hidden gives out 0 and
 * lse 0, as PyTorch's CPU flash kernel). */

typedef struct mcase {
	cfg c;
	int64_t ms[4]; /* the mask's shape: each dim 1 or the full size */
	int kind;      /* 0: 0 / -inf (some rows fully hidden), 1: random, 2:
			* the first half of the keys of batch 0 hidden */
	bool top_left;
	epj_dtype mdt; /* EPJ_DTYPE_COUNT: the dtype of q */
} mcase;

/* Random mask values of shape ms: 0 or -inf (a third hidden, every key of
 * one query row and of the last key hidden) or N(0, 1) * 2. */
static double *mask_values(const mcase *mc)
{
	int64_t n = tu_numel(4, mc->ms);
	double *x = malloc(sizeof *x * (size_t)n);
	for (int64_t f = 0; f < n; f++) {
		int64_t ix[4];
		tu_unflat(f, 4, mc->ms, ix);
		if (mc->kind == 1) {
			x[f] = tu_uniform(-2, 2);
			continue;
		}
		if (mc->kind == 2) { /* batch 0: the first half padding */
			x[f] = ix[0] == 0 && ix[3] < mc->ms[3] / 2 ? -INFINITY
								   : 0.0;
			continue;
		}
		bool row0 = ix[2] == mc->ms[2] - 1 && ix[0] == 0;
		bool hide = row0 || ix[3] == mc->ms[3] - 1 ||
			    tu_uniform(0, 1) < 1.0 / 3;
		x[f] = hide ? -INFINITY : 0.0;
	}
	return x;
}

/* The mask value of (b, h, i, j) from values of shape ms. */
static double mask_at(const mcase *mc, const double *x, int64_t b, int64_t h,
		      int64_t i, int64_t j)
{
	int64_t ix[4] = { b, h, i, j };
	for (int a = 0; a < 4; a++)
		ix[a] = mc->ms[a] == 1 ? 0 : ix[a];
	return x[tu_flat(4, mc->ms, ix)];
}

/* out, lse and (when dout is given) dq, dk, dv of the masked attention,
 * one score row at a time; Di from o (the kernel's out) when given. */
static void ref_masked(const mcase *mc, const double *mk, const double *q,
		       const double *k, const double *v, const double *dout,
		       const double *o, double *out, double *lse, double *dq,
		       double *dk, double *dv)
{
	const cfg *c = &mc->c;
	double sc = cfg_scale(c), *p = calloc((size_t)c->s + 1, sizeof *p);
	double *dp = calloc((size_t)c->s + 1, sizeof *dp);
	if (dout) {
		memset(dq, 0,
		       sizeof *dq * (size_t)(c->b * c->hq * c->t * c->d));
		memset(dk, 0,
		       sizeof *dk * (size_t)(c->b * c->hkv * c->s * c->d));
		memset(dv, 0,
		       sizeof *dv * (size_t)(c->b * c->hkv * c->s * c->dv));
	}
	for (int64_t b = 0; b < c->b; b++)
		for (int64_t h = 0; h < c->hq; h++)
			for (int64_t i = 0; i < c->t; i++) {
				int64_t g = h / (c->hq / c->hkv);
				int64_t row = (b * c->hq + h) * c->t + i;
				int64_t last =
				    mc->top_left ? i : i + c->s - c->t;
				double mx = -INFINITY, sum = 0;
				for (int64_t j = 0; j < c->s; j++) {
					const double *kj =
					    k + ((b * c->hkv + g) * c->s + j) *
						    c->d;
					double s = 0;
					for (int64_t e = 0; e < c->d; e++)
						s += q[row * c->d + e] * kj[e];
					p[j] = s * sc +
					       mask_at(mc, mk, b, h, i, j);
					if (c->causal && j > last)
						p[j] = -INFINITY;
					mx = fmax(mx, p[j]);
				}
				for (int64_t j = 0; j < c->s; j++)
					sum += mx == -INFINITY ? 0
							       : exp(p[j] - mx);
				for (int64_t j = 0; j < c->s; j++)
					p[j] =
					    sum > 0 ? exp(p[j] - mx) / sum : 0;
				lse[row] = sum > 0 ? mx + log(sum) : 0.0;
				const double *vg =
				    v + (b * c->hkv + g) * c->s * c->dv;
				for (int64_t e = 0; e < c->dv; e++) {
					double a = 0;
					for (int64_t j = 0; j < c->s; j++)
						a += p[j] * vg[j * c->dv + e];
					out[row * c->dv + e] = a;
				}
				if (!dout)
					continue;
				const double *go = dout + row * c->dv;
				const double *od = o ? o : out;
				double di = 0;
				for (int64_t e = 0; e < c->dv; e++)
					di += go[e] * od[row * c->dv + e];
				for (int64_t j = 0; j < c->s; j++) {
					int64_t kv =
					    (b * c->hkv + g) * c->s + j;
					dp[j] = 0;
					for (int64_t e = 0; e < c->dv; e++) {
						dp[j] +=
						    go[e] * vg[j * c->dv + e];
						dv[kv * c->dv + e] +=
						    p[j] * go[e];
					}
					double ds = p[j] * (dp[j] - di) * sc;
					for (int64_t e = 0; e < c->d; e++) {
						dq[row * c->d + e] +=
						    ds * k[kv * c->d + e];
						dk[kv * c->d + e] +=
						    ds * q[row * c->d + e];
					}
				}
			}
	free(p);
	free(dp);
}

static ej_attrs mask_attrs(const mcase *mc)
{
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, mc->c.causal);
	ej_attrs_push_i(&at, 1 | (mc->top_left ? 2 : 0));
	ej_attrs_push_f(&at, cfg_scale(&mc->c));
	return at;
}

/* out, lse, dq, dk, dv of one kernel with the mask. */
static sdpa_res mask_run(epj_ctx *ctx, const mcase *mc, bool reference,
			 epj_tensor *const *qkv, epj_tensor *mask,
			 epj_tensor *dout)
{
	sdpa_res r;
	bool prev = ctx->sdpa_reference;
	ctx->sdpa_reference = reference;
	ej_attrs at = mask_attrs(mc);
	epj_tensor *in[8] = { qkv[0], qkv[1], qkv[2], mask };
	ck_assert_msg(ej_dispatch(ctx, EJ_OP_SDPA, in, 4, &at, r.t, 2) ==
			  EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	epj_tensor *bin[8] = { dout,   qkv[0], qkv[1], qkv[2],
			       r.t[0], r.t[1], mask };
	ck_assert_msg(ej_dispatch(ctx, EJ_OP_SDPA_BACKWARD, bin, 7, &at,
				  r.t + 2, 3) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ctx->sdpa_reference = prev;
	return r;
}

/* The case's mask tensor (a non-contiguous view when nc). */
static epj_tensor *mask_tensor(epj_ctx *ctx, const mcase *mc, epj_dtype dt,
			       const double *x, bool nc)
{
	epj_dtype md = mc->mdt == EPJ_DTYPE_COUNT ? dt : mc->mdt;
	epj_tensor *m = epj_zeros(ctx, md, 4, mc->ms);
	tu_ok(ctx, m);
	int64_t n = tu_numel(4, mc->ms);
	double *keep = malloc(sizeof *keep * (size_t)n);
	for (int64_t f = 0; f < n; f++) /* i32: 1 keeps, 0 hides */
		keep[f] = md == EPJ_DTYPE_I32 ? x[f] == 0 : x[f];
	ck_assert_int_eq(epj_tensor_from_f64(ctx, m, keep), EPJ_OK);
	free(keep);
	if (!nc)
		return m;
	epj_tensor *view = tu_noncontig(ctx, m);
	epj_tensor_free(m);
	return view;
}

/* Both kernels with the mask against ref_masked, in dtype dt. */
static void check_mask_case(epj_ctx *ctx, const mcase *mc, epj_dtype dt,
			    bool nc, const char *what)
{
	const cfg *c = &mc->c;
	epj_tensor *qkv[3];
	make_qkv(ctx, c, dt, &qkv[0], &qkv[1], &qkv[2]);
	int64_t os[4] = { c->b, c->hq, c->t, c->dv };
	epj_tensor *dout = tu_randn(ctx, dt, 4, os);
	double *mx = mask_values(mc);
	epj_tensor *mask = mask_tensor(ctx, mc, dt, mx, nc);
	free(mx);
	mx = tu_values(ctx, mask); /* as rounded to its dtype */
	for (int64_t f = 0;
	     epj_tensor_dtype(mask) == EPJ_DTYPE_I32 && f < tu_numel(4, mc->ms);
	     f++)
		mx[f] = mx[f] != 0 ? 0.0 : -INFINITY;
	double *qv = tu_values(ctx, qkv[0]), *kv = tu_values(ctx, qkv[1]),
	       *vv = tu_values(ctx, qkv[2]), *gv = tu_values(ctx, dout);
	int64_t nq = epj_tensor_numel(qkv[0]), nk = epj_tensor_numel(qkv[1]);
	int64_t nv = epj_tensor_numel(qkv[2]), no = c->b * c->hq * c->t;
	double *ro = malloc(sizeof *ro * (size_t)(no * c->dv + 1));
	double *rl = malloc(sizeof *rl * (size_t)(no + 1));
	double *dq = malloc(sizeof *dq * (size_t)(nq + 1));
	double *dk = malloc(sizeof *dk * (size_t)(nk + 1));
	double *dv = malloc(sizeof *dv * (size_t)(nv + 1));
	tol ft = fw_tol(dt), bt = bw_tol(dt);
	double lt = dt == EPJ_DTYPE_F64 ? 1e-12 : 1e-5;
	for (int a = 0; a < 2; a++) {
		sdpa_res r = mask_run(ctx, mc, a == 1, qkv, mask, dout);
		char w2[128];
		snprintf(w2, sizeof w2, "%s %s %s", what,
			 a ? "reference" : "flash", epj_dtype_name(dt));
		double *ov =
		    dt == EPJ_DTYPE_BF16 ? tu_values(ctx, r.t[0]) : NULL;
		ref_masked(mc, mx, qv, kv, vv, gv, ov, ro, rl, dq, dk, dv);
		tu_assert_close(ctx, r.t[0], ro, ft.rtol, ft.atol, w2);
		tu_assert_close(ctx, r.t[1], rl, lt, lt, w2);
		tu_assert_close(ctx, r.t[2], dq, bt.rtol, bt.atol, w2);
		tu_assert_close(ctx, r.t[3], dk, bt.rtol, bt.atol, w2);
		tu_assert_close(ctx, r.t[4], dv, bt.rtol, bt.atol, w2);
		free(ov);
		sdpa_res_free(&r);
	}
	free(mx);
	free(qv);
	free(kv);
	free(vv);
	free(gv);
	free(ro);
	free(rl);
	free(dq);
	free(dk);
	free(dv);
	epj_tensor *all[] = { qkv[0], qkv[1], qkv[2], dout, mask };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
}

#define F EPJ_DTYPE_F32
#define Q EPJ_DTYPE_COUNT
#define I EPJ_DTYPE_I32
static const mcase mask_cases[] = {
	/* GQA 4:2, D 24 != Dv 8, T != S; [B, 1, T, S] 0 / -inf */
	{ { 2, 4, 2, 5, 7, 24, 8, false, 0 }, { 2, 1, 5, 7 }, 0, false, Q },
	/* [1, H, T, S] random, an f32 mask */
	{ { 2, 4, 2, 5, 7, 24, 8, false, 0 }, { 1, 4, 5, 7 }, 1, false, F },
	/* [B, 1, 1, S] padding: batch 0's last row... every key hidden for
	 * the last key; causal bottom-right */
	{ { 2, 4, 2, 6, 9, 8, 8, true, 0 }, { 2, 1, 1, 9 }, 0, false, Q },
	/* the same as a boolean i32 mask (1 keeps a key, 0 hides it) */
	{ { 2, 4, 2, 6, 9, 8, 8, true, 0 }, { 2, 1, 1, 9 }, 0, false, I },
	/* [1, 1, T, S] random with causal top-left, T < S and T > S */
	{ { 1, 4, 2, 5, 9, 8, 4, true, 0.4 }, { 1, 1, 5, 9 }, 1, true, Q },
	{ { 1, 2, 1, 9, 5, 8, 4, true, 0 }, { 1, 1, 9, 5 }, 0, true, Q },
	/* full [B, H, T, S], bottom-right causal T > S (rows with no key) */
	{ { 2, 2, 2, 7, 4, 4, 4, true, 0 }, { 2, 2, 7, 4 }, 1, false, Q },
	/* over the 64 x 64 tiles and the serial threshold: several query
	 * and key tiles on threads; padding and top-left causal */
	{ { 2, 4, 2, 130, 70, 16, 24, true, 0 },
	  { 2, 1, 130, 70 },
	  0,
	  true,
	  Q },
	{ { 2, 4, 2, 70, 131, 16, 16, false, 0 },
	  { 2, 1, 1, 131 },
	  0,
	  false,
	  F },
	{ { 2, 4, 2, 130, 70, 16, 24, true, 0 },
	  { 2, 1, 130, 70 },
	  0,
	  false,
	  I },
	/* key tiles of padding that the flash kernels skip */
	{ { 2, 2, 1, 70, 140, 8, 8, false, 0 }, { 2, 1, 1, 140 }, 2, false, Q },
	{ { 2, 2, 1, 70, 140, 8, 8, true, 0 }, { 2, 1, 70, 140 }, 2, true, I },
};
#undef F
#undef Q
#undef I

START_TEST(test_sdpa_mask)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t i = 0; i < LEN(mask_cases); i++)
		for (size_t j = 0; j < LEN(float_dtypes); j++) {
			char what[64];
			snprintf(what, sizeof what, "mask case %zu", i);
			check_mask_case(ctx, &mask_cases[i], float_dtypes[j],
					i % 3 == 1, what);
		}
	epj_ctx_free(ctx);
}
END_TEST

/* Rows whose keys are all hidden: out, lse, dq exactly 0, and keys no
 * query sees get dk = dv = 0; the mask an expanded view (strides 0). */
START_TEST(test_sdpa_mask_hidden_rows)
{
	epj_ctx *ctx = tu_ctx();
	mcase mc = { { 2, 4, 2, 5, 70, 8, 8, false, 0 },
		     { 2, 4, 5, 70 },
		     0,
		     false,
		     EPJ_DTYPE_COUNT };
	int64_t one[4] = { 2, 1, 1, 70 };
	double x[140];
	for (int j = 0; j < 140; j++) /* batch 1: every key hidden */
		x[j] = j < 70 && j % 3 ? 0.0 : -INFINITY;
	for (size_t d = 0; d < LEN(float_dtypes); d++) {
		epj_dtype dt = float_dtypes[d];
		epj_tensor *qkv[3];
		make_qkv(ctx, &mc.c, dt, &qkv[0], &qkv[1], &qkv[2]);
		int64_t os[4] = { 2, 4, 5, 8 };
		epj_tensor *dout = tu_randn(ctx, dt, 4, os);
		epj_tensor *m1 = epj_zeros(ctx, dt, 4, one);
		tu_ok(ctx, m1);
		ck_assert_int_eq(epj_tensor_from_f64(ctx, m1, x), EPJ_OK);
		epj_tensor *mask = epj_expand(ctx, m1, 4, mc.ms);
		tu_ok(ctx, mask);
		for (int a = 0; a < 2; a++) {
			sdpa_res r =
			    mask_run(ctx, &mc, a == 1, qkv, mask, dout);
			/* per output: elements per batch */
			const int64_t per[5] = { 4 * 5 * 8, 4 * 5, 4 * 5 * 8,
						 2 * 70 * 8, 2 * 70 * 8 };
			for (int o = 0; o < 5; o++) {
				double *v = tu_values(ctx, r.t[o]);
				for (int64_t e = 0; e < per[o]; e++)
					ck_assert_msg(v[per[o] + e] == 0,
						      "%s output %d batch 1 "
						      "element %lld: %g",
						      epj_dtype_name(dt), o,
						      (long long)e,
						      v[per[o] + e]);
				/* batch 0: hidden keys (j % 3 == 0) get no
				 * dk, dv */
				for (int64_t e = 0; o >= 3 && e < per[o]; e++)
					if ((e / 8) % 70 % 3 == 0)
						ck_assert(v[e] == 0);
				free(v);
			}
			sdpa_res_free(&r);
		}
		epj_tensor *all[] = { qkv[0], qkv[1], qkv[2], dout, m1, mask };
		for (size_t i = 0; i < LEN(all); i++)
			epj_tensor_free(all[i]);
	}
	epj_ctx_free(ctx);
}
END_TEST

static epj_tensor *fn_sdpa_mask(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	ej_attrs at = mask_attrs(user);
	epj_tensor *outs[2] = { NULL, NULL };
	if (ej_dispatch(ctx, EJ_OP_SDPA, (epj_tensor **)in, 4, &at, outs, 2) !=
	    EPJ_OK)
		return NULL;
	epj_tensor_free(outs[1]);
	return outs[0];
}

/* Central differences of q, k, v through the masked op (f64); the mask,
 * which requires no gradient here, is an input of the recorded call. */
START_TEST(test_sdpa_mask_gradcheck)
{
	epj_ctx *ctx = tu_ctx();
	const mcase cs[] = {
		{ { 1, 4, 2, 3, 5, 3, 2, false, 0 },
		  { 1, 1, 3, 5 },
		  1,
		  false,
		  EPJ_DTYPE_COUNT },
		{ { 2, 2, 1, 4, 3, 3, 3, true, 0 },
		  { 2, 1, 1, 3 },
		  0,
		  true,
		  EPJ_DTYPE_COUNT },
		{ { 1, 2, 1, 66, 67, 1, 1, true, 0 },
		  { 1, 2, 66, 67 },
		  0,
		  false,
		  EPJ_DTYPE_COUNT },
	};
	for (size_t i = 0; i < LEN(cs); i++) {
		epj_tensor *in[4];
		make_qkv(ctx, &cs[i].c, EPJ_DTYPE_F64, &in[0], &in[1], &in[2]);
		double *x = mask_values(&cs[i]);
		in[3] = mask_tensor(ctx, &cs[i], EPJ_DTYPE_F64, x, false);
		free(x);
		for (int j = 0; j < 3; j++)
			epj_tensor_set_requires_grad(in[j], true);
		char what[48];
		snprintf(what, sizeof what, "masked sdpa gradcheck %zu", i);
		tu_gradcheck(ctx, fn_sdpa_mask, in, 4, (void *)&cs[i], 1e-6,
			     1e-5, 1e-7, what);
		for (int j = 0; j < 4; j++)
			epj_tensor_free(in[j]);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* The masked op in a compiled region (traced with the mask an input, its
 * backward through the region): the same out and gradients as eager. */
static const mcase region_case = { { 2, 4, 2, 5, 9, 6, 4, true, 0 },
				   { 2, 1, 5, 9 },
				   0,
				   true,
				   EPJ_DTYPE_COUNT };

static epj_tensor *region_masked(epj_ctx *ctx, epj_tensor *const *in)
{
	return fn_sdpa_mask(ctx, in, (void *)&region_case);
}

/* y = f(in), then the gradients of sum(y * w) w.r.t. in[0..3) into g. */
static epj_tensor *region_grads(epj_ctx *ctx, ej_region_fn *f,
				epj_tensor *const *in, epj_tensor *w,
				epj_tensor **g)
{
	epj_tensor *y = NULL;
	if (f)
		ck_assert_msg(ej_region_run(ctx, f, in, 4, NULL, 0, NULL, NULL,
					    &y, 1) == EPJ_OK,
			      "%s", epj_ctx_error(ctx));
	else
		y = region_masked(ctx, in);
	tu_ok(ctx, y);
	epj_tensor *yw = epj_mul(ctx, y, w), *loss = epj_sum_all(ctx, yw);
	tu_ok(ctx, loss);
	ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	for (int i = 0; i < 3; i++) {
		g[i] = epj_detach(ctx, epj_tensor_grad(in[i]));
		tu_ok(ctx, g[i]);
		epj_tensor_set_grad(in[i], NULL);
	}
	epj_tensor_free(yw);
	epj_tensor_free(loss);
	return y;
}

START_TEST(test_sdpa_mask_region)
{
	epj_ctx *ctx = tu_ctx();
	const mcase *mc = &region_case;
	epj_tensor *in[4];
	make_qkv(ctx, &mc->c, EPJ_DTYPE_F64, &in[0], &in[1], &in[2]);
	double *x = mask_values(mc);
	in[3] = mask_tensor(ctx, mc, EPJ_DTYPE_F64, x, false);
	free(x);
	for (int j = 0; j < 3; j++)
		epj_tensor_set_requires_grad(in[j], true);
	int64_t os[4] = { 2, 4, 5, 4 };
	epj_tensor *w = tu_randn(ctx, EPJ_DTYPE_F64, 4, os);
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_INTERPRETER);
	ck_assert_ptr_nonnull(jit);
	ej_region_fn *f = tu_compile_region(ctx, jit, region_masked, in, 4);
	epj_tensor *ge[3], *gr[3];
	epj_tensor *ye = region_grads(ctx, NULL, in, w, ge);
	epj_tensor *yr = region_grads(ctx, f, in, w, gr);
	tu_assert_tensors_close(ctx, yr, ye, 1e-12, 1e-12, "region out");
	for (int i = 0; i < 3; i++) {
		tu_assert_tensors_close(ctx, gr[i], ge[i], 1e-12, 1e-12,
					"region grad");
		epj_tensor_free(ge[i]);
		epj_tensor_free(gr[i]);
	}
	epj_tensor_free(ye);
	epj_tensor_free(yr);
	ej_region_fn_free(f);
	ej_jit_free(jit);
	for (int i = 0; i < 4; i++)
		epj_tensor_free(in[i]);
	epj_tensor_free(w);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_sdpa_mask_errors)
{
	epj_ctx *ctx = tu_ctx();
	mcase mc = { { 1, 2, 1, 3, 4, 2, 2, false, 0 },
		     { 1, 1, 3, 4 },
		     1,
		     false,
		     EPJ_DTYPE_COUNT };
	epj_tensor *qkv[3];
	make_qkv(ctx, &mc.c, EPJ_DTYPE_F32, &qkv[0], &qkv[1], &qkv[2]);
	int64_t s3[3] = { 1, 3, 4 }, sw[4] = { 1, 1, 3, 5 },
		s4[4] = { 1, 1, 3, 4 };
	epj_tensor *m3 = tu_randn(ctx, EPJ_DTYPE_F32, 3, s3);
	epj_tensor *mw = tu_randn(ctx, EPJ_DTYPE_F32, 4, sw);
	epj_tensor *mb = tu_randn(ctx, EPJ_DTYPE_BF16, 4, s4);
	epj_tensor *ok = tu_randn(ctx, EPJ_DTYPE_F32, 4, s4);
	struct {
		epj_tensor *m;
		int n_in, flags;
		epj_status st;
		const char *needle;
	} cases[] = {
		{ m3, 4, 1, EPJ_ERR_SHAPE, "broadcastable to [B, Hq, T, S]" },
		{ mw, 4, 1, EPJ_ERR_SHAPE, "[1, 2, 3, 4]" },
		{ mb, 4, 1, EPJ_ERR_DTYPE,
		  "mask must be f32 (the dtype of q or f32, additive) or i32 "
		  "(boolean), got bf16" },
		{ ok, 3, 1, EPJ_ERR_INVALID, "a mask follows" },
		{ ok, 4, 4, EPJ_ERR_INVALID, "unknown flags 4" },
		{ ok, 6, 1, EPJ_ERR_INVALID, "at most 5 inputs" },
	};
	for (size_t i = 0; i < LEN(cases); i++) {
		ej_attrs at = ej_attrs_none();
		ej_attrs_push_i(&at, 0);
		ej_attrs_push_i(&at, cases[i].flags);
		ej_attrs_push_f(&at, 0.5);
		epj_tensor *in[6] = { qkv[0],	  qkv[1],     qkv[2],
				      cases[i].m, cases[i].m, cases[i].m };
		epj_tensor *outs[2] = { NULL, NULL };
		ck_assert_int_eq(ej_dispatch(ctx, EJ_OP_SDPA, in, cases[i].n_in,
					     &at, outs, 2),
				 cases[i].st);
		ck_assert_msg(strstr(epj_ctx_error(ctx), cases[i].needle),
			      "case %zu: %s", i, epj_ctx_error(ctx));
	}
	epj_tensor *all[] = { qkv[0], qkv[1], qkv[2], m3, mw, mb, ok };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- cross entropy ----------------------------------------------------------
 */

/* Mean of lse(row) - row[target] over rows with target != ign; NaN if none.
 * grad (optional): d loss / d logits scaled by g. */
static double ref_ce(const double *x, const int64_t *tg, int64_t n, int64_t nv,
		     int64_t ign, double g, double *grad)
{
	int64_t valid = 0;
	for (int64_t r = 0; r < n; r++)
		valid += tg[r] != ign;
	double total = 0;
	for (int64_t r = 0; r < n; r++) {
		const double *row = x + r * nv;
		double mx = -INFINITY, sum = 0;
		for (int64_t j = 0; j < nv; j++)
			mx = row[j] > mx ? row[j] : mx;
		for (int64_t j = 0; j < nv; j++)
			sum += exp(row[j] - mx);
		for (int64_t j = 0; grad && j < nv; j++)
			grad[r * nv + j] =
			    tg[r] == ign
				? 0
				: g / (double)valid *
				      (exp(row[j] - mx) / sum - (j == tg[r]));
		if (tg[r] != ign)
			total += mx + log(sum) - row[tg[r]];
	}
	return valid ? total / (double)valid : NAN;
}

/* Targets [n] in dtype dt from values tg. */
static epj_tensor *make_targets(epj_ctx *ctx, epj_dtype dt, const int64_t *tg,
				int64_t n)
{
	epj_tensor *t;
	if (dt == EPJ_DTYPE_I64) {
		t = epj_tensor_from_data(ctx, dt, 1, &n, tg);
	} else {
		int32_t *v = malloc(sizeof *v * (size_t)n);
		for (int64_t i = 0; i < n; i++)
			v[i] = (int32_t)tg[i];
		t = epj_tensor_from_data(ctx, dt, 1, &n, v);
		free(v);
	}
	tu_ok(ctx, t);
	return t;
}

/* Random targets, every fourth row (from a random phase) set to ign. */
static void random_targets(int64_t *tg, int64_t n, int64_t nv, int64_t ign)
{
	int64_t phase = tu_randint(0, 4);
	for (int64_t r = 0; r < n; r++)
		tg[r] = r % 4 == phase ? ign : tu_randint(0, nv);
}

static void check_ce(epj_ctx *ctx, epj_dtype dt, epj_dtype tdt, int64_t n,
		     int64_t nv, int64_t ign, bool noncontig, const char *what)
{
	int64_t ls[2] = { n, nv };
	epj_tensor *lg = tu_randn(ctx, dt, 2, ls);
	if (noncontig) {
		epj_tensor *t = tu_noncontig(ctx, lg);
		epj_tensor_free(lg);
		lg = t;
	}
	int64_t *tg = malloc(sizeof *tg * (size_t)n);
	random_targets(tg, n, nv, ign);
	epj_tensor *tt = make_targets(ctx, tdt, tg, n);
	epj_tensor_set_requires_grad(lg, true);
	epj_tensor *loss = epj_cross_entropy(ctx, lg, tt, ign);
	tu_ok(ctx, loss);
	ck_assert_int_eq(epj_tensor_ndim(loss), 0);
	ck_assert_int_eq(epj_tensor_dtype(loss),
			 dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32);
	double *xv = tu_values(ctx, lg);
	double *gref = malloc(sizeof *gref * (size_t)(n * nv));
	double g = tu_uniform(0.5, 2.0);
	double ref = ref_ce(xv, tg, n, nv, ign, g, gref);
	double ftol = dt == EPJ_DTYPE_F64 ? 1e-12 : 1e-5;
	tu_assert_close(ctx, loss, &ref, ftol, ftol, what);

	/* backward with an upstream gradient g */
	epj_tensor *gt = epj_full(ctx, epj_tensor_dtype(loss), 0, NULL, g);
	tu_ok(ctx, gt);
	ck_assert_msg(epj_backward(ctx, loss, gt) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_tensor *grad = epj_tensor_grad(lg);
	ck_assert_ptr_nonnull(grad);
	ck_assert_int_eq(epj_tensor_dtype(grad), dt);
	double brt = dt == EPJ_DTYPE_F64    ? 1e-10
		     : dt == EPJ_DTYPE_BF16 ? 1.0 / 250
					    : 1e-4;
	tu_assert_close(ctx, grad, gref, brt,
			dt == EPJ_DTYPE_F64 ? 1e-14 : 1e-6, what);
	free(tg);
	free(xv);
	free(gref);
	epj_tensor *all[] = { lg, tt, loss, gt };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
}

START_TEST(test_ce_forward_backward)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t j = 0; j < LEN(float_dtypes); j++) {
		epj_dtype dt = float_dtypes[j];
		check_ce(ctx, dt, EPJ_DTYPE_I64, 13, 7, -100, false, "ce i64");
		check_ce(ctx, dt, EPJ_DTYPE_I32, 13, 7, 2, true,
			 "ce i32 ignore 2 noncontig");
		check_ce(ctx, dt, EPJ_DTYPE_I64, 17, 3001, -1, false,
			 "ce large vocab");
	}
	epj_ctx_free(ctx);
}
END_TEST

typedef struct ce_user {
	epj_tensor *targets;
	int64_t ign;
} ce_user;

static epj_tensor *fn_ce(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	ce_user *u = user;
	return epj_cross_entropy(ctx, in[0], u->targets, u->ign);
}

START_TEST(test_ce_gradcheck)
{
	epj_ctx *ctx = tu_ctx();
	int64_t ls[2] = { 5, 7 }, tg[5];
	random_targets(tg, 5, 7, -100);
	epj_tensor *lg = tu_randn(ctx, EPJ_DTYPE_F64, 2, ls);
	epj_tensor_set_requires_grad(lg, true);
	ce_user u = { make_targets(ctx, EPJ_DTYPE_I64, tg, 5), -100 };
	epj_tensor *in[1] = { lg };
	tu_gradcheck(ctx, fn_ce, in, 1, &u, 1e-6, 1e-6, 1e-9, "ce gradcheck");
	epj_tensor_free(lg);
	epj_tensor_free(u.targets);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_ce_all_ignored)
{
	epj_ctx *ctx = tu_ctx();
	int64_t ls[2] = { 3, 5 }, tg[3] = { -100, -100, -100 };
	epj_tensor *lg = tu_randn(ctx, EPJ_DTYPE_F32, 2, ls);
	epj_tensor_set_requires_grad(lg, true);
	epj_tensor *tt = make_targets(ctx, EPJ_DTYPE_I64, tg, 3);
	epj_tensor *loss = epj_cross_entropy(ctx, lg, tt, -100);
	tu_ok(ctx, loss);
	ck_assert(isnan(epj_tensor_get_f64(loss, 0)));
	ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	double zero[15] = { 0 };
	tu_assert_close(ctx, epj_tensor_grad(lg), zero, 0, 0,
			"ce all ignored: zero gradient");
	epj_tensor_free(lg);
	epj_tensor_free(tt);
	epj_tensor_free(loss);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_ce_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t ls[2] = { 6, 7 }, l1[1] = { 7 }, t5[1] = { 5 };
	int64_t big[6] = { 0, 1, 2, 3, 7, 1 }, neg[6] = { 0, 1, -1, 3, 4, 1 };
	epj_tensor *lg = tu_randn(ctx, EPJ_DTYPE_F32, 2, ls);
	epj_tensor *lg1 = tu_randn(ctx, EPJ_DTYPE_F32, 1, l1);
	epj_tensor *tb = make_targets(ctx, EPJ_DTYPE_I64, big, 6);
	epj_tensor *tn = make_targets(ctx, EPJ_DTYPE_I32, neg, 6);
	epj_tensor *tf = tu_randn(ctx, EPJ_DTYPE_F32, 1, ls);
	epj_tensor *t5t = epj_randint(ctx, EPJ_DTYPE_I64, 1, t5, 0, 7);

	const char *range[] = { "cross_entropy", "target 7", "row 4" };
	tu_assert_error(ctx, epj_cross_entropy(ctx, lg, tb, -100),
			EPJ_ERR_INDEX, range, 3);
	const char *negs[] = { "cross_entropy", "target -1", "row 2" };
	tu_assert_error(ctx, epj_cross_entropy(ctx, lg, tn, -100),
			EPJ_ERR_INDEX, negs, 3);
	const char *len[] = { "cross_entropy", "[6]" };
	tu_assert_error(ctx, epj_cross_entropy(ctx, lg, t5t, -100),
			EPJ_ERR_SHAPE, len, 2);
	const char *one[] = { "cross_entropy", "[7]" };
	tu_assert_error(ctx, epj_cross_entropy(ctx, lg1, t5t, -100),
			EPJ_ERR_SHAPE, one, 2);
	const char *fl[] = { "cross_entropy", "i32 or i64" };
	tu_assert_error(ctx, epj_cross_entropy(ctx, lg, tf, -100),
			EPJ_ERR_DTYPE, fl, 2);
	/* the -1 row is fine when -1 is the ignore index */
	epj_tensor *ok = epj_cross_entropy(ctx, lg, tn, -1);
	tu_ok(ctx, ok);

	epj_tensor *all[] = { lg, lg1, tb, tn, tf, t5t, ok };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- the gated delta rule ------------------------------------------------
 */

/* The reference, written as the recurrence over explicit per-step states
 * S_0 .. S_T (all kept), in double: o [B, T, H, Dv]. */
static void ref_delta(int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv,
		      const double *q, const double *k, const double *v,
		      const double *g, const double *be, double *o)
{
	double *S = calloc((size_t)((T + 1) * Dk * Dv), sizeof *S);
	ck_assert_ptr_nonnull(S);
	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < H; h++) {
			memset(S, 0, sizeof *S * (size_t)(Dk * Dv));
			for (int64_t t = 0; t < T; t++) {
				int64_t r = (b * T + t) * H + h;
				double *P = S + t * Dk * Dv, *N = P + Dk * Dv;
				double a = exp(g[r]);
				for (int64_t j = 0; j < Dv; j++) {
					double mk = 0;
					for (int64_t i = 0; i < Dk; i++)
						mk += a * P[i * Dv + j] *
						      k[r * Dk + i];
					double d = be[r] * (v[r * Dv + j] - mk);
					for (int64_t i = 0; i < Dk; i++)
						N[i * Dv + j] =
						    a * P[i * Dv + j] +
						    k[r * Dk + i] * d;
					double y = 0;
					for (int64_t i = 0; i < Dk; i++)
						y += N[i * Dv + j] *
						     q[r * Dk + i];
					o[r * Dv + j] = y;
				}
			}
		}
	free(S);
}

/* Random inputs of the rule: q, k l2-normalised rows (as Gated DeltaNet
 * feeds them), v normal, g = log decay in [-2, -0.01], beta in (0, 1). */
static void make_delta(epj_ctx *ctx, epj_dtype dt, const int64_t *d,
		       epj_tensor **in)
{
	int64_t sk[4] = { d[0], d[1], d[2], d[3] },
		sv[4] = { d[0], d[1], d[2], d[4] };
	int64_t n = d[0] * d[1] * d[2];
	in[0] = tu_randn(ctx, dt, 4, sk);
	in[1] = tu_randn(ctx, dt, 4, sk);
	in[2] = tu_randn(ctx, dt, 4, sv);
	double *x = malloc(sizeof *x * (size_t)(n * d[3]));
	for (int w = 0; w < 2; w++) {
		ck_assert_int_eq(epj_tensor_to_f64(ctx, in[w], x), EPJ_OK);
		for (int64_t r = 0; r < n; r++) {
			double ss = 0;
			for (int64_t i = 0; i < d[3]; i++)
				ss += x[r * d[3] + i] * x[r * d[3] + i];
			for (int64_t i = 0; i < d[3]; i++)
				x[r * d[3] + i] /= sqrt(ss + 1e-6);
		}
		ck_assert_int_eq(epj_tensor_from_f64(ctx, in[w], x), EPJ_OK);
	}
	free(x);
	int64_t s3[3] = { d[0], d[1], d[2] };
	double *gv = malloc(sizeof *gv * (size_t)n);
	double *bv = malloc(sizeof *bv * (size_t)n);
	for (int64_t i = 0; i < n; i++) {
		gv[i] = tu_uniform(-2, -0.01);
		bv[i] = tu_uniform(0.05, 0.95);
	}
	in[3] = epj_zeros(ctx, dt, 3, s3);
	in[4] = epj_zeros(ctx, dt, 3, s3);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, in[3], gv), EPJ_OK);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, in[4], bv), EPJ_OK);
	free(gv);
	free(bv);
}

/* The op against the reference on odd sizes, f64, f32 and bf16, on the
 * cpu and on cuda-sim (templates/delta.cuh, no CPU fallback). */
START_TEST(test_gated_delta_forward)
{
	/* the last two: Dk over 64 and over 128 (the kernels' register
	 * tiers), Dv past a column tile and not a multiple of 8 */
	const int64_t dims[][5] = { { 2, 9, 3, 5, 4 },
				    { 1, 1, 1, 1, 1 },
				    { 1, 70, 2, 3, 6 },
				    { 2, 75, 3, 70, 45 },
				    { 1, 20, 2, 131, 9 } };
	for (int dev = 0; dev < 2; dev++) {
		epj_ctx *ctx = NULL;
		ck_assert_int_eq(epj_ctx_new(dev ? "cuda-sim" : "cpu", &ctx),
				 EPJ_OK);
		epj_ctx_seed(ctx, tu_seed() + (uint64_t)dev);
		for (size_t c = 0; c < LEN(dims); c++)
			for (int f = 0; f < 3; f++) {
				epj_dtype dt = f == 2	? EPJ_DTYPE_BF16
					       : f == 1 ? EPJ_DTYPE_F32
							: EPJ_DTYPE_F64;
				const int64_t *d = dims[c];
				epj_tensor *in[5];
				make_delta(ctx, dt, d, in);
				int64_t fb0 = epj_counter_get(
				    ctx, "kernels.eager_cpu_fallback");
				epj_tensor *o = epj_gated_delta(
				    ctx, in[0], in[1], in[2], in[3], in[4]);
				ck_assert_msg(o != NULL, "%s",
					      epj_ctx_error(ctx));
				/* cuda-sim: the template, no fallback */
				ck_assert_int_eq(
				    epj_counter_get(
					ctx, "kernels.eager_cpu_fallback"),
				    fb0);
				ck_assert_int_eq(epj_tensor_dtype(o), dt);
				double *x[5];
				for (int i = 0; i < 5; i++)
					x[i] = tu_values(ctx, in[i]);
				int64_t no = d[0] * d[1] * d[2] * d[4];
				double *want =
				    malloc(sizeof *want * (size_t)no);
				ref_delta(d[0], d[1], d[2], d[3], d[4], x[0],
					  x[1], x[2], x[3], x[4], want);
				double *got = tu_values(ctx, o), nz = 0;
				for (int64_t i = 0; i < no; i++) {
					/* bf16: the output's rounding */
					double tl = f == 2   ? 1e-2
						    : f == 1 ? 2e-5
							     : 1e-11;
					ck_assert_msg(
					    fabs(got[i] - want[i]) <=
						tl * (1 + fabs(want[i])),
					    "case %zu %s o[%lld] %g, "
					    "want %g",
					    c, epj_dtype_name(dt), (long long)i,
					    got[i], want[i]);
					nz += fabs(want[i]);
				}
				ck_assert(nz > 0);
				free(got);
				free(want);
				for (int i = 0; i < 5; i++) {
					free(x[i]);
					epj_tensor_free(in[i]);
				}
				epj_tensor_free(o);
			}
		epj_ctx_free(ctx);
	}
}
END_TEST

static epj_tensor *fn_delta(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	(void)user;
	return epj_gated_delta(ctx, in[0], in[1], in[2], in[3], in[4]);
}

/* Every input's gradient against central differences (f64), one case with
 * T > 64 so that the backward's kept states and recomputed chunks (every
 * 64 steps) are crossed. */
START_TEST(test_gated_delta_gradcheck)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t dims[][5] = { { 2, 6, 2, 3, 4 }, { 1, 67, 1, 2, 2 } };
	for (size_t c = 0; c < LEN(dims); c++) {
		epj_tensor *in[5];
		make_delta(ctx, EPJ_DTYPE_F64, dims[c], in);
		for (int i = 0; i < 5; i++)
			epj_tensor_set_requires_grad(in[i], true);
		char what[48];
		snprintf(what, sizeof what, "gated_delta gradcheck %zu", c);
		tu_gradcheck(ctx, fn_delta, in, 5, NULL, 1e-6, 1e-5, 1e-7,
			     what);
		for (int i = 0; i < 5; i++)
			epj_tensor_free(in[i]);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* The backward on cuda-sim (templates/delta.cuh: column tiles, states
 * kept every 64 steps, the reverse sweep in segments of time) against the
 * CPU kernel's, on the same inputs and upstream gradient; f64, f32, bf16.
 * Sizes: B > 1, several heads, T across chunks and segments and not a
 * multiple of either (segments of 64 steps, set by the test hook, or the
 * default of one), Dk != Dv, Dv across column tiles and not a multiple of
 * 8 or 32, Dk in each register tier (<= 64, <= 128, <= 256). */
static void delta_backward_case(const int64_t *d, int64_t seg)
{
	int64_t shp[6][4] = {
		{ d[0], d[1], d[2], d[3] }, { d[0], d[1], d[2], d[3] },
		{ d[0], d[1], d[2], d[4] }, { d[0], d[1], d[2] },
		{ d[0], d[1], d[2] },	    { d[0], d[1], d[2], d[4] }
	};
	int nd[6] = { 4, 4, 4, 3, 3, 4 };
	ej_cuda_delta_segment_hook(seg);
	for (int f = 0; f < 3; f++) {
		epj_dtype dt = f == 2	? EPJ_DTYPE_BF16
			       : f == 1 ? EPJ_DTYPE_F32
					: EPJ_DTYPE_F64;
		/* the inputs and the upstream weights, drawn once (cpu) */
		double *vals[6];
		epj_ctx *c0 = tu_ctx();
		epj_tensor *src[6];
		make_delta(c0, dt, d, src);
		src[5] = tu_randn(c0, dt, 4, shp[5]);
		for (int i = 0; i < 6; i++) {
			vals[i] = tu_values(c0, src[i]);
			epj_tensor_free(src[i]);
		}
		epj_ctx_free(c0);
		double *grads[2][5];
		for (int dev = 0; dev < 2; dev++) {
			epj_ctx *ctx = NULL;
			ck_assert_int_eq(
			    epj_ctx_new(dev ? "cuda-sim" : "cpu", &ctx),
			    EPJ_OK);
			epj_tensor *in[6];
			for (int i = 0; i < 6; i++) {
				in[i] = epj_zeros(ctx, dt, nd[i], shp[i]);
				ck_assert_int_eq(
				    epj_tensor_from_f64(ctx, in[i], vals[i]),
				    EPJ_OK);
				if (i < 5)
					epj_tensor_set_requires_grad(in[i],
								     true);
			}
			epj_tensor *o = epj_gated_delta(ctx, in[0], in[1],
							in[2], in[3], in[4]);
			ck_assert_ptr_nonnull(o);
			epj_tensor *ow = epj_mul(ctx, o, in[5]);
			epj_tensor *l = epj_sum_all(ctx, ow);
			int64_t fb0 =
			    epj_counter_get(ctx, "kernels.eager_cpu_fallback");
			ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
			if (dev)
				ck_assert_int_eq(
				    epj_counter_get(
					ctx, "kernels.eager_cpu_fallback"),
				    fb0);
			for (int i = 0; i < 5; i++) {
				ck_assert_ptr_nonnull(epj_tensor_grad(in[i]));
				grads[dev][i] =
				    tu_values(ctx, epj_tensor_grad(in[i]));
			}
			for (int i = 0; i < 6; i++)
				epj_tensor_free(in[i]);
			epj_tensor_free(o);
			epj_tensor_free(ow);
			epj_tensor_free(l);
			epj_ctx_free(ctx);
		}
		for (int i = 0; i < 5; i++) {
			int64_t n = ej_numel(nd[i], shp[i]);
			double num = 0, den = 0;
			for (int64_t j = 0; j < n; j++) {
				double e = grads[1][i][j] - grads[0][i][j];
				num += e * e;
				den += grads[0][i][j] * grads[0][i][j];
			}
			ck_assert(den > 0);
			/* bf16: the outputs' rounding, f32 sums against
			 * the CPU's double ones */
			ck_assert_msg(sqrt(num / den) < (f == 2	  ? 1e-2
							 : f == 1 ? 1e-5
								  : 1e-12),
				      "%s B=%lld T=%lld H=%lld Dk=%lld Dv=%lld "
				      "segment %lld input %d: cuda-sim's "
				      "gradient %g (relative L2) from the "
				      "cpu's",
				      epj_dtype_name(dt), (long long)d[0],
				      (long long)d[1], (long long)d[2],
				      (long long)d[3], (long long)d[4],
				      (long long)seg, i, sqrt(num / den));
			free(grads[0][i]);
			free(grads[1][i]);
		}
		for (int i = 0; i < 6; i++)
			free(vals[i]);
	}
	ej_cuda_delta_segment_hook(0);
}

START_TEST(test_gated_delta_backward_sim)
{
	const int64_t d[5] = { 2, 67, 3, 4, 5 };
	delta_backward_case(d, 0);
}
END_TEST

START_TEST(test_gated_delta_backward_odd)
{
	static const struct {
		int64_t d[5], seg;
	} cs[] = { { { 2, 140, 2, 19, 45 }, 64 },
		   { { 1, 70, 2, 70, 11 }, 64 },
		   { { 2, 9, 1, 131, 6 }, 0 } };
	delta_backward_case(cs[_i].d, cs[_i].seg);
}
END_TEST

START_TEST(test_gated_delta_errors)
{
	epj_ctx *ctx = tu_ctx();
	epj_tensor *in[5];
	const int64_t d[5] = { 1, 3, 2, 4, 5 };
	make_delta(ctx, EPJ_DTYPE_F32, d, in);
	/* k of another shape */
	int64_t bad[4] = { 1, 3, 2, 3 };
	epj_tensor *k2 = tu_randn(ctx, EPJ_DTYPE_F32, 4, bad);
	ck_assert_ptr_null(
	    epj_gated_delta(ctx, in[0], k2, in[2], in[3], in[4]));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "gated_delta"));
	/* g of another dtype */
	epj_tensor *g64 = epj_cast(ctx, in[3], EPJ_DTYPE_F64);
	ck_assert_ptr_null(
	    epj_gated_delta(ctx, in[0], in[1], in[2], g64, in[4]));
	epj_tensor_free(k2);
	epj_tensor_free(g64);
	for (int i = 0; i < 5; i++)
		epj_tensor_free(in[i]);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_ops_attention_suite(void)
{
	Suite *s = suite_create("ops_attention");
	TCase *ts = tcase_create("sdpa");
	tcase_set_timeout(ts, 60);
	tcase_add_test(ts, test_sdpa_forward);
	tcase_add_test(ts, test_sdpa_views);
	tcase_add_test(ts, test_sdpa_backward);
	tcase_add_test(ts, test_sdpa_gradcheck);
	tcase_add_test(ts, test_sdpa_lse_no_grad);
	tcase_add_test(ts, test_sdpa_errors);
	tcase_add_test(ts, test_sdpa_flash_vs_reference);
	tcase_add_test(ts, test_sdpa_flash_threads);
	tcase_add_test(ts, test_sdpa_env);
	tcase_add_test(ts, test_sdpa_docs);
	tcase_add_test(ts, test_sdpa_docs_alone);
	tcase_add_test(ts, test_sdpa_docs_errors);
	tcase_add_test(ts, test_sdpa_mask);
	tcase_add_test(ts, test_sdpa_mask_hidden_rows);
	tcase_add_test(ts, test_sdpa_mask_gradcheck);
	tcase_add_test(ts, test_sdpa_mask_errors);
	tcase_add_test(ts, test_sdpa_mask_region);
	suite_add_tcase(s, ts);
	TCase *td = tcase_create("gated_delta");
	tcase_set_timeout(td, 300);
	tcase_add_test(td, test_gated_delta_forward);
	tcase_add_test(td, test_gated_delta_gradcheck);
	tcase_add_test(td, test_gated_delta_backward_sim);
	tu_add_loop_test(td, test_gated_delta_backward_odd, 3);
	tcase_add_test(td, test_gated_delta_errors);
	suite_add_tcase(s, td);
	TCase *tc = tcase_create("cross_entropy");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_ce_forward_backward);
	tcase_add_test(tc, test_ce_gradcheck);
	tcase_add_test(tc, test_ce_all_ignored);
	tcase_add_test(tc, test_ce_errors);
	suite_add_tcase(s, tc);
	return s;
}
