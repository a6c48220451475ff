/* train_defaults.h -- the built-in run of epjit-train, shared with
 * epjit-warmup so that a cache warmed with the same flags holds exactly what
 * the trainer compiles.  The built-in learning-rate schedule spans
 * DEFAULT_STEPS whatever --steps says (see epjit_train.c's invariants).
 */
#ifndef EPJIT_TRAIN_DEFAULTS_H
#define EPJIT_TRAIN_DEFAULTS_H

#include <stdio.h>

enum {
	DEFAULT_STEPS = 200,
	DEFAULT_SEQ = 32,
	DEFAULT_MICRO_BATCH = 8,
	DEFAULT_PRINT = 20,
	DEFAULT_WARMUP = 20,
};
#define DEFAULT_LR 3e-3

/* The built-in DeepSpeed config: micro-batch 8, AdamW (betas 0.9/0.95, wd
 * 0.01), linear warmup over 20 steps to 3e-3, cosine decay to 10% at step
 * 200, gradient clipping 1.0, a line every 20 steps, regional compilation
 * around the AutoEP layers; bf16 (epjit-train --bf16): bf16.enabled. */
static inline void default_config_prec(char *buf, size_t n, int bf16)
{
	snprintf(buf, n,
		 "{\n"
		 "  \"train_micro_batch_size_per_gpu\": %d,\n"
		 "  \"gradient_accumulation_steps\": 1,\n"
		 "  \"bf16\": {\"enabled\": %s},\n"
		 "  \"steps_per_print\": %d,\n"
		 "  \"optimizer\": {\"type\": \"AdamW\", \"params\": {\n"
		 "    \"lr\": %g, \"betas\": [0.9, 0.95], \"eps\": 1e-8,\n"
		 "    \"weight_decay\": 0.01}},\n"
		 "  \"scheduler\": {\"type\": \"WarmupCosineLR\", "
		 "\"params\": {\n"
		 "    \"warmup_num_steps\": %d, \"warmup_type\": \"linear\",\n"
		 "    \"total_num_steps\": %d, \"cos_min_ratio\": 0.1}},\n"
		 "  \"gradient_clipping\": 1.0,\n"
		 "  \"compile\": {\"autoep_non_moe\": true}\n"
		 "}\n",
		 DEFAULT_MICRO_BATCH, bf16 ? "true" : "false", DEFAULT_PRINT,
		 DEFAULT_LR, DEFAULT_WARMUP, DEFAULT_STEPS);
}

static inline void default_config(char *buf, size_t n)
{
	default_config_prec(buf, n, 0);
}

/* The values a ds.json's "auto" takes under epjit-train and epjit-warmup
 * (epj_engine_initialize_auto): the built-in run's micro-batch,
 * accumulation, optimizer, warm-up and clipping, warmup_max_lr = the lr,
 * and total_num_steps = the run's --steps (steps; epjit-warmup, which
 * trains nothing, passes DEFAULT_STEPS).  bf16.enabled is bf16 (epjit-train
 * --bf16; auto_config: false); fp16 is false.  train_batch_size is left to
 * the library (derived). */
static inline void auto_config_prec(char *buf, size_t n, long steps, int bf16)
{
	snprintf(buf, n,
		 "{\n"
		 "  \"train_micro_batch_size_per_gpu\": %d,\n"
		 "  \"gradient_accumulation_steps\": 1,\n"
		 "  \"bf16\": {\"enabled\": %s},\n"
		 "  \"fp16\": {\"enabled\": false},\n"
		 "  \"optimizer\": {\"params\": {\n"
		 "    \"lr\": %g, \"betas\": [0.9, 0.95], \"eps\": 1e-8,\n"
		 "    \"weight_decay\": 0.01}},\n"
		 "  \"scheduler\": {\"params\": {\n"
		 "    \"warmup_min_lr\": 0, \"warmup_max_lr\": %g,\n"
		 "    \"warmup_num_steps\": %d, \"total_num_steps\": %ld}},\n"
		 "  \"gradient_clipping\": 1.0\n"
		 "}\n",
		 DEFAULT_MICRO_BATCH, bf16 ? "true" : "false", DEFAULT_LR,
		 DEFAULT_LR, DEFAULT_WARMUP, steps);
}

static inline void auto_config(char *buf, size_t n, long steps)
{
	auto_config_prec(buf, n, steps, 0);
}

#endif /* EPJIT_TRAIN_DEFAULTS_H */
