/* device_cuda.c -- the cuda device: the CUDA Driver API loaded with dlopen
 * (cuda_driver.h), one primary context per process on the GPU chosen by the
 * local rank, a compute stream, a side stream and a communication stream
 * (NCCL's all-to-all exchanges, ordered with the compute stream by events),
 * device memory under the
 * shared caching allocator (alloc.c), modules (cubins or PTX) loaded from
 * bytes, kernel launches, events and CUDA graph capture.
 *
 *   ej_cuda_driver_get   dlopen -> cuGetProcAddress(name, driver version)
 *                        for every entry point -> cuInit(0)
 *   ej_cuda_open         device = local rank % device count (or
 *                        $EPJIT_CUDA_DEVICE), primary context, streams,
 *                        attributes; the ej_device vtable over it
 *
 * Memory is stream-ordered on the compute stream: copies and fills are
 * issued there (cuMemcpyAsync / cuMemsetD8Async); a copy into host memory,
 * or out of page-locked memory, returns after a stream synchronize, so the
 * host may read or reuse its buffer at once; out of pageable memory the
 * driver has staged the bytes on return, and device to device is stream
 * ordered, so neither waits; device
 * pointers are unified addresses, so cuMemcpy infers the direction.  A
 * failed cuMemAlloc returns NULL and the caching allocator empties its free
 * lists and retries once (alloc.c), as framework allocators do on OOM.
 *
 * The vtable members have no context to report to: a failure is kept in the
 * device's last error (ej_cuda_last_error) and logged; members that take a
 * context (load, launch) report there.
 */
#include "cuda_driver.h"
#include "dynlib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the driver table ---------------------------------------------------- */

typedef ej_CUresult (*getproc_v2_fn)(const char *, void **, int,
				     unsigned long long, int *);
typedef ej_CUresult (*getproc_v1_fn)(const char *, void **, int,
				     unsigned long long);

static ej_cuda_driver drv;
static bool driver_load(char *err, size_t n, epj_status *st_out);
static ej_dynlib drv_dl = EJ_DYNLIB_INIT(driver_load, EPJ_ERR_BACKEND);

static const char *src_file(const char *p)
{
	const char *s = strrchr(p, '/');
	return s ? s + 1 : p;
}

epj_status ej_cuda_error(epj_ctx *ctx, const ej_cuda_driver *d, ej_CUresult r,
			 const char *what, const char *file, int line)
{
	const char *name = NULL, *str = NULL;
	if (d && d->cuGetErrorName)
		d->cuGetErrorName(r, &name);
	if (d && d->cuGetErrorString)
		d->cuGetErrorString(r, &str);
	return ej_error(ctx, EPJ_ERR_BACKEND,
			"cuda: %s failed at %s:%d: %s (%d): %s", what,
			src_file(file), line, name ? name : "CUDA_ERROR_?", r,
			str ? str : "no description");
}

/* ---- the counting wrappers ------------------------------------------------
 * The table handed out (drv) holds these in place of the driver's own
 * entry points for every call that allocates, frees, copies, launches or
 * waits; raw holds the driver's.  Counts are process-wide (one driver per
 * process) and atomic (contexts may live on several threads).  Copy
 * directions come from the live allocations: an address inside a block
 * from cuMemAlloc is device memory, anything else host memory. */

static ej_cuda_driver raw;
static struct {
	int64_t launches, graph_launches, mem_alloc, mem_free, syncs;
	int64_t h2d, d2h, d2d, reserved, peak;
} cnt;

#define CNT_ADD(field, n) __atomic_add_fetch(&cnt.field, (n), __ATOMIC_RELAXED)
#define CNT_GET(field)	  __atomic_load_n(&cnt.field, __ATOMIC_RELAXED)

/* live device blocks, sorted by base */
static pthread_mutex_t blk_lock = PTHREAD_MUTEX_INITIALIZER;
static struct blk {
	uintptr_t base;
	size_t n;
	bool pinned; /* page-locked host memory (cuMemHostAlloc) */
} * blk;
static size_t n_blk, cap_blk;

