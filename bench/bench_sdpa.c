/* bench_sdpa.c -- the attention kernels side by side: CPU time per call of
 * sdpa and sdpa_backward, flash against reference (EPJIT_SDPA's two
 * choices), at the benchmark model's attention shape by default (batch 4,
 * 8 query heads over 4 kv heads, seq 256, head dim 32, causal).
 *
 * Both arms run in one process on the same inputs and alternate A B B A
 * within every round, so a load change on a shared machine hits both; the
 * table gives the median over rounds of CPU time (CLOCK_PROCESS_CPUTIME_ID:
 * run it with OMP_NUM_THREADS=1 for per-core figures).  It links the
 * internal library to call the op kernels directly (no autograd around
 * them), and checks that the two arms agree before it times them.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core_impl.h"

#define PROG "bench-sdpa"

static double cpu_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
	return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof *v, cmp_double);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void usage(FILE *fp)
{
	fprintf(fp, "usage: " PROG " [--batch B] [--heads HQ] [--kv-heads "
		    "HKV] [--seq T] [--head-dim D]\n"
		    "                  [--rounds N] [--bf16] [--no-causal]\n"
		    "defaults: the bench model's attention: 4 8 4 256 32, 20 "
		    "rounds, f32, causal\n");
}

typedef struct arm {
	epj_tensor *out[2], *grad[3];
	double fw[1024], bw[1024];
} arm;

/* One forward and one backward call of the chosen kernels; CPU ms into
 * a->fw[r], a->bw[r]; results kept in a. */
static int run_arm(epj_ctx *ctx, bool reference, epj_tensor *const *qkv,
		   epj_tensor *dout, const ej_attrs *at, arm *a, int r)
{
	ctx->sdpa_reference = reference;
	for (int i = 0; i < 2; i++)
		epj_tensor_free(a->out[i]);
	for (int i = 0; i < 3; i++)
		epj_tensor_free(a->grad[i]);
	memset(a->out, 0, sizeof a->out);
	memset(a->grad, 0, sizeof a->grad);
	double t0 = cpu_ms();
	if (ej_dispatch(ctx, EJ_OP_SDPA, (epj_tensor **)qkv, 3, at, a->out,
			2) != EPJ_OK)
		return 1;
	double t1 = cpu_ms();
	epj_tensor *in[6] = {
		dout, qkv[0], qkv[1], qkv[2], a->out[0], a->out[1]
	};
	if (ej_dispatch(ctx, EJ_OP_SDPA_BACKWARD, in, 6, at, a->grad, 3) !=
	    EPJ_OK)
		return 1;
	double t2 = cpu_ms();
	if (r >= 0) {
		a->fw[r] = t1 - t0;
		a->bw[r] = t2 - t1;
	}
	return 0;
}

/* Largest |x - y| / (1 + |y|) over two tensors of one shape. */
static double max_diff(const epj_tensor *x, const epj_tensor *y)
{
	double w = 0;
	for (int64_t i = 0; i < epj_tensor_numel(x); i++) {
		double a = epj_tensor_get_f64(x, i),
		       b = epj_tensor_get_f64(y, i);
		double d = fabs(a - b) / (1 + fabs(b));
		w = d > w ? d : w;
	}
	return w;
}

