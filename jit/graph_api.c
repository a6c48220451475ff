/* graph_api.c -- graphs described by another framework (epj_graph_*).
 *
 * A caller that has its own graph (PyTorch's FX graphs of ATen ops, through
 * the Python package in python/) describes it node by node: inputs (dtype,
 * shape), nodes (an op of lib/ops.def by name, tensor arguments, int and
 * float attributes in the op's layout), outputs.  Compiling interprets that
 * list inside ej_trace_region, calling the ordinary op dispatcher, so the
 * tracer records the same IR as a native region and ej_jit_compile runs the
 * same passes, printers, compilers, kernel cache and signatures.  Every
 * tensor is a graph input (parameters included): no data pointer reaches a
 * signature, so identical layers share one compiled graph.
 *
 * Graphs are forward-only: they are traced and run with gradient mode off
 * (the caller differentiates, e.g. AOTAutograd hands a backward graph as
 * another graph).
 */
#include "jit.h"

#include <stdlib.h>
#include <string.h>

struct epj_compiler {
	ej_jit *jit;
};

typedef struct graph_node {
	int op;
	int n_in, n_out;
	int *in;   /* value ids */
	int first; /* value id of output 0; outputs are consecutive */
	ej_attrs attrs;
} graph_node;

typedef struct graph_input {
	epj_dtype dtype;
	int ndim;
	int64_t shape[EPJ_MAX_DIMS];
} graph_input;

struct epj_graph {
	graph_input *inputs;
	int n_inputs, cap_inputs;
	graph_node *nodes;
	int n_nodes, cap_nodes;
	int *outputs;
	int n_outputs, cap_outputs;
	int n_values;
	ej_region_fn *fn; /* after epj_graph_compile */
};

epj_status epj_compiler_new(epj_ctx *ctx, const char *backend,
			    epj_compiler **out)
{
	char msg[256] = "";
	ej_backend_kind kind;
	*out = NULL;
	/* no backend: the context's device's own when it runs CUDA C
	 * (cuda: nvrtc, cuda-sim: cuda-sim), as the engine picks; else the
	 * default (EPJIT_DEVICE's, jit/pipeline.c) */
	if ((!backend || !*backend) && ctx->dev->desc->runs_cuda)
		backend = ctx->dev->desc->backend;
	epj_status st =
	    ej_backend_parse(backend ? backend : "", &kind, msg, sizeof msg);
	if (st != EPJ_OK)
		return ej_error(ctx, st, "compiler: backend \"%s\": %s",
				backend ? backend : "", msg);
	/* generated C (and cuda-sim's kernels) run on the host: they cannot
	 * read a context's device memory */
	if (!ctx->dev->host_visible && kind != EJ_BACKEND_INTERPRETER &&
	    !ej_backend_device(kind))
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"compiler: backend \"%s\" runs on the host and "
				"cannot read the %s device's memory (its own: "
				"\"%s\")",
				ej_backend_name(kind), ctx->dev->name,
				ctx->dev->desc->backend);
	epj_compiler *c = calloc(1, sizeof *c);
	if (c)
		c->jit = ej_jit_new(ctx, kind);
	if (!c || !c->jit) {
		free(c);
		return ej_error(ctx, EPJ_ERR_NOMEM, "compiler: out of memory");
	}
	*out = c;
	return EPJ_OK;
}

ej_jit *ej_compiler_jit(epj_compiler *c)
{
	return c->jit;
}

void epj_compiler_free(epj_compiler *c)
{
	if (!c)
		return;
	ej_jit_free(c->jit);
	free(c);
}

epj_status epj_graph_new(epj_ctx *ctx, epj_graph **out)
{
	*out = calloc(1, sizeof **out);
	if (!*out)
		return ej_error(ctx, EPJ_ERR_NOMEM, "graph: out of memory");
	return EPJ_OK;
}

void epj_graph_free(epj_graph *g)
{
	if (!g)
		return;
	for (int i = 0; i < g->n_nodes; i++)
		free(g->nodes[i].in);
	free(g->nodes);
	free(g->inputs);
	free(g->outputs);
	ej_region_fn_free(g->fn);
	free(g);
}

/* Grows *p (elements of size sz) to hold n + 1. */
static bool grow(void **p, int *cap, int n, size_t sz)
{
	if (n < *cap)
		return true;
	int nc = *cap ? *cap * 2 : 16;
	void *q = realloc(*p, (size_t)nc * sz);
	if (!q)
		return false;
	*p = q;
	*cap = nc;
	return true;
}

