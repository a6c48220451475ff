/* tools/epjit_train.c -- epjit-train, the host trainer.
 *
 * Trains an MoE causal LM (Qwen3-MoE, Mixtral or Qwen2-MoE, from a
 * config.json, or the built-in tiny model) with the DeepSpeed-style engine
 * on a corpus (the synthetic Markov source, a token file, or a text file
 * read as bytes), using only the public API in
 * epjit.h; doc/trainer.md and doc/epjit-train.1 describe it for users.  The run
 * is one straight line:
 *
 *   parse flags -> context -> model -> engine (ds.json or the built-in
 *   config) -> corpus -> [--load + skip consumed batches] -> [--dump-state
 *   and stop] -> train to --steps -> [--save] -> eval -> summary
 *
 * Invariants
 *  - --steps N is the optimizer step the run ends at, counted from the
 *    start of training: a run loaded from a checkpoint at step k trains
 *    N - k more steps (Hugging Face's max_steps).
 *  - The data stream is deterministic in the run seed.  A resumed run
 *    regenerates and drops the step_count * gradient_accumulation_steps
 *    micro-batches the saved run consumed, so "10 steps, save, load, 10
 *    more" is bit-identical to "20 steps" (t/train.sh checks it).  For the
 *    same reason the built-in learning-rate schedule does not depend on
 *    --steps.
 *  - The run seed is --seed when given, else the config's "seed" (DeepSpeed
 *    default 42).  It seeds parameter init and the context RNG; the corpus
 *    seed is derived from it.
 *  - Every failure prints "epjit-train: <message>" to stderr and exits 1;
 *    a bad command line prints the usage and exits 2.  All objects live in
 *    one `run` struct freed on every path.
 *  - SIGTERM, SIGUSR1 and SIGINT stop the run between two optimizer steps,
 *    the same step on every rank (see "stop signals" below); the metrics
 *    file only ever holds whole rows.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv, clock_gettime, execv */
#endif
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdio_ext.h> /* __fpurge */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef HAVE_CONFIG_H
#include "config.h"
#endif
#include "epjit.h"
#include "flag_hint.h"
#include "tb_events.h"
#include "train_defaults.h"

#ifndef PACKAGE_VERSION
#define PACKAGE_VERSION "0.1"
#endif

#define PROG "epjit-train"

/* Defaults of the built-in run (see usage() and train_defaults.h). */
enum {
	EVAL_BATCHES = 4, /* micro-batches of the held-out evaluation */
	EVAL_STREAM = 1,  /* epj_corpus_fork stream of the evaluation */
	/* --compare-eager: rounds (alternating which arm goes first) of
	 * steps per arm each */
	COMPARE_ROUNDS = 8,
	COMPARE_ROUND_STEPS = 4,
};
/* An error after step 1 without --save saves to RESCUE_NAME<step>.ckpt in
 * the working directory. */
#define RESCUE_NAME "epjit-train-rescue.step"
/* --seq at most 2^31 - 1 tokens; tokens per optimizer step (micro-batch x
 * seq x gradient accumulation) at most 2^40. */
#define SEQ_MAX	   2147483647L
#define TOKENS_MAX ((int64_t)1 << 40)

/* --model-override: at most this many edits of the model config. */
#define MAX_OVERRIDES 64

/* Environment variable that marks a process re-executed by --threads. */
#define THREADS_ENV "EPJIT_TRAIN_THREADS_SET"

typedef struct opts {
	const char *model_path; /* NULL: built-in tiny model */
	/* --model-override KEY=VALUE, in order (epj_model_opts) */
	const char *model_overrides[MAX_OVERRIDES];
	int n_model_overrides;
	const char *config_path; /* NULL: built-in ds config */
	const char *data;  /* NULL or "synthetic", *.txt, a token dataset (see
			      epj_data_spec_p), else a token file */
	const char *split; /* --split: a token dataset's document split */
	long steps;
	epj_layout layout;
	long seq;
	bool checkpointing;
	bool compile; /* call epj_engine_compile (the config picks the mode) */
	bool no_precompile; /* regions compile at their first call */
	bool parity;	    /* --parity: eager vs compiled check, no training */
	bool bf16;	    /* --parity: bf16 arms */
	bool full_model; /* --parity: full-model compile instead of regional */
	const char *load, *save, *metrics, *dump_state, *dump_batch;
	long save_every; /* --save-every N: 0 none */
	long keep;	 /* --keep K: 0 not given (1) */
	/* --save-async: the periodic saves in the background */
	bool save_async;
	const char *emit_cuda; /* --emit-cuda DIR */
	bool nvrtc_check;      /* --nvrtc-check: compile the units too */
	bool compare_eager;    /* --compare-eager: eager vs compiled steps */
	long eval_every;       /* 0: evaluate only at the end */
	uint64_t seed;
	bool seed_given;
	long threads;	      /* 0: leave as is */
	const char *list_st;  /* hidden: --list-safetensors FILE */
	const char *rank_log; /* --rank-log PREFIX: PREFIX.rank<N>.log */
	long fault_step;      /* hidden --fault-step: see fault_inject() */
	const char *fault;    /* hidden --fault kill|stop */
	long fault_rank;
	bool async_plan; /* --parity: expert_parallel.async_split_plan */
	/* packed documents and the loss: Megatron's options, each or-ed with
	 * the config's data section; --eod-token (-1: the config's) */
	bool reset_attn, reset_pos, eod_mask, per_token;
	long eod_token;
	int argc; /* the command line, for the resume hint */
	char **argv;
	/* --model resolved: the config.json to build from, and the Hugging
	 * Face folder whose weights the model starts from ("" for none: a
	 * --model DIR, or a config.json with model.safetensors or
	 * model.safetensors.index.json beside it) */
	char model_cfg[4096];
	char weights_dir[4096];
} opts;

#define N_MON 10 /* the monitors' events (mon_events) */
#define N_RL  5	 /* router losses at most (epj_engine_router_loss) */

/* Everything a run owns; run_free() releases it in reverse order. */
typedef struct run {
	epj_ctx *ctx;
	epj_config *cfg; /* the training config, read once (setup) */
	epj_model *model;
	epj_engine *engine;
	epj_corpus *corpus;
	FILE *metrics;
	FILE *monitor[N_MON]; /* csv_monitor: one file per event (mon_events) */
	char mon_dir[4096];   /* their folder */
	/* the expert-load metrics (load_names), on with any of the records:
	 * n_moe layers; csv_monitor's files, N_LOAD per layer, or NULL */
	bool loads_on;
	int n_moe;
	FILE **load_mon;
	FILE *rl_monitor[N_RL]; /* csv_monitor: the router losses' files */
	tb_writer *tb;		/* tensorboard: rank 0's event file, or NULL */
	uint64_t seed;		/* the run seed */
	int64_t B, T, gas;
	int eval_stream;  /* epj_corpus_fork stream of the evaluation */
	const char *data; /* --data or the config's data.path, "synthetic" */
	/* epj_engine_precompile: variants compiled before step 1, its wall
	 * time (-1 when not called) */
	int precompiled;
	double precompile_ms;
	/* the stop signal all ranks agreed on between two steps (0: none),
	 * and whether its orderly end (save, exit status) went through */
	int stop_sig;
	bool stopped;
	/* errors after the first step (see "errors in a run"): the step the
	 * training started from, the step of the last checkpoint this run
	 * wrote (-1: none), whether an error ends the run (on any rank), and
	 * whether it may have left a peer inside a collective (then no rank
	 * can take part in a save) */
	int64_t step0;
	int64_t saved_step;
	bool failed;
	bool no_rescue;
	/* the last agreement: some rank's background save is still writing;
	 * the step of the background save in flight */
	bool save_busy;
	int64_t bg_step;
	char weights[4400]; /* where the starting weights came from */
} run;

/* ---- messages ---- */

/* The first error message of the process, repeated as the last line of a
 * run that saved its state after it (see "errors in a run"). */
static char g_first_err[1024];

static int fail_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Prints "epjit-train: <message>" and returns 1 (the exit status). */
static int fail_msg(const char *fmt, ...)
{
	char *msg = NULL;
	va_list ap;
	va_start(ap, fmt);
	if (vasprintf(&msg, fmt, ap) < 0)
		msg = NULL;
	va_end(ap);
	if (!g_first_err[0])
		snprintf(g_first_err, sizeof g_first_err, "%s",
			 msg ? msg : "out of memory");
	fputs(PROG ": ", stderr);
	if (epj_dist_size() > 1)
		fprintf(stderr, "rank %d of %d: ", epj_dist_rank(),
			epj_dist_size());
	fprintf(stderr, "%s\n", msg ? msg : "out of memory");
	fflush(stderr);
	free(msg);
	return 1;
}

/* Prints the context's last error and returns 1. */
static int fail(const epj_ctx *ctx)
{
	const char *m = ctx ? epj_ctx_error(ctx) : "";
	return fail_msg("%s", m && *m ? m : "unknown error");
}

