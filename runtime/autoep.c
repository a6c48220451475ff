/* autoep.c -- the AutoEP MoE layer (doc/design.md section 4), eager on every
 * backend.
 *
 *   hidden [B, T, H] -> x [N, H]                        (N = B*T)
 *   router:   logits = x @ gate.weight^T [N, E]; probs = softmax in fp32
 *             top-k -> (w [N, k], idx [N, k] i64), optional renormalisation
 *             (fixed routing: idx[n, j] = (n*k + j) % E, w = probs at idx)
 *   plan:     rows per global expert (from idx), exchanged with the EP
 *             group: rows to / from every rank, and per local expert the
 *             rows from every rank.  async_split_plan posts the exchange
 *             here and waits for it after the permutation
 *   permute:  order = stable argsort of idx flattened [N*k]; the routed row r
 *             (sorted by expert, token order kept within one expert) carries
 *             token order[r] / k; x_sorted = x[token_of_row] [N*k, H]; the
 *             rows of rank p's experts are contiguous (experts in blocks)
 *   dispatch: AllToAll-v of the rows (world of one: nothing moves), then the
 *             local-expert permutation: received rows, grouped by source
 *             rank, regrouped by local expert
 *   experts:  SwiGLU per local expert on its contiguous block of rows
 *             (a grouped GEMM as a loop of linear calls), unpermuted back
 *             to source-rank order
 *   combine:  AllToAll-v back with the reversed plan: y_sorted [N*k, H];
 *             then out[token] += w * y in fp32 (index_add), cast to
 *             hidden's dtype, reshaped to [B, T, H]
 *
 * Each AllToAll-v is one autograd node (a2a_rows) whose backward is the
 * reverse exchange of the gradient over the same group; the graph is the
 * same on every rank, so the backward exchanges match too.
 *
 * On a cuda context with an NCCL EP group the exchanges run on the
 * device's communication stream (ej_comm_a2av_start): forward, the
 * compute stream waits for the dispatch right before the regrouping's
 * index_select and for the combine right before the weighted combine, and
 * meanwhile runs the shared expert (which the layer then computes itself,
 * ej_autoep_shared_in_layer) and the regrouping's index upload; backward,
 * each exchange's node waits at its end.  No host synchronization.
 *
 * Everything that carries values is computed with ops, so autograd covers
 * the router, the experts and the input; only the index bookkeeping
 * (counts, the split plan, the local-expert regrouping) runs on the host
 * and needs no gradient.  By default the router, the permutation, the
 * expert GEMMs with their SwiGLU and the combine are the fused MoE ops of
 * lib/ops_moe.c: one dispatch each, rows of every device's eager table
 * (the CPU kernels; the templates of templates/moe.cuh and
 * templates/gemm.cuh on the devices that run CUDA C), so the layer has
 * one data path on every device.  EPJIT_AUTOEP_OPS=sequence runs the
 * generic op sequence described above instead, the reference the tests
 * compare the fused ops with.  The layer is compiler_disabled: the
 * region compiler makes every call of it a graph break and runs it eagerly,
 * which is why forward refuses to run while a recorder traces.
 *
 * Parameters (HF names under the layer): gate.weight [E, H],
 * experts.{e}.gate_proj.weight [I, H], experts.{e}.up_proj.weight [I, H],
 * experts.{e}.down_proj.weight [H, I]; a rank holds the E / P local experts
 * of its position in the EP group of P ranks, named by their global index
 * (all E in a world of one; ej_autoep_shard drops the others).  All E are
 * drawn at construction, so an expert's initial values do not depend on P.
 *
 * Routing math runs in f32 for f32 and bf16 layers (as HF's router does) and
 * in f64 for f64 layers, so that the layer can be gradient-checked.
 */
#include "kernels.h" /* ej_index_pin */
#include "ops_moe.h"
#include "router_loss_impl.h"
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
	ej_comm *comm;	/* borrowed, or owned when owns_comm */
	bool owns_comm; /* NULL comm given: a private world of one */
	/* the device counterpart of comm (an `nccl` comm over the same ranks,
	 * borrowed from the engine) for the rows of a cuda context; NULL: none
	 * (host memory, or one rank) */
	ej_comm *dev_comm;
	/* the shared expert (NULL: none), computed here while the dispatch
	 * travels when dev_comm is set (ej_autoep_shared_in_layer) */
	ej_autoep_shared_fn shared_fn;
	int n_local;	 /* experts on this rank: num_experts / comm->size */
	int first_local; /* global index of local expert 0 */
	epj_tensor *last_routing; /* [N, top_k] i64, owned, NULL before use */
	int64_t ops_at_post;	  /* eager launches when the plan was posted */
	int64_t n_forward, n_replay; /* calls of this layer */
	/* the routing of every call since ej_autoep_routing_log_start, in
	 * call order (the parity harness); owned; log_on: recording */
	bool log_on;
	int n_log, cap_log;
	epj_tensor **log;
	bool *log_replay;
	/* the fused MoE ops (lib/ops_moe.c; rows of every device's eager
	 * table) instead of the generic op sequence; EPJIT_AUTOEP_OPS at
	 * construction, default fused */
	bool fused;
	/* score bias layers (DeepSeek-V3): tokens routed to each expert by
	 * the training forwards since the last ej_autoep_balance ([E],
	 * owned; NULL without a score bias) */
	int64_t *load;
	/* the model's router losses (borrowed; NULL: none) and this layer's
	 * index among the model's MoE layers */
	ej_rloss *rloss;
	int rloss_layer;
	/* the expert-load metrics: (token, expert) assignments to each of the
	 * E experts by this rank's calls (not replays) since the last
	 * ej_autoep_step_load_reset ([E], owned) */
	int64_t *step_load;
} autoep_impl;

