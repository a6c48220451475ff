/* autoep.c -- the AutoEP MoE layer (DESIGN.md section 4), eager on every
 * backend.
 *
 *   hidden [B, T, H] -> x [N, H]                        (N = B*T)
 *   router:   logits = x @ gate.weight^T [N, E]; probs = softmax in fp32
 *             top-k -> (w [N, k], idx [N, k] i64), optional renormalisation
 *             (fixed routing: idx[n, j] = (n*k + j) % E, w = probs at idx)
 *   permute:  order = stable argsort of idx flattened [N*k]; the routed row r
 *             (sorted by expert, token order kept within one expert) carries
 *             token order[r] / k; x_sorted = x[token_of_row] [N*k, H]
 *   dispatch: split plan (rows per expert, per destination rank) exchanged,
 *             then AllToAll-v of the rows (world of one: nothing moves)
 *   experts:  SwiGLU per local expert on its contiguous block of rows
 *             (a grouped GEMM as a loop of linear calls): y_sorted [N*k, H]
 *   combine:  AllToAll-v back, then out[token] += w * y in fp32 (index_add),
 *             cast to hidden's dtype, reshaped to [B, T, H]
 *
 * Everything that carries values is computed with public epj_* ops, so
 * autograd covers the router, the experts and the input; only the index
 * bookkeeping (counts, token of each routed row) runs on the host and needs
 * no gradient.  The layer is compiler_disabled: the region compiler makes
 * every call of it a graph break and runs it eagerly, which is why forward
 * refuses to run while a recorder traces.
 *
 * Parameters (HF names under the layer): gate.weight [E, H],
 * experts.{e}.gate_proj.weight [I, H], experts.{e}.up_proj.weight [I, H],
 * experts.{e}.down_proj.weight [H, I]; a rank holds its E / world_size local
 * experts, named by their global index (all E in a world of one).
 *
 * Routing math runs in f32 for f32 and bf16 layers (as HF's router does) and
 * in f64 for f64 layers, so that the layer can be gradient-checked.
 */
#include "runtime_impl.h"

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define AUTOEP_KIND "AutoEPMoELayer"
/* Experts of one layer at most (the parameter list holds 1 + 3 x local
 * experts entries, counted in int). */
#define AUTOEP_MAX_EXPERTS (1 << 16)

typedef struct autoep_impl {
	ej_autoep_opts opts;
	int hidden, inter;
	epj_dtype dtype;
	ej_comm *comm;	 /* borrowed, or owned when owns_comm */
	bool owns_comm;	 /* NULL comm given: a private world of one */
	int n_local;	 /* experts on this rank: num_experts / comm->size */
	int first_local; /* global index of local expert 0 */
	epj_tensor *last_routing; /* [N, top_k] i64, owned, NULL before use */
	int64_t n_forward, n_replay; /* calls of this layer */
} autoep_impl;

static void autoep_impl_free(void *p)
{
	autoep_impl *im = p;
	if (!im)
		return;
	epj_tensor_free(im->last_routing);
	if (im->owns_comm)
		ej_comm_free(im->comm);
	free(im);
}

/* ---- helpers --------------------------------------------------------------
 */

/* t in dtype dt: a new reference to t itself when it already is. */
static epj_tensor *cast_to(epj_ctx *ctx, epj_tensor *t, epj_dtype dt)
{
	if (!t)
		return NULL;
	if (epj_tensor_dtype(t) == dt)
		return epj_tensor_ref(t);
	return epj_cast(ctx, t, dt);
}

/* All elements of an integer tensor as host int64 values (any backend:
 * through epj_tensor_to_f64, exact for |v| < 2^53). */
static epj_status index_to_host(epj_ctx *ctx, const epj_tensor *t, int64_t *out)
{
	int64_t n = epj_tensor_numel(t);
	double *tmp = malloc(sizeof *tmp * (size_t)(n > 0 ? n : 1));
	if (!tmp)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of host memory");
	epj_status s = epj_tensor_to_f64(ctx, t, tmp);
	for (int64_t i = 0; s == EPJ_OK && i < n; i++)
		out[i] = (int64_t)tmp[i];
	free(tmp);
	return s;
}

