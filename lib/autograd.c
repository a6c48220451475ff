/* autograd.c -- reverse-mode differentiation over the recorded graph.
 *
 * The "tape" is the graph of ej_node records hanging off tensors' grad_fn:
 * ej_dispatch records one node per differentiable op call (dispatch.c).
 * epj_backward(root) walks the nodes reachable from root, counts for each
 * node how many consumers will deliver a gradient, then runs nodes in a
 * dependency-respecting reverse order (Kahn's algorithm): a node runs once
 * all its consumers have run, with the sum of the gradients they delivered.
 * Each node's backward formula is made of ops (the op table's rows), run in
 * no-grad mode.  Saved tensors are released right after a node has run, so a
 * second backward through the same graph is an error, as in PyTorch.
 *
 * Leaves accumulate into .grad (contiguous, the leaf's dtype).  Non-leaf
 * tensors that called epj_tensor_retain_grad get their gradient too.
 */
#include "core_impl.h"

#include <string.h>

static void free_saved(ej_node *n)
{
	for (int i = 0; i < n->n_in; i++) {
		epj_tensor_free(n->saved_in[i]);
		n->saved_in[i] = NULL;
	}
	for (int j = 0; j < n->n_out; j++) {
		epj_tensor_free(n->saved_out[j]);
		n->saved_out[j] = NULL;
	}
	n->released = true;
}

void ej_node_unref(ej_node *n)
{
	/* Iterative release: a long chain of nodes must not recurse deeply. */
	ej_node *stack_buf[64];
	ej_node **stack = stack_buf;
	int cap = 64, top = 0;
	if (!n)
		return;
	stack[top++] = n;
	while (top > 0) {
		ej_node *x = stack[--top];
		if (--x->refcount > 0)
			continue;
		if (x->saved_in)
			for (int i = 0; i < x->n_in; i++)
				epj_tensor_free(x->saved_in[i]);
		if (x->saved_out)
			for (int j = 0; j < x->n_out; j++)
				epj_tensor_free(x->saved_out[j]);
		for (int i = 0; x->leaf && i < x->n_in; i++)
			epj_tensor_free(x->leaf[i]);
		for (int i = 0; x->next && i < x->n_in; i++) {
			if (!x->next[i])
				continue;
			if (top == cap) {
				int ncap = cap * 2;
				ej_node **ns =
				    malloc(sizeof *ns * (size_t)ncap);
				EJ_ASSERT(ns);
				memcpy(ns, stack, sizeof *ns * (size_t)top);
				if (stack != stack_buf)
					free(stack);
				stack = ns;
				cap = ncap;
			}
			stack[top++] = x->next[i];
		}
		if (x->custom_free)
			x->custom_free(x->custom);
		free(x->saved_in);
		free(x->saved_out);
		free(x->in_meta);
		free(x->next);
		free(x->next_nr);
		free(x->leaf);
		free(x->needs);
		free(x->retain);
		free(x);
	}
	if (stack != stack_buf)
		free(stack);
}

void ej_node_forget_retained(ej_node *n, int output_nr)
{
	if (n && n->retain && output_nr < n->n_out &&
	    n->retain[output_nr] != NULL)
		n->retain[output_nr] = NULL;
}

void epj_tensor_retain_grad(epj_tensor *t)
{
	if (!t || !t->requires_grad || !t->grad_fn)
		return; /* leaves always keep their gradient */
	t->retains_grad = true;
	t->grad_fn->retain[t->output_nr] = t;
}