static void autoep_impl_free(void *p)
{
	autoep_impl *im = p;
	if (!im)
		return;
	epj_tensor_free(im->last_routing);
	for (int i = 0; i < im->n_log; i++)
		epj_tensor_free(im->log[i]);
	free(im->log);
	free(im->log_replay);
	free(im->load);
	free(im->step_load);
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

/* The values of an index tensor on the host: on a device the host cannot
 * address, a dense i64 tensor in one copy ordered after the kernels of the
 * compute stream that wrote it (one stream synchronization per layer
 * call); else index_to_host. */
static epj_status index_dense_to_host(epj_ctx *ctx, const epj_tensor *t,
				      int64_t *out)
{
	const ej_device *dev = ctx->dev;
	if (dev->host_visible || t->dtype != EPJ_DTYPE_I64 ||
	    !ej_is_contiguous(t) || !t->storage)
		return index_to_host(ctx, t, out);
	const int64_t n = epj_tensor_numel(t);
	if (n > 0)
		dev->copy(dev->self, out, ej_data(t), sizeof *out * (size_t)n);
	return EPJ_OK;
}

/* The values of two i64 index tensors a and b on the host (ha, hb: their
 * element counts).  On a device the host cannot address, one copy of one
 * packed buffer (cat of both, made on the compute stream): one stream
 * synchronization per layer call instead of a full device synchronization
 * and a copy per tensor (epj_tensor_to_f64).  The copy is ordered after the
 * kernels that wrote a and b, which all run on that stream.  It is one copy
 * when hb follows ha in memory (hb == ha + numel(a)), as the caller lays
 * them out; else one per tensor. */
static epj_status index_pair_to_host(epj_ctx *ctx, epj_tensor *a, epj_tensor *b,
				     int64_t *ha, int64_t *hb)
{
	const ej_device *dev = ctx->dev;
	if (dev->host_visible || epj_tensor_dtype(a) != EPJ_DTYPE_I64 ||
	    epj_tensor_dtype(b) != EPJ_DTYPE_I64 || epj_tensor_ndim(a) != 1 ||
	    epj_tensor_ndim(b) != 1) {
		epj_status s = index_to_host(ctx, a, ha);
		return s == EPJ_OK ? index_to_host(ctx, b, hb) : s;
	}
	epj_tensor *ab[2] = { a, b };
	epj_tensor *cat = epj_cat(ctx, ab, 2, 0); /* [na + nb] i64, dense */
	if (!cat)
		return epj_ctx_status(ctx);
	EJ_ASSERT(ej_is_contiguous(cat) && cat->storage);
	int64_t na = epj_tensor_numel(a), nb = epj_tensor_numel(b);
	if (hb == ha + na) {
		if (na + nb > 0)
			dev->copy(dev->self, ha, ej_data(cat),
				  sizeof *ha * (size_t)(na + nb));
	} else {
		if (na > 0)
			dev->copy(dev->self, ha, ej_data(cat),
				  sizeof *ha * (size_t)na);
		if (nb > 0)
			dev->copy(dev->self, hb, (int64_t *)ej_data(cat) + na,
				  sizeof *hb * (size_t)nb);
	}
	epj_tensor_free(cat);
	return EPJ_OK;
}

/* An exchange on the device's communication stream whose end the compute
 * stream has not waited for yet (a2a_finish): nothing on the compute
 * stream may read the received rows, or reuse the send buffer's memory,
 * before then.  send holds the send buffer until the wait (the caching
 * allocator would otherwise hand its memory to the next kernel while the
 * exchange still reads it); ops: eager launches at the start. */
typedef struct a2a_pending {
	ej_comm *dev_comm; /* NULL: nothing in flight */
	const char *what;
	epj_tensor *send;
	int64_t ops;
} a2a_pending;

/* The compute stream waits for the pending exchange (no host
 * synchronization); the eager kernels issued since its start, which ran
 * while it did, are counted in autoep.a2a.overlapped_ops. */
static epj_status a2a_finish(epj_ctx *ctx, a2a_pending *pd)
{
	if (!pd || !pd->dev_comm)
		return EPJ_OK;
	epj_counter_add(ctx, "autoep.a2a.overlapped_ops",
			epj_counter_get(ctx, "kernels.launched.eager") -
			    pd->ops);
	epj_status s = ej_comm_a2av_wait(ctx, pd->dev_comm, pd->what);
	epj_tensor_free(pd->send);
	*pd = (a2a_pending){ 0 };
	return s;
}

/* Token AllToAll-v of the rows of x [R, H] with send_counts[p] rows going to
 * rank p and recv_counts[p] rows coming from it; returns the received rows
 * [sum recv_counts, H].  With grad enabled and x requiring grad, the result
 * carries one custom autograd node whose backward is the reverse exchange
 * of the gradient (counts swapped) over the same comm.  Every rank runs
 * that backward in the same order (the graph is the same on every rank),
 * also for zero rows, so the collectives match.  In a world of one every
 * row stays here in the same order, so no data moves and no node is
 * needed: the result is x itself (a new reference). */
typedef struct a2a_node {
	ej_comm *comm, *dev_comm;
	int P;
	int64_t *send, *recv; /* of the forward exchange */
	const char *what;     /* counter / message name of the backward */
	a2a_pending pd;	      /* the backward's exchange in flight */
} a2a_node;

static void a2a_node_free(void *p)
{
	a2a_node *a = p;
	if (!a)
		return;
	EJ_ASSERT(!a->pd.dev_comm); /* the engine finished it */
	free(a->send);
	free(a->recv);
	free(a);
}

/* The autograd engine's wait for the backward exchange left in flight
 * (before the gradient's first reader); the kernels issued meanwhile are
 * counted in autoep.a2a.backward_overlapped_ops. */
static epj_status a2a_node_finish(epj_ctx *ctx, ej_node *n)
{
	a2a_node *a = n->custom;
	if (!a->pd.dev_comm)
		return EPJ_OK;
	epj_counter_add(ctx, "autoep.a2a.backward_overlapped_ops",
			epj_counter_get(ctx, "kernels.launched.eager") +
			    epj_counter_get(ctx, "kernels.launched.compiled") -
			    a->pd.ops);
	/* counted here, not in the forward's overlapped_ops */
	a->pd.ops = epj_counter_get(ctx, "kernels.launched.eager");
	return a2a_finish(ctx, &a->pd);
}

static epj_tensor *a2a_rows(epj_ctx *ctx, ej_comm *comm, ej_comm *dev_comm,
			    const char *what, epj_tensor *x,
			    const int64_t *send_counts,
			    const int64_t *recv_counts, a2a_pending *pd);

static epj_status a2a_backward(epj_ctx *ctx, ej_node *n,
			       epj_tensor *const *grad_out,
			       epj_tensor **grad_in)
{
	a2a_node *a = n->custom;
	epj_tensor *g = grad_out[0] ? epj_tensor_ref(grad_out[0]) : NULL;
	if (!g) {
		int64_t rows = 0;
		for (int p = 0; p < a->P; p++)
			rows += a->recv[p];
		int64_t sh[2] = { rows, n->in_meta[0].shape[1] };
		g = epj_zeros(ctx, n->in_meta[0].dtype, 2, sh);
		if (!g)
			return epj_ctx_status(ctx);
	}
	bool prev = epj_no_grad_enter(ctx);
	/* on the communication stream the exchange is left in flight when
	 * the engine allows it (bw_defer): it calls a2a_node_finish before
	 * the gradient's first reader and runs other nodes meanwhile;
	 * otherwise the compute stream waits for it at once (pd NULL) */
	int64_t ops = epj_counter_get(ctx, "kernels.launched.eager") +
		      epj_counter_get(ctx, "kernels.launched.compiled");
	grad_in[0] = a2a_rows(ctx, a->comm, a->dev_comm, a->what, g, a->recv,
			      a->send, n->bw_defer ? &a->pd : NULL);
	if (a->pd.dev_comm) {
		a->pd.ops = ops;
		n->bw_in_flight = true;
	}
	epj_no_grad_exit(ctx, prev);
	epj_tensor_free(g);
	return grad_in[0] ? EPJ_OK : epj_ctx_status(ctx);
}

/* pd: where an exchange on the communication stream is left pending for
 * the caller to finish before its first reader of the result; NULL: the
 * compute stream waits for it here. */
static epj_tensor *a2a_rows(epj_ctx *ctx, ej_comm *comm, ej_comm *dev_comm,
			    const char *what, epj_tensor *x,
			    const int64_t *send_counts,
			    const int64_t *recv_counts, a2a_pending *pd)
{
	const int P = comm->size;
	EJ_ASSERT(epj_tensor_ndim(x) == 2);
	int64_t rows_in = 0, rows_out = 0;
	for (int p = 0; p < P; p++) {
		rows_in += send_counts[p];
		rows_out += recv_counts[p];
	}
	EJ_ASSERT(rows_in == epj_tensor_dim(x, 0));
	const int64_t H = epj_tensor_dim(x, 1);
	epj_tensor *xc =
	    ej_is_contiguous(x) ? epj_tensor_ref(x) : epj_contiguous(ctx, x);
	int64_t sh[2] = { rows_out, H };
	epj_tensor *y =
	    xc ? ej_tensor_alloc(ctx, epj_tensor_dtype(x), 2, sh, false) : NULL;
	if (!y) {
		epj_tensor_free(xc);
		return NULL;
	}
	size_t row = (size_t)H * epj_dtype_size(epj_tensor_dtype(x));
	epj_status s;
	if (!ctx->dev->host_visible && P == 1) {
		/* one rank on the GPU: the rows stay in device memory */
		size_t bytes = (size_t)rows_in * row;
		if (bytes)
			ctx->dev->copy(ctx->dev->self, ej_data(y), ej_data(xc),
				       bytes);
		s = EPJ_OK;
	} else if (!ctx->dev->host_visible && !dev_comm) {
		s = ej_error(ctx, EPJ_ERR_UNSUPPORTED,
			     "%s: all-to-all of device memory over %d ranks "
			     "needs a device communicator (comm.backend "
			     "\"nccl\"; the engine sets it up)",
			     what, P);
	} else if (!ctx->dev->host_visible) {
		/* device rows over NCCL, on the communication stream after
		 * the compute stream's work so far; the compute stream waits
		 * for its end before the first kernel that reads y */
		EJ_ASSERT(dev_comm->size == P && dev_comm->rank == comm->rank);
		EJ_ASSERT(!pd || !pd->dev_comm);
		int64_t ops = epj_counter_get(ctx, "kernels.launched.eager");
		bool started = false;
		s = ej_comm_a2av_start(ctx, dev_comm, what, ej_data(xc),
				       send_counts, ej_data(y), recv_counts,
				       row, &started);
		if (s == EPJ_OK && started && pd) {
			*pd = (a2a_pending){ .dev_comm = dev_comm,
					     .what = what,
					     .send = xc,
					     .ops = ops };
			xc = NULL; /* held until the wait */
		} else if (s == EPJ_OK && started) {
			s = ej_comm_a2av_wait(ctx, dev_comm, what);
		}
	} else {
		s = ej_comm_a2av(ctx, comm, what, ej_data(xc), send_counts,
				 ej_data(y), recv_counts, row);
	}
	epj_tensor_free(xc);
	if (s != EPJ_OK) {
		epj_tensor_free(y);
		return NULL;
	}
	if (!epj_grad_enabled(ctx) || !x->requires_grad)
		return y;
	a2a_node *a = calloc(1, sizeof *a);
	if (a) {
		a->send = malloc(sizeof(int64_t) * (size_t)P);
		a->recv = malloc(sizeof(int64_t) * (size_t)P);
	}
	if (!a || !a->send || !a->recv) {
		a2a_node_free(a);
		a2a_finish(ctx, pd); /* y's memory is free to reuse after */
		epj_tensor_free(y);
		ej_error(ctx, EPJ_ERR_NOMEM, "all_to_all_v: out of memory");
		return NULL;
	}
	a->comm = comm;
	a->dev_comm = dev_comm;
	a->P = P;
	memcpy(a->send, send_counts, sizeof(int64_t) * (size_t)P);
	memcpy(a->recv, recv_counts, sizeof(int64_t) * (size_t)P);
	a->what = !strcmp(what, "autoep.dispatch") ? "autoep.dispatch_grad"
						   : "autoep.combine_grad";
	ej_node *node = ej_node_custom(ctx, "autoep.all_to_all_v", &x, 1, &y, 1,
				       a2a_backward, a, a2a_node_free);
	if (!node) {
		a2a_node_free(a);
		a2a_finish(ctx, pd);
		epj_tensor_free(y);
		return NULL;
	}
	if (dev_comm && !ctx->dev->host_visible)
		node->custom_finish = a2a_node_finish;
	if (y->grad_fn != node)
		ej_node_unref(node);
	return y;
}

static epj_tensor *ep_all_to_all(epj_ctx *ctx, const epj_module *m,
				 ej_comm *comm, ej_comm *dev_comm,
				 const char *what, epj_tensor *x,
				 const int64_t *send_counts,
				 const int64_t *recv_counts, a2a_pending *pd)
{
	if (!x)
		return NULL;
	if (comm->size == 1) {
		EJ_ASSERT(send_counts[0] == recv_counts[0] &&
			  send_counts[0] == epj_tensor_dim(x, 0));
		return epj_tensor_ref(x);
	}
	epj_tensor *y = a2a_rows(ctx, comm, dev_comm, what, x, send_counts,
				 recv_counts, pd);
	if (!y)
		ej_error_prefix(ctx, "%s (%s)", m->name, AUTOEP_KIND);
	return y;
}

/* The split plan.  counts[e] = routed rows for global expert e, laid out
 * [P][L] (rank p owns global experts [p*L, (p+1)*L)).  Out: send_counts[p]
 * / recv_counts[p] = rows to / from rank p, and recv_plan[p][l] = rows this
 * rank's local expert l receives from rank p.
 *
 * Synchronous plan: the per-rank totals through all_to_all_i64 and the
 * per-expert detail through all_to_all_v, now.  Asynchronous plan
 * (async_split_plan): plan_post posts one non-blocking exchange of the
 * [P][L] detail before the local permutation runs and plan_wait completes
 * it after (the totals follow from the detail), so the exchange overlaps
 * with the permutation; the numbers are the same. */
typedef struct split_plan {
	int P, L;
	int64_t *send_counts, *recv_counts, *recv_plan;
	ej_comm_req *req; /* posted, not yet waited for */
} split_plan;

static void plan_totals(split_plan *sp, const int64_t *counts)
{
	for (int p = 0; p < sp->P; p++) {
		sp->send_counts[p] = 0;
		for (int e = 0; e < sp->L; e++)
			sp->send_counts[p] += counts[(int64_t)p * sp->L + e];
	}
}

static epj_status plan_sync(epj_ctx *ctx, const epj_module *m,
			    const autoep_impl *im, split_plan *sp,
			    const int64_t *counts)
{
	ej_comm *comm = im->comm;
	int P = sp->P, L = sp->L;
	plan_totals(sp, counts);
	int64_t *ones = malloc(sizeof *ones * (size_t)P);
	if (!ones)
		return ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory",
				m->name, AUTOEP_KIND);
	for (int p = 0; p < P; p++)
		ones[p] = 1;
	epj_status s = ej_comm_a2a_i64(ctx, comm, "autoep.split_plan",
				       sp->send_counts, sp->recv_counts);
	/* counts is laid out [P][L] already: row p goes to rank p */
	if (s == EPJ_OK)
		s = ej_comm_a2av(ctx, comm, "autoep.split_plan", counts, ones,
				 sp->recv_plan, ones,
				 sizeof(int64_t) * (size_t)L);
	free(ones);
	if (s != EPJ_OK)
		ej_error_prefix(ctx, "%s (%s): split plan", m->name,
				AUTOEP_KIND);
	else
		epj_counter_add(ctx, "autoep.split_plan.sync", 1);
	return s;
}

