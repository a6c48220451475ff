/* ops_linalg.c -- MATMUL, LINEAR and SOLVE_TRIANGULAR: shape inference, CPU
 * reference kernels on BLAS (OpenBLAS through <cblas.h>), backward formulas,
 * public wrappers.
 *
 * Compute dtype: f64 inputs run dgemm; f32 runs sgemm; bf16 is converted to
 * f32 temporaries, multiplied with sgemm and rounded back (RNE) once at the
 * end, so a bf16 product carries one rounding per output element.
 *
 * BLAS reads a [rows, cols] matrix in place whenever its two strides are a
 * row-major (stride pattern (ld, 1)) or a transposed row-major ((1, ld))
 * layout; the backward formulas pass epj_transpose views, so that path must
 * not copy.  Any other matrix layout (stride 0 from expand, steps from
 * slice) is packed into a contiguous temporary.  Batch dims only move the
 * base pointer, so they may have any strides.
 *
 * The BLAS helpers (ej_linalg_*) are shared with ops_attention.c, which
 * declares their prototypes itself (they belong in ops_impl.h).
 */
#include "ops_impl.h"

#include <cblas.h>
#include <limits.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- shared BLAS helpers ------------------------------------------------- */

/* Compute dtype of a float op: f64 stays f64, f32 and bf16 compute in f32. */
static epj_dtype compute_dtype(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
}

static int64_t max1(int64_t v)
{
	return v > 1 ? v : 1;
}

/* How BLAS can read the [rows, cols] matrix whose element (i, j) sits at
 * i * srow + j * scol: as a row-major matrix (trans false, ld = srow), as the
 * transpose of a row-major [cols, rows] matrix (trans true, ld = scol), or
 * not at all (returns false: the caller packs).  Strides of size-1 dims are
 * irrelevant; BLAS wants ld >= max(1, stored columns). */
bool ej_linalg_layout(int64_t rows, int64_t cols, int64_t srow, int64_t scol,
		      bool *trans, int64_t *ld)
{
	if ((cols <= 1 || scol == 1) && (rows <= 1 || srow >= max1(cols))) {
		*trans = false;
		*ld = rows <= 1 ? max1(cols) : srow;
		return *ld <= INT_MAX;
	}
	if ((rows <= 1 || srow == 1) && (cols <= 1 || scol >= max1(rows))) {
		*trans = true;
		*ld = cols <= 1 ? max1(rows) : scol;
		return *ld <= INT_MAX;
	}
	return false;
}

/* Converts n elements read with stride `ss` (elements) from src (dtype sdt)
 * into the dense array dst of dtype ddt. */
void ej_linalg_convert(const void *src_, epj_dtype sdt, int64_t ss, void *dst,
		       epj_dtype ddt, int64_t n)
{
	const char *src = src_;
	if (sdt == EPJ_DTYPE_F32 && ddt == EPJ_DTYPE_F32) {
		const float *s = (const float *)src;
		float *d = dst;
		if (ss == 1)
			memcpy(d, s, (size_t)n * sizeof *d);
		else
			for (int64_t i = 0; i < n; i++)
				d[i] = s[i * ss];
	} else if (sdt == EPJ_DTYPE_BF16 && ddt == EPJ_DTYPE_F32) {
		const uint16_t *s = (const uint16_t *)src;
		float *d = dst;
		if (ss == 1)
			ej_cvt_bf16_to_f32(s, d, n);
		else
			for (int64_t i = 0; i < n; i++)
				d[i] = ej_bf16_load(s[i * ss]);
	} else if (sdt == EPJ_DTYPE_F64 && ddt == EPJ_DTYPE_F64) {
		const double *s = (const double *)src;
		double *d = dst;
		if (ss == 1)
			memcpy(d, s, (size_t)n * sizeof *d);
		else
			for (int64_t i = 0; i < n; i++)
				d[i] = s[i * ss];
	} else {
		size_t es = ej_dtype_size(sdt), ed = ej_dtype_size(ddt);
		for (int64_t i = 0; i < n; i++)
			ej_store_f64(
			    (char *)dst + (size_t)i * ed, ddt,
			    ej_load_f64(src + (size_t)(i * ss) * es, sdt));
	}
}

/* Copies t (any strides) into dst as a dense row-major array of dtype cdt
 * (f32 or f64), numel(t) elements. */
void ej_linalg_pack(const epj_tensor *t, epj_dtype cdt, void *dst)
{
	int nd = t->ndim;
	int64_t n = ej_numel(nd, t->shape);
	if (n == 0)
		return;
	int64_t inner = nd > 0 ? t->shape[nd - 1] : 1;
	int64_t sin = nd > 0 ? t->stride[nd - 1] : 0;
	int64_t rows = n / inner;
	const char *src = ej_data(t);
	size_t es = ej_dtype_size(t->dtype), ed = ej_dtype_size(cdt);
#pragma omp parallel for schedule(static) if (n > (1 << 18))
	for (int64_t r = 0; r < rows; r++) {
		int64_t rem = r, off = 0;
		for (int d = nd - 2; d >= 0; d--) {
			off += (rem % t->shape[d]) * t->stride[d];
			rem /= t->shape[d];
		}
		ej_linalg_convert(src + (size_t)off * es, t->dtype, sin,
				  (char *)dst + (size_t)(r * inner) * ed, cdt,
				  inner);
	}
}

/* Writes n dense values of dtype cdt into the dense array dst of dtype dt
 * (bf16: round to nearest even). */
void ej_linalg_store(const void *src, epj_dtype cdt, void *dst, epj_dtype dt,
		     int64_t n)
{
	if (cdt == dt) {
		memcpy(dst, src, (size_t)n * ej_dtype_size(dt));
	} else if (cdt == EPJ_DTYPE_F32 && dt == EPJ_DTYPE_BF16) {
		const float *s = src;
		uint16_t *d = dst;
		const int64_t chunk = 1 << 14;
		int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (n > (1 << 18))
		for (int64_t k = 0; k < chunks; k++)
			ej_cvt_f32_to_bf16(s + k * chunk, d + k * chunk,
					   k + 1 < chunks ? chunk
							  : n - k * chunk);
	} else {
		ej_linalg_convert(src, cdt, 1, dst, dt, n);
	}
}

/* Prepares t ([..., R, C], ndim >= 2) as a BLAS operand in compute dtype
 * cdt.  *base is element 0 and stride[0..ndim) its strides: t's own when t
 * already has dtype cdt and a BLAS layout, else those of a packed contiguous
 * copy returned in *owned (free() it; NULL when t is used in place).
 * *trans and *ld give the layout of every [R, C] matrix. */
