/* fake_cuda.c -- a stand-in for libcuda.so.1 that the cuda device's tests
 * load through $EPJIT_CUDA_DRIVER on machines without a GPU.  It implements
 * the Driver API entry points lib/device_cuda.c resolves, over host memory,
 * with the driver's rules where the device code relies on them:
 *
 *  - cuGetProcAddress_v2 resolves (name, version) as cudaTypedefs.h lists
 *    the prototypes (cuMemAlloc at 3020 is the _v2 form), refuses a version
 *    that selects a prototype epjit does not declare, and fails unknown
 *    names with CUDA_ERROR_NOT_FOUND;
 *  - "device" memory is malloc'ed; frees of unknown pointers are
 *    CUDA_ERROR_INVALID_VALUE; FAKE_CUDA_MEM_LIMIT (bytes) makes cuMemAlloc
 *    fail with CUDA_ERROR_OUT_OF_MEMORY above that many live bytes;
 *  - FAKE_CUDA_GUARD=1 (read at the first cuMemAlloc): "device" memory
 *    instead comes from one mmap'ed region that stays PROT_NONE except
 *    while a copy, a memset or a kernel runs inside the driver, so host
 *    code that dereferences a device pointer dies with SIGSEGV, as it
 *    would (or worse, silently would not) on a GPU;
 *  - cuModuleLoadData accepts an ELF image (a cubin) or PTX text and
 *    refuses anything else (CUDA_ERROR_INVALID_IMAGE); cuModuleGetFunction
 *    finds a kernel only if its name is a NUL-terminated string of the
 *    image (as a cubin's symbol table holds it);
 *  - a launch with more than 48 KiB of dynamic shared memory fails unless
 *    cuFuncSetAttribute raised that function's limit first;
 *  - launches between cuStreamBeginCapture and cuStreamEndCapture are
 *    recorded (kernel parameters copied, as the driver does) and replayed
 *    by cuGraphLaunch;
 *  - stream order: streams are distinct, and the stand-in keeps for each
 *    the position of its last operation and how far it is ordered after
 *    every other stream (cuStreamWaitEvent on an event recorded there,
 *    or a host synchronization: stream, event, context, cuMemFree).
 *    Everything runs when issued, so work that a GPU would run in the
 *    wrong order would still compute the right numbers here; instead,
 *    the stand-in NCCL (t/fake_nccl.c) reports each buffer its sends and
 *    receives touch on a stream (fake_cuda_stream_access), and a kernel
 *    launch (a parameter word pointing into the buffer), an async copy or
 *    a fill on another stream that is not ordered after that operation
 *    fails with CUDA_ERROR_ILLEGAL_STATE and a "stream order" line on
 *    stderr; so does an exchange whose send buffer was touched by a
 *    kernel or copy of another stream it is not ordered after.  Kernels
 *    that read the received rows before the compute stream waited for
 *    the exchange's completion event fail as they would compute garbage
 *    on a GPU.
 * A kernel "runs" through a hook the test installs (fake_cuda_set_hook):
 * the tests point it at cuda-sim running the same kernel's CUDA C, so
 * numbers computed through the cuda device's launch path are checked
 * against the CPU reference.  FAKE_CUDA_FAIL=<entry point> makes that call
 * fail with CUDA_ERROR_UNKNOWN; FAKE_CUDA_DEVICES=<n> sets the count,
 * FAKE_CUDA_SMS=<n> the SM count and FAKE_CUDA_OCC=<n> the resident blocks
 * per SM that the occupancy query answers; FAKE_CUDA_DRIVER_VERSION=<v>
 * the version cuDriverGetVersion reports (default 13000).
 *
 * From outside it looks like the real library: it exports the Driver API
 * only (cu*), plus the test hooks fake_cuda_set_hook (how kernels run) and
 * fake_cuda_device_access (for the stand-in cuBLASLt and NCCL), and keeps
 * its bookkeeping to itself, so a test that passes here asserts only what a
 * real driver would let it see (t/exports.sh checks the export list).
 *
 * Test code: built only for make check, never installed.
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "fake_cuda_exec.h"
#include "fake_kparam.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
	OK = 0,
	E_INVALID_VALUE = 1,
	E_OOM = 2,
	E_NOT_INIT = 3,
	E_NO_DEVICE = 100,
	E_INVALID_DEVICE = 101,
	E_INVALID_IMAGE = 200,
	E_INVALID_HANDLE = 400,
	E_ILLEGAL_STATE = 401,
	E_NOT_FOUND = 500,
	E_NOT_SUPPORTED = 801,
	E_CAPTURE = 900, /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
	E_UNKNOWN = 999,
};

#define MAX_ALLOCS 65536
#define MAX_FUNCS  1024
#define MAX_REC	   4096

typedef int (*fake_hook)(void *user, void *module, const char *kernel,
			 const unsigned *grid, const unsigned *block,
			 unsigned smem, void *args);

/* the stand-in's own bookkeeping (not exported: the tests read the
 * library's driver counters, as they would on a GPU) */
typedef struct fake_stats {
	long long launches, graph_launches, replayed, allocs, frees;
	long long live_bytes, peak_bytes;
	unsigned last_grid[3], last_block[3], last_smem;
	char last_kernel[128];
} fake_stats;

typedef struct func {
	void *module; /* the module handle it came from */
	char name[128];
	int max_dyn_smem;
	long kp; /* parameter bytes (stream order checks); 0: not known yet */

} func;

typedef struct rec {
	func *f;
	unsigned grid[3], block[3], smem;
	unsigned char *args;
	size_t n_args;
} rec;

