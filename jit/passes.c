/* passes.c -- graph passes: dead-code elimination, common-subexpression
 * elimination, compaction, requires_grad propagation.
 *
 * Every pass keeps all graph inputs (bindings are positional) and the
 * output list.  No op mutates its inputs, so CSE may merge any two pure
 * nodes with equal op, attributes and operands; graph breaks are never
 * merged or removed by CSE.
 */
#include "jit_impl.h"

void ej_pass_dce(ej_graph *g)
{
	bool *live = calloc((size_t)g->n_values + 1, sizeof *live);
	EJ_ASSERT(live);
	for (int i = 0; i < g->n_outputs; i++)
		live[g->outputs[i]] = true;
	for (int i = g->n_nodes - 1; i >= 0; i--) {
		ej_ir_node *n = &g->nodes[i];
		if (n->dead)
			continue;
		bool used = n->op == EJ_IR_BREAK; /* side effects */
		for (int j = 0; j < n->n_out && !used; j++)
			used = live[n->out[j]];
		if (!used) {
			n->dead = true;
			continue;
		}
		for (int k = 0; k < n->n_in; k++)
			live[n->in[k]] = true;
	}
	free(live);
}

static bool same_node(const ej_ir_node *a, const ej_ir_node *b, const int *repl)
{
	if (a->op != b->op || a->n_in != b->n_in || a->n_out != b->n_out)
		return false;
	if (a->attrs.n_i != b->attrs.n_i || a->attrs.n_f != b->attrs.n_f)
		return false;
	for (int k = 0; k < a->attrs.n_i; k++)
		if (a->attrs.i[k] != b->attrs.i[k])
			return false;
	for (int k = 0; k < a->attrs.n_f; k++)
		if (memcmp(&a->attrs.f[k], &b->attrs.f[k], sizeof(double)))
			return false;
	for (int k = 0; k < a->n_in; k++)
		if (repl[a->in[k]] != repl[b->in[k]])
			return false;
	return true;
}

static uint64_t node_hash(const ej_ir_node *n, const int *repl)
{
	uint64_t h = 1469598103934665603ull ^ (uint64_t)(n->op + 7);
	for (int k = 0; k < n->n_in; k++)
		h = (h ^ (uint64_t)repl[n->in[k]]) * 1099511628211ull;
	for (int k = 0; k < n->attrs.n_i; k++)
		h = (h ^ (uint64_t)n->attrs.i[k]) * 1099511628211ull;
	for (int k = 0; k < n->attrs.n_f; k++) {
		uint64_t b;
		memcpy(&b, &n->attrs.f[k], sizeof b);
		h = (h ^ b) * 1099511628211ull;
	}
	return h;
}

void ej_pass_cse(ej_graph *g)
{
	int *repl = malloc(sizeof *repl * (size_t)(g->n_values + 1));
	int cap = 1;
	while (cap < g->n_nodes * 2 + 2)
		cap *= 2;
	int *table = malloc(sizeof *table * (size_t)cap);
	EJ_ASSERT(repl && table);
	for (int v = 0; v < g->n_values; v++)
		repl[v] = v;
	for (int i = 0; i < cap; i++)
		table[i] = -1;
	for (int i = 0; i < g->n_nodes; i++) {
		ej_ir_node *n = &g->nodes[i];
		if (n->dead)
			continue;
		for (int k = 0; k < n->n_in; k++)
			n->in[k] = repl[n->in[k]];
		if (n->op == EJ_IR_BREAK)
			continue;
		uint64_t h = node_hash(n, repl);
		int slot = (int)(h & (uint64_t)(cap - 1));
		for (;;) {
			int o = table[slot];
			if (o < 0) {
				table[slot] = i;
				break;
			}
			if (same_node(&g->nodes[o], n, repl)) {
				for (int j = 0; j < n->n_out; j++)
					repl[n->out[j]] = g->nodes[o].out[j];
				n->dead = true;
				break;
			}
			slot = (slot + 1) & (cap - 1);
		}
	}
	for (int i = 0; i < g->n_outputs; i++)
		g->outputs[i] = repl[g->outputs[i]];
	free(repl);
	free(table);
}

