/* parity.c -- the parity harness: eager vs compiled on the same weights and
 * batch, one step, compared quantity by quantity (DESIGN.md section 8; the
 * seed's GPU suite).
 *
 * Two arms, each with its own context (so counters are per arm), model and
 * engine built from the same seed; the compiled arm calls
 * epj_engine_compile().  Each arm runs a warm-up forward+backward (which
 * traces and compiles), drops the gradients, then the measured step:
 * forward, backward, one SGD step with lr 1.0 (so FP32 master updates stay
 * above rounding near unit-valued norm weights, as the seed explains).
 *
 * Compared: logits, loss, the input gradient (of the token embedding:
 * the LM's input is token ids), router / expert / dense gradients, the FP32
 * master-parameter update, exact routing assignments, the number of eager
 * AutoEP calls in the measured step (regions x (2 with checkpointing, else
 * 1)), and zero change of stats.unique_graphs, stats.calls_captured and
 * recompiles in the measured step.
 *
 * Checks that make the comparison mean something (each fails on its own):
 *  - "before" masters are copies taken before the step, and each arm's
 *    update must be non-zero and equal -grad (SGD, lr 1.0) within 5%
 *    relative L2 (at world > 1, where the update follows the gradient
 *    averaged over the ranks: non-zero and within 4x of this rank's
 *    gradient RMS), so two zero updates cannot compare equal;
 *  - every region of the compiled arm ran a compiled variant with compiled
 *    kernel launches in the measured step (epj_engine_region_stats) and no
 *    call fell back to the original forward; the eager arm made no compiled
 *    launch at all.
 * At a world of one, ZeRO stage 1 and async split planning are the same
 * computation as stage 0 and the synchronous plan: the table says so
 * instead of reporting them as covered code paths.
 */
#include "optim_impl.h"
#include "runtime_impl.h"

#include <math.h>
#include <string.h>

typedef struct arm {
	epj_ctx *ctx;
	epj_model *model;
	epj_engine *eng;
	epj_tensor *logits;
	double loss;
	/* per parameter: gradient (f32 copy) and master update */
	epj_tensor **grad;
	epj_tensor **update;
	epj_tensor **routing; /* per AutoEP layer */
	epj_counters *before, *after;
	/* per compiled region, around the measured forward + backward */
	epj_region_stats *rs_before, *rs_after;
	int n_regions;
} arm;

static void arm_free(arm *a)
{
	if (a->model) {
		for (int i = 0; a->grad && i < a->model->params.n; i++) {
			epj_tensor_free(a->grad[i]);
			epj_tensor_free(a->update[i]);
		}
		for (int i = 0; a->routing && i < a->model->n_moe; i++)
			epj_tensor_free(a->routing[i]);
	}
	free(a->grad);
	free(a->update);
	free(a->routing);
	free(a->rs_before);
	free(a->rs_after);
	epj_tensor_free(a->logits);
	epj_counters_free(a->before);
	epj_counters_free(a->after);
	epj_engine_free(a->eng);
	epj_model_free(a->model);
	epj_ctx_free(a->ctx);
	memset(a, 0, sizeof *a);
}

static char *config_json(const epj_parity_opts *o, bool compiled)
{
	char *s = malloc(1024);
	if (!s)
		return NULL;
	snprintf(
	    s, 1024,
	    "{\"train_micro_batch_size_per_gpu\": %lld,"
	    " \"gradient_accumulation_steps\": 1,"
	    " \"bf16\": {\"enabled\": %s},"
	    " \"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": 1.0}},"
	    " \"zero_optimization\": {\"stage\": 1},"
	    " \"activation_checkpointing\": {\"enabled\": %s},"
	    " \"expert_parallel\": {\"enabled\": true, \"autoep_size\": %d,"
	    " \"async_split_plan\": %s},"
	    " \"compile\": {\"autoep_non_moe\": %s%s%s%s},"
	    " \"seed\": %llu}",
	    (long long)o->batch, o->bf16 ? "true" : "false",
	    o->checkpointing ? "true" : "false", ej_comm_world()->size,
	    o->async_split_plan ? "true" : "false",
	    o->regional ? "true" : "false",
	    o->backend ? ", \"backend\": \"" : "", o->backend ? o->backend : "",
	    o->backend ? "\"" : "", (unsigned long long)o->seed);
	(void)compiled;
	return s;
}