static epj_status plan_post(epj_ctx *ctx, const epj_module *m,
			    const autoep_impl *im, split_plan *sp,
			    const int64_t *counts)
{
	plan_totals(sp, counts);
	epj_status s =
	    ej_comm_a2a_i64_start(ctx, im->comm, "autoep.split_plan", counts,
				  sp->recv_plan, sp->L, &sp->req);
	if (s != EPJ_OK)
		ej_error_prefix(ctx, "%s (%s): posting the split plan", m->name,
				AUTOEP_KIND);
	else
		epj_counter_add(ctx, "autoep.split_plan.async", 1);
	return s;
}

static epj_status plan_wait(epj_ctx *ctx, const epj_module *m,
			    const autoep_impl *im, split_plan *sp)
{
	ej_comm_req *r = sp->req;
	sp->req = NULL;
	epj_status s = ej_comm_wait(ctx, im->comm, "autoep.split_plan", r);
	if (s != EPJ_OK) {
		ej_error_prefix(ctx, "%s (%s): split plan", m->name,
				AUTOEP_KIND);
		return s;
	}
	for (int p = 0; p < sp->P; p++) {
		sp->recv_counts[p] = 0;
		for (int e = 0; e < sp->L; e++)
			sp->recv_counts[p] += sp->recv_plan[p * sp->L + e];
	}
	return EPJ_OK;
}

/* A posted plan that an error left behind is completed (its buffers are
 * the plan's) before the plan is freed; the first error stays. */
static void plan_drain(epj_ctx *ctx, const autoep_impl *im, split_plan *sp)
{
	if (!sp->req)
		return;
	char saved[1024];
	epj_status st = epj_ctx_status(ctx);
	snprintf(saved, sizeof saved, "%s", epj_ctx_error(ctx));
	ej_comm_req *r = sp->req;
	sp->req = NULL;
	(void)ej_comm_wait(ctx, im->comm, "autoep.split_plan (drain)", r);
	epj_counter_add(ctx, "autoep.split_plan.drained", 1);
	if (st != EPJ_OK)
		ej_error(ctx, st, "%s", saved);
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
		epj_tensor *wg = ej_module_param(
		    ej_module_child(ex, im->opts.proj[0]), "weight");
		epj_tensor *wu = ej_module_param(
		    ej_module_child(ex, im->opts.proj[1]), "weight");
		epj_tensor *wd = ej_module_param(
		    ej_module_child(ex, im->opts.proj[2]), "weight");
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
	if (!failed && n_y == 0) {
		/* A rank that received no rows: an empty result that stays
		 * connected to x_recv, so that the backward exchanges run on
		 * this rank too (the peers wait for them). */
		EJ_ASSERT(start == 0 && epj_tensor_dim(x_recv, 0) == 0);
		y = epj_mul(ctx, x_recv, x_recv);
	} else if (!failed) {
		/* every received row belongs to some local expert */
		EJ_ASSERT(start == epj_tensor_dim(x_recv, 0));
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

/* The experts as three grouped GEMMs and one SwiGLU over the rows of
 * x_recv [R, H] grouped by local expert (local_counts[e] rows each): the
 * fused counterpart of run_experts, same result.  Only experts that
 * receive rows take part, so an expert without rows gets no gradient, as
 * in run_experts. */
static epj_tensor *run_experts_fused(epj_ctx *ctx, epj_module *m,
				     const autoep_impl *im, epj_tensor *x_recv,
				     const int64_t *local_counts)
{
	epj_module *experts = ej_module_child(m, "experts");
	EJ_ASSERT(experts != NULL);
	const int L = im->n_local;
	epj_tensor **wg = calloc((size_t)L * 3, sizeof *wg);
	int64_t *cnt = malloc(sizeof *cnt * (size_t)L);
	if (!wg || !cnt) {
		free(wg);
		free(cnt);
		ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory", m->name,
			 AUTOEP_KIND);
		return NULL;
	}
	epj_tensor **wu = wg + L, **wd = wg + 2 * L;
	int G = 0;
	for (int e = 0; e < L; e++) {
		if (local_counts[e] == 0)
			continue;
		char local[32];
		snprintf(local, sizeof local, "%d", im->first_local + e);
		epj_module *ex = ej_module_child(experts, local);
		EJ_ASSERT(ex != NULL);
		wg[G] = ej_module_param(ej_module_child(ex, im->opts.proj[0]),
					"weight");
		wu[G] = ej_module_param(ej_module_child(ex, im->opts.proj[1]),
					"weight");
		wd[G] = ej_module_param(ej_module_child(ex, im->opts.proj[2]),
					"weight");
		EJ_ASSERT(wg[G] && wu[G] && wd[G]);
		cnt[G++] = local_counts[e];
	}
	epj_tensor *y = NULL;
	if (G == 0) {
		/* no rows: an empty result connected to x_recv (run_experts) */
		EJ_ASSERT(epj_tensor_dim(x_recv, 0) == 0);
		y = epj_mul(ctx, x_recv, x_recv);
	} else {
		epj_tensor *ct = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 1,
						      (int64_t[]){ G }, cnt);
		/* on a device the GEMMs (forward, backward, replays) take
		 * the counts from cnt instead of reading ct back: ct is
		 * ours, never written nor handed out */
		if (ct && ej_index_pin(ctx, ct, cnt) != EPJ_OK) {
			epj_tensor_free(ct);
			ct = NULL;
		}
		/* [R, H] -> silu(x Wg^T) * (x Wu^T) [R, I] -> [R, H] */
		epj_tensor *g = ej_moe_grouped_mm(ctx, x_recv, ct, wg, G, true);
		epj_tensor *u = ej_moe_grouped_mm(ctx, x_recv, ct, wu, G, true);
		epj_tensor *h = g && u ? ej_swiglu(ctx, g, u) : NULL;
		y = h ? ej_moe_grouped_mm(ctx, h, ct, wd, G, true) : NULL;
		epj_tensor_free(ct);
		epj_tensor_free(g);
		epj_tensor_free(u);
		epj_tensor_free(h);
	}
	free(wg);
	free(cnt);
	return y;
}

