/* alloc.c -- the cpu device and the caching allocator; storages.
 *
 * The allocator sits between storages and a device (ej_device).  Freed blocks
 * are kept in per-size free lists ("bins") and handed out again to requests of
 * the same rounded size, so a training loop that allocates the same shapes
 * every step stops calling the device after the first step.
 *
 * Rounding (what the stats count):
 *  - requests up to 1 MiB round up to a multiple of 512 bytes (0 -> 512);
 *  - larger requests round up to a multiple of 64 KiB.  (PyTorch's 2 MiB
 *    large-block granularity wastes too much on cpu for 1-2 MiB tensors.)
 * Reuse is by exact rounded size: simple, O(1), and exactly what repeated
 * shapes need.  A request that misses the cache and fails on the device
 * empties the cache and retries once, as PyTorch's allocator does.
 *
 * Statistics (bytes are rounded sizes):
 *  - allocated: live blocks; reserved: blocks obtained from the device and
 *    not returned (live + cached); peaks since creation or the last reset;
 *  - num_allocs / num_frees: ej_alloc calls served / ej_dealloc calls;
 *  - cache_hits: allocations served from a free list.
 *
 * Invariants
 *  - Every block is in exactly one place: the live table (keyed by pointer)
 *    or one bin's free stack.  allocated == sum(live), reserved ==
 *    allocated + sum(cached).
 *  - Threading: one context = one thread.  The allocator has no locks;
 *    callers must not allocate or free from inside parallel regions.
 *
 * EPJIT_ALLOC_CACHE=0 disables caching (every free goes to the device), which
 * lets ASan/valgrind see use-after-free of storage data.
 */
#include "core_impl.h"

#include <stdint.h>
#include <string.h>

/* ---- cpu device ------------------------------------------------------------
 */

static void *cpu_alloc(void *self, size_t bytes)
{
	(void)self;
	/* aligned_alloc wants a size that is a multiple of the alignment. */
	if (bytes == 0 || bytes > SIZE_MAX - 63)
		return NULL;
	return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}

static void cpu_free(void *self, void *ptr)
{
	(void)self;
	free(ptr);
}

static void cpu_copy(void *self, void *dst, const void *src, size_t bytes)
{
	(void)self;
	if (bytes)
		memcpy(dst, src, bytes);
}

static void cpu_memzero(void *self, void *ptr, size_t bytes)
{
	(void)self;
	if (bytes)
		memset(ptr, 0, bytes);
}

static void cpu_sync(void *self)
{
	(void)self;
}

static epj_status cpu_desc_open(epj_ctx *probe, const ej_device **out)
{
	(void)probe;
	*out = &ej_device_cpu;
	return EPJ_OK;
}

/* The host: lib's kernels, compiled regions as generated C. */
const ej_device_desc ej_desc_cpu = {
	.name = "cpu",
	.backend = "c",
	.comm = NULL,
	.runs_cuda = false,
	.modules = EJ_MODULES_NONE,
	.reruns_grids = false,
	.gemm_library = false,
	.open = cpu_desc_open,
};

const ej_device ej_device_cpu = {
	.name = "cpu",
	.desc = &ej_desc_cpu,
	.self = NULL,
	.alloc = cpu_alloc,
	.free = cpu_free,
	.copy = cpu_copy,
	.memzero = cpu_memzero,
	.sync = cpu_sync,
	.host_visible = true,
};

/* ---- caching allocator
 * -------------------------------------------------------
 */

#define SMALL_LIMIT ((size_t)1 << 20) /* 1 MiB */
#define SMALL_ROUND ((size_t)512)
#define LARGE_ROUND ((size_t)64 << 10) /* 64 KiB */

typedef struct block {
	void *ptr;
	size_t size;	    /* rounded */
	struct block *next; /* live-table chain or bin free stack */
} block;

typedef struct bin {
	size_t size;
	block *free; /* stack of cached blocks of this size */
	struct bin *next;
} bin;

struct ej_allocator {
	const ej_device *dev;
	bool caching;
	/* live blocks: chained hash table keyed by pointer */
	block **live;
	size_t n_live_buckets, n_live;
	/* bins: chained hash table keyed by size (bins are never removed) */
	bin **bins;
	size_t n_bin_buckets, n_bins;
	int64_t fail_countdown; /* > 0: the countdown-th allocation fails */
	epj_memory_stats st;
};

static size_t hash_ptr(const void *p, size_t nb)
{
	uint64_t x = (uint64_t)(uintptr_t)p;
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	return (size_t)(x & (nb - 1));
}

static size_t hash_size(size_t s, size_t nb)
{
	return hash_ptr((const void *)(uintptr_t)s, nb);
}

/* Rounds a request as described in the file comment; 0 on overflow. */
static size_t round_size(size_t bytes)
{
	if (bytes == 0)
		bytes = 1;
	size_t g = bytes <= SMALL_LIMIT ? SMALL_ROUND : LARGE_ROUND;
	if (bytes > SIZE_MAX - g)
		return 0;
	return (bytes + g - 1) / g * g;
}

