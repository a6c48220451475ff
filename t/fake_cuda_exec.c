/* fake_cuda_exec.c -- the stand-in driver's own way of running a kernel:
 * on cuda-sim, from the CUDA C the module was compiled from, without a
 * test's hook.  t/fake_nvrtc.c (preloaded) remembers which source each
 * NVRTC image came from; a module whose image it knows gets its source at
 * cuModuleLoadData, and its kernels run here: the kernels are found in the
 * source (every `__global__ void [__launch_bounds__(...)] NAME(TYPE a)`:
 * one argument struct by value, as every epjit kernel takes), built once
 * per module into a cuda-sim module (the library's ej_sim_build_module,
 * linked into the stand-in, kernel cache included) and launched with the
 * parameter bytes cuLaunchKernel received.
 *
 * Test code: built only for make check, never installed.
 */
#include "fake_cuda_exec.h"

#include <ctype.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core_impl.h"
#include "fake_kparam.h"
#include "kir.h"

typedef const char *(*source_fn)(const void *, size_t);

static source_fn source_of(void)
{
	static int tried;
	static source_fn fn;
	if (!tried) {
		tried = 1;
		void *p = dlsym(RTLD_DEFAULT, "fake_nvrtc_source_of");
		memcpy(&fn, &p, sizeof p);
	}
	return fn;
}

bool fake_exec_available(void)
{
	return source_of() != NULL;
}

const char *fake_exec_source(const void *image, size_t size)
{
	source_fn f = source_of();
	return f ? f(image, size) : NULL;
}

/* src with comments and string/char literals blanked (same length). */
static char *strip(const char *src)
{
	char *s = strdup(src);
	if (!s)
		return NULL;
	for (char *p = s; *p;) {
		if (p[0] == '/' && p[1] == '*') {
			char *e = strstr(p + 2, "*/");
			char *end = e ? e + 2 : p + strlen(p);
			for (; p < end; p++)
				if (*p != '\n')
					*p = ' ';
		} else if (p[0] == '/' && p[1] == '/') {
			for (; *p && *p != '\n'; p++)
				*p = ' ';
		} else if (*p == '"' || *p == '\'') {
			char q = *p++;
			for (; *p && *p != q; p++) {
				if (*p == '\\' && p[1])
					*p++ = ' ';
				*p = ' ';
			}
			if (*p)
				p++;
		} else {
			p++;
		}
	}
	return s;
}

static const char *skip_ws(const char *p)
{
	while (isspace((unsigned char)*p))
		p++;
	return p;
}

static bool ident_char(char c)
{
	return isalnum((unsigned char)c) || c == '_';
}

/* After `(`: the matching `)` or NULL. */
static const char *close_paren(const char *p)
{
	int depth = 1;
	for (; *p; p++) {
		if (*p == '(')
			depth++;
		else if (*p == ')' && --depth == 0)
			return p;
	}
	return NULL;
}

/* The kernels of src: names and argument types (malloc'ed, *n of them);
 * false when a __global__ cannot be read. */
static bool find_kernels(const char *src, char ***names, char ***types, int *n)
{
	*names = *types = NULL;
	*n = 0;
	char *s = strip(src);
	if (!s)
		return false;
	int cap = 0;
	bool ok = true;
	for (const char *p = strstr(s, "__global__"); p && ok;
	     p = strstr(p, "__global__")) {
		p = skip_ws(p + strlen("__global__"));
		if (strncmp(p, "void", 4) || ident_char(p[4])) {
			ok = false;
			break;
		}
		p = skip_ws(p + 4);
		if (!strncmp(p, "__launch_bounds__", 17)) {
			p = skip_ws(p + 17);
			const char *e = *p == '(' ? close_paren(p + 1) : NULL;
			if (!e) {
				ok = false;
				break;
			}
			p = skip_ws(e + 1);
		}
		const char *name = p;
		while (ident_char(*p))
			p++;
		size_t nl = (size_t)(p - name);
		p = skip_ws(p);
		const char *e = *p == '(' ? close_paren(p + 1) : NULL;
		if (!nl || !e) {
			ok = false;
			break;
		}
		/* "const struct X a": drop the parameter name and a const */
		const char *t = skip_ws(p + 1), *te = e;
		while (te > t && isspace((unsigned char)te[-1]))
			te--;
		while (te > t && ident_char(te[-1]))
			te--;
		while (te > t && isspace((unsigned char)te[-1]))
			te--;
		if (!strncmp(t, "const", 5) && !ident_char(t[5]))
			t = skip_ws(t + 5);
		if (te <= t) {
			ok = false;
			break;
		}
		if (*n == cap) {
			cap = cap ? 2 * cap : 16;
			char **nn = realloc(*names, sizeof *nn * (size_t)cap);
			if (nn)
				*names = nn;
			char **tt = realloc(*types, sizeof *tt * (size_t)cap);
			if (tt)
				*types = tt;
			if (!nn || !tt) {
				ok = false;
				break;
			}
		}
		(*names)[*n] = strndup(name, nl);
		(*types)[*n] = strndup(t, (size_t)(te - t));
		(*n)++;
		p = e;
	}
	free(s);
	return ok && *n > 0;
}

