/* ops_pointwise.c -- elementwise ops: broadcasting binary arithmetic (add sub
 * mul div eq maximum), the select where, scalar ops, unary math (neg exp log
 * sqrt rsqrt silu sigmoid tanh gelu cos sin log1p), cast, and the silu/gelu
 * backward helpers.
 *
 * where (cond, a, b) copies elements whole, so it takes any dtypes (a and b
 * of one, cond of any) and is exact.
 *
 * Dtypes.  Float ops accept f32, bf16 and f64; bf16 is loaded as f32,
 * computed in f32 and stored with round-to-nearest-even.  Integer inputs
 * (i32/i64) are accepted only by add, sub, mul, eq, maximum and neg (exact
 * int64 arithmetic, wrapping on overflow, stored back in the input dtype) and
 * by cast; every other op rejects them with EPJ_ERR_DTYPE.  Binary inputs must
 * share one dtype; the output has that dtype (eq: 1/0 in a's dtype).  cast
 * converts any dtype to any: float -> int truncates toward zero, NaN -> 0,
 * out-of-range values saturate.
 *
 * Kernel engine.  Every kernel runs through one loop (pw_run): the output
 * (contiguous) and the inputs (broadcast strides, any layout, stride 0
 * allowed) are coalesced into as few dims as their strides allow, then the
 * innermost dim is cut into blocks of PW_BLK elements.  A block of an input
 * that is already in the compute type with unit stride is read in place;
 * otherwise it is gathered (and converted) into a stack buffer.  So the
 * common case -- contiguous f32 of equal shapes -- is one flat vectorisable
 * loop per block with no copies, and every other layout is still correct.
 * Blocks are spread over OpenMP threads when the output is large.
 *
 * Backward formulas use only public epj_* ops, so they run eagerly and while
 * tracing alike; broadcast inputs get their gradient through epj_sum_to.
 */
#include "ops_impl.h"

#include <stdint.h>

#include "ops_expf.h"

/* Work below this many elements stays on one thread. */
#define PW_PAR_MIN 32768
/* elements per conversion call of a parallel cast */
#define PW_CHUNK 16384
/* Elements per block of the innermost dim (3 stack buffers of this many
 * doubles per iteration: 24 KiB). */
#define PW_BLK 1024

#define PW_SQRT1_2	0.70710678118654752440 /* 1/sqrt(2) */
#define PW_INV_SQRT_2PI 0.39894228040143267794 /* 1/sqrt(2 pi) */

/* ---- compute types ------------------------------------------------------
 * The arithmetic type of one call: f32 for f32/bf16, f64 for f64, int64 for
 * the integer dtypes (cast picks f64 unless both sides are integers). */

typedef enum pw_ctype { CT_F32, CT_F64, CT_I64 } pw_ctype;

static pw_ctype ctype_of(epj_dtype dt)
{
	switch (dt) {
	case EPJ_DTYPE_F32:
	case EPJ_DTYPE_BF16:
		return CT_F32;
	case EPJ_DTYPE_F64:
		return CT_F64;
	default:
		return CT_I64;
	}
}

static bool is_int(epj_dtype dt)
{
	return dt == EPJ_DTYPE_I32 || dt == EPJ_DTYPE_I64;
}

/* True when dt's storage is already the compute type (no conversion). */
static bool native_p(epj_dtype dt, pw_ctype ct)
{
	return (ct == CT_F32 && dt == EPJ_DTYPE_F32) ||
	       (ct == CT_F64 && dt == EPJ_DTYPE_F64) ||
	       (ct == CT_I64 && dt == EPJ_DTYPE_I64);
}

/* Float -> int with truncation; NaN -> 0, saturating at the range ends. */
static inline int64_t sat_i64(double v, int64_t lo, int64_t hi)
{
	if (v != v)
		return 0;
	if (v <= (double)lo)
		return lo;
	if (v >= (double)hi)
		return hi;
	return (int64_t)v;
}

/* ---- float math ---------------------------------------------------------
 * One body for f32 and f64 (instantiated twice below) so the two precisions
 * cannot drift apart.  FM picks expf/exp ... by the argument's type. */

/* The f32 exp of generated C too (lib/ops_expf.h): arithmetic that `omp
 * simd` vectorises, where a libm call per element is not. */
EJ_EXPF_DEFINE(static inline)

#define FM(fn, x) _Generic((x), float : fn##f, double : fn)(x)
/* exp: lib/ops_expf.h's in f32, libm's in f64 */
#define FEXP(x)	      _Generic((x), float : ej_expf, double : exp)(x)
#define FM2(fn, x, y) _Generic((x), float : fn##f, double : fn)(x, y)
/* `omp simd` lets GCC vectorise at -O2 (its default cost model there
 * refuses loops that need an epilogue); no loop carries a dependence and
 * outputs never alias inputs. */
#define LOOP(body)                                                             \
	_Pragma("omp simd") for (int64_t i = 0; i < n; i++)                    \
	{                                                                      \
		body;                                                          \
	}

