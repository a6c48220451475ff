/* cuda_driver.h -- the CUDA Driver API as epjit uses it: loaded at run time
 * with dlopen (libcuda.so.1, or $EPJIT_CUDA_DRIVER), every entry point found
 * through cuGetProcAddress with an explicit API version, every call checked.
 *
 * The library never links against libcuda and never includes cuda.h: the
 * handful of types and constants used here are declared below with the
 * values of the Driver API's ABI (cuda.h, CUDA 12/13), so the same build runs
 * where no driver is installed and reports "no CUDA driver" cleanly.
 *
 * Invariants
 *  - One driver table per process (ej_cuda_driver), loaded once under a
 *    lock; a failed load is remembered with its message and never retried.
 *  - EJ_CU(ctx, call) runs a driver call; a failure returns EPJ_ERR_BACKEND
 *    from the enclosing function with the call text, file:line, the driver's
 *    cuGetErrorName and cuGetErrorString in ctx (EJ_CU_TRY stores the status
 *    instead of returning).
 */
#ifndef EPJIT_CUDA_DRIVER_H
#define EPJIT_CUDA_DRIVER_H

#include "core_impl.h"

#include <stddef.h>
#include <stdint.h>

/* ---- the ABI subset (values as in cuda.h) --------------------------------
 */
typedef int ej_CUresult; /* CUDA_SUCCESS = 0 */
typedef int ej_CUdevice;
typedef unsigned long long ej_CUdeviceptr;
typedef struct ej_CUctx_st *ej_CUcontext;
typedef struct ej_CUmod_st *ej_CUmodule;
typedef struct ej_CUfunc_st *ej_CUfunction;
typedef struct ej_CUstream_st *ej_CUstream;
typedef struct ej_CUevent_st *ej_CUevent;
typedef struct ej_CUgraph_st *ej_CUgraph;
typedef struct ej_CUgraphExec_st *ej_CUgraphExec;

#define EJ_CUDA_SUCCESS			    0
#define EJ_CUDA_ERROR_OUT_OF_MEMORY	    2
#define EJ_CU_DEVICE_ATTR_MAX_THREADS_BLOCK 1
#define EJ_CU_DEVICE_ATTR_SMEM_OPTIN	    97 /* max shared per block, opt-in */
#define EJ_CU_DEVICE_ATTR_SM_COUNT	    16
#define EJ_CU_DEVICE_ATTR_CC_MAJOR	    75
#define EJ_CU_DEVICE_ATTR_CC_MINOR	    76
#define EJ_CU_FUNC_ATTR_MAX_DYN_SMEM	    8
#define EJ_CU_STREAM_NON_BLOCKING	    1
#define EJ_CU_EVENT_DEFAULT		    0
#define EJ_CU_EVENT_DISABLE_TIMING	    2
#define EJ_CU_CAPTURE_MODE_THREAD_LOCAL	    1
#define EJ_CU_MEMHOSTALLOC_PORTABLE	    1

/* The oldest driver epjit loads: the CUDA 13 toolkit's NVRTC output,
 * cuBLASLt and NCCL need an R580 or newer driver (API version 13000). */
#define EJ_CUDA_MIN_DRIVER 13000

/* Dynamic shared memory above this needs the opt-in function attribute. */
#define EJ_CUDA_SMEM_DEFAULT_MAX (48 * 1024)

/* The entry points, each with the API version of the prototype declared
 * here, as cudaTypedefs.h names it (PFN_<name>_v<version>), and requested
 * at exactly that version: cuGetProcAddress returns the implementation of
 * the newest prototype at or below the version asked for, so asking at the
 * driver's own version would hand back another signature where one changed
 * (cuCtxSynchronize takes a context from 13000; the 3-argument
 * cuGraphInstantiate is cuGraphInstantiateWithFlags, 11040; cuMemAlloc at
 * 2000 takes a 32-bit size).  X(name, version, args). */
