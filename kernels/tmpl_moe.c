/* tmpl_moe.c -- host side of the MoE, embedding and loss templates: their
 * arguments (the structs of templates/args.h, which the templates are
 * compiled with too), geometry, scratch buffers on the module's device,
 * and the eager adapters of EMBEDDING, EMBEDDING_BACKWARD, CROSS_ENTROPY,
 * CROSS_ENTROPY_BACKWARD and the fused MoE ops.  The optimizer template's
 * host side is tmpl_optim.c.
 *
 * Every launch lists its outputs (ej_launch_out) so that cuda-sim poisons
 * them, checks that each element is written and compares two block/thread
 * orders bit for bit.
 */
#include "tmpl_moe.h"

#include "templates/args.h"
#include "tmpl.h"
#include "tmpl_gemm.h" /* ej_index_pinned */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- modules ------------------------------------------------------------ */

static const ej_tmpl_kernel moe_kernels[] = {
	{ "ej_moe_route", "struct ej_moe_route_args" },
	{ "ej_moe_sort_count", "struct ej_moe_sort_args" },
	{ "ej_moe_sort_scan", "struct ej_moe_sort_args" },
	{ "ej_moe_sort_scatter", "struct ej_moe_sort_args" },
	{ "ej_moe_permute", "struct ej_moe_permute_args" },
	{ "ej_moe_permute_bw", "struct ej_moe_permute_bw_args" },
	{ "ej_moe_combine", "struct ej_moe_combine_args" },
	{ "ej_moe_combine_bw_y", "struct ej_moe_combine_args" },
	{ "ej_moe_combine_bw_w", "struct ej_moe_combine_args" },
	{ "ej_moe_route_bw", "struct ej_moe_route_bw_args" },
	{ "ej_swiglu_fwd", "struct ej_swiglu_args" },
	{ "ej_swiglu_bwd", "struct ej_swiglu_args" },
};
static const ej_tmpl_kernel embed_kernels[] = {
	{ "ej_embed_fwd", "struct ej_embed_args" },
	{ "ej_embed_bwd", "struct ej_embed_args" },
	{ "ej_ce_rows", "struct ej_ce_args" },
	{ "ej_ce_reduce", "struct ej_ce_args" },
	{ "ej_ce_count", "struct ej_ce_args" },
	{ "ej_ce_bwd", "struct ej_ce_args" },
};
#define NK(a) ((int)(sizeof(a) / sizeof((a)[0])))

static epj_status get_moe(epj_ctx *ctx, const char *dev, ej_tmpl **m)
{
	return ej_tmpl_get(ctx, dev, "moe", NULL, moe_kernels, NK(moe_kernels),
			   m);
}
static epj_status get_embed(epj_ctx *ctx, const char *dev, ej_tmpl **m)
{
	return ej_tmpl_get(ctx, dev, "embedding", NULL, embed_kernels,
			   NK(embed_kernels), m);
}

static epj_status need_float(epj_ctx *ctx, const char *what, const char *arg,
			     epj_dtype dt)
{
	if (ej_tmpl_dcode(dt) >= 0)
		return EPJ_OK;
	return ej_error(ctx, EPJ_ERR_DTYPE,
			"%s: %s has dtype %s, expected f32, bf16 or f64", what,
			arg, epj_dtype_name(dt));
}

static epj_status need_rdt(epj_ctx *ctx, const char *what, epj_dtype dt)
{
	if (dt == EPJ_DTYPE_F32 || dt == EPJ_DTYPE_F64)
		return EPJ_OK;
	return ej_error(ctx, EPJ_ERR_DTYPE,
			"%s: routing dtype %s, expected f32 or f64", what,
			epj_dtype_name(dt));
}

static unsigned clamp_grid(int64_t n)
{
	if (n < 1)
		return 1;
	return n > 65535 ? 65535u : (unsigned)n;
}

/* threads for a row of h elements: a multiple of 32 from 32 to 256 */
static unsigned row_threads(int64_t h)
{
	int64_t t = (h + 31) / 32 * 32;
	return t < 32 ? 32u : t > 256 ? 256u : (unsigned)t;
}

/* scratch on the module's device; NULL with an error */
static void *dev_alloc(epj_ctx *ctx, ej_tmpl *m, size_t bytes, const char *w)
{
	return ej_tmpl_scratch_alloc(ctx, ej_tmpl_device(m), bytes, w);
}
static void dev_free(epj_ctx *ctx, ej_tmpl *m, void *p)
{
	ej_tmpl_scratch_free(ctx, ej_tmpl_device(m), p);
}

/* 16-byte accesses need every buffer on a 16-byte boundary */
static bool aligned16(const void *const *p, int n)
{
	for (int i = 0; i < n; i++)
		if ((uintptr_t)p[i] % 16)
			return false;
	return true;
}

/* 32-bit index math: n and every thread's last index + the grid's threads
 * stay below 2^31 (grids have at most 65535 blocks of 1024 threads) */
static bool fits_i32(int64_t n)
{
	return n >= 0 && n < ((int64_t)1 << 30);
}

/* Row kernels (permute, combine and their backward) over rows of h
 * elements of es bytes: 16-byte vectors when `ok` (what else the kernel
 * needs), a row is a whole number of them and every buffer of p[0..n) is
 * aligned (counted: moe.rows.vec16 or moe.rows.scalar). */
static bool rows_vec16(epj_ctx *ctx, bool ok, int64_t h, size_t es,
		       const void *const *p, int n)
{
	bool v = ok && ((uint64_t)h * es) % 16 == 0 && aligned16(p, n);
	epj_counter_add(ctx, v ? "moe.rows.vec16" : "moe.rows.scalar", 1);
	return v;
}

/* ---- MoE ---------------------------------------------------------------- */

/* keys per block of the sort (EJ_MOE_SORT_T of templates/moe.cuh) */
#define MOE_SORT_T 256

