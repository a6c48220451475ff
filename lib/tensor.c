/* tensor.c -- tensor structs, views, accessors, element access and copies,
 * random factories, and the autograd fields that belong to a tensor.
 *
 * A tensor is a refcounted header (shape, strides and offset in elements,
 * dtype) over a refcounted storage; views share the storage.  Symbolic
 * tensors of trace mode have no storage (value_id >= 0).
 *
 * Invariants
 *  - 0 <= ndim <= EPJ_MAX_DIMS, shape[i] >= 0, stride[i] >= 0.
 *  - A view never reaches outside its storage: when numel > 0,
 *    (offset + sum((shape[i]-1)*stride[i]) + 1) * elsize <= storage->bytes
 *    (asserted in ej_tensor_view).
 *  - Element order everywhere here is row-major over the shape, whatever
 *    the strides; random factories fill in that order from ctx->rng, so a
 *    seed gives the same values on every run and thread count.
 *  - Element access on a device that is not host-visible goes through a
 *    host copy of the view's span [offset, last element] (dev->copy), so
 *    to_f64/from_f64/copy_ work on any backend, slowly.
 */
#include "core_impl.h"

#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <string.h>

/* ---- geometry -------------------------------------------------------------
 */

void ej_contiguous_strides(int ndim, const int64_t *shape, int64_t *stride)
{
	int64_t s = 1;
	for (int i = ndim - 1; i >= 0; i--) {
		stride[i] = s;
		/* shapes were checked (check_new_shape): no overflow */
		bool ovf =
		    __builtin_mul_overflow(s, shape[i] > 1 ? shape[i] : 1, &s);
		EJ_ASSERT(!ovf);
	}
}

int64_t ej_numel(int ndim, const int64_t *shape)
{
	int64_t n = 1;
	for (int i = 0; i < ndim; i++)
		n *= shape[i];
	return n;
}

bool ej_is_contiguous(const epj_tensor *t)
{
	int64_t expect = 1;
	for (int i = t->ndim - 1; i >= 0; i--) {
		if (t->shape[i] == 0)
			return true; /* no elements: any layout is dense */
		if (t->shape[i] == 1)
			continue;
		if (t->stride[i] != expect)
			return false;
		expect *= t->shape[i];
	}
	return true;
}

int ej_axis(int axis, int ndim)
{
	if (axis < 0)
		axis += ndim;
	return axis >= 0 && axis < ndim ? axis : -1;
}

/* Offset (elements, relative to t->offset) of the last element; 0 when
 * empty. */
static int64_t span_last(int ndim, const int64_t *shape, const int64_t *stride)
{
	int64_t last = 0;
	for (int i = 0; i < ndim; i++) {
		if (shape[i] == 0)
			return 0;
		last += (shape[i] - 1) * stride[i];
	}
	return last;
}

/* Validates a shape for a new tensor of dtype dt: ndim range, dims >= 0, and
 * a byte size that fits.  *nbytes receives the byte size. */
static epj_status check_new_shape(epj_ctx *ctx, const char *who, epj_dtype dt,
				  int ndim, const int64_t *shape,
				  size_t *nbytes)
{
	if ((int)dt < 0 || dt >= EPJ_DTYPE_COUNT)
		return ej_error(ctx, EPJ_ERR_DTYPE, "%s: invalid dtype %d", who,
				(int)dt);
	if (ndim < 0 || ndim > EPJ_MAX_DIMS)
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"%s: ndim %d out of range [0, %d]", who, ndim,
				EPJ_MAX_DIMS);
	if (ndim > 0 && !shape)
		return ej_error(ctx, EPJ_ERR_INVALID, "%s: NULL shape", who);
	char buf[256];
	/* n: elements; nz: product of the non-zero dimensions, which bounds
	 * the contiguous strides even of an empty tensor ([0, 2^62, 2^62]
	 * has no element but strides past int64). */
	int64_t n = 1, nz = 1;
	for (int i = 0; i < ndim; i++) {
		if (shape[i] < 0)
			return ej_error(
			    ctx, EPJ_ERR_SHAPE,
			    "%s: negative dimension in shape %s", who,
			    ej_shape_str(ndim, shape, buf, sizeof buf));
		if (shape[i] > 0 && nz > INT64_MAX / 8 / shape[i])
			return ej_error(
			    ctx, EPJ_ERR_SHAPE,
			    "%s: shape %s is too large: the product of its "
			    "non-zero dimensions must be at most %" PRId64,
			    who, ej_shape_str(ndim, shape, buf, sizeof buf),
			    INT64_MAX / 8);
		if (shape[i] > 0)
			nz *= shape[i];
		n *= shape[i];
	}
	if ((uint64_t)n * epj_dtype_size(dt) > SIZE_MAX)
		return ej_error(ctx, EPJ_ERR_SHAPE, "%s: shape %s is too large",
				who,
				ej_shape_str(ndim, shape, buf, sizeof buf));
	*nbytes = (size_t)n * epj_dtype_size(dt);
	return EPJ_OK;
}

