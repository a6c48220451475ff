/* ops_reduce.c -- reductions: sum, mean, amax, max (+ argmax), sum_all,
 * sum_to, and the row-wise softmax / log_softmax.
 *
 * Dtypes.  sum, sum_all, sum_to, amax and max accept every dtype (integers
 * sum exactly in int64, wrapping); mean, softmax and log_softmax want f32,
 * bf16 or f64.  Results keep the input dtype (max's indices are i64).
 * Float sums accumulate in double and are rounded once into the output;
 * softmax computes in f32 for f32/bf16 and in f64 for f64, subtracting the
 * row maximum first.  amax/max propagate NaN (max's index is then the first
 * NaN's); otherwise max's index is the first occurrence of the maximum.
 *
 * Kernel layout.  A reduction views its input as kept dims x reduced dims
 * (rd_plan): size-1 dims are dropped and neighbouring dims of one kind are
 * merged where the input's strides allow, so the output index q (row-major
 * over the kept dims, the order of the contiguous output) maps to an input
 * base offset, and the reduced elements hang off that base.  Three paths:
 *  - row:    one reduced dim of unit stride (reduce over the last axis of a
 *            contiguous tensor): a lane-split sum per output, OpenMP over
 *            outputs;
 *  - column: one reduced dim and a unit-stride innermost kept dim (e.g.
 *            [B,T,D] -> [D]): rows of the input are added into a block of
 *            accumulators, which streams memory and vectorises;
 *  - general: any strides (also 0): nested walk of the reduced dims.
 * softmax works row by row the same way: contiguous f32 rows in place,
 * every other layout gathered into a per-thread row buffer and scattered
 * back.
 *
 * Backward formulas use only public epj_* ops (reshape/expand, eq, sum,
 * zeros + scatter_add), so they run eagerly and while tracing alike.
 */
#include "ops_impl.h"

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Work below this many input elements stays on one thread. */
#define RD_PAR_MIN 32768
/* Accumulators per block of the column path (8 KiB of doubles). */
#define RD_BLK 1024

#define FM(fn, x) _Generic((x), float : fn##f, double : fn)(x)

/* ---- element access ------------------------------------------------------
 */

static bool is_int(epj_dtype dt)
{
	return dt == EPJ_DTYPE_I32 || dt == EPJ_DTYPE_I64;
}

/* Element i of a float-dtype array, as double. */
static inline double ld_f(const void *p, epj_dtype dt, int64_t i)
{
	switch (dt) {
	case EPJ_DTYPE_F32:
		return ((const float *)p)[i];
	case EPJ_DTYPE_BF16:
		return ej_bf16_load(((const uint16_t *)p)[i]);
	default:
		return ((const double *)p)[i];
	}
}

static inline void st_f(void *p, epj_dtype dt, int64_t i, double v)
{
	switch (dt) {
	case EPJ_DTYPE_F32:
		((float *)p)[i] = (float)v;
		break;
	case EPJ_DTYPE_BF16:
		((uint16_t *)p)[i] = ej_bf16_store((float)v);
		break;
	default:
		((double *)p)[i] = v;
	}
}

/* Element 0 of t, or NULL for a tensor without storage (empty). */
static void *data_of(const epj_tensor *t)
{
	return t->storage ? ej_data(t) : NULL;
}

static inline int64_t ld_i(const void *p, epj_dtype dt, int64_t i)
{
	return dt == EPJ_DTYPE_I32 ? ((const int32_t *)p)[i]
				   : ((const int64_t *)p)[i];
}

static inline void st_i(void *p, epj_dtype dt, int64_t i, int64_t v)
{
	if (dt == EPJ_DTYPE_I32)
		((int32_t *)p)[i] = (int32_t)(uint32_t)(uint64_t)v;
	else
		((int64_t *)p)[i] = v;
}

/* ---- plan: kept dims x reduced dims --------------------------------------
 */

typedef struct rd_plan {
	int nk, nr;
	int64_t kshape[EPJ_MAX_DIMS], kstride[EPJ_MAX_DIMS];
	int64_t rshape[EPJ_MAX_DIMS], rstride[EPJ_MAX_DIMS];
	int64_t nout, nred; /* products of kshape, rshape */
} rd_plan;

/* Appends a dim, merging it into the last one when it continues it. */
static void rd_push(int *n, int64_t *shape, int64_t *stride, int64_t size,
		    int64_t st)
{
	if (*n > 0 && stride[*n - 1] == st * size) {
		shape[*n - 1] *= size;
		stride[*n - 1] = st;
		return;
	}
	shape[*n] = size;
	stride[*n] = st;
	(*n)++;
}

