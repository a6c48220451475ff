/* copy.cuh -- data movement kernels of the eager ops on the CUDA devices
 * (kernels/eager_cuda.c): strided copies with dtype conversion (contiguous,
 * reshape and view materialisation, expand copies, casts that involve an
 * integer dtype), concatenation, slice backward, and the integer pointwise
 * ops (add, sub, mul, eq, neg on i32/i64).
 *
 * Dtype codes are epj_dtype's: 0 f32, 1 bf16, 2 i32, 3 i64, 4 f64.
 * Geometry: every kernel walks its output's elements in row-major order
 * with a grid-stride loop (one thread per element, any block size); the
 * element's multi-index is decomposed over `shape` (row-major, `ndim` <=
 * EJ_COPY_DIMS dims) and each operand is addressed through its own element
 * strides (0 for broadcast dims), so views are read in place.
 *
 * Conversions follow lib/ops_pointwise.c's cast exactly: float -> float
 * through double (bf16 stored from the f32 rounding of the value, RNE);
 * integer -> float exact through double; float -> integer truncates toward
 * zero, NaN -> 0, saturating at the range ends; integer -> integer keeps
 * the low bits (two's complement).  Integer arithmetic wraps (computed on
 * unsigned 64-bit words, stored in the input dtype).  Every output element
 * is written exactly once, so outputs may be poisoned before a launch.
 */

#define EJ_DT_F32  0
#define EJ_DT_BF16 1
#define EJ_DT_I32  2
#define EJ_DT_I64  3
#define EJ_DT_F64  4

EJ_D bool ej_dt_is_int(int dt)
{
	return dt == EJ_DT_I32 || dt == EJ_DT_I64;
}

EJ_D int ej_dt_size(int dt)
{
	return dt == EJ_DT_BF16 ? 2 : (dt == EJ_DT_I64 || dt == EJ_DT_F64) ? 8 : 4;
}

EJ_D double ej_ld_f(const void *p, long long i, int dt)
{
	switch (dt) {
	case EJ_DT_F32:
		return (double)((const float *)p)[i];
	case EJ_DT_BF16:
		return (double)ej_bf2f(((const ej_bf16 *)p)[i]);
	case EJ_DT_I32:
		return (double)((const int *)p)[i];
	case EJ_DT_I64:
		return (double)((const long long *)p)[i];
	default:
		return ((const double *)p)[i];
	}
}

EJ_D long long ej_ld_i(const void *p, long long i, int dt)
{
	return dt == EJ_DT_I64 ? ((const long long *)p)[i]
			       : (long long)((const int *)p)[i];
}

EJ_D void ej_st_i(void *p, long long i, int dt, long long v)
{
	if (dt == EJ_DT_I64)
		((long long *)p)[i] = v;
	else
		((int *)p)[i] = (int)(unsigned)(unsigned long long)v;
}

/* float -> integer as lib/ops_pointwise.c's sat_i64 */
EJ_D long long ej_sat_i(double v, int dt)
{
	double lo = dt == EJ_DT_I64 ? -9223372036854775808.0 : -2147483648.0;
	double hi = dt == EJ_DT_I64 ? 9223372036854775807.0 : 2147483647.0;
	if (v != v)
		return 0;
	if (v <= lo)
		return dt == EJ_DT_I64 ? (-9223372036854775807LL - 1)
				       : -2147483648LL;
	if (v >= hi)
		return dt == EJ_DT_I64 ? 9223372036854775807LL : 2147483647LL;
	return (long long)v;
}

EJ_D void ej_st_f(void *p, long long i, int dt, double v)
{
	switch (dt) {
	case EJ_DT_F32:
		((float *)p)[i] = (float)v;
		break;
	case EJ_DT_BF16:
		((ej_bf16 *)p)[i] = ej_f2bf((float)v);
		break;
	case EJ_DT_F64:
		((double *)p)[i] = v;
		break;
	default:
		ej_st_i(p, i, dt, ej_sat_i(v, dt));
		break;
	}
}

/* d[di] (dtype ddt) = s[si] (dtype sdt), converted as cast does. */
EJ_D void ej_convert(void *d, long long di, int ddt, const void *s,
		     long long si, int sdt)
{
	if (sdt == ddt)
		ej_copy_bits(d, di, s, si, ej_dt_size(sdt));
	else if (ej_dt_is_int(sdt) && ej_dt_is_int(ddt))
		ej_st_i(d, di, ddt, ej_ld_i(s, si, sdt));
	else
		ej_st_f(d, di, ddt, ej_ld_f(s, si, sdt));
}