static void usage(FILE *fp)
{
	fprintf(
	    fp,
	    "usage: " PROG " [options]\n"
	    "Trains a Qwen3-MoE, Mixtral or Qwen2-MoE model with the epjit "
	    "engine (eager, cpu).\n"
	    "\n"
	    "  --model PATH        HF config.json, or a model folder (its "
	    "config.json and\n"
	    "                      the weights of model.safetensors[.index."
	    "json] there or\n"
	    "                      beside the config.json; default: "
	    "built-in tiny model)\n"
	    "  --model-override KEY=VALUE\n"
	    "                      edit the model config before it is "
	    "checked (repeatable;\n"
	    "                      VALUE a JSON scalar, e.g. "
	    "num_hidden_layers=1)\n"
	    "  --config FILE       DeepSpeed-style ds.json (default: "
	    "built-in:\n"
	    "                      micro-batch %d, AdamW lr %g, warmup %d, "
	    "cosine\n"
	    "                      to step %d, clipping 1.0, print every "
	    "%d)\n"
	    "  --data SRC          synthetic (default), a token file, "
	    "a .txt file\n"
	    "                      (byte tokens, vocab 256), a Megatron "
	    "prefix\n"
	    "                      (PREFIX.bin + PREFIX.idx), a .npy file or "
	    "a blend\n"
	    "                      \"W1 PATH1 W2 PATH2 ...\"\n"
	    "  --split W           a dataset's train,validation,test "
	    "document split\n"
	    "                      (default 969,30,1)\n"
	    "  --reset-attention-mask  the documents packed in a row do not "
	    "see each other\n"
	    "  --reset-position-ids    positions restart at every document\n"
	    "  --eod-mask-loss     no loss where the input is the "
	    "end-of-document token\n"
	    "  --eod-token ID      that token (the three options above need "
	    "it)\n"
	    "  --calculate-per-token-loss  a step's loss: the sum over its "
	    "counted tokens\n"
	    "                      divided by their number (on with "
	    "--eod-mask-loss and\n"
	    "                      a dataset's loss mask)\n"
	    "  --steps N           train until optimizer step N (default "
	    "%d)\n"
	    "  --layout L          nested (default) or root\n"
	    "  --seq T             tokens per sequence (default %d)\n"
	    "  --checkpointing     activation checkpointing of every block\n"
	    "  --compile           call engine.compile() after initialize: "
	    "regional\n"
	    "                      compilation around the AutoEP layers when "
	    "the config\n"
	    "                      sets compile.autoep_non_moe (the built-in "
	    "one does),\n"
	    "                      else full-model compilation\n"
	    "  --no-precompile     with --compile: compile each region at its "
	    "first call,\n"
	    "                      not before step 1 (later variants count as "
	    "recompiles)\n"
	    "  --compare-eager     with --compile: after the run, time the "
	    "compiled engine\n"
	    "                      against a fresh eager one on its weights "
	    "and batches,\n"
	    "                      %d alternating rounds of %d steps; median "
	    "ratio and spread\n"
	    "  --bf16              bf16 parameters, FP32 masters (the config's "
	    "bf16.enabled:\n"
	    "                      built-in or \"auto\"); with --parity: "
	    "bf16 arms\n"
	    "  --emit-cuda DIR     trace every region at the batch shape (one "
	    "CPU step,\n"
	    "                      no update) and write each compiled graph's "
	    "CUDA C\n"
	    "                      (*.cu) with its NVRTC options (*.opts); "
	    "--nvrtc-check\n"
	    "                      also compiles them for EPJIT_CUDA_ARCH\n"
	    "  --device DEV        cpu, cuda-sim (the CUDA C on the "
	    "simulator) or cuda\n"
	    "                      (tensors and kernels on the GPU); as "
	    "EPJIT_DEVICE=DEV\n"
	    "  --parity            eager vs compiled on one batch (table; exit "
	    "1 "
	    "on any\n"
	    "                      failure); with --layout, --checkpointing, "
	    "--bf16,\n"
	    "                      --full-model, --async-split-plan, "
	    "--model, --seed;\n"
	    "                      under mpirun: EP over all ranks, every "
	    "rank must pass\n"
	    "  --load CKPT         resume from a checkpoint (or HF f32 "
	    "safetensors)\n"
	    "  --save CKPT         write a checkpoint at the end, when a "
	    "signal stops the run\n"
	    "                      and after an error\n"
	    "  --save-every N      also save to --save after every N-th "
	    "optimizer step\n"
	    "  --save-async        the periodic saves in the background: the "
	    "state is copied\n"
	    "                      between two steps, a thread writes it "
	    "while training goes\n"
	    "                      on (also the config's "
	    "checkpoint.writer.decoupled)\n"
	    "  --keep K            committed generations of --save kept "
	    "(default 1; a\n"
	    "                      checkpoint set: several ranks)\n"
	    "  --metrics FILE      CSV: step,loss,lr,grad_norm,tokens_per_s,"
	    "peak_alloc_bytes,\n"
	    "                      step_ms,compile_ms,entropy_floor,"
	    "peak_alloc_rank,\n"
	    "                      peak_reserved_bytes,peak_reserved_rank "
	    "(memory: the\n"
	    "                      largest over the ranks), then per MoE "
	    "layer L\n"
	    "                      moe_load_max_mean_layer_L,"
	    "moe_load_cv_layer_L,\n"
	    "                      moe_dead_experts_layer_L, then one column "
	    "per router\n"
	    "                      loss (the config's csv_monitor writes "
	    "DeepSpeed's\n"
	    "                      per-metric files)\n"
	    "  --dump-state FILE   one forward+backward on the next batch, "
	    "write\n"
	    "                      ids, labels, logits, loss, weights and "
	    "grads; no training\n"
	    "  --dump-batch FILE   --dump-state's batch from FILE's input_ids "
	    "and labels\n"
	    "                      (I64 [B, T] safetensors) instead of the "
	    "data\n"
	    "  --eval-every N      held-out eval every N steps (default 0: "
	    "at the end)\n"
	    "  --seed S            run seed (default: the config's seed, "
	    "42)\n"
	    "  --threads N         OpenMP/BLAS threads\n"
	    "  --rank-log PREFIX   under mpirun: ranks > 0 write their "
	    "output to\n"
	    "                      PREFIX.rank<N>.log (default: rank 0 "
	    "prints, the\n"
	    "                      others print only errors)\n"
	    "  --help, --version\n"
	    "SIGTERM / SIGHUP / SIGPIPE (or stdout closed) / SIGUSR1 / SIGINT: "
	    "stop after the\n"
	    "current step; all but SIGINT save to --save.  An error after "
	    "step 1 saves to\n"
	    "--save (default " RESCUE_NAME "<N>.ckpt) before exiting 1.\n"
	    "Exit status: 0 ok (also after SIGUSR1), 1 error, 2 bad command "
	    "line,\n"
	    "129 SIGHUP, 130 SIGINT, 141 SIGPIPE, 143 SIGTERM.  See "
	    "epjit-train(1).\n",
	    DEFAULT_MICRO_BATCH, DEFAULT_LR, DEFAULT_WARMUP, DEFAULT_STEPS,
	    DEFAULT_PRINT, DEFAULT_STEPS, DEFAULT_SEQ, (int)COMPARE_ROUNDS,
	    (int)COMPARE_ROUND_STEPS);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double mib(uint64_t bytes)
{
	return (double)bytes / (1024.0 * 1024.0);
}

/* Under mpirun: which ranks hold the memory maxima, as " (max over ranks:
 * peak rank R, reserved rank R of N)" in buf; "" for one rank. */
static const char *mem_ranks(const epj_dist_memory *m, char *buf, size_t n)
{
	if (epj_dist_size() < 2)
		return "";
	snprintf(buf, n,
		 " (max over ranks: peak rank %d, reserved rank %d of %d)",
		 m->peak_allocated_rank, m->reserved_rank, epj_dist_size());
	return buf;
}

/* ---- command line ---- */

/* Parses a decimal integer in [lo, hi]; false on anything else. */
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

static bool parse_u64(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (*s == '-')
		return false;
	unsigned long long v = strtoull(s, &end, 0);
	if (errno || end == s || *end)
		return false;
	*out = v;
	return true;
}

static int bad_usage(const char *fmt, const char *a, const char *b)
{
	fputs(PROG ": ", stderr);
	fprintf(stderr, fmt, a, b);
	fputc('\n', stderr);
	usage(stderr);
	return 2;
}

/* The options without a value: each sets its bool. */
static const struct {
	const char *name;
	size_t off;
} flag_opts[] = {
	{ "--checkpointing", offsetof(opts, checkpointing) },
	{ "--compile", offsetof(opts, compile) },
	{ "--no-precompile", offsetof(opts, no_precompile) },
	{ "--parity", offsetof(opts, parity) },
	{ "--bf16", offsetof(opts, bf16) },
	{ "--full-model", offsetof(opts, full_model) },
	{ "--nvrtc-check", offsetof(opts, nvrtc_check) },
	{ "--compare-eager", offsetof(opts, compare_eager) },
	{ "--async-split-plan", offsetof(opts, async_plan) },
	{ "--save-async", offsetof(opts, save_async) },
	{ "--reset-attention-mask", offsetof(opts, reset_attn) },
	{ "--reset-position-ids", offsetof(opts, reset_pos) },
	{ "--eod-mask-loss", offsetof(opts, eod_mask) },
	{ "--calculate-per-token-loss", offsetof(opts, per_token) },
};

/* The options with a value: "--opt VALUE" or "--opt=VALUE". */
static const char *const with_value[] = {
	"--model",	"--config",	    "--data",
	"--steps",	"--layout",	    "--seq",
	"--load",	"--save",	    "--metrics",
	"--dump-state", "--dump-batch",	    "--eval-every",
	"--seed",	"--threads",	    "--list-safetensors",
	"--emit-cuda",	"--device",	    "--rank-log",
	"--fault",	"--split",	    "--fault-step",
	"--fault-rank", "--model-override", "--save-every",
	"--keep",	"--eod-token",
};

/* Option `name` (one of with_value) given value val; -1, or the exit
 * status of a usage error. */
static int set_value(opts *o, const char *name, const char *val)
{
	long v;
	if (!strcmp(name, "--model")) {
		o->model_path = val;
	} else if (!strcmp(name, "--model-override")) {
		if (o->n_model_overrides >= MAX_OVERRIDES)
			return bad_usage("more than %s %s options", "64", name);
		o->model_overrides[o->n_model_overrides++] = val;
	} else if (!strcmp(name, "--config")) {
		o->config_path = val;
	} else if (!strcmp(name, "--data")) {
		o->data = val;
	} else if (!strcmp(name, "--split")) {
		o->split = val;
	} else if (!strcmp(name, "--load")) {
		o->load = val;
	} else if (!strcmp(name, "--save")) {
		o->save = val;
	} else if (!strcmp(name, "--metrics")) {
		o->metrics = val;
	} else if (!strcmp(name, "--dump-state")) {
		o->dump_state = val;
	} else if (!strcmp(name, "--dump-batch")) {
		o->dump_batch = val;
	} else if (!strcmp(name, "--emit-cuda")) {
		o->emit_cuda = val;
	} else if (!strcmp(name, "--rank-log")) {
		o->rank_log = val;
	} else if (!strcmp(name, "--fault")) {
		if (strcmp(val, "kill") && strcmp(val, "stop"))
			return bad_usage("--fault wants kill or "
					 "stop, got '%s'%s",
					 val, "");
		o->fault = val;
	} else if (!strcmp(name, "--list-safetensors")) {
		o->list_st = val;
	} else if (!strcmp(name, "--device")) {
		/* the same as EPJIT_DEVICE, for this process (the
		 * parity harness's arms read it too) */
		if (!epj_device_known(val))
			return bad_usage("--device wants one of %s, "
					 "got '%s'",
					 epj_device_names(), val);
		setenv("EPJIT_DEVICE", val, 1);
	} else if (!strcmp(name, "--layout")) {
		if (!strcmp(val, "nested"))
			o->layout = EPJ_LAYOUT_NESTED;
		else if (!strcmp(val, "root"))
			o->layout = EPJ_LAYOUT_ROOT;
		else
			return bad_usage("--layout wants nested or "
					 "root, got '%s'%s",
					 val, "");
	} else if (!strcmp(name, "--seed")) {
		if (!parse_u64(val, &o->seed))
			return bad_usage("%s wants an unsigned "
					 "integer, got '%s'",
					 name, val);
		o->seed_given = true;
	} else {
		long lo = !strcmp(name, "--steps") ||
				  !strcmp(name, "--eval-every") ||
				  !strcmp(name, "--fault-rank") ||
				  !strcmp(name, "--eod-token")
			      ? 0
			      : 1;
		long hi = !strcmp(name, "--threads")	 ? 1024
			  : !strcmp(name, "--seq")	 ? SEQ_MAX
			  : !strcmp(name, "--keep")	 ? 65536
			  : !strcmp(name, "--eod-token") ? INT32_MAX
							 : LONG_MAX;
		if (!parse_long(val, lo, hi, &v)) {
			char what[96];
			snprintf(what, sizeof what,
				 "%%s wants an integer in [%ld, %ld], "
				 "got '%%s'",
				 lo, hi);
			return bad_usage(what, name, val);
		}
		if (!strcmp(name, "--steps"))
			o->steps = v;
		else if (!strcmp(name, "--seq"))
			o->seq = v;
		else if (!strcmp(name, "--eval-every"))
			o->eval_every = v;
		else if (!strcmp(name, "--fault-step"))
			o->fault_step = v;
		else if (!strcmp(name, "--fault-rank"))
			o->fault_rank = v;
		else if (!strcmp(name, "--save-every"))
			o->save_every = v;
		else if (!strcmp(name, "--keep"))
			o->keep = v;
		else if (!strcmp(name, "--eod-token"))
			o->eod_token = v;
		else
			o->threads = v;
	}
	return -1;
}

static bool is_file(const char *path)
{
	struct stat sb;
	return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* --model PATH: a Hugging Face model folder (PATH/config.json) or a
 * config.json; either way the folder's weights, model.safetensors.index.json
 * (shards) or model.safetensors, when there, are the model's starting
 * weights (o->weights_dir; epj_engine_load reads the folder). */
static void resolve_model(opts *o)
{
	o->model_cfg[0] = o->weights_dir[0] = '\0';
	if (!o->model_path)
		return;
	struct stat sb;
	char dir[4096], f[4200];
	if (stat(o->model_path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
		snprintf(dir, sizeof dir, "%s", o->model_path);
		size_t n = strlen(dir);
		while (n > 1 && dir[n - 1] == '/')
			dir[--n] = '\0';
		snprintf(o->model_cfg, sizeof o->model_cfg, "%s/config.json",
			 dir);
	} else {
		snprintf(o->model_cfg, sizeof o->model_cfg, "%s",
			 o->model_path);
		const char *sl = strrchr(o->model_path, '/');
		if (sl)
			snprintf(dir, sizeof dir, "%.*s",
				 (int)(sl - o->model_path), o->model_path);
		else
			snprintf(dir, sizeof dir, ".");
		if (!dir[0])
			snprintf(dir, sizeof dir, "/");
	}
	static const char *const wf[2] = { "model.safetensors.index.json",
					   "model.safetensors" };
	for (int i = 0; i < 2 && !o->weights_dir[0]; i++) {
		snprintf(f, sizeof f, "%s/%s", dir, wf[i]);
		if (is_file(f))
			snprintf(o->weights_dir, sizeof o->weights_dir, "%s",
				 dir);
	}
}

/* The weights file of the folder (as epj_engine_load picks it). */
static void weights_file(const opts *o, char *buf, size_t n)
{
	snprintf(buf, n, "%s/model.safetensors.index.json", o->weights_dir);
	if (!is_file(buf))
		snprintf(buf, n, "%s/model.safetensors", o->weights_dir);
}

/* Fills o from argv.  Returns -1 to go on, else the exit status (0 for
 * --help/--version, 2 for a bad command line). */
static int parse_args(int argc, char **argv, opts *o)
{
	*o = (opts){ .steps = DEFAULT_STEPS,
		     .layout = EPJ_LAYOUT_NESTED,
		     .seq = DEFAULT_SEQ,
		     .eod_token = -1,
		     .argc = argc,
		     .argv = argv };
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
		bool flag = false;
		for (size_t k = 0; k < sizeof flag_opts / sizeof *flag_opts;
		     k++)
			if (!strcmp(a, flag_opts[k].name)) {
				*(bool *)((char *)o + flag_opts[k].off) = true;
				flag = true;
			}
		if (flag)
			continue;
		if (strncmp(a, "--", 2) != 0)
			return bad_usage("unexpected argument '%s'%s", a, "");
		/* Options with a value: "--opt VALUE" or "--opt=VALUE". */
		char name[64];
		const char *val = NULL, *eq = strchr(a, '=');
		size_t n = eq ? (size_t)(eq - a) : strlen(a);
		char hint[96];
		if (n >= sizeof name)
			return bad_usage("unknown option '%s'%s", a, "");
		memcpy(name, a, n);
		name[n] = '\0';
		bool known = false;
		for (size_t k = 0; k < sizeof with_value / sizeof *with_value;
		     k++)
			known |= !strcmp(name, with_value[k]);
		if (!known) {
			flag_hint(usage, a, hint, sizeof hint);
			return bad_usage("unknown option '%s'%s", a, hint);
		}
		if (eq)
			val = eq + 1;
		else if (i + 1 < argc)
			val = argv[++i];
		else
			return bad_usage("option '%s' needs a value%s", name,
					 "");
		if (!*val)
			return bad_usage("option '%s' has an empty value%s",
					 name, "");
		int r = set_value(o, name, val);
		if (r >= 0)
			return r;
	}
	if (o->n_model_overrides > 0 && o->parity)
		return bad_usage("%s does not apply to %s (its arms read the "
				 "config.json as is)",
				 "--model-override", "--parity");
	if (o->dump_batch && !o->dump_state)
		return bad_usage("%s FILE gives %s its batch: give it too",
				 "--dump-batch", "--dump-state");
	if ((o->save_every || o->keep) && !o->save)
		return bad_usage("%s saves to --save CKPT: give it too%s",
				 o->save_every ? "--save-every" : "--keep", "");
	if (o->save_async && !o->save_every)
		return bad_usage("%s runs the periodic saves of %s in the "
				 "background: give it too",
				 "--save-async", "--save-every N");
	resolve_model(o);
	return -1;
}

/* --threads N: OpenMP reads OMP_NUM_THREADS and a pthreads OpenBLAS reads
 * OPENBLAS_NUM_THREADS when they are loaded, before main runs.  So the
 * process sets both and re-executes itself once (THREADS_ENV = N marks the
 * second run); where that is impossible omp_set_num_threads still bounds our
 * own OpenMP regions. */
static void apply_threads(long n, char **argv)
{
	if (n <= 0)
		return;
	char buf[32];
	snprintf(buf, sizeof buf, "%ld", n);
	const char *done = getenv(THREADS_ENV);
	if (!done || strcmp(done, buf) != 0) {
		setenv("OMP_NUM_THREADS", buf, 1);
		setenv("OPENBLAS_NUM_THREADS", buf, 1);
		setenv(THREADS_ENV, buf, 1);
		fflush(NULL);
		execv("/proc/self/exe", argv);
		/* exec failed (no /proc): fall through. */
	}
#ifdef _OPENMP
	omp_set_num_threads((int)n);
#endif
}

/* ---- --list-safetensors (hidden; used by t/train.sh) ---- */

/* Prints "name dtype [d0,d1,...]" per tensor, then "meta key=value". */
static int list_safetensors(const char *path)
{
	epj_ctx *ctx = NULL;
	epj_st_file *f = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return fail_msg("cannot create a cpu context");
	if (epj_st_open(ctx, path, &f) != EPJ_OK) {
		int rc = fail(ctx);
		epj_ctx_free(ctx);
		return rc;
	}
	for (int i = 0; i < epj_st_count(f); i++) {
		printf("%s %s [", epj_st_name_at(f, i),
		       epj_st_dtype_str_at(f, i));
		for (int d = 0; d < epj_st_ndim_at(f, i); d++)
			printf("%s%" PRId64, d ? "," : "",
			       epj_st_shape_at(f, i)[d]);
		printf("]\n");
	}
	for (int i = 0; i < epj_st_metadata_count(f); i++) {
		const char *k = epj_st_metadata_key_at(f, i);
		printf("meta %s=%s\n", k, epj_st_metadata(f, k));
	}
	epj_st_close(f);
	epj_ctx_free(ctx);
	return 0;
}

/* ---- setup ---- */

/* The run's training config: --config (its "auto" values take this run's
 * own), else the built-in one.  On failure the context holds the message. */
static epj_status load_config(run *r, const opts *o)
{
	if (o->config_path) {
		char autos[1024];
		auto_config_prec(autos, sizeof autos, o->steps, o->bf16);
		return epj_config_load(r->ctx, o->config_path, autos, &r->cfg);
	}
	char json[1024];
	default_config_prec(json, sizeof json, o->bf16);
	return epj_config_parse(r->ctx, json, "<built-in ds config>", NULL,
				&r->cfg);
}

/* A value of the run's config.  The keys named here are keys of the
 * config's table, of the getter's type: a failure is a bug of this
 * program, reported and aborted. */
static void cfg_bug(const run *r)
{
	fprintf(stderr, PROG ": internal error: %s\n", epj_ctx_error(r->ctx));
	abort();
}

static const char *cfg_str(const run *r, const char *key)
{
	const char *v = "";
	if (epj_config_str(r->ctx, r->cfg, key, &v) != EPJ_OK)
		cfg_bug(r);
	return v;
}

static int64_t cfg_int(const run *r, const char *key)
{
	int64_t v = 0;
	if (epj_config_int(r->ctx, r->cfg, key, &v) != EPJ_OK)
		cfg_bug(r);
	return v;
}

static bool cfg_bool(const run *r, const char *key)
{
	bool v = false;
	if (epj_config_bool(r->ctx, r->cfg, key, &v) != EPJ_OK)
		cfg_bug(r);
	return v;
}

/* Model + engine for `seed` under cfg (the run's config: one parse for
 * every engine of the run).  On failure the context holds the message. */
static epj_status build_model_engine(run *r, const opts *o,
				     const epj_config *cfg, uint64_t seed)
{
	epj_model_opts mo = { .layout = o->layout,
			      .seed = seed,
			      .fixed_routing = false,
			      .dtype = EPJ_DTYPE_F32,
			      .config_overrides = o->model_overrides,
			      .n_config_overrides = o->n_model_overrides };
	epj_status st = epj_model_new(
	    r->ctx, o->model_path ? o->model_cfg : NULL, &mo, &r->model);
	if (st != EPJ_OK)
		return st;
	if (o->checkpointing)
		epj_model_set_checkpointing(r->model, true);
	st = epj_engine_new(r->ctx, r->model, cfg, &r->engine);

	/* packed documents: the flags add to the config's data section */
	if (st == EPJ_OK) {
		epj_batch_opts b;
		epj_engine_batch_opts(r->engine, &b);
		b.reset_attention_mask |= o->reset_attn;
		b.reset_position_ids |= o->reset_pos;
		b.eod_mask_loss |= o->eod_mask;
		b.per_token_loss |= o->per_token;
		if (o->eod_token >= 0)
			b.eod_token = o->eod_token;
		st = epj_engine_set_batch_opts(r->engine, &b);
	}
	/* --compile stands for the user's engine.compile() call */
	if (st == EPJ_OK && o->compile)
		st = epj_engine_compile(r->engine);
	/* Compile every region now, at the run's shape, so that the first
	 * step runs compiled code only (with a warm cache: loads only). */
	r->precompile_ms = -1;
	if (st == EPJ_OK && o->compile && !o->no_precompile && !o->parity &&
	    !o->emit_cuda && !o->dump_state) {
		double t0 = now_s();
		st = epj_engine_precompile(r->engine, o->seq, &r->precompiled);
		r->precompile_ms = (now_s() - t0) * 1e3;
	}
	return st;
}

/* A 64-bit mix (splitmix64's finaliser): the corpus seed of a run seed. */
static uint64_t mix64(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static bool has_suffix(const char *s, const char *suf)
{
	size_t n = strlen(s), k = strlen(suf);
	return n >= k && !strcmp(s + n - k, suf);
}

/* --data FILE.txt: byte-level tokens (vocab 256) through a temporary token
 * file, removed as soon as the corpus has read it into memory. */
static int text_corpus(run *r, const char *path)
{
	const char *dir = getenv("TMPDIR");
	char tmp[4096];
	snprintf(tmp, sizeof tmp, "%s/epjit-train.XXXXXX",
		 dir && *dir ? dir : "/tmp");
	int fd = mkstemp(tmp);
	if (fd < 0)
		return fail_msg("%s: cannot create a temporary token file: %s",
				tmp, strerror(errno));
	close(fd);
	if (epj_tokens_from_text(r->ctx, path, tmp) == EPJ_OK)
		r->corpus = epj_corpus_from_tokens(r->ctx, tmp);
	unlink(tmp);
	return r->corpus ? 0 : fail(r->ctx);
}

/* The device of the run's contexts: EPJIT_DEVICE (set by --device too),
 * "cpu" when unset.  On "cuda-sim" every eager op of the run (model
 * forward, autograd backward formulas, the AutoEP layer) runs as a CUDA
 * kernel on the simulator, and compiled regions use the cuda-sim backend;
 * on "cuda" the tensors live in GPU memory, the eager ops are NVRTC cubins
 * and compiled regions use the nvrtc backend. */
/* The run's device: EPJIT_DEVICE (--device sets it), else cpu.  An
 * unknown name is the caller's to refuse (epj_device_known). */
static const char *run_device(void)
{
	const char *d = getenv("EPJIT_DEVICE");
	return d && *d ? d : "cpu";
}

static int batch_banner(run *r);

static int setup(run *r, const opts *o)
{
	if (!epj_device_known(run_device()))
		return fail_msg("EPJIT_DEVICE=\"%s\" is not a device (known: "
				"%s)",
				run_device(), epj_device_names());
	if (epj_ctx_new(run_device(), &r->ctx) != EPJ_OK || !r->ctx)
		return fail_msg("cannot create a %s context", run_device());
	/* The config first, once: the device, seed and precision that the
	 * model and engine are built with come from it. */
	if (load_config(r, o) != EPJ_OK)
		return fail(r->ctx);
	/* "device": "cuda-sim" or "cuda" in the config with no EPJIT_DEVICE /
	 * --device: the run's contexts move there (eager ops included) */
	const char *dev = cfg_str(r, "device");
	if (!getenv("EPJIT_DEVICE") && dev[0] &&
	    strcmp(dev, run_device()) != 0) {
		setenv("EPJIT_DEVICE", dev, 1);
		epj_ctx_free(r->ctx);
		r->ctx = NULL;
		if (epj_ctx_new(run_device(), &r->ctx) != EPJ_OK || !r->ctx)
			return fail_msg("cannot create a %s context",
					run_device());
	}
	/* The run seed: --seed, else the config's. */
	uint64_t seed = o->seed_given ? o->seed : (uint64_t)cfg_int(r, "seed");
	/* --bf16 is the config's bf16.enabled ("auto" takes it): a config
	 * that says false is refused, not overruled */
	if (o->bf16 && !cfg_bool(r, "bf16.enabled"))
		return fail_msg("--bf16: %s does not enable bf16 (bf16.enabled "
				"is false or absent); write \"bf16\": "
				"{\"enabled\": true} or \"auto\", or leave "
				"--bf16 off",
				o->config_path);
	if (build_model_engine(r, o, r->cfg, seed) != EPJ_OK)
		return fail(r->ctx);
	r->seed = seed;
	epj_ctx_seed(r->ctx, seed);
	r->B = epj_engine_micro_batch_size(r->engine);
	r->gas = epj_engine_grad_accum_steps(r->engine);
	r->T = o->seq;
	/* Tokens per step (and per resume skip) in checked arithmetic. */
	int64_t bt, tok;
	if (__builtin_mul_overflow(r->B, r->T, &bt) ||
	    __builtin_mul_overflow(bt, r->gas, &tok) || tok > TOKENS_MAX)
		return fail_msg("micro-batch %" PRId64 " x seq %" PRId64
				" x gradient accumulation %" PRId64
				" tokens per step is out of range: at most "
				"%" PRId64 " (2^40)",
				r->B, r->T, r->gas, TOKENS_MAX);

	int vocab = epj_model_vocab_size(r->model);
	/* --data and --split, else the config's "data" section */
	const char *cdata = cfg_str(r, "data.path"),
		   *csplit = cfg_str(r, "data.split");
	const char *data = o->data ? o->data : *cdata ? cdata : NULL;
	const char *split = o->split ? o->split : *csplit ? csplit : NULL;
	uint64_t dseed = mix64(seed);
	if (epj_config_given(r->cfg, "data.seed")) /* the config's */
		dseed = (uint64_t)cfg_int(r, "data.seed");
	r->data = data ? data : "synthetic";
	if (!data || !strcmp(data, "synthetic")) {
		r->corpus =
		    epj_corpus_synthetic(r->ctx, (uint32_t)vocab, mix64(seed));
		if (!r->corpus)
			return fail(r->ctx);
	} else if (has_suffix(data, ".txt")) {
		if (text_corpus(r, data))
			return 1;
	} else if (epj_data_spec_p(data)) {
		/* Megatron prefix, .npy or blend: tokens are checked against
		 * the model's vocabulary as they are read */
		epj_data_opts dopt = { .split = split,
				       .seed = dseed,
				       .vocab = (uint32_t)vocab };
		r->corpus = epj_corpus_dataset(r->ctx, data, &dopt);
		if (!r->corpus)
			return fail(r->ctx);
	} else {
		r->corpus = epj_corpus_from_tokens(r->ctx, data);
		if (!r->corpus)
			return fail(r->ctx);
	}
	if (split && epj_corpus_split_tokens(r->corpus, 0) == UINT64_MAX)
		return fail_msg("--split (or data.split) applies to token "
				"datasets, not to --data %s",
				data ? data : "synthetic");
	/* The held-out evaluation reads a dataset's validation split; one
	 * too short for a sample falls back to the train split from its
	 * start (as other corpora restart their stream). */
	r->eval_stream = EVAL_STREAM;
	uint64_t vt = epj_corpus_split_tokens(r->corpus, 1);
	if (vt <= (uint64_t)r->T) {
		r->eval_stream = 0;
		if (epj_dist_rank() == 0)
			fprintf(stderr,
				PROG ": note: the validation split of %s holds "
				     "%" PRIu64 " tokens, fewer than seq + 1; "
				     "evaluating on the train split\n",
				data, vt);
	}
	/* A token id >= vocab would fail in the embedding: say why now. */
	if (epj_corpus_vocab(r->corpus) > (uint32_t)vocab)
		return fail_msg("%s: token vocabulary %u exceeds the model's "
				"vocab_size %d",
				data, epj_corpus_vocab(r->corpus), vocab);
	return batch_banner(r);
}

/* A dataset with a loss mask (SFT) trains on its counted tokens with the
 * per-token loss; the banner says what the batches become.  0 or 1. */
static int batch_banner(run *r)
{
	epj_batch_opts b;
	epj_engine_batch_opts(r->engine, &b);
	bool mask = epj_corpus_has_loss_mask(r->corpus);
	if (mask && !b.per_token_loss) {
		b.per_token_loss = true;
		if (epj_engine_set_batch_opts(r->engine, &b) != EPJ_OK)
			return fail(r->ctx);
	}
	if (epj_dist_rank() != 0 ||
	    !(mask || b.per_token_loss || b.reset_attention_mask ||
	      b.reset_position_ids))
		return 0;
	printf(PROG ": batches: %s%s%s%sloss %s\n",
	       mask ? "the data's loss mask, " : "",
	       b.reset_attention_mask ? "documents do not see each other, "
				      : "",
	       b.reset_position_ids ? "positions restart per document, " : "",
	       b.eod_mask_loss ? "no loss at end-of-document inputs, " : "",
	       b.per_token_loss ? "per token over the global batch"
				: "mean of micro-batch means");
	if (b.reset_attention_mask || b.reset_position_ids || b.eod_mask_loss)
		printf(PROG ": batches: end-of-document token %" PRId64 "\n",
		       b.eod_token);
	return 0;
}

/* After --load: drops the micro-batches the saved run consumed, so that
 * the stream continues where it stopped (the corpus is deterministic).
 * The position is the checkpoint's micro-step (micro-batches per rank)
 * times this run's world: the same stream position as the saved run's
 * when the world is the one it was saved with, and when epjit-ckpt
 * reshard rewrote the micro-step for this world. */
static int skip_consumed(run *r, const char *path)
{
	/* a micro-step out of line with the step (a damaged or edited file)
	 * would skip that many batches, for hours: refuse it.  A run stops
	 * between optimizer steps, or (an error, a library user's save)
	 * between the micro-batches of one: step x gas + [0, gas). */
	int64_t step = epj_engine_step_count(r->engine),
		micro = epj_engine_micro_step_count(r->engine), lo;
	if (__builtin_mul_overflow(step, r->gas, &lo) || micro < lo ||
	    micro - lo >= r->gas) {
		char want[64];
		if (r->gas > 1)
			snprintf(want, sizeof want, "%" PRId64 " to %" PRId64,
				 lo, lo + r->gas - 1);
		else
			snprintf(want, sizeof want, "%" PRId64, lo);
		return fail_msg(
		    "%s: inconsistent counters: micro_step %" PRId64
		    " with step %" PRId64 " and this run's "
		    "gradient_accumulation_steps %" PRId64 "; expected "
		    "micro_step %s (step x gradient_accumulation_steps, up "
		    "to a stop between the micro-batches of a step): a "
		    "damaged checkpoint, or one saved with another gradient "
		    "accumulation or world size (epjit-ckpt reshard rewrites "
		    "it for a new world)",
		    path, micro, step, r->gas, want);
	}
	int64_t n;
	if (__builtin_mul_overflow(epj_engine_micro_step_count(r->engine),
				   (int64_t)epj_dist_size(), &n))
		return fail_msg("the checkpoint's micro-step %" PRId64
				" times %d ranks overflows the data position",
				epj_engine_micro_step_count(r->engine),
				epj_dist_size());
	if (epj_corpus_skip(r->ctx, r->corpus, n, r->B, r->T) != EPJ_OK)
		return fail(r->ctx);
	return 0;
}

/* ---- --dump-state ---- */

/* Adds t cast to f32 (a new tensor when it is not f32) under name. */
static epj_status add_f32(epj_ctx *ctx, epj_st_writer *w, const char *name,
			  epj_tensor *t)
{
	epj_tensor *c = epj_tensor_dtype(t) == EPJ_DTYPE_F32
			    ? epj_tensor_ref(t)
			    : epj_cast(ctx, t, EPJ_DTYPE_F32);
	epj_status st = EPJ_ERR_INVALID;
	if (c)
		st = epj_st_writer_add(w, name, c);
	else if (epj_ctx_status(ctx) != EPJ_OK)
		st = epj_ctx_status(ctx);
	epj_tensor_free(c);
	return st;
}

/* One forward and backward of the model (grads on, no optimizer step) on
 * the next batch; writes input_ids, labels (i64 [B,T]), logits (f32
 * [B,T,V]), loss (f32 []), every parameter (f32, HF name) and its gradient
 * (f32, HF name + ".grad"; zeros when it got none; none for a buffer). */
/* --emit-cuda DIR: trace every region at the run's batch shape (one CPU
 * forward and backward, no optimizer step) and write each graph's CUDA C
 * with its NVRTC options; --nvrtc-check compiles them too. */
static int emit_cuda(run *r, const opts *o)
{
	epj_tensor *ids = NULL, *lab = NULL;
	if (epj_corpus_next_batch(r->ctx, r->corpus, r->B, r->T, &ids, &lab) !=
	    EPJ_OK)
		return fail(r->ctx);
	int n = 0;
	epj_status st = epj_engine_emit_cuda(r->engine, ids, lab, o->emit_cuda,
					     o->nvrtc_check, &n);
	epj_tensor_free(ids);
	epj_tensor_free(lab);
	if (st != EPJ_OK)
		return fail(r->ctx);
	printf(PROG ": wrote %d CUDA C unit%s (mode %s, %d region%s, batch "
		    "%" PRId64 " x %" PRId64 ") to %s%s\n",
	       n, n == 1 ? "" : "s", epj_engine_compile_mode(r->engine),
	       epj_engine_num_regions(r->engine),
	       epj_engine_num_regions(r->engine) == 1 ? "" : "s", r->B, r->T,
	       o->emit_cuda,
	       o->nvrtc_check ? "; each compiles under NVRTC without warnings"
			      : "");
	return 0;
}

/* --dump-batch: input_ids and labels, I64 [B, T] of one shape, ids in
 * [0, vocab), labels in [0, vocab) or -100, from a safetensors file.
 * 0, or 1 with the error printed. */
static int read_batch(run *r, const char *path, epj_tensor **ids,
		      epj_tensor **lab)
{
	epj_ctx *ctx = r->ctx;
	epj_st_file *f = NULL;
	*ids = *lab = NULL;
	if (epj_st_open(ctx, path, &f) != EPJ_OK)
		return fail(ctx);
	const char *nm[2] = { "input_ids", "labels" };
	epj_tensor **t[2] = { ids, lab };
	int rc = 0;
	for (int k = 0; k < 2 && rc == 0; k++) {
		*t[k] = epj_st_get(ctx, f, nm[k]);
		if (!*t[k])
			rc = fail(ctx);
		else if (epj_tensor_dtype(*t[k]) != EPJ_DTYPE_I64 ||
			 epj_tensor_ndim(*t[k]) != 2 ||
			 epj_tensor_numel(*t[k]) == 0)
			rc = fail_msg("--dump-batch %s: \"%s\" must be a "
				      "non-empty I64 [B, T] tensor",
				      path, nm[k]);
	}
	epj_st_close(f);
	if (rc == 0 && (epj_tensor_dim(*ids, 0) != epj_tensor_dim(*lab, 0) ||
			epj_tensor_dim(*ids, 1) != epj_tensor_dim(*lab, 1)))
		rc = fail_msg("--dump-batch %s: labels must have the shape of "
			      "input_ids",
			      path);
	const double V = epj_model_vocab_size(r->model);
	for (int64_t i = 0; rc == 0 && i < epj_tensor_numel(*ids); i++) {
		double a = epj_tensor_get_f64(*ids, i);
		double b = epj_tensor_get_f64(*lab, i);
		if (a < 0 || a >= V || ((b < 0 || b >= V) && b != -100))
			rc = fail_msg("--dump-batch %s: element %" PRId64
				      ": token %.0f or label %.0f is outside "
				      "the vocabulary [0, %.0f)",
				      path, i, a, b, V);
	}
	if (rc != 0) {
		epj_tensor_free(*ids);
		epj_tensor_free(*lab);
		*ids = *lab = NULL;
	}
	return rc;
}

static int dump_state(run *r, const char *path, const char *batch)
{
	epj_ctx *ctx = r->ctx;
	epj_model *m = r->model;
	epj_tensor *ids = NULL, *lab = NULL, *logits = NULL, *loss = NULL;
	epj_st_writer *w = NULL;
	for (int i = 0; i < epj_model_num_params(m); i++)
		epj_tensor_set_grad(epj_model_param(m, i), NULL);
	if (batch && read_batch(r, batch, &ids, &lab))
		return 1;
	epj_status st = batch ? EPJ_OK
			      : epj_corpus_next_batch(ctx, r->corpus, r->B,
						      r->T, &ids, &lab);
	if (st == EPJ_OK)
		st = epj_engine_forward(r->engine, ids, lab, &logits, &loss);
	if (st == EPJ_OK)
		st = epj_backward(ctx, loss, NULL);
	if (st == EPJ_OK)
		st = epj_st_writer_new(ctx, &w);
	bool prev = epj_no_grad_enter(ctx);
	if (st == EPJ_OK)
		st = epj_st_writer_add(w, "input_ids", ids);
	if (st == EPJ_OK)
		st = epj_st_writer_add(w, "labels", lab);
	if (st == EPJ_OK)
		st = add_f32(ctx, w, "logits", logits);
	if (st == EPJ_OK)
		st = add_f32(ctx, w, "loss", loss);
	for (int i = 0; st == EPJ_OK && i < epj_model_num_params(m); i++) {
		epj_tensor *p = epj_model_param(m, i);
		const char *nm = epj_model_param_name(m, i);
		char gname[512];
		snprintf(gname, sizeof gname, "%s.grad", nm);
		st = add_f32(ctx, w, nm, p);
		/* a buffer (untrained state: DeepSeek-V3's score bias) has
		 * no gradient to write */
		if (!epj_tensor_requires_grad(p))
			continue;
		/* A parameter that got no gradient (an expert no token was
		 * routed to) has a zero gradient. */
		epj_tensor *g = epj_tensor_grad(p), *z = NULL;
		if (!g)
			g = z =
			    epj_zeros(ctx, EPJ_DTYPE_F32, epj_tensor_ndim(p),
				      epj_tensor_shape(p));
		if (st == EPJ_OK)
			st = add_f32(ctx, w, gname, g);
		epj_tensor_free(z);
	}
	epj_no_grad_exit(ctx, prev);
	char seed[32];
	snprintf(seed, sizeof seed, "%" PRIu64, r->seed);
	if (st == EPJ_OK)
		st = epj_st_writer_set_metadata(w, "format",
						"epjit-train-dump-state-1");
	if (st == EPJ_OK)
		st = epj_st_writer_set_metadata(w, "seed", seed);
	if (st == EPJ_OK)
		st = epj_st_writer_set_metadata(
		    w, "bf16", cfg_bool(r, "bf16.enabled") ? "true" : "false");
	if (st == EPJ_OK)
		st = epj_st_writer_save(w, path);
	int rc = st == EPJ_OK ? 0 : fail(ctx);
	if (rc == 0)
		printf("dump-state: loss %.6f on input_ids [%" PRId64
		       ", %" PRId64 "], %d parameters, %" PRId64
		       " compiled kernel launches -> %s\n",
		       epj_tensor_get_f64(loss, 0), epj_tensor_dim(ids, 0),
		       epj_tensor_dim(ids, 1), epj_model_num_params(m),
		       epj_counter_get(ctx, "kernels.launched.compiled"), path);
	epj_st_writer_free(w);
	epj_tensor_free(loss);
	epj_tensor_free(logits);
	epj_tensor_free(lab);
	epj_tensor_free(ids);
	return rc;
}

/* ---- stop signals ----
 *
 * SIGTERM, SIGHUP and SIGUSR1 (the preemption notices of Slurm and of spot
 * machines, a closed terminal): finish the optimizer step under way, save
 * to --save through the end-of-run save, exit 143 (SIGTERM), 129 (SIGHUP)
 * or 0 (SIGUSR1, with a resume hint).  SIGPIPE, and EPIPE on stdout (its
 * reader went away: `| head`, a dead `tee`), is the same stop request,
 * exit 141: SIGPIPE never kills the process (its handler only records it,
 * from the start of main), and stdout goes to /dev/null after the first
 * failed write.  SIGINT: finish the step, save nothing, exit 130.  The
 * handler only records the signal, one bit each in g_signals (a lock-free
 * atomic: async-signal-safe); the training loop reads it between
 * micro-batches, where the ranks of a multi-rank run agree on it
 * (epj_dist_any), and acts on it between optimizer steps, so that all
 * stop after the same step and all take part in the save.  A signal other
 * than SIGPIPE that arrives once the run is stopping (STOP_BIT set, or
 * another such bit already there) ends the process at once, _exit(128 +
 * signo): the checkpoint write is atomic (temporary file + rename), so
 * --save then holds the previous checkpoint or the new one, never a part
 * of one, and the metrics file holds whole rows only because each row is
 * flushed as it is written.  A signal ignored when the trainer starts
 * (SIG_IGN, as a shell without job control leaves SIGINT for a background
 * job, or nohup SIGHUP) stays ignored. */

enum {
	SIG_BIT_USR1 = 1u,
	SIG_BIT_TERM = 2u,
	SIG_BIT_INT = 4u,
	STOP_BIT = 8u, /* the run is stopping: the next signal exits */
	SIG_BIT_HUP = 16u,
	SIG_BIT_PIPE = 32u, /* SIGPIPE, or EPIPE on stdout */
	/* in the agreement only: an error on the rank ends the run */
	ERR_BIT = 64u,
	/* in the agreement only: the rank's background save is writing */
	SAVE_BUSY_BIT = 128u,
};

_Static_assert(ATOMIC_INT_LOCK_FREE == 2,
	       "the signal flags must be lock-free to be set in a handler");
static atomic_uint g_signals;

static void on_stop_signal(int sig)
{
	unsigned bit = sig == SIGINT	? SIG_BIT_INT
		       : sig == SIGTERM ? SIG_BIT_TERM
		       : sig == SIGHUP	? SIG_BIT_HUP
					: SIG_BIT_USR1;
	/* a SIGPIPE before (one per write to a closed pipe) is no reason to
	 * exit on the first real signal */
	if ((atomic_fetch_or(&g_signals, bit) & ~SIG_BIT_PIPE) == 0)
		return;
	static const char msg[] = PROG ": second signal: exiting now\n";
	if (write(STDERR_FILENO, msg, sizeof msg - 1) < 0) {
		/* nothing to do: the process ends either way */
	}
	_exit(128 + sig);
}

/* SIGPIPE: a stop request, never a second signal (every later write to
 * the pipe raises another). */
static void on_sigpipe(int sig)
{
	(void)sig;
	atomic_fetch_or(&g_signals, SIG_BIT_PIPE);
}

/* From the start of main: no write to a closed pipe kills the process.  A
 * handler rather than SIG_IGN, so that programs the library starts (host
 * compilers) get the default action back at exec.  A SIGPIPE ignored by
 * the caller stays ignored. */
static void sigpipe_install(void)
{
	struct sigaction sa, old;
	if (sigaction(SIGPIPE, NULL, &old) == 0 && old.sa_handler == SIG_IGN)
		return;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_sigpipe;
	sa.sa_flags = SA_RESTART;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGPIPE, &sa, NULL);
}

static const char *sig_name(int sig)
{
	return sig == SIGINT	? "SIGINT"
	       : sig == SIGTERM ? "SIGTERM"
	       : sig == SIGHUP	? "SIGHUP"
	       : sig == SIGPIPE ? "SIGPIPE"
				: "SIGUSR1";
}

/* Installs on_stop_signal for SIGTERM, SIGHUP, SIGUSR1 and SIGINT (each
 * blocked while the handler runs; SA_RESTART, so that the reads, writes
 * and waits of a step or a save resume instead of failing with EINTR). */
static int stop_signals_install(void)
{
	static const int sigs[4] = { SIGTERM, SIGHUP, SIGUSR1, SIGINT };
	struct sigaction sa, old;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_stop_signal;
	sa.sa_flags = SA_RESTART;
	sigemptyset(&sa.sa_mask);
	for (int i = 0; i < 4; i++)
		sigaddset(&sa.sa_mask, sigs[i]);
	for (int i = 0; i < 4; i++) {
		if (sigaction(sigs[i], NULL, &old) == 0 &&
		    old.sa_handler == SIG_IGN)
			continue;
		if (sigaction(sigs[i], &sa, NULL) != 0)
			return fail_msg("sigaction(%s): %s", sig_name(sigs[i]),
					strerror(errno));
	}
	return 0;
}

/* Set once stdout failed: it then writes to /dev/null, and what the run
 * still has to say goes to stderr (where_to). */
static bool g_stdout_dead;

/* After a write to stdout: a failed one (EPIPE: the reader went away;
 * anything else, e.g. a full disk: one warning) sends stdout to /dev/null
 * from then on, so that no later write fails; EPIPE also asks the run to
 * stop as SIGPIPE does. */
static void stdout_check(void)
{
	if (g_stdout_dead)
		return;
	errno = 0;
	if (fflush(stdout) == 0 && !ferror(stdout))
		return;
	int err = errno;
	g_stdout_dead = true;
	__fpurge(stdout);
	clearerr(stdout);
	int fd = open("/dev/null", O_WRONLY);
	if (fd >= 0) {
		dup2(fd, STDOUT_FILENO);
		close(fd);
	}
	if (err == EPIPE) {
		atomic_fetch_or(&g_signals, SIG_BIT_PIPE);
		return;
	}
	fprintf(stderr,
		PROG ": warning: stdout: write failed: %s; no more output "
		     "there, training goes on\n",
		err ? strerror(err) : "unknown error");
	fflush(stderr);
}

/* stdout, or stderr once stdout failed. */
static FILE *where_to(void)
{
	return g_stdout_dead ? stderr : stdout;
}

/* Between two micro-batches (every rank at the same point): the ranks
 * agree on the signals and the errors any of them got (one all-reduce;
 * none on a world of one).  *sig is the most urgent signal, 0 for none:
 * SIGINT, then SIGTERM, SIGHUP, SIGPIPE and SIGUSR1, so that they also
 * agree on whether to save; the run acts on it between optimizer steps.
 * An error on any rank sets r->failed on every rank.  A failed agreement
 * (a peer gone: the comm is broken) fails the run with no save.  It also
 * tells whether some rank's background save is still writing
 * (r->save_busy): until none is, no rank commits it. */
static int agree(run *r, int *sig)
{
	uint32_t any = 0, mine = atomic_load(&g_signals) & ~STOP_BIT;
	if (r->failed)
		mine |= ERR_BIT;
	if (epj_engine_save_pending(r->engine) == EPJ_SAVE_WRITING)
		mine |= SAVE_BUSY_BIT;
	if (epj_dist_any(r->engine, mine, &any) != EPJ_OK) {
		r->failed = r->no_rescue = true;
		return fail(r->ctx);
	}
	if ((any & ERR_BIT) && !r->failed) {
		r->failed = true;
		fail_msg("stopping: another rank failed (its message is "
			 "above, or in its --rank-log file)");
	}
	r->save_busy = any & SAVE_BUSY_BIT;
	*sig = any & SIG_BIT_INT    ? SIGINT
	       : any & SIG_BIT_TERM ? SIGTERM
	       : any & SIG_BIT_HUP  ? SIGHUP
	       : any & SIG_BIT_PIPE ? SIGPIPE
	       : any & SIG_BIT_USR1 ? SIGUSR1
				    : 0;
	return r->failed;
}

/* At the end of a step where the ranks agreed on *sig: the run stops. */
static void stop_say(run *r, const opts *o, int sig)
{
	atomic_fetch_or(&g_signals, STOP_BIT);
	if (epj_dist_rank() == 0 || o->rank_log) {
		fprintf(stderr,
			PROG ": %s: stopping after step %" PRId64 "%s\n",
			sig_name(sig), epj_engine_step_count(r->engine),
			sig == SIGPIPE ? " (stdout or a pipe was closed)" : "");
		fflush(stderr);
	}
}

/* Prints s to fp, in single quotes for a POSIX shell unless it is made of
 * characters that need none. */
static void put_shell_word(FILE *fp, const char *s)
{
	static const char plain[] = "abcdefghijklmnopqrstuvwxyz"
				    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
				    "0123456789_-+=/.,:@%";
	if (*s && strspn(s, plain) == strlen(s)) {
		fputs(s, fp);
		return;
	}
	fputc('\'', fp);
	for (const char *c = s; *c; c++)
		if (*c == '\'')
			fputs("'\\''", fp);
		else
			fputc(*c, fp);
	fputc('\'', fp);
}

/* The program as the user ran it.  In a build tree libtool's wrapper
 * script (tools/epjit-train) runs the real binary as
 * /abs/tools/.libs/epjit-train (or .../.libs/lt-epjit-train), which cannot
 * find the uninstalled libepjit on its own: name the wrapper beside that
 * .libs folder instead, when it is there. */
static void put_program(FILE *fp, const char *argv0)
{
	const char *dot = strstr(argv0, "/.libs/");
	if (dot && !strchr(dot + 7, '/')) {
		const char *base = dot + 7;
		if (!strncmp(base, "lt-", 3))
			base += 3;
		char w[4096];
		snprintf(w, sizeof w, "%.*s/%s", (int)(dot - argv0), argv0,
			 base);
		if (is_file(w) && access(w, X_OK) == 0) {
			put_shell_word(fp, w);
			return;
		}
	}
	put_shell_word(fp, argv0);
}

/* "resume with: <this command line without its --load> --load PATH": the
 * same --steps goes on to the same end (--steps counts from the start).
 * Written to stderr in one piece, so that it is not cut by the output of
 * other ranks or streams. */
static void print_resume_hint(const opts *o, const char *path)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *fp = open_memstream(&buf, &len);
	if (!fp)
		fp = stderr;
	fputs(PROG ": resume with: ", fp);
	put_program(fp, o->argv[0]);
	for (int i = 1; i < o->argc; i++) {
		const char *a = o->argv[i];
		if (!strcmp(a, "--load")) {
			i++; /* and its value */
			continue;
		}
		if (!strncmp(a, "--load=", 7))
			continue;
		fputc(' ', fp);
		put_shell_word(fp, a);
	}
	fputs(" --load ", fp);
	put_shell_word(fp, path);
	if (epj_dist_size() > 1)
		fprintf(fp, "   (under mpirun, on %d ranks again)",
			epj_dist_size());
	fputc('\n', fp);
	if (o->metrics)
		fprintf(fp,
			PROG ": (that run rewrites --metrics %s: give it "
			     "another file to keep these rows)\n",
			o->metrics);
	if (fp != stderr && fclose(fp) == 0) {
		fputs(buf, stderr);
		fflush(stderr);
	}
	free(buf);
}

/* The checkpoint of the end of a run (--save), of a run stopped by a
 * signal, and of one that failed (rescue); its message goes to out (a
 * failed run says everything on stderr, in order). */
static int save_checkpoint(run *r, const char *path, FILE *out)
{
	if (epj_engine_save(r->engine, path) != EPJ_OK)
		return fail(r->ctx);
	r->saved_step = epj_engine_step_count(r->engine);
	fprintf(out, PROG ": saved step %" PRId64 " to %s%s\n", r->saved_step,
		path,
		epj_dist_size() > 1 ? " (the commit record of a set of one "
				      "file per rank)"
				    : "");
	fflush(out);
	return 0;
}

/* ---- periodic and background saves ----
 *
 * --save-every N saves to --save after every N-th optimizer step (not the
 * last one: the end of the run saves that).  A foreground save is
 * epj_engine_save, collective, the step waits for it.  A background save
 * (--save-async, or the config's checkpoint.writer.decoupled) copies the
 * state between the two steps and a writer thread of each rank writes its
 * file while the run goes on; the writer never communicates.  Each
 * agreement of the training loop carries a bit "my writer is still
 * writing"; at the first step boundary where no rank's is, every rank
 * calls epj_engine_save_finish: the ranks exchange their files' checksums,
 * rank 0 commits the record, they agree on it and prune.  A new save, the
 * end of the run, a stop signal and an error all finish the save in flight
 * first (waiting for the writers).  A failed save is an error of the run,
 * agreed like any other (the run saves what it can and exits 1). */

/* Whether the periodic save is due after the step just taken. */
static bool save_due(const run *r, const opts *o)
{
	int64_t step = epj_engine_step_count(r->engine);
	return o->save_every > 0 && step < o->steps &&
	       step % o->save_every == 0;
}

/* Finishes the background save in flight, if any (collective: every rank
 * calls it at the same point); says so.  0, or 1 with the error printed. */
static int finish_save(run *r, const opts *o)
{
	epj_engine *e = r->engine;
	bool say = epj_dist_rank() == 0 || o->rank_log;
	epj_save_state s = epj_engine_save_pending(e);
	if (s == EPJ_SAVE_NONE)
		return 0;
	/* this rank's writer, or another's at the last agreement */
	if ((s == EPJ_SAVE_WRITING || r->save_busy) && say) {
		fprintf(stderr,
			PROG ": waiting for the background save of step "
			     "%" PRId64 " to %s\n",
			r->bg_step, o->save);
		fflush(stderr);
	}
	int64_t step;
	if (epj_engine_save_finish(e, &step) != EPJ_OK)
		return fail(r->ctx);
	r->saved_step = step;
	FILE *out = where_to();
	fprintf(out, PROG ": saved step %" PRId64 " to %s (background save)\n",
		step, o->save);
	fflush(out);
	return 0;
}

/* The periodic save after the step just taken; 0, or 1 with the error
 * printed (an error of the run: agreed at the next boundary). */
static int periodic_save(run *r, const opts *o)
{
	if (!o->save_async && !cfg_bool(r, "checkpoint.writer.decoupled"))
		return save_checkpoint(r, o->save, where_to());
	if (finish_save(r, o)) /* at most one in flight */
		return 1;
	if (epj_engine_save_async(r->engine, o->save) != EPJ_OK)
		return fail(r->ctx);
	r->bg_step = epj_engine_step_count(r->engine);
	return 0;
}

/* The end of a run stopped by r->stop_sig, once the metrics file is
 * closed: SIGTERM, SIGHUP, SIGPIPE and SIGUSR1 save to --save and exit
 * 143, 129, 141 / 0; SIGINT saves nothing and exits 130.  No evaluation
 * and no summary: a preempted machine has seconds left. */
static int stop_run(run *r, const opts *o)
{
	int sig = r->stop_sig;
	bool say = epj_dist_rank() == 0 || o->rank_log;
	int64_t step = epj_engine_step_count(r->engine);
	bool none = step == r->step0;
	if (o->save && step == r->saved_step) {
		/* the periodic save of this step is committed already */
		if (say)
			print_resume_hint(o, o->save);
	} else if (sig == SIGINT || !o->save || none) {
		if (say)
			fprintf(stderr,
				PROG ": %s: no checkpoint written (%s)\n",
				sig_name(sig),
				sig == SIGINT ? "SIGINT does not save; "
						"SIGTERM, SIGHUP, SIGPIPE and "
						"SIGUSR1 save to --save"
				: none ? "no step taken: --save stays as it was"
				       : "no --save PATH");
	} else {
		if (save_checkpoint(r, o->save, where_to()))
			return 1;
		if (say)
			print_resume_hint(o, o->save);
	}
	r->stopped = true;
	return sig == SIGUSR1 ? 0 : 128 + sig;
}

/* ---- errors in a run ----
 *
 * An error once this process has taken an optimizer step (a --metrics or
 * csv_monitor write that failed, a bad token in a later batch or in an
 * --eval-every evaluation, a step that failed) would lose what the run
 * trained.  The ranks agree on it as on a stop signal (agree(): an error
 * on any rank sets r->failed on every rank at the same point), then every
 * rank takes part in saving a committed checkpoint of the last whole step
 * to --save, or without --save to RESCUE_NAME<step>.ckpt in the working
 * directory, and the run exits 1 naming the error and the resume command.
 * A state that is not finite is never saved (epj_engine_save refuses it,
 * naming the entry).  The save's own failure is printed, and the first
 * error stays the last line.  An error that may have left a peer inside a
 * collective (a failed step or evaluation with several ranks, a failed
 * agreement) saves nothing: the peers fail within comm.timeout_s. */

/* After r->failed (on every rank, agreed): saves when there is something
 * new to save; returns 1, the exit status. */
static int rescue(run *r, const opts *o)
{
	int64_t step = epj_engine_step_count(r->engine);
	bool say = epj_dist_rank() == 0 || o->rank_log;
	if (r->no_rescue || step <= r->step0 || step == r->saved_step)
		return 1;
	char def[128];
	snprintf(def, sizeof def, RESCUE_NAME "%" PRId64 ".ckpt", step);
	const char *path = o->save ? o->save : def;
	if (say) {
		fprintf(stderr,
			PROG ": the run failed after step %" PRId64
			     "; saving its state to %s%s\n",
			step, path, o->save ? "" : " (no --save PATH)");
		fflush(stderr);
	}
	if (save_checkpoint(r, path, stderr) == 0) {
		if (say)
			print_resume_hint(o, path);
	} else if (say) {
		fprintf(stderr,
			PROG ": the state after step %" PRId64
			     " was not saved\n",
			step);
	}
	if (say) {
		fprintf(stderr,
			PROG ": exiting with status 1 after step %" PRId64
			     ": %s\n",
			step, g_first_err[0] ? g_first_err : "an error");
		fflush(stderr);
	}
	return 1;
}

/* ---- training ---- */

/* The next micro-batch of this rank from corpus c (in ctx): with W ranks
 * the stream's batches go round-robin, rank r taking batches r, r + W,
 * r + 2W, ... (one global batch = W consecutive micro-batches of the
 * single-rank stream). */
static epj_status rank_batch(run *r, epj_ctx *ctx, epj_corpus *c,
			     epj_tensor **ids, epj_tensor **lab)
{
	int W = epj_dist_size(), me = epj_dist_rank();
	epj_status st = EPJ_OK;
	*ids = *lab = NULL;
	for (int k = 0; st == EPJ_OK && k < W; k++) {
		epj_tensor *a = NULL, *b = NULL;
		st = epj_corpus_next_batch(ctx, c, r->B, r->T, &a, &b);
		if (k == me) {
			*ids = a;
			*lab = b;
		} else {
			epj_tensor_free(a);
			epj_tensor_free(b);
		}
	}
	return st;
}

/* Hidden --fault kill|stop --fault-step S --fault-rank R (tests): rank R
 * kills itself (SIGKILL) or stops (SIGSTOP: a peer that vanished without
 * exiting) before optimizer step S, so the other ranks meet a dead peer in
 * that step's collectives. */
static void fault_inject(const opts *o, int64_t step)
{
	if (!o->fault || step != o->fault_step ||
	    epj_dist_rank() != o->fault_rank)
		return;
	fprintf(stderr, PROG ": rank %d: --fault %s before step %" PRId64 "\n",
		epj_dist_rank(), o->fault, step);
	fflush(stderr);
	raise(!strcmp(o->fault, "kill") ? SIGKILL : SIGSTOP);
}

/* Mean loss of EVAL_BATCHES micro-batches of a fresh fork of the corpus
 * (always the same batches, so successive evaluations compare).  A failed
 * forward with several ranks may leave a peer inside its collectives
 * (r->no_rescue); a bad batch or a loss that is not finite is the same on
 * every rank. */
static int evaluate(run *r, double *out)
{
	epj_corpus *ev = epj_corpus_fork(r->ctx, r->corpus, r->eval_stream);
	if (!ev)
		return fail(r->ctx);
	double sum = 0;
	int64_t tokens = 0; /* per-token: the counted labels */
	epj_batch_opts b;
	epj_engine_batch_opts(r->engine, &b);
	for (int i = 0; i < EVAL_BATCHES; i++) {
		epj_tensor *ids = NULL, *lab = NULL;
		double l = 0;
		int64_t n = 0;
		epj_status st =
		    epj_corpus_next_batch(r->ctx, ev, r->B, r->T, &ids, &lab);
		if (st == EPJ_OK) {
			st =
			    epj_engine_eval_tokens(r->engine, ids, lab, &l, &n);
			if (st != EPJ_OK && epj_dist_size() > 1)
				r->no_rescue = true;
		}
		epj_tensor_free(ids);
		epj_tensor_free(lab);
		if (st != EPJ_OK) {
			epj_corpus_free(ev);
			return fail(r->ctx);
		}
		/* per token: a batch's mean times its counted labels */
		sum += !b.per_token_loss ? l : n > 0 ? l * (double)n : 0;
		tokens += n;
	}
	epj_corpus_free(ev);
	/* per token: over the batches' counted labels (NaN when none) */
	*out = b.per_token_loss ? sum / (double)tokens : sum / EVAL_BATCHES;
	if (!isfinite(*out))
		return fail_msg("evaluation after step %" PRId64
				": the mean loss is %g (the weights are no "
				"longer finite: lower the learning rate)",
				epj_engine_step_count(r->engine), *out);
	return 0;
}

typedef struct train_stats {
	double first_loss; /* mean loss of the first step of this process */
	double last_loss;  /* of the last step */
	double window_loss;
	int64_t steps_done;	     /* optimizer steps run by this process */
	double seconds;		     /* training time */
	int64_t comm_bytes, comm_us; /* comm.* counters over the training */
} train_stats;

/* The monitors' events, as DeepSpeed names them ("Train/Samples/<metric>",
 * x = samples seen): csv_monitor's file of "A/B/c" is A_B_c.csv with the
 * header "step,c"; tensorboard's scalars carry them as tags. */
static const char *const mon_events[N_MON] = {
	"Train/Samples/train_loss",
	"Train/Samples/lr",
	"Train/Samples/grad_norm",
	"Train/Samples/tokens_per_s",
	"Train/Samples/step_time_ms",
	"Train/Samples/peak_alloc_bytes",
	"Train/Samples/compile_ms",
	/* memory: the largest over the ranks, and the rank (lowest on ties)
	 * that holds it (epj_dist_memory_max) */
	"Train/Samples/peak_alloc_rank",
	"Train/Samples/peak_reserved_bytes",
	"Train/Samples/peak_reserved_rank",
};

/* mkdir -p */
static int make_dirs(const char *dir)
{
	char p[4096];
	snprintf(p, sizeof p, "%s", dir);
	for (char *c = p + 1; *c; c++) {
		if (*c != '/')
			continue;
		*c = '\0';
		if (mkdir(p, 0755) != 0 && errno != EEXIST)
			return -1;
		*c = '/';
	}
	return mkdir(p, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

static int put_row(FILE **fpp, const char *what, const char *path,
		   const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* Appends one whole row to *fpp and flushes it.  When that fails (a full
 * disk): the file is cut back to its last whole row (best effort), closed
 * (*fpp NULL: nothing more is written there), and the error printed with
 * what, the file's path and errno; returns 1. */
static int put_row(FILE **fpp, const char *what, const char *path,
		   const char *fmt, ...)
{
	FILE *fp = *fpp;
	off_t at = ftello(fp);
	va_list ap;
	va_start(ap, fmt);
	errno = 0;
	int n = vfprintf(fp, fmt, ap);
	va_end(ap);
	int err = errno;
	if (n >= 0) {
		errno = 0;
		if (fflush(fp) == 0 && !ferror(fp))
			return 0;
		err = errno;
	}
	__fpurge(fp); /* what stdio holds of the row is not written later */
	if (at >= 0 && ftruncate(fileno(fp), at) != 0) {
		/* a device (/dev/full) or a file system that cannot: the
		 * row stays cut, and the error says so below */
	}
	fclose(fp);
	*fpp = NULL;
	return fail_msg("%s%s: write failed: %s", what, path,
			strerror(err ? err : EIO));
}

/* csv_monitor's file of event i under r->mon_dir. */
static void monitor_path(const run *r, int i, char *path, size_t n)
{
	char name[128];
	snprintf(name, sizeof name, "%s", mon_events[i]);
	for (char *c = name; *c; c++)
		if (*c == '/' || *c == ' ')
			*c = '_';
	snprintf(path, n, "%s/%s.csv", r->mon_dir, name);
}

/* The router losses that are on (epj_engine_router_loss: the model's
 * config.json and the config's moe section): their number, names and
 * values at the last step; their monitor event "Train/Samples/<name>" and
 * csv_monitor file. */
static int rl_count(const run *r, const char **names, double *values)
{
	int n = 0;
	while (n < N_RL &&
	       epj_engine_router_loss(r->engine, n, &names[n], &values[n]))
		n++;
	return n;
}

static void rl_monitor_path(const run *r, const char *name, char *path,
			    size_t n)
{
	snprintf(path, n, "%s/Train_Samples_%s.csv", r->mon_dir, name);
}

/* ", name" for each router loss (the --metrics header), or its values. */
static void rl_columns(const run *r, bool header, char *buf, size_t n)
{
	const char *nm[N_RL];
	double v[N_RL];
	int k = rl_count(r, nm, v);
	buf[0] = '\0';
	for (int i = 0; i < k; i++) {
		size_t l = strlen(buf);
		if (header)
			snprintf(buf + l, n - l, ",%s", nm[i]);
		else
			snprintf(buf + l, n - l, ",%.9g", v[i]);
	}
}

/* The router losses' csv_monitor files, opened as monitor_open opens the
 * others. */
static int rl_monitor_open(run *r)
{
	const char *nm[N_RL];
	double v[N_RL];
	int k = rl_count(r, nm, v);
	for (int i = 0; r->monitor[0] && i < k; i++) {
		char path[4400];
		rl_monitor_path(r, nm[i], path, sizeof path);
		r->rl_monitor[i] = fopen(path, "a");
		if (!r->rl_monitor[i])
			return fail_msg("csv_monitor: cannot open %s: %s", path,
					strerror(errno));
		if (ftello(r->rl_monitor[i]) == 0 &&
		    put_row(&r->rl_monitor[i], "csv_monitor: ", path,
			    "step,%s\n", nm[i]))
			return 1;
	}
	return 0;
}

/* The expert-load metrics, per MoE layer (doc/trainer.md, "Expert load"):
 * max / mean load, coefficient of variation, dead experts, as the events
 * Train/Samples/<name>_layer_<L> (L the decoder layer) and the --metrics
 * columns <name>_layer_<L>. */
#define N_LOAD 3
static const char *const load_names[N_LOAD] = { "moe_load_max_mean",
						"moe_load_cv",
						"moe_dead_experts" };

/* Event j of MoE layer i: "Train/Samples/moe_load_cv_layer_3". */
static void load_event(const run *r, int i, int j, char *buf, size_t n)
{
	epj_expert_load x;
	epj_engine_expert_load(r->engine, i, &x); /* x.layer: always */
	snprintf(buf, n, "Train/Samples/%s_layer_%d", load_names[j], x.layer);
}

/* csv_monitor's file of load event (i, j): Train_Samples_<...>.csv. */
static void load_path(const run *r, int i, int j, char *path, size_t n)
{
	char ev[128];
	load_event(r, i, j, ev, sizeof ev);
	for (char *c = ev; *c; c++)
		if (*c == '/')
			*c = '_';
	snprintf(path, n, "%s/%s.csv", r->mon_dir, ev);
}

/* The --metrics header's load columns (",moe_load_max_mean_layer_1,...")
 * or one row's values, malloc'ed ("" when the metrics are off); NULL when
 * out of memory. */
static char *load_columns(const run *r, bool header)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *fp = open_memstream(&buf, &len);
	if (!fp)
		return NULL;
	for (int i = 0; r->loads_on && i < r->n_moe; i++) {
		epj_expert_load x;
		bool valid = epj_engine_expert_load(r->engine, i, &x);
		for (int j = 0; j < N_LOAD; j++) {
			char ev[128];
			load_event(r, i, j, ev, sizeof ev);
			double v = !valid   ? NAN
				   : j == 0 ? x.max_over_mean
				   : j == 1 ? x.cv
					    : x.dead;
			if (header)
				fprintf(fp, ",%s", strrchr(ev, '/') + 1);
			else
				fprintf(fp, ",%.9g", v);
		}
	}
	if (fclose(fp) != 0) {
		free(buf);
		return NULL;
	}
	return buf;
}

/* Turns the expert-load metrics on when the run writes any record (on every
 * rank alike: the engine then reduces the loads every step). */
static void load_setup(run *r, const opts *o)
{
	char dir[4096];
	r->n_moe = epj_engine_num_moe_layers(r->engine);
	r->loads_on = r->n_moe > 0 &&
		      (o->metrics ||
		       epj_engine_csv_monitor_dir(r->engine, dir, sizeof dir) ||
		       epj_engine_tensorboard_dir(r->engine, dir, sizeof dir));
	epj_engine_track_expert_load(r->engine, r->loads_on);
}

/* Their csv_monitor files, opened as monitor_open opens the others. */
static int load_monitor_open(run *r)
{
	if (!r->loads_on || !r->monitor[0])
		return 0;
	r->load_mon = calloc((size_t)r->n_moe * N_LOAD, sizeof *r->load_mon);
	if (!r->load_mon)
		return fail_msg("csv_monitor: out of memory");
	for (int k = 0; k < r->n_moe * N_LOAD; k++) {
		char path[4400], ev[128];
		load_path(r, k / N_LOAD, k % N_LOAD, path, sizeof path);
		load_event(r, k / N_LOAD, k % N_LOAD, ev, sizeof ev);
		r->load_mon[k] = fopen(path, "a");
		if (!r->load_mon[k])
			return fail_msg("csv_monitor: cannot open %s: %s", path,
					strerror(errno));
		if (ftello(r->load_mon[k]) == 0 &&
		    put_row(&r->load_mon[k], "csv_monitor: ", path, "step,%s\n",
			    strrchr(ev, '/') + 1))
			return 1;
	}
	return 0;
}

/* One step's load events: the csv_monitor rows and the tensorboard
 * scalars (wt: the events' wall time, tb_bad: a tensorboard write
 * failed); 1 when a csv_monitor write failed. */
static int load_record(run *r, int64_t samples, double wt, int *tb_bad)
{
	for (int i = 0; r->loads_on && i < r->n_moe; i++) {
		epj_expert_load x;
		if (!epj_engine_expert_load(r->engine, i, &x))
			continue;
		const double v[N_LOAD] = { x.max_over_mean, x.cv, x.dead };
		for (int j = 0; j < N_LOAD; j++) {
			char ev[128], path[4400];
			load_event(r, i, j, ev, sizeof ev);
			FILE **f =
			    r->load_mon ? &r->load_mon[i * N_LOAD + j] : NULL;
			if (f && *f) {
				load_path(r, i, j, path, sizeof path);
				if (put_row(f, "csv_monitor: ", path,
					    "%" PRId64 ",%.9g\n", samples,
					    v[j]))
					return 1;
			}
			if (r->tb && !*tb_bad)
				*tb_bad = tb_writer_scalar(r->tb, wt, samples,
							   ev, (float)v[j]);
		}
	}
	return 0;
}

/* One step's router-loss events, as load_record's: a csv_monitor row of
 * each at x = samples and their tensorboard scalars; 1 when a csv_monitor
 * write failed. */
static int rl_record(run *r, int64_t samples, double wt, int *tb_bad)
{
	const char *nm[N_RL];
	double v[N_RL];
	int k = rl_count(r, nm, v);
	for (int i = 0; i < k; i++) {
		char path[4400], ev[64];
		snprintf(ev, sizeof ev, "Train/Samples/%s", nm[i]);
		if (r->tb && !*tb_bad)
			*tb_bad = tb_writer_scalar(r->tb, wt, samples, ev,
						   (float)v[i]);
		if (!r->rl_monitor[i])
			continue;
		rl_monitor_path(r, nm[i], path, sizeof path);
		if (put_row(&r->rl_monitor[i], "csv_monitor: ", path,
			    "%" PRId64 ",%.9g\n", samples, v[i]))
			return 1;
	}
	return 0;
}

/* Opens the csv_monitor files when the config enables it (appending, as
 * DeepSpeed does; a header, written through, when a file is new); rank 0
 * only, as DeepSpeed's monitors, so that ranks do not append the same
 * rows.  Any failure fails the run before step 1. */
static int monitor_open(run *r)
{
	if (!epj_engine_csv_monitor_dir(r->engine, r->mon_dir,
					sizeof r->mon_dir) ||
	    epj_dist_rank() != 0)
		return 0;
	if (make_dirs(r->mon_dir) != 0)
		return fail_msg("csv_monitor: cannot create %s: %s", r->mon_dir,
				strerror(errno));
	for (int i = 0; i < N_MON; i++) {
		char path[4400];
		monitor_path(r, i, path, sizeof path);
		r->monitor[i] = fopen(path, "a");
		if (!r->monitor[i])
			return fail_msg("csv_monitor: cannot open %s: %s", path,
					strerror(errno));
		if (ftello(r->monitor[i]) == 0 &&
		    put_row(&r->monitor[i], "csv_monitor: ", path, "step,%s\n",
			    strrchr(mon_events[i], '/') + 1))
			return 1;
	}
	if (rl_monitor_open(r))
		return 1;
	fprintf(where_to(),
		PROG ": csv_monitor: writing %s/Train_Samples_*.csv\n",
		r->mon_dir);
	stdout_check();
	return 0;
}

/* Seconds since the epoch: an event's wall_time. */
static double wall_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Opens the tensorboard event file when the config enables it; rank 0
 * only, as DeepSpeed's TensorBoardMonitor.  Like the csv_monitor files, a
 * folder or file that cannot be created fails the run before step 1. */
static int tb_open(run *r)
{
	char dir[4096], err[4600];
	if (!epj_engine_tensorboard_dir(r->engine, dir, sizeof dir) ||
	    epj_dist_rank() != 0)
		return 0;
	if (make_dirs(dir) != 0)
		return fail_msg("tensorboard: cannot create %s: %s", dir,
				strerror(errno));
	r->tb = tb_writer_open(dir, wall_s(), err, sizeof err);
	if (!r->tb)
		return fail_msg("tensorboard: %s", err);
	fprintf(where_to(), PROG ": tensorboard: writing %s\n",
		tb_writer_path(r->tb));
	stdout_check();
	return 0;
}

/* A failed write of the event file (disk full, ...) costs the TensorBoard
 * curves, not the run: one warning, then no more events. */
static void tb_drop(run *r, int err)
{
	fprintf(stderr,
		PROG ": warning: tensorboard: %s: write failed: %s; no more "
		     "events are written, training goes on\n",
		tb_writer_path(r->tb), strerror(err));
	tb_writer_close(r->tb);
	r->tb = NULL;
}

/* The training loop's clocks and windows. */
typedef struct loop_state {
	int64_t print_every, tok_per_step, compile_us;
	double t_start, t_win, t_step, win_sum, floor;
	int64_t win_n;
} loop_state;

/* The records of one optimizer step (info; t its end, ms the allocator
 * then): the --metrics row, the csv_monitor rows, the tensorboard events;
 * 1 when a --metrics or csv_monitor write failed. */
static int record_step(run *r, const opts *o, loop_state *ls,
		       const epj_step_info *info, double t,
		       const epj_dist_memory *ms)
{
	double step_s = t - ls->t_step;
	int64_t cus = epj_counter_get(r->ctx, "compile.us");
	double compile_ms = (double)(cus - ls->compile_us) / 1e3;
	ls->compile_us = cus;
	char rl[N_RL * 24];
	rl_columns(r, false, rl, sizeof rl);
	/* one whole row per write: a stopped or killed run leaves no cut
	 * row */
	char *lc = r->metrics ? load_columns(r, false) : NULL;
	if (r->metrics && !lc)
		return fail_msg("%s: out of memory", o->metrics);
	int bad_row =
	    r->metrics &&
	    put_row(&r->metrics, "", o->metrics,
		    "%" PRId64 ",%.9g,%.9g,%.9g,%.1f,%" PRIu64
		    ",%.3f,%.3f,%.6g,%d,%" PRIu64 ",%d%s%s\n",
		    info->step, info->mean_loss, info->lr, info->grad_norm,
		    (double)ls->tok_per_step / step_s, ms->peak_allocated,
		    step_s * 1e3, compile_ms, ls->floor,
		    ms->peak_allocated_rank, ms->peak_reserved,
		    ms->peak_reserved_rank, lc, rl);
	free(lc);
	if (bad_row)
		return 1;
	/* the monitors' events (mon_events), x = samples seen by the whole
	 * job, as DeepSpeed's global_samples: step x train_batch_size
	 * (micro-batch x accumulation x the data-parallel world, every rank
	 * here) */
	double v[N_MON] = { info->mean_loss, info->lr, info->grad_norm,
			    (double)ls->tok_per_step / step_s, step_s * 1e3,
			    (double)ms->peak_allocated, compile_ms,
			    /* the memory of every rank */
			    ms->peak_allocated_rank, (double)ms->peak_reserved,
			    ms->peak_reserved_rank };
	int64_t samples = info->step * r->B * r->gas * (int64_t)epj_dist_size();
	for (int i = 0; i < N_MON && r->monitor[i]; i++) {
		char path[4400];
		monitor_path(r, i, path, sizeof path);
		if (put_row(&r->monitor[i], "csv_monitor: ", path,
			    "%" PRId64 ",%.9g\n", samples, v[i]))
			return 1;
	}
	/* the step's events as whole records, flushed (a stopped or killed
	 * run leaves every finished step readable) */
	double wt = wall_s();
	int bad = 0;
	for (int i = 0; r->tb && i < N_MON && !bad; i++)
		bad = tb_writer_scalar(r->tb, wt, samples, mon_events[i],
				       (float)v[i]);
	if (load_record(r, samples, wt, &bad) ||
	    rl_record(r, samples, wt, &bad))
		return 1;
	if (r->tb && (tb_writer_flush(r->tb) != 0 || bad))
		tb_drop(r, errno);
	return 0;
}

/* After optimizer step info (not skipped): statistics, records, progress
 * line and --eval-every; 1 on an error (r->failed is then set). */
static int after_step(run *r, const opts *o, loop_state *ls, train_stats *ts,
		      const epj_step_info *info, double t,
		      const epj_dist_memory *ms)
{
	if (!isfinite(info->mean_loss))
		return fail_msg("step %" PRId64 ": loss is %g; "
				"lower the learning rate",
				info->step, info->mean_loss);
	if (ts->steps_done++ == 0)
		ts->first_loss = info->mean_loss;
	ts->last_loss = info->mean_loss;
	ls->win_sum += info->mean_loss;
	ls->win_n++;
	if (record_step(r, o, ls, info, t, ms))
		return 1;
	bool last = info->step >= o->steps;
	if (info->step % ls->print_every == 0 || last) {
		char buf[96];
		ts->window_loss = ls->win_sum / (double)ls->win_n;
		printf("step %6" PRId64 "/%ld  loss %.4f  lr %.3e  "
		       "grad_norm %.3f  tok/s %.0f  peak %.1f MiB  "
		       "reserved %.1f MiB%s\n",
		       info->step, o->steps, ts->window_loss, info->lr,
		       info->grad_norm,
		       (double)(ls->tok_per_step * ls->win_n) / (t - ls->t_win),
		       mib(ms->peak_allocated), mib(ms->reserved),
		       mem_ranks(ms, buf, sizeof buf));
		stdout_check();
		ls->win_sum = 0;
		ls->win_n = 0;
		ls->t_win = now_s();
	}
	if (o->eval_every > 0 && info->step % o->eval_every == 0 && !last) {
		double el, t0 = now_s();
		if (evaluate(r, &el))
			return 1;
		printf("step %6" PRId64 "  eval loss %.4f\n", info->step, el);
		stdout_check();
		/* The evaluation is not training time. */
		double dt = now_s() - t0;
		ls->t_start += dt;
		ls->t_win += dt;
	}
	return 0;
}

/* Trains to --steps, or until a stop signal (r->stop_sig) or an error (on
 * any rank: r->failed, return 1) ends the run after the same micro-batch
 * on every rank. */
static int train(run *r, const opts *o, train_stats *ts)
{
	epj_ctx *ctx = r->ctx;
	epj_engine *e = r->engine;
	loop_state ls = {
		.print_every = cfg_int(r, "steps_per_print"),
		.tok_per_step = r->B * r->T * r->gas,
		.compile_us = epj_counter_get(ctx, "compile.us"),
		.t_start = now_s(),
		.floor = epj_corpus_entropy_rate(r->corpus),
	};
	ls.t_win = ls.t_step = ls.t_start;
	*ts = (train_stats){ .first_loss = NAN,
			     .last_loss = NAN,
			     .window_loss = NAN };
	int64_t cb0 = epj_counter_get(ctx, "comm.bytes");
	int64_t cu0 = epj_counter_get(ctx, "comm.us");
	r->step0 = epj_engine_step_count(e);
	bool boundary = true; /* between two optimizer steps */
	for (;;) {
		bool done = boundary && epj_engine_step_count(e) >= o->steps;
		epj_tensor *ids = NULL, *lab = NULL;
		/* the micro-batch before the agreement: a bad one on any
		 * rank stops every rank before the step's collectives */
		if (!done && !r->failed &&
		    rank_batch(r, ctx, r->corpus, &ids, &lab) != EPJ_OK) {
			fail(ctx);
			r->failed = true;
		}
		/* a stop signal or an error on any rank: every rank stops
		 * here, after the same micro-batch; a signal after the same
		 * step (also after the last one: the ranks then agree on the
		 * end of the run) */
		int sig = 0;
		if (agree(r, &sig) || (boundary && (sig || done))) {
			epj_tensor_free(ids);
			epj_tensor_free(lab);
			if (!r->failed && sig) {
				r->stop_sig = sig;
				stop_say(r, o, sig);
			}
			break;
		}
		/* no rank's background writer is at work: every rank commits
		 * the save here (a failure is agreed at the next agreement) */
		if (boundary && !r->save_busy &&
		    epj_engine_save_pending(e) != EPJ_SAVE_NONE &&
		    finish_save(r, o)) {
			epj_tensor_free(ids);
			epj_tensor_free(lab);
			r->failed = true;
			continue;
		}
		epj_step_info info;
		fault_inject(o, epj_engine_step_count(e) + 1);
		epj_status st = epj_engine_train_step(e, ids, lab, &info);
		epj_tensor_free(ids);
		epj_tensor_free(lab);
		if (st != EPJ_OK) {
			/* with several ranks a peer may be inside the step's
			 * collectives: no agreement, no save */
			fail(ctx);
			r->failed = true;
			r->no_rescue = epj_dist_size() > 1;
			break;
		}
		boundary = info.stepped;
		if (!info.stepped)
			continue;
		double t = now_s();
		/* every rank's memory, before any rank may skip ahead (a
		 * collective: a failure leaves no agreement, no save) */
		epj_dist_memory ms;
		if (epj_dist_memory_max(e, &ms) != EPJ_OK) {
			fail(ctx);
			r->failed = true;
			r->no_rescue = epj_dist_size() > 1;
			break;
		}
		if (info.skipped)
			continue; /* warned and counted by the engine */
		if (after_step(r, o, &ls, ts, &info, t, &ms))
			r->failed = true; /* agreed at the top */
		ls.t_step = now_s();
		/* the save's time counts in the next step's (step_ms) */
		if (!r->failed && save_due(r, o) && periodic_save(r, o))
			r->failed = true; /* agreed at the top */
	}
	ts->seconds = now_s() - ls.t_start;
	ts->comm_bytes = epj_counter_get(ctx, "comm.bytes") - cb0;
	ts->comm_us = epj_counter_get(ctx, "comm.us") - cu0;
	return r->failed;
}

/* The counters of the run as a compact two-column table. */
static int print_counters(run *r)
{
	epj_counters *c = epj_counters_snapshot(r->ctx);
	if (!c)
		return fail(r->ctx);
	printf("counters:\n");
	for (int i = 0; i < epj_counters_count(c); i++)
		printf("  %-32s %" PRId64 "\n", epj_counters_name_at(c, i),
		       epj_counters_value_at(c, i));
	epj_counters_free(c);
	return 0;
}

static void run_free(run *r);

/* One optimizer step of engine e on the next batches of c (this rank's
 * share, as in training); wall ms. */
static epj_status timed_step(run *r, epj_engine *e, epj_ctx *ctx, epj_corpus *c,
			     double *ms)
{
	double t0 = now_s();
	for (int64_t k = 0; k < r->gas; k++) {
		epj_tensor *ids = NULL, *lab = NULL;
		epj_status st = rank_batch(r, ctx, c, &ids, &lab);
		epj_step_info info;
		if (st == EPJ_OK)
			st = epj_engine_train_step(e, ids, lab, &info);
		epj_tensor_free(ids);
		epj_tensor_free(lab);
		if (st != EPJ_OK)
			return st;
	}
	*ms = (now_s() - t0) * 1e3;
	return EPJ_OK;
}

static int cmp_dbl(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* Median of v[n] (sorts v). */
static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof *v, cmp_dbl);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int64_t launches(epj_ctx *ctx)
{
	return epj_counter_get(ctx, "kernels.launched.eager") +
	       epj_counter_get(ctx, "kernels.launched.compiled");
}

/* Removes dir and the files in it (a flat folder of our own). */
static void remove_dir(const char *dir)
{
	DIR *d = opendir(dir);
	if (d) {
		struct dirent *de;
		char p[4400];
		while ((de = readdir(d)))
			if (strcmp(de->d_name, ".") &&
			    strcmp(de->d_name, "..")) {
				snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
				unlink(p);
			}
		closedir(d);
	}
	rmdir(dir);
}

/* The compiled engine's state (weights, FP32 masters, optimizer state,
 * step) into the fresh eager engine e, through a checkpoint in a private
 * folder $TMPDIR/epjit-compare.<pid of rank 0> (the same path on every
 * rank: a save of several ranks is a set), removed afterwards. */
static int copy_state(run *r, run *e)
{
	const char *tmp = getenv("TMPDIR");
	char dir[4096], path[4200];
	uint32_t any = 0;
	if (epj_dist_any(r->engine,
			 epj_dist_rank() == 0 ? (uint32_t)getpid() : 0u,
			 &any) != EPJ_OK)
		return fail(r->ctx);
	snprintf(dir, sizeof dir, "%s/epjit-compare.%u",
		 tmp && *tmp ? tmp : "/tmp", any);
	snprintf(path, sizeof path, "%s/state.ckpt", dir);
	struct stat sb;
	if (mkdir(dir, 0700) != 0 && errno != EEXIST)
		return fail_msg("--compare-eager: cannot create %s: %s", dir,
				strerror(errno));
	/* not a planted link or somebody else's folder (ranks on one
	 * machine share it) */
	if (lstat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode) ||
	    sb.st_uid != getuid() || (sb.st_mode & 077))
		return fail_msg("--compare-eager: %s is not a private folder "
				"of this user",
				dir);
	epj_status st = epj_engine_save(r->engine, path);
	int rc = st == EPJ_OK ? 0 : fail(r->ctx);
	if (rc == 0 && epj_engine_load(e->engine, path) != EPJ_OK)
		rc = fail(e->ctx);
	/* every rank is past its load before any removes a file */
	uint32_t unused;
	if (rc == 0 && epj_dist_any(r->engine, 0, &unused) != EPJ_OK)
		rc = fail(r->ctx);
	remove_dir(dir);
	return rc;
}

/* Loss of engine en on the first evaluation batch of c's fork: the proof
 * that both arms start from the same weights. */
static int same_weights_loss(run *r, epj_engine *en, epj_ctx *ctx, double *loss)
{
	epj_corpus *ev = epj_corpus_fork(ctx, r->corpus, r->eval_stream);
	epj_tensor *ids = NULL, *lab = NULL;
	epj_status st =
	    ev ? epj_corpus_next_batch(ctx, ev, r->B, r->T, &ids, &lab)
	       : EPJ_ERR_INVALID;
	if (st == EPJ_OK)
		st = epj_engine_eval(en, ids, lab, loss);
	epj_tensor_free(ids);
	epj_tensor_free(lab);
	epj_corpus_free(ev);
	return st == EPJ_OK ? 0 : fail(ctx);
}

/* The arms' figures of --compare-eager. */
typedef struct cmp_arm {
	run *a;	       /* engine and context */
	epj_corpus *c; /* its stream of the run's batches */
	double t[COMPARE_ROUNDS * COMPARE_ROUND_STEPS]; /* step ms */
	int64_t l0, b0, u0; /* launches, comm bytes, comm us at the start */
	double med, mean, launches, comm_mib, comm_ms; /* per step */
	epj_memory_stats ms;
} cmp_arm;

_Static_assert(COMPARE_ROUND_STEPS <= 16, "compare_rounds' buffer");

/* The rounds: in round k arm (k even ? eager : compiled) takes
 * COMPARE_ROUND_STEPS steps, then the other arm the same steps on the same
 * batches (A B, B A, A B, ...); ratio[k] = compiled median / eager median
 * of round k. */
static int compare_rounds(run *r, cmp_arm arm[2], double *ratio)
{
	for (int k = 0; k < COMPARE_ROUNDS; k++) {
		double m[2];
		for (int j = 0; j < 2; j++) {
			cmp_arm *x = &arm[(j + k) % 2];
			double *t = x->t + k * COMPARE_ROUND_STEPS, w[16];
			for (int i = 0; i < COMPARE_ROUND_STEPS; i++)
				if (timed_step(r, x->a->engine, x->a->ctx, x->c,
					       &t[i]) != EPJ_OK)
					return fail(x->a->ctx);
			memcpy(w, t, COMPARE_ROUND_STEPS * sizeof *w);
			m[(j + k) % 2] = median(w, COMPARE_ROUND_STEPS);
		}
		ratio[k] = m[1] / m[0];
	}
	return 0;
}

static void compare_print(run *r, int64_t step, cmp_arm arm[2], double *ratio,
			  double le, double lc, int64_t frames)
{
	cmp_arm *E = &arm[0], *C = &arm[1];
	double lo = ratio[0], hi = ratio[0];
	for (int k = 1; k < COMPARE_ROUNDS; k++) {
		lo = fmin(lo, ratio[k]);
		hi = fmax(hi, ratio[k]);
	}
	double rm = median(ratio, COMPARE_ROUNDS);
	printf("compare: eager vs compiled (%s) from step %" PRId64
	       ", same weights (eval loss %.6f eager, %.6f compiled), same "
	       "batches (%s); %d rounds of %d steps per arm, alternating "
	       "which goes first:\n",
	       epj_engine_compile_mode(r->engine), step, le, lc, r->data,
	       COMPARE_ROUNDS, COMPARE_ROUND_STEPS);
	printf("compare:   %-24s %10s %10s %7s\n", "", "eager", "compiled",
	       "ratio");
	printf("compare:   %-24s %10.2f %10.2f %7.3f  (rounds %.3f..%.3f)\n",
	       "median step (ms)", E->med, C->med, rm, lo, hi);
	printf("compare:   %-24s %10.0f %10.0f %7.3f\n", "kernel launches/step",
	       E->launches, C->launches, C->launches / E->launches);
	printf("compare:   %-24s %10.2f %10.2f %7.3f\n", "peak allocated (MiB)",
	       mib(E->ms.peak_allocated), mib(C->ms.peak_allocated),
	       (double)C->ms.peak_allocated / (double)E->ms.peak_allocated);
	if (epj_dist_size() > 1) {
		/* this rank's collectives (bytes sent, wall time inside the
		 * calls, which includes waiting for the peers) */
		printf("compare:   %-24s %10.3f %10.3f\n", "comm MiB sent/step",
		       E->comm_mib, C->comm_mib);
		printf("compare:   %-24s %10.2f %10.2f\n", "comm ms/step",
		       E->comm_ms, C->comm_ms);
		printf("compare:   %-24s %10.1f %10.1f\n",
		       "comm share of step (%)", 100.0 * E->comm_ms / E->mean,
		       100.0 * C->comm_ms / C->mean);
	}
	printf("compare:   frames compiled while measuring: %" PRId64 "\n",
	       frames);
	printf("compare: compiled/eager step time %.3f (median of %d "
	       "rounds; spread %.3f..%.3f): %s\n",
	       rm, COMPARE_ROUNDS, lo, hi,
	       lo <= 1.0 && hi >= 1.0 ? "the spread crosses 1.0, no difference "
					"measurable"
	       : hi < 1.0	      ? "compiled is faster"
				      : "compiled is slower");
	stdout_check();
}

/* --compare-eager: the trained, compiled engine against a fresh eager
 * engine of the same model and config given the compiled engine's state
 * (the same weights, masters, optimizer state and step), on the same
 * batches (each arm reads the run's own data source from its start, this
 * rank's share), COMPARE_ROUNDS rounds of COMPARE_ROUND_STEPS steps per
 * arm alternating which arm goes first.  Prints the figures the run
 * observed: median step time and the median and spread of the rounds'
 * ratios, kernel launches per step, peak memory. */
static int compare_eager(run *r, const opts *o)
{
	run e = { .saved_step = -1 };
	static opts eo;
	eo = *o;
	eo.compile = false;
	if (epj_ctx_new(run_device(), &e.ctx) != EPJ_OK)
		return fail_msg("cannot create a %s context", run_device());
	cmp_arm arm[2] = { { .a = &e }, { .a = r } };
	double le = 0, lc = 0, ratio[COMPARE_ROUNDS], ms;
	int64_t step = epj_engine_step_count(r->engine);
	int rc = build_model_engine(&e, &eo, r->cfg, r->seed) != EPJ_OK
		     ? fail(e.ctx)
		     : 0;
	if (rc == 0)
		rc = copy_state(r, &e);
	if (rc == 0)
		rc = same_weights_loss(r, e.engine, e.ctx, &le) ||
		     same_weights_loss(r, r->engine, r->ctx, &lc);
	for (int j = 0; rc == 0 && j < 2; j++) {
		arm[j].c = epj_corpus_fork(arm[j].a->ctx, r->corpus, 0);
		if (!arm[j].c)
			rc = fail(arm[j].a->ctx);
	}
	/* one warm-up step each (the eager arm's allocator cache) */
	for (int j = 0; rc == 0 && j < 2; j++)
		if (timed_step(r, arm[j].a->engine, arm[j].a->ctx, arm[j].c,
			       &ms) != EPJ_OK)
			rc = fail(arm[j].a->ctx);
	for (int j = 0; rc == 0 && j < 2; j++) {
		epj_memory_reset_peaks(arm[j].a->ctx);
		arm[j].l0 = launches(arm[j].a->ctx);
		arm[j].b0 = epj_counter_get(arm[j].a->ctx, "comm.bytes");
		arm[j].u0 = epj_counter_get(arm[j].a->ctx, "comm.us");
	}
	int64_t f0 = epj_counter_get(r->ctx, "frames.total");
	if (rc == 0)
		rc = compare_rounds(r, arm, ratio);
	const double n = COMPARE_ROUNDS * COMPARE_ROUND_STEPS;
	for (int j = 0; rc == 0 && j < 2; j++) {
		epj_ctx *c = arm[j].a->ctx;
		arm[j].launches = (double)(launches(c) - arm[j].l0) / n;
		arm[j].comm_mib =
		    mib((uint64_t)(epj_counter_get(c, "comm.bytes") -
				   arm[j].b0)) /
		    n;
		arm[j].comm_ms =
		    1e-3 * (double)(epj_counter_get(c, "comm.us") - arm[j].u0) /
		    n;
		arm[j].mean = 0;
		for (int i = 0; i < (int)n; i++)
			arm[j].mean += arm[j].t[i] / n;
		arm[j].med = median(arm[j].t, (int)n);
		epj_memory_stats_get(c, &arm[j].ms);
	}
	if (rc == 0) {
		compare_print(r, step, arm, ratio, le, lc,
			      epj_counter_get(r->ctx, "frames.total") - f0);
	}
	epj_corpus_free(arm[0].c);
	epj_corpus_free(arm[1].c);
	run_free(&e);
	return rc;
}

/* --parity: the library's harness; prints its table, exits 1 on failure. */
static int run_parity(const opts *o)
{
	epj_parity_opts po = {
		.model_config = o->model_path ? o->model_cfg : NULL,
		.layout = o->layout,
		.checkpointing = o->checkpointing,
		.bf16 = o->bf16,
		.regional = !o->full_model,
		.async_split_plan = o->async_plan,
		.batch = 2,
		.seq = o->seq > 0 && o->seq != DEFAULT_SEQ ? o->seq : 16,
		.seed = o->seed_given ? o->seed : 42
	};
	bool passed = false;
	if (epj_parity_run(&po, stdout, &passed) != EPJ_OK)
		return fail_msg("parity: could not run (see above)");
	return passed ? 0 : 1;
}

/* Under mpirun: rank 0 prints; the others print only errors, unless
 * --rank-log PREFIX sends the stdout and stderr of every rank but 0 to
 * PREFIX.rank<N>.log. */
static int rank_output(const opts *o)
{
	int W = epj_dist_size(), me = epj_dist_rank();
	if (W == 1 || me == 0)
		return 0;
	const char *path = "/dev/null";
	char buf[4096];
	if (o->rank_log) {
		snprintf(buf, sizeof buf, "%s.rank%d.log", o->rank_log, me);
		path = buf;
	}
	fflush(stdout);
	fflush(stderr);
	if (!freopen(path, "w", stdout))
		return fail_msg("%s: cannot open for writing: %s", path,
				strerror(errno));
	if (o->rank_log && dup2(fileno(stdout), fileno(stderr)) < 0)
		return fail_msg("%s: cannot redirect stderr: %s", path,
				strerror(errno));
	setvbuf(stdout, NULL, _IOLBF, 0);
	return 0;
}

static void run_free(run *r)
{
	if (r->metrics)
		fclose(r->metrics);
	for (int i = 0; i < N_MON; i++)
		if (r->monitor[i])
			fclose(r->monitor[i]);
	for (int k = 0; r->load_mon && k < r->n_moe * N_LOAD; k++)
		if (r->load_mon[k])
			fclose(r->load_mon[k]);
	free(r->load_mon);
	for (int i = 0; i < N_RL; i++)
		if (r->rl_monitor[i])
			fclose(r->rl_monitor[i]);
	if (r->tb && tb_writer_close(r->tb) != 0)
		fprintf(stderr,
			PROG ": warning: tensorboard: closing the event file "
			     "failed: %s\n",
			strerror(errno));
	epj_corpus_free(r->corpus);
	epj_engine_free(r->engine);
	epj_model_free(r->model);
	epj_config_free(r->cfg);
	epj_ctx_free(r->ctx);
}

/* The starting weights, once the engine is built: --load CKPT, else the
 * --model folder's (model.safetensors[.index.json]), else the random
 * initialisation from the run seed; what it was goes to r->weights. */
static int load_weights(run *r, const opts *o)
{
	if (o->load) {
		if (epj_engine_load(r->engine, o->load) != EPJ_OK)
			return fail(r->ctx);
		snprintf(r->weights, sizeof r->weights,
			 "%s (--load, step %" PRId64 ")", o->load,
			 epj_engine_step_count(r->engine));
	} else if (o->weights_dir[0]) {
		char f[4200];
		weights_file(o, f, sizeof f);
		if (epj_engine_load(r->engine, o->weights_dir) != EPJ_OK)
			return fail(r->ctx);
		snprintf(r->weights, sizeof r->weights, "%s", f);
	} else {
		snprintf(r->weights, sizeof r->weights,
			 "random (seed %" PRIu64 ")", r->seed);
	}
	return 0;
}

/* The banner: model, weights, config (and what each "auto" value
 * resolved to), world, compile. */
static void banner(run *r, const opts *o)
{
	printf(PROG ": model %s (%s layout, %d params, %" PRId64
		    " elements, vocab %d), data %s\n",
	       o->model_path ? o->model_cfg : "<built-in tiny>",
	       o->layout == EPJ_LAYOUT_ROOT ? "root" : "nested",
	       epj_model_num_params(r->model), epj_model_num_elements(r->model),
	       epj_model_vocab_size(r->model), r->data);
	printf(PROG ": weights: %s\n", r->weights);
	printf(PROG ": config %s, micro-batch %" PRId64 " x seq %" PRId64
		    ", grad accum %" PRId64 ", %s, seed %" PRIu64
		    ", steps %" PRId64 " -> %ld%s\n",
	       o->config_path ? o->config_path : "<built-in>", r->B, r->T,
	       r->gas, cfg_bool(r, "bf16.enabled") ? "bf16" : "f32", r->seed,
	       epj_engine_step_count(r->engine), o->steps,
	       o->checkpointing ? ", checkpointing" : "");
	char key[300], val[300];
	for (int i = 0; epj_engine_auto_value(r->engine, i, key, sizeof key,
					      val, sizeof val);
	     i++)
		printf(PROG ": config \"auto\": %s = %s\n", key, val);
	printf(PROG ": world %d rank%s, expert parallel %d, ZeRO stage %d, "
		    "device %s\n",
	       epj_dist_size(), epj_dist_size() == 1 ? "" : "s",
	       (int)cfg_int(r, "expert_parallel.autoep_size"),
	       (int)cfg_int(r, "zero_optimization.stage"), run_device());
	if (o->compile) {
		printf(PROG ": compiled: mode %s, %d region%s",
		       epj_engine_compile_mode(r->engine),
		       epj_engine_num_regions(r->engine),
		       epj_engine_num_regions(r->engine) == 1 ? "" : "s");
		if (r->precompile_ms >= 0)
			printf("; %d variant%s compiled before step 1 in %.1f "
			       "ms (compile.ms %" PRId64 ", compile.cached_us "
			       "%" PRId64 ")",
			       r->precompiled, r->precompiled == 1 ? "" : "s",
			       r->precompile_ms,
			       epj_counter_get(r->ctx, "compile.ms"),
			       epj_counter_get(r->ctx, "compile.cached_us"));
		printf("\n");
	}
	stdout_check();
}

/* The summary's evaluation line. */
static void print_eval(run *r, double eval_loss)
{
	double floor = epj_corpus_entropy_rate(r->corpus);
	if (isnan(floor))
		printf("summary: eval loss %.4f (%d x [%" PRId64 ", %" PRId64
		       "] from the start of %s%s; entropy floor unknown)\n",
		       eval_loss, EVAL_BATCHES, r->B, r->T,
		       r->eval_stream && epj_corpus_split_tokens(
					     r->corpus, 1) != UINT64_MAX
			   ? "the validation split of "
			   : "",
		       r->data);
	else
		printf(
		    "summary: eval loss %.4f (held-out stream, %d x [%" PRId64
		    ", %" PRId64 "]), entropy floor %.4f nats/token, "
		    "gap %.4f\n",
		    eval_loss, EVAL_BATCHES, r->B, r->T, floor,
		    eval_loss - floor);
	stdout_check();
}

/* ms: every rank's memory (epj_dist_memory_max, a collective the caller
 * made on every rank). */
static void print_summary(run *r, const train_stats *ts, double eval_loss,
			  const epj_dist_memory *m)
{
	const epj_dist_memory ms = *m;
	printf(
	    "summary: %" PRId64 " steps in %.2f s (%.1f ms/step), "
	    "%.0f tokens/s\n",
	    ts->steps_done, ts->seconds,
	    ts->steps_done ? 1e3 * ts->seconds / (double)ts->steps_done : 0.0,
	    ts->seconds > 0
		? (double)(ts->steps_done * r->B * r->T * r->gas) / ts->seconds
		: 0.0);
	if (ts->steps_done)
		printf("summary: train loss %.4f (first step) -> %.4f (last "
		       "window)\n",
		       ts->first_loss, ts->window_loss);
	print_eval(r, eval_loss);
	if (epj_dist_size() > 1)
		printf("summary: memory, the largest of %d ranks: peak "
		       "allocated %.1f MiB (rank %d), peak reserved %.1f MiB "
		       "(rank %d), reserved %.1f MiB (rank %d)\n",
		       epj_dist_size(), mib(ms.peak_allocated),
		       ms.peak_allocated_rank, mib(ms.peak_reserved),
		       ms.peak_reserved_rank, mib(ms.reserved),
		       ms.reserved_rank);
	else
		printf("summary: memory peak allocated %.1f MiB, peak "
		       "reserved %.1f MiB, reserved %.1f MiB\n",
		       mib(ms.peak_allocated), mib(ms.peak_reserved),
		       mib(ms.reserved));
	if (epj_dist_size() > 1 && ts->steps_done)
		printf(
		    "summary: comm (rank 0 of %d): %.3f MiB sent and %.1f ms "
		    "in collectives per step, %.1f%% of the step time\n",
		    epj_dist_size(),
		    mib((uint64_t)(ts->comm_bytes / ts->steps_done)),
		    1e-3 * (double)ts->comm_us / (double)ts->steps_done,
		    ts->seconds > 0
			? 100.0 * 1e-6 * (double)ts->comm_us / ts->seconds
			: 0.0);
	stdout_check();
}

/* Closes --metrics and the csv_monitor files (rank 0); 1 when a close
 * failed (the rows were flushed, so only a late error of the file system
 * can show here). */
static int close_outputs(run *r, const opts *o)
{
	int rc = 0;
	if (r->metrics) {
		errno = 0;
		int bad = fclose(r->metrics) != 0;
		r->metrics = NULL;
		if (bad)
			rc = fail_msg("%s: write failed: %s", o->metrics,
				      strerror(errno));
	}
	for (int i = 0; i < N_MON; i++) {
		if (!r->monitor[i])
			continue;
		errno = 0;
		int bad = fclose(r->monitor[i]) != 0;
		r->monitor[i] = NULL;
		char path[4400];
		monitor_path(r, i, path, sizeof path);
		if (bad && !rc)
			rc = fail_msg("csv_monitor: %s: write failed: %s", path,
				      strerror(errno));
	}
	for (int k = 0; r->load_mon && k < r->n_moe * N_LOAD; k++) {
		if (!r->load_mon[k])
			continue;
		errno = 0;
		int bad = fclose(r->load_mon[k]) != 0;
		r->load_mon[k] = NULL;
		char path[4400];
		load_path(r, k / N_LOAD, k % N_LOAD, path, sizeof path);
		if (bad && !rc)
			rc = fail_msg("csv_monitor: %s: write failed: %s", path,
				      strerror(errno));
	}
	for (int i = 0; i < N_RL; i++) {
		errno = 0;
		if (r->rl_monitor[i] && fclose(r->rl_monitor[i]) != 0 && !rc)
			rc = fail_msg("csv_monitor: a router loss's file: "
				      "write failed: %s",
				      strerror(errno));
		r->rl_monitor[i] = NULL;
	}
	return rc;
}

/* --load of a run that is done already (--steps at or below its step;
 * --steps 0 is the documented evaluation): nothing to skip or train, no
 * --metrics or --save written; the evaluation of the checkpoint. */
static int evaluate_only(run *r, const opts *o)
{
	printf(PROG ": weights: %s\n", r->weights);
	printf(PROG ": %s is at step %" PRId64 ", --steps is %ld: nothing "
		    "left to train; evaluating it\n",
	       o->load, epj_engine_step_count(r->engine), o->steps);
	stdout_check();
	double eval_loss;
	if (evaluate(r, &eval_loss))
		return 1;
	print_eval(r, eval_loss);
	return 0;
}

/* Opens --metrics (rank 0: the loss is the global batch's on every rank),
 * the csv_monitor files and the tensorboard event file. */
static int open_outputs(run *r, const opts *o)
{
	load_setup(r, o);
	if (o->metrics && epj_dist_rank() == 0) {
		r->metrics = fopen(o->metrics, "w");
		if (!r->metrics)
			return fail_msg("%s: cannot open for writing: %s",
					o->metrics, strerror(errno));
		char *lc = load_columns(r, true);
		if (!lc)
			return fail_msg("%s: out of memory", o->metrics);
		char rl[N_RL * 40];
		rl_columns(r, true, rl, sizeof rl);
		int bad =
		    put_row(&r->metrics, "", o->metrics,
			    "step,loss,lr,grad_norm,tokens_per_s,"
			    "peak_alloc_bytes,step_ms,compile_ms,"
			    "entropy_floor,peak_alloc_rank,"
			    "peak_reserved_bytes,peak_reserved_rank%s%s\n",
			    lc, rl);
		free(lc);
		if (bad)
			return 1;
	}
	return monitor_open(r) || load_monitor_open(r) || tb_open(r);
}

static int run_main(run *r, const opts *o)
{
	if (setup(r, o) || load_weights(r, o))
		return 1;
	if (o->keep > 1 &&
	    epj_engine_set_save_keep(r->engine, (int)o->keep) != EPJ_OK)
		return fail_msg("--keep %ld: %s", o->keep,
				epj_ctx_error(r->ctx));
	if (o->load && epj_engine_step_count(r->engine) >= o->steps &&
	    !o->dump_state && !o->emit_cuda)
		return evaluate_only(r, o);
	if (o->load && skip_consumed(r, o->load))
		return 1;
	if (o->dump_state || o->emit_cuda) {
		printf(PROG ": weights: %s\n", r->weights);
		stdout_check();
	}
	if (o->dump_state) {
		/* several ranks: one file per rank (its batch, its experts) */
		char path[4096];
		snprintf(path, sizeof path, "%s", o->dump_state);
		if (epj_dist_size() > 1)
			snprintf(path, sizeof path, "%s.rank%d", o->dump_state,
				 epj_dist_rank());
		return dump_state(r, path, o->dump_batch);
	}
	if (o->emit_cuda)
		return emit_cuda(r, o);
	banner(r, o);
	if (open_outputs(r, o) || stop_signals_install())
		return 1;
	train_stats ts;
	train(r, o, &ts);
	if (r->no_rescue)
		return 1; /* a peer may be inside a collective */
	/* a failed close (rank 0) ends the run on every rank; so does a
	 * background save in flight that fails (its writers waited for) */
	int sig;
	if (close_outputs(r, o))
		r->failed = true;
	if (finish_save(r, o))
		r->failed = true;
	if (agree(r, &sig) || r->failed)
		return rescue(r, o);
	if (r->stop_sig)
		return stop_run(r, o);
	if (o->save && r->saved_step != epj_engine_step_count(r->engine) &&
	    save_checkpoint(r, o->save, where_to()))
		return 1;
	double eval_loss;
	if (evaluate(r, &eval_loss))
		r->failed = true;
	if (r->no_rescue)
		return 1;
	if (agree(r, &sig) || r->failed)
		return rescue(r, o);
	epj_dist_memory ms; /* every rank's: collective */
	if (epj_dist_memory_max(r->engine, &ms) != EPJ_OK)
		return fail(r->ctx);
	print_summary(r, &ts, eval_loss, &ms);
	int rc = print_counters(r);
	if (!rc && o->compare_eager && o->compile)
		rc = compare_eager(r, o);
	return rc;
}

int main(int argc, char **argv)
{
	sigpipe_install(); /* a closed pipe never kills the process */
	static opts o;
	int rc = parse_args(argc, argv, &o);
	if (rc >= 0)
		return rc;
	if (o.list_st)
		return list_safetensors(o.list_st);
	apply_threads(o.threads, argv);
	char err[512];
	if (epj_dist_init(err, sizeof err) != EPJ_OK)
		return fail_msg("%s", err);
	if (rank_output(&o))
		return 1;
	/* ok: MPI may be finalized (every rank got here in step); so is a
	 * run that stopped in order on a signal, with its own exit status,
	 * and one whose ranks agreed on an error */
	bool ok;
	if (o.parity) {
		rc = run_parity(&o);
		ok = rc == 0;
	} else {
		static run r = { .saved_step = -1 };
		rc = run_main(&r, &o);
		ok = rc == 0 || r.stopped || (r.failed && !r.no_rescue);
		run_free(&r);
	}
	fflush(stdout);
	epj_dist_finalize(ok);
	return rc;
}
