/* ops_moe.c -- fused MoE ops: router (softmax + top-k + renormalisation),
 * token permutation, unpermutation + weighted combine, grouped expert GEMM,
 * SwiGLU; each with its backward op, and their wrappers (ops_moe.h).
 *
 * These are the ops of the eager AutoEP layer (runtime/autoep.c): one
 * dispatch each instead of a chain of generic ops, in the manner of
 * Megatron's fused permute / unpermute.  Their backward formulas call one
 * backward op each (MOE_*_BACKWARD, SWIGLU_BACKWARD; the grouped GEMM's
 * backward is a grouped GEMM and MOE_GROUPED_MM_WGRAD), so a backward node
 * is one or two launches too.
 *
 * Precision: routing math (softmax, top-k selection on the logits, the
 * renormalisation and their backward) runs in double and is stored in the
 * routing dtype (f32, f64 for f64 logits).  Permutation copies rows.  The
 * combine accumulates in the routing weights' dtype.  GEMMs go through
 * ej_linalg_gemm (lib/ops_linalg.c: sgemm for f32 and bf16, dgemm for
 * f64); bf16 operands are converted to f32 once per call and the result is
 * rounded once.  SwiGLU computes in f32 (f64 for f64) and rounds once.
 *
 * Index inputs (idx, pos, counts) are i64 or i32 of any strides and are
 * checked against their ranges in the kernels (EPJ_ERR_INDEX naming the op
 * and the value).  Float inputs may have any strides: a non-contiguous one
 * is copied to a dense temporary first.
 */
#include "ops_moe.h"
#include "ops_impl.h"
#include "ops_vexp.h"

#include <stdlib.h>

/* Below this much work a kernel runs on one thread. */
#define PAR_MIN_ELEMS (1 << 15)
/* Elements per f32 scratch chunk of the f32 / bf16 fast paths. */
#define CHUNK 512

static bool f32_or_bf16(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F32 || dt == EPJ_DTYPE_BF16;
}

/* len elements from element off of the dense f32 or bf16 array p, as f32 */
static inline void chunk_load(const void *p, epj_dtype dt, int64_t off,
			      int64_t len, float *dst)
{
	if (dt == EPJ_DTYPE_F32)
		memcpy(dst, (const float *)p + off, sizeof *dst * (size_t)len);
	else
		ej_cvt_bf16_to_f32((const uint16_t *)p + off, dst, len);
}

static inline void chunk_store(const float *src, void *p, epj_dtype dt,
			       int64_t off, int64_t len)
{
	if (dt == EPJ_DTYPE_F32)
		memcpy((float *)p + off, src, sizeof *src * (size_t)len);
	else
		ej_cvt_f32_to_bf16(src, (uint16_t *)p + off, len);
}

/* acc[0..len) += a * x[0..len) (f32) */
EJ_ISA_CLONES static void axpy_f32(float a, const float *restrict x,
				   float *restrict acc, int64_t len)
{
#pragma omp simd
	for (int64_t i = 0; i < len; i++)
		acc[i] += a * x[i];
}

/* ---- helpers ------------------------------------------------------------ */

static inline double ld(const void *p, epj_dtype dt, int64_t i)
{
	switch (dt) {
	case EPJ_DTYPE_F32:
		return ((const float *)p)[i];
	case EPJ_DTYPE_BF16:
		return ej_bf16_load(((const uint16_t *)p)[i]);
	case EPJ_DTYPE_F64:
		return ((const double *)p)[i];
	default:
		return ej_load_f64(
		    (const char *)p + (size_t)i * ej_dtype_size(dt), dt);
	}
}

static inline void st(void *p, epj_dtype dt, int64_t i, double v)
{
	switch (dt) {
	case EPJ_DTYPE_F32:
		((float *)p)[i] = (float)v;
		break;
	case EPJ_DTYPE_BF16:
		((uint16_t *)p)[i] = ej_bf16_store((float)v);
		break;
	case EPJ_DTYPE_F64:
		((double *)p)[i] = v;
		break;
	default:
		ej_store_f64((char *)p + (size_t)i * ej_dtype_size(dt), dt, v);
	}
}

/* t's elements as a dense row-major array of t's dtype: t's own storage
 * when contiguous, else a copy returned in *owned (free() it). */
static epj_status dense(epj_ctx *ctx, const ej_call *c, const epj_tensor *t,
			const void **p, void **owned)
{
	*owned = NULL;
	if (ej_is_contiguous(t)) {
		*p = ej_data(t);
		return EPJ_OK;
	}
	*p = ej_dense_as(ctx, c, t, t->dtype, owned);
	return *p ? EPJ_OK : EPJ_ERR_NOMEM;
}

/* pos[0..R) (each in range already) must hit every row once. */
static epj_status check_perm(epj_ctx *ctx, const ej_call *c, const int64_t *pos,
			     int64_t R)
{
	unsigned char *seen = calloc((size_t)(R > 0 ? R : 1), 1);
	if (!seen)
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
	for (int64_t i = 0; i < R; i++) {
		if (seen[pos[i]]) {
			free(seen);
			return ej_op_error(ctx, c, EPJ_ERR_INDEX,
					   "row position %lld appears twice "
					   "(positions must be a permutation "
					   "of [0, %lld), as moe_permute "
					   "makes them)",
					   (long long)pos[i], (long long)R);
		}
		seen[pos[i]] = 1;
	}
	free(seen);
	return EPJ_OK;
}

static epj_status check_index(epj_ctx *ctx, const ej_call *c, int input)
{
	return ej_check_index_dtype(ctx, c, input);
}

static bool shape_is(const epj_tensor *t, int nd, const int64_t *shape)
{
	if (t->ndim != nd)
		return false;
	for (int i = 0; i < nd; i++)
		if (t->shape[i] != shape[i])
			return false;
	return true;
}

static epj_dtype route_dtype(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
}

static epj_status bw_fail(epj_ctx *ctx, const char *op)
{
	epj_status s = epj_ctx_status(ctx);
	return s != EPJ_OK ? s
			   : ej_error(ctx, EPJ_ERR_STATE,
				      "%s backward: an op failed", op);
}

/* ---- MOE_ROUTE: (logits [N, E]) -> (w [N, k], idx [N, k] i64);
 * i[0] = k, i[1] = norm, i[2] = fixed ------------------------------------ */

static epj_status route_attrs(epj_ctx *ctx, const ej_call *c, int64_t E,
			      int64_t *k)
{
	if (c->attrs->n_i < 3)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "expects attributes k, norm, fixed");
	*k = c->attrs->i[0];
	if (*k < 1 || *k > E)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "k = %lld out of range [1, %lld] (number "
				   "of experts)",
				   (long long)*k, (long long)E);
	return EPJ_OK;
}

epj_status ej_infer_MOE_ROUTE(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *l = c->in[0];
	epj_status s = ej_check_float(ctx, c, 0);
	if (s != EPJ_OK)
		return s;
	if (l->ndim != 2 || l->shape[1] < 1)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "logits must be [N, E] with E >= 1");
	int64_t k;
	if ((s = route_attrs(ctx, c, l->shape[1], &k)) != EPJ_OK)
		return s;
	int64_t sh[2] = { l->shape[0], k };
	ej_meta_set(&out[0], route_dtype(l->dtype), 2, sh);
	ej_meta_set(&out[1], EPJ_DTYPE_I64, 2, sh);
	return EPJ_OK;
}