epj_status ej_linalg_operand(epj_ctx *ctx, const ej_call *c,
			     const epj_tensor *t, epj_dtype cdt,
			     const void **base, int64_t *stride, bool *trans,
			     int64_t *ld, void **owned)
{
	int nd = t->ndim;
	int64_t rows = t->shape[nd - 2], cols = t->shape[nd - 1];
	*owned = NULL;
	if (t->dtype == cdt && ej_linalg_layout(rows, cols, t->stride[nd - 2],
						t->stride[nd - 1], trans, ld)) {
		*base = ej_data(t);
		memcpy(stride, t->stride, (size_t)nd * sizeof *stride);
		return EPJ_OK;
	}
	/* a bf16 parameter: its f32 view, converted once (lib/wcache.c) */
	const float *tf =
	    cdt == EPJ_DTYPE_F32 &&
		    ej_linalg_layout(rows, cols, t->stride[nd - 2],
				     t->stride[nd - 1], trans, ld)
		? ej_param_f32(ctx, t)
		: NULL;
	if (tf) {
		*base = tf;
		memcpy(stride, t->stride, (size_t)nd * sizeof *stride);
		return EPJ_OK;
	}
	int64_t n = ej_numel(nd, t->shape);
	void *buf = malloc((size_t)max1(n) * ej_dtype_size(cdt));
	if (!buf)
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "out of memory packing an operand (%lld "
				   "elements)",
				   (long long)n);
	ej_linalg_pack(t, cdt, buf);
	ej_contiguous_strides(nd, t->shape, stride);
	bool ok = ej_linalg_layout(rows, cols, stride[nd - 2], stride[nd - 1],
				   trans, ld);
	if (!ok) {
		free(buf);
		return ej_op_error(ctx, c, EPJ_ERR_UNSUPPORTED,
				   "matrix of %lld columns exceeds the BLAS "
				   "integer range",
				   (long long)cols);
	}
	*base = buf;
	*owned = buf;
	return EPJ_OK;
}

/* C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C, all row-major in
 * dtype cdt (f32: sgemm, f64: dgemm).  op(A) = A^T when ta (A stored as
 * [k, m]), likewise B.  k == 0 scales C by beta without calling BLAS (some
 * BLAS builds reject ld < 1 there). */
void ej_linalg_gemm(epj_dtype cdt, bool ta, bool tb, int64_t m, int64_t n,
		    int64_t k, double alpha, const void *a, int64_t lda,
		    const void *b, int64_t ldb, double beta, void *c,
		    int64_t ldc)
{
	if (m <= 0 || n <= 0)
		return;
	EJ_ASSERT(ldc >= n);
	ej_blas_ready();
	if (k <= 0) {
		for (int64_t i = 0; i < m; i++)
			for (int64_t j = 0; j < n; j++) {
				if (cdt == EPJ_DTYPE_F64) {
					double *p = (double *)c + i * ldc + j;
					*p = beta == 0 ? 0 : beta * *p;
				} else {
					float *p = (float *)c + i * ldc + j;
					*p = beta == 0 ? 0 : (float)beta * *p;
				}
			}
		return;
	}
	EJ_ASSERT(lda >= (ta ? m : k) && ldb >= (tb ? k : n));
	EJ_ASSERT(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX &&
		  lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX);
	enum CBLAS_TRANSPOSE cta = ta ? CblasTrans : CblasNoTrans;
	enum CBLAS_TRANSPOSE ctb = tb ? CblasTrans : CblasNoTrans;
	if (cdt == EPJ_DTYPE_F64)
		cblas_dgemm(CblasRowMajor, cta, ctb, (int)m, (int)n, (int)k,
			    alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
	else
		cblas_sgemm(CblasRowMajor, cta, ctb, (int)m, (int)n, (int)k,
			    (float)alpha, a, (int)lda, b, (int)ldb, (float)beta,
			    c, (int)ldc);
}

/* BLAS threads inside our own OpenMP regions.  A pthreads build of OpenBLAS
 * called from several OpenMP threads at once oversubscribes the cores and its
 * workers spin against each other (attention ran 40x slower on 2 cores).  So
 * a kernel that spreads independent GEMMs over OpenMP threads makes BLAS
 * single-threaded for the duration of that region, as PyTorch does around
 * its parallel_for; an OpenMP build of OpenBLAS does this by itself, other
 * CBLAS libraries are left alone.  The setting is process-wide: a BLAS call
 * from another host thread meanwhile runs single-threaded (slower, still
 * correct).  Returns the count to hand to ej_linalg_blas_serial_end. */
int ej_linalg_blas_serial_begin(void)
{
#ifdef OPENBLAS_VERSION
	if (openblas_get_parallel() == 1) {
		int n = openblas_get_num_threads();
		if (n > 1)
			openblas_set_num_threads(1);
		return n;
	}
#endif
	return 0;
}

void ej_linalg_blas_serial_end(int prev)
{
#ifdef OPENBLAS_VERSION
	if (prev > 1)
		openblas_set_num_threads(prev);
#else
	(void)prev;
#endif
}

int ej_linalg_max_threads(void)
{
#ifdef _OPENMP
	return omp_get_max_threads();
#else
	return 1;
#endif
}

/* Batched GEMMs go over OpenMP threads (BLAS serial) when each is small
 * enough that OpenBLAS would run it on one thread anyway (it does below
 * 64^3 multiply-adds) or when there are enough of them to balance; else one
 * after the other on a threaded BLAS. */
#define SMALL_GEMM_MACS (64 * 64 * 64)

static bool batches_in_parallel(int64_t nbatch, int64_t macs)
{
	int nthr = ej_linalg_max_threads();
	return nthr > 1 && nbatch > 1 &&
	       (macs <= SMALL_GEMM_MACS || nbatch >= 4 * (int64_t)nthr);
}

static bool fits_int(int64_t v)
{
	return v >= 0 && v <= INT_MAX;
}

/* Backward results: NULL from an op means the op has set the error. */
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

static bool same_shape(const epj_tensor *a, const epj_tensor *b)
{
	if (a->ndim != b->ndim)
		return false;
	for (int i = 0; i < a->ndim; i++)
		if (a->shape[i] != b->shape[i])
			return false;
	return true;
}

/* ---- MATMUL: a [..., M, K] @ b [..., K, N] -> [..., M, N] -----------------
 */

epj_status ej_infer_MATMUL(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	epj_status s;
	if ((s = ej_check_float(ctx, c, 0)) ||
	    (s = ej_check_float(ctx, c, 1)) ||
	    (s = ej_check_same_dtype(ctx, c, 0, 1)))
		return s;
	const epj_tensor *a = c->in[0], *b = c->in[1];
	if (a->ndim < 2 || b->ndim < 2)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "inputs need at least 2 dims ([..., M, K] @ "
				   "[..., K, N]; 1-D is not accepted)");
	char sa[96], sb[96];
	ej_shape_str(a->ndim, a->shape, sa, sizeof sa);
	ej_shape_str(b->ndim, b->shape, sb, sizeof sb);
	int64_t k = a->shape[a->ndim - 1];
	if (b->shape[b->ndim - 2] != k)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "inner dimensions differ: a %s has K=%lld, "
				   "b %s has K=%lld",
				   sa, (long long)k, sb,
				   (long long)b->shape[b->ndim - 2]);
	/* batch dims broadcast as numpy does, aligned at the right */
	int na = a->ndim - 2, nb = b->ndim - 2, n = na > nb ? na : nb;
	int64_t shape[EPJ_MAX_DIMS];
	for (int d = 0; d < n; d++) {
		int da = d - (n - na), db = d - (n - nb);
		int64_t ea = da >= 0 ? a->shape[da] : 1;
		int64_t eb = db >= 0 ? b->shape[db] : 1;
		if (ea != eb && ea != 1 && eb != 1)
			return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
					   "batch dimensions of a %s and b %s "
					   "do not broadcast",
					   sa, sb);
		shape[d] = ea == 1 ? eb : ea;
	}
	shape[n] = a->shape[a->ndim - 2];
	shape[n + 1] = b->shape[b->ndim - 1];
	ej_meta_set(out, a->dtype, n + 2, shape);
	return EPJ_OK;
}