/* Token AllToAll-v of the rows of x [R, H] with send_counts[p] rows going to
 * rank p and recv_counts[p] rows coming from it; returns the received rows.
 * Autograd-aware by construction: its backward is the reverse exchange of the
 * gradient (counts swapped), which a multi-rank version records as one
 * custom node.  In a world of one every row stays here in the same order, so
 * no data moves and no node is needed: the result is x itself (a new
 * reference) and gradients flow through unchanged. */
static epj_tensor *ep_all_to_all(epj_ctx *ctx, const epj_module *m,
				 const ej_comm *comm, epj_tensor *x,
				 const int64_t *send_counts,
				 const int64_t *recv_counts)
{
	if (!x)
		return NULL;
	if (comm->size == 1) {
		EJ_ASSERT(send_counts[0] == recv_counts[0] &&
			  send_counts[0] == epj_tensor_dim(x, 0));
		return epj_tensor_ref(x);
	}
	ej_error(ctx, EPJ_ERR_UNSUPPORTED,
		 "%s (%s): token all_to_all_v over %d ranks (comm '%s'): "
		 "multi-rank AutoEP comes with the Distributed issue",
		 m->name, AUTOEP_KIND, comm->size, comm->name);
	return NULL;
}

/* Exchanges the split plan.  counts[e] = routed rows for global expert e.
 * Out: send_counts[p] / recv_counts[p] = rows to / from rank p (size P), and
 * local_counts[e] = rows this rank's local expert e receives from all ranks
 * (n_local).  The per-rank totals go through all_to_all_i64; the per-expert
 * detail (needed for the local-expert permutation) through all_to_all_v with
 * one row of n_local int64 per rank.
 *
 * With async_split_plan a multi-rank backend posts this exchange before the
 * tokens are permuted and waits for it only at the token dispatch, so it
 * overlaps with the permutation; in a world of one it completes at once, so
 * both modes take this synchronous path. */
static epj_status
exchange_split_plan(epj_ctx *ctx, const epj_module *m, const autoep_impl *im,
		    const int64_t *counts, int64_t *send_counts,
		    int64_t *recv_counts, int64_t *local_counts)
{
	const ej_comm *comm = im->comm;
	int P = comm->size, L = im->n_local;
	int64_t *ones = malloc(sizeof *ones * (size_t)P);
	int64_t *recv_plan = malloc(sizeof *recv_plan * (size_t)P * (size_t)L);
	if (!ones || !recv_plan) {
		free(ones);
		free(recv_plan);
		return ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory",
				m->name, AUTOEP_KIND);
	}
	for (int p = 0; p < P; p++) {
		ones[p] = 1;
		send_counts[p] = 0;
		/* global experts of rank p: [p*L, (p+1)*L) */
		for (int e = 0; e < L; e++)
			send_counts[p] += counts[(int64_t)p * L + e];
	}
	const char *what = "all_to_all_i64";
	epj_status s =
	    comm->all_to_all_i64(comm->self, send_counts, recv_counts);
	if (s == EPJ_OK) {
		/* counts is laid out [P][L] already: row p goes to rank p */
		what = "all_to_all_v (split plan)";
		s = comm->all_to_all_v(comm->self, counts, ones, recv_plan,
				       ones, sizeof(int64_t) * (size_t)L);
	}
	if (s == EPJ_OK) {
		for (int e = 0; e < L; e++) {
			local_counts[e] = 0;
			for (int p = 0; p < P; p++)
				local_counts[e] +=
				    recv_plan[(int64_t)p * L + e];
		}
	}
	free(ones);
	free(recv_plan);
	if (s != EPJ_OK)
		return ej_error(ctx, s, "%s (%s): comm '%s' %s failed (%s)",
				m->name, AUTOEP_KIND, comm->name, what,
				epj_status_name(s));
	return EPJ_OK;
}

/* SwiGLU experts over rows grouped by local expert: block e holds
 * local_counts[e] consecutive rows of x_recv [R, H].  Returns y [R, H] (the
 * blocks' outputs concatenated in the same order); experts without rows are
 * skipped.  Parameters are looked up by name on every call, so a caller that
 * replaces a parameter tensor is seen. */
