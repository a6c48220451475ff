/* gemm_amx.c -- bf16 GEMM on the CPU's AMX tiles (Intel AMX-BF16).
 *
 * OpenBLAS has no bf16 GEMM in Debian's build, so a bf16 product on the CPU
 * otherwise converts both operands to f32 and runs sgemm.  Where the CPU has
 * AMX-BF16 and the kernel grants the tile state (arch_prctl
 * ARCH_REQ_XCOMP_PERM), the matmul and linear kernels (lib/ops_linalg.c)
 * multiply the bf16 operands as they are: TDPBF16PS forms each product
 * exactly and adds in f32, so the result is the f32 product of the bf16
 * values, as with sgemm, up to the order of the additions (and bf16
 * subnormal inputs, which the tiles read as zero).
 *
 * Layout: op(A) [m, k] and op(B) [k, n] are read through any element
 * strides into zero-padded packs: A as rows of 32 k-values (one 16 x 64-byte
 * tile per 16 rows), B in the tiles' pair-interleaved ("VNNI") layout, 16
 * pairs of k by 16 columns per tile.  Each 32 x 32 block of C keeps four
 * f32 accumulator tiles (tmm0-3) over the whole k, with two A tiles (tmm4,
 * tmm5) and two B tiles (tmm6, tmm7) per step of 32; blocks are shared out
 * among OpenMP threads.  C = alpha * op(A) op(B) + beta * C, in f32.
 *
 * EPJIT_CPU_AMX=0, read when a context is made, turns the path off (the
 * f32 path then runs); ej_amx_usable() says whether this process can use
 * the tiles at all.
 */
#include "ops_impl.h"

#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) &&          \
    !defined(__clang__)
#define EJ_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define EJ_HAVE_AMX 0
#endif

enum { TR = 16, TK = 32, BM = 32, BN = 32 };

static int64_t round_up(int64_t v, int64_t to)
{
	return (v + to - 1) / to * to;
}

#if EJ_HAVE_AMX

static bool amx_ok;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

/* CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE; the OS must enable the
 * tile state (XCR0 bits 17, 18) and grant it to this process. */
static void amx_probe(void)
{
	unsigned a, b, c, d;
	if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
		return;
	if (!(d & (1u << 22)) || !(d & (1u << 24)))
		return;
	if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)))
		return; /* no OSXSAVE: xgetbv would fault */
	unsigned lo, hi;
	__asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
	if ((lo & (3u << 17)) != (3u << 17))
		return;
	/* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA */
	amx_ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

bool ej_amx_usable(void)
{
	pthread_once(&amx_once, amx_probe);
	return amx_ok;
}

/* The tile configuration: palette 1, tiles 0-7 of 16 rows of 64 bytes. */
struct tilecfg {
	uint8_t palette, start_row, reserved[14];
	uint16_t colsb[16];
	uint8_t rows[16];
};

/* One 32 x 32 block of C from the packs: rows [i0, i0 + 32) of ap (kp
 * bf16 a row), columns [j0, j0 + 32) of bp (per 16 columns, kp / 2 rows of
 * 32 bf16), added to out (row stride ldo floats) when load, else written
 * over it. */
__attribute__((target("amx-tile,amx-bf16"))) static void
amx_block(const uint16_t *ap, const uint16_t *bp, int64_t kp, int64_t i0,
	  int64_t j0, float *out, int64_t ldo, bool load)
{
	const uint16_t *a0 = ap + i0 * kp, *a1 = a0 + TR * kp;
	const uint16_t *b0 = bp + (j0 / TR) * (kp / 2) * 32;
	const uint16_t *b1 = b0 + (kp / 2) * 32;
	const size_t sa = (size_t)kp * 2, so = (size_t)ldo * 4;
	float *o1 = out + TR, *o2 = out + TR * ldo, *o3 = o2 + TR;
	if (load) {
		_tile_loadd(0, out, so);
		_tile_loadd(1, o1, so);
		_tile_loadd(2, o2, so);
		_tile_loadd(3, o3, so);
	} else {
		_tile_zero(0);
		_tile_zero(1);
		_tile_zero(2);
		_tile_zero(3);
	}
	for (int64_t p = 0; p < kp; p += TK) {
		_tile_loadd(4, a0 + p, sa);
		_tile_loadd(5, a1 + p, sa);
		_tile_loadd(6, b0 + (p / 2) * 32, 64);
		_tile_loadd(7, b1 + (p / 2) * 32, 64);
		_tile_dpbf16ps(0, 4, 6);
		_tile_dpbf16ps(1, 4, 7);
		_tile_dpbf16ps(2, 5, 6);
		_tile_dpbf16ps(3, 5, 7);
	}
	_tile_stored(0, out, so);
	_tile_stored(1, o1, so);
	_tile_stored(2, o2, so);
	_tile_stored(3, o3, so);
}

