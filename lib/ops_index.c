/* ops_index.c -- indexing ops: embedding (+ backward), index_select,
 * index_add, gather, scatter_add, topk, argsort; and their public wrappers.
 *
 * Index tensors are i32 or i64 of any strides.  Kernels first read an index
 * input into a dense int64 array (load_index), checking every value against
 * the range of the indexed axis: a negative or too large index is an
 * EPJ_ERR_INDEX naming the op, the position and the value (no wrap-around).
 * Range checks can only run in the kernel (trace mode has no data).
 *
 * Semantics (torch's):
 *  - embedding(weight [V, D], ids [*]) -> [*, D].
 *  - index_select(a, axis, index [n]) -> a with dim axis = n.
 *  - index_add(a, axis, index [n], src) -> a.clone() with src[.., i, ..]
 *    added at a[.., index[i], ..]; src is a's shape with dim axis = n.
 *  - gather(a, axis, index) -> index's shape; index has a's ndim and
 *    index.shape[d] <= a.shape[d] for d != axis.
 *  - scatter_add(a, axis, index, src): index as for gather; src must have
 *    exactly index's shape (torch allows a larger src and ignores the
 *    excess; we reject it so that gather is scatter_add's exact adjoint).
 *  - topk along the last axis: largest first, ties by lower index; NaN
 *    counts as the largest value; indices i64.  argsort: stable ascending,
 *    NaN last.
 *
 * Accumulating ops (index_add, scatter_add, embedding_backward) are
 * deterministic: every output element receives its contributions in index
 * order on one thread (threads split disjoint output columns or rows), and
 * bf16 outputs accumulate in an f32 scratch buffer rounded once at the end.
 * Gathering ops memcpy whole rows when the source is contiguous and keep a
 * general strided path otherwise.
 */
#include "ops_impl.h"

/* Below this much work a kernel runs on one thread. */
#define PAR_MIN_ELEMS (1 << 15)
/* Columns per task in the accumulating kernels. */
#define COL_BLOCK 512

/* ---- helpers ----------------------------------------------------------- */

static void copy_elem(char *d, const char *s, size_t es)
{
	switch (es) {
	case 2:
		memcpy(d, s, 2);
		break;
	case 4:
		memcpy(d, s, 4);
		break;
	case 8:
		memcpy(d, s, 8);
		break;
	default:
		memcpy(d, s, es);
	}
}

/* Index input `input` of the call as int64, each value checked (ops_impl.h) */
epj_status ej_load_index(epj_ctx *ctx, const ej_call *c, int input,
			 int64_t limit, const char *what, int64_t **out)
{
	const epj_tensor *t = c->in[input];
	int64_t n = ej_numel(t->ndim, t->shape);
	int64_t *v = malloc(sizeof *v * (size_t)(n > 0 ? n : 1));
	*out = NULL;
	if (!v)
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "out of memory reading %lld indices",
				   (long long)n);
	int64_t idx[EPJ_MAX_DIMS] = { 0 };
	const char *base = (const char *)ej_data(t);
	bool i64 = t->dtype == EPJ_DTYPE_I64;
	/* row by row over the last dim (any strides, 0 included), the rows
	 * in parallel; the range is checked as a whole, and only a value out
	 * of range takes the element walk below, which names its position */
	const int nd = t->ndim;
	const int64_t len = nd > 0 ? t->shape[nd - 1] : 1;
	const int64_t rows = len > 0 ? n / len : 0;
	const int64_t st = nd > 0 ? t->stride[nd - 1] : 0;
	int bad = 0;
#pragma omp parallel for if (n >= PAR_MIN_ELEMS) schedule(static)              \
    reduction(|                                                                \
	      : bad)
	for (int64_t r = 0; r < rows; r++) {
		int64_t rem = r, off = 0;
		for (int d = nd - 2; d >= 0; d--) {
			off += rem % t->shape[d] * t->stride[d];
			rem /= t->shape[d];
		}
		int64_t *o = v + r * len;
		if (i64) {
			const int64_t *p = (const int64_t *)base + off;
			for (int64_t k = 0; k < len; k++) {
				int64_t x = p[k * st];
				bad |= (uint64_t)x >= (uint64_t)limit;
				o[k] = x;
			}
		} else {
			const int32_t *p = (const int32_t *)base + off;
			for (int64_t k = 0; k < len; k++) {
				int64_t x = p[k * st];
				bad |= (uint64_t)x >= (uint64_t)limit;
				o[k] = x;
			}
		}
	}
	if (!bad) {
		*out = v;
		return EPJ_OK;
	}
	for (int64_t e = 0; e < n; e++) {
		int64_t off = ej_offset_of(t->ndim, idx, t->stride);
		int64_t x = i64 ? ((const int64_t *)base)[off]
				: ((const int32_t *)base)[off];
		if (x < 0 || x >= limit) {
			char pos[160];
			ej_shape_str(t->ndim, idx, pos, sizeof pos);
			free(v);
			return ej_op_error(ctx, c, EPJ_ERR_INDEX,
					   "index value %lld at position %s "
					   "(flat %lld) of input %d is out of "
					   "range [0, %lld) for %s",
					   (long long)x, pos, (long long)e,
					   input, (long long)limit, what);
		}
		v[e] = x;
		ej_index_next(t->ndim, t->shape, idx);
	}
	*out = v;
	return EPJ_OK;
}

