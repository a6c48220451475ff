/* gemm.cuh -- GEMM kernels: C = epilogue(op(A) op(B)), batched (two
 * strided batch levels) or grouped over row blocks.
 *
 * Operands are described by element strides, not by a layout enum:
 * op(A) is [m, k] with element (i, p) at a[i * a_rs + p * a_cs], op(B) is
 * [k, n] with element (p, j) at b[p * b_rs + j * b_cs]; C is [m, n] with
 * row stride ldc (column stride 1).  So A.B, A.B^T (linear's x.w^T: b_rs = 1,
 * b_cs = ldw), A^T.B (weight gradients: a_rs = 1) and sliced or broadcast
 * views are the same kernel.
 *
 * Epilogue, per output element (i, j), from the fp32 (f64 for the f64
 * kernel) accumulator acc:
 *     v = act(acc + bias[j * bias_cs]) + res[i * ldr + j]
 * bias and res optional (NULL), act none / silu / gelu (EJ_GEMM_ACT_*),
 * then stored as f32 or bf16 (round to nearest even, once).  res is a
 * separate input (the beta = 1 accumulate of a residual add); it may be
 * C itself, element by element.
 *
 * Batches: blockIdx.z = z0 * nb1 + z1 and every pointer moves by
 * z0 * s?0 + z1 * s?1 elements (s = sa, sb, sc, sr; the bias by z0 * sbias).
 * Grouped (goff != NULL, groups G): group g covers rows [goff[g],
 * goff[g+1]) of A, C and res and uses B + g * sb0 (its own weight matrix)
 * and bias + g * sbias; blockIdx.y enumerates the groups' 64-row tiles in
 * order (the grid has at least sum_g ceil(rows_g / 64) of them; spare
 * blocks return at once) and empty groups have no tile.
 *
 * ej_gemm_bf16: bf16 A and B, tensor cores.  Block 128 threads (4 warps in
 * 2 x 2), tile 64 x 64 x 32, each warp 32 x 32 = 2 x 4 mma.sync m16n8k16
 * with fp32 accumulators.  Shared memory: two stages (double buffering) of
 * an A tile and a B tile, each stored in the operand's own contiguous
 * direction ([m][k] when k is contiguous, [k][m] when m is; ldmatrix or
 * ldmatrix.trans makes the fragments either way) with 8 elements of row
 * padding.  a_vec / b_vec (set by the host when the contiguous stride is 1,
 * the other and the batch strides are multiples of 8 elements and the base
 * is 16-byte aligned) load tiles with 16-byte cp.async copies whose tails
 * (m, n and k) are zero-filled through the copy's source size; otherwise
 * every thread loads elements with bounds checks (zeros outside).  The
 * next k tile is in flight while the current one is multiplied
 * (cp.async.wait_group 1; two barriers per k tile).
 * Grid: (ceil(n / 64), m tiles, batches).
 *
 * ej_gemm_simt_f32 / ej_gemm_simt_f64: f32 / f64 A and B, plain FMA in the
 * input precision (no tensor cores).  Block 256 threads (16 x 16), tile
 * 32 x 32 x 16, 2 x 2 outputs per thread; bias and res in the input
 * dtype, output in the input dtype.  Grid: (ceil(n / 32), m tiles of 32,
 * batches); grouped as above with 32-row tiles.
 *
 * Every thread of a block reaches every barrier (out-of-range rows and
 * columns load zeros and skip only their stores), and every output element
 * is written by one thread in a fixed order, so results are deterministic.
 */

/* Full unrolling of the loops over per-thread accumulator arrays (NVRTC;
 * cuda-sim's host compiler needs no hint). */
#ifdef EJ_CUDA_SIM
#define EJ_GEMM_UNROLL
#else
#define EJ_GEMM_UNROLL _Pragma("unroll")
#endif
#ifndef EJ_GEMM_ACT_NONE
#define EJ_GEMM_ACT_NONE 0
#define EJ_GEMM_ACT_SILU 1
#define EJ_GEMM_ACT_GELU 2
#endif

#define EJ_GB_M	      64
#define EJ_GB_N	      64
#define EJ_GB_K	      32
#define EJ_GB_THREADS 128
/* one stage of one operand: [64][32 + 8] or [32][64 + 8] elements */
#define EJ_GB_TILE 2560

/* Rows [m0, m0 + tile) of one batch or group: the pointers and sizes a
 * block works on.  Returns false when the block has no tile (grouped). */
struct ej_gemm_job {
	const char *a, *b; /* element 0 of the block's batch/group */
	char *c;
	const char *bias, *res;
	long long m, m0;
};