/* Index of the first block whose base is > p. */
static size_t blk_upper(uintptr_t p)
{
	size_t lo = 0, hi = n_blk;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (blk[mid].base <= p)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static void blk_add(uintptr_t p, size_t n, bool pinned)
{
	pthread_mutex_lock(&blk_lock);
	if (n_blk == cap_blk) {
		size_t cap = cap_blk ? 2 * cap_blk : 256;
		struct blk *v = realloc(blk, cap * sizeof *v);
		if (!v) { /* directions of copies into it read as host */
			pthread_mutex_unlock(&blk_lock);
			return;
		}
		blk = v;
		cap_blk = cap;
	}
	size_t i = blk_upper(p);
	memmove(blk + i + 1, blk + i, (n_blk - i) * sizeof *blk);
	blk[i] = (struct blk){ p, n, pinned };
	n_blk++;
	if (!pinned) {
		int64_t r = CNT_ADD(reserved, (int64_t)n);
		if (r > cnt.peak)
			cnt.peak = r;
	}
	pthread_mutex_unlock(&blk_lock);
}

static void blk_remove(uintptr_t p)
{
	pthread_mutex_lock(&blk_lock);
	size_t i = blk_upper(p);
	if (i > 0 && blk[i - 1].base == p) {
		if (!blk[i - 1].pinned)
			CNT_ADD(reserved, -(int64_t)blk[i - 1].n);
		memmove(blk + i - 1, blk + i, (n_blk - i) * sizeof *blk);
		n_blk--;
	}
	pthread_mutex_unlock(&blk_lock);
}

/* 1: inside a device block, 2: inside a pinned host block, 0: neither
 * (pageable host memory). */
static int where(ej_CUdeviceptr p)
{
	pthread_mutex_lock(&blk_lock);
	size_t i = blk_upper((uintptr_t)p);
	int w = i > 0 && (uintptr_t)p - blk[i - 1].base < blk[i - 1].n
		    ? (blk[i - 1].pinned ? 2 : 1)
		    : 0;
	pthread_mutex_unlock(&blk_lock);
	return w;
}

static bool on_device(ej_CUdeviceptr p)
{
	return where(p) == 1;
}

static void count_copy(ej_CUdeviceptr dst, ej_CUdeviceptr src, size_t bytes)
{
	bool d = on_device(dst), s = on_device(src);
	if (d && s)
		CNT_ADD(d2d, (int64_t)bytes);
	else if (d)
		CNT_ADD(h2d, (int64_t)bytes);
	else if (s)
		CNT_ADD(d2h, (int64_t)bytes);
}

static ej_CUresult w_cuMemAlloc(ej_CUdeviceptr *dptr, size_t bytes)
{
	ej_CUresult r = raw.cuMemAlloc(dptr, bytes);
	if (r == EJ_CUDA_SUCCESS) {
		CNT_ADD(mem_alloc, 1);
		blk_add((uintptr_t)*dptr, bytes, false);
	}
	return r;
}

static ej_CUresult w_cuMemFree(ej_CUdeviceptr dptr)
{
	/* cuMemFree waits for the device: a free is a synchronization */
	ej_CUresult r = raw.cuMemFree(dptr);
	CNT_ADD(syncs, 1);
	if (r == EJ_CUDA_SUCCESS) {
		CNT_ADD(mem_free, 1);
		blk_remove((uintptr_t)dptr);
	}
	return r;
}

static ej_CUresult w_cuMemHostAlloc(void **p, size_t bytes, unsigned flags)
{
	ej_CUresult r = raw.cuMemHostAlloc(p, bytes, flags);
	if (r == EJ_CUDA_SUCCESS)
		blk_add((uintptr_t)*p, bytes, true);
	return r;
}

static ej_CUresult w_cuMemFreeHost(void *p)
{
	ej_CUresult r = raw.cuMemFreeHost(p);
	if (r == EJ_CUDA_SUCCESS)
		blk_remove((uintptr_t)p);
	return r;
}

static ej_CUresult w_cuMemcpy(ej_CUdeviceptr dst, ej_CUdeviceptr src,
			      size_t bytes)
{
	count_copy(dst, src, bytes);
	CNT_ADD(syncs, 1); /* returns when the copy is done */
	return raw.cuMemcpy(dst, src, bytes);
}

/* ---- the stream log --------------------------------------------------------
 *
 * The order in which work reached the device's streams (the census of the
 * overlap): each launch, async copy, event record, stream wait and library
 * exchange (ej_cuda_stream_note) is one entry, the stream's letter (c:
 * compute, s: side, m: communication, ?: another) and the operation's. */
#define SLOG_CAP 8192
static struct {
	pthread_mutex_t lock;
	char ev[SLOG_CAP][2];
	uint64_t n; /* entries ever logged (the ring keeps the last SLOG_CAP) */
	ej_CUstream streams[3];
} slog = { .lock = PTHREAD_MUTEX_INITIALIZER };

static void slog_add(ej_CUstream s, char op)
{
	static const char letter[3] = { 'c', 's', 'm' };
	char who = '?';
	for (int i = 0; i < 3; i++)
		if (s && s == slog.streams[i])
			who = letter[i];
	pthread_mutex_lock(&slog.lock);
	char *e = slog.ev[slog.n++ % SLOG_CAP];
	e[0] = who;
	e[1] = op;
	pthread_mutex_unlock(&slog.lock);
}

void ej_cuda_stream_note(void *stream, char op)
{
	slog_add((ej_CUstream)stream, op);
}

size_t ej_cuda_stream_log(char *out, size_t n)
{
	pthread_mutex_lock(&slog.lock);
	uint64_t first = slog.n > SLOG_CAP ? slog.n - SLOG_CAP : 0;
	size_t k = 0, w = 0; /* the text's length, and what fits */
	for (uint64_t i = first; i < slog.n; i++) {
		const char *e = slog.ev[i % SLOG_CAP];
		char tok[5] = { ' ', e[0], ':', e[1], 0 };
		const char *t = k ? tok : tok + 1;
		size_t len = strlen(t);
		if (out && w == k && w + len < n) {
			memcpy(out + w, t, len);
			w += len;
		}
		k += len;
	}
	if (out && n)
		out[w] = 0;
	pthread_mutex_unlock(&slog.lock);
	return k;
}

void ej_cuda_stream_log_reset(void)
{
	pthread_mutex_lock(&slog.lock);
	slog.n = 0;
	pthread_mutex_unlock(&slog.lock);
}

static ej_CUresult w_cuEventRecord(ej_CUevent ev, ej_CUstream stream)
{
	ej_CUresult r = raw.cuEventRecord(ev, stream);
	if (r == EJ_CUDA_SUCCESS)
		slog_add(stream, 'R');
	return r;
}

static ej_CUresult w_cuStreamWaitEvent(ej_CUstream stream, ej_CUevent ev,
				       unsigned flags)
{
	ej_CUresult r = raw.cuStreamWaitEvent(stream, ev, flags);
	if (r == EJ_CUDA_SUCCESS)
		slog_add(stream, 'W');
	return r;
}

static ej_CUresult w_cuMemcpyAsync(ej_CUdeviceptr dst, ej_CUdeviceptr src,
				   size_t bytes, ej_CUstream stream)
{
	count_copy(dst, src, bytes);
	ej_CUresult r = raw.cuMemcpyAsync(dst, src, bytes, stream);
	if (r == EJ_CUDA_SUCCESS)
		slog_add(stream, 'C');
	return r;
}

static ej_CUresult w_cuLaunchKernel(ej_CUfunction fn, unsigned gx, unsigned gy,
				    unsigned gz, unsigned bx, unsigned by,
				    unsigned bz, unsigned smem,
				    ej_CUstream stream, void **params,
				    void **extra)
{
	ej_CUresult r = raw.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem,
					   stream, params, extra);
	if (r == EJ_CUDA_SUCCESS) {
		CNT_ADD(launches, 1);
		slog_add(stream, 'L');
	}
	return r;
}