epj_status ej_tmpl_moe_route(epj_ctx *ctx, const char *device,
			     const void *logits, epj_dtype ldt, int64_t sl0,
			     int64_t sl1, int64_t N, int E, int k, bool norm,
			     bool fixed, void *probs, void *w, int64_t *idx)
{
	const char *what = "moe route";
	epj_status st = need_float(ctx, what, "logits", ldt);
	if (st != EPJ_OK)
		return st;
	if (N < 0 || E < 1 || k < 1 || k > E || k > EJ_TMPL_MOE_MAX_K)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s: N = %lld tokens, E = %d experts, k = %d: "
				"expected N >= 0, 1 <= k <= min(E, %d)",
				what, (long long)N, E, k, EJ_TMPL_MOE_MAX_K);
	if (N == 0)
		return EPJ_OK;
	ej_tmpl *m;
	if ((st = get_moe(ctx, device, &m)) != EPJ_OK)
		return st;
	const bool f64 = ldt == EPJ_DTYPE_F64;
	const size_t rs = f64 ? 8 : 4;
	struct ej_moe_route_args a = { .logits = logits,
				       .sl0 = sl0,
				       .sl1 = sl1,
				       .ldt = ej_tmpl_dcode(ldt),
				       .rdt = f64 ? 2 : 0,
				       .N = N,
				       .E = E,
				       .k = k,
				       .norm = norm,
				       .fixed = fixed,
				       .probs = probs,
				       .w = w,
				       .idx = (long long *)idx };
	ej_launch_out o[3] = { ej_tmpl_out(probs, N * E, rs),
			       ej_tmpl_out(w, N * k, rs),
			       ej_tmpl_out(idx, N * k, 8) };
	return ej_tmpl_launch_1d(ctx, m, "ej_moe_route",
				 clamp_grid((N + 3) / 4), 128, &a, sizeof a, o,
				 3);
}

epj_status ej_tmpl_moe_sort(epj_ctx *ctx, const char *device,
			    const int64_t *key, int64_t n, int B,
			    int64_t *counts, int64_t *offsets, int64_t *order,
			    int64_t *pos)
{
	if (n < 0 || B < 1)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"moe sort: %lld keys into %d buckets: expected "
				"n >= 0 and B >= 1",
				(long long)n, B);
	ej_tmpl *m;
	epj_status st = get_moe(ctx, device, &m);
	if (st != EPJ_OK)
		return st;
	/* blocks of MOE_SORT_T keys; per block and key a count and a base */
	const int64_t G = (n + MOE_SORT_T - 1) / MOE_SORT_T, GB = G * B;
	long long *scratch =
	    dev_alloc(ctx, m, sizeof(long long) * 2 * (size_t)GB, "moe sort");
	if (!scratch)
		return EPJ_ERR_NOMEM;
	struct ej_moe_sort_args a = { .key = (const long long *)key,
				      .n = n,
				      .B = B,
				      .counts = (long long *)counts,
				      .offsets = (long long *)offsets,
				      .order = (long long *)order,
				      .pos = (long long *)pos,
				      .scratch = scratch,
				      .base = scratch + GB,
				      .G = G };
	epj_counter_add(ctx, "moe.sort.blocks", G);
	if (G > 0) {
		ej_launch_out o = ej_tmpl_out(a.scratch, GB, 8);
		st = ej_tmpl_launch_1d(ctx, m, "ej_moe_sort_count",
				       clamp_grid(G), MOE_SORT_T, &a, sizeof a,
				       &o, 1);
	}
	if (st == EPJ_OK) {
		ej_launch_out o[3] = { ej_tmpl_out(counts, B, 8),
				       ej_tmpl_out(offsets, B + 1, 8),
				       ej_tmpl_out(a.base, GB, 8) };
		st = ej_tmpl_launch_1d(ctx, m, "ej_moe_sort_scan", 1,
				       row_threads(B), &a, sizeof a, o,
				       G > 0 ? 3 : 2);
	}
	if (st == EPJ_OK && G > 0) {
		ej_launch_out o[2] = { ej_tmpl_out(order, n, 8),
				       ej_tmpl_out(pos, n, 8) };
		st = ej_tmpl_launch_1d(ctx, m, "ej_moe_sort_scatter",
				       clamp_grid(G), MOE_SORT_T, &a, sizeof a,
				       o, 2);
	}
	dev_free(ctx, m, scratch);
	return st;
}

epj_status ej_tmpl_moe_permute(epj_ctx *ctx, const char *device, const void *x,
			       epj_dtype dt, int64_t sx0, int64_t sx1,
			       const int64_t *order, int k, int64_t R,
			       int64_t H, void *out)
{
	size_t es = ej_dtype_size(dt);
	if (es != 2 && es != 4 && es != 8)
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"moe permute: dtype %s: expected elements of "
				"2, 4 or 8 bytes",
				epj_dtype_name(dt));
	if (k < 1 || R < 0 || H < 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"moe permute: k = %d, R = %lld, H = %lld", k,
				(long long)R, (long long)H);
	if (R == 0 || H == 0)
		return EPJ_OK;
	ej_tmpl *m;
	epj_status st = get_moe(ctx, device, &m);
	if (st != EPJ_OK)
		return st;
	const void *vp[2] = { x, out };
	const int64_t ax0 = sx0 < 0 ? -sx0 : sx0, ax1 = sx1 < 0 ? -sx1 : sx1;
	struct ej_moe_permute_args a = {
		.x = x,
		.sx0 = sx0,
		.sx1 = sx1,
		.order = (const long long *)order,
		.k = k,
		.R = R,
		.H = H,
		.elem = (int)es,
		.out = out,
		/* source rows on 16-byte boundaries too */
		.vec =
		    rows_vec16(ctx, sx1 == 1 && (sx0 * (int64_t)es) % 16 == 0,
			       H, es, vp, 2),
		.i32 = fits_i32(R * H) &&
		       fits_i32((R - 1) / k * ax0 + (H - 1) * ax1 + 1)
	};
	ej_launch_out o = ej_tmpl_out(out, R * H, es);
	return ej_tmpl_launch_1d(ctx, m, "ej_moe_permute", clamp_grid(R),
				 row_threads(a.vec ? H * (int64_t)es / 16 : H),
				 &a, sizeof a, &o, 1);
}

