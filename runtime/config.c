/* config.c -- the DeepSpeed-style training configuration (ds.json).
 *
 * Everything about a key lives in one row of the key table below (`keys`):
 * its section, name, type, range or choices, field, default, which mode
 * refuses it and why, and one line of documentation.  One generic reader,
 * one defaults filler, one JSON writer and the reference page generator
 * (ej_config_reference, doc/config.md) walk that table, so a key is added
 * in one place; hooks cover what one row cannot say (top_k's "auto", the
 * scheduler's required total_num_steps, ...).
 *
 * A strict reader: every key of every section is looked up in the table,
 * so an unknown key (a typo that DeepSpeed's pydantic models would also
 * reject) is an error naming its full dotted path and, when one is close,
 * the key the user probably meant.  Values are type- and range-checked
 * where they are read; cross-field rules follow (batch divisibility,
 * parameters that the chosen optimizer or scheduler does not take).  The
 * support boundary of compile.autoep_non_moe is a separate check
 * (ej_config_validate_autoep_compile) because the engine applies it only
 * when that option is on, at compile time, with its own messages.
 *
 * Invariants
 *  - Parsing fills a scratch copy and assigns *out only on success; on
 *    failure *out holds the defaults.  Nothing is heap-allocated.
 *  - Every error is EPJ_ERR_CONFIG with "config error in <source>: " first,
 *    except an unreadable file (EPJ_ERR_IO, same prefix).
 *  - Integers may be written as integral reals (5e8), as DeepSpeed configs
 *    often do; the value must still be exactly integral.
 */
#include "config_impl.h"
#include "jit.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ==== helpers shared with model_config.c ================================ */

int ej_edit_distance(const char *a, const char *b)
{
	/* Optimal string alignment distance over lower-cased ASCII.  Keys are
	 * short; longer strings are only compared by length (never close). */
	enum { N = 64 };
	size_t n = strlen(a), m = strlen(b);
	if (n >= N || m >= N)
		return (int)(n > m ? n : m);
	int d[N][N];
	for (size_t i = 0; i <= n; i++)
		d[i][0] = (int)i;
	for (size_t j = 0; j <= m; j++)
		d[0][j] = (int)j;
	for (size_t i = 1; i <= n; i++) {
		for (size_t j = 1; j <= m; j++) {
			int ca = tolower((unsigned char)a[i - 1]);
			int cb = tolower((unsigned char)b[j - 1]);
			int cost = ca != cb;
			int best = d[i - 1][j] + 1;
			if (d[i][j - 1] + 1 < best)
				best = d[i][j - 1] + 1;
			if (d[i - 1][j - 1] + cost < best)
				best = d[i - 1][j - 1] + cost;
			if (i > 1 && j > 1 &&
			    ca == tolower((unsigned char)b[j - 2]) &&
			    tolower((unsigned char)a[i - 2]) == cb &&
			    d[i - 2][j - 2] + 1 < best)
				best = d[i - 2][j - 2] + 1;
			d[i][j] = best;
		}
	}
	return d[n][m];
}

const char *ej_nearest_key(const char *key, const char *const *cands, int n)
{
	/* "Close" grows with the key: one edit for short keys, up to three
	 * for long ones; never a candidate that is mostly edits. */
	size_t len = strlen(key);
	int limit = len <= 4 ? 1 : len <= 8 ? 2 : 3;
	const char *best = NULL;
	int best_d = INT_MAX;
	for (int i = 0; i < n; i++) {
		int d = ej_edit_distance(key, cands[i]);
		if (d < best_d) {
			best_d = d;
			best = cands[i];
		}
	}
	if (best && best_d <= limit && (size_t)best_d < strlen(best))
		return best;
	return NULL;
}

const char *ej_json_type_name(const json_t *v)
{
	switch (json_typeof(v)) {
	case JSON_OBJECT:
		return "object";
	case JSON_ARRAY:
		return "array";
	case JSON_STRING:
		return "string";
	case JSON_INTEGER:
		return "integer";
	case JSON_REAL:
		return "real";
	case JSON_TRUE:
	case JSON_FALSE:
		return "boolean";
	case JSON_NULL:
		return "null";
	}
	return "unknown";
}

char *ej_config_read_file(epj_ctx *ctx, const char *path)
{
	enum { MAX_BYTES = 64 << 20 }; /* a config is never this large */
	const char *why = NULL;
	FILE *f = ej_fopen_regular(path, &why);
	if (!f) {
		ej_error(ctx, EPJ_ERR_IO, "config error in %s: cannot read: %s",
			 path, why);
		return NULL;
	}
	size_t cap = 4096, len = 0;
	char *buf = malloc(cap);
	if (!buf) {
		fclose(f);
		ej_error(ctx, EPJ_ERR_NOMEM,
			 "config error in %s: out of memory", path);
		return NULL;
	}
	for (;;) {
		if (len + 1 >= cap) {
			if (cap >= MAX_BYTES) {
				free(buf);
				fclose(f);
				ej_error(ctx, EPJ_ERR_CONFIG,
					 "config error in %s: file larger than "
					 "%d bytes",
					 path, (int)MAX_BYTES);
				return NULL;
			}
			char *nb = realloc(buf, cap * 2);
			if (!nb) {
				free(buf);
				fclose(f);
				ej_error(ctx, EPJ_ERR_NOMEM,
					 "config error in %s: out of memory",
					 path);
				return NULL;
			}
			buf = nb;
			cap *= 2;
		}
		size_t got = fread(buf + len, 1, cap - 1 - len, f);
		len += got;
		if (got == 0) {
			if (ferror(f)) {
				int e = errno;
				free(buf);
				fclose(f);
				f = NULL;
				errno = e;
				goto io_fail;
			}
			break;
		}
	}
	fclose(f);
	buf[len] = '\0';
	if (strlen(buf) != len) {
		free(buf);
		ej_error(ctx, EPJ_ERR_CONFIG,
			 "config error in %s: file contains a NUL byte (not "
			 "JSON text)",
			 path);
		return NULL;
	}
	return buf;

io_fail:
	ej_error(ctx, EPJ_ERR_IO, "config error in %s: cannot read: %s", path,
		 strerror(errno));
	if (f)
		fclose(f);
	return NULL;
}

epj_status ej_config_error(epj_ctx *ctx, const char *src, const char *fmt, ...)
{
	char msg[896];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	return ej_error(ctx, EPJ_ERR_CONFIG, "config error in %s: %s", src,
			msg);
}

epj_status ej_config_json_object(epj_ctx *ctx, const char *json_text,
				 const char *src, json_t **root)
{
	*root = NULL;
	if (!json_text)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"config error in %s: no JSON text (NULL)", src);
	json_error_t jerr;
	json_t *r = json_loads(json_text,
			       JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
	if (!r)
		return ej_config_error(ctx, src,
				       "invalid JSON at line %d, column %d: %s",
				       jerr.line, jerr.column, jerr.text);
	if (!json_is_object(r)) {
		char g[100];
		epj_status s = ej_config_error(
		    ctx, src, "the top level must be a JSON object, got %s",
		    ej_json_describe(r, g, sizeof g));
		json_decref(r);
		return s;
	}
	*root = r;
	return EPJ_OK;
}

bool ej_json_as_int(const json_t *v, int64_t *out)
{
	if (json_is_integer(v)) {
		*out = json_integer_value(v);
		return true;
	}
	if (json_is_real(v)) {
		double d = json_real_value(v);
		if (d == floor(d) && fabs(d) < 9.0e15) {
			*out = (int64_t)d;
			return true;
		}
	}
	return false;
}

const char *ej_json_describe(const json_t *v, char *buf, size_t n)
{
	if (json_is_string(v))
		snprintf(buf, n, "string \"%.60s\"", json_string_value(v));
	else if (json_is_real(v))
		snprintf(buf, n, "real %g", json_real_value(v));
	else if (json_is_integer(v))
		snprintf(buf, n, "integer %" JSON_INTEGER_FORMAT,
			 json_integer_value(v));
	else
		snprintf(buf, n, "%s", ej_json_type_name(v));
	return buf;
}

/* ==== the key table ====================================================== */

/* One JSON object level of the config. */
enum {
	SEC_ROOT,
	SEC_BF16,
	SEC_FP16,
	SEC_OPTIM,
	SEC_OPTIM_PARAMS,
	SEC_SCHED,
	SEC_SCHED_PARAMS,
	SEC_ZERO,
	SEC_OFFLOAD, /* offload_optimizer and offload_param */
	SEC_ACT_CKPT,
	SEC_EP,
	SEC_COMPILE,
	SEC_PIPELINE,
	SEC_TP,
	SEC_MOE,
	SEC_COMM,
	SEC_CSV_MONITOR,
	SEC_TENSORBOARD,
	SEC_DATA,
	SEC_WANDB,
	SEC_COMET,
	SEC_FLOPS_PROFILER,
	SEC_COMMS_LOGGER,
	SEC_AIO,
	SEC_CHECKPOINT,
	SEC_CKPT_WRITER,
	SEC_COUNT
};

/* How a key's value is read, kept and written. */
typedef enum key_type {
	K_SECTION,  /* an object (null = absent) of the keys of `child` */
	K_BOOL,	    /* true / false */
	K_INT,	    /* integer in [ilo, ihi] into int or int64_t (by size) */
	K_NUM,	    /* number in lo .. hi (K_LO_OPEN, K_HI_OPEN) */
	K_PAIR,	    /* array of 2 numbers in lo .. hi into double[2] */
	K_ENUM,	    /* one of choices, kept as enum_base + its index */
	K_NAME,	    /* one of choices, kept as the string */
	K_STR,	    /* a string shorter than the field */
	K_TRISTATE, /* true / false / null, kept exactly (ej_json_bool) */
	K_NUMBOOL,  /* a number or a boolean, not kept */
	K_SPECIAL,  /* read and written by its hooks */
	K_TEXT,	    /* a string or null, not kept */
	K_ANY,	    /* any JSON value, not kept (a DeepSpeed feature that
		       epjit refuses when it is on; see KIND_NOT_IMPL) */
} key_type;

/* What epjit does with a key (the reference page's "class" column).  A
 * key is one of DeepSpeed's (or an epjit extension) in every class: a
 * typo is a key in no row.
 *  - KIND_IMPL: acted on (or checked and refused by value, see .refused);
 *  - KIND_OBSERVE: only observes or tunes the run in DeepSpeed (monitors,
 *    profilers, buckets, overlap, ...): type-checked, no effect here; the
 *    parse names every such key present in one warning
 *    (ej_config.no_effect);
 *  - KIND_NOT_IMPL: would change the computation and is not implemented:
 *    refused by the parser when on (a boolean true, an integer other than
 *    its default, a choice other than the first, any K_ANY value but null,
 *    false, {} or an object whose "enabled" is false); off, it is
 *    accepted and named with the no-effect keys. */
typedef enum key_kind {
	KIND_IMPL = 0,
	KIND_OBSERVE,
	KIND_NOT_IMPL,
} key_kind;

enum {
	K_LO_OPEN = 1u << 0,   /* lo excluded */
	K_HI_OPEN = 1u << 1,   /* hi excluded */
	K_NULL_OK = 1u << 2,   /* null allowed: int 0, name "", num not given */
	K_NOCASE = 1u << 3,    /* choices matched ignoring case */
	K_REQUIRED = 1u << 4,  /* an error when its section has it not */
	K_W_NONZERO = 1u << 5, /* written only when not 0 / "" */
	K_W_NEVER = 1u << 6,   /* not written (not kept, or moot) */
	K_BY_TYPE = 1u << 7,   /* section: keys filtered by the parent's type */
	K_ON_SET = 1u << 8,    /* KIND_NOT_IMPL: any value but null is on */
};

typedef struct cp cp;
struct key;
/* K_SPECIAL: reads v (present) into the field.  Other types: called after
 * the value (or, for a section, the whole object) was read. */
typedef epj_status (*key_hook)(cp *p, const struct key *k, json_t *obj,
			       json_t *v, const char *path, char *base,
			       ej_config *c);
/* K_SPECIAL: the value to write (a new reference).  K_SECTION: NULL when
 * the section is not written. */
typedef json_t *(*key_writer)(const struct key *k, const char *base,
			      const ej_config *c);

/* One key.  Offsets are from the base of the key's section: the config
 * itself, except in the offload sections (an ej_offload_config); a
 * section's `off` is the offset of its base from its parent's. */
typedef struct key {
	int sec; /* the section the key is in */
	const char *name;
	key_type type;
	int child;	  /* K_SECTION: the section of its value */
	long off;	  /* field; -1: checked and not kept */
	size_t size;	  /* bytes of the field */
	long given_off;	  /* bool: set when present (a nullable number:
			     when it has a value; a section: when given) */
	int64_t ilo, ihi; /* K_INT range */
	double lo, hi;	  /* K_NUM, K_PAIR range */
	unsigned flags;
	unsigned applies; /* K_BY_TYPE sections: bit per type value */
	const char *const *choices;
	int nchoices;
	/* K_NAME: the choices come from a registry (devices, backends) */
	const char *const *(*registry)(int *n);
	int enum_base;
	double def, def2;    /* default (def2: K_PAIR's second) */
	const char *def_str; /* default of K_NAME / K_STR */
	key_type store;	     /* K_SPECIAL: how the default is kept */
	key_hook hook;
	key_writer wr;
	key_kind kind;
	/* "auto" (DeepSpeed's and Hugging Face's placeholder): NULL when the
	 * key refuses it, else the rule that gives its value, for the
	 * reference page.  The value comes from the caller's auto source at
	 * the same path (epjit-train's own values) when it has one, else from
	 * auto_lib (a hook, e.g. warmup_max_lr = the optimizer's lr), else the
	 * key is read as absent (its default, or derived). */
	const char *auto_doc;
	key_hook auto_lib;
	/* The reference page: value and default when the generated text
	 * does not say it well; when a mode refuses the key and why; what
	 * it does (for a section: the paragraph under its heading). */
	const char *doc_value, *doc_default, *refused, *doc;
} key;

static const char *const optim_names[] = { "SGD", "Adam", "AdamW" };
static const char *const sched_names[] = { "WarmupLR", "WarmupDecayLR",
					   "WarmupCosineLR" };
static const char *const warmup_types[] = { "log", "linear" };
static const char *const comm_backends[] = { "comm", "deepep" };
static const char *const offload_devices[] = { "none", "cpu", "nvme" };
/* DeepSpeed 0.19.8's AutoEP presets (and Llama-4, an earlier one) by name:
 * the first five are the families epjit builds (ej_config_check_model),
 * the rest are refused by the parser (hook_preset_model). */
static const char *const preset_models[] = { "mixtral",	    "qwen3_moe",
					     "qwen3_5_moe", "deepseek_v2",
					     "deepseek_v3", "minimax_m3",
					     "llama4" };
enum { N_PRESETS_BUILT = 5 };
static const char *const score_funcs[] = { "auto", "softmax", "sigmoid" };
static const char *const score_applies[] = { "auto", "pre", "post" };
static const char *const combine_impls[] = { "auto", "weighted_sum",
					     "fused_weighted_sum",
					     "legacy_bmm" };
static const char *const row_weighting_impls[] = { "auto", "eager", "fused" };
static const char *const gate_up_impls[] = { "separate", "fused" };
/* DeepSpeed's expert activations; epjit's experts are SwiGLU (silu gate) in
 * every family, the first. */
static const char *const expert_activations[] = { "swiglu", "geglu_tanh",
						  "swiglu_clamped",
						  "swiglu_oai" };
static const char *const comm_device_backends[] = { "auto", "host", "nccl" };
static const char *const comm_dtypes[] = { "fp32", "fp16", "bf16" };

#define CH(a) .choices = a, .nchoices = (int)EJ_ARRAY_LEN(a)
#define F(m)                                                                   \
	.off = (long)offsetof(ej_config, m), .size = sizeof(((ej_config *)0)->m)
#define FO(m)                                                                  \
	.off = (long)offsetof(ej_offload_config, m),                           \
	.size = sizeof(((ej_offload_config *)0)->m)
#define GIVEN(m) .given_off = (long)offsetof(ej_config, m)
#define NOFIELD	 .off = -1, .given_off = -1, .flags = K_W_NEVER
#define SECTION(parent, nm, id)                                                \
	.sec = parent, .name = nm, .type = K_SECTION, .child = id
#define NOGIVEN .given_off = -1
/* Bit of a K_BY_TYPE key per optimizer / scheduler type. */
#define O_SGD	(1u << EJ_OPTIM_SGD)
#define O_ADAM	(1u << EJ_OPTIM_ADAM)
#define O_ADAMW (1u << EJ_OPTIM_ADAMW)
#define S_WLR	(1u << EJ_SCHED_WARMUP_LR)
#define S_WDLR	(1u << EJ_SCHED_WARMUP_DECAY_LR)
#define S_WCLR	(1u << EJ_SCHED_WARMUP_COSINE_LR)
/* Upper bound of batch-like integers: keeps micro * gas * world in int64. */
#define BATCH_MAX ((int64_t)1 << 31)
/* Upper bound of ints stored in `int` fields. */
#define INT_FIELD_MAX ((int64_t)1 << 30)
#define ANY_INT	      (INT64_MAX / 2)
/* Rows of keys that are checked and not kept, by class. */
#define OBS_ROW(s, nm, t, d)                                                   \
	{                                                                      \
		.sec = s, .name = nm, .type = t, NOFIELD,                      \
		.kind = KIND_OBSERVE, .ilo = 0, .ihi = ANY_INT, .lo = 0,       \
		.hi = HUGE_VAL, .doc = d                                       \
	}
#define NOTIMPL_ROW(s, nm, t, d)                                               \
	{                                                                      \
		.sec = s, .name = nm, .type = t, NOFIELD,                      \
		.kind = KIND_NOT_IMPL, .doc = d                                \
	}
/* An observe-only section: the section's row. */
#define OBS_SECTION(nm, id, d)                                                 \
	{                                                                      \
		SECTION(SEC_ROOT, nm, id), NOGIVEN,                            \
		    .flags = K_W_NEVER, .kind = KIND_OBSERVE, .doc = d         \
	}
/* "auto" from the library: the key as if absent. */
#define AUTO_ABSENT "as absent"

static epj_status hook_optim_type(cp *, const key *, json_t *, json_t *,
				  const char *, char *, ej_config *);
static epj_status hook_optim_params(cp *, const key *, json_t *, json_t *,
				    const char *, char *, ej_config *);
static epj_status hook_sched(cp *, const key *, json_t *, json_t *,
			     const char *, char *, ej_config *);
static epj_status hook_fp16(cp *, const key *, json_t *, json_t *, const char *,
			    char *, ej_config *);
static epj_status hook_offload(cp *, const key *, json_t *, json_t *,
			       const char *, char *, ej_config *);
static epj_status hook_csv(cp *, const key *, json_t *, json_t *, const char *,
			   char *, ej_config *);
static epj_status hook_tb(cp *, const key *, json_t *, json_t *, const char *,
			  char *, ej_config *);
static epj_status hook_top_k(cp *, const key *, json_t *, json_t *,
			     const char *, char *, ej_config *);
static epj_status hook_route_norm(cp *, const key *, json_t *, json_t *,
				  const char *, char *, ej_config *);
static epj_status hook_rsf(cp *, const key *, json_t *, json_t *, const char *,
			   char *, ej_config *);
static epj_status hook_preset_model(cp *, const key *, json_t *, json_t *,
				    const char *, char *, ej_config *);
static epj_status hook_ep(cp *, const key *, json_t *, json_t *, const char *,
			  char *, ej_config *);
static epj_status hook_schedule(cp *, const key *, json_t *, json_t *,
				const char *, char *, ej_config *);
static epj_status auto_max_lr(cp *, const key *, json_t *, json_t *,
			      const char *, char *, ej_config *);
static epj_status auto_total_steps(cp *, const key *, json_t *, json_t *,
				   const char *, char *, ej_config *);
static json_t *wr_top_k(const key *, const char *, const ej_config *);
static json_t *wr_route_norm(const key *, const char *, const ej_config *);
static json_t *wr_rsf(const key *, const char *, const ej_config *);
static json_t *wr_schedule(const key *, const char *, const ej_config *);
static json_t *wr_if_sched(const key *, const char *, const ej_config *);
static json_t *wr_if_given(const key *, const char *, const ej_config *);
static json_t *wr_if_moe(const key *, const char *, const ej_config *);
static json_t *wr_if_decoupled(const key *, const char *, const ej_config *);

/* Every key of the config, section by section, in the order the parser
 * reads them and the JSON writer writes them.  A key is added here and
 * nowhere else: the parser, its type and range errors, the defaults, the
 * JSON writer and the reference page (doc/config.md) all come from it. */
