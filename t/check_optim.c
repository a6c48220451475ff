/* check_optim.c -- optimizers on FP32 masters, clipping, accumulation,
 * checkpoint state and DeepSpeed's learning-rate schedules.
 *
 * Every update is checked against a reference written here in double from
 * PyTorch's formulas (torch.optim.SGD / Adam / AdamW, single-tensor path,
 * including SGD's "first step: buf = g.clone()"), fed with the same random
 * gradients.  The schedules are checked against values worked out by hand
 * from deepspeed/runtime/lr_schedules.py, with DeepSpeed's engine order
 * (scheduler stepped after the optimizer: optimizer step k runs at
 * last_batch_iteration k - 1).
 */
#include "check_util.h"

#include "config_impl.h"
#include "optim_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- reference optimizer (double) -----------------------------------------
 */

#define MAXP 4

typedef struct ref_opt {
	ej_optim_type type;
	double mom, b1, b2, eps, wd;
	bool nesterov, decoupled;
	int n;
	int64_t numel[MAXP];
	double *p[MAXP], *s1[MAXP], *s2[MAXP];
	bool started[MAXP]; /* SGD: momentum buffer exists */
	int64_t t;
} ref_opt;

static void ref_init(ref_opt *r, const ej_config *cfg, epj_ctx *ctx,
		     epj_tensor *const *params, int n)
{
	memset(r, 0, sizeof *r);
	r->type = cfg->optimizer.type;
	r->mom = cfg->optimizer.momentum;
	r->nesterov = cfg->optimizer.nesterov;
	r->b1 = cfg->optimizer.betas[0];
	r->b2 = cfg->optimizer.betas[1];
	r->eps = cfg->optimizer.eps;
	r->wd = cfg->optimizer.weight_decay;
	r->decoupled = r->type == EJ_OPTIM_ADAMW ||
		       (r->type == EJ_OPTIM_ADAM && cfg->optimizer.adam_w_mode);
	r->n = n;
	for (int i = 0; i < n; i++) {
		r->numel[i] = epj_tensor_numel(params[i]);
		r->p[i] = tu_values(ctx, params[i]);
		r->s1[i] = calloc((size_t)r->numel[i], sizeof(double));
		r->s2[i] = calloc((size_t)r->numel[i], sizeof(double));
	}
}

static void ref_free(ref_opt *r)
{
	for (int i = 0; i < r->n; i++) {
		free(r->p[i]);
		free(r->s1[i]);
		free(r->s2[i]);
	}
}

/* One step with final gradients g[i] (already scaled and clipped; NULL: the
 * parameter has no gradient and is skipped). */
static void ref_step(ref_opt *r, double lr, double *const *g)
{
	r->t++;
	for (int i = 0; i < r->n; i++) {
		if (!g[i])
			continue;
		double *p = r->p[i], *b = r->s1[i], *v = r->s2[i];
		for (int64_t k = 0; k < r->numel[i]; k++) {
			double gk = g[i][k];
			if (r->type == EJ_OPTIM_SGD) {
				gk += r->wd * p[k];
				if (r->mom > 0) {
					if (!r->started[i])
						b[k] = gk;
					else
						b[k] = r->mom * b[k] + gk;
					gk = r->nesterov ? gk + r->mom * b[k]
							 : b[k];
				}
				p[k] -= lr * gk;
				continue;
			}
			if (r->decoupled)
				p[k] *= 1 - lr * r->wd;
			else
				gk += r->wd * p[k];
			b[k] += (gk - b[k]) * (1 - r->b1); /* lerp_ */
			v[k] = v[k] * r->b2 + (1 - r->b2) * gk * gk;
			double bc1 = 1 - pow(r->b1, (double)r->t);
			double bc2 = 1 - pow(r->b2, (double)r->t);
			double denom = sqrt(v[k]) / sqrt(bc2) + r->eps;
			p[k] -= lr / bc1 * b[k] / denom;
		}
		r->started[i] = true;
	}
}

/* Scales gr[i] (raw accumulated gradients, NULL = none) by scale and by
 * DeepSpeed's clipping factor; returns the pre-clip norm. */
static double ref_scale_clip(double *const *gr, const int64_t *numel, int n,
			     double scale, double clip)
{
	double ss = 0;
	for (int i = 0; i < n; i++)
		for (int64_t k = 0; gr[i] && k < numel[i]; k++) {
			gr[i][k] *= scale;
			ss += gr[i][k] * gr[i][k];
		}
	double norm = sqrt(ss);
	double coef = clip > 0 ? clip / (norm + 1e-6) : 1;
	if (coef < 1)
		for (int i = 0; i < n; i++)
			for (int64_t k = 0; gr[i] && k < numel[i]; k++)
				gr[i][k] *= coef;
	return norm;
}

/* ---- helpers ----------------------------------------------------------------
 */