/* Writes all elements of t (any strides) row-major into dst as dtype dt:
 * a byte copy when dt is t's dtype, else a value conversion (used for
 * bf16 -> f32, which is exact). */
static void fill_dense(void *dst, epj_dtype dt, const epj_tensor *t)
{
	int64_t n = ej_numel(t->ndim, t->shape);
	size_t ds = ej_dtype_size(dt), ts = ej_dtype_size(t->dtype);
	bool same = dt == t->dtype;
	if (n == 0)
		return;
	if (same && ej_is_contiguous(t)) {
		memcpy(dst, ej_data(t), (size_t)n * ds);
		return;
	}
	const int nd = t->ndim;
	const int64_t len = nd ? t->shape[nd - 1] : 1;
	const int64_t sl = nd ? t->stride[nd - 1] : 0, rows = n / len;
	const char *src = (const char *)ej_data(t);
#pragma omp parallel for if (n >= PAR_MIN_ELEMS) schedule(static)
	for (int64_t r = 0; r < rows; r++) {
		int64_t rem = r, off = 0;
		for (int d = nd - 2; d >= 0; d--) {
			off += (rem % t->shape[d]) * t->stride[d];
			rem /= t->shape[d];
		}
		char *dp = (char *)dst + (size_t)(r * len) * ds;
		for (int64_t k = 0; k < len; k++) {
			const char *sp = src + (size_t)(off + k * sl) * ts;
			if (same)
				copy_elem(dp + (size_t)k * ds, sp, ds);
			else
				ej_store_f64(dp + (size_t)k * ds, dt,
					     ej_load_f64(sp, t->dtype));
		}
	}
}

/* t's elements as a dense row-major array of dtype dt (ops_impl.h) */
const char *ej_dense_as(epj_ctx *ctx, const ej_call *c, const epj_tensor *t,
			epj_dtype dt, void **tmp)
{
	*tmp = NULL;
	if (t->dtype == dt && ej_is_contiguous(t))
		return (const char *)ej_data(t);
	int64_t n = ej_numel(t->ndim, t->shape);
	*tmp = malloc((size_t)(n > 0 ? n : 1) * ej_dtype_size(dt));
	if (!*tmp) {
		ej_op_error(ctx, c, EPJ_ERR_NOMEM,
			    "out of memory packing an input");
		return NULL;
	}
	fill_dense(*tmp, dt, t);
	return (const char *)*tmp;
}

/* Accumulation target of the adding kernels: the (contiguous) output
 * itself, or an f32 scratch of the output's shape when the output is bf16. */
typedef struct acc_buf {
	epj_dtype dt;  /* arithmetic dtype */
	char *data;    /* dense, the output's shape */
	void *scratch; /* owned when the output is bf16 */
} acc_buf;

static epj_status acc_begin(epj_ctx *ctx, const ej_call *c, epj_tensor *out,
			    acc_buf *b)
{
	int64_t n = ej_numel(out->ndim, out->shape);
	b->scratch = NULL;
	if (out->dtype != EPJ_DTYPE_BF16) {
		b->dt = out->dtype;
		b->data = (char *)ej_data(out);
		return EPJ_OK;
	}
	b->dt = EPJ_DTYPE_F32;
	b->scratch = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
	if (!b->scratch)
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "out of memory for an f32 accumulator");
	b->data = b->scratch;
	return EPJ_OK;
}

/* Rounds a bf16 output's scratch into it; frees the scratch. */
static void acc_end(acc_buf *b, epj_tensor *out)
{
	if (!b->scratch)
		return;
	int64_t n = ej_numel(out->ndim, out->shape);
	uint16_t *o = (uint16_t *)ej_data(out);
	const float *s = (const float *)b->scratch;
	for (int64_t i = 0; i < n; i++)
		o[i] = epj_f32_to_bf16(s[i]);
	free(b->scratch);
	b->scratch = NULL;
}

/* acc[i] += src[i], i < n, both dense of arithmetic dtype dt.  Integer
 * sums wrap (computed unsigned) rather than overflow. */
static void add_row(char *acc, const char *src, int64_t n, epj_dtype dt)
{
	switch (dt) {
	case EPJ_DTYPE_F32: {
		float *a = (float *)acc;
		const float *s = (const float *)src;
		for (int64_t i = 0; i < n; i++)
			a[i] += s[i];
		break;
	}
	case EPJ_DTYPE_F64: {
		double *a = (double *)acc;
		const double *s = (const double *)src;
		for (int64_t i = 0; i < n; i++)
			a[i] += s[i];
		break;
	}
	case EPJ_DTYPE_I32: {
		uint32_t *a = (uint32_t *)acc;
		const uint32_t *s = (const uint32_t *)src;
		for (int64_t i = 0; i < n; i++)
			a[i] += s[i];
		break;
	}
	case EPJ_DTYPE_I64: {
		uint64_t *a = (uint64_t *)acc;
		const uint64_t *s = (const uint64_t *)src;
		for (int64_t i = 0; i < n; i++)
			a[i] += s[i];
		break;
	}
	default:
		EJ_ASSERT(!"add_row: not an arithmetic dtype");
	}
}

/* acc [outer, A, inner] += src [outer, n, inner] scattered along the middle
 * axis: acc[o, idx[i], :] += src[o, i, :].  Tasks own disjoint (o, column
 * block) pairs and walk i in order, so the sums are deterministic. */
