/* tmpl_optim.c -- host side of the optimizer template (templates/optim.cuh):
 * the multi-tensor SGD and Adam/AdamW step over FP32 masters and the
 * squared norm of the gradients, with their descriptor tables kept on the
 * device from step to step (kernels.h; runtime/optim.c calls them).
 *
 * Every launch lists its outputs (ej_launch_out) so that cuda-sim poisons
 * them, checks that each element is written and compares two block/thread
 * orders bit for bit.  The step updates in place on cuda; on cuda-sim the
 * inputs are first copied to scratch so that the updated buffers are plain
 * outputs the checks can cover.
 */
#include "kernels.h"

#include "templates/args.h"
#include "tmpl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const ej_tmpl_kernel optim_kernels[] = {
	{ "ej_optim_step", "struct ej_optim_args" },
	{ "ej_optim_sumsq", "struct ej_optim_sumsq_args" },
	{ "ej_optim_sumsq_total", "struct ej_optim_sumsq_args" },
};

#define NK(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* scratch on the module's device; NULL with an error */
static void *dev_alloc(epj_ctx *ctx, ej_tmpl *m, size_t bytes, const char *w)
{
	return ej_tmpl_scratch_alloc(ctx, ej_tmpl_device(m), bytes, w);
}
static void dev_free(epj_ctx *ctx, ej_tmpl *m, void *p)
{
	ej_tmpl_scratch_free(ctx, ej_tmpl_device(m), p);
}

/* Elements per block of the multi-tensor step. */
#define OPTIM_CHUNK 2048

/* The blocks of n elements. */
static int64_t optim_blocks(int64_t n)
{
	return (n + OPTIM_CHUNK - 1) / OPTIM_CHUNK;
}

/* A device copy of a descriptor table, kept from call to call: the host
 * bytes it was made from, and the device block (on dev) that holds them. */
struct ej_tmpl_optim_table {
	const ej_device *dev;
	void *dmem;
	char *host;
	size_t bytes, cap;
};

ej_tmpl_optim_table *ej_tmpl_optim_table_new(epj_ctx *ctx, int n)
{
	ej_tmpl_optim_table *tab = calloc(1, sizeof *tab);
	if (!tab) {
		ej_error(ctx, EPJ_ERR_NOMEM, "optimizer table: out of memory");
		return NULL;
	}
	if (n > 0) { /* reserved now, so a step never allocates it */
		size_t bytes = sizeof(struct ej_optim_tensor) * (size_t)n;
		tab->host = malloc(bytes);
		tab->dmem = tab->host
				? ej_tmpl_scratch_alloc(ctx, ctx->dev, bytes,
							"optimizer table")
				: NULL;
		if (!tab->dmem) {
			if (!tab->host)
				ej_error(ctx, EPJ_ERR_NOMEM,
					 "optimizer table: out of memory");
			free(tab->host);
			free(tab);
			return NULL;
		}
		tab->dev = ctx->dev;
		tab->cap = bytes;
	}
	return tab;
}

void ej_tmpl_optim_table_free(epj_ctx *ctx, ej_tmpl_optim_table *tab)
{
	if (!tab)
		return;
	if (tab->dmem)
		ej_tmpl_scratch_free(ctx, tab->dev, tab->dmem);
	free(tab->host);
	free(tab);
}

/* The device copy of the descriptors hbuf[0..bytes) on m's device: tab's
 * block when it already holds these bytes (nothing is copied), else the
 * bytes copied into it (grown as needed; one H2D copy on the compute
 * stream, after the kernels that read the old table).  tab NULL: a block
 * of this call, which the caller frees (*owned).  NULL with an error. */