static epj_tensor *run_experts(epj_ctx *ctx, epj_module *m,
			       const autoep_impl *im, epj_tensor *x_recv,
			       const int64_t *local_counts)
{
	epj_module *experts = ej_module_child(m, "experts");
	EJ_ASSERT(experts != NULL);
	epj_tensor **ys = calloc((size_t)im->n_local, sizeof *ys);
	if (!ys) {
		ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory", m->name,
			 AUTOEP_KIND);
		return NULL;
	}
	int n_y = 0;
	int64_t start = 0;
	bool failed = false;
	for (int e = 0; e < im->n_local && !failed; e++) {
		int64_t c = local_counts[e];
		if (c == 0)
			continue;
		char local[32];
		snprintf(local, sizeof local, "%d", im->first_local + e);
		epj_module *ex = ej_module_child(experts, local);
		EJ_ASSERT(ex != NULL);
		epj_tensor *wg =
		    ej_module_param(ej_module_child(ex, "gate_proj"), "weight");
		epj_tensor *wu =
		    ej_module_param(ej_module_child(ex, "up_proj"), "weight");
		epj_tensor *wd =
		    ej_module_param(ej_module_child(ex, "down_proj"), "weight");
		EJ_ASSERT(wg && wu && wd);
		/* rows [c, H] -> silu(rows Wg^T) * (rows Wu^T) [c, I] -> [c, H]
		 */
		epj_tensor *rows =
		    epj_slice(ctx, x_recv, 0, start, start + c, 1);
		epj_tensor *g = epj_linear(ctx, rows, wg, NULL);
		epj_tensor *u = epj_linear(ctx, rows, wu, NULL);
		epj_tensor *sg = epj_silu(ctx, g);
		epj_tensor *h = epj_mul(ctx, sg, u);
		ys[n_y] = epj_linear(ctx, h, wd, NULL);
		failed = ys[n_y] == NULL;
		n_y++;
		epj_tensor_free(rows);
		epj_tensor_free(g);
		epj_tensor_free(u);
		epj_tensor_free(sg);
		epj_tensor_free(h);
		start += c;
	}
	epj_tensor *y = NULL;
	if (!failed) {
		/* every routed row belongs to some expert, and R >= 1 */
		EJ_ASSERT(n_y > 0 && start == epj_tensor_dim(x_recv, 0));
		y = epj_cat(ctx, ys, n_y, 0);
	}
	for (int i = 0; i < n_y; i++)
		epj_tensor_free(ys[i]);
	free(ys);
	return y;
}

/* ---- forward --------------------------------------------------------------
 */

static epj_status check_input(epj_ctx *ctx, const epj_module *m,
			      const autoep_impl *im, const epj_tensor *hidden)
{
	char d[96];
	if (!hidden)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): hidden states are NULL", m->name,
				AUTOEP_KIND);
	epj_tensor_describe(hidden, d, sizeof d);
	int nd = epj_tensor_ndim(hidden);
	if (nd < 2 || epj_tensor_dim(hidden, -1) != im->hidden)
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"%s (%s): hidden states %s, expected [B, T, "
				"%d] (hidden size %d)",
				m->name, AUTOEP_KIND, d, im->hidden,
				im->hidden);
	if (epj_tensor_dtype(hidden) != im->dtype)
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"%s (%s): hidden states %s, layer dtype is %s",
				m->name, AUTOEP_KIND, d,
				epj_dtype_name(im->dtype));
	if (epj_tensor_numel(hidden) == 0)
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"%s (%s): empty hidden states %s", m->name,
				AUTOEP_KIND, d);
	return EPJ_OK;
}

