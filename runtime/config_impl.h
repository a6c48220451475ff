/* config_impl.h -- the two configuration files of a training run: the
 * DeepSpeed-style training config (ds.json, config.c) and the Hugging Face
 * model config (config.json, model_config.c).
 *
 * Both parsers are strict where a silent mistake would change a run: the
 * training config rejects unknown keys (naming the full dotted path and the
 * nearest known key), wrong types and out-of-range values; the model config
 * tolerates keys it does not use (HF files carry many) but rejects used keys
 * whose values this library does not implement.  Every error is
 * EPJ_ERR_CONFIG (EPJ_ERR_IO for an unreadable file) with a message that
 * starts "config error in <source>: " and names the key.
 *
 * Invariants
 *  - Both structs are plain values: nothing is heap-allocated, so they may be
 *    copied with `=` and need no free function.
 *  - A parse never leaves *out half parsed: on failure it holds the
 *    defaults (ej_config) or all zeros (ej_model_config).
 */
#ifndef EPJIT_CONFIG_IMPL_H
#define EPJIT_CONFIG_IMPL_H

#include "core_impl.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

/* ==== DeepSpeed-style training config (config.c) ========================= */

#define EJ_CONFIG_STR_MAX 32 /* longest string value kept (with the NUL) */

typedef enum ej_optim_type {
	EJ_OPTIM_SGD = 0,
	EJ_OPTIM_ADAM,
	EJ_OPTIM_ADAMW,
} ej_optim_type;

typedef enum ej_sched_type {
	EJ_SCHED_NONE = 0, /* no "scheduler" section: constant lr */
	EJ_SCHED_WARMUP_LR,
	EJ_SCHED_WARMUP_DECAY_LR,
	EJ_SCHED_WARMUP_COSINE_LR,
} ej_sched_type;

typedef enum ej_warmup_type {
	EJ_WARMUP_LOG = 0, /* DeepSpeed's default */
	EJ_WARMUP_LINEAR,
} ej_warmup_type;

typedef enum ej_offload_device {
	EJ_OFFLOAD_NONE = 0, /* absent, null, {} or {"device": "none"} */
	EJ_OFFLOAD_CPU,
	EJ_OFFLOAD_NVME,
} ej_offload_device;

/* zero_optimization.offload_optimizer / offload_param. */
typedef struct ej_offload_config {
	bool present;		  /* the key was given with an object value */
	ej_offload_device device; /* default none */
	bool active;		  /* device present and not "none" */
	bool pin_memory;	  /* default false */
	char nvme_path[256];	  /* "" unless given */
} ej_offload_config;

/* A JSON value that may be false, true or null, remembered exactly (torch
 * treats dynamic=None differently from dynamic=False). */
typedef enum ej_json_bool {
	EJ_JSON_FALSE = 0,
	EJ_JSON_TRUE,
	EJ_JSON_NULL,
} ej_json_bool;

