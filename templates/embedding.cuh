/* embedding.cuh -- embedding forward/backward and cross-entropy fused with
 * log-softmax on the CUDA devices, computing what lib/ops_index.c and
 * lib/ops_attention.c compute.  Deterministic: no float atomics, every sum
 * in a fixed order (cuda-sim's race check compares two block/thread orders
 * bit for bit).  Dtype codes: 0 f32, 1 bf16, 2 f64.  Index inputs are
 * contiguous i64 (the host API converts i32 and strided ids and checks
 * their range).
 *
 *  ej_embed_fwd   out [n, D] = w[ids[i]] (w rows/columns of any stride,
 *                 element size 2, 4 or 8 bytes); block per row, grid-stride.
 *  ej_embed_bwd   dw [V, D] = sum over i with ids[i] == v of g[i] (g of any
 *                 strides): one block per vocabulary row v, threads over
 *                 columns, each scanning the ids in index order -- so every
 *                 element gets its contributions in index order, in f32 (f64
 *                 for f64; bf16 rounded once at the end), exactly as the CPU
 *                 kernel adds them.  Rows no id names are written as zero.
 *                 Work is V * n id reads (broadcast within a block).
 *  ej_ce_rows     loss_row [N] (double) = logsumexp(x_r) - x_r[t_r] for rows
 *                 whose target is not ignore_index, else 0: one block per
 *                 row, block max, sum of exp(x - max) in double, the row's
 *                 arithmetic in f32 (f64 for f64) as the CPU's.  cnt [1] is
 *                 not touched here.
 *  ej_ce_reduce   ONE block: loss [] (f32, or f64 for f64 logits) = sum of
 *                 loss_row / number of non-ignored rows (NaN when there is
 *                 none), and that number in cnt [1] (for the backward).
 *  ej_ce_count    ONE block: cnt [1] = the number of non-ignored rows.
 *  ej_ce_bwd      dlogits [N, V] (logits' dtype, contiguous) = (softmax(x_r)
 *                 - onehot(t_r)) * g / cnt for non-ignored rows, 0 for the
 *                 others; g = the upstream scalar (dtype gdt).
 */

/* ---- embedding ----------------------------------------------------------- */

extern "C" __global__ void ej_embed_fwd(const struct ej_embed_args a)
{
	for (long long i = blockIdx.x; i < a.n; i += gridDim.x) {
		const long long row = a.ids[i] * a.s0;
		for (long long d = threadIdx.x; d < a.D; d += blockDim.x) {
			const long long si = row + d * a.s1, di = i * a.D + d;
			if (a.elem == 8)
				((unsigned long long *)a.out)[di] =
				    ((const unsigned long long *)a.src)[si];
			else if (a.elem == 4)
				((unsigned *)a.out)[di] =
				    ((const unsigned *)a.src)[si];
			else
				((unsigned short *)a.out)[di] =
				    ((const unsigned short *)a.src)[si];
		}
	}
}

template <class A>
static __device__ void ej_embed_bwd_row(const struct ej_embed_args &a,
					long long v)
{
	for (long long d = threadIdx.x; d < a.D; d += blockDim.x) {
		A acc = (A)0;
		for (long long i = 0; i < a.n; i++)
			if (a.ids[i] == v)
				acc += ej_fld<A>(a.src, i * a.s0 + d * a.s1,
						   a.dt);
		ej_fst<A>(a.out, v * a.D + d, a.dt, acc);
	}
}

extern "C" __global__ void ej_embed_bwd(const struct ej_embed_args a)
{
	for (long long v = blockIdx.x; v < a.V; v += gridDim.x) {
		if (a.dt == 2)
			ej_embed_bwd_row<double>(a, v);
		else
			ej_embed_bwd_row<float>(a, v);
	}
}

/* ---- cross-entropy ------------------------------------------------------- */

