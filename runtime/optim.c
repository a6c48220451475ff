/* optim.c -- SGD, Adam and AdamW on FP32 master parameters, gradient
 * clipping by global norm, and DeepSpeed's learning-rate schedules.
 *
 * The update formulas are PyTorch's (torch.optim.SGD / Adam / AdamW,
 * single-tensor path), computed per element in double from f32 storage:
 *
 *   SGD:   g += wd * p;  b = momentum * b + g (dampening 0);
 *          g = nesterov ? g + momentum * b : b;  p -= lr * g
 *   Adam (L2, adam_w_mode false):  g += wd * p, then the Adam update
 *   AdamW (decoupled: type AdamW, or Adam with adam_w_mode true as in
 *          DeepSpeed):  p *= 1 - lr * wd, then the Adam update
 *   Adam update (t = step count + 1):
 *          m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g^2;
 *          p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
 *
 * SGD's momentum buffer starts at zero, which gives PyTorch's first step
 * (b = g) exactly.  t is one global count (DeepSpeed's FusedAdam keeps one
 * per parameter group); a parameter without a gradient is skipped entirely.
 *
 * Kernels are flat loops over contiguous f32 arrays (ej_data), OpenMP
 * parallel above PAR_MIN elements; elementwise updates are independent of
 * the thread count, and the global norm is summed in fixed chunks and then
 * in chunk order, so it is too.  No autograd is involved: only raw data is
 * touched.
 *
 * On a cuda-sim or cuda context the update is one launch of the optimizer
 * template (templates/optim.cuh, the same formulas and bits), which also
 * writes densely stored bf16 parameters.  On cuda (device memory) the
 * global norm is summed on the device too (ej_tmpl_optim_sumsq: per-chunk
 * double sums, then the chunks in order); the one double it copies back
 * decides clipping and the non-finite skip on the host.  No gradient,
 * master or densely stored parameter is copied to the host in a step (a
 * strided bf16 parameter is still written through epj_tensor_copy_'s host
 * copies).  cuda-sim sums on the host as above (its memory is host memory).
 */
#include "kernels.h"
#include "optim_impl.h"
#include "runtime_impl.h"

#include "ops_impl.h" /* ej_bf16_load / ej_bf16_store */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PAR_MIN	   (1 << 15) /* elements below which loops stay serial */
#define NORM_CHUNK 8192	     /* elements per partial sum of the norm */
#define NORM_LANES 8	     /* running sums inside a chunk (sum_sq) */

typedef struct opt_param {
	char *name;
	epj_tensor *param;  /* owned ref */
	epj_tensor *master; /* owned ref; == param for f32 parameters */
	epj_tensor *mgrad;  /* owned ref; f32 accumulator, bf16 only */
	epj_tensor *s1;	    /* momentum buffer or exp_avg; NULL if unused */
	epj_tensor *s2;	    /* exp_avg_sq; NULL if unused */
	int64_t numel;
	bool has_grad; /* bf16: mgrad received a gradient since the last step */
	/* data parallelism: the group the gradient is summed over (NULL: a
	 * world of one) and this rank's partition [lo, hi) of the flat
	 * parameter; sharded: master and state hold only that partition */
	ej_comm *group;
	/* group's device counterpart (device memory, group of > 1 rank) */
	ej_comm *dgroup;
	int64_t lo, hi;
	int64_t nlo, nhi; /* partition counted in the global norm */
	bool sharded;
} opt_param;

typedef struct opt_state {
	char *name;    /* "optimizer.<kind>.<param name>" (owned) */
	epj_tensor *t; /* borrowed from an opt_param */
} opt_state;

struct ej_optim {
	epj_ctx *ctx;
	ej_optim_type type;
	double momentum, beta1, beta2, eps, wd, clip;
	bool nesterov;
	bool decoupled; /* AdamW-style weight decay */
	int n;
	opt_param *p;
	int n_state;
	opt_state *state;
	int64_t steps;
	double *partial; /* norm scratch: one slot per NORM_CHUNK */
	/* device memory (cuda): the gradient spans whose squares one
	 * template launch sums on the device ([n]) */
	ej_tmpl_optim_span *spans;
	int n_spans;
	/* the device copies of the step's and the norm's descriptors, kept
	 * from step to step (cuda) */
	ej_tmpl_optim_table *step_tab, *norm_tab;
	bool dist; /* more than one rank: see ej_optim_dist */
	ej_optim_dist d;
	float *gshard;	 /* stage 2 scratch: the reduced gradient shard */
	float *gather;	 /* all-gather scratch (largest parameter) */
	int64_t *counts; /* per-rank scratch (largest group) */
	int64_t max_numel;
};

/* ---- creation -------------------------------------------------------------
 */

static char *dup_str(const char *s)
{
	size_t n = strlen(s) + 1;
	char *d = malloc(n);
	if (d)
		memcpy(d, s, n);
	return d;
}

static epj_tensor *zeros_like_f32(epj_ctx *ctx, const epj_tensor *t)
{
	return epj_zeros(ctx, EPJ_DTYPE_F32, t->ndim, t->shape);
}

static epj_status add_state(epj_ctx *ctx, ej_optim *o, const char *kind,
			    const char *pname, epj_tensor *t)
{
	size_t len = strlen("optimizer...") + strlen(kind) + strlen(pname) + 1;
	char *name = malloc(len);
	if (!name)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"optim: out of memory naming state of %s",
				pname);
	snprintf(name, len, "optimizer.%s.%s", kind, pname);
	o->state[o->n_state].name = name;
	o->state[o->n_state].t = t;
	o->n_state++;
	return EPJ_OK;
}

/* Validates parameter i; the message names it, its description and the
 * optimizer. */