static void rd_plan_init(rd_plan *p, const epj_tensor *x, const bool *red)
{
	p->nk = p->nr = 0;
	for (int d = 0; d < x->ndim; d++) {
		if (x->shape[d] == 1)
			continue;
		if (red[d])
			rd_push(&p->nr, p->rshape, p->rstride, x->shape[d],
				x->stride[d]);
		else
			rd_push(&p->nk, p->kshape, p->kstride, x->shape[d],
				x->stride[d]);
	}
	p->nout = ej_numel(p->nk, p->kshape);
	p->nred = ej_numel(p->nr, p->rshape);
}

/* Input element offset of the first reduced element of output q. */
static int64_t rd_base(const rd_plan *p, int64_t q)
{
	int64_t off = 0;
	for (int d = p->nk - 1; d >= 0; d--) {
		off += (q % p->kshape[d]) * p->kstride[d];
		q /= p->kshape[d];
	}
	return off;
}

/* Axis attribute i[0], validated by infer and normalised again here, so a
 * caller that passes -1 still gets the right axis. */
static int attr_axis(const ej_call *c)
{
	int ax = ej_axis((int)c->attrs->i[0], c->in[0]->ndim);
	return ax < 0 ? 0 : ax; /* a 0-d input reduces over its one element */
}

/* Length of x along axis (1 for a 0-d tensor). */
static int64_t axis_len(const epj_tensor *x, int axis)
{
	return x->ndim > 0 ? x->shape[axis] : 1;
}

static int64_t axis_stride(const epj_tensor *x, int axis)
{
	return x->ndim > 0 ? x->stride[axis] : 0;
}

/* ---- sums ----------------------------------------------------------------
 * Row sums use 8 independent double lanes: the compiler vectorises them
 * without -ffast-math, and the result does not depend on thread count. */

typedef double (*rowsum_fn)(const void *x, int64_t n);
typedef void (*colacc_fn)(const void *x, int64_t n, double *restrict acc);

#define LD_F32(v)  ((double)(v))
#define LD_BF16(v) ((double)ej_bf16_load(v))
#define LD_F64(v)  (v)

#define SUM_KERNELS(SFX, T, LD)                                                \
	static double rowsum_##SFX(const void *xv, int64_t n)                  \
	{                                                                      \
		const T *x = xv;                                               \
		double acc[8] = { 0 }, tail = 0;                               \
		int64_t i = 0;                                                 \
		for (; i + 8 <= n; i += 8)                                     \
			for (int l = 0; l < 8; l++)                            \
				acc[l] += LD(x[i + l]);                        \
		for (; i < n; i++)                                             \
			tail += LD(x[i]);                                      \
		return ((acc[0] + acc[4]) + (acc[1] + acc[5])) +               \
		       ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;         \
	}                                                                      \
	static void colacc_##SFX(const void *xv, int64_t n,                    \
				 double *restrict acc)                         \
	{                                                                      \
		const T *x = xv;                                               \
		for (int64_t i = 0; i < n; i++)                                \
			acc[i] += LD(x[i]);                                    \
	}

SUM_KERNELS(f32, float, LD_F32)
SUM_KERNELS(bf16, uint16_t, LD_BF16)
SUM_KERNELS(f64, double, LD_F64)

static rowsum_fn rowsum_for(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F32    ? rowsum_f32
	       : dt == EPJ_DTYPE_BF16 ? rowsum_bf16
				      : rowsum_f64;
}

static colacc_fn colacc_for(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F32    ? colacc_f32
	       : dt == EPJ_DTYPE_BF16 ? colacc_bf16
				      : colacc_f64;
}

/* Sum of the reduced elements under `base`, any strides. */
static double sum_general_f(const rd_plan *p, const char *x, epj_dtype dt,
			    int64_t base)
{
	if (p->nred == 0)
		return 0;
	if (p->nr == 0)
		return ld_f(x, dt, base);
	int nr = p->nr;
	int64_t idx[EPJ_MAX_DIMS] = { 0 };
	int64_t n = p->rshape[nr - 1], st = p->rstride[nr - 1];
	double s = 0;
	do {
		int64_t off = base + ej_offset_of(nr - 1, idx, p->rstride);
		for (int64_t r = 0; r < n; r++)
			s += ld_f(x, dt, off + r * st);
	} while (ej_index_next(nr - 1, p->rshape, idx));
	return s;
}