__device__ __forceinline__ bool ej_gemm_job_of(const struct ej_gemm_args &p,
					       int tile_m, int esz, int csz,
					       int bsz, int rsz,
					       struct ej_gemm_job *j)
{
	long long oa, ob, oc, obias = 0, orr;
	if (p.goff) {
		long long t = blockIdx.y, g = 0, rows = 0;
		for (; g < p.groups; g++) {
			rows = p.goff[g + 1] - p.goff[g];
			long long nt = (rows + tile_m - 1) / tile_m;
			if (t < nt)
				break;
			t -= nt;
		}
		if (g == p.groups)
			return false;
		long long r0 = p.goff[g];
		j->m = rows;
		j->m0 = t * tile_m;
		oa = r0 * p.a_rs;
		ob = g * p.sb0;
		oc = r0 * p.ldc;
		orr = r0 * p.ldr;
		obias = g * p.sbias;
	} else {
		long long z0 = blockIdx.z / p.nb1, z1 = blockIdx.z % p.nb1;
		j->m = p.m;
		j->m0 = (long long)blockIdx.y * tile_m;
		oa = z0 * p.sa0 + z1 * p.sa1;
		ob = z0 * p.sb0 + z1 * p.sb1;
		oc = z0 * p.sc0 + z1 * p.sc1;
		orr = z0 * p.sr0 + z1 * p.sr1;
		obias = z0 * p.sbias;
	}
	j->a = (const char *)p.a + oa * esz;
	j->b = (const char *)p.b + ob * esz;
	j->c = (char *)p.c + oc * csz;
	j->bias = p.bias ? (const char *)p.bias + obias * bsz : 0;
	j->res = p.res ? (const char *)p.res + orr * rsz : 0;
	return true;
}

__device__ __forceinline__ float ej_gemm_act_f(float v, int act)
{
	return act == EJ_GEMM_ACT_SILU	 ? ej_silu_f(v)
	       : act == EJ_GEMM_ACT_GELU ? ej_gelu_f(v)
					 : v;
}
__device__ __forceinline__ double ej_gemm_act_d(double v, int act)
{
	return act == EJ_GEMM_ACT_SILU	 ? ej_silu_d(v)
	       : act == EJ_GEMM_ACT_GELU ? ej_gelu_d(v)
					 : v;
}

/* ---- bf16 tensor-core kernel -------------------------------------------- */

/* Loads the [rows, k] tile of an operand (rows: m of A or n of B) starting
 * at (r0, k0) into s.  rs/cs: strides of row and k; kmaj: s is [row][k]
 * (k contiguous), else [k][row].  vec: 16-byte cp.async copies along the
 * contiguous direction (the caller commits the group). */
__device__ __forceinline__ void
ej_gemm_load_tile(unsigned short *s, const unsigned short *g, long long rows,
		  long long k, long long r0, long long k0, long long rs,
		  long long cs, int kmaj, int vec, int tile_r)
{
	const int tid = threadIdx.x;
	if (vec && kmaj) { /* [tile_r][32 + 8], k contiguous in memory */
		for (int c = tid; c < tile_r * (EJ_GB_K / 8);
		     c += EJ_GB_THREADS) {
			int r = c / (EJ_GB_K / 8), kc = (c % (EJ_GB_K / 8)) * 8;
			long long gr = r0 + r, gk = k0 + kc;
			long long left = k - gk;
			int nv = gr < rows && left > 0 ? (left < 8 ? (int)left : 8)
						       : 0;
			const unsigned short *src = nv ? g + gr * rs + gk : g;
			ej_cp_async16(s + r * (EJ_GB_K + 8) + kc, src, 2 * nv);
		}
	} else if (vec) { /* [32][tile_r + 8], rows contiguous in memory */
		for (int c = tid; c < EJ_GB_K * (tile_r / 8);
		     c += EJ_GB_THREADS) {
			int kk = c / (tile_r / 8), rc = (c % (tile_r / 8)) * 8;
			long long gr = r0 + rc, gk = k0 + kk;
			long long left = rows - gr;
			int nv = gk < k && left > 0 ? (left < 8 ? (int)left : 8)
						    : 0;
			const unsigned short *src = nv ? g + gk * cs + gr : g;
			ej_cp_async16(s + kk * (tile_r + 8) + rc, src, 2 * nv);
		}
	} else {
		for (int e = tid; e < tile_r * EJ_GB_K; e += EJ_GB_THREADS) {
			int r, kk;
			if (kmaj) {
				r = e / EJ_GB_K;
				kk = e % EJ_GB_K;
			} else {
				kk = e / tile_r;
				r = e % tile_r;
			}
			long long gr = r0 + r, gk = k0 + kk;
			unsigned short v = 0;
			if (gr < rows && gk < k)
				v = g[gr * rs + gk * cs];
			if (kmaj)
				s[r * (EJ_GB_K + 8) + kk] = v;
			else
				s[kk * (tile_r + 8) + r] = v;
		}
	}
}

