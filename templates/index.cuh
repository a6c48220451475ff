/* index.cuh -- indexing kernels of the eager ops on the CUDA devices
 * (kernels/eager_cuda.c): index_select, gather, index_add, scatter_add, max
 * with indices along an axis, topk along the last axis and a stable
 * ascending argsort along an axis.
 *
 * Dtype codes are epj_dtype's (0 f32, 1 bf16, 2 i32, 3 i64, 4 f64); index
 * tensors are i32 or i64 (idx64), read through their element strides.
 * Indices are range-checked by the host before a launch (as
 * lib/ops_index.c does, with the same message); the kernels skip an
 * out-of-range index rather than read outside a buffer.
 *
 * Determinism: there are no atomics.  index_add and scatter_add run one
 * thread per OUTPUT element that walks the contributions in index order
 * (i = 0, 1, ... of the index), accumulating in f32 for f32/bf16 (bf16
 * rounded once at the end), f64 for f64, wrapping 64-bit words for the
 * integers -- the order and precision of the CPU kernels, so the results
 * match them bit for bit.  max, topk and argsort run one thread per row
 * (rows are short in the eager paths that use them) and select with the
 * CPU kernels' orders: max keeps the first maximum and lets the first NaN
 * win; topk is largest first, NaN largest, ties to the lower index;
 * argsort is ascending, NaN last, ties by position (stable).  Every output
 * element is written exactly once.
 *
 * Geometry: grid-stride loops over output elements (or rows), any block.
 */

#define EJ_IX_F32  0
#define EJ_IX_BF16 1
#define EJ_IX_I32  2
#define EJ_IX_I64  3
#define EJ_IX_F64  4

EJ_D int ej_ix_size(int dt)
{
	return dt == EJ_IX_BF16 ? 2 : (dt == EJ_IX_I64 || dt == EJ_IX_F64) ? 8 : 4;
}

EJ_D long long ej_ix_index(const void *p, long long i, int idx64)
{
	return idx64 ? ((const long long *)p)[i]
		     : (long long)((const int *)p)[i];
}

/* An accumulator in the CPU kernels' arithmetic type. */
struct ej_ix_acc {
	float f;
	double d;
	unsigned long long u;
};

EJ_D void ej_ix_acc_load(struct ej_ix_acc *a, const void *p, long long i,
			 int dt)
{
	switch (dt) {
	case EJ_IX_F32:
		a->f = ((const float *)p)[i];
		break;
	case EJ_IX_BF16:
		a->f = ej_bf2f(((const ej_bf16 *)p)[i]);
		break;
	case EJ_IX_F64:
		a->d = ((const double *)p)[i];
		break;
	case EJ_IX_I32:
		a->u = (unsigned long long)(long long)((const int *)p)[i];
		break;
	default:
		a->u = ((const unsigned long long *)p)[i];
		break;
	}
}

EJ_D void ej_ix_acc_add(struct ej_ix_acc *a, const void *p, long long i,
			int dt)
{
	switch (dt) {
	case EJ_IX_F32:
		a->f += ((const float *)p)[i];
		break;
	case EJ_IX_BF16:
		a->f += ej_bf2f(((const ej_bf16 *)p)[i]);
		break;
	case EJ_IX_F64:
		a->d += ((const double *)p)[i];
		break;
	case EJ_IX_I32:
		a->u += (unsigned long long)(long long)((const int *)p)[i];
		break;
	default:
		a->u += ((const unsigned long long *)p)[i];
		break;
	}
}

EJ_D void ej_ix_acc_store(const struct ej_ix_acc *a, void *p, long long i,
			  int dt)
{
	switch (dt) {
	case EJ_IX_F32:
		((float *)p)[i] = a->f;
		break;
	case EJ_IX_BF16:
		((ej_bf16 *)p)[i] = ej_f2bf(a->f);
		break;
	case EJ_IX_F64:
		((double *)p)[i] = a->d;
		break;
	case EJ_IX_I32:
		((unsigned *)p)[i] = (unsigned)a->u;
		break;
	default:
		((unsigned long long *)p)[i] = a->u;
		break;
	}
}

/* ---- index_select -----------------------------------------------------------
 * dst (contiguous, shape = a's with dim axis = the index length) =
 * a[.., idx[m], ..]. */

extern "C" __global__ void
ej_index_select(const struct ej_index_select_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     e < a.n; e += step) {
		long long rem = e, so = 0;
		for (int d = a.ndim - 1; d >= 0; d--) {
			long long m = rem % a.shape[d];
			rem /= a.shape[d];
			if (d == a.axis) {
				m = ej_ix_index(a.idx, m * a.idx_st, a.idx64);
				if (m < 0 || m >= a.limit)
					m = 0;
			}
			so += m * a.a_st[d];
		}
		ej_copy_bits(a.dst, e, a.a, so, a.es);
	}
}

