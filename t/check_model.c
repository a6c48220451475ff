/* check_model.c -- the Qwen3-MoE causal LM (runtime/qwen3.c) end to end, in
 * both layouts (nested: model.layers.N.mlp; root: one block owned by the
 * root module).
 *
 *  - An independent double-precision reference forward written here with
 *    plain loops over the parameter values (read with epj_tensor_to_f64):
 *    embedding, RMSNorm, per-head q/k RMSNorm, RoPE as HF computes it
 *    (inv_freq = 1/theta^(2i/D), cat(freqs, freqs), rotate_half), causal
 *    grouped-query attention, MoE routing (softmax -> top-k -> optional
 *    renormalisation -> SwiGLU experts) or a dense SwiGLU MLP, final norm,
 *    lm_head, mean cross-entropy skipping -100.  The f32 model must match it
 *    to rtol 1e-4.  Routing is piecewise constant: a token whose k-th and
 *    (k+1)-th router probabilities nearly tie (gap < 1e-4) may route
 *    differently in f32; the reference then adopts the model's choice, and
 *    every other token must route exactly as the reference does.
 *  - Gradients of the loss w.r.t. a sample of elements of every parameter
 *    against central differences (eps 1e-6) on an f64 copy of the model:
 *    with fixed routing (smooth everywhere) and with learned routing on
 *    inputs whose top-k boundary gaps are all > 1e-3 (checked with the
 *    reference), so no perturbation can flip a routing decision.
 *  - Activation checkpointing on vs off: identical loss and gradients (bit
 *    for bit in f32: the replay runs the same kernels on the same inputs)
 *    and the AutoEP call counters (forward = MoE layers, replay = MoE
 *    layers with checkpointing, 0 without).
 *  - A bf16 model vs the f32 model with the same (bf16-rounded) weights.
 */
#include "check_util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime_impl.h"

/* ---- test configs ---------------------------------------------------------
 */

#define MAX_L 4

typedef struct tcfg {
	int V, H, L, Hq, Hkv, D, I, MI, E, K;
	bool norm_topk;
	int sparse_step;
	int n_only;
	int only[MAX_L]; /* mlp_only_layers */
	double init, eps, theta;
} tcfg;

/* FD config: vocab 11, hidden 8, 2 heads / 1 KV head of dim 4, 2 layers,
 * 3 experts of dim 6, top-2 renormalised. */
static const tcfg CFG_FD = { .V = 11,
			     .H = 8,
			     .L = 2,
			     .Hq = 2,
			     .Hkv = 1,
			     .D = 4,
			     .I = 7,
			     .MI = 6,
			     .E = 3,
			     .K = 2,
			     .norm_topk = true,
			     .sparse_step = 1,
			     .init = 0.3,
			     .eps = 1e-6,
			     .theta = 100.0 };

/* Reference config: hidden 10 with 4 query heads and 2 KV heads of dim 6
 * (q_proj [24, 10] is not square; query heads 0, 1 read KV head 0 and 2, 3
 * read KV head 1), 3 layers of which layer 0 is dense (mlp_only_layers),
 * 5 experts top-2 without renormalisation. */
static const tcfg CFG_REF = { .V = 13,
			      .H = 10,
			      .L = 3,
			      .Hq = 4,
			      .Hkv = 2,
			      .D = 6,
			      .I = 9,
			      .MI = 5,
			      .E = 5,
			      .K = 2,
			      .norm_topk = false,
			      .sparse_step = 1,
			      .n_only = 1,
			      .only = { 0 },
			      .init = 0.2,
			      .eps = 1e-5,
			      .theta = 50.0 };

static bool layer_is_moe(const tcfg *c, int l)
{
	for (int i = 0; i < c->n_only; i++)
		if (c->only[i] == l)
			return false;
	return c->E > 0 && (l + 1) % c->sparse_step == 0;
}

/* Writes c as config.json into a temporary directory and builds the model;
 * the file and directory are removed before returning. */
static epj_model *build_model(epj_ctx *ctx, const tcfg *c, epj_layout layout,
			      uint64_t seed, bool fixed, epj_dtype dt)
{
	char only[64] = "[", json[2048];
	for (int i = 0; i < c->n_only; i++)
		snprintf(only + strlen(only), sizeof only - strlen(only),
			 "%s%d", i ? ", " : "", c->only[i]);
	strcat(only, "]");
	snprintf(json, sizeof json,
		 "{\"model_type\": \"qwen3_moe\", \"vocab_size\": %d, "
		 "\"hidden_size\": %d, \"num_hidden_layers\": %d, "
		 "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, "
		 "\"head_dim\": %d, \"intermediate_size\": %d, "
		 "\"moe_intermediate_size\": %d, \"num_experts\": %d, "
		 "\"num_experts_per_tok\": %d, \"norm_topk_prob\": %s, "
		 "\"decoder_sparse_step\": %d, \"mlp_only_layers\": %s, "
		 "\"initializer_range\": %.17g, \"rms_norm_eps\": %.17g, "
		 "\"rope_theta\": %.17g, \"max_position_embeddings\": 16}",
		 c->V, c->H, c->L, c->Hq, c->Hkv, c->D, c->I, c->MI, c->E, c->K,
		 c->norm_topk ? "true" : "false", c->sparse_step, only, c->init,
		 c->eps, c->theta);
	tu_tmpfile cfg = tu_tmpfile_new("model", "config.json", json);
	epj_model_opts o = { .layout = layout,
			     .seed = seed,
			     .fixed_routing = fixed,
			     .dtype = dt };
	epj_model *m = NULL;
	epj_status st = epj_model_new(ctx, cfg.path, &o, &m);
	tu_tmpfile_free(&cfg);
	ck_assert_msg(st == EPJ_OK, "epj_model_new: %s", epj_ctx_error(ctx));
	return m;
}

/* Number of decoder layers the model holds (the root layout has one). */
static int n_layers(const tcfg *c, epj_layout layout)
{
	return layout == EPJ_LAYOUT_ROOT ? 1 : c->L;
}

static int n_moe_layers(const tcfg *c, epj_layout layout)
{
	int n = 0;
	for (int l = 0; l < n_layers(c, layout); l++)
		n += layer_is_moe(c, l);
	return n;
}

static int param_index(const epj_model *m, const char *name)
{
	for (int i = 0; i < epj_model_num_params(m); i++)
		if (!strcmp(epj_model_param_name(m, i), name))
			return i;
	return -1;
}

/* Norm weights become 1 + U(-0.3, 0.3) so that the reference's use of them
 * is tested (they are all ones after init). */
static void randomize_norms(epj_ctx *ctx, epj_model *m)
{
	bool prev = epj_no_grad_enter(ctx);
	for (int i = 0; i < epj_model_num_params(m); i++) {
		if (!strstr(epj_model_param_name(m, i), "norm.weight"))
			continue;
		epj_tensor *p = epj_model_param(m, i);
		for (int64_t k = 0; k < epj_tensor_numel(p); k++)
			epj_tensor_set_f64(p, k, 1.0 + tu_uniform(-0.3, 0.3));
	}
	epj_no_grad_exit(ctx, prev);
}

