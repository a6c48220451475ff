/* jit_impl.h -- private structures of the region compiler: arena, IR,
 * traces with graph breaks, compiled segments and regions.
 *
 * IR.  A graph is a list of values and a list of nodes in a valid order.
 * Value ids index graph->values; each value is either a graph input or the
 * out_nr-th output of one node.  Nodes reference values by id.  An IR node's
 * op is an op-table id (EJ_OP_*); a trace additionally has EJ_IR_BREAK nodes
 * (calls of an eager callee: the AutoEP layer).  Shapes and dtypes are
 * static (guards cover them).
 *
 * Memory.  Everything of one graph lives in its arena and is freed in one
 * call (ej_graph_free); only captured constants (tensor refs) are released
 * one by one.
 */
#ifndef EPJIT_JIT_IMPL_H
#define EPJIT_JIT_IMPL_H

#include "jit.h"

#include <stdarg.h>
#include <string.h>

/* ---- arena ------------------------------------------------------------- */

typedef struct ej_arena ej_arena;
ej_arena *ej_arena_new(void);
void ej_arena_free(ej_arena *a);
/* Zeroed, 16-byte aligned; aborts (EJ_ASSERT) when out of memory: a
 * compile that cannot get a few KiB cannot report anything useful. */
void *ej_arena_alloc(ej_arena *a, size_t n);
char *ej_arena_strdup(ej_arena *a, const char *s);
char *ej_arena_printf(ej_arena *a, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* A growable string (malloc'ed; graph text, generated sources). */
typedef struct ej_sbuf {
	char *p;
	size_t len, cap;
} ej_sbuf;

void ej_sb_printf(ej_sbuf *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void ej_sb_vprintf(ej_sbuf *s, const char *fmt, va_list ap);
void ej_sb_puts(ej_sbuf *s, const char *str);
/* Moves the text into the arena and frees the buffer. */
const char *ej_sb_finish(ej_sbuf *s, ej_arena *A);

/* ---- IR -------------------------------------------------------------------
 */

#define EJ_IR_BREAK (-1)

typedef enum ej_input_kind {
	EJ_IN_ACT = 0, /* activation: an input of the region or segment */
	EJ_IN_PARAM,   /* parameter, bound by slot at every call */
	EJ_IN_CONST,   /* constant captured at trace time (tensor ref) */
	EJ_IN_GRAD,    /* backward graph: gradient of a forward output */
	EJ_IN_SAVED,   /* backward graph: a value saved by the forward */
} ej_input_kind;

typedef struct ej_value {
	epj_dtype dtype;
	int ndim;
	int64_t shape[EPJ_MAX_DIMS];
	int node;   /* producing node, -1 for a graph input */
	int out_nr; /* output index at the producer */
	int input;  /* index in graph->inputs, -1 for node outputs */
	bool requires_grad;
} ej_value;

typedef struct ej_ir_node {
	int op; /* EJ_OP_* or EJ_IR_BREAK */
	ej_attrs attrs;
	int n_in, n_out;
	int *in, *out; /* value ids */
	void *callee;  /* EJ_IR_BREAK: the eager callee */
	const char *reason;
	bool dead;
} ej_ir_node;

typedef struct ej_graph_input {
	int value;
	ej_input_kind kind;
	int slot;	   /* PARAM: parameter slot; ACT: input index; GRAD:
			      forward output index; SAVED: saved index */
	epj_tensor *konst; /* CONST: captured tensor (owned ref) */
} ej_graph_input;

typedef struct ej_graph {
	ej_arena *arena;
	ej_value *values;
	int n_values, cap_values;
	ej_ir_node *nodes;
	int n_nodes, cap_nodes;
	ej_graph_input *inputs;
	int n_inputs, cap_inputs;
	int *outputs; /* value ids */
	int n_outputs, cap_outputs;
	const char *name; /* "segment 0 forward" etc. (debug) */
} ej_graph;

ej_graph *ej_graph_new(const char *name);
void ej_graph_free(ej_graph *g);
int ej_graph_add_value(ej_graph *g, epj_dtype dt, int ndim,
		       const int64_t *shape);
int ej_graph_add_input(ej_graph *g, ej_input_kind kind, int slot, epj_dtype dt,
		       int ndim, const int64_t *shape);
/* Appends a node; its output values are created with the given metas.
 * Returns the node index. */
int ej_graph_add_node(ej_graph *g, int op, const ej_attrs *attrs, const int *in,
		      int n_in, const ej_meta *out_meta, int n_out);
void ej_graph_add_output(ej_graph *g, int value);
/* Canonical text (inputs, nodes, outputs with renumbered values; never
 * parameter identities or names).  Arena-owned string. */
const char *ej_graph_text(ej_graph *g);
/* XXH3-128 of the canonical text (+ constant contents). */
epj_hash128 ej_graph_signature(ej_graph *g);
/* Number of live nodes. */
int ej_graph_live_nodes(const ej_graph *g);

/* ---- passes (passes.c; one pipeline in pipeline.c) --------------------------
 */

/* Removes nodes whose outputs reach no graph output. */
void ej_pass_dce(ej_graph *g);
/* Merges nodes with the same op, attributes and inputs (not breaks, not
 * creation ops whose result is mutated -- no op mutates in place). */
void ej_pass_cse(ej_graph *g);
/* GEMM epilogue fusion (passes.c): add(r, [reshape of] matmul/linear
 * product read only there) -> GEMM_ADD(a, b, r); returns how many adds
 * were fused.  Leaves the dead products for DCE. */
int ej_pass_gemm_epilogue(ej_graph *g);
/* RoPE chains -> ROPE(x, cos, sin) (passes.c), before autodiff; returns
 * how many were rewritten.  Leaves the dead chains for DCE. */
int ej_pass_rope(ej_graph *g);
/* Compacts: drops dead nodes and unused values, renumbers in order. */
ej_graph *ej_graph_compact(ej_graph *g, const char *name);
/* Marks requires_grad on values from the inputs' flags. */
void ej_graph_propagate_grad(ej_graph *g);

/* ---- traces
 * ------------------------------------------------------------------- */

struct ej_trace {
	ej_graph *g;	/* all nodes in program order, breaks included */
	int n_in;	/* region inputs = g inputs 0..n_in-1 (EJ_IN_ACT) */
	bool grad_mode; /* grad enabled while traced (train) */
	/* guards: meta of the region inputs and of the parameters */
	ej_meta *in_meta;
	bool *in_rg;
	int n_params;
	epj_dtype *param_dtype;
	bool *param_rg;
	int calls_captured;
};

/* ---- code generating backends ------------------------------------------ */

/* A backend of compiled segments: everything the pipeline, the warm-up and
 * the debug dump ask of one, so that none of them names a backend.  One
 * entry per row of jit/backends.def (ej_backend_get); the interpreter is one
 * too, with no build: it runs each IR node with the op table's kernels.  A
 * code-generating backend builds an artifact for one graph (forward or
 * backward of a segment) and runs it with the interpreter's calling
 * convention; `state` is owned by the segment and freed with free_state. */
struct ej_schedule;
typedef struct ej_codegen_backend {
	const char *name; /* compile.backend's name */
	ej_backend_kind kind;
	/* whether this build has it (NVRTC for nvrtc) */
	bool (*available)(void);
	/* RoPE chains become one op before autodiff (ej_pass_rope): the
	 * backends with a fused RoPE kernel (C; the CUDA devices' eager ROPE
	 * runs the op chain, so there the fused kernels are the better
	 * form) */
	bool rope_fusion;
	/* NULL: builds nothing (the interpreter).  A backend that builds gets
	 * the GEMM epilogue pass on its graphs too. */
	epj_status (*build)(epj_ctx *ctx, ej_jit *jit, ej_graph *g,
			    void **state);
	/* runs graph g (state from build; NULL for the interpreter) */
	epj_status (*run)(epj_ctx *ctx, void *state, ej_graph *g,
			  epj_tensor *const *inputs, epj_tensor **outs);
	void (*free_state)(void *state);
	/* the fused kernels a built state launches per run (debug dump) */
	int (*kernels)(const void *state);
	/* The warm-up (NULL: the backend has none): the source that build
	 * compiles for schedule s of the graph named `name`, for target
	 * `arch` (NULL where artifacts are not per arch), into arena A, and
	 * its kernel-cache key, computed by the function build uses ... */
	const char *(*artifact)(ej_arena *A, const struct ej_schedule *s,
				const char *name, const char *arch,
				char key[65]);
	/* ... and the compile of such a source (*art malloc'ed) */
	epj_status (*compile)(epj_ctx *ctx, const char *src, const char *name,
			      const char *arch, void **art, size_t *len);
	bool per_arch; /* artifacts per target arch (--arch) */
	/* the device its artifacts run on, opened before a compile so that
	 * its absence fails there, not at the first call (nvrtc: cuda);
	 * NULL: any context's */
	const char *device;
} ej_codegen_backend;

/* The entry of backend kind k (any valid ej_backend_kind). */
const ej_codegen_backend *ej_backend_get(ej_backend_kind k);

/* Each backend's entry, in its own file (jit/backends.def lists them). */
#define EJ_BACKEND(KIND, sym) extern const ej_codegen_backend sym;
#include "backends.def"
#undef EJ_BACKEND

/* Name of graph g's generated translation units: "g" + 16 hex digits of the
 * hash of its canonical text (it appears in the sources, so loaders and the
 * warm-up must use this one). */
void ej_codegen_graph_name(ej_graph *g, char name[48]);
/* Kernel-cache key of the shared object built from C source `src` (the
 * whole translation unit, prelude included): the source, the host compiler
 * identity (compiler, version, fixed flags).  The C backend looks artifacts
 * up under this key and the warm-up stores them under it. */
void ej_backend_c_key(const char *src, char key[65]);

/* ---- compiled segments and regions
 * --------------------------------------------- */

/* One compiled segment: forward graph F, backward graph B (NULL when no
 * input requires grad or grad mode was off), shared by every region and
 * call site with the same signature (refcounted, in the jit cache). */
typedef struct ej_segment {
	int refcount;
	epj_hash128 sig;
	char sig_hex[33];
	ej_graph *fwd; /* inputs: ACT(slot = segment input index) / PARAM /
			  CONST; outputs: segment outputs then saved values */
	int n_seg_out; /* leading outputs that are segment outputs */
	ej_graph *bwd; /* inputs: GRAD(slot = output idx) / SAVED(slot) */
	/* For each fwd input: the index of its gradient among bwd outputs,
	 * or -1 (no gradient). */
	int *grad_of_input;
	/* For each SAVED slot: where its value comes from in the forward:
	 * >= 0 a fwd output index, or -(1 + fwd input index). */
	int *saved_src;
	int n_saved;
	void *fwd_state, *bwd_state; /* backend artifacts (codegen), or NULL
					for the interpreter */
	/* the backend that runs it: its jit's, or the interpreter when its
	 * build was deferred (the warm-up plans only) */
	const ej_codegen_backend *backend;
	double compile_ms;
} ej_segment;

void ej_segment_unref(ej_segment *s);

/* A step of a compiled region: run a segment or perform a break.  Value
 * ids are those of the trace graph (the region's environment). */
typedef struct ej_region_step {
	bool is_break;
	ej_segment *seg; /* !is_break */
	void *callee;	 /* is_break */
	int n_in, n_out;
	int *in;  /* trace value ids feeding the step (segment: in order of
		     the segment's ACT inputs; params/consts bound apart) */
	int *out; /* trace value ids produced */
		  /* segment PARAM inputs: fwd input index -> parameter slot;
		   * CONST inputs carry their tensor in fwd itself */
} ej_region_step;

struct ej_region_fn {
	ej_arena *arena;
	ej_trace *trace; /* kept for guards and debug */
	ej_region_step *steps;
	int n_steps;
	int n_values; /* trace values (environment size) */
	int *out;     /* trace value ids of the region outputs */
	int n_out;
	int *last_use; /* per trace value: last step index using it */
};

struct ej_jit {
	epj_ctx *ctx;
	ej_backend_kind backend;
	/* cache of segments by signature (open addressing) */
	ej_segment **cache;
	int cache_cap, cache_n;
	int compile_seq; /* numbering of debug dumps */
	/* the kernel cache of compiled backends, opened at first use and
	 * closed with the jit (NULL after a failed open: no caching) */
	struct ej_kcache *kc;
	bool kc_opened;
	/* Offline warm-up: segments are traced, differentiated and passed but
	 * not built by the backend (their artifacts are compiled apart, see
	 * jit/warmup.c); such segments cannot run. */
	bool defer_build;
};

/* The kernel cache of jit's code-generating backends (pipeline.c):
 * opened at the first build and kept for the jit's lifetime; a NULL jit
 * gets a cache of its own (*own: the caller closes it).  *kc NULL: no
 * caching (the directory could not be made; warned); an unsafe directory
 * is an error naming `who`. */
epj_status ej_jit_kcache(epj_ctx *ctx, ej_jit *jit, const char *who,
			 struct ej_kcache **kc, bool *own);

/* Interpreter backend: runs g on bound inputs (one tensor per graph input;
 * borrowed).  outs[] receive new references for g's outputs.  Runs with
 * grad disabled; counts kernels.launched.compiled per node executed. */
epj_status ej_interp_run(epj_ctx *ctx, ej_graph *g, epj_tensor *const *inputs,
			 epj_tensor **outs);

/* Liveness shared by the interpreter and the C backend (interp.c).  A run is
 * a sequence of steps; read(u, i, j) is the j-th value step i reads, -1
 * past its last.  ej_last_use returns per value of g the last step reading
 * it, n_steps for graph outputs, -1 if never read (malloc'ed; NULL when out
 * of memory).  ej_release_reads frees (and clears in env) the values step i
 * read for the last time; ej_release_unused those of vals[0..n) that are
 * never read. */
typedef int (*ej_step_read_fn)(const void *u, int step, int j);
int *ej_last_use(const ej_graph *g, int n_steps, ej_step_read_fn read,
		 const void *u);
void ej_release_reads(epj_tensor **env, const int *last, int step,
		      ej_step_read_fn read, const void *u);
void ej_release_unused(epj_tensor **env, const int *last, const int *vals,
		       int n);
/* Runs node `node` of g through the op table (its inputs bound in env),
 * binds its outputs in env, then releases what step `step` read last and
 * the outputs never read.  On error the message names g and the node. */
epj_status ej_run_node(epj_ctx *ctx, ej_graph *g, int node, epj_tensor **env,
		       const int *last, int step, ej_step_read_fn read,
		       const void *u);

/* Joint forward/backward + partition of one segment (autodiff.c).
 * seg_fwd is the segment's forward graph with requires_grad marked; fills
 * seg->fwd/bwd/grad_of_input/saved_src. */
epj_status ej_autodiff_segment(epj_ctx *ctx, ej_graph *seg_fwd,
			       ej_segment *seg);

/* Debug dump: one line per compiled segment appended to
 * dir/compile_times.txt: signature, milliseconds, forward and backward
 * node counts. */
void ej_debug_dump_compile_time(ej_jit *jit, const char *sig, double ms,
				int fwd_nodes, int bwd_nodes);
/* Debug dump index: appends one JSON object (one line) describing a
 * compiled segment to dir/graphs.jsonl: seq, signature, mode, backend,
 * segment (its index in the region trace), forward/backward node and
 * fused-kernel counts, compile_ms, and the dump files written for it (IR
 * after each pass, schedules and generated sources), relative to dir. */
void ej_debug_dump_segment(ej_jit *jit, const ej_segment *s, bool train,
			   int segment);
/* Debug dump of a graph after a pass: dir/<seq>-<name>-<pass>.txt */
void ej_debug_dump_graph(ej_jit *jit, ej_graph *g, const char *pass);

#endif /* EPJIT_JIT_IMPL_H */