/* Strides that walk t's batch dims as if broadcast to the output's nbd batch
 * dims (0 where t has no such dim or size 1).  tstride: t's strides. */
static void batch_strides(const epj_tensor *t, const int64_t *tstride, int nbd,
			  int64_t *out)
{
	int nt = t->ndim - 2;
	for (int d = 0; d < nbd; d++) {
		int dt = d - (nbd - nt);
		out[d] = (dt < 0 || t->shape[dt] == 1) ? 0 : tstride[dt];
	}
}

/* The product a @ b into pc, a dense [nbatch, m, n] array of the compute
 * dtype of o's dtype (o: the product's shape), C = a @ b + beta * C. */
static epj_status matmul_run(epj_ctx *ctx, const ej_call *c,
			     const epj_tensor *a, const epj_tensor *b,
			     const epj_tensor *o, void *pc, double beta)
{
	int nd = o->ndim, nbd = nd - 2;
	int64_t m = o->shape[nd - 2], n = o->shape[nd - 1];
	int64_t k = a->shape[a->ndim - 1];
	int64_t nbatch = ej_numel(nbd, o->shape);
	if (!fits_int(m) || !fits_int(n) || !fits_int(k))
		return ej_op_error(
		    ctx, c, EPJ_ERR_UNSUPPORTED,
		    "matrix sizes exceed the BLAS integer range");
	epj_dtype cdt = compute_dtype(o->dtype);
	size_t es = ej_dtype_size(cdt);
	void *scratch =
	    cdt == EPJ_DTYPE_F32 &&
		    ej_amx_wanted(ctx, a->dtype, b->dtype, m * n * k)
		? ej_amx_begin(ctx, m, n, k)
		: NULL;
	if (scratch) {
		int64_t sa[EPJ_MAX_DIMS], sb[EPJ_MAX_DIMS];
		batch_strides(a, a->stride, nbd, sa);
		batch_strides(b, b->stride, nbd, sb);
		for (int64_t p = 0; p < nbatch; p++) {
			int64_t rem = p, oa = 0, ob = 0;
			for (int d = nbd - 1; d >= 0; d--) {
				int64_t i = rem % o->shape[d];
				rem /= o->shape[d];
				oa += i * sa[d];
				ob += i * sb[d];
			}
			ej_gemm_bf16_amx(
			    m, n, k, 1.0f, (const uint16_t *)ej_data(a) + oa,
			    a->stride[a->ndim - 2], a->stride[a->ndim - 1],
			    (const uint16_t *)ej_data(b) + ob,
			    b->stride[b->ndim - 2], b->stride[b->ndim - 1],
			    (float)beta, (float *)pc + p * m * n, n, scratch);
		}
		free(scratch);
		return EPJ_OK;
	}

	const void *pa = NULL, *pb = NULL;
	void *owned_a = NULL, *owned_b = NULL;
	int64_t stra[EPJ_MAX_DIMS], strb[EPJ_MAX_DIMS], lda = 0, ldb = 0;
	bool ta = false, tb = false;
	epj_status s = EPJ_OK;
	if (k > 0) {
		s = ej_linalg_operand(ctx, c, a, cdt, &pa, stra, &ta, &lda,
				      &owned_a);
		if (s == EPJ_OK)
			s = ej_linalg_operand(ctx, c, b, cdt, &pb, strb, &tb,
					      &ldb, &owned_b);
		if (s != EPJ_OK)
			goto done;
	}
	int64_t sa[EPJ_MAX_DIMS], sb[EPJ_MAX_DIMS];
	if (k > 0) {
		batch_strides(a, stra, nbd, sa);
		batch_strides(b, strb, nbd, sb);
	}
	bool par = batches_in_parallel(nbatch, m * n * k);
	int blas_prev = par ? ej_linalg_blas_serial_begin() : 0;
#pragma omp parallel for schedule(static) if (par)
	for (int64_t p = 0; p < nbatch; p++) {
		int64_t rem = p, oa = 0, ob = 0;
		for (int d = nbd - 1; d >= 0 && k > 0; d--) {
			int64_t i = rem % o->shape[d];
			rem /= o->shape[d];
			oa += i * sa[d];
			ob += i * sb[d];
		}
		ej_linalg_gemm(
		    cdt, ta, tb, m, n, k, 1.0,
		    k > 0 ? (const char *)pa + (size_t)oa * es : NULL, lda,
		    k > 0 ? (const char *)pb + (size_t)ob * es : NULL, ldb,
		    beta, (char *)pc + (size_t)(p * m * n) * es, n);
	}
	if (par)
		ej_linalg_blas_serial_end(blas_prev);
done:
	free(owned_a);
	free(owned_b);
	return s;
}

epj_status ej_kernel_MATMUL(epj_ctx *ctx, const ej_call *c)
{
	epj_tensor *o = c->out[0];
	int64_t numel = ej_numel(o->ndim, o->shape);
	if (numel == 0)
		return EPJ_OK;
	epj_dtype cdt = compute_dtype(o->dtype);
	void *pc = ej_data(o), *owned_c = NULL;
	if (o->dtype != cdt) {
		owned_c = malloc((size_t)numel * ej_dtype_size(cdt));
		if (!owned_c)
			return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					   "out of memory for the f32 result");
		pc = owned_c;
	}
	epj_status s = matmul_run(ctx, c, c->in[0], c->in[1], o, pc, 0.0);
	if (s == EPJ_OK && owned_c)
		ej_linalg_store(owned_c, cdt, ej_data(o), o->dtype, numel);
	free(owned_c);
	return s;
}

/* dA = grad @ B^T, dB = A^T @ grad; each summed back over the batch dims its
 * input was broadcast along. */
epj_status ej_backward_MATMUL(epj_ctx *ctx, const ej_call *c,
			      epj_tensor *const *grad_out, const bool *needs,
			      epj_tensor **grad_in)
{
	epj_tensor *a = c->in[0], *b = c->in[1], *g = grad_out[0];
	for (int i = 0; i < 2; i++) {
		if (!needs[i])
			continue;
		epj_tensor *x = c->in[i], *d;
		if (!g) {
			d = zeros_like(ctx, x);
		} else if (i == 0) {
			epj_tensor *bt =
			    epj_transpose(ctx, b, b->ndim - 2, b->ndim - 1);
			d = epj_matmul(ctx, g, bt);
			epj_tensor_free(bt);
		} else {
			epj_tensor *at =
			    epj_transpose(ctx, a, a->ndim - 2, a->ndim - 1);
			d = epj_matmul(ctx, at, g);
			epj_tensor_free(at);
		}
		if (d && !same_shape(d, x)) {
			epj_tensor *r = epj_sum_to(ctx, d, x->ndim, x->shape);
			epj_tensor_free(d);
			d = r;
		}
		if (!d)
			return bw_status(ctx, "matmul");
		grad_in[i] = d;
	}
	return EPJ_OK;
}

