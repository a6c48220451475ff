/* check_util.h -- shared helpers of the Check suites.
 *
 * Randomness: every suite draws from a seed that is fresh per run (time and
 * pid) unless EPJIT_TEST_SEED is set; the runner prints the seed first, so a
 * failing run can be replayed exactly.
 */
#ifndef EPJIT_CHECK_UTIL_H
#define EPJIT_CHECK_UTIL_H

#include <check.h>
#include <stdint.h>

#include "epjit.h"

/* Suites (one per module), listed in check_main.c. */
Suite *make_tensor_suite(void);
Suite *make_alloc_suite(void);
Suite *make_autograd_suite(void);
Suite *make_counters_suite(void);
Suite *make_ops_pointwise_suite(void);
Suite *make_ops_reduce_suite(void);
Suite *make_ops_linalg_suite(void);
Suite *make_ops_attention_suite(void);
Suite *make_ops_index_suite(void);
Suite *make_ops_shape_suite(void);
Suite *make_config_suite(void);
Suite *make_model_config_suite(void);
Suite *make_safetensors_suite(void);
Suite *make_data_suite(void);
Suite *make_autoep_suite(void);
Suite *make_module_suite(void);
Suite *make_optim_suite(void);
Suite *make_model_suite(void);
Suite *make_engine_suite(void);
Suite *make_jit_suite(void);
Suite *make_compile_suite(void);
Suite *make_parity_suite(void);
Suite *make_kcache_suite(void);
Suite *make_cc_suite(void);

/* The run's base seed. */
uint64_t tu_seed(void);
/* A fresh context (cpu) seeded from tu_seed() and a per-call counter. */
epj_ctx *tu_ctx(void);
/* Uniform integer in [lo, hi) from the test RNG (seeded from tu_seed). */
int64_t tu_randint(int64_t lo, int64_t hi);
double tu_uniform(double lo, double hi);

/* Random normal tensor (mean 0, std 1) from ctx's RNG. */
epj_tensor *tu_randn(epj_ctx *ctx, epj_dtype dt, int ndim,
		     const int64_t *shape);
/* Same values as t, stored non-contiguously (a transposed or strided buffer
 * viewed back to t's shape).  t must have ndim >= 1. */
epj_tensor *tu_noncontig(epj_ctx *ctx, epj_tensor *t);
/* All elements as a malloc'ed double array (caller frees). */
double *tu_values(epj_ctx *ctx, const epj_tensor *t);

/* Fails the test unless every element satisfies
 * |t - ref| <= atol + rtol * |ref| (NaN only matches NaN, Inf equal Inf).
 * Prints the worst element on failure. */
void tu_assert_close(epj_ctx *ctx, const epj_tensor *t, const double *ref,
		     double rtol, double atol, const char *what);
/* Same between two tensors of one shape. */
void tu_assert_tensors_close(epj_ctx *ctx, const epj_tensor *a,
			     const epj_tensor *b, double rtol, double atol,
			     const char *what);
/* Fails with the context message when t is NULL. */
#define tu_ok(ctx, t) ck_assert_msg((t) != NULL, "%s", epj_ctx_error(ctx))

/* Gradient check.  fn maps the inputs to one output tensor.  The check draws
 * a random weight w shaped like the output, backpropagates sum(out * w)
 * through fn, and compares every input's gradient (for inputs with
 * requires_grad set) against central differences of sum(out * w) computed
 * in double with step eps.  Use f64 inputs wherever the op allows. */
typedef epj_tensor *(*tu_fn)(epj_ctx *ctx, epj_tensor *const *in, void *user);
void tu_gradcheck(epj_ctx *ctx, tu_fn fn, epj_tensor *const *in, int n_in,
		  void *user, double eps, double rtol, double atol,
		  const char *what);

#endif