ej_graph *ej_graph_compact(ej_graph *g, const char *name)
{
	ej_graph *c = ej_graph_new(name);
	int *map = malloc(sizeof *map * (size_t)(g->n_values + 1));
	EJ_ASSERT(map);
	for (int v = 0; v < g->n_values; v++)
		map[v] = -1;
	for (int i = 0; i < g->n_inputs; i++) {
		const ej_graph_input *in = &g->inputs[i];
		const ej_value *x = &g->values[in->value];
		int nv = ej_graph_add_input(c, in->kind, in->slot, x->dtype,
					    x->ndim, x->shape);
		c->values[nv].requires_grad = x->requires_grad;
		if (in->konst)
			c->inputs[c->values[nv].input].konst =
			    epj_tensor_ref(in->konst);
		map[in->value] = nv;
	}
	for (int i = 0; i < g->n_nodes; i++) {
		const ej_ir_node *n = &g->nodes[i];
		if (n->dead)
			continue;
		int ins[64];
		ej_meta m[16];
		EJ_ASSERT(n->n_in <= 64 && n->n_out <= 16);
		for (int k = 0; k < n->n_in; k++) {
			EJ_ASSERT(map[n->in[k]] >= 0);
			ins[k] = map[n->in[k]];
		}
		for (int j = 0; j < n->n_out; j++) {
			const ej_value *x = &g->values[n->out[j]];
			memset(&m[j], 0, sizeof m[j]);
			m[j].dtype = x->dtype;
			m[j].ndim = x->ndim;
			memcpy(m[j].shape, x->shape, sizeof x->shape);
		}
		int k = ej_graph_add_node(c, n->op, &n->attrs, ins, n->n_in, m,
					  n->n_out);
		c->nodes[k].callee = n->callee;
		c->nodes[k].reason = n->reason;
		for (int j = 0; j < n->n_out; j++) {
			map[n->out[j]] = c->nodes[k].out[j];
			c->values[map[n->out[j]]].requires_grad =
			    g->values[n->out[j]].requires_grad;
		}
	}
	for (int i = 0; i < g->n_outputs; i++) {
		EJ_ASSERT(map[g->outputs[i]] >= 0);
		ej_graph_add_output(c, map[g->outputs[i]]);
	}
	free(map);
	return c;
}

void ej_graph_propagate_grad(ej_graph *g)
{
	for (int i = 0; i < g->n_nodes; i++) {
		ej_ir_node *n = &g->nodes[i];
		if (n->dead || n->op == EJ_IR_BREAK)
			continue;
		bool rg = false;
		for (int k = 0; k < n->n_in; k++)
			rg |= g->values[n->in[k]].requires_grad;
		const ej_op_info *info = &ej_ops[n->op];
		bool diff = info->backward && !(info->flags & EJ_OPF_NO_GRAD);
		for (int j = 0; j < n->n_out; j++) {
			ej_value *x = &g->values[n->out[j]];
			x->requires_grad =
			    rg && diff && epj_dtype_is_float(x->dtype);
		}
	}
}

/* GEMM epilogue: add(linear(x, w), b) with a bias b [out] becomes
 * linear(x, w, b) (the bias is the GEMM's C, beta = 1, in LINEAR's
 * kernel).  add(r, P) where P is a MATMUL or LINEAR (x, w) product,
 * possibly through reshapes, read by nothing else, becomes one
 * GEMM_ADD(a, b, r) whose GEMM accumulates onto r (beta = 1); r must have
 * the add's shape and dtype (no broadcast).  Both residual adds
 * (h + o_proj(x)) and the gradient sums of backward (g = g + A @ B) take
 * this form.  The product and its reshapes die (DCE removes them). */
static int n_uses(const ej_graph *g, const int *uses, int v)
{
	int n = uses[v];
	for (int i = 0; i < g->n_outputs; i++)
		n += g->outputs[i] == v ? 1 : 0;
	return n;
}

static bool same_meta(const ej_value *a, const ej_value *b)
{
	if (a->dtype != b->dtype || a->ndim != b->ndim)
		return false;
	for (int d = 0; d < a->ndim; d++)
		if (a->shape[d] != b->shape[d])
			return false;
	return true;
}

int ej_pass_gemm_epilogue(ej_graph *g)
{
	int *uses = calloc((size_t)g->n_values + 1, sizeof *uses);
	EJ_ASSERT(uses);
	for (int i = 0; i < g->n_nodes; i++) {
		const ej_ir_node *n = &g->nodes[i];
		if (!n->dead)
			for (int k = 0; k < n->n_in; k++)
				uses[n->in[k]]++;
	}
	int fused = 0;
	for (int i = 0; i < g->n_nodes; i++) {
		ej_ir_node *n = &g->nodes[i];
		if (n->dead || n->op != EJ_OP_ADD || n->in[0] == n->in[1])
			continue;
		const ej_value *o = &g->values[n->out[0]];
		for (int k = 0; k < 2; k++) {
			int v = n->in[k], r = n->in[1 - k];
			/* a bias: linear(x, w) + b [out] -> linear(x, w, b) */
			const ej_value *bv = &g->values[r];
			int q = g->values[v].node;
			if (q >= 0 && n_uses(g, uses, v) == 1 &&
			    g->nodes[q].op == EJ_OP_LINEAR &&
			    g->nodes[q].n_in == 2 && bv->ndim == 1 &&
			    bv->dtype == o->dtype &&
			    same_meta(&g->values[v], o) &&
			    bv->shape[0] == o->shape[o->ndim - 1]) {
				ej_ir_node *x = &g->nodes[q];
				int *in =
				    ej_arena_alloc(g->arena, sizeof(int) * 4);
				in[0] = x->in[0];
				in[1] = x->in[1];
				in[2] = r;
				n->op = EJ_OP_LINEAR;
				n->attrs = ej_attrs_none();
				n->in = in;
				n->n_in = 3;
				x->dead = true;
				fused++;
				break;
			}
			if (!same_meta(&g->values[r], o))
				continue;
			/* through single-use reshapes to the product */
			int chain[EPJ_MAX_DIMS * 4], nc = 0, p = -1;
			while (n_uses(g, uses, v) == 1) {
				int q = g->values[v].node;
				if (q < 0)
					break;
				const ej_ir_node *x = &g->nodes[q];
				if (x->op == EJ_OP_RESHAPE &&
				    nc < (int)(sizeof chain / sizeof *chain)) {
					chain[nc++] = q;
					v = x->in[0];
					continue;
				}
				if ((x->op == EJ_OP_MATMUL ||
				     (x->op == EJ_OP_LINEAR && x->n_in == 2)) &&
				    g->values[v].dtype == o->dtype)
					p = q;
				break;
			}
			if (p < 0)
				continue;
			ej_ir_node *x = &g->nodes[p];
			int *in = ej_arena_alloc(g->arena, sizeof(int) * 4);
			in[0] = x->in[0];
			in[1] = x->in[1];
			in[2] = r;
			ej_attrs at = ej_attrs_none();
			at.n_i = 1;
			at.i[0] = x->op == EJ_OP_LINEAR;
			n->op = EJ_OP_GEMM_ADD;
			n->attrs = at;
			n->in = in;
			n->n_in = 3;
			uses[v]--;
			x->dead = true;
			for (int c = 0; c < nc; c++)
				g->nodes[chain[c]].dead = true;
			fused++;
			break;
		}
	}
	free(uses);
	return fused;
}