static struct {
	bool init;
	struct {
		void *p;
		size_t n;
	} alloc[MAX_ALLOCS];
	func funcs[MAX_FUNCS];
	int n_funcs;
	fake_hook hook;
	size_t (*size)(void *user, void *module, const char *kernel);
	void *hook_user;
	fake_stats st;
	bool capturing;
	rec rec[MAX_REC];
	int n_rec;
} F;

static bool failing(const char *name)
{
	const char *f = getenv("FAKE_CUDA_FAIL");
	return f && !strcmp(f, name);
}
#define ENTER(name)                                                            \
	do {                                                                   \
		if (failing(name))                                             \
			return E_UNKNOWN;                                      \
	} while (0)
#define NEED_INIT()                                                            \
	do {                                                                   \
		if (!F.init)                                                   \
			return E_NOT_INIT;                                     \
	} while (0)

/* ---- the test's side ---------------------------------------------------- */

/* h runs a launched kernel (0: done, else the kernel faulted); size gives
 * the byte size of a kernel's one parameter (the real driver reads it from
 * the cubin), needed to copy parameters at capture time. */
typedef size_t (*fake_size_fn)(void *user, void *module, const char *kernel);
void fake_cuda_set_hook(fake_hook h, fake_size_fn size, void *user);
void fake_cuda_set_hook(fake_hook h, fake_size_fn size, void *user)
{
	F.hook = h;
	F.size = size;
	F.hook_user = user;
}

/* ---- errors ---------------------------------------------------------------
 */

CUresult cuGetErrorName(CUresult e, const char **s);
CUresult cuGetErrorName(CUresult e, const char **s)
{
	switch (e) {
	case OK:
		*s = "CUDA_SUCCESS";
		break;
	case E_INVALID_VALUE:
		*s = "CUDA_ERROR_INVALID_VALUE";
		break;
	case E_OOM:
		*s = "CUDA_ERROR_OUT_OF_MEMORY";
		break;
	case E_NOT_INIT:
		*s = "CUDA_ERROR_NOT_INITIALIZED";
		break;
	case E_NO_DEVICE:
		*s = "CUDA_ERROR_NO_DEVICE";
		break;
	case E_INVALID_DEVICE:
		*s = "CUDA_ERROR_INVALID_DEVICE";
		break;
	case E_INVALID_IMAGE:
		*s = "CUDA_ERROR_INVALID_IMAGE";
		break;
	case E_INVALID_HANDLE:
		*s = "CUDA_ERROR_INVALID_HANDLE";
		break;
	case E_ILLEGAL_STATE:
		*s = "CUDA_ERROR_ILLEGAL_STATE";
		break;
	case E_NOT_FOUND:
		*s = "CUDA_ERROR_NOT_FOUND";
		break;
	case E_NOT_SUPPORTED:
		*s = "CUDA_ERROR_NOT_SUPPORTED";
		break;
	case E_CAPTURE:
		*s = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
		break;
	case E_UNKNOWN:
		*s = "CUDA_ERROR_UNKNOWN";
		break;
	default:
		*s = NULL;
		return E_INVALID_VALUE;
	}
	return OK;
}

CUresult cuGetErrorString(CUresult e, const char **s);
CUresult cuGetErrorString(CUresult e, const char **s)
{
	switch (e) {
	case OK:
		*s = "no error";
		break;
	case E_INVALID_VALUE:
		*s = "invalid argument";
		break;
	case E_OOM:
		*s = "out of memory";
		break;
	case E_NOT_INIT:
		*s = "initialization error";
		break;
	case E_NO_DEVICE:
		*s = "no CUDA-capable device is detected";
		break;
	case E_INVALID_DEVICE:
		*s = "invalid device ordinal";
		break;
	case E_INVALID_IMAGE:
		*s = "device kernel image is invalid";
		break;
	case E_INVALID_HANDLE:
		*s = "invalid resource handle";
		break;
	case E_ILLEGAL_STATE:
		*s = "stream order violated: a buffer of an exchange on "
		     "another stream was touched before its event was "
		     "waited for";
		break;
	case E_NOT_FOUND:
		*s = "named symbol not found";
		break;
	case E_NOT_SUPPORTED:
		*s = "operation not supported";
		break;
	case E_CAPTURE:
		*s = "operation not permitted when stream is capturing";
		break;
	case E_UNKNOWN:
		*s = "unknown error";
		break;
	default:
		*s = NULL;
		return E_INVALID_VALUE;
	}
	return OK;
}

/* ---- init, devices, contexts ------------------------------------------- */

static int n_devices(void)
{
	const char *v = getenv("FAKE_CUDA_DEVICES");
	return v ? atoi(v) : 1;
}

static CUresult f_cuInit(unsigned flags)
{
	ENTER("cuInit");
	if (flags)
		return E_INVALID_VALUE;
	if (n_devices() < 1)
		return E_NO_DEVICE;
	F.init = true;
	return OK;
}

/* 13000, or FAKE_CUDA_DRIVER_VERSION (an older driver's refusal) */
CUresult cuDriverGetVersion(int *v);
CUresult cuDriverGetVersion(int *v)
{
	const char *e = getenv("FAKE_CUDA_DRIVER_VERSION");
	*v = e && *e ? atoi(e) : 13000;
	return OK;
}

static CUresult f_cuDeviceGetCount(int *n)
{
	NEED_INIT();
	*n = n_devices();
	return OK;
}

static CUresult f_cuDeviceGet(int *d, int ord)
{
	NEED_INIT();
	if (ord < 0 || ord >= n_devices())
		return E_INVALID_DEVICE;
	*d = ord;
	return OK;
}

static CUresult f_cuDeviceGetName(char *name, int len, int d)
{
	(void)d;
	snprintf(name, (size_t)len, "epjit fake GPU");
	return OK;
}