epj_status ej_tmpl_moe_permute_backward(epj_ctx *ctx, const char *device,
					const void *dxs, epj_dtype dt,
					const int64_t *pos, int64_t N, int k,
					int64_t H, void *dx)
{
	epj_status st = need_float(ctx, "moe permute backward", "dxs", dt);
	if (st != EPJ_OK)
		return st;
	if (k < 1 || N < 0 || H < 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"moe permute backward: k = %d, N = %lld, H = "
				"%lld",
				k, (long long)N, (long long)H);
	if (N == 0 || H == 0)
		return EPJ_OK;
	ej_tmpl *m;
	if ((st = get_moe(ctx, device, &m)) != EPJ_OK)
		return st;
	const size_t es = ej_dtype_size(dt);
	const void *vp[2] = { dxs, dx };
	struct ej_moe_permute_bw_args a = {
		.dxs = dxs,
		.pos = (const long long *)pos,
		.N = N,
		.k = k,
		.H = H,
		.dt = ej_tmpl_dcode(dt),
		.dx = dx,
		.vec = rows_vec16(ctx, true, H, es, vp, 2),
		.i32 = fits_i32(N * k * H),
	};
	ej_launch_out o = ej_tmpl_out(dx, N * H, es);
	return ej_tmpl_launch_1d(ctx, m, "ej_moe_permute_bw", clamp_grid(N),
				 row_threads(a.vec ? H * (int64_t)es / 16 : H),
				 &a, sizeof a, &o, 1);
}

static epj_status combine_check(epj_ctx *ctx, const char *what, epj_dtype dt,
				epj_dtype wdt, int64_t N, int k, int64_t H)
{
	epj_status st = need_float(ctx, what, "y", dt);
	if (st == EPJ_OK)
		st = need_rdt(ctx, what, wdt);
	if (st == EPJ_OK && (k < 1 || N < 0 || H < 0))
		st = ej_error(ctx, EPJ_ERR_INVALID,
			      "%s: k = %d, N = %lld, H = %lld", what, k,
			      (long long)N, (long long)H);
	return st;
}

epj_status ej_tmpl_moe_combine(epj_ctx *ctx, const char *device, const void *y,
			       epj_dtype dt, const void *w, epj_dtype wdt,
			       const int64_t *pos, int64_t N, int k, int64_t H,
			       void *out)
{
	epj_status st = combine_check(ctx, "moe combine", dt, wdt, N, k, H);
	if (st != EPJ_OK || N == 0 || H == 0)
		return st;
	ej_tmpl *m;
	if ((st = get_moe(ctx, device, &m)) != EPJ_OK)
		return st;
	const size_t es = ej_dtype_size(dt);
	const void *vp[2] = { y, out };
	struct ej_moe_combine_args a = { .y = y,
					 .w = w,
					 .pos = (const long long *)pos,
					 .N = N,
					 .k = k,
					 .H = H,
					 .dt = ej_tmpl_dcode(dt),
					 .wdt = ej_tmpl_dcode(wdt),
					 .out = out,
					 .vec = rows_vec16(ctx, true, H, es, vp,
							   2),
					 .i32 = fits_i32(N * k * H) };
	ej_launch_out o = ej_tmpl_out(out, N * H, es);
	return ej_tmpl_launch_1d(ctx, m, "ej_moe_combine", clamp_grid(N),
				 row_threads(a.vec ? H * (int64_t)es / 16 : H),
				 &a, sizeof a, &o, 1);
}

epj_status ej_tmpl_moe_combine_backward(epj_ctx *ctx, const char *device,
					const void *dout, const void *y,
					epj_dtype dt, const void *w,
					epj_dtype wdt, const int64_t *pos,
					int64_t N, int k, int64_t H, void *dy,
					void *dw)
{
	epj_status st =
	    combine_check(ctx, "moe combine backward", dt, wdt, N, k, H);
	if (st != EPJ_OK || N == 0)
		return st;
	ej_tmpl *m;
	if ((st = get_moe(ctx, device, &m)) != EPJ_OK)
		return st;
	const int64_t R = N * k;
	const size_t es = ej_dtype_size(dt);
	struct ej_moe_combine_args a = { .y = y,
					 .w = w,
					 .pos = (const long long *)pos,
					 .dout = dout,
					 .N = N,
					 .k = k,
					 .H = H,
					 .dt = ej_tmpl_dcode(dt),
					 .wdt = ej_tmpl_dcode(wdt),
					 .out = dy,
					 .i32 = fits_i32(R * H) };
	if (dy && H > 0) {
		const void *vp[2] = { dout, dy };
		a.vec = rows_vec16(ctx, true, H, es, vp, 2);
		ej_launch_out o = ej_tmpl_out(dy, R * H, es);
		st = ej_tmpl_launch_1d(
		    ctx, m, "ej_moe_combine_bw_y", clamp_grid(R),
		    row_threads(a.vec ? H * (int64_t)es / 16 : H), &a, sizeof a,
		    &o, 1);
	}
	if (st == EPJ_OK && dw) {
		a.vec = 0;
		a.out = dw;
		ej_launch_out o = ej_tmpl_out(dw, R, ej_dtype_size(wdt));
		st = ej_tmpl_launch_1d(ctx, m, "ej_moe_combine_bw_w",
				       clamp_grid((R + 3) / 4), 128, &a,
				       sizeof a, &o, 1);
	}
	return st;
}

epj_status ej_tmpl_moe_route_backward(epj_ctx *ctx, const char *device,
				      const void *probs, const int64_t *idx,
				      const void *dw, epj_dtype rdt, int64_t N,
				      int E, int k, bool norm, void *dlogits)
{
	const char *what = "moe route backward";
	epj_status st = need_rdt(ctx, what, rdt);
	if (st != EPJ_OK)
		return st;
	if (N < 0 || E < 1 || k < 1 || k > E || k > EJ_TMPL_MOE_MAX_K)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s: N = %lld tokens, E = %d experts, k = %d: "
				"expected N >= 0, 1 <= k <= min(E, %d)",
				what, (long long)N, E, k, EJ_TMPL_MOE_MAX_K);
	if (N == 0)
		return EPJ_OK;
	ej_tmpl *m;
	if ((st = get_moe(ctx, device, &m)) != EPJ_OK)
		return st;
	struct ej_moe_route_bw_args a = {
		probs, (const long long *)idx, dw,     N, E, k,
		norm,  ej_tmpl_dcode(rdt),     dlogits
	};
	ej_launch_out o = ej_tmpl_out(dlogits, N * E, ej_dtype_size(rdt));
	return ej_tmpl_launch_1d(ctx, m, "ej_moe_route_bw",
				 clamp_grid((N + 3) / 4), 128, &a, sizeof a, &o,
				 1);
}

/* One pass over n elements: SwiGLU forward (d NULL: y = silu(g) u) or
 * backward (y = dg, du), 256 threads a block, 16-byte vectors when every
 * buffer is aligned (counted: moe.swiglu.vec16 or moe.swiglu.scalar). */