/* Every parameter replaced by a copy in dtype dt. */
static void cast_params(epj_ctx *ctx, epj_model *m, epj_dtype dt)
{
	bool prev = epj_no_grad_enter(ctx);
	for (int i = 0; i < epj_model_num_params(m); i++) {
		epj_tensor *c = epj_cast(ctx, epj_model_param(m, i), dt);
		tu_ok(ctx, c);
		ck_assert_msg(epj_model_set_param(ctx, m, i, c) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		epj_tensor_free(c);
		ck_assert_int_eq(epj_tensor_dtype(epj_model_param(m, i)), dt);
		ck_assert(epj_tensor_requires_grad(epj_model_param(m, i)));
	}
	epj_no_grad_exit(ctx, prev);
}

/* ---- the double reference -------------------------------------------------
 */

typedef struct ref_layer {
	bool moe;
	double *in_norm, *post_norm, *wq, *wk, *wv, *wo, *qn, *kn;
	double *gate, *eg, *eu, *ed; /* router [E, H]; experts [E][MI * H] */
	double *mg, *mu, *md;	     /* dense MLP */
} ref_layer;

typedef struct ref_model {
	tcfg c;
	int L; /* layers held */
	bool fixed;
	double *embed, *norm, *lm_head;
	ref_layer ly[MAX_L];
} ref_model;

static double *pvals(epj_ctx *ctx, const epj_model *m, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static double *pvals(epj_ctx *ctx, const epj_model *m, const char *fmt, ...)
{
	char name[128];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(name, sizeof name, fmt, ap);
	va_end(ap);
	int i = param_index(m, name);
	ck_assert_msg(i >= 0, "parameter %s missing", name);
	return tu_values(ctx, epj_model_param(m, i));
}

static void ref_load(epj_ctx *ctx, const epj_model *m, const tcfg *c,
		     epj_layout layout, bool fixed, ref_model *r)
{
	memset(r, 0, sizeof *r);
	r->c = *c;
	r->L = n_layers(c, layout);
	r->fixed = fixed;
	bool nested = layout == EPJ_LAYOUT_NESTED;
	const char *top = nested ? "model." : "";
	r->embed = pvals(ctx, m, "%sembed_tokens.weight", top);
	r->norm = pvals(ctx, m, "%snorm.weight", top);
	r->lm_head = pvals(ctx, m, "lm_head.weight");
	size_t eh = (size_t)c->MI * (size_t)c->H;
	for (int l = 0; l < r->L; l++) {
		ref_layer *y = &r->ly[l];
		char p[32] = "";
		if (nested)
			snprintf(p, sizeof p, "model.layers.%d.", l);
		y->moe = layer_is_moe(c, l);
		y->in_norm = pvals(ctx, m, "%sinput_layernorm.weight", p);
		y->post_norm =
		    pvals(ctx, m, "%spost_attention_layernorm.weight", p);
		y->wq = pvals(ctx, m, "%sself_attn.q_proj.weight", p);
		y->wk = pvals(ctx, m, "%sself_attn.k_proj.weight", p);
		y->wv = pvals(ctx, m, "%sself_attn.v_proj.weight", p);
		y->wo = pvals(ctx, m, "%sself_attn.o_proj.weight", p);
		y->qn = pvals(ctx, m, "%sself_attn.q_norm.weight", p);
		y->kn = pvals(ctx, m, "%sself_attn.k_norm.weight", p);
		if (!y->moe) {
			y->mg = pvals(ctx, m, "%smlp.gate_proj.weight", p);
			y->mu = pvals(ctx, m, "%smlp.up_proj.weight", p);
			y->md = pvals(ctx, m, "%smlp.down_proj.weight", p);
			continue;
		}
		y->gate = pvals(ctx, m, "%smlp.gate.weight", p);
		y->eg = malloc(sizeof(double) * eh * (size_t)c->E);
		y->eu = malloc(sizeof(double) * eh * (size_t)c->E);
		y->ed = malloc(sizeof(double) * eh * (size_t)c->E);
		ck_assert(y->eg && y->eu && y->ed);
		static const char *const proj[3] = { "gate_proj", "up_proj",
						     "down_proj" };
		double *dst[3] = { y->eg, y->eu, y->ed };
		for (int e = 0; e < c->E; e++) {
			for (int j = 0; j < 3; j++) {
				double *v =
				    pvals(ctx, m, "%smlp.experts.%d.%s.weight",
					  p, e, proj[j]);
				memcpy(dst[j] + eh * (size_t)e, v,
				       sizeof(double) * eh);
				free(v);
			}
		}
	}
}

static void ref_free(ref_model *r)
{
	free(r->embed);
	free(r->norm);
	free(r->lm_head);
	for (int l = 0; l < r->L; l++) {
		ref_layer *y = &r->ly[l];
		double *all[] = { y->in_norm, y->post_norm, y->wq, y->wk,
				  y->wv,      y->wo,	    y->qn, y->kn,
				  y->gate,    y->eg,	    y->eu, y->ed,
				  y->mg,      y->mu,	    y->md };
		for (size_t i = 0; i < EJ_ARRAY_LEN(all); i++)
			free(all[i]);
	}
}

/* y[o] = sum_i w[o, i] x[i] */
static void matvec(const double *w, const double *x, int out, int in, double *y)
{
	for (int o = 0; o < out; o++) {
		double s = 0;
		for (int i = 0; i < in; i++)
			s += w[(size_t)o * (size_t)in + (size_t)i] * x[i];
		y[o] = s;
	}
}

/* y = x / sqrt(mean(x^2) + eps) * w over n values (in place ok) */
static void rmsnorm(const double *x, const double *w, int n, double eps,
		    double *y)
{
	double ss = 0;
	for (int i = 0; i < n; i++)
		ss += x[i] * x[i];
	double r = 1.0 / sqrt(ss / n + eps);
	for (int i = 0; i < n; i++)
		y[i] = x[i] * r * w[i];
}

static double silu(double v)
{
	return v / (1.0 + exp(-v));
}

/* HF rotary embedding of one head vector x[D] at position pos, in place:
 * inv_freq[i] = 1 / theta^(2i/D), emb = cat(freqs, freqs),
 * x * cos(emb) + rotate_half(x) * sin(emb), rotate_half(x) =
 * cat(-x[D/2:], x[:D/2]). */
static void rope(double *x, int D, int pos, double theta)
{
	double tmp[64];
	ck_assert_int_le(D, 64);
	for (int j = 0; j < D; j++) {
		int i = j % (D / 2);
		double ang = pos * (1.0 / pow(theta, (2.0 * i) / D));
		double rot = j < D / 2 ? -x[j + D / 2] : x[j - D / 2];
		tmp[j] = x[j] * cos(ang) + rot * sin(ang);
	}
	memcpy(x, tmp, sizeof(double) * (size_t)D);
}

/* Routing statistics of one reference run. */
typedef struct ref_routing {
	double min_gap;	      /* smallest gap p_(k) - p_(k+1) seen */
	int mismatches;	      /* tokens routed unlike the reference, gap ok */
	int adopted;	      /* near-tie tokens where the model's choice won */
	const int64_t *model; /* per MoE layer [N*K] model routing, or NULL */
} ref_routing;

/* MoE layer on one token x[H] -> y[H].  n = flat token index. */
static void ref_moe(const ref_model *r, const ref_layer *y, const double *x,
		    int64_t n, const int64_t *model_sel, double tie,
		    ref_routing *rs, double *out)
{
	const tcfg *c = &r->c;
	int E = c->E, K = c->K, H = c->H, MI = c->MI;
	double logit[32], prob[32], mx = -INFINITY, z = 0;
	ck_assert_int_le(E, 32);
	matvec(y->gate, x, E, H, logit);
	for (int e = 0; e < E; e++)
		mx = fmax(mx, logit[e]);
	for (int e = 0; e < E; e++)
		z += (prob[e] = exp(logit[e] - mx));
	for (int e = 0; e < E; e++)
		prob[e] /= z;
	int sel[32];
	bool used[32] = { false };
	if (r->fixed) {
		for (int j = 0; j < K; j++)
			sel[j] = (int)((n * K + j) % E);
	} else {
		/* top-k, largest first, lower index first on ties */
		for (int j = 0; j < K; j++) {
			int best = -1;
			for (int e = 0; e < E; e++)
				if (!used[e] &&
				    (best < 0 || prob[e] > prob[best]))
					best = e;
			sel[j] = best;
			used[best] = true;
		}
		double next = -1;
		for (int e = 0; e < E; e++)
			if (!used[e])
				next = fmax(next, prob[e]);
		double gap = K < E ? prob[sel[K - 1]] - next : INFINITY;
		rs->min_gap = fmin(rs->min_gap, gap);
		if (model_sel) {
			bool same = true;
			for (int j = 0; j < K; j++) {
				bool found = false;
				for (int i = 0; i < K; i++)
					found |= model_sel[i] == sel[j];
				same &= found;
			}
			if (!same) {
				if (gap < tie)
					rs->adopted++;
				else
					rs->mismatches++;
				for (int j = 0; j < K; j++)
					sel[j] = (int)model_sel[j];
			}
		}
	}
	double w[32], ws = 0;
	for (int j = 0; j < K; j++)
		ws += (w[j] = prob[sel[j]]);
	if (c->norm_topk)
		for (int j = 0; j < K; j++)
			w[j] /= ws;
	double *g = malloc(sizeof(double) * (size_t)MI * 3);
	double *u = g + MI, *a = u + MI;
	double eo[64];
	ck_assert(g && H <= 64);
	for (int i = 0; i < H; i++)
		out[i] = 0;
	size_t eh = (size_t)MI * (size_t)H;
	for (int j = 0; j < K; j++) {
		int e = sel[j];
		matvec(y->eg + eh * (size_t)e, x, MI, H, g);
		matvec(y->eu + eh * (size_t)e, x, MI, H, u);
		for (int i = 0; i < MI; i++)
			a[i] = silu(g[i]) * u[i];
		matvec(y->ed + eh * (size_t)e, a, H, MI, eo);
		for (int i = 0; i < H; i++)
			out[i] += w[j] * eo[i];
	}
	free(g);
}

/* Reference forward: ids/labels [B*T] -> logits [B*T*V] and the mean
 * cross-entropy over labels != -100 (returned; NaN when all ignored).
 * model_routing[i] (may be NULL) is the model's [N*K] routing of the i-th
 * MoE layer, adopted for near ties (prob gap < tie). */
static double ref_forward(const ref_model *r, const int64_t *ids,
			  const int64_t *labels, int B, int T, double *logits,
			  int64_t *const *model_routing, double tie,
			  ref_routing *rs)
{
	const tcfg *c = &r->c;
	const int H = c->H, D = c->D, Hq = c->Hq, Hkv = c->Hkv, V = c->V;
	const int N = B * T, QD = Hq * D, KD = Hkv * D;
	double *h = malloc(sizeof(double) * (size_t)N * (size_t)H);
	double *x = malloc(sizeof(double) * (size_t)N * (size_t)H);
	double *q = malloc(sizeof(double) * (size_t)N * (size_t)QD);
	double *k = malloc(sizeof(double) * (size_t)N * (size_t)KD);
	double *v = malloc(sizeof(double) * (size_t)N * (size_t)KD);
	double *att = malloc(sizeof(double) * (size_t)N * (size_t)QD);
	double *tmp = malloc(sizeof(double) * (size_t)(H + c->I) * 4);
	ck_assert(h && x && q && k && v && att && tmp);
	rs->min_gap = INFINITY;
	rs->mismatches = rs->adopted = 0;
	for (int n = 0; n < N; n++) {
		ck_assert(ids[n] >= 0 && ids[n] < V);
		memcpy(h + (size_t)n * H, r->embed + (size_t)ids[n] * H,
		       sizeof(double) * (size_t)H);
	}
	int moe_i = 0;
	for (int l = 0; l < r->L; l++) {
		const ref_layer *y = &r->ly[l];
		for (int n = 0; n < N; n++) {
			double *xn = x + (size_t)n * H;
			rmsnorm(h + (size_t)n * H, y->in_norm, H, c->eps, xn);
			matvec(y->wq, xn, QD, H, q + (size_t)n * QD);
			matvec(y->wk, xn, KD, H, k + (size_t)n * KD);
			matvec(y->wv, xn, KD, H, v + (size_t)n * KD);
			int pos = n % T;
			for (int hd = 0; hd < Hq; hd++) {
				double *qh = q + (size_t)n * QD + hd * D;
				rmsnorm(qh, y->qn, D, c->eps, qh);
				rope(qh, D, pos, c->theta);
			}
			for (int hd = 0; hd < Hkv; hd++) {
				double *kh = k + (size_t)n * KD + hd * D;
				rmsnorm(kh, y->kn, D, c->eps, kh);
				rope(kh, D, pos, c->theta);
			}
		}
		/* causal GQA attention: query head hd reads KV head
		 * hd / (Hq / Hkv) */
		for (int b = 0; b < B; b++) {
			for (int hd = 0; hd < Hq; hd++) {
				int kv = hd / (Hq / Hkv);
				for (int t = 0; t < T; t++) {
					const double *qv =
					    q + (size_t)(b * T + t) * QD +
					    hd * D;
					double s[64], mx = -INFINITY, z = 0;
					ck_assert_int_le(T, 64);
					for (int u = 0; u <= t; u++) {
						const double *kv_ =
						    k +
						    (size_t)(b * T + u) * KD +
						    kv * D;
						double d = 0;
						for (int i = 0; i < D; i++)
							d += qv[i] * kv_[i];
						s[u] = d / sqrt((double)D);
						mx = fmax(mx, s[u]);
					}
					for (int u = 0; u <= t; u++)
						z += (s[u] = exp(s[u] - mx));
					double *o = att +
						    (size_t)(b * T + t) * QD +
						    hd * D;
					for (int i = 0; i < D; i++) {
						double acc = 0;
						for (int u = 0; u <= t; u++)
							acc +=
							    s[u] / z *
							    v[(size_t)(b * T +
								       u) *
								  KD +
							      kv * D + i];
						o[i] = acc;
					}
				}
			}
		}
		for (int n = 0; n < N; n++) {
			double *hn = h + (size_t)n * H, *ao = tmp;
			matvec(y->wo, att + (size_t)n * QD, H, QD, ao);
			for (int i = 0; i < H; i++)
				hn[i] += ao[i];
		}
		const int64_t *msel =
		    model_routing && y->moe ? model_routing[moe_i] : NULL;
		for (int n = 0; n < N; n++) {
			double *hn = h + (size_t)n * H, *xn = x + (size_t)n * H;
			double *mo = tmp;
			rmsnorm(hn, y->post_norm, H, c->eps, xn);
			if (y->moe) {
				ref_moe(r, y, xn, n,
					msel ? msel + (size_t)n * c->K : NULL,
					tie, rs, mo);
			} else {
				double *g = tmp + H, *u = g + c->I;
				matvec(y->mg, xn, c->I, H, g);
				matvec(y->mu, xn, c->I, H, u);
				for (int i = 0; i < c->I; i++)
					g[i] = silu(g[i]) * u[i];
				matvec(y->md, g, H, c->I, mo);
			}
			for (int i = 0; i < H; i++)
				hn[i] += mo[i];
		}
		moe_i += y->moe;
	}
	double loss = 0;
	int counted = 0;
	for (int n = 0; n < N; n++) {
		double *xn = x + (size_t)n * H, *lg = logits + (size_t)n * V;
		rmsnorm(h + (size_t)n * H, r->norm, H, c->eps, xn);
		matvec(r->lm_head, xn, V, H, lg);
		if (!labels || labels[n] == -100)
			continue;
		double mx = -INFINITY, z = 0;
		for (int i = 0; i < V; i++)
			mx = fmax(mx, lg[i]);
		for (int i = 0; i < V; i++)
			z += exp(lg[i] - mx);
		loss += mx + log(z) - lg[labels[n]];
		counted++;
	}
	free(h);
	free(x);
	free(q);
	free(k);
	free(v);
	free(att);
	free(tmp);
	return counted ? loss / counted : NAN;
}

/* ---- model helpers ----------------------------------------------------------
 */

static epj_module *moe_module(epj_model *m, epj_layout layout, const tcfg *c,
			      int i)
{
	int seen = 0;
	for (int l = 0; l < n_layers(c, layout); l++) {
		if (!layer_is_moe(c, l))
			continue;
		if (seen++ != i)
			continue;
		char nm[48] = "mlp";
		if (layout == EPJ_LAYOUT_NESTED)
			snprintf(nm, sizeof nm, "model.layers.%d.mlp", l);
		epj_module *mod = epj_module_find(epj_model_root(m), nm);
		ck_assert_ptr_nonnull(mod);
		return mod;
	}
	ck_abort_msg("no MoE layer %d", i);
	return NULL;
}

/* The model's last routing of every MoE layer, as host arrays. */
static int64_t **model_routing(epj_ctx *ctx, epj_model *m, epj_layout layout,
			       const tcfg *c, int N)
{
	int nm = n_moe_layers(c, layout);
	int64_t **rt = calloc((size_t)nm + 1, sizeof *rt);
	ck_assert_ptr_nonnull(rt);
	for (int i = 0; i < nm; i++) {
		epj_tensor *t = epj_module_routing(moe_module(m, layout, c, i));
		ck_assert_ptr_nonnull(t);
		ck_assert_int_eq(epj_tensor_numel(t), (int64_t)N * c->K);
		double *v = tu_values(ctx, t);
		rt[i] = malloc(sizeof(int64_t) * (size_t)N * (size_t)c->K);
		ck_assert_ptr_nonnull(rt[i]);
		for (int64_t j = 0; j < (int64_t)N * c->K; j++)
			rt[i][j] = (int64_t)v[j];
		free(v);
	}
	return rt;
}

static void routing_free(int64_t **rt)
{
	for (int i = 0; rt && rt[i]; i++)
		free(rt[i]);
	free(rt);
}

/* Random ids [B, T] and labels (a few -100 when with_ignored), as tensors and
 * host arrays. */
typedef struct batch {
	int B, T;
	int64_t ids[256], labels[256];
	epj_tensor *t_ids, *t_labels;
} batch;

static void make_batch(epj_ctx *ctx, batch *b, int B, int T, int V,
		       bool with_ignored)
{
	ck_assert_int_le(B * T, 256);
	b->B = B;
	b->T = T;
	for (int i = 0; i < B * T; i++) {
		b->ids[i] = tu_randint(0, V);
		b->labels[i] = tu_randint(0, V);
	}
	if (with_ignored) {
		b->labels[0] = -100;
		b->labels[B * T - 2] = -100;
	}
	int64_t sh[2] = { B, T };
	b->t_ids = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, sh, b->ids);
	b->t_labels =
	    epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, sh, b->labels);
	tu_ok(ctx, b->t_ids);
	tu_ok(ctx, b->t_labels);
}