/* The best `k` of v[0..n) among the allowed (ok NULL: all), best first,
 * ties to the lower index, into out. */
static void top_of(const double *v, const bool *ok, int n, int k, int64_t *out)
{
	for (int j = 0; j < k; j++) {
		int best = -1;
		for (int e = 0; e < n; e++) {
			if (ok && !ok[e])
				continue;
			bool taken = false;
			for (int i = 0; i < j && !taken; i++)
				taken = out[i] == e;
			if (!taken && (best < 0 || v[e] > v[best]))
				best = e;
		}
		out[j] = best;
	}
}

void ej_autoep_select(const double *scores, const double *bias, int64_t n,
		      int E, int k, ej_route_groups groups, int n_group,
		      int topk_group, int64_t *idx)
{
	double *c = malloc(sizeof *c * (size_t)(2 * E));
	bool *ok = malloc(sizeof *ok * (size_t)E);
	int64_t *g_top = malloc(sizeof *g_top * (size_t)(E + 2));
	EJ_ASSERT(c && ok && g_top); /* E <= AUTOEP_MAX_EXPERTS */
	double *gs = c + E;
	const int per = groups != EJ_GROUPS_NONE ? E / n_group : E;
	for (int64_t t = 0; t < n; t++) {
		for (int e = 0; e < E; e++)
			c[e] = scores[t * E + e] + (bias ? bias[e] : 0.0);
		if (groups == EJ_GROUPS_NONE) {
			top_of(c, NULL, E, k, idx + t * k);
			continue;
		}
		for (int g = 0; g < n_group; g++) {
			int64_t two[2];
			int m = groups == EJ_GROUPS_TOP2 ? 2 : 1;
			top_of(c + g * per, NULL, per, m, two);
			gs[g] = c[g * per + two[0]];
			if (m == 2)
				gs[g] += c[g * per + two[1]];
		}
		top_of(gs, NULL, n_group, topk_group, g_top);
		for (int e = 0; e < E; e++)
			ok[e] = false;
		for (int j = 0; j < topk_group; j++)
			for (int e = 0; e < per; e++)
				ok[g_top[j] * per + e] = true;
		top_of(c, ok, E, k, idx + t * k);
	}
	free(c);
	free(ok);
	free(g_top);
}

/* DeepSeek's routers (ej_autoep_opts.scoring ...): from the logits in rdt
 * (router_logits), scores by softmax or sigmoid, the experts chosen on the host
 * from the scores (and the score bias) by ej_autoep_select (or the fixed
 * assignment), the weights gathered from the scores (so the router trains),
 * renormalised and scaled.  The host reads the scores: one synchronization on a
 * device, as the idx read of the other path. */
static epj_status route_scored(epj_ctx *ctx, epj_module *m,
			       const autoep_impl *im, epj_tensor *logits,
			       int64_t N, epj_tensor **w_out,
			       epj_tensor **idx_out)
{
	const int E = im->opts.num_experts, k = im->opts.top_k;
	epj_module *gate = ej_module_child(m, "gate");
	epj_tensor *gb = im->opts.score_bias
			     ? ej_module_param(gate, "e_score_correction_bias")
			     : NULL;
	EJ_ASSERT(gb || !im->opts.score_bias);
	enum { LG, SC, W, SUM, SUME, WN, WS, N_T };
	epj_tensor *t[N_T] = { 0 }, *idx = NULL;
	double *sc = malloc(sizeof *sc * (size_t)(N * E + E));
	int64_t *h = malloc(sizeof *h * (size_t)(N * k + 1));
	epj_status s = EPJ_OK;
	if (!sc || !h) {
		s = ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory",
			     m->name, AUTOEP_KIND);
		goto out;
	}
	t[LG] = epj_tensor_ref(logits);
	t[SC] = im->opts.scoring == EJ_SCORE_SIGMOID
		    ? epj_sigmoid(ctx, t[LG])
		    : epj_softmax(ctx, t[LG], -1);
	if (!t[SC]) {
		s = epj_ctx_status(ctx);
		goto out;
	}
	if (im->opts.fixed_routing) {
		for (int64_t n = 0; n < N; n++)
			for (int j = 0; j < k; j++)
				h[n * k + j] = (n * k + j) % E;
	} else {
		double *bias = gb ? sc + N * E : NULL;
		if ((s = epj_tensor_to_f64(ctx, t[SC], sc)) != EPJ_OK ||
		    (bias && (s = epj_tensor_to_f64(ctx, gb, bias)) != EPJ_OK))
			goto out;
		ej_autoep_select(sc, bias, N, E, k, im->opts.groups,
				 im->opts.n_group, im->opts.topk_group, h);
	}
	idx =
	    epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, (int64_t[]){ N, k }, h);
	if (idx && ej_index_pin(ctx, idx, h) != EPJ_OK) {
		epj_tensor_free(idx);
		idx = NULL;
	}
	t[W] = idx ? epj_gather(ctx, t[SC], 1, idx) : NULL;
	if (t[W] && im->opts.norm_topk_prob) {
		t[SUM] = epj_sum(ctx, t[W], -1, true);
		t[SUME] = epj_add_scalar(ctx, t[SUM], 1e-20);
		t[WN] = epj_div(ctx, t[W], t[SUME]);
	} else {
		t[WN] = epj_tensor_ref(t[W]);
	}
	double rsf = im->opts.routed_scaling_factor;
	t[WS] = rsf != 0 && rsf != 1 ? epj_mul_scalar(ctx, t[WN], rsf)
				     : epj_tensor_ref(t[WN]);
	if (!t[WS] || !idx)
		s = epj_ctx_status(ctx);
out:
	if (s == EPJ_OK) {
		*w_out = epj_tensor_ref(t[WS]);
		*idx_out = idx;
	} else {
		epj_tensor_free(idx);
	}
	for (int i = 0; i < N_T; i++)
		epj_tensor_free(t[i]);
	free(sc);
	free(h);
	return s;
}

/* Whether the layer routes as DeepSeek's routers do (route_scored). */
static bool scored_routing(const autoep_impl *im)
{
	const ej_autoep_opts *o = &im->opts;
	return o->scoring != EJ_SCORE_SOFTMAX || o->groups != EJ_GROUPS_NONE ||
	       o->score_bias ||
	       (o->routed_scaling_factor != 0 && o->routed_scaling_factor != 1);
}

/* The router's logits [N, E] of x [N, H]: x gate.weight^T in the layer's
 * dtype, or, for DeepSeek's routers, in rdt from x and the gate cast to
 * rdt (transformers computes them in f32). */
static epj_tensor *router_logits(epj_ctx *ctx, epj_module *m,
				 const autoep_impl *im, epj_tensor *x,
				 epj_dtype rdt)
{
	epj_tensor *gw = ej_module_param(ej_module_child(m, "gate"), "weight");
	EJ_ASSERT(gw != NULL);
	if (!scored_routing(im))
		return epj_linear(ctx, x, gw, NULL);
	epj_tensor *xr = cast_to(ctx, x, rdt), *gr = cast_to(ctx, gw, rdt);
	epj_tensor *lg = xr && gr ? epj_linear(ctx, xr, gr, NULL) : NULL;
	epj_tensor_free(xr);
	epj_tensor_free(gr);
	return lg;
}

/* Router: from the logits [N, E], probs [N, E] in rdt, then (w [N, k] in
 * rdt, idx [N, k] i64). */