static epj_status check_param(epj_ctx *ctx, epj_tensor *const *params,
			      const char *const *names, int i)
{
	char d[64];
	const char *nm = names[i];
	epj_tensor *t = params[i];
	if (!t)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"optim: parameter %d (%s) is NULL", i, nm);
	if (!t->storage && !ctx->meta) /* shape-only mode: none expected */
		return ej_error(ctx, EPJ_ERR_STATE,
				"optim: parameter %s %s has no data (symbolic "
				"tensor of trace mode)",
				nm, epj_tensor_describe(t, d, sizeof d));
	if (t->dtype != EPJ_DTYPE_F32 && t->dtype != EPJ_DTYPE_BF16)
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"optim: parameter %s is %s: only f32 and bf16 "
				"parameters are supported",
				nm, epj_tensor_describe(t, d, sizeof d));
	if (t->dtype == EPJ_DTYPE_F32 && !ej_is_contiguous(t))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"optim: f32 parameter %s %s is not contiguous "
				"(its master is the parameter itself, updated "
				"by flat loops)",
				nm, epj_tensor_describe(t, d, sizeof d));
	for (int j = 0; j < i; j++) {
		if (params[j] == t)
			return ej_error(
			    ctx, EPJ_ERR_INVALID,
			    "optim: parameter %s is the same tensor "
			    "as parameter %s",
			    nm, names[j]);
		if (strcmp(names[j], nm) == 0)
			return ej_error(ctx, EPJ_ERR_INVALID,
					"optim: parameters %d and %d are both "
					"named \"%s\"",
					j, i, nm);
	}
	return EPJ_OK;
}

/* The master shard of p from the parameter's values [lo, hi). */
static epj_status master_from_param(epj_ctx *ctx, opt_param *p)
{
	epj_tensor *t = p->param;
	epj_tensor *full =
	    ej_tensor_alloc(ctx, EPJ_DTYPE_F32, t->ndim, t->shape, false);
	epj_status st = full ? epj_tensor_copy_(ctx, full, t) : EPJ_ERR_NOMEM;
	if (st == EPJ_OK) /* device memory on cuda (a copy that says so) */
		ctx->dev->copy(ctx->dev->self, ej_data(p->master),
			       (float *)ej_data(full) + p->lo,
			       sizeof(float) * (size_t)(p->hi - p->lo));
	epj_tensor_free(full);
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "optim: master shard of %s", p->name);
		return ctx->status != EPJ_OK ? ctx->status : st;
	}
	return EPJ_OK;
}

/* Optimizer state of p: shaped like the parameter, or its 1-D shard. */
static epj_tensor *state_zeros(epj_ctx *ctx, const opt_param *p,
			       const epj_tensor *t, int64_t len)
{
	return p->sharded ? epj_zeros(ctx, EPJ_DTYPE_F32, 1, &len)
			  : zeros_like_f32(ctx, t);
}

static epj_status init_param(epj_ctx *ctx, ej_optim *o, opt_param *p,
			     epj_tensor *t, const char *name)
{
	p->name = dup_str(name);
	if (!p->name)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"optim: out of memory for parameter %s", name);
	p->param = epj_tensor_ref(t);
	p->numel = ej_numel(t->ndim, t->shape);
	if (!p->sharded) {
		p->lo = 0;
		p->hi = p->numel;
	}
	if (!o->dist) {
		p->nlo = 0;
		p->nhi = p->numel;
	}
	epj_status st;
	if (p->sharded) {
		/* master = this rank's partition of the flat parameter */
		int64_t len = p->hi - p->lo;
		p->master = epj_zeros(ctx, EPJ_DTYPE_F32, 1, &len);
		if (t->dtype != EPJ_DTYPE_F32)
			p->mgrad = zeros_like_f32(ctx, t);
		if (!p->master || (t->dtype != EPJ_DTYPE_F32 && !p->mgrad))
			goto fail;
		if ((st = master_from_param(ctx, p)) != EPJ_OK)
			return st;
		if ((st = add_state(ctx, o, "master_shard", name, p->master)))
			return st;
	} else if (t->dtype == EPJ_DTYPE_F32) {
		p->master = epj_tensor_ref(t);
	} else {
		p->master = zeros_like_f32(ctx, t);
		p->mgrad = zeros_like_f32(ctx, t);
		if (!p->master || !p->mgrad)
			goto fail;
		if ((st = epj_tensor_copy_(ctx, p->master, t)) != EPJ_OK)
			goto fail;
		if ((st = add_state(ctx, o, "master", name, p->master)))
			return st;
	}
	int64_t slen = p->hi - p->lo;
	if (o->type == EJ_OPTIM_SGD) {
		if (o->momentum > 0) {
			if (!(p->s1 = state_zeros(ctx, p, t, slen)))
				goto fail;
			if ((st = add_state(ctx, o, "momentum", name, p->s1)))
				return st;
		}
	} else {
		p->s1 = state_zeros(ctx, p, t, slen);
		p->s2 = state_zeros(ctx, p, t, slen);
		if (!p->s1 || !p->s2)
			goto fail;
		if ((st = add_state(ctx, o, "exp_avg", name, p->s1)) ||
		    (st = add_state(ctx, o, "exp_avg_sq", name, p->s2)))
			return st;
	}
	return EPJ_OK;
fail:
	ej_error_prefix(ctx, "optim: state of parameter %s", name);
	return ctx->status != EPJ_OK ? ctx->status : EPJ_ERR_NOMEM;
}

ej_optim *ej_optim_new(epj_ctx *ctx, const ej_config *cfg,
		       epj_tensor *const *params, const char *const *names,
		       int n)
{
	return ej_optim_new_dist(ctx, cfg, params, names, n, NULL);
}

/* This rank's partition [lo, hi) of n elements over a group of G ranks. */
static void partition(int64_t n, int G, int g, int64_t *lo, int64_t *hi)
{
	int64_t chunk = (n + G - 1) / G;
	int64_t a = (int64_t)g * chunk;
	*lo = a < n ? a : n;
	*hi = a + chunk < n ? a + chunk : n;
}

