/* t/mpi_nccl_check.c -- several ranks on the cuda device with NCCL on
 * device buffers, run by t/mpi.sh under `mpirun -np 2 --oversubscribe`
 * without a GPU: the cuda device on the stand-in driver (t/fake_cuda.c,
 * $EPJIT_CUDA_DRIVER; each kernel launch runs its CUDA C on cuda-sim, and
 * with FAKE_CUDA_GUARD=1 host code that touches device memory faults) and
 * NCCL on the stand-in t/fake_nccl.c ($EPJIT_NCCL), whose ranks exchange
 * through files.
 *
 *  comm     an `nccl` comm over the world, bootstrapped over the mpi comm:
 *           all-to-all-v (odd row size, zero counts), all-reduce,
 *           reduce-scatter and all-gather (even and uneven), broadcast on
 *           fresh device buffers, against what every rank can compute;
 *           ranks that call different counts get an error naming both
 *           calls, and a receive count that differs from the peer's
 *           send is an error; a rank that never joins makes the other
 *           fail within the stand-in's timeout instead of hanging.
 *  train    the tiny MoE model on the cuda context, EP = 2 (ZeRO 2, 1) and
 *           data parallel (autoep_size 1, ZeRO 0 and 2), f32 (and bf16
 *           with MPI_NCCL_CHECK_BF16=1),
 *           two SGD steps with clipping on 2 ranks x micro-batch 2
 *           against a single-rank cpu engine on the global batch of 4:
 *           losses, grad norms and every updated parameter within f32
 *           (bf16) tolerances, the updates non-zero; the counters show
 *           that the expert rows and the gradients went over NCCL
 *           (comm.nccl.*.bytes > 0) and the host comm carried none of
 *           them (comm.mpi.<purpose>.bytes == 0); the rows' exchanges ran
 *           on the communication stream, each waited for by the compute
 *           stream, and no kernel or copy touched their buffers before
 *           (the stand-in driver's stream order check would fail it).
 *           The same at EP 2 for the Qwen2-MoE golden model (a gated
 *           shared expert, which the layer computes while its dispatch
 *           travels: autoep.shared.in_layer) when $top_srcdir has it.
 *  refuse   comm.backend "host" on the cuda device with 2 ranks fails at
 *           engine creation, saying why.
 *
 * Every rank prints its failures; the exit status is non-zero when any
 * rank failed.  EPJIT_TEST_SEED replays a seed (rank 0's is used).
 */
#include "cuda_driver.h"
#include "jit.h"
#include "jit_impl.h"
#include "kir.h"
#include "runtime_impl.h"
#include "tmpl.h"

#include <dlfcn.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* test hooks of jit/backend_cuda.c and kernels/tmpl.c (in no header) */
extern const void *ej_backend_cuda_test_state(const void *module);
extern int ej_tmpl_test_module(const void *module, const char **source,
			       const char *const **kernels,
			       const char *const **arg_types);
extern size_t ej_tmpl_test_args_size(const void *module, const char *kernel);

static int rank, failures;
static uint64_t seed;

static void fail_at(int line, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void fail_at(int line, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "mpi_nccl_check: rank %d: FAIL line %d: ", rank, line);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	failures++;
}
#define CHECK(c, ...)                                                          \
	do {                                                                   \
		if (!(c))                                                      \
			fail_at(__LINE__, __VA_ARGS__);                        \
	} while (0)
#define OK(ctx, st) CHECK((st) == EPJ_OK, "%s: %s", #st, epj_ctx_error(ctx))

