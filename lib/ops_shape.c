/* ops_shape.c -- shape and movement ops: reshape, transpose, permute, slice
 * (+ its backward), expand, contiguous, cat, full; and the public wrappers
 * epj_reshape ... epj_split, epj_zeros, epj_full.
 *
 * View ops (RESHAPE when the strides allow it, TRANSPOSE, PERMUTE, SLICE,
 * EXPAND) compute the view's geometry in their infer function: meta.is_view,
 * meta.stride and meta.offset (absolute, in elements of input 0's storage),
 * derived from the input's strides and offset.  Dispatch then makes a view
 * sharing the storage and never calls the kernel.  In trace mode the inputs
 * are symbolic tensors whose strides are contiguous, so the same infer code
 * runs unchanged.  The kernels of the view ops still exist: they materialise
 * the view's elements into a contiguous output (RESHAPE uses that when the
 * input cannot be viewed, e.g. a transposed matrix flattened).
 *
 * Every kernel here is a byte copy through strides (copy_strided): dims that
 * are jointly contiguous on both sides are coalesced first, so the dense case
 * is one memcpy and a row-strided case is a memcpy per row; rows are spread
 * over OpenMP threads when the copy is large.
 *
 * Backward formulas use public ops only (and SLICE_BACKWARD through
 * ej_call1), so they run eagerly and while tracing alike.  Input tensors of
 * every op here are meta-only in backward (EJ_OPF_NO_SAVE_IN): only their
 * shapes are read.
 */
#include "ops_impl.h"

/* Below this many elements a copy runs on one thread. */
#define PAR_MIN_ELEMS (1 << 16)

/* ---- helpers ----------------------------------------------------------- */

/* Sets an error naming the op and the wrapper's inputs, like ej_op_error,
 * for checks done in a public wrapper before dispatch.  Returns s. */