typedef struct ej_config {
	char source[256]; /* source name of the parse, for later messages */

	/* Batch (DeepSpeed: train_batch_size = micro * gas * world_size).
	 * The *_given flags say what the file set; ej_config_resolve_batch()
	 * fills the rest for a world size.  Defaults when nothing is given:
	 * micro 1, gas 1 (train = world_size). */
	int64_t train_batch_size; /* 0 until given or resolved */
	int64_t micro_batch_per_gpu;
	int64_t gradient_accumulation_steps;
	bool train_batch_size_given, micro_batch_given, gas_given;
	int batch_world_size; /* world size of the last resolve, 0 if none */

	/* Precision.  bf16.enabled default false; fp16 only as disabled. */
	bool bf16_enabled;

	/* optimizer.{type, params}.  Default (section absent): AdamW, lr 1e-3.
	 * Parameters that the type does not take are rejected (DeepSpeed
	 * passes params to the optimizer constructor). */
	struct ej_optimizer_config {
		bool given; /* the "optimizer" section was present */
		ej_optim_type type;
		double lr;	     /* default 1e-3, >= 0 */
		double momentum;     /* SGD only; default 0, [0, 1) */
		bool nesterov;	     /* SGD only; needs momentum > 0 */
		double betas[2];     /* Adam/AdamW; default 0.9, 0.999 */
		double eps;	     /* Adam/AdamW; default 1e-8, > 0 */
		double weight_decay; /* default 0 (DeepSpeed's), >= 0 */
		/* Decoupled (AdamW-style) weight decay: always for AdamW; for
		 * Adam params.adam_w_mode, default true as in DeepSpeed. */
		bool adam_w_mode;
	} optimizer;

	/* scheduler.{type, params}, DeepSpeed's names and defaults. */
	struct ej_scheduler_config {
		ej_sched_type type;	    /* default none */
		double warmup_min_lr;	    /* WarmupLR/DecayLR; default 0 */
		double warmup_max_lr;	    /* WarmupLR/DecayLR; default 1e-3 */
		int64_t warmup_num_steps;   /* default 1000 */
		ej_warmup_type warmup_type; /* default log */
		int64_t total_num_steps;    /* DecayLR/CosineLR: required */
		double cos_min_ratio;	    /* CosineLR; default 1e-4 */
		double warmup_min_ratio;    /* CosineLR; default 0 */
		int64_t last_batch_iteration; /* default -1 */
	} scheduler;

	double gradient_clipping; /* >= 0; 0 = off (default) */
	/* epjit extension: a step whose mean loss or gradient norm is not
	 * finite is skipped (no update, counted) instead of failing the
	 * train step; default false */
	bool skip_nonfinite_steps;

	struct ej_zero_config {
		int stage; /* 0..3, default 0 */
		ej_offload_config offload_optimizer;
		ej_offload_config offload_param;
		int64_t reduce_bucket_size;    /* elements, default 5e8 */
		int64_t allgather_bucket_size; /* elements, default 5e8 */
		bool overlap_comm;	       /* default false */
		bool contiguous_gradients;     /* default true */
	} zero;

	struct ej_act_ckpt_config {
		bool enabled; /* epjit extension; default false */
		bool partition_activations;
		bool cpu_checkpointing;
		bool contiguous_memory_optimization;
		int64_t number_checkpoints; /* 0 = null/absent */
		bool synchronize_checkpoint_boundary;
		bool profile;
	} activation_checkpointing;

	struct ej_ep_config {
		bool enabled;			      /* default false */
		int autoep_size;		      /* >= 1, default 1 */
		char comm_backend[EJ_CONFIG_STR_MAX]; /* "comm" (default),
							 "deepep" */
		char preset_model[EJ_CONFIG_STR_MAX]; /* "" = auto */
		bool async_split_plan;		      /* default false */
		int top_k;	/* 0 = "auto" (model's num_experts_per_tok)
				 */
		int route_norm; /* -1 = auto (model's norm_topk_prob), 0, 1 */
		double route_scale; /* default 1.0 */
		/* DeepSpeed's routing overrides, checked against the model by
		 * ej_config_check_model: "auto" (default) or a value */
		char score_func[EJ_CONFIG_STR_MAX];  /* auto softmax sigmoid */
		char score_apply[EJ_CONFIG_STR_MAX]; /* auto pre post */
		int num_expert_groups;		     /* 0 = null (default) */
		int num_limited_groups;		     /* 0 = null (default) */
		bool has_routed_scaling_factor;	     /* false: "auto" */
		double routed_scaling_factor;
		bool fixed_routing; /* epjit extension for benchmarks */
		/* Aux-loss-free balancing of DeepSeek-V3's score bias:
		 * the rate, default 0 (off); null: has_load_balance false */
		bool has_load_balance;
		double load_balance_coeff;
	} expert_parallel;

	struct ej_compile_config {
		bool autoep_non_moe; /* default false */
		/* "" = the device's own default; else "interpreter", "c",
		 * "nvrtc" or "cuda-sim" (whether this build has it is checked
		 * by the engine). */
		char backend[EJ_CONFIG_STR_MAX];
		ej_json_bool fullgraph; /* default false */
		bool fullgraph_given;
		ej_json_bool dynamic; /* default false; null kept as null */
		bool dynamic_given;
		bool deepcompile;	/* default false */
		bool compiled_autograd; /* default false */
		bool schedule_present;	/* compile.schedule given, non-null */
	} compile;

	/* moe (epjit extension): Megatron Core's router losses, each a
	 * coefficient >= 0, 0 (or null): off (runtime/router_loss.c) */
	struct ej_moe_config {
		double aux_loss_coeff;	      /* aux_loss */
		double seq_aux_loss_coeff;    /* seq_aux_loss */
		double global_aux_loss_coeff; /* global_aux_loss */
		double z_loss_coeff;	      /* router z-loss */
	} moe;

	int sequence_parallel_size; /* >= 1, default 1 */
	int pipeline_stages;	    /* pipeline.stages >= 1, default 1 */
	int autotp_size;	    /* tensor_parallel.autotp_size >= 1 */
	int64_t steps_per_print;    /* >= 1, default 10 */
	int64_t seed;		    /* default 42 */
	bool wall_clock_breakdown;  /* default false */
	/* "device": "" (default: $EPJIT_DEVICE, else cpu), "cpu" or
	 * "cuda-sim"; with compile.backend unset, cuda-sim runs compiled
	 * regions on the cuda-sim backend. */
	char device[EJ_CONFIG_STR_MAX];
	double comm_timeout_s; /* comm.timeout_s > 0: bound of every blocking
				  collective (seconds), default 300 */
	/* comm.backend: "auto" (default), "host" or "nccl": the comm for
	 * collectives on device buffers (ej_comm_device_select) */
	char comm_backend[EJ_CONFIG_STR_MAX];

	/* csv_monitor (DeepSpeed's monitor section): one CSV file per
	 * training metric under log dir = output_path/job_name (job_name
	 * alone when output_path is "", as DeepSpeed does). */
	struct ej_csv_monitor_config {
		bool enabled;		/* default false */
		char output_path[1024]; /* default "" */
		char job_name[256];	/* default "DeepSpeedJobName" */
	} csv_monitor;
	/* tensorboard (DeepSpeed's monitor section): event files under
	 * output_path/job_name, the same folder rule as csv_monitor. */
	struct ej_csv_monitor_config tensorboard;
	/* checkpoint.writer.decoupled (DeepSpeed's decoupled checkpoint
	 * engine): epjit-train's periodic saves run in the background */
	bool checkpoint_decoupled;
	/* data (epjit extension): epjit-train's --data and --split when its
	 * command line has none, and the data seed (doc/trainer.md). */
	struct ej_data_config {
		bool given;	 /* the section is in the file */
		char path[4096]; /* "" = not given */
		char split[64];	 /* "" = not given */
		int64_t seed;
		bool seed_given;
		/* packed documents and the loss (runtime/batch.c): Megatron's
		 * reset_attention_mask, reset_position_ids, eod_mask_loss at
		 * the end-of-document token eod_token (-1: none), and
		 * calculate_per_token_loss */
		bool reset_attention_mask, reset_position_ids, eod_mask_loss;
		int64_t eod_token;
		bool per_token_loss;
	} data;

	/* The keys of the file that epjit accepts and does not act on
	 * (DeepSpeed's observe-only keys, and not-implemented features left
	 * off), as "a.b, c" in the key table's order; "" when none.  The parse
	 * logs them in one warning. */
	char no_effect[1024];
	/* The keys of the file whose value was "auto" (the placeholder, not
	 * comm.backend's own "auto"), as dotted paths in the order read, each
	 * ended by '\n'; "" when none.  The values they took are the fields'
	 * (epj_engine_auto_value prints them). */
	char auto_keys[1024];
} ej_config;

