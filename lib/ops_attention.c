/* ops_attention.c -- SDPA (scaled dot-product attention with grouped-query
 * heads) and CROSS_ENTROPY, with their backward ops: shape inference, CPU
 * reference kernels, backward formulas and the public wrappers.
 *
 * SDPA: q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], Hq % Hkv == 0;
 * query head h reads kv head h / (Hq / Hkv).  Causal masks key j of query i
 * when j > i + (S - T) (bottom-right aligned, as in flash-attention; with
 * T > S the first T - S queries see no key at all: their output is 0 and
 * their lse -inf, where PyTorch's math kernel would give NaN), or, with
 * bit 2 of attr i[1], when j > i (top-left aligned, as PyTorch).  Outputs:
 * out [B, Hq, T, Dv] in the inputs' dtype and lse [B, Hq, T] (f32, f64 for
 * f64 inputs), the log-sum-exp of each query's scaled, masked scores.  lse
 * exists for the backward op and is NOT differentiable: a gradient flowing
 * into it is ignored.
 *
 * Documents: an optional fourth input seg [B, S] (i32 or i64; T == S) gives
 * each position the id of the document it belongs to; key j is then also
 * hidden from query i when seg[b, j] != seg[b, i], so the documents packed
 * in a row do not see each other (Megatron's reset_attention_mask).  The
 * ids are data, so one traced graph serves every set of boundaries.  Masked
 * scores are -inf before the softmax; a flash tile pair whose query and
 * key id ranges do not overlap is skipped.  SDPA_BACKWARD takes the same
 * ids as its seventh input.
 *
 * Mask: with bit 1 of attr i[1] the last input is a mask, 4-D and
 * broadcastable to [B, Hq, T, S], read through its strides (0 on a
 * broadcast dim), never expanded: an additive one (q's dtype or f32) is
 * added to the scaled scores before the softmax, -inf hides a key; a
 * boolean one (i32, epjit's bool) hides the keys where it is 0.  The flash
 * kernels skip a (query tile, key tile) pair that the mask hides entirely
 * (padding), as they skip other documents.  With a mask, a query that
 * sees no key gets out 0 and lse 0 (not -inf), as PyTorch's CPU flash
 * kernel gives, and no gradient.  The mask gets no gradient; SDPA_BACKWARD
 * takes it as its last input, with the same attrs.  The CUDA kernels
 * (templates/attention.cuh) take the mask and top-left alignment too.
 *
 * Kernels work per (b, head, block of QB queries) with two small GEMMs
 * (scores = scale q k^T, then P v) and an exact row softmax in between, in
 * f32 (f64 for f64; bf16 inputs are converted to f32 once).  Causal blocks
 * stop at their last visible key.  The backward op recomputes P from lse
 * (flash-attention style) per (b, query head); query heads of one kv group
 * accumulate dk/dv in slots of their own, summed per group at the end, so
 * the work items never write the same memory.  Blocks run on OpenMP threads
 * with BLAS single-threaded meanwhile (see ej_linalg_blas_serial_begin).
 *
 * CROSS_ENTROPY: mean over rows whose target is not ignore_index of
 * logsumexp(row) - row[target], each row in f32 (f64 for f64 logits), the
 * mean summed in double in row order (deterministic for any thread count).
 */
#include "ops_impl.h"
#include "ops_vexp.h"

#include <assert.h>
#include <limits.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Queries per block: the scores of a block, QB x S, stay in cache for
 * S up to a few thousand. */
#define QB 64

static epj_dtype compute_dtype(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
}

static int64_t max1(int64_t v)
{
	return v > 1 ? v : 1;
}

static int thread_num(void)
{
#ifdef _OPENMP
	return omp_get_thread_num();
#else
	return 0;
#endif
}

static epj_status bw_status(epj_ctx *ctx, const char *op)
{
	epj_status s = epj_ctx_status(ctx);
	return s != EPJ_OK ? s
			   : ej_error(ctx, EPJ_ERR_STATE,
				      "%s backward: an op failed", op);
}

static epj_tensor *zeros_like(epj_ctx *ctx, const epj_tensor *t)
{
	return epj_zeros(ctx, t->dtype, t->ndim, t->shape);
}

/* ---- SDPA shapes and attributes ------------------------------------------ */

/* Below this many multiply-adds (B*Hq*T*S*D) attention runs serially. */
#define ATTN_PAR_MIN_WORK (1 << 18)

/* Bits of attr i[1] (absent: 0): SDPA_MASK, an additive mask is the last
 * input; SDPA_TOP_LEFT, causal aligned top-left (key j hidden when j > i). */
#define SDPA_MASK     1
#define SDPA_TOP_LEFT 2

typedef struct sdpa_dims {
	int64_t b, hq, t, d, hkv, s, dv;
	bool causal, top_left;
	double scale;
	int seg_in;		/* the input holding document ids; -1: none */
	const int64_t *seg;	/* [B, S] document ids (kernels only) */
	int mask_in;		/* the input holding the mask; -1: none */
	const epj_tensor *mask; /* the mask (kernels only) */
	int64_t mst[4];		/* its strides, 0 on broadcast dims */
} sdpa_dims;

/* Keys visible to query i: [0, key_end(i)). */
static int64_t key_end(const sdpa_dims *m, int64_t i)
{
	if (!m->causal)
		return m->s;
	int64_t e = i + 1 + (m->top_left ? 0 : m->s - m->t);
	return e < 0 ? 0 : (e > m->s ? m->s : e);
}

/* The lse of a query that sees no key: -inf, or 0 with a mask (as
 * PyTorch's CPU flash kernel gives for a fully masked row). */
static double empty_lse(const sdpa_dims *m)
{
	return m->mask_in >= 0 ? 0.0 : -INFINITY;
}

static double sdpa_scale(double scale, int64_t d)
{
	return scale > 0 ? scale : 1.0 / sqrt((double)max1(d));
}

/* The optional mask (input m->mask_in, the last one): float, the dtype of
 * q or f32, rank 4 and broadcastable to [B, Hq, T, S]. */
static epj_status mask_check(epj_ctx *ctx, const ej_call *c, int iq,
			     sdpa_dims *m)
{
	const epj_tensor *x = c->in[m->mask_in];
	epj_dtype qt = c->in[iq]->dtype;
	if (x->dtype != qt && x->dtype != EPJ_DTYPE_F32 &&
	    x->dtype != EPJ_DTYPE_I32)
		return ej_op_error(ctx, c, EPJ_ERR_DTYPE,
				   "the mask must be f32%s%s (the dtype of q "
				   "or f32, additive) or i32 (boolean), got %s",
				   qt == EPJ_DTYPE_F32 ? "" : " or ",
				   qt == EPJ_DTYPE_F32 ? ""
						       : epj_dtype_name(qt),
				   epj_dtype_name(x->dtype));
	int64_t full[4] = { m->b, m->hq, m->t, m->s };
	bool ok = x->ndim == 4;
	for (int i = 0; ok && i < 4; i++) {
		ok = x->shape[i] == 1 || x->shape[i] == full[i];
		m->mst[i] = x->shape[i] == 1 ? 0 : x->stride[i];
	}
	if (!ok)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "the mask must be 4-D and broadcastable to "
				   "[B, Hq, T, S] = [%lld, %lld, %lld, %lld]",
				   (long long)m->b, (long long)m->hq,
				   (long long)m->t, (long long)m->s);
	return EPJ_OK;
}

/* The optional inputs after the op's own max_in - 1: the document ids seg
 * (input m->seg_in: an index tensor [B, S], and T == S, one id per query
 * and key position), then the mask when attr i[1] has SDPA_MASK. */
static epj_status seg_check(epj_ctx *ctx, const ej_call *c, sdpa_dims *m,
			    int max_in)
{
	const ej_attrs *a = c->attrs;
	int64_t flags = a && a->n_i > 1 ? a->i[1] : 0;
	bool has_mask = (flags & SDPA_MASK) != 0;
	m->top_left = (flags & SDPA_TOP_LEFT) != 0;
	m->seg_in = m->mask_in = -1;
	m->seg = NULL;
	m->mask = NULL;
	if (flags & ~(int64_t)(SDPA_MASK | SDPA_TOP_LEFT))
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "unknown flags %lld in attr i[1]",
				   (long long)flags);
	if (has_mask) {
		max_in++;
		if (c->n_in < max_in - 1)
			return ej_op_error(ctx, c, EPJ_ERR_INVALID,
					   "attr i[1] says a mask follows the "
					   "inputs, but there are only %d",
					   c->n_in);
		m->mask_in = c->n_in - 1;
		epj_status s = mask_check(ctx, c, max_in == 5 ? 0 : 1, m);
		if (s != EPJ_OK)
			return s;
	}
	if (c->n_in > max_in)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "takes at most %d inputs (the document "
				   "ids%s), got %d",
				   max_in, has_mask ? ", the mask" : "",
				   c->n_in);
	if (c->n_in < max_in)
		return EPJ_OK;
	m->seg_in = max_in - 1 - has_mask;
	epj_status s = ej_check_index_dtype(ctx, c, m->seg_in);
	if (s != EPJ_OK)
		return s;
	const epj_tensor *g = c->in[m->seg_in];
	if (g->ndim != 2 || g->shape[0] != m->b || g->shape[1] != m->s)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "document ids must be [B, S] = [%lld, "
				   "%lld]",
				   (long long)m->b, (long long)m->s);
	if (m->t != m->s)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "document ids need as many queries as keys "
				   "(T=%lld, S=%lld)",
				   (long long)m->t, (long long)m->s);
	return EPJ_OK;
}

/* Validates q, k, v = inputs iq, iq+1, iq+2 of the call (and the document
 * ids after the op's other inputs) and fills *m. */