static epj_tensor *header_new(epj_ctx *ctx, epj_dtype dt, int ndim,
			      const int64_t *shape)
{
	epj_tensor *t = calloc(1, sizeof *t);
	if (!t) {
		ej_error(ctx, EPJ_ERR_NOMEM,
			 "out of memory allocating a tensor");
		return NULL;
	}
	t->refcount = 1;
	t->dtype = dt;
	t->ndim = ndim;
	for (int i = 0; i < ndim; i++)
		t->shape[i] = shape[i];
	ej_contiguous_strides(ndim, t->shape, t->stride);
	t->ctx = ctx;
	t->value_id = -1;
	return t;
}

epj_tensor *ej_tensor_alloc(epj_ctx *ctx, epj_dtype dt, int ndim,
			    const int64_t *shape, bool zero)
{
	size_t nbytes;
	if (check_new_shape(ctx, "tensor", dt, ndim, shape, &nbytes) != EPJ_OK)
		return NULL;
	epj_tensor *t = header_new(ctx, dt, ndim, shape);
	if (!t || ctx->meta)
		return t; /* shape-only mode: no storage */
	t->storage = zero ? ej_storage_new(ctx, nbytes)
			  : ej_storage_new_uninit(ctx, nbytes);
	if (!t->storage) {
		free(t);
		return NULL;
	}
	return t;
}

epj_tensor *ej_tensor_meta(epj_ctx *ctx, epj_dtype dt, int ndim,
			   const int64_t *shape)
{
	size_t nbytes;
	if (check_new_shape(ctx, "tensor", dt, ndim, shape, &nbytes) != EPJ_OK)
		return NULL;
	return header_new(ctx, dt, ndim, shape);
}

epj_tensor *epj_tensor_borrow(epj_ctx *ctx, epj_dtype dt, int ndim,
			      const int64_t *shape, void *data)
{
	size_t nbytes;
	if (!ctx)
		return NULL;
	if ((unsigned)dt >= EPJ_DTYPE_COUNT || ndim < 0 ||
	    ndim > EPJ_MAX_DIMS || (ndim > 0 && !shape)) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "tensor_borrow: bad dtype %d or rank %d (at most %d)",
			 (int)dt, ndim, EPJ_MAX_DIMS);
		return NULL;
	}
	if (check_new_shape(ctx, "tensor_borrow", dt, ndim, shape, &nbytes) !=
	    EPJ_OK)
		return NULL;
	if (!data && nbytes > 0) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "tensor_borrow: NULL data for %zu bytes", nbytes);
		return NULL;
	}
	epj_tensor *t = header_new(ctx, dt, ndim, shape);
	ej_storage *s = t ? calloc(1, sizeof *s) : NULL;
	if (!s) {
		free(t);
		ej_error(ctx, EPJ_ERR_NOMEM,
			 "out of memory borrowing a tensor");
		return NULL;
	}
	s->refcount = 1;
	s->data = data;
	s->bytes = nbytes;
	s->alloc = NULL; /* borrowed: never freed here */
	t->storage = s;
	return t;
}

