/* tools/epjit_warmup.c -- epjit-warmup, the offline kernel-cache warm-up.
 *
 * Fills the kernel cache (EPJIT_CACHE_DIR) with every artifact a compiled
 * epjit-train run with the same --model/--config/--seq/--layout/
 * --checkpointing will load, on a machine without a GPU, and ships caches
 * between machines as verified archives.  doc/epjit-warmup.1 is the manual.
 *
 *   shape-only model + engine (ctx->meta: no parameter has storage, so the
 *   48-layer qwen3-30b-a3b costs a few MiB) -> engine compile with the
 *   backend build deferred -> every region traced for each variant a
 *   training run asks for (train or checkpoint forward + replay, eval)
 *   -> the jit's unique graphs -> sources + keys (jit/warmup.c) ->
 *   [--dry-run: list] -> missing ones compiled by -j forked workers
 *
 * --graphs FILE replaces the model by the graphs a torch run compiled
 * (recorded by the Python package; tools/warmup_graphs.c).
 *
 * It links the convenience library (internal ej_* functions) because the
 * kernel cache and the jit are not part of the public API.
 * Exit status: 0 ok, 1 error, 2 bad command line.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef HAVE_CONFIG_H
#include "config.h"
#endif
#include "cc.h"
#include "flag_hint.h"
#include "jit_impl.h"
#include "kcache.h"
#include "kcache_archive.h"
#include "runtime_impl.h"
#include "train_defaults.h"
#include "warmup.h"
#include "warmup_graphs.h"

#ifndef PACKAGE_VERSION
#define PACKAGE_VERSION "0.1"
#endif

#define PROG "epjit-warmup"

/* --model-override: at most this many edits of the model config. */
#define MAX_OVERRIDES 64

typedef struct opts {
	const char *model_path, *config_path;
	/* --model-override KEY=VALUE, in order (epj_model_opts) */
	const char *model_overrides[MAX_OVERRIDES];
	int n_model_overrides;
	long seq;
	long world; /* --world, 0: the config's (runtime/engine.c) */
	epj_layout layout;
	bool checkpointing;
	bool cuda;
	const char *archs;
	long jobs;
	bool dry_run;
	const char *export_path, *import_path;
	const char *kind;	 /* --kind: export entries of one kind only */
	const char *graphs_path; /* --graphs: a torch run's graph file */
} opts;

static void usage(FILE *fp)
{
	fprintf(
	    fp,
	    "usage: " PROG " [options]\n"
	    "Compiles every kernel a compiled epjit-train run with the "
	    "same model, config,\n"
	    "sequence length, layout and checkpointing will load into the "
	    "kernel cache\n"
	    "($EPJIT_CACHE_DIR), without a GPU and without allocating the "
	    "weights.\n"
	    "\n"
	    "  --model FILE        HF config.json (default: built-in tiny "
	    "model)\n"
	    "  --model-override KEY=VALUE\n"
	    "                      edit the model config as epjit-train "
	    "does (repeatable)\n"
	    "  --config FILE       DeepSpeed-style ds.json (default: "
	    "epjit-train's built-in\n"
	    "                      config); the micro-batch comes from it\n"
	    "  --seq T             tokens per sequence (default %d)\n"
	    "  --world N           ranks of the run (default: the config's "
	    "train_batch_size /\n"
	    "                      (micro-batch x accumulation), else its "
	    "autoep_size, else 1);\n"
	    "                      no ranks are started: it compiles what "
	    "one rank would\n"
	    "  --layout L          nested (default) or root\n"
	    "  --checkpointing     activation checkpointing of every block\n"
	    "  --backend B         c (default: shared objects for the host "
	    "C compiler) or\n"
	    "                      cuda (NVRTC cubins)\n"
	    "  --arch LIST         cuda targets, e.g. sm_80,sm_90,sm_100 "
	    "(default %s)\n"
	    "  -j N, --jobs N      compile with N worker processes "
	    "(default: online CPUs)\n"
	    "  --dry-run           list the artifacts (key, unit, graph, "
	    "arch, cached or\n"
	    "                      missing); compile nothing\n"
	    "  --export FILE       write an archive: alone, every entry of "
	    "the cache; with\n"
	    "                      --model/--config, the entries this "
	    "warm-up needs\n"
	    "                      (compiled first when missing)\n"
	    "  --kind K            with --export: only the entries of kind "
	    "K, c (shared\n"
	    "                      objects) or nvrtc (cubins: an archive "
	    "another host\n"
	    "                      compiler can import)\n"
	    "  --import FILE       verify every entry of an archive, then "
	    "add them all to\n"
	    "                      the cache (nothing is added when any "
	    "entry fails)\n"
	    "  --graphs FILE       compile the graphs of FILE (the Python "
	    "package records\n"
	    "                      them: EPJIT_GRAPH_RECORD) instead of a "
	    "model's\n"
	    "  --help, --version\n"
	    "Exit status: 0 ok, 1 error, 2 bad command line.  See "
	    "epjit-warmup(1).\n",
	    DEFAULT_SEQ, EJ_CUDA_ARCH_DEFAULT);
}

