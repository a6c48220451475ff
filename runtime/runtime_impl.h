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
	/* A child of a compiler_disabled module whose parameters the
	 * enclosing region uses (Qwen2-MoE's mlp.shared_expert: named under
	 * the MoE block, computed in the decoder block): the region's
	 * parameter table includes its subtree. */
	bool region_owned;
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

/* ---- the commit record of a multi-rank checkpoint (ckpt_set.c)
 * ------------------------------------------------------------ */

#define EJ_CKPT_SET_FORMAT_PREFIX "epjit-checkpoint-set-"
#define EJ_CKPT_SET_VERSION	  1
#define EJ_CKPT_SET_FORMAT	  "epjit-checkpoint-set-1"
#define EJ_CKPT_NAME_MAX	  256
/* The most ranks a record may name. */
#define EJ_CKPT_SET_MAX_WORLD 65536
/* The largest record (bytes of the file) that a reader takes and a writer
 * commits: the same constant at both ends, so that no committed record is
 * refused.  It scales with the world limit: 512 bytes per rank hold a file
 * entry whose name is as long as a file name can be (255 bytes) when the
 * name needs no JSON escapes (at most 396 bytes), plus 64 KiB for the rest.
 * A record over it (names full of control characters) is refused by the
 * writer before the commit. */
#define EJ_CKPT_SET_MAX_BYTES                                                  \
	(((size_t)64 << 10) + (size_t)EJ_CKPT_SET_MAX_WORLD * 512)
/* The last generation a record may hold ([1, INT64_MAX]): a save over a
 * record of this generation is refused (there is no next one). */
#define EJ_CKPT_GEN_MAX INT64_MAX

typedef struct ej_ckpt_file {
	int64_t bytes;
	char hash[33]; /* XXH3-128 of the whole file, 32 hex digits */
	char name[EJ_CKPT_NAME_MAX]; /* plain name in the record's dir */
} ej_ckpt_file;

/* One committed generation of a checkpoint set. */
typedef struct ej_ckpt_set {
	int64_t generation, world, zero_stage, autoep_size;
	int64_t step, micro_step, optimizer_steps;
	ej_ckpt_file *files; /* [world], indexed by rank (owned) */
} ej_ckpt_set;

/* Whether the first n bytes of a file look like a commit record (of any
 * format version: the parser names a version this build does not read). */
bool ej_ckpt_set_sniff(const char *buf, size_t n);
/* Reads the record at path: 1 with *text (malloc'd, *len bytes) when path
 * is a regular file that starts like a record, 0 when it is anything else
 * (absent, a safetensors file, a FIFO: never blocks), -1 when it starts
 * like a record but cannot be read (a read error), -2 when it starts like
 * one but is larger than EJ_CKPT_SET_MAX_BYTES. */
int ej_ckpt_set_read(const char *path, char **text, size_t *len);
/* The error (EPJ_ERR_FORMAT naming path) for ej_ckpt_set_read's rc < 0. */
epj_status ej_ckpt_set_read_error(epj_ctx *ctx, const char *path, int rc);
/* Parses and validates a record (types, ranges, one file per rank, plain
 * file names, checksums of 32 hex digits); EPJ_ERR_FORMAT naming path (a
 * record of another format version: "commit record format version N,
 * this build reads 1"). */
epj_status ej_ckpt_set_parse(epj_ctx *ctx, const char *path, const char *text,
			     size_t len, ej_ckpt_set *s);
/* Writes s to path atomically (the commit).  The text is checked first as
 * a reader checks it (at most EJ_CKPT_SET_MAX_BYTES, then ej_ckpt_set_parse):
 * what a reader would refuse is never committed.  An error (naming path)
 * always means that path was not replaced. */
epj_status ej_ckpt_set_write(epj_ctx *ctx, const char *path,
			     const ej_ckpt_set *s);
void ej_ckpt_set_free(ej_ckpt_set *s);
/* Size and XXH3-128 of a regular file's whole content. */
epj_status ej_file_hash(epj_ctx *ctx, const char *path, int64_t *bytes,
			char hex[33]);
/* The name a save of set path gives rank's file of generation gen:
 * "<base>.g<gen>.rank<rank>", base path's last component; false when it
 * does not fit name[n]. */
bool ej_ckpt_set_file_name(const char *path, int64_t gen, int rank, char *name,
			   size_t n);
/* Called once a newer record of set path is committed: removes the files
 * of prev, the record path held before, that rank `part` of `nparts` is
 * to remove (prev's ranks k with k % nparts == part).  Only a file that
 * prev names and that has the name a save of this set gives it
 * (ej_ckpt_set_file_name of prev's generation and k), and only when it is
 * a regular file: never a file of another set, never what a link points
 * to, never a file the new record names. */