ej_allocator *ej_allocator_new(const ej_device *dev)
{
	ej_allocator *a = calloc(1, sizeof *a);
	if (!a)
		return NULL;
	a->dev = dev;
	const char *env = getenv("EPJIT_ALLOC_CACHE");
	a->caching = !(env && strcmp(env, "0") == 0);
	a->n_live_buckets = 64;
	a->n_bin_buckets = 64;
	a->live = calloc(a->n_live_buckets, sizeof *a->live);
	a->bins = calloc(a->n_bin_buckets, sizeof *a->bins);
	if (!a->live || !a->bins) {
		free(a->live);
		free(a->bins);
		free(a);
		return NULL;
	}
	return a;
}

static void release_block(ej_allocator *a, block *b)
{
	a->dev->free(a->dev->self, b->ptr);
	a->st.reserved -= b->size;
	free(b);
}

void ej_allocator_empty_cache(ej_allocator *a)
{
	for (size_t i = 0; i < a->n_bin_buckets; i++)
		for (bin *bn = a->bins[i]; bn; bn = bn->next)
			while (bn->free) {
				block *b = bn->free;
				bn->free = b->next;
				release_block(a, b);
			}
}

void ej_allocator_free(ej_allocator *a)
{
	if (!a)
		return;
	ej_allocator_empty_cache(a);
	if (a->n_live)
		epj_log_msg(
		    EPJ_LOG_WARN,
		    "allocator freed with %zu live blocks (%llu bytes): "
		    "tensors outlive their context",
		    a->n_live, (unsigned long long)a->st.allocated);
	for (size_t i = 0; i < a->n_live_buckets; i++)
		while (a->live[i]) {
			block *b = a->live[i];
			a->live[i] = b->next;
			release_block(a, b);
		}
	for (size_t i = 0; i < a->n_bin_buckets; i++)
		while (a->bins[i]) {
			bin *bn = a->bins[i];
			a->bins[i] = bn->next;
			free(bn);
		}
	free(a->live);
	free(a->bins);
	free(a);
}

/* Doubles a chained table when it gets loaded; on malloc failure keeps the
 * old one (chains only get longer). */
static void live_grow(ej_allocator *a)
{
	size_t nb = a->n_live_buckets * 2;
	block **t = calloc(nb, sizeof *t);
	if (!t)
		return;
	for (size_t i = 0; i < a->n_live_buckets; i++)
		while (a->live[i]) {
			block *b = a->live[i];
			a->live[i] = b->next;
			size_t h = hash_ptr(b->ptr, nb);
			b->next = t[h];
			t[h] = b;
		}
	free(a->live);
	a->live = t;
	a->n_live_buckets = nb;
}

static void bins_grow(ej_allocator *a)
{
	size_t nb = a->n_bin_buckets * 2;
	bin **t = calloc(nb, sizeof *t);
	if (!t)
		return;
	for (size_t i = 0; i < a->n_bin_buckets; i++)
		while (a->bins[i]) {
			bin *bn = a->bins[i];
			a->bins[i] = bn->next;
			size_t h = hash_size(bn->size, nb);
			bn->next = t[h];
			t[h] = bn;
		}
	free(a->bins);
	a->bins = t;
	a->n_bin_buckets = nb;
}

static bin *bin_find(ej_allocator *a, size_t size, bool create)
{
	for (bin *bn = a->bins[hash_size(size, a->n_bin_buckets)]; bn;
	     bn = bn->next)
		if (bn->size == size)
			return bn;
	if (!create)
		return NULL;
	bin *bn = calloc(1, sizeof *bn);
	if (!bn)
		return NULL;
	bn->size = size;
	if (a->n_bins + 1 > 2 * a->n_bin_buckets)
		bins_grow(a);
	size_t h = hash_size(size, a->n_bin_buckets);
	bn->next = a->bins[h];
	a->bins[h] = bn;
	a->n_bins++;
	return bn;
}

static void live_insert(ej_allocator *a, block *b)
{
	if (a->n_live + 1 > 2 * a->n_live_buckets)
		live_grow(a);
	size_t h = hash_ptr(b->ptr, a->n_live_buckets);
	b->next = a->live[h];
	a->live[h] = b;
	a->n_live++;
}

static block *live_remove(ej_allocator *a, void *ptr)
{
	block **pp = &a->live[hash_ptr(ptr, a->n_live_buckets)];
	for (; *pp; pp = &(*pp)->next)
		if ((*pp)->ptr == ptr) {
			block *b = *pp;
			*pp = b->next;
			b->next = NULL;
			a->n_live--;
			return b;
		}
	return NULL;
}

static void update_peaks(ej_allocator *a)
{
	if (a->st.allocated > a->st.peak_allocated)
		a->st.peak_allocated = a->st.allocated;
	if (a->st.reserved > a->st.peak_reserved)
		a->st.peak_reserved = a->st.reserved;
}

