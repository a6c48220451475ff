/* delta.cuh -- the gated delta rule (Gated DeltaNet's recurrence) on the
 * CUDA devices, computing what lib/ops_delta.c computes (see there for the
 * recurrence and its backward).  Inputs are contiguous (the host adapter
 * copies strided ones): q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta
 * [B, T, H], one dtype (code 0 f32, 1 bf16, 2 f64); arithmetic in f32
 * (f64 for f64).  Deterministic: no atomics, every sum in index order.
 *
 *  ej_delta_fwd  o [B, T, H, Dv]: one block per (b, h) (grid-stride),
 *                threads over the columns j of the state; a column
 *                S[:, j] evolves on its own (its read S~^T k and its write
 *                k d_j touch only that column), so each thread keeps its
 *                column in registers (Dk <= EJ_DELTA_MAXK) and writes
 *                o[.., j] at every step.
 *  ej_delta_bwd  dq, dk [B, T, H, Dk], dv [.., Dv], dg, dbeta [B, T, H]:
 *                one thread per (b, h), the CPU kernel's reverse sweep
 *                (states kept every EJ_DELTA_CK steps, the chunk between
 *                recomputed) in the scratch `ws` the host allocates,
 *                ej_delta_ws_elems(T, Dk, Dv) elements of the compute type
 *                per (b, h).  Correct, not fast: its sums over the state's
 *                columns would need cross-thread reductions, and this is
 *                the first CUDA form of the op.
 */

#define EJ_DELTA_MAXK 256
#define EJ_DELTA_CK 64

static __device__ float ej_delta_exp(float x)
{
	return expf(x);
}
static __device__ double ej_delta_exp(double x)
{
	return exp(x);
}

template <class A>
static __device__ void ej_delta_fwd_bh(const struct ej_delta_args &a,
				       long long b, long long h)
{
	A s[EJ_DELTA_MAXK];
	for (long long j = threadIdx.x; j < a.Dv; j += blockDim.x) {
		for (long long i = 0; i < a.Dk; i++)
			s[i] = (A)0;
		for (long long t = 0; t < a.T; t++) {
			const long long r = (b * a.T + t) * a.H + h;
			const A al = ej_delta_exp(ej_fld<A>(a.g, r, a.dt));
			const A be = ej_fld<A>(a.beta, r, a.dt);
			A m = (A)0;
			for (long long i = 0; i < a.Dk; i++) {
				s[i] *= al;
				m += s[i] * ej_fld<A>(a.k, r * a.Dk + i, a.dt);
			}
			const A d =
			    be * (ej_fld<A>(a.v, r * a.Dv + j, a.dt) - m);
			A y = (A)0;
			for (long long i = 0; i < a.Dk; i++) {
				s[i] += ej_fld<A>(a.k, r * a.Dk + i, a.dt) * d;
				y += s[i] * ej_fld<A>(a.q, r * a.Dk + i, a.dt);
			}
			ej_fst<A>(a.o, r * a.Dv + j, a.dt, y);
		}
	}
}

extern "C" __global__ void ej_delta_fwd(const struct ej_delta_args a)
{
	for (long long bh = blockIdx.x; bh < a.B * a.H; bh += gridDim.x) {
		if (a.dt == 2)
			ej_delta_fwd_bh<double>(a, bh / a.H, bh % a.H);
		else
			ej_delta_fwd_bh<float>(a, bh / a.H, bh % a.H);
	}
}

/* One forward step of (b, h) at time t on S [Dk, Dv]; the delta into dl. */
template <class A>
static __device__ void ej_delta_step(const struct ej_delta_args &a,
				     long long r, A *S, A *dl)
{
	const long long Dk = a.Dk, Dv = a.Dv;
	const A al = ej_delta_exp(ej_fld<A>(a.g, r, a.dt));
	const A be = ej_fld<A>(a.beta, r, a.dt);
	for (long long i = 0; i < Dk * Dv; i++)
		S[i] *= al;
	for (long long j = 0; j < Dv; j++) {
		A m = (A)0;
		for (long long i = 0; i < Dk; i++)
			m += S[i * Dv + j] * ej_fld<A>(a.k, r * Dk + i, a.dt);
		dl[j] = be * (ej_fld<A>(a.v, r * Dv + j, a.dt) - m);
	}
	for (long long i = 0; i < Dk; i++) {
		const A ki = ej_fld<A>(a.k, r * Dk + i, a.dt);
		for (long long j = 0; j < Dv; j++)
			S[i * Dv + j] += ki * dl[j];
	}
}