static ej_CUresult w_cuGraphLaunch(ej_CUgraphExec exec, ej_CUstream stream)
{
	ej_CUresult r = raw.cuGraphLaunch(exec, stream);
	if (r == EJ_CUDA_SUCCESS) {
		CNT_ADD(graph_launches, 1);
		slog_add(stream, 'G');
	}
	return r;
}

static ej_CUresult w_cuStreamSynchronize(ej_CUstream stream)
{
	CNT_ADD(syncs, 1);
	return raw.cuStreamSynchronize(stream);
}

static ej_CUresult w_cuCtxSynchronize(void)
{
	CNT_ADD(syncs, 1);
	return raw.cuCtxSynchronize();
}

static ej_CUresult w_cuEventSynchronize(ej_CUevent ev)
{
	CNT_ADD(syncs, 1);
	return raw.cuEventSynchronize(ev);
}

void ej_cuda_counters(ej_dev_counters *out)
{
	*out = (ej_dev_counters){ .launches = CNT_GET(launches),
				  .graph_launches = CNT_GET(graph_launches),
				  .mem_alloc = CNT_GET(mem_alloc),
				  .mem_free = CNT_GET(mem_free),
				  .syncs = CNT_GET(syncs),
				  .bytes_h2d = CNT_GET(h2d),
				  .bytes_d2h = CNT_GET(d2h),
				  .bytes_d2d = CNT_GET(d2d),
				  .reserved = CNT_GET(reserved) };
	pthread_mutex_lock(&blk_lock);
	out->peak_reserved = cnt.peak;
	pthread_mutex_unlock(&blk_lock);
}

void ej_cuda_counters_reset_peak(void)
{
	pthread_mutex_lock(&blk_lock);
	cnt.peak = CNT_GET(reserved);
	pthread_mutex_unlock(&blk_lock);
}