epj_tensor *epj_matmul(epj_ctx *ctx, epj_tensor *a, epj_tensor *b)
{
	ej_attrs at = ej_attrs_none();
	epj_tensor *in[2] = { a, b };
	return ej_call1(ctx, EJ_OP_MATMUL, in, 2, &at);
}

/* ---- LINEAR: x [..., in] @ w [out, in]^T (+ bias [out]) -> [..., out] ---- */

epj_status ej_infer_LINEAR(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	if (c->n_in < 2 || c->n_in > 3)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "takes (x, w) or (x, w, bias), got %d "
				   "inputs",
				   c->n_in);
	epj_status s;
	for (int i = 0; i < c->n_in; i++)
		if ((s = ej_check_float(ctx, c, i)) ||
		    (i > 0 && (s = ej_check_same_dtype(ctx, c, 0, i))))
			return s;
	const epj_tensor *x = c->in[0], *w = c->in[1];
	if (x->ndim < 1 || w->ndim != 2)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "expects x [..., in] and w [out, in]");
	if (x->shape[x->ndim - 1] != w->shape[1])
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "x has %lld input features, w [out, in] has "
				   "%lld",
				   (long long)x->shape[x->ndim - 1],
				   (long long)w->shape[1]);
	if (c->n_in == 3) {
		const epj_tensor *bias = c->in[2];
		if (bias->ndim != 1 || bias->shape[0] != w->shape[0])
			return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
					   "bias must be [out] = [%lld]",
					   (long long)w->shape[0]);
	}
	ej_meta_set(out, x->dtype, x->ndim, x->shape);
	out->shape[x->ndim - 1] = w->shape[0];
	return EPJ_OK;
}

/* Row stride of x read as a [rows, in] matrix when its leading dims merge
 * into one (size-1 dims ignored); false when they do not. */
static bool rows_stride(const epj_tensor *x, int64_t *srow)
{
	int nd = x->ndim;
	int last = -1; /* innermost leading dim of size > 1 seen so far */
	*srow = max1(x->shape[nd - 1]);
	for (int d = nd - 2; d >= 0; d--) {
		if (x->shape[d] == 1)
			continue;
		if (last < 0)
			*srow = x->stride[d];
		else if (x->stride[d] != x->stride[last] * x->shape[last])
			return false;
		last = d;
	}
	return true;
}

/* x @ w^T (+ bias) into pc, a dense [rows, out] array of the compute
 * dtype cdt: C = x @ w^T + beta * C (a bias is added once on top). */
static epj_status linear_run(epj_ctx *ctx, const ej_call *c,
			     const epj_tensor *x, const epj_tensor *w,
			     const epj_tensor *bias, epj_dtype cdt, void *pc,
			     double beta)
{
	int64_t fin = w->shape[1], fout = w->shape[0];
	int64_t rows = ej_numel(x->ndim - 1, x->shape);
	if (rows == 0 || fout == 0)
		return EPJ_OK;
	if (!fits_int(rows) || !fits_int(fin) || !fits_int(fout))
		return ej_op_error(
		    ctx, c, EPJ_ERR_UNSUPPORTED,
		    "matrix sizes exceed the BLAS integer range");
	size_t es = ej_dtype_size(cdt);
	void *owned_x = NULL, *owned_w = NULL, *owned_b = NULL;
	epj_status s = EPJ_OK;

	/* bias: fill every output row with it (beta = 0), or add it to every
	 * row (beta = 1), then let the GEMM accumulate onto it, so the bias
	 * costs no extra pass over C */
	if (bias && beta == 0.0) {
		ej_linalg_pack(bias, cdt, pc);
		for (int64_t r = 1; r < rows; r++)
			memcpy((char *)pc + (size_t)(r * fout) * es, pc,
			       (size_t)fout * es);
		beta = 1.0;
	} else if (bias) {
		owned_b = malloc((size_t)fout * es);
		if (!owned_b) {
			s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					"out of memory for the bias");
			goto done;
		}
		ej_linalg_pack(bias, cdt, owned_b);
		for (int64_t r = 0; r < rows; r++)
			for (int64_t j = 0; j < fout; j++) {
				if (cdt == EPJ_DTYPE_F64)
					((double *)pc)[r * fout + j] +=
					    ((double *)owned_b)[j];
				else
					((float *)pc)[r * fout + j] +=
					    ((float *)owned_b)[j];
			}
	}
	int64_t srow;
	void *scratch =
	    cdt == EPJ_DTYPE_F32 &&
		    ej_amx_wanted(ctx, x->dtype, w->dtype, rows * fout * fin) &&
		    rows_stride(x, &srow)
		? ej_amx_begin(ctx, rows, fout, fin)
		: NULL;
	if (scratch) { /* B = w^T: element (i, j) is w[j, i] */
		ej_gemm_bf16_amx(rows, fout, fin, 1.0f, ej_data(x), srow,
				 x->stride[x->ndim - 1], ej_data(w),
				 w->stride[1], w->stride[0], (float)beta, pc,
				 fout, scratch);
		free(scratch);
		goto done;
	}
	/* x as A [rows, in]: in place when its rows merge and BLAS can read
	 * them, else a packed copy */
	const void *px = ej_data(x);
	bool tx = false;
	int64_t ldx = max1(fin);
	if (!(x->dtype == cdt && rows_stride(x, &srow) &&
	      ej_linalg_layout(rows, fin, srow, x->stride[x->ndim - 1], &tx,
			       &ldx))) {
		owned_x = malloc((size_t)max1(rows * fin) * es);
		if (!owned_x) {
			s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					"out of memory packing x");
			goto done;
		}
		ej_linalg_pack(x, cdt, owned_x);
		px = owned_x;
		tx = false;
		ldx = max1(fin);
	}
	/* w^T as B [in, out]: element (i, j) is w[j, i] */
	const void *pw = ej_data(w);
	bool tw = false;
	int64_t ldw = 0;
	/* a bf16 parameter: its f32 view, converted once (lib/wcache.c) */
	const float *wf = cdt == EPJ_DTYPE_F32 ? ej_param_f32(ctx, w) : NULL;
	if (wf && ej_linalg_layout(fin, fout, w->stride[1], w->stride[0], &tw,
				   &ldw)) {
		pw = wf;
	} else if (!(w->dtype == cdt &&
		     ej_linalg_layout(fin, fout, w->stride[1], w->stride[0],
				      &tw, &ldw))) {
		owned_w = malloc((size_t)max1(fout * fin) * es);
		if (!owned_w) {
			s = ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					"out of memory packing w");
			goto done;
		}
		ej_linalg_pack(w, cdt, owned_w);
		pw = owned_w;
		tw = true; /* dense w [out, in] is w^T transposed */
		ldw = max1(fin);
	}
	ej_linalg_gemm(cdt, tx, tw, rows, fout, fin, 1.0, px, ldx, pw, ldw,
		       beta, pc, fout);
done:
	free(owned_x);
	free(owned_w);
	free(owned_b);
	return s;
}