#define EJ_CUDA_ENTRY_POINTS(X)                                                \
	X(cuInit, 2000, (unsigned flags))                                      \
	X(cuDriverGetVersion, 2020, (int *version))                            \
	X(cuDeviceGetCount, 2000, (int *count))                                \
	X(cuDeviceGet, 2000, (ej_CUdevice * dev, int ordinal))                 \
	X(cuDeviceGetName, 2000, (char *name, int len, ej_CUdevice dev))       \
	X(cuDeviceGetAttribute, 2000,                                          \
	  (int *value, int attrib, ej_CUdevice dev))                           \
	X(cuDeviceTotalMem, 3020, (size_t * bytes, ej_CUdevice dev))           \
	X(cuDevicePrimaryCtxRetain, 7000,                                      \
	  (ej_CUcontext * ctx, ej_CUdevice dev))                               \
	X(cuDevicePrimaryCtxRelease, 11000, (ej_CUdevice dev))                 \
	X(cuCtxSetCurrent, 4000, (ej_CUcontext ctx))                           \
	X(cuCtxSynchronize, 2000, (void))                                      \
	X(cuMemAlloc, 3020, (ej_CUdeviceptr * dptr, size_t bytes))             \
	X(cuMemFree, 3020, (ej_CUdeviceptr dptr))                              \
	X(cuMemGetInfo, 3020, (size_t * free_bytes, size_t * total))           \
	X(cuMemHostAlloc, 2020, (void **p, size_t bytes, unsigned flags))      \
	X(cuMemFreeHost, 2000, (void *p))                                      \
	X(cuMemcpy, 4000,                                                      \
	  (ej_CUdeviceptr dst, ej_CUdeviceptr src, size_t bytes))              \
	X(cuMemcpyAsync, 4000,                                                 \
	  (ej_CUdeviceptr dst, ej_CUdeviceptr src, size_t bytes,               \
	   ej_CUstream stream))                                                \
	X(cuMemsetD8Async, 3020,                                               \
	  (ej_CUdeviceptr dst, unsigned char value, size_t n,                  \
	   ej_CUstream stream))                                                \
	X(cuModuleLoadData, 2000, (ej_CUmodule * mod, const void *image))      \
	X(cuModuleUnload, 2000, (ej_CUmodule mod))                             \
	X(cuModuleGetFunction, 2000,                                           \
	  (ej_CUfunction * fn, ej_CUmodule mod, const char *name))             \
	X(cuFuncSetAttribute, 9000, (ej_CUfunction fn, int attrib, int value)) \
	X(cuOccupancyMaxActiveBlocksPerMultiprocessor, 6050,                   \
	  (int *blocks, ej_CUfunction fn, int block_size, size_t smem))        \
	X(cuLaunchKernel, 4000,                                                \
	  (ej_CUfunction fn, unsigned gx, unsigned gy, unsigned gz,            \
	   unsigned bx, unsigned by, unsigned bz, unsigned smem,               \
	   ej_CUstream stream, void **params, void **extra))                   \
	X(cuStreamCreate, 2000, (ej_CUstream * stream, unsigned flags))        \
	X(cuStreamDestroy, 4000, (ej_CUstream stream))                         \
	X(cuStreamSynchronize, 2000, (ej_CUstream stream))                     \
	X(cuStreamWaitEvent, 3020,                                             \
	  (ej_CUstream stream, ej_CUevent ev, unsigned flags))                 \
	X(cuEventCreate, 2000, (ej_CUevent * ev, unsigned flags))              \
	X(cuEventDestroy, 4000, (ej_CUevent ev))                               \
	X(cuEventRecord, 2000, (ej_CUevent ev, ej_CUstream stream))            \
	X(cuEventSynchronize, 2000, (ej_CUevent ev))                           \
	X(cuEventElapsedTime, 12080,                                           \
	  (float *ms, ej_CUevent start, ej_CUevent end))                       \
	X(cuStreamBeginCapture, 10010, (ej_CUstream stream, int mode))         \
	X(cuStreamEndCapture, 10000, (ej_CUstream stream, ej_CUgraph * graph)) \
	X(cuGraphInstantiateWithFlags, 11040,                                  \
	  (ej_CUgraphExec * exec, ej_CUgraph graph, unsigned long long flags)) \
	X(cuGraphLaunch, 10000, (ej_CUgraphExec exec, ej_CUstream stream))     \
	X(cuGraphExecDestroy, 10000, (ej_CUgraphExec exec))                    \
	X(cuGraphDestroy, 10000, (ej_CUgraph graph))

