/* check_compile.c -- STUB: replaced by the real suite. */
#include "check_util.h"

START_TEST(test_placeholder)
{
	ck_assert_int_eq(1, 1);
}
END_TEST

Suite *make_compile_suite(void)
{
	Suite *s = suite_create("compile");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_placeholder);
	suite_add_tcase(s, tc);
	return s;
}
