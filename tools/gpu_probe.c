/* tools/gpu_probe.c -- the first lines of tools/gpu-check: which driver,
 * which GPU, which NVRTC, before anything is built.
 *
 * A standalone program (C11 and libdl only; gpu-check compiles it with the
 * system cc in a second) that loads the CUDA driver as the library does
 * ($EPJIT_CUDA_DRIVER, default libcuda.so.1; entry points through
 * cuGetProcAddress_v2 at their prototypes' versions) and NVRTC
 * ($EPJIT_NVRTC, default libnvrtc.so from the toolkit's lib64 or the
 * loader's path), and prints:
 *
 *   driver: 13000 (13.0) from libcuda.so.1
 *   gpu 0: NVIDIA H200, sm_90, 132 SMs, 143771 MiB
 *   nvrtc: 13.0
 *
 * Exit status: 0 usable; 2 no driver or no GPU; 3 a driver older than
 * 13000 (the CUDA 13 toolkit's NVRTC output, cuBLASLt and NCCL need an
 * R580 or newer driver); 4 no NVRTC.
 */
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

int main(int argc, char **argv)
{
	if (argc > 1) {
		fprintf(stderr, "usage: gpu-probe (no arguments; "
				"EPJIT_CUDA_DRIVER, EPJIT_NVRTC, CUDA_HOME)\n");
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
	printf("driver: %d (%d.%d) from %s\n", v, v / 1000, v % 1000 / 10,
	       path);
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
	const char *np = getenv("EPJIT_NVRTC");
	const char *home = getenv("CUDA_HOME");
	char buf[4096];
	void *nh = NULL;
	if (np && *np) {
		nh = dlopen(np, RTLD_NOW | RTLD_LOCAL);
	} else {
		snprintf(buf, sizeof buf, "%s/lib64/libnvrtc.so",
			 home && *home ? home : "/usr/local/cuda");
		nh = dlopen(buf, RTLD_NOW | RTLD_LOCAL);
		if (!nh)
			nh = dlopen("libnvrtc.so", RTLD_NOW | RTLD_LOCAL);
	}
	int (*nv)(int *, int *) = NULL;
	p = sym(nh, "nvrtcVersion");
	memcpy(&nv, &p, sizeof p);
	int a = 0, b = 0;
	if (!nv || nv(&a, &b) != 0) {
		printf("nvrtc: none\n");
		return rc ? rc : 4;
	}
	printf("nvrtc: %d.%d\n", a, b);
	return rc;
}
