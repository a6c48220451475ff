/* config.c -- the DeepSpeed-style training configuration (ds.json).
 *
 * A strict reader: every key of every section is looked up in the tables
 * below, so an unknown key (a typo that DeepSpeed's pydantic models would
 * also reject) is an error naming its full dotted path and, when one is
 * close, the key the user probably meant.  Values are type- and
 * range-checked where they are read; cross-field rules follow (batch
 * divisibility, parameters that the chosen optimizer or scheduler does not
 * take).  The support boundary of compile.autoep_non_moe is a separate check
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

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <string.h>
#include <strings.h>

/* Upper bound of batch-like integers: keeps micro * gas * world in int64. */
#define BATCH_MAX ((int64_t)1 << 31)
/* Upper bound of ints stored in `int` fields. */
#define INT_FIELD_MAX ((int64_t)1 << 30)

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

/* ==== key tables ========================================================= */

/* One JSON object level of the config: its dotted path and its keys. */
enum {
	SEC_ROOT,
	SEC_BF16,
	SEC_FP16,
	SEC_OPTIM,
	SEC_OPTIM_PARAMS,
	SEC_SCHED,
	SEC_SCHED_PARAMS,
	SEC_ZERO,
	SEC_OFFLOAD_OPT,
	SEC_OFFLOAD_PARAM,
	SEC_ACT_CKPT,
	SEC_EP,
	SEC_COMPILE,
	SEC_PIPELINE,
	SEC_TP,
	SEC_COMM,
	SEC_CSV_MONITOR,
	SEC_COUNT
};

static const char *const k_root[] = {
	"train_batch_size",
	"train_micro_batch_size_per_gpu",
	"gradient_accumulation_steps",
	"bf16",
	"fp16",
	"optimizer",
	"scheduler",
	"gradient_clipping",
	"zero_optimization",
	"activation_checkpointing",
	"expert_parallel",
	"compile",
	"sequence_parallel_size",
	"pipeline",
	"tensor_parallel",
	"steps_per_print",
	"seed",
	"wall_clock_breakdown",
	"device",
	"skip_nonfinite_steps",
	"comm",
	"csv_monitor",
};
static const char *const k_bf16[] = { "enabled" };
static const char *const k_csv_monitor[] = { "enabled", "output_path",
					     "job_name" };
/* fp16 must be disabled; its loss-scaling keys are accepted (moot). */
static const char *const k_fp16[] = {
	"enabled",
	"auto_cast",
	"loss_scale",
	"initial_scale_power",
	"loss_scale_window",
	"hysteresis",
	"consecutive_hysteresis",
	"min_loss_scale",
};
static const char *const k_optim[] = { "type", "params" };
static const char *const k_optim_params[] = {
	"lr",  "momentum",     "nesterov",    "betas",
	"eps", "weight_decay", "adam_w_mode",
};
static const char *const k_sched[] = { "type", "params" };
static const char *const k_sched_params[] = {
	"warmup_min_lr",    "warmup_max_lr",	    "warmup_num_steps",
	"warmup_type",	    "total_num_steps",	    "cos_min_ratio",
	"warmup_min_ratio", "last_batch_iteration",
};
static const char *const k_zero[] = {
	"stage",
	"offload_optimizer",
	"offload_param",
	"reduce_bucket_size",
	"allgather_bucket_size",
	"overlap_comm",
	"contiguous_gradients",
	"allgather_partitions",
	"reduce_scatter",
	"round_robin_gradients",
};
static const char *const k_offload[] = {
	"device",	  "pin_memory", "nvme_path", "buffer_count",
	"buffer_size",	  "max_in_cpu", "fast_init", "pipeline_read",
	"pipeline_write", "ratio",
};
static const char *const k_act_ckpt[] = {
	"enabled",
	"partition_activations",
	"cpu_checkpointing",
	"contiguous_memory_optimization",
	"number_checkpoints",
	"synchronize_checkpoint_boundary",
	"profile",
};
static const char *const k_ep[] = {
	"enabled",	    "autoep_size",
	"comm_backend",	    "preset_model",
	"async_split_plan", "top_k",
	"route_norm",	    "route_scale",
	"fixed_routing",    "load_balance_coeff",
};
static const char *const k_compile[] = {
	"autoep_non_moe", "backend",	       "fullgraph", "dynamic",
	"deepcompile",	  "compiled_autograd", "schedule",
};
static const char *const k_pipeline[] = { "stages" };
static const char *const k_tp[] = { "autotp_size" };
static const char *const k_comm[] = { "timeout_s" };

static const struct section {
	const char *path; /* "" for the top level */
	const char *const *keys;
	int n;
} sections[SEC_COUNT] = {
#define SEC(id, path, arr) [id] = { path, arr, (int)EJ_ARRAY_LEN(arr) }
	SEC(SEC_ROOT, "", k_root),
	SEC(SEC_BF16, "bf16", k_bf16),
	SEC(SEC_FP16, "fp16", k_fp16),
	SEC(SEC_OPTIM, "optimizer", k_optim),
	SEC(SEC_OPTIM_PARAMS, "optimizer.params", k_optim_params),
	SEC(SEC_SCHED, "scheduler", k_sched),
	SEC(SEC_SCHED_PARAMS, "scheduler.params", k_sched_params),
	SEC(SEC_ZERO, "zero_optimization", k_zero),
	SEC(SEC_OFFLOAD_OPT, "zero_optimization.offload_optimizer", k_offload),
	SEC(SEC_OFFLOAD_PARAM, "zero_optimization.offload_param", k_offload),
	SEC(SEC_ACT_CKPT, "activation_checkpointing", k_act_ckpt),
	SEC(SEC_EP, "expert_parallel", k_ep),
	SEC(SEC_COMPILE, "compile", k_compile),
	SEC(SEC_PIPELINE, "pipeline", k_pipeline),
	SEC(SEC_TP, "tensor_parallel", k_tp),
	SEC(SEC_COMM, "comm", k_comm),
	SEC(SEC_CSV_MONITOR, "csv_monitor", k_csv_monitor),
#undef SEC
};

static const char *const optim_names[] = { "SGD", "Adam", "AdamW" };
static const char *const sched_names[] = { "WarmupLR", "WarmupDecayLR",
					   "WarmupCosineLR" };
static const char *const comm_backends[] = { "comm", "deepep" };
static const char *const compile_backends[] = { "interpreter", "c", "nvrtc",
						"cuda-sim" };
static const char *const offload_devices[] = { "none", "cpu", "nvme" };
static const char *const preset_models[] = { "qwen3_moe" };

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

/* ==== defaults =========================================================== */

static void set_str(char *dst, size_t n, const char *src)
{
	/* Zero-fills the rest so that configs compare bytewise. */
	memset(dst, 0, n);
	snprintf(dst, n, "%s", src);
}

