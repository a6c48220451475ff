/* dispatch.c -- the one entry through which every op runs.
 *
 *   ej_dispatch(ctx, op, inputs, attrs) =
 *       infer (validate, output meta)
 *       -> recorder installed?  hand the call to it (trace mode), done
 *       -> allocate outputs (or make views), run the kernel: the CPU
 *          reference kernel, or on a device that runs CUDA C the entry of
 *          its eager table (ej_eager_install; a missing entry falls back
 *          to the CPU kernel and is counted)
 *       -> grad mode and an input requires grad?  record an autograd node
 *
 * Also the shared helpers of the op families declared in ops_impl.h (error
 * messages with shapes, dtype/axis checks, broadcasting).
 */
#include "ops_impl.h"

#include <stdarg.h>
#include <time.h>

/* ---- attributes -----------------------------------------------------------
 */

void ej_attrs_push_i(ej_attrs *a, int64_t v)
{
	EJ_ASSERT(a->n_i < EJ_MAX_ATTR_INTS);
	a->i[a->n_i++] = v;
}

void ej_attrs_push_f(ej_attrs *a, double v)
{
	EJ_ASSERT(a->n_f < EJ_MAX_ATTR_FLOATS);
	a->f[a->n_f++] = v;
}

/* ---- op helpers --------------------------------------------------------- */

static void describe_inputs(const ej_call *c, char *buf, size_t n)
{
	size_t used = 0;
	buf[0] = 0;
	for (int i = 0; i < c->n_in && used + 1 < n; i++) {
		char t[96];
		if (c->in[i])
			epj_tensor_describe(c->in[i], t, sizeof t);
		else
			snprintf(t, sizeof t, "NULL");
		int w =
		    snprintf(buf + used, n - used, "%s%s", i ? ", " : "", t);
		if (w < 0)
			break;
		used += (size_t)w;
	}
}

epj_status ej_op_error(epj_ctx *ctx, const ej_call *c, epj_status s,
		       const char *fmt, ...)
{
	char msg[512], ins[384];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	describe_inputs(c, ins, sizeof ins);
	if (c->n_in > 0)
		return ej_error(ctx, s, "%s: %s (inputs: %s)",
				ej_ops[c->op].name, msg, ins);
	return ej_error(ctx, s, "%s: %s", ej_ops[c->op].name, msg);
}

epj_status ej_check_float(epj_ctx *ctx, const ej_call *c, int input)
{
	if (epj_dtype_is_float(c->in[input]->dtype))
		return EPJ_OK;
	return ej_op_error(ctx, c, EPJ_ERR_DTYPE,
			   "input %d must be a float tensor, got %s", input,
			   epj_dtype_name(c->in[input]->dtype));
}

epj_status ej_check_index_dtype(epj_ctx *ctx, const ej_call *c, int input)
{
	epj_dtype dt = c->in[input]->dtype;
	if (dt == EPJ_DTYPE_I32 || dt == EPJ_DTYPE_I64)
		return EPJ_OK;
	return ej_op_error(ctx, c, EPJ_ERR_DTYPE,
			   "index input %d must be i32 or i64, got %s", input,
			   epj_dtype_name(dt));
}

epj_status ej_check_same_dtype(epj_ctx *ctx, const ej_call *c, int a, int b)
{
	if (c->in[a]->dtype == c->in[b]->dtype)
		return EPJ_OK;
	return ej_op_error(ctx, c, EPJ_ERR_DTYPE,
			   "inputs %d and %d have different dtypes (%s vs %s)",
			   a, b, epj_dtype_name(c->in[a]->dtype),
			   epj_dtype_name(c->in[b]->dtype));
}

epj_status ej_check_axis(epj_ctx *ctx, const ej_call *c, int64_t axis, int ndim,
			 int *out_axis)
{
	int64_t ax = axis < 0 ? axis + ndim : axis;
	if (ax < 0 || ax >= (ndim > 0 ? ndim : 1) || (ndim == 0 && ax != 0))
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "axis %lld out of range for %d dims",
				   (long long)axis, ndim);
	*out_axis = (int)ax;
	return EPJ_OK;
}