epj_status ej_kernel_LINEAR(epj_ctx *ctx, const ej_call *c)
{
	epj_tensor *o = c->out[0];
	int64_t numel = ej_numel(o->ndim, o->shape);
	if (numel == 0)
		return EPJ_OK;
	epj_dtype cdt = compute_dtype(o->dtype);
	void *pc = ej_data(o), *owned_c = NULL;
	if (o->dtype != cdt) {
		owned_c = malloc((size_t)numel * ej_dtype_size(cdt));
		if (!owned_c)
			return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					   "out of memory for the f32 result");
		pc = owned_c;
	}
	epj_status s = linear_run(ctx, c, c->in[0], c->in[1],
				  c->n_in == 3 ? c->in[2] : NULL, cdt, pc, 0.0);
	if (s == EPJ_OK && owned_c)
		ej_linalg_store(owned_c, cdt, ej_data(o), o->dtype, numel);
	free(owned_c);
	return s;
}

/* With g2 = grad as [rows, out] and x2 = x as [rows, in]:
 * dx = g2 @ w (reshaped to x), dw = g2^T @ x2, dbias = sum of g2 over rows. */
epj_status ej_backward_LINEAR(epj_ctx *ctx, const ej_call *c,
			      epj_tensor *const *grad_out, const bool *needs,
			      epj_tensor **grad_in)
{
	epj_tensor *x = c->in[0], *w = c->in[1], *g = grad_out[0];
	if (!g) {
		for (int i = 0; i < c->n_in; i++)
			if (needs[i] &&
			    !(grad_in[i] = zeros_like(ctx, c->in[i])))
				return bw_status(ctx, "linear");
		return EPJ_OK;
	}
	int64_t rows = ej_numel(x->ndim - 1, x->shape);
	int64_t g2s[2] = { rows, w->shape[0] };
	epj_tensor *g2 = epj_reshape(ctx, g, 2, g2s);
	if (!g2)
		return bw_status(ctx, "linear");
	epj_status s = EPJ_OK;
	if (needs[0]) {
		epj_tensor *d = epj_matmul(ctx, g2, w);
		grad_in[0] = epj_reshape(ctx, d, x->ndim, x->shape);
		epj_tensor_free(d);
		if (!grad_in[0])
			s = bw_status(ctx, "linear");
	}
	if (s == EPJ_OK && needs[1]) {
		int64_t x2s[2] = { rows, w->shape[1] };
		epj_tensor *x2 = epj_reshape(ctx, x, 2, x2s);
		epj_tensor *g2t = epj_transpose(ctx, g2, 0, 1);
		grad_in[1] = epj_matmul(ctx, g2t, x2);
		epj_tensor_free(x2);
		epj_tensor_free(g2t);
		if (!grad_in[1])
			s = bw_status(ctx, "linear");
	}
	if (s == EPJ_OK && c->n_in == 3 && needs[2]) {
		grad_in[2] = epj_sum(ctx, g2, 0, false);
		if (!grad_in[2])
			s = bw_status(ctx, "linear");
	}
	epj_tensor_free(g2);
	return s;
}

epj_tensor *epj_linear(epj_ctx *ctx, epj_tensor *x, epj_tensor *w,
		       epj_tensor *bias)
{
	ej_attrs at = ej_attrs_none();
	epj_tensor *in[3] = { x, w, bias };
	return ej_call1(ctx, EJ_OP_LINEAR, in, bias ? 3 : 2, &at);
}

/* ---- GEMM_ADD: r + reshape(a @ op(b), shape of r) -------------------------
 * The compiler's GEMM epilogue (jit/passes.c): the residual r is the GEMM's
 * C operand with beta = 1, so the sum costs no pass of its own.  i[0] = 0:
 * a @ b with MATMUL's shapes; 1: a @ b^T with LINEAR's (b = w [out, in]).
 * r has the product's element count and dtype, any shape and strides.  The
 * sum is rounded once (bf16: the product is not rounded before the add). */

static epj_status gemm_add_product(epj_ctx *ctx, const ej_call *c,
				   ej_meta *prod)
{
	epj_tensor *in2[2] = { c->in[0], c->in[1] };
	ej_attrs none = ej_attrs_none();
	ej_call sub = { .op = c->attrs->i[0] ? EJ_OP_LINEAR : EJ_OP_MATMUL,
			.attrs = &none,
			.in = in2,
			.n_in = 2 };
	return c->attrs->i[0] ? ej_infer_LINEAR(ctx, &sub, prod)
			      : ej_infer_MATMUL(ctx, &sub, prod);
}

epj_status ej_infer_GEMM_ADD(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	if (c->attrs->n_i < 1 || c->attrs->i[0] < 0 || c->attrs->i[0] > 1)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "i[0] must be 0 (matmul) or 1 (linear)");
	ej_meta prod;
	epj_status s = gemm_add_product(ctx, c, &prod);
	if (s != EPJ_OK)
		return s;
	const epj_tensor *r = c->in[2];
	if (r->dtype != prod.dtype)
		return ej_op_error(ctx, c, EPJ_ERR_DTYPE,
				   "the residual's dtype differs from the "
				   "product's");
	if (ej_numel(r->ndim, r->shape) != ej_numel(prod.ndim, prod.shape)) {
		char sr[96], sp[96];
		ej_shape_str(r->ndim, r->shape, sr, sizeof sr);
		ej_shape_str(prod.ndim, prod.shape, sp, sizeof sp);
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "residual %s has another element count "
				   "than the product %s",
				   sr, sp);
	}
	ej_meta_set(out, r->dtype, r->ndim, r->shape);
	return EPJ_OK;
}

/* o = bf16(r + bf16(p)): the bf16 epilogue, eager's product store and
 * add, vectorised (AVX2 clone; the same bits as the scalar form). */
EJ_ISA_CLONES static void add_rounded_bf16(const uint16_t *restrict r,
					   const float *restrict p,
					   uint16_t *restrict o, int64_t n)
{
#pragma omp simd
	for (int64_t i = 0; i < n; i++)
		o[i] = ej_bf16_store(ej_bf16_load(r[i]) +
				     ej_bf16_load(ej_bf16_store(p[i])));
}