static void index_accumulate(char *acc, epj_dtype dt, int64_t outer, int64_t A,
			     int64_t inner, const int64_t *idx, int64_t n,
			     const char *src)
{
	const size_t es = ej_dtype_size(dt);
	const int64_t nb = (inner + COL_BLOCK - 1) / COL_BLOCK;
	const int64_t tasks = outer * nb;
#pragma omp parallel for if (outer * n * inner >= PAR_MIN_ELEMS && tasks > 1)  \
    schedule(static)
	for (int64_t t = 0; t < tasks; t++) {
		int64_t o = t / nb, c0 = (t % nb) * COL_BLOCK;
		int64_t cn = inner - c0 < COL_BLOCK ? inner - c0 : COL_BLOCK;
		for (int64_t i = 0; i < n; i++)
			add_row(acc + (size_t)((o * A + idx[i]) * inner + c0) *
					  es,
				src + (size_t)((o * n + i) * inner + c0) * es,
				cn, dt);
	}
}

/* out (dense, a's shape with dim axis = n) = a[.., idx[i], ..]. */
static void select_rows(char *out, const epj_tensor *a, int axis,
			const int64_t *idx, int64_t n)
{
	const size_t es = ej_dtype_size(a->dtype);
	const int nd = a->ndim;
	const int64_t outer = ej_numel(axis, a->shape), A = a->shape[axis];
	const int64_t inner = ej_numel(nd - axis - 1, a->shape + axis + 1);
	const int64_t total = outer * n * inner;
	if (total == 0)
		return;
	if (ej_is_contiguous(a)) {
		/* rows of inner elements: one memcpy each */
		const char *src = (const char *)ej_data(a);
		const size_t rb = (size_t)inner * es;
#pragma omp parallel for if (total >= PAR_MIN_ELEMS) schedule(static)
		for (int64_t t = 0; t < outer * n; t++) {
			int64_t o = t / n, i = t % n;
			memcpy(out + (size_t)t * rb,
			       src + (size_t)(o * A + idx[i]) * rb, rb);
		}
		return;
	}
	/* general strides: walk the output's rows (last dim) */
	int64_t oshape[EPJ_MAX_DIMS];
	for (int d = 0; d < nd; d++)
		oshape[d] = d == axis ? n : a->shape[d];
	const int64_t len = oshape[nd - 1], rows = total / len;
	const int64_t sl = a->stride[nd - 1];
	const char *src = (const char *)ej_data(a);
#pragma omp parallel for if (total >= PAR_MIN_ELEMS) schedule(static)
	for (int64_t r = 0; r < rows; r++) {
		int64_t rem = r, off = 0;
		for (int d = nd - 2; d >= 0; d--) {
			int64_t m = rem % oshape[d];
			rem /= oshape[d];
			off += (d == axis ? idx[m] : m) * a->stride[d];
		}
		char *dp = out + (size_t)(r * len) * es;
		for (int64_t k = 0; k < len; k++) {
			int64_t so = off + (axis == nd - 1 ? idx[k] : k) * sl;
			copy_elem(dp + (size_t)k * es, src + (size_t)so * es,
				  es);
		}
	}
}

/* Checks a gather/scatter index against a: same ndim, and no larger than a
 * on every dim but axis. */
static epj_status check_scatter_index(epj_ctx *ctx, const ej_call *c,
				      const epj_tensor *a,
				      const epj_tensor *index, int axis)
{
	char b1[160], b2[160];
	bool ok = index->ndim == a->ndim;
	for (int d = 0; ok && d < a->ndim; d++)
		ok = d == axis || index->shape[d] <= a->shape[d];
	if (!ok)
		return ej_op_error(
		    ctx, c, EPJ_ERR_SHAPE,
		    "index shape %s must have the input's %d dims and be no "
		    "larger than %s except on axis %d",
		    ej_shape_str(index->ndim, index->shape, b1, sizeof b1),
		    a->ndim, ej_shape_str(a->ndim, a->shape, b2, sizeof b2),
		    axis);
	return EPJ_OK;
}

/* Axis attribute i[0] checked against input 0 (which must have dims). */
static epj_status check_axis0(epj_ctx *ctx, const ej_call *c, int *axis)
{
	if (c->attrs->n_i < 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID, "expects an axis");
	if (c->in[0]->ndim == 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "input 0 must have at least one dim");
	return ej_check_axis(ctx, c, c->attrs->i[0], c->in[0]->ndim, axis);
}

/* ---- EMBEDDING: (weight [V, D], ids [*]) -> [*, D] --------------------- */

epj_status ej_infer_EMBEDDING(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *w = c->in[0], *ids = c->in[1];
	if (w->ndim != 2)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "weight must be 2-D [V, D]");
	if (ej_check_index_dtype(ctx, c, 1) != EPJ_OK)
		return ctx->status;
	if (ids->ndim + 1 > EPJ_MAX_DIMS)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "ids have too many dims (%d)", ids->ndim);
	ej_meta_set(out, w->dtype, ids->ndim, ids->shape);
	out->shape[out->ndim++] = w->shape[1];
	return EPJ_OK;
}

epj_status ej_kernel_EMBEDDING(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *w = c->in[0], *ids = c->in[1];
	int64_t *idx;
	if (ej_load_index(ctx, c, 1, w->shape[0], "the weight's rows", &idx) !=
	    EPJ_OK)
		return ctx->status;
	select_rows((char *)ej_data(c->out[0]), w, 0, idx,
		    ej_numel(ids->ndim, ids->shape));
	free(idx);
	return EPJ_OK;
}

