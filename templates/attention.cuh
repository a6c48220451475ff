/* attention.cuh -- causal grouped-query attention, flash-style: the SDPA and
 * SDPA_BACKWARD ops (lib/ops_attention.c) on the CUDA devices, with no
 * T x S tensor in memory.
 *
 * Layouts (element strides in the args, so any strided input works):
 *   q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv]; query head h reads
 *   kv head h / (Hq / Hkv).  Outputs are contiguous: out [B, Hq, T, Dv] in
 *   the inputs' dtype, lse [B, Hq, T] in the compute type; dq, dk, dv shaped
 *   like q, k, v.  Causal masks key j of query i when j > i + coff (coff
 *   = S - T: bottom-right aligned; 0: top-left); a query that sees no key
 *   gets out 0, lse -inf, dq 0, as the CPU op gives.  With document ids
 *   seg [B, S] (T == S; i64 or i32, any strides) key j is also hidden from
 *   query i when seg[b, j] != seg[b, i]: packed documents do not see each
 *   other.  A mask (any strides, 0 on broadcast dims) is added to the
 *   scaled scores (f32, bf16, f64) or hides the keys where it is 0 (i32);
 *   with a mask a query that sees no key gets lse 0, as the CPU op.
 *
 * Types: EJ_ATTN_DT 0 = f32, 1 = bf16 (storage; math in f32), 2 = f64 (math
 * in f64).  EJ_ATTN_DL = ceil(max(D, Dv) / 32): head dims up to 32 * DL are
 * held in registers, DL per lane (the host picks it; at most 8, so D and Dv
 * up to 256).  All kernels use blocks of EJ_AT_NT = 128 threads (4 warps)
 * and the launch's dynamic shared memory (sizes below, in compute-type
 * elements; the host computes them).  Every output element is written by
 * exactly one thread, and every sum runs in a fixed order: no atomics, so
 * results are bit for bit the same for any block schedule.
 *
 * ej_attn_fwd     grid (B * Hq, ceil(T / 16)).  A block owns 16 queries of
 *                 one (b, h), 4 rows per warp.  Shared: qs [16][D] (q *
 *                 scale), ks [bk][D + 1], vs [bk][Dv], ps [16][bk].  The
 *                 block loops over key tiles of bk <= 32 keys (up to the
 *                 last key its last row sees), staged in shared memory;
 *                 lane j scores key j of the tile, the warp takes max and
 *                 sum by shuffles, and the online softmax keeps per row the
 *                 running max m and sum l (compute type) and rescales the
 *                 accumulator out[Dv] (lane owns dims lane + 32 c) by
 *                 exp(m_old - m_new) before adding the tile's p V.  At the
 *                 end out = acc / l, lse = m + log l.
 * ej_attn_bwd_dq  grid (B * Hq, ceil(T / 16)), rows as in the forward.
 *                 Shared: qs [16][D], gos [16][Dv], ks [bk][D + 1],
 *                 vs [bk][Dv + 1], dss [16][bk].  Per row Di =
 *                 rowsum(dO * O), written to di [B, Hq, T] for the next
 *                 kernel; per key tile P = exp(q k^T scale - lse), dP = dO
 *                 V^T, dS = P (dP - Di), and dq += dS K; dq = scale dq.
 * ej_attn_bwd_dkdv grid (B * Hkv, ceil(S / 16)).  A block owns 16 keys of
 *                 one kv head (4 per warp, lane owns dims lane + 32 c) and
 *                 loops over the query heads of the kv group and, for each,
 *                 over tiles of bq queries (from the first query that sees
 *                 the tile's first key under the causal mask).  Shared:
 *                 ks [16][D + 1], vs [16][Dv + 1], qs [bq][D], gos [bq][Dv],
 *                 lses [bq], dis [bq], ps [bq][17], dss [bq][17].  Each
 *                 thread recomputes some P and dS elements of the tile;
 *                 then dV += P^T dO and dK += dS^T (q scale) accumulate in
 *                 registers.  Reads di of ej_attn_bwd_dq.
 *
 * Tensor cores (the bf16 module; the host runs every bf16 call here):
 * ej_attn_fwd_tc  grid (B * Hq, ceil(T / 64)), the query blocks in reverse
 *                 (blockIdx.y 0 owns the last 64 queries: under the causal
 *                 mask the blocks with the most keys start first and the
 *                 light ones fill in behind them).  A block owns 64 queries
 *                 of one (b, h), 16 rows per warp; key tiles of EJ_TC_BK =
 *                 64 keys (32 past head dim 128).  Shared (bf16, as
 *                 stored): qs [64][ld(D)], ks [BK][ld(D)], vs [BK][ld(Dv)],
 *                 ld(n) = n rounded up to 16 plus 8 (rows 16 bytes apart
 *                 in the banks for ldmatrix), zero past D, Dv and the
 *                 last row (16-byte loads where a row is contiguous and
 *                 aligned).  Per tile and warp: S = Q K^T on mma.sync
 *                 m16n8k16 (bf16 in, f32 accumulate; fragments by
 *                 ldmatrix .x4), masked (causal, documents) and scaled in
 *                 f32; the online softmax keeps m and l of the lane's two
 *                 rows in registers (max and sum over the 4 lanes of a row
 *                 by shuffles; l adds p in f32); P, rounded to bf16, is
 *                 the A operand of O += P V (V by ldmatrix .trans), O in
 *                 f32 registers, 4 ceil(Dv / 16) n-tiles of 8 dims
 *                 (compile-time bound 4 DL).  out = O / l, lse = m + log l;
 *                 a row that sees no key: out 0, lse -inf.
 * ej_attn_bwd_dq_tc grid and rows as ej_attn_fwd_tc.  Shared: qs, gos
 *                 [64][ld], ks, vs [BK][ld].  Di = rowsum(dO * O) per row
 *                 (to di); per key tile S = Q K^T and dP = dO V^T on mma,
 *                 dS = exp(S scale - lse) (dP - Di) in f32, dq += dS K on
 *                 mma (dS rounded to bf16); dq = scale dq.
 * ej_attn_bwd_dkdv_tc grid (B * Hq, ceil(S / 64)): a block owns 64 keys
 *                 (16 per warp) and ONE query head, so the grid has Hq / Hkv
 *                 times the blocks of one per kv head (Qwen3's B 1, Hq 32,
 *                 S 1024: 512 blocks; DeepSeek's Hq 128: 2048), and loops
 *                 over tiles of BK queries from the first query that sees
 *                 its first key (key block 0, the heaviest under the causal
 *                 mask, is launched first).  Shared: ks, vs [64][ld], qs,
 *                 gos [BK][ld], lses, dis [BK] (f32).  Past head dim 128
 *                 two launches, one accumulator each (a.part): dv += P^T
 *                 dO, then dk += dS^T q scale, with S^T = K Q^T and dP^T
 *                 = V dO^T on mma: the dk pass recomputes S^T, which keeps
 *                 the registers of one accumulator (head dim 256 fits
 *                 without spills).
 * ej_attn_bwd_dkdv1_tc the same blocks, head dims up to 128 only: dv and dk
 *                 in one pass, both accumulators (dV's product before dP^T
 *                 is computed, so that dP^T's registers are not live
 *                 across it: no spill at 128, the ptxas suite).
 *                 With Hq == Hkv the passes write grad_k and grad_v; else
 *                 f32 partials per query head to kv_part (scratch [B, Hq,
 *                 S, D + Dv]) and
 * ej_attn_bwd_kv_sum adds the heads of each kv group in head order (one
 *                 thread an element).  No atomic adds anywhere: every
 *                 output is the same bit for bit for any block schedule.
 * ej_attn_doc_spans grid (B, ceil(S / 64)), with document ids only, before
 *                 the dk/dv passes: per block of 64 keys the span of
 *                 queries whose ids fall in the keys' id range (atomic min
 *                 and max in shared memory: the same span in any order);
 *                 the passes visit only the query tiles in it.
 */

#ifndef EJ_ATTN_DT
#define EJ_ATTN_DT 0
#endif
#ifndef EJ_ATTN_DL
#define EJ_ATTN_DL 4
#endif

