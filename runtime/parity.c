/* parity.c -- the parity harness: eager vs compiled on the same weights and
 * batches, one training step, compared quantity by quantity and parameter
 * by parameter (doc/design.md section 8).
 *
 * Two arms, each with its own context (so counters are per arm), model and
 * engine built from the same seed; the compiled arm calls
 * epj_engine_compile().  Both arms draw two batches from the same synthetic
 * stream: a warm-up batch, run forward + backward (which traces and
 * compiles; gradients dropped), and a different measured batch (the
 * stream's next batch unlike the warm-up's), run
 * through epj_engine_train_step -- the call users make: forward, backward,
 * accumulate, one SGD step with lr 1.0 (so FP32 master updates stay above
 * rounding near unit-valued norm weights, as DeepSpeed's AutoEP validation
 * explains).  An engine probe (ej_step_probe) copies the logits, loss and
 * gradients between the backward and the optimizer; the masters are copied
 * around the step.  "No new graphs" is thus shown on tokens the compile never
 * saw.
 *
 * Compared, with the tolerances of parity_tol below (per quantity; for
 * gradients and master updates per parameter, so one wrong parameter
 * cannot hide in a pooled norm): logits, loss, the input gradient (of the
 * token embedding: the LM's input is token ids), router / expert / dense
 * gradients, the FP32 master-parameter update; the routing of every call of
 * every AutoEP layer in the measured step, by layer name and call index,
 * checkpoint replays included, exactly; the number of eager AutoEP calls of
 * each arm (layers x (2 with checkpointing, else 1)); zero change of
 * stats.unique_graphs, stats.calls_captured and recompiles in the compiled
 * arm's measured step.  Every category must be non-empty (a model without
 * AutoEP layers reports the router, expert and routing rows as n/a).
 *
 * Checks that make the comparison mean something (each fails on its own):
 *  - the measured batch differs from the warm-up batch;
 *  - "before" masters are copies taken before the step, and each arm's
 *    update must be non-zero and equal -grad (SGD, lr 1.0) within 5%
 *    relative L2 (at world > 1, where the update follows the gradient
 *    averaged over the ranks: non-zero and within 4x of this rank's
 *    gradient RMS), so two zero updates cannot compare equal;
 *  - every region of the compiled arm ran a compiled variant with compiled
 *    kernel launches in the measured step (epj_engine_region_stats) and no
 *    call fell back to the original forward; the eager arm made no compiled
 *    launch at all.
 * The comparison functions are internal entry points (runtime_impl.h) so
 * that t/check_parity.c can feed them known-bad signals.
 * At a world of one, ZeRO stage 1 and async split planning are the same
 * computation as stage 0 and the synchronous plan: the table says so
 * instead of reporting them as covered code paths.
 */
#include "optim_impl.h"
#include "runtime_impl.h"

#include <math.h>
#include <string.h>

/* ---- tolerances ------------------------------------------------------------
 *
 * Per quantity, as DeepSpeed's AutoEP GPU suite for bf16: a value passes when
 * |got - ref| <= atol + rtol * (|ref| + rms(ref)) element by element AND
 * the relative L2 distance ||got - ref|| / ||ref|| of the tensor is <=
 * rel_l2; for gradients and master updates each parameter on its own.
 * rms(ref), the tensor's root mean square, sets the scale of an element's
 * rounding: an embedding gradient's small entry is a sum over many tokens
 * of large terms, and differs between two summation orders (two OpenBLAS
 * kernel sets, say) by a few units of the tensor's scale, not of its own
 * value (the f32 case that made this: 1.5e-6 off at 0.049 in a gradient of
 * RMS 1.2 under Prescott's kernels).
 *
 *   bf16       atol    rtol    rel L2
 *   outputs    2e-2    5e-3    5%      (logits)
 *   loss       2e-3    5e-3    5%
 *   gradients  5e-3    5e-3    5%      per parameter
 *   updates    5e-5    5e-3    5%      per parameter (FP32 master deltas)
 *
 * f32 is far tighter (rtol 1e-5, rel L2 1e-4; atol 1e-5 for outputs, 1e-6
 * otherwise: about 8 FP32 ulps of a unit-valued master, the rounding one
 * master update can differ by when the gradients differ in the last bit).
 */
