/* check_alloc.c -- the caching allocator and storages.
 *
 * The allocator is checked against a model kept in the test, over a test
 * device (host memory) that records the segments it hands out, counts its
 * calls and can refuse allocations above a limit (memory pressure).  The
 * rules restated here: requests round to 512 B up to 1 MiB and to 64 KiB
 * above; small blocks come from 2 MiB segments, larger ones from 20 MiB
 * segments below 10 MiB and from their size rounded to 2 MiB above.
 *
 * Checked after every step of random alloc/free sequences: the statistics
 * recomputed from the model (allocated, peaks, calls) and from the device
 * (reserved is exactly what the device holds; segments obtained and
 * returned); live blocks never overlap and lie inside the device's
 * segments; a per-block byte pattern survives until the block is freed.
 * Then splitting and merging by address, release under pressure, and the
 * varying-size expert-parallel workload whose reserved memory must stay
 * within 1.25 x its peak allocated plus a constant, with no device call
 * once warm.  Failure paths use ej_allocator_fail_after.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"
#include "core_impl.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static size_t model_round(size_t n)
{
	if (n == 0)
		n = 1;
	size_t g = n <= MiB ? 512 : 64 * KiB;
	return ((n + g - 1) / g) * g;
}

/* The segment a cache miss of a rounded block of n bytes asks for. */
static size_t model_segment(size_t n)
{
	return n <= MiB	      ? 2 * MiB
	       : n < 10 * MiB ? 20 * MiB
			      : (n + 2 * MiB - 1) / (2 * MiB) * (2 * MiB);
}

/* True when the user runs the suite with caching off (EPJIT_ALLOC_CACHE=0,
 * e.g. under valgrind): contexts' allocators then never cache. */
static bool env_cache_off(void)
{
	const char *e = getenv("EPJIT_ALLOC_CACHE");
	return e && strcmp(e, "0") == 0;
}

/* ---- the test device: host memory, every segment recorded ---- */

enum { TDEV_MAX = 4096 };
typedef struct tdev {
	size_t limit; /* > 0: an allocation beyond limit live bytes fails */
	size_t live;  /* bytes held by the allocator */
	uint64_t allocs, frees, refused;
	int n;
	struct {
		char *p;
		size_t bytes;
	} seg[TDEV_MAX];
} tdev;

static void *tdev_alloc(void *self, size_t n)
{
	tdev *d = self;
	if ((d->limit && d->live + n > d->limit) || d->n == TDEV_MAX) {
		d->refused++;
		return NULL;
	}
	char *p = aligned_alloc(64, (n + 63) & ~(size_t)63);
	tu_assert(p != NULL);
	d->seg[d->n].p = p;
	d->seg[d->n].bytes = n;
	d->n++;
	d->live += n;
	d->allocs++;
	return p;
}

static void tdev_free(void *self, void *p)
{
	tdev *d = self;
	int i = 0;
	while (i < d->n && d->seg[i].p != p)
		i++;
	tu_assert(i < d->n); /* only whole segments go back */
	d->live -= d->seg[i].bytes;
	d->seg[i] = d->seg[--d->n];
	d->frees++;
	free(p);
}

static void tdev_copy(void *self, void *dst, const void *src, size_t n)
{
	(void)self;
	memcpy(dst, src, n);
}

static ej_device tdev_device(tdev *d)
{
	return (ej_device){ .name = "test",
			    .self = d,
			    .alloc = tdev_alloc,
			    .free = tdev_free,
			    .copy = tdev_copy,
			    .host_visible = true };
}

/* An allocator over dev with caching on or off.  EPJIT_ALLOC_CACHE is read
 * when an allocator is created; the user's setting is restored afterwards
 * (tests may share one process). */
