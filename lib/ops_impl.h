/* ops_impl.h -- shared helpers for the op implementations (lib/ops_*.c).
 *
 * Every op family file includes this header, implements for each of its rows
 * in ops.def: ej_infer_ID, ej_kernel_ID and (if differentiable)
 * ej_backward_ID, plus the public epj_* wrappers of its ops.  Backward
 * formulas use only public epj_* ops so they work eagerly and while tracing.
 */
#ifndef EPJIT_OPS_IMPL_H
#define EPJIT_OPS_IMPL_H

#include "core_impl.h"

#include <math.h>
#include <string.h>

#define EJ_OP(id, name, nin, nout, flags) EJ_OP_FNS(id)
#include "ops.def"
#undef EJ_OP

/* Sets an error "<op>: <message> (inputs: f32[2,3], i64[4])" naming the op
 * and the shapes and dtypes of the call's inputs.  Returns s. */
epj_status ej_op_error(epj_ctx *ctx, const ej_call *c, epj_status s,
		       const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Checks used by infer functions; each sets an ej_op_error on failure. */
epj_status ej_check_float(epj_ctx *ctx, const ej_call *c, int input);
epj_status ej_check_index_dtype(epj_ctx *ctx, const ej_call *c, int input);
epj_status ej_check_same_dtype(epj_ctx *ctx, const ej_call *c, int a, int b);
/* lib/ops_index.c: index input `input` of the call (i32/i64, any strides)
 * read row-major into a malloc'ed int64 array (*out, caller frees), every
 * value checked in [0, limit); `what` names the indexed axis in the error.
 * And t's elements as a dense row-major array of dtype dt: t's own data
 * when it already is one, else a malloc'ed copy also returned in *tmp
 * (caller frees); NULL with an error when out of memory. */
epj_status ej_load_index(epj_ctx *ctx, const ej_call *c, int input,
			 int64_t limit, const char *what, int64_t **out);
const char *ej_dense_as(epj_ctx *ctx, const ej_call *c, const epj_tensor *t,
			epj_dtype dt, void **tmp);
/* Normalises axis for an input of ndim dims, or sets an error. */
epj_status ej_check_axis(epj_ctx *ctx, const ej_call *c, int64_t axis, int ndim,
			 int *out_axis);

/* Broadcasts input b into the shape (*ndim, shape) in place. */
epj_status ej_broadcast_more(epj_ctx *ctx, const ej_call *c, int b, int *ndim,
			     int64_t *shape);
/* Broadcast shape of inputs a and b of the call (numpy rules). */
epj_status ej_broadcast_shape(epj_ctx *ctx, const ej_call *c, int a, int b,
			      int *ndim, int64_t *shape);
/* Strides that read t as if broadcast to (ndim, shape): 0 on broadcast
 * dims, leading dims added. */
void ej_broadcast_strides(const epj_tensor *t, int ndim, const int64_t *shape,
			  int64_t *stride);

static inline void ej_meta_set(ej_meta *m, epj_dtype dt, int ndim,
			       const int64_t *shape)
{
	memset(m, 0, sizeof *m);
	m->dtype = dt;
	m->ndim = ndim;
	for (int i = 0; i < ndim; i++)
		m->shape[i] = shape[i];
}

static inline void ej_meta_from(ej_meta *m, const epj_tensor *t)
{
	ej_meta_set(m, t->dtype, t->ndim, t->shape);
}

/* Element offset (in elements, relative to ej_data) of multi-index idx. */
static inline int64_t ej_offset_of(int ndim, const int64_t *idx,
				   const int64_t *stride)
{
	int64_t o = 0;
	for (int i = 0; i < ndim; i++)
		o += idx[i] * stride[i];
	return o;
}

/* Advances a row-major multi-index; returns false after the last one. */
static inline bool ej_index_next(int ndim, const int64_t *shape, int64_t *idx)
{
	for (int i = ndim - 1; i >= 0; i--) {
		if (++idx[i] < shape[i])
			return true;
		idx[i] = 0;
	}
	return false;
}

/* Reads element i (flat, through strides) of a 1-D index tensor. */
int64_t ej_index_at(const epj_tensor *idx, int64_t i);

/* True when the tensor can be read as a dense contiguous array. */
static inline bool ej_dense(const epj_tensor *t)
{
	return ej_is_contiguous(t);
}

/* ---- BLAS helpers shared by ops_linalg.c and ops_attention.c ------------
 * (documented at their definitions in ops_linalg.c) */
bool ej_linalg_layout(int64_t rows, int64_t cols, int64_t srow, int64_t scol,
		      bool *trans, int64_t *ld);
void ej_linalg_convert(const void *src, epj_dtype sdt, int64_t ss, void *dst,
		       epj_dtype ddt, int64_t n);
void ej_linalg_pack(const epj_tensor *t, epj_dtype cdt, void *dst);
void ej_linalg_store(const void *src, epj_dtype cdt, void *dst, epj_dtype dt,
		     int64_t n);
epj_status ej_linalg_operand(epj_ctx *ctx, const ej_call *c,
			     const epj_tensor *t, epj_dtype cdt,
			     const void **base, int64_t *stride, bool *trans,
			     int64_t *ld, void **owned);
void ej_linalg_gemm(epj_dtype cdt, bool ta, bool tb, int64_t m, int64_t n,
		    int64_t k, double alpha, const void *a, int64_t lda,
		    const void *b, int64_t ldb, double beta, void *c,
		    int64_t ldc);
/* bf16 GEMM on AMX tiles (lib/gemm_amx.c): c[m, n] (row stride ldc) =
 * alpha * A B + beta * c in f32, A [m, k] element (i, p) at
 * a[i * sam + p * sak], B [k, n] element (p, j) at b[p * sbk + j * sbn];
 * k > 0, ej_amx_usable(), and scratch holds ej_amx_scratch(m, n, k) bytes
 * aligned to 64. */
bool ej_amx_usable(void);
size_t ej_amx_scratch(int64_t m, int64_t n, int64_t k);
/* Whether a product on ctx runs on the tiles: operands a and b
 * both bf16, the context not opted out (EPJIT_CPU_AMX=0), the CPU able,
 * and macs multiply-adds in all (>= 16 x 16 x 32, below which 32 x 32
 * blocks do not pay). */
bool ej_amx_wanted(epj_ctx *ctx, epj_dtype a, epj_dtype b, int64_t macs);
/* Scratch for products of up to [m, k] x [k, n] (free() it), counted as
 * one product on the tiles (kernels.cpu_amx); NULL when memory is short:
 * the caller takes its f32 path. */
void *ej_amx_begin(epj_ctx *ctx, int64_t m, int64_t n, int64_t k);
void ej_gemm_bf16_amx(int64_t m, int64_t n, int64_t k, float alpha,
		      const uint16_t *a, int64_t sam, int64_t sak,
		      const uint16_t *b, int64_t sbk, int64_t sbn, float beta,
		      float *c, int64_t ldc, void *scratch);
/* OpenBLAS's kernels on CPUs newer than its release (lib/blas_core.c):
 * ej_blas_ready() before a BLAS call (once a process; cheap after); the
 * CPU's features (EJ_CPU_*, what the CPU and the OS support); the core
 * worth selecting when OpenBLAS chose `chosen` on a CPU with feats (NULL:
 * keep it); OpenBLAS's current core (NULL: not OpenBLAS); the
 * re-selection itself; the test hook
 * that makes the next ej_blas_ready() look again. */
enum {
	EJ_CPU_AVX = 1,
	EJ_CPU_AVX2_FMA = 2,
	EJ_CPU_AVX512 = 4, /* F, DQ, CD, BW, VL */
	EJ_CPU_AVX512_BF16 = 8
};
void ej_blas_ready(void);
unsigned ej_cpu_features(void);
const char *ej_blas_core_pick(const char *chosen, unsigned feats);
const char *ej_blas_core_name(void);
/* Re-runs a DYNAMIC_ARCH OpenBLAS's selection with OPENBLAS_CORETYPE=name
 * (unset again after); false when this BLAS cannot be re-selected. */
bool ej_blas_core_select(const char *name);
void ej_blas_ready_reset(void);
int ej_linalg_blas_serial_begin(void);
void ej_linalg_blas_serial_end(int prev);
int ej_linalg_max_threads(void);
/* GEMM_ADD run in place (the compiled graphs' GEMM epilogue, jit/interp.c):
 * r += a @ op(b) in r's own buffer (attrs as GEMM_ADD), counted as one
 * launch.  Allowed only when ej_gemm_add_can_reuse: r is the only
 * reference to its storage, contiguous, of its compute dtype (f32, f64),
 * not an autograd tensor, and a and b do not read that storage. */
bool ej_gemm_add_can_reuse(const epj_tensor *a, const epj_tensor *b,
			   const epj_tensor *r);
epj_status ej_gemm_add_inplace(epj_ctx *ctx, const ej_attrs *attrs,
			       epj_tensor *a, epj_tensor *b, epj_tensor *r);

/* ---- helpers shared by op families --------------------------------------
 * (ops_pointwise.c with ops_reduce.c, ops_index.c with ops_shape.c) */

/* bf16 <-> f32 exactly as epj_bf16_to_f32 / epj_f32_to_bf16 (round to
 * nearest even, NaN kept and made quiet), inline so conversion loops
 * vectorise. */
static inline float ej_bf16_load(uint16_t b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;
	memcpy(&f, &u, sizeof f);
	return f;
}

static inline uint16_t ej_bf16_store(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof u);
	if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it, make it quiet */
		return (uint16_t)((u >> 16) | 0x40u);
	u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
	return (uint16_t)(u >> 16);
}