epj_tensor *ej_tensor_view(epj_tensor *t, int ndim, const int64_t *shape,
			   const int64_t *stride, int64_t offset)
{
	EJ_ASSERT(ndim >= 0 && ndim <= EPJ_MAX_DIMS);
	EJ_ASSERT(offset >= 0);
	for (int i = 0; i < ndim; i++)
		EJ_ASSERT(shape[i] >= 0 && stride[i] >= 0);
	if (t->storage && ej_numel(ndim, shape) > 0)
		EJ_ASSERT(
		    (uint64_t)(offset + span_last(ndim, shape, stride) + 1) *
			ej_dtype_size(t->dtype) <=
		    t->storage->bytes);
	epj_tensor *v = calloc(1, sizeof *v);
	if (!v) {
		ej_error(t->ctx, EPJ_ERR_NOMEM,
			 "out of memory allocating a tensor view");
		return NULL;
	}
	v->refcount = 1;
	v->dtype = t->dtype;
	v->ndim = ndim;
	for (int i = 0; i < ndim; i++) {
		v->shape[i] = shape[i];
		v->stride[i] = stride[i];
	}
	v->offset = offset;
	v->storage = t->storage;
	if (v->storage)
		ej_storage_ref(v->storage);
	v->ctx = t->ctx;
	v->value_id = -1;
	return v;
}

/* ---- accessors -------------------------------------------------------------
 * NULL-tolerant: a NULL tensor reads as empty (ndim -1, numel 0, NULL). */

epj_dtype epj_tensor_dtype(const epj_tensor *t)
{
	return t ? t->dtype : EPJ_DTYPE_COUNT;
}

int epj_tensor_ndim(const epj_tensor *t)
{
	return t ? t->ndim : -1;
}

int64_t epj_tensor_dim(const epj_tensor *t, int i)
{
	if (!t)
		return -1;
	int a = ej_axis(i, t->ndim);
	if (a < 0) {
		ej_error(
		    t->ctx, EPJ_ERR_INDEX,
		    "tensor_dim: dimension %d out of range for %d-d tensor", i,
		    t->ndim);
		return -1;
	}
	return t->shape[a];
}

const int64_t *epj_tensor_shape(const epj_tensor *t)
{
	return t ? t->shape : NULL;
}

const int64_t *epj_tensor_strides(const epj_tensor *t)
{
	return t ? t->stride : NULL;
}

int64_t epj_tensor_offset(const epj_tensor *t)
{
	return t ? t->offset : 0;
}

int64_t epj_tensor_numel(const epj_tensor *t)
{
	return t ? ej_numel(t->ndim, t->shape) : 0;
}

bool epj_tensor_is_contiguous(const epj_tensor *t)
{
	return t && ej_is_contiguous(t);
}

void *epj_tensor_address(epj_tensor *t)
{
	if (!t || !t->storage || !t->storage->data)
		return NULL;
	ej_param_write(t->ctx, t); /* the caller may write through it */
	return ej_data(t);
}

void *epj_tensor_data(epj_tensor *t)
{
	return t && t->ctx->dev->host_visible ? epj_tensor_address(t) : NULL;
}

bool epj_tensor_shares_storage(const epj_tensor *a, const epj_tensor *b)
{
	return a && b && a->storage && a->storage == b->storage;
}

char *epj_tensor_describe(const epj_tensor *t, char *buf, size_t n)
{
	if (!buf || n == 0)
		return buf;
	if (!t) {
		snprintf(buf, n, "(null)");
		return buf;
	}
	char sh[EPJ_MAX_DIMS * 21 + 3];
	snprintf(buf, n, "%s%s", epj_dtype_name(t->dtype),
		 ej_shape_str(t->ndim, t->shape, sh, sizeof sh));
	return buf;
}

/* ---- refcounting ------------------------------------------------------------
 */

epj_tensor *epj_tensor_ref(epj_tensor *t)
{
	if (t) {
		EJ_ASSERT(t->refcount > 0);
		t->refcount++;
	}
	return t;
}

void epj_tensor_free(epj_tensor *t)
{
	if (!t)
		return;
	EJ_ASSERT(t->refcount > 0);
	if (--t->refcount > 0)
		return;
	if (t->grad_fn) {
		if (t->retains_grad)
			ej_node_forget_retained(t->grad_fn, t->output_nr);
		ej_node_unref(t->grad_fn);
	}
	epj_tensor_free(t->grad);
	ej_storage_unref(t->storage);
	free(t);
}

/* ---- host access to element data -------------------------------------------
 * host_view gives a host pointer to element 0 of a tensor: directly on a
 * host-visible device, else through a malloc'ed copy of the span, written
 * back by host_view_end when asked. */

typedef struct host_view {
	char *p;	/* element 0 (offset applied) */
	char *owned;	/* malloc'ed span copy, or NULL */
	char *dev_base; /* device address of element 0 */
	size_t bytes;	/* span size */
} host_view;