static epj_status swiglu_launch(epj_ctx *ctx, const char *device, const void *d,
				const void *g, const void *u, epj_dtype dt,
				int64_t n, void *y, void *du)
{
	const char *what = d ? "swiglu backward" : "swiglu";
	epj_status st = need_float(ctx, what, "gate", dt);
	if (st != EPJ_OK)
		return st;
	if (n < 0)
		return ej_error(ctx, EPJ_ERR_INVALID, "%s: %lld elements", what,
				(long long)n);
	if (n == 0)
		return EPJ_OK;
	ej_tmpl *m;
	if ((st = get_moe(ctx, device, &m)) != EPJ_OK)
		return st;
	const void *ptrs[5] = { g, u, y, d ? d : g, du ? du : y };
	const size_t es = ej_dtype_size(dt);
	struct ej_swiglu_args a = { .g = g,
				    .u = u,
				    .d = d,
				    .y = y,
				    .du = du,
				    .n = n,
				    .dt = ej_tmpl_dcode(dt),
				    .vec = aligned16(ptrs, 5),
				    .i32 = fits_i32(n) };
	epj_counter_add(ctx, a.vec ? "moe.swiglu.vec16" : "moe.swiglu.scalar",
			1);
	const int64_t lanes = 16 / (int64_t)es;
	const int64_t items = a.vec ? n / lanes + lanes : n;
	ej_launch_out o[2] = { ej_tmpl_out(y, n, es), ej_tmpl_out(du, n, es) };
	return ej_tmpl_launch_1d(ctx, m, d ? "ej_swiglu_bwd" : "ej_swiglu_fwd",
				 clamp_grid((items + 255) / 256), 256, &a,
				 sizeof a, o, d ? 2 : 1);
}

epj_status ej_tmpl_swiglu(epj_ctx *ctx, const char *device, const void *g,
			  const void *u, epj_dtype dt, int64_t n, void *y)
{
	return swiglu_launch(ctx, device, NULL, g, u, dt, n, y, NULL);
}

epj_status ej_tmpl_swiglu_backward(epj_ctx *ctx, const char *device,
				   const void *d, const void *g, const void *u,
				   epj_dtype dt, int64_t n, void *dg, void *du)
{
	return swiglu_launch(ctx, device, d, g, u, dt, n, dg, du);
}

/* ---- embedding and cross-entropy ----------------------------------------- */

epj_status ej_tmpl_embedding(epj_ctx *ctx, const char *device, const void *w,
			     epj_dtype dt, int64_t sw0, int64_t sw1,
			     const int64_t *ids, int64_t n, int64_t D,
			     void *out)
{
	size_t es = ej_dtype_size(dt);
	if (es != 2 && es != 4 && es != 8)
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"embedding: weight dtype %s: expected elements "
				"of 2, 4 or 8 bytes",
				epj_dtype_name(dt));
	if (n < 0 || D < 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"embedding: %lld ids, D = %lld", (long long)n,
				(long long)D);
	if (n == 0 || D == 0)
		return EPJ_OK;
	ej_tmpl *m;
	epj_status st = get_embed(ctx, device, &m);
	if (st != EPJ_OK)
		return st;
	struct ej_embed_args a = {
		w, sw0, sw1,	 (const long long *)ids, n,
		0, D,	(int)es, ej_tmpl_dcode(dt),	 out
	};
	ej_launch_out o = ej_tmpl_out(out, n * D, es);
	return ej_tmpl_launch_1d(ctx, m, "ej_embed_fwd", clamp_grid(n),
				 row_threads(D), &a, sizeof a, &o, 1);
}

epj_status ej_tmpl_embedding_backward(epj_ctx *ctx, const char *device,
				      const void *g, epj_dtype dt, int64_t sg0,
				      int64_t sg1, const int64_t *ids,
				      int64_t n, int64_t V, int64_t D, void *dw)
{
	epj_status st = need_float(ctx, "embedding backward", "gradient", dt);
	if (st != EPJ_OK)
		return st;
	if (n < 0 || V < 0 || D < 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"embedding backward: %lld ids, V = %lld, D = "
				"%lld",
				(long long)n, (long long)V, (long long)D);
	if (V == 0 || D == 0)
		return EPJ_OK;
	ej_tmpl *m;
	if ((st = get_embed(ctx, device, &m)) != EPJ_OK)
		return st;
	struct ej_embed_args a = { g, sg0, sg1,	   (const long long *)ids, n,
				   V, D,   (int)0, ej_tmpl_dcode(dt),	   dw };
	ej_launch_out o = ej_tmpl_out(dw, V * D, ej_dtype_size(dt));
	return ej_tmpl_launch_1d(ctx, m, "ej_embed_bwd", clamp_grid(V),
				 row_threads(D), &a, sizeof a, &o, 1);
}

static epj_status ce_check(epj_ctx *ctx, const char *what, epj_dtype dt,
			   int64_t N, int64_t V)
{
	epj_status st = need_float(ctx, what, "logits", dt);
	if (st == EPJ_OK && (N < 0 || V < 1))
		st = ej_error(ctx, EPJ_ERR_INVALID,
			      "%s: logits [%lld, %lld]: expected V >= 1", what,
			      (long long)N, (long long)V);
	return st;
}

epj_status ej_tmpl_cross_entropy(epj_ctx *ctx, const char *device,
				 const void *logits, epj_dtype dt, int64_t s0,
				 int64_t s1, const int64_t *tgt, int64_t N,
				 int64_t V, int64_t ign, void *loss)
{
	epj_status st = ce_check(ctx, "cross_entropy", dt, N, V);
	if (st != EPJ_OK)
		return st;
	ej_tmpl *m;
	if ((st = get_embed(ctx, device, &m)) != EPJ_OK)
		return st;
	/* scratch: N row losses, then the count */
	char *s = dev_alloc(ctx, m, sizeof(double) * (size_t)(N + 1),
			    "cross_entropy");
	if (!s)
		return EPJ_ERR_NOMEM;
	struct ej_ce_args a = {
		logits,	     s0,
		s1,	     (const long long *)tgt,
		N,	     V,
		ign,	     ej_tmpl_dcode(dt),
		(double *)s, (long long *)(s + sizeof(double) * (size_t)N),
		NULL,	     0,
		loss
	};
	if (N > 0) {
		ej_launch_out o = ej_tmpl_out(s, N, 8);
		st = ej_tmpl_launch_1d(ctx, m, "ej_ce_rows", clamp_grid(N),
				       row_threads(V), &a, sizeof a, &o, 1);
	}
	if (st == EPJ_OK) {
		ej_launch_out o[2] = { ej_tmpl_out(loss, 1,
						   dt == EPJ_DTYPE_F64 ? 8 : 4),
				       ej_tmpl_out(a.cnt, 1, 8) };
		st = ej_tmpl_launch_1d(ctx, m, "ej_ce_reduce", 1, 256, &a,
				       sizeof a, o, 2);
	}
	dev_free(ctx, m, s);
	return st;
}