static CUresult f_cuDeviceGetAttribute(int *v, int attr, int d)
{
	(void)d;
	switch (attr) {
	case 1:
		*v = 1024;
		break; /* max threads per block */
	case 16:       /* SM count (FAKE_CUDA_SMS, default 132) */
		*v = getenv("FAKE_CUDA_SMS") ? atoi(getenv("FAKE_CUDA_SMS"))
					     : 132;
		break;
	case 75:
		*v = 9;
		break; /* cc major */
	case 76:
		*v = 0;
		break; /* cc minor */
	case 97:
		*v = 227 * 1024;
		break; /* smem opt-in */
	default:
		return E_INVALID_VALUE;
	}
	return OK;
}

static CUresult f_cuDeviceTotalMem(size_t *b, int d)
{
	(void)d;
	*b = (size_t)80 << 30;
	return OK;
}

static int the_ctx;
static CUresult f_cuDevicePrimaryCtxRetain(void **c, int d)
{
	NEED_INIT();
	(void)d;
	*c = &the_ctx;
	return OK;
}
static CUresult f_cuDevicePrimaryCtxRelease(int d)
{
	(void)d;
	return OK;
}
static CUresult f_cuCtxSetCurrent(void *c)
{
	return c == &the_ctx || !c ? OK : E_INVALID_HANDLE;
}
static void host_waited(int s);
static CUresult f_cuCtxSynchronize(void)
{
	host_waited(-1);
	return OK;
}

/* ---- memory ---------------------------------------------------------------
 */

/* The guarded region (FAKE_CUDA_GUARD=1): a bump allocator over reserved
 * address space; freed blocks give their pages back but are not reused. */
#define GUARD_RESERVE ((size_t)64 << 30)
static struct {
	int on; /* -1: not decided yet */
	char *base;
	size_t used; /* bytes handed out (page-rounded end below) */
	int open;    /* nesting of guard_open */
} G = { -1, NULL, 0, 0 };

/* FAKE_CUDA_COUNT_ONLY=1 (read at the first cuMemAlloc): "device" memory
 * is address space from the guarded region that is never made accessible;
 * copies into it and fills are dropped, copies out of it read zeros, and
 * launched kernels are recorded (parameters copied at capture) but not run.
 * The library runs unchanged; what it asks of the driver is counted by its
 * own counters, at any size, in seconds. */
static int count_only = -1;
static bool counting_only(void)
{
	if (count_only < 0) {
		const char *v = getenv("FAKE_CUDA_COUNT_ONLY");
		count_only = v && !strcmp(v, "1");
	}
	return count_only == 1;
}

static bool guard_on(void)
{
	if (G.on < 0) {
		const char *v = getenv("FAKE_CUDA_GUARD");
		G.on = (v && !strcmp(v, "1")) || counting_only();
		if (G.on) {
			void *p = mmap(
			    NULL, GUARD_RESERVE, PROT_NONE,
			    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
			if (p == MAP_FAILED)
				G.on = 0;
			else
				G.base = p;
		}
	}
	return G.on;
}

static size_t guard_span(void)
{
	return (G.used + 4095) & ~(size_t)4095;
}

/* Device memory readable and writable (inside a driver call) or not. */
static void guard_open(void)
{
	if (count_only == 1)
		return; /* never accessible */
	if (G.on == 1 && G.open++ == 0 && G.used)
		mprotect(G.base, guard_span(), PROT_READ | PROT_WRITE);
}

static void guard_close(void)
{
	if (count_only == 1)
		return;
	if (G.on == 1 && --G.open == 0 && G.used)
		mprotect(G.base, guard_span(), PROT_NONE);
}

/* For the stand-in libraries that touch "device" memory as a driver-side
 * library would (t/fake_cublaslt.c's GEMMs, t/fake_nccl.c's collectives):
 * open (1) or close (0) the guard around their work. */
void fake_cuda_device_access(int open);
void fake_cuda_device_access(int open)
{
	if (open)
		guard_open();
	else
		guard_close();
}

static void *guard_alloc(size_t n)
{
	size_t at = (G.used + 255) & ~(size_t)255;
	size_t need = (n + 255) & ~(size_t)255;
	if (at + need > GUARD_RESERVE)
		return NULL;
	G.used = at + need;
	if (G.open && count_only != 1)
		mprotect(G.base, guard_span(), PROT_READ | PROT_WRITE);
	return G.base + at;
}

static void guard_release(void *p, size_t n)
{
	/* whole pages inside the block go back to the system */
	uintptr_t lo = ((uintptr_t)p + 4095) & ~(uintptr_t)4095;
	uintptr_t hi = ((uintptr_t)p + n) & ~(uintptr_t)4095;
	if (hi > lo)
		madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

static int find_alloc(const void *p)
{
	for (int i = 0; i < MAX_ALLOCS; i++)
		if (F.alloc[i].p == p)
			return i;
	return -1;
}

static CUresult f_cuMemAlloc(CUdeviceptr *d, size_t n)
{
	ENTER("cuMemAlloc");
	NEED_INIT();
	if (!n)
		return E_INVALID_VALUE;
	const char *lim = getenv("FAKE_CUDA_MEM_LIMIT");
	if (lim && F.st.live_bytes + (long long)n > atoll(lim))
		return E_OOM;
	int i = find_alloc(NULL);
	void *p = i < 0	       ? NULL
		  : guard_on() ? guard_alloc(n)
			       : aligned_alloc(256, (n + 255) & ~(size_t)255);
	if (!p)
		return E_OOM;
	F.alloc[i].p = p;
	F.alloc[i].n = n;
	F.st.allocs++;
	F.st.live_bytes += (long long)n;
	if (F.st.live_bytes > F.st.peak_bytes)
		F.st.peak_bytes = F.st.live_bytes;
	*d = (CUdeviceptr)(uintptr_t)p;
	return OK;
}

static void host_waited(int s);
static CUresult f_cuMemFree(CUdeviceptr d)
{
	int i = find_alloc((void *)(uintptr_t)d);
	if (!d || i < 0)
		return E_INVALID_VALUE;
	host_waited(-1); /* cuMemFree synchronizes the device */
	if (G.on == 1)
		guard_release(F.alloc[i].p, F.alloc[i].n);
	else
		free(F.alloc[i].p);
	F.st.live_bytes -= (long long)F.alloc[i].n;
	F.alloc[i].p = NULL;
	F.st.frees++;
	return OK;
}

static CUresult f_cuMemGetInfo(size_t *fr, size_t *total)
{
	*total = (size_t)80 << 30;
	*fr = *total - (size_t)F.st.live_bytes;
	return OK;
}

static CUresult f_cuMemHostAlloc(void **p, size_t n, unsigned flags)
{
	(void)flags;
	*p = malloc(n);
	return *p ? OK : E_OOM;
}
static CUresult f_cuMemFreeHost(void *p)
{
	free(p);
	return OK;
}

static bool in_region(CUdeviceptr p)
{
	return G.base && (uintptr_t)p >= (uintptr_t)G.base &&
	       (uintptr_t)p - (uintptr_t)G.base < GUARD_RESERVE;
}

/* A copy as the driver does it (count-only: as described above). */
static void copy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	if (count_only == 1) {
		if (!in_region(dst) && in_region(src))
			memset((void *)(uintptr_t)dst, 0, n);
		else if (!in_region(dst))
			memmove((void *)(uintptr_t)dst,
				(const void *)(uintptr_t)src, n);
		return;
	}
	guard_open();
	memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
	guard_close();
}

static CUresult f_cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	ENTER("cuMemcpy");
	copy(dst, src, n);
	return OK;
}
static int sid(void *s);
static CUresult order_copy(int t, uintptr_t dst, uintptr_t src,
			   const char *who);
