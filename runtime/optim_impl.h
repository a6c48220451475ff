/* optim_impl.h -- optimizers on FP32 master parameters (SGD, Adam, AdamW),
 * DeepSpeed's learning-rate schedules, and the optimizer state that
 * checkpoints save.
 *
 * An ej_optim updates n parameter tensors that a model owns (leaf tensors,
 * f32 or bf16; the optimizer keeps a reference on each).  Every parameter
 * has an FP32 master copy and an FP32 gradient:
 *  - f32 parameter: the master IS the parameter (no copy) and the gradient is
 *    the parameter's own .grad, into which autograd accumulates micro-batch
 *    after micro-batch;
 *  - bf16 parameter: the master is a separate f32 tensor (initialised from
 *    the parameter), the gradient a separate f32 accumulator `master_grad`
 *    into which ej_optim_accumulate() adds the bf16 .grad of each
 *    micro-batch.  After each step the parameter is the master rounded to
 *    bf16 (round to nearest even).
 *
 * Invariants
 *  - All state (masters, accumulators, momentum / exp_avg / exp_avg_sq) is
 *    allocated, zeroed, by ej_optim_new, so the set of state names is the
 *    same before the first step as after any number of steps.
 *  - Between steps every master_grad holds the sum of the accumulated
 *    micro-batch gradients; after a step all gradients are cleared (.grad
 *    NULL, master_grad zero).
 *  - Parameters must be contiguous when f32 (the master is the parameter and
 *    the kernels are flat loops); bf16 parameters may have any strides.
 */
#ifndef EPJIT_OPTIM_IMPL_H
#define EPJIT_OPTIM_IMPL_H

#include "config_impl.h"
#include "core_impl.h"

#include <stdint.h>

typedef struct ej_optim ej_optim;
typedef struct ej_comm ej_comm; /* runtime_impl.h */

/* The optimizer of cfg->optimizer (type, betas, eps, weight_decay,
 * momentum, nesterov, adam_w_mode) and cfg->gradient_clipping over n >= 0
 * parameters params[n] named names[n] (HF names, distinct; copied).  The
 * optimizer takes a reference on each parameter.  Parameters must be real
 * (not symbolic), f32 (contiguous) or bf16, and distinct.  The caller owns
 * the result (ej_optim_free); NULL on failure with the error in ctx. */
ej_optim *ej_optim_new(epj_ctx *ctx, const ej_config *cfg,
		       epj_tensor *const *params, const char *const *names,
		       int n);
void ej_optim_free(ej_optim *o); /* NULL ok; releases the references */

/* Data parallelism and ZeRO (doc/design.md section 4; DeepSpeed's
 * semantics).
 * Every rank holds the same dense parameters and its EP group's experts;
 * each step the accumulated gradient of a dense parameter is summed over
 * `dp`, that of an expert parameter over `edp`, and both are multiplied by
 * grad_scale (1 / world size), so that the update equals single-rank
 * training on the global batch (every rank's loss is the mean over its own
 * micro-batch).  The global gradient norm is summed over `world`.
 *  - stage 0: all-reduce; every rank updates whole parameters.
 *  - stage 1: FP32 masters and optimizer state are partitioned over the
 *    parameter's group: each parameter's flat elements in contiguous shards
 *    of ceil(n / G) (rank g owns [g*ceil, (g+1)*ceil) clipped to n); the
 *    gradient is all-reduced, each rank updates its shard, the updated
 *    masters are all-gathered into the parameters.
 *  - stage 2: as stage 1, but the gradient is reduce-scattered: a rank
 *    receives the summed gradient of its shard only.
 * A parameter whose group has one rank is never partitioned.  With more
 * than one rank every parameter is updated at every step (a parameter that
 * received no gradient on any rank gets a zero gradient): replicas must
 * take the same decisions.  Checkpoint state of a partitioned parameter is
 * its shard, 1-D, named "optimizer.master_shard.<name>" (the master) and
 * "optimizer.<kind>.<name>". */
typedef struct ej_optim_dist {
	int zero_stage;		   /* 0, 1 or 2 */
	ej_comm *dp, *edp, *world; /* borrowed; outlive the optimizer */
	double grad_scale;	   /* 1 / world size */
	const bool *expert;	   /* [n]: parameter i is an expert's */
	/* A context with device memory (cuda): the device counterparts of dp
	 * and edp (`nccl` comms over the same ranks, borrowed; NULL where the
	 * group has one rank), which carry the gradient all-reduce /
	 * reduce-scatter and the parameter all-gather on device buffers.
	 * world (the grad-norm partial sums, host scalars) stays on the host
	 * comm. */
	ej_comm *dev_dp, *dev_edp;
} ej_optim_dist;
/* ej_optim_new over the groups of d (copied; NULL: a world of one). */
ej_optim *ej_optim_new_dist(epj_ctx *ctx, const ej_config *cfg,
			    epj_tensor *const *params, const char *const *names,
			    int n, const ej_optim_dist *d);
/* Parameter i is partitioned: its master is a shard [hi - lo] of the flat
 * parameter (*lo, *hi may be NULL). */
bool ej_optim_sharded(const ej_optim *o, int i, int64_t *lo, int64_t *hi);
/* Sets every partitioned master from its parameter's current values (after
 * loading plain weights into the parameters; other masters were loaded
 * directly). */
epj_status ej_optim_masters_from_params(ej_optim *o);
/* Sets parameter i's master (its shard, or its f32 copy) from the
 * parameter's current values: after a write to the parameter outside the
 * optimizer (DeepSeek-V3's score bias, ej_autoep_balance), so that the
 * next all-gather and a save carry it.  No-op when the master is the
 * parameter. */