ej_optim *ej_optim_new_dist(epj_ctx *ctx, const ej_config *cfg,
			    epj_tensor *const *params, const char *const *names,
			    int n, const ej_optim_dist *d)
{
	if (!cfg || n < 0 || (n > 0 && (!params || !names))) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "optim: bad arguments (cfg %p, params %p, names %p, "
			 "n %d)",
			 (const void *)cfg, (const void *)params,
			 (const void *)names, n);
		return NULL;
	}
	for (int i = 0; i < n; i++) {
		if (!names[i]) {
			ej_error(ctx, EPJ_ERR_INVALID,
				 "optim: parameter %d has no name", i);
			return NULL;
		}
		if (check_param(ctx, params, names, i) != EPJ_OK)
			return NULL;
	}
	const struct ej_optimizer_config *oc = &cfg->optimizer;
	ej_optim *o = calloc(1, sizeof *o);
	if (!o) {
		ej_error(ctx, EPJ_ERR_NOMEM, "optim: out of memory");
		return NULL;
	}
	o->ctx = ctx;
	o->type = oc->type;
	o->momentum = oc->momentum;
	o->nesterov = oc->nesterov;
	o->beta1 = oc->betas[0];
	o->beta2 = oc->betas[1];
	o->eps = oc->eps;
	o->wd = oc->weight_decay;
	o->decoupled = oc->type == EJ_OPTIM_ADAMW ||
		       (oc->type == EJ_OPTIM_ADAM && oc->adam_w_mode);
	o->clip = cfg->gradient_clipping;
	o->n = n;
	int64_t max_chunks = 1;
	for (int i = 0; i < n; i++) {
		int64_t c = (ej_numel(params[i]->ndim, params[i]->shape) +
			     NORM_CHUNK - 1) /
			    NORM_CHUNK;
		if (c > max_chunks)
			max_chunks = c;
	}
	o->p = calloc((size_t)(n > 0 ? n : 1), sizeof *o->p);
	/* At most 3 state tensors per parameter (master + 2 moments). */
	o->state = calloc((size_t)(n > 0 ? 3 * n : 1), sizeof *o->state);
	o->partial = malloc(sizeof *o->partial * (size_t)max_chunks);
	o->spans = malloc(sizeof *o->spans * (size_t)(n > 0 ? n : 1));
	if (!ctx->dev->host_visible) {
		o->step_tab = ej_tmpl_optim_table_new(ctx, n);
		o->norm_tab = ej_tmpl_optim_table_new(ctx, n);
		if (!o->step_tab || !o->norm_tab) {
			ej_optim_free(o);
			return NULL;
		}
	}
	if (!o->p || !o->state || !o->partial || !o->spans) {
		ej_error(ctx, EPJ_ERR_NOMEM,
			 "optim: out of memory for %d "
			 "parameters",
			 n);
		ej_optim_free(o);
		return NULL;
	}
	const bool dev_mem = !ctx->dev->host_visible;
	if (d && d->world && d->world->size > 1) {
		o->dist = true;
		o->d = *d;
		o->d.expert = NULL; /* not kept */
		int gmax = d->world->size;
		for (int i = 0; i < n; i++) {
			opt_param *p = &o->p[i];
			bool ex = d->expert && d->expert[i];
			p->group = ex ? d->edp : d->dp;
			p->dgroup = !dev_mem || p->group->size == 1 ? NULL
				    : ex			    ? d->dev_edp
								    : d->dev_dp;
			if (dev_mem && p->group->size > 1 && !p->dgroup) {
				ej_error(ctx, EPJ_ERR_UNSUPPORTED,
					 "optim: %d ranks on the %s device: "
					 "the gradients of %s (group %s of %d "
					 "ranks) are device memory and need "
					 "a device communicator (comm.backend "
					 "\"nccl\")",
					 d->world->size, ctx->dev->name,
					 names[i], ex ? "edp" : "dp",
					 p->group->size);
				ej_optim_free(o);
				return NULL;
			}
			EJ_ASSERT(!p->dgroup ||
				  (p->dgroup->size == p->group->size &&
				   p->dgroup->rank == p->group->rank));
			int64_t ne =
			    ej_numel(params[i]->ndim, params[i]->shape);
			if (ne > o->max_numel)
				o->max_numel = ne;
			partition(ne, p->group->size, p->group->rank, &p->nlo,
				  &p->nhi);
			p->sharded = d->zero_stage >= 1 && p->group->size > 1;
			p->lo = p->nlo;
			p->hi = p->nhi;
		}
		o->gshard = malloc(sizeof(float) * (size_t)(o->max_numel + 1));
		o->gather = malloc(sizeof(float) * (size_t)(o->max_numel + 1));
		o->counts = malloc(sizeof(int64_t) * (size_t)gmax);
		if (!o->gshard || !o->gather || !o->counts) {
			ej_error(ctx, EPJ_ERR_NOMEM, "optim: out of memory");
			ej_optim_free(o);
			return NULL;
		}
	}
	for (int i = 0; i < n; i++) {
		if (init_param(ctx, o, &o->p[i], params[i], names[i]) !=
		    EPJ_OK) {
			ej_optim_free(o);
			return NULL;
		}
	}
	return o;
}

void ej_optim_free(ej_optim *o)
{
	if (!o)
		return;
	for (int i = 0; o->p && i < o->n; i++) {
		opt_param *p = &o->p[i];
		free(p->name);
		epj_tensor_free(p->param);
		epj_tensor_free(p->master);
		epj_tensor_free(p->mgrad);
		epj_tensor_free(p->s1);
		epj_tensor_free(p->s2);
	}
	for (int i = 0; i < o->n_state; i++)
		free(o->state[i].name);
	free(o->p);
	free(o->state);
	free(o->partial);
	free(o->spans);
	ej_tmpl_optim_table_free(o->ctx, o->step_tab);
	ej_tmpl_optim_table_free(o->ctx, o->norm_tab);
	free(o->gshard);
	free(o->gather);
	free(o->counts);
	free(o);
}

int ej_optim_num_params(const ej_optim *o)
{
	return o->n;
}

epj_tensor *ej_optim_param(const ej_optim *o, int i)
{
	EJ_ASSERT(i >= 0 && i < o->n);
	return o->p[i].param;
}

epj_tensor *ej_optim_master(const ej_optim *o, int i)
{
	EJ_ASSERT(i >= 0 && i < o->n);
	return o->p[i].master;
}

/* ---- gradients ------------------------------------------------------------
 */

/* The .grad of p's parameter, checked and made contiguous in place (a
 * gradient set by hand may be a strided view); NULL when there is none, or
 * on error (*st set). */
static epj_tensor *param_grad(epj_ctx *ctx, opt_param *p, epj_status *st)
{
	*st = EPJ_OK;
	epj_tensor *g = p->param->grad;
	if (!g)
		return NULL;
	char gd[64], pd[64];
	if (g->dtype != p->param->dtype || !g->storage ||
	    g->ndim != p->param->ndim ||
	    memcmp(g->shape, p->param->shape, sizeof(int64_t) * g->ndim)) {
		*st = ej_error(ctx, EPJ_ERR_SHAPE,
			       "optim: gradient %s of parameter %s %s does not "
			       "match it",
			       epj_tensor_describe(g, gd, sizeof gd), p->name,
			       epj_tensor_describe(p->param, pd, sizeof pd));
		return NULL;
	}
	if (ej_is_contiguous(g))
		return g;
	epj_tensor *c =
	    ej_tensor_alloc(ctx, g->dtype, g->ndim, g->shape, false);
	if (!c || (*st = epj_tensor_copy_(ctx, c, g)) != EPJ_OK) {
		epj_tensor_free(c);
		ej_error_prefix(ctx, "optim: gradient of %s", p->name);
		*st = ctx->status != EPJ_OK ? ctx->status : EPJ_ERR_NOMEM;
		return NULL;
	}
	epj_tensor_set_grad(p->param, c); /* takes its own reference */
	epj_tensor_free(c);
	return p->param->grad;
}

