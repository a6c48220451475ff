/* check_util.c -- shared helpers of the Check suites: seeds, random tensors,
 * comparisons against double references, and the finite-difference gradient
 * check every differentiable op is tested with. */
#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static uint64_t seed_value;
static bool seed_done;
static uint64_t rng_state;
static uint64_t ctx_counter;

uint64_t tu_seed(void)
{
	if (!seed_done) {
		const char *e = getenv("EPJIT_TEST_SEED");
		if (e && *e)
			seed_value = strtoull(e, NULL, 0);
		else
			seed_value =
			    ((uint64_t)time(NULL) << 16) ^ (uint64_t)getpid();
		rng_state = seed_value * 0x9E3779B97F4A7C15ull + 1;
		seed_done = true;
	}
	return seed_value;
}

static uint64_t next_u64(void)
{
	tu_seed();
	/* splitmix64 */
	uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
	return z ^ (z >> 31);
}

int64_t tu_randint(int64_t lo, int64_t hi)
{
	ck_assert(hi > lo);
	return lo + (int64_t)(next_u64() % (uint64_t)(hi - lo));
}

double tu_uniform(double lo, double hi)
{
	return lo + (hi - lo) * ((double)(next_u64() >> 11) * 0x1.0p-53);
}

epj_ctx *tu_ctx(void)
{
	epj_ctx *ctx = NULL;
	ck_assert_int_eq(epj_ctx_new("cpu", &ctx), EPJ_OK);
	epj_ctx_seed(ctx, tu_seed() + 7919 * ++ctx_counter + next_u64());
	return ctx;
}

epj_tensor *tu_randn(epj_ctx *ctx, epj_dtype dt, int ndim, const int64_t *shape)
{
	epj_tensor *t = epj_randn(ctx, dt, ndim, shape, 0.0, 1.0);
	tu_ok(ctx, t);
	return t;
}

double *tu_values(epj_ctx *ctx, const epj_tensor *t)
{
	int64_t n = epj_tensor_numel(t);
	double *v = malloc(sizeof *v * (size_t)(n > 0 ? n : 1));
	ck_assert_ptr_nonnull(v);
	ck_assert_int_eq(epj_tensor_to_f64(ctx, t, v), EPJ_OK);
	return v;
}

epj_tensor *tu_noncontig(epj_ctx *ctx, epj_tensor *t)
{
	int nd = epj_tensor_ndim(t);
	const int64_t *sh = epj_tensor_shape(t);
	double *vals = tu_values(ctx, t);
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *view = NULL;
	if (nd >= 2) {
		/* Storage laid out with the dims reversed, viewed back. */
		int64_t rsh[EPJ_MAX_DIMS];
		int perm[EPJ_MAX_DIMS];
		for (int i = 0; i < nd; i++) {
			rsh[i] = sh[nd - 1 - i];
			perm[i] = nd - 1 - i;
		}
		epj_tensor *buf = epj_zeros(ctx, epj_tensor_dtype(t), nd, rsh);
		tu_ok(ctx, buf);
		view = epj_permute(ctx, buf, perm);
		epj_tensor_free(buf);
	} else if (nd == 1) {
		/* Every second element of a buffer twice as long. */
		int64_t n2 = sh[0] * 2;
		epj_tensor *buf = epj_zeros(ctx, epj_tensor_dtype(t), 1, &n2);
		tu_ok(ctx, buf);
		view = epj_slice(ctx, buf, 0, 1, n2, 2);
		epj_tensor_free(buf);
	} else {
		view = epj_zeros(ctx, epj_tensor_dtype(t), 0, sh);
	}
	tu_ok(ctx, view);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, view, vals), EPJ_OK);
	epj_no_grad_exit(ctx, prev);
	free(vals);
	return view;
}

static bool close_enough(double a, double r, double rtol, double atol)
{
	if (isnan(r))
		return isnan(a);
	if (isinf(r))
		return a == r;
	return fabs(a - r) <= atol + rtol * fabs(r);
}

void tu_assert_close(epj_ctx *ctx, const epj_tensor *t, const double *ref,
		     double rtol, double atol, const char *what)
{
	int64_t n = epj_tensor_numel(t);
	double *v = tu_values(ctx, t);
	int64_t worst = -1, bad = 0;
	double worst_err = -1;
	for (int64_t i = 0; i < n; i++) {
		if (close_enough(v[i], ref[i], rtol, atol))
			continue;
		bad++;
		double err = fabs(v[i] - ref[i]) / (atol + rtol * fabs(ref[i]));
		if (isnan(err) || err > worst_err) {
			worst_err = isnan(err) ? INFINITY : err;
			worst = i;
		}
	}
	double got = worst >= 0 ? v[worst] : 0,
	       want = worst >= 0 ? ref[worst] : 0;
	free(v);
	ck_assert_msg(bad == 0,
		      "%s: %lld of %lld elements differ; worst at %lld: got "
		      "%.9g want %.9g (rtol %g atol %g, seed %llu)",
		      what, (long long)bad, (long long)n, (long long)worst, got,
		      want, rtol, atol, (unsigned long long)tu_seed());
}