static const key keys[] = {
	/* ---- top level */
	{ .sec = SEC_ROOT,
	  .name = "train_batch_size",
	  .type = K_INT,
	  F(train_batch_size),
	  GIVEN(train_batch_size_given),
	  .ilo = 1,
	  .ihi = BATCH_MAX,
	  .flags = K_W_NONZERO,
	  .doc_default = "derived",
	  .auto_doc = "micro-batch × accumulation × data-parallel world "
		      "(derived, as when absent)",
	  .doc = "global batch; see *Batch sizes*" },
	{ .sec = SEC_ROOT,
	  .name = "train_micro_batch_size_per_gpu",
	  .type = K_INT,
	  F(micro_batch_per_gpu),
	  GIVEN(micro_batch_given),
	  .ilo = 1,
	  .ihi = BATCH_MAX,
	  .flags = K_W_NONZERO,
	  .doc_default = "derived",
	  .auto_doc = "epjit-train: its micro-batch (8); library: " AUTO_ABSENT
		      " (derived)",
	  .doc = "rows B of every `[B, T]` micro-batch" },
	{ .sec = SEC_ROOT,
	  .name = "gradient_accumulation_steps",
	  .type = K_INT,
	  F(gradient_accumulation_steps),
	  GIVEN(gas_given),
	  .ilo = 1,
	  .ihi = BATCH_MAX,
	  .flags = K_W_NONZERO,
	  .doc_default = "derived",
	  .auto_doc = "epjit-train: 1; library: " AUTO_ABSENT " (derived)",
	  .doc = "micro-batches per optimizer step" },
	{ SECTION(SEC_ROOT, "bf16", SEC_BF16), NOGIVEN },
	{ SECTION(SEC_ROOT, "fp16", SEC_FP16), NOGIVEN, .flags = K_W_NEVER,
	  .hook = hook_fp16,
	  .doc = "fp16 training is not supported: `fp16.enabled` must be "
		 "false; the loss-scaling keys are accepted and ignored (they "
		 "matter only with fp16 on). Not written by the JSON dump." },
	{ SECTION(SEC_ROOT, "optimizer", SEC_OPTIM), GIVEN(optimizer.given),
	  .doc = "`optimizer.type` is required when the section is present, "
		 "case-insensitive as in DeepSpeed. Without the section: "
		 "AdamW with the defaults below. The update formulas are "
		 "PyTorch's (`runtime/optim.c`), on FP32 master weights, with "
		 "one global step count. A parameter the chosen type does not "
		 "take is an error that lists what it takes." },
	{ SECTION(SEC_ROOT, "scheduler", SEC_SCHED), NOGIVEN, .wr = wr_if_sched,
	  .hook = hook_sched,
	  .doc = "No section: constant `optimizer.params.lr`. With the "
		 "section, `scheduler.type` is required and matched exactly. "
		 "Formulas and defaults are DeepSpeed's. WarmupLR and "
		 "WarmupDecayLR run from `warmup_min_lr` to `warmup_max_lr` "
		 "(`optimizer.params.lr` is not used); WarmupCosineLR scales "
		 "`optimizer.params.lr` by a ratio. Optimizer step n (1, 2, "
		 "...) uses the schedule at iteration `last_batch_iteration + "
		 "n - 1`, so with the default the first step runs at "
		 "iteration -1: `warmup_min_lr`, or 0 for WarmupCosineLR "
		 "(DeepSpeed steps the scheduler after the optimizer). "
		 "`total_num_steps < warmup_num_steps` is logged as a "
		 "warning." },
	{ .sec = SEC_ROOT,
	  .name = "gradient_clipping",
	  .type = K_NUM,
	  F(gradient_clipping),
	  NOGIVEN,
	  .lo = 0,
	  .hi = HUGE_VAL,
	  .doc_default = "0 (off)",
	  .auto_doc = "epjit-train: 1.0; library: 0 (off)",
	  .doc = "clip by global gradient norm: scale by `clip / (norm + "
		 "1e-6)` when below 1" },
	{ SECTION(SEC_ROOT, "zero_optimization", SEC_ZERO), NOGIVEN },
	{ SECTION(SEC_ROOT, "activation_checkpointing", SEC_ACT_CKPT),
	  NOGIVEN },
	{ SECTION(SEC_ROOT, "expert_parallel", SEC_EP), NOGIVEN,
	  .hook = hook_ep,
	  .doc = "Every key DeepSpeed 0.19.8's `parse_autoep_config` reads. "
		 "*Acted on*: the group size, the token exchange, the split "
		 "plan, the balancing rate (an epjit extension, see "
		 "`load_balance_coeff`). *Checked against the model* by "
		 "initialize (`ej_config_check_model`): `preset_model` "
		 "against the model's `model_type`, and `top_k`, "
		 "`route_norm`, `route_scale`, `routed_scaling_factor`, "
		 "`score_func`, `score_apply`, `num_expert_groups` and "
		 "`num_limited_groups` against what its config.json says "
		 "and epjit implements for the family. epjit routes as the "
		 "model does: a value that would route otherwise is "
		 "`EPJ_ERR_CONFIG` naming the key, its value and the "
		 "model's (another routing is not implemented), and every "
		 "value that DeepSpeed resolves to the model's own routing "
		 "is accepted (its presets, `fill_autoep_config_from_hf` and "
		 "`_resolve_route_scale`; *AutoEP routing keys* below). *No "
		 "effect*: DeepSpeed's kernel choices and "
		 "DeepEP tuning (epjit runs its own kernels; DeepEP is not "
		 "implemented), named in the no-effect warning. *Not "
		 "implemented*: expert tensor parallelism and the fields "
		 "that describe a custom model's layout to DeepSpeed's "
		 "module detection (epjit builds its families from "
		 "config.json; for them null is the only value). DeepSpeed "
		 "validates the section only when `enabled` is true; epjit "
		 "checks it whatever `enabled` says. DeepSpeed's pair rules "
		 "are kept: `gate_up_impl` `\"fused\"` with "
		 "`use_grouped_mm` false, `row_weighting_impl` "
		 "`\"fused\"` without `comm_backend` `\"deepep\"` and "
		 "`autoep_size` > 1, `combine_impl` "
		 "`\"fused_weighted_sum\"` with DeepEP and `autoep_size` > "
		 "1, and `num_limited_groups` above `num_expert_groups` are "
		 "errors." },
	{ SECTION(SEC_ROOT, "compile", SEC_COMPILE), NOGIVEN,
	  .doc = "These keys concern compilation only: initialize accepts "
		 "every value the parser does (the run trains eagerly) and "
		 "`epj_engine_compile` (`epjit-train --compile`) refuses "
		 "what the mode cannot honour (doc/compile.md). Setting "
		 "`autoep_non_moe` compiles nothing by itself." },
	{ .sec = SEC_ROOT,
	  .name = "sequence_parallel_size",
	  .type = K_INT,
	  F(sequence_parallel_size),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = INT_FIELD_MAX,
	  .def = 1,
	  .refused = "> 1: by initialize (sequence parallelism is not "
		     "implemented in epjit)",
	  .doc = "sequence-parallel group size" },
	{ SECTION(SEC_ROOT, "pipeline", SEC_PIPELINE), NOGIVEN },
	{ SECTION(SEC_ROOT, "tensor_parallel", SEC_TP), NOGIVEN },
	{ SECTION(SEC_ROOT, "moe", SEC_MOE), NOGIVEN, .wr = wr_if_moe,
	  .doc = "**epjit extension.** Megatron Core's router losses "
		 "(`--moe-router-load-balancing-type` with "
		 "`--moe-aux-loss-coeff`, `--moe-z-loss-coeff`), one "
		 "coefficient per loss, 0 or null: off; they add to the "
		 "training loss of every MoE layer as Megatron defines them "
		 "and are logged as their own metrics (doc/trainer.md, "
		 "*Router losses*). transformers' auxiliary loss comes from "
		 "the model's config.json instead (`output_router_logits`, "
		 "`router_aux_loss_coef`); initialize refuses it together "
		 "with a balancing loss of this section." },
	{ .sec = SEC_ROOT,
	  .name = "steps_per_print",
	  .type = K_INT,
	  F(steps_per_print),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = INT64_MAX,
	  .def = 10,
	  .doc = "stored (`epj_engine_steps_per_print`); epjit-train's "
		 "progress interval" },
	{ .sec = SEC_ROOT,
	  .name = "seed",
	  .type = K_INT,
	  F(seed),
	  NOGIVEN,
	  .ilo = 0,
	  .ihi = INT64_MAX,
	  .def = 42,
	  .doc = "stored (`epj_engine_seed`); epjit-train's run seed unless "
		 "`--seed`" },
	{ .sec = SEC_ROOT,
	  .name = "wall_clock_breakdown",
	  .type = K_BOOL,
	  F(wall_clock_breakdown),
	  NOGIVEN,
	  .kind = KIND_OBSERVE,
	  .doc = "DeepSpeed's step timers" },
	{ .sec = SEC_ROOT,
	  .name = "device",
	  .type = K_NAME,
	  F(device),
	  NOGIVEN,
	  .registry = ej_device_list,
	  .flags = K_NULL_OK | K_W_NONZERO,
	  .doc_default = "null (`$EPJIT_DEVICE`, else cpu)",
	  .doc = "with `compile.backend` unset: `\"cuda-sim\"` runs compiled "
		 "regions on the cuda-sim backend (doc/cuda-sim.md), "
		 "`\"cuda\"` on the nvrtc backend (doc/cuda.md), "
		 "`\"cpu\"` on the C backend" },
	{ .sec = SEC_ROOT,
	  .name = "skip_nonfinite_steps",
	  .type = K_BOOL,
	  F(skip_nonfinite_steps),
	  NOGIVEN,
	  .doc = "epjit extension: a step with a non-finite mean loss or "
		 "gradient norm is skipped (no update, "
		 "`train.skipped_steps`) instead of failing the train step; "
		 "see doc/trainer.md" },
	{ SECTION(SEC_ROOT, "comm", SEC_COMM), NOGIVEN },
	{ SECTION(SEC_ROOT, "csv_monitor", SEC_CSV_MONITOR), NOGIVEN,
	  .hook = hook_csv,
	  .doc = "DeepSpeed's CSV monitor. `epjit-train` writes its metric "
		 "files (`doc/trainer.md`); the library only parses and keeps "
		 "the section (`epj_engine_csv_monitor_dir`)." },
	{ SECTION(SEC_ROOT, "tensorboard", SEC_TENSORBOARD), NOGIVEN,
	  .hook = hook_tb,
	  .doc = "DeepSpeed's TensorBoard monitor. `epjit-train` (rank 0) "
		 "writes the training scalars to a TensorBoard event file "
		 "(`doc/trainer.md`); the library only parses and keeps the "
		 "section (`epj_engine_tensorboard_dir`)." },
	{ SECTION(SEC_ROOT, "data", SEC_DATA),
	  .off = (long)offsetof(ej_config, data),
	  .given_off = (long)offsetof(struct ej_data_config, given),
	  .wr = wr_if_given,
	  .doc = "epjit extension: the training data of `epjit-train` "
		 "(doc/trainer.md), for the keys its command line does not "
		 "give.  The library keeps `path`, `split` and `seed` "
		 "(`epj_engine_data_path`, `_split`, `_seed`) and acts on "
		 "the packed-document and loss keys itself "
		 "(`epj_engine_batch_opts`; the trainer's flags add to "
		 "them)." },

	/* DeepSpeed's keys that only observe or tune a run, and its
	 * features that epjit does not implement */
	OBS_ROW(SEC_ROOT, "memory_breakdown", K_BOOL,
		"DeepSpeed: memory use in its step timers"),
	OBS_ROW(SEC_ROOT, "dump_state", K_BOOL,
		"DeepSpeed: prints its engine state at initialize"),
	OBS_ROW(SEC_ROOT, "disable_python_gc", K_BOOL,
		"DeepSpeed (its AutoEP docs): Python's cyclic garbage "
		"collector off during training; epjit runs no Python"),
	OBS_ROW(SEC_ROOT, "zero_allow_untested_optimizer", K_BOOL,
		"DeepSpeed: lets ZeRO run a client optimizer; epjit's "
		"optimizers are its own"),
	OBS_ROW(SEC_ROOT, "zero_force_ds_cpu_optimizer", K_BOOL,
		"DeepSpeed: the CPU optimizer of offload (not implemented, "
		"see `zero_optimization.offload_optimizer`)"),
	{ .sec = SEC_ROOT,
	  .name = "communication_data_type",
	  .type = K_NAME,
	  .off = -1,
	  .given_off = -1,
	  .flags = K_W_NEVER | K_NOCASE | K_NULL_OK,
	  CH(comm_dtypes),
	  .kind = KIND_NOT_IMPL,
	  .doc_default = "null",
	  .doc = "dtype of the gradient collectives: epjit reduces gradients "
		 "in fp32 (the FP32 gradient buffers), which `\"fp32\"` and "
		 "null accept; `\"fp16\"` and `\"bf16\"` would change the "
		 "sums and are refused" },
	NOTIMPL_ROW(SEC_ROOT, "prescale_gradients", K_BOOL,
		    "divide gradients by the world before the all-reduce "
		    "(epjit scales after it)"),
	NOTIMPL_ROW(SEC_ROOT, "sparse_gradients", K_BOOL,
		    "sparse embedding gradients"),
	NOTIMPL_ROW(SEC_ROOT, "amp", K_ANY, "NVIDIA Apex AMP"),
	NOTIMPL_ROW(SEC_ROOT, "torch_autocast", K_ANY, "torch autocast"),
	NOTIMPL_ROW(SEC_ROOT, "sparse_attention", K_ANY, "sparse attention"),
	NOTIMPL_ROW(SEC_ROOT, "progressive_layer_drop", K_ANY,
		    "progressive layer drop"),
	NOTIMPL_ROW(SEC_ROOT, "curriculum_learning", K_ANY,
		    "curriculum learning"),
	NOTIMPL_ROW(SEC_ROOT, "data_efficiency", K_ANY,
		    "data efficiency (sampling, routing)"),
	NOTIMPL_ROW(SEC_ROOT, "eigenvalue", K_ANY, "eigenvalue computation"),
	NOTIMPL_ROW(SEC_ROOT, "quantize_training", K_ANY,
		    "quantization-aware training"),
	NOTIMPL_ROW(SEC_ROOT, "compression_training", K_ANY,
		    "compression training"),
	NOTIMPL_ROW(SEC_ROOT, "elasticity", K_ANY,
		    "elastic training (it picks the batch size)"),
	NOTIMPL_ROW(SEC_ROOT, "hybrid_engine", K_ANY, "RLHF hybrid engine"),
	NOTIMPL_ROW(SEC_ROOT, "data_types", K_ANY,
		    "gradient accumulation dtype (epjit accumulates in fp32)"),
	OBS_ROW(SEC_ROOT, "autotuning", K_ANY,
		"DeepSpeed's autotuner (its own launcher)"),
	OBS_SECTION("wandb", SEC_WANDB,
		    "DeepSpeed's Weights & Biases "
		    "monitor: checked, no effect in epjit."),
	OBS_SECTION("comet", SEC_COMET,
		    "DeepSpeed's Comet monitor: checked, "
		    "no effect in epjit."),
	OBS_SECTION("flops_profiler", SEC_FLOPS_PROFILER,
		    "DeepSpeed's FLOPs profiler: checked, no effect in epjit "
		    "(epjit's counters: doc/counters.md)."),
	OBS_SECTION("comms_logger", SEC_COMMS_LOGGER,
		    "DeepSpeed's communication logger: checked, no effect in "
		    "epjit (epjit counts its collectives: doc/counters.md)."),
	OBS_SECTION("aio", SEC_AIO,
		    "DeepSpeed's async I/O for NVMe offload "
		    "(offload is not implemented): checked, no effect."),
	{ SECTION(SEC_ROOT, "checkpoint", SEC_CHECKPOINT), NOGIVEN,
	  .wr = wr_if_decoupled,
	  .doc = "DeepSpeed's checkpoint options: `writer.decoupled` true "
		 "makes `epjit-train`'s periodic saves (`--save-every`) "
		 "background saves, as DeepSpeed's decoupled checkpoint "
		 "engine does (doc/ckpt.md); the other keys are checked and "
		 "change nothing, and `load_universal` true is refused." },

	/* ---- bf16, fp16 */
	{ .sec = SEC_BF16,
	  .name = "enabled",
	  .type = K_BOOL,
	  F(bf16_enabled),
	  NOGIVEN,
	  .auto_doc = "epjit-train: true with `--bf16`, else false; library: "
		      "false",
	  .doc = "parameters become bf16 (round-to-nearest-even of the f32 "
		 "init) at initialize; the optimizer keeps FP32 masters; "
		 "checkpoints hold the masters" },
	{ .sec = SEC_FP16,
	  .name = "enabled",
	  .type = K_BOOL,
	  NOFIELD,
	  .refused = "true: by the parser (fp16 training is not supported; "
		     "use `bf16`)",
	  .auto_doc = "false (fp16 is not supported)",
	  .doc = "must be false" },
#define FP16_MOOT(nm)                                                          \
	{                                                                      \
		.sec = SEC_FP16, .name = nm, .type = K_NUMBOOL, NOFIELD,       \
		.kind = KIND_OBSERVE,                                          \
		.doc = "loss scaling of fp16 training (off)"                   \
	}
	FP16_MOOT("auto_cast"),
	FP16_MOOT("loss_scale"),
	FP16_MOOT("initial_scale_power"),
	FP16_MOOT("loss_scale_window"),
	FP16_MOOT("hysteresis"),
	FP16_MOOT("consecutive_hysteresis"),
	FP16_MOOT("min_loss_scale"),
#undef FP16_MOOT

	/* ---- optimizer */
	{ .sec = SEC_OPTIM,
	  .name = "type",
	  .type = K_ENUM,
	  F(optimizer.type),
	  NOGIVEN,
	  CH(optim_names),
	  .flags = K_NOCASE | K_REQUIRED,
	  .def = EJ_OPTIM_ADAMW,
	  .doc_default = "**required** in the section (AdamW without it)",
	  .hook = hook_optim_type,
	  .doc = "the update rule" },
	{ SECTION(SEC_OPTIM, "params", SEC_OPTIM_PARAMS), NOGIVEN,
	  .flags = K_BY_TYPE, .hook = hook_optim_params },
	{ .sec = SEC_OPTIM_PARAMS,
	  .name = "lr",
	  .type = K_NUM,
	  F(optimizer.lr),
	  NOGIVEN,
	  .lo = 0,
	  .hi = HUGE_VAL,
	  .def = 1e-3,
	  .applies = O_SGD | O_ADAM | O_ADAMW,
	  .auto_doc = "epjit-train: 3e-3 (its built-in run's); library: 1e-3",
	  .doc = "learning rate (peak lr of `WarmupCosineLR`)" },
	{ .sec = SEC_OPTIM_PARAMS,
	  .name = "momentum",
	  .type = K_NUM,
	  F(optimizer.momentum),
	  NOGIVEN,
	  .lo = 0,
	  .hi = 1,
	  .flags = K_HI_OPEN,
	  .applies = O_SGD,
	  .doc = "momentum, dampening 0" },
	{ .sec = SEC_OPTIM_PARAMS,
	  .name = "nesterov",
	  .type = K_BOOL,
	  F(optimizer.nesterov),
	  NOGIVEN,
	  .applies = O_SGD,
	  .doc = "needs `momentum > 0` (error otherwise)" },
	{ .sec = SEC_OPTIM_PARAMS,
	  .name = "betas",
	  .type = K_PAIR,
	  F(optimizer.betas),
	  NOGIVEN,
	  .lo = 0,
	  .hi = 1,
	  .flags = K_HI_OPEN,
	  .def = 0.9,
	  .def2 = 0.999,
	  .applies = O_ADAM | O_ADAMW,
	  .auto_doc = "epjit-train: [0.9, 0.95]; library: [0.9, 0.999]",
	  .doc = "Adam's moment decay rates" },
	{ .sec = SEC_OPTIM_PARAMS,
	  .name = "eps",
	  .type = K_NUM,
	  F(optimizer.eps),
	  NOGIVEN,
	  .lo = 0,
	  .hi = HUGE_VAL,
	  .flags = K_LO_OPEN,
	  .def = 1e-8,
	  .applies = O_ADAM | O_ADAMW,
	  .auto_doc = "1e-8",
	  .doc = "added to the denominator" },
	{ .sec = SEC_OPTIM_PARAMS,
	  .name = "weight_decay",
	  .type = K_NUM,
	  F(optimizer.weight_decay),
	  NOGIVEN,
	  .lo = 0,
	  .hi = HUGE_VAL,
	  .applies = O_SGD | O_ADAM | O_ADAMW,
	  .auto_doc = "epjit-train: 0.01; library: 0",
	  .doc = "SGD and Adam with `adam_w_mode` false: L2 (`g += wd * p`); "
		 "AdamW and Adam with `adam_w_mode` true: decoupled (`p *= 1 "
		 "- lr * wd`)" },
	{ .sec = SEC_OPTIM_PARAMS,
	  .name = "adam_w_mode",
	  .type = K_BOOL,
	  F(optimizer.adam_w_mode),
	  NOGIVEN,
	  .def = 1,
	  .applies = O_ADAM,
	  .doc_default = "true (Adam, AdamW)",
	  .doc = "decoupled weight decay, as DeepSpeed's default" },

	/* ---- scheduler */
	{ .sec = SEC_SCHED,
	  .name = "type",
	  .type = K_ENUM,
	  F(scheduler.type),
	  NOGIVEN,
	  CH(sched_names),
	  .enum_base = 1,
	  .flags = K_REQUIRED,
	  .def = EJ_SCHED_NONE,
	  .doc_default = "none (constant lr)",
	  .doc = "the schedule" },
	{ SECTION(SEC_SCHED, "params", SEC_SCHED_PARAMS), NOGIVEN,
	  .flags = K_BY_TYPE },
	{ .sec = SEC_SCHED_PARAMS,
	  .name = "warmup_min_lr",
	  .type = K_NUM,
	  F(scheduler.warmup_min_lr),
	  NOGIVEN,
	  .lo = 0,
	  .hi = HUGE_VAL,
	  .applies = S_WLR | S_WDLR,
	  .auto_doc = "0",
	  .doc = "lr at the start of warm-up" },
	{ .sec = SEC_SCHED_PARAMS,
	  .name = "warmup_max_lr",
	  .type = K_NUM,
	  F(scheduler.warmup_max_lr),
	  NOGIVEN,
	  .lo = 0,
	  .hi = HUGE_VAL,
	  .def = 1e-3,
	  .applies = S_WLR | S_WDLR,
	  .auto_doc = "epjit-train: its lr (3e-3); library: "
		      "`optimizer.params.lr` as resolved",
	  .auto_lib = auto_max_lr,
	  .doc = "lr at the end of warm-up" },
	{ .sec = SEC_SCHED_PARAMS,
	  .name = "warmup_num_steps",
	  .type = K_INT,
	  F(scheduler.warmup_num_steps),
	  NOGIVEN,
	  .ilo = 0,
	  .ihi = BATCH_MAX,
	  .def = 1000,
	  .applies = S_WLR | S_WDLR | S_WCLR,
	  .auto_doc = "epjit-train: 20; library: 1000",
	  .doc = "warm-up length (values < 2 act as 2)" },
	{ .sec = SEC_SCHED_PARAMS,
	  .name = "warmup_type",
	  .type = K_ENUM,
	  F(scheduler.warmup_type),
	  NOGIVEN,
	  CH(warmup_types),
	  .def = EJ_WARMUP_LOG,
	  .applies = S_WLR | S_WDLR | S_WCLR,
	  .doc = "warm-up curve" },
	{ .sec = SEC_SCHED_PARAMS,
	  .name = "total_num_steps",
	  .type = K_INT,
	  F(scheduler.total_num_steps),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = BATCH_MAX,
	  .applies = S_WDLR | S_WCLR,
	  .doc_default = "**required** (WarmupDecayLR, WarmupCosineLR)",
	  .auto_doc = "epjit-train: `--steps`; library: none (an error)",
	  .auto_lib = auto_total_steps,
	  .doc = "end of the decay" },
	{ .sec = SEC_SCHED_PARAMS,
	  .name = "cos_min_ratio",
	  .type = K_NUM,
	  F(scheduler.cos_min_ratio),
	  NOGIVEN,
	  .lo = 0,
	  .hi = 1,
	  .def = 1e-4,
	  .applies = S_WCLR,
	  .doc = "final lr / peak lr" },
	{ .sec = SEC_SCHED_PARAMS,
	  .name = "warmup_min_ratio",
	  .type = K_NUM,
	  F(scheduler.warmup_min_ratio),
	  NOGIVEN,
	  .lo = 0,
	  .hi = 1,
	  .applies = S_WCLR,
	  .doc = "first warm-up lr / peak lr" },
	{ .sec = SEC_SCHED_PARAMS,
	  .name = "last_batch_iteration",
	  .type = K_INT,
	  F(scheduler.last_batch_iteration),
	  NOGIVEN,
	  .ilo = -1,
	  .ihi = BATCH_MAX,
	  .def = -1,
	  .applies = S_WLR | S_WDLR | S_WCLR,
	  .doc = "iteration before the first step" },

	/* ---- zero_optimization */
	{ .sec = SEC_ZERO,
	  .name = "stage",
	  .type = K_INT,
	  F(zero.stage),
	  NOGIVEN,
	  .ilo = 0,
	  .ihi = 3,
	  .refused = "3: by initialize (ZeRO Stage 3 is not implemented in "
		     "epjit)",
	  .doc = "data parallelism over the ranks (`mpirun`): 0 all-reduces "
		 "the gradients; 1 partitions FP32 masters and optimizer "
		 "state over each parameter's data-parallel group (each rank "
		 "updates its shard, the parameters are all-gathered); 2 also "
		 "reduce-scatters the gradients to their owners. On one rank "
		 "0, 1 and 2 train identically (nothing to partition). See "
		 "\"Several ranks\" below" },
	{ SECTION(SEC_ZERO, "offload_optimizer", SEC_OFFLOAD),
	  .off = (long)offsetof(ej_config, zero.offload_optimizer),
	  .given_off = (long)offsetof(ej_offload_config, present),
	  .wr = wr_if_given, .hook = hook_offload,
	  .doc = "Optimizer offload. `{}`, `null` and `{\"device\": "
		 "\"none\"}` mean no offload." },
	{ SECTION(SEC_ZERO, "offload_param", SEC_OFFLOAD),
	  .off = (long)offsetof(ej_config, zero.offload_param),
	  .given_off = (long)offsetof(ej_offload_config, present),
	  .wr = wr_if_given, .hook = hook_offload,
	  .doc = "Parameter offload; the same keys as "
		 "`zero_optimization.offload_optimizer`." },
	{ .sec = SEC_ZERO,
	  .name = "reduce_bucket_size",
	  .type = K_INT,
	  F(zero.reduce_bucket_size),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = ANY_INT,
	  .def = 5e8,
	  .kind = KIND_OBSERVE,
	  .auto_doc = "5e8",
	  .doc = "elements per gradient reduction bucket (epjit reduces "
		 "each parameter's gradient whole)" },
	{ .sec = SEC_ZERO,
	  .name = "allgather_bucket_size",
	  .type = K_INT,
	  F(zero.allgather_bucket_size),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = ANY_INT,
	  .def = 5e8,
	  .kind = KIND_OBSERVE,
	  .auto_doc = "5e8",
	  .doc = "elements per parameter all-gather bucket" },
	{ .sec = SEC_ZERO,
	  .name = "overlap_comm",
	  .type = K_BOOL,
	  F(zero.overlap_comm),
	  NOGIVEN,
	  .kind = KIND_OBSERVE,
	  .doc = "overlap of reductions with backward" },
	{ .sec = SEC_ZERO,
	  .name = "contiguous_gradients",
	  .type = K_BOOL,
	  F(zero.contiguous_gradients),
	  NOGIVEN,
	  .def = 1,
	  .kind = KIND_OBSERVE,
	  .doc = "gradient copies into one buffer" },
	OBS_ROW(SEC_ZERO, "allgather_partitions", K_BOOL,
		"all-gather instead of broadcasts (the same values)"),
	OBS_ROW(SEC_ZERO, "reduce_scatter", K_BOOL,
		"reduce-scatter instead of all-reduce (the same sums)"),
	OBS_ROW(SEC_ZERO, "round_robin_gradients", K_BOOL,
		"gradient partition order for offload"),
	OBS_ROW(SEC_ZERO, "use_multi_rank_bucket_allreduce", K_BOOL,
		"bucketing of all-reduces"),
	OBS_ROW(SEC_ZERO, "load_from_fp32_weights", K_BOOL,
		"epjit's checkpoints always hold the FP32 masters"),
	OBS_ROW(SEC_ZERO, "elastic_checkpoint", K_BOOL,
		"checkpoint layout across world sizes"),
	OBS_ROW(SEC_ZERO, "ignore_unused_parameters", K_BOOL,
		"stage 2 check for parameters without gradients"),
	OBS_ROW(SEC_ZERO, "memory_efficient_linear", K_BOOL,
		"memory of ZeRO's linear layers"),
	OBS_ROW(SEC_ZERO, "log_trace_cache_warnings", K_BOOL,
		"stage 3 logging"),
	OBS_ROW(SEC_ZERO, "sub_group_size", K_INT, "stage 3 tuning"),
#define ZERO3_INT(nm)                                                          \
	{                                                                      \
		.sec = SEC_ZERO, .name = nm, .type = K_INT, NOFIELD,           \
		.kind = KIND_OBSERVE, .ilo = 0, .ihi = ANY_INT,                \
		.auto_doc = AUTO_ABSENT,                                       \
		.doc = "stage 3 tuning (stage 3 is "                           \
		       "refused)"                                              \
	}
	ZERO3_INT("stage3_prefetch_bucket_size"),
	ZERO3_INT("prefetch_bucket_size"),
	ZERO3_INT("stage3_param_persistence_threshold"),
	ZERO3_INT("param_persistence_threshold"),
	ZERO3_INT("model_persistence_threshold"),
	ZERO3_INT("stage3_max_live_parameters"),
	ZERO3_INT("max_live_parameters"),
	ZERO3_INT("stage3_max_reuse_distance"),
	ZERO3_INT("max_reuse_distance"),
#undef ZERO3_INT
	OBS_ROW(SEC_ZERO, "stage3_gather_16bit_weights_on_model_save", K_BOOL,
		"stage 3 saving"),
	OBS_ROW(SEC_ZERO, "gather_16bit_weights_on_model_save", K_BOOL,
		"stage 3 saving"),
	OBS_ROW(SEC_ZERO, "stage3_gather_fp16_weights_on_model_save", K_BOOL,
		"stage 3 saving"),
	NOTIMPL_ROW(SEC_ZERO, "cpu_offload", K_BOOL,
		    "the old spelling of optimizer offload to the CPU"),
	NOTIMPL_ROW(SEC_ZERO, "zero_quantized_weights", K_BOOL,
		    "ZeRO++ quantized weight communication"),
	NOTIMPL_ROW(SEC_ZERO, "zero_quantized_nontrainable_weights", K_BOOL,
		    "ZeRO++ quantized frozen weights"),
	NOTIMPL_ROW(SEC_ZERO, "zero_quantized_gradients", K_BOOL,
		    "ZeRO++ quantized gradient communication"),
	{ .sec = SEC_ZERO,
	  .name = "zero_hpz_partition_size",
	  .type = K_INT,
	  NOFIELD,
	  .ilo = 0,
	  .ihi = INT_FIELD_MAX,
	  .def = 1,
	  .kind = KIND_NOT_IMPL,
	  .doc_default = "1",
	  .doc = "ZeRO++ hierarchical partitioning: 1 (off) only" },
	{ .sec = SEC_ZERO,
	  .name = "mics_shard_size",
	  .type = K_INT,
	  NOFIELD,
	  .ilo = -1,
	  .ihi = INT_FIELD_MAX,
	  .def = -1,
	  .kind = KIND_NOT_IMPL,
	  .doc_default = "-1",
	  .doc = "MiCS sharding: -1 (off) only" },

	/* ---- zero_optimization.offload_optimizer / offload_param */
	{ .sec = SEC_OFFLOAD,
	  .name = "device",
	  .type = K_ENUM,
	  FO(device),
	  NOGIVEN,
	  CH(offload_devices),
	  .def = EJ_OFFLOAD_NONE,
	  .refused = "`\"cpu\"`, `\"nvme\"`: by initialize (offload is not "
		     "implemented in epjit)",
	  .doc = "where the state goes" },
	{ .sec = SEC_OFFLOAD,
	  .name = "pin_memory",
	  .type = K_BOOL,
	  FO(pin_memory),
	  NOGIVEN,
	  .kind = KIND_OBSERVE,
	  .doc = "offload tuning" },
	{ .sec = SEC_OFFLOAD,
	  .name = "nvme_path",
	  .type = K_STR,
	  FO(nvme_path),
	  NOGIVEN,
	  .flags = K_NULL_OK | K_W_NONZERO,
	  .doc_default = "null",
	  .kind = KIND_OBSERVE,
	  .doc = "required with `\"nvme\"`" },
	{ .sec = SEC_OFFLOAD,
	  .name = "buffer_count",
	  .type = K_INT,
	  NOFIELD,
	  .ilo = 1,
	  .ihi = BATCH_MAX,
	  .kind = KIND_OBSERVE,
	  .doc = "offload tuning" },
	{ .sec = SEC_OFFLOAD,
	  .name = "buffer_size",
	  .type = K_INT,
	  NOFIELD,
	  .ilo = 1,
	  .ihi = ANY_INT,
	  .kind = KIND_OBSERVE,
	  .doc = "offload tuning" },
	{ .sec = SEC_OFFLOAD,
	  .name = "max_in_cpu",
	  .type = K_INT,
	  NOFIELD,
	  .ilo = 0,
	  .ihi = ANY_INT,
	  .kind = KIND_OBSERVE,
	  .doc = "offload tuning" },
	{ .sec = SEC_OFFLOAD,
	  .name = "fast_init",
	  .type = K_BOOL,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .doc = "offload tuning" },
	{ .sec = SEC_OFFLOAD,
	  .name = "pipeline_read",
	  .type = K_BOOL,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .doc = "offload tuning" },
	{ .sec = SEC_OFFLOAD,
	  .name = "pipeline_write",
	  .type = K_BOOL,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .doc = "offload tuning" },
	{ .sec = SEC_OFFLOAD,
	  .name = "ratio",
	  .type = K_NUM,
	  NOFIELD,
	  .lo = 0,
	  .hi = 1,
	  .kind = KIND_OBSERVE,
	  .doc = "offload tuning" },

	/* ---- activation_checkpointing */
	{ .sec = SEC_ACT_CKPT,
	  .name = "enabled",
	  .type = K_BOOL,
	  F(activation_checkpointing.enabled),
	  NOGIVEN,
	  .doc = "**epjit extension.** Checkpoints every decoder block "
		 "`model.layers.N` (nested layout) or the root block (root "
		 "layout): forward under no-grad keeping only the inputs, "
		 "forward replayed in backward. Same as `epjit-train "
		 "--checkpointing`" },
	{ .sec = SEC_ACT_CKPT,
	  .name = "partition_activations",
	  .type = K_BOOL,
	  F(activation_checkpointing.partition_activations),
	  NOGIVEN,
	  .kind = KIND_OBSERVE,
	  .doc = "DeepSpeed's checkpointing tuning (memory only)" },
	{ .sec = SEC_ACT_CKPT,
	  .name = "cpu_checkpointing",
	  .type = K_BOOL,
	  F(activation_checkpointing.cpu_checkpointing),
	  NOGIVEN,
	  .kind = KIND_OBSERVE,
	  .doc = "DeepSpeed's checkpointing tuning (memory only)" },
	{ .sec = SEC_ACT_CKPT,
	  .name = "contiguous_memory_optimization",
	  .type = K_BOOL,
	  F(activation_checkpointing.contiguous_memory_optimization),
	  NOGIVEN,
	  .kind = KIND_OBSERVE,
	  .doc = "DeepSpeed's checkpointing tuning (memory only)" },
	{ .sec = SEC_ACT_CKPT,
	  .name = "number_checkpoints",
	  .type = K_INT,
	  F(activation_checkpointing.number_checkpoints),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = BATCH_MAX,
	  .flags = K_NULL_OK,
	  .doc_default = "null",
	  .kind = KIND_OBSERVE,
	  .doc = "DeepSpeed's checkpointing tuning (memory only)" },
	{ .sec = SEC_ACT_CKPT,
	  .name = "synchronize_checkpoint_boundary",
	  .type = K_BOOL,
	  F(activation_checkpointing.synchronize_checkpoint_boundary),
	  NOGIVEN,
	  .kind = KIND_OBSERVE,
	  .doc = "DeepSpeed's checkpointing tuning (memory only)" },
	{ .sec = SEC_ACT_CKPT,
	  .name = "profile",
	  .type = K_BOOL,
	  F(activation_checkpointing.profile),
	  NOGIVEN,
	  .kind = KIND_OBSERVE,
	  .doc = "DeepSpeed's checkpointing tuning (memory only)" },

	/* ---- expert_parallel */
	{ .sec = SEC_EP,
	  .name = "enabled",
	  .type = K_BOOL,
	  F(expert_parallel.enabled),
	  NOGIVEN,
	  .doc = "parsed only: every MoE layer of the model is an AutoEP "
		 "layer whatever it says" },
	{ .sec = SEC_EP,
	  .name = "autoep_size",
	  .type = K_INT,
	  F(expert_parallel.autoep_size),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = INT_FIELD_MAX,
	  .def = 1,
	  .doc = "expert-parallel group size: the experts of every AutoEP "
		 "layer are sharded over groups of this many consecutive "
		 "ranks; must divide the world size, and `num_experts` must "
		 "be divisible by it" },
	{ .sec = SEC_EP,
	  .name = "comm_backend",
	  .type = K_NAME,
	  F(expert_parallel.comm_backend),
	  NOGIVEN,
	  CH(comm_backends),
	  .def_str = "comm",
	  .refused = "`\"deepep\"`: by initialize (DeepEP is not implemented "
		     "in epjit)",
	  .doc = "AutoEP's token exchange" },
	{ .sec = SEC_EP,
	  .name = "preset_model",
	  .type = K_NAME,
	  F(expert_parallel.preset_model),
	  NOGIVEN,
	  CH(preset_models),
	  .flags = K_NULL_OK,
	  .doc_default = "null",
	  .hook = hook_preset_model,
	  .refused = "`\"minimax_m3\"`, `\"llama4\"`: by the parser "
		     "(not implemented in epjit); another family than the "
		     "model's: by initialize",
	  .doc = "DeepSpeed's preset of the model family: checked against "
		 "the model's `model_type` (`mixtral`; `qwen3_moe` for "
		 "`qwen3_moe` and `qwen2_moe`; `qwen3_5_moe` for "
		 "`qwen3_5_moe_text`; `deepseek_v2`; `deepseek_v3`); null: "
		 "the model's" },
	{ .sec = SEC_EP,
	  .name = "async_split_plan",
	  .type = K_BOOL,
	  F(expert_parallel.async_split_plan),
	  NOGIVEN,
	  .doc = "post the count exchange (split plan) as a non-blocking "
		 "collective before the local token permutation and wait for "
		 "it after, instead of exchanging it before; same numbers. "
		 "Counted: `autoep.split_plan.async` / `.sync`, "
		 "`autoep.split_plan.overlapped_ops`" },
	{ .sec = SEC_EP,
	  .name = "top_k",
	  .type = K_SPECIAL,
	  F(expert_parallel.top_k),
	  NOGIVEN,
	  .store = K_INT,
	  .hook = hook_top_k,
	  .wr = wr_top_k,
	  .doc_value = "a positive integer or `\"auto\"`",
	  .doc_default = "`\"auto\"`",
	  .auto_doc = "the model's `num_experts_per_tok`",
	  .refused = "by initialize when it differs from the model's "
		     "`num_experts_per_tok`",
	  .doc = "experts per token (`\"auto\"`: the model's "
		 "`num_experts_per_tok`)" },
	{ .sec = SEC_EP,
	  .name = "route_norm",
	  .type = K_SPECIAL,
	  F(expert_parallel.route_norm),
	  NOGIVEN,
	  .store = K_INT,
	  .def = -1,
	  .hook = hook_route_norm,
	  .wr = wr_route_norm,
	  .doc_value = "a boolean or null",
	  .doc_default = "null",
	  .refused = "by initialize when it differs from the model's "
		     "`norm_topk_prob` (Mixtral and Qwen3.5-MoE always "
		     "renormalise, DeepSeek-V2 never)",
	  .doc = "renormalise the top-k weights (null: the model's "
		 "`norm_topk_prob`)" },
	{ .sec = SEC_EP,
	  .name = "route_scale",
	  .type = K_NUM,
	  F(expert_parallel.route_scale),
	  NOGIVEN,
	  .lo = -HUGE_VAL,
	  .hi = HUGE_VAL,
	  .def = 1.0,
	  .refused = "by initialize when it is the scale (no "
		     "`routed_scaling_factor` in the config or the model) "
		     "and differs from the model's: 1 for Mixtral and the "
		     "Qwen families",
	  .doc = "the routing weights times this, unless "
		 "`routed_scaling_factor` or the model's own (DeepSeek's "
		 "config.json) is given: then that one, as DeepSpeed's "
		 "`_resolve_route_scale` (a warning names the one "
		 "overridden)" },
	{ .sec = SEC_EP,
	  .name = "routed_scaling_factor",
	  .type = K_SPECIAL,
	  F(expert_parallel.routed_scaling_factor),
	  NOGIVEN,
	  .store = K_NUM,
	  .hook = hook_rsf,
	  .wr = wr_rsf,
	  .doc_value = "a number or `\"auto\"`",
	  .doc_default = "`\"auto\"`",
	  .refused = "by initialize when it differs from the model's "
		     "`routed_scaling_factor` (DeepSeek) or from 1 (the "
		     "other families)",
	  .doc = "the scale of the routing weights, over `route_scale` "
		 "(`\"auto\"`: the model's `routed_scaling_factor` when "
		 "its config has one, else `route_scale`)" },
	{ .sec = SEC_EP,
	  .name = "score_func",
	  .type = K_NAME,
	  F(expert_parallel.score_func),
	  NOGIVEN,
	  CH(score_funcs),
	  .def_str = "auto",
	  .refused = "by initialize when it differs from the family's "
		     "(sigmoid for DeepSeek-V3, softmax for the others)",
	  .doc = "the router's scores (`\"auto\"`: the model's)" },
	{ .sec = SEC_EP,
	  .name = "score_apply",
	  .type = K_NAME,
	  F(expert_parallel.score_apply),
	  NOGIVEN,
	  CH(score_applies),
	  .def_str = "auto",
	  .refused = "`\"pre\"`: by initialize (every family weights the "
		     "experts' outputs, `\"post\"`; weighting their inputs "
		     "is not implemented)",
	  .doc = "where the routing weights apply (`\"auto\"`: the "
		 "model's, `\"post\"`)" },
	{ .sec = SEC_EP,
	  .name = "num_expert_groups",
	  .type = K_INT,
	  F(expert_parallel.num_expert_groups),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = INT_FIELD_MAX,
	  .flags = K_NULL_OK,
	  .doc_default = "null",
	  .refused = "by initialize when it differs from the model's "
		     "`n_group` (group-limited DeepSeek routing), or, for a "
		     "model without groups, unless `num_limited_groups` "
		     "equals it (every group kept)",
	  .doc = "expert groups of group-limited routing (null: the "
		 "model's `n_group`)" },
	{ .sec = SEC_EP,
	  .name = "num_limited_groups",
	  .type = K_INT,
	  F(expert_parallel.num_limited_groups),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = INT_FIELD_MAX,
	  .flags = K_NULL_OK,
	  .doc_default = "null",
	  .refused = "above `num_expert_groups`: by the parser; by "
		     "initialize when it differs from the model's "
		     "`topk_group`, or without groups (as DeepSpeed)",
	  .doc = "groups kept per token (null: the model's `topk_group`)" },
	{ .sec = SEC_EP,
	  .name = "fixed_routing",
	  .type = K_BOOL,
	  F(expert_parallel.fixed_routing),
	  NOGIVEN,
	  .doc = "**epjit extension** for benchmarks: token n's j-th expert "
		 "is `(n * top_k + j) % num_experts`; the weights still come "
		 "from the router, so it trains" },
	{ .sec = SEC_EP,
	  .name = "load_balance_coeff",
	  .type = K_NUM,
	  F(expert_parallel.load_balance_coeff),
	  GIVEN(expert_parallel.has_load_balance),
	  .lo = 0,
	  .hi = HUGE_VAL,
	  .flags = K_NULL_OK,
	  .def = 0,
	  .doc = "aux-loss-free balancing (DeepSeek-V3's rule): after every "
		 "optimizer step each expert score bias "
		 "(`e_score_correction_bias`, DeepSeek-V3) moves by this "
		 "rate towards balance, `b += rate * sign(mean load - "
		 "load)` over the step's tokens on all ranks; 0 or null: "
		 "off, the default, so a checkpoint's bias stays as loaded "
		 "unless asked. An **epjit extension** where it is > 0: "
		 "DeepSpeed 0.19.8 has no aux-loss-free balancing, and its "
		 "`parse_autoep_config` raises a ValueError (`load_balance_"
		 "coeff=... is not supported in this AutoEP build`) for any "
		 "value but null, 0 included, whatever `enabled` says; its "
		 "DeepSeek presets default it to null. A model without a score "
		 "bias logs `[info] "
		 "expert_parallel.load_balance_coeff: this model has no "
		 "expert score bias (DeepSeek-V3's e_score_correction_bias); "
		 "routing uses the router logits only` when it is > 0" },
	{ .sec = SEC_EP,
	  .name = "expert_tensor_parallel_size",
	  .type = K_INT,
	  NOFIELD,
	  .kind = KIND_NOT_IMPL,
	  .ilo = 1,
	  .ihi = INT_FIELD_MAX,
	  .def = 1,
	  .refused = "> 1: by the parser (expert tensor parallelism is not "
		     "implemented in epjit; DeepSpeed 0.19.8 refuses it "
		     "too)",
	  .doc_default = "1",
	  .doc = "expert tensor parallelism" },
	{ .sec = SEC_EP,
	  .name = "validate_folding_routing",
	  .type = K_BOOL,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .doc_default = "false",
	  .doc = "DeepSpeed's debugging check of AutoEP+AutoTP folding; "
		 "epjit has no folding (AutoTP is not implemented)" },
	{ .sec = SEC_EP,
	  .name = "use_grouped_mm",
	  .type = K_BOOL,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .doc_default = "true",
	  .doc = "kernel choice (torch's grouped GEMM or a loop): epjit's "
		 "expert GEMMs are its own, the numbers the same" },
	{ .sec = SEC_EP,
	  .name = "disable_triton_grouped_mm",
	  .type = K_BOOL,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .doc_default = "false",
	  .doc = "kernel choice (Triton's grouped GEMM), as "
		 "`use_grouped_mm`" },
	{ .sec = SEC_EP,
	  .name = "combine_impl",
	  .type = K_NAME,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  CH(combine_impls),
	  .doc_default = "`\"auto\"`",
	  .doc = "kernel choice of the weighted combine: epjit's combine "
		 "accumulates in fp32 (doc/design.md)" },
	{ .sec = SEC_EP,
	  .name = "row_weighting_impl",
	  .type = K_NAME,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  CH(row_weighting_impls),
	  .doc_default = "`\"auto\"`",
	  .doc = "kernel choice inside DeepEP's route (not implemented in "
		 "epjit)" },
	{ .sec = SEC_EP,
	  .name = "gate_up_impl",
	  .type = K_NAME,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  CH(gate_up_impls),
	  .doc_default = "`\"separate\"`",
	  .doc = "kernel choice: the gate and up projections as one GEMM or "
		 "two; the same products" },
	{ .sec = SEC_EP,
	  .name = "comm_num_sm",
	  .type = K_INT,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .ilo = 1,
	  .ihi = ANY_INT,
	  .doc_default = "12",
	  .doc = "DeepEP tuning (SMs of its kernels); DeepEP is not "
		 "implemented in epjit" },
	{ .sec = SEC_EP,
	  .name = "comm_qp_margin",
	  .type = K_INT,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .ilo = 0,
	  .ihi = ANY_INT,
	  .doc_default = "4",
	  .doc = "DeepEP tuning (RDMA queue pairs), as `comm_num_sm`" },
	{ .sec = SEC_EP,
	  .name = "comm_max_tokens_per_rank",
	  .type = K_INT,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .ilo = 0,
	  .ihi = ANY_INT,
	  .doc_default = "0",
	  .doc = "DeepEP's buffer size, as `comm_num_sm`" },
	{ .sec = SEC_EP,
	  .name = "expert_activation",
	  .type = K_NAME,
	  .off = -1,
	  .given_off = -1,
	  .kind = KIND_NOT_IMPL,
	  CH(expert_activations),
	  .flags = K_W_NEVER | K_NULL_OK,
	  .refused = "other than `\"swiglu\"`: by the parser",
	  .doc_default = "null",
	  .doc = "the experts' activation: epjit's are SwiGLU in every "
		 "family (`\"swiglu\"`, the same as null)" },
#define CUSTOM_ROW(nm, t, fl)                                                  \
	{                                                                      \
		.sec = SEC_EP, .name = nm, .type = t, .off = -1,               \
		.given_off = -1, .flags = K_W_NEVER | K_ON_SET | (fl),         \
		.kind = KIND_NOT_IMPL,                                         \
		.refused = "any value but null: by the parser",                \
		.doc_default = "null",                                         \
		.doc = "a custom model's layout for DeepSpeed's module "       \
		       "detection; epjit builds its families from "            \
		       "config.json"                                           \
	}
	CUSTOM_ROW("moe_layer_pattern", K_TEXT, 0),
	CUSTOM_ROW("expert_pattern", K_TEXT, 0),
	CUSTOM_ROW("router_pattern", K_TEXT, 0),
	CUSTOM_ROW("expert_w1", K_TEXT, 0),
	CUSTOM_ROW("expert_w2", K_TEXT, 0),
	CUSTOM_ROW("expert_w3", K_TEXT, 0),
	CUSTOM_ROW("num_experts_attr", K_TEXT, 0),
	CUSTOM_ROW("top_k_attr", K_TEXT, 0),
	CUSTOM_ROW("has_shared_experts", K_BOOL, K_NULL_OK),
	CUSTOM_ROW("shared_experts_pattern", K_TEXT, 0),
	CUSTOM_ROW("shared_experts_gate_pattern", K_TEXT, 0),
#undef CUSTOM_ROW

	/* ---- compile */
	{ .sec = SEC_COMPILE,
	  .name = "autoep_non_moe",
	  .type = K_BOOL,
	  F(compile.autoep_non_moe),
	  NOGIVEN,
	  .doc = "`epj_engine_compile` compiles the callable parent of every "
		 "AutoEP layer (regional) instead of the whole model; turns "
		 "on the support boundary (*The support boundary of "
		 "`compile.autoep_non_moe`* below)" },
	{ .sec = SEC_COMPILE,
	  .name = "backend",
	  .type = K_NAME,
	  F(compile.backend),
	  NOGIVEN,
	  .registry = ej_backend_names,
	  .flags = K_NULL_OK,
	  .doc_default = "null (the device's: `c` on cpu, `cuda-sim`, "
			 "`nvrtc` on cuda)",
	  .refused = "by `epj_engine_compile` when this build lacks it",
	  .doc = "the code generator of compiled regions" },
	{ .sec = SEC_COMPILE,
	  .name = "fullgraph",
	  .type = K_TRISTATE,
	  F(compile.fullgraph),
	  GIVEN(compile.fullgraph_given),
	  .def = EJ_JSON_FALSE,
	  .refused = "by `epj_engine_compile`: true or null with "
		     "`compile.autoep_non_moe` (every AutoEP layer is a "
		     "graph break), true in full-model mode (not "
		     "implemented)",
	  .doc = "null is kept as null" },
	{ .sec = SEC_COMPILE,
	  .name = "dynamic",
	  .type = K_TRISTATE,
	  F(compile.dynamic),
	  GIVEN(compile.dynamic_given),
	  .def = EJ_JSON_FALSE,
	  .refused = "by `epj_engine_compile`: true or null with "
		     "`compile.autoep_non_moe` (regions are compiled for "
		     "static shapes)",
	  .doc = "null is kept as null" },
	{ .sec = SEC_COMPILE,
	  .name = "deepcompile",
	  .type = K_BOOL,
	  F(compile.deepcompile),
	  NOGIVEN,
	  .refused = "true: by `epj_engine_compile` (DeepCompile is not "
		     "implemented)",
	  .doc = "DeepCompile" },
	{ .sec = SEC_COMPILE,
	  .name = "compiled_autograd",
	  .type = K_BOOL,
	  F(compile.compiled_autograd),
	  NOGIVEN,
	  .refused = "true: by `epj_engine_compile` (not implemented)",
	  .doc = "compiled autograd" },
	{ .sec = SEC_COMPILE,
	  .name = "schedule",
	  .type = K_SPECIAL,
	  F(compile.schedule_present),
	  NOGIVEN,
	  .store = K_BOOL,
	  .hook = hook_schedule,
	  .wr = wr_schedule,
	  .doc_value = "an array, an object or null",
	  .doc_default = "null",
	  .refused = "any value but null: by `epj_engine_compile` "
		     "(DeepCompile schedules are not implemented)",
	  .doc = "DeepCompile schedule; only its presence is kept" },

/* ---- compile: DeepCompile's tuning (DeepCompile is refused) */
#define DC_BOOL(nm) OBS_ROW(SEC_COMPILE, nm, K_BOOL, "DeepCompile tuning")
	DC_BOOL("free_activation"),
	OBS_ROW(SEC_COMPILE, "free_activation_threshold", K_INT,
		"DeepCompile tuning"),
	DC_BOOL("offload_activation"),
	DC_BOOL("offload_activation_pin_memory"),
	DC_BOOL("offload_opt_states"),
	DC_BOOL("offload_parameters"),
	DC_BOOL("double_buffer"),
	DC_BOOL("symmetric_memory"),
	DC_BOOL("debug_log"),
	DC_BOOL("sync_before_reduce"),
	DC_BOOL("sync_after_reduce"),
	DC_BOOL("sync_before_allgather"),
	DC_BOOL("sync_after_allgather"),
	DC_BOOL("keep_int_input_tensors"),
	DC_BOOL("keep_all_input_tensors"),
#undef DC_BOOL
	OBS_ROW(SEC_COMPILE, "passes", K_ANY, "DeepCompile's pass list"),

	/* ---- wandb, comet, flops_profiler, comms_logger, aio, checkpoint */
	OBS_ROW(SEC_WANDB, "enabled", K_BOOL, "log to W&B"),
	OBS_ROW(SEC_WANDB, "group", K_TEXT, "W&B group"),
	OBS_ROW(SEC_WANDB, "team", K_TEXT, "W&B team"),
	OBS_ROW(SEC_WANDB, "project", K_TEXT, "W&B project"),
	OBS_ROW(SEC_COMET, "enabled", K_BOOL, "log to Comet"),
	OBS_ROW(SEC_COMET, "samples_log_interval", K_INT, "samples per log"),
	OBS_ROW(SEC_COMET, "project", K_TEXT, "Comet project"),
	OBS_ROW(SEC_COMET, "workspace", K_TEXT, "Comet workspace"),
	OBS_ROW(SEC_COMET, "api_key", K_TEXT, "Comet key"),
	OBS_ROW(SEC_COMET, "experiment_name", K_TEXT, "Comet experiment"),
	OBS_ROW(SEC_COMET, "experiment_key", K_TEXT, "Comet experiment key"),
	OBS_ROW(SEC_COMET, "online", K_ANY, "Comet online mode"),
	OBS_ROW(SEC_COMET, "mode", K_TEXT, "Comet mode"),
	OBS_ROW(SEC_FLOPS_PROFILER, "enabled", K_BOOL, "profile one step"),
	OBS_ROW(SEC_FLOPS_PROFILER, "recompute_fwd_factor", K_NUM,
		"forward recomputation factor"),
	OBS_ROW(SEC_FLOPS_PROFILER, "profile_step", K_INT, "the step"),
	{ .sec = SEC_FLOPS_PROFILER,
	  .name = "module_depth",
	  .type = K_INT,
	  NOFIELD,
	  .kind = KIND_OBSERVE,
	  .ilo = -1,
	  .ihi = ANY_INT,
	  .doc = "depth of the report" },
	OBS_ROW(SEC_FLOPS_PROFILER, "top_modules", K_INT, "modules listed"),
	OBS_ROW(SEC_FLOPS_PROFILER, "detailed", K_BOOL, "per-module report"),
	OBS_ROW(SEC_FLOPS_PROFILER, "output_file", K_TEXT, "report file"),
	OBS_ROW(SEC_COMMS_LOGGER, "enabled", K_BOOL, "log collectives"),
	OBS_ROW(SEC_COMMS_LOGGER, "verbose", K_BOOL, "every call"),
	OBS_ROW(SEC_COMMS_LOGGER, "prof_all", K_BOOL, "all operations"),
	OBS_ROW(SEC_COMMS_LOGGER, "debug", K_BOOL, "caller names"),
	OBS_ROW(SEC_COMMS_LOGGER, "prof_ops", K_ANY, "operations to log"),
	OBS_ROW(SEC_AIO, "block_size", K_INT, "I/O block bytes"),
	OBS_ROW(SEC_AIO, "queue_depth", K_INT, "I/O queue depth"),
	OBS_ROW(SEC_AIO, "intra_op_parallelism", K_INT, "I/O threads"),
	OBS_ROW(SEC_AIO, "thread_count", K_INT, "I/O threads (old name)"),
	OBS_ROW(SEC_AIO, "single_submit", K_BOOL, "submission mode"),
	OBS_ROW(SEC_AIO, "overlap_events", K_BOOL, "event overlap"),
	OBS_ROW(SEC_AIO, "use_gds", K_BOOL, "GPUDirect Storage"),
	OBS_ROW(SEC_CHECKPOINT, "tag_validation", K_TEXT,
		"DeepSpeed's tag check across ranks (`\"Ignore\"`, "
		"`\"Warn\"`, `\"Fail\"`); epjit's multi-rank saves commit one "
		"record (doc/formats.md)"),
	NOTIMPL_ROW(SEC_CHECKPOINT, "load_universal", K_BOOL,
		    "load a universal checkpoint"),
	OBS_ROW(SEC_CHECKPOINT, "use_node_local_storage", K_BOOL,
		"per-node checkpoint storage"),
	OBS_ROW(SEC_CHECKPOINT, "parallel_write", K_ANY,
		"pipeline-stage parallel writes"),
	OBS_ROW(SEC_CHECKPOINT, "checkpoint_serialization", K_BOOL,
		"DeepSpeed's torch.save serialization"),
	{ SECTION(SEC_CHECKPOINT, "writer", SEC_CKPT_WRITER), NOGIVEN,
	  .wr = wr_if_decoupled,
	  .doc = "DeepSpeed's checkpoint writer (its fast and decoupled "
		 "checkpoint engines)" },
	{ .sec = SEC_CKPT_WRITER,
	  .name = "decoupled",
	  .type = K_BOOL,
	  F(checkpoint_decoupled),
	  NOGIVEN,
	  .doc = "true: `epjit-train`'s periodic saves (`--save-every`) are "
		 "background saves (as with `--save-async`): the state is "
		 "copied to host memory between two optimizer steps and a "
		 "writer thread writes it while training goes on "
		 "(doc/ckpt.md, `epj_engine_save_async`)" },
	OBS_ROW(SEC_CKPT_WRITER, "type", K_TEXT,
		"DeepSpeed's writer (`\"mock\"`, `\"python\"`, `\"fast\"`)"),
	OBS_ROW(SEC_CKPT_WRITER, "io_buffer_size", K_INT,
		"the fast writer's buffer bytes"),
	OBS_ROW(SEC_CKPT_WRITER, "io_buffer_double", K_BOOL,
		"the fast writer's double buffering"),
	OBS_ROW(SEC_CKPT_WRITER, "show_statistics", K_BOOL,
		"the fast writer's statistics"),
	OBS_ROW(SEC_CKPT_WRITER, "data_parallel", K_TEXT,
		"which data-parallel ranks write (`\"replica\"`, "
		"`\"socket\"`, `\"machine\"`); every epjit rank writes its "
		"own file"),
	OBS_ROW(SEC_CKPT_WRITER, "io_multiplier", K_INT,
		"the fast writer's I/O multiplier"),

	/* ---- pipeline, tensor_parallel, comm */
	{ .sec = SEC_PIPELINE,
	  .name = "stages",
	  .type = K_INT,
	  F(pipeline_stages),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = INT_FIELD_MAX,
	  .def = 1,
	  .refused = "> 1: by initialize (pipeline parallelism is not "
		     "implemented in epjit)",
	  .doc = "pipeline stages" },
	{ .sec = SEC_TP,
	  .name = "autotp_size",
	  .type = K_INT,
	  F(autotp_size),
	  NOGIVEN,
	  .ilo = 1,
	  .ihi = INT_FIELD_MAX,
	  .def = 1,
	  .refused = "> 1: by initialize (AutoTP is not implemented in "
		     "epjit)",
	  .doc = "AutoTP group size" },
/* ---- moe: Megatron Core's router losses (runtime/router_loss.c) */
#define MOE_REFUSED                                                            \
	"> 0 with the model's `output_router_logits` true: by initialize "     \
	"(one load-balancing loss)"
#define MOE_COEFF(nm, fld, r, d)                                               \
	{                                                                      \
		.sec = SEC_MOE, .name = nm, .type = K_NUM, F(moe.fld),         \
		NOGIVEN, .lo = 0, .hi = HUGE_VAL, .flags = K_NULL_OK,          \
		.def = 0, .refused = r, .doc = d                               \
	}
	MOE_COEFF("aux_loss_coeff", aux_loss_coeff, MOE_REFUSED,
		  "Megatron's `aux_loss`: per MoE layer `E / (k T^2) sum_e "
		  "P_e c_e` over the micro-batch's T tokens (P_e: the sum of "
		  "the router's probabilities of expert e, c_e: the tokens "
		  "whose top-k takes e)"),
	MOE_COEFF("seq_aux_loss_coeff", seq_aux_loss_coeff, MOE_REFUSED,
		  "Megatron's `seq_aux_loss`: the same per sequence, averaged "
		  "over the micro-batch's sequences"),
	MOE_COEFF("global_aux_loss_coeff", global_aux_loss_coeff, MOE_REFUSED,
		  "Megatron's `global_aux_loss`: c_e summed over the ranks "
		  "and averaged over the micro-batches of the step so far, T "
		  "the tokens of all ranks"),
	MOE_COEFF("z_loss_coeff", z_loss_coeff, NULL,
		  "Megatron's router z-loss: per MoE layer the mean over the "
		  "tokens of `logsumexp(logits)^2`"),
#undef MOE_COEFF
#undef MOE_REFUSED
	{ .sec = SEC_COMM,
	  .name = "timeout_s",
	  .type = K_NUM,
	  F(comm_timeout_s),
	  NOGIVEN,
	  .lo = 0,
	  .hi = 86400.0 * 7,
	  .flags = K_LO_OPEN,
	  .def = 300,
	  .doc = "**epjit extension.** Bound of every blocking collective of "
		 "the `mpi` comm, in seconds (at most a week): a collective "
		 "that a peer does not join in time (it stopped, died or is "
		 "in another call) fails with a message naming the call, the "
		 "group and the rank, and the run stops (`epjit-train` exits "
		 "1; the launcher ends the other ranks)" },
	{ .sec = SEC_COMM,
	  .name = "backend",
	  .type = K_NAME,
	  F(comm_backend),
	  NOGIVEN,
	  CH(comm_device_backends),
	  .def_str = "auto",
	  .doc = "**epjit extension.** The comm for collectives on device "
		 "buffers: `\"nccl\"` (NCCL on the cuda device over the "
		 "world's ranks; refused on other devices), `\"host\"` "
		 "(the world's host collectives only) or `\"auto\"` (NCCL "
		 "on the cuda device over two or more ranks when "
		 "`libnccl.so.2` loads, else host). With two or more "
		 "ranks on the cuda device the expert rows and the "
		 "optimizer's gradients and parameters are device memory and "
		 "go over NCCL (comms for the DP, EP and EDP groups), so "
		 "`\"host\"`, or `\"auto\"` without NCCL, is refused by "
		 "initialize. `EPJIT_COMM` overrides it" },

	/* ---- csv_monitor */
	{ .sec = SEC_CSV_MONITOR,
	  .name = "enabled",
	  .type = K_BOOL,
	  F(csv_monitor.enabled),
	  NOGIVEN,
	  .doc = "write the CSV files" },
	{ .sec = SEC_CSV_MONITOR,
	  .name = "output_path",
	  .type = K_STR,
	  F(csv_monitor.output_path),
	  NOGIVEN,
	  .def_str = "",
	  .doc = "parent folder; the files go to `output_path/job_name/` "
		 "(`job_name/` in the working directory when empty, as "
		 "DeepSpeed does)" },
	{ .sec = SEC_CSV_MONITOR,
	  .name = "job_name",
	  .type = K_STR,
	  F(csv_monitor.job_name),
	  NOGIVEN,
	  .def_str = "DeepSpeedJobName",
	  .doc = "the run's folder; must not be empty" },

	/* ---- tensorboard */
	{ .sec = SEC_TENSORBOARD,
	  .name = "enabled",
	  .type = K_BOOL,
	  F(tensorboard.enabled),
	  NOGIVEN,
	  .doc = "write the event file" },
	{ .sec = SEC_TENSORBOARD,
	  .name = "output_path",
	  .type = K_STR,
	  F(tensorboard.output_path),
	  NOGIVEN,
	  .def_str = "",
	  .doc = "parent folder; the event files go to "
		 "`output_path/job_name/` (`job_name/` in the working "
		 "directory when empty, as DeepSpeed does)" },
	{ .sec = SEC_TENSORBOARD,
	  .name = "job_name",
	  .type = K_STR,
	  F(tensorboard.job_name),
	  NOGIVEN,
	  .def_str = "DeepSpeedJobName",
	  .doc = "the run's folder (TensorBoard's run name); must not be "
		 "empty" },

	/* ---- data (offsets from ej_config.data) */
	{ .sec = SEC_DATA,
	  .name = "path",
	  .type = K_STR,
	  .off = (long)offsetof(struct ej_data_config, path),
	  .size = sizeof(((struct ej_data_config *)0)->path),
	  NOGIVEN,
	  .def_str = "",
	  .flags = K_W_NONZERO,
	  .doc = "`--data`: a Megatron prefix, a `.npy` file, a blend "
		 "`\"W1 P1 W2 P2\"`, a token file, a `.txt` file or "
		 "`synthetic`" },
	{ .sec = SEC_DATA,
	  .name = "split",
	  .type = K_STR,
	  .off = (long)offsetof(struct ej_data_config, split),
	  .size = sizeof(((struct ej_data_config *)0)->split),
	  NOGIVEN,
	  .def_str = "",
	  .flags = K_W_NONZERO,
	  .doc_default = "\"\" (969,30,1)",
	  .doc = "`--split`: a token dataset's train,validation,test "
		 "document weights" },
	{ .sec = SEC_DATA,
	  .name = "seed",
	  .type = K_INT,
	  .off = (long)offsetof(struct ej_data_config, seed),
	  .size = sizeof(((struct ej_data_config *)0)->seed),
	  .given_off = (long)offsetof(struct ej_data_config, seed_given),
	  .ilo = 0,
	  .ihi = INT64_MAX,
	  .flags = K_W_NONZERO,
	  .doc_default = "derived from the run seed",
	  .doc = "seed of a token dataset's document and sample shuffles" },
#define DATA_BOOL(nm, fld, text)                                               \
	{                                                                      \
		.sec = SEC_DATA, .name = nm, .type = K_BOOL,                   \
		.off = (long)offsetof(struct ej_data_config, fld),             \
		.size = sizeof(((struct ej_data_config *)0)->fld), NOGIVEN,    \
		.flags = K_W_NONZERO, .doc = text                              \
	}
	DATA_BOOL("reset_attention_mask", reset_attention_mask,
		  "`--reset-attention-mask`: the documents packed in a row "
		  "(ended by `eod_token`) do not see each other (Megatron's "
		  "option; document ids are an input of attention, see "
		  "doc/trainer.md)"),
	DATA_BOOL("reset_position_ids", reset_position_ids,
		  "`--reset-position-ids`: positions restart at 0 after every "
		  "`eod_token` (Megatron's option)"),
	DATA_BOOL("eod_mask_loss", eod_mask_loss,
		  "`--eod-mask-loss`: the loss where the input token is "
		  "`eod_token` is not counted (Megatron's option)"),
	{ .sec = SEC_DATA,
	  .name = "eod_token",
	  .type = K_INT,
	  .off = (long)offsetof(struct ej_data_config, eod_token),
	  .size = sizeof(((struct ej_data_config *)0)->eod_token),
	  NOGIVEN,
	  .ilo = -1,
	  .ihi = INT32_MAX,
	  .def = -1,
	  .flags = K_W_NONZERO,
	  .doc_default = "-1 (none)",
	  .doc = "`--eod-token`: the end-of-document token id that "
		 "`reset_attention_mask`, `reset_position_ids` and "
		 "`eod_mask_loss` need" },
	DATA_BOOL("calculate_per_token_loss", per_token_loss,
		  "`--calculate-per-token-loss`: the loss of a step is the "
		  "sum of its counted token losses over every micro-batch and "
		  "rank divided by their number (Megatron's option); on by "
		  "itself with `eod_mask_loss` or a dataset with a loss mask"),
#undef DATA_BOOL
};

