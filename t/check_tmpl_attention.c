/* check_tmpl_attention.c -- the flash-style attention template
 * (templates/attention.cuh through kernels/tmpl_attention.c) executed on
 * cuda-sim, race check and poisoned outputs on (the defaults).
 *
 * - forward (out, lse) and backward (dq, dk, dv, from the kernel's own out
 *   and lse) against a double reference written here, at odd sizes: T of 1,
 *   5, 17 and past one 32-key tile, T != S both ways (bottom-right causal
 *   mask: rows that see one key, rows that see none), D of 8, 24, 64 and
 *   128, Dv != D, Hq/Hkv of 1/1, 4/2, 6/2, B of 1 and 2, causal or not, an
 *   explicit scale, f32 / bf16 / f64, contiguous and strided inputs;
 * - document ids (packed documents that do not see each other): runs of
 *   random lengths and ids in any order, i64 and i32, causal and not;
 * - the eager adapters ej_cuda_op_sdpa and ej_cuda_op_sdpa_backward on a
 *   cuda-sim context against the op table's CPU kernels on a cpu context,
 *   strided inputs;
 * - the errors of the host API and the adapters.
 *
 * Tolerances: f32 as the op tests (forward rtol 1e-4, backward 1e-3); bf16
 * inputs are exact in the reference and the kernels compute in f32, so the
 * error is the final rounding (2^-8 relative) plus the bf16-rounded out in
 * rowsum(dO * O), which the reference uses too; bf16 runs on tensor
 * cores, whose products take P (forward, dv) and dS (dq, dk) rounded to
 * bf16: up to 2^-9 of the sum of the terms' magnitudes more per element
 * (forward atol 8e-3 for |v| of a few units; the backward sums up to
 * T terms per element: atol 1.5e-2; lse keeps the f32 tolerance: the row
 * sums add p in f32); f64 1e-10 / 1e-9.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cc.h"
#include "tmpl_attention.h"

#define LEN(a) (sizeof(a) / sizeof((a)[0]))

static char *cache_dir;

static void cache_setup(void)
{
	cache_dir = tu_tmpdir_new("tmpl-attn");
	setenv("EPJIT_CACHE_DIR", cache_dir, 1);
	unsetenv("EPJIT_SIM_RACECHECK");
	unsetenv("EPJIT_SIM_POISON");
	ej_tmpl_clear();
}

static void cache_teardown(void)
{
	ej_tmpl_clear();
	tu_tmpdir_free(cache_dir);
	cache_dir = NULL;
}

typedef struct cfg {
	int64_t b, hq, hkv, t, s, d, dv;
	bool causal;
	double scale; /* <= 0: 1/sqrt(D) */
} cfg;

/* The document ids of the case that runs (test_docs sets them): [B, S]
 * values for the reference and their tensor for the kernels; NULL: none. */
static const int64_t *docs_ids;
static epj_tensor *docs_t;

static double cfg_scale(const cfg *c)
{
	return c->scale > 0 ? c->scale : 1.0 / sqrt((double)c->d);
}

/* ---- double reference ----------------------------------------------------
 */

static int64_t ref_kend(const cfg *c, int64_t i)
{
	int64_t e = c->causal ? i + 1 + c->s - c->t : c->s;
	return e < 0 ? 0 : (e > c->s ? c->s : e);
}

/* p[S] of query (b, h, i); returns the lse (-inf: no key visible). */
static double ref_row(const cfg *c, const double *q, const double *k, int64_t b,
		      int64_t h, int64_t i, double *p)
{
	int64_t g = h / (c->hq / c->hkv), je = ref_kend(c, i);
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
	if (mx == -INFINITY) { /* no key visible */
		for (int64_t j = 0; j < c->s; j++)
			p[j] = 0;
		return -INFINITY;
	}
	double sum = 0;
	for (int64_t j = 0; j < je; j++)
		sum += exp(p[j] - mx);
	for (int64_t j = 0; j < c->s; j++)
		p[j] = j < je ? exp(p[j] - mx) / sum : 0;
	return mx + log(sum);
}

static void ref_fwd(const cfg *c, const double *q, const double *k,
		    const double *v, double *out, double *lse)
{
	double *p = malloc(sizeof *p * (size_t)(c->s + 1));
	for (int64_t b = 0; b < c->b; b++)
		for (int64_t h = 0; h < c->hq; h++)
			for (int64_t i = 0; i < c->t; i++) {
				int64_t row = (b * c->hq + h) * c->t + i;
				int64_t g = h / (c->hq / c->hkv);
				const double *vg =
				    v + (b * c->hkv + g) * c->s * c->dv;
				lse[row] = ref_row(c, q, k, b, h, i, p);
				for (int64_t e = 0; e < c->dv; e++) {
					double s = 0;
					for (int64_t j = 0; j < c->s; j++)
						s += p[j] * vg[j * c->dv + e];
					out[row * c->dv + e] = s;
				}
			}
	free(p);
}

/* Gradients of sum(out * go); Di = rowsum(go * o) over the given out o (as
 * the op defines it: the kernels read their out). */
/* Also, in mq, mk, mv (shaped like dq, dk, dv), the sum of the magnitudes
 * of each element's terms: what rounding a factor of every term (P and dS
 * to bf16 before the tensor-core products) can move it by, relatively. */
