/* core_impl.h -- private structures of lib/: storage, tensor, device,
 * allocator, context, op table, autograd node.
 *
 * Internal (non-static) symbols use the `ej_` prefix; only `epj_` symbols are
 * exported from the shared library (libtool -export-symbols-regex).
 *
 * Invariants
 *  - A tensor's element (i0..in) lives at storage->data + elsize *
 *    (offset + sum(i_k * stride_k)).  Strides are in elements, may be 0
 *    (expand) and are never negative.
 *  - A symbolic tensor (trace mode) has storage == NULL and value_id >= 0.
 *  - grad_fn holds one reference on its node; a node holds references on its
 *    saved tensors (detached aliases: never on the tensor that owns the node,
 *    so there are no cycles) and on the nodes of its inputs.
 */
#ifndef EPJIT_CORE_IMPL_H
#define EPJIT_CORE_IMPL_H

#include "epjit.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- invariants --------------------------------------------------------- */

void ej_assert_fail(const char *expr, const char *file, int line,
		    const char *func) __attribute__((noreturn));
#define EJ_ASSERT(e)                                                           \
	((e) ? (void)0 : ej_assert_fail(#e, __FILE__, __LINE__, __func__))

#define EJ_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ---- errors --------------------------------------------------------------
 * ej_error sets the context's status and message (printf format) and returns
 * the status, so `return ej_error(ctx, EPJ_ERR_SHAPE, "...")` reads well. */
epj_status ej_error(epj_ctx *ctx, epj_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
epj_status ej_verror(epj_ctx *ctx, epj_status s, const char *fmt, va_list ap);
/* Prefixes the current message with "prefix: " (adds context upward). */
void ej_error_prefix(epj_ctx *ctx, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Atomic file write (fileio.c): `fill` writes the content to fp (tmp is
 * the temporary file's name, for messages); on any failure the temporary
 * file is removed and `path` is left as it was.  `what` names the kind of
 * file in messages ("safetensors", "token file"). */
typedef epj_status (*ej_fill_fn)(epj_ctx *ctx, FILE *fp, const char *tmp,
				 void *user);
epj_status ej_write_atomic(epj_ctx *ctx, const char *what, const char *path,
			   ej_fill_fn fill, void *user);
/* Writes the bytes epj_st_writer_save puts in its file (header and
 * tensors) to fp, for a caller that writes the file itself (a fill of
 * ej_write_atomic that also hashes them: runtime/ckpt_async.c).  path
 * and tmp name the file in messages; errors go to w's context. */
epj_status ej_st_writer_write(epj_st_writer *w, FILE *fp, const char *path,
			      const char *tmp);
/* Creates the temporary file of an atomic write of `path`, exclusively
 * (O_CREAT | O_EXCL | O_NOFOLLOW, mode 0666 & ~umask), under a name no one
 * can predict: "<path>.tmp.<pid>.<16 random hex digits>.<host>", written
 * to tmp[n]; another name is drawn when one is taken.  Returns the
 * descriptor, or -1 with errno set. */
int ej_tmp_create(const char *path, char *tmp, size_t n);
/* Test hook: when set, the random part of ej_tmp_create's names (so that a
 * test can plant a file at the name it will draw). */
extern uint64_t (*ej_tmp_nonce_hook)(void);
/* Temporary files of interrupted writes are named "<name>.tmp.<pid>[.<n>]
 * .<host>" with <host> = ej_host_tag() (8 hex digits of a hash of the host
 * name).  ej_tmp_is_dead(s), s the part after ".tmp.", says whether the
 * file belongs to a process of this host that is no longer alive (another
 * host's pid means nothing here).  ej_write_atomic removes such files of
 * `path` before it writes. */
const char *ej_host_tag(void);
bool ej_tmp_is_dead(const char *after_tmp);
/* Removes, in path's directory, the temporary files of interrupted writes
 * of path and of every name that starts with path's ("<path>*.tmp.<pid>.
 * <nonce>.<host>"), where the process is gone (ej_tmp_is_dead) and the
 * file is ours (uid): a save or load of a checkpoint set sweeps those of
 * all its generations and ranks. */
void ej_sweep_tmp(const char *path);
/* path's directory ("." when it has none, "/" at the root) and last
 * component, for readdir and directory fsyncs next to a file: dir points
 * into buf (malloc'd, the caller frees it), base into path.  False when
 * out of memory. */
typedef struct ej_path_parts {
	char *buf;
	const char *dir, *base;
} ej_path_parts;
bool ej_path_split(const char *path, ej_path_parts *out);
/* fopen(path, "rb") of a regular file only: opened with O_NONBLOCK first so
 * that a FIFO (or a device) never blocks, refused unless fstat says it is a
 * regular file.  NULL with *why set (strerror(errno), or "not a regular
 * file (a FIFO)" and the like) on failure. */
FILE *ej_fopen_regular(const char *path, const char **why);

/* Shape as "[2,3,4]" into buf (returns buf). */
char *ej_shape_str(int ndim, const int64_t *shape, char *buf, size_t n);

/* ---- memory: device vtable + caching allocator ----------------------------
 */

struct ej_launch;

/* What reached a device's driver (the cuda device: lib/device_cuda.c),
 * counted where every driver call goes through, so that a real GPU and the
 * stand-in driver give the same numbers.  Cumulative for the process (one
 * driver per process); peak_reserved since the last reset_peaks.  Reported
 * as "<device name>.<counter>" counters (doc/counters.md). */
typedef struct ej_dev_counters {
	int64_t launches;	/* kernel launches (cuLaunchKernel) */
	int64_t graph_launches; /* CUDA graph replays (cuGraphLaunch) */
	int64_t mem_alloc;	/* device allocations (cuMemAlloc) */
	int64_t mem_free;	/* device frees (cuMemFree) */
	/* calls that block the host until the device catches up: stream,
	 * event and context synchronizations, blocking copies, frees */
	int64_t syncs;
	int64_t bytes_h2d, bytes_d2h, bytes_d2d; /* copies issued */
	int64_t reserved, peak_reserved; /* bytes held from cuMemAlloc */
} ej_dev_counters;

/* How a device's generated code reaches it (ej_device.load). */
typedef enum ej_module_form {
	EJ_MODULES_NONE,    /* runs no generated code of its own (cpu) */
	EJ_MODULES_HOST_SO, /* shared objects from the host C++ compiler */
	EJ_MODULES_CUBIN,   /* cubins from NVRTC, loaded by the driver */
} ej_module_form;

struct ej_device;

/* What a device is, known before it is opened: everything the layers
 * above ask about a device goes here, never to its name.  One descriptor
 * per device, defined in the device's own file and listed once in the
 * registry (lib/devices.c); adding a device is its file and a row there. */
typedef struct ej_device_desc {
	const char *name;
	/* the codegen backend compiled regions default to on it
	 * (jit/pipeline.c's names: "c", "cuda-sim", "nvrtc") */
	const char *backend;
	/* the collective backend comm.backend "auto" picks for it when the
	 * world has more than one rank and that library loads; NULL: the
	 * host's (MPI) */
	const char *comm;
	/* its kernels are CUDA C: the templates and the eager CUDA table
	 * serve it (kernels/tmpl*.c, kernels/eager_cuda.c) */
	bool runs_cuda;
	ej_module_form modules;
	/* it runs each grid twice and compares the outputs a launch names
	 * (ej_launch.outs): launches must name them, and an output that is
	 * also read must be read from a copy (cuda-sim's race check) */
	bool reruns_grids;
	/* its GEMMs may go to cuBLASLt, the expert GEMMs of an AutoEP layer
	 * grouped into one call (lib/cublaslt.c, kernels/tmpl_gemm.c) */
	bool gemm_library;
	/* Opens the device for a new context: *out is the device (a static
	 * one, or the process's GPU); errors go to probe. */
	epj_status (*open)(epj_ctx *probe, const struct ej_device **out);
} ej_device_desc;

/* The registry: the descriptor named `name`, or NULL (lib/devices.c). */
const ej_device_desc *ej_device_find(const char *name);
/* The registry's device names in its order (*n of them): the choices of
 * the config's "device". */
const char *const *ej_device_list(int *n);

/* One backend's memory and execution primitives.  Members marked optional may
 * be NULL.  `self` is passed back to every call. */
typedef struct ej_device {
	const char *name; /* its descriptor's name */
	const ej_device_desc *desc;
	void *self;
	/* Raw allocation of `bytes` (>0), aligned to 64 bytes; NULL on failure.
	 */
	void *(*alloc)(void *self, size_t bytes);
	/* Releases a pointer from alloc. */
	void (*free)(void *self, void *ptr);
	/* Host<->device or device<->device copy of bytes.  On cpu a memcpy. */
	void (*copy)(void *self, void *dst, const void *src, size_t bytes);
	/* Optional: fill bytes with zero (default: copy from a host zero page).
	 */
	void (*memzero)(void *self, void *ptr, size_t bytes);
	/* Optional: wait for outstanding work (cpu: nothing). */
	void (*sync)(void *self);
	/* True when data pointers are host-addressable. */
	bool host_visible;
	/* Optional (default NULL: the device runs no generated code): loads
	 * an artifact of `size` bytes (cuda-sim: a shared object; cuda: a
	 * cubin or PTX) under `name` into *module.  Errors go to ctx. */
	epj_status (*load)(void *self, epj_ctx *ctx, const void *image,
			   size_t size, const char *name, void **module);
	/* Optional, set with load: releases a module (NULL ok). */
	void (*unload)(void *self, void *module);
	/* Optional, set with load: the kernel `kernel` of a module (cuda-sim:
	 * its launch entry ej_sim_<kernel>); NULL when absent. */
	void *(*function)(void *self, void *module, const char *kernel);
	/* Optional, set with load: runs kernel fn (named `kernel`, for
	 * messages) as l describes; returns when it is done (there is one
	 * stream).  A failed launch, or a bug the device detects (cuda-sim:
	 * divergent barrier, race, unwritten output), is EPJ_ERR_BACKEND with
	 * the device's report in ctx. */
	epj_status (*launch)(void *self, epj_ctx *ctx, void *fn,
			     const char *kernel, const struct ej_launch *l);
	/* Optional: the driver counts (above), and their peak reset. */
	void (*counters)(void *self, ej_dev_counters *out);
	void (*reset_peaks)(void *self);
} ej_device;

/* One launch (the host launch code of the cuda devices, jit/launch_cuda.c,
 * fills it).  outs: the output buffers of the launch, which cuda-sim's
 * checks fill and compare (elem: element size); cuda ignores them. */
typedef struct ej_launch_out {
	void *ptr;
	size_t bytes;
	size_t elem;
} ej_launch_out;
typedef struct ej_launch {
	unsigned grid[3], block[3];
	size_t smem; /* dynamic shared memory bytes */
	const void *args;
	size_t args_size;
	const ej_launch_out *outs;
	int n_out;
} ej_launch;

extern const ej_device ej_device_cpu;
/* True for the devices whose kernels are CUDA C (cuda-sim, cuda): the
 * template and eager-table paths of the runtime run on them. */
static inline bool ej_dev_runs_cuda(const ej_device *d)
{
	return d->desc && d->desc->runs_cuda;
}
/* True for a device that reruns grids to check them (ej_device_desc). */
static inline bool ej_dev_reruns_grids(const ej_device *d)
{
	return d->desc && d->desc->reruns_grids;
}
/* Host memory, kernels are CUDA C compiled by the host C++ compiler and run
 * by the simulator (lib/device_sim.c, templates/cuda_sim.cuh). */
extern const ej_device ej_device_sim;
/* How the cuda-sim device loads its modules, shared objects given as bytes:
 * the jit, which builds them, registers its loader (jit/hostcc.c, at
 * library load), so that lib names no function of the layer above it.
 * Until one is registered a load fails with EPJ_ERR_STATE. */
typedef struct ej_so_loader {
	epj_status (*load)(epj_ctx *ctx, const void *image, size_t size,
			   const char *name, void **handle);
	void *(*sym)(void *handle, const char *sym);
	void (*unload)(void *handle);
} ej_so_loader;
void ej_device_sim_set_loader(const ej_so_loader *l);

/* Caching allocator over a device: blocks are cut from segments taken from
 * the device, and a freed block is merged with its free neighbours and
 * reused, best fit, by requests of its size or smaller; statistics as in
 * epj_memory_stats.  Sizes are rounded up to 512-byte multiples up to 1 MiB
 * and to 64 KiB multiples above (alloc.c). */
typedef struct ej_allocator ej_allocator;
ej_allocator *ej_allocator_new(const ej_device *dev);
void ej_allocator_free(ej_allocator *a);
void *ej_alloc(ej_allocator *a, size_t bytes); /* NULL on failure */
void ej_dealloc(ej_allocator *a, void *ptr);
void ej_allocator_stats(const ej_allocator *a, epj_memory_stats *out);
void ej_allocator_reset_peaks(ej_allocator *a);
void ej_allocator_empty_cache(ej_allocator *a);
/* Test hook: the n-th allocation from now fails (0 = off). */
void ej_allocator_fail_after(ej_allocator *a, int64_t n);

typedef struct ej_storage {
	int refcount;
	void *data;
	size_t bytes;
	ej_allocator *alloc; /* NULL: data is not owned (external) */
	/* bf16 parameters (lib/wcache.c): `param` marks a module parameter's
	 * storage; f32 holds its values widened to f32 (bytes / 2 floats,
	 * from the same allocator), valid while f32_epoch equals the
	 * context's wepoch. */
	bool param;
	float *f32;
	uint64_t f32_epoch;
} ej_storage;

ej_storage *ej_storage_new(epj_ctx *ctx, size_t bytes); /* zero-filled */
/* lib/wcache.c: the f32 values of a bf16 parameter tensor t (element 0 of
 * t; t's strides and shape apply), converted at most once per write epoch,
 * or NULL when t is not a bf16 parameter on host memory, the cache is off
 * (EPJIT_BF16_WEIGHT_CACHE=0) or memory ran out (the caller converts). */
const float *ej_param_f32(epj_ctx *ctx, const epj_tensor *t);
/* Marks t's storage as a parameter's (ej_module_add_param). */
void ej_storage_mark_param(epj_tensor *t);
/* Something may have written a parameter: every f32 view is stale. */
void ej_params_written(epj_ctx *ctx);
/* t (about to be written) is a parameter's: its f32 view is stale. */
void ej_param_write(epj_ctx *ctx, const epj_tensor *t);
ej_storage *ej_storage_new_uninit(epj_ctx *ctx, size_t bytes);
void ej_storage_ref(ej_storage *s);
void ej_storage_unref(ej_storage *s);

/* ---- tensors ------------------------------------------------------------- */

typedef struct ej_node ej_node;

struct epj_tensor {
	int refcount;
	epj_dtype dtype;
	int ndim;
	int64_t shape[EPJ_MAX_DIMS];
	int64_t stride[EPJ_MAX_DIMS]; /* elements */
	int64_t offset;		      /* elements */
	ej_storage *storage;	      /* NULL for symbolic tensors */
	epj_ctx *ctx;		      /* creating context (borrowed) */

	/* autograd */
	bool requires_grad;
	bool retains_grad;
	epj_tensor *grad; /* owned */
	ej_node *grad_fn; /* owned ref; NULL for leaves */
	int output_nr;	  /* which output of grad_fn */

	/* trace mode: IR value id (>= 0) owned by the recorder; -1 otherwise */
	int value_id;
	void *trace_owner; /* recorder's graph */
};

size_t ej_dtype_size(epj_dtype dt);
/* Allocates a contiguous tensor (uninitialised storage unless zero). */
epj_tensor *ej_tensor_alloc(epj_ctx *ctx, epj_dtype dt, int ndim,
			    const int64_t *shape, bool zero);
/* A tensor struct (refcount 1) with meta only: no storage, value_id -1. */
epj_tensor *ej_tensor_meta(epj_ctx *ctx, epj_dtype dt, int ndim,
			   const int64_t *shape);
/* New tensor viewing t's storage with the given geometry. */
epj_tensor *ej_tensor_view(epj_tensor *t, int ndim, const int64_t *shape,
			   const int64_t *stride, int64_t offset);
void ej_contiguous_strides(int ndim, const int64_t *shape, int64_t *stride);
int64_t ej_numel(int ndim, const int64_t *shape);
bool ej_is_contiguous(const epj_tensor *t);
/* Address of element 0 (storage data + offset). */
static inline void *ej_data(const epj_tensor *t)
{
	return (char *)t->storage->data +
	       (size_t)t->offset * ej_dtype_size(t->dtype);
}
/* Normalises a possibly negative axis; -1 when out of range. */
int ej_axis(int axis, int ndim);

/* Scalar load/store of any dtype through a typed pointer. */
double ej_load_f64(const void *p, epj_dtype dt);
void ej_store_f64(void *p, epj_dtype dt, double v);

/* Iterates over all index tuples of `shape` in row-major order. */
typedef struct ej_iter {
	int ndim;
	int64_t shape[EPJ_MAX_DIMS];
	int64_t idx[EPJ_MAX_DIMS];
} ej_iter;

/* ---- op table -------------------------------------------------------------
 * One row per op, in lib/ops.def (X-macro).  Attributes are a flat record so
 * that the compiler can hash and print them canonically. */

enum {
#define EJ_OP(id, name, nin, nout, flags) EJ_OP_##id,
#include "ops.def"
#undef EJ_OP
	EJ_OP_COUNT
};

#define EJ_MAX_ATTR_INTS   16
#define EJ_MAX_ATTR_FLOATS 4

typedef struct ej_attrs {
	int64_t i[EJ_MAX_ATTR_INTS];
	double f[EJ_MAX_ATTR_FLOATS];
	int n_i, n_f;
} ej_attrs;

/* Output metadata computed by an op's infer function. */
typedef struct ej_meta {
	epj_dtype dtype;
	int ndim;
	int64_t shape[EPJ_MAX_DIMS];
	/* For view ops on real tensors: strides/offset of the view into the
	 * (first) input's storage.  is_view = true makes dispatch create a
	 * view instead of allocating. */
	bool is_view;
	int64_t stride[EPJ_MAX_DIMS];
	int64_t offset;
} ej_meta;

/* Everything an op's kernel or backward sees about one call.
 * In a backward formula in[i] is never NULL: it is the saved input when the
 * op saves inputs (no EJ_OPF_NO_SAVE_IN), else a meta-only tensor (shape and
 * dtype, no storage) that must not be passed to ops.  out[j] likewise is the
 * saved output with EJ_OPF_SAVE_OUT, else meta-only. */
typedef struct ej_call {
	int op;
	const ej_attrs *attrs;
	epj_tensor *const *in; /* n_in inputs */
	int n_in;
	epj_tensor *const *out; /* n_out outputs */
	int n_out;
} ej_call;

/* Validates inputs and fills out[0..n_out).  Errors name the op and shapes. */
typedef epj_status (*ej_infer_fn)(epj_ctx *ctx, const ej_call *c, ej_meta *out);
/* Runs on real (cpu) tensors; outputs are allocated (contiguous,
 * uninitialised) already.  Inputs may have any strides (also 0).  Not called
 * when every output is a view (ej_meta.is_view). */
typedef epj_status (*ej_kernel_fn)(epj_ctx *ctx, const ej_call *c);
/* Backward formula written with ops (epj_* calls), so it runs eagerly and in
 * trace mode alike.  grad_out[j] may be NULL (no gradient flows into that
 * output: treat as zeros).  Set grad_in[i] (new reference) for every i with
 * needs[i]; leave others NULL. */
typedef epj_status (*ej_backward_fn)(epj_ctx *ctx, const ej_call *c,
				     epj_tensor *const *grad_out,
				     const bool *needs, epj_tensor **grad_in);

/* Flags of an op row. */
enum {
	EJ_OPF_NONE = 0,
	EJ_OPF_VIEW = 1 << 0,	     /* output views input 0's storage */
	EJ_OPF_VARIADIC_IN = 1 << 1, /* nin is a minimum */
	EJ_OPF_VARIADIC_OUT = 1 << 2,
	EJ_OPF_NO_GRAD = 1 << 3,    /* outputs never require grad */
	EJ_OPF_SAVE_OUT = 1 << 4,   /* backward needs the outputs */
	EJ_OPF_NO_SAVE_IN = 1 << 5, /* backward needs no inputs (only shapes) */
	EJ_OPF_POINTWISE = 1 << 6,
	EJ_OPF_REDUCTION = 1 << 7,
	EJ_OPF_CREATION = 1 << 8, /* no tensor inputs */
};

typedef struct ej_op_info {
	const char *name;
	int n_in, n_out; /* fixed counts or minimums (variadic) */
	unsigned flags;
	ej_infer_fn infer;
	ej_kernel_fn cpu_kernel;
	ej_backward_fn backward; /* NULL: not differentiable */
} ej_op_info;

extern const ej_op_info ej_ops[EJ_OP_COUNT];

/* Per-family registration: each ops_*.c defines the rows of its ops with
 * these names (declared by ops.def through EJ_OP_DECL in ops.c). */
#define EJ_OP_FNS(id)                                                          \
	epj_status ej_infer_##id(epj_ctx *ctx, const ej_call *c,               \
				 ej_meta *out);                                \
	epj_status ej_kernel_##id(epj_ctx *ctx, const ej_call *c);             \
	epj_status ej_backward_##id(epj_ctx *ctx, const ej_call *c,            \
				    epj_tensor *const *grad_out,               \
				    const bool *needs, epj_tensor **grad_in);

/* The one dispatch entry: runs op `op` on inputs, eagerly or (while a
 * recorder is installed) by recording it.  outs[n_out] receive new refs.
 * Records an autograd node when grad mode is on and an input requires grad
 * (and the op is differentiable).  Counts kernels.launched.eager. */
epj_status ej_dispatch(epj_ctx *ctx, int op, epj_tensor *const *in, int n_in,
		       const ej_attrs *attrs, epj_tensor **outs, int n_out);
/* Runs single-output op `op` on in[] into out, a dense tensor with the
 * dtype and shape the op infers (EPJ_ERR_SHAPE otherwise), overwriting
 * it: the op's kernel on the context's device, no autograd node, never
 * while tracing or in shape-only mode.  For updates of buffers that stay
 * put (a gradient accumulator). */
epj_status ej_dispatch_into(epj_ctx *ctx, int op, epj_tensor *const *in,
			    int n_in, const ej_attrs *attrs, epj_tensor *out);
/* Convenience for single-output ops: returns the output or NULL.  A NULL
 * input returns NULL without changing the error. */
epj_tensor *ej_call1(epj_ctx *ctx, int op, epj_tensor *const *in, int n_in,
		     const ej_attrs *attrs);

/* Attribute builders. */
static inline ej_attrs ej_attrs_none(void)
{
	ej_attrs a = { 0 };
	return a;
}
void ej_attrs_push_i(ej_attrs *a, int64_t v);
void ej_attrs_push_f(ej_attrs *a, double v);

/* ---- eager kernels of devices that run CUDA C ------------------------------
 * A device whose kernels are CUDA C (cuda-sim, cuda: ej_dev_runs_cuda)
 * runs eager ops through a table indexed by op id (EJ_OP_*), installed by
 * the layer that generates and compiles CUDA C (kernels/eager_cuda.c): lib/
 * never calls into the compiler, it only consults what was installed.
 *
 * An entry runs op c->op on the device: c->out[] are allocated already
 * (contiguous, uninitialised, on the ctx's device), inputs have any
 * strides.  A NULL entry, or an entry that cannot run a case and calls
 * ej_eager_fallback, runs the CPU reference kernel on the same host
 * buffers (cuda-sim memory is host memory; on cuda, through host copies
 * of the inputs and outputs) and is counted in
 * kernels.eager_cpu_fallback and kernels.eager_cpu_fallback.<op>; an op
 * that ran as CUDA kernels counts in kernels.eager_cuda.  The cpu device
 * has no table. */
typedef epj_status (*ej_eager_fn)(epj_ctx *ctx, ej_call *c);
/* Installs table[EJ_OP_COUNT] (static storage; NULL uninstalls) as dev's
 * eager kernels.  Idempotent. */
void ej_eager_install(const ej_device *dev, const ej_eager_fn *table);
/* Installs table for every device named `name` (static string): the cuda
 * device's vtable exists only once the process opened its GPU. */
void ej_eager_install_name(const char *name, const ej_eager_fn *table);
/* The table installed for dev (by pointer, else by name), or NULL. */
const ej_eager_fn *ej_eager_table(const ej_device *dev);
/* Runs c's CPU reference kernel and counts it as a fallback (for entries
 * that decline a case, e.g. an integer reduction).  On a device the host
 * cannot address (cuda) the inputs are copied to host memory, the kernel
 * runs there and the outputs are copied back. */
epj_status ej_eager_fallback(epj_ctx *ctx, ej_call *c);

/* ---- autograd -------------------------------------------------------------
 */

struct ej_node {
	int refcount;
	int op;
	ej_attrs attrs;
	int n_in, n_out;
	/* Saved inputs/outputs (detached aliases or NULL when not needed). */
	epj_tensor **saved_in;
	epj_tensor **saved_out;
	/* Input metadata kept even when not saved (for shapes in backward). */
	ej_meta *in_meta;
	/* Edges: for input i, the producing node (ref) and its output index,
	 * or a leaf tensor (ref) that accumulates; or neither (no grad). */
	ej_node **next;
	int *next_nr;
	epj_tensor **leaf;
	bool *needs; /* needs[i]: input i requires grad */
	/* Non-leaf outputs that asked for retain_grad (weak pointers cleared
	 * when the tensor dies). */
	epj_tensor **retain;
	/* Optional custom backward (used by compiled regions, checkpointing):
	 * when set it replaces the op row's formula. */
	epj_status (*custom_backward)(epj_ctx *ctx, ej_node *n,
				      epj_tensor *const *grad_out,
				      epj_tensor **grad_in);
	void (*custom_free)(void *custom);
	void *custom;
	const char *name; /* for errors and debug ("mul", "region ...") */
	bool released;	  /* saved tensors freed after its backward ran */
	/* An exchange whose backward may leave its gradient in flight on a
	 * communication stream (custom_finish set): the engine sets
	 * bw_defer before custom_backward; a node that then leaves its
	 * result in flight sets bw_in_flight, and the engine calls
	 * custom_finish before anything reads that gradient (and clears
	 * bw_in_flight), meanwhile running the ready nodes that do not
	 * read it. */
	epj_status (*custom_finish)(epj_ctx *ctx, ej_node *n);
	bool bw_defer, bw_in_flight;
	/* a custom node whose backward never communicates (a compiled
	 * segment): it may run while an exchange is in flight; any other
	 * custom node waits for the exchange first */
	bool bw_comm_free;
	/* scratch of one epj_backward run */
	int bw_pending; /* consumers still to deliver a gradient */
	int bw_slot;	/* index in the run's gradient table, -1 if none */
};

/* Creates a node for a custom autograd function with n_in inputs (whose
 * edges are set from the inputs) and n_out outputs (their grad_fn is set). */
ej_node *ej_node_custom(epj_ctx *ctx, const char *name, epj_tensor *const *in,
			int n_in, epj_tensor *const *out, int n_out,
			epj_status (*bw)(epj_ctx *, ej_node *,
					 epj_tensor *const *, epj_tensor **),
			void *custom, void (*custom_free)(void *));
void ej_node_unref(ej_node *n);
/* Called by epj_tensor_free for a dying non-leaf that retained its grad. */
void ej_node_forget_retained(ej_node *n, int output_nr);
bool ej_any_requires_grad(epj_tensor *const *in, int n);

/* ---- trace hook -------------------------------------------------------------
 * While ctx->recorder is set, ej_dispatch hands every call to it instead of
 * running a kernel.  The recorder creates the outputs (symbolic tensors with
 * the inferred meta).  lib/ never includes the compiler: jit/ installs this. */
typedef struct ej_recorder {
	void *self;
	epj_status (*record)(void *self, epj_ctx *ctx, int op,
			     epj_tensor *const *in, int n_in,
			     const ej_attrs *attrs, const ej_meta *meta,
			     epj_tensor **outs, int n_out);
} ej_recorder;

/* ---- counters -------------------------------------------------------------
 */

typedef struct ej_counter_table ej_counter_table;
ej_counter_table *ej_counter_table_new(void);
void ej_counter_table_free(ej_counter_table *t);
/* Stable slot for a name (created at 0); lets hot paths avoid lookups. */
int64_t *ej_counter_slot(epj_ctx *ctx, const char *name);

/* EPJIT_PROFILE sections beyond the op kernels (doc/counters.md,
 * Profiling): ej_prof_begin(ctx, &t) notes the time when the context
 * profiles; ej_prof_end(ctx, &t, fmt, ...) then adds the wall time since
 * to profile.<name>.us and 1 to profile.<name>.calls, <name> formatted
 * from fmt.  Both do nothing when the context does not profile. */
typedef struct ej_prof {
	int64_t t0_ns; /* 0: not started */
} ej_prof;
void ej_prof_begin(const epj_ctx *ctx, ej_prof *p);
void ej_prof_end(epj_ctx *ctx, ej_prof *p, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- RNG (splitmix64-seeded xoshiro256**) ---------------------------------
 */

typedef struct ej_rng {
	uint64_t s[4];
} ej_rng;
void ej_rng_seed(ej_rng *r, uint64_t seed);
uint64_t ej_rng_next(ej_rng *r);
double ej_rng_uniform(ej_rng *r); /* [0, 1) */
double ej_rng_normal(ej_rng *r);  /* N(0, 1), Box-Muller */

/* ---- context
 * ----------------------------------------------------------------- */

struct epj_ctx {
	const ej_device *dev;
	ej_allocator *alloc;
	/* Write epoch of parameters (lib/wcache.c): bumped by every write
	 * that may change a parameter; f32 views of an older epoch are
	 * stale.  Starts at 1. */
	uint64_t wepoch;
	bool no_wcache; /* EPJIT_BF16_WEIGHT_CACHE=0 */
	bool no_amx;	/* EPJIT_CPU_AMX=0 (lib/gemm_amx.c) */
	epj_status status;
	char errmsg[1024];
	bool grad_enabled;
	ej_rng rng;
	ej_counter_table *counters;
	int64_t *ctr_eager_launches; /* slot of kernels.launched.eager */
	const ej_recorder *recorder; /* non-NULL while tracing */
	/* EPJIT_PROFILE=1: per-op kernel time into counters
	 * profile.<op>.us / profile.<op>.calls (eager and compiled alike) */
	bool profile;
	int64_t *prof_us[EJ_OP_COUNT], *prof_calls[EJ_OP_COUNT];
	/* Runtime hooks (installed by upper layers, may be NULL; lib/ never
	 * looks inside). */
	const void *rt_break_hook; /* runtime's ej_break_hook */
	int rt_replay_depth;	   /* > 0 while checkpoint replays run */
	void *user;
	/* Shape-only mode (offline cache warm-up): new tensors get no storage
	 * (ej_tensor_alloc, random fills), ops infer their outputs and run no
	 * kernel, copies between storage-less tensors do nothing.  Such a
	 * model can be traced and compiled, never run. */
	bool meta;
	/* The world an engine initialized in shape-only mode stands for, one
	 * rank of it (there are no ranks: the warm-up compiles what a rank
	 * would); 0: the config's (runtime/engine.c, meta_world_size). */
	int meta_world;
	/* eager kernels on a CUDA C device (ej_eager_table): slots of
	 * kernels.eager_cuda, kernels.eager_cpu_fallback and, created at the
	 * first fallback of each op, kernels.eager_cpu_fallback.<op> */
	int64_t *ctr_eager_cuda, *ctr_eager_fallback;
	int64_t *ctr_fallback_op[EJ_OP_COUNT];
	/* EPJIT_SDPA=reference: SDPA and SDPA_BACKWARD run the reference
	 * kernels instead of the flash ones (lib/ops_attention.c) */
	bool sdpa_reference;
	/* A host allocator for the CPU kernels of eager fallbacks on a device
	 * whose memory the host cannot address (cuda); made at the first
	 * fallback (ej_eager_fallback). */
	ej_allocator *host_alloc;
	/* The GEMM path of a CUDA C device (kernels/tmpl_gemm.c): the per-shape
	 * choice between cuBLASLt and the NVRTC template and the cuBLASLt
	 * handle, made at the first GEMM; freed first by epj_ctx_free. */
	void *gemm_sel;
	void (*gemm_sel_free)(void *);
};

#endif /* EPJIT_CORE_IMPL_H */