static epj_status route(epj_ctx *ctx, epj_module *m, const autoep_impl *im,
			epj_tensor *logits_in, epj_dtype rdt, int64_t N,
			epj_tensor **w_out, epj_tensor **idx_out)
{
	const int E = im->opts.num_experts, k = im->opts.top_k;
	if (scored_routing(im))
		return route_scored(ctx, m, im, logits_in, N, w_out, idx_out);
	epj_tensor *logits = epj_tensor_ref(logits_in); /* [N, E] */
	if (im->fused) {
		/* one op: softmax, top-k (or the fixed assignment) and the
		 * renormalisation, read from the layer's dtype and computed
		 * in double, w in rdt */
		epj_status s =
		    logits
			? ej_moe_route(ctx, logits, k, im->opts.norm_topk_prob,
				       im->opts.fixed_routing, w_out, idx_out)
			: epj_ctx_status(ctx);
		epj_tensor_free(logits);
		(void)rdt;
		(void)N;
		return s;
	}
	epj_tensor *logits_r = cast_to(ctx, logits, rdt);
	epj_tensor_free(logits);
	epj_tensor *probs = epj_softmax(ctx, logits_r, -1);
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
		/* ours: the gather and its backward validate h, not a copy
		 * read back from the device */
		if (idx && ej_index_pin(ctx, idx, h) != EPJ_OK) {
			epj_tensor_free(idx);
			idx = NULL;
		}
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

static epj_status autoep_forward_body(epj_ctx *ctx, epj_module *m,
				      epj_tensor *const *in, int n_in,
				      epj_tensor **out, int n_out);

/* The layer's forward, timed as profile.autoep.forward under
 * EPJIT_PROFILE (its backward runs as the autograd nodes of its ops). */
static epj_status autoep_forward(epj_ctx *ctx, epj_module *m,
				 epj_tensor *const *in, int n_in,
				 epj_tensor **out, int n_out)
{
	ej_prof pf;
	ej_prof_begin(ctx, &pf);
	epj_status st = autoep_forward_body(ctx, m, in, n_in, out, n_out);
	ej_prof_end(ctx, &pf, "autoep.forward");
	return st;
}

/* One forward's state, all of it owned: the host bookkeeping of the
 * routing and the exchanges, and the tensors that live across the steps
 * below.  named: the error's message names the layer already. */
typedef struct fwd {
	int64_t N, H, R, T; /* T: tokens per sequence */
	int k, E, P, L;
	epj_dtype rdt;
	bool async; /* the split plan is posted, then waited for */
	/* idx_h and order_h are one block, so that index_pair_to_host reads
	 * both with one copy */
	int64_t *idx_h, *order_h, *counts, *local_counts;
	split_plan sp;
	epj_tensor *x, *w, *idx, *order, *tok, *pos, *routing, *x_sorted,
	    *y_sorted, *out;
	/* the dispatch, then the combine, in flight on the communication
	 * stream (finished before the first kernel that reads their rows) */
	a2a_pending pd;
	/* the layer's input (borrowed) and its shared expert's contribution,
	 * when the layer computes it (ej_autoep_shared_in_layer) */
	epj_tensor *hidden, *shared;
	bool named;
} fwd;

static void fwd_free(epj_ctx *ctx, fwd *f)
{
	/* after a failure: still ordered before the buffers' reuse */
	a2a_finish(ctx, &f->pd);
	free(f->idx_h); /* order_h with it */
	free(f->counts);
	free(f->local_counts);
	free(f->sp.send_counts);
	free(f->sp.recv_counts);
	free(f->sp.recv_plan);
	epj_tensor *t[] = { f->x,	 f->w,	 f->idx,     f->order,
			    f->tok,	 f->pos, f->routing, f->x_sorted,
			    f->y_sorted, f->out, f->shared };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
}

/* The status of an op that returned NULL (never EPJ_OK). */
static epj_status op_failed(epj_ctx *ctx)
{
	epj_status s = epj_ctx_status(ctx);
	return s != EPJ_OK ? s : EPJ_ERR_INVALID;
}

static epj_status fwd_init(epj_ctx *ctx, const epj_module *m,
			   const autoep_impl *im, const epj_tensor *hidden,
			   fwd *f)
{
	f->k = im->opts.top_k;
	f->E = im->opts.num_experts;
	f->P = im->comm->size;
	f->L = im->n_local;
	f->H = im->hidden;
	f->N = epj_tensor_numel(hidden) / f->H;
	f->T = epj_tensor_dim(hidden, -2);
	f->R = f->N * f->k;
	f->rdt = im->dtype == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
	f->async = im->opts.async_split_plan;
	const size_t P = (size_t)f->P, L = (size_t)f->L;
	f->idx_h = malloc(sizeof *f->idx_h * 2 * (size_t)f->R);
	f->order_h = f->idx_h ? f->idx_h + f->R : NULL;
	f->counts = calloc((size_t)f->E, sizeof *f->counts);
	f->local_counts = calloc(L, sizeof *f->local_counts);
	f->sp = (split_plan){ .P = f->P,
			      .L = f->L,
			      .send_counts = calloc(P, sizeof(int64_t)),
			      .recv_counts = calloc(P, sizeof(int64_t)),
			      .recv_plan = calloc(P * L, sizeof(int64_t)) };
	if (f->idx_h && f->counts && f->local_counts && f->sp.send_counts &&
	    f->sp.recv_counts && f->sp.recv_plan)
		return EPJ_OK;
	f->named = true;
	return ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory", m->name,
			AUTOEP_KIND);
}

/* The op-sequence reference of the permutation (EPJIT_AUTOEP_OPS=sequence;
 * the tests compare the fused ops with it): order = the stable argsort of
 * the experts, both read to the host in one copy. */
static epj_status sequence_order(epj_ctx *ctx, fwd *f)
{
	epj_tensor *flat = epj_reshape(ctx, f->idx, 1, &f->R);
	f->order = flat ? epj_argsort(ctx, flat, 0) : NULL;
	epj_status s = f->order ? index_pair_to_host(ctx, flat, f->order,
						     f->idx_h, f->order_h)
				: op_failed(ctx);
	epj_tensor_free(flat);
	return s;
}

/* ... and the routed rows in that order: row r carries token order[r] / k. */
static epj_status sequence_permute(epj_ctx *ctx, fwd *f)
{
	int64_t *tok_h = malloc(sizeof *tok_h * (size_t)(f->R + 1));
	if (!tok_h)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (int64_t r = 0; r < f->R; r++)
		tok_h[r] = f->order_h[r] / f->k;
	f->tok = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 1, &f->R, tok_h);
	free(tok_h);
	f->x_sorted = f->tok ? epj_index_select(ctx, f->x, 0, f->tok) : NULL;
	return f->x_sorted ? EPJ_OK : op_failed(ctx);
}

/* ... and the combine in rdt: out[tok[r]] += w_flat[order[r]] y[r]. */
static epj_tensor *sequence_combine(epj_ctx *ctx, const autoep_impl *im, fwd *f)
{
	int64_t flat_shape[2] = { f->N, f->H };
	epj_tensor *w_flat = epj_reshape(ctx, f->w, 1, &f->R);
	epj_tensor *w_sorted = epj_index_select(ctx, w_flat, 0, f->order);
	epj_tensor *w_col =
	    epj_reshape(ctx, w_sorted, 2, (int64_t[]){ f->R, 1 });
	epj_tensor *y_r = cast_to(ctx, f->y_sorted, f->rdt);
	epj_tensor *y_w = epj_mul(ctx, y_r, w_col); /* [R, H] */
	epj_tensor *acc = epj_zeros(ctx, f->rdt, 2, flat_shape);
	epj_tensor *out_r = epj_index_add(ctx, acc, 0, f->tok, y_w);
	epj_tensor *out = cast_to(ctx, out_r, im->dtype);
	epj_tensor *t[] = { w_flat, w_sorted, w_col, y_r, y_w, acc, out_r };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return out;
}

/* The router losses' count of this call (runtime/router_loss.c): the
 * top-k of the router's probabilities, which is the routing the host has
 * unless the layer routes otherwise (fixed routing, DeepSeek's groups and
 * score bias); then the top-k of the logits (the same order). */
static epj_status rloss_count(epj_ctx *ctx, const autoep_impl *im, const fwd *f,
			      epj_tensor *logits)
{
	if (!ej_rloss_wants_choice(ctx, im->rloss))
		return EPJ_OK;
	if (!scored_routing(im) && !im->opts.fixed_routing)
		return ej_rloss_count(ctx, im->rloss, im->rloss_layer, f->idx_h,
				      f->N);
	epj_tensor *v = NULL, *idx = NULL;
	int64_t *sel = malloc(sizeof *sel * (size_t)(f->R + 1));
	epj_status s = sel ? epj_topk(ctx, logits, f->k, &v, &idx)
			   : ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	if (s == EPJ_OK)
		s = index_to_host(ctx, idx, sel);
	if (s == EPJ_OK)
		s = ej_rloss_count(ctx, im->rloss, im->rloss_layer, sel, f->N);
	epj_tensor_free(v);
	epj_tensor_free(idx);
	free(sel);
	return s;
}

/* Routing: the router's logits (with the router losses' node), the
 * weights and experts [N, k], the experts read to the host, the rows per
 * expert, the router losses' and balancing loads and the split plan
 * (posted with async_split_plan, else exchanged now). */