const char *ej_optim_type_name(ej_optim_type t)
{
	EJ_ASSERT((unsigned)t < EJ_ARRAY_LEN(optim_names));
	return optim_names[t];
}

const char *ej_sched_type_name(ej_sched_type t)
{
	if (t == EJ_SCHED_NONE)
		return "none";
	EJ_ASSERT((unsigned)t - 1 < EJ_ARRAY_LEN(sched_names));
	return sched_names[t - 1];
}

/* ==== field access ======================================================= */

static void set_str(char *dst, size_t n, const char *src)
{
	/* Zero-fills the rest so that configs compare bytewise. */
	memset(dst, 0, n);
	snprintf(dst, n, "%s", src);
}

static void *field(const key *k, const char *base)
{
	EJ_ASSERT(k->off >= 0);
	return (void *)(base + k->off);
}

static int64_t get_int(const key *k, const char *base)
{
	if (k->size == sizeof(int64_t)) {
		int64_t v;
		memcpy(&v, field(k, base), sizeof v);
		return v;
	}
	EJ_ASSERT(k->size == sizeof(int));
	int v;
	memcpy(&v, field(k, base), sizeof v);
	return v;
}

static void set_int(const key *k, char *base, int64_t x)
{
	if (k->size == sizeof(int64_t)) {
		memcpy(field(k, base), &x, sizeof x);
	} else {
		EJ_ASSERT(k->size == sizeof(int));
		int v = (int)x;
		memcpy(field(k, base), &v, sizeof v);
	}
}