static uint64_t mix(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* ---- the stand-in driver's kernels on cuda-sim ----------------------------
 * (as t/check_cuda.c's hook: a launch runs the same kernel's CUDA C) */

typedef int (*fake_hook)(void *user, void *module, const char *kernel,
			 const unsigned *grid, const unsigned *block,
			 unsigned smem, void *args);
typedef size_t (*fake_size_fn)(void *user, void *module, const char *kernel);

static struct {
	epj_ctx *ctx;
	struct {
		const void *module;
		char *src; /* the CUDA C of the sim module (a freed driver
			      module's address is reused: match both) */
		void *sim;
	} m[1024];
	int n;
} H;

static const ej_kernel *kernel_of(const void *state, const char *name)
{
	const ej_schedule *s = ej_backend_cuda_schedule(state);
	int i = -1;
	if (sscanf(name, "epjk_%d", &i) != 1 || i < 0 || i >= s->n_kernels)
		return NULL;
	return s->kernels[i];
}

static void *sim_for(const void *module)
{
	const void *state = ej_backend_cuda_test_state(module);
	const char *tsrc = NULL;
	const char *const *tk = NULL, *const *tt = NULL;
	int tn = state ? -1 : ej_tmpl_test_module(module, &tsrc, &tk, &tt);
	const char *src = state ? ej_backend_cuda_source(state) : tsrc;
	for (int i = 0; src && i < H.n; i++)
		if (H.m[i].module == module && !strcmp(H.m[i].src, src))
			return H.m[i].sim;
	if (H.n >= 1024)
		return NULL;
	void *sim = NULL;
	epj_status st;
	if (!state && tn < 0) {
		fail_at(__LINE__, "the stand-in driver ran an unknown module");
		return NULL;
	} else if (!state) {
		st = ej_sim_build_module(H.ctx, tsrc, tk, tt, tn, "fake_tmpl",
					 &sim);
	} else {
		const ej_schedule *s = ej_backend_cuda_schedule(state);
		const char *kn[64], *ty[64];
		char names[64][32], types[64][48];
		if (s->n_kernels > 64)
			return NULL;
		for (int i = 0; i < s->n_kernels; i++) {
			snprintf(names[i], sizeof names[i], "epjk_%d", i);
			snprintf(types[i], sizeof types[i],
				 "struct ej_kargs_%d", i);
			kn[i] = names[i];
			ty[i] = types[i];
		}
		st = ej_sim_build_module(H.ctx, ej_backend_cuda_source(state),
					 kn, ty, s->n_kernels, "fake", &sim);
	}
	if (st != EPJ_OK) {
		fail_at(__LINE__, "cuda-sim module: %s", epj_ctx_error(H.ctx));
		return NULL;
	}
	H.m[H.n].module = module;
	H.m[H.n].src = strdup(src);
	H.m[H.n].sim = sim;
	H.n++;
	return H.m[H.n - 1].src ? sim : NULL;
}

static int run_on_sim(void *user, void *module, const char *kernel,
		      const unsigned *grid, const unsigned *block,
		      unsigned smem, void *args)
{
	(void)user;
	void *sim = sim_for(module);
	void *fn = sim ? ej_device_sim.function(ej_device_sim.self, sim, kernel)
		       : NULL;
	if (!fn)
		return 1;
	const void *state = ej_backend_cuda_test_state(module);
	const ej_kernel *k = state ? kernel_of(state, kernel) : NULL;
	ej_launch l = { .smem = smem,
			.args = args,
			.args_size =
			    k ? ej_cuda_args_size(k)
			      : ej_tmpl_test_args_size(module, kernel) };
	memcpy(l.grid, grid, sizeof l.grid);
	memcpy(l.block, block, sizeof l.block);
	epj_status st =
	    ej_device_sim.launch(ej_device_sim.self, H.ctx, fn, kernel, &l);
	if (st != EPJ_OK)
		fprintf(stderr, "mpi_nccl_check: %s on cuda-sim: %s\n", kernel,
			epj_ctx_error(H.ctx));
	return st != EPJ_OK;
}

static size_t args_size_of(void *user, void *module, const char *kernel)
{
	(void)user;
	const void *state = ej_backend_cuda_test_state(module);
	const ej_kernel *k = state ? kernel_of(state, kernel) : NULL;
	return k ? ej_cuda_args_size(k)
		 : ej_tmpl_test_args_size(module, kernel);
}

/* The hook installed in the driver named by $EPJIT_CUDA_DRIVER. */
static bool hook_on(void)
{
	const char *path = getenv("EPJIT_CUDA_DRIVER");
	void *h = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
	void *p = h ? dlsym(h, "fake_cuda_set_hook") : NULL;
	if (!p) {
		fprintf(stderr, "mpi_nccl_check: no stand-in driver (%s)\n",
			path ? path : "EPJIT_CUDA_DRIVER unset");
		return false;
	}
	void (*set)(fake_hook, fake_size_fn, void *);
	memcpy(&set, &p, sizeof p);
	if (epj_ctx_new("cpu", &H.ctx) != EPJ_OK)
		return false;
	set(run_on_sim, args_size_of, NULL);
	return true;
}

/* ---- values ---------------------------------------------------------------
 */

static double *values(epj_ctx *ctx, epj_tensor *t)
{
	int64_t n = epj_tensor_numel(t);
	double *d = calloc((size_t)n + 1, sizeof *d);
	if (epj_tensor_to_f64(ctx, t, d) != EPJ_OK)
		fail_at(__LINE__, "to_f64: %s", epj_ctx_error(ctx));
	return d;
}

/* t, or (NULL: the call failed) the end of this rank with the context's
 * message: nothing after it could run. */
static epj_tensor *need_at(epj_ctx *ctx, epj_tensor *t, int line)
{
	if (t)
		return t;
	fprintf(stderr,
		"mpi_nccl_check: rank %d: FAIL line %d: no tensor: %s\n", rank,
		line, epj_ctx_error(ctx));
	fflush(stderr);
	exit(1);
}
#define NEED(ctx, t) need_at(ctx, t, __LINE__)

/* A device tensor of n f32 (or bytes as u8) from host values. */
static epj_tensor *dev_f32(epj_ctx *ctx, const float *v, int64_t n)
{
	return NEED(ctx, epj_tensor_from_data(ctx, EPJ_DTYPE_F32, 1, &n, v));
}

static float val(int r, int64_t i, int salt)
{
	return (float)((int64_t)(mix(seed + (uint64_t)r * 7919u +
				     (uint64_t)i * 31u + (uint64_t)salt) %
				 2001) -
		       1000) /
	       256.0f;
}

/* ---- the comm -------------------------------------------------------------
 */

static void check_comm(epj_ctx *ctx, ej_comm *w)
{
	const int P = w->size, me = w->rank;
	ej_cuda_dev *dev = NULL;
	OK(ctx, ej_cuda_open(ctx, &dev));
	ej_comm *nc = NULL;
	OK(ctx, ej_comm_nccl_new(ctx, w, dev, &nc));
	if (!nc)
		return;
	CHECK(!strcmp(nc->name, "nccl") && nc->size == P && nc->rank == me,
	      "nccl comm %s %d of %d", nc->name, nc->rank, nc->size);

	/* all_to_all_v: rows of 4 f32 (16 bytes; a2av moves bytes), some
	 * counts zero */
	int64_t sc[8], rc[8], ns = 0, nr = 0;
	for (int p = 0; p < P; p++) {
		uint64_t hs = mix(seed ^ (uint64_t)(me * 131 + p * 7 + 1));
		uint64_t hr = mix(seed ^ (uint64_t)(p * 131 + me * 7 + 1));
		sc[p] = hs % 4 == 0 ? 0 : (int64_t)(hs % 9);
		rc[p] = hr % 4 == 0 ? 0 : (int64_t)(hr % 9);
		ns += sc[p];
		nr += rc[p];
	}
	const int64_t RW = 3; /* f32 per row: an odd row of 12 bytes */
	float *hs = malloc(sizeof *hs * (size_t)(ns * RW + 1));
	for (int64_t i = 0; i < ns * RW; i++)
		hs[i] = val(me, i, 1);
	epj_tensor *ts = dev_f32(ctx, hs, ns * RW + 1);
	int64_t nrr = nr * RW + 1;
	epj_tensor *tr = NEED(ctx, epj_zeros(ctx, EPJ_DTYPE_F32, 1, &nrr));
	OK(ctx, ej_comm_a2av(ctx, nc, "test.a2av", ej_data(ts), sc, ej_data(tr),
			     rc, sizeof(float) * RW));
	double *got = values(ctx, tr);
	int64_t bad = 0, k = 0;
	for (int p = 0; p < P; p++) {
		/* rank p's rows to me start at the sum of its counts before
		 * me */
		int64_t off = 0;
		for (int q = 0; q < me; q++) {
			uint64_t h =
			    mix(seed ^ (uint64_t)(p * 131 + q * 7 + 1));
			off += h % 4 == 0 ? 0 : (int64_t)(h % 9);
		}
		for (int64_t i = 0; i < rc[p] * RW; i++, k++)
			bad += got[k] != (double)val(p, off * RW + i, 1);
	}
	CHECK(bad == 0, "nccl all_to_all_v: %lld wrong values", (long long)bad);
	free(got);
	free(hs);
	epj_tensor_free(ts);
	epj_tensor_free(tr);

	/* all-reduce in place, reduce-scatter (uneven) and all-gather */
	int64_t n = 5 + (int64_t)(seed % 40);
	float *hv = malloc(sizeof *hv * (size_t)n);
	for (int64_t i = 0; i < n; i++)
		hv[i] = val(me, i, 2);
	epj_tensor *tv = dev_f32(ctx, hv, n);
	OK(ctx, ej_comm_allreduce(ctx, nc, "test.ar", ej_data(tv), n));
	got = values(ctx, tv);
	bad = 0;
	for (int64_t i = 0; i < n; i++) {
		double want = 0;
		for (int p = 0; p < P; p++)
			want += val(p, i, 2);
		bad += fabs(got[i] - want) > 1e-6 * (1 + fabs(want));
	}
	CHECK(bad == 0, "nccl all_reduce: %lld wrong", (long long)bad);
	free(got);
	int64_t counts[8], tot = 0;
	for (int uneven = 0; uneven < 2; uneven++) {
		tot = 0;
		for (int p = 0; p < P; p++) {
			counts[p] = uneven ? 1 + p + (int64_t)(seed % 3) : 4;
			tot += counts[p];
		}
		float *hf = malloc(sizeof *hf * (size_t)tot);
		for (int64_t i = 0; i < tot; i++)
			hf[i] = val(me, i, 3 + uneven);
		epj_tensor *tf = dev_f32(ctx, hf, tot);
		epj_tensor *to =
		    NEED(ctx, epj_zeros(ctx, EPJ_DTYPE_F32, 1, &counts[me]));
		OK(ctx, ej_comm_reduce_scatter(ctx, nc, "test.rs", ej_data(tf),
					       ej_data(to), counts));
		got = values(ctx, to);
		int64_t lo = 0;
		for (int p = 0; p < me; p++)
			lo += counts[p];
		bad = 0;
		for (int64_t i = 0; i < counts[me]; i++) {
			double want = 0;
			for (int p = 0; p < P; p++)
				want += val(p, lo + i, 3 + uneven);
			bad += fabs(got[i] - want) > 1e-6 * (1 + fabs(want));
		}
		CHECK(bad == 0, "nccl reduce_scatter (uneven %d): %lld wrong",
		      uneven, (long long)bad);
		free(got);
		/* all-gather of the parts back */
		epj_tensor *tg =
		    NEED(ctx, epj_zeros(ctx, EPJ_DTYPE_F32, 1, &tot));
		OK(ctx, ej_comm_allgather(ctx, nc, "test.ag", ej_data(to),
					  ej_data(tg), counts, sizeof(float)));
		got = values(ctx, tg);
		bad = 0;
		for (int64_t i = 0; i < tot; i++) {
			double want = 0;
			for (int p = 0; p < P; p++)
				want += val(p, i, 3 + uneven);
			bad += fabs(got[i] - want) > 1e-6 * (1 + fabs(want));
		}
		CHECK(bad == 0, "nccl all_gather (uneven %d): %lld wrong",
		      uneven, (long long)bad);
		free(got);
		free(hf);
		epj_tensor_free(tf);
		epj_tensor_free(to);
		epj_tensor_free(tg);
	}
	/* broadcast from the last rank */
	for (int64_t i = 0; i < n; i++)
		hv[i] = val(me, i, 9);
	epj_tensor *tb = dev_f32(ctx, hv, n);
	OK(ctx, ej_comm_bcast(ctx, nc, "test.bcast", ej_data(tb),
			      sizeof(float) * (size_t)n, P - 1));
	got = values(ctx, tb);
	bad = 0;
	for (int64_t i = 0; i < n; i++)
		bad += got[i] != (double)val(P - 1, i, 9);
	CHECK(bad == 0, "nccl broadcast: %lld wrong", (long long)bad);
	free(got);
	epj_tensor_free(tb);
	CHECK(epj_counter_get(ctx, "comm.nccl.bytes") > 0 &&
		  epj_counter_get(ctx, "comm.nccl.test.a2av.bytes") ==
		      epj_counter_get(ctx, "comm.test.a2av.bytes"),
	      "comm.nccl.* counters: %lld",
	      (long long)epj_counter_get(ctx, "comm.nccl.bytes"));

	/* ranks that disagree on the count: an error on every rank naming
	 * both calls, not a hang */
	epj_status st = ej_comm_allreduce(ctx, nc, "test.mismatch", ej_data(tv),
					  n - (me == 0));
	const char *m = epj_ctx_error(ctx);
	CHECK(st != EPJ_OK && strstr(m, "ranks disagree") &&
		  strstr(m, "ncclAllReduce") && strstr(m, "test.mismatch"),
	      "count mismatch: %s", m);
	epj_ctx_clear_error(ctx);
	ej_comm_free(nc);
	nc = NULL;
	OK(ctx, ej_comm_barrier_c(ctx, w, "test"));

	/* an all-to-all whose receive count differs from what the peer
	 * sends: the receiving rank's error says so */
	OK(ctx, ej_comm_nccl_new(ctx, w, dev, &nc));
	if (!nc)
		return;
	int64_t sc2[8], rc2[8];
	for (int p = 0; p < P; p++)
		sc2[p] = rc2[p] = 2;
	if (me == 1)
		rc2[0] = 1; /* rank 0 sends 2 rows, 1 is expected */
	int64_t n4 = 4 * 2 * P;
	epj_tensor *ta = NEED(ctx, epj_zeros(ctx, EPJ_DTYPE_F32, 1, &n4));
	epj_tensor *tz = NEED(ctx, epj_zeros(ctx, EPJ_DTYPE_F32, 1, &n4));
	st = ej_comm_a2av(ctx, nc, "test.short", ej_data(ta), sc2, ej_data(tz),
			  rc2, 4 * sizeof(float));
	m = epj_ctx_error(ctx);
	if (me == 1)
		CHECK(st != EPJ_OK && strstr(m, "sizes differ") &&
			  strstr(m, "ncclGroupEnd") && strstr(m, "test.short"),
		      "receive count mismatch: %s", m);
	epj_ctx_clear_error(ctx);
	epj_tensor_free(ta);
	epj_tensor_free(tz);
	OK(ctx, ej_comm_barrier_c(ctx, w, "test"));
	ej_comm_free(nc);
	nc = NULL;

	/* a rank that never joins: the other fails within the timeout */
	OK(ctx, ej_comm_nccl_new(ctx, w, dev, &nc));
	if (!nc)
		return;
	if (me == 0) {
		setenv("FAKE_NCCL_TIMEOUT_S", "1", 1);
		struct timespec t0, t1;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		st = ej_comm_allreduce(ctx, nc, "test.lonely", ej_data(tv), n);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		double dt = (double)(t1.tv_sec - t0.tv_sec) +
			    1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
		m = epj_ctx_error(ctx);
		CHECK(st != EPJ_OK && strstr(m, "did not join") &&
			  strstr(m, "test.lonely") && dt < 10,
		      "lonely all-reduce (%.1f s): %s", dt, m);
		epj_ctx_clear_error(ctx);
		unsetenv("FAKE_NCCL_TIMEOUT_S");
	}
	OK(ctx, ej_comm_barrier_c(ctx, w, "test"));
	ej_comm_free(nc);
	epj_tensor_free(tv);
	free(hv);
}

/* ---- training -------------------------------------------------------------
 */

/* fixed: expert_parallel.fixed_routing (token n's j-th expert is
 * (n k + j) % E, so no near tie of router logits can send a token to
 * another expert on one side of a comparison) */
static char *ds_json(int ep, int zero, int64_t micro, bool bf16,
		     const char *backend, bool fixed)
{
	char *s = malloc(1024);
	snprintf(
	    s, 1024,
	    "{\"train_micro_batch_size_per_gpu\": %lld,"
	    " \"gradient_accumulation_steps\": 1,"
	    " \"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": "
	    "0.05, \"momentum\": 0.9}},"
	    " \"gradient_clipping\": 0.5,"
	    " \"bf16\": {\"enabled\": %s},"
	    " \"zero_optimization\": {\"stage\": %d},"
	    " \"expert_parallel\": {\"enabled\": true, \"autoep_size\": %d,"
	    " \"fixed_routing\": %s},"
	    " \"comm\": {\"timeout_s\": 60, \"backend\": \"%s\"}}",
	    (long long)micro, bf16 ? "true" : "false", zero, ep,
	    fixed ? "true" : "false", backend);
	return s;
}

static int param_index(const epj_model *m, const char *name)
{
	for (int i = 0; i < m->params.n; i++)
		if (!strcmp(m->params.names[i], name))
			return i;
	return -1;
}

/* Rows [r*rows, (r+1)*rows) of the host tensor t (i64 [R, T], on cr) as a
 * tensor of ctx. */
static epj_tensor *rows_of(epj_ctx *ctx, epj_ctx *cr, epj_tensor *t, int r,
			   int64_t rows)
{
	int64_t T = epj_tensor_dim(t, 1), n = epj_tensor_numel(t);
	double *d = calloc((size_t)n, sizeof *d);
	int64_t *v = calloc((size_t)(rows * T), sizeof *v);
	if (epj_tensor_to_f64(cr, t, d) != EPJ_OK)
		fail_at(__LINE__, "to_f64: %s", epj_ctx_error(cr));
	for (int64_t i = 0; i < rows * T; i++)
		v[i] = (int64_t)d[r * rows * T + i];
	int64_t sh[2] = { rows, T };
	epj_tensor *out = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, sh, v);
	free(d);
	free(v);
	return out;
}

