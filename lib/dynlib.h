/* dynlib.h -- an optional shared library loaded with dlopen at first use.
 *
 * The devices' libraries (the CUDA driver, cuBLASLt, NCCL) are each loaded
 * once per process, at the first call that needs them, under a lock; the
 * verdict (loaded, or the status and message that say why not) is kept and
 * given to every later caller.  Each library brings its own load function,
 * which resolves its entry points into its own table; this file holds what
 * was written three times before: the lock, the tried flag, the verdict,
 * the dlopen with its message, and the test hook that forgets it.
 */
#ifndef EPJIT_DYNLIB_H
#define EPJIT_DYNLIB_H

#include "core_impl.h"

#include <pthread.h>

typedef struct ej_dynlib {
	pthread_mutex_t lock;
	/* fills the library's table; false with err (and *status, preset to
	 * the library's default) set */
	bool (*load)(char *err, size_t n, epj_status *status);
	epj_status status0; /* the status of a failed load by default */
	bool tried, ok;
	epj_status status;
	char err[2048];
} ej_dynlib;

#define EJ_DYNLIB_INIT(load_fn, st)                                            \
	{                                                                      \
		.lock = PTHREAD_MUTEX_INITIALIZER, .load = (load_fn),          \
		.status0 = (st)                                                \
	}

/* True once the library is loaded (the first call loads it); else false
 * with the verdict in ctx (NULL: kept only). */
bool ej_dynlib_get(ej_dynlib *l, epj_ctx *ctx);
/* Test hook: forget the verdict (handles stay open), so that one process
 * can load another stand-in; the caller clears its own table. */
void ej_dynlib_reset(ej_dynlib *l);
/* dlopen(path, RTLD_NOW | RTLD_LOCAL); NULL with "<path> not found:
 * <dlerror>" in why. */
void *ej_dynlib_open(const char *path, char *why, size_t n);

#endif
