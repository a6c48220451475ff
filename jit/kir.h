/* kir.h -- the code generator's data: the schedule of a graph (which nodes
 * run as one fused kernel, which run as extern op-table calls, in what
 * order) and the kernel IR of each fused kernel, shared by the C printer
 * (print_c.c) and the CUDA C printer (print_cuda.c).
 *
 *   graph --sched.c--> schedule: steps in order, each a fused kernel or an
 *                      extern node (ej_dispatch, exactly as the interpreter)
 *   group --kir.c----> kernel IR: iteration space, inputs and their
 *                      accesses, an SSA list of scalar ops, outputs
 *   kernel IR --print_c.c / print_cuda.c--> source text
 *
 * Kernel IR.  A kernel iterates over a static space of `rank` dims (the
 * shape of its outputs; for a row kernel the shape of its reductions'
 * input).  The last dim is the "column"; the others, flattened row-major,
 * are the "rows".  Every SSA value is one scalar computed at the current
 * point of the space:
 *   - elem: it varies along the columns (computed in a column loop);
 *   - otherwise it is a row value, computed once per row (loads of inputs
 *     broadcast along the columns, constants, reductions and everything
 *     computed only from those).
 * A row kernel (reduce = true) holds reductions over the columns (RSUM,
 * RMAX); a reduction of `dep` d is accumulated in column loop d and its
 * value is available to loops after it (softmax = max in loop 0, sum of
 * exp in loop 1, outputs in loop 2).  Element outputs are stored in the
 * loop of their dep; row outputs once per row after the last loop.
 *
 * Inputs are graph values with any strides: each access of an input is
 * the input read through a map from its dims to iteration dims (-1 for a
 * dim of size 1 or a broadcast one); at run time the caller passes, per
 * access and iteration dim, the element stride (0 where not mapped), so
 * views (transposes, slices, expands) are read in place.  Outputs are
 * contiguous tensors of the group's output values.
 *
 * Arithmetic follows the op table's CPU kernels exactly: f32 compute for
 * f32 and bf16 data, f64 for f64; a value whose graph dtype is bf16 is
 * rounded to bf16 (RNE) where the interpreter would have stored it, so a
 * fused kernel differs from op-by-op execution only by the order of
 * floating-point sums; sums accumulate in double like the reference
 * reductions.
 *
 * Memory: everything here lives in the arena given to the builder.
 */
#ifndef EPJIT_KIR_H
#define EPJIT_KIR_H

#include "jit_impl.h"

/* ---- kernel IR --------------------------------------------------------- */

typedef enum ej_kop {
	EJ_K_LOAD,  /* access `acc` at the current point */
	EJ_K_CONST, /* c, in the value's type */
	/* pointwise, as the op table's kernels (a, b args) */
	EJ_K_ADD,
	EJ_K_SUB,
	EJ_K_MUL,
	EJ_K_DIV,
	EJ_K_EQ,  /* 1 or 0 */
	EJ_K_SEL, /* a != 0 ? b : e (NaN a is true; a may be of another type) */
/* the ops of lib/ops.def's EJ_OP_FN rows: ej_<name>_f/_d(a[, b]) of the
 * prelude (EJ_K_EXP, EJ_K_LOG, EJ_K_RSQRT, EJ_K_SILU_BACKWARD, ...) */
#define EJ_OP(ID, name, n_in, n_out, flags)
#define EJ_OP_FN(ID, name, n_in, flags) EJ_K_##ID,
#include "ops.def"
#undef EJ_OP_FN
#undef EJ_OP
	EJ_K_POWC,  /* pow(a, c) (c not 1 or 2: those are a and a*a) */
	EJ_K_RECIP, /* 1 / a */
	EJ_K_CVT,   /* a converted to this value's type */
	EJ_K_RBF16, /* an f32 rounded to bf16 precision (RNE), kept f32 */
	/* reductions over the columns of a row (row kernels) */
	EJ_K_RSUM,  /* sum in f64 (the value's type is f64) */
	EJ_K_RMAX,  /* max, NaN-propagating (amax) */
	EJ_K_RMAXS, /* max as softmax takes it: m = x > m ? x : m */
	EJ_K_COUNT
} ej_kop;

/* Compute types of SSA values. */
typedef enum ej_ktype { EJ_KT_F32 = 0, EJ_KT_F64 } ej_ktype;

typedef struct ej_kval {
	ej_kop op;
	ej_ktype t;
	int a, b;  /* SSA args (-1 when absent) */
	int e;	   /* SEL: the value where a is 0 (else -1) */
	int acc;   /* LOAD: access index */
	double c;  /* CONST / POWC */
	bool elem; /* varies along the columns */
	int dep;   /* reductions this value waits for: max over args, +1 for
		      a reduction itself */
} ej_kval;