ej_node *ej_node_custom(epj_ctx *ctx, const char *name, epj_tensor *const *in,
			int n_in, epj_tensor *const *out, int n_out,
			epj_status (*bw)(epj_ctx *, ej_node *,
					 epj_tensor *const *, epj_tensor **),
			void *custom, void (*custom_free)(void *))
{
	ej_node *n = calloc(1, sizeof *n);
	if (!n)
		goto oom;
	n->op = -1;
	n->n_in = n_in;
	n->n_out = n_out;
	n->name = name;
	n->bw_slot = -1;
	n->custom_backward = bw;
	n->custom = custom;
	n->custom_free = custom_free;
	n->saved_in = calloc((size_t)n_in + 1, sizeof *n->saved_in);
	n->saved_out = calloc((size_t)n_out + 1, sizeof *n->saved_out);
	n->in_meta = calloc((size_t)n_in + 1, sizeof *n->in_meta);
	n->next = calloc((size_t)n_in + 1, sizeof *n->next);
	n->next_nr = calloc((size_t)n_in + 1, sizeof *n->next_nr);
	n->leaf = calloc((size_t)n_in + 1, sizeof *n->leaf);
	n->needs = calloc((size_t)n_in + 1, sizeof *n->needs);
	n->retain = calloc((size_t)n_out + 1, sizeof *n->retain);
	if (!n->saved_in || !n->saved_out || !n->in_meta || !n->next ||
	    !n->next_nr || !n->leaf || !n->needs || !n->retain) {
		n->refcount = 1;
		n->custom_free = NULL; /* caller still owns custom on failure */
		ej_node_unref(n);
		goto oom;
	}
	for (int i = 0; i < n_in; i++) {
		epj_tensor *t = in[i];
		if (!t)
			continue;
		n->in_meta[i].dtype = t->dtype;
		n->in_meta[i].ndim = t->ndim;
		memcpy(n->in_meta[i].shape, t->shape, sizeof t->shape);
		if (!t->requires_grad)
			continue;
		n->needs[i] = true;
		if (t->grad_fn) {
			n->next[i] = t->grad_fn;
			t->grad_fn->refcount++;
			n->next_nr[i] = t->output_nr;
		} else {
			n->leaf[i] = epj_tensor_ref(t);
		}
	}
	for (int j = 0; j < n_out; j++) {
		epj_tensor *t = out[j];
		if (!t || !epj_dtype_is_float(t->dtype))
			continue;
		if (t->grad_fn)
			ej_node_unref(t->grad_fn);
		t->requires_grad = true;
		t->grad_fn = n;
		t->output_nr = j;
		n->refcount++;
	}
	if (n->refcount == 0)
		n->refcount = 1; /* caller owns it (no float output) */
	return n;
oom:
	ej_error(ctx, EPJ_ERR_NOMEM, "%s: out of memory creating autograd node",
		 name);
	return NULL;
}

/* ---- backward
 * ----------------------------------------------------------------- */

typedef struct bw_slot {
	ej_node *node;
	epj_tensor **grad; /* n_out accumulated gradients (owned) */
	ej_node *reads;	   /* the exchange whose gradient it got in flight */
} bw_slot;

typedef struct bw_run {
	bw_slot *slots;
	int n, cap;
	ej_node *inflight; /* the exchange whose gradient is in flight */
} bw_run;

/* Waits for the exchange in flight, if any (its readers may run). */
static epj_status finish_inflight(epj_ctx *ctx, bw_run *r)
{
	ej_node *n = r->inflight;
	if (!n)
		return EPJ_OK;
	r->inflight = NULL;
	epj_status st = n->bw_in_flight ? n->custom_finish(ctx, n) : EPJ_OK;
	n->bw_in_flight = false;
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "backward of %s", n->name);
	return st;
}

static int run_add_slot(bw_run *r, ej_node *n)
{
	if (r->n == r->cap) {
		int ncap = r->cap ? r->cap * 2 : 64;
		bw_slot *ns = realloc(r->slots, sizeof *ns * (size_t)ncap);
		if (!ns)
			return -1;
		r->slots = ns;
		r->cap = ncap;
	}
	r->slots[r->n].node = n;
	r->slots[r->n].reads = NULL;
	r->slots[r->n].grad =
	    calloc((size_t)n->n_out + 1, sizeof(epj_tensor *));
	if (!r->slots[r->n].grad)
		return -1;
	n->bw_slot = r->n;
	n->bw_pending = 0;
	return r->n++;
}

/* Adds g into *acc (takes no ownership of g). */
static epj_status accumulate(epj_ctx *ctx, epj_tensor **acc, epj_tensor *g)
{
	if (!*acc) {
		*acc = epj_tensor_ref(g);
		return EPJ_OK;
	}
	epj_tensor *sum = epj_add(ctx, *acc, g);
	if (!sum)
		return ctx->status;
	epj_tensor_free(*acc);
	*acc = sum;
	return EPJ_OK;
}

static bool same_shape(const ej_meta *m, const epj_tensor *t)
{
	if (m->ndim != t->ndim)
		return false;
	for (int i = 0; i < m->ndim; i++)
		if (m->shape[i] != t->shape[i])
			return false;
	return true;
}

/* True when g can become a leaf's .grad as it is: the one reference to it
 * is the caller's (a backward formula's fresh result, which nothing else
 * holds), it is dense from element 0 of a storage nobody else shares, and
 * it has the leaf's dtype. */
static bool adoptable(const epj_tensor *g, const epj_tensor *leaf)
{
	return g->refcount == 1 && g->dtype == leaf->dtype && g->storage &&
	       g->storage->refcount == 1 && !g->storage->param &&
	       g->offset == 0 && !g->requires_grad && !g->grad_fn &&
	       ej_is_contiguous(g) &&
	       g->storage->bytes == (size_t)ej_numel(g->ndim, g->shape) *
					ej_dtype_size(g->dtype);
}

