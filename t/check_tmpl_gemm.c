/* check_tmpl_gemm.c -- the GEMM template (templates/gemm.cuh through
 * kernels/tmpl_gemm.c) on cuda-sim, and the simulator's emulations of the
 * tensor-core helpers it is built on.
 *
 * Emulations: mma.sync m16n8k16 against a hand-computed 16x8x16 product
 * with fragments laid out by the PTX formulas on the host; ldmatrix .x4
 * (and .trans) lane mapping with per-lane row addresses; cp.async's
 * deferred copies (a read before the wait sees the old shared memory, the
 * zero fill, wait_group 1 leaving the newest group pending); a lane missing
 * from an mma and a thread ending with copies pending are reported.
 *
 * GEMM: every variant against a double reference on fresh random inputs
 * (bf16 inputs rounded once, the reference reading the rounded values) at
 * odd sizes (1, 7, 17, 33, 65, 70; K never a multiple of 16 or 32 but
 * once), all four transposes, cp.async and element-wise tile loads, batches
 * of 2-3 (one operand broadcast), f32 and bf16 output, each epilogue, the
 * grouped GEMM with empty groups, the f32 and f64 kernels; the matmul and
 * linear adapters against the CPU ops.  Tolerance for bf16 inputs: 1e-3 of
 * sum_p |a||b| (fp32 accumulation), plus 2^-8 relative for a bf16 output.
 *
 * The module is compiled once per test case into a cache directory the
 * case creates (unchecked fixture); race check and poisoned outputs on.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cc.h"
#include "kir.h"
#include "tmpl.h"
#include "tmpl_gemm.h"

static char *cache_dir;

static void cache_setup(void)
{
	cache_dir = tu_tmpdir_new("tmpl_gemm");
	setenv("EPJIT_CACHE_DIR", cache_dir, 1);
	unsetenv("EPJIT_SIM_RACECHECK");
	unsetenv("EPJIT_SIM_POISON");
	ej_tmpl_clear();
}

static void cache_teardown(void)
{
	ej_tmpl_clear();
	tu_tmpdir_free(cache_dir);
	cache_dir = NULL;
}

static uint16_t bf(double v)
{
	return ej_bf16_store((float)v);
}
static double unbf(uint16_t h)
{
	return (double)ej_bf16_load(h);
}

/* ---- the emulations ------------------------------------------------------
 */

typedef struct bufs {
	void *p[4];
} bufs;

static void *module_of(epj_ctx *ctx, const char *src, const char *const *k,
		       int n)
{
	const char *ty[8];
	for (int i = 0; i < n; i++)
		ty[i] = "struct bufs";
	char *full = NULL;
	ck_assert(asprintf(&full, "%s\nstruct bufs { void *p[4]; };\n%s",
			   ej_prelude_cuda(), src) > 0);
	void *m = NULL;
	epj_status st = ej_sim_build_module(ctx, full, k, ty, n, "t", &m);
	ck_assert_msg(st == EPJ_OK, "build: %s", epj_ctx_error(ctx));
	free(full);
	return m;
}

static epj_status launch(epj_ctx *ctx, void *m, const char *k, unsigned bx,
			 bufs *b, void *out, size_t out_bytes)
{
	void *fn = ej_device_sim.function(NULL, m, k);
	ck_assert_msg(fn != NULL, "no entry for %s", k);
	ej_launch_out lo = { out, out_bytes, 4 };
	ej_launch l = { .grid = { 1, 1, 1 },
			.block = { bx, 1, 1 },
			.args = b,
			.args_size = sizeof *b,
			.outs = &lo,
			.n_out = out ? 1 : 0 };
	return ej_device_sim.launch(NULL, ctx, fn, k, &l);
}