epj_status ej_optim_master_from_param(ej_optim *o, int i);

int ej_optim_num_params(const ej_optim *o);
/* Parameter i (borrowed) and its FP32 master (borrowed: the parameter
 * itself for f32 parameters). */
epj_tensor *ej_optim_param(const ej_optim *o, int i);
epj_tensor *ej_optim_master(const ej_optim *o, int i);

/* After each micro-batch backward: adds f32(param.grad) into master_grad for
 * every bf16 parameter that has a .grad and clears that .grad.  f32
 * parameters need nothing (autograd accumulates into .grad).  Idempotent
 * (a second call finds no .grad). */
epj_status ej_optim_accumulate(ej_optim *o);

/* The accumulated FP32 gradient of parameter i (borrowed, contiguous):
 * master_grad for bf16 parameters (call ej_optim_accumulate first), .grad
 * for f32 ones.  NULL when the parameter received no gradient since the last
 * step, unless `create`: then a zero gradient is made so that the next step
 * updates the parameter (for the engine's cross-rank reduction, where every
 * replica must make the same skip decision).  The engine may modify the
 * values in place (all-reduce).  NULL with an error only on failure. */
epj_tensor *ej_optim_grad(ej_optim *o, int i, bool create);

/* One optimizer step at learning rate lr (>= 0, finite).
 *  1. ej_optim_accumulate (pending bf16 .grad are taken in);
 *  2. g = accumulated gradient * grad_scale (the engine passes
 *     1 / gradient_accumulation_steps);
 *  3. global L2 norm of g over all parameters (double accumulation, in a
 *     fixed order: the result does not depend on the thread count) into
 *     *grad_norm_out (may be NULL): the norm BEFORE clipping, which DeepSpeed
 *     reports.  On a context with device memory (cuda) the squares are
 *     summed on the device (another fixed order: the same norm up to double
 *     rounding) and only that sum comes back to the host;
 *  4. with gradient_clipping c > 0: g *= c / (norm + 1e-6) when that factor
 *     is below 1 (DeepSpeed's clip_tensors_by_global_norm; a NaN norm is
 *     reported and not clipped, as there);
 *  5. the update on the masters (PyTorch formulas, see optim.c);
 *  6. masters copied into bf16 parameters (round to nearest even), all
 *     gradients cleared, step count + 1.
 * On cuda-sim and cuda contexts steps 5 and 6 are one launch of the
 * optimizer template, and no gradient or densely stored parameter is copied
 * to the host (cuda: no driver allocation either once the allocator's cache
 * is warm; a strided bf16 parameter is still written through host copies).
 * A parameter that received no gradient at all since the last step is
 * skipped entirely (no weight decay, no momentum, state unchanged), as
 * PyTorch skips parameters whose .grad is None.  The step count (Adam's bias
 * correction) is global, like DeepSpeed's per-group step. */
epj_status ej_optim_step(ej_optim *o, double lr, double grad_scale,
			 double *grad_norm_out);

/* A gradient norm that is not finite applies nothing: the gradients are
 * dropped, the step count stays, *grad_norm_out has the norm (the caller
 * fails or skips the step). */
/* Drops the accumulated gradients without an update (a skipped step). */
epj_status ej_optim_drop_grads(ej_optim *o);
/* Number of optimizer steps taken (restored from checkpoints). */
int64_t ej_optim_step_count(const ej_optim *o);
void ej_optim_set_step_count(ej_optim *o, int64_t steps); /* steps >= 0 */

/* Checkpoint state: state tensors in a fixed order, per parameter in
 * parameter order:
 *   "optimizer.master.<name>"     bf16 parameters only (the f32 master)
 *   "optimizer.momentum.<name>"   SGD with momentum > 0
 *   "optimizer.exp_avg.<name>"    Adam / AdamW
 *   "optimizer.exp_avg_sq.<name>" Adam / AdamW
 * all f32, contiguous, shaped like the parameter.  ej_optim_state_tensor
 * returns a borrowed tensor that the engine saves, or into which it copies
 * loaded values (epj_tensor_copy_); after loading masters it calls
 * ej_optim_sync_params.  Gradient accumulators are not state (they are zero
 * between steps). */
int ej_optim_state_count(const ej_optim *o);
const char *ej_optim_state_name(const ej_optim *o, int i);
epj_tensor *ej_optim_state_tensor(ej_optim *o, int i);
/* Copies every master into its bf16 parameter (round to nearest even);
 * partitioned masters are all-gathered first (a collective: every rank of
 * the group calls it). */
epj_status ej_optim_sync_params(ej_optim *o);

/* Learning rate of the optimizer step with index `step` (the number of
 * optimizer steps taken before it: 0 for the first step) under
 * cfg->scheduler, exactly as DeepSpeed's engine applies it: DeepSpeed
 * calls lr_scheduler.step() AFTER optimizer.step(), so step k runs with the
 * scheduler at last_batch_iteration = k - 1 (with the config's
 * last_batch_iteration -1; in general last_batch_iteration + k).  A
 * negative iteration gives the value DeepSpeed sets at construction:
 * warmup_min_lr (WarmupLR, WarmupDecayLR), 0 (WarmupCosineLR).  No
 * scheduler: cfg->optimizer.lr at every step. */
double ej_sched_lr(const ej_config *cfg, int64_t step);

#endif /* EPJIT_OPTIM_IMPL_H */