static epj_status sdpa_check(epj_ctx *ctx, const ej_call *c, int iq,
			     sdpa_dims *m)
{
	epj_status s;
	for (int i = iq; i < iq + 3; i++)
		if ((s = ej_check_float(ctx, c, i)) ||
		    (s = ej_check_same_dtype(ctx, c, iq, i)))
			return s;
	const epj_tensor *q = c->in[iq], *k = c->in[iq + 1], *v = c->in[iq + 2];
	if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "expects 4-D q [B, Hq, T, D], k [B, Hkv, S, "
				   "D], v [B, Hkv, S, Dv]");
	m->b = q->shape[0];
	m->hq = q->shape[1];
	m->t = q->shape[2];
	m->d = q->shape[3];
	m->hkv = k->shape[1];
	m->s = k->shape[2];
	m->dv = v->shape[3];
	if (k->shape[0] != m->b || v->shape[0] != m->b)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "batch sizes of q, k, v differ");
	if (v->shape[1] != m->hkv || v->shape[2] != m->s)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "k [B, Hkv, S, D] and v [B, Hkv, S, Dv] "
				   "disagree on Hkv or S");
	if (k->shape[3] != m->d)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "head dims of q (D=%lld) and k (D=%lld) "
				   "differ",
				   (long long)m->d, (long long)k->shape[3]);
	if (m->hkv < 1 || m->hq % m->hkv != 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "query heads Hq=%lld are not a multiple of "
				   "key/value heads Hkv=%lld",
				   (long long)m->hq, (long long)m->hkv);
	if (m->t > INT_MAX || m->s > INT_MAX || m->d > INT_MAX ||
	    m->dv > INT_MAX)
		return ej_op_error(ctx, c, EPJ_ERR_UNSUPPORTED,
				   "sizes exceed the BLAS integer range");
	const ej_attrs *a = c->attrs;
	m->causal = a && a->n_i > 0 && a->i[0] != 0;
	m->scale = sdpa_scale(a && a->n_f > 0 ? a->f[0] : 0.0, m->d);
	/* forward (q, k, v[, seg]); backward (go, q, k, v, o, lse[, seg]) */
	return seg_check(ctx, c, m, iq == 0 ? 4 : 7);
}

/* The document ids of the call as a dense host array [B, S] (NULL, and OK,
 * when the call has none); the caller frees it. */
static epj_status seg_load(epj_ctx *ctx, const ej_call *c, const sdpa_dims *m,
			   int64_t **out)
{
	*out = NULL;
	if (m->seg_in < 0)
		return EPJ_OK;
	const epj_tensor *g = c->in[m->seg_in];
	int64_t *v = malloc((size_t)max1(m->b * m->s) * sizeof *v);
	if (!v)
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "out of memory for the document ids");
	const char *p = ej_data(g);
	for (int64_t b = 0; b < m->b; b++)
		for (int64_t j = 0; j < m->s; j++) {
			int64_t o = b * g->stride[0] + j * g->stride[1];
			v[b * m->s + j] =
			    g->dtype == EPJ_DTYPE_I64
				? ((const int64_t *)(const void *)p)[o]
				: ((const int32_t *)(const void *)p)[o];
		}
	*out = v;
	return EPJ_OK;
}

/* Scores sc [nr, ld] of queries i0.. against keys j0..j0+nk of batch b:
 * -inf where the key is in another document than the query. */
#define DEFINE_SEG_MASK(SFX, REAL)                                             \
	static void seg_mask_##SFX(const sdpa_dims *m, int64_t b, REAL *sc,    \
				   int64_t nr, int64_t nk, int64_t ld,         \
				   int64_t i0, int64_t j0)                     \
	{                                                                      \
		if (!m->seg)                                                   \
			return;                                                \
		const int64_t *g = m->seg + b * m->s;                          \
		for (int64_t r = 0; r < nr; r++)                               \
			for (int64_t j = 0; j < nk; j++)                       \
				if (g[j0 + j] != g[i0 + r])                    \
					sc[r * ld + j] = -INFINITY;            \
	}
DEFINE_SEG_MASK(f32, float)
DEFINE_SEG_MASK(f64, double)
#undef DEFINE_SEG_MASK

/* Scores sc [nr, ld] of queries i0.. against keys j0..j0+nk of batch b,
 * query head h: the mask added, read through its strides. */
#define DEFINE_MASK_ADD(SFX, REAL)                                             \
	static void mask_add_##SFX(const sdpa_dims *m, int64_t b, int64_t h,   \
				   REAL *sc, int64_t nr, int64_t nk,           \
				   int64_t ld, int64_t i0, int64_t j0)         \
	{                                                                      \
		const epj_tensor *x = m->mask;                                 \
		if (!x)                                                        \
			return;                                                \
		const int64_t *st = m->mst;                                    \
		int64_t o0 = b * st[0] + h * st[1] + j0 * st[3];               \
		const char *base = ej_data(x);                                 \
		for (int64_t r = 0; r < nr; r++) {                             \
			REAL *row = sc + r * ld;                               \
			int64_t o = o0 + (i0 + r) * st[2];                     \
			if (x->dtype == EPJ_DTYPE_I32) { /* 0 hides */         \
				const int32_t *p =                             \
				    (const int32_t *)(const void *)base + o;   \
				if (st[3] == 1)                                \
					for (int64_t j = 0; j < nk; j++)       \
						row[j] =                       \
						    p[j] ? row[j] : -INFINITY; \
				else                                           \
					for (int64_t j = 0; j < nk; j++)       \
						row[j] = p[j * st[3]]          \
							     ? row[j]          \
							     : -INFINITY;      \
			} else if (x->dtype == EPJ_DTYPE_F32 && st[3] == 1) {  \
				const float *p =                               \
				    (const float *)(const void *)base + o;     \
				for (int64_t j = 0; j < nk; j++)               \
					row[j] += p[j];                        \
			} else if (x->dtype == EPJ_DTYPE_F64) {                \
				const double *p =                              \
				    (const double *)(const void *)base;        \
				for (int64_t j = 0; j < nk; j++)               \
					row[j] += (REAL)p[o + j * st[3]];      \
			} else if (x->dtype == EPJ_DTYPE_F32) {                \
				const float *p =                               \
				    (const float *)(const void *)base;         \
				for (int64_t j = 0; j < nk; j++)               \
					row[j] += p[o + j * st[3]];            \
			} else {                                               \
				const uint16_t *p =                            \
				    (const uint16_t *)(const void *)base;      \
				for (int64_t j = 0; j < nk; j++)               \
					row[j] +=                              \
					    ej_bf16_load(p[o + j * st[3]]);    \
			}                                                      \
		}                                                              \
	}
DEFINE_MASK_ADD(f32, float)
DEFINE_MASK_ADD(f64, double)
#undef DEFINE_MASK_ADD

/* True when the mask hides every key of [j0, j0 + nk) from every query of
 * [i0, i0 + nr) of batch b, head h (-inf, or 0 in an i32 mask): the flash
 * kernels skip such a tile, which adds nothing. */
static bool mask_hides_tile(const sdpa_dims *m, int64_t b, int64_t h,
			    int64_t i0, int64_t nr, int64_t j0, int64_t nk)
{
	const epj_tensor *x = m->mask;
	if (!x)
		return false;
	const int64_t *st = m->mst;
	const char *base = ej_data(x);
	int64_t o0 = b * st[0] + h * st[1];
	for (int64_t r = 0; r < (st[2] ? nr : 1); r++)
		for (int64_t j = 0; j < (st[3] ? nk : 1); j++) {
			int64_t o = o0 + (i0 + r) * st[2] + (j0 + j) * st[3];
			double v;
			if (x->dtype == EPJ_DTYPE_I32)
				v = ((const int32_t *)(const void *)base)[o]
					? 0.0
					: -INFINITY;
			else if (x->dtype == EPJ_DTYPE_F32)
				v = ((const float *)(const void *)base)[o];
			else if (x->dtype == EPJ_DTYPE_F64)
				v = ((const double *)(const void *)base)[o];
			else
				v = ej_bf16_load(
				    ((const uint16_t *)(const void *)base)[o]);
			if (v != -INFINITY)
				return false;
		}
	return true;
}

/* True when no query of [i0, i0 + nr) shares a document with a key of
 * [j0, j0 + nk) in batch b: their id ranges do not overlap (any ids; for
 * packed documents, whose ids grow along the row, the usual case). */
static bool seg_disjoint(const sdpa_dims *m, int64_t b, int64_t i0, int64_t nr,
			 int64_t j0, int64_t nk)
{
	if (!m->seg || nr <= 0 || nk <= 0)
		return false;
	const int64_t *g = m->seg + b * m->s;
	int64_t qlo = g[i0], qhi = g[i0], klo = g[j0], khi = g[j0];
	for (int64_t r = 1; r < nr; r++) {
		qlo = g[i0 + r] < qlo ? g[i0 + r] : qlo;
		qhi = g[i0 + r] > qhi ? g[i0 + r] : qhi;
	}
	for (int64_t j = 1; j < nk; j++) {
		klo = g[j0 + j] < klo ? g[j0 + j] : klo;
		khi = g[j0 + j] > khi ? g[j0 + j] : khi;
	}
	return qhi < klo || khi < qlo;
}

/* One BLAS-ready 4-D operand [B, H, R, C] (see ej_linalg_operand). */
typedef struct operand {
	const char *base;
	int64_t s[4];
	bool trans;
	int64_t ld;
	void *owned;
} operand;

static epj_status operand_init(epj_ctx *ctx, const ej_call *c,
			       const epj_tensor *t, epj_dtype cdt, operand *op)
{
	const void *base = NULL;
	epj_status s = ej_linalg_operand(ctx, c, t, cdt, &base, op->s,
					 &op->trans, &op->ld, &op->owned);
	op->base = base;
	return s;
}

/* Element offset of matrix (b, h), row r. */
static int64_t operand_at(const operand *op, int64_t b, int64_t h, int64_t r)
{
	return b * op->s[0] + h * op->s[1] + r * op->s[2];
}

/* ---- row kernels, generated for float (f32, bf16) and double (f64) -------
 * softmax_rows: scaled scores sc[nr, ncol] of queries i0.. -> probabilities
 *   in place (0 on masked keys), lse[r] = log-sum-exp (-inf: no key).
 * probs_rows: sc -> exp(sc - lse) in place (0 on masked keys).
 * dsoftmax_rows: dp <- p * (dp - di[r]).
 * rowdot: di[r] = sum_c x[r, c] * y[r, c] through strides.
 */