static epj_status fwd_route(epj_ctx *ctx, epj_module *m, autoep_impl *im,
			    epj_tensor *hidden, fwd *f)
{
	int64_t flat_shape[2] = { f->N, f->H };
	f->x = epj_reshape(ctx, hidden, 2, flat_shape); /* [N, H] */
	epj_tensor *z = f->x ? router_logits(ctx, m, im, f->x, f->rdt) : NULL;
	epj_tensor *za = NULL;
	epj_status s =
	    z ? ej_rloss_attach(ctx, im->rloss, im->rloss_layer, z, f->T, &za)
	      : op_failed(ctx);
	if (s == EPJ_OK)
		s = route(ctx, m, im, za, f->rdt, f->N, &f->w, &f->idx);
	epj_tensor_free(za);
	if (s == EPJ_OK)
		s = im->fused ? index_dense_to_host(ctx, f->idx, f->idx_h)
			      : sequence_order(ctx, f);
	/* on a device, the fused ops (and their backwards) check the experts
	 * against this host copy and read the device's in place */
	if (s == EPJ_OK && im->fused)
		s = ej_index_pin(ctx, f->idx, f->idx_h);
	if (s == EPJ_OK)
		s = rloss_count(ctx, im, f, z);
	epj_tensor_free(z);
	if (s != EPJ_OK)
		return s;
	for (int64_t r = 0; r < f->R; r++) {
		EJ_ASSERT(f->idx_h[r] >= 0 && f->idx_h[r] < f->E);
		f->counts[f->idx_h[r]]++;
	}
	/* the loads of aux-loss-free balancing: training forwards only (a
	 * checkpoint replay routes the same tokens again), the calls of a
	 * checkpointed layer too, which run without grad */
	if (im->load && ctx->rt_replay_depth == 0 &&
	    (epj_grad_enabled(ctx) || ej_rloss_training(ctx, im->rloss)))
		for (int e = 0; e < f->E; e++)
			im->load[e] += f->counts[e];
	/* the expert-load metrics, every layer: every call but a replay (a
	 * checkpointed forward runs without grad; the engine takes the
	 * counts of its training forwards) */
	if (ctx->rt_replay_depth == 0)
		for (int e = 0; e < f->E; e++)
			im->step_load[e] += f->counts[e];
	if (f->async) {
		int64_t l0 = epj_counter_get(ctx, "kernels.launched.eager");
		s = plan_post(ctx, m, im, &f->sp, f->counts);
		im->ops_at_post = l0;
	} else {
		s = plan_sync(ctx, m, im, &f->sp, f->counts);
	}
	if (s != EPJ_OK) {
		f->named = true;
		return s;
	}
	f->routing = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2,
					  (int64_t[]){ f->N, f->k }, f->idx_h);
	return f->routing ? EPJ_OK : op_failed(ctx);
}

/* The routed rows sorted by expert, stable (rows of one expert keep token
 * order): the rows of rank p's experts are contiguous because experts are
 * assigned to ranks in blocks of n_local.  Fused: one op, which also gives
 * pos [N, k], the row of every slot; on a device its host copy (the same
 * counting sort, from the experts the host has) is pinned for the
 * combine and the backwards to check. */
static epj_status fwd_permute(epj_ctx *ctx, const autoep_impl *im, fwd *f)
{
	if (!im->fused)
		return sequence_permute(ctx, f);
	epj_tensor *cnt = NULL; /* the host has the counts already */
	epj_status s = ej_moe_permute(ctx, f->x, f->idx, f->E, &f->x_sorted,
				      &f->pos, &cnt);
	epj_tensor_free(cnt);
	if (s != EPJ_OK || !ej_dev_runs_cuda(ctx->dev))
		return s;
	/* scratch counts: f->counts may be in flight (async split plan);
	 * order_h is free here */
	int64_t *off = malloc(sizeof *off * 2 * (size_t)f->E);
	if (!off)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	ej_moe_positions(f->idx_h, f->R, f->E, off + f->E, off, f->order_h);
	free(off);
	return ej_index_pin(ctx, f->pos, f->order_h);
}

/* The received rows x_recv [R_recv, H], grouped by source rank and within
 * one by local expert, regrouped by local expert (source rank order kept
 * within one) as the experts want them: *x_grp, and *inv, the permutation
 * back.  One source rank: the identity, *inv NULL. */
static epj_status group_by_expert(epj_ctx *ctx, const epj_module *m, fwd *f,
				  epj_tensor *x_recv, epj_tensor **x_grp,
				  epj_tensor **inv)
{
	*inv = NULL;
	if (f->P == 1) {
		*x_grp = epj_tensor_ref(x_recv);
		return EPJ_OK;
	}
	const int P = f->P, L = f->L;
	const int64_t *plan = f->sp.recv_plan;
	const int64_t R_recv = epj_tensor_dim(x_recv, 0);
	int64_t *perm_h = malloc(sizeof *perm_h * (size_t)(R_recv + 1));
	int64_t *inv_h = malloc(sizeof *inv_h * (size_t)(R_recv + 1));
	int64_t *src_off = calloc((size_t)P * (size_t)L + 1, sizeof *src_off);
	epj_status s = EPJ_OK;
	if (!perm_h || !inv_h || !src_off) {
		f->named = true;
		s = ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory",
			     m->name, AUTOEP_KIND);
		goto done;
	}
	int64_t off = 0, j = 0;
	for (int p = 0; p < P; p++)
		for (int e = 0; e < L; e++) {
			src_off[p * L + e] = off;
			off += plan[(int64_t)p * L + e];
		}
	for (int e = 0; e < L; e++)
		for (int p = 0; p < P; p++)
			for (int64_t q = 0; q < plan[(int64_t)p * L + e]; q++) {
				perm_h[j] = src_off[p * L + e] + q;
				inv_h[perm_h[j]] = j;
				j++;
			}
	EJ_ASSERT(j == R_recv);
	epj_tensor *perm =
	    epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 1, &R_recv, perm_h);
	*inv = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 1, &R_recv, inv_h);
	/* the index ops validate the permutations from these host values
	 * instead of a copy back (a device synchronization, which would
	 * also wait for the exchange in flight) */
	if (perm && *inv && ej_dev_runs_cuda(ctx->dev)) {
		s = ej_index_pin(ctx, perm, perm_h);
		if (s == EPJ_OK)
			s = ej_index_pin(ctx, *inv, inv_h);
	}
	/* the first kernel that reads the received rows: the compute stream
	 * waits for the dispatch here, after the permutation's upload */
	if (perm && *inv && s == EPJ_OK)
		s = a2a_finish(ctx, &f->pd);
	*x_grp = s == EPJ_OK && perm && *inv
		     ? epj_index_select(ctx, x_recv, 0, perm)
		     : NULL;
	epj_tensor_free(perm);
	if (!*x_grp && s == EPJ_OK)
		s = op_failed(ctx);
done:
	free(perm_h);
	free(inv_h);
	free(src_off);
	return s;
}

/* Dispatch of the sorted rows to their experts' ranks, the experts, and
 * the outputs back to the ranks their tokens came from (the reversed
 * plan): f->y_sorted [R, H], in x_sorted's order. */
static epj_status fwd_experts(epj_ctx *ctx, epj_module *m, autoep_impl *im,
			      fwd *f)
{
	split_plan *sp = &f->sp;
	epj_status s = EPJ_OK;
	if (f->async) {
		/* the eager ops that ran while the plan was in flight */
		epj_counter_add(ctx, "autoep.split_plan.overlapped_ops",
				epj_counter_get(ctx, "kernels.launched.eager") -
				    im->ops_at_post);
		if ((s = plan_wait(ctx, m, im, sp)) != EPJ_OK) {
			f->named = true;
			return s;
		}
	}
	for (int e = 0; e < f->L; e++) {
		f->local_counts[e] = 0;
		for (int p = 0; p < f->P; p++)
			f->local_counts[e] +=
			    sp->recv_plan[(int64_t)p * f->L + e];
	}
	epj_tensor *x_recv = ep_all_to_all(
	    ctx, m, im->comm, im->dev_comm, "autoep.dispatch", f->x_sorted,
	    sp->send_counts, sp->recv_counts, &f->pd);
	if (!x_recv) {
		f->named = true; /* the message names the layer already */
		return op_failed(ctx);
	}
	/* work that does not need the exchange, issued while it runs: the
	 * shared expert (its GEMMs on the compute stream) */
	if (ej_autoep_shared_in_layer(m)) {
		f->shared = im->shared_fn(ctx, m, f->hidden);
		if (!f->shared) {
			epj_tensor_free(x_recv);
			return op_failed(ctx);
		}
		epj_counter_add(ctx, "autoep.shared.in_layer", 1);
	}
	epj_tensor *x_grp = NULL, *inv = NULL, *y_grp = NULL, *y_recv = NULL;
	s = group_by_expert(ctx, m, f, x_recv, &x_grp, &inv);
	/* the fused ops or a device with a GEMM library: the expert GEMMs
	 * grouped (on a cuda context, one cuBLASLt grouped call where it
	 * takes them) */
	if (s == EPJ_OK)
		y_grp =
		    im->fused || ctx->dev->desc->gemm_library
			? run_experts_fused(ctx, m, im, x_grp, f->local_counts)
			: run_experts(ctx, m, im, x_grp, f->local_counts);
	if (s == EPJ_OK && y_grp)
		y_recv = inv ? epj_index_select(ctx, y_grp, 0, inv)
			     : epj_tensor_ref(y_grp);
	if (s == EPJ_OK && !y_recv)
		s = op_failed(ctx);
	if (s == EPJ_OK) {
		f->y_sorted = ep_all_to_all(
		    ctx, m, im->comm, im->dev_comm, "autoep.combine", y_recv,
		    sp->recv_counts, sp->send_counts, &f->pd);
		if (!f->y_sorted) {
			f->named = true;
			s = op_failed(ctx);
		}
	}
	epj_tensor *t[] = { x_recv, x_grp, inv, y_grp, y_recv };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return s;
}