extern "C" __global__ void __launch_bounds__(EJ_GB_THREADS)
    ej_gemm_bf16(const struct ej_gemm_args p)
{
	__shared__ __align__(16) unsigned short sa[2][EJ_GB_TILE];
	__shared__ __align__(16) unsigned short sb[2][EJ_GB_TILE];
	struct ej_gemm_job j;
	if (!ej_gemm_job_of(p, EJ_GB_M, 2, p.c_bf16 ? 2 : 4,
			    p.bias_bf16 ? 2 : 4, p.res_bf16 ? 2 : 4, &j))
		return;
	const unsigned short *A = (const unsigned short *)j.a;
	const unsigned short *B = (const unsigned short *)j.b;
	const long long n0 = (long long)blockIdx.x * EJ_GB_N;
	/* A: rows m, k; B as rows n, k (b_cs walks n, b_rs walks k) */
	const int a_kmaj = !(p.a_rs == 1 && p.a_cs != 1);
	const int b_kmaj = !(p.b_cs == 1 && p.b_rs != 1);
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
	const int g = lane >> 2, t = lane & 3, lr = lane & 7, lj = lane >> 3;
	float acc[2][4][4];
	for (int x = 0; x < 2; x++)
		for (int y = 0; y < 4; y++)
			for (int i = 0; i < 4; i++)
				acc[x][y][i] = 0.0f;

	const long long nk = (p.k + EJ_GB_K - 1) / EJ_GB_K;
	if (nk > 0) {
		ej_gemm_load_tile(sa[0], A, j.m, p.k, j.m0, 0, p.a_rs, p.a_cs,
				  a_kmaj, p.a_vec, EJ_GB_M);
		ej_gemm_load_tile(sb[0], B, p.n, p.k, n0, 0, p.b_cs, p.b_rs,
				  b_kmaj, p.b_vec, EJ_GB_N);
		ej_cp_async_commit();
	}
	for (long long kt = 0; kt < nk; kt++) {
		const int cur = (int)(kt & 1);
		if (kt + 1 < nk) {
			ej_gemm_load_tile(sa[cur ^ 1], A, j.m, p.k, j.m0,
					  (kt + 1) * EJ_GB_K, p.a_rs, p.a_cs,
					  a_kmaj, p.a_vec, EJ_GB_M);
			ej_gemm_load_tile(sb[cur ^ 1], B, p.n, p.k, n0,
					  (kt + 1) * EJ_GB_K, p.b_cs, p.b_rs,
					  b_kmaj, p.b_vec, EJ_GB_N);
			ej_cp_async_commit();
			ej_cp_async_wait(1);
		} else {
			ej_cp_async_wait(0);
		}
		__syncthreads();
		const unsigned short *ta = sa[cur], *tb = sb[cur];
		for (int ks = 0; ks < EJ_GB_K; ks += 16) {
			unsigned af[2][4], bf[4][2];
			for (int x = 0; x < 2; x++) {
				int mb = wm + x * 16;
				if (a_kmaj)
					ej_ldmatrix_x4(
					    af[x],
					    ta + (mb + lr + 8 * (lj & 1)) *
						     (EJ_GB_K + 8) +
						ks + 8 * (lj >> 1));
				else
					ej_ldmatrix_x4_trans(
					    af[x],
					    ta + (ks + lr + 8 * (lj >> 1)) *
						     (EJ_GB_M + 8) +
						mb + 8 * (lj & 1));
			}
			for (int y = 0; y < 4; y += 2) {
				int nb = wn + y * 8;
				unsigned r[4];
				if (b_kmaj)
					ej_ldmatrix_x4(
					    r, tb + (nb + lr + 8 * (lj >> 1)) *
							(EJ_GB_K + 8) +
						   ks + 8 * (lj & 1));
				else
					ej_ldmatrix_x4_trans(
					    r, tb + (ks + lr + 8 * (lj & 1)) *
							(EJ_GB_N + 8) +
						   nb + 8 * (lj >> 1));
				bf[y][0] = r[0];
				bf[y][1] = r[1];
				bf[y + 1][0] = r[2];
				bf[y + 1][1] = r[3];
			}
			for (int x = 0; x < 2; x++)
				for (int y = 0; y < 4; y++)
					ej_mma_bf16_16816(acc[x][y], af[x],
							  bf[y], acc[x][y]);
		}
		__syncthreads();
	}

	/* unrolled: acc indexed at compile time stays in registers (a
	 * rolled loop puts it in a stack frame; t/check_ptxas.c) */
	EJ_GEMM_UNROLL
	for (int x = 0; x < 2; x++)
		EJ_GEMM_UNROLL
		for (int y = 0; y < 4; y++)
			EJ_GEMM_UNROLL
			for (int i = 0; i < 4; i++) {
				long long row = j.m0 + wm + x * 16 + g +
						8 * (i >> 1);
				long long col = n0 + wn + y * 8 + 2 * t + (i & 1);
				if (row >= j.m || col >= p.n)
					continue;
				float v = acc[x][y][i];
				if (j.bias) {
					long long o = col * p.bias_cs;
					v += p.bias_bf16
						 ? ej_bf2f(((const ej_bf16 *)
								j.bias)[o])
						 : ((const float *)j.bias)[o];
				}
				v = ej_gemm_act_f(v, p.act);
				if (j.res) {
					long long o = row * p.ldr + col;
					v += p.res_bf16
						 ? ej_bf2f(((const ej_bf16 *)
								j.res)[o])
						 : ((const float *)j.res)[o];
				}
				long long o = row * p.ldc + col;
				if (p.c_bf16)
					((ej_bf16 *)j.c)[o] = ej_f2bf(v);
				else
					((float *)j.c)[o] = v;
			}
}