/* Router: probs [N, E] in rdt, then (w [N, k] in rdt, idx [N, k] i64). */
static epj_status route(epj_ctx *ctx, epj_module *m, const autoep_impl *im,
			epj_tensor *x, epj_dtype rdt, int64_t N,
			epj_tensor **w_out, epj_tensor **idx_out)
{
	const int E = im->opts.num_experts, k = im->opts.top_k;
	epj_tensor *gw = ej_module_param(ej_module_child(m, "gate"), "weight");
	EJ_ASSERT(gw != NULL);
	epj_tensor *logits = epj_linear(ctx, x, gw, NULL); /* [N, E] */
	epj_tensor *logits_r = cast_to(ctx, logits, rdt);
	epj_tensor *probs = epj_softmax(ctx, logits_r, -1);
	epj_tensor_free(logits);
	epj_tensor_free(logits_r);
	if (!probs)
		return epj_ctx_status(ctx);

	epj_tensor *w = NULL, *idx = NULL;
	epj_status s = EPJ_OK;
	if (im->opts.fixed_routing) {
		/* Deterministic balanced assignment, built directly; the
		 * weights still come from probs so the router trains. */
		int64_t *h = malloc(sizeof *h * (size_t)(N * k));
		if (!h) {
			epj_tensor_free(probs);
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"%s (%s): out of memory", m->name,
					AUTOEP_KIND);
		}
		for (int64_t n = 0; n < N; n++)
			for (int j = 0; j < k; j++)
				h[n * k + j] = (n * k + j) % E;
		int64_t shape[2] = { N, k };
		idx = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, shape, h);
		free(h);
		w = epj_gather(ctx, probs, 1, idx);
		if (!w)
			s = epj_ctx_status(ctx);
	} else {
		s = epj_topk(ctx, probs, k, &w, &idx);
	}
	epj_tensor_free(probs);
	if (s == EPJ_OK && im->opts.norm_topk_prob) {
		epj_tensor *sum = epj_sum(ctx, w, -1, true);
		epj_tensor *wn = epj_div(ctx, w, sum);
		epj_tensor_free(sum);
		epj_tensor_free(w);
		w = wn;
	}
	if (s == EPJ_OK && (!w || !idx))
		s = epj_ctx_status(ctx); /* an op above failed */
	if (s != EPJ_OK) {
		epj_tensor_free(w);
		epj_tensor_free(idx);
		return s;
	}
	*w_out = w;
	*idx_out = idx;
	return EPJ_OK;
}

