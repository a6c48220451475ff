/* router_loss.c -- the router losses of the AutoEP layers (doc/trainer.md,
 * "Router losses"): transformers' auxiliary load-balancing loss and
 * Megatron Core's aux_loss, seq_aux_loss, global_aux_loss and z-loss.
 *
 * Per MoE layer l of a forward over N = B T tokens (B sequences of T), with
 * p [N, E] the router's scores as the losses define them (the softmax of
 * the logits z; a sigmoid router's scores normalised to sum 1, Megatron's
 * compute_routing_scores_for_aux_loss) and c the top-k choice of p (the
 * routing map: not the layer's fixed routing, groups or score bias):
 *
 *   transformers (load_balancing_loss_func of modeling_qwen3_moe.py,
 *   _mixtral, _qwen2_moe, _qwen3_5_moe, transformers 5.24; the layers'
 *   counts and probabilities summed before the product):
 *     aux = E sum_e C_e S_e / (L N)^2,  C_e = sum_l,n c, S_e = sum_l,n p
 *   Megatron Core (moe_utils.py switch_load_balancing_loss_func and
 *   z_loss_func, router.py _apply_aux_loss, _apply_seq_aux_loss,
 *   _apply_global_aux_loss), per layer, summed over the layers:
 *     aux_loss        E / (k N^2) sum_e P_e c_e        P_e = sum_n p[n, e]
 *     seq_aux_loss    1/B sum_b E / (k T^2) sum_e P_be c_be   (per sequence)
 *     global_aux_loss E / (k N_g^2) sum_e P_e cbar_e   cbar: c summed over
 *                     the ranks, averaged over the step's micro-batches so
 *                     far; N_g = N x ranks
 *     z-loss          1/N sum_n logsumexp(z_n)^2
 *
 * Every balancing loss is linear in p with coefficients fixed by counts
 * (no gradient flows through a top-k), so its gradient is G [B, E] per
 * layer: dL/dp[n, e] = G[b(n), e], taken back through the score function
 * (softmax: p (G - <p, G>); normalised sigmoid s = sig / sum sig:
 * sig (1 - sig) / sum sig (G - <s, G>)); the z-loss adds 2 zc lse_n
 * softmax(z_n) / N.  The values are counted once per layer and forward by
 * the forward's call (under checkpointing that runs without grad); the
 * gradient is added once, by the identity node ej_rloss_attach hangs on
 * the logits of the call that runs with grad (the forward, or its replay
 * in the backward), which reads G at backward time: transformers' G needs
 * the counts of every layer, known at ej_rloss_end.
 *
 * Invariants: a layer's G belongs to the forward numbered `serial`; a node
 * of another forward fails its backward (EPJ_ERR_STATE) rather than add a
 * gradient of other tokens.  No padding: epjit's batches have none (every
 * token counts, as transformers without an attention mask).
 */
#include "router_loss_impl.h"
#include "runtime_impl.h"

#include <math.h>
#include <string.h>

static const char *const metric_names[EJ_RLOSS_N] = {
	"aux_loss", "load_balancing_loss", "seq_load_balancing_loss",
	"global_load_balancing_loss", "z_loss"
};

typedef struct rl_layer {
	int64_t serial;	  /* the forward that counted it; 0: none */
	bool counted;	  /* ej_rloss_count ran in that forward */
	double *cnt, *g;  /* [B, E]: top-k counts; dL/dp (ej_rloss_end) */
	int64_t cap;	  /* elements of cnt and g */
	double zk;	  /* dL/dz of the z-loss: zk lse softmax(z) */
	epj_tensor *psum; /* [B, E] sum over each sequence of p */
	epj_tensor *lse2; /* [] sum_n logsumexp(z_n)^2 */
	double *ga;	  /* [E] global aux loss: counts over the step */
	int64_t ga_n;	  /* micro-batches in ga */
} rl_layer;

struct ej_rloss {
	int L, E, k;
	ej_route_scoring scoring;
	double coef[EJ_RLOSS_N]; /* 0: off */
	ej_comm *world;		 /* borrowed; NULL: one rank */
	/* the current (or last) forward */
	int64_t serial;
	bool in_forward, training;
	int64_t N, B, T;
	rl_layer *lay; /* [L] */
	double value[EJ_RLOSS_N];
	/* the optimizer step */
	double step_sum[EJ_RLOSS_N];
	int64_t step_n;
	double metric[EJ_RLOSS_N];
	/* the gradient that reached the training loss of the current forward
	 * (ej_rloss_add_to_loss's node; NULL before its backward): the
	 * router losses' gradient is scaled by it */
	epj_tensor *gout;
};