/* mgrad += f32(g) with eager ops on the context's device.  The first
 * gradient since the last step (mgrad is zero then) is converted into
 * mgrad by one cast kernel instead of a cast, an add and a copy. */
static epj_status accumulate_ops(epj_ctx *ctx, opt_param *p, epj_tensor *g)
{
	if (!p->has_grad) {
		epj_tensor *gv =
		    epj_reshape(ctx, g, p->mgrad->ndim, p->mgrad->shape);
		ej_attrs at = ej_attrs_none();
		ej_attrs_push_i(&at, (int64_t)EPJ_DTYPE_F32);
		epj_status st = gv ? ej_dispatch_into(ctx, EJ_OP_CAST, &gv, 1,
						      &at, p->mgrad)
				   : epj_ctx_status(ctx);
		epj_tensor_free(gv);
		if (st != EPJ_OK)
			ej_error_prefix(ctx, "optim: gradient of %s", p->name);
		return st;
	}
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *gf = epj_cast(ctx, g, EPJ_DTYPE_F32);
	epj_tensor *gv =
	    gf ? epj_reshape(ctx, gf, p->mgrad->ndim, p->mgrad->shape) : NULL;
	epj_tensor *sum = gv ? epj_add(ctx, p->mgrad, gv) : NULL;
	epj_status st =
	    sum ? epj_tensor_copy_(ctx, p->mgrad, sum) : epj_ctx_status(ctx);
	epj_tensor_free(gf);
	epj_tensor_free(gv);
	epj_tensor_free(sum);
	epj_no_grad_exit(ctx, prev);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "optim: gradient of %s", p->name);
	return st;
}

epj_status ej_optim_accumulate(ej_optim *o)
{
	for (int i = 0; i < o->n; i++) {
		opt_param *p = &o->p[i];
		if (!p->mgrad)
			continue; /* f32: autograd accumulates into .grad */
		epj_status st;
		epj_tensor *g = param_grad(o->ctx, p, &st);
		if (st != EPJ_OK)
			return st;
		if (!g)
			continue;
		if (!o->ctx->dev->host_visible) {
			/* device memory: mgrad += f32(g) as eager kernels
			 * (the same f32 additions as the loop below) */
			if ((st = accumulate_ops(o->ctx, p, g)) != EPJ_OK)
				return st;
			p->has_grad = true;
			epj_tensor_zero_grad(p->param);
			continue;
		}
		const uint16_t *src = ej_data(g);
		float *acc = ej_data(p->mgrad);
		int64_t n = p->numel;
#pragma omp parallel for if (n >= PAR_MIN) schedule(static)
		for (int64_t k = 0; k < n; k++)
			acc[k] += ej_bf16_load(src[k]);
		p->has_grad = true;
		epj_tensor_zero_grad(p->param);
	}
	return EPJ_OK;
}

/* The accumulated f32 gradient data of parameter p, NULL when it has none
 * (or on error: *st set). */
static epj_tensor *acc_grad(ej_optim *o, opt_param *p, epj_status *st)
{
	*st = EPJ_OK;
	if (p->mgrad)
		return p->has_grad ? p->mgrad : NULL;
	return param_grad(o->ctx, p, st);
}

epj_tensor *ej_optim_grad(ej_optim *o, int i, bool create)
{
	EJ_ASSERT(i >= 0 && i < o->n);
	opt_param *p = &o->p[i];
	epj_status st;
	epj_tensor *g = acc_grad(o, p, &st);
	if (g || st != EPJ_OK || !create)
		return g;
	if (p->mgrad) {
		p->has_grad = true; /* mgrad is zero between steps */
		return p->mgrad;
	}
	epj_tensor *z = zeros_like_f32(o->ctx, p->param);
	if (!z) {
		ej_error_prefix(o->ctx, "optim: gradient of %s", p->name);
		return NULL;
	}
	epj_tensor_set_grad(p->param, z);
	epj_tensor_free(z);
	return p->param->grad;
}

/* Sum of squares of x[0..n) in double: fixed chunks summed in parallel, the
 * chunk sums then added in order, so the result does not depend on the
 * thread count.  Inside a chunk NORM_LANES running sums take every
 * NORM_LANES-th element and are added in lane order at the chunk's end (a
 * vectorizable order, fixed by the chunk alone): against one running sum
 * the result moves by rounding only, a relative 1e-16 * NORM_CHUNK at most
 * for squares, which are all non-negative. */
EJ_ISA_CLONES static void sum_sq_chunks(double *partial, const float *x,
					int64_t n, int64_t nch)
{
#pragma omp parallel for if (n >= PAR_MIN) schedule(static)
	for (int64_t c = 0; c < nch; c++) {
		int64_t lo = c * NORM_CHUNK;
		int64_t hi = lo + NORM_CHUNK < n ? lo + NORM_CHUNK : n;
		double lane[NORM_LANES] = { 0 };
		int64_t k = lo;
		for (; k + NORM_LANES <= hi; k += NORM_LANES)
			for (int j = 0; j < NORM_LANES; j++)
				lane[j] += (double)x[k + j] * x[k + j];
		double s = 0;
		for (int j = 0; j < NORM_LANES; j++)
			s += lane[j];
		for (; k < hi; k++)
			s += (double)x[k] * x[k];
		partial[c] = s;
	}
}

static double sum_sq(double *partial, const float *x, int64_t n)
{
	int64_t nch = (n + NORM_CHUNK - 1) / NORM_CHUNK;
	sum_sq_chunks(partial, x, n, nch);
	double s = 0;
	for (int64_t c = 0; c < nch; c++)
		s += partial[c];
	return s;
}