/* A new f32 tensor holding the values of t now: never t itself (epj_cast
 * to the same dtype is the identity, and the optimizer updates masters in
 * place, so a "before" taken by casting would change with the update). */
static epj_tensor *copy_f32(epj_ctx *ctx, const epj_tensor *t)
{
	epj_tensor *r = epj_zeros(ctx, EPJ_DTYPE_F32, epj_tensor_ndim(t),
				  epj_tensor_shape(t));
	if (r && epj_tensor_copy_(ctx, r, t) != EPJ_OK) {
		epj_tensor_free(r);
		r = NULL;
	}
	return r;
}

static epj_status run_arm(arm *a, const epj_parity_opts *o, bool compiled,
			  epj_tensor **ids_out, epj_tensor **labels_out)
{
	/* both arms on the run's device (EPJIT_DEVICE): on cuda-sim the
	 * eager arm, and the eager ops of the compiled one, run as CUDA
	 * kernels */
	const char *dev = getenv("EPJIT_DEVICE");
	epj_status st = epj_ctx_new(
	    dev && (!strcmp(dev, "cuda-sim") || !strcmp(dev, "cuda")) ? dev
								      : "cpu",
	    &a->ctx);
	if (st != EPJ_OK)
		return st;
	epj_ctx *ctx = a->ctx;
	epj_model_opts mo = { .layout = o->layout,
			      .seed = o->seed,
			      .dtype = EPJ_DTYPE_F32 };
	st = epj_model_new(ctx, o->model_config, &mo, &a->model);
	if (st != EPJ_OK)
		return st;
	char *js = config_json(o, compiled);
	if (!js)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	st = epj_engine_initialize_json(ctx, a->model, js, "<parity>", &a->eng);
	free(js);
	if (st != EPJ_OK)
		return st;
	if (compiled && (st = epj_engine_compile(a->eng)) != EPJ_OK)
		return st;
	/* the batch: a synthetic stream with the run's seed */
	epj_corpus *c = epj_corpus_synthetic(
	    ctx, (uint32_t)epj_model_vocab_size(a->model),
	    o->seed + 17 + (uint64_t)ej_comm_world()->rank);
	if (!c)
		return ctx->status;
	epj_tensor *ids = NULL, *labels = NULL;
	st = epj_corpus_next_batch(ctx, c, o->batch, o->seq, &ids, &labels);
	epj_corpus_free(c);
	if (st != EPJ_OK)
		return st;
	epj_model *m = a->model;
	/* warm-up: forward + backward (traces, compiles), grads dropped */
	epj_tensor *loss = NULL;
	st = epj_model_forward(ctx, m, ids, labels, NULL, &loss);
	if (st == EPJ_OK)
		st = epj_backward(ctx, loss, NULL);
	epj_tensor_free(loss);
	loss = NULL;
	for (int i = 0; i < m->params.n; i++)
		epj_tensor_zero_grad(m->params.params[i]);
	if (st != EPJ_OK)
		goto out;
	/* measured step */
	a->n_regions = epj_engine_num_regions(a->eng);
	a->rs_before = calloc((size_t)a->n_regions + 1, sizeof *a->rs_before);
	a->rs_after = calloc((size_t)a->n_regions + 1, sizeof *a->rs_after);
	if (!a->rs_before || !a->rs_after) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		goto out;
	}
	for (int i = 0; i < a->n_regions && st == EPJ_OK; i++)
		st = epj_engine_region_stats(a->eng, i, &a->rs_before[i]);
	if (st != EPJ_OK)
		goto out;
	a->before = epj_counters_snapshot(ctx);
	st = epj_model_forward(ctx, m, ids, labels, &a->logits, &loss);
	if (st == EPJ_OK) {
		a->loss = epj_tensor_get_f64(loss, 0);
		st = epj_backward(ctx, loss, NULL);
	}
	epj_tensor_free(loss);
	if (st != EPJ_OK)
		goto out;
	a->after = epj_counters_snapshot(ctx);
	for (int i = 0; i < a->n_regions && st == EPJ_OK; i++)
		st = epj_engine_region_stats(a->eng, i, &a->rs_after[i]);
	if (st != EPJ_OK)
		goto out;
	a->grad = calloc((size_t)m->params.n + 1, sizeof *a->grad);
	a->update = calloc((size_t)m->params.n + 1, sizeof *a->update);
	a->routing = calloc((size_t)m->n_moe + 1, sizeof *a->routing);
	if (!a->grad || !a->update || !a->routing) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		goto out;
	}
	for (int i = 0; i < m->n_moe; i++) {
		epj_tensor *r = ej_autoep_last_routing(m->moe[i]);
		a->routing[i] = r ? epj_tensor_ref(r) : NULL;
	}
	for (int i = 0; i < m->params.n && st == EPJ_OK; i++) {
		epj_tensor *g = epj_tensor_grad(m->params.params[i]);
		if (g) {
			a->grad[i] = copy_f32(ctx, g);
			if (!a->grad[i])
				st = ctx->status;
		}
	}
	/* masters before, one SGD step (lr 1.0 from the config), after */
	epj_tensor **before = calloc((size_t)m->params.n + 1, sizeof *before);
	if (!before && st == EPJ_OK)
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (int i = 0; i < m->params.n && st == EPJ_OK; i++) {
		epj_tensor *ms = ej_optim_master(a->eng->optim, i);
		before[i] = copy_f32(ctx, ms ? ms : m->params.params[i]);
		if (!before[i])
			st = ctx->status;
	}
	if (st == EPJ_OK)
		st = ej_optim_accumulate(a->eng->optim);
	double norm = 0;
	if (st == EPJ_OK)
		st = ej_optim_step(a->eng->optim, 1.0, 1.0, &norm);
	for (int i = 0; i < m->params.n && st == EPJ_OK; i++) {
		epj_tensor *ms = ej_optim_master(a->eng->optim, i);
		epj_tensor *after =
		    copy_f32(ctx, ms ? ms : m->params.params[i]);
		bool prev = epj_no_grad_enter(ctx);
		a->update[i] = after ? epj_sub(ctx, after, before[i]) : NULL;
		epj_no_grad_exit(ctx, prev);
		epj_tensor_free(after);
		if (!a->update[i])
			st = ctx->status;
	}
	for (int i = 0; before && i < m->params.n; i++)
		epj_tensor_free(before[i]);
	free(before);