/* Loads and resolves the table into drv; false with err set. */
static bool driver_load(char *err, size_t n, epj_status *st_out)
{
	(void)st_out; /* EPJ_ERR_BACKEND, the default */
	const char *path = getenv("EPJIT_CUDA_DRIVER");
	if (!path || !*path)
		path = "libcuda.so.1";
	snprintf(drv.path, sizeof drv.path, "%s", path);
	char why[400];
	void *h = ej_dynlib_open(path, why, sizeof why);
	if (!h) {
		snprintf(err, n, "no CUDA driver (%s)", why);
		return false;
	}
	/* POSIX: dlsym's data pointer converts to a function pointer */
	void *p;
	p = dlsym(h, "cuGetErrorName");
	memcpy(&drv.cuGetErrorName, &p, sizeof p);
	p = dlsym(h, "cuGetErrorString");
	memcpy(&drv.cuGetErrorString, &p, sizeof p);
	p = dlsym(h, "cuDriverGetVersion");
	ej_CUresult (*version)(int *) = NULL;
	memcpy(&version, &p, sizeof p);
	getproc_v2_fn gp2 = NULL;
	getproc_v1_fn gp1 = NULL;
	p = dlsym(h, "cuGetProcAddress_v2");
	memcpy(&gp2, &p, sizeof p);
	p = dlsym(h, "cuGetProcAddress");
	memcpy(&gp1, &p, sizeof p);
	if (!version || (!gp2 && !gp1) || !drv.cuGetErrorName ||
	    !drv.cuGetErrorString) {
		snprintf(err, n,
			 "CUDA driver unusable: %s lacks cuGetProcAddress, "
			 "cuDriverGetVersion or cuGetErrorName",
			 path);
		return false; /* the handle stays open: nothing to undo */
	}
	int v = 0;
	if (version(&v) != EJ_CUDA_SUCCESS || v < EJ_CUDA_MIN_DRIVER) {
		snprintf(
		    err, n,
		    "CUDA driver %s is too old: version %d.%d; epjit "
		    "needs %d.%d or newer (an R580+ driver: the CUDA %d "
		    "toolkit's NVRTC, cuBLASLt and NCCL need it)",
		    path, v / 1000, v % 1000 / 10, EJ_CUDA_MIN_DRIVER / 1000,
		    EJ_CUDA_MIN_DRIVER % 1000 / 10, EJ_CUDA_MIN_DRIVER / 1000);
		return false;
	}
	drv.version = v;
	/* every entry point at its prototype's version (cuda_driver.h) */
#define EJ_CUDA_RESOLVE(name, ver, args)                                       \
	{                                                                      \
		void *fp = NULL;                                               \
		int status = 0;                                                \
		ej_CUresult r = gp2 ? gp2(#name, &fp, (ver), 0, &status)       \
				    : gp1(#name, &fp, (ver), 0);               \
		if (r != EJ_CUDA_SUCCESS || !fp) {                             \
			snprintf(err, n,                                       \
				 "CUDA driver %s: cuGetProcAddress(\"%s\", "   \
				 "%d) failed (error %d)",                      \
				 path, #name, (ver), r);                       \
			return false;                                          \
		}                                                              \
		memcpy(&drv.name, &fp, sizeof fp);                             \
	}
	EJ_CUDA_ENTRY_POINTS(EJ_CUDA_RESOLVE)
#undef EJ_CUDA_RESOLVE
	/* the counted calls go through the wrappers */
	raw = drv;
	drv.cuMemAlloc = w_cuMemAlloc;
	drv.cuMemFree = w_cuMemFree;
	drv.cuMemHostAlloc = w_cuMemHostAlloc;
	drv.cuMemFreeHost = w_cuMemFreeHost;
	drv.cuMemcpy = w_cuMemcpy;
	drv.cuMemcpyAsync = w_cuMemcpyAsync;
	drv.cuLaunchKernel = w_cuLaunchKernel;
	drv.cuGraphLaunch = w_cuGraphLaunch;
	drv.cuStreamSynchronize = w_cuStreamSynchronize;
	drv.cuCtxSynchronize = w_cuCtxSynchronize;
	drv.cuEventSynchronize = w_cuEventSynchronize;
	drv.cuEventRecord = w_cuEventRecord;
	drv.cuStreamWaitEvent = w_cuStreamWaitEvent;
	ej_CUresult r = drv.cuInit(0);
	if (r != EJ_CUDA_SUCCESS) {
		const char *name = NULL, *str = NULL;
		drv.cuGetErrorName(r, &name);
		drv.cuGetErrorString(r, &str);
		snprintf(err, n,
			 "CUDA driver %s: cuInit(0) failed: %s (%d): %s", path,
			 name ? name : "?", r, str ? str : "");
		return false;
	}
	return true;
}

const ej_cuda_driver *ej_cuda_driver_get(epj_ctx *ctx)
{
	return ej_dynlib_get(&drv_dl, ctx) ? &drv : NULL;
}

/* ---- the device ---------------------------------------------------------- */

struct ej_cuda_dev {
	const ej_cuda_driver *d;
	int ordinal;
	ej_CUdevice dev;
	ej_CUcontext cu;
	ej_CUstream compute, side, comm;
	int sm_count, cc_major, cc_minor, max_threads, smem_optin;
	size_t total_mem;
	char name[128];
	ej_device vt;	      /* the vtable, self = this */
	char last_error[512]; /* of a vtable member without a context */
	bool capturing;	      /* a stream capture is under way */
	int64_t launches;     /* cuLaunchKernel calls made */
};

static pthread_mutex_t dev_lock = PTHREAD_MUTEX_INITIALIZER;
static ej_cuda_dev *dev_open; /* the process's device (one context) */

/* A failed call inside a vtable member: kept and logged. */
static void dev_fail(ej_cuda_dev *c, ej_CUresult r, const char *what)
{
	const char *name = NULL, *str = NULL;
	c->d->cuGetErrorName(r, &name);
	c->d->cuGetErrorString(r, &str);
	snprintf(c->last_error, sizeof c->last_error,
		 "cuda: %s failed: %s (%d): %s", what, name ? name : "?", r,
		 str ? str : "");
	epj_log_msg(EPJ_LOG_WARN, "%s", c->last_error);
}

#define DEV_CALL(c, call)                                                      \
	do {                                                                   \
		ej_CUresult r_ = (c)->d->call;                                 \
		if (r_ != EJ_CUDA_SUCCESS)                                     \
			dev_fail((c), r_, #call);                              \
	} while (0)

static void *cu_alloc(void *self, size_t bytes)
{
	ej_cuda_dev *c = self;
	ej_CUdeviceptr p = 0;
	ej_CUresult r = c->d->cuMemAlloc(&p, bytes);
	if (r != EJ_CUDA_SUCCESS) {
		/* out of memory is the allocator's cue to empty its cache and
		 * retry; only a second failure is the caller's problem */
		if (r != EJ_CUDA_ERROR_OUT_OF_MEMORY)
			dev_fail(c, r, "cuMemAlloc");
		else
			snprintf(c->last_error, sizeof c->last_error,
				 "cuda: cuMemAlloc(%zu bytes): out of memory",
				 bytes);
		return NULL;
	}
	return (void *)(uintptr_t)p;
}

static void cu_free(void *self, void *ptr)
{
	ej_cuda_dev *c = self;
	if (!ptr)
		return;
	/* the block may still be read by queued work: frees are ordered after
	 * it (cuMemFree synchronizes the device) */
	DEV_CALL(c, cuMemFree((ej_CUdeviceptr)(uintptr_t)ptr));
}

static void cu_copy(void *self, void *dst, const void *src, size_t bytes)
{
	ej_cuda_dev *c = self;
	if (!bytes)
		return;
	DEV_CALL(c, cuMemcpyAsync((ej_CUdeviceptr)(uintptr_t)dst,
				  (ej_CUdeviceptr)(uintptr_t)src, bytes,
				  c->compute));
	/* The copy returns when the host may touch its host side: a copy
	 * into host memory after it is done (the host reads it next), and
	 * one out of page-locked memory too (the driver reads it during the
	 * transfer).  Out of pageable memory the driver has staged the
	 * bytes when cuMemcpyAsync returns (the CUDA documentation's "API
	 * synchronization behavior"), and a device-to-device copy is ordered
	 * with the kernels on the compute stream: waiting for either would
	 * stall the host for nothing. */
	int wd = where((ej_CUdeviceptr)(uintptr_t)dst),
	    ws = where((ej_CUdeviceptr)(uintptr_t)src);
	if (wd != 1 || ws == 2)
		DEV_CALL(c, cuStreamSynchronize(c->compute));
}

static void cu_memzero(void *self, void *ptr, size_t bytes)
{
	ej_cuda_dev *c = self;
	if (bytes)
		DEV_CALL(c, cuMemsetD8Async((ej_CUdeviceptr)(uintptr_t)ptr, 0,
					    bytes, c->compute));
}

static void cu_sync(void *self)
{
	ej_cuda_dev *c = self;
	/* not the communication stream: the compute stream waits for each
	 * exchange there (all_to_all_v_wait) before anything reads its
	 * buffers, so its work that matters is behind the compute stream's */
	DEV_CALL(c, cuStreamSynchronize(c->side));
	DEV_CALL(c, cuStreamSynchronize(c->compute));
}

static epj_status cu_load(void *self, epj_ctx *ctx, const void *image,
			  size_t size, const char *name, void **module)
{
	ej_cuda_dev *c = self;
	*module = NULL;
	if (!image || size < 4)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"cuda: module %s: empty image", name);
	ej_CUmodule m = NULL;
	epj_status st;
	EJ_CU_TRY(st, ctx, c->d, cuModuleLoadData(&m, image));
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "cuda: loading module %s (%zu bytes)",
				name, size);
		return st;
	}
	*module = m;
	return EPJ_OK;
}

static void cu_unload(void *self, void *module)
{
	ej_cuda_dev *c = self;
	if (module)
		DEV_CALL(c, cuModuleUnload((ej_CUmodule)module));
}

static void *cu_function(void *self, void *module, const char *kernel)
{
	ej_cuda_dev *c = self;
	ej_CUfunction f = NULL;
	ej_CUresult r =
	    c->d->cuModuleGetFunction(&f, (ej_CUmodule)module, kernel);
	return r == EJ_CUDA_SUCCESS ? (void *)f : NULL;
}

static epj_status cu_launch(void *self, epj_ctx *ctx, void *fn,
			    const char *kernel, const ej_launch *l)
{
	ej_cuda_dev *c = self;
	if (l->smem > (size_t)c->smem_optin)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"cuda: kernel %s wants %zu bytes of dynamic "
				"shared memory; %s allows %d per block",
				kernel, l->smem, c->name, c->smem_optin);
	epj_status st;
	if (l->smem > EJ_CUDA_SMEM_DEFAULT_MAX) {
		/* above 48 KiB a kernel must opt in, per function */
		EJ_CU_TRY(st, ctx, c->d,
			  cuFuncSetAttribute((ej_CUfunction)fn,
					     EJ_CU_FUNC_ATTR_MAX_DYN_SMEM,
					     (int)l->smem));
		if (st != EPJ_OK)
			return st;
	}
	/* the kernel's one parameter is its argument struct, by value:
	 * kernelParams[0] points at the packed bytes */
	void *params[1] = { (void *)l->args };
	EJ_CU_TRY(st, ctx, c->d,
		  cuLaunchKernel((ej_CUfunction)fn, l->grid[0], l->grid[1],
				 l->grid[2], l->block[0], l->block[1],
				 l->block[2], (unsigned)l->smem, c->compute,
				 params, NULL));
	if (st != EPJ_OK) {
		ej_error_prefix(ctx,
				"cuda: launching %s (grid %u,%u,%u block "
				"%u,%u,%u smem %zu)",
				kernel, l->grid[0], l->grid[1], l->grid[2],
				l->block[0], l->block[1], l->block[2], l->smem);
		return st;
	}
	c->launches++;
	return EPJ_OK;
}

