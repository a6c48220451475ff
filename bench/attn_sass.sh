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
. "$(dirname "$0")/sass_common.sh"
for inst in "1 4" "1 6" "1 8" "0 4"; do
	set -- $inst
	echo "== EJ_ATTN_DT $1 ($([ "$1" = 1 ] && echo bf16 || echo f32))," \
		"EJ_ATTN_DL $2 (head dims up to $((32 * $2)))"
	"$T/tmpl_cubin" attention "#define EJ_ATTN_DT $1
#define EJ_ATTN_DL $2" "$T/a.cubin" |
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