#if EJ_ATTN_DT == 2
typedef double ej_at_acc;
typedef double ej_at_el;
#define EJ_AT_LD(x)  (x)
#define EJ_AT_ST(x)  (x)
#define EJ_AT_EXP(x) exp(x)
#define EJ_AT_LOG(x) log(x)
#define EJ_AT_NINF   (-ej_inf_d())
#elif EJ_ATTN_DT == 1
typedef float ej_at_acc;
typedef ej_bf16 ej_at_el;
#define EJ_AT_LD(x)  ej_bf2f(x)
#define EJ_AT_ST(x)  ej_f2bf(x)
#define EJ_AT_EXP(x) expf(x)
#define EJ_AT_LOG(x) logf(x)
#define EJ_AT_NINF   (-ej_inf_f())
#else
typedef float ej_at_acc;
typedef float ej_at_el;
#define EJ_AT_LD(x)  (x)
#define EJ_AT_ST(x)  (x)
#define EJ_AT_EXP(x) expf(x)
#define EJ_AT_LOG(x) logf(x)
#define EJ_AT_NINF   (-ej_inf_f())
#endif

#define EJ_AT_NW  4			 /* warps per block */
#define EJ_AT_NT  (32 * EJ_AT_NW)	 /* threads per block */
#define EJ_AT_RPW 4			 /* query rows per warp (fwd, dq) */
#define EJ_AT_BQ  (EJ_AT_NW * EJ_AT_RPW) /* queries per block (fwd, dq) */
#define EJ_AT_KPW 4			 /* keys per warp (dkdv) */
#define EJ_AT_BKB (EJ_AT_NW * EJ_AT_KPW) /* keys per block (dkdv) */

/* Registers.  The per-thread arrays (m, l, lse, di, acc, dk, dv: rows rr,
 * keys kk, head-dim slots c) stay in registers only when every index is
 * known at compile time: each loop over them has a constant trip count, no
 * break (a bound that depends on the data is a predicate on the body) and
 * EJ_AT_UNROLL.  Left to itself ptxas keeps the row and key loops, whose
 * bodies hold loops of their own, rolled, and the arrays live in local
 * memory (96-256 byte stack frames at head dim 128).  EJ_AT_MINB blocks per
 * SM in the launch bounds give ptxas a budget of 65536 / (4 * 128) = 128
 * registers a thread, at head dim 128 about what the shared memory (up to
 * 48 KiB a block) allows anyway; without it ptxas aims lower and spills
 * (dkdv at head dim 32: 64 registers and 32 bytes of spills).  The
 * "ptxas" check suite (t/check_ptxas.c) fails on any stack frame or
 * spill. */
#define EJ_AT_MINB 4
#ifdef EJ_CUDA_SIM
#define EJ_AT_UNROLL
#else
#define EJ_AT_UNROLL _Pragma("unroll")
#endif

/* Keys visible to query i: [0, ej_at_kend(i)); 0 for rows past T. */
EJ_D int ej_at_kend(const struct ej_attn_args &a, int i)
{
	if (i >= a.t)
		return 0;
	if (!a.causal)
		return a.s;
	int e = i + 1 + a.coff;
	return e < 0 ? 0 : (e > a.s ? a.s : e);
}

/* The document id of position i of row b (i < S = T).  Only with a.seg. */
EJ_D long long ej_at_doc(const struct ej_attn_args &a, int b, int i)
{
	long long o = (long long)b * a.sgs[0] + (long long)i * a.sgs[1];
	if (a.seg8)
		return ((const long long *)a.seg)[o];
	return ((const int *)a.seg)[o];
}

/* Does query i see key j by the documents (always without seg)?  j and i
 * must be positions of the row (< S = T). */
EJ_D bool ej_at_same_doc(const struct ej_attn_args &a, int b, int i, int j)
{
	if (!a.seg)
		return true;
	return ej_at_doc(a, b, i) == ej_at_doc(a, b, j);
}

/* The mask of query i, key j of (b, h): what the scaled score adds (0
 * where an i32 mask is nonzero, -inf where it is 0).  Only with a.mask. */
EJ_D ej_at_acc ej_at_mask(const struct ej_attn_args &a, int b, int h, int i,
			  int j)
{
	long long o = (long long)b * a.mks[0] + (long long)h * a.mks[1] +
		      (long long)i * a.mks[2] + (long long)j * a.mks[3];
	if (a.mdt == 3)
		return ((const int *)a.mask)[o] ? (ej_at_acc)0 : EJ_AT_NINF;
	if (a.mdt == 2)
		return (ej_at_acc)((const double *)a.mask)[o];
	if (a.mdt == 1)
		return (ej_at_acc)ej_bf2f(((const ej_bf16 *)a.mask)[o]);
	return (ej_at_acc)((const float *)a.mask)[o];
}

/* The lse of a query that sees no key: -inf, or 0 with a mask. */
EJ_D ej_at_acc ej_at_empty_lse(const struct ej_attn_args &a)
{
	return a.mask ? (ej_at_acc)0 : EJ_AT_NINF;
}

EJ_D long long ej_at_off(const long long *st, int b, int h, int i, int c)
{
	return (long long)b * st[0] + (long long)h * st[1] +
	       (long long)i * st[2] + (long long)c * st[3];
}

EJ_D ej_at_acc ej_at_ld(const void *p, long long off)
{
	return EJ_AT_LD(((const ej_at_el *)p)[off]);
}

EJ_D ej_at_acc ej_at_wmax(ej_at_acc v)
{
	for (int o = 16; o > 0; o >>= 1) {
		ej_at_acc x = __shfl_xor_sync(0xffffffffu, v, o);
		v = x > v ? x : v;
	}
	return v;
}