void ej_ckpt_set_prune(const char *path, const ej_ckpt_set *prev, int part,
		       int nparts);
/* The record of generation gen that a save keeping several generations
 * writes beside set path: "<path>.g<gen>.record"; false when it does not
 * fit buf[n]. */
bool ej_ckpt_set_copy_path(const char *path, int64_t gen, char *buf, size_t n);

/* ---- saves of the engine's state (engine.c, ckpt_async.c)
 * ------------------------------------------------------------ */

/* The counters a save records. */
typedef struct ej_save_counts {
	int64_t step, micro_step, optimizer_steps;
} ej_save_counts;

/* One rank's row of a save's exchange: whether its file is written, its
 * size and XXH3-128 checksum. */
typedef struct ej_save_row {
	int64_t ok, bytes;
	char hash[40];
} ej_save_row;

/* A save to path as every rank of the world plans it (ej_save_prepare):
 * the same generation and records on every rank. */
typedef struct ej_save_plan {
	char path[4096];
	char file[4200]; /* this rank's file: PATH.g<G>.rank<R>; one rank: PATH
			  */
	int64_t gen;	 /* the generation written (0: a world of one) */
	int rank, world;
	int keep; /* committed generations kept after the commit (>= 1) */
	ej_ckpt_set prev; /* the committed record (have_prev) */
	bool have_prev;
	/* the record of generation gen - keep when it is not prev: the copy
	 * ej_ckpt_set_copy_path names (rank 0 read it, every rank has it) */
	ej_ckpt_set drop;
	bool have_drop;
	ej_save_counts counts;
} ej_save_plan;

/* The world of a multi-rank engine, NULL for a world of one. */
struct ej_comm *ej_engine_world(const epj_engine *e);
/* Plans a save of e's state to path: with several ranks the generation
 * after the committed record's and the record of the generation its commit
 * drops, shared from rank 0 (collective); the counters as they are now.
 * On failure (a record at the last generation) nothing was written. */
epj_status ej_save_prepare(epj_engine *e, const char *path, ej_save_plan *pl);
void ej_save_plan_free(ej_save_plan *pl);
/* The end of a save of several ranks, on every rank (collective): the
 * rows are exchanged; rank 0 commits the record when every rank's file is
 * written (mine->ok on all of them and st EPJ_OK: this rank's status so
 * far); the ranks agree on the outcome; the generation pl->gen - pl->keep
 * is pruned only when every rank knows the commit happened. */
epj_status ej_save_commit(epj_engine *e, const ej_save_plan *pl,
			  const ej_save_row *mine, epj_status st);

/* What a checkpoint holds, entry by entry (engine.c's order): tensor() for
 * every tensor (borrowed, the engine's own: masters, optimizer state),
 * meta() for every metadata pair.  An error from either ends the walk. */
typedef struct ej_save_sink {
	void *self;
	epj_status (*tensor)(void *self, const char *name, epj_tensor *t);
	epj_status (*meta)(void *self, const char *key, const char *value);
} ej_save_sink;
epj_status ej_engine_save_entries(epj_engine *e, const char *path,
				  int64_t generation, const ej_save_sink *s);

/* Test hook: EPJIT_TEST_SAVE_HOLD=PHASE[:RANK[:STEP]] blocks the thread
 * that reaches PHASE of the save of step STEP on rank RANK (either left
 * out: any) until the process is killed, after saying so on stderr
 * ("... holds the save of step S at 'PHASE' (pid P) ..."). */
void ej_save_hold(const char *phase, int rank, int64_t step);
/* Test hook (the Check suite "save"): when set, called first by every
 * ej_save_hold, on the thread at that phase. */
extern void (*ej_save_phase_hook)(const char *phase, int rank, int64_t step);

/* The background save of an engine (ckpt_async.c): released by
 * epj_engine_free, which waits for its writer. */
struct ej_save_bg;
void ej_save_bg_free(struct ej_save_bg *b);

/* ---- comm (comm.c, comm_self.c, comm_mpi.c, comm_nccl.c)
 * ------------------------------------------------------------ */