static int64_t ctr(epj_ctx *ctx, const char *name)
{
	return epj_counter_get(ctx, name);
}

/* The stream log of the last step (ej_cuda_stream_log): on the
 * communication stream every exchange waits for an event of the compute
 * stream, runs and records its completion (m:W m:N m:R), and the compute
 * stream waits for each (c:W); work reached the compute stream between an
 * exchange and its wait in at least one of them (the overlap). */
static void check_stream_log(const char *label)
{
	size_t n = ej_cuda_stream_log(NULL, 0);
	char *log = malloc(n + 1);
	if (!log)
		return;
	ej_cuda_stream_log(log, n + 1);
	int exchanges = 0, waits = 0, overlapped = 0, meanwhile = -1;
	/* the next op expected on the comm stream (0: any, where the log
	 * kept only a step's last entries) */
	char want = 0;
	bool ok = true;
	for (const char *p = log; *p; p += p[3] ? 4 : 3) {
		char s = p[0], op = p[2];
		if (s == 'm') {
			ok = ok && (!want || op == want);
			want = op == 'W' ? 'N' : op == 'N' ? 'R' : 'W';
			if (op == 'R') {
				exchanges++;
				meanwhile = 0;
			}
		} else if (s == 'c' && op == 'W') {
			waits++;
			overlapped += meanwhile > 0;
			meanwhile = -1;
		} else if (s == 'c' && meanwhile >= 0) {
			meanwhile++;
		}
	}
	CHECK(ok && want == 'W' && exchanges > 0 && waits >= exchanges &&
		  overlapped > 0,
	      "%s: stream log: comm stream in order %d, %d exchanges, %d "
	      "compute waits, %d with work issued meanwhile (%zu bytes of "
	      "log)",
	      label, ok, exchanges, waits, overlapped, n);
	if (rank == 0)
		printf("mpi_nccl_check: %s: a step's stream log: %d exchanges "
		       "on the communication stream, %d with compute work "
		       "issued before the compute stream's wait\n",
		       label, exchanges, overlapped);
	free(log);
}