/* out = r + a @ op(b); out may be r itself (the in-place form). */
static epj_status gemm_add_into(epj_ctx *ctx, const ej_call *c, epj_tensor *o)
{
	const epj_tensor *a = c->in[0], *b = c->in[1], *r = c->in[2];
	int64_t numel = ej_numel(o->ndim, o->shape);
	if (numel == 0)
		return EPJ_OK;
	ej_meta prod;
	epj_status s = gemm_add_product(ctx, c, &prod);
	if (s != EPJ_OK)
		return s;
	epj_dtype cdt = compute_dtype(o->dtype);
	void *pc = ej_data(o), *owned_c = NULL;
	if (o->dtype != cdt) {
		owned_c = malloc((size_t)numel * ej_dtype_size(cdt));
		if (!owned_c)
			return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
					   "out of memory for the f32 result");
		pc = owned_c;
	}
	/* f32 / f64: C = r, then C += a @ op(b).  bf16: the product alone in
	 * f32, rounded to bf16 as the MATMUL / LINEAR kernels store it, then
	 * added to r with one more rounding: eager's two roundings exactly */
	double beta = owned_c ? 0.0 : 1.0;
	if (!owned_c && ej_data(o) != ej_data(r))
		ej_linalg_pack(r, cdt, pc);
	if (c->attrs->i[0]) {
		s = linear_run(ctx, c, a, b, NULL, cdt, pc, beta);
	} else {
		epj_tensor po = { .dtype = o->dtype, .ndim = prod.ndim };
		memcpy(po.shape, prod.shape, sizeof po.shape);
		s = matmul_run(ctx, c, a, b, &po, pc, beta);
	}
	if (s == EPJ_OK && owned_c) {
		EJ_ASSERT(cdt == EPJ_DTYPE_F32 && o->dtype == EPJ_DTYPE_BF16);
		float *p = owned_c;
		uint16_t *po = ej_data(o);
		if (ej_is_contiguous(r)) {
			const uint16_t *pr = ej_data(r);
			const int64_t chunk = 1 << 14;
			int64_t chunks = (numel + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (numel > (1 << 18))
			for (int64_t q = 0; q < chunks; q++) {
				int64_t i0 = q * chunk;
				add_rounded_bf16(pr + i0, p + i0, po + i0,
						 q + 1 < chunks ? chunk
								: numel - i0);
			}
		} else {
			float *rf = malloc((size_t)numel * sizeof *rf);
			if (!rf) {
				free(owned_c);
				return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
						   "out of memory for the "
						   "residual");
			}
			ej_linalg_pack(r, cdt, rf);
			for (int64_t i = 0; i < numel; i++)
				p[i] =
				    rf[i] + ej_bf16_load(ej_bf16_store(p[i]));
			free(rf);
			ej_linalg_store(owned_c, cdt, po, o->dtype, numel);
		}
	}
	free(owned_c);
	return s;
}

epj_status ej_kernel_GEMM_ADD(epj_ctx *ctx, const ej_call *c)
{
	return gemm_add_into(ctx, c, c->out[0]);
}

bool ej_gemm_add_can_reuse(const epj_tensor *a, const epj_tensor *b,
			   const epj_tensor *r)
{
	if (!r->storage || r->refcount != 1 || r->storage->refcount != 1 ||
	    r->requires_grad || r->grad_fn ||
	    compute_dtype(r->dtype) != r->dtype || !ej_is_contiguous(r))
		return false;
	/* a or b reading r's storage would see partial sums */
	return (!a->storage || a->storage != r->storage) &&
	       (!b->storage || b->storage != r->storage);
}

epj_status ej_gemm_add_inplace(epj_ctx *ctx, const ej_attrs *attrs,
			       epj_tensor *a, epj_tensor *b, epj_tensor *r)
{
	EJ_ASSERT(ej_gemm_add_can_reuse(a, b, r));
	epj_tensor *in[3] = { a, b, r };
	epj_tensor *out[1] = { r };
	ej_call c = { .op = EJ_OP_GEMM_ADD,
		      .attrs = attrs,
		      .in = in,
		      .n_in = 3,
		      .out = out,
		      .n_out = 1 };
	ej_meta m;
	epj_status s = ej_infer_GEMM_ADD(ctx, &c, &m);
	if (s == EPJ_OK)
		s = gemm_add_into(ctx, &c, r);
	if (s == EPJ_OK) {
		(*ctx->ctr_eager_launches)++;
		epj_counter_add(ctx, "kernels.gemm_add.in_place", 1);
	}
	return s;
}

/* ---- SOLVE_TRIANGULAR: X with A X = B, A [..., n, n] triangular ----------
 * BLAS trsm solves each batch's matrices in place in a dense buffer of the
 * compute dtype (the output's own memory for f32 and f64) that B is packed
 * into; A is read in place when it has the compute dtype and a BLAS layout
 * (row-major or transposed, e.g. the backward's A^T), else packed through
 * its strides.  bf16 is solved in f32 and rounded once.
 * Batch dims broadcast as matmul's do.  Attrs: i[0] upper, i[1]
 * unitriangular, i[2] left (left = 0, X A = B, is refused). */

typedef struct trsm_attrs {
	bool upper, unit;
} trsm_attrs;

static epj_status trsm_check_attrs(epj_ctx *ctx, const ej_call *c,
				   trsm_attrs *ta)
{
	const ej_attrs *at = c->attrs;
	if (at->n_i != 3)
		return ej_op_error(ctx, c, EPJ_ERR_INVALID,
				   "expects 3 int attributes (upper, "
				   "unitriangular, left), got %d",
				   at->n_i);
	for (int i = 0; i < 3; i++)
		if (at->i[i] != 0 && at->i[i] != 1)
			return ej_op_error(ctx, c, EPJ_ERR_INVALID,
					   "attribute %d (%s) must be 0 or 1, "
					   "got %lld",
					   i,
					   i == 0   ? "upper"
					   : i == 1 ? "unitriangular"
						    : "left",
					   (long long)at->i[i]);
	if (!at->i[2])
		return ej_op_error(ctx, c, EPJ_ERR_UNSUPPORTED,
				   "left=false (X A = B) is not implemented; "
				   "only A X = B");
	ta->upper = at->i[0] != 0;
	ta->unit = at->i[1] != 0;
	return EPJ_OK;
}

/* The broadcast batch shape of a [..., n, n] and b [..., n, k] into shape
 * (returns the number of batch dims, or -1 when they do not broadcast). */
static int trsm_batch(const epj_tensor *a, const epj_tensor *b, int64_t *shape)
{
	int na = a->ndim - 2, nb = b->ndim - 2, n = na > nb ? na : nb;
	for (int d = 0; d < n; d++) {
		int da = d - (n - na), db = d - (n - nb);
		int64_t ea = da >= 0 ? a->shape[da] : 1;
		int64_t eb = db >= 0 ? b->shape[db] : 1;
		if (ea != eb && ea != 1 && eb != 1)
			return -1;
		shape[d] = ea == 1 ? eb : ea;
	}
	return n;
}

/* Checks A (input ia) and B (input ib) and sets shape to the solution's
 * shape [batch..., n, k]; returns its rank through *nd. */
static epj_status trsm_shapes(epj_ctx *ctx, const ej_call *c, int ia, int ib,
			      int64_t *shape, int *nd)
{
	epj_status s;
	if ((s = ej_check_float(ctx, c, ia)) ||
	    (s = ej_check_float(ctx, c, ib)) ||
	    (s = ej_check_same_dtype(ctx, c, ia, ib)))
		return s;
	const epj_tensor *a = c->in[ia], *b = c->in[ib];
	if (a->ndim < 2 || b->ndim < 2)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "A and B need at least 2 dims (A [..., n, "
				   "n], B [..., n, k])");
	int64_t n = a->shape[a->ndim - 1];
	if (a->shape[a->ndim - 2] != n)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "A must be square in its last two dims, "
				   "got %lld x %lld",
				   (long long)a->shape[a->ndim - 2],
				   (long long)n);
	if (b->shape[b->ndim - 2] != n)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "B has %lld rows, A is %lld x %lld",
				   (long long)b->shape[b->ndim - 2],
				   (long long)n, (long long)n);
	int nbd = trsm_batch(a, b, shape);
	if (nbd < 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "batch dimensions of A and B do not "
				   "broadcast");
	if (!fits_int(n) || !fits_int(b->shape[b->ndim - 1]))
		return ej_op_error(ctx, c, EPJ_ERR_UNSUPPORTED,
				   "matrix sizes exceed the BLAS integer "
				   "range");
	shape[nbd] = n;
	shape[nbd + 1] = b->shape[b->ndim - 1];
	*nd = nbd + 2;
	return EPJ_OK;
}

