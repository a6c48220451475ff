/* deltanet.c -- Qwen3.5-MoE's Gated DeltaNet layer (linear_attn), written
 * with epj_* ops as transformers' Qwen3_5MoeGatedDeltaNet computes it (no
 * cache: training; the family's zero-centred RMSNorm is ej_rmsnorm_offset,
 * runtime/qwen3.c):
 *
 *   qkv = in_proj_qkv(x)                      [B, T, 2 Kd + Vd]
 *   qkv = silu(causal depthwise conv1d(qkv))  K taps, no bias
 *   q, k = split(qkv) [B, T, Hk, dk], v [B, T, Hv, dv]
 *   beta = sigmoid(in_proj_b(x)), g = -exp(A_log) softplus(in_proj_a(x) +
 *          dt_bias)                           [B, T, Hv]
 *   q, k = l2norm(q), l2norm(k) (eps 1e-6); q /= sqrt(dk); q, k repeated
 *          to the Hv value heads (each key head serves Hv / Hk in a row)
 *   o = gated_delta(q, k, v, g, beta)         [B, T, Hv, dv] (lib/ops_delta.c,
 *                                             templates/delta.cuh)
 *   o = norm(o) * silu(in_proj_z(x))          gated RMSNorm over dv
 *   out_proj(o)                               [B, T, H]
 *
 * The conv is the sum over its K taps of the input shifted by K-1-j
 * positions (zeros before the first token) times the tap's weight, so it
 * is pointwise work the region compiler fuses.
 *
 * Packed documents (docs [B, T], each token's document, as data): a
 * document starts from nothing, as it would alone.  A conv tap reads a
 * token of the same document or zero (the shifted input times the mask
 * docs[t] == docs[t - s]), and the first token of a document decays the
 * state to zero: its g gets -1e30 added, exp(g) = 0, so S~ = 0, and the
 * backward's dS = exp(g) dS~ and dg = exp(g) <dS~, S> are 0 there too.
 * The masks are computed from the ids in the graph, so a compiled region
 * keeps one graph whatever the boundaries.  softplus(u) is computed
 * as -log(sigmoid(-u)), exact where transformers' softplus is (|u| < 80
 * or so; transformers switches to u itself above 20, the same value in
 * f32).
 */
#include "runtime_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* x W^T (+ b) of the Linear m.local */
static epj_tensor *lin(epj_ctx *ctx, epj_module *m, const char *local,
		       epj_tensor *x)
{
	return ej_linear_of(ctx, ej_module_child(m, local), x);
}

/* x * rsqrt(sum(x^2, -1) + 1e-6) */
static epj_tensor *l2norm(epj_ctx *ctx, epj_tensor *x)
{
	epj_tensor *t[4] = { 0 };
	t[0] = epj_mul(ctx, x, x);
	t[1] = epj_sum(ctx, t[0], -1, true);
	t[2] = epj_add_scalar(ctx, t[1], 1e-6);
	t[3] = epj_rsqrt(ctx, t[2]);
	epj_tensor *y = epj_mul(ctx, x, t[3]);
	ej_drop(t, 4);
	return y;
}

/* [B, T, Hk, d] -> [B, T, Hk * r, d], each head repeated r times in a row
 * (repeat_interleave over the heads) */
static epj_tensor *repeat_heads(epj_ctx *ctx, epj_tensor *x, int64_t r)
{
	if (!x || r == 1)
		return epj_tensor_ref(x);
	int64_t B = epj_tensor_dim(x, 0), T = epj_tensor_dim(x, 1);
	int64_t H = epj_tensor_dim(x, 2), d = epj_tensor_dim(x, 3);
	int64_t s5[5] = { B, T, H, 1, d }, e5[5] = { B, T, H, r, d };
	int64_t s4[4] = { B, T, H * r, d };
	epj_tensor *a = epj_reshape(ctx, x, 5, s5);
	epj_tensor *b = a ? epj_expand(ctx, a, 5, e5) : NULL;
	epj_tensor *y = b ? epj_reshape(ctx, b, 4, s4) : NULL;
	epj_tensor_free(a);
	epj_tensor_free(b);
	return y;
}