typedef struct ej_cuda_driver {
#define EJ_CUDA_FIELD(name, ver, args) ej_CUresult(*name) args;
	EJ_CUDA_ENTRY_POINTS(EJ_CUDA_FIELD)
#undef EJ_CUDA_FIELD
	/* not through cuGetProcAddress: they must work when it fails */
	ej_CUresult (*cuGetErrorName)(ej_CUresult err, const char **s);
	ej_CUresult (*cuGetErrorString)(ej_CUresult err, const char **s);
	int version; /* cuDriverGetVersion, e.g. 13000 */
	char path[256];
} ej_cuda_driver;

/* The process's driver table: loads $EPJIT_CUDA_DRIVER (default
 * libcuda.so.1) at the first call, refuses a driver older than
 * EJ_CUDA_MIN_DRIVER, resolves every entry point and calls cuInit(0).  The
 * calls that allocate, free, copy, launch or wait go through counting
 * wrappers (ej_cuda_counters), so every caller of the table is counted.  NULL
 * with EPJ_ERR_BACKEND in ctx when there is none: "no CUDA driver (libcuda.so.1
 * not found: <dlerror>)", or the entry point / cuInit failure.  The same answer
 * every later call. */
const ej_cuda_driver *ej_cuda_driver_get(epj_ctx *ctx);

/* The counts of the calls made through the driver table so far (zeros
 * before it is loaded), and the reset of the reserved-bytes peak. */
void ej_cuda_counters(ej_dev_counters *out);
void ej_cuda_counters_reset_peak(void);

/* Sets ctx's error for a failed driver call (the check macro's work):
 * "<what> failed at <file>:<line>: <cuGetErrorName> (<code>): <string>". */
epj_status ej_cuda_error(epj_ctx *ctx, const ej_cuda_driver *d, ej_CUresult r,
			 const char *what, const char *file, int line);

#define EJ_CU_TRY(st, ctx, d, call)                                            \
	do {                                                                   \
		ej_CUresult ej_cu_r_ = (d)->call;                              \
		(st) = ej_cu_r_ == EJ_CUDA_SUCCESS                             \
			   ? EPJ_OK                                            \
			   : ej_cuda_error((ctx), (d), ej_cu_r_, #call,        \
					   __FILE__, __LINE__);                \
	} while (0)
#define EJ_CU(ctx, d, call)                                                    \
	do {                                                                   \
		epj_status ej_cu_st_;                                          \
		EJ_CU_TRY(ej_cu_st_, ctx, d, call);                            \
		if (ej_cu_st_ != EPJ_OK)                                       \
			return ej_cu_st_;                                      \
	} while (0)

/* ---- the device (device_cuda.c) ---------------------------------------- */

/* The process's cuda device: one primary context on one GPU, a compute
 * stream, a side stream (for work that overlaps the compute stream, such
 * as split-plan copies) and a communication stream (NCCL's all-to-all
 * exchanges, runtime/comm_nccl.c, ordered with the compute stream by
 * events so that the kernels issued meanwhile overlap them). */
typedef struct ej_cuda_dev ej_cuda_dev;

/* Opens (the first call) or returns the process's device: the GPU with
 * ordinal $EPJIT_CUDA_DEVICE when set, else the local rank (LOCAL_RANK,
 * OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID; 0 when none)
 * modulo the device count.  Errors (ctx): no driver, no GPU, a bad
 * EPJIT_CUDA_DEVICE (EPJ_ERR_CONFIG), any failing driver call.  The device
 * lives until the process ends. */
epj_status ej_cuda_open(epj_ctx *ctx, ej_cuda_dev **out);
/* The ordinal for a process: override (a decimal in [0, count)) when
 * non-empty, else local % count; -1 when impossible. */
int ej_cuda_pick_ordinal(int device_count, const char *override, int local);
/* The ej_device vtable of c (memory on the compute stream, modules,
 * launches); for an ej_allocator or a backend. */
const ej_device *ej_cuda_device(ej_cuda_dev *c);