/* The public config object (epjit.h: epj_config): the parsed and checked
 * values, and the file's own JSON object (what epj_config_given asks).
 * The engine copies cfg (epj_engine_new); the object stays the caller's. */
struct epj_config {
	ej_config cfg;
	json_t *file; /* a reference; never NULL once parsed */
};

/* Fills every field with its documented default. */
void ej_config_defaults(ej_config *cfg);

/* Parses DeepSpeed-style JSON text.  source_name (e.g. the file name; NULL
 * means "<string>") prefixes every message: "config error in ds.json: ...".
 * *out is always written (defaults on failure).  Checks that do not need the
 * world size are done here (train_batch_size divisible by micro * gas). */
epj_status ej_config_parse(epj_ctx *ctx, const char *json_text,
			   const char *source_name, ej_config *out);
/* Reads and parses a file; an unreadable file is EPJ_ERR_IO naming path. */
epj_status ej_config_load(epj_ctx *ctx, const char *path, ej_config *out);
/* As ej_config_parse / _load, where a value "auto" takes the value at the
 * same dotted path of auto_json, a JSON object of the caller's own values
 * (epjit-train passes its built-in run's); NULL, or a path it does not
 * have, leaves the library's rule (doc/config.md, the "auto" column).  A
 * key without an "auto" rule refuses "auto" by name.
 * Every error of the file is reported: one as "config error in SRC: MSG",
 * several as "config error in SRC: N errors:" and one indented line each
 * (what does not fit the context's message is logged). */