/* [B, T, 1] in dt: 1 where the token s >= 1 positions back is of the same
 * document as token t (docs [B, T]), else 0 (for t < s: whatever). */
static epj_tensor *same_doc(epj_ctx *ctx, epj_tensor *docs, int64_t s,
			    epj_dtype dt)
{
	enum { PAD, CAT, SH, EQ, F, N_T };
	epj_tensor *t[N_T] = { 0 };
	const int64_t B = epj_tensor_dim(docs, 0), T = epj_tensor_dim(docs, 1);
	const int64_t ps[2] = { B, s }, ms[3] = { B, T, 1 };
	bool prev = epj_no_grad_enter(ctx);
	/* where t < s the mask's value does not matter: the conv reads the
	 * zeros before the first token, and the state is zero at t = 0 */
	t[PAD] = epj_full(ctx, epj_tensor_dtype(docs), 2, ps, -1);
	epj_tensor *parts[2] = { t[PAD], docs };
	t[CAT] = t[PAD] ? epj_cat(ctx, parts, 2, 1) : NULL;
	t[SH] = epj_slice(ctx, t[CAT], 1, 0, T, 1);
	t[EQ] = epj_eq(ctx, docs, t[SH]);
	t[F] = epj_cast(ctx, t[EQ], dt);
	epj_tensor *m = epj_reshape(ctx, t[F], 3, ms);
	ej_drop(t, N_T);
	epj_no_grad_exit(ctx, prev);
	return m;
}

/* silu of the causal depthwise conv of x [B, T, C] with w [C, 1, K]; with
 * docs, each tap reads only its own document's tokens. */
static epj_tensor *causal_conv(epj_ctx *ctx, epj_tensor *x, epj_tensor *w,
			       epj_tensor *docs)
{
	if (!x || !w)
		return NULL;
	int64_t B = epj_tensor_dim(x, 0), T = epj_tensor_dim(x, 1);
	int64_t C = epj_tensor_dim(x, 2), K = epj_tensor_dim(w, 2);
	int64_t zs[3] = { B, K - 1, C }, w2s[2] = { C, K };
	epj_tensor *z = NULL, *xp = NULL, *w2 = NULL, *acc = NULL;
	if (K > 1) {
		/* zeros before the first token, outside the graph */
		bool prev = epj_no_grad_enter(ctx);
		z = epj_zeros(ctx, epj_tensor_dtype(x), 3, zs);
		epj_no_grad_exit(ctx, prev);
		epj_tensor *parts[2] = { z, x };
		xp = z ? epj_cat(ctx, parts, 2, 1) : NULL;
	} else {
		xp = epj_tensor_ref(x);
	}
	w2 = epj_reshape(ctx, w, 2, w2s);
	for (int64_t j = 0; xp && w2 && j < K; j++) {
		epj_tensor *xs = epj_slice(ctx, xp, 1, j, j + T, 1);
		if (xs && docs && j < K - 1) {
			epj_tensor *mk =
			    same_doc(ctx, docs, K - 1 - j, epj_tensor_dtype(x));
			epj_tensor *xm = mk ? epj_mul(ctx, xs, mk) : NULL;
			epj_tensor_free(mk);
			epj_tensor_free(xs);
			xs = xm;
		}
		epj_tensor *wc = epj_slice(ctx, w2, 1, j, j + 1, 1);
		epj_tensor *wv = wc ? epj_reshape(ctx, wc, 1, &C) : NULL;
		epj_tensor *p = xs && wv ? epj_mul(ctx, xs, wv) : NULL;
		epj_tensor *na = !acc ? epj_tensor_ref(p)
				 : p  ? epj_add(ctx, acc, p)
				      : NULL;
		epj_tensor_free(xs);
		epj_tensor_free(wc);
		epj_tensor_free(wv);
		epj_tensor_free(p);
		epj_tensor_free(acc);
		acc = na;
		if (!acc)
			break;
	}
	epj_tensor *y = acc ? epj_silu(ctx, acc) : NULL;
	epj_tensor_free(z);
	epj_tensor_free(xp);
	epj_tensor_free(w2);
	epj_tensor_free(acc);
	return y;
}

