/* epjit.h -- the one public header of libepjit.
 *
 * epjit trains Mixture-of-Experts transformers with opt-in regional JIT
 * compilation around expert-parallel (AutoEP) MoE layers.  This header is the
 * whole public surface: opaque handles, the `epj_` prefix, and plain C11.
 *
 * Conventions
 *  - Every call takes the context first.
 *  - Ownership is in the name: a function returning `epj_tensor *` returns a
 *    NEW reference that the caller owns and releases with epj_tensor_free().
 *    Tensor arguments are borrowed unless the comment says otherwise.
 *  - Ops return NULL on failure and leave a status and a message with context
 *    (op name, shapes) in the context: epj_ctx_status(), epj_ctx_error().
 *    A NULL tensor argument makes an op return NULL without touching the
 *    message, so a chain of ops can be checked once at its end.
 *  - Functions returning epj_status return EPJ_OK on success.
 */
#ifndef EPJIT_H
#define EPJIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPJ_MAX_DIMS 8

typedef enum epj_status {
	EPJ_OK = 0,
	EPJ_ERR_INVALID, /* bad argument */
	EPJ_ERR_SHAPE,	 /* shape mismatch */
	EPJ_ERR_DTYPE,	 /* dtype mismatch or unsupported dtype */
	EPJ_ERR_INDEX,	 /* index out of range */
	EPJ_ERR_NOMEM,	 /* allocation failed */
	EPJ_ERR_IO,	 /* file or system call failed */
	EPJ_ERR_FORMAT,	 /* malformed file (safetensors, token file, cache) */
	EPJ_ERR_CONFIG,	 /* bad configuration (JSON key, value, type) */
	EPJ_ERR_UNSUPPORTED, /* valid request this build or mode cannot do */
	EPJ_ERR_BACKEND,     /* backend/driver failure (no driver, launch) */
	EPJ_ERR_COMPILE,     /* trace or code generation or compiler failure */
	EPJ_ERR_STATE,	     /* call not valid in the current state */
} epj_status;

/* Name of a status ("EPJ_ERR_SHAPE" ...). Never NULL. */
const char *epj_status_name(epj_status s);

typedef enum epj_dtype {
	EPJ_DTYPE_F32 = 0,
	EPJ_DTYPE_BF16,
	EPJ_DTYPE_I32,
	EPJ_DTYPE_I64,
	EPJ_DTYPE_F64, /* for references and finite differences */
	EPJ_DTYPE_COUNT
} epj_dtype;

const char *epj_dtype_name(epj_dtype dt); /* "f32", "bf16", ... */
size_t epj_dtype_size(epj_dtype dt);
bool epj_dtype_is_float(epj_dtype dt);

/* bf16 <-> f32: round to nearest even; NaN stays NaN (quiet), Inf stays Inf. */
uint16_t epj_f32_to_bf16(float f);
float epj_bf16_to_f32(uint16_t b);

typedef struct epj_ctx epj_ctx;
typedef struct epj_tensor epj_tensor;
typedef struct epj_counters epj_counters;
typedef struct epj_module epj_module;

/* ---- context --------------------------------------------------------- */

/* Creates a context on a backend: "cpu" (NULL means "cpu"); "cuda-sim" (host
 * memory, eager ops as CUDA kernels run on the CPU, compiled regions on the
 * cuda-sim backend by default); "cuda" (the GPU through the dlopen'ed
 * driver: tensors in device memory, eager ops as NVRTC kernels; without a
 * driver or GPU, EPJ_ERR_BACKEND).  Any other name is EPJ_ERR_INVALID.
 * *out owns it. */
epj_status epj_ctx_new(const char *backend, epj_ctx **out);
void epj_ctx_free(epj_ctx *ctx);
/* Ordering with a stream of the caller's, for a framework that shares the
 * GPU's primary context with the library (PyTorch: its current stream).
 * `stream` is a CUstream (the runtime's cudaStream_t; NULL: the legacy
 * default stream).  epj_ctx_wait_stream: the work the context issues from
 * now on runs after the work queued on `stream` so far.
 * epj_stream_wait_ctx: the work queued on `stream` from now on runs after
 * the context's work queued so far.  Each records an event and makes the
 * other stream wait for it (no host wait), and makes the context's GPU
 * current in the calling thread.  On the cpu and cuda-sim devices a call's
 * work is done when it returns: both do nothing and return EPJ_OK. */
epj_status epj_ctx_wait_stream(epj_ctx *ctx, void *stream);
epj_status epj_stream_wait_ctx(epj_ctx *ctx, void *stream);
/* The ordinal of a cuda context's GPU (what the driver numbers it:
 * EPJIT_CUDA_DEVICE, else the local rank modulo the device count); -1 on
 * the other devices. */
int epj_ctx_cuda_ordinal(const epj_ctx *ctx);
/* Whether `name` is a device of this build (what epj_ctx_new takes; the
 * cuda device is known even where no GPU is there to open). */
bool epj_device_known(const char *name);
/* The known devices, for messages: "cpu, cuda-sim, cuda".  Static. */
const char *epj_device_names(void);

epj_status epj_ctx_status(const epj_ctx *ctx);
/* Message of the last error ("" when none). Valid until the next error. */
const char *epj_ctx_error(const epj_ctx *ctx);
void epj_ctx_clear_error(epj_ctx *ctx);

/* Seeds the context RNG (deterministic across runs and thread counts). */
void epj_ctx_seed(epj_ctx *ctx, uint64_t seed);

/* Gradient mode.  epj_no_grad_enter returns the previous mode for
 * epj_no_grad_exit, so scopes nest. */
bool epj_no_grad_enter(epj_ctx *ctx);
void epj_no_grad_exit(epj_ctx *ctx, bool prev);
bool epj_grad_enabled(const epj_ctx *ctx);

/* ---- logging ----------------------------------------------------------- */

typedef enum epj_log_level {
	EPJ_LOG_ERROR = 0,
	EPJ_LOG_WARN,
	EPJ_LOG_INFO,
	EPJ_LOG_DEBUG,
	EPJ_LOG_TRACE
} epj_log_level;

/* Logging to stderr: epj_log_msg (epj_log is the natural-log op).
 * Level from EPJIT_LOG (error|warn|info|debug|trace or 0..4; default warn). */