/* Static: GCC 12 drops stores to a stack copy that only ldtilecfg reads. */
static const struct tilecfg amx_cfg = {
	.palette = 1,
	.colsb = { 64, 64, 64, 64, 64, 64, 64, 64 },
	.rows = { TR, TR, TR, TR, TR, TR, TR, TR },
};

__attribute__((target("amx-tile"))) static void amx_config(void)
{
	_tile_loadconfig(&amx_cfg);
}

__attribute__((target("amx-tile"))) static void amx_release(void)
{
	_tile_release();
}

#else /* !EJ_HAVE_AMX */

bool ej_amx_usable(void)
{
	return false;
}

static void amx_block(const uint16_t *ap, const uint16_t *bp, int64_t kp,
		      int64_t i0, int64_t j0, float *out, int64_t ldo,
		      bool load)
{
	(void)ap, (void)bp, (void)kp, (void)i0, (void)j0, (void)out, (void)ldo,
	    (void)load;
	EJ_ASSERT(!"AMX GEMM without AMX");
}

static void amx_config(void)
{
}

static void amx_release(void)
{
}

#endif

/* A [m, k] (element (i, p) at a[i * sam + p * sak]) into ap [mp][kp]. */
static void pack_a(const uint16_t *a, int64_t sam, int64_t sak, int64_t m,
		   int64_t k, uint16_t *ap, int64_t mp, int64_t kp)
{
#pragma omp parallel for schedule(static) if (mp * kp > (1 << 18))
	for (int64_t i = 0; i < mp; i++) {
		uint16_t *r = ap + i * kp;
		if (i >= m) {
			memset(r, 0, (size_t)kp * 2);
			continue;
		}
		const uint16_t *s = a + i * sam;
		if (sak == 1)
			memcpy(r, s, (size_t)k * 2);
		else
			for (int64_t p = 0; p < k; p++)
				r[p] = s[p * sak];
		memset(r + k, 0, (size_t)(kp - k) * 2);
	}
}

/* B [k, n] (element (p, j) at b[p * sbk + j * sbn]) into bp: per 16
 * columns jt, kp / 2 rows of 16 pairs (b[2q][j], b[2q + 1][j]).  A column
 * of consecutive k (sbk 1, as w^T of a row-major weight) moves a pair at a
 * time; a row of consecutive j (sbn 1) interleaves two rows. */