static void *optim_table(epj_ctx *ctx, ej_tmpl *m, ej_tmpl_optim_table *tab,
			 const void *hbuf, size_t bytes, const char *what,
			 void **owned)
{
	const ej_device *d = ej_tmpl_device(m);
	*owned = NULL;
	if (!tab) {
		void *p = dev_alloc(ctx, m, bytes, what);
		if (p) {
			d->copy(d->self, p, hbuf, bytes);
			*owned = p;
		}
		return p;
	}
	if (tab->bytes && tab->dev == d && tab->bytes == bytes &&
	    memcmp(tab->host, hbuf, bytes) == 0) {
		epj_counter_add(ctx, "optim.table_reused", 1);
		return tab->dmem;
	}
	if (!tab->dmem || tab->dev != d || tab->cap < bytes) {
		if (tab->dmem)
			ej_tmpl_scratch_free(ctx, tab->dev, tab->dmem);
		tab->dmem = NULL;
		char *h = realloc(tab->host, bytes);
		if (!h) {
			ej_error(ctx, EPJ_ERR_NOMEM, "%s: out of memory", what);
			return NULL;
		}
		tab->host = h;
		tab->dmem = dev_alloc(ctx, m, bytes, what);
		if (!tab->dmem)
			return NULL;
		tab->dev = d;
		tab->cap = bytes;
	}
	memcpy(tab->host, hbuf, bytes);
	tab->bytes = bytes;
	d->copy(d->self, tab->dmem, hbuf, bytes);
	epj_counter_add(ctx, "optim.table_uploads", 1);
	return tab->dmem;
}

/* The optimizer module for a launch over `items` chunks (what: the
 * caller's name for messages); *m is NULL when there is nothing to do. */
static epj_status optim_module(epj_ctx *ctx, const char *device,
			       const char *what, int64_t items, ej_tmpl **m)
{
	*m = NULL;
	if (items == 0)
		return EPJ_OK;
	if (items > 0x7fffffff)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s: %lld blocks of %d elements exceed one "
				"launch",
				what, (long long)items, OPTIM_CHUNK);
	return ej_tmpl_get(ctx, device, "optim", NULL, optim_kernels,
			   NK(optim_kernels), m);
}

static epj_status optim_check(epj_ctx *ctx, const ej_tmpl_optim *o,
			      const ej_tmpl_optim_tensor *t, int n,
			      int64_t *items, int64_t *total)
{
	if ((o->grad_dtype != EPJ_DTYPE_F32 &&
	     o->grad_dtype != EPJ_DTYPE_BF16) ||
	    (o->model_dtype != EPJ_DTYPE_F32 &&
	     o->model_dtype != EPJ_DTYPE_BF16))
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"optimizer step: gradient %s, model copy %s: "
				"expected f32 or bf16 each",
				epj_dtype_name(o->grad_dtype),
				epj_dtype_name(o->model_dtype));
	if (n < 0 || (o->adam && o->step < 1))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"optimizer step: %d tensors, step %lld: "
				"expected n >= 0 and step >= 1",
				n, (long long)o->step);
	*items = *total = 0;
	for (int i = 0; i < n; i++) {
		if (t[i].n < 0 || (t[i].n > 0 && (!t[i].master || !t[i].grad)))
			return ej_error(ctx, EPJ_ERR_INVALID,
					"optimizer step: tensor %d: %lld "
					"elements, master %p, grad %p",
					i, (long long)t[i].n,
					(void *)t[i].master, t[i].grad);
		if (o->adam && t[i].n > 0 && (!t[i].s1 || !t[i].s2))
			return ej_error(ctx, EPJ_ERR_INVALID,
					"optimizer step: tensor %d: Adam "
					"needs exp_avg and exp_avg_sq",
					i);
		*items += optim_blocks(t[i].n);
		*total += t[i].n;
	}
	return EPJ_OK;
}