#define DEFINE_ROWS(SFX, REAL, EXPF, LOGF)                                     \
	static void softmax_rows_##SFX(const sdpa_dims *m, REAL *sc,           \
				       int64_t nr, int64_t ncol, int64_t i0,   \
				       REAL *lse)                              \
	{                                                                      \
		for (int64_t r = 0; r < nr; r++) {                             \
			REAL *row = sc + r * ncol;                             \
			int64_t je = key_end(m, i0 + r);                       \
			if (je > ncol)                                         \
				je = ncol;                                     \
			REAL mx = je > 0 ? row[0] : -INFINITY;                 \
			for (int64_t j = 1; j < je; j++)                       \
				mx = row[j] > mx ? row[j] : mx;                \
			if (mx == -INFINITY) { /* every key masked */          \
				memset(row, 0, (size_t)ncol * sizeof *row);    \
				lse[r] = (REAL)empty_lse(m);                   \
				continue;                                      \
			}                                                      \
			double sum = 0;                                        \
			for (int64_t j = 0; j < je; j++) {                     \
				row[j] = EXPF(row[j] - mx);                    \
				sum += row[j];                                 \
			}                                                      \
			REAL inv = (REAL)(1.0 / sum);                          \
			for (int64_t j = 0; j < je; j++)                       \
				row[j] *= inv;                                 \
			for (int64_t j = je; j < ncol; j++)                    \
				row[j] = 0;                                    \
			lse[r] = mx + (REAL)LOGF((REAL)sum);                   \
		}                                                              \
	}                                                                      \
	static void probs_rows_##SFX(const sdpa_dims *m, REAL *sc, int64_t nr, \
				     int64_t ncol, int64_t i0,                 \
				     const REAL *lse)                          \
	{                                                                      \
		for (int64_t r = 0; r < nr; r++) {                             \
			REAL *row = sc + r * ncol;                             \
			int64_t je = key_end(m, i0 + r);                       \
			if (je > ncol)                                         \
				je = ncol;                                     \
			if (!isfinite(lse[r]))                                 \
				je = 0;                                        \
			for (int64_t j = 0; j < je; j++)                       \
				row[j] = EXPF(row[j] - lse[r]);                \
			for (int64_t j = je < 0 ? 0 : je; j < ncol; j++)       \
				row[j] = 0;                                    \
		}                                                              \
	}                                                                      \
	static void dsoftmax_rows_##SFX(const REAL *p, REAL *dp, int64_t nr,   \
					int64_t ncol, const REAL *di)          \
	{                                                                      \
		for (int64_t r = 0; r < nr; r++)                               \
			for (int64_t j = 0; j < ncol; j++)                     \
				dp[r * ncol + j] = p[r * ncol + j] *           \
						   (dp[r * ncol + j] - di[r]); \
	}                                                                      \
	static void rowdot_##SFX(const REAL *x, int64_t sxr, int64_t sxc,      \
				 const REAL *y, int64_t syr, int64_t syc,      \
				 int64_t nr, int64_t nc, REAL *di)             \
	{                                                                      \
		for (int64_t r = 0; r < nr; r++) {                             \
			double acc = 0;                                        \
			for (int64_t j = 0; j < nc; j++)                       \
				acc += (double)x[r * sxr + j * sxc] *          \
				       y[r * syr + j * syc];                   \
			di[r] = (REAL)acc;                                     \
		}                                                              \
	}

DEFINE_ROWS(f32, float, expf, logf)
DEFINE_ROWS(f64, double, exp, log)
#undef DEFINE_ROWS

/* ---- SDPA forward ----------------------------------------------------------
 */

epj_status ej_infer_SDPA(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	sdpa_dims m;
	epj_status s = sdpa_check(ctx, c, 0, &m);
	if (s != EPJ_OK)
		return s;
	epj_dtype dt = c->in[0]->dtype;
	int64_t os[4] = { m.b, m.hq, m.t, m.dv };
	ej_meta_set(&out[0], dt, 4, os);
	ej_meta_set(&out[1], compute_dtype(dt), 3, os);
	return EPJ_OK;
}

/* What every block of one SDPA (or SDPA_BACKWARD) call shares. */
typedef struct sdpa_run {
	sdpa_dims m;
	epj_dtype dt, cdt;	/* tensors' dtype, compute dtype */
	size_t es;		/* bytes per cdt element */
	operand q, k, v, o, go; /* o, go: out and grad_out (backward only) */
	int64_t *seg;		/* m.seg, owned */
} sdpa_run;

/* Loads the call's document ids (if any) into w->seg and w->m.seg. */
static epj_status sdpa_run_seg(epj_ctx *ctx, const ej_call *c, sdpa_run *w)
{
	epj_status s = seg_load(ctx, c, &w->m, &w->seg);
	w->m.seg = w->seg;
	w->m.mask = w->m.mask_in >= 0 ? c->in[w->m.mask_in] : NULL;
	return s;
}

static void sdpa_run_free(sdpa_run *w)
{
	free(w->seg);
	free(w->q.owned);
	free(w->k.owned);
	free(w->v.owned);
	free(w->o.owned);
	free(w->go.owned);
}

/* Queries i0..i0+nr of head h: out rows into op (ld Dv, dtype cdt) and lse
 * into lse (cdt).  sc: scratch for [nr, S] scores. */
static void sdpa_fw_block(const sdpa_run *w, int64_t b, int64_t h, int64_t i0,
			  int64_t nr, char *sc, char *op, void *lse)
{
	const sdpa_dims *m = &w->m;
	size_t es = w->es;
	int64_t g = h / (m->hq / m->hkv);
	int64_t se = key_end(m, i0 + nr - 1); /* keys any row can see */
	int64_t ldp = max1(se);
	/* sc = scale q k^T */
	ej_linalg_gemm(w->cdt, w->q.trans, !w->k.trans, nr, se, m->d, m->scale,
		       w->q.base + operand_at(&w->q, b, h, i0) * es, w->q.ld,
		       w->k.base + operand_at(&w->k, b, g, 0) * es, w->k.ld,
		       0.0, sc, ldp);
	if (w->cdt == EPJ_DTYPE_F64) {
		mask_add_f64(m, b, h, (double *)sc, nr, se, ldp, i0, 0);
		seg_mask_f64(m, b, (double *)sc, nr, se, ldp, i0, 0);
		softmax_rows_f64(m, (double *)sc, nr, se, i0, lse);
	} else {
		mask_add_f32(m, b, h, (float *)sc, nr, se, ldp, i0, 0);
		seg_mask_f32(m, b, (float *)sc, nr, se, ldp, i0, 0);
		softmax_rows_f32(m, (float *)sc, nr, se, i0, lse);
	}
	/* out = P v */
	ej_linalg_gemm(w->cdt, false, w->v.trans, nr, m->dv, se, 1.0, sc, ldp,
		       w->v.base + operand_at(&w->v, b, g, 0) * es, w->v.ld,
		       0.0, op, max1(m->dv));
}

static epj_status sdpa_fw_reference(epj_ctx *ctx, const ej_call *c)
{
	sdpa_run w = { 0 };
	epj_status s = sdpa_check(ctx, c, 0, &w.m);
	if (s != EPJ_OK)
		return s;
	const sdpa_dims *m = &w.m;
	epj_tensor *out = c->out[0], *lse = c->out[1];
	w.dt = out->dtype;
	w.cdt = compute_dtype(w.dt);
	w.es = ej_dtype_size(w.cdt);
	int64_t nblk = (m->t + QB - 1) / QB, items = m->b * m->hq * nblk;
	char *scratch = NULL;
	if (items == 0)
		return EPJ_OK;
	if ((s = operand_init(ctx, c, c->in[0], w.cdt, &w.q)) ||
	    (s = operand_init(ctx, c, c->in[1], w.cdt, &w.k)) ||
	    (s = operand_init(ctx, c, c->in[2], w.cdt, &w.v)) ||
	    (s = sdpa_run_seg(ctx, c, &w)))
		goto done;
	/* per thread: scores [QB, S] and, for bf16, an f32 output block */
	int nthr = ej_linalg_max_threads();
	size_t per = (size_t)(QB * max1(m->s) + QB * max1(m->dv)) * w.es;
	scratch = malloc(per * (size_t)nthr);
	if (!scratch) {
		s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				"out of memory for %d x %zu bytes of scratch",
				nthr, per);
		goto done;
	}
	char *obase = ej_data(out), *lbase = ej_data(lse);
	size_t eo = ej_dtype_size(w.dt);
	/* blocks over OpenMP threads, each GEMM on one BLAS thread; tiny
	 * calls stay serial (waking a team costs more than they do) */
	bool par = nthr > 1 && items > 1 &&
		   (double)m->b * (double)m->hq * (double)m->t * (double)m->s *
			   (double)max1(m->d) >=
		       ATTN_PAR_MIN_WORK;
	int blas_prev = par ? ej_linalg_blas_serial_begin() : 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthr) if (par)
	for (int64_t it = 0; it < items; it++) {
		char *sc = scratch + per * (size_t)thread_num();
		char *obuf = sc + (size_t)(QB * max1(m->s)) * w.es;
		int64_t bh = it / nblk, i0 = (it % nblk) * QB;
		int64_t nr = m->t - i0 < QB ? m->t - i0 : QB;
		int64_t row = bh * m->t + i0; /* first row of out and lse */
		char *orow = obase + (size_t)(row * m->dv) * eo;
		sdpa_fw_block(&w, bh / m->hq, bh % m->hq, i0, nr, sc,
			      w.dt == w.cdt ? orow : obuf,
			      lbase + (size_t)row * w.es);
		if (w.dt != w.cdt)
			ej_linalg_store(obuf, w.cdt, orow, w.dt, nr * m->dv);
	}
	if (par)
		ej_linalg_blas_serial_end(blas_prev);
done:
	sdpa_run_free(&w);
	free(scratch);
	return s;
}

/* Gradients of q, k, v through the SDPA_BACKWARD op.  lse's gradient
 * (grad_out[1]) is ignored: lse is not differentiable. */
epj_status ej_backward_SDPA(epj_ctx *ctx, const ej_call *c,
			    epj_tensor *const *grad_out, const bool *needs,
			    epj_tensor **grad_in)
{
	if (!grad_out[0]) {
		for (int i = 0; i < 3; i++)
			if (needs[i] &&
			    !(grad_in[i] = zeros_like(ctx, c->in[i])))
				return bw_status(ctx, "sdpa");
		return EPJ_OK;
	}
	/* the document ids and the mask, when given, follow the backward's
	 * own inputs (the mask gets no gradient) */
	epj_tensor *in[8] = { grad_out[0], c->in[0],  c->in[1], c->in[2],
			      c->out[0],   c->out[1], NULL,	NULL };
	int extra = c->n_in - 3;
	assert(extra >= 0 && extra <= 2);
	for (int i = 0; i < extra; i++)
		in[6 + i] = c->in[3 + i];
	epj_tensor *outs[3] = { NULL, NULL, NULL };
	epj_status s = ej_dispatch(ctx, EJ_OP_SDPA_BACKWARD, in, 6 + extra,
				   c->attrs, outs, 3);
	if (s != EPJ_OK)
		return s;
	for (int i = 0; i < 3; i++) {
		if (needs[i])
			grad_in[i] = outs[i];
		else
			epj_tensor_free(outs[i]);
	}
	return EPJ_OK;
}