epj_status ej_broadcast_more(epj_ctx *ctx, const ej_call *c, int b, int *ndim,
			     int64_t *shape)
{
	const epj_tensor *y = c->in[b];
	int nx = *ndim, n = nx > y->ndim ? nx : y->ndim;
	int64_t out[EPJ_MAX_DIMS];
	for (int i = 0; i < n; i++) {
		int ix = nx - n + i, iy = y->ndim - n + i;
		int64_t dx = ix >= 0 ? shape[ix] : 1;
		int64_t dy = iy >= 0 ? y->shape[iy] : 1;
		if (dx != dy && dx != 1 && dy != 1)
			return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
					   "shapes are not broadcastable "
					   "(dim %d: %lld vs %lld)",
					   i, (long long)dx, (long long)dy);
		out[i] = dx == 1 ? dy : dx;
	}
	memcpy(shape, out, sizeof(int64_t) * (size_t)n);
	*ndim = n;
	return EPJ_OK;
}

epj_status ej_broadcast_shape(epj_ctx *ctx, const ej_call *c, int a, int b,
			      int *ndim, int64_t *shape)
{
	const epj_tensor *x = c->in[a];
	*ndim = x->ndim;
	memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
	return ej_broadcast_more(ctx, c, b, ndim, shape);
}

void ej_broadcast_strides(const epj_tensor *t, int ndim, const int64_t *shape,
			  int64_t *stride)
{
	for (int i = 0; i < ndim; i++) {
		int it = t->ndim - ndim + i;
		if (it < 0 || (t->shape[it] == 1 && shape[i] != 1))
			stride[i] = 0;
		else
			stride[i] = t->stride[it];
	}
}

int64_t ej_index_at(const epj_tensor *idx, int64_t i)
{
	/* 1-D index tensors only; stride-aware. */
	EJ_ASSERT(idx->ndim <= 1);
	int64_t off = idx->ndim == 1 ? i * idx->stride[0] : 0;
	const char *p = (const char *)ej_data(idx);
	if (idx->dtype == EPJ_DTYPE_I64)
		return ((const int64_t *)p)[off];
	EJ_ASSERT(idx->dtype == EPJ_DTYPE_I32);
	return ((const int32_t *)p)[off];
}

bool ej_any_requires_grad(epj_tensor *const *in, int n)
{
	for (int i = 0; i < n; i++)
		if (in[i] && in[i]->requires_grad)
			return true;
	return false;
}

/* ---- autograd recording -----------------------------------------------------
 */

/* A detached alias: same storage and geometry, no autograd links. */
static epj_tensor *alias(epj_tensor *t)
{
	return ej_tensor_view(t, t->ndim, t->shape, t->stride, t->offset);
}