static CUresult f_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n,
				void *s)
{
	ENTER("cuMemcpyAsync");
	if (F.capturing)
		return E_CAPTURE; /* not recorded by this fake */
	CUresult r =
	    order_copy(sid(s), (uintptr_t)dst, (uintptr_t)src, "cuMemcpyAsync");
	if (r != OK)
		return r;
	copy(dst, src, n);
	return OK;
}
static CUresult f_cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n,
				  void *s)
{
	CUresult r = order_copy(sid(s), (uintptr_t)dst, 0, "cuMemsetD8Async");
	if (r != OK)
		return r;
	if (count_only == 1 && in_region(dst))
		return OK;
	guard_open();
	memset((void *)(uintptr_t)dst, v, n);
	guard_close();
	return OK;
}

/* ---- stream order ---------------------------------------------------------
 */

/* Stream 0 is the legacy default stream (a NULL handle); created streams
 * are 1..MAX_STREAMS-1.  pos[s]: operations issued on s; seen[t][s]: t is
 * ordered after s's first seen[t][s] operations.  rng: the buffers the
 * stand-in NCCL's operations touched (a ring; the oldest is forgotten);
 * touch: the pointers that launches and copies passed, most recent last
 * (a ring). */
#define MAX_STREAMS 64
#define MAX_RANGES  1024
#define MAX_TOUCH   4096
typedef struct fstream {
	int id;
} fstream;
typedef struct fevent {
	double t;		     /* cuEventRecord's time (elapsed time) */
	int s;			     /* recorded on; -1: never recorded */
	long long seen[MAX_STREAMS]; /* s's order at the record */
} fevent;
static struct {
	fstream streams[MAX_STREAMS];
	int next; /* the slot the next stream takes (round robin) */
	long long pos[MAX_STREAMS];
	long long seen[MAX_STREAMS][MAX_STREAMS];
	struct orng {
		uintptr_t lo, hi;
		int s;
		long long pos;
		char what[48];
	} rng[MAX_RANGES];
	int n_rng, at_rng;
	struct otouch {
		uintptr_t p;
		int s;
		long long pos;
	} touch[MAX_TOUCH];
	int n_touch, at_touch;
} O;

static int sid(void *s)
{
	if (!s)
		return 0;
	fstream *f = s;
	return f >= O.streams && f < O.streams + MAX_STREAMS ? f->id : 0;
}

/* t is ordered after s's first `pos` operations */
static bool ordered(int t, int s, long long pos)
{
	return t == s || O.seen[t][s] >= pos;
}

/* The host waited for stream s's operations so far (or every stream's,
 * s < 0): everything issued from now on comes after them. */
static void host_waited(int s)
{
	for (int u = 0; u < MAX_STREAMS; u++) {
		if (s >= 0 && u != s)
			continue;
		for (int t = 0; t < MAX_STREAMS; t++)
			if (O.seen[t][u] < O.pos[u])
				O.seen[t][u] = O.pos[u];
	}
}