epj_status ej_tmpl_cross_entropy_backward(epj_ctx *ctx, const char *device,
					  const void *g, epj_dtype gdt,
					  const void *logits, epj_dtype dt,
					  int64_t s0, int64_t s1,
					  const int64_t *tgt, int64_t N,
					  int64_t V, int64_t ign, void *dlogits)
{
	epj_status st = ce_check(ctx, "cross_entropy_backward", dt, N, V);
	if (st == EPJ_OK)
		st = need_float(ctx, "cross_entropy_backward", "grad", gdt);
	if (st != EPJ_OK || N == 0)
		return st;
	ej_tmpl *m;
	if ((st = get_embed(ctx, device, &m)) != EPJ_OK)
		return st;
	long long *cnt = dev_alloc(ctx, m, sizeof *cnt, "cross_entropy");
	if (!cnt)
		return EPJ_ERR_NOMEM;
	struct ej_ce_args a = { logits, s0,  s1,  (const long long *)tgt,
				N,	V,   ign, ej_tmpl_dcode(dt),
				NULL,	cnt, g,	  ej_tmpl_dcode(gdt),
				dlogits };
	ej_launch_out oc = ej_tmpl_out(cnt, 1, 8);
	st = ej_tmpl_launch_1d(ctx, m, "ej_ce_count", 1, 256, &a, sizeof a, &oc,
			       1);
	if (st == EPJ_OK) {
		ej_launch_out o =
		    ej_tmpl_out(dlogits, N * V, ej_dtype_size(dt));
		st = ej_tmpl_launch_1d(ctx, m, "ej_ce_bwd", clamp_grid(N),
				       row_threads(V), &a, sizeof a, &o, 1);
	}
	dev_free(ctx, m, cnt);
	return st;
}

/* ---- eager adapters ------------------------------------------------------ */

static const char *ctx_device(const epj_ctx *ctx)
{
	return ctx->dev->name;
}

/* The values of index input `input` of c (i32/i64, any strides) read to the
 * host row-major (*host when host is not NULL, malloc'ed) and uploaded
 * contiguous i64 to the ctx's device (*dev, free with dev_release).  Each
 * value must be in [0, limit) -- or equal `ign` when ce (cross-entropy
 * targets) -- else the CPU kernel's error.  n = 0 gives NULL pointers. */
static epj_status index_upload(epj_ctx *ctx, const ej_call *c, int input,
			       int64_t limit, const char *what, bool ce,
			       int64_t ign, int64_t **dev, int64_t **host)
{
	if (host)
		*host = NULL;
	const epj_tensor *t = c->in[input];
	const ej_device *d = ctx->dev;
	const int64_t n = ej_numel(t->ndim, t->shape);
	const size_t es = ej_dtype_size(t->dtype);
	*dev = NULL;
	if (n == 0)
		return EPJ_OK;
	int64_t span = 1;
	for (int k = 0; k < t->ndim; k++)
		span += (t->shape[k] - 1) * t->stride[k];
	char *raw = NULL;
	int64_t *v = malloc(sizeof *v * (size_t)n);
	if (!v || (!d->host_visible && !(raw = malloc((size_t)span * es)))) {
		free(v);
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "out of memory reading %lld indices",
				   (long long)n);
	}
	const char *base = ej_data(t);
	if (raw) {
		d->copy(d->self, raw, base, (size_t)span * es);
		base = raw;
	}
	int64_t idx[EPJ_MAX_DIMS] = { 0 };
	const bool i64 = t->dtype == EPJ_DTYPE_I64;
	epj_status st = EPJ_OK;
	for (int64_t e = 0; e < n && st == EPJ_OK; e++) {
		int64_t off = ej_offset_of(t->ndim, idx, t->stride);
		int64_t x = i64 ? ((const int64_t *)base)[off]
				: ((const int32_t *)base)[off];
		v[e] = x;
		const bool bad = x < 0 || x >= limit;
		if (ce && bad && x != ign) {
			st = ej_op_error(ctx, c, EPJ_ERR_INDEX,
					 "target %lld at row %lld is out of "
					 "range [0, %lld) and is not "
					 "ignore_index %lld",
					 (long long)x, (long long)e,
					 (long long)limit, (long long)ign);
		} else if (!ce && bad) {
			char pos[160];
			ej_shape_str(t->ndim, idx, pos, sizeof pos);
			st = ej_op_error(ctx, c, EPJ_ERR_INDEX,
					 "index value %lld at position %s "
					 "(flat %lld) of input %d is out of "
					 "range [0, %lld) for %s",
					 (long long)x, pos, (long long)e, input,
					 (long long)limit, what);
		}
		ej_index_next(t->ndim, t->shape, idx);
	}
	free(raw);
	if (st == EPJ_OK) {
		/* the context's caching allocator: no driver call per step */
		*dev = ej_alloc(ctx->alloc, sizeof *v * (size_t)n);
		if (*dev)
			d->copy(d->self, *dev, v, sizeof *v * (size_t)n);
		else
			st = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					 "out of device memory for %lld "
					 "indices",
					 (long long)n);
	}
	if (st == EPJ_OK && host)
		*host = v;
	else
		free(v);
	return st;
}

static void dev_release(epj_ctx *ctx, void *p)
{
	ej_dealloc(ctx->alloc, p); /* NULL ok */
}

/* t [*, D] as rows of D: the row stride when the leading dims collapse into
 * one (always for ndim <= 2), else false. */
static bool rows_stride(const epj_tensor *t, int64_t *s0)
{
	int64_t s = -1, rows = 1;
	for (int k = t->ndim - 2; k >= 0; k--) {
		if (t->shape[k] == 1)
			continue;
		if (s < 0)
			s = t->stride[k];
		else if (t->stride[k] != s * rows)
			return false;
		rows *= t->shape[k];
	}
	*s0 = s < 0 ? 0 : s;
	return true;
}