/* g [B, T, H] with -1e30 added at the first token of every document but
 * a row's first (docs [B, T]; NULL: g itself): exp(g) = 0 there, the
 * state starts from zero. */
static epj_tensor *reset_gate(epj_ctx *ctx, epj_tensor *g, epj_tensor *docs)
{
	if (!g || !docs)
		return epj_tensor_ref(g);
	enum { SAME, NEG, NEW, SC, N_T };
	epj_tensor *t[N_T] = { 0 };
	t[SAME] = same_doc(ctx, docs, 1, epj_tensor_dtype(g));
	/* 1 - same: 1 at a document's first token (and a row's) */
	bool prev = epj_no_grad_enter(ctx);
	t[NEG] = epj_neg(ctx, t[SAME]);
	t[NEW] = epj_add_scalar(ctx, t[NEG], 1);
	t[SC] = epj_mul_scalar(ctx, t[NEW], -1e30);
	epj_no_grad_exit(ctx, prev);
	epj_tensor *y = t[SC] ? epj_add(ctx, g, t[SC]) : NULL;
	ej_drop(t, N_T);
	return y;
}

epj_tensor *ej_deltanet_forward(epj_ctx *ctx, epj_module *la,
				const ej_model_config *c, epj_tensor *x,
				epj_tensor *docs)
{
	enum {
		QKV,
		CV,
		Q0,
		K0,
		V0,
		Q4,
		K4,
		V4,
		QN,
		KN,
		QS,
		QR,
		KR,
		Z,
		Z4,
		BL,
		BE,
		AL,
		ADT,
		NA,
		SG,
		SP,
		AE,
		G,
		GD,
		O,
		ON,
		SZ,
		OG,
		OR,
		N_T
	};
	epj_tensor *t[N_T] = { 0 };
	if (!x)
		return NULL;
	const int64_t B = epj_tensor_dim(x, 0), T = epj_tensor_dim(x, 1);
	const int64_t Hk = c->linear_num_key_heads;
	const int64_t Hv = c->linear_num_value_heads;
	const int64_t dk = c->linear_key_head_dim,
		      dv = c->linear_value_head_dim;
	const int64_t Kd = Hk * dk, Vd = Hv * dv;
	t[QKV] = lin(ctx, la, "in_proj_qkv", x);
	t[CV] = causal_conv(
	    ctx, t[QKV],
	    ej_module_param(ej_module_child(la, "conv1d"), "weight"), docs);
	t[Q0] = epj_slice(ctx, t[CV], -1, 0, Kd, 1);
	t[K0] = epj_slice(ctx, t[CV], -1, Kd, 2 * Kd, 1);
	t[V0] = epj_slice(ctx, t[CV], -1, 2 * Kd, 2 * Kd + Vd, 1);
	int64_t sk[4] = { B, T, Hk, dk }, sv[4] = { B, T, Hv, dv };
	t[Q4] = epj_reshape(ctx, t[Q0], 4, sk);
	t[K4] = epj_reshape(ctx, t[K0], 4, sk);
	t[V4] = epj_reshape(ctx, t[V0], 4, sv);
	t[QN] = l2norm(ctx, t[Q4]);
	t[KN] = l2norm(ctx, t[K4]);
	t[QS] = epj_mul_scalar(ctx, t[QN], 1.0 / sqrt((double)dk));
	t[QR] = repeat_heads(ctx, t[QS], Hv / Hk);
	t[KR] = repeat_heads(ctx, t[KN], Hv / Hk);
	/* beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) */
	t[BL] = lin(ctx, la, "in_proj_b", x);
	t[BE] = epj_sigmoid(ctx, t[BL]);
	t[AL] = lin(ctx, la, "in_proj_a", x);
	t[ADT] = epj_add(ctx, t[AL], ej_module_param(la, "dt_bias"));
	t[NA] = epj_neg(ctx, t[ADT]);
	t[SG] = epj_sigmoid(ctx, t[NA]);
	t[SP] = epj_log(ctx, t[SG]); /* -softplus */
	t[AE] = epj_exp(ctx, ej_module_param(la, "A_log"));
	t[G] = epj_mul(ctx, t[SP], t[AE]); /* -exp(A_log) softplus */
	t[GD] = reset_gate(ctx, t[G], docs);
	t[O] = epj_gated_delta(ctx, t[QR], t[KR], t[V4], t[GD], t[BE]);
	/* gated RMSNorm over dv (weight times the normalised value, then
	 * times silu(z)) */
	t[Z] = lin(ctx, la, "in_proj_z", x);
	t[Z4] = epj_reshape(ctx, t[Z], 4, sv);
	t[ON] = ej_rmsnorm(
	    ctx, t[O], ej_module_param(ej_module_child(la, "norm"), "weight"),
	    c->rms_norm_eps);
	t[SZ] = epj_silu(ctx, t[Z4]);
	t[OG] = epj_mul(ctx, t[ON], t[SZ]);
	int64_t so[3] = { B, T, Vd };
	t[OR] = epj_reshape(ctx, t[OG], 3, so);
	epj_tensor *y = lin(ctx, la, "out_proj", t[OR]);
	ej_drop(t, N_T);
	return y;
}