/* EP > 1: the expert rows went over NCCL, off the compute stream, in
 * order (the stream log), the split plan over the host comm; shared: the
 * model has a shared expert, which the layer computed. */
static void check_ep_rows(epj_ctx *ca, const char *label, bool shared)
{
	char name[128];
	const char *rows[] = { "autoep.dispatch", "autoep.combine",
			       "autoep.dispatch_grad", "autoep.combine_grad" };
	for (int i = 0; i < 4; i++) {
		snprintf(name, sizeof name, "comm.nccl.%s.bytes", rows[i]);
		int64_t nb = ctr(ca, name);
		snprintf(name, sizeof name, "comm.mpi.%s.bytes", rows[i]);
		CHECK(nb > 0 && ctr(ca, name) == 0,
		      "%s: %s: nccl %lld bytes, mpi %lld", label, rows[i],
		      (long long)nb, (long long)ctr(ca, name));
	}
	/* the split plan's counts: host scalars on the host comm */
	CHECK(ctr(ca, "comm.mpi.autoep.split_plan.bytes") > 0,
	      "%s: split plan not on the host comm", label);
	/* every exchange ran on the communication stream and the
	 * compute stream waited for each (the stand-in driver
	 * refuses a kernel that reads rows before that wait) */
	check_stream_log(label);
	/* a model with a shared expert: the layer computes it while
	 * the dispatch travels (the reference, one rank, in the
	 * block) */
	if (shared)
		CHECK(ctr(ca, "autoep.shared.in_layer") > 0 &&
			  ctr(ca, "autoep.a2a.overlapped_ops") > 0,
		      "%s: the shared expert did not run in the layer (%lld "
		      "calls) while an exchange was in flight (%lld eager "
		      "ops)",
		      label, (long long)ctr(ca, "autoep.shared.in_layer"),
		      (long long)ctr(ca, "autoep.a2a.overlapped_ops"));
	/* backward: the exchanges of the gradients are left in flight by
	 * the autograd engine, which runs nodes that do not read them
	 * meanwhile (the shared expert's backward) */
	CHECK(!shared || ctr(ca, "autoep.a2a.backward_overlapped_ops") > 0,
	      "%s: no kernel issued while a backward exchange travelled",
	      label);
	if (rank == 0)
		printf("mpi_nccl_check: %s: %lld kernels issued while the "
		       "backward's exchanges travelled, %lld while the "
		       "forward's did\n",
		       label,
		       (long long)ctr(ca, "autoep.a2a.backward_overlapped_ops"),
		       (long long)ctr(ca, "autoep.a2a.overlapped_ops"));
	int64_t st = ctr(ca, "comm.a2av.started");
	CHECK(st > 0 && st == ctr(ca, "comm.a2av.waits"),
	      "%s: %lld exchanges off the compute stream, %lld "
	      "waits",
	      label, (long long)st, (long long)ctr(ca, "comm.a2av.waits"));
}

