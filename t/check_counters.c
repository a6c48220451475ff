/* check_counters.c -- named counters, snapshots, diffs, JSON; content hash.
 *
 * Counters are checked against a model array kept in the test (random names
 * and values); JSON against round trips and a list of malformed inputs.  The
 * hash is checked against the published XXH3-128 value of the empty input
 * and for its basic properties (determinism, sensitivity, hex layout).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"
#include "core_impl.h"

START_TEST(test_add_set_get)
{
	epj_ctx *ctx = tu_ctx();
	ck_assert_int_eq(epj_counter_get(ctx, "nope"), 0);
	epj_counter_add(ctx, "a.b", 5);
	epj_counter_add(ctx, "a.b", -2);
	ck_assert_int_eq(epj_counter_get(ctx, "a.b"), 3);
	epj_counter_set(ctx, "gauge", 42);
	epj_counter_set(ctx, "gauge", 7);
	ck_assert_int_eq(epj_counter_get(ctx, "gauge"), 7);
	/* slots never move, however many counters follow */
	int64_t *slot = ej_counter_slot(ctx, "a.b");
	char name[32];
	for (int i = 0; i < 300; i++) {
		snprintf(name, sizeof name, "%c.filler.%d", 'a' + i % 26, i);
		epj_counter_add(ctx, name, i);
	}
	ck_assert_ptr_eq(ej_counter_slot(ctx, "a.b"), slot);
	*slot += 10;
	ck_assert_int_eq(epj_counter_get(ctx, "a.b"), 13);
	ck_assert_int_eq(epj_counter_get(ctx, "q.filler.16"), 16);
	/* the context created this one */
	ck_assert_ptr_eq(ej_counter_slot(ctx, "kernels.launched.eager"),
			 ctx->ctr_eager_launches);
	epj_counter_add(NULL, "x", 1);
	epj_counter_add(ctx, NULL, 1);
	ck_assert_int_eq(epj_counter_get(NULL, "x"), 0);
	epj_ctx_free(ctx);
}
END_TEST

typedef struct {
	char name[32];
	int64_t value;
} model_entry;

static int model_cmp(const void *a, const void *b)
{
	return strcmp(((const model_entry *)a)->name,
		      ((const model_entry *)b)->name);
}