static epj_status wrap_error(epj_ctx *ctx, int op, epj_tensor *const *in,
			     int n_in, epj_status s, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

static epj_status wrap_error(epj_ctx *ctx, int op, epj_tensor *const *in,
			     int n_in, epj_status s, const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	ej_attrs none = ej_attrs_none();
	ej_call c = { .op = op, .attrs = &none, .in = in, .n_in = n_in };
	return ej_op_error(ctx, &c, s, "%s", msg);
}

/* Status to return from a status-returning wrapper given a NULL input: the
 * error already set by whoever produced the NULL, else a generic one. */
static epj_status null_status(epj_ctx *ctx)
{
	return ctx->status != EPJ_OK ? ctx->status : EPJ_ERR_INVALID;
}

static void copy_elems(char *d, int64_t ds, const char *s, int64_t ss,
		       int64_t n, size_t es)
{
	switch (es) {
	case 2:
		for (int64_t i = 0; i < n; i++)
			((uint16_t *)d)[i * ds] = ((const uint16_t *)s)[i * ss];
		break;
	case 4:
		for (int64_t i = 0; i < n; i++)
			((uint32_t *)d)[i * ds] = ((const uint32_t *)s)[i * ss];
		break;
	case 8:
		for (int64_t i = 0; i < n; i++)
			((uint64_t *)d)[i * ds] = ((const uint64_t *)s)[i * ss];
		break;
	default:
		for (int64_t i = 0; i < n; i++)
			memcpy(d + (size_t)(i * ds) * es,
			       s + (size_t)(i * ss) * es, es);
	}
}

/* Copies every element of the geometry (ndim, shape) from src (strides sst)
 * to dst (strides dst_st), es bytes each, in any order (the two never
 * overlap).  Strides are in elements and may be 0 on the source side. */
static void copy_strided(char *dst, const int64_t *dst_st, const char *src,
			 const int64_t *src_st, int ndim, const int64_t *shape,
			 size_t es)
{
	int64_t sh[EPJ_MAX_DIMS], ds[EPJ_MAX_DIMS], ss[EPJ_MAX_DIMS];
	int n = 0;
	int64_t numel = ej_numel(ndim, shape);
	if (numel == 0)
		return;
	/* Coalesce: drop size-1 dims; merge dim i into the previous kept one
	 * when both sides step over it exactly as one longer dim. */
	for (int i = 0; i < ndim; i++) {
		if (shape[i] == 1)
			continue;
		if (n > 0 && ds[n - 1] == dst_st[i] * shape[i] &&
		    ss[n - 1] == src_st[i] * shape[i]) {
			sh[n - 1] *= shape[i];
			ds[n - 1] = dst_st[i];
			ss[n - 1] = src_st[i];
		} else {
			sh[n] = shape[i];
			ds[n] = dst_st[i];
			ss[n] = src_st[i];
			n++;
		}
	}
	if (n == 0) {
		memcpy(dst, src, es);
		return;
	}
	const int64_t len = sh[n - 1], rows = numel / len;
	const int64_t dl = ds[n - 1], sl = ss[n - 1];
	const bool dense_rows = dl == 1 && sl == 1;
#pragma omp parallel for if (numel >= PAR_MIN_ELEMS && rows > 1)               \
    schedule(static)
	for (int64_t r = 0; r < rows; r++) {
		int64_t rem = r, doff = 0, soff = 0;
		for (int d = n - 2; d >= 0; d--) {
			int64_t k = rem % sh[d];
			rem /= sh[d];
			doff += k * ds[d];
			soff += k * ss[d];
		}
		char *dp = dst + (size_t)doff * es;
		const char *sp = src + (size_t)soff * es;
		if (dense_rows)
			memcpy(dp, sp, (size_t)len * es);
		else
			copy_elems(dp, dl, sp, sl, len, es);
	}
}

/* Copies the elements of t, seen with geometry (ndim, shape, stride, offset
 * absolute in t's storage), row-major into the contiguous tensor out. */
static void copy_view_into(epj_tensor *out, const epj_tensor *t, int ndim,
			   const int64_t *shape, const int64_t *stride,
			   int64_t offset)
{
	size_t es = ej_dtype_size(t->dtype);
	int64_t cst[EPJ_MAX_DIMS];
	ej_contiguous_strides(ndim, shape, cst);
	const char *src = (const char *)t->storage->data + (size_t)offset * es;
	copy_strided((char *)ej_data(out), cst, src, stride, ndim, shape, es);
}

/* Kernel of a view op asked to materialise: infer again for the view's
 * geometry and copy it (dispatch does not call it for views). */
static epj_status kernel_copy_view(epj_ctx *ctx, const ej_call *c,
				   ej_infer_fn infer)
{
	ej_meta m;
	epj_status st = infer(ctx, c, &m);
	if (st != EPJ_OK)
		return st;
	if (m.is_view)
		copy_view_into(c->out[0], c->in[0], m.ndim, m.shape, m.stride,
			       m.offset);
	else
		copy_view_into(c->out[0], c->in[0], c->in[0]->ndim,
			       c->in[0]->shape, c->in[0]->stride,
			       c->in[0]->offset);
	return EPJ_OK;
}

/* ---- RESHAPE ----------------------------------------------------------- */

/* Strides that view (ond, oshape, ostride) as shape (nnd, nshape) without a
 * copy, as torch.view computes them: every run of old dims that is merged or
 * split must be contiguous with respect to itself.  False when impossible. */
static bool view_strides(int ond, const int64_t *oshape, const int64_t *ostride,
			 int nnd, const int64_t *nshape, int64_t *nstride)
{
	if (ond == 0 || ej_numel(ond, oshape) == 0) {
		/* a scalar or an empty tensor views as anything */
		ej_contiguous_strides(nnd, nshape, nstride);
		return true;
	}
	int view_d = nnd - 1;
	int64_t chunk_base = ostride[ond - 1];
	int64_t tensor_numel = 1, view_numel = 1;
	for (int td = ond - 1; td >= 0; td--) {
		tensor_numel *= oshape[td];
		if (td == 0 || (oshape[td - 1] != 1 &&
				ostride[td - 1] != tensor_numel * chunk_base)) {
			while (view_d >= 0 && (view_numel < tensor_numel ||
					       nshape[view_d] == 1)) {
				nstride[view_d] = view_numel * chunk_base;
				view_numel *= nshape[view_d];
				view_d--;
			}
			if (view_numel != tensor_numel)
				return false;
			if (td > 0) {
				chunk_base = ostride[td - 1];
				tensor_numel = 1;
				view_numel = 1;
			}
		}
	}
	return view_d == -1;
}

epj_status ej_infer_RESHAPE(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0];
	const ej_attrs *at = c->attrs;
	char buf[160];
	if (at->n_i > EPJ_MAX_DIMS)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "target has %d dims (at most %d)", at->n_i,
				   EPJ_MAX_DIMS);
	for (int i = 0; i < at->n_i; i++)
		if (at->i[i] < 0)
			return ej_op_error(
			    ctx, c, EPJ_ERR_SHAPE,
			    "negative dimension in target shape %s",
			    ej_shape_str(at->n_i, at->i, buf, sizeof buf));
	int64_t n_new = ej_numel(at->n_i, at->i);
	int64_t n_old = ej_numel(a->ndim, a->shape);
	if (n_new != n_old)
		return ej_op_error(
		    ctx, c, EPJ_ERR_SHAPE,
		    "cannot reshape %lld elements to shape %s (%lld elements)",
		    (long long)n_old,
		    ej_shape_str(at->n_i, at->i, buf, sizeof buf),
		    (long long)n_new);
	ej_meta_set(out, a->dtype, at->n_i, at->i);
	if (view_strides(a->ndim, a->shape, a->stride, at->n_i, at->i,
			 out->stride)) {
		out->is_view = true;
		out->offset = a->offset;
	}
	return EPJ_OK;
}