/* leaf.grad += g.  The first gradient becomes leaf.grad without a copy
 * when `own` says the caller's reference is the only one and adoptable()
 * holds (a backward formula's output); else it is copied into a buffer of
 * the leaf's own (g may be a view of a saved tensor, a stride-0 expand,
 * the user's tensor, or handed to several inputs). */
static epj_status accumulate_leaf(epj_ctx *ctx, epj_tensor *leaf, epj_tensor *g,
				  bool own)
{
	if (!leaf->grad && own && adoptable(g, leaf)) {
		leaf->grad = epj_tensor_ref(g);
		epj_counter_add(ctx, "autograd.grads_adopted", 1);
		return EPJ_OK;
	}
	epj_tensor *gc = g;
	if (g->dtype != leaf->dtype) {
		gc = epj_cast(ctx, g, leaf->dtype);
		if (!gc)
			return ctx->status;
	} else {
		epj_tensor_ref(gc);
	}
	epj_status st = EPJ_OK;
	if (!leaf->grad) {
		/* Own a contiguous buffer: g may be a view of a saved tensor
		 * or a broadcast (stride 0) expand. */
		epj_tensor *own =
		    ej_tensor_alloc(ctx, gc->dtype, gc->ndim, gc->shape, false);
		if (!own)
			st = ctx->status;
		else if ((st = epj_tensor_copy_(ctx, own, gc)) == EPJ_OK) {
			leaf->grad = own;
			epj_counter_add(
			    ctx, "autograd.grad_copy_bytes",
			    (int64_t)(ej_numel(own->ndim, own->shape) *
				      ej_dtype_size(own->dtype)));
		} else
			epj_tensor_free(own);
	} else {
		epj_tensor *sum = epj_add(ctx, leaf->grad, gc);
		if (!sum) {
			st = ctx->status;
		} else {
			epj_tensor_free(leaf->grad);
			leaf->grad = sum;
		}
	}
	epj_tensor_free(gc);
	return st;
}

/* Collects the nodes reachable from root and counts consumers. */
static epj_status collect(epj_ctx *ctx, bw_run *r, ej_node *root)
{
	int cap = 256, top = 0;
	ej_node **stack = malloc(sizeof *stack * (size_t)cap);
	if (!stack || run_add_slot(r, root) < 0) {
		free(stack);
		return ej_error(ctx, EPJ_ERR_NOMEM, "backward: out of memory");
	}
	stack[top++] = root;
	while (top > 0) {
		ej_node *x = stack[--top];
		for (int i = 0; i < x->n_in; i++) {
			ej_node *y = x->next[i];
			if (!y)
				continue;
			if (y->bw_slot < 0) {
				if (run_add_slot(r, y) < 0)
					goto oom;
				if (top == cap) {
					cap *= 2;
					ej_node **ns = realloc(
					    stack, sizeof *ns * (size_t)cap);
					if (!ns)
						goto oom;
					stack = ns;
				}
				stack[top++] = y;
			}
			y->bw_pending++;
		}
	}
	free(stack);
	return EPJ_OK;
oom:
	free(stack);
	return ej_error(ctx, EPJ_ERR_NOMEM, "backward: out of memory");
}

/* The position in ready[] of the node to run next: the last one readied
 * (depth first, which frees gradients soonest), passing over the nodes
 * that read the gradient in flight while another node is ready, so that
 * independent work runs while the exchange travels. */
static int pick_ready(const bw_run *r, const int *ready, int n_ready)
{
	if (!r->inflight)
		return n_ready - 1;
	for (int k = n_ready - 1; k >= 0; k--)
		if (r->slots[ready[k]].reads != r->inflight)
			return k;
	return n_ready - 1;
}