EJ_D ej_at_acc ej_at_wsum(ej_at_acc v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

/* finite (neither inf nor NaN) */
EJ_D bool ej_at_finite(ej_at_acc x)
{
	return x - x == (ej_at_acc)0;
}

/* Rows [n] of a [B, H, rows, cols] operand (row r0 + r, r < n) into
 * sh[n][ld], times mul; rows past `rows` are 0. */
EJ_D void ej_at_stage(ej_at_acc *sh, int ld, const void *p, const long long *st,
		      int b, int h, int r0, int n, int rows, int cols,
		      ej_at_acc mul)
{
	for (int e = threadIdx.x; e < n * cols; e += EJ_AT_NT) {
		int r = e / cols, c = e - r * cols;
		ej_at_acc x = 0;
		if (r0 + r < rows)
			x = mul * ej_at_ld(p, ej_at_off(st, b, h, r0 + r, c));
		sh[r * ld + c] = x;
	}
}

extern "C" __global__ void __launch_bounds__(EJ_AT_NT, EJ_AT_MINB)
    ej_attn_fwd(const struct ej_attn_args a)
{
	const int D = a.d, DV = a.dv, BK = a.bk;
	const int bh = blockIdx.x, b = bh / a.hq, h = bh % a.hq;
	const int g = h / (a.hq / a.hkv);
	const int i0 = blockIdx.y * EJ_AT_BQ;
	const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
	ej_at_acc *qs = (ej_at_acc *)ej_dyn_smem();
	ej_at_acc *ks = qs + EJ_AT_BQ * D;
	ej_at_acc *vs = ks + BK * (D + 1);
	ej_at_acc *ps = vs + BK * DV;
	const ej_at_acc ninf = EJ_AT_NINF;

	ej_at_stage(qs, D, a.q, a.qs, b, h, i0, EJ_AT_BQ, a.t, D,
		    (ej_at_acc)a.scale);
	ej_at_acc m[EJ_AT_RPW], l[EJ_AT_RPW], acc[EJ_AT_RPW][EJ_ATTN_DL];
	EJ_AT_UNROLL
	for (int rr = 0; rr < EJ_AT_RPW; rr++) {
		m[rr] = ninf;
		l[rr] = 0;
		EJ_AT_UNROLL
		for (int c = 0; c < EJ_ATTN_DL; c++)
			acc[rr][c] = 0;
	}
	int ilast = i0 + EJ_AT_BQ < a.t ? i0 + EJ_AT_BQ - 1 : a.t - 1;
	int kmax = ej_at_kend(a, ilast); /* keys any row of the block sees */
	for (int k0 = 0; k0 < kmax; k0 += BK) {
		__syncthreads(); /* the previous tile is consumed */
		ej_at_stage(ks, D + 1, a.k, a.ks, b, g, k0, BK, a.s, D, 1);
		ej_at_stage(vs, DV, a.v, a.vs, b, g, k0, BK, a.s, DV, 1);
		__syncthreads();
		EJ_AT_UNROLL
		for (int rr = 0; rr < EJ_AT_RPW; rr++) {
			int r = w * EJ_AT_RPW + rr;
			int ke = ej_at_kend(a, i0 + r) - k0; /* in the tile */
			bool vis = lane < BK && lane < ke &&
				   ej_at_same_doc(a, b, i0 + r, k0 + lane);
			ej_at_acc sc = ninf;
			if (vis) {
				const ej_at_acc *qr = qs + r * D;
				const ej_at_acc *kr = ks + lane * (D + 1);
				ej_at_acc dot = 0;
				for (int c = 0; c < D; c++)
					dot += qr[c] * kr[c];
				sc = dot;
				if (a.mask)
					sc += ej_at_mask(a, b, h, i0 + r,
							 k0 + lane);
			}
			ej_at_acc mn = ej_at_wmax(sc);
			mn = m[rr] > mn ? m[rr] : mn;
			ej_at_acc p = 0, alpha = 1;
			if (mn != ninf) {
				p = vis ? EJ_AT_EXP(sc - mn) : (ej_at_acc)0;
				alpha = EJ_AT_EXP(m[rr] - mn);
			}
			ej_at_acc psum = ej_at_wsum(p);
			l[rr] = l[rr] * alpha + psum;
			m[rr] = mn;
			if (lane < BK)
				ps[r * BK + lane] = p;
			__syncwarp();
			int nk = ke < BK ? ke : BK;
			const ej_at_acc *pr = ps + r * BK;
			EJ_AT_UNROLL
			for (int c = 0; c < EJ_ATTN_DL; c++) {
				int d = lane + 32 * c;
				if (d < DV) {
					ej_at_acc x = acc[rr][c] * alpha;
					for (int j = 0; j < nk; j++)
						x += pr[j] * vs[j * DV + d];
					acc[rr][c] = x;
				}
			}
		}
	}
	EJ_AT_UNROLL
	for (int rr = 0; rr < EJ_AT_RPW; rr++) {
		int i = i0 + w * EJ_AT_RPW + rr;
		if (i >= a.t)
			continue; /* no break: see EJ_AT_UNROLL */
		long long row = (long long)bh * a.t + i;
		bool any = l[rr] > 0;
		ej_at_acc inv = any ? (ej_at_acc)1 / l[rr] : (ej_at_acc)0;
		EJ_AT_UNROLL
		for (int c = 0; c < EJ_ATTN_DL; c++) {
			int d = lane + 32 * c;
			if (d < DV)
				((ej_at_el *)a.out)[row * DV + d] =
				    EJ_AT_ST(acc[rr][c] * inv);
		}
		if (lane == 0)
			((ej_at_acc *)a.lse)[row] =
			    any ? m[rr] + EJ_AT_LOG(l[rr])
				: ej_at_empty_lse(a);
	}
}

extern "C" __global__ void __launch_bounds__(EJ_AT_NT, EJ_AT_MINB)
    ej_attn_bwd_dq(const struct ej_attn_args a)
{
	const int D = a.d, DV = a.dv, BK = a.bk;
	const int bh = blockIdx.x, b = bh / a.hq, h = bh % a.hq;
	const int g = h / (a.hq / a.hkv);
	const int i0 = blockIdx.y * EJ_AT_BQ;
	const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
	ej_at_acc *qs = (ej_at_acc *)ej_dyn_smem();
	ej_at_acc *gos = qs + EJ_AT_BQ * D;
	ej_at_acc *ks = gos + EJ_AT_BQ * DV;
	ej_at_acc *vs = ks + BK * (D + 1);
	ej_at_acc *dss = vs + BK * (DV + 1);

	ej_at_stage(qs, D, a.q, a.qs, b, h, i0, EJ_AT_BQ, a.t, D,
		    (ej_at_acc)a.scale);
	ej_at_stage(gos, DV, a.go, a.gs, b, h, i0, EJ_AT_BQ, a.t, DV, 1);
	__syncthreads();
	/* per row: lse, Di = rowsum(dO * O) (written for ej_attn_bwd_dkdv) */
	ej_at_acc lse[EJ_AT_RPW], di[EJ_AT_RPW], acc[EJ_AT_RPW][EJ_ATTN_DL];
	EJ_AT_UNROLL
	for (int rr = 0; rr < EJ_AT_RPW; rr++) {
		int r = w * EJ_AT_RPW + rr, i = i0 + r;
		ej_at_acc part = 0;
		lse[rr] = EJ_AT_NINF;
		if (i < a.t) {
			for (int d = lane; d < DV; d += 32)
				part +=
				    gos[r * DV + d] *
				    ej_at_ld(a.o, ej_at_off(a.os, b, h, i, d));
			lse[rr] = ((const ej_at_acc *)
				       a.lse_in)[(long long)b * a.ls[0] +
						 (long long)h * a.ls[1] +
						 (long long)i * a.ls[2]];
		}
		di[rr] = ej_at_wsum(part);
		if (i < a.t && lane == 0)
			((ej_at_acc *)a.di)[(long long)bh * a.t + i] = di[rr];
		EJ_AT_UNROLL
		for (int c = 0; c < EJ_ATTN_DL; c++)
			acc[rr][c] = 0;
	}
	int ilast = i0 + EJ_AT_BQ < a.t ? i0 + EJ_AT_BQ - 1 : a.t - 1;
	int kmax = ej_at_kend(a, ilast);
	for (int k0 = 0; k0 < kmax; k0 += BK) {
		__syncthreads();
		ej_at_stage(ks, D + 1, a.k, a.ks, b, g, k0, BK, a.s, D, 1);
		ej_at_stage(vs, DV + 1, a.v, a.vs, b, g, k0, BK, a.s, DV, 1);
		__syncthreads();
		EJ_AT_UNROLL
		for (int rr = 0; rr < EJ_AT_RPW; rr++) {
			int r = w * EJ_AT_RPW + rr;
			int ke = ej_at_kend(a, i0 + r) - k0;
			ej_at_acc ds = 0;
			if (lane < BK && lane < ke && ej_at_finite(lse[rr]) &&
			    ej_at_same_doc(a, b, i0 + r, k0 + lane)) {
				const ej_at_acc *qr = qs + r * D;
				const ej_at_acc *kr = ks + lane * (D + 1);
				const ej_at_acc *gr = gos + r * DV;
				const ej_at_acc *vr = vs + lane * (DV + 1);
				ej_at_acc s = 0, dp = 0;
				for (int c = 0; c < D; c++)
					s += qr[c] * kr[c];
				for (int c = 0; c < DV; c++)
					dp += gr[c] * vr[c];
				if (a.mask)
					s += ej_at_mask(a, b, h, i0 + r,
							k0 + lane);
				ds = EJ_AT_EXP(s - lse[rr]) * (dp - di[rr]);
			}
			if (lane < BK)
				dss[r * BK + lane] = ds;
			__syncwarp();
			int nk = ke < BK ? ke : BK;
			const ej_at_acc *dr = dss + r * BK;
			EJ_AT_UNROLL
			for (int c = 0; c < EJ_ATTN_DL; c++) {
				int d = lane + 32 * c;
				if (d < D) {
					ej_at_acc x = acc[rr][c];
					for (int j = 0; j < nk; j++)
						x +=
						    dr[j] * ks[j * (D + 1) + d];
					acc[rr][c] = x;
				}
			}
		}
	}
	EJ_AT_UNROLL
	for (int rr = 0; rr < EJ_AT_RPW; rr++) {
		int i = i0 + w * EJ_AT_RPW + rr;
		if (i >= a.t)
			continue; /* no break: see EJ_AT_UNROLL */
		long long row = (long long)bh * a.t + i;
		EJ_AT_UNROLL
		for (int c = 0; c < EJ_ATTN_DL; c++) {
			int d = lane + 32 * c;
			if (d < D)
				((ej_at_el *)a.grad_q)[row * D + d] =
				    EJ_AT_ST((ej_at_acc)a.scale * acc[rr][c]);
		}
	}
}

extern "C" __global__ void __launch_bounds__(EJ_AT_NT, EJ_AT_MINB)
    ej_attn_bwd_dkdv(const struct ej_attn_args a)
{
	const int D = a.d, DV = a.dv, BQ = a.bq, BK = EJ_AT_BKB;
	const int bg = blockIdx.x, b = bg / a.hkv, g = bg % a.hkv;
	const int rep = a.hq / a.hkv;
	const int j0 = blockIdx.y * BK;
	const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
	ej_at_acc *ks = (ej_at_acc *)ej_dyn_smem();
	ej_at_acc *vs = ks + BK * (D + 1);
	ej_at_acc *qs = vs + BK * (DV + 1);
	ej_at_acc *gos = qs + BQ * D;
	ej_at_acc *lses = gos + BQ * DV;
	ej_at_acc *dis = lses + BQ;
	ej_at_acc *ps = dis + BQ;
	ej_at_acc *dss = ps + BQ * (BK + 1);

	ej_at_stage(ks, D + 1, a.k, a.ks, b, g, j0, BK, a.s, D, 1);
	ej_at_stage(vs, DV + 1, a.v, a.vs, b, g, j0, BK, a.s, DV, 1);
	ej_at_acc dk[EJ_AT_KPW][EJ_ATTN_DL], dv[EJ_AT_KPW][EJ_ATTN_DL];
	EJ_AT_UNROLL
	for (int kk = 0; kk < EJ_AT_KPW; kk++) {
		EJ_AT_UNROLL
		for (int c = 0; c < EJ_ATTN_DL; c++)
			dk[kk][c] = dv[kk][c] = 0;
	}
	/* the first query that sees key j0 */
	int imin = a.causal ? j0 - a.coff : 0;
	if (imin < 0)
		imin = 0;
	for (int hh = 0; hh < rep; hh++) {
		int h = g * rep + hh;
		for (int q0 = imin; q0 < a.t; q0 += BQ) {
			__syncthreads(); /* the previous tile is consumed */
			ej_at_stage(qs, D, a.q, a.qs, b, h, q0, BQ, a.t, D,
				    (ej_at_acc)a.scale);
			ej_at_stage(gos, DV, a.go, a.gs, b, h, q0, BQ, a.t, DV,
				    1);
			for (int r = threadIdx.x; r < BQ; r += EJ_AT_NT) {
				int i = q0 + r;
				ej_at_acc ls = EJ_AT_NINF, d0 = 0;
				if (i < a.t) {
					ls = ((const ej_at_acc *)a.lse_in)
					    [(long long)b * a.ls[0] +
					     (long long)h * a.ls[1] +
					     (long long)i * a.ls[2]];
					d0 = ((const ej_at_acc *)a.di)
					    [((long long)b * a.hq + h) * a.t +
					     i];
				}
				lses[r] = ls;
				dis[r] = d0;
			}
			__syncthreads();
			for (int e = threadIdx.x; e < BQ * BK; e += EJ_AT_NT) {
				int r = e / BK, jj = e - r * BK;
				ej_at_acc p = 0, ds = 0;
				if (j0 + jj < ej_at_kend(a, q0 + r) &&
				    ej_at_finite(lses[r]) &&
				    ej_at_same_doc(a, b, q0 + r, j0 + jj)) {
					const ej_at_acc *qr = qs + r * D;
					const ej_at_acc *kr = ks + jj * (D + 1);
					const ej_at_acc *gr = gos + r * DV;
					const ej_at_acc *vr =
					    vs + jj * (DV + 1);
					ej_at_acc s = 0, dp = 0;
					for (int c = 0; c < D; c++)
						s += qr[c] * kr[c];
					for (int c = 0; c < DV; c++)
						dp += gr[c] * vr[c];
					if (a.mask)
						s += ej_at_mask(a, b, h, q0 + r,
								j0 + jj);
					p = EJ_AT_EXP(s - lses[r]);
					ds = p * (dp - dis[r]);
				}
				ps[r * (BK + 1) + jj] = p;
				dss[r * (BK + 1) + jj] = ds;
			}
			__syncthreads();
			int nr = a.t - q0 < BQ ? a.t - q0 : BQ;
			EJ_AT_UNROLL
			for (int kk = 0; kk < EJ_AT_KPW; kk++) {
				int jj = w * EJ_AT_KPW + kk;
				EJ_AT_UNROLL
				for (int c = 0; c < EJ_ATTN_DL; c++) {
					int d = lane + 32 * c;
					ej_at_acc xv = dv[kk][c],
						  xk = dk[kk][c];
					for (int r = 0; r < nr; r++) {
						ej_at_acc pr =
						    ps[r * (BK + 1) + jj];
						ej_at_acc sr =
						    dss[r * (BK + 1) + jj];
						if (d < DV)
							xv += pr *
							      gos[r * DV + d];
						if (d < D)
							xk +=
							    sr * qs[r * D + d];
					}
					dv[kk][c] = xv;
					dk[kk][c] = xk;
				}
			}
		}
	}
	EJ_AT_UNROLL
	for (int kk = 0; kk < EJ_AT_KPW; kk++) {
		int j = j0 + w * EJ_AT_KPW + kk;
		if (j >= a.s)
			continue; /* no break: see EJ_AT_UNROLL */
		long long row = (long long)bg * a.s + j;
		EJ_AT_UNROLL
		for (int c = 0; c < EJ_ATTN_DL; c++) {
			int d = lane + 32 * c;
			if (d < D)
				((ej_at_el *)a.grad_k)[row * D + d] =
				    EJ_AT_ST(dk[kk][c]);
			if (d < DV)
				((ej_at_el *)a.grad_v)[row * DV + d] =
				    EJ_AT_ST(dv[kk][c]);
		}
	}
}

/* ---- tensor cores (bf16) --------------------------------------------------
 * ej_attn_fwd_tc: the forward on mma.sync m16n8k16 (bf16 in, f32
 * accumulate); the bf16 module only.  See the header. */
#if EJ_ATTN_DT == 1
#define EJ_TC_BQ   64 /* queries per block: 16 per warp */
#define EJ_TC_BK   (EJ_ATTN_DL <= 4 ? 64 : 32) /* keys per tile */
#define EJ_TC_NS   (EJ_TC_BK / 8)	       /* score n-tiles of 8 keys */
#define EJ_TC_KD   (2 * EJ_ATTN_DL) /* k-steps of 16 over D, at most */
#define EJ_TC_NO   (4 * EJ_ATTN_DL) /* n-tiles of 8 over Dv, at most */
#define EJ_TC_MINB 2

/* Row stride (elements) of a [rows][n] bf16 tile in shared memory: n
 * rounded up to 16, plus 8 (16 bytes), so that the 8 rows an ldmatrix reads
 * fall in different banks. */
EJ_D int ej_tc_ld(int n)
{
	return (n + 15) / 16 * 16 + 8;
}

/* Rows [n] of a bf16 [B, H, rows, cols] operand (row r0 + r) into sh[n][ld]
 * as they are, 8 elements per step: one 16-byte load where the 8 are
 * contiguous and aligned, else one at a time; past `rows` or `cols` (up to
 * the next multiple of 16) zeros. */
EJ_D void ej_tc_stage(ej_bf16 *sh, int ld, const void *p, const long long *st,
		      int b, int h, int r0, int n, int rows, int cols)
{
	const ej_bf16 *src = (const ej_bf16 *)p;
	int nc = (cols + 15) / 16 * 2; /* chunks of 8 per row */
	for (int e = threadIdx.x; e < n * nc; e += EJ_AT_NT) {
		int r = e / nc, c = (e - r * nc) * 8;
		ej_bf16 *dst = sh + r * ld + c;
		if (r0 + r >= rows || c >= cols) {
			*(uint4 *)dst = make_uint4(0, 0, 0, 0);
			continue;
		}
		const ej_bf16 *s = src + ej_at_off(st, b, h, r0 + r, c);
		if (st[3] == 1 && c + 8 <= cols && ((size_t)s & 15) == 0) {
			*(uint4 *)dst = *(const uint4 *)s;
			continue;
		}
		for (int u = 0; u < 8; u++) {
			ej_bf16 x;
			x.x = 0;
			if (c + u < cols)
				x = s[(long long)u * st[3]];
			dst[u] = x;
		}
	}
}

/* S (16 rows of the warp x EJ_TC_BK keys) = Q K^T over nkd k-steps. */
EJ_D void ej_tc_qk(float (*s)[4], const ej_bf16 *qw, const ej_bf16 *ks, int ld,
		   int nkd, int lane)
{
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NS; nt++)
		s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0;
	/* ldmatrix rows: A matrix j = lane / 8 is rows 8 (j & 1), columns
	 * 8 (j >> 1); B matrices are keys 8 (j >> 1), dims 8 (j & 1) */
	const int ra = (lane & 7) + 8 * ((lane >> 3) & 1), ca = 8 * (lane >> 4);
	const int rb = (lane & 7) + 8 * (lane >> 4), cb = 8 * ((lane >> 3) & 1);
	EJ_AT_UNROLL
	for (int kd = 0; kd < EJ_TC_KD; kd++) {
		if (kd >= nkd)
			continue; /* warp-uniform; no break: see EJ_AT_UNROLL */
		unsigned qa[4];
		ej_ldmatrix_x4(qa, qw + ra * ld + kd * 16 + ca);
		EJ_AT_UNROLL
		for (int np = 0; np < EJ_TC_NS / 2; np++) {
			unsigned kb[4];
			ej_ldmatrix_x4(kb,
				       ks + (np * 16 + rb) * ld + kd * 16 + cb);
			ej_mma_bf16_16816(s[2 * np], qa, kb, s[2 * np]);
			ej_mma_bf16_16816(s[2 * np + 1], qa, kb + 2,
					  s[2 * np + 1]);
		}
	}
}

