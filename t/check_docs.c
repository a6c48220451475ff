/* check_docs.c -- suite "docs": packed documents and the per-token loss,
 * through epjit itself (no other implementation needed).
 *
 *  - test_alone: a batch of rows of packed documents, each ended by the
 *    end-of-document token (the last one cut), with reset_attention_mask,
 *    reset_position_ids and eod_mask_loss, gives for every document the
 *    logits that document gives alone (a [1, len] forward from position
 *    0), and the gradients of the sum of the counted token losses are the
 *    sum over the documents of theirs: the tiny Qwen3-MoE model (nested and
 *    root layouts) and DeepSeek-V3's latent attention with interleaved
 *    YaRN rope (t/golden/hf/deepseek_v3) on the cpu in f64, where a
 *    document at other positions than 0.. is 1e-7 off (rope is shift
 *    invariant but for the rounding of its f32 tables), and Qwen3.5-MoE
 *    (t/golden/hf/qwen3_5_moe), whose Gated DeltaNet layers start each
 *    document from a zero state and conv window; the tiny model in f32 on
 *    cuda-sim and on a cuda context over the stand-in driver, Qwen3.5-MoE
 *    on cuda-sim.
 *  - test_batch_documents: epj_batch_documents against Megatron's
 *    get_ltor_masks_and_position_ids written out by hand (a row that starts
 *    with the EOD, two EODs in a row, a row without one).
 *  - test_compiled: regional and full-model compilation (and regional on
 *    Qwen3.5-MoE) run the documents
 *    with the ids and positions as inputs: batches of other boundaries
 *    reuse the compiled graphs (recompiles 0, no new frame) and give the
 *    eager engine's logits and loss.
 *  - test_per_token: one step of 2 micro-batches whose counted tokens
 *    differ (a loss mask that hides most of the first) updates the weights
 *    as one micro-batch of both rows does: the sum of the counted token
 *    losses over their number, not a mean of the two means; the step's
 *    loss is that quotient.
 *  - test_per_token_router_loss: with Megatron's router losses on, one
 *    micro-batch's step per token updates the weights as the same step
 *    with the micro-batch's mean loss (the router losses' gradient weighted
 *    by the counted tokens, as their value is).
 *  - test_errors: doc_ids without labels, options set after a step, an
 *    eod token outside the vocabulary.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EOD 1

static epj_model *tiny_dt(epj_ctx *ctx, const char *cfg, epj_layout layout,
			  epj_dtype dt)
{
	epj_model_opts o = { .layout = layout, .seed = 11, .dtype = dt };
	epj_model *m = NULL;
	ck_assert_msg(epj_model_new(ctx, cfg, &o, &m) == EPJ_OK, "model: %s",
		      epj_ctx_error(ctx));
	return m;
}

static epj_model *tiny(epj_ctx *ctx, const char *cfg, epj_layout layout)
{
	return tiny_dt(ctx, cfg, layout, EPJ_DTYPE_F32);
}

/* Rows of packed documents: ids [B, T] with an EOD ending each document
 * (lengths 1..maxlen, the last one of a row cut), the next-token labels
 * (the row's T + 1 tokens shifted) with some targets hidden (-100) as a
 * loss mask would. */
static void packed(int64_t *ids, int64_t *lab, int64_t B, int64_t T, int64_t V,
		   int64_t maxlen)
{
	for (int64_t b = 0; b < B; b++) {
		int64_t x[257], left = tu_randint(1, maxlen + 1);
		ck_assert(T < 256);
		for (int64_t t = 0; t <= T; t++) {
			x[t] = --left == 0 ? EOD : tu_randint(2, V);
			if (left == 0)
				left = tu_randint(1, maxlen + 1);
		}
		for (int64_t t = 0; t < T; t++) {
			ids[b * T + t] = x[t];
			lab[b * T + t] = tu_randint(0, 6) ? x[t + 1] : -100;
		}
	}
}