static void cu_counters(void *self, ej_dev_counters *out)
{
	(void)self;
	ej_cuda_counters(out);
}

static void cu_reset_peaks(void *self)
{
	(void)self;
	ej_cuda_counters_reset_peak();
}

/* The local rank the launcher gave this process (0 when none). */
static int local_rank(void)
{
	static const char *const vars[] = { "LOCAL_RANK",
					    "OMPI_COMM_WORLD_LOCAL_RANK",
					    "MPI_LOCALRANKID",
					    "SLURM_LOCALID" };
	for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
		const char *v = getenv(vars[i]);
		char *end = NULL;
		long n = v && *v ? strtol(v, &end, 10) : -1;
		if (v && *v && *end == 0 && n >= 0 && n < 1 << 20)
			return (int)n;
	}
	return 0;
}

int ej_cuda_pick_ordinal(int device_count, const char *override, int local)
{
	if (override && *override) {
		char *end = NULL;
		long n = strtol(override, &end, 10);
		if (*end || n < 0 || n >= device_count)
			return -1;
		return (int)n;
	}
	return device_count > 0 ? local % device_count : -1;
}

/* This device's descriptor (below; lib/devices.c lists it). */
extern const ej_device_desc ej_desc_cuda;

static epj_status dev_init(epj_ctx *ctx, const ej_cuda_driver *d,
			   ej_cuda_dev *c)
{
	int n = 0;
	EJ_CU(ctx, d, cuDeviceGetCount(&n));
	if (n < 1)
		return ej_error(ctx, EPJ_ERR_BACKEND,
				"cuda: the driver sees no GPU");
	const char *ov = getenv("EPJIT_CUDA_DEVICE");
	int ord = ej_cuda_pick_ordinal(n, ov, local_rank());
	if (ord < 0)
		return ej_error(
		    ctx, EPJ_ERR_CONFIG,
		    "cuda: EPJIT_CUDA_DEVICE=\"%s\" is not a device "
		    "ordinal in [0, %d)",
		    ov ? ov : "", n);
	c->d = d;
	c->ordinal = ord;
	EJ_CU(ctx, d, cuDeviceGet(&c->dev, ord));
	EJ_CU(ctx, d, cuDeviceGetName(c->name, (int)sizeof c->name, c->dev));
	EJ_CU(ctx, d,
	      cuDeviceGetAttribute(&c->sm_count, EJ_CU_DEVICE_ATTR_SM_COUNT,
				   c->dev));
	EJ_CU(ctx, d,
	      cuDeviceGetAttribute(&c->cc_major, EJ_CU_DEVICE_ATTR_CC_MAJOR,
				   c->dev));
	EJ_CU(ctx, d,
	      cuDeviceGetAttribute(&c->cc_minor, EJ_CU_DEVICE_ATTR_CC_MINOR,
				   c->dev));
	EJ_CU(ctx, d,
	      cuDeviceGetAttribute(&c->max_threads,
				   EJ_CU_DEVICE_ATTR_MAX_THREADS_BLOCK,
				   c->dev));
	EJ_CU(ctx, d,
	      cuDeviceGetAttribute(&c->smem_optin, EJ_CU_DEVICE_ATTR_SMEM_OPTIN,
				   c->dev));
	EJ_CU(ctx, d, cuDeviceTotalMem(&c->total_mem, c->dev));
	EJ_CU(ctx, d, cuDevicePrimaryCtxRetain(&c->cu, c->dev));
	EJ_CU(ctx, d, cuCtxSetCurrent(c->cu));
	EJ_CU(ctx, d, cuStreamCreate(&c->compute, EJ_CU_STREAM_NON_BLOCKING));
	EJ_CU(ctx, d, cuStreamCreate(&c->side, EJ_CU_STREAM_NON_BLOCKING));
	EJ_CU(ctx, d, cuStreamCreate(&c->comm, EJ_CU_STREAM_NON_BLOCKING));
	pthread_mutex_lock(&slog.lock);
	slog.streams[0] = c->compute;
	slog.streams[1] = c->side;
	slog.streams[2] = c->comm;
	pthread_mutex_unlock(&slog.lock);
	c->vt = (ej_device){ .name = ej_desc_cuda.name,
			     .desc = &ej_desc_cuda,
			     .self = c,
			     .alloc = cu_alloc,
			     .free = cu_free,
			     .copy = cu_copy,
			     .memzero = cu_memzero,
			     .sync = cu_sync,
			     .host_visible = false,
			     .load = cu_load,
			     .unload = cu_unload,
			     .function = cu_function,
			     .launch = cu_launch,
			     .counters = cu_counters,
			     .reset_peaks = cu_reset_peaks };
	return EPJ_OK;
}