static int fail_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail_msg(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs(PROG ": ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	return 1;
}

static int fail(const epj_ctx *ctx)
{
	const char *m = epj_ctx_error(ctx);
	return fail_msg("%s", m && *m ? m : "unknown error");
}

static int bad_usage(const char *fmt, const char *a)
{
	fputs(PROG ": ", stderr);
	fprintf(stderr, fmt, a);
	fputc('\n', stderr);
	usage(stderr);
	return 2;
}

static bool parse_long(const char *s, long lo, long hi, long *out)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < lo || v > hi)
		return false;
	*out = v;
	return true;
}

static int parse_args(int argc, char **argv, opts *o, bool *model_given)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	*o = (opts){ .seq = DEFAULT_SEQ,
		     .layout = EPJ_LAYOUT_NESTED,
		     .jobs = ncpu > 0 ? ncpu : 1 };
	*model_given = false;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout);
			return 0;
		}
		if (!strcmp(a, "--version")) {
			printf(PROG " (epjit) %s\n", PACKAGE_VERSION);
			return 0;
		}
		if (!strcmp(a, "--checkpointing")) {
			o->checkpointing = true;
			*model_given = true;
			continue;
		}
		if (!strcmp(a, "--dry-run")) {
			o->dry_run = true;
			continue;
		}
		const char *val = NULL, *eq = strchr(a, '=');
		char name[40];
		size_t n = eq ? (size_t)(eq - a) : strlen(a);
		if (!strncmp(a, "-j", 2) && a[2]) { /* -j4 */
			snprintf(name, sizeof name, "-j");
			val = a + 2;
		} else {
			if (strncmp(a, "-", 1) != 0 || n >= sizeof name)
				return bad_usage("unexpected argument '%s'", a);
			memcpy(name, a, n);
			name[n] = '\0';
			static const char *const known[] = {
				"--model",  "--config",		"--seq",
				"--layout", "--backend",	"--arch",
				"-j",	    "--jobs",		"--export",
				"--import", "--model-override", "--world",
				"--kind",   "--graphs",
			};
			bool ok = false;
			for (size_t k = 0; k < EJ_ARRAY_LEN(known); k++)
				ok |= !strcmp(name, known[k]);
			if (!ok) {
				char msg[160];
				flag_hint(usage, a, msg, sizeof msg);
				fprintf(stderr,
					PROG ": unknown option '%s'%s\n", a,
					msg);
				usage(stderr);
				return 2;
			}
			if (eq)
				val = eq + 1;
			else if (i + 1 < argc)
				val = argv[++i];
			else
				return bad_usage("option '%s' needs a value",
						 name);
		}
		if (!*val)
			return bad_usage("option '%s' has an empty value",
					 name);
		if (!strcmp(name, "--model")) {
			o->model_path = val;
			*model_given = true;
		} else if (!strcmp(name, "--model-override")) {
			if (o->n_model_overrides >= MAX_OVERRIDES)
				return bad_usage("more than 64 %s options",
						 name);
			o->model_overrides[o->n_model_overrides++] = val;
			*model_given = true;
		} else if (!strcmp(name, "--config")) {
			o->config_path = val;
			*model_given = true;
		} else if (!strcmp(name, "--export")) {
			o->export_path = val;
		} else if (!strcmp(name, "--graphs")) {
			o->graphs_path = val;
		} else if (!strcmp(name, "--import")) {
			o->import_path = val;
		} else if (!strcmp(name, "--kind")) {
			if (strcmp(val, "c") && strcmp(val, "nvrtc"))
				return bad_usage("--kind '%s': c or nvrtc",
						 val);
			o->kind = val;
		} else if (!strcmp(name, "--arch")) {
			o->archs = val;
		} else if (!strcmp(name, "--backend")) {
			if (!strcmp(val, "c"))
				o->cuda = false;
			else if (!strcmp(val, "cuda"))
				o->cuda = true;
			else
				return bad_usage("--backend wants c or cuda, "
						 "got '%s'",
						 val);
		} else if (!strcmp(name, "--layout")) {
			*model_given = true;
			if (!strcmp(val, "nested"))
				o->layout = EPJ_LAYOUT_NESTED;
			else if (!strcmp(val, "root"))
				o->layout = EPJ_LAYOUT_ROOT;
			else
				return bad_usage("--layout wants nested or "
						 "root, got '%s'",
						 val);
		} else if (!strcmp(name, "--world")) {
			*model_given = true;
			if (!parse_long(val, 1, 1 << 20, &o->world))
				return bad_usage("--world wants an integer >= "
						 "1, got '%s'",
						 val);
		} else if (!strcmp(name, "--seq")) {
			*model_given = true;
			if (!parse_long(val, 1, INT_MAX, &o->seq))
				return bad_usage("--seq wants an integer >= 1, "
						 "got '%s'",
						 val);
		} else { /* -j / --jobs */
			if (!parse_long(val, 1, 256, &o->jobs))
				return bad_usage("-j wants an integer in "
						 "[1, 256], got '%s'",
						 val);
		}
	}
	if (o->archs && !o->cuda)
		return bad_usage("--arch '%s' needs --backend cuda", o->archs);
	if (o->graphs_path && *model_given)
		return bad_usage("--graphs '%s' takes no model option "
				 "(--model, --config, --seq, ...)",
				 o->graphs_path);
	if (o->graphs_path)
		*model_given = true; /* --export: the entries it needs */
	if (o->import_path && (o->export_path || *model_given || o->dry_run ||
			       o->kind || o->graphs_path))
		return bad_usage("--import '%s' takes no other option",
				 o->import_path);
	if (o->kind && !o->export_path)
		return bad_usage("--kind '%s' goes with --export", o->kind);
	return -1;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- cache size ---- */

