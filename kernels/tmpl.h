/* tmpl.h -- CUDA C templates (templates/<name>.cuh, embedded at build time)
 * built into modules for the cuda-sim or cuda device, and launched.
 *
 * A template is a CUDA C file written against the CUDA prelude
 * (templates/prelude_cuda.h): the unit handed to the compiler is
 *
 *     prelude + "#define" lines of the caller + the template text
 *
 * compiled by the host C++ compiler for cuda-sim (jit/backend_sim.c,
 * ej_sim_build_module) or by NVRTC for the cuda device's arch, through the
 * kernel cache in both cases.  Every kernel of a template takes one argument
 * struct by value (as generated kernels do), so cuda-sim's launch entry
 * (EJ_SIM_ENTRY) and cuLaunchKernel see the same layout.
 *
 * Loaded modules are kept for the life of the process in one table keyed by
 * (device, template, defines): the eager ops ask for a module at every call
 * and get the loaded one.
 */
#ifndef EPJIT_TMPL_H
#define EPJIT_TMPL_H

#include "jit_impl.h"

/* One kernel a caller needs from a template: its name and the C type of its
 * one argument ("struct ej_gemm_args"). */
typedef struct ej_tmpl_kernel {
	const char *name;
	const char *arg_type;
} ej_tmpl_kernel;

/* The embedded text of template `name` (the file templates/<name>.cuh);
 * NULL when there is none. */
const char *ej_tmpl_text(const char *name);
/* Names of all embedded templates, NULL-terminated (static storage). */
const char *const *ej_tmpl_names(void);

/* The full CUDA C unit of template `name` with `defines` (NULL or text of
 * "#define" lines placed after the prelude): prelude + defines + template.
 * Arena-allocated; NULL (error in ctx) for an unknown template. */
const char *ej_tmpl_source(epj_ctx *ctx, ej_arena *A, const char *name,
			   const char *defines);

typedef struct ej_tmpl ej_tmpl;

/* The module of template `name` with `defines`, built for `device`
 * ("cuda-sim" or "cuda") with kernels k[0..n) resolved.  Cached in the
 * process table: the first call compiles (or reads the kernel cache) and
 * loads, later calls with the same (device, name, defines) return the same
 * module.  Kernels not named at the first call cannot be added later: name
 * them all.  Errors: unknown template or device, compile failure (the
 * compiler's message), a kernel missing from the module. */
epj_status ej_tmpl_get(epj_ctx *ctx, const char *device, const char *name,
		       const char *defines, const ej_tmpl_kernel *k, int n,
		       ej_tmpl **out);

/* As ej_tmpl_get for a complete CUDA C unit (prelude included) that is no
 * template, e.g. a generated kernel: cached in the same table under
 * (device, name, unit); the test hooks see its unit like a template's. */
epj_status ej_tmpl_get_unit(epj_ctx *ctx, const char *device, const char *name,
			    const char *unit, const ej_tmpl_kernel *k, int n,
			    ej_tmpl **out);

/* Launches kernel `kernel` (named at ej_tmpl_get) of m as l describes;
 * returns when it is done.  cuda-sim runs its checks (barriers, races,
 * unwritten outputs of l->outs). */
epj_status ej_tmpl_launch(epj_ctx *ctx, ej_tmpl *m, const char *kernel,
			  const ej_launch *l);

/* The device a module runs on (its alloc/copy/free members give buffers the
 * kernels can address). */
const ej_device *ej_tmpl_device(const ej_tmpl *m);

/* Unloads every module of the process table (tests; not thread-safe against
 * concurrent launches). */
void ej_tmpl_clear(void);

/* ---- what the host APIs of the templates share -------------------------- */

/* Scratch buffers that a template launch needs on dev, the device of its
 * module (ej_tmpl_device): from ctx's caching allocator when ctx's memory
 * is dev's memory (the same device name, or both host memory), so that a
 * training step reuses cached blocks and never reaches the driver's
 * allocation (cuMemAlloc / cuMemFree, which synchronizes the whole
 * device); the device's own alloc otherwise (a context of another device
 * driving templates directly: tests).  A freed block goes back to the
 * cache at once: the next user of the block is ordered after the kernels
 * that read it by the one compute stream.  alloc: NULL with an
 * EPJ_ERR_NOMEM error naming `what`; free takes the same ctx and dev (NULL
 * ok). */
void *ej_tmpl_scratch_alloc(epj_ctx *ctx, const ej_device *dev, size_t bytes,
			    const char *what);
void ej_tmpl_scratch_free(epj_ctx *ctx, const ej_device *dev, void *p);

/* The dtype code of the templates' arguments: 0 f32, 1 bf16, 2 f64; -1
 * for any other dtype. */
int ej_tmpl_dcode(epj_dtype dt);
/* An output of a launch: n elements of elem bytes at p. */
ej_launch_out ej_tmpl_out(void *p, int64_t n, size_t elem);
/* ej_tmpl_launch of a one-dimensional grid of `grid` blocks of `block`
 * threads, with the argument struct args (size bytes) and outputs
 * outs[0..n_out). */
epj_status ej_tmpl_launch_1d(epj_ctx *ctx, ej_tmpl *m, const char *kernel,
			     unsigned grid, unsigned block, const void *args,
			     size_t size, const ej_launch_out *outs, int n_out);

#endif