static double get_num(const key *k, const char *base, int i)
{
	double v;
	memcpy(&v, (const char *)field(k, base) + i * sizeof v, sizeof v);
	return v;
}

static void set_num(const key *k, char *base, int i, double x)
{
	memcpy((char *)field(k, base) + i * sizeof x, &x, sizeof x);
}

static bool get_bool(const key *k, const char *base)
{
	return *(const bool *)field(k, base);
}

static void set_given(const key *k, char *base, bool v)
{
	if (k->given_off >= 0)
		*(bool *)(base + k->given_off) = v;
}

/* The base of section instance `child` of row k in its parent's base. */
static char *child_base(const key *k, char *base)
{
	return base + k->off;
}

static key_type stored_type(const key *k)
{
	return k->type == K_SPECIAL ? k->store : k->type;
}

/* ==== defaults =========================================================== */

static void defaults_of(int sec, char *base)
{
	for (size_t i = 0; i < EJ_ARRAY_LEN(keys); i++) {
		const key *k = &keys[i];
		if (k->sec != sec)
			continue;
		if (k->type == K_SECTION) {
			defaults_of(k->child, child_base(k, base));
			continue;
		}
		if (k->off < 0)
			continue;
		/* Offset 0 of the config is its source name: a row that
		 * names no field must say NOFIELD. */
		EJ_ASSERT(k->off > 0 || sec == SEC_OFFLOAD);
		switch (stored_type(k)) {
		case K_BOOL:
			*(bool *)field(k, base) = k->def != 0;
			break;
		case K_INT:
		case K_ENUM:
		case K_TRISTATE:
			set_int(k, base, (int64_t)k->def);
			break;
		case K_NUM:
			set_num(k, base, 0, k->def);
			/* A nullable number with a default has a value. */
			if (k->flags & K_NULL_OK)
				set_given(k, base, true);
			break;
		case K_PAIR:
			set_num(k, base, 0, k->def);
			set_num(k, base, 1, k->def2);
			break;
		case K_NAME:
		case K_STR:
			set_str(field(k, base), k->size,
				k->def_str ? k->def_str : "");
			break;
		case K_SECTION:
		case K_NUMBOOL:
		case K_SPECIAL:
		case K_TEXT:
		case K_ANY:
			EJ_ASSERT(!"a key without a stored type");
		}
	}
}