epj_status ej_cuda_open(epj_ctx *ctx, ej_cuda_dev **out)
{
	*out = NULL;
	const ej_cuda_driver *d = ej_cuda_driver_get(ctx);
	if (!d)
		return epj_ctx_status(ctx);
	pthread_mutex_lock(&dev_lock);
	epj_status st = EPJ_OK;
	if (!dev_open) {
		ej_cuda_dev *c = calloc(1, sizeof *c);
		if (!c)
			st =
			    ej_error(ctx, EPJ_ERR_NOMEM, "cuda: out of memory");
		else if ((st = dev_init(ctx, d, c)) != EPJ_OK)
			free(c); /* a retained context stays: the driver
				    frees it at exit */
		else
			dev_open = c;
	} else if (d->cuCtxSetCurrent(dev_open->cu) != EJ_CUDA_SUCCESS) {
		st = ej_error(ctx, EPJ_ERR_BACKEND,
			      "cuda: cannot make the context of device %d "
			      "current in this thread",
			      dev_open->ordinal);
	}
	pthread_mutex_unlock(&dev_lock);
	if (st == EPJ_OK)
		*out = dev_open;
	return st;
}

/* Test hook, deliberately in no header: forget the driver and the device
 * (both leaked), so a test run in one process (CK_FORK=no) can load another
 * driver.  Not an interface of the library. */
