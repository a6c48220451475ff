/* check_templates.c -- the CUDA C templates (templates/<name>.cuh through
 * kernels/tmpl.c): each runs on cuda-sim against a CPU reference on fresh
 * random inputs at odd sizes (race check and poisoned outputs on), and
 * every embedded template compiles under NVRTC for sm_80, sm_90 and sm_100
 * without a warning.
 *
 * Each test gets a private kernel cache directory and an empty module
 * table.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cc.h"
#include "tmpl.h"

static char *cache_dir;

static void cache_setup(void)
{
	cache_dir = tu_tmpdir_new("tmpl");
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

/* ---- fill ------------------------------------------------------------------
 */

struct fill_args {
	void *out;
	long long n;
	unsigned long long bits;
	int elem;
};

START_TEST(test_fill)
{
	epj_ctx *ctx = tu_ctx();
	static const ej_tmpl_kernel k[] = { { "ej_fill",
					      "struct ej_fill_args" } };
	ej_tmpl *m = NULL;
	ck_assert_int_eq(ej_tmpl_get(ctx, "cuda-sim", "fill", NULL, k, 1, &m),
			 EPJ_OK);
	ej_tmpl *again = NULL;
	ck_assert_int_eq(
	    ej_tmpl_get(ctx, "cuda-sim", "fill", NULL, k, 1, &again), EPJ_OK);
	ck_assert_ptr_eq(m, again); /* the process table serves it */
	static const int elems[] = { 1, 2, 4, 8 };
	for (int e = 0; e < 4; e++) {
		int elem = elems[e];
		long long n = tu_randint(1, 3000) | 1;
		unsigned long long bits = 0;
		for (int b = 0; b < elem; b++)
			bits |= (unsigned long long)tu_randint(1, 255)
				<< (8 * b);
		unsigned char *buf = malloc((size_t)n * (size_t)elem);
		ck_assert_ptr_nonnull(buf);
		struct fill_args a = { buf, n, bits, elem };
		ej_launch_out lo = { buf, (size_t)n * (size_t)elem,
				     (size_t)(elem >= 2 ? elem : 2) };
		if (elem == 1)
			lo.elem = 1;
		unsigned grid = (unsigned)tu_randint(1, 5);
		ej_launch l = { .grid = { grid, 1, 1 },
				.block = { 96, 1, 1 },
				.args = &a,
				.args_size = sizeof a,
				.outs = &lo,
				.n_out = elem == 1 ? 0 : 1 };
		ck_assert_msg(ej_tmpl_launch(ctx, m, "ej_fill", &l) == EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		for (long long i = 0; i < n; i++)
			for (int b = 0; b < elem; b++)
				ck_assert_uint_eq(
				    buf[i * elem + b],
				    (unsigned)((bits >> (8 * b)) & 0xff));
		free(buf);
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	static const ej_tmpl_kernel k[] = { { "ej_fill",
					      "struct ej_fill_args" } };
	static const ej_tmpl_kernel bad[] = { { "ej_nope",
						"struct ej_fill_args" } };
	ej_tmpl *m = NULL;
	epj_status st =
	    ej_tmpl_get(ctx, "cuda-sim", "no_such_template", NULL, k, 1, &m);
	ck_assert_int_eq(st, EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID,
			    (const char *const[]){ "no_such_template" }, 1);
	ck_assert_ptr_null(m);
	st = ej_tmpl_get(ctx, "cpu", "fill", NULL, k, 1, &m);
	ck_assert_int_eq(st, EPJ_ERR_INVALID);
	tu_assert_ctx_error(ctx, EPJ_ERR_INVALID,
			    (const char *const[]){ "runs no CUDA C" }, 1);
	/* the kernel is declared by the source and so resolves only when it
	 * is there: a missing one fails and the module is not kept */
	st = ej_tmpl_get(ctx, "cuda-sim", "fill", "#define EJ_UNUSED 1", bad, 1,
			 &m);
	ck_assert_int_ne(st, EPJ_OK);
	ck_assert_ptr_null(m);
	ck_assert_int_eq(ej_tmpl_get(ctx, "cuda-sim", "fill",
				     "#define EJ_UNUSED 1", k, 1, &m),
			 EPJ_OK);
	ck_assert_int_eq(ej_tmpl_launch(ctx, m, "ej_other", NULL) == EPJ_OK, 0);
	epj_ctx_free(ctx);
}
END_TEST

/* Every embedded template compiles under NVRTC for the three archs the
 * project supports, with an empty log (no warning).  (A third of the
 * template x arch pairs under EPJIT_CHECK_QUICK: tu_quick_keep.) */
START_TEST(test_nvrtc_all)
{
	int maj = 0, min = 0;
	if (!ej_nvrtc_version(&maj, &min)) {
		printf("test_nvrtc_all: built without NVRTC, skipped\n");
		return;
	}
	epj_ctx *ctx = tu_ctx();
	static const char *const archs[] = { "sm_80", "sm_90", "sm_100" };
	int n = 0;
	for (const char *const *t = ej_tmpl_names(); *t; t++) {
		ej_arena *A = ej_arena_new();
		const char *src = ej_tmpl_source(ctx, A, *t, NULL);
		ck_assert_ptr_nonnull(src);
		for (int a = 0; a < 3; a++) {
			if (!tu_quick_keep(3 * n + a))
				continue;
			ej_nvrtc_result r = { 0 };
			epj_status st = ej_nvrtc_compile(ctx, src, *t, archs[a],
							 NULL, 0, &r);
			ck_assert_msg(st == EPJ_OK, "%s %s: %s", *t, archs[a],
				      epj_ctx_error(ctx));
			ck_assert_msg(!r.log || !*r.log,
				      "%s %s: NVRTC said: %s", *t, archs[a],
				      r.log);
			ck_assert_uint_gt(r.size, 0);
			ej_nvrtc_result_free(&r);
		}
		ej_arena_free(A);
		n++;
	}
	ck_assert_int_ge(n, 1);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_templates_suite(void)
{
	Suite *s = suite_create("templates");
	TCase *tc = tcase_create("sim");
	tcase_add_checked_fixture(tc, cache_setup, cache_teardown);
	/* a guard against a hang: NVRTC compiles every template for three
	 * archs, minutes on a loaded 2-core machine under the sanitizers */
	tcase_set_timeout(tc, 1500);
	tcase_add_test(tc, test_fill);
	tcase_add_test(tc, test_errors);
	tcase_add_test(tc, test_nvrtc_all);
	suite_add_tcase(s, tc);
	return s;
}