static const int64_t shapes[MAXP][2] = {
	{ 3, 5 }, { 7, 1 }, { 13, 3 }, { 5, 1 }
};
static const int ndims[MAXP] = { 2, 1, 2, 1 };
static const char *const pnames[MAXP] = { "model.a.weight", "model.b.bias",
					  "model.layers.0.mlp.gate.weight",
					  "lm_head.bias" };

static ej_config make_cfg(ej_optim_type type, double wd)
{
	ej_config cfg;
	ej_config_defaults(&cfg);
	cfg.optimizer.type = type;
	cfg.optimizer.weight_decay = wd;
	cfg.optimizer.betas[0] = tu_uniform(0.8, 0.95);
	cfg.optimizer.betas[1] = tu_uniform(0.9, 0.999);
	cfg.optimizer.eps =
	    type == EJ_OPTIM_SGD ? 1e-8 : tu_uniform(1e-8, 1e-3);
	cfg.optimizer.adam_w_mode = type == EJ_OPTIM_ADAMW;
	return cfg;
}

/* A fresh copy of t (contiguous, same dtype). */
static epj_tensor *clone(epj_ctx *ctx, epj_tensor *t)
{
	epj_tensor *c = epj_zeros(ctx, epj_tensor_dtype(t), epj_tensor_ndim(t),
				  epj_tensor_shape(t));
	tu_ok(ctx, c);
	ck_assert_int_eq(epj_tensor_copy_(ctx, c, t), EPJ_OK);
	return c;
}

/* Random gradient for p (p's dtype), sometimes stored non-contiguously;
 * its values (as stored) go to *vals. */
static epj_tensor *rand_grad(epj_ctx *ctx, epj_tensor *p, double **vals)
{
	epj_tensor *g = tu_randn(ctx, epj_tensor_dtype(p), epj_tensor_ndim(p),
				 epj_tensor_shape(p));
	if (tu_randint(0, 2)) {
		epj_tensor *nc = tu_noncontig(ctx, g);
		epj_tensor_free(g);
		g = nc;
	}
	*vals = tu_values(ctx, g);
	return g;
}

static bool f32_bits_eq_bf16(float m, const epj_tensor *p, int64_t k)
{
	return epj_tensor_get_f64(p, k) ==
	       (double)epj_bf16_to_f32(epj_f32_to_bf16(m));
}

/* ---- tests ----------------------------------------------------------------
 */

/* Every optimizer flavour on f32 parameters over a few steps, one of them
 * large enough for the parallel loops and several norm chunks. */
START_TEST(test_f32_updates)
{
	struct {
		ej_optim_type type;
		double mom, wd;
		bool nesterov, adam_w_mode;
	} cases[] = {
		{ EJ_OPTIM_SGD, 0, 0, false, false },
		{ EJ_OPTIM_SGD, 0.9, 0.01, false, false },
		{ EJ_OPTIM_SGD, 0.7, 0.05, true, false },
		{ EJ_OPTIM_ADAM, 0, 0.03, false, false },
		{ EJ_OPTIM_ADAM, 0, 0.03, false, true },
		{ EJ_OPTIM_ADAMW, 0, 0.1, false, true },
	};
	for (size_t c = 0; c < EJ_ARRAY_LEN(cases); c++) {
		epj_ctx *ctx = tu_ctx();
		ej_config cfg = make_cfg(cases[c].type, cases[c].wd);
		cfg.optimizer.momentum = cases[c].mom;
		cfg.optimizer.nesterov = cases[c].nesterov;
		cfg.optimizer.adam_w_mode = cases[c].adam_w_mode;
		int n = 3;
		epj_tensor *params[MAXP];
		for (int i = 0; i < n; i++)
			params[i] =
			    tu_randn(ctx, EPJ_DTYPE_F32, ndims[i], shapes[i]);
		if (c == 1) { /* > PAR_MIN elements: parallel paths */
			epj_tensor_free(params[2]);
			params[2] = tu_randn(ctx, EPJ_DTYPE_F32, 2,
					     (int64_t[]){ 181, 203 });
		}
		ej_optim *o = ej_optim_new(ctx, &cfg, params, pnames, n);
		tu_ok(ctx, o);
		ck_assert_ptr_eq(ej_optim_master(o, 0), params[0]);
		ref_opt r;
		ref_init(&r, &cfg, ctx, params, n);
		for (int s = 0; s < 4; s++) {
			double lr = cases[c].type == EJ_OPTIM_SGD
					? tu_uniform(0.05, 0.5)
					: tu_uniform(0.005, 0.05);
			double scale = tu_uniform(0.2, 1.0);
			double *gv[MAXP];
			for (int i = 0; i < n; i++) {
				epj_tensor *g =
				    rand_grad(ctx, params[i], &gv[i]);
				epj_tensor_set_grad(params[i], g);
				epj_tensor_free(g);
			}
			double norm = -1;
			ck_assert_int_eq(ej_optim_step(o, lr, scale, &norm),
					 EPJ_OK);
			double rnorm = ref_scale_clip(gv, r.numel, n, scale, 0);
			ck_assert_msg(fabs(norm - rnorm) <= 1e-9 * rnorm,
				      "case %zu step %d: norm %.10g, ref %.10g",
				      c, s, norm, rnorm);
			ref_step(&r, lr, gv);
			for (int i = 0; i < n; i++) {
				char what[64];
				snprintf(what, sizeof what,
					 "case %zu step %d p%d", c, s, i);
				tu_assert_close(ctx, params[i], r.p[i], 2e-6,
						1e-6, what);
				ck_assert_ptr_null(epj_tensor_grad(params[i]));
				free(gv[i]);
			}
		}
		ck_assert_int_eq(ej_optim_step_count(o), 4);
		ref_free(&r);
		ej_optim_free(o);
		for (int i = 0; i < n; i++)
			epj_tensor_free(params[i]);
		epj_ctx_free(ctx);
	}
}
END_TEST

