/* runtime_impl.h -- private structures of runtime/: module tree, model,
 * AutoEP layer, comm, activation checkpointing.
 *
 * Module forward contract: forward(ctx, m, in, n_in, out, n_out) takes
 * borrowed input tensors and returns new references in out[].  Modules call
 * their children through ej_module_call(), never through child->forward
 * directly: that one place applies activation checkpointing and, while the
 * compiler traces, turns a call of a compiler_disabled module (the AutoEP
 * layer) into a graph break (hook installed by jit/ through the context).
 */
#ifndef EPJIT_RUNTIME_IMPL_H
#define EPJIT_RUNTIME_IMPL_H

#include "config_impl.h"
#include "core_impl.h"

typedef epj_status (*ej_forward_fn)(epj_ctx *ctx, epj_module *m,
				    epj_tensor *const *in, int n_in,
				    epj_tensor **out, int n_out);

struct epj_module {
	char *name;	  /* full dotted HF-style name; "" for the root */
	char *local;	  /* last component ("" for the root) */
	const char *kind; /* "Qwen3MoeForCausalLM", "Qwen3MoeDecoderLayer",
			     "AutoEPMoELayer", "ModuleList", "Linear", ... */
	epj_module *parent;
	epj_module **children;
	int n_children, cap_children;
	/* parameters: local names ("weight") and leaf tensors (owned refs) */
	char **param_names;
	epj_tensor **params;
	int n_params, cap_params;

	ej_forward_fn forward; /* NULL for pure containers */
	bool compiler_disabled;
	bool checkpoint; /* activation checkpointing around every call */

	void *impl; /* kind-specific state (owned) */
	void (*impl_free)(void *impl);

	/* Installed by the region compiler: the original forward while a
	 * compiled wrapper is in place, and the wrapper's state. */
	ej_forward_fn orig_forward;
	void *compiled;
	void (*compiled_free)(void *compiled);
};

/* ---- module tree (module.c) -------------------------------------------------
 */

/* New module named parent.name + "." + local (or local when parent is the
 * root, "" for the root itself); appended to parent's children. */
epj_module *ej_module_new(epj_module *parent, const char *local,
			  const char *kind, ej_forward_fn forward);
/* Frees m and its subtree (params, impl). */
void ej_module_free(epj_module *m);
/* Adds a parameter (takes ownership of the reference t; sets
 * requires_grad).  Returns t (borrowed). */
epj_tensor *ej_module_add_param(epj_module *m, const char *local,
				epj_tensor *t);
/* Borrowed parameter by local name, NULL if absent. */
epj_tensor *ej_module_param(const epj_module *m, const char *local);
/* Child by local name, NULL if absent. */
epj_module *ej_module_child(const epj_module *m, const char *local);

/* Calls a module (see the contract above). */
epj_status ej_module_call(epj_ctx *ctx, epj_module *m, epj_tensor *const *in,
			  int n_in, epj_tensor **out, int n_out);

/* Visits every module depth-first in model order (pre-order). */
typedef int (*ej_module_visit_fn)(epj_module *m, void *user);
int ej_module_walk(epj_module *root, ej_module_visit_fn fn, void *user);

/* Every parameter of the subtree with its full name ("model.norm.weight"),
 * in model order.  names[i] are malloc'ed; free with ej_param_list_free. */
typedef struct ej_param_list {
	int n;
	char **names;
	epj_tensor **params; /* borrowed */
	epj_module **owners;
} ej_param_list;
epj_status ej_module_params(epj_ctx *ctx, epj_module *root, ej_param_list *out);
void ej_param_list_free(ej_param_list *l);

/* Graph-break hook: while ctx traces (ctx->recorder != NULL) and a
 * compiler_disabled module is called, ej_module_call hands the call to this
 * hook (installed by the region compiler) instead of running it. */
typedef struct ej_break_hook {
	void *self;
	epj_status (*on_call)(void *self, epj_ctx *ctx, epj_module *m,
			      epj_tensor *const *in, int n_in, epj_tensor **out,
			      int n_out);
} ej_break_hook;
void ej_set_break_hook(epj_ctx *ctx, const ej_break_hook *hook);
const ej_break_hook *ej_get_break_hook(const epj_ctx *ctx);

/* ---- activation checkpointing (checkpoint.c)
 * ------------------------------------ */

/* Runs m->forward (through its orig/compiled forward) without saving
 * activations; in backward re-runs it with grad enabled and backpropagates
 * through the recomputed graph.  Outputs get one custom autograd node whose
 * inputs are in[] (and, implicitly, the parameters, which are leaves of the
 * recomputed graph and receive their gradients there). */
epj_status ej_checkpoint_call(epj_ctx *ctx, epj_module *m,
			      epj_tensor *const *in, int n_in, epj_tensor **out,
			      int n_out);
/* True while a checkpointed forward is being replayed in backward. */
bool ej_in_replay(const epj_ctx *ctx);

/* ---- comm (comm.c)
 * ------------------------------------------------------------ */

/* Collective backends (vtable).  Counts and offsets are in rows of `row`
 * bytes.  `self` is a world of one; MPI and NCCL come later. */