#define FLOAT_KERNELS(T, SFX)                                                  \
	EJ_ISA_CLONES static void unary_##SFX(                                 \
	    int op, T s, const T *restrict x, T *restrict y, int64_t n)        \
	{                                                                      \
		const T one = 1, half = (T)0.5;                                \
		switch (op) {                                                  \
		case EJ_OP_ADD_SCALAR:                                         \
			LOOP(y[i] = x[i] + s);                                 \
			break;                                                 \
		case EJ_OP_MUL_SCALAR:                                         \
			LOOP(y[i] = x[i] * s);                                 \
			break;                                                 \
		case EJ_OP_POW_SCALAR:                                         \
			if (s == 2) {                                          \
				LOOP(y[i] = x[i] * x[i]);                      \
			} else if (s == 1) {                                   \
				LOOP(y[i] = x[i]);                             \
			} else {                                               \
				LOOP(y[i] = FM2(pow, x[i], s));                \
			}                                                      \
			break;                                                 \
		case EJ_OP_NEG:                                                \
			LOOP(y[i] = -x[i]);                                    \
			break;                                                 \
		case EJ_OP_EXP:                                                \
			LOOP(y[i] = FEXP(x[i]));                               \
			break;                                                 \
		case EJ_OP_LOG:                                                \
			LOOP(y[i] = FM(log, x[i]));                            \
			break;                                                 \
		case EJ_OP_SQRT:                                               \
			LOOP(y[i] = FM(sqrt, x[i]));                           \
			break;                                                 \
		case EJ_OP_RSQRT:                                              \
			LOOP(y[i] = one / FM(sqrt, x[i]));                     \
			break;                                                 \
		case EJ_OP_SILU:                                               \
			LOOP(y[i] = x[i] / (one + FEXP(-x[i])));               \
			break;                                                 \
		case EJ_OP_SIGMOID:                                            \
			LOOP(y[i] = one / (one + FEXP(-x[i])));                \
			break;                                                 \
		case EJ_OP_TANH:                                               \
			LOOP(y[i] = FM(tanh, x[i]));                           \
			break;                                                 \
		case EJ_OP_COS:                                                \
			LOOP(y[i] = FM(cos, x[i]));                            \
			break;                                                 \
		case EJ_OP_SIN:                                                \
			LOOP(y[i] = FM(sin, x[i]));                            \
			break;                                                 \
		case EJ_OP_LOG1P:                                              \
			LOOP(y[i] = FM(log1p, x[i]));                          \
			break;                                                 \
		case EJ_OP_GELU:                                               \
			LOOP(y[i] = half * x[i] *                              \
				    (one + FM(erf, x[i] * (T)PW_SQRT1_2)));    \
			break;                                                 \
		default:                                                       \
			EJ_ASSERT(!"not a unary float op");                    \
		}                                                              \
	}                                                                      \
                                                                               \
	/* For the backward helpers a is the gradient and b is x. */           \
	EJ_ISA_CLONES static void binary_##SFX(int op, const T *restrict a,    \
					       const T *restrict b,            \
					       T *restrict y, int64_t n)       \
	{                                                                      \
		const T one = 1, half = (T)0.5;                                \
		switch (op) {                                                  \
		case EJ_OP_ADD:                                                \
			LOOP(y[i] = a[i] + b[i]);                              \
			break;                                                 \
		case EJ_OP_SUB:                                                \
			LOOP(y[i] = a[i] - b[i]);                              \
			break;                                                 \
		case EJ_OP_MUL:                                                \
			LOOP(y[i] = a[i] * b[i]);                              \
			break;                                                 \
		case EJ_OP_DIV:                                                \
			LOOP(y[i] = a[i] / b[i]);                              \
			break;                                                 \
		case EJ_OP_EQ:                                                 \
			LOOP(y[i] = a[i] == b[i] ? one : 0);                   \
			break;                                                 \
		case EJ_OP_MAXIMUM: /* the first NaN; a on ties */             \
			LOOP(y[i] =                                            \
				 (b[i] > a[i] || b[i] != b[i]) && a[i] == a[i] \
				     ? b[i]                                    \
				     : a[i]);                                  \
			break;                                                 \
		case EJ_OP_SILU_BACKWARD: /* g * s * (1 + x (1 - s)) */        \
			LOOP(T sg = one / (one + FEXP(-b[i]));                 \
			     y[i] = a[i] * sg * (one + b[i] * (one - sg)));    \
			break;                                                 \
		case EJ_OP_GELU_BACKWARD: /* g * (Phi(x) + x phi(x)) */        \
			LOOP(T cdf =                                           \
				 half * (one + FM(erf, b[i] * (T)PW_SQRT1_2)); \
			     T pdf = FEXP(-half * b[i] * b[i]) *               \
				     (T)PW_INV_SQRT_2PI;                       \
			     y[i] = a[i] * (cdf + b[i] * pdf));                \
			break;                                                 \
		default:                                                       \
			EJ_ASSERT(!"not a binary float op");                   \
		}                                                              \
	}

FLOAT_KERNELS(float, f32)
FLOAT_KERNELS(double, f64)

/* Integer ops wrap (computed in uint64: signed overflow is undefined). */
static void unary_i64(int op, const int64_t *restrict x, int64_t *restrict y,
		      int64_t n)
{
	EJ_ASSERT(op == EJ_OP_NEG);
	LOOP(y[i] = (int64_t)(0u - (uint64_t)x[i]));
}

static void binary_i64(int op, const int64_t *restrict a,
		       const int64_t *restrict b, int64_t *restrict y,
		       int64_t n)
{
	switch (op) {
	case EJ_OP_ADD:
		LOOP(y[i] = (int64_t)((uint64_t)a[i] + (uint64_t)b[i]));
		break;
	case EJ_OP_SUB:
		LOOP(y[i] = (int64_t)((uint64_t)a[i] - (uint64_t)b[i]));
		break;
	case EJ_OP_MUL:
		LOOP(y[i] = (int64_t)((uint64_t)a[i] * (uint64_t)b[i]));
		break;
	case EJ_OP_EQ:
		LOOP(y[i] = a[i] == b[i]);
		break;
	case EJ_OP_MAXIMUM:
		LOOP(y[i] = b[i] > a[i] ? b[i] : a[i]);
		break;
	default:
		EJ_ASSERT(!"not an integer op");
	}
}

/* ---- gather / store ------------------------------------------------------
 * gather: n elements of a dt array at data[off + i * st] into dst in the
 * compute type.  store: n compute-type values into a contiguous dt array. */

