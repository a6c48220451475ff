/* alloc.c -- the cpu device and the caching allocator; storages.
 *
 * The allocator sits between storages and a device (ej_device).  It takes
 * memory from the device in segments and hands out blocks carved from
 * them; a freed block is merged with its free neighbours and kept, so a
 * training loop stops calling the device once the cache holds enough,
 * also when the sizes it asks for change from step to step (the routed
 * rows of an MoE layer), as PyTorch's CUDA caching allocator does.
 *
 * Rounding (what the stats count as a block's size):
 *  - requests up to 1 MiB round up to a multiple of 512 bytes (0 -> 512);
 *  - larger requests round up to a multiple of 64 KiB.
 * Pools and segments: blocks up to 1 MiB come from the small pool, whose
 * segments are 2 MiB; larger blocks from the large pool, whose segments
 * are 20 MiB for blocks under 10 MiB and the block rounded up to a
 * multiple of 2 MiB above.  A pool never serves the other's requests, so
 * small blocks do not cut up the large pool's space.
 * Reuse: a request takes the best fit among its pool's free blocks (the
 * smallest of at least its size, the lowest address among equals; a treap
 * ordered by (size, address)), split when larger: the rest stays free.
 * A freed block merges with the free blocks beside it in its segment.
 * Release: a request that misses the cache and fails on the device returns
 * every whole free segment to the device and retries, then asks for a
 * segment of the block's own size (a 20 MiB one may no longer fit).
 * ej_allocator_empty_cache returns the whole free segments; a segment with
 * a live block stays.
 *
 * Blocks are device addresses: nothing here reads or writes through them
 * (on the cuda device they are not host memory).  Their records (address,
 * size, neighbours) live in host memory.  Under AddressSanitizer, on host
 * memory, free bytes are poisoned, so a run past a block or a read after a
 * free is reported as with separate mallocs.
 *
 * Statistics (bytes are rounded sizes):
 *  - allocated: live blocks; reserved: segments obtained from the device
 *    and not returned (live blocks + free blocks); peaks since creation or
 *    the last reset;
 *  - num_allocs / num_frees: ej_alloc calls served / ej_dealloc calls;
 *  - cache_hits: allocations served from a free block;
 *  - num_device_allocs / num_device_frees: segments obtained / returned.
 *
 * Invariants
 *  - Every segment is a list of blocks that tile it in address order
 *    (prev/next); no two free blocks are neighbours.  A block is live (in
 *    the live table, keyed by address) or free (in its pool's tree).
 *    allocated == sum(live), reserved == sum(segments).
 *  - Stream order (the cuda device): all work runs on one compute stream,
 *    and a freed block (or a piece of it) is handed out only to work
 *    queued after the free on that stream.  A segment goes back only
 *    through the device's free, which waits for the device.
 *  - Threading: one context = one thread.  The allocator has no locks;
 *    callers must not allocate or free from inside parallel regions.
 *
 * EPJIT_ALLOC_CACHE=0 disables caching: every block is a segment of its
 * own, returned to the device when freed, which lets ASan/valgrind see
 * use-after-free of storage data.
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

#define SMALL_LIMIT	   ((size_t)1 << 20) /* 1 MiB: the small pool's largest */
#define SMALL_ROUND	   ((size_t)512)
#define LARGE_ROUND	   ((size_t)64 << 10) /* 64 KiB */
#define SMALL_SEGMENT	   ((size_t)2 << 20)  /* 2 MiB */
#define LARGE_SEGMENT	   ((size_t)20 << 20) /* 20 MiB */
#define LARGE_SHARED_LIMIT ((size_t)10 << 20) /* below: LARGE_SEGMENT */
#define SEGMENT_ROUND	   ((size_t)2 << 20)  /* above: multiples of 2 MiB */

enum { POOL_SMALL, POOL_LARGE, N_POOLS };

/* A block: a piece of a segment, live or free.  ptr is an address on the
 * device, never dereferenced here (device memory is not host memory). */