/* Collective backends (vtable), one file per backend: `self` (a world of
 * one, comm_self.c), `mpi` (Open MPI, comm_mpi.c; built with HAVE_MPI) and
 * `nccl` (NCCL loaded with dlopen, comm_nccl.c, below).  Counts and offsets
 * are in rows of `row` bytes; displacements are the prefix sums of the
 * counts (rows to / from rank p are contiguous, in rank order).  Buffers
 * are host memory, except those of the data members of an `nccl` comm,
 * which are device memory (see ej_comm_nccl_new).  Members after `destroy` are
 * optional in hand-made test comms (NULL: the wrappers below report "not
 * provided").  A failure returns a status; `error` (when set) gives its
 * text: the call, the file:line, the backend's message, group and rank.
 * Blocking members wait at most `timeout_s` seconds (a vanished peer never
 * hangs the caller); after a timeout the comm is broken and every later
 * call fails at once. */
typedef struct ej_comm_req ej_comm_req; /* a posted non-blocking call */
typedef struct ej_comm {
	const char *name; /* backend: "self", "mpi", "nccl" */
	int rank, size;
	void *self;
	/* send[i] rows to rank i, receive recv[i] rows from rank i. */
	epj_status (*all_to_all_v)(void *self, const void *sendbuf,
				   const int64_t *send_counts, void *recvbuf,
				   const int64_t *recv_counts, size_t row);
	/* exchange one int64 per rank (the split plan) */
	epj_status (*all_to_all_i64)(void *self, const int64_t *send,
				     int64_t *recv);
	/* in-place sum over the ranks */
	epj_status (*all_reduce_f32)(void *self, float *buf, int64_t n);
	epj_status (*barrier)(void *self);
	void (*destroy)(void *self);
	/* ---- optional members ---- */
	const char *group; /* "world", "ep", "edp", "dp"; NULL: "world" */
	/* send holds sum(counts) floats laid out by rank; recv receives the
	 * sum over the ranks of block `rank` (counts[rank] floats). */
	epj_status (*reduce_scatter_f32)(void *self, const float *send,
					 float *recv, const int64_t *counts);
	/* send holds counts[rank] rows; recv gets every rank's rows in rank
	 * order. */
	epj_status (*all_gather_v)(void *self, const void *send, void *recv,
				   const int64_t *counts, size_t row);
	epj_status (*broadcast)(void *self, void *buf, size_t bytes, int root);
	/* Non-blocking exchange of n_per int64 per rank (send [size][n_per]
	 * -> recv [size][n_per]): posted now, completed by wait (which frees
	 * the request, also on failure).  Buffers stay untouched meanwhile. */
	epj_status (*all_to_all_i64_start)(void *self, const int64_t *send,
					   int64_t *recv, int n_per,
					   ej_comm_req **req);
	epj_status (*wait)(void *self, ej_comm_req *req);
	/* all_to_all_v off the compute stream (the `nccl` comm): issued on
	 * the device's communication stream after the compute stream's work
	 * so far (the send buffer is written), returning at once;
	 * all_to_all_v_wait makes the compute stream wait for its end without
	 * blocking the host.  Neither buffer may be read or reused on the
	 * compute stream before that wait.  One in flight per comm.  NULL:
	 * all_to_all_v is ordered with the caller already (host buffers). */
	epj_status (*all_to_all_v_start)(void *self, const void *sendbuf,
					 const int64_t *send_counts,
					 void *recvbuf,
					 const int64_t *recv_counts,
					 size_t row);
	epj_status (*all_to_all_v_wait)(void *self);
	/* A sub-communicator of the ranks passing the same color, ordered by
	 * key (MPI_Comm_split); group names it.  NULL on failure. */
	struct ej_comm *(*split)(void *self, int color, int key,
				 const char *group);
	const char *(*error)(void *self); /* text of the last failure */
	/* statistics, updated by the backend */
	int64_t stat_calls, stat_bytes; /* bytes sent by this rank */
	double stat_seconds;		/* wall time inside the calls */
} ej_comm;
ej_comm *ej_comm_self_new(void);
void ej_comm_free(ej_comm *c);
/* The counter-name part of a collective's purpose (comm.<part>.bytes):
 * words joined by dots, parentheses dropped, never a blank; n >= 1. */
void ej_comm_purpose_part(const char *what, char *out, size_t n);

/* The process's world (borrowed, never NULL after ej_comm_world_init or
 * on first use): `mpi` when epj_dist_init started MPI, else `self`. */
ej_comm *ej_comm_world(void);
/* Makes c (borrowed, not NULL) the world that engines made from now on use
 * and returns the previous one (owned by the caller again while c is set):
 * how a test builds a single-rank reference engine inside a multi-rank
 * run.  Set the previous world back before epj_dist_finalize. */
ej_comm *ej_comm_world_set(ej_comm *c);

/* The parallel groups of one engine (comm.c): world W, expert-parallel
 * (ep_size consecutive ranks), expert-data-parallel (ranks with the same
 * position in their EP group: W / ep_size of them) and data-parallel (the
 * whole world: every rank is a data-parallel replica of the dense
 * parameters).  All borrowed from / owned by the struct. */