/* The routing of this call (no grad: built from host values) kept for
 * ej_autoep_last_routing and the parity log, and the call counted by kind:
 * a checkpoint replay in backward recomputes a forward counted already. */
static epj_status fwd_record(epj_ctx *ctx, const epj_module *m, autoep_impl *im,
			     fwd *f)
{
	epj_tensor_free(im->last_routing);
	im->last_routing = f->routing;
	f->routing = NULL;
	if (im->log_on) {
		if (im->n_log == im->cap_log) {
			int nc = im->cap_log ? 2 * im->cap_log : 4;
			epj_tensor **nl =
			    realloc(im->log, sizeof *nl * (size_t)nc);
			if (nl)
				im->log = nl;
			bool *nr = nl ? realloc(im->log_replay,
						sizeof *nr * (size_t)nc)
				      : NULL;
			if (nr)
				im->log_replay = nr;
			if (!nl || !nr)
				return ej_error(ctx, EPJ_ERR_NOMEM,
						"%s: out of memory logging the "
						"routing of call %d",
						m->name, im->n_log + 1);
			im->cap_log = nc;
		}
		im->log[im->n_log] = epj_tensor_ref(im->last_routing);
		im->log_replay[im->n_log++] = ctx->rt_replay_depth > 0;
	}
	if (ctx->rt_replay_depth > 0) {
		epj_counter_add(ctx, "autoep.calls.replay", 1);
		im->n_replay++;
	} else {
		epj_counter_add(ctx, "autoep.calls.forward", 1);
		im->n_forward++;
	}
	return EPJ_OK;
}

/* The layer: route, permute, exchange and run the experts, combine in fp32
 * (f64 for f64 layers), record.  The fused ops are rows of every device's
 * eager table (the CPU kernels of lib/ops_moe.c; the MoE templates on the
 * devices that run CUDA C), so this is the one data path; the op sequence
 * is its reference. */
static epj_status autoep_forward_body(epj_ctx *ctx, epj_module *m,
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
	fwd f = { 0 };
	f.hidden = hidden;
	s = fwd_init(ctx, m, im, hidden, &f);
	if (s == EPJ_OK)
		s = fwd_route(ctx, m, im, hidden, &f);
	if (s == EPJ_OK)
		s = fwd_permute(ctx, im, &f);
	if (s == EPJ_OK)
		s = fwd_experts(ctx, m, im, &f);
	/* the combine's rows are read from here on */
	if (s == EPJ_OK && (s = a2a_finish(ctx, &f.pd)) != EPJ_OK)
		f.named = true;
	if (s == EPJ_OK) {
		/* one op summed in rdt over each token's slots in slot order,
		 * written in the layer's dtype; or the sequence's same sum */
		f.out = im->fused
			    ? ej_moe_unpermute(ctx, f.y_sorted, f.w, f.pos)
			    : sequence_combine(ctx, im, &f);
		out[0] = f.out
			     ? epj_reshape(ctx, f.out, epj_tensor_ndim(hidden),
					   epj_tensor_shape(hidden))
			     : NULL;
		if (out[0] && f.shared) {
			/* the shared expert first: the autograd engine
			 * (depth first) then takes the experts' path first,
			 * and runs the shared expert's backward while the
			 * combine's gradient travels */
			epj_tensor *sum = epj_add(ctx, f.shared, out[0]);
			epj_tensor_free(out[0]);
			out[0] = sum;
		}
		if (!out[0])
			s = op_failed(ctx);
	}
	if (s == EPJ_OK && (s = fwd_record(ctx, m, im, &f)) != EPJ_OK) {
		epj_tensor_free(out[0]);
		out[0] = NULL;
	}
	/* an op failed: its message names the op and shapes; add the layer */
	if (s != EPJ_OK && !f.named)
		ej_error_prefix(ctx, "%s (%s)", m->name, AUTOEP_KIND);
	plan_drain(ctx, im, &f.sp);
	fwd_free(ctx, &f);
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
	if (o->groups != EJ_GROUPS_NONE &&
	    (o->n_group < 1 || o->num_experts % o->n_group != 0 ||
	     o->topk_group < 1 || o->topk_group > o->n_group ||
	     o->top_k > o->topk_group * (o->num_experts / o->n_group) ||
	     (o->groups == EJ_GROUPS_TOP2 && o->num_experts / o->n_group < 2)))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): group-limited routing of %d experts "
				"in %d groups, %d kept, top %d: the groups "
				"must divide the experts (at least 2 each when "
				"a group scores its best two), 1 <= kept <= "
				"groups, and top_k at most the kept groups' "
				"experts",
				who, AUTOEP_KIND, o->num_experts, o->n_group,
				o->topk_group, o->top_k);
	if (!(o->routed_scaling_factor >= 0) || isinf(o->routed_scaling_factor))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (%s): routed_scaling_factor %g must be "
				"finite and >= 0 (0: 1)",
				who, AUTOEP_KIND, o->routed_scaling_factor);
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

/* The expert projection names of a layer whose options name none. */
static const char *const qwen3_proj[3] = { "gate_proj", "up_proj",
					   "down_proj" };

/* The layer's state for ej_autoep_new (opts checked): its kernel choice
 * (EPJIT_AUTOEP_OPS), options with their defaults, its comm (a
 * single-rank one when comm is NULL) and share of the experts; NULL with
 * the error set. */
static autoep_impl *autoep_impl_new(epj_ctx *ctx, const char *local, int hidden,
				    int inter, const ej_autoep_opts *opts,
				    epj_dtype dt, ej_comm *comm)
{
	autoep_impl *im = calloc(1, sizeof *im);
	if (!im || !(im->step_load = calloc((size_t)opts->num_experts,
					    sizeof *im->step_load))) {
		free(im);
		ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory", local,
			 AUTOEP_KIND);
		return NULL;
	}
	const char *ops = getenv("EPJIT_AUTOEP_OPS");
	im->fused = true;
	if (ops && *ops && strcmp(ops, "fused") != 0) {
		if (strcmp(ops, "sequence") != 0) {
			autoep_impl_free(im);
			ej_error(ctx, EPJ_ERR_CONFIG,
				 "%s (%s): EPJIT_AUTOEP_OPS=\"%s\": unknown "
				 "kernel choice (known: fused, sequence)",
				 local, AUTOEP_KIND, ops);
			return NULL;
		}
		im->fused = false;
	}
	im->opts = *opts;
	for (int j = 0; j < 3; j++)
		if (!im->opts.proj[j])
			im->opts.proj[j] = qwen3_proj[j];
	if (!im->opts.expert_kind)
		im->opts.expert_kind = "Qwen3MoeMLP";
	im->hidden = hidden;
	im->inter = inter;
	im->dtype = dt;
	im->comm = comm;
	if (!comm) {
		im->comm = ej_comm_self_new();
		im->owns_comm = true;
		if (!im->comm) {
			autoep_impl_free(im);
			ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory",
				 local, AUTOEP_KIND);
			return NULL;
		}
	}
	im->n_local = opts->num_experts / im->comm->size;
	im->first_local = im->comm->rank * im->n_local;
	return im;
}

