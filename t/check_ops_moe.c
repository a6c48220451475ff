/* check_ops_moe.c -- the fused MoE ops of lib/ops_moe.c: moe_route,
 * moe_permute, moe_unpermute, moe_grouped_mm, swiglu and their backward.
 *
 * Every forward result is compared against a double-precision reference
 * written here with plain loops, on fresh random inputs of odd sizes
 * (token counts that divide nothing, experts that receive no token, groups
 * of zero rows, logits with exact ties), in f64, f32 and bf16, contiguous
 * and not.  Gradients are checked against central differences in f64
 * (tu_gradcheck).  Bad counts and indices must fail with a message naming
 * the op.
 */
#include "check_util.h"
#include "ops_impl.h"
#include "ops_moe.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static epj_tensor *from_vals(epj_ctx *ctx, epj_dtype dt, int nd,
			     const int64_t *shape, const double *v)
{
	epj_tensor *t = epj_zeros(ctx, dt, nd, shape);
	tu_ok(ctx, t);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, t, v), EPJ_OK);
	return t;
}

static epj_tensor *from_i64(epj_ctx *ctx, int nd, const int64_t *shape,
			    const int64_t *v)
{
	epj_tensor *t = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, nd, shape, v);
	tu_ok(ctx, t);
	return t;
}

/* tolerance of a result in dt against a double reference */
static double tol_of(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? 1e-12 : dt == EPJ_DTYPE_F32 ? 2e-6 : 1e-2;
}

static const epj_dtype float_dts[3] = { EPJ_DTYPE_F64, EPJ_DTYPE_F32,
					EPJ_DTYPE_BF16 };

/* ---- moe_route ------------------------------------------------------- */

/* Reference router on logits l [N, E] (double): w [N, k], idx [N, k]. */
static void ref_route(const double *l, int64_t N, int64_t E, int64_t k,
		      bool norm, bool fixed, double *w, int64_t *idx)
{
	double *p = malloc(sizeof *p * (size_t)E);
	bool *taken = malloc(sizeof *taken * (size_t)E);
	for (int64_t n = 0; n < N; n++) {
		const double *r = l + n * E;
		double m = -INFINITY, s = 0;
		for (int64_t e = 0; e < E; e++)
			m = fmax(m, r[e]);
		for (int64_t e = 0; e < E; e++)
			s += p[e] = exp(r[e] - m);
		for (int64_t e = 0; e < E; e++) {
			p[e] /= s;
			taken[e] = false;
		}
		for (int64_t j = 0; j < k; j++) {
			int64_t best = -1;
			if (fixed) {
				best = (n * k + j) % E;
			} else {
				/* the largest not yet taken, the lower
				 * expert on ties */
				for (int64_t e = 0; e < E; e++)
					if (!taken[e] &&
					    (best < 0 || r[e] > r[best]))
						best = e;
				taken[best] = true;
			}
			idx[n * k + j] = best;
			w[n * k + j] = p[best];
		}
		double sum = 0;
		for (int64_t j = 0; j < k; j++)
			sum += w[n * k + j];
		for (int64_t j = 0; norm && j < k; j++)
			w[n * k + j] /= sum;
	}
	free(p);
	free(taken);
}