out:
	if (st == EPJ_OK && ids_out) {
		*ids_out = ids;
		*labels_out = labels;
	} else {
		epj_tensor_free(ids);
		epj_tensor_free(labels);
	}
	return st;
}

/* ---- comparison ------------------------------------------------------------
 */

typedef struct cmp_acc {
	double max_abs, max_excess; /* excess over atol + rtol*|ref| */
	double num, den;	    /* squared norms of diff and ref */
	int64_t n;
	bool bad;
} cmp_acc;

static void acc_add(cmp_acc *c, epj_ctx *ctx, epj_tensor *a, epj_tensor *b,
		    double rtol, double atol_scale)
{
	if (!a || !b) {
		c->bad |= (a != NULL) != (b != NULL);
		return;
	}
	int64_t n = epj_tensor_numel(b);
	if (n != epj_tensor_numel(a)) {
		c->bad = true;
		return;
	}
	double *va = malloc(sizeof *va * (size_t)(n ? n : 1));
	double *vb = malloc(sizeof *vb * (size_t)(n ? n : 1));
	if (!va || !vb || epj_tensor_to_f64(ctx, a, va) != EPJ_OK ||
	    epj_tensor_to_f64(ctx, b, vb) != EPJ_OK) {
		c->bad = true;
		free(va);
		free(vb);
		return;
	}
	double rms = 0;
	for (int64_t i = 0; i < n; i++)
		rms += vb[i] * vb[i];
	rms = n ? sqrt(rms / (double)n) : 0;
	double atol = atol_scale * rms + 1e-30;
	for (int64_t i = 0; i < n; i++) {
		double d = fabs(va[i] - vb[i]);
		if (!isfinite(va[i]) || !isfinite(vb[i]))
			c->bad |=
			    !(va[i] == vb[i] || (isnan(va[i]) && isnan(vb[i])));
		if (d > c->max_abs)
			c->max_abs = d;
		double ex = d - (atol + rtol * fabs(vb[i]));
		if (ex > c->max_excess)
			c->max_excess = ex;
		c->num += d * d;
		c->den += vb[i] * vb[i];
	}
	c->n += n;
	free(va);
	free(vb);
}