static int64_t sum_general_i(const rd_plan *p, const char *x, epj_dtype dt,
			     int64_t base)
{
	if (p->nred == 0)
		return 0;
	if (p->nr == 0)
		return ld_i(x, dt, base);
	int nr = p->nr;
	int64_t idx[EPJ_MAX_DIMS] = { 0 };
	int64_t n = p->rshape[nr - 1], st = p->rstride[nr - 1];
	uint64_t s = 0; /* wraps like the int64 it ends in */
	do {
		int64_t off = base + ej_offset_of(nr - 1, idx, p->rstride);
		for (int64_t r = 0; r < n; r++)
			s += (uint64_t)ld_i(x, dt, off + r * st);
	} while (ej_index_next(nr - 1, p->rshape, idx));
	return (int64_t)s;
}

/* out[q] = sum of input over the dims flagged in red, divided by div. */
static epj_status sum_kernel(const ej_call *c, const bool *red, double div)
{
	const epj_tensor *x = c->in[0];
	epj_tensor *y = c->out[0];
	rd_plan p;
	rd_plan_init(&p, x, red);
	const char *xd = data_of(x);
	void *yd = data_of(y);
	epj_dtype dt = x->dtype;
	int64_t es = (int64_t)ej_dtype_size(dt);
	bool par = p.nout * p.nred > RD_PAR_MIN;
	if (p.nout == 0)
		return EPJ_OK;

	if (is_int(dt)) {
#pragma omp parallel for schedule(static) if (par)
		for (int64_t q = 0; q < p.nout; q++)
			st_i(yd, dt, q,
			     sum_general_i(&p, xd, dt, rd_base(&p, q)));
	} else if (p.nr == 1 && p.rstride[0] == 1) { /* row path */
		rowsum_fn f = rowsum_for(dt);
		int64_t n = p.rshape[0];
#pragma omp parallel for schedule(static) if (par)
		for (int64_t q = 0; q < p.nout; q++)
			st_f(yd, dt, q, f(xd + rd_base(&p, q) * es, n) / div);
	} else if (p.nr == 1 && p.nk >= 1 && p.kstride[p.nk - 1] == 1) {
		/* column path: block of RD_BLK outputs along the innermost
		 * kept dim, input rows added in order r = 0..R-1 */
		colacc_fn f = colacc_for(dt);
		int64_t inner = p.kshape[p.nk - 1], outer = p.nout / inner;
		int64_t nblk = (inner + RD_BLK - 1) / RD_BLK;
		int64_t rn = p.rshape[0], rs = p.rstride[0];
#pragma omp parallel for schedule(static) if (par)
		for (int64_t u = 0; u < outer * nblk; u++) {
			int64_t o = u / nblk, j0 = (u % nblk) * RD_BLK;
			int64_t n = inner - j0 < RD_BLK ? inner - j0 : RD_BLK;
			int64_t q0 = o * inner + j0, base = rd_base(&p, q0);
			double acc[RD_BLK];
			for (int64_t j = 0; j < n; j++)
				acc[j] = 0;
			for (int64_t r = 0; r < rn; r++)
				f(xd + (base + r * rs) * es, n, acc);
			for (int64_t j = 0; j < n; j++)
				st_f(yd, dt, q0 + j, acc[j] / div);
		}
	} else {
#pragma omp parallel for schedule(static) if (par)
		for (int64_t q = 0; q < p.nout; q++)
			st_f(yd, dt, q,
			     sum_general_f(&p, xd, dt, rd_base(&p, q)) / div);
	}
	return EPJ_OK;
}

/* ---- max -----------------------------------------------------------------
 */

/* Max of n elements x[off + r * st] and the first r holding it; the first
 * NaN wins outright.  One typed loop per float dtype. */
#define MAX_LOOP(T, LD)                                                        \
	do {                                                                   \
		const T *p = (const T *)x + off;                               \
		for (int64_t r = 1; r < n && best == best; r++) {              \
			double v = LD(p[r * st]);                              \
			if (v > best || v != v) {                              \
				best = v;                                      \
				bi = r;                                        \
			}                                                      \
		}                                                              \
	} while (0)

static void max_row_f(const char *x, epj_dtype dt, int64_t off, int64_t st,
		      int64_t n, double *val, int64_t *arg)
{
	double best = ld_f(x, dt, off);
	int64_t bi = 0;
	if (dt == EPJ_DTYPE_F32)
		MAX_LOOP(float, LD_F32);
	else if (dt == EPJ_DTYPE_BF16)
		MAX_LOOP(uint16_t, LD_BF16);
	else
		MAX_LOOP(double, LD_F64);
	*val = best;
	*arg = bi;
}

static void max_row_i(const char *x, epj_dtype dt, int64_t off, int64_t st,
		      int64_t n, int64_t *val, int64_t *arg)
{
	int64_t best = ld_i(x, dt, off), bi = 0;
	for (int64_t r = 1; r < n; r++) {
		int64_t v = ld_i(x, dt, off + r * st);
		if (v > best) {
			best = v;
			bi = r;
		}
	}
	*val = best;
	*arg = bi;
}

