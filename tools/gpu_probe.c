/* tools/gpu_probe.c -- the first lines of tools/gpu-check: which driver,
 * which GPU, which CUDA libraries, from which files, before anything else
 * runs.
 *
 * A standalone program (C11, POSIX and libdl only: gpu-check compiles it
 * with the system cc in a second, and the GPU bundle carries it built)
 * that loads the CUDA driver as the library does ($EPJIT_CUDA_DRIVER,
 * default libcuda.so.1; entry points through cuGetProcAddress_v2 at their
 * prototypes' versions) and looks for NVRTC, cuBLASLt, cuBLAS and NCCL
 * where the library looks for them (lib/cuda_libs.h: the loader's path,
 * $CUDA_HOME, the Python environments' nvidia/ * /lib; or the file that
 * $EPJIT_NVRTC, $EPJIT_CUBLASLT, $EPJIT_CUBLAS, $EPJIT_NCCL name), and
 * prints each with the file the loader loaded:
 *
 *   driver: 13000 (13.0) from /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05
 *   gpu 0: NVIDIA H200, sm_90, 132 SMs, 143771 MiB
 *   nvrtc: 13.0 from /usr/local/cuda/lib64/libnvrtc.so.13
 *   cublaslt: 130100 from
 * /opt/torch/.venv/.../nvidia/cu13/lib/libcublasLt.so.13 cublas: from ... nccl:
 * 22703 from ... ld_library_path: /usr/local/cuda/lib64
 *
 * The last line lists the folders of the libraries found (NVRTC first),
 * for a caller that starts programs which link NVRTC (gpu-check --bundle).
 * Exit status: 0 usable; 2 no driver or no GPU; 3 a driver older than
 * 13000 (the CUDA 13 toolkit's NVRTC output, cuBLASLt and NCCL need an
 * R580 or newer driver); 4 no NVRTC; 5 no cuBLASLt (every GEMM would run
 * the mma.sync template: the GPU check refuses to call that a pass).  NCCL
 * is printed but not required (one GPU has nothing to exchange).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "../lib/cuda_libs.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*getproc_fn)(const char *, void **, int, unsigned long long,
			  int *);

static void *sym(void *h, const char *name)
{
	return h ? dlsym(h, name) : NULL;
}

/* The entry point `name` at prototype version `ver` (NULL if refused). */
static void *proc(getproc_fn gp, const char *name, int ver)
{
	void *fn = NULL;
	int status = 0;
	return gp(name, &fn, ver, 0, &status) == 0 ? fn : NULL;
}

/* One library: the override $env (a file or a name; "0": off), else the
 * first of names found where the library looks (cuda_libs.h).  Prints
 * "<what>: <version> from <file>" or "<what>: none (<why>)"; adds the
 * file's folder to dirs.  NULL when not loaded. */
static void *lib(const char *what, const char *env, const char *const *names,
		 int n, char *dirs, size_t dn, char *file, size_t fn)
{
	const char *ov = getenv(env);
	char why[1600] = "";
	void *h = NULL;
	file[0] = 0;
	if (ov && !strcmp(ov, "0")) {
		printf("%s: none (%s=0)\n", what, env);
		return NULL;
	}
	if (ov && *ov) {
		snprintf(file, fn, "%s", ov);
		h = dlopen(ov, RTLD_NOW | RTLD_LOCAL);
		if (!h)
			snprintf(why, sizeof why, "%s: %s", ov, dlerror());
		ej_cuda_lib_where(h, file, fn);
	} else {
		h = ej_cuda_lib_open(names, n, file, fn, why, sizeof why);
	}
	if (!h) {
		printf("%s: none (%s)\n", what, why);
		return NULL;
	}
	const char *slash = strrchr(file, '/');
	size_t used = strlen(dirs);
	if (slash && slash > file) {
		int dl = (int)(slash - file);
		char dir[1024];
		snprintf(dir, sizeof dir, "%.*s", dl, file);
		if (!strstr(dirs, dir) && used + strlen(dir) + 2 < dn)
			snprintf(dirs + used, dn - used, "%s%s",
				 used ? ":" : "", dir);
	}
	return h;
}

/* A library's int version through fn (NULL: none), for the line. */
static void version_line(const char *what, void *h, const char *fn,
			 const char *file)
{
	int (*get)(int *) = NULL;
	size_t (*lt)(void) = NULL;
	void *p = h ? dlsym(h, fn) : NULL;
	int v = 0;
	if (!strcmp(what, "cublaslt")) {
		memcpy(&lt, &p, sizeof p);
		v = lt ? (int)lt() : 0;
	} else {
		memcpy(&get, &p, sizeof p);
		if (!get || get(&v) != 0)
			v = 0;
	}
	if (v)
		printf("%s: %d from %s\n", what, v, file);
	else
		printf("%s: from %s\n", what, file);
}

/* NVRTC, cuBLASLt, cuBLAS, NCCL: each with its file; 4 no NVRTC, 5 no
 * cuBLASLt, else 0. */