static void ref_bwd(const cfg *c, const double *q, const double *k,
		    const double *v, const double *go, const double *o,
		    double *dq, double *dk, double *dv, double *mq, double *mk,
		    double *mv)
{
	const size_t nq = (size_t)(c->b * c->hq * c->t * c->d);
	const size_t nk = (size_t)(c->b * c->hkv * c->s * c->d);
	const size_t nv = (size_t)(c->b * c->hkv * c->s * c->dv);
	memset(dq, 0, sizeof *dq * nq);
	memset(dk, 0, sizeof *dk * nk);
	memset(dv, 0, sizeof *dv * nv);
	memset(mq, 0, sizeof *mq * nq);
	memset(mk, 0, sizeof *mk * nk);
	memset(mv, 0, sizeof *mv * nv);
	double *p = malloc(sizeof *p * (size_t)(c->s + 1));
	double *dp = malloc(sizeof *dp * (size_t)(c->s + 1));
	double sc = cfg_scale(c);
	for (int64_t b = 0; b < c->b; b++)
		for (int64_t h = 0; h < c->hq; h++)
			for (int64_t i = 0; i < c->t; i++) {
				int64_t g = h / (c->hq / c->hkv);
				int64_t row = (b * c->hq + h) * c->t + i;
				const double *gr = go + row * c->dv;
				ref_row(c, q, k, b, h, i, p);
				double di = 0;
				for (int64_t e = 0; e < c->dv; e++)
					di += gr[e] * o[row * c->dv + e];
				for (int64_t j = 0; j < c->s; j++) {
					int64_t kv =
					    (b * c->hkv + g) * c->s + j;
					dp[j] = 0;
					for (int64_t e = 0; e < c->dv; e++) {
						dp[j] +=
						    gr[e] * v[kv * c->dv + e];
						dv[kv * c->dv + e] +=
						    p[j] * gr[e];
						mv[kv * c->dv + e] +=
						    fabs(p[j] * gr[e]);
					}
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
						mq[row * c->d + e] +=
						    fabs(ds * k[kv * c->d + e]);
						mk[kv * c->d + e] += fabs(
						    ds * q[row * c->d + e]);
					}
				}
			}
	free(p);
	free(dp);
}

/* ---- template against the reference ------------------------------------- */

typedef struct tol {
	double rtol, atol;
} tol;

static tol fw_tol(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64    ? (tol){ 1e-10, 1e-12 }
	       : dt == EPJ_DTYPE_BF16 ? (tol){ 1.0 / 250, 8e-3 }
				      : (tol){ 1e-4, 1e-5 };
}

static tol bw_tol(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64    ? (tol){ 1e-9, 1e-11 }
	       : dt == EPJ_DTYPE_BF16 ? (tol){ 1.0 / 250, 5e-3 }
				      : (tol){ 1e-3, 1e-4 };
}

/* The backward's elements against the double reference: bw_tol's bound,
 * and in bf16 also 2^-7 of the element's term magnitudes (mag, from
 * ref_bwd): the tensor-core kernels round P and dS to bf16 (2^-8 of each
 * term at most) before the products, so an element whose terms cancel
 * may be off by more than its own size allows. */
static void bw_close(epj_ctx *ctx, const epj_tensor *t, const double *ref,
		     const double *mag, epj_dtype dt, const char *what)
{
	tol bt = bw_tol(dt);
	if (dt != EPJ_DTYPE_BF16) {
		tu_assert_close(ctx, t, ref, bt.rtol, bt.atol, what);
		return;
	}
	double *got = tu_values(ctx, t);
	int64_t n = epj_tensor_numel(t), bad = 0, worst = -1;
	double worst_r = 0;
	for (int64_t i = 0; i < n; i++) {
		double lim = bt.atol + bt.rtol * fabs(ref[i]) + mag[i] / 128.0;
		double r = fabs(got[i] - ref[i]) / lim;
		if (!(r <= 1.0)) {
			bad++;
			if (worst < 0 || !(r <= worst_r)) {
				worst = i;
				worst_r = r;
			}
		}
	}
	ck_assert_msg(bad == 0,
		      "%s: %lld of %lld elements differ; worst at %lld: got "
		      "%.9g want %.9g (term magnitudes %.4g, %.3g x the "
		      "bound)",
		      what, (long long)bad, (long long)n, (long long)worst,
		      worst >= 0 ? got[worst] : 0.0,
		      worst >= 0 ? ref[worst] : 0.0,
		      worst >= 0 ? mag[worst] : 0.0, worst_r);
	free(got);
}

static epj_dtype acc_dt(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
}

static ej_attn_operand operand(const epj_tensor *t)
{
	ej_attn_operand o = { ej_data(t), { 0, 0, 0, 0 } };
	for (int i = 0; i < t->ndim; i++)
		o.st[i] = t->stride[i];
	return o;
}

static ej_attn_shape shape_of(const cfg *c)
{
	ej_attn_shape m = { .b = c->b,
			    .hq = c->hq,
			    .hkv = c->hkv,
			    .t = c->t,
			    .s = c->s,
			    .d = c->d,
			    .dv = c->dv,
			    .causal = c->causal,
			    .scale = cfg_scale(c) };
	if (docs_t) {
		m.seg = ej_data(docs_t);
		m.seg_st[0] = docs_t->stride[0];
		m.seg_st[1] = docs_t->stride[1];
		m.seg_i64 = docs_t->dtype == EPJ_DTYPE_I64;
	}
	return m;
}