epj_status ej_backward_EMBEDDING(epj_ctx *ctx, const ej_call *c,
				 epj_tensor *const *grad_out, const bool *needs,
				 epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, c->in[0]->shape[0]);
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *in[2] = { g, c->in[1] };
	epj_tensor *r = ej_call1(ctx, EJ_OP_EMBEDDING_BACKWARD, in, 2, &at);
	epj_tensor_free(g);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- EMBEDDING_BACKWARD: (grad [*, D], ids [*]) -> [V, D]; i[0] = V ---- */

epj_status ej_infer_EMBEDDING_BACKWARD(epj_ctx *ctx, const ej_call *c,
				       ej_meta *out)
{
	const epj_tensor *g = c->in[0], *ids = c->in[1];
	char b1[160];
	if (c->attrs->n_i < 1 || c->attrs->i[0] < 0)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "expects the vocabulary size V >= 0");
	if (ej_check_index_dtype(ctx, c, 1) != EPJ_OK)
		return ctx->status;
	bool ok = g->ndim == ids->ndim + 1;
	for (int d = 0; ok && d < ids->ndim; d++)
		ok = g->shape[d] == ids->shape[d];
	if (!ok)
		return ej_op_error(
		    ctx, c, EPJ_ERR_SHAPE,
		    "gradient must have shape ids %s + [D]",
		    ej_shape_str(ids->ndim, ids->shape, b1, sizeof b1));
	int64_t shape[2] = { c->attrs->i[0], g->shape[g->ndim - 1] };
	ej_meta_set(out, g->dtype, 2, shape);
	return EPJ_OK;
}

epj_status ej_kernel_EMBEDDING_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *g = c->in[0], *ids = c->in[1];
	epj_tensor *out = c->out[0];
	const int64_t V = out->shape[0], D = out->shape[1];
	int64_t *idx = NULL;
	void *tmp = NULL;
	acc_buf b;
	if (ej_load_index(ctx, c, 1, V, "the vocabulary", &idx) != EPJ_OK)
		return ctx->status;
	if (acc_begin(ctx, c, out, &b) != EPJ_OK) {
		free(idx);
		return ctx->status;
	}
	memset(b.data, 0, (size_t)(V * D) * ej_dtype_size(b.dt));
	const char *src = ej_dense_as(ctx, c, g, b.dt, &tmp);
	if (!src) {
		free(idx);
		free(b.scratch);
		return ctx->status;
	}
	index_accumulate(b.data, b.dt, 1, V, D, idx,
			 ej_numel(ids->ndim, ids->shape), src);
	acc_end(&b, out);
	free(tmp);
	free(idx);
	return EPJ_OK;
}

/* ---- INDEX_SELECT: (a, index [n]); i[0] = axis ------------------------- */

epj_status ej_infer_INDEX_SELECT(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0], *index = c->in[1];
	int axis;
	if (check_axis0(ctx, c, &axis) != EPJ_OK ||
	    ej_check_index_dtype(ctx, c, 1) != EPJ_OK)
		return ctx->status;
	if (index->ndim != 1)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "index must be 1-D, got %d dims",
				   index->ndim);
	ej_meta_from(out, a);
	out->shape[axis] = index->shape[0];
	return EPJ_OK;
}

epj_status ej_kernel_INDEX_SELECT(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *a = c->in[0];
	int axis = ej_axis((int)c->attrs->i[0], a->ndim);
	int64_t *idx;
	if (ej_load_index(ctx, c, 1, a->shape[axis], "the selected axis",
			  &idx) != EPJ_OK)
		return ctx->status;
	select_rows((char *)ej_data(c->out[0]), a, axis, idx,
		    c->in[1]->shape[0]);
	free(idx);
	return EPJ_OK;
}

epj_status ej_backward_INDEX_SELECT(epj_ctx *ctx, const ej_call *c,
				    epj_tensor *const *grad_out,
				    const bool *needs, epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	const epj_tensor *a = c->in[0];
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *z = g ? epj_zeros(ctx, g->dtype, a->ndim, a->shape) : NULL;
	epj_tensor *r = epj_index_add(ctx, z, (int)c->attrs->i[0], c->in[1], g);
	epj_tensor_free(z);
	epj_tensor_free(g);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- INDEX_ADD: (a, index [n], src); i[0] = axis ----------------------- */

epj_status ej_infer_INDEX_ADD(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0], *index = c->in[1], *src = c->in[2];
	int axis;
	char b1[160];
	if (check_axis0(ctx, c, &axis) != EPJ_OK ||
	    ej_check_index_dtype(ctx, c, 1) != EPJ_OK ||
	    ej_check_same_dtype(ctx, c, 0, 2) != EPJ_OK)
		return ctx->status;
	if (index->ndim != 1)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "index must be 1-D, got %d dims",
				   index->ndim);
	int64_t want[EPJ_MAX_DIMS];
	memcpy(want, a->shape, sizeof want[0] * (size_t)a->ndim);
	want[axis] = index->shape[0];
	bool ok = src->ndim == a->ndim;
	for (int d = 0; ok && d < a->ndim; d++)
		ok = src->shape[d] == want[d];
	if (!ok)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "src must have shape %s (input 0 with dim "
				   "%d = index length)",
				   ej_shape_str(a->ndim, want, b1, sizeof b1),
				   axis);
	ej_meta_from(out, a);
	return EPJ_OK;
}