epj_tensor *epj_sdpa_docs(epj_ctx *ctx, epj_tensor *q, epj_tensor *k,
			  epj_tensor *v, epj_tensor *doc_ids, bool causal,
			  double scale)
{
	if (!q || !k || !v)
		return NULL;
	/* the scale is resolved here so that equal calls have equal attrs */
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, causal ? 1 : 0);
	ej_attrs_push_f(
	    &at, sdpa_scale(scale, q->ndim > 0 ? q->shape[q->ndim - 1] : 1));
	epj_tensor *in[4] = { q, k, v, doc_ids }, *outs[2] = { NULL, NULL };
	if (ej_dispatch(ctx, EJ_OP_SDPA, in, doc_ids ? 4 : 3, &at, outs, 2) !=
	    EPJ_OK)
		return NULL;
	epj_tensor_free(outs[1]);
	return outs[0];
}

epj_tensor *epj_sdpa(epj_ctx *ctx, epj_tensor *q, epj_tensor *k, epj_tensor *v,
		     bool causal, double scale)
{
	return epj_sdpa_docs(ctx, q, k, v, NULL, causal, scale);
}

/* ---- SDPA backward: (grad_out, q, k, v, out, lse) -> (dq, dk, dv) -------- */

epj_status ej_infer_SDPA_BACKWARD(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	sdpa_dims m;
	epj_status s = sdpa_check(ctx, c, 1, &m);
	if (s != EPJ_OK)
		return s;
	const epj_tensor *q = c->in[1];
	int64_t os[4] = { m.b, m.hq, m.t, m.dv };
	for (int i = 0; i < 6; i += 4) { /* grad_out (0) and out (4) */
		const epj_tensor *t = c->in[i];
		if ((s = ej_check_same_dtype(ctx, c, 1, i)))
			return s;
		if (t->ndim != 4 || memcmp(t->shape, os, sizeof os) != 0)
			return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
					   "%s must be [B, Hq, T, Dv]",
					   i == 0 ? "grad_out" : "out");
	}
	const epj_tensor *lse = c->in[5];
	if (lse->dtype != compute_dtype(q->dtype))
		return ej_op_error(ctx, c, EPJ_ERR_DTYPE,
				   "lse must be %s for %s inputs",
				   epj_dtype_name(compute_dtype(q->dtype)),
				   epj_dtype_name(q->dtype));
	if (lse->ndim != 3 || memcmp(lse->shape, os, 3 * sizeof *os) != 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "lse must be [B, Hq, T]");
	for (int i = 0; i < 3; i++)
		ej_meta_from(&out[i], c->in[1 + i]);
	return EPJ_OK;
}

/* Per-thread scratch of the backward: P and dP [QB, S], lse and Di [QB]. */
typedef struct sdpa_bw_scratch {
	char *p, *dp, *lse, *di;
} sdpa_bw_scratch;

/* Queries i0..i0+nr of head h (kv head g): writes their dq rows (dqp, ld D)
 * and accumulates into dk, dv of head g (dkp, dvp: [S, D], [S, Dv]). */
static void sdpa_bw_block(const sdpa_run *w, const epj_tensor *lse, int64_t b,
			  int64_t h, int64_t g, int64_t i0, int64_t nr,
			  const sdpa_bw_scratch *t, char *dqp, char *dkp,
			  char *dvp)
{
	const sdpa_dims *m = &w->m;
	const operand *q = &w->q, *k = &w->k, *v = &w->v, *go = &w->go;
	epj_dtype cdt = w->cdt;
	size_t es = w->es;
	int64_t se = key_end(m, i0 + nr - 1), ldp = max1(se);
	if (se <= 0) { /* no row of the block sees a key */
		memset(dqp, 0, (size_t)(nr * m->d) * es);
		return;
	}
	const char *qp = q->base + operand_at(q, b, h, i0) * es;
	const char *gp = go->base + operand_at(go, b, h, i0) * es;
	const char *op = w->o.base + operand_at(&w->o, b, h, i0) * es;
	const char *kp = k->base + operand_at(k, b, g, 0) * es;
	const char *vp = v->base + operand_at(v, b, g, 0) * es;
	const char *lp = (const char *)ej_data(lse) +
			 (b * lse->stride[0] + h * lse->stride[1]) * es;
	for (int64_t r = 0; r < nr; r++)
		memcpy(t->lse + r * es, lp + (i0 + r) * lse->stride[2] * es,
		       es);
	/* P = exp(scale q k^T - lse); Di = rowsum(dO * O) */
	ej_linalg_gemm(cdt, q->trans, !k->trans, nr, se, m->d, m->scale, qp,
		       q->ld, kp, k->ld, 0.0, t->p, ldp);
	if (cdt == EPJ_DTYPE_F64) {
		mask_add_f64(m, b, h, (double *)t->p, nr, se, ldp, i0, 0);
		seg_mask_f64(m, b, (double *)t->p, nr, se, ldp, i0, 0);
	} else {
		mask_add_f32(m, b, h, (float *)t->p, nr, se, ldp, i0, 0);
		seg_mask_f32(m, b, (float *)t->p, nr, se, ldp, i0, 0);
	}
	if (cdt == EPJ_DTYPE_F64) {
		probs_rows_f64(m, (double *)t->p, nr, se, i0,
			       (const double *)t->lse);
		rowdot_f64((const double *)gp, go->s[2], go->s[3],
			   (const double *)op, w->o.s[2], w->o.s[3], nr, m->dv,
			   (double *)t->di);
	} else {
		probs_rows_f32(m, (float *)t->p, nr, se, i0,
			       (const float *)t->lse);
		rowdot_f32((const float *)gp, go->s[2], go->s[3],
			   (const float *)op, w->o.s[2], w->o.s[3], nr, m->dv,
			   (float *)t->di);
	}
	/* dV += P^T dO */
	ej_linalg_gemm(cdt, true, go->trans, se, m->dv, nr, 1.0, t->p, ldp, gp,
		       go->ld, 1.0, dvp, max1(m->dv));
	/* dP = dO V^T, then dS = P (dP - Di) in place */
	ej_linalg_gemm(cdt, go->trans, !v->trans, nr, se, m->dv, 1.0, gp,
		       go->ld, vp, v->ld, 0.0, t->dp, ldp);
	if (cdt == EPJ_DTYPE_F64)
		dsoftmax_rows_f64((const double *)t->p, (double *)t->dp, nr, se,
				  (const double *)t->di);
	else
		dsoftmax_rows_f32((const float *)t->p, (float *)t->dp, nr, se,
				  (const float *)t->di);
	/* dQ = scale dS K; dK += scale dS^T Q */
	ej_linalg_gemm(cdt, false, k->trans, nr, m->d, se, m->scale, t->dp, ldp,
		       kp, k->ld, 0.0, dqp, max1(m->d));
	ej_linalg_gemm(cdt, true, q->trans, se, m->d, nr, m->scale, t->dp, ldp,
		       qp, q->ld, 1.0, dkp, max1(m->d));
}

/* dst[g, e] = sum over r < rep of src[g * rep + r, e], for ngroups groups of
 * len elements (dtype cdt): the query heads of a kv group summed. */
static void sum_groups(epj_dtype cdt, const char *src, char *dst,
		       int64_t ngroups, int64_t rep, int64_t len)
{
	int64_t n = ngroups * len;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
	for (int64_t i = 0; i < n; i++) {
		int64_t g = i / len, e = i % len;
		double acc = 0;
		for (int64_t r = 0; r < rep; r++) {
			int64_t at = (g * rep + r) * len + e;
			acc += cdt == EPJ_DTYPE_F64 ? ((const double *)src)[at]
						    : ((const float *)src)[at];
		}
		if (cdt == EPJ_DTYPE_F64)
			((double *)dst)[i] = acc;
		else
			((float *)dst)[i] = (float)acc;
	}
}

