/* fuzz_checkpoint.c -- the checkpoint loader (epj_engine_load): one tiny
 * model and AdamW engine per process; every input is loaded into it.  A
 * refused file must leave the engine usable (a train step after a failed
 * load still works). */
#include "fuzz.h"

#include <stdio.h>
#include <stdlib.h>

static const char model_json[] =
    "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 8, \"hidden_size\": 8, "
    "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
    "\"num_key_value_heads\": 1, \"head_dim\": 4, \"intermediate_size\": 8, "
    "\"moe_intermediate_size\": 4, \"num_experts\": 2, "
    "\"num_experts_per_tok\": 1, \"max_position_embeddings\": 16}";

static epj_model *model;
static epj_engine *engine;

static void cleanup(void)
{
	epj_engine_free(engine);
	epj_model_free(model);
}

static void setup(epj_ctx *ctx)
{
	char path[4200];
	snprintf(path, sizeof path, "%s/model.json", fuzz_dir());
	FILE *f = fopen(path, "w");
	if (!f || fputs(model_json, f) < 0 || fclose(f) != 0)
		abort();
	epj_model_opts o = { .layout = EPJ_LAYOUT_NESTED,
			     .seed = 1,
			     .dtype = EPJ_DTYPE_F32 };
	if (epj_model_new(ctx, path, &o, &model) != EPJ_OK ||
	    epj_engine_initialize_json(
		ctx, model,
		"{\"train_micro_batch_size_per_gpu\": 1, \"optimizer\": "
		"{\"type\": \"AdamW\", \"params\": {\"lr\": 0.001}}}",
		"fuzz.json", &engine) != EPJ_OK) {
		fprintf(stderr, "fuzz_checkpoint: %s\n", epj_ctx_error(ctx));
		abort();
	}
	remove(path);
	atexit(cleanup);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	epj_ctx *ctx = fuzz_ctx();
	if (!engine)
		setup(ctx);
	const char *path = fuzz_file(data, size);
	if (path)
		(void)epj_engine_load(engine, path);
	return 0;
}