/* max and sum of exp(x - max) of row r (every thread gets both) */
template <class T>
static __device__ void ej_ce_stats(const struct ej_ce_args &a, long long r,
				   T *m_out, double *s_out, double *sh)
{
	T m = -(T)ej_inf_d();
	for (long long j = threadIdx.x; j < a.V; j += blockDim.x) {
		T x = ej_fld<T>(a.x, r * a.s0 + j * a.s1, a.dt);
		m = x > m ? x : m;
	}
	m = (T)ej_block_smax_d((double)m, sh, -ej_inf_d());
	double s = 0;
	for (long long j = threadIdx.x; j < a.V; j += blockDim.x) {
		T x = ej_fld<T>(a.x, r * a.s0 + j * a.s1, a.dt);
		s += sizeof(T) == 8 ? exp((double)(x - m))
				    : (double)expf((float)(x - m));
	}
	__syncthreads(); /* sh is reused */
	s = ej_block_sum(s, sh);
	__syncthreads();
	*m_out = m;
	*s_out = s;
}

extern "C" __global__ void ej_ce_rows(const struct ej_ce_args a)
{
	__shared__ double sh[32];
	for (long long r = blockIdx.x; r < a.N; r += gridDim.x) {
		const long long t = a.tgt[r];
		if (t == a.ign) {
			if (threadIdx.x == 0)
				a.loss_row[r] = 0.0;
			continue;
		}
		double loss;
		if (a.dt == 2) {
			double m, s;
			ej_ce_stats<double>(a, r, &m, &s, sh);
			loss = m + log(s) -
			       ej_fld<double>(a.x, r * a.s0 + t * a.s1, a.dt);
		} else {
			float m;
			double s;
			ej_ce_stats<float>(a, r, &m, &s, sh);
			loss = (double)(m + logf((float)s) -
					ej_fld<float>(a.x, r * a.s0 + t * a.s1,
							a.dt));
		}
		if (threadIdx.x == 0)
			a.loss_row[r] = loss;
	}
}

extern "C" __global__ void ej_ce_reduce(const struct ej_ce_args a)
{
	__shared__ double sh[32];
	double s = 0, c = 0;
	for (long long r = threadIdx.x; r < a.N; r += blockDim.x) {
		s += a.loss_row[r];
		c += a.tgt[r] != a.ign ? 1.0 : 0.0;
	}
	s = ej_block_sum(s, sh);
	__syncthreads();
	c = ej_block_sum(c, sh);
	if (threadIdx.x == 0) {
		double mean = c > 0 ? s / c : __longlong_as_double(0x7ff8000000000000LL);
		if (a.dt == 2)
			*(double *)a.out = mean;
		else
			*(float *)a.out = (float)mean;
		*a.cnt = (long long)c;
	}
}

extern "C" __global__ void ej_ce_count(const struct ej_ce_args a)
{
	__shared__ double sh[32];
	double c = 0;
	for (long long r = threadIdx.x; r < a.N; r += blockDim.x)
		c += a.tgt[r] != a.ign ? 1.0 : 0.0;
	c = ej_block_sum(c, sh);
	if (threadIdx.x == 0)
		*a.cnt = (long long)c;
}

template <class T>
static __device__ void ej_ce_bwd_row(const struct ej_ce_args &a, long long r,
				     double g, double *sh)
{
	const long long t = a.tgt[r];
	T m;
	double s;
	ej_ce_stats<T>(a, r, &m, &s, sh);
	const T scale = (T)(g / s);
	for (long long j = threadIdx.x; j < a.V; j += blockDim.x) {
		T x = ej_fld<T>(a.x, r * a.s0 + j * a.s1, a.dt);
		T e = sizeof(T) == 8 ? (T)exp((double)(x - m))
				     : (T)expf((float)(x - m));
		T d = e * scale;
		if (j == t)
			d -= (T)g;
		ej_fst<T>(a.out, r * a.V + j, a.dt, d);
	}
}

extern "C" __global__ void ej_ce_bwd(const struct ej_ce_args a)
{
	__shared__ double sh[32];
	const long long cnt = *a.cnt;
	double g = ej_fld<double>(a.g, 0, a.gdt);
	g = cnt > 0 ? g / (double)cnt : 0.0;
	for (long long r = blockIdx.x; r < a.N; r += gridDim.x) {
		if (a.tgt[r] == a.ign) {
			for (long long j = threadIdx.x; j < a.V;
			     j += blockDim.x)
				ej_fst<float>(a.out, r * a.V + j, a.dt, 0.0f);
			continue;
		}
		if (a.dt == 2)
			ej_ce_bwd_row<double>(a, r, g, sh);
		else
			ej_ce_bwd_row<float>(a, r, g, sh);
	}
}
