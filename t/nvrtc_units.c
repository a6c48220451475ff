/* nvrtc_units.c -- compiles CUDA C units written by epjit-train
 * --emit-cuda under NVRTC, as --nvrtc-check does, for every arch of
 * EPJIT_CUDA_ARCH, failing on any error or warning:
 *
 *   t/nvrtc_units FILE.cu ...
 *
 * t/emit_cuda.sh emits the units of its twelve configurations (many of
 * them the same unit: one signature, one file name) and checks each
 * distinct unit once with this program instead of once per configuration.
 * Exit 0 when all compile cleanly, 1 when one does not, 77 without NVRTC.
 *
 * Test code: built only for make check, never installed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cc.h"
#include "core_impl.h"

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	char *buf = NULL;
	long n = -1;
	if (fseek(f, 0, SEEK_END) == 0)
		n = ftell(f);
	if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
	    (buf = malloc((size_t)n + 1))) {
		if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
			free(buf);
			buf = NULL;
		} else {
			buf[n] = 0;
		}
	}
	fclose(f);
	return buf;
}

int main(int argc, char **argv)
{
	int maj = 0, min = 0;
	if (!ej_nvrtc_version(&maj, &min)) {
		printf("SKIP: no NVRTC\n");
		return 77;
	}
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return 1;
	char archs[8][EJ_CUDA_ARCH_MAX];
	int n_archs = ej_cuda_archs(ctx, archs, 8);
	if (n_archs < 1) {
		fprintf(stderr, "nvrtc_units: %s\n", epj_ctx_error(ctx));
		return 1;
	}
	int bad = 0, n = 0;
	for (int i = 1; i < argc; i++) {
		char *src = slurp(argv[i]);
		if (!src) {
			fprintf(stderr, "nvrtc_units: cannot read %s\n",
				argv[i]);
			bad++;
			continue;
		}
		const char *base = strrchr(argv[i], '/');
		base = base ? base + 1 : argv[i];
		for (int a = 0; a < n_archs; a++) {
			ej_nvrtc_result r = { 0 };
			epj_status st = ej_nvrtc_compile(ctx, src, base,
							 archs[a], NULL, 0, &r);
			if (st != EPJ_OK) {
				fprintf(stderr, "nvrtc_units: %s for %s: %s\n",
					argv[i], archs[a], epj_ctx_error(ctx));
				epj_ctx_clear_error(ctx);
				bad++;
			} else if (r.log && ej_nvrtc_log_has_warning(r.log)) {
				fprintf(stderr,
					"nvrtc_units: %s for %s compiles with "
					"warnings:\n%s\n",
					argv[i], archs[a], r.log);
				bad++;
			}
			ej_nvrtc_result_free(&r);
		}
		free(src);
		n++;
	}
	printf("nvrtc_units: %d units for %d arch%s, %d failed\n", n, n_archs,
	       n_archs == 1 ? "" : "s", bad);
	epj_ctx_free(ctx);
	return bad ? 1 : 0;
}
