/* trace.c -- the recorder: TRACE mode of a context.
 *
 * While a tracer is installed (ctx->recorder), every op call reaching
 * ej_dispatch is appended to the tracer's graph instead of running: the op's
 * infer function has already validated the call and computed the output
 * meta; the recorder creates symbolic output tensors (no storage, value_id
 * = IR value) that flow on through the traced code.
 *
 * Real tensors met as op inputs are external: parameters (the runtime's
 * resolver gives their slot; they are bound anew at every call) or constants
 * (captured by reference, e.g. RoPE tables built while recording was paused).
 *
 * The same recorder serves autodiff.c, which runs the op table's backward
 * formulas on symbolic tensors to extend a graph into its joint graph.
 */
#include "jit_impl.h"

typedef struct ext_entry {
	const epj_tensor *t;
	int value;
} ext_entry;

typedef struct tracer {
	ej_recorder rec; /* first: ctx->recorder points here */
	epj_ctx *ctx;
	ej_graph *g;
	ej_param_slot_fn param_slot;
	void *slot_user;
	ext_entry *ext;
	int n_ext, cap_ext;
	int calls;
	bool grad_mode;
} tracer;

static epj_status tracer_record(void *self, epj_ctx *ctx, int op,
				epj_tensor *const *in, int n_in,
				const ej_attrs *attrs, const ej_meta *meta,
				epj_tensor **outs, int n_out);

bool ej_tracing(const epj_ctx *ctx)
{
	return ctx->recorder != NULL;
}

static tracer *tracer_of(const epj_ctx *ctx)
{
	const ej_recorder *r = ctx->recorder;
	if (!r || r->record != tracer_record)
		return NULL;
	return (tracer *)r->self;
}

/* A new symbolic tensor for value v of the tracer's graph. */
static epj_tensor *symbolic(tracer *tr, int v)
{
	const ej_value *val = &tr->g->values[v];
	epj_tensor *t =
	    ej_tensor_meta(tr->ctx, val->dtype, val->ndim, val->shape);
	if (!t)
		return NULL;
	t->value_id = v;
	t->trace_owner = tr;
	t->requires_grad = val->requires_grad;
	return t;
}

static epj_status value_of(tracer *tr, epj_tensor *t, int *out)
{
	if (t->trace_owner == tr) {
		*out = t->value_id;
		return EPJ_OK;
	}
	/* a storage-less parameter (shape-only mode, warm-up) is bound by
	 * slot like any parameter; a storage-less constant has nothing to
	 * capture */
	if (!t->storage && (t->value_id >= 0 || !tr->param_slot ||
			    tr->param_slot(tr->slot_user, t) < 0)) {
		char d[64];
		return ej_error(tr->ctx, EPJ_ERR_COMPILE,
				"trace: tensor %s belongs to another trace or "
				"has no data",
				epj_tensor_describe(t, d, sizeof d));
	}
	for (int i = 0; i < tr->n_ext; i++) {
		if (tr->ext[i].t == t) {
			*out = tr->ext[i].value;
			return EPJ_OK;
		}
	}
	int slot = tr->param_slot ? tr->param_slot(tr->slot_user, t) : -1;
	int v;
	if (slot >= 0) {
		v = ej_graph_add_input(tr->g, EJ_IN_PARAM, slot, t->dtype,
				       t->ndim, t->shape);
	} else {
		v = ej_graph_add_input(tr->g, EJ_IN_CONST, -1, t->dtype,
				       t->ndim, t->shape);
		tr->g->inputs[tr->g->values[v].input].konst = epj_tensor_ref(t);
	}
	tr->g->values[v].requires_grad =
	    t->requires_grad && tr->ctx->grad_enabled;
	if (tr->n_ext == tr->cap_ext) {
		int nc = tr->cap_ext ? tr->cap_ext * 2 : 32;
		ext_entry *ne = realloc(tr->ext, sizeof *ne * (size_t)nc);
		if (!ne)
			return ej_error(tr->ctx, EPJ_ERR_NOMEM,
					"trace: out of memory");
		tr->ext = ne;
		tr->cap_ext = nc;
	}
	tr->ext[tr->n_ext].t = t;
	tr->ext[tr->n_ext].value = v;
	tr->n_ext++;
	*out = v;
	return EPJ_OK;
}