static epj_status host_view_begin(epj_ctx *ctx, const epj_tensor *t,
				  const char *who, host_view *hv)
{
	memset(hv, 0, sizeof *hv);
	if (!t->storage) {
		char d[64];
		return ej_error(ctx, EPJ_ERR_STATE,
				"%s: tensor %s has no data (symbolic tensor "
				"of trace mode)",
				who, epj_tensor_describe(t, d, sizeof d));
	}
	const ej_device *dev = t->ctx->dev;
	char *base = ej_data(t);
	if (dev->host_visible) {
		hv->p = base;
		return EPJ_OK;
	}
	int64_t n = ej_numel(t->ndim, t->shape);
	hv->bytes =
	    n == 0 ? 0
		   : (size_t)(span_last(t->ndim, t->shape, t->stride) + 1) *
			 ej_dtype_size(t->dtype);
	hv->dev_base = base;
	hv->owned = malloc(hv->bytes ? hv->bytes : 1);
	if (!hv->owned)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"%s: out of memory allocating %zu bytes", who,
				hv->bytes);
	if (dev->sync)
		dev->sync(dev->self);
	dev->copy(dev->self, hv->owned, base, hv->bytes);
	hv->p = hv->owned;
	return EPJ_OK;
}

static void host_view_end(const epj_tensor *t, host_view *hv, bool write_back)
{
	if (!hv->owned)
		return;
	const ej_device *dev = t->ctx->dev;
	if (write_back)
		dev->copy(dev->self, hv->dev_base, hv->owned, hv->bytes);
	free(hv->owned);
	hv->owned = NULL;
}

/* ---- strided element copy ---------------------------------------------------
 */

static bool dtype_is_int(epj_dtype dt)
{
	return dt == EPJ_DTYPE_I32 || dt == EPJ_DTYPE_I64;
}

static int64_t load_int(const char *p, epj_dtype dt)
{
	if (dt == EPJ_DTYPE_I32) {
		int32_t v;
		memcpy(&v, p, sizeof v);
		return v;
	}
	int64_t v;
	memcpy(&v, p, sizeof v);
	return v;
}

/* Stores an integer value: exactly for integer dtypes (i32 saturates),
 * through double for float dtypes. */
static void store_int(char *p, epj_dtype dt, int64_t v)
{
	if (dt == EPJ_DTYPE_I64) {
		memcpy(p, &v, sizeof v);
	} else if (dt == EPJ_DTYPE_I32) {
		int32_t w = v > INT32_MAX   ? INT32_MAX
			    : v < INT32_MIN ? INT32_MIN
					    : (int32_t)v;
		memcpy(p, &w, sizeof w);
	} else {
		ej_store_f64(p, dt, (double)v);
	}
}

/* Copies one row of n elements with element strides ds/ss, converting
 * dtypes: bytes for equal dtypes, int64 between integer dtypes (exact), and
 * through double otherwise (ej_store_f64 rounding). */
static void copy_row(char *d, epj_dtype ddt, int64_t ds, const char *s,
		     epj_dtype sdt, int64_t ss, int64_t n)
{
	size_t de = ej_dtype_size(ddt), se = ej_dtype_size(sdt);
	if (ddt == sdt) {
		if (ds == 1 && ss == 1) {
			memcpy(d, s, (size_t)n * de);
			return;
		}
		for (int64_t i = 0; i < n; i++)
			memcpy(d + i * ds * de, s + i * ss * se, de);
	} else if (dtype_is_int(ddt) && dtype_is_int(sdt)) {
		for (int64_t i = 0; i < n; i++)
			store_int(d + i * ds * de, ddt,
				  load_int(s + i * ss * se, sdt));
	} else {
		for (int64_t i = 0; i < n; i++)
			ej_store_f64(d + i * ds * de, ddt,
				     ej_load_f64(s + i * ss * se, sdt));
	}
}

/* Copies all elements of `shape` from (s, sdt, sstride) to (d, ddt,
 * dstride), row-major; pointers are element 0, strides in elements. */
