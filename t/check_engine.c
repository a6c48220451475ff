/* check_engine.c -- the training engine (runtime/engine.c) over the
 * Qwen3-MoE model and the optimizers (runtime/optim.c).
 *
 *  - Training on the synthetic Markov corpus lowers the held-out loss from
 *    about ln(V) to near the source's entropy rate (the floor).
 *  - Save / load / resume is exact: training 6 + 6 steps in one engine and
 *    6 steps in a fresh engine loaded from the checkpoint written after the
 *    first 6 give bit-identical parameters and byte-identical checkpoint
 *    files (masters, optimizer state, progress), for SGD with momentum and
 *    AdamW, f32 and bf16, with a warm-up schedule so the restored step count
 *    matters.
 *  - Failed loads (truncated or corrupt files, a missing parameter, a wrong
 *    shape, an unknown tensor, missing optimizer state) return an error
 *    naming the file or tensor and leave the parameters as they were.
 *  - Settings this build cannot run are refused at initialisation with a
 *    message naming the key.
 *  - Gradient accumulation: gas = 2 over micro-batches a, b equals gas = 1
 *    over [a; b] (equal token counts, so the per-micro-batch means average
 *    to the mean over both).
 *  - bf16: parameters bf16, FP32 masters (read back from the checkpoint),
 *    parameter == RNE(master) after every step.
 */
#include "check_util.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime_impl.h"

/* ---- helpers --------------------------------------------------------------
 */

/* The engine test model: TU_TINY_MOE_JSON (its vocabulary). */
#define E_V 16

static epj_model *new_model(epj_ctx *ctx, uint64_t seed)
{
	tu_tmpfile cfg =
	    tu_tmpfile_new("engine", "config.json", TU_TINY_MOE_JSON);
	epj_model_opts o = { .layout = EPJ_LAYOUT_NESTED,
			     .seed = seed,
			     .dtype = EPJ_DTYPE_F32 };
	epj_model *m = NULL;
	epj_status st = epj_model_new(ctx, cfg.path, &o, &m);
	tu_tmpfile_free(&cfg);
	ck_assert_msg(st == EPJ_OK, "model: %s", epj_ctx_error(ctx));
	return m;
}

static epj_engine *new_engine(epj_ctx *ctx, epj_model *m, const char *json)
{
	epj_engine *e = NULL;
	epj_status st =
	    epj_engine_initialize_json(ctx, m, json, "test.json", &e);
	ck_assert_msg(st == EPJ_OK && e, "engine (%s): %s", json,
		      epj_ctx_error(ctx));
	return e;
}

/* All parameter values (as doubles: exact for f32 and bf16). */
typedef struct snap {
	int n;
	double **v;
	int64_t *numel;
} snap;

static void snap_take(epj_ctx *ctx, const epj_model *m, snap *s)
{
	s->n = epj_model_num_params(m);
	s->v = calloc((size_t)s->n, sizeof *s->v);
	s->numel = calloc((size_t)s->n, sizeof *s->numel);
	ck_assert(s->v && s->numel);
	for (int i = 0; i < s->n; i++) {
		s->v[i] = tu_values(ctx, epj_model_param(m, i));
		s->numel[i] = epj_tensor_numel(epj_model_param(m, i));
	}
}

static void snap_free(snap *s)
{
	for (int i = 0; i < s->n; i++)
		free(s->v[i]);
	free(s->v);
	free(s->numel);
}

/* Bitwise equality of two snapshots; names the first difference. */
static void snap_assert_equal(const epj_model *m, const snap *a, const snap *b,
			      const char *what)
{
	ck_assert_int_eq(a->n, b->n);
	for (int i = 0; i < a->n; i++) {
		ck_assert_int_eq(a->numel[i], b->numel[i]);
		for (int64_t k = 0; k < a->numel[i]; k++)
			ck_assert_msg(a->v[i][k] == b->v[i][k],
				      "%s: %s[%lld] %.9g vs %.9g", what,
				      epj_model_param_name(m, i), (long long)k,
				      a->v[i][k], b->v[i][k]);
	}
}

/* Micro-batches drawn in advance from a synthetic corpus. */
typedef struct batches {
	int n;
	epj_tensor *ids[16], *labels[16];
} batches;

static void batches_make(epj_ctx *ctx, batches *b, int n, int64_t B, int64_t T,
			 uint64_t seed)
{
	ck_assert_int_le(n, 16);
	epj_corpus *c = epj_corpus_synthetic(ctx, E_V, seed);
	tu_ok(ctx, c);
	b->n = n;
	for (int i = 0; i < n; i++)
		ck_assert_int_eq(epj_corpus_next_batch(ctx, c, B, T, &b->ids[i],
						       &b->labels[i]),
				 EPJ_OK);
	epj_corpus_free(c);
}

static void batches_free(batches *b)
{
	for (int i = 0; i < b->n; i++) {
		epj_tensor_free(b->ids[i]);
		epj_tensor_free(b->labels[i]);
	}
}

static double train(epj_engine *e, epj_ctx *ctx, epj_tensor *ids,
		    epj_tensor *labels, epj_step_info *info)
{
	epj_step_info tmp;
	if (!info)
		info = &tmp;
	ck_assert_msg(epj_engine_train_step(e, ids, labels, info) == EPJ_OK,
		      "train_step: %s", epj_ctx_error(ctx));
	ck_assert(isfinite(info->loss));
	return info->loss;
}

/* ---- training lowers the loss to near the floor ---------------------------
 */

/* Calibration (this model, AdamW lr 1e-2 with a 10-step linear warm-up,
 * batch 8 x 16, 150 steps; measured over seeds): the held-out loss starts
 * at ln(16) = 2.77 and ends 0.02 .. 0.08 above the entropy rate of the
 * source (0.9 .. 1.3 nats depending on the chain), a drop of about 1.6.
 * Required: a drop > 1.0 and a final loss in [floor - 0.1, floor + 0.25]
 * (the lower bound is 5 standard errors of the held-out mean). */
/* DeepSeek-V3's score bias through the engine (the tiny model of the
 * golden files, loaded from transformers' checkpoint): a buffer the
 * optimizer leaves alone (f32, no gradient) under the default
 * load_balance_coeff (0); with a coefficient c, every step moves each
 * bias by -c, 0 or +c, so after 3 steps each moved by a multiple of c of
 * at most 3c, and some moved; with activation checkpointing (the layers'
 * forwards run without grad, their replays count nothing) it moves as
 * without. */
