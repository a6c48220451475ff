/* tmpl_cubin.c -- compiles one CUDA template of the library for sm_90
 * through its NVRTC path (as the cuda device does), prints ptxas's report
 * and writes the cubin: what bench/attn_sass.sh and bench/moe_sass.sh read.
 *
 *   tmpl_cubin TEMPLATE DEFINES OUT.cubin
 *
 * DEFINES: source lines put before the template ("" for none), e.g.
 * "#define EJ_ATTN_DT 1\n#define EJ_ATTN_DL 4" with real newlines. */
#include "config.h"

#include "cc.h"
#include "jit_impl.h"
#include "tmpl.h"
#include <stdio.h>

int main(int argc, char **argv)
{
	epj_ctx *ctx = NULL;
	if (argc != 4 || epj_ctx_new("cpu", &ctx) != EPJ_OK) {
		fprintf(stderr, "usage: tmpl_cubin TEMPLATE DEFINES OUT\n");
		return 1;
	}
	ej_arena *A = ej_arena_new();
	const char *src =
	    ej_tmpl_source(ctx, A, argv[1], argv[2][0] ? argv[2] : NULL);
	const char *opts[] = { EJ_NVRTC_OPT_PTXAS_REPORT };
	ej_nvrtc_result r = { 0 };
	if (!src ||
	    ej_nvrtc_compile(ctx, src, argv[1], "sm_90", opts, 1, &r) !=
		EPJ_OK ||
	    r.is_ptx) {
		fprintf(stderr, "%s\n", epj_ctx_error(ctx));
		return 1;
	}
	fputs(r.log, stdout);
	FILE *f = fopen(argv[3], "wb");
	if (!f || fwrite(r.image, 1, r.size, f) != r.size || fclose(f))
		return 1;
	return 0;
}