ej_rloss *ej_rloss_new(int n_layers, int E, int k, ej_route_scoring scoring,
		       bool hf, double hf_coef)
{
	EJ_ASSERT(n_layers >= 0 && E >= 1 && k >= 1 && k <= E);
	ej_rloss *rl = calloc(1, sizeof *rl);
	if (!rl)
		return NULL;
	rl->L = n_layers;
	rl->E = E;
	rl->k = k;
	rl->scoring = scoring;
	rl->coef[EJ_RLOSS_HF] = hf ? hf_coef : 0;
	rl->lay = calloc((size_t)n_layers + 1, sizeof *rl->lay);
	bool ok = rl->lay != NULL;
	for (int l = 0; ok && l < n_layers; l++)
		ok = (rl->lay[l].ga = calloc((size_t)E, sizeof(double)));
	if (!ok) {
		ej_rloss_free(rl);
		return NULL;
	}
	return rl;
}

void ej_rloss_free(ej_rloss *rl)
{
	if (!rl)
		return;
	for (int l = 0; rl->lay && l < rl->L; l++) {
		free(rl->lay[l].cnt);
		free(rl->lay[l].g);
		free(rl->lay[l].ga);
		epj_tensor_free(rl->lay[l].psum);
		epj_tensor_free(rl->lay[l].lse2);
	}
	free(rl->lay);
	epj_tensor_free(rl->gout);
	free(rl);
}

epj_status ej_rloss_configure(epj_ctx *ctx, ej_rloss *rl,
			      const struct ej_moe_config *moe, ej_comm *world)
{
	if (!rl)
		return EPJ_OK; /* no MoE layer: nothing to balance */
	const struct {
		const char *key;
		double v;
	} mc[] = { { "aux_loss_coeff", moe->aux_loss_coeff },
		   { "seq_aux_loss_coeff", moe->seq_aux_loss_coeff },
		   { "global_aux_loss_coeff", moe->global_aux_loss_coeff } };
	for (size_t i = 0; rl->coef[EJ_RLOSS_HF] != 0 && i < EJ_ARRAY_LEN(mc);
	     i++)
		if (mc[i].v > 0)
			return ej_error(
			    ctx, EPJ_ERR_CONFIG,
			    "moe.%s is %g and the model's config.json has "
			    "\"output_router_logits\": true (transformers' "
			    "auxiliary loss, router_aux_loss_coef %g): "
			    "choose one load-balancing loss (set "
			    "output_router_logits false, or moe.%s 0)",
			    mc[i].key, mc[i].v, rl->coef[EJ_RLOSS_HF],
			    mc[i].key);
	rl->coef[EJ_RLOSS_AUX] = moe->aux_loss_coeff;
	rl->coef[EJ_RLOSS_SEQ] = moe->seq_aux_loss_coeff;
	rl->coef[EJ_RLOSS_GLOBAL] = moe->global_aux_loss_coeff;
	rl->coef[EJ_RLOSS_Z] = moe->z_loss_coeff;
	rl->world = world && world->size > 1 ? world : NULL;
	return EPJ_OK;
}

bool ej_rloss_on(const ej_rloss *rl)
{
	if (!rl || rl->L == 0)
		return false;
	for (int i = 0; i < EJ_RLOSS_N; i++)
		if (rl->coef[i] != 0)
			return true;
	return false;
}

/* Whether loss i counts in the current forward: transformers' always (as
 * its forward adds it whenever output_router_logits), Megatron's in
 * training only (router.py: self.training and torch.is_grad_enabled()). */
static bool active(const ej_rloss *rl, int i)
{
	return rl->coef[i] != 0 && (i == EJ_RLOSS_HF || rl->training);
}

/* A balancing loss (one that needs the scores' sums and the counts). */
static bool balancing(const ej_rloss *rl)
{
	for (int i = EJ_RLOSS_HF; i <= EJ_RLOSS_GLOBAL; i++)
		if (active(rl, i))
			return true;
	return false;
}