static epj_status record_node(epj_ctx *ctx, int op, epj_tensor *const *in,
			      int n_in, const ej_attrs *attrs,
			      epj_tensor **outs, int n_out)
{
	const ej_op_info *info = &ej_ops[op];
	ej_node *n = calloc(1, sizeof *n);
	if (!n)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"%s: out of memory "
				"recording autograd node",
				info->name);
	n->refcount = 0;
	n->op = op;
	n->attrs = attrs ? *attrs : ej_attrs_none();
	n->n_in = n_in;
	n->n_out = n_out;
	n->name = info->name;
	n->bw_slot = -1;
	n->saved_in = calloc((size_t)n_in + 1, sizeof *n->saved_in);
	n->saved_out = calloc((size_t)n_out, sizeof *n->saved_out);
	n->in_meta = calloc((size_t)n_in + 1, sizeof *n->in_meta);
	n->next = calloc((size_t)n_in + 1, sizeof *n->next);
	n->next_nr = calloc((size_t)n_in + 1, sizeof *n->next_nr);
	n->leaf = calloc((size_t)n_in + 1, sizeof *n->leaf);
	n->needs = calloc((size_t)n_in + 1, sizeof *n->needs);
	n->retain = calloc((size_t)n_out, sizeof *n->retain);
	if (!n->saved_in || !n->saved_out || !n->in_meta || !n->next ||
	    !n->next_nr || !n->leaf || !n->needs || !n->retain) {
		n->refcount = 1;
		ej_node_unref(n);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"%s: out of memory recording autograd node",
				info->name);
	}
	for (int i = 0; i < n_in; i++) {
		epj_tensor *t = in[i];
		ej_meta_from(&n->in_meta[i], t);
		if (!(info->flags & EJ_OPF_NO_SAVE_IN))
			n->saved_in[i] = alias(t);
		if (t->requires_grad) {
			n->needs[i] = true;
			if (t->grad_fn) {
				n->next[i] = t->grad_fn;
				n->next[i]->refcount++;
				n->next_nr[i] = t->output_nr;
			} else {
				n->leaf[i] = epj_tensor_ref(t);
			}
		}
	}
	for (int j = 0; j < n_out; j++) {
		if (info->flags & EJ_OPF_SAVE_OUT)
			n->saved_out[j] = alias(outs[j]);
		if (!epj_dtype_is_float(outs[j]->dtype))
			continue;
		outs[j]->requires_grad = true;
		outs[j]->grad_fn = n;
		outs[j]->output_nr = j;
		n->refcount++;
	}
	if (n->refcount == 0) { /* no float output: nothing to hang it on */
		n->refcount = 1;
		ej_node_unref(n);
	}
	return EPJ_OK;
}

/* ---- dispatch ---------------------------------------------------------------
 */

#define EJ_MAX_STACK_OUTS 8

static epj_status run_eager(epj_ctx *ctx, const ej_op_info *info, ej_call *c);