ej_parity_tol ej_parity_tolerance(ej_parity_qty q, bool bf16)
{
	static const ej_parity_tol t_bf16[] = {
		[EJ_PARITY_OUTPUT] = { 2e-2, 5e-3, 5e-2 },
		[EJ_PARITY_LOSS] = { 2e-3, 5e-3, 5e-2 },
		[EJ_PARITY_GRAD] = { 5e-3, 5e-3, 5e-2 },
		[EJ_PARITY_UPDATE] = { 5e-5, 5e-3, 5e-2 },
	};
	static const ej_parity_tol t_f32[] = {
		[EJ_PARITY_OUTPUT] = { 1e-5, 1e-5, 1e-4 },
		[EJ_PARITY_LOSS] = { 1e-6, 1e-5, 1e-4 },
		[EJ_PARITY_GRAD] = { 1e-6, 1e-5, 1e-4 },
		[EJ_PARITY_UPDATE] = { 1e-6, 1e-5, 1e-4 },
	};
	EJ_ASSERT(q >= 0 && q <= EJ_PARITY_UPDATE);
	return bf16 ? t_bf16[q] : t_f32[q];
}

static void diff_bad(ej_parity_diff *d, int index)
{
	d->n_bad++;
	if (!d->first_bad)
		d->first_bad = index + 1;
}

void ej_parity_diff_add(epj_ctx *ctx, ej_parity_diff *d, int index,
			const epj_tensor *got, const epj_tensor *ref,
			const ej_parity_tol *tol)
{
	if (!got && !ref)
		return; /* absent on both sides: nothing to compare */
	d->n_tensors++;
	if (!got || !ref) {
		diff_bad(d, index); /* missing on one side */
		return;
	}
	int64_t n = epj_tensor_numel(ref);
	if (n != epj_tensor_numel(got)) {
		diff_bad(d, index);
		return;
	}
	double *vg = malloc(sizeof *vg * (size_t)(n ? n : 1));
	double *vr = malloc(sizeof *vr * (size_t)(n ? n : 1));
	if (!vg || !vr || epj_tensor_to_f64(ctx, got, vg) != EPJ_OK ||
	    epj_tensor_to_f64(ctx, ref, vr) != EPJ_OK) {
		diff_bad(d, index);
		free(vg);
		free(vr);
		return;
	}
	bool bad = false;
	double num = 0, den = 0;
	int64_t nf = 0;
	for (int64_t i = 0; i < n; i++)
		if (isfinite(vr[i])) {
			den += vr[i] * vr[i];
			nf++;
		}
	/* an element's error is measured against its own size and the
	 * tensor's (its RMS): a small element of a sum over many tokens
	 * carries the rounding of the large terms it was summed from */
	const double floor_ =
	    tol->atol + tol->rtol * (nf ? sqrt(den / (double)nf) : 0);
	for (int64_t i = 0; i < n; i++) {
		double e = fabs(vg[i] - vr[i]);
		if (!isfinite(vg[i]) || !isfinite(vr[i])) {
			/* the same non-finite value on both sides only */
			bad |=
			    !(vg[i] == vr[i] || (isnan(vg[i]) && isnan(vr[i])));
			continue;
		}
		if (e > d->max_abs)
			d->max_abs = e;
		bad |= e > floor_ + tol->rtol * fabs(vr[i]);
		num += e * e;
	}
	double rel = den > 0 ? sqrt(num / den) : num > 0 ? INFINITY : 0;
	if (rel > d->worst_rel)
		d->worst_rel = rel;
	bad |= !(rel <= tol->rel_l2);
	d->n += n;
	if (bad)
		diff_bad(d, index);
	free(vg);
	free(vr);
}

bool ej_parity_diff_ok(const ej_parity_diff *d)
{
	return d->n_bad == 0 && d->n_tensors > 0 && d->n > 0;
}

/* ---- routing ----------------------------------------------------------- */

static const ej_parity_route *route_find(const ej_parity_route *r, int n,
					 const char *layer, int call)
{
	for (int i = 0; i < n; i++)
		if (r[i].call == call && !strcmp(r[i].layer, layer))
			return &r[i];
	return NULL;
}

static int64_t route_size(const ej_parity_route *r)
{
	int64_t n = r->assign ? epj_tensor_numel(r->assign) : 0;
	return n > 0 ? n : 1;
}