/* ---- update kernels -------------------------------------------------------
 * p: master [n]; g: accumulated gradient [n], multiplied by gs (grad_scale
 * times the clipping factor) on the fly; s1/s2: state.  All f32, contiguous.
 * bf: NULL, or the bf16 model copy [n] of the master, written block by
 * block right after the block's update (rounded as epj_tensor_copy_
 * rounds), while the block is still in cache.
 *
 * The update loops are SIMD loops (omp simd; the AVX2 clone on x86-64) in
 * double: each lane computes exactly what the scalar loop computes (no
 * contraction: the clones enable no FMA; sqrt and division are correctly
 * rounded), so the bits do not depend on the vector width.  The library is
 * built with -fno-math-errno so that sqrt is an instruction, not a call
 * that may set errno, which is what lets these loops vectorize.
 */

#define UPDATE_BLOCK 4096 /* elements per update block (bf16 copy) */

EJ_ISA_CLONES static void sgd_block(float *restrict p, const float *restrict g,
				    float *restrict b, int64_t n, double lr,
				    double gs, double wd, double mom,
				    bool nesterov)
{
	if (b) {
#pragma omp simd
		for (int64_t k = 0; k < n; k++) {
			double pk = p[k];
			double gk = gs * g[k] + wd * pk;
			double bk = mom * b[k] + gk;
			b[k] = (float)bk;
			gk = nesterov ? gk + mom * bk : bk;
			p[k] = (float)(pk - lr * gk);
		}
	} else {
#pragma omp simd
		for (int64_t k = 0; k < n; k++) {
			double pk = p[k];
			double gk = gs * g[k] + wd * pk;
			p[k] = (float)(pk - lr * gk);
		}
	}
}

static void sgd_kernel(const ej_optim *o, float *restrict p,
		       const float *restrict g, float *restrict b, int64_t n,
		       double lr, double gs, uint16_t *restrict bf)
{
	const double wd = o->wd, mom = o->momentum;
	const bool nesterov = o->nesterov;
	const int64_t nb = (n + UPDATE_BLOCK - 1) / UPDATE_BLOCK;
#pragma omp parallel for if (n >= PAR_MIN) schedule(static)
	for (int64_t i = 0; i < nb; i++) {
		int64_t lo = i * UPDATE_BLOCK;
		int64_t len = n - lo < UPDATE_BLOCK ? n - lo : UPDATE_BLOCK;
		sgd_block(p + lo, g + lo, b ? b + lo : NULL, len, lr, gs, wd,
			  mom, nesterov);
		if (bf)
			ej_cvt_f32_to_bf16(p + lo, bf + lo, len);
	}
}

typedef struct adam_coef {
	double b1, b2, eps, l2, decay, bc2_sqrt, step_size;
} adam_coef;

EJ_ISA_CLONES static void adam_block(float *restrict p, const float *restrict g,
				     float *restrict m, float *restrict v,
				     int64_t n, double gs, const adam_coef *c)
{
	const double b1 = c->b1, b2 = c->b2, eps = c->eps, l2 = c->l2;
	const double decay = c->decay, bc2_sqrt = c->bc2_sqrt;
	const double step_size = c->step_size;
#pragma omp simd
	for (int64_t k = 0; k < n; k++) {
		double pk = p[k];
		double gk = gs * g[k] + l2 * pk;
		double mk = b1 * m[k] + (1.0 - b1) * gk;
		double vk = b2 * v[k] + (1.0 - b2) * gk * gk;
		m[k] = (float)mk;
		v[k] = (float)vk;
		double denom = sqrt(vk) / bc2_sqrt + eps;
		p[k] = (float)(pk * decay - step_size * mk / denom);
	}
}

static void adam_kernel(const ej_optim *o, float *restrict p,
			const float *restrict g, float *restrict m,
			float *restrict v, int64_t n, double lr, double gs,
			int64_t t, uint16_t *restrict bf)
{
	const double b1 = o->beta1, b2 = o->beta2;
	const adam_coef c = {
		.b1 = b1,
		.b2 = b2,
		.eps = o->eps,
		.l2 = o->decoupled ? 0.0 : o->wd,
		.decay = o->decoupled ? 1.0 - lr * o->wd : 1.0,
		.bc2_sqrt = sqrt(1.0 - pow(b2, (double)t)),
		.step_size = lr / (1.0 - pow(b1, (double)t)),
	};
	const int64_t nb = (n + UPDATE_BLOCK - 1) / UPDATE_BLOCK;
#pragma omp parallel for if (n >= PAR_MIN) schedule(static)
	for (int64_t i = 0; i < nb; i++) {
		int64_t lo = i * UPDATE_BLOCK;
		int64_t len = n - lo < UPDATE_BLOCK ? n - lo : UPDATE_BLOCK;
		adam_block(p + lo, g + lo, m + lo, v + lo, len, gs, &c);
		if (bf)
			ej_cvt_f32_to_bf16(p + lo, bf + lo, len);
	}
}

/* ---- step -----------------------------------------------------------------
 */

static epj_status clear_grads(ej_optim *o)
{
	for (int i = 0; i < o->n; i++) {
		opt_param *p = &o->p[i];
		epj_tensor_zero_grad(p->param);
		if (p->mgrad && p->has_grad && o->ctx->dev->host_visible)
			memset(ej_data(p->mgrad), 0,
			       sizeof(float) * (size_t)p->numel);
		else if (p->mgrad && p->has_grad)
			o->ctx->dev->memzero(o->ctx->dev->self,
					     ej_data(p->mgrad),
					     sizeof(float) * (size_t)p->numel);
		p->has_grad = false;
	}
	return EPJ_OK;
}

/* Per-rank element counts of p's partition over its group (o->counts). */
static const int64_t *part_counts(ej_optim *o, const opt_param *p)
{
	int G = p->group->size;
	for (int g = 0; g < G; g++) {
		int64_t lo, hi;
		partition(p->numel, G, g, &lo, &hi);
		o->counts[g] = hi - lo;
	}
	return o->counts;
}

/* The summed gradient of p that this rank updates with, and its length:
 * stage 2 (sharded) reduce-scatters into o->gshard (valid until the next
 * parameter), else the full gradient is all-reduced in place; with one
 * rank in the group nothing moves. */