epj_status ej_config_parse_auto(epj_ctx *ctx, const char *json_text,
				const char *source_name, const char *auto_json,
				ej_config *out);
epj_status ej_config_load_auto(epj_ctx *ctx, const char *path,
			       const char *auto_json, ej_config *out);

/* Resolves train_batch_size / micro / gas for world_size ranks (any two
 * determine the third; only train_batch_size or only micro: gas 1; only gas:
 * micro 1; nothing: micro = gas = 1).  Inconsistent values are an error naming
 * all three and the world size.  Idempotent for the same world size. */
epj_status ej_config_resolve_batch(epj_ctx *ctx, ej_config *cfg,
				   int world_size);

/* The support boundary of compile.autoep_non_moe (doc/design.md section 5),
 * checked by epj_engine_compile (never by initialize: these options concern
 * compilation only).  Each returns EPJ_OK when the option is off; otherwise
 * it rejects each unsupported setting with EPJ_ERR_CONFIG and a message
 * beginning "compile.autoep_non_moe=true", then DeepSpeed's own wording
 * (what its tests match), then what to change.
 *  - _engine: what DeepSpeed's engine.compile() refuses before it looks at
 *    the model: DeepCompile, comm_backend, AutoTP, sequence and pipeline
 *    parallelism, ZeRO-3, offload, schedule, compiled autograd;
 *  - _kwargs: fullgraph and dynamic other than false, which DeepSpeed
 *    checks after "requires at least one AutoEPMoELayer";
 *  - _compile: both, in that order.
 * Not checked here: whether this build has the backend, whether the model
 * has AutoEP layers. */
epj_status ej_config_validate_autoep_engine(epj_ctx *ctx, const ej_config *cfg);
epj_status ej_config_validate_autoep_kwargs(epj_ctx *ctx, const ej_config *cfg);
epj_status ej_config_validate_autoep_compile(epj_ctx *ctx,
					     const ej_config *cfg);

/* Full-model mode (compile.autoep_non_moe false): refuses, by name, what
 * that compile cannot honour -- compile.deepcompile, compile.schedule,
 * compile.compiled_autograd and compile.fullgraph=true -- with
 * EPJ_ERR_UNSUPPORTED and a message beginning "compile: ".  EPJ_OK when
 * the option is on. */
epj_status ej_config_validate_model_compile(epj_ctx *ctx, const ej_config *cfg);