void ej_rloss_begin(ej_rloss *rl, bool training)
{
	if (!rl)
		return;
	rl->in_forward = true; /* also without a loss: ej_rloss_training */
	rl->training = training;
	if (!ej_rloss_on(rl))
		return;
	rl->serial++;
	epj_tensor_free(rl->gout);
	rl->gout = NULL;
	rl->N = rl->B = rl->T = 0;
	memset(rl->value, 0, sizeof rl->value);
}

/* The loss node's backward: the gradient passes through, and is kept for
 * the router logits' nodes, which run after it (they are upstream of the
 * loss). */
static epj_status total_backward(epj_ctx *ctx, ej_node *n,
				 epj_tensor *const *grad_out,
				 epj_tensor **grad_in)
{
	ej_rloss *rl = n->custom;
	(void)ctx;
	epj_tensor_free(rl->gout);
	rl->gout = epj_tensor_ref(grad_out[0]);
	grad_in[0] = epj_tensor_ref(grad_out[0]);
	return EPJ_OK;
}

epj_status ej_rloss_add_to_loss(epj_ctx *ctx, ej_rloss *rl, double add,
				epj_tensor **loss)
{
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *sum = epj_add_scalar(ctx, *loss, add);
	epj_no_grad_exit(ctx, prev);
	if (!sum)
		return ctx->status;
	if (epj_grad_enabled(ctx) && epj_tensor_requires_grad(*loss) &&
	    !ej_node_custom(ctx, "router_loss_total", loss, 1, &sum, 1,
			    total_backward, rl, NULL)) {
		epj_tensor_free(sum);
		return ctx->status;
	}
	epj_tensor_free(*loss);
	*loss = sum;
	return EPJ_OK;
}

bool ej_rloss_training(const epj_ctx *ctx, const ej_rloss *rl)
{
	return rl && rl->in_forward && rl->training &&
	       ctx->rt_replay_depth == 0;
}

/* A call of the forward (not a checkpoint replay). */
static bool counting(const epj_ctx *ctx, const ej_rloss *rl)
{
	return ej_rloss_on(rl) && rl->in_forward && ctx->rt_replay_depth == 0;
}

bool ej_rloss_wants_choice(const epj_ctx *ctx, const ej_rloss *rl)
{
	return counting(ctx, rl) && balancing(rl);
}

/* ---- the scores and the gradient node ---------------------------------- */

/* The router's scores p [N, E] in rdt from the logits (rdt already). */
static epj_tensor *scores(epj_ctx *ctx, const ej_rloss *rl, epj_tensor *zr)
{
	if (rl->scoring == EJ_SCORE_SOFTMAX)
		return epj_softmax(ctx, zr, -1);
	epj_tensor *t[3] = { 0 };
	t[0] = epj_sigmoid(ctx, zr);
	t[1] = t[0] ? epj_sum(ctx, t[0], -1, true) : NULL;
	t[2] = t[1] ? epj_add_scalar(ctx, t[1], 1e-20) : NULL;
	epj_tensor *s = t[2] ? epj_div(ctx, t[0], t[2]) : NULL;
	ej_drop(t, 3);
	return s;
}

/* logsumexp of each row of zr [N, E]: [N, 1]. */
static epj_tensor *row_lse(epj_ctx *ctx, epj_tensor *zr)
{
	epj_tensor *t[4] = { 0 };
	t[0] = epj_amax(ctx, zr, -1, true);
	t[1] = t[0] ? epj_sub(ctx, zr, t[0]) : NULL;
	t[2] = t[1] ? epj_exp(ctx, t[1]) : NULL;
	t[3] = t[2] ? epj_sum(ctx, t[2], -1, true) : NULL;
	epj_tensor *lg = t[3] ? epj_log(ctx, t[3]) : NULL;
	epj_tensor *r = lg ? epj_add(ctx, lg, t[0]) : NULL;
	epj_tensor_free(lg);
	ej_drop(t, 4);
	return r;
}

static epj_dtype wide_of(const epj_tensor *t)
{
	return epj_tensor_dtype(t) == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64
						    : EPJ_DTYPE_F32;
}

typedef struct rl_node {
	ej_rloss *rl;
	int layer;
	int64_t serial, B, T;
	epj_tensor *z; /* the logits, detached */
} rl_node;

static void rl_node_free(void *p)
{
	rl_node *d = p;
	if (d)
		epj_tensor_free(d->z);
	free(d);
}

