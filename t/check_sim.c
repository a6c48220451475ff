/* check_sim.c -- the cuda-sim device: the simulator's CUDA semantics
 * against hand-computed expectations, its bug reports (each proven by a
 * small deliberately buggy kernel), and the CUDA C that print_cuda.c emits
 * for compiled graphs executed on cuda-sim against the C backend and the
 * interpreter (CPU reference kernels) at odd sizes, f32, f64 and bf16, with
 * the race check and poisoned outputs on (the device's defaults).
 *
 * Each test gets a private kernel cache directory.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cc.h"
#include "jit_impl.h"
#include "kcache.h"
#include "kir.h"

static char *cache_dir;

static void cache_setup(void)
{
	cache_dir = tu_tmpdir_new("sim");
	setenv("EPJIT_CACHE_DIR", cache_dir, 1);
	unsetenv("EPJIT_SIM_RACECHECK");
	unsetenv("EPJIT_SIM_POISON");
}

static void cache_teardown(void)
{
	tu_tmpdir_free(cache_dir);
	cache_dir = NULL;
}

/* ---- hand-written kernels ------------------------------------------------ */

typedef struct bufs {
	void *p[4];
} bufs;

/* One module from src with kernels k[0..n) taking `struct bufs`. */
static void *module_of(epj_ctx *ctx, const char *src, const char *const *k,
		       int n)
{
	const char *ty[16];
	ck_assert(n <= 16);
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

/* Launches kernel k of m over grid x block (x only) with smem bytes; outs
 * are checked (poison, race) with element size 4. */
static epj_status launch(epj_ctx *ctx, void *m, const char *k, unsigned grid,
			 unsigned bx, unsigned by, size_t smem, bufs *b,
			 const size_t *out_bytes, int n_out)
{
	void *fn = ej_device_sim.function(NULL, m, k);
	ck_assert_msg(fn != NULL, "no entry for %s", k);
	ej_launch_out lo[4];
	for (int i = 0; i < n_out; i++)
		lo[i] = (ej_launch_out){ b->p[i], out_bytes[i], 4 };
	ej_launch l = { .grid = { grid, 1, 1 },
			.block = { bx, by, 1 },
			.smem = smem,
			.args = b,
			.args_size = sizeof *b,
			.outs = lo,
			.n_out = n_out };
	return ej_device_sim.launch(NULL, ctx, fn, k, &l);
}

static const char sem_src[] =
    "extern \"C\" __global__ void k_warp(const struct bufs a)\n"
    "{\n"
    "\tint *o = (int *)a.p[0];\n"
    "\tint t = threadIdx.x + threadIdx.y * blockDim.x;\n"
    "\tint lane = t & 31;\n"
    "\tint v = t * 3 + 1;\n"
    "\tint *r = o + (blockIdx.x * blockDim.x * blockDim.y + t) * 12;\n"
    "\tr[0] = __shfl_sync(0xffffffffu, v, (lane + 5) & 31);\n"
    "\tr[1] = __shfl_up_sync(0xffffffffu, v, 3);\n"
    "\tr[2] = __shfl_down_sync(0xffffffffu, v, 5);\n"
    "\tr[3] = __shfl_xor_sync(0xffffffffu, v, 6);\n"
    "\tr[4] = __shfl_xor_sync(0xffffffffu, v, 3, 8);\n"
    "\tr[5] = __shfl_down_sync(0xffffffffu, v, 2, 16);\n"
    "\tr[6] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);\n"
    "\tr[7] = __any_sync(0xffffffffu, lane == 7);\n"
    "\tr[8] = __all_sync(0xffffffffu, lane < 31);\n"
    "\tr[9] = __shfl_sync(0xffffffffu, (float)v * 0.5f, 31 - lane) == "
    "(float)(t - lane + 31 - lane) * 1.5f + 0.5f;\n"
    "\tr[10] = -1;\n"
    "\tif (lane < 16)\n"
    "\t\tr[10] = __shfl_down_sync(0x0000ffffu, v, 1, 16);\n"
    "\t__syncwarp();\n"
    "\tr[11] = (int)__shfl_sync(0xffffffffu, (double)v, 0);\n"
    "}\n"
    /* a block sum through shared memory, 2-D blocks */
    "extern \"C\" __global__ void k_bar(const struct bufs a)\n"
    "{\n"
    "\t__shared__ float sh[256];\n"
    "\tconst float *in = (const float *)a.p[1];\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\tunsigned n = blockDim.x * blockDim.y;\n"
    "\tunsigned t = threadIdx.x + threadIdx.y * blockDim.x;\n"
    "\tsh[t] = in[blockIdx.x * n + t];\n"
    "\t__syncthreads();\n"
    "\tfor (unsigned s = n / 2; s > 0; s /= 2) {\n"
    "\t\tif (t < s)\n"
    "\t\t\tsh[t] += sh[t + s];\n"
    "\t\t__syncthreads();\n"
    "\t}\n"
    "\tif (t == 0)\n"
    "\t\to[blockIdx.x] = sh[0];\n"
    "}\n"
    /* dynamic shared memory: reverse through it */
    "extern \"C\" __global__ void k_dyn(const struct bufs a)\n"
    "{\n"
    "\tfloat *s = (float *)ej_dyn_smem();\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\tunsigned t = threadIdx.x, n = blockDim.x;\n"
    "\ts[t] = (float)(t * 2 + blockIdx.x);\n"
    "\t__syncthreads();\n"
    "\to[blockIdx.x * n + t] = s[n - 1 - t];\n"
    "}\n"
    /* atomics across blocks */
    "extern \"C\" __global__ void k_atomic(const struct bufs a)\n"
    "{\n"
    "\tint *o = (int *)a.p[0];\n"
    "\tatomicAdd(&o[0], 1);\n"
    "\tatomicMax(&o[1], (int)(blockIdx.x * 1000 + threadIdx.x));\n"
    "\tatomicAdd(&o[2], (int)threadIdx.x);\n"
    "\tatomicCAS(&o[3], 0, 7);\n"
    "}\n";

/* A cached module that passes the cache's checks but does not load (built
 * against another glibc, say, or imported) is dropped and rebuilt: the
 * build succeeds, cache.unloadable counts it, and the next build loads the
 * rebuilt entry. */
static void first_key(void *user, const char *key, int64_t bytes)
{
	(void)bytes;
	memcpy(user, key, 65);
}

START_TEST(test_unloadable_module)
{
	static const char src[] =
	    "extern \"C\" __global__ void k_set(const struct bufs a)\n"
	    "{ ((int *)a.p[0])[threadIdx.x] = (int)threadIdx.x * 7 + 3; }\n";
	const char *k[] = { "k_set" };
	for (int round = 0; round < 3; round++) {
		epj_ctx *ctx = tu_ctx();
		void *m = module_of(ctx, src, k, 1);
		int o[32];
		bufs b = { { o } };
		size_t bytes = sizeof o;
		ck_assert_int_eq(
		    launch(ctx, m, "k_set", 1, 32, 1, 0, &b, &bytes, 1),
		    EPJ_OK);
		for (int i = 0; i < 32; i++)
			ck_assert_int_eq(o[i], i * 7 + 3);
		ej_device_sim.unload(NULL, m);
		int64_t unl = epj_counter_get(ctx, "cache.unloadable");
		if (round == 0) {
			ck_assert_int_eq(unl, 0);
			/* plant bytes dlopen refuses through the cache's own
			 * put: a valid checksum */
			ej_kcache *c = ej_kcache_open(ctx, cache_dir);
			ck_assert_ptr_nonnull(c);
			char key[65] = "";
			ck_assert_int_eq(ej_kcache_list(c, first_key, key), 1);
			void *d = NULL;
			size_t n = 0;
			char *s = NULL;
			ck_assert_int_eq(
			    ej_kcache_get_with_source(c, key, &d, &n, &s),
			    EPJ_OK);
			unsigned char bad[4096];
			for (size_t i = 0; i < sizeof bad; i++)
				bad[i] = (unsigned char)tu_randint(0, 256);
			memcpy(bad, "\177ELF", 4);
			ck_assert_int_eq(
			    ej_kcache_put(c, key, bad, sizeof bad, s), EPJ_OK);
			free(d);
			free(s);
			ej_kcache_close(c);
		} else if (round == 1) {
			ck_assert_int_eq(unl, 1);
		} else {
			ck_assert_int_eq(unl, 0);
			ck_assert_int_eq(epj_counter_get(ctx, "cache.misses"),
					 0);
		}
		epj_ctx_free(ctx);
	}
}
END_TEST

START_TEST(test_warp_semantics)
{
	epj_ctx *ctx = tu_ctx();
	const char *k[] = { "k_warp", "k_bar", "k_dyn", "k_atomic" };
	void *m = module_of(ctx, sem_src, k, 4);
	/* k_warp: 2 blocks of 16 x 4 = 64 threads (two warps each) */
	unsigned bx = 16, by = 4, nb = 2, n = bx * by;
	size_t bytes = sizeof(int) * 12 * n * nb;
	int *o = malloc(bytes);
	bufs b = { { o } };
	ck_assert_int_eq(launch(ctx, m, "k_warp", nb, bx, by, 0, &b, &bytes, 1),
			 EPJ_OK);
	for (unsigned blk = 0; blk < nb; blk++)
		for (unsigned t = 0; t < n; t++) {
			const int *r = o + (blk * n + t) * 12;
			int lane = (int)(t & 31), base = (int)t - lane;
#define V(l) ((base + (l)) * 3 + 1)
			tu_assert(r[0] == V((lane + 5) & 31));
			tu_assert(r[1] == (lane >= 3 ? V(lane - 3) : V(lane)));
			tu_assert(r[2] ==
				  (lane + 5 < 32 ? V(lane + 5) : V(lane)));
			tu_assert(r[3] == V(lane ^ 6));
			tu_assert(r[4] == V(lane ^ 3));
			tu_assert(r[5] == ((lane & 15) + 2 < 16 ? V(lane + 2)
								: V(lane)));
			tu_assert((unsigned)r[6] == 0x49249249u);
			tu_assert(r[7] == 1 && r[8] == 0);
			tu_assert(r[9] == 1);
			tu_assert(r[10] == (lane < 15	 ? V(lane + 1)
					    : lane == 15 ? V(15)
							 : -1));
			tu_assert(r[11] == V(0));
#undef V
		}
	free(o);

	/* k_bar: sums of 7 blocks of 8 x 8 */
	nb = 7;
	n = 64;
	float *in = malloc(sizeof(float) * n * nb),
	      *s = malloc(sizeof(float) * nb);
	double ref[7] = { 0 };
	for (unsigned i = 0; i < n * nb; i++) {
		in[i] = (float)tu_randint(-50, 50);
		ref[i / n] += in[i];
	}
	b = (bufs){ { s, in } };
	bytes = sizeof(float) * nb;
	ck_assert_int_eq(launch(ctx, m, "k_bar", nb, 8, 8, 0, &b, &bytes, 1),
			 EPJ_OK);
	for (unsigned i = 0; i < nb; i++)
		ck_assert_double_eq(s[i], ref[i]);
	free(in);
	free(s);

	/* k_dyn: 3 blocks of 96 threads (a partial warp is fine without
	 * warp collectives), 96 floats of dynamic shared memory */
	nb = 3;
	n = 96;
	float *d = malloc(sizeof(float) * n * nb);
	b = (bufs){ { d } };
	bytes = sizeof(float) * n * nb;
	ck_assert_int_eq(
	    launch(ctx, m, "k_dyn", nb, n, 1, sizeof(float) * n, &b, &bytes, 1),
	    EPJ_OK);
	for (unsigned i = 0; i < n * nb; i++)
		ck_assert_float_eq(d[i], (float)((n - 1 - i % n) * 2 + i / n));
	free(d);

	/* k_atomic: 5 blocks of 40 (no poison: it accumulates) */
	setenv("EPJIT_SIM_POISON", "0", 1);
	int acc[4] = { 0, 0, 0, 0 };
	b = (bufs){ { acc } };
	bytes = sizeof acc;
	ck_assert_int_eq(launch(ctx, m, "k_atomic", 5, 40, 1, 0, &b, &bytes, 1),
			 EPJ_OK);
	ck_assert_int_eq(acc[0], 200);
	ck_assert_int_eq(acc[1], 4039);
	ck_assert_int_eq(acc[2], 5 * 780);
	ck_assert_int_eq(acc[3], 7);
	unsetenv("EPJIT_SIM_POISON");
	ej_device_sim.unload(NULL, m);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- bug reports ------------------------------------------------------- */

static const char bug_src[] =
    "extern \"C\" __global__ void k_divbar(const struct bufs a)\n"
    "{\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\tif (threadIdx.x < 16)\n"
    "\t\t__syncthreads();\n"
    "\to[threadIdx.x] = 1.0f;\n"
    "}\n"
    "extern \"C\" __global__ void k_twobar(const struct bufs a)\n"
    "{\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\tif (threadIdx.x < 16)\n"
    "\t\t__syncthreads();\n"
    "\telse\n"
    "\t\t__syncthreads();\n"
    "\to[threadIdx.x] = 1.0f;\n"
    "}\n"
    "extern \"C\" __global__ void k_exited(const struct bufs a)\n"
    "{\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\tif (threadIdx.x == 31)\n"
    "\t\treturn;\n"
    "\to[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);\n"
    "}\n"
    "extern \"C\" __global__ void k_nolane(const struct bufs a)\n"
    "{\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\to[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);\n"
    "}\n"
    "extern \"C\" __global__ void k_outmask(const struct bufs a)\n"
    "{\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\tif (threadIdx.x < 8)\n"
    "\t\to[threadIdx.x] = __shfl_down_sync(0xffu, 1.0f, 4, 16);\n"
    "}\n"
    "extern \"C\" __global__ void k_race(const struct bufs a)\n"
    "{\n"
    "\t__shared__ float sh[64];\n"
    "\tconst float *in = (const float *)a.p[1];\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\tunsigned t = threadIdx.x;\n"
    "\tsh[t] = in[t];\n"
    "\t/* missing __syncthreads() */\n"
    "\to[t] = sh[(t + 1) % blockDim.x];\n"
    "}\n"
    "extern \"C\" __global__ void k_shrace(const struct bufs a)\n"
    "{\n"
    "\t__shared__ float last;\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\tlast = (float)threadIdx.x;\n"
    "\t__syncthreads();\n"
    "\to[threadIdx.x] = last >= 0.0f ? 2.0f : 1.0f;\n"
    "}\n"
    "extern \"C\" __global__ void k_unwritten(const struct bufs a)\n"
    "{\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\tunsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "\tif (i < 100)\n"
    "\t\to[i] = 3.0f;\n"
    "}\n"
    "extern \"C\" __global__ void k_oob(const struct bufs a)\n"
    "{\n"
    "\tfloat *o = (float *)a.p[0];\n"
    "\to[threadIdx.x + 1] = 1.0f;\n"
    "}\n";

static const char *const bug_k[] = { "k_divbar", "k_twobar",	"k_exited",
				     "k_nolane", "k_outmask",	"k_race",
				     "k_shrace", "k_unwritten", "k_oob" };

/* Launches a buggy kernel and expects a report holding every needle. */
static void expect_report(epj_ctx *ctx, void *m, const char *k, unsigned grid,
			  unsigned bx, size_t n_out_elems,
			  const char *const *needles, int n)
{
	float *o = calloc(n_out_elems + 1, sizeof(float));
	float *in = calloc(1024, sizeof(float));
	for (int i = 0; i < 1024; i++)
		in[i] = (float)i + 0.5f;
	bufs b = { { o, in } };
	size_t bytes = sizeof(float) * n_out_elems;
	epj_status st = launch(ctx, m, k, grid, bx, 1, 0, &b, &bytes, 1);
	ck_assert_msg(st == EPJ_ERR_BACKEND, "%s: launch passed", k);
	tu_assert_ctx_error(ctx, EPJ_ERR_BACKEND, needles, n);
	free(o);
	free(in);
}

START_TEST(test_reports)
{
	epj_ctx *ctx = tu_ctx();
	void *m = module_of(ctx, bug_src, bug_k, 9);
	expect_report(ctx, m, "k_divbar", 2, 32, 32,
		      TU_STRS("kernel k_divbar", "block (0,0,0)",
			      "thread (16,0,0)", "divergent __syncthreads",
			      "exited while 16 thread(s) wait"));
	expect_report(ctx, m, "k_twobar", 1, 32, 32,
		      TU_STRS("kernel k_twobar", "divergent __syncthreads",
			      "thread (16,0,0)", "at line"));
	expect_report(ctx, m, "k_exited", 1, 32, 32,
		      TU_STRS("kernel k_exited", "__shfl_xor_sync",
			      "mask 0xffffffff names lane 31, which has "
			      "exited"));
	expect_report(ctx, m, "k_nolane", 1, 20, 20,
		      TU_STRS("kernel k_nolane", "thread (0,0,0)",
			      "names lane 20, which does not exist",
			      "20 threads"));
	expect_report(ctx, m, "k_outmask", 1, 32, 32,
		      TU_STRS("kernel k_outmask", "__shfl_down_sync",
			      "reads lane 8, which is not in the mask"));
	expect_report(ctx, m, "k_race", 1, 64, 64,
		      TU_STRS("kernel k_race", "race", "output 0 element"));
	expect_report(
	    ctx, m, "k_shrace", 3, 64, 64,
	    TU_STRS("kernel k_shrace", "block (2,0,0)", "shared-memory race"));
	expect_report(ctx, m, "k_unwritten", 4, 32, 128,
		      TU_STRS("kernel k_unwritten",
			      "output 0 element 100 (of 128) was never "
			      "written"));
	/* the same kernels pass with the checks off */
	setenv("EPJIT_SIM_RACECHECK", "0", 1);
	float o[64], in[64];
	for (int i = 0; i < 64; i++)
		in[i] = (float)i;
	bufs b = { { o, in } };
	size_t bytes = sizeof o;
	ck_assert_int_eq(launch(ctx, m, "k_race", 1, 64, 1, 0, &b, &bytes, 1),
			 EPJ_OK);
	setenv("EPJIT_SIM_POISON", "0", 1);
	float u[128];
	b = (bufs){ { u } };
	bytes = sizeof u;
	ck_assert_int_eq(
	    launch(ctx, m, "k_unwritten", 4, 32, 1, 0, &b, &bytes, 1), EPJ_OK);
	unsetenv("EPJIT_SIM_RACECHECK");
	unsetenv("EPJIT_SIM_POISON");
	ej_device_sim.unload(NULL, m);
	epj_ctx_free(ctx);
}
END_TEST

/* Out of bounds under ASan: the kernel writes one float past a heap buffer;
 * the module (built with -fsanitize=address) must stop the process with an
 * ASan report.  Runs in a child process; without ASan there is nothing to
 * catch it, so the test says so and checks nothing. */
START_TEST(test_asan_oob)
{
	if (!ej_sim_asan() || !dlsym(RTLD_DEFAULT, "__asan_init")) {
		fprintf(stderr, "sim: test_asan_oob skipped: no ASan in this "
				"process (configure --enable-sanitizers, or "
				"run t/sim_asan.sh)\n");
		return;
	}
	epj_ctx *ctx = tu_ctx();
	void *m = module_of(ctx, bug_src, bug_k, 9);
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		dup2(pfd[1], 2);
		float *o = malloc(sizeof(float) * 32);
		bufs b = { { o } };
		size_t bytes = sizeof(float) * 32;
		setenv("EPJIT_SIM_POISON", "0", 1);
		setenv("EPJIT_SIM_RACECHECK", "0", 1);
		launch(ctx, m, "k_oob", 1, 32, 1, 0, &b, &bytes, 0);
		_exit(0);
	}
	close(pfd[1]);
	char buf[8192];
	size_t got = 0;
	ssize_t r;
	while ((r = read(pfd[0], buf + got, sizeof buf - 1 - got)) > 0)
		got += (size_t)r;
	buf[got] = 0;
	close(pfd[0]);
	int ws = 0;
	waitpid(pid, &ws, 0);
	ck_assert_msg(!(WIFEXITED(ws) && WEXITSTATUS(ws) == 0),
		      "out-of-bounds kernel ran clean");
	ck_assert_msg(strstr(buf, "heap-buffer-overflow") &&
			  strstr(buf, "WRITE of size 4") &&
			  strstr(buf, "0 bytes to the right of 128-byte"),
		      "no ASan report of the write past the buffer:\n%s", buf);
	ej_device_sim.unload(NULL, m);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- the CUDA prelude's bf16, bit for bit --------------------------------
 * ej_f2bf (scalar and through the 8-lane vector store) on cuda-sim against
 * lib/dtype.c's epj_f32_to_bf16 on random floats, exact ties (round to
 * even both ways), the largest finite values, infinities, NaNs with
 * payloads and subnormals; ej_bf2f back must be exact. */
static const char bf16_src[] =
    "extern \"C\" __global__ void k_bf16(const struct bufs a)\n"
    "{\n"
    "\tconst float *in = (const float *)a.p[0];\n"
    "\tej_bf16 *o = (ej_bf16 *)a.p[1];\n"
    "\tej_bf16 *ov = (ej_bf16 *)a.p[2];\n"
    "\tfloat *back = (float *)a.p[3];\n"
    "\tunsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "\to[i] = ej_f2bf(in[i]);\n"
    "\tback[i] = ej_bf2f(o[i]);\n"
    "\tif (i % 8 == 0) {\n"
    "\t\tfloat l[8];\n"
    "\t\tfor (int k = 0; k < 8; k++)\n"
    "\t\t\tl[k] = in[i + k];\n"
    "\t\tej_vst_bf16x8(ov + i, l);\n"
    "\t}\n"
    "}\n";

START_TEST(test_prelude_bf16)
{
	epj_ctx *ctx = tu_ctx();
	const char *k[] = { "k_bf16" };
	void *m = module_of(ctx, bf16_src, k, 1);
	enum { N = 4096 };
	float *in = aligned_alloc(64, sizeof(float) * N);
	uint16_t *o = aligned_alloc(64, 2 * N), *ov = aligned_alloc(64, 2 * N);
	float *back = aligned_alloc(64, sizeof(float) * N);
	for (int i = 0; i < N; i++) {
		uint32_t u;
		switch (i % 8) {
		case 0: /* a tie: low half exactly 0x8000 */
			u = ((uint32_t)tu_randint(0, 1 << 16) << 16) | 0x8000u;
			break;
		case 1: /* just above / below a tie */
			u = ((uint32_t)tu_randint(0, 1 << 16) << 16) |
			    (tu_randint(0, 2) ? 0x8001u : 0x7fffu);
			break;
		case 2: { /* specials */
			static const uint32_t sp[] = {
				0x7f800000u, 0xff800000u, 0x7fc00000u,
				0x7f800001u, 0xffa5a5a5u, 0x7f7fffffu,
				0xff7fffffu, 0x00000001u, 0x807fffffu,
				0x00008000u, 0x7f7f8000u, 0x00000000u,
				0x80000000u, 0x3f808000u, 0x3f818000u
			};
			u = sp[(i / 8) % (int)EJ_ARRAY_LEN(sp)];
			break;
		}
		default: {
			float f = (float)tu_uniform(-4.0, 4.0) *
				  (float)pow(2.0, (double)tu_randint(-30, 30));
			memcpy(&u, &f, 4);
		}
		}
		memcpy(&in[i], &u, 4);
	}
	bufs b = { { in, o, ov, back } };
	void *fn = ej_device_sim.function(NULL, m, "k_bf16");
	ck_assert_ptr_nonnull(fn);
	ej_launch_out lo[3] = { { o, 2 * N, 2 },
				{ ov, 2 * N, 2 },
				{ back, sizeof(float) * N, 4 } };
	ej_launch l = { .grid = { N / 128, 1, 1 },
			.block = { 128, 1, 1 },
			.args = &b,
			.args_size = sizeof b,
			.outs = lo,
			.n_out = 3 };
	ck_assert_msg(ej_device_sim.launch(NULL, ctx, fn, "k_bf16", &l) ==
			  EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	for (int i = 0; i < N; i++) {
		uint16_t want = epj_f32_to_bf16(in[i]);
		uint32_t u;
		memcpy(&u, &in[i], 4);
		ck_assert_msg(o[i] == want && ov[i] == want,
			      "bf16 of 0x%08x: scalar 0x%04x, vector 0x%04x, "
			      "want 0x%04x",
			      u, o[i], ov[i], want);
		float bb = epj_bf16_to_f32(want);
		ck_assert(memcmp(&bb, &back[i], 4) == 0);
	}
	free(in);
	free(o);
	free(ov);
	free(back);
	ej_device_sim.unload(NULL, m);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- generated kernels on cuda-sim ---------------------------------------
 * The functions of the model's compiled regions (RMSNorm, RoPE, SwiGLU,
 * softmax, residual chains), traced at odd sizes, compiled with the cuda-sim
 * backend (their CUDA C executed by the simulator, race check and poisoned
 * outputs on) and with the interpreter (the op table's CPU kernels):
 * outputs and input gradients must agree; then every fused kernel of every
 * graph runs alone on fresh random non-contiguous inputs against its nodes
 * run op by op. */

typedef tu_region_fn sim_fn;

static epj_tensor *f_rmsnorm(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *x = in[0];
	bool up = epj_tensor_dtype(x) == EPJ_DTYPE_BF16;
	epj_tensor *xf =
	    up ? epj_cast(ctx, x, EPJ_DTYPE_F32) : epj_tensor_ref(x);
	epj_tensor *sq = epj_pow_scalar(ctx, xf, 2.0);
	epj_tensor *var = epj_mean(ctx, sq, -1, true);
	epj_tensor *ve = epj_add_scalar(ctx, var, 1e-6);
	epj_tensor *rs = epj_rsqrt(ctx, ve);
	epj_tensor *nx = epj_mul(ctx, xf, rs);
	epj_tensor *nc =
	    up ? epj_cast(ctx, nx, EPJ_DTYPE_BF16) : epj_tensor_ref(nx);
	epj_tensor *y = epj_mul(ctx, nc, in[1]);
	epj_tensor *t[] = { xf, sq, var, ve, rs, nx, nc };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

static epj_tensor *f_rope(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *x = in[0];
	int64_t d = epj_tensor_dim(x, -1);
	epj_tensor *x1 = epj_slice(ctx, x, -1, 0, d / 2, 1);
	epj_tensor *x2 = epj_slice(ctx, x, -1, d / 2, d, 1);
	epj_tensor *nx2 = epj_neg(ctx, x2);
	epj_tensor *parts[2] = { nx2, x1 };
	epj_tensor *rot = epj_cat(ctx, parts, 2, -1);
	epj_tensor *xc = epj_mul(ctx, x, in[1]);
	epj_tensor *rs = epj_mul(ctx, rot, in[2]);
	epj_tensor *y = epj_add(ctx, xc, rs);
	epj_tensor *t[] = { x1, x2, nx2, rot, xc, rs };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

static epj_tensor *f_swiglu(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *g = epj_linear(ctx, in[0], in[1], NULL);
	epj_tensor *s = epj_silu(ctx, g);
	epj_tensor *u = epj_linear(ctx, in[0], in[2], NULL);
	epj_tensor *m = epj_mul(ctx, s, u);
	epj_tensor *y = epj_linear(ctx, m, in[3], NULL);
	epj_tensor *t[] = { g, s, u, m };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

static epj_tensor *f_softmax(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *x = in[0];
	epj_tensor *xs = epj_mul_scalar(ctx, x, 0.37);
	epj_tensor *xm = epj_add(ctx, xs, in[1]);
	epj_tensor *p = epj_softmax(ctx, xm, -1);
	epj_tensor *lp = epj_log_softmax(ctx, x, -1);
	epj_tensor *m = epj_amax(ctx, x, -1, true);
	epj_tensor *d = epj_sub(ctx, x, m);
	epj_tensor *e = epj_exp(ctx, d);
	epj_tensor *s = epj_sum(ctx, e, -1, true);
	epj_tensor *q = epj_div(ctx, e, s);
	epj_tensor *a = epj_add(ctx, p, lp);
	epj_tensor *y = epj_add(ctx, a, q);
	epj_tensor *t[] = { xs, xm, p, lp, m, d, e, s, q, a };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

static epj_tensor *f_residual(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *h = epj_add(ctx, in[0], in[1]);
	epj_tensor *hg = epj_mul(ctx, h, in[2]);
	epj_tensor *hb = epj_add(ctx, hg, in[3]);
	epj_tensor *sg = epj_sigmoid(ctx, h);
	epj_tensor *p = epj_mul(ctx, hb, sg);
	epj_tensor *th = epj_tanh(ctx, h);
	epj_tensor *t3 = epj_mul_scalar(ctx, th, 1.0 / 3.0);
	epj_tensor *dd = epj_sub(ctx, p, t3);
	epj_tensor *ge = epj_gelu(ctx, in[0]);
	epj_tensor *y = epj_add(ctx, dd, ge);
	epj_tensor *t[] = { h, hg, hb, sg, p, th, t3, dd, ge };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

static double tol_of(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64   ? 1e-12
	       : dt == EPJ_DTYPE_F32 ? 1e-5
				     : 1.6e-2;
}

typedef struct sim_run {
	epj_tensor *y, *grad[8];
	int64_t launches;
} sim_run;

/* Compiles fn with `backend`, runs forward and the backward of sum(y * w). */
static ej_region_fn *run_with(epj_ctx *ctx, ej_jit *jit, sim_fn fn,
			      epj_tensor *const *in, int n_in, epj_tensor *w,
			      sim_run *r)
{
	memset(r, 0, sizeof *r);
	ej_region_fn *f = tu_compile_region(ctx, jit, fn, in, n_in);
	epj_status st;
	int64_t l0 = epj_counter_get(ctx, "kernels.launched.compiled");
	st = ej_region_run(ctx, f, in, n_in, NULL, 0, NULL, NULL, &r->y, 1);
	ck_assert_msg(st == EPJ_OK, "run: %s", epj_ctx_error(ctx));
	epj_tensor *yw = epj_mul(ctx, r->y, w);
	epj_tensor *loss = epj_sum_all(ctx, yw);
	tu_ok(ctx, loss);
	ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	r->launches = epj_counter_get(ctx, "kernels.launched.compiled") - l0;
	for (int i = 0; i < n_in; i++) {
		epj_tensor *g = epj_tensor_grad(in[i]);
		r->grad[i] = g ? epj_detach(ctx, g) : NULL;
		epj_tensor_set_grad(in[i], NULL);
	}
	epj_tensor_free(yw);
	epj_tensor_free(loss);
	return f;
}

static void sim_run_free(sim_run *r)
{
	epj_tensor_free(r->y);
	for (int i = 0; i < 8; i++)
		epj_tensor_free(r->grad[i]);
}

static epj_tensor *fresh_input(epj_ctx *ctx, const ej_value *v, int i)
{
	epj_tensor *r = tu_randn(ctx, v->dtype, v->ndim, v->shape);
	int64_t n = epj_tensor_numel(r);
	for (int64_t q = 0; q < n; q++)
		epj_tensor_set_f64(r, q, fabs(epj_tensor_get_f64(r, q)) + 0.25);
	if (i % 2 == 1 && v->ndim >= 1) {
		epj_tensor *nc = tu_noncontig(ctx, r);
		epj_tensor_free(r);
		r = nc;
	}
	return r;
}

/* Kernel k of g as a graph of its own (for the interpreter). */
static ej_graph *kernel_graph(const ej_graph *g, const ej_kernel *k)
{
	ej_graph *sub = ej_graph_new("kernel");
	int *map = calloc((size_t)g->n_values + 1, sizeof(int));
	ck_assert_ptr_nonnull(map);
	for (int i = 0; i < k->n_in; i++) {
		const ej_value *v = &g->values[k->in[i].value];
		map[k->in[i].value] = ej_graph_add_input(
		    sub, EJ_IN_ACT, i, v->dtype, v->ndim, v->shape);
	}
	for (int i = 0; i < k->n_nodes; i++) {
		const ej_ir_node *n = &g->nodes[k->nodes[i]];
		int ins[64];
		ej_meta m;
		const ej_value *o = &g->values[n->out[0]];
		memset(&m, 0, sizeof m);
		m.dtype = o->dtype;
		m.ndim = o->ndim;
		memcpy(m.shape, o->shape, sizeof m.shape);
		for (int j = 0; j < n->n_in; j++)
			ins[j] = map[n->in[j]];
		int nn = ej_graph_add_node(sub, n->op, &n->attrs, ins, n->n_in,
					   &m, 1);
		map[n->out[0]] = sub->nodes[nn].out[0];
	}
	for (int o = 0; o < k->n_out; o++)
		ej_graph_add_output(sub, map[k->out[o].value]);
	free(map);
	return sub;
}

/* Every fused kernel of a graph built by the cuda-sim backend, alone. */
static int check_kernels(epj_ctx *ctx, ej_graph *g, void *state, epj_dtype dt)
{
	const ej_schedule *s = ej_backend_sim_schedule(state);
	for (int ki = 0; ki < s->n_kernels; ki++) {
		const ej_kernel *k = s->kernels[ki];
		ej_graph *sub = kernel_graph(g, k);
		epj_tensor *in[64], *os[16] = { 0 }, *oi[16] = { 0 };
		ck_assert(k->n_in <= 64 && k->n_out <= 16);
		for (int i = 0; i < k->n_in; i++)
			in[i] = fresh_input(
			    ctx, &sub->values[sub->inputs[i].value], i);
		epj_status st =
		    ej_backend_sim_run_kernel(ctx, state, ki, in, os);
		ck_assert_msg(st == EPJ_OK, "cuda-sim kernel %d: %s", ki,
			      epj_ctx_error(ctx));
		st = ej_interp_run(ctx, sub, in, oi);
		ck_assert_msg(st == EPJ_OK, "interp: %s", epj_ctx_error(ctx));
		for (int o = 0; o < k->n_out; o++) {
			char what[96];
			snprintf(what, sizeof what,
				 "cuda-sim kernel %d output %d (%s)", ki, o,
				 epj_dtype_name(dt));
			tu_assert_tensors_close(ctx, os[o], oi[o], tol_of(dt),
						tol_of(dt), what);
			epj_tensor_free(os[o]);
			epj_tensor_free(oi[o]);
		}
		for (int i = 0; i < k->n_in; i++)
			epj_tensor_free(in[i]);
		ej_graph_free(sub);
	}
	return s->n_kernels;
}

/* fn on cuda-sim against the interpreter; returns the kernels checked. */
static int sim_case(epj_ctx *ctx, sim_fn fn, epj_tensor *const *in, int n_in,
		    const char *what)
{
	epj_dtype dt = epj_tensor_dtype(in[0]);
	double tol = tol_of(dt);
	for (int i = 0; i < n_in; i++)
		epj_tensor_set_requires_grad(in[i], true);
	bool p = epj_no_grad_enter(ctx);
	epj_tensor *y0 = fn(ctx, in);
	tu_ok(ctx, y0);
	epj_tensor *w = tu_randn(ctx, epj_tensor_dtype(y0), epj_tensor_ndim(y0),
				 epj_tensor_shape(y0));
	epj_tensor_free(y0);
	epj_no_grad_exit(ctx, p);
	ej_jit *js = ej_jit_new(ctx, EJ_BACKEND_CUDA_SIM);
	ej_jit *ji = ej_jit_new(ctx, EJ_BACKEND_INTERPRETER);
	sim_run rs, ri;
	int64_t k0 = epj_counter_get(ctx, "codegen.kernels");
	ej_region_fn *fs = run_with(ctx, js, fn, in, n_in, w, &rs);
	ck_assert_msg(epj_counter_get(ctx, "codegen.kernels") > k0,
		      "%s: the cuda-sim backend generated no kernel", what);
	ej_region_fn *fi = run_with(ctx, ji, fn, in, n_in, w, &ri);
	char buf[128];
	snprintf(buf, sizeof buf, "%s %s output", what, epj_dtype_name(dt));
	tu_assert_tensors_close(ctx, rs.y, ri.y, tol, tol, buf);
	for (int i = 0; i < n_in; i++) {
		snprintf(buf, sizeof buf, "%s %s grad of input %d", what,
			 epj_dtype_name(dt), i);
		ck_assert_msg(!rs.grad[i] == !ri.grad[i],
			      "%s: only one arm "
			      "has it",
			      buf);
		if (!rs.grad[i])
			continue;
		tu_assert_tensors_close(ctx, rs.grad[i], ri.grad[i], tol, tol,
					buf);
	}
	/* fused kernels launch fewer times than the op-by-op interpreter */
	ck_assert_msg(rs.launches < ri.launches, "%s: %lld vs %lld launches",
		      what, (long long)rs.launches, (long long)ri.launches);
	int nk = 0;
	for (int s = 0; s < fs->n_steps; s++) {
		ej_segment *seg = fs->steps[s].seg;
		if (fs->steps[s].is_break)
			continue;
		nk += check_kernels(ctx, seg->fwd, seg->fwd_state, dt);
		if (seg->bwd)
			nk += check_kernels(ctx, seg->bwd, seg->bwd_state, dt);
	}
	sim_run_free(&rs);
	sim_run_free(&ri);
	ej_region_fn_free(fs);
	ej_region_fn_free(fi);
	ej_jit_free(js);
	ej_jit_free(ji);
	epj_tensor_free(w);
	return nk;
}

static const epj_dtype dtypes[3] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16,
				     EPJ_DTYPE_F64 };
/* one row; a tail past every vector width and block size; many rows */
static const int64_t shapes[3][3] = { { 1, 1, 7 },
				      { 3, 5, 37 },
				      { 2, 173, 12 } };

START_TEST(test_model_kernels)
{
	epj_dtype dt = dtypes[_i % 3];
	const int64_t *sh = shapes[_i / 3];
	epj_ctx *ctx = tu_ctx();
	int nk = 0;
	/* RMSNorm [B,T,H] * w[H] */
	epj_tensor *x = tu_randn(ctx, dt, 3, sh);
	epj_tensor *wn = tu_randn(ctx, dt, 1, sh + 2);
	epj_tensor *in1[] = { x, wn };
	nk += sim_case(ctx, f_rmsnorm, in1, 2, "rmsnorm");
	/* softmax family on [B,T,H] with a [T,H] mask */
	epj_tensor *mask = tu_randn(ctx, dt, 2, sh + 1);
	epj_tensor *in2[] = { x, mask };
	nk += sim_case(ctx, f_softmax, in2, 2, "softmax");
	/* residual chain: g [T,1], b [H] */
	int64_t g_sh[2] = { sh[1], 1 };
	epj_tensor *a = tu_randn(ctx, dt, 3, sh);
	epj_tensor *g = tu_randn(ctx, dt, 2, g_sh);
	epj_tensor *b = tu_randn(ctx, dt, 1, sh + 2);
	epj_tensor *in3[] = { x, a, g, b };
	nk += sim_case(ctx, f_residual, in3, 4, "residual");
	/* RoPE: x [B,H,T,D] (even D), cos/sin [T,D] */
	int64_t rx[4] = { sh[0], 2, sh[1], 2 * ((sh[2] + 1) / 2) };
	epj_tensor *xr = tu_randn(ctx, dt, 4, rx);
	epj_tensor *c = tu_randn(ctx, dt, 2, rx + 2);
	epj_tensor *s = tu_randn(ctx, dt, 2, rx + 2);
	epj_tensor *in4[] = { xr, c, s };
	nk += sim_case(ctx, f_rope, in4, 3, "rope");
	/* SwiGLU MLP: x [B,T,H], weights [I,H], [I,H], [H,I] */
	int64_t wg[2] = { 11, sh[2] }, wd[2] = { sh[2], 11 };
	epj_tensor *w1 = tu_randn(ctx, dt, 2, wg);
	epj_tensor *w2 = tu_randn(ctx, dt, 2, wg);
	epj_tensor *w3 = tu_randn(ctx, dt, 2, wd);
	epj_tensor *in5[] = { x, w1, w2, w3 };
	nk += sim_case(ctx, f_swiglu, in5, 4, "swiglu");
	ck_assert_int_gt(nk, 10);
	epj_tensor *t[] = { x, wn, mask, a, g, b, xr, c, s, w1, w2, w3 };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	epj_ctx_free(ctx);
}
END_TEST

/* Every op the fusion scheduler lowers, each as a kernel of its own: the
 * ops read the inputs side by side and meet only in a concatenation (an
 * extern node), so nothing fuses them together (the two casts excepted).
 * x, y [R,C] positive, b [C] broadcast. */
static epj_tensor *f_ops(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *x = in[0], *y = in[1], *b = in[2];
	epj_dtype dt = epj_tensor_dtype(x);
	epj_tensor *c1 = epj_cast(
	    ctx, x, dt == EPJ_DTYPE_BF16 ? EPJ_DTYPE_F32 : EPJ_DTYPE_BF16);
	epj_tensor *t[] = {
		epj_add(ctx, x, b),
		epj_sub(ctx, x, y),
		epj_mul(ctx, x, y),
		epj_div(ctx, x, y),
		epj_eq(ctx, x, y),
		epj_add_scalar(ctx, x, 0.75),
		epj_mul_scalar(ctx, x, -1.25),
		epj_pow_scalar(ctx, x, 3.0),
		epj_neg(ctx, x),
		epj_exp(ctx, x),
		epj_log(ctx, x),
		epj_sqrt(ctx, x),
		epj_rsqrt(ctx, x),
		epj_silu(ctx, x),
		epj_sigmoid(ctx, x),
		epj_tanh(ctx, x),
		epj_gelu(ctx, x),
		epj_cast(ctx, c1, dt),
		epj_sum(ctx, x, -1, true),
		epj_mean(ctx, x, -1, true),
		epj_amax(ctx, x, -1, true),
		epj_softmax(ctx, x, -1),
		epj_log_softmax(ctx, x, -1),
	};
	int n = (int)EJ_ARRAY_LEN(t);
	epj_tensor *r = epj_cat(ctx, t, n, -1);
	for (int i = 0; i < n; i++)
		epj_tensor_free(t[i]);
	epj_tensor_free(c1);
	return r;
}

static epj_tensor *positive(epj_ctx *ctx, epj_dtype dt, int nd,
			    const int64_t *shape)
{
	epj_tensor *r = tu_randn(ctx, dt, nd, shape);
	int64_t n = epj_tensor_numel(r);
	for (int64_t q = 0; q < n; q++)
		epj_tensor_set_f64(r, q, fabs(epj_tensor_get_f64(r, q)) + 0.25);
	return r;
}

START_TEST(test_single_ops)
{
	static const int64_t rc[3][2] = { { 1, 7 }, { 5, 37 }, { 300, 9 } };
	epj_dtype dt = _i % 2 ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32;
	const int64_t *sh = rc[_i / 2];
	epj_ctx *ctx = tu_ctx();
	epj_tensor *x = positive(ctx, dt, 2, sh), *y = positive(ctx, dt, 2, sh);
	/* some equal elements for eq */
	for (int64_t q = 0; q < epj_tensor_numel(x); q += 3)
		epj_tensor_set_f64(y, q, epj_tensor_get_f64(x, q));
	epj_tensor *b = positive(ctx, dt, 1, sh + 1);
	epj_tensor *in[] = { x, y, b };
	int nk = sim_case(ctx, f_ops, in, 3, "single ops");
	ck_assert_int_ge(nk, 22);
	epj_tensor_free(x);
	epj_tensor_free(y);
	epj_tensor_free(b);
	epj_ctx_free(ctx);
}
END_TEST

/* Selecting the device: EPJIT_DEVICE picks the default compile backend (a
 * bad value is a clear error); a "cuda-sim" context holds host memory on
 * the cuda-sim device and runs eager ops. */
START_TEST(test_device_select)
{
	ej_backend_kind k = EJ_BACKEND_INTERPRETER;
	char msg[256];
	setenv("EPJIT_DEVICE", "cuda-sim", 1);
	ck_assert_int_eq(ej_backend_parse("", &k, msg, sizeof msg), EPJ_OK);
	ck_assert_int_eq(k, EJ_BACKEND_CUDA_SIM);
	/* an explicit backend wins */
	ck_assert_int_eq(ej_backend_parse("c", &k, msg, sizeof msg), EPJ_OK);
	ck_assert_int_eq(k, EJ_BACKEND_C);
	setenv("EPJIT_DEVICE", "cpu", 1);
	ck_assert_int_eq(ej_backend_parse("", &k, msg, sizeof msg), EPJ_OK);
	ck_assert_int_eq(k, EJ_BACKEND_C);
	setenv("EPJIT_DEVICE", "gpu0", 1);
	ck_assert_int_eq(ej_backend_parse("", &k, msg, sizeof msg),
			 EPJ_ERR_CONFIG);
	ck_assert_msg(strstr(msg, "EPJIT_DEVICE=\"gpu0\"") &&
			  strstr(msg, "cpu, cuda-sim, cuda"),
		      "%s", msg);
	unsetenv("EPJIT_DEVICE");
	ck_assert_int_eq(ej_backend_parse("cuda-sim", &k, msg, sizeof msg),
			 EPJ_OK);
	ck_assert_int_eq(k, EJ_BACKEND_CUDA_SIM);

	epj_ctx *ctx = NULL;
	ck_assert_int_eq(epj_ctx_new("cuda-sim", &ctx), EPJ_OK);
	ck_assert_str_eq(ctx->dev->name, "cuda-sim");
	int64_t sh[2] = { 3, 5 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	epj_tensor *e = epj_exp(ctx, a);
	tu_ok(ctx, e);
	for (int64_t i = 0; i < 15; i++)
		ck_assert_double_eq_tol(epj_tensor_get_f64(e, i),
					exp(epj_tensor_get_f64(a, i)), 1e-5);
	epj_tensor_free(a);
	epj_tensor_free(e);
	epj_ctx_free(ctx);
	ck_assert_int_eq(epj_ctx_new("cuda", &ctx), EPJ_ERR_BACKEND);
}
END_TEST

Suite *make_sim_suite(void)
{
	Suite *s = suite_create("sim");
	TCase *tc = tcase_create("sim");
	tcase_add_checked_fixture(tc, cache_setup, cache_teardown);
	tcase_set_timeout(tc, 600);
	tcase_add_test(tc, test_warp_semantics);
	tcase_add_test(tc, test_unloadable_module);
	tcase_add_test(tc, test_device_select);
	tcase_add_test(tc, test_reports);
	tcase_add_test(tc, test_prelude_bf16);
	tu_add_loop_test(tc, test_model_kernels, 9);
	tu_add_loop_test(tc, test_single_ops, 6);
	suite_add_tcase(s, tc);
	/* its own case, so that t/sim_asan.sh can run it alone */
	TCase *ta = tcase_create("asan");
	tcase_add_checked_fixture(ta, cache_setup, cache_teardown);
	tcase_set_timeout(ta, 600);
	tcase_add_test(ta, test_asan_oob);
	suite_add_tcase(s, ta);
	return s;
}
