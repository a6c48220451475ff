/* check_alloc.c -- the caching allocator and storages.
 *
 * The allocator is checked against a model kept in the test: the rounding
 * rule is restated here (512 B up to 1 MiB, 64 KiB above), live blocks are
 * filled with a per-block byte pattern to catch overlapping blocks, and the
 * statistics are recomputed from the model after every step.  Failure paths
 * use ej_allocator_fail_after.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"
#include "core_impl.h"

static size_t model_round(size_t n)
{
	if (n == 0)
		n = 1;
	size_t g = n <= ((size_t)1 << 20) ? 512 : ((size_t)64 << 10);
	return ((n + g - 1) / g) * g;
}

/* True when the user runs the suite with caching off (EPJIT_ALLOC_CACHE=0,
 * e.g. under valgrind): contexts' allocators then never cache. */
static bool env_cache_off(void)
{
	const char *e = getenv("EPJIT_ALLOC_CACHE");
	return e && strcmp(e, "0") == 0;
}

static ej_allocator *new_alloc(bool caching)
{
	/* EPJIT_ALLOC_CACHE is read when an allocator is created; restore
	 * the user's setting afterwards (tests may share one process). */
	const char *e = getenv("EPJIT_ALLOC_CACHE");
	char *saved = e ? strdup(e) : NULL;
	if (!caching)
		setenv("EPJIT_ALLOC_CACHE", "0", 1);
	else
		unsetenv("EPJIT_ALLOC_CACHE");
	ej_allocator *a = ej_allocator_new(&ej_device_cpu);
	if (saved)
		setenv("EPJIT_ALLOC_CACHE", saved, 1);
	else
		unsetenv("EPJIT_ALLOC_CACHE");
	free(saved);
	ck_assert_ptr_nonnull(a);
	return a;
}

START_TEST(test_rounding_and_stats)
{
	ej_allocator *a = new_alloc(true);
	epj_memory_stats st;
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.allocated, 0);
	ck_assert_uint_eq(st.reserved, 0);

	const size_t req[] = { 0,
			       1,
			       511,
			       512,
			       513,
			       1000,
			       (size_t)1 << 20,
			       ((size_t)1 << 20) + 1,
			       3000000 };
	void *p[EJ_ARRAY_LEN(req)];
	uint64_t total = 0;
	for (size_t i = 0; i < EJ_ARRAY_LEN(req); i++) {
		p[i] = ej_alloc(a, req[i]);
		ck_assert_ptr_nonnull(p[i]);
		ck_assert_uint_eq((uintptr_t)p[i] % 64, 0);
		memset(p[i], (int)i + 1, req[i]); /* writable (ASan checks) */
		total += model_round(req[i]);
		ej_allocator_stats(a, &st);
		ck_assert_uint_eq(st.allocated, total);
		ck_assert_uint_eq(st.reserved, total);
		ck_assert_uint_eq(st.peak_allocated, total);
		ck_assert_uint_eq(st.num_allocs, i + 1);
	}
	ck_assert_uint_eq(model_round(1000), 1024);
	ck_assert_uint_eq(model_round(((size_t)1 << 20) + 1),
			  ((size_t)1 << 20) + ((size_t)64 << 10));

	/* free one: allocated drops, reserved stays (cached), peak stays */
	ej_dealloc(a, p[5]);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.allocated, total - 1024);
	ck_assert_uint_eq(st.reserved, total);
	ck_assert_uint_eq(st.peak_allocated, total);
	ck_assert_uint_eq(st.num_frees, 1);
	/* same rounded size again: served from the cache, same block */
	void *q = ej_alloc(a, 1001);
	ck_assert_ptr_eq(q, p[5]);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.cache_hits, 1);
	ck_assert_uint_eq(st.allocated, total);
	ck_assert_uint_eq(st.reserved, total);
	/* a different size misses */
	ej_dealloc(a, q);
	void *r = ej_alloc(a, 2000);
	ck_assert_ptr_nonnull(r);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.cache_hits, 1);
	ck_assert_uint_eq(st.reserved, total + 2048);
	ck_assert_uint_eq(st.peak_reserved, total + 2048);

	/* reset peaks: peaks := current */
	ej_dealloc(a, p[8]);
	ej_allocator_reset_peaks(a);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.peak_allocated, st.allocated);
	ck_assert_uint_eq(st.peak_reserved, st.reserved);
	ck_assert_uint_eq(st.allocated,
			  total - 1024 - model_round(3000000) + 2048);
	/* empty_cache: the cached 1024 and 3 MB blocks go back */
	ej_allocator_empty_cache(a);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.reserved, st.allocated);
	ck_assert_uint_eq(st.peak_reserved,
			  total + 2048); /* peaks are not lowered */

	ej_dealloc(a, r);
	for (size_t i = 0; i < EJ_ARRAY_LEN(req); i++)
		if (i != 5 && i != 8)
			ej_dealloc(a, p[i]);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.allocated, 0);
	ck_assert_uint_eq(st.num_frees, st.num_allocs);
	ej_allocator_free(a);
}
END_TEST