/* config: a model's config.json (NULL: the built-in tiny model) */
static void check_train(ej_comm *w, ej_comm *self, int ep, int zero, bool bf16,
			const char *config)
{
	const int P = w->size;
	const int64_t B = 2, T = 6;
	char label[160];
	snprintf(label, sizeof label, "cuda ep %d zero %d %s%s", ep, zero,
		 bf16 ? "bf16" : "f32", config ? " (config.json)" : "");
	epj_ctx *ca = NULL, *cr = NULL;
	OK(ca, epj_ctx_new("cuda", &ca));
	epj_ctx_new("cpu", &cr);
	if (!ca || !cr)
		return;
	CHECK(!ca->dev->host_visible, "the cuda context is host memory");
	epj_model_opts mo = { .layout = EPJ_LAYOUT_NESTED,
			      .seed = seed,
			      .dtype = EPJ_DTYPE_F32 };
	epj_model *ma = NULL, *mr = NULL;
	epj_engine *ea = NULL, *er = NULL;
	OK(ca, epj_model_new(ca, config, &mo, &ma));
	OK(cr, epj_model_new(cr, config, &mo, &mr));
	/* the golden Qwen2-MoE model's router gives near ties that the
	 * arms' sums in other orders can break differently (an expert's
	 * update then differs by its own size): its case routes fixed, the
	 * same on every rank (B T k a multiple of E) as in the reference */
	char *ja = ds_json(ep, zero, B, bf16, "auto", config != NULL);
	char *jr = ds_json(1, 0, B * P, bf16, "auto", config != NULL);
	OK(ca, epj_engine_initialize_json(ca, ma, ja, label, &ea));
	ej_comm *prev = ej_comm_world_set(self);
	OK(cr, epj_engine_initialize_json(cr, mr, jr, "<reference>", &er));
	ej_comm_world_set(prev);
	free(ja);
	free(jr);
	if (!ea || !er)
		return;
	CHECK(ea->dev_comm && !strcmp(ea->dev_comm->name, "nccl"),
	      "%s: no nccl device comm", label);
	CHECK(ep == 1 || (ea->dev_ep && ea->dev_ep->size == ep),
	      "%s: no device EP group", label);
	double **before = calloc((size_t)ma->params.n, sizeof *before);
	for (int i = 0; i < ma->params.n; i++)
		before[i] = values(ca, ma->params.params[i]);
	epj_corpus *corp = epj_corpus_synthetic(
	    cr, (uint32_t)epj_model_vocab_size(mr), seed + 3);
	const double ltol = bf16 ? 2e-2 : 2e-5;
	for (int step = 0; step < 2; step++) {
		epj_tensor *ids = NULL, *lab = NULL;
		OK(cr, epj_corpus_next_batch(cr, corp, B * P, T, &ids, &lab));
		if (step == 1)
			ej_cuda_stream_log_reset(); /* the census of a step */
		epj_tensor *ida = rows_of(ca, cr, ids, w->rank, B);
		epj_tensor *laa = rows_of(ca, cr, lab, w->rank, B);
		epj_step_info ia, ir;
		memset(&ia, 0, sizeof ia);
		memset(&ir, 0, sizeof ir);
		OK(ca, epj_engine_train_step(ea, ida, laa, &ia));
		OK(cr, epj_engine_train_step(er, ids, lab, &ir));
		CHECK(ia.stepped && ir.stepped, "%s: no step", label);
		CHECK(fabs(ia.mean_loss - ir.mean_loss) <=
			  ltol * fabs(ir.mean_loss),
		      "%s step %d: loss %.9g vs reference %.9g", label, step,
		      ia.mean_loss, ir.mean_loss);
		CHECK(fabs(ia.grad_norm - ir.grad_norm) <=
			  (bf16 ? 5e-2 : 1e-4) * ir.grad_norm,
		      "%s step %d: grad norm %.9g vs reference %.9g", label,
		      step, ia.grad_norm, ir.grad_norm);
		CHECK(ir.grad_norm > 0.5, "%s: clipping not exercised (%g)",
		      label, ir.grad_norm);
		epj_tensor *fr[] = { ids, lab, ida, laa };
		for (size_t i = 0; i < 4; i++)
			epj_tensor_free(fr[i]);
	}
	/* every parameter this rank holds against the reference's */
	int moved = 0, compared = 0;
	double worst = 0;
	for (int i = 0; i < ma->params.n; i++) {
		const char *nm = ma->params.names[i];
		int j = param_index(mr, nm);
		CHECK(j >= 0, "%s: %s missing in the reference", label, nm);
		if (j < 0)
			continue;
		int64_t n = epj_tensor_numel(ma->params.params[i]);
		double *a = values(ca, ma->params.params[i]);
		double *r = values(cr, mr->params.params[j]);
		double du = 0, dm = 0, pm = 0;
		for (int64_t k = 0; k < n; k++) {
			du = fmax(du, fabs(a[k] - r[k]));
			dm = fmax(dm, fabs(r[k] - before[i][k]));
			pm = fmax(pm, fabs(r[k]));
		}
		/* f32: the update to 2e-3 of its size (cuda's kernels sum in
		 * another order); bf16: each arm rounds its parameters to
		 * bf16 after the step, so a few ulp of the parameter */
		double tol =
		    bf16 ? 2e-2 * pm + 0.1 * dm : 2e-3 * dm + 1e-6 * pm;
		worst = fmax(worst, dm > 0 ? du / dm : du);
		CHECK(du <= tol,
		      "%s: %s after 2 steps differs by %g (update %g)", label,
		      nm, du, dm);
		moved += dm > 0;
		compared++;
		free(a);
		free(r);
		free(before[i]);
	}
	free(before);
	CHECK(compared == ma->params.n && moved >= compared / 2,
	      "%s: %d of %d parameters moved", label, moved, compared);
	/* who carried what */
	char grad[32];
	snprintf(grad, sizeof grad, "zero%d.%s", zero,
		 zero >= 2 ? "reduce_scatter" : "all_reduce");
	char name[128];
	snprintf(name, sizeof name, "comm.nccl.%s.bytes", grad);
	CHECK(ctr(ca, name) > 0, "%s: %s = %lld", label, name,
	      (long long)ctr(ca, name));
	snprintf(name, sizeof name, "comm.mpi.%s.bytes", grad);
	CHECK(ctr(ca, name) == 0, "%s: the host comm carried gradients", label);
	if (zero >= 1)
		CHECK(ctr(ca, "comm.nccl.zero.all_gather.bytes") > 0 &&
			  ctr(ca, "comm.mpi.zero.all_gather.bytes") == 0,
		      "%s: parameter all-gather not on nccl", label);
	if (ep > 1)
		check_ep_rows(ca, label, config != NULL);
	CHECK(ctr(ca, "kernels.eager_cuda") > 0 &&
		  ctr(ca, "optim.steps.device") == 2,
	      "%s: did not run on the device", label);
	if (rank == 0)
		printf("mpi_nccl_check: %s: losses and parameters match the "
		       "1-rank cpu reference (largest update difference "
		       "%.2e of the update), nccl bytes %lld\n",
		       label, worst, (long long)ctr(ca, "comm.nccl.bytes"));
	epj_corpus_free(corp);
	epj_engine_free(ea);
	epj_engine_free(er);
	epj_model_free(ma);
	epj_model_free(mr);
	epj_ctx_free(ca);
	epj_ctx_free(cr);
}