epj_status ej_kernel_RESHAPE(epj_ctx *ctx, const ej_call *c)
{
	/* not viewable: row-major order of the input is the output's */
	const epj_tensor *a = c->in[0];
	copy_view_into(c->out[0], a, a->ndim, a->shape, a->stride, a->offset);
	return EPJ_OK;
}

epj_status ej_backward_RESHAPE(epj_ctx *ctx, const ej_call *c,
			       epj_tensor *const *grad_out, const bool *needs,
			       epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *r = epj_reshape(ctx, g, c->in[0]->ndim, c->in[0]->shape);
	epj_tensor_free(g);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- TRANSPOSE --------------------------------------------------------- */

epj_status ej_infer_TRANSPOSE(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0];
	int d0, d1;
	if (c->attrs->n_i != 2)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "expects 2 dims, got %d", c->attrs->n_i);
	if (ej_check_axis(ctx, c, c->attrs->i[0], a->ndim, &d0) != EPJ_OK ||
	    ej_check_axis(ctx, c, c->attrs->i[1], a->ndim, &d1) != EPJ_OK)
		return ctx->status;
	ej_meta_from(out, a);
	for (int i = 0; i < a->ndim; i++)
		out->stride[i] = a->stride[i];
	if (a->ndim > 0) {
		out->shape[d0] = a->shape[d1];
		out->shape[d1] = a->shape[d0];
		out->stride[d0] = a->stride[d1];
		out->stride[d1] = a->stride[d0];
	}
	out->offset = a->offset;
	out->is_view = true;
	return EPJ_OK;
}

epj_status ej_kernel_TRANSPOSE(epj_ctx *ctx, const ej_call *c)
{
	return kernel_copy_view(ctx, c, ej_infer_TRANSPOSE);
}

epj_status ej_backward_TRANSPOSE(epj_ctx *ctx, const ej_call *c,
				 epj_tensor *const *grad_out, const bool *needs,
				 epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *r =
	    epj_transpose(ctx, g, (int)c->attrs->i[0], (int)c->attrs->i[1]);
	epj_tensor_free(g);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- PERMUTE ----------------------------------------------------------- */

epj_status ej_infer_PERMUTE(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0];
	const ej_attrs *at = c->attrs;
	bool seen[EPJ_MAX_DIMS] = { false };
	char buf[160];
	bool ok = at->n_i == a->ndim;
	for (int i = 0; ok && i < at->n_i; i++) {
		int64_t p = at->i[i];
		if (p < 0 || p >= a->ndim || seen[p])
			ok = false;
		else
			seen[p] = true;
	}
	if (!ok)
		return ej_op_error(
		    ctx, c, EPJ_ERR_INVALID,
		    "bad permutation %s for %d dims (each dim exactly once)",
		    ej_shape_str(at->n_i, at->i, buf, sizeof buf), a->ndim);
	ej_meta_set(out, a->dtype, a->ndim, a->shape);
	for (int i = 0; i < a->ndim; i++) {
		out->shape[i] = a->shape[at->i[i]];
		out->stride[i] = a->stride[at->i[i]];
	}
	out->offset = a->offset;
	out->is_view = true;
	return EPJ_OK;
}

epj_status ej_kernel_PERMUTE(epj_ctx *ctx, const ej_call *c)
{
	return kernel_copy_view(ctx, c, ej_infer_PERMUTE);
}

epj_status ej_backward_PERMUTE(epj_ctx *ctx, const ej_call *c,
			       epj_tensor *const *grad_out, const bool *needs,
			       epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	int inv[EPJ_MAX_DIMS];
	for (int i = 0; i < c->attrs->n_i; i++)
		inv[c->attrs->i[i]] = i;
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *r = epj_permute(ctx, g, inv);
	epj_tensor_free(g);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- SLICE ------------------------------------------------------------- */

/* Validates slice attributes i[0..4) = axis, start, end, step against an
 * input of (ndim, shape); *len receives the sliced length. */
static epj_status check_slice(epj_ctx *ctx, const ej_call *c, int ndim,
			      const int64_t *shape, int *axis, int64_t *len)
{
	const ej_attrs *at = c->attrs;
	if (at->n_i < 4)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "expects axis, start, end, step");
	if (ndim == 0)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "cannot slice a 0-dim tensor");
	if (ej_check_axis(ctx, c, at->i[0], ndim, axis) != EPJ_OK)
		return ctx->status;
	int64_t start = at->i[1], end = at->i[2], step = at->i[3];
	int64_t dim = shape[*axis];
	if (step < 1 || start < 0 || end < start || end > dim)
		return ej_op_error(ctx, c, EPJ_ERR_INDEX,
				   "slice [%lld:%lld:%lld] out of range for "
				   "axis %d of size %lld",
				   (long long)start, (long long)end,
				   (long long)step, *axis, (long long)dim);
	*len = (end - start + step - 1) / step;
	return EPJ_OK;
}

