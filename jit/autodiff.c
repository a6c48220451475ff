/* autodiff.c -- joint forward/backward graph of a segment, and its
 * partition into a forward graph and a backward graph.
 *
 * The backward graph is not derived by a second autodiff: the op table's
 * backward formulas (written with ops) run in TRACE mode on symbolic
 * tensors, appending their ops to a copy of the forward graph -- the joint
 * graph J (the AOTAutograd idea).  Gradients of forward outputs enter J as
 * GRAD inputs; the forward nodes are walked in reverse, each formula's
 * input gradients accumulated with traced adds.
 *
 * Partition: nodes of the forward stay in F; nodes added by the formulas go
 * to B.  A forward value B reads is either "saved" -- an extra output of F
 * (or a forward input, kept by reference at no cost) that becomes a SAVED
 * input of B -- or, when it is cheap to produce again, recomputed in B.
 *
 * Recomputation (the safe core of AOTAutograd's min-cut partitioner): a
 * value produced by a pointwise, view or ROPE node (never a reduction,
 * matmul, sdpa or index op) is recomputed from its node's inputs when the
 * bytes of the values that must newly be saved for it (forward inputs,
 * values saved anyway and recomputed values cost nothing) are fewer than
 * its own bytes; such inputs may themselves be recomputed, recursively.
 * Decisions are taken in topological order, repeated to a fixed point;
 * they never raise the saved bytes.  Recomputed nodes are copied into B
 * just before their first use; F still computes the value when its own
 * outputs need it.
 */
#include "jit_impl.h"

void *ej_tracer_begin(epj_ctx *ctx, ej_graph *g);
epj_tensor *ej_tracer_symbolic(void *tr, int value);
void ej_tracer_end(epj_ctx *ctx, void *tr);

static ej_graph *clone(const ej_graph *f, const char *name)
{
	ej_graph *g = ej_graph_new(name);
	for (int v = 0; v < f->n_values; v++) {
		const ej_value *x = &f->values[v];
		if (x->input >= 0) {
			const ej_graph_input *in = &f->inputs[x->input];
			int nv = ej_graph_add_input(
			    g, in->kind, in->slot, x->dtype, x->ndim, x->shape);
			EJ_ASSERT(nv == v);
			if (in->konst)
				g->inputs[g->values[nv].input].konst =
				    epj_tensor_ref(in->konst);
		} else {
			/* node outputs are recreated by add_node below; keep
			 * ids equal by adding nodes in value order */
		}
	}
	/* Inputs come first in f (builders add all inputs before nodes); nodes
	 * then recreate their outputs with the same ids. */
	for (int i = 0; i < f->n_nodes; i++) {
		const ej_ir_node *n = &f->nodes[i];
		ej_meta m[16];
		EJ_ASSERT(n->n_out <= 16);
		for (int j = 0; j < n->n_out; j++) {
			const ej_value *x = &f->values[n->out[j]];
			memset(&m[j], 0, sizeof m[j]);
			m[j].dtype = x->dtype;
			m[j].ndim = x->ndim;
			memcpy(m[j].shape, x->shape, sizeof x->shape);
		}
		int k = ej_graph_add_node(g, n->op, &n->attrs, n->in, n->n_in,
					  m, n->n_out);
		g->nodes[k].dead = n->dead;
		g->nodes[k].callee = n->callee;
		for (int j = 0; j < n->n_out; j++)
			EJ_ASSERT(g->nodes[k].out[j] == n->out[j]);
	}
	for (int v = 0; v < f->n_values; v++)
		g->values[v].requires_grad = f->values[v].requires_grad;
	for (int i = 0; i < f->n_outputs; i++)
		ej_graph_add_output(g, f->outputs[i]);
	return g;
}

typedef struct ad_state {
	epj_ctx *ctx;
	ej_graph *j;
	void *tr;
	epj_tensor **sym;  /* per J value, lazily */
	epj_tensor **grad; /* per forward value */
	int n_fvalues;
} ad_state;