void tu_assert_tensors_close(epj_ctx *ctx, const epj_tensor *a,
			     const epj_tensor *b, double rtol, double atol,
			     const char *what)
{
	ck_assert_int_eq(epj_tensor_ndim(a), epj_tensor_ndim(b));
	for (int i = 0; i < epj_tensor_ndim(a); i++)
		ck_assert_int_eq(epj_tensor_dim(a, i), epj_tensor_dim(b, i));
	double *rb = tu_values(ctx, b);
	tu_assert_close(ctx, a, rb, rtol, atol, what);
	free(rb);
}

/* sum(out * w) in double, for a forward evaluation under no-grad. */
static double weighted_sum(epj_ctx *ctx, tu_fn fn, epj_tensor *const *in,
			   void *user, const double *w, int64_t nw)
{
	epj_tensor *out = fn(ctx, in, user);
	tu_ok(ctx, out);
	ck_assert_int_eq(epj_tensor_numel(out), nw);
	double *v = tu_values(ctx, out);
	double s = 0;
	for (int64_t i = 0; i < nw; i++)
		s += v[i] * w[i];
	free(v);
	epj_tensor_free(out);
	return s;
}

void tu_gradcheck(epj_ctx *ctx, tu_fn fn, epj_tensor *const *in, int n_in,
		  void *user, double eps, double rtol, double atol,
		  const char *what)
{
	for (int i = 0; i < n_in; i++)
		if (in[i])
			epj_tensor_zero_grad(in[i]);
	epj_tensor *out = fn(ctx, in, user);
	tu_ok(ctx, out);
	ck_assert_msg(epj_tensor_requires_grad(out),
		      "%s: output does not require grad", what);
	int64_t nw = epj_tensor_numel(out);
	epj_tensor *wt =
	    epj_randn(ctx, epj_tensor_dtype(out), epj_tensor_ndim(out),
		      epj_tensor_shape(out), 0.0, 1.0);
	tu_ok(ctx, wt);
	double *w = tu_values(ctx, wt);
	epj_tensor *prod = epj_mul(ctx, out, wt);
	epj_tensor *loss = epj_sum_all(ctx, prod);
	tu_ok(ctx, loss);
	ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s: %s", what,
		      epj_ctx_error(ctx));
	epj_tensor_free(loss);
	epj_tensor_free(prod);
	epj_tensor_free(out);
	epj_tensor_free(wt);

	bool prev = epj_no_grad_enter(ctx);
	for (int i = 0; i < n_in; i++) {
		if (!in[i] || !epj_tensor_requires_grad(in[i]))
			continue;
		epj_tensor *g = epj_tensor_grad(in[i]);
		ck_assert_msg(g != NULL, "%s: input %d got no gradient", what,
			      i);
		double *ga = tu_values(ctx, g);
		int64_t n = epj_tensor_numel(in[i]);
		/* Large inputs: check a random subset of elements. */
		int64_t checks = n <= 400 ? n : 200;
		for (int64_t c = 0; c < checks; c++) {
			int64_t k = n <= 400 ? c : tu_randint(0, n);
			double x0 = epj_tensor_get_f64(in[i], k);
			epj_tensor_set_f64(in[i], k, x0 + eps);
			double lp = weighted_sum(ctx, fn, in, user, w, nw);
			epj_tensor_set_f64(in[i], k, x0 - eps);
			double lm = weighted_sum(ctx, fn, in, user, w, nw);
			epj_tensor_set_f64(in[i], k, x0);
			double num = (lp - lm) / (2 * eps);
			ck_assert_msg(close_enough(ga[k], num, rtol, atol),
				      "%s: d/d input %d [%lld]: analytic %.9g "
				      "numeric %.9g (eps %g rtol %g atol %g, "
				      "seed %llu)",
				      what, i, (long long)k, ga[k], num, eps,
				      rtol, atol,
				      (unsigned long long)tu_seed());
		}
		free(ga);
	}
	epj_no_grad_exit(ctx, prev);
	free(w);
}
