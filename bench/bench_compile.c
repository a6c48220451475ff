/* bench/bench_compile.c -- eager vs regionally compiled, side by side in one
 * run, on the bench config (bench/configs: hidden 256, 8 layers, 8 experts
 * top-2, seq 256, micro-batch 4, bf16, fixed routing).
 *
 * Two arms, each with its own context (its own allocator, so peak memory is
 * per arm) and an identical model and engine; the compiled arm calls
 * epj_engine_compile() with compile.autoep_non_moe and the chosen backend.
 * After --warmup steps per arm (the compiled arm traces and compiles then),
 * the arms alternate A B B A ... for --steps steps each, so slow drifts of a
 * shared machine hit both.  Reported, as ratios compiled/eager:
 *   - median step time (wall), and CPU time per step,
 *   - kernel launches per step (eager + compiled counters),
 *   - peak allocated and peak reserved bytes over the measured window,
 * and the compile costs:
 *   - cold compile time of the 2-layer and the 8-layer model (compile.us of
 *     the first step), their ratio,
 *   - with --cache-dir, the compile time of a second process on a warm disk
 *     cache relative to the cold one.
 * It also checks what the times are times of: every step's mean loss is
 * recorded per arm (the arms start from the same weights and read the same
 * batches), printed, and must be finite and agree between the arms to
 * --loss-tol relative (default 0.02: bf16 rounding over a few steps; a
 * wrong kernel is off by far more); otherwise it says LOSS MISMATCH and
 * exits 1.  Timed claims live here only.
 *
 * Usage: bench-compile [--model FILE] [--model2 FILE] [--config FILE]
 *                      [--backend NAME] [--seq T] [--warmup N] [--steps N]
 *                      [--checkpointing] [--compile-only]
 *                      [--device DEV] [--layers N] [--no-compile-cost]
 *                      [--json FILE] [--loss-tol X]
 *                      [--routing fixed|learned]
 *
 * --device runs both arms on another device (cuda-sim, cuda: the engine's
 * tensors and eager ops live there too); --layers N trains the --model
 * config cut to its first N decoder layers (the GPU benchmark's "as many
 * layers as fit one GPU"); --no-compile-cost skips the cold/warm compile
 * measurements; --json writes the side-by-side figures as one object.
 * --routing learned routes tokens by the router (the configs fix the
 * routing, so that every step has the same shapes): the experts' row
 * counts, and so the sizes the allocator is asked for, change every step.
 * The step rows add the p95 step and p95/median of each arm.
 * With EPJIT_PROFILE set (doc/counters.md) it also prints the profile.*
 * rows of the measured window per step, eager and compiled side by side
 * (graph.* and fused.* rows summed; BENCH_PROFILE_KERNELS=1 lists each
 * fused kernel).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "epjit.h"

#define PROG "bench-compile"

typedef struct bopts {
	const char *model, *model2, *config, *backend, *device, *json;
	long seq, warmup, steps, layers;
	double loss_tol;
	bool checkpointing, compile_only, no_cost;
	bool learned; /* --routing learned */
	bool
	    child; /* --child: only measure compile_cost of --model, print it */
} bopts;

/* The census of a device with a driver (cuda): what reached the driver
 * per steady-state step, summed over each arm's own steps (the arms share
 * the process's driver, so totals would mix them). */
#define N_DRV 7
static const char *const DRV_NAME[N_DRV] = {
	"cuda.launches",  "cuda.graph_launches", "cuda.mem_alloc",
	"cuda.mem_free",  "cuda.syncs",		 "cuda.bytes.h2d",
	"cuda.bytes.d2h",
};

typedef struct arm {
	const char *name;
	epj_ctx *ctx;
	epj_model *model;
	epj_engine *eng;
	epj_corpus *corpus;
	double *wall, *cpu;
	int64_t launches0, launches1;
	int64_t compiled0, compiled1; /* kernels.launched.compiled */
	epj_memory_stats mem;
	epj_counters *prof0, *prof; /* EPJIT_PROFILE: the measured window */
	bool census;		    /* sum the driver counters (below) */
	int64_t drv[N_DRV];	    /* their sums over the measured steps */
	int64_t d2d;
	int64_t d2d_graph, d2d_grad; /* of which: graph replay I/O, grads */
	int64_t lib_calls;	     /* cuBLASLt GEMMs, NCCL calls */
	double *loss;		     /* every step's mean loss, warm-up first */
	long n_loss;
	int64_t *step_allocs, *step_frees; /* driver, per step() call */
	long n_step;
} arm;