/* amax (indices == NULL) or max along axis; the axis is non-empty. */
static void max_kernel(const ej_call *c, int axis, epj_tensor *indices)
{
	const epj_tensor *x = c->in[0];
	bool red[EPJ_MAX_DIMS] = { false };
	red[axis] = true;
	rd_plan p;
	rd_plan_init(&p, x, red);
	const char *xd = data_of(x);
	void *yd = data_of(c->out[0]);
	int64_t *id = indices ? data_of(indices) : NULL;
	epj_dtype dt = x->dtype;
	int64_t n = axis_len(x, axis), st = axis_stride(x, axis);
	bool par = p.nout * n > RD_PAR_MIN;
#pragma omp parallel for schedule(static) if (par)
	for (int64_t q = 0; q < p.nout; q++) {
		int64_t base = rd_base(&p, q), arg;
		if (is_int(dt)) {
			int64_t v;
			max_row_i(xd, dt, base, st, n, &v, &arg);
			st_i(yd, dt, q, v);
		} else {
			double v;
			max_row_f(xd, dt, base, st, n, &v, &arg);
			st_f(yd, dt, q, v);
		}
		if (id)
			id[q] = arg;
	}
}

/* ---- softmax -------------------------------------------------------------
 * In place is allowed (x == y).  A NaN anywhere makes the row NaN; a row of
 * -inf is NaN (as in PyTorch). */

#define SOFTMAX_ROW(T, SFX)                                                    \
	static void softmax_row_##SFX(const T *x, T *y, int64_t n, bool logsm) \
	{                                                                      \
		T m = -(T)INFINITY;                                            \
		for (int64_t i = 0; i < n; i++)                                \
			m = x[i] > m ? x[i] : m;                               \
		double s = 0;                                                  \
		if (logsm) {                                                   \
			for (int64_t i = 0; i < n; i++)                        \
				s += FM(exp, x[i] - m);                        \
			T ls = (T)log(s);                                      \
			for (int64_t i = 0; i < n; i++)                        \
				y[i] = (x[i] - m) - ls;                        \
		} else {                                                       \
			for (int64_t i = 0; i < n; i++) {                      \
				T e = FM(exp, x[i] - m);                       \
				y[i] = e;                                      \
				s += e;                                        \
			}                                                      \
			T inv = (T)(1.0 / s);                                  \
			for (int64_t i = 0; i < n; i++)                        \
				y[i] *= inv;                                   \
		}                                                              \
	}

SOFTMAX_ROW(float, f32)
SOFTMAX_ROW(double, f64)

/* n elements x[off + r * st] of an f32 or bf16 array into b (f32), and
 * back (bf16 rounded to nearest even). */
static void row_load_f32(const char *x, epj_dtype dt, int64_t off, int64_t st,
			 int64_t n, float *b)
{
	if (dt == EPJ_DTYPE_F32) {
		const float *p = (const float *)x + off;
		for (int64_t r = 0; r < n; r++)
			b[r] = p[r * st];
	} else {
		const uint16_t *p = (const uint16_t *)x + off;
		for (int64_t r = 0; r < n; r++)
			b[r] = ej_bf16_load(p[r * st]);
	}
}

static void row_store_f32(char *y, epj_dtype dt, int64_t off, int64_t st,
			  int64_t n, const float *b)
{
	if (dt == EPJ_DTYPE_F32) {
		float *p = (float *)y + off;
		for (int64_t r = 0; r < n; r++)
			p[r * st] = b[r];
	} else {
		uint16_t *p = (uint16_t *)y + off;
		for (int64_t r = 0; r < n; r++)
			p[r * st] = ej_bf16_store(b[r]);
	}
}

