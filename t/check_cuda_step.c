/* check_cuda_step.c -- suite "cuda_step": what one steady-state training
 * step costs on a cuda context, measured at the driver.
 *
 * Everything runs on the stand-in driver (t/fake_cuda.c, guarded: a host
 * read of device memory faults) with its kernels on cuda-sim, and the
 * stand-in cuBLASLt, through tu_fake_cuda_begin.  The numbers come from the
 * library's own driver counters (lib/device_cuda.c: "cuda.mem_alloc",
 * "cuda.mem_free", "cuda.bytes.d2h", ...), read before and after a step:
 *
 *  - test_step_steady: the tiny MoE model trained on one batch, with
 *    fixed routing (expert_parallel.fixed_routing: every step has the same
 *    shapes; with learned routing the experts' row counts move and the
 *    caching allocator, which reuses blocks of one size only, may still
 *    take a new block now and then) and gradient clipping that bites (AdamW
 * f32; SGD with momentum, f32 and bf16, whose update is proportional to the
 * clipped gradient).  After warm-up a step makes no cuMemAlloc and no cuMemFree
 * (every scratch buffer comes from the context's caching allocator) and copies
 * back only scalars and index data (D2H_MAX below): a few KB, where the
 *    gradients alone are about 28 KB; nothing is copied device to device
 *    (the gradients become .grad or the accumulator as they are made).  Losses,
 * gradient norms and updates match the same run on a cpu context.
 *  - test_norm_random: ej_optim on fresh random gradients of odd sizes
 *    (several chunks of the norm kernel, f32 and bf16 parameters, SGD and
 *    AdamW): the norm computed on the device equals the cpu context's to
 *    double rounding, the clipped updates agree, a NaN gradient gives a NaN
 *    norm and leaves every parameter as it was; a step copies 8 bytes back
 *    and allocates nothing.
 *  - test_sumsq_sim: the norm template (ej_tmpl_optim_sumsq) on cuda-sim
 *    against a double reference, f32 and bf16, empty spans included.
 */
#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_impl.h"
#include "core_impl.h"
#include "kernels.h"
#include "ops_impl.h"
#include "optim_impl.h"

#include "templates/args.h"

/* ---- the driver's counts ---------------------------------------------- */

typedef struct drv {
	int64_t alloc, free, d2h, h2d, d2d;
} drv;

static drv drv_now(epj_ctx *g)
{
	drv d = { epj_counter_get(g, "cuda.mem_alloc"),
		  epj_counter_get(g, "cuda.mem_free"),
		  epj_counter_get(g, "cuda.bytes.d2h"),
		  epj_counter_get(g, "cuda.bytes.h2d"),
		  epj_counter_get(g, "cuda.bytes.d2d") };
	return d;
}

static drv drv_since(epj_ctx *g, drv a)
{
	drv b = drv_now(g);
	drv d = { b.alloc - a.alloc, b.free - a.free, b.d2h - a.d2h,
		  b.h2d - a.h2d, b.d2d - a.d2d };
	return d;
}

/* A cuda context on the stand-in driver (tu_fake_cuda_begin). */
static epj_ctx *cuda_ctx_on(void)
{
	ck_assert(tu_fake_cuda_begin());
	epj_ctx *c = NULL;
	ck_assert_msg(epj_ctx_new("cuda", &c) == EPJ_OK && c,
		      "epj_ctx_new(\"cuda\") on the stand-in driver failed");
	ck_assert(!c->dev->host_visible);
	epj_ctx_seed(c, tu_seed());
	return c;
}

/* ---- a steady-state step of the tiny model ------------------------------ */

