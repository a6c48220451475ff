/* delta.cuh -- the gated delta rule (Gated DeltaNet's recurrence) on the
 * CUDA devices, computing what lib/ops_delta.c computes (see there for the
 * recurrence and its backward).  Inputs are contiguous (the host adapter
 * copies strided ones): q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta
 * [B, T, H], one dtype (code 0 f32, 1 bf16, 2 f64); arithmetic in f32
 * (f64 for f64).  Deterministic: no atomics, every sum in a fixed order.
 *
 * A column S[:, j] of the Dk x Dv state evolves on its own, forwards and
 * backwards: its read S~^T k and its write k d_j touch only that column,
 * and so do the backward's dS[:, j] updates.  So every kernel splits the
 * state by columns: a block of EJ_DELTA_THREADS (128) threads holds
 * EJ_DELTA_COLS (8) columns of one (batch, head), 2 per warp, each column
 * shared by EJ_DELTA_KL (16) lanes that hold its keys i = lane + 16 u in
 * registers (u < NU: the host builds one instantiation per NU = 4, 8 or
 * 16, for Dk up to 64, 128, 256 = EJ_DELTA_MAXK; fully unrolled, so no
 * local memory).  Dot products over the keys are 16-lane butterflies
 * (__shfl_xor_sync).  Work items are (batch, head, column tile), B H
 * ceil(Dv / 8) of them, grid-stride.
 *
 *  ej_delta_fwd       o [B, T, H, Dv]: the recurrence, o written per step
 *                     by lane 0 of each column.
 *  ej_delta_bwd_keep  the states before steps 0, CK, 2 CK, ... (CK =
 *                     EJ_DELTA_CK) into ws, [B H][ceil(T / CK)][state]
 *                     (a state padded to 16 ceil(Dk / 16) x 8 ceil(Dv /
 *                     8) elements: ej_delta_el).
 *  ej_delta_bwd_seg   the reverse sweep over steps [t0, t1) (a segment,
 *                     t0 a multiple of CK), dS carried in from dsin (zero
 *                     when t1 = T) and out to dsout, [B H][state]: per
 *                     chunk of CK steps the states are recomputed from
 *                     the kept one into chunk ([B H][CK][state]), then
 *                     walked backwards.  dv is complete per column; dq,
 *                     dk (sums over the columns) and dbeta, dg's inner
 *                     product (sums over columns and keys) are summed
 *                     over the block's columns (warp pairs by shuffle,
 *                     the 4 warps in shared memory, in warp order) and
 *                     written as one partial per column tile, part
 *                     [tile][B][t1 - t0][H][2 Dk + 2].
 *  ej_delta_bwd_sum   dq, dk, dbeta, dg of the segment: the partials
 *                     summed over the tiles in tile order.
 * The host launches keep once, then seg and sum per segment from the last
 * one back, so the partials take memory for one segment only.
 */

/* The instantiation (the host's defines): EJ_DELTA_F64 1 computes in f64
 * (f64 tensors), 0 in f32 (f32 and bf16); EJ_DELTA_NU keys per lane and
 * column (4, 8 or 16: Dk up to 16 NU). */
#ifndef EJ_DELTA_F64
#define EJ_DELTA_F64 0
#endif
#ifndef EJ_DELTA_NU
#define EJ_DELTA_NU 8
#endif
#if EJ_DELTA_F64
typedef double ej_delta_t;
#else
typedef float ej_delta_t;
#endif

#define EJ_DELTA_MAXK	 256
#define EJ_DELTA_CK	 64
#define EJ_DELTA_KL	 16
#define EJ_DELTA_COLS	 8
#define EJ_DELTA_THREADS 128

/* exp in the instantiation's compute type (one definition: NVRTC warns of
 * an unreferenced one) */
static __device__ ej_delta_t ej_delta_exp(ej_delta_t x)
{
#if EJ_DELTA_F64
	return exp(x);
#else
	return expf(x);
#endif
}