static void optim_args(struct ej_optim_args *a, const ej_tmpl_optim *o)
{
	a->chunk = OPTIM_CHUNK;
	a->adam = o->adam;
	a->gdt = ej_tmpl_dcode(o->grad_dtype);
	a->mdt = ej_tmpl_dcode(o->model_dtype);
	a->nesterov = o->nesterov;
	a->lr = o->lr;
	a->gs = o->grad_scale;
	a->wd = o->weight_decay;
	a->mom = o->momentum;
	if (o->adam) {
		/* runtime/optim.c, adam_kernel */
		a->b1 = o->beta1;
		a->omb1 = 1.0 - o->beta1;
		a->b2 = o->beta2;
		a->omb2 = 1.0 - o->beta2;
		a->eps = o->eps;
		a->l2 = o->decoupled ? 0.0 : o->weight_decay;
		a->decay = o->decoupled ? 1.0 - o->lr * o->weight_decay : 1.0;
		a->step_size = o->lr / (1.0 - pow(o->beta1, (double)o->step));
		a->bc2_sqrt = sqrt(1.0 - pow(o->beta2, (double)o->step));
	}
}

epj_status ej_tmpl_optim_step(epj_ctx *ctx, const char *device,
			      const ej_tmpl_optim *o,
			      const ej_tmpl_optim_tensor *t, int n,
			      ej_tmpl_optim_table *tab)
{
	int64_t items = 0, total = 0;
	epj_status st = optim_check(ctx, o, t, n, &items, &total);
	if (st != EPJ_OK)
		return st;
	ej_tmpl *m;
	st = optim_module(ctx, device, "optimizer step", items, &m);
	if (st != EPJ_OK || !m)
		return st;
	const ej_device *d = ej_tmpl_device(m);
	const bool sim = ej_dev_reruns_grids(d);
	/* the descriptors (kept on the device in tab), then (cuda-sim) the
	 * input snapshots, scratch of this call */
	size_t tbytes = sizeof(struct ej_optim_tensor) * (size_t)n;
	struct ej_optim_tensor *ht = calloc((size_t)(n ? n : 1), sizeof *ht);
	ej_launch_out *outs = sim ? calloc((size_t)n * 4, sizeof *outs) : NULL;
	size_t snap = sim ? sizeof(float) * (size_t)total * 3 : 0;
	float *sp = NULL;
	void *owned = NULL;
	if (!ht || (sim && !outs)) {
		st = ej_error(ctx, EPJ_ERR_NOMEM,
			      "optimizer step: out of memory");
		goto done;
	}
	if (snap) {
		sp = dev_alloc(ctx, m, snap, "optimizer step");
		if (!sp) {
			st = EPJ_ERR_NOMEM;
			goto done;
		}
	}
	float *spn = sp;
	int n_out = 0;
	int64_t q = 0;
	for (int i = 0; i < n; i++) {
		const ej_tmpl_optim_tensor *s = &t[i];
		struct ej_optim_tensor *h = &ht[i];
		h->master = s->master;
		h->grad = s->grad;
		h->s1 = s->s1;
		h->s2 = o->adam ? s->s2 : NULL;
		h->model = s->model;
		h->n = s->n;
		h->first = q;
		h->master_in = s->master;
		h->s1_in = s->s1;
		h->s2_in = h->s2;
		if (sim && s->n > 0) {
			size_t b = sizeof(float) * (size_t)s->n;
			float *bufs[3] = { s->master, s->s1, h->s2 };
			const float **ins[3] = { &h->master_in, &h->s1_in,
						 &h->s2_in };
			for (int j = 0; j < 3; j++) {
				if (!bufs[j])
					continue;
				d->copy(d->self, spn, bufs[j], b);
				*ins[j] = spn;
				spn += s->n;
				outs[n_out++] = ej_tmpl_out(bufs[j], s->n, 4);
			}
			if (s->model)
				outs[n_out++] =
				    ej_tmpl_out(s->model, s->n,
						ej_dtype_size(o->model_dtype));
		}
		q += optim_blocks(s->n);
	}
	struct ej_optim_args a = { 0 };
	a.t = optim_table(ctx, m, tab, ht, tbytes, "optimizer step", &owned);
	if (!a.t) {
		st = EPJ_ERR_NOMEM;
		goto done;
	}
	a.n_t = n;
	optim_args(&a, o);
	st = ej_tmpl_launch_1d(ctx, m, "ej_optim_step", (unsigned)items, 256,
			       &a, sizeof a, outs, n_out);
done:
	dev_free(ctx, m, sp);
	dev_free(ctx, m, owned);
	free(ht);
	free(outs);
	return st;
}