epj_status ej_infer_SLICE(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0];
	int axis;
	int64_t len;
	if (check_slice(ctx, c, a->ndim, a->shape, &axis, &len) != EPJ_OK)
		return ctx->status;
	ej_meta_from(out, a);
	for (int i = 0; i < a->ndim; i++)
		out->stride[i] = a->stride[i];
	out->shape[axis] = len;
	out->stride[axis] = a->stride[axis] * c->attrs->i[3];
	/* an empty slice may start at the end: keep the offset in bounds */
	out->offset =
	    a->offset + (len > 0 ? c->attrs->i[1] * a->stride[axis] : 0);
	out->is_view = true;
	return EPJ_OK;
}

epj_status ej_kernel_SLICE(epj_ctx *ctx, const ej_call *c)
{
	return kernel_copy_view(ctx, c, ej_infer_SLICE);
}

epj_status ej_backward_SLICE(epj_ctx *ctx, const ej_call *c,
			     epj_tensor *const *grad_out, const bool *needs,
			     epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	const epj_tensor *a = c->in[0];
	ej_attrs at = ej_attrs_none();
	for (int i = 0; i < 4; i++)
		ej_attrs_push_i(&at, c->attrs->i[i]);
	for (int i = 0; i < a->ndim; i++)
		ej_attrs_push_i(&at, a->shape[i]);
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *r = ej_call1(ctx, EJ_OP_SLICE_BACKWARD, &g, 1, &at);
	epj_tensor_free(g);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- SLICE_BACKWARD: (grad of the slice) -> zeros of the input shape with
 * grad written at the slice; i[0..4) as SLICE, i[4..) = input shape. */

epj_status ej_infer_SLICE_BACKWARD(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *g = c->in[0];
	const ej_attrs *at = c->attrs;
	int ndim = at->n_i - 4, axis;
	int64_t len;
	char b1[160], b2[160];
	if (ndim < 1 || ndim > EPJ_MAX_DIMS)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "expects slice attributes and the input "
				   "shape (%d attributes)",
				   at->n_i);
	const int64_t *shape = at->i + 4;
	for (int i = 0; i < ndim; i++)
		if (shape[i] < 0)
			return ej_op_error(
			    ctx, c, EPJ_ERR_SHAPE, "negative dimension in %s",
			    ej_shape_str(ndim, shape, b1, sizeof b1));
	if (check_slice(ctx, c, ndim, shape, &axis, &len) != EPJ_OK)
		return ctx->status;
	bool ok = g->ndim == ndim;
	for (int i = 0; ok && i < ndim; i++)
		ok = g->shape[i] == (i == axis ? len : shape[i]);
	if (!ok) {
		int64_t want[EPJ_MAX_DIMS];
		memcpy(want, shape, sizeof want[0] * (size_t)ndim);
		want[axis] = len;
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "gradient shape must be %s (slice of %s)",
				   ej_shape_str(ndim, want, b1, sizeof b1),
				   ej_shape_str(ndim, shape, b2, sizeof b2));
	}
	ej_meta_set(out, g->dtype, ndim, shape);
	return EPJ_OK;
}

epj_status ej_kernel_SLICE_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *g = c->in[0];
	epj_tensor *out = c->out[0];
	int axis = ej_axis((int)c->attrs->i[0], out->ndim);
	size_t es = ej_dtype_size(out->dtype);
	memset(ej_data(out), 0, (size_t)ej_numel(out->ndim, out->shape) * es);
	int64_t st[EPJ_MAX_DIMS];
	for (int i = 0; i < out->ndim; i++)
		st[i] = out->stride[i];
	char *dst = (char *)ej_data(out);
	if (g->shape[axis] > 0)
		dst += (size_t)(c->attrs->i[1] * st[axis]) * es;
	st[axis] *= c->attrs->i[3];
	copy_strided(dst, st, (const char *)ej_data(g), g->stride, g->ndim,
		     g->shape, es);
	return EPJ_OK;
}