static void gather(const void *data, epj_dtype dt, int64_t off, int64_t st,
		   int64_t n, pw_ctype ct, void *dst)
{
	const char *p = data;
	if (ct == CT_F32) {
		float *d = dst;
		if (dt == EPJ_DTYPE_F32) {
			const float *s = (const float *)p + off;
			LOOP(d[i] = s[i * st]);
		} else {
			EJ_ASSERT(dt == EPJ_DTYPE_BF16);
			const uint16_t *s = (const uint16_t *)p + off;
			if (st == 1)
				ej_cvt_bf16_to_f32(s, d, n);
			else
				LOOP(d[i] = ej_bf16_load(s[i * st]));
		}
	} else if (ct == CT_F64) {
		double *d = dst;
		switch (dt) {
		case EPJ_DTYPE_F32: {
			const float *s = (const float *)p + off;
			LOOP(d[i] = s[i * st]);
			break;
		}
		case EPJ_DTYPE_BF16: {
			const uint16_t *s = (const uint16_t *)p + off;
			LOOP(d[i] = ej_bf16_load(s[i * st]));
			break;
		}
		case EPJ_DTYPE_F64: {
			const double *s = (const double *)p + off;
			LOOP(d[i] = s[i * st]);
			break;
		}
		case EPJ_DTYPE_I32: {
			const int32_t *s = (const int32_t *)p + off;
			LOOP(d[i] = (double)s[i * st]);
			break;
		}
		case EPJ_DTYPE_I64: {
			const int64_t *s = (const int64_t *)p + off;
			LOOP(d[i] = (double)s[i * st]);
			break;
		}
		default:
			EJ_ASSERT(!"bad dtype");
		}
	} else {
		int64_t *d = dst;
		if (dt == EPJ_DTYPE_I64) {
			const int64_t *s = (const int64_t *)p + off;
			LOOP(d[i] = s[i * st]);
		} else {
			EJ_ASSERT(dt == EPJ_DTYPE_I32);
			const int32_t *s = (const int32_t *)p + off;
			LOOP(d[i] = s[i * st]);
		}
	}
}

static void store(void *data, epj_dtype dt, int64_t off, int64_t n, pw_ctype ct,
		  const void *src)
{
	char *p = data;
	if (ct == CT_F32) {
		const float *s = src;
		if (dt == EPJ_DTYPE_F32) {
			memcpy((float *)p + off, s, (size_t)n * sizeof *s);
		} else {
			EJ_ASSERT(dt == EPJ_DTYPE_BF16);
			ej_cvt_f32_to_bf16(s, (uint16_t *)p + off, n);
		}
	} else if (ct == CT_F64) {
		const double *s = src;
		switch (dt) {
		case EPJ_DTYPE_F32: {
			float *d = (float *)p + off;
			LOOP(d[i] = (float)s[i]);
			break;
		}
		case EPJ_DTYPE_BF16: { /* via f32, as PyTorch rounds f64 */
			uint16_t *d = (uint16_t *)p + off;
			LOOP(d[i] = ej_bf16_store((float)s[i]));
			break;
		}
		case EPJ_DTYPE_F64:
			memcpy((double *)p + off, s, (size_t)n * sizeof *s);
			break;
		case EPJ_DTYPE_I32: {
			int32_t *d = (int32_t *)p + off;
			LOOP(d[i] =
				 (int32_t)sat_i64(s[i], INT32_MIN, INT32_MAX));
			break;
		}
		case EPJ_DTYPE_I64: {
			int64_t *d = (int64_t *)p + off;
			LOOP(d[i] = sat_i64(s[i], INT64_MIN, INT64_MAX));
			break;
		}
		default:
			EJ_ASSERT(!"bad dtype");
		}
	} else {
		const int64_t *s = src;
		if (dt == EPJ_DTYPE_I64) {
			memcpy((int64_t *)p + off, s, (size_t)n * sizeof *s);
		} else { /* i64 -> i32 keeps the low 32 bits (two's complement)
			  */
			EJ_ASSERT(dt == EPJ_DTYPE_I32);
			int32_t *d = (int32_t *)p + off;
			LOOP(d[i] = (int32_t)(uint32_t)(uint64_t)s[i]);
		}
	}
}

/* ---- the engine ----------------------------------------------------------
 */

#define PW_MAX_IN 3 /* where's (cond, a, b) */

/* Operand 0 is the output, 1..n_in the inputs; dims after coalescing. */
typedef struct pw_plan {
	int ndim, nops;
	int64_t shape[EPJ_MAX_DIMS];
	int64_t stride[PW_MAX_IN + 1][EPJ_MAX_DIMS];
} pw_plan;

/* Drops size-1 dims and merges dim d into the previous one when every
 * operand walks both as one (stride[prev] == stride[d] * shape[d]).  The
 * result has at least one dim; its innermost output stride is 1. */
static void pw_plan_build(pw_plan *p, const epj_tensor *out,
			  epj_tensor *const *in, int n_in)
{
	int nd = out->ndim;
	int64_t st[PW_MAX_IN + 1][EPJ_MAX_DIMS];
	ej_contiguous_strides(nd, out->shape, st[0]);
	for (int k = 0; k < n_in; k++)
		ej_broadcast_strides(in[k], nd, out->shape, st[k + 1]);
	p->nops = 1 + n_in;
	p->ndim = 0;
	for (int d = 0; d < nd; d++) {
		if (out->shape[d] == 1)
			continue;
		int l = p->ndim - 1;
		bool merge = l >= 0;
		for (int k = 0; merge && k < p->nops; k++)
			merge = p->stride[k][l] == st[k][d] * out->shape[d];
		if (merge) {
			p->shape[l] *= out->shape[d];
			for (int k = 0; k < p->nops; k++)
				p->stride[k][l] = st[k][d];
		} else {
			p->shape[++l] = out->shape[d];
			for (int k = 0; k < p->nops; k++)
				p->stride[k][l] = st[k][d];
			p->ndim++;
		}
	}
	if (p->ndim == 0) {
		p->ndim = 1;
		p->shape[0] = 1;
		for (int k = 0; k < p->nops; k++)
			p->stride[k][0] = 0;
	}
}

typedef union pw_buf {
	float f[PW_BLK];
	double d[PW_BLK];
	int64_t i[PW_BLK];
} pw_buf;

/* One call's fixed parameters. */
typedef struct pw_job {
	int op, n_in;
	pw_ctype ct;
	double s; /* scalar attribute (scalar ops) */
	const void *in[PW_MAX_IN];
	epj_dtype in_dt[PW_MAX_IN];
	void *out;
	epj_dtype out_dt;
} pw_job;

