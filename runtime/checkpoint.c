/* checkpoint.c -- activation checkpointing of one module call.
 *
 * Forward: run the module under no-grad, keep only detached aliases of its
 * inputs, and hang one custom autograd node on the outputs.  Backward: replay
 * the forward with grad enabled on fresh leaves that alias the saved inputs
 * (ctx->rt_replay_depth > 0 meanwhile, so the AutoEP layer counts the call as
 * a replay), backpropagate the incoming gradients through the recomputed
 * graph, and hand the leaves' gradients to the outer graph.  Parameters are
 * leaves of the recomputed graph, so they receive their gradients there, as
 * in PyTorch's reentrant torch.utils.checkpoint.
 */
#include "runtime_impl.h"

#include <string.h>

typedef struct ckpt {
	epj_module *m;
	int n_in, n_out;
	epj_tensor **saved; /* detached aliases of the inputs */
	char *name;
} ckpt;

static void ckpt_free(void *p)
{
	ckpt *c = p;
	if (!c)
		return;
	for (int i = 0; i < c->n_in; i++)
		epj_tensor_free(c->saved[i]);
	free(c->saved);
	free(c->name);
	free(c);
}

bool ej_in_replay(const epj_ctx *ctx)
{
	return ctx->rt_replay_depth > 0;
}

static epj_status ckpt_backward(epj_ctx *ctx, ej_node *n,
				epj_tensor *const *grad_out,
				epj_tensor **grad_in)
{
	ckpt *c = n->custom;
	epj_status st = EPJ_OK;
	epj_tensor **leaves = calloc((size_t)c->n_in + 1, sizeof *leaves);
	epj_tensor **outs = calloc((size_t)c->n_out + 1, sizeof *outs);
	epj_tensor *root = NULL, *root_grad = NULL;
	if (!leaves || !outs) {
		st = ej_error(ctx, EPJ_ERR_NOMEM,
			      "checkpoint replay: out of "
			      "memory");
		goto out;
	}
	for (int i = 0; i < c->n_in; i++) {
		leaves[i] = epj_detach(ctx, c->saved[i]);
		if (!leaves[i]) {
			st = ctx->status;
			goto out;
		}
		if (n->needs[i])
			epj_tensor_set_requires_grad(leaves[i], true);
	}
	bool prev = ctx->grad_enabled;
	ctx->grad_enabled = true;
	ctx->rt_replay_depth++;
	st = c->m->forward(ctx, c->m, leaves, c->n_in, outs, c->n_out);
	ctx->rt_replay_depth--;
	ctx->grad_enabled = prev;
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "checkpoint replay of \"%s\"", c->m->name);
		goto out;
	}
	/* One root: sum_j <out_j, grad_j> (only outputs that got a gradient
	 * and take part in the graph); for a single output the output itself
	 * with grad_out[0] as its gradient. */
	int live = 0, last = -1;
	for (int j = 0; j < c->n_out; j++)
		if (grad_out[j] && outs[j] && epj_tensor_requires_grad(outs[j]))
			live++, last = j;
	if (live == 1) {
		st = epj_backward(ctx, outs[last], grad_out[last]);
	} else if (live > 1) {
		ctx->grad_enabled = true;
		for (int j = 0; j < c->n_out && st == EPJ_OK; j++) {
			if (!grad_out[j] || !outs[j] ||
			    !epj_tensor_requires_grad(outs[j]))
				continue;
			epj_tensor *p = epj_mul(ctx, outs[j], grad_out[j]);
			epj_tensor *s = epj_sum_all(ctx, p);
			epj_tensor_free(p);
			if (!s) {
				st = ctx->status;
				break;
			}
			if (!root) {
				root = s;
			} else {
				epj_tensor *r2 = epj_add(ctx, root, s);
				epj_tensor_free(s);
				epj_tensor_free(root);
				root = r2;
				if (!root)
					st = ctx->status;
			}
		}
		ctx->grad_enabled = prev;
		if (st == EPJ_OK)
			st = epj_backward(ctx, root, NULL);
	}
	if (st != EPJ_OK)
		goto out;
	for (int i = 0; i < c->n_in; i++) {
		epj_tensor *g = n->needs[i] ? epj_tensor_grad(leaves[i]) : NULL;
		grad_in[i] = g ? epj_tensor_ref(g) : NULL;
	}
out:
	epj_tensor_free(root);
	epj_tensor_free(root_grad);
	for (int i = 0; leaves && i < c->n_in; i++)
		epj_tensor_free(leaves[i]);
	for (int j = 0; outs && j < c->n_out; j++)
		epj_tensor_free(outs[j]);
	free(leaves);
	free(outs);
	return st;
}

epj_status ej_checkpoint_call(epj_ctx *ctx, epj_module *m,
			      epj_tensor *const *in, int n_in, epj_tensor **out,
			      int n_out)
{
	bool prev = epj_no_grad_enter(ctx);
	epj_status st = m->forward(ctx, m, in, n_in, out, n_out);
	epj_no_grad_exit(ctx, prev);
	if (st != EPJ_OK)
		return st;
	ckpt *c = calloc(1, sizeof *c);
	if (!c)
		goto oom;
	c->m = m;
	c->n_in = n_in;
	c->n_out = n_out;
	c->saved = calloc((size_t)n_in + 1, sizeof *c->saved);
	size_t nl = strlen(m->name) + 16;
	c->name = malloc(nl);
	if (!c->saved || !c->name)
		goto oom;
	snprintf(c->name, nl, "checkpoint(%s)", m->name);
	for (int i = 0; i < n_in; i++) {
		c->saved[i] = epj_detach(ctx, in[i]);
		if (!c->saved[i])
			goto fail;
	}
	/* Outputs computed under no-grad carry no node yet; the checkpoint
	 * node makes them differentiable (parameters flow through replay). */
	ej_node *node = ej_node_custom(ctx, c->name, in, n_in, out, n_out,
				       ckpt_backward, c, ckpt_free);
	if (!node)
		goto fail;
	bool hung = false;
	for (int j = 0; j < n_out; j++)
		hung |= out[j] && out[j]->grad_fn == node;
	if (!hung)
		ej_node_unref(node); /* no float output: nothing to replay */
	return EPJ_OK;
oom:
	ej_error(ctx, EPJ_ERR_NOMEM, "checkpoint of \"%s\": out of memory",
		 m->name);
fail:
	ckpt_free(c);
	for (int j = 0; j < n_out; j++) {
		epj_tensor_free(out[j]);
		out[j] = NULL;
	}
	return ctx->status;
}