static void describe(char *buf, size_t n, const cfg *c, epj_dtype dt,
		     const char *what)
{
	snprintf(buf, n,
		 "%s %s B=%lld Hq=%lld Hkv=%lld T=%lld S=%lld D=%lld "
		 "Dv=%lld causal=%d",
		 what, epj_dtype_name(dt), (long long)c->b, (long long)c->hq,
		 (long long)c->hkv, (long long)c->t, (long long)c->s,
		 (long long)c->d, (long long)c->dv, (int)c->causal);
}

/* Forward and backward of one configuration on cuda-sim against ref_fwd /
 * ref_bwd; inputs strided when nc. */
static void check_case(epj_ctx *ctx, const cfg *c, epj_dtype dt, bool nc)
{
	int64_t qsh[4] = { c->b, c->hq, c->t, c->d };
	int64_t ksh[4] = { c->b, c->hkv, c->s, c->d };
	int64_t vsh[4] = { c->b, c->hkv, c->s, c->dv };
	int64_t osh[4] = { c->b, c->hq, c->t, c->dv };
	epj_tensor *q = tu_randn_nc(ctx, dt, 4, qsh, nc);
	epj_tensor *k = tu_randn_nc(ctx, dt, 4, ksh, nc);
	epj_tensor *v = tu_randn_nc(ctx, dt, 4, vsh, nc);
	epj_tensor *go = tu_randn_nc(ctx, dt, 4, osh, nc);
	epj_tensor *out = ej_tensor_alloc(ctx, dt, 4, osh, false);
	epj_tensor *lse = ej_tensor_alloc(ctx, acc_dt(dt), 3, osh, false);
	epj_tensor *dq = ej_tensor_alloc(ctx, dt, 4, qsh, false);
	epj_tensor *dk = ej_tensor_alloc(ctx, dt, 4, ksh, false);
	epj_tensor *dv = ej_tensor_alloc(ctx, dt, 4, vsh, false);
	tu_ok(ctx, q);
	tu_ok(ctx, k);
	tu_ok(ctx, v);
	tu_ok(ctx, go);
	tu_ok(ctx, out);
	tu_ok(ctx, lse);
	tu_ok(ctx, dq);
	tu_ok(ctx, dk);
	tu_ok(ctx, dv);
	char what[256];
	ej_attn_shape m = shape_of(c);
	ej_attn_operand oq = operand(q), ok = operand(k), ov = operand(v),
			ogo = operand(go);

	describe(what, sizeof what, c, dt, "forward");
	epj_status st = ej_tmpl_attention_fwd(ctx, "cuda-sim", dt, &m, &oq, &ok,
					      &ov, ej_data(out), ej_data(lse));
	ck_assert_msg(st == EPJ_OK, "%s: %s", what, epj_ctx_error(ctx));
	double *qv = tu_values(ctx, q), *kv = tu_values(ctx, k),
	       *vv = tu_values(ctx, v), *gv = tu_values(ctx, go);
	int64_t nq = c->b * c->hq * c->t;
	double *ro = malloc(sizeof *ro * (size_t)(nq * c->dv + 1));
	double *rl = malloc(sizeof *rl * (size_t)(nq + 1));
	ref_fwd(c, qv, kv, vv, ro, rl);
	tol ft = fw_tol(dt);
	tu_assert_close(ctx, out, ro, ft.rtol, ft.atol, what);
	/* lse is in the compute type: f32 rounding for bf16 too */
	tol lt = dt == EPJ_DTYPE_F64 ? ft : fw_tol(EPJ_DTYPE_F32);
	tu_assert_close(ctx, lse, rl, lt.rtol, lt.atol, what);

	/* backward from the kernel's own out and lse */
	describe(what, sizeof what, c, dt, "backward");
	ej_attn_operand oo = operand(out), ol = operand(lse);
	st = ej_tmpl_attention_bwd(ctx, "cuda-sim", dt, &m, &ogo, &oq, &ok, &ov,
				   &oo, &ol, ej_data(dq), ej_data(dk),
				   ej_data(dv));
	ck_assert_msg(st == EPJ_OK, "%s: %s", what, epj_ctx_error(ctx));
	double *outv = tu_values(ctx, out);
	double *rq = malloc(sizeof *rq * (size_t)(nq * c->d + 1));
	double *rk =
	    malloc(sizeof *rk * (size_t)(c->b * c->hkv * c->s * c->d + 1));
	double *rv =
	    malloc(sizeof *rv * (size_t)(c->b * c->hkv * c->s * c->dv + 1));
	double *mq = malloc(sizeof *mq * (size_t)(nq * c->d + 1));
	double *mk =
	    malloc(sizeof *mk * (size_t)(c->b * c->hkv * c->s * c->d + 1));
	double *mv =
	    malloc(sizeof *mv * (size_t)(c->b * c->hkv * c->s * c->dv + 1));
	ref_bwd(c, qv, kv, vv, gv, outv, rq, rk, rv, mq, mk, mv);
	char w2[300];
	snprintf(w2, sizeof w2, "%s dq", what);
	bw_close(ctx, dq, rq, mq, dt, w2);
	snprintf(w2, sizeof w2, "%s dk", what);
	bw_close(ctx, dk, rk, mk, dt, w2);
	snprintf(w2, sizeof w2, "%s dv", what);
	bw_close(ctx, dv, rv, mv, dt, w2);
	free(mq);
	free(mk);
	free(mv);

	free(qv);
	free(kv);
	free(vv);
	free(gv);
	free(outv);
	free(ro);
	free(rl);
	free(rq);
	free(rk);
	free(rv);
	epj_tensor *all[] = { q, k, v, go, out, lse, dq, dk, dv };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
}