static bool report(FILE *out, const char *what, const cmp_acc *c,
		   double rel_l2_max)
{
	double rel = c->den > 0 ? sqrt(c->num / c->den) : sqrt(c->num);
	bool ok = !c->bad && c->max_excess <= 0 && rel <= rel_l2_max;
	if (out)
		fprintf(out, "  %-22s %10.3e %10.3e %8lld  %s\n", what,
			c->max_abs, rel, (long long)c->n, ok ? "ok" : "FAIL");
	return ok;
}

static int64_t delta(const arm *a, const char *name)
{
	return epj_counters_value(a->after, name) -
	       epj_counters_value(a->before, name);
}

static bool check_count(FILE *out, const char *what, int64_t got, int64_t want)
{
	bool ok = got == want;
	if (out)
		fprintf(out, "  %-22s %10lld %10lld %8s  %s\n", what,
			(long long)got, (long long)want, "",
			ok ? "ok" : "FAIL");
	return ok;
}

/* One arm's master update against what SGD with lr 1.0 must do: update =
 * -grad for every parameter that has a gradient.  A harness whose updates
 * were zero (or the gradients themselves) would compare nothing, so this
 * fails unless both are non-zero and the update's relative L2 distance from
 * -grad is within rel_max (f32 masters round before - grad to about 1e-7 of
 * |before|, so the distance is far below that bound; 5% would take a wrong
 * step or a missed parameter). */
static bool update_check(FILE *out, const char *what, const arm *a,
			 double rel_max, int world)
{
	double g2 = 0, u2 = 0, d2 = 0;
	int64_t n = 0;
	bool bad = false;
	for (int i = 0; i < a->model->params.n; i++) {
		epj_tensor *g = a->grad[i], *u = a->update[i];
		if (!g)
			continue;
		int64_t k = epj_tensor_numel(g);
		/* at world > 1 a ZeRO master is this rank's shard: its
		 * update has another size and is compared between the arms
		 * only */
		if (u && world > 1 && epj_tensor_numel(u) != k)
			continue;
		if (!u || epj_tensor_numel(u) != k) {
			bad = true;
			continue;
		}
		for (int64_t j = 0; j < k; j++) {
			double gv = epj_tensor_get_f64(g, j);
			double uv = epj_tensor_get_f64(u, j);
			g2 += gv * gv;
			u2 += uv * uv;
			d2 += (uv + gv) * (uv + gv);
		}
		n += k;
	}
	double rms = n ? sqrt(u2 / (double)n) : 0;
	double rel = g2 > 0 ? sqrt(d2 / g2) : INFINITY;
	bool ok = !bad && n > 0 && g2 > 0 && u2 > 0 && isfinite(rel) &&
		  rel <= rel_max;
	if (world > 1) {
		/* the update follows the gradient averaged over the ranks,
		 * not this rank's own: require it non-zero and of the
		 * gradient's size (RMS ratio within 4x) */
		double ratio = sqrt(u2 / g2);
		rel = ratio;
		ok = !bad && n > 0 && g2 > 0 && u2 > 0 && ratio >= 0.25 &&
		     ratio <= 4;
	}
	if (out)
		fprintf(out, "  %-22s %10.3e %10.3e %8lld  %s\n", what, rms,
			rel, (long long)n, ok ? "ok" : "FAIL");
	return ok;
}

/* How many regions ran compiled code in the measured step: a call of a
 * compiled variant, no call run eagerly, and compiled kernel launches. */