/* Random counters; a snapshot has exactly them (sorted) plus memory.*. */
START_TEST(test_snapshot_diff)
{
	epj_ctx *ctx = tu_ctx();
	int n = (int)tu_randint(5, 40);
	model_entry m[40];
	for (int i = 0; i < n; i++) {
		snprintf(m[i].name, sizeof m[i].name, "k%03d.%c",
			 (int)tu_randint(0, 1000), 'a' + i % 26);
		m[i].value = 0;
	}
	/* dedupe names (random draws may repeat) */
	qsort(m, (size_t)n, sizeof *m, model_cmp);
	int u = 0;
	for (int i = 0; i < n; i++)
		if (u == 0 || strcmp(m[u - 1].name, m[i].name) != 0)
			m[u++] = m[i];
	n = u;
	for (int r = 0; r < 5 * n; r++) {
		int i = (int)tu_randint(0, n);
		int64_t d = tu_randint(-1000000, 1000000);
		m[i].value += d;
		epj_counter_add(ctx, m[i].name, d);
	}
	/* a live counter named like a memory.* entry loses to the allocator */
	epj_counter_set(ctx, "memory.allocated", -5);
	const int64_t sh[] = { 13, 3 };
	epj_tensor *t = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	epj_counters *a = epj_counters_snapshot(ctx);
	ck_assert_ptr_nonnull(a);
	for (int i = 0; i < n; i++)
		ck_assert_int_eq(epj_counters_value(a, m[i].name), m[i].value);
	epj_memory_stats ms;
	epj_memory_stats_get(ctx, &ms);
	ck_assert_int_eq(epj_counters_value(a, "memory.allocated"),
			 (int64_t)ms.allocated);
	ck_assert_int_gt(epj_counters_value(a, "memory.allocated"), 0);
	ck_assert_int_eq(epj_counters_value(a, "memory.reserved"),
			 (int64_t)ms.reserved);
	ck_assert_int_eq(epj_counters_value(a, "memory.peak_allocated"),
			 (int64_t)ms.peak_allocated);
	ck_assert_int_eq(epj_counters_value(a, "memory.peak_reserved"),
			 (int64_t)ms.peak_reserved);
	ck_assert_int_eq(epj_counters_value(a, "memory.num_allocs"),
			 (int64_t)ms.num_allocs);
	ck_assert_int_eq(epj_counters_value(a, "memory.device_allocs"),
			 (int64_t)ms.num_device_allocs);
	ck_assert_int_gt(epj_counters_value(a, "memory.device_allocs"), 0);
	ck_assert_int_eq(epj_counters_value(a, "memory.device_frees"),
			 (int64_t)ms.num_device_frees);
	/* the model counters, 7 memory.*, and whatever the context keeps
	 * (kernels.launched.eager ...), each with its live value */
	ck_assert_int_ge(epj_counters_count(a), n + 7);
	int n_alloc_names = 0;
	for (int i = 0; i < epj_counters_count(a); i++)
		n_alloc_names +=
		    !strcmp(epj_counters_name_at(a, i), "memory.allocated");
	ck_assert_int_eq(n_alloc_names, 1);
	for (int i = 0; i < epj_counters_count(a); i++) {
		const char *nm = epj_counters_name_at(a, i);
		if (strncmp(nm, "memory.", 7) != 0)
			ck_assert_int_eq(epj_counters_value_at(a, i),
					 epj_counter_get(ctx, nm));
	}
	for (int i = 1; i < epj_counters_count(a); i++)
		ck_assert_int_lt(strcmp(epj_counters_name_at(a, i - 1),
					epj_counters_name_at(a, i)),
				 0);
	for (int i = 0; i < epj_counters_count(a); i++)
		ck_assert_int_eq(
		    epj_counters_value_at(a, i),
		    epj_counters_value(a, epj_counters_name_at(a, i)));
	ck_assert_ptr_null(epj_counters_name_at(a, -1));
	ck_assert_ptr_null(epj_counters_name_at(a, epj_counters_count(a)));
	ck_assert_int_eq(epj_counters_value(a, "absent"), 0);

	/* change some, add a new one, free the tensor; diff = b - a */
	int i0 = (int)tu_randint(0, n);
	epj_counter_add(ctx, m[i0].name, 17);
	epj_counter_add(ctx, "zz.new", 4);
	epj_tensor_free(t);
	epj_counters *b = epj_counters_snapshot(ctx);
	epj_counters *d = epj_counters_diff(a, b);
	ck_assert_ptr_nonnull(d);
	ck_assert_int_eq(epj_counters_count(d), epj_counters_count(b));
	for (int i = 0; i < n; i++)
		ck_assert_int_eq(epj_counters_value(d, m[i].name),
				 i == i0 ? 17 : 0);
	ck_assert_int_eq(epj_counters_value(d, "zz.new"), 4);
	ck_assert_int_eq(epj_counters_value(d, "memory.allocated"),
			 -epj_counters_value(a, "memory.allocated"));
	/* names only in a appear negated */
	epj_counters *r = epj_counters_diff(b, a);
	ck_assert_int_eq(epj_counters_value(r, "zz.new"), -4);
	epj_counters *e = epj_counters_diff(NULL, a);
	ck_assert_int_eq(epj_counters_count(e), epj_counters_count(a));
	epj_counters_free(e);
	epj_counters_free(r);
	epj_counters_free(d);
	epj_counters_free(b);
	epj_counters_free(a);
	epj_counters_free(NULL);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_json_roundtrip)
{
	epj_ctx *ctx = tu_ctx();
	epj_counter_set(ctx, "max", INT64_MAX);
	epj_counter_set(ctx, "min", INT64_MIN);
	epj_counter_set(ctx, "b.quote\"d", -1);
	for (int i = 0; i < 13; i++) {
		char nm[32];
		snprintf(nm, sizeof nm, "r.%d", (int)tu_randint(0, 1 << 20));
		epj_counter_add(ctx, nm, tu_randint(-(1LL << 40), 1LL << 40));
	}
	epj_counters *a = epj_counters_snapshot(ctx);
	char *js = epj_counters_to_json(a);
	ck_assert_ptr_nonnull(js);
	ck_assert_ptr_nonnull(strstr(js, "\n  \"")); /* indent 2 */
	ck_assert_ptr_nonnull(strstr(js, "9223372036854775807"));
	/* sorted keys: "b.quote..." before "max" before "min" */
	char *pb = strstr(js, "\"b.quote"), *pm = strstr(js, "\"max\""),
	     *pn = strstr(js, "\"min\"");
	ck_assert(pb && pm && pn && pb < pm && pm < pn);
	epj_counters *b = epj_counters_from_json(js);
	ck_assert_ptr_nonnull(b);
	ck_assert_int_eq(epj_counters_count(b), epj_counters_count(a));
	for (int i = 0; i < epj_counters_count(a); i++) {
		ck_assert_str_eq(epj_counters_name_at(b, i),
				 epj_counters_name_at(a, i));
		ck_assert_int_eq(epj_counters_value_at(b, i),
				 epj_counters_value_at(a, i));
	}
	/* unsorted input is sorted on load */
	epj_counters *c = epj_counters_from_json("{\"z\": 1, \"a\": -2}");
	ck_assert_ptr_nonnull(c);
	ck_assert_str_eq(epj_counters_name_at(c, 0), "a");
	ck_assert_int_eq(epj_counters_value_at(c, 0), -2);
	epj_counters *empty = epj_counters_from_json("{}");
	ck_assert_ptr_nonnull(empty);
	ck_assert_int_eq(epj_counters_count(empty), 0);
	char *ej = epj_counters_to_json(empty);
	ck_assert_str_eq(ej, "{}");
	free(ej);
	epj_counters_free(empty);
	epj_counters_free(c);
	epj_counters_free(b);
	free(js);
	epj_counters_free(a);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_json_malformed)
{
	static const char *bad[] = {
		"",
		"{",
		"[1, 2]",
		"null",
		"42",
		"{\"a\": 1.5}",
		"{\"a\": \"1\"}",
		"{\"a\": true}",
		"{\"a\": null}",
		"{\"a\": {\"b\": 1}}",
		"{\"a\": [1]}",
		"{\"a\": 1,}",
		"{\"a\": 1} trailing",
		"{\"a\": 1, \"a\": 2}", /* duplicate keys are rejected */
		"{a: 1}",
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(bad); i++)
		ck_assert_msg(epj_counters_from_json(bad[i]) == NULL,
			      "accepted malformed counters JSON: %s", bad[i]);
	ck_assert_ptr_null(epj_counters_from_json(NULL));
	ck_assert_ptr_null(epj_counters_to_json(NULL));
}
END_TEST