static epj_status check_open(epj_ctx *ctx, const epj_graph *g, const char *who)
{
	if (g->fn)
		return ej_error(ctx, EPJ_ERR_STATE,
				"graph: %s after epj_graph_compile", who);
	return EPJ_OK;
}

epj_status epj_graph_input(epj_ctx *ctx, epj_graph *g, epj_dtype dt, int ndim,
			   const int64_t *shape, int *value)
{
	epj_status st = check_open(ctx, g, "input");
	if (st != EPJ_OK)
		return st;
	if (g->n_nodes > 0)
		return ej_error(ctx, EPJ_ERR_STATE,
				"graph: input %d declared after the first node",
				g->n_inputs);
	if ((unsigned)dt >= EPJ_DTYPE_COUNT || ndim < 0 ||
	    ndim > EPJ_MAX_DIMS || (ndim > 0 && !shape))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"graph: input %d: bad dtype %d or rank %d "
				"(at most %d)",
				g->n_inputs, (int)dt, ndim, EPJ_MAX_DIMS);
	for (int i = 0; i < ndim; i++)
		if (shape[i] < 0)
			return ej_error(ctx, EPJ_ERR_SHAPE,
					"graph: input %d: dimension %d is "
					"%lld",
					g->n_inputs, i, (long long)shape[i]);
	if (!grow((void **)&g->inputs, &g->cap_inputs, g->n_inputs,
		  sizeof *g->inputs))
		return ej_error(ctx, EPJ_ERR_NOMEM, "graph: out of memory");
	graph_input *in = &g->inputs[g->n_inputs++];
	in->dtype = dt;
	in->ndim = ndim;
	for (int i = 0; i < ndim; i++)
		in->shape[i] = shape[i];
	*value = g->n_values++;
	return EPJ_OK;
}

/* The op named `name` (lib/ops.def), or -1. */
static int op_by_name(const char *name)
{
	for (int i = 0; i < EJ_OP_COUNT; i++)
		if (strcmp(ej_ops[i].name, name) == 0)
			return i;
	return -1;
}

static epj_status check_node(epj_ctx *ctx, const epj_graph *g, int op,
			     const char *name, const int *in, int n_in,
			     int n_ints, int n_floats, int n_out)
{
	const ej_op_info *info = &ej_ops[op];
	bool var_in = info->flags & EJ_OPF_VARIADIC_IN;
	if (info->flags & EJ_OPF_VARIADIC_OUT)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"graph: node %d: op %s has a variable number "
				"of outputs, which graphs do not take",
				g->n_nodes, name);
	if (n_in < info->n_in || (!var_in && n_in != info->n_in))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"graph: node %d: op %s takes %s%d inputs, got "
				"%d",
				g->n_nodes, name, var_in ? "at least " : "",
				info->n_in, n_in);
	if (n_out != info->n_out)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"graph: node %d: op %s has %d outputs, got %d",
				g->n_nodes, name, info->n_out, n_out);
	if (n_ints < 0 || n_ints > EJ_MAX_ATTR_INTS || n_floats < 0 ||
	    n_floats > EJ_MAX_ATTR_FLOATS)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"graph: node %d: op %s: %d int / %d float "
				"attributes (at most %d / %d)",
				g->n_nodes, name, n_ints, n_floats,
				EJ_MAX_ATTR_INTS, EJ_MAX_ATTR_FLOATS);
	for (int k = 0; k < n_in; k++)
		if (in[k] < 0 || in[k] >= g->n_values)
			return ej_error(ctx, EPJ_ERR_INDEX,
					"graph: node %d: op %s: input %d is "
					"value %d, not one of the %d defined "
					"so far",
					g->n_nodes, name, k, in[k],
					g->n_values);
	return EPJ_OK;
}

epj_status epj_graph_node(epj_ctx *ctx, epj_graph *g, const char *op_name,
			  const int *in, int n_in, const int64_t *ints,
			  int n_ints, const double *floats, int n_floats,
			  int n_out, int *first_value)
{
	epj_status st = check_open(ctx, g, "node");
	if (st != EPJ_OK)
		return st;
	int op = op_name ? op_by_name(op_name) : -1;
	if (op < 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"graph: node %d: unknown op \"%s\" (see "
				"lib/ops.def)",
				g->n_nodes, op_name ? op_name : "(null)");
	st = check_node(ctx, g, op, op_name, in, n_in, n_ints, n_floats, n_out);
	if (st != EPJ_OK)
		return st;
	if (!grow((void **)&g->nodes, &g->cap_nodes, g->n_nodes,
		  sizeof *g->nodes))
		return ej_error(ctx, EPJ_ERR_NOMEM, "graph: out of memory");
	graph_node *nd = &g->nodes[g->n_nodes];
	memset(nd, 0, sizeof *nd);
	nd->in = malloc(((size_t)n_in + 1) * sizeof *nd->in);
	if (!nd->in)
		return ej_error(ctx, EPJ_ERR_NOMEM, "graph: out of memory");
	if (n_in > 0)
		memcpy(nd->in, in, (size_t)n_in * sizeof *in);
	nd->op = op;
	nd->n_in = n_in;
	nd->n_out = n_out;
	for (int i = 0; i < n_ints; i++)
		ej_attrs_push_i(&nd->attrs, ints[i]);
	for (int i = 0; i < n_floats; i++)
		ej_attrs_push_f(&nd->attrs, floats[i]);
	nd->first = g->n_values;
	g->n_values += n_out;
	g->n_nodes++;
	*first_value = nd->first;
	return EPJ_OK;
}

