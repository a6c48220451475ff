/* kernels.h -- what the runtime uses of the device kernels (kernels/):
 * the eager table's installation, the pinned host copies of index tensors
 * and the optimizer's multi-tensor kernels.  runtime/ includes this header
 * and no other of kernels/ (t/layers.sh); the kernels' own headers
 * (eager_cuda.h, tmpl*.h) are for kernels/ and the tests.
 *
 * The device-facing functions take device pointers (host pointers on
 * cuda-sim) and return when their kernels are done.
 */
#ifndef EPJIT_KERNELS_H
#define EPJIT_KERNELS_H

#include "core_impl.h"

/* ---- the eager table (eager_cuda.c) ------------------------------------- */

/* Installs ej_eager_cuda_table (eager_cuda.h) for every device that runs
 * CUDA C (cuda-sim and cuda).  Idempotent; runs at library load and again
 * from the engine (runtime/engine.c), so a statically linked program that
 * uses the engine gets it too. */
void ej_eager_cuda_install(void);

/* ---- pinned index values (tmpl_gemm.c) ---------------------------------- */

/* Pins the host copy v of an index tensor t (i64 or i32, dense; e.g. the
 * group counts of the expert GEMMs) on a cuda or cuda-sim context: v holds
 * t's numel values in order, which the caller built t from.  Until t's
 * storage is freed, the grouped GEMMs take their counts and the eager index
 * ops validate their index from v instead of reading t (or a dense alias of
 * the same elements) back.  The caller must not write t afterwards nor hand
 * it to anyone who might.  Does nothing on other devices.  Errors:
 * EPJ_ERR_NOMEM. */
epj_status ej_index_pin(epj_ctx *ctx, const epj_tensor *t, const int64_t *v);

/* ---- optimizer (tmpl_optim.c, templates/optim.cuh) ---------------------- */

/* One parameter of a multi-tensor step: device pointers, n elements each.
 * master, s1, s2 are updated in place; model (NULL: none) receives the
 * updated master in model_dtype (f32 or bf16). */
typedef struct ej_tmpl_optim_tensor {
	float *master;
	const void *grad; /* dtype of ej_tmpl_optim.grad_dtype */
	float *s1;	  /* momentum (SGD, NULL: no momentum) or exp_avg */
	float *s2;	  /* exp_avg_sq (Adam), else NULL */
	void *model;
	int64_t n;
} ej_tmpl_optim_tensor;

/* The step's hyper-parameters, as runtime/optim.c takes them. */
typedef struct ej_tmpl_optim {
	bool adam;	/* false: SGD */
	bool decoupled; /* AdamW-style weight decay (Adam only) */
	bool nesterov;	/* SGD */
	double lr, grad_scale, weight_decay, momentum, beta1, beta2, eps;
	int64_t step; /* t: the step count after this step (>= 1) */
	epj_dtype grad_dtype, model_dtype; /* f32 or bf16 each */
} ej_tmpl_optim;

/* A device copy of the descriptors of a multi-tensor launch, kept by the
 * caller from step to step: one per launch site (the step, the norm).
 * The descriptors are copied to the device only when they differ from the
 * last call's (the parameters moved, or were added), so a steady-state
 * step copies none (counters optim.table_uploads, optim.table_reused).
 * _free releases the device block through ctx's allocator (NULL ok). */
typedef struct ej_tmpl_optim_table ej_tmpl_optim_table;
/* Room for n descriptors on ctx's device is taken now (grown later when a
 * call needs more, or moved when its module is on another device); NULL
 * with the error in ctx. */
ej_tmpl_optim_table *ej_tmpl_optim_table_new(epj_ctx *ctx, int n);
void ej_tmpl_optim_table_free(epj_ctx *ctx, ej_tmpl_optim_table *tab);

/* One launch updates all n tensors t[0..n): SGD or Adam/AdamW with
 * runtime/optim.c's formulas (same bits on cuda-sim).  Its descriptors
 * (n of them, whatever the number of blocks) live in tab (NULL: copied
 * for this call only); its scratch comes from ctx's allocator. */
epj_status ej_tmpl_optim_step(epj_ctx *ctx, const char *device,
			      const ej_tmpl_optim *o,
			      const ej_tmpl_optim_tensor *t, int n,
			      ej_tmpl_optim_table *tab);

/* n gradient spans on the device: n elements (f32 or bf16) from grad. */
typedef struct ej_tmpl_optim_span {
	const void *grad;
	int64_t n;
} ej_tmpl_optim_span;

/* *ss = the sum of the squares of every element of s[0..n), in double:
 * one partial sum per 2048-element chunk, then the partials in order (two
 * launches, a fixed order: the same value for any block order).  The sum
 * is the one value copied back to the host (8 bytes; the copy waits for
 * the kernels; its descriptors live in tab as for the step).  It differs
 * from runtime/optim.c's chunked CPU sum by
 * rounding only.  *ss = 0 for no elements. */
epj_status ej_tmpl_optim_sumsq(epj_ctx *ctx, const char *device,
			       epj_dtype grad_dtype,
			       const ej_tmpl_optim_span *s, int n,
			       ej_tmpl_optim_table *tab, double *ss);

#endif