typedef struct block {
	char *ptr;
	size_t size; /* rounded */
	/* the neighbours in its segment, by address; NULL at the ends, so a
	 * block with neither is a whole segment */
	struct block *prev, *next;
	struct block *chain;	    /* live-table chain; release lists */
	struct block *left, *right; /* free tree of its pool */
	uint32_t prio;		    /* free tree: treap priority */
	uint8_t pool;
	bool free;
} block;

struct ej_allocator {
	const ej_device *dev;
	bool caching;
	/* live blocks: chained hash table keyed by pointer */
	block **live;
	size_t n_live_buckets, n_live;
	/* free blocks of each pool: a treap ordered by (size, ptr) */
	block *free_tree[N_POOLS];
	int64_t fail_countdown; /* > 0: the countdown-th allocation fails */
	epj_memory_stats st;
};

/* Host-memory devices under AddressSanitizer: free bytes of a segment are
 * poisoned, so that a kernel running past its block, or reading a block
 * after its storage was freed, is reported as with separate mallocs. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EJ_ALLOC_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(EJ_ALLOC_ASAN)
#define EJ_ALLOC_ASAN 1
#endif
#ifdef EJ_ALLOC_ASAN
#include <sanitizer/asan_interface.h>
static void poison(const ej_allocator *a, const void *p, size_t n, bool on)
{
	if (!a->dev->host_visible)
		return;
	if (on)
		ASAN_POISON_MEMORY_REGION(p, n);
	else
		ASAN_UNPOISON_MEMORY_REGION(p, n);
}
#else
static void poison(const ej_allocator *a, const void *p, size_t n, bool on)
{
	(void)a, (void)p, (void)n, (void)on;
}
#endif

static size_t hash_ptr(const void *p, size_t nb)
{
	uint64_t x = (uint64_t)(uintptr_t)p;
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	return (size_t)(x & (nb - 1));
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

/* The device allocation a cache miss of rounded size `size` asks for. */
static size_t segment_size(const ej_allocator *a, size_t size)
{
	if (!a->caching)
		return size;
	if (size <= SMALL_LIMIT)
		return SMALL_SEGMENT;
	if (size < LARGE_SHARED_LIMIT)
		return LARGE_SEGMENT;
	if (size > SIZE_MAX - SEGMENT_ROUND)
		return size;
	return (size + SEGMENT_ROUND - 1) / SEGMENT_ROUND * SEGMENT_ROUND;
}

/* ---- the free trees: treaps keyed by (size, ptr) ---- */

static bool key_less(const block *x, const block *y)
{
	return x->size < y->size || (x->size == y->size && x->ptr < y->ptr);
}

/* Joins two treaps whose keys are all less in l than in r. */
static block *tree_join(block *l, block *r)
{
	if (!l)
		return r;
	if (!r)
		return l;
	if (l->prio > r->prio) {
		l->right = tree_join(l->right, r);
		return l;
	}
	r->left = tree_join(l, r->left);
	return r;
}

/* Splits t into the keys less than k's (*l) and the others (*r). */
static void tree_split(block *t, const block *k, block **l, block **r)
{
	if (!t) {
		*l = *r = NULL;
	} else if (key_less(t, k)) {
		tree_split(t->right, k, &t->right, r);
		*l = t;
	} else {
		tree_split(t->left, k, l, &t->left);
		*r = t;
	}
}

static void tree_insert(block **root, block *b)
{
	b->left = b->right = NULL;
	b->prio = (uint32_t)hash_ptr(b->ptr, (size_t)1 << 31) ^
		  (uint32_t)(b->size >> 9);
	block *l, *r;
	tree_split(*root, b, &l, &r);
	*root = tree_join(tree_join(l, b), r);
}

static void tree_remove(block **root, block *b)
{
	block **p = root;
	while (*p != b) {
		EJ_ASSERT(*p != NULL && "a free block missing from its tree");
		p = key_less(b, *p) ? &(*p)->left : &(*p)->right;
	}
	*p = tree_join(b->left, b->right);
	b->left = b->right = NULL;
}