/* bf16 parameters: the master is f32 and the parameter is RNE(master) after
 * every step; a non-contiguous bf16 parameter is written through its
 * strides.  The first parameter spans two full update blocks and a part
 * of a third (the dense one's copy is written block by block). */
START_TEST(test_bf16_master)
{
	ej_optim_type types[] = { EJ_OPTIM_SGD, EJ_OPTIM_ADAMW };
	for (size_t c = 0; c < EJ_ARRAY_LEN(types); c++) {
		epj_ctx *ctx = tu_ctx();
		ej_config cfg = make_cfg(types[c], 0.02);
		cfg.optimizer.momentum = 0.9;
		int n = 3;
		epj_tensor *params[MAXP];
		params[0] =
		    tu_randn(ctx, EPJ_DTYPE_BF16, 2, (int64_t[]){ 3, 2767 });
		epj_tensor *tmp =
		    tu_randn(ctx, EPJ_DTYPE_BF16, ndims[1], shapes[1]);
		params[1] = tu_noncontig(ctx, tmp);
		epj_tensor_free(tmp);
		params[2] = tu_randn(ctx, EPJ_DTYPE_F32, ndims[2], shapes[2]);
		ej_optim *o = ej_optim_new(ctx, &cfg, params, pnames, n);
		tu_ok(ctx, o);
		for (int i = 0; i < 2; i++) {
			epj_tensor *m = ej_optim_master(o, i);
			ck_assert_int_eq(epj_tensor_dtype(m), EPJ_DTYPE_F32);
			ck_assert(!epj_tensor_shares_storage(m, params[i]));
			double *pv = tu_values(ctx, params[i]);
			tu_assert_close(ctx, m, pv, 0, 0, "initial master");
			free(pv);
		}
		ref_opt r;
		ref_init(&r, &cfg, ctx, params, n);
		for (int s = 0; s < 3; s++) {
			double lr = tu_uniform(0.01, 0.1);
			double *gv[MAXP];
			for (int i = 0; i < n; i++) {
				epj_tensor *g =
				    rand_grad(ctx, params[i], &gv[i]);
				epj_tensor_set_grad(params[i], g);
				epj_tensor_free(g);
			}
			ck_assert_int_eq(ej_optim_step(o, lr, 1.0, NULL),
					 EPJ_OK);
			ref_step(&r, lr, gv);
			for (int i = 0; i < n; i++) {
				char what[64];
				snprintf(what, sizeof what,
					 "type %zu step %d p%d", c, s, i);
				epj_tensor *m = ej_optim_master(o, i);
				tu_assert_close(ctx, m, r.p[i], 2e-6, 1e-6,
						what);
				const float *md = epj_tensor_data(m);
				for (int64_t k = 0; i < 2 && k < r.numel[i];
				     k++)
					ck_assert_msg(f32_bits_eq_bf16(
							  md[k], params[i], k),
						      "%s: param[%lld] is not "
						      "RNE(master)",
						      what, (long long)k);
				free(gv[i]);
			}
		}
		ref_free(&r);
		ej_optim_free(o);
		for (int i = 0; i < n; i++)
			epj_tensor_free(params[i]);
		epj_ctx_free(ctx);
	}
}
END_TEST

static epj_tensor *dot_loss(epj_ctx *ctx, epj_tensor *p, epj_tensor *w)
{
	epj_tensor *y = epj_mul(ctx, p, w);
	epj_tensor *s = epj_sum_all(ctx, y);
	epj_tensor_free(y);
	tu_ok(ctx, s);
	return s;
}

/* Three micro-batches through real backward passes with grad_scale 1/3
 * equal one step with the mean gradient (written into the optimizer's own
 * accumulators through ej_optim_grad). */