void ej_cuda_test_reset(void);
void ej_cuda_test_reset(void)
{
	ej_dynlib_reset(&drv_dl);
	memset(&drv, 0, sizeof drv);
	memset(&raw, 0, sizeof raw);
	pthread_mutex_lock(&blk_lock);
	n_blk = 0; /* the counts stay: tests take differences */
	__atomic_store_n(&cnt.reserved, 0, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&blk_lock);
	pthread_mutex_lock(&dev_lock);
	dev_open = NULL;
	pthread_mutex_unlock(&dev_lock);
}

const ej_device *ej_cuda_device(ej_cuda_dev *c)
{
	return &c->vt;
}

/* The registry's opener: the process's GPU; without a driver its
 * verdict: "no CUDA driver (libcuda.so.1 not found: ...)". */
static epj_status cuda_desc_open(epj_ctx *probe, const ej_device **out)
{
	ej_cuda_dev *cd = NULL;
	epj_status st = ej_cuda_open(probe, &cd);
	*out = st == EPJ_OK ? ej_cuda_device(cd) : NULL;
	return st;
}

/* The GPU: cubins from NVRTC, NCCL between ranks, cuBLASLt GEMMs. */
const ej_device_desc ej_desc_cuda = {
	.name = "cuda",
	.backend = "nvrtc",
	.comm = "nccl",
	.runs_cuda = true,
	.modules = EJ_MODULES_CUBIN,
	.reruns_grids = false,
	.gemm_library = true,
	.open = cuda_desc_open,
};

void ej_cuda_info(const ej_cuda_dev *c, ej_cuda_dev_info *out)
{
	memset(out, 0, sizeof *out);
	out->ordinal = c->ordinal;
	out->sm_count = c->sm_count;
	out->cc_major = c->cc_major;
	out->cc_minor = c->cc_minor;
	out->max_threads = c->max_threads;
	out->smem_optin = c->smem_optin;
	out->total_mem = c->total_mem;
	out->driver_version = c->d->version;
	out->launches = c->launches;
	snprintf(out->name, sizeof out->name, "%s", c->name);
	snprintf(out->arch, sizeof out->arch, "sm_%d%d", c->cc_major,
		 c->cc_minor);
}

unsigned ej_cuda_grid_cap(ej_cuda_dev *c, void *fn, unsigned block, size_t smem)
{
	int nb = 0;
	if (!c || !fn || block == 0 || c->sm_count < 1 ||
	    c->d->cuOccupancyMaxActiveBlocksPerMultiprocessor(
		&nb, (ej_CUfunction)fn, (int)block, smem) != EJ_CUDA_SUCCESS ||
	    nb < 1)
		return 0;
	uint64_t cap = (uint64_t)nb * (uint64_t)c->sm_count;
	return cap > 65535u ? 65535u : (unsigned)cap;
}

const char *ej_cuda_last_error(const ej_cuda_dev *c)
{
	return c->last_error;
}

/* ---- pinned host memory, events, graphs ---------------------------------- */

epj_status ej_cuda_host_alloc(epj_ctx *ctx, ej_cuda_dev *c, size_t bytes,
			      void **out)
{
	*out = NULL;
	EJ_CU(ctx, c->d,
	      cuMemHostAlloc(out, bytes, EJ_CU_MEMHOSTALLOC_PORTABLE));
	return EPJ_OK;
}

void ej_cuda_host_free(ej_cuda_dev *c, void *p)
{
	if (p)
		DEV_CALL(c, cuMemFreeHost(p));
}

epj_status ej_cuda_event_new(epj_ctx *ctx, ej_cuda_dev *c, void **ev)
{
	ej_CUevent e = NULL;
	EJ_CU(ctx, c->d, cuEventCreate(&e, EJ_CU_EVENT_DEFAULT));
	*ev = e;
	return EPJ_OK;
}

void ej_cuda_event_free(ej_cuda_dev *c, void *ev)
{
	if (ev)
		DEV_CALL(c, cuEventDestroy((ej_CUevent)ev));
}

epj_status ej_cuda_event_record(epj_ctx *ctx, ej_cuda_dev *c, void *ev,
				bool side)
{
	EJ_CU(ctx, c->d,
	      cuEventRecord((ej_CUevent)ev, side ? c->side : c->compute));
	return EPJ_OK;
}

epj_status ej_cuda_stream_wait(epj_ctx *ctx, ej_cuda_dev *c, void *ev,
			       bool side)
{
	EJ_CU(
	    ctx, c->d,
	    cuStreamWaitEvent(side ? c->side : c->compute, (ej_CUevent)ev, 0));
	return EPJ_OK;
}