epj_status ej_backward_SLICE_BACKWARD(epj_ctx *ctx, const ej_call *c,
				      epj_tensor *const *grad_out,
				      const bool *needs, epj_tensor **grad_in)
{
	/* linear: the adjoint of "place at the slice" is "take the slice" */
	if (!needs[0])
		return EPJ_OK;
	const ej_attrs *at = c->attrs;
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *r =
	    epj_slice(ctx, g, (int)at->i[0], at->i[1], at->i[2], at->i[3]);
	epj_tensor_free(g);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- EXPAND ------------------------------------------------------------ */

epj_status ej_infer_EXPAND(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0];
	const ej_attrs *at = c->attrs;
	int nd = at->n_i, lead = at->n_i - a->ndim;
	char b1[160];
	if (nd > EPJ_MAX_DIMS || lead < 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "target shape %s has fewer dims than the "
				   "input or more than %d",
				   ej_shape_str(nd, at->i, b1, sizeof b1),
				   EPJ_MAX_DIMS);
	ej_meta_set(out, a->dtype, nd, at->i);
	for (int i = 0; i < nd; i++) {
		int j = i - lead;
		int64_t want = at->i[i];
		if (j >= 0 && want == -1)
			want = a->shape[j];
		if (want < 0)
			return ej_op_error(
			    ctx, c, EPJ_ERR_SHAPE,
			    "bad size %lld at dim %d of target %s",
			    (long long)at->i[i], i,
			    ej_shape_str(nd, at->i, b1, sizeof b1));
		out->shape[i] = want;
		if (j < 0) {
			out->stride[i] = 0;
		} else if (a->shape[j] == want) {
			out->stride[i] = a->stride[j];
		} else if (a->shape[j] == 1) {
			out->stride[i] = 0;
		} else {
			return ej_op_error(
			    ctx, c, EPJ_ERR_SHAPE,
			    "cannot expand dim %d of size %lld to %lld "
			    "(target %s; only size-1 dims expand)",
			    j, (long long)a->shape[j], (long long)want,
			    ej_shape_str(nd, at->i, b1, sizeof b1));
		}
	}
	out->offset = a->offset;
	out->is_view = true;
	return EPJ_OK;
}

epj_status ej_kernel_EXPAND(epj_ctx *ctx, const ej_call *c)
{
	return kernel_copy_view(ctx, c, ej_infer_EXPAND);
}

epj_status ej_backward_EXPAND(epj_ctx *ctx, const ej_call *c,
			      epj_tensor *const *grad_out, const bool *needs,
			      epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *r = epj_sum_to(ctx, g, c->in[0]->ndim, c->in[0]->shape);
	epj_tensor_free(g);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- CONTIGUOUS -------------------------------------------------------- */

epj_status ej_infer_CONTIGUOUS(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	ej_meta_from(out, c->in[0]);
	return EPJ_OK;
}

epj_status ej_kernel_CONTIGUOUS(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *a = c->in[0];
	copy_view_into(c->out[0], a, a->ndim, a->shape, a->stride, a->offset);
	return EPJ_OK;
}

epj_status ej_backward_CONTIGUOUS(epj_ctx *ctx, const ej_call *c,
				  epj_tensor *const *grad_out,
				  const bool *needs, epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	return ej_set_grad(ctx, &grad_in[0],
			   ej_grad_or_zeros(ctx, c, grad_out, 0));
}

/* ---- CAT: variadic inputs of one dtype and ndim, equal shapes except on
 * axis i[0]; output sums their sizes on axis. */

epj_status ej_infer_CAT(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0];
	int axis;
	char b1[160], b2[160];
	if (c->attrs->n_i < 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID, "expects an axis");
	if (a->ndim == 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "cannot concatenate 0-dim tensors");
	if (ej_check_axis(ctx, c, c->attrs->i[0], a->ndim, &axis) != EPJ_OK)
		return ctx->status;
	int64_t total = 0;
	for (int k = 0; k < c->n_in; k++) {
		const epj_tensor *t = c->in[k];
		if (ej_check_same_dtype(ctx, c, 0, k) != EPJ_OK)
			return ctx->status;
		bool ok = t->ndim == a->ndim;
		for (int i = 0; ok && i < a->ndim; i++)
			ok = i == axis || t->shape[i] == a->shape[i];
		if (!ok)
			return ej_op_error(
			    ctx, c, EPJ_ERR_SHAPE,
			    "input %d has shape %s but input 0 has %s "
			    "(shapes must match except on axis %d)",
			    k, ej_shape_str(t->ndim, t->shape, b1, sizeof b1),
			    ej_shape_str(a->ndim, a->shape, b2, sizeof b2),
			    axis);
		total += t->shape[axis];
	}
	ej_meta_from(out, a);
	out->shape[axis] = total;
	return EPJ_OK;
}