void ej_parity_routes_compare(const ej_parity_route *got, int n_got,
			      const ej_parity_route *ref, int n_ref,
			      int64_t *mismatch, int64_t *total)
{
	*mismatch = 0;
	*total = 0;
	for (int i = 0; i < n_ref; i++) {
		const ej_parity_route *r = &ref[i];
		const ej_parity_route *g =
		    route_find(got, n_got, r->layer, r->call);
		int64_t n = r->assign ? epj_tensor_numel(r->assign) : 0;
		*total += n;
		if (!g || !g->assign || !r->assign || g->replay != r->replay ||
		    epj_tensor_numel(g->assign) != n) {
			*mismatch += route_size(r);
			continue;
		}
		for (int64_t k = 0; k < n; k++)
			*mismatch += epj_tensor_get_f64(g->assign, k) !=
				     epj_tensor_get_f64(r->assign, k);
	}
	/* calls the reference never made */
	for (int i = 0; i < n_got; i++)
		if (!route_find(ref, n_ref, got[i].layer, got[i].call))
			*mismatch += route_size(&got[i]);
}

/* ---- update = -grad ------------------------------------------------------ */

bool ej_parity_update_follows(epj_tensor *const *grad,
			      epj_tensor *const *update, int n_params,
			      int world, double *rms_out, double *rel_out,
			      int64_t *n_out)
{
	double g2 = 0, u2 = 0, d2 = 0;
	int64_t n = 0;
	bool bad = false;
	for (int i = 0; i < n_params; i++) {
		epj_tensor *g = grad[i], *u = update[i];
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
	double rel = g2 > 0 ? sqrt(d2 / g2) : INFINITY;
	/* f32 masters round before - grad to about 1e-7 of |before|, far
	 * below 5%; 5% would take a wrong step or a missed parameter */
	bool ok =
	    !bad && n > 0 && g2 > 0 && u2 > 0 && isfinite(rel) && rel <= 5e-2;
	if (world > 1) {
		/* the update follows the gradient averaged over the ranks,
		 * not this rank's own: require it non-zero and of the
		 * gradient's size (RMS ratio within 4x) */
		double ratio = g2 > 0 ? sqrt(u2 / g2) : INFINITY;
		rel = ratio;
		ok = !bad && n > 0 && g2 > 0 && u2 > 0 && ratio >= 0.25 &&
		     ratio <= 4;
	}
	*rms_out = n ? sqrt(u2 / (double)n) : 0;
	*rel_out = rel;
	*n_out = n;
	return ok;
}

/* ---- one arm ---------------------------------------------------------------
 */

typedef struct arm {
	epj_ctx *ctx;
	epj_model *model;
	epj_engine *eng;
	epj_tensor *logits; /* measured step, f32 copy */
	double loss;
	/* per parameter: gradient (f32 copy) and master update */
	epj_tensor **grad;
	epj_tensor **update;
	/* the measured step's AutoEP calls, all layers, in layer order */
	ej_parity_route *routes;
	int n_routes;
	int64_t warm_tokens_differ; /* tokens of the measured batch unlike the
				       warm-up batch's */
	epj_counters *before, *after;
	/* per compiled region, around the measured step */
	epj_region_stats *rs_before, *rs_after;
	int n_regions;
	bool probed; /* the probe ran in the measured step */
} arm;

static void arm_free(arm *a)
{
	if (a->model)
		for (int i = 0; a->grad && i < a->model->params.n; i++) {
			epj_tensor_free(a->grad[i]);
			epj_tensor_free(a->update[i]);
		}
	for (int i = 0; i < a->n_routes; i++)
		epj_tensor_free((epj_tensor *)a->routes[i].assign);
	free(a->routes);
	free(a->grad);
	free(a->update);
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

static char *config_json(const epj_parity_opts *o)
{
	size_t n = 1024 + (o->moe_json ? strlen(o->moe_json) : 0);
	char *s = malloc(n);
	if (!s)
		return NULL;
	snprintf(
	    s, n,
	    "{\"train_micro_batch_size_per_gpu\": %lld,"
	    " \"gradient_accumulation_steps\": 1,"
	    " \"bf16\": {\"enabled\": %s},"
	    " \"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": 1.0}},"
	    " \"zero_optimization\": {\"stage\": 1},"
	    " \"activation_checkpointing\": {\"enabled\": %s},"
	    " \"expert_parallel\": {\"enabled\": true, \"autoep_size\": %d,"
	    " \"async_split_plan\": %s},"
	    " \"compile\": {\"autoep_non_moe\": %s%s%s%s},"
	    " \"moe\": %s, \"seed\": %llu}",
	    (long long)o->batch, o->bf16 ? "true" : "false",
	    o->checkpointing ? "true" : "false", ej_comm_world()->size,
	    o->async_split_plan ? "true" : "false",
	    o->regional ? "true" : "false",
	    o->backend ? ", \"backend\": \"" : "", o->backend ? o->backend : "",
	    o->backend ? "\"" : "", o->moe_json ? o->moe_json : "null",
	    (unsigned long long)o->seed);
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

/* ej_step_probe.on_backward of the measured step: the logits, the loss
 * and every gradient as the backward left them, before the optimizer. */
static epj_status probe_backward(void *self, epj_engine *e, epj_tensor *logits,
				 double loss)
{
	arm *a = self;
	epj_ctx *ctx = a->ctx;
	epj_model *m = a->model;
	(void)e;
	a->probed = true;
	a->loss = loss;
	if (!logits)
		return ej_error(ctx, EPJ_ERR_STATE,
				"parity: the train step returned no logits");
	if (!(a->logits = copy_f32(ctx, logits)))
		return ctx->status;
	for (int i = 0; i < m->params.n; i++) {
		epj_tensor *g = epj_tensor_grad(m->params.params[i]);
		if (g && !(a->grad[i] = copy_f32(ctx, g)))
			return ctx->status;
	}
	return EPJ_OK;
}

/* The routing log of every AutoEP layer after the measured step: one
 * route per call (layer name, call index, replay or not), each a copy. */
static epj_status collect_routes(arm *a)
{
	epj_model *m = a->model;
	int n = 0;
	for (int i = 0; i < m->n_moe; i++) {
		epj_tensor *const *calls;
		const bool *replay;
		n += ej_autoep_routing_log(m->moe[i], &calls, &replay);
	}
	a->routes = calloc((size_t)n + 1, sizeof *a->routes);
	if (!a->routes)
		return ej_error(a->ctx, EPJ_ERR_NOMEM, "out of memory");
	for (int i = 0; i < m->n_moe; i++) {
		epj_tensor *const *calls;
		const bool *replay;
		int k = ej_autoep_routing_log(m->moe[i], &calls, &replay);
		for (int j = 0; j < k; j++) {
			ej_parity_route *r = &a->routes[a->n_routes++];
			r->layer = m->moe[i]->name;
			r->call = j;
			r->replay = replay[j];
			r->assign = epj_tensor_ref(calls[j]);
		}
	}
	return EPJ_OK;
}

/* For the harness's own tests (t/check_parity.c): 1 (2) makes the eager
 * (compiled) arm call its first AutoEP layer once more, without grad, in
 * the measured window before the routing log starts -- an eager AutoEP
 * call count the table must reject, and nothing else.
 * 0: off.  A global like compile.c's test hooks. */
static int extra_call_arm;

void ej_parity_test_extra_call(int which);
void ej_parity_test_extra_call(int which)
{
	extra_call_arm = which;
}

static epj_status extra_call(arm *a)
{
	epj_ctx *ctx = a->ctx;
	epj_model *m = a->model;
	int64_t shape[3] = { 1, 1, m->cfg.hidden_size };
	epj_tensor *h =
	    epj_zeros(ctx, epj_tensor_dtype(m->params.params[0]), 3, shape);
	epj_tensor *y = NULL;
	bool prev = epj_no_grad_enter(ctx);
	epj_status st =
	    h ? ej_module_call(ctx, m->moe[0], &h, 1, &y, 1) : ctx->status;
	epj_no_grad_exit(ctx, prev);
	epj_tensor_free(y);
	epj_tensor_free(h);
	return st;
}

static epj_status run_arm(arm *a, const epj_parity_opts *o, bool compiled)
{
	/* both arms on the run's device (EPJIT_DEVICE): on cuda-sim the
	 * eager arm, and the eager ops of the compiled one, run as CUDA
	 * kernels */
	const char *dev = getenv("EPJIT_DEVICE");
	epj_status st =
	    epj_ctx_new(dev && epj_device_known(dev) ? dev : "cpu", &a->ctx);
	if (st != EPJ_OK)
		return st;
	epj_ctx *ctx = a->ctx;
	epj_model_opts mo = { .layout = o->layout,
			      .seed = o->seed,
			      .dtype = EPJ_DTYPE_F32 };
	st = epj_model_new(ctx, o->model_config, &mo, &a->model);
	if (st != EPJ_OK)
		return st;
	char *js = config_json(o);
	if (!js)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	st = epj_engine_initialize_json(ctx, a->model, js, "<parity>", &a->eng);
	free(js);
	if (st != EPJ_OK)
		return st;
	if (compiled && (st = epj_engine_compile(a->eng)) != EPJ_OK)
		return st;
	epj_model *m = a->model;
	/* two batches of a synthetic stream with the run's seed: the
	 * warm-up's, then the measured step's */
	epj_corpus *c = epj_corpus_synthetic(
	    ctx, (uint32_t)epj_model_vocab_size(a->model),
	    o->seed + 17 + (uint64_t)ej_comm_world()->rank);
	if (!c)
		return ctx->status;
	epj_tensor *ids_w = NULL, *labels_w = NULL, *ids = NULL, *labels = NULL,
		   *loss = NULL, **before = NULL;
	st = epj_corpus_next_batch(ctx, c, o->batch, o->seq, &ids_w, &labels_w);
	/* The chain can sit in a state whose likeliest successor is itself,
	 * so a short batch may repeat the warm-up's token for token: draw
	 * on (the same draws in both arms) until one differs. */
	for (int draw = 0; st == EPJ_OK && draw < 64; draw++) {
		epj_tensor_free(ids);
		epj_tensor_free(labels);
		ids = labels = NULL;
		st = epj_corpus_next_batch(ctx, c, o->batch, o->seq, &ids,
					   &labels);
		if (st != EPJ_OK)
			break;
		a->warm_tokens_differ = 0;
		for (int64_t k = 0; k < epj_tensor_numel(ids); k++)
			a->warm_tokens_differ += epj_tensor_get_f64(ids, k) !=
						 epj_tensor_get_f64(ids_w, k);
		if (a->warm_tokens_differ > 0)
			break;
	}
	epj_corpus_free(c);
	if (st != EPJ_OK)
		goto out;
	/* warm-up: forward + backward (traces, compiles), grads dropped */
	st = epj_model_forward(ctx, m, ids_w, labels_w, NULL, &loss);
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
	a->grad = calloc((size_t)m->params.n + 1, sizeof *a->grad);
	a->update = calloc((size_t)m->params.n + 1, sizeof *a->update);
	before = calloc((size_t)m->params.n + 1, sizeof *before);
	if (!a->rs_before || !a->rs_after || !a->grad || !a->update ||
	    !before) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		goto out;
	}
	for (int i = 0; i < a->n_regions && st == EPJ_OK; i++)
		st = epj_engine_region_stats(a->eng, i, &a->rs_before[i]);
	/* masters before the step (copies: the step updates in place) */
	for (int i = 0; i < m->params.n && st == EPJ_OK; i++) {
		epj_tensor *ms = ej_optim_master(a->eng->optim, i);
		before[i] = copy_f32(ctx, ms ? ms : m->params.params[i]);
		if (!before[i])
			st = ctx->status;
	}
	if (st != EPJ_OK)
		goto out;
	a->before = epj_counters_snapshot(ctx);
	/* the test hook's extra call: counted, not in the routing log */
	if (m->n_moe > 0 && extra_call_arm == 1 + compiled &&
	    (st = extra_call(a)) != EPJ_OK)
		goto out;
	for (int i = 0; i < m->n_moe; i++)
		ej_autoep_routing_log_start(m->moe[i]);
	/* the engine's train step, as users call it: forward, backward
	 * (the probe copies logits, loss and gradients), accumulate, one
	 * SGD step (lr 1.0) */
	ej_step_probe probe = { .self = a, .on_backward = probe_backward };
	a->eng->probe = &probe;
	epj_step_info info;
	st = epj_engine_train_step(a->eng, ids, labels, &info);
	a->eng->probe = NULL;
	if (st == EPJ_OK && (!a->probed || !info.stepped))
		st = ej_error(ctx, EPJ_ERR_STATE,
			      "parity: the measured train step %s",
			      a->probed ? "took no optimizer step"
					: "never reached the probe");
	if (st != EPJ_OK)
		goto out;
	a->after = epj_counters_snapshot(ctx);
	for (int i = 0; i < a->n_regions && st == EPJ_OK; i++)
		st = epj_engine_region_stats(a->eng, i, &a->rs_after[i]);
	if (st == EPJ_OK)
		st = collect_routes(a);
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
out:
	for (int i = 0; before && i < m->params.n; i++)
		epj_tensor_free(before[i]);
	free(before);
	epj_tensor_free(ids_w);
	epj_tensor_free(labels_w);
	epj_tensor_free(ids);
	epj_tensor_free(labels);
	return st;
}