typedef struct ej_groups {
	ej_comm *world, *ep, *edp, *dp;
	bool owned; /* ep/edp were split (freed by ej_groups_free) */
} ej_groups;
epj_status ej_groups_new(epj_ctx *ctx, ej_comm *world, int ep_size,
			 ej_groups *out);
void ej_groups_free(ej_groups *g);

/* Checked wrappers: on failure the context gets a message naming the call,
 * the comm's backend and group, this rank and the backend's text; the
 * counters comm.calls, comm.bytes and comm.us (wall microseconds) and
 * comm.<what>.bytes are advanced. */
epj_status ej_comm_a2av(epj_ctx *ctx, ej_comm *c, const char *what,
			const void *send, const int64_t *send_counts,
			void *recv, const int64_t *recv_counts, size_t row);
epj_status ej_comm_a2a_i64(epj_ctx *ctx, ej_comm *c, const char *what,
			   const int64_t *send, int64_t *recv);
/* The all-to-all-v of ej_comm_a2av off the compute stream where the comm
 * has all_to_all_v_start (*started true: ej_comm_a2av_wait must follow
 * before the buffers are read or reused on the compute stream; counted in
 * comm.a2av.started), else ej_comm_a2av itself (*started false). */
epj_status ej_comm_a2av_start(epj_ctx *ctx, ej_comm *c, const char *what,
			      const void *send, const int64_t *send_counts,
			      void *recv, const int64_t *recv_counts,
			      size_t row, bool *started);
/* The compute stream waits for the exchange ej_comm_a2av_start started
 * (comm.a2av.waits); no host synchronization. */
epj_status ej_comm_a2av_wait(epj_ctx *ctx, ej_comm *c, const char *what);
epj_status ej_comm_a2a_i64_start(epj_ctx *ctx, ej_comm *c, const char *what,
				 const int64_t *send, int64_t *recv, int n_per,
				 ej_comm_req **req);
epj_status ej_comm_wait(epj_ctx *ctx, ej_comm *c, const char *what,
			ej_comm_req *req);
epj_status ej_comm_allreduce(epj_ctx *ctx, ej_comm *c, const char *what,
			     float *buf, int64_t n);
epj_status ej_comm_reduce_scatter(epj_ctx *ctx, ej_comm *c, const char *what,
				  const float *send, float *recv,
				  const int64_t *counts);
epj_status ej_comm_allgather(epj_ctx *ctx, ej_comm *c, const char *what,
			     const void *send, void *recv,
			     const int64_t *counts, size_t row);
epj_status ej_comm_bcast(epj_ctx *ctx, ej_comm *c, const char *what, void *buf,
			 size_t bytes, int root);
epj_status ej_comm_barrier_c(epj_ctx *ctx, ej_comm *c, const char *what);

/* comm_mpi.c: the world over MPI_COMM_WORLD (MPI initialised by
 * epj_dist_init); NULL in a build without MPI. */
ej_comm *ej_comm_mpi_world(void);
/* comm_mpi.c: MPI_Init_thread when the environment says the process was
 * started by an MPI launcher (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK);
 * *started tells whether it did.  Errors: launched but built without MPI,
 * or MPI_Init_thread failed. */
epj_status ej_mpi_init(char *err, size_t n, bool *started);
void ej_mpi_finalize(void);
/* Timeout of every later blocking call of comms made from the world
 * (comm.timeout_s). */
void ej_comm_set_timeout(ej_comm *c, double timeout_s);

struct ej_cuda_dev; /* lib/cuda_driver.h */
/* comm_nccl.c: the `nccl` comm, collectives on device buffers of the cuda
 * device dev on its compute stream, over the ranks of boot (borrowed; it
 * must outlive the comm): rank 0's ncclGetUniqueId is broadcast over boot
 * (nothing is sent for a world of one, so `self` needs no MPI), then
 * ncclCommInitRank.  The int64 split-plan exchanges (host buffers) and the
 * barrier go to boot.  Errors: EPJ_ERR_UNSUPPORTED "no NCCL (libnccl.so.2
 * not found: ...)" or "NCCL disabled (EPJIT_NCCL=0)"; EPJ_ERR_BACKEND for
 * a failing NCCL call (its text, file:line, ncclGetErrorString). */
epj_status ej_comm_nccl_new(epj_ctx *ctx, ej_comm *boot,
			    struct ej_cuda_dev *dev, ej_comm **out);
/* True when NCCL can be loaded ($EPJIT_NCCL, default libnccl.so.2; the
 * first call tries, the answer is kept); ctx (may be NULL) gets why not. */