/* The gradient norm is clipped to this (the model's is about 1 to 3). */
#define CLIP  0.25
#define STEPS 5
#define WARM  3 /* steps before the measured ones */
/* Bytes a steady step may copy to the host: scalars and index data.
 * Measured (f32, 2 x 9 tokens) 4044 bytes: the loss (4) and the norm (8);
 * ids and targets read for their range checks by the embedding and the
 * cross-entropy, forward and backward (4 x 144); the routing indices the
 * AutoEP layer reads (288 each) and the expert counts of the grouped GEMMs
 * (18 x 32); the RoPE tables, which epj_tensor_from_f64 reads before
 * writing them (2 x 288).  The gradients alone are about 28 KB.  And what
 * the optimizer adds to a forward + backward of the same batch: the norm,
 * nothing else (OPT_D2H_MAX). */
#define D2H_MAX	    8192
#define OPT_D2H_MAX 64

typedef struct run {
	epj_ctx *ctx;
	epj_model *m;
	epj_engine *e;
	double loss[STEPS], norm[STEPS];
	drv step[STEPS]; /* cuda: the driver's counts per step */
	drv fb;		 /* cuda: of a forward + backward of the batch */
	int n_params;
	double **init, **after;
} run;

static double **param_values(epj_ctx *ctx, const epj_model *m)
{
	int n = epj_model_num_params(m);
	double **v = calloc((size_t)n, sizeof *v);
	ck_assert_ptr_nonnull(v);
	for (int i = 0; i < n; i++)
		v[i] = tu_values(ctx, epj_model_param(m, i));
	return v;
}

static void values_free(double **v, int n)
{
	for (int i = 0; i < n && v; i++)
		free(v[i]);
	free(v);
}

/* STEPS training steps of the model on ctx, all on the same batch with
 * fixed routing (the shapes of a step are then the shapes of the one
 * before: the steady state of a loop over equal batches). */
static void run_steps(run *r, epj_ctx *ctx, const char *model_path,
		      uint64_t seed, bool bf16, bool sgd)
{
	r->ctx = ctx;
	epj_model_opts o = { .layout = EPJ_LAYOUT_NESTED,
			     .seed = seed,
			     .dtype = bf16 ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32 };
	ck_assert_msg(epj_model_new(ctx, model_path, &o, &r->m) == EPJ_OK,
		      "model: %s", epj_ctx_error(ctx));
	char js[512];
	snprintf(js, sizeof js,
		 "{\"train_micro_batch_size_per_gpu\": 2, \"optimizer\": %s, "
		 "\"gradient_clipping\": %g, \"expert_parallel\": "
		 "{\"fixed_routing\": true}%s}",
		 sgd ? "{\"type\": \"SGD\", \"params\": {\"lr\": 0.2, "
		       "\"momentum\": 0.9}}"
		     : "{\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, "
		       "\"weight_decay\": 0.01}}",
		 CLIP, bf16 ? ", \"bf16\": {\"enabled\": true}" : "");
	ck_assert_msg(epj_engine_initialize_json(ctx, r->m, js, "step.json",
						 &r->e) == EPJ_OK,
		      "engine: %s", epj_ctx_error(ctx));
	r->n_params = epj_model_num_params(r->m);
	r->init = param_values(ctx, r->m);
	epj_corpus *c = epj_corpus_synthetic(ctx, 16, seed + 5);
	tu_ok(ctx, c);
	epj_tensor *ids = NULL, *labels = NULL;
	tu_next_batch_varied(ctx, c, 2, 9, &ids, &labels);
	const bool dev = !ctx->dev->host_visible;
	for (int s = 0; s < STEPS; s++) {
		epj_step_info info;
		drv d0 = dev ? drv_now(ctx) : (drv){ 0 };
		ck_assert_msg(epj_engine_train_step(r->e, ids, labels, &info) ==
				  EPJ_OK,
			      "train step %d on %s: %s", s, ctx->dev->name,
			      epj_ctx_error(ctx));
		if (dev)
			r->step[s] = drv_since(ctx, d0);
		ck_assert(info.stepped);
		r->loss[s] = info.mean_loss;
		r->norm[s] = info.grad_norm;
	}
	r->after = param_values(ctx, r->m);
	if (dev) {
		/* what the step costs without the optimizer */
		epj_tensor *loss = NULL;
		drv d0 = drv_now(ctx);
		ck_assert_msg(epj_model_forward(ctx, r->m, ids, labels, NULL,
						&loss) == EPJ_OK,
			      "forward: %s", epj_ctx_error(ctx));
		(void)epj_tensor_get_f64(loss, 0); /* as the engine reads it */
		ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK,
			      "backward: %s", epj_ctx_error(ctx));
		r->fb = drv_since(ctx, d0);
		epj_tensor_free(loss);
		for (int i = 0; i < r->n_params; i++)
			epj_tensor_zero_grad(epj_model_param(r->m, i));
	}
	epj_tensor_free(ids);
	epj_tensor_free(labels);
	epj_corpus_free(c);
}

