/* ops_rope.c -- ROPE and ROPE_BACKWARD: the rotary embedding
 *     y = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x2, x1)
 * (x1, x2 the halves of the last dim) as one op.  The compiler makes it
 * from the traced chain slice, slice, neg, cat, mul, mul, add
 * (jit/passes.c, C backend); the model's eager code keeps the chain.
 *
 * Rounding: f32 arithmetic for f32 and bf16 data (f64 for f64), every step
 * rounded to the data's dtype where the op-by-op chain stores it (x * cos,
 * rotate_half(x) * sin, their sum), so the result is the chain's bit for
 * bit (up to the sign of a zero).  Floats are f32 as stored (no ISA clone
 * or contraction: the library builds with -std=c11, no FMA contraction).
 *
 * ROPE_BACKWARD (g, cos, sin) -> dx = g * cos + rotate_half^T(g * sin),
 * rotate_half^T(u) = cat(u2, -u1): the chain's gradient with respect to x,
 * rounded as the chain's backward (slice_backward zero fills and adds)
 * rounds it.
 */
#include "ops_impl.h"

static epj_status rope_infer(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	epj_status s;
	for (int i = 0; i < 3; i++)
		if ((s = ej_check_float(ctx, c, i)) ||
		    (i > 0 && (s = ej_check_same_dtype(ctx, c, 0, i))))
			return s;
	const epj_tensor *x = c->in[0];
	char sx[96];
	ej_shape_str(x->ndim, x->shape, sx, sizeof sx);
	if (x->ndim < 1 || x->shape[x->ndim - 1] % 2 != 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "x %s needs an even last dim", sx);
	for (int i = 1; i < 3; i++) {
		int nd;
		int64_t shp[EPJ_MAX_DIMS];
		if ((s = ej_broadcast_shape(ctx, c, 0, i, &nd, shp)))
			return s;
		bool same = nd == x->ndim;
		for (int d = 0; same && d < nd; d++)
			same = shp[d] == x->shape[d];
		if (!same)
			return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
					   "input %d must broadcast to x %s", i,
					   sx);
	}
	ej_meta_set(out, x->dtype, x->ndim, x->shape);
	return EPJ_OK;
}

epj_status ej_infer_ROPE(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return rope_infer(ctx, c, out);
}

epj_status ej_infer_ROPE_BACKWARD(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return rope_infer(ctx, c, out);
}

/* One row of D columns: a (stride sa), cos (sc), sin (ss) -> o
 * (contiguous).  CT is the compute type (f32 for f32 and bf16, as the
 * op-by-op kernels); R rounds a CT value where the chain stores it. */
#define ROPE_ROW(NAME, T, CT, LOAD, STORE, R)                                  \
	static void NAME(const T *a, int64_t sa, const T *c, int64_t sc,       \
			 const T *s, int64_t ss, T *o, int64_t D, bool bw)     \
	{                                                                      \
		int64_t h = D / 2;                                             \
		/* first half: partner j + h, rot = -a[j + h] (forward),       \
		 * +u[j + h] (backward); second half: partner j - h */         \
		for (int half = 0; half < 2; half++) {                         \
			int64_t j0 = half ? h : 0, k0 = half ? 0 : h;          \
			CT sg = half ? 1 : -1;                                 \
			const T *aj = a + j0 * sa, *ak = a + k0 * sa;          \
			const T *cj = c + j0 * sc;                             \
			const T *sj = s + (bw ? k0 : j0) * ss;                 \
			T *oj = o + j0;                                        \
			for (int64_t i = 0; i < h; i++) {                      \
				CT p1 =                                        \
				    R(LOAD(aj[i * sa]) * LOAD(cj[i * sc]));    \
				CT p2 =                                        \
				    R(LOAD(ak[i * sa]) * LOAD(sj[i * ss]));    \
				/* forward: (-x) * s == -(x * s) exactly;      \
				 * backward: + u (first half), - u */          \
				oj[i] = STORE(R(p1 + (bw ? -sg : sg) * p2));   \
			}                                                      \
		}                                                              \
	}

#define ID(v) (v)
static inline float bf_round(float v)
{
	return ej_bf16_load(ej_bf16_store(v));
}
ROPE_ROW(row_f32, float, float, ID, ID, ID)
ROPE_ROW(row_f64, double, double, ID, ID, ID)
ROPE_ROW(row_bf16, uint16_t, float, ej_bf16_load, ej_bf16_store, bf_round)
#undef ID

