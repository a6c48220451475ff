/* interp.c -- the interpreter backend: each IR node of a compiled graph is
 * executed by the op table's eager kernels (as torch.compile's "aot_eager"),
 * so the whole compile path runs and is testable before code generation.
 *
 * Runs with grad disabled (a compiled segment is one autograd node) and
 * counts every node executed as kernels.launched.compiled.  Values are
 * released after their last use, so peak memory follows the graph's
 * liveness rather than holding every intermediate.  The liveness helpers
 * (ej_last_use, ej_release_*) serve the C backend's steps as well.
 */
#include "jit_impl.h"

#include "ops_impl.h"

int *ej_last_use(const ej_graph *g, int n_steps, ej_step_read_fn read,
		 const void *u)
{
	int *last = malloc(sizeof *last * (size_t)(g->n_values + 1));
	if (!last)
		return NULL;
	for (int v = 0; v < g->n_values; v++)
		last[v] = -1;
	for (int i = 0; i < n_steps; i++)
		for (int j = 0, v; (v = read(u, i, j)) >= 0; j++)
			last[v] = i;
	for (int i = 0; i < g->n_outputs; i++)
		last[g->outputs[i]] = n_steps;
	return last;
}

void ej_release_reads(epj_tensor **env, const int *last, int step,
		      ej_step_read_fn read, const void *u)
{
	for (int j = 0, v; (v = read(u, step, j)) >= 0; j++)
		if (last[v] == step) {
			epj_tensor_free(env[v]);
			env[v] = NULL;
		}
}

void ej_release_unused(epj_tensor **env, const int *last, const int *vals,
		       int n)
{
	for (int j = 0; j < n; j++)
		if (last[vals[j]] < 0) {
			epj_tensor_free(env[vals[j]]);
			env[vals[j]] = NULL;
		}
}

epj_status ej_run_node(epj_ctx *ctx, ej_graph *g, int node, epj_tensor **env,
		       const int *last, int step, ej_step_read_fn read,
		       const void *u)
{
	ej_ir_node *n = &g->nodes[node];
	epj_tensor *ins[64], *res[16] = { 0 };
	EJ_ASSERT(n->n_in <= 64 && n->n_out <= 16);
	for (int k = 0; k < n->n_in; k++) {
		ins[k] = env[n->in[k]];
		EJ_ASSERT(ins[k]);
	}
	epj_status st;
	int r = n->op == EJ_OP_GEMM_ADD ? n->in[2] : -1;
	if (r >= 0 && ctx->dev == &ej_device_cpu && !ctx->profile &&
	    last[r] == step && n->in[0] != r && n->in[1] != r &&
	    ej_gemm_add_can_reuse(ins[0], ins[1], ins[2])) {
		/* the residual dies here: accumulate into its buffer */
		st =
		    ej_gemm_add_inplace(ctx, &n->attrs, ins[0], ins[1], ins[2]);
		if (st == EPJ_OK) {
			res[0] = env[r];
			env[r] = NULL;
		}
	} else {
		st = ej_dispatch(ctx, n->op, ins, n->n_in, &n->attrs, res,
				 n->n_out);
	}
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "%s, node %d", g->name, node);
		return st;
	}
	for (int j = 0; j < n->n_out; j++)
		env[n->out[j]] = res[j];
	ej_release_reads(env, last, step, read, u);
	ej_release_unused(env, last, n->out, n->n_out);
	return EPJ_OK;
}

/* Steps of the interpreter: the graph's nodes (dead ones read nothing). */
static int node_read(const void *u, int step, int j)
{
	const ej_ir_node *n = &((const ej_graph *)u)->nodes[step];
	return !n->dead && j < n->n_in ? n->in[j] : -1;
}

static epj_status interp_run(epj_ctx *ctx, void *state, ej_graph *g,
			     epj_tensor *const *inputs, epj_tensor **outs)
{
	(void)state;
	return ej_interp_run(ctx, g, inputs, outs);
}

static bool interp_available(void)
{
	return true;
}

const ej_codegen_backend ej_backend_interp = {
	.name = "interpreter",
	.kind = EJ_BACKEND_INTERPRETER,
	.available = interp_available,
	.run = interp_run,
};

epj_status ej_interp_run(epj_ctx *ctx, ej_graph *g, epj_tensor *const *inputs,
			 epj_tensor **outs)
{
	epj_status st = EPJ_OK;
	epj_tensor **env = calloc((size_t)g->n_values + 1, sizeof *env);
	int *last = ej_last_use(g, g->n_nodes, node_read, g);
	if (!env || !last) {
		free(env);
		free(last);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"interpreter: out of memory");
	}
	for (int i = 0; i < g->n_inputs; i++)
		env[g->inputs[i].value] = epj_tensor_ref(inputs[i]);

	bool prev = epj_no_grad_enter(ctx);
	int64_t *saved_ctr = ctx->ctr_eager_launches;
	ctx->ctr_eager_launches =
	    ej_counter_slot(ctx, "kernels.launched.compiled");
	for (int i = 0; i < g->n_nodes && st == EPJ_OK; i++) {
		ej_ir_node *n = &g->nodes[i];
		if (n->dead)
			continue;
		EJ_ASSERT(n->op != EJ_IR_BREAK);
		st = ej_run_node(ctx, g, i, env, last, i, node_read, g);
	}
	ctx->ctr_eager_launches = saved_ctr;
	epj_no_grad_exit(ctx, prev);
	for (int i = 0; i < g->n_outputs; i++)
		outs[i] =
		    st == EPJ_OK ? epj_tensor_ref(env[g->outputs[i]]) : NULL;
	for (int v = 0; v < g->n_values; v++)
		epj_tensor_free(env[v]);
	free(env);
	free(last);
	return st;
}