/* a ranks above b: larger, NaN above everything, ties to the lower index */
static bool route_above(double a, int64_t ia, double b, int64_t ib)
{
	bool na = isnan(a), nb = isnan(b);
	if (na || nb)
		return na && (!nb || ia < ib);
	return a > b || (a == b && ia < ib);
}

/* softmax of one row of E logits (row-major in l, dtype dt) into p */
static void softmax_row(const void *l, epj_dtype dt, int64_t off, int64_t E,
			double *p)
{
	double m = -INFINITY;
	for (int64_t e = 0; e < E; e++) {
		p[e] = ld(l, dt, off + e);
		if (p[e] > m)
			m = p[e];
	}
	double s = 0;
	for (int64_t e = 0; e < E; e++) {
		p[e] = exp(p[e] - m);
		s += p[e];
	}
	for (int64_t e = 0; e < E; e++)
		p[e] /= s;
}

epj_status ej_kernel_MOE_ROUTE(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *lt = c->in[0];
	const int64_t N = lt->shape[0], E = lt->shape[1], k = c->attrs->i[0];
	const bool norm = c->attrs->i[1] != 0, fixed = c->attrs->i[2] != 0;
	const epj_dtype wdt = c->out[0]->dtype;
	void *wo = ej_data(c->out[0]);
	int64_t *io = ej_data(c->out[1]);
	const void *l;
	void *owned;
	epj_status s = dense(ctx, c, lt, &l, &owned);
	if (s != EPJ_OK)
		return s;
	double *p = malloc(sizeof *p * (size_t)E);
	double *sel = malloc(sizeof *sel * (size_t)k);
	if (!p || !sel) {
		free(p);
		free(sel);
		free(owned);
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
	}
	for (int64_t n = 0; n < N; n++) {
		softmax_row(l, lt->dtype, n * E, E, p);
		int64_t *ix = io + n * k;
		if (fixed) {
			for (int64_t j = 0; j < k; j++)
				ix[j] = (n * k + j) % E;
		} else {
			/* insertion into the sorted top list, on the logits
			 * (softmax is monotonic; ties keep the lower expert) */
			int64_t cnt = 0;
			for (int64_t e = 0; e < E; e++) {
				double v = ld(l, lt->dtype, n * E + e);
				if (cnt == k &&
				    !route_above(v, e, sel[k - 1], ix[k - 1]))
					continue;
				int64_t q = cnt < k ? cnt++ : k - 1;
				while (q > 0 && route_above(v, e, sel[q - 1],
							    ix[q - 1])) {
					sel[q] = sel[q - 1];
					ix[q] = ix[q - 1];
					q--;
				}
				sel[q] = v;
				ix[q] = e;
			}
		}
		double sum = 0;
		for (int64_t j = 0; j < k; j++)
			sum += p[ix[j]];
		for (int64_t j = 0; j < k; j++)
			st(wo, wdt, n * k + j,
			   norm ? p[ix[j]] / sum : p[ix[j]]);
	}
	free(p);
	free(sel);
	free(owned);
	return EPJ_OK;
}

epj_status ej_backward_MOE_ROUTE(epj_ctx *ctx, const ej_call *c,
				 epj_tensor *const *grad_out, const bool *needs,
				 epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	epj_tensor *l = c->in[0];
	if (!grad_out[0]) /* only the indices were used */
		return ej_set_grad(ctx, &grad_in[0],
				   epj_zeros(ctx, l->dtype, 2, l->shape));
	epj_tensor *in[3] = { grad_out[0], l, c->out[1] };
	grad_in[0] = ej_call1(ctx, EJ_OP_MOE_ROUTE_BACKWARD, in, 3, c->attrs);
	return grad_in[0] ? EPJ_OK : bw_fail(ctx, "moe_route");
}

/* ---- MOE_ROUTE_BACKWARD: (grad_w [N, k], logits [N, E], idx [N, k]) ->
 * dlogits [N, E] (logits' dtype); attrs as MOE_ROUTE -------------------- */

epj_status ej_infer_MOE_ROUTE_BACKWARD(epj_ctx *ctx, const ej_call *c,
				       ej_meta *out)
{
	const epj_tensor *g = c->in[0], *l = c->in[1], *ix = c->in[2];
	epj_status s = ej_check_float(ctx, c, 0);
	if (s == EPJ_OK)
		s = ej_check_float(ctx, c, 1);
	if (s == EPJ_OK)
		s = check_index(ctx, c, 2);
	if (s != EPJ_OK)
		return s;
	if (l->ndim != 2 || l->shape[1] < 1)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "logits must be [N, E] with E >= 1");
	int64_t k;
	if ((s = route_attrs(ctx, c, l->shape[1], &k)) != EPJ_OK)
		return s;
	int64_t sh[2] = { l->shape[0], k };
	if (!shape_is(g, 2, sh) || !shape_is(ix, 2, sh))
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "grad and indices must be [%lld, %lld]",
				   (long long)sh[0], (long long)sh[1]);
	ej_meta_from(out, l);
	return EPJ_OK;
}

/* With p = softmax(l), s_j = p[idx_j] and w_j = s_j / S (S = sum s_j) when
 * norm, else w_j = s_j:
 *   ds_j = (dw_j - sum_i dw_i w_i) / S   (norm)   or   dw_j,
 *   dl_e = p_e (dp_e - sum_j ds_j s_j)   with dp_e = sum_{j: idx_j = e} ds_j.
 */
epj_status ej_kernel_MOE_ROUTE_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *gt = c->in[0], *lt = c->in[1];
	const int64_t N = lt->shape[0], E = lt->shape[1], k = c->attrs->i[0];
	const bool norm = c->attrs->i[1] != 0;
	epj_tensor *o = c->out[0];
	const void *g, *l;
	void *og = NULL, *ol = NULL;
	int64_t *ix = NULL;
	double *p = NULL, *dp = NULL, *ds = NULL;
	epj_status s = dense(ctx, c, gt, &g, &og);
	if (s == EPJ_OK)
		s = dense(ctx, c, lt, &l, &ol);
	if (s == EPJ_OK)
		s = ej_load_index(ctx, c, 2, E, "the experts", &ix);
	if (s != EPJ_OK)
		goto done;
	p = malloc(sizeof *p * (size_t)E);
	dp = malloc(sizeof *dp * (size_t)E);
	ds = malloc(sizeof *ds * (size_t)k);
	if (!p || !dp || !ds) {
		s = ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
		goto done;
	}
	for (int64_t n = 0; n < N; n++) {
		const int64_t *r = ix + n * k;
		softmax_row(l, lt->dtype, n * E, E, p);
		double S = 0, gw = 0;
		for (int64_t j = 0; j < k; j++)
			S += p[r[j]];
		for (int64_t j = 0; j < k; j++)
			gw += ld(g, gt->dtype, n * k + j) * p[r[j]] / S;
		double dot = 0;
		for (int64_t e = 0; e < E; e++)
			dp[e] = 0;
		for (int64_t j = 0; j < k; j++) {
			double dw = ld(g, gt->dtype, n * k + j);
			ds[j] = norm ? (dw - gw) / S : dw;
			dp[r[j]] += ds[j];
			dot += ds[j] * p[r[j]];
		}
		for (int64_t e = 0; e < E; e++)
			st(ej_data(o), o->dtype, n * E + e,
			   p[e] * (dp[e] - dot));
	}