epj_status ej_kernel_INDEX_ADD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *a = c->in[0], *src = c->in[2];
	epj_tensor *out = c->out[0];
	int axis = ej_axis((int)c->attrs->i[0], a->ndim);
	int64_t *idx = NULL;
	void *tmp = NULL;
	acc_buf b;
	if (ej_load_index(ctx, c, 1, a->shape[axis], "the target axis", &idx) !=
	    EPJ_OK)
		return ctx->status;
	if (acc_begin(ctx, c, out, &b) != EPJ_OK) {
		free(idx);
		return ctx->status;
	}
	fill_dense(b.data, b.dt, a);
	const char *s = ej_dense_as(ctx, c, src, b.dt, &tmp);
	if (!s) {
		free(idx);
		free(b.scratch);
		return ctx->status;
	}
	index_accumulate(b.data, b.dt, ej_numel(axis, a->shape), a->shape[axis],
			 ej_numel(a->ndim - axis - 1, a->shape + axis + 1), idx,
			 c->in[1]->shape[0], s);
	acc_end(&b, out);
	free(tmp);
	free(idx);
	return EPJ_OK;
}

epj_status ej_backward_INDEX_ADD(epj_ctx *ctx, const ej_call *c,
				 epj_tensor *const *grad_out, const bool *needs,
				 epj_tensor **grad_in)
{
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	if (!g)
		return ctx->status;
	epj_status st = EPJ_OK;
	if (needs[0])
		grad_in[0] = epj_tensor_ref(g);
	if (needs[2])
		st = ej_set_grad(
		    ctx, &grad_in[2],
		    epj_index_select(ctx, g, (int)c->attrs->i[0], c->in[1]));
	epj_tensor_free(g);
	return st;
}

/* ---- GATHER: (a, index) -> index's shape; i[0] = axis ------------------ */

epj_status ej_infer_GATHER(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0], *index = c->in[1];
	int axis;
	if (check_axis0(ctx, c, &axis) != EPJ_OK ||
	    ej_check_index_dtype(ctx, c, 1) != EPJ_OK ||
	    check_scatter_index(ctx, c, a, index, axis) != EPJ_OK)
		return ctx->status;
	ej_meta_set(out, a->dtype, index->ndim, index->shape);
	return EPJ_OK;
}

epj_status ej_kernel_GATHER(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *a = c->in[0], *index = c->in[1];
	int axis = ej_axis((int)c->attrs->i[0], a->ndim);
	int64_t *idx;
	if (ej_load_index(ctx, c, 1, a->shape[axis], "the gathered axis",
			  &idx) != EPJ_OK)
		return ctx->status;
	const int nd = index->ndim;
	const int64_t n = ej_numel(nd, index->shape);
	const size_t es = ej_dtype_size(a->dtype);
	const char *src = (const char *)ej_data(a);
	char *out = (char *)ej_data(c->out[0]);
	if (n > 0) {
		/* out[m] = a[m with m[axis] = index[m]], row by row */
		const int64_t len = index->shape[nd - 1], rows = n / len;
		const int64_t sl = axis == nd - 1 ? 0 : a->stride[nd - 1];
		const int64_t sa = a->stride[axis];
#pragma omp parallel for if (n >= PAR_MIN_ELEMS) schedule(static)
		for (int64_t r = 0; r < rows; r++) {
			int64_t rem = r, base = 0;
			for (int d = nd - 2; d >= 0; d--) {
				int64_t m = rem % index->shape[d];
				rem /= index->shape[d];
				if (d != axis)
					base += m * a->stride[d];
			}
			const int64_t *ix = idx + r * len;
			char *o = out + (size_t)(r * len) * es;
			/* one loop per element size: no per-element branch */
#define GATHER_ROW(T)                                                          \
	do {                                                                   \
		const T *sp = (const T *)src + base;                           \
		T *op = (T *)o;                                                \
		for (int64_t k = 0; k < len; k++)                              \
			memcpy(op + k, sp + k * sl + ix[k] * sa, sizeof(T));   \
	} while (0)
			if (es == 2)
				GATHER_ROW(uint16_t);
			else if (es == 4)
				GATHER_ROW(uint32_t);
			else if (es == 8)
				GATHER_ROW(uint64_t);
			else
				for (int64_t k = 0; k < len; k++)
					copy_elem(o + (size_t)k * es,
						  src + (size_t)(base + k * sl +
								 ix[k] * sa) *
							    es,
						  es);
#undef GATHER_ROW
		}
	}
	free(idx);
	return EPJ_OK;
}