/* Each dtype runs every row; head dims stay in two register classes (D <=
 * 32 and <= 64) per dtype to bound the modules built. */
static const cfg cases[] = {
	/* b hq hkv  t   s   d  dv causal scale */
	{ 1, 1, 1, 1, 1, 8, 8, true, 0 },	/* one query, one key */
	{ 2, 4, 2, 5, 5, 24, 24, true, 0 },	/* GQA 2:1, row 0: one key */
	{ 1, 6, 2, 17, 17, 64, 64, false, 0 },	/* GQA 3:1, one tile */
	{ 2, 6, 2, 37, 37, 8, 8, true, 0 },	/* two key tiles + tail */
	{ 1, 4, 2, 35, 35, 64, 64, true, 0.2 }, /* two tiles, scale */
	{ 1, 1, 1, 5, 17, 24, 8, true, 0 },	/* T < S, Dv != D */
	{ 1, 4, 2, 17, 5, 8, 8, true, 0 },	/* T > S: 12 rows see none */
	{ 1, 1, 1, 37, 37, 24, 24, false, 0 },	/* not causal, 2 tiles */
	{ 2, 6, 2, 1, 33, 64, 24, true, 0 },	/* decode: 1 query, 33 keys */
	{ 1, 4, 2, 33, 33, 24, 24, true, 0.7 }, /* sharper softmax */
};

static void run_cases(epj_dtype dt)
{
	epj_ctx *ctx = tu_ctx();
	for (size_t i = 0; i < LEN(cases); i++)
		check_case(ctx, &cases[i], dt, i % 3 == 1);
	epj_ctx_free(ctx);
}

START_TEST(test_f32)
{
	run_cases(EPJ_DTYPE_F32);
}
END_TEST

START_TEST(test_bf16)
{
	run_cases(EPJ_DTYPE_BF16);
}
END_TEST

START_TEST(test_f64)
{
	run_cases(EPJ_DTYPE_F64);
}
END_TEST

/* Head dims past 64 (the largest the template holds: 128, and 96 for a
 * partial register class), f32, both passes. */
START_TEST(test_wide_heads)
{
	epj_ctx *ctx = tu_ctx();
	static const cfg wide[] = {
		{ 1, 2, 1, 19, 19, 128, 128, true, 0 },
		{ 1, 2, 2, 7, 9, 96, 128, false, 0 },
	};
	for (size_t i = 0; i < LEN(wide); i++)
		check_case(ctx, &wide[i], EPJ_DTYPE_F32, i == 1);
	epj_ctx_free(ctx);
}
END_TEST

/* The tensor-core kernels (every bf16 forward and backward) at the sizes
 * their tiles make odd: 64-query (64-key) blocks and 64-key (64-query)
 * tiles, 32 past head dim 128, with T and S off their multiples, T != S
 * both ways (rows that see no key: out 0, lse -inf, dq 0; keys no query
 * sees: dk, dv 0), D and Dv off multiples of 16 (zero padding) and
 * different, MLA's 192/128, 256, GQA (per-head partials added up) and
 * Hq == Hkv (written directly), causal and not; both passes (the backward
 * from the kernel's out and lse).  The launch counter shows the
 * tensor-core kernels ran: forward, dq and dk/dv in one pass up to head
 * dim 128, in two (dv, dk) past it. */
unsigned long ej_attn_test_tc_launches(void);