static epj_status softmax_kernel(epj_ctx *ctx, const ej_call *c, bool logsm)
{
	const epj_tensor *x = c->in[0];
	epj_tensor *y = c->out[0];
	int axis = attr_axis(c);
	int64_t numel = ej_numel(x->ndim, x->shape);
	if (numel == 0)
		return EPJ_OK;
	bool red[EPJ_MAX_DIMS] = { false };
	red[axis] = true;
	rd_plan p;
	rd_plan_init(&p, x, red);
	int64_t n = axis_len(x, axis), xs = axis_stride(x, axis);
	int64_t inner =
	    x->ndim > 0 ? ej_numel(x->ndim - axis - 1, x->shape + axis + 1) : 1;
	const char *xd = data_of(x);
	char *yd = data_of(y);
	epj_dtype dt = x->dtype;
	bool par = numel > RD_PAR_MIN;

	if (dt == EPJ_DTYPE_F32 && inner == 1 && (xs == 1 || n == 1)) {
#pragma omp parallel for schedule(static) if (par)
		for (int64_t q = 0; q < p.nout; q++)
			softmax_row_f32((const float *)xd + rd_base(&p, q),
					(float *)yd + q * n, n, logsm);
		return EPJ_OK;
	}

	/* General: row q is gathered into this thread's buffer (f32 or f64),
	 * computed in place, and stored at output q's row, whose elements sit
	 * `inner` apart in the contiguous output. */
	int nth = 1;
#ifdef _OPENMP
	nth = omp_get_max_threads();
#endif
	bool wide = dt == EPJ_DTYPE_F64;
	size_t es = wide ? sizeof(double) : sizeof(float);
	char *scratch = malloc((size_t)nth * (size_t)n * es);
	if (!scratch)
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "no memory for %d row buffers of %lld", nth,
				   (long long)n);
#pragma omp parallel for schedule(static) if (par)
	for (int64_t q = 0; q < p.nout; q++) {
		int tid = 0;
#ifdef _OPENMP
		tid = omp_get_thread_num();
#endif
		int64_t base = rd_base(&p, q);
		int64_t ob = (q / inner) * n * inner + q % inner;
		if (wide) {
			double *b = (double *)(scratch + (size_t)tid * n * es);
			const double *xr = (const double *)xd + base;
			double *yr = (double *)yd + ob;
			for (int64_t r = 0; r < n; r++)
				b[r] = xr[r * xs];
			softmax_row_f64(b, b, n, logsm);
			for (int64_t r = 0; r < n; r++)
				yr[r * inner] = b[r];
		} else {
			float *b = (float *)(scratch + (size_t)tid * n * es);
			row_load_f32(xd, dt, base, xs, n, b);
			softmax_row_f32(b, b, n, logsm);
			row_store_f32(yd, dt, ob, inner, n, b);
		}
	}
	free(scratch);
	return EPJ_OK;
}

/* ---- infer ---------------------------------------------------------------
 */

/* sum/mean/amax/max: i[0] = axis, i[1] = keepdim. */
static epj_status infer_axis(epj_ctx *ctx, const ej_call *c, ej_meta *out,
			     bool float_only, bool nonempty)
{
	const epj_tensor *x = c->in[0];
	epj_status st;
	if (float_only && (st = ej_check_float(ctx, c, 0)) != EPJ_OK)
		return st;
	if (!c->attrs || c->attrs->n_i < 2)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "missing axis/keepdim attributes");
	int ax;
	if ((st = ej_check_axis(ctx, c, c->attrs->i[0], x->ndim, &ax)) !=
	    EPJ_OK)
		return st;
	if (nonempty && x->ndim > 0 && x->shape[ax] == 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "cannot reduce over axis %d of size 0", ax);
	bool keep = c->attrs->i[1] != 0;
	int64_t shape[EPJ_MAX_DIMS];
	int nd = 0;
	for (int d = 0; d < x->ndim; d++) {
		if (d != ax)
			shape[nd++] = x->shape[d];
		else if (keep)
			shape[nd++] = 1;
	}
	ej_meta_set(out, x->dtype, nd, shape);
	return EPJ_OK;
}

epj_status ej_infer_SUM(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_axis(ctx, c, out, false, false);
}

epj_status ej_infer_MEAN(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_axis(ctx, c, out, true, false);
}

epj_status ej_infer_AMAX(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_axis(ctx, c, out, false, true);
}

epj_status ej_infer_MAX(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	epj_status st = infer_axis(ctx, c, out, false, true);
	if (st != EPJ_OK)
		return st;
	ej_meta_set(&out[1], EPJ_DTYPE_I64, out[0].ndim, out[0].shape);
	return EPJ_OK;
}

epj_status ej_infer_SUM_ALL(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	ej_meta_set(out, c->in[0]->dtype, 0, NULL);
	return EPJ_OK;
}

/* Target shape aligned to the input's trailing dims; each target dim equals
 * the input's or is 1. */
epj_status ej_infer_SUM_TO(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *x = c->in[0];
	int nt = c->attrs ? c->attrs->n_i : 0;
	const int64_t *t = c->attrs ? c->attrs->i : NULL;
	char buf[128];
	if (nt > x->ndim)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "cannot sum to %s: more dims than the input",
				   ej_shape_str(nt, t, buf, sizeof buf));
	int lead = x->ndim - nt;
	for (int k = 0; k < nt; k++)
		if (t[k] != x->shape[lead + k] && t[k] != 1)
			return ej_op_error(
			    ctx, c, EPJ_ERR_SHAPE,
			    "cannot sum to %s: dim %d is %lld, not %lld or 1",
			    ej_shape_str(nt, t, buf, sizeof buf), k,
			    (long long)t[k], (long long)x->shape[lead + k]);
	ej_meta_set(out, x->dtype, nt, t);
	return EPJ_OK;
}