/* A parameter [n...] of m from host values (NULL: zeros). */
static epj_status add_param(epj_ctx *ctx, epj_module *m, const char *local,
			    int nd, const int64_t *shape, const double *v,
			    double std)
{
	epj_tensor *p = std > 0
			    ? epj_randn(ctx, EPJ_DTYPE_F32, nd, shape, 0.0, std)
			    : epj_zeros(ctx, EPJ_DTYPE_F32, nd, shape);
	/* values only on real tensors (a dry run builds symbolic ones) */
	if (p && v && !ctx->meta && epj_tensor_from_f64(ctx, p, v) != EPJ_OK) {
		epj_tensor_free(p);
		p = NULL;
	}
	if (!ej_module_add_param(m, local, p))
		return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
	return EPJ_OK;
}

epj_status ej_deltanet_build(epj_ctx *ctx, const ej_model_config *c,
			     epj_module *blk, const char *norm_kind)
{
	const double std = c->initializer_range;
	const int64_t H = c->hidden_size, Hv = c->linear_num_value_heads;
	const int64_t Kd =
	    (int64_t)c->linear_num_key_heads * c->linear_key_head_dim;
	const int64_t Vd = Hv * c->linear_value_head_dim, C = 2 * Kd + Vd;
	const int64_t K = c->linear_conv_kernel_dim;
	epj_module *la =
	    ej_module_new(blk, "linear_attn", "Qwen3_5MoeGatedDeltaNet", NULL);
	if (!la)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	epj_module *cv = ej_module_new(la, "conv1d", "Conv1d", NULL);
	if (!cv)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	int64_t cs[3] = { C, 1, K };
	/* dt_bias ones; A_log = log(A), A spread over [1, 16] (transformers
	 * draws A uniform in [0.01, 16)) */
	double *v = malloc(sizeof *v * (size_t)(2 * Hv));
	if (!v)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (int64_t h = 0; h < Hv; h++) {
		v[h] = 1.0;
		v[Hv + h] = log(1.0 + 15.0 * ((double)h + 0.5) / (double)Hv);
	}
	epj_status st = add_param(ctx, cv, "weight", 3, cs, NULL, std);
	if (st == EPJ_OK)
		st = add_param(ctx, la, "dt_bias", 1, &Hv, v, 0);
	if (st == EPJ_OK)
		st = add_param(ctx, la, "A_log", 1, &Hv, v + Hv, 0);
	free(v);
	epj_module *nm = st ? NULL : ej_module_new(la, "norm", norm_kind, NULL);
	if (st == EPJ_OK && !nm)
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	if (st == EPJ_OK) {
		int64_t dv = c->linear_value_head_dim;
		epj_tensor *w = epj_full(ctx, EPJ_DTYPE_F32, 1, &dv, 1.0);
		if (!ej_module_add_param(nm, "weight", w))
			st = ctx->status ? ctx->status : EPJ_ERR_NOMEM;
	}
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, la, "out_proj", H, Vd, std);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, la, "in_proj_qkv", C, H, std);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, la, "in_proj_z", Vd, H, std);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, la, "in_proj_b", Hv, H, std);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, la, "in_proj_a", Hv, H, std);
	return st;
}