done:
	free(og);
	free(ol);
	free(ix);
	free(p);
	free(dp);
	free(ds);
	return s;
}

/* ---- MOE_PERMUTE: (x [N, H], idx [N, k]) -> (x_sorted [N k, H], pos [N, k]
 * i64, counts [E] i64); i[0] = E ----------------------------------------- */

epj_status ej_infer_MOE_PERMUTE(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *x = c->in[0], *ix = c->in[1];
	epj_status s = ej_check_float(ctx, c, 0);
	if (s == EPJ_OK)
		s = check_index(ctx, c, 1);
	if (s != EPJ_OK)
		return s;
	if (c->attrs->n_i < 1 || c->attrs->i[0] < 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "expects the number of experts (>= 1)");
	if (x->ndim != 2 || ix->ndim != 2 || ix->shape[0] != x->shape[0])
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "expects x [N, H] and indices [N, k]");
	int64_t sh[2] = { x->shape[0] * ix->shape[1], x->shape[1] };
	ej_meta_set(&out[0], x->dtype, 2, sh);
	ej_meta_set(&out[1], EPJ_DTYPE_I64, 2, ix->shape);
	ej_meta_set(&out[2], EPJ_DTYPE_I64, 1, &c->attrs->i[0]);
	return EPJ_OK;
}

void ej_moe_positions(const int64_t *idx, int64_t R, int64_t E, int64_t *counts,
		      int64_t *off, int64_t *pos)
{
	/* counting sort of the slots by expert: stable */
	for (int64_t e = 0; e < E; e++)
		counts[e] = 0;
	for (int64_t r = 0; r < R; r++)
		counts[idx[r]]++;
	for (int64_t e = 0, o = 0; e < E; e++) {
		off[e] = o;
		o += counts[e];
	}
	for (int64_t r = 0; r < R; r++)
		pos[r] = off[idx[r]]++;
}

epj_status ej_kernel_MOE_PERMUTE(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *xt = c->in[0];
	const int64_t N = xt->shape[0], H = xt->shape[1];
	const int64_t k = c->in[1]->shape[1], R = N * k, E = c->attrs->i[0];
	int64_t *pos = ej_data(c->out[1]), *counts = ej_data(c->out[2]);
	int64_t *ix = NULL, *off = NULL;
	const void *x;
	void *owned = NULL;
	epj_status s = ej_load_index(ctx, c, 1, E, "the experts", &ix);
	if (s == EPJ_OK)
		s = dense(ctx, c, xt, &x, &owned);
	if (s != EPJ_OK)
		goto done;
	off = malloc(sizeof *off * (size_t)E);
	if (!off) {
		s = ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
		goto done;
	}
	ej_moe_positions(ix, R, E, counts, off, pos);
	const size_t row = (size_t)H * ej_dtype_size(xt->dtype);
	char *y = ej_data(c->out[0]);
#pragma omp parallel for schedule(static) if (R * H >= PAR_MIN_ELEMS)
	for (int64_t r = 0; r < R; r++)
		memcpy(y + (size_t)pos[r] * row,
		       (const char *)x + (size_t)(r / k) * row, row);
done:
	free(ix);
	free(off);
	free(owned);
	return s;
}

epj_status ej_backward_MOE_PERMUTE(epj_ctx *ctx, const ej_call *c,
				   epj_tensor *const *grad_out,
				   const bool *needs, epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	const epj_tensor *x = c->in[0];
	if (!grad_out[0])
		return ej_set_grad(ctx, &grad_in[0],
				   epj_zeros(ctx, x->dtype, 2, x->shape));
	epj_tensor *in[2] = { grad_out[0], c->out[1] };
	grad_in[0] = ej_call1(ctx, EJ_OP_MOE_PERMUTE_BACKWARD, in, 2, NULL);
	return grad_in[0] ? EPJ_OK : bw_fail(ctx, "moe_permute");
}

/* ---- MOE_PERMUTE_BACKWARD: (grad [R, H], pos [N, k]) -> dx [N, H]:
 * dx[n] = sum_j grad[pos[n, j]] (summed in f32, f64 for f64) ------------ */

epj_status ej_infer_MOE_PERMUTE_BACKWARD(epj_ctx *ctx, const ej_call *c,
					 ej_meta *out)
{
	const epj_tensor *g = c->in[0], *p = c->in[1];
	epj_status s = ej_check_float(ctx, c, 0);
	if (s == EPJ_OK)
		s = check_index(ctx, c, 1);
	if (s != EPJ_OK)
		return s;
	if (g->ndim != 2 || p->ndim != 2 ||
	    g->shape[0] != p->shape[0] * p->shape[1])
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "expects grad [N k, H] and positions [N, "
				   "k]");
	int64_t sh[2] = { p->shape[0], g->shape[1] };
	ej_meta_set(out, g->dtype, 2, sh);
	return EPJ_OK;
}

epj_status ej_kernel_MOE_PERMUTE_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *gt = c->in[0];
	const int64_t N = c->in[1]->shape[0], k = c->in[1]->shape[1];
	const int64_t H = gt->shape[1], R = N * k;
	epj_tensor *o = c->out[0];
	int64_t *pos = NULL;
	const void *g;
	void *owned = NULL;
	epj_status s = ej_load_index(ctx, c, 1, R, "the rows", &pos);
	if (s == EPJ_OK)
		s = dense(ctx, c, gt, &g, &owned);
	if (s != EPJ_OK)
		goto done;
	const bool f64 = gt->dtype == EPJ_DTYPE_F64;
	const epj_dtype dt = gt->dtype;
	if (f32_or_bf16(dt)) {
		/* the same sums (slot order, f32) on f32 chunks */
#pragma omp parallel for schedule(static) if (R * H >= PAR_MIN_ELEMS)
		for (int64_t n = 0; n < N; n++) {
			float acc[CHUNK], row[CHUNK];
			for (int64_t h0 = 0; h0 < H; h0 += CHUNK) {
				int64_t len = H - h0 < CHUNK ? H - h0 : CHUNK;
				memset(acc, 0, sizeof acc);
				for (int64_t j = 0; j < k; j++) {
					chunk_load(g, dt,
						   pos[n * k + j] * H + h0, len,
						   row);
					axpy_f32(1.0f, row, acc, len);
				}
				chunk_store(acc, ej_data(o), dt, n * H + h0,
					    len);
			}
		}
		goto done;
	}
	/* every output row is one token's: rows split over threads */
#pragma omp parallel for schedule(static) if (R * H >= PAR_MIN_ELEMS)
	for (int64_t n = 0; n < N; n++) {
		const int64_t *p = pos + n * k;
		for (int64_t h = 0; h < H; h++) {
			double a = 0;
			float af = 0;
			for (int64_t j = 0; j < k; j++) {
				double v = ld(g, dt, p[j] * H + h);
				if (f64)
					a += v;
				else
					af += (float)v;
			}
			st(ej_data(o), o->dtype, n * H + h, f64 ? a : af);
		}
	}
done:
	free(pos);
	free(owned);
	return s;
}