void ej_config_defaults(ej_config *c)
{
	memset(c, 0, sizeof *c);
	set_str(c->source, sizeof c->source, "<defaults>");
	defaults_of(SEC_ROOT, (char *)c);
}

/* ==== the reader ========================================================= */

struct cp {
	epj_ctx *ctx;
	const char *src;
	/* ej_config_parse gathers every error of the file (errs, nerr) and
	 * reports them together; elsewhere (batch resolution) an error is
	 * the context's at once. */
	bool collect;
	int nerr;
	size_t len;
	char *errs;
	size_t cap;
	json_t *auto_src; /* the caller's values of "auto", or NULL */
	int quiet;	  /* > 0 inside a section named as a whole */
};

/* An EPJ_ERR_CONFIG error naming the config's source (ej_config_error),
 * or, while collecting, one more line of the file's report. */
static epj_status cp_err(cp *p, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static epj_status cp_err(cp *p, const char *fmt, ...)
{
	char msg[896];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (!p->collect)
		return ej_config_error(p->ctx, p->src, "%s", msg);
	p->nerr++;
	/* one line per error (messages hold no newline) */
	if (p->len < p->cap) {
		p->len += (size_t)snprintf(p->errs + p->len, p->cap - p->len,
					   "%s\n", msg);
		if (p->len > p->cap - 1)
			p->len = p->cap - 1;
	}
	return EPJ_ERR_CONFIG;
}

static void key_path(char *buf, size_t n, const char *prefix, const char *key)
{
	if (prefix[0])
		snprintf(buf, n, "%s.%s", prefix, key);
	else
		snprintf(buf, n, "%s", key);
}

/* The keys of section sec, in table order, into names (at most max). */
static int section_keys(int sec, const char **names, int max)
{
	int n = 0;
	for (size_t i = 0; i < EJ_ARRAY_LEN(keys); i++)
		if (keys[i].sec == sec && n < max)
			names[n++] = keys[i].name;
	return n;
}

/* Every section instance (its dotted path and section) below sec at path,
 * depth first, appended to paths/secs from *n (at most max). */
static void instances(int sec, const char *path, char (*paths)[160], int *secs,
		      int *n, int max)
{
	if (*n < max) {
		snprintf(paths[*n], 160, "%s", path);
		secs[(*n)++] = sec;
	}
	for (size_t i = 0; i < EJ_ARRAY_LEN(keys); i++) {
		const key *k = &keys[i];
		if (k->sec != sec || k->type != K_SECTION)
			continue;
		char sub[160];
		key_path(sub, sizeof sub, path, k->name);
		instances(k->child, sub, paths, secs, n, max);
	}
}

/* Rejects any key of obj (section sec at path) that is not in the table. */
static epj_status check_keys(cp *p, json_t *obj, int sec, const char *spath)
{
	enum { MAXK = 96, MAXI = 48 };
	epj_status st = EPJ_OK;
	const char *names[MAXK];
	int nk = section_keys(sec, names, MAXK);
	const char *key;
	json_t *val;
	json_object_foreach(obj, key, val)
	{
		bool known = false;
		for (int i = 0; i < nk && !known; i++)
			known = strcmp(key, names[i]) == 0;
		if (known)
			continue;
		char path[300], hint[400] = "";
		key_path(path, sizeof path, spath, key);
		const char *near = ej_nearest_key(key, names, nk);
		if (near) {
			char np[300];
			key_path(np, sizeof np, spath, near);
			snprintf(hint, sizeof hint, " (did you mean \"%s\"?)",
				 np);
		} else {
			/* A key at the wrong level: suggest the one section
			 * that has it (e.g. top-level "stage"). */
			char paths[MAXI][160];
			int secs[MAXI], ni = 0;
			instances(SEC_ROOT, "", paths, secs, &ni, MAXI);
			int found = -1, count = 0;
			for (int s = 0; s < ni; s++) {
				if (strcmp(paths[s], spath) == 0)
					continue;
				const char *other[MAXK];
				int no = section_keys(secs[s], other, MAXK);
				for (int i = 0; i < no; i++) {
					if (strcasecmp(key, other[i]) == 0) {
						found = s;
						count++;
					}
				}
			}
			if (count == 1) {
				char np[300];
				key_path(np, sizeof np, paths[found], key);
				snprintf(hint, sizeof hint,
					 " (did you mean \"%s\"?)", np);
			} else if (sec != SEC_ROOT) {
				size_t o = (size_t)snprintf(
				    hint, sizeof hint,
				    " (known keys in \"%s\":", spath);
				/* the first ten (the ones configs use);
				 * doc/config.md has them all */
				enum { SHOWN = 10 };
				for (int i = 0;
				     i < nk && i < SHOWN && o < sizeof hint;
				     i++)
					o += (size_t)snprintf(
					    hint + o, sizeof hint - o, "%s %s",
					    i ? "," : "", names[i]);
				if (o < sizeof hint)
					snprintf(hint + o, sizeof hint - o,
						 "%s)",
						 nk > SHOWN ? ", ...; all in "
							      "doc/config.md"
							    : "");
			}
		}
		st = cp_err(p, "unknown key \"%s\"%s", path, hint);
	}
	return st;
}

/* "a positive integer", "an integer in [0, 3]" ... */
static const char *int_expect(char *buf, size_t n, int64_t lo, int64_t hi)
{
	if (lo == 1 && hi >= INT_FIELD_MAX)
		snprintf(buf, n, "a positive integer");
	else if (lo == 0 && hi >= INT_FIELD_MAX)
		snprintf(buf, n, "a non-negative integer");
	else if (lo == INT64_MIN && hi == INT64_MAX)
		snprintf(buf, n, "an integer");
	else if (hi >= INT_FIELD_MAX)
		snprintf(buf, n, "an integer >= %" PRId64, lo);
	else
		snprintf(buf, n, "an integer in [%" PRId64 ", %" PRId64 "]", lo,
			 hi);
	return buf;
}

/* "a number", "a number > 0", "a number in [0, 1)" ... */
static const char *num_expect(char *buf, size_t n, double lo, bool lo_open,
			      double hi, bool hi_open)
{
	if (isinf(lo) && isinf(hi))
		snprintf(buf, n, "a number");
	else if (isinf(hi))
		snprintf(buf, n, "a number %s %g", lo_open ? ">" : ">=", lo);
	else
		snprintf(buf, n, "a number in %c%g, %g%c", lo_open ? '(' : '[',
			 lo, hi, hi_open ? ')' : ']');
	return buf;
}

/* Reads v (at path) as an integer in [lo, hi] into *out. */
static epj_status rd_int(cp *p, json_t *v, const char *path, int64_t lo,
			 int64_t hi, int64_t *out)
{
	char e[80], g[100];
	int64_t x;
	if (!ej_json_as_int(v, &x))
		return cp_err(p, "\"%s\" must be %s, got %s", path,
			      int_expect(e, sizeof e, lo, hi),
			      ej_json_describe(v, g, sizeof g));
	if (x < lo || x > hi)
		return cp_err(p, "\"%s\" must be %s, got %" PRId64, path,
			      int_expect(e, sizeof e, lo, hi), x);
	*out = x;
	return EPJ_OK;
}

/* Reads v (at path) as a number with lo <= x (lo < x when lo_open) and
 * x <= hi (x < hi when hi_open).  Use -HUGE_VAL / HUGE_VAL for no bound. */
static epj_status rd_num(cp *p, json_t *v, const char *path, double lo,
			 bool lo_open, double hi, bool hi_open, double *out)
{
	char e[120], g[100];
	num_expect(e, sizeof e, lo, lo_open, hi, hi_open);
	if (!json_is_number(v))
		return cp_err(p, "\"%s\" must be %s, got %s", path, e,
			      ej_json_describe(v, g, sizeof g));
	double x = json_number_value(v);
	if (x < lo || (lo_open && x == lo) || x > hi || (hi_open && x == hi))
		return cp_err(p, "\"%s\" must be %s, got %g", path, e, x);
	*out = x;
	return EPJ_OK;
}

/* k's choices (*n of them): its own list, or its registry's names. */
static const char *const *choices_of(const key *k, int *n)
{
	if (k->registry)
		return k->registry(n);
	*n = k->nchoices;
	return k->choices;
}

/* The choices of k as "a", "b", "c" into list. */
static const char *choice_list(const key *k, char *list, size_t n)
{
	size_t o = 0;
	int nc;
	const char *const *ch = choices_of(k, &nc);
	list[0] = '\0';
	for (int i = 0; i < nc && o < n; i++)
		o += (size_t)snprintf(list + o, n - o, "%s\"%s\"",
				      i ? ", " : "", ch[i]);
	return list;
}

/* Reads v (obj[k->name], present) as one of k's choices into *idx.
 * Unknown values name the choices and the nearest one. */
static epj_status rd_choice(cp *p, const key *k, json_t *v, const char *path,
			    int *idx)
{
	char g[100], list[200];
	choice_list(k, list, sizeof list);
	if (!json_is_string(v))
		return cp_err(p, "\"%s\" must be a string (one of %s), got %s",
			      path, list, ej_json_describe(v, g, sizeof g));
	const char *s = json_string_value(v);
	int nc;
	const char *const *ch = choices_of(k, &nc);
	for (int i = 0; i < nc; i++) {
		if ((k->flags & K_NOCASE) ? strcasecmp(s, ch[i]) == 0
					  : strcmp(s, ch[i]) == 0) {
			*idx = i;
			return EPJ_OK;
		}
	}
	const char *near = ej_nearest_key(s, ch, nc);
	char hint[120] = "";
	if (near)
		snprintf(hint, sizeof hint, " (did you mean \"%s\"?)", near);
	return cp_err(p,
		      "\"%s\" value \"%.60s\" is not supported%s; expected "
		      "one of %s",
		      path, s, hint, list);
}

/* The value of the parent section's "type" key, for K_BY_TYPE sections. */
static const key *type_key(int sec)
{
	for (size_t i = 0; i < EJ_ARRAY_LEN(keys); i++)
		if (keys[i].sec == sec && strcmp(keys[i].name, "type") == 0)
			return &keys[i];
	EJ_ASSERT(!"a K_BY_TYPE section whose parent has no type");
	return NULL;
}

/* The keys of section sec that type value t takes, as "a, b, c". */
static const char *applicable_list(int sec, int t, char *list, size_t n)
{
	size_t o = 0;
	list[0] = '\0';
	for (size_t i = 0; i < EJ_ARRAY_LEN(keys) && o < n; i++)
		if (keys[i].sec == sec && (keys[i].applies & (1u << t)))
			o += (size_t)snprintf(list + o, n - o, "%s%s",
					      o ? ", " : "", keys[i].name);
	return list;
}

/* A K_BY_TYPE section (e.g. optimizer.params): every key present must be
 * one the parent's type takes (DeepSpeed passes the params to the
 * constructor, which rejects others). */
static epj_status check_applicable(cp *p, json_t *obj, const key *sk,
				   const char *spath, const char *parent_base)
{
	const key *tk = type_key(sk->sec);
	int t = (int)get_int(tk, parent_base);
	const char *type_name = tk->choices[t - tk->enum_base];
	/* the parent section's name: "optimizer", "scheduler" */
	char parent[300];
	snprintf(parent, sizeof parent, "%s", spath);
	char *dot = strrchr(parent, '.');
	if (dot)
		*dot = '\0';
	const char *name;
	json_t *v;
	json_object_foreach(obj, name, v)
	{
		const key *k = NULL;
		for (size_t i = 0; i < EJ_ARRAY_LEN(keys) && !k; i++)
			if (keys[i].sec == sk->child &&
			    strcmp(keys[i].name, name) == 0)
				k = &keys[i];
		if (k && (k->applies & (1u << t)))
			continue;
		char list[200];
		return cp_err(p,
			      "\"%s.%s\" is not a parameter of %s type %s (it "
			      "takes: %s)",
			      spath, name, parent, type_name,
			      applicable_list(sk->child, t, list, sizeof list));
	}
	return EPJ_OK;
}

static epj_status read_section(cp *p, json_t *obj, int sec, const char *spath,
			       char *base, ej_config *c);

static bool is_auto(const json_t *v)
{
	return json_is_string(v) && strcmp(json_string_value(v), "auto") == 0;
}

/* "auto" is one of k's own values (comm.backend), not the placeholder. */
static bool auto_is_choice(const key *k)
{
	int nc;
	const char *const *ch = choices_of(k, &nc);
	for (int i = 0; i < nc; i++)
		if (strcmp(ch[i], "auto") == 0)
			return true;
	return false;
}

static void doc_value(FILE *f, const key *k);

/* The caller's value of "auto" at the dotted path (borrowed); NULL when
 * it gives none (absent, null or "auto" itself). */
static json_t *auto_value(cp *p, const char *path)
{
	json_t *o = p->auto_src;
	char buf[300];
	snprintf(buf, sizeof buf, "%s", path);
	char *save = NULL;
	for (char *t = strtok_r(buf, ".", &save); t && o;
	     t = strtok_r(NULL, ".", &save))
		o = json_is_object(o) ? json_object_get(o, t) : NULL;
	return o && !json_is_null(o) && !is_auto(o) ? o : NULL;
}

/* Names path in the parse's one no-effect warning (ej_config.no_effect),
 * unless a section around it is named as a whole. */
static void note_no_effect(cp *p, ej_config *c, const char *path)
{
	if (p->quiet)
		return;
	size_t o = strlen(c->no_effect);
	if (o + 1 < sizeof c->no_effect)
		snprintf(c->no_effect + o, sizeof c->no_effect - o, "%s%s",
			 o ? ", " : "", path);
}

/* Remembers that path was "auto" in the file (ej_config.auto_keys); a
 * path that does not fit is left out. */
static void note_auto(ej_config *c, const char *path)
{
	size_t o = strlen(c->auto_keys), n = strlen(path);
	if (o + n + 2 <= sizeof c->auto_keys)
		snprintf(c->auto_keys + o, sizeof c->auto_keys - o, "%s\n",
			 path);
}

/* A K_ANY value that turns its feature on: anything but null, false, {}
 * or an object whose "enabled" is false. */
static bool any_on(const json_t *v)
{
	if (json_is_null(v) || json_is_false(v))
		return false;
	if (json_is_object(v))
		return json_object_size(v) != 0 &&
		       !json_is_false(json_object_get(v, "enabled"));
	return true;
}

/* Reads row k of a section object obj (at spath, fields at base).
 * type_failed: the section's "type" key was in error (its params are then
 * not checked against it). */
/* "auto" as the value of key k, which takes it: the caller's value in
 * *v, read as if written here; or, when the caller gave none, the key's own
 * "auto" rule applied (*done, its status returned). */
static epj_status read_auto(cp *p, const key *k, json_t *obj, json_t **v,
			    const char *path, char *base, ej_config *c,
			    bool *done)
{
	*done = false;
	if (!k->auto_doc) {
		/* the value column of the reference, as the hint */
		char want[300] = "an object";
		FILE *mf = k->type == K_SECTION
			       ? NULL
			       : fmemopen(want, sizeof want, "w");
		if (mf) {
			doc_value(mf, k);
			fclose(mf);
		}
		return cp_err(p,
			      "\"%s\" does not accept \"auto\": it "
			      "must be %s (doc/config.md lists the keys "
			      "that take \"auto\")",
			      path, want);
	}
	json_t *a = auto_value(p, path);
	if (!a) {
		*done = true;
		return k->auto_lib ? k->auto_lib(p, k, obj, *v, path, base, c)
				   : EPJ_OK;
	}
	*v = a;
	return EPJ_OK;
}

/* Section key k with value v: its keys checked and read. */
static epj_status read_section_key(cp *p, const key *k, json_t *obj, json_t *v,
				   const char *path, char *base, ej_config *c,
				   bool type_failed)
{
	char g[100];
	epj_status s;
	if (!json_is_object(v))
		return cp_err(p, "\"%s\" must be an object, got %s", path,
			      ej_json_describe(v, g, sizeof g));
	char *cb = child_base(k, base);
	epj_status s1 = check_keys(p, v, k->child, path);
	epj_status s2 = EPJ_OK;
	if ((k->flags & K_BY_TYPE) && !type_failed)
		s2 = check_applicable(p, v, k, path, base);
	set_given(k, cb, true);
	if (k->kind != KIND_IMPL) {
		note_no_effect(p, c, path);
		p->quiet++;
	}
	s = read_section(p, v, k->child, path, cb, c);
	if (k->kind != KIND_IMPL)
		p->quiet--;
	if (s1 || s2 || s)
		return s1 ? s1 : s2 ? s2 : s;
	return k->hook ? k->hook(p, k, obj, v, path, cb, c) : EPJ_OK;
}

/* Pair key k: an array of two numbers in the key's range. */
static epj_status read_pair(cp *p, const key *k, json_t *v, const char *path,
			    char *base)
{
	char g[100], e[120];
	num_expect(e, sizeof e, k->lo, k->flags & K_LO_OPEN, k->hi,
		   k->flags & K_HI_OPEN);
	/* "a number in [0, 1)" -> "numbers in [0, 1)" */
	const char *range = e + strlen("a number");
	if (!json_is_array(v) || json_array_size(v) != 2)
		return cp_err(p,
			      "\"%s\" must be an array of 2 numbers%s, "
			      "got %s%s",
			      path, range, ej_json_describe(v, g, sizeof g),
			      json_is_array(v) ? " of another length" : "");
	for (int i = 0; i < 2; i++) {
		json_t *xi = json_array_get(v, (size_t)i);
		double di = json_is_number(xi) ? json_number_value(xi) : 0;
		if (!json_is_number(xi) || di < k->lo ||
		    ((k->flags & K_LO_OPEN) && di == k->lo) || di > k->hi ||
		    ((k->flags & K_HI_OPEN) && di == k->hi))
			return cp_err(p, "\"%s[%d]\" must be %s, got %s", path,
				      i, e,
				      json_is_number(xi)
					  ? (snprintf(g, sizeof g, "%g", di), g)
					  : ej_json_describe(xi, g, sizeof g));
		set_num(k, base, i, di);
	}
	return EPJ_OK;
}

/* The value v of key k (not a section, not special) stored at base; *on:
 * the value asks for the key's feature (what a KIND_NOT_IMPL key
 * refuses). */
static epj_status read_value(cp *p, const key *k, json_t *v, const char *path,
			     char *base, bool *on)
{
	char g[100];
	epj_status s;
	int64_t x = 0;
	double d = 0;
	int idx = 0;
	*on = false;
	switch (k->type) {
	case K_BOOL:
		if (!json_is_boolean(v))
			return cp_err(p, "\"%s\" must be a boolean, got %s",
				      path, ej_json_describe(v, g, sizeof g));
		if (k->off >= 0)
			*(bool *)field(k, base) = json_is_true(v);
		*on = json_is_true(v);
		break;
	case K_INT:
		if ((s = rd_int(p, v, path, k->ilo, k->ihi, &x)))
			return s;
		if (k->off >= 0)
			set_int(k, base, x);
		set_given(k, base, true);
		*on = x != (int64_t)k->def;
		break;
	case K_NUM:
		if ((s = rd_num(p, v, path, k->lo, k->flags & K_LO_OPEN, k->hi,
				k->flags & K_HI_OPEN, &d)))
			return s;
		if (k->off >= 0)
			set_num(k, base, 0, d);
		set_given(k, base, true);
		*on = d != k->def;
		break;
	case K_PAIR:
		return read_pair(p, k, v, path, base);
	case K_ENUM:
		if ((s = rd_choice(p, k, v, path, &idx)))
			return s;
		if (k->off >= 0)
			set_int(k, base, k->enum_base + idx);
		*on = idx != 0;
		break;
	case K_NAME:
		if ((s = rd_choice(p, k, v, path, &idx)))
			return s;
		if (k->off >= 0)
			set_str(field(k, base), k->size,
				choices_of(k, &(int){ 0 })[idx]);
		*on = idx != 0;
		break;
	case K_STR:
		if (!json_is_string(v))
			return cp_err(p, "\"%s\" must be a string, got %s",
				      path, ej_json_describe(v, g, sizeof g));
		if (json_string_length(v) >= k->size)
			return cp_err(p,
				      "\"%s\" is too long (%zu bytes, at most "
				      "%zu)",
				      path, json_string_length(v), k->size - 1);
		set_str(field(k, base), k->size, json_string_value(v));
		break;
	case K_TEXT:
		if (!json_is_string(v))
			return cp_err(p,
				      "\"%s\" must be a string or null, got %s",
				      path, ej_json_describe(v, g, sizeof g));
		break;
	case K_ANY:
		*on = any_on(v);
		break;
	case K_TRISTATE:
		if (!json_is_boolean(v) && !json_is_null(v))
			return cp_err(
			    p, "\"%s\" must be a boolean or null, got %s", path,
			    ej_json_describe(v, g, sizeof g));
		set_int(k, base,
			json_is_null(v)	  ? EJ_JSON_NULL
			: json_is_true(v) ? EJ_JSON_TRUE
					  : EJ_JSON_FALSE);
		set_given(k, base, true);
		break;
	case K_NUMBOOL:
		if (!json_is_number(v) && !json_is_boolean(v))
			return cp_err(p,
				      "\"%s\" must be a number or a boolean, "
				      "got %s",
				      path, ej_json_describe(v, g, sizeof g));
		break;
	case K_SECTION:
	case K_SPECIAL:
		EJ_ASSERT(!"read_value: a section or special key");
		break;
	}
	if (k->flags & K_ON_SET)
		*on = true;
	return EPJ_OK;
}

static epj_status read_key(cp *p, const key *k, json_t *obj, const char *spath,
			   char *base, ej_config *c, bool type_failed)
{
	char path[300], g[100], e[120];
	key_path(path, sizeof path, spath, k->name);
	json_t *v = json_object_get(obj, k->name);
	epj_status s = EPJ_OK;
	if (!v) {
		if (k->flags & K_REQUIRED)
			return cp_err(p, "\"%s\" is required (one of %s)", path,
				      choice_list(k, e, sizeof e));
		return EPJ_OK;
	}
	if (is_auto(v) && k->type != K_SPECIAL && !auto_is_choice(k)) {
		bool done;
		if (k->auto_doc)
			note_auto(c, path);
		s = read_auto(p, k, obj, &v, path, base, c, &done);
		if (s != EPJ_OK || done)
			return s;
	}
	if (json_is_null(v) && (k->type == K_SECTION || k->type == K_TEXT ||
				k->type == K_ANY || (k->flags & K_NULL_OK))) {
		/* DeepSpeed treats null as "not set". */
		if (k->type == K_NUM && k->off >= 0) {
			set_num(k, base, 0, 0);
			set_given(k, base, false);
		}
		return EPJ_OK;
	}
	if (k->type == K_SECTION)
		return read_section_key(p, k, obj, v, path, base, c,
					type_failed);
	if (k->type == K_SPECIAL)
		return k->hook(p, k, obj, v, path, base, c);
	bool on = false; /* a KIND_NOT_IMPL value that asks for its feature */
	if ((s = read_value(p, k, v, path, base, &on)))
		return s;
	if (k->kind == KIND_NOT_IMPL && on)
		return cp_err(p,
			      "\"%s\" is %s: not implemented in epjit (it "
			      "would change the computation); remove it or "
			      "turn it off",
			      path,
			      json_is_object(v) ? "an enabled section"
			      : json_is_array(v)
				  ? "a list"
				  : ej_json_describe(v, g, sizeof g));
	if (k->kind != KIND_IMPL)
		note_no_effect(p, c, path);
	return k->hook ? k->hook(p, k, obj, v, path, base, c) : EPJ_OK;
}

/* Reads every key of section sec from obj (keys already checked); an
 * error does not stop it: the file's report names every one. */
static epj_status read_section(cp *p, json_t *obj, int sec, const char *spath,
			       char *base, ej_config *c)
{
	epj_status first = EPJ_OK;
	bool type_failed = false;
	for (size_t i = 0; i < EJ_ARRAY_LEN(keys); i++) {
		if (keys[i].sec != sec)
			continue;
		epj_status s =
		    read_key(p, &keys[i], obj, spath, base, c, type_failed);
		if (s && strcmp(keys[i].name, "type") == 0)
			type_failed = true;
		if (s && !first)
			first = s;
	}
	return first;
}

/* ==== hooks: what one row cannot say ===================================== */

static epj_status hook_fp16(cp *p, const key *k, json_t *obj, json_t *v,
			    const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)base, (void)c, (void)path;
	if (json_is_true(json_object_get(v, "enabled")))
		return cp_err(p, "\"fp16.enabled\" must be false: fp16 "
				 "training is not supported; use "
				 "\"bf16\": {\"enabled\": true}");
	return EPJ_OK;
}

