#!/bin/sh
# moe_sass.sh -- what the GPU would run for the MoE template (templates/
# moe.cuh): compiles it for sm_90 through the library's NVRTC path (as the
# cuda device does), prints ptxas's report (registers, stack frame, spills
# per kernel) and, per kernel, the global load/store widths of its SASS;
# then the kernels that one SwiGLU forward and backward launch on a
# cuda-sim context (the same eager rows as on cuda), bf16 and f32.
#
#   bench/moe_sass.sh BUILD_DIR [CUOBJDUMP]
#
# BUILD_DIR: a configured and built tree (its .libs/libepjit.a and config.h);
# CUOBJDUMP: cuobjdump to use (default: first on PATH, else Triton's).
set -eu
. "$(dirname "$0")/sass_common.sh"
"$T/tmpl_cubin" moe "" "$T/moe.cubin" | grep -E "Compiling entry|registers|stack frame" |
	sed -e 's/ptxas info    : //' -e "s/for 'sm_90'//"
echo
echo "kernel: global loads/stores by width (SASS)"
"$OBJ" -sass "$T/moe.cubin" | awk '
function flush() { if (k == "") return; s = ""; for (o in c) s = s " " o "=" c[o]; print k ":" s; delete c }
/Function :/ { flush(); k = $3 }
/(LDG|STG)\.E/ { if (match($0, /(LDG|STG)\.E[.A-Z0-9]*/)) c[substr($0, RSTART, RLENGTH)]++ }
END { flush() }'

cat >"$T/swiglu.c" <<'C'
#include "config.h"
#include "core_impl.h"
#include "ops_impl.h"
#include "ops_moe.h"
#include <stdio.h>
static long long launches(epj_ctx *c)
{
	return epj_counter_get(c, "kernels.launched.eager_cuda") +
	       epj_counter_get(c, "kernels.launched.template");
}
int main(void)
{
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cuda-sim", &ctx) != EPJ_OK)
		return 1;
	int64_t sh[2] = { 64, 768 };
	const epj_dtype dts[2] = { EPJ_DTYPE_BF16, EPJ_DTYPE_F32 };
	for (int d = 0; d < 2; d++) {
		epj_tensor *in[3], *o[2];
		for (int i = 0; i < 3; i++)
			in[i] = epj_zeros(ctx, dts[d], 2, sh);
		long long l0 = launches(ctx);
		epj_tensor *y = ej_swiglu(ctx, in[1], in[2]);
		long long l1 = launches(ctx);
		if (!y || ej_dispatch(ctx, EJ_OP_SWIGLU_BACKWARD, in, 3, NULL,
				      o, 2) != EPJ_OK)
			return 1;
		printf("%s swiglu launches: forward %lld, backward %lld\n",
		       epj_dtype_name(dts[d]), l1 - l0, launches(ctx) - l1);
	}
	return 0;
}
C
echo
${CC:-gcc} -std=gnu11 -fopenmp -I"$B" -I"$SRC/lib" -I"$SRC/jit" \
	-I"$SRC/kernels" \
	"$T/swiglu.c" -Wl,--whole-archive "$B/.libs/libepjit.a" \
	-Wl,--no-whole-archive $LIBS -ldl -lpthread -o "$T/swiglu"
EPJIT_CACHE_DIR="$T/cache" "$T/swiglu"