bool ej_nccl_available(epj_ctx *ctx);
/* comm.c: the comm for collectives on device buffers of a context on the
 * device named `device` (ctx->dev->name), as comm.backend (`choice`; NULL
 * or "" is "auto") or $EPJIT_COMM, which overrides it, says:
 *   "host"  none (*out NULL): collectives stay on world, host buffers;
 *   "nccl"  NCCL over world's ranks; EPJ_ERR_CONFIG unless device is
 *           "cuda", the NCCL error when it cannot be loaded or started;
 *   "auto"  "nccl" on the cuda device when NCCL loads, else "host".
 * *out (owned by the caller, ej_comm_free) borrows world. */
epj_status ej_comm_device_select(epj_ctx *ctx, const char *choice,
				 const char *device, ej_comm *world,
				 ej_comm **out);

/* ---- AutoEP layer (autoep.c)
 * --------------------------------------------------- */

typedef struct ej_autoep_opts {
	int num_experts;
	int top_k;
	bool norm_topk_prob;
	bool fixed_routing; /* deterministic balanced assignment */
	bool async_split_plan;
	/* DeepSeek's routers (all zero: softmax, plain top-k, as Qwen3):
	 * scores by softmax or sigmoid; experts chosen among the topk_group
	 * best of n_group groups (groups); with score_bias, by score +
	 * gate.e_score_correction_bias (a buffer [E] of the gate, f32, no
	 * gradient), the weights still the scores; weights renormalised
	 * (norm_topk_prob, + 1e-20 then) and times routed_scaling_factor
	 * (0 means 1). */
	ej_route_scoring scoring;
	ej_route_groups groups;
	int n_group, topk_group;
	double routed_scaling_factor;
	bool score_bias;
	/* The checkpoint names of an expert's projections, gate, up, down
	 * (NULL: Qwen3-MoE's gate_proj, up_proj, down_proj; Mixtral: w1, w3,
	 * w2), and an expert's module kind (NULL: "Qwen3MoeMLP").  Static
	 * strings: the layer keeps the pointers. */
	const char *proj[3];
	const char *expert_kind;
} ej_autoep_opts;

/* Builds an AutoEP MoE layer module named parent.local with parameters
 * gate.weight [E, H] and experts.{e}.{gate,up}_proj.weight [I, H],
 * experts.{e}.down_proj.weight [H, I] (opts->proj names them), initialised
 * normal(0, init_std) from ctx's RNG in that order, dtype dt.
 * compiler_disabled is set.
 * forward: in[0] = hidden [B, T, H] -> out[0] = [B, T, H]. */
epj_module *ej_autoep_new(epj_ctx *ctx, epj_module *parent, const char *local,
			  int hidden, int inter, const ej_autoep_opts *opts,
			  epj_dtype dt, double init_std, ej_comm *comm);
/* The experts of n tokens chosen from their scores [n, E] (row-major; the
 * router's softmax or sigmoid) as DeepSeek's routers choose them: by
 * score + bias[e] (bias NULL: 0); with groups, only among the experts of
 * the topk_group best of n_group equal groups (a group scores its best
 * expert, EJ_GROUPS_MAX, or the sum of its best two, EJ_GROUPS_TOP2); the
 * top k, best first, ties to the lower index.  idx [n, k]. */
void ej_autoep_select(const double *scores, const double *bias, int64_t n,
		      int E, int k, ej_route_groups groups, int n_group,
		      int topk_group, int64_t *idx);
/* Aux-loss-free balancing (DeepSeek-V3) of a layer with a score bias:
 * bias[e] += rate * sign(mean load - load[e]), the loads the tokens
 * routed to each expert by the training forwards since the last call,
 * summed over `comm` (NULL: this rank); then the loads restart.  A layer
 * without a score bias, or without forwards, is left as is. */
epj_status ej_autoep_balance(epj_ctx *ctx, epj_module *m, ej_comm *comm,
			     double rate);
/* The last forward's expert assignment: [N, top_k] i64 (borrowed; NULL
 * before the first call). */
epj_tensor *ej_autoep_last_routing(const epj_module *m);
/* The expert-load metrics (doc/trainer.md): the (token, expert)
 * assignments of this rank's calls (checkpoint replays excluded) to each
 * expert since the last reset, a token routed to k experts counting once
 * for each.  ej_autoep_step_load_add adds them to acc[E] (NULL: nothing)
 * and returns E, 0 for other modules. */
