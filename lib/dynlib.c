/* dynlib.c -- an optional shared library loaded with dlopen at first use
 * (dynlib.h): the driver (device_cuda.c), cuBLASLt (cublaslt.c) and NCCL
 * (runtime/comm_nccl.c) share the lock, the verdict and the messages.
 */
#include "dynlib.h"

#include <dlfcn.h>
#include <stdio.h>

bool ej_dynlib_get(ej_dynlib *l, epj_ctx *ctx)
{
	pthread_mutex_lock(&l->lock);
	if (!l->tried) {
		l->tried = true;
		l->err[0] = 0;
		l->status = l->status0;
		l->ok = l->load(l->err, sizeof l->err, &l->status);
	}
	bool ok = l->ok;
	pthread_mutex_unlock(&l->lock);
	if (!ok && ctx)
		ej_error(ctx, l->status, "%s", l->err);
	return ok;
}

void ej_dynlib_reset(ej_dynlib *l)
{
	pthread_mutex_lock(&l->lock);
	l->tried = false;
	l->ok = false;
	pthread_mutex_unlock(&l->lock);
}

void *ej_dynlib_open(const char *path, char *why, size_t n)
{
	dlerror();
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		const char *e = dlerror();
		snprintf(why, n, "%s not found: %s", path,
			 e ? e : "dlopen failed");
	}
	return h;
}