/* ---- the table ------------------------------------------------------------
 */

static const char *const qty_name[] = { "outputs", "loss", "gradients",
					"updates" };

/* One row of compared tensors.  required: an empty row fails (a category
 * the model must have); otherwise an empty row is n/a. */
static bool report(FILE *out, const char *what, const ej_parity_diff *d,
		   bool required, const char *const *names)
{
	if (d->n_tensors == 0 && !required) {
		if (out)
			fprintf(out, "  %-22s %10s %10s %8s  n/a\n", what, "-",
				"-", "0");
		return true;
	}
	bool ok = ej_parity_diff_ok(d);
	if (out) {
		fprintf(out, "  %-22s %10.3e %10.3e %8lld  %s\n", what,
			d->max_abs, d->worst_rel, (long long)d->n,
			ok ? "ok" : "FAIL");
		if (d->n_tensors == 0)
			fprintf(out, "    (empty: nothing compared)\n");
		else if (d->first_bad && names)
			fprintf(
			    out, "    (%d of %d out of tolerance, first %s)\n",
			    d->n_bad, d->n_tensors, names[d->first_bad - 1]);
	}
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

typedef enum { CAT_INPUT, CAT_ROUTER, CAT_EXPERT, CAT_DENSE } category;

/* nm is, or ends in, "<block>.<what>" with block one of the MoE block
 * names of the families (Qwen3-MoE's mlp, Mixtral's block_sparse_moe). */
static bool moe_part(const char *nm, const char *what)
{
	static const char *const blocks[] = { "mlp.", "block_sparse_moe." };
	for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) {
		char key[64];
		snprintf(key, sizeof key, "%s%s", blocks[i], what);
		const char *s = strstr(nm, key);
		if (s && (s == nm || s[-1] == '.'))
			return true;
	}
	return false;
}

