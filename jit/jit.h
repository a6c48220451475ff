/* jit.h -- the region compiler's interface to the runtime.
 *
 * The jit knows ops, not modules.  The runtime hands it:
 *   - a function to trace (the region's original forward) and its inputs,
 *   - a resolver that says which real tensors met during tracing are
 *     parameters (graph inputs bound anew on every call) as opposed to
 *     constants captured by value,
 *   - at run time, a callback that performs a graph break (calls the
 *     compiler_disabled module eagerly).
 * Everything else (IR, graph breaks, joint forward/backward graphs, passes,
 * signatures, the cache of compiled graphs, execution as autograd nodes) is
 * inside jit/.
 *
 *   trace = ej_trace_region(ctx, fn, inputs)       (TRACE mode, graph breaks)
 *   cr    = ej_jit_compile(ctx, jit, trace)        (segments -> compiled)
 *   ej_region_run(ctx, cr, inputs, params, breaks) (eager autograd nodes)
 */
#ifndef EPJIT_JIT_H
#define EPJIT_JIT_H

#include "core_impl.h"

typedef struct ej_jit ej_jit;		  /* per-engine compiler state */
typedef struct ej_trace ej_trace;	  /* one traced region call */
typedef struct ej_region_fn ej_region_fn; /* one compiled region variant */

/* Backends that run compiled graphs: EJ_BACKEND_<KIND> per row of
 * jit/backends.def (the interpreter is 0). */
typedef enum ej_backend_kind {
#define EJ_BACKEND(KIND, sym) EJ_BACKEND_##KIND,
#include "backends.def"
#undef EJ_BACKEND
	EJ_BACKEND_COUNT
} ej_backend_kind;

/* Parses a backend name ("" = the device's default: cuda-sim when
 * EPJIT_DEVICE=cuda-sim, nvrtc when EPJIT_DEVICE=cuda and NVRTC loads,
 * else c; an EPJIT_DEVICE other than cpu, cuda-sim or cuda is
 * EPJ_ERR_CONFIG).  Returns
 * EPJ_ERR_UNSUPPORTED for a known backend this build does not have and
 * EPJ_ERR_CONFIG for an unknown name; msg describes which. */
epj_status ej_backend_parse(const char *name, ej_backend_kind *out, char *msg,
			    size_t msg_len);
const char *ej_backend_name(ej_backend_kind k);
/* The names of all backends, indexed by kind (*n of them): the choices of
 * the config's compile.backend. */
const char *const *ej_backend_names(int *n);
/* The device backend k's artifacts run on ("cuda" for nvrtc), which a
 * compile opens first; NULL: any context's. */
const char *ej_backend_device(ej_backend_kind k);

ej_jit *ej_jit_new(epj_ctx *ctx, ej_backend_kind backend);
void ej_jit_free(ej_jit *jit);
/* The jit behind a public compiler (jit/graph_api.c): epjit-warmup defers
 * its builds and plans their artifacts. */
ej_jit *ej_compiler_jit(epj_compiler *c);

/* ---- tracing --------------------------------------------------------------
 */

/* Says whether a real tensor met while tracing is a parameter: returns its
 * slot (>= 0) in the caller's parameter table, else -1 (a constant). */
typedef int (*ej_param_slot_fn)(void *user, const epj_tensor *t);

/* The traced function: called with symbolic inputs; must return its outputs
 * (symbolic tensors, new references) in out[]. */
typedef epj_status (*ej_traced_fn)(void *user, epj_ctx *ctx,
				   epj_tensor *const *in, int n_in,
				   epj_tensor **out, int n_out);

/* Traces fn on symbolic copies of the real inputs `in` (their shapes,
 * dtypes and requires_grad).  While tracing, runtime code reports graph
 * breaks through ej_trace_break().  On failure nothing is left behind. */
epj_status ej_trace_region(epj_ctx *ctx, ej_jit *jit, ej_traced_fn fn,
			   void *fn_user, epj_tensor *const *in, int n_in,
			   int n_out, ej_param_slot_fn param_slot,
			   void *slot_user, ej_trace **out);
/* Records a graph break: a call of an opaque eager callee (`callee`, e.g. a
 * module) on symbolic inputs.  Its outputs get the meta of input 0 (the
 * AutoEP layer maps [.., H] -> [.., H]); `reason` names the break for the
 * graph_break.<reason> counter.  Outputs are new symbolic references. */
epj_status ej_trace_break(epj_ctx *ctx, void *callee, const char *reason,
			  epj_tensor *const *in, int n_in, epj_tensor **out,
			  int n_out);