/* Bytes between pattern probes: about 64 probes per block, so that large
 * blocks are not touched page by page. */
static size_t probe_step(size_t n)
{
	return n / 64 > 97 ? n / 64 : 97;
}

/* Random alloc/free sequence against the model. */
static void random_sequence(bool caching)
{
	ej_allocator *a = new_alloc(caching);
	enum { SLOTS = 37 };
	void *ptr[SLOTS] = { 0 };
	size_t len[SLOTS] = { 0 };
	uint64_t allocated = 0, peak = 0, allocs = 0, frees = 0;
	for (int step = 0; step < 2000; step++) {
		int s = (int)tu_randint(0, SLOTS);
		if (ptr[s]) {
			/* pattern intact: no other block overlapped it */
			unsigned char *b = ptr[s];
			for (size_t i = 0; i < len[s]; i += probe_step(len[s]))
				tu_assert(b[i] == (unsigned char)(s + 1));
			tu_assert(b[len[s] - 1] == (unsigned char)(s + 1));
			ej_dealloc(a, ptr[s]);
			allocated -= model_round(len[s]);
			ptr[s] = NULL;
			frees++;
		} else {
			/* small sizes mostly, from a few classes so the
			 * cache gets hits; sometimes a large block */
			size_t n = tu_randint(0, 20) == 0
				       ? (size_t)tu_randint(1 << 20, 3 << 20)
				       : (size_t)tu_randint(1, 8) * 700 +
					     (size_t)tu_randint(0, 3);
			ptr[s] = ej_alloc(a, n);
			tu_assert(ptr[s] != NULL);
			len[s] = n;
			unsigned char *b = ptr[s];
			for (size_t i = 0; i < n; i += probe_step(n))
				b[i] = (unsigned char)(s + 1);
			b[n - 1] = (unsigned char)(s + 1);
			allocated += model_round(n);
			allocs++;
			if (allocated > peak)
				peak = allocated;
		}
		epj_memory_stats st;
		ej_allocator_stats(a, &st);
		tu_assert(st.allocated == allocated);
		tu_assert(st.peak_allocated == peak);
		tu_assert(st.num_allocs == allocs);
		tu_assert(st.num_frees == frees);
		tu_assert(st.reserved >= st.allocated);
		tu_assert(st.peak_reserved >= st.reserved);
		if (!caching) {
			tu_assert(st.reserved == st.allocated);
			tu_assert(st.cache_hits == 0);
		}
		if (step == 1000) {
			ej_allocator_empty_cache(a);
			ej_allocator_stats(a, &st);
			tu_assert(st.reserved == st.allocated);
		}
	}
	epj_memory_stats st;
	ej_allocator_stats(a, &st);
	if (caching)
		ck_assert_uint_gt(st.cache_hits, 0);
	for (int s = 0; s < SLOTS; s++)
		ej_dealloc(a, ptr[s]); /* NULL is a no-op */
	ej_allocator_free(a);
}

START_TEST(test_random_caching)
{
	random_sequence(true);
}
END_TEST

START_TEST(test_random_no_cache)
{
	random_sequence(false);
}
END_TEST

START_TEST(test_fail_after)
{
	ej_allocator *a = new_alloc(true);
	ej_allocator_fail_after(a, 3);
	void *p1 = ej_alloc(a, 100), *p2 = ej_alloc(a, 100);
	ck_assert_ptr_nonnull(p1);
	ck_assert_ptr_nonnull(p2);
	ck_assert_ptr_null(ej_alloc(a, 100)); /* the third */
	void *p4 = ej_alloc(a, 100);	      /* one-shot: works again */
	ck_assert_ptr_nonnull(p4);
	epj_memory_stats st;
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.num_allocs, 3); /* the failure is not counted */
	ck_assert_uint_eq(st.allocated, 3 * 512);
	ej_allocator_fail_after(a, 1);
	ej_allocator_fail_after(a, 0); /* off again */
	void *p5 = ej_alloc(a, 100);
	ck_assert_ptr_nonnull(p5);
	ej_dealloc(a, p1);
	ej_dealloc(a, p2);
	ej_dealloc(a, p4);
	ej_dealloc(a, p5);
	ej_allocator_free(a);
}
END_TEST