static epj_status reduce_grad(ej_optim *o, opt_param *p, epj_tensor *g,
			      const float **gd)
{
	epj_ctx *ctx = o->ctx;
	float *full = ej_data(g);
	epj_status st = EPJ_OK;
	char what[48];
	snprintf(what, sizeof what, "zero%d.%s", o->d.zero_stage,
		 p->sharded && o->d.zero_stage >= 2 ? "reduce_scatter"
						    : "all_reduce");
	/* device memory: the same collectives over the group's device
	 * counterpart, on the compute stream */
	ej_comm *c = p->dgroup ? p->dgroup : p->group;
	if (p->group->size == 1) {
		*gd = full;
	} else if (p->sharded && o->d.zero_stage >= 2 && p->dgroup) {
		/* the shard lands in a device buffer, then at its offset in
		 * the full gradient (stream-ordered copy) */
		int64_t len = p->hi - p->lo;
		epj_tensor *sh =
		    ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 1, &len, false);
		st = sh ? ej_comm_reduce_scatter(ctx, c, what, full,
						 ej_data(sh), part_counts(o, p))
			: epj_ctx_status(ctx);
		if (st == EPJ_OK && len)
			ctx->dev->copy(ctx->dev->self, full + p->lo,
				       ej_data(sh),
				       sizeof(float) * (size_t)len);
		epj_tensor_free(sh);
		*gd = full + p->lo;
	} else if (p->sharded && o->d.zero_stage >= 2) {
		st = ej_comm_reduce_scatter(ctx, c, what, full, o->gshard,
					    part_counts(o, p));
		*gd = o->gshard;
	} else {
		st = ej_comm_allreduce(ctx, c, what, full, p->numel);
		*gd = p->sharded ? full + p->lo : full;
	}
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "optim step: gradient of %s", p->name);
	return st;
}

/* dst = src cast to dst's dtype (same shape).  In device memory the cast
 * is an eager kernel, so that the copy that follows has one dtype and
 * stays on the device when dst is contiguous (epj_tensor_copy_ between
 * dtypes goes through host copies of both). */
static epj_status cast_into(epj_ctx *ctx, epj_tensor *dst,
			    const epj_tensor *src)
{
	if (ctx->dev->host_visible || dst->dtype == src->dtype)
		return epj_tensor_copy_(ctx, dst, src);
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *c = epj_cast(ctx, (epj_tensor *)src, dst->dtype);
	epj_no_grad_exit(ctx, prev);
	epj_status st = c ? epj_tensor_copy_(ctx, dst, c) : epj_ctx_status(ctx);
	epj_tensor_free(c);
	return st;
}

/* The update writes p's parameter itself (the template's model copy, or
 * the bf argument of the CPU kernels): an unsharded bf16 parameter stored
 * densely.  Anything else is refreshed from its master after the update. */
static bool update_writes_param(const opt_param *p)
{
	return !p->sharded && p->master != p->param &&
	       p->param->dtype == EPJ_DTYPE_BF16 &&
	       ej_is_contiguous(p->param) && p->hi - p->lo == p->numel;
}

/* After the update: the parameter from its (partitioned) master. */
static epj_status refresh_param(ej_optim *o, opt_param *p)
{
	epj_ctx *ctx = o->ctx;
	epj_status st = EPJ_OK;
	if (p->sharded && p->dgroup) {
		/* device memory: the shards gathered over the device group,
		 * into the parameter itself (f32) or a device buffer cast
		 * into it */
		epj_tensor *t = p->param;
		bool direct = t->dtype == EPJ_DTYPE_F32 && ej_is_contiguous(t);
		epj_tensor *full =
		    direct ? NULL
			   : ej_tensor_alloc(ctx, EPJ_DTYPE_F32, t->ndim,
					     t->shape, false);
		if (!direct && !full)
			st = epj_ctx_status(ctx);
		if (st == EPJ_OK)
			st = ej_comm_allgather(
			    ctx, p->dgroup, "zero.all_gather",
			    ej_data(p->master), ej_data(direct ? t : full),
			    part_counts(o, p), sizeof(float));
		if (st == EPJ_OK && !direct)
			st = cast_into(ctx, t, full);
		epj_tensor_free(full);
	} else if (p->sharded) {
		epj_tensor *t = p->param;
		bool direct = t->dtype == EPJ_DTYPE_F32 && ej_is_contiguous(t);
		float *dst = direct ? ej_data(t) : o->gather;
		st = ej_comm_allgather(ctx, p->group, "zero.all_gather",
				       ej_data(p->master), dst,
				       part_counts(o, p), sizeof(float));
		if (st == EPJ_OK && !direct) {
			epj_tensor *full = epj_tensor_from_data(
			    ctx, EPJ_DTYPE_F32, t->ndim, t->shape, o->gather);
			st = full ? epj_tensor_copy_(ctx, t, full)
				  : epj_ctx_status(ctx);
			epj_tensor_free(full);
		}
	} else if (p->master != p->param) {
		st = cast_into(ctx, p->param, p->master);
	}
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "optim step: parameter %s", p->name);
	return st;
}

/* Sum over the world of x (a double carried as two floats, so that the
 * sum keeps about double precision). */
static epj_status world_sum(ej_optim *o, double *x)
{
	float hl[2];
	hl[0] = (float)*x;
	hl[1] = (float)(*x - (double)hl[0]);
	epj_status st =
	    ej_comm_allreduce(o->ctx, o->d.world, "optim.grad_norm", hl, 2);
	if (st == EPJ_OK)
		*x = (double)hl[0] + (double)hl[1];
	return st;
}

/* The update of every parameter that has a gradient as one multi-tensor
 * launch of templates/optim.cuh on the context's CUDA device (the formulas
 * and operation order of the kernels above). */
static epj_status device_update(ej_optim *o, double lr, double gs, int64_t t)
{
	epj_ctx *ctx = o->ctx;
	ej_tmpl_optim_tensor *d =
	    calloc((size_t)(o->n > 0 ? o->n : 1), sizeof *d);
	if (!d)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"optim step: out of memory");
	int n = 0;
	epj_status st = EPJ_OK;
	for (int i = 0; i < o->n && st == EPJ_OK; i++) {
		opt_param *p = &o->p[i];
		epj_tensor *g = acc_grad(o, p, &st);
		if (!g)
			continue;
		d[n].master = ej_data(p->master);
		d[n].grad = (const float *)ej_data(g) + p->lo;
		d[n].s1 = p->s1 ? ej_data(p->s1) : NULL;
		d[n].s2 = o->type == EJ_OPTIM_SGD ? NULL : ej_data(p->s2);
		/* the bf16 parameter written in the same pass (rounded as
		 * the CPU kernels round), with no cast afterwards */
		d[n].model = update_writes_param(p) ? ej_data(p->param) : NULL;
		d[n].n = p->hi - p->lo;
		n++;
	}
	ej_tmpl_optim hp = { .adam = o->type != EJ_OPTIM_SGD,
			     .decoupled = o->decoupled,
			     .nesterov = o->nesterov,
			     .lr = lr,
			     .grad_scale = gs,
			     .weight_decay = o->wd,
			     .momentum = o->momentum,
			     .beta1 = o->beta1,
			     .beta2 = o->beta2,
			     .eps = o->eps,
			     .step = t,
			     .grad_dtype = EPJ_DTYPE_F32,
			     .model_dtype = EPJ_DTYPE_BF16 };
	if (st == EPJ_OK)
		st = ej_tmpl_optim_step(ctx, ctx->dev->name, &hp, d, n,
					o->step_tab);
	free(d);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "optim step on %s", ctx->dev->name);
	else
		epj_counter_add(ctx, "optim.steps.device", 1);
	return st;
}