static void copy_strided(int ndim, const int64_t *shape, char *d, epj_dtype ddt,
			 const int64_t *dstride, const char *s, epj_dtype sdt,
			 const int64_t *sstride)
{
	if (ej_numel(ndim, shape) == 0)
		return;
	if (ndim == 0) {
		copy_row(d, ddt, 1, s, sdt, 1, 1);
		return;
	}
	size_t de = ej_dtype_size(ddt), se = ej_dtype_size(sdt);
	int last = ndim - 1;
	int64_t idx[EPJ_MAX_DIMS] = { 0 };
	for (;;) {
		int64_t doff = 0, soff = 0;
		for (int i = 0; i < last; i++) {
			doff += idx[i] * dstride[i];
			soff += idx[i] * sstride[i];
		}
		copy_row(d + doff * (int64_t)de, ddt, dstride[last],
			 s + soff * (int64_t)se, sdt, sstride[last],
			 shape[last]);
		int i = last - 1;
		for (; i >= 0; i--) {
			if (++idx[i] < shape[i])
				break;
			idx[i] = 0;
		}
		if (i < 0)
			return;
	}
}

/* Offset (elements, relative to element 0) of a row-major flat index. */
static int64_t flat_offset(const epj_tensor *t, int64_t flat)
{
	int64_t off = 0;
	for (int i = t->ndim - 1; i >= 0; i--) {
		off += (flat % t->shape[i]) * t->stride[i];
		flat /= t->shape[i];
	}
	return off;
}

epj_status epj_tensor_to_f64(epj_ctx *ctx, const epj_tensor *t, double *out)
{
	if (!t || !out)
		return ej_error(ctx, EPJ_ERR_INVALID, "tensor_to_f64: NULL %s",
				t ? "output" : "tensor");
	host_view hv;
	epj_status st = host_view_begin(ctx, t, "tensor_to_f64", &hv);
	if (st != EPJ_OK)
		return st;
	int64_t cs[EPJ_MAX_DIMS];
	ej_contiguous_strides(t->ndim, t->shape, cs);
	copy_strided(t->ndim, t->shape, (char *)out, EPJ_DTYPE_F64, cs, hv.p,
		     t->dtype, t->stride);
	host_view_end(t, &hv, false);
	return EPJ_OK;
}

epj_status epj_tensor_from_f64(epj_ctx *ctx, epj_tensor *t, const double *in)
{
	if (!t || !in)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"tensor_from_f64: NULL %s",
				t ? "input" : "tensor");
	host_view hv;
	epj_status st = host_view_begin(ctx, t, "tensor_from_f64", &hv);
	if (st != EPJ_OK)
		return st;
	ej_param_write(t->ctx, t);
	int64_t cs[EPJ_MAX_DIMS];
	ej_contiguous_strides(t->ndim, t->shape, cs);
	copy_strided(t->ndim, t->shape, hv.p, t->dtype, t->stride,
		     (const char *)in, EPJ_DTYPE_F64, cs);
	host_view_end(t, &hv, true);
	return EPJ_OK;
}

/* Checks a flat index for get/set; errors go to t's context. */
static bool flat_ok(const epj_tensor *t, int64_t flat, const char *who)
{
	int64_t n = ej_numel(t->ndim, t->shape);
	if (flat >= 0 && flat < n && t->storage)
		return true;
	char d[64];
	if (!t->storage)
		ej_error(t->ctx, EPJ_ERR_STATE,
			 "%s: tensor %s has no data (symbolic tensor of trace "
			 "mode)",
			 who, epj_tensor_describe(t, d, sizeof d));
	else
		ej_error(t->ctx, EPJ_ERR_INDEX,
			 "%s: flat index %lld out of range for %s (%lld "
			 "elements)",
			 who, (long long)flat,
			 epj_tensor_describe(t, d, sizeof d), (long long)n);
	return false;
}

double epj_tensor_get_f64(const epj_tensor *t, int64_t flat_index)
{
	if (!t || !flat_ok(t, flat_index, "tensor_get_f64"))
		return NAN;
	const ej_device *dev = t->ctx->dev;
	size_t es = ej_dtype_size(t->dtype);
	char *p = (char *)ej_data(t) + flat_offset(t, flat_index) * (int64_t)es;
	if (dev->host_visible)
		return ej_load_f64(p, t->dtype);
	char tmp[8];
	if (dev->sync)
		dev->sync(dev->self);
	dev->copy(dev->self, tmp, p, es);
	return ej_load_f64(tmp, t->dtype);
}