/* dL/dz [N, E] in rdt of one layer's losses (G, zk of the layer). */
static epj_tensor *loss_grad(epj_ctx *ctx, const ej_rloss *rl,
			     const rl_layer *ly, epj_tensor *zr, int64_t B,
			     int64_t T)
{
	const int64_t E = rl->E, N = B * T;
	enum { P, GT, P3, PG, PGS, D, S3, S1, W, DZ, LSE, SM, ZZ, ZS, N_T };
	epj_tensor *t[N_T] = { 0 };
	epj_tensor *dz = NULL;
	const int64_t s3[3] = { B, T, E }, sg[3] = { B, 1, E };
	const int64_t s2[2] = { N, E };
	t[P] = scores(ctx, rl, zr);
	t[GT] = epj_zeros(ctx, epj_tensor_dtype(zr), 3, sg);
	if (!t[P] || !t[GT] || epj_tensor_from_f64(ctx, t[GT], ly->g))
		goto out;
	t[P3] = epj_reshape(ctx, t[P], 3, s3);
	t[PG] = t[P3] ? epj_mul(ctx, t[P3], t[GT]) : NULL;
	t[PGS] = t[PG] ? epj_sum(ctx, t[PG], -1, true) : NULL;
	t[D] = t[PGS] ? epj_sub(ctx, t[GT], t[PGS]) : NULL; /* G - <p, G> */
	if (!t[D])
		goto out;
	if (rl->scoring == EJ_SCORE_SOFTMAX) {
		t[DZ] = epj_mul(ctx, t[P3], t[D]);
	} else {
		/* sig (1 - sig) / (sum sig + 1e-20) (G - <s, G>) */
		epj_tensor *u[4] = { 0 };
		u[0] = epj_sigmoid(ctx, zr);
		u[1] = u[0] ? epj_reshape(ctx, u[0], 3, s3) : NULL;
		u[2] = u[1] ? epj_mul(ctx, u[1], u[1]) : NULL;
		t[S3] = u[2] ? epj_sub(ctx, u[1], u[2]) : NULL;
		u[3] = u[1] ? epj_sum(ctx, u[1], -1, true) : NULL;
		t[S1] = u[3] ? epj_add_scalar(ctx, u[3], 1e-20) : NULL;
		t[W] = t[S3] && t[S1] ? epj_div(ctx, t[S3], t[S1]) : NULL;
		t[DZ] = t[W] ? epj_mul(ctx, t[W], t[D]) : NULL;
		ej_drop(u, 4);
	}
	if (!t[DZ])
		goto out;
	dz = epj_reshape(ctx, t[DZ], 2, s2);
	if (dz && ly->zk != 0) {
		/* the z-loss: zk lse_n softmax(z_n) */
		t[LSE] = row_lse(ctx, zr);
		t[SM] = t[LSE] ? epj_softmax(ctx, zr, -1) : NULL;
		t[ZZ] = t[SM] ? epj_mul(ctx, t[SM], t[LSE]) : NULL;
		t[ZS] = t[ZZ] ? epj_mul_scalar(ctx, t[ZZ], ly->zk) : NULL;
		epj_tensor *sum = t[ZS] ? epj_add(ctx, dz, t[ZS]) : NULL;
		epj_tensor_free(dz);
		dz = sum;
	}
out:
	ej_drop(t, N_T);
	return dz;
}

static epj_status rl_backward(epj_ctx *ctx, ej_node *n,
			      epj_tensor *const *grad_out, epj_tensor **grad_in)
{
	rl_node *d = n->custom;
	ej_rloss *rl = d->rl;
	const rl_layer *ly = &rl->lay[d->layer];
	if (d->serial != rl->serial || ly->serial != d->serial || !ly->counted)
		return ej_error(ctx, EPJ_ERR_STATE,
				"router loss of MoE layer %d: the backward of "
				"forward %lld runs after forward %lld began "
				"(one backward per forward)",
				d->layer, (long long)d->serial,
				(long long)rl->serial);
	bool prev = epj_no_grad_enter(ctx);
	const epj_dtype rdt = wide_of(d->z);
	epj_tensor *zr = epj_cast(ctx, d->z, rdt);
	epj_tensor *dz = zr ? loss_grad(ctx, rl, ly, zr, d->B, d->T) : NULL;
	if (dz && rl->gout) {
		/* the loss's own gradient (the per-token loss backpropagates
		 * the sum of a micro-batch's token losses) */
		const int64_t one[2] = { 1, 1 };
		epj_tensor *g1 = epj_reshape(ctx, rl->gout, 2, one);
		epj_tensor *gr = g1 ? epj_cast(ctx, g1, rdt) : NULL;
		epj_tensor *sc = gr ? epj_mul(ctx, dz, gr) : NULL;
		epj_tensor_free(g1);
		epj_tensor_free(gr);
		epj_tensor_free(dz);
		dz = sc;
	}
	epj_tensor *go = dz ? epj_cast(ctx, grad_out[0], rdt) : NULL;
	epj_tensor *sum = go ? epj_add(ctx, go, dz) : NULL;
	grad_in[0] = sum ? epj_cast(ctx, sum, epj_tensor_dtype(d->z)) : NULL;
	epj_tensor_free(zr);
	epj_tensor_free(dz);
	epj_tensor_free(go);
	epj_tensor_free(sum);
	epj_no_grad_exit(ctx, prev);
	return grad_in[0] ? EPJ_OK : epj_ctx_status(ctx);
}