epj_status ej_cuda_event_elapsed_ms(epj_ctx *ctx, ej_cuda_dev *c, void *start,
				    void *end, double *ms)
{
	float f = 0;
	EJ_CU(ctx, c->d, cuEventSynchronize((ej_CUevent)end));
	EJ_CU(ctx, c->d,
	      cuEventElapsedTime(&f, (ej_CUevent)start, (ej_CUevent)end));
	*ms = f;
	return EPJ_OK;
}

epj_status ej_cuda_copy_async(epj_ctx *ctx, ej_cuda_dev *c, void *dst,
			      const void *src, size_t bytes)
{
	EJ_CU(ctx, c->d,
	      cuMemcpyAsync((ej_CUdeviceptr)(uintptr_t)dst,
			    (ej_CUdeviceptr)(uintptr_t)src, bytes, c->compute));
	return EPJ_OK;
}

epj_status ej_cuda_sync(epj_ctx *ctx, ej_cuda_dev *c)
{
	EJ_CU(ctx, c->d, cuStreamSynchronize(c->side));
	EJ_CU(ctx, c->d, cuStreamSynchronize(c->comm));
	EJ_CU(ctx, c->d, cuStreamSynchronize(c->compute));
	return EPJ_OK;
}

epj_status ej_cuda_capture_begin(epj_ctx *ctx, ej_cuda_dev *c)
{
	if (c->capturing)
		return ej_error(ctx, EPJ_ERR_STATE,
				"cuda: a graph capture is already under way");
	EJ_CU(
	    ctx, c->d,
	    cuStreamBeginCapture(c->compute, EJ_CU_CAPTURE_MODE_THREAD_LOCAL));
	c->capturing = true;
	return EPJ_OK;
}

epj_status ej_cuda_capture_end(epj_ctx *ctx, ej_cuda_dev *c, void **exec)
{
	*exec = NULL;
	if (!c->capturing)
		return ej_error(ctx, EPJ_ERR_STATE,
				"cuda: no graph capture under way");
	c->capturing = false;
	ej_CUgraph g = NULL;
	EJ_CU(ctx, c->d, cuStreamEndCapture(c->compute, &g));
	ej_CUgraphExec x = NULL;
	epj_status st;
	EJ_CU_TRY(st, ctx, c->d, cuGraphInstantiateWithFlags(&x, g, 0));
	c->d->cuGraphDestroy(g); /* the executable graph keeps what it needs */
	if (st != EPJ_OK)
		return st;
	*exec = x;
	return EPJ_OK;
}

epj_status ej_cuda_graph_launch(epj_ctx *ctx, ej_cuda_dev *c, void *exec)
{
	EJ_CU(ctx, c->d, cuGraphLaunch((ej_CUgraphExec)exec, c->compute));
	return EPJ_OK;
}

void ej_cuda_graph_free(ej_cuda_dev *c, void *exec)
{
	if (exec)
		DEV_CALL(c, cuGraphExecDestroy((ej_CUgraphExec)exec));
}

void *ej_cuda_compute_stream(const ej_cuda_dev *c)
{
	return c->compute;
}

void *ej_cuda_comm_stream(const ej_cuda_dev *c)
{
	return c->comm;
}

/* ---- ordering with a caller's stream (lib/epjit.h) ----------------------- */

static ej_cuda_dev *ctx_gpu(const epj_ctx *ctx)
{
	return ctx && ctx->dev && ctx->dev->desc == &ej_desc_cuda
		   ? ctx->dev->self
		   : NULL;
}

/* `to` waits for what `from` holds now: an event recorded on `from` and
 * waited for on `to`, then destroyed (the driver keeps it until the wait
 * is over).  The device's context is made current first: the caller's
 * thread (a framework's autograd thread) may have had none. */
static epj_status join(epj_ctx *ctx, ej_cuda_dev *c, ej_CUstream from,
		       ej_CUstream to)
{
	EJ_CU(ctx, c->d, cuCtxSetCurrent(c->cu));
	ej_CUevent ev = NULL;
	EJ_CU(ctx, c->d, cuEventCreate(&ev, EJ_CU_EVENT_DISABLE_TIMING));
	ej_CUresult r = c->d->cuEventRecord(ev, from);
	const char *what = "cuEventRecord";
	if (r == EJ_CUDA_SUCCESS) {
		r = c->d->cuStreamWaitEvent(to, ev, 0);
		what = "cuStreamWaitEvent";
	}
	c->d->cuEventDestroy(ev);
	if (r != EJ_CUDA_SUCCESS)
		return ej_cuda_error(ctx, c->d, r, what, __FILE__, __LINE__);
	return EPJ_OK;
}

epj_status epj_ctx_wait_stream(epj_ctx *ctx, void *stream)
{
	ej_cuda_dev *c = ctx_gpu(ctx);
	return c ? join(ctx, c, (ej_CUstream)stream, c->compute) : EPJ_OK;
}

epj_status epj_stream_wait_ctx(epj_ctx *ctx, void *stream)
{
	ej_cuda_dev *c = ctx_gpu(ctx);
	return c ? join(ctx, c, c->compute, (ej_CUstream)stream) : EPJ_OK;
}

int epj_ctx_cuda_ordinal(const epj_ctx *ctx)
{
	const ej_cuda_dev *c = ctx_gpu(ctx);
	return c ? c->ordinal : -1;
}