static epj_status infer_softmax(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	epj_status st = ej_check_float(ctx, c, 0);
	if (st != EPJ_OK)
		return st;
	if (!c->attrs || c->attrs->n_i < 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "missing axis attribute");
	int ax;
	if ((st = ej_check_axis(ctx, c, c->attrs->i[0], c->in[0]->ndim, &ax)) !=
	    EPJ_OK)
		return st;
	ej_meta_from(out, c->in[0]);
	return EPJ_OK;
}

epj_status ej_infer_SOFTMAX(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_softmax(ctx, c, out);
}

epj_status ej_infer_LOG_SOFTMAX(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_softmax(ctx, c, out);
}

/* ---- kernels -------------------------------------------------------------
 */

epj_status ej_kernel_SUM(epj_ctx *ctx, const ej_call *c)
{
	bool red[EPJ_MAX_DIMS] = { false };
	red[attr_axis(c)] = true;
	return sum_kernel(c, red, 1.0);
}

epj_status ej_kernel_MEAN(epj_ctx *ctx, const ej_call *c)
{
	bool red[EPJ_MAX_DIMS] = { false };
	int ax = attr_axis(c);
	red[ax] = true;
	return sum_kernel(c, red, (double)axis_len(c->in[0], ax));
}

epj_status ej_kernel_AMAX(epj_ctx *ctx, const ej_call *c)
{
	max_kernel(c, attr_axis(c), NULL);
	return EPJ_OK;
}

epj_status ej_kernel_MAX(epj_ctx *ctx, const ej_call *c)
{
	max_kernel(c, attr_axis(c), c->out[1]);
	return EPJ_OK;
}

epj_status ej_kernel_SUM_ALL(epj_ctx *ctx, const ej_call *c)
{
	bool red[EPJ_MAX_DIMS];
	for (int d = 0; d < EPJ_MAX_DIMS; d++)
		red[d] = true;
	return sum_kernel(c, red, 1.0);
}

epj_status ej_kernel_SUM_TO(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *x = c->in[0];
	int nt = c->attrs->n_i, lead = x->ndim - nt;
	bool red[EPJ_MAX_DIMS];
	for (int d = 0; d < x->ndim; d++)
		red[d] = d < lead ||
			 (c->attrs->i[d - lead] == 1 && x->shape[d] != 1);
	return sum_kernel(c, red, 1.0);
}

epj_status ej_kernel_SOFTMAX(epj_ctx *ctx, const ej_call *c)
{
	return softmax_kernel(ctx, c, false);
}

epj_status ej_kernel_LOG_SOFTMAX(epj_ctx *ctx, const ej_call *c)
{
	return softmax_kernel(ctx, c, true);
}

/* ---- backward ------------------------------------------------------------
 * Every needed grad_in[i] is set, or on failure all are released and the
 * status of the failing op is returned. */

#define BW_ARGS                                                                \
	epj_ctx *ctx, const ej_call *c, epj_tensor *const *grad_out,           \
	    const bool *needs, epj_tensor **grad_in
/* No gradient reached the output (grad_out[0] NULL): zeros. */
#define BW_GRAD(g)                                                             \
	epj_tensor *g = grad_out[0];                                           \
	if (!needs[0])                                                         \
		return EPJ_OK;                                                 \
	if (!g) {                                                              \
		grad_in[0] = epj_zeros(ctx, c->in[0]->dtype, c->in[0]->ndim,   \
				       c->in[0]->shape);                       \
		return ej_backward_done(ctx, c, needs, grad_in);               \
	}

/* t (shaped like the reduction's output) reshaped to x's shape with 1 at
 * axis; a new reference (t itself when keepdim). */
static epj_tensor *keepdim_of(epj_ctx *ctx, epj_tensor *t, const epj_tensor *x,
			      int axis, bool keepdim)
{
	if (!t)
		return NULL;
	if (keepdim)
		return epj_tensor_ref(t);
	int64_t shape[EPJ_MAX_DIMS];
	memcpy(shape, x->shape, sizeof shape);
	shape[axis] = 1;
	return epj_reshape(ctx, t, x->ndim, shape);
}

/* t broadcast back over x's shape (a view); steals t. */
static epj_tensor *expand_to(epj_ctx *ctx, epj_tensor *t, const epj_tensor *x)
{
	epj_tensor *r = epj_expand(ctx, t, x->ndim, x->shape);
	epj_tensor_free(t);
	return r;
}

