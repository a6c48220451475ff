/* tmpl_gemm.h -- the GEMM template (templates/gemm.cuh) on the cuda and
 * cuda-sim devices: C = epilogue(op(A) op(B)) for bf16 inputs on tensor
 * cores (fp32 accumulate, f32 or bf16 output) and for f32 / f64 inputs on
 * plain FMA, batched or grouped over row blocks, and the eager adapters of
 * the MATMUL and LINEAR ops built on it.
 *
 * Pointers are device pointers of the device named (cuda-sim: host
 * memory).  Sizes and strides are in elements.
 */
#ifndef EPJIT_TMPL_GEMM_H
#define EPJIT_TMPL_GEMM_H

#include "core_impl.h"
#include "kernels.h" /* ej_index_pin */
#include "ops_impl.h"

typedef enum ej_gemm_act {
	EJ_GEMM_ACT_NONE = 0,
	EJ_GEMM_ACT_SILU = 1, /* x / (1 + exp(-x)) */
	EJ_GEMM_ACT_GELU = 2, /* erf form, as the GELU op */
} ej_gemm_act;

/* One GEMM, set up with ej_gemm_desc_init and the ej_gemm_set_* helpers
 * (or the fields directly).  Per batch (or group) and output element
 * (i, j), with acc = sum_p op(A)[i, p] op(B)[p, j] (fp32 for bf16 inputs,
 * else the input precision):
 *     C[i, j] = act(acc + bias[j]) + res[i, j]
 * op(A) [m, k] has element (i, p) at a[i * a_rs + p * a_cs]; op(B) [k, n]
 * has (p, j) at b[p * b_rs + j * b_cs]; C [m, n] at c[i * ldc + j].
 * ej_gemm_set_a/b translate the BLAS form (ld, transposed) into these. */
typedef struct ej_gemm_desc {
	epj_dtype dtype;     /* A and B: bf16 (tensor cores), f32 or f64 */
	epj_dtype out_dtype; /* C: f32 or bf16 with bf16 inputs, else dtype */
	int64_t m, n, k;     /* grouped: m = total rows of A and C */
	const void *a, *b;
	void *c;
	int64_t a_rs, a_cs, b_rs, b_cs, ldc;
	/* batches: nb0 x nb1 (default 1 x 1); batch (z0, z1) moves A by
	 * z0 * sa0 + z1 * sa1, likewise B, C and res (bias: z0 * sbias) */
	int64_t nb0, nb1;
	int64_t sa0, sa1, sb0, sb1, sc0, sc1;
	/* epilogue: bias [n] (element j at bias[j * bias_cs]) and residual
	 * res [m, n] (row stride ldr; c itself, or disjoint from c) are
	 * optional; their
	 * dtypes are f32 or bf16 with bf16 inputs, else dtype */
	const void *bias;
	epj_dtype bias_dtype;
	int64_t bias_cs, sbias;
	const void *res;
	epj_dtype res_dtype;
	int64_t ldr, sr0, sr1;
	ej_gemm_act act;
	/* grouped: groups >= 1 and group_off[0..groups] (a device array of
	 * int64 row offsets, non-decreasing, within [0, m]): group g computes
	 * rows [off[g], off[g+1]) of A, C and res with B + g * sb0 and
	 * bias + g * sbias; no batches.  NULL: not grouped. */
	const int64_t *group_off;
	int groups;
} ej_gemm_desc;

/* Zeroes d and sets the dtypes (output: dt), sizes, 1 x 1 batches,
 * bias_cs = 1 and no epilogue. */
void ej_gemm_desc_init(ej_gemm_desc *d, epj_dtype dt, int64_t m, int64_t n,
		       int64_t k);
/* A as BLAS gives it: row-major with leading dimension lda, holding op(A)
 * [m, k] (ta false) or its transpose [k, m] (ta true). */
void ej_gemm_set_a(ej_gemm_desc *d, const void *a, int64_t lda, bool ta);
/* B likewise: [k, n] (tb false) or [n, k] (tb true, e.g. linear's w). */
void ej_gemm_set_b(ej_gemm_desc *d, const void *b, int64_t ldb, bool tb);

/* Runs d on `device` ("cuda-sim" or "cuda"), returning when it is done.
 * Errors: EPJ_ERR_DTYPE for a dtype combination the kernels lack,
 * EPJ_ERR_INVALID for negative sizes, missing pointers, ldc < n or a bad
 * group table, EPJ_ERR_UNSUPPORTED for a grid beyond the launch limits,
 * else the template build or launch error (cuda-sim: its reports).  On
 * cuda-sim, C is poisoned and race-checked when it is one dense block
 * (ldc == n, batches back to back, res not C). */
epj_status ej_gemm(epj_ctx *ctx, const char *device, const ej_gemm_desc *d);

/* Eager adapters of the op table (see lib/ops_linalg.c for the CPU
 * semantics): run the op with the template on ctx's device for f32, bf16
 * and f64 and any input strides.  c->out[0] is allocated and contiguous. */
epj_status ej_cuda_op_matmul(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_linear(epj_ctx *ctx, ej_call *c);
/* GEMM_ADD's GEMM (c: the GEMM_ADD call): out, contiguous with r's shape
 * and already holding r, accumulates a @ op(b) (acc: the template's
 * residual is C itself), or receives the product alone (acc false). */
epj_status ej_cuda_gemm_acc(epj_ctx *ctx, const ej_call *c, epj_tensor *out,
			    bool acc);
/* The expert GEMMs (MOE_GROUPED_MM, MOE_GROUPED_MM_WGRAD; lib/ops_moe.c):
 * one GEMM per group, on a cuda context one cuBLASLt grouped call where
 * cuBLASLt takes them all, else each GEMM on its own path.  The counts are
 * the pinned values (ej_index_pin), else read back to the host. */
epj_status ej_cuda_op_moe_grouped_mm(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_moe_grouped_mm_wgrad(epj_ctx *ctx, ej_call *c);
/* The pinned host copy of t (flat, in t's element order), or NULL. */
const int64_t *ej_index_pinned(const epj_ctx *ctx, const epj_tensor *t);

#endif