epj_status ej_backward_GATHER(epj_ctx *ctx, const ej_call *c,
			      epj_tensor *const *grad_out, const bool *needs,
			      epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	const epj_tensor *a = c->in[0];
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *z = g ? epj_zeros(ctx, g->dtype, a->ndim, a->shape) : NULL;
	epj_tensor *r =
	    epj_scatter_add(ctx, z, (int)c->attrs->i[0], c->in[1], g);
	epj_tensor_free(z);
	epj_tensor_free(g);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- SCATTER_ADD: (a, index, src of index's shape); i[0] = axis -------- */

epj_status ej_infer_SCATTER_ADD(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0], *index = c->in[1], *src = c->in[2];
	int axis;
	char b1[160];
	if (check_axis0(ctx, c, &axis) != EPJ_OK ||
	    ej_check_index_dtype(ctx, c, 1) != EPJ_OK ||
	    ej_check_same_dtype(ctx, c, 0, 2) != EPJ_OK ||
	    check_scatter_index(ctx, c, a, index, axis) != EPJ_OK)
		return ctx->status;
	bool ok = src->ndim == index->ndim;
	for (int d = 0; ok && d < index->ndim; d++)
		ok = src->shape[d] == index->shape[d];
	if (!ok)
		return ej_op_error(
		    ctx, c, EPJ_ERR_SHAPE, "src must have the index's shape %s",
		    ej_shape_str(index->ndim, index->shape, b1, sizeof b1));
	ej_meta_from(out, a);
	return EPJ_OK;
}

/* acc[ba + idx[e] * sa] += s[e] for e = bi + j * si, j < J (one lane). */
#define SCATTER_LANE(T)                                                        \
	do {                                                                   \
		T *ap = (T *)acc;                                              \
		const T *sp = (const T *)s;                                    \
		for (int64_t j = 0; j < J; j++) {                              \
			int64_t e = bi + j * si;                               \
			ap[ba + idx[e] * sa] += sp[e];                         \
		}                                                              \
	} while (0)

epj_status ej_kernel_SCATTER_ADD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *a = c->in[0], *index = c->in[1], *src = c->in[2];
	epj_tensor *out = c->out[0];
	int axis = ej_axis((int)c->attrs->i[0], a->ndim);
	int64_t *idx = NULL;
	void *tmp = NULL;
	acc_buf b;
	if (ej_load_index(ctx, c, 1, a->shape[axis], "the scattered axis",
			  &idx) != EPJ_OK)
		return ctx->status;
	if (acc_begin(ctx, c, out, &b) != EPJ_OK) {
		free(idx);
		return ctx->status;
	}
	fill_dense(b.data, b.dt, a);
	const char *s = ej_dense_as(ctx, c, src, b.dt, &tmp);
	if (!s) {
		free(idx);
		free(b.scratch);
		return ctx->status;
	}
	const int nd = a->ndim;
	int64_t ist[EPJ_MAX_DIMS], ast[EPJ_MAX_DIMS];
	ej_contiguous_strides(nd, index->shape, ist);
	ej_contiguous_strides(nd, a->shape, ast);
	const int64_t n = ej_numel(nd, index->shape);
	const int64_t J = index->shape[axis];
	const int64_t lanes = J > 0 ? n / J : 0;
	const int64_t si = ist[axis], sa = ast[axis];
	char *acc = b.data;
	const epj_dtype dt = b.dt;
	/* One lane = all positions along axis for fixed other coordinates; it
	 * only writes a's lane with those coordinates, so lanes run in
	 * parallel and each adds in index order. */
#pragma omp parallel for if (n >= PAR_MIN_ELEMS) schedule(static)
	for (int64_t p = 0; p < lanes; p++) {
		int64_t rem = p, bi = 0, ba = 0;
		for (int d = nd - 1; d >= 0; d--) {
			if (d == axis)
				continue;
			int64_t m = rem % index->shape[d];
			rem /= index->shape[d];
			bi += m * ist[d];
			ba += m * ast[d];
		}
		switch (dt) {
		case EPJ_DTYPE_F32:
			SCATTER_LANE(float);
			break;
		case EPJ_DTYPE_F64:
			SCATTER_LANE(double);
			break;
		case EPJ_DTYPE_I32:
			SCATTER_LANE(uint32_t);
			break;
		case EPJ_DTYPE_I64:
			SCATTER_LANE(uint64_t);
			break;
		default:
			EJ_ASSERT(!"scatter_add: not an arithmetic dtype");
		}
	}
	acc_end(&b, out);
	free(tmp);
	free(idx);
	return EPJ_OK;
}

#undef SCATTER_LANE

epj_status ej_backward_SCATTER_ADD(epj_ctx *ctx, const ej_call *c,
				   epj_tensor *const *grad_out,
				   const bool *needs, epj_tensor **grad_in)
{
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	if (!g)
		return ctx->status;
	epj_status st = EPJ_OK;
	if (needs[0])
		grad_in[0] = epj_tensor_ref(g);
	if (needs[2])
		st = ej_set_grad(
		    ctx, &grad_in[2],
		    epj_gather(ctx, g, (int)c->attrs->i[0], c->in[1]));
	epj_tensor_free(g);
	return st;
}

/* ---- sorting keys (topk, argsort) ---------------------------------------
 * One entry per element of a row: its key and position.  i64 keys compare
 * in `i` (f = 0), every other dtype in `f` (i = 0), so one comparator
 * serves all dtypes without losing i64 precision.  Ties fall back to the
 * position, which makes any sort stable. */

typedef struct sort_ent {
	double f;
	int64_t i;
	int64_t pos;
} sort_ent;

/* Ascending total order on doubles with NaN above everything. */
static int cmp_f(double a, double b)
{
	bool na = isnan(a), nb = isnan(b);
	if (na || nb)
		return (int)na - (int)nb;
	return (a > b) - (a < b);
}