/* EPJIT_PROFILE: the kernel's wall time in microseconds, per op. */
static epj_status profiled_kernel(epj_ctx *ctx, const ej_op_info *info,
				  ej_call *c)
{
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	epj_status st = run_eager(ctx, info, c);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	if (!ctx->prof_us[c->op]) {
		char name[96];
		snprintf(name, sizeof name, "profile.%s.us", info->name);
		ctx->prof_us[c->op] = ej_counter_slot(ctx, name);
		snprintf(name, sizeof name, "profile.%s.calls", info->name);
		ctx->prof_calls[c->op] = ej_counter_slot(ctx, name);
	}
	*ctx->prof_us[c->op] += (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000 +
				(t1.tv_nsec - t0.tv_nsec) / 1000;
	(*ctx->prof_calls[c->op])++;
	return st;
}

/* ---- eager kernels of CUDA C devices ----------------------------------------
 * One installed table per device (cuda-sim, cuda): a handful of devices, a
 * fixed array.  Installation happens at library load or engine start,
 * before contexts run ops; the pointers are read without a lock. */

#define EJ_EAGER_DEVICES 4

static struct {
	const ej_device *dev;
	const ej_eager_fn *table;
} eager_tables[EJ_EAGER_DEVICES];

void ej_eager_install(const ej_device *dev, const ej_eager_fn *table)
{
	int free_slot = -1;
	for (int i = 0; i < EJ_EAGER_DEVICES; i++) {
		if (eager_tables[i].dev == dev) {
			eager_tables[i].table = table;
			return;
		}
		if (!eager_tables[i].dev && free_slot < 0)
			free_slot = i;
	}
	EJ_ASSERT(free_slot >= 0);
	eager_tables[free_slot].table = table;
	eager_tables[free_slot].dev = dev;
}

/* Tables installed by device name (the cuda device's vtable is made when
 * the process opens its GPU, after the table is installed). */
static struct {
	const char *name;
	const ej_eager_fn *table;
} eager_named[EJ_EAGER_DEVICES];

void ej_eager_install_name(const char *name, const ej_eager_fn *table)
{
	int free_slot = -1;
	for (int i = 0; i < EJ_EAGER_DEVICES; i++) {
		if (eager_named[i].name && !strcmp(eager_named[i].name, name)) {
			eager_named[i].table = table;
			return;
		}
		if (!eager_named[i].name && free_slot < 0)
			free_slot = i;
	}
	EJ_ASSERT(free_slot >= 0);
	eager_named[free_slot].table = table;
	eager_named[free_slot].name = name;
}

const ej_eager_fn *ej_eager_table(const ej_device *dev)
{
	for (int i = 0; i < EJ_EAGER_DEVICES; i++)
		if (eager_tables[i].dev == dev)
			return eager_tables[i].table;
	for (int i = 0; i < EJ_EAGER_DEVICES; i++)
		if (eager_named[i].name &&
		    !strcmp(eager_named[i].name, dev->name))
			return eager_named[i].table;
	return NULL;
}

static void count_fallback(epj_ctx *ctx, int op)
{
	if (!ctx->ctr_eager_fallback)
		ctx->ctr_eager_fallback =
		    ej_counter_slot(ctx, "kernels.eager_cpu_fallback");
	if (!ctx->ctr_fallback_op[op]) {
		char name[96];
		snprintf(name, sizeof name, "kernels.eager_cpu_fallback.%s",
			 ej_ops[op].name);
		ctx->ctr_fallback_op[op] = ej_counter_slot(ctx, name);
	}
	(*ctx->ctr_eager_fallback)++;
	(*ctx->ctr_fallback_op[op])++;
}

/* A host tensor with t's geometry over a host copy of t's storage (copy:
 * the device bytes are copied in; else uninitialised).  Made while ctx runs
 * on the host device. */
static epj_tensor *host_twin(epj_ctx *ctx, const ej_device *dev,
			     const epj_tensor *t, bool copy)
{
	epj_tensor *h = ej_tensor_meta(ctx, t->dtype, t->ndim, t->shape);
	if (!h)
		return NULL;
	for (int d = 0; d < t->ndim; d++)
		h->stride[d] = t->stride[d];
	h->offset = t->offset;
	if (!t->storage)
		return h;
	h->storage = ej_storage_new_uninit(ctx, t->storage->bytes);
	if (!h->storage) {
		epj_tensor_free(h);
		return NULL;
	}
	if (copy)
		dev->copy(dev->self, h->storage->data, t->storage->data,
			  t->storage->bytes);
	return h;
}

/* The CPU kernel of c on a device the host cannot address: inputs copied
 * to host buffers, the kernel run there (the context on the host device
 * meanwhile, so that its scratch tensors are host memory too), outputs
 * copied back. */
static epj_status fallback_on_host(epj_ctx *ctx, ej_call *c)
{
	const ej_device *dev = ctx->dev;
	ej_allocator *dalloc = ctx->alloc;
	if (!ctx->host_alloc &&
	    !(ctx->host_alloc = ej_allocator_new(&ej_device_cpu)))
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"%s: out of memory (host fallback)",
				ej_ops[c->op].name);
	int n = c->n_in + c->n_out;
	epj_tensor **h = calloc((size_t)n + 1, sizeof *h);
	if (!h)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"%s: out of memory (host fallback)",
				ej_ops[c->op].name);
	if (dev->sync)
		dev->sync(dev->self);
	ctx->dev = &ej_device_cpu;
	ctx->alloc = ctx->host_alloc;
	epj_status st = EPJ_OK;
	for (int i = 0; i < n && st == EPJ_OK; i++) {
		const epj_tensor *t =
		    i < c->n_in ? c->in[i] : c->out[i - c->n_in];
		h[i] = host_twin(ctx, dev, t, i < c->n_in);
		if (!h[i])
			st =
			    ctx->status != EPJ_OK ? ctx->status : EPJ_ERR_NOMEM;
	}
	if (st == EPJ_OK) {
		ej_call hc = *c;
		hc.in = h;
		hc.out = h + c->n_in;
		st = ej_ops[c->op].cpu_kernel(ctx, &hc);
	}
	ctx->dev = dev;
	ctx->alloc = dalloc;
	for (int j = 0; st == EPJ_OK && j < c->n_out; j++) {
		const epj_tensor *o = c->out[j];
		if (!o->storage)
			continue;
		size_t at = (size_t)o->offset * ej_dtype_size(o->dtype);
		size_t bytes = (size_t)ej_numel(o->ndim, o->shape) *
			       ej_dtype_size(o->dtype);
		if (bytes)
			dev->copy(dev->self, (char *)o->storage->data + at,
				  (char *)h[c->n_in + j]->storage->data + at,
				  bytes);
	}
	for (int i = 0; i < n; i++)
		epj_tensor_free(h[i]);
	free(h);
	return st;
}

