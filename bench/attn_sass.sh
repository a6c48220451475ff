#!/bin/sh
# attn_sass.sh -- what the GPU would run for the attention template
# (templates/attention.cuh): compiles it for sm_90 through the library's
# NVRTC path (as the cuda device does) for each instantiation below (dtype
# EJ_ATTN_DT: 0 f32, 1 bf16; EJ_ATTN_DL: head dims up to 32 DL), prints
# ptxas's report (registers, stack frame, spills per kernel) and, per
# kernel, the SASS instruction mix: tensor-core instructions (HMMA), FFMA,
# shared loads (LDS, LDSM = ldmatrix) and global loads/stores by width.
#
#   bench/attn_sass.sh BUILD_DIR [CUOBJDUMP]
#
# BUILD_DIR: a configured and built tree (its .libs/libepjit.a and config.h);
# CUOBJDUMP: cuobjdump to use (default: first on PATH, else Triton's).
set -eu
B=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
OBJ=${2:-$(command -v cuobjdump || ls /work/venv-golden/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump 2>/dev/null | head -1)}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
LIBS=$(sed -n "s/^dependency_libs='\(.*\)'/\1/p" "$B/libepjit.la" |
	sed 's/-R\([^ ]*\)/-Wl,-rpath,\1/g')
cat >"$T/dump.c" <<'C'
#include "config.h"
#include "cc.h"
#include "jit_impl.h"
#include "tmpl.h"
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv)
{
	epj_ctx *ctx = NULL;
	if (argc < 4 || epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return 1;
	char defs[96];
	snprintf(defs, sizeof defs,
		 "#define EJ_ATTN_DT %d\n#define EJ_ATTN_DL %d", atoi(argv[1]),
		 atoi(argv[2]));
	ej_arena *A = ej_arena_new();
	const char *src = ej_tmpl_source(ctx, A, "attention", defs);
	const char *opts[] = { EJ_NVRTC_OPT_PTXAS_REPORT };
	ej_nvrtc_result r = { 0 };
	if (!src || ej_nvrtc_compile(ctx, src, "attention", "sm_90", opts, 1,
				     &r) != EPJ_OK || r.is_ptx) {
		fprintf(stderr, "%s\n", epj_ctx_error(ctx));
		return 1;
	}
	fputs(r.log, stdout);
	FILE *f = fopen(argv[3], "wb");
	if (!f || fwrite(r.image, 1, r.size, f) != r.size || fclose(f))
		return 1;
	return 0;
}
C
${CC:-gcc} -std=gnu11 -fopenmp -I"$B" -I"$SRC/lib" -I"$SRC/jit" \
	-I"$SRC/runtime" -I"$SRC" "$T/dump.c" "$B/.libs/libepjit.a" \
	$LIBS -ldl -lpthread -o "$T/dump"
for inst in "1 4" "1 6" "1 8" "0 4"; do
	set -- $inst
	echo "== EJ_ATTN_DT $1 ($([ "$1" = 1 ] && echo bf16 || echo f32))," \
		"EJ_ATTN_DL $2 (head dims up to $((32 * $2)))"
	"$T/dump" "$1" "$2" "$T/a.cubin" |
		grep -E "Compiling entry|registers|stack frame" |
		sed -e 's/ptxas info    : //' -e "s/for 'sm_90'//"
	echo "kernel: SASS instruction mix"
	"$OBJ" -sass "$T/a.cubin" | awk '
function flush() { if (k == "") return; s = ""; n = split("HMMA FFMA LDSM LDS LDG STG", o, " ");
  for (i = 1; i <= n; i++) { s = s " " o[i] "=" (c[o[i]] + 0) }
  for (w in wd) s = s " " w "=" wd[w]; print k ":" s; delete c; delete wd }
/Function :/ { flush(); k = $3 }
/ HMMA\./ { c["HMMA"]++ }
/ FFMA / { c["FFMA"]++ }
/ LDSM\./ { c["LDSM"]++ }
/ LDS[. ]/ { c["LDS"]++; if (match($0, /LDS\.[0-9]+/)) wd[substr($0, RSTART, RLENGTH)]++ }
/ (LDG|STG)\.E/ { if (match($0, /(LDG|STG)\.E[.A-Z0-9]*/)) { x = substr($0, RSTART, RLENGTH); c[substr(x, 1, 3)]++; wd[x]++ } }
END { flush() }'
	echo
done