static int cmp_key(const sort_ent *x, const sort_ent *y)
{
	int r = cmp_f(x->f, y->f);
	return r ? r : (x->i > y->i) - (x->i < y->i);
}

static int cmp_pos(const sort_ent *x, const sort_ent *y)
{
	return (x->pos > y->pos) - (x->pos < y->pos);
}

static int cmp_asc(const void *p, const void *q)
{
	int r = cmp_key(p, q);
	return r ? r : cmp_pos(p, q);
}

static int cmp_desc(const void *p, const void *q)
{
	int r = cmp_key(q, p);
	return r ? r : cmp_pos(p, q);
}

static sort_ent load_ent(const char *p, epj_dtype dt, int64_t pos)
{
	sort_ent e = { 0.0, 0, pos };
	if (dt == EPJ_DTYPE_I64)
		memcpy(&e.i, p, sizeof e.i);
	else
		e.f = ej_load_f64(p, dt);
	return e;
}

/* ---- TOPK: (a) -> (values, indices i64) along the last axis; i[0] = k -- */

epj_status ej_infer_TOPK(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *a = c->in[0];
	if (c->attrs->n_i < 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID, "expects k");
	if (a->ndim == 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "input must have at least one dim");
	int64_t k = c->attrs->i[0], n = a->shape[a->ndim - 1];
	if (k < 1 || k > n)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "k = %lld out of range [1, %lld] (size of "
				   "the last axis)",
				   (long long)k, (long long)n);
	ej_meta_from(&out[0], a);
	out[0].shape[a->ndim - 1] = k;
	ej_meta_from(&out[1], a);
	out[1].dtype = EPJ_DTYPE_I64;
	out[1].shape[a->ndim - 1] = k;
	return EPJ_OK;
}

/* Largest k of a row, largest first, ties by lower position: insertion
 * into a sorted list (k small) or a full sort of the row. */
static void topk_row(const char *row, int64_t stride, epj_dtype dt, int64_t n,
		     int64_t k, size_t es, sort_ent *buf)
{
	if (k > 32 && k * 8 > n) {
		for (int64_t j = 0; j < n; j++)
			buf[j] =
			    load_ent(row + (size_t)(j * stride) * es, dt, j);
		qsort(buf, (size_t)n, sizeof *buf, cmp_desc);
		return;
	}
	int64_t cnt = 0;
	for (int64_t j = 0; j < n; j++) {
		sort_ent e = load_ent(row + (size_t)(j * stride) * es, dt, j);
		/* e comes after every entry so far: it moves up only past
		 * strictly smaller keys */
		if (cnt == k && cmp_key(&e, &buf[k - 1]) <= 0)
			continue;
		int64_t p = cnt < k ? cnt++ : k - 1;
		while (p > 0 && cmp_key(&e, &buf[p - 1]) > 0) {
			buf[p] = buf[p - 1];
			p--;
		}
		buf[p] = e;
	}
}

epj_status ej_kernel_TOPK(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *a = c->in[0];
	const int nd = a->ndim;
	const int64_t n = a->shape[nd - 1], k = c->attrs->i[0];
	const int64_t rows = ej_numel(nd, a->shape) / n;
	const size_t es = ej_dtype_size(a->dtype);
	const char *src = (const char *)ej_data(a);
	char *vals = (char *)ej_data(c->out[0]);
	int64_t *inds = (int64_t *)ej_data(c->out[1]);
	bool failed = false;
#pragma omp parallel if (rows * n >= PAR_MIN_ELEMS && rows > 1)
	{
		sort_ent *buf = malloc(sizeof *buf * (size_t)n);
		if (!buf) {
#pragma omp atomic write
			failed = true;
		}
#pragma omp for schedule(static)
		for (int64_t r = 0; r < rows; r++) {
			if (!buf)
				continue;
			int64_t rem = r, off = 0;
			for (int d = nd - 2; d >= 0; d--) {
				off += (rem % a->shape[d]) * a->stride[d];
				rem /= a->shape[d];
			}
			const char *row = src + (size_t)off * es;
			const int64_t sl = a->stride[nd - 1];
			topk_row(row, sl, a->dtype, n, k, es, buf);
			for (int64_t q = 0; q < k; q++) {
				copy_elem(vals + (size_t)(r * k + q) * es,
					  row + (size_t)(buf[q].pos * sl) * es,
					  es);
				inds[r * k + q] = buf[q].pos;
			}
		}
		free(buf);
	}
	if (failed)
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "out of memory for a sort buffer");
	return EPJ_OK;
}

epj_status ej_backward_TOPK(epj_ctx *ctx, const ej_call *c,
			    epj_tensor *const *grad_out, const bool *needs,
			    epj_tensor **grad_in)
{
	/* values' gradient scattered back to the selected positions */
	if (!needs[0])
		return EPJ_OK;
	const epj_tensor *a = c->in[0];
	epj_dtype dt = grad_out[0] ? grad_out[0]->dtype : a->dtype;
	epj_tensor *z = epj_zeros(ctx, dt, a->ndim, a->shape);
	if (!grad_out[0])
		return ej_set_grad(ctx, &grad_in[0], z);
	epj_tensor *r =
	    epj_scatter_add(ctx, z, a->ndim - 1, c->out[1], grad_out[0]);
	epj_tensor_free(z);
	return ej_set_grad(ctx, &grad_in[0], r);
}

/* ---- ARGSORT: (a) -> i64 of a's shape; i[0] = axis; stable ascending --- */

