/* tmpl_attention.h -- the flash-style attention template
 * (templates/attention.cuh) on the cuda-sim or cuda device: host API and
 * the eager adapters of the SDPA and SDPA_BACKWARD ops.
 *
 * Shapes as the op (lib/ops_attention.c): q [B, Hq, T, D], k [B, Hkv, S, D],
 * v [B, Hkv, S, Dv], Hq a multiple of Hkv (query head h reads kv head
 * h / (Hq / Hkv)); out [B, Hq, T, Dv] in the inputs' dtype, lse [B, Hq, T]
 * in f32 (f64 for f64 inputs).  Inputs are strided operands; outputs are
 * contiguous.  dtypes f32, bf16 (math in f32; on tensor cores)
 * and f64 (math in f64); D and Dv up to 256, different allowed (MLA: 192
 * and 128).
 */
#ifndef EPJIT_TMPL_ATTENTION_H
#define EPJIT_TMPL_ATTENTION_H

#include "tmpl.h"

/* Largest head dim (D and Dv) the kernels hold in registers. */
#define EJ_ATTN_MAX_HEAD_DIM 256

/* A strided input: the address of element 0 (a device pointer; on cuda-sim
 * a host pointer) and the element strides of its dims (3 used for lse). */
typedef struct ej_attn_operand {
	const void *p;
	int64_t st[4];
} ej_attn_operand;

typedef struct ej_attn_shape {
	int64_t b, hq, hkv, t, s, d, dv;
	/* mask key j of query i when j > i + (S - T) (bottom-right), or
	 * j > i with top_left */
	bool causal, top_left;
	double scale; /* multiplies q k^T; > 0 */
	/* document ids [B, S] (T == S; NULL: none), a device pointer with
	 * element strides seg_st, i64 (seg_i64) or i32: key j is hidden
	 * from query i when seg[b, j] != seg[b, i] */
	const void *seg;
	int64_t seg_st[2];
	bool seg_i64;
	/* a mask broadcast to [B, Hq, T, S] (NULL: none), element strides
	 * mask_st (0 on a broadcast dim), dtype mask_dt: f32, bf16 or f64
	 * are added to the scaled scores; i32 hides the keys where it is 0.
	 * With a mask a query that sees no key gets lse 0 (not -inf). */
	const void *mask;
	int64_t mask_st[4];
	epj_dtype mask_dt;
} ej_attn_shape;

/* out [B, Hq, T, Dv] (dtype dt) and lse [B, Hq, T] (f32; f64 for f64) of
 * softmax(scale q k^T, masked) v, on `device` ("cuda-sim" or "cuda").
 * Errors: EPJ_ERR_DTYPE for a dtype other than f32/bf16/f64, EPJ_ERR_SHAPE
 * for inconsistent sizes, EPJ_ERR_UNSUPPORTED for head dims over
 * EJ_ATTN_MAX_HEAD_DIM or sizes past the launch limits, and the template's
 * build and launch errors. */
epj_status ej_tmpl_attention_fwd(epj_ctx *ctx, const char *device, epj_dtype dt,
				 const ej_attn_shape *m,
				 const ej_attn_operand *q,
				 const ej_attn_operand *k,
				 const ej_attn_operand *v, void *out,
				 void *lse);

/* dq, dk, dv (contiguous, shaped like q, k, v, dtype dt) of the forward
 * above, from grad_out go and the forward's out o and lse (probabilities
 * recomputed from q, k and lse).  Query heads of a kv group accumulate into
 * dk, dv in a fixed order: deterministic.  Uses a [B, Hq, T] scratch buffer
 * from the device.  Errors as ej_tmpl_attention_fwd. */
epj_status
ej_tmpl_attention_bwd(epj_ctx *ctx, const char *device, epj_dtype dt,
		      const ej_attn_shape *m, const ej_attn_operand *go,
		      const ej_attn_operand *q, const ej_attn_operand *k,
		      const ej_attn_operand *v, const ej_attn_operand *o,
		      const ej_attn_operand *lse, void *dq, void *dk, void *dv);

/* Eager adapters (the op table's calls, c->out allocated contiguous on the
 * ctx's device, inputs of any strides): SDPA (q, k, v[, seg][, mask]) ->
 * (out, lse) and SDPA_BACKWARD (grad_out, q, k, v, out, lse[, seg][,
 * mask]) -> (dq, dk, dv), attrs i[0] causal, i[1] flags (1: the mask, 2:
 * causal top-left), f[0] scale (<= 0: 1 / sqrt(D)), run on the ctx's
 * device; seg, the document ids, and the mask are read in place. */
epj_status ej_cuda_op_sdpa(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_sdpa_backward(epj_ctx *ctx, ej_call *c);

#endif