/* RoPE: add(mul(x, cos), mul(cat(neg(slice(x, h:D)), slice(x, 0:h)), sin))
 * along the last dim (either operand order of add and mul) becomes
 * ROPE(x, cos, sin); run on the traced graph before autodiff, so the
 * backward is ROPE's formula (ROPE_BACKWARD, one op instead of slices,
 * negation, zero-filled slice_backward copies and adds).  The chain's
 * nodes stay for DCE. */
static const ej_ir_node *producer(const ej_graph *g, int v, int op)
{
	int p = g->values[v].node;
	if (p < 0 || g->nodes[p].dead || g->nodes[p].op != op)
		return NULL;
	return &g->nodes[p];
}

/* Is v = slice(x, last axis, start, end, 1)?  Returns x or -1. */
static int half_of(const ej_graph *g, int v, int64_t start, int64_t end)
{
	const ej_ir_node *s = producer(g, v, EJ_OP_SLICE);
	if (!s || s->attrs.n_i < 4)
		return -1;
	const ej_value *x = &g->values[s->in[0]];
	if (s->attrs.i[0] != x->ndim - 1 || s->attrs.i[1] != start ||
	    s->attrs.i[2] != end || s->attrs.i[3] != 1)
		return -1;
	return s->in[0];
}

/* Is v = cat(neg(x[..., h:]), x[..., :h])?  Returns x or -1. */
static int rotated(const ej_graph *g, int v)
{
	const ej_ir_node *c = producer(g, v, EJ_OP_CAT);
	if (!c || c->n_in != 2)
		return -1;
	const ej_value *o = &g->values[v];
	int64_t D = o->shape[o->ndim - 1];
	if (c->attrs.i[0] != o->ndim - 1 || D % 2 != 0)
		return -1;
	const ej_ir_node *n = producer(g, c->in[0], EJ_OP_NEG);
	if (!n)
		return -1;
	int x = half_of(g, n->in[0], D / 2, D);
	if (x < 0 || half_of(g, c->in[1], 0, D / 2) != x)
		return -1;
	return x;
}

int ej_pass_rope(ej_graph *g)
{
	int fused = 0;
	for (int i = 0; i < g->n_nodes; i++) {
		ej_ir_node *n = &g->nodes[i];
		if (n->dead || n->op != EJ_OP_ADD)
			continue;
		const ej_value *o = &g->values[n->out[0]];
		for (int k = 0; k < 2; k++) {
			const ej_ir_node *m1 = producer(g, n->in[k], EJ_OP_MUL);
			const ej_ir_node *m2 =
			    producer(g, n->in[1 - k], EJ_OP_MUL);
			if (!m1 || !m2)
				continue;
			int x = -1, cs = -1, sn = -1;
			for (int a = 0; a < 2 && x < 0; a++) {
				int r = rotated(g, m2->in[a]);
				if (r < 0)
					continue;
				for (int b = 0; b < 2; b++)
					if (m1->in[b] == r) {
						x = r;
						cs = m1->in[1 - b];
						sn = m2->in[1 - a];
						break;
					}
			}
			if (x < 0 || !same_meta(&g->values[x], o) ||
			    g->values[cs].dtype != o->dtype ||
			    g->values[sn].dtype != o->dtype ||
			    !same_meta(&g->values[m1->out[0]], o) ||
			    !same_meta(&g->values[m2->out[0]], o))
				continue;
			int *in = ej_arena_alloc(g->arena, sizeof(int) * 4);
			in[0] = x;
			in[1] = cs;
			in[2] = sn;
			n->op = EJ_OP_ROPE;
			n->attrs = ej_attrs_none();
			n->in = in;
			n->n_in = 3;
			fused++;
			break;
		}
	}
	return fused;
}
