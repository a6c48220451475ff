/* sched_run.c -- running a schedule (sched.c) with the interpreter's calling
 * convention, shared by the code-generating backends (C, cuda-sim, nvrtc).
 *
 * A backend supplies only how one fused kernel runs (ej_sched_kernel_fn:
 * bind fresh outputs in env, launch); everything else is the same for all
 * of them: inputs bound in schedule order, extern nodes through the op
 * table (ej_run_node), each value freed after its last reader (the
 * liveness the backend computed at build with ej_sched_step_read), grad
 * disabled, every launch counted in kernels.launched.compiled, and on any
 * failure every output NULL.
 */
#include "kir.h"

int ej_sched_step_read(const void *u, int i, int j)
{
	const ej_schedule *s = u;
	const ej_step *st = &s->steps[i];
	if (st->k)
		return j < st->k->n_in ? st->k->in[j].value : -1;
	const ej_ir_node *n = &s->g->nodes[st->node];
	return j < n->n_in ? n->in[j] : -1;
}

epj_status ej_sched_run(epj_ctx *ctx, const ej_schedule *s, ej_graph *g,
			const int *last, epj_tensor *const *inputs,
			epj_tensor **outs, ej_sched_kernel_fn fn, void *user)
{
	epj_status st = EPJ_OK;
	epj_tensor **env = calloc((size_t)g->n_values + 1, sizeof *env);
	if (!env)
		return ej_error(ctx, EPJ_ERR_NOMEM, "%s: out of memory",
				g->name);
	for (int i = 0; i < g->n_inputs; i++)
		env[g->inputs[i].value] = epj_tensor_ref(inputs[i]);
	bool prev = epj_no_grad_enter(ctx);
	ej_prof gpf;
	ej_prof_begin(ctx, &gpf);
	int64_t *saved_ctr = ctx->ctr_eager_launches;
	ctx->ctr_eager_launches =
	    ej_counter_slot(ctx, "kernels.launched.compiled");
	for (int i = 0; i < s->n_steps && st == EPJ_OK; i++) {
		const ej_step *step = &s->steps[i];
		if (step->k) {
			ej_prof pf;
			ej_prof_begin(ctx, &pf);
			st = fn(ctx, user, step->k, env);
			ej_prof_end(ctx, &pf, "fused.%s.k%d", g->name,
				    step->k->id);
			if (st != EPJ_OK) {
				ej_error_prefix(ctx, "%s, kernel %d", g->name,
						step->k->id);
				break;
			}
			(*ctx->ctr_eager_launches)++;
			ej_release_reads(env, last, i, ej_sched_step_read, s);
			continue;
		}
		st = ej_run_node(ctx, g, step->node, env, last, i,
				 ej_sched_step_read, s);
	}
	ctx->ctr_eager_launches = saved_ctr;
	ej_prof_end(ctx, &gpf, "graph.%s", g->name);
	epj_no_grad_exit(ctx, prev);
	for (int i = 0; i < g->n_outputs; i++)
		outs[i] =
		    st == EPJ_OK ? epj_tensor_ref(env[g->outputs[i]]) : NULL;
	for (int v = 0; v < g->n_values; v++)
		epj_tensor_free(env[v]);
	free(env);
	return st;
}

epj_status ej_sched_run_kernel(epj_ctx *ctx, const ej_schedule *s, int kernel,
			       epj_tensor *const *in, epj_tensor **out,
			       ej_sched_kernel_fn fn, void *user)
{
	EJ_ASSERT(kernel >= 0 && kernel < s->n_kernels);
	const ej_kernel *k = s->kernels[kernel];
	const ej_graph *g = s->g;
	epj_tensor **env = calloc((size_t)g->n_values + 1, sizeof *env);
	if (!env)
		return ej_error(ctx, EPJ_ERR_NOMEM, "%s: out of memory",
				g->name);
	for (int i = 0; i < k->n_in; i++)
		env[k->in[i].value] = in[i];
	int64_t *saved_ctr = ctx->ctr_eager_launches;
	ctx->ctr_eager_launches =
	    ej_counter_slot(ctx, "kernels.launched.compiled");
	epj_status st = fn(ctx, user, k, env);
	if (st == EPJ_OK)
		(*ctx->ctr_eager_launches)++;
	ctx->ctr_eager_launches = saved_ctr;
	for (int o = 0; o < k->n_out; o++) {
		out[o] = st == EPJ_OK ? env[k->out[o].value] : NULL;
		if (st != EPJ_OK)
			epj_tensor_free(env[k->out[o].value]);
	}
	free(env);
	return st;
}
