/* check_parity.c -- the parity matrix of the region compiler: nested and
 * root layouts x activation checkpointing off/on x f32/bf16 x regional and
 * full-model compile, each through the library harness (epj_parity_run),
 * which compares outputs, loss, gradients by group, FP32 master updates,
 * exact routing, eager AutoEP call counts and compile-counter stability. */
#include "check_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void run_case(epj_layout layout, bool ckpt, bool bf16, bool regional,
		     bool async_plan, const char *backend)
{
	epj_parity_opts o = { .backend = backend,
			      .layout = layout,
			      .checkpointing = ckpt,
			      .bf16 = bf16,
			      .regional = regional,
			      .async_split_plan = async_plan,
			      .batch = tu_randint(1, 4),
			      .seq = tu_randint(3, 12),
			      .seed = tu_seed() };
	char *buf = NULL;
	size_t len = 0;
	FILE *out = open_memstream(&buf, &len);
	ck_assert_ptr_nonnull(out);
	bool passed = false;
	epj_status st = epj_parity_run(&o, out, &passed);
	fclose(out);
	ck_assert_msg(
	    st == EPJ_OK && passed, "parity %s/%s/%s/%s/%s: status %s\n%s",
	    layout == EPJ_LAYOUT_ROOT ? "root" : "nested",
	    ckpt ? "ckpt" : "no-ckpt", bf16 ? "bf16" : "f32",
	    regional ? "regional" : "full-model", backend ? backend : "default",
	    epj_status_name(st), buf ? buf : "");
	/* the table must report every quantity */
	const char *rows[] = { "logits",
			       "loss",
			       "input grad",
			       "router grads",
			       "expert grads",
			       "dense grads",
			       "fp32 master update",
			       "routing mismatches",
			       "eager AutoEP calls",
			       "d stats.unique_graphs",
			       "d recompiles",
			       "update=-grad eager",
			       "update=-grad compiled",
			       "regions ran compiled",
			       "eager arm compiled" };
	for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
		ck_assert_msg(strstr(buf, rows[i]) != NULL, "missing row %s",
			      rows[i]);
	free(buf);
}

START_TEST(test_matrix)
{
	/* _i encodes layout, checkpointing, dtype, mode */
	int i = _i;
	run_case(i & 1 ? EPJ_LAYOUT_ROOT : EPJ_LAYOUT_NESTED, i & 2, i & 4,
		 !(i & 8), false, NULL);
}
END_TEST

START_TEST(test_async_split_plan)
{
	run_case(EPJ_LAYOUT_NESTED, true, true, true, true, NULL);
}
END_TEST

/* The matrix above runs the default backend (generated C on the cpu); the
 * interpreter backend must agree too. */
START_TEST(test_interpreter)
{
	int i = _i;
	run_case(i & 1 ? EPJ_LAYOUT_ROOT : EPJ_LAYOUT_NESTED, i & 2, i & 4,
		 true, false, "interpreter");
}
END_TEST

Suite *make_parity_suite(void)
{
	Suite *s = suite_create("parity");
	TCase *tc = tcase_create("matrix");
	tcase_set_timeout(tc, 120);
	tcase_add_loop_test(tc, test_matrix, 0, 16);
	tcase_add_test(tc, test_async_split_plan);
	tcase_add_loop_test(tc, test_interpreter, 0, 8);
	suite_add_tcase(s, tc);
	return s;
}