/* The CPU reference kernel of c on the context's device: in place where
 * the host addresses its memory, else through host copies. */
static epj_status cpu_kernel_on(epj_ctx *ctx, ej_call *c)
{
	if (ctx->dev->host_visible)
		return ej_ops[c->op].cpu_kernel(ctx, c);
	return fallback_on_host(ctx, c);
}

epj_status ej_eager_fallback(epj_ctx *ctx, ej_call *c)
{
	count_fallback(ctx, c->op);
	return cpu_kernel_on(ctx, c);
}

/* The op's kernel on the context's device: its eager CUDA entry where the
 * device has a table, else the CPU reference kernel. */
static epj_status run_eager(epj_ctx *ctx, const ej_op_info *info, ej_call *c)
{
	const ej_eager_fn *table = ej_eager_table(ctx->dev);
	if (!table && ctx->dev->host_visible)
		return info->cpu_kernel(ctx, c);
	if (!table) {
		count_fallback(ctx, c->op);
		return fallback_on_host(ctx, c);
	}
	if (!table[c->op]) {
		count_fallback(ctx, c->op);
		return cpu_kernel_on(ctx, c);
	}
	if (!ctx->ctr_eager_cuda)
		ctx->ctr_eager_cuda =
		    ej_counter_slot(ctx, "kernels.eager_cuda");
	if (!ctx->ctr_eager_fallback)
		ctx->ctr_eager_fallback =
		    ej_counter_slot(ctx, "kernels.eager_cpu_fallback");
	int64_t fb = *ctx->ctr_eager_fallback;
	epj_status st = table[c->op](ctx, c);
	if (st == EPJ_OK && *ctx->ctr_eager_fallback == fb)
		(*ctx->ctr_eager_cuda)++;
	return st;
}

epj_status ej_dispatch(epj_ctx *ctx, int op, epj_tensor *const *in, int n_in,
		       const ej_attrs *attrs, epj_tensor **outs, int n_out)
{
	EJ_ASSERT(op >= 0 && op < EJ_OP_COUNT);
	const ej_op_info *info = &ej_ops[op];
	ej_attrs none = ej_attrs_none();
	if (!attrs)
		attrs = &none;
	for (int j = 0; j < n_out; j++)
		outs[j] = NULL;
	for (int i = 0; i < n_in; i++) {
		if (!in[i]) {
			if (ctx->status == EPJ_OK)
				ej_error(ctx, EPJ_ERR_INVALID,
					 "%s: input %d is NULL", info->name, i);
			return ctx->status;
		}
	}
	bool var_in = info->flags & EJ_OPF_VARIADIC_IN;
	bool var_out = info->flags & EJ_OPF_VARIADIC_OUT;
	if ((var_in ? n_in < info->n_in : n_in != info->n_in) ||
	    (var_out ? n_out < info->n_out : n_out != info->n_out))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s: called with %d inputs / %d outputs, "
				"expects %s%d / %s%d",
				info->name, n_in, n_out, var_in ? ">= " : "",
				info->n_in, var_out ? ">= " : "", info->n_out);

	ej_meta meta_stack[EJ_MAX_STACK_OUTS];
	ej_meta *meta = meta_stack;
	if (n_out > EJ_MAX_STACK_OUTS) {
		meta = calloc((size_t)n_out, sizeof *meta);
		if (!meta)
			return ej_error(ctx, EPJ_ERR_NOMEM, "%s: out of memory",
					info->name);
	}
	memset(meta, 0, sizeof *meta * (size_t)n_out);
	ej_call c = { .op = op,
		      .attrs = attrs,
		      .in = in,
		      .n_in = n_in,
		      .out = NULL,
		      .n_out = n_out };
	epj_status st = info->infer(ctx, &c, meta);
	if (st != EPJ_OK)
		goto done;

	if (ctx->recorder) {
		st = ctx->recorder->record(ctx->recorder->self, ctx, op, in,
					   n_in, attrs, meta, outs, n_out);
		goto done;
	}

	bool run_kernel = false;
	for (int j = 0; j < n_out; j++) {
		if (meta[j].is_view) {
			outs[j] =
			    ej_tensor_view(in[0], meta[j].ndim, meta[j].shape,
					   meta[j].stride, meta[j].offset);
		} else {
			outs[j] =
			    ej_tensor_alloc(ctx, meta[j].dtype, meta[j].ndim,
					    meta[j].shape, false);
			run_kernel = true;
		}
		if (!outs[j]) {
			if (ctx->status == EPJ_OK)
				ej_error(ctx, EPJ_ERR_NOMEM,
					 "%s: cannot allocate output %d",
					 info->name, j);
			st = ctx->status;
			goto fail;
		}
	}
	if (run_kernel && !ctx->meta) { /* shape-only mode runs nothing */
		c.out = outs;
		if (ctx->profile) {
			st = profiled_kernel(ctx, info, &c);
		} else {
			st = run_eager(ctx, info, &c);
		}
		if (st != EPJ_OK)
			goto fail;
		(*ctx->ctr_eager_launches)++;
	}
	if (ctx->grad_enabled && info->backward &&
	    !(info->flags & EJ_OPF_NO_GRAD) && ej_any_requires_grad(in, n_in)) {
		st = record_node(ctx, op, in, n_in, attrs, outs, n_out);
		if (st != EPJ_OK)
			goto fail;
	}
	goto done;
