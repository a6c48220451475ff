/* ir.c -- the IR graph: construction, canonical text and signature.
 *
 * The canonical text numbers values in order of definition (inputs first,
 * then node outputs, skipping dead nodes), prints each input's kind, slot,
 * dtype, shape and requires_grad, each node's op, attributes and operands,
 * and the outputs.  Parameters appear only as "param <slot>": never their
 * identity or name, so identical decoder blocks produce identical text and
 * one signature.  Constants are identified by a hash of their contents.
 */
#include "jit_impl.h"

#include <stdio.h>

#define GROW(g, arr, n, cap, type)                                             \
	do {                                                                   \
		if ((n) == (cap)) {                                            \
			int nc_ = (cap) ? (cap)*2 : 16;                        \
			type *na_ = ej_arena_alloc(                            \
			    (g)->arena, sizeof(type) * (size_t)nc_);           \
			if ((n) > 0)                                           \
				memcpy(na_, (arr),                             \
				       sizeof(type) * (size_t)(n));            \
			(arr) = na_;                                           \
			(cap) = nc_;                                           \
		}                                                              \
	} while (0)

ej_graph *ej_graph_new(const char *name)
{
	ej_arena *a = ej_arena_new();
	ej_graph *g = ej_arena_alloc(a, sizeof *g);
	g->arena = a;
	g->name = ej_arena_strdup(a, name ? name : "graph");
	return g;
}

void ej_graph_free(ej_graph *g)
{
	if (!g)
		return;
	for (int i = 0; i < g->n_inputs; i++)
		epj_tensor_free(g->inputs[i].konst);
	ej_arena_free(g->arena);
}

int ej_graph_add_value(ej_graph *g, epj_dtype dt, int ndim,
		       const int64_t *shape)
{
	GROW(g, g->values, g->n_values, g->cap_values, ej_value);
	ej_value *v = &g->values[g->n_values];
	memset(v, 0, sizeof *v);
	v->dtype = dt;
	v->ndim = ndim;
	for (int i = 0; i < ndim; i++)
		v->shape[i] = shape[i];
	v->node = -1;
	v->input = -1;
	return g->n_values++;
}

int ej_graph_add_input(ej_graph *g, ej_input_kind kind, int slot, epj_dtype dt,
		       int ndim, const int64_t *shape)
{
	int v = ej_graph_add_value(g, dt, ndim, shape);
	GROW(g, g->inputs, g->n_inputs, g->cap_inputs, ej_graph_input);
	ej_graph_input *in = &g->inputs[g->n_inputs];
	memset(in, 0, sizeof *in);
	in->value = v;
	in->kind = kind;
	in->slot = slot;
	g->values[v].input = g->n_inputs;
	g->n_inputs++;
	return v;
}

int ej_graph_add_node(ej_graph *g, int op, const ej_attrs *attrs, const int *in,
		      int n_in, const ej_meta *out_meta, int n_out)
{
	GROW(g, g->nodes, g->n_nodes, g->cap_nodes, ej_ir_node);
	int idx = g->n_nodes++;
	ej_ir_node *n = &g->nodes[idx];
	memset(n, 0, sizeof *n);
	n->op = op;
	n->attrs = attrs ? *attrs : ej_attrs_none();
	n->n_in = n_in;
	n->n_out = n_out;
	n->in = ej_arena_alloc(g->arena, sizeof(int) * (size_t)(n_in + 1));
	n->out = ej_arena_alloc(g->arena, sizeof(int) * (size_t)(n_out + 1));
	for (int i = 0; i < n_in; i++)
		n->in[i] = in[i];
	for (int j = 0; j < n_out; j++) {
		int v = ej_graph_add_value(g, out_meta[j].dtype,
					   out_meta[j].ndim, out_meta[j].shape);
		/* add_value may have moved g->nodes? no: values only */
		g->values[v].node = idx;
		g->values[v].out_nr = j;
		g->nodes[idx].out[j] = v;
	}
	return idx;
}

void ej_graph_add_output(ej_graph *g, int value)
{
	GROW(g, g->outputs, g->n_outputs, g->cap_outputs, int);
	g->outputs[g->n_outputs++] = value;
}

int ej_graph_live_nodes(const ej_graph *g)
{
	int n = 0;
	for (int i = 0; i < g->n_nodes; i++)
		n += !g->nodes[i].dead;
	return n;
}