/* The identity alias of logits whose node adds the layer's gradient. */
static epj_status hang_node(epj_ctx *ctx, ej_rloss *rl, int layer,
			    epj_tensor *logits, int64_t B, int64_t T,
			    epj_tensor **out)
{
	rl_node *d = calloc(1, sizeof *d);
	epj_tensor *alias = d ? epj_detach(ctx, logits) : NULL;
	if (d)
		d->z = epj_detach(ctx, logits);
	if (!alias || !d->z) {
		epj_tensor_free(alias);
		rl_node_free(d);
		return ctx->status ? ctx->status
				   : ej_error(ctx, EPJ_ERR_NOMEM,
					      "router loss: out of memory");
	}
	d->rl = rl;
	d->layer = layer;
	d->serial = rl->serial;
	d->B = B;
	d->T = T;
	ej_node *node = ej_node_custom(ctx, "router_loss", &logits, 1, &alias,
				       1, rl_backward, d, rl_node_free);
	if (!node) {
		rl_node_free(d);
		epj_tensor_free(alias);
		return ctx->status;
	}
	EJ_ASSERT(alias->grad_fn == node);
	*out = alias;
	return EPJ_OK;
}

/* ---- the forward ---------------------------------------------------------
 */

/* The values of a counting call: the sums of p over each sequence [B, E]
 * and of logsumexp^2 (z-loss), under no grad. */
static epj_status take_values(epj_ctx *ctx, ej_rloss *rl, rl_layer *ly,
			      epj_tensor *logits)
{
	epj_tensor_free(ly->psum);
	epj_tensor_free(ly->lse2);
	ly->psum = ly->lse2 = NULL;
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *zr = epj_cast(ctx, logits, wide_of(logits));
	epj_tensor *p = zr && balancing(rl) ? scores(ctx, rl, zr) : NULL;
	const int64_t s3[3] = { rl->B, rl->T, rl->E };
	epj_tensor *p3 = p ? epj_reshape(ctx, p, 3, s3) : NULL;
	if (p3)
		ly->psum = epj_sum(ctx, p3, 1, false);
	if (zr && active(rl, EJ_RLOSS_Z)) {
		epj_tensor *lse = row_lse(ctx, zr);
		epj_tensor *sq = lse ? epj_mul(ctx, lse, lse) : NULL;
		ly->lse2 = sq ? epj_sum_all(ctx, sq) : NULL;
		epj_tensor_free(lse);
		epj_tensor_free(sq);
	}
	epj_tensor_free(zr);
	epj_tensor_free(p);
	epj_tensor_free(p3);
	epj_no_grad_exit(ctx, prev);
	bool ok = zr && (!balancing(rl) || ly->psum) &&
		  (!active(rl, EJ_RLOSS_Z) || ly->lse2);
	return ok ? EPJ_OK : epj_ctx_status(ctx);
}

/* Room for [B, E] counts and coefficients. */
static epj_status layer_room(epj_ctx *ctx, rl_layer *ly, int64_t n)
{
	if (n <= ly->cap)
		return EPJ_OK;
	double *c = realloc(ly->cnt, sizeof *c * (size_t)n);
	if (c)
		ly->cnt = c;
	double *g = c ? realloc(ly->g, sizeof *g * (size_t)n) : NULL;
	if (g)
		ly->g = g;
	if (!c || !g)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"router loss: out of memory");
	ly->cap = n;
	return EPJ_OK;
}