/* Device memory: elements [lo, lo + n) of g (f32, contiguous) join the
 * spans whose squares device_sum_sq sums. */
static void span_add(ej_optim *o, const epj_tensor *g, int64_t lo, int64_t n)
{
	EJ_ASSERT(o->n_spans < o->n);
	o->spans[o->n_spans].grad = (const float *)ej_data(g) + lo;
	o->spans[o->n_spans].n = n;
	o->n_spans++;
}

/* *ss += the sum of squares of the spans, summed on the device by the
 * optimizer template (templates/optim.cuh): no gradient leaves the device,
 * one double comes back. */
static epj_status device_sum_sq(ej_optim *o, double *ss)
{
	epj_ctx *ctx = o->ctx;
	double part = 0;
	epj_status st =
	    ej_tmpl_optim_sumsq(ctx, ctx->dev->name, EPJ_DTYPE_F32, o->spans,
				o->n_spans, o->norm_tab, &part);
	o->n_spans = 0;
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "optim step: gradient norm on %s",
				ctx->dev->name);
		return st;
	}
	*ss += part;
	epj_counter_add(ctx, "optim.grad_norm.device", 1);
	return EPJ_OK;
}

epj_status ej_optim_step(ej_optim *o, double lr, double grad_scale,
			 double *grad_norm_out)
{
	epj_ctx *ctx = o->ctx;
	if (!(lr >= 0) || !isfinite(lr) || !isfinite(grad_scale))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"optim step: lr %g must be finite and >= 0, "
				"grad_scale %g finite",
				lr, grad_scale);
	/* the update writes the parameters: their f32 views (lib/wcache.c)
	 * are stale from here on */
	ej_params_written(ctx);
	epj_status st = ej_optim_accumulate(o);
	if (st != EPJ_OK)
		return st;
	if (o->dist)
		grad_scale *= o->d.grad_scale;

	/* Data parallelism: sum every gradient over its group first (every
	 * parameter has one on every rank: replicas decide alike). */
	if (o->dist) {
		for (int i = 0; i < o->n; i++) {
			if (!ej_optim_grad(o, i, true))
				return epj_ctx_status(ctx);
		}
	}

	/* Global norm of grad_scale * g over every parameter with a grad;
	 * with several ranks each rank sums its partition and the sums are
	 * added over the world.  Stage 2 reduces (and updates) parameter by
	 * parameter below, so its norm comes from the shards. */
	double ss = 0;
	const bool rs = o->dist && o->d.zero_stage >= 2;
	const bool dev_mem = !ctx->dev->host_visible;
	o->n_spans = 0;
	for (int i = 0; i < o->n && !rs; i++) {
		opt_param *p = &o->p[i];
		epj_tensor *g = acc_grad(o, p, &st);
		if (st != EPJ_OK)
			return st;
		if (!g)
			continue;
		const float *gd = ej_data(g);
		if (dev_mem) {
			/* device memory: summed over the device group; the
			 * squares of this rank's partition (the whole
			 * gradient on one rank) are summed on the device */
			if (o->dist &&
			    (st = reduce_grad(o, p, g, &gd)) != EPJ_OK)
				return st;
			span_add(o, g, p->nlo, p->nhi - p->nlo);
			continue;
		}
		if (o->dist && (st = reduce_grad(o, p, g, &gd)) != EPJ_OK)
			return st;
		if (o->dist) /* gd points at the shard when sharded */
			ss += sum_sq(o->partial,
				     (const float *)ej_data(g) + p->nlo,
				     p->nhi - p->nlo);
		else
			ss += sum_sq(o->partial, gd, p->numel);
	}
	/* Stage 2: reduce-scatter into per-parameter shards kept in the
	 * full gradient buffer at the shard's offset (the rest is stale). */
	for (int i = 0; i < o->n && rs; i++) {
		opt_param *p = &o->p[i];
		epj_tensor *g = acc_grad(o, p, &st);
		if (st != EPJ_OK)
			return st;
		const float *gd;
		if ((st = reduce_grad(o, p, g, &gd)) != EPJ_OK)
			return st;
		float *full = ej_data(g);
		if (dev_mem) {
			/* reduce_grad put the shard in place on the device */
			EJ_ASSERT(gd == full + p->lo);
			span_add(o, g, p->nlo, p->nhi - p->nlo);
			continue;
		}
		if (gd != full + p->lo)
			memmove(full + p->lo, gd,
				sizeof(float) * (size_t)(p->hi - p->lo));
		ss += sum_sq(o->partial, full + p->nlo, p->nhi - p->nlo);
	}
	if (dev_mem && (st = device_sum_sq(o, &ss)) != EPJ_OK)
		return st;
	if (o->dist && (st = world_sum(o, &ss)) != EPJ_OK)
		return st;
	double norm = fabs(grad_scale) * sqrt(ss);
	if (grad_norm_out)
		*grad_norm_out = norm;
	if (!isfinite(norm)) {
		/* nothing applied: the caller fails or skips the step */
		clear_grads(o);
		return EPJ_OK;
	}
	double gs = grad_scale;
	if (o->clip > 0) {
		double coef = o->clip / (norm + 1e-6);
		if (coef < 1)
			gs *= coef;
	}

	const int64_t t = o->steps + 1;
	/* On a cuda-sim or cuda context the update of every parameter with a
	 * gradient is one launch of the optimizer template (the same bits);
	 * the parameters are then refreshed from their masters below. */
	const bool device = ej_dev_runs_cuda(ctx->dev);
	if (device && (st = device_update(o, lr, gs, t)) != EPJ_OK)
		return st;
	for (int i = 0; i < o->n; i++) {
		opt_param *p = &o->p[i];
		epj_tensor *g = acc_grad(o, p, &st);
		if (!g)
			continue; /* no gradient: skipped, as PyTorch does */
		if (device) {
			if (!update_writes_param(p) &&
			    (st = refresh_param(o, p)) != EPJ_OK)
				return st;
			continue;
		}
		float *pm = ej_data(p->master);
		const float *gd = (const float *)ej_data(g) + p->lo;
		int64_t len = p->hi - p->lo;
		/* an unsharded bf16 parameter stored densely gets its copy in
		 * the update pass; anything else is refreshed after it */
		uint16_t *bf =
		    update_writes_param(p) ? ej_data(p->param) : NULL;
		if (o->type == EJ_OPTIM_SGD)
			sgd_kernel(o, pm, gd, p->s1 ? ej_data(p->s1) : NULL,
				   len, lr, gs, bf);
		else
			adam_kernel(o, pm, gd, ej_data(p->s1), ej_data(p->s2),
				    len, lr, gs, t, bf);
		if (!bf && (st = refresh_param(o, p)) != EPJ_OK)
			return st;
	}
	clear_grads(o);
	o->steps = t;
	return EPJ_OK;
}

