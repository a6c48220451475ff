/* bench/bench_eager.c -- the eager baseline: training-step time of the
 * engine without any compilation, on the bench config.
 *
 * Builds the model of bench/configs/bench-model.json (hidden 256, 8 layers,
 * 8 experts top-2; see bench/RESULTS.md) and the engine of
 * bench/configs/bench-ds.json (micro-batch 4, bf16, AdamW, fixed routing so
 * that every step moves the same tokens to the same experts), feeds it
 * micro-batches [4, 256] of the synthetic corpus, runs --warmup optimizer
 * steps untimed and then times --steps optimizer steps one by one with a
 * monotonic clock.  It reports the median, min and max step time, tokens/s at
 * the median, the allocator's peak allocated/reserved bytes over the timed
 * window (peaks reset after warm-up), and the counters per timed step
 * (eager kernel launches, AutoEP calls).  The compiled numbers of
 * compile.autoep_non_moe are compared against this table.
 *
 * Only the public API of epjit.h is used.  Timed claims live here, never in
 * tests: this program checks nothing but that the run works (exit 1 with the
 * library's message otherwise; 2 for a bad command line).
 *
 * Usage: bench-eager [--model FILE] [--config FILE] [--seq T] [--warmup N]
 *                    [--steps N] [--checkpointing]
 * Threads: OMP_NUM_THREADS and OPENBLAS_NUM_THREADS in the environment (both
 * are read when the libraries load).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* clock_gettime */
#endif
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "epjit.h"

#define PROG "bench-eager"

typedef struct bopts {
	const char *model, *config;
	long seq, warmup, steps;
	bool checkpointing;
} bopts;

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* Milliseconds of a clock: CLOCK_MONOTONIC (wall) or
 * CLOCK_PROCESS_CPUTIME_ID (CPU time of all threads of the process). */