void *ej_alloc(ej_allocator *a, size_t bytes)
{
	if (a->fail_countdown > 0 && --a->fail_countdown == 0)
		return NULL; /* test hook: one-shot failure */
	size_t size = round_size(bytes);
	if (size == 0)
		return NULL;

	block *b = NULL;
	bin *bn = a->caching ? bin_find(a, size, false) : NULL;
	if (bn && bn->free) {
		b = bn->free;
		bn->free = b->next;
		b->next = NULL;
		a->st.cache_hits++;
	} else {
		b = malloc(sizeof *b);
		if (!b)
			return NULL;
		b->size = size;
		b->next = NULL;
		b->ptr = a->dev->alloc(a->dev->self, size);
		if (!b->ptr && a->st.reserved > a->st.allocated) {
			ej_allocator_empty_cache(a);
			b->ptr = a->dev->alloc(a->dev->self, size);
		}
		if (!b->ptr) {
			free(b);
			return NULL;
		}
		a->st.reserved += size;
	}
	live_insert(a, b);
	a->st.allocated += size;
	a->st.num_allocs++;
	update_peaks(a);
	return b->ptr;
}

void ej_dealloc(ej_allocator *a, void *ptr)
{
	if (!ptr)
		return;
	block *b = live_remove(a, ptr);
	EJ_ASSERT(b != NULL && "ej_dealloc of a pointer this allocator does "
			       "not own");
	a->st.allocated -= b->size;
	a->st.num_frees++;
	bin *bn = a->caching ? bin_find(a, b->size, true) : NULL;
	if (bn) {
		b->next = bn->free;
		bn->free = b;
	} else {
		release_block(a, b); /* caching off, or no memory for a bin */
	}
}

void ej_allocator_stats(const ej_allocator *a, epj_memory_stats *out)
{
	*out = a->st;
}

void ej_allocator_reset_peaks(ej_allocator *a)
{
	a->st.peak_allocated = a->st.allocated;
	a->st.peak_reserved = a->st.reserved;
}

void ej_allocator_fail_after(ej_allocator *a, int64_t n)
{
	a->fail_countdown = n > 0 ? n : 0;
}

/* ---- public memory API ----------------------------------------------------
 */

void epj_memory_stats_get(const epj_ctx *ctx, epj_memory_stats *out)
{
	if (!out)
		return;
	if (!ctx || !ctx->alloc) {
		memset(out, 0, sizeof *out);
		return;
	}
	ej_allocator_stats(ctx->alloc, out);
}

void epj_memory_reset_peaks(epj_ctx *ctx)
{
	if (ctx && ctx->alloc)
		ej_allocator_reset_peaks(ctx->alloc);
	if (ctx && ctx->dev && ctx->dev->reset_peaks)
		ctx->dev->reset_peaks(ctx->dev->self);
}

void epj_memory_empty_cache(epj_ctx *ctx)
{
	if (ctx && ctx->alloc)
		ej_allocator_empty_cache(ctx->alloc);
}

/* ---- storages ---------------------------------------------------------------
 * A storage owns one allocator block (alloc != NULL) or borrows external
 * memory (alloc == NULL, never freed here).  Refcounted by tensors. */

/* Zero-fills device memory: dev->memzero, or copies from a host zero page. */
static void device_zero(const ej_device *dev, void *ptr, size_t bytes)
{
	if (dev->memzero) {
		dev->memzero(dev->self, ptr, bytes);
		return;
	}
	static const char zeros[4096];
	for (size_t o = 0; o < bytes; o += sizeof zeros) {
		size_t n = bytes - o < sizeof zeros ? bytes - o : sizeof zeros;
		dev->copy(dev->self, (char *)ptr + o, zeros, n);
	}
}

ej_storage *ej_storage_new_uninit(epj_ctx *ctx, size_t bytes)
{
	ej_storage *s = malloc(sizeof *s);
	void *data = s ? ej_alloc(ctx->alloc, bytes) : NULL;
	if (!data) {
		free(s);
		ej_error(ctx, EPJ_ERR_NOMEM,
			 "out of memory allocating %zu bytes", bytes);
		return NULL;
	}
	s->refcount = 1;
	s->data = data;
	s->bytes = bytes;
	s->alloc = ctx->alloc;
	s->param = false;
	s->f32 = NULL;
	s->f32_epoch = 0;
	return s;
}

ej_storage *ej_storage_new(epj_ctx *ctx, size_t bytes)
{
	ej_storage *s = ej_storage_new_uninit(ctx, bytes);
	if (s)
		device_zero(ctx->dev, s->data, bytes);
	return s;
}

void ej_storage_ref(ej_storage *s)
{
	EJ_ASSERT(s->refcount > 0);
	s->refcount++;
}

void ej_storage_unref(ej_storage *s)
{
	if (!s)
		return;
	EJ_ASSERT(s->refcount > 0);
	if (--s->refcount > 0)
		return;
	if (s->alloc)
		ej_dealloc(s->alloc, s->data);
	if (s->f32)
		ej_dealloc(s->alloc, s->f32);
	free(s);
}