/* ---- strided copy ----------------------------------------------------------
 * dst[i . dst_st] = convert(src[i . src_st]) for every multi-index i of
 * shape (n = its element count). */

extern "C" __global__ void ej_copy(const struct ej_copy_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     e < a.n; e += step) {
		long long rem = e, so = 0, dof = 0;
		for (int d = a.ndim - 1; d >= 0; d--) {
			long long m = rem % a.shape[d];
			rem /= a.shape[d];
			so += m * a.src_st[d];
			dof += m * a.dst_st[d];
		}
		ej_convert(a.dst, dof, a.ddt, a.src, so, a.sdt);
	}
}

/* ---- concatenation ---------------------------------------------------------
 * dst (contiguous, shape) = inputs 0..n_in-1 side by side along axis; input
 * j covers positions [start[j], start[j + 1]) of that axis and is read
 * through its strides src_st[j].  One dtype for all. */

extern "C" __global__ void ej_cat(const struct ej_cat_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	int es = ej_dt_size(a.dt);
	for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     e < a.n; e += step) {
		long long rem = e, m[EJ_COPY_DIMS];
		for (int d = a.ndim - 1; d >= 0; d--) {
			m[d] = rem % a.shape[d];
			rem /= a.shape[d];
		}
		int j = 0;
		while (j + 1 < a.n_in && m[a.axis] >= a.start[j + 1])
			j++;
		m[a.axis] -= a.start[j];
		long long so = 0;
		for (int d = 0; d < a.ndim; d++)
			so += m[d] * a.src_st[j][d];
		ej_copy_bits(a.dst, e, a.src[j], so, es);
	}
}

/* ---- slice backward --------------------------------------------------------
 * dst (contiguous, shape) = zeros with the gradient of a slice placed at
 * positions start, start + step, ... (< end) of axis; src (the gradient,
 * glen positions along axis) is read through src_st. */

extern "C" __global__ void ej_slice_bw(const struct ej_slice_bw_args a)
{
	long long stp = (long long)gridDim.x * blockDim.x;
	int es = ej_dt_size(a.dt);
	for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     e < a.n; e += stp) {
		long long rem = e, so = 0, q = 0;
		for (int d = a.ndim - 1; d >= 0; d--) {
			long long m = rem % a.shape[d];
			rem /= a.shape[d];
			if (d == a.axis)
				q = m;
			else
				so += m * a.src_st[d];
		}
		long long k = (q - a.start) / a.step;
		bool in = q >= a.start && q < a.end &&
			  (q - a.start) % a.step == 0 && k < a.glen;
		if (in) {
			ej_copy_bits(a.dst, e, a.src, so + k * a.src_st[a.axis],
				     es);
		} else {
			switch (es) {
			case 2:
				((unsigned short *)a.dst)[e] = 0;
				break;
			case 4:
				((unsigned *)a.dst)[e] = 0;
				break;
			default:
				((unsigned long long *)a.dst)[e] = 0;
				break;
			}
		}
	}
}

/* ---- integer pointwise -----------------------------------------------------
 * dst (contiguous, shape) = a op b with a, b read through broadcast strides
 * (b unused for neg).  op: 0 add, 1 sub, 2 mul, 3 eq (1 / 0), 4 neg,
 * 5 maximum (signed). */

extern "C" __global__ void ej_ipw(const struct ej_ipw_args a)
{
	long long step = (long long)gridDim.x * blockDim.x;
	for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     e < a.n; e += step) {
		long long rem = e, ao = 0, bo = 0;
		for (int d = a.ndim - 1; d >= 0; d--) {
			long long m = rem % a.shape[d];
			rem /= a.shape[d];
			ao += m * a.a_st[d];
			bo += m * a.b_st[d];
		}
		unsigned long long x = (unsigned long long)ej_ld_i(a.a, ao, a.dt);
		unsigned long long y =
		    a.op == 4 ? 0ull : (unsigned long long)ej_ld_i(a.b, bo, a.dt);
		unsigned long long r;
		switch (a.op) {
		case 0:
			r = x + y;
			break;
		case 1:
			r = x - y;
			break;
		case 2:
			r = x * y;
			break;
		case 3:
			r = x == y ? 1ull : 0ull;
			break;
		case 5:
			r = (long long)y > (long long)x ? y : x;
			break;
		default:
			r = 0ull - x;
			break;
		}
		ej_st_i(a.dst, e, a.dt, (long long)r);
	}
}