static epj_tensor *sym_of(ad_state *s, int v)
{
	if (!s->sym[v])
		s->sym[v] = ej_tracer_symbolic(s->tr, v);
	return s->sym[v];
}

static epj_status add_grad(ad_state *s, int v, epj_tensor *g)
{
	if (!s->grad[v]) {
		s->grad[v] = epj_tensor_ref(g);
		return EPJ_OK;
	}
	epj_tensor *sum = epj_add(s->ctx, s->grad[v], g);
	if (!sum)
		return s->ctx->status;
	epj_tensor_free(s->grad[v]);
	s->grad[v] = sum;
	return EPJ_OK;
}

/* ---- recomputation choice ---------------------------------------------- */

enum { RC_NONE = 0, RC_SAVED, RC_RECOMP };

/* Depth bound of the cost recursion (a chain of recomputable producers
 * longer than this is cut: its deepest value counts as newly saved). */
#define RC_MAX_DEPTH 8

typedef struct rc_state {
	const ej_graph *f;
	char *st; /* per forward value: RC_* */
} rc_state;

static bool rc_cheap_op(int op)
{
	if (op < 0)
		return false;
	switch (op) {
	case EJ_OP_RESHAPE:
	case EJ_OP_TRANSPOSE:
	case EJ_OP_PERMUTE:
	case EJ_OP_SLICE:
	case EJ_OP_EXPAND:
	/* elementwise but for its partner column: attention's q and k come
	 * back from the (qk-norm) inputs saved anyway instead of being saved
	 * a second time after the rotation */
	case EJ_OP_ROPE:
		return true;
	default:
		return (ej_ops[op].flags & EJ_OPF_POINTWISE) != 0;
	}
}

/* The node producing v when it may be recomputed, else NULL. */
static const ej_ir_node *rc_node(const rc_state *r, int v)
{
	const ej_value *x = &r->f->values[v];
	if (x->input >= 0 || x->node < 0)
		return NULL;
	const ej_ir_node *n = &r->f->nodes[x->node];
	if (n->dead || n->n_out != 1 || n->n_in < 1 || !rc_cheap_op(n->op))
		return NULL;
	return n;
}

static uint64_t rc_bytes(const ej_value *x)
{
	return (uint64_t)ej_numel(x->ndim, x->shape) *
	       (uint64_t)ej_dtype_size(x->dtype);
}

/* Bytes of the values that must newly be saved to make u available in the
 * backward: 0 for forward inputs and values already saved or recomputed;
 * for a recomputable u the cheaper of saving it and recomputing it. */
static uint64_t rc_cost(const rc_state *r, int u, int depth)
{
	const ej_value *x = &r->f->values[u];
	if (x->input >= 0 || r->st[u] != RC_NONE)
		return 0;
	uint64_t b = rc_bytes(x);
	const ej_ir_node *n = depth < RC_MAX_DEPTH ? rc_node(r, u) : NULL;
	if (!n)
		return b;
	uint64_t c = 0;
	for (int k = 0; k < n->n_in && c < b; k++)
		c += rc_cost(r, n->in[k], depth + 1);
	return c < b ? c : b;
}

/* Makes u available, following the choice rc_cost describes. */
static void rc_commit(rc_state *r, int u, int depth)
{
	const ej_value *x = &r->f->values[u];
	if (x->input >= 0 || r->st[u] != RC_NONE)
		return;
	const ej_ir_node *n = depth < RC_MAX_DEPTH ? rc_node(r, u) : NULL;
	if (n && rc_cost(r, u, depth) < rc_bytes(x)) {
		for (int k = 0; k < n->n_in; k++)
			rc_commit(r, n->in[k], depth + 1);
		r->st[u] = RC_RECOMP;
		return;
	}
	r->st[u] = RC_SAVED;
}