static epj_status sdpa_bw_reference(epj_ctx *ctx, const ej_call *c)
{
	sdpa_run w = { 0 };
	epj_status s = sdpa_check(ctx, c, 1, &w.m);
	if (s != EPJ_OK)
		return s;
	const sdpa_dims *m = &w.m;
	epj_tensor *dq_t = c->out[0], *dk_t = c->out[1], *dv_t = c->out[2];
	w.dt = dq_t->dtype;
	w.cdt = compute_dtype(w.dt);
	w.es = ej_dtype_size(w.cdt);
	size_t es = w.es;
	int64_t nq = m->b * m->hq * m->t * m->d;
	int64_t nk = m->b * m->hkv * m->s * m->d;
	int64_t nv = m->b * m->hkv * m->s * m->dv;
	int64_t items = m->b * m->hq, rep = m->hq / m->hkv;
	char *scratch = NULL, *acc = NULL, *part = NULL;
	if (items == 0)
		return EPJ_OK;
	if ((s = operand_init(ctx, c, c->in[0], w.cdt, &w.go)) ||
	    (s = operand_init(ctx, c, c->in[1], w.cdt, &w.q)) ||
	    (s = operand_init(ctx, c, c->in[2], w.cdt, &w.k)) ||
	    (s = operand_init(ctx, c, c->in[3], w.cdt, &w.v)) ||
	    (s = operand_init(ctx, c, c->in[4], w.cdt, &w.o)) ||
	    (s = sdpa_run_seg(ctx, c, &w)))
		goto done;
	/* results go to the outputs, or to f32 accumulators for bf16 */
	char *dq = ej_data(dq_t), *dk = ej_data(dk_t), *dv = ej_data(dv_t);
	if (w.dt != w.cdt) {
		acc = malloc((size_t)(nq + nk + nv + 1) * es);
		if (!acc) {
			s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					"out of memory for f32 gradients");
			goto done;
		}
		dq = acc;
		dk = dq + (size_t)nq * es;
		dv = dk + (size_t)nk * es;
	}
	/* one item per (b, query head).  Query heads sharing a kv head
	 * accumulate dk, dv into their own slots [B, Hq, S, D|Dv], summed per
	 * group afterwards, so items stay independent (no atomics) */
	char *pk = dk, *pv = dv;
	if (rep > 1) {
		int64_t per_head = m->b * m->hq * m->s;
		part = malloc((size_t)(per_head * (m->d + m->dv) + 1) * es);
		if (!part) {
			s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					"out of memory for per-head dk, dv");
			goto done;
		}
		pk = part;
		pv = part + (size_t)(per_head * m->d) * es;
	}
	int nthr = ej_linalg_max_threads();
	size_t per = (size_t)(2 * QB * max1(m->s) + 2 * QB) * es;
	scratch = malloc(per * (size_t)nthr);
	if (!scratch) {
		s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				"out of memory for %d x %zu bytes of scratch",
				nthr, per);
		goto done;
	}
	/* items over OpenMP threads, each GEMM on one BLAS thread; tiny
	 * calls stay serial */
	bool par = nthr > 1 && items > 1 &&
		   (double)m->b * (double)m->hq * (double)m->t * (double)m->s *
			   (double)max1(m->d) >=
		       ATTN_PAR_MIN_WORK;
	int blas_prev = par ? ej_linalg_blas_serial_begin() : 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthr) if (par)
	for (int64_t it = 0; it < items; it++) {
		char *base = scratch + per * (size_t)thread_num();
		sdpa_bw_scratch t = { base, base + QB * max1(m->s) * es,
				      base + 2 * QB * max1(m->s) * es,
				      base + (2 * QB * max1(m->s) + QB) * es };
		int64_t b = it / m->hq, h = it % m->hq, g = h / rep;
		/* with rep == 1, slot it is (b, g) of dk, dv themselves */
		char *dkp = pk + (size_t)(it * m->s * m->d) * es;
		char *dvp = pv + (size_t)(it * m->s * m->dv) * es;
		memset(dkp, 0, (size_t)(m->s * m->d) * es);
		memset(dvp, 0, (size_t)(m->s * m->dv) * es);
		for (int64_t i0 = 0; i0 < m->t; i0 += QB) {
			int64_t nr = m->t - i0 < QB ? m->t - i0 : QB;
			int64_t row = it * m->t + i0;
			sdpa_bw_block(&w, c->in[5], b, h, g, i0, nr, &t,
				      dq + (size_t)(row * m->d) * es, dkp, dvp);
		}
	}
	if (par)
		ej_linalg_blas_serial_end(blas_prev);
	if (rep > 1) {
		sum_groups(w.cdt, pk, dk, m->b * m->hkv, rep, m->s * m->d);
		sum_groups(w.cdt, pv, dv, m->b * m->hkv, rep, m->s * m->dv);
	}
	if (acc) {
		ej_linalg_store(dq, w.cdt, ej_data(dq_t), w.dt, nq);
		ej_linalg_store(dk, w.cdt, ej_data(dk_t), w.dt, nk);
		ej_linalg_store(dv, w.cdt, ej_data(dv_t), w.dt, nv);
	}
done:
	sdpa_run_free(&w);
	free(scratch);
	free(acc);
	free(part);
	return s;
}

/* ---- flash kernels ---------------------------------------------------------
 * The default SDPA and SDPA_BACKWARD kernels: query tiles of FQ rows x key
 * tiles of FK keys, so nothing larger than an FQ x FK tile of scores exists.
 * Key tiles entirely above the causal diagonal are never visited; rows of a
 * tile that straddles it are masked per element.
 *
 * Forward, per (b, query head h, query tile): for each key tile in order,
 *   S = scale Q K^T (GEMM), m' = max(m, rowmax S), alpha = exp(m - m'),
 *   P = exp(S - m'), l = alpha l + rowsum P, O = alpha O + P V (GEMM),
 * with m, l per row in f32 (f64 for f64); at the end O /= l and
 * lse = m + log l (-inf and O = 0 for a row that sees no key).
 *
 * Backward, per (b, kv head g): Di = rowsum(dO * O) for the rep = Hq / Hkv
 * query heads of the group, then for each key tile j in order, each query
 * head h = g * rep + r of the group in order, each query tile i that sees
 * a key of tile j in order: P = exp(scale Q_i K_j^T - lse_i) (recomputed),
 *   dV_j += P^T dO_i, dP = dO_i V_j^T, dS = P * (dP - Di),
 *   dK_j += scale dS^T Q_i, dQ_i += scale dS K_j.
 * The item owns dK, dV of kv head g and dQ of the group's query heads, so
 * k and v are never repeated per query head, no memory is written by two
 * items and every sum runs in a fixed order: the results are the same bit
 * for bit whatever the number of threads.  Work items run on OpenMP threads
 * with BLAS single-threaded meanwhile, as in the reference kernels.
 */

#define FQ 64 /* queries per tile */
#define FK 64 /* keys per tile */

/* The f32 flash rows use the vector exp of ops_vexp.h: the scalar libm
 * expf of the reference kernels costs more than the GEMMs at head dim 32.
 * One lane order per row, so results do not depend on threads. */
typedef ej_v8f fl_v8f;
typedef ej_v8i fl_v8i;
#define FL_CLONES EJ_V8_CLONES

/* e = exp(v - sub) over 8 lanes (statements; v, sub, e in scope). */
#define FL_VEXP(e, v, sub)                                                     \
	do {                                                                   \
		(e) = (v) - (sub);                                             \
		ej_v8_exp(&(e));                                               \
	} while (0)

/* x[j] = exp(x[j] - sub) for j < n; returns the sum of the results, added
 * in a fixed order (8 lane sums, then the lanes in order). */
FL_CLONES static float fl_exp_sub_sum(float *x, int64_t n, float sub)
{
	fl_v8f acc = { 0 }, v, e;
	int64_t j = 0;
	for (; j + 8 <= n; j += 8) {
		memcpy(&v, x + j, sizeof v);
		FL_VEXP(e, v, sub);
		memcpy(x + j, &e, sizeof e);
		acc += e;
	}
	if (j < n) { /* tail: lanes past n give 0 */
		float buf[8] = { 0 };
		int32_t rem = (int32_t)(n - j);
		memcpy(buf, x + j, (size_t)rem * sizeof *buf);
		memcpy(&v, buf, sizeof v);
		FL_VEXP(e, v, sub);
		fl_v8i lane = { 0, 1, 2, 3, 4, 5, 6, 7 };
		e = (fl_v8f)((fl_v8i)e & (lane < rem));
		memcpy(buf, &e, sizeof e);
		memcpy(x + j, buf, (size_t)rem * sizeof *buf);
		acc += e;
	}
	float s = 0;
	for (int l = 0; l < 8; l++)
		s += acc[l];
	return s;
}

/* Max of x[0..n), n >= 1 (a NaN may be dropped, as by the scalar loop). */
FL_CLONES static float fl_max(const float *x, int64_t n)
{
	float m = x[0];
	int64_t j = 0;
	if (n >= 8) {
		fl_v8f a, v;
		memcpy(&a, x, sizeof a);
		for (j = 8; j + 8 <= n; j += 8) {
			memcpy(&v, x + j, sizeof v);
			a = (fl_v8f)(((fl_v8i)a & ~(v > a)) |
				     ((fl_v8i)v & (v > a)));
		}
		for (int l = 0; l < 8; l++)
			m = a[l] > m ? a[l] : m;
	}
	for (; j < n; j++)
		m = x[j] > m ? x[j] : m;
	return m;
}

/* dp[j] = p[j] * (dp[j] - di) for j < n. */
FL_CLONES static void fl_dsoftmax_row(const float *p, float *dp, int64_t n,
				      float di)
{
	int64_t j = 0;
	for (; j + 8 <= n; j += 8) {
		fl_v8f a, b;
		memcpy(&a, p + j, sizeof a);
		memcpy(&b, dp + j, sizeof b);
		b = a * (b - di);
		memcpy(dp + j, &b, sizeof b);
	}
	for (; j < n; j++)
		dp[j] = p[j] * (dp[j] - di);
}

/* x[j] *= a for j < n. */
FL_CLONES static void fl_scale(float *x, int64_t n, float a)
{
	int64_t j = 0;
	for (; j + 8 <= n; j += 8) {
		fl_v8f v;
		memcpy(&v, x + j, sizeof v);
		v = v * a;
		memcpy(x + j, &v, sizeof v);
	}
	for (; j < n; j++)
		x[j] *= a;
}

static double fl_max_f64(const double *x, int64_t n)
{
	double m = x[0];
	for (int64_t j = 1; j < n; j++)
		m = x[j] > m ? x[j] : m;
	return m;
}

static void fl_dsoftmax_row_f64(const double *p, double *dp, int64_t n,
				double di)
{
	for (int64_t j = 0; j < n; j++)
		dp[j] = p[j] * (dp[j] - di);
}

static void fl_scale_f64(double *x, int64_t n, double a)
{
	for (int64_t j = 0; j < n; j++)
		x[j] *= a;
}

static double fl_exp_sub_sum_f64(double *x, int64_t n, double sub)
{
	double s = 0;
	for (int64_t j = 0; j < n; j++) {
		x[j] = exp(x[j] - sub);
		s += x[j];
	}
	return s;
}

/* Online-softmax update of one tile: sc [nr, FK] scaled scores of queries
 * i0.. against keys j0..j0+nk -> probabilities relative to the new running
 * max (0 where masked); mx, l: running max and sum per row; alpha: factor
 * by which each row's output accumulator is to be rescaled.
 * fl_probs: sc -> exp(sc - lse) (0 where masked or lse = -inf).
 * fl_dsoftmax: dp <- p * (dp - di[r]) over nr x nk (ld FK). */