/* A kernel input: one graph value (a graph input or another step's
 * output). */
typedef struct ej_kinput {
	int value;
	epj_dtype dtype;
	int ndim;
	int64_t shape[EPJ_MAX_DIMS];
} ej_kinput;

/* An input read through map[d] (input dim d -> iteration dim, or -1). */
typedef struct ej_kaccess {
	int input;
	int map[EPJ_MAX_DIMS];
	bool elem; /* maps to the last iteration dim */
} ej_kaccess;

typedef struct ej_koutput {
	int value; /* graph value stored */
	int v;	   /* SSA value */
	epj_dtype dtype;
	bool row; /* one element per row (shape = rows [+ 1]) */
	int loop; /* element outputs: the column loop storing it */
} ej_koutput;

typedef struct ej_kernel {
	int id;	     /* index in the schedule's kernel list */
	bool reduce; /* row kernel */
	int rank;    /* >= 1 (size-1 dims dropped, except a row kernel's
			columns) */
	int64_t size[EPJ_MAX_DIMS];
	int64_t rows, cols, numel;
	int n_loops; /* column loops of a row kernel (1 for pointwise) */
	ej_kinput *in;
	int n_in;
	ej_kaccess *acc;
	int n_acc;
	ej_kval *v;
	int n_v;
	ej_koutput *out;
	int n_out;
	int *nodes; /* fused graph nodes, in order (debug) */
	int n_nodes;
} ej_kernel;

/* ---- graph uses ---------------------------------------------------------
 * Consumers of every value (CSR), and whether it is a graph output. */
typedef struct ej_uses {
	int *start; /* n_values + 1 */
	int *node;  /* consumer node per use (a node using a value twice is
		       listed twice) */
	bool *is_output;
} ej_uses;

ej_uses *ej_uses_build(ej_arena *A, const ej_graph *g);

/* How the scheduler may treat a node. */
typedef enum ej_kclass {
	EJ_KC_EXTERN = 0, /* op-table call (ej_dispatch) */
	EJ_KC_POINTWISE,  /* float pointwise op */
	EJ_KC_REDUCE,	  /* float row reduction over the last axis */
	EJ_KC_VIEW,	  /* expand / unit-dim reshape: an index map */
} ej_kclass;

ej_kclass ej_kir_node_class(const ej_graph *g, int node);

/* Builds the kernel IR of the group member[] (nodes[0..n) in graph order)
 * of g.  Returns NULL (and *why, a static string) when the group cannot be
 * one kernel: outputs of different shapes, a reduction read at another
 * row, broadcasting that does not line up, etc.  The scheduler uses this
 * as its legality test. */
ej_kernel *ej_kir_build(ej_arena *A, const ej_graph *g, const ej_uses *u,
			const bool *member, const int *nodes, int n_nodes,
			const char **why);

/* ---- schedule ------------------------------------------------------------ */

typedef struct ej_step {
	ej_kernel *k; /* fused kernel, or NULL: */
	int node;     /* the extern node */
} ej_step;

typedef struct ej_schedule {
	const ej_graph *g;
	ej_step *steps; /* execution order (a topological order) */
	int n_steps;
	ej_kernel **kernels; /* the fused steps' kernels, by id */
	int n_kernels;
	int n_extern;
} ej_schedule;

/* Groups g's live nodes into fused kernels and extern nodes (sched.c).
 * Never fails: a node that cannot be fused is extern. */
ej_schedule *ej_sched_build(ej_arena *A, const ej_graph *g);

/* Human-readable schedule and kernel IR (EPJIT_DEBUG_DUMP), arena string. */
const char *ej_sched_text(ej_arena *A, const ej_schedule *s);

/* ---- printers -------------------------------------------------------------
 * Each returns the translation unit for every fused kernel of s (arena
 * string).  Kernel i is `epjk_<i>`:
 *   C:    void epjk_i(char *const *ptr, const int64_t *st)
 *         ptr = inputs then outputs (element 0 of each), st = per access,
 *         `rank` strides (elements) by iteration dim.
 *   CUDA: extern "C" __global__ void epjk_i(ej_kargs_i a)  -- a struct of
 *         the same pointers and strides, passed by value; launch geometry
 *         from ej_cuda_launch_dims(). */
const char *ej_print_c(ej_arena *A, const ej_schedule *s, const char *name);
const char *ej_print_cuda(ej_arena *A, const ej_schedule *s, const char *name);

/* Launch geometry of a CUDA kernel printed by ej_print_cuda. */
void ej_cuda_launch_dims(const ej_kernel *k, unsigned grid[3],
			 unsigned block[3]);