/* st[] holds RC_SAVED for every node value the backward reads; turns
 * some of them into RC_RECOMP, in value (topological) order, to a fixed
 * point.  A segment output is recomputed only when that needs no new
 * saved bytes: it is kept alive by its consumers anyway, so saving it may
 * cost nothing. */
static int rc_choose(rc_state *r)
{
	const ej_graph *f = r->f;
	bool *is_out = calloc((size_t)f->n_values + 1, sizeof *is_out);
	EJ_ASSERT(is_out);
	for (int i = 0; i < f->n_outputs; i++)
		is_out[f->outputs[i]] = true;
	int n_recomp = 0;
	for (bool changed = true; changed;) {
		changed = false;
		for (int v = 0; v < f->n_values; v++) {
			if (r->st[v] != RC_SAVED)
				continue;
			const ej_ir_node *n = rc_node(r, v);
			if (!n)
				continue;
			uint64_t gain = is_out[v] ? 1 : rc_bytes(&f->values[v]);
			uint64_t c = 0;
			for (int k = 0; k < n->n_in && c < gain; k++) {
				EJ_ASSERT(n->in[k] < v);
				c += rc_cost(r, n->in[k], 1);
			}
			if (c >= gain)
				continue;
			for (int k = 0; k < n->n_in; k++)
				rc_commit(r, n->in[k], 1);
			r->st[v] = RC_RECOMP;
			n_recomp++;
			changed = true;
		}
	}
	free(is_out);
	return n_recomp;
}

/* Bytes of the saved node values (forward inputs are kept by reference). */
static uint64_t rc_saved_bytes(const rc_state *r, const bool *used, int *n)
{
	uint64_t b = 0;
	*n = 0;
	for (int v = 0; v < r->f->n_values; v++)
		if (used[v] && r->f->values[v].input < 0) {
			b += rc_bytes(&r->f->values[v]);
			(*n)++;
		}
	return b;
}

/* Backward graph under construction: map[] takes J (= forward, for ids
 * < n_fvalues) value ids to B value ids. */
typedef struct bw_state {
	const ej_graph *f;
	const char *st;
	ej_graph *bwd;
	int *map;
	int *saved;
	int n_saved;
	bool *seen;
} bw_state;

/* Collects the SAVED inputs forward value u needs: u itself, or for a
 * recomputed u the inputs of its node. */
static void bw_need(bw_state *b, int u)
{
	if (b->seen[u])
		return;
	b->seen[u] = true;
	const ej_value *x = &b->f->values[u];
	if (x->input < 0 && b->st[u] == RC_RECOMP) {
		const ej_ir_node *n = &b->f->nodes[x->node];
		for (int k = 0; k < n->n_in; k++)
			bw_need(b, n->in[k]);
		return;
	}
	b->map[u] = ej_graph_add_input(b->bwd, EJ_IN_SAVED, b->n_saved,
				       x->dtype, x->ndim, x->shape);
	b->saved[b->n_saved++] = u;
}

static void copy_meta(const ej_graph *g, const ej_ir_node *n, ej_meta *m)
{
	EJ_ASSERT(n->n_out <= 16);
	for (int q = 0; q < n->n_out; q++) {
		const ej_value *x = &g->values[n->out[q]];
		memset(&m[q], 0, sizeof m[q]);
		m[q].dtype = x->dtype;
		m[q].ndim = x->ndim;
		memcpy(m[q].shape, x->shape, sizeof x->shape);
	}
}

/* Copies the node of recomputed forward value u (and first those of its
 * recomputed inputs) into B, unless already there. */