/* o (16 rows x 8 EJ_TC_NO dims) += P V: p in the accumulator layout of S
 * (rounded to bf16 here), V tile vs [EJ_TC_BK][ldv], nvo n-tiles used. */
EJ_D void ej_tc_pv(float (*o)[4], float (*p)[4], const ej_bf16 *vs, int ldv,
		   int nvo, int lane)
{
	/* V matrices (ldmatrix .trans): keys 8 (j & 1), dims 8 (j >> 1) */
	const int rv = (lane & 7) + 8 * ((lane >> 3) & 1), cv = 8 * (lane >> 4);
	EJ_AT_UNROLL
	for (int kk = 0; kk < EJ_TC_NS / 2; kk++) {
		unsigned pa[4];
		pa[0] = ej_pack_bf16(p[2 * kk][0], p[2 * kk][1]);
		pa[1] = ej_pack_bf16(p[2 * kk][2], p[2 * kk][3]);
		pa[2] = ej_pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
		pa[3] = ej_pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
		EJ_AT_UNROLL
		for (int np = 0; np < EJ_TC_NO / 2; np++) {
			if (2 * np >= nvo)
				continue; /* warp-uniform */
			unsigned vb[4];
			ej_ldmatrix_x4_trans(vb, vs + (kk * 16 + rv) * ldv +
						     np * 16 + cv);
			ej_mma_bf16_16816(o[2 * np], pa, vb, o[2 * np]);
			ej_mma_bf16_16816(o[2 * np + 1], pa, vb + 2,
					  o[2 * np + 1]);
		}
	}
}