START_TEST(test_accumulate)
{
	epj_ctx *ctx = tu_ctx();
	ej_config cfg = make_cfg(EJ_OPTIM_SGD, 0);
	cfg.optimizer.momentum = 0.5;
	epj_dtype dts[3] = { EPJ_DTYPE_BF16, EPJ_DTYPE_F32, EPJ_DTYPE_BF16 };
	int n = 3;
	epj_tensor *pa[MAXP], *pb[MAXP];
	for (int i = 0; i < n; i++) {
		pa[i] = tu_randn(ctx, dts[i], ndims[i], shapes[i]);
		pb[i] = clone(ctx, pa[i]);
		epj_tensor_set_requires_grad(pa[i], true);
	}
	ej_optim *oa = ej_optim_new(ctx, &cfg, pa, pnames, n);
	ej_optim *ob = ej_optim_new(ctx, &cfg, pb, pnames, n);
	tu_ok(ctx, oa);
	tu_ok(ctx, ob);
	double *mean[MAXP], *ref[MAXP];
	for (int i = 0; i < n; i++) {
		int64_t ne = epj_tensor_numel(pa[i]);
		mean[i] = calloc((size_t)ne, sizeof(double));
		ref[i] = tu_values(ctx, pa[i]);
	}
	for (int mb = 0; mb < 3; mb++) {
		for (int i = 0; i < n; i++) {
			epj_tensor *w =
			    tu_randn(ctx, dts[i], ndims[i], shapes[i]);
			double *wv = tu_values(ctx, w);
			for (int64_t k = 0; k < epj_tensor_numel(w); k++)
				mean[i][k] += wv[k] / 3;
			free(wv);
			epj_tensor *loss = dot_loss(ctx, pa[i], w);
			ck_assert_int_eq(epj_backward(ctx, loss, NULL), EPJ_OK);
			epj_tensor_free(loss);
			epj_tensor_free(w);
		}
		ck_assert_int_eq(ej_optim_accumulate(oa), EPJ_OK);
		/* bf16 gradients moved into the accumulators, f32 kept */
		ck_assert_ptr_null(epj_tensor_grad(pa[0]));
		ck_assert_ptr_nonnull(epj_tensor_grad(pa[1]));
	}
	for (int i = 0; i < n; i++) {
		ck_assert_ptr_null(ej_optim_grad(ob, i, false));
		epj_tensor *g = ej_optim_grad(ob, i, true);
		tu_ok(ctx, g);
		ck_assert_int_eq(epj_tensor_dtype(g), EPJ_DTYPE_F32);
		ck_assert_int_eq(epj_tensor_from_f64(ctx, g, mean[i]), EPJ_OK);
	}
	double lr = tu_uniform(0.1, 1.0), na, nb;
	ck_assert_int_eq(ej_optim_step(oa, lr, 1.0 / 3, &na), EPJ_OK);
	ck_assert_int_eq(ej_optim_step(ob, lr, 1.0, &nb), EPJ_OK);
	ck_assert_msg(fabs(na - nb) <= 1e-6 * nb, "norms %g vs %g", na, nb);
	for (int i = 0; i < n; i++) {
		for (int64_t k = 0; k < epj_tensor_numel(pa[i]); k++)
			ref[i][k] -= lr * mean[i][k];
		tu_assert_close(ctx, ej_optim_master(oa, i), ref[i], 1e-6, 1e-6,
				"accumulated vs reference");
		tu_assert_tensors_close(ctx, ej_optim_master(oa, i),
					ej_optim_master(ob, i), 1e-6, 1e-6,
					"accumulated vs mean");
		free(mean[i]);
		free(ref[i]);
	}
	ej_optim_free(oa);
	ej_optim_free(ob);
	for (int i = 0; i < n; i++) {
		epj_tensor_free(pa[i]);
		epj_tensor_free(pb[i]);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Clipping: the reported norm is the pre-clip one; the update's norm is
 * the clip value; no clipping when the norm is below it or clip is 0. */
START_TEST(test_clipping)
{
	for (int c = 0; c < 3; c++) {
		epj_ctx *ctx = tu_ctx();
		ej_config cfg = make_cfg(EJ_OPTIM_SGD, 0);
		int n = 3;
		epj_tensor *params[MAXP];
		double *gv[MAXP], *before[MAXP];
		double scale = tu_uniform(0.3, 2.0), ss = 0;
		for (int i = 0; i < n; i++) {
			params[i] =
			    tu_randn(ctx, EPJ_DTYPE_F32, ndims[i], shapes[i]);
			before[i] = tu_values(ctx, params[i]);
			epj_tensor *g = rand_grad(ctx, params[i], &gv[i]);
			epj_tensor_set_grad(params[i], g);
			epj_tensor_free(g);
			for (int64_t k = 0; k < epj_tensor_numel(params[i]);
			     k++)
				ss += gv[i][k] * gv[i][k];
		}
		double true_norm = scale * sqrt(ss);
		double clip = c == 0   ? true_norm * tu_uniform(0.2, 0.8)
			      : c == 1 ? true_norm * tu_uniform(1.2, 2.0)
				       : 0;
		cfg.gradient_clipping = clip;
		ej_optim *o = ej_optim_new(ctx, &cfg, params, pnames, n);
		tu_ok(ctx, o);
		double norm;
		ck_assert_int_eq(ej_optim_step(o, 1.0, scale, &norm), EPJ_OK);
		ck_assert_msg(fabs(norm - true_norm) <= 1e-9 * true_norm,
			      "norm %.12g, expected %.12g", norm, true_norm);
		double rn = ref_scale_clip(gv, (int64_t[]){ 15, 7, 39 }, n,
					   scale, clip);
		ck_assert(fabs(rn - true_norm) <= 1e-12 * true_norm);
		double upd = 0;
		for (int i = 0; i < n; i++) {
			double *after = tu_values(ctx, params[i]);
			for (int64_t k = 0; k < epj_tensor_numel(params[i]);
			     k++) {
				double d = before[i][k] - after[k];
				upd += d * d;
				before[i][k] -= gv[i][k];
			}
			tu_assert_close(ctx, params[i], before[i], 1e-6, 1e-6,
					"clipped update");
			free(after);
			free(before[i]);
			free(gv[i]);
		}
		upd = sqrt(upd);
		double want = c == 0 ? clip : true_norm;
		ck_assert_msg(fabs(upd - want) <= 1e-5 * want,
			      "case %d: update norm %.9g, expected %.9g", c,
			      upd, want);
		ej_optim_free(o);
		for (int i = 0; i < n; i++)
			epj_tensor_free(params[i]);
		epj_ctx_free(ctx);
	}
}
END_TEST

static bool all_zero(epj_ctx *ctx, epj_tensor *t)
{
	double *v = tu_values(ctx, t);
	bool z = true;
	for (int64_t k = 0; k < epj_tensor_numel(t); k++)
		z = z && v[k] == 0;
	free(v);
	return z;
}

/* A parameter without gradient (an expert that got no tokens) is skipped
 * entirely: no weight decay, no momentum, state untouched.  When it gets a
 * gradient later, Adam's bias correction uses the global step count. */
START_TEST(test_no_grad_skipped)
{
	ej_optim_type types[] = { EJ_OPTIM_SGD, EJ_OPTIM_ADAMW, EJ_OPTIM_ADAM };
	for (size_t c = 0; c < EJ_ARRAY_LEN(types); c++) {
		epj_ctx *ctx = tu_ctx();
		ej_config cfg = make_cfg(types[c], 0.1);
		cfg.optimizer.momentum = 0.9;
		int n = 3;
		epj_dtype dts[3] = { EPJ_DTYPE_F32, EPJ_DTYPE_F32,
				     EPJ_DTYPE_BF16 };
		epj_tensor *params[MAXP], *orig[MAXP];
		for (int i = 0; i < n; i++) {
			params[i] = tu_randn(ctx, dts[i], ndims[i], shapes[i]);
			orig[i] = clone(ctx, params[i]);
		}
		ej_optim *o = ej_optim_new(ctx, &cfg, params, pnames, n);
		tu_ok(ctx, o);
		ref_opt r;
		ref_init(&r, &cfg, ctx, params, n);
		for (int s = 0; s < 3; s++) {
			/* p1 and p2 get gradients only at the last step */
			double *gv[MAXP] = { NULL, NULL, NULL, NULL };
			for (int i = 0; i < n; i++) {
				if (i > 0 && s < 2)
					continue;
				epj_tensor *g =
				    rand_grad(ctx, params[i], &gv[i]);
				epj_tensor_set_grad(params[i], g);
				epj_tensor_free(g);
			}
			double lr = tu_uniform(0.01, 0.1), norm;
			ck_assert_int_eq(ej_optim_step(o, lr, 1.0, &norm),
					 EPJ_OK);
			ref_step(&r, lr, gv);
			for (int i = 0; i < n; i++) {
				tu_assert_close(ctx, ej_optim_master(o, i),
						r.p[i], 2e-6, 1e-6, "skip");
				free(gv[i]);
			}
			if (s < 2) {
				for (int i = 1; i < n; i++)
					tu_assert_tensors_close(
					    ctx, params[i], orig[i], 0, 0,
					    "skipped param");
				for (int k = 0; k < ej_optim_state_count(o);
				     k++) {
					const char *nm =
					    ej_optim_state_name(o, k);
					if (strstr(nm, pnames[1]) ||
					    (strstr(nm, pnames[2]) &&
					     !strstr(nm, ".master.")))
						ck_assert_msg(
						    all_zero(
							ctx,
							ej_optim_state_tensor(
							    o, k)),
						    "%s changed", nm);
				}
			}
		}
		ref_free(&r);
		ej_optim_free(o);
		for (int i = 0; i < n; i++) {
			epj_tensor_free(params[i]);
			epj_tensor_free(orig[i]);
		}
		epj_ctx_free(ctx);
	}
}
END_TEST

static void check_lr(const ej_config *cfg, int64_t step, double want,
		     const char *what)
{
	double got = ej_sched_lr(cfg, step);
	ck_assert_msg(fabs(got - want) <= 1e-12 * fabs(want) + 1e-15,
		      "%s step %lld: lr %.15g, expected %.15g", what,
		      (long long)step, got, want);
}

START_TEST(test_schedules)
{
	ej_config c;
	ej_config_defaults(&c);
	double lr0 = tu_uniform(1e-4, 1e-2);
	c.optimizer.lr = lr0;
	for (int s = 0; s < 5; s++)
		check_lr(&c, s * 97, lr0, "none");

	/* WarmupLR, log: step k runs at iteration k - 1. */
	c.scheduler.type = EJ_SCHED_WARMUP_LR;
	double mn = tu_uniform(0, 1e-3), mx = tu_uniform(1e-2, 1e-1);
	c.scheduler.warmup_min_lr = mn;
	c.scheduler.warmup_max_lr = mx;
	c.scheduler.warmup_num_steps = 10;
	c.scheduler.warmup_type = EJ_WARMUP_LOG;
	check_lr(&c, 0, mn, "log"); /* before the scheduler started */
	check_lr(&c, 1, mn, "log"); /* log(1) = 0 */
	check_lr(&c, 5, mn + (mx - mn) * log(5.0) / log(10.0), "log");
	check_lr(&c, 10, mn + (mx - mn) * log(10.0) / log(10.0), "log");
	check_lr(&c, 11, mx, "log");
	check_lr(&c, 5000, mx, "log");
	c.scheduler.warmup_type = EJ_WARMUP_LINEAR;
	check_lr(&c, 0, mn, "linear");
	check_lr(&c, 4, mn + (mx - mn) * 3 / 10.0, "linear");
	check_lr(&c, 10, mn + (mx - mn) * 9 / 10.0, "linear");
	check_lr(&c, 11, mx, "linear");
	/* warmup_num_steps 1 is raised to 2, as DeepSpeed does */
	c.scheduler.warmup_num_steps = 1;
	check_lr(&c, 2, mn + (mx - mn) * 0.5, "linear W=1");
	check_lr(&c, 3, mx, "linear W=1");
	/* last_batch_iteration offsets the iteration */
	c.scheduler.warmup_num_steps = 10;
	c.scheduler.last_batch_iteration = 4;
	check_lr(&c, 0, mn + (mx - mn) * 4 / 10.0, "lbi 4");
	c.scheduler.last_batch_iteration = -1;

	/* WarmupDecayLR: linear to 0 at iteration total_num_steps. */
	c.scheduler.type = EJ_SCHED_WARMUP_DECAY_LR;
	c.scheduler.warmup_min_lr = 0;
	c.scheduler.total_num_steps = 30;
	check_lr(&c, 4, mx * 3 / 10.0, "decay warmup");
	check_lr(&c, 11, mx, "decay peak");	  /* (30 - 10) / 20 */
	check_lr(&c, 21, mx * 0.5, "decay mid");  /* (30 - 20) / 20 */
	check_lr(&c, 28, mx * 3 / 20.0, "decay"); /* (30 - 27) / 20 */
	check_lr(&c, 31, 0, "decay end");
	check_lr(&c, 40, 0, "decay past end");
	c.scheduler.warmup_min_lr = mn;
	check_lr(&c, 31, mn, "decay end min");

	/* WarmupCosineLR: ratios of the optimizer lr. */
	c.scheduler.type = EJ_SCHED_WARMUP_COSINE_LR;
	c.scheduler.warmup_num_steps = 4;
	c.scheduler.total_num_steps = 20;
	c.scheduler.warmup_min_ratio = 0.1;
	c.scheduler.cos_min_ratio = tu_uniform(0.001, 0.1);
	c.scheduler.warmup_type = EJ_WARMUP_LOG;
	double cm = c.scheduler.cos_min_ratio;
	check_lr(&c, 0, 0, "cosine before start");
	check_lr(&c, 1, lr0 * 0.1, "cosine");
	check_lr(&c, 3, lr0 * (0.1 + 0.9 * log(3.0) / log(4.0)), "cosine");
	check_lr(&c, 5, lr0 * (cm + (1 - cm) * (1 + cos(M_PI / 16)) / 2),
		 "cosine");
	check_lr(&c, 12, lr0 * (cm + (1 - cm) * (1 + cos(M_PI * 8 / 16)) / 2),
		 "cosine");
	check_lr(&c, 20, lr0 * cm, "cosine end"); /* 16 / 16 */
	check_lr(&c, 21, lr0 * cm, "cosine clamped");
	check_lr(&c, 1000, lr0 * cm, "cosine clamped");
	c.scheduler.warmup_type = EJ_WARMUP_LINEAR;
	check_lr(&c, 3, lr0 * (0.1 + 0.9 * 2 / 4.0), "cosine linear");
}
END_TEST

/* Names are fixed at creation; exporting the state into fresh tensors and
 * importing it into a new optimizer over fresh parameters gives bitwise
 * identical later steps. */
START_TEST(test_state_roundtrip)
{
	ej_optim_type types[] = { EJ_OPTIM_SGD, EJ_OPTIM_ADAM };
	for (size_t c = 0; c < EJ_ARRAY_LEN(types); c++) {
		epj_ctx *ctx = tu_ctx();
		ej_config cfg = make_cfg(types[c], 0.01);
		cfg.optimizer.momentum = 0.8;
		int n = 3;
		epj_dtype dts[3] = { EPJ_DTYPE_BF16, EPJ_DTYPE_F32,
				     EPJ_DTYPE_BF16 };
		epj_tensor *pa[MAXP], *pb[MAXP];
		for (int i = 0; i < n; i++)
			pa[i] = tu_randn(ctx, dts[i], ndims[i], shapes[i]);
		ej_optim *oa = ej_optim_new(ctx, &cfg, pa, pnames, n);
		tu_ok(ctx, oa);
		/* names: per parameter master (bf16), then the moments */
		const char *kinds_sgd[] = { "master", "momentum" };
		const char *kinds_adam[] = { "master", "exp_avg",
					     "exp_avg_sq" };
		const char *const *kinds = c == 0 ? kinds_sgd : kinds_adam;
		int nk = c == 0 ? 2 : 3;
		int idx = 0;
		char want[128];
		for (int i = 0; i < n; i++)
			for (int k = 0; k < nk; k++) {
				if (k == 0 && dts[i] != EPJ_DTYPE_BF16)
					continue;
				snprintf(want, sizeof want, "optimizer.%s.%s",
					 kinds[k], pnames[i]);
				ck_assert_int_lt(idx, ej_optim_state_count(oa));
				ck_assert_str_eq(ej_optim_state_name(oa, idx),
						 want);
				idx++;
			}
		ck_assert_int_eq(ej_optim_state_count(oa), idx);
		char **names0 = calloc((size_t)idx, sizeof *names0);
		for (int k = 0; k < idx; k++)
			names0[k] = strdup(ej_optim_state_name(oa, k));

		/* the gradients of 4 steps, shared by both runs */
		epj_tensor *g[4][MAXP];
		double lrs[4];
		for (int s = 0; s < 4; s++) {
			lrs[s] = tu_uniform(0.01, 0.1);
			for (int i = 0; i < n; i++)
				g[s][i] =
				    tu_randn(ctx, dts[i], ndims[i], shapes[i]);
		}
		for (int s = 0; s < 2; s++) {
			for (int i = 0; i < n; i++)
				epj_tensor_set_grad(pa[i], g[s][i]);
			ck_assert_int_eq(ej_optim_step(oa, lrs[s], 0.5, NULL),
					 EPJ_OK);
		}
		ck_assert_int_eq(ej_optim_state_count(oa), idx);
		for (int k = 0; k < idx; k++)
			ck_assert_str_eq(ej_optim_state_name(oa, k), names0[k]);

		/* export */
		epj_tensor **saved = calloc((size_t)idx, sizeof *saved);
		for (int k = 0; k < idx; k++)
			saved[k] = clone(ctx, ej_optim_state_tensor(oa, k));
		/* import over fresh parameters (bf16 ones get the masters) */
		for (int i = 0; i < n; i++)
			pb[i] =
			    dts[i] == EPJ_DTYPE_F32
				? clone(ctx, pa[i])
				: tu_randn(ctx, dts[i], ndims[i], shapes[i]);
		ej_optim *ob = ej_optim_new(ctx, &cfg, pb, pnames, n);
		tu_ok(ctx, ob);
		ck_assert_int_eq(ej_optim_state_count(ob), idx);
		for (int k = 0; k < idx; k++) {
			ck_assert_str_eq(ej_optim_state_name(ob, k), names0[k]);
			ck_assert_int_eq(
			    epj_tensor_copy_(ctx, ej_optim_state_tensor(ob, k),
					     saved[k]),
			    EPJ_OK);
		}
		ej_optim_set_step_count(ob, ej_optim_step_count(oa));
		ck_assert_int_eq(ej_optim_sync_params(ob), EPJ_OK);
		for (int i = 0; i < n; i++)
			tu_assert_tensors_close(ctx, pb[i], pa[i], 0, 0,
						"synced param");

		for (int s = 2; s < 4; s++) {
			for (int i = 0; i < n; i++) {
				epj_tensor_set_grad(pa[i], g[s][i]);
				epj_tensor_set_grad(pb[i], g[s][i]);
			}
			ck_assert_int_eq(ej_optim_step(oa, lrs[s], 0.5, NULL),
					 EPJ_OK);
			ck_assert_int_eq(ej_optim_step(ob, lrs[s], 0.5, NULL),
					 EPJ_OK);
		}
		for (int i = 0; i < n; i++) {
			tu_assert_tensors_close(ctx, pb[i], pa[i], 0, 0,
						"resumed param");
			tu_assert_tensors_close(ctx, ej_optim_master(ob, i),
						ej_optim_master(oa, i), 0, 0,
						"resumed master");
		}
		for (int k = 0; k < idx; k++) {
			tu_assert_tensors_close(
			    ctx, ej_optim_state_tensor(ob, k),
			    ej_optim_state_tensor(oa, k), 0, 0, names0[k]);
			epj_tensor_free(saved[k]);
			free(names0[k]);
		}
		free(saved);
		free(names0);
		for (int s = 0; s < 4; s++)
			for (int i = 0; i < n; i++)
				epj_tensor_free(g[s][i]);
		ej_optim_free(oa);
		ej_optim_free(ob);
		for (int i = 0; i < n; i++) {
			epj_tensor_free(pa[i]);
			epj_tensor_free(pb[i]);
		}
		epj_ctx_free(ctx);
	}
}
END_TEST

static void expect_new_error(epj_ctx *ctx, const ej_config *cfg,
			     epj_tensor *const *params,
			     const char *const *names, int n, epj_status st,
			     const char *needle)
{
	tu_assert_error(ctx, ej_optim_new(ctx, cfg, params, names, n), st,
			TU_STRS("optim", needle));
}

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	ej_config cfg = make_cfg(EJ_OPTIM_ADAMW, 0);
	epj_tensor *f = tu_randn(ctx, EPJ_DTYPE_F32, 2, shapes[0]);
	epj_tensor *i32 = epj_zeros(ctx, EPJ_DTYPE_I32, 1, shapes[1]);
	epj_tensor *nc = tu_noncontig(ctx, f);
	tu_ok(ctx, i32);

	expect_new_error(ctx, &cfg, (epj_tensor *[]){ f, i32 }, pnames, 2,
			 EPJ_ERR_DTYPE, pnames[1]);
	expect_new_error(ctx, &cfg, (epj_tensor *[]){ nc }, pnames, 1,
			 EPJ_ERR_INVALID, "not contiguous");
	expect_new_error(ctx, &cfg, (epj_tensor *[]){ f, f }, pnames, 2,
			 EPJ_ERR_INVALID, "same tensor");
	epj_tensor *f2 = clone(ctx, f);
	expect_new_error(ctx, &cfg, (epj_tensor *[]){ f, f2 },
			 (const char *[]){ "x", "x" }, 2, EPJ_ERR_INVALID,
			 "\"x\"");

	ej_optim *o = ej_optim_new(ctx, &cfg, &f, pnames, 1);
	tu_ok(ctx, o);
	ck_assert_int_eq(ej_optim_step(o, -1.0, 1.0, NULL), EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "optim step"));
	ck_assert_int_eq(ej_optim_step(o, 0.1, NAN, NULL), EPJ_ERR_INVALID);
	epj_ctx_clear_error(ctx);
	/* a step with no gradient anywhere changes nothing but the count */
	double *before = tu_values(ctx, f), norm = -1;
	ck_assert_int_eq(ej_optim_step(o, 0.1, 1.0, &norm), EPJ_OK);
	ck_assert(norm == 0);
	tu_assert_close(ctx, f, before, 0, 0, "no grads");
	ck_assert_int_eq(ej_optim_step_count(o), 1);
	free(before);
	ej_optim_free(o);
	ej_optim_free(NULL);

	epj_tensor_free(f);
	epj_tensor_free(f2);
	epj_tensor_free(i32);
	epj_tensor_free(nc);
	epj_ctx_free(ctx);
}
END_TEST