static epj_status tracer_record(void *self, epj_ctx *ctx, int op,
				epj_tensor *const *in, int n_in,
				const ej_attrs *attrs, const ej_meta *meta,
				epj_tensor **outs, int n_out)
{
	tracer *tr = self;
	int stack_ids[16];
	int *ids = n_in <= 16 ? stack_ids : malloc(sizeof *ids * (size_t)n_in);
	if (!ids)
		return ej_error(ctx, EPJ_ERR_NOMEM, "trace: out of memory");
	epj_status st = EPJ_OK;
	bool rg = false;
	for (int i = 0; i < n_in && st == EPJ_OK; i++) {
		st = value_of(tr, in[i], &ids[i]);
		if (st == EPJ_OK)
			rg |= tr->g->values[ids[i]].requires_grad;
	}
	if (st == EPJ_OK) {
		int node =
		    ej_graph_add_node(tr->g, op, attrs, ids, n_in, meta, n_out);
		const ej_op_info *info = &ej_ops[op];
		bool diff = info->backward && !(info->flags & EJ_OPF_NO_GRAD) &&
			    ctx->grad_enabled;
		for (int j = 0; j < n_out; j++) {
			int v = tr->g->nodes[node].out[j];
			tr->g->values[v].requires_grad =
			    rg && diff && epj_dtype_is_float(meta[j].dtype);
			outs[j] = symbolic(tr, v);
			if (!outs[j]) {
				st = ctx->status ? ctx->status : EPJ_ERR_NOMEM;
				break;
			}
			if (meta[j].is_view) {
				/* keep the view's layout so that later
				 * infers (reshape) decide as eagerly */
				for (int d = 0; d < meta[j].ndim; d++)
					outs[j]->stride[d] = meta[j].stride[d];
				outs[j]->offset = meta[j].offset;
			}
		}
		tr->calls++;
	}
	if (st != EPJ_OK)
		for (int j = 0; j < n_out; j++) {
			epj_tensor_free(outs[j]);
			outs[j] = NULL;
		}
	if (ids != stack_ids)
		free(ids);
	return st;
}

const void *ej_trace_pause(epj_ctx *ctx)
{
	const void *r = ctx->recorder;
	ctx->recorder = NULL;
	return r;
}

void ej_trace_resume(epj_ctx *ctx, const void *state)
{
	ctx->recorder = state;
}

epj_status ej_trace_break(epj_ctx *ctx, void *callee, const char *reason,
			  epj_tensor *const *in, int n_in, epj_tensor **out,
			  int n_out)
{
	tracer *tr = tracer_of(ctx);
	for (int j = 0; j < n_out; j++)
		out[j] = NULL;
	if (!tr)
		return ej_error(ctx, EPJ_ERR_STATE,
				"graph break outside of a trace");
	if (n_in < 1)
		return ej_error(ctx, EPJ_ERR_COMPILE,
				"graph break %s: needs an input", reason);
	int ids[16];
	if (n_in > 16)
		return ej_error(ctx, EPJ_ERR_COMPILE,
				"graph break %s: too many inputs", reason);
	for (int i = 0; i < n_in; i++) {
		epj_status st = value_of(tr, in[i], &ids[i]);
		if (st != EPJ_OK)
			return st;
	}
	ej_meta m[16];
	if (n_out > 16)
		return ej_error(ctx, EPJ_ERR_COMPILE,
				"graph break %s: too many outputs", reason);
	const ej_value *v0 = &tr->g->values[ids[0]];
	for (int j = 0; j < n_out; j++) {
		memset(&m[j], 0, sizeof m[j]);
		m[j].dtype = v0->dtype;
		m[j].ndim = v0->ndim;
		memcpy(m[j].shape, v0->shape, sizeof v0->shape);
	}
	int node =
	    ej_graph_add_node(tr->g, EJ_IR_BREAK, NULL, ids, n_in, m, n_out);
	tr->g->nodes[node].callee = callee;
	tr->g->nodes[node].reason = ej_arena_strdup(tr->g->arena, reason);
	for (int j = 0; j < n_out; j++) {
		int v = tr->g->nodes[node].out[j];
		/* the eager callee owns trainable parameters (the experts and
		 * the router): its outputs need gradients in train mode */
		tr->g->values[v].requires_grad = tr->grad_mode;
		out[j] = symbolic(tr, v);
		if (!out[j]) {
			for (int k = 0; k < j; k++) {
				epj_tensor_free(out[k]);
				out[k] = NULL;
			}
			return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
		}
	}
	char cname[96];
	snprintf(cname, sizeof cname, "graph_break.%s", reason);
	epj_counter_add(ctx, cname, 1);
	return EPJ_OK;
}

void ej_trace_free(ej_trace *t)
{
	if (!t)
		return;
	ej_graph_free(t->g);
	free(t->in_meta);
	free(t->in_rg);
	free(t->param_dtype);
	free(t->param_rg);
	free(t);
}

/* Shared by autodiff.c: a tracer recording into an existing graph. */
void *ej_tracer_begin(epj_ctx *ctx, ej_graph *g);
epj_tensor *ej_tracer_symbolic(void *tr, int value);
void ej_tracer_end(epj_ctx *ctx, void *tr);

void *ej_tracer_begin(epj_ctx *ctx, ej_graph *g)
{
	tracer *tr = calloc(1, sizeof *tr);
	if (!tr)
		return NULL;
	tr->rec.self = tr;
	tr->rec.record = tracer_record;
	tr->ctx = ctx;
	tr->g = g;
	tr->grad_mode = true;
	ctx->recorder = &tr->rec;
	return tr;
}

