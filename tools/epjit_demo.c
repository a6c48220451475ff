/* tools/epjit_demo.c -- the interim main job: ops and autograd end to end.
 *
 * Fits a two-layer MLP classifier (linear -> SiLU -> linear -> cross-entropy)
 * to synthetic data with full-batch SGD, using only the public API in
 * epjit.h: the library builds the graph, epj_backward fills the parameters'
 * .grad, and the update is written by hand through epj_tensor_data.  The
 * labels come from a random linear "teacher", so the task is learnable and
 * the loss must fall; the program fails (exit 1) when it does not.  At the
 * end it prints the context's counters as JSON and the allocator's memory
 * statistics.  Every call is checked: a NULL tensor or a failed status
 * prints the context's error message and exits 1.
 *
 * Usage: epjit-demo [--steps N] [--seed S]
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "epjit.h"

enum {
	N_SAMPLES = 512, /* rows of the synthetic data set */
	D_IN = 16,	 /* input features */
	D_HIDDEN = 32,	 /* hidden units */
	N_CLASSES = 5,
	N_PARAMS = 4,
};

static void die(epj_ctx *ctx, const char *what)
{
	fprintf(stderr, "epjit-demo: %s failed: %s (%s)\n", what,
		ctx ? epj_ctx_error(ctx) : "",
		ctx ? epj_status_name(epj_ctx_status(ctx)) : "no context");
	exit(1);
}

/* Returns t, or exits with the context's error when t is NULL. */
static epj_tensor *must(epj_ctx *ctx, epj_tensor *t, const char *what)
{
	if (!t)
		die(ctx, what);
	return t;
}

static void must_ok(epj_ctx *ctx, epj_status s, const char *what)
{
	if (s != EPJ_OK)
		die(ctx, what);
}

static double now_ms(void)
{
	struct timespec ts; /* C11's clock: no POSIX feature macro needed */
	timespec_get(&ts, TIME_UTC);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Parses a positive integer option value or exits with usage. */
static long parse_long(const char *opt, const char *s)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || *end || v < 0) {
		fprintf(stderr,
			"epjit-demo: %s wants a non-negative integer, "
			"got '%s'\n",
			opt, s);
		exit(2);
	}
	return v;
}

/* Logits [N, C] of the MLP for x [N, D_IN]: silu(x W1^T + b1) W2^T + b2.
 * Returns a new reference. */
static epj_tensor *forward(epj_ctx *ctx, epj_tensor *x, epj_tensor **params)
{
	epj_tensor *h = must(ctx, epj_linear(ctx, x, params[0], params[1]),
			     "epj_linear (layer 1)");
	epj_tensor *a = must(ctx, epj_silu(ctx, h), "epj_silu");
	epj_tensor *logits = must(ctx, epj_linear(ctx, a, params[2], params[3]),
				  "epj_linear (layer 2)");
	epj_tensor_free(h);
	epj_tensor_free(a);
	return logits;
}

/* Fraction of rows whose argmax of logits [N, C] equals the label y [N]. */
static double accuracy(epj_ctx *ctx, epj_tensor *logits, epj_tensor *y)
{
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *vals = NULL, *idx = NULL;
	must_ok(ctx, epj_max(ctx, logits, 1, false, &vals, &idx), "epj_max");
	epj_no_grad_exit(ctx, prev);
	int64_t n = epj_tensor_numel(y), hits = 0;
	for (int64_t i = 0; i < n; i++)
		hits += epj_tensor_get_f64(idx, i) == epj_tensor_get_f64(y, i);
	epj_tensor_free(vals);
	epj_tensor_free(idx);
	return (double)hits / (double)n;
}

/* p -= lr * p.grad through the host data of both (f32), then clears grad. */
static void sgd_update(epj_ctx *ctx, epj_tensor *p, double lr)
{
	epj_tensor *g = epj_tensor_grad(p);
	if (!g) {
		fprintf(stderr, "epjit-demo: a parameter got no gradient\n");
		exit(1);
	}
	/* .grad may in principle be a strided view: read a contiguous copy. */
	epj_tensor *gc = must(ctx, epj_contiguous(ctx, g), "epj_contiguous");
	float *pd = epj_tensor_data(p);
	const float *gd = epj_tensor_data(gc);
	if (!pd || !gd || !epj_tensor_is_contiguous(p)) {
		fprintf(stderr, "epjit-demo: parameter data not on the host\n");
		exit(1);
	}
	int64_t n = epj_tensor_numel(p);
	for (int64_t i = 0; i < n; i++)
		pd[i] -= (float)(lr * gd[i]);
	epj_tensor_free(gc);
	epj_tensor_set_grad(p, NULL);
}