static category param_category(const char *nm)
{
	if (strstr(nm, "embed_tokens"))
		return CAT_INPUT;
	if (moe_part(nm, "gate."))
		return CAT_ROUTER;
	if (moe_part(nm, "experts."))
		return CAT_EXPERT;
	return CAT_DENSE;
}

/* The table's header: where and how the arms ran, the tolerances. */
static void print_header(FILE *out, const epj_parity_opts *opts, const arm *c,
			 int regions, const ej_comm *world)
{
	const epj_parity_opts o = *opts;
	if (!out)
		return;
	fprintf(out,
		"parity: device %s, backend %s, dtype %s, world size "
		"%d (EP %d, ZeRO 1), layout %s\n",
		c->ctx->dev->name, ej_engine_backend_name(c->eng),
		o.bf16 ? "bf16" : "f32", world->size, world->size,
		o.layout == EPJ_LAYOUT_ROOT ? "root" : "nested");
	fprintf(
	    out,
	    "parity: checkpointing %s, async split plan %s, %s "
	    "compile (%d region%s), batch %lldx%lld, a warm-up "
	    "batch then another measured one\n",
	    o.checkpointing ? "on" : "off", o.async_split_plan ? "on" : "off",
	    o.regional ? "regional (autoep_non_moe)" : "full-model", regions,
	    regions == 1 ? "" : "s", (long long)o.batch, (long long)o.seq);
	fprintf(out, "parity: tolerances (atol, rtol, rel L2; gradients and "
		     "updates per parameter):");
	for (int q = 0; q <= EJ_PARITY_UPDATE; q++) {
		ej_parity_tol t = ej_parity_tolerance(q, o.bf16);
		fprintf(out, " %s %g %g %g%s", qty_name[q], t.atol, t.rtol,
			t.rel_l2, q < EJ_PARITY_UPDATE ? ";" : "\n");
	}
	fprintf(out, "  %-22s %10s %10s %8s\n", "quantity", "max|diff|",
		"rel L2", "n");
}