static ej_allocator *new_alloc_on(const ej_device *dev, bool caching)
{
	const char *e = getenv("EPJIT_ALLOC_CACHE");
	char *saved = e ? strdup(e) : NULL;
	if (!caching)
		setenv("EPJIT_ALLOC_CACHE", "0", 1);
	else
		unsetenv("EPJIT_ALLOC_CACHE");
	ej_allocator *a = ej_allocator_new(dev);
	if (saved)
		setenv("EPJIT_ALLOC_CACHE", saved, 1);
	else
		unsetenv("EPJIT_ALLOC_CACHE");
	free(saved);
	ck_assert_ptr_nonnull(a);
	return a;
}

static ej_allocator *new_alloc(bool caching)
{
	return new_alloc_on(&ej_device_cpu, caching);
}

/* ---- the model ---- */

enum { SLOTS = 128 };
typedef struct model {
	ej_allocator *a;
	tdev *d;
	bool caching;
	void *ptr[SLOTS];
	size_t len[SLOTS];
	uint64_t allocated, peak, allocs, frees;
} model;

/* Bytes between pattern probes: about 64 probes per block, so that large
 * blocks are not touched page by page. */
static size_t probe_step(size_t n)
{
	return n / 64 > 97 ? n / 64 : 97;
}

static void model_alloc(model *m, int s, size_t n)
{
	tu_assert(m->ptr[s] == NULL);
	uint64_t allocs = m->d->allocs, refused = m->d->refused;
	unsigned char *b = ej_alloc(m->a, n);
	tu_assert(b != NULL);
	/* a miss asks the device for the segment of the rules above */
	tu_assert(m->d->allocs - allocs <= 1);
	if (m->d->allocs > allocs && m->d->refused == refused)
		tu_assert(m->d->seg[m->d->n - 1].bytes ==
			  (m->caching ? model_segment(model_round(n))
				      : model_round(n)));
	tu_assert((uintptr_t)b % 64 == 0);
	for (size_t i = 0; i < n; i += probe_step(n))
		b[i] = (unsigned char)(s + 1);
	b[n - 1] = (unsigned char)(s + 1);
	m->ptr[s] = b;
	m->len[s] = n;
	m->allocated += model_round(n);
	m->allocs++;
	if (m->allocated > m->peak)
		m->peak = m->allocated;
}

static void model_free(model *m, int s)
{
	unsigned char *b = m->ptr[s];
	size_t n = m->len[s];
	/* the pattern is intact: no other block overlapped this one */
	for (size_t i = 0; i < n; i += probe_step(n))
		tu_assert(b[i] == (unsigned char)(s + 1));
	tu_assert(b[n - 1] == (unsigned char)(s + 1));
	ej_dealloc(m->a, b);
	m->allocated -= model_round(n);
	m->ptr[s] = NULL;
	m->frees++;
}

static int cmp_slot(const void *x, const void *y)
{
	const char *const *p = x, *const *q = y;
	return (*p > *q) - (*p < *q);
}

/* The statistics against the model and the device. */
static void model_check_stats(const model *m, bool caching)
{
	epj_memory_stats st;
	ej_allocator_stats(m->a, &st);
	tu_assert(st.allocated == m->allocated);
	tu_assert(st.peak_allocated == m->peak);
	tu_assert(st.num_allocs == m->allocs);
	tu_assert(st.num_frees == m->frees);
	tu_assert(st.reserved == m->d->live);
	tu_assert(st.num_device_allocs == m->d->allocs);
	tu_assert(st.num_device_frees == m->d->frees);
	tu_assert(st.reserved >= st.allocated);
	tu_assert(st.peak_reserved >= st.reserved);
	if (!caching) {
		tu_assert(st.reserved == st.allocated);
		tu_assert(st.cache_hits == 0);
		tu_assert(st.num_device_allocs == st.num_allocs);
	}
}