#define DEFINE_FLASH_ROWS(SFX, REAL, EXPF, EXPSUM, MAX, DSOFT)                 \
	static void fl_online_##SFX(const sdpa_dims *m, REAL *sc, int64_t nr,  \
				    int64_t nk, int64_t i0, int64_t j0,        \
				    REAL *mx, REAL *l, REAL *alpha)            \
	{                                                                      \
		for (int64_t r = 0; r < nr; r++) {                             \
			REAL *row = sc + r * FK;                               \
			int64_t je = key_end(m, i0 + r) - j0;                  \
			je = je > nk ? nk : je;                                \
			if (je <= 0) { /* no key of this tile */               \
				memset(row, 0, (size_t)nk * sizeof *row);      \
				alpha[r] = 1;                                  \
				continue;                                      \
			}                                                      \
			REAL tm = MAX(row, je);                                \
			REAL mn = tm > mx[r] ? tm : mx[r];                     \
			if (mn == -INFINITY) { /* every key masked so far */   \
				memset(row, 0, (size_t)nk * sizeof *row);      \
				alpha[r] = 1;                                  \
				continue;                                      \
			}                                                      \
			alpha[r] = EXPF(mx[r] - mn);                           \
			REAL sum = EXPSUM(row, je, mn);                        \
			for (int64_t j = je; j < nk; j++)                      \
				row[j] = 0;                                    \
			l[r] = l[r] * alpha[r] + sum;                          \
			mx[r] = mn;                                            \
		}                                                              \
	}                                                                      \
	static void fl_probs_##SFX(const sdpa_dims *m, REAL *sc, int64_t nr,   \
				   int64_t nk, int64_t i0, int64_t j0,         \
				   const REAL *lse)                            \
	{                                                                      \
		for (int64_t r = 0; r < nr; r++) {                             \
			REAL *row = sc + r * FK;                               \
			int64_t je = key_end(m, i0 + r) - j0;                  \
			je = je > nk ? nk : (je < 0 ? 0 : je);                 \
			if (!isfinite(lse[r]))                                 \
				je = 0;                                        \
			(void)EXPSUM(row, je, lse[r]);                         \
			for (int64_t j = je; j < nk; j++)                      \
				row[j] = 0;                                    \
		}                                                              \
	}                                                                      \
	static void fl_dsoftmax_##SFX(const REAL *p, REAL *dp, int64_t nr,     \
				      int64_t nk, const REAL *di)              \
	{                                                                      \
		for (int64_t r = 0; r < nr; r++)                               \
			DSOFT(p + r * FK, dp + r * FK, nk, di[r]);             \
	}

DEFINE_FLASH_ROWS(f32, float, expf, fl_exp_sub_sum, fl_max, fl_dsoftmax_row)
DEFINE_FLASH_ROWS(f64, double, exp, fl_exp_sub_sum_f64, fl_max_f64,
		  fl_dsoftmax_row_f64)
#undef DEFINE_FLASH_ROWS

/* Per-thread scratch of the flash forward: scores [FQ, FK], the output
 * accumulator [FQ, Dv] and per-row max, sum and rescale factor [FQ]. */
static size_t fl_fw_scratch(const sdpa_dims *m, size_t es)
{
	return (size_t)(FQ * FK + FQ * max1(m->dv) + 3 * FQ) * es;
}

/* Queries i0..i0+nr of head h: out rows (dtype cdt, ld Dv) into op, lse
 * into lse (cdt). */
static void fl_fw_tile(const sdpa_run *w, int64_t b, int64_t h, int64_t i0,
		       int64_t nr, char *scr, char *op, char *lse)
{
	const sdpa_dims *m = &w->m;
	epj_dtype cdt = w->cdt;
	size_t es = w->es;
	bool f64 = cdt == EPJ_DTYPE_F64;
	int64_t g = h / (m->hq / m->hkv), dv = max1(m->dv);
	int64_t se = key_end(m, i0 + nr - 1); /* keys any row can see */
	char *sc = scr, *acc = sc + FQ * FK * es;
	char *mx = acc + FQ * dv * es, *l = mx + FQ * es, *al = l + FQ * es;
	memset(acc, 0, (size_t)(nr * dv) * es);
	for (int64_t r = 0; r < nr; r++) {
		if (f64) {
			((double *)mx)[r] = -INFINITY;
			((double *)l)[r] = 0;
		} else {
			((float *)mx)[r] = -INFINITY;
			((float *)l)[r] = 0;
		}
	}
	const char *qp = w->q.base + operand_at(&w->q, b, h, i0) * es;
	for (int64_t j0 = 0; j0 < se; j0 += FK) {
		int64_t nk = se - j0 < FK ? se - j0 : FK;
		if (seg_disjoint(m, b, i0, nr, j0, nk) ||
		    mask_hides_tile(m, b, h, i0, nr, j0, nk))
			continue; /* adds nothing: other documents, masked */
		ej_linalg_gemm(cdt, w->q.trans, !w->k.trans, nr, nk, m->d,
			       m->scale, qp, w->q.ld,
			       w->k.base + operand_at(&w->k, b, g, j0) * es,
			       w->k.ld, 0.0, sc, FK);
		if (f64) {
			mask_add_f64(m, b, h, (double *)sc, nr, nk, FK, i0, j0);
			seg_mask_f64(m, b, (double *)sc, nr, nk, FK, i0, j0);
		} else {
			mask_add_f32(m, b, h, (float *)sc, nr, nk, FK, i0, j0);
			seg_mask_f32(m, b, (float *)sc, nr, nk, FK, i0, j0);
		}
		if (f64)
			fl_online_f64(m, (double *)sc, nr, nk, i0, j0,
				      (double *)mx, (double *)l, (double *)al);
		else
			fl_online_f32(m, (float *)sc, nr, nk, i0, j0,
				      (float *)mx, (float *)l, (float *)al);
		/* O = alpha O + P V */
		for (int64_t r = 0; r < nr; r++) {
			if (f64)
				fl_scale_f64((double *)acc + r * dv, m->dv,
					     ((double *)al)[r]);
			else
				fl_scale((float *)acc + r * dv, m->dv,
					 ((float *)al)[r]);
		}
		ej_linalg_gemm(cdt, false, w->v.trans, nr, m->dv, nk, 1.0, sc,
			       FK, w->v.base + operand_at(&w->v, b, g, j0) * es,
			       w->v.ld, 1.0, acc, dv);
	}
	for (int64_t r = 0; r < nr; r++) {
		double lr = f64 ? ((double *)l)[r] : ((float *)l)[r];
		double mr = f64 ? ((double *)mx)[r] : ((float *)mx)[r];
		double inv = lr > 0 ? 1.0 / lr : 0.0;
		for (int64_t e = 0; e < m->dv; e++) {
			if (f64)
				((double *)op)[r * dv + e] =
				    ((double *)acc)[r * dv + e] * inv;
			else
				((float *)op)[r * dv + e] =
				    ((float *)acc)[r * dv + e] * (float)inv;
		}
		if (f64)
			((double *)lse)[r] =
			    lr > 0 ? mr + log(lr) : empty_lse(m);
		else
			((float *)lse)[r] = lr > 0 ? (float)mr + logf((float)lr)
						   : (float)empty_lse(m);
	}
}

static bool sdpa_par(const sdpa_dims *m, int nthr, int64_t items)
{
	return nthr > 1 && items > 1 &&
	       (double)m->b * (double)m->hq * (double)m->t * (double)m->s *
		       (double)max1(m->d) >=
		   ATTN_PAR_MIN_WORK;
}

static epj_status sdpa_fw_flash(epj_ctx *ctx, const ej_call *c)
{
	sdpa_run w = { 0 };
	epj_status s = sdpa_check(ctx, c, 0, &w.m);
	if (s != EPJ_OK)
		return s;
	const sdpa_dims *m = &w.m;
	epj_tensor *out = c->out[0], *lse = c->out[1];
	w.dt = out->dtype;
	w.cdt = compute_dtype(w.dt);
	w.es = ej_dtype_size(w.cdt);
	int64_t ntile = (m->t + FQ - 1) / FQ, items = m->b * m->hq * ntile;
	char *scratch = NULL;
	if (items == 0)
		return EPJ_OK;
	if ((s = operand_init(ctx, c, c->in[0], w.cdt, &w.q)) ||
	    (s = operand_init(ctx, c, c->in[1], w.cdt, &w.k)) ||
	    (s = operand_init(ctx, c, c->in[2], w.cdt, &w.v)) ||
	    (s = sdpa_run_seg(ctx, c, &w)))
		goto done;
	/* per thread: the tile scratch and, for bf16, an f32 output tile */
	int nthr = ej_linalg_max_threads();
	size_t per = fl_fw_scratch(m, w.es) + (size_t)(FQ * max1(m->dv)) * w.es;
	scratch = malloc(per * (size_t)nthr);
	if (!scratch) {
		s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				"out of memory for %d x %zu bytes of scratch",
				nthr, per);
		goto done;
	}
	char *obase = ej_data(out), *lbase = ej_data(lse);
	size_t eo = ej_dtype_size(w.dt);
	bool par = sdpa_par(m, nthr, items);
	int blas_prev = par ? ej_linalg_blas_serial_begin() : 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthr) if (par)
	for (int64_t it = 0; it < items; it++) {
		char *scr = scratch + per * (size_t)thread_num();
		char *obuf = scr + fl_fw_scratch(m, w.es);
		int64_t bh = it / ntile, i0 = (it % ntile) * FQ;
		int64_t nr = m->t - i0 < FQ ? m->t - i0 : FQ;
		int64_t row = bh * m->t + i0; /* first row of out and lse */
		char *orow = obase + (size_t)(row * m->dv) * eo;
		fl_fw_tile(&w, bh / m->hq, bh % m->hq, i0, nr, scr,
			   w.dt == w.cdt ? orow : obuf,
			   lbase + (size_t)row * w.es);
		if (w.dt != w.cdt)
			ej_linalg_store(obuf, w.cdt, orow, w.dt, nr * m->dv);
	}
	if (par)
		ej_linalg_blas_serial_end(blas_prev);
done:
	sdpa_run_free(&w);
	free(scratch);
	return s;
}

/* Per-thread scratch of the flash backward: P and dP [FQ, FK], lse [FQ],
 * Di [rep * T] of the group's query heads. */
static size_t fl_bw_scratch(const sdpa_dims *m, size_t es)
{
	return (size_t)(2 * FQ * FK + FQ + (m->hq / m->hkv) * max1(m->t)) * es;
}

/* First query that sees key j0 (T when none does). */
static int64_t first_query(const sdpa_dims *m, int64_t j0)
{
	if (!m->causal)
		return 0;
	int64_t i = j0 + (m->top_left ? 0 : m->t - m->s);
	return i < 0 ? 0 : (i > m->t ? m->t : i);
}

/* The mask and the document ids applied to a tile of scores p [nr, FK]. */
static void fl_bw_masks(const sdpa_dims *m, bool f64, int64_t b, int64_t h,
			char *p, int64_t nr, int64_t nk, int64_t i0, int64_t j0)
{
	if (f64) {
		mask_add_f64(m, b, h, (double *)p, nr, nk, FK, i0, j0);
		seg_mask_f64(m, b, (double *)p, nr, nk, FK, i0, j0);
	} else {
		mask_add_f32(m, b, h, (float *)p, nr, nk, FK, i0, j0);
		seg_mask_f32(m, b, (float *)p, nr, nk, FK, i0, j0);
	}
}