void ej_config_defaults(ej_config *c)
{
	memset(c, 0, sizeof *c);
	set_str(c->source, sizeof c->source, "<defaults>");
	c->optimizer.type = EJ_OPTIM_ADAMW;
	c->optimizer.lr = 1e-3;
	c->optimizer.betas[0] = 0.9;
	c->optimizer.betas[1] = 0.999;
	c->optimizer.eps = 1e-8;
	c->optimizer.adam_w_mode = true;
	c->scheduler.type = EJ_SCHED_NONE;
	c->scheduler.warmup_max_lr = 1e-3;
	c->scheduler.warmup_num_steps = 1000;
	c->scheduler.warmup_type = EJ_WARMUP_LOG;
	c->scheduler.cos_min_ratio = 1e-4;
	c->scheduler.last_batch_iteration = -1;
	c->zero.reduce_bucket_size = 500000000;
	c->zero.allgather_bucket_size = 500000000;
	c->zero.contiguous_gradients = true;
	c->expert_parallel.autoep_size = 1;
	set_str(c->expert_parallel.comm_backend,
		sizeof c->expert_parallel.comm_backend, "comm");
	set_str(c->csv_monitor.job_name, sizeof c->csv_monitor.job_name,
		"DeepSpeedJobName");
	c->expert_parallel.route_norm = -1;
	c->expert_parallel.route_scale = 1.0;
	c->expert_parallel.has_load_balance = true;
	c->expert_parallel.load_balance_coeff = 1e-3;
	c->compile.fullgraph = EJ_JSON_FALSE;
	c->compile.dynamic = EJ_JSON_FALSE;
	c->sequence_parallel_size = 1;
	c->pipeline_stages = 1;
	c->comm_timeout_s = 300.0;
	c->autotp_size = 1;
	c->steps_per_print = 10;
	c->seed = 42;
}

/* ==== the reader ========================================================= */

typedef struct cp {
	epj_ctx *ctx;
	const char *src;
} cp;

/* An EPJ_ERR_CONFIG error naming the config's source (ej_config_error). */
#define cp_err(p, ...) ej_config_error((p)->ctx, (p)->src, __VA_ARGS__)

static void key_path(char *buf, size_t n, const char *prefix, const char *key)
{
	if (prefix[0])
		snprintf(buf, n, "%s.%s", prefix, key);
	else
		snprintf(buf, n, "%s", key);
}

/* Rejects any key of obj that is not in section `sec`. */
static epj_status check_keys(cp *p, json_t *obj, int sec)
{
	const struct section *S = &sections[sec];
	const char *key;
	json_t *val;
	json_object_foreach(obj, key, val)
	{
		bool known = false;
		for (int i = 0; i < S->n && !known; i++)
			known = strcmp(key, S->keys[i]) == 0;
		if (known)
			continue;
		char path[300], hint[400] = "";
		key_path(path, sizeof path, S->path, key);
		const char *near = ej_nearest_key(key, S->keys, S->n);
		if (near) {
			char np[300];
			key_path(np, sizeof np, S->path, near);
			snprintf(hint, sizeof hint, " (did you mean \"%s\"?)",
				 np);
		} else {
			/* A key at the wrong level: suggest the one section
			 * that has it (e.g. top-level "stage"). */
			int found = -1, count = 0;
			for (int s = 0; s < SEC_COUNT; s++) {
				if (s == sec)
					continue;
				for (int i = 0; i < sections[s].n; i++) {
					if (strcasecmp(key,
						       sections[s].keys[i]) ==
					    0) {
						found = s;
						count++;
					}
				}
			}
			if (count == 1) {
				char np[300];
				key_path(np, sizeof np, sections[found].path,
					 key);
				snprintf(hint, sizeof hint,
					 " (did you mean \"%s\"?)", np);
			} else if (sec != SEC_ROOT) {
				size_t o = (size_t)snprintf(
				    hint, sizeof hint,
				    " (known keys in \"%s\":", S->path);
				for (int i = 0; i < S->n && o < sizeof hint;
				     i++)
					o += (size_t)snprintf(
					    hint + o, sizeof hint - o, "%s %s",
					    i ? "," : "", S->keys[i]);
				if (o < sizeof hint)
					snprintf(hint + o, sizeof hint - o,
						 ")");
			}
		}
		return cp_err(p, "unknown key \"%s\"%s", path, hint);
	}
	return EPJ_OK;
}

/* The object at parent[key] as section `sec` (keys checked).  *out is NULL
 * when the key is absent or null (DeepSpeed treats both as "not set"). */