static const char emu_src[] =
    /* p0: a frags [32][4], p1: b frags [32][2], p2: c [32][4],
     * p3: d [32][4]; the kernel only moves registers */
    "extern \"C\" __global__ void k_mma(const struct bufs p)\n"
    "{\n"
    "\tunsigned l = threadIdx.x;\n"
    "\tconst unsigned *a = (const unsigned *)p.p[0] + 4 * l;\n"
    "\tconst unsigned *b = (const unsigned *)p.p[1] + 2 * l;\n"
    "\tconst float *c = (const float *)p.p[2] + 4 * l;\n"
    "\tfloat d[4];\n"
    "\tej_mma_bf16_16816(d, a, b, c);\n"
    "\tfor (int i = 0; i < 4; i++)\n"
    "\t\t((float *)p.p[3])[4 * l + i] = d[i];\n"
    "}\n"
    /* p0: 4 matrices of 8x8 u16, p1: out [32][4] (x4), p2: [32][4] trans;
     * lane l points at row (l & 7) ^ 5 of matrix l >> 3 */
    "extern \"C\" __global__ void k_ldm(const struct bufs p)\n"
    "{\n"
    "\t__shared__ __align__(16) unsigned short s[4 * 64];\n"
    "\tunsigned l = threadIdx.x;\n"
    "\tfor (int i = l; i < 256; i += 32)\n"
    "\t\ts[i] = ((const unsigned short *)p.p[0])[i];\n"
    "\t__syncthreads();\n"
    "\tconst unsigned short *row = s + (l >> 3) * 64 + ((l & 7) ^ 5) * 8;\n"
    "\tunsigned r[4], t[4];\n"
    "\tej_ldmatrix_x4(r, row);\n"
    "\tej_ldmatrix_x4_trans(t, row);\n"
    "\tfor (int i = 0; i < 4; i++) {\n"
    "\t\t((unsigned *)p.p[1])[4 * l + i] = r[i];\n"
    "\t\t((unsigned *)p.p[2])[4 * l + i] = t[i];\n"
    "\t}\n"
    "}\n"
    /* p0: source [64] u32, p1: out [5][64] u32: before the wait, after
     * wait_group 1, after wait_group 0, the zero-filled copy */
    "extern \"C\" __global__ void k_cp(const struct bufs p)\n"
    "{\n"
    "\t__shared__ __align__(16) unsigned s[3 * 64];\n"
    "\tunsigned t = threadIdx.x;\n"
    "\tconst unsigned *src = (const unsigned *)p.p[0];\n"
    "\tunsigned *o = (unsigned *)p.p[1];\n"
    "\tfor (int i = 0; i < 12; i++)\n"
    "\t\ts[t * 12 + i] = 7u;\n"
    "\t__syncthreads();\n"
    "\tej_cp_async16(s + t * 4, src + t * 4, 16);\n"
    "\tej_cp_async_commit();\n"
    "\tej_cp_async16(s + 64 + t * 4, src + t * 4, 16);\n"
    "\tej_cp_async16(s + 128 + t * 4, src + t * 4, 6);\n"
    "\tej_cp_async_commit();\n"
    "\tfor (int i = 0; i < 4; i++)\n"
    "\t\to[t * 4 + i] = s[t * 4 + i];\n"
    "\tej_cp_async_wait(1);\n"
    "\tfor (int i = 0; i < 4; i++) {\n"
    "\t\to[64 + t * 4 + i] = s[t * 4 + i];\n"
    "\t\to[128 + t * 4 + i] = s[64 + t * 4 + i];\n"
    "\t}\n"
    "\tej_cp_async_wait(0);\n"
    "\tfor (int i = 0; i < 4; i++) {\n"
    "\t\to[192 + t * 4 + i] = s[64 + t * 4 + i];\n"
    "\t\to[256 + t * 4 + i] = s[128 + t * 4 + i];\n"
    "\t}\n"
    "}\n"
    /* lane 31 leaves before the mma */
    "extern \"C\" __global__ void k_mma_missing(const struct bufs p)\n"
    "{\n"
    "\tunsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};\n"
    "\tfloat c[4] = {0, 0, 0, 0};\n"
    "\tif (threadIdx.x == 31)\n"
    "\t\treturn;\n"
    "\tej_mma_bf16_16816(c, a, b, c);\n"
    "\t((float *)p.p[0])[threadIdx.x] = c[0];\n"
    "}\n"
    /* ldmatrix rows 2 bytes off alignment, and rows in global memory */
    "extern \"C\" __global__ void k_ldm_bad(const struct bufs p)\n"
    "{\n"
    "\t__shared__ __align__(16) unsigned short s[4 * 64 + 8];\n"
    "\tunsigned r[4];\n"
    "\tfor (int i = threadIdx.x; i < 264; i += 32)\n"
    "\t\ts[i] = 0;\n"
    "\t__syncthreads();\n"
    "\tif (p.p[0])\n"
    "\t\tej_ldmatrix_x4(r, (const unsigned short *)p.p[0] +\n"
    "\t\t\t       threadIdx.x * 8);\n"
    "\telse\n"
    "\t\tej_ldmatrix_x4(r, s + 1 + threadIdx.x * 8);\n"
    "\t((unsigned *)p.p[1])[threadIdx.x] = r[0];\n"
    "}\n"
    "extern \"C\" __global__ void k_cp_nowait(const struct bufs p)\n"
    "{\n"
    "\t__shared__ __align__(16) unsigned s[64];\n"
    "\tej_cp_async16(s + threadIdx.x * 4, (const unsigned *)p.p[0] +\n"
    "\t\t      threadIdx.x * 4, 16);\n"
    "\tej_cp_async_commit();\n"
    "}\n";

static const char *const emu_kernels[] = { "k_mma",	  "k_ldm",
					   "k_cp",	  "k_mma_missing",
					   "k_cp_nowait", "k_ldm_bad" };
#define N_EMU 6

/* A [16][16] and B [16][8] small integers (exact in bf16 and their
 * products' sums exact in f32), C [16][8]; fragments per the PTX ISA's
 * m16n8k16 tables (groupID g = lane >> 2, threadID_in_group t = lane % 4). */