epj_status ej_infer_ARGSORT(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	int axis;
	if (check_axis0(ctx, c, &axis) != EPJ_OK)
		return ctx->status;
	ej_meta_from(out, c->in[0]);
	out->dtype = EPJ_DTYPE_I64;
	return EPJ_OK;
}

epj_status ej_kernel_ARGSORT(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *a = c->in[0];
	epj_tensor *out = c->out[0];
	const int nd = a->ndim;
	const int axis = ej_axis((int)c->attrs->i[0], nd);
	const int64_t A = a->shape[axis], n = ej_numel(nd, a->shape);
	const int64_t rows = A > 0 ? n / A : 0;
	const size_t es = ej_dtype_size(a->dtype);
	const char *src = (const char *)ej_data(a);
	int64_t *o = (int64_t *)ej_data(out);
	bool failed = false;
#pragma omp parallel if (n >= PAR_MIN_ELEMS && rows > 1)
	{
		sort_ent *buf = malloc(sizeof *buf * (size_t)(A > 0 ? A : 1));
		if (!buf) {
#pragma omp atomic write
			failed = true;
		}
#pragma omp for schedule(static)
		for (int64_t r = 0; r < rows; r++) {
			if (!buf)
				continue;
			int64_t rem = r, ba = 0, bo = 0;
			for (int d = nd - 1; d >= 0; d--) {
				if (d == axis)
					continue;
				int64_t m = rem % a->shape[d];
				rem /= a->shape[d];
				ba += m * a->stride[d];
				bo += m * out->stride[d];
			}
			for (int64_t j = 0; j < A; j++)
				buf[j] = load_ent(
				    src +
					(size_t)(ba + j * a->stride[axis]) * es,
				    a->dtype, j);
			qsort(buf, (size_t)A, sizeof *buf, cmp_asc);
			for (int64_t j = 0; j < A; j++)
				o[bo + j * out->stride[axis]] = buf[j].pos;
		}
		free(buf);
	}
	if (failed)
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "out of memory for a sort buffer");
	return EPJ_OK;
}

/* ---- public wrappers --------------------------------------------------- */

/* Axis normalised against a's dims for canonical attributes; an
 * out-of-range axis passes through for infer to report. */
static ej_attrs axis_attrs(const epj_tensor *a, int axis)
{
	ej_attrs at = ej_attrs_none();
	int ax = ej_axis(axis, a->ndim);
	ej_attrs_push_i(&at, ax >= 0 ? ax : axis);
	return at;
}

epj_tensor *epj_embedding(epj_ctx *ctx, epj_tensor *weight, epj_tensor *ids)
{
	if (!weight || !ids)
		return NULL;
	epj_tensor *in[2] = { weight, ids };
	return ej_call1(ctx, EJ_OP_EMBEDDING, in, 2, NULL);
}

epj_tensor *epj_index_select(epj_ctx *ctx, epj_tensor *a, int axis,
			     epj_tensor *index)
{
	if (!a || !index)
		return NULL;
	epj_tensor *in[2] = { a, index };
	ej_attrs at = axis_attrs(a, axis);
	return ej_call1(ctx, EJ_OP_INDEX_SELECT, in, 2, &at);
}

epj_tensor *epj_index_add(epj_ctx *ctx, epj_tensor *a, int axis,
			  epj_tensor *index, epj_tensor *src)
{
	if (!a || !index || !src)
		return NULL;
	epj_tensor *in[3] = { a, index, src };
	ej_attrs at = axis_attrs(a, axis);
	return ej_call1(ctx, EJ_OP_INDEX_ADD, in, 3, &at);
}

epj_tensor *epj_gather(epj_ctx *ctx, epj_tensor *a, int axis, epj_tensor *index)
{
	if (!a || !index)
		return NULL;
	epj_tensor *in[2] = { a, index };
	ej_attrs at = axis_attrs(a, axis);
	return ej_call1(ctx, EJ_OP_GATHER, in, 2, &at);
}

epj_tensor *epj_scatter_add(epj_ctx *ctx, epj_tensor *a, int axis,
			    epj_tensor *index, epj_tensor *src)
{
	if (!a || !index || !src)
		return NULL;
	epj_tensor *in[3] = { a, index, src };
	ej_attrs at = axis_attrs(a, axis);
	return ej_call1(ctx, EJ_OP_SCATTER_ADD, in, 3, &at);
}

epj_status epj_topk(epj_ctx *ctx, epj_tensor *a, int64_t k, epj_tensor **values,
		    epj_tensor **indices)
{
	if (!values || !indices)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"topk: NULL values or indices pointer");
	*values = *indices = NULL;
	if (!a)
		return ctx->status != EPJ_OK ? ctx->status : EPJ_ERR_INVALID;
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, k);
	epj_tensor *outs[2];
	epj_status st = ej_dispatch(ctx, EJ_OP_TOPK, &a, 1, &at, outs, 2);
	if (st != EPJ_OK)
		return st;
	*values = outs[0];
	*indices = outs[1];
	return EPJ_OK;
}

epj_tensor *epj_argsort(epj_ctx *ctx, epj_tensor *a, int axis)
{
	if (!a)
		return NULL;
	ej_attrs at = axis_attrs(a, axis);
	return ej_call1(ctx, EJ_OP_ARGSORT, &a, 1, &at);
}
