/* moe.cuh -- the eager AutoEP layer's token bookkeeping on the CUDA devices
 * (runtime/autoep.c computes the same with ops): router softmax + top-k,
 * a stable counting sort of the routed slots by expert, permute,
 * unpermute + weighted combine, and the backward of each.  Deterministic:
 * no float atomics, every sum in a fixed order, so cuda-sim's race check
 * (two block/thread orders, outputs compared bit for bit) holds.
 *
 * Names: N tokens, E experts, k slots per token (slot s = n * k + j), R =
 * N * k routed rows, H columns.  "rdt" is the routing dtype (f32 for f32
 * and bf16 layers, f64 for f64 layers); dtype codes: 0 f32, 1 bf16, 2 f64.
 *
 *  ej_moe_route      one warp per token (grid-stride): probs [N, E] rdt =
 *                    softmax(logits) as lib/ops_reduce.c computes it (max,
 *                    e = exp(x - max), sum of e in double, e * (1 / sum));
 *                    top-k of probs, largest first, ties to the LOWER
 *                    expert index, NaN above everything (lib/ops_index.c);
 *                    w [N, k] rdt = the selected probs, divided by their sum
 *                    when `norm` (norm_topk_prob); idx [N, k] i64.  With
 *                    `fixed`, the experts are (n k + j) % E instead
 *                    (expert_parallel.fixed_routing), weighted the same.
 *                    Any k <= E (no per-thread list: the experts taken are
 *                    those ordered before the last one taken).  Logits
 *                    have any row/column strides.
 *  ej_moe_sort_*     stable counting sort of n keys in [0, B) over blocks of
 *                    EJ_MOE_SORT_T keys, one a thread: _count writes each
 *                    block's count of each key (a thread's rank among the
 *                    equal keys before it in the block, from shared
 *                    memory; the key's last writes the count), _scan (one
 *                    block) the counts of the blocks before each block per
 *                    key, counts [B] and offsets [B + 1] (exclusive scan),
 *                    _scatter puts each key at offsets + the blocks before
 *                    + its rank: order [n] (order[r] = the key position at
 *                    sorted row r, positions of one key ascending) and pos
 *                    [n] (its inverse).
 *  ej_moe_permute    xs [R, H] = x[order[r] / k] (rows of any stride;
 *                    element size 2, 4 or 8 bytes); block per row.
 *                    permute, permute_bw, combine and combine_bw_y take
 *                    16-byte vectors of a row a thread when `vec` (rows of
 *                    whole vectors, buffers aligned; the lanes sum in the
 *                    scalar order) and 32-bit index math when `i32`.
 *  ej_moe_permute_bw dx [N, H] = sum over j of dxs[pos[n * k + j]] in j
 *                    order, f32 accumulation (f64 for f64).
 *  ej_moe_combine    out [N, H] = sum over j of w[n, j] * y[pos[n, j]] in rdt
 *                    (each product rounded, then added in j order, as
 *                    autoep.c's mul + index_add), cast to the dtype of y.
 *  ej_moe_combine_bw_y  dy[pos[s]] = w[s] * dout[s / k] for every slot s
 *                    (pos is a permutation: each row written once).
 *  ej_moe_combine_bw_w  dw [N, k] rdt = sum over h of dout[n, h] * y[pos[s],
 *                    h]: one warp per slot, lanes over h, a shuffle tree.
 *  ej_swiglu_fwd     y = silu(g) * u over n contiguous elements, one pass
 *                    (lib/ops_moe.c's formula, f32 for bf16, rounded once).
 *  ej_swiglu_bwd     dg = d u s (1 + g (1 - s)), du = d g s, s = sigmoid(g)
 *                    recomputed, one pass.  Both: 16-byte vectors (8 bf16,
 *                    4 f32, 2 f64) grid-stride when every buffer is 16-byte
 *                    aligned (`vec`), then the tail one element a thread;
 *                    32-bit index math when `i32`.
 *  ej_moe_route_bw   dlogits [N, E] rdt from dw [N, k] through the optional
 *                    renormalisation (dp_j = (dw_j - sum_m dw_m w~_m) / S)
 *                    and the softmax (dl_i = p_i (dp_i - sum_j p_j dp_j),
 *                    dp_i summed over the slots that chose i); one warp per
 *                    token.
 *
 * Blocks are multiples of 32 threads (full-mask warp shuffles).  Products
 * that the CPU rounds before adding use ej_mul_* so that NVRTC does not
 * contract them into an FMA.
 */