epj_status ej_rloss_attach(epj_ctx *ctx, ej_rloss *rl, int layer,
			   epj_tensor *logits, int64_t T, epj_tensor **out)
{
	*out = NULL;
	if (!ej_rloss_on(rl) || !(balancing(rl) || active(rl, EJ_RLOSS_Z))) {
		*out = epj_tensor_ref(logits);
		return EPJ_OK;
	}
	EJ_ASSERT(layer >= 0 && layer < rl->L);
	EJ_ASSERT(epj_tensor_ndim(logits) == 2 &&
		  epj_tensor_dim(logits, 1) == rl->E);
	const int64_t N = epj_tensor_dim(logits, 0);
	EJ_ASSERT(T >= 1 && N % T == 0);
	rl_layer *ly = &rl->lay[layer];
	const bool fwd = counting(ctx, rl);
	if (fwd) {
		if (rl->N == 0) {
			rl->N = N;
			rl->T = T;
			rl->B = N / T;
		}
		if (rl->N != N || rl->T != T)
			return ej_error(ctx, EPJ_ERR_SHAPE,
					"router loss of MoE layer %d: %lld "
					"tokens of %lld, another MoE layer of "
					"this forward had %lld of %lld",
					layer, (long long)N, (long long)T,
					(long long)rl->N, (long long)rl->T);
		ly->serial = rl->serial;
		ly->counted = !balancing(rl); /* else by ej_rloss_count */
		epj_status s = layer_room(ctx, ly, rl->B * rl->E);
		if (s == EPJ_OK) {
			memset(ly->cnt, 0,
			       sizeof *ly->cnt * (size_t)(rl->B * rl->E));
			s = take_values(ctx, rl, ly, logits);
		}
		if (s != EPJ_OK)
			return s;
	}
	/* the gradient: by the call with grad, the forward's or its
	 * checkpoint replay's (the replay of the forward that counted) */
	bool replay = ctx->rt_replay_depth > 0 && !rl->in_forward &&
		      ly->serial == rl->serial;
	if (epj_grad_enabled(ctx) && epj_tensor_requires_grad(logits) &&
	    (fwd || replay))
		return hang_node(ctx, rl, layer, logits, N / T, T, out);
	*out = epj_tensor_ref(logits);
	return EPJ_OK;
}

epj_status ej_rloss_count(epj_ctx *ctx, ej_rloss *rl, int layer,
			  const int64_t *sel, int64_t N)
{
	if (!ej_rloss_wants_choice(ctx, rl))
		return EPJ_OK;
	rl_layer *ly = &rl->lay[layer];
	EJ_ASSERT(ly->serial == rl->serial && N == rl->N);
	const int E = rl->E, k = rl->k;
	memset(ly->cnt, 0, sizeof *ly->cnt * (size_t)(rl->B * E));
	for (int64_t n = 0; n < N; n++)
		for (int j = 0; j < k; j++) {
			int64_t e = sel[n * k + j];
			EJ_ASSERT(e >= 0 && e < E);
			ly->cnt[(n / rl->T) * E + e] += 1;
		}
	if (active(rl, EJ_RLOSS_GLOBAL)) {
		/* Megatron's global_tokens_per_expert: the counts of every
		 * rank of the data-parallel group, summed (each micro-batch,
		 * the same layers in the same order on every rank) */
		float *tot = calloc((size_t)E, sizeof *tot);
		if (!tot)
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"router loss: out of memory");
		for (int64_t b = 0; b < rl->B; b++)
			for (int e = 0; e < E; e++)
				tot[e] += (float)ly->cnt[b * E + e];
		epj_status s =
		    rl->world ? ej_comm_allreduce(ctx, rl->world,
						  "moe.global_aux_loss", tot, E)
			      : EPJ_OK;
		for (int e = 0; s == EPJ_OK && e < E; e++)
			ly->ga[e] += tot[e];
		free(tot);
		if (s != EPJ_OK)
			return s;
		ly->ga_n++;
	}
	ly->counted = true;
	return EPJ_OK;
}

/* One counted layer at ej_rloss_end: its values (v, by kind, unscaled),
 * and G from them and hf_c[E] (transformers': the same for every layer). */
