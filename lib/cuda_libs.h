/* cuda_libs.h -- where the CUDA libraries loaded at run time are looked
 * for, and which file was loaded.
 *
 * cuBLASLt, cuBLAS, NCCL (and NVRTC, for tools/gpu_probe.c) may live in
 * the system's loader path, in a CUDA toolkit, or only in a Python
 * environment's pip wheels (nvidia/cublas/lib, nvidia/nccl/lib, or for
 * CUDA 13 wheels nvidia/cu13/lib), as on a machine whose CUDA comes with
 * PyTorch.  A library is tried, for each of its names in order:
 *   1. by its name, through the loader's own search (LD_LIBRARY_PATH, the
 *      caller's RUNPATH, ld.so.cache; a copy already loaded, e.g. by
 *      PyTorch in the same process, is found here);
 *   2. in $CUDA_HOME/lib64 and $CUDA_HOME/lib (default /usr/local/cuda);
 *   3. in <env>/lib/python3.* /site-packages/nvidia/ * /lib of every Python
 *      environment named by $VIRTUAL_ENV, $CONDA_PREFIX and
 *      $EPJIT_PYTHON_ENVS (a colon-separated list of environment roots,
 *      e.g. /opt/torch/.venv).
 * The file that was loaded is reported by the loader itself (its link
 * map), so a caller can say exactly which library runs.
 *
 * Header-only (static functions, C11 + POSIX + dlinfo): the library's
 * loaders (lib/cublaslt.c, runtime/comm_nccl.c) and tools/gpu_probe.c,
 * which is built without the library, search the same way.
 */
#ifndef EPJIT_CUDA_LIBS_H
#define EPJIT_CUDA_LIBS_H

#ifndef _GNU_SOURCE
#error "cuda_libs.h needs _GNU_SOURCE (dlinfo) before the first include"
#endif

#include <dlfcn.h>
#include <glob.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The file behind handle h (the loader's link map), into path. */
static inline void ej_cuda_lib_where(void *h, char *path, size_t pn)
{
	struct link_map *lm = NULL;
	if (h && dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name &&
	    *lm->l_name)
		snprintf(path, pn, "%s", lm->l_name);
}

/* dlopen of the first match of pattern (a glob), NULL if none loads. */
static inline void *ej_cuda_lib_glob(const char *pattern)
{
	glob_t g;
	void *h = NULL;
	if (glob(pattern, 0, NULL, &g) == 0) {
		for (size_t i = 0; i < g.gl_pathc && !h; i++)
			h = dlopen(g.gl_pathv[i], RTLD_NOW | RTLD_LOCAL);
		globfree(&g);
	}
	return h;
}

/* Step 3 for one name: the Python environments' nvidia/ * /lib folders. */
static inline void *ej_cuda_lib_pyenvs(const char *name, char *tried, size_t tn)
{
	const char *envs[3] = { getenv("VIRTUAL_ENV"), getenv("CONDA_PREFIX"),
				getenv("EPJIT_PYTHON_ENVS") };
	for (int e = 0; e < 3; e++) {
		const char *s = envs[e];
		while (s && *s) {
			const char *colon = strchr(s, ':');
			size_t len = colon ? (size_t)(colon - s) : strlen(s);
			if (len > 0 && len < 2048) {
				char pat[2560];
				snprintf(pat, sizeof pat,
					 "%.*s/lib/python3*/site-packages/"
					 "nvidia/*/lib/%s",
					 (int)len, s, name);
				void *h = ej_cuda_lib_glob(pat);
				size_t used = strlen(tried);
				if (used + len + 2 < tn)
					snprintf(tried + used, tn - used,
						 ", %.*s", (int)len, s);
				if (h)
					return h;
			}
			s = colon ? colon + 1 : NULL;
		}
	}
	return NULL;
}

/* dlopen (RTLD_NOW | RTLD_LOCAL) of the first of names[0..n) found in the
 * places above; *path (pn bytes) gets the file loaded.  NULL when none
 * loads, with why naming the first name and every place tried. */
static inline void *ej_cuda_lib_open(const char *const *names, int n,
				     char *path, size_t pn, char *why,
				     size_t wn)
{
	const char *home = getenv("CUDA_HOME");
	if (!home || !*home)
		home = "/usr/local/cuda";
	char first_err[320] = "";
	char tried[1024] = "";
	for (int i = 0; i < n; i++) {
		dlerror();
		void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
		if (!h && i == 0) {
			const char *e = dlerror();
			snprintf(first_err, sizeof first_err, "%s",
				 e ? e : "dlopen failed");
		}
		const char *sub[2] = { "lib64", "lib" };
		for (int k = 0; k < 2 && !h; k++) {
			char p[2400];
			snprintf(p, sizeof p, "%s/%s/%s", home, sub[k],
				 names[i]);
			h = dlopen(p, RTLD_NOW | RTLD_LOCAL);
		}
		if (!h) {
			tried[0] = 0;
			h = ej_cuda_lib_pyenvs(names[i], tried, sizeof tried);
		}
		if (h) {
			snprintf(path, pn, "%s", names[i]);
			ej_cuda_lib_where(h, path, pn);
			return h;
		}
	}
	snprintf(path, pn, "%s", n > 0 ? names[0] : "");
	snprintf(why, wn,
		 "%s not found: %s; nor in %s/lib64, %s/lib (CUDA_HOME), nor "
		 "in the nvidia/*/lib folders of the Python environments "
		 "(VIRTUAL_ENV, CONDA_PREFIX, EPJIT_PYTHON_ENVS)%s%s",
		 n > 0 ? names[0] : "?", first_err, home, home,
		 tried[0] ? ":" : " (none set)", tried[0] ? tried + 1 : "");
	return NULL;
}

#endif