typedef struct sizes {
	int64_t n, bytes;
} sizes;

static void add_size(void *user, const char *key, int64_t bytes)
{
	(void)key;
	sizes *s = user;
	s->n++;
	s->bytes += bytes;
}

static void print_cache(epj_ctx *ctx)
{
	ej_kcache *kc = ej_kcache_open(ctx, NULL);
	if (!kc) {
		epj_ctx_clear_error(ctx);
		return;
	}
	sizes s = { 0, 0 };
	ej_kcache_list(kc, add_size, &s);
	printf(PROG ": cache %s: %" PRId64 " entr%s, %.1f KiB\n",
	       ej_kcache_dir(kc), s.n, s.n == 1 ? "y" : "ies",
	       (double)s.bytes / 1024.0);
	ej_kcache_close(kc);
}

/* ---- the plan ---- */

typedef struct warm {
	epj_ctx *ctx;
	epj_compiler *compiler; /* --graphs */
	int n_file_graphs;
	epj_config *cfg;
	epj_model *model;
	epj_engine *engine;
	ej_warm_plan plan;
	int64_t B, T;
	int world;   /* the run's ranks this warm-up stands for */
	int ep_size; /* the config's expert_parallel.autoep_size */
	int n_variants;
	double trace_s;
} warm;

static void warm_free(warm *w)
{
	ej_warm_plan_free(&w->plan);
	epj_engine_free(w->engine);
	epj_compiler_free(w->compiler);
	epj_model_free(w->model);
	epj_config_free(w->cfg);
}