/* p[d] = x0 and p[d + 1] = x1 (if d + 1 < n) in bf16: one 4-byte store
 * where both are written and the address is aligned. */
EJ_D void ej_tc_st2(ej_bf16 *p, int d, int n, float x0, float x1)
{
	if (d + 1 < n && ((size_t)(p + d) & 3) == 0) {
		*(unsigned *)(p + d) = ej_pack_bf16(x0, x1);
		return;
	}
	if (d < n)
		p[d] = ej_f2bf(x0);
	if (d + 1 < n)
		p[d + 1] = ej_f2bf(x1);
}

/* max (sum) over the 4 lanes of a quad: the lanes that hold one row */
EJ_D float ej_tc_qmax(float v)
{
	for (int o = 1; o < 4; o <<= 1) {
		float x = __shfl_xor_sync(0xffffffffu, v, o);
		v = x > v ? x : v;
	}
	return v;
}

EJ_D float ej_tc_qsum(float v)
{
	for (int o = 1; o < 4; o <<= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

/* The document ids of positions [p0, p0 + n) of row b (n >= 1, every
 * position < S) span [r[0], r[1]]: each lane reads every 32nd id and the
 * warp reduces them, so every warp of the block gets the same range (a
 * block-uniform skip needs no shared memory).  Only with a.seg. */
EJ_D void ej_tc_doc_range(const struct ej_attn_args &a, int b, int p0, int n,
			  int lane, long long *r)
{
	long long lo = ej_at_doc(a, b, p0), hi = lo;
	for (int k = lane; k < n; k += 32) {
		long long id = ej_at_doc(a, b, p0 + k);
		lo = id < lo ? id : lo;
		hi = id > hi ? id : hi;
	}
	for (int o = 1; o < 32; o <<= 1) {
		long long x = __shfl_xor_sync(0xffffffffu, lo, o);
		long long y = __shfl_xor_sync(0xffffffffu, hi, o);
		lo = x < lo ? x : lo;
		hi = y > hi ? y : hi;
	}
	r[0] = lo;
	r[1] = hi;
}

/* Does a key tile of positions [p0, p0 + n) (n clipped at len) hold no
 * document of the range qr, so that no query of qr's block sees any of
 * its keys?  Packed documents, whose ids grow along the row, skip every
 * tile outside the block's documents; any ids are safe (disjoint ranges
 * share no id).  False without a.seg. */
EJ_D bool ej_tc_docs_apart(const struct ej_attn_args &a, int b, int p0,
			   int n, int len, const long long *qr, int lane)
{
	if (!a.seg)
		return false;
	long long kr[2];
	ej_tc_doc_range(a, b, p0, p0 + n < len ? n : len - p0, lane, kr);
	return kr[1] < qr[0] || qr[1] < kr[0];
}

/* Online softmax of one key tile: s (scores of rows i and i + 8 of this
 * lane, keys k0 + 8 nt + 2 (lane % 4) + {0, 1}) is masked and scaled, m and
 * l are updated, o is rescaled and s becomes P. */
EJ_D void ej_tc_softmax(const struct ej_attn_args &a, float (*s)[4],
			float (*o)[4], float *m, float *l, int b, int h, int i,
			int k0, const int *ke, int lane)
{
	const float ninf = -ej_inf_f(), scale = (float)a.scale;
	float mx[2] = { ninf, ninf };
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NS; nt++)
		EJ_AT_UNROLL
	for (int e = 0; e < 4; e++) {
		int rw = e >> 1, j = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
		bool vis = j < ke[rw] &&
			   (!a.seg || ej_at_same_doc(a, b, i + 8 * rw, j));
		float x = vis ? s[nt][e] * scale : ninf;
		if (vis && a.mask)
			x += ej_at_mask(a, b, h, i + 8 * rw, j);
		s[nt][e] = x;
		mx[rw] = x > mx[rw] ? x : mx[rw];
	}
	float alpha[2], sum[2] = { 0, 0 };
	EJ_AT_UNROLL
	for (int rw = 0; rw < 2; rw++) {
		float mn = ej_tc_qmax(mx[rw]);
		mn = m[rw] > mn ? m[rw] : mn;
		alpha[rw] = mn == ninf ? 1.0f : expf(m[rw] - mn);
		m[rw] = mn;
	}
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NS; nt++)
		EJ_AT_UNROLL
	for (int e = 0; e < 4; e++) {
		int rw = e >> 1;
		float x = s[nt][e];
		/* l sums p in f32 (lse as exact as the f32 kernel's); the
		 * P V product rounds p to bf16 */
		float p = x == ninf ? 0.0f : expf(x - m[rw]);
		s[nt][e] = p;
		sum[rw] += p;
	}
	EJ_AT_UNROLL
	for (int rw = 0; rw < 2; rw++)
		l[rw] = l[rw] * alpha[rw] + ej_tc_qsum(sum[rw]);
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NO; nt++)
		EJ_AT_UNROLL
	for (int e = 0; e < 4; e++)
		o[nt][e] *= alpha[e >> 1];
}

