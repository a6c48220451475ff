/* device_sim.c -- the cuda-sim device: host memory (so eager ops and extern
 * nodes run the CPU reference kernels on the same buffers), modules are
 * shared objects built from CUDA C by jit/backend_sim.c, and a launch calls
 * the module's per-kernel entry, which runs the grid in the simulator
 * (templates/cuda_sim.cuh).
 *
 * Launch checks, on unless turned off by the environment:
 *   EPJIT_SIM_RACECHECK=0  no second run in reverse block/thread order
 *   EPJIT_SIM_POISON=0     outputs are not filled with a NaN pattern and
 *                          not checked for unwritten elements
 * A report from the simulator (kernel, block, thread, what) becomes
 * EPJ_ERR_BACKEND with the report as the message.
 */
#include "core_impl.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The jit's loader of host shared objects (ej_device_sim_set_loader). */
static _Atomic(const ej_so_loader *) loader;

void ej_device_sim_set_loader(const ej_so_loader *l)
{
	atomic_store(&loader, l);
}

/* Mirror of struct ej_sim_launch / ej_sim_out in templates/cuda_sim.cuh;
 * the abi field catches a mismatch. */
#define SIM_ABI	      3
#define SIM_RACECHECK 1
#define SIM_POISON    2
typedef struct sim_out {
	void *ptr;
	unsigned long long bytes;
	unsigned long long elem;
} sim_out;
typedef struct sim_launch {
	unsigned abi;
	unsigned grid[3], block[3];
	unsigned long long smem;
	const void *args;
	const sim_out *outs;
	int n_out;
	int flags;
	char msg[1024];
} sim_launch;
typedef int (*sim_entry)(sim_launch *);

static void *sim_alloc(void *self, size_t bytes)
{
	(void)self;
	return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}

static void sim_free(void *self, void *p)
{
	(void)self;
	free(p);
}

static void sim_copy(void *self, void *dst, const void *src, size_t n)
{
	(void)self;
	memmove(dst, src, n);
}

static void sim_memzero(void *self, void *p, size_t n)
{
	(void)self;
	memset(p, 0, n);
}

static epj_status sim_load(void *self, epj_ctx *ctx, const void *image,
			   size_t size, const char *name, void **module)
{
	(void)self;
	const ej_so_loader *l = atomic_load(&loader);
	*module = NULL;
	if (!l)
		return ej_error(ctx, EPJ_ERR_STATE,
				"cuda-sim: loading module %s: no module "
				"loader (the jit registers it)",
				name);
	epj_status st = l->load(ctx, image, size, name, module);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "cuda-sim: loading module %s", name);
	return st;
}

static void sim_unload(void *self, void *module)
{
	(void)self;
	const ej_so_loader *l = atomic_load(&loader);
	if (l && module)
		l->unload(module);
}

static void *sim_function(void *self, void *module, const char *kernel)
{
	(void)self;
	char sym[128];
	snprintf(sym, sizeof sym, "ej_sim_%s", kernel);
	const ej_so_loader *l = atomic_load(&loader);
	return l ? l->sym(module, sym) : NULL;
}

/* An EPJIT_SIM_* switch: on unless set to 0/off/no/false. */
static bool sim_flag(const char *env)
{
	const char *v = getenv(env);
	return !v || !(!strcmp(v, "0") || !strcmp(v, "off") ||
		       !strcmp(v, "no") || !strcmp(v, "false"));
}

static epj_status sim_launch_fn(void *self, epj_ctx *ctx, void *fn,
				const char *kernel, const ej_launch *l)
{
	(void)self;
	EJ_ASSERT(fn && l);
	sim_launch L;
	memset(&L, 0, sizeof L);
	L.abi = SIM_ABI;
	memcpy(L.grid, l->grid, sizeof L.grid);
	memcpy(L.block, l->block, sizeof L.block);
	L.smem = l->smem;
	L.args = l->args;
	sim_out outs[16];
	sim_out *o =
	    l->n_out <= 16 ? outs : calloc((size_t)l->n_out, sizeof *o);
	if (!o)
		return ej_error(ctx, EPJ_ERR_NOMEM, "cuda-sim: out of memory");
	for (int i = 0; i < l->n_out; i++)
		o[i] = (sim_out){ l->outs[i].ptr, l->outs[i].bytes,
				  l->outs[i].elem };
	L.outs = o;
	L.n_out = l->n_out;
	L.flags = (sim_flag("EPJIT_SIM_RACECHECK") ? SIM_RACECHECK : 0) |
		  (sim_flag("EPJIT_SIM_POISON") ? SIM_POISON : 0);
	sim_entry entry;
	memcpy(&entry, &fn, sizeof entry);
	int rc = entry(&L);
	if (o != outs)
		free(o);
	if (rc != 0)
		return ej_error(ctx, EPJ_ERR_BACKEND, "%s",
				L.msg[0] ? L.msg : "cuda-sim: launch failed");
	(void)kernel;
	return EPJ_OK;
}

static epj_status sim_desc_open(epj_ctx *probe, const ej_device **out)
{
	(void)probe;
	*out = &ej_device_sim;
	return EPJ_OK;
}

/* The simulated CUDA device: host memory, CUDA C built by the host C++
 * compiler, every grid run twice to find races. */
const ej_device_desc ej_desc_sim = {
	.name = "cuda-sim",
	.backend = "cuda-sim",
	.comm = NULL,
	.runs_cuda = true,
	.modules = EJ_MODULES_HOST_SO,
	.reruns_grids = true,
	.gemm_library = false,
	.open = sim_desc_open,
};

const ej_device ej_device_sim = {
	.name = "cuda-sim",
	.desc = &ej_desc_sim,
	.self = NULL,
	.alloc = sim_alloc,
	.free = sim_free,
	.copy = sim_copy,
	.memzero = sim_memzero,
	.sync = NULL,
	.host_visible = true,
	.load = sim_load,
	.unload = sim_unload,
	.function = sim_function,
	.launch = sim_launch_fn,
};