/* EJ_ISA_CLONES: the hot loops of the CPU kernels (conversions, pointwise
 * arithmetic) are built twice on x86-64, for the baseline and for AVX2,
 * and the loader picks the clone the CPU runs (an ifunc), so the eager
 * kernels use the vector width the generated C gets (jit/hostcc.c) without
 * building the library for one machine.  AVX2 without FMA: no contraction
 * is possible, so both clones compute the same bits.  gcc only: clang 14
 * leaves the clones of an extern function unresolvable behind the
 * library's symbol map (a clang build runs the baseline loops). */
#if defined(__x86_64__) && defined(__ELF__) && defined(__has_attribute) &&     \
    !defined(__clang__) && !defined(EJ_NO_ISA_CLONES)
#if __has_attribute(target_clones)
#define EJ_ISA_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef EJ_ISA_CLONES
#define EJ_ISA_CLONES
#endif
/* clang reports "loop not vectorized" (-Wpass-failed) for simd loops it
 * leaves scalar, e.g. around libm calls in a clone: correct code, not a
 * defect of the source. */
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

/* Dense conversions, bit for bit ej_bf16_load / ej_bf16_store (dtype.c). */
void ej_cvt_bf16_to_f32(const uint16_t *restrict s, float *restrict d,
			int64_t n);