/* Live blocks do not overlap and each lies inside one device segment. */
static void model_check_layout(const model *m)
{
	const char *p[SLOTS];
	size_t len[SLOTS];
	int n = 0;
	for (int s = 0; s < SLOTS; s++)
		if (m->ptr[s])
			p[n++] = m->ptr[s];
	qsort(p, (size_t)n, sizeof *p, cmp_slot);
	for (int i = 0; i < n; i++)
		for (int s = 0; s < SLOTS; s++)
			if (m->ptr[s] == p[i])
				len[i] = model_round(m->len[s]);
	for (int i = 0; i + 1 < n; i++)
		tu_assert(p[i] + len[i] <= p[i + 1]);
	for (int i = 0; i < n; i++) {
		int k = 0;
		while (k < m->d->n &&
		       !(m->d->seg[k].p <= p[i] &&
			 p[i] + len[i] <= m->d->seg[k].p + m->d->seg[k].bytes))
			k++;
		tu_assert(k < m->d->n);
	}
}

/* Every device segment holds a live block (after empty_cache). */
static void model_check_no_free_segment(const model *m)
{
	for (int k = 0; k < m->d->n; k++) {
		int s = 0;
		while (
		    s < SLOTS &&
		    !(m->ptr[s] && (char *)m->ptr[s] >= m->d->seg[k].p &&
		      (char *)m->ptr[s] < m->d->seg[k].p + m->d->seg[k].bytes))
			s++;
		tu_assert(s < SLOTS);
	}
}

static void model_free_all(model *m)
{
	for (int s = 0; s < SLOTS; s++)
		if (m->ptr[s])
			model_free(m, s);
}

START_TEST(test_rounding_and_stats)
{
	tdev d = { 0 };
	ej_device dev = tdev_device(&d);
	ej_allocator *a = new_alloc_on(&dev, true);
	epj_memory_stats st;
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.allocated, 0);
	ck_assert_uint_eq(st.reserved, 0);

	/* small requests, carved one after the other from one 2 MiB
	 * segment; then two large ones from one 20 MiB segment */
	const size_t req[] = { 0,    1,	      511,	   512,	   513,
			       1000, 1 * MiB, 1 * MiB + 1, 3000000 };
	enum { N = EJ_ARRAY_LEN(req) };
	char *p[N];
	uint64_t total = 0;
	for (size_t i = 0; i < N; i++) {
		p[i] = ej_alloc(a, req[i]);
		ck_assert_ptr_nonnull(p[i]);
		ck_assert_uint_eq((uintptr_t)p[i] % 64, 0);
		memset(p[i], (int)i + 1, req[i]); /* writable (ASan checks) */
		total += model_round(req[i]);
		if (i > 0 && i != 7)
			ck_assert_ptr_eq(p[i],
					 p[i - 1] + model_round(req[i - 1]));
		ej_allocator_stats(a, &st);
		ck_assert_uint_eq(st.allocated, total);
		ck_assert_uint_eq(st.reserved, d.live);
		ck_assert_uint_eq(st.reserved, i < 7 ? 2 * MiB : 22 * MiB);
		ck_assert_uint_eq(st.num_device_allocs, i < 7 ? 1 : 2);
		ck_assert_uint_eq(st.peak_allocated, total);
		ck_assert_uint_eq(st.num_allocs, i + 1);
		ck_assert_uint_eq(st.cache_hits,
				  st.num_allocs - st.num_device_allocs);
	}
	ck_assert_uint_eq(model_round(1000), 1024);
	ck_assert_uint_eq(model_round(MiB + 1), MiB + 64 * KiB);
	/* 10 MiB and more: a segment of its own, rounded to 2 MiB */
	char *big = ej_alloc(a, 21 * MiB + 1);
	ck_assert_ptr_nonnull(big);
	ck_assert_uint_eq(d.live, 22 * MiB + 22 * MiB);
	ej_dealloc(a, big);

	/* free one: allocated drops, reserved stays (cached), peak stays */
	uint64_t reserved = d.live;
	total -= 1024;
	ej_dealloc(a, p[5]);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.allocated, total);
	ck_assert_uint_eq(st.reserved, reserved);
	ck_assert_uint_eq(st.peak_allocated,
			  total + 1024 + model_round(21 * MiB + 1));
	ck_assert_uint_eq(st.num_frees, 2);
	/* the same rounded size again: the same block, no device call */
	char *q = ej_alloc(a, 1001);
	ck_assert_ptr_eq(q, p[5]);
	/* smaller sizes: the best fit is the freed block, split */
	ej_dealloc(a, q);
	char *r1 = ej_alloc(a, 100), *r2 = ej_alloc(a, 512);
	ck_assert_ptr_eq(r1, p[5]);
	ck_assert_ptr_eq(r2, p[5] + 512);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.num_device_allocs, 3);
	ck_assert_uint_eq(st.reserved, reserved);
	ck_assert_uint_eq(st.allocated, total + 1024);

	/* reset peaks: peaks := current */
	ej_allocator_reset_peaks(a);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.peak_allocated, st.allocated);
	ck_assert_uint_eq(st.peak_reserved, st.reserved);
	/* empty_cache: the free 22 MiB segment goes back; the others hold
	 * live blocks and stay */
	ej_allocator_empty_cache(a);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.reserved, 22 * MiB);
	ck_assert_uint_eq(st.num_device_frees, 1);
	ck_assert_uint_eq(st.peak_reserved, 44 * MiB); /* not lowered */
	ej_dealloc(a, r1);
	ej_dealloc(a, r2);
	for (size_t i = 0; i < N; i++)
		if (i != 5)
			ej_dealloc(a, p[i]);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.allocated, 0);
	ck_assert_uint_eq(st.num_frees, st.num_allocs);
	ck_assert_uint_eq(st.reserved, 22 * MiB); /* cached */
	ej_allocator_empty_cache(a);
	ej_allocator_stats(a, &st);
	ck_assert_uint_eq(st.reserved, 0);
	ck_assert_uint_eq(d.live, 0);
	ck_assert_uint_eq(st.num_device_frees, 3);
	ej_allocator_free(a);
	ck_assert_uint_eq(d.frees, d.allocs);
}
END_TEST