/* the sum over the 16 lanes of a column (every lane gets the same bits) */
template <class A> static __device__ A ej_delta_sum16(A v)
{
#pragma unroll
	for (int o = 1; o < EJ_DELTA_KL; o <<= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

/* One thread's place: column j of (b, h), keys kl + 16 u. */
struct ej_delta_at {
	long long bh, b, h, j;
	long long nu, dvp; /* the scratch states' key groups and columns */
	int kl;
	bool jv; /* j < Dv */
};

static __device__ ej_delta_at ej_delta_place(const struct ej_delta_args &a,
					     long long item)
{
	const long long nt = (a.Dv + EJ_DELTA_COLS - 1) / EJ_DELTA_COLS;
	const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
	ej_delta_at p;
	p.bh = item / nt;
	p.b = p.bh / a.H;
	p.h = p.bh % a.H;
	p.j = (item % nt) * EJ_DELTA_COLS + 2 * w + (lane >> 4);
	p.kl = lane & (EJ_DELTA_KL - 1);
	p.jv = p.j < a.Dv;
	p.nu = (a.Dk + EJ_DELTA_KL - 1) / EJ_DELTA_KL;
	p.dvp = nt * EJ_DELTA_COLS;
	return p;
}

/* Row r's keys of this thread (zero past Dk). */
template <class A, int NU>
static __device__ void ej_delta_keys(const struct ej_delta_args &a,
				     const void *x, long long r, int kl, A *o)
{
#pragma unroll
	for (int u = 0; u < NU; u++) {
		const long long i = kl + EJ_DELTA_KL * u;
		o[u] = i < a.Dk ? ej_fld<A>(x, r * a.Dk + i, a.dt) : (A)0;
	}
}

/* One forward step of a column: s <- al s + k d, d = be (v_j - (al s).k);
 * returns d. */
template <class A, int NU>
static __device__ A ej_delta_step(A *s, const A *kk, A al, A be, A vj)
{
	A m = (A)0;
#pragma unroll
	for (int u = 0; u < NU; u++) {
		s[u] *= al;
		m += s[u] * kk[u];
	}
	m = ej_delta_sum16(m);
	const A d = be * (vj - m);
#pragma unroll
	for (int u = 0; u < NU; u++)
		s[u] += kk[u] * d;
	return d;
}

/* This thread's element u of state number n of a scratch buffer of
 * states (kept, chunk, dS), or -1 past the state's key groups.  A state is
 * stored padded, [ceil(Dk / 16)][8 ceil(Dv / 8)][16]: key group u, column
 * j, key lane, so that a warp's 32 lanes touch 32 consecutive elements;
 * the padding holds zeros (the kernels' keys and values there are 0). */
static __device__ long long ej_delta_el(const struct ej_delta_args &a,
					const ej_delta_at &p, long long n,
					int u)
{
	return u < p.nu
		   ? ((n * p.nu + u) * p.dvp + p.j) * EJ_DELTA_KL + p.kl
		   : -1;
}

/* The forward of one column; with kept, no output but the states before
 * every CK-th step. */
template <class A, int NU>
static __device__ void ej_delta_fwd_col(const struct ej_delta_args &a,
					const ej_delta_at &p, A *kept)
{
	const long long nck = (a.T + EJ_DELTA_CK - 1) / EJ_DELTA_CK;
	A s[NU], kk[NU], qq[NU];
#pragma unroll
	for (int u = 0; u < NU; u++)
		s[u] = (A)0;
	for (long long t = 0; t < a.T; t++) {
		const long long r = (p.b * a.T + t) * a.H + p.h;
		if (kept && t % EJ_DELTA_CK == 0)
#pragma unroll
			for (int u = 0; u < NU; u++) {
				long long e = ej_delta_el(
				    a, p, p.bh * nck + t / EJ_DELTA_CK, u);
				if (e >= 0)
					kept[e] = s[u];
			}
		const A al = ej_delta_exp(ej_fld<A>(a.g, r, a.dt));
		const A be = ej_fld<A>(a.beta, r, a.dt);
		const A vj = p.jv ? ej_fld<A>(a.v, r * a.Dv + p.j, a.dt) : (A)0;
		ej_delta_keys<A, NU>(a, a.k, r, p.kl, kk);
		ej_delta_step<A, NU>(s, kk, al, be, vj);
		if (kept)
			continue;
		ej_delta_keys<A, NU>(a, a.q, r, p.kl, qq);
		A y = (A)0;
#pragma unroll
		for (int u = 0; u < NU; u++)
			y += s[u] * qq[u];
		y = ej_delta_sum16(y);
		if (p.jv && p.kl == 0)
			ej_fst<A>(a.o, r * a.Dv + p.j, a.dt, y);
	}
}

template <class A, int NU>
static __device__ void ej_delta_fwd_all(const struct ej_delta_args &a,
					A *kept)
{
	const long long nt = (a.Dv + EJ_DELTA_COLS - 1) / EJ_DELTA_COLS;
	for (long long it = blockIdx.x; it < a.B * a.H * nt; it += gridDim.x)
		ej_delta_fwd_col<A, NU>(a, ej_delta_place(a, it), kept);
}

extern "C" __global__ void __launch_bounds__(EJ_DELTA_THREADS)
    ej_delta_fwd(const struct ej_delta_args a)
{
	ej_delta_fwd_all<ej_delta_t, EJ_DELTA_NU>(a, (ej_delta_t *)0);
}

extern "C" __global__ void __launch_bounds__(EJ_DELTA_THREADS)
    ej_delta_bwd_keep(const struct ej_delta_args a)
{
	ej_delta_fwd_all<ej_delta_t, EJ_DELTA_NU>(a, (ej_delta_t *)a.ws);
}

/* The sum of v over the warp's 2 columns into slot e of this warp's row
 * of the block sums (by lane 0-15, the column pair's first). */
template <class A>
static __device__ void ej_delta_put(A *rw, long long e, bool ok, A v)
{
	v += __shfl_xor_sync(0xffffffffu, v, 16);
	if (ok && (threadIdx.x & 31) < EJ_DELTA_KL)
		rw[e] = v;
}

/* The block's sums of one step (the warps' rows of red, 2 MAXK + 2 each,
 * filled by ej_delta_put: dq at 0, dk at Dk, dbeta at 2 Dk, dg's inner
 * product at 2 Dk + 1) summed over the 4 warps in order into the partial
 * row `row` of tile `tile`. */
template <class A>
static __device__ void ej_delta_block_sum(const struct ej_delta_args &a,
					  const A *red, long long tile,
					  long long row)
{
	const int W = 2 * EJ_DELTA_MAXK + 2;
	__syncthreads();
	const long long nw = 2 * a.Dk + 2;
	const long long rows = a.B * (a.t1 - a.t0) * a.H;
	for (long long e = threadIdx.x; e < nw; e += blockDim.x) {
		A s = (A)0;
		for (int x = 0; x < EJ_DELTA_THREADS / 32; x++)
			s += red[x * W + e];
		((A *)a.part)[(tile * rows + row) * nw + e] = s;
	}
}

/* One reverse step at row r of a column: Sp = the state before the step;
 * dS updated in place; dv stored; the block's partial row written (red:
 * this step's buffer of block sums, 4 warps x (2 MAXK + 2)). */
template <class A, int NU>
static __device__ void ej_delta_back_step(const struct ej_delta_args &a,
					  const ej_delta_at &p, long long r,
					  const A *Sp, A *dS, A *red,
					  long long tile, long long row)
{
	A kk[NU];
	A *rw = red + (threadIdx.x >> 5) * (2 * EJ_DELTA_MAXK + 2);
	ej_delta_keys<A, NU>(a, a.k, r, p.kl, kk);
	const A al = ej_delta_exp(ej_fld<A>(a.g, r, a.dt));
	const A be = ej_fld<A>(a.beta, r, a.dt);
	const A vj = p.jv ? ej_fld<A>(a.v, r * a.Dv + p.j, a.dt) : (A)0;
	const A gj = p.jv ? ej_fld<A>(a.go, r * a.Dv + p.j, a.dt) : (A)0;
	A m = (A)0;
#pragma unroll
	for (int u = 0; u < NU; u++)
		m += al * Sp[u] * kk[u];
	m = ej_delta_sum16(m);
	const A dl = be * (vj - m);
	A dd = (A)0;
#pragma unroll
	for (int u = 0; u < NU; u++) {
		const long long i = p.kl + EJ_DELTA_KL * u;
		const A qi = i < a.Dk ? ej_fld<A>(a.q, r * a.Dk + i, a.dt) : (A)0;
		/* dq = S_t do, S_t = S~ + k dl */
		ej_delta_put(rw, i, i < a.Dk, (al * Sp[u] + kk[u] * dl) * gj);
		dS[u] += qi * gj;
		dd += dS[u] * kk[u];
	}
	dd = ej_delta_sum16(dd);
	if (p.jv && p.kl == 0)
		ej_fst<A>(a.dv, r * a.Dv + p.j, a.dt, be * dd);
	const A dm = -be * dd;
	A da = (A)0;
#pragma unroll
	for (int u = 0; u < NU; u++) {
		const long long i = p.kl + EJ_DELTA_KL * u;
		ej_delta_put(rw, a.Dk + i, i < a.Dk,
			     dS[u] * dl + al * Sp[u] * dm);
		dS[u] += kk[u] * dm;
		da += dS[u] * Sp[u];
		dS[u] *= al;
	}
	da = ej_delta_sum16(da);
	ej_delta_put(rw, 2 * a.Dk, p.kl == 0, dd * (vj - m));
	ej_delta_put(rw, 2 * a.Dk + 1, p.kl == 0, da);
	ej_delta_block_sum<A>(a, red, tile, row);
}

/* The reverse sweep of one column over the segment [t0, t1). */
template <class A, int NU>
static __device__ void ej_delta_bwd_col(const struct ej_delta_args &a,
					const ej_delta_at &p, long long tile,
					A *red, unsigned &par)
{
	const long long nck = (a.T + EJ_DELTA_CK - 1) / EJ_DELTA_CK;
	const long long W = 2 * EJ_DELTA_MAXK + 2;
	const A *kept = (const A *)a.ws;
	A *chunk = (A *)a.chunk;
	A dS[NU], s[NU], kk[NU];
#pragma unroll
	for (int u = 0; u < NU; u++) {
		const long long e = ej_delta_el(a, p, p.bh, u);
		dS[u] = e >= 0 && a.t1 < a.T ? ((const A *)a.dsin)[e] : (A)0;
	}
	for (long long c0 = (a.t1 - 1) / EJ_DELTA_CK * EJ_DELTA_CK;
	     c0 >= a.t0; c0 -= EJ_DELTA_CK) {
		const long long len =
		    a.T - c0 < EJ_DELTA_CK ? a.T - c0 : EJ_DELTA_CK;
#pragma unroll
		for (int u = 0; u < NU; u++) {
			const long long e =
			    ej_delta_el(a, p, p.bh * nck + c0 / EJ_DELTA_CK, u);
			s[u] = e >= 0 ? kept[e] : (A)0;
		}
		for (long long jt = 0; jt < len; jt++) {
			const long long r = (p.b * a.T + c0 + jt) * a.H + p.h;
#pragma unroll
			for (int u = 0; u < NU; u++) {
				const long long e = ej_delta_el(
				    a, p, p.bh * EJ_DELTA_CK + jt, u);
				if (e >= 0)
					chunk[e] = s[u];
			}
			ej_delta_keys<A, NU>(a, a.k, r, p.kl, kk);
			const A vj =
			    p.jv ? ej_fld<A>(a.v, r * a.Dv + p.j, a.dt) : (A)0;
			ej_delta_step<A, NU>(
			    s, kk, ej_delta_exp(ej_fld<A>(a.g, r, a.dt)),
			    ej_fld<A>(a.beta, r, a.dt), vj);
		}
		for (long long jt = len - 1; jt >= 0; jt--) {
			const long long t = c0 + jt;
			const long long r = (p.b * a.T + t) * a.H + p.h;
#pragma unroll
			for (int u = 0; u < NU; u++) {
				const long long e = ej_delta_el(
				    a, p, p.bh * EJ_DELTA_CK + jt, u);
				s[u] = e >= 0 ? chunk[e] : (A)0;
			}
			ej_delta_back_step<A, NU>(
			    a, p, r, s, dS, red + (par++ & 1) * 4 * W, tile,
			    (p.b * (a.t1 - a.t0) + t - a.t0) * a.H + p.h);
		}
	}
#pragma unroll
	for (int u = 0; u < NU; u++) {
		const long long e = ej_delta_el(a, p, p.bh, u);
		if (e >= 0)
			((A *)a.dsout)[e] = dS[u];
	}
}

template <class A, int NU>
static __device__ void ej_delta_bwd_all(const struct ej_delta_args &a, A *red)
{
	const long long nt = (a.Dv + EJ_DELTA_COLS - 1) / EJ_DELTA_COLS;
	unsigned par = 0;
	for (long long it = blockIdx.x; it < a.B * a.H * nt; it += gridDim.x)
		ej_delta_bwd_col<A, NU>(a, ej_delta_place(a, it), it % nt, red,
					par);
}

/* at least 4 blocks an SM in f32 (2 in f64): without the hint, ptxas
 * (NVRTC 13, sm_90) squeezed the f32 Dk <= 64 kernel into 64 registers
 * and spilled */
extern "C" __global__ void
    __launch_bounds__(EJ_DELTA_THREADS, EJ_DELTA_F64 ? 2 : 4)
	ej_delta_bwd_seg(const struct ej_delta_args a)
{
	/* the block sums' buffers: by step parity, 4 warps */
	__shared__ ej_delta_t red[2 * (EJ_DELTA_THREADS / 32) *
				  (2 * EJ_DELTA_MAXK + 2)];
	ej_delta_bwd_all<ej_delta_t, EJ_DELTA_NU>(a, red);
}

/* dq, dk, dbeta, dg of the segment's rows from the tiles' partials. */
template <class A>
static __device__ void ej_delta_sum(const struct ej_delta_args &a)
{
	const long long nt = (a.Dv + EJ_DELTA_COLS - 1) / EJ_DELTA_COLS;
	const long long nw = 2 * a.Dk + 2, L = a.t1 - a.t0;
	const long long rows = a.B * L * a.H;
	const A *part = (const A *)a.part;
	for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x;
	     x < rows * nw; x += (long long)gridDim.x * blockDim.x) {
		const long long row = x / nw, e = x % nw;
		A s = (A)0;
		for (long long tl = 0; tl < nt; tl++)
			s += part[(tl * rows + row) * nw + e];
		const long long b = row / (L * a.H), rest = row % (L * a.H);
		const long long r = (b * a.T + a.t0) * a.H + rest;
		if (e < a.Dk)
			ej_fst<A>(a.o, r * a.Dk + e, a.dt, s);
		else if (e < 2 * a.Dk)
			ej_fst<A>(a.dk, r * a.Dk + e - a.Dk, a.dt, s);
		else if (e == 2 * a.Dk)
			ej_fst<A>(a.dbeta, r, a.dt, s);
		else
			ej_fst<A>(a.dg, r, a.dt,
				  s * ej_delta_exp(ej_fld<A>(a.g, r, a.dt)));
	}
}

extern "C" __global__ void ej_delta_bwd_sum(const struct ej_delta_args a)
{
	ej_delta_sum<ej_delta_t>(a);
}