/* True while ctx is tracing. */
bool ej_tracing(const epj_ctx *ctx);
void ej_trace_free(ej_trace *t);

/* Stops recording temporarily (for constants computed with real data inside
 * a traced function, e.g. RoPE tables); returns the state for resume. */
const void *ej_trace_pause(epj_ctx *ctx);
void ej_trace_resume(epj_ctx *ctx, const void *state);

/* ---- compile and run -------------------------------------------------------
 */

/* Compiles a trace: splits it at graph breaks, builds each segment's joint
 * forward/backward graph, runs the passes and the backend (through the
 * jit's cache of graphs by signature).  Takes ownership of the trace. */
epj_status ej_jit_compile(epj_ctx *ctx, ej_jit *jit, ej_trace *trace,
			  ej_region_fn **out);
void ej_region_fn_free(ej_region_fn *f);

/* Performs graph break `callee` eagerly on real inputs (runtime supplied). */
typedef epj_status (*ej_break_call_fn)(void *user, epj_ctx *ctx, void *callee,
				       epj_tensor *const *in, int n_in,
				       epj_tensor **out, int n_out);

/* Runs a compiled region: in[] real inputs, params[] the current parameter
 * tensors by slot, outputs as new references.  Each compiled segment is one
 * autograd node (when grad mode is on); breaks call back into the runtime. */
epj_status ej_region_run(epj_ctx *ctx, ej_region_fn *f, epj_tensor *const *in,
			 int n_in, epj_tensor *const *params, int n_params,
			 ej_break_call_fn brk, void *brk_user, epj_tensor **out,
			 int n_out);

/* ---- guards
 * ------------------------------------------------------------------- */

/* A guard is what a compiled variant assumed about its call: input shapes,
 * dtypes, requires_grad, grad mode (train/eval), parameter dtypes and
 * requires_grad. */
bool ej_region_fn_guard_ok(const ej_region_fn *f, const epj_ctx *ctx,
			   epj_tensor *const *in, int n_in,
			   epj_tensor *const *params, int n_params);
/* Human-readable reason of the first guard failure (for logs). */
void ej_region_fn_guard_explain(const ej_region_fn *f, const epj_ctx *ctx,
				epj_tensor *const *in, int n_in,
				epj_tensor *const *params, int n_params,
				char *buf, size_t n);

/* ---- offline CUDA C ---------------------------------------------------- */

/* Writes the CUDA C translation unit of every compiled graph of the jit
 * (forward and backward of each unique segment) to dir/<sig>-<dir>.cu with
 * its NVRTC options in .opts (dir NULL: write nothing).  With nvrtc_check,
 * compiles each unit under NVRTC for every arch of EPJIT_CUDA_ARCH and fails
 * on an error or a warning (EPJ_ERR_UNSUPPORTED when built without NVRTC).
 * *n_units: units emitted. */
epj_status ej_jit_emit_cuda(epj_ctx *ctx, ej_jit *jit, const char *dir,
			    bool nvrtc_check, int *n_units);

/* ---- debug dump
 * ---------------------------------------------------------------- */

/* EPJIT_DEBUG_DUMP=dir (NULL when unset). */
const char *ej_debug_dump_dir(void);
/* Multi-rank runs (the runtime's comm init): with size > 1 the dump goes
 * to $EPJIT_DEBUG_DUMP/rank<rank>, one folder per rank. */
void ej_debug_dump_set_rank(int rank, int size);
/* Writes counters as JSON to dir/counters.json (at exit or on demand). */
epj_status ej_debug_dump_counters(epj_ctx *ctx, const char *dir);
/* Appends one line "<region>\t<variant>\t<reason>" to dir/recompiles.txt
 * (a region compiled another variant because no guard accepted the call;
 * reason: each variant's first failing guard).  Best effort. */
void ej_debug_dump_recompile(const char *region, int variant,
			     const char *reason);
/* Appends one JSON line to dir/provenance.jsonl for a compiled variant of
 * a region: the region's module path and kind, the variant number and
 * mode, params[i] = the name of the parameter every graph of f calls
 * "param i", and f's steps in order (a segment's signature, as in
 * graphs.jsonl, or a break's module through callee_name) with the origin
 * of each step's activation inputs ("act j" of a segment's graph is its
 * j-th input: "region input k" or "output m of step s").  Best effort. */
void ej_debug_dump_provenance(const ej_region_fn *f, const char *region,
			      const char *kind, int variant,
			      const char *const *params, int n_params,
			      const char *(*callee_name)(const void *callee));

#endif /* EPJIT_JIT_H */