static void bw_emit(bw_state *b, int u)
{
	if (b->map[u] >= 0)
		return;
	const ej_value *x = &b->f->values[u];
	EJ_ASSERT(x->input < 0 && b->st[u] == RC_RECOMP);
	const ej_ir_node *n = &b->f->nodes[x->node];
	int ins[64];
	ej_meta m[16];
	EJ_ASSERT(n->n_in <= 64 && n->n_out == 1);
	for (int k = 0; k < n->n_in; k++) {
		bw_emit(b, n->in[k]);
		ins[k] = b->map[n->in[k]];
	}
	copy_meta(b->f, n, m);
	int nn = ej_graph_add_node(b->bwd, n->op, &n->attrs, ins, n->n_in, m,
				   n->n_out);
	b->map[u] = b->bwd->nodes[nn].out[0];
}

/* The backward formula of forward node n, traced into the joint graph;
 * its input gradients added to s->grad. */
static epj_status ad_node(ad_state *s, const ej_graph *f, const ej_ir_node *n)
{
	epj_ctx *ctx = s->ctx;
	epj_status st = EPJ_OK;
	if (n->dead)
		return EPJ_OK;
	EJ_ASSERT(n->op != EJ_IR_BREAK);
	bool any_g = false, any_need = false;
	for (int k = 0; k < n->n_out; k++)
		any_g |= s->grad[n->out[k]] != NULL;
	bool needs[64] = { 0 };
	EJ_ASSERT(n->n_in <= 64);
	for (int k = 0; k < n->n_in; k++) {
		needs[k] = f->values[n->in[k]].requires_grad;
		any_need |= needs[k];
	}
	if (!any_g || !any_need)
		return EPJ_OK;
	const ej_op_info *info = &ej_ops[n->op];
	if (!info->backward || (info->flags & EJ_OPF_NO_GRAD))
		return EPJ_OK;
	epj_tensor *ins[64], *outs[16], *gout[16], *gin[64] = { 0 };
	EJ_ASSERT(n->n_out <= 16);
	for (int k = 0; k < n->n_in; k++)
		ins[k] = sym_of(s, n->in[k]);
	for (int k = 0; k < n->n_out; k++) {
		outs[k] = sym_of(s, n->out[k]);
		gout[k] = s->grad[n->out[k]];
	}
	ej_call c = { .op = n->op,
		      .attrs = &n->attrs,
		      .in = ins,
		      .n_in = n->n_in,
		      .out = outs,
		      .n_out = n->n_out };
	st = info->backward(ctx, &c, gout, needs, gin);
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "autodiff of %s", info->name);
		return st;
	}
	for (int k = 0; k < n->n_in; k++) {
		if (gin[k] && needs[k] && st == EPJ_OK)
			st = add_grad(s, n->in[k], gin[k]);
		epj_tensor_free(gin[k]);
	}
	return st;
}

/* The joint graph j of f partitioned into seg's forward graph (f plus the
 * saved values as outputs) and backward graph, the forward values the
 * backward reads either saved or recomputed in it (rc_choose);
 * grad_in_ids[k]: the joint value of f's input k's gradient, -1 if none. */