START_TEST(test_bf16_tc)
{
	epj_ctx *ctx = tu_ctx();
	static const cfg tc[] = {
		/* b hq hkv  t   s    d   dv causal scale */
		{ 1, 4, 2, 100, 100, 128, 128, true, 0 },
		{ 2, 2, 1, 70, 45, 40, 24, true, 0 },	/* T > S: 25 see none */
		{ 1, 2, 1, 33, 90, 24, 8, false, 0.3 }, /* T < S, not causal */
		{ 1, 4, 1, 67, 67, 192, 128, true, 0 }, /* MLA, GQA 4:1 */
		{ 1, 2, 2, 40, 41, 256, 200, false, 0 },
		{ 1, 2, 1, 20, 5, 16, 16, true, 0 }, /* 15 of 20 see none */
	};
	for (size_t i = 0; i < LEN(tc); i++) {
		unsigned long n0 = ej_attn_test_tc_launches();
		check_case(ctx, &tc[i], EPJ_DTYPE_BF16, i % 2 == 1);
		/* forward, dq, and dk/dv in one pass or dv and dk */
		unsigned long want = tc[i].d <= 128 && tc[i].dv <= 128 ? 3 : 4;
		ck_assert_msg(ej_attn_test_tc_launches() == n0 + want,
			      "case %zu: %lu tensor-core launches, %lu "
			      "expected",
			      i, ej_attn_test_tc_launches() - n0, want);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Document ids: key j hidden from query i when their ids differ.  Runs of
 * 1..12 positions (packed documents, across the 32-key tiles and the
 * 64-query blocks and 64-key tiles of the bf16 tensor-core kernels) and
 * ids in any order, i64 and i32 ids, causal and not; f32 and bf16.  The
 * tensor-core forward and dq skip the key tiles whose documents are apart
 * from the block's (ej_tc_docs_apart), and dk/dv visit only the queries of
 * their keys' documents (ej_attn_doc_spans): the runs of 200 and 150
 * positions, in bf16, leave each 64-block only the tiles of its own
 * documents. */
unsigned long ej_attn_test_span_launches(void);

START_TEST(test_docs)
{
	epj_ctx *ctx = tu_ctx();
	static const cfg dc[] = {
		{ 2, 4, 2, 37, 37, 24, 24, true, 0 },
		{ 1, 2, 1, 20, 20, 8, 8, false, 0 },
		/* past one 64-query block and 64-key tile of the
		 * tensor-core kernels (bf16: random ids, causal) */
		{ 1, 2, 1, 70, 70, 40, 40, true, 0 },
		/* four 64-blocks, not causal (bf16: runs; tiles skipped) */
		{ 2, 2, 1, 200, 200, 16, 24, false, 0 },
		/* causal, GQA 2:1 (dk/dv partials per head); runs in bf16
		 * too, random ids in f32 */
		{ 1, 4, 2, 150, 150, 32, 16, true, 0 },
	};
	/* f32 and bf16: f64 takes the f32 paths (two modules built); the
	 * runs in f32 for even cases but the last, in bf16 for the others */
	static const epj_dtype dts[] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16 };
	int n = 0;
	for (size_t i = 0; i < LEN(dc); i++)
		for (int runs = 1; runs >= 0; runs--, n++) {
			const cfg *c = &dc[i];
			const bool last = i + 1 == LEN(dc);
			const epj_dtype dt =
			    dts[(i + (size_t)(runs ? last : 1)) % 2];
			int64_t *ids =
			    malloc(sizeof *ids * (size_t)(c->b * c->s));
			for (int64_t b = 0; b < c->b; b++) {
				int64_t doc = b, left = tu_randint(1, 13);
				for (int64_t j = 0; j < c->s; j++) {
					if (runs && left-- == 0) {
						doc++;
						left = tu_randint(0, 12);
					}
					ids[b * c->s + j] =
					    runs ? doc : tu_randint(0, 3);
				}
			}
			int64_t shp[2] = { c->b, c->s };
			docs_t = epj_zeros(
			    ctx, n % 2 ? EPJ_DTYPE_I32 : EPJ_DTYPE_I64, 2, shp);
			tu_ok(ctx, docs_t);
			for (int64_t j = 0; j < c->b * c->s; j++)
				epj_tensor_set_f64(docs_t, j, (double)ids[j]);
			docs_ids = ids;
			unsigned long n0 = ej_attn_test_tc_launches(),
				      s0 = ej_attn_test_span_launches();
			check_case(ctx, c, dt, n == 1);
			/* bf16 ran on the tensor cores: fwd, dq, dk/dv in one
			 * pass, and the spans of dk/dv once */
			ck_assert_uint_eq(ej_attn_test_tc_launches() - n0,
					  dt == EPJ_DTYPE_BF16 ? 3 : 0);
			ck_assert_uint_eq(ej_attn_test_span_launches() - s0,
					  dt == EPJ_DTYPE_BF16);
			epj_tensor_free(docs_t);
			docs_t = NULL;
			docs_ids = NULL;
			free(ids);
		}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- the eager adapters against the op table's CPU kernels -------------- */

/* flags: attr i[1] (1: a mask is the last input, 2: causal top-left) */
static ej_attrs sdpa_attrs(const cfg *c, int flags)
{
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, c->causal);
	if (flags)
		ej_attrs_push_i(&at, flags);
	ej_attrs_push_f(&at, c->scale);
	return at;
}

/* Masks of the adapter cases: none; additive f32; additive in q's dtype;
 * i32 (0 hides). */
enum { MK_NONE, MK_F32, MK_QDT, MK_I32 };

/* A mask for c on ctx, broadcast over B and/or Hq when bcast has bit 1 /
 * bit 2 (stride 0 there), strided over T and S (a transposed view): random
 * values (additive: uniform in [-4, 4], about a third -inf; i32: about a third
 * 0) and query row 0 fully hidden. */
static epj_tensor *make_mask(epj_ctx *ctx, const cfg *c, int kind,
			     epj_dtype qdt, int bcast)
{
	epj_dtype dt = kind == MK_I32	? EPJ_DTYPE_I32
		       : kind == MK_F32 ? EPJ_DTYPE_F32
					: qdt;
	int64_t sh[4] = { bcast & 1 ? 1 : c->b, bcast & 2 ? 1 : c->hq, c->s,
			  c->t };
	int64_t n = sh[0] * sh[1] * sh[2] * sh[3];
	double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
	for (int64_t e = 0; e < n; e++) {
		int64_t i = e % c->t; /* [.., S, T]: the query is the last */
		bool hide = i == 0 || tu_randint(0, 3) == 0;
		if (kind == MK_I32)
			v[e] = hide ? 0 : 1;
		else
			v[e] = hide ? -INFINITY : tu_uniform(-4, 4);
	}
	epj_tensor *st = epj_zeros(ctx, dt, 4, sh);
	tu_ok(ctx, st);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, st, v), EPJ_OK);
	free(v);
	epj_tensor *m = epj_transpose(ctx, st, 2, 3);
	tu_ok(ctx, m);
	epj_tensor_free(st);
	return m;
}

static tol adapter_tol(epj_dtype dt, bool bw)
{
	/* two implementations that round differently: one bf16 ulp apart */
	if (dt == EPJ_DTYPE_BF16)
		return (tol){ 1.0 / 100, bw ? 2e-2 : 1e-2 };
	return bw ? bw_tol(dt) : fw_tol(dt);
}