static void batch_free(batch *b)
{
	epj_tensor_free(b->t_ids);
	epj_tensor_free(b->t_labels);
	b->t_ids = b->t_labels = NULL;
}

static void clear_grads(epj_model *m)
{
	for (int i = 0; i < epj_model_num_params(m); i++)
		epj_tensor_set_grad(epj_model_param(m, i), NULL);
}

/* Loss of one forward under no-grad. */
static double loss_nograd(epj_ctx *ctx, epj_model *m, const batch *b)
{
	epj_tensor *loss = NULL;
	bool prev = epj_no_grad_enter(ctx);
	epj_status st =
	    epj_model_forward(ctx, m, b->t_ids, b->t_labels, NULL, &loss);
	epj_no_grad_exit(ctx, prev);
	ck_assert_msg(st == EPJ_OK, "forward: %s", epj_ctx_error(ctx));
	double v = epj_tensor_get_f64(loss, 0);
	epj_tensor_free(loss);
	return v;
}

/* ---- reference forward vs the f32 model
 * ---------------------------------------
 */

static void check_against_reference(epj_layout layout, bool fixed)
{
	epj_ctx *ctx = tu_ctx();
	const tcfg *c = &CFG_REF;
	epj_model *m =
	    build_model(ctx, c, layout, (uint64_t)tu_randint(1, 1 << 30), fixed,
			EPJ_DTYPE_F32);
	randomize_norms(ctx, m);
	int B = 3, T = 7, N = B * T;
	batch b;
	make_batch(ctx, &b, B, T, c->V, true);
	epj_tensor *logits = NULL, *loss = NULL;
	ck_assert_msg(epj_model_forward(ctx, m, b.t_ids, b.t_labels, &logits,
					&loss) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert_int_eq(epj_tensor_dtype(logits), EPJ_DTYPE_F32);
	ck_assert_int_eq(epj_tensor_ndim(logits), 3);
	ck_assert_int_eq(epj_tensor_dim(logits, 0), B);
	ck_assert_int_eq(epj_tensor_dim(logits, 1), T);
	ck_assert_int_eq(epj_tensor_dim(logits, 2), c->V);
	ck_assert_int_eq(epj_tensor_ndim(loss), 0);
	ck_assert_int_eq(epj_tensor_dtype(loss), EPJ_DTYPE_F32);

	ref_model r;
	ref_load(ctx, m, c, layout, fixed, &r);
	int64_t **rt = model_routing(ctx, m, layout, c, N);
	double *ref = malloc(sizeof(double) * (size_t)N * (size_t)c->V);
	ck_assert_ptr_nonnull(ref);
	ref_routing rs = { 0 };
	double ref_loss =
	    ref_forward(&r, b.ids, b.labels, B, T, ref, rt, 1e-4, &rs);
	ck_assert_msg(rs.mismatches == 0,
		      "%d tokens routed unlike the reference (gap >= 1e-4)",
		      rs.mismatches);
	double mx = 0;
	for (int i = 0; i < N * c->V; i++)
		mx = fmax(mx, fabs(ref[i]));
	ck_assert_msg(mx > 0.1, "degenerate logits (max |logit| %g)", mx);
	tu_assert_close(ctx, logits, ref, 1e-4, 1e-5 * mx, "logits vs ref");
	double lv = epj_tensor_get_f64(loss, 0);
	ck_assert_msg(fabs(lv - ref_loss) <= 1e-5 * fabs(ref_loss),
		      "loss %.9g, reference %.9g", lv, ref_loss);
	/* fixed routing assigns (n*k + j) % E */
	if (fixed)
		for (int j = 0; j < N * c->K; j++)
			ck_assert_int_eq(rt[0][j], j % c->E);

	/* without labels: logits only, same values */
	epj_tensor *logits2 = NULL, *loss2 = logits; /* must be reset */
	ck_assert_int_eq(
	    epj_model_forward(ctx, m, b.t_ids, NULL, &logits2, &loss2), EPJ_OK);
	ck_assert_ptr_null(loss2);
	tu_assert_tensors_close(ctx, logits2, logits, 0, 0, "logits again");
	epj_tensor_free(logits2);

	free(ref);
	routing_free(rt);
	ref_free(&r);
	epj_tensor_free(logits);
	epj_tensor_free(loss);
	batch_free(&b);
	epj_model_free(m);
	epj_ctx_free(ctx);
}

START_TEST(test_reference_nested)
{
	check_against_reference(EPJ_LAYOUT_NESTED, false);
}
END_TEST

START_TEST(test_reference_nested_fixed)
{
	check_against_reference(EPJ_LAYOUT_NESTED, true);
}
END_TEST

/* The root layout holds one block; CFG_REF's layer 0 is dense, so the root
 * layout is tested with the all-MoE config (its block is an AutoEP). */
static void check_root_reference(bool fixed)
{
	epj_ctx *ctx = tu_ctx();
	tcfg c = CFG_REF;
	c.n_only = 0;
	epj_model *m =
	    build_model(ctx, &c, EPJ_LAYOUT_ROOT,
			(uint64_t)tu_randint(1, 1 << 30), fixed, EPJ_DTYPE_F32);
	randomize_norms(ctx, m);
	int B = 2, T = 9, N = B * T;
	batch b;
	make_batch(ctx, &b, B, T, c.V, true);
	epj_tensor *logits = NULL, *loss = NULL;
	ck_assert_msg(epj_model_forward(ctx, m, b.t_ids, b.t_labels, &logits,
					&loss) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ref_model r;
	ref_load(ctx, m, &c, EPJ_LAYOUT_ROOT, fixed, &r);
	ck_assert_int_eq(r.L, 1);
	int64_t **rt = model_routing(ctx, m, EPJ_LAYOUT_ROOT, &c, N);
	double *ref = malloc(sizeof(double) * (size_t)N * (size_t)c.V);
	ck_assert_ptr_nonnull(ref);
	ref_routing rs = { 0 };
	double ref_loss =
	    ref_forward(&r, b.ids, b.labels, B, T, ref, rt, 1e-4, &rs);
	ck_assert_int_eq(rs.mismatches, 0);
	double mx = 0;
	for (int i = 0; i < N * c.V; i++)
		mx = fmax(mx, fabs(ref[i]));
	tu_assert_close(ctx, logits, ref, 1e-4, 1e-5 * mx, "root logits");
	double lv = epj_tensor_get_f64(loss, 0);
	ck_assert_msg(fabs(lv - ref_loss) <= 1e-5 * fabs(ref_loss),
		      "loss %.9g, reference %.9g", lv, ref_loss);
	free(ref);
	routing_free(rt);
	ref_free(&r);
	epj_tensor_free(logits);
	epj_tensor_free(loss);
	batch_free(&b);
	epj_model_free(m);
	epj_ctx_free(ctx);
}

START_TEST(test_reference_root)
{
	check_root_reference(false);
	check_root_reference(true);
}
END_TEST

/* Bad inputs: errors naming the model, nothing returned. */
START_TEST(test_forward_errors)
{
	epj_ctx *ctx = tu_ctx();
	const tcfg *c = &CFG_FD;
	epj_model *m =
	    build_model(ctx, c, EPJ_LAYOUT_NESTED, 3, false, EPJ_DTYPE_F32);
	epj_tensor *lg = NULL, *ls = NULL;
	/* 1-D ids */
	int64_t n5 = 5;
	epj_tensor *ids1 = epj_randint(ctx, EPJ_DTYPE_I64, 1, &n5, 0, c->V);
	ck_assert_int_eq(epj_model_forward(ctx, m, ids1, NULL, &lg, &ls),
			 EPJ_ERR_SHAPE);
	ck_assert_ptr_null(lg);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "input_ids"), "%s",
		      epj_ctx_error(ctx));
	/* labels of another shape */
	int64_t s25[2] = { 2, 5 }, s24[2] = { 2, 4 }, s2_20[2] = { 2, 20 };
	epj_tensor *ids = epj_randint(ctx, EPJ_DTYPE_I64, 2, s25, 0, c->V);
	epj_tensor *lab = epj_randint(ctx, EPJ_DTYPE_I64, 2, s24, 0, c->V);
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_model_forward(ctx, m, ids, lab, &lg, &ls),
			 EPJ_ERR_SHAPE);
	ck_assert_ptr_null(lg);
	ck_assert_ptr_null(ls);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "labels"), "%s",
		      epj_ctx_error(ctx));
	/* longer than max_position_embeddings (16) */
	epj_tensor *idl = epj_randint(ctx, EPJ_DTYPE_I64, 2, s2_20, 0, c->V);
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_model_forward(ctx, m, idl, NULL, &lg, NULL),
			 EPJ_ERR_SHAPE);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "max_position_embeddings"),
		      "%s", epj_ctx_error(ctx));
	/* token id out of range: the embedding op says so */
	epj_tensor *bad = epj_full(ctx, EPJ_DTYPE_I64, 2, s25, c->V);
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_model_forward(ctx, m, bad, NULL, &lg, NULL),
			 EPJ_ERR_INDEX);
	ck_assert_ptr_null(lg);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "embedding"), "%s",
		      epj_ctx_error(ctx));
	/* NULL ids */
	epj_ctx_clear_error(ctx);
	ck_assert_int_ne(epj_model_forward(ctx, m, NULL, NULL, &lg, NULL),
			 EPJ_OK);
	/* all labels ignored: NaN loss, as PyTorch */
	epj_tensor *ign = epj_full(ctx, EPJ_DTYPE_I64, 2, s25, -100);
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_model_forward(ctx, m, ids, ign, NULL, &ls),
			 EPJ_OK);
	ck_assert(isnan(epj_tensor_get_f64(ls, 0)));
	epj_tensor_free(ls);
	/* i32 ids are accepted and give the i64 result */
	epj_tensor *ids32 = epj_cast(ctx, ids, EPJ_DTYPE_I32);
	epj_tensor *a = NULL, *b2 = NULL;
	ck_assert_int_eq(epj_model_forward(ctx, m, ids, NULL, &a, NULL),
			 EPJ_OK);
	ck_assert_int_eq(epj_model_forward(ctx, m, ids32, NULL, &b2, NULL),
			 EPJ_OK);
	tu_assert_tensors_close(ctx, b2, a, 0, 0, "i32 ids");
	epj_tensor_free(a);
	epj_tensor_free(b2);
	epj_tensor_free(ids32);
	epj_tensor_free(ign);
	epj_tensor_free(bad);
	epj_tensor_free(idl);
	epj_tensor_free(ids1);
	epj_tensor_free(ids);
	epj_tensor_free(lab);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- finite differences in f64
 * -----------------------------------------------
 */