/* ---- MOE_UNPERMUTE: (y [R, H], w [N, k], pos [N, k]) -> out [N, H] ------ */

epj_status ej_infer_MOE_UNPERMUTE(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *y = c->in[0], *w = c->in[1], *p = c->in[2];
	epj_status s = ej_check_float(ctx, c, 0);
	if (s == EPJ_OK)
		s = ej_check_float(ctx, c, 1);
	if (s == EPJ_OK)
		s = check_index(ctx, c, 2);
	if (s != EPJ_OK)
		return s;
	if (y->ndim != 2 || !shape_is(p, 2, w->shape) ||
	    y->shape[0] != w->shape[0] * w->shape[1])
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "expects y [N k, H], weights [N, k] and "
				   "positions [N, k]");
	int64_t sh[2] = { w->shape[0], y->shape[1] };
	ej_meta_set(out, y->dtype, 2, sh);
	return EPJ_OK;
}

epj_status ej_kernel_MOE_UNPERMUTE(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *yt = c->in[0], *wt = c->in[1];
	const int64_t N = wt->shape[0], k = wt->shape[1], H = yt->shape[1];
	epj_tensor *o = c->out[0];
	int64_t *pos = NULL;
	const void *y, *w;
	void *oy = NULL, *ow = NULL;
	epj_status s = ej_load_index(ctx, c, 2, N * k, "the rows", &pos);
	if (s == EPJ_OK)
		s = check_perm(ctx, c, pos, N * k);
	if (s == EPJ_OK)
		s = dense(ctx, c, yt, &y, &oy);
	if (s == EPJ_OK)
		s = dense(ctx, c, wt, &w, &ow);
	if (s != EPJ_OK)
		goto done;
	const bool f64 = wt->dtype == EPJ_DTYPE_F64;
	const epj_dtype ydt = yt->dtype, wdt = wt->dtype;
	if (f32_or_bf16(ydt) && wdt == EPJ_DTYPE_F32) {
		/* the same sums (slot order, f32) on f32 chunks */
		const float *wf = w;
#pragma omp parallel for schedule(static) if (N * k * H >= PAR_MIN_ELEMS)
		for (int64_t n = 0; n < N; n++) {
			float acc[CHUNK], row[CHUNK];
			for (int64_t h0 = 0; h0 < H; h0 += CHUNK) {
				int64_t len = H - h0 < CHUNK ? H - h0 : CHUNK;
				memset(acc, 0, sizeof acc);
				for (int64_t j = 0; j < k; j++) {
					chunk_load(y, ydt,
						   pos[n * k + j] * H + h0, len,
						   row);
					axpy_f32(wf[n * k + j], row, acc, len);
				}
				chunk_store(acc, ej_data(o), o->dtype,
					    n * H + h0, len);
			}
		}
		goto done;
	}
	/* every output row is one token's: rows split over threads */
#pragma omp parallel for schedule(static) if (N * k * H >= PAR_MIN_ELEMS)
	for (int64_t n = 0; n < N; n++) {
		const int64_t *p = pos + n * k;
		for (int64_t h = 0; h < H; h++) {
			double a = 0;
			float af = 0;
			for (int64_t j = 0; j < k; j++) {
				double wj = ld(w, wdt, n * k + j);
				double v = ld(y, ydt, p[j] * H + h);
				if (f64)
					a += wj * v;
				else
					af += (float)wj * (float)v;
			}
			st(ej_data(o), o->dtype, n * H + h, f64 ? a : af);
		}
	}
done:
	free(pos);
	free(oy);
	free(ow);
	return s;
}

epj_status ej_backward_MOE_UNPERMUTE(epj_ctx *ctx, const ej_call *c,
				     epj_tensor *const *grad_out,
				     const bool *needs, epj_tensor **grad_in)
{
	if (!needs[0] && !needs[1])
		return EPJ_OK;
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *in[4] = { g, c->in[0], c->in[1], c->in[2] };
	epj_tensor *outs[2] = { NULL, NULL };
	epj_status s = g ? ej_dispatch(ctx, EJ_OP_MOE_UNPERMUTE_BACKWARD, in, 4,
				       NULL, outs, 2)
			 : bw_fail(ctx, "moe_unpermute");
	epj_tensor_free(g);
	if (s != EPJ_OK)
		return s;
	for (int i = 0; i < 2; i++) {
		if (needs[i])
			grad_in[i] = outs[i];
		else
			epj_tensor_free(outs[i]);
	}
	return EPJ_OK;
}

/* ---- MOE_UNPERMUTE_BACKWARD: (grad [N, H], y [R, H], w [N, k], pos) ->
 * (dy [R, H] y's dtype, dw [N, k] w's dtype):
 *   dy[pos[n, j]] = w[n, j] grad[n],  dw[n, j] = grad[n] . y[pos[n, j]] -- */

epj_status ej_infer_MOE_UNPERMUTE_BACKWARD(epj_ctx *ctx, const ej_call *c,
					   ej_meta *out)
{
	const epj_tensor *g = c->in[0], *y = c->in[1], *w = c->in[2],
			 *p = c->in[3];
	epj_status s = ej_check_float(ctx, c, 0);
	for (int i = 1; s == EPJ_OK && i < 3; i++)
		s = ej_check_float(ctx, c, i);
	if (s == EPJ_OK)
		s = check_index(ctx, c, 3);
	if (s != EPJ_OK)
		return s;
	if (y->ndim != 2 || !shape_is(p, 2, w->shape) ||
	    y->shape[0] != w->shape[0] * w->shape[1] || g->ndim != 2 ||
	    g->shape[0] != w->shape[0] || g->shape[1] != y->shape[1])
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "expects grad [N, H], y [N k, H], weights "
				   "[N, k] and positions [N, k]");
	ej_meta_from(&out[0], y);
	ej_meta_from(&out[1], w);
	return EPJ_OK;
}

epj_status ej_kernel_MOE_UNPERMUTE_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *gt = c->in[0], *yt = c->in[1], *wt = c->in[2];
	const int64_t N = wt->shape[0], k = wt->shape[1], H = yt->shape[1];
	epj_tensor *dy = c->out[0], *dw = c->out[1];
	int64_t *pos = NULL;
	const void *g, *y, *w;
	void *og = NULL, *oy = NULL, *ow = NULL;
	epj_status s = ej_load_index(ctx, c, 3, N * k, "the rows", &pos);
	if (s == EPJ_OK)
		s = dense(ctx, c, gt, &g, &og);
	if (s == EPJ_OK)
		s = dense(ctx, c, yt, &y, &oy);
	if (s == EPJ_OK)
		s = dense(ctx, c, wt, &w, &ow);
	if (s != EPJ_OK)
		goto done;
	if ((s = check_perm(ctx, c, pos, N * k)) != EPJ_OK)
		goto done;
	if (f32_or_bf16(gt->dtype) && f32_or_bf16(yt->dtype) &&
	    wt->dtype == EPJ_DTYPE_F32) {
		/* the same values on f32 chunks: a product of two f32 values
		 * is exact in double, so w g rounds once either way */
		const float *wf = w;
#pragma omp parallel for schedule(static) if (N * k * H >= PAR_MIN_ELEMS)
		for (int64_t n = 0; n < N; n++) {
			float gr[CHUNK], yr[CHUNK], dr[CHUNK];
			for (int64_t j = 0; j < k; j++) {
				const int64_t r = pos[n * k + j];
				const float wj = wf[n * k + j];
				double dot = 0;
				for (int64_t h0 = 0; h0 < H; h0 += CHUNK) {
					int64_t len =
					    H - h0 < CHUNK ? H - h0 : CHUNK;
					chunk_load(g, gt->dtype, n * H + h0,
						   len, gr);
					chunk_load(y, yt->dtype, r * H + h0,
						   len, yr);
					for (int64_t i = 0; i < len; i++) {
						dot += (double)gr[i] * yr[i];
						dr[i] = wj * gr[i];
					}
					chunk_store(dr, ej_data(dy), dy->dtype,
						    r * H + h0, len);
				}
				st(ej_data(dw), dw->dtype, n * k + j, dot);
			}
		}
		goto done;
	}
	/* each token writes its own k rows of dy (pos is a permutation) */