static epj_status hook_optim_type(cp *p, const key *k, json_t *obj, json_t *v,
				  const char *path, char *base, ej_config *c)
{
	/* Adam's decoupled weight decay defaults to on, SGD has none. */
	(void)p, (void)k, (void)obj, (void)v, (void)path, (void)base;
	c->optimizer.adam_w_mode = c->optimizer.type != EJ_OPTIM_SGD;
	return EPJ_OK;
}

static epj_status hook_optim_params(cp *p, const key *k, json_t *obj, json_t *v,
				    const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)v, (void)path, (void)base;
	if (c->optimizer.nesterov && !(c->optimizer.momentum > 0))
		return cp_err(p, "\"optimizer.params.nesterov\" is true but "
				 "\"optimizer.params.momentum\" is 0: Nesterov "
				 "momentum needs momentum > 0");
	return EPJ_OK;
}

static epj_status hook_sched(cp *p, const key *k, json_t *obj, json_t *v,
			     const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)path, (void)base;
	int t = (int)c->scheduler.type - 1;
	json_t *pp = json_object_get(v, "params");
	bool total_given =
	    json_is_object(pp) && json_object_get(pp, "total_num_steps");
	if (t != 0 && !total_given)
		return cp_err(p,
			      "\"scheduler.params.total_num_steps\" is "
			      "required for scheduler type %s",
			      sched_names[t]);
	if (t != 0 &&
	    c->scheduler.total_num_steps < c->scheduler.warmup_num_steps)
		epj_log_msg(EPJ_LOG_WARN,
			    "%s: scheduler.params.total_num_steps (%" PRId64
			    ") is less than warmup_num_steps (%" PRId64 ")",
			    p->src, c->scheduler.total_num_steps,
			    c->scheduler.warmup_num_steps);
	return EPJ_OK;
}

static epj_status hook_offload(cp *p, const key *k, json_t *obj, json_t *v,
			       const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)v, (void)c;
	ej_offload_config *off = (ej_offload_config *)base;
	off->active = off->device != EJ_OFFLOAD_NONE;
	if (off->device == EJ_OFFLOAD_NVME && !off->nvme_path[0])
		return cp_err(p,
			      "\"%s.device\" is \"nvme\" but \"%s.nvme_path\" "
			      "is not set",
			      path, path);
	return EPJ_OK;
}

static epj_status hook_csv(cp *p, const key *k, json_t *obj, json_t *v,
			   const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)v, (void)path, (void)base;
	if (!c->csv_monitor.job_name[0])
		return cp_err(p, "\"csv_monitor.job_name\" must not be empty");
	return EPJ_OK;
}

static epj_status hook_tb(cp *p, const key *k, json_t *obj, json_t *v,
			  const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)v, (void)path, (void)base;
	if (!c->tensorboard.job_name[0])
		return cp_err(p, "\"tensorboard.job_name\" must not be empty");
	return EPJ_OK;
}

/* scheduler.params.warmup_max_lr "auto" without the caller's value: the
 * optimizer's lr (read before the scheduler: the table's order). */
static epj_status auto_max_lr(cp *p, const key *k, json_t *obj, json_t *v,
			      const char *path, char *base, ej_config *c)
{
	(void)p, (void)k, (void)obj, (void)v, (void)path, (void)base;
	c->scheduler.warmup_max_lr = c->optimizer.lr;
	return EPJ_OK;
}

/* scheduler.params.total_num_steps "auto" without the caller's value: the
 * library knows no run length. */
static epj_status auto_total_steps(cp *p, const key *k, json_t *obj, json_t *v,
				   const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)v, (void)base, (void)c;
	return cp_err(p,
		      "\"%s\" is \"auto\" and nothing gives it a value: the "
		      "library has no default run length (epjit-train gives "
		      "its --steps); write the number of steps",
		      path);
}

/* top_k: an integer >= 1 or "auto" (the model's num_experts_per_tok). */
static epj_status hook_top_k(cp *p, const key *k, json_t *obj, json_t *v,
			     const char *path, char *base, ej_config *c)
{
	(void)obj;
	char g[100];
	if (is_auto(v)) {
		note_auto(c, path);
		set_int(k, base, 0);
		return EPJ_OK;
	}
	if (!json_is_integer(v) && !json_is_real(v))
		return cp_err(p,
			      "\"%s\" must be a positive integer or "
			      "\"auto\", got %s",
			      path, ej_json_describe(v, g, sizeof g));
	int64_t x = 0;
	epj_status s = rd_int(p, v, path, 1, INT_FIELD_MAX, &x);
	if (s == EPJ_OK)
		set_int(k, base, x);
	return s;
}

/* route_norm: bool, or null = the model's norm_topk_prob (-1). */
static epj_status hook_route_norm(cp *p, const key *k, json_t *obj, json_t *v,
				  const char *path, char *base, ej_config *c)
{
	(void)obj, (void)c;
	char g[100];
	if (json_is_null(v))
		set_int(k, base, -1);
	else if (json_is_boolean(v))
		set_int(k, base, json_is_true(v));
	else
		return cp_err(p, "\"%s\" must be a boolean or null, got %s",
			      path, ej_json_describe(v, g, sizeof g));
	return EPJ_OK;
}

/* routed_scaling_factor: a number, or "auto" (DeepSpeed's own value: the
 * model's, else route_scale). */
static epj_status hook_rsf(cp *p, const key *k, json_t *obj, json_t *v,
			   const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)base;
	char g[100];
	struct ej_ep_config *ep = &c->expert_parallel;
	if (is_auto(v)) {
		ep->has_routed_scaling_factor = false;
		ep->routed_scaling_factor = 0;
		return EPJ_OK;
	}
	if (!json_is_number(v))
		return cp_err(p, "\"%s\" must be a number or \"auto\", got %s",
			      path, ej_json_describe(v, g, sizeof g));
	ep->has_routed_scaling_factor = true;
	ep->routed_scaling_factor = json_number_value(v);
	return EPJ_OK;
}

/* preset_model: DeepSpeed's presets of families epjit does not build are
 * refused by name. */
static epj_status hook_preset_model(cp *p, const key *k, json_t *obj, json_t *v,
				    const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)v, (void)base;
	const char *name = c->expert_parallel.preset_model;
	for (size_t i = N_PRESETS_BUILT; i < EJ_ARRAY_LEN(preset_models); i++)
		if (!strcmp(name, preset_models[i]))
			return cp_err(
			    p,
			    "\"%s\" is \"%s\": that model family is not "
			    "implemented in epjit; it builds \"mixtral\", "
			    "\"qwen3_moe\" (also Qwen2-MoE), \"qwen3_5_moe\", "
			    "\"deepseek_v2\" and \"deepseek_v3\" (null: the "
			    "model's)",
			    path, name);
	return EPJ_OK;
}

static const char *str_key(json_t *obj, const char *key)
{
	json_t *x = json_object_get(obj, key);
	return json_is_string(x) ? json_string_value(x) : "";
}

/* The expert_parallel section: DeepSpeed's rules on pairs of its keys
 * (validate_autoep_config), those that do not need the model. */
static epj_status hook_ep(cp *p, const key *k, json_t *obj, json_t *v,
			  const char *path, char *base, ej_config *c)
{
	(void)k, (void)obj, (void)base;
	const struct ej_ep_config *ep = &c->expert_parallel;
	const bool deepep = !strcmp(ep->comm_backend, "deepep");
	epj_status s = EPJ_OK;
	if (!strcmp(str_key(v, "gate_up_impl"), "fused") &&
	    json_is_false(json_object_get(v, "use_grouped_mm")))
		s = cp_err(p,
			   "\"%s.gate_up_impl\" is \"fused\" but "
			   "\"%s.use_grouped_mm\" is false: DeepSpeed refuses "
			   "the pair (the fused projections are one grouped "
			   "GEMM); set use_grouped_mm to true or leave "
			   "gate_up_impl unset",
			   path, path);
	if (!strcmp(str_key(v, "row_weighting_impl"), "fused") &&
	    (!deepep || ep->autoep_size == 1))
		s = cp_err(p,
			   "\"%s.row_weighting_impl\" is \"fused\", which "
			   "runs only inside DeepEP's route: DeepSpeed refuses "
			   "it without comm_backend \"deepep\" and autoep_size "
			   "> 1 (DeepEP is not implemented in epjit); leave it "
			   "unset",
			   path);
	if (!strcmp(str_key(v, "combine_impl"), "fused_weighted_sum") &&
	    deepep && ep->autoep_size > 1)
		s = cp_err(p,
			   "\"%s.combine_impl\" is \"fused_weighted_sum\" "
			   "with comm_backend \"deepep\": DeepSpeed refuses "
			   "the pair (DeepEP reduces the rows itself); leave "
			   "combine_impl unset",
			   path);
	if (ep->num_expert_groups &&
	    ep->num_limited_groups > ep->num_expert_groups)
		s = cp_err(p,
			   "\"%s.num_limited_groups\" (%d) must not exceed "
			   "\"%s.num_expert_groups\" (%d)",
			   path, ep->num_limited_groups, path,
			   ep->num_expert_groups);
	return s;
}

/* A DeepCompile schedule is a list of [step, passes] pairs (or an object);
 * only its presence matters to us. */
static epj_status hook_schedule(cp *p, const key *k, json_t *obj, json_t *v,
				const char *path, char *base, ej_config *c)
{
	(void)obj, (void)c;
	char g[100];
	if (json_is_null(v))
		return EPJ_OK;
	if (!json_is_array(v) && !json_is_object(v))
		return cp_err(p,
			      "\"%s\" must be an array, an object or null, got "
			      "%s",
			      path, ej_json_describe(v, g, sizeof g));
	*(bool *)field(k, base) = true;
	return EPJ_OK;
}

static json_t *wr_top_k(const key *k, const char *base, const ej_config *c)
{
	(void)c;
	int64_t t = get_int(k, base);
	return t ? json_integer(t) : json_string("auto");
}

static json_t *wr_route_norm(const key *k, const char *base, const ej_config *c)
{
	(void)c;
	int64_t r = get_int(k, base);
	return r < 0 ? json_null() : json_boolean(r);
}

static json_t *wr_rsf(const key *k, const char *base, const ej_config *c)
{
	(void)k, (void)base;
	const struct ej_ep_config *ep = &c->expert_parallel;
	return ep->has_routed_scaling_factor
		   ? json_real(ep->routed_scaling_factor)
		   : json_string("auto");
}

static json_t *wr_schedule(const key *k, const char *base, const ej_config *c)
{
	/* The schedule's content is not kept; an empty list marks it. */
	(void)c;
	return get_bool(k, base) ? json_array() : json_null();
}

/* Section writers: json_true() when the section is written (a borrowed
 * singleton, never freed), NULL when it is not. */
static json_t *wr_if_sched(const key *k, const char *base, const ej_config *c)
{
	(void)k, (void)base;
	return c->scheduler.type != EJ_SCHED_NONE ? json_true() : NULL;
}