epj_status ej_tmpl_optim_sumsq(epj_ctx *ctx, const char *device,
			       epj_dtype grad_dtype,
			       const ej_tmpl_optim_span *s, int n,
			       ej_tmpl_optim_table *tab, double *ss)
{
	*ss = 0;
	if (grad_dtype != EPJ_DTYPE_F32 && grad_dtype != EPJ_DTYPE_BF16)
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"gradient norm: gradient %s: expected f32 or "
				"bf16",
				epj_dtype_name(grad_dtype));
	if (n < 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"gradient norm: %d tensors", n);
	int64_t items = 0;
	for (int i = 0; i < n; i++) {
		if (s[i].n < 0 || (s[i].n > 0 && !s[i].grad))
			return ej_error(ctx, EPJ_ERR_INVALID,
					"gradient norm: tensor %d: %lld "
					"elements, grad %p",
					i, (long long)s[i].n, s[i].grad);
		items += optim_blocks(s[i].n);
	}
	ej_tmpl *m;
	epj_status st = optim_module(ctx, device, "gradient norm", items, &m);
	if (st != EPJ_OK || !m)
		return st;
	const ej_device *d = ej_tmpl_device(m);
	/* the descriptors (kept in tab); scratch: partial sums [items], the
	 * sum [1] */
	size_t tbytes = sizeof(struct ej_optim_tensor) * (size_t)n;
	struct ej_optim_tensor *ht = calloc((size_t)(n ? n : 1), sizeof *ht);
	double *part = NULL;
	void *owned = NULL;
	if (!ht) {
		st = ej_error(ctx, EPJ_ERR_NOMEM,
			      "gradient norm: out of memory");
		goto done;
	}
	int64_t q = 0;
	for (int i = 0; i < n; i++) {
		ht[i].grad = s[i].grad;
		ht[i].n = s[i].n;
		ht[i].first = q;
		q += optim_blocks(s[i].n);
	}
	part = dev_alloc(ctx, m, sizeof(double) * (size_t)(items + 1),
			 "gradient norm");
	const struct ej_optim_tensor *dt =
	    part ? optim_table(ctx, m, tab, ht, tbytes, "gradient norm", &owned)
		 : NULL;
	if (!dt) {
		st = EPJ_ERR_NOMEM;
		goto done;
	}
	struct ej_optim_sumsq_args a = {
		.t = dt,
		.n_t = n,
		.chunk = OPTIM_CHUNK,
		.gdt = ej_tmpl_dcode(grad_dtype),
		.n_items = items,
		.partial = part,
		.out = part + items,
	};
	ej_launch_out op = ej_tmpl_out(a.partial, items, 8);
	st = ej_tmpl_launch_1d(ctx, m, "ej_optim_sumsq", (unsigned)items, 256,
			       &a, sizeof a, &op, 1);
	if (st == EPJ_OK) {
		ej_launch_out oo = ej_tmpl_out(a.out, 1, 8);
		st = ej_tmpl_launch_1d(ctx, m, "ej_optim_sumsq_total", 1, 256,
				       &a, sizeof a, &oo, 1);
	}
	if (st == EPJ_OK) /* the one value that comes back (a synchronous
			     copy: the kernels are done) */
		d->copy(d->self, ss, a.out, sizeof *ss);
done:
	dev_free(ctx, m, part);
	dev_free(ctx, m, owned);
	free(ht);
	return st;
}