/* The values of the measured step compared, row by row, and each arm's
 * update checked against its gradient: all within tolerance. */
static bool compare_values(FILE *out, const epj_parity_opts *opts, const arm *e,
			   const arm *c, const ej_comm *world)
{
	const epj_parity_opts o = *opts;
	epj_model *m = e->model;
	bool moe = m->n_moe > 0;
	bool ok = true;
	ej_parity_tol t_out = ej_parity_tolerance(EJ_PARITY_OUTPUT, o.bf16),
		      t_loss = ej_parity_tolerance(EJ_PARITY_LOSS, o.bf16),
		      t_grad = ej_parity_tolerance(EJ_PARITY_GRAD, o.bf16),
		      t_upd = ej_parity_tolerance(EJ_PARITY_UPDATE, o.bf16);
	ej_parity_diff d_logits = { 0 }, d_loss = { 0 }, d_cat[4] = { 0 },
		       d_upd = { 0 };
	ej_parity_diff_add(e->ctx, &d_logits, 0, c->logits, e->logits, &t_out);
	{
		int64_t one = 1;
		epj_tensor *lc =
		    epj_full(e->ctx, EPJ_DTYPE_F64, 1, &one, c->loss);
		epj_tensor *le =
		    epj_full(e->ctx, EPJ_DTYPE_F64, 1, &one, e->loss);
		ej_parity_diff_add(e->ctx, &d_loss, 0, lc, le, &t_loss);
		epj_tensor_free(lc);
		epj_tensor_free(le);
	}
	for (int i = 0; i < m->params.n; i++) {
		category k = param_category(m->params.names[i]);
		ej_parity_diff_add(e->ctx, &d_cat[k], i, c->grad[i], e->grad[i],
				   &t_grad);
		ej_parity_diff_add(e->ctx, &d_upd, i, c->update[i],
				   e->update[i], &t_upd);
	}
	const char *const *pn = (const char *const *)m->params.names;
	ok &= report(out, "logits", &d_logits, true, NULL);
	ok &= report(out, "loss", &d_loss, true, NULL);
	ok &= report(out, "input grad (embed)", &d_cat[CAT_INPUT], true, pn);
	ok &= report(out, "router grads", &d_cat[CAT_ROUTER], moe, pn);
	ok &= report(out, "expert grads", &d_cat[CAT_EXPERT], moe, pn);
	ok &= report(out, "dense grads", &d_cat[CAT_DENSE], true, pn);
	ok &= report(out, "fp32 master update", &d_upd, true, pn);
	/* both arms really updated (rms of the update, distance from -grad) */
	const arm *arms[2] = { e, c };
	for (int k = 0; k < 2; k++) {
		double rms = 0, rel = 0;
		int64_t n = 0;
		bool u = ej_parity_update_follows(arms[k]->grad,
						  arms[k]->update, m->params.n,
						  world->size, &rms, &rel, &n);
		if (out)
			fprintf(out, "  %-22s %10.3e %10.3e %8lld  %s\n",
				k ? "update=-grad compiled"
				  : "update=-grad eager",
				rms, rel, (long long)n, u ? "ok" : "FAIL");
		ok &= u;
	}
	return ok;
}