int ej_autoep_step_load_add(const epj_module *m, int64_t *acc);
void ej_autoep_step_load_reset(epj_module *m);
/* Sums load[n] (non-negative) over the ranks of comm (NULL or one rank:
 * unchanged) in one all-reduce ("expert load metrics"), exactly up to 4096
 * ranks and 2^36 per element. */
epj_status ej_expert_load_reduce(epj_ctx *ctx, ej_comm *comm, int64_t *load,
				 int64_t n);
/* The statistics of one layer's loads load[E] (total, max / mean, the
 * population coefficient of variation, dead experts; NaN ratios when the
 * total is 0); out->layer is left as is. */
void ej_expert_load_summary(const int64_t *load, int E, epj_expert_load *out);
/* From now on, m records the routing of every call (forward and
 * checkpoint replay) in call order; a second start clears the record.  A
 * no-op for other modules.  ej_autoep_routing_log: the number of calls
 * recorded, *calls their [N, top_k] i64 assignments and *replay whether
 * each was a replay (both borrowed, valid until the next call of m); 0 for
 * other modules. */
void ej_autoep_routing_log_start(epj_module *m);
int ej_autoep_routing_log(const epj_module *m, epj_tensor *const **calls,
			  const bool **replay);
/* Shards an AutoEP layer built over a world of one over the expert-parallel
 * group ep (borrowed; must outlive the layer): the layer keeps experts
 * [ep->rank * E / P, (ep->rank + 1) * E / P) (named by their global index)
 * and frees the others.  Error when num_experts % ep->size != 0. */
epj_status ej_autoep_shard(epj_ctx *ctx, epj_module *m, ej_comm *ep);
/* Changes the routing options of an AutoEP module (engine config). */
epj_status ej_autoep_set_routing(epj_module *m, bool fixed_routing,
				 bool async_split_plan);
/* Chooses the kernels of an AutoEP module on CPU contexts: the fused MoE
 * ops (lib/ops_moe.c; the default) or the sequence of generic ops
 * (EPJIT_AUTOEP_OPS=sequence sets this at construction).  cuda-sim
 * contexts run the MoE templates either way. */
epj_status ej_autoep_set_fused(epj_module *m, bool fused);
/* The device counterpart of the layer's EP group (an `nccl` comm over the
 * same ranks in the same order, borrowed; NULL: none): the dispatch and
 * combine all-to-all of a cuda context's rows (forward and backward) go
 * over it, the split plan's host counts stay on the host group. */
epj_status ej_autoep_set_dev_comm(epj_module *m, ej_comm *dev_comm);
/* The layer's shared expert (Qwen2-MoE's gated one, DeepSeek's shared
 * experts; children of the layer): fn(ctx, layer, hidden) returns its
 * contribution to the output, in hidden's shape (NULL with ctx's error
 * on failure).  When the layer's exchanges run off the compute stream
 * (ej_autoep_shared_in_layer) the layer computes it itself, issued
 * between the dispatch's start and its wait so that it runs while the
 * rows travel, and adds it to its output; else the model's block does,
 * in its compiled region. */
typedef epj_tensor *(*ej_autoep_shared_fn)(epj_ctx *ctx, epj_module *layer,
					   epj_tensor *hidden);
epj_status ej_autoep_set_shared(epj_module *m, ej_autoep_shared_fn fn);
/* True when the layer's output includes its shared expert: it has one
 * (ej_autoep_set_shared) and a device comm over more than one rank. */
bool ej_autoep_shared_in_layer(const epj_module *m);
/* The router losses the layer feeds (runtime/router_loss.c; borrowed, it
 * must outlive the layer; NULL: none) as the model's MoE layer `layer`. */
struct ej_rloss;
epj_status ej_autoep_set_rloss(epj_module *m, struct ej_rloss *rl, int layer);

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
	/* parallel groups made by the first multi-rank engine (owned; the
	 * AutoEP layers borrow groups.ep) */
	ej_groups groups;
	bool has_groups;
	/* the rope tables cos / sin [T, head_dim] of the last untraced
	 * forward (owned, NULL before; runtime/qwen3.c): reused while T and
	 * the dtype stay, so a forward uploads nothing (epj_tensor_from_f64
	 * is a host synchronization on a cuda context) */
	epj_tensor *rope_cos, *rope_sin;
	/* the router losses of the MoE layers (owned; runtime/router_loss.c;
	 * NULL: the model has none) */
	struct ej_rloss *rloss;
	/* what the root's forward takes after (input_ids, labels): position
	 * ids [B, T] (docs_pos) and document ids [B, T] (docs_attn), as the
	 * last ej_model_forward_docs was given them (a region's warm-up
	 * reads them: ej_model_region_args) */
	bool docs_pos, docs_attn;
};