/* Blocks split from a segment in address order; a freed block merges with
 * its free neighbours, below, above and both. */
START_TEST(test_split_merge)
{
	tdev d = { 0 };
	ej_device dev = tdev_device(&d);
	ej_allocator *a = new_alloc_on(&dev, true);
	const size_t n[4] = { 3 * 512, 5 * 512, 2 * 512, 512 };
	char *b[4];
	for (int i = 0; i < 4; i++) {
		b[i] = ej_alloc(a, n[i]);
		if (i)
			ck_assert_ptr_eq(b[i], b[i - 1] + n[i - 1]);
	}
	/* B then C freed: one hole of 7 x 512 between A and D, the best fit
	 * for exactly that size (the rest of the segment is larger) */
	ej_dealloc(a, b[1]);
	ej_dealloc(a, b[2]);
	char *h = ej_alloc(a, 7 * 512);
	ck_assert_ptr_eq(h, b[1]);
	ej_dealloc(a, h);
	/* A freed: merged with the hole above it */
	ej_dealloc(a, b[0]);
	ck_assert_ptr_eq(ej_alloc(a, 10 * 512), b[0]);
	ej_dealloc(a, b[0]);
	/* both sides: A and C free, then B joins them */
	for (int i = 0; i < 3; i++)
		ck_assert_ptr_eq(ej_alloc(a, n[i]), b[i]);
	ej_dealloc(a, b[0]);
	ej_dealloc(a, b[2]);
	ej_dealloc(a, b[1]);
	ck_assert_ptr_eq(ej_alloc(a, 10 * 512), b[0]);
	ej_dealloc(a, b[0]);
	/* D freed last: the segment is whole again and goes back */
	ej_dealloc(a, b[3]);
	ck_assert_uint_eq(d.allocs, 1);
	ej_allocator_empty_cache(a);
	ck_assert_uint_eq(d.frees, 1);
	ck_assert_uint_eq(d.live, 0);

	/* the large pool: a freed 3 MiB block serves 2 MiB and then 900 KiB
	 * is not taken from it (small requests have their own pool) */
	char *l = ej_alloc(a, 3 * MiB);
	ej_dealloc(a, l);
	ck_assert_ptr_eq(ej_alloc(a, 2 * MiB), l);
	ck_assert_uint_eq(d.allocs, 2);
	char *s = ej_alloc(a, 900 * KiB);
	ck_assert(s < l || s >= l + 20 * MiB);
	ck_assert_uint_eq(d.allocs, 3);
	ej_dealloc(a, s);
	ej_dealloc(a, l);
	ej_allocator_free(a);
	ck_assert_uint_eq(d.live, 0);
}
END_TEST