/* The effective config as JSON text (2-space indent) that ej_config_parse
 * accepts and that parses back to the same values (reals are printed with 15
 * significant digits: exact for values read from decimal text); malloc'ed
 * (free()), NULL on allocation failure.  For logging a run's config. */
char *ej_config_to_json(const ej_config *cfg);

/* Names for logging ("SGD", "WarmupLR", ...). */
const char *ej_optim_type_name(ej_optim_type t);
const char *ej_sched_type_name(ej_sched_type t);

/* ==== Hugging Face model config (model_config.c) ========================= */

#define EJ_MODEL_MAX_LAYERS 1024

/* The model families the builder knows (model_type). */
typedef enum ej_model_family {
	EJ_FAMILY_QWEN3_MOE = 0, /* "qwen3_moe" (also when absent) */
	EJ_FAMILY_MIXTRAL,	 /* "mixtral" */
	EJ_FAMILY_QWEN2_MOE,	 /* "qwen2_moe" */
	EJ_FAMILY_DEEPSEEK_V2,	 /* "deepseek_v2" */
	EJ_FAMILY_DEEPSEEK_V3,	 /* "deepseek_v3" */
	EJ_FAMILY_QWEN3_5_MOE,	 /* "qwen3_5_moe_text" */
} ej_model_family;

/* rope_parameters.rope_type (or the older rope_scaling.type). */
typedef enum ej_rope_type {
	EJ_ROPE_DEFAULT = 0,
	EJ_ROPE_LINEAR, /* positions divided by factor */
	EJ_ROPE_YARN,	/* NTK-by-parts interpolation, attention factor */
} ej_rope_type;

/* How a router turns logits into scores and picks experts. */
typedef enum ej_route_scoring {
	EJ_SCORE_SOFTMAX = 0,
	EJ_SCORE_SIGMOID, /* DeepSeek-V3 */
} ej_route_scoring;
typedef enum ej_route_groups {
	EJ_GROUPS_NONE = 0, /* plain top-k ("greedy") */
	EJ_GROUPS_MAX,	    /* V2 group_limited_greedy: a group's score is
			     * its best expert's */
	EJ_GROUPS_TOP2,	    /* V3 noaux_tc: the sum of its best two, bias
			     * included */
} ej_route_groups;