static CUresult order_fail(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
static CUresult order_fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("fake_cuda: stream order: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	return E_ILLEGAL_STATE;
}

/* An operation on stream t touching the word p (a pointer, maybe):
 * refused when p lies in a buffer an exchange of another stream touched
 * and t is not ordered after that exchange. */
static CUresult order_check(int t, uintptr_t p, const char *who)
{
	for (int i = 0; i < O.n_rng; i++) {
		const struct orng *r = &O.rng[i];
		if (p >= r->lo && p < r->hi && !ordered(t, r->s, r->pos))
			return order_fail(
			    "%s on stream %d touches %#lx, in the buffer "
			    "[%#lx, %#lx) of %s on stream %d (its operation "
			    "%lld), and stream %d has waited for none of its "
			    "events since",
			    who, t, (unsigned long)p, (unsigned long)r->lo,
			    (unsigned long)r->hi, r->what, r->s, r->pos, t);
	}
	return OK;
}

static void order_touch(int t, uintptr_t p)
{
	if (p < 4096)
		return; /* not a pointer */
	O.touch[O.at_touch] = (struct otouch){ p, t, O.pos[t] };
	O.at_touch = (O.at_touch + 1) % MAX_TOUCH;
	if (O.n_touch < MAX_TOUCH)
		O.n_touch++;
}

/* A launch's parameter words (8-byte aligned: where pointers are). */
static CUresult order_launch(int t, const func *f, const void *args, size_t n)
{
	O.pos[t]++;
	for (size_t off = 0; args && off + 8 <= n; off += 8) {
		uintptr_t w;
		memcpy(&w, (const char *)args + off, sizeof w);
		CUresult r = order_check(t, w, f->name);
		if (r != OK)
			return r;
		order_touch(t, w);
	}
	return OK;
}

static CUresult order_copy(int t, uintptr_t dst, uintptr_t src, const char *who)
{
	O.pos[t]++;
	CUresult r = order_check(t, dst, who);
	if (r == OK && src)
		r = order_check(t, src, who);
	order_touch(t, dst);
	if (src)
		order_touch(t, src);
	return r;
}

/* The allocation holding p: [*lo, *hi); false when none does. */
static bool alloc_of(uintptr_t p, uintptr_t *lo, uintptr_t *hi)
{
	for (int i = 0; i < MAX_ALLOCS; i++) {
		uintptr_t a = (uintptr_t)F.alloc[i].p;
		if (a && p >= a && p - a < F.alloc[i].n) {
			*lo = a;
			*hi = a + F.alloc[i].n;
			return true;
		}
	}
	return false;
}

/* For the stand-in NCCL: its operation `what` on stream `stream` reads
 * (write 0) or writes [p, p + n).  0 when the order allows it, else -1
 * with a "stream order" line on stderr: the buffer (or its allocation)
 * was touched by an operation of another stream that this one is not
 * ordered after.  The buffer is then remembered as the exchange's:
 * other streams must wait for an event recorded after it before they
 * touch it. */
int fake_cuda_stream_access(void *stream, const void *p, size_t n, int write,
			    const char *what);
int fake_cuda_stream_access(void *stream, const void *p, size_t n, int write,
			    const char *what)
{
	int t = sid(stream);
	uintptr_t lo = (uintptr_t)p, hi = lo + n;
	if (!n)
		return 0;
	O.pos[t]++;
	for (int i = 0; i < O.n_rng; i++) { /* overlapping exchanges */
		const struct orng *r = &O.rng[i];
		if (lo < r->hi && r->lo < hi && !ordered(t, r->s, r->pos)) {
			order_fail("%s on stream %d touches [%#lx, %#lx), "
				   "which %s on stream %d (its operation "
				   "%lld) touches, and stream %d has not "
				   "waited for it",
				   what, t, (unsigned long)lo,
				   (unsigned long)hi, r->what, r->s, r->pos, t);
			return -1;
		}
	}
	uintptr_t a0, a1;
	if (alloc_of(lo, &a0, &a1)) {
		for (int i = 0; i < O.n_touch; i++) {
			const struct otouch *k = &O.touch[i];
			if (k->p >= a0 && k->p < a1 &&
			    !ordered(t, k->s, k->pos)) {
				order_fail("%s on stream %d %s [%#lx, %#lx), "
					   "touched by stream %d (its "
					   "operation %lld), which stream %d "
					   "has not waited for",
					   what, t, write ? "writes" : "reads",
					   (unsigned long)lo, (unsigned long)hi,
					   k->s, k->pos, t);
				return -1;
			}
		}
	}
	struct orng *r = &O.rng[O.at_rng];
	*r = (struct orng){ .lo = lo, .hi = hi, .s = t, .pos = O.pos[t] };
	snprintf(r->what, sizeof r->what, "%s", what);
	O.at_rng = (O.at_rng + 1) % MAX_RANGES;
	if (O.n_rng < MAX_RANGES)
		O.n_rng++;
	return 0;
}

/* ---- modules and launches -------------------------------------------------
 */

typedef struct module {
	unsigned char *image;
	size_t size;
	const char *src; /* its CUDA C, where fake_nvrtc.c knows it */
	void *sim;	 /* that source built for cuda-sim (at the first
			    launch without a hook) */
} module;

/* Size of an ELF64 image: the end of its section header table (a cubin
 * puts it last) or of its program headers, whichever is further. */
static size_t elf_size(const unsigned char *p)
{
	uint64_t shoff, phoff;
	uint16_t shentsize, shnum, phentsize, phnum;
	memcpy(&phoff, p + 32, 8);
	memcpy(&shoff, p + 40, 8);
	memcpy(&phentsize, p + 54, 2);
	memcpy(&phnum, p + 56, 2);
	memcpy(&shentsize, p + 58, 2);
	memcpy(&shnum, p + 60, 2);
	uint64_t a = shoff + (uint64_t)shentsize * shnum;
	uint64_t b = phoff + (uint64_t)phentsize * phnum;
	return (size_t)(a > b ? a : b);
}

static CUresult f_cuModuleLoadData(void **m, const void *image)
{
	ENTER("cuModuleLoadData");
	NEED_INIT();
	const unsigned char *p = image;
	size_t n;
	if (!p)
		return E_INVALID_VALUE;
	if (!memcmp(p,
		    "\x7f"
		    "ELF",
		    4) &&
	    p[4] == 2)
		n = elf_size(p);
	else if (strstr((const char *)p, ".version") &&
		 strstr((const char *)p, ".target"))
		n = strlen((const char *)p) + 1;
	else
		return E_INVALID_IMAGE;
	module *mod = calloc(1, sizeof *mod);
	mod->image = malloc(n);
	memcpy(mod->image, p, n);
	mod->size = n;
	mod->src = fake_exec_source(mod->image, n);
	*m = mod;
	return OK;
}

static CUresult f_cuModuleUnload(void *m)
{
	module *mod = m;
	if (!mod)
		return E_INVALID_HANDLE;
	fake_exec_unload(mod->sim);
	free(mod->image);
	free(mod);
	return OK;
}

static CUresult f_cuModuleGetFunction(void **f, void *m, const char *name)
{
	module *mod = m;
	size_t k = strlen(name) + 1;
	bool found = false;
	for (size_t i = 0; !found && i + k <= mod->size; i++)
		found = (i == 0 || mod->image[i - 1] == 0) &&
			!memcmp(mod->image + i, name, k);
	if (!found)
		return E_NOT_FOUND;
	for (int i = 0; i < F.n_funcs; i++) {
		if (!strcmp(F.funcs[i].name, name) && F.funcs[i].module == m) {
			*f = &F.funcs[i];
			return OK;
		}
	}
	if (F.n_funcs == MAX_FUNCS)
		return E_UNKNOWN;
	func *fn = &F.funcs[F.n_funcs++];
	fn->module = m;
	snprintf(fn->name, sizeof fn->name, "%s", name);
	*f = fn;
	return OK;
}

static CUresult f_cuFuncSetAttribute(void *f, int attr, int v)
{
	if (attr != 8 || v < 0 || v > 227 * 1024)
		return E_INVALID_VALUE;
	((func *)f)->max_dyn_smem = v;
	return OK;
}

static CUresult f_cuOccupancyMaxActiveBlocksPerMultiprocessor(int *b, void *f,
							      int bs, size_t sm)
{
	(void)f;
	(void)sm;
	/* 2048 resident threads per SM, or FAKE_CUDA_OCC blocks */
	*b = getenv("FAKE_CUDA_OCC") ? atoi(getenv("FAKE_CUDA_OCC"))
	     : bs > 0		     ? 2048 / bs
				     : 0;
	return OK;
}

static CUresult run(func *f, const unsigned *g, const unsigned *b,
		    unsigned smem, void *args)
{
	F.st.launches++;
	memcpy(F.st.last_grid, g, sizeof F.st.last_grid);
	memcpy(F.st.last_block, b, sizeof F.st.last_block);
	F.st.last_smem = smem;
	snprintf(F.st.last_kernel, sizeof F.st.last_kernel, "%s", f->name);
	guard_open();
	int rc = 0;
	if (count_only == 1) {
		/* nothing runs */
	} else if (F.hook) {
		rc = F.hook(F.hook_user, f->module, f->name, g, b, smem, args);
	} else if (fake_exec_available()) {
		/* a program that knows nothing of the stand-in: the kernel
		 * runs on cuda-sim from the source NVRTC saw */
		module *mod = f->module;
		long kp = fake_kparam_size(mod->image, mod->size, f->name);
		if (!mod->src || kp < 0) {
			fprintf(stderr, "fake_cuda: %s: %s; cannot run it\n",
				f->name,
				!mod->src
				    ? "its module's source is unknown (an "
				      "image NVRTC did not make in this "
				      "process)"
				    : "unknown parameter size");
			rc = 1;
		} else {
			rc = fake_exec_launch(&mod->sim, mod->src, mod->image,
					      mod->size, f->name, g, b, smem,
					      args, (size_t)kp);
		}
	}
	guard_close();
	if (rc != 0)
		return E_UNKNOWN; /* the kernel "faulted" */
	return OK;
}

/* A kernel's parameter bytes: from its image, else the test's callback
 * (0: unknown). */
static size_t args_size(func *f)
{
	if (!f->kp) {
		const module *mod = f->module;
		long kp = fake_kparam_size(mod->image, mod->size, f->name);
		f->kp = kp > 0 ? kp : -1;
	}
	if (f->kp > 0)
		return (size_t)f->kp;
	return F.size ? F.size(F.hook_user, f->module, f->name) : 0;
}

static CUresult f_cuLaunchKernel(void *fp, unsigned gx, unsigned gy,
				 unsigned gz, unsigned bx, unsigned by,
				 unsigned bz, unsigned smem, void *s,
				 void **params, void **extra)
{
	ENTER("cuLaunchKernel");
	func *f = fp;
	if (!f || extra || !params)
		return E_INVALID_VALUE;
	if (!gx || !gy || !gz || !bx || !by || !bz ||
	    (unsigned long long)bx * by * bz > 1024)
		return E_INVALID_VALUE;
	if (smem > 48 * 1024 && (int)smem > f->max_dyn_smem)
		return E_INVALID_VALUE;
	unsigned g[3] = { gx, gy, gz }, b[3] = { bx, by, bz };
	if (F.capturing) {
		/* the parameter bytes, from the image as the driver reads
		 * them (the test's size callback, where set, must agree) */
		const module *mod = f->module;
		long kp = fake_kparam_size(mod->image, mod->size, f->name);
		size_t n = kp > 0 ? (size_t)kp : 0;
		if (F.size && n &&
		    F.size(F.hook_user, f->module, f->name) != n) {
			fprintf(stderr,
				"fake_cuda: %s: the image says %zu parameter "
				"bytes, the test %zu\n",
				f->name, n,
				F.size(F.hook_user, f->module, f->name));
			return E_INVALID_VALUE;
		}
		if (!n && F.size)
			n = F.size(F.hook_user, f->module, f->name);
		if (F.n_rec == MAX_REC || !n)
			return E_CAPTURE;
		rec *r = &F.rec[F.n_rec++];
		r->f = f;
		memcpy(r->grid, g, sizeof g);
		memcpy(r->block, b, sizeof b);
		r->smem = smem;
		r->args = malloc(n);
		r->n_args = n;
		memcpy(r->args, params[0], n);
		return OK;
	}
	CUresult r = order_launch(sid(s), f, params[0], args_size(f));
	return r != OK ? r : run(f, g, b, smem, params[0]);
}

/* ---- streams, events, graphs -------------------------------------------- */

static CUresult f_cuStreamCreate(void **s, unsigned flags)
{
	(void)flags;
	/* slots are taken in turn (a test process that opens the device
	 * again and again never destroys its old streams): a stream made
	 * MAX_STREAMS - 1 creations ago is forgotten */
	int i = O.next % (MAX_STREAMS - 1) + 1;
	O.next = i;
	O.streams[i].id = i;
	O.pos[i] = 0;
	for (int u = 0; u < MAX_STREAMS; u++)
		O.seen[i][u] = O.seen[u][i] = 0;
	for (int k = 0; k < O.n_rng; k++)
		if (O.rng[k].s == i)
			O.rng[k].hi = O.rng[k].lo; /* the old stream's */
	for (int k = 0; k < O.n_touch; k++)
		if (O.touch[k].s == i)
			O.touch[k].p = 0;
	*s = &O.streams[i];
	return OK;
}
static CUresult f_cuStreamDestroy(void *s)
{
	return sid(s) ? OK : E_INVALID_HANDLE;
}
static CUresult f_cuStreamSynchronize(void *s)
{
	if (F.capturing)
		return E_CAPTURE;
	host_waited(sid(s));
	return OK;
}
static CUresult f_cuStreamWaitEvent(void *s, void *e, unsigned fl)
{
	(void)fl;
	const fevent *ev = e;
	int t = sid(s);
	if (!ev || ev->s < 0)
		return OK; /* never recorded: nothing to wait for */
	for (int u = 0; u < MAX_STREAMS; u++)
		if (O.seen[t][u] < ev->seen[u])
			O.seen[t][u] = ev->seen[u];
	return OK;
}

static CUresult f_cuEventCreate(void **e, unsigned flags)
{
	(void)flags;
	fevent *ev = calloc(1, sizeof *ev);
	if (!ev)
		return E_OOM;
	ev->s = -1;
	*e = ev;
	return OK;
}
static CUresult f_cuEventDestroy(void *e)
{
	free(e);
	return OK;
}
static CUresult f_cuEventRecord(void *e, void *s)
{
	fevent *ev = e;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	ev->t = (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
	/* what waiting for it orders after: s's operations so far, and what
	 * s was ordered after itself */
	ev->s = sid(s);
	memcpy(ev->seen, O.seen[ev->s], sizeof ev->seen);
	ev->seen[ev->s] = O.pos[ev->s];
	return OK;
}
static CUresult f_cuEventSynchronize(void *e)
{
	const fevent *ev = e;
	for (int u = 0; ev && ev->s >= 0 && u < MAX_STREAMS; u++)
		for (int t = 0; t < MAX_STREAMS; t++)
			if (O.seen[t][u] < ev->seen[u])
				O.seen[t][u] = ev->seen[u];
	return OK;
}
static CUresult f_cuEventElapsedTime(float *ms, void *a, void *b)
{
	*ms = (float)(((fevent *)b)->t - ((fevent *)a)->t);
	return OK;
}

static int a_graph;
static CUresult f_cuStreamBeginCapture(void *s, int mode)
{
	(void)s;
	if (F.capturing || mode < 0 || mode > 2)
		return E_INVALID_VALUE;
	F.capturing = true;
	F.n_rec = 0;
	return OK;
}
static CUresult f_cuStreamEndCapture(void *s, void **g)
{
	(void)s;
	if (!F.capturing)
		return E_INVALID_VALUE;
	F.capturing = false;
	*g = &a_graph;
	return OK;
}

typedef struct gexec {
	rec *r;
	int n;
} gexec;

static CUresult f_cuGraphInstantiateWithFlags(void **x, void *g,
					      unsigned long long fl)
{
	(void)fl;
	if (g != &a_graph)
		return E_INVALID_VALUE;
	gexec *e = calloc(1, sizeof *e);
	e->r = calloc((size_t)F.n_rec + 1, sizeof *e->r);
	memcpy(e->r, F.rec, sizeof *e->r * (size_t)F.n_rec);
	e->n = F.n_rec;
	F.n_rec = 0;
	*x = e;
	return OK;
}
static CUresult f_cuGraphLaunch(void *x, void *s)
{
	gexec *e = x;
	F.st.graph_launches++;
	for (int i = 0; i < e->n; i++) {
		CUresult r = order_launch(sid(s), e->r[i].f, e->r[i].args,
					  e->r[i].n_args);
		if (r == OK)
			r = run(e->r[i].f, e->r[i].grid, e->r[i].block,
				e->r[i].smem, e->r[i].args);
		if (r != OK)
			return r;
		F.st.replayed++;
	}
	return OK;
}
static CUresult f_cuGraphExecDestroy(void *x)
{
	gexec *e = x;
	for (int i = 0; e && i < e->n; i++)
		free(e->r[i].args);
	if (e)
		free(e->r);
	free(e);
	return OK;
}
static CUresult f_cuGraphDestroy(void *g)
{
	return g == &a_graph ? OK : E_INVALID_VALUE;
}

/* ---- cuGetProcAddress ------------------------------------------------------
 */

static CUresult f_cuDriverGetVersion(int *v)
{
	return cuDriverGetVersion(v);
}

/* The entry points by (name, version), as cudaTypedefs.h lists them
 * (PFN_<name>_v<version>): a request at version v gets the newest
 * prototype introduced at or before v, and nothing below the first.  The
 * prototypes this stand-in implements are the ones epjit declares
 * (lib/cuda_driver.h); a request that selects another one (fn NULL here:
 * cuCtxSynchronize at 13000 takes a context, cuGraphInstantiate's
 * prototypes take an error node and a log, cuMemAlloc at 2000 a 32-bit
 * size) is refused with CUDA_ERROR_NOT_SUPPORTED and a line on stderr, where
 * the real driver would hand back a function that a call through the
 * declared prototype corrupts. */
#define ENTRY(n, v)                                                            \
	{                                                                      \
#n, v, (void *)f_##n                                           \
	}
#define OTHER(n, v)                                                            \
	{                                                                      \
#n, v, NULL                                                    \
	}
static const struct {
	const char *name;
	int since;
	void *fn; /* NULL: a prototype epjit does not declare */
} entries[] = {
	ENTRY(cuInit, 2000),
	ENTRY(cuDriverGetVersion, 2020),
	ENTRY(cuDeviceGetCount, 2000),
	ENTRY(cuDeviceGet, 2000),
	ENTRY(cuDeviceGetName, 2000),
	ENTRY(cuDeviceGetAttribute, 2000),
	OTHER(cuDeviceTotalMem, 2000),
	ENTRY(cuDeviceTotalMem, 3020),
	ENTRY(cuDevicePrimaryCtxRetain, 7000),
	OTHER(cuDevicePrimaryCtxRelease, 7000),
	ENTRY(cuDevicePrimaryCtxRelease, 11000),
	ENTRY(cuCtxSetCurrent, 4000),
	ENTRY(cuCtxSynchronize, 2000),
	OTHER(cuCtxSynchronize, 13000),
	OTHER(cuMemAlloc, 2000),
	ENTRY(cuMemAlloc, 3020),
	OTHER(cuMemFree, 2000),
	ENTRY(cuMemFree, 3020),
	OTHER(cuMemGetInfo, 2000),
	ENTRY(cuMemGetInfo, 3020),
	ENTRY(cuMemHostAlloc, 2020),
	ENTRY(cuMemFreeHost, 2000),
	ENTRY(cuMemcpy, 4000),
	ENTRY(cuMemcpyAsync, 4000),
	ENTRY(cuMemsetD8Async, 3020),
	ENTRY(cuModuleLoadData, 2000),
	ENTRY(cuModuleUnload, 2000),
	ENTRY(cuModuleGetFunction, 2000),
	ENTRY(cuFuncSetAttribute, 9000),
	ENTRY(cuOccupancyMaxActiveBlocksPerMultiprocessor, 6050),
	ENTRY(cuLaunchKernel, 4000),
	ENTRY(cuStreamCreate, 2000),
	OTHER(cuStreamDestroy, 2000),
	ENTRY(cuStreamDestroy, 4000),
	ENTRY(cuStreamSynchronize, 2000),
	ENTRY(cuStreamWaitEvent, 3020),
	ENTRY(cuEventCreate, 2000),
	OTHER(cuEventDestroy, 2000),
	ENTRY(cuEventDestroy, 4000),
	ENTRY(cuEventRecord, 2000),
	ENTRY(cuEventSynchronize, 2000),
	ENTRY(cuEventElapsedTime, 2000),
	ENTRY(cuEventElapsedTime, 12080),
	OTHER(cuStreamBeginCapture, 10000),
	ENTRY(cuStreamBeginCapture, 10010),
	ENTRY(cuStreamEndCapture, 10000),
	OTHER(cuGraphInstantiate, 10000),
	OTHER(cuGraphInstantiate, 11000),
	ENTRY(cuGraphInstantiateWithFlags, 11040),
	ENTRY(cuGraphLaunch, 10000),
	ENTRY(cuGraphExecDestroy, 10000),
	ENTRY(cuGraphDestroy, 10000),
};

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version,
			     unsigned long long flags, int *status);
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version,
			     unsigned long long flags, int *status)
{
	*pfn = NULL;
	if (status)
		*status = 0;
	if (flags || version < 1000)
		return E_INVALID_VALUE;
	if (version > 13000) /* newer than this "driver" */
		return E_NOT_FOUND;
	int best = -1;
	bool known = false;
	for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
		if (strcmp(entries[i].name, sym) != 0)
			continue;
		known = true;
		if (entries[i].since <= version &&
		    (best < 0 || entries[i].since > entries[best].since))
			best = (int)i;
	}
	if (best >= 0 && entries[best].fn) {
		*pfn = entries[best].fn;
		return OK;
	}
	if (best >= 0) {
		fprintf(stderr,
			"fake_cuda: cuGetProcAddress(\"%s\", %d) selects the "
			"prototype of version %d, which epjit does not "
			"declare: refused\n",
			sym, version, entries[best].since);
		return E_NOT_SUPPORTED;
	}
	if (status) /* unknown, or not yet at that version */
		*status =
		    known ? 2 : 1; /* ..._VERSION_NOT_SUFFICIENT / _NOT_FOUND */
	return E_NOT_FOUND;
}