static int libs(char *dirs, size_t dn)
{
	static const char *const nvrtc[] = { "libnvrtc.so.13", "libnvrtc.so.12",
					     "libnvrtc.so" };
	static const char *const lt[] = { "libcublasLt.so.13",
					  "libcublasLt.so.12",
					  "libcublasLt.so" };
	static const char *const blas[] = { "libcublas.so.13",
					    "libcublas.so.12", "libcublas.so" };
	static const char *const nccl[] = { "libnccl.so.2" };
	char file[1024];
	int rc = 0;
	void *h =
	    lib("nvrtc", "EPJIT_NVRTC", nvrtc, 3, dirs, dn, file, sizeof file);
	int (*nv)(int *, int *) = NULL;
	void *p = h ? dlsym(h, "nvrtcVersion") : NULL;
	memcpy(&nv, &p, sizeof p);
	int a = 0, b = 0;
	if (h && nv && nv(&a, &b) == 0) {
		printf("nvrtc: %d.%d from %s\n", a, b, file);
	} else {
		if (h)
			printf("nvrtc: none (%s lacks nvrtcVersion)\n", file);
		rc = 4;
	}
	h = lib("cublaslt", "EPJIT_CUBLASLT", lt, 3, dirs, dn, file,
		sizeof file);
	if (h)
		version_line("cublaslt", h, "cublasLtGetVersion", file);
	else if (!rc)
		rc = 5;
	h = lib("cublas", "EPJIT_CUBLAS", blas, 3, dirs, dn, file, sizeof file);
	if (h)
		printf("cublas: %s from %s\n",
		       dlsym(h, "cublasGemmGroupedBatchedEx")
			   ? "grouped GEMM"
			   : "no grouped GEMM (cuBLAS 12.5 or newer has it)",
		       file);
	h = lib("nccl", "EPJIT_NCCL", nccl, 1, dirs, dn, file, sizeof file);
	if (h)
		version_line("nccl", h, "ncclGetVersion", file);
	return rc;
}

int main(int argc, char **argv)
{
	if (argc > 1) {
		fprintf(stderr, "usage: gpu-probe (no arguments; "
				"EPJIT_CUDA_DRIVER, EPJIT_NVRTC, "
				"EPJIT_CUBLASLT, EPJIT_CUBLAS, EPJIT_NCCL, "
				"CUDA_HOME, VIRTUAL_ENV, CONDA_PREFIX, "
				"EPJIT_PYTHON_ENVS)\n");
		return strcmp(argv[1], "--help") == 0 ? 0 : 1;
	}
	const char *path = getenv("EPJIT_CUDA_DRIVER");
	if (!path || !*path)
		path = "libcuda.so.1";
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		printf("driver: none (%s: %s)\n", path, dlerror());
		return 2;
	}
	int (*version)(int *) = NULL;
	getproc_fn gp = NULL;
	void *p = sym(h, "cuDriverGetVersion");
	memcpy(&version, &p, sizeof p);
	p = sym(h, "cuGetProcAddress_v2");
	memcpy(&gp, &p, sizeof p);
	int v = 0;
	if (!version || !gp || version(&v) != 0) {
		printf("driver: %s lacks cuDriverGetVersion or "
		       "cuGetProcAddress_v2\n",
		       path);
		return 2;
	}
	char where[1024];
	snprintf(where, sizeof where, "%s", path);
	ej_cuda_lib_where(h, where, sizeof where);
	printf("driver: %d (%d.%d) from %s\n", v, v / 1000, v % 1000 / 10,
	       where);
	int rc = 0;
	if (v < 13000) {
		printf("driver: TOO OLD: epjit needs 13.0 or newer (an R580+ "
		       "driver) for the CUDA 13 toolkit's NVRTC output, "
		       "cuBLASLt and NCCL\n");
		rc = 3;
	}
	int (*init)(unsigned) = NULL;
	int (*count)(int *) = NULL;
	int (*get)(int *, int) = NULL;
	int (*name)(char *, int, int) = NULL;
	int (*attr)(int *, int, int) = NULL;
	int (*mem)(size_t *, int) = NULL;
	p = proc(gp, "cuInit", 2000);
	memcpy(&init, &p, sizeof p);
	p = proc(gp, "cuDeviceGetCount", 2000);
	memcpy(&count, &p, sizeof p);
	p = proc(gp, "cuDeviceGet", 2000);
	memcpy(&get, &p, sizeof p);
	p = proc(gp, "cuDeviceGetName", 2000);
	memcpy(&name, &p, sizeof p);
	p = proc(gp, "cuDeviceGetAttribute", 2000);
	memcpy(&attr, &p, sizeof p);
	p = proc(gp, "cuDeviceTotalMem", 3020);
	memcpy(&mem, &p, sizeof p);
	int n = 0;
	if (!init || !count || !get || !name || !attr || !mem || init(0) != 0 ||
	    count(&n) != 0 || n < 1) {
		printf("gpu: none (cuInit or cuDeviceGetCount failed, or no "
		       "device)\n");
		return 2;
	}
	for (int i = 0; i < n; i++) {
		int d = 0, sms = 0, ma = 0, mi = 0;
		char nm[128] = "?";
		size_t bytes = 0;
		if (get(&d, i) != 0)
			continue;
		name(nm, (int)sizeof nm, d);
		attr(&sms, 16,
		     d);	  /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */
		attr(&ma, 75, d); /* ..._COMPUTE_CAPABILITY_MAJOR */
		attr(&mi, 76, d); /* ..._COMPUTE_CAPABILITY_MINOR */
		mem(&bytes, d);
		printf("gpu %d: %s, sm_%d%d, %d SMs, %zu MiB\n", i, nm, ma, mi,
		       sms, bytes >> 20);
	}
	char dirs[4096] = "";
	int lrc = libs(dirs, sizeof dirs);
	printf("ld_library_path: %s\n", dirs);
	return rc ? rc : lrc;
}