/* Shape-only model and engine, every region traced, the artifact plan. */
static epj_status make_plan(warm *w, const opts *o)
{
	epj_ctx *ctx = w->ctx;
	double t0 = now_s();
	epj_model_opts mo = { .layout = o->layout,
			      .seed = 42,
			      .dtype = EPJ_DTYPE_F32,
			      .config_overrides = o->model_overrides,
			      .n_config_overrides = o->n_model_overrides };
	/* the config as epjit-train reads it: "auto" as it resolves it (the
	 * schedule's length changes no kernel), else the built-in one */
	char text[1024];
	epj_status st;
	if (o->config_path) {
		auto_config(text, sizeof text, DEFAULT_STEPS);
		st = epj_config_load(ctx, o->config_path, text, &w->cfg);
	} else {
		default_config(text, sizeof text);
		st = epj_config_parse(ctx, text, "<built-in ds config>", NULL,
				      &w->cfg);
	}
	if (st != EPJ_OK)
		return st;
	ctx->meta = true; /* no storage for parameters or optimizer state */
	ctx->meta_world = (int)o->world; /* one rank of it, none started */
	st = epj_model_new(ctx, o->model_path, &mo, &w->model);
	if (st == EPJ_OK && o->checkpointing)
		epj_model_set_checkpointing(w->model, true);
	if (st == EPJ_OK)
		st = epj_engine_new(ctx, w->model, w->cfg, &w->engine);
	/* tracing computes small constants (RoPE tables) for real */
	ctx->meta = false;
	if (st == EPJ_OK)
		st = epj_engine_compile(w->engine);
	if (st != EPJ_OK)
		return st;
	ej_jit *jit = ej_engine_jit(w->engine);
	jit->defer_build = true;
	if (!o->cuda && jit->backend != EJ_BACKEND_C)
		fprintf(stderr,
			PROG ": note: the config's compile.backend is %s: a "
			     "run with it loads no C artifacts (warming them "
			     "anyway)\n",
			ej_backend_name(jit->backend));
	int64_t ep = 1;
	if ((st = epj_config_int(ctx, w->cfg, "expert_parallel.autoep_size",
				 &ep)) != EPJ_OK)
		return st;
	w->ep_size = (int)ep;
	w->B = epj_engine_micro_batch_size(w->engine);
	/* the world the batch sizes were resolved for */
	w->world = (int)(w->engine->cfg.train_batch_size /
			 (w->B * epj_engine_grad_accum_steps(w->engine)));
	w->T = o->seq;
	st = ej_engine_compile_trace_all(w->engine, w->B, w->T, &w->n_variants);
	if (st == EPJ_OK)
		st = ej_warm_plan_build(
		    ctx, jit, o->cuda ? EJ_BACKEND_NVRTC : EJ_BACKEND_C,
		    o->archs, &w->plan);
	w->trace_s = now_s() - t0;
	return st;
}

/* --graphs: the file's graphs compiled with the builds deferred
 * (tools/warmup_graphs.c), then the artifact plan. */
static epj_status make_graph_plan(warm *w, const opts *o)
{
	double t0 = now_s();
	epj_status st = warm_graphs_compile(w->ctx, o->graphs_path,
					    &w->compiler, &w->n_file_graphs);
	if (st == EPJ_OK)
		st = ej_warm_plan_build(w->ctx, ej_compiler_jit(w->compiler),
					o->cuda ? EJ_BACKEND_NVRTC
						: EJ_BACKEND_C,
					o->archs, &w->plan);
	w->trace_s = now_s() - t0;
	return st;
}

static void print_header(const warm *w, const opts *o)
{
	if (o->graphs_path) {
		printf(PROG ": %s: %d graph%s, %d unique segment%s, %d "
			    "graph%s to build, backend %s%s%s (traced in %.2f "
			    "s)\n",
		       o->graphs_path, w->n_file_graphs,
		       w->n_file_graphs == 1 ? "" : "s", w->plan.n_segments,
		       w->plan.n_segments == 1 ? "" : "s", w->plan.n_graphs,
		       w->plan.n_graphs == 1 ? "" : "s", o->cuda ? "cuda" : "c",
		       o->cuda ? " " : "", o->cuda ? ej_nvrtc_identity() : "",
		       w->trace_s);
		return;
	}
	printf(
	    PROG ": %s, %d layer%s, batch %" PRId64 " x %" PRId64
		 " (a rank of %d, expert parallel %d), mode %s, %d region%s, "
		 "%d variant%s, %d unique "
		 "segment%s, %d graph%s, backend %s%s%s (traced in %.2f s)\n",
	    o->model_path ? o->model_path : "built-in tiny model",
	    w->model->cfg.num_hidden_layers,
	    w->model->cfg.num_hidden_layers == 1 ? "" : "s", w->B, w->T,
	    w->world, w->ep_size, epj_engine_compile_mode(w->engine),
	    epj_engine_num_regions(w->engine),
	    epj_engine_num_regions(w->engine) == 1 ? "" : "s", w->n_variants,
	    w->n_variants == 1 ? "" : "s", w->plan.n_segments,
	    w->plan.n_segments == 1 ? "" : "s", w->plan.n_graphs,
	    w->plan.n_graphs == 1 ? "" : "s", o->cuda ? "cuda" : "c",
	    o->cuda ? " " : "", o->cuda ? ej_nvrtc_identity() : "", w->trace_s);
}

static void print_job(const char *state, const ej_warm_job *j)
{
	printf("%-9s %s %s %s%s%s\n", state, j->key, j->name, j->what,
	       j->arch[0] ? " " : "", j->arch);
}