extern "C" __global__ void __launch_bounds__(EJ_AT_NT, EJ_TC_MINB)
    ej_attn_fwd_tc(const struct ej_attn_args a)
{
	const int D = a.d, DV = a.dv, ldq = ej_tc_ld(D), ldv = ej_tc_ld(DV);
	const int nkd = (D + 15) / 16, nvo = (DV + 15) / 16 * 2;
	const int bh = blockIdx.x, b = bh / a.hq, h = bh % a.hq;
	const int g = h / (a.hq / a.hkv);
	/* the last query blocks (the most keys under the causal mask) first */
	const int i0 = (int)(gridDim.y - 1 - blockIdx.y) * EJ_TC_BQ;
	const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
	ej_bf16 *qs = (ej_bf16 *)ej_dyn_smem();
	ej_bf16 *ks = qs + EJ_TC_BQ * ldq;
	ej_bf16 *vs = ks + EJ_TC_BK * ldq;
	const int i = i0 + 16 * w + (lane >> 2); /* rows i and i + 8 */
	const int ke[2] = { ej_at_kend(a, i), ej_at_kend(a, i + 8) };

	ej_tc_stage(qs, ldq, a.q, a.qs, b, h, i0, EJ_TC_BQ, a.t, D);
	float m[2] = { -ej_inf_f(), -ej_inf_f() }, l[2] = { 0, 0 };
	float o[EJ_TC_NO][4], s[EJ_TC_NS][4];
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NO; nt++)
		o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0;
	int ilast = i0 + EJ_TC_BQ < a.t ? i0 + EJ_TC_BQ - 1 : a.t - 1;
	int kmax = ej_at_kend(a, ilast); /* keys any row of the block sees */
	long long qr[2]; /* the block's documents (with a.seg) */
	if (a.seg)
		ej_tc_doc_range(a, b, i0, ilast - i0 + 1, lane, qr);
	for (int k0 = 0; k0 < kmax; k0 += EJ_TC_BK) {
		/* a tile of other documents adds nothing: skipped (uniform) */
		if (ej_tc_docs_apart(a, b, k0, EJ_TC_BK, a.s, qr, lane))
			continue;
		__syncthreads(); /* the previous tile is consumed */
		ej_tc_stage(ks, ldq, a.k, a.ks, b, g, k0, EJ_TC_BK, a.s, D);
		ej_tc_stage(vs, ldv, a.v, a.vs, b, g, k0, EJ_TC_BK, a.s, DV);
		__syncthreads();
		ej_tc_qk(s, qs + 16 * w * ldq, ks, ldq, nkd, lane);
		ej_tc_softmax(a, s, o, m, l, b, h, i, k0, ke, lane);
		ej_tc_pv(o, s, vs, ldv, nvo, lane);
	}
	EJ_AT_UNROLL
	for (int rw = 0; rw < 2; rw++) {
		int r = i + 8 * rw;
		if (r >= a.t)
			continue; /* no break: see EJ_AT_UNROLL */
		long long row = (long long)bh * a.t + r;
		float inv = l[rw] > 0 ? 1.0f / l[rw] : 0.0f;
		ej_bf16 *dst = (ej_bf16 *)a.out + row * DV;
		EJ_AT_UNROLL
		for (int nt = 0; nt < EJ_TC_NO; nt++) {
			ej_tc_st2(dst, nt * 8 + 2 * (lane & 3), DV,
				  o[nt][2 * rw] * inv, o[nt][2 * rw + 1] * inv);
		}
		if ((lane & 3) == 0)
			((float *)a.lse)[row] =
			    l[rw] > 0 ? m[rw] + logf(l[rw]) : ej_at_empty_lse(a);
	}
}

/* lse and Di = rowsum(dO * O) of rows i and i + 8 of this lane (gw: the
 * warp's 16 rows of dO in shared memory); Di is written to a.di. */
EJ_D void ej_tc_lse_di(const struct ej_attn_args &a, const ej_bf16 *gw, int ldv,
		       int b, int h, int i, int lane, float *lse, float *di)
{
	EJ_AT_UNROLL
	for (int rw = 0; rw < 2; rw++) {
		int r = i + 8 * rw;
		float part = 0;
		lse[rw] = -ej_inf_f();
		if (r < a.t) {
			const ej_bf16 *o = (const ej_bf16 *)a.o;
			const ej_bf16 *gr = gw + ((lane >> 2) + 8 * rw) * ldv;
			for (int d = lane & 3; d < a.dv; d += 4)
				part += ej_bf2f(gr[d]) *
					ej_bf2f(o[ej_at_off(a.os, b, h, r, d)]);
			lse[rw] =
			    ((const float *)a.lse_in)[(long long)b * a.ls[0] +
						      (long long)h * a.ls[1] +
						      (long long)r * a.ls[2]];
		}
		di[rw] = ej_tc_qsum(part);
		if (r < a.t && (lane & 3) == 0)
			((float *)a.di)[((long long)b * a.hq + h) * a.t + r] =
			    di[rw];
	}
}

/* dq on tensor cores: grid (B * Hq, ceil(T / 64)), query blocks in reverse
 * as in the forward; per key tile S = Q K^T, dP = dO V^T, dS = P (dP - Di)
 * and dq += dS K (dS rounded to bf16); dq = scale dq.  Shared: qs
 * [64][ld(D)], gos [64][ld(Dv)], ks [BK][ld(D)], vs [BK][ld(Dv)]. */
extern "C" __global__ void __launch_bounds__(EJ_AT_NT, EJ_TC_MINB)
    ej_attn_bwd_dq_tc(const struct ej_attn_args a)
{
	const int D = a.d, DV = a.dv, ldq = ej_tc_ld(D), ldv = ej_tc_ld(DV);
	const int nkd = (D + 15) / 16, nkv = (DV + 15) / 16;
	const int bh = blockIdx.x, b = bh / a.hq, h = bh % a.hq;
	const int g = h / (a.hq / a.hkv);
	const int i0 = (int)(gridDim.y - 1 - blockIdx.y) * EJ_TC_BQ;
	const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
	ej_bf16 *qs = (ej_bf16 *)ej_dyn_smem();
	ej_bf16 *gos = qs + EJ_TC_BQ * ldq;
	ej_bf16 *ks = gos + EJ_TC_BQ * ldv;
	ej_bf16 *vs = ks + EJ_TC_BK * ldq;
	const int i = i0 + 16 * w + (lane >> 2); /* rows i and i + 8 */
	const int ke[2] = { ej_at_kend(a, i), ej_at_kend(a, i + 8) };
	const float scale = (float)a.scale;

	ej_tc_stage(qs, ldq, a.q, a.qs, b, h, i0, EJ_TC_BQ, a.t, D);
	ej_tc_stage(gos, ldv, a.go, a.gs, b, h, i0, EJ_TC_BQ, a.t, DV);
	__syncthreads();
	float lse[2], di[2];
	ej_tc_lse_di(a, gos + 16 * w * ldv, ldv, b, h, i, lane, lse, di);
	float dq[EJ_TC_NO][4], s[EJ_TC_NS][4], dp[EJ_TC_NS][4];
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NO; nt++)
		dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0;
	int ilast = i0 + EJ_TC_BQ < a.t ? i0 + EJ_TC_BQ - 1 : a.t - 1;
	int kmax = ej_at_kend(a, ilast);
	long long qr[2]; /* the block's documents (with a.seg) */
	if (a.seg)
		ej_tc_doc_range(a, b, i0, ilast - i0 + 1, lane, qr);
	for (int k0 = 0; k0 < kmax; k0 += EJ_TC_BK) {
		if (ej_tc_docs_apart(a, b, k0, EJ_TC_BK, a.s, qr, lane))
			continue; /* other documents: dS is 0 there */
		__syncthreads();
		ej_tc_stage(ks, ldq, a.k, a.ks, b, g, k0, EJ_TC_BK, a.s, D);
		ej_tc_stage(vs, ldv, a.v, a.vs, b, g, k0, EJ_TC_BK, a.s, DV);
		__syncthreads();
		ej_tc_qk(s, qs + 16 * w * ldq, ks, ldq, nkd, lane);
		ej_tc_qk(dp, gos + 16 * w * ldv, vs, ldv, nkv, lane);
		EJ_AT_UNROLL
		for (int nt = 0; nt < EJ_TC_NS; nt++)
			EJ_AT_UNROLL
		for (int e = 0; e < 4; e++) {
			int rw = e >> 1;
			int j = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
			float ds = 0;
			if (j < ke[rw] && ej_at_finite(lse[rw]) &&
			    (!a.seg || ej_at_same_doc(a, b, i + 8 * rw, j)))
				ds = expf(s[nt][e] * scale +
					  (a.mask ? ej_at_mask(a, b, h,
							       i + 8 * rw, j)
						  : 0.0f) -
					  lse[rw]) *
				     (dp[nt][e] - di[rw]);
			s[nt][e] = ds;
		}
		ej_tc_pv(dq, s, ks, ldq, 2 * nkd, lane);
	}
	EJ_AT_UNROLL
	for (int rw = 0; rw < 2; rw++) {
		int r = i + 8 * rw;
		if (r >= a.t)
			continue; /* no break: see EJ_AT_UNROLL */
		ej_bf16 *dst =
		    (ej_bf16 *)a.grad_q + ((long long)bh * a.t + r) * D;
		EJ_AT_UNROLL
		for (int nt = 0; nt < EJ_TC_NO; nt++) {
			ej_tc_st2(dst, nt * 8 + 2 * (lane & 3), D,
				  scale * dq[nt][2 * rw],
				  scale * dq[nt][2 * rw + 1]);
		}
	}
}