static int regions_compiled(const arm *a)
{
	int n = 0;
	for (int i = 0; i < a->n_regions; i++) {
		const epj_region_stats *b = &a->rs_before[i],
				       *f = &a->rs_after[i];
		n += f->compiled_calls > b->compiled_calls &&
		     f->eager_calls == b->eager_calls &&
		     f->compiled_launches > b->compiled_launches;
	}
	return n;
}

epj_status epj_parity_run(const epj_parity_opts *opts, FILE *out, bool *passed)
{
	epj_parity_opts o = *opts;
	if (o.batch <= 0)
		o.batch = 2;
	if (o.seq <= 0)
		o.seq = 16;
	*passed = false;
	arm e = { 0 }, c = { 0 };
	epj_tensor *ids = NULL, *labels = NULL;
	epj_status st = run_arm(&e, &o, false, &ids, &labels);
	if (st != EPJ_OK) {
		if (out && e.ctx)
			fprintf(out, "parity: eager arm: %s\n",
				epj_ctx_error(e.ctx));
		arm_free(&e);
		return st;
	}
	st = run_arm(&c, &o, true, NULL, NULL);
	if (st != EPJ_OK) {
		if (out && c.ctx)
			fprintf(out, "parity: compiled arm: %s\n",
				epj_ctx_error(c.ctx));
		epj_tensor_free(ids);
		epj_tensor_free(labels);
		arm_free(&e);
		arm_free(&c);
		return st;
	}
	/* tolerances: the seed's GPU suite for bf16 (rtol 5e-3, atol per
	 * quantity = a fraction of the reference's RMS, relative L2 <= 5%);
	 * much tighter for f32 */
	double rtol = o.bf16 ? 5e-3 : 1e-5;
	double atol_s = o.bf16 ? 2e-2 : 1e-5;
	double l2 = o.bf16 ? 5e-2 : 1e-5;
	epj_model *m = e.model;
	int regions = c.eng ? epj_engine_num_regions(c.eng) : 0;
	if (out) {
		fprintf(out,
			"parity: %s layout, %s, checkpointing %s, %s compile "
			"(%d region%s), batch %lldx%lld\n",
			o.layout == EPJ_LAYOUT_ROOT ? "root" : "nested",
			o.bf16 ? "bf16" : "f32", o.checkpointing ? "on" : "off",
			o.regional ? "regional (autoep_non_moe)" : "full-model",
			regions, regions == 1 ? "" : "s", (long long)o.batch,
			(long long)o.seq);
		fprintf(out, "  %-22s %10s %10s %8s\n", "quantity", "max|diff|",
			"rel L2", "n");
	}
	bool ok = true;
	cmp_acc a_logits = { 0 }, a_loss = { 0 }, a_in = { 0 },
		a_router = { 0 }, a_expert = { 0 }, a_dense = { 0 },
		a_upd = { 0 };
	acc_add(&a_logits, e.ctx, c.logits, e.logits, rtol, atol_s);
	{
		int64_t one = 1;
		epj_tensor *lc =
		    epj_full(e.ctx, EPJ_DTYPE_F64, 1, &one, c.loss);
		epj_tensor *le =
		    epj_full(e.ctx, EPJ_DTYPE_F64, 1, &one, e.loss);
		acc_add(&a_loss, e.ctx, lc, le, rtol, 0);
		epj_tensor_free(lc);
		epj_tensor_free(le);
	}
	for (int i = 0; i < m->params.n; i++) {
		const char *nm = m->params.names[i];
		cmp_acc *dst =
		    strstr(nm, "embed_tokens") ? &a_in
		    : strstr(nm, ".mlp.gate.") || !strncmp(nm, "mlp.gate.", 9)
			? &a_router
		    : strstr(nm, "mlp.experts.") ? &a_expert
						 : &a_dense;
		acc_add(dst, e.ctx, c.grad[i], e.grad[i], rtol, atol_s);
		acc_add(&a_upd, e.ctx, c.update[i], e.update[i], rtol, atol_s);
	}
	ok &= report(out, "logits", &a_logits, l2);
	ok &= report(out, "loss", &a_loss, l2);
	ok &= report(out, "input grad (embed)", &a_in, l2);
	ok &= report(out, "router grads", &a_router, l2);
	ok &= report(out, "expert grads", &a_expert, l2);
	ok &= report(out, "dense grads", &a_dense, l2);
	ok &= report(out, "fp32 master update", &a_upd, l2);
	/* both arms really updated (rms of the update, distance from -grad) */
	int wsize = ej_comm_world()->size;
	ok &= update_check(out, "update=-grad eager", &e, 5e-2, wsize);
	ok &= update_check(out, "update=-grad compiled", &c, 5e-2, wsize);
	/* routing: exact */
	int64_t mism = 0, total = 0;
	for (int i = 0; i < m->n_moe; i++) {
		epj_tensor *re = e.routing[i], *rc = c.routing[i];
		if (!re || !rc) {
			mism += re != rc;
			continue;
		}
		int64_t n = epj_tensor_numel(re);
		total += n;
		if (n != epj_tensor_numel(rc)) {
			mism += n;
			continue;
		}
		for (int64_t k = 0; k < n; k++)
			mism += epj_tensor_get_f64(re, k) !=
				epj_tensor_get_f64(rc, k);
	}
	if (out)
		fprintf(out, "  %-22s %10lld %10s %8lld  %s\n",
			"routing mismatches", (long long)mism, "",
			(long long)total, mism == 0 ? "ok" : "FAIL");
	ok &= mism == 0;
	int64_t want_calls = (int64_t)m->n_moe * (o.checkpointing ? 2 : 1);
	ok &= check_count(out, "eager AutoEP calls",
			  delta(&c, "autoep.calls.forward") +
			      delta(&c, "autoep.calls.replay"),
			  want_calls);
	ok &= check_count(out, "d stats.unique_graphs",
			  delta(&c, "stats.unique_graphs"), 0);
	ok &= check_count(out, "d stats.calls_captured",
			  delta(&c, "stats.calls_captured"), 0);
	ok &= check_count(out, "d recompiles", delta(&c, "recompiles"), 0);
	/* each arm ran what it claims: every region of the compiled arm ran
	 * compiled kernels, the eager arm never did */
	ok &= check_count(out, "compiled launches > 0",
			  delta(&c, "kernels.launched.compiled") > 0, 1);
	ok &= check_count(out, "regions ran compiled", regions_compiled(&c),
			  regions > 0 ? regions : -1);
	ok &= check_count(
	    out, "regions with frames",
	    (int64_t)epj_counter_get(c.ctx, "frames.ok") >= regions, 1);
	ok &=
	    check_count(out, "eager arm compiled",
			epj_counter_get(e.ctx, "kernels.launched.compiled"), 0);
	ej_comm *world = ej_comm_world();
	/* what a world of one can and cannot tell apart */
	if (out && world->size == 1) {
		fprintf(out, "  world size 1: ZeRO stage 1 runs the same "
			     "computation as stage 0 (one shard)\n");
		if (o.async_split_plan)
			fprintf(out, "  world size 1: async split planning "
				     "runs the same computation as the "
				     "synchronous plan (no count exchange); "
				     "not a distinct code path\n");
	}
	if (world->size > 1) {
		/* every rank compares its own batch and experts: all must pass
		 */
		float f = ok ? 1.0f : 0.0f;
		if (ej_comm_allreduce(e.ctx, world, "parity.result", &f, 1) !=
		    EPJ_OK) {
			if (out)
				fprintf(out, "parity: %s\n",
					epj_ctx_error(e.ctx));
			f = 0;
		}
		ok = f == (float)world->size;
		if (out)
			fprintf(out,
				"parity: world of %d ranks (EP %d, each "
				"rank its own batch and experts): %s\n",
				world->size, world->size,
				ok ? "every rank passed" : "a rank FAILED");
	}
	if (out)
		fprintf(out, "parity: %s\n", ok ? "PASS" : "FAIL");
	*passed = ok;
	epj_tensor_free(ids);
	epj_tensor_free(labels);
	arm_free(&e);
	arm_free(&c);
	return EPJ_OK;
}