#define FD_EPS	   1e-6
#define FD_SAMPLES 4

/* Checks dloss/dparam at FD_SAMPLES random elements of every parameter. */
static void fd_check(epj_ctx *ctx, epj_model *m, const batch *b,
		     const char *what)
{
	clear_grads(m);
	epj_tensor *loss = NULL, *logits = NULL;
	ck_assert_msg(epj_model_forward(ctx, m, b->t_ids, b->t_labels, &logits,
					&loss) == EPJ_OK,
		      "%s: forward: %s", what, epj_ctx_error(ctx));
	/* every op ran in f64 */
	ck_assert_int_eq(epj_tensor_dtype(logits), EPJ_DTYPE_F64);
	ck_assert_int_eq(epj_tensor_dtype(loss), EPJ_DTYPE_F64);
	epj_tensor_free(logits);
	ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s: %s", what,
		      epj_ctx_error(ctx));
	epj_tensor_free(loss);
	int checked = 0;
	for (int i = 0; i < epj_model_num_params(m); i++) {
		epj_tensor *p = epj_model_param(m, i);
		const char *nm = epj_model_param_name(m, i);
		epj_tensor *g = epj_tensor_grad(p);
		int64_t n = epj_tensor_numel(p);
		double *ga = NULL;
		if (g) {
			ck_assert_int_eq(epj_tensor_dtype(g), EPJ_DTYPE_F64);
			ga = tu_values(ctx, g);
		} else {
			/* No gradient: the parameter took no part (an expert
			 * no token was routed to, as PyTorch leaves .grad
			 * None); finite differences must then give 0. */
			ck_assert_msg(strstr(nm, ".experts."),
				      "%s: %s got no gradient", what, nm);
			ga = calloc((size_t)n, sizeof *ga);
			ck_assert_ptr_nonnull(ga);
		}
		for (int s = 0; s < FD_SAMPLES && s < n; s++) {
			int64_t k = tu_randint(0, n);
			if (!strcmp(nm, "model.embed_tokens.weight") ||
			    !strcmp(nm, "embed_tokens.weight"))
				/* a row of a token in the batch (others
				 * have zero gradient) */
				k = b->ids[tu_randint(0, b->B * b->T)] *
					epj_tensor_dim(p, 1) +
				    tu_randint(0, epj_tensor_dim(p, 1));
			bool prev = epj_no_grad_enter(ctx);
			double x0 = epj_tensor_get_f64(p, k);
			epj_tensor_set_f64(p, k, x0 + FD_EPS);
			double lp = loss_nograd(ctx, m, b);
			epj_tensor_set_f64(p, k, x0 - FD_EPS);
			double lm = loss_nograd(ctx, m, b);
			epj_tensor_set_f64(p, k, x0);
			epj_no_grad_exit(ctx, prev);
			double num = (lp - lm) / (2 * FD_EPS);
			ck_assert_msg(fabs(ga[k] - num) <=
					  1e-7 + 1e-5 * fabs(num),
				      "%s: d loss / d %s[%lld]: analytic "
				      "%.12g, numeric %.12g (seed %llu)",
				      what, nm, (long long)k, ga[k], num,
				      (unsigned long long)tu_seed());
			checked++;
		}
		free(ga);
	}
	ck_assert_int_ge(checked, epj_model_num_params(m));
}