/* Attention + norms of one decoder block, shared by both layouts.  `blk` is
 * the module owning self_attn / input_layernorm / post_attention_layernorm
 * / mlp; h [B, T, H], cos/sin [T, D] (or [B, 1, T, D] for position ids),
 * docs the document ids [B, T] or NULL; returns the block output. */
epj_tensor *ej_qwen3_block(epj_ctx *ctx, epj_module *blk, epj_tensor *h,
			   epj_tensor *cos, epj_tensor *sin, epj_tensor *docs);
/* RMSNorm as HF computes it: x.f32 * rsqrt(mean(x.f32^2, -1) + eps), cast
 * back to x's dtype, times weight. */
epj_tensor *ej_rmsnorm(epj_ctx *ctx, epj_tensor *x, epj_tensor *w, double eps);
/* Qwen3.5's zero-centred RMSNorm: (x.f32 * rsqrt(mean(x.f32^2) + eps)) *
 * (1 + w.f32), cast back to x's dtype (runtime/qwen3.c). */
epj_tensor *ej_rmsnorm_offset(epj_ctx *ctx, epj_tensor *x, epj_tensor *w,
			      double eps);
/* Model builder helpers (runtime/qwen3.c), shared by the families' files:
 * frees ts[0..n) and sets them to NULL; x W^T (+ b when the Linear `lin`
 * has a bias); a Linear parent.local with weight [out_f, in_f] drawn from
 * N(0, std). */
void ej_drop(epj_tensor **ts, int n);
epj_tensor *ej_linear_of(epj_ctx *ctx, epj_module *lin, epj_tensor *x);
epj_status ej_add_linear(epj_ctx *ctx, epj_module *parent, const char *local,
			 int64_t out_f, int64_t in_f, double std);

/* Qwen3.5-MoE's Gated DeltaNet (runtime/deltanet.c): blk.linear_attn with
 * transformers' parameter names (its gated norm of kind norm_kind), and its
 * forward x [B, T, H] -> out_proj output [B, T, H], with docs [B, T] the
 * document ids of packed documents (NULL: none), each starting from a zero
 * state and conv window. */
epj_status ej_deltanet_build(epj_ctx *ctx, const ej_model_config *c,
			     epj_module *blk, const char *norm_kind);
epj_tensor *ej_deltanet_forward(epj_ctx *ctx, epj_module *la,
				const ej_model_config *c, epj_tensor *x,
				epj_tensor *docs);

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
	/* packed documents and the per-token loss (runtime/batch.c) */
	epj_batch_opts batch;
	int64_t accum_tokens; /* counted tokens of the step (per-token) */
	/* region compiler state (compile.c), NULL until compiled */
	struct ej_engine_compile *compiled;
	/* collectives on device buffers (comm.backend), NULL: host only */
	ej_comm *dev_comm;
	/* its counterparts of the model's EP and EDP groups (owned; NULL
	 * where the group has one rank or there is no dev_comm) */
	ej_comm *dev_ep, *dev_edp;
	/* an observer of epj_engine_train_step (the parity harness), NULL:
	 * none */
	const struct ej_step_probe *probe;
	/* the expert-load metrics (epj_engine_track_expert_load): on, and
	 * each MoE layer's figures of the last step taken while on ([n_moe],
	 * owned; NULL before) */
	bool track_load;
	epj_expert_load *loads;
	/* while on: every layer's loads of the current step's training
	 * forwards, layer after layer ([sum of the layers' E], owned) */
	int64_t *step_loads;
	bool loads_valid; /* loads hold a step's figures */
	/* saves: the generations a commit keeps (epj_engine_set_save_keep),
	 * and the background save (ckpt_async.c), NULL until the first */
	int save_keep;
	struct ej_save_bg *bg;
};

/* With e->probe set, train_step asks the forward for the logits too and,
 * after the backward and before the gradients reach the optimizer, calls
 * on_backward with the logits ([B, T, V], borrowed for the call) and the
 * loss; an error from it ends the step there. */
typedef struct ej_step_probe {
	void *self;
	epj_status (*on_backward)(void *self, epj_engine *e, epj_tensor *logits,
				  double loss);
} ej_step_probe;

/* ---- batches (batch.c) ---- */
/* The engine's batch options from its config's data section, checked
 * against the model. */
epj_status ej_engine_batch_init(epj_engine *e);
/* The forward of a training micro-batch: the documents of the engine's
 * batch options applied (epj_batch_documents), the model's mean loss;
 * *tokens: the labels that count, with per_token_loss (else 0). */
epj_status ej_engine_forward(epj_engine *e, epj_tensor *input_ids,
			     epj_tensor *labels, epj_tensor **logits,
			     epj_tensor **loss, int64_t *tokens);