typedef struct ej_comm {
	const char *name;
	int rank, size;
	void *self;
	/* send[i] rows to rank i, receive recv[i] rows from rank i. */
	epj_status (*all_to_all_v)(void *self, const void *sendbuf,
				   const int64_t *send_counts, void *recvbuf,
				   const int64_t *recv_counts, size_t row);
	/* exchange one int64 per rank (the split plan) */
	epj_status (*all_to_all_i64)(void *self, const int64_t *send,
				     int64_t *recv);
	epj_status (*all_reduce_f32)(void *self, float *buf, int64_t n);
	epj_status (*barrier)(void *self);
	void (*destroy)(void *self);
} ej_comm;
ej_comm *ej_comm_self_new(void);
void ej_comm_free(ej_comm *c);

/* ---- AutoEP layer (autoep.c)
 * --------------------------------------------------- */

typedef struct ej_autoep_opts {
	int num_experts;
	int top_k;
	bool norm_topk_prob;
	bool fixed_routing; /* deterministic balanced assignment */
	bool async_split_plan;
} ej_autoep_opts;

/* Builds an AutoEP MoE layer module named parent.local with parameters
 * gate.weight [E, H] and experts.{e}.{gate,up}_proj.weight [I, H],
 * experts.{e}.down_proj.weight [H, I], initialised normal(0, init_std) from
 * ctx's RNG in that order, dtype dt.  compiler_disabled is set.
 * forward: in[0] = hidden [B, T, H] -> out[0] = [B, T, H]. */
epj_module *ej_autoep_new(epj_ctx *ctx, epj_module *parent, const char *local,
			  int hidden, int inter, const ej_autoep_opts *opts,
			  epj_dtype dt, double init_std, ej_comm *comm);
/* The last forward's expert assignment: [N, top_k] i64 (borrowed; NULL
 * before the first call). */
epj_tensor *ej_autoep_last_routing(const epj_module *m);
/* Changes the routing options of an AutoEP module (engine config). */
epj_status ej_autoep_set_routing(epj_module *m, bool fixed_routing,
				 bool async_split_plan);

/* ---- Qwen3-MoE model (qwen3.c)
 * -------------------------------------------------- */

struct epj_model {
	epj_module *root;
	ej_model_config cfg;
	epj_layout layout;
	ej_comm *comm;
	ej_param_list params; /* HF names, model order */
	/* AutoEP layers in model order (borrowed) */
	epj_module **moe;
	int n_moe;
};

/* Attention + norms of one decoder block, shared by both layouts.  `blk` is
 * the module owning self_attn / input_layernorm / post_attention_layernorm
 * / mlp; h [B, T, H], cos/sin [T, D]; returns the block output. */
epj_tensor *ej_qwen3_block(epj_ctx *ctx, epj_module *blk, epj_tensor *h,
			   epj_tensor *cos, epj_tensor *sin);
/* RMSNorm as HF computes it: x.f32 * rsqrt(mean(x.f32^2, -1) + eps), cast
 * back to x's dtype, times weight. */
epj_tensor *ej_rmsnorm(epj_ctx *ctx, epj_tensor *x, epj_tensor *w, double eps);

/* ---- engine (engine.c, compile.c)
 * ----------------------------------------------- */

typedef struct ej_optim ej_optim;

struct epj_engine {
	epj_ctx *ctx;
	epj_model *model; /* borrowed */
	ej_config cfg;
	ej_optim *optim;
	int64_t micro_step; /* micro-batches since the start */
	int64_t step;	    /* optimizer steps taken */
	double last_lr, last_grad_norm;
	double accum_loss; /* sum of micro losses of the current step */
	int64_t accum_n;
	/* region compiler state (compile.c), NULL until compiled */
	struct ej_engine_compile *compiled;
};

/* Frees the compile state (restores every region) -- compile.c. */
void ej_engine_compile_free(epj_engine *e);

/* ---- offline warm-up (qwen3.c, compile.c) ------------------------------ */

/* One argument a module is called with: meta, and whether it is a float
 * activation that requires grad when the caller runs with grad enabled (the
 * hidden state, which flows from the parameters). */
typedef struct ej_region_arg {
	epj_dtype dtype;
	int ndim;
	int64_t shape[EPJ_MAX_DIMS];
	bool activation;
} ej_region_arg;

/* The arguments (at most 3) and output count with which the model calls
 * region module m at micro-batch B x T.  EPJ_ERR_UNSUPPORTED for a module
 * the model does not call as a region. */
epj_status ej_model_region_args(epj_ctx *ctx, const epj_model *model,
				const epj_module *m, int64_t B, int64_t T,
				ej_region_arg *args, int *n_in, int *n_out);

/* Traces and compiles, without running anything, every variant a training
 * run at B x T asks of each region of a compiled engine: the training
 * forward (with activation checkpointing: the no-grad forward and the
 * replay instead) and the evaluation forward.  Variants already compiled
 * are skipped.  *n_variants: variants compiled. */
epj_status ej_engine_compile_trace_all(epj_engine *e, int64_t B, int64_t T,
				       int *n_variants);
/* The jit of a compiled engine (NULL before epj_engine_compile). */
struct ej_jit *ej_engine_jit(epj_engine *e);

#endif /* EPJIT_RUNTIME_IMPL_H */