epj_status ej_cuda_op_embedding(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *w = c->in[0], *ids = c->in[1];
	const int64_t V = w->shape[0], D = w->shape[1];
	const int64_t n = ej_numel(ids->ndim, ids->shape);
	int64_t *di;
	epj_status st = index_upload(ctx, c, 1, V, "the weight's rows", false,
				     0, &di, NULL);
	if (st != EPJ_OK)
		return st;
	st = ej_tmpl_embedding(ctx, ctx_device(ctx), ej_data(w), w->dtype,
			       w->stride[0], w->stride[1], di, n, D,
			       ej_data(c->out[0]));
	dev_release(ctx, di);
	return st;
}

epj_status ej_cuda_op_embedding_backward(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *g = c->in[0];
	const epj_tensor *ids = c->in[1];
	epj_tensor *out = c->out[0];
	const int64_t V = out->shape[0], D = out->shape[1];
	const int64_t n = ej_numel(ids->ndim, ids->shape);
	int64_t *di;
	epj_status st =
	    index_upload(ctx, c, 1, V, "the vocabulary", false, 0, &di, NULL);
	if (st != EPJ_OK)
		return st;
	int64_t s0;
	epj_tensor *gc = NULL;
	if (!rows_stride(g, &s0)) {
		/* leading dims that do not collapse: one contiguous copy */
		bool prev = epj_no_grad_enter(ctx);
		gc = epj_contiguous(ctx, g);
		epj_no_grad_exit(ctx, prev);
		if (!gc) {
			dev_release(ctx, di);
			return epj_ctx_status(ctx);
		}
		g = gc;
		rows_stride(g, &s0);
	}
	st = ej_tmpl_embedding_backward(ctx, ctx_device(ctx), ej_data(g),
					g->dtype, s0, g->stride[g->ndim - 1],
					di, n, V, D, ej_data(out));
	epj_tensor_free(gc);
	dev_release(ctx, di);
	return st;
}

static int64_t ce_ignore(const ej_call *c)
{
	return c->attrs->n_i > 0 ? c->attrs->i[0] : -100;
}

epj_status ej_cuda_op_cross_entropy(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *lg = c->in[0];
	const int64_t N = lg->shape[0], V = lg->shape[1], ign = ce_ignore(c);
	int64_t *dt;
	epj_status st =
	    index_upload(ctx, c, 1, V, "targets", true, ign, &dt, NULL);
	if (st != EPJ_OK)
		return st;
	st = ej_tmpl_cross_entropy(ctx, ctx_device(ctx), ej_data(lg), lg->dtype,
				   lg->stride[0], lg->stride[1], dt, N, V, ign,
				   ej_data(c->out[0]));
	dev_release(ctx, dt);
	return st;
}

epj_status ej_cuda_op_cross_entropy_backward(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *g = c->in[0], *lg = c->in[1];
	const int64_t N = lg->shape[0], V = lg->shape[1], ign = ce_ignore(c);
	int64_t *dt;
	epj_status st =
	    index_upload(ctx, c, 2, V, "targets", true, ign, &dt, NULL);
	if (st != EPJ_OK)
		return st;
	st = ej_tmpl_cross_entropy_backward(
	    ctx, ctx_device(ctx), ej_data(g), g->dtype, ej_data(lg), lg->dtype,
	    lg->stride[0], lg->stride[1], dt, N, V, ign, ej_data(c->out[0]));
	dev_release(ctx, dt);
	return st;
}

/* ---- the fused MoE ops (lib/ops_moe.c) as rows of the eager table --------
 * Each runs the kernels of templates/moe.cuh with the CPU kernel's
 * semantics, so the
 * AutoEP layer takes one data path on every device.  Index inputs are
 * checked as the CPU kernels check them: from the host copy the AutoEP
 * layer pinned (ej_index_pin: its experts and positions, which it has on
 * the host anyway), the device's copy then read in place with no transfer;
 * else read to the host and uploaded (one round trip).  Results are
 * written into the op's outputs by the device's own kernels, never by a
 * blocking copy. */

/* t in dtype dt: a new reference to t itself when it already is */
static epj_tensor *cast_or_ref(epj_ctx *ctx, epj_tensor *t, epj_dtype dt)
{
	return t->dtype == dt ? epj_tensor_ref(t) : epj_cast(ctx, t, dt);
}

/* t as a contiguous tensor of dtype dt (a new reference, no grad) */
static epj_tensor *dense_as(epj_ctx *ctx, epj_tensor *t, epj_dtype dt)
{
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *c = cast_or_ref(ctx, t, dt);
	epj_tensor *d = c && !ej_is_contiguous(c) ? epj_contiguous(ctx, c)
						  : epj_tensor_ref(c);
	epj_tensor_free(c);
	epj_no_grad_exit(ctx, prev);
	return d;
}

/* Writes t (dst's shape, any dtype and strides) into the op's output dst:
 * the device's cast kernel (a copy for equal dtypes). */
static epj_status put_out(epj_ctx *ctx, epj_tensor *t, epj_tensor *dst)
{
	if (!t)
		return epj_ctx_status(ctx);
	const ej_eager_fn *tab = ej_eager_table(ctx->dev);
	EJ_ASSERT(tab && tab[EJ_OP_CAST]);
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, dst->dtype);
	epj_tensor *in[1] = { t };
	epj_tensor *out[1] = { dst };
	ej_call cast = { .op = EJ_OP_CAST,
			 .attrs = &at,
			 .in = in,
			 .n_in = 1,
			 .out = out,
			 .n_out = 1 };
	return tab[EJ_OP_CAST](ctx, &cast);
}

/* scratch of n elements of es bytes on ctx's device (NULL for n = 0) */
static void *scratch(epj_ctx *ctx, const ej_call *c, int64_t n, size_t es,
		     epj_status *st)
{
	if (*st != EPJ_OK || n == 0)
		return NULL;
	void *p = ej_alloc(ctx->alloc, (size_t)n * es);
	if (!p)
		*st = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				  "out of device memory (%lld elements)",
				  (long long)n);
	return p;
}

/* An index input on the device as contiguous i64. */
typedef struct dev_index {
	const int64_t *p; /* NULL for no elements */
	void *owned;	  /* an upload to release, or NULL (in place) */
} dev_index;