/* The unit-stride rows (x / g, cos and sin with column stride 1; the
 * model's case): n rows, row t of each operand at t * its row stride, out
 * contiguous.  The same products, roundings and sums as ROPE_ROW
 * (p1 + (-1) * p2 is p1 - p2 exactly; a bf16 store of a value already
 * rounded to bf16 is the store of the value), in column loops the
 * compiler vectorises, built with an AVX2 clone (EJ_ISA_CLONES): the same
 * bits as the generic rows. */
#define ROPE_UNIT(NAME, T, LOAD, STORE, R)                                     \
	EJ_ISA_CLONES static void NAME(                                        \
	    const T *restrict a, int64_t ra, const T *restrict c, int64_t rc,  \
	    const T *restrict s, int64_t rs, T *restrict o, int64_t n,         \
	    int64_t D, bool bw)                                                \
	{                                                                      \
		int64_t h = D / 2;                                             \
		for (int64_t t = 0; t < n; t++) {                              \
			const T *restrict x1 = a + t * ra, *restrict x2 =      \
							       x1 + h;         \
			const T *restrict c1 = c + t * rc, *restrict c2 =      \
							       c1 + h;         \
			const T *restrict s1 = s + t * rs, *restrict s2 =      \
							       s1 + h;         \
			T *restrict o1 = o + t * D, *restrict o2 = o1 + h;     \
			/* forward: o1 = x1 c1 - x2 s1, o2 = x2 c2 + x1 s2;    \
			 * backward: o1 = g1 c1 + g2 s2, o2 = g2 c2 - g1 s1 */ \
			const T *restrict sa = bw ? s2 : s1;                   \
			const T *restrict sb = bw ? s1 : s2;                   \
			float f1 = bw ? 1.0f : -1.0f;                          \
			_Pragma("omp simd") for (int64_t i = 0; i < h; i++)    \
			{                                                      \
				float p1 = R(LOAD(x1[i]) * LOAD(c1[i]));       \
				float p2 = R(LOAD(x2[i]) * LOAD(sa[i]));       \
				o1[i] = STORE(p1 + f1 * p2);                   \
			}                                                      \
			_Pragma("omp simd") for (int64_t i = 0; i < h; i++)    \
			{                                                      \
				float p1 = R(LOAD(x2[i]) * LOAD(c2[i]));       \
				float p2 = R(LOAD(x1[i]) * LOAD(sb[i]));       \
				o2[i] = STORE(p1 - f1 * p2);                   \
			}                                                      \
		}                                                              \
	}

#define ID(v) (v)
ROPE_UNIT(unit_f32, float, ID, ID, ID)
ROPE_UNIT(unit_bf16, uint16_t, ej_bf16_load, ej_bf16_store, bf_round)
#undef ID

/* Both directions: a = x (forward) or g (backward), out contiguous.  Rows
 * go in runs along dim nd - 2 (one offset computation per run, not per
 * row). */