typedef struct ej_model_config {
	ej_model_family family; /* from model_type */
	bool qk_norm;		/* per-head RMSNorm of q, k (Qwen3) */
	int64_t sliding_window; /* Mixtral; 0: none */
	bool qkv_bias;		/* q/k/v projections with bias (Qwen2) */
	/* Qwen2-MoE: the shared expert's width in every MoE layer (0: none) */
	int64_t shared_expert_intermediate_size;
	int64_t vocab_size;	       /* required */
	int64_t hidden_size;	       /* required */
	int num_hidden_layers;	       /* required, <= EJ_MODEL_MAX_LAYERS */
	int num_attention_heads;       /* required */
	int num_key_value_heads;       /* default num_attention_heads */
	int head_dim;		       /* default hidden / heads; even */
	int64_t intermediate_size;     /* required (dense MLP layers) */
	int64_t moe_intermediate_size; /* required when num_experts > 0 */
	int num_experts;	       /* default 0 (no MoE layer) */
	int num_experts_per_tok;       /* required when num_experts > 0 */
	bool norm_topk_prob;	       /* default false (HF) */
	int decoder_sparse_step;       /* default 1 */
	int n_mlp_only_layers;	       /* entries of mlp_only_layers */
	int mlp_only_layers[EJ_MODEL_MAX_LAYERS]; /* distinct, in range */
	double rms_norm_eps;			  /* default 1e-6 */
	double rope_theta;			  /* default 10000 */
	int64_t max_position_embeddings;	  /* default 32768 */
	bool tie_word_embeddings;		  /* default false */
	double initializer_range;		  /* default 0.02 */
	char torch_dtype[16]; /* informational; "" if absent */
	/* RoPE scaling (rope_parameters), every family. */
	ej_rope_type rope_type;
	double rope_factor;	   /* linear, yarn */
	int64_t rope_original_max; /* yarn; 0: max_position_embeddings */
	double rope_beta_fast, rope_beta_slow;	 /* yarn; 32, 1 */
	double rope_mscale, rope_mscale_all_dim; /* yarn; 0: absent */
	double rope_attention_factor;		 /* yarn; 0: derived */
	bool rope_truncate;			 /* yarn; default true */
	/* DeepSeek-V2/V3: multi-head latent attention (mla) */
	bool mla;
	int64_t q_lora_rank; /* 0: a plain q_proj */
	int64_t kv_lora_rank;
	int qk_nope_head_dim, qk_rope_head_dim, v_head_dim; /* head_dim is
							     * the rope part */
	bool rope_interleave;	   /* rope over interleaved pairs (V2 always) */
	int first_k_dense_replace; /* layers below it are dense MLPs */
	int n_shared_experts;	   /* shared_experts of n x moe width */
	double routed_scaling_factor; /* routing weights times this (1) */
	ej_route_scoring scoring;
	ej_route_groups groups;
	int n_group, topk_group; /* groups; 0 with EJ_GROUPS_NONE */
	bool score_bias;	 /* gate.e_score_correction_bias (V3) */
	/* Qwen3.5-MoE: zero-centred norms (weight w: x^ (1 + w), in f32),
	 * gated attention output, rope on the first rotary_dim dimensions of
	 * a head (0: all), Gated DeltaNet in the layers marked linear */
	bool norm_offset;
	bool attn_output_gate;
	double partial_rotary_factor; /* default 1 (Qwen3.5: 0.25) */
	int rotary_dim;
	int linear_conv_kernel_dim;
	int linear_key_head_dim, linear_value_head_dim;
	int linear_num_key_heads, linear_num_value_heads;
	bool linear_layer[EJ_MODEL_MAX_LAYERS];
	/* transformers' auxiliary load-balancing loss: on when
	 * output_router_logits, times router_aux_loss_coef (default 0.001;
	 * any finite number, as transformers takes it); DeepSeek-V2/V3 have
	 * none (runtime/router_loss.c) */
	bool output_router_logits;
	double router_aux_loss_coef;
} ej_model_config;

/* The AutoEP routing keys of cfg (expert_parallel: preset_model, top_k,
 * route_norm, score_func, score_apply, route_scale, routed_scaling_factor,
 * num_expert_groups, num_limited_groups) against what model m says and
 * epjit implements for its family: the first that would route otherwise is
 * EPJ_ERR_CONFIG naming the key, its value and the model's (model_type);
 * a route_scale that DeepSpeed overrides is a warning.  Called by
 * epj_engine_initialize. */
epj_status ej_config_check_model(epj_ctx *ctx, const ej_config *cfg,
				 const ej_model_config *m);

/* Parses an HF config.json (Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V2/V3).
 * Unused keys are listed once at debug level; used keys with values this
 * library does not implement (sliding window, attention bias, rope types
 * other than default, linear and yarn, activation other
 * than silu, another model_type, dropout, router jitter) are errors
 * naming the key.  *out is always written (zeros on
 * failure). */
epj_status ej_model_config_parse(epj_ctx *ctx, const char *json_text,
				 const char *source_name, ej_model_config *out);
epj_status ej_model_config_load(epj_ctx *ctx, const char *path,
				ej_model_config *out);
/* ej_model_config_load after n "KEY=VALUE" edits of the file's top-level
 * object (epj_model_opts.config_overrides: VALUE a JSON scalar, else a
 * string; KEY one of the file's keys or of the keys the model reads, else
 * an error naming it and the nearest such key).  n 0: the file as is. */
epj_status ej_model_config_load_overrides(epj_ctx *ctx, const char *path,
					  const char *const *overrides, int n,
					  ej_model_config *out);