static void fd_test(epj_layout layout, bool fixed)
{
	epj_ctx *ctx = tu_ctx();
	const tcfg *c = &CFG_FD;
	epj_model *m =
	    build_model(ctx, c, layout, (uint64_t)tu_randint(1, 1 << 30), fixed,
			EPJ_DTYPE_F32);
	cast_params(ctx, m, EPJ_DTYPE_F64);
	randomize_norms(ctx, m);
	batch b;
	int B = 2, T = 5;
	if (!fixed) {
		/* Learned routing: redraw the batch until every token's top-k
		 * boundary gap exceeds 1e-3 (the FD perturbation moves
		 * router probabilities by ~1e-6), judged by the reference,
		 * which must also agree with the model's routing. */
		double gap = 0;
		for (int tries = 0; tries < 50; tries++) {
			make_batch(ctx, &b, B, T, c->V, true);
			epj_tensor *lg = NULL;
			ck_assert_msg(epj_model_forward(ctx, m, b.t_ids, NULL,
							&lg, NULL) == EPJ_OK,
				      "%s", epj_ctx_error(ctx));
			ref_model r;
			ref_load(ctx, m, c, layout, false, &r);
			int64_t **rt = model_routing(ctx, m, layout, c, B * T);
			double *ref =
			    malloc(sizeof(double) * (size_t)(B * T * c->V));
			ref_routing rs = { 0 };
			ref_forward(&r, b.ids, NULL, B, T, ref, rt, 1e-9, &rs);
			ck_assert_int_eq(rs.mismatches, 0);
			/* the f64 model and the reference agree closely */
			/* (the model's RoPE tables are f32, as HF's) */
			tu_assert_close(ctx, lg, ref, 1e-5, 1e-6,
					"f64 logits vs reference");
			gap = rs.min_gap;
			free(ref);
			routing_free(rt);
			ref_free(&r);
			epj_tensor_free(lg);
			if (gap > 1e-3)
				break;
			batch_free(&b);
		}
		ck_assert_msg(gap > 1e-3, "no batch without near-ties found");
	} else {
		make_batch(ctx, &b, B, T, c->V, true);
	}
	fd_check(ctx, m, &b, fixed ? "fd fixed routing" : "fd learned routing");
	batch_free(&b);
	epj_model_free(m);
	epj_ctx_free(ctx);
}