/* One pass of dk or dv (a.part 1 or 0) for the 16 keys of a warp over
 * query tile q0 (staged): P^T = exp(K Q^T scale - lse), and dV += P^T dO,
 * or dP^T = V dO^T, dS^T = P^T (dP^T - Di) and dK += dS^T Q. */
EJ_D void ej_tc_kv_tile(const struct ej_attn_args &a, float (*acc)[4],
			const ej_bf16 *kw, const ej_bf16 *vw, const ej_bf16 *qs,
			const ej_bf16 *gos, const float *lses, const float *dis,
			int b, int h, int j, int q0, int lane)
{
	const int ldq = ej_tc_ld(a.d), ldv = ej_tc_ld(a.dv);
	const int nkd = (a.d + 15) / 16, nkv = (a.dv + 15) / 16;
	float s[EJ_TC_NS][4], dp[EJ_TC_NS][4];
	ej_tc_qk(s, kw, qs, ldq, nkd, lane);
	if (a.part)
		ej_tc_qk(dp, vw, gos, ldv, nkv, lane);
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NS; nt++)
		EJ_AT_UNROLL
	for (int e = 0; e < 4; e++) {
		int jj = j + 8 * (e >> 1),
		    r = nt * 8 + 2 * (lane & 3) + (e & 1);
		float x = 0;
		if (jj < ej_at_kend(a, q0 + r) && ej_at_finite(lses[r]) &&
		    (!a.seg || ej_at_same_doc(a, b, q0 + r, jj))) {
			x = expf(s[nt][e] * (float)a.scale +
				 (a.mask ? ej_at_mask(a, b, h, q0 + r, jj)
					 : 0.0f) -
				 lses[r]);
			if (a.part)
				x *= dp[nt][e] - dis[r];
		}
		s[nt][e] = x;
	}
	if (a.part)
		ej_tc_pv(acc, s, qs, ldq, 2 * nkd, lane);
	else
		ej_tc_pv(acc, s, gos, ldv, 2 * nkv, lane);
}

#if EJ_ATTN_DL <= 4
/* Both at once (ej_attn_bwd_dkdv1_tc): P^T and dP^T = V dO^T, dV += P^T
 * dO, dS^T = P^T (dP^T - Di), dK += dS^T Q; four products a tile where
 * the two passes take five, and Q and dO are staged once. */
EJ_D void ej_tc_kv_tile1(const struct ej_attn_args &a, float (*dk)[4],
			 float (*dv)[4], const ej_bf16 *kw, const ej_bf16 *vw,
			 const ej_bf16 *qs, const ej_bf16 *gos,
			 const float *lses, const float *dis, int b, int h,
			 int j, int q0, int lane)
{
	const int ldq = ej_tc_ld(a.d), ldv = ej_tc_ld(a.dv);
	const int nkd = (a.d + 15) / 16, nkv = (a.dv + 15) / 16;
	float s[EJ_TC_NS][4], dp[EJ_TC_NS][4];
	ej_tc_qk(s, kw, qs, ldq, nkd, lane);
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NS; nt++)
		EJ_AT_UNROLL
	for (int e = 0; e < 4; e++) {
		int jj = j + 8 * (e >> 1),
		    r = nt * 8 + 2 * (lane & 3) + (e & 1);
		float x = 0;
		if (jj < ej_at_kend(a, q0 + r) && ej_at_finite(lses[r]) &&
		    (!a.seg || ej_at_same_doc(a, b, q0 + r, jj)))
			x = expf(s[nt][e] * (float)a.scale +
				 (a.mask ? ej_at_mask(a, b, h, q0 + r, jj)
					 : 0.0f) -
				 lses[r]);
		s[nt][e] = x;
	}
	/* dV first: dP^T's registers are not live during its product */
	ej_tc_pv(dv, s, gos, ldv, 2 * nkv, lane);
	ej_tc_qk(dp, vw, gos, ldv, nkv, lane);
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NS; nt++)
		EJ_AT_UNROLL
	for (int e = 0; e < 4; e++) {
		int r = nt * 8 + 2 * (lane & 3) + (e & 1);
		dp[nt][e] = s[nt][e] * (dp[nt][e] - dis[r]);
	}
	ej_tc_pv(dk, dp, qs, ldq, 2 * nkd, lane);
}
#endif

/* For the dk/dv kernels with document ids: grid (B, ceil(S / 64)), block
 * (b, kb) writes to a.spans[2 (b gridDim.y + kb) + {0, 1}] the first
 * query and one past the last query whose id is in the id range of keys
 * [64 kb, 64 kb + 64) of row b ([T, 0): none).  A query outside that span
 * shares no document with those keys, so dk/dv need not visit it; for
 * packed documents (ids growing along the row) the span is exactly the
 * keys' documents.  Any ids are safe: the span holds every query whose id
 * is in the range.  O(T) reads a block, coalesced. */
extern "C" __global__ void __launch_bounds__(EJ_AT_NT)
    ej_attn_doc_spans(const struct ej_attn_args a)
{
	__shared__ long long kr[2];
	__shared__ int qr[2];
	const int b = blockIdx.x, j0 = blockIdx.y * EJ_TC_BQ;
	const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
	if (w == 0) {
		long long r[2];
		ej_tc_doc_range(a, b, j0, j0 + EJ_TC_BQ < a.s ? EJ_TC_BQ
							     : a.s - j0,
				lane, r);
		if (lane == 0) {
			kr[0] = r[0];
			kr[1] = r[1];
			qr[0] = a.t;
			qr[1] = 0;
		}
	}
	__syncthreads();
	int lo = a.t, hi = -1;
	for (int i = threadIdx.x; i < a.t; i += EJ_AT_NT) {
		long long id = ej_at_doc(a, b, i);
		if (id >= kr[0] && id <= kr[1]) {
			lo = i < lo ? i : lo;
			hi = i;
		}
	}
	if (hi >= 0) {
		atomicMin(&qr[0], lo);
		atomicMax(&qr[1], hi + 1);
	}
	__syncthreads();
	if (threadIdx.x == 0) {
		int *sp = a.spans + 2 * (b * gridDim.y + blockIdx.y);
		sp[0] = qr[0];
		sp[1] = qr[1];
	}
}

/* The lse and Di of query tile q0 to shared memory (-inf and 0 past T). */
EJ_D void ej_tc_stage_rows(const struct ej_attn_args &a, float *lses,
			   float *dis, int b, int h, int q0)
{
	for (int r = threadIdx.x; r < EJ_TC_BK; r += EJ_AT_NT) {
		int i = q0 + r;
		float ls = -ej_inf_f(), d0 = 0;
		if (i < a.t) {
			ls = ((const float *)a.lse_in)[(long long)b * a.ls[0] +
						       (long long)h * a.ls[1] +
						       (long long)i * a.ls[2]];
			d0 = ((const float *)
				  a.di)[((long long)b * a.hq + h) * a.t + i];
		}
		lses[r] = ls;
		dis[r] = d0;
	}
}

/* The dk/dv kernels' shared memory: ks [64][ldq], vs [64][ldv], qs
 * [BK][ldq], gos [BK][ldv], lses [BK], dis [BK] (f32). */
struct ej_tc_kv_smem {
	int ldq, ldv;
	ej_bf16 *ks, *vs, *qs, *gos;
	float *lses, *dis;
};

/* Lays out the shared memory of a dk/dv block and stages its 64 keys and
 * values (kv head of query head blockIdx.x % Hq). */
EJ_D void ej_tc_kv_begin(const struct ej_attn_args &a, struct ej_tc_kv_smem *m)
{
	const int b = blockIdx.x / a.hq, h = blockIdx.x % a.hq;
	const int g = h / (a.hq / a.hkv), j0 = blockIdx.y * EJ_TC_BQ;
	m->ldq = ej_tc_ld(a.d);
	m->ldv = ej_tc_ld(a.dv);
	m->ks = (ej_bf16 *)ej_dyn_smem();
	m->vs = m->ks + EJ_TC_BQ * m->ldq;
	m->qs = m->vs + EJ_TC_BQ * m->ldv;
	m->gos = m->qs + EJ_TC_BK * m->ldq;
	m->lses = (float *)(m->gos + EJ_TC_BK * m->ldv);
	m->dis = m->lses + EJ_TC_BK;
	ej_tc_stage(m->ks, m->ldq, a.k, a.ks, b, g, j0, EJ_TC_BQ, a.s, a.d);
	ej_tc_stage(m->vs, m->ldv, a.v, a.vs, b, g, j0, EJ_TC_BQ, a.s, a.dv);
}