/* ---- hash ------------------------------------------------------------------
 */

START_TEST(test_hash)
{
	char hex[33];
	/* published XXH3-128 (seed 0) of the empty input */
	epj_hash_hex(epj_hash("", 0), hex);
	ck_assert_str_eq(hex, "99aa06d3014798d86001c324468d497f");
	epj_hash128 e = epj_hash(NULL, 0);
	ck_assert(e.hi == 0x99aa06d3014798d8ull &&
		  e.lo == 0x6001c324468d497full);

	enum { N = 1000 };
	unsigned char buf[N];
	for (int i = 0; i < N; i++)
		buf[i] = (unsigned char)tu_randint(0, 256);
	size_t len = (size_t)tu_randint(1, N + 1);
	epj_hash128 h1 = epj_hash(buf, len), h2 = epj_hash(buf, len);
	ck_assert(h1.lo == h2.lo && h1.hi == h2.hi);
	/* any single flipped bit changes both halves (w.h.p.) */
	for (int k = 0; k < 50; k++) {
		size_t pos = (size_t)tu_randint(0, (int64_t)len);
		unsigned char bit = (unsigned char)(1u << tu_randint(0, 8));
		buf[pos] ^= bit;
		epj_hash128 h3 = epj_hash(buf, len);
		buf[pos] ^= bit;
		ck_assert(h3.lo != h1.lo && h3.hi != h1.hi);
	}
	/* length matters (prefix) */
	epj_hash128 h4 = epj_hash(buf, len - 1);
	ck_assert(h4.lo != h1.lo || h4.hi != h1.hi);

	/* hex: hi then lo, 32 lowercase digits */
	epj_hash128 x = { .lo = 0x0123456789abcdefull,
			  .hi = 0xfedcba9876543210ull };
	epj_hash_hex(x, hex);
	ck_assert_str_eq(hex, "fedcba98765432100123456789abcdef");
	epj_hash_hex(h1, hex);
	ck_assert_uint_eq(strlen(hex), 32);
	for (int i = 0; i < 32; i++)
		ck_assert(strchr("0123456789abcdef", hex[i]) != NULL);
	char want[33];
	snprintf(want, sizeof want, "%016llx%016llx", (unsigned long long)h1.hi,
		 (unsigned long long)h1.lo);
	ck_assert_str_eq(hex, want);
}
END_TEST

Suite *make_counters_suite(void)
{
	Suite *s = suite_create("counters");
	TCase *tc = tcase_create("counters");
	tcase_add_test(tc, test_add_set_get);
	tcase_add_test(tc, test_snapshot_diff);
	tcase_add_test(tc, test_json_roundtrip);
	tcase_add_test(tc, test_json_malformed);
	suite_add_tcase(s, tc);
	tc = tcase_create("hash");
	tcase_add_test(tc, test_hash);
	suite_add_tcase(s, tc);
	return s;
}