epj_status epj_graph_output(epj_ctx *ctx, epj_graph *g, int value)
{
	epj_status st = check_open(ctx, g, "output");
	if (st != EPJ_OK)
		return st;
	if (value < 0 || value >= g->n_values)
		return ej_error(ctx, EPJ_ERR_INDEX,
				"graph: output %d is value %d, not one of the "
				"%d defined",
				g->n_outputs, value, g->n_values);
	if (!grow((void **)&g->outputs, &g->cap_outputs, g->n_outputs,
		  sizeof *g->outputs))
		return ej_error(ctx, EPJ_ERR_NOMEM, "graph: out of memory");
	g->outputs[g->n_outputs++] = value;
	return EPJ_OK;
}

int epj_graph_n_outputs(const epj_graph *g)
{
	return g ? g->n_outputs : 0;
}

/* The traced function: interprets the node list through the dispatcher
 * (the tracer records each call). */
static epj_status interpret(void *user, epj_ctx *ctx, epj_tensor *const *in,
			    int n_in, epj_tensor **out, int n_out)
{
	epj_graph *g = user;
	EJ_ASSERT(n_in == g->n_inputs && n_out == g->n_outputs);
	epj_tensor **val = calloc((size_t)g->n_values + 1, sizeof *val);
	if (!val)
		return ej_error(ctx, EPJ_ERR_NOMEM, "graph: out of memory");
	for (int i = 0; i < n_in; i++)
		val[i] = epj_tensor_ref(in[i]);
	epj_status st = EPJ_OK;
	for (int n = 0; n < g->n_nodes && st == EPJ_OK; n++) {
		const graph_node *nd = &g->nodes[n];
		epj_tensor *args[64];
		epj_tensor **a =
		    nd->n_in <= 64 ? args : calloc((size_t)nd->n_in, sizeof *a);
		if (!a) {
			st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
			break;
		}
		for (int k = 0; k < nd->n_in; k++)
			a[k] = val[nd->in[k]];
		st = ej_dispatch(ctx, nd->op, a, nd->n_in, &nd->attrs,
				 &val[nd->first], nd->n_out);
		if (a != args)
			free(a);
		if (st != EPJ_OK)
			ej_error_prefix(ctx, "graph node %d (%s)", n,
					ej_ops[nd->op].name);
	}
	for (int j = 0; j < n_out && st == EPJ_OK; j++)
		out[j] = epj_tensor_ref(val[g->outputs[j]]);
	for (int v = 0; v < g->n_values; v++)
		epj_tensor_free(val[v]);
	free(val);
	return st;
}

static epj_status trace_and_compile(epj_ctx *ctx, ej_jit *jit, epj_graph *g)
{
	epj_tensor **meta = calloc((size_t)g->n_inputs + 1, sizeof *meta);
	if (!meta)
		return ej_error(ctx, EPJ_ERR_NOMEM, "graph: out of memory");
	epj_status st = EPJ_OK;
	for (int i = 0; i < g->n_inputs && st == EPJ_OK; i++) {
		const graph_input *gi = &g->inputs[i];
		meta[i] = ej_tensor_meta(ctx, gi->dtype, gi->ndim, gi->shape);
		if (!meta[i])
			st = ctx->status ? ctx->status : EPJ_ERR_NOMEM;
	}
	ej_trace *t = NULL;
	if (st == EPJ_OK)
		st = ej_trace_region(ctx, jit, interpret, g, meta, g->n_inputs,
				     g->n_outputs, NULL, NULL, &t);
	if (st == EPJ_OK)
		st = ej_jit_compile(ctx, jit, t, &g->fn); /* owns t */
	for (int i = 0; i < g->n_inputs; i++)
		epj_tensor_free(meta[i]);
	free(meta);
	return st;
}

