/* optim.cuh -- SGD and AdamW/Adam steps over FP32 master weights on the CUDA
 * devices, multi-tensor: one launch updates a whole group of parameters.
 *
 * The host (kernels/tmpl_optim.c) passes an array of tensor descriptors, each
 * with its first block: block b belongs to the last tensor t whose first
 * block is <= b (a binary search, ej_optim_find) and updates elements
 * [(b - first_t) chunk, + chunk) of it (clipped to its length), its threads
 * striding over the chunk.  Every element is independent, so any block or
 * thread order gives the same bits.  The descriptors do not change from
 * step to step, so the host uploads them once and keeps them.
 *
 * The formulas are runtime/optim.c's, per element in double from f32
 * storage, with the same operation order; the products and sums go through
 * ej_om / ej_oa so NVRTC cannot contract them into FMAs (the CPU does not
 * either), hence the same bits as the CPU optimizer:
 *   SGD:   g = gs * grad + wd * p;  b = mom * b + g (b present);
 *          g = nesterov ? g + mom * b : b;  p = p - lr * g
 *   Adam:  g = gs * grad + l2 * p;  m = b1 * m + (1 - b1) * g;
 *          v = b2 * v + (1 - b2) * g * g;
 *          p = p * decay - step_size * m / (sqrt(v) / bc2_sqrt + eps)
 *   (AdamW: l2 = 0, decay = 1 - lr * wd; Adam with L2: l2 = wd, decay = 1;
 *   step_size = lr / (1 - b1^t), bc2_sqrt = sqrt(1 - b2^t) from the host.)
 * The gradient is f32 or bf16 (gdt 0 / 1); after the update the model copy
 * `model` (when not NULL) receives the new master as f32 or bf16 (mdt 0 / 1,
 * round to nearest even).
 *
 * The squared norm of the gradients (for the global-norm clipping) runs
 * over descriptors of the same layout, reading grad, n and first only:
 *   ej_optim_sumsq        block b: partial[b] = sum of grad^2 over item b,
 *                         in double, reduced by ej_block_sum;
 *   ej_optim_sumsq_total  ONE block: *out = sum of partial[0 .. n_items).
 * Every sum has a fixed order (no atomics), so the result does not depend
 * on the block order; it differs from the CPU's chunked sum by rounding
 * only (double sums of f32 squares).
 */
#ifdef EJ_CUDA_SIM
#define ej_om(a, b) ((a) * (b))
#define ej_oa(a, b) ((a) + (b))
#define ej_os(a, b) ((a) - (b))
#else
#define ej_om(a, b) __dmul_rn((a), (b))
#define ej_oa(a, b) __dadd_rn((a), (b))
#define ej_os(a, b) __dsub_rn((a), (b))
#endif

/* The descriptor of the tensor that owns block b: the last of t[0..n)
 * whose first block is <= b (t[0].first is 0). */
static __device__ int ej_optim_find(const struct ej_optim_tensor *t, int n,
				    long long b)
{
	int lo = 0, hi = n - 1;
	while (lo < hi) {
		int mid = (lo + hi + 1) / 2;
		if (t[mid].first <= b)
			lo = mid;
		else
			hi = mid - 1;
	}
	return lo;
}

extern "C" __global__ void ej_optim_step(const struct ej_optim_args a)
{
	const struct ej_optim_tensor T =
	    a.t[ej_optim_find(a.t, a.n_t, blockIdx.x)];
	const long long first = (blockIdx.x - T.first) * a.chunk;
	const long long hi = first + a.chunk < T.n ? first + a.chunk : T.n;
	for (long long k = first + threadIdx.x; k < hi; k += blockDim.x) {
		double pk = T.master_in[k];
		double gr = a.gdt == 1
				? (double)ej_bf2f(((const ej_bf16 *)T.grad)[k])
				: (double)((const float *)T.grad)[k];
		float np;
		if (!a.adam) {
			double gk = ej_oa(ej_om(a.gs, gr), ej_om(a.wd, pk));
			if (T.s1) {
				double bk = ej_oa(ej_om(a.mom, (double)T.s1_in[k]),
						  gk);
				T.s1[k] = (float)bk;
				gk = a.nesterov ? ej_oa(gk, ej_om(a.mom, bk))
						: bk;
			}
			np = (float)ej_os(pk, ej_om(a.lr, gk));
		} else {
			double gk = ej_oa(ej_om(a.gs, gr), ej_om(a.l2, pk));
			double mk = ej_oa(ej_om(a.b1, (double)T.s1_in[k]),
					  ej_om(a.omb1, gk));
			double vk = ej_oa(ej_om(a.b2, (double)T.s2_in[k]),
					  ej_om(ej_om(a.omb2, gk), gk));
			T.s1[k] = (float)mk;
			T.s2[k] = (float)vk;
			double denom = ej_oa(sqrt(vk) / a.bc2_sqrt, a.eps);
			np = (float)ej_os(ej_om(pk, a.decay),
					  ej_om(a.step_size, mk) / denom);
		}
		T.master[k] = np;
		if (T.model) {
			if (a.mdt == 1)
				((ej_bf16 *)T.model)[k] = ej_f2bf(np);
			else
				((float *)T.model)[k] = np;
		}
	}
}

/* ---- squared norm of the gradients ---------------------------------------- */

extern "C" __global__ void ej_optim_sumsq(const struct ej_optim_sumsq_args a)
{
	__shared__ double sh[32];
	const struct ej_optim_tensor T =
	    a.t[ej_optim_find(a.t, a.n_t, blockIdx.x)];
	const long long first = (blockIdx.x - T.first) * a.chunk;
	const long long hi = first + a.chunk < T.n ? first + a.chunk : T.n;
	double s = 0;
	for (long long k = first + threadIdx.x; k < hi; k += blockDim.x) {
		double g = a.gdt == 1
			       ? (double)ej_bf2f(((const ej_bf16 *)T.grad)[k])
			       : (double)((const float *)T.grad)[k];
		s = ej_oa(s, ej_om(g, g));
	}
	s = ej_block_sum(s, sh);
	if (threadIdx.x == 0)
		a.partial[blockIdx.x] = s;
}

extern "C" __global__ void
ej_optim_sumsq_total(const struct ej_optim_sumsq_args a)
{
	__shared__ double sh[32];
	double s = 0;
	for (long long i = threadIdx.x; i < a.n_items; i += blockDim.x)
		s = ej_oa(s, a.partial[i]);
	s = ej_block_sum(s, sh);
	if (threadIdx.x == 0)
		*a.out = s;
}