/* ---- f32 / f64 SIMT kernels --------------------------------------------- */

#define EJ_GS_M 32
#define EJ_GS_N 32
#define EJ_GS_K 16

template <class T>
__device__ __forceinline__ void ej_gemm_simt(const struct ej_gemm_args &p,
					     T *sa, T *sb)
{
	struct ej_gemm_job j;
	if (!ej_gemm_job_of(p, EJ_GS_M, (int)sizeof(T), (int)sizeof(T),
			    (int)sizeof(T), (int)sizeof(T), &j))
		return;
	const T *A = (const T *)j.a, *B = (const T *)j.b;
	const long long n0 = (long long)blockIdx.x * EJ_GS_N;
	const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
	T acc[2][2] = { { 0, 0 }, { 0, 0 } };
	for (long long k0 = 0; k0 < p.k; k0 += EJ_GS_K) {
		/* sa [k][m + 1], sb [k][n + 1] */
		for (int e = threadIdx.x; e < EJ_GS_M * EJ_GS_K; e += 256) {
			int r = e / EJ_GS_K, kk = e % EJ_GS_K;
			long long gr = j.m0 + r, gk = k0 + kk;
			sa[kk * (EJ_GS_M + 1) + r] =
			    gr < j.m && gk < p.k
				? A[gr * p.a_rs + gk * p.a_cs]
				: (T)0;
			long long gc = n0 + r;
			sb[kk * (EJ_GS_N + 1) + r] =
			    gc < p.n && gk < p.k
				? B[gk * p.b_rs + gc * p.b_cs]
				: (T)0;
		}
		__syncthreads();
		for (int kk = 0; kk < EJ_GS_K; kk++) {
			T a0 = sa[kk * (EJ_GS_M + 1) + ty];
			T a1 = sa[kk * (EJ_GS_M + 1) + ty + 16];
			T b0 = sb[kk * (EJ_GS_N + 1) + tx];
			T b1 = sb[kk * (EJ_GS_N + 1) + tx + 16];
			acc[0][0] += a0 * b0;
			acc[0][1] += a0 * b1;
			acc[1][0] += a1 * b0;
			acc[1][1] += a1 * b1;
		}
		__syncthreads();
	}
	EJ_GEMM_UNROLL
	for (int x = 0; x < 2; x++)
		EJ_GEMM_UNROLL
		for (int y = 0; y < 2; y++) {
			long long row = j.m0 + ty + 16 * x;
			long long col = n0 + tx + 16 * y;
			if (row >= j.m || col >= p.n)
				continue;
			T v = acc[x][y];
			if (j.bias)
				v += ((const T *)j.bias)[col * p.bias_cs];
			v = sizeof(T) == 8 ? (T)ej_gemm_act_d((double)v, p.act)
					   : (T)ej_gemm_act_f((float)v, p.act);
			if (j.res)
				v += ((const T *)j.res)[row * p.ldr + col];
			((T *)j.c)[row * p.ldc + col] = v;
		}
}

extern "C" __global__ void __launch_bounds__(256)
    ej_gemm_simt_f32(const struct ej_gemm_args p)
{
	__shared__ float sa[EJ_GS_K * (EJ_GS_M + 1)];
	__shared__ float sb[EJ_GS_K * (EJ_GS_N + 1)];
	ej_gemm_simt<float>(p, sa, sb);
}

extern "C" __global__ void __launch_bounds__(256)
    ej_gemm_simt_f64(const struct ej_gemm_args p)
{
	__shared__ double sa[EJ_GS_K * (EJ_GS_M + 1)];
	__shared__ double sb[EJ_GS_K * (EJ_GS_N + 1)];
	ej_gemm_simt<double>(p, sa, sb);
}