static epj_status get_section(cp *p, json_t *parent, const char *key, int sec,
			      json_t **out)
{
	*out = NULL;
	json_t *v = json_object_get(parent, key);
	if (!v || json_is_null(v))
		return EPJ_OK;
	if (!json_is_object(v)) {
		char g[100];
		return cp_err(p, "\"%s\" must be an object, got %s",
			      sections[sec].path,
			      ej_json_describe(v, g, sizeof g));
	}
	*out = v;
	return check_keys(p, v, sec);
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

/* Reads obj[key] as an integer in [lo, hi].  Absent: OK, *out untouched.
 * *given (optional) is set when present. */
static epj_status rd_int(cp *p, json_t *obj, const char *prefix,
			 const char *key, int64_t lo, int64_t hi, int64_t *out,
			 bool *given)
{
	json_t *v = json_object_get(obj, key);
	if (!v)
		return EPJ_OK;
	char path[300], e[80], g[100];
	key_path(path, sizeof path, prefix, key);
	int64_t x;
	if (!ej_json_as_int(v, &x))
		return cp_err(p, "\"%s\" must be %s, got %s", path,
			      int_expect(e, sizeof e, lo, hi),
			      ej_json_describe(v, g, sizeof g));
	if (x < lo || x > hi)
		return cp_err(p, "\"%s\" must be %s, got %" PRId64, path,
			      int_expect(e, sizeof e, lo, hi), x);
	*out = x;
	if (given)
		*given = true;
	return EPJ_OK;
}

/* Same into an int field. */
static epj_status rd_i32(cp *p, json_t *obj, const char *prefix,
			 const char *key, int64_t lo, int64_t hi, int *out)
{
	int64_t x = *out;
	epj_status s = rd_int(p, obj, prefix, key, lo, hi, &x, NULL);
	if (s == EPJ_OK)
		*out = (int)x;
	return s;
}

/* Reads obj[key] as a number with lo <= x (lo < x when lo_open) and
 * x <= hi (x < hi when hi_open).  Use -HUGE_VAL / HUGE_VAL for no bound. */
static epj_status rd_num(cp *p, json_t *obj, const char *prefix,
			 const char *key, double lo, bool lo_open, double hi,
			 bool hi_open, double *out)
{
	json_t *v = json_object_get(obj, key);
	if (!v)
		return EPJ_OK;
	char path[300], e[120], g[100];
	key_path(path, sizeof path, prefix, key);
	if (isinf(lo) && isinf(hi))
		snprintf(e, sizeof e, "a number");
	else if (isinf(hi))
		snprintf(e, sizeof e, "a number %s %g",
			 lo_open ? ">" : ">=", lo);
	else
		snprintf(e, sizeof e, "a number in %c%g, %g%c",
			 lo_open ? '(' : '[', lo, hi, hi_open ? ')' : ']');
	if (!json_is_number(v))
		return cp_err(p, "\"%s\" must be %s, got %s", path, e,
			      ej_json_describe(v, g, sizeof g));
	double x = json_number_value(v);
	if (x < lo || (lo_open && x == lo) || x > hi || (hi_open && x == hi))
		return cp_err(p, "\"%s\" must be %s, got %g", path, e, x);
	*out = x;
	return EPJ_OK;
}

static epj_status rd_bool(cp *p, json_t *obj, const char *prefix,
			  const char *key, bool *out)
{
	json_t *v = json_object_get(obj, key);
	if (!v)
		return EPJ_OK;
	if (!json_is_boolean(v)) {
		char path[300], g[100];
		key_path(path, sizeof path, prefix, key);
		return cp_err(p, "\"%s\" must be a boolean, got %s", path,
			      ej_json_describe(v, g, sizeof g));
	}
	*out = json_is_true(v);
	return EPJ_OK;
}

/* A bool that may also be null, kept exactly (compile.fullgraph/dynamic). */
static epj_status rd_json_bool(cp *p, json_t *obj, const char *prefix,
			       const char *key, ej_json_bool *out, bool *given)
{
	json_t *v = json_object_get(obj, key);
	if (!v)
		return EPJ_OK;
	if (!json_is_boolean(v) && !json_is_null(v)) {
		char path[300], g[100];
		key_path(path, sizeof path, prefix, key);
		return cp_err(p, "\"%s\" must be a boolean or null, got %s",
			      path, ej_json_describe(v, g, sizeof g));
	}
	*out = json_is_null(v)	 ? EJ_JSON_NULL
	       : json_is_true(v) ? EJ_JSON_TRUE
				 : EJ_JSON_FALSE;
	*given = true;
	return EPJ_OK;
}

/* Reads obj[key] as one of the strings in choices (exact match) into idx.
 * Unknown values name the choices and the nearest one. */
static epj_status rd_choice(cp *p, json_t *obj, const char *prefix,
			    const char *key, const char *const *choices, int n,
			    bool nocase, int *idx)
{
	json_t *v = json_object_get(obj, key);
	if (!v)
		return EPJ_OK;
	char path[300], g[100], list[200];
	key_path(path, sizeof path, prefix, key);
	size_t o = 0;
	for (int i = 0; i < n && o < sizeof list; i++)
		o += (size_t)snprintf(list + o, sizeof list - o, "%s\"%s\"",
				      i ? ", " : "", choices[i]);
	if (!json_is_string(v))
		return cp_err(p, "\"%s\" must be a string (one of %s), got %s",
			      path, list, ej_json_describe(v, g, sizeof g));
	const char *s = json_string_value(v);
	for (int i = 0; i < n; i++) {
		if (nocase ? strcasecmp(s, choices[i]) == 0
			   : strcmp(s, choices[i]) == 0) {
			*idx = i;
			return EPJ_OK;
		}
	}
	const char *near = ej_nearest_key(s, choices, n);
	char hint[120] = "";
	if (near)
		snprintf(hint, sizeof hint, " (did you mean \"%s\"?)", near);
	return cp_err(p,
		      "\"%s\" value \"%.60s\" is not supported%s; expected "
		      "one of %s",
		      path, s, hint, list);
}

/* ==== sections =========================================================== */

static epj_status parse_precision(cp *p, json_t *root, ej_config *c)
{
	epj_status s;
	json_t *o;
	if ((s = get_section(p, root, "bf16", SEC_BF16, &o)))
		return s;
	if (o && (s = rd_bool(p, o, "bf16", "enabled", &c->bf16_enabled)))
		return s;
	if ((s = get_section(p, root, "fp16", SEC_FP16, &o)))
		return s;
	if (o) {
		bool fp16 = false;
		if ((s = rd_bool(p, o, "fp16", "enabled", &fp16)))
			return s;
		if (fp16)
			return cp_err(p, "\"fp16.enabled\" must be false: fp16 "
					 "training is not supported; use "
					 "\"bf16\": {\"enabled\": true}");
		/* The loss-scaling keys only matter with fp16 on. */
		const char *key;
		json_t *v;
		json_object_foreach(o, key, v)
		{
			if (strcmp(key, "enabled") && !json_is_number(v) &&
			    !json_is_boolean(v)) {
				char g[100];
				return cp_err(p,
					      "\"fp16.%s\" must be a number or "
					      "a boolean, got %s",
					      key,
					      ej_json_describe(v, g, sizeof g));
			}
		}
	}
	return EPJ_OK;
}

/* Parameters each optimizer type takes (DeepSpeed passes "params" to the
 * constructor, which rejects others). */
static const char *const sgd_params[] = { "lr", "momentum", "nesterov",
					  "weight_decay" };
static const char *const adam_params[] = { "lr", "betas", "eps", "weight_decay",
					   "adam_w_mode" };
static const char *const adamw_params[] = { "lr", "betas", "eps",
					    "weight_decay" };

static bool in_list(const char *key, const char *const *list, int n)
{
	for (int i = 0; i < n; i++)
		if (strcmp(key, list[i]) == 0)
			return true;
	return false;
}

static epj_status check_applicable(cp *p, json_t *params, const char *prefix,
				   const char *what, const char *type_name,
				   const char *const *allowed, int n)
{
	const char *key;
	json_t *v;
	json_object_foreach(params, key, v)
	{
		if (in_list(key, allowed, n))
			continue;
		char list[200];
		size_t o = 0;
		for (int i = 0; i < n && o < sizeof list; i++)
			o += (size_t)snprintf(list + o, sizeof list - o, "%s%s",
					      i ? ", " : "", allowed[i]);
		return cp_err(p,
			      "\"%s.%s\" is not a parameter of %s type %s (it "
			      "takes: %s)",
			      prefix, key, what, type_name, list);
	}
	return EPJ_OK;
}

static epj_status parse_optimizer(cp *p, json_t *root, ej_config *c)
{
	epj_status s;
	json_t *o, *pp;
	if ((s = get_section(p, root, "optimizer", SEC_OPTIM, &o)))
		return s;
	if (!o)
		return EPJ_OK;
	c->optimizer.given = true;
	if (!json_object_get(o, "type"))
		return cp_err(p, "\"optimizer.type\" is required (one of "
				 "\"SGD\", \"Adam\", \"AdamW\")");
	/* DeepSpeed matches optimizer names case-insensitively. */
	int t = 0;
	if ((s = rd_choice(p, o, "optimizer", "type", optim_names,
			   (int)EJ_ARRAY_LEN(optim_names), true, &t)))
		return s;
	c->optimizer.type = (ej_optim_type)t;
	c->optimizer.adam_w_mode = c->optimizer.type != EJ_OPTIM_SGD;
	if ((s = get_section(p, o, "params", SEC_OPTIM_PARAMS, &pp)))
		return s;
	if (!pp)
		return EPJ_OK;
	const char *const *allowed =
	    c->optimizer.type == EJ_OPTIM_SGD	 ? sgd_params
	    : c->optimizer.type == EJ_OPTIM_ADAM ? adam_params
						 : adamw_params;
	int n = c->optimizer.type == EJ_OPTIM_SGD
		    ? (int)EJ_ARRAY_LEN(sgd_params)
		: c->optimizer.type == EJ_OPTIM_ADAM
		    ? (int)EJ_ARRAY_LEN(adam_params)
		    : (int)EJ_ARRAY_LEN(adamw_params);
	if ((s = check_applicable(p, pp, "optimizer.params", "optimizer",
				  optim_names[t], allowed, n)))
		return s;
	const char *P = "optimizer.params";
	if ((s = rd_num(p, pp, P, "lr", 0, false, HUGE_VAL, false,
			&c->optimizer.lr)) ||
	    (s = rd_num(p, pp, P, "momentum", 0, false, 1, true,
			&c->optimizer.momentum)) ||
	    (s = rd_bool(p, pp, P, "nesterov", &c->optimizer.nesterov)) ||
	    (s = rd_num(p, pp, P, "eps", 0, true, HUGE_VAL, false,
			&c->optimizer.eps)) ||
	    (s = rd_num(p, pp, P, "weight_decay", 0, false, HUGE_VAL, false,
			&c->optimizer.weight_decay)) ||
	    (s = rd_bool(p, pp, P, "adam_w_mode", &c->optimizer.adam_w_mode)))
		return s;
	json_t *b = json_object_get(pp, "betas");
	if (b) {
		char g[100];
		if (!json_is_array(b) || json_array_size(b) != 2)
			return cp_err(p,
				      "\"optimizer.params.betas\" must be an "
				      "array of 2 numbers in [0, 1), got %s%s",
				      ej_json_describe(b, g, sizeof g),
				      json_is_array(b) ? " of another length"
						       : "");
		for (int i = 0; i < 2; i++) {
			json_t *x = json_array_get(b, (size_t)i);
			double d =
			    json_is_number(x) ? json_number_value(x) : -1.0;
			if (!json_is_number(x) || d < 0 || d >= 1)
				return cp_err(
				    p,
				    "\"optimizer.params.betas[%d]\" must be a "
				    "number in [0, 1), got %s",
				    i,
				    json_is_number(x)
					? (snprintf(g, sizeof g, "%g", d), g)
					: ej_json_describe(x, g, sizeof g));
			c->optimizer.betas[i] = d;
		}
	}
	if (c->optimizer.nesterov && !(c->optimizer.momentum > 0))
		return cp_err(p, "\"optimizer.params.nesterov\" is true but "
				 "\"optimizer.params.momentum\" is 0: Nesterov "
				 "momentum needs momentum > 0");
	return EPJ_OK;
}

static const char *const warmuplr_params[] = {
	"warmup_min_lr", "warmup_max_lr",	 "warmup_num_steps",
	"warmup_type",	 "last_batch_iteration",
};
static const char *const decaylr_params[] = {
	"warmup_min_lr", "warmup_max_lr",	 "warmup_num_steps",
	"warmup_type",	 "last_batch_iteration", "total_num_steps",
};
static const char *const cosinelr_params[] = {
	"total_num_steps", "warmup_min_ratio", "warmup_num_steps",
	"cos_min_ratio",   "warmup_type",      "last_batch_iteration",
};

static epj_status parse_scheduler(cp *p, json_t *root, ej_config *c)
{
	epj_status s;
	json_t *o, *pp;
	if ((s = get_section(p, root, "scheduler", SEC_SCHED, &o)))
		return s;
	if (!o)
		return EPJ_OK;
	if (!json_object_get(o, "type"))
		return cp_err(p, "\"scheduler.type\" is required (one of "
				 "\"WarmupLR\", \"WarmupDecayLR\", "
				 "\"WarmupCosineLR\")");
	/* DeepSpeed looks schedulers up by exact class name. */
	int t = 0;
	if ((s = rd_choice(p, o, "scheduler", "type", sched_names,
			   (int)EJ_ARRAY_LEN(sched_names), false, &t)))
		return s;
	c->scheduler.type = (ej_sched_type)(t + 1);
	if ((s = get_section(p, o, "params", SEC_SCHED_PARAMS, &pp)))
		return s;
	const char *const *allowed = t == 0   ? warmuplr_params
				     : t == 1 ? decaylr_params
					      : cosinelr_params;
	int n = t == 0	 ? (int)EJ_ARRAY_LEN(warmuplr_params)
		: t == 1 ? (int)EJ_ARRAY_LEN(decaylr_params)
			 : (int)EJ_ARRAY_LEN(cosinelr_params);
	const char *P = "scheduler.params";
	bool total_given = false;
	if (pp) {
		if ((s = check_applicable(p, pp, P, "scheduler", sched_names[t],
					  allowed, n)))
			return s;
		int wt = 0;
		static const char *const wtypes[] = { "log", "linear" };
		if ((s = rd_num(p, pp, P, "warmup_min_lr", 0, false, HUGE_VAL,
				false, &c->scheduler.warmup_min_lr)) ||
		    (s = rd_num(p, pp, P, "warmup_max_lr", 0, false, HUGE_VAL,
				false, &c->scheduler.warmup_max_lr)) ||
		    (s = rd_int(p, pp, P, "warmup_num_steps", 0, BATCH_MAX,
				&c->scheduler.warmup_num_steps, NULL)) ||
		    (s = rd_choice(p, pp, P, "warmup_type", wtypes, 2, false,
				   &wt)) ||
		    (s = rd_int(p, pp, P, "total_num_steps", 1, BATCH_MAX,
				&c->scheduler.total_num_steps, &total_given)) ||
		    (s = rd_num(p, pp, P, "cos_min_ratio", 0, false, 1, false,
				&c->scheduler.cos_min_ratio)) ||
		    (s = rd_num(p, pp, P, "warmup_min_ratio", 0, false, 1,
				false, &c->scheduler.warmup_min_ratio)) ||
		    (s = rd_int(p, pp, P, "last_batch_iteration", -1, BATCH_MAX,
				&c->scheduler.last_batch_iteration, NULL)))
			return s;
		c->scheduler.warmup_type = (ej_warmup_type)wt;
	}
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

static epj_status parse_offload(cp *p, json_t *zero, const char *key, int sec,
				ej_offload_config *off)
{
	epj_status s;
	json_t *o;
	if ((s = get_section(p, zero, key, sec, &o)))
		return s;
	if (!o)
		return EPJ_OK; /* absent or null: no offload */
	off->present = true;
	const char *P = sections[sec].path;
	int dev = 0;
	int64_t ignored = 0;
	double ratio = 1.0;
	bool b = false;
	if ((s = rd_choice(p, o, P, "device", offload_devices,
			   (int)EJ_ARRAY_LEN(offload_devices), false, &dev)) ||
	    (s = rd_bool(p, o, P, "pin_memory", &off->pin_memory)) ||
	    (s = rd_int(p, o, P, "buffer_count", 1, BATCH_MAX, &ignored,
			NULL)) ||
	    (s = rd_int(p, o, P, "buffer_size", 1, INT64_MAX / 2, &ignored,
			NULL)) ||
	    (s = rd_int(p, o, P, "max_in_cpu", 0, INT64_MAX / 2, &ignored,
			NULL)) ||
	    (s = rd_bool(p, o, P, "fast_init", &b)) ||
	    (s = rd_bool(p, o, P, "pipeline_read", &b)) ||
	    (s = rd_bool(p, o, P, "pipeline_write", &b)) ||
	    (s = rd_num(p, o, P, "ratio", 0, false, 1, false, &ratio)))
		return s;
	json_t *np = json_object_get(o, "nvme_path");
	if (np && !json_is_null(np)) {
		char g[100];
		if (!json_is_string(np))
			return cp_err(p,
				      "\"%s.nvme_path\" must be a string, "
				      "got %s",
				      P, ej_json_describe(np, g, sizeof g));
		if (strlen(json_string_value(np)) >= sizeof off->nvme_path)
			return cp_err(p,
				      "\"%s.nvme_path\" is longer than %zu "
				      "bytes",
				      P, sizeof off->nvme_path - 1);
		set_str(off->nvme_path, sizeof off->nvme_path,
			json_string_value(np));
	}
	off->device = (ej_offload_device)dev;
	off->active = off->device != EJ_OFFLOAD_NONE;
	if (off->device == EJ_OFFLOAD_NVME && !off->nvme_path[0])
		return cp_err(p,
			      "\"%s.device\" is \"nvme\" but \"%s.nvme_path\" "
			      "is not set",
			      P, P);
	return EPJ_OK;
}

static epj_status parse_zero(cp *p, json_t *root, ej_config *c)
{
	epj_status s;
	json_t *o;
	if ((s = get_section(p, root, "zero_optimization", SEC_ZERO, &o)))
		return s;
	if (!o)
		return EPJ_OK;
	const char *P = "zero_optimization";
	bool ignored = false;
	if ((s = rd_i32(p, o, P, "stage", 0, 3, &c->zero.stage)) ||
	    (s = parse_offload(p, o, "offload_optimizer", SEC_OFFLOAD_OPT,
			       &c->zero.offload_optimizer)) ||
	    (s = parse_offload(p, o, "offload_param", SEC_OFFLOAD_PARAM,
			       &c->zero.offload_param)) ||
	    (s = rd_int(p, o, P, "reduce_bucket_size", 1, INT64_MAX / 2,
			&c->zero.reduce_bucket_size, NULL)) ||
	    (s = rd_int(p, o, P, "allgather_bucket_size", 1, INT64_MAX / 2,
			&c->zero.allgather_bucket_size, NULL)) ||
	    (s = rd_bool(p, o, P, "overlap_comm", &c->zero.overlap_comm)) ||
	    (s = rd_bool(p, o, P, "contiguous_gradients",
			 &c->zero.contiguous_gradients)) ||
	    (s = rd_bool(p, o, P, "allgather_partitions", &ignored)) ||
	    (s = rd_bool(p, o, P, "reduce_scatter", &ignored)) ||
	    (s = rd_bool(p, o, P, "round_robin_gradients", &ignored)))
		return s;
	return EPJ_OK;
}

static epj_status parse_act_ckpt(cp *p, json_t *root, ej_config *c)
{
	epj_status s;
	json_t *o;
	if ((s = get_section(p, root, "activation_checkpointing", SEC_ACT_CKPT,
			     &o)))
		return s;
	if (!o)
		return EPJ_OK;
	const char *P = "activation_checkpointing";
	struct ej_act_ckpt_config *a = &c->activation_checkpointing;
	if ((s = rd_bool(p, o, P, "enabled", &a->enabled)) ||
	    (s = rd_bool(p, o, P, "partition_activations",
			 &a->partition_activations)) ||
	    (s = rd_bool(p, o, P, "cpu_checkpointing",
			 &a->cpu_checkpointing)) ||
	    (s = rd_bool(p, o, P, "contiguous_memory_optimization",
			 &a->contiguous_memory_optimization)) ||
	    (s = rd_bool(p, o, P, "synchronize_checkpoint_boundary",
			 &a->synchronize_checkpoint_boundary)) ||
	    (s = rd_bool(p, o, P, "profile", &a->profile)))
		return s;
	json_t *nc = json_object_get(o, "number_checkpoints");
	if (nc && !json_is_null(nc) &&
	    (s = rd_int(p, o, P, "number_checkpoints", 1, BATCH_MAX,
			&a->number_checkpoints, NULL)))
		return s;
	return EPJ_OK;
}

/* Reads obj[key] as a string of fewer than n bytes into dst. */
static epj_status rd_string(cp *p, json_t *obj, const char *prefix,
			    const char *key, char *dst, size_t n)
{
	json_t *v = json_object_get(obj, key);
	if (!v)
		return EPJ_OK;
	char path[300], g[100];
	key_path(path, sizeof path, prefix, key);
	if (!json_is_string(v))
		return cp_err(p, "\"%s\" must be a string, got %s", path,
			      ej_json_describe(v, g, sizeof g));
	if (json_string_length(v) >= n)
		return cp_err(p, "\"%s\" is too long (%zu bytes, at most %zu)",
			      path, json_string_length(v), n - 1);
	set_str(dst, n, json_string_value(v));
	return EPJ_OK;
}

static epj_status parse_csv_monitor(cp *p, json_t *root, ej_config *c)
{
	epj_status s;
	json_t *o;
	if ((s = get_section(p, root, "csv_monitor", SEC_CSV_MONITOR, &o)))
		return s;
	if (!o)
		return EPJ_OK;
	const char *P = "csv_monitor";
	struct ej_csv_monitor_config *m = &c->csv_monitor;
	if ((s = rd_bool(p, o, P, "enabled", &m->enabled)) ||
	    (s = rd_string(p, o, P, "output_path", m->output_path,
			   sizeof m->output_path)) ||
	    (s = rd_string(p, o, P, "job_name", m->job_name,
			   sizeof m->job_name)))
		return s;
	if (!m->job_name[0])
		return cp_err(p, "\"csv_monitor.job_name\" must not be empty");
	return EPJ_OK;
}

static epj_status parse_ep(cp *p, json_t *root, ej_config *c)
{
	epj_status s;
	json_t *o;
	if ((s = get_section(p, root, "expert_parallel", SEC_EP, &o)))
		return s;
	if (!o)
		return EPJ_OK;
	const char *P = "expert_parallel";
	struct ej_ep_config *e = &c->expert_parallel;
	int comm = 0;
	if ((s = rd_bool(p, o, P, "enabled", &e->enabled)) ||
	    (s = rd_i32(p, o, P, "autoep_size", 1, INT_FIELD_MAX,
			&e->autoep_size)) ||
	    (s = rd_choice(p, o, P, "comm_backend", comm_backends,
			   (int)EJ_ARRAY_LEN(comm_backends), false, &comm)) ||
	    (s = rd_bool(p, o, P, "async_split_plan", &e->async_split_plan)) ||
	    (s = rd_num(p, o, P, "route_scale", 0, true, HUGE_VAL, false,
			&e->route_scale)) ||
	    (s = rd_bool(p, o, P, "fixed_routing", &e->fixed_routing)))
		return s;
	set_str(e->comm_backend, sizeof e->comm_backend, comm_backends[comm]);
	json_t *v;
	char g[100];
	if ((v = json_object_get(o, "preset_model")) && !json_is_null(v)) {
		int pm = 0;
		if ((s = rd_choice(p, o, P, "preset_model", preset_models,
				   (int)EJ_ARRAY_LEN(preset_models), false,
				   &pm)))
			return s;
		set_str(e->preset_model, sizeof e->preset_model,
			preset_models[pm]);
	}
	/* top_k: an integer >= 1 or "auto" (the model's num_experts_per_tok) */
	if ((v = json_object_get(o, "top_k"))) {
		if (json_is_string(v) &&
		    strcmp(json_string_value(v), "auto") == 0)
			e->top_k = 0;
		else if (!json_is_integer(v) && !json_is_real(v))
			return cp_err(p,
				      "\"expert_parallel.top_k\" must be a "
				      "positive integer or \"auto\", got %s",
				      ej_json_describe(v, g, sizeof g));
		else if ((s = rd_i32(p, o, P, "top_k", 1, INT_FIELD_MAX,
				     &e->top_k)))
			return s;
	}
	/* route_norm: bool, or null = the model's norm_topk_prob */
	if ((v = json_object_get(o, "route_norm"))) {
		if (json_is_null(v))
			e->route_norm = -1;
		else if (json_is_boolean(v))
			e->route_norm = json_is_true(v);
		else
			return cp_err(p,
				      "\"expert_parallel.route_norm\" must "
				      "be a boolean or null, got %s",
				      ej_json_describe(v, g, sizeof g));
	}
	/* load_balance_coeff: number >= 0, or null = balancing off */
	if ((v = json_object_get(o, "load_balance_coeff"))) {
		if (json_is_null(v)) {
			e->has_load_balance = false;
			e->load_balance_coeff = 0;
		} else if ((s = rd_num(p, o, P, "load_balance_coeff", 0, false,
				       HUGE_VAL, false,
				       &e->load_balance_coeff))) {
			return s;
		} else {
			e->has_load_balance = true;
		}
	}
	return EPJ_OK;
}

static epj_status parse_compile(cp *p, json_t *root, ej_config *c)
{
	epj_status s;
	json_t *o;
	if ((s = get_section(p, root, "compile", SEC_COMPILE, &o)))
		return s;
	if (!o)
		return EPJ_OK;
	const char *P = "compile";
	struct ej_compile_config *k = &c->compile;
	if ((s = rd_bool(p, o, P, "autoep_non_moe", &k->autoep_non_moe)) ||
	    (s = rd_json_bool(p, o, P, "fullgraph", &k->fullgraph,
			      &k->fullgraph_given)) ||
	    (s = rd_json_bool(p, o, P, "dynamic", &k->dynamic,
			      &k->dynamic_given)) ||
	    (s = rd_bool(p, o, P, "deepcompile", &k->deepcompile)) ||
	    (s = rd_bool(p, o, P, "compiled_autograd", &k->compiled_autograd)))
		return s;
	json_t *v;
	char g[100];
	if ((v = json_object_get(o, "backend")) && !json_is_null(v)) {
		int b = 0;
		if ((s = rd_choice(p, o, P, "backend", compile_backends,
				   (int)EJ_ARRAY_LEN(compile_backends), false,
				   &b)))
			return s;
		set_str(k->backend, sizeof k->backend, compile_backends[b]);
	}
	/* A DeepCompile schedule is a list of [step, passes] pairs (or an
	 * object); only its presence matters to us. */
	if ((v = json_object_get(o, "schedule")) && !json_is_null(v)) {
		if (!json_is_array(v) && !json_is_object(v))
			return cp_err(p,
				      "\"compile.schedule\" must be an "
				      "array, an object or null, got %s",
				      ej_json_describe(v, g, sizeof g));
		k->schedule_present = true;
	}
	return EPJ_OK;
}

static epj_status parse_root(cp *p, json_t *root, ej_config *c)
{
	epj_status s;
	json_t *o;
	if ((s = check_keys(p, root, SEC_ROOT)))
		return s;
	if ((s = rd_int(p, root, "", "train_batch_size", 1, BATCH_MAX,
			&c->train_batch_size, &c->train_batch_size_given)) ||
	    (s = rd_int(p, root, "", "train_micro_batch_size_per_gpu", 1,
			BATCH_MAX, &c->micro_batch_per_gpu,
			&c->micro_batch_given)) ||
	    (s = rd_int(p, root, "", "gradient_accumulation_steps", 1,
			BATCH_MAX, &c->gradient_accumulation_steps,
			&c->gas_given)) ||
	    (s = parse_precision(p, root, c)) ||
	    (s = parse_optimizer(p, root, c)) ||
	    (s = parse_scheduler(p, root, c)) ||
	    (s = rd_num(p, root, "", "gradient_clipping", 0, false, HUGE_VAL,
			false, &c->gradient_clipping)) ||
	    (s = parse_zero(p, root, c)) || (s = parse_act_ckpt(p, root, c)) ||
	    (s = parse_ep(p, root, c)) || (s = parse_compile(p, root, c)) ||
	    (s = rd_i32(p, root, "", "sequence_parallel_size", 1, INT_FIELD_MAX,
			&c->sequence_parallel_size)) ||
	    (s = rd_int(p, root, "", "steps_per_print", 1, INT64_MAX,
			&c->steps_per_print, NULL)) ||
	    (s = rd_int(p, root, "", "seed", 0, INT64_MAX, &c->seed, NULL)) ||
	    (s = rd_bool(p, root, "", "wall_clock_breakdown",
			 &c->wall_clock_breakdown)) ||
	    (s = rd_bool(p, root, "", "skip_nonfinite_steps",
			 &c->skip_nonfinite_steps)) ||
	    (s = parse_csv_monitor(p, root, c)))
		return s;
	{
		static const char *const devices[] = { "cpu", "cuda-sim" };
		json_t *dv = json_object_get(root, "device");
		int d = 0;
		if (dv && !json_is_null(dv)) {
			if ((s = rd_choice(p, root, "", "device", devices,
					   (int)EJ_ARRAY_LEN(devices), false,
					   &d)))
				return s;
			set_str(c->device, sizeof c->device, devices[d]);
		}
	}
	if ((s = get_section(p, root, "pipeline", SEC_PIPELINE, &o)))
		return s;
	if (o && (s = rd_i32(p, o, "pipeline", "stages", 1, INT_FIELD_MAX,
			     &c->pipeline_stages)))
		return s;
	if ((s = get_section(p, root, "tensor_parallel", SEC_TP, &o)))
		return s;
	if (o && (s = rd_i32(p, o, "tensor_parallel", "autotp_size", 1,
			     INT_FIELD_MAX, &c->autotp_size)))
		return s;
	if ((s = get_section(p, root, "comm", SEC_COMM, &o)))
		return s;
	if (o && (s = rd_num(p, o, "comm", "timeout_s", 0, true, 86400.0 * 7,
			     false, &c->comm_timeout_s)))
		return s;

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

epj_status ej_config_parse(epj_ctx *ctx, const char *json_text,
			   const char *source_name, ej_config *out)
{
	EJ_ASSERT(out);
	cp p = { ctx, source_name ? source_name : "<string>" };
	ej_config_defaults(out);
	set_str(out->source, sizeof out->source, p.src);
	json_t *root;
	epj_status s = ej_config_json_object(ctx, json_text, p.src, &root);
	if (s != EPJ_OK)
		return s;
	ej_config tmp = *out;
	s = parse_root(&p, root, &tmp);
	if (s == EPJ_OK)
		*out = tmp;
	json_decref(root);
	return s;
}

epj_status ej_config_load(epj_ctx *ctx, const char *path, ej_config *out)
{
	EJ_ASSERT(out && path);
	ej_config_defaults(out);
	set_str(out->source, sizeof out->source, path);
	char *text = ej_config_read_file(ctx, path);
	if (!text)
		return epj_ctx_status(ctx);
	epj_status s = ej_config_parse(ctx, text, path, out);
	free(text);
	return s;
}

/* ==== batch resolution =================================================== */

epj_status ej_config_resolve_batch(epj_ctx *ctx, ej_config *c, int world_size)
{
	EJ_ASSERT(c);
	cp p = { ctx, c->source };
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

epj_status ej_config_validate_autoep_compile(epj_ctx *ctx, const ej_config *c)
{
	EJ_ASSERT(c);
	if (!c->compile.autoep_non_moe)
		return EPJ_OK;
	/* One check per unsupported feature, in the seed's order; the first
	 * failure is reported.  Each message says what to change. */
	if (c->compile.deepcompile)
		return autoep_err(ctx, "cannot be combined with DeepCompile "
				       "(compile.deepcompile=true): set "
				       "compile.deepcompile to false");
	if (strcmp(c->expert_parallel.comm_backend, "comm") != 0)
		return autoep_err(ctx,
				  "supports only the standard AutoEP comm "
				  "backend, got expert_parallel.comm_backend="
				  "\"%s\": set it to \"comm\"",
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
		return autoep_err(ctx, "supports ZeRO stages 0, 1 and 2 only, "
				       "got zero_optimization.stage=3: use "
				       "stage 2 or lower");
	if (c->zero.offload_optimizer.active)
		return autoep_err(
		    ctx,
		    "does not support optimizer offload "
		    "(zero_optimization.offload_optimizer.device=\"%s\"): "
		    "remove offload_optimizer or set its device to \"none\"",
		    offload_name(c->zero.offload_optimizer.device));
	if (c->zero.offload_param.active)
		return autoep_err(
		    ctx,
		    "does not support parameter offload "
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
	if (c->compile.fullgraph != EJ_JSON_FALSE)
		return autoep_err(ctx,
				  "requires compile.fullgraph=false, got %s: "
				  "every AutoEP layer is a graph break, so no "
				  "region is one full graph; set "
				  "compile.fullgraph to false",
				  json_bool_name(c->compile.fullgraph));
	if (c->compile.dynamic != EJ_JSON_FALSE)
		return autoep_err(ctx,
				  "requires compile.dynamic=false, got %s: "
				  "regions are compiled for static shapes "
				  "(null would let the compiler choose); set "
				  "compile.dynamic to false",
				  json_bool_name(c->compile.dynamic));
	return EPJ_OK;
}

/* ==== dump =============================================================== */

static json_t *json_bool_value(ej_json_bool b)
{
	return b == EJ_JSON_NULL ? json_null()
				 : json_boolean(b == EJ_JSON_TRUE);
}

static json_t *offload_json(const ej_offload_config *o)
{
	json_t *j = json_object();
	json_object_set_new(j, "device", json_string(offload_name(o->device)));
	json_object_set_new(j, "pin_memory", json_boolean(o->pin_memory));
	if (o->nvme_path[0])
		json_object_set_new(j, "nvme_path", json_string(o->nvme_path));
	return j;
}

char *ej_config_to_json(const ej_config *c)
{
	EJ_ASSERT(c);
	json_t *r = json_object(), *o, *pp;
	if (!r)
		return NULL;
		/* jansson's setters tolerate NULL values (allocation failures)
		 * by failing; json_dumps then still returns a string or NULL.
		 */
#define SET(obj, k, v) json_object_set_new(obj, k, v)
	if (c->train_batch_size)
		SET(r, "train_batch_size", json_integer(c->train_batch_size));
	if (c->micro_batch_per_gpu)
		SET(r, "train_micro_batch_size_per_gpu",
		    json_integer(c->micro_batch_per_gpu));
	if (c->gradient_accumulation_steps)
		SET(r, "gradient_accumulation_steps",
		    json_integer(c->gradient_accumulation_steps));
	SET(r, "bf16", json_pack("{s:b}", "enabled", c->bf16_enabled));

	o = json_object();
	SET(o, "type", json_string(optim_names[c->optimizer.type]));
	pp = json_object();
	SET(pp, "lr", json_real(c->optimizer.lr));
	if (c->optimizer.type == EJ_OPTIM_SGD) {
		SET(pp, "momentum", json_real(c->optimizer.momentum));
		SET(pp, "nesterov", json_boolean(c->optimizer.nesterov));
	} else {
		SET(pp, "betas",
		    json_pack("[f,f]", c->optimizer.betas[0],
			      c->optimizer.betas[1]));
		SET(pp, "eps", json_real(c->optimizer.eps));
		if (c->optimizer.type == EJ_OPTIM_ADAM)
			SET(pp, "adam_w_mode",
			    json_boolean(c->optimizer.adam_w_mode));
	}
	SET(pp, "weight_decay", json_real(c->optimizer.weight_decay));
	SET(o, "params", pp);
	SET(r, "optimizer", o);

	if (c->scheduler.type != EJ_SCHED_NONE) {
		o = json_object();
		SET(o, "type",
		    json_string(ej_sched_type_name(c->scheduler.type)));
		pp = json_object();
		if (c->scheduler.type == EJ_SCHED_WARMUP_COSINE_LR) {
			SET(pp, "warmup_min_ratio",
			    json_real(c->scheduler.warmup_min_ratio));
			SET(pp, "cos_min_ratio",
			    json_real(c->scheduler.cos_min_ratio));
		} else {
			SET(pp, "warmup_min_lr",
			    json_real(c->scheduler.warmup_min_lr));
			SET(pp, "warmup_max_lr",
			    json_real(c->scheduler.warmup_max_lr));
		}
		if (c->scheduler.type != EJ_SCHED_WARMUP_LR)
			SET(pp, "total_num_steps",
			    json_integer(c->scheduler.total_num_steps));
		SET(pp, "warmup_num_steps",
		    json_integer(c->scheduler.warmup_num_steps));
		SET(pp, "warmup_type",
		    json_string(c->scheduler.warmup_type == EJ_WARMUP_LOG
				    ? "log"
				    : "linear"));
		SET(pp, "last_batch_iteration",
		    json_integer(c->scheduler.last_batch_iteration));
		SET(o, "params", pp);
		SET(r, "scheduler", o);
	}
	SET(r, "gradient_clipping", json_real(c->gradient_clipping));

	o = json_object();
	SET(o, "stage", json_integer(c->zero.stage));
	if (c->zero.offload_optimizer.present)
		SET(o, "offload_optimizer",
		    offload_json(&c->zero.offload_optimizer));
	if (c->zero.offload_param.present)
		SET(o, "offload_param", offload_json(&c->zero.offload_param));
	SET(o, "reduce_bucket_size", json_integer(c->zero.reduce_bucket_size));
	SET(o, "allgather_bucket_size",
	    json_integer(c->zero.allgather_bucket_size));
	SET(o, "overlap_comm", json_boolean(c->zero.overlap_comm));
	SET(o, "contiguous_gradients",
	    json_boolean(c->zero.contiguous_gradients));
	SET(r, "zero_optimization", o);

	const struct ej_act_ckpt_config *a = &c->activation_checkpointing;
	o = json_object();
	SET(o, "enabled", json_boolean(a->enabled));
	SET(o, "partition_activations", json_boolean(a->partition_activations));
	SET(o, "cpu_checkpointing", json_boolean(a->cpu_checkpointing));
	SET(o, "contiguous_memory_optimization",
	    json_boolean(a->contiguous_memory_optimization));
	SET(o, "number_checkpoints",
	    a->number_checkpoints ? json_integer(a->number_checkpoints)
				  : json_null());
	SET(o, "synchronize_checkpoint_boundary",
	    json_boolean(a->synchronize_checkpoint_boundary));
	SET(o, "profile", json_boolean(a->profile));
	SET(r, "activation_checkpointing", o);

	const struct ej_ep_config *e = &c->expert_parallel;
	o = json_object();
	SET(o, "enabled", json_boolean(e->enabled));
	SET(o, "autoep_size", json_integer(e->autoep_size));
	SET(o, "comm_backend", json_string(e->comm_backend));
	SET(o, "preset_model",
	    e->preset_model[0] ? json_string(e->preset_model) : json_null());
	SET(o, "async_split_plan", json_boolean(e->async_split_plan));
	SET(o, "top_k",
	    e->top_k ? json_integer(e->top_k) : json_string("auto"));
	SET(o, "route_norm",
	    e->route_norm < 0 ? json_null() : json_boolean(e->route_norm));
	SET(o, "route_scale", json_real(e->route_scale));
	SET(o, "fixed_routing", json_boolean(e->fixed_routing));
	SET(o, "load_balance_coeff",
	    e->has_load_balance ? json_real(e->load_balance_coeff)
				: json_null());
	SET(r, "expert_parallel", o);

	const struct ej_compile_config *k = &c->compile;
	o = json_object();
	SET(o, "autoep_non_moe", json_boolean(k->autoep_non_moe));
	SET(o, "backend",
	    k->backend[0] ? json_string(k->backend) : json_null());
	SET(o, "fullgraph", json_bool_value(k->fullgraph));
	SET(o, "dynamic", json_bool_value(k->dynamic));
	SET(o, "deepcompile", json_boolean(k->deepcompile));
	SET(o, "compiled_autograd", json_boolean(k->compiled_autograd));
	/* The schedule's content is not kept; an empty list marks it. */
	SET(o, "schedule", k->schedule_present ? json_array() : json_null());
	SET(r, "compile", o);

	SET(r, "sequence_parallel_size",
	    json_integer(c->sequence_parallel_size));
	SET(r, "pipeline", json_pack("{s:i}", "stages", c->pipeline_stages));
	SET(r, "tensor_parallel",
	    json_pack("{s:i}", "autotp_size", c->autotp_size));
	SET(r, "steps_per_print", json_integer(c->steps_per_print));
	SET(r, "seed", json_integer(c->seed));
	SET(r, "wall_clock_breakdown", json_boolean(c->wall_clock_breakdown));
	if (c->device[0])
		SET(r, "device", json_string(c->device));
	SET(r, "skip_nonfinite_steps", json_boolean(c->skip_nonfinite_steps));
	SET(r, "comm", json_pack("{s:f}", "timeout_s", c->comm_timeout_s));
	SET(r, "csv_monitor",
	    json_pack("{s:b, s:s, s:s}", "enabled", c->csv_monitor.enabled,
		      "output_path", c->csv_monitor.output_path, "job_name",
		      c->csv_monitor.job_name));
#undef SET
	/* 15 significant digits: readable (0.9, not 0.90000000000000002)
	 * and exact for any value that was read from decimal text of up to
	 * 15 digits, which is where config values come from. */
	char *text = json_dumps(r, JSON_INDENT(2) | JSON_PRESERVE_ORDER |
				       JSON_REAL_PRECISION(15));
	json_decref(r);
	return text;
}

/* ==== the keys, for the reference page's drift check ====================== */

bool ej_config_key_at(int i, char *buf, size_t n)
{
	for (int s = 0; s < SEC_COUNT; s++) {
		if (i < sections[s].n) {
			key_path(buf, n, sections[s].path, sections[s].keys[i]);
			return true;
		}
		i -= sections[s].n;
	}
	return false;
}