epj_status ej_backward_SUM(BW_ARGS)
{
	BW_GRAD(g);
	const epj_tensor *x = c->in[0];
	grad_in[0] = expand_to(
	    ctx, keepdim_of(ctx, g, x, attr_axis(c), c->attrs->i[1]), x);
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_MEAN(BW_ARGS)
{
	BW_GRAD(g);
	const epj_tensor *x = c->in[0];
	int ax = attr_axis(c);
	epj_tensor *s = epj_mul_scalar(ctx, g, 1.0 / (double)axis_len(x, ax));
	grad_in[0] =
	    expand_to(ctx, keepdim_of(ctx, s, x, ax, c->attrs->i[1]), x);
	epj_tensor_free(s);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* Ties share the gradient evenly: mask = (x == amax), g * mask / count. */
epj_status ej_backward_AMAX(BW_ARGS)
{
	BW_GRAD(g);
	epj_tensor *x = c->in[0];
	int ax = attr_axis(c);
	bool keep = c->attrs->i[1] != 0;
	epj_tensor *yk = keepdim_of(ctx, c->out[0], x, ax, keep);
	epj_tensor *mask = epj_eq(ctx, x, yk);
	epj_tensor *cnt = epj_sum(ctx, mask, ax, true);
	epj_tensor *gk = keepdim_of(ctx, g, x, ax, keep);
	epj_tensor *share = epj_div(ctx, gk, cnt);
	grad_in[0] = epj_mul(ctx, mask, share);
	epj_tensor_free(share);
	epj_tensor_free(gk);
	epj_tensor_free(cnt);
	epj_tensor_free(mask);
	epj_tensor_free(yk);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* The gradient goes to the argmax only: zeros + scatter_add at indices. */
epj_status ej_backward_MAX(BW_ARGS)
{
	BW_GRAD(g);
	const epj_tensor *x = c->in[0];
	if (x->ndim == 0) { /* max of one element: the identity */
		grad_in[0] = epj_tensor_ref(g);
		return ej_backward_done(ctx, c, needs, grad_in);
	}
	int ax = attr_axis(c);
	bool keep = c->attrs->i[1] != 0;
	epj_tensor *ik = keepdim_of(ctx, c->out[1], x, ax, keep);
	epj_tensor *gk = keepdim_of(ctx, g, x, ax, keep);
	epj_tensor *z = epj_zeros(ctx, g->dtype, x->ndim, x->shape);
	grad_in[0] = epj_scatter_add(ctx, z, ax, ik, gk);
	epj_tensor_free(z);
	epj_tensor_free(gk);
	epj_tensor_free(ik);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* g has `nd` dims (a suffix of x's, broadcast-compatible); reshaped with
 * leading 1s to x's rank, then expanded. */
static epj_tensor *broadcast_back(epj_ctx *ctx, epj_tensor *g,
				  const epj_tensor *x)
{
	if (g->ndim == x->ndim)
		return expand_to(ctx, epj_tensor_ref(g), x);
	int64_t shape[EPJ_MAX_DIMS];
	int lead = x->ndim - g->ndim;
	for (int d = 0; d < x->ndim; d++)
		shape[d] = d < lead ? 1 : g->shape[d - lead];
	return expand_to(ctx, epj_reshape(ctx, g, x->ndim, shape), x);
}

epj_status ej_backward_SUM_ALL(BW_ARGS)
{
	BW_GRAD(g);
	grad_in[0] = broadcast_back(ctx, g, c->in[0]);
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_SUM_TO(BW_ARGS)
{
	BW_GRAD(g);
	grad_in[0] = broadcast_back(ctx, g, c->in[0]);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* dx = y * (g - sum(g * y, axis)). */
epj_status ej_backward_SOFTMAX(BW_ARGS)
{
	BW_GRAD(g);
	epj_tensor *y = c->out[0];
	epj_tensor *gy = epj_mul(ctx, g, y);
	epj_tensor *s = epj_sum(ctx, gy, attr_axis(c), true);
	epj_tensor *d = epj_sub(ctx, g, s);
	grad_in[0] = epj_mul(ctx, y, d);
	epj_tensor_free(d);
	epj_tensor_free(s);
	epj_tensor_free(gy);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* dx = g - exp(y) * sum(g, axis). */
epj_status ej_backward_LOG_SOFTMAX(BW_ARGS)
{
	BW_GRAD(g);
	epj_tensor *s = epj_sum(ctx, g, attr_axis(c), true);
	epj_tensor *e = epj_exp(ctx, c->out[0]);
	epj_tensor *t = epj_mul(ctx, e, s);
	grad_in[0] = epj_sub(ctx, g, t);
	epj_tensor_free(t);
	epj_tensor_free(e);
	epj_tensor_free(s);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* ---- public wrappers -----------------------------------------------------
 * Axes are normalised here; an out-of-range axis is passed on unchanged so
 * that infer reports it with the op name and shapes. */

static int norm_axis(const epj_tensor *a, int axis)
{
	if (a->ndim == 0 && (axis == 0 || axis == -1))
		return 0; /* as PyTorch: a 0-d tensor has axis 0 (or -1) */
	int ax = ej_axis(axis, a->ndim);
	return ax >= 0 ? ax : axis;
}

static epj_tensor *call_axis(epj_ctx *ctx, int op, epj_tensor *a, int axis,
			     bool keepdim)
{
	if (!a) /* dispatch reports (or keeps) the error */
		return ej_call1(ctx, op, &a, 1, NULL);
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, norm_axis(a, axis));
	ej_attrs_push_i(&at, keepdim ? 1 : 0);
	return ej_call1(ctx, op, &a, 1, &at);
}

epj_tensor *epj_sum(epj_ctx *ctx, epj_tensor *a, int axis, bool keepdim)
{
	return call_axis(ctx, EJ_OP_SUM, a, axis, keepdim);
}

epj_tensor *epj_mean(epj_ctx *ctx, epj_tensor *a, int axis, bool keepdim)
{
	return call_axis(ctx, EJ_OP_MEAN, a, axis, keepdim);
}

epj_tensor *epj_amax(epj_ctx *ctx, epj_tensor *a, int axis, bool keepdim)
{
	return call_axis(ctx, EJ_OP_AMAX, a, axis, keepdim);
}

epj_status epj_max(epj_ctx *ctx, epj_tensor *a, int axis, bool keepdim,
		   epj_tensor **values, epj_tensor **indices)
{
	if (values)
		*values = NULL;
	if (indices)
		*indices = NULL;
	if (!values)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"max: values must not be NULL");
	if (!a) {
		epj_status st = epj_ctx_status(ctx);
		return st != EPJ_OK
			   ? st
			   : ej_error(ctx, EPJ_ERR_INVALID, "max: NULL input");
	}
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, norm_axis(a, axis));
	ej_attrs_push_i(&at, keepdim ? 1 : 0);
	epj_tensor *outs[2] = { NULL, NULL };
	epj_status st = ej_dispatch(ctx, EJ_OP_MAX, &a, 1, &at, outs, 2);
	if (st != EPJ_OK)
		return st;
	*values = outs[0];
	if (indices)
		*indices = outs[1];
	else
		epj_tensor_free(outs[1]);
	return EPJ_OK;
}

epj_tensor *epj_sum_all(epj_ctx *ctx, epj_tensor *a)
{
	ej_attrs at = ej_attrs_none();
	return ej_call1(ctx, EJ_OP_SUM_ALL, &a, 1, &at);
}

/* Summing to the tensor's own shape is the identity (a new reference). */
epj_tensor *epj_sum_to(epj_ctx *ctx, epj_tensor *a, int ndim,
		       const int64_t *shape)
{
	if (!a)
		return ej_call1(ctx, EJ_OP_SUM_TO, &a, 1, NULL);
	if (ndim < 0 || ndim > EPJ_MAX_DIMS || (ndim > 0 && !shape)) {
		ej_error(ctx, EPJ_ERR_SHAPE, "sum_to: bad target rank %d",
			 ndim);
		return NULL;
	}
	bool same = ndim == a->ndim;
	for (int d = 0; same && d < ndim; d++)
		same = shape[d] == a->shape[d];
	if (same)
		return epj_tensor_ref(a);
	ej_attrs at = ej_attrs_none();
	for (int d = 0; d < ndim; d++)
		ej_attrs_push_i(&at, shape[d]);
	return ej_call1(ctx, EJ_OP_SUM_TO, &a, 1, &at);
}

static epj_tensor *call_softmax(epj_ctx *ctx, int op, epj_tensor *a, int axis)
{
	if (!a)
		return ej_call1(ctx, op, &a, 1, NULL);
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, norm_axis(a, axis));
	return ej_call1(ctx, op, &a, 1, &at);
}

epj_tensor *epj_softmax(epj_ctx *ctx, epj_tensor *a, int axis)
{
	return call_softmax(ctx, EJ_OP_SOFTMAX, a, axis);
}

epj_tensor *epj_log_softmax(epj_ctx *ctx, epj_tensor *a, int axis)
{
	return call_softmax(ctx, EJ_OP_LOG_SOFTMAX, a, axis);
}
