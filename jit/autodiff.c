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
 * to B.  Every forward value B reads is "saved": an extra output of F (or a
 * forward input, kept by reference) that becomes a SAVED input of B.
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
	ej_graph *fwd = NULL, *bwd = NULL;
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
	for (int i = nF - 1; i >= 0 && st == EPJ_OK; i--) {
		const ej_ir_node *n = &f->nodes[i];
		if (n->dead)
			continue;
		EJ_ASSERT(n->op != EJ_IR_BREAK);
		bool any_g = false, any_need = false;
		for (int k = 0; k < n->n_out; k++)
			any_g |= s.grad[n->out[k]] != NULL;
		bool needs[64] = { 0 };
		EJ_ASSERT(n->n_in <= 64);
		for (int k = 0; k < n->n_in; k++) {
			needs[k] = f->values[n->in[k]].requires_grad;
			any_need |= needs[k];
		}
		if (!any_g || !any_need)
			continue;
		const ej_op_info *info = &ej_ops[n->op];
		if (!info->backward || (info->flags & EJ_OPF_NO_GRAD))
			continue;
		epj_tensor *ins[64], *outs[16], *gout[16], *gin[64] = { 0 };
		EJ_ASSERT(n->n_out <= 16);
		for (int k = 0; k < n->n_in; k++)
			ins[k] = sym_of(&s, n->in[k]);
		for (int k = 0; k < n->n_out; k++) {
			outs[k] = sym_of(&s, n->out[k]);
			gout[k] = s.grad[n->out[k]];
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
			break;
		}
		for (int k = 0; k < n->n_in; k++) {
			if (gin[k] && needs[k] && st == EPJ_OK)
				st = add_grad(&s, n->in[k], gin[k]);
			epj_tensor_free(gin[k]);
		}
	}
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

	/* ---- partition ---- */
	int *map = malloc(sizeof *map * (size_t)(j->n_values + 1));
	int *saved = malloc(sizeof *saved * (size_t)(j->n_values + 1));
	if (!map || !saved) {
		free(map);
		free(saved);
		st = ej_error(ctx, EPJ_ERR_NOMEM, "autodiff: out of memory");
		goto out;
	}
	for (int v = 0; v < j->n_values; v++)
		map[v] = -1;
	bwd = ej_graph_new("backward");
	int n_saved = 0;
	/* GRAD inputs first, in output order */
	for (int k = 0; k < j->n_inputs; k++) {
		ej_graph_input *gi = &j->inputs[k];
		if (gi->kind != EJ_IN_GRAD)
			continue;
		const ej_value *x = &j->values[gi->value];
		map[gi->value] = ej_graph_add_input(
		    bwd, EJ_IN_GRAD, gi->slot, x->dtype, x->ndim, x->shape);
	}
	/* SAVED inputs: forward values read by backward nodes or returned */
#define NEED(v)                                                                \
	do {                                                                   \
		int v_ = (v);                                                  \
		if (map[v_] < 0) {                                             \
			EJ_ASSERT(v_ < nV);                                    \
			const ej_value *x_ = &j->values[v_];                   \
			map[v_] = ej_graph_add_input(bwd, EJ_IN_SAVED,         \
						     n_saved, x_->dtype,       \
						     x_->ndim, x_->shape);     \
			saved[n_saved++] = v_;                                 \
		}                                                              \
	} while (0)
	for (int i = nF; i < j->n_nodes; i++)
		for (int k = 0; k < j->nodes[i].n_in; k++)
			if (j->nodes[i].in[k] < nV)
				NEED(j->nodes[i].in[k]);
	for (int k = 0; k < f->n_inputs; k++)
		if (grad_in_ids[k] >= 0 && grad_in_ids[k] < nV)
			NEED(grad_in_ids[k]);
#undef NEED
	for (int i = nF; i < j->n_nodes; i++) {
		const ej_ir_node *n = &j->nodes[i];
		int ins[64];
		ej_meta m[16];
		for (int k = 0; k < n->n_in; k++) {
			EJ_ASSERT(map[n->in[k]] >= 0);
			ins[k] = map[n->in[k]];
		}
		for (int q = 0; q < n->n_out; q++) {
			const ej_value *x = &j->values[n->out[q]];
			memset(&m[q], 0, sizeof m[q]);
			m[q].dtype = x->dtype;
			m[q].ndim = x->ndim;
			memcpy(m[q].shape, x->shape, sizeof x->shape);
		}
		int nn = ej_graph_add_node(bwd, n->op, &n->attrs, ins, n->n_in,
					   m, n->n_out);
		for (int q = 0; q < n->n_out; q++)
			map[n->out[q]] = bwd->nodes[nn].out[q];
	}
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
	if (s.sym)
		for (int v = 0; v < n_cap; v++)
			epj_tensor_free(s.sym[v]);
	if (s.grad)
		for (int v = 0; v < nV; v++)
			epj_tensor_free(s.grad[v]);
	free(s.sym);
	free(s.grad);
	free(grad_in_ids);
	ej_graph_free(fwd);
	ej_graph_free(bwd);
	ej_graph_free(j);
	return st;
}
