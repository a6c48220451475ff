/* trsm.cuh -- the triangular solve on the CUDA devices, computing what
 * lib/ops_linalg.c computes (SOLVE_TRIANGULAR and its backward).  A simple
 * kernel, no tiling: one thread per column of the solution.  Inputs are
 * dense (the host adapter, kernels/tmpl_trsm.c, copies strided and
 * broadcast ones): a [nb, n, n], b [nb, n, k], one dtype (code 0 f32, 1
 * bf16, 2 f64); arithmetic in f32 (f64 for f64), every sum in a fixed
 * order.
 *
 *  ej_trsm     x = op(A)^-1 b per batch and column (op(A) = A^T when
 *              trans; upper names A's stored triangle, unit takes its
 *              diagonal as 1), the substitution's values kept in the
 *              compute-type buffer x ([nb, n, k]) and, when out differs
 *              from x, stored to out in dtype dt once the column is done.
 *  ej_trsm_da  da [nb, n, n] = -x xs^T in A's triangle (strictly when
 *              unit), 0 elsewhere: the backward's dA from dB (x, compute
 *              type) and the saved solution xs (dtype dt), one thread per
 *              element.
 * Work items are grid-stride.
 */

template <class A> EJ_D void ej_trsm_col(const struct ej_trsm_args &a,
					 long long p, long long c)
{
	const long long n = a.n, k = a.k;
	const bool lower = (a.upper != 0) == (a.trans != 0);
	A *x = (A *)a.x;
	for (long long s = 0; s < n; s++) {
		const long long i = lower ? s : n - 1 - s;
		A acc = ej_fld<A>(a.b, (p * n + i) * k + c, a.dt);
		const long long j0 = lower ? 0 : i + 1, j1 = lower ? i : n;
		for (long long j = j0; j < j1; j++) {
			const long long e = a.trans ? j * n + i : i * n + j;
			acc -= ej_fld<A>(a.a, p * n * n + e, a.dt) *
			       x[(p * n + j) * k + c];
		}
		if (!a.unit)
			acc /= ej_fld<A>(a.a, p * n * n + i * n + i, a.dt);
		x[(p * n + i) * k + c] = acc;
	}
	if (a.out != a.x)
		for (long long i = 0; i < n; i++)
			ej_fst<A>(a.out, (p * n + i) * k + c, a.dt,
				  x[(p * n + i) * k + c]);
}

extern "C" __global__ void ej_trsm(const struct ej_trsm_args a)
{
	const long long items = a.nb * a.k;
	const long long stride = (long long)gridDim.x * blockDim.x;
	for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     t < items; t += stride) {
		if (a.dt == 2)
			ej_trsm_col<double>(a, t / a.k, t % a.k);
		else
			ej_trsm_col<float>(a, t / a.k, t % a.k);
	}
}

template <class A> EJ_D A ej_trsm_da1(const struct ej_trsm_args &a,
				      long long p, long long i, long long j)
{
	const bool keep = a.upper ? (a.unit ? j > i : j >= i)
				  : (a.unit ? j < i : j <= i);
	if (!keep)
		return (A)0;
	const A *x = (const A *)a.x;
	A s = 0;
	for (long long c = 0; c < a.k; c++)
		s += x[(p * a.n + i) * a.k + c] *
		     ej_fld<A>(a.xs, (p * a.n + j) * a.k + c, a.dt);
	return -s;
}

extern "C" __global__ void ej_trsm_da(const struct ej_trsm_args a)
{
	const long long items = a.nb * a.n * a.n;
	const long long stride = (long long)gridDim.x * blockDim.x;
	for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     t < items; t += stride) {
		const long long p = t / (a.n * a.n), e = t % (a.n * a.n);
		if (a.dt == 2)
			ej_fst<double>(a.da, t, a.dt,
				       ej_trsm_da1<double>(a, p, e / a.n,
							   e % a.n));
		else
			ej_fst<float>(a.da, t, a.dt,
				      ej_trsm_da1<float>(a, p, e / a.n,
							 e % a.n));
	}
}