/* Runs one node's backward formula; delivers gradients to its inputs. */
static epj_status run_node(epj_ctx *ctx, bw_run *r, ej_node *n, int *ready,
			   int *n_ready)
{
	bw_slot *slot = &r->slots[n->bw_slot];
	if (n->released)
		return ej_error(
		    ctx, EPJ_ERR_STATE,
		    "backward: the graph through \"%s\" was already "
		    "used by an earlier backward (its saved tensors "
		    "are freed)",
		    n->name);
	epj_tensor **grad_in = calloc((size_t)n->n_in + 1, sizeof *grad_in);
	epj_tensor **meta_in = calloc((size_t)n->n_in + 1, sizeof *meta_in);
	epj_tensor **meta_out = calloc((size_t)n->n_out + 1, sizeof *meta_out);
	epj_status st = EPJ_OK;
	if (!grad_in || !meta_in || !meta_out) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "backward: out of memory");
		goto out;
	}
	/* Retained gradients of non-leaf outputs. */
	for (int j = 0; j < n->n_out; j++) {
		epj_tensor *t = n->retain[j];
		if (t && slot->grad[j]) {
			epj_tensor_free(t->grad);
			t->grad = epj_tensor_ref(slot->grad[j]);
		}
	}
	bool any_grad = false;
	for (int j = 0; j < n->n_out; j++)
		any_grad |= slot->grad[j] != NULL;
	/* the exchange in flight ends before a node that reads its
	 * gradient, another exchange, or a custom node that may
	 * communicate */
	if (r->inflight && (slot->reads == r->inflight ||
			    (n->custom_backward && !n->bw_comm_free))) {
		st = finish_inflight(ctx, r);
		if (st != EPJ_OK)
			goto out;
	}
	if (!any_grad) {
		/* no gradient reached this node: nothing to compute */
	} else if (n->custom_backward) {
		n->bw_defer = n->custom_finish != NULL;
		st = n->custom_backward(ctx, n, slot->grad, grad_in);
		n->bw_defer = false;
		if (n->bw_in_flight)
			r->inflight = n;
	} else {
		const ej_op_info *info = &ej_ops[n->op];
		epj_tensor **ins = meta_in, **outs = meta_out;
		for (int i = 0; i < n->n_in; i++) {
			if (n->saved_in[i]) {
				ins[i] = epj_tensor_ref(n->saved_in[i]);
			} else {
				ins[i] = ej_tensor_meta(
				    ctx, n->in_meta[i].dtype,
				    n->in_meta[i].ndim, n->in_meta[i].shape);
				if (!ins[i]) {
					st = ctx->status;
					goto out;
				}
			}
		}
		for (int j = 0; j < n->n_out; j++) {
			if (n->saved_out[j]) {
				outs[j] = epj_tensor_ref(n->saved_out[j]);
			} else {
				/* shape of the gradient stands in for the
				 * output's meta when it is not saved */
				epj_tensor *g = slot->grad[j];
				outs[j] = g ? ej_tensor_meta(ctx, g->dtype,
							     g->ndim, g->shape)
					    : NULL;
			}
		}
		ej_call c = { .op = n->op,
			      .attrs = &n->attrs,
			      .in = ins,
			      .n_in = n->n_in,
			      .out = outs,
			      .n_out = n->n_out };
		st = info->backward(ctx, &c, slot->grad, n->needs, grad_in);
	}
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "backward of %s", n->name);
		goto out;
	}
	for (int i = 0; i < n->n_in; i++) {
		epj_tensor *g = grad_in[i];
		if (n->next[i] && (!n->needs[i] || !g)) {
			/* nothing flows, but the producer must still learn
			 * that this consumer is done */
			ej_node *y = n->next[i];
			if (--y->bw_pending == 0)
				ready[(*n_ready)++] = y->bw_slot;
			continue;
		}
		if (!n->needs[i] || !g)
			continue;
		if (!same_shape(&n->in_meta[i], g)) {
			char a[96], b[96];
			st = ej_error(
			    ctx, EPJ_ERR_SHAPE,
			    "backward of %s: gradient %s for input %d does not "
			    "match the input shape %s",
			    n->name,
			    ej_shape_str(g->ndim, g->shape, a, sizeof a), i,
			    ej_shape_str(n->in_meta[i].ndim,
					 n->in_meta[i].shape, b, sizeof b));
			goto out;
		}
		/* a gradient in flight may be stored, not read: adding it
		 * to another (or to a leaf's .grad), or another to it, waits
		 * for it first */
		if (r->inflight &&
		    (n->leaf[i]
			 ? r->inflight == n
			 : r->slots[n->next[i]->bw_slot].grad[n->next_nr[i]] &&
			       (r->inflight == n ||
				r->slots[n->next[i]->bw_slot].reads ==
				    r->inflight))) {
			st = finish_inflight(ctx, r);
			if (st != EPJ_OK)
				goto out;
		}
		if (n->leaf[i]) {
			/* grad_in[i] is the formula's reference; the same
			 * tensor may be another input's gradient too */
			bool own = true;
			for (int j = 0; j < n->n_in; j++)
				own &= j == i || grad_in[j] != g;
			st = accumulate_leaf(ctx, n->leaf[i], g, own);
		} else if (n->next[i]) {
			ej_node *y = n->next[i];
			st = accumulate(
			    ctx, &r->slots[y->bw_slot].grad[n->next_nr[i]], g);
			if (r->inflight == n)
				r->slots[y->bw_slot].reads = n;
			if (st == EPJ_OK && --y->bw_pending == 0)
				ready[(*n_ready)++] = y->bw_slot;
		}
		if (st != EPJ_OK)
			goto out;
	}
	free_saved(n);