static double clock_ms(clockid_t id)
{
	struct timespec ts;
	clock_gettime(id, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Median of v[n] (sorts v). */
static double median(double *v, long n)
{
	qsort(v, (size_t)n, sizeof *v, cmp_double);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double mib(uint64_t b)
{
	return (double)b / (1024.0 * 1024.0);
}

static void usage(FILE *fp)
{
	fprintf(fp,
		"usage: " PROG " [--model FILE] [--config FILE] [--seq T] "
		"[--warmup N]\n"
		"                   [--steps N] [--checkpointing]\n"
		"defaults: bench/configs/bench-model.json, "
		"bench/configs/bench-ds.json,\n"
		"          seq 256, warmup 3, steps 10 (paths relative to the "
		"current dir)\n");
}

static int parse(int argc, char **argv, bopts *o)
{
	*o = (bopts){ .model = "bench/configs/bench-model.json",
		      .config = "bench/configs/bench-ds.json",
		      .seq = 256,
		      .warmup = 3,
		      .steps = 10 };
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--help")) {
			usage(stdout);
			return 0;
		}
		if (!strcmp(a, "--checkpointing")) {
			o->checkpointing = true;
			continue;
		}
		if (i + 1 >= argc) {
			usage(stderr);
			return 2;
		}
		const char *v = argv[++i];
		if (!strcmp(a, "--model")) {
			o->model = v;
			continue;
		}
		if (!strcmp(a, "--config")) {
			o->config = v;
			continue;
		}
		char *end;
		errno = 0;
		long n = strtol(v, &end, 10);
		bool ok = !errno && end != v && !*end && n >= 0;
		long *dst = !strcmp(a, "--seq")	     ? &o->seq
			    : !strcmp(a, "--warmup") ? &o->warmup
			    : !strcmp(a, "--steps")  ? &o->steps
						     : NULL;
		if (!dst || !ok || (n == 0 && dst != &o->warmup)) {
			fprintf(stderr, PROG ": bad option %s %s\n", a, v);
			usage(stderr);
			return 2;
		}
		*dst = n;
	}
	return -1;
}

static int fail(const epj_ctx *ctx)
{
	fprintf(stderr, PROG ": %s\n", ctx ? epj_ctx_error(ctx) : "no context");
	return 1;
}

/* One optimizer step = gradient_accumulation_steps micro-batches. */
static epj_status opt_step(epj_ctx *ctx, epj_engine *e, epj_corpus *c,
			   int64_t B, int64_t T, double *loss)
{
	epj_step_info info = { 0 };
	do {
		epj_tensor *ids = NULL, *lab = NULL;
		epj_status st = epj_corpus_next_batch(ctx, c, B, T, &ids, &lab);
		if (st == EPJ_OK)
			st = epj_engine_train_step(e, ids, lab, &info);
		epj_tensor_free(ids);
		epj_tensor_free(lab);
		if (st != EPJ_OK)
			return st;
	} while (!info.stepped);
	*loss = info.mean_loss;
	return EPJ_OK;
}

static int bench(epj_ctx *ctx, const bopts *o)
{
	epj_model *m = NULL;
	epj_engine *e = NULL;
	epj_corpus *c = NULL;
	epj_counters *c0 = NULL, *c1 = NULL, *dc = NULL;
	double *ms = calloc((size_t)o->steps, sizeof *ms);
	double *cpu = calloc((size_t)o->steps, sizeof *cpu);
	int rc = 1;
	epj_model_opts mo = { .layout = EPJ_LAYOUT_NESTED,
			      .seed = 1234,
			      .fixed_routing = true,
			      .dtype = EPJ_DTYPE_F32 };
	if (!ms || !cpu) {
		free(ms);
		free(cpu);
		fprintf(stderr, PROG ": out of memory\n");
		return 1;
	}
	if (epj_model_new(ctx, o->model, &mo, &m) != EPJ_OK)
		goto err;
	if (o->checkpointing)
		epj_model_set_checkpointing(m, true);
	if (epj_engine_initialize(ctx, m, o->config, &e) != EPJ_OK)
		goto err;
	c = epj_corpus_synthetic(ctx, (uint32_t)epj_model_vocab_size(m), 1234);
	if (!c)
		goto err;
	int64_t B = epj_engine_micro_batch_size(e), T = o->seq;
	int64_t gas = epj_engine_grad_accum_steps(e);
	double loss = NAN, loss0 = NAN;
	for (long i = 0; i < o->warmup; i++) {
		if (opt_step(ctx, e, c, B, T, &loss) != EPJ_OK)
			goto err;
		if (i == 0)
			loss0 = loss;
	}
	epj_memory_reset_peaks(ctx);
	c0 = epj_counters_snapshot(ctx);
	if (!c0)
		goto err;
	for (long i = 0; i < o->steps; i++) {
		double t0 = clock_ms(CLOCK_MONOTONIC);
		double c0_ms = clock_ms(CLOCK_PROCESS_CPUTIME_ID);
		if (opt_step(ctx, e, c, B, T, &loss) != EPJ_OK)
			goto err;
		ms[i] = clock_ms(CLOCK_MONOTONIC) - t0;
		cpu[i] = clock_ms(CLOCK_PROCESS_CPUTIME_ID) - c0_ms;
		if (isnan(loss0))
			loss0 = loss;
	}
	epj_memory_stats mst;
	epj_memory_stats_get(ctx, &mst);
	c1 = epj_counters_snapshot(ctx);
	dc = c1 ? epj_counters_diff(c0, c1) : NULL;
	if (!dc)
		goto err;

	double sum = 0;
	for (long i = 0; i < o->steps; i++)
		sum += ms[i];
	double med = median(ms, o->steps); /* sorts ms */
	double cpu_med = median(cpu, o->steps);
	double tok = (double)(B * T * gas);
	int threads = 1;
#ifdef _OPENMP
	threads = omp_get_max_threads();
#endif
	printf("eager training step, %s + %s\n", o->model, o->config);
	printf("  %" PRId64 " parameters, micro-batch %" PRId64
	       " x seq %" PRId64 " x grad accum %" PRId64
	       ", %s, %d OpenMP threads%s\n",
	       epj_model_num_elements(m), B, T, gas,
	       epj_engine_bf16(e) ? "bf16" : "f32", threads,
	       o->checkpointing ? ", checkpointing" : "");
	printf("  %ld warm-up + %ld timed steps; loss %.4f -> %.4f\n",
	       o->warmup, o->steps, loss0, loss);
	printf("\n| metric                         | value        |\n");
	printf("|--------------------------------|--------------|\n");
	printf("| step time, median (ms)         | %12.1f |\n", med);
	printf("| step time, min (ms)            | %12.1f |\n", ms[0]);
	printf("| step time, max (ms)            | %12.1f |\n",
	       ms[o->steps - 1]);
	printf("| step time, mean (ms)           | %12.1f |\n",
	       sum / (double)o->steps);
	printf("| CPU time / step, median (ms)   | %12.1f |\n", cpu_med);
	printf("| tokens/s (at the median)       | %12.0f |\n",
	       tok / (med / 1e3));
	printf("| peak allocated (MiB)           | %12.1f |\n",
	       mib(mst.peak_allocated));
	printf("| peak reserved (MiB)            | %12.1f |\n",
	       mib(mst.peak_reserved));
	printf("| eager kernels / step           | %12.0f |\n",
	       (double)epj_counters_value(dc, "kernels.launched.eager") /
		   (double)o->steps);
	printf("| compiled kernels / step        | %12.0f |\n",
	       (double)epj_counters_value(dc, "kernels.launched.compiled") /
		   (double)o->steps);
	printf("| AutoEP forward calls / step    | %12.0f |\n",
	       (double)epj_counters_value(dc, "autoep.calls.forward") /
		   (double)o->steps);
	printf("| AutoEP replay calls / step     | %12.0f |\n",
	       (double)epj_counters_value(dc, "autoep.calls.replay") /
		   (double)o->steps);
	/* EPJIT_PROFILE=1: the attention kernels' share (EPJIT_SDPA picks
	 * them) */
	if (epj_counters_value(dc, "profile.sdpa.calls") > 0) {
		printf("| sdpa kernel / step (ms)        | %12.1f |\n",
		       (double)epj_counters_value(dc, "profile.sdpa.us") / 1e3 /
			   (double)o->steps);
		printf(
		    "| sdpa_backward kernel / step (ms) | %10.1f |\n",
		    (double)epj_counters_value(dc, "profile.sdpa_backward.us") /
			1e3 / (double)o->steps);
	}
	/* EPJIT_PROFILE=1: the ops whose time is BLAS GEMMs (bench/blas_ab.sh
	 * compares BLAS libraries on them) */
	static const char *const gemm_ops[] = {
		"profile.matmul.us",
		"profile.linear.us",
		"profile.gemm_add.us",
		"profile.moe_grouped_mm.us",
		"profile.moe_grouped_mm_wgrad.us",
	};
	double gemm_us = 0;
	for (size_t i = 0; i < sizeof gemm_ops / sizeof *gemm_ops; i++)
		gemm_us += (double)epj_counters_value(dc, gemm_ops[i]);
	if (gemm_us > 0)
		printf("| GEMM ops / step (ms)           | %12.1f |\n",
		       gemm_us / 1e3 / (double)o->steps);
	rc = 0;
	goto out;
err:
	rc = fail(ctx);
out:
	epj_counters_free(dc);
	epj_counters_free(c1);
	epj_counters_free(c0);
	epj_corpus_free(c);
	epj_engine_free(e);
	epj_model_free(m);
	free(cpu);
	free(ms);
	return rc;
}

int main(int argc, char **argv)
{
	bopts o;
	int rc = parse(argc, argv, &o);
	if (rc >= 0)
		return rc;
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK || !ctx) {
		fprintf(stderr, PROG ": cannot create a cpu context\n");
		return 1;
	}
	rc = bench(ctx, &o);
	epj_ctx_free(ctx);
	return rc;
}