static void pw_compute(const pw_job *j, const void *const *src, void *dst,
		       int64_t n)
{
	switch (j->ct) {
	case CT_F32:
		if (j->n_in == 1)
			unary_f32(j->op, (float)j->s, src[0], dst, n);
		else
			binary_f32(j->op, src[0], src[1], dst, n);
		break;
	case CT_F64:
		if (j->n_in == 1)
			unary_f64(j->op, j->s, src[0], dst, n);
		else
			binary_f64(j->op, src[0], src[1], dst, n);
		break;
	case CT_I64:
		if (j->n_in == 1)
			unary_i64(j->op, src[0], dst, n);
		else
			binary_i64(j->op, src[0], src[1], dst, n);
		break;
	}
}

/* Runs n elements starting at element offsets off[] (per operand) with
 * innermost strides ist[] (inputs; the output's is 1). */
static void pw_block(const pw_job *j, const int64_t *off, const int64_t *ist,
		     int64_t n)
{
	pw_buf buf[3];
	const void *src[2] = { NULL, NULL };
	for (int k = 0; k < j->n_in; k++) {
		if (native_p(j->in_dt[k], j->ct) && ist[k] == 1) {
			src[k] =
			    (const char *)j->in[k] +
			    off[k + 1] * (int64_t)ej_dtype_size(j->in_dt[k]);
		} else {
			gather(j->in[k], j->in_dt[k], off[k + 1], ist[k], n,
			       j->ct, &buf[k]);
			src[k] = &buf[k];
		}
	}
	if (j->op == EJ_OP_CAST) { /* no arithmetic: convert on store */
		store(j->out, j->out_dt, off[0], n, j->ct, src[0]);
		return;
	}
	if (native_p(j->out_dt, j->ct)) {
		void *dst =
		    (char *)j->out + off[0] * (int64_t)ej_dtype_size(j->out_dt);
		pw_compute(j, src, dst, n);
	} else {
		pw_compute(j, src, &buf[2], n);
		store(j->out, j->out_dt, off[0], n, j->ct, &buf[2]);
	}
}

/* where: the condition's truth (x != 0; NaN is true, -0.0 false) of n
 * elements at data[off + i * st]. */
static void truth(const void *data, epj_dtype dt, int64_t off, int64_t st,
		  int64_t n, uint8_t *t)
{
	switch (dt) {
	case EPJ_DTYPE_F32: {
		const float *s = (const float *)data + off;
		LOOP(t[i] = s[i * st] != 0.0f);
		break;
	}
	case EPJ_DTYPE_BF16: { /* any bit but the sign */
		const uint16_t *s = (const uint16_t *)data + off;
		LOOP(t[i] = (s[i * st] & 0x7fffu) != 0);
		break;
	}
	case EPJ_DTYPE_F64: {
		const double *s = (const double *)data + off;
		LOOP(t[i] = s[i * st] != 0.0);
		break;
	}
	case EPJ_DTYPE_I32: {
		const int32_t *s = (const int32_t *)data + off;
		LOOP(t[i] = s[i * st] != 0);
		break;
	}
	case EPJ_DTYPE_I64: {
		const int64_t *s = (const int64_t *)data + off;
		LOOP(t[i] = s[i * st] != 0);
		break;
	}
	default:
		EJ_ASSERT(!"bad dtype");
	}
}

/* where: elements are copied whole (any dtype, bit for bit), a's where the
 * condition holds, else b's. */
#define WHERE_COPY(T)                                                          \
	do {                                                                   \
		const T *a = (const T *)j->in[1] + off[2];                     \
		const T *b = (const T *)j->in[2] + off[3];                     \
		T *d = (T *)j->out + off[0];                                   \
		int64_t sa = ist[1], sb = ist[2];                              \
		LOOP(d[i] = t[i] ? a[i * sa] : b[i * sb]);                     \
	} while (0)

static void where_block(const pw_job *j, const int64_t *off, const int64_t *ist,
			int64_t n)
{
	uint8_t t[PW_BLK];
	truth(j->in[0], j->in_dt[0], off[1], ist[0], n, t);
	switch (ej_dtype_size(j->out_dt)) {
	case 2:
		WHERE_COPY(uint16_t);
		break;
	case 4:
		WHERE_COPY(uint32_t);
		break;
	default:
		EJ_ASSERT(ej_dtype_size(j->out_dt) == 8);
		WHERE_COPY(uint64_t);
		break;
	}
}

static void pw_run(const pw_job *j, const pw_plan *p)
{
	int nd = p->ndim;
	int64_t len = p->shape[nd - 1];
	int64_t numel = ej_numel(nd, p->shape);
	if (numel == 0)
		return;
	int64_t rows = numel / len;
	int64_t nblk = (len + PW_BLK - 1) / PW_BLK;
	int64_t units = rows * nblk;
	int64_t ist[PW_MAX_IN] = { 0, 0, 0 };
	for (int k = 0; k < j->n_in; k++)
		ist[k] = p->stride[k + 1][nd - 1];

#pragma omp parallel for schedule(static) if (numel > PW_PAR_MIN)
	for (int64_t u = 0; u < units; u++) {
		int64_t row = u / nblk, j0 = (u % nblk) * PW_BLK;
		int64_t n = len - j0 < PW_BLK ? len - j0 : PW_BLK;
		int64_t off[PW_MAX_IN + 1];
		for (int k = 0; k < p->nops; k++)
			off[k] = j0 * p->stride[k][nd - 1];
		for (int d = nd - 2; d >= 0; d--) {
			int64_t digit = row % p->shape[d];
			row /= p->shape[d];
			for (int k = 0; k < p->nops; k++)
				off[k] += digit * p->stride[k][d];
		}
		if (j->op == EJ_OP_WHERE)
			where_block(j, off, ist, n);
		else
			pw_block(j, off, ist, n);
	}
}