static epj_status rope_run(const ej_call *c, bool backward)
{
	const epj_tensor *a = c->in[0], *cs = c->in[1], *sn = c->in[2];
	epj_tensor *o = c->out[0];
	int nd = a->ndim;
	int64_t D = a->shape[nd - 1];
	int64_t n = ej_numel(nd, a->shape);
	if (n == 0)
		return EPJ_OK;
	int64_t rows = n / D;
	int64_t sc[EPJ_MAX_DIMS], ss[EPJ_MAX_DIMS];
	ej_broadcast_strides(cs, nd, a->shape, sc);
	ej_broadcast_strides(sn, nd, a->shape, ss);
	const char *pa = ej_data(a), *pc = ej_data(cs), *ps = ej_data(sn);
	char *po = ej_data(o);
	epj_dtype dt = o->dtype;
	size_t es = ej_dtype_size(dt);
	int64_t sa = a->stride[nd - 1];
	/* a run: the rows along dim nd - 2 (one row when nd == 1) */
	int64_t run = nd >= 2 ? a->shape[nd - 2] : 1;
	int64_t ra = nd >= 2 ? a->stride[nd - 2] : 0;
	int64_t rc = nd >= 2 ? sc[nd - 2] : 0, rs = nd >= 2 ? ss[nd - 2] : 0;
	int64_t runs = rows / run;
	bool unit = sa == 1 && sc[nd - 1] == 1 && ss[nd - 1] == 1 &&
		    dt != EPJ_DTYPE_F64;
#pragma omp parallel for schedule(static) if (n > (1 << 18))
	for (int64_t q = 0; q < runs; q++) {
		int64_t rem = q, oa = 0, oc = 0, os = 0;
		for (int d = nd - 3; d >= 0; d--) {
			int64_t i = rem % a->shape[d];
			rem /= a->shape[d];
			oa += i * a->stride[d];
			oc += i * sc[d];
			os += i * ss[d];
		}
		const char *xa = pa + (size_t)oa * es,
			   *xc = pc + (size_t)oc * es,
			   *xs = ps + (size_t)os * es;
		char *xo = po + (size_t)(q * run * D) * es;
		if (unit && dt == EPJ_DTYPE_F32) {
			unit_f32((const float *)xa, ra, (const float *)xc, rc,
				 (const float *)xs, rs, (float *)xo, run, D,
				 backward);
			continue;
		}
		if (unit) {
			unit_bf16((const uint16_t *)xa, ra,
				  (const uint16_t *)xc, rc,
				  (const uint16_t *)xs, rs, (uint16_t *)xo, run,
				  D, backward);
			continue;
		}
		for (int64_t t = 0; t < run; t++) {
			const char *ta = xa + (size_t)(t * ra) * es,
				   *tc = xc + (size_t)(t * rc) * es,
				   *ts = xs + (size_t)(t * rs) * es;
			char *to = xo + (size_t)(t * D) * es;
			if (dt == EPJ_DTYPE_F32)
				row_f32((const float *)ta, sa,
					(const float *)tc, sc[nd - 1],
					(const float *)ts, ss[nd - 1],
					(float *)to, D, backward);
			else if (dt == EPJ_DTYPE_F64)
				row_f64((const double *)ta, sa,
					(const double *)tc, sc[nd - 1],
					(const double *)ts, ss[nd - 1],
					(double *)to, D, backward);
			else
				row_bf16((const uint16_t *)ta, sa,
					 (const uint16_t *)tc, sc[nd - 1],
					 (const uint16_t *)ts, ss[nd - 1],
					 (uint16_t *)to, D, backward);
		}
	}
	return EPJ_OK;
}

epj_status ej_kernel_ROPE(epj_ctx *ctx, const ej_call *c)
{
	(void)ctx;
	return rope_run(c, false);
}

epj_status ej_kernel_ROPE_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	(void)ctx;
	return rope_run(c, true);
}

/* rotate_half(x) with ops (for the gradient of sin). */
static epj_tensor *rotate_half(epj_ctx *ctx, epj_tensor *x)
{
	int64_t d = x->shape[x->ndim - 1];
	epj_tensor *x1 = epj_slice(ctx, x, -1, 0, d / 2, 1);
	epj_tensor *x2 = epj_slice(ctx, x, -1, d / 2, d, 1);
	epj_tensor *n2 = epj_neg(ctx, x2);
	epj_tensor *parts[2] = { n2, x1 };
	epj_tensor *r = n2 && x1 ? epj_cat(ctx, parts, 2, -1) : NULL;
	epj_tensor_free(x1);
	epj_tensor_free(x2);
	epj_tensor_free(n2);
	return r;
}

/* dx = ROPE_BACKWARD(g, cos, sin); dcos = sum_to(g * x), dsin =
 * sum_to(g * rotate_half(x)) over the dims cos / sin were broadcast
 * along. */
epj_status ej_backward_ROPE(epj_ctx *ctx, const ej_call *c,
			    epj_tensor *const *grad_out, const bool *needs,
			    epj_tensor **grad_in)
{
	epj_tensor *x = c->in[0], *g = grad_out[0];
	for (int i = 0; i < 3; i++) {
		if (!needs[i])
			continue;
		epj_tensor *t = c->in[i], *d = NULL;
		if (!g) {
			d = epj_zeros(ctx, t->dtype, t->ndim, t->shape);
		} else if (i == 0) {
			ej_attrs at = ej_attrs_none();
			epj_tensor *in[3] = { g, c->in[1], c->in[2] };
			d = ej_call1(ctx, EJ_OP_ROPE_BACKWARD, in, 3, &at);
		} else {
			epj_tensor *f =
			    i == 1 ? epj_tensor_ref(x) : rotate_half(ctx, x);
			epj_tensor *p = f ? epj_mul(ctx, g, f) : NULL;
			d = p ? epj_sum_to(ctx, p, t->ndim, t->shape) : NULL;
			epj_tensor_free(f);
			epj_tensor_free(p);
		}
		if (!d) {
			epj_status s = epj_ctx_status(ctx);
			return s != EPJ_OK ? s
					   : ej_error(ctx, EPJ_ERR_STATE,
						      "rope backward: an op "
						      "failed");
		}
		grad_in[i] = d;
	}
	return EPJ_OK;
}