/* Best fit: the smallest block of at least `size` bytes (the lowest address
 * among equals), or NULL. */
static block *tree_best_fit(block *t, size_t size)
{
	block *best = NULL;
	while (t) {
		if (t->size >= size) {
			best = t;
			t = t->left;
		} else {
			t = t->right;
		}
	}
	return best;
}

/* Pushes the whole free segments of tree t onto *out (through chain). */
static void tree_whole_segments(block *t, block **out)
{
	for (; t; t = t->right) {
		tree_whole_segments(t->left, out);
		if (!t->prev && !t->next) {
			t->chain = *out;
			*out = t;
		}
	}
}

/* ---- live blocks: a chained hash table keyed by pointer ---- */

/* Doubles the table when it gets loaded; on malloc failure keeps the old
 * one (chains only get longer). */
static void live_grow(ej_allocator *a)
{
	size_t nb = a->n_live_buckets * 2;
	block **t = calloc(nb, sizeof *t);
	if (!t)
		return;
	for (size_t i = 0; i < a->n_live_buckets; i++)
		while (a->live[i]) {
			block *b = a->live[i];
			a->live[i] = b->chain;
			size_t h = hash_ptr(b->ptr, nb);
			b->chain = t[h];
			t[h] = b;
		}
	free(a->live);
	a->live = t;
	a->n_live_buckets = nb;
}

static void live_insert(ej_allocator *a, block *b)
{
	if (a->n_live + 1 > 2 * a->n_live_buckets)
		live_grow(a);
	size_t h = hash_ptr(b->ptr, a->n_live_buckets);
	b->chain = a->live[h];
	a->live[h] = b;
	a->n_live++;
}

static block *live_remove(ej_allocator *a, void *ptr)
{
	block **pp = &a->live[hash_ptr(ptr, a->n_live_buckets)];
	for (; *pp; pp = &(*pp)->chain)
		if ((*pp)->ptr == ptr) {
			block *b = *pp;
			*pp = b->chain;
			b->chain = NULL;
			a->n_live--;
			return b;
		}
	return NULL;
}

/* ---- segments and blocks ---- */

ej_allocator *ej_allocator_new(const ej_device *dev)
{
	ej_allocator *a = calloc(1, sizeof *a);
	if (!a)
		return NULL;
	a->dev = dev;
	const char *env = getenv("EPJIT_ALLOC_CACHE");
	a->caching = !(env && strcmp(env, "0") == 0);
	a->n_live_buckets = 64;
	a->live = calloc(a->n_live_buckets, sizeof *a->live);
	if (!a->live) {
		free(a);
		return NULL;
	}
	return a;
}

/* Returns a whole segment (a free block with no neighbours, in no tree) to
 * the device. */
static void release_segment(ej_allocator *a, block *b)
{
	EJ_ASSERT(b->free && !b->prev && !b->next);
	poison(a, b->ptr, b->size, false);
	a->dev->free(a->dev->self, b->ptr);
	a->st.reserved -= b->size;
	a->st.num_device_frees++;
	free(b);
}

/* Returns every whole free segment to the device (the others hold a live
 * block). */
static void release_free_segments(ej_allocator *a)
{
	for (int p = 0; p < N_POOLS; p++) {
		block *list = NULL;
		tree_whole_segments(a->free_tree[p], &list);
		while (list) {
			block *b = list;
			list = b->chain;
			tree_remove(&a->free_tree[p], b);
			release_segment(a, b);
		}
	}
}

void ej_allocator_empty_cache(ej_allocator *a)
{
	release_free_segments(a);
}

/* A new segment for a block of `size` bytes of pool `pool`, in the pool's
 * free tree; NULL when the device has no memory for it.  Out of memory,
 * the cache's whole free segments go back to the device and the request is
 * tried again, then once more for `size` bytes alone. */