static epj_tensor *i64(epj_ctx *ctx, const int64_t *v, int64_t B, int64_t T)
{
	int64_t shp[2] = { B, T };
	epj_tensor *t = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, shp, v);
	tu_ok(ctx, t);
	return t;
}

static double *values(epj_ctx *ctx, epj_tensor *t)
{
	int64_t n = epj_tensor_numel(t);
	double *v = malloc(sizeof *v * (size_t)(n + 1));
	ck_assert(v && epj_tensor_to_f64(ctx, t, v) == EPJ_OK);
	return v;
}

static const epj_batch_opts docs_opts = { .reset_attention_mask = true,
					  .reset_position_ids = true,
					  .eod_mask_loss = true,
					  .eod_token = EOD,
					  .per_token_loss = true };

/* The gradients of every parameter (zeros where none) as doubles, then
 * cleared. */
static double **take_grads(epj_ctx *ctx, epj_model *m)
{
	int n = epj_model_num_params(m);
	double **g = calloc((size_t)n + 1, sizeof *g);
	for (int i = 0; i < n; i++) {
		epj_tensor *p = epj_model_param(m, i);
		int64_t k = epj_tensor_numel(p);
		g[i] = calloc((size_t)k + 1, sizeof **g);
		epj_tensor *gr = epj_tensor_grad(p);
		if (gr)
			ck_assert(epj_tensor_to_f64(ctx, gr, g[i]) == EPJ_OK);
		epj_tensor_set_grad(p, NULL);
	}
	return g;
}

static void free_grads(double **g, int n)
{
	for (int i = 0; i < n; i++)
		free(g[i]);
	free(g);
}

/* ||a - b|| <= tol (||b|| + 1e-6), or fails naming what. */
static void rel_close(const double *a, const double *b, int64_t n, double tol,
		      const char *what)
{
	double d = 0, r = 0;
	for (int64_t i = 0; i < n; i++) {
		d += (a[i] - b[i]) * (a[i] - b[i]);
		r += b[i] * b[i];
	}
	ck_assert_msg(sqrt(d) <= tol * (sqrt(r) + 1e-6),
		      "%s: relative L2 %g > %g", what,
		      sqrt(d) / (sqrt(r) + 1e-30), tol);
}