#pragma omp parallel for schedule(static) if (N * k * H >= PAR_MIN_ELEMS)
	for (int64_t n = 0; n < N; n++) {
		for (int64_t j = 0; j < k; j++) {
			int64_t r = pos[n * k + j];
			double wj = ld(w, wt->dtype, n * k + j), dot = 0;
			for (int64_t h = 0; h < H; h++) {
				double gh = ld(g, gt->dtype, n * H + h);
				dot += gh * ld(y, yt->dtype, r * H + h);
				st(ej_data(dy), dy->dtype, r * H + h, wj * gh);
			}
			st(ej_data(dw), dw->dtype, n * k + j, dot);
		}
	}
done:
	free(pos);
	free(og);
	free(oy);
	free(ow);
	return s;
}

/* ---- MOE_GROUPED_MM: (x [R, K], counts [G], w_0 .. w_{G-1}) -> y [R, M];
 * i[0] = w_trans (1: w_g [M, K], y_g = x_g w_g^T; 0: w_g [K, M],
 * y_g = x_g w_g) ---------------------------------------------------------- */

static epj_status grouped_shapes(epj_ctx *ctx, const ej_call *c, int64_t *M)
{
	const epj_tensor *x = c->in[0], *cnt = c->in[1];
	const int G = c->n_in - 2;
	if (c->attrs->n_i < 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "expects the w_trans attribute");
	const bool tr = c->attrs->i[0] != 0;
	if (x->ndim != 2 || cnt->ndim != 1 || cnt->shape[0] != G)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "expects x [R, K], counts [G] and G = %d "
				   "weights",
				   G);
	const epj_tensor *w0 = c->in[2];
	for (int g = 0; g < G; g++) {
		const epj_tensor *w = c->in[2 + g];
		if (w->ndim != 2 || w->dtype != x->dtype ||
		    w->shape[0] != w0->shape[0] ||
		    w->shape[1] != w0->shape[1] ||
		    w->shape[tr ? 1 : 0] != x->shape[1])
			return ej_op_error(
			    ctx, c, EPJ_ERR_SHAPE,
			    "weight %d must be [%s] of x's dtype like "
			    "weight 0, with K = %lld",
			    g, tr ? "M, K" : "K, M", (long long)x->shape[1]);
	}
	*M = w0->shape[tr ? 0 : 1];
	return EPJ_OK;
}

epj_status ej_infer_MOE_GROUPED_MM(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	epj_status s = ej_check_float(ctx, c, 0);
	if (s == EPJ_OK)
		s = check_index(ctx, c, 1);
	int64_t M = 0;
	if (s == EPJ_OK)
		s = grouped_shapes(ctx, c, &M);
	if (s != EPJ_OK)
		return s;
	int64_t sh[2] = { c->in[0]->shape[0], M };
	ej_meta_set(out, c->in[0]->dtype, 2, sh);
	return EPJ_OK;
}

/* counts of the call's input `input`, each >= 0, summing to rows */
static epj_status load_counts(epj_ctx *ctx, const ej_call *c, int input,
			      int64_t rows, int64_t **out)
{
	epj_status s =
	    ej_load_index(ctx, c, input, rows + 1, "the group sizes", out);
	if (s != EPJ_OK)
		return s;
	int64_t sum = 0, G = c->in[input]->shape[0];
	for (int64_t g = 0; g < G; g++)
		sum += (*out)[g];
	if (sum != rows) {
		free(*out);
		*out = NULL;
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "group counts sum to %lld, expected %lld "
				   "(rows)",
				   (long long)sum, (long long)rows);
	}
	return EPJ_OK;
}

/* A BLAS operand of t [rows, cols] in dtype cdt: base, layout (*tr: stored
 * transposed) and ld; *owned is a packed copy to free. */
static epj_status operand2(epj_ctx *ctx, const ej_call *c, const epj_tensor *t,
			   epj_dtype cdt, const char **base, bool *tr,
			   int64_t *ldm, void **owned)
{
	int64_t stride[2];
	const void *b;
	epj_status s =
	    ej_linalg_operand(ctx, c, t, cdt, &b, stride, tr, ldm, owned);
	*base = b;
	return s;
}

/* Row r of a [rows, cols] operand stored with (tr, ld), in elements. */
static int64_t row_off(bool tr, int64_t ldm, int64_t r)
{
	return tr ? r : r * ldm;
}

/* The grouped product on the CPU's AMX tiles (lib/gemm_amx.c) when x and
 * every w_g are bf16 and the context wants it: y_g = x_g op(w_g) into the
 * f32 rows y; false (y untouched) otherwise. */
static bool grouped_mm_amx(epj_ctx *ctx, const ej_call *c, const int64_t *cnt,
			   bool wtr, float *y)
{
	const epj_tensor *xt = c->in[0];
	const int G = c->n_in - 2;
	const int64_t R = xt->shape[0], K = xt->shape[1],
		      M = c->out[0]->shape[1];
	int64_t most = 0;
	for (int g = 0; g < G; g++) {
		if (c->in[2 + g]->dtype != EPJ_DTYPE_BF16)
			return false;
		most = cnt[g] > most ? cnt[g] : most;
	}
	void *scratch =
	    K > 0 && ej_amx_wanted(ctx, xt->dtype, EPJ_DTYPE_BF16, R * M * K)
		? ej_amx_begin(ctx, most, M, K)
		: NULL;
	if (!scratch)
		return false;
	const uint16_t *x = ej_data(xt);
	int64_t r0 = 0;
	for (int g = 0; g < G; r0 += cnt[g], g++) {
		const epj_tensor *w = c->in[2 + g];
		/* B [K, M] = w_g^T (w_g [M, K]) or w_g */
		int64_t sbk = wtr ? w->stride[1] : w->stride[0];
		int64_t sbn = wtr ? w->stride[0] : w->stride[1];
		ej_gemm_bf16_amx(cnt[g], M, K, 1.0f, x + r0 * xt->stride[0],
				 xt->stride[0], xt->stride[1], ej_data(w), sbk,
				 sbn, 0.0f, y + r0 * M, M, scratch);
	}
	free(scratch);
	return true;
}

