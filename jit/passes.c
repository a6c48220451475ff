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