/* ---- canonical text ---------------------------------------------------------
 */

static void sb_meta(ej_sbuf *s, const ej_value *v)
{
	ej_sb_printf(s, "%s[", epj_dtype_name(v->dtype));
	for (int i = 0; i < v->ndim; i++)
		ej_sb_printf(s, "%s%lld", i ? "," : "", (long long)v->shape[i]);
	ej_sb_printf(s, "]");
}

static const char *kind_name(ej_input_kind k)
{
	switch (k) {
	case EJ_IN_ACT:
		return "act";
	case EJ_IN_PARAM:
		return "param";
	case EJ_IN_CONST:
		return "const";
	case EJ_IN_GRAD:
		return "grad";
	case EJ_IN_SAVED:
		return "saved";
	}
	return "?";
}

static void const_hash_hex(const epj_tensor *t, char out[33])
{
	/* contents of a contiguous copy, row-major, as doubles */
	int64_t n = epj_tensor_numel(t);
	double *v = malloc(sizeof *v * (size_t)(n > 0 ? n : 1));
	EJ_ASSERT(v);
	epj_tensor_to_f64(t->ctx, t, v);
	epj_hash_hex(epj_hash(v, sizeof *v * (size_t)n), out);
	free(v);
}

const char *ej_graph_text(ej_graph *g)
{
	ej_sbuf s = { 0 };
	int *num = calloc((size_t)g->n_values + 1, sizeof *num);
	EJ_ASSERT(num);
	int next = 0;
	for (int i = 0; i < g->n_values; i++)
		num[i] = -1;
	for (int i = 0; i < g->n_inputs; i++) {
		const ej_graph_input *in = &g->inputs[i];
		num[in->value] = next++;
		ej_sb_printf(&s, "in %%%d %s %d ", num[in->value],
			     kind_name(in->kind), in->slot);
		sb_meta(&s, &g->values[in->value]);
		if (g->values[in->value].requires_grad)
			ej_sb_printf(&s, " rg");
		if (in->kind == EJ_IN_CONST && in->konst) {
			char h[33];
			const_hash_hex(in->konst, h);
			ej_sb_printf(&s, " #%s", h);
		}
		ej_sb_printf(&s, "\n");
	}
	for (int i = 0; i < g->n_nodes; i++) {
		const ej_ir_node *n = &g->nodes[i];
		if (n->dead)
			continue;
		for (int j = 0; j < n->n_out; j++) {
			num[n->out[j]] = next++;
			ej_sb_printf(&s, "%s%%%d", j ? ", " : "",
				     num[n->out[j]]);
		}
		if (n->op == EJ_IR_BREAK)
			ej_sb_printf(&s, " = break.%s(",
				     n->reason ? n->reason : "call");
		else
			ej_sb_printf(&s, " = %s(", ej_ops[n->op].name);
		for (int k = 0; k < n->n_in; k++)
			ej_sb_printf(&s, "%s%%%d", k ? ", " : "",
				     num[n->in[k]]);
		ej_sb_printf(&s, ")");
		if (n->attrs.n_i || n->attrs.n_f) {
			ej_sb_printf(&s, " {");
			for (int k = 0; k < n->attrs.n_i; k++)
				ej_sb_printf(&s, "%s%lld", k ? "," : "i:",
					     (long long)n->attrs.i[k]);
			for (int k = 0; k < n->attrs.n_f; k++)
				ej_sb_printf(&s, "%s%.17g",
					     k ? ","
					       : (n->attrs.n_i ? " f:" : "f:"),
					     n->attrs.f[k]);
			ej_sb_printf(&s, "}");
		}
		ej_sb_printf(&s, " :");
		for (int j = 0; j < n->n_out; j++) {
			ej_sb_printf(&s, " ");
			sb_meta(&s, &g->values[n->out[j]]);
		}
		ej_sb_printf(&s, "\n");
	}
	ej_sb_printf(&s, "out");
	for (int i = 0; i < g->n_outputs; i++)
		ej_sb_printf(&s, " %%%d", num[g->outputs[i]]);
	ej_sb_printf(&s, "\n");
	free(num);
	return ej_sb_finish(&s, g->arena);
}

epj_hash128 ej_graph_signature(ej_graph *g)
{
	const char *t = ej_graph_text(g);
	return epj_hash(t, strlen(t));
}