static epj_status pw_kernel(epj_ctx *ctx, const ej_call *c, int op)
{
	epj_tensor *out = c->out[0];
	if (ej_numel(out->ndim, out->shape) == 0)
		return EPJ_OK; /* empty tensors may have no storage */
	pw_job j = { .op = op,
		     .n_in = c->n_in,
		     .out = ej_data(out),
		     .out_dt = out->dtype };
	EJ_ASSERT(c->n_in >= 1 && c->n_in <= (op == EJ_OP_WHERE ? 3 : 2));
	for (int k = 0; k < c->n_in; k++) {
		j.in[k] = ej_data(c->in[k]);
		j.in_dt[k] = c->in[k]->dtype;
	}
	if (op == EJ_OP_CAST)
		j.ct = is_int(j.in_dt[0]) && is_int(j.out_dt) ? CT_I64 : CT_F64;
	else
		j.ct = ctype_of(j.in_dt[0]);
	if (c->attrs && c->attrs->n_f > 0)
		j.s = c->attrs->f[0];
	pw_plan p;
	pw_plan_build(&p, out, c->in, c->n_in);
	pw_run(&j, &p);
	return EPJ_OK;
}

/* ---- infer --------------------------------------------------------------
 */

static epj_status infer_binary(epj_ctx *ctx, const ej_call *c, ej_meta *out,
			       bool ints_ok)
{
	int nd;
	int64_t shape[EPJ_MAX_DIMS];
	epj_status st = ej_broadcast_shape(ctx, c, 0, 1, &nd, shape);
	if (st == EPJ_OK)
		st = ej_check_same_dtype(ctx, c, 0, 1);
	if (st == EPJ_OK && !ints_ok)
		st = ej_check_float(ctx, c, 0);
	if (st == EPJ_OK)
		ej_meta_set(out, c->in[0]->dtype, nd, shape);
	return st;
}

static epj_status infer_unary(epj_ctx *ctx, const ej_call *c, ej_meta *out,
			      bool ints_ok)
{
	if (!ints_ok) {
		epj_status st = ej_check_float(ctx, c, 0);
		if (st != EPJ_OK)
			return st;
	}
	ej_meta_from(out, c->in[0]);
	return EPJ_OK;
}

static epj_status infer_scalar(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	if (!c->attrs || c->attrs->n_f < 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "missing scalar attribute f[0]");
	return infer_unary(ctx, c, out, false);
}

/* (grad, x) of one float dtype and equal shapes. */
static epj_status infer_bw_helper(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	const epj_tensor *g = c->in[0], *x = c->in[1];
	epj_status st = ej_check_same_dtype(ctx, c, 0, 1);
	if (st == EPJ_OK)
		st = ej_check_float(ctx, c, 0);
	if (st != EPJ_OK)
		return st;
	bool same = g->ndim == x->ndim;
	for (int d = 0; same && d < g->ndim; d++)
		same = g->shape[d] == x->shape[d];
	if (!same)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "grad and x must have equal shapes");
	ej_meta_from(out, x);
	return EPJ_OK;
}

epj_status ej_infer_ADD(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_binary(ctx, c, out, true);
}

epj_status ej_infer_SUB(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_binary(ctx, c, out, true);
}

epj_status ej_infer_MUL(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_binary(ctx, c, out, true);
}

epj_status ej_infer_DIV(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_binary(ctx, c, out, false);
}

epj_status ej_infer_EQ(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_binary(ctx, c, out, true);
}

epj_status ej_infer_MAXIMUM(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_binary(ctx, c, out, true);
}

/* (cond, a, b): the three shapes broadcast; a and b of one dtype (any), cond
 * of any dtype; the output a's dtype. */
epj_status ej_infer_WHERE(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	int nd;
	int64_t shape[EPJ_MAX_DIMS];
	epj_status st = ej_broadcast_shape(ctx, c, 0, 1, &nd, shape);
	if (st == EPJ_OK)
		st = ej_broadcast_more(ctx, c, 2, &nd, shape);
	if (st != EPJ_OK)
		return st;
	st = ej_check_same_dtype(ctx, c, 1, 2);
	if (st == EPJ_OK)
		ej_meta_set(out, c->in[1]->dtype, nd, shape);
	return st;
}

epj_status ej_infer_ADD_SCALAR(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_scalar(ctx, c, out);
}

epj_status ej_infer_MUL_SCALAR(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_scalar(ctx, c, out);
}

epj_status ej_infer_POW_SCALAR(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_scalar(ctx, c, out);
}

epj_status ej_infer_NEG(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_unary(ctx, c, out, true);
}

#define UNARY_FLOAT_INFER(ID)                                                  \
	epj_status ej_infer_##ID(epj_ctx *ctx, const ej_call *c, ej_meta *out) \
	{                                                                      \
		return infer_unary(ctx, c, out, false);                        \
	}
UNARY_FLOAT_INFER(EXP)
UNARY_FLOAT_INFER(LOG)
UNARY_FLOAT_INFER(SQRT)
UNARY_FLOAT_INFER(RSQRT)
UNARY_FLOAT_INFER(SILU)
UNARY_FLOAT_INFER(SIGMOID)
UNARY_FLOAT_INFER(TANH)
UNARY_FLOAT_INFER(GELU)
UNARY_FLOAT_INFER(COS)
UNARY_FLOAT_INFER(SIN)
UNARY_FLOAT_INFER(LOG1P)

epj_status ej_infer_CAST(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	if (!c->attrs || c->attrs->n_i < 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "missing target dtype attribute i[0]");
	int64_t dt = c->attrs->i[0];
	if (dt < 0 || dt >= EPJ_DTYPE_COUNT)
		return ej_op_error(ctx, c, EPJ_ERR_DTYPE,
				   "unknown target dtype %lld", (long long)dt);
	ej_meta_set(out, (epj_dtype)dt, c->in[0]->ndim, c->in[0]->shape);
	return EPJ_OK;
}

epj_status ej_infer_SILU_BACKWARD(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_bw_helper(ctx, c, out);
}

epj_status ej_infer_GELU_BACKWARD(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	return infer_bw_helper(ctx, c, out);
}

/* ---- kernels ------------------------------------------------------------
 */