epj_status ej_kernel_MOE_GROUPED_MM(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *xt = c->in[0];
	epj_tensor *o = c->out[0];
	const int G = c->n_in - 2;
	const bool wtr = c->attrs->i[0] != 0;
	const int64_t R = xt->shape[0], K = xt->shape[1], M = o->shape[1];
	const epj_dtype cdt = route_dtype(o->dtype);
	const size_t es = ej_dtype_size(cdt);
	int64_t *cnt = NULL;
	void *ox = NULL, *oc = NULL;
	const char *x = NULL;
	bool xtr = false;
	int64_t ldx = 0;
	epj_status s = load_counts(ctx, c, 1, R, &cnt);
	if (s != EPJ_OK)
		return s;
	if (R == 0 || M == 0)
		goto done;
	char *y = ej_data(o);
	if (o->dtype != cdt) {
		if (!(oc = malloc((size_t)(R * M) * es))) {
			s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					"out of memory for the f32 result");
			goto done;
		}
		y = oc;
	}
	if (grouped_mm_amx(ctx, c, cnt, wtr, (float *)y)) {
		ej_linalg_store(oc, cdt, ej_data(o), o->dtype, R * M);
		goto done;
	}
	if ((s = operand2(ctx, c, xt, cdt, &x, &xtr, &ldx, &ox)) != EPJ_OK)
		goto done;
	int64_t r0 = 0;
	for (int g = 0; g < G; r0 += cnt[g], g++) {
		if (cnt[g] == 0)
			continue;
		const char *w;
		bool wst;
		int64_t ldw;
		void *ow = NULL;
		/* w_g read as [rows, cols] = its own shape */
		s = operand2(ctx, c, c->in[2 + g], cdt, &w, &wst, &ldw, &ow);
		if (s != EPJ_OK)
			goto done;
		/* B = w_g^T [K, M] (w_trans) or w_g [K, M]: transposed for
		 * BLAS exactly when its storage and the wanted layout differ */
		bool tb = wtr ? !wst : wst;
		ej_linalg_gemm(cdt, xtr, tb, cnt[g], M, K, 1.0,
			       x + (size_t)row_off(xtr, ldx, r0) * es, ldx, w,
			       ldw, 0.0, y + (size_t)(r0 * M) * es, M);
		free(ow);
	}
	if (oc)
		ej_linalg_store(oc, cdt, ej_data(o), o->dtype, R * M);
done:
	free(cnt);
	free(ox);
	free(oc);
	return s;
}

epj_status ej_backward_MOE_GROUPED_MM(epj_ctx *ctx, const ej_call *c,
				      epj_tensor *const *grad_out,
				      const bool *needs, epj_tensor **grad_in)
{
	const int G = c->n_in - 2;
	const bool wtr = c->attrs->i[0] != 0;
	epj_tensor *x = c->in[0], *cnt = c->in[1];
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	if (!g)
		return bw_fail(ctx, "moe_grouped_mm");
	epj_status s = EPJ_OK;
	if (needs[0]) {
		/* dx_g = g_g w_g (w_trans) or g_g w_g^T */
		grad_in[0] = ej_moe_grouped_mm(ctx, g, cnt, c->in + 2, G, !wtr);
		if (!grad_in[0])
			s = bw_fail(ctx, "moe_grouped_mm");
	}
	bool any_w = false;
	for (int i = 0; i < G; i++)
		any_w = any_w || needs[2 + i];
	if (s == EPJ_OK && any_w) {
		/* dw_g = g_g^T x_g [M, K] (w_trans) or x_g^T g_g [K, M] */
		epj_tensor *in[3] = { wtr ? g : x, wtr ? x : g, cnt };
		epj_tensor **outs = calloc((size_t)G, sizeof *outs);
		s = outs ? ej_dispatch(ctx, EJ_OP_MOE_GROUPED_MM_WGRAD, in, 3,
				       NULL, outs, G)
			 : ej_error(ctx, EPJ_ERR_NOMEM,
				    "moe_grouped_mm backward: out of memory");
		for (int i = 0; outs && i < G; i++) {
			if (s == EPJ_OK && needs[2 + i])
				grad_in[2 + i] = outs[i];
			else
				epj_tensor_free(outs[i]);
		}
		free(outs);
	}
	epj_tensor_free(g);
	return s;
}

/* ---- MOE_GROUPED_MM_WGRAD: (a [R, A], b [R, B], counts [G]) -> G outputs
 * [A, B] in a's dtype: out_g = a_g^T b_g (zeros for an empty group) ----- */

epj_status ej_infer_MOE_GROUPED_MM_WGRAD(epj_ctx *ctx, const ej_call *c,
					 ej_meta *out)
{
	const epj_tensor *a = c->in[0], *b = c->in[1], *cnt = c->in[2];
	epj_status s = ej_check_float(ctx, c, 0);
	if (s == EPJ_OK)
		s = ej_check_same_dtype(ctx, c, 0, 1);
	if (s == EPJ_OK)
		s = check_index(ctx, c, 2);
	if (s != EPJ_OK)
		return s;
	if (a->ndim != 2 || b->ndim != 2 || a->shape[0] != b->shape[0] ||
	    cnt->ndim != 1 || cnt->shape[0] != c->n_out)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "expects a [R, A], b [R, B] and counts "
				   "[G] for G = %d outputs",
				   c->n_out);
	int64_t sh[2] = { a->shape[1], b->shape[1] };
	for (int g = 0; g < c->n_out; g++)
		ej_meta_set(&out[g], a->dtype, 2, sh);
	return EPJ_OK;
}

/* The weight gradients on the CPU's AMX tiles (lib/gemm_amx.c) when a and
 * b are bf16 and the context wants it: out_g = a_g^T b_g through the f32
 * buffer y [A, B], rounded into each bf16 output; false (nothing written)
 * otherwise. */
static bool wgrad_amx(epj_ctx *ctx, const ej_call *c, const int64_t *cnt,
		      float *y)
{
	const epj_tensor *at = c->in[0], *bt = c->in[1];
	const int64_t R = at->shape[0], A = at->shape[1], B = bt->shape[1];
	int64_t most = 0;
	for (int g = 0; g < c->n_out; g++)
		most = cnt[g] > most ? cnt[g] : most;
	void *scratch =
	    y && most > 0 && ej_amx_wanted(ctx, at->dtype, bt->dtype, R * A * B)
		? ej_amx_begin(ctx, A, B, most)
		: NULL;
	if (!scratch)
		return false;
	const uint16_t *a = ej_data(at), *b = ej_data(bt);
	int64_t r0 = 0;
	for (int g = 0; g < c->n_out; r0 += cnt[g], g++) {
		if (cnt[g] == 0) {
			memset(ej_data(c->out[g]), 0,
			       (size_t)(A * B) * ej_dtype_size(at->dtype));
			continue;
		}
		/* a_g^T [A, cnt]: element (i, p) is a[r0 + p][i] */
		ej_gemm_bf16_amx(A, B, cnt[g], 1.0f, a + r0 * at->stride[0],
				 at->stride[1], at->stride[0],
				 b + r0 * bt->stride[0], bt->stride[0],
				 bt->stride[1], 0.0f, y, B, scratch);
		ej_linalg_store(y, EPJ_DTYPE_F32, ej_data(c->out[g]), at->dtype,
				A * B);
	}
	free(scratch);
	return true;
}