/* At a step of a per-token engine: the step's loss, the sum over every
 * micro-batch of every rank divided by their counted tokens (NaN when
 * none), and the scale that makes the optimizer's gradients that sum's
 * (1 / the tokens, times the world size the optimizer divides by). */
epj_status ej_engine_token_mean(epj_engine *e, double *mean, double *scale);

/* The name of the backend the compiled regions run on ("c", "cuda-sim",
 * "nvrtc", ...), "none" before compile -- compile.c. */
const char *ej_engine_backend_name(const epj_engine *e);

/* ---- parity harness internals (parity.c) ---------------------------------
 * The comparisons epj_parity_run makes, callable on their own so that the
 * tests can feed them known-bad signals. */

typedef enum ej_parity_qty {
	EJ_PARITY_OUTPUT, /* logits */
	EJ_PARITY_LOSS,
	EJ_PARITY_GRAD,	  /* gradients, per parameter */
	EJ_PARITY_UPDATE, /* FP32 master updates, per parameter */
} ej_parity_qty;

/* A tensor passes when |got - ref| <= atol + rtol * |ref| for every
 * element and ||got - ref|| / ||ref|| <= rel_l2. */
typedef struct ej_parity_tol {
	double atol, rtol, rel_l2;
} ej_parity_tol;

/* The harness's tolerance of quantity q (the table in parity.c). */
ej_parity_tol ej_parity_tolerance(ej_parity_qty q, bool bf16);

/* The comparison of a list of tensors, one by one; zero-initialise. */
typedef struct ej_parity_diff {
	double max_abs;	  /* largest |got - ref| */
	double worst_rel; /* largest relative L2 distance of one tensor */
	int64_t n;	  /* elements compared */
	int n_tensors;	  /* tensors compared (present on either side) */
	int n_bad;	  /* of them out of tolerance, missing on one side,
			     of another size or non-finite where ref is not */
	int first_bad;	  /* index + 1 of the first bad one, 0: none */
} ej_parity_diff;

/* Adds tensor `index`: got against ref under tol.  Both NULL: absent,
 * not counted; one NULL: bad. */
void ej_parity_diff_add(epj_ctx *ctx, ej_parity_diff *d, int index,
			const epj_tensor *got, const epj_tensor *ref,
			const ej_parity_tol *tol);
/* No bad tensor and something compared (an empty list fails). */
bool ej_parity_diff_ok(const ej_parity_diff *d);

/* One call of an AutoEP layer in the measured step. */
typedef struct ej_parity_route {
	const char *layer;	  /* the layer's module name */
	int call;		  /* its index among the layer's calls */
	bool replay;		  /* a checkpoint replay */
	const epj_tensor *assign; /* [N, top_k] i64 expert assignment */
} ej_parity_route;

/* Matches every call of ref with the call of got of the same layer and
 * index: the kinds must agree and the assignments be equal.  *total: the
 * assignments of ref; *mismatch: those that differ, plus all assignments
 * (at least 1) of a call only one side made or of another kind. */
void ej_parity_routes_compare(const ej_parity_route *got, int n_got,
			      const ej_parity_route *ref, int n_ref,
			      int64_t *mismatch, int64_t *total);

/* One SGD step with lr 1.0 moves every parameter with a gradient by
 * -grad: true when the updates are non-zero and within 5% relative L2 of
 * -grad (world > 1, where the update follows the rank-averaged gradient:
 * non-zero and within 4x of the gradient's RMS; shards skipped).  *rms:
 * RMS of the updates, *rel: the distance (the RMS ratio at world > 1), *n:
 * elements.  grad[i] NULL: parameter i has none; update[i] NULL where
 * grad[i] is not: fails. */
bool ej_parity_update_follows(epj_tensor *const *grad,
			      epj_tensor *const *update, int n_params,
			      int world, double *rms, double *rel, int64_t *n);

/* Frees the compile state (restores every region) -- compile.c. */
void ej_engine_compile_free(epj_engine *e);

/* The jit of a compiled engine (its segment cache holds every compiled
 * graph), NULL before compile; for benchmarks and tools (compile.c). */
struct ej_jit *ej_engine_jit(const epj_engine *e);
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

/* The arguments (at most EJ_REGION_MAX_ARGS) and output count with which
 * the model calls region module m at micro-batch B x T (with the position
 * and document ids of its docs_pos and docs_attn).  EPJ_ERR_UNSUPPORTED for
 * a module the model does not call as a region. */
#define EJ_REGION_MAX_ARGS 4
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

#endif /* EPJIT_RUNTIME_IMPL_H */