void epj_tensor_set_f64(epj_tensor *t, int64_t flat_index, double v)
{
	if (!t || !flat_ok(t, flat_index, "tensor_set_f64"))
		return;
	ej_param_write(t->ctx, t);
	const ej_device *dev = t->ctx->dev;
	size_t es = ej_dtype_size(t->dtype);
	char *p = (char *)ej_data(t) + flat_offset(t, flat_index) * (int64_t)es;
	if (dev->host_visible) {
		ej_store_f64(p, t->dtype, v);
		return;
	}
	char tmp[8];
	ej_store_f64(tmp, t->dtype, v);
	if (dev->sync)
		dev->sync(dev->self);
	dev->copy(dev->self, p, tmp, es);
}

static bool same_shape(const epj_tensor *a, const epj_tensor *b)
{
	if (a->ndim != b->ndim)
		return false;
	for (int i = 0; i < a->ndim; i++)
		if (a->shape[i] != b->shape[i])
			return false;
	return true;
}

/* Byte ranges [lo, hi) of two views of one storage intersect. */
static bool spans_overlap(const epj_tensor *a, const epj_tensor *b)
{
	size_t ea = ej_dtype_size(a->dtype), eb = ej_dtype_size(b->dtype);
	int64_t alo = a->offset * (int64_t)ea;
	int64_t ahi =
	    (a->offset + span_last(a->ndim, a->shape, a->stride) + 1) *
	    (int64_t)ea;
	int64_t blo = b->offset * (int64_t)eb;
	int64_t bhi =
	    (b->offset + span_last(b->ndim, b->shape, b->stride) + 1) *
	    (int64_t)eb;
	return alo < bhi && blo < ahi;
}

epj_status epj_tensor_copy_(epj_ctx *ctx, epj_tensor *dst,
			    const epj_tensor *src)
{
	if (!dst || !src) {
		if (ctx && ctx->status != EPJ_OK)
			return ctx->status; /* NULL propagated from an op */
		return ej_error(ctx, EPJ_ERR_INVALID, "copy_: NULL %s",
				dst ? "src" : "dst");
	}
	char ds[64], ss[64];
	if (!same_shape(dst, src))
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"copy_: shape mismatch: dst %s, src %s",
				epj_tensor_describe(dst, ds, sizeof ds),
				epj_tensor_describe(src, ss, sizeof ss));
	for (int i = 0; i < dst->ndim; i++)
		if (dst->stride[i] == 0 && dst->shape[i] > 1)
			return ej_error(
			    ctx, EPJ_ERR_INVALID,
			    "copy_: dst %s has stride 0 in dim %d: several "
			    "elements share one memory location",
			    epj_tensor_describe(dst, ds, sizeof ds), i);
	if (ctx->meta && !dst->storage && dst->value_id < 0)
		return EPJ_OK; /* shape-only mode */
	if (!dst->storage || !src->storage)
		return ej_error(ctx, EPJ_ERR_STATE,
				"copy_: %s %s has no data (symbolic tensor of "
				"trace mode)",
				dst->storage ? "src" : "dst",
				dst->storage
				    ? epj_tensor_describe(src, ss, sizeof ss)
				    : epj_tensor_describe(dst, ds, sizeof ds));
	if (ej_numel(dst->ndim, dst->shape) == 0)
		return EPJ_OK;
	ej_param_write(dst->ctx, dst);
	/* between contexts: the device whose memory the host cannot address
	 * copies (cuMemcpy infers the direction); host memory otherwise */
	const ej_device *dev =
	    dst->ctx->dev->host_visible ? src->ctx->dev : dst->ctx->dev;

	/* Same dtype, both dense, disjoint (or identical): one device copy.
	 * Partly overlapping views take the general path below. */
	bool overlap =
	    epj_tensor_shares_storage(dst, src) && spans_overlap(dst, src);
	if (dst->dtype == src->dtype && ej_is_contiguous(dst) &&
	    ej_is_contiguous(src) &&
	    (!overlap || ej_data(dst) == ej_data(src))) {
		if (!overlap)
			dev->copy(dev->self, ej_data(dst), ej_data(src),
				  (size_t)ej_numel(dst->ndim, dst->shape) *
				      ej_dtype_size(dst->dtype));
		return EPJ_OK;
	}

	host_view hd, hs;
	epj_status st = host_view_begin(ctx, dst, "copy_", &hd);
	if (st != EPJ_OK)
		return st;
	st = host_view_begin(ctx, src, "copy_", &hs);
	if (st != EPJ_OK) {
		host_view_end(dst, &hd, false);
		return st;
	}
	const char *sp = hs.p;
	const int64_t *sstride = src->stride;
	char *tmp = NULL;
	int64_t cs[EPJ_MAX_DIMS];
	if (!hs.owned && overlap) {
		/* Overlapping views of one host storage: read src fully
		 * first, into a dense buffer of its dtype. */
		size_t bytes = (size_t)ej_numel(src->ndim, src->shape) *
			       ej_dtype_size(src->dtype);
		tmp = malloc(bytes);
		if (!tmp) {
			host_view_end(dst, &hd, false);
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"copy_: out of memory allocating %zu "
					"bytes",
					bytes);
		}
		ej_contiguous_strides(src->ndim, src->shape, cs);
		copy_strided(src->ndim, src->shape, tmp, src->dtype, cs, sp,
			     src->dtype, sstride);
		sp = tmp;
		sstride = cs;
	}
	copy_strided(dst->ndim, dst->shape, hd.p, dst->dtype, dst->stride, sp,
		     src->dtype, sstride);
	free(tmp);
	host_view_end(src, &hs, false);
	host_view_end(dst, &hd, true);
	return EPJ_OK;
}