#ifdef EJ_CUDA_SIM
#define ej_mul_f(a, b) ((a) * (b))
#define ej_mul_d(a, b) ((a) * (b))
#else
#define ej_mul_f(a, b) __fmul_rn((a), (b))
#define ej_mul_d(a, b) __dmul_rn((a), (b))
#endif
static __device__ __forceinline__ float ej_mul(float a, float b)
{
	return ej_mul_f(a, b);
}
static __device__ __forceinline__ double ej_mul(double a, double b)
{
	return ej_mul_d(a, b);
}

/* (a, ia) ranks before (b, ib): larger first, NaN largest, ties to the
 * lower index (a total order, so any reduction tree agrees) */
template <class T>
static __device__ __forceinline__ bool ej_moe_before(T a, long long ia, T b,
						     long long ib)
{
	bool na = a != a, nb = b != b;
	if (na || nb)
		return na && (!nb || ia < ib);
	return a > b || (a == b && ia < ib);
}

template <class T> static __device__ __forceinline__ T ej_moe_warp_sum(T v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

/* ---- 16-byte vectors of any float dtype ---------------------------------- */

/* lanes of a 16-byte vector of dtype code DT */
#define EJ_MOE_LANES(DT) ((DT) == 1 ? 8 : (DT) == 0 ? 4 : 2)

/* the EJ_MOE_LANES(DT) elements of p from element i (16-byte aligned) as A */
template <int DT, class A>
static __device__ __forceinline__ void ej_moe_vld(const void *p, long long i,
						  A *o)
{
	if (DT == 1) {
		float f[8];
		ej_vld_bf16x8((const ej_bf16 *)p + i, f);
		for (int q = 0; q < 8; q++)
			o[q] = (A)f[q];
	} else if (DT == 0) {
		float f[4];
		ej_vld_f32x4((const float *)p + i, f);
		for (int q = 0; q < 4; q++)
			o[q] = (A)f[q];
	} else {
		double f[2];
		ej_vld_f64x2((const double *)p + i, f);
		for (int q = 0; q < 2; q++)
			o[q] = (A)f[q];
	}
}

template <int DT, class A>
static __device__ __forceinline__ void ej_moe_vst(void *p, long long i,
						  const A *v)
{
	if (DT == 1) {
		float f[8];
		for (int q = 0; q < 8; q++)
			f[q] = (float)v[q];
		ej_vst_bf16x8((ej_bf16 *)p + i, f);
	} else if (DT == 0) {
		float f[4];
		for (int q = 0; q < 4; q++)
			f[q] = (float)v[q];
		ej_vst_f32x4((float *)p + i, f);
	} else {
		double f[2];
		for (int q = 0; q < 2; q++)
			f[q] = (double)v[q];
		ej_vst_f64x2((double *)p + i, f);
	}
}

/* the kernel RUN<DT, A, I> for a.dt, with 32-bit indices when a.i32 */
#define EJ_MOE_BY_DT(a, RUN)                                                   \
	do {                                                                   \
		if ((a).dt == 1)                                               \
			(a).i32 ? RUN<1, float, int>(a)                        \
				: RUN<1, float, long long>(a);                 \
		else if ((a).dt == 0)                                          \
			(a).i32 ? RUN<0, float, int>(a)                        \
				: RUN<0, float, long long>(a);                 \
		else                                                           \
			(a).i32 ? RUN<2, double, int>(a)                       \
				: RUN<2, double, long long>(a);                \
	} while (0)

/* ---- router -------------------------------------------------------------- */

template <class T>
static __device__ void ej_moe_route_tok(const struct ej_moe_route_args &a,
					long long n, int lane)
{
	const int E = a.E;
	T *p = (T *)a.probs + n * E;
	T m = -(T)ej_inf_d();
	for (int i = lane; i < E; i += 32) {
		T x = ej_fld<T>(a.logits, n * a.sl0 + i * a.sl1, a.ldt);
		m = x > m ? x : m;
	}
	for (int o = 16; o > 0; o >>= 1) {
		T y = __shfl_xor_sync(0xffffffffu, m, o);
		m = y > m ? y : m;
	}
	double s = 0;
	for (int i = lane; i < E; i += 32) {
		T x = ej_fld<T>(a.logits, n * a.sl0 + i * a.sl1, a.ldt);
		T e = sizeof(T) == 8 ? (T)exp((double)(x - m))
				     : (T)expf((float)(x - m));
		p[i] = e;
		s += (double)e;
	}
	s = ej_moe_warp_sum(s);
	const T inv = (T)(1.0 / s);
	for (int i = lane; i < E; i += 32)
		p[i] = ej_mul(p[i], inv);
	/* top-k: k rounds of a warp arg-max over the unselected experts; or
	 * the fixed assignment, each probability from the lane that wrote it.
	 * ej_moe_before is a strict total order, so the experts taken in the
	 * rounds before are those ordered before the last one taken (pv, pi):
	 * no per-thread list, nothing in local memory.  Lane 0 writes each
	 * slot as it is chosen, then divides by the sum (in slot order). */
	T *w = (T *)a.w + n * a.k;
	long long *idx = a.idx + n * a.k;
	T sum = (T)0, pv = (T)0;
	long long pi = -1;
	for (int j = 0; j < a.k; j++) {
		T bv = (T)0;
		long long bi = -1;
		if (a.fixed) {
			bi = (n * a.k + j) % E;
			const int owner = (int)(bi & 31);
			bv = __shfl_sync(0xffffffffu,
					 lane == owner ? p[bi] : (T)0, owner);
		} else {
			for (int i = lane; i < E && (j == 0 || pi >= 0);
			     i += 32) {
				const long long li = i;
				if (j > 0 && !ej_moe_before(pv, pi, p[i], li))
					continue;
				if (bi < 0 || ej_moe_before(p[i], li, bv, bi)) {
					bv = p[i];
					bi = i;
				}
			}
			for (int o = 16; o > 0; o >>= 1) {
				T ov = __shfl_xor_sync(0xffffffffu, bv, o);
				long long oi = __shfl_xor_sync(0xffffffffu, bi, o);
				if (oi >= 0 &&
				    (bi < 0 || ej_moe_before(ov, oi, bv, bi))) {
					bv = ov;
					bi = oi;
				}
			}
			pv = bv;
			pi = bi;
		}
		sum += bv;
		if (lane == 0) {
			w[j] = bv;
			idx[j] = bi;
		}
	}
	for (int j = 0; a.norm && lane == 0 && j < a.k; j++)
		w[j] = w[j] / sum;
}

extern "C" __global__ void ej_moe_route(const struct ej_moe_route_args a)
{
	const int lane = threadIdx.x & 31;
	const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
	for (long long n = (long long)blockIdx.x * (blockDim.x >> 5) +
			   (threadIdx.x >> 5);
	     n < a.N; n += warps) {
		if (a.rdt == 2)
			ej_moe_route_tok<double>(a, n, lane);
		else
			ej_moe_route_tok<float>(a, n, lane);
	}
}

/* ---- stable counting sort ------------------------------------------------ */

/* keys a block of the sort takes: one a thread */
#define EJ_MOE_SORT_T 256

/* Block b's keys into k[] (key -1 past n); each thread's key, its rank
 * among the equal keys before it in the block and how many the block has. */
static __device__ __forceinline__ long long
ej_moe_sort_rank(const struct ej_moe_sort_args &a, long long b, long long *k,
		 int *rank, int *tot)
{
	const int t = threadIdx.x;
	const long long i = b * EJ_MOE_SORT_T + t;
	const long long key = i < a.n ? a.key[i] : -1;
	k[t] = key;
	__syncthreads();
	int r = 0, c = 0;
	for (int j = 0; j < EJ_MOE_SORT_T; j++)
		if (k[j] == key) {
			c++;
			r += j < t;
		}
	*rank = r;
	*tot = c;
	return key;
}

/* scratch[b, e] = how many of block b's keys are e */
extern "C" __global__ void ej_moe_sort_count(const struct ej_moe_sort_args a)
{
	__shared__ long long k[EJ_MOE_SORT_T];
	for (long long b = blockIdx.x; b < a.G; b += gridDim.x) {
		for (long long e = threadIdx.x; e < a.B; e += blockDim.x)
			a.scratch[b * a.B + e] = 0;
		int rank, tot;
		const long long key = ej_moe_sort_rank(a, b, k, &rank, &tot);
		if (key >= 0 && rank == tot - 1) /* the key's last in b */
			a.scratch[b * a.B + key] = tot;
		__syncthreads();
	}
}

/* One block: base[b, e] = the keys e of blocks before b, counts[e] their
 * total, offsets the exclusive scan of the counts. */
extern "C" __global__ void ej_moe_sort_scan(const struct ej_moe_sort_args a)
{
	for (long long e = threadIdx.x; e < a.B; e += blockDim.x) {
		long long run = 0;
		for (long long b = 0; b < a.G; b++) {
			a.base[b * a.B + e] = run;
			run += a.scratch[b * a.B + e];
		}
		a.counts[e] = run;
	}
	__syncthreads();
	if (threadIdx.x == 0) {
		long long run = 0;
		for (long long e = 0; e < a.B; e++) {
			a.offsets[e] = run;
			run += a.counts[e];
		}
		a.offsets[a.B] = run;
	}
}

/* key i of block b goes to row offsets[e] + base[b, e] + its rank in b:
 * equal keys in position order (stable) */
extern "C" __global__ void
ej_moe_sort_scatter(const struct ej_moe_sort_args a)
{
	__shared__ long long k[EJ_MOE_SORT_T];
	for (long long b = blockIdx.x; b < a.G; b += gridDim.x) {
		int rank, tot;
		const long long key = ej_moe_sort_rank(a, b, k, &rank, &tot);
		if (key >= 0) {
			const long long i = b * EJ_MOE_SORT_T + threadIdx.x;
			const long long r =
			    a.offsets[key] + a.base[b * a.B + key] + rank;
			a.order[r] = i;
			a.pos[i] = r;
		}
		__syncthreads();
	}
}

/* ---- permute / unpermute ------------------------------------------------- */

/* rows as 16-byte vectors, whatever the dtype: hv vectors a row */
template <class I>
static __device__ void ej_moe_permute_v16(const struct ej_moe_permute_args &a)
{
	const I hv = (I)(a.H * a.elem / 16), sv = (I)(a.sx0 * a.elem / 16);
	const I R = (I)a.R, k = (I)a.k;
	const uint4 *x = (const uint4 *)a.x;
	uint4 *o = (uint4 *)a.out;
	for (I r = (I)blockIdx.x; r < R; r += (I)gridDim.x) {
		const I n = (I)a.order[r] / k;
		for (I h = (I)threadIdx.x; h < hv; h += (I)blockDim.x)
			o[r * hv + h] = x[n * sv + h];
	}
}

template <class I>
static __device__ void ej_moe_permute_el(const struct ej_moe_permute_args &a)
{
	const I H = (I)a.H, R = (I)a.R, k = (I)a.k;
	const I sx0 = (I)a.sx0, sx1 = (I)a.sx1;
	for (I r = (I)blockIdx.x; r < R; r += (I)gridDim.x) {
		const I n = (I)a.order[r] / k;
		for (I h = (I)threadIdx.x; h < H; h += (I)blockDim.x)
			ej_copy_bits(a.out, r * H + h, a.x, n * sx0 + h * sx1,
				     a.elem);
	}
}

extern "C" __global__ void ej_moe_permute(const struct ej_moe_permute_args a)
{
	if (a.vec)
		a.i32 ? ej_moe_permute_v16<int>(a)
		      : ej_moe_permute_v16<long long>(a);
	else
		a.i32 ? ej_moe_permute_el<int>(a)
		      : ej_moe_permute_el<long long>(a);
}

template <class A>
static __device__ void ej_moe_permute_bw_row(
    const struct ej_moe_permute_bw_args &a, long long n)
{
	for (long long h = threadIdx.x; h < a.H; h += blockDim.x) {
		A acc = (A)0;
		for (int j = 0; j < a.k; j++)
			acc += ej_fld<A>(a.dxs, a.pos[n * a.k + j] * a.H + h,
					    a.dt);
		ej_fst<A>(a.dx, n * a.H + h, a.dt, acc);
	}
}

/* 16-byte vectors of the row: V lanes a thread */
template <int DT, class A, class I>
static __device__ void ej_moe_permute_bw_v16(
    const struct ej_moe_permute_bw_args &a)
{
	const I V = EJ_MOE_LANES(DT), H = (I)a.H, hv = H / V, k = (I)a.k;
	for (I n = (I)blockIdx.x; n < (I)a.N; n += (I)gridDim.x)
		for (I h = (I)threadIdx.x; h < hv; h += (I)blockDim.x) {
			A acc[8], v[8];
			for (int q = 0; q < V; q++)
				acc[q] = (A)0;
			for (I j = 0; j < k; j++) {
				ej_moe_vld<DT>(a.dxs,
					       (I)a.pos[n * k + j] * H + h * V,
					       v);
				for (int q = 0; q < V; q++)
					acc[q] += v[q];
			}
			ej_moe_vst<DT>(a.dx, n * H + h * V, acc);
		}
}

extern "C" __global__ void
ej_moe_permute_bw(const struct ej_moe_permute_bw_args a)
{
	if (a.vec) {
		EJ_MOE_BY_DT(a, ej_moe_permute_bw_v16);
		return;
	}
	for (long long n = blockIdx.x; n < a.N; n += gridDim.x) {
		if (a.dt == 2)
			ej_moe_permute_bw_row<double>(a, n);
		else
			ej_moe_permute_bw_row<float>(a, n);
	}
}

/* ---- weighted combine ---------------------------------------------------- */

template <class A>
static __device__ void ej_moe_combine_row(const struct ej_moe_combine_args &a,
					  long long n)
{
	for (long long h = threadIdx.x; h < a.H; h += blockDim.x) {
		A acc = (A)0;
		for (int j = 0; j < a.k; j++) {
			const long long s = n * a.k + j;
			A wj = ((const A *)a.w)[s];
			acc += ej_mul(
			    ej_fld<A>(a.y, a.pos[s] * a.H + h, a.dt), wj);
		}
		ej_fst<A>(a.out, n * a.H + h, a.dt, acc);
	}
}

/* 16-byte vectors of the row: V lanes a thread, each lane's sum as the
 * scalar kernel adds it (same order, same rounding) */
template <int DT, class A, class I>
static __device__ void ej_moe_combine_v16(const struct ej_moe_combine_args &a)
{
	const I V = EJ_MOE_LANES(DT), H = (I)a.H, hv = H / V, k = (I)a.k;
	for (I n = (I)blockIdx.x; n < (I)a.N; n += (I)gridDim.x)
		for (I h = (I)threadIdx.x; h < hv; h += (I)blockDim.x) {
			A acc[8], v[8];
			for (int q = 0; q < V; q++)
				acc[q] = (A)0;
			for (I j = 0; j < k; j++) {
				const I s = n * k + j;
				const A wj = ((const A *)a.w)[s];
				ej_moe_vld<DT>(a.y, (I)a.pos[s] * H + h * V,
					       v);
				for (int q = 0; q < V; q++)
					acc[q] += ej_mul(v[q], wj);
			}
			ej_moe_vst<DT>(a.out, n * H + h * V, acc);
		}
}

/* slot s's row: dy[pos[s]] = w[s] * dout[s / k], 16-byte vectors */
template <int DT, class A, class I>
static __device__ void ej_moe_combine_bw_y_v16(
    const struct ej_moe_combine_args &a)
{
	const I V = EJ_MOE_LANES(DT), H = (I)a.H, hv = H / V, k = (I)a.k;
	const I S = (I)a.N * k;
	for (I s = (I)blockIdx.x; s < S; s += (I)gridDim.x) {
		const I r = (I)a.pos[s], n = s / k;
		const A ws = ((const A *)a.w)[s];
		for (I h = (I)threadIdx.x; h < hv; h += (I)blockDim.x) {
			A v[8];
			ej_moe_vld<DT>(a.dout, n * H + h * V, v);
			for (int q = 0; q < V; q++)
				v[q] = ej_mul(v[q], ws);
			ej_moe_vst<DT>(a.out, r * H + h * V, v);
		}
	}
}

/* the vector kernel RUN for the layer dtype a.dt and the weights' a.wdt */
#define EJ_MOE_BY_DT_W(a, RUN)                                                 \
	do {                                                                   \
		if ((a).wdt == 2) {                                            \
			if ((a).dt == 1)                                       \
				(a).i32 ? RUN<1, double, int>(a)               \
					: RUN<1, double, long long>(a);        \
			else if ((a).dt == 0)                                  \
				(a).i32 ? RUN<0, double, int>(a)               \
					: RUN<0, double, long long>(a);        \
			else                                                   \
				(a).i32 ? RUN<2, double, int>(a)               \
					: RUN<2, double, long long>(a);        \
		} else {                                                       \
			if ((a).dt == 1)                                       \
				(a).i32 ? RUN<1, float, int>(a)                \
					: RUN<1, float, long long>(a);         \
			else if ((a).dt == 0)                                  \
				(a).i32 ? RUN<0, float, int>(a)                \
					: RUN<0, float, long long>(a);         \
			else                                                   \
				(a).i32 ? RUN<2, float, int>(a)                \
					: RUN<2, float, long long>(a);         \
		}                                                              \
	} while (0)

extern "C" __global__ void ej_moe_combine(const struct ej_moe_combine_args a)
{
	if (a.vec) {
		EJ_MOE_BY_DT_W(a, ej_moe_combine_v16);
		return;
	}
	for (long long n = blockIdx.x; n < a.N; n += gridDim.x) {
		if (a.wdt == 2)
			ej_moe_combine_row<double>(a, n);
		else
			ej_moe_combine_row<float>(a, n);
	}
}

template <class A>
static __device__ void ej_moe_combine_bw_y_slot(
    const struct ej_moe_combine_args &a, long long s)
{
	const long long r = a.pos[s], n = s / a.k;
	const A ws = ((const A *)a.w)[s];
	for (long long h = threadIdx.x; h < a.H; h += blockDim.x)
		ej_fst<A>(
		    a.out, r * a.H + h, a.dt,
		    ej_mul(ej_fld<A>(a.dout, n * a.H + h, a.dt), ws));
}

extern "C" __global__ void
ej_moe_combine_bw_y(const struct ej_moe_combine_args a)
{
	if (a.vec) {
		EJ_MOE_BY_DT_W(a, ej_moe_combine_bw_y_v16);
		return;
	}
	const long long S = a.N * a.k;
	for (long long s = blockIdx.x; s < S; s += gridDim.x) {
		if (a.wdt == 2)
			ej_moe_combine_bw_y_slot<double>(a, s);
		else
			ej_moe_combine_bw_y_slot<float>(a, s);
	}
}

template <class A>
static __device__ void ej_moe_combine_bw_w_slot(
    const struct ej_moe_combine_args &a, long long s, int lane)
{
	const long long n = s / a.k, row = a.pos[s];
	A acc = (A)0;
	for (long long h = lane; h < a.H; h += 32)
		acc += ej_mul(ej_fld<A>(a.dout, n * a.H + h, a.dt),
			      ej_fld<A>(a.y, row * a.H + h, a.dt));
	acc = ej_moe_warp_sum(acc);
	if (lane == 0)
		((A *)a.out)[s] = acc;
}

extern "C" __global__ void
ej_moe_combine_bw_w(const struct ej_moe_combine_args a)
{
	const int lane = threadIdx.x & 31;
	const long long S = a.N * a.k;
	const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
	for (long long s = (long long)blockIdx.x * (blockDim.x >> 5) +
			   (threadIdx.x >> 5);
	     s < S; s += warps) {
		if (a.wdt == 2)
			ej_moe_combine_bw_w_slot<double>(a, s, lane);
		else
			ej_moe_combine_bw_w_slot<float>(a, s, lane);
	}
}

/* ---- router backward ----------------------------------------------------- */

template <class T>
static __device__ void ej_moe_route_bw_tok(const struct ej_moe_route_bw_args &a,
					   long long n, int lane)
{
	const T *p = (const T *)a.probs + n * a.E;
	const long long *id = a.idx + n * a.k;
	const T *dw = (const T *)a.dw + n * a.k;
	/* dp_j = (dw_j - c) / S when renormalised, else dw_j: recomputed
	 * where used (no per-thread array in local memory) */
	T S = (T)0, c = (T)0;
	for (int j = 0; j < a.k; j++)
		S += p[id[j]];
	for (int j = 0; a.norm && j < a.k; j++)
		c += dw[j] * (p[id[j]] / S);
#define EJ_MOE_DP(j) (a.norm ? (dw[j] - c) / S : dw[j])
	T inner = (T)0;
	for (int j = 0; j < a.k; j++)
		inner += p[id[j]] * EJ_MOE_DP(j);
	for (int i = lane; i < a.E; i += 32) {
		T d = (T)0;
		for (int j = 0; j < a.k; j++)
			if (id[j] == i)
				d += EJ_MOE_DP(j);
		((T *)a.dlogits)[n * a.E + i] = p[i] * (d - inner);
	}
#undef EJ_MOE_DP
}

extern "C" __global__ void ej_moe_route_bw(const struct ej_moe_route_bw_args a)
{
	const int lane = threadIdx.x & 31;
	const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
	for (long long n = (long long)blockIdx.x * (blockDim.x >> 5) +
			   (threadIdx.x >> 5);
	     n < a.N; n += warps) {
		if (a.rdt == 2)
			ej_moe_route_bw_tok<double>(a, n, lane);
		else
			ej_moe_route_bw_tok<float>(a, n, lane);
	}
}

/* ---- SwiGLU -------------------------------------------------------------- */

/* y = g / (1 + exp(-g)) * u and its backward, as lib/ops_moe.c writes them
 * (f32 for f32 and bf16, rounded once to the dtype; f64 for f64) */
static __device__ __forceinline__ float ej_swiglu_e(float g)
{
	return expf(-g);
}
static __device__ __forceinline__ double ej_swiglu_e(double g)
{
	return exp(-g);
}
template <class A> static __device__ __forceinline__ A ej_swiglu_y(A g, A u)
{
	return g / ((A)1 + ej_swiglu_e(g)) * u;
}
template <class A>
static __device__ __forceinline__ void ej_swiglu_d(A d, A g, A u, A *dg, A *du)
{
	const A s = (A)1 / ((A)1 + ej_swiglu_e(g));
	*dg = d * u * s * ((A)1 + g * ((A)1 - s));
	*du = d * g * s;
}

/* Grid-stride over 16-byte vectors (when a.vec), then the tail (and every
 * element when not a.vec) one element per thread. */
template <int DT, class A, class I>
static __device__ void ej_swiglu_fwd_run(const struct ej_swiglu_args &a)
{
	const I V = EJ_MOE_LANES(DT), n = (I)a.n, nv = a.vec ? n / V : 0;
	const I t0 = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x;
	const I T = (I)gridDim.x * (I)blockDim.x;
	for (I v = t0; v < nv; v += T) {
		A g[8], u[8], y[8];
		ej_moe_vld<DT>(a.g, v * V, g);
		ej_moe_vld<DT>(a.u, v * V, u);
		for (int q = 0; q < V; q++)
			y[q] = ej_swiglu_y(g[q], u[q]);
		ej_moe_vst<DT>(a.y, v * V, y);
	}
	for (I i = nv * V + t0; i < n; i += T)
		ej_fst<A>(a.y, i, DT,
			  ej_swiglu_y(ej_fld<A>(a.g, i, DT),
				      ej_fld<A>(a.u, i, DT)));
}

template <int DT, class A, class I>
static __device__ void ej_swiglu_bwd_run(const struct ej_swiglu_args &a)
{
	const I V = EJ_MOE_LANES(DT), n = (I)a.n, nv = a.vec ? n / V : 0;
	const I t0 = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x;
	const I T = (I)gridDim.x * (I)blockDim.x;
	for (I v = t0; v < nv; v += T) {
		A d[8], g[8], u[8], dg[8], du[8];
		ej_moe_vld<DT>(a.d, v * V, d);
		ej_moe_vld<DT>(a.g, v * V, g);
		ej_moe_vld<DT>(a.u, v * V, u);
		for (int q = 0; q < V; q++)
			ej_swiglu_d(d[q], g[q], u[q], &dg[q], &du[q]);
		ej_moe_vst<DT>(a.y, v * V, dg);
		ej_moe_vst<DT>(a.du, v * V, du);
	}
	for (I i = nv * V + t0; i < n; i += T) {
		A dg, du;
		ej_swiglu_d(ej_fld<A>(a.d, i, DT), ej_fld<A>(a.g, i, DT),
			    ej_fld<A>(a.u, i, DT), &dg, &du);
		ej_fst<A>(a.y, i, DT, dg);
		ej_fst<A>(a.du, i, DT, du);
	}
}


extern "C" __global__ void ej_swiglu_fwd(const struct ej_swiglu_args a)
{
	EJ_MOE_BY_DT(a, ej_swiglu_fwd_run);
}

extern "C" __global__ void ej_swiglu_bwd(const struct ej_swiglu_args a)
{
	EJ_MOE_BY_DT(a, ej_swiglu_bwd_run);
}