static void run_free(run *r)
{
	values_free(r->init, r->n_params);
	values_free(r->after, r->n_params);
	epj_engine_free(r->e);
	epj_model_free(r->m);
	epj_ctx_free(r->ctx);
}

/* _i 0: f32 parameters, AdamW; 1: f32, SGD; 2: bf16, SGD. */
START_TEST(test_step_steady)
{
	if (!tu_fake_cuda_usable())
		return;
	const bool bf16 = _i == 2, sgd = _i >= 1;
	uint64_t seed = tu_seed() % 100000 + 1;
	tu_tmpfile cfg =
	    tu_tmpfile_new("cudastep", "config.json", TU_TINY_MOE_JSON);
	run c = { 0 }, g = { 0 };
	run_steps(&c, tu_ctx(), cfg.path, seed, bf16, sgd);
	epj_ctx *gc = cuda_ctx_on();
	run_steps(&g, gc, cfg.path, seed, bf16, sgd);
	tu_tmpfile_free(&cfg);

	/* the counters are the driver's: the first step allocated */
	ck_assert_msg(g.step[0].alloc > 0,
		      "cuda.mem_alloc counted nothing in the first step");
	for (int s = WARM; s < STEPS; s++) {
		const drv *d = &g.step[s];
		ck_assert_msg(d->alloc == 0 && d->free == 0,
			      "steady step %d: %lld cuMemAlloc and %lld "
			      "cuMemFree reached the driver",
			      s, (long long)d->alloc, (long long)d->free);
		ck_assert_msg(d->d2h > 0 && d->d2h <= D2H_MAX,
			      "steady step %d: %lld bytes copied to the host "
			      "(at most %d: scalars and indices, no gradient "
			      "or parameter)",
			      s, (long long)d->d2h, D2H_MAX);
		/* the optimizer's part: the norm (8 bytes), no gradient,
		 * master or parameter */
		int64_t opt = d->d2h - g.fb.d2h;
		ck_assert_msg(opt >= 8 && opt <= OPT_D2H_MAX,
			      "steady step %d: %lld bytes copied to the host "
			      "beyond a forward + backward (%lld): the "
			      "optimizer copies the norm only",
			      s, (long long)opt, (long long)g.fb.d2h);
		/* and sends at most its descriptors, one per parameter for
		 * the norm and one for the update, whatever the sizes
		 * (before, 16 bytes per 2048 elements more) */
		/* no gradient is copied on the device: each parameter's
		 * first gradient becomes its .grad, or (bf16) is cast into
		 * the f32 accumulator in one kernel (before, about 28 KB a
		 * step: every gradient copied once more) */
		ck_assert_msg(d->d2d == 0,
			      "steady step %d: %lld bytes copied device to "
			      "device",
			      s, (long long)d->d2d);
		int64_t oh = d->h2d - g.fb.h2d;
		int64_t oh_max = 2 * (int64_t)g.n_params *
				 (int64_t)sizeof(struct ej_optim_tensor);
		ck_assert_msg(
		    oh <= oh_max,
		    "steady step %d: %lld bytes copied to the device "
		    "beyond a forward + backward (%lld), at most %lld",
		    s, (long long)oh, (long long)g.fb.h2d, (long long)oh_max);
	}
	/* bf16: the gradients accumulate in kept f32 buffers, so the
	 * descriptors do not change after the first step: copied once */
	if (bf16)
		ck_assert_int_eq(epj_counter_get(gc, "optim.table_uploads"), 2);
	ck_assert_int_eq(epj_counter_get(gc, "kernels.eager_cpu_fallback"), 0);
	ck_assert_int_eq(epj_counter_get(gc, "optim.steps.device"), STEPS);
	ck_assert_int_eq(epj_counter_get(gc, "optim.grad_norm.device"), STEPS);

	/* the same numbers as the cpu context: loss, the norm before
	 * clipping (which bites: the update is the clipped one) and the
	 * parameters after every update */
	const double tol = bf16 ? 3e-2 : 2e-4;
	for (int s = 0; s < STEPS; s++) {
		ck_assert_msg(fabs(g.loss[s] - c.loss[s]) <=
				  tol * (1 + fabs(c.loss[s])),
			      "step %d loss: cuda %.9g vs cpu %.9g", s,
			      g.loss[s], c.loss[s]);
		ck_assert_msg(c.norm[s] > CLIP, "step %d: norm %g, no clipping",
			      s, c.norm[s]);
		ck_assert_msg(fabs(g.norm[s] - c.norm[s]) <= tol * c.norm[s],
			      "step %d grad norm: cuda %.9g vs cpu %.9g", s,
			      g.norm[s], c.norm[s]);
	}
	/* the parameters: AdamW's steps (about lr each, whatever the
	 * gradient's scale) against the values; SGD's updates, which scale
	 * with the clipped gradient, against the largest update (bf16: plus
	 * one rounding of the value to bf16).  AdamW divides by the root of
	 * the squared gradients, so an element whose gradient nearly cancels
	 * (the two devices summing in different orders) may differ more:
	 * over 8 seeds most elements agreed to 6e-5 and 2 of 6896 (one seed)
	 * by up to 1.7e-4.  So AdamW allows 1 in 1000 elements up to a tenth
	 * of one step (1e-3) beyond the bound. */
	int64_t loose = 0, total = 0;
	double moved = 0;
	for (int i = 0; i < c.n_params; i++) {
		int64_t n = epj_tensor_numel(epj_model_param(c.m, i));
		for (int64_t k = 0; k < n; k++)
			moved = fmax(moved, fabs(c.after[i][k] - c.init[i][k]));
	}
	for (int i = 0; i < c.n_params; i++) {
		const char *nm = epj_model_param_name(c.m, i);
		int64_t n = epj_tensor_numel(epj_model_param(c.m, i));
		for (int64_t k = 0; k < n; k++) {
			double dg = g.after[i][k] - g.init[i][k];
			double dc = c.after[i][k] - c.init[i][k];
			double b =
			    !sgd    ? 1e-4 * (1 + fabs(c.after[i][k]))
			    : !bf16 ? 1e-5 * moved + 1e-7
				    : 3e-2 * moved + fabs(c.after[i][k]) / 128;
			tu_assert(g.init[i][k] == c.init[i][k]);
			total++;
			if (!sgd && fabs(dg - dc) > b &&
			    fabs(dg - dc) <= 1e-3) {
				loose++;
				continue;
			}
			ck_assert_msg(fabs(dg - dc) <= b,
				      "%s[%lld] after %d steps: update cuda "
				      "%.9g vs cpu %.9g (largest %.3g)",
				      nm, (long long)k, STEPS, dg, dc, moved);
		}
	}
	ck_assert_msg(loose * 1000 <= total,
		      "%lld of %lld AdamW updates beyond 1e-4 of the cpu's",
		      (long long)loose, (long long)total);
	ck_assert_msg(moved > 1e-3, "the updates moved nothing (%g)", moved);
	run_free(&c);
	run_free(&g);
	tu_fake_cuda_end();
}
END_TEST