epj_module *ej_autoep_new(epj_ctx *ctx, epj_module *parent, const char *local,
			  int hidden, int inter, const ej_autoep_opts *opts,
			  epj_dtype dt, double init_std, ej_comm *comm)
{
	if (check_opts(ctx, local, hidden, inter, opts, dt, init_std, comm) !=
	    EPJ_OK)
		return NULL;
	autoep_impl *im =
	    autoep_impl_new(ctx, local, hidden, inter, opts, dt, comm);
	if (!im)
		return NULL;
	const ej_autoep_opts im_opts = im->opts; /* im moves into the tree */
	const int first_local = im->first_local;

	/* Draw every parameter first, in the documented order (gate, then
	 * experts' gate_proj, up_proj, down_proj), so that a failure leaves
	 * no half-built layer in the parent.  All num_experts experts are
	 * drawn and a rank keeps its own: expert e has the same initial
	 * values whatever the expert-parallel size. */
	const int L = im->n_local, EA = opts->num_experts, np = 1 + 3 * EA;
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
	for (int e = 0; e < EA && ok; e++) {
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
	ok = m != NULL;
	if (ok) {
		m->compiler_disabled = true;
		m->impl = im;
		m->impl_free = autoep_impl_free;
		im = NULL; /* owned by m now */
		epj_module *gate = ej_module_new(m, "gate", "Linear", NULL);
		ok = gate && ej_module_add_param(gate, "weight", p[0]);
		p[0] = NULL;
		if (ok && im_opts.score_bias) {
			/* a buffer: f32 zeros as transformers initialises
			 * it, no gradient, moved by ej_autoep_balance */
			int64_t ne = im_opts.num_experts;
			autoep_impl *mi = m->impl;
			epj_tensor *b = ej_module_add_param(
			    gate, "e_score_correction_bias",
			    epj_zeros(ctx, EPJ_DTYPE_F32, 1, &ne));
			mi->load = calloc((size_t)ne, sizeof *mi->load);
			ok = b && mi->load;
			if (b)
				epj_tensor_set_requires_grad(b, false);
		}
	}
	epj_module *experts =
	    ok ? ej_module_new(m, "experts", "ModuleList", NULL) : NULL;
	ok = ok && experts;
	const char *proj[3], *ekind = im_opts.expert_kind;
	memcpy(proj, im_opts.proj, sizeof proj);
	for (int e = 0; e < L && ok; e++) {
		char name[32];
		snprintf(name, sizeof name, "%d", first_local + e);
		epj_module *ex = ej_module_new(experts, name, ekind, NULL);
		ok = ex != NULL;
		for (int j = 0; j < 3 && ok; j++) {
			epj_module *lin =
			    ej_module_new(ex, proj[j], "Linear", NULL);
			int k = 1 + 3 * (first_local + e) + j;
			ok = lin && ej_module_add_param(lin, "weight", p[k]);
			p[k] = NULL;
		}
	}
	for (int i = 0; i < np; i++)
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

epj_status ej_autoep_balance(epj_ctx *ctx, epj_module *m, ej_comm *comm,
			     double rate)
{
	autoep_impl *im = m->impl;
	EJ_ASSERT(im != NULL);
	if (!im->load)
		return EPJ_OK;
	const int E = im->opts.num_experts;
	epj_tensor *b = ej_module_param(ej_module_child(m, "gate"),
					"e_score_correction_bias");
	double *bias = malloc(sizeof *bias * (size_t)E);
	float *load = malloc(sizeof *load * (size_t)E);
	epj_status s = EPJ_OK;
	if (!bias || !load || !b) {
		s = ej_error(ctx, EPJ_ERR_NOMEM, "%s (%s): out of memory",
			     m->name, AUTOEP_KIND);
		goto out;
	}
	/* loads are token counts, exact in f32 up to 2^24 per expert and
	 * step */
	for (int e = 0; e < E; e++)
		load[e] = (float)im->load[e];
	if (comm && comm->size > 1 &&
	    (s = ej_comm_allreduce(ctx, comm, "expert loads", load, E)) !=
		EPJ_OK)
		goto out;
	double total = 0;
	for (int e = 0; e < E; e++)
		total += load[e];
	if (total > 0) {
		double mean = total / E;
		if ((s = epj_tensor_to_f64(ctx, b, bias)) != EPJ_OK)
			goto out;
		for (int e = 0; e < E; e++)
			bias[e] += rate * (double)((load[e] < mean) -
						   (load[e] > mean));
		s = epj_tensor_from_f64(ctx, b, bias);
		ej_params_written(ctx);
	}
	memset(im->load, 0, sizeof *im->load * (size_t)E);
out:
	free(bias);
	free(load);
	return s;
}

int ej_autoep_step_load_add(const epj_module *m, int64_t *acc)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return 0;
	const autoep_impl *im = m->impl;
	const int E = im->opts.num_experts;
	for (int e = 0; acc && e < E; e++)
		acc[e] += im->step_load[e];
	return E;
}

void ej_autoep_step_load_reset(epj_module *m)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return;
	autoep_impl *im = m->impl;
	memset(im->step_load, 0,
	       sizeof *im->step_load * (size_t)im->opts.num_experts);
}

/* One all-reduce for all the loads, exact: a load x travels as two floats,
 * x / 2^12 and x mod 2^12 (whole numbers).  Every partial sum of the low
 * parts is below ranks x 2^12 and of the high parts below total / 2^12, so
 * both stay whole numbers below 2^24, which f32 holds exactly, up to 4096
 * ranks and 2^36 assignments of one expert in one step. */
epj_status ej_expert_load_reduce(epj_ctx *ctx, ej_comm *comm, int64_t *load,
				 int64_t n)
{
	if (!comm || comm->size == 1 || n == 0)
		return EPJ_OK;
	float *buf = malloc(sizeof *buf * (size_t)(2 * n));
	if (!buf)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"expert loads: out of host memory");
	for (int64_t i = 0; i < n; i++) {
		EJ_ASSERT(load[i] >= 0);
		buf[2 * i] = (float)(load[i] >> 12);
		buf[2 * i + 1] = (float)(load[i] & 4095);
	}
	epj_status s =
	    ej_comm_allreduce(ctx, comm, "expert load metrics", buf, 2 * n);
	for (int64_t i = 0; s == EPJ_OK && i < n; i++)
		load[i] = ((int64_t)buf[2 * i] << 12) + (int64_t)buf[2 * i + 1];
	free(buf);
	return s;
}

void ej_expert_load_summary(const int64_t *load, int E, epj_expert_load *out)
{
	int64_t total = 0, max = 0;
	int dead = 0;
	for (int e = 0; e < E; e++) {
		total += load[e];
		max = load[e] > max ? load[e] : max;
		dead += load[e] == 0;
	}
	out->num_experts = E;
	out->total = total;
	out->dead = dead;
	if (total == 0) {
		out->max_over_mean = out->cv = NAN;
		return;
	}
	/* in whole numbers as far as they go: max / mean = E max / total,
	 * and the variance's sum of squares of (E load - total), so that a
	 * balanced layer gives exactly 1 and 0 */
	double ss = 0;
	for (int e = 0; e < E; e++) {
		double d = (double)E * (double)load[e] - (double)total;
		ss += d * d;
	}
	out->max_over_mean = (double)E * (double)max / (double)total;
	out->cv = sqrt(ss / E) / (double)total;
}

epj_tensor *ej_autoep_last_routing(const epj_module *m)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return NULL;
	const autoep_impl *im = m->impl;
	return im->last_routing;
}

void ej_autoep_routing_log_start(epj_module *m)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return;
	autoep_impl *im = m->impl;
	for (int i = 0; i < im->n_log; i++)
		epj_tensor_free(im->log[i]);
	im->n_log = 0;
	im->log_on = true;
}

int ej_autoep_routing_log(const epj_module *m, epj_tensor *const **calls,
			  const bool **replay)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return 0;
	const autoep_impl *im = m->impl;
	*calls = im->log;
	*replay = im->log_replay;
	return im->n_log;
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

epj_status ej_autoep_set_rloss(epj_module *m, ej_rloss *rl, int layer)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return EPJ_ERR_INVALID;
	autoep_impl *im = m->impl;
	im->rloss = rl;
	im->rloss_layer = layer;
	return EPJ_OK;
}

epj_status ej_autoep_set_dev_comm(epj_module *m, ej_comm *dev_comm)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return EPJ_ERR_INVALID;
	autoep_impl *im = m->impl;
	EJ_ASSERT(!dev_comm || (dev_comm->size == im->comm->size &&
				dev_comm->rank == im->comm->rank));
	im->dev_comm = dev_comm;
	return EPJ_OK;
}

epj_status ej_autoep_set_shared(epj_module *m, ej_autoep_shared_fn fn)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return EPJ_ERR_INVALID;
	((autoep_impl *)m->impl)->shared_fn = fn;
	return EPJ_OK;
}

bool ej_autoep_shared_in_layer(const epj_module *m)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return false;
	const autoep_impl *im = m->impl;
	return im->shared_fn && im->dev_comm && im->comm->size > 1;
}

epj_status ej_autoep_set_fused(epj_module *m, bool fused)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return EPJ_ERR_INVALID;
	autoep_impl *im = m->impl;
	im->fused = fused;
	return EPJ_OK;
}

epj_status ej_autoep_shard(epj_ctx *ctx, epj_module *m, ej_comm *ep)
{
	if (!m || !m->impl || !m->kind || strcmp(m->kind, AUTOEP_KIND) != 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"autoep shard: not an AutoEP layer");
	autoep_impl *im = m->impl;
	const int E = im->opts.num_experts;
	if (ep->size < 1 || E % ep->size != 0)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s (%s): num_experts %d is not divisible by "
				"expert_parallel.autoep_size %d",
				m->name, AUTOEP_KIND, E, ep->size);
	if (im->comm->size != 1)
		return ej_error(ctx, EPJ_ERR_STATE,
				"%s (%s): already sharded over %d ranks",
				m->name, AUTOEP_KIND, im->comm->size);
	const int L = E / ep->size, first = ep->rank * L;
	epj_module *experts = ej_module_child(m, "experts");
	EJ_ASSERT(experts && experts->n_children == E);
	int kept = 0;
	for (int i = 0; i < experts->n_children; i++) {
		epj_module *c = experts->children[i];
		int g = atoi(c->local);
		if (g >= first && g < first + L)
			experts->children[kept++] = c;
		else
			ej_module_free(c);
	}
	experts->n_children = kept;
	EJ_ASSERT(kept == L);
	if (im->owns_comm)
		ej_comm_free(im->comm);
	im->owns_comm = false;
	im->comm = ep;
	im->n_local = L;
	im->first_local = first;
	return EPJ_OK;
}