/* ---- factories
 * ----------------------------------------------------------------
 */

epj_tensor *epj_tensor_from_data(epj_ctx *ctx, epj_dtype dt, int ndim,
				 const int64_t *shape, const void *data)
{
	epj_tensor *t = ej_tensor_alloc(ctx, dt, ndim, shape, false);
	if (!t)
		return NULL;
	size_t bytes = (size_t)ej_numel(ndim, shape) * ej_dtype_size(dt);
	if (bytes && !data) {
		epj_tensor_free(t);
		ej_error(ctx, EPJ_ERR_INVALID, "tensor_from_data: NULL data");
		return NULL;
	}
	ctx->dev->copy(ctx->dev->self, t->storage->data, data, bytes);
	return t;
}

typedef enum { FILL_NORMAL, FILL_UNIFORM, FILL_INT } fill_kind;

/* Uniform integer in [lo, hi) without modulo bias (rejection). */
static int64_t rng_int(ej_rng *r, int64_t lo, int64_t hi)
{
	uint64_t range = (uint64_t)hi - (uint64_t)lo;
	uint64_t limit = UINT64_MAX - UINT64_MAX % range;
	uint64_t x;
	do
		x = ej_rng_next(r);
	while (x >= limit);
	return (int64_t)((uint64_t)lo + x % range);
}

/* New contiguous tensor filled in row-major order from ctx->rng.  a, b are
 * (mean, std), (lo, hi) or the integer bounds. */
static epj_tensor *random_tensor(epj_ctx *ctx, const char *who, fill_kind k,
				 epj_dtype dt, int ndim, const int64_t *shape,
				 double a, double b, int64_t ilo, int64_t ihi)
{
	if (k != FILL_INT && !epj_dtype_is_float(dt)) {
		ej_error(ctx, EPJ_ERR_DTYPE,
			 "%s: dtype %s is not a float dtype", who,
			 epj_dtype_name(dt));
		return NULL;
	}
	if (k == FILL_INT && ilo >= ihi) {
		ej_error(ctx, EPJ_ERR_INVALID, "%s: empty range [%lld, %lld)",
			 who, (long long)ilo, (long long)ihi);
		return NULL;
	}
	if (k == FILL_UNIFORM && !(a <= b)) {
		ej_error(ctx, EPJ_ERR_INVALID, "%s: bad range [%g, %g)", who, a,
			 b);
		return NULL;
	}
	epj_tensor *t = ej_tensor_alloc(ctx, dt, ndim, shape, false);
	if (!t || ctx->meta)
		return t; /* shape-only mode: nothing to fill */
	int64_t n = ej_numel(ndim, shape);
	size_t es = ej_dtype_size(dt);
	bool direct = ctx->dev->host_visible;
	char *buf = direct ? t->storage->data : malloc((size_t)n * es + 1);
	if (!buf) {
		epj_tensor_free(t);
		ej_error(ctx, EPJ_ERR_NOMEM, "%s: out of memory", who);
		return NULL;
	}
	for (int64_t i = 0; i < n; i++) {
		char *p = buf + i * (int64_t)es;
		switch (k) {
		case FILL_NORMAL:
			ej_store_f64(p, dt, a + b * ej_rng_normal(&ctx->rng));
			break;
		case FILL_UNIFORM:
			/* in [a, b) in double; rounding to f32/bf16 may give
			 * b itself, as in PyTorch */
			ej_store_f64(p, dt,
				     a + (b - a) * ej_rng_uniform(&ctx->rng));
			break;
		case FILL_INT:
			store_int(p, dt, rng_int(&ctx->rng, ilo, ihi));
			break;
		}
	}
	if (!direct) {
		ctx->dev->copy(ctx->dev->self, t->storage->data, buf,
			       (size_t)n * es);
		free(buf);
	}
	return t;
}