/* The built-in tiny model of `epjit-train` with no arguments: vocab 64,
 * hidden 32, 2 layers, 4 heads (2 KV) of dim 8, intermediate 64, 4 experts
 * of dim 32, top-2 with renormalisation, rope 1e4, eps 1e-6, 256 positions,
 * untied embeddings. */
void ej_model_config_tiny(ej_model_config *out);
/* The config as HF config.json text (Qwen3MoeForCausalLM, the keys
 * ej_model_config_parse reads back to the same struct), torch_dtype the
 * given one (NULL: the config's, else "float32").  malloc'ed; NULL when
 * out of memory. */
char *ej_model_config_json(const ej_model_config *m, const char *torch_dtype);

/* HF rule: layer is MoE iff it is not in mlp_only_layers, num_experts > 0
 * and (layer + 1) % decoder_sparse_step == 0.  layer must be in
 * [0, num_hidden_layers) (asserted). */
bool ej_model_layer_is_moe(const ej_model_config *cfg, int layer);

/* ==== helpers shared by the two parsers ================================== */

/* Edit distance between two strings, ignoring ASCII case: Levenshtein
 * (insert, delete, substitute) plus adjacent transposition, each 1. */
int ej_edit_distance(const char *a, const char *b);
/* Nearest of n candidates to key when close enough to be a likely typo,
 * else NULL. */
const char *ej_nearest_key(const char *key, const char *const *cands, int n);
/* "object", "array", "string", "integer", "real", "boolean", "null". */
const char *ej_json_type_name(const json_t *v);
/* Reads a whole text file into a NUL-terminated malloc'ed buffer (free());
 * on failure sets EPJ_ERR_IO "config error in <path>: cannot read: ..." and
 * returns NULL.  A file containing a NUL byte is EPJ_ERR_CONFIG. */
char *ej_config_read_file(epj_ctx *ctx, const char *path);
/* Sets EPJ_ERR_CONFIG "config error in <src>: <message>" (the message cut
 * at 895 bytes) and returns it. */
epj_status ej_config_error(epj_ctx *ctx, const char *src, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* json_text parsed as a JSON object (duplicate keys rejected) into *root,
 * a new reference.  On failure *root is NULL and the status is
 * EPJ_ERR_INVALID (json_text NULL) or EPJ_ERR_CONFIG (invalid JSON, with
 * line and column; another top-level type), the message naming src. */
epj_status ej_config_json_object(epj_ctx *ctx, const char *json_text,
				 const char *src, json_t **root);
/* v as an integer: a JSON integer, or a real that is exactly integral and
 * below 9e15 in magnitude (5e8 for 500000000).  False otherwise. */
bool ej_json_as_int(const json_t *v, int64_t *out);
/* v described for a type error: string "x" (first 60 bytes), real 2.5,
 * integer 3, or the type name; written into buf, returned. */
const char *ej_json_describe(const json_t *v, char *buf, size_t n);

/* The i-th key the parser knows, as its dotted path ("compile.backend",
 * "seed"), into buf; false past the last one.  The reference page
 * (doc/config.md) must document every one (check_config_doc). */
bool ej_config_key_at(int i, char *buf, size_t n);

/* The generated part of the reference page doc/config.md: every key of the
 * key table in config.c (its value type and range, default, what refuses
 * it and its effect) as Markdown, between the lines EJ_CONFIG_DOC_BEGIN and
 * EJ_CONFIG_DOC_END (both included, each followed by a newline).
 * malloc'ed (free()); NULL on allocation failure.  `make config-doc`
 * writes it into the page; check_config_doc fails when the page differs. */
char *ej_config_reference(void);
#define EJ_CONFIG_DOC_BEGIN                                                    \
	"<!-- generated from the key table of runtime/config.c by "            \
	"`make config-doc`: edit the table, not this part -->"
#define EJ_CONFIG_DOC_END "<!-- end of the generated part -->"

#endif /* EPJIT_CONFIG_IMPL_H */