epj_tensor *ej_tracer_symbolic(void *tr, int value)
{
	return symbolic(tr, value);
}

void ej_tracer_end(epj_ctx *ctx, void *p)
{
	tracer *tr = p;
	if (!tr)
		return;
	if (ctx->recorder == &tr->rec)
		ctx->recorder = NULL;
	free(tr->ext);
	free(tr);
}

epj_status ej_trace_region(epj_ctx *ctx, ej_jit *jit, ej_traced_fn fn,
			   void *fn_user, epj_tensor *const *in, int n_in,
			   int n_out, ej_param_slot_fn param_slot,
			   void *slot_user, ej_trace **out)
{
	(void)jit;
	*out = NULL;
	if (ctx->recorder)
		return ej_error(ctx, EPJ_ERR_STATE,
				"trace: nested tracing is not supported");
	ej_trace *t = calloc(1, sizeof *t);
	tracer *tr = calloc(1, sizeof *tr);
	epj_tensor **sym = calloc((size_t)n_in + 1, sizeof *sym);
	epj_tensor **res = calloc((size_t)n_out + 1, sizeof *res);
	epj_status st = EPJ_OK;
	if (!t || !tr || !sym || !res) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "trace: out of memory");
		goto done;
	}
	t->g = ej_graph_new("trace");
	t->n_in = n_in;
	t->grad_mode = ctx->grad_enabled;
	t->in_meta = calloc((size_t)n_in + 1, sizeof *t->in_meta);
	t->in_rg = calloc((size_t)n_in + 1, sizeof *t->in_rg);
	if (!t->in_meta || !t->in_rg) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "trace: out of memory");
		goto done;
	}
	tr->rec.self = tr;
	tr->rec.record = tracer_record;
	tr->ctx = ctx;
	tr->g = t->g;
	tr->param_slot = param_slot;
	tr->slot_user = slot_user;
	tr->grad_mode = ctx->grad_enabled;
	for (int i = 0; i < n_in; i++) {
		epj_tensor *x = in[i];
		int v = ej_graph_add_input(t->g, EJ_IN_ACT, i, x->dtype,
					   x->ndim, x->shape);
		t->g->values[v].requires_grad =
		    x->requires_grad && ctx->grad_enabled;
		t->in_meta[i].dtype = x->dtype;
		t->in_meta[i].ndim = x->ndim;
		memcpy(t->in_meta[i].shape, x->shape, sizeof x->shape);
		t->in_rg[i] = x->requires_grad;
		sym[i] = symbolic(tr, v);
		if (!sym[i]) {
			st = ctx->status ? ctx->status : EPJ_ERR_NOMEM;
			goto done;
		}
	}
	ctx->recorder = &tr->rec;
	st = fn(fn_user, ctx, sym, n_in, res, n_out);
	ctx->recorder = NULL;
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "while tracing");
		goto done;
	}
	for (int j = 0; j < n_out; j++) {
		int v;
		st = value_of(tr, res[j], &v);
		if (st != EPJ_OK)
			goto done;
		ej_graph_add_output(t->g, v);
	}
	/* parameter guards: dtype and requires_grad of every slot used */
	int max_slot = -1;
	for (int i = 0; i < t->g->n_inputs; i++)
		if (t->g->inputs[i].kind == EJ_IN_PARAM &&
		    t->g->inputs[i].slot > max_slot)
			max_slot = t->g->inputs[i].slot;
	t->n_params = max_slot + 1;
	t->param_dtype = calloc((size_t)t->n_params + 1, sizeof(epj_dtype));
	t->param_rg = calloc((size_t)t->n_params + 1, sizeof(bool));
	if (!t->param_dtype || !t->param_rg) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "trace: out of memory");
		goto done;
	}
	for (int i = 0; i < t->n_params; i++)
		t->param_dtype[i] = EPJ_DTYPE_COUNT; /* unused slot */
	for (int i = 0; i < t->g->n_inputs; i++) {
		ej_graph_input *gi = &t->g->inputs[i];
		if (gi->kind != EJ_IN_PARAM)
			continue;
		t->param_dtype[gi->slot] = t->g->values[gi->value].dtype;
		t->param_rg[gi->slot] = t->g->values[gi->value].requires_grad;
	}
	t->calls_captured = tr->calls;
	epj_counter_add(ctx, "stats.calls_captured", tr->calls);
done:
	ctx->recorder = NULL;
	for (int i = 0; sym && i < n_in; i++)
		epj_tensor_free(sym[i]);
	for (int j = 0; res && j < n_out; j++)
		epj_tensor_free(res[j]);
	free(sym);
	free(res);
	if (tr)
		free(tr->ext);
	free(tr);
	if (st != EPJ_OK) {
		ej_trace_free(t);
		return st;
	}
	*out = t;
	return EPJ_OK;
}