static epj_status layer_end(epj_ctx *ctx, ej_rloss *rl, rl_layer *ly,
			    const double *hf_c, double v[EJ_RLOSS_N])
{
	const int E = rl->E, k = rl->k;
	const int64_t B = rl->B, T = rl->T, N = rl->N;
	const int W = rl->world ? rl->world->size : 1;
	const double Ng = (double)N * W;
	double *ps = calloc((size_t)(B * E), sizeof *ps);
	if (!ps)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"router loss: out of memory");
	epj_status s = ly->psum ? epj_tensor_to_f64(ctx, ly->psum, ps) : EPJ_OK;
	double lse2 = 0;
	if (s == EPJ_OK && ly->lse2)
		s = epj_tensor_to_f64(ctx, ly->lse2, &lse2);
	if (s != EPJ_OK) {
		free(ps);
		return s;
	}
	const double c_aux =
			 active(rl, EJ_RLOSS_AUX) ? rl->coef[EJ_RLOSS_AUX] : 0,
		     c_seq =
			 active(rl, EJ_RLOSS_SEQ) ? rl->coef[EJ_RLOSS_SEQ] : 0,
		     c_glob = active(rl, EJ_RLOSS_GLOBAL)
				  ? rl->coef[EJ_RLOSS_GLOBAL]
				  : 0;
	for (int64_t b = 0; b < B; b++)
		for (int e = 0; e < E; e++) {
			double c = 0, P = 0;
			for (int64_t b2 = 0; b2 < B; b2++) {
				c += ly->cnt[b2 * E + e];
				P += ps[b2 * E + e];
			}
			const double cb = ly->cnt[b * E + e],
				     Pb = ps[b * E + e];
			const double cbar = ly->ga_n ? ly->ga[e] / ly->ga_n : 0;
			if (b == 0) {
				v[EJ_RLOSS_AUX] +=
				    E * P * c / (k * (double)N * N);
				v[EJ_RLOSS_GLOBAL] +=
				    E * P * cbar / (k * Ng * Ng);
			}
			v[EJ_RLOSS_SEQ] +=
			    E * Pb * cb / (k * (double)T * T * (double)B);
			ly->g[b * E + e] =
			    hf_c[e] + c_aux * E * c / (k * (double)N * N) +
			    c_seq * E * cb / (k * (double)T * T * (double)B) +
			    c_glob * E * cbar / (k * Ng * Ng);
		}
	v[EJ_RLOSS_Z] = lse2 / (double)N;
	ly->zk =
	    active(rl, EJ_RLOSS_Z) ? 2 * rl->coef[EJ_RLOSS_Z] / (double)N : 0;
	free(ps);
	return EPJ_OK;
}

/* transformers' aux over the counted layers, and its dL/dp (hf_c). */
static epj_status hf_end(epj_ctx *ctx, ej_rloss *rl, int Lc, double *hf_c,
			 double *value)
{
	const int E = rl->E;
	const double LN = (double)Lc * (double)rl->N;
	double *S = calloc((size_t)E, sizeof *S), *C = hf_c, *ps = NULL;
	if (S)
		ps = malloc(sizeof *ps * (size_t)(rl->B * E));
	epj_status s = S && ps ? EPJ_OK
			       : ej_error(ctx, EPJ_ERR_NOMEM,
					  "router loss: out of memory");
	for (int l = 0; s == EPJ_OK && l < rl->L; l++) {
		const rl_layer *ly = &rl->lay[l];
		if (ly->serial != rl->serial || !ly->counted)
			continue;
		s = epj_tensor_to_f64(ctx, ly->psum, ps);
		for (int64_t i = 0; s == EPJ_OK && i < rl->B * E; i++) {
			S[i % E] += ps[i];
			C[i % E] += ly->cnt[i];
		}
	}
	double aux = 0;
	for (int e = 0; s == EPJ_OK && e < E; e++)
		aux += C[e] * S[e];
	*value = E * aux / (LN * LN);
	for (int e = 0; e < E; e++)
		hf_c[e] = rl->coef[EJ_RLOSS_HF] * E * C[e] / (LN * LN);
	free(S);
	free(ps);
	return s;
}