epj_status ej_kernel_MOE_GROUPED_MM_WGRAD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *at = c->in[0], *bt = c->in[1];
	const int G = c->n_out;
	const int64_t R = at->shape[0], A = at->shape[1], B = bt->shape[1];
	const epj_dtype dt = at->dtype, cdt = route_dtype(dt);
	const size_t es = ej_dtype_size(cdt);
	int64_t *cnt = NULL;
	void *oa = NULL, *ob = NULL, *oc = NULL;
	const char *a = NULL, *b = NULL;
	bool atr = false, btr = false;
	int64_t lda = 0, ldb = 0;
	epj_status s = load_counts(ctx, c, 2, R, &cnt);
	if (s != EPJ_OK)
		return s;
	if (A == 0 || B == 0)
		goto done;
	if (dt != cdt && !(oc = malloc((size_t)(A * B) * es))) {
		s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				"out of memory for the f32 result");
		goto done;
	}
	if (wgrad_amx(ctx, c, cnt, oc))
		goto done;
	if (R > 0) {
		s = operand2(ctx, c, at, cdt, &a, &atr, &lda, &oa);
		if (s == EPJ_OK)
			s = operand2(ctx, c, bt, cdt, &b, &btr, &ldb, &ob);
		if (s != EPJ_OK)
			goto done;
	}
	int64_t r0 = 0;
	for (int g = 0; g < G; r0 += cnt[g], g++) {
		char *y = oc ? oc : ej_data(c->out[g]);
		if (cnt[g] == 0) {
			memset(y, 0, (size_t)(A * B) * es);
		} else {
			/* a_g^T: a_g stored [c, A] row-major is transposed;
			 * stored transposed it is a_g^T row-major */
			ej_linalg_gemm(cdt, !atr, btr, A, B, cnt[g], 1.0,
				       a + (size_t)row_off(atr, lda, r0) * es,
				       lda,
				       b + (size_t)row_off(btr, ldb, r0) * es,
				       ldb, 0.0, y, B);
		}
		if (oc)
			ej_linalg_store(oc, cdt, ej_data(c->out[g]), dt, A * B);
	}
done:
	free(cnt);
	free(oa);
	free(ob);
	free(oc);
	return s;
}

/* ---- SWIGLU: (gate, up) of one shape -> silu(gate) * up ----------------- */

epj_status ej_infer_SWIGLU(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	epj_status s = ej_check_float(ctx, c, 0);
	if (s == EPJ_OK)
		s = ej_check_same_dtype(ctx, c, 0, 1);
	if (s != EPJ_OK)
		return s;
	if (!shape_is(c->in[1], c->in[0]->ndim, c->in[0]->shape))
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "gate and up must have one shape");
	ej_meta_from(out, c->in[0]);
	return EPJ_OK;
}

/* SwiGLU over f32 runs, 8 lanes at a time with the vector exp of
 * ops_vexp.h (libm's scalar expf cost more than the rest of the loop); the
 * tail runs one more vector with its unused lanes at g = 0, u = 0.
 * silu(g) = g / (1 + exp(-g)): exp(-g) = inf for g <= -88.72 gives -0,
 * where the exact value is below 1e-36 in magnitude; exp(-g) = 0 for
 * g > 87.3 gives g, as it should in f32. */
static inline __attribute__((always_inline)) void
swiglu_v8(const ej_v8f *g, const ej_v8f *u, ej_v8f *y)
{
	ej_v8f e = -*g;
	ej_v8_exp(&e);
	*y = *g / (1.0f + e) * *u;
}

EJ_V8_CLONES static void swiglu_f32(const float *restrict g,
				    const float *restrict u, float *restrict y,
				    int64_t n)
{
	ej_v8f gv, uv, yv;
	int64_t i = 0;
	for (; i + 8 <= n; i += 8) {
		memcpy(&gv, g + i, sizeof gv);
		memcpy(&uv, u + i, sizeof uv);
		swiglu_v8(&gv, &uv, &yv);
		memcpy(y + i, &yv, sizeof yv);
	}
	if (i < n) {
		const size_t sz = (size_t)(n - i) * sizeof *g;
		gv = uv = (ej_v8f){ 0 };
		memcpy(&gv, g + i, sz);
		memcpy(&uv, u + i, sz);
		swiglu_v8(&gv, &uv, &yv);
		memcpy(y + i, &yv, sz);
	}
}

/* dg = d u s (1 + g (1 - s)), du = d g s, s = sigmoid(g) = 1 / (1 + exp(-g)),
 * 8 lanes at a time as in swiglu_f32. */
static inline __attribute__((always_inline)) void
swiglu_bw_v8(const ej_v8f *d, const ej_v8f *g, const ej_v8f *u, ej_v8f *dg,
	     ej_v8f *du)
{
	ej_v8f s = -*g;
	ej_v8_exp(&s);
	s = 1.0f / (1.0f + s);
	*dg = *d * *u * s * (1.0f + *g * (1.0f - s));
	*du = *d * *g * s;
}

EJ_V8_CLONES static void swiglu_bw_f32(const float *restrict d,
				       const float *restrict g,
				       const float *restrict u,
				       float *restrict dg, float *restrict du,
				       int64_t n)
{
	ej_v8f dv, gv, uv, a, b;
	int64_t i = 0;
	for (; i + 8 <= n; i += 8) {
		memcpy(&dv, d + i, sizeof dv);
		memcpy(&gv, g + i, sizeof gv);
		memcpy(&uv, u + i, sizeof uv);
		swiglu_bw_v8(&dv, &gv, &uv, &a, &b);
		memcpy(dg + i, &a, sizeof a);
		memcpy(du + i, &b, sizeof b);
	}
	if (i < n) {
		const size_t sz = (size_t)(n - i) * sizeof *g;
		dv = gv = uv = (ej_v8f){ 0 };
		memcpy(&dv, d + i, sz);
		memcpy(&gv, g + i, sz);
		memcpy(&uv, u + i, sz);
		swiglu_bw_v8(&dv, &gv, &uv, &a, &b);
		memcpy(dg + i, &a, sz);
		memcpy(du + i, &b, sz);
	}
}

epj_status ej_kernel_SWIGLU(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *gt = c->in[0], *ut = c->in[1];
	epj_tensor *o = c->out[0];
	const int64_t n = ej_numel(gt->ndim, gt->shape);
	const void *g, *u;
	void *og = NULL, *ou = NULL;
	epj_status s = dense(ctx, c, gt, &g, &og);
	if (s == EPJ_OK)
		s = dense(ctx, c, ut, &u, &ou);
	if (s != EPJ_OK)
		goto done;
	const epj_dtype dt = gt->dtype;
	void *y = ej_data(o);
	if (dt == EPJ_DTYPE_F64) {
		const double *a = g, *b = u;
		double *d = y;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
		for (int64_t i = 0; i < n; i++)
			d[i] = a[i] / (1.0 + exp(-a[i])) * b[i];
	} else {
		/* f32 chunks (bf16 converted in and rounded once out) */
		const int64_t nc = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
		for (int64_t q = 0; q < nc; q++) {
			float a[CHUNK], b[CHUNK], d[CHUNK];
			const int64_t o0 = q * CHUNK;
			const int64_t len = n - o0 < CHUNK ? n - o0 : CHUNK;
			if (dt == EPJ_DTYPE_F32) {
				swiglu_f32((const float *)g + o0,
					   (const float *)u + o0,
					   (float *)y + o0, len);
				continue;
			}
			chunk_load(g, dt, o0, len, a);
			chunk_load(u, dt, o0, len, b);
			swiglu_f32(a, b, d, len);
			chunk_store(d, y, dt, o0, len);
		}
	}
done:
	free(og);
	free(ou);
	return s;
}