/* The preludes pasted at the top of every generated unit (the text of
 * templates/prelude_c.h and prelude_cuda.h). */
const char *ej_prelude_c(void);
const char *ej_prelude_cuda(void);

/* CUDA C of every fused kernel of g (schedule + print), for the NVRTC
 * compile path and `epjit-train --emit-cuda`.  *source is malloc'ed (caller
 * frees); NULL with an error in ctx on failure. */
epj_status ej_codegen_emit_cuda(epj_ctx *ctx, ej_graph *g, const char *name,
				char **source);

/* ---- C backend test hooks (backend_c.c) -----------------------------------
 */

/* The schedule a built graph runs (state from ej_backend_c.build). */
const ej_schedule *ej_backend_c_schedule(const void *state);
/* Runs fused kernel `kernel` of a built graph alone: in[i] binds the
 * kernel's input i (any strides), out[o] receives its output o (a new
 * contiguous tensor).  Counts one kernels.launched.compiled. */
epj_status ej_backend_c_run_kernel(epj_ctx *ctx, void *state, int kernel,
				   epj_tensor *const *in, epj_tensor **out);

/* ---- running a schedule (sched_run.c) ------------------------------------
 * Shared by the code-generating backends: fn runs one fused kernel k with
 * its inputs bound in env (by value id): it binds k's outputs in env (new
 * references) and launches.  The runner counts each launch in
 * kernels.launched.compiled. */
typedef epj_status (*ej_sched_kernel_fn)(epj_ctx *ctx, void *user,
					 const ej_kernel *k, epj_tensor **env);
/* Values step i of schedule u reads (an ej_step_read_fn for liveness). */
int ej_sched_step_read(const void *u, int i, int j);
/* Runs schedule s of graph g with the interpreter's calling convention
 * (inputs bound to g->inputs; outs[] new references, all NULL on failure);
 * last: the liveness of ej_last_use(g, s->n_steps, ej_sched_step_read, s). */
epj_status ej_sched_run(epj_ctx *ctx, const ej_schedule *s, ej_graph *g,
			const int *last, epj_tensor *const *inputs,
			epj_tensor **outs, ej_sched_kernel_fn fn, void *user);
/* One fused kernel alone (the backends' test hooks): in[] its inputs,
 * out[] new references to its outputs (NULL on failure). */
epj_status ej_sched_run_kernel(epj_ctx *ctx, const ej_schedule *s, int kernel,
			       epj_tensor *const *in, epj_tensor **out,
			       ej_sched_kernel_fn fn, void *user);

/* ---- host launch code of the CUDA devices (launch_cuda.c) ---------------- */

/* Bytes of kernel k's argument struct (struct ej_kargs_<id>). */
size_t ej_cuda_args_size(const ej_kernel *k);
/* What a CUDA backend sizes its launch buffers by, over the kernels of s:
 * the largest argument struct, the most inputs and the most outputs of one
 * kernel (0 when s has none). */
void ej_cuda_sched_maxima(const struct ej_schedule *s, size_t *args, int *n_in,
			  int *n_out);
/* Prepares a launch of kernel k: in[i] binds input i (any strides), out[o]
 * is output o (contiguous, allocated); packs the argument struct into buf
 * (ej_cuda_args_size bytes), fills outs[0..n_out) and l (geometry from
 * ej_cuda_launch_dims, no dynamic shared memory). */
void ej_cuda_launch_prepare(const ej_kernel *k, epj_tensor *const *in,
			    epj_tensor *const *out, void *buf,
			    ej_launch_out *outs, ej_launch *l);

/* ---- cuda-sim backend (backend_sim.c) -------------------------------------
 */

/* Builds a cuda-sim module from CUDA C `cuda_src` (prelude included or not,
 * as the caller wrote it): the simulator header, the source, then one launch
 * entry per kernel[i] taking one argument of type arg_type[i] (e.g. "struct
 * ej_kargs_0"); compiled with $EPJIT_CXX (ASan flags when the library is
 * built with ASan, or EPJIT_SIM_ASAN=1; EPJIT_SIM_ASAN=0 never), cached in
 * the kernel cache under the hash of that full source and the compiler
 * identity and flags, and loaded on ej_device_sim.  *module for the
 * device's function/unload. */
epj_status ej_sim_build_module(epj_ctx *ctx, const char *cuda_src,
			       const char *const *kernel,
			       const char *const *arg_type, int n,
			       const char *name, void **module);
/* Whether modules are built with -fsanitize=address. */
bool ej_sim_asan(void);
/* Test hooks as the C backend's: the schedule of a built graph, and one
 * fused kernel run alone on cuda-sim (outputs new contiguous tensors). */