/* The n-th storage allocation fails, for every n that creation makes: each
 * failure is EPJ_ERR_NOMEM naming the optimizer and leaks nothing. */
START_TEST(test_alloc_failure)
{
	epj_ctx *ctx = tu_ctx();
	ej_config cfg = make_cfg(EJ_OPTIM_ADAM, 0);
	epj_tensor *params[2] = {
		tu_randn(ctx, EPJ_DTYPE_BF16, ndims[0], shapes[0]),
		tu_randn(ctx, EPJ_DTYPE_F32, ndims[2], shapes[2]),
	};
	int failures = 0;
	for (int64_t k = 1;; k++) {
		ej_allocator_fail_after(ctx->alloc, k);
		ej_optim *o = ej_optim_new(ctx, &cfg, params, pnames, 2);
		ej_allocator_fail_after(ctx->alloc, 0);
		if (o) {
			ck_assert_int_eq(ej_optim_state_count(o), 5);
			ej_optim_free(o);
			break;
		}
		ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_NOMEM);
		ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "optim"));
		epj_ctx_clear_error(ctx);
		failures++;
	}
	ck_assert_int_eq(failures, 6); /* master, mgrad, 2 x (m, v) */
	epj_tensor_free(params[0]);
	epj_tensor_free(params[1]);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_optim_suite(void)
{
	Suite *s = suite_create("optim");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_f32_updates);
	tcase_add_test(tc, test_bf16_master);
	tcase_add_test(tc, test_accumulate);
	tcase_add_test(tc, test_clipping);
	tcase_add_test(tc, test_no_grad_skipped);
	tcase_add_test(tc, test_schedules);
	tcase_add_test(tc, test_state_roundtrip);
	tcase_add_test(tc, test_errors);
	tcase_add_test(tc, test_alloc_failure);
	suite_add_tcase(s, tc);
	return s;
}