out:
	for (int i = 0; grad_in && i < n->n_in; i++)
		epj_tensor_free(grad_in[i]);
	for (int i = 0; meta_in && i < n->n_in; i++)
		epj_tensor_free(meta_in[i]);
	for (int j = 0; meta_out && j < n->n_out; j++)
		epj_tensor_free(meta_out[j]);
	free(grad_in);
	free(meta_in);
	free(meta_out);
	/* This node's incoming gradients are consumed. */
	for (int j = 0; j < n->n_out; j++) {
		epj_tensor_free(slot->grad[j]);
		slot->grad[j] = NULL;
	}
	return st;
}

epj_status epj_backward(epj_ctx *ctx, epj_tensor *root, epj_tensor *grad)
{
	if (!root)
		return ctx->status != EPJ_OK
			   ? ctx->status
			   : ej_error(ctx, EPJ_ERR_INVALID,
				      "backward: root tensor is NULL");
	if (ctx->recorder)
		return ej_error(ctx, EPJ_ERR_STATE,
				"backward: not available while tracing");
	if (!root->requires_grad)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"backward: tensor does not require grad (no "
				"input of the computation requires grad)");
	epj_tensor *g0 = grad;
	if (!g0) {
		if (ej_numel(root->ndim, root->shape) != 1) {
			char s[96];
			return ej_error(
			    ctx, EPJ_ERR_SHAPE,
			    "backward: grad can be omitted only for "
			    "a one-element root, got shape %s",
			    ej_shape_str(root->ndim, root->shape, s, sizeof s));
		}
		g0 = epj_full(ctx, root->dtype, root->ndim, root->shape, 1.0);
		if (!g0)
			return ctx->status;
	} else {
		bool ok = grad->ndim == root->ndim;
		for (int i = 0; ok && i < root->ndim; i++)
			ok = grad->shape[i] == root->shape[i];
		if (!ok) {
			char a[96], b[96];
			return ej_error(
			    ctx, EPJ_ERR_SHAPE,
			    "backward: grad shape %s does not match root %s",
			    ej_shape_str(grad->ndim, grad->shape, a, sizeof a),
			    ej_shape_str(root->ndim, root->shape, b, sizeof b));
		}
		epj_tensor_ref(g0);
	}

	bool prev = epj_no_grad_enter(ctx);
	epj_status st = EPJ_OK;
	if (!root->grad_fn) {
		st = accumulate_leaf(ctx, root, g0, false);
		goto done;
	}
	bw_run r = { 0 };
	st = collect(ctx, &r, root->grad_fn);
	int *ready = NULL, n_ready = 0;
	if (st == EPJ_OK) {
		ready = malloc(sizeof *ready * (size_t)(r.n + 1));
		if (!ready)
			st = ej_error(ctx, EPJ_ERR_NOMEM,
				      "backward: out of memory");
	}
	if (st == EPJ_OK) {
		bw_slot *rs = &r.slots[root->grad_fn->bw_slot];
		rs->grad[root->output_nr] = epj_tensor_ref(g0);
		if (root->grad_fn->bw_pending == 0)
			ready[n_ready++] = root->grad_fn->bw_slot;
		while (n_ready > 0 && st == EPJ_OK) {
			int k = pick_ready(&r, ready, n_ready);
			int s = ready[k];
			memmove(ready + k, ready + k + 1,
				sizeof *ready * (size_t)(n_ready - k - 1));
			n_ready--;
			st =
			    run_node(ctx, &r, r.slots[s].node, ready, &n_ready);
		}
	}
	/* an exchange still in flight (the last node, or an error) */
	if (r.inflight) {
		epj_status fs = finish_inflight(ctx, &r);
		st = st == EPJ_OK ? fs : st;
	}
	for (int s = 0; s < r.n; s++) {
		ej_node *n = r.slots[s].node;
		for (int j = 0; j < n->n_out; j++)
			epj_tensor_free(r.slots[s].grad[j]);
		free(r.slots[s].grad);
		n->bw_slot = -1;
		n->bw_pending = 0;
	}
	free(r.slots);
	free(ready);
done:
	epj_tensor_free(g0);
	epj_no_grad_exit(ctx, prev);
	return st;
}