#define PW_KERNEL(ID)                                                          \
	epj_status ej_kernel_##ID(epj_ctx *ctx, const ej_call *c)              \
	{                                                                      \
		return pw_kernel(ctx, c, EJ_OP_##ID);                          \
	}
PW_KERNEL(ADD)
PW_KERNEL(SUB)
PW_KERNEL(MUL)
PW_KERNEL(DIV)
PW_KERNEL(EQ)
PW_KERNEL(WHERE)
PW_KERNEL(ADD_SCALAR)
PW_KERNEL(MUL_SCALAR)
PW_KERNEL(POW_SCALAR)
PW_KERNEL(NEG)
PW_KERNEL(EXP)
PW_KERNEL(LOG)
PW_KERNEL(SQRT)
PW_KERNEL(RSQRT)
PW_KERNEL(SILU)
PW_KERNEL(SIGMOID)
PW_KERNEL(TANH)
PW_KERNEL(GELU)
PW_KERNEL(COS)
PW_KERNEL(SIN)
PW_KERNEL(LOG1P)
PW_KERNEL(SILU_BACKWARD)
PW_KERNEL(GELU_BACKWARD)
PW_KERNEL(MAXIMUM)

/* cast: f32 <-> bf16 of a contiguous tensor (the mixed-precision hot case)
 * is a direct loop; everything else goes through the engine. */
epj_status ej_kernel_CAST(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *x = c->in[0];
	epj_tensor *y = c->out[0];
	int64_t n = ej_numel(x->ndim, x->shape);
	if (n == 0)
		return EPJ_OK;
	int64_t chunks = (n + PW_CHUNK - 1) / PW_CHUNK;
	if (ej_dense(x) && x->dtype == EPJ_DTYPE_F32 &&
	    y->dtype == EPJ_DTYPE_BF16) {
		const float *s = ej_data(x);
		uint16_t *d = ej_data(y);
#pragma omp parallel for schedule(static) if (n > PW_PAR_MIN)
		for (int64_t k = 0; k < chunks; k++)
			ej_cvt_f32_to_bf16(s + k * PW_CHUNK, d + k * PW_CHUNK,
					   k + 1 < chunks ? PW_CHUNK
							  : n - k * PW_CHUNK);
		return EPJ_OK;
	}
	if (ej_dense(x) && x->dtype == EPJ_DTYPE_BF16 &&
	    y->dtype == EPJ_DTYPE_F32) {
		const uint16_t *s = ej_data(x);
		float *d = ej_data(y);
#pragma omp parallel for schedule(static) if (n > PW_PAR_MIN)
		for (int64_t k = 0; k < chunks; k++)
			ej_cvt_bf16_to_f32(s + k * PW_CHUNK, d + k * PW_CHUNK,
					   k + 1 < chunks ? PW_CHUNK
							  : n - k * PW_CHUNK);
		return EPJ_OK;
	}
	return pw_kernel(ctx, c, EJ_OP_CAST);
}

/* ---- backward -----------------------------------------------------------
 * Every needed grad_in[i] is set, or on failure all are released and the
 * status of the failing op is returned. */

epj_status ej_backward_done(epj_ctx *ctx, const ej_call *c, const bool *needs,
			    epj_tensor **grad_in)
{
	bool ok = true;
	for (int i = 0; i < c->n_in; i++)
		if (needs[i] && !grad_in[i])
			ok = false;
	if (ok)
		return EPJ_OK;
	for (int i = 0; i < c->n_in; i++) {
		epj_tensor_free(grad_in[i]);
		grad_in[i] = NULL;
	}
	epj_status st = epj_ctx_status(ctx);
	return st != EPJ_OK ? st
			    : ej_error(ctx, EPJ_ERR_STATE,
				       "%s backward: no gradient produced",
				       ej_ops[c->op].name);
}

/* No gradient reached the output: the input gradients are zeros. */
static epj_status bw_zeros(epj_ctx *ctx, const ej_call *c, const bool *needs,
			   epj_tensor **grad_in)
{
	for (int i = 0; i < c->n_in; i++)
		if (needs[i])
			grad_in[i] = epj_zeros(ctx, c->in[i]->dtype,
					       c->in[i]->ndim, c->in[i]->shape);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* g (broadcast shape) summed back to the shape of `like`; steals g. */
static epj_tensor *reduce_to(epj_ctx *ctx, epj_tensor *g,
			     const epj_tensor *like)
{
	epj_tensor *r = epj_sum_to(ctx, g, like->ndim, like->shape);
	epj_tensor_free(g);
	return r;
}

#define BW_ARGS                                                                \
	epj_ctx *ctx, const ej_call *c, epj_tensor *const *grad_out,           \
	    const bool *needs, epj_tensor **grad_in
#define BW_GRAD(g)                                                             \
	epj_tensor *g = grad_out[0];                                           \
	if (!g)                                                                \
		return bw_zeros(ctx, c, needs, grad_in);

epj_status ej_backward_ADD(BW_ARGS)
{
	BW_GRAD(g);
	for (int i = 0; i < 2; i++)
		if (needs[i])
			grad_in[i] =
			    reduce_to(ctx, epj_tensor_ref(g), c->in[i]);
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_SUB(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0])
		grad_in[0] = reduce_to(ctx, epj_tensor_ref(g), c->in[0]);
	if (needs[1])
		grad_in[1] = reduce_to(ctx, epj_neg(ctx, g), c->in[1]);
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_MUL(BW_ARGS)
{
	BW_GRAD(g);
	epj_tensor *a = c->in[0], *b = c->in[1];
	if (needs[0])
		grad_in[0] = reduce_to(ctx, epj_mul(ctx, g, b), a);
	if (needs[1])
		grad_in[1] = reduce_to(ctx, epj_mul(ctx, g, a), b);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* d(a/b)/da = 1/b; d(a/b)/db = -a/b^2 = -(g/b) * (a/b). */
epj_status ej_backward_DIV(BW_ARGS)
{
	BW_GRAD(g);
	epj_tensor *a = c->in[0], *b = c->in[1];
	epj_tensor *gb = epj_div(ctx, g, b);
	if (needs[0])
		grad_in[0] = reduce_to(ctx, epj_tensor_ref(gb), a);
	if (needs[1]) {
		epj_tensor *q = epj_div(ctx, a, b);
		epj_tensor *t = epj_mul(ctx, gb, q);
		grad_in[1] = reduce_to(ctx, epj_neg(ctx, t), b);
		epj_tensor_free(t);
		epj_tensor_free(q);
	}
	epj_tensor_free(gb);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* a's gradient is grad where cond, b's grad where not (each summed back to
 * its shape); the condition's is zero (the select is piecewise constant in
 * it). */
epj_status ej_backward_WHERE(BW_ARGS)
{
	BW_GRAD(g);
	epj_tensor *cond = c->in[0];
	if (needs[0])
		grad_in[0] =
		    epj_zeros(ctx, cond->dtype, cond->ndim, cond->shape);
	if (needs[1] || needs[2]) {
		epj_tensor *z = epj_zeros(ctx, g->dtype, 0, NULL);
		if (z && needs[1])
			grad_in[1] = reduce_to(ctx, epj_where(ctx, cond, g, z),
					       c->in[1]);
		if (z && needs[2])
			grad_in[2] = reduce_to(ctx, epj_where(ctx, cond, z, g),
					       c->in[2]);
		epj_tensor_free(z);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* 1 where a < b, else 0 (0 where either is NaN): maximum(a, b) == b
 * minus a == b. */
static epj_tensor *less(epj_ctx *ctx, epj_tensor *a, epj_tensor *b)
{
	epj_tensor *m = epj_maximum(ctx, a, b);
	epj_tensor *le = epj_eq(ctx, m, b);
	epj_tensor *eq = epj_eq(ctx, a, b);
	epj_tensor *r = epj_sub(ctx, le, eq);
	epj_tensor_free(m);
	epj_tensor_free(le);
	epj_tensor_free(eq);
	return r;
}

/* As torch's maximum: h = grad, halved where a == b; a gets h except
 * where a < b, b gets h except where b < a (so where either is NaN both
 * get the whole grad). */
epj_status ej_backward_MAXIMUM(BW_ARGS)
{
	BW_GRAD(g);
	epj_tensor *a = c->in[0], *b = c->in[1];
	epj_tensor *eq = epj_eq(ctx, a, b);
	epj_tensor *half = epj_mul_scalar(ctx, g, 0.5);
	epj_tensor *h = epj_where(ctx, eq, half, g);
	epj_tensor *z = epj_zeros(ctx, epj_tensor_dtype(g), 0, NULL);
	for (int i = 0; i < 2; i++) {
		if (!needs[i])
			continue;
		epj_tensor *lt = i == 0 ? less(ctx, a, b) : less(ctx, b, a);
		grad_in[i] = reduce_to(ctx, epj_where(ctx, lt, z, h), c->in[i]);
		epj_tensor_free(lt);
	}
	epj_tensor_free(eq);
	epj_tensor_free(half);
	epj_tensor_free(h);
	epj_tensor_free(z);
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_ADD_SCALAR(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0])
		grad_in[0] = epj_tensor_ref(g);
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_MUL_SCALAR(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0])
		grad_in[0] = epj_mul_scalar(ctx, g, c->attrs->f[0]);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* d x^p = p x^(p-1); p == 0 gives zeros (not 0 * x^-1, NaN at 0). */
epj_status ej_backward_POW_SCALAR(BW_ARGS)
{
	BW_GRAD(g);
	if (!needs[0])
		return EPJ_OK;
	double p = c->attrs->f[0];
	epj_tensor *x = c->in[0];
	if (p == 0) {
		grad_in[0] = epj_zeros(ctx, x->dtype, x->ndim, x->shape);
	} else if (p == 1) {
		grad_in[0] = epj_tensor_ref(g);
	} else {
		epj_tensor *t = epj_pow_scalar(ctx, x, p - 1);
		epj_tensor *d = epj_mul_scalar(ctx, t, p);
		grad_in[0] = epj_mul(ctx, g, d);
		epj_tensor_free(d);
		epj_tensor_free(t);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_NEG(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0])
		grad_in[0] = epj_neg(ctx, g);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* exp' = out (saved). */
epj_status ej_backward_EXP(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0])
		grad_in[0] = epj_mul(ctx, g, c->out[0]);
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_LOG(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0])
		grad_in[0] = epj_div(ctx, g, c->in[0]);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* sqrt' = 0.5 / out. */
epj_status ej_backward_SQRT(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0]) {
		epj_tensor *h = epj_mul_scalar(ctx, g, 0.5);
		grad_in[0] = epj_div(ctx, h, c->out[0]);
		epj_tensor_free(h);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* rsqrt' = -0.5 x^-1.5 = -0.5 out^3. */
epj_status ej_backward_RSQRT(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0]) {
		epj_tensor *o3 = epj_pow_scalar(ctx, c->out[0], 3.0);
		epj_tensor *d = epj_mul_scalar(ctx, o3, -0.5);
		grad_in[0] = epj_mul(ctx, g, d);
		epj_tensor_free(d);
		epj_tensor_free(o3);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_SILU(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0]) {
		epj_tensor *in[2] = { g, c->in[0] };
		ej_attrs at = ej_attrs_none();
		grad_in[0] = ej_call1(ctx, EJ_OP_SILU_BACKWARD, in, 2, &at);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* sigmoid' = out (1 - out). */
epj_status ej_backward_SIGMOID(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0]) {
		epj_tensor *y = c->out[0];
		epj_tensor *ny = epj_neg(ctx, y);
		epj_tensor *om = epj_add_scalar(ctx, ny, 1.0);
		epj_tensor *d = epj_mul(ctx, y, om);
		grad_in[0] = epj_mul(ctx, g, d);
		epj_tensor_free(d);
		epj_tensor_free(om);
		epj_tensor_free(ny);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* tanh' = 1 - out^2. */
epj_status ej_backward_TANH(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0]) {
		epj_tensor *y = c->out[0];
		epj_tensor *y2 = epj_mul(ctx, y, y);
		epj_tensor *ny2 = epj_neg(ctx, y2);
		epj_tensor *d = epj_add_scalar(ctx, ny2, 1.0);
		grad_in[0] = epj_mul(ctx, g, d);
		epj_tensor_free(d);
		epj_tensor_free(ny2);
		epj_tensor_free(y2);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

epj_status ej_backward_GELU(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0]) {
		epj_tensor *in[2] = { g, c->in[0] };
		ej_attrs at = ej_attrs_none();
		grad_in[0] = ej_call1(ctx, EJ_OP_GELU_BACKWARD, in, 2, &at);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* cos' = -sin x. */
epj_status ej_backward_COS(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0]) {
		epj_tensor *s = epj_sin(ctx, c->in[0]);
		epj_tensor *gs = epj_mul(ctx, g, s);
		grad_in[0] = epj_neg(ctx, gs);
		epj_tensor_free(gs);
		epj_tensor_free(s);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* sin' = cos x. */
epj_status ej_backward_SIN(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0]) {
		epj_tensor *co = epj_cos(ctx, c->in[0]);
		grad_in[0] = epj_mul(ctx, g, co);
		epj_tensor_free(co);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* log1p' = 1 / (1 + x). */
epj_status ej_backward_LOG1P(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0]) {
		epj_tensor *d = epj_add_scalar(ctx, c->in[0], 1.0);
		grad_in[0] = epj_div(ctx, g, d);
		epj_tensor_free(d);
	}
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* The gradient goes back to the input's dtype (only float inputs can
 * require grad). */
epj_status ej_backward_CAST(BW_ARGS)
{
	BW_GRAD(g);
	if (needs[0])
		grad_in[0] = epj_cast(ctx, g, c->in[0]->dtype);
	return ej_backward_done(ctx, c, needs, grad_in);
}

/* ---- public wrappers -----------------------------------------------------
 */

static epj_tensor *call_binary(epj_ctx *ctx, int op, epj_tensor *a,
			       epj_tensor *b)
{
	epj_tensor *in[2] = { a, b };
	ej_attrs at = ej_attrs_none();
	return ej_call1(ctx, op, in, 2, &at);
}

static epj_tensor *call_unary(epj_ctx *ctx, int op, epj_tensor *a)
{
	ej_attrs at = ej_attrs_none();
	return ej_call1(ctx, op, &a, 1, &at);
}

static epj_tensor *call_scalar(epj_ctx *ctx, int op, epj_tensor *a, double s)
{
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_f(&at, s);
	return ej_call1(ctx, op, &a, 1, &at);
}

epj_tensor *epj_add(epj_ctx *ctx, epj_tensor *a, epj_tensor *b)
{
	return call_binary(ctx, EJ_OP_ADD, a, b);
}

epj_tensor *epj_sub(epj_ctx *ctx, epj_tensor *a, epj_tensor *b)
{
	return call_binary(ctx, EJ_OP_SUB, a, b);
}

epj_tensor *epj_mul(epj_ctx *ctx, epj_tensor *a, epj_tensor *b)
{
	return call_binary(ctx, EJ_OP_MUL, a, b);
}

epj_tensor *epj_div(epj_ctx *ctx, epj_tensor *a, epj_tensor *b)
{
	return call_binary(ctx, EJ_OP_DIV, a, b);
}

epj_tensor *epj_eq(epj_ctx *ctx, epj_tensor *a, epj_tensor *b)
{
	return call_binary(ctx, EJ_OP_EQ, a, b);
}

epj_tensor *epj_where(epj_ctx *ctx, epj_tensor *cond, epj_tensor *a,
		      epj_tensor *b)
{
	epj_tensor *in[3] = { cond, a, b };
	ej_attrs at = ej_attrs_none();
	return ej_call1(ctx, EJ_OP_WHERE, in, 3, &at);
}

epj_tensor *epj_maximum(epj_ctx *ctx, epj_tensor *a, epj_tensor *b)
{
	return call_binary(ctx, EJ_OP_MAXIMUM, a, b);
}

epj_tensor *epj_add_scalar(epj_ctx *ctx, epj_tensor *a, double s)
{
	return call_scalar(ctx, EJ_OP_ADD_SCALAR, a, s);
}

epj_tensor *epj_mul_scalar(epj_ctx *ctx, epj_tensor *a, double s)
{
	return call_scalar(ctx, EJ_OP_MUL_SCALAR, a, s);
}

epj_tensor *epj_pow_scalar(epj_ctx *ctx, epj_tensor *a, double exponent)
{
	return call_scalar(ctx, EJ_OP_POW_SCALAR, a, exponent);
}

epj_tensor *epj_neg(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_NEG, a);
}