/* comm.backend "host" with 2 ranks on the cuda device: refused at engine
 * creation with the reason. */
static void check_refuse(void)
{
	epj_ctx *ca = NULL;
	epj_ctx_new("cuda", &ca);
	epj_model_opts mo = { .layout = EPJ_LAYOUT_NESTED,
			      .seed = seed,
			      .dtype = EPJ_DTYPE_F32 };
	epj_model *ma = NULL;
	epj_engine *ea = NULL;
	OK(ca, epj_model_new(ca, NULL, &mo, &ma));
	char *j = ds_json(2, 0, 2, false, "host", false);
	epj_status st = epj_engine_initialize_json(ca, ma, j, "host.json", &ea);
	const char *m = epj_ctx_error(ca);
	CHECK(st == EPJ_ERR_UNSUPPORTED && !ea &&
		  strstr(m, "2 ranks on the cuda device") &&
		  strstr(m, "need NCCL") && strstr(m, "\"host\""),
	      "comm.backend host: %d %s", st, m);
	free(j);
	epj_engine_free(ea);
	epj_model_free(ma);
	epj_ctx_free(ca);
}

int main(void)
{
	char err[512];
	if (epj_dist_init(err, sizeof err) != EPJ_OK) {
		fprintf(stderr, "mpi_nccl_check: %s\n", err);
		return 1;
	}
	ej_comm *w = ej_comm_world();
	rank = w->rank;
	if (w->size != 2) {
		fprintf(stderr,
			"mpi_nccl_check: needs mpirun -np 2 (world %d)\n",
			w->size);
		return 1;
	}
	const char *es = getenv("EPJIT_TEST_SEED");
	seed = es ? strtoull(es, NULL, 10)
		  : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
	epj_ctx *hctx = NULL;
	epj_ctx_new("cpu", &hctx);
	if (ej_comm_bcast(hctx, w, "seed", &seed, sizeof seed, 0) != EPJ_OK) {
		fprintf(stderr, "mpi_nccl_check: %s\n", epj_ctx_error(hctx));
		return 1;
	}
	seed %= 1000000007u;
	if (rank == 0)
		printf("mpi_nccl_check: 2 ranks, EPJIT_TEST_SEED=%llu\n",
		       (unsigned long long)seed);
	if (!hook_on())
		return 1;
	ej_comm *self = ej_comm_self_new();
	epj_ctx *ctx = NULL;
	epj_ctx_new("cuda", &ctx);
	CHECK(ctx && !ctx->dev->host_visible, "no cuda context: %s",
	      ctx ? "host memory" : "epj_ctx_new failed");
	if (ctx)
		check_comm(ctx, w);
	/* f32 (bf16's kernels would double the build time of the run;
	 * MPI_NCCL_CHECK_BF16=1 adds a bf16 arm by hand) */
	check_train(w, self, 2, 2, false, NULL);
	check_train(w, self, 2, 1, false, NULL);
	check_train(w, self, 1, 0, false, NULL);
	check_train(w, self, 1, 2, false, NULL);
	/* Qwen2-MoE's shared expert (t/mpi.sh exports top_srcdir) */
	const char *src = getenv("top_srcdir");
	char q2[4096];
	snprintf(q2, sizeof q2, "%s/t/golden/hf/qwen2_moe/config.json",
		 src ? src : ".");
	FILE *fq = fopen(q2, "r");
	if (fq) {
		fclose(fq);
		check_train(w, self, 2, 2, false, q2);
	} else if (rank == 0) {
		printf("mpi_nccl_check: %s not found: the shared-expert case "
		       "skipped\n",
		       q2);
	}
	if (getenv("MPI_NCCL_CHECK_BF16"))
		check_train(w, self, 1, 2, true, NULL);
	check_refuse();

	float f = (float)failures;
	if (ej_comm_allreduce(hctx, w, "failures", &f, 1) != EPJ_OK)
		f = 1;
	if (rank == 0)
		printf("mpi_nccl_check: %s (%g failure%s over 2 ranks)\n",
		       f == 0 ? "PASS" : "FAIL", f, f == 1 ? "" : "s");
	ej_comm_free(self);
	epj_ctx_free(ctx);
	epj_ctx_free(hctx);
	epj_dist_finalize(f == 0);
	return f == 0 ? 0 : 1;
}