static void check_adapters(epj_ctx *cpu, epj_ctx *sim, const cfg *c,
			   epj_dtype dt, int mk, bool top_left)
{
	int64_t qsh[4] = { c->b, c->hq, c->t, c->d };
	int64_t ksh[4] = { c->b, c->hkv, c->s, c->d };
	int64_t vsh[4] = { c->b, c->hkv, c->s, c->dv };
	int64_t osh[4] = { c->b, c->hq, c->t, c->dv };
	/* strided inputs on the cuda-sim context */
	epj_tensor *q = tu_randn_nc(sim, dt, 4, qsh, true);
	epj_tensor *k = tu_randn_nc(sim, dt, 4, ksh, true);
	epj_tensor *v = tu_randn_nc(sim, dt, 4, vsh, false);
	epj_tensor *go = tu_randn_nc(sim, dt, 4, osh, true);
	tu_ok(sim, q);
	tu_ok(sim, k);
	tu_ok(sim, v);
	tu_ok(sim, go);
	int flags = (mk != MK_NONE ? 1 : 0) | (top_left ? 2 : 0);
	ej_attrs at = sdpa_attrs(c, flags);
	epj_tensor *mask =
	    mk != MK_NONE ? make_mask(sim, c, mk, dt, (int)tu_randint(0, 4))
			  : NULL;
	char what[300];

	/* forward: CPU kernel on the cpu context, the adapter on cuda-sim */
	epj_tensor *co[2] = { ej_tensor_alloc(cpu, dt, 4, osh, false),
			      ej_tensor_alloc(cpu, acc_dt(dt), 3, osh, false) };
	epj_tensor *so[2] = { ej_tensor_alloc(sim, dt, 4, osh, false),
			      ej_tensor_alloc(sim, acc_dt(dt), 3, osh, false) };
	epj_tensor *in[4] = { q, k, v, mask };
	ej_call call = { EJ_OP_SDPA, &at, in, mask ? 4 : 3, co, 2 };
	ck_assert_msg(ej_ops[EJ_OP_SDPA].cpu_kernel(cpu, &call) == EPJ_OK, "%s",
		      epj_ctx_error(cpu));
	call.out = so;
	describe(what, sizeof what, c, dt, "ej_cuda_op_sdpa");
	snprintf(what + strlen(what), sizeof what - strlen(what),
		 " mask %d top_left %d", mk, (int)top_left);
	ck_assert_msg(ej_cuda_op_sdpa(sim, &call) == EPJ_OK, "%s: %s", what,
		      epj_ctx_error(sim));
	tol ft = adapter_tol(dt, false);
	tu_assert_tensors_close(cpu, so[0], co[0], ft.rtol, ft.atol, what);
	tol lt = dt == EPJ_DTYPE_F64 ? ft : fw_tol(EPJ_DTYPE_F32);
	tu_assert_tensors_close(cpu, so[1], co[1], lt.rtol, lt.atol, what);

	/* backward of both from the CPU forward's out and a strided lse */
	epj_tensor *lse_nc = tu_noncontig(sim, co[1]);
	tu_ok(sim, lse_nc);
	epj_tensor *o_nc = tu_noncontig(sim, co[0]);
	tu_ok(sim, o_nc);
	epj_tensor *bin[7] = { go, q, k, v, o_nc, lse_nc, mask };
	epj_tensor *cg[3], *sg[3];
	const int64_t *gsh[3] = { qsh, ksh, vsh };
	for (int i = 0; i < 3; i++) {
		cg[i] = ej_tensor_alloc(cpu, dt, 4, gsh[i], false);
		sg[i] = ej_tensor_alloc(sim, dt, 4, gsh[i], false);
	}
	ej_call bcall = { EJ_OP_SDPA_BACKWARD, &at, bin, mask ? 7 : 6, cg, 3 };
	ck_assert_int_eq(ej_ops[EJ_OP_SDPA_BACKWARD].cpu_kernel(cpu, &bcall),
			 EPJ_OK);
	bcall.out = sg;
	describe(what, sizeof what, c, dt, "ej_cuda_op_sdpa_backward");
	snprintf(what + strlen(what), sizeof what - strlen(what),
		 " mask %d top_left %d", mk, (int)top_left);
	ck_assert_msg(ej_cuda_op_sdpa_backward(sim, &bcall) == EPJ_OK, "%s: %s",
		      what, epj_ctx_error(sim));
	tol bt = adapter_tol(dt, true);
	static const char *const gname[3] = { "dq", "dk", "dv" };
	for (int i = 0; i < 3; i++) {
		char w2[300];
		snprintf(w2, sizeof w2, "%s %s", what, gname[i]);
		tu_assert_tensors_close(cpu, sg[i], cg[i], bt.rtol, bt.atol,
					w2);
	}
	epj_tensor *all[] = { q,     k,	    v,	    go,	   co[0], co[1],
			      so[0], so[1], lse_nc, o_nc,  cg[0], cg[1],
			      cg[2], sg[0], sg[1],  sg[2], mask };
	for (size_t i = 0; i < LEN(all); i++)
		epj_tensor_free(all[i]);
}

/* The adapters' dtypes: f32, bf16 (on tensor cores), f64. */
static const epj_dtype adapter_dts[] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16,
					 EPJ_DTYPE_F64 };