const ej_schedule *ej_backend_sim_schedule(const void *state);
epj_status ej_backend_sim_run_kernel(epj_ctx *ctx, void *state, int kernel,
				     epj_tensor *const *in, epj_tensor **out);

/* ---- nvrtc backend on the cuda device (backend_cuda.c) -------------------
 * Test and benchmark hooks as the other backends': the schedule and CUDA C
 * unit of a built graph, one fused kernel run alone (host tensors in, fresh
 * host tensors out, computed on the GPU), and the device allocator's
 * statistics. */
const ej_schedule *ej_backend_cuda_schedule(const void *state);
const char *ej_backend_cuda_source(const void *state);
epj_status ej_backend_cuda_run_kernel(epj_ctx *ctx, void *state, int kernel,
				      epj_tensor *const *in, epj_tensor **out);
void ej_backend_cuda_memory_stats(epj_memory_stats *out);
/* Times fused kernel `kernel` of a built graph on the GPU: in[] (host
 * tensors, the kernel's inputs) staged once, outputs allocated once, one
 * warm-up launch, then `iters` launches between two events.  *us: mean
 * microseconds per launch; *bytes: the bytes the kernel reads (input spans)
 * and writes (outputs). */
epj_status ej_backend_cuda_time_kernel(epj_ctx *ctx, void *state, int kernel,
				       epj_tensor *const *in, int iters,
				       double *us, double *bytes);
/* The device-to-device copy bandwidth (GB/s, bytes read + written) of
 * `iters` copies of `bytes`, timed with events on the compute stream. */
epj_status ej_backend_cuda_copy_bandwidth(epj_ctx *ctx, size_t bytes, int iters,
					  double *gbps);

/* ---- kernel body printing shared by print_c.c and print_cuda.c (kir.c) ----
 * The scalar SSA body of a kernel prints the same in both dialects: values
 * are `const T v<i> = <expr>;` (v<i>_<lane> on the CUDA vector path), loads
 * read in<n>[b<a> + column offset] (bf16 through ej_bf2f), stores write
 * out<n>[idx] (bf16 through ej_f2bf), reductions fold into acc<i>.  What
 * differs is how an exact constant is spelled (`literal`; `constant` for a
 * CONST value), the unit-stride copy of the C loops (`unit`) and the CUDA
 * vector lanes (`lane`).  row_done/elem_done/seen have n_v + 1 entries. */
typedef struct ej_kpr {
	ej_sbuf *s;
	const ej_kernel *k;
	void (*literal)(char *buf, size_t n, ej_ktype t, double c);
	void (*constant)(char *buf, size_t n, ej_ktype t, double c);
	bool *row_done; /* per value: declared in the row scope */
	int *elem_done; /* per value: stamp of the loop body that has it */
	int body;
	int *seen, stamp; /* pre_row walk marks */
	bool unit;	  /* printing the unit-stride copy of a loop (C) */
	int lane; /* vector path: lane being printed; -1 scalar (CUDA) */
	int ind;  /* indent (tabs) */
	/* C: suffix of the row_sum accumulators in the body ("[l]" in the
	 * 8-lane loop, "_t" in its tail); NULL: plain acc<v> */
	const char *acc_at;
} ej_kpr;

/* Allocates the marks (lane -1); ej_kpr_fini frees them. */
void ej_kpr_init(ej_kpr *p, ej_sbuf *s, const ej_kernel *k);
void ej_kpr_fini(ej_kpr *p);
/* One line of code at the current indent. */
void ej_kpr_line(ej_kpr *p, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
const char *ej_kt_ctype(ej_ktype t);
bool ej_kop_is_red(ej_kop op);
/* Row value v into the row scope (once per row). */
void ej_kpr_need_row(ej_kpr *p, int v);
/* Element value v into the current loop body. */
void ej_kpr_need_elem(ej_kpr *p, int v);
/* Before a loop: the row values its element values read. */
void ej_kpr_pre_row(ej_kpr *p, int v);
/* Before column loop l: the row values it reads (new walk stamp). */
void ej_kpr_pre_loop(ej_kpr *p, int l);
/* out<n_in + o>[idx] = the output's value at the current lane. */
void ej_kpr_store(ej_kpr *p, int o, const char *idx);
/* Body of column loop l (new body): reductions of loop l folded into
 * acc<v>, element outputs of loop l stored at ob + j. */
void ej_kpr_loop_body(ej_kpr *p, int l);

/* Short names for dumps. */
const char *ej_kop_name(ej_kop op);

#endif /* EPJIT_KIR_H */