/* One work item: batch b, kv head g.  dq [B, Hq, T, D], dk [B, Hkv, S, D],
 * dv [B, Hkv, S, Dv] (dtype cdt, dense) get the item's rows. */
static void fl_bw_item(const sdpa_run *w, const epj_tensor *lse, int64_t b,
		       int64_t g, char *scr, char *dq, char *dk, char *dv)
{
	const sdpa_dims *m = &w->m;
	const operand *q = &w->q, *k = &w->k, *v = &w->v, *go = &w->go;
	epj_dtype cdt = w->cdt;
	size_t es = w->es;
	bool f64 = cdt == EPJ_DTYPE_F64;
	int64_t rep = m->hq / m->hkv, d = m->d, ldd = max1(d);
	int64_t ndv = m->dv, ldv = max1(ndv);
	char *p = scr, *dp = p + FQ * FK * es, *lr = dp + FQ * FK * es;
	char *di = lr + FQ * es; /* [rep, T] */
	char *dkg = dk + (size_t)((b * m->hkv + g) * m->s * d) * es;
	char *dvg = dv + (size_t)((b * m->hkv + g) * m->s * ndv) * es;
	memset(dkg, 0, (size_t)(m->s * d) * es);
	memset(dvg, 0, (size_t)(m->s * ndv) * es);
	for (int64_t r = 0; r < rep; r++) {
		int64_t h = g * rep + r;
		memset(dq + (size_t)((b * m->hq + h) * m->t * d) * es, 0,
		       (size_t)(m->t * d) * es);
		const char *gp = go->base + operand_at(go, b, h, 0) * es;
		const char *op = w->o.base + operand_at(&w->o, b, h, 0) * es;
		char *dir = di + (size_t)(r * m->t) * es;
		if (f64)
			rowdot_f64((const double *)gp, go->s[2], go->s[3],
				   (const double *)op, w->o.s[2], w->o.s[3],
				   m->t, m->dv, (double *)dir);
		else
			rowdot_f32((const float *)gp, go->s[2], go->s[3],
				   (const float *)op, w->o.s[2], w->o.s[3],
				   m->t, m->dv, (float *)dir);
	}
	const char *lbase = (const char *)ej_data(lse);
	for (int64_t j0 = 0; j0 < m->s; j0 += FK) {
		int64_t nk = m->s - j0 < FK ? m->s - j0 : FK;
		const char *kp = k->base + operand_at(k, b, g, j0) * es;
		const char *vp = v->base + operand_at(v, b, g, j0) * es;
		char *dkp = dkg + (size_t)(j0 * d) * es;
		char *dvp = dvg + (size_t)(j0 * ndv) * es;
		int64_t ifirst = first_query(m, j0) / FQ * FQ;
		for (int64_t r = 0; r < rep; r++) {
			int64_t h = g * rep + r;
			const char *lh =
			    lbase +
			    (b * lse->stride[0] + h * lse->stride[1]) * es;
			for (int64_t i0 = ifirst; i0 < m->t; i0 += FQ) {
				int64_t nr = m->t - i0 < FQ ? m->t - i0 : FQ;
				if (seg_disjoint(m, b, i0, nr, j0, nk) ||
				    mask_hides_tile(m, b, h, i0, nr, j0, nk))
					continue; /* other documents, masked */
				const char *qp =
				    q->base + operand_at(q, b, h, i0) * es;
				const char *gp =
				    go->base + operand_at(go, b, h, i0) * es;
				char *dqp =
				    dq +
				    (size_t)(((b * m->hq + h) * m->t + i0) *
					     d) *
					es;
				char *dii = di + (size_t)(r * m->t + i0) * es;
				for (int64_t x = 0; x < nr; x++)
					memcpy(lr + x * es,
					       lh + (i0 + x) * lse->stride[2] *
							es,
					       es);
				/* P = exp(scale Q K^T - lse) */
				ej_linalg_gemm(cdt, q->trans, !k->trans, nr, nk,
					       m->d, m->scale, qp, q->ld, kp,
					       k->ld, 0.0, p, FK);
				fl_bw_masks(m, f64, b, h, p, nr, nk, i0, j0);
				if (f64)
					fl_probs_f64(m, (double *)p, nr, nk, i0,
						     j0, (const double *)lr);
				else
					fl_probs_f32(m, (float *)p, nr, nk, i0,
						     j0, (const float *)lr);
				/* dV += P^T dO */
				ej_linalg_gemm(cdt, true, go->trans, nk, m->dv,
					       nr, 1.0, p, FK, gp, go->ld, 1.0,
					       dvp, ldv);
				/* dP = dO V^T; dS = P (dP - Di) */
				ej_linalg_gemm(cdt, go->trans, !v->trans, nr,
					       nk, m->dv, 1.0, gp, go->ld, vp,
					       v->ld, 0.0, dp, FK);
				if (f64)
					fl_dsoftmax_f64((const double *)p,
							(double *)dp, nr, nk,
							(const double *)dii);
				else
					fl_dsoftmax_f32((const float *)p,
							(float *)dp, nr, nk,
							(const float *)dii);
				/* dK += scale dS^T Q; dQ += scale dS K */
				ej_linalg_gemm(cdt, true, q->trans, nk, m->d,
					       nr, m->scale, dp, FK, qp, q->ld,
					       1.0, dkp, ldd);
				ej_linalg_gemm(cdt, false, k->trans, nr, m->d,
					       nk, m->scale, dp, FK, kp, k->ld,
					       1.0, dqp, ldd);
			}
		}
	}
}

static epj_status sdpa_bw_flash(epj_ctx *ctx, const ej_call *c)
{
	sdpa_run w = { 0 };
	epj_status s = sdpa_check(ctx, c, 1, &w.m);
	if (s != EPJ_OK)
		return s;
	const sdpa_dims *m = &w.m;
	epj_tensor *dq_t = c->out[0], *dk_t = c->out[1], *dv_t = c->out[2];
	w.dt = dq_t->dtype;
	w.cdt = compute_dtype(w.dt);
	w.es = ej_dtype_size(w.cdt);
	size_t es = w.es;
	int64_t nq = m->b * m->hq * m->t * m->d;
	int64_t nk = m->b * m->hkv * m->s * m->d;
	int64_t nv = m->b * m->hkv * m->s * m->dv;
	int64_t items = m->b * m->hkv;
	char *scratch = NULL, *acc = NULL;
	if (items == 0 || nq + nk + nv == 0)
		return EPJ_OK;
	if ((s = operand_init(ctx, c, c->in[0], w.cdt, &w.go)) ||
	    (s = operand_init(ctx, c, c->in[1], w.cdt, &w.q)) ||
	    (s = operand_init(ctx, c, c->in[2], w.cdt, &w.k)) ||
	    (s = operand_init(ctx, c, c->in[3], w.cdt, &w.v)) ||
	    (s = operand_init(ctx, c, c->in[4], w.cdt, &w.o)) ||
	    (s = sdpa_run_seg(ctx, c, &w)))
		goto done;
	/* results go to the outputs, or to f32 accumulators for bf16 */
	char *dq = ej_data(dq_t), *dk = ej_data(dk_t), *dv = ej_data(dv_t);
	if (w.dt != w.cdt) {
		acc = malloc((size_t)(nq + nk + nv + 1) * es);
		if (!acc) {
			s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					"out of memory for f32 gradients");
			goto done;
		}
		dq = acc;
		dk = dq + (size_t)nq * es;
		dv = dk + (size_t)nk * es;
	}
	int nthr = ej_linalg_max_threads();
	size_t per = fl_bw_scratch(m, es);
	scratch = malloc(per * (size_t)nthr);
	if (!scratch) {
		s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				"out of memory for %d x %zu bytes of scratch",
				nthr, per);
		goto done;
	}
	bool par = sdpa_par(m, nthr, items);
	int blas_prev = par ? ej_linalg_blas_serial_begin() : 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthr) if (par)
	for (int64_t it = 0; it < items; it++)
		fl_bw_item(&w, c->in[5], it / m->hkv, it % m->hkv,
			   scratch + per * (size_t)thread_num(), dq, dk, dv);
	if (par)
		ej_linalg_blas_serial_end(blas_prev);
	if (acc) {
		ej_linalg_store(dq, w.cdt, ej_data(dq_t), w.dt, nq);
		ej_linalg_store(dk, w.cdt, ej_data(dk_t), w.dt, nk);
		ej_linalg_store(dv, w.cdt, ej_data(dv_t), w.dt, nv);
	}
done:
	sdpa_run_free(&w);
	free(scratch);
	free(acc);
	return s;
}

/* EPJIT_SDPA (read when the context is made) picks the kernels: flash
 * (default) or reference. */
epj_status ej_kernel_SDPA(epj_ctx *ctx, const ej_call *c)
{
	return ctx->sdpa_reference ? sdpa_fw_reference(ctx, c)
				   : sdpa_fw_flash(ctx, c);
}

epj_status ej_kernel_SDPA_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	return ctx->sdpa_reference ? sdpa_bw_reference(ctx, c)
				   : sdpa_bw_flash(ctx, c);
}

/* ---- CROSS_ENTROPY ---------------------------------------------------------
 */

static epj_status ce_check(epj_ctx *ctx, const ej_call *c, int il)
{
	epj_status s;
	if ((s = ej_check_float(ctx, c, il)) ||
	    (s = ej_check_index_dtype(ctx, c, il + 1)))
		return s;
	const epj_tensor *lg = c->in[il], *tg = c->in[il + 1];
	if (lg->ndim != 2)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "logits must be 2-D [N, V]");
	if (tg->ndim != 1 || tg->shape[0] != lg->shape[0])
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "targets must be [N] = [%lld]",
				   (long long)lg->shape[0]);
	return EPJ_OK;
}

/* Reads the targets into tgt[N] and checks them: each is ignore_index or in
 * [0, V).  Counts the rows that are not ignored. */
static epj_status ce_targets(epj_ctx *ctx, const ej_call *c, int il,
			     int64_t *tgt, int64_t *n_valid)
{
	const epj_tensor *lg = c->in[il], *tg = c->in[il + 1];
	int64_t n = lg->shape[0], vocab = lg->shape[1];
	int64_t ign = c->attrs->n_i > 0 ? c->attrs->i[0] : -100;
	*n_valid = 0;
	for (int64_t r = 0; r < n; r++) {
		tgt[r] = ej_index_at(tg, r);
		if (tgt[r] == ign)
			continue;
		if (tgt[r] < 0 || tgt[r] >= vocab)
			return ej_op_error(ctx, c, EPJ_ERR_INDEX,
					   "target %lld at row %lld is out of "
					   "range [0, %lld) and is not "
					   "ignore_index %lld",
					   (long long)tgt[r], (long long)r,
					   (long long)vocab, (long long)ign);
		++*n_valid;
	}
	return EPJ_OK;
}