static epj_status autoep_forward(epj_ctx *ctx, epj_module *m,
				 epj_tensor *const *in, int n_in,
				 epj_tensor **out, int n_out)
{
	autoep_impl *im = m->impl;
	EJ_ASSERT(im != NULL);
	if (n_in < 1 || n_out < 1)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): takes 1 input and 1 output, got %d "
				"and %d",
				m->name, AUTOEP_KIND, n_in, n_out);
	out[0] = NULL;
	if (ctx->recorder)
		return ej_error(ctx, EPJ_ERR_STATE,
				"%s (%s): called while tracing; the layer is "
				"compiler_disabled and runs eagerly (graph "
				"break)",
				m->name, AUTOEP_KIND);
	epj_tensor *hidden = in[0];
	/* The layer computes in its parameters' current dtype: the engine may
	 * have converted them (bf16.enabled) since construction. */
	epj_tensor *gw = ej_module_param(ej_module_child(m, "gate"), "weight");
	if (gw)
		im->dtype = epj_tensor_dtype(gw);
	epj_status s = check_input(ctx, m, im, hidden);
	if (s != EPJ_OK)
		return s;

	const int k = im->opts.top_k, E = im->opts.num_experts;
	const int P = im->comm->size;
	const int64_t H = im->hidden;
	const int64_t N = epj_tensor_numel(hidden) / H, R = N * k;
	const epj_dtype rdt =
	    im->dtype == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;

	/* host bookkeeping (owned) */
	int64_t *idx_h = malloc(sizeof *idx_h * (size_t)R);
	int64_t *order_h = malloc(sizeof *order_h * (size_t)R);
	int64_t *tok_h = malloc(sizeof *tok_h * (size_t)R);
	int64_t *counts = calloc((size_t)E, sizeof *counts);
	int64_t *send_counts = calloc((size_t)P, sizeof *send_counts);
	int64_t *recv_counts = calloc((size_t)P, sizeof *recv_counts);
	int64_t *local_counts = calloc((size_t)im->n_local, sizeof(int64_t));
	/* tensors (owned) */
	epj_tensor *x = NULL, *w = NULL, *idx = NULL, *idx_flat = NULL,
		   *order = NULL, *tok = NULL, *x_sorted = NULL, *x_recv = NULL,
		   *y_recv = NULL, *y_sorted = NULL, *w_flat = NULL,
		   *w_sorted = NULL, *w_col = NULL, *y_r = NULL, *y_w = NULL,
		   *acc = NULL, *out_r = NULL, *out_h = NULL, *routing = NULL;

	if (!idx_h || !order_h || !tok_h || !counts || !send_counts ||
	    !recv_counts || !local_counts) {
		s = ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory",
			     m->name, AUTOEP_KIND);
		goto done;
	}

	int64_t flat_shape[2] = { N, H };
	x = epj_reshape(ctx, hidden, 2, flat_shape); /* [N, H] */
	if (!x) {
		s = epj_ctx_status(ctx);
		goto fail_op;
	}
	s = route(ctx, m, im, x, rdt, N, &w, &idx); /* [N, k] each */
	if (s != EPJ_OK)
		goto fail_op;

	/* Permutation: routed rows sorted by expert (stable, so rows of one
	 * expert keep token order); routed row r carries token order[r] / k. */
	idx_flat = epj_reshape(ctx, idx, 1, &R);
	order = epj_argsort(ctx, idx_flat, 0);
	if (!order) {
		s = epj_ctx_status(ctx);
		goto fail_op;
	}
	s = index_to_host(ctx, idx, idx_h);
	if (s == EPJ_OK)
		s = index_to_host(ctx, order, order_h);
	if (s != EPJ_OK)
		goto fail_op;
	for (int64_t r = 0; r < R; r++) {
		EJ_ASSERT(idx_h[r] >= 0 && idx_h[r] < E);
		counts[idx_h[r]]++;
		tok_h[r] = order_h[r] / k;
	}
	routing = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2,
				       (int64_t[]){ N, k }, idx_h);
	tok = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 1, &R, tok_h);
	if (!routing || !tok) {
		s = epj_ctx_status(ctx);
		goto fail_op;
	}

	/* Split plan, then dispatch of the rows [R, H] to their experts'
	 * ranks.  The rows of rank p's experts are contiguous in x_sorted
	 * because experts are assigned to ranks in blocks of n_local. */
	s = exchange_split_plan(ctx, m, im, counts, send_counts, recv_counts,
				local_counts);
	if (s != EPJ_OK)
		goto done;
	x_sorted = epj_index_select(ctx, x, 0, tok); /* [R, H] */
	if (!x_sorted) {
		s = epj_ctx_status(ctx);
		goto fail_op;
	}
	x_recv =
	    ep_all_to_all(ctx, m, im->comm, x_sorted, send_counts, recv_counts);
	if (!x_recv) {
		s = epj_ctx_status(ctx);
		goto done; /* the message names the layer already */
	}
	/* Local-expert permutation: received rows are grouped by source rank
	 * and by local expert within it; regrouping them by local expert is
	 * the identity for a single source rank (a world of one, the only
	 * case the exchange above lets through). */
	EJ_ASSERT(P == 1);

	y_recv = run_experts(ctx, m, im, x_recv, local_counts); /* [R, H] */
	if (!y_recv) {
		s = epj_ctx_status(ctx);
		goto fail_op;
	}
	/* Return the expert outputs to the ranks their tokens came from. */
	y_sorted =
	    ep_all_to_all(ctx, m, im->comm, y_recv, recv_counts, send_counts);
	if (!y_sorted) {
		s = epj_ctx_status(ctx);
		goto done;
	}

	/* Unpermute + weighted combine in fp32 (f64 for f64 layers):
	 * out[tok[r]] += w_flat[order[r]] * y_sorted[r]. */
	w_flat = epj_reshape(ctx, w, 1, &R);
	w_sorted = epj_index_select(ctx, w_flat, 0, order); /* [R] */
	w_col = epj_reshape(ctx, w_sorted, 2, (int64_t[]){ R, 1 });
	y_r = cast_to(ctx, y_sorted, rdt);
	y_w = epj_mul(ctx, y_r, w_col); /* [R, H] */
	acc = epj_zeros(ctx, rdt, 2, flat_shape);
	out_r = epj_index_add(ctx, acc, 0, tok, y_w); /* [N, H] */
	out_h = cast_to(ctx, out_r, im->dtype);
	out[0] = epj_reshape(ctx, out_h, epj_tensor_ndim(hidden),
			     epj_tensor_shape(hidden));
	if (!out[0]) {
		s = epj_ctx_status(ctx);
		goto fail_op;
	}

	/* Routing record of this call (no grad: built from host values). */
	epj_tensor_free(im->last_routing);
	im->last_routing = routing;
	routing = NULL;
	/* Count completed calls by kind: a checkpoint replay in backward
	 * (ej_in_replay; read directly here) recomputes a forward that was
	 * counted already. */
	if (ctx->rt_replay_depth > 0) {
		epj_counter_add(ctx, "autoep.calls.replay", 1);
		im->n_replay++;
	} else {
		epj_counter_add(ctx, "autoep.calls.forward", 1);
		im->n_forward++;
	}
	s = EPJ_OK;
	goto done;

fail_op:
	/* An op failed: its message names the op and shapes; add the layer. */
	if (s == EPJ_OK)
		s = EPJ_ERR_INVALID;
	ej_error_prefix(ctx, "%s (%s)", m->name, AUTOEP_KIND);