START_TEST(test_mma_layout)
{
	epj_ctx *ctx = tu_ctx();
	void *m = module_of(ctx, emu_src, emu_kernels, N_EMU);
	double A[16][16], B[16][8], C[16][8];
	for (int i = 0; i < 16; i++)
		for (int k = 0; k < 16; k++)
			A[i][k] = (double)tu_randint(-8, 9);
	for (int k = 0; k < 16; k++)
		for (int j = 0; j < 8; j++)
			B[k][j] = (double)tu_randint(-8, 9);
	for (int i = 0; i < 16; i++)
		for (int j = 0; j < 8; j++)
			C[i][j] = (double)tu_randint(-50, 51) / 4;
	unsigned af[32][4], bfr[32][2];
	float cf[32][4], df[32][4];
	for (int l = 0; l < 32; l++) {
		int g = l >> 2, t = l & 3;
		/* a0..a7 in pairs: a0,a1 row g cols 2t,2t+1; a2,a3 row g+8;
		 * a4,a5 row g cols +8; a6,a7 row g+8 cols +8 */
		for (int r = 0; r < 4; r++) {
			int row = g + (r & 1 ? 8 : 0),
			    col = 2 * t + (r & 2 ? 8 : 0);
			af[l][r] = (unsigned)bf(A[row][col]) |
				   (unsigned)bf(A[row][col + 1]) << 16;
		}
		/* b0,b1: rows 2t,2t+1, column g; b2,b3: rows 2t+8,2t+9 */
		for (int r = 0; r < 2; r++) {
			int k = 2 * t + 8 * r;
			bfr[l][r] = (unsigned)bf(B[k][g]) |
				    (unsigned)bf(B[k + 1][g]) << 16;
		}
		/* c0,c1: row g cols 2t,2t+1; c2,c3: row g+8 */
		for (int i = 0; i < 4; i++)
			cf[l][i] =
			    (float)C[g + (i >= 2 ? 8 : 0)][2 * t + (i & 1)];
	}
	bufs b = { { af, bfr, cf, df } };
	ck_assert_msg(launch(ctx, m, "k_mma", 32, &b, df, sizeof df) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	for (int l = 0; l < 32; l++)
		for (int i = 0; i < 4; i++) {
			int row = (l >> 2) + (i >= 2 ? 8 : 0);
			int col = 2 * (l & 3) + (i & 1);
			double want = C[row][col];
			for (int k = 0; k < 16; k++)
				want += A[row][k] * B[k][col];
			ck_assert_msg(
			    df[l][i] == want,
			    "lane %d d%d (row %d col %d): %g, want %g", l, i,
			    row, col, df[l][i], want);
		}
	/* a lane that left is named, not waited for */
	float o[32];
	b.p[0] = o;
	epj_status st = launch(ctx, m, "k_mma_missing", 32, &b, NULL, 0);
	ck_assert_int_eq(st, EPJ_ERR_BACKEND);
	tu_assert_ctx_error(ctx, EPJ_ERR_BACKEND,
			    TU_STRS("k_mma_missing", "mma.sync", "lane 31"));
	/* a warp of 16 threads has no lanes 16..31 */
	st = launch(ctx, m, "k_mma_missing", 16, &b, NULL, 0);
	tu_assert_ctx_error(ctx, EPJ_ERR_BACKEND,
			    TU_STRS("mma.sync", "does not exist"));
	ej_device_sim.unload(NULL, m);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_ldmatrix)
{
	epj_ctx *ctx = tu_ctx();
	void *m = module_of(ctx, emu_src, emu_kernels, N_EMU);
	uint16_t mat[4][8][8];
	for (int j = 0; j < 4; j++)
		for (int r = 0; r < 8; r++)
			for (int c = 0; c < 8; c++)
				mat[j][r][c] = (uint16_t)tu_randint(0, 65536);
	unsigned r[32][4], t[32][4];
	bufs b = { { mat, r, t, NULL } };
	ck_assert_msg(launch(ctx, m, "k_ldm", 32, &b, NULL, 0) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	/* row q of matrix j is the row lane 8j + q points at: stored row
	 * q ^ 5 */
	for (int l = 0; l < 32; l++) {
		int g = l >> 2, q = l & 3;
		for (int j = 0; j < 4; j++) {
			unsigned want = mat[j][g ^ 5][2 * q] |
					(unsigned)mat[j][g ^ 5][2 * q + 1]
					    << 16;
			unsigned wt = mat[j][(2 * q) ^ 5][g] |
				      (unsigned)mat[j][(2 * q + 1) ^ 5][g]
					  << 16;
			ck_assert_msg(r[l][j] == want,
				      "lane %d reg %d: %08x want %08x", l, j,
				      r[l][j], want);
			ck_assert_msg(t[l][j] == wt,
				      "trans lane %d reg %d: %08x want %08x", l,
				      j, t[l][j], wt);
		}
	}
	/* row addresses off 16-byte alignment, or outside shared memory */
	unsigned o[32];
	bufs bad = { { NULL, o, NULL, NULL } };
	ck_assert_int_eq(launch(ctx, m, "k_ldm_bad", 32, &bad, NULL, 0),
			 EPJ_ERR_BACKEND);
	tu_assert_ctx_error(ctx, EPJ_ERR_BACKEND,
			    TU_STRS("k_ldm_bad", "ldmatrix",
				    "not 16-byte aligned shared memory"));
	bad.p[0] = mat;
	ck_assert_int_eq(launch(ctx, m, "k_ldm_bad", 32, &bad, NULL, 0),
			 EPJ_ERR_BACKEND);
	tu_assert_ctx_error(ctx, EPJ_ERR_BACKEND,
			    TU_STRS("ldmatrix", "shared memory"));
	ej_device_sim.unload(NULL, m);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_cp_async)
{
	epj_ctx *ctx = tu_ctx();
	void *m = module_of(ctx, emu_src, emu_kernels, N_EMU);
	uint32_t src[64], o[5 * 64];
	for (int i = 0; i < 64; i++)
		src[i] = (uint32_t)tu_randint(8, 1 << 30);
	bufs b = { { src, o, NULL, NULL } };
	ck_assert_msg(launch(ctx, m, "k_cp", 16, &b, o, sizeof o) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	for (int i = 0; i < 64; i++) {
		/* before any wait: the old contents */
		ck_assert_uint_eq(o[i], 7u);
		/* wait_group 1: the first group landed, the second not */
		ck_assert_uint_eq(o[64 + i], src[i]);
		ck_assert_uint_eq(o[128 + i], 7u);
		/* wait_group 0: all; 6 of 16 bytes read, the rest zero */
		ck_assert_uint_eq(o[192 + i], src[i]);
		uint32_t want = (i & 3) == 0   ? src[i]
				: (i & 3) == 1 ? src[i] & 0xffffu
					       : 0u;
		ck_assert_uint_eq(o[256 + i], want);
	}
	/* copies never waited for are a bug the launch reports */
	epj_status st = launch(ctx, m, "k_cp_nowait", 16, &b, NULL, 0);
	ck_assert_int_eq(st, EPJ_ERR_BACKEND);
	tu_assert_ctx_error(
	    ctx, EPJ_ERR_BACKEND,
	    TU_STRS("k_cp_nowait", "cp.async", "cp.async.wait_group"));
	ej_device_sim.unload(NULL, m);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- GEMM against a double reference -------------------------------------
 */

typedef struct gcase {
	epj_dtype dt, odt;
	int64_t m, n, k;
	bool ta, tb;
	int pad_a, pad_b, pad_c; /* extra leading-dimension elements */
	int nb0, nb1;
	bool bcast_b; /* B shared by the outer batches (sb0 = 0) */
	int bias;     /* 0 none, else its dtype: 1 f32 / input, 2 bf16 */
	int res;      /* likewise */
	ej_gemm_act act;
	bool res_in_c; /* the residual is C itself (res must be 0) */
} gcase;

static size_t esize(epj_dtype dt)
{
	return dt == EPJ_DTYPE_BF16 ? 2 : dt == EPJ_DTYPE_F32 ? 4 : 8;
}

/* n random values of dtype dt; vals gets them as read back. */
static void *rand_buf(epj_dtype dt, int64_t n, double *vals)
{
	void *p =
	    aligned_alloc(64, ((size_t)n * esize(dt) + 63) / 64 * 64 + 64);
	ck_assert_ptr_nonnull(p);
	for (int64_t i = 0; i < n; i++) {
		double v = tu_uniform(-1, 1);
		if (dt == EPJ_DTYPE_BF16) {
			((uint16_t *)p)[i] = bf(v);
			vals[i] = unbf(((uint16_t *)p)[i]);
		} else if (dt == EPJ_DTYPE_F32) {
			((float *)p)[i] = (float)v;
			vals[i] = (float)v;
		} else {
			((double *)p)[i] = v;
			vals[i] = v;
		}
	}
	return p;
}

static double get(const void *p, epj_dtype dt, int64_t i)
{
	return dt == EPJ_DTYPE_BF16  ? unbf(((const uint16_t *)p)[i])
	       : dt == EPJ_DTYPE_F32 ? ((const float *)p)[i]
				     : ((const double *)p)[i];
}

static double act_ref(double v, ej_gemm_act act)
{
	return act == EJ_GEMM_ACT_SILU	 ? v / (1 + exp(-v))
	       : act == EJ_GEMM_ACT_GELU ? 0.5 * v * (1 + erf(v / sqrt(2.0)))
					 : v;
}

static double in_tol(epj_dtype dt)
{
	return dt == EPJ_DTYPE_BF16 ? 1e-3 : dt == EPJ_DTYPE_F32 ? 1e-5 : 1e-12;
}

static double out_tol(epj_dtype odt)
{
	return odt == EPJ_DTYPE_BF16 ? 1.0 / 256 : 0;
}

static epj_dtype epi_dt(const gcase *g, int which)
{
	return g->dt == EPJ_DTYPE_BF16 && which == 2 ? EPJ_DTYPE_BF16
	       : g->dt == EPJ_DTYPE_BF16	     ? EPJ_DTYPE_F32
						     : g->dt;
}

static void run_case(epj_ctx *ctx, const gcase *g)
{
	int64_t M = g->m, N = g->n, K = g->k;
	int64_t nbat = (int64_t)g->nb0 * g->nb1;
	int64_t lda = (g->ta ? M : K) + g->pad_a;
	int64_t ldb = (g->tb ? K : N) + g->pad_b;
	int64_t ldc = N + g->pad_c;
	int64_t sa = (g->ta ? K : M) * lda, sb = (g->tb ? N : K) * ldb;
	int64_t sc = M * ldc;
	int64_t nbb = g->bcast_b ? g->nb1 : nbat;
	double *va = malloc(sizeof(double) * (size_t)(sa * nbat + 1));
	double *vb = malloc(sizeof(double) * (size_t)(sb * nbb + 1));
	double *vbias = malloc(sizeof(double) * (size_t)(N * g->nb0 + 1));
	double *vres = malloc(sizeof(double) * (size_t)(sc * nbat + 1));
	void *A = rand_buf(g->dt, sa * nbat, va);
	void *B = rand_buf(g->dt, sb * nbb, vb);
	epj_dtype bdt = epi_dt(g, g->bias), rdt = epi_dt(g, g->res);
	void *bias = g->bias ? rand_buf(bdt, N * g->nb0, vbias) : NULL;
	void *res = g->res ? rand_buf(rdt, sc * nbat, vres) : NULL;
	size_t cs = esize(g->odt);
	unsigned char *C = malloc((size_t)(sc * nbat) * cs + 1);
	memset(C, 0x5a, (size_t)(sc * nbat) * cs); /* gaps must keep it */
	if (g->res_in_c) {
		free(C);
		C = rand_buf(g->odt, sc * nbat, vres);
		res = C;
		rdt = g->odt;
	}

	ej_gemm_desc d;
	ej_gemm_desc_init(&d, g->dt, M, N, K);
	d.out_dtype = g->odt;
	ej_gemm_set_a(&d, A, lda, g->ta);
	ej_gemm_set_b(&d, B, ldb, g->tb);
	d.c = C;
	d.ldc = ldc;
	d.nb0 = g->nb0;
	d.nb1 = g->nb1;
	d.sa1 = sa;
	d.sa0 = sa * g->nb1;
	d.sb1 = sb;
	d.sb0 = g->bcast_b ? 0 : sb * g->nb1;
	d.sc1 = sc;
	d.sc0 = sc * g->nb1;
	if (bias) {
		d.bias = bias;
		d.bias_dtype = bdt;
		d.sbias = N;
	}
	if (res) {
		d.res = res;
		d.res_dtype = rdt;
		d.ldr = ldc;
		d.sr1 = sc;
		d.sr0 = sc * g->nb1;
	}
	d.act = g->act;
	epj_status st = ej_gemm(ctx, "cuda-sim", &d);
	ck_assert_msg(st == EPJ_OK, "%s", epj_ctx_error(ctx));

	for (int64_t z0 = 0; z0 < g->nb0; z0++)
		for (int64_t z1 = 0; z1 < g->nb1; z1++) {
			int64_t z = z0 * g->nb1 + z1;
			const double *a = va + z * sa;
			const double *b = vb + (g->bcast_b ? z1 : z) * sb;
			for (int64_t i = 0; i < M; i++)
				for (int64_t j = 0; j < ldc; j++) {
					int64_t ci = z * sc + i * ldc + j;
					if (j >= N) {
						for (size_t e = 0; e < cs; e++)
							tu_assert(
							    C[ci * (int64_t)cs +
							      (int64_t)e] ==
							    0x5a);
						continue;
					}
					double acc = 0, mag = 0;
					for (int64_t p = 0; p < K; p++) {
						double x =
						    a[g->ta ? p * lda + i
							    : i * lda + p];
						double y =
						    b[g->tb ? j * ldb + p
							    : p * ldb + j];
						acc += x * y;
						mag += fabs(x * y);
					}
					double v = acc;
					if (bias) {
						v += vbias[z0 * N + j];
						mag += fabs(vbias[z0 * N + j]);
					}
					v = act_ref(v, g->act);
					mag *= 1.2; /* |act'| <= 1.13 */
					if (res) {
						v += vres[ci];
						mag += fabs(vres[ci]);
					}
					double got = get(C, g->odt, ci);
					double tol = in_tol(g->dt) * mag +
						     out_tol(g->odt) * fabs(v) +
						     1e-30;
					if (!(fabs(got - v) <= tol))
						ck_abort_msg(
						    "%s->%s m=%lld n=%lld "
						    "k=%lld ta=%d tb=%d "
						    "batch (%lld,%lld) "
						    "C[%lld,%lld] = %.9g, "
						    "want %.9g (tol %.3g; seed "
						    "%llu)",
						    epj_dtype_name(g->dt),
						    epj_dtype_name(g->odt),
						    (long long)M, (long long)N,
						    (long long)K, g->ta, g->tb,
						    (long long)z0,
						    (long long)z1, (long long)i,
						    (long long)j, got, v, tol,
						    (unsigned long long)
							tu_seed());
				}
		}
	free(va);
	free(vb);
	free(vbias);
	free(vres);
	free(A);
	free(B);
	free(bias);
	if (!g->res_in_c)
		free(res);
	free(C);
}

static const int64_t odd[] = { 1, 7, 17, 33, 65, 70 };

static int64_t pick(void)
{
	return odd[tu_randint(0, 6)];
}

/* The bf16 kernel: each transpose pair, with aligned leading dimensions
 * (cp.async tiles) and odd ones (element loads), at odd sizes. */
START_TEST(test_bf16_transposes)
{
	epj_ctx *ctx = tu_ctx();
	static const int64_t ks[] = { 1, 17, 33, 70 };
	for (int tr = 0; tr < 4; tr++)
		for (int vec = 0; vec < 2; vec++) {
			gcase g = { .dt = EPJ_DTYPE_BF16,
				    .odt = EPJ_DTYPE_F32,
				    .m = pick(),
				    .n = pick(),
				    .k = ks[tu_randint(0, 4)],
				    .ta = tr & 1,
				    .tb = tr >> 1,
				    .nb0 = 1,
				    .nb1 = 1 };
			/* vec: round leading dims up to 8 elements */
			int64_t la = g.ta ? g.m : g.k, lb = g.tb ? g.k : g.n;
			g.pad_a = vec ? (int)((8 - la % 8) % 8) + 8
				      : (la % 8 ? 0 : 1);
			g.pad_b =
			    vec ? (int)((8 - lb % 8) % 8) : (lb % 8 ? 0 : 3);
			run_case(ctx, &g);
		}
	/* the residual read from C itself, in place; K = 0 (the epilogue
	 * alone) */
	gcase gi = { .dt = EPJ_DTYPE_BF16,
		     .odt = EPJ_DTYPE_BF16,
		     .m = 33,
		     .n = 17,
		     .k = 33,
		     .nb0 = 1,
		     .nb1 = 2,
		     .bias = 1,
		     .act = EJ_GEMM_ACT_GELU,
		     .res_in_c = true };
	run_case(ctx, &gi);
	gi.k = 0;
	gi.odt = EPJ_DTYPE_F32;
	run_case(ctx, &gi);
	gi.dt = gi.odt = EPJ_DTYPE_F64;
	gi.k = 7;
	run_case(ctx, &gi);
	gi.k = 0;
	run_case(ctx, &gi);
	/* the sizes the issue names, K a multiple of 32 once (no tail) */
	gcase g = { .dt = EPJ_DTYPE_BF16,
		    .odt = EPJ_DTYPE_F32,
		    .m = 65,
		    .n = 33,
		    .k = 64,
		    .nb0 = 1,
		    .nb1 = 1 };
	run_case(ctx, &g);
	g.m = 1;
	g.n = 70;
	g.k = 7;
	g.tb = true;
	run_case(ctx, &g);
	epj_ctx_free(ctx);
}
END_TEST

/* Batches (2 x 3 and broadcast B), bf16 output, every epilogue. */
START_TEST(test_bf16_batched_epilogue)
{
	epj_ctx *ctx = tu_ctx();
	static const ej_gemm_act acts[] = { EJ_GEMM_ACT_NONE, EJ_GEMM_ACT_SILU,
					    EJ_GEMM_ACT_GELU };
	for (int v = 0; v < 6; v++) {
		gcase g = { .dt = EPJ_DTYPE_BF16,
			    .odt = v & 1 ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32,
			    .m = odd[tu_randint(1, 5)],
			    .n = odd[tu_randint(1, 5)],
			    .k = odd[tu_randint(1, 6)],
			    .ta = tu_randint(0, 2),
			    .tb = tu_randint(0, 2),
			    .pad_a = (int)tu_randint(0, 2) * 8,
			    .pad_c = v == 5 ? 3 : 0,
			    .nb0 = v < 2 ? 1 : 2,
			    .nb1 = v < 2 ? 3 : 2,
			    .bcast_b = v == 3,
			    .bias = v % 3,
			    .res = (v + 1) % 3,
			    .act = acts[v % 3] };
		run_case(ctx, &g);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* The f32 and f64 kernels: transposes, batches, epilogue. */
START_TEST(test_simt)
{
	epj_ctx *ctx = tu_ctx();
	for (int v = 0; v < 8; v++) {
		epj_dtype dt = v & 1 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
		gcase g = { .dt = dt,
			    .odt = dt,
			    .m = pick(),
			    .n = pick(),
			    .k = odd[tu_randint(0, 5)],
			    .ta = (v >> 1) & 1,
			    .tb = (v >> 2) & 1,
			    .pad_a = (int)tu_randint(0, 3),
			    .pad_b = (int)tu_randint(0, 3),
			    .nb0 = v >= 4 ? 2 : 1,
			    .nb1 = v >= 6 ? 2 : 1,
			    .bias = v % 2,
			    .res = v >= 4,
			    .act = (ej_gemm_act)(v % 3) };
		run_case(ctx, &g);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Grouped: groups of rows (some empty) with their own B and bias. */
static void run_grouped(epj_ctx *ctx, epj_dtype dt, bool tb)
{
	int G = 5;
	int64_t rows[5] = { tu_randint(1, 40), 0, tu_randint(60, 90), 0,
			    tu_randint(1, 8) };
	int64_t off[6] = { 0 };
	for (int gi = 0; gi < G; gi++)
		off[gi + 1] = off[gi] + rows[gi];
	int64_t M = off[G], N = odd[tu_randint(1, 5)],
		K = odd[tu_randint(0, 5)];
	int64_t ldb = tb ? K : N, sb = tb ? N * K : K * N;
	double *va = malloc(sizeof(double) * (size_t)(M * K));
	double *vb = malloc(sizeof(double) * (size_t)(sb * G));
	double *vbias = malloc(sizeof(double) * (size_t)(N * G));
	void *A = rand_buf(dt, M * K, va);
	void *B = rand_buf(dt, sb * G, vb);
	epj_dtype bdt = dt == EPJ_DTYPE_BF16 ? EPJ_DTYPE_F32 : dt;
	void *bias = rand_buf(bdt, N * G, vbias);
	epj_dtype odt = dt == EPJ_DTYPE_BF16 ? EPJ_DTYPE_BF16 : dt;
	void *C = malloc((size_t)(M * N) * esize(odt));
	ej_gemm_desc d;
	ej_gemm_desc_init(&d, dt, M, N, K);
	d.out_dtype = odt;
	ej_gemm_set_a(&d, A, K, false);
	ej_gemm_set_b(&d, B, ldb, tb);
	d.c = C;
	d.sb0 = sb;
	d.bias = bias;
	d.bias_dtype = bdt;
	d.sbias = N;
	d.act = EJ_GEMM_ACT_SILU;
	d.group_off = off;
	d.groups = G;
	epj_status st = ej_gemm(ctx, "cuda-sim", &d);
	ck_assert_msg(st == EPJ_OK, "%s", epj_ctx_error(ctx));
	for (int gi = 0; gi < G; gi++)
		for (int64_t i = off[gi]; i < off[gi + 1]; i++)
			for (int64_t j = 0; j < N; j++) {
				double acc = vbias[gi * N + j], mag = fabs(acc);
				for (int64_t p = 0; p < K; p++) {
					double y =
					    vb[gi * sb +
					       (tb ? j * K + p : p * N + j)];
					acc += va[i * K + p] * y;
					mag += fabs(va[i * K + p] * y);
				}
				double v = act_ref(acc, EJ_GEMM_ACT_SILU);
				double got = get(C, odt, i * N + j);
				double tol = 1.2 * in_tol(dt) * mag +
					     out_tol(odt) * fabs(v) + 1e-30;
				if (!(fabs(got - v) <= tol))
					ck_abort_msg(
					    "grouped %s group %d row %lld "
					    "col %lld: %.9g want %.9g",
					    epj_dtype_name(dt), gi,
					    (long long)i, (long long)j, got, v);
			}
	/* a bad table is refused */
	d.groups = 0;
	ck_assert_int_eq(ej_gemm(ctx, "cuda-sim", &d), EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID, TU_STRS("grouped"));
	free(va);
	free(vb);
	free(vbias);
	free(A);
	free(B);
	free(bias);
	free(C);
}

START_TEST(test_grouped)
{
	epj_ctx *ctx = tu_ctx();
	run_grouped(ctx, EPJ_DTYPE_BF16, true);
	run_grouped(ctx, EPJ_DTYPE_BF16, false);
	run_grouped(ctx, EPJ_DTYPE_F32, true);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	float a[4], b[4], c[4];
	ej_gemm_desc d;
	ej_gemm_desc_init(&d, EPJ_DTYPE_I32, 2, 2, 2);
	ej_gemm_set_a(&d, a, 2, false);
	ej_gemm_set_b(&d, b, 2, false);
	d.c = c;
	ck_assert_int_eq(ej_gemm(ctx, "cuda-sim", &d), EPJ_ERR_DTYPE);
	tu_assert_ctx_error(ctx, EPJ_ERR_DTYPE, TU_STRS("i32"));
	ej_gemm_desc_init(&d, EPJ_DTYPE_F32, 2, 2, 2);
	ej_gemm_set_a(&d, a, 2, false);
	ej_gemm_set_b(&d, b, 2, false);
	d.c = c;
	d.out_dtype = EPJ_DTYPE_BF16;
	ck_assert_int_eq(ej_gemm(ctx, "cuda-sim", &d), EPJ_ERR_DTYPE);
	tu_assert_ctx_error(ctx, EPJ_ERR_DTYPE, TU_STRS("f32", "bf16"));
	d.out_dtype = EPJ_DTYPE_F32;
	d.ldc = 1;
	ck_assert_int_eq(ej_gemm(ctx, "cuda-sim", &d), EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID, TU_STRS("ldc 1 < n 2"));
	d.ldc = 2;
	d.m = -1;
	ck_assert_int_eq(ej_gemm(ctx, "cuda-sim", &d), EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID, TU_STRS("m=-1"));
	d.m = 2;
	ck_assert_int_eq(ej_gemm(ctx, "cpu", &d), EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID, TU_STRS("runs no CUDA C"));
	epj_ctx_free(ctx);
}
END_TEST

/* ---- adapters against the CPU ops ----------------------------------------
 */

/* t's values in a new tensor of ctx (contiguous) */
static epj_tensor *on(epj_ctx *ctx, epj_ctx *src_ctx, epj_tensor *t)
{
	int64_t n = epj_tensor_numel(t);
	double *v = malloc(sizeof(double) * (size_t)(n + 1));
	ck_assert_int_eq(epj_tensor_to_f64(src_ctx, t, v), EPJ_OK);
	epj_tensor *r = epj_zeros(ctx, epj_tensor_dtype(t), epj_tensor_ndim(t),
				  epj_tensor_shape(t));
	tu_ok(ctx, r);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, r, v), EPJ_OK);
	free(v);
	return r;
}

static double rtol_of(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64    ? 1e-12
	       : dt == EPJ_DTYPE_BF16 ? 1.0 / 128
				      : 1e-5;
}
static double atol_of(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? 1e-12 : dt == EPJ_DTYPE_BF16 ? 2e-2 : 1e-5;
}

/* Runs op on sim (adapter) and cpu (op table) with the same inputs (made
 * on cpu: views by `view`) and compares. */
typedef epj_tensor *(*view_fn)(epj_ctx *ctx, epj_tensor *t, int which);

static epj_tensor *transpose_last(epj_ctx *ctx, epj_tensor *t)
{
	int nd = epj_tensor_ndim(t);
	epj_tensor *r = epj_transpose(ctx, t, nd - 2, nd - 1);
	tu_ok(ctx, r);
	return r;
}

static void check_op(epj_ctx *cpu, epj_ctx *sim, int op, epj_tensor **in_cpu,
		     epj_tensor **in_sim, int n_in, const char *what)
{
	epj_tensor *want = op == EJ_OP_MATMUL
			       ? epj_matmul(cpu, in_cpu[0], in_cpu[1])
			       : epj_linear(cpu, in_cpu[0], in_cpu[1],
					    n_in == 3 ? in_cpu[2] : NULL);
	tu_ok(cpu, want);
	epj_tensor *out =
	    epj_zeros(sim, epj_tensor_dtype(want), epj_tensor_ndim(want),
		      epj_tensor_shape(want));
	tu_ok(sim, out);
	ej_attrs at = ej_attrs_none();
	ej_call c = { .op = op,
		      .attrs = &at,
		      .in = in_sim,
		      .n_in = n_in,
		      .out = &out,
		      .n_out = 1 };
	epj_status st = op == EJ_OP_MATMUL ? ej_cuda_op_matmul(sim, &c)
					   : ej_cuda_op_linear(sim, &c);
	ck_assert_msg(st == EPJ_OK, "%s: %s", what, epj_ctx_error(sim));
	int64_t n = epj_tensor_numel(want);
	double *ref = malloc(sizeof(double) * (size_t)(n + 1));
	ck_assert_int_eq(epj_tensor_to_f64(cpu, want, ref), EPJ_OK);
	epj_dtype dt = epj_tensor_dtype(want);
	tu_assert_close(sim, out, ref, rtol_of(dt), atol_of(dt), what);
	free(ref);
	epj_tensor_free(want);
	epj_tensor_free(out);
}

START_TEST(test_adapter_matmul)
{
	epj_ctx *cpu = tu_ctx(), *sim = NULL;
	ck_assert_int_eq(epj_ctx_new("cuda-sim", &sim), EPJ_OK);
	static const epj_dtype dts[] = { EPJ_DTYPE_BF16, EPJ_DTYPE_F32,
					 EPJ_DTYPE_F64 };
	for (int di = 0; di < 3; di++) {
		epj_dtype dt = dts[di];
		/* a [2, 3, M, K] @ b [3, K, N] (b broadcast over dim 0); then
		 * a^T views and b [K, N] shared by every batch */
		int64_t M = odd[tu_randint(1, 4)], N = odd[tu_randint(0, 5)],
			K = odd[tu_randint(1, 5)];
		int64_t ash[4] = { 2, 3, M, K }, bsh[3] = { 3, K, N };
		epj_tensor *a = tu_randn(cpu, dt, 4, ash);
		epj_tensor *b = tu_randn(cpu, dt, 3, bsh);
		epj_tensor *ic[2] = { a, b };
		epj_tensor *is[2] = { on(sim, cpu, a), on(sim, cpu, b) };
		check_op(cpu, sim, EJ_OP_MATMUL, ic, is, 2, "matmul batched");
		/* transposed views: a^T^T etc. stored the other way round */
		int64_t ash2[3] = { 2, K, M }, bsh2[2] = { N, K };
		epj_tensor *a2 = tu_randn(cpu, dt, 3, ash2);
		epj_tensor *b2 = tu_randn(cpu, dt, 2, bsh2);
		epj_tensor *a2s = on(sim, cpu, a2), *b2s = on(sim, cpu, b2);
		epj_tensor *ic2[2] = { transpose_last(cpu, a2),
				       transpose_last(cpu, b2) };
		epj_tensor *is2[2] = { transpose_last(sim, a2s),
				       transpose_last(sim, b2s) };
		check_op(cpu, sim, EJ_OP_MATMUL, ic2, is2, 2,
			 "matmul transposed views");
		/* non-contiguous (strided copies) */
		epj_tensor *ic3[2] = { tu_noncontig(cpu, a),
				       tu_noncontig(cpu, b) };
		epj_tensor *is3[2] = { tu_noncontig(sim, is[0]),
				       tu_noncontig(sim, is[1]) };
		tu_ok(sim, is3[0]);
		tu_ok(sim, is3[1]);
		check_op(cpu, sim, EJ_OP_MATMUL, ic3, is3, 2,
			 "matmul non-contiguous");
		for (int i = 0; i < 2; i++) {
			epj_tensor_free(is[i]);
			epj_tensor_free(ic2[i]);
			epj_tensor_free(is2[i]);
			epj_tensor_free(ic3[i]);
			epj_tensor_free(is3[i]);
		}
		epj_tensor_free(a);
		epj_tensor_free(b);
		epj_tensor_free(a2);
		epj_tensor_free(b2);
		epj_tensor_free(a2s);
		epj_tensor_free(b2s);
	}
	/* three batch dims that do not merge (b broadcast in the middle
	 * one): the outer one is launched per index */
	int64_t ash[5] = { 2, 3, 2, odd[tu_randint(0, 4)], 17 },
		bsh[4] = { 3, 1, 17, 7 };
	epj_tensor *a = tu_randn(cpu, EPJ_DTYPE_F32, 5, ash);
	epj_tensor *b = tu_randn(cpu, EPJ_DTYPE_F32, 4, bsh);
	epj_tensor *ic[2] = { a, b };
	epj_tensor *is[2] = { on(sim, cpu, a), on(sim, cpu, b) };
	check_op(cpu, sim, EJ_OP_MATMUL, ic, is, 2, "matmul 3 batch dims");
	epj_tensor_free(is[0]);
	epj_tensor_free(is[1]);
	epj_tensor_free(a);
	epj_tensor_free(b);
	epj_ctx_free(sim);
	epj_ctx_free(cpu);
}
END_TEST

START_TEST(test_adapter_linear)
{
	epj_ctx *cpu = tu_ctx(), *sim = NULL;
	ck_assert_int_eq(epj_ctx_new("cuda-sim", &sim), EPJ_OK);
	static const epj_dtype dts[] = { EPJ_DTYPE_BF16, EPJ_DTYPE_F32,
					 EPJ_DTYPE_F64 };
	for (int di = 0; di < 3; di++) {
		epj_dtype dt = dts[di];
		int64_t T = odd[tu_randint(0, 4)], fin = odd[tu_randint(1, 5)],
			fout = odd[tu_randint(1, 5)];
		int64_t xsh[3] = { 2, T, fin }, wsh[2] = { fout, fin },
			bsh[1] = { fout };
		epj_tensor *x = tu_randn(cpu, dt, 3, xsh);
		epj_tensor *w = tu_randn(cpu, dt, 2, wsh);
		epj_tensor *bias = tu_randn(cpu, dt, 1, bsh);
		epj_tensor *ic[3] = { x, w, bias };
		epj_tensor *is[3] = { on(sim, cpu, x), on(sim, cpu, w),
				      on(sim, cpu, bias) };
		check_op(cpu, sim, EJ_OP_LINEAR, ic, is, 3, "linear + bias");
		check_op(cpu, sim, EJ_OP_LINEAR, ic, is, 2, "linear");
		/* strided x (rows do not merge) and w */
		epj_tensor *ic2[3] = { tu_noncontig(cpu, x),
				       tu_noncontig(cpu, w), bias };
		epj_tensor *is2[3] = { tu_noncontig(sim, is[0]),
				       tu_noncontig(sim, is[1]), is[2] };
		tu_ok(sim, is2[0]);
		tu_ok(sim, is2[1]);
		check_op(cpu, sim, EJ_OP_LINEAR, ic2, is2, 3,
			 "linear non-contiguous");
		/* 1-D x */
		int64_t x1sh[1] = { fin };
		epj_tensor *x1 = tu_randn(cpu, dt, 1, x1sh);
		epj_tensor *ic3[2] = { x1, w };
		epj_tensor *is3[2] = { on(sim, cpu, x1), is[1] };
		check_op(cpu, sim, EJ_OP_LINEAR, ic3, is3, 2, "linear 1-D");
		for (int i = 0; i < 3; i++)
			epj_tensor_free(is[i]);
		for (int i = 0; i < 2; i++) {
			epj_tensor_free(ic2[i]);
			epj_tensor_free(is2[i]);
		}
		epj_tensor_free(is3[0]);
		epj_tensor_free(x1);
		epj_tensor_free(x);
		epj_tensor_free(w);
		epj_tensor_free(bias);
	}
	epj_ctx_free(sim);
	epj_ctx_free(cpu);
}
END_TEST

Suite *make_tmpl_gemm_suite(void)
{
	Suite *s = suite_create("tmpl_gemm");
	TCase *te = tcase_create("emulation");
	tcase_add_checked_fixture(te, cache_setup, cache_teardown);
	tcase_set_timeout(te, 300);
	tcase_add_test(te, test_mma_layout);
	tcase_add_test(te, test_ldmatrix);
	tcase_add_test(te, test_cp_async);
	suite_add_tcase(s, te);
	TCase *tc = tcase_create("gemm");
	/* one cache for the case: the first test compiles the module */
	tcase_add_unchecked_fixture(tc, cache_setup, cache_teardown);
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_bf16_transposes);
	tcase_add_test(tc, test_bf16_batched_epilogue);
	tcase_add_test(tc, test_simt);
	tcase_add_test(tc, test_grouped);
	tcase_add_test(tc, test_errors);
	tcase_add_test(tc, test_adapter_matmul);
	tcase_add_test(tc, test_adapter_linear);
	suite_add_tcase(s, tc);
	return s;
}