/* Storages and tensors report NOMEM with the size; nothing leaks. */
START_TEST(test_storage_nomem)
{
	epj_ctx *ctx = tu_ctx();
	ej_allocator_fail_after(ctx->alloc, 1);
	ck_assert_ptr_null(ej_storage_new(ctx, 4000));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_NOMEM);
	ck_assert_str_eq(epj_ctx_error(ctx),
			 "out of memory allocating 4000 bytes");
	epj_ctx_clear_error(ctx);

	const int64_t sh[] = { 3, 5, 7 };
	for (int which = 0; which < 5; which++) {
		ej_allocator_fail_after(ctx->alloc, 1);
		epj_tensor *t = NULL;
		switch (which) {
		case 0:
			t = ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 3, sh, true);
			break;
		case 1: {
			double d[105] = { 0 };
			t = epj_tensor_from_data(ctx, EPJ_DTYPE_F64, 3, sh, d);
			break;
		}
		case 2:
			t = epj_randn(ctx, EPJ_DTYPE_BF16, 3, sh, 0, 1);
			break;
		case 3:
			t = epj_rand_uniform(ctx, EPJ_DTYPE_F32, 3, sh, 0, 1);
			break;
		case 4:
			t = epj_randint(ctx, EPJ_DTYPE_I64, 3, sh, 0, 5);
			break;
		}
		ck_assert_msg(t == NULL, "case %d did not fail", which);
		ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_NOMEM);
		static const int bytes[] = { 420, 840, 210, 420, 840 };
		char want[64];
		snprintf(want, sizeof want, "out of memory allocating %d bytes",
			 bytes[which]);
		ck_assert_str_eq(epj_ctx_error(ctx), want);
		epj_ctx_clear_error(ctx);
	}
	epj_memory_stats st;
	epj_memory_stats_get(ctx, &st);
	ck_assert_uint_eq(st.allocated, 0);
	epj_ctx_free(ctx);
}
END_TEST

/* ej_storage_new zero-fills even a dirty block reused from the cache. */
START_TEST(test_storage_zero_and_refs)
{
	epj_ctx *ctx = tu_ctx();
	size_t n = (size_t)tu_randint(100, 5000);
	ej_storage *s = ej_storage_new_uninit(ctx, n);
	ck_assert_ptr_nonnull(s);
	ck_assert_uint_eq(s->bytes, n);
	ck_assert_ptr_eq(s->alloc, ctx->alloc);
	memset(s->data, 0xab, n);
	void *old = s->data;
	ej_storage_ref(s);
	ck_assert_int_eq(s->refcount, 2);
	ej_storage_unref(s);
	epj_memory_stats st;
	epj_memory_stats_get(ctx, &st);
	ck_assert_uint_eq(st.allocated, model_round(n)); /* still alive */
	ej_storage_unref(s);
	epj_memory_stats_get(ctx, &st);
	ck_assert_uint_eq(st.allocated, 0);

	ej_storage *z = ej_storage_new(ctx, n);
	ck_assert_ptr_nonnull(z);
	if (!env_cache_off())
		ck_assert_ptr_eq(z->data, old); /* the cached block is back */
	for (size_t i = 0; i < n; i++)
		ck_assert_uint_eq(((unsigned char *)z->data)[i], 0);
	ej_storage_unref(z);
	ej_storage_unref(NULL);

	/* public API over the context's allocator */
	const int64_t sh[] = { 13, 7 };
	epj_tensor *t = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	epj_memory_stats_get(ctx, &st);
	ck_assert_uint_eq(st.allocated, model_round(13 * 7 * 4));
	ck_assert_uint_ge(st.peak_allocated, st.allocated);
	epj_tensor_free(t);
	epj_memory_reset_peaks(ctx);
	epj_memory_stats_get(ctx, &st);
	ck_assert_uint_eq(st.peak_allocated, 0);
	ck_assert(env_cache_off() || st.reserved > 0);
	epj_memory_empty_cache(ctx);
	epj_memory_stats_get(ctx, &st);
	ck_assert_uint_eq(st.reserved, 0);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_free_with_live_blocks)
{
	/* A context freed before its tensors' blocks: a warning, no leak of
	 * the blocks themselves (ASan would report them). */
	epj_log_level lvl = epj_log_level_get();
	epj_log_level_set(EPJ_LOG_ERROR);
	ej_allocator *a = new_alloc(true);
	for (int i = 0; i < 200; i++) /* enough to grow the tables */
		ck_assert_ptr_nonnull(ej_alloc(a, (size_t)(i % 7) * 600 + 1));
	ej_allocator_free(a);
	ej_allocator_free(NULL);
	epj_log_level_set(lvl);
}
END_TEST

Suite *make_alloc_suite(void)
{
	Suite *s = suite_create("alloc");
	TCase *tc = tcase_create("allocator");
	tcase_add_test(tc, test_rounding_and_stats);
	tcase_add_test(tc, test_random_caching);
	tcase_add_test(tc, test_random_no_cache);
	tcase_add_test(tc, test_fail_after);
	tcase_add_test(tc, test_free_with_live_blocks);
	suite_add_tcase(s, tc);
	tc = tcase_create("storage");
	tcase_add_test(tc, test_storage_nomem);
	tcase_add_test(tc, test_storage_zero_and_refs);
	suite_add_tcase(s, tc);
	return s;
}