static void free_list(char **v, int n)
{
	for (int i = 0; i < n; i++)
		free(v[i]);
	free(v);
}

static epj_ctx *exec_ctx(void)
{
	static epj_ctx *ctx;
	if (!ctx) {
		/* kernels handed over by a driver may update in place (an
		 * optimizer step, a GEMM accumulating into C): cuda-sim's
		 * race check would run such a grid twice */
		setenv("EPJIT_SIM_RACECHECK", "0", 1);
		if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
			ctx = NULL;
	}
	return ctx;
}

/* Drops the kernels of names/types that are not in the module's image: a
 * __global__ the preprocessor left out (the attention template's
 * tensor-core kernels outside its bf16 module) is in the source text but
 * not in what NVRTC compiled, and a cuda-sim module must not name it. */
static void keep_compiled(const unsigned char *image, size_t size, char **names,
			  char **types, int *n)
{
	int k = 0;
	for (int i = 0; i < *n; i++) {
		if (fake_kparam_size(image, size, names[i]) < 0) {
			free(names[i]);
			free(types[i]);
			continue;
		}
		names[k] = names[i];
		types[k++] = types[i];
	}
	*n = k;
}

int fake_exec_launch(void **sim, const char *src, const void *image,
		     size_t image_size, const char *kernel,
		     const unsigned *grid, const unsigned *block, unsigned smem,
		     const void *args, size_t args_size)
{
	epj_ctx *ctx = exec_ctx();
	if (!ctx || !src)
		return 1;
	if (!*sim) {
		char **names = NULL, **types = NULL;
		int n = 0;
		if (!find_kernels(src, &names, &types, &n)) {
			fprintf(stderr,
				"fake_cuda: cannot read the kernels of a "
				"module's source\n");
			free_list(names, n);
			free_list(types, n);
			return 1;
		}
		keep_compiled(image, image_size, names, types, &n);
		epj_status st = ej_sim_build_module(
		    ctx, src, (const char *const *)names,
		    (const char *const *)types, n, "fake_exec", sim);
		free_list(names, n);
		free_list(types, n);
		if (st != EPJ_OK) {
			fprintf(stderr, "fake_cuda: cuda-sim build: %s\n",
				epj_ctx_error(ctx));
			epj_ctx_clear_error(ctx);
			*sim = NULL;
			return 1;
		}
	}
	void *fn = ej_device_sim.function(ej_device_sim.self, *sim, kernel);
	if (!fn) {
		fprintf(stderr, "fake_cuda: no kernel %s in its module\n",
			kernel);
		return 1;
	}
	ej_launch l = { .smem = smem, .args = args, .args_size = args_size };
	memcpy(l.grid, grid, sizeof l.grid);
	memcpy(l.block, block, sizeof l.block);
	epj_status st =
	    ej_device_sim.launch(ej_device_sim.self, ctx, fn, kernel, &l);
	if (st != EPJ_OK) {
		fprintf(stderr, "fake_cuda: %s on cuda-sim: %s\n", kernel,
			epj_ctx_error(ctx));
		epj_ctx_clear_error(ctx);
	}
	return st != EPJ_OK;
}

void fake_exec_unload(void *sim)
{
	if (sim)
		ej_device_sim.unload(ej_device_sim.self, sim);
}