void ej_cvt_f32_to_bf16(const float *restrict s, uint16_t *restrict d,
			int64_t n);

/* Last step of a backward: EPJ_OK when every needed grad_in[i] is set;
 * otherwise releases all of grad_in (NULLs them) and returns the status of
 * the op that failed, or EPJ_ERR_STATE "<op> backward: no gradient
 * produced".  (ops_pointwise.c) */
epj_status ej_backward_done(epj_ctx *ctx, const ej_call *c, const bool *needs,
			    epj_tensor **grad_in);

/* The gradient of output j of the call (a new reference), or zeros of that
 * output's shape when no gradient flows into it. */
static inline epj_tensor *ej_grad_or_zeros(epj_ctx *ctx, const ej_call *c,
					   epj_tensor *const *grad_out, int j)
{
	if (grad_out[j])
		return epj_tensor_ref(grad_out[j]);
	EJ_ASSERT(c->out[j]);
	return epj_zeros(ctx, c->out[j]->dtype, c->out[j]->ndim,
			 c->out[j]->shape);
}

/* Stores g (owned, may be NULL) in *slot: EPJ_OK, or the context's status
 * when g is NULL (the op that made it failed). */
static inline epj_status ej_set_grad(epj_ctx *ctx, epj_tensor **slot,
				     epj_tensor *g)
{
	*slot = g;
	return g ? EPJ_OK : ctx->status;
}

#endif /* EPJIT_OPS_IMPL_H */