/* The moe section is written when one of its losses is on. */
static json_t *wr_if_moe(const key *k, const char *base, const ej_config *c)
{
	(void)k, (void)base;
	return c->moe.aux_loss_coeff > 0 || c->moe.seq_aux_loss_coeff > 0 ||
		       c->moe.global_aux_loss_coeff > 0 ||
		       c->moe.z_loss_coeff > 0
		   ? json_true()
		   : NULL;
}

static json_t *wr_if_given(const key *k, const char *base, const ej_config *c)
{
	(void)c;
	return *(const bool *)(base + k->off + k->given_off) ? json_true()
							     : NULL;
}

/* checkpoint and checkpoint.writer: written when writer.decoupled is
 * true (the only key of them that acts). */
static json_t *wr_if_decoupled(const key *k, const char *base,
			       const ej_config *c)
{
	(void)k, (void)base;
	return c->checkpoint_decoupled ? json_true() : NULL;
}

/* ==== sections that cross-check ========================================== */

static epj_status parse_root(cp *p, json_t *root, ej_config *c)
{
	epj_status s1 = check_keys(p, root, SEC_ROOT, "");
	epj_status s = read_section(p, root, SEC_ROOT, "", (char *)c, c);
	if (s1 || s)
		return s1 ? s1 : s;

	/* Batch rules that hold for every world size: train_batch_size is a
	 * multiple of micro * gas (the quotient being the world size). */
	int64_t unit = (c->micro_batch_given ? c->micro_batch_per_gpu : 1) *
		       (c->gas_given ? c->gradient_accumulation_steps : 1);
	if (c->train_batch_size_given &&
	    (c->micro_batch_given || c->gas_given) &&
	    c->train_batch_size % unit != 0) {
		char mb[32] = "not set", ga[32] = "not set";
		if (c->micro_batch_given)
			snprintf(mb, sizeof mb, "%" PRId64,
				 c->micro_batch_per_gpu);
		if (c->gas_given)
			snprintf(ga, sizeof ga, "%" PRId64,
				 c->gradient_accumulation_steps);
		return cp_err(p,
			      "batch sizes are inconsistent: train_batch_size "
			      "(%" PRId64 ") must equal "
			      "train_micro_batch_size_per_gpu (%s) * "
			      "gradient_accumulation_steps (%s) * world size, "
			      "but %" PRId64 " is not a multiple of %" PRId64,
			      c->train_batch_size, mb, ga, c->train_batch_size,
			      unit);
	}
	return EPJ_OK;
}

/* Sets the context's error from the parse's collected errors: one error
 * as before ("config error in SRC: MSG"), several as "N errors:" and one
 * indented line each.  What does not fit the context's message is logged
 * (every error, then) and counted in its last line. */
/* Whether the "no effect" warning for this source and key list is the
 * first of the process: a program that parses the same file twice (the
 * trainer does when the config moves its seed or device) warns once.  A
 * 64-bit FNV-1a of both strings; one parse at a time, as everywhere in
 * config parsing. */
static bool first_warning(const char *src, const char *list)
{
	static uint64_t last;
	uint64_t h = 0xcbf29ce484222325ull;
	for (const char *c = src; *c; c++)
		h = (h ^ (unsigned char)*c) * 0x100000001b3ull;
	h = (h ^ 0xffu) * 0x100000001b3ull;
	for (const char *c = list; *c; c++)
		h = (h ^ (unsigned char)*c) * 0x100000001b3ull;
	if (h == last)
		return false;
	last = h;
	return true;
}

static epj_status report_errors(cp *p)
{
	EJ_ASSERT(p->nerr > 0);
	if (p->nerr == 1) {
		char *nl = strchr(p->errs, '\n');
		if (nl)
			*nl = '\0';
		return ej_config_error(p->ctx, p->src, "%s", p->errs);
	}
	/* ej_config_error keeps 895 bytes of message: whole lines up to
	 * that, less room for the count line */
	char msg[896];
	size_t room = sizeof msg - 64;
	size_t o = (size_t)snprintf(msg, sizeof msg, "%d errors:", p->nerr);
	int shown = 0;
	for (char *line = p->errs; *line;) {
		char *nl = strchr(line, '\n');
		size_t n = nl ? (size_t)(nl - line) : strlen(line);
		if (o + n + 3 > room)
			break;
		o += (size_t)snprintf(msg + o, sizeof msg - o, "\n  %.*s",
				      (int)n, line);
		shown++;
		line += n + (nl ? 1 : 0);
	}
	if (shown < p->nerr) {
		for (char *line = p->errs; *line;) {
			char *nl = strchr(line, '\n');
			size_t n = nl ? (size_t)(nl - line) : strlen(line);
			epj_log_msg(EPJ_LOG_ERROR, "config error in %s: %.*s",
				    p->src, (int)n, line);
			line += n + (nl ? 1 : 0);
		}
		snprintf(msg + o, sizeof msg - o,
			 "\n  ... and %d more (each logged above)",
			 p->nerr - shown);
	}
	return ej_config_error(p->ctx, p->src, "%s", msg);
}

epj_status ej_config_parse_auto(epj_ctx *ctx, const char *json_text,
				const char *source_name, const char *auto_json,
				ej_config *out)
{
	EJ_ASSERT(out);
	cp p = { .ctx = ctx,
		 .src = source_name ? source_name : "<string>",
		 .collect = true };
	ej_config_defaults(out);
	set_str(out->source, sizeof out->source, p.src);
	json_t *auto_root = NULL;
	if (auto_json) {
		epj_status s = ej_config_json_object(
		    ctx, auto_json, "<the caller's values of \"auto\">",
		    &auto_root);
		if (s != EPJ_OK)
			return s;
	}
	json_t *root;
	epj_status s = ej_config_json_object(ctx, json_text, p.src, &root);
	if (s != EPJ_OK) {
		json_decref(auto_root);
		return s;
	}
	p.auto_src = auto_root;
	p.cap = 16384;
	p.errs = calloc(1, p.cap);
	ej_config *tmp = malloc(sizeof *tmp);
	if (!p.errs || !tmp) {
		s = ej_error(ctx, EPJ_ERR_NOMEM,
			     "config error in %s: out of memory", p.src);
	} else {
		*tmp = *out;
		s = parse_root(&p, root, tmp);
		if (p.nerr > 0) {
			s = report_errors(&p);
		} else if (s == EPJ_OK) {
			*out = *tmp;
			if (out->no_effect[0] &&
			    first_warning(p.src, out->no_effect))
				epj_log_msg(EPJ_LOG_WARN,
					    "%s: accepted, no effect in epjit: "
					    "%s",
					    p.src, out->no_effect);
		}
	}
	free(tmp);
	free(p.errs);
	json_decref(root);
	json_decref(auto_root);
	return s;
}

epj_status ej_config_parse(epj_ctx *ctx, const char *json_text,
			   const char *source_name, ej_config *out)
{
	return ej_config_parse_auto(ctx, json_text, source_name, NULL, out);
}

epj_status ej_config_load_auto(epj_ctx *ctx, const char *path,
			       const char *auto_json, ej_config *out)
{
	EJ_ASSERT(out && path);
	ej_config_defaults(out);
	set_str(out->source, sizeof out->source, path);
	char *text = ej_config_read_file(ctx, path);
	if (!text)
		return epj_ctx_status(ctx);
	epj_status s = ej_config_parse_auto(ctx, text, path, auto_json, out);
	free(text);
	return s;
}

epj_status ej_config_load(epj_ctx *ctx, const char *path, ej_config *out)
{
	return ej_config_load_auto(ctx, path, NULL, out);
}

/* ==== batch resolution =================================================== */

epj_status ej_config_resolve_batch(epj_ctx *ctx, ej_config *c, int world_size)
{
	EJ_ASSERT(c);
	cp p = { .ctx = ctx, .src = c->source };
	if (world_size < 1)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"config error in %s: world size must be >= 1, "
				"got %d",
				c->source, world_size);
	int64_t w = world_size;
	int64_t tb = c->train_batch_size_given ? c->train_batch_size : 0;
	int64_t mb = c->micro_batch_given ? c->micro_batch_per_gpu : 0;
	int64_t ga = c->gas_given ? c->gradient_accumulation_steps : 0;
	/* Every product below is of values <= BATCH_MAX = 2^31 and a world
	 * size < 2^31: it must not reach past BATCH_MAX (checked, no
	 * overflow). */
	int64_t prod;
	int64_t mbv = mb ? mb : 1, gav = ga ? ga : 1;
	if (__builtin_mul_overflow(mbv, gav, &prod) ||
	    __builtin_mul_overflow(prod, w, &prod) || prod > BATCH_MAX)
		return cp_err(&p,
			      "train_micro_batch_size_per_gpu (%" PRId64
			      ") * gradient_accumulation_steps (%" PRId64
			      ") * world size (%d) is out of range: the "
			      "global batch must be in [1, %" PRId64 "]",
			      mbv, gav, world_size, BATCH_MAX);
	/* DeepSpeed's rules (runtime/config.py _set_batch_related_parameters):
	 * two given determine the third; one given sets gas = 1 (or micro =
	 * 1 when only gas is given); none given: micro = gas = 1. */
	if (tb && mb && ga) {
		/* checked below */
	} else if (tb && mb) {
		ga = tb / (mb * w);
	} else if (tb && ga) {
		mb = tb / (ga * w);
	} else if (mb && ga) {
		tb = mb * ga * w;
	} else if (tb) {
		ga = 1;
		mb = tb / w;
	} else {
		mb = mb ? mb : 1;
		ga = ga ? ga : 1;
		tb = mb * ga * w;
	}
	if (mb < 1 || ga < 1 || tb != mb * ga * w)
		return cp_err(
		    &p,
		    "batch sizes are inconsistent for world size %d: "
		    "train_batch_size (%" PRId64
		    "%s) must equal train_micro_batch_size_per_gpu "
		    "(%" PRId64 "%s) * gradient_accumulation_steps "
		    "(%" PRId64 "%s) * world size (%d)",
		    world_size,
		    c->train_batch_size_given ? c->train_batch_size : tb,
		    c->train_batch_size_given ? "" : ", derived",
		    c->micro_batch_given ? c->micro_batch_per_gpu : mb,
		    c->micro_batch_given ? "" : ", derived",
		    c->gas_given ? c->gradient_accumulation_steps : ga,
		    c->gas_given ? "" : ", derived", world_size);
	c->train_batch_size = tb;
	c->micro_batch_per_gpu = mb;
	c->gradient_accumulation_steps = ga;
	c->batch_world_size = world_size;
	return EPJ_OK;
}

/* ==== the AutoEP routing keys against the model ========================== */

/* A family's model_type (config.json) and DeepSpeed's preset of it. */
static const struct {
	const char *model_type, *preset;
} family_names[] = {
	[EJ_FAMILY_QWEN3_MOE] = { "qwen3_moe", "qwen3_moe" },
	[EJ_FAMILY_MIXTRAL] = { "mixtral", "mixtral" },
	[EJ_FAMILY_QWEN2_MOE] = { "qwen2_moe", "qwen3_moe" },
	[EJ_FAMILY_DEEPSEEK_V2] = { "deepseek_v2", "deepseek_v2" },
	[EJ_FAMILY_DEEPSEEK_V3] = { "deepseek_v3", "deepseek_v3" },
	[EJ_FAMILY_QWEN3_5_MOE] = { "qwen3_5_moe_text", "qwen3_5_moe" },
};

/* x as the shortest of %.15g / %.17g that reads back exactly. */
static const char *num_text(double x, char *buf, size_t n)
{
	snprintf(buf, n, "%.15g", x);
	if (strtod(buf, NULL) != x)
		snprintf(buf, n, "%.17g", x);
	return buf;
}

/* The scale of the routing weights, as DeepSpeed's _resolve_route_scale
 * finds it (routed_scaling_factor, else the model's own, which the
 * DeepSeek configs have, else route_scale), against the model's. */
static epj_status check_scale(epj_ctx *ctx, const ej_config *c,
			      const ej_model_config *m, const char *mt)
{
	const struct ej_ep_config *ep = &c->expert_parallel;
	const bool own = m->family == EJ_FAMILY_DEEPSEEK_V2 ||
			 m->family == EJ_FAMILY_DEEPSEEK_V3;
	const double want = own ? m->routed_scaling_factor : 1.0;
	char a[40], b[40];
	const char *over = NULL; /* what overrides a route_scale given */
	if (ep->has_routed_scaling_factor) {
		if (ep->routed_scaling_factor != want)
			return ej_error(
			    ctx, EPJ_ERR_CONFIG,
			    "%s: expert_parallel.routed_scaling_factor=%s "
			    "differs from the model's %s (%s, model_type "
			    "\"%s\"): another scale is not implemented in "
			    "epjit",
			    c->source,
			    num_text(ep->routed_scaling_factor, a, sizeof a),
			    own ? "routed_scaling_factor"
				: "routing scale, which has none",
			    num_text(want, b, sizeof b), mt);
		over = "expert_parallel.routed_scaling_factor";
	} else if (own) {
		over = "the model's routed_scaling_factor";
	} else if (ep->route_scale != 1.0) {
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: expert_parallel.route_scale=%s differs "
				"from the model's routing scale (1: model_type "
				"\"%s\" has no routed_scaling_factor): another "
				"scale is not implemented in epjit",
				c->source,
				num_text(ep->route_scale, a, sizeof a), mt);
	}
	if (over && ep->route_scale != 1.0)
		epj_log_msg(EPJ_LOG_WARN,
			    "%s: expert_parallel.route_scale=%s is overridden "
			    "by %s (%s), as in DeepSpeed",
			    c->source, num_text(ep->route_scale, a, sizeof a),
			    over, num_text(want, b, sizeof b));
	return EPJ_OK;
}

/* Group-limited routing: num_expert_groups / num_limited_groups against
 * the model's n_group / topk_group (DeepSeek's group-limited methods); a
 * model without groups routes over all experts, which groups all kept
 * (limited = groups) also do. */
static epj_status check_groups(epj_ctx *ctx, const ej_config *c,
			       const ej_model_config *m, const char *mt)
{
	const struct ej_ep_config *ep = &c->expert_parallel;
	const char *src = c->source;
	const int G = ep->num_expert_groups, L = ep->num_limited_groups;
	if (m->groups != EJ_GROUPS_NONE) {
		if (G && G != m->n_group)
			return ej_error(
			    ctx, EPJ_ERR_CONFIG,
			    "%s: expert_parallel.num_expert_groups="
			    "%d differs from the model's n_group=%d "
			    "(model_type \"%s\")",
			    src, G, m->n_group, mt);
		if (L && L != m->topk_group)
			return ej_error(ctx, EPJ_ERR_CONFIG,
					"%s: expert_parallel.num_limited_groups"
					"=%d differs from the model's "
					"topk_group=%d (model_type \"%s\")",
					src, L, m->topk_group, mt);
		return EPJ_OK;
	}
	if (L && !G)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: expert_parallel.num_limited_groups=%d "
				"needs num_expert_groups, and the model has no "
				"expert groups (model_type \"%s\"), as "
				"DeepSpeed requires",
				src, L, mt);
	if (!G)
		return EPJ_OK;
	if (!L)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: expert_parallel.num_expert_groups=%d "
				"needs num_limited_groups, as DeepSpeed "
				"requires",
				src, G);
	if (m->num_experts % G != 0)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: expert_parallel.num_expert_groups=%d must "
				"divide the model's num_experts=%d",
				src, G, m->num_experts);
	if (L != G)
		return ej_error(
		    ctx, EPJ_ERR_CONFIG,
		    "%s: expert_parallel.num_expert_groups=%d with "
		    "num_limited_groups=%d limits the routing to %d "
		    "of %d groups; the model routes over all its "
		    "experts (model_type \"%s\" has no expert "
		    "groups): group-limited routing is not "
		    "implemented for it in epjit",
		    src, G, L, L, G, mt);
	return EPJ_OK;
}

epj_status ej_config_check_model(epj_ctx *ctx, const ej_config *c,
				 const ej_model_config *m)
{
	const struct ej_ep_config *ep = &c->expert_parallel;
	const char *src = c->source;
	EJ_ASSERT((size_t)m->family < EJ_ARRAY_LEN(family_names));
	const char *mt = family_names[m->family].model_type;
	const char *preset = family_names[m->family].preset;
	if (ep->preset_model[0] && strcmp(ep->preset_model, preset) != 0)
		return ej_error(
		    ctx, EPJ_ERR_CONFIG,
		    "%s: expert_parallel.preset_model=\"%s\" does "
		    "not match the model: its model_type is \"%s\", "
		    "whose preset is \"%s\"",
		    src, ep->preset_model, mt, preset);
	if (ep->top_k && ep->top_k != m->num_experts_per_tok)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: expert_parallel.top_k=%d differs from the "
				"model's num_experts_per_tok=%d",
				src, ep->top_k, m->num_experts_per_tok);
	if (ep->route_norm >= 0 && (ep->route_norm != 0) != m->norm_topk_prob)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: expert_parallel.route_norm=%s differs "
				"from the model's norm_topk_prob (%s for "
				"model_type \"%s\")",
				src, ep->route_norm ? "true" : "false",
				m->norm_topk_prob ? "true" : "false", mt);
	const char *fs = m->scoring == EJ_SCORE_SIGMOID ? "sigmoid" : "softmax";
	if (strcmp(ep->score_func, "auto") != 0 &&
	    strcmp(ep->score_func, fs) != 0)
		return ej_error(
		    ctx, EPJ_ERR_CONFIG,
		    "%s: expert_parallel.score_func=\"%s\" differs "
		    "from the model's scores (\"%s\" for model_type "
		    "\"%s\"): another score function is not "
		    "implemented in epjit",
		    src, ep->score_func, fs, mt);
	if (!strcmp(ep->score_apply, "pre"))
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: expert_parallel.score_apply=\"pre\" "
				"differs from the model, which weights the "
				"experts' outputs (\"post\", model_type "
				"\"%s\"): weighting their inputs is not "
				"implemented in epjit",
				src, mt);
	epj_status st = check_scale(ctx, c, m, mt);
	return st != EPJ_OK ? st : check_groups(ctx, c, m, mt);
}

/* ==== the compile.autoep_non_moe support boundary ======================== */

