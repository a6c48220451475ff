/* interp.c -- the interpreter backend: each IR node of a compiled graph is
 * executed by the op table's eager kernels (as torch.compile's "aot_eager"),
 * so the whole compile path runs and is testable before code generation.
 *
 * Runs with grad disabled (a compiled segment is one autograd node) and
 * counts every node executed as kernels.launched.compiled.  Values are
 * released after their last use, so peak memory follows the graph's
 * liveness rather than holding every intermediate.
 */
#include "jit_impl.h"

epj_status ej_interp_run(epj_ctx *ctx, ej_graph *g, epj_tensor *const *inputs,
			 epj_tensor **outs)
{
	epj_status st = EPJ_OK;
	epj_tensor **env = calloc((size_t)g->n_values + 1, sizeof *env);
	int *last = malloc(sizeof *last * (size_t)(g->n_values + 1));
	if (!env || !last) {
		free(env);
		free(last);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"interpreter: out of memory");
	}
	/* last use by a node; graph outputs live to the end */
	for (int v = 0; v < g->n_values; v++)
		last[v] = -1;
	for (int i = 0; i < g->n_nodes; i++) {
		if (g->nodes[i].dead)
			continue;
		for (int k = 0; k < g->nodes[i].n_in; k++)
			last[g->nodes[i].in[k]] = i;
	}
	for (int i = 0; i < g->n_outputs; i++)
		last[g->outputs[i]] = g->n_nodes;
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
		epj_tensor *ins[64], *res[16] = { 0 };
		for (int k = 0; k < n->n_in; k++) {
			ins[k] = env[n->in[k]];
			EJ_ASSERT(ins[k]);
		}
		st = ej_dispatch(ctx, n->op, ins, n->n_in, &n->attrs, res,
				 n->n_out);
		if (st != EPJ_OK) {
			ej_error_prefix(ctx, "%s, node %d", g->name, i);
			break;
		}
		for (int j = 0; j < n->n_out; j++)
			env[n->out[j]] = res[j];
		for (int k = 0; k < n->n_in; k++) {
			int v = n->in[k];
			if (last[v] == i) {
				epj_tensor_free(env[v]);
				env[v] = NULL;
			}
		}
		for (int j = 0; j < n->n_out; j++) {
			int v = n->out[j];
			if (last[v] < 0) { /* never used */
				epj_tensor_free(env[v]);
				env[v] = NULL;
			}
		}
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