epj_status epj_graph_compile(epj_ctx *ctx, epj_compiler *c, epj_graph *g)
{
	epj_status st = check_open(ctx, g, "compile");
	if (st != EPJ_OK)
		return st;
	if (g->n_outputs == 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"graph: compile: the graph has no output");
	bool prev = epj_no_grad_enter(ctx);
	st = trace_and_compile(ctx, c->jit, g);
	epj_no_grad_exit(ctx, prev);
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "graph: compile");
		g->fn = NULL;
	}
	return st;
}

epj_status epj_graph_run(epj_ctx *ctx, epj_graph *g, epj_tensor *const *in,
			 int n_in, epj_tensor **out, int n_out)
{
	for (int j = 0; j < n_out; j++)
		out[j] = NULL;
	if (!g->fn)
		return ej_error(ctx, EPJ_ERR_STATE,
				"graph: run before epj_graph_compile");
	if (n_in != g->n_inputs || n_out != g->n_outputs)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"graph: run with %d inputs / %d outputs, the "
				"graph has %d / %d",
				n_in, n_out, g->n_inputs, g->n_outputs);
	for (int i = 0; i < n_in; i++)
		if (!in[i] || !in[i]->storage)
			return ej_error(ctx, EPJ_ERR_INVALID,
					"graph: run: input %d has no data", i);
	bool prev = epj_no_grad_enter(ctx);
	epj_status st = EPJ_OK;
	if (!ej_region_fn_guard_ok(g->fn, ctx, in, n_in, NULL, 0)) {
		char why[256];
		ej_region_fn_guard_explain(g->fn, ctx, in, n_in, NULL, 0, why,
					   sizeof why);
		st = ej_error(ctx, EPJ_ERR_SHAPE,
			      "graph: run: the inputs differ from the "
			      "compiled ones: %s",
			      why);
	}
	if (st == EPJ_OK)
		st = ej_region_run(ctx, g->fn, in, n_in, NULL, 0, NULL, NULL,
				   out, n_out);
	epj_no_grad_exit(ctx, prev);
	return st;
}

epj_status epj_graph_run_data(epj_ctx *ctx, epj_graph *g, void *const *in_data,
			      int n_in, epj_tensor **out, int n_out,
			      int64_t *desc)
{
	for (int j = 0; j < n_out; j++)
		out[j] = NULL;
	if (n_in != g->n_inputs || (n_in > 0 && !in_data))
		return ej_error(
		    ctx, EPJ_ERR_INVALID,
		    "graph: run with %d inputs%s, the graph has %d", n_in,
		    n_in > 0 && !in_data ? " (no addresses)" : "", g->n_inputs);
	epj_tensor *stack[16] = { 0 };
	epj_tensor **in = n_in <= 16 ? stack : calloc((size_t)n_in, sizeof *in);
	if (!in)
		return ej_error(ctx, EPJ_ERR_NOMEM, "graph: out of memory");
	epj_status st = EPJ_OK;
	int made = 0;
	for (; made < n_in && st == EPJ_OK; made++) {
		const graph_input *d = &g->inputs[made];
		in[made] = epj_tensor_borrow(ctx, d->dtype, d->ndim, d->shape,
					     in_data[made]);
		if (!in[made]) {
			ej_error_prefix(ctx, "graph: run: input %d", made);
			st = epj_ctx_status(ctx);
		}
	}
	if (st == EPJ_OK)
		st = epj_graph_run(ctx, g, in, n_in, out, n_out);
	for (int j = 0; st == EPJ_OK && desc && j < n_out; j++) {
		int64_t *r = desc + (size_t)j * EPJ_GRAPH_DESC;
		const epj_tensor *t = out[j];
		memset(r, 0, sizeof(int64_t) * EPJ_GRAPH_DESC);
		r[0] = t->storage && t->storage->data
			   ? (int64_t)(intptr_t)ej_data(t)
			   : 0;
		r[1] = t->dtype;
		r[2] = t->ndim;
		r[3] = -1;
		for (int i = 0; i < n_in && r[3] < 0; i++)
			if (t->storage && t->storage == in[i]->storage)
				r[3] = i;
		for (int d = 0; d < t->ndim; d++) {
			r[4 + d] = t->shape[d];
			r[4 + EPJ_MAX_DIMS + d] = t->stride[d];
		}
	}
	for (int i = 0; i < made; i++)
		epj_tensor_free(in[i]);
	if (in != stack)
		free(in);
	return st;
}

epj_status epj_debug_dump(epj_ctx *ctx)
{
	const char *dir = ej_debug_dump_dir();
	return dir ? ej_debug_dump_counters(ctx, dir) : EPJ_OK;
}