/* ---- the optimizer alone, on random gradients --------------------------- */

#define NP 4

/* A tensor of ctx with the values v (f32 or bf16). */
static epj_tensor *tensor_of(epj_ctx *ctx, epj_dtype dt, int nd,
			     const int64_t *shape, const double *v)
{
	epj_tensor *t = epj_zeros(ctx, dt, nd, shape);
	tu_ok(ctx, t);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, t, v), EPJ_OK);
	return t;
}

/* _i 0: SGD with momentum, f32; 1: AdamW with one bf16 parameter; 2:
 * AdamW, f32, and the last step's gradient holds a NaN. */
START_TEST(test_norm_random)
{
	if (!tu_fake_cuda_usable())
		return;
	epj_ctx *g = cuda_ctx_on();
	epj_ctx *c = tu_ctx();
	ej_config cfg;
	ej_config_defaults(&cfg);
	cfg.optimizer.type = _i == 0 ? EJ_OPTIM_SGD : EJ_OPTIM_ADAMW;
	cfg.optimizer.momentum = 0.9;
	cfg.optimizer.weight_decay = 0.01;
	cfg.optimizer.adam_w_mode = _i != 0;
	/* shapes: one element or a few, several 2048-element chunks of the
	 * norm kernel with a tail, odd 2-D */
	int64_t shapes[NP][2] = {
		{ tu_randint(1, 8), 1 },
		{ 2048 * tu_randint(1, 3) + tu_randint(1, 2047), 1 },
		{ 2 * tu_randint(5, 40) + 1, 2 * tu_randint(20, 70) + 1 },
		{ tu_randint(3000, 9000), 1 },
	};
	int nds[NP] = { 1, 1, 2, 1 };
	const char *names[NP] = { "a", "b", "c", "d" };
	epj_dtype dts[NP] = { EPJ_DTYPE_F32, EPJ_DTYPE_F32, EPJ_DTYPE_F32,
			      _i == 1 ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32 };
	epj_tensor *pg[NP], *pc[NP];
	int64_t numel = 0;
	for (int i = 0; i < NP; i++) {
		int64_t n = tu_numel(nds[i], shapes[i]);
		numel += n;
		double *v = malloc(sizeof *v * (size_t)n);
		ck_assert_ptr_nonnull(v);
		for (int64_t k = 0; k < n; k++)
			v[k] = tu_uniform(-1, 1);
		pg[i] = tensor_of(g, dts[i], nds[i], shapes[i], v);
		pc[i] = tensor_of(c, dts[i], nds[i], shapes[i], v);
		free(v);
	}
	/* gradients uniform in [-1, 1) times `scale`, times the grad_scale
	 * 0.5: a norm of about 0.5 sqrt(numel / 3) scale; clipped at half
	 * of that for scale 1 */
	cfg.gradient_clipping = 0.25 * sqrt((double)numel / 3.0);
	ej_optim *og = ej_optim_new(g, &cfg, pg, names, NP);
	ej_optim *oc = ej_optim_new(c, &cfg, pc, names, NP);
	tu_ok(g, og);
	tu_ok(c, oc);
	const int steps = 4;
	for (int s = 0; s < steps; s++) {
		/* scale 1: clipped; 0.1: not */
		double scale = s % 2 == 0 ? 1.0 : 0.1;
		bool nan = _i == 2 && s == steps - 1;
		for (int i = 0; i < NP; i++) {
			int64_t n = tu_numel(nds[i], shapes[i]);
			double *v = malloc(sizeof *v * (size_t)n);
			ck_assert_ptr_nonnull(v);
			for (int64_t k = 0; k < n; k++)
				v[k] = scale * tu_uniform(-1, 1);
			if (nan && i == 2)
				v[tu_randint(0, n)] = NAN;
			epj_tensor *gg =
			    tensor_of(g, dts[i], nds[i], shapes[i], v);
			epj_tensor *gcpu =
			    tensor_of(c, dts[i], nds[i], shapes[i], v);
			epj_tensor_set_grad(pg[i], gg);
			epj_tensor_set_grad(pc[i], gcpu);
			epj_tensor_free(gg);
			epj_tensor_free(gcpu);
			free(v);
		}
		double *before[NP];
		for (int i = 0; i < NP; i++)
			before[i] = tu_values(g, pg[i]);
		double ng = -1, nc = -1, lr = _i == 0 ? 0.05 : 0.01;
		drv d0 = drv_now(g);
		ck_assert_msg(ej_optim_step(og, lr, 0.5, &ng) == EPJ_OK, "%s",
			      epj_ctx_error(g));
		drv d = drv_since(g, d0);
		ck_assert_int_eq(ej_optim_step(oc, lr, 0.5, &nc), EPJ_OK);
		/* only the norm comes back, and after the first step every
		 * buffer is a cached block */
		ck_assert_msg(d.d2h <= 64,
			      "step %d: %lld bytes copied to the host", s,
			      (long long)d.d2h);
		/* the descriptors go to the device (new gradients: new
		 * pointers), one per parameter for the norm and one for
		 * the update, however many 2048-element blocks each has */
		ck_assert_msg(
		    d.h2d <= 2 * NP * (int64_t)sizeof(struct ej_optim_tensor),
		    "step %d: %lld bytes copied to the device", s,
		    (long long)d.h2d);
		if (s > 0)
			ck_assert_msg(d.alloc == 0 && d.free == 0,
				      "step %d: %lld cuMemAlloc, %lld "
				      "cuMemFree",
				      s, (long long)d.alloc, (long long)d.free);
		if (nan) {
			ck_assert_msg(isnan(ng) && isnan(nc),
				      "NaN gradient: norm cuda %g, cpu %g", ng,
				      nc);
			for (int i = 0; i < NP; i++) {
				tu_assert_close(g, pg[i], before[i], 0, 0,
						"parameter after a NaN norm");
				ck_assert_ptr_null(epj_tensor_grad(pg[i]));
			}
			ck_assert_int_eq(ej_optim_step_count(og), s);
		} else {
			/* both sum f32 squares in double, in two orders */
			ck_assert_msg(fabs(ng - nc) <= 1e-12 * nc,
				      "step %d: norm cuda %.17g, cpu %.17g", s,
				      ng, nc);
			ck_assert_msg((nc > cfg.gradient_clipping) ==
					  (s % 2 == 0),
				      "step %d: norm %g against clip %g", s, nc,
				      cfg.gradient_clipping);
			for (int i = 0; i < NP; i++) {
				double *want = tu_values(c, pc[i]);
				char what[64];
				snprintf(what, sizeof what, "step %d param %s",
					 s, names[i]);
				tu_assert_close(g, pg[i], want,
						dts[i] == EPJ_DTYPE_BF16 ? 8e-3
									 : 2e-6,
						1e-7, what);
				free(want);
			}
		}
		for (int i = 0; i < NP; i++)
			free(before[i]);
	}
	ck_assert_int_eq(epj_counter_get(g, "optim.grad_norm.device"), steps);
	ck_assert_int_eq(epj_counter_get(c, "optim.grad_norm.device"), 0);
	ej_optim_free(og);
	ej_optim_free(oc);
	for (int i = 0; i < NP; i++) {
		epj_tensor_free(pg[i]);
		epj_tensor_free(pc[i]);
	}
	epj_ctx_free(g);
	epj_ctx_free(c);
	tu_fake_cuda_end();
}
END_TEST