/* Stages query tile q0 of (b, h) for a dk/dv block: q, dO, lse and Di,
 * between the barriers that keep the previous tile until it is consumed. */
EJ_D void ej_tc_kv_stage_tile(const struct ej_attn_args &a,
			      const struct ej_tc_kv_smem *m, int b, int h,
			      int q0)
{
	__syncthreads(); /* the previous tile is consumed */
	ej_tc_stage(m->qs, m->ldq, a.q, a.qs, b, h, q0, EJ_TC_BK, a.t, a.d);
	ej_tc_stage(m->gos, m->ldv, a.go, a.gs, b, h, q0, EJ_TC_BK, a.t, a.dv);
	ej_tc_stage_rows(a, m->lses, m->dis, b, h, q0);
	__syncthreads();
}

/* The queries [*qbeg, *qend) the keys j0.. of block row b visit: from the
 * first that sees key j0 under the causal mask, within the span of their
 * documents (a.spans) when there is one. */
EJ_D void ej_tc_kv_span(const struct ej_attn_args &a, int b, int j0,
			int *qbeg, int *qend)
{
	int imin = a.causal ? j0 - a.coff : 0; /* first query seeing j0 */
	int qe = a.t;
	if (a.spans) { /* only the queries of the keys' documents */
		const int *sp = a.spans + 2 * (b * gridDim.y + blockIdx.y);
		imin = sp[0] > imin ? sp[0] : imin;
		qe = sp[1] < qe ? sp[1] : qe;
	}
	*qbeg = imin < 0 ? 0 : imin;
	*qend = qe;
}

/* Writes the accumulator of dk (part 1, times the scale) or dv (part 0)
 * of keys j and j + 8 of (b, h) = bh: to grad_k / grad_v in bf16, or as
 * f32 partials to kv_part. */
EJ_D void ej_tc_kv_store(const struct ej_attn_args &a, float (*acc)[4],
			 int part, int bh, int j, int lane)
{
	const int W = part ? a.d : a.dv;
	const float mul = part ? (float)a.scale : 1.0f;
	EJ_AT_UNROLL
	for (int rw = 0; rw < 2; rw++) {
		int jj = j + 8 * rw;
		if (jj >= a.s)
			continue; /* no break: see EJ_AT_UNROLL */
		long long row = ((long long)bh * a.s + jj) * W;
		EJ_AT_UNROLL
		for (int nt = 0; nt < EJ_TC_NO; nt++) {
			int d = nt * 8 + 2 * (lane & 3);
			float x0 = mul * acc[nt][2 * rw];
			float x1 = mul * acc[nt][2 * rw + 1];
			if (!a.kv_part) {
				ej_tc_st2(
				    (ej_bf16 *)(part ? a.grad_k : a.grad_v) +
					row,
				    d, W, x0, x1);
				continue;
			}
			float *p = (float *)a.kv_part + row;
			if (!part)
				p += (long long)a.b * a.hq * a.s * a.d;
			if (d < W)
				p[d] = x0;
			if (d + 1 < W)
				p[d + 1] = x1;
		}
	}
}

/* dk or dv on tensor cores (a.part 1 or 0), for head dims past 128 (the
 * two accumulators of ej_attn_bwd_dkdv1_tc would spill there): grid
 * (B * Hq, ceil(S / 64)), a block owns 64 keys (16 per warp) and ONE query
 * head h, and loops over tiles of EJ_TC_BK queries from the first that
 * sees its first key (with document ids, within the span of queries of
 * its keys' documents, ej_attn_doc_spans: the tiles of other documents
 * are never loaded).  Shared: ks [64][ld(D)], vs [64][ld(Dv)], qs
 * [BK][ld(D)], gos [BK][ld(Dv)], lses [BK], dis [BK] (f32).  With Hq ==
 * Hkv it writes grad_k or grad_v; else f32 partials of head h to kv_part,
 * which ej_attn_bwd_kv_sum adds up. */
extern "C" __global__ void __launch_bounds__(EJ_AT_NT, EJ_TC_MINB)
    ej_attn_bwd_dkdv_tc(const struct ej_attn_args a)
{
	const int bh = blockIdx.x, b = bh / a.hq, h = bh % a.hq;
	const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
	const int j = blockIdx.y * EJ_TC_BQ + 16 * w + (lane >> 2); /* j, j+8 */
	struct ej_tc_kv_smem sm;
	ej_tc_kv_begin(a, &sm);
	float acc[EJ_TC_NO][4];
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NO; nt++)
		acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;
	int qbeg, qend;
	ej_tc_kv_span(a, b, blockIdx.y * EJ_TC_BQ, &qbeg, &qend);
	for (int q0 = qbeg; q0 < qend; q0 += EJ_TC_BK) {
		ej_tc_kv_stage_tile(a, &sm, b, h, q0);
		ej_tc_kv_tile(a, acc, sm.ks + 16 * w * sm.ldq,
			      sm.vs + 16 * w * sm.ldv, sm.qs, sm.gos, sm.lses,
			      sm.dis, b, h, j, q0, lane);
	}
	ej_tc_kv_store(a, acc, a.part, bh, j, lane);
}

#if EJ_ATTN_DL <= 4
/* dk and dv in one pass, head dims up to 128: as ej_attn_bwd_dkdv_tc with
 * both accumulators (no spill at 128: the ptxas suite),
 * so a query tile is staged and S^T and dP^T computed once. */
extern "C" __global__ void __launch_bounds__(EJ_AT_NT, EJ_TC_MINB)
    ej_attn_bwd_dkdv1_tc(const struct ej_attn_args a)
{
	const int bh = blockIdx.x, b = bh / a.hq, h = bh % a.hq;
	const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
	const int j = blockIdx.y * EJ_TC_BQ + 16 * w + (lane >> 2); /* j, j+8 */
	struct ej_tc_kv_smem sm;
	ej_tc_kv_begin(a, &sm);
	float dk[EJ_TC_NO][4], dv[EJ_TC_NO][4];
	EJ_AT_UNROLL
	for (int nt = 0; nt < EJ_TC_NO; nt++) {
		dk[nt][0] = dk[nt][1] = dk[nt][2] = dk[nt][3] = 0;
		dv[nt][0] = dv[nt][1] = dv[nt][2] = dv[nt][3] = 0;
	}
	int qbeg, qend;
	ej_tc_kv_span(a, b, blockIdx.y * EJ_TC_BQ, &qbeg, &qend);
	for (int q0 = qbeg; q0 < qend; q0 += EJ_TC_BK) {
		ej_tc_kv_stage_tile(a, &sm, b, h, q0);
		ej_tc_kv_tile1(a, dk, dv, sm.ks + 16 * w * sm.ldq,
			       sm.vs + 16 * w * sm.ldv, sm.qs, sm.gos, sm.lses,
			       sm.dis, b, h, j, q0, lane);
	}
	EJ_AT_UNROLL
	for (int part = 0; part < 2; part++)
		ej_tc_kv_store(a, part ? dk : dv, part, bh, j, lane);
}
#endif

/* dk and dv with Hq > Hkv: the sum of the query heads' partials of
 * ej_attn_bwd_dkdv_tc (kv_part), head by head in order; one thread per
 * element of dk then dv, grid-stride. */
extern "C" __global__ void __launch_bounds__(EJ_AT_NT)
    ej_attn_bwd_kv_sum(const struct ej_attn_args a)
{
	const int rep = a.hq / a.hkv;
	const long long nk = (long long)a.b * a.hkv * a.s * a.d;
	const long long nv = (long long)a.b * a.hkv * a.s * a.dv;
	const float *pk = (const float *)a.kv_part;
	const float *pv = pk + (long long)a.b * a.hq * a.s * a.d;
	for (long long e = (long long)blockIdx.x * EJ_AT_NT + threadIdx.x;
	     e < nk + nv; e += (long long)gridDim.x * EJ_AT_NT) {
		bool isk = e < nk;
		long long x = isk ? e : e - nk;
		long long row =
		    isk ? a.s * (long long)a.d : a.s * (long long)a.dv;
		long long bg = x / row, in = x - bg * row; /* (b, g), within */
		const float *p = (isk ? pk : pv) + bg * rep * row + in;
		float sum = 0;
		for (int hh = 0; hh < rep; hh++)
			sum += p[hh * row];
		((ej_bf16 *)(isk ? a.grad_k : a.grad_v))[x] = ej_f2bf(sum);
	}
}
#endif