epj_tensor *epj_randn(epj_ctx *ctx, epj_dtype dt, int ndim,
		      const int64_t *shape, double mean, double std)
{
	return random_tensor(ctx, "randn", FILL_NORMAL, dt, ndim, shape, mean,
			     std, 0, 0);
}

epj_tensor *epj_rand_uniform(epj_ctx *ctx, epj_dtype dt, int ndim,
			     const int64_t *shape, double lo, double hi)
{
	return random_tensor(ctx, "rand_uniform", FILL_UNIFORM, dt, ndim, shape,
			     lo, hi, 0, 0);
}

epj_tensor *epj_randint(epj_ctx *ctx, epj_dtype dt, int ndim,
			const int64_t *shape, int64_t lo, int64_t hi)
{
	return random_tensor(ctx, "randint", FILL_INT, dt, ndim, shape, 0, 0,
			     lo, hi);
}

/* ---- autograd fields
 * ----------------------------------------------------------
 */

void epj_tensor_set_requires_grad(epj_tensor *t, bool on)
{
	if (!t)
		return;
	char d[64];
	if (on && !epj_dtype_is_float(t->dtype)) {
		epj_log_msg(
		    EPJ_LOG_WARN,
		    "set_requires_grad: %s is not a float tensor; ignored",
		    epj_tensor_describe(t, d, sizeof d));
		return;
	}
	if (t->grad_fn) {
		/* A non-leaf's flag follows its graph (PyTorch raises). */
		epj_log_msg(EPJ_LOG_WARN,
			    "set_requires_grad: %s is not a leaf; ignored",
			    epj_tensor_describe(t, d, sizeof d));
		return;
	}
	t->requires_grad = on;
}

bool epj_tensor_requires_grad(const epj_tensor *t)
{
	return t && t->requires_grad;
}

bool epj_tensor_is_leaf(const epj_tensor *t)
{
	return t && t->grad_fn == NULL;
}

epj_tensor *epj_tensor_grad(const epj_tensor *t)
{
	return t ? t->grad : NULL;
}

void epj_tensor_set_grad(epj_tensor *t, epj_tensor *g)
{
	if (!t)
		return;
	if (g && (!same_shape(t, g) || t->dtype != g->dtype)) {
		char td[64], gd[64];
		ej_error(t->ctx,
			 same_shape(t, g) ? EPJ_ERR_DTYPE : EPJ_ERR_SHAPE,
			 "set_grad: gradient %s does not match tensor %s "
			 "(ignored)",
			 epj_tensor_describe(g, gd, sizeof gd),
			 epj_tensor_describe(t, td, sizeof td));
		return;
	}
	epj_tensor_ref(g); /* before the free: g may already be t->grad */
	epj_tensor_free(t->grad);
	t->grad = g;
}

/* PyTorch's zero_grad(set_to_none=True): drops the gradient, so the next
 * backward writes a fresh one instead of adding into zeros. */
void epj_tensor_zero_grad(epj_tensor *t)
{
	if (!t)
		return;
	epj_tensor_free(t->grad);
	t->grad = NULL;
}

epj_tensor *epj_detach(epj_ctx *ctx, epj_tensor *t)
{
	if (!t)
		return NULL;
	if (t->storage)
		return ej_tensor_view(t, t->ndim, t->shape, t->stride,
				      t->offset);
	/* Symbolic tensor: same IR value, cut from the graph. */
	epj_tensor *m =
	    ej_tensor_meta(ctx ? ctx : t->ctx, t->dtype, t->ndim, t->shape);
	if (!m)
		return NULL;
	for (int i = 0; i < t->ndim; i++)
		m->stride[i] = t->stride[i];
	m->offset = t->offset;
	m->value_id = t->value_id;
	m->trace_owner = t->trace_owner;
	return m;
}