static double clock_ms(clockid_t id)
{
	struct timespec ts;
	clock_gettime(id, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double median(double *v, long n)
{
	double *c = malloc(sizeof *c * (size_t)n);
	memcpy(c, v, sizeof *c * (size_t)n);
	qsort(c, (size_t)n, sizeof *c, cmp_double);
	double m = n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
	free(c);
	return m;
}

/* The nearest-rank q-quantile of v[0..n). */
static double quantile(const double *v, long n, double q)
{
	double *c = malloc(sizeof *c * (size_t)n);
	memcpy(c, v, sizeof *c * (size_t)n);
	qsort(c, (size_t)n, sizeof *c, cmp_double);
	long k = (long)ceil(q * (double)n) - 1;
	double r = c[k < 0 ? 0 : k >= n ? n - 1 : k];
	free(c);
	return r;
}

/* A copy of the model config at path with num_hidden_layers = layers, in a
 * temporary file whose name is returned (NULL on error, said). */
static char *cut_model(const char *path, long layers)
{
	json_error_t err;
	json_t *m = json_load_file(path, 0, &err);
	if (!m || !json_is_object(m) ||
	    !json_is_integer(json_object_get(m, "num_hidden_layers"))) {
		fprintf(stderr,
			PROG ": %s: not a model config with "
			     "num_hidden_layers (%s)\n",
			path, m ? "no such key" : err.text);
		json_decref(m);
		return NULL;
	}
	long have =
	    (long)json_integer_value(json_object_get(m, "num_hidden_layers"));
	if (layers > have) {
		fprintf(stderr, PROG ": --layers %ld: %s has only %ld\n",
			layers, path, have);
		json_decref(m);
		return NULL;
	}
	json_object_set_new(m, "num_hidden_layers", json_integer(layers));
	char *out = strdup("/tmp/bench-compile-model-XXXXXX");
	int fd = out ? mkstemp(out) : -1;
	if (fd < 0 || json_dumpfd(m, fd, JSON_INDENT(1)) != 0) {
		fprintf(stderr, PROG ": cannot write a model config\n");
		if (fd >= 0) {
			close(fd);
			unlink(out);
		}
		free(out);
		json_decref(m);
		return NULL;
	}
	close(fd);
	json_decref(m);
	return out;
}

static int die(epj_ctx *ctx, const char *what)
{
	fprintf(stderr, PROG ": %s: %s\n", what,
		ctx ? epj_ctx_error(ctx) : "failed");
	return 1;
}

/* ds config text: the bench config file plus the compile section. */
static char *config_text(const bopts *o, bool compiled)
{
	FILE *f = fopen(o->config, "r");
	if (!f)
		return NULL;
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *base = malloc((size_t)n + 1);
	if (fread(base, 1, (size_t)n, f) != (size_t)n) {
		fclose(f);
		free(base);
		return NULL;
	}
	fclose(f);
	base[n] = 0;
	/* insert the compile section before the final brace */
	char *end = strrchr(base, '}');
	if (!end) {
		free(base);
		return NULL;
	}
	*end = 0;
	size_t cap = (size_t)n + 512;
	char *s = malloc(cap);
	snprintf(s, cap,
		 "%s, \"compile\": {\"autoep_non_moe\": %s, \"backend\": "
		 "\"%s\"}, \"activation_checkpointing\": {\"enabled\": %s}}",
		 base, compiled ? "true" : "false", o->backend,
		 o->checkpointing ? "true" : "false");
	free(base);
	return s;
}

/* --routing learned: the config text cfg (taken) with
 * expert_parallel.fixed_routing false; NULL when it has no such section. */
static char *learned_routing(char *cfg)
{
	json_error_t err;
	json_t *j = json_loads(cfg, 0, &err);
	free(cfg);
	json_t *ep = json_object_get(j, "expert_parallel");
	char *s = json_is_object(ep) && !json_object_set_new(
					    ep, "fixed_routing", json_false())
		      ? json_dumps(j, 0)
		      : NULL;
	json_decref(j);
	return s;
}

static int arm_init(arm *a, const bopts *o, const char *model, bool compiled)
{
	if (epj_ctx_new(o->device, &a->ctx) != EPJ_OK)
		return die(NULL, "context");
	epj_model_opts mo = { .layout = EPJ_LAYOUT_NESTED,
			      .seed = 1234,
			      .fixed_routing = !o->learned,
			      .dtype = EPJ_DTYPE_F32 };
	if (epj_model_new(a->ctx, model, &mo, &a->model) != EPJ_OK)
		return die(a->ctx, "model");
	char *cfg = config_text(o, compiled);
	if (!cfg) {
		fprintf(stderr, PROG ": cannot read %s\n", o->config);
		return 1;
	}
	if (o->learned && !(cfg = learned_routing(cfg))) {
		fprintf(stderr,
			PROG ": --routing learned: %s has no "
			     "expert_parallel section\n",
			o->config);
		return 1;
	}
	epj_status st = epj_engine_initialize_json(a->ctx, a->model, cfg,
						   o->config, &a->eng);
	free(cfg);
	if (st != EPJ_OK)
		return die(a->ctx, "engine");
	if (compiled && epj_engine_compile(a->eng) != EPJ_OK)
		return die(a->ctx, "compile");
	a->corpus = epj_corpus_synthetic(
	    a->ctx, (uint32_t)epj_model_vocab_size(a->model), 99);
	if (!a->corpus)
		return die(a->ctx, "corpus");
	a->wall = calloc((size_t)o->steps + 1, sizeof(double));
	a->cpu = calloc((size_t)o->steps + 1, sizeof(double));
	size_t ns = (size_t)(o->warmup + o->steps) + 2;
	a->loss = calloc(ns, sizeof(double));
	a->step_allocs = calloc(ns, sizeof(int64_t));
	a->step_frees = calloc(ns, sizeof(int64_t));
	if (!a->wall || !a->cpu || !a->loss || !a->step_allocs ||
	    !a->step_frees) {
		fprintf(stderr, PROG ": out of memory\n");
		return 1;
	}
	return 0;
}

static void arm_free(arm *a)
{
	free(a->wall);
	free(a->cpu);
	free(a->loss);
	free(a->step_allocs);
	free(a->step_frees);
	epj_counters_free(a->prof0);
	epj_counters_free(a->prof);
	epj_corpus_free(a->corpus);
	epj_engine_free(a->eng);
	epj_model_free(a->model);
	epj_ctx_free(a->ctx);
}

/* EPJIT_PROFILE (doc/counters.md): the profile.* rows of the measured
 * window, per step, eager and compiled side by side. */
static void profile_window(arm *a)
{
	epj_counters *now = epj_counters_snapshot(a->ctx);
	a->prof = epj_counters_diff(a->prof0, now);
	epj_counters_free(now);
}

typedef struct prow {
	char name[256];
	double ems, cms, ecalls, ccalls;
} prow;

static int prow_cmp(const void *x, const void *y)
{
	const prow *a = x, *b = y;
	double ka = a->ems > a->cms ? a->ems : a->cms;
	double kb = b->ems > b->cms ? b->ems : b->cms;
	return ka < kb ? 1 : ka > kb ? -1 : strcmp(a->name, b->name);
}

/* Rows with >= 0.5 ms per step in either arm; graph.* and fused.* rows
 * summed into "graph.*" / "fused.*" (one row per signature is too many). */
static void print_profile(const arm *e, const arm *c, long steps)
{
	const char *env = getenv("EPJIT_PROFILE");
	if (!env || !*env || !strcmp(env, "0") || !e->prof || !c->prof)
		return;
	int cap = epj_counters_count(e->prof) + epj_counters_count(c->prof) + 2;
	prow *r = calloc((size_t)cap, sizeof *r);
	if (!r)
		return;
	int n = 0;
	for (int k = 0; k < 2; k++) {
		const epj_counters *p = k ? c->prof : e->prof;
		for (int i = 0; i < epj_counters_count(p); i++) {
			const char *nm = epj_counters_name_at(p, i);
			size_t len = strlen(nm);
			if (strncmp(nm, "profile.", 8) || len < 12 ||
			    strcmp(nm + len - 3, ".us"))
				continue;
			char base[256];
			snprintf(base, sizeof base, "%.*s", (int)(len - 11),
				 nm + 8);
			if (!strncmp(base, "graph.", 6))
				strcpy(base, "graph.*");
			else if (!strncmp(base, "fused.", 6) &&
				 !getenv("BENCH_PROFILE_KERNELS"))
				strcpy(base, "fused.*");
			char ckey[300];
			snprintf(ckey, sizeof ckey, "profile.%.*s.calls",
				 (int)(len - 11), nm + 8);
			double us = (double)epj_counters_value_at(p, i);
			double calls = (double)epj_counters_value(p, ckey);
			int j = 0;
			while (j < n && strcmp(r[j].name, base))
				j++;
			if (j == n) {
				snprintf(r[n].name, sizeof r[n].name, "%s",
					 base);
				n++;
			}
			if (k) {
				r[j].cms += us / 1e3;
				r[j].ccalls += calls;
			} else {
				r[j].ems += us / 1e3;
				r[j].ecalls += calls;
			}
		}
	}
	qsort(r, (size_t)n, sizeof *r, prow_cmp);
	printf("profile per step (ms, wall; calls): %-9s %9s %8s %9s %8s\n", "",
	       "eager", "calls", "compiled", "calls");
	for (int j = 0; j < n; j++) {
		double d = (double)steps;
		if (r[j].ems / d < 0.5 && r[j].cms / d < 0.5)
			continue;
		printf("  %-44s %9.1f %8.0f %9.1f %8.0f\n", r[j].name,
		       r[j].ems / d, r[j].ecalls / d, r[j].cms / d,
		       r[j].ccalls / d);
	}
	free(r);
}

static int64_t launches(epj_ctx *ctx)
{
	return epj_counter_get(ctx, "kernels.launched.eager") +
	       epj_counter_get(ctx, "kernels.launched.compiled");
}

/* Calls into the CUDA libraries whose kernels the driver counters do not
 * see (they launch through their own runtime): cuBLASLt GEMMs, grouped
 * GEMMs and NCCL collectives. */
static int64_t lib_calls(epj_ctx *ctx)
{
	return epj_counter_get(ctx, "cublaslt.gemms") +
	       epj_counter_get(ctx, "gemm.cublaslt_grouped") +
	       epj_counter_get(ctx, "comm.nccl.calls");
}

/* One optimizer step (gas micro-batches); wall and cpu ms out. */
static int step(arm *a, const bopts *o, double *wall, double *cpu)
{
	int64_t B = epj_engine_micro_batch_size(a->eng);
	int64_t gas = epj_engine_grad_accum_steps(a->eng);
	int64_t d0[N_DRV + 1];
	for (int i = 0; i < N_DRV; i++)
		d0[i] = epj_counter_get(a->ctx, DRV_NAME[i]);
	d0[N_DRV] = epj_counter_get(a->ctx, "cuda.bytes.d2d");
	int64_t g0 = epj_counter_get(a->ctx, "cudagraph.copy_bytes"),
		a0 = epj_counter_get(a->ctx, "autograd.grad_copy_bytes"),
		l0 = lib_calls(a->ctx);
	double loss = 0;
	double w0 = clock_ms(CLOCK_MONOTONIC),
	       c0 = clock_ms(CLOCK_PROCESS_CPUTIME_ID);
	for (int64_t k = 0; k < gas; k++) {
		epj_tensor *ids = NULL, *labels = NULL;
		if (epj_corpus_next_batch(a->ctx, a->corpus, B, o->seq, &ids,
					  &labels) != EPJ_OK)
			return die(a->ctx, "batch");
		epj_step_info info;
		epj_status st =
		    epj_engine_train_step(a->eng, ids, labels, &info);
		epj_tensor_free(ids);
		epj_tensor_free(labels);
		if (st != EPJ_OK)
			return die(a->ctx, a->name);
		loss += info.mean_loss / (double)gas;
	}
	if (a->loss)
		a->loss[a->n_loss++] = loss;
	*wall = clock_ms(CLOCK_MONOTONIC) - w0;
	*cpu = clock_ms(CLOCK_PROCESS_CPUTIME_ID) - c0;
	/* every step's driver allocations and frees, warmup included */
	a->step_allocs[a->n_step] =
	    epj_counter_get(a->ctx, "cuda.mem_alloc") - d0[2];
	a->step_frees[a->n_step++] =
	    epj_counter_get(a->ctx, "cuda.mem_free") - d0[3];
	if (a->census) {
		for (int i = 0; i < N_DRV; i++)
			a->drv[i] +=
			    epj_counter_get(a->ctx, DRV_NAME[i]) - d0[i];
		a->d2d += epj_counter_get(a->ctx, "cuda.bytes.d2d") - d0[N_DRV];
		a->d2d_graph +=
		    epj_counter_get(a->ctx, "cudagraph.copy_bytes") - g0;
		a->d2d_grad +=
		    epj_counter_get(a->ctx, "autograd.grad_copy_bytes") - a0;
		a->lib_calls += lib_calls(a->ctx) - l0;
	}
	return 0;
}

/* Compile cost of a model in this process: compile.us + compile.cached_us
 * (graph passes, code generation, host compiler, load; not the trace;
 * segments found in the kernel cache count in the second) and the first
 * step's extra wall time over the second (trace + compile + first run). */
typedef struct ccost {
	double compile_ms, first_extra_ms;
	int64_t graphs, disk_hits, misses;
} ccost;

static int compile_cost(const bopts *o, const char *model, ccost *c)
{
	arm a = { .name = "compile" };
	bopts two = *o;
	two.steps = 2;
	int rc = arm_init(&a, &two, model, true);
	double w1 = 0, w2 = 0, cpu;
	if (!rc)
		rc = step(&a, &two, &w1, &cpu);
	if (!rc) {
		c->compile_ms =
		    (double)(epj_counter_get(a.ctx, "compile.us") +
			     epj_counter_get(a.ctx, "compile.cached_us")) /
		    1e3;
		c->graphs = epj_counter_get(a.ctx, "stats.unique_graphs");
		c->disk_hits = epj_counter_get(a.ctx, "cache.disk_hits");
		c->misses = epj_counter_get(a.ctx, "cache.misses");
		rc = step(&a, &two, &w2, &cpu);
	}
	c->first_extra_ms = w1 - w2;
	arm_free(&a);
	return rc;
}

/* A fresh private kernel cache directory for a cold measurement. */
static char *fresh_cache(void)
{
	char *d = strdup("/tmp/bench-compile-cache-XXXXXX");
	if (!d || !mkdtemp(d)) {
		free(d);
		return NULL;
	}
	setenv("EPJIT_CACHE_DIR", d, 1);
	return d;
}

static void drop_cache(char *d)
{
	if (!d)
		return;
	char cmd[256];
	snprintf(cmd, sizeof cmd, "rm -rf '%s'", d);
	if (system(cmd) != 0)
		fprintf(stderr, PROG ": could not remove %s\n", d);
	free(d);
}

static int run(const bopts *op);
static int arms(const bopts *op);

static int parse(int argc, char **argv, bopts *o)
{
	*o = (bopts){ .model = "bench/configs/bench-model.json",
		      .model2 = "bench/configs/bench-model-2l.json",
		      .config = "bench/configs/bench-ds.json",
		      .backend = "interpreter",
		      .device = "cpu",
		      .seq = 256,
		      .warmup = 2,
		      .steps = 6,
		      .loss_tol = 0.02 };
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--checkpointing"))
			o->checkpointing = true;
		else if (!strcmp(a, "--compile-only"))
			o->compile_only = true;
		else if (!strcmp(a, "--child"))
			o->child = true;
		else if (!strcmp(a, "--no-compile-cost"))
			o->no_cost = true;
		else if (v && !strcmp(a, "--device"))
			o->device = v, i++;
		else if (v && !strcmp(a, "--json"))
			o->json = v, i++;
		else if (v && !strcmp(a, "--layers"))
			o->layers = atol(v), i++;
		else if (v && !strcmp(a, "--model"))
			o->model = v, i++;
		else if (v && !strcmp(a, "--model2"))
			o->model2 = v, i++;
		else if (v && !strcmp(a, "--config"))
			o->config = v, i++;
		else if (v && !strcmp(a, "--backend"))
			o->backend = v, i++;
		else if (v && !strcmp(a, "--seq"))
			o->seq = atol(v), i++;
		else if (v && !strcmp(a, "--warmup"))
			o->warmup = atol(v), i++;
		else if (v && !strcmp(a, "--steps"))
			o->steps = atol(v), i++;
		else if (v && !strcmp(a, "--loss-tol"))
			o->loss_tol = atof(v), i++;
		else if (v && !strcmp(a, "--routing") &&
			 (!strcmp(v, "fixed") || !strcmp(v, "learned")))
			o->learned = !strcmp(v, "learned"), i++;
		else {
			fprintf(stderr,
				"usage: " PROG " [--model F] [--model2 F] "
				"[--config F] [--backend NAME] [--seq T] "
				"[--warmup N] [--steps N] [--checkpointing] "
				"[--compile-only] [--device DEV] [--layers N] "
				"[--no-compile-cost] [--json FILE] "
				"[--loss-tol X] [--routing fixed|learned]\n");
			return 2;
		}
	}
	if (!(o->loss_tol >= 0) || !isfinite(o->loss_tol)) {
		fprintf(stderr, PROG ": --loss-tol must be a number >= 0\n");
		return 2;
	}
	if (o->seq < 1 || o->steps < 1 || o->warmup < 1 || o->layers < 0) {
		fprintf(stderr, PROG ": --seq, --steps, --warmup must be >= 1, "
				     "--layers >= 1\n");
		return 2;
	}
	return -1;
}

int main(int argc, char **argv)
{
	bopts o;
	int rc = parse(argc, argv, &o);
	if (rc >= 0)
		return rc;
	char *cut = NULL;
	if (o.layers > 0) {
		if (!(cut = cut_model(o.model, o.layers)))
			return 1;
		printf(PROG ": %s cut to %ld layers\n", o.model, o.layers);
		o.model = cut;
	}
	rc = run(&o);
	if (cut) {
		unlink(cut);
		free(cut);
	}
	return rc;
}

static int run(const bopts *op)
{
	bopts o = *op;
	int rc;
	printf(PROG ": model %s, seq %ld, device %s, backend %s, "
		    "checkpointing %s, routing %s, warmup %ld, steps %ld per "
		    "arm\n",
	       o.model, o.seq, o.device, o.backend,
	       o.checkpointing ? "on" : "off", o.learned ? "learned" : "fixed",
	       o.warmup, o.steps);
	if (o.child) {
		ccost w = { 0 };
		if ((rc = compile_cost(&o, o.model, &w)))
			return rc;
		printf("child %.3f %.3f %" PRId64 " %" PRId64 "\n",
		       w.compile_ms, w.first_extra_ms, w.disk_hits, w.misses);
		return 0;
	}
	if (o.no_cost)
		return arms(&o);
	ccost c2 = { 0 }, c8 = { 0 };
	char *d2 = fresh_cache();
	rc = compile_cost(&o, o.model2, &c2);
	drop_cache(d2);
	if (rc)
		return rc;
	char *d8 = fresh_cache();
	if ((rc = compile_cost(&o, o.model, &c8))) {
		drop_cache(d8);
		return rc;
	}
	printf("cold compile (fresh kernel cache; compile = passes + codegen + "
	       "cc + load, first-step extra = + trace + first run):\n");
	printf("  2-layer: compile %.1f ms, first-step extra %.1f ms, %" PRId64
	       " unique graphs\n",
	       c2.compile_ms, c2.first_extra_ms, c2.graphs);
	printf("  8-layer: compile %.1f ms, first-step extra %.1f ms, %" PRId64
	       " unique graphs\n",
	       c8.compile_ms, c8.first_extra_ms, c8.graphs);
	printf("  8-layer / 2-layer: compile %.2f, first-step extra %.2f\n",
	       c8.compile_ms / c2.compile_ms,
	       c8.first_extra_ms / c2.first_extra_ms);
	/* a second process on the warm disk cache of the 8-layer run */
	char self[2048], cmd[4096];
	ssize_t ns = readlink("/proc/self/exe", self, sizeof self - 1);
	if (ns <= 0) {
		drop_cache(d8);
		fprintf(stderr, PROG ": cannot find its own executable\n");
		return 1;
	}
	self[ns] = 0;
	snprintf(cmd, sizeof cmd,
		 "'%s' --child --model '%s' --config '%s' --backend '%s' "
		 "--seq %ld%s",
		 self, o.model, o.config, o.backend, o.seq,
		 o.checkpointing ? " --checkpointing" : "");
	FILE *p = popen(cmd, "r");
	double wc = -1, wf = -1;
	long long wh = -1, wm = -1;
	char line[256];
	while (p && fgets(line, sizeof line, p))
		if (sscanf(line, "child %lf %lf %lld %lld", &wc, &wf, &wh,
			   &wm) == 4)
			break;
	if (p)
		pclose(p);
	drop_cache(d8);
	if (wc < 0) {
		fprintf(stderr, PROG ": the warm-cache child process failed\n");
		return 1;
	}
	printf("warm disk cache, second process (8-layer): compile %.1f ms "
	       "(%.1f%% of cold), first-step extra %.1f ms, disk hits %lld, "
	       "misses %lld\n",
	       wc, 100.0 * wc / c8.compile_ms, wf, wh, wm);
	if (o.compile_only)
		return 0;
	return arms(&o);
}

/* The driver census (a cuda device): per steady-state step, eager and
 * compiled side by side, as the seed's Nsight census counts a step; peak
 * device memory is each arm's own allocator's peak reservation (its
 * context's memory.peak_reserved), which on a cuda context is device
 * memory.  Nothing on devices without a driver. */
static void census(const arm *e, const arm *c, const bopts *o)
{
	if (!epj_counter_get(e->ctx, "cuda.launches") &&
	    !epj_counter_get(e->ctx, "cuda.mem_alloc"))
		return;
	double d = (double)o->steps;
	static const char *const label[N_DRV] = {
		"driver launches / step", "graph launches / step",
		"driver allocs / step",	  "driver frees / step",
		"host syncs / step",	  "H2D bytes / step",
		"D2H bytes / step",
	};
	printf("driver census, per step (%ld steps each, layers %ld):\n",
	       o->steps, o->layers);
	for (int i = 0; i < N_DRV; i++) {
		double x = (double)e->drv[i] / d, y = (double)c->drv[i] / d;
		printf("%-26s %14.0f %14.0f %8.3f\n", label[i], x, y,
		       x > 0 ? y / x : 0.0);
	}
	double x = (double)e->d2d / d, y = (double)c->d2d / d;
	printf("%-26s %14.0f %14.0f %8.3f\n", "D2D bytes / step", x, y,
	       x > 0 ? y / x : 0.0);
	/* where the device copies come from */
	printf("%-26s %14.0f %14.0f\n", "  of which CUDA-graph I/O",
	       (double)e->d2d_graph / d, (double)c->d2d_graph / d);
	printf("%-26s %14.0f %14.0f\n", "  of which gradient copies",
	       (double)e->d2d_grad / d, (double)c->d2d_grad / d);
	printf("%-26s %14.0f %14.0f\n", "library calls / step",
	       (double)e->lib_calls / d, (double)c->lib_calls / d);
	printf("  (cuBLASLt, cuBLAS and NCCL launch their kernels through "
	       "their own runtime: the driver\n   counters above do not see "
	       "them; each library call is one or more kernels more)\n");
	double pe = (double)e->mem.peak_reserved / 1048576.0,
	       pc = (double)c->mem.peak_reserved / 1048576.0;
	printf("%-26s %14.1f %14.1f %8.3f\n", "peak device MiB", pe, pc,
	       pe > 0 ? pc / pe : 0.0);
	/* the allocator's driver calls step by step: none once warm */
	for (int k = 0; k < 2; k++) {
		const arm *a = k ? c : e;
		printf("driver allocs/frees by step, %s (%ld warmup first):",
		       a->name, o->warmup);
		for (long i = 0; i < a->n_step; i++)
			printf(" %" PRId64 "/%" PRId64, a->step_allocs[i],
			       a->step_frees[i]);
		printf("\n");
	}
}

/* Every step's loss of both arms: printed, finite, equal to --loss-tol.
 * Returns 0, or 1 with LOSS MISMATCH said. */
static int check_losses(const arm *e, const arm *c, const bopts *o)
{
	int bad = 0;
	printf("loss per step (warm-up first):\n");
	printf("%-26s %14s %14s %8s\n", "", "eager", "compiled", "rel diff");
	long n = e->n_loss < c->n_loss ? e->n_loss : c->n_loss;
	for (long i = 0; i < n; i++) {
		double le = e->loss[i], lc = c->loss[i];
		double rel = fabs(le - lc) / (1.0 + fabs(le));
		bool ok = isfinite(le) && isfinite(lc) && rel <= o->loss_tol;
		char what[48];
		snprintf(what, sizeof what, "step %ld%s", i + 1,
			 i < o->warmup ? " (warm-up)" : "");
		printf("  %-24s %14.6f %14.6f %8.1e%s\n", what, le, lc, rel,
		       ok ? "" : "  <-");
		bad += !ok;
	}
	if (bad || e->n_loss != c->n_loss || n == 0) {
		printf("LOSS MISMATCH: %d of %ld steps non-finite or apart by "
		       "more than %g relative (the timings above are of "
		       "wrong results)\n",
		       bad, n, o->loss_tol);
		return 1;
	}
	printf("losses: finite, eager and compiled within %g relative\n",
	       o->loss_tol);
	return 0;
}

/* The two arms, side by side. */
static int arms(const bopts *op)
{
	bopts o = *op;
	int rc;
	arm e = { .name = "eager" }, c = { .name = "compiled" };
	if ((rc = arm_init(&e, &o, o.model, false)) ||
	    (rc = arm_init(&c, &o, o.model, true)))
		goto out;
	double w, cp;
	for (long i = 0; i < o.warmup; i++)
		if ((rc = step(&e, &o, &w, &cp)) ||
		    (rc = step(&c, &o, &w, &cp)))
			goto out;
	epj_memory_reset_peaks(e.ctx);
	epj_memory_reset_peaks(c.ctx);
	e.census = c.census = true;
	e.launches0 = launches(e.ctx);
	c.launches0 = launches(c.ctx);
	c.compiled0 = epj_counter_get(c.ctx, "kernels.launched.compiled");
	int64_t frames0 = epj_counter_get(c.ctx, "frames.total");
	e.prof0 = epj_counters_snapshot(e.ctx);
	c.prof0 = epj_counters_snapshot(c.ctx);
	for (long i = 0; i < o.steps; i++) {
		/* A B B A ... */
		arm *first = i % 2 ? &c : &e, *second = i % 2 ? &e : &c;
		if ((rc = step(first, &o, &first->wall[i], &first->cpu[i])) ||
		    (rc = step(second, &o, &second->wall[i], &second->cpu[i])))
			goto out;
	}
	e.launches1 = launches(e.ctx);
	c.launches1 = launches(c.ctx);
	c.compiled1 = epj_counter_get(c.ctx, "kernels.launched.compiled");
	profile_window(&e);
	profile_window(&c);
	epj_memory_stats_get(e.ctx, &e.mem);
	epj_memory_stats_get(c.ctx, &c.mem);
	double ew = median(e.wall, o.steps), cw = median(c.wall, o.steps);
	double ec = median(e.cpu, o.steps), cc = median(c.cpu, o.steps);
	double el = (double)(e.launches1 - e.launches0) / (double)o.steps;
	double cl = (double)(c.launches1 - c.launches0) / (double)o.steps;
	printf("%-26s %14s %14s %8s\n", "", "eager", "compiled", "ratio");
	printf("%-26s %14.1f %14.1f %8.3f\n", "median step (ms, wall)", ew, cw,
	       cw / ew);
	printf("%-26s %14.1f %14.1f %8.3f\n", "median step (ms, cpu)", ec, cc,
	       cc / ec);
	double ep = quantile(e.wall, o.steps, 0.95),
	       cp95 = quantile(c.wall, o.steps, 0.95);
	printf("%-26s %14.1f %14.1f %8.3f\n", "p95 step (ms, wall)", ep, cp95,
	       cp95 / ep);
	printf("%-26s %14.3f %14.3f\n", "p95 / median (wall)", ep / ew,
	       cp95 / cw);
	printf("%-26s %14.0f %14.0f %8.3f\n", "kernel launches / step", el, cl,
	       cl / el);
	double cg = (double)(c.compiled1 - c.compiled0) / (double)o.steps;
	printf("%-26s %14s %14.0f\n", "  of which in regions", "", cg);
	printf("%-26s %14s %14.0f\n", "  of which eager (AutoEP...)", "",
	       cl - cg);
	printf("%-26s %14.1f %14.1f %8.3f\n", "peak allocated (MiB)",
	       (double)e.mem.peak_allocated / 1048576.0,
	       (double)c.mem.peak_allocated / 1048576.0,
	       (double)c.mem.peak_allocated / (double)e.mem.peak_allocated);
	printf("%-26s %14.1f %14.1f %8.3f\n", "peak reserved (MiB)",
	       (double)e.mem.peak_reserved / 1048576.0,
	       (double)c.mem.peak_reserved / 1048576.0,
	       (double)c.mem.peak_reserved / (double)e.mem.peak_reserved);
	census(&e, &c, &o);
	int loss_rc = check_losses(&e, &c, &o);
	int64_t frames = epj_counter_get(c.ctx, "frames.total") - frames0;
	printf("frames compiled in the measured window: %" PRId64 "\n", frames);
	print_profile(&e, &c, o.steps);
	if (o.json) {
		json_t *j = json_pack(
		    "{s:s, s:s, s:s, s:i, s:i, s:b, s:{s:f, s:f, s:f, s:f, "
		    "s:f, "
		    "s:I, s:I}, s:{s:f, s:f, s:f, s:f, s:f, s:I, s:I, s:f}, "
		    "s:I}",
		    "model", o.model, "device", o.device, "backend", o.backend,
		    "seq", (int)o.seq, "steps", (int)o.steps, "checkpointing",
		    o.checkpointing, "eager", "wall_ms", ew, "cpu_ms", ec,
		    "p95_ms", ep, "launches", el, "p95_over_median", ep / ew,
		    "peak_allocated", (json_int_t)e.mem.peak_allocated,
		    "peak_reserved", (json_int_t)e.mem.peak_reserved,
		    "compiled", "wall_ms", cw, "cpu_ms", cc, "p95_ms", cp95,
		    "launches", cl, "p95_over_median", cp95 / cw,
		    "peak_allocated", (json_int_t)c.mem.peak_allocated,
		    "peak_reserved", (json_int_t)c.mem.peak_reserved,
		    "launches_in_regions", cg, "frames_in_window",
		    (json_int_t)frames);
		json_t *le = json_array(), *lc = json_array();
		for (long i = 0; i < e.n_loss; i++)
			json_array_append_new(le, json_real(e.loss[i]));
		for (long i = 0; i < c.n_loss; i++)
			json_array_append_new(lc, json_real(c.loss[i]));
		if (j) {
			json_object_set_new(json_object_get(j, "eager"), "loss",
					    le);
			json_object_set_new(json_object_get(j, "compiled"),
					    "loss", lc);
			json_object_set_new(j, "losses_agree",
					    json_boolean(!loss_rc));
		} else {
			json_decref(le);
			json_decref(lc);
		}
		if (!j || json_dump_file(j, o.json, JSON_INDENT(1)) != 0) {
			fprintf(stderr, PROG ": cannot write %s\n", o.json);
			rc = 1;
		}
		json_decref(j);
	}
	if (!rc)
		rc = loss_rc;
out:
	arm_free(&e);
	arm_free(&c);
	return rc;
}