/* ---- the norm template on cuda-sim -------------------------------------- */

START_TEST(test_sumsq_sim)
{
	epj_ctx *ctx = tu_ctx();
	for (int dt = 0; dt < 2; dt++) {
		epj_dtype gdt = dt ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32;
		int n = (int)tu_randint(1, 6);
		ej_tmpl_optim_span sp[6];
		void *buf[6];
		double want = 0;
		for (int i = 0; i < n; i++) {
			/* empty spans anywhere: a block's search for its
			 * tensor passes over them */
			int64_t len = i == 0 || tu_randint(0, 3) == 0
					  ? 0
					  : tu_randint(1, 5000);
			size_t es = dt ? 2 : 4;
			buf[i] = malloc(es * (size_t)(len ? len : 1));
			ck_assert_ptr_nonnull(buf[i]);
			for (int64_t k = 0; k < len; k++) {
				float x = (float)tu_uniform(-3, 3);
				double xv;
				if (dt) {
					uint16_t b = ej_bf16_store(x);
					((uint16_t *)buf[i])[k] = b;
					xv = ej_bf16_load(b);
				} else {
					((float *)buf[i])[k] = x;
					xv = x;
				}
				want += xv * xv;
			}
			sp[i].grad = buf[i];
			sp[i].n = len;
		}
		/* the same spans twice through one kept table (the second
		 * call copies nothing), then through none */
		ej_tmpl_optim_table *tab = ej_tmpl_optim_table_new(ctx, 0);
		ck_assert_ptr_nonnull(tab);
		for (int rep = 0; rep < 3; rep++) {
			int64_t up =
			    epj_counter_get(ctx, "optim.table_uploads");
			int64_t re = epj_counter_get(ctx, "optim.table_reused");
			double ss = -1;
			ck_assert_msg(ej_tmpl_optim_sumsq(
					  ctx, "cuda-sim", gdt, sp, n,
					  rep < 2 ? tab : NULL, &ss) == EPJ_OK,
				      "%s", epj_ctx_error(ctx));
			ck_assert_msg(fabs(ss - want) <= 1e-12 * want,
				      "%s: sum of squares %.17g, reference "
				      "%.17g (call %d)",
				      epj_dtype_name(gdt), ss, want, rep);
			bool any = want > 0;
			ck_assert_int_eq(
			    epj_counter_get(ctx, "optim.table_uploads") - up,
			    any && rep == 0);
			ck_assert_int_eq(
			    epj_counter_get(ctx, "optim.table_reused") - re,
			    any && rep == 1);
		}
		double z = -1;
		ck_assert_int_eq(
		    ej_tmpl_optim_sumsq(ctx, "cuda-sim", gdt, sp, 1, tab, &z),
		    EPJ_OK);
		ck_assert(z == 0); /* only the empty span */
		ej_tmpl_optim_table_free(ctx, tab);
		for (int i = 0; i < n; i++)
			free(buf[i]);
	}
	/* refused: another dtype */
	double ss;
	ej_tmpl_optim_span one = { "", 0 };
	ck_assert_int_eq(ej_tmpl_optim_sumsq(ctx, "cuda-sim", EPJ_DTYPE_F64,
					     &one, 1, NULL, &ss),
			 EPJ_ERR_DTYPE);
	tu_assert_ctx_error(ctx, EPJ_ERR_DTYPE,
			    TU_STRS("gradient norm", "f64"));
	epj_ctx_free(ctx);
}
END_TEST

/* In the gpu suite: the same cases on the machine's driver. */
void tu_add_gpu_step_cases(Suite *s)
{
	TCase *tc = tcase_create("gpu_step");
	tcase_set_timeout(tc, 600);
	tcase_add_checked_fixture(tc, tu_gpu_setup, tu_gpu_teardown);
	if (tu_gpu_wanted()) {
		tu_add_loop_test(tc, test_norm_random, 3);
		tu_add_loop_test(tc, test_step_steady, 3);
	}
	suite_add_tcase(s, tc);
}

Suite *make_cuda_step_suite(void);
Suite *make_cuda_step_suite(void)
{
	Suite *s = suite_create("cuda_step");
	TCase *tc = tcase_create("cuda_step");
	tcase_set_timeout(tc, 600);
	tcase_add_test(tc, test_sumsq_sim);
	tu_add_loop_test(tc, test_norm_random, 3);
	tu_add_loop_test(tc, test_step_steady, 3);
	suite_add_tcase(s, tc);
	return s;
}
