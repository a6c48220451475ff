/* tmpl_moe.h -- host API of the MoE, embedding and loss templates
 * (templates/moe.cuh, embedding.cuh), and the eager adapters of the
 * op-table ops they implement.  The optimizer template's API is in
 * kernels.h (the runtime's).
 *
 * Every function takes the device name ("cuda-sim" or "cuda"), device
 * pointers (host pointers on cuda-sim), sizes and dtypes, picks the
 * geometry and launches; it returns when the kernels are done.  Shapes are
 * named as in the templates: N tokens, E experts, k slots per token (slot
 * n * k + j), R = N * k routed rows, H columns.  The routing dtype "rdt" is
 * f64 for f64 layers and f32 for f32 and bf16 ones.  Index arrays are
 * contiguous int64 on the device.  Output buffers are contiguous unless a
 * stride says otherwise; inputs with strides take element strides.
 * Errors: EPJ_ERR_INVALID naming the size that the kernels cannot take,
 * EPJ_ERR_DTYPE naming the dtype, compile/launch failures of the device.
 */
#ifndef EPJIT_TMPL_MOE_H
#define EPJIT_TMPL_MOE_H

#include "core_impl.h"
#include "ops_impl.h"

/* The most slots per token the router kernel takes. */
#define EJ_TMPL_MOE_MAX_K 32

/* ---- MoE (templates/moe.cuh) ------------------------------------------- */

/* Router: logits [N, E] (f32, bf16 or f64; element strides sl0, sl1) ->
 * probs [N, E] rdt = softmax, w [N, k] rdt = the top-k probs (largest
 * first, ties to the lower expert, NaN largest), renormalised to sum 1 when
 * norm, idx [N, k] i64 the experts; with fixed, the experts (n k + j) % E
 * instead (weighted the same).  1 <= k <= min(E, EJ_TMPL_MOE_MAX_K). */
epj_status ej_tmpl_moe_route(epj_ctx *ctx, const char *device,
			     const void *logits, epj_dtype ldt, int64_t sl0,
			     int64_t sl1, int64_t N, int E, int k, bool norm,
			     bool fixed, void *probs, void *w, int64_t *idx);

/* Stable counting sort of n keys in [0, B): counts [B], offsets [B + 1],
 * order [n] (order[r] = position of the r-th key in sorted order; equal
 * keys keep their positions ascending) and pos [n], its inverse.  With the
 * router's idx as keys (n = N * k, B = E) this is the histogram per expert
 * and the expert-contiguous order of the (token, slot) pairs. */
epj_status ej_tmpl_moe_sort(epj_ctx *ctx, const char *device,
			    const int64_t *key, int64_t n, int B,
			    int64_t *counts, int64_t *offsets, int64_t *order,
			    int64_t *pos);

/* Permute: out [R, H] = x[order[r] / k] (x [N, H] of dtype dt with element
 * strides sx0, sx1; any dtype of 2, 4 or 8 bytes). */
epj_status ej_tmpl_moe_permute(epj_ctx *ctx, const char *device, const void *x,
			       epj_dtype dt, int64_t sx0, int64_t sx1,
			       const int64_t *order, int k, int64_t R,
			       int64_t H, void *out);
/* Its backward: dx [N, H] = sum over j of dxs[pos[n * k + j]] (dxs [R, H]),
 * f32 accumulation (f64 for f64), dtype dt (f32, bf16, f64). */
epj_status ej_tmpl_moe_permute_backward(epj_ctx *ctx, const char *device,
					const void *dxs, epj_dtype dt,
					const int64_t *pos, int64_t N, int k,
					int64_t H, void *dx);

/* Unpermute + weighted combine: out [N, H] (dtype dt) = sum over j in j
 * order of w[n, j] * y[pos[n * k + j]] computed in wdt (rdt: f32 or f64),
 * y [R, H] of dtype dt (f32, bf16, f64). */
epj_status ej_tmpl_moe_combine(epj_ctx *ctx, const char *device, const void *y,
			       epj_dtype dt, const void *w, epj_dtype wdt,
			       const int64_t *pos, int64_t N, int k, int64_t H,
			       void *out);
/* Its backward from dout [N, H] (dtype dt): dy [R, H] (dt) with dy[pos[s]]
 * = w[s] * dout[s / k] for every slot s (pos a permutation of [0, R)), and
 * dw [N, k] (wdt) = sum over h of dout[n, h] * y[pos[n, j], h].  Either
 * output may be NULL (not computed). */
epj_status ej_tmpl_moe_combine_backward(epj_ctx *ctx, const char *device,
					const void *dout, const void *y,
					epj_dtype dt, const void *w,
					epj_dtype wdt, const int64_t *pos,
					int64_t N, int k, int64_t H, void *dy,
					void *dw);