static epj_status ad_partition(epj_ctx *ctx, ej_graph *f, ej_graph *j,
			       const int *grad_in_ids, ej_segment *seg)
{
	const int nF = f->n_nodes, nV = f->n_values;
	ej_graph *fwd = NULL, *bwd = NULL;
	epj_status st = EPJ_OK;
	int *map = malloc(sizeof *map * (size_t)(j->n_values + 1));
	int *saved = malloc(sizeof *saved * (size_t)(nV + 1));
	char *rst = calloc((size_t)nV + 1, 1);
	bool *want = calloc((size_t)nV + 1, sizeof *want);
	bool *seen = calloc((size_t)nV + 1, sizeof *seen);
	if (!map || !saved || !rst || !want || !seen) {
		free(map);
		free(saved);
		free(rst);
		free(want);
		free(seen);
		st = ej_error(ctx, EPJ_ERR_NOMEM, "autodiff: out of memory");
		goto out;
	}
	/* forward values read by backward nodes or returned as gradients */
	for (int i = nF; i < j->n_nodes; i++)
		for (int k = 0; k < j->nodes[i].n_in; k++)
			if (j->nodes[i].in[k] < nV)
				want[j->nodes[i].in[k]] = true;
	for (int k = 0; k < f->n_inputs; k++)
		if (grad_in_ids[k] >= 0 && grad_in_ids[k] < nV)
			want[grad_in_ids[k]] = true;
	rc_state rc = { .f = f, .st = rst };
	for (int v = 0; v < nV; v++)
		if (want[v] && f->values[v].input < 0)
			rst[v] = RC_SAVED;
	int n_before, n_after;
	uint64_t b_before = rc_saved_bytes(&rc, want, &n_before);
	int n_recomp = rc_choose(&rc);

	for (int v = 0; v < j->n_values; v++)
		map[v] = -1;
	bwd = ej_graph_new("backward");
	bw_state bw = { .f = f,
			.st = rst,
			.bwd = bwd,
			.map = map,
			.saved = saved,
			.seen = seen };
	/* GRAD inputs first, in output order */
	for (int k = 0; k < j->n_inputs; k++) {
		ej_graph_input *gi = &j->inputs[k];
		if (gi->kind != EJ_IN_GRAD)
			continue;
		const ej_value *x = &j->values[gi->value];
		map[gi->value] = ej_graph_add_input(
		    bwd, EJ_IN_GRAD, gi->slot, x->dtype, x->ndim, x->shape);
	}
	/* SAVED inputs, in order of first use (all inputs precede nodes) */
	for (int i = nF; i < j->n_nodes; i++)
		for (int k = 0; k < j->nodes[i].n_in; k++)
			if (j->nodes[i].in[k] < nV)
				bw_need(&bw, j->nodes[i].in[k]);
	for (int k = 0; k < f->n_inputs; k++)
		if (grad_in_ids[k] >= 0 && grad_in_ids[k] < nV)
			bw_need(&bw, grad_in_ids[k]);
	int n_saved = bw.n_saved;
	memset(want, 0, sizeof *want * (size_t)(nV + 1));
	for (int q = 0; q < n_saved; q++)
		want[saved[q]] = true;
	uint64_t b_after = rc_saved_bytes(&rc, want, &n_after);
	epj_log_msg(EPJ_LOG_DEBUG,
		    "autodiff: saved node values %d (%.1f KiB) -> %d "
		    "(%.1f KiB), %d recomputed in backward",
		    n_before, (double)b_before / 1024.0, n_after,
		    (double)b_after / 1024.0, n_recomp);
	/* backward nodes, each recomputed forward value emitted before its
	 * first use */
	for (int i = nF; i < j->n_nodes; i++) {
		const ej_ir_node *n = &j->nodes[i];
		int ins[64];
		ej_meta m[16];
		for (int k = 0; k < n->n_in; k++) {
			if (n->in[k] < nV)
				bw_emit(&bw, n->in[k]);
			EJ_ASSERT(map[n->in[k]] >= 0);
			ins[k] = map[n->in[k]];
		}
		copy_meta(j, n, m);
		int nn = ej_graph_add_node(bwd, n->op, &n->attrs, ins, n->n_in,
					   m, n->n_out);
		for (int q = 0; q < n->n_out; q++)
			map[n->out[q]] = bwd->nodes[nn].out[q];
	}
	for (int k = 0; k < f->n_inputs; k++)
		if (grad_in_ids[k] >= 0 && grad_in_ids[k] < nV)
			bw_emit(&bw, grad_in_ids[k]);
	free(rst);
	free(want);
	free(seen);
	seg->grad_of_input = calloc((size_t)f->n_inputs + 1, sizeof(int));
	seg->saved_src = calloc((size_t)n_saved + 1, sizeof(int));
	if (!seg->grad_of_input || !seg->saved_src) {
		free(map);
		free(saved);
		st = ej_error(ctx, EPJ_ERR_NOMEM, "autodiff: out of memory");
		goto out;
	}
	for (int k = 0; k < f->n_inputs; k++) {
		if (grad_in_ids[k] < 0) {
			seg->grad_of_input[k] = -1;
			continue;
		}
		seg->grad_of_input[k] = bwd->n_outputs;
		ej_graph_add_output(bwd, map[grad_in_ids[k]]);
	}
	/* forward graph: F plus the saved node values as extra outputs */
	fwd = clone(f, "forward");
	seg->n_seg_out = f->n_outputs;
	for (int q = 0; q < n_saved; q++) {
		int v = saved[q];
		if (f->values[v].input >= 0) {
			seg->saved_src[q] = -(1 + f->values[v].input);
		} else {
			seg->saved_src[q] = fwd->n_outputs;
			ej_graph_add_output(fwd, v);
		}
	}
	seg->n_saved = n_saved;
	free(map);
	free(saved);
	seg->fwd = fwd;
	seg->bwd = bwd;
	fwd = bwd = NULL;
out:
	ej_graph_free(fwd);
	ej_graph_free(bwd);
	return st;
}