/* ---- gather -------------------------------------------------------------
 * dst (contiguous, the index's shape) = a[m with m[axis] = idx[m]]. */

extern "C" __global__ void ej_gather(const struct ej_gather_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     e < a.n; e += step) {
		long long rem = e, so = 0, io = 0;
		for (int d = a.ndim - 1; d >= 0; d--) {
			long long m = rem % a.shape[d];
			rem /= a.shape[d];
			io += m * a.idx_st[d];
			if (d != a.axis)
				so += m * a.a_st[d];
		}
		long long j = ej_ix_index(a.idx, io, a.idx64);
		if (j < 0 || j >= a.limit)
			j = 0;
		ej_copy_bits(a.dst, e, a.a, so + j * a.a_st[a.axis], a.es);
	}
}

/* ---- index_add ----------------------------------------------------------
 * dst (contiguous, a's shape) = a with src[.., i, ..] added at
 * [.., idx[i], ..] for i = 0 .. nidx-1 in order. */

extern "C" __global__ void ej_index_add(const struct ej_index_add_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     e < a.n; e += step) {
		long long rem = e, ao = 0, so = 0, q = 0;
		for (int d = a.ndim - 1; d >= 0; d--) {
			long long m = rem % a.shape[d];
			rem /= a.shape[d];
			ao += m * a.a_st[d];
			if (d == a.axis)
				q = m;
			else
				so += m * a.src_st[d];
		}
		struct ej_ix_acc acc;
		ej_ix_acc_load(&acc, a.a, ao, a.dt);
		for (long long i = 0; i < a.nidx; i++)
			if (ej_ix_index(a.idx, i * a.idx_st, a.idx64) == q)
				ej_ix_acc_add(&acc, a.src,
					      so + i * a.src_st[a.axis], a.dt);
		ej_ix_acc_store(&acc, a.dst, e, a.dt);
	}
}

/* ---- scatter_add --------------------------------------------------------
 * dst (contiguous, a's shape) = a with src[p] added at p with p[axis] =
 * idx[p], for every position p of the index (ishape) in row-major order.
 * An output element o receives the positions p that agree with o off the
 * axis, in increasing p[axis]: the CPU kernel's order. */

extern "C" __global__ void ej_scatter_add(const struct ej_scatter_add_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     e < a.n; e += step) {
		long long rem = e, ao = 0, io = 0, so = 0, q = 0;
		bool inside = true;
		for (int d = a.ndim - 1; d >= 0; d--) {
			long long m = rem % a.shape[d];
			rem /= a.shape[d];
			ao += m * a.a_st[d];
			if (d == a.axis) {
				q = m;
				continue;
			}
			if (m >= a.ishape[d])
				inside = false;
			io += m * a.idx_st[d];
			so += m * a.src_st[d];
		}
		struct ej_ix_acc acc;
		ej_ix_acc_load(&acc, a.a, ao, a.dt);
		if (inside)
			for (long long j = 0; j < a.ishape[a.axis]; j++)
				if (ej_ix_index(a.idx, io + j * a.idx_st[a.axis],
						a.idx64) == q)
					ej_ix_acc_add(&acc, a.src,
						      so + j * a.src_st[a.axis],
						      a.dt);
		ej_ix_acc_store(&acc, a.dst, e, a.dt);
	}
}

/* ---- sort keys ----------------------------------------------------------
 * i64 compares as integers, every other dtype as double with NaN above
 * everything (lib/ops_index.c cmp_key). */
EJ_D int ej_ix_cmp(const void *p, long long i, long long j, int dt)
{
	if (dt == EJ_IX_I64) {
		long long x = ((const long long *)p)[i];
		long long y = ((const long long *)p)[j];
		return (x > y) - (x < y);
	}
	double x, y;
	switch (dt) {
	case EJ_IX_F32:
		x = ((const float *)p)[i];
		y = ((const float *)p)[j];
		break;
	case EJ_IX_BF16:
		x = ej_bf2f(((const ej_bf16 *)p)[i]);
		y = ej_bf2f(((const ej_bf16 *)p)[j]);
		break;
	case EJ_IX_I32:
		x = ((const int *)p)[i];
		y = ((const int *)p)[j];
		break;
	default:
		x = ((const double *)p)[i];
		y = ((const double *)p)[j];
		break;
	}
	bool nx = x != x, ny = y != y;
	if (nx || ny)
		return (int)nx - (int)ny;
	return (x > y) - (x < y);
}

/* ---- max with indices ---------------------------------------------------
 * For each of the n output positions (the input with the axis removed,
 * oshape / x_st over ndim dims): the first maximum along the axis (len
 * elements, stride ax_st); the first NaN wins outright (floats). */