epj_status ej_rloss_end(epj_ctx *ctx, ej_rloss *rl, double *add)
{
	*add = 0;
	bool was = rl && rl->in_forward;
	if (rl)
		rl->in_forward = false;
	if (!ej_rloss_on(rl) || !was)
		return EPJ_OK;
	int Lc = 0;
	for (int l = 0; l < rl->L; l++)
		Lc += rl->lay[l].serial == rl->serial && rl->lay[l].counted;
	if (Lc == 0)
		return EPJ_OK; /* no MoE layer counted (no balancing loss) */
	double *hf_c = calloc((size_t)rl->E, sizeof *hf_c);
	if (!hf_c)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"router loss: out of memory");
	epj_status s = active(rl, EJ_RLOSS_HF)
			   ? hf_end(ctx, rl, Lc, hf_c, &rl->value[EJ_RLOSS_HF])
			   : EPJ_OK;
	double sum[EJ_RLOSS_N] = { 0 };
	for (int l = 0; s == EPJ_OK && l < rl->L; l++) {
		rl_layer *ly = &rl->lay[l];
		if (ly->serial != rl->serial || !ly->counted)
			continue;
		double v[EJ_RLOSS_N] = { 0 };
		s = layer_end(ctx, rl, ly, hf_c, v);
		for (int i = EJ_RLOSS_AUX; i < EJ_RLOSS_N; i++)
			sum[i] += v[i];
	}
	free(hf_c);
	if (s != EPJ_OK)
		return s;
	/* the training loss adds every layer's loss; the metric is the
	 * mean over the layers (Megatron's MoEMetricsTracker) */
	*add = active(rl, EJ_RLOSS_HF)
		   ? rl->coef[EJ_RLOSS_HF] * rl->value[EJ_RLOSS_HF]
		   : 0;
	for (int i = EJ_RLOSS_AUX; i < EJ_RLOSS_N; i++) {
		if (!active(rl, i))
			continue;
		*add += rl->coef[i] * sum[i];
		rl->value[i] = sum[i] / Lc;
	}
	return EPJ_OK;
}

/* ---- the optimizer step --------------------------------------------------
 */

void ej_rloss_values(const ej_rloss *rl, double v[EJ_RLOSS_N])
{
	for (int i = 0; i < EJ_RLOSS_N; i++)
		v[i] = ej_rloss_on(rl) ? rl->value[i] : 0;
}

void ej_rloss_accumulate(ej_rloss *rl)
{
	if (!ej_rloss_on(rl))
		return;
	for (int i = 0; i < EJ_RLOSS_N; i++)
		rl->step_sum[i] += rl->value[i];
	rl->step_n++;
}

epj_status ej_rloss_step_end(epj_ctx *ctx, ej_rloss *rl, ej_comm *world)
{
	if (!ej_rloss_on(rl))
		return EPJ_OK;
	double m[EJ_RLOSS_N];
	for (int i = 0; i < EJ_RLOSS_N; i++)
		m[i] = rl->step_n ? rl->step_sum[i] / (double)rl->step_n : 0;
	if (world && world->size > 1) {
		/* hi and lo halves in f32 (as train.loss); the mean over the
		 * ranks, the global aux loss's sum (Megatron's needs_dp_avg
		 * False) */
		float hl[2 * EJ_RLOSS_N];
		for (int i = 0; i < EJ_RLOSS_N; i++) {
			hl[2 * i] = (float)m[i];
			hl[2 * i + 1] = (float)(m[i] - (double)hl[2 * i]);
		}
		epj_status s = ej_comm_allreduce(
		    ctx, world, "moe.router_losses", hl, 2 * EJ_RLOSS_N);
		if (s != EPJ_OK)
			return s;
		for (int i = 0; i < EJ_RLOSS_N; i++) {
			m[i] = (double)hl[2 * i] + (double)hl[2 * i + 1];
			if (i != EJ_RLOSS_GLOBAL)
				m[i] /= world->size;
		}
	}
	memcpy(rl->metric, m, sizeof m);
	memset(rl->step_sum, 0, sizeof rl->step_sum);
	rl->step_n = 0;
	/* Megatron's reset_global_aux_loss_tracker (finalize_model_grads) */
	for (int l = 0; l < rl->L; l++) {
		memset(rl->lay[l].ga, 0, sizeof(double) * (size_t)rl->E);
		rl->lay[l].ga_n = 0;
	}
	return EPJ_OK;
}

bool ej_rloss_metric(const ej_rloss *rl, int i, const char **name,
		     double *value)
{
	if (!ej_rloss_on(rl) || i < 0)
		return false;
	for (int j = 0; j < EJ_RLOSS_N; j++) {
		if (rl->coef[j] == 0 || i-- > 0)
			continue;
		if (name)
			*name = metric_names[j];
		if (value)
			*value = rl->metric[j];
		return true;
	}
	return false;
}