template <class A>
static __device__ void ej_delta_bwd_bh(const struct ej_delta_args &a,
				       long long b, long long h, A *w)
{
	const long long T = a.T, Dk = a.Dk, Dv = a.Dv, SS = Dk * Dv;
	const long long nck = T / EJ_DELTA_CK + 1;
	A *kept = w, *chunk = kept + SS * nck;
	A *dS = chunk + SS * (EJ_DELTA_CK + 1), *St = dS + SS;
	A *dl = St + SS, *mm = dl + Dv, *dd = mm + Dv, *dm = dd + Dv;
	for (long long i = 0; i < SS; i++)
		chunk[i] = (A)0;
	for (long long t = 0; t < T; t++) {
		if (t % EJ_DELTA_CK == 0)
			for (long long i = 0; i < SS; i++)
				kept[SS * (t / EJ_DELTA_CK) + i] = chunk[i];
		ej_delta_step<A>(a, (b * T + t) * a.H + h, chunk, dl);
	}
	for (long long i = 0; i < SS; i++)
		dS[i] = (A)0;
	for (long long c0 = T > 0 ? ((T - 1) / EJ_DELTA_CK) * EJ_DELTA_CK : -1;
	     c0 >= 0; c0 -= EJ_DELTA_CK) {
		const long long len =
		    T - c0 < EJ_DELTA_CK ? T - c0 : EJ_DELTA_CK;
		for (long long i = 0; i < SS; i++)
			chunk[i] = kept[SS * (c0 / EJ_DELTA_CK) + i];
		for (long long j = 0; j < len; j++) {
			for (long long i = 0; i < SS; i++)
				chunk[SS * (j + 1) + i] = chunk[SS * j + i];
			ej_delta_step<A>(a, (b * T + c0 + j) * a.H + h,
					 chunk + SS * (j + 1), dl);
		}
		for (long long jt = len - 1; jt >= 0; jt--) {
			const long long r = (b * T + c0 + jt) * a.H + h;
			const A *Sp = chunk + SS * jt, *Sn = Sp + SS;
			const A al = ej_delta_exp(ej_fld<A>(a.g, r, a.dt));
			const A be = ej_fld<A>(a.beta, r, a.dt);
			for (long long i = 0; i < SS; i++)
				St[i] = al * Sp[i];
			for (long long j = 0; j < Dv; j++) {
				A s2 = (A)0;
				for (long long i = 0; i < Dk; i++)
					s2 += St[i * Dv + j] *
					      ej_fld<A>(a.k, r * Dk + i, a.dt);
				mm[j] = s2;
				dl[j] = be *
					(ej_fld<A>(a.v, r * Dv + j, a.dt) - s2);
			}
			for (long long i = 0; i < Dk; i++) {
				const A qi = ej_fld<A>(a.q, r * Dk + i, a.dt);
				A y = (A)0;
				for (long long j = 0; j < Dv; j++) {
					const A go =
					    ej_fld<A>(a.go, r * Dv + j, a.dt);
					dS[i * Dv + j] += qi * go;
					y += Sn[i * Dv + j] * go;
				}
				ej_fst<A>(a.o, r * Dk + i, a.dt, y);
			}
			for (long long j = 0; j < Dv; j++) {
				A s2 = (A)0;
				for (long long i = 0; i < Dk; i++)
					s2 += dS[i * Dv + j] *
					      ej_fld<A>(a.k, r * Dk + i, a.dt);
				dd[j] = s2;
			}
			A dbeta = (A)0;
			for (long long j = 0; j < Dv; j++) {
				const A vj = ej_fld<A>(a.v, r * Dv + j, a.dt);
				dbeta += dd[j] * (vj - mm[j]);
				ej_fst<A>(a.dv, r * Dv + j, a.dt, be * dd[j]);
				dm[j] = -be * dd[j];
			}
			ej_fst<A>(a.dbeta, r, a.dt, dbeta);
			for (long long i = 0; i < Dk; i++) {
				const A ki = ej_fld<A>(a.k, r * Dk + i, a.dt);
				A s1 = (A)0, s2 = (A)0;
				for (long long j = 0; j < Dv; j++) {
					s1 += dS[i * Dv + j] * dl[j];
					s2 += St[i * Dv + j] * dm[j];
					dS[i * Dv + j] += ki * dm[j];
				}
				ej_fst<A>(a.dk, r * Dk + i, a.dt, s1 + s2);
			}
			A da = (A)0;
			for (long long i = 0; i < SS; i++) {
				da += dS[i] * Sp[i];
				dS[i] *= al;
			}
			ej_fst<A>(a.dg, r, a.dt, da * al);
		}
	}
}

extern "C" __global__ void ej_delta_bwd(const struct ej_delta_args a)
{
	const long long n = a.B * a.H;
	const long long per =
	    (a.T / EJ_DELTA_CK + 1 + EJ_DELTA_CK + 1 + 2) * a.Dk * a.Dv +
	    4 * a.Dv;
	for (long long bh = blockIdx.x * blockDim.x + threadIdx.x; bh < n;
	     bh += gridDim.x * blockDim.x) {
		if (a.dt == 2)
			ej_delta_bwd_bh<double>(a, bh / a.H, bh % a.H,
						(double *)a.ws + bh * per);
		else
			ej_delta_bwd_bh<float>(a, bh / a.H, bh % a.H,
					       (float *)a.ws + bh * per);
	}
}