/* The routing of every AutoEP call compared exactly, and the counts that
 * show each arm ran what it claims. */
static bool check_calls(FILE *out, const epj_parity_opts *opts, arm *e, arm *c,
			int regions)
{
	const epj_parity_opts o = *opts;
	epj_model *m = e->model;
	bool moe = m->n_moe > 0, ok = true;
	const arm *arms[2] = { e, c };
	/* routing: every call of every AutoEP layer, replays included,
	 * exactly */
	int64_t mism = 0, total = 0;
	ej_parity_routes_compare(c->routes, c->n_routes, e->routes, e->n_routes,
				 &mism, &total);
	int64_t want_calls = (int64_t)m->n_moe * (o.checkpointing ? 2 : 1);
	if (!moe) {
		if (out)
			fprintf(out, "  %-22s %10s %10s %8s  n/a\n",
				"routing mismatches", "-", "-", "0");
	} else {
		/* every call was logged on both sides, and compared */
		bool r_ok = mism == 0 && total > 0 &&
			    e->n_routes == want_calls &&
			    c->n_routes == want_calls;
		if (out)
			fprintf(out, "  %-22s %10lld %10d %8lld  %s\n",
				"routing mismatches", (long long)mism,
				c->n_routes, (long long)total,
				r_ok ? "ok" : "FAIL");
		ok &= r_ok;
	}
	/* the eager AutoEP boundary, in each arm */
	for (int k = 0; k < 2; k++)
		ok &= check_count(
		    out, k ? "AutoEP calls compiled" : "AutoEP calls eager",
		    delta(arms[k], "autoep.calls.forward") +
			delta(arms[k], "autoep.calls.replay"),
		    want_calls);
	ok &= check_count(
	    out, "measured batch differs",
	    e->warm_tokens_differ > 0 && c->warm_tokens_differ > 0, 1);
	ok &= check_count(out, "d stats.unique_graphs",
			  delta(c, "stats.unique_graphs"), 0);
	ok &= check_count(out, "d stats.calls_captured",
			  delta(c, "stats.calls_captured"), 0);
	ok &= check_count(out, "d recompiles", delta(c, "recompiles"), 0);
	/* each arm ran what it claims: every region of the compiled arm ran
	 * compiled kernels, the eager arm never did */
	ok &= check_count(out, "compiled launches > 0",
			  delta(c, "kernels.launched.compiled") > 0, 1);
	ok &= check_count(out, "regions ran compiled", regions_compiled(c),
			  regions > 0 ? regions : -1);
	ok &= check_count(
	    out, "regions with frames",
	    (int64_t)epj_counter_get(c->ctx, "frames.ok") >= regions, 1);
	ok &= check_count(out, "eager arm compiled",
			  epj_counter_get(e->ctx, "kernels.launched.compiled"),
			  0);
	return ok;
}