START_TEST(test_fd_nested_fixed)
{
	fd_test(EPJ_LAYOUT_NESTED, true);
}
END_TEST

START_TEST(test_fd_nested_learned)
{
	fd_test(EPJ_LAYOUT_NESTED, false);
}
END_TEST

START_TEST(test_fd_root_fixed)
{
	fd_test(EPJ_LAYOUT_ROOT, true);
}
END_TEST

START_TEST(test_fd_root_learned)
{
	fd_test(EPJ_LAYOUT_ROOT, false);
}
END_TEST

/* ---- activation checkpointing
 * -------------------------------------------------
 */

typedef struct grads {
	int n;
	double **g;
	int64_t *numel;
} grads;

static void grads_take(epj_ctx *ctx, epj_model *m, grads *out)
{
	out->n = epj_model_num_params(m);
	out->g = calloc((size_t)out->n, sizeof *out->g);
	out->numel = calloc((size_t)out->n, sizeof *out->numel);
	ck_assert(out->g && out->numel);
	for (int i = 0; i < out->n; i++) {
		epj_tensor *g = epj_tensor_grad(epj_model_param(m, i));
		/* an expert no token was routed to has no gradient (NULL) */
		ck_assert_msg(
		    g || strstr(epj_model_param_name(m, i), ".experts."),
		    "%s: no gradient", epj_model_param_name(m, i));
		out->g[i] = g ? tu_values(ctx, g) : NULL;
		out->numel[i] = g ? epj_tensor_numel(g) : -1;
	}
	clear_grads(m);
}

