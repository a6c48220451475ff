/* warmup.h -- the artifacts of a jit's compiled graphs, listed and compiled
 * ahead of a run (jit/warmup.c; the tool is tools/epjit_warmup.c).
 */
#ifndef EPJIT_WARMUP_H
#define EPJIT_WARMUP_H

#include "jit.h"

/* One artifact: a kernel-cache key and the generated source it is built
 * from (C for the host compiler, CUDA C for NVRTC when arch is set). */
typedef struct ej_warm_job {
	char key[65];
	char *source;  /* malloc'ed */
	char name[48]; /* translation unit name (ej_codegen_graph_name) */
	char arch[16]; /* "" for the C backend */
	char what[16]; /* "forward" or "backward" */
	bool was_cached, compiled;
} ej_warm_job;

typedef struct ej_warm_plan {
	ej_backend_kind backend; /* whose artifacts */
	ej_warm_job *jobs;
	int n, cap;
	int n_segments, n_graphs; /* unique segments and their graphs */
	int n_cached, n_compiled, n_failed; /* after ej_warm_plan_compile */
} ej_warm_plan;

/* The artifacts of every unique graph in jit's segment cache as backend
 * `kind` builds them (its vtable's artifact): C shared objects, or NVRTC
 * cubins for each arch of arch_list (comma separated; NULL:
 * EJ_CUDA_ARCH_DEFAULT).  Keys are unique in the plan.  A backend without
 * cached artifacts (interpreter, cuda-sim) is EPJ_ERR_UNSUPPORTED. */
epj_status ej_warm_plan_build(epj_ctx *ctx, ej_jit *jit, ej_backend_kind kind,
			      const char *arch_list, ej_warm_plan *out);
/* Compiles the artifacts missing from the kernel cache at dir (NULL: the
 * default) with n_workers forked processes and stores them; fills the
 * counts and each job's was_cached/compiled.  EPJ_ERR_COMPILE when any
 * artifact is still missing afterwards (the workers printed why). */
epj_status ej_warm_plan_compile(epj_ctx *ctx, ej_warm_plan *p, const char *dir,
				int n_workers);
void ej_warm_plan_free(ej_warm_plan *p);

#endif /* EPJIT_WARMUP_H */