epj_status ej_autodiff_segment(epj_ctx *ctx, ej_graph *f, ej_segment *seg)
{
	ej_graph *j = clone(f, "joint");
	int nF = f->n_nodes, nV = f->n_values;
	ad_state s = { .ctx = ctx, .j = j, .n_fvalues = nV };
	epj_status st = EPJ_OK;
	int n_cap = nV * 4 + 64;
	s.sym = calloc((size_t)n_cap, sizeof *s.sym);
	s.grad = calloc((size_t)nV + 1, sizeof *s.grad);
	int *grad_in_ids = NULL;
	if (!s.sym || !s.grad) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "autodiff: out of memory");
		goto out;
	}
	bool prev = epj_no_grad_enter(ctx);
	s.tr = ej_tracer_begin(ctx, j);
	if (!s.tr) {
		epj_no_grad_exit(ctx, prev);
		st = ej_error(ctx, EPJ_ERR_NOMEM, "autodiff: out of memory");
		goto out;
	}
	/* gradients of the forward outputs enter as GRAD inputs */
	for (int o = 0; o < f->n_outputs && st == EPJ_OK; o++) {
		int v = f->outputs[o];
		const ej_value *x = &f->values[v];
		if (!x->requires_grad)
			continue;
		int gv = ej_graph_add_input(j, EJ_IN_GRAD, o, x->dtype, x->ndim,
					    x->shape);
		if (gv >= n_cap) {
			st = ej_error(ctx, EPJ_ERR_COMPILE,
				      "autodiff: value table overflow");
			break;
		}
		st = add_grad(&s, v, sym_of(&s, gv));
	}
	/* reverse over the forward nodes */
	for (int i = nF - 1; i >= 0 && st == EPJ_OK; i--)
		st = ad_node(&s, f, &f->nodes[i]);
	/* backward outputs: gradients of the forward inputs */
	grad_in_ids = malloc(sizeof *grad_in_ids * (size_t)(f->n_inputs + 1));
	if (!grad_in_ids && st == EPJ_OK)
		st = ej_error(ctx, EPJ_ERR_NOMEM, "autodiff: out of memory");
	for (int k = 0; st == EPJ_OK && k < f->n_inputs; k++) {
		int v = f->inputs[k].value;
		grad_in_ids[k] = s.grad[v] ? s.grad[v]->value_id : -1;
	}
	ej_tracer_end(ctx, s.tr);
	epj_no_grad_exit(ctx, prev);
	if (st != EPJ_OK)
		goto out;

	st = ad_partition(ctx, f, j, grad_in_ids, seg);
out:
	if (s.sym)
		for (int v = 0; v < n_cap; v++)
			epj_tensor_free(s.sym[v]);
	if (s.grad)
		for (int v = 0; v < nV; v++)
			epj_tensor_free(s.grad[v]);
	free(s.sym);
	free(s.grad);
	free(grad_in_ids);
	ej_graph_free(j);
	return st;
}