epj_status ej_kernel_CAT(epj_ctx *ctx, const ej_call *c)
{
	epj_tensor *out = c->out[0];
	int axis = ej_axis((int)c->attrs->i[0], out->ndim);
	size_t es = ej_dtype_size(out->dtype);
	int64_t at = 0;
	for (int k = 0; k < c->n_in; k++) {
		/* input k lands in out[..., at:at+len, ...]: same strides */
		const epj_tensor *t = c->in[k];
		char *dst = (char *)ej_data(out) +
			    (size_t)(at * out->stride[axis]) * es;
		copy_strided(dst, out->stride, (const char *)ej_data(t),
			     t->stride, t->ndim, t->shape, es);
		at += t->shape[axis];
	}
	return EPJ_OK;
}

epj_status ej_backward_CAT(epj_ctx *ctx, const ej_call *c,
			   epj_tensor *const *grad_out, const bool *needs,
			   epj_tensor **grad_in)
{
	int axis = ej_axis((int)c->attrs->i[0], c->in[0]->ndim);
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	if (!g)
		return ctx->status;
	epj_status st = EPJ_OK;
	int64_t at = 0;
	for (int k = 0; k < c->n_in && st == EPJ_OK; k++) {
		int64_t len = c->in[k]->shape[axis];
		if (needs[k])
			st = ej_set_grad(
			    ctx, &grad_in[k],
			    epj_slice(ctx, g, axis, at, at + len, 1));
		at += len;
	}
	epj_tensor_free(g);
	return st;
}

/* ---- FULL: creation; i[0] = dtype, i[1..) = shape, f[0] = value -------- */

epj_status ej_infer_FULL(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const ej_attrs *at = c->attrs;
	char b1[160];
	if (at->n_i < 1 || at->n_f < 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "expects dtype, shape and value");
	int64_t dt = at->i[0];
	int ndim = at->n_i - 1;
	if (dt < 0 || dt >= EPJ_DTYPE_COUNT)
		return ej_op_error(ctx, c, EPJ_ERR_DTYPE, "invalid dtype %lld",
				   (long long)dt);
	if (ndim > EPJ_MAX_DIMS)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "%d dims (at most %d)", ndim, EPJ_MAX_DIMS);
	for (int i = 0; i < ndim; i++)
		if (at->i[1 + i] < 0)
			return ej_op_error(
			    ctx, c, EPJ_ERR_SHAPE,
			    "negative dimension in shape %s",
			    ej_shape_str(ndim, at->i + 1, b1, sizeof b1));
	if (!epj_dtype_is_float((epj_dtype)dt) && !isfinite(at->f[0]))
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "value %g is not representable in %s",
				   at->f[0], epj_dtype_name((epj_dtype)dt));
	ej_meta_set(out, (epj_dtype)dt, ndim, at->i + 1);
	return EPJ_OK;
}

epj_status ej_kernel_FULL(epj_ctx *ctx, const ej_call *c)
{
	epj_tensor *out = c->out[0];
	double v = c->attrs->f[0];
	int64_t n = ej_numel(out->ndim, out->shape);
	void *p = ej_data(out);
	if (v == 0.0 && !signbit(v)) {
		memset(p, 0, (size_t)n * ej_dtype_size(out->dtype));
		return EPJ_OK;
	}
	switch (out->dtype) {
	case EPJ_DTYPE_F32: {
		float x = (float)v;
		for (int64_t i = 0; i < n; i++)
			((float *)p)[i] = x;
		break;
	}
	case EPJ_DTYPE_BF16: {
		uint16_t x = epj_f32_to_bf16((float)v);
		for (int64_t i = 0; i < n; i++)
			((uint16_t *)p)[i] = x;
		break;
	}
	case EPJ_DTYPE_F64:
		for (int64_t i = 0; i < n; i++)
			((double *)p)[i] = v;
		break;
	case EPJ_DTYPE_I32: {
		int32_t x = (int32_t)v;
		for (int64_t i = 0; i < n; i++)
			((int32_t *)p)[i] = x;
		break;
	}
	case EPJ_DTYPE_I64: {
		int64_t x = (int64_t)v;
		for (int64_t i = 0; i < n; i++)
			((int64_t *)p)[i] = x;
		break;
	}
	default:
		EJ_ASSERT(!"full: dtype checked by infer");
	}
	return EPJ_OK;
}

/* ---- public wrappers --------------------------------------------------- */

epj_tensor *epj_full(epj_ctx *ctx, epj_dtype dt, int ndim, const int64_t *shape,
		     double value)
{
	if (ndim < 0 || ndim > EPJ_MAX_DIMS || (ndim > 0 && !shape)) {
		wrap_error(ctx, EJ_OP_FULL, NULL, 0, EPJ_ERR_SHAPE,
			   "ndim %d out of range [0, %d] or NULL shape", ndim,
			   EPJ_MAX_DIMS);
		return NULL;
	}
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, (int64_t)dt);
	for (int i = 0; i < ndim; i++)
		ej_attrs_push_i(&at, shape[i]);
	ej_attrs_push_f(&at, value);
	return ej_call1(ctx, EJ_OP_FULL, NULL, 0, &at);
}

