/* ops_moe.h -- the fused MoE ops of lib/ops_moe.c (rows MOE_* and SWIGLU of
 * ops.def): the calls the eager AutoEP layer (runtime/autoep.c) makes
 * instead of its sequence of generic ops.  Each is one dispatch, so one
 * kernel launch in kernels.launched.eager, and has its own backward op.
 *
 * Shapes (N tokens, E experts, k slots per token, R = N * k routed rows,
 * H hidden, G groups):
 *   ej_moe_route     logits [N, E] -> w [N, k] (f32, f64 for f64 logits),
 *                    idx [N, k] i64: softmax over E, the k largest (ties to
 *                    the lower expert, NaN largest), w renormalised to sum 1
 *                    when norm; fixed: idx[n, j] = (n k + j) % E instead of
 *                    the top-k, w = probabilities there (renormalised when
 *                    norm)
 *   ej_moe_permute   x [N, H], idx [N, k] -> x_sorted [R, H] (the routed
 *                    rows sorted by expert, slot order within one expert:
 *                    a stable sort), pos [N, k] i64 (row of slot (n, j) in
 *                    x_sorted), counts [E] i64 (rows per expert)
 *   ej_moe_unpermute y [R, H], w [N, k], pos [N, k] -> out [N, H] in y's
 *                    dtype: out[n] = sum_j w[n, j] y[pos[n, j]], summed in
 *                    w's dtype over j in slot order
 *   ej_moe_grouped_mm x [R, K], counts [G] i64 (sum R), w[G] -> y [R, M]:
 *                    block g (counts[g] consecutive rows) times w[g]^T
 *                    (w_trans, w[g] [M, K]) or w[g] (w[g] [K, M])
 *   ej_swiglu        gate, up of one shape -> silu(gate) * up
 */
#ifndef EPJIT_OPS_MOE_H
#define EPJIT_OPS_MOE_H

#include "core_impl.h"

epj_status ej_moe_route(epj_ctx *ctx, epj_tensor *logits, int k, bool norm,
			bool fixed, epj_tensor **w, epj_tensor **idx);
epj_status ej_moe_permute(epj_ctx *ctx, epj_tensor *x, epj_tensor *idx, int E,
			  epj_tensor **x_sorted, epj_tensor **pos,
			  epj_tensor **counts);
epj_tensor *ej_moe_unpermute(epj_ctx *ctx, epj_tensor *y, epj_tensor *w,
			     epj_tensor *pos);
epj_tensor *ej_moe_grouped_mm(epj_ctx *ctx, epj_tensor *x, epj_tensor *counts,
			      epj_tensor *const *w, int G, bool w_trans);
epj_tensor *ej_swiglu(epj_ctx *ctx, epj_tensor *gate, epj_tensor *up);
/* moe_permute's stable counting sort on the host: counts[E] the slots per
 * expert of idx[R] (values in [0, E)), pos[R] the row of every slot in
 * expert order.  off: scratch of E elements.  The CPU kernel runs it, and
 * the AutoEP layer for the host copy of the positions it pins. */
void ej_moe_positions(const int64_t *idx, int64_t R, int64_t E, int64_t *counts,
		      int64_t *off, int64_t *pos);

#endif /* EPJIT_OPS_MOE_H */