epj_tensor *epj_exp(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_EXP, a);
}

epj_tensor *epj_log(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_LOG, a);
}

epj_tensor *epj_sqrt(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_SQRT, a);
}

epj_tensor *epj_rsqrt(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_RSQRT, a);
}

epj_tensor *epj_silu(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_SILU, a);
}

epj_tensor *epj_sigmoid(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_SIGMOID, a);
}

epj_tensor *epj_tanh(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_TANH, a);
}

epj_tensor *epj_gelu(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_GELU, a);
}

epj_tensor *epj_cos(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_COS, a);
}

epj_tensor *epj_sin(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_SIN, a);
}

epj_tensor *epj_log1p(epj_ctx *ctx, epj_tensor *a)
{
	return call_unary(ctx, EJ_OP_LOG1P, a);
}

/* A cast to the tensor's own dtype is the identity: a new reference, no op
 * (as PyTorch's .to() returns self), which also keeps traces smaller. */
epj_tensor *epj_cast(epj_ctx *ctx, epj_tensor *a, epj_dtype dt)
{
	if (!a) /* dispatch reports (or keeps) the error */
		return ej_call1(ctx, EJ_OP_CAST, &a, 1, NULL);
	if (a->dtype == dt)
		return epj_tensor_ref(a);
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, (int64_t)dt);
	return ej_call1(ctx, EJ_OP_CAST, &a, 1, &at);
}