/* Router backward: dlogits [N, E] rdt from dw [N, k] rdt (the gradient of
 * ej_tmpl_moe_route's w), through the renormalisation when norm and the
 * softmax; probs and idx are the forward's. */
epj_status ej_tmpl_moe_route_backward(epj_ctx *ctx, const char *device,
				      const void *probs, const int64_t *idx,
				      const void *dw, epj_dtype rdt, int64_t N,
				      int E, int k, bool norm, void *dlogits);

/* SwiGLU over n contiguous elements of dtype dt (f32, bf16, f64), one
 * kernel: y = silu(g) * u; its backward from d (the gradient of y): dg =
 * d u s (1 + g (1 - s)), du = d g s, s = sigmoid(g).  f32 arithmetic for
 * bf16, rounded once; 16-byte accesses when every buffer is 16-byte
 * aligned (counters moe.swiglu.vec16 / moe.swiglu.scalar). */
epj_status ej_tmpl_swiglu(epj_ctx *ctx, const char *device, const void *g,
			  const void *u, epj_dtype dt, int64_t n, void *y);
epj_status ej_tmpl_swiglu_backward(epj_ctx *ctx, const char *device,
				   const void *d, const void *g, const void *u,
				   epj_dtype dt, int64_t n, void *dg, void *du);

/* ---- embedding and cross-entropy (templates/embedding.cuh) ------------- */

/* out [n, D] = w[ids[i]] (w [V, D] of dtype dt, element strides sw0, sw1);
 * ids in [0, V) (not checked here: the adapter checks). */
epj_status ej_tmpl_embedding(epj_ctx *ctx, const char *device, const void *w,
			     epj_dtype dt, int64_t sw0, int64_t sw1,
			     const int64_t *ids, int64_t n, int64_t D,
			     void *out);
/* dw [V, D] = sum of g[i] over ids[i] == v in index order (g [n, D] of
 * dtype dt, element strides sg0, sg1), f32 accumulation (f64 for f64). */
epj_status ej_tmpl_embedding_backward(epj_ctx *ctx, const char *device,
				      const void *g, epj_dtype dt, int64_t sg0,
				      int64_t sg1, const int64_t *ids,
				      int64_t n, int64_t V, int64_t D,
				      void *dw);
/* loss [] (f32, f64 for f64 logits) = mean over rows whose target is not
 * ign of logsumexp(row) - row[target]; NaN when every row is ignored.
 * logits [N, V] of dtype dt with element strides s0, s1; targets in [0, V)
 * or ign. */
epj_status ej_tmpl_cross_entropy(epj_ctx *ctx, const char *device,
				 const void *logits, epj_dtype dt, int64_t s0,
				 int64_t s1, const int64_t *tgt, int64_t N,
				 int64_t V, int64_t ign, void *loss);
/* dlogits [N, V] (dtype dt, contiguous) = (softmax - onehot) * g / valid
 * rows, zero rows for ignored targets; g the scalar upstream gradient
 * (device pointer, dtype gdt). */
epj_status ej_tmpl_cross_entropy_backward(
    epj_ctx *ctx, const char *device, const void *g, epj_dtype gdt,
    const void *logits, epj_dtype dt, int64_t s0, int64_t s1,
    const int64_t *tgt, int64_t N, int64_t V, int64_t ign, void *dlogits);

/* ---- eager adapters (op table) ----------------------------------------- */

/* The ops on the ctx's device with the templates above, for every dtype
 * and stride the CPU kernels accept, giving their results: index inputs are
 * read to the host, range-checked with the CPU kernels' errors and
 * uploaded as contiguous i64. */
epj_status ej_cuda_op_embedding(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_embedding_backward(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_cross_entropy(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_cross_entropy_backward(epj_ctx *ctx, ej_call *c);
/* The fused MoE ops of lib/ops_moe.c (moe_route, moe_permute,
 * moe_unpermute, swiglu and their backwards): the AutoEP layer's one data
 * path on the devices that run CUDA C.  k above EJ_TMPL_MOE_MAX_K, bf16
 * combine weights and a combine gradient of
 * another dtype than the expert outputs run the CPU kernel (counted). */
epj_status ej_cuda_op_moe_route(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_moe_route_backward(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_moe_permute(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_moe_permute_backward(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_moe_unpermute(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_moe_unpermute_backward(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_swiglu(epj_ctx *ctx, ej_call *c);
epj_status ej_cuda_op_swiglu_backward(epj_ctx *ctx, ej_call *c);

#endif