static block *segment_new(ej_allocator *a, int pool, size_t size)
{
	block *b = calloc(1, sizeof *b);
	if (!b)
		return NULL;
	size_t seg = segment_size(a, size);
	void *p = a->dev->alloc(a->dev->self, seg);
	if (!p && a->st.reserved > a->st.allocated) {
		release_free_segments(a);
		p = a->dev->alloc(a->dev->self, seg);
	}
	if (!p && seg > size) {
		seg = size;
		p = a->dev->alloc(a->dev->self, seg);
	}
	if (!p) {
		free(b);
		return NULL;
	}
	b->ptr = p;
	b->size = seg;
	b->pool = (uint8_t)pool;
	b->free = true;
	a->st.reserved += seg;
	a->st.num_device_allocs++;
	poison(a, p, seg, true);
	tree_insert(&a->free_tree[pool], b);
	return b;
}

/* Takes `size` bytes from the start of free block b (in its tree): the
 * rest, if any, stays free as a block of its own.  False when there is no
 * memory for that block's record (b stays free). */
static bool block_take(ej_allocator *a, block *b, size_t size)
{
	EJ_ASSERT(b->free && b->size >= size);
	block *rest = NULL;
	if (b->size > size && !(rest = calloc(1, sizeof *rest)))
		return false;
	tree_remove(&a->free_tree[b->pool], b);
	b->free = false;
	if (rest) {
		rest->ptr = b->ptr + size;
		rest->size = b->size - size;
		rest->pool = b->pool;
		rest->free = true;
		rest->prev = b;
		rest->next = b->next;
		if (b->next)
			b->next->prev = rest;
		b->next = rest;
		b->size = size;
		tree_insert(&a->free_tree[rest->pool], rest);
	}
	poison(a, b->ptr, b->size, false);
	return true;
}

/* Absorbs block hi into its neighbour lo (just below it in the same
 * segment); returns lo. */
static block *block_merge(block *lo, block *hi)
{
	EJ_ASSERT(lo->next == hi && hi->prev == lo);
	lo->size += hi->size;
	lo->next = hi->next;
	if (hi->next)
		hi->next->prev = lo;
	free(hi);
	return lo;
}

/* Makes live block b free: merged with its free neighbours and cached, or,
 * with caching off, returned to the device. */
static void block_put(ej_allocator *a, block *b)
{
	poison(a, b->ptr, b->size, true);
	b->free = true;
	if (b->prev && b->prev->free) {
		tree_remove(&a->free_tree[b->pool], b->prev);
		b = block_merge(b->prev, b);
	}
	if (b->next && b->next->free) {
		tree_remove(&a->free_tree[b->pool], b->next);
		b = block_merge(b, b->next);
	}
	if (a->caching)
		tree_insert(&a->free_tree[b->pool], b);
	else
		release_segment(a, b);
}

void ej_allocator_free(ej_allocator *a)
{
	if (!a)
		return;
	if (a->n_live)
		epj_log_msg(
		    EPJ_LOG_WARN,
		    "allocator freed with %zu live blocks (%llu bytes): "
		    "tensors outlive their context",
		    a->n_live, (unsigned long long)a->st.allocated);
	/* live blocks go back as if freed, so that every segment is whole */
	for (size_t i = 0; i < a->n_live_buckets; i++)
		while (a->live[i]) {
			block *b = a->live[i];
			a->live[i] = b->chain;
			b->chain = NULL;
			block_put(a, b);
		}
	release_free_segments(a);
	EJ_ASSERT(a->st.reserved == 0);
	free(a->live);
	free(a);
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
	int pool = size <= SMALL_LIMIT ? POOL_SMALL : POOL_LARGE;
	block *b = tree_best_fit(a->free_tree[pool], size);
	bool hit = b != NULL;
	if (!b)
		b = segment_new(a, pool, size);
	update_peaks(a); /* a new segment stays, also if the take fails */
	if (!b || !block_take(a, b, size))
		return NULL;
	live_insert(a, b);
	a->st.allocated += size;
	a->st.num_allocs++;
	a->st.cache_hits += hit;
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
	block_put(a, b);
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