START_TEST(test_adapters)
{
	epj_ctx *cpu = tu_ctx(), *sim = NULL;
	ck_assert_int_eq(epj_ctx_new("cuda-sim", &sim), EPJ_OK);
	epj_ctx_seed(sim, tu_seed() + 7);
	static const cfg acases[] = {
		{ 2, 4, 2, 17, 17, 8, 8, true, 0 },
		{ 1, 6, 2, 7, 37, 24, 16, true, 0.25 },
		{ 1, 3, 3, 37, 9, 16, 16, true, 0 },
		{ 1, 2, 1, 5, 5, 32, 24, false, 0 },
		/* empty sizes: no key (out 0, lse -inf, dq 0), no query (dk,
		 * dv 0) */
		{ 1, 2, 1, 3, 0, 8, 8, false, 0 },
		{ 2, 2, 1, 0, 4, 8, 8, true, 0 },
	};
	for (size_t d = 0; d < LEN(adapter_dts); d++)
		for (size_t i = 0; i < LEN(acases); i++)
			if ((i + d) % 2 == 0 ||
			    adapter_dts[d] == EPJ_DTYPE_F32 || i >= 4)
				check_adapters(cpu, sim, &acases[i],
					       adapter_dts[d], MK_NONE, false);
	epj_ctx_free(sim);
	epj_ctx_free(cpu);
}
END_TEST

/* The adapters with a mask (f32, q's dtype, i32; broadcast over B, Hq or
 * neither; read through strides; a row all hidden: out 0, lse 0, no
 * gradient) and causal aligned top-left, against the op table's CPU
 * kernels, at head dims up to 128 and past it (bf16: dk/dv in one pass,
 * and in two).  _i: the dtype (f32, bf16 on tensor cores, f64). */
START_TEST(test_adapters_mask)
{
	epj_ctx *cpu = tu_ctx(), *sim = NULL;
	ck_assert_int_eq(epj_ctx_new("cuda-sim", &sim), EPJ_OK);
	epj_ctx_seed(sim, tu_seed() + 11);
	static const cfg mcases[] = {
		{ 2, 4, 2, 17, 17, 8, 8, true, 0 },
		{ 1, 6, 2, 7, 37, 24, 16, true, 0.25 },
		{ 1, 3, 3, 37, 9, 16, 16, true, 0 },
		{ 2, 2, 1, 5, 70, 32, 24, false, 0 },
		{ 1, 2, 2, 66, 66, 16, 16, true, 0 },
		/* past head dim 128: bf16's two-pass dk/dv with the mask */
		{ 1, 2, 1, 9, 21, 160, 144, true, 0 },
	};
	epj_dtype dt = adapter_dts[_i];
	for (size_t i = 0; i < LEN(mcases); i++) {
		int mk = (int)(i + (size_t)_i) % 3 + 1;
		check_adapters(cpu, sim, &mcases[i], dt, mk, false);
		/* top-left causal, with and without a mask */
		if (mcases[i].causal)
			check_adapters(cpu, sim, &mcases[i], dt,
				       i % 2 ? MK_NONE : MK_I32, true);
	}
	epj_ctx_free(sim);
	epj_ctx_free(cpu);
}
END_TEST

/* ---- NVRTC ---------------------------------------------------------------
 * Every module the host API can ask for (dtype x head-dim registers)
 * compiles under NVRTC without a warning; the templates suite covers the
 * defaults for every arch.  (A third of them under EPJIT_CHECK_QUICK.) */