epj_status ej_infer_SOLVE_TRIANGULAR(epj_ctx *ctx, const ej_call *c,
				     ej_meta *out)
{
	trsm_attrs ta;
	int64_t shape[EPJ_MAX_DIMS];
	int nd;
	epj_status s = trsm_check_attrs(ctx, c, &ta);
	if (s == EPJ_OK)
		s = trsm_shapes(ctx, c, 0, 1, shape, &nd);
	if (s != EPJ_OK)
		return s;
	ej_meta_set(out, c->in[0]->dtype, nd, shape);
	return EPJ_OK;
}

/* Element offset of batch p (of the nbd-dim batch shape bshape) of t
 * [..., r, q], broadcast over it. */
static int64_t trsm_offset(const epj_tensor *t, int nbd, const int64_t *bshape,
			   int64_t p)
{
	int64_t bs[EPJ_MAX_DIMS];
	batch_strides(t, t->stride, nbd, bs);
	int64_t off = 0;
	for (int d = nbd - 1; d >= 0; d--) {
		off += (p % bshape[d]) * bs[d];
		p /= bshape[d];
	}
	return off;
}

/* Packs batch p of t [..., r, q] into the dense [r, q] array dst of dtype
 * cdt. */
static void trsm_pack(const epj_tensor *t, int nbd, const int64_t *bshape,
		      int64_t p, epj_dtype cdt, void *dst)
{
	int64_t off = trsm_offset(t, nbd, bshape, p);
	int nd = t->ndim;
	int64_t r = t->shape[nd - 2], q = t->shape[nd - 1];
	size_t es = ej_dtype_size(t->dtype), ed = ej_dtype_size(cdt);
	for (int64_t i = 0; i < r; i++)
		ej_linalg_convert((const char *)ej_data(t) +
				      (size_t)(off + i * t->stride[nd - 2]) *
					  es,
				  t->dtype, t->stride[nd - 1],
				  (char *)dst + (size_t)(i * q) * ed, cdt, q);
}

/* How BLAS reads the matrices of A [..., n, n]: in place (true) when A has
 * the compute dtype and a BLAS layout, each matrix row-major (*lt false)
 * or the transpose of one (*lt true) with leading dimension *ld; else
 * (false) packed per batch into a dense [n, n] buffer. */
static bool trsm_a_in_place(const epj_tensor *a, epj_dtype cdt, bool *lt,
			    int64_t *ld)
{
	int nd = a->ndim;
	int64_t n = a->shape[nd - 1];
	*lt = false;
	*ld = max1(n);
	return a->dtype == cdt && ej_linalg_layout(n, n, a->stride[nd - 2],
						   a->stride[nd - 1], lt, ld);
}

/* Batch p's matrix of A for BLAS: in place, or packed into buf. */
static const void *trsm_a(const epj_tensor *a, bool in_place, int nbd,
			  const int64_t *bshape, int64_t p, epj_dtype cdt,
			  void *buf)
{
	if (!in_place) {
		trsm_pack(a, nbd, bshape, p, cdt, buf);
		return buf;
	}
	return (const char *)ej_data(a) +
	       (size_t)trsm_offset(a, nbd, bshape, p) * ej_dtype_size(cdt);
}

/* x [n, k] (dense, dtype cdt) := op(A)^-1 x for the triangular A [n, n]
 * (op(A) = A^T when trans; upper names A's triangle) whose matrix a BLAS
 * reads with leading dimension lda, stored transposed when lt. */
static void trsm1(epj_dtype cdt, bool upper, bool trans, bool unit, int64_t n,
		  int64_t k, const void *a, bool lt, int64_t lda, void *x)
{
	if (n == 0 || k == 0)
		return;
	ej_blas_ready();
	/* A stored as M^T: M's triangle is the other one, op flips */
	enum CBLAS_UPLO ul = upper != lt ? CblasUpper : CblasLower;
	enum CBLAS_TRANSPOSE tr = trans != lt ? CblasTrans : CblasNoTrans;
	enum CBLAS_DIAG dg = unit ? CblasUnit : CblasNonUnit;
	if (cdt == EPJ_DTYPE_F64)
		cblas_dtrsm(CblasRowMajor, CblasLeft, ul, tr, dg, (int)n,
			    (int)k, 1.0, a, (int)lda, x, (int)k);
	else
		cblas_strsm(CblasRowMajor, CblasLeft, ul, tr, dg, (int)n,
			    (int)k, 1.0f, a, (int)lda, x, (int)k);
}

/* The output o of dtype dt from the dense compute array x (freed unless it
 * is o's own data). */
static void trsm_finish(epj_tensor *o, void *x, epj_dtype cdt)
{
	if (x == ej_data(o))
		return;
	int64_t n = ej_numel(o->ndim, o->shape);
	if (n > 0)
		ej_linalg_store(x, cdt, ej_data(o), o->dtype, n);
	free(x);
}

/* A dense compute-dtype array for o: o's data when o has that dtype and
 * elements (an empty o may have no data), else a new buffer. */
static void *trsm_dest(epj_tensor *o, epj_dtype cdt)
{
	int64_t n = ej_numel(o->ndim, o->shape);
	if (o->dtype == cdt && n > 0)
		return ej_data(o);
	return malloc((size_t)max1(n) * ej_dtype_size(cdt));
}

epj_status ej_kernel_SOLVE_TRIANGULAR(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *a = c->in[0], *b = c->in[1];
	epj_tensor *o = c->out[0];
	EJ_ASSERT(ej_is_contiguous(o));
	bool upper = c->attrs->i[0] != 0, unit = c->attrs->i[1] != 0;
	int nbd = o->ndim - 2;
	int64_t n = o->shape[nbd], k = o->shape[nbd + 1];
	int64_t nbatch = ej_numel(nbd, o->shape);
	if (nbatch * n * k == 0)
		return EPJ_OK;
	epj_dtype cdt = compute_dtype(o->dtype);
	size_t ed = ej_dtype_size(cdt);
	bool lt;
	int64_t lda;
	bool in_place = trsm_a_in_place(a, cdt, &lt, &lda);
	void *x = trsm_dest(o, cdt);
	void *abuf = in_place ? NULL : malloc((size_t)(nbatch * n * n) * ed);
	if (!x || (!in_place && !abuf)) {
		if (x != ej_data(o))
			free(x);
		free(abuf);
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "out of memory for the packed operands");
	}
	bool par = batches_in_parallel(nbatch, n * n * k / 2);
	int blas_prev = par ? ej_linalg_blas_serial_begin() : 0;
#pragma omp parallel for schedule(static) if (par)
	for (int64_t p = 0; p < nbatch; p++) {
		char *xp = (char *)x + (size_t)(p * n * k) * ed;
		const void *ap = trsm_a(
		    a, in_place, nbd, o->shape, p, cdt,
		    in_place ? NULL : (char *)abuf + (size_t)(p * n * n) * ed);
		trsm_pack(b, nbd, o->shape, p, cdt, xp);
		trsm1(cdt, upper, false, unit, n, k, ap, lt, lda, xp);
	}
	if (par)
		ej_linalg_blas_serial_end(blas_prev);
	free(abuf);
	trsm_finish(o, x, cdt);
	return EPJ_OK;
}