static void grads_free(grads *g)
{
	for (int i = 0; i < g->n; i++)
		free(g->g[i]);
	free(g->g);
	free(g->numel);
}

/* One forward + backward; returns the loss; counter deltas in *fwd, *rep. */
static double step_counted(epj_ctx *ctx, epj_model *m, const batch *b,
			   int64_t *fwd, int64_t *rep)
{
	int64_t f0 = epj_counter_get(ctx, "autoep.calls.forward");
	int64_t r0 = epj_counter_get(ctx, "autoep.calls.replay");
	epj_tensor *loss = NULL;
	ck_assert_msg(epj_model_forward(ctx, m, b->t_ids, b->t_labels, NULL,
					&loss) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	double v = epj_tensor_get_f64(loss, 0);
	ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_tensor_free(loss);
	*fwd = epj_counter_get(ctx, "autoep.calls.forward") - f0;
	*rep = epj_counter_get(ctx, "autoep.calls.replay") - r0;
	return v;
}

static void ckpt_test(epj_layout layout)
{
	epj_ctx *ctx = tu_ctx();
	const tcfg *c = &CFG_FD;
	int nm = n_moe_layers(c, layout);
	epj_model *m =
	    build_model(ctx, c, layout, (uint64_t)tu_randint(1, 1 << 30), false,
			EPJ_DTYPE_F32);
	randomize_norms(ctx, m);
	batch b;
	make_batch(ctx, &b, 2, 7, c->V, true);
	int64_t fwd, rep;
	grads off, on;

	epj_model_set_checkpointing(m, false);
	double l_off = step_counted(ctx, m, &b, &fwd, &rep);
	ck_assert_int_eq(fwd, nm);
	ck_assert_int_eq(rep, 0);
	grads_take(ctx, m, &off);

	epj_model_set_checkpointing(m, true);
	double l_on = step_counted(ctx, m, &b, &fwd, &rep);
	ck_assert_int_eq(fwd, nm);
	ck_assert_int_eq(rep, nm);
	grads_take(ctx, m, &on);
	ck_assert_msg(l_on == l_off, "loss %.9g with checkpointing, %.9g off",
		      l_on, l_off);
	for (int i = 0; i < off.n; i++) {
		ck_assert_msg(off.numel[i] == on.numel[i],
			      "%s: gradient present %d with checkpointing, %d "
			      "without",
			      epj_model_param_name(m, i), on.numel[i] >= 0,
			      off.numel[i] >= 0);
		for (int64_t k = 0; k < off.numel[i]; k++)
			ck_assert_msg(off.g[i][k] == on.g[i][k],
				      "%s[%lld]: grad %.9g with checkpointing, "
				      "%.9g without",
				      epj_model_param_name(m, i), (long long)k,
				      on.g[i][k], off.g[i][k]);
	}

	/* a second checkpointed step: the same again (nothing left over) */
	double l2 = step_counted(ctx, m, &b, &fwd, &rep);
	ck_assert_int_eq(fwd, nm);
	ck_assert_int_eq(rep, nm);
	ck_assert(l2 == l_on);
	grads on2;
	grads_take(ctx, m, &on2);
	for (int i = 0; i < on.n; i++) {
		ck_assert_int_eq(on.numel[i], on2.numel[i]);
		ck_assert(on.numel[i] < 0 ||
			  !memcmp(on.g[i], on2.g[i],
				  sizeof(double) * (size_t)on.numel[i]));
	}
	grads_free(&on2);

	/* under no-grad (eval) nothing is checkpointed or replayed */
	int64_t f0 = epj_counter_get(ctx, "autoep.calls.forward");
	int64_t r0 = epj_counter_get(ctx, "autoep.calls.replay");
	double le = loss_nograd(ctx, m, &b);
	ck_assert(le == l_on);
	ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.forward") - f0, nm);
	ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.replay") - r0, 0);

	/* and off again: back to one call per layer */
	epj_model_set_checkpointing(m, false);
	step_counted(ctx, m, &b, &fwd, &rep);
	ck_assert_int_eq(fwd, nm);
	ck_assert_int_eq(rep, 0);
	clear_grads(m);

	grads_free(&off);
	grads_free(&on);
	batch_free(&b);
	epj_model_free(m);
	epj_ctx_free(ctx);
}

START_TEST(test_ckpt_nested)
{
	ckpt_test(EPJ_LAYOUT_NESTED);
}
END_TEST

START_TEST(test_ckpt_root)
{
	ckpt_test(EPJ_LAYOUT_ROOT);
}
END_TEST

/* ---- bf16
 * --------------------------------------------------------------------
 */

/* A bf16 model (opts.dtype BF16) has exactly the RNE-rounded weights of the
 * f32 model with the same seed, and computes the same function to bf16
 * accuracy.  Compared against the f32 model holding those same rounded
 * weights, so only activation rounding differs.  Fixed routing: a bf16
 * router may legitimately flip near-ties.
 *
 * Tolerance: bf16 has an 8-bit significand (unit roundoff 2^-9 = 0.2%); the
 * activations of each op are rounded once, and a few dozen ops in sequence
 * give relative errors of a few 1e-3..1e-2 on the logits.  Measured over
 * 20 seeds: relative L2 error of the logits 0.004 .. 0.014, largest error
 * 0.005 .. 0.02 of max |logit|, relative loss difference 1e-5 .. 1e-3.
 * Required: < 3e-2, < 6e-2 and < 5e-3 respectively. */
static void bf16_test(epj_layout layout)
{
	epj_ctx *ctx = tu_ctx();
	tcfg c = CFG_REF;
	c.n_only = 0;
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *mf = build_model(ctx, &c, layout, seed, true, EPJ_DTYPE_F32);
	epj_model *mb =
	    build_model(ctx, &c, layout, seed, true, EPJ_DTYPE_BF16);
	ck_assert_int_eq(epj_model_num_params(mf), epj_model_num_params(mb));
	for (int i = 0; i < epj_model_num_params(mb); i++) {
		epj_tensor *pf = epj_model_param(mf, i),
			   *pb = epj_model_param(mb, i);
		ck_assert_int_eq(epj_tensor_dtype(pb), EPJ_DTYPE_BF16);
		ck_assert(epj_tensor_requires_grad(pb));
		double *vf = tu_values(ctx, pf), *vb = tu_values(ctx, pb);
		for (int64_t k = 0; k < epj_tensor_numel(pf); k++) {
			float rne =
			    epj_bf16_to_f32(epj_f32_to_bf16((float)vf[k]));
			ck_assert_msg(vb[k] == (double)rne,
				      "%s[%lld]: bf16 %.9g, RNE(f32) %.9g",
				      epj_model_param_name(mb, i), (long long)k,
				      vb[k], (double)rne);
		}
		free(vf);
		free(vb);
	}
	/* the f32 model with the bf16-rounded weights */
	cast_params(ctx, mf, EPJ_DTYPE_BF16);
	cast_params(ctx, mf, EPJ_DTYPE_F32);
	int B = 2, T = 8, N = B * T;
	batch b;
	make_batch(ctx, &b, B, T, c.V, true);
	epj_tensor *lf = NULL, *lb = NULL, *sf = NULL, *sb = NULL;
	ck_assert_msg(
	    epj_model_forward(ctx, mf, b.t_ids, b.t_labels, &lf, &sf) == EPJ_OK,
	    "%s", epj_ctx_error(ctx));
	ck_assert_msg(
	    epj_model_forward(ctx, mb, b.t_ids, b.t_labels, &lb, &sb) == EPJ_OK,
	    "bf16 forward: %s", epj_ctx_error(ctx));
	ck_assert_int_eq(epj_tensor_dtype(lb), EPJ_DTYPE_BF16);
	double *vf = tu_values(ctx, lf), *vb = tu_values(ctx, lb);
	double num = 0, den = 0, mx = 0, worst = 0;
	for (int i = 0; i < N * c.V; i++) {
		num += (vb[i] - vf[i]) * (vb[i] - vf[i]);
		den += vf[i] * vf[i];
		mx = fmax(mx, fabs(vf[i]));
		worst = fmax(worst, fabs(vb[i] - vf[i]));
	}
	double rel = sqrt(num / den);
	double lossf = epj_tensor_get_f64(sf, 0),
	       lossb = epj_tensor_get_f64(sb, 0);
	ck_assert_msg(rel < 3e-2 && worst < 6e-2 * mx &&
			  fabs(lossb - lossf) < 5e-3 * fabs(lossf),
		      "bf16 vs f32: logits rel L2 %.3g, max abs %.3g (max "
		      "|logit| %.3g), loss %.6g vs %.6g",
		      rel, worst, mx, lossb, lossf);
	/* and not identical: the bf16 model really computes in bf16 */
	ck_assert(rel > 0);
	/* backward runs in bf16 and gives bf16 gradients */
	ck_assert_int_eq(epj_backward(ctx, sb, NULL), EPJ_OK);
	for (int i = 0; i < epj_model_num_params(mb); i++) {
		epj_tensor *g = epj_tensor_grad(epj_model_param(mb, i));
		ck_assert_msg(g, "%s: no grad", epj_model_param_name(mb, i));
		ck_assert_int_eq(epj_tensor_dtype(g), EPJ_DTYPE_BF16);
	}
	free(vf);
	free(vb);
	epj_tensor_free(lf);
	epj_tensor_free(lb);
	epj_tensor_free(sf);
	epj_tensor_free(sb);
	batch_free(&b);
	epj_model_free(mf);
	epj_model_free(mb);
	epj_ctx_free(ctx);
}

START_TEST(test_bf16_nested)
{
	bf16_test(EPJ_LAYOUT_NESTED);
}
END_TEST

START_TEST(test_bf16_root)
{
	bf16_test(EPJ_LAYOUT_ROOT);
}
END_TEST

/* set_param refuses another shape, naming the parameter. */
START_TEST(test_set_param_errors)
{
	epj_ctx *ctx = tu_ctx();
	epj_model *m = build_model(ctx, &CFG_FD, EPJ_LAYOUT_NESTED, 1, false,
				   EPJ_DTYPE_F32);
	int i = param_index(m, "model.layers.1.self_attn.k_proj.weight");
	ck_assert_int_ge(i, 0);
	int64_t sh[2] = { 3, 8 };
	epj_tensor *t = epj_zeros(ctx, EPJ_DTYPE_F32, 2, sh);
	epj_tensor *before = epj_model_param(m, i);
	ck_assert_int_eq(epj_model_set_param(ctx, m, i, t), EPJ_ERR_SHAPE);
	ck_assert_msg(strstr(epj_ctx_error(ctx),
			     "model.layers.1.self_attn.k_proj.weight"),
		      "%s", epj_ctx_error(ctx));
	ck_assert_ptr_eq(epj_model_param(m, i), before);
	ck_assert_int_ne(
	    epj_model_set_param(ctx, m, epj_model_num_params(m), t), EPJ_OK);
	ck_assert_int_ne(epj_model_set_param(ctx, m, -1, t), EPJ_OK);
	ck_assert_int_ne(epj_model_set_param(ctx, m, 0, NULL), EPJ_OK);
	epj_tensor_free(t);
	/* a replaced parameter is used by the next forward: zero lm_head
	 * gives zero logits */
	int lm = param_index(m, "lm_head.weight");
	epj_tensor *z = epj_zeros(ctx, EPJ_DTYPE_F32, 2,
				  epj_tensor_shape(epj_model_param(m, lm)));
	ck_assert_int_eq(epj_model_set_param(ctx, m, lm, z), EPJ_OK);
	epj_tensor_free(z);
	batch b;
	make_batch(ctx, &b, 1, 4, CFG_FD.V, false);
	epj_tensor *lg = NULL;
	ck_assert_int_eq(epj_model_forward(ctx, m, b.t_ids, NULL, &lg, NULL),
			 EPJ_OK);
	double *zero = calloc((size_t)epj_tensor_numel(lg), sizeof(double));
	tu_assert_close(ctx, lg, zero, 0, 0, "logits with zero lm_head");
	free(zero);
	epj_tensor_free(lg);
	batch_free(&b);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_model_suite(void)
{
	Suite *s = suite_create("model");
	TCase *tr = tcase_create("reference");
	tcase_set_timeout(tr, 60);
	tcase_add_test(tr, test_reference_nested);
	tcase_add_test(tr, test_reference_nested_fixed);
	tcase_add_test(tr, test_reference_root);
	tcase_add_test(tr, test_forward_errors);
	tcase_add_test(tr, test_set_param_errors);
	suite_add_tcase(s, tr);
	TCase *tf = tcase_create("fd");
	tcase_set_timeout(tf, 60);
	tcase_add_test(tf, test_fd_nested_fixed);
	tcase_add_test(tf, test_fd_nested_learned);
	tcase_add_test(tf, test_fd_root_fixed);
	tcase_add_test(tf, test_fd_root_learned);
	suite_add_tcase(s, tf);
	TCase *tc = tcase_create("checkpointing");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_ckpt_nested);
	tcase_add_test(tc, test_ckpt_root);
	suite_add_tcase(s, tc);
	TCase *tb = tcase_create("bf16");
	tcase_set_timeout(tb, 60);
	tcase_add_test(tb, test_bf16_nested);
	tcase_add_test(tb, test_bf16_root);
	suite_add_tcase(s, tb);
	return s;
}