/* Backward of loss * n (the micro-batch's sum of counted token losses). */
static void backward_sum(epj_ctx *ctx, epj_tensor *loss, int64_t n)
{
	epj_tensor *s = epj_mul_scalar(ctx, loss, (double)n);
	tu_ok(ctx, s);
	ck_assert_msg(epj_backward(ctx, s, NULL) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_tensor_free(s);
}

static int64_t counted(const int64_t *lab, int64_t n)
{
	int64_t c = 0;
	for (int64_t i = 0; i < n; i++)
		c += lab[i] != -100;
	return c;
}

/* The packed batch against every document alone on ctx's model m. */
static void check_alone(epj_ctx *ctx, epj_model *m, int64_t B, int64_t T,
			double tol, const char *what)
{
	const int64_t V = epj_model_vocab_size(m);
	int64_t *ids = malloc(sizeof *ids * (size_t)(B * T));
	int64_t *lab = malloc(sizeof *lab * (size_t)(B * T));
	packed(ids, lab, B, T, V, 9);
	epj_tensor *ti = i64(ctx, ids, B, T), *tl = i64(ctx, lab, B, T);
	epj_tensor *pos = NULL, *docs = NULL, *ml = NULL;
	ck_assert_msg(epj_batch_documents(ctx, ti, tl, &docs_opts, &pos, &docs,
					  &ml) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	double *mlv = values(ctx, ml);
	int64_t *mli = malloc(sizeof *mli * (size_t)(B * T));
	for (int64_t i = 0; i < B * T; i++)
		mli[i] = (int64_t)mlv[i];
	epj_tensor *logits = NULL, *loss = NULL;
	ck_assert_msg(epj_model_forward_docs(ctx, m, ti, ml, pos, docs, &logits,
					     &loss) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	backward_sum(ctx, loss, counted(mli, B * T));
	double **gp = take_grads(ctx, m);
	double *lp = values(ctx, logits);
	int docs_n = 0;
	for (int64_t b = 0; b < B; b++)
		for (int64_t lo = 0; lo < T; docs_n++) {
			int64_t hi = lo;
			while (hi < T && ids[b * T + hi] != EOD)
				hi++;
			hi = hi < T ? hi + 1 : T; /* the EOD is the doc's */
			int64_t len = hi - lo;
			epj_tensor *di = i64(ctx, ids + b * T + lo, 1, len);
			epj_tensor *dl = i64(ctx, mli + b * T + lo, 1, len);
			epj_tensor *dlog = NULL, *dloss = NULL;
			ck_assert_msg(epj_model_forward(ctx, m, di, dl, &dlog,
							&dloss) == EPJ_OK,
				      "%s", epj_ctx_error(ctx));
			int64_t n = counted(mli + b * T + lo, len);
			if (n > 0)
				backward_sum(ctx, dloss, n);
			double *la = values(ctx, dlog);
			char w[160];
			snprintf(w, sizeof w,
				 "%s: logits of row %lld, document [%lld, "
				 "%lld) alone",
				 what, (long long)b, (long long)lo,
				 (long long)hi);
			rel_close(lp + (b * T + lo) * V, la, len * V, tol, w);
			free(la);
			epj_tensor *all[] = { di, dl, dlog, dloss };
			for (int k = 0; k < 4; k++)
				epj_tensor_free(all[k]);
			lo = hi;
		}
	ck_assert_int_ge(docs_n, 2 * B);
	double **ga = take_grads(ctx, m);
	for (int i = 0; i < epj_model_num_params(m); i++) {
		char w[256];
		snprintf(w, sizeof w, "%s: gradient of %s", what,
			 epj_model_param_name(m, i));
		rel_close(gp[i], ga[i], epj_tensor_numel(epj_model_param(m, i)),
			  tol, w);
	}
	free_grads(gp, epj_model_num_params(m));
	free_grads(ga, epj_model_num_params(m));
	epj_tensor *all[] = { ti, tl, pos, docs, ml, logits, loss };
	for (int k = 0; k < 7; k++)
		epj_tensor_free(all[k]);
	free(lp);
	free(mlv);
	free(mli);
	free(ids);
	free(lab);
}

/* The cases of test_alone: the device, the family of t/golden/hf (NULL:
 * the tiny model), the layout, and whether it runs in f64. */
static const struct {
	const char *dev, *family;
	epj_layout layout;
	bool f64;
} alone_case[] = {
	{ "cpu", NULL, EPJ_LAYOUT_NESTED, true },
	{ "cpu", NULL, EPJ_LAYOUT_ROOT, true },
	{ "cpu", "deepseek_v3", EPJ_LAYOUT_NESTED, true },
	{ "cuda-sim", NULL, EPJ_LAYOUT_NESTED, false },
	{ "cuda", NULL, EPJ_LAYOUT_NESTED, false },
	/* Gated DeltaNet layers: state and conv window per document */
	{ "cpu", "qwen3_5_moe", EPJ_LAYOUT_NESTED, true },
	{ "cuda-sim", "qwen3_5_moe", EPJ_LAYOUT_NESTED, false },
};
#define N_ALONE (int)(sizeof alone_case / sizeof alone_case[0])

START_TEST(test_alone)
{
	const bool stand_in = !strcmp(alone_case[_i].dev, "cuda");
	if (stand_in && !tu_fake_cuda_usable())
		return; /* no NVRTC: the stand-in cannot build kernels */
	if (stand_in)
		ck_assert(tu_fake_cuda_begin());
	epj_ctx *ctx = NULL;
	ck_assert_msg(epj_ctx_new(alone_case[_i].dev, &ctx) == EPJ_OK, "ctx %s",
		      alone_case[_i].dev);
	epj_ctx_seed(ctx, tu_seed());
	char cfg[4096];
	if (alone_case[_i].family)
		snprintf(cfg, sizeof cfg, "%s/t/golden/hf/%s/config.json",
			 tu_srcdir(), alone_case[_i].family);
	/* f64 on the cpu: rope is shift invariant, so only there (the tables
	 * are f32 values, as transformers makes them) does a document at
	 * the wrong positions show, 1e-7 off; at its own, 1e-15 */
	const bool f64 = alone_case[_i].f64;
	epj_model *m =
	    tiny_dt(ctx, alone_case[_i].family ? cfg : NULL,
		    alone_case[_i].layout, f64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32);
	char what[96];
	snprintf(what, sizeof what, "%s %s%s", alone_case[_i].dev,
		 alone_case[_i].family ? alone_case[_i].family : "tiny",
		 alone_case[_i].layout == EPJ_LAYOUT_ROOT ? " root" : "");
	/* cuda-sim and the stand-in are slow: fewer, shorter rows */
	check_alone(ctx, m, f64 ? 3 : 1, f64 ? 29 : 12, f64 ? 1e-11 : 2e-5,
		    what);
	epj_model_free(m);
	epj_ctx_free(ctx);
	if (stand_in)
		tu_fake_cuda_end();
}
END_TEST

START_TEST(test_batch_documents)
{
	epj_ctx *ctx = tu_ctx();
	enum { B = 3, T = 7 };
	const int64_t ids[B * T] = { 5,	  6, EOD, 7, EOD, EOD, 8, /* */
				     EOD, 9, 9,	  9, 9,	  9,   9, /* */
				     4,	  4, 4,	  4, 4,	  4,   4 };
	const int64_t lab[B * T] = { 6, 1, 7, 1, 1, 8, 2, /* */
				     9, 9, 9, 9, 9, 9, 3, /* */
				     4, 4, 4, 4, 4, 4, 4 };
	/* get_ltor_masks_and_position_ids by hand */
	const int64_t want_pos[B * T] = { 0, 1, 2, 0, 1, 0, 0, /* */
					  0, 0, 1, 2, 3, 4, 5, /* */
					  0, 1, 2, 3, 4, 5, 6 };
	const int64_t want_doc[B * T] = { 0, 0, 0, 1, 1, 2, 3, /* */
					  0, 1, 1, 1, 1, 1, 1, /* */
					  0, 0, 0, 0, 0, 0, 0 };
	epj_tensor *ti = i64(ctx, ids, B, T), *tl = i64(ctx, lab, B, T);
	epj_tensor *pos, *doc, *ml;
	ck_assert(epj_batch_documents(ctx, ti, tl, &docs_opts, &pos, &doc,
				      &ml) == EPJ_OK);
	for (int64_t i = 0; i < B * T; i++) {
		ck_assert_int_eq(epj_tensor_get_f64(pos, i), want_pos[i]);
		ck_assert_int_eq(epj_tensor_get_f64(doc, i), want_doc[i]);
		ck_assert_int_eq(epj_tensor_get_f64(ml, i),
				 ids[i] == EOD ? -100 : lab[i]);
	}
	epj_tensor_free(pos);
	epj_tensor_free(doc);
	epj_tensor_free(ml);
	/* one option alone: the others are NULL or the labels as given */
	epj_batch_opts o = { .reset_position_ids = true, .eod_token = EOD };
	ck_assert(epj_batch_documents(ctx, ti, tl, &o, &pos, &doc, &ml) ==
		  EPJ_OK);
	ck_assert_ptr_nonnull(pos);
	ck_assert_ptr_null(doc);
	ck_assert_ptr_eq(ml, tl);
	epj_tensor_free(pos);
	epj_tensor_free(ml);
	o.eod_token = -1;
	ck_assert_int_eq(epj_batch_documents(ctx, ti, tl, &o, &pos, &doc, &ml),
			 EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "eod_token"));
	epj_tensor_free(ti);
	epj_tensor_free(tl);
	epj_ctx_free(ctx);
}
END_TEST

static epj_engine *engine(epj_ctx *ctx, epj_model *m, const char *json)
{
	epj_engine *e = NULL;
	ck_assert_msg(epj_engine_initialize_json(ctx, m, json, "test", &e) ==
			  EPJ_OK,
		      "engine: %s", epj_ctx_error(ctx));
	ck_assert_msg(epj_engine_set_batch_opts(e, &docs_opts) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	return e;
}

/* _i: 0 regional (autoep_non_moe), 1 full-model, 2 regional on
 * Qwen3.5-MoE (Gated DeltaNet layers). */
START_TEST(test_compiled)
{
	const bool regional = _i != 1;
	epj_ctx *ctx = tu_ctx();
	char cfg[4096];
	snprintf(cfg, sizeof cfg, "%s/t/golden/hf/qwen3_5_moe/config.json",
		 tu_srcdir());
	epj_model *mc = tiny(ctx, _i == 2 ? cfg : NULL, EPJ_LAYOUT_NESTED);
	epj_model *me = tiny(ctx, _i == 2 ? cfg : NULL, EPJ_LAYOUT_NESTED);
	char json[256];
	snprintf(json, sizeof json,
		 "{\"train_micro_batch_size_per_gpu\": 2, "
		 "\"compile\": {\"autoep_non_moe\": %s}}",
		 regional ? "true" : "false");
	epj_engine *ec = engine(ctx, mc, json), *ee = engine(ctx, me, json);
	ck_assert_msg(epj_engine_compile(ec) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	const int64_t B = 2, T = 21, V = epj_model_vocab_size(mc);
	int64_t frames = 0;
	for (int k = 0; k < 4; k++) {
		int64_t ids[2 * 21], lab[2 * 21];
		packed(ids, lab, B, T, V, 3 + 4 * k);
		epj_tensor *ti = i64(ctx, ids, B, T), *tl = i64(ctx, lab, B, T);
		epj_tensor *lc = NULL, *le = NULL, *xc = NULL, *xe = NULL;
		ck_assert_msg(epj_engine_forward(ec, ti, tl, &lc, &xc) ==
				  EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		ck_assert_msg(epj_engine_forward(ee, ti, tl, &le, &xe) ==
				  EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		tu_assert_tensors_close(ctx, lc, le, 1e-5, 1e-5,
					"compiled logits");
		tu_assert_tensors_close(ctx, xc, xe, 1e-5, 1e-5,
					"compiled loss");
		if (k == 0)
			frames = epj_counter_get(ctx, "frames.ok");
		/* other boundaries, the same graphs */
		ck_assert_int_eq(epj_counter_get(ctx, "recompiles"), 0);
		ck_assert_int_eq(epj_counter_get(ctx, "frames.ok"), frames);
		epj_tensor *all[] = { ti, tl, lc, le, xc, xe };
		for (int q = 0; q < 6; q++)
			epj_tensor_free(all[q]);
	}
	ck_assert_int_gt(frames, 0);
	ck_assert_int_gt(epj_counter_get(ctx, "kernels.launched.compiled"), 0);
	epj_engine_free(ec);
	epj_engine_free(ee);
	epj_model_free(mc);
	epj_model_free(me);
	epj_ctx_free(ctx);
}
END_TEST

/* One SGD step (lr 1, no clipping) of engine e on micro-batches of rows
 * [r0, r0 + rows) each; the parameters after it (the caller frees). */
static double **step_with(epj_ctx *ctx, int gas, const int64_t *ids,
			  const int64_t *lab, int64_t B, int64_t T,
			  bool per_token, const char *moe, double *loss)
{
	epj_model *m = tiny(ctx, NULL, EPJ_LAYOUT_NESTED);
	char json[512];
	snprintf(
	    json, sizeof json,
	    "{\"train_micro_batch_size_per_gpu\": %lld, "
	    "\"gradient_accumulation_steps\": %d, "
	    "\"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": 1}}%s%s}",
	    (long long)(B / gas), gas, moe ? ", \"moe\": " : "",
	    moe ? moe : "");
	epj_engine *e = NULL;
	ck_assert_msg(epj_engine_initialize_json(ctx, m, json, "test", &e) ==
			  EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	epj_batch_opts o = { .per_token_loss = per_token, .eod_token = -1 };
	ck_assert(epj_engine_set_batch_opts(e, &o) == EPJ_OK);
	epj_step_info info = { 0 };
	for (int k = 0; k < gas; k++) {
		int64_t r0 = k * (B / gas);
		epj_tensor *ti = i64(ctx, ids + r0 * T, B / gas, T);
		epj_tensor *tl = i64(ctx, lab + r0 * T, B / gas, T);
		ck_assert_msg(epj_engine_train_step(e, ti, tl, &info) == EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		epj_tensor_free(ti);
		epj_tensor_free(tl);
	}
	ck_assert(info.stepped);
	*loss = info.mean_loss;
	int n = epj_model_num_params(m);
	double **p = calloc((size_t)n + 1, sizeof *p);
	for (int i = 0; i < n; i++)
		p[i] = values(ctx, epj_model_param(m, i));
	epj_engine_free(e);
	epj_model_free(m);
	return p;
}

static double **one_step(epj_ctx *ctx, int gas, const int64_t *ids,
			 const int64_t *lab, int64_t B, int64_t T, double *loss)
{
	return step_with(ctx, gas, ids, lab, B, T, true, NULL, loss);
}

START_TEST(test_per_token)
{
	epj_ctx *ctx = tu_ctx();
	enum { B = 4, T = 10 };
	int64_t ids[B * T], lab[B * T];
	for (int64_t i = 0; i < B * T; i++) {
		ids[i] = tu_randint(2, 64);
		/* rows 0, 1 (micro-batch 1): 3 counted targets; rows 2, 3:
		 * all 20 */
		lab[i] = i < 2 * T && i % 7 ? -100 : tu_randint(2, 64);
	}
	double l1, l2;
	double **p1 = one_step(ctx, 1, ids, lab, B, T, &l1);
	double **p2 = one_step(ctx, 2, ids, lab, B, T, &l2);
	ck_assert_msg(fabs(l1 - l2) <= 1e-6 * fabs(l1),
		      "the step's loss: %.9g in one micro-batch, %.9g in two",
		      l1, l2);
	epj_model *m = tiny(ctx, NULL, EPJ_LAYOUT_NESTED);
	for (int i = 0; i < epj_model_num_params(m); i++) {
		char w[256];
		snprintf(w, sizeof w, "parameter %s after the step",
			 epj_model_param_name(m, i));
		rel_close(p2[i], p1[i], epj_tensor_numel(epj_model_param(m, i)),
			  1e-6, w);
	}
	free_grads(p1, epj_model_num_params(m));
	free_grads(p2, epj_model_num_params(m));
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* The router losses under the per-token loss: with one micro-batch on one
 * rank the per-token loss is the micro-batch's mean, so a step with it and
 * one without update the weights alike, the router losses' gradient
 * included (it is weighted by the counted tokens as their value is). */
START_TEST(test_per_token_router_loss)
{
	epj_ctx *ctx = tu_ctx();
	enum { B = 2, T = 12 };
	int64_t ids[B * T], lab[B * T];
	for (int64_t i = 0; i < B * T; i++) {
		ids[i] = tu_randint(2, 64);
		lab[i] = i % 3 ? tu_randint(2, 64) : -100;
	}
	const char *moe[] = {
		"{\"aux_loss_coeff\": 0.5, \"z_loss_coeff\": 0.5}",
		"{\"seq_aux_loss_coeff\": 0.7}"
	};
	for (int k = 0; k < 2; k++) {
		double l1, l2;
		double **p1 =
		    step_with(ctx, 1, ids, lab, B, T, true, moe[k], &l1);
		double **p2 =
		    step_with(ctx, 1, ids, lab, B, T, false, moe[k], &l2);
		ck_assert_msg(fabs(l1 - l2) <= 1e-6 * fabs(l2),
			      "%s: the step's loss %.9g per token, %.9g as a "
			      "mean",
			      moe[k], l1, l2);
		epj_model *m = tiny(ctx, NULL, EPJ_LAYOUT_NESTED);
		for (int i = 0; i < epj_model_num_params(m); i++) {
			char w[320];
			snprintf(w, sizeof w,
				 "%s: parameter %s after the step per token "
				 "(against the mean)",
				 moe[k], epj_model_param_name(m, i));
			rel_close(p1[i], p2[i],
				  epj_tensor_numel(epj_model_param(m, i)), 1e-6,
				  w);
		}
		free_grads(p1, epj_model_num_params(m));
		free_grads(p2, epj_model_num_params(m));
		epj_model_free(m);
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	epj_model *m = tiny(ctx, NULL, EPJ_LAYOUT_NESTED);
	int64_t ids[6] = { 2, EOD, 3, 4, EOD, 5 };
	epj_tensor *ti = i64(ctx, ids, 1, 6);
	epj_tensor *lo = NULL, *ls = NULL;
	ck_assert_int_eq(
	    epj_model_forward_docs(ctx, m, ti, NULL, NULL, ti, &lo, &ls),
	    EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "need labels"));
	epj_engine *e = NULL;
	ck_assert(epj_engine_initialize_json(ctx, m, "{}", "t", &e) == EPJ_OK);
	epj_batch_opts o = docs_opts;
	o.eod_token = 64;
	ck_assert_int_eq(epj_engine_set_batch_opts(e, &o), EPJ_ERR_CONFIG);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "vocab_size 64"));
	ck_assert(epj_engine_set_batch_opts(e, &docs_opts) == EPJ_OK);
	epj_step_info info;
	epj_tensor *tb = i64(ctx, (int64_t[8 * 6]){ 0 }, 8, 6);
	ck_assert_msg(epj_engine_train_step(e, tb, tb, &info) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_engine_set_batch_opts(e, &docs_opts), EPJ_OK);
	o = docs_opts;
	o.eod_token = 2;
	ck_assert_int_eq(epj_engine_set_batch_opts(e, &o), EPJ_ERR_STATE);
	epj_engine_free(e);
	/* after compile: the loss options may change (a dataset's mask
	 * turns the per-token loss on), the ids the graphs take may not */
	ck_assert(epj_engine_initialize_json(ctx, m, "{}", "t", &e) == EPJ_OK);
	ck_assert(epj_engine_compile(e) == EPJ_OK);
	o = (epj_batch_opts){ .eod_token = -1, .per_token_loss = true };
	ck_assert_int_eq(epj_engine_set_batch_opts(e, &o), EPJ_OK);
	ck_assert_int_eq(epj_engine_set_batch_opts(e, &docs_opts),
			 EPJ_ERR_STATE);
	epj_engine_free(e);
	epj_model_free(m);
	epj_tensor_free(ti);
	epj_tensor_free(tb);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_docs_suite(void);
Suite *make_docs_suite(void)
{
	Suite *s = suite_create("docs");
	TCase *tc = tcase_create("docs");
	tcase_set_timeout(tc, 600);
	tu_add_loop_test(tc, test_alone, N_ALONE);
	tcase_add_test(tc, test_batch_documents);
	tcase_add_loop_test(tc, test_compiled, 0, 3);
	tcase_add_test(tc, test_per_token);
	tcase_add_test(tc, test_per_token_router_loss);
	tcase_add_test(tc, test_errors);
	suite_add_tcase(s, tc);
	return s;
}