/* Index input `input` of c: every value in [0, limit) and, when perm, each
 * once (positions, a permutation as moe_permute makes them), else the CPU
 * kernels' errors.  From its pinned host copy when it has one (then in
 * place when dense i64), else read to the host and uploaded. */
static epj_status index_in(epj_ctx *ctx, const ej_call *c, int input,
			   int64_t limit, const char *what, bool perm,
			   dev_index *out)
{
	const epj_tensor *t = c->in[input];
	const int64_t n = ej_numel(t->ndim, t->shape);
	out->p = NULL;
	out->owned = NULL;
	const int64_t *pin = ej_index_pinned(ctx, t);
	int64_t *host = NULL;
	epj_status st = EPJ_OK;
	if (pin && t->dtype == EPJ_DTYPE_I64 && ej_is_contiguous(t)) {
		for (int64_t e = 0; e < n && st == EPJ_OK; e++)
			if (pin[e] < 0 || pin[e] >= limit)
				st = ej_op_error(
				    ctx, c, EPJ_ERR_INDEX,
				    "index value %lld at flat position %lld "
				    "of input %d is out of range [0, %lld) "
				    "for %s",
				    (long long)pin[e], (long long)e, input,
				    (long long)limit, what);
		out->p = n ? ej_data(t) : NULL;
	} else {
		int64_t *d = NULL;
		st = index_upload(ctx, c, input, limit, what, false, 0, &d,
				  perm ? &host : NULL);
		out->p = out->owned = d;
		pin = host;
	}
	unsigned char *seen =
	    st == EPJ_OK && perm ? calloc((size_t)limit + 1, 1) : NULL;
	if (st == EPJ_OK && perm && !seen)
		st = ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
	for (int64_t e = 0; st == EPJ_OK && perm && e < n; e++) {
		if (seen[pin[e]])
			st = ej_op_error(ctx, c, EPJ_ERR_INDEX,
					 "row position %lld appears twice "
					 "(positions must be a permutation "
					 "of [0, %lld), as moe_permute makes "
					 "them)",
					 (long long)pin[e], (long long)limit);
		else
			seen[pin[e]] = 1;
	}
	free(seen);
	free(host);
	if (st != EPJ_OK) {
		dev_release(ctx, out->owned);
		out->p = out->owned = NULL;
	}
	return st;
}

static epj_dtype route_rdt(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
}

/* MOE_ROUTE: softmax, top-k (or the fixed assignment) and renormalisation
 * in one kernel; k beyond the kernel's limit runs the CPU kernel
 * (counted). */
epj_status ej_cuda_op_moe_route(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *l = c->in[0];
	const int64_t N = l->shape[0], E = l->shape[1], k = c->attrs->i[0];
	if (k > EJ_TMPL_MOE_MAX_K)
		return ej_eager_fallback(ctx, c);
	epj_status st = EPJ_OK;
	const epj_dtype rdt = c->out[0]->dtype;
	void *probs = scratch(ctx, c, N * E, ej_dtype_size(rdt), &st);
	if (st == EPJ_OK)
		st = ej_tmpl_moe_route(ctx, ctx_device(ctx), ej_data(l),
				       l->dtype, l->stride[0], l->stride[1], N,
				       (int)E, (int)k, c->attrs->i[1] != 0,
				       c->attrs->i[2] != 0, probs,
				       ej_data(c->out[0]), ej_data(c->out[1]));
	dev_release(ctx, probs);
	return st;
}

/* MOE_ROUTE_BACKWARD: the probabilities recomputed by the router kernel,
 * then its backward kernel in the routing dtype. */
epj_status ej_cuda_op_moe_route_backward(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *l = c->in[1];
	const int64_t N = l->shape[0], E = l->shape[1], k = c->attrs->i[0];
	if (k > EJ_TMPL_MOE_MAX_K)
		return ej_eager_fallback(ctx, c);
	const epj_dtype rdt = route_rdt(l->dtype);
	const size_t rs = ej_dtype_size(rdt);
	dev_index ix;
	epj_status st = index_in(ctx, c, 2, E, "the experts", false, &ix);
	void *probs = scratch(ctx, c, N * E, rs, &st);
	void *w = scratch(ctx, c, N * k, rs, &st);
	void *sel = scratch(ctx, c, N * k, 8, &st);
	epj_tensor *g = st == EPJ_OK ? dense_as(ctx, c->in[0], rdt) : NULL;
	epj_tensor *o = c->out[0]->dtype == rdt
			    ? epj_tensor_ref(c->out[0])
			    : ej_tensor_alloc(ctx, rdt, 2, l->shape, false);
	if (st == EPJ_OK && (!g || !o))
		st = epj_ctx_status(ctx);
	if (st == EPJ_OK)
		st = ej_tmpl_moe_route(ctx, ctx_device(ctx), ej_data(l),
				       l->dtype, l->stride[0], l->stride[1], N,
				       (int)E, (int)k, false, false, probs, w,
				       sel);
	if (st == EPJ_OK)
		st = ej_tmpl_moe_route_backward(
		    ctx, ctx_device(ctx), probs, ix.p, ej_data(g), rdt, N,
		    (int)E, (int)k, c->attrs->i[1] != 0, ej_data(o));
	if (st == EPJ_OK && o != c->out[0])
		st = put_out(ctx, o, c->out[0]);
	epj_tensor_free(g);
	epj_tensor_free(o);
	dev_release(ctx, probs);
	dev_release(ctx, w);
	dev_release(ctx, sel);
	dev_release(ctx, ix.owned);
	return st;
}

/* MOE_PERMUTE: the stable counting sort of the slots by expert (counts and
 * positions straight into the outputs), then the row gather. */
epj_status ej_cuda_op_moe_permute(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *x = c->in[0];
	const int64_t N = x->shape[0], H = x->shape[1], k = c->in[1]->shape[1];
	const int64_t R = N * k, E = c->attrs->i[0];
	if (E > INT32_MAX)
		return ej_eager_fallback(ctx, c);
	dev_index ix;
	epj_status st = index_in(ctx, c, 1, E, "the experts", false, &ix);
	int64_t *off = scratch(ctx, c, E + 1, 8, &st);
	int64_t *order = scratch(ctx, c, R, 8, &st);
	if (st == EPJ_OK)
		st = ej_tmpl_moe_sort(ctx, ctx_device(ctx), ix.p, R, (int)E,
				      ej_data(c->out[2]), off, order,
				      ej_data(c->out[1]));
	if (st == EPJ_OK)
		st = ej_tmpl_moe_permute(
		    ctx, ctx_device(ctx), ej_data(x), x->dtype, x->stride[0],
		    x->stride[1], order, (int)k, R, H, ej_data(c->out[0]));
	dev_release(ctx, ix.owned);
	dev_release(ctx, off);
	dev_release(ctx, order);
	return st;
}