typedef struct ej_cuda_dev_info {
	char name[128];
	char arch[16]; /* "sm_90" */
	int ordinal, sm_count, cc_major, cc_minor, max_threads, smem_optin;
	int driver_version;
	size_t total_mem;
	int64_t launches; /* kernels launched through this device */
} ej_cuda_dev_info;
void ej_cuda_info(const ej_cuda_dev *c, ej_cuda_dev_info *out);
/* The grid that fills the device once with resident blocks of `block`
 * threads and `smem` bytes of dynamic shared memory for kernel fn:
 * cuOccupancyMaxActiveBlocksPerMultiprocessor times the SM count (at most
 * 65535), or 0 when the driver cannot say.  A grid-stride kernel needs no
 * more blocks than that. */
unsigned ej_cuda_grid_cap(ej_cuda_dev *c, void *fn, unsigned block,
			  size_t smem);
/* The last failure of a vtable member that has no context ("" if none). */
const char *ej_cuda_last_error(const ej_cuda_dev *c);

/* Pinned (page-locked) host memory, for copies that overlap compute. */
epj_status ej_cuda_host_alloc(epj_ctx *ctx, ej_cuda_dev *c, size_t bytes,
			      void **out);
void ej_cuda_host_free(ej_cuda_dev *c, void *p);

/* Events: recorded on the compute stream (side false) or the side stream;
 * elapsed time waits for `end`. */
epj_status ej_cuda_event_new(epj_ctx *ctx, ej_cuda_dev *c, void **ev);
void ej_cuda_event_free(ej_cuda_dev *c, void *ev);
epj_status ej_cuda_event_record(epj_ctx *ctx, ej_cuda_dev *c, void *ev,
				bool side);
/* The compute (side false) or side stream waits for ev. */
epj_status ej_cuda_stream_wait(epj_ctx *ctx, ej_cuda_dev *c, void *ev,
			       bool side);
epj_status ej_cuda_event_elapsed_ms(epj_ctx *ctx, ej_cuda_dev *c, void *start,
				    void *end, double *ms);
/* A copy on the compute stream that does not wait for its end. */
epj_status ej_cuda_copy_async(epj_ctx *ctx, ej_cuda_dev *c, void *dst,
			      const void *src, size_t bytes);
/* Waits for the three streams. */
epj_status ej_cuda_sync(epj_ctx *ctx, ej_cuda_dev *c);

/* CUDA graphs: launches on the compute stream between begin and end are
 * captured (thread-local mode) instead of run; end instantiates them into
 * *exec, which ej_cuda_graph_launch replays on the compute stream. */
epj_status ej_cuda_capture_begin(epj_ctx *ctx, ej_cuda_dev *c);
epj_status ej_cuda_capture_end(epj_ctx *ctx, ej_cuda_dev *c, void **exec);
epj_status ej_cuda_graph_launch(epj_ctx *ctx, ej_cuda_dev *c, void *exec);
void ej_cuda_graph_free(ej_cuda_dev *c, void *exec);

/* The compute stream (a CUstream, which is also the runtime's
 * cudaStream_t), for libraries that take a stream: cuBLASLt, NCCL. */
void *ej_cuda_compute_stream(const ej_cuda_dev *c);
/* The communication stream (a CUstream): NCCL's all-to-all exchanges run
 * there, between an event of the compute stream (the send buffer is
 * written) and an event the compute stream waits for before it reads the
 * received rows (runtime/comm_nccl.c).  ej_cuda_sync waits for it too;
 * the vtable's sync does not (whatever reads an exchange's buffers comes
 * after the compute stream's wait for it). */
void *ej_cuda_comm_stream(const ej_cuda_dev *c);

/* The stream log: the order in which work reached the device's streams,
 * process-wide, the last 8192 entries.  Each entry is "<stream>:<op>",
 * stream c (compute), s (side), m (communication) or ? (another), op L
 * (kernel launch), G (graph launch), C (async copy), R (event record), W
 * (the stream waits for an event) or what ej_cuda_stream_note gave (N: a
 * library's exchange, runtime/comm_nccl.c).  ej_cuda_stream_log writes
 * them oldest first, separated by spaces, into out (at most n bytes with
 * the NUL; out may be NULL) and returns the full text's length. */
void ej_cuda_stream_note(void *stream, char op);
size_t ej_cuda_stream_log(char *out, size_t n);
void ej_cuda_stream_log_reset(void);

#endif /* EPJIT_CUDA_DRIVER_H */