static void pack_b(const uint16_t *b, int64_t sbk, int64_t sbn, int64_t k,
		   int64_t n, uint16_t *bp, int64_t kp, int64_t np)
{
	int64_t nt = np / TR, k2 = k & ~(int64_t)1;
#pragma omp parallel for schedule(static) if (np * kp > (1 << 18))
	for (int64_t jt = 0; jt < nt; jt++) {
		uint16_t *t = bp + jt * (kp / 2) * 32;
		int64_t jn = n - jt * TR < TR ? n - jt * TR : TR;
		if (jn < TR || k2 < kp)
			memset(t, 0, (size_t)kp * TR * 2);
		if (sbn == 1 && jn == TR) {
			const uint16_t *s = b + jt * TR;
			for (int64_t p = 0; p < k2; p += 2) {
				const uint16_t *r0 = s + p * sbk,
					       *r1 = r0 + sbk;
				uint16_t *d = t + (p / 2) * 32;
				for (int jj = 0; jj < TR; jj++) {
					d[2 * jj] = r0[jj];
					d[2 * jj + 1] = r1[jj];
				}
			}
		}
		for (int64_t jj = 0; jj < jn; jj++) {
			const uint16_t *s = b + (jt * TR + jj) * sbn;
			int64_t p = sbn == 1 && jn == TR ? k2 : 0;
			if (sbk == 1)
				for (; p < k2; p += 2) {
					uint32_t v;
					memcpy(&v, s + p, 4);
					memcpy(t + (p / 2) * 32 + jj * 2, &v,
					       4);
				}
			for (; p < k; p++)
				t[(p / 2) * 32 + jj * 2 + (p & 1)] = s[p * sbk];
		}
	}
}

bool ej_amx_wanted(epj_ctx *ctx, epj_dtype a, epj_dtype b, int64_t macs)
{
	return a == EPJ_DTYPE_BF16 && b == EPJ_DTYPE_BF16 && !ctx->no_amx &&
	       macs >= 16 * 16 * 32 && ej_amx_usable();
}

void *ej_amx_begin(epj_ctx *ctx, int64_t m, int64_t n, int64_t k)
{
	size_t bytes = (ej_amx_scratch(m, n, k) + 63) / 64 * 64;
	void *scratch = aligned_alloc(64, bytes);
	if (scratch)
		epj_counter_add(ctx, "kernels.cpu_amx", 1);
	return scratch;
}

size_t ej_amx_scratch(int64_t m, int64_t n, int64_t k)
{
	int64_t kp = round_up(k > 0 ? k : 1, TK);
	return (size_t)((round_up(m, BM) + round_up(n, BN)) * kp) * 2;
}

void ej_gemm_bf16_amx(int64_t m, int64_t n, int64_t k, float alpha,
		      const uint16_t *a, int64_t sam, int64_t sak,
		      const uint16_t *b, int64_t sbk, int64_t sbn, float beta,
		      float *c, int64_t ldc, void *scratch)
{
	if (m <= 0 || n <= 0)
		return;
	EJ_ASSERT(k > 0 && ldc >= n && ej_amx_usable());
	int64_t mp = round_up(m, BM), np = round_up(n, BN),
		kp = round_up(k, TK);
	uint16_t *ap = scratch, *bp = ap + mp * kp;
	pack_a(a, sam, sak, m, k, ap, mp, kp);
	pack_b(b, sbk, sbn, k, n, bp, kp, np);
	int64_t mb = mp / BM, nb = np / BN;
#pragma omp parallel if (mb * nb > 1 && m * n * k > (1 << 21))
	{
		float acc[BM * BN] __attribute__((aligned(64)));
		amx_config();
#pragma omp for schedule(static)
		for (int64_t blk = 0; blk < mb * nb; blk++) {
			int64_t i0 = (blk / nb) * BM, j0 = (blk % nb) * BN;
			int64_t ie = m - i0 < BM ? m - i0 : BM;
			int64_t je = n - j0 < BN ? n - j0 : BN;
			float *cb = c + i0 * ldc + j0;
			/* a whole block with alpha 1 and beta 0 or 1: the
			 * tiles load and store C itself */
			if (ie == BM && je == BN && alpha == 1 &&
			    (beta == 0 || beta == 1)) {
				amx_block(ap, bp, kp, i0, j0, cb, ldc,
					  beta == 1);
				continue;
			}
			amx_block(ap, bp, kp, i0, j0, acc, BN, false);
			for (int64_t i = 0; i < ie; i++) {
				float *cr = cb + i * ldc;
				const float *ar = acc + i * BN;
				if (beta == 0)
					for (int64_t j = 0; j < je; j++)
						cr[j] = alpha * ar[j];
				else
					for (int64_t j = 0; j < je; j++)
						cr[j] = alpha * ar[j] +
							beta * cr[j];
			}
		}
		amx_release();
	}
}