START_TEST(test_score_bias_balance)
{
	const double c = 0.05;
	char cfg[1024], st[1024];
	snprintf(cfg, sizeof cfg, "%s/t/golden/hf/deepseek_v3/config.json",
		 tu_srcdir());
	snprintf(st, sizeof st, "%s/t/golden/hf/deepseek_v3/model.safetensors",
		 tu_srcdir());
	double moved_by[2][8] = { { 0 } };
	for (int arm = 0; arm < 3; arm++) {
		epj_ctx *ctx = tu_ctx();
		epj_model *m = NULL;
		epj_model_opts o = { .layout = EPJ_LAYOUT_NESTED,
				     .seed = 5,
				     .dtype = EPJ_DTYPE_F32 };
		ck_assert_int_eq(epj_model_new(ctx, cfg, &o, &m), EPJ_OK);
		char js[512];
		snprintf(js, sizeof js,
			 "{\"train_micro_batch_size_per_gpu\": 2, "
			 "\"optimizer\": {\"type\": \"AdamW\", \"params\": "
			 "{\"lr\": 0.01, \"weight_decay\": 0.1}}%s%s}",
			 arm ? ", \"expert_parallel\": "
			       "{\"load_balance_coeff\": 0.05}"
			     : "",
			 arm == 2 ? ", \"activation_checkpointing\": "
				    "{\"enabled\": true}"
				  : "");
		epj_engine *e = new_engine(ctx, m, js);
		ck_assert_msg(epj_engine_load(e, st) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		double before[2][8], after[2][8];
		int nb = 0, idx[2];
		for (int i = 0; i < epj_model_num_params(m); i++) {
			const char *nm = epj_model_param_name(m, i);
			if (!strstr(nm, "e_score_correction_bias"))
				continue;
			ck_assert_int_lt(nb, 2);
			epj_tensor *b = epj_model_param(m, i);
			ck_assert(!epj_tensor_requires_grad(b));
			ck_assert_int_eq(epj_tensor_numel(b), 8);
			ck_assert_int_eq(epj_tensor_to_f64(ctx, b, before[nb]),
					 EPJ_OK);
			idx[nb++] = i;
		}
		ck_assert_int_eq(nb, 2); /* layers 1 and 2 (layer 0 dense) */
		epj_corpus *corp = epj_corpus_synthetic(ctx, 97, 11);
		tu_ok(ctx, corp);
		for (int s = 0; s < 3; s++) {
			epj_tensor *ids = NULL, *lab = NULL;
			ck_assert_int_eq(
			    epj_corpus_next_batch(ctx, corp, 2, 7, &ids, &lab),
			    EPJ_OK);
			train(e, ctx, ids, lab, NULL);
			epj_tensor_free(ids);
			epj_tensor_free(lab);
		}
		int moved = 0;
		for (int j = 0; j < nb; j++) {
			epj_tensor *b = epj_model_param(m, idx[j]);
			ck_assert_int_eq(epj_tensor_dtype(b), EPJ_DTYPE_F32);
			ck_assert_ptr_null(epj_tensor_grad(b));
			ck_assert_int_eq(epj_tensor_to_f64(ctx, b, after[j]),
					 EPJ_OK);
			for (int x = 0; x < 8; x++) {
				double d = after[j][x] - before[j][x];
				if (!arm) {
					ck_assert_msg(d == 0,
						      "bias moved by %g "
						      "without a "
						      "coefficient",
						      d);
					continue;
				}
				double q = d / c;
				ck_assert_msg(fabs(q - round(q)) < 1e-4 &&
						  fabs(q) <= 3 + 1e-4,
					      "bias moved by %g: not a "
					      "multiple of %g up to 3",
					      d, c);
				moved += d != 0;
				if (arm == 1)
					moved_by[j][x] = d;
				else
					ck_assert_msg(
					    d == moved_by[j][x],
					    "with checkpointing a bias moved "
					    "by %g, without by %g",
					    d, moved_by[j][x]);
			}
		}
		if (arm)
			ck_assert_int_gt(moved, 0);
		epj_corpus_free(corp);
		epj_engine_free(e);
		epj_model_free(m);
		epj_ctx_free(ctx);
	}
}
END_TEST

START_TEST(test_train_converges)
{
	epj_ctx *ctx = tu_ctx();
	epj_model *m = new_model(ctx, (uint64_t)tu_randint(1, 1 << 30));
	epj_engine *e = new_engine(
	    ctx, m,
	    "{\"train_micro_batch_size_per_gpu\": 8, \"optimizer\": {\"type\": "
	    "\"AdamW\", \"params\": {\"lr\": 0.01, \"weight_decay\": 0.0}}, "
	    "\"scheduler\": {\"type\": \"WarmupLR\", \"params\": "
	    "{\"warmup_min_lr\": 0, \"warmup_max_lr\": 0.01, "
	    "\"warmup_num_steps\": 10, \"warmup_type\": \"linear\"}}, "
	    "\"gradient_clipping\": 1.0}");
	ck_assert_int_eq(epj_engine_micro_batch_size(e), 8);
	uint64_t cs = (uint64_t)tu_randint(1, 1 << 30);
	epj_corpus *train_c = epj_corpus_synthetic(ctx, E_V, cs);
	tu_ok(ctx, train_c);
	epj_corpus *eval_c = epj_corpus_fork(ctx, train_c, 1);
	tu_ok(ctx, eval_c);
	double floor = epj_corpus_entropy_rate(train_c);
	ck_assert(floor > 0 && floor < log((double)E_V));
	/* held-out batches, fixed for the run: 2048 tokens, so the sampling
	 * error of the held-out mean is about 0.02 nats */
	enum { NE = 8 };
	epj_tensor *eids[NE], *elab[NE];
	for (int i = 0; i < NE; i++)
		ck_assert_int_eq(epj_corpus_next_batch(ctx, eval_c, 8, 32,
						       &eids[i], &elab[i]),
				 EPJ_OK);
	double before = 0, after = 0;
	for (int i = 0; i < NE; i++) {
		double l;
		ck_assert_int_eq(epj_engine_eval(e, eids[i], elab[i], &l),
				 EPJ_OK);
		before += l / NE;
	}
	const int steps = 150;
	epj_step_info info;
	for (int s = 0; s < steps; s++) {
		epj_tensor *ids = NULL, *lab = NULL;
		ck_assert_int_eq(
		    epj_corpus_next_batch(ctx, train_c, 8, 16, &ids, &lab),
		    EPJ_OK);
		train(e, ctx, ids, lab, &info);
		ck_assert(info.stepped);
		ck_assert_int_eq(info.step, s + 1);
		ck_assert(isfinite(info.grad_norm) && info.grad_norm > 0);
		epj_tensor_free(ids);
		epj_tensor_free(lab);
	}
	ck_assert_int_eq(epj_engine_step_count(e), steps);
	ck_assert_msg(fabs(info.lr - 0.01) < 1e-12, "lr %g after warm-up",
		      info.lr);
	for (int i = 0; i < NE; i++) {
		double l;
		ck_assert_int_eq(epj_engine_eval(e, eids[i], elab[i], &l),
				 EPJ_OK);
		after += l / NE;
		epj_tensor_free(eids[i]);
		epj_tensor_free(elab[i]);
	}
	/* an untrained model predicts about uniformly: ln V, give or take the
	 * spread of its random logits (0.1 above it for some seeds) */
	ck_assert_msg(fabs(before - log((double)E_V)) < 0.3,
		      "initial loss %g, expected about ln(%d)", before, E_V);
	ck_assert_msg(after < before - 1.0 && after < floor + 0.25 &&
			  after > floor - 0.1,
		      "held-out loss %.4f -> %.4f after %d steps (floor %.4f)",
		      before, after, steps, floor);
	epj_corpus_free(train_c);
	epj_corpus_free(eval_c);
	epj_engine_free(e);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- save / load / resume --------------------------------------------------
 */

static void resume_identity(const char *json)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("engine");
	char ck[160], f1[160], f2[160];
	snprintf(ck, sizeof ck, "%s/ck.safetensors", dir);
	snprintf(f1, sizeof f1, "%s/end1.safetensors", dir);
	snprintf(f2, sizeof f2, "%s/end2.safetensors", dir);
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	batches b;
	batches_make(ctx, &b, 12, 3, 9, seed);

	epj_model *m1 = new_model(ctx, seed);
	epj_engine *e1 = new_engine(ctx, m1, json);
	bool bf16 = epj_engine_bf16(e1);
	int64_t gas = epj_engine_grad_accum_steps(e1);
	for (int i = 0; i < 6; i++)
		train(e1, ctx, b.ids[i], b.labels[i], NULL);
	ck_assert_msg(epj_engine_save(e1, ck) == EPJ_OK, "save: %s",
		      epj_ctx_error(ctx));
	double loss1[6];
	for (int i = 6; i < 12; i++)
		loss1[i - 6] = train(e1, ctx, b.ids[i], b.labels[i], NULL);
	snap p1;
	snap_take(ctx, m1, &p1);

	/* a model from another seed: the load must set everything */
	epj_model *m2 = new_model(ctx, seed + 1);
	epj_engine *e2 = new_engine(ctx, m2, json);
	ck_assert_msg(epj_engine_load(e2, ck) == EPJ_OK, "load: %s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_engine_step_count(e2), 6 / gas);
	for (int i = 0; i < epj_model_num_params(m2); i++)
		ck_assert_int_eq(epj_tensor_dtype(epj_model_param(m2, i)),
				 bf16 ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32);
	epj_step_info info;
	for (int i = 6; i < 12; i++) {
		double l = train(e2, ctx, b.ids[i], b.labels[i], &info);
		ck_assert_msg(l == loss1[i - 6],
			      "%s: micro-batch %d loss %.9g after resume, "
			      "%.9g uninterrupted",
			      json, i, l, loss1[i - 6]);
	}
	ck_assert_int_eq(info.step, 12 / gas);
	ck_assert_int_eq(info.micro_step, 12);
	snap p2;
	snap_take(ctx, m2, &p2);
	snap_assert_equal(m1, &p1, &p2, "resumed vs uninterrupted");

	/* the whole training state agrees: byte-identical checkpoints */
	ck_assert_int_eq(epj_engine_save(e1, f1), EPJ_OK);
	ck_assert_int_eq(epj_engine_save(e2, f2), EPJ_OK);
	size_t n1, n2;
	unsigned char *c1 = tu_read_file(f1, &n1), *c2 = tu_read_file(f2, &n2);
	ck_assert_msg(n1 == n2 && !memcmp(c1, c2, n1),
		      "%s: final checkpoints differ (%zu vs %zu bytes)", json,
		      n1, n2);
	free(c1);
	free(c2);

	snap_free(&p1);
	snap_free(&p2);
	epj_engine_free(e1);
	epj_engine_free(e2);
	epj_model_free(m1);
	epj_model_free(m2);
	batches_free(&b);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}

#define SCHED                                                                  \
	"\"scheduler\": {\"type\": \"WarmupLR\", \"params\": "                 \
	"{\"warmup_min_lr\": 0.001, \"warmup_max_lr\": 0.05, "                 \
	"\"warmup_num_steps\": 20, \"warmup_type\": \"linear\"}}"
#define SGD_M                                                                  \
	"\"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": 0.05, "       \
	"\"momentum\": 0.9, \"weight_decay\": 0.01}}"
#define ADAMW                                                                  \
	"\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, "     \
	"\"weight_decay\": 0.05}}, \"gradient_clipping\": 0.5"

START_TEST(test_resume_sgd_f32)
{
	resume_identity("{\"train_micro_batch_size_per_gpu\": 3, " SGD_M
			", " SCHED "}");
}
END_TEST

START_TEST(test_resume_adamw_f32)
{
	resume_identity("{\"train_micro_batch_size_per_gpu\": 3, "
			"\"gradient_accumulation_steps\": 2, " ADAMW ", " SCHED
			"}");
}
END_TEST

START_TEST(test_resume_sgd_bf16)
{
	resume_identity("{\"train_micro_batch_size_per_gpu\": 3, \"bf16\": "
			"{\"enabled\": true}, " SGD_M ", " SCHED "}");
}
END_TEST

START_TEST(test_resume_adamw_bf16)
{
	resume_identity("{\"train_micro_batch_size_per_gpu\": 3, \"bf16\": "
			"{\"enabled\": true}, \"gradient_accumulation_steps\": "
			"2, " ADAMW ", " SCHED "}");
}
END_TEST

/* ---- failed loads change nothing
 * ---------------------------------------------
 */

/* Loads `path`, expects failure with `status` (0: any) and a message
 * containing `needle`, and the parameters and step count as before. */
static void expect_load_fails(epj_ctx *ctx, epj_engine *e, const char *path,
			      epj_status status, const char *needle,
			      const snap *before, const char *what)
{
	int64_t steps = epj_engine_step_count(e);
	epj_ctx_clear_error(ctx);
	epj_status st = epj_engine_load(e, path);
	ck_assert_msg(st != EPJ_OK, "%s: load succeeded", what);
	if (status)
		ck_assert_msg(st == status, "%s: status %s, expected %s (%s)",
			      what, epj_status_name(st),
			      epj_status_name(status), epj_ctx_error(ctx));
	ck_assert_msg(strstr(epj_ctx_error(ctx), needle) != NULL,
		      "%s: message \"%s\" does not name \"%s\"", what,
		      epj_ctx_error(ctx), needle);
	snap now;
	snap_take(ctx, epj_engine_model(e), &now);
	snap_assert_equal(epj_engine_model(e), before, &now, what);
	snap_free(&now);
	ck_assert_int_eq(epj_engine_step_count(e), steps);
	epj_ctx_clear_error(ctx);
}

/* A safetensors file holding the model's current parameters, with one
 * dropped (skip), one reshaped (bad_shape: its first dim + 1) and one extra
 * tensor (extra); NULL for none of each. */
static void write_params(epj_ctx *ctx, const epj_model *m, const char *path,
			 const char *skip, const char *bad_shape,
			 const char *extra)
{
	epj_st_writer *w = NULL;
	ck_assert_int_eq(epj_st_writer_new(ctx, &w), EPJ_OK);
	for (int i = 0; i < epj_model_num_params(m); i++) {
		const char *nm = epj_model_param_name(m, i);
		epj_tensor *p = epj_model_param(m, i);
		if (skip && !strcmp(nm, skip))
			continue;
		epj_tensor *t = NULL;
		if (bad_shape && !strcmp(nm, bad_shape)) {
			int64_t sh[EPJ_MAX_DIMS];
			memcpy(sh, epj_tensor_shape(p),
			       sizeof(int64_t) * (size_t)epj_tensor_ndim(p));
			sh[0] += 1;
			t = epj_full(ctx, EPJ_DTYPE_F32, epj_tensor_ndim(p), sh,
				     0.5);
		} else {
			t = epj_cast(ctx, p, EPJ_DTYPE_F32);
		}
		tu_ok(ctx, t);
		ck_assert_int_eq(epj_st_writer_add(w, nm, t), EPJ_OK);
		epj_tensor_free(t);
	}
	if (extra) {
		int64_t n = 3;
		epj_tensor *t = epj_full(ctx, EPJ_DTYPE_F32, 1, &n, 1.0);
		ck_assert_int_eq(epj_st_writer_add(w, extra, t), EPJ_OK);
		epj_tensor_free(t);
	}
	ck_assert_msg(epj_st_writer_save(w, path) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_st_writer_free(w);
}

START_TEST(test_load_failures)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("engine");
	const char *names[] = { "good",	   "trunc", "half",  "hdr",
				"hugelen", "miss",  "shape", "extra",
				"sgd",	   "plain", "empty", "missing_file" };
	char p[12][160];
	for (int i = 0; i < 12; i++)
		snprintf(p[i], sizeof p[i], "%s/%s", dir, names[i]);
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	batches b;
	batches_make(ctx, &b, 4, 2, 7, seed);
	epj_model *m = new_model(ctx, seed);
	epj_engine *e = new_engine(
	    ctx, m, "{\"train_micro_batch_size_per_gpu\": 2, " ADAMW "}");
	train(e, ctx, b.ids[0], b.labels[0], NULL);
	train(e, ctx, b.ids[1], b.labels[1], NULL);
	ck_assert_int_eq(epj_engine_save(e, p[0]), EPJ_OK);
	/* move on, so that "unchanged" differs from the file's values */
	train(e, ctx, b.ids[2], b.labels[2], NULL);
	snap before;
	snap_take(ctx, m, &before);

	size_t n;
	unsigned char *good = tu_read_file(p[0], &n);
	ck_assert_int_gt(n, 1000);
	/* truncated: the last 100 bytes, and half of the file, missing */
	tu_write_file(p[1], good, n - 100);
	expect_load_fails(ctx, e, p[1], 0, p[1], &before, "truncated");
	tu_write_file(p[2], good, n / 2);
	expect_load_fails(ctx, e, p[2], 0, p[2], &before, "half");
	/* corrupt JSON header */
	unsigned char *bad = malloc(n);
	ck_assert_ptr_nonnull(bad);
	memcpy(bad, good, n);
	memcpy(bad + 8, "{\"x\"::[", 7);
	tu_write_file(p[3], bad, n);
	expect_load_fails(ctx, e, p[3], EPJ_ERR_FORMAT, p[3], &before,
			  "corrupt header");
	/* header length beyond the file */
	memcpy(bad, good, n);
	for (int i = 0; i < 8; i++)
		bad[i] = i == 5 ? 0x7f : 0x00;
	tu_write_file(p[4], bad, n);
	expect_load_fails(ctx, e, p[4], 0, p[4], &before, "header length");
	free(bad);
	/* an empty file */
	tu_write_file(p[10], "", 0);
	expect_load_fails(ctx, e, p[10], 0, p[10], &before, "empty file");
	/* a file that does not exist */
	expect_load_fails(ctx, e, p[11], EPJ_ERR_IO, p[11], &before,
			  "missing file");

	/* missing parameter (late in model order) */
	const char *late = "model.layers.1.mlp.experts.2.down_proj.weight";
	write_params(ctx, m, p[5], late, NULL, NULL);
	expect_load_fails(ctx, e, p[5], EPJ_ERR_FORMAT, late, &before,
			  "missing parameter");
	/* wrong shape of the second to last parameter: every earlier one
	 * would already have been copied without validation up front */
	write_params(ctx, m, p[6], NULL, "model.norm.weight", NULL);
	expect_load_fails(ctx, e, p[6], EPJ_ERR_SHAPE, "model.norm.weight",
			  &before, "wrong shape");
	/* a tensor the model does not have */
	write_params(ctx, m, p[7], NULL, NULL,
		     "model.layers.7.mlp.gate.weight");
	expect_load_fails(ctx, e, p[7], EPJ_ERR_FORMAT,
			  "model.layers.7.mlp.gate.weight", &before,
			  "unknown tensor");

	/* A training checkpoint of another optimizer (SGD without momentum:
	 * no optimizer state at all) loaded into this AdamW engine: the
	 * exp_avg state is missing.  The parameters must stay unchanged
	 * (the optimizer state is validated before the masters are
	 * copied). */
	{
		epj_model *ms = new_model(ctx, seed + 7);
		epj_engine *es = new_engine(
		    ctx, ms,
		    "{\"train_micro_batch_size_per_gpu\": 2, \"optimizer\": "
		    "{\"type\": \"SGD\", \"params\": {\"lr\": 0.1}}}");
		train(es, ctx, b.ids[3], b.labels[3], NULL);
		ck_assert_int_eq(epj_engine_save(es, p[8]), EPJ_OK);
		epj_engine_free(es);
		epj_model_free(ms);
		expect_load_fails(ctx, e, p[8], EPJ_ERR_FORMAT,
				  "optimizer.exp_avg.", &before,
				  "missing optimizer state");
	}

	/* a plain HF checkpoint (weights only) loads: values from the file,
	 * progress reset */
	epj_model *mh = new_model(ctx, seed + 3);
	write_params(ctx, mh, p[9], NULL, NULL, NULL);
	ck_assert_msg(epj_engine_load(e, p[9]) == EPJ_OK, "plain HF: %s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_engine_step_count(e), 0);
	snap hs, now;
	snap_take(ctx, mh, &hs);
	snap_take(ctx, m, &now);
	snap_assert_equal(m, &hs, &now, "plain HF load");
	snap_free(&hs);
	snap_free(&now);
	epj_model_free(mh);
	/* and the good training checkpoint still loads after all failures */
	ck_assert_msg(epj_engine_load(e, p[0]) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_engine_step_count(e), 2);

	free(good);
	snap_free(&before);
	epj_engine_free(e);
	epj_model_free(m);
	batches_free(&b);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- expert-load metrics ---------------------------------------------------
 */

/* The figures of hand-made loads: known max/mean, CV and dead experts;
 * a balanced layer exactly 1, 0, 0; no token: NaN ratios. */
START_TEST(test_expert_load_summary)
{
	epj_expert_load x;
	/* mean 4: max 9 / 4; deviations 1, -4, -2, 5: CV sqrt(46 / 4) / 4 */
	ej_expert_load_summary((const int64_t[]){ 5, 0, 2, 9 }, 4, &x);
	ck_assert_int_eq(x.num_experts, 4);
	ck_assert_int_eq(x.total, 16);
	ck_assert_int_eq(x.dead, 1);
	ck_assert(fabs(x.max_over_mean - 2.25) <= 1e-15);
	ck_assert(fabs(x.cv - sqrt(11.5) / 4) <= 1e-15);
	ej_expert_load_summary((const int64_t[]){ 7, 7, 7 }, 3, &x);
	ck_assert(x.max_over_mean == 1.0 && x.cv == 0.0 && x.dead == 0);
	ej_expert_load_summary((const int64_t[]){ 0, 0 }, 2, &x);
	ck_assert(isnan(x.max_over_mean) && isnan(x.cv) && x.dead == 2);
	/* a world of one: unchanged */
	int64_t v[2] = { (int64_t)1 << 40, 3 };
	epj_ctx *ctx = tu_ctx();
	ck_assert_int_eq(ej_expert_load_reduce(ctx, NULL, v, 2), EPJ_OK);
	ck_assert(v[0] == (int64_t)1 << 40 && v[1] == 3);
	epj_ctx_free(ctx);
}
END_TEST

/* The engine's figures: with fixed routing every layer is balanced, exactly
 * (max/mean 1, CV 0, no dead expert), and each step counts its B x T x k x
 * gas assignments once (checkpoint replays and evaluation not counted);
 * with a zero router every token's scores tie and it goes to experts 0 and
 * 1: loads (N, N, 0, 0), max/mean 2, CV 1, 2 dead.  Off (the default), no
 * figures. */
START_TEST(test_expert_load_engine)
{
	enum { B = 2, T = 5, K = 2, GAS = 2 };
	epj_ctx *ctx = tu_ctx();
	batches b;
	batches_make(ctx, &b, 4, B, T, 11);
	epj_model *m = new_model(ctx, 3);
	epj_engine *e =
	    new_engine(ctx, m,
		       "{\"train_micro_batch_size_per_gpu\": 2, "
		       "\"gradient_accumulation_steps\": 2, "
		       "\"activation_checkpointing\": {\"enabled\": true}, "
		       "\"expert_parallel\": {\"fixed_routing\": true}}");
	ck_assert_int_eq(epj_engine_num_moe_layers(e), 2);
	epj_expert_load x;
	train(e, ctx, b.ids[0], b.labels[0], NULL);
	train(e, ctx, b.ids[1], b.labels[1], NULL);
	ck_assert(!epj_engine_expert_load(e, 0, &x)); /* off */
	epj_engine_track_expert_load(e, true);
	for (int s = 0; s < 2; s++) {
		double l;
		train(e, ctx, b.ids[2 * s], b.labels[2 * s], NULL);
		ck_assert_int_eq(epj_engine_eval(e, b.ids[3], b.labels[3], &l),
				 EPJ_OK);
		train(e, ctx, b.ids[2 * s + 1], b.labels[2 * s + 1], NULL);
		for (int i = 0; i < 2; i++) {
			ck_assert(epj_engine_expert_load(e, i, &x));
			ck_assert_int_eq(x.layer, i);
			ck_assert_int_eq(x.num_experts, 4);
			ck_assert_int_eq(x.total, B * T * K * GAS);
			ck_assert_msg(
			    x.max_over_mean == 1.0 && x.cv == 0.0 &&
				x.dead == 0,
			    "fixed routing, layer %d: max/mean %.17g, "
			    "CV %.17g, dead %d",
			    i, x.max_over_mean, x.cv, x.dead);
		}
	}
	ck_assert(!epj_engine_expert_load(e, 2, &x));
	epj_engine_free(e);

	/* a zero router, SGD with lr 0 so that it stays zero */
	for (int i = 0; i < epj_model_num_params(m); i++) {
		const char *n = epj_model_param_name(m, i);
		if (!strstr(n, "mlp.gate.weight"))
			continue;
		epj_tensor *p = epj_model_param(m, i);
		epj_tensor *z = epj_zeros(
		    ctx, EPJ_DTYPE_F32, 2,
		    (int64_t[]){ epj_tensor_dim(p, 0), epj_tensor_dim(p, 1) });
		ck_assert_int_eq(epj_model_set_param(ctx, m, i, z), EPJ_OK);
		epj_tensor_free(z);
	}
	e = new_engine(ctx, m,
		       "{\"train_micro_batch_size_per_gpu\": 2, "
		       "\"gradient_accumulation_steps\": 2, "
		       "\"optimizer\": {\"type\": \"SGD\", \"params\": "
		       "{\"lr\": 0}}}");
	epj_engine_track_expert_load(e, true);
	train(e, ctx, b.ids[0], b.labels[0], NULL);
	train(e, ctx, b.ids[1], b.labels[1], NULL);
	for (int i = 0; i < 2; i++) {
		ck_assert(epj_engine_expert_load(e, i, &x));
		ck_assert_int_eq(x.total, B * T * K * GAS);
		ck_assert_msg(x.max_over_mean == 2.0 && x.cv == 1.0 &&
				  x.dead == 2,
			      "a zero router, layer %d: max/mean %.17g, CV "
			      "%.17g, dead %d",
			      i, x.max_over_mean, x.cv, x.dead);
	}
	epj_engine_free(e);
	epj_model_free(m);
	batches_free(&b);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- configuration errors --------------------------------------------------
 */

START_TEST(test_config_errors)
{
	static const struct {
		const char *json;
		epj_status status;
		const char *key; /* the message names it */
	} cases[] = {
		{ "{\"expert_parallel\": {\"enabled\": true, \"comm_backend\": "
		  "\"deepep\"}}",
		  EPJ_ERR_UNSUPPORTED, "expert_parallel.comm_backend" },
		{ "{\"zero_optimization\": {\"stage\": 3}}",
		  EPJ_ERR_UNSUPPORTED, "zero_optimization.stage" },
		{ "{\"zero_optimization\": {\"stage\": 2, "
		  "\"offload_optimizer\": {\"device\": \"cpu\"}}}",
		  EPJ_ERR_UNSUPPORTED, "offload_optimizer" },
		{ "{\"zero_optimization\": {\"stage\": 1, \"offload_param\": "
		  "{\"device\": \"cpu\"}}}",
		  EPJ_ERR_UNSUPPORTED, "offload_param" },
		{ "{\"expert_parallel\": {\"enabled\": true, \"autoep_size\": "
		  "2}}",
		  EPJ_ERR_UNSUPPORTED, "expert_parallel.autoep_size" },
		{ "{\"expert_parallel\": {\"enabled\": true, \"top_k\": 3}}",
		  EPJ_ERR_CONFIG, "expert_parallel.top_k" },
		{ "{\"sequence_parallel_size\": 2}", EPJ_ERR_UNSUPPORTED,
		  "sequence_parallel_size" },
		{ "{\"pipeline\": {\"stages\": 2}}", EPJ_ERR_UNSUPPORTED,
		  "pipeline.stages" },
		{ "{\"train_micro_batch_size\": 2}", EPJ_ERR_CONFIG,
		  "train_micro_batch_size" },
		{ "{\"optimizer\": {\"type\": \"Adamx\"}}", EPJ_ERR_CONFIG,
		  "optimizer.type" },
		{ "{\"train_batch_size\": 3, "
		  "\"train_micro_batch_size_per_gpu\": 2}",
		  EPJ_ERR_CONFIG, "train_batch_size" },
		/* products near 2^62 in checked arithmetic */
		{ "{\"train_micro_batch_size_per_gpu\": 2147483647, "
		  "\"gradient_accumulation_steps\": 2147483647}",
		  EPJ_ERR_CONFIG,
		  "the global batch must be in [1, 2147483648]" },
		{ "{\"train_micro_batch_size_per_gpu\": 65536, "
		  "\"gradient_accumulation_steps\": 32769}",
		  EPJ_ERR_CONFIG, "out of range" },
	};
	epj_ctx *ctx = tu_ctx();
	epj_model *m = new_model(ctx, 5);
	snap before;
	snap_take(ctx, m, &before);
	for (size_t i = 0; i < EJ_ARRAY_LEN(cases); i++) {
		/* bf16 and checkpointing requested too: a refused config
		 * must not have converted the model first */
		char json[512];
		snprintf(json, sizeof json,
			 "{\"bf16\": {\"enabled\": true}, "
			 "\"activation_checkpointing\": {\"enabled\": true}, "
			 "%s",
			 cases[i].json + 1);
		epj_engine *e = (epj_engine *)&before;
		epj_ctx_clear_error(ctx);
		epj_status st =
		    epj_engine_initialize_json(ctx, m, json, "bad.json", &e);
		ck_assert_msg(
		    st == cases[i].status, "%s: status %s, expected %s (%s)",
		    json, epj_status_name(st), epj_status_name(cases[i].status),
		    epj_ctx_error(ctx));
		ck_assert_ptr_null(e);
		const char *msg = epj_ctx_error(ctx);
		ck_assert_msg(strstr(msg, cases[i].key) &&
				  strstr(msg, "bad.json"),
			      "%s: message \"%s\" does not name %s and the "
			      "source",
			      json, msg, cases[i].key);
		for (int k = 0; k < epj_model_num_params(m); k++)
			ck_assert_int_eq(
			    epj_tensor_dtype(epj_model_param(m, k)),
			    EPJ_DTYPE_F32);
		ck_assert(!epj_module_find(epj_model_root(m), "model.layers.0")
			       ->checkpoint);
	}
	snap now;
	snap_take(ctx, m, &now);
	snap_assert_equal(m, &before, &now, "after refused configs");
	snap_free(&now);
	snap_free(&before);
	/* NULL model, unreadable config file */
	epj_engine *e = NULL;
	ck_assert_int_ne(epj_engine_initialize_json(ctx, NULL, "{}", "x", &e),
			 EPJ_OK);
	ck_assert_ptr_null(e);
	ck_assert_int_eq(
	    epj_engine_initialize(ctx, m, "/nonexistent/epjit/ds.json", &e),
	    EPJ_ERR_IO);
	ck_assert_ptr_null(e);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "/nonexistent/epjit/ds.json"),
		      "%s", epj_ctx_error(ctx));
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* The run's device: an EPJIT_DEVICE that names no device, or a config
 * "device" that does not, is refused with the known names (a run would
 * otherwise train on the cpu without a word); unset, empty and every known
 * name are accepted. */
START_TEST(test_device_names)
{
	epj_ctx *ctx = tu_ctx();
	epj_model *m = new_model(ctx, 5);
	epj_engine *e = NULL;
	static const char *const bad[] = { "no-such-device", "gpu0", "CPU",
					   "cuda-sim " };
	for (size_t i = 0; i < EJ_ARRAY_LEN(bad); i++) {
		setenv("EPJIT_DEVICE", bad[i], 1);
		epj_status st =
		    epj_engine_initialize_json(ctx, m, "{}", "dev.json", &e);
		ck_assert_int_eq(st, EPJ_ERR_INVALID);
		ck_assert_ptr_null(e);
		char want[128];
		snprintf(want, sizeof want,
			 "EPJIT_DEVICE=\"%s\" is not a device (known: cpu, "
			 "cuda-sim, cuda)",
			 bad[i]);
		ck_assert_str_eq(epj_ctx_error(ctx), want);
	}
	/* the cuda names are known even where no GPU is: choosing the device
	 * is the program's (epj_ctx_new), not the engine's */
	static const char *const good[] = { "", "cpu", "cuda-sim", "cuda" };
	for (size_t i = 0; i < EJ_ARRAY_LEN(good); i++) {
		setenv("EPJIT_DEVICE", good[i], 1);
		ck_assert_msg(epj_engine_initialize_json(
				  ctx, m, "{}", "dev.json", &e) == EPJ_OK,
			      "EPJIT_DEVICE=\"%s\": %s", good[i],
			      epj_ctx_error(ctx));
		epj_engine_free(e);
		e = NULL;
	}
	unsetenv("EPJIT_DEVICE");
	ck_assert_int_eq(
	    epj_engine_initialize_json(ctx, m, "{}", "dev.json", &e), EPJ_OK);
	epj_engine_free(e);
	e = NULL;
	/* the config's "device": the parser's list of choices */
	ck_assert_int_eq(epj_engine_initialize_json(
			     ctx, m, "{\"device\": \"gpu0\"}", "dev.json", &e),
			 EPJ_ERR_CONFIG);
	ck_assert_msg(strstr(epj_ctx_error(ctx),
			     "\"device\" value \"gpu0\" is not supported; "
			     "expected one of \"cpu\", \"cuda-sim\", \"cuda\""),
		      "%s", epj_ctx_error(ctx));
	ck_assert_ptr_null(e);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* The device registry (lib/devices.c): every device the config's "device"
 * accepts is in it and the other way round; each descriptor answers for its
 * device what the layers above ask (the default codegen backend, CUDA C,
 * the collective library, grid reruns, cuBLASLt GEMMs); a context's device
 * carries its descriptor; epj_ctx_new refuses an unknown name with the
 * list.  Each answer is checked where it is used, too: the default
 * backends in test_compile's, the rest in the cuda-sim and cuda suites. */
START_TEST(test_device_registry)
{
	ck_assert_str_eq(epj_device_names(), "cpu, cuda-sim, cuda");
	static const struct {
		const char *name, *backend, *comm;
		bool cuda, rerun, lt;
		ej_module_form modules;
	} want[] = {
		{ "cpu", "c", NULL, false, false, false, EJ_MODULES_NONE },
		{ "cuda-sim", "cuda-sim", NULL, true, true, false,
		  EJ_MODULES_HOST_SO },
		{ "cuda", "nvrtc", "nccl", true, false, true,
		  EJ_MODULES_CUBIN },
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(want); i++) {
		const ej_device_desc *d = ej_device_find(want[i].name);
		ck_assert_ptr_nonnull(d);
		ck_assert(epj_device_known(want[i].name));
		ck_assert_str_eq(d->name, want[i].name);
		ck_assert_str_eq(d->backend, want[i].backend);
		if (want[i].comm)
			ck_assert_str_eq(d->comm, want[i].comm);
		else
			ck_assert_ptr_null(d->comm);
		ck_assert_int_eq(d->runs_cuda, want[i].cuda);
		ck_assert_int_eq(d->reruns_grids, want[i].rerun);
		ck_assert_int_eq(d->gemm_library, want[i].lt);
		ck_assert_int_eq(d->modules, want[i].modules);
		ck_assert_ptr_nonnull(d->open);
		/* the config's "device" takes it */
		char json[96];
		snprintf(json, sizeof json, "{\"device\": \"%s\"}",
			 want[i].name);
		ej_config c;
		epj_ctx *ctx = tu_ctx();
		ck_assert_msg(ej_config_parse(ctx, json, "dev.json", &c) ==
				  EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		ck_assert_str_eq(c.device, want[i].name);
		epj_ctx_free(ctx);
	}
	static const char *const bad[] = { "", "CPU", "cuda ", "gpu", "cud" };
	for (size_t i = 0; i < EJ_ARRAY_LEN(bad); i++) {
		ck_assert_ptr_null(ej_device_find(bad[i]));
		ck_assert(!epj_device_known(bad[i]));
		epj_ctx *ctx = NULL;
		ck_assert_int_eq(epj_ctx_new(bad[i], &ctx), EPJ_ERR_INVALID);
		ck_assert_ptr_null(ctx);
	}
	ck_assert_ptr_null(ej_device_find(NULL));
	ck_assert(!epj_device_known(NULL));
	/* the static devices carry their descriptors */
	static const char *const stat[] = { "cpu", "cuda-sim" };
	for (size_t i = 0; i < EJ_ARRAY_LEN(stat); i++) {
		epj_ctx *ctx = NULL;
		ck_assert_int_eq(epj_ctx_new(stat[i], &ctx), EPJ_OK);
		ck_assert_ptr_eq(ctx->dev->desc, ej_device_find(stat[i]));
		ck_assert_str_eq(ctx->dev->name, stat[i]);
		ck_assert_int_eq(ej_dev_runs_cuda(ctx->dev), i == 1);
		ck_assert_int_eq(ej_dev_reruns_grids(ctx->dev), i == 1);
		epj_ctx_free(ctx);
	}
}
END_TEST

/* Defaults (NULL path) and a config file. */
START_TEST(test_initialize_defaults)
{
	epj_ctx *ctx = tu_ctx();
	epj_model *m = new_model(ctx, 2);
	epj_engine *e = NULL;
	ck_assert_int_eq(epj_engine_initialize(ctx, m, NULL, &e), EPJ_OK);
	ck_assert_int_eq(epj_engine_micro_batch_size(e), 1);
	ck_assert_int_eq(epj_engine_grad_accum_steps(e), 1);
	ck_assert_int_eq(epj_engine_seed(e), 42);
	ck_assert_int_eq(epj_engine_steps_per_print(e), 10);
	ck_assert_int_eq(epj_engine_step_count(e), 0);
	ck_assert(!epj_engine_bf16(e));
	ck_assert_ptr_eq(epj_engine_model(e), m);
	epj_engine_free(e);
	tu_tmpfile ds = tu_tmpfile_new(
	    "engine", "ds.json",
	    "{\"train_batch_size\": 12, \"gradient_accumulation_steps\": 3, "
	    "\"seed\": 7, \"steps_per_print\": 5}");
	ck_assert_msg(epj_engine_initialize(ctx, m, ds.path, &e) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert_int_eq(epj_engine_micro_batch_size(e), 4);
	ck_assert_int_eq(epj_engine_grad_accum_steps(e), 3);
	ck_assert_int_eq(epj_engine_seed(e), 7);
	ck_assert_int_eq(epj_engine_steps_per_print(e), 5);
	epj_engine_free(e);
	tu_tmpfile_free(&ds);
	/* train_step without labels */
	ck_assert_int_eq(epj_engine_initialize(ctx, m, NULL, &e), EPJ_OK);
	int64_t sh[2] = { 1, 4 };
	epj_tensor *ids = epj_randint(ctx, EPJ_DTYPE_I64, 2, sh, 0, E_V);
	epj_step_info info;
	ck_assert_int_ne(epj_engine_train_step(e, ids, NULL, &info), EPJ_OK);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "labels"), "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_engine_step_count(e), 0);
	epj_tensor_free(ids);
	epj_engine_free(e);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- gradient accumulation -------------------------------------------------
 */

/* Fixed routing: learned routing may flip a near-tie token between the two
 * runs (the router GEMM sees another batch size, so its f32 rounding
 * differs), which moves the result by more than f32 noise.  Fixed routing
 * assigns token n of a micro-batch to experts (n*k + j) % E; with B*T*k a
 * multiple of E (2*8*2 = 32, E = 4) the tokens of b get the same experts
 * in [a; b] as alone, so both runs compute the same function. */
START_TEST(test_grad_accum)
{
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	const int64_t B = 2, T = 8;
	batches b;
	batches_make(ctx, &b, 6, B, T, seed);
	epj_model *ma = new_model(ctx, seed), *mb = new_model(ctx, seed);
	const char *opt = "\"optimizer\": {\"type\": \"SGD\", \"params\": "
			  "{\"lr\": 0.1, \"momentum\": 0.5}}, "
			  "\"expert_parallel\": {\"fixed_routing\": true}";
	char ja[256], jb[256];
	snprintf(ja, sizeof ja,
		 "{\"train_micro_batch_size_per_gpu\": %d, "
		 "\"gradient_accumulation_steps\": 2, %s}",
		 (int)B, opt);
	snprintf(jb, sizeof jb,
		 "{\"train_micro_batch_size_per_gpu\": %d, "
		 "\"gradient_accumulation_steps\": 1, %s}",
		 (int)(2 * B), opt);
	epj_engine *ea = new_engine(ctx, ma, ja), *eb = new_engine(ctx, mb, jb);
	for (int s = 0; s < 3; s++) {
		epj_step_info ia1, ia2, ib;
		train(ea, ctx, b.ids[2 * s], b.labels[2 * s], &ia1);
		ck_assert(!ia1.stepped);
		ck_assert_int_eq(ia1.step, s);
		train(ea, ctx, b.ids[2 * s + 1], b.labels[2 * s + 1], &ia2);
		ck_assert(ia2.stepped);
		ck_assert_int_eq(ia2.step, s + 1);
		ck_assert_int_eq(ia2.micro_step, 2 * s + 2);
		ck_assert_msg(fabs(ia2.mean_loss - (ia1.loss + ia2.loss) / 2) <
				  1e-12,
			      "mean_loss %.9g of %.9g and %.9g", ia2.mean_loss,
			      ia1.loss, ia2.loss);
		epj_tensor *ab[2] = { b.ids[2 * s], b.ids[2 * s + 1] };
		epj_tensor *lb[2] = { b.labels[2 * s], b.labels[2 * s + 1] };
		epj_tensor *ids = epj_cat(ctx, ab, 2, 0);
		epj_tensor *lab = epj_cat(ctx, lb, 2, 0);
		tu_ok(ctx, ids);
		tu_ok(ctx, lab);
		train(eb, ctx, ids, lab, &ib);
		epj_tensor_free(ids);
		epj_tensor_free(lab);
		ck_assert(ib.stepped);
		ck_assert_int_eq(ib.step, s + 1);
		ck_assert_msg(fabs(ib.mean_loss - ia2.mean_loss) <=
				  2e-6 * ib.mean_loss,
			      "step %d: loss %.9g (gas 1) vs %.9g (gas 2)", s,
			      ib.mean_loss, ia2.mean_loss);
		ck_assert_msg(fabs(ib.grad_norm - ia2.grad_norm) <=
				  1e-4 * ib.grad_norm,
			      "step %d: grad norm %.9g (gas 1) vs %.9g (gas 2)",
			      s, ib.grad_norm, ia2.grad_norm);
		ck_assert(ib.grad_norm > 0);
	}
	ck_assert_int_eq(epj_engine_step_count(ea), 3);
	ck_assert_int_eq(epj_engine_step_count(eb), 3);
	/* parameters after 3 steps agree to f32 accuracy (they moved by
	 * lr * g, so compare the updates' scale: atol 1e-6) */
	for (int i = 0; i < epj_model_num_params(ma); i++)
		tu_assert_tensors_close(ctx, epj_model_param(ma, i),
					epj_model_param(mb, i), 1e-4, 1e-6,
					epj_model_param_name(ma, i));
	/* and they did move */
	epj_model *m0 = new_model(ctx, seed);
	int moved = 0;
	for (int i = 0; i < epj_model_num_params(ma); i++) {
		double *x = tu_values(ctx, epj_model_param(ma, i));
		double *y = tu_values(ctx, epj_model_param(m0, i));
		for (int64_t k = 0;
		     k < epj_tensor_numel(epj_model_param(ma, i)); k++)
			moved += x[k] != y[k];
		free(x);
		free(y);
	}
	ck_assert_int_gt(moved, 100);
	epj_model_free(m0);
	epj_engine_free(ea);
	epj_engine_free(eb);
	epj_model_free(ma);
	epj_model_free(mb);
	batches_free(&b);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- bf16
 * --------------------------------------------------------------------
 */

/* Each bf16 parameter equals the RNE rounding of its FP32 master, read from
 * a checkpoint (which stores the masters); at least some masters hold more
 * precision than bf16 once the optimizer has stepped. */
static void check_masters(epj_ctx *ctx, epj_engine *e, const char *path,
			  bool expect_extra_precision)
{
	ck_assert_int_eq(epj_engine_save(e, path), EPJ_OK);
	epj_st_file *f = NULL;
	ck_assert_int_eq(epj_st_open(ctx, path, &f), EPJ_OK);
	epj_model *m = epj_engine_model(e);
	int64_t finer = 0;
	for (int i = 0; i < epj_model_num_params(m); i++) {
		const char *nm = epj_model_param_name(m, i);
		epj_tensor *p = epj_model_param(m, i);
		ck_assert_int_eq(epj_tensor_dtype(p), EPJ_DTYPE_BF16);
		int k = epj_st_find(f, nm);
		ck_assert_msg(k >= 0, "%s not in the checkpoint", nm);
		ck_assert_str_eq(epj_st_dtype_str_at(f, k), "F32");
		epj_tensor *ms = epj_st_get(ctx, f, nm);
		tu_ok(ctx, ms);
		double *vm = tu_values(ctx, ms), *vp = tu_values(ctx, p);
		for (int64_t j = 0; j < epj_tensor_numel(p); j++) {
			float rne =
			    epj_bf16_to_f32(epj_f32_to_bf16((float)vm[j]));
			ck_assert_msg(vp[j] == (double)rne,
				      "%s[%lld]: param %.9g, RNE(master %.9g) "
				      "= %.9g",
				      nm, (long long)j, vp[j], vm[j],
				      (double)rne);
			finer += vm[j] != vp[j];
		}
		free(vm);
		free(vp);
		epj_tensor_free(ms);
	}
	epj_st_close(f);
	if (expect_extra_precision)
		ck_assert_msg(finer > 100,
			      "only %lld masters finer than bf16 after a step",
			      (long long)finer);
	else
		ck_assert_int_eq(finer, 0);
}

START_TEST(test_bf16_masters)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("engine");
	char p[160];
	snprintf(p, sizeof p, "%s/ck.safetensors", dir);
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *m = new_model(ctx, seed), *mf = new_model(ctx, seed);
	epj_engine *e = new_engine(
	    ctx, m,
	    "{\"train_micro_batch_size_per_gpu\": 2, \"bf16\": {\"enabled\": "
	    "true}, \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": "
	    "0.001}}}");
	ck_assert(epj_engine_bf16(e));
	/* parameters: bf16, the RNE of the f32 init */
	for (int i = 0; i < epj_model_num_params(m); i++) {
		epj_tensor *pb = epj_model_param(m, i);
		ck_assert_int_eq(epj_tensor_dtype(pb), EPJ_DTYPE_BF16);
		ck_assert(epj_tensor_requires_grad(pb));
		double *vb = tu_values(ctx, pb);
		double *vf = tu_values(ctx, epj_model_param(mf, i));
		for (int64_t k = 0; k < epj_tensor_numel(pb); k++)
			ck_assert(vb[k] == (double)epj_bf16_to_f32(
					       epj_f32_to_bf16((float)vf[k])));
		free(vb);
		free(vf);
	}
	/* before any step the masters are the bf16 values themselves */
	check_masters(ctx, e, p, false);
	batches b;
	batches_make(ctx, &b, 3, 2, 9, seed);
	for (int s = 0; s < 3; s++) {
		epj_step_info info;
		train(e, ctx, b.ids[s], b.labels[s], &info);
		ck_assert(info.stepped);
		check_masters(ctx, e, p, true);
	}
	batches_free(&b);
	epj_engine_free(e);
	epj_model_free(m);
	epj_model_free(mf);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* The f32 view of bf16 parameters (lib/wcache.c): an engine with the view
 * and one without (the per-call conversion) train bit for bit alike over
 * steps that change every weight; the cached arm really reused its views
 * (hits) and the other never filled one.  Then writes through the public
 * writers (copy_, epj_tensor_data, set_f64) between two direct linears on
 * a parameter must be seen by the second. */
static double linear_max_diff(epj_ctx *ctx, epj_tensor *x, epj_tensor *w)
{
	epj_tensor *y = epj_linear(ctx, x, w, NULL);
	epj_tensor *wc = epj_cast(ctx, w, EPJ_DTYPE_F32); /* not a param */
	epj_tensor *wb = epj_cast(ctx, wc, EPJ_DTYPE_BF16);
	epj_tensor *r = epj_linear(ctx, x, wb, NULL);
	tu_ok(ctx, y);
	tu_ok(ctx, r);
	double *a = tu_values(ctx, y), *b = tu_values(ctx, r), d = 0;
	for (int64_t k = 0; k < epj_tensor_numel(y); k++)
		d = fmax(d, fabs(a[k] - b[k]));
	free(a);
	free(b);
	epj_tensor_free(y);
	epj_tensor_free(r);
	epj_tensor_free(wc);
	epj_tensor_free(wb);
	return d;
}

START_TEST(test_bf16_weight_cache)
{
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	const char *cfg =
	    "{\"train_micro_batch_size_per_gpu\": 3, \"bf16\": {\"enabled\": "
	    "true}, \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": "
	    "0.01}}}";
	epj_ctx *ctx[2];
	epj_model *m[2];
	epj_engine *e[2];
	batches b[2];
	snap s0[2];
	for (int a = 0; a < 2; a++) {
		ctx[a] = tu_ctx();
		ctx[a]->no_wcache = a == 1;
		m[a] = new_model(ctx[a], seed);
		e[a] = new_engine(ctx[a], m[a], cfg);
		ck_assert(epj_engine_bf16(e[a]));
		batches_make(ctx[a], &b[a], 4, 3, 11, seed ^ 0x5a5a);
		snap_take(ctx[a], m[a], &s0[a]);
	}
	for (int step = 0; step < 4; step++) {
		double loss[2];
		for (int a = 0; a < 2; a++)
			loss[a] = train(e[a], ctx[a], b[a].ids[step],
					b[a].labels[step], NULL);
		ck_assert_msg(loss[0] == loss[1],
			      "step %d: loss %.9g (cached views) vs %.9g", step,
			      loss[0], loss[1]);
		snap sa, sb;
		snap_take(ctx[0], m[0], &sa);
		snap_take(ctx[1], m[1], &sb);
		snap_assert_equal(m[0], &sa, &sb, "cached vs per-call");
		snap_free(&sa);
		snap_free(&sb);
	}
	/* the steps changed the weights (so a stale view would show) */
	snap s1;
	snap_take(ctx[0], m[0], &s1);
	int64_t changed = 0, total = 0;
	for (int i = 0; i < s1.n; i++)
		for (int64_t k = 0; k < s1.numel[i]; k++, total++)
			changed += s1.v[i][k] != s0[0].v[i][k];
	ck_assert_msg(changed > total / 2, "only %lld of %lld weights moved",
		      (long long)changed, (long long)total);
	snap_free(&s1);
	int64_t fills = epj_counter_get(ctx[0], "kernels.bf16_weight_fills"),
		hits = epj_counter_get(ctx[0], "kernels.bf16_weight_hits");
	ck_assert_msg(fills > 0 && hits >= fills / 2,
		      "cached arm: %lld fills, %lld hits", (long long)fills,
		      (long long)hits);
	ck_assert_int_eq(epj_counter_get(ctx[1], "kernels.bf16_weight_fills"),
			 0);

	/* direct linears on a parameter around writes to it */
	epj_ctx *c = ctx[0];
	epj_tensor *w = NULL;
	for (int i = 0; i < epj_model_num_params(m[0]) && !w; i++)
		if (strstr(epj_model_param_name(m[0], i), "q_proj.weight"))
			w = epj_model_param(m[0], i);
	ck_assert(w && epj_tensor_dtype(w) == EPJ_DTYPE_BF16);
	int64_t xs[2] = { 5, epj_tensor_dim(w, 1) };
	epj_tensor *x = tu_randn(c, EPJ_DTYPE_BF16, 2, xs);
	ck_assert(linear_max_diff(c, x, w) == 0);
	int64_t f0 = epj_counter_get(c, "kernels.bf16_weight_fills");
	for (int how = 0; how < 3; how++) {
		/* fill the view, then write new values into w */
		epj_tensor *y = epj_linear(c, x, w, NULL);
		tu_ok(c, y);
		epj_tensor_free(y);
		if (how == 0) {
			epj_tensor *n =
			    tu_randn(c, EPJ_DTYPE_BF16, epj_tensor_ndim(w),
				     epj_tensor_shape(w));
			ck_assert_int_eq(epj_tensor_copy_(c, w, n), EPJ_OK);
			epj_tensor_free(n);
		} else if (how == 1) {
			uint16_t *d = epj_tensor_data(w);
			for (int64_t k = 0; k < epj_tensor_numel(w); k += 3)
				d[k] =
				    epj_f32_to_bf16((float)tu_uniform(-1, 1));
		} else {
			epj_tensor_set_f64(w, 1, 3.5);
		}
		ck_assert_msg(linear_max_diff(c, x, w) == 0,
			      "write %d to the parameter not seen", how);
	}
	ck_assert_int_ge(epj_counter_get(c, "kernels.bf16_weight_fills"),
			 f0 + 3);
	epj_tensor_free(x);
	for (int a = 0; a < 2; a++) {
		snap_free(&s0[a]);
		batches_free(&b[a]);
		epj_engine_free(e[a]);
		epj_model_free(m[a]);
		epj_ctx_free(ctx[a]);
	}
}
END_TEST

/* ---- checkpoint metadata and dtypes ----------------------------------------
 */

/* Copies the checkpoint src to dst with metadata key set to val (NULL:
 * dropped), the tensor `as_i32` (when non-NULL) stored as I32, and an extra
 * F32 tensor `extra` (when non-NULL). */
static void rewrite_ckpt(epj_ctx *ctx, const char *src, const char *dst,
			 const char *key, const char *val, const char *as_i32,
			 const char *extra)
{
	epj_st_file *f = NULL;
	ck_assert_int_eq(epj_st_open(ctx, src, &f), EPJ_OK);
	epj_st_writer *w = NULL;
	ck_assert_int_eq(epj_st_writer_new(ctx, &w), EPJ_OK);
	for (int i = 0; i < epj_st_count(f); i++) {
		const char *nm = epj_st_name_at(f, i);
		epj_tensor *t = epj_st_get(ctx, f, nm);
		tu_ok(ctx, t);
		if (as_i32 && !strcmp(nm, as_i32)) {
			epj_tensor *c = epj_cast(ctx, t, EPJ_DTYPE_I32);
			tu_ok(ctx, c);
			epj_tensor_free(t);
			t = c;
		}
		ck_assert_int_eq(epj_st_writer_add(w, nm, t), EPJ_OK);
		epj_tensor_free(t);
	}
	if (extra) {
		int64_t n = 2;
		epj_tensor *t = epj_full(ctx, EPJ_DTYPE_F32, 1, &n, 0.25);
		ck_assert_int_eq(epj_st_writer_add(w, extra, t), EPJ_OK);
		epj_tensor_free(t);
	}
	for (int i = 0; i < epj_st_metadata_count(f); i++) {
		const char *k = epj_st_metadata_key_at(f, i);
		if (key && !strcmp(k, key))
			continue;
		ck_assert_int_eq(
		    epj_st_writer_set_metadata(w, k, epj_st_metadata(f, k)),
		    EPJ_OK);
	}
	if (key && val)
		ck_assert_int_eq(epj_st_writer_set_metadata(w, key, val),
				 EPJ_OK);
	ck_assert_int_eq(epj_st_writer_save(w, dst), EPJ_OK);
	epj_st_writer_free(w);
	epj_st_close(f);
}

START_TEST(test_load_metadata)
{
	static const struct {
		const char *key, *val; /* val NULL: the field dropped */
		const char *needle;
	} cases[] = {
		{ "optimizer_steps", "-1", "\"optimizer_steps\" is \"-1\"" },
		{ "optimizer_steps", "9223372036854775807", "[0, 2147483647]" },
		{ "optimizer_steps", "99999999999999999999",
		  "optimizer_steps" },
		{ "step", "4611686018427387904", "\"step\" is" },
		{ "step", "-5", "\"step\" is \"-5\"" },
		{ "step", "abc", "\"step\" is \"abc\"" },
		{ "step", "", "\"step\" is \"\"" },
		{ "step", "3x", "\"step\" is \"3x\"" },
		{ "step", " 3", "\"step\" is \" 3\"" },
		{ "micro_step", "1e3", "\"micro_step\"" },
		{ "step", NULL, "without metadata \"step\"" },
		{ "optimizer_steps", "3", "at most \"step\"" },
	};
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("engine");
	char good[200], bad[200];
	snprintf(good, sizeof good, "%s/good.safetensors", dir);
	snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	batches b;
	batches_make(ctx, &b, 3, 2, 5, seed);
	epj_model *m = new_model(ctx, seed);
	epj_engine *e = new_engine(
	    ctx, m, "{\"train_micro_batch_size_per_gpu\": 2, " ADAMW "}");
	train(e, ctx, b.ids[0], b.labels[0], NULL);
	train(e, ctx, b.ids[1], b.labels[1], NULL);
	ck_assert_int_eq(epj_engine_save(e, good), EPJ_OK);
	train(e, ctx, b.ids[2], b.labels[2], NULL);
	snap before;
	snap_take(ctx, m, &before);
	for (size_t i = 0; i < EJ_ARRAY_LEN(cases); i++) {
		rewrite_ckpt(ctx, good, bad, cases[i].key, cases[i].val, NULL,
			     NULL);
		expect_load_fails(ctx, e, bad, EPJ_ERR_FORMAT, cases[i].needle,
				  &before, cases[i].needle);
		/* the message names the file too */
		rewrite_ckpt(ctx, good, bad, cases[i].key, cases[i].val, NULL,
			     NULL);
		ck_assert_int_ne(epj_engine_load(e, bad), EPJ_OK);
		ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), bad));
		epj_ctx_clear_error(ctx);
	}
	/* An integer tensor for a float parameter, and for an optimizer
	 * state. */
	const char *par = "model.layers.1.self_attn.o_proj.weight";
	rewrite_ckpt(ctx, good, bad, NULL, NULL, par, NULL);
	expect_load_fails(ctx, e, bad, EPJ_ERR_DTYPE, par, &before,
			  "I32 parameter");
	char st_name[128];
	snprintf(st_name, sizeof st_name, "optimizer.exp_avg.%s", par);
	rewrite_ckpt(ctx, good, bad, NULL, NULL, st_name, NULL);
	expect_load_fails(ctx, e, bad, EPJ_ERR_DTYPE, st_name, &before,
			  "I32 optimizer state");
	/* Optimizer tensors this optimizer does not have. */
	const char *unknown[] = { "optimizer.bogus.model.norm.weight",
				  "optimizer.master.model.norm.weight",
				  "optimizer.exp_avg.model.nope" };
	for (size_t i = 0; i < EJ_ARRAY_LEN(unknown); i++) {
		rewrite_ckpt(ctx, good, bad, NULL, NULL, NULL, unknown[i]);
		expect_load_fails(ctx, e, bad, EPJ_ERR_FORMAT, unknown[i],
				  &before, unknown[i]);
	}
	/* The good one still loads, with its counts. */
	ck_assert_msg(epj_engine_load(e, good) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_engine_step_count(e), 2);
	snap_free(&before);
	epj_engine_free(e);
	epj_model_free(m);
	batches_free(&b);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- non-finite steps -------------------------------------------------------
 */

/* Raw parameter bytes, so that NaN and inf compare as themselves. */
static unsigned char *param_bytes(const epj_model *m, size_t *n)
{
	size_t total = 0;
	for (int i = 0; i < epj_model_num_params(m); i++)
		total += (size_t)epj_tensor_numel(epj_model_param(m, i)) * 4;
	unsigned char *b = malloc(total), *p = b;
	ck_assert_ptr_nonnull(b);
	for (int i = 0; i < epj_model_num_params(m); i++) {
		epj_tensor *t = epj_model_param(m, i);
		size_t k = (size_t)epj_tensor_numel(t) * 4;
		memcpy(p, epj_tensor_data(t), k);
		p += k;
	}
	*n = total;
	return b;
}

/* lr 1e308 (the reported reproduction): the first update makes weights
 * infinite, the next loss is not finite.  That step fails naming it and
 * the weights are not touched; with "skip_nonfinite_steps" it is skipped
 * (counted, flagged) and training goes on. */
static void nonfinite_run(bool skip)
{
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	batches b;
	batches_make(ctx, &b, 3, 2, 5, seed);
	epj_model *m = new_model(ctx, seed);
	char json[256];
	snprintf(json, sizeof json,
		 "{\"train_micro_batch_size_per_gpu\": 2, \"optimizer\": "
		 "{\"type\": \"SGD\", \"params\": {\"lr\": 1e308}}%s}",
		 skip ? ", \"skip_nonfinite_steps\": true" : "");
	epj_engine *e = new_engine(ctx, m, json);
	epj_step_info info;
	ck_assert_int_eq(epj_engine_train_step(e, b.ids[0], b.labels[0], &info),
			 EPJ_OK);
	ck_assert(isfinite(info.loss) && !info.skipped);
	size_t n0, n1;
	unsigned char *w0 = param_bytes(m, &n0);
	epj_status st = epj_engine_train_step(e, b.ids[1], b.labels[1], &info);
	unsigned char *w1 = param_bytes(m, &n1);
	ck_assert(n0 == n1 && memcmp(w0, w1, n0) == 0); /* not touched */
	if (!skip) {
		ck_assert_int_eq(st, EPJ_ERR_STATE);
		const char *msg = epj_ctx_error(ctx);
		ck_assert_msg(strstr(msg, "train step 2") &&
				  (strstr(msg, "the mean loss is") ||
				   strstr(msg, "the gradient norm is")) &&
				  strstr(msg, "skip_nonfinite_steps"),
			      "%s", msg);
		ck_assert_int_eq(epj_engine_step_count(e), 1);
	} else {
		ck_assert_msg(st == EPJ_OK, "%s", epj_ctx_error(ctx));
		ck_assert(info.stepped && info.skipped);
		ck_assert_int_eq(info.step, 2);
		ck_assert_int_eq(epj_counter_get(ctx, "train.skipped_steps"),
				 1);
		ck_assert_int_eq(
		    epj_engine_train_step(e, b.ids[2], b.labels[2], &info),
		    EPJ_OK);
		ck_assert(info.skipped);
		ck_assert_int_eq(epj_counter_get(ctx, "train.skipped_steps"),
				 2);
	}
	free(w0);
	free(w1);
	epj_engine_free(e);
	epj_model_free(m);
	batches_free(&b);
	epj_ctx_free(ctx);
}

START_TEST(test_nonfinite_fails)
{
	nonfinite_run(false);
}
END_TEST

START_TEST(test_nonfinite_skipped)
{
	epj_log_level lvl = epj_log_level_get();
	epj_log_level_set(EPJ_LOG_ERROR);
	nonfinite_run(true);
	epj_log_level_set(lvl);
}
END_TEST

/* The update of a diverging step (SGD lr 1e308) leaves infinite weights
 * although its loss and gradient norm were finite: a save then is refused
 * naming the entry, and the good checkpoint saved before stays as it was,
 * byte for byte. */
START_TEST(test_save_refuses_nonfinite)
{
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	batches b;
	batches_make(ctx, &b, 1, 2, 5, seed);
	epj_model *m = new_model(ctx, seed);
	epj_engine *e =
	    new_engine(ctx, m,
		       "{\"train_micro_batch_size_per_gpu\": 2, \"optimizer\": "
		       "{\"type\": \"SGD\", \"params\": {\"lr\": 1e308}}}");
	char *dir = tu_tmpdir_new("engine");
	char *ck = tu_path(dir, "ck.safetensors");
	ck_assert_msg(epj_engine_save(e, ck) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	size_t n0, n1;
	unsigned char *good = tu_read_file(ck, &n0);
	epj_step_info info;
	ck_assert_int_eq(epj_engine_train_step(e, b.ids[0], b.labels[0], &info),
			 EPJ_OK);
	ck_assert(isfinite(info.loss) && isfinite(info.grad_norm));
	ck_assert_int_eq(epj_engine_save(e, ck), EPJ_ERR_STATE);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "not saved") && strstr(msg, "model.") &&
			  strstr(msg, ck),
		      "%s", msg);
	unsigned char *now = tu_read_file(ck, &n1);
	ck_assert(n0 == n1 && memcmp(good, now, n0) == 0);
	ck_assert_int_eq(tu_dir_count(dir), 1); /* no temporary file left */
	free(good);
	free(now);
	free(ck);
	tu_tmpdir_free(dir);
	epj_engine_free(e);
	epj_model_free(m);
	batches_free(&b);
	epj_ctx_free(ctx);
}
END_TEST

/* Temporary files of saves killed half-way (a dead process of this host)
 * are removed by the next save of the same path; a live writer's and
 * another host's are not. */
START_TEST(test_save_sweeps_stale)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("engine");
	char ck[200], gone[260], live[260], other[260], h[256] = "", hex[33];
	snprintf(ck, sizeof ck, "%s/ck.safetensors", dir);
	ck_assert_int_eq(gethostname(h, sizeof h - 1), 0);
	epj_hash_hex(epj_hash(h, strlen(h)), hex);
	hex[8] = '\0';
	pid_t dead = fork();
	ck_assert_int_ge(dead, 0);
	if (dead == 0)
		_exit(0);
	ck_assert_int_eq(waitpid(dead, NULL, 0), dead);
	snprintf(gone, sizeof gone, "%s.tmp.%d.%s", ck, (int)dead, hex);
	snprintf(live, sizeof live, "%s.tmp.%d.%s", ck, (int)getppid(), hex);
	snprintf(other, sizeof other, "%s.tmp.%d.0badc0de", ck, (int)dead);
	tu_write_text(gone, "half a checkpoint");
	tu_write_text(live, "a save at work");
	tu_write_text(other, "another host's");
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *m = new_model(ctx, seed);
	epj_engine *e = new_engine(
	    ctx, m, "{\"train_micro_batch_size_per_gpu\": 2, " ADAMW "}");
	ck_assert_int_eq(epj_engine_save(e, ck), EPJ_OK);
	ck_assert(!tu_exists(gone));
	ck_assert(tu_exists(live));
	ck_assert(tu_exists(other));
	ck_assert(tu_exists(ck));
	/* the temp files of a killed save of a set's rank file (another
	 * final name than PATH) and of the set's record go when PATH is
	 * loaded, as do those of any name PATH starts */
	char gen[300], rec[300], unrel[300];
	snprintf(gen, sizeof gen, "%s.g7.rank1.tmp.%d.0123456789abcdef.%s", ck,
		 (int)dead, hex);
	snprintf(rec, sizeof rec, "%s.tmp.%d.fedcba9876543210.%s", ck,
		 (int)dead, hex);
	snprintf(unrel, sizeof unrel, "%s/other.tmp.%d.0123456789abcdef.%s",
		 dir, (int)dead, hex);
	tu_write_text(gen, "half a rank file");
	tu_write_text(rec, "half a record");
	tu_write_text(unrel, "not ours to judge");
	ck_assert_int_eq(epj_engine_load(e, ck), EPJ_OK);
	ck_assert(!tu_exists(gen));
	ck_assert(!tu_exists(rec));
	ck_assert(tu_exists(unrel));
	ck_assert(tu_exists(live));
	epj_engine_free(e);
	epj_model_free(m);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* A record as a save writes it, for world w (files "NAME.g<gen>.rank<r>"). */
static char *record_text(int64_t gen, int w, int64_t step, const char *name0)
{
	size_t cap = 4096;
	char *t = malloc(cap);
	ck_assert_ptr_nonnull(t);
	int n = snprintf(t, cap,
			 "{\"format\": \"epjit-checkpoint-set-1\", "
			 "\"generation\": %lld, \"world_size\": %d, "
			 "\"zero_stage\": 1, \"autoep_size\": 2, \"step\": "
			 "%lld, \"micro_step\": %lld, \"optimizer_steps\": "
			 "%lld, \"files\": [",
			 (long long)gen, w, (long long)step,
			 (long long)step * 2, (long long)step);
	for (int r = 0; r < w; r++)
		n += snprintf(
		    t + n, cap - (size_t)n,
		    "%s{\"rank\": %d, \"name\": \"%s%s.g%lld.rank%d\", "
		    "\"bytes\": %d, \"xxh3_128\": "
		    "\"0123456789abcdef0123456789abcdef\"}",
		    r ? ", " : "", r, r ? "ck" : name0, r ? "" : "",
		    (long long)gen, r, 100 + r);
	snprintf(t + n, cap - (size_t)n, "]}");
	return t;
}

static void record_refused(epj_ctx *ctx, const char *text, const char *want)
{
	ej_ckpt_set s;
	ck_assert_int_eq(ej_ckpt_set_parse(ctx, "R", text, strlen(text), &s),
			 EPJ_ERR_FORMAT);
	ck_assert_msg(strstr(epj_ctx_error(ctx), want), "%s: got '%s'", text,
		      epj_ctx_error(ctx));
	ck_assert_ptr_null(s.files);
	epj_ctx_clear_error(ctx);
}

/* The commit record of a checkpoint set: what a save writes reads back;
 * every hostile variant is refused by name, never followed outside the
 * record's directory; a reader never blocks on a FIFO; the checksum is the
 * content's. */
START_TEST(test_ckpt_set_record)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("ckset");
	int w = tu_randint(2, 9);
	int64_t gen = tu_randint(1, 1 << 20), step = tu_randint(0, 1 << 20);
	/* a record round-trips through write, read, parse */
	char *t = record_text(gen, w, step, "ck");
	ej_ckpt_set s, u;
	ck_assert_int_eq(ej_ckpt_set_parse(ctx, "R", t, strlen(t), &s), EPJ_OK);
	ck_assert_int_eq(s.world, w);
	ck_assert_int_eq(s.generation, gen);
	ck_assert_int_eq(s.micro_step, step * 2);
	ck_assert_int_eq(s.files[w - 1].bytes, 100 + w - 1);
	char *rp = tu_path(dir, "ck");
	ck_assert_int_eq(ej_ckpt_set_write(ctx, rp, &s), EPJ_OK);
	char *text = NULL;
	size_t len = 0;
	ck_assert_int_eq(ej_ckpt_set_read(rp, &text, &len), 1);
	ck_assert_int_eq(ej_ckpt_set_parse(ctx, rp, text, len, &u), EPJ_OK);
	ck_assert_int_eq(u.generation, gen);
	ck_assert_int_eq(u.step, step);
	ck_assert_str_eq(u.files[1].name, s.files[1].name);
	ck_assert_str_eq(u.files[0].hash, "0123456789abcdef0123456789abcdef");
	ej_ckpt_set_free(&u);
	ej_ckpt_set_free(&s);
	free(text);
	free(t);
	/* hostile records */
	t = record_text(gen, w, step, "../ck");
	record_refused(ctx, t, "plain file name");
	free(t);
	t = record_text(gen, w, step, "/etc/passwd#");
	record_refused(ctx, t, "plain file name");
	free(t);
	t = record_text(0, w, step, "ck");
	record_refused(ctx, t, "\"generation\" must be a whole number");
	free(t);
	t = record_text(gen, 1, step, "ck");
	record_refused(ctx, t, "\"world_size\"");
	free(t);
	t = record_text(gen, w, (int64_t)INT32_MAX + 1, "ck");
	record_refused(ctx, t, "\"step\"");
	free(t);
	t = record_text(gen, w, step, "ck");
	char *p = strstr(t, "\"world_size\": ");
	p[strlen("\"world_size\": ")] = '9'; /* more ranks than files */
	if (w != 9 && p[strlen("\"world_size\": ") + 1] == ',')
		record_refused(ctx, t, "one file per rank");
	free(t);
	t = record_text(gen, w, step, "ck");
	p = strstr(t, "0123456789abcdef0123456789abcdef");
	p[3] = 'X';
	record_refused(ctx, t, "32 lowercase hex digits");
	free(t);
	record_refused(ctx,
		       "{\"format\": \"epjit-checkpoint-set-1\", "
		       "\"format\": \"x\"}",
		       "invalid JSON");
	record_refused(ctx, "{\"format\": \"epjit-checkpoint-set-2\"}",
		       "format version 2, this build reads 1");
	record_refused(ctx, "{\"format\": \"epjit-checkpoint-set-x\"}",
		       "\"format\" is not");
	record_refused(ctx, "[1, 2]", "\"format\"");
	/* what is no record reads as none; a FIFO never blocks */
	char *fifo = tu_path(dir, "fifo");
	ck_assert_int_eq(mkfifo(fifo, 0600), 0);
	ck_assert_int_eq(ej_ckpt_set_read(fifo, &text, &len), 0);
	char *st = tu_path(dir, "plain.safetensors");
	tu_write_text(st, "\x7b\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}");
	ck_assert_int_eq(ej_ckpt_set_read(st, &text, &len), 0);
	char *absent = tu_path(dir, "absent");
	ck_assert_int_eq(ej_ckpt_set_read(absent, &text, &len), 0);
	free(absent);
	/* the checksum of a file is that of its bytes */
	size_t n = (size_t)tu_randint(1, 3 << 20);
	unsigned char *b = malloc(n);
	ck_assert_ptr_nonnull(b);
	for (size_t i = 0; i < n; i++)
		b[i] = (unsigned char)tu_randint(0, 255);
	char *bf = tu_path(dir, "bytes");
	FILE *fp = fopen(bf, "wb");
	ck_assert_ptr_nonnull(fp);
	ck_assert_uint_eq(fwrite(b, 1, n, fp), n);
	ck_assert_int_eq(fclose(fp), 0);
	int64_t got = 0;
	char hex[33], want[33];
	ck_assert_int_eq(ej_file_hash(ctx, bf, &got, hex), EPJ_OK);
	epj_hash_hex(epj_hash(b, n), want);
	ck_assert_int_eq(got, (int64_t)n);
	ck_assert_str_eq(hex, want);
	ck_assert_int_eq(ej_file_hash(ctx, fifo, &got, hex), EPJ_ERR_IO);
	epj_ctx_clear_error(ctx);
	free(b);
	free(bf);
	free(st);
	free(fifo);
	free(rp);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* A set of w ranks whose file names are all `len` bytes long, the first
 * `esc` of them (over all names, in rank order) control characters that
 * JSON escapes as 6 bytes ("\u0001"): the record's size is then exact to
 * the byte (5 more per escaped character). */
static void set_of_names(ej_ckpt_set *s, int64_t w, int len, int64_t esc)
{
	memset(s, 0, sizeof *s);
	s->generation = 3;
	s->world = w;
	s->zero_stage = 1;
	s->autoep_size = 1;
	s->step = s->micro_step = s->optimizer_steps = 5;
	s->files = calloc((size_t)w, sizeof *s->files);
	ck_assert_ptr_nonnull(s->files);
	for (int64_t r = 0; r < w; r++) {
		ej_ckpt_file *f = &s->files[r];
		f->bytes = 1000 + r;
		memcpy(f->hash, "0123456789abcdef0123456789abcdef", 33);
		memset(f->name, 'n', (size_t)len);
		f->name[len] = '\0';
		for (int i = 0; i < len && esc > 0; i++, esc--)
			f->name[i] = '\x01';
	}
}

static int64_t file_size(const char *p)
{
	struct stat sb;
	ck_assert_int_eq(stat(p, &sb), 0);
	return (int64_t)sb.st_size;
}

/* A record written reads back whole. */
static void record_reads_back(epj_ctx *ctx, const char *rp, int64_t w)
{
	char *text = NULL;
	size_t len = 0;
	ej_ckpt_set u;
	ck_assert_int_eq(ej_ckpt_set_read(rp, &text, &len), 1);
	ck_assert_int_eq(ej_ckpt_set_parse(ctx, rp, text, len, &u), EPJ_OK);
	ck_assert_int_eq(u.world, w);
	ck_assert_int_eq(u.files[w - 1].bytes, 1000 + w - 1);
	ej_ckpt_set_free(&u);
	free(text);
}

/* The writer never commits a record that the reader refuses: one size
 * limit at both ends, which every set of plain file names fits (the
 * largest world with names as long as a file system allows); a record
 * one escape over the limit is refused before the commit and the path
 * keeps the previous record, one at the limit is written and read back.
 * The reader takes a file of exactly the limit and refuses one byte
 * more. */
START_TEST(test_ckpt_set_size_limit)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("cklim");
	char *rp = tu_path(dir, "run.ckpt");
	const int64_t max = (int64_t)EJ_CKPT_SET_MAX_BYTES;
	ej_ckpt_set s;
	/* 7400 ranks of the usual names: about 1 MiB */
	set_of_names(&s, 7400, 20, 0);
	ck_assert_int_eq(ej_ckpt_set_write(ctx, rp, &s), EPJ_OK);
	ck_assert_int_gt(file_size(rp), 1 << 20);
	record_reads_back(ctx, rp, 7400);
	ej_ckpt_set_free(&s);
	/* the largest world, the longest plain names */
	set_of_names(&s, EJ_CKPT_SET_MAX_WORLD, EJ_CKPT_NAME_MAX - 1, 0);
	ck_assert_int_eq(ej_ckpt_set_write(ctx, rp, &s), EPJ_OK);
	record_reads_back(ctx, rp, EJ_CKPT_SET_MAX_WORLD);
	ej_ckpt_set_free(&s);
	/* escaped names up to the limit, exactly */
	const int64_t w = 24000;
	const int len = EJ_CKPT_NAME_MAX - 1;
	set_of_names(&s, w, len, 0);
	ck_assert_int_eq(ej_ckpt_set_write(ctx, rp, &s), EPJ_OK);
	int64_t plain = file_size(rp), esc = (max - plain) / 5;
	ck_assert_int_le(esc, w * len);
	ej_ckpt_set_free(&s);
	set_of_names(&s, w, len, esc);
	ck_assert_int_eq(ej_ckpt_set_write(ctx, rp, &s), EPJ_OK);
	int64_t at = file_size(rp);
	ck_assert_int_le(at, max);
	ck_assert_int_gt(at, max - 5);
	record_reads_back(ctx, rp, w);
	ej_ckpt_set_free(&s);
	/* one escape more: over the limit, refused, the old record stays */
	set_of_names(&s, w, len, esc + 1);
	ck_assert_int_eq(ej_ckpt_set_write(ctx, rp, &s), EPJ_ERR_INVALID);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "over the") &&
			  strstr(epj_ctx_error(ctx), "nothing committed"),
		      "%s", epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(file_size(rp), at);
	record_reads_back(ctx, rp, w);
	ej_ckpt_set_free(&s);
	/* the reader: a file of exactly the limit, and one byte more */
	char *big = tu_path(dir, "big");
	for (int extra = 0; extra < 2; extra++) {
		FILE *fp = fopen(big, "wb");
		ck_assert_ptr_nonnull(fp);
		static const char head[] =
		    "{\"format\": \"epjit-checkpoint-set-1\", \"x\": \"";
		fputs(head, fp);
		for (int64_t i = (int64_t)strlen(head) + 3; i < max + extra;
		     i++)
			fputc('a', fp);
		fputs("\"}\n", fp);
		ck_assert_int_eq(fclose(fp), 0);
		ck_assert_int_eq(file_size(big), max + extra);
		char *text = NULL;
		size_t len2 = 0;
		int rc = ej_ckpt_set_read(big, &text, &len2);
		ck_assert_int_eq(rc, extra ? -2 : 1);
		ck_assert_int_eq((int64_t)len2, extra ? 0 : max);
		free(text);
		if (extra) {
			ej_ckpt_set_read_error(ctx, big, rc);
			char want[64];
			snprintf(want, sizeof want, "over the %lld bytes",
				 (long long)max);
			ck_assert_msg(strstr(epj_ctx_error(ctx), want), "%s",
				      epj_ctx_error(ctx));
			epj_ctx_clear_error(ctx);
		}
	}
	free(big);
	free(rp);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* The generation: the reader takes [1, 2^63 - 1] and refuses the rest by
 * name; the writer refuses to commit one the reader would refuse; a record
 * of another format version says which. */
START_TEST(test_ckpt_set_generation_version)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("ckgen");
	char *t = record_text(INT64_MAX, 2, 4, "ck");
	ej_ckpt_set s;
	ck_assert_int_eq(ej_ckpt_set_parse(ctx, "R", t, strlen(t), &s), EPJ_OK);
	ck_assert_int_eq(s.generation, INT64_MAX);
	ej_ckpt_set_free(&s);
	free(t);
	t = record_text(-1, 2, 4, "ck");
	record_refused(ctx, t, "\"generation\" must be a whole number");
	free(t);
	t = record_text(INT64_MIN, 2, 4, "ck");
	record_refused(ctx, t, "\"generation\" must be a whole number");
	free(t);
	t = record_text(7, 2, 4, "ck");
	char *g = strstr(t, "7,");
	ck_assert_ptr_nonnull(g);
	char *t2 = malloc(strlen(t) + 32);
	ck_assert_ptr_nonnull(t2);
	snprintf(t2, strlen(t) + 32, "%.*s9223372036854775808%s", (int)(g - t),
		 t, g + 1);
	record_refused(ctx, t2, "invalid JSON");
	free(t2);
	/* the writer: a generation past the reader's range is not written */
	ck_assert_int_eq(ej_ckpt_set_parse(ctx, "R", t, strlen(t), &s), EPJ_OK);
	free(t);
	char *rp = tu_path(dir, "run");
	int64_t bad[] = { 0, -1, INT64_MIN };
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		s.generation = bad[i];
		ck_assert_int_ne(ej_ckpt_set_write(ctx, rp, &s), EPJ_OK);
		ck_assert_msg(strstr(epj_ctx_error(ctx), "\"generation\""),
			      "%s", epj_ctx_error(ctx));
		epj_ctx_clear_error(ctx);
		ck_assert_int_ne(access(rp, F_OK), 0);
	}
	ej_ckpt_set_free(&s);
	/* another format version: read as a record, refused by version */
	tu_write_text(rp, "{\n  \"format\": \"epjit-checkpoint-set-2\",\n"
			  "  \"generation\": 1\n}\n");
	char *text = NULL;
	size_t len = 0;
	ck_assert_int_eq(ej_ckpt_set_read(rp, &text, &len), 1);
	ck_assert_int_eq(ej_ckpt_set_parse(ctx, rp, text, len, &s),
			 EPJ_ERR_FORMAT);
	ck_assert_msg(strstr(epj_ctx_error(ctx),
			     "commit record format version 2, this build "
			     "reads 1"),
		      "%s", epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	free(text);
	free(rp);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* After a commit only the files of the previous record go, each only
 * under the name a save of this set gives it: saving set "run.g1" never
 * removes "run.g1.rank0" (set "run"'s file of generation 1), a hostile
 * record's other names stay, a link is never followed, and each rank
 * removes its share. */
START_TEST(test_ckpt_set_prune_own)
{
	char *dir = tu_tmpdir_new("ckprune");
	const char *names[] = { "run.g1.rank0",	   "run.g1.rank1",
				"run.g1.g1.rank0", "run.g1.g1.rank1",
				"run.g1.g1.rank2", "keep.txt" };
	char *p[6];
	for (int i = 0; i < 6; i++) {
		p[i] = tu_path(dir, names[i]);
		tu_write_text(p[i], "x");
	}
	char *set = tu_path(dir, "run.g1");
	ej_ckpt_set prev = { .generation = 1, .world = 3 };
	prev.files = calloc(3, sizeof *prev.files);
	ck_assert_ptr_nonnull(prev.files);
	for (int k = 0; k < 3; k++)
		snprintf(prev.files[k].name, sizeof prev.files[k].name,
			 "run.g1.g1.rank%d", k);
	/* rank 1 of 2 removes its share: prev's rank 1 */
	ej_ckpt_set_prune(set, &prev, 1, 2);
	ck_assert_int_eq(access(p[3], F_OK), -1);
	ck_assert_int_eq(access(p[2], F_OK), 0);
	ck_assert_int_eq(access(p[4], F_OK), 0);
	/* rank 0 of 2: ranks 0 and 2 */
	ej_ckpt_set_prune(set, &prev, 0, 2);
	ck_assert_int_eq(access(p[2], F_OK), -1);
	ck_assert_int_eq(access(p[4], F_OK), -1);
	/* set "run"'s files stay */
	ck_assert_int_eq(access(p[0], F_OK), 0);
	ck_assert_int_eq(access(p[1], F_OK), 0);
	/* a record naming other files, or a link, removes nothing */
	snprintf(prev.files[0].name, sizeof prev.files[0].name, "keep.txt");
	snprintf(prev.files[1].name, sizeof prev.files[1].name, "run.g1.rank1");
	ck_assert_int_eq(symlink("keep.txt", p[4]), 0);
	ej_ckpt_set_prune(set, &prev, 0, 1);
	ck_assert_int_eq(access(p[5], F_OK), 0);
	ck_assert_int_eq(access(p[1], F_OK), 0);
	struct stat sb;
	ck_assert_int_eq(lstat(p[4], &sb), 0);
	ck_assert(S_ISLNK(sb.st_mode));
	ej_ckpt_set_free(&prev);
	for (int i = 0; i < 6; i++)
		free(p[i]);
	free(set);
	tu_tmpdir_free(dir);
}
END_TEST

Suite *make_engine_suite(void)
{
	Suite *s = suite_create("engine");
	TCase *tt = tcase_create("train");
	tcase_set_timeout(tt, 60);
	tcase_add_test(tt, test_train_converges);
	tcase_add_test(tt, test_score_bias_balance);
	tcase_add_test(tt, test_grad_accum);
	tcase_add_test(tt, test_nonfinite_fails);
	tcase_add_test(tt, test_nonfinite_skipped);
	tcase_add_test(tt, test_save_refuses_nonfinite);
	suite_add_tcase(s, tt);
	TCase *tl = tcase_create("expert_load");
	tcase_set_timeout(tl, 60);
	tcase_add_test(tl, test_expert_load_summary);
	tcase_add_test(tl, test_expert_load_engine);
	suite_add_tcase(s, tl);
	TCase *tr = tcase_create("checkpoint");
	tcase_set_timeout(tr, 60);
	tcase_add_test(tr, test_resume_sgd_f32);
	tcase_add_test(tr, test_resume_adamw_f32);
	tcase_add_test(tr, test_resume_sgd_bf16);
	tcase_add_test(tr, test_resume_adamw_bf16);
	tcase_add_test(tr, test_load_failures);
	tcase_add_test(tr, test_load_metadata);
	tcase_add_test(tr, test_save_sweeps_stale);
	tcase_add_test(tr, test_ckpt_set_record);
	tcase_add_test(tr, test_ckpt_set_size_limit);
	tcase_add_test(tr, test_ckpt_set_generation_version);
	tcase_add_test(tr, test_ckpt_set_prune_own);
	suite_add_tcase(s, tr);
	TCase *tc = tcase_create("config");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_config_errors);
	tcase_add_test(tc, test_device_names);
	tcase_add_test(tc, test_device_registry);
	tcase_add_test(tc, test_initialize_defaults);
	tcase_add_test(tc, test_bf16_masters);
	tcase_add_test(tc, test_bf16_weight_cache);
	suite_add_tcase(s, tc);
	return s;
}