START_TEST(test_nvrtc_variants)
{
	int maj = 0, min = 0;
	if (!ej_nvrtc_version(&maj, &min)) {
		printf("test_nvrtc_variants: built without NVRTC, skipped\n");
		return;
	}
	epj_ctx *ctx = tu_ctx();
	for (int dt = 0; dt < 3; dt++)
		for (int dl = 1; dl <= 4; dl++) {
			if (!tu_quick_keep(4 * dt + dl))
				continue;
			char defs[96];
			snprintf(defs, sizeof defs,
				 "#define EJ_ATTN_DT %d\n#define EJ_ATTN_DL %d",
				 dt, dl);
			ej_arena *A = ej_arena_new();
			const char *src =
			    ej_tmpl_source(ctx, A, "attention", defs);
			ck_assert_ptr_nonnull(src);
			const char *arch = dl % 2 ? "sm_80" : "sm_90";
			ej_nvrtc_result r = { 0 };
			epj_status st = ej_nvrtc_compile(ctx, src, "attention",
							 arch, NULL, 0, &r);
			ck_assert_msg(st == EPJ_OK, "DT %d DL %d %s: %s", dt,
				      dl, arch, epj_ctx_error(ctx));
			ck_assert_msg(!r.log || !*r.log,
				      "DT %d DL %d %s: NVRTC said: %s", dt, dl,
				      arch, r.log);
			ck_assert_uint_gt(r.size, 0);
			ej_nvrtc_result_free(&r);
			ej_arena_free(A);
		}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- errors ----------------------------------------------------------------
 */

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	float buf[64] = { 0 };
	ej_attn_operand o = { buf, { 0, 0, 0, 0 } };
	ej_attn_shape m = { .b = 1,
			    .hq = 2,
			    .hkv = 1,
			    .t = 3,
			    .s = 3,
			    .d = 8,
			    .dv = 8,
			    .causal = true,
			    .scale = 0.5 };
	epj_status st = ej_tmpl_attention_fwd(ctx, "cuda-sim", EPJ_DTYPE_I32,
					      &m, &o, &o, &o, buf, buf);
	ck_assert_int_eq(st, EPJ_ERR_DTYPE);
	tu_assert_ctx_error(ctx, EPJ_ERR_DTYPE, TU_STRS("i32", "f32"));
	ej_attn_shape wide = m;
	wide.d = 257;
	st = ej_tmpl_attention_fwd(ctx, "cuda-sim", EPJ_DTYPE_F32, &wide, &o,
				   &o, &o, buf, buf);
	ck_assert_int_eq(st, EPJ_ERR_UNSUPPORTED);
	tu_assert_ctx_error(ctx, EPJ_ERR_UNSUPPORTED, TU_STRS("D=257", "256"));
	ej_attn_shape gqa = m;
	gqa.hq = 3;
	gqa.hkv = 2;
	st = ej_tmpl_attention_bwd(ctx, "cuda-sim", EPJ_DTYPE_F32, &gqa, &o, &o,
				   &o, &o, &o, &o, buf, buf, buf);
	ck_assert_int_eq(st, EPJ_ERR_SHAPE);
	tu_assert_ctx_error(ctx, EPJ_ERR_SHAPE, TU_STRS("Hq=3", "Hkv=2"));
	ej_attn_shape noscale = m;
	noscale.scale = 0;
	st = ej_tmpl_attention_fwd(ctx, "cuda-sim", EPJ_DTYPE_F32, &noscale, &o,
				   &o, &o, buf, buf);
	ck_assert_int_eq(st, EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID, TU_STRS("scale"));
	st = ej_tmpl_attention_fwd(ctx, "cpu", EPJ_DTYPE_F32, &m, &o, &o, &o,
				   buf, buf);
	ck_assert_int_eq(st, EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID, TU_STRS("runs no CUDA C"));

	/* adapters: the op's own shape errors, and a cpu context */
	int64_t qsh[4] = { 1, 2, 3, 8 }, ksh[4] = { 1, 1, 4, 6 };
	epj_tensor *q = tu_randn(ctx, EPJ_DTYPE_F32, 4, qsh);
	epj_tensor *k = tu_randn(ctx, EPJ_DTYPE_F32, 4, ksh);
	epj_tensor *out = ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 4, qsh, false);
	epj_tensor *lse = ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 3, qsh, false);
	epj_tensor *in[3] = { q, k, k }, *outs[2] = { out, lse };
	ej_attrs at = ej_attrs_none();
	ej_call c = { EJ_OP_SDPA, &at, in, 3, outs, 2 };
	ck_assert_int_eq(ej_cuda_op_sdpa(ctx, &c), EPJ_ERR_SHAPE);
	tu_assert_ctx_error(ctx, EPJ_ERR_SHAPE, TU_STRS("head dims"));
	in[1] = in[2] = q; /* valid shapes, but a cpu context */
	ck_assert_int_eq(ej_cuda_op_sdpa(ctx, &c), EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID, TU_STRS("cpu"));
	/* an output that is not contiguous is refused, named */
	epj_ctx *sim = NULL;
	ck_assert_int_eq(epj_ctx_new("cuda-sim", &sim), EPJ_OK);
	epj_tensor *out_nc = tu_noncontig(sim, out);
	outs[0] = out_nc;
	ck_assert_int_eq(ej_cuda_op_sdpa(sim, &c), EPJ_ERR_UNSUPPORTED);
	tu_assert_ctx_error(sim, EPJ_ERR_UNSUPPORTED,
			    TU_STRS("sdpa", "output 0", "contiguous"));
	/* a mask of a dtype the op refuses (the op's own check), and a host
	 * API mask dtype that is neither q's, f32 nor i32 */
	int64_t msh[4] = { 1, 1, 3, 3 };
	epj_tensor *mask = epj_zeros(ctx, EPJ_DTYPE_I64, 4, msh);
	epj_tensor *min[4] = { q, q, q, mask };
	ej_attrs mat = ej_attrs_none();
	ej_attrs_push_i(&mat, 0);
	ej_attrs_push_i(&mat, 1);
	outs[0] = out;
	ej_call mc = { EJ_OP_SDPA, &mat, min, 4, outs, 2 };
	ck_assert_int_eq(ej_cuda_op_sdpa(sim, &mc), EPJ_ERR_DTYPE);
	tu_assert_ctx_error(sim, EPJ_ERR_DTYPE, TU_STRS("sdpa", "mask"));
	ej_attn_shape bad = m;
	bad.mask = buf;
	bad.mask_dt = EPJ_DTYPE_BF16;
	st = ej_tmpl_attention_fwd(ctx, "cuda-sim", EPJ_DTYPE_F32, &bad, &o, &o,
				   &o, buf, buf);
	ck_assert_int_eq(st, EPJ_ERR_DTYPE);
	tu_assert_ctx_error(ctx, EPJ_ERR_DTYPE, TU_STRS("mask", "bf16"));
	epj_tensor_free(mask);
	epj_tensor_free(out_nc);
	epj_ctx_free(sim);
	epj_tensor_free(q);
	epj_tensor_free(k);
	epj_tensor_free(out);
	epj_tensor_free(lse);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_tmpl_attention_suite(void)
{
	Suite *s = suite_create("tmpl_attention");
	TCase *tc = tcase_create("sim");
	tcase_add_checked_fixture(tc, cache_setup, cache_teardown);
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_f32);
	tcase_add_test(tc, test_bf16);
	tcase_add_test(tc, test_f64);
	tcase_add_test(tc, test_wide_heads);
	tcase_add_test(tc, test_bf16_tc);
	tcase_add_test(tc, test_docs);
	tcase_add_test(tc, test_adapters);
	tcase_add_loop_test(tc, test_adapters_mask, 0, 3);
	tcase_add_test(tc, test_errors);
	tcase_add_test(tc, test_nvrtc_variants);
	suite_add_tcase(s, tc);
	return s;
}
