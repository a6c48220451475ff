/* eager_cuda.h -- the eager kernels of the devices that run CUDA C
 * (cuda-sim and cuda): one entry per op of the op table, installed in
 * lib/'s dispatcher with ej_eager_install (see kernels/eager_cuda.c;
 * kernels.h declares the installation, which the engine calls).
 */
#ifndef EPJIT_EAGER_CUDA_H
#define EPJIT_EAGER_CUDA_H

#include "core_impl.h"
#include "kernels.h"
#include "ops_impl.h"

/* Entry per op id (EJ_OP_*); NULL where the op still runs its CPU reference
 * kernel (counted as a fallback by the dispatcher). */
extern const ej_eager_fn ej_eager_cuda_table[EJ_OP_COUNT];

/* Single-op modules of the process table (kernel-IR lowerings), built so
 * far (tests: a repeated eager call builds nothing). */
int ej_eager_cuda_modules(void);

/* Calls fn(user, name, cuda) for every single-op kernel built so far, with
 * its CUDA C unit (the text NVRTC compiles for the cuda device; cuda-sim
 * compiles it with the simulator header); returns how many.  fn runs
 * under the table's lock: it must not run eager ops. */
int ej_eager_cuda_each_source(void (*fn)(void *user, const char *name,
					 const char *cuda),
			      void *user);

/* kernels/tmpl_delta.c: the gated delta rule and its backward on the CUDA
 * template templates/delta.cuh. */
epj_status ej_cuda_op_gated_delta(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_gated_delta_backward(epj_ctx *ctx, ej_call *c);
/* Test hook: the gated delta backward's segment length in steps (rounded
 * down to a multiple of 64, at least 64); 0 restores the default. */
void ej_cuda_delta_segment_hook(int64_t steps);
/* kernels/tmpl_trsm.c: the triangular solve and its backward on the CUDA
 * template templates/trsm.cuh. */
epj_status ej_cuda_op_solve_triangular(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_solve_triangular_backward(epj_ctx *ctx, ej_call *c);

#endif
