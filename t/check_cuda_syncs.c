/* check_cuda_syncs.c -- host synchronizations of a training step on a
 * "cuda" context, against the stand-in driver (t/fake_cuda.c).
 *
 * The tiny MoE model (two decoder layers, each an AutoEP layer) trains with
 * activation checkpointing on a cuda context and on a cpu context; the
 * losses must agree, and a steady-state step on the cuda context may
 * synchronize the host with the device (counter cuda.syncs: stream, event
 * and context synchronizations, blocking copies and frees) at most
 * SYNCS_PER_MOE_LAYER times per MoE layer plus SYNCS_PER_STEP.  The AutoEP
 * layer reads its routing from the device once per call (runtime/autoep.c:
 * index_pair_to_host); the expert GEMMs take their group counts from the
 * host copy the layer pinned (kernels/tmpl_gemm.c: ej_index_pin) instead of
 * reading them back, which was three GEMMs forward, three in the replay,
 * three dgrad and three wgrad per layer, each a full synchronization and a
 * blocking copy; the rope tables are the model's, built once.
 */
#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define SYNC_MOE_LAYERS 2

/* The bound: the routing read of each AutoEP layer call (two calls per
 * layer and step: the forward and its checkpoint replay), and a constant
 * per step measured on the stand-in (the step's scalars: loss, gradient
 * norm, the optimizer's), the same for every seed. */
#define SYNCS_PER_MOE_LAYER 2
#define SYNCS_PER_STEP	    8

#define SYNC_STEPS 3

typedef struct sync_arm {
	epj_model *m;
	epj_engine *e;
	double losses[SYNC_STEPS];
	int64_t syncs[SYNC_STEPS]; /* cuda.syncs of each step */
} sync_arm;

static void sync_arm_run(sync_arm *a, epj_ctx *ctx, const char *path,
			 uint64_t seed)
{
	epj_model_opts o = { .layout = EPJ_LAYOUT_NESTED,
			     .seed = seed,
			     .dtype = EPJ_DTYPE_F32 };
	ck_assert_msg(epj_model_new(ctx, path, &o, &a->m) == EPJ_OK,
		      "model: %s", epj_ctx_error(ctx));
	/* every AutoEP layer runs twice a step: forward and replay */
	epj_model_set_checkpointing(a->m, true);
	const char *js =
	    "{\"train_micro_batch_size_per_gpu\": 2, \"optimizer\": "
	    "{\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, "
	    "\"weight_decay\": 0.01}}, \"gradient_clipping\": 1.0}";
	ck_assert_msg(epj_engine_initialize_json(ctx, a->m, js, "syncs.json",
						 &a->e) == EPJ_OK,
		      "engine: %s", epj_ctx_error(ctx));
	epj_corpus *c = epj_corpus_synthetic(ctx, 16, seed + 5);
	tu_ok(ctx, c);
	for (int s = 0; s < SYNC_STEPS; s++) {
		epj_tensor *ids = NULL, *labels = NULL;
		tu_next_batch_varied(ctx, c, 2, 8, &ids, &labels);
		int64_t s0 = epj_counter_get(ctx, "cuda.syncs");
		epj_step_info info;
		ck_assert_msg(epj_engine_train_step(a->e, ids, labels, &info) ==
				  EPJ_OK,
			      "train step %d: %s", s, epj_ctx_error(ctx));
		a->syncs[s] = epj_counter_get(ctx, "cuda.syncs") - s0;
		ck_assert(info.stepped);
		a->losses[s] = info.mean_loss;
		epj_tensor_free(ids);
		epj_tensor_free(labels);
	}
	epj_corpus_free(c);
	epj_engine_free(a->e);
	epj_model_free(a->m);
}

/* Three AdamW steps of the tiny model, cpu and cuda: the same losses, and
 * the last (steady-state: every kernel built, every buffer cached) cuda
 * step within the bound. */
START_TEST(test_step_syncs)
{
	if (!tu_fake_cuda_usable())
		return;
	uint64_t seed = tu_seed() % 100000 + 1;
	tu_tmpfile cfg =
	    tu_tmpfile_new("cudasyncs", "config.json", TU_TINY_MOE_JSON);
	sync_arm c = { 0 }, g = { 0 };
	epj_ctx *cc = tu_ctx();
	sync_arm_run(&c, cc, cfg.path, seed);
	epj_ctx_free(cc);
	ck_assert(tu_fake_cuda_begin());
	epj_ctx *gc = NULL;
	ck_assert_msg(epj_ctx_new("cuda", &gc) == EPJ_OK && gc,
		      "epj_ctx_new(\"cuda\") on the fake driver failed");
	epj_ctx_seed(gc, tu_seed());
	sync_arm_run(&g, gc, cfg.path, seed);
	int64_t calls = epj_counter_get(gc, "autoep.calls.forward") +
			epj_counter_get(gc, "autoep.calls.replay");
	epj_ctx_free(gc);
	tu_fake_cuda_end();
	tu_tmpfile_free(&cfg);
	for (int s = 0; s < SYNC_STEPS; s++)
		ck_assert_msg(fabs(g.losses[s] - c.losses[s]) <=
				  2e-4 * (1 + fabs(c.losses[s])),
			      "step %d loss: cuda %.9g vs cpu %.9g", s,
			      g.losses[s], c.losses[s]);
	/* checkpointing: two AutoEP calls per layer and step */
	ck_assert_int_eq(calls, (int64_t)SYNC_STEPS * SYNC_MOE_LAYERS * 2);
	int64_t last = g.syncs[SYNC_STEPS - 1];
	int64_t bound = SYNCS_PER_MOE_LAYER * SYNC_MOE_LAYERS + SYNCS_PER_STEP;
	printf("cuda_syncs: host syncs per step %lld %lld %lld (bound %lld)\n",
	       (long long)g.syncs[0], (long long)g.syncs[1],
	       (long long)g.syncs[2], (long long)bound);
	ck_assert_msg(last > 0 && last <= bound,
		      "host syncs of a steady-state step: %lld (bound %lld: "
		      "%d per MoE layer x %d + %d per step); steps: %lld "
		      "%lld %lld",
		      (long long)last, (long long)bound, SYNCS_PER_MOE_LAYER,
		      SYNC_MOE_LAYERS, SYNCS_PER_STEP, (long long)g.syncs[0],
		      (long long)g.syncs[1], (long long)g.syncs[2]);
}
END_TEST

Suite *make_cuda_syncs_suite(void)
{
	Suite *s = suite_create("cuda_syncs");
	TCase *tc = tcase_create("step");
	tcase_set_timeout(tc, 600);
	tcase_add_test(tc, test_step_syncs);
	suite_add_tcase(s, tc);
	return s;
}