epj_tensor *epj_zeros(epj_ctx *ctx, epj_dtype dt, int ndim,
		      const int64_t *shape)
{
	return epj_full(ctx, dt, ndim, shape, 0.0);
}

epj_tensor *epj_reshape(epj_ctx *ctx, epj_tensor *a, int ndim,
			const int64_t *shape)
{
	if (!a)
		return NULL;
	char b1[160];
	if (ndim < 0 || ndim > EPJ_MAX_DIMS || (ndim > 0 && !shape)) {
		wrap_error(ctx, EJ_OP_RESHAPE, &a, 1, EPJ_ERR_SHAPE,
			   "target ndim %d out of range [0, %d] or NULL shape",
			   ndim, EPJ_MAX_DIMS);
		return NULL;
	}
	ej_attrs at = ej_attrs_none();
	int infer_at = -1;
	int64_t known = 1;
	for (int i = 0; i < ndim; i++) {
		if (shape[i] == -1 && infer_at < 0) {
			infer_at = i;
			continue;
		}
		if (shape[i] < 0) {
			wrap_error(ctx, EJ_OP_RESHAPE, &a, 1, EPJ_ERR_SHAPE,
				   "bad target shape %s (one -1 at most, other "
				   "dims >= 0)",
				   ej_shape_str(ndim, shape, b1, sizeof b1));
			return NULL;
		}
		known *= shape[i];
	}
	int64_t numel = ej_numel(a->ndim, a->shape);
	for (int i = 0; i < ndim; i++) {
		int64_t d = shape[i];
		if (i == infer_at) {
			if (known == 0 || numel % known != 0) {
				wrap_error(
				    ctx, EJ_OP_RESHAPE, &a, 1, EPJ_ERR_SHAPE,
				    "cannot reshape %lld elements to "
				    "%s (-1 is ambiguous or does not "
				    "divide)",
				    (long long)numel,
				    ej_shape_str(ndim, shape, b1, sizeof b1));
				return NULL;
			}
			d = numel / known;
		}
		ej_attrs_push_i(&at, d);
	}
	if (infer_at < 0 && known != numel) {
		wrap_error(ctx, EJ_OP_RESHAPE, &a, 1, EPJ_ERR_SHAPE,
			   "cannot reshape %lld elements to %s (%lld "
			   "elements)",
			   (long long)numel,
			   ej_shape_str(ndim, shape, b1, sizeof b1),
			   (long long)known);
		return NULL;
	}
	return ej_call1(ctx, EJ_OP_RESHAPE, &a, 1, &at);
}

/* Normalises a possibly negative dim for a wrapper; an out-of-range dim is
 * passed through unchanged for infer to report. */
static int64_t norm_dim(int64_t d, int ndim)
{
	return d < 0 && d + ndim >= 0 ? d + ndim : d;
}

epj_tensor *epj_transpose(epj_ctx *ctx, epj_tensor *a, int d0, int d1)
{
	if (!a)
		return NULL;
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, norm_dim(d0, a->ndim));
	ej_attrs_push_i(&at, norm_dim(d1, a->ndim));
	return ej_call1(ctx, EJ_OP_TRANSPOSE, &a, 1, &at);
}

epj_tensor *epj_permute(epj_ctx *ctx, epj_tensor *a, const int *perm)
{
	if (!a)
		return NULL;
	if (!perm && a->ndim > 0) {
		wrap_error(ctx, EJ_OP_PERMUTE, &a, 1, EPJ_ERR_INVALID,
			   "NULL permutation");
		return NULL;
	}
	ej_attrs at = ej_attrs_none();
	for (int i = 0; i < a->ndim; i++)
		ej_attrs_push_i(&at, norm_dim(perm[i], a->ndim));
	return ej_call1(ctx, EJ_OP_PERMUTE, &a, 1, &at);
}

/* Python-style bound: negative counts from the end, then clamped. */
static int64_t slice_bound(int64_t v, int64_t dim)
{
	if (v < 0)
		v += dim;
	return v < 0 ? 0 : v > dim ? dim : v;
}