/* MOE_PERMUTE_BACKWARD: dx[n] = sum_j grad[pos[n, j]], one kernel. */
epj_status ej_cuda_op_moe_permute_backward(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *o = c->out[0];
	const int64_t N = c->in[1]->shape[0], k = c->in[1]->shape[1];
	const int64_t H = o->shape[1];
	dev_index ps;
	epj_status st = index_in(ctx, c, 1, N * k, "the rows", false, &ps);
	epj_tensor *g = st == EPJ_OK ? dense_as(ctx, c->in[0], o->dtype) : NULL;
	if (st == EPJ_OK && !g)
		st = epj_ctx_status(ctx);
	if (st == EPJ_OK)
		st = ej_tmpl_moe_permute_backward(ctx, ctx_device(ctx),
						  ej_data(g), o->dtype, ps.p, N,
						  (int)k, H, ej_data(o));
	epj_tensor_free(g);
	dev_release(ctx, ps.owned);
	return st;
}

/* The combine kernels take f32 or f64 weights: other weights (bf16), and
 * a gradient of another dtype than the expert outputs, run the CPU
 * kernel (counted). */
static bool combine_dtypes(const ej_call *c, int yi, int wi)
{
	const epj_dtype w = c->in[wi]->dtype;
	return (w == EPJ_DTYPE_F32 || w == EPJ_DTYPE_F64) &&
	       c->in[0]->dtype == c->in[yi]->dtype;
}

/* MOE_UNPERMUTE: out[n] = sum_j w[n, j] y[pos[n, j]] in the weights'
 * dtype, slot order, one kernel. */
epj_status ej_cuda_op_moe_unpermute(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *y = c->in[0], *w = c->in[1];
	const int64_t N = w->shape[0], k = w->shape[1], H = y->shape[1];
	if (!combine_dtypes(c, 0, 1))
		return ej_eager_fallback(ctx, c);
	dev_index ps;
	epj_status st = index_in(ctx, c, 2, N * k, "the rows", true, &ps);
	epj_tensor *yc = st == EPJ_OK ? dense_as(ctx, y, y->dtype) : NULL;
	epj_tensor *wc = yc ? dense_as(ctx, w, w->dtype) : NULL;
	if (st == EPJ_OK && !wc)
		st = epj_ctx_status(ctx);
	if (st == EPJ_OK)
		st = ej_tmpl_moe_combine(ctx, ctx_device(ctx), ej_data(yc),
					 y->dtype, ej_data(wc), w->dtype, ps.p,
					 N, (int)k, H, ej_data(c->out[0]));
	epj_tensor_free(yc);
	epj_tensor_free(wc);
	dev_release(ctx, ps.owned);
	return st;
}

/* MOE_UNPERMUTE_BACKWARD: dy[pos[s]] = w[s] grad[s / k] and dw[s] =
 * grad[s / k] . y[pos[s]], the combine's backward kernels. */
epj_status ej_cuda_op_moe_unpermute_backward(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *y = c->in[1], *w = c->in[2];
	const int64_t N = w->shape[0], k = w->shape[1], H = y->shape[1];
	if (!combine_dtypes(c, 1, 2))
		return ej_eager_fallback(ctx, c);
	dev_index ps;
	epj_status st = index_in(ctx, c, 3, N * k, "the rows", true, &ps);
	epj_tensor *g = st == EPJ_OK ? dense_as(ctx, c->in[0], y->dtype) : NULL;
	epj_tensor *yc = g ? dense_as(ctx, y, y->dtype) : NULL;
	epj_tensor *wc = yc ? dense_as(ctx, w, w->dtype) : NULL;
	if (st == EPJ_OK && !wc)
		st = epj_ctx_status(ctx);
	if (st == EPJ_OK)
		st = ej_tmpl_moe_combine_backward(
		    ctx, ctx_device(ctx), ej_data(g), ej_data(yc), y->dtype,
		    ej_data(wc), w->dtype, ps.p, N, (int)k, H,
		    ej_data(c->out[0]), ej_data(c->out[1]));
	epj_tensor_free(g);
	epj_tensor_free(yc);
	epj_tensor_free(wc);
	dev_release(ctx, ps.owned);
	return st;
}

/* SWIGLU and its backward: one kernel each over the contiguous inputs (the
 * CPU kernel's formulas, f32 for bf16, rounded once). */
epj_status ej_cuda_op_swiglu(epj_ctx *ctx, ej_call *c)
{
	const epj_dtype dt = c->in[0]->dtype;
	epj_tensor *g = dense_as(ctx, c->in[0], dt);
	epj_tensor *u = g ? dense_as(ctx, c->in[1], dt) : NULL;
	epj_status st = u ? EPJ_OK : epj_ctx_status(ctx);
	if (st == EPJ_OK)
		st =
		    ej_tmpl_swiglu(ctx, ctx_device(ctx), ej_data(g), ej_data(u),
				   dt, epj_tensor_numel(g), ej_data(c->out[0]));
	epj_tensor_free(g);
	epj_tensor_free(u);
	return st;
}

epj_status ej_cuda_op_swiglu_backward(epj_ctx *ctx, ej_call *c)
{
	const epj_dtype dt = c->in[0]->dtype;
	epj_tensor *d = dense_as(ctx, c->in[0], dt);
	epj_tensor *g = d ? dense_as(ctx, c->in[1], dt) : NULL;
	epj_tensor *u = g ? dense_as(ctx, c->in[2], dt) : NULL;
	epj_status st = u ? EPJ_OK : epj_ctx_status(ctx);
	if (st == EPJ_OK)
		st = ej_tmpl_swiglu_backward(
		    ctx, ctx_device(ctx), ej_data(d), ej_data(g), ej_data(u),
		    dt, epj_tensor_numel(d), ej_data(c->out[0]),
		    ej_data(c->out[1]));
	epj_tensor_free(d);
	epj_tensor_free(g);
	epj_tensor_free(u);
	return st;
}