/* dB = A^-T grad, dA = -dB X^T in A's triangle; each summed back over the
 * batch dims its input was broadcast along. */
epj_status ej_backward_SOLVE_TRIANGULAR(epj_ctx *ctx, const ej_call *c,
					epj_tensor *const *grad_out,
					const bool *needs, epj_tensor **grad_in)
{
	epj_tensor *g = grad_out[0];
	if (!g) {
		for (int i = 0; i < 2; i++)
			if (needs[i] &&
			    !(grad_in[i] = zeros_like(ctx, c->in[i])))
				return bw_status(ctx, "solve_triangular");
		return EPJ_OK;
	}
	epj_tensor *in[3] = { g, c->in[0], c->out[0] }, *outs[2] = { 0 };
	epj_status s = ej_dispatch(ctx, EJ_OP_SOLVE_TRIANGULAR_BACKWARD, in, 3,
				   c->attrs, outs, 2);
	if (s != EPJ_OK)
		return s;
	for (int i = 0; i < 2; i++) {
		epj_tensor *d = outs[i], *x = c->in[i];
		if (needs[i] && !same_shape(d, x)) {
			d = epj_sum_to(ctx, outs[i], x->ndim, x->shape);
			epj_tensor_free(outs[i]);
			outs[i] = d;
			if (!d) {
				if (i == 0)
					epj_tensor_free(outs[1]);
				return bw_status(ctx, "solve_triangular");
			}
		}
		if (needs[i])
			grad_in[i] = outs[i];
		else
			epj_tensor_free(outs[i]);
	}
	return EPJ_OK;
}

epj_tensor *epj_solve_triangular(epj_ctx *ctx, epj_tensor *a, epj_tensor *b,
				 bool upper, bool unitriangular, bool left)
{
	ej_attrs at = ej_attrs_none();
	at.n_i = 3;
	at.i[0] = upper;
	at.i[1] = unitriangular;
	at.i[2] = left;
	epj_tensor *in[2] = { a, b };
	return ej_call1(ctx, EJ_OP_SOLVE_TRIANGULAR, in, 2, &at);
}

/* ---- SOLVE_TRIANGULAR_BACKWARD: (grad, A, X) -> (dA, dB) -------------- */

epj_status ej_infer_SOLVE_TRIANGULAR_BACKWARD(epj_ctx *ctx, const ej_call *c,
					      ej_meta *out)
{
	trsm_attrs ta;
	int64_t shape[EPJ_MAX_DIMS];
	int nd;
	epj_status s = trsm_check_attrs(ctx, c, &ta);
	if (s == EPJ_OK)
		s = trsm_shapes(ctx, c, 1, 2, shape, &nd);
	if (s == EPJ_OK)
		s = ej_check_same_dtype(ctx, c, 0, 1);
	if (s != EPJ_OK)
		return s;
	const epj_tensor *g = c->in[0];
	const epj_tensor *x = c->in[2];
	size_t bytes = sizeof *shape * (size_t)nd;
	if (g->ndim != nd || x->ndim != nd || memcmp(g->shape, shape, bytes) ||
	    memcmp(x->shape, shape, bytes))
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "grad and X must have the solution's "
				   "shape [batch..., n, k]");
	ej_meta_set(&out[1], g->dtype, nd, shape);
	shape[nd - 1] = shape[nd - 2];
	ej_meta_set(&out[0], g->dtype, nd, shape);
	return EPJ_OK;
}

/* Zeroes the part of the dense [n, n] da outside A's triangle (the
 * diagonal too when unit). */
static void trsm_mask(epj_dtype cdt, bool upper, bool unit, int64_t n, void *da)
{
	for (int64_t i = 0; i < n; i++)
		for (int64_t j = 0; j < n; j++) {
			bool keep = upper ? (unit ? j > i : j >= i)
					  : (unit ? j < i : j <= i);
			if (keep)
				continue;
			if (cdt == EPJ_DTYPE_F64)
				((double *)da)[i * n + j] = 0;
			else
				((float *)da)[i * n + j] = 0;
		}
}

epj_status ej_kernel_SOLVE_TRIANGULAR_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	const epj_tensor *g = c->in[0], *a = c->in[1], *xs = c->in[2];
	epj_tensor *oa = c->out[0], *ob = c->out[1];
	EJ_ASSERT(ej_is_contiguous(oa) && ej_is_contiguous(ob));
	bool upper = c->attrs->i[0] != 0, unit = c->attrs->i[1] != 0;
	int nbd = ob->ndim - 2;
	int64_t n = ob->shape[nbd], k = ob->shape[nbd + 1];
	int64_t nbatch = ej_numel(nbd, ob->shape);
	if (nbatch * n == 0)
		return EPJ_OK;
	epj_dtype cdt = compute_dtype(ob->dtype);
	size_t ed = ej_dtype_size(cdt);
	bool lt;
	int64_t lda;
	bool in_place = trsm_a_in_place(a, cdt, &lt, &lda);
	void *da = trsm_dest(oa, cdt), *db = trsm_dest(ob, cdt);
	void *abuf = in_place ? NULL : malloc((size_t)(nbatch * n * n) * ed);
	void *xbuf = malloc((size_t)max1(nbatch * n * k) * ed);
	if (!da || !db || (!in_place && !abuf) || !xbuf) {
		if (da != ej_data(oa))
			free(da);
		if (db != ej_data(ob))
			free(db);
		free(abuf);
		free(xbuf);
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
				   "out of memory for the packed operands");
	}
	bool par = batches_in_parallel(nbatch, n * n * k);
	int blas_prev = par ? ej_linalg_blas_serial_begin() : 0;
#pragma omp parallel for schedule(static) if (par)
	for (int64_t p = 0; p < nbatch; p++) {
		char *bp = (char *)db + (size_t)(p * n * k) * ed;
		char *xp = (char *)xbuf + (size_t)(p * n * k) * ed;
		char *dap = (char *)da + (size_t)(p * n * n) * ed;
		const void *ap = trsm_a(
		    a, in_place, nbd, ob->shape, p, cdt,
		    in_place ? NULL : (char *)abuf + (size_t)(p * n * n) * ed);
		trsm_pack(g, nbd, ob->shape, p, cdt, bp);
		trsm_pack(xs, nbd, ob->shape, p, cdt, xp);
		/* dB = A^-T grad: the transposed solve of the same triangle */
		trsm1(cdt, upper, true, unit, n, k, ap, lt, lda, bp);
		ej_linalg_gemm(cdt, false, true, n, n, k, -1.0, bp, max1(k), xp,
			       max1(k), 0.0, dap, n);
		trsm_mask(cdt, upper, unit, n, dap);
	}
	if (par)
		ej_linalg_blas_serial_end(blas_prev);
	free(abuf);
	free(xbuf);
	trsm_finish(oa, da, cdt);
	trsm_finish(ob, db, cdt);
	return EPJ_OK;
}