fail:
	for (int j = 0; j < n_out; j++) {
		epj_tensor_free(outs[j]);
		outs[j] = NULL;
	}
done:
	if (meta != meta_stack)
		free(meta);
	return st;
}

epj_status ej_dispatch_into(epj_ctx *ctx, int op, epj_tensor *const *in,
			    int n_in, const ej_attrs *attrs, epj_tensor *out)
{
	EJ_ASSERT(op >= 0 && op < EJ_OP_COUNT);
	const ej_op_info *info = &ej_ops[op];
	EJ_ASSERT(!ctx->recorder && !ctx->meta && info->n_out == 1 &&
		  !(info->flags & EJ_OPF_VARIADIC_OUT));
	ej_attrs none = ej_attrs_none();
	ej_call c = { .op = op,
		      .attrs = attrs ? attrs : &none,
		      .in = in,
		      .n_in = n_in,
		      .out = &out,
		      .n_out = 1 };
	ej_meta m;
	memset(&m, 0, sizeof m);
	epj_status st = info->infer(ctx, &c, &m);
	if (st != EPJ_OK)
		return st;
	char want[96], have[96];
	if (m.is_view || m.dtype != out->dtype || m.ndim != out->ndim ||
	    memcmp(m.shape, out->shape, sizeof(int64_t) * (size_t)m.ndim) ||
	    !out->storage || !ej_is_contiguous(out))
		return ej_error(
		    ctx, EPJ_ERR_SHAPE,
		    "%s into a tensor: the result is %s %s, the "
		    "tensor %s (dense, with storage)",
		    info->name, epj_dtype_name(m.dtype),
		    ej_shape_str(m.ndim, m.shape, want, sizeof want),
		    epj_tensor_describe(out, have, sizeof have));
	ej_param_write(out->ctx, out);
	st = run_eager(ctx, info, &c);
	if (st == EPJ_OK)
		(*ctx->ctr_eager_launches)++;
	return st;
}

epj_tensor *ej_call1(epj_ctx *ctx, int op, epj_tensor *const *in, int n_in,
		     const ej_attrs *attrs)
{
	epj_tensor *out = NULL;
	if (ej_dispatch(ctx, op, in, n_in, attrs, &out, 1) != EPJ_OK)
		return NULL;
	return out;
}