static epj_status autoep_err(epj_ctx *ctx, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static epj_status autoep_err(epj_ctx *ctx, const char *fmt, ...)
{
	char msg[896];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	return ej_error(ctx, EPJ_ERR_CONFIG, "compile.autoep_non_moe=true %s",
			msg);
}

static const char *json_bool_name(ej_json_bool b)
{
	return b == EJ_JSON_TRUE   ? "true"
	       : b == EJ_JSON_NULL ? "null"
				   : "false";
}

static const char *offload_name(ej_offload_device d)
{
	return offload_devices[d];
}

/* DeepSpeed's engine.compile() checks, in the order of its tests
 * (test_engine_rejects_unsupported_modes); each message holds DeepSpeed's
 * wording first (its tests match it with a regex: "comm_backend='comm'",
 * "ZeRO Stage 3", "optimizer or parameter offload", ...) and epjit's detail
 * after. */
epj_status ej_config_validate_autoep_engine(epj_ctx *ctx, const ej_config *c)
{
	EJ_ASSERT(c);
	if (!c->compile.autoep_non_moe)
		return EPJ_OK;
	if (c->compile.deepcompile)
		return autoep_err(ctx, "cannot be combined with DeepCompile "
				       "(compile.deepcompile=true): set "
				       "compile.deepcompile to false");
	if (strcmp(c->expert_parallel.comm_backend, "comm") != 0)
		return autoep_err(ctx,
				  "requires expert_parallel "
				  "comm_backend='comm' (the standard AutoEP "
				  "comm backend), got "
				  "expert_parallel.comm_backend=\"%s\": set it "
				  "to \"comm\"",
				  c->expert_parallel.comm_backend);
	if (c->autotp_size > 1)
		return autoep_err(ctx,
				  "does not support AutoEP+AutoTP folding "
				  "(tensor_parallel.autotp_size=%d): set "
				  "tensor_parallel.autotp_size to 1",
				  c->autotp_size);
	if (c->sequence_parallel_size > 1)
		return autoep_err(ctx,
				  "does not support sequence parallelism "
				  "(sequence_parallel_size=%d): set "
				  "sequence_parallel_size to 1",
				  c->sequence_parallel_size);
	if (c->pipeline_stages > 1)
		return autoep_err(ctx,
				  "does not support pipeline parallelism "
				  "(pipeline.stages=%d): set pipeline.stages "
				  "to 1",
				  c->pipeline_stages);
	if (c->zero.stage == 3)
		return autoep_err(ctx, "does not support ZeRO Stage 3 "
				       "(zero_optimization.stage=3): use "
				       "stage 0, 1 or 2");
	if (c->zero.offload_optimizer.active)
		return autoep_err(
		    ctx,
		    "does not support optimizer or parameter offload "
		    "(zero_optimization.offload_optimizer.device=\"%s\"): "
		    "remove offload_optimizer or set its device to \"none\"",
		    offload_name(c->zero.offload_optimizer.device));
	if (c->zero.offload_param.active)
		return autoep_err(
		    ctx,
		    "does not support optimizer or parameter offload "
		    "(zero_optimization.offload_param.device=\"%s\"): remove "
		    "offload_param or set its device to \"none\"",
		    offload_name(c->zero.offload_param.device));
	if (c->compile.schedule_present)
		return autoep_err(ctx, "does not support DeepCompile schedules "
				       "(compile.schedule is set): remove "
				       "compile.schedule or set it to null");
	if (c->compile.compiled_autograd)
		return autoep_err(ctx, "does not support compiled autograd "
				       "(compile.compiled_autograd=true): set "
				       "compile.compiled_autograd to false");
	return EPJ_OK;
}

/* DeepSpeed's compile_autoep_non_moe_regions checks these after it found an
 * AutoEP layer; absent counts as false, null does not. */
epj_status ej_config_validate_autoep_kwargs(epj_ctx *ctx, const ej_config *c)
{
	EJ_ASSERT(c);
	if (!c->compile.autoep_non_moe)
		return EPJ_OK;
	if (c->compile.fullgraph != EJ_JSON_FALSE)
		return autoep_err(ctx,
				  "requires fullgraph=False because AutoEP is "
				  "an eager graph break (compile.fullgraph is "
				  "%s): no region is one full graph; set "
				  "compile.fullgraph to false",
				  json_bool_name(c->compile.fullgraph));
	if (c->compile.dynamic != EJ_JSON_FALSE)
		return autoep_err(ctx,
				  "currently requires dynamic=False "
				  "(compile.dynamic is %s): regions are "
				  "compiled for static shapes (null would let "
				  "the compiler choose); set compile.dynamic "
				  "to false",
				  json_bool_name(c->compile.dynamic));
	return EPJ_OK;
}

epj_status ej_config_validate_autoep_compile(epj_ctx *ctx, const ej_config *c)
{
	epj_status st = ej_config_validate_autoep_engine(ctx, c);
	return st != EPJ_OK ? st : ej_config_validate_autoep_kwargs(ctx, c);
}

/* Full-model mode: the options its compile cannot honour, by name. */
static epj_status model_err(epj_ctx *ctx, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static epj_status model_err(epj_ctx *ctx, const char *fmt, ...)
{
	char msg[896];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	return ej_error(ctx, EPJ_ERR_UNSUPPORTED, "compile: %s", msg);
}

epj_status ej_config_validate_model_compile(epj_ctx *ctx, const ej_config *c)
{
	EJ_ASSERT(c);
	if (c->compile.autoep_non_moe)
		return EPJ_OK;
	if (c->compile.deepcompile)
		return model_err(ctx, "compile.deepcompile=true: DeepCompile "
				      "is not implemented in epjit; set "
				      "compile.deepcompile to false");
	if (c->compile.schedule_present)
		return model_err(ctx, "compile.schedule is set: DeepCompile "
				      "schedules are not implemented in "
				      "epjit; remove compile.schedule or set "
				      "it to null");
	if (c->compile.compiled_autograd)
		return model_err(ctx, "compile.compiled_autograd=true: "
				      "compiled autograd is not implemented "
				      "in epjit; set "
				      "compile.compiled_autograd to false");
	if (c->compile.fullgraph == EJ_JSON_TRUE)
		return model_err(ctx, "compile.fullgraph=true is not "
				      "implemented by epjit's full-model "
				      "compile (compile.autoep_non_moe=false), "
				      "which breaks the graph at every AutoEP "
				      "layer (and, with activation "
				      "checkpointing in the nested layout, "
				      "at every decoder block); set "
				      "compile.fullgraph to false");
	return EPJ_OK;
}

/* ==== the JSON writer ==================================================== */

static json_t *json_bool_value(ej_json_bool b)
{
	return b == EJ_JSON_NULL ? json_null()
				 : json_boolean(b == EJ_JSON_TRUE);
}

/* Section sec at base as a JSON object; t >= 0 writes only the keys that
 * type value t takes. */
static json_t *write_section(int sec, const char *base, const ej_config *c,
			     int t)
{
	json_t *o = json_object();
	for (size_t i = 0; o && i < EJ_ARRAY_LEN(keys); i++) {
		const key *k = &keys[i];
		if (k->sec != sec || (k->flags & K_W_NEVER))
			continue;
		if (t >= 0 && !(k->applies & (1u << t)))
			continue;
		json_t *v = NULL;
		int64_t x;
		const char *s;
		switch (k->type) {
		case K_SECTION:
			if (k->wr && !k->wr(k, base, c))
				continue;
			v = write_section(
			    k->child, base + k->off, c,
			    (k->flags & K_BY_TYPE)
				? (int)get_int(type_key(sec), base)
				: -1);
			break;
		case K_SPECIAL:
			v = k->wr(k, base, c);
			break;
		case K_BOOL:
			v = json_boolean(get_bool(k, base));
			break;
		case K_INT:
			x = get_int(k, base);
			if (x == 0 && (k->flags & K_W_NONZERO))
				continue;
			v = x == 0 && (k->flags & K_NULL_OK) ? json_null()
							     : json_integer(x);
			break;
		case K_NUM:
			v = (k->flags & K_NULL_OK) && k->given_off >= 0 &&
				    !*(const bool *)(base + k->given_off)
				? json_null()
				: json_real(get_num(k, base, 0));
			break;
		case K_PAIR:
			v = json_pack("[f,f]", get_num(k, base, 0),
				      get_num(k, base, 1));
			break;
		case K_ENUM:
			x = get_int(k, base) - k->enum_base;
			EJ_ASSERT(x >= 0 && x < k->nchoices);
			v = json_string(k->choices[x]);
			break;
		case K_NAME:
		case K_STR:
			s = field(k, base);
			if (!s[0] && (k->flags & K_W_NONZERO))
				continue;
			v = !s[0] && (k->flags & K_NULL_OK) ? json_null()
							    : json_string(s);
			break;
		case K_TRISTATE:
			v = json_bool_value((ej_json_bool)get_int(k, base));
			break;
		case K_NUMBOOL:
		case K_TEXT:
		case K_ANY:
			continue;
		}
		/* jansson's setters tolerate NULL values (allocation
		 * failures) by failing; json_dumps then still returns a
		 * string or NULL. */
		json_object_set_new(o, k->name, v);
	}
	return o;
}

char *ej_config_to_json(const ej_config *c)
{
	EJ_ASSERT(c);
	json_t *r = write_section(SEC_ROOT, (const char *)c, c, -1);
	if (!r)
		return NULL;
	/* 15 significant digits: readable (0.9, not 0.90000000000000002)
	 * and exact for any value that was read from decimal text of up to
	 * 15 digits, which is where config values come from. */
	char *text = json_dumps(r, JSON_INDENT(2) | JSON_PRESERVE_ORDER |
				       JSON_REAL_PRECISION(15));
	json_decref(r);
	return text;
}

/* ==== the keys, for the reference page =================================== */

bool ej_config_key_at(int i, char *buf, size_t n)
{
	enum { MAXI = 48 };
	char paths[MAXI][160];
	int secs[MAXI], ni = 0;
	instances(SEC_ROOT, "", paths, secs, &ni, MAXI);
	for (int s = 0; s < ni; s++) {
		for (size_t j = 0; j < EJ_ARRAY_LEN(keys); j++) {
			if (keys[j].sec != secs[s])
				continue;
			if (i-- == 0) {
				key_path(buf, n, paths[s], keys[j].name);
				return true;
			}
		}
	}
	return false;
}

/* The value column: the parser's own words for what it accepts. */
static void doc_value(FILE *f, const key *k)
{
	char e[160], list[200];
	if (k->doc_value) {
		fputs(k->doc_value, f);
		return;
	}
	switch (k->type) {
	case K_BOOL:
		fputs("a boolean", f);
		break;
	case K_INT:
		fputs(int_expect(e, sizeof e, k->ilo, k->ihi), f);
		break;
	case K_NUM:
		fputs(num_expect(e, sizeof e, k->lo, k->flags & K_LO_OPEN,
				 k->hi, k->flags & K_HI_OPEN),
		      f);
		break;
	case K_PAIR:
		num_expect(e, sizeof e, k->lo, k->flags & K_LO_OPEN, k->hi,
			   k->flags & K_HI_OPEN);
		fprintf(f, "an array of 2 numbers%s", e + strlen("a number"));
		break;
	case K_ENUM:
	case K_NAME:
		fprintf(f, "one of %s%s", choice_list(k, list, sizeof list),
			(k->flags & K_NOCASE) ? " (case ignored)" : "");
		break;
	case K_STR:
		fprintf(f, "a string of at most %zu bytes", k->size - 1);
		break;
	case K_TRISTATE:
		fputs("a boolean or null", f);
		break;
	case K_NUMBOOL:
		fputs("a number or a boolean", f);
		break;
	case K_TEXT:
		fputs("a string or null", f);
		break;
	case K_ANY:
		fputs(k->kind == KIND_NOT_IMPL
			  ? "any value; off: null, false, `{}` or "
			    "`{\"enabled\": false}`"
			  : "any value",
		      f);
		break;
	case K_SECTION:
	case K_SPECIAL:
		EJ_ASSERT(!"a key without a documented value");
	}
	if ((k->flags & K_NULL_OK) && k->type != K_TRISTATE)
		fputs(", or null", f);
}

static void doc_default(FILE *f, const key *k)
{
	if (k->doc_default) {
		fputs(k->doc_default, f);
		return;
	}
	if (k->flags & K_REQUIRED) {
		fputs("**required**", f);
		return;
	}
	if (k->off < 0)
		return;
	switch (stored_type(k)) {
	case K_BOOL:
		fputs(k->def != 0 ? "true" : "false", f);
		break;
	case K_INT:
		fprintf(f, "%" PRId64, (int64_t)k->def);
		break;
	case K_NUM:
		fprintf(f, "%g", k->def);
		break;
	case K_PAIR:
		fprintf(f, "[%g, %g]", k->def, k->def2);
		break;
	case K_ENUM:
		fprintf(f, "`\"%s\"`", k->choices[(int)k->def - k->enum_base]);
		break;
	case K_NAME:
	case K_STR:
		if (k->def_str)
			fprintf(f, "`\"%s\"`", k->def_str);
		else
			fputs((k->flags & K_NULL_OK) ? "null" : "`\"\"`", f);
		break;
	case K_TRISTATE:
		fputs(k->def == EJ_JSON_TRUE   ? "true"
		      : k->def == EJ_JSON_NULL ? "null"
					       : "false",
		      f);
		break;
	case K_SECTION:
	case K_NUMBOOL:
	case K_SPECIAL:
	case K_TEXT:
	case K_ANY:
		break;
	}
}

/* One table of the scalar keys of section sec at path; skey is the
 * section's own row (NULL for the top level). */
static void doc_section(FILE *f, int sec, const char *path, const key *skey,
			int parent_sec)
{
	if (skey)
		fprintf(f, "### `%s`\n\n", path);
	else
		fputs("### Top level\n\n", f);
	if (skey && skey->doc)
		fprintf(f, "%s\n\n", skey->doc);
	const key *tk =
	    skey && (skey->flags & K_BY_TYPE) ? type_key(parent_sec) : NULL;
	fputs("| key | value | default | class | `\"auto\"` | refused | effect "
	      "|\n"
	      "|---|---|---|---|---|---|---|\n",
	      f);
	for (size_t i = 0; i < EJ_ARRAY_LEN(keys); i++) {
		const key *k = &keys[i];
		if (k->sec != sec || k->type == K_SECTION)
			continue;
		char kp[300];
		key_path(kp, sizeof kp, path, k->name);
		fprintf(f, "| `%s` | ", kp);
		doc_value(f, k);
		fputs(" | ", f);
		doc_default(f, k);
		static const char *const kinds[] = { "acted on", "no effect",
						     "not implemented" };
		fprintf(f, " | %s | %s | %s | ", kinds[k->kind],
			k->auto_doc ? k->auto_doc : "refused",
			k->refused		   ? k->refused
			: k->kind == KIND_NOT_IMPL ? "on: by the parser"
						   : "");
		if (tk) {
			fputs("*", f);
			int o = 0;
			for (int t = 0; t < tk->nchoices; t++)
				if (k->applies & (1u << (t + tk->enum_base)))
					fprintf(f, "%s%s", o++ ? ", " : "",
						tk->choices[t]);
			fputs(":* ", f);
		}
		fprintf(f, "%s |\n", k->doc ? k->doc : "");
	}
	fputs("\n", f);
}

static void doc_tree(FILE *f, int sec, const char *path, const key *skey,
		     int parent_sec)
{
	doc_section(f, sec, path, skey, parent_sec);
	for (size_t i = 0; i < EJ_ARRAY_LEN(keys); i++) {
		const key *k = &keys[i];
		if (k->sec != sec || k->type != K_SECTION)
			continue;
		char sub[300];
		key_path(sub, sizeof sub, path, k->name);
		doc_tree(f, k->child, sub, k, sec);
	}
}

char *ej_config_reference(void)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	if (!f)
		return NULL;
	fputs(EJ_CONFIG_DOC_BEGIN "\n"
				  "## Keys\n\n"
				  "Every key of the training config as the "
				  "parser reads it: the value it accepts (in "
				  "the words of its errors), the default, "
				  "which values are refused by whom and why, "
				  "and what it does. \"Parsed only\" means: "
				  "type- and range-checked, kept in the "
				  "config, and not acted on by this build "
				  "(kept for configs written for DeepSpeed). "
				  "\"By initialize\" refusals are "
				  "`epj_engine_initialize`'s (see *What "
				  "`epj_engine_initialize` refuses*), those "
				  "\"with `compile.autoep_non_moe`\" are the "
				  "support boundary below. The class says "
				  "what epjit does with the key: *acted on*; "
				  "*no effect* (DeepSpeed's keys that only "
				  "observe or tune a run: checked, then named "
				  "in one warning, `accepted, no effect in "
				  "epjit: a.b, c`); *not implemented* (a "
				  "feature that would change the computation: "
				  "refused by the parser when on, named with "
				  "the no-effect keys when off). The "
				  "`\"auto\"` column is the value a key "
				  "written `\"auto\"` takes (see *\"auto\"* "
				  "above); \"refused\" means the key does not "
				  "accept it. In "
				  "`optimizer.params` and `scheduler.params` "
				  "the effect starts with the types that take "
				  "the key; the JSON dump of the effective "
				  "config (`ej_config_to_json`) writes the "
				  "keys of this table that are kept.\n\n",
	      f);
	doc_tree(f, SEC_ROOT, "", NULL, -1);
	fputs(EJ_CONFIG_DOC_END "\n", f);
	if (fclose(f) != 0) {
		free(buf);
		return NULL;
	}
	return buf;
}

/* ==== the public config object (epj_config) ============================== */

/* The row of dotted path `path` and the base of its section in c (NULL
 * when no row has that path).  A K_BY_TYPE section's row is the one its
 * parent's type takes, else the first of that name. */
static const key *find_key(const ej_config *c, const char *path,
			   const char **base)
{
	int sec = SEC_ROOT, t = -1;
	const char *b = (const char *)c;
	const char *seg = path;
	for (;;) {
		const char *dot = strchr(seg, '.');
		size_t len = dot ? (size_t)(dot - seg) : strlen(seg);
		const key *hit = NULL;
		for (size_t i = 0; i < EJ_ARRAY_LEN(keys); i++) {
			const key *k = &keys[i];
			if (k->sec != sec || strlen(k->name) != len ||
			    strncmp(k->name, seg, len) != 0)
				continue;
			if (!hit || (t >= 0 && (k->applies & (1u << t)) &&
				     !(hit->applies & (1u << t))))
				hit = k;
		}
		if (!hit || !dot) {
			*base = b;
			return hit;
		}
		if (hit->type != K_SECTION)
			return NULL;
		t = (hit->flags & K_BY_TYPE) ? (int)get_int(type_key(sec), b)
					     : -1;
		b += hit->off;
		sec = hit->child;
		seg = dot + 1;
	}
}

/* "the nearest key is X" for an unknown path, or "". */
static void nearest_path(const char *path, char *buf, size_t n)
{
	char cand[160], best[160] = "";
	int bd = 4; /* a likely typo: at most 3 edits */
	for (int i = 0; ej_config_key_at(i, cand, sizeof cand); i++) {
		int d = ej_edit_distance(path, cand);
		if (d < bd) {
			bd = d;
			snprintf(best, sizeof best, "%s", cand);
		}
	}
	if (best[0])
		snprintf(buf, n, " (did you mean \"%s\"?)", best);
	else
		buf[0] = '\0';
}

static const char *const stored_names[] = {
	[K_BOOL] = "a boolean",	   [K_INT] = "an integer",
	[K_NUM] = "a number",	   [K_PAIR] = "a pair of numbers",
	[K_ENUM] = "a string",	   [K_NAME] = "a string",
	[K_STR] = "a string",	   [K_TRISTATE] = "true, false or null",
	[K_SECTION] = "a section",
};

/* The row of path in c as the getter `want` (its name) reads it, with
 * its base; NULL after an error naming the key and what it holds. */
static const key *getter_key(epj_ctx *ctx, const epj_config *c,
			     const char *path, const char *want,
			     const key_type *ok, int nok, const char **base)
{
	EJ_ASSERT(c && path);
	const key *k = find_key(&c->cfg, path, base);
	if (!k) {
		char hint[200];
		nearest_path(path, hint, sizeof hint);
		if (ctx)
			ej_error(ctx, EPJ_ERR_INVALID,
				 "epj_config_%s: \"%s\" is not a key of the "
				 "training config (doc/config.md)%s",
				 want, path, hint);
		return NULL;
	}
	if (k->type != K_SECTION && k->off < 0) {
		if (ctx)
			ej_error(ctx, EPJ_ERR_INVALID,
				 "epj_config_%s: \"%s\" is accepted and not "
				 "kept (it has no effect in epjit, "
				 "doc/config.md)",
				 want, path);
		return NULL;
	}
	key_type st = stored_type(k);
	for (int i = 0; i < nok; i++)
		if (st == ok[i])
			return k;
	const char *what =
	    (size_t)st < EJ_ARRAY_LEN(stored_names) && stored_names[st]
		? stored_names[st]
		: "not a plain value";
	if (ctx)
		ej_error(ctx, EPJ_ERR_INVALID,
			 "epj_config_%s: \"%s\" is %s%s, not what "
			 "epj_config_%s reads",
			 want, path, what,
			 st == K_SECTION ? " (name one of its keys)" : "",
			 want);
	return NULL;
}

epj_status epj_config_int(epj_ctx *ctx, const epj_config *c, const char *key,
			  int64_t *out)
{
	static const key_type ok[] = { K_INT };
	const char *base;
	const struct key *k = getter_key(ctx, c, key, "int", ok, 1, &base);
	if (!k)
		return EPJ_ERR_INVALID;
	*out = get_int(k, base);
	return EPJ_OK;
}

epj_status epj_config_real(epj_ctx *ctx, const epj_config *c, const char *key,
			   double *out)
{
	static const key_type ok[] = { K_NUM, K_INT };
	const char *base;
	const struct key *k = getter_key(ctx, c, key, "real", ok, 2, &base);
	if (!k)
		return EPJ_ERR_INVALID;
	*out = stored_type(k) == K_INT ? (double)get_int(k, base)
				       : get_num(k, base, 0);
	return EPJ_OK;
}

epj_status epj_config_bool(epj_ctx *ctx, const epj_config *c, const char *key,
			   bool *out)
{
	static const key_type ok[] = { K_BOOL };
	const char *base;
	const struct key *k = getter_key(ctx, c, key, "bool", ok, 1, &base);
	if (!k)
		return EPJ_ERR_INVALID;
	*out = get_bool(k, base);
	return EPJ_OK;
}

epj_status epj_config_str(epj_ctx *ctx, const epj_config *c, const char *key,
			  const char **out)
{
	static const key_type ok[] = { K_NAME, K_STR, K_ENUM, K_TRISTATE };
	static const char *const tri[] = { "false", "true", "null" };
	const char *base;
	const struct key *k = getter_key(ctx, c, key, "str", ok, 4, &base);
	if (!k)
		return EPJ_ERR_INVALID;
	int64_t x;
	switch (stored_type(k)) {
	case K_ENUM:
		x = get_int(k, base) - k->enum_base;
		EJ_ASSERT(x >= 0 && x < k->nchoices);
		*out = k->choices[x];
		break;
	case K_TRISTATE:
		x = get_int(k, base);
		EJ_ASSERT(x >= 0 && x < 3);
		*out = tri[x];
		break;
	default:
		*out = field(k, base);
		break;
	}
	return EPJ_OK;
}

bool epj_config_given(const epj_config *c, const char *key)
{
	EJ_ASSERT(c && key);
	char buf[300];
	snprintf(buf, sizeof buf, "%s", key);
	json_t *o = c->file;
	char *save = NULL;
	for (char *t = strtok_r(buf, ".", &save); t && o;
	     t = strtok_r(NULL, ".", &save))
		o = json_is_object(o) ? json_object_get(o, t) : NULL;
	return o && !json_is_null(o);
}

const char *epj_config_source(const epj_config *c)
{
	return c->cfg.source;
}

char *epj_config_to_json(const epj_config *c)
{
	return ej_config_to_json(&c->cfg);
}

epj_status epj_config_parse(epj_ctx *ctx, const char *json, const char *source,
			    const char *auto_json, epj_config **out)
{
	EJ_ASSERT(out);
	*out = NULL;
	if (!json)
		json = "{}";
	epj_config *c = calloc(1, sizeof *c);
	if (!c)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	epj_status st =
	    ej_config_parse_auto(ctx, json, source, auto_json, &c->cfg);
	/* the file's own keys, for epj_config_given */
	if (st == EPJ_OK)
		st = ej_config_json_object(ctx, json, c->cfg.source, &c->file);
	if (st != EPJ_OK) {
		epj_config_free(c);
		return st;
	}
	*out = c;
	return EPJ_OK;
}

epj_status epj_config_load(epj_ctx *ctx, const char *path,
			   const char *auto_json, epj_config **out)
{
	EJ_ASSERT(out);
	*out = NULL;
	if (!path)
		return epj_config_parse(ctx, "{}", "<defaults>", NULL, out);
	char *text = ej_config_read_file(ctx, path);
	if (!text)
		return epj_ctx_status(ctx);
	epj_status st = epj_config_parse(ctx, text, path, auto_json, out);
	free(text);
	return st;
}

void epj_config_free(epj_config *c)
{
	if (!c)
		return;
	json_decref(c->file);
	free(c);
}