epj_log_level epj_log_level_get(void);
void epj_log_level_set(epj_log_level lvl);
void epj_log_msg(epj_log_level lvl, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* ---- memory ------------------------------------------------------------ */

typedef struct epj_memory_stats {
	uint64_t allocated;	 /* bytes in live tensors' storages */
	uint64_t reserved;	 /* bytes held by the caching allocator */
	uint64_t peak_allocated; /* since creation or the last reset */
	uint64_t peak_reserved;
	uint64_t num_allocs; /* storage allocations served */
	uint64_t num_frees;
	uint64_t cache_hits; /* allocations served from the cache */
	/* segments obtained from the device and returned to it: calls of
	 * the device's allocation and free (cuMemAlloc / cuMemFree) */
	uint64_t num_device_allocs;
	uint64_t num_device_frees;
} epj_memory_stats;

void epj_memory_stats_get(const epj_ctx *ctx, epj_memory_stats *out);
void epj_memory_reset_peaks(epj_ctx *ctx);
/* Returns cached, unused blocks to the system. */
void epj_memory_empty_cache(epj_ctx *ctx);

/* ---- tensors ----------------------------------------------------------- */

/* New contiguous tensor, zero-filled. */
epj_tensor *epj_zeros(epj_ctx *ctx, epj_dtype dt, int ndim,
		      const int64_t *shape);
epj_tensor *epj_full(epj_ctx *ctx, epj_dtype dt, int ndim, const int64_t *shape,
		     double value);
/* New contiguous tensor holding a copy of `data` (row-major, dtype dt). */
epj_tensor *epj_tensor_from_data(epj_ctx *ctx, epj_dtype dt, int ndim,
				 const int64_t *shape, const void *data);
/* Normal(mean, std) and Uniform[lo, hi) from the context RNG. */
epj_tensor *epj_randn(epj_ctx *ctx, epj_dtype dt, int ndim,
		      const int64_t *shape, double mean, double std);
epj_tensor *epj_rand_uniform(epj_ctx *ctx, epj_dtype dt, int ndim,
			     const int64_t *shape, double lo, double hi);
/* Integers uniform in [lo, hi). */
epj_tensor *epj_randint(epj_ctx *ctx, epj_dtype dt, int ndim,
			const int64_t *shape, int64_t lo, int64_t hi);

/* A contiguous row-major tensor over memory the caller owns (`data`: host
 * memory on the cpu device, device memory on cuda): no copy, and the memory
 * is never freed or reallocated by the library.  The caller keeps it alive
 * and unmoved while the tensor or any view of it lives.  A bad dtype, rank
 * or shape, or NULL data with elements, is EPJ_ERR_INVALID / EPJ_ERR_SHAPE
 * (NULL result, message in the context). */
epj_tensor *epj_tensor_borrow(epj_ctx *ctx, epj_dtype dt, int ndim,
			      const int64_t *shape, void *data);
epj_tensor *epj_tensor_ref(epj_tensor *t); /* returns t, one more ref */
void epj_tensor_free(epj_tensor *t);	   /* drops one ref; NULL ok */

epj_dtype epj_tensor_dtype(const epj_tensor *t);
int epj_tensor_ndim(const epj_tensor *t);
int64_t epj_tensor_dim(const epj_tensor *t, int i); /* negative i counts back */
const int64_t *epj_tensor_shape(const epj_tensor *t);
const int64_t *epj_tensor_strides(const epj_tensor *t); /* in elements */
int64_t epj_tensor_offset(const epj_tensor *t);		/* in elements */
int64_t epj_tensor_numel(const epj_tensor *t);
bool epj_tensor_is_contiguous(const epj_tensor *t);
/* Host pointer to element 0 (storage + offset) of a cpu tensor, else NULL. */
void *epj_tensor_data(epj_tensor *t);
/* Address of element 0 on the tensor's device: a device pointer on cuda,
 * host memory on cpu and cuda-sim; NULL when it has no storage.  The
 * caller may write through it. */
void *epj_tensor_address(epj_tensor *t);
/* True when both tensors view the same storage. */
bool epj_tensor_shares_storage(const epj_tensor *a, const epj_tensor *b);
/* Writes "f32[2,3]" into buf. Returns buf. */
char *epj_tensor_describe(const epj_tensor *t, char *buf, size_t n);

/* Strided copy of all elements, row-major, converted to double. */
epj_status epj_tensor_to_f64(epj_ctx *ctx, const epj_tensor *t, double *out);
/* Strided write of numel values converted from double (rounding for bf16). */
epj_status epj_tensor_from_f64(epj_ctx *ctx, epj_tensor *t, const double *in);
/* Element at a flat row-major index, as double. */
double epj_tensor_get_f64(const epj_tensor *t, int64_t flat_index);
void epj_tensor_set_f64(epj_tensor *t, int64_t flat_index, double v);
/* Copies src into dst (same shape; dtype converted), through strides. */
epj_status epj_tensor_copy_(epj_ctx *ctx, epj_tensor *dst,
			    const epj_tensor *src);

/* ---- autograd ----------------------------------------------------------- */

void epj_tensor_set_requires_grad(epj_tensor *t, bool on);
bool epj_tensor_requires_grad(const epj_tensor *t);
bool epj_tensor_is_leaf(const epj_tensor *t);
/* Borrowed gradient (NULL if none). */
epj_tensor *epj_tensor_grad(const epj_tensor *t);
/* Sets the gradient (takes a new reference to g; NULL clears). */
void epj_tensor_set_grad(epj_tensor *t, epj_tensor *g);
void epj_tensor_zero_grad(epj_tensor *t);
/* Keep .grad of a non-leaf tensor during backward (for tests). */
void epj_tensor_retain_grad(epj_tensor *t);
/* New tensor sharing storage, cut from the graph, requires_grad false. */
epj_tensor *epj_detach(epj_ctx *ctx, epj_tensor *t);
/* Backpropagates from `root`.  grad may be NULL when root has one element
 * (it is then 1).  Gradients of leaves accumulate into .grad.  The graph is
 * freed as it is consumed (saved tensors are released after use). */
epj_status epj_backward(epj_ctx *ctx, epj_tensor *root, epj_tensor *grad);

/* ---- ops ------------------------------------------------------------------
 * Elementwise binary ops broadcast as numpy does.  Float ops accept f32,
 * bf16 and f64; bf16 computes in f32.  Results have the inputs' dtype. */

epj_tensor *epj_add(epj_ctx *ctx, epj_tensor *a, epj_tensor *b);
epj_tensor *epj_sub(epj_ctx *ctx, epj_tensor *a, epj_tensor *b);
epj_tensor *epj_mul(epj_ctx *ctx, epj_tensor *a, epj_tensor *b);
epj_tensor *epj_div(epj_ctx *ctx, epj_tensor *a, epj_tensor *b);
/* 1.0 where a == b else 0.0, in a's dtype (no gradient). */
epj_tensor *epj_eq(epj_ctx *ctx, epj_tensor *a, epj_tensor *b);
/* a where cond != 0 (NaN counts as true), else b: the three broadcast
 * together; a and b of one dtype (any), cond of any dtype; the result has
 * a's dtype.  Exact (elements are copied, never computed with), so an Inf or
 * NaN in the branch not taken does not reach the result.  Gradients: a's is
 * grad where cond, b's grad where not, cond's zero. */
epj_tensor *epj_where(epj_ctx *ctx, epj_tensor *cond, epj_tensor *a,
		      epj_tensor *b);
/* The larger of a and b (broadcast, one dtype, integers too); NaN where
 * either is NaN (a's where both are), a where they are equal (0 and -0
 * included).  Gradients as torch's maximum: halved between equal inputs;
 * both get it where either is NaN. */
epj_tensor *epj_maximum(epj_ctx *ctx, epj_tensor *a, epj_tensor *b);
epj_tensor *epj_add_scalar(epj_ctx *ctx, epj_tensor *a, double s);
epj_tensor *epj_mul_scalar(epj_ctx *ctx, epj_tensor *a, double s);
epj_tensor *epj_pow_scalar(epj_ctx *ctx, epj_tensor *a, double exponent);
epj_tensor *epj_neg(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_exp(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_log(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_sqrt(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_rsqrt(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_silu(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_sigmoid(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_tanh(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_gelu(epj_ctx *ctx, epj_tensor *a); /* exact (erf) form */
epj_tensor *epj_cos(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_sin(epj_ctx *ctx, epj_tensor *a);
epj_tensor *epj_log1p(epj_ctx *ctx, epj_tensor *a); /* log(1 + a) */
epj_tensor *epj_cast(epj_ctx *ctx, epj_tensor *a, epj_dtype dt);

/* Reductions over one axis (negative counts back). */
epj_tensor *epj_sum(epj_ctx *ctx, epj_tensor *a, int axis, bool keepdim);
epj_tensor *epj_mean(epj_ctx *ctx, epj_tensor *a, int axis, bool keepdim);
epj_tensor *epj_amax(epj_ctx *ctx, epj_tensor *a, int axis, bool keepdim);
/* Max with argmax (i64, first index of the maximum). */
epj_status epj_max(epj_ctx *ctx, epj_tensor *a, int axis, bool keepdim,
		   epj_tensor **values, epj_tensor **indices);
/* Sum of all elements, shape []. */
epj_tensor *epj_sum_all(epj_ctx *ctx, epj_tensor *a);
/* Reduces a broadcast result back to `shape` by summing (broadcast rules). */
epj_tensor *epj_sum_to(epj_ctx *ctx, epj_tensor *a, int ndim,
		       const int64_t *shape);
/* Softmax / log-softmax computed in f32 (f64 for f64); result in a's dtype. */
epj_tensor *epj_softmax(epj_ctx *ctx, epj_tensor *a, int axis);
epj_tensor *epj_log_softmax(epj_ctx *ctx, epj_tensor *a, int axis);

/* a [..., M, K] @ b [..., K, N]; batch dims broadcast; 1-D not accepted. */
epj_tensor *epj_matmul(epj_ctx *ctx, epj_tensor *a, epj_tensor *b);
/* x [..., in] @ w[out, in]^T (+ bias[out], may be NULL). */
epj_tensor *epj_linear(epj_ctx *ctx, epj_tensor *x, epj_tensor *w,
		       epj_tensor *bias);

/* weight [V, D], ids (i32/i64) any shape -> [..., D]. */
epj_tensor *epj_embedding(epj_ctx *ctx, epj_tensor *weight, epj_tensor *ids);
/* Rows of a along axis picked by 1-D index (i32/i64). */
epj_tensor *epj_index_select(epj_ctx *ctx, epj_tensor *a, int axis,
			     epj_tensor *index);
/* out = a with src added at rows index along axis (out of place). */
epj_tensor *epj_index_add(epj_ctx *ctx, epj_tensor *a, int axis,
			  epj_tensor *index, epj_tensor *src);
/* torch.gather / scatter_add semantics (out of place). */
epj_tensor *epj_gather(epj_ctx *ctx, epj_tensor *a, int axis,
		       epj_tensor *index);
epj_tensor *epj_scatter_add(epj_ctx *ctx, epj_tensor *a, int axis,
			    epj_tensor *index, epj_tensor *src);
/* Top-k along the last axis, largest first; ties: lower index first.
 * indices are i64. */
epj_status epj_topk(epj_ctx *ctx, epj_tensor *a, int64_t k, epj_tensor **values,
		    epj_tensor **indices);
/* Stable ascending argsort along axis, i64 result (no gradient). */
epj_tensor *epj_argsort(epj_ctx *ctx, epj_tensor *a, int axis);

/* n >= 1 tensors concatenated along axis. */
epj_tensor *epj_cat(epj_ctx *ctx, epj_tensor *const *ts, int n, int axis);
/* Splits along axis into n pieces of the given sizes (views). outs[n]. */
epj_status epj_split(epj_ctx *ctx, epj_tensor *a, int axis, int n,
		     const int64_t *sizes, epj_tensor **outs);
/* Views (share storage): */
epj_tensor *epj_reshape(epj_ctx *ctx, epj_tensor *a, int ndim,
			const int64_t *shape); /* one -1 allowed; copies when
						  a is not viewable */
epj_tensor *epj_transpose(epj_ctx *ctx, epj_tensor *a, int d0, int d1);
epj_tensor *epj_permute(epj_ctx *ctx, epj_tensor *a, const int *perm);
/* Elements start, start+step, ... < end along axis (step >= 1). */
epj_tensor *epj_slice(epj_ctx *ctx, epj_tensor *a, int axis, int64_t start,
		      int64_t end, int64_t step);
epj_tensor *epj_expand(epj_ctx *ctx, epj_tensor *a, int ndim,
		       const int64_t *shape);
/* Contiguous copy (or a new reference when a is already contiguous). */
epj_tensor *epj_contiguous(epj_ctx *ctx, epj_tensor *a);

/* Scaled dot-product attention with grouped-query heads:
 * q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], Hq % Hkv == 0
 * (query head h reads kv head h / (Hq / Hkv)) -> [B, Hq, T, Dv].
 * scale <= 0 means 1/sqrt(D).  causal masks key j > i + (S - T); with
 * T > S the first T - S queries see no key and their output is 0. */
epj_tensor *epj_sdpa(epj_ctx *ctx, epj_tensor *q, epj_tensor *k, epj_tensor *v,
		     bool causal, double scale);
/* epj_sdpa over documents packed in a row: doc_ids [B, S] (i32 or i64,
 * T == S) gives each position's document; key j is also hidden from query
 * i when doc_ids[b, j] != doc_ids[b, i] (Megatron's reset_attention_mask).
 * The ids are an input (data), not an attribute: a compiled graph serves
 * any boundaries.  doc_ids NULL: epj_sdpa. */
epj_tensor *epj_sdpa_docs(epj_ctx *ctx, epj_tensor *q, epj_tensor *k,
			  epj_tensor *v, epj_tensor *doc_ids, bool causal,
			  double scale);
/* The gated delta rule of Gated DeltaNet: q, k [B, T, H, Dk], v [B, T, H,
 * Dv], g (log decay), beta [B, T, H] -> o [B, T, H, Dv], per (b, h) a state
 * S [Dk, Dv] from zero: S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T;
 * o_t = S^T q_t (lib/ops_delta.c).  Differentiable in every input. */
epj_tensor *epj_gated_delta(epj_ctx *ctx, epj_tensor *q, epj_tensor *k,
			    epj_tensor *v, epj_tensor *g, epj_tensor *beta);
/* X with A X = B for a triangular A [..., n, n] and B [..., n, k], batch
 * dims broadcast (torch.linalg.solve_triangular): only A's upper (upper) or
 * lower triangle is read, its diagonal taken as 1 when unitriangular.  f32,
 * bf16 (solved in f32, rounded once) and f64; differentiable in A (within
 * its triangle) and B.  left must be true (X A = B is not implemented: an
 * EPJ_ERR_UNSUPPORTED error). */
epj_tensor *epj_solve_triangular(epj_ctx *ctx, epj_tensor *a, epj_tensor *b,
				 bool upper, bool unitriangular, bool left);
/* Mean cross-entropy of logits [N, V] against targets [N] (i32/i64),
 * skipping targets equal to ignore_index.  Result shape [] in f32 (f64 for
 * f64 logits).  All ignored -> NaN, as in PyTorch. */
epj_tensor *epj_cross_entropy(epj_ctx *ctx, epj_tensor *logits,
			      epj_tensor *targets, int64_t ignore_index);

/* ---- graphs from other frameworks (jit/graph_api.c) --------------------
 * A graph described node by node (the Python package lowers PyTorch's FX
 * graphs of ATen ops to it; doc/torch.md) and compiled by the same tracer,
 * passes, code generators, kernel cache and signatures as a native region.
 * Values are numbered in order of definition: inputs first (0, 1, ...), then
 * each node's outputs, consecutively.  Graphs are forward-only: traced and
 * run with gradient mode off.  Every tensor is an input (weights included),
 * so graphs of identical layers share one compiled graph. */

typedef struct epj_compiler epj_compiler;
typedef struct epj_graph epj_graph;

/* A compiler: a cache of compiled graphs by signature and a backend
 * ("c", "interpreter", "nvrtc", ...; NULL or "" = the device's default;
 * an unknown name is EPJ_ERR_CONFIG). */
epj_status epj_compiler_new(epj_ctx *ctx, const char *backend,
			    epj_compiler **out);
void epj_compiler_free(epj_compiler *c);

epj_status epj_graph_new(epj_ctx *ctx, epj_graph **out);
void epj_graph_free(epj_graph *g);
/* Declares the next input (all inputs before the first node); *value gets
 * its value number. */
epj_status epj_graph_input(epj_ctx *ctx, epj_graph *g, epj_dtype dt, int ndim,
			   const int64_t *shape, int *value);
/* Appends a node: op by its name in the op table (lib/ops.def: "add",
 * "matmul", "sdpa", ...), in[n_in] earlier values, the int and float
 * attributes in the op's layout (normalised: axes >= 0, shapes without
 * -1), n_out = the op's outputs.  *first_value: the value of output 0.
 * An unknown op, a wrong count or an undefined value is an error naming the
 * node; shapes are checked when the graph is compiled. */
epj_status epj_graph_node(epj_ctx *ctx, epj_graph *g, const char *op,
			  const int *in, int n_in, const int64_t *ints,
			  int n_ints, const double *floats, int n_floats,
			  int n_out, int *first_value);
/* Appends `value` to the graph's outputs. */
epj_status epj_graph_output(epj_ctx *ctx, epj_graph *g, int value);
int epj_graph_n_outputs(const epj_graph *g);
/* Traces and compiles g through c (its cache of graphs by signature).  A
 * shape or dtype error names the node and its op. */
epj_status epj_graph_compile(epj_ctx *ctx, epj_compiler *c, epj_graph *g);
/* Runs a compiled graph on in[n_in] (e.g. epj_tensor_borrow of the
 * caller's memory, with the dtypes and shapes declared; else
 * EPJ_ERR_SHAPE); out[n_out] receive new references (library memory). */
epj_status epj_graph_run(epj_ctx *ctx, epj_graph *g, epj_tensor *const *in,
			 int n_in, epj_tensor **out, int n_out);
/* epj_graph_run on the caller's memory in one call, for bindings where a
 * call costs (Python): in_data[n_in] are the inputs' addresses (device
 * pointers on cuda), dense row-major in the dtypes and shapes the graph
 * declared, borrowed for the run (NULL only for an input without
 * elements).  out[n_out] as epj_graph_run.  With desc (n_out rows of
 * EPJ_GRAPH_DESC int64): per output [0] the address of element 0 (0 when
 * it has no storage), [1] its dtype, [2] its rank, [3] the input whose
 * memory it views (its storage is that input's; -1: memory of its own),
 * [4 + d] its shape, [4 + EPJ_MAX_DIMS + d] its strides (elements). */
#define EPJ_GRAPH_DESC (4 + 2 * EPJ_MAX_DIMS)
epj_status epj_graph_run_data(epj_ctx *ctx, epj_graph *g, void *const *in_data,
			      int n_in, epj_tensor **out, int n_out,
			      int64_t *desc);
/* With EPJIT_DEBUG_DUMP set, writes the context's counters to
 * $EPJIT_DEBUG_DUMP/counters.json (else does nothing). */
epj_status epj_debug_dump(epj_ctx *ctx);

/* ---- counters ------------------------------------------------------------ */

/* Adds delta to the named counter of the context (created at 0). */
void epj_counter_add(epj_ctx *ctx, const char *name, int64_t delta);
/* Sets a gauge-like counter. */
void epj_counter_set(epj_ctx *ctx, const char *name, int64_t value);
int64_t epj_counter_get(const epj_ctx *ctx, const char *name);
/* Snapshot of all counters (plus memory.* from the allocator). */
epj_counters *epj_counters_snapshot(epj_ctx *ctx);
/* b - a for every name in either (missing = 0). */
epj_counters *epj_counters_diff(const epj_counters *a, const epj_counters *b);
int64_t epj_counters_value(const epj_counters *c, const char *name);
int epj_counters_count(const epj_counters *c);
const char *epj_counters_name_at(const epj_counters *c, int i);
int64_t epj_counters_value_at(const epj_counters *c, int i);
/* JSON object {"name": value, ...}, sorted by name; caller frees with free().
 */
char *epj_counters_to_json(const epj_counters *c);
/* Parses what epj_counters_to_json wrote. */
epj_counters *epj_counters_from_json(const char *json);
void epj_counters_free(epj_counters *c);

/* ---- hashing ---------------------------------------------------------------
 */

typedef struct epj_hash128 {
	uint64_t lo, hi;
} epj_hash128;

/* XXH3-128 of a buffer (seed 0). */
epj_hash128 epj_hash(const void *data, size_t len);
/* 32 lowercase hex digits + NUL into out[33]. */
void epj_hash_hex(epj_hash128 h, char out[33]);

/* ---- models ----------------------------------------------------------------
 * A Qwen3-MoE causal LM built from an HF-style config.json.  Parameters are
 * created in f32 (the engine converts them to bf16 when bf16.enabled) and
 * carry HF names ("model.layers.0.mlp.gate.weight"). */

typedef struct epj_model epj_model;

typedef enum epj_layout {
	EPJ_LAYOUT_NESTED = 0, /* model.layers.N.mlp is the AutoEP layer */
	EPJ_LAYOUT_ROOT	       /* one block; the root owns the AutoEP `mlp` */
} epj_layout;

typedef struct epj_model_opts {
	epj_layout layout;
	uint64_t seed; /* parameter init (HF: normal(0, initializer_range)) */
	bool fixed_routing; /* deterministic balanced expert assignment */
	epj_dtype dtype;    /* parameter dtype at creation (f32 default) */
	/* "KEY=VALUE" edits of the config.json, applied in order before it
	 * is checked (HF's config kwargs): VALUE is read as a JSON scalar
	 * (integer, real, true/false, null, "string"), else as a plain
	 * string; KEY must be one of the file's keys or one the model reads
	 * (an error names it and the nearest such key).  Needs a config
	 * path. */
	const char *const *config_overrides;
	int n_config_overrides;
} epj_model_opts;

/* Builds from config.json at path (NULL: the built-in tiny model). */
epj_status epj_model_new(epj_ctx *ctx, const char *config_path,
			 const epj_model_opts *opts, epj_model **out);
void epj_model_free(epj_model *m);
/* Root of the module tree (borrowed). */
epj_module *epj_model_root(epj_model *m);
/* Forward: input_ids [B, T] (i32/i64) -> logits [B, T, V] (may pass NULL
 * to skip) and, when labels [B, T] is given (-100 = ignored), the mean
 * cross-entropy loss [] f32 (else *loss = NULL).  New references. */
epj_status epj_model_forward(epj_ctx *ctx, epj_model *m, epj_tensor *input_ids,
			     epj_tensor *labels, epj_tensor **logits,
			     epj_tensor **loss);
/* Forward over documents packed in each row (Megatron's
 * reset_position_ids and reset_attention_mask; epj_batch_documents makes
 * both from the end-of-document tokens): position_ids [B, T] (i64, each in
 * [0, T)) pick the rows of the rope tables instead of 0..T-1, and doc_ids
 * [B, T] (i32/i64) hide every other document from a token's attention.
 * Either may be NULL; with either, labels are required.  Both are inputs
 * (data) of the forward: a compiled region serves any boundaries.  In a
 * linear-attention (Gated DeltaNet) layer a document is a run of equal
 * doc_ids: its recurrent state and conv window start from zero where the
 * id changes. */
epj_status epj_model_forward_docs(epj_ctx *ctx, epj_model *m,
				  epj_tensor *input_ids, epj_tensor *labels,
				  epj_tensor *position_ids, epj_tensor *doc_ids,
				  epj_tensor **logits, epj_tensor **loss);
/* Parameters in model order with HF names (borrowed; valid while m lives). */
int epj_model_num_params(const epj_model *m);
const char *epj_model_param_name(const epj_model *m, int i);
epj_tensor *epj_model_param(const epj_model *m, int i);
/* Replaces parameter i (takes a new reference to t; same shape). */
epj_status epj_model_set_param(epj_ctx *ctx, epj_model *m, int i,
			       epj_tensor *t);
int64_t epj_model_num_elements(const epj_model *m);
int epj_model_vocab_size(const epj_model *m);
/* Switches activation checkpointing on or off for every decoder block (the
 * root in the root layout). */
void epj_model_set_checkpointing(epj_model *m, bool on);

/* Module tree walking. */
const char *epj_module_name(const epj_module *m); /* "" for the root */
const char *epj_module_kind(const epj_module *m);
int epj_module_num_children(const epj_module *m);
epj_module *epj_module_child_at(const epj_module *m, int i);
/* Module by dotted name ("" = root), NULL if absent. */
epj_module *epj_module_find(epj_module *root, const char *name);
bool epj_module_has_forward(const epj_module *m);
bool epj_module_compiler_disabled(const epj_module *m);
void epj_module_set_checkpoint(epj_module *m, bool on);
/* The last forward's expert assignment of an AutoEP module ([N, k] i64,
 * borrowed), NULL for other modules or before the first call. */
epj_tensor *epj_module_routing(const epj_module *m);

/* ---- training config
 * ---------------------------------------------------------
 * A DeepSpeed-style training config (ds.json, doc/config.md), parsed and
 * checked once: unknown keys, wrong types and out-of-range values are
 * EPJ_ERR_CONFIG naming the key and what it takes ("config error in
 * SOURCE: ..."; every error of the file is reported).  The object is a
 * plain value once made: read it from any thread, hand it to any number
 * of engines (epj_engine_new copies it), free it when done.  Values are
 * read by the key's dotted path ("seed", "bf16.enabled",
 * "compile.backend"), so a key added to the config is readable with no
 * new function. */

typedef struct epj_config epj_config;

/* Parses json (NULL: "{}", all defaults); source names it in messages
 * (NULL: "<string>").  A value "auto" takes the value at the same dotted
 * path of auto_json, a JSON object of the caller's own settings (a
 * trainer's flags and defaults); auto_json NULL, or a path it lacks: the
 * library's rule (doc/config.md, the "auto" column).  *out is NULL on
 * failure. */
epj_status epj_config_parse(epj_ctx *ctx, const char *json, const char *source,
			    const char *auto_json, epj_config **out);
/* As epj_config_parse on the file at path (NULL: all defaults); an
 * unreadable file is EPJ_ERR_IO naming it. */
epj_status epj_config_load(epj_ctx *ctx, const char *path,
			   const char *auto_json, epj_config **out);
void epj_config_free(epj_config *c);
/* The source name of its messages (the path, or epj_config_parse's). */
const char *epj_config_source(const epj_config *c);
/* The value of key (a dotted path) as the config holds it: the file's
 * value, "auto" resolved, else the default (doc/config.md).
 *  - _int: an integer key;
 *  - _real: a number or an integer key (a null number reads as 0);
 *  - _bool: a boolean key;
 *  - _str: a string or choice key ("" when absent and not defaulted), or
 *    a true/false/null key as "true", "false" or "null"; *out lives as
 *    long as c.
 * A path that is no key, a section, a key that is accepted and not kept
 * (no effect in epjit) or a key of another type is EPJ_ERR_INVALID, the
 * message (in ctx, which may be NULL) naming the key, what it holds and,
 * for a likely typo, the nearest key; *out is then unchanged.
 * Batch sizes are as given (0 when not): the engine resolves them for its
 * world size (epj_engine_micro_batch_size, epj_engine_grad_accum_steps). */
epj_status epj_config_int(epj_ctx *ctx, const epj_config *c, const char *key,
			  int64_t *out);
epj_status epj_config_real(epj_ctx *ctx, const epj_config *c, const char *key,
			   double *out);
epj_status epj_config_bool(epj_ctx *ctx, const epj_config *c, const char *key,
			   bool *out);
epj_status epj_config_str(epj_ctx *ctx, const epj_config *c, const char *key,
			  const char **out);
/* Whether the config's text sets key (a dotted path) to a value other
 * than null ("auto" included); false for any other path. */
bool epj_config_given(const epj_config *c, const char *key);
/* The effective config as JSON text that epj_config_parse reads back to
 * the same values; malloc'ed (free()), NULL when out of memory. */
char *epj_config_to_json(const epj_config *c);

/* ---- engine
 * ------------------------------------------------------------------
 * DeepSpeed-style training engine over a model (borrowed: the model must
 * outlive the engine).  The config is DeepSpeed JSON (doc/config.md). */

typedef struct epj_engine epj_engine;

typedef struct epj_step_info {
	double loss;	  /* this micro-batch's loss */
	double mean_loss; /* mean over the micro-batches of the current step
			     (per-token: over their counted tokens) */
	bool stepped;	  /* an optimizer step ended this micro-batch */
	int64_t step;	  /* optimizer steps taken */
	int64_t micro_step;
	double lr;	  /* lr of the last optimizer step */
	double grad_norm; /* global grad norm before clipping (last step) */
	bool skipped; /* that step had a non-finite loss or gradient norm and
			 was skipped (config "skip_nonfinite_steps") */
} epj_step_info;

/* The engine of model under cfg (copied: cfg may be freed after).  The
 * config is read here and nowhere else; the epj_engine_initialize*
 * functions below are epj_config_load / _parse, then this. */
epj_status epj_engine_new(epj_ctx *ctx, epj_model *model, const epj_config *cfg,
			  epj_engine **out);
/* ds_config_path NULL: all defaults. */
epj_status epj_engine_initialize(epj_ctx *ctx, epj_model *model,
				 const char *ds_config_path, epj_engine **out);
epj_status epj_engine_initialize_json(epj_ctx *ctx, epj_model *model,
				      const char *json, const char *source,
				      epj_engine **out);
/* As epj_engine_initialize, where a value "auto" in the config takes the
 * value at the same key path of auto_json, a JSON object of the caller's
 * own settings (a trainer's flags and defaults: epjit-train passes its
 * built-in run's); auto_json NULL, or a path it lacks: the library's rule
 * (doc/config.md, the "auto" column).  ds_config_path NULL: all defaults. */
epj_status epj_engine_initialize_auto(epj_ctx *ctx, epj_model *model,
				      const char *ds_config_path,
				      const char *auto_json, epj_engine **out);
void epj_engine_free(epj_engine *e);
/* One micro-batch (ids, labels [B, T]); an optimizer step every
 * gradient_accumulation_steps micro-batches. */
epj_status epj_engine_train_step(epj_engine *e, epj_tensor *input_ids,
				 epj_tensor *labels, epj_step_info *info);
epj_status epj_engine_eval(epj_engine *e, epj_tensor *input_ids,
			   epj_tensor *labels, double *loss);
/* epj_engine_eval, and with per_token_loss the labels that count (else 0):
 * an evaluation over several batches is sum(loss * tokens) / sum(tokens). */
epj_status epj_engine_eval_tokens(epj_engine *e, epj_tensor *input_ids,
				  epj_tensor *labels, double *loss,
				  int64_t *tokens);

/* What a batch becomes before the model sees it (runtime/batch.c; the
 * config's data section, doc/trainer.md): documents packed in a row, each
 * ended by the end-of-document token, as Megatron's
 * get_ltor_masks_and_position_ids reads them, and the loss normalisation. */
typedef struct epj_batch_opts {
	/* documents do not see each other (document ids to attention) */
	bool reset_attention_mask;
	/* positions restart at 0 after every end-of-document token */
	bool reset_position_ids;
	/* the loss where the input token is the end of a document (the
	 * first token of the next one as target) is not counted */
	bool eod_mask_loss;
	int64_t eod_token; /* the end-of-document id; -1: none */
	/* a step's loss is the sum of its counted token losses over every
	 * micro-batch and rank divided by their number (Megatron's
	 * calculate_per_token_loss), not the mean of micro-batch means; on
	 * whenever eod_mask_loss is */
	bool per_token_loss;
} epj_batch_opts;

/* Megatron's get_ltor_masks_and_position_ids on input_ids [B, T]: with
 * o->reset_position_ids, *position_ids [B, T] i64 (t minus the start of
 * t's document), else NULL; with o->reset_attention_mask, *doc_ids [B, T]
 * i64 (the end-of-document tokens before t in its row), else NULL;
 * *labels_out: labels with -100 where input_ids is the end-of-document
 * token when o->eod_mask_loss, else a new reference to labels (NULL
 * without labels).  New references on input_ids' context. */
epj_status epj_batch_documents(epj_ctx *ctx, epj_tensor *input_ids,
			       epj_tensor *labels, const epj_batch_opts *o,
			       epj_tensor **position_ids, epj_tensor **doc_ids,
			       epj_tensor **labels_out);
/* The engine's batch options (from its config's data section, or as set). */
void epj_engine_batch_opts(const epj_engine *e, epj_batch_opts *o);
/* Sets them (per_token_loss forced on by eod_mask_loss), checked against
 * the model (an eod_token in its vocabulary); a change after the first train
 * step, or of reset_attention_mask or reset_position_ids after
 * epj_engine_compile, is EPJ_ERR_STATE. */
epj_status epj_engine_set_batch_opts(epj_engine *e, const epj_batch_opts *o);
/* One forward as a train step makes it (the batch options applied), with
 * the mean loss over the labels that count; logits and loss as
 * epj_model_forward.  Gradients are on when the context's are. */
epj_status epj_engine_forward(epj_engine *e, epj_tensor *input_ids,
			      epj_tensor *labels, epj_tensor **logits,
			      epj_tensor **loss);
/* Training checkpoint (atomic): FP32 masters under HF names + optimizer
 * state + progress.  load also accepts a plain HF safetensors file.  With
 * several ranks save is collective and writes one generation of a
 * checkpoint set (doc/ckpt.md); a background save in flight is committed
 * first (epj_engine_save_finish). */
epj_status epj_engine_save(epj_engine *e, const char *path);
epj_status epj_engine_load(epj_engine *e, const char *path);
/* The router losses that are on (transformers' auxiliary loss of the
 * model's config.json, Megatron's of the config's moe section; doc/
 * trainer.md, "Router losses"): the i-th one's metric name ("aux_loss",
 * "load_balancing_loss", "seq_load_balancing_loss",
 * "global_load_balancing_loss", "z_loss") and its value at the last
 * optimizer step (without its coefficient; the mean over the step's
 * micro-batches, and over the ranks except the global aux loss, summed as
 * Megatron logs it); false past the last (and without MoE layers). */
bool epj_engine_router_loss(const epj_engine *e, int i, const char **name,
			    double *value);
/* The committed generations of a checkpoint set that a save keeps (>= 1,
 * default 1: the newest only); each kept generation's record is also
 * written as PATH.g<G>.record, which loads like PATH.  A world of one
 * saves one file: keep > 1 is EPJ_ERR_UNSUPPORTED there. */
epj_status epj_engine_set_save_keep(epj_engine *e, int keep);
/* A background save of e's state to path (collective, between optimizer
 * steps): a save in flight is finished first (at most one in flight);
 * then every tensor of the checkpoint is copied to host memory (pinned on
 * the cuda device), the ranks agree the copies succeeded, and a writer
 * thread writes this rank's file (fsynced, renamed, checksummed) while
 * training goes on.  The writer never communicates: the commit is
 * epj_engine_save_finish's. */
epj_status epj_engine_save_async(epj_engine *e, const char *path);
/* This rank's background save (no communication): EPJ_SAVE_NONE, or
 * EPJ_SAVE_WRITING while its writer works, EPJ_SAVE_WRITTEN once the
 * writer is done (its file written, or its error kept) and the save
 * waits for epj_engine_save_finish. */
typedef enum epj_save_state {
	EPJ_SAVE_NONE = 0,
	EPJ_SAVE_WRITING,
	EPJ_SAVE_WRITTEN
} epj_save_state;
epj_save_state epj_engine_save_pending(const epj_engine *e);
/* Ends the background save (collective; EPJ_OK at once when there is
 * none): waits for this rank's writer, then -- several ranks -- rank 0
 * commits the record when every rank's file is written, the ranks agree
 * on the outcome, and the oldest generation no longer kept is removed.
 * Calling it once no rank's save is EPJ_SAVE_WRITING costs no wait.  The
 * save's error (a writer's, on any rank) is returned on every rank;
 * *step is the step saved (-1 when there was no save or it failed). */
epj_status epj_engine_save_finish(epj_engine *e, int64_t *step);
/* The config's checkpoint.writer.decoupled (DeepSpeed's decoupled
 * checkpoint engine): epjit-train's periodic saves run in the background
 * when it is true. */
bool epj_engine_save_decoupled(const epj_engine *e);
int64_t epj_engine_micro_batch_size(const epj_engine *e);
int64_t epj_engine_grad_accum_steps(const epj_engine *e);
int64_t epj_engine_steps_per_print(const epj_engine *e);
int64_t epj_engine_seed(const epj_engine *e);
/* The config's "device" ("cpu", "cuda-sim", "cuda"), "" when it names none (the
 * caller's choice, e.g. EPJIT_DEVICE, stands).  Never NULL. */
const char *epj_engine_device(const epj_engine *e);
int64_t epj_engine_step_count(const epj_engine *e);
/* Micro-batches this rank has trained since the start (a checkpoint's
 * "micro_step"; restored by epj_engine_load). */
int64_t epj_engine_micro_step_count(const epj_engine *e);
bool epj_engine_bf16(const epj_engine *e);
/* The config's ZeRO stage (zero_optimization.stage) and expert-parallel
 * size (expert_parallel.autoep_size; 1 without expert parallelism). */
int epj_engine_zero_stage(const epj_engine *e);
int epj_engine_ep_size(const epj_engine *e);
/* The i-th key (from 0) whose value was "auto" in the config, as a dotted
 * path in key (capacity kn), and the value it resolved to as JSON text in
 * val (capacity vn; e.g. "8", "0.003", "[0.9,0.95]", "false"; "?" when it
 * cannot be written).  False when the config has fewer than i + 1 "auto"
 * values. */
bool epj_engine_auto_value(const epj_engine *e, int i, char *key, size_t kn,
			   char *val, size_t vn);
/* The config's csv_monitor (DeepSpeed's monitor section): true when it is
 * enabled, with dir (capacity n) the folder of its CSV files,
 * output_path/job_name, or job_name alone when output_path is empty. */
bool epj_engine_csv_monitor_dir(const epj_engine *e, char *dir, size_t n);
/* The config's tensorboard section, the same way: true when it is enabled,
 * with dir (capacity n) the folder of its event files. */
bool epj_engine_tensorboard_dir(const epj_engine *e, char *dir, size_t n);
/* The config's "data" section (an epjit extension, read by epjit-train):
 * "path" and "split", NULL when absent or empty; true with *seed when
 * "seed" is given. */
const char *epj_engine_data_path(const epj_engine *e);
const char *epj_engine_data_split(const epj_engine *e);
bool epj_engine_data_seed(const epj_engine *e, uint64_t *seed);
epj_model *epj_engine_model(epj_engine *e);

/* Expert load of one MoE layer over an optimizer step (doc/trainer.md,
 * "Expert load"): load_e is the number of (token, expert) assignments to
 * expert e by the step's training forwards on every rank -- every
 * micro-batch, padding included, checkpoint replays excluded -- so a token
 * routed to k experts counts k times and the loads sum to tokens x k. */
typedef struct epj_expert_load {
	int layer;	      /* the decoder layer (model.layers.N); the root
				 layout's: its index among the MoE layers */
	int num_experts;      /* E */
	int64_t total;	      /* sum of the loads */
	double max_over_mean; /* max_e load_e / (total / E); 1: balanced */
	double cv;	      /* population std of the loads / their mean */
	int dead;	      /* experts with load 0 */
} epj_expert_load;
/* Turns the expert-load metrics on or off (off by default).  On, every
 * optimizer step ends with one all-reduce of every layer's loads over the
 * ranks, so every rank must turn them on or off between the same steps. */
void epj_engine_track_expert_load(epj_engine *e, bool on);
int epj_engine_num_moe_layers(const epj_engine *e);
/* MoE layer i's loads over the last optimizer step taken while on; false
 * before such a step (then only layer and num_experts are filled, the
 * ratios NaN) or for i out of range (nothing filled). */
bool epj_engine_expert_load(const epj_engine *e, int i, epj_expert_load *out);

/* The user's engine.compile().  With "compile": {"autoep_non_moe": true}:
 * regional compilation of every callable direct parent of an AutoEP layer
 * (each AutoEP call stays an eager graph break); otherwise full-model
 * compilation (the root forward, with a graph break at every AutoEP layer).
 * Validation fails fast and changes nothing; a failure part-way restores
 * every region (rollback).  Calling it again in the same mode does nothing.
 * Graphs are traced at their first call and cached by signature. */
epj_status epj_engine_compile(epj_engine *e);
/* After epj_engine_compile: traces and compiles every region now, at the
 * shape the training steps will call it with (the config's micro-batch x
 * seq_len tokens): the training forward and backward (with activation
 * checkpointing, the no-grad forward and the replay) and the evaluation
 * forward.  The first step then compiles nothing, and the time goes to
 * this call; with a kernel cache filled by epjit-warmup nothing is built,
 * only the graph passes run and the cached artifacts are loaded.
 * *n_variants (may be NULL) is the number of variants compiled.  A later
 * call at another shape still compiles at its first step (guards). */
epj_status epj_engine_precompile(epj_engine *e, int64_t seq_len,
				 int *n_variants);
/* Compiles (as epj_engine_compile), traces every region at the shape of
 * (input_ids, labels) by one forward and backward on the CPU (gradients
 * dropped, no optimizer step), and writes the CUDA C translation unit of
 * every compiled graph to dir (*.cu, with the NVRTC options in *.opts; dir
 * may be NULL).  With nvrtc_check every unit is compiled under NVRTC for
 * each arch of EPJIT_CUDA_ARCH (default sm_80,sm_90) and an error or warning
 * fails the call (EPJ_ERR_UNSUPPORTED when built without NVRTC). */
epj_status epj_engine_emit_cuda(epj_engine *e, epj_tensor *input_ids,
				epj_tensor *labels, const char *dir,
				bool nvrtc_check, int *n_units);
/* "none", "autoep_non_moe" or "model". */
const char *epj_engine_compile_mode(const epj_engine *e);
/* Number of compiled regions (0 before compile). */
int epj_engine_num_regions(const epj_engine *e);
const char *epj_engine_region_name(const epj_engine *e, int i);
/* What region i has run since compile: the proof that a compiled arm ran
 * compiled code.  compiled_calls counts calls that ran a compiled variant
 * (their compiled kernel launches, also in kernels.launched.compiled, are
 * compiled_launches); eager_calls counts calls run by the original forward
 * because the recompile limit was reached.  name is owned by the engine. */
typedef struct epj_region_stats {
	const char *name;
	int variants;
	int64_t compiled_calls, eager_calls, compiled_launches;
} epj_region_stats;
/* EPJ_ERR_INVALID (message in the engine's context) for i out of range. */
epj_status epj_engine_region_stats(const epj_engine *e, int i,
				   epj_region_stats *out);

/* ---- parity harness
 * ----------------------------------------------------------- Eager vs compiled
 * on the same weights for one epj_engine_train_step on a batch other than the
 * warm-up's: outputs, loss, input (embedding) gradients, router / expert /
 * dense gradients and the FP32 master update of one SGD step with lr 1.0,
 * per quantity and per parameter (doc/testing.md has the tolerances), the
 * exact routing of every AutoEP call (replays included), eager AutoEP call
 * counts of both arms and zero compile-counter change after the warm-up. */

typedef struct epj_parity_opts {
	const char *model_config; /* NULL: the built-in tiny model */
	epj_layout layout;
	bool checkpointing;
	bool bf16;
	bool regional; /* compile.autoep_non_moe (else full-model) */
	bool async_split_plan;
	const char *backend; /* compile.backend, NULL = default */
	int64_t batch, seq;  /* <= 0: 2 x 16 */
	uint64_t seed;
	/* the config's "moe" section (Megatron's router losses) as a JSON
	 * object, e.g. "{\"z_loss_coeff\": 0.01}"; NULL: none */
	const char *moe_json;
} epj_parity_opts;

/* Prints a table to out (may be NULL); *passed tells the verdict.  Returns
 * an error status only when an arm could not run at all. */
epj_status epj_parity_run(const epj_parity_opts *opts, FILE *out, bool *passed);

/* ---- safetensors ----------------------------------------------------------
 */
/* (block owned by lib/safetensors.c)
 *
 * Hugging Face safetensors files (doc/formats.md): u64 little-endian header
 * length N, N bytes of JSON, then the data buffer.  Reading validates the
 * whole header and the file size up front (EPJ_ERR_FORMAT / EPJ_ERR_IO with
 * the file's path in the message); files that HF's reader accepts open here.
 * Writing produces the bytes HF's serializer produces for the same tensors
 * (data ordered by dtype alignment then name, header padded to 8 bytes). */

typedef struct epj_st_file epj_st_file;

/* Opens and validates `path`; *out owns the handle (epj_st_close).  The file
 * stays open; tensors are read on demand by epj_st_get. */
epj_status epj_st_open(epj_ctx *ctx, const char *path, epj_st_file **out);
void epj_st_close(epj_st_file *f); /* NULL ok */

/* Tensors in ascending byte order of their names, i in [0, count). */
int epj_st_count(const epj_st_file *f);
const char *epj_st_name_at(const epj_st_file *f, int i);
/* Index of `name`, or -1. */
int epj_st_find(const epj_st_file *f, const char *name);
/* The file's dtype string ("F32", "F16", ...) of tensor i. */
const char *epj_st_dtype_str_at(const epj_st_file *f, int i);
/* epjit dtype of tensor i, EPJ_DTYPE_COUNT when the file's dtype has no
 * epjit equivalent (F16, U8, ...: listed, but epj_st_get refuses them). */
epj_dtype epj_st_dtype_at(const epj_st_file *f, int i);
int epj_st_ndim_at(const epj_st_file *f, int i);
const int64_t *epj_st_shape_at(const epj_st_file *f, int i);

/* New contiguous tensor on ctx's device with the file's dtype and shape;
 * NULL with an error naming the file and tensor when it is missing, its
 * dtype or rank is unsupported or the read fails. */
epj_tensor *epj_st_get(epj_ctx *ctx, epj_st_file *f, const char *name);

/* "__metadata__" entries (string -> string), keys in ascending order.
 * epj_st_metadata returns NULL for a missing key.  Strings are owned by f. */
const char *epj_st_metadata(const epj_st_file *f, const char *key);
int epj_st_metadata_count(const epj_st_file *f);
const char *epj_st_metadata_key_at(const epj_st_file *f, int i);

typedef struct epj_st_writer epj_st_writer;

/* A writer collecting tensors and metadata; errors go to ctx. */
epj_status epj_st_writer_new(epj_ctx *ctx, epj_st_writer **out);
void epj_st_writer_free(epj_st_writer *w); /* releases its tensor refs */
/* Adds `t` under `name` (takes a new reference; the caller keeps its own).
 * Any strides; stored contiguous.  Fails on a duplicate name,
 * "__metadata__", a name that is not UTF-8, a symbolic tensor.  A NULL t
 * returns the context's pending error status (or EPJ_ERR_INVALID). */
epj_status epj_st_writer_add(epj_st_writer *w, const char *name, epj_tensor *t);
/* Sets (or replaces) a metadata entry; both strings are copied. */
epj_status epj_st_writer_set_metadata(epj_st_writer *w, const char *key,
				      const char *value);
/* Writes the file atomically: "<path>.tmp.<pid>", fflush, fsync, rename over
 * path, fsync of the directory.  On failure the temporary file is removed
 * and a file already at path is left untouched.  The writer stays usable. */
epj_status epj_st_writer_save(epj_st_writer *w, const char *path);

/* ---- data: synthetic corpus and token files ---------------------------------
 */
/* (block owned by runtime/data.c)
 *
 * Token files (doc/formats.md): a 32-byte header ("EPJTOK\0\0", u32
 * version 1, u32 dtype 1 = uint16 / 2 = uint32, u64 count, u32 vocab_size or
 * 0, u32 reserved 0) and `count` little-endian tokens.  A corpus is an
 * endless token stream cut into training batches: either a synthetic Markov
 * source whose entropy rate (the loss floor, nats/token) is known, or a
 * token file read in sequential, wrapping windows.  Everything is
 * deterministic given the seed and independent of the thread count. */

typedef struct epj_tokens {
	uint64_t count;
	uint32_t vocab_size; /* 0 = unknown */
	uint32_t *data;	     /* count tokens, owned */
} epj_tokens;

/* Writes tokens[count] atomically (as epj_st_writer_save) as uint16 (u16:
 * every token must be < 65536) or uint32.  vocab_size 0 = unknown; else
 * every token must be < vocab_size. */
epj_status epj_tokens_write(epj_ctx *ctx, const char *path,
			    const uint32_t *tokens, uint64_t count,
			    uint32_t vocab_size, bool u16);
/* Reads and validates a token file (magic, version, dtype, reserved, size
 * against count, tokens < vocab_size).  *out owns the result. */
epj_status epj_tokens_read(epj_ctx *ctx, const char *path, epj_tokens **out);
void epj_tokens_free(epj_tokens *t); /* NULL ok */
/* Byte-level tokenizer: every byte of text_path is one token; writes a
 * uint16 token file with vocab_size 256 to out_path. */
epj_status epj_tokens_from_text(epj_ctx *ctx, const char *text_path,
				const char *out_path);

typedef struct epj_corpus epj_corpus;

/* Synthetic source over `vocab` (2 .. 2^20) tokens: a random sparse
 * first-order Markov chain fixed by `seed` (each state has a few successors
 * with skewed probabilities, plus a small uniform smoothing), started from
 * its stationary distribution so that every position has the same
 * statistics.  NULL with an error on a bad vocab. */
epj_corpus *epj_corpus_synthetic(epj_ctx *ctx, uint32_t vocab, uint64_t seed);
/* Corpus over a token file (read into memory; >= 2 tokens). */
epj_corpus *epj_corpus_from_tokens(epj_ctx *ctx, const char *path);
/* Same source, a separate stream (for evaluation): a synthetic corpus draws
 * an independent sample path selected by `stream` (equal streams give equal
 * paths; the original corpus is stream 0); a file corpus restarts at token
 * 0; a token dataset's streams 0, 1 and 2 read its train, validation and
 * test splits from their start (other streams are refused).  Independent of
 * how far c has been read. */
epj_corpus *epj_corpus_fork(epj_ctx *ctx, const epj_corpus *c, uint64_t stream);
void epj_corpus_free(epj_corpus *c); /* NULL ok */

uint32_t epj_corpus_vocab(const epj_corpus *c);
/* Entropy rate of the source in nats/token: the lowest mean cross-entropy a
 * model can reach.  NaN when unknown (file corpora). */
double epj_corpus_entropy_rate(const epj_corpus *c);
/* Stationary distribution (vocab doubles, summing to 1) of a synthetic
 * source; NULL for file corpora.  Owned by c. */
const double *epj_corpus_stationary(const epj_corpus *c);

/* Next batch: input_ids and labels, new i64 tensors [B, T] (B, T >= 1).
 * Each row is T + 1 consecutive tokens x[0..T] of the stream: input_ids =
 * x[0..T-1], labels = x[1..T]; the next row starts at x[T], so every
 * transition of the stream is seen exactly once.  On failure both outputs
 * are NULL. */
epj_status epj_corpus_next_batch(epj_ctx *ctx, epj_corpus *c, int64_t B,
				 int64_t T, epj_tensor **input_ids,
				 epj_tensor **labels);
/* Advances the stream as n calls of epj_corpus_next_batch(B, T) would,
 * without building the batches: in constant time for a token file, one
 * chain step per token for the synthetic corpus. */
epj_status epj_corpus_skip(epj_ctx *ctx, epj_corpus *c, int64_t n, int64_t B,
			   int64_t T);

/* ---- token datasets ---------------------------------------------------------
 * (block owned by runtime/dataset.c; doc/formats.md)
 *
 * Token data as pipelines write it, memory-mapped read-only and validated
 * against the file sizes before any token is read: a Megatron-LM indexed
 * dataset (PREFIX.bin + PREFIX.idx, MMIDIDX version 1, integer dtype codes
 * 1-5 and 8) or a numpy .npy file (1-D: one document; 2-D C-order [N, L]:
 * N documents; dtypes <u2 <u4 <i4 <i8). */

typedef struct epj_docs epj_docs;

/* Opens `path`: a .npy file, else the Megatron prefix of path.bin and
 * path.idx.  EPJ_ERR_FORMAT naming the file for anything malformed. */
epj_status epj_docs_open(epj_ctx *ctx, const char *path, epj_docs **out);
void epj_docs_free(epj_docs *d);			/* NULL ok */
uint64_t epj_docs_count(const epj_docs *d);		/* documents */
uint64_t epj_docs_tokens(const epj_docs *d);		/* all tokens */
uint64_t epj_docs_len(const epj_docs *d, uint64_t doc); /* 0 if out of range */
/* Tokens [off, off + n) of document doc as int64 values (as stored, signed
 * dtypes sign-extended); EPJ_ERR_INDEX past the document's end. */
epj_status epj_docs_read(epj_ctx *ctx, const epj_docs *d, uint64_t doc,
			 uint64_t off, uint64_t n, int64_t *out);
/* The loss mask of a Megatron prefix P: the uint8 Megatron dataset
 * P.lossmask (.bin + .idx) when P.lossmask.idx exists, opened with d and
 * checked against it (doc/formats.md).  has: is there one?  read: the
 * values of tokens [off, off + n) of document doc, each 0 or 1 (else
 * EPJ_ERR_FORMAT naming the file); all 1 without a mask. */
bool epj_docs_has_loss_mask(const epj_docs *d);
epj_status epj_docs_read_mask(epj_ctx *ctx, const epj_docs *d, uint64_t doc,
			      uint64_t off, uint64_t n, int64_t *out);

typedef struct epj_data_opts {
	const char *split; /* document split weights "train,valid,test"
			      (Megatron's --split); NULL: "969,30,1" */
	uint64_t seed;	   /* document and sample shuffle */
	uint32_t vocab;	   /* every token must be in [0, vocab); >= 2 */
} epj_data_opts;

/* True when spec names a token dataset: a blend (whitespace in spec), a
 * .npy file, or a prefix whose PREFIX.idx exists. */
bool epj_data_spec_p(const char *spec);
/* Corpus over a token dataset: spec is a Megatron prefix, a .npy file or
 * a blend "W1 P1 W2 P2 ..." of them (Megatron's --data-path form).  Each
 * source's documents are split into contiguous train / validation / test
 * ranges by the weights; every epoch of a split shuffles its document
 * order, packs the documents into one stream (no token inserted between
 * them), cuts it into samples of T + 1 tokens (consecutive samples share
 * one token) and shuffles the samples, all from the seed.  A blend picks
 * the source of each sample by Megatron's greedy rule (the source furthest
 * below its weight's share).  The corpus reads the train split;
 * epj_corpus_fork streams 1 and 2 read validation and test from their
 * start. */
epj_corpus *epj_corpus_dataset(epj_ctx *ctx, const char *spec,
			       const epj_data_opts *o);
/* Tokens of split (0 train, 1 validation, 2 test) of a dataset corpus: the
 * least over the blend's sources; UINT64_MAX for other corpora. */
uint64_t epj_corpus_split_tokens(const epj_corpus *c, int split);
/* Does a source of a dataset corpus have a loss mask (PREFIX.lossmask,
 * doc/formats.md)?  Its batches then label -100 every target whose mask
 * value is 0 (a prompt token of supervised fine-tuning). */
bool epj_corpus_has_loss_mask(const epj_corpus *c);

/* ---- distributed runs -------------------------------------------------------
 * One process per rank, started by an MPI launcher (mpirun, srun).  The
 * process calls epj_dist_init before anything else; it starts MPI when the
 * environment says a launcher started it (OMPI_COMM_WORLD_SIZE, PMI_SIZE or
 * PMIX_RANK) and otherwise leaves a world of one.  Engines then use the
 * world for expert parallelism (expert_parallel.autoep_size), data
 * parallelism and ZeRO.  On failure err (n bytes) holds the message. */
epj_status epj_dist_init(char *err, size_t n);
/* ok: the run succeeded; MPI is finalized.  After a failure (ok false) MPI
 * is left alone -- a peer may wait in a collective -- and the process
 * should exit non-zero: the launcher then ends the other ranks. */
void epj_dist_finalize(bool ok);
int epj_dist_rank(void); /* rank in the world (0 without MPI) */
int epj_dist_size(void); /* ranks in the world (1 without MPI) */
/* The ranks of e's world agree on a set of flags: *any gets the bitwise OR
 * of every rank's `local` (bit k is set when any rank set it).  Collective:
 * every rank calls it at the same point of its run (one all-reduce of 32
 * floats over the world, counted in the comm.* counters, comm.timeout_s
 * like every collective); a world of one returns local and communicates
 * nothing.  epjit-train calls it between optimizer steps so that all ranks
 * stop after the same step when any of them got a stop signal.  On failure
 * the engine's context holds the message and *any is left as it was. */
epj_status epj_dist_any(epj_engine *e, uint32_t local, uint32_t *any);
/* The memory of every rank of e's world (epj_memory_stats of each rank's
 * context): for peak allocated, peak reserved and reserved bytes, the
 * largest over the ranks and the lowest rank that holds it.  Collective
 * like epj_dist_any (one all-gather of 3 int64 per rank over the world,
 * counted as comm.*.dist.memory.bytes); a world of one reports its own
 * statistics, rank 0, and communicates nothing.  epjit-train calls it after
 * every optimizer step: its summary and monitors report these maxima.  On
 * failure the engine's context holds the message and *out is left as it
 * was. */
typedef struct epj_dist_memory {
	uint64_t peak_allocated, peak_reserved, reserved;
	int peak_allocated_rank, peak_reserved_rank, reserved_rank;
} epj_dist_memory;
epj_status epj_dist_memory_max(epj_engine *e, epj_dist_memory *out);

#ifdef __cplusplus
}
#endif
#endif /* EPJIT_H */