int main(int argc, char **argv)
{
	long v[6] = { 4, 8, 4, 256, 32, 20 };
	const char *names[6] = { "--batch", "--heads",	  "--kv-heads",
				 "--seq",   "--head-dim", "--rounds" };
	bool bf16 = false, causal = true;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--help")) {
			usage(stdout);
			return 0;
		}
		if (!strcmp(argv[i], "--bf16")) {
			bf16 = true;
			continue;
		}
		if (!strcmp(argv[i], "--no-causal")) {
			causal = false;
			continue;
		}
		int k = 0;
		while (k < 6 && strcmp(argv[i], names[k]) != 0)
			k++;
		char *end = NULL;
		errno = 0;
		long n =
		    k < 6 && i + 1 < argc ? strtol(argv[++i], &end, 10) : 0;
		if (k == 6 || errno || !end || *end || n < 1 ||
		    (k == 5 && n > 1024)) {
			fprintf(stderr, PROG ": bad option %s\n", argv[i]);
			usage(stderr);
			return 2;
		}
		v[k] = n;
	}
	if (v[1] % v[2] != 0) {
		fprintf(stderr, PROG ": --heads must be a multiple of "
				     "--kv-heads\n");
		return 2;
	}
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return 1;
	epj_dtype dt = bf16 ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32;
	int64_t qs[4] = { v[0], v[1], v[3], v[4] };
	int64_t ks[4] = { v[0], v[2], v[3], v[4] };
	epj_tensor *qkv[3] = { epj_randn(ctx, dt, 4, qs, 0, 1),
			       epj_randn(ctx, dt, 4, ks, 0, 1),
			       epj_randn(ctx, dt, 4, ks, 0, 1) };
	epj_tensor *dout = epj_randn(ctx, dt, 4, qs, 0, 1);
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, causal);
	ej_attrs_push_f(&at, 1.0 / sqrt((double)v[4]));
	static arm a[2]; /* 0: flash, 1: reference */
	int rounds = (int)v[5], rc = 1;
	/* warm-up, and the arms must agree */
	if (run_arm(ctx, false, qkv, dout, &at, &a[0], -1) ||
	    run_arm(ctx, true, qkv, dout, &at, &a[1], -1))
		goto done;
	double diff = 0;
	for (int i = 0; i < 5; i++) {
		epj_tensor *x = i < 2 ? a[0].out[i] : a[0].grad[i - 2];
		epj_tensor *y = i < 2 ? a[1].out[i] : a[1].grad[i - 2];
		double d = max_diff(x, y);
		diff = d > diff ? d : diff;
	}
	for (int r = 0; r < rounds; r++) { /* A B B A */
		int order[4] = { 0, 1, 1, 0 };
		for (int k = 0; k < 4; k++)
			if (run_arm(ctx, order[k] == 1, qkv, dout, &at,
				    &a[order[k]], k < 2 ? r : r + rounds))
				goto done;
	}
	printf("sdpa kernels: batch %ld, heads %ld/%ld, seq %ld, head dim "
	       "%ld, %s, %s; %d rounds A B B A\n",
	       v[0], v[1], v[2], v[3], v[4], bf16 ? "bf16" : "f32",
	       causal ? "causal" : "not causal", rounds);
	printf("largest difference flash vs reference: %.2e (relative)\n\n",
	       diff);
	double f[4];
	for (int i = 0; i < 2; i++) {
		f[2 * i] = median(a[i].fw, 2 * rounds);
		f[2 * i + 1] = median(a[i].bw, 2 * rounds);
	}
	printf("| CPU ms per call, median | flash | reference | ratio |\n");
	printf("|-------------------------|------:|----------:|------:|\n");
	printf("| sdpa                    | %5.2f | %9.2f | %5.3f |\n", f[0],
	       f[2], f[0] / f[2]);
	printf("| sdpa_backward           | %5.2f | %9.2f | %5.3f |\n", f[1],
	       f[3], f[1] / f[3]);
	rc = 0;
done:
	if (rc)
		fprintf(stderr, PROG ": %s\n", epj_ctx_error(ctx));
	for (int i = 0; i < 2; i++) {
		for (int k = 0; k < 2; k++)
			epj_tensor_free(a[i].out[k]);
		for (int k = 0; k < 3; k++)
			epj_tensor_free(a[i].grad[k]);
	}
	for (int i = 0; i < 3; i++)
		epj_tensor_free(qkv[i]);
	epj_tensor_free(dout);
	epj_ctx_free(ctx);
	return rc;
}
