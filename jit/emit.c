/* emit.c -- CUDA C of every compiled graph, for offline use: write each
 * translation unit with the NVRTC options it would be compiled with
 * (`epjit-train --emit-cuda DIR`), and optionally compile it under NVRTC
 * for every target arch (EPJIT_CUDA_ARCH), failing on any error or warning.
 *
 * The units are those of the graphs in the jit's segment cache: the forward
 * and backward graph of every unique segment traced so far.
 */
#include "cc.h"
#include "jit_impl.h"
#include "kir.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

static epj_status write_text(epj_ctx *ctx, const char *path, const char *s)
{
	FILE *f = fopen(path, "w");
	if (!f)
		return ej_error(ctx, EPJ_ERR_IO, "emit: cannot write %s: %s",
				path, strerror(errno));
	fputs(s, f);
	if (fclose(f) != 0)
		return ej_error(ctx, EPJ_ERR_IO, "emit: error writing %s",
				path);
	return EPJ_OK;
}

/* One unit: write dir/name.cu and dir/name.opts (first arch), compile for
 * every arch when asked. */
static epj_status emit_unit(epj_ctx *ctx, ej_graph *g, const char *name,
			    const char *dir, bool nvrtc_check,
			    char archs[][EJ_CUDA_ARCH_MAX], int n_archs,
			    int *n_units)
{
	char *src = NULL;
	epj_status st = ej_codegen_emit_cuda(ctx, g, name, &src);
	if (st != EPJ_OK)
		return st;
	if (!src)
		return EPJ_OK; /* no fused kernel: every node is an extern */
	char path[4096];
	if (dir) {
		snprintf(path, sizeof path, "%s/%s.cu", dir, name);
		st = write_text(ctx, path, src);
		if (st == EPJ_OK) {
			/* the options ej_nvrtc_compile passes, one a line */
			char opts[64];
			snprintf(opts, sizeof opts, "-arch=%s\n", archs[0]);
			snprintf(path, sizeof path, "%s/%s.opts", dir, name);
			st = write_text(ctx, path, opts);
		}
	}
	for (int a = 0; st == EPJ_OK && nvrtc_check && a < n_archs; a++) {
		ej_nvrtc_result r = { 0 };
		st = ej_nvrtc_compile(ctx, src, name, archs[a], NULL, 0, &r);
		if (st == EPJ_OK && r.log && ej_nvrtc_log_has_warning(r.log))
			st = ej_error(ctx, EPJ_ERR_COMPILE,
				      "emit: %s.cu for %s compiles with "
				      "warnings:\n%s",
				      name, archs[a], r.log);
		ej_nvrtc_result_free(&r);
	}
	free(src);
	if (st == EPJ_OK)
		(*n_units)++;
	return st;
}

epj_status ej_jit_emit_cuda(epj_ctx *ctx, ej_jit *jit, const char *dir,
			    bool nvrtc_check, int *n_units)
{
	char archs[8][EJ_CUDA_ARCH_MAX];
	*n_units = 0;
	int n_archs = ej_cuda_archs(ctx, archs, 8);
	if (n_archs < 1)
		return ctx->status;
	if (nvrtc_check) {
		int maj = 0, min = 0;
		if (!ej_nvrtc_version(&maj, &min))
			return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
					"emit: this build has no NVRTC to "
					"check the units with");
	}
	if (dir && mkdir(dir, 0755) != 0 && errno != EEXIST)
		return ej_error(ctx, EPJ_ERR_IO, "emit: cannot create %s: %s",
				dir, strerror(errno));
	epj_status st = EPJ_OK;
	for (int i = 0; st == EPJ_OK && i < jit->cache_cap; i++) {
		ej_segment *s = jit->cache[i];
		if (!s)
			continue;
		char name[64];
		snprintf(name, sizeof name, "%.16s-forward", s->sig_hex);
		st = emit_unit(ctx, s->fwd, name, dir, nvrtc_check, archs,
			       n_archs, n_units);
		if (st == EPJ_OK && s->bwd) {
			snprintf(name, sizeof name, "%.16s-backward",
				 s->sig_hex);
			st = emit_unit(ctx, s->bwd, name, dir, nvrtc_check,
				       archs, n_archs, n_units);
		}
	}
	return st;
}