done:
	epj_tensor_free(x);
	epj_tensor_free(w);
	epj_tensor_free(idx);
	epj_tensor_free(idx_flat);
	epj_tensor_free(order);
	epj_tensor_free(tok);
	epj_tensor_free(x_sorted);
	epj_tensor_free(x_recv);
	epj_tensor_free(y_recv);
	epj_tensor_free(y_sorted);
	epj_tensor_free(w_flat);
	epj_tensor_free(w_sorted);
	epj_tensor_free(w_col);
	epj_tensor_free(y_r);
	epj_tensor_free(y_w);
	epj_tensor_free(acc);
	epj_tensor_free(out_r);
	epj_tensor_free(out_h);
	epj_tensor_free(routing);
	free(idx_h);
	free(order_h);
	free(tok_h);
	free(counts);
	free(send_counts);
	free(recv_counts);
	free(local_counts);
	return s;
}

/* ---- construction ---------------------------------------------------------
 */

static epj_status check_opts(epj_ctx *ctx, const char *local, int hidden,
			     int inter, const ej_autoep_opts *o, epj_dtype dt,
			     double init_std, const ej_comm *comm)
{
	const char *who = local ? local : "(null)";
	if (!o)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): options are NULL", who, AUTOEP_KIND);
	if (hidden < 1 || inter < 1)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): hidden size %d and intermediate "
				"size %d must be >= 1",
				who, AUTOEP_KIND, hidden, inter);
	if (o->num_experts < 1 || o->num_experts > AUTOEP_MAX_EXPERTS)
		return ej_error(
		    ctx, EPJ_ERR_INVALID,
		    "%s (%s): num_experts %d is out of range [1, %d]", who,
		    AUTOEP_KIND, o->num_experts, AUTOEP_MAX_EXPERTS);
	/* Elements of the gate and of all experts (3 matrices each), in
	 * checked arithmetic: each tensor's and the sum must fit in int64. */
	int64_t gate_n, exp_n, all_n;
	if (__builtin_mul_overflow((int64_t)o->num_experts, (int64_t)hidden,
				   &gate_n) ||
	    __builtin_mul_overflow((int64_t)inter, (int64_t)hidden, &exp_n) ||
	    __builtin_mul_overflow(exp_n, (int64_t)3 * o->num_experts,
				   &all_n) ||
	    __builtin_add_overflow(all_n, gate_n, &all_n))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): num_experts %d x 3 x intermediate "
				"%d x hidden %d parameters overflow 64 bits "
				"(at most %" PRId64 " elements)",
				who, AUTOEP_KIND, o->num_experts, inter, hidden,
				INT64_MAX);
	if (o->top_k < 1 || o->top_k > o->num_experts)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): top_k %d must be in [1, "
				"num_experts %d]",
				who, AUTOEP_KIND, o->top_k, o->num_experts);
	if (dt != EPJ_DTYPE_F32 && dt != EPJ_DTYPE_BF16 && dt != EPJ_DTYPE_F64)
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"%s (%s): dtype %s, expected f32, bf16 or f64",
				who, AUTOEP_KIND, epj_dtype_name(dt));
	if (!(init_std >= 0) || isinf(init_std))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): init_std %g must be finite and >= 0",
				who, AUTOEP_KIND, init_std);
	if (comm &&
	    (comm->size < 1 || comm->rank < 0 || comm->rank >= comm->size ||
	     o->num_experts % comm->size != 0))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): num_experts %d cannot be split over "
				"comm '%s' (rank %d of %d)",
				who, AUTOEP_KIND, o->num_experts, comm->name,
				comm->rank, comm->size);
	return EPJ_OK;
}