/* Row r of logits as a dense array of dtype cdt: in place when possible,
 * else converted into buf (V elements). */
static const void *ce_row(const epj_tensor *lg, int64_t r, epj_dtype cdt,
			  void *buf)
{
	const char *p = (const char *)ej_data(lg) +
			(size_t)(r * lg->stride[0]) * ej_dtype_size(lg->dtype);
	if (lg->dtype == cdt && lg->stride[1] == 1)
		return p;
	ej_linalg_convert(p, lg->dtype, lg->stride[1], buf, cdt, lg->shape[1]);
	return buf;
}

/* Row max and sum of exp(x - max) over V logits: f64 rows with libm exp,
 * summed in order; f32 rows with the vector exp of ops_vexp.h, summed in
 * double in 8 lane sums, then the lanes in order (a fixed order, so the
 * same bits whatever the threads). */
static void row_stats_f64(const double *x, int64_t nv, double *mx, double *sum)
{
	double m = -INFINITY;
	for (int64_t j = 0; j < nv; j++)
		m = x[j] > m ? x[j] : m;
	double s = 0;
	for (int64_t j = 0; j < nv; j++)
		s += exp(x[j] - m);
	*mx = m;
	*sum = s;
}

/* d[j] = (softmax(x)[j] - [j == t]) * g, in double */
static void row_grad_f64(const double *x, int64_t nv, int64_t t, double g,
			 double *d)
{
	double m, s;
	row_stats_f64(x, nv, &m, &s);
	double scale = g / s;
	for (int64_t j = 0; j < nv; j++)
		d[j] = exp(x[j] - m) * scale;
	d[t] -= g;
}

typedef double ce_v8d __attribute__((vector_size(64)));

/* The sum in double of exp(x[j] - m) for j < n; e[j] = exp(x[j] - m) as
 * well when e is not NULL. */
FL_CLONES static double ce_exp_sum(const float *x, float *e, int64_t n, float m)
{
	ce_v8d acc = { 0 };
	fl_v8f v, y;
	int64_t j = 0;
	for (; j + 8 <= n; j += 8) {
		memcpy(&v, x + j, sizeof v);
		FL_VEXP(y, v, m);
		if (e)
			memcpy(e + j, &y, sizeof y);
		acc += __builtin_convertvector(y, ce_v8d);
	}
	if (j < n) { /* tail: lanes past n give 0 */
		float buf[8] = { 0 };
		const int32_t rem = (int32_t)(n - j);
		memcpy(buf, x + j, (size_t)rem * sizeof *buf);
		memcpy(&v, buf, sizeof v);
		FL_VEXP(y, v, m);
		fl_v8i lane = { 0, 1, 2, 3, 4, 5, 6, 7 };
		y = (fl_v8f)((fl_v8i)y & (lane < rem));
		if (e) {
			memcpy(buf, &y, sizeof y);
			memcpy(e + j, buf, (size_t)rem * sizeof *buf);
		}
		acc += __builtin_convertvector(y, ce_v8d);
	}
	double s = 0;
	for (int l = 0; l < 8; l++)
		s += acc[l];
	return s;
}

/* The max of an f32 row, -inf for an empty row.  fl_max gives NaN when
 * x[0] is NaN; that becomes -inf here, and the row's sum of exps is NaN
 * either way, as the loss of a row with a NaN logit always is. */
static float ce_max_f32(const float *x, int64_t nv)
{
	float m = nv > 0 ? fl_max(x, nv) : -INFINITY;
	return m > -INFINITY ? m : -INFINITY;
}

static void row_stats_f32(const float *x, int64_t nv, float *mx, double *sum)
{
	*mx = ce_max_f32(x, nv);
	*sum = ce_exp_sum(x, NULL, nv, *mx);
}

/* d[j] = (softmax(x)[j] - [j == t]) * g: exp(x[j] - max) rounded to f32,
 * times g / sum rounded to f32 */
static void row_grad_f32(const float *x, int64_t nv, int64_t t, double g,
			 float *d)
{
	double s = ce_exp_sum(x, d, nv, ce_max_f32(x, nv));
	fl_scale(d, nv, (float)(g / s));
	d[t] -= (float)g;
}

epj_status ej_infer_CROSS_ENTROPY(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	epj_status s = ce_check(ctx, c, 0);
	if (s != EPJ_OK)
		return s;
	ej_meta_set(out, compute_dtype(c->in[0]->dtype), 0, NULL);
	return EPJ_OK;
}

epj_status ej_kernel_CROSS_ENTROPY(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *lg = c->in[0];
	epj_tensor *out = c->out[0];
	epj_dtype cdt = compute_dtype(lg->dtype);
	size_t es = ej_dtype_size(cdt);
	int64_t n = lg->shape[0], vocab = lg->shape[1], n_valid = 0;
	int nthr = ej_linalg_max_threads();
	int64_t *tgt = malloc((size_t)max1(n) * sizeof *tgt);
	double *loss = malloc((size_t)max1(n) * sizeof *loss);
	char *buf = malloc((size_t)nthr * (size_t)max1(vocab) * es);
	epj_status s = EPJ_OK;
	if (!tgt || !loss || !buf) {
		s = ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
		goto done;
	}
	if ((s = ce_targets(ctx, c, 0, tgt, &n_valid)))
		goto done;
	int64_t ign = c->attrs->n_i > 0 ? c->attrs->i[0] : -100;
#pragma omp parallel for schedule(static)                                      \
    num_threads(nthr) if (n * vocab > 32768)
	for (int64_t r = 0; r < n; r++) {
		loss[r] = 0;
		if (tgt[r] == ign)
			continue;
		void *tb = buf + (size_t)thread_num() * (size_t)vocab * es;
		const void *x = ce_row(lg, r, cdt, tb);
		double sum;
		if (cdt == EPJ_DTYPE_F64) {
			double m;
			row_stats_f64(x, vocab, &m, &sum);
			loss[r] = m + log(sum) - ((const double *)x)[tgt[r]];
		} else {
			float m;
			row_stats_f32(x, vocab, &m, &sum);
			loss[r] = (double)(m + logf((float)sum) -
					   ((const float *)x)[tgt[r]]);
		}
	}
	double total = 0;
	for (int64_t r = 0; r < n; r++)
		total += loss[r];
	/* 0 / 0: NaN when every row is ignored, as in PyTorch */
	ej_store_f64(ej_data(out), out->dtype,
		     n_valid > 0 ? total / (double)n_valid : NAN);
done:
	free(tgt);
	free(loss);
	free(buf);
	return s;
}

epj_status ej_backward_CROSS_ENTROPY(epj_ctx *ctx, const ej_call *c,
				     epj_tensor *const *grad_out,
				     const bool *needs, epj_tensor **grad_in)
{
	if (!needs[0])
		return EPJ_OK;
	if (!grad_out[0]) {
		grad_in[0] = zeros_like(ctx, c->in[0]);
	} else {
		epj_tensor *in[3] = { grad_out[0], c->in[0], c->in[1] };
		grad_in[0] = ej_call1(ctx, EJ_OP_CROSS_ENTROPY_BACKWARD, in, 3,
				      c->attrs);
	}
	return grad_in[0] ? EPJ_OK : bw_status(ctx, "cross_entropy");
}

epj_tensor *epj_cross_entropy(epj_ctx *ctx, epj_tensor *logits,
			      epj_tensor *targets, int64_t ignore_index)
{
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, ignore_index);
	epj_tensor *in[2] = { logits, targets };
	return ej_call1(ctx, EJ_OP_CROSS_ENTROPY, in, 2, &at);
}

/* ---- CROSS_ENTROPY_BACKWARD: (grad [], logits, targets) -> dlogits ------- */

epj_status ej_infer_CROSS_ENTROPY_BACKWARD(epj_ctx *ctx, const ej_call *c,
					   ej_meta *out)
{
	epj_status s;
	if ((s = ej_check_float(ctx, c, 0)) || (s = ce_check(ctx, c, 1)))
		return s;
	if (c->in[0]->ndim != 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "grad must be a scalar of shape []");
	ej_meta_from(out, c->in[1]);
	return EPJ_OK;
}

epj_status ej_kernel_CROSS_ENTROPY_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *lg = c->in[1];
	epj_tensor *out = c->out[0];
	epj_dtype dt = out->dtype, cdt = compute_dtype(dt);
	size_t es = ej_dtype_size(cdt), eo = ej_dtype_size(dt);
	int64_t n = lg->shape[0], vocab = lg->shape[1], n_valid = 0;
	int nthr = ej_linalg_max_threads();
	int64_t *tgt = malloc((size_t)max1(n) * sizeof *tgt);
	/* per thread: the row as cdt, and its gradient as cdt */
	char *buf = malloc((size_t)nthr * 2 * (size_t)max1(vocab) * es);
	epj_status s = EPJ_OK;
	if (!tgt || !buf) {
		s = ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
		goto done;
	}
	if ((s = ce_targets(ctx, c, 1, tgt, &n_valid)))
		goto done;
	int64_t ign = c->attrs->n_i > 0 ? c->attrs->i[0] : -100;
	double g = ej_load_f64(ej_data(c->in[0]), c->in[0]->dtype);
	g = n_valid > 0 ? g / (double)n_valid : 0.0;
	char *obase = ej_data(out);
#pragma omp parallel for schedule(static)                                      \
    num_threads(nthr) if (n * vocab > 32768)
	for (int64_t r = 0; r < n; r++) {
		char *orow = obase + (size_t)(r * vocab) * eo;
		if (tgt[r] == ign) {
			memset(orow, 0, (size_t)vocab * eo);
			continue;
		}
		char *tb = buf + (size_t)thread_num() * 2 * (size_t)vocab * es;
		char *d = dt == cdt ? orow : tb + (size_t)vocab * es;
		const void *x = ce_row(lg, r, cdt, tb);
		if (cdt == EPJ_DTYPE_F64)
			row_grad_f64(x, vocab, tgt[r], g, (double *)d);
		else
			row_grad_f32(x, vocab, tgt[r], g, (float *)d);
		if (d != orow)
			ej_linalg_store(d, cdt, orow, dt, vocab);
	}
done:
	free(tgt);
	free(buf);
	return s;
}