START_TEST(test_route_forward)
{
	epj_ctx *ctx = tu_ctx();
	char report[4096] = "";
	for (int rep = 0; rep < 24; rep++) {
		const epj_dtype dt = float_dts[rep % 3];
		const int64_t N = tu_randint(1, 40), E = tu_randint(1, 10);
		const int64_t k = tu_randint(1, E + 1);
		const bool norm = rep & 1, fixed = (rep / 6) % 2 == 1;
		const bool nc = rep % 4 == 3;
		int64_t sh[2] = { N, E };
		double *lv = malloc(sizeof *lv * (size_t)(N * E));
		for (int64_t i = 0; i < N * E; i++) {
			/* small integers in bf16-exact halves: many ties */
			lv[i] = rep % 2 ? tu_uniform(-3, 3)
					: (double)tu_randint(-4, 4) * 0.5;
			if (dt == EPJ_DTYPE_BF16)
				lv[i] = (double)tu_randint(-16, 16) * 0.25;
		}
		epj_tensor *l =
		    tu_maybe_noncontig(ctx, from_vals(ctx, dt, 2, sh, lv), nc);
		double *lr = tu_values(ctx, l); /* as stored (rounded) */
		epj_tensor *w = NULL, *idx = NULL;
		ck_assert_msg(ej_moe_route(ctx, l, (int)k, norm, fixed, &w,
					   &idx) == EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		ck_assert_int_eq(epj_tensor_dtype(w), dt == EPJ_DTYPE_F64
							  ? EPJ_DTYPE_F64
							  : EPJ_DTYPE_F32);
		double *rw = malloc(sizeof *rw * (size_t)(N * k));
		int64_t *ri = malloc(sizeof *ri * (size_t)(N * k));
		ref_route(lr, N, E, k, norm, fixed, rw, ri);
		double *gw = tu_values(ctx, w), *gi = tu_values(ctx, idx);
		for (int64_t i = 0; i < N * k; i++) {
			if ((int64_t)gi[i] != ri[i])
				tu_report(report, sizeof report,
					  " rep %d slot %lld: expert %g, "
					  "expected %lld;",
					  rep, (long long)i, gi[i],
					  (long long)ri[i]);
			double tol = dt == EPJ_DTYPE_F64 ? 1e-13 : 1e-6;
			if (fabs(gw[i] - rw[i]) > tol * (1 + fabs(rw[i])))
				tu_report(report, sizeof report,
					  " rep %d slot %lld: weight %g, "
					  "expected %g;",
					  rep, (long long)i, gw[i], rw[i]);
		}
		free(lv);
		free(lr);
		free(rw);
		free(ri);
		free(gw);
		free(gi);
		epj_tensor_free(l);
		epj_tensor_free(w);
		epj_tensor_free(idx);
	}
	ck_assert_msg(report[0] == 0, "moe_route:%s (seed %llu)", report,
		      (unsigned long long)tu_seed());
	epj_ctx_free(ctx);
}
END_TEST

typedef struct route_user {
	int k;
	bool norm, fixed;
} route_user;

static epj_tensor *route_fn(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	route_user *u = user;
	epj_tensor *w = NULL, *idx = NULL;
	if (ej_moe_route(ctx, in[0], u->k, u->norm, u->fixed, &w, &idx) !=
	    EPJ_OK)
		return NULL;
	epj_tensor_free(idx);
	return w;
}

START_TEST(test_route_grad)
{
	epj_ctx *ctx = tu_ctx();
	for (int rep = 0; rep < 8; rep++) {
		const int64_t N = tu_randint(1, 9), E = tu_randint(2, 8);
		route_user u = { (int)tu_randint(1, E + 1), rep & 1, rep >= 6 };
		int64_t sh[2] = { N, E };
		/* distinct logits, well apart, so that a step of 1e-6 never
		 * changes the selection: a random permutation of 0.1 steps
		 * plus a little noise */
		double *v = malloc(sizeof *v * (size_t)(N * E));
		for (int64_t n = 0; n < N; n++) {
			for (int64_t e = 0; e < E; e++)
				v[n * E + e] = 0.1 * (double)e;
			for (int64_t e = E - 1; e > 0; e--) {
				int64_t j = tu_randint(0, e + 1);
				double t = v[n * E + e];
				v[n * E + e] = v[n * E + j];
				v[n * E + j] = t;
			}
			for (int64_t e = 0; e < E; e++)
				v[n * E + e] += tu_uniform(-0.02, 0.02);
		}
		epj_tensor *l = from_vals(ctx, EPJ_DTYPE_F64, 2, sh, v);
		epj_tensor_set_requires_grad(l, true);
		char what[64];
		snprintf(what, sizeof what, "moe_route N %lld E %lld k %d%s%s",
			 (long long)N, (long long)E, u.k, u.norm ? " norm" : "",
			 u.fixed ? " fixed" : "");
		tu_gradcheck(ctx, route_fn, &l, 1, &u, 1e-6, 1e-6, 1e-8, what);
		free(v);
		epj_tensor_free(l);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- moe_permute ----------------------------------------------------- */

/* Random expert indices [N, k]: distinct within a token, drawn from the
 * first E - 2 experts (when E > k + 1) so that some expert gets none. */
static int64_t *rand_routes(int64_t N, int64_t k, int64_t E)
{
	int64_t *v = malloc(sizeof *v * (size_t)(N * k));
	int64_t avail = E > k + 1 ? E - 2 : E;
	for (int64_t n = 0; n < N; n++)
		for (int64_t j = 0; j < k; j++) {
			int64_t e;
			bool dup;
			do {
				e = tu_randint(0, avail);
				dup = false;
				for (int64_t q = 0; q < j; q++)
					dup = dup || v[n * k + q] == e;
			} while (dup);
			v[n * k + j] = e;
		}
	return v;
}

/* Reference stable order: pos[s] of slot s, counts[e]. */
static void ref_permute(const int64_t *idx, int64_t R, int64_t E, int64_t *pos,
			int64_t *counts)
{
	int64_t r = 0;
	for (int64_t e = 0; e < E; e++) {
		counts[e] = 0;
		for (int64_t s = 0; s < R; s++)
			if (idx[s] == e) {
				pos[s] = r++;
				counts[e]++;
			}
	}
}

START_TEST(test_permute_forward)
{
	epj_ctx *ctx = tu_ctx();
	for (int rep = 0; rep < 12; rep++) {
		const epj_dtype dt = float_dts[rep % 3];
		const int64_t N = tu_randint(1, 30), H = tu_randint(1, 11);
		const int64_t E = tu_randint(1, 9), k = tu_randint(1, E + 1);
		const int64_t R = N * k;
		int64_t xs[2] = { N, H }, is[2] = { N, k };
		epj_tensor *x = tu_randn_nc(ctx, dt, 2, xs, rep % 2 == 1);
		int64_t *iv = rand_routes(N, k, E);
		epj_tensor *idx = from_i64(ctx, 2, is, iv);
		epj_tensor *xsort = NULL, *pos = NULL, *cnt = NULL;
		ck_assert_msg(ej_moe_permute(ctx, x, idx, (int)E, &xsort, &pos,
					     &cnt) == EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		int64_t *rp = malloc(sizeof *rp * (size_t)R);
		int64_t *rc = malloc(sizeof *rc * (size_t)E);
		ref_permute(iv, R, E, rp, rc);
		double *xv = tu_values(ctx, x), *sv = tu_values(ctx, xsort);
		double *pv = tu_values(ctx, pos), *cv = tu_values(ctx, cnt);
		int64_t ss[2] = { R, H };
		tu_assert_shape(xsort, 2, ss);
		for (int64_t e = 0; e < E; e++)
			ck_assert_msg((int64_t)cv[e] == rc[e],
				      "expert %lld: %g rows, expected %lld",
				      (long long)e, cv[e], (long long)rc[e]);
		for (int64_t s = 0; s < R; s++) {
			ck_assert_msg((int64_t)pv[s] == rp[s],
				      "slot %lld at row %g, expected %lld",
				      (long long)s, pv[s], (long long)rp[s]);
			for (int64_t h = 0; h < H; h++)
				tu_assert(sv[rp[s] * H + h] ==
					  xv[(s / k) * H + h]);
		}
		free(iv);
		free(rp);
		free(rc);
		free(xv);
		free(sv);
		free(pv);
		free(cv);
		epj_tensor_free(x);
		epj_tensor_free(idx);
		epj_tensor_free(xsort);
		epj_tensor_free(pos);
		epj_tensor_free(cnt);
	}
	epj_ctx_free(ctx);
}
END_TEST

typedef struct perm_user {
	epj_tensor *idx, *pos, *w;
	int E;
} perm_user;

static epj_tensor *permute_fn(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	perm_user *u = user;
	epj_tensor *xs = NULL, *pos = NULL, *cnt = NULL;
	if (ej_moe_permute(ctx, in[0], u->idx, u->E, &xs, &pos, &cnt) != EPJ_OK)
		return NULL;
	epj_tensor_free(pos);
	epj_tensor_free(cnt);
	return xs;
}

START_TEST(test_permute_grad)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t N = tu_randint(1, 8), H = tu_randint(1, 6);
	const int64_t E = tu_randint(2, 7), k = tu_randint(1, E + 1);
	int64_t xs[2] = { N, H }, is[2] = { N, k };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F64, 2, xs);
	epj_tensor_set_requires_grad(x, true);
	int64_t *iv = rand_routes(N, k, E);
	perm_user u = { from_i64(ctx, 2, is, iv), NULL, NULL, (int)E };
	tu_gradcheck(ctx, permute_fn, &x, 1, &u, 1e-6, 1e-6, 1e-8,
		     "moe_permute");
	free(iv);
	epj_tensor_free(u.idx);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- moe_unpermute --------------------------------------------------- */

/* A random permutation of [0, R) as pos [N, k]. */
static int64_t *rand_perm(int64_t R)
{
	int64_t *p = malloc(sizeof *p * (size_t)(R + 1));
	for (int64_t i = 0; i < R; i++)
		p[i] = i;
	for (int64_t i = R - 1; i > 0; i--) {
		int64_t j = tu_randint(0, i + 1), t = p[i];
		p[i] = p[j];
		p[j] = t;
	}
	return p;
}

START_TEST(test_unpermute_forward)
{
	epj_ctx *ctx = tu_ctx();
	for (int rep = 0; rep < 12; rep++) {
		const epj_dtype dt = float_dts[rep % 3];
		const epj_dtype wdt =
		    dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
		const int64_t N = tu_randint(1, 25), H = tu_randint(1, 13);
		const int64_t k = tu_randint(1, 4), R = N * k;
		int64_t ys[2] = { R, H }, ws[2] = { N, k };
		epj_tensor *y = tu_randn_nc(ctx, dt, 2, ys, rep % 2 == 0);
		epj_tensor *w = tu_randn_nc(ctx, wdt, 2, ws, rep % 4 == 1);
		int64_t *pv = rand_perm(R);
		epj_tensor *pos = from_i64(ctx, 2, ws, pv);
		epj_tensor *out = ej_moe_unpermute(ctx, y, w, pos);
		tu_ok(ctx, out);
		ck_assert_int_eq(epj_tensor_dtype(out), dt);
		double *yv = tu_values(ctx, y), *wv = tu_values(ctx, w);
		double *ref = calloc((size_t)(N * H), sizeof *ref);
		for (int64_t n = 0; n < N; n++)
			for (int64_t j = 0; j < k; j++)
				for (int64_t h = 0; h < H; h++)
					ref[n * H + h] +=
					    wv[n * k + j] *
					    yv[pv[n * k + j] * H + h];
		tu_assert_close(ctx, out, ref, tol_of(dt), tol_of(dt),
				"moe_unpermute");
		free(yv);
		free(wv);
		free(ref);
		free(pv);
		epj_tensor_free(y);
		epj_tensor_free(w);
		epj_tensor_free(pos);
		epj_tensor_free(out);
	}
	epj_ctx_free(ctx);
}
END_TEST

static epj_tensor *unpermute_fn(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	perm_user *u = user;
	return ej_moe_unpermute(ctx, in[0], in[1], u->pos);
}

START_TEST(test_unpermute_grad)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t N = tu_randint(1, 7), H = tu_randint(1, 6);
	const int64_t k = tu_randint(1, 4), R = N * k;
	int64_t ys[2] = { R, H }, ws[2] = { N, k };
	epj_tensor *in[2] = { tu_randn(ctx, EPJ_DTYPE_F64, 2, ys),
			      tu_randn(ctx, EPJ_DTYPE_F64, 2, ws) };
	epj_tensor_set_requires_grad(in[0], true);
	epj_tensor_set_requires_grad(in[1], true);
	int64_t *pv = rand_perm(R);
	perm_user u = { NULL, from_i64(ctx, 2, ws, pv), NULL, 0 };
	tu_gradcheck(ctx, unpermute_fn, in, 2, &u, 1e-6, 1e-6, 1e-8,
		     "moe_unpermute");
	free(pv);
	epj_tensor_free(u.pos);
	epj_tensor_free(in[0]);
	epj_tensor_free(in[1]);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- moe_grouped_mm -------------------------------------------------- */

/* Random counts of G groups summing to R, some of them zero. */
static int64_t *rand_counts(int G, int64_t R)
{
	int64_t *c = calloc((size_t)G, sizeof *c);
	for (int64_t r = 0; r < R; r++) {
		int g = (int)tu_randint(0, G);
		if (G > 2 && g == 1)
			g = 0; /* group 1 stays empty */
		c[g]++;
	}
	return c;
}

START_TEST(test_grouped_mm_forward)
{
	epj_ctx *ctx = tu_ctx();
	for (int rep = 0; rep < 12; rep++) {
		const epj_dtype dt = float_dts[rep % 3];
		const bool tr = rep % 2 == 0, nc = rep % 4 >= 2;
		const int G = (int)tu_randint(1, 6);
		const int64_t R = tu_randint(0, 40), K = tu_randint(1, 17),
			      M = tu_randint(1, 15);
		int64_t xs[2] = { R, K }, gs[1] = { G };
		int64_t wsh[2] = { tr ? M : K, tr ? K : M };
		epj_tensor *x = tu_randn_nc(ctx, dt, 2, xs, nc && R > 0);
		int64_t *cv = rand_counts(G, R);
		epj_tensor *cnt = from_i64(ctx, 1, gs, cv);
		epj_tensor *w[8];
		double *wv[8];
		for (int g = 0; g < G; g++) {
			w[g] = tu_randn_nc(ctx, dt, 2, wsh, nc);
			wv[g] = tu_values(ctx, w[g]);
		}
		epj_tensor *y = ej_moe_grouped_mm(ctx, x, cnt, w, G, tr);
		tu_ok(ctx, y);
		int64_t ysh[2] = { R, M };
		tu_assert_shape(y, 2, ysh);
		double *xv = tu_values(ctx, x);
		double *ref = calloc((size_t)(R * M + 1), sizeof *ref);
		for (int g = 0, r0 = 0; g < G; r0 += (int)cv[g], g++)
			for (int64_t r = r0; r < r0 + cv[g]; r++)
				for (int64_t m = 0; m < M; m++) {
					double s = 0;
					for (int64_t q = 0; q < K; q++)
						s += xv[r * K + q] *
						     (tr ? wv[g][m * K + q]
							 : wv[g][q * M + m]);
					ref[r * M + m] = s;
				}
		/* bf16: one rounding of a sum over K products of bf16 values */
		double tl = dt == EPJ_DTYPE_BF16 ? 1e-2 : tol_of(dt) * 10;
		tu_assert_close(ctx, y, ref, tl, tl * sqrt((double)K),
				"moe_grouped_mm");
		for (int g = 0; g < G; g++) {
			epj_tensor_free(w[g]);
			free(wv[g]);
		}
		free(xv);
		free(ref);
		free(cv);
		epj_tensor_free(x);
		epj_tensor_free(cnt);
		epj_tensor_free(y);
	}
	epj_ctx_free(ctx);
}
END_TEST

typedef struct gmm_user {
	epj_tensor *cnt;
	int G;
	bool tr;
} gmm_user;

static epj_tensor *gmm_fn(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	gmm_user *u = user;
	return ej_moe_grouped_mm(ctx, in[0], u->cnt, in + 1, u->G, u->tr);
}

START_TEST(test_grouped_mm_grad)
{
	epj_ctx *ctx = tu_ctx();
	for (int rep = 0; rep < 4; rep++) {
		const bool tr = rep % 2 == 0;
		const int G = (int)tu_randint(2, 5);
		const int64_t R = tu_randint(1, 12), K = tu_randint(1, 6),
			      M = tu_randint(1, 6);
		int64_t xs[2] = { R, K }, gs[1] = { G };
		int64_t wsh[2] = { tr ? M : K, tr ? K : M };
		int64_t *cv = rand_counts(G, R);
		gmm_user u = { from_i64(ctx, 1, gs, cv), G, tr };
		epj_tensor *in[1 + 5];
		in[0] = tu_randn(ctx, EPJ_DTYPE_F64, 2, xs);
		for (int g = 0; g < G; g++)
			in[1 + g] =
			    tu_randn_nc(ctx, EPJ_DTYPE_F64, 2, wsh, rep >= 2);
		for (int i = 0; i <= G; i++)
			epj_tensor_set_requires_grad(in[i], true);
		tu_gradcheck(ctx, gmm_fn, in, 1 + G, &u, 1e-6, 1e-6, 1e-8,
			     tr ? "moe_grouped_mm (w^T)" : "moe_grouped_mm");
		/* an empty group's weight gets an exact zero gradient */
		for (int g = 0; g < G; g++) {
			if (cv[g] != 0)
				continue;
			epj_tensor *gr = epj_tensor_grad(in[1 + g]);
			ck_assert_ptr_nonnull(gr);
			double *gv = tu_values(ctx, gr);
			for (int64_t i = 0; i < epj_tensor_numel(gr); i++)
				ck_assert(gv[i] == 0);
			free(gv);
		}
		for (int i = 0; i <= G; i++)
			epj_tensor_free(in[i]);
		epj_tensor_free(u.cnt);
		free(cv);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* bf16 grouped products on the CPU's AMX tiles (lib/gemm_amx.c): forward
 * and the weight gradients, w and w^T, strided operands and an empty
 * group, against double sums, with and without EPJIT_CPU_AMX=0; on the
 * tiles where the CPU has them (kernels.cpu_amx). */
START_TEST(test_grouped_mm_amx)
{
	setenv("EPJIT_CPU_AMX", "0", 1);
	epj_ctx *off = tu_ctx();
	unsetenv("EPJIT_CPU_AMX");
	epj_ctx *on = tu_ctx();
	const int G = 4;
	const int64_t K = 45, M = 37;
	const int64_t cv[4] = { 31, 0, 40, 9 }, R = 80;
	for (int v = 0; v < 4; v++) {
		epj_ctx *ctx = v < 2 ? on : off;
		const bool tr = v % 2 == 0;
		int64_t xs[2] = { R, K }, gs[1] = { G }, ys[2] = { R, M };
		int64_t wsh[2] = { tr ? M : K, tr ? K : M };
		epj_tensor *x = tu_randn_nc(ctx, EPJ_DTYPE_BF16, 2, xs, tr);
		epj_tensor *cnt = from_i64(ctx, 1, gs, cv);
		epj_tensor *w[4];
		double *wv[4];
		for (int g = 0; g < G; g++) {
			w[g] = tu_randn_nc(ctx, EPJ_DTYPE_BF16, 2, wsh, !tr);
			epj_tensor_set_requires_grad(w[g], true);
			wv[g] = tu_values(ctx, w[g]);
		}
		epj_tensor_set_requires_grad(x, true);
		epj_tensor *y = ej_moe_grouped_mm(ctx, x, cnt, w, G, tr);
		tu_ok(ctx, y);
		epj_tensor *gy = tu_randn(ctx, EPJ_DTYPE_BF16, 2, ys);
		ck_assert_int_eq(epj_backward(ctx, y, gy), EPJ_OK);
		double *xv = tu_values(ctx, x), *gv = tu_values(ctx, gy);
		double *ref = calloc((size_t)(R * M), sizeof *ref);
		double *dw = calloc((size_t)(G * M * K), sizeof *dw);
		double *dx = calloc((size_t)(R * K), sizeof *dx);
		for (int g = 0, r0 = 0; g < G; r0 += (int)cv[g], g++)
			for (int64_t r = r0; r < r0 + cv[g]; r++)
				for (int64_t m = 0; m < M; m++)
					for (int64_t q = 0; q < K; q++) {
						int64_t wi =
						    tr ? m * K + q : q * M + m;
						ref[r * M + m] +=
						    xv[r * K + q] * wv[g][wi];
						dw[g * M * K + wi] +=
						    gv[r * M + m] *
						    xv[r * K + q];
						dx[r * K + q] +=
						    gv[r * M + m] * wv[g][wi];
					}
		/* one rounding to bf16 of f32 sums of exact products */
		tu_assert_close(ctx, y, ref, 1.0 / 250, 1e-2,
				"amx moe_grouped_mm");
		tu_assert_close(ctx, epj_tensor_grad(x), dx, 1.0 / 250, 1e-2,
				"amx moe_grouped_mm dx");
		free(dx);
		for (int g = 0; g < G; g++) {
			char what[64];
			snprintf(what, sizeof what, "amx moe_grouped_mm dw_%d",
				 g);
			tu_assert_close(ctx, epj_tensor_grad(w[g]),
					dw + g * M * K, 1.0 / 250, 1e-2, what);
			epj_tensor_free(w[g]);
			free(wv[g]);
		}
		free(xv);
		free(gv);
		free(ref);
		free(dw);
		epj_tensor_free(x);
		epj_tensor_free(cnt);
		epj_tensor_free(y);
		epj_tensor_free(gy);
	}
	ck_assert_int_eq(epj_counter_get(off, "kernels.cpu_amx"), 0);
	/* two forwards, their dx and their weight gradients */
	ck_assert_int_eq(epj_counter_get(on, "kernels.cpu_amx"),
			 ej_amx_usable() ? 6 : 0);
	epj_ctx_free(on);
	epj_ctx_free(off);
}
END_TEST

/* ---- swiglu ------------------------------------------------------------ */

static epj_tensor *swiglu_fn(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	(void)user;
	return ej_swiglu(ctx, in[0], in[1]);
}

START_TEST(test_swiglu)
{
	epj_ctx *ctx = tu_ctx();
	for (int rep = 0; rep < 6; rep++) {
		const epj_dtype dt = float_dts[rep % 3];
		int64_t sh[2] = { tu_randint(1, 30), tu_randint(1, 9) };
		epj_tensor *g = tu_randn_nc(ctx, dt, 2, sh, rep >= 3);
		epj_tensor *u = tu_randn(ctx, dt, 2, sh);
		epj_tensor *y = ej_swiglu(ctx, g, u);
		tu_ok(ctx, y);
		double *gv = tu_values(ctx, g), *uv = tu_values(ctx, u);
		int64_t n = sh[0] * sh[1];
		double *ref = malloc(sizeof *ref * (size_t)n);
		for (int64_t i = 0; i < n; i++)
			ref[i] = gv[i] / (1 + exp(-gv[i])) * uv[i];
		tu_assert_close(ctx, y, ref, tol_of(dt), tol_of(dt), "swiglu");
		free(gv);
		free(uv);
		free(ref);
		epj_tensor_free(g);
		epj_tensor_free(u);
		epj_tensor_free(y);
	}
	int64_t sh[2] = { 7, 5 };
	epj_tensor *in[2] = { tu_randn(ctx, EPJ_DTYPE_F64, 2, sh),
			      tu_randn(ctx, EPJ_DTYPE_F64, 2, sh) };
	epj_tensor_set_requires_grad(in[0], true);
	epj_tensor_set_requires_grad(in[1], true);
	tu_gradcheck(ctx, swiglu_fn, in, 2, NULL, 1e-6, 1e-6, 1e-8, "swiglu");
	epj_tensor_free(in[0]);
	epj_tensor_free(in[1]);
	epj_ctx_free(ctx);
}
END_TEST

/* f32 and bf16 SwiGLU forward and backward (the vector-exp kernels of
 * lib/ops_moe.c) against a double reference, on runs that cross the
 * kernels' 512-element chunks and 8-lane vectors with a tail, including
 * gates past exp's overflow and underflow and a NaN. */
START_TEST(test_swiglu_f32_kernels)
{
	epj_ctx *ctx = tu_ctx();
	static const double special[] = { -200.0, -88.8, -88.72, -88.7,
					  -87.4,  -50.0, -17.0,	 -1e-30,
					  0.0,	  1e-30, 17.0,	 50.0,
					  87.2,	  87.4,	 88.8,	 200.0 };
	const int ns = (int)(sizeof special / sizeof special[0]);
	for (int rep = 0; rep < 4; rep++) {
		const epj_dtype dt = rep < 3 ? EPJ_DTYPE_F32 : EPJ_DTYPE_BF16;
		int64_t n = rep == 0 ? tu_randint(1, 8) : tu_randint(513, 1700);
		double *gv = malloc(sizeof *gv * (size_t)n);
		double *uv = malloc(sizeof *uv * (size_t)n);
		double *dv = malloc(sizeof *dv * (size_t)n);
		for (int64_t i = 0; i < n; i++) {
			/* most gates where silu bends, some far out */
			gv[i] = tu_randint(0, 5) == 0 ? tu_uniform(-120, 120)
						      : tu_uniform(-12, 12);
			uv[i] = tu_uniform(-2, 2);
			dv[i] = tu_uniform(-2, 2);
		}
		for (int j = 0; j < ns && j < n; j++)
			gv[tu_randint(0, n)] = special[j];
		int64_t nan_at = n > 1 ? tu_randint(0, n) : -1;
		if (nan_at >= 0)
			gv[nan_at] = NAN;
		epj_tensor *in[3] = { from_vals(ctx, dt, 1, &n, dv),
				      from_vals(ctx, dt, 1, &n, gv),
				      from_vals(ctx, dt, 1, &n, uv) };
		double *d = tu_values(ctx, in[0]), *g = tu_values(ctx, in[1]);
		double *u = tu_values(ctx, in[2]);
		double *ry = malloc(sizeof *ry * (size_t)n);
		double *rg = malloc(sizeof *rg * (size_t)n);
		double *ru = malloc(sizeof *ru * (size_t)n);
		for (int64_t i = 0; i < n; i++) {
			double sg = 1 / (1 + exp(-g[i]));
			ry[i] = g[i] * sg * u[i];
			rg[i] = d[i] * u[i] * sg * (1 + g[i] * (1 - sg));
			ru[i] = d[i] * g[i] * sg;
		}
		/* the backward's 1 + g (1 - s) cancels near g = -1.28: an
		 * absolute term of a few f32 (bf16) roundings of |d u| <= 4 */
		const double tol = dt == EPJ_DTYPE_F32 ? 2e-6 : 1e-2;
		const double batol = dt == EPJ_DTYPE_F32 ? 1e-5 : 1e-3;
		epj_tensor *y = ej_swiglu(ctx, in[1], in[2]);
		tu_ok(ctx, y);
		tu_assert_close(ctx, y, ry, tol, 1e-30, "swiglu f32 kernel");
		epj_tensor *outs[2] = { NULL, NULL };
		ck_assert_int_eq(ej_dispatch(ctx, EJ_OP_SWIGLU_BACKWARD, in, 3,
					     NULL, outs, 2),
				 EPJ_OK);
		tu_assert_close(ctx, outs[0], rg, tol, batol, "swiglu dgate");
		tu_assert_close(ctx, outs[1], ru, tol, batol, "swiglu dup");
		if (nan_at >= 0) {
			double *yv = tu_values(ctx, y);
			ck_assert(isnan(yv[nan_at]));
			free(yv);
		}
		for (int i = 0; i < 3; i++)
			epj_tensor_free(in[i]);
		epj_tensor_free(outs[0]);
		epj_tensor_free(outs[1]);
		epj_tensor_free(y);
		free(gv);
		free(uv);
		free(dv);
		free(d);
		free(g);
		free(u);
		free(ry);
		free(rg);
		free(ru);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- errors ------------------------------------------------------------ */

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t xs[2] = { 5, 3 }, gs[1] = { 2 }, ws[2] = { 4, 3 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 2, xs);
	epj_tensor *w[2] = { tu_randn(ctx, EPJ_DTYPE_F32, 2, ws),
			     tu_randn(ctx, EPJ_DTYPE_F32, 2, ws) };
	/* counts that do not sum to the rows */
	epj_tensor *bad = from_i64(ctx, 1, gs, (int64_t[]){ 2, 2 });
	tu_assert_error(ctx, ej_moe_grouped_mm(ctx, x, bad, w, 2, true),
			EPJ_ERR_INVALID,
			TU_STRS("moe_grouped_mm", "sum to 4", "expected 5"));
	/* a weight of the wrong width */
	int64_t ws2[2] = { 4, 2 };
	epj_tensor *w2[2] = { w[0], tu_randn(ctx, EPJ_DTYPE_F32, 2, ws2) };
	epj_tensor *good = from_i64(ctx, 1, gs, (int64_t[]){ 3, 2 });
	tu_assert_error(ctx, ej_moe_grouped_mm(ctx, x, good, w2, 2, true),
			EPJ_ERR_SHAPE, TU_STRS("moe_grouped_mm", "weight 1"));
	/* an expert index out of range */
	int64_t is[2] = { 5, 1 };
	epj_tensor *idx = from_i64(ctx, 2, is, (int64_t[]){ 0, 1, 3, 1, 0 });
	epj_tensor *a = NULL, *b = NULL, *c = NULL;
	ck_assert_int_eq(ej_moe_permute(ctx, x, idx, 3, &a, &b, &c),
			 EPJ_ERR_INDEX);
	ck_assert_ptr_null(a);
	tu_assert_ctx_error(
	    ctx, EPJ_ERR_INDEX,
	    TU_STRS("moe_permute", "index value 3", "for the experts"));
	/* positions that are not a permutation */
	int64_t ps[2] = { 5, 1 };
	epj_tensor *wt = tu_randn(ctx, EPJ_DTYPE_F32, 2, ps);
	epj_tensor *rep = from_i64(ctx, 2, ps, (int64_t[]){ 0, 1, 2, 1, 4 });
	tu_assert_error(ctx, ej_moe_unpermute(ctx, x, wt, rep), EPJ_ERR_INDEX,
			TU_STRS("moe_unpermute", "position 1 appears twice"));
	epj_tensor_free(wt);
	epj_tensor_free(rep);
	/* k larger than the number of experts */
	epj_tensor *wo = NULL, *io = NULL;
	ck_assert_int_eq(ej_moe_route(ctx, x, 4, true, false, &wo, &io),
			 EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID,
			    TU_STRS("moe_route", "k = 4"));
	epj_tensor_free(w2[1]);
	epj_tensor_free(good);
	epj_tensor_free(idx);
	epj_tensor_free(bad);
	epj_tensor_free(w[0]);
	epj_tensor_free(w[1]);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_ops_moe_suite(void)
{
	Suite *s = suite_create("ops_moe");
	TCase *tc = tcase_create("ops_moe");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_route_forward);
	tcase_add_test(tc, test_route_grad);
	tcase_add_test(tc, test_permute_forward);
	tcase_add_test(tc, test_permute_grad);
	tcase_add_test(tc, test_unpermute_forward);
	tcase_add_test(tc, test_unpermute_grad);
	tcase_add_test(tc, test_grouped_mm_forward);
	tcase_add_test(tc, test_grouped_mm_grad);
	tcase_add_test(tc, test_grouped_mm_amx);
	tcase_add_test(tc, test_swiglu);
	tcase_add_test(tc, test_swiglu_f32_kernels);
	tcase_add_test(tc, test_errors);
	suite_add_tcase(s, tc);
	return s;
}