extern "C" __global__ void ej_max_index(const struct ej_max_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	bool isint = a.dt == EJ_IX_I32 || a.dt == EJ_IX_I64;
	for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     e < a.n; e += step) {
		long long rem = e, off = 0;
		for (int d = a.ndim - 1; d >= 0; d--) {
			long long m = rem % a.shape[d];
			rem /= a.shape[d];
			off += m * a.x_st[d];
		}
		long long bi = 0;
		for (long long r = 1; r < a.len; r++) {
			long long cur = off + bi * a.ax_st;
			long long cand = off + r * a.ax_st;
			if (isint) {
				if (ej_ix_cmp(a.x, cand, cur, a.dt) > 0)
					bi = r;
				continue;
			}
			double b = 0, v = 0;
			if (a.dt == EJ_IX_F32) {
				b = ((const float *)a.x)[cur];
				v = ((const float *)a.x)[cand];
			} else if (a.dt == EJ_IX_BF16) {
				b = ej_bf2f(((const ej_bf16 *)a.x)[cur]);
				v = ej_bf2f(((const ej_bf16 *)a.x)[cand]);
			} else {
				b = ((const double *)a.x)[cur];
				v = ((const double *)a.x)[cand];
			}
			if (b != b)
				break;
			if (v > b || v != v)
				bi = r;
		}
		long long src = off + bi * a.ax_st;
		if (a.dt == EJ_IX_BF16) {
			/* through f32, as the CPU kernel stores it (a NaN is
			 * made quiet) */
			((ej_bf16 *)a.vals)[e] =
			    ej_f2bf(ej_bf2f(((const ej_bf16 *)a.x)[src]));
		} else if (a.dt == EJ_IX_F32) {
			((float *)a.vals)[e] =
			    (float)(double)((const float *)a.x)[src];
		} else {
			ej_copy_bits(a.vals, e, a.x, src, ej_ix_size(a.dt));
		}
		a.inds[e] = bi;
	}
}

/* ---- topk along the last axis --------------------------------------------
 * Row r (rows over shape[0..ndim-1) with x_st; len elements of stride
 * ax_st): the k largest, largest first, ties to the lower index; vals and
 * inds (i64) are contiguous [rows, k].  The q-th pick is the first element
 * in (key descending, position ascending) order after the (q-1)-th. */

/* Does (i) come before (j) in the topk order? */
EJ_D bool ej_topk_before(const void *x, long long off, long long st,
			 long long i, long long j, int dt)
{
	int c = ej_ix_cmp(x, off + i * st, off + j * st, dt);
	return c > 0 || (c == 0 && i < j);
}

extern "C" __global__ void ej_topk(const struct ej_topk_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	int es = ej_ix_size(a.dt);
	for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     r < a.rows; r += step) {
		long long rem = r, off = 0;
		for (int d = a.ndim - 1; d >= 0; d--) {
			off += (rem % a.shape[d]) * a.x_st[d];
			rem /= a.shape[d];
		}
		long long prev = -1;
		for (long long q = 0; q < a.k; q++) {
			long long best = -1;
			for (long long j = 0; j < a.len; j++) {
				if (prev >= 0 &&
				    !ej_topk_before(a.x, off, a.ax_st, prev, j,
						    a.dt))
					continue;
				if (best < 0 || ej_topk_before(a.x, off,
							       a.ax_st, j, best,
							       a.dt))
					best = j;
			}
			if (best < 0)
				best = 0; /* k <= len: unreachable */
			ej_copy_bits(a.vals, r * a.k + q, a.x,
				   off + best * a.ax_st, es);
			a.inds[r * a.k + q] = best;
			prev = best;
		}
	}
}

/* ---- argsort along an axis ------------------------------------------------
 * Row r: the other dims (shape / x_st / out_st over ndim dims), len
 * elements along the axis (ax_st in x, out_ax in out, i64).  Stable
 * ascending, NaN last. */

EJ_D bool ej_asc_before(const void *x, long long off, long long st,
			long long i, long long j, int dt)
{
	int c = ej_ix_cmp(x, off + i * st, off + j * st, dt);
	return c < 0 || (c == 0 && i < j);
}

extern "C" __global__ void ej_argsort(const struct ej_argsort_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     r < a.rows; r += step) {
		long long rem = r, off = 0, oo = 0;
		for (int d = a.ndim - 1; d >= 0; d--) {
			long long m = rem % a.shape[d];
			rem /= a.shape[d];
			off += m * a.x_st[d];
			oo += m * a.out_st[d];
		}
		/* rank of element j = how many elements come before it */
		for (long long j = 0; j < a.len; j++) {
			long long rank = 0;
			for (long long i = 0; i < a.len; i++)
				if (i != j &&
				    ej_asc_before(a.x, off, a.ax_st, i, j, a.dt))
					rank++;
			a.out[oo + rank * a.out_ax] = j;
		}
	}
}