epj_status ej_optim_drop_grads(ej_optim *o)
{
	epj_status st = ej_optim_accumulate(o);
	if (st == EPJ_OK)
		clear_grads(o);
	return st;
}

int64_t ej_optim_step_count(const ej_optim *o)
{
	return o->steps;
}

void ej_optim_set_step_count(ej_optim *o, int64_t steps)
{
	EJ_ASSERT(steps >= 0);
	o->steps = steps;
}

/* ---- checkpoint state -----------------------------------------------------
 */

int ej_optim_state_count(const ej_optim *o)
{
	return o->n_state;
}

const char *ej_optim_state_name(const ej_optim *o, int i)
{
	EJ_ASSERT(i >= 0 && i < o->n_state);
	return o->state[i].name;
}

epj_tensor *ej_optim_state_tensor(ej_optim *o, int i)
{
	EJ_ASSERT(i >= 0 && i < o->n_state);
	return o->state[i].t;
}

epj_status ej_optim_sync_params(ej_optim *o)
{
	for (int i = 0; i < o->n; i++) {
		opt_param *p = &o->p[i];
		if (p->master == p->param)
			continue;
		epj_status st = refresh_param(o, p);
		if (st != EPJ_OK)
			return st;
	}
	return EPJ_OK;
}

bool ej_optim_sharded(const ej_optim *o, int i, int64_t *lo, int64_t *hi)
{
	EJ_ASSERT(i >= 0 && i < o->n);
	if (lo)
		*lo = o->p[i].lo;
	if (hi)
		*hi = o->p[i].hi;
	return o->p[i].sharded;
}

epj_status ej_optim_master_from_param(ej_optim *o, int i)
{
	EJ_ASSERT(i >= 0 && i < o->n);
	opt_param *p = &o->p[i];
	if (p->sharded)
		return master_from_param(o->ctx, p);
	if (p->master == p->param)
		return EPJ_OK;
	epj_status st = epj_tensor_copy_(o->ctx, p->master, p->param);
	if (st != EPJ_OK)
		ej_error_prefix(o->ctx, "optim: master of %s", p->name);
	return st;
}

epj_status ej_optim_masters_from_params(ej_optim *o)
{
	for (int i = 0; i < o->n; i++) {
		opt_param *p = &o->p[i];
		epj_status st = EPJ_OK;
		if (p->sharded)
			st = master_from_param(o->ctx, p);
		if (st != EPJ_OK)
			return st;
	}
	return EPJ_OK;
}

/* ---- learning-rate schedules ----------------------------------------------
 * Follows deepspeed/runtime/lr_schedules.py: WarmupLR._get_gamma,
 * WarmupDecayLR._get_gamma and WarmupCosineLR.get_lr_ratio, including
 * warmup_num_steps = max(2, warmup_num_steps), the cosine progress clamped
 * to [0, 1] and the values for last_batch_iteration < 0 (get_lr before the
 * scheduler has started). */

/* DeepSpeed's warmup fraction at iteration it (0 <= it < W). */
static double warmup_gamma(ej_warmup_type type, int64_t it, int64_t w)
{
	if (type == EJ_WARMUP_LINEAR)
		return (double)it / (double)w;
	return log((double)it + 1.0) / log((double)w);
}

double ej_sched_lr(const ej_config *cfg, int64_t step)
{
	const struct ej_scheduler_config *s = &cfg->scheduler;
	/* The scheduler steps after the optimizer: optimizer step k runs at
	 * the scheduler's last_batch_iteration of the step before. */
	int64_t it = s->last_batch_iteration + step;
	int64_t w = s->warmup_num_steps > 2 ? s->warmup_num_steps : 2;
	double gamma;
	switch (s->type) {
	case EJ_SCHED_NONE:
		return cfg->optimizer.lr;
	case EJ_SCHED_WARMUP_LR:
	case EJ_SCHED_WARMUP_DECAY_LR:
		if (it < 0)
			return s->warmup_min_lr;
		if (it < w) {
			gamma = warmup_gamma(s->warmup_type, it, w);
		} else if (s->type == EJ_SCHED_WARMUP_LR) {
			gamma = 1.0;
		} else {
			double span = (double)(s->total_num_steps - w);
			gamma = (double)(s->total_num_steps - it) /
				(span > 1.0 ? span : 1.0);
			if (gamma < 0)
				gamma = 0;
		}
		return s->warmup_min_lr +
		       (s->warmup_max_lr - s->warmup_min_lr) * gamma;
	case EJ_SCHED_WARMUP_COSINE_LR: {
		if (it < 0)
			return 0.0;
		double ratio;
		if (it < w) {
			ratio = s->warmup_min_ratio +
				warmup_gamma(s->warmup_type, it, w) *
				    (1.0 - s->warmup_min_ratio);
		} else {
			double real_last = (double)(it - w + 1);
			double real_total = (double)(s->total_num_steps - w);
			if (real_total < 1)
				real_total = 1;
			double prog = real_last / real_total;
			if (prog > 1)
				prog = 1;
			ratio = s->cos_min_ratio +
				(1.0 - s->cos_min_ratio) *
				    (1.0 + cos(M_PI * prog)) / 2.0;
			if (ratio < 0)
				ratio = 0;
		}
		return cfg->optimizer.lr * ratio;
	}
	}
	EJ_ASSERT(!"unknown scheduler type");
	return 0;
}