epj_module *ej_autoep_new(epj_ctx *ctx, epj_module *parent, const char *local,
			  int hidden, int inter, const ej_autoep_opts *opts,
			  epj_dtype dt, double init_std, ej_comm *comm)
{
	if (check_opts(ctx, local, hidden, inter, opts, dt, init_std, comm) !=
	    EPJ_OK)
		return NULL;
	autoep_impl *im = calloc(1, sizeof *im);
	if (!im) {
		ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory", local,
			 AUTOEP_KIND);
		return NULL;
	}
	im->opts = *opts;
	im->hidden = hidden;
	im->inter = inter;
	im->dtype = dt;
	im->comm = comm;
	if (!comm) {
		im->comm = ej_comm_self_new();
		im->owns_comm = true;
		if (!im->comm) {
			free(im);
			ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory",
				 local, AUTOEP_KIND);
			return NULL;
		}
	}
	im->n_local = opts->num_experts / im->comm->size;
	im->first_local = im->comm->rank * im->n_local;
	const int first_local = im->first_local;

	/* Draw every parameter first, in the documented order (gate, then
	 * experts' gate_proj, up_proj, down_proj), so that a failure leaves
	 * no half-built layer in the parent. */
	const int L = im->n_local, np = 1 + 3 * L;
	epj_tensor **p = calloc((size_t)np, sizeof *p);
	if (!p) {
		autoep_impl_free(im);
		ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory", local,
			 AUTOEP_KIND);
		return NULL;
	}
	int64_t sh_gate[2] = { opts->num_experts, hidden };
	int64_t sh_in[2] = { inter, hidden }, sh_out[2] = { hidden, inter };
	bool ok = true;
	p[0] = epj_randn(ctx, dt, 2, sh_gate, 0.0, init_std);
	ok = p[0] != NULL;
	for (int e = 0; e < L && ok; e++) {
		p[1 + 3 * e] = epj_randn(ctx, dt, 2, sh_in, 0.0, init_std);
		p[2 + 3 * e] = epj_randn(ctx, dt, 2, sh_in, 0.0, init_std);
		p[3 + 3 * e] = epj_randn(ctx, dt, 2, sh_out, 0.0, init_std);
		ok = p[1 + 3 * e] && p[2 + 3 * e] && p[3 + 3 * e];
	}
	if (!ok) {
		for (int i = 0; i < np; i++)
			epj_tensor_free(p[i]);
		free(p);
		autoep_impl_free(im);
		ej_error_prefix(ctx, "%s (%s): parameter init", local,
				AUTOEP_KIND);
		return NULL;
	}

	/* The tree: every ej_module_add_param consumes its tensor, also when
	 * it fails; a failure detaches the half-built layer (the last child
	 * of parent) and frees it. */
	epj_module *m =
	    ej_module_new(parent, local, AUTOEP_KIND, autoep_forward);
	int used = 0;
	ok = m != NULL;
	if (ok) {
		m->compiler_disabled = true;
		m->impl = im;
		m->impl_free = autoep_impl_free;
		im = NULL; /* owned by m now */
		epj_module *gate = ej_module_new(m, "gate", "Linear", NULL);
		ok = gate && ej_module_add_param(gate, "weight", p[used++]);
	}
	epj_module *experts =
	    ok ? ej_module_new(m, "experts", "ModuleList", NULL) : NULL;
	ok = ok && experts;
	static const char *const proj[3] = { "gate_proj", "up_proj",
					     "down_proj" };
	for (int e = 0; e < L && ok; e++) {
		char name[32];
		snprintf(name, sizeof name, "%d", first_local + e);
		epj_module *ex =
		    ej_module_new(experts, name, "Qwen3MoeMLP", NULL);
		ok = ex != NULL;
		for (int j = 0; j < 3 && ok; j++) {
			epj_module *lin =
			    ej_module_new(ex, proj[j], "Linear", NULL);
			ok = lin &&
			     ej_module_add_param(lin, "weight", p[used++]);
		}
	}
	for (int i = used; i < np; i++)
		epj_tensor_free(p[i]);
	free(p);
	if (!ok) {
		if (m && parent) {
			EJ_ASSERT(parent->n_children > 0 &&
				  parent->children[parent->n_children - 1] ==
				      m);
			parent->n_children--;
		}
		ej_module_free(m);
		autoep_impl_free(im); /* when m was never made */
		ej_error(ctx, EPJ_ERR_NOMEM,
			 "%s (%s): out of memory building "
			 "the module tree",
			 local, AUTOEP_KIND);
		return NULL;
	}
	return m;
}

epj_tensor *ej_autoep_last_routing(const epj_module *m)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return NULL;
	const autoep_impl *im = m->impl;
	return im->last_routing;
}

epj_status ej_autoep_set_routing(epj_module *m, bool fixed_routing,
				 bool async_split_plan)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return EPJ_ERR_INVALID;
	autoep_impl *im = m->impl;
	im->opts.fixed_routing = fixed_routing;
	im->opts.async_split_plan = async_split_plan;
	return EPJ_OK;
}