/* What a world of one cannot tell apart, said; on several ranks, every
 * rank's verdict combined. */
static bool world_verdict(FILE *out, const epj_parity_opts *o, arm *e,
			  ej_comm *world, bool ok)
{
	/* what a world of one can and cannot tell apart */
	if (out && world->size == 1) {
		fprintf(out, "  world size 1: ZeRO stage 1 runs the same "
			     "computation as stage 0 (one shard)\n");
		if (o->async_split_plan)
			fprintf(out, "  world size 1: async split planning "
				     "runs the same computation as the "
				     "synchronous plan (no count exchange); "
				     "not a distinct code path\n");
	}
	if (world->size > 1) {
		/* every rank compares its own batch and experts: all must pass
		 */
		float f = ok ? 1.0f : 0.0f;
		if (ej_comm_allreduce(e->ctx, world, "parity.result", &f, 1) !=
		    EPJ_OK) {
			if (out)
				fprintf(out, "parity: %s\n",
					epj_ctx_error(e->ctx));
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
	return ok;
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
	epj_status st = run_arm(&e, &o, false);
	if (st != EPJ_OK) {
		if (out && e.ctx)
			fprintf(out, "parity: eager arm: %s\n",
				epj_ctx_error(e.ctx));
		arm_free(&e);
		return st;
	}
	st = run_arm(&c, &o, true);
	if (st != EPJ_OK) {
		if (out && c.ctx)
			fprintf(out, "parity: compiled arm: %s\n",
				epj_ctx_error(c.ctx));
		arm_free(&e);
		arm_free(&c);
		return st;
	}
	int regions = epj_engine_num_regions(c.eng);
	ej_comm *world = ej_comm_world();
	print_header(out, &o, &c, regions, world);
	bool ok = compare_values(out, &o, &e, &c, world);
	ok &= check_calls(out, &o, &e, &c, regions);
	ok = world_verdict(out, &o, &e, world, ok);
	if (out)
		fprintf(out, "parity: %s\n", ok ? "PASS" : "FAIL");
	*passed = ok;
	arm_free(&e);
	arm_free(&c);
	return EPJ_OK;
}