static int run_warmup(warm *w, const opts *o)
{
	/* a refused cache directory fails before any work */
	ej_kcache *probe = ej_kcache_open(w->ctx, NULL);
	if (!probe)
		return fail(w->ctx);
	ej_kcache_close(probe);
	if ((o->graphs_path ? make_graph_plan(w, o) : make_plan(w, o)) !=
	    EPJ_OK)
		return fail(w->ctx);
	print_header(w, o);
	if (o->dry_run) {
		ej_kcache *kc = ej_kcache_open(w->ctx, NULL);
		for (int i = 0; i < w->plan.n; i++) {
			ej_warm_job *j = &w->plan.jobs[i];
			void *d = NULL;
			size_t n = 0;
			if (kc)
				ej_kcache_get(kc, j->key, &d, &n);
			print_job(d ? "cached" : "missing", j);
			free(d);
		}
		ej_kcache_close(kc);
		epj_ctx_clear_error(w->ctx);
		printf(PROG ": %d artifact%s (dry run: nothing compiled)\n",
		       w->plan.n, w->plan.n == 1 ? "" : "s");
		return 0;
	}
	double t0 = now_s();
	epj_status st =
	    ej_warm_plan_compile(w->ctx, &w->plan, NULL, (int)o->jobs);
	double dt = now_s() - t0;
	for (int i = 0; i < w->plan.n; i++) {
		const ej_warm_job *j = &w->plan.jobs[i];
		print_job(j->was_cached ? "cached"
			  : j->compiled ? "compiled"
					: "FAILED",
			  j);
	}
	printf(PROG ": %d artifact%s: %d compiled, %d already cached, %d "
		    "failed; compile %.2f s with -j %ld, total %.2f s\n",
	       w->plan.n, w->plan.n == 1 ? "" : "s", w->plan.n_compiled,
	       w->plan.n_cached, w->plan.n_failed, dt, o->jobs,
	       dt + w->trace_s);
	if (st != EPJ_OK)
		return fail(w->ctx);
	print_cache(w->ctx);
	return 0;
}

/* ---- archives ---- */

static int do_export(warm *w, const opts *o, bool with_model)
{
	epj_ctx *ctx = w->ctx;
	const char **keys = NULL;
	int n_keys = -1; /* the whole cache */
	if (with_model) {
		int rc = run_warmup(w, o);
		if (rc != 0)
			return rc;
		if (o->dry_run)
			return 0;
		keys = calloc((size_t)w->plan.n + 1, sizeof *keys);
		if (!keys)
			return fail_msg("out of memory");
		for (int i = 0; i < w->plan.n; i++)
			keys[i] = w->plan.jobs[i].key;
		n_keys = w->plan.n;
	}
	ej_kcache *kc = ej_kcache_open(ctx, NULL);
	int n = 0;
	epj_status st =
	    kc ? ej_kcache_archive_export_kind(ctx, kc, o->export_path, keys,
					       n_keys, o->kind, &n)
	       : ctx->status;
	ej_kcache_close(kc);
	free(keys);
	if (st != EPJ_OK)
		return fail(ctx);
	printf(PROG ": exported %d entr%s to %s\n", n, n == 1 ? "y" : "ies",
	       o->export_path);
	return 0;
}

static int do_import(epj_ctx *ctx, const char *path)
{
	ej_kcache *kc = ej_kcache_open(ctx, NULL);
	if (!kc)
		return fail(ctx);
	int added = 0, present = 0;
	epj_status st =
	    ej_kcache_archive_import(ctx, kc, path, &added, &present);
	ej_kcache_close(kc);
	if (st != EPJ_OK)
		return fail(ctx);
	printf(PROG ": imported %s: %d entr%s added, %d already present\n",
	       path, added, added == 1 ? "y" : "ies", present);
	print_cache(ctx);
	return 0;
}

int main(int argc, char **argv)
{
	opts o;
	bool model_given;
	int rc = parse_args(argc, argv, &o, &model_given);
	if (rc >= 0)
		return rc;
	warm w = { 0 };
	if (epj_ctx_new("cpu", &w.ctx) != EPJ_OK || !w.ctx)
		return fail_msg("cannot create a cpu context");
	if (o.import_path)
		rc = do_import(w.ctx, o.import_path);
	else if (o.export_path)
		rc = do_export(&w, &o, model_given);
	else
		rc = run_warmup(&w, &o);
	warm_free(&w);
	epj_ctx_free(w.ctx);
	return rc;
}