epj_status ej_backward_SWIGLU(epj_ctx *ctx, const ej_call *c,
			      epj_tensor *const *grad_out, const bool *needs,
			      epj_tensor **grad_in)
{
	if (!needs[0] && !needs[1])
		return EPJ_OK;
	epj_tensor *g = ej_grad_or_zeros(ctx, c, grad_out, 0);
	epj_tensor *in[3] = { g, c->in[0], c->in[1] };
	epj_tensor *outs[2] = { NULL, NULL };
	epj_status s =
	    g ? ej_dispatch(ctx, EJ_OP_SWIGLU_BACKWARD, in, 3, NULL, outs, 2)
	      : bw_fail(ctx, "swiglu");
	epj_tensor_free(g);
	if (s != EPJ_OK)
		return s;
	for (int i = 0; i < 2; i++) {
		if (needs[i])
			grad_in[i] = outs[i];
		else
			epj_tensor_free(outs[i]);
	}
	return EPJ_OK;
}

/* ---- SWIGLU_BACKWARD: (grad, gate, up) -> (dgate, dup):
 *   dgate = grad up s (1 + gate (1 - s)), dup = grad silu(gate),
 *   s = sigmoid(gate) ------------------------------------------------------ */

epj_status ej_infer_SWIGLU_BACKWARD(epj_ctx *ctx, const ej_call *c,
				    ej_meta *out)
{
	epj_status s = ej_check_float(ctx, c, 0);
	for (int i = 1; s == EPJ_OK && i < 3; i++)
		s = ej_check_same_dtype(ctx, c, 0, i);
	if (s != EPJ_OK)
		return s;
	const epj_tensor *a = c->in[0];
	if (!shape_is(c->in[1], a->ndim, a->shape) ||
	    !shape_is(c->in[2], a->ndim, a->shape))
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "grad, gate and up must have one shape");
	ej_meta_from(&out[0], a);
	ej_meta_from(&out[1], a);
	return EPJ_OK;
}

epj_status ej_kernel_SWIGLU_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *dt_ = c->in[0];
	const int64_t n = ej_numel(dt_->ndim, dt_->shape);
	const void *p[3];
	void *own[3] = { NULL, NULL, NULL };
	epj_status s = EPJ_OK;
	for (int i = 0; i < 3 && s == EPJ_OK; i++)
		s = dense(ctx, c, c->in[i], &p[i], &own[i]);
	if (s != EPJ_OK)
		goto done;
	const epj_dtype dt = dt_->dtype;
	void *dg = ej_data(c->out[0]), *du = ej_data(c->out[1]);
	if (dt == EPJ_DTYPE_F64) {
		const double *d = p[0], *g = p[1], *u = p[2];
		double *og = dg, *ou = du;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
		for (int64_t i = 0; i < n; i++) {
			double sg = 1.0 / (1.0 + exp(-g[i]));
			og[i] = d[i] * u[i] * sg * (1.0 + g[i] * (1.0 - sg));
			ou[i] = d[i] * g[i] * sg;
		}
	} else {
		const int64_t nc = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
		for (int64_t q = 0; q < nc; q++) {
			float d[CHUNK], g[CHUNK], u[CHUNK], a[CHUNK], b[CHUNK];
			const int64_t o0 = q * CHUNK;
			const int64_t len = n - o0 < CHUNK ? n - o0 : CHUNK;
			chunk_load(p[0], dt, o0, len, d);
			chunk_load(p[1], dt, o0, len, g);
			chunk_load(p[2], dt, o0, len, u);
			swiglu_bw_f32(d, g, u, a, b, len);
			chunk_store(a, dg, dt, o0, len);
			chunk_store(b, du, dt, o0, len);
		}
	}
done:
	for (int i = 0; i < 3; i++)
		free(own[i]);
	return s;
}

/* ---- wrappers ------------------------------------------------------------ */

epj_status ej_moe_route(epj_ctx *ctx, epj_tensor *logits, int k, bool norm,
			bool fixed, epj_tensor **w, epj_tensor **idx)
{
	*w = *idx = NULL;
	if (!logits)
		return ctx->status != EPJ_OK ? ctx->status : EPJ_ERR_INVALID;
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, k);
	ej_attrs_push_i(&at, norm);
	ej_attrs_push_i(&at, fixed);
	epj_tensor *outs[2];
	epj_status s =
	    ej_dispatch(ctx, EJ_OP_MOE_ROUTE, &logits, 1, &at, outs, 2);
	if (s != EPJ_OK)
		return s;
	*w = outs[0];
	*idx = outs[1];
	return EPJ_OK;
}

epj_status ej_moe_permute(epj_ctx *ctx, epj_tensor *x, epj_tensor *idx, int E,
			  epj_tensor **x_sorted, epj_tensor **pos,
			  epj_tensor **counts)
{
	*x_sorted = *pos = *counts = NULL;
	if (!x || !idx)
		return ctx->status != EPJ_OK ? ctx->status : EPJ_ERR_INVALID;
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, E);
	epj_tensor *in[2] = { x, idx }, *outs[3];
	epj_status s = ej_dispatch(ctx, EJ_OP_MOE_PERMUTE, in, 2, &at, outs, 3);
	if (s != EPJ_OK)
		return s;
	*x_sorted = outs[0];
	*pos = outs[1];
	*counts = outs[2];
	return EPJ_OK;
}

epj_tensor *ej_moe_unpermute(epj_ctx *ctx, epj_tensor *y, epj_tensor *w,
			     epj_tensor *pos)
{
	if (!y || !w || !pos)
		return NULL;
	epj_tensor *in[3] = { y, w, pos };
	return ej_call1(ctx, EJ_OP_MOE_UNPERMUTE, in, 3, NULL);
}

epj_tensor *ej_moe_grouped_mm(epj_ctx *ctx, epj_tensor *x, epj_tensor *counts,
			      epj_tensor *const *w, int G, bool w_trans)
{
	if (!x || !counts || G < 1)
		return NULL;
	epj_tensor *stack[18];
	epj_tensor **in =
	    G + 2 <= 18 ? stack : calloc((size_t)G + 2, sizeof *in);
	if (!in) {
		ej_error(ctx, EPJ_ERR_NOMEM, "moe_grouped_mm: out of memory");
		return NULL;
	}
	in[0] = x;
	in[1] = counts;
	for (int g = 0; g < G; g++)
		in[2 + g] = w[g];
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, w_trans);
	epj_tensor *y = ej_call1(ctx, EJ_OP_MOE_GROUPED_MM, in, G + 2, &at);
	if (in != stack)
		free(in);
	return y;
}

epj_tensor *ej_swiglu(epj_ctx *ctx, epj_tensor *gate, epj_tensor *up)
{
	epj_tensor *in[2] = { gate, up };
	return ej_call1(ctx, EJ_OP_SWIGLU, in, 2, NULL);
}