int main(int argc, char **argv)
{
	long steps = 200, seed = 42;
	const double lr = 0.5;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
			steps = parse_long("--steps", argv[++i]);
		} else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
			seed = parse_long("--seed", argv[++i]);
		} else {
			fprintf(stderr,
				"usage: epjit-demo [--steps N] [--seed S]\n");
			return strcmp(argv[i], "--help") ? 2 : 0;
		}
	}

	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK || !ctx) {
		fprintf(stderr, "epjit-demo: epj_ctx_new(\"cpu\") failed\n");
		return 1;
	}
	epj_ctx_seed(ctx, (uint64_t)seed);

	/* Data: x [N, D_IN] ~ N(0, 1); labels y [N] (i64) = argmax of a random
	 * teacher's logits x Wt^T, Wt [C, D_IN]. */
	const int64_t x_shape[2] = { N_SAMPLES, D_IN };
	const int64_t t_shape[2] = { N_CLASSES, D_IN };
	epj_tensor *x =
	    must(ctx, epj_randn(ctx, EPJ_DTYPE_F32, 2, x_shape, 0, 1),
		 "epj_randn (x)");
	epj_tensor *teacher =
	    must(ctx, epj_randn(ctx, EPJ_DTYPE_F32, 2, t_shape, 0, 1),
		 "epj_randn (teacher)");
	epj_tensor *y = NULL;
	{
		bool prev = epj_no_grad_enter(ctx);
		epj_tensor *tl = must(ctx, epj_linear(ctx, x, teacher, NULL),
				      "epj_linear (teacher)");
		epj_tensor *tv = NULL;
		must_ok(ctx, epj_max(ctx, tl, 1, false, &tv, &y),
			"epj_max (labels)");
		epj_no_grad_exit(ctx, prev);
		epj_tensor_free(tl);
		epj_tensor_free(tv);
	}

	/* Parameters: W1 [H, D_IN], b1 [H], W2 [C, H], b2 [C]; weights
	 * N(0, 1/fan_in), biases zero. */
	const int64_t shapes[N_PARAMS][2] = { { D_HIDDEN, D_IN },
					      { D_HIDDEN, 0 },
					      { N_CLASSES, D_HIDDEN },
					      { N_CLASSES, 0 } };
	const char *names[N_PARAMS] = { "W1", "b1", "W2", "b2" };
	epj_tensor *params[N_PARAMS];
	for (int i = 0; i < N_PARAMS; i++) {
		bool weight = i % 2 == 0;
		params[i] = weight
				? epj_randn(ctx, EPJ_DTYPE_F32, 2, shapes[i], 0,
					    1.0 / sqrt((double)shapes[i][1]))
				: epj_zeros(ctx, EPJ_DTYPE_F32, 1, shapes[i]);
		must(ctx, params[i], names[i]);
		epj_tensor_set_requires_grad(params[i], true);
	}

	printf("epjit-demo: 2-layer MLP %d -> %d -> %d on %d synthetic "
	       "samples, full-batch SGD lr %.2f, %ld steps\n",
	       D_IN, D_HIDDEN, N_CLASSES, N_SAMPLES, lr, steps);
	double t0 = now_ms();
	double first_loss = 0, last_loss = 0, last_acc = 0;
	for (long step = 0; step <= steps; step++) {
		epj_tensor *logits = forward(ctx, x, params);
		epj_tensor *loss =
		    must(ctx, epj_cross_entropy(ctx, logits, y, -100),
			 "epj_cross_entropy");
		last_loss = epj_tensor_get_f64(loss, 0);
		if (step == 0)
			first_loss = last_loss;
		if (step % 25 == 0 || step == steps) {
			last_acc = accuracy(ctx, logits, y);
			printf("step %4ld  loss %.4f  accuracy %.3f\n", step,
			       last_loss, last_acc);
		}
		if (step < steps) {
			must_ok(ctx, epj_backward(ctx, loss, NULL),
				"epj_backward");
			for (int i = 0; i < N_PARAMS; i++)
				sgd_update(ctx, params[i], lr);
		}
		epj_tensor_free(loss);
		epj_tensor_free(logits);
	}
	double ms = now_ms() - t0;
	epj_counter_add(ctx, "demo.steps", steps);
	printf("loss %.4f -> %.4f in %ld steps (%.1f ms, %.3f ms/step)\n",
	       first_loss, last_loss, steps, ms, steps ? ms / steps : 0.0);

	epj_counters *c = epj_counters_snapshot(ctx);
	if (!c)
		die(ctx, "epj_counters_snapshot");
	char *json = epj_counters_to_json(c);
	if (!json)
		die(ctx, "epj_counters_to_json");
	printf("counters: %s\n", json);
	free(json);
	epj_counters_free(c);

	epj_memory_stats ms_stats;
	epj_memory_stats_get(ctx, &ms_stats);
	printf("memory: allocated %" PRIu64 " B, reserved %" PRIu64
	       " B, peak allocated %" PRIu64 " B, peak reserved %" PRIu64
	       " B, %" PRIu64 " allocs (%" PRIu64 " from cache), %" PRIu64
	       " frees\n",
	       ms_stats.allocated, ms_stats.reserved, ms_stats.peak_allocated,
	       ms_stats.peak_reserved, ms_stats.num_allocs, ms_stats.cache_hits,
	       ms_stats.num_frees);

	for (int i = 0; i < N_PARAMS; i++)
		epj_tensor_free(params[i]);
	epj_tensor_free(y);
	epj_tensor_free(teacher);
	epj_tensor_free(x);
	epj_ctx_free(ctx);

	/* The task is learnable: the loss must fall, and by half in a run of
	 * 50 steps or more (the default run ends near 1/30 of its start). */
	double want = steps >= 50 ? 0.5 * first_loss : first_loss;
	if (steps > 0 && !(last_loss < want)) {
		fprintf(stderr,
			"epjit-demo: loss did not fall enough (%.4f -> "
			"%.4f)\n",
			first_loss, last_loss);
		return 1;
	}
	return 0;
}