/* A random request size: mostly small and all different, some large,
 * a few of 10 MiB and more. */
static size_t random_size(void)
{
	int64_t k = tu_randint(0, 100);
	if (k < 70)
		return (size_t)tu_randint(1, 64 * KiB);
	if (k < 90)
		return (size_t)tu_randint(64 * KiB, MiB + 1);
	if (k < 98)
		return (size_t)tu_randint(MiB + 1, 6 * MiB);
	return (size_t)tu_randint(10 * MiB, 14 * MiB);
}

/* Random alloc/free sequence against the model. */
static void random_sequence(bool caching)
{
	tdev d = { 0 };
	ej_device dev = tdev_device(&d);
	model m = { .a = new_alloc_on(&dev, caching),
		    .d = &d,
		    .caching = caching };
	enum { USED = 40 };
	for (int step = 0; step < 3000; step++) {
		int s = (int)tu_randint(0, USED);
		if (m.ptr[s])
			model_free(&m, s);
		else
			model_alloc(&m, s, random_size());
		model_check_stats(&m, caching);
		if (step % 50 == 0)
			model_check_layout(&m);
		if (step == 1500) {
			ej_allocator_empty_cache(m.a);
			model_check_stats(&m, caching);
			model_check_no_free_segment(&m);
		}
	}
	epj_memory_stats st;
	ej_allocator_stats(m.a, &st);
	if (caching)
		ck_assert_uint_gt(st.cache_hits, 0);
	model_free_all(&m);
	model_check_stats(&m, caching);
	ej_allocator_free(m.a);
	ck_assert_uint_eq(d.live, 0);
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

/* Out of memory: the whole free segments go back to the device and the
 * request is retried; a segment with a live block stays; a 20 MiB segment
 * that no longer fits gives way to one of the block's own size. */
START_TEST(test_release_under_pressure)
{
	tdev d = { 0 };
	ej_device dev = tdev_device(&d);
	model m = { .a = new_alloc_on(&dev, true), .d = &d, .caching = true };
	for (int s = 0; s < 4; s++)
		model_alloc(&m, s, 12 * MiB);
	ck_assert_uint_eq(d.live, 48 * MiB);
	for (int s = 1; s < 4; s++)
		model_free(&m, s);
	model_check_stats(&m, true);
	/* 14 MiB fits no cached block; the device has room for it only
	 * once the three free segments are back */
	d.limit = d.live + 8 * MiB;
	model_alloc(&m, 1, 14 * MiB);
	model_check_stats(&m, true);
	ck_assert_uint_eq(d.frees, 3);
	ck_assert_uint_eq(d.refused, 1);
	ck_assert_uint_eq(d.live, 26 * MiB);
	/* 1.5 MiB: its 20 MiB segment does not fit, its own size does */
	d.limit = d.live + 3 * MiB;
	model_alloc(&m, 2, 3 * MiB / 2);
	model_check_stats(&m, true);
	ck_assert_uint_eq(d.live, 26 * MiB + 3 * MiB / 2);
	/* beyond the device: NULL, nothing counted, nothing lost */
	epj_memory_stats st0, st1;
	ej_allocator_stats(m.a, &st0);
	ck_assert_ptr_null(ej_alloc(m.a, 2 * MiB));
	ej_allocator_stats(m.a, &st1);
	ck_assert_uint_eq(st1.allocated, st0.allocated);
	ck_assert_uint_eq(st1.num_allocs, st0.num_allocs);
	ck_assert_uint_eq(st1.reserved, d.live);
	/* a small block: its 2 MiB segment does not fit either */
	model_alloc(&m, 3, 4000);
	ck_assert_uint_eq(d.live, 26 * MiB + 3 * MiB / 2 + 4096);
	model_check_stats(&m, true);
	model_check_layout(&m);
	/* freed, the memory serves a request of another size without the
	 * device: 14 MiB + 12 MiB merge nowhere (two segments), but 13 MiB
	 * fits the 14 MiB one */
	model_free(&m, 1);
	uint64_t allocs = d.allocs;
	model_alloc(&m, 1, 13 * MiB);
	ck_assert_uint_eq(d.allocs, allocs);
	model_check_stats(&m, true);
	model_free_all(&m);
	ej_allocator_free(m.a);
	ck_assert_uint_eq(d.live, 0);
}
END_TEST

/* The expert-parallel training step in allocator calls: parameters and
 * their optimizer state live throughout; each step, per layer, the
 * forward keeps per-expert activations whose row counts follow the
 * routing, which changes every step (the rows sum to the tokens times
 * top-k); the backward frees them in reverse with per-expert temporaries
 * of the same sizes.  hidden sets the row size: 64 keeps every block in
 * the small pool, 1024 puts the larger experts' blocks in the large one. */
static void ep_workload(size_t hidden)
{
	tdev d = { 0 };
	ej_device dev = tdev_device(&d);
	model m = { .a = new_alloc_on(&dev, true), .d = &d, .caching = true };
	enum {
		PARAMS = 24,
		LAYERS = 3,
		EXPERTS = 8,
		ROWS = 1024,
		STEPS = 300,
		WARM = 30
	};
	int s = 0;
	for (; s < PARAMS; s++)
		model_alloc(&m, s, (size_t)tu_randint(1, 40) * hidden * 64);
	uint64_t warm_allocs = 0, warm_frees = 0;
	for (int step = 0; step < STEPS; step++) {
		if (step == WARM) {
			warm_allocs = d.allocs;
			warm_frees = d.frees;
		}
		int first[LAYERS];
		size_t rows[LAYERS][EXPERTS];
		s = PARAMS;
		for (int l = 0; l < LAYERS; l++) {
			/* the routing: random shares of ROWS rows */
			double w[EXPERTS], sum = 0;
			for (int e = 0; e < EXPERTS; e++)
				sum += w[e] = tu_uniform(0.1, 1.9);
			size_t left = ROWS;
			for (int e = 0; e < EXPERTS; e++) {
				rows[l][e] = e == EXPERTS - 1
						 ? left
						 : (size_t)(ROWS * w[e] / sum);
				left -= rows[l][e];
			}
			first[l] = s;
			model_alloc(&m, s++, ROWS * hidden * 4); /* input */
			for (int e = 0; e < EXPERTS; e++) {
				size_t r = rows[l][e] ? rows[l][e] : 1;
				model_alloc(&m, s++, r * hidden * 4);
				model_alloc(&m, s++, r * hidden * 8);
				/* the expert's output, combined and gone */
				model_alloc(&m, s, r * hidden * 4);
				model_free(&m, s);
			}
		}
		for (int l = LAYERS - 1; l >= 0; l--) {
			for (int e = EXPERTS - 1; e >= 0; e--) {
				size_t r = rows[l][e] ? rows[l][e] : 1;
				model_alloc(&m, s, r * hidden * 8); /* grad */
				int k = first[l] + 1 + 2 * e;
				model_free(&m, k + 1);
				model_free(&m, k);
				model_free(&m, s);
			}
			model_free(&m, first[l]);
		}
		/* gradients of the parameters, applied and freed */
		for (int p = 0; p < PARAMS; p++)
			model_alloc(&m, s + p, m.len[p]);
		for (int p = 0; p < PARAMS; p++)
			model_free(&m, s + p);
		model_check_stats(&m, true);
	}
	model_check_layout(&m);
	epj_memory_stats st;
	ej_allocator_stats(m.a, &st);
	/* bounded: within 1.25 x the peak plus one segment of each pool
	 * the workload uses (hidden 64 uses the small pool only) */
	size_t slack = 2 * MiB + (hidden > 64 ? 20 * MiB : 0);
	ck_assert_msg(st.reserved <= 1.25 * (double)st.peak_allocated + slack,
		      "reserved %.2f MiB over 1.25 x peak allocated %.2f MiB "
		      "+ %zu MiB (seed %llu)",
		      (double)st.reserved / MiB,
		      (double)st.peak_allocated / MiB, slack / MiB,
		      (unsigned long long)tu_seed());
	/* warm: no device call once the cache holds enough (the small pool);
	 * never a free without pressure */
	ck_assert_uint_eq(d.frees, warm_frees);
	if (hidden == 64)
		ck_assert_uint_eq(d.allocs, warm_allocs);
	model_free_all(&m);
	ej_allocator_free(m.a);
	ck_assert_uint_eq(d.live, 0);
}

START_TEST(test_ep_workload)
{
	ep_workload(_i ? 1024 : 64);
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

/* Under AddressSanitizer the free bytes of host segments are poisoned: a
 * block handed out is addressable up to its rounded size, the rest of its
 * segment is not, nor is a block once freed (the cache keeps it). */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(TEST_ASAN)
#define TEST_ASAN 1
#endif
#ifdef TEST_ASAN
#include <sanitizer/asan_interface.h>
START_TEST(test_asan_poison)
{
	if (env_cache_off())
		return;
	ej_allocator *a = new_alloc(true);
	char *p = ej_alloc(a, 1000), *q = ej_alloc(a, 3000);
	ck_assert_ptr_eq(q, p + 1024);
	ck_assert(!__asan_address_is_poisoned(p));
	ck_assert(!__asan_address_is_poisoned(p + 1023));
	ck_assert(!__asan_address_is_poisoned(q + 3071));
	ck_assert(
	    __asan_address_is_poisoned(q + 3072)); /* the segment's rest */
	ej_dealloc(a, p);
	ck_assert(__asan_address_is_poisoned(p));
	ck_assert(!__asan_address_is_poisoned(q));
	ej_dealloc(a, q);
	ej_allocator_free(a);
}
END_TEST
#endif

Suite *make_alloc_suite(void)
{
	Suite *s = suite_create("alloc");
	TCase *tc = tcase_create("allocator");
	tcase_add_test(tc, test_rounding_and_stats);
	tcase_add_test(tc, test_split_merge);
	tcase_add_test(tc, test_random_caching);
	tcase_add_test(tc, test_random_no_cache);
	tcase_add_test(tc, test_release_under_pressure);
	tcase_add_loop_test(tc, test_ep_workload, 0, 2);
	tcase_add_test(tc, test_fail_after);
	tcase_add_test(tc, test_free_with_live_blocks);
#ifdef TEST_ASAN
	tcase_add_test(tc, test_asan_poison);
#endif
	suite_add_tcase(s, tc);
	tc = tcase_create("storage");
	tcase_add_test(tc, test_storage_nomem);
	tcase_add_test(tc, test_storage_zero_and_refs);
	suite_add_tcase(s, tc);
	return s;
}