epj_tensor *epj_slice(epj_ctx *ctx, epj_tensor *a, int axis, int64_t start,
		      int64_t end, int64_t step)
{
	if (!a)
		return NULL;
	int ax = ej_axis(axis, a->ndim);
	if (ax < 0) {
		wrap_error(ctx, EJ_OP_SLICE, &a, 1, EPJ_ERR_INVALID,
			   "axis %d out of range for %d dims", axis, a->ndim);
		return NULL;
	}
	if (step < 1) {
		wrap_error(ctx, EJ_OP_SLICE, &a, 1, EPJ_ERR_INVALID,
			   "step %lld must be >= 1", (long long)step);
		return NULL;
	}
	int64_t dim = a->shape[ax];
	int64_t s = slice_bound(start, dim), e = slice_bound(end, dim);
	if (e < s)
		e = s;
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, ax);
	ej_attrs_push_i(&at, s);
	ej_attrs_push_i(&at, e);
	ej_attrs_push_i(&at, step);
	return ej_call1(ctx, EJ_OP_SLICE, &a, 1, &at);
}

epj_status epj_split(epj_ctx *ctx, epj_tensor *a, int axis, int n,
		     const int64_t *sizes, epj_tensor **outs)
{
	if (!outs)
		return ej_error(ctx, EPJ_ERR_INVALID, "split: NULL outs");
	for (int i = 0; i < n; i++)
		outs[i] = NULL;
	if (!a)
		return null_status(ctx);
	int ax = ej_axis(axis, a->ndim);
	if (ax < 0)
		return wrap_error(ctx, EJ_OP_SLICE, &a, 1, EPJ_ERR_INVALID,
				  "split: axis %d out of range for %d dims",
				  axis, a->ndim);
	if (n < 1 || !sizes)
		return wrap_error(ctx, EJ_OP_SLICE, &a, 1, EPJ_ERR_INVALID,
				  "split: needs n >= 1 sizes (n = %d)", n);
	int64_t total = 0;
	for (int i = 0; i < n; i++) {
		if (sizes[i] < 0)
			return wrap_error(ctx, EJ_OP_SLICE, &a, 1,
					  EPJ_ERR_SHAPE,
					  "split: size %d is negative (%lld)",
					  i, (long long)sizes[i]);
		total += sizes[i];
	}
	if (total != a->shape[ax])
		return wrap_error(ctx, EJ_OP_SLICE, &a, 1, EPJ_ERR_SHAPE,
				  "split: sizes sum to %lld but axis %d has "
				  "size %lld",
				  (long long)total, ax,
				  (long long)a->shape[ax]);
	int64_t at = 0;
	for (int i = 0; i < n; i++) {
		outs[i] = epj_slice(ctx, a, ax, at, at + sizes[i], 1);
		if (!outs[i]) {
			for (int j = 0; j < i; j++) {
				epj_tensor_free(outs[j]);
				outs[j] = NULL;
			}
			return null_status(ctx);
		}
		at += sizes[i];
	}
	return EPJ_OK;
}

epj_tensor *epj_expand(epj_ctx *ctx, epj_tensor *a, int ndim,
		       const int64_t *shape)
{
	if (!a)
		return NULL;
	char b1[160];
	if (ndim < a->ndim || ndim > EPJ_MAX_DIMS || (ndim > 0 && !shape)) {
		wrap_error(ctx, EJ_OP_EXPAND, &a, 1, EPJ_ERR_SHAPE,
			   "target ndim %d must be in [%d, %d]", ndim, a->ndim,
			   EPJ_MAX_DIMS);
		return NULL;
	}
	int lead = ndim - a->ndim;
	ej_attrs at = ej_attrs_none();
	for (int i = 0; i < ndim; i++) {
		int64_t d = shape[i];
		if (d == -1 && i >= lead)
			d = a->shape[i - lead];
		if (d < 0) {
			wrap_error(ctx, EJ_OP_EXPAND, &a, 1, EPJ_ERR_SHAPE,
				   "bad target %s (-1 keeps an existing dim; "
				   "new leading dims need a size)",
				   ej_shape_str(ndim, shape, b1, sizeof b1));
			return NULL;
		}
		ej_attrs_push_i(&at, d);
	}
	return ej_call1(ctx, EJ_OP_EXPAND, &a, 1, &at);
}

epj_tensor *epj_contiguous(epj_ctx *ctx, epj_tensor *a)
{
	if (!a)
		return NULL;
	/* while tracing the copy must be recorded even for a dense input */
	if (ctx->recorder == NULL && ej_is_contiguous(a))
		return epj_tensor_ref(a);
	return ej_call1(ctx, EJ_OP_CONTIGUOUS, &a, 1, NULL);
}

epj_tensor *epj_cat(epj_ctx *ctx, epj_tensor *const *ts, int n, int axis)
{
	if (!ts || n < 1) {
		wrap_error(ctx, EJ_OP_CAT, NULL, 0, EPJ_ERR_INVALID,
			   "needs at least one tensor (n = %d)", n);
		return NULL;
	}
	for (int i = 0; i < n; i++)
		if (!ts[i])
			return NULL;
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, norm_dim(axis, ts[0]->ndim));
	return ej_call1(ctx, EJ_OP_CAT, ts, n, &at);
}
