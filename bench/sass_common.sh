# sass_common.sh -- sourced by bench/attn_sass.sh and bench/moe_sass.sh:
# from BUILD_DIR ($1) and an optional cuobjdump ($2) sets B, SRC, OBJ, the
# temporary folder T (removed on exit) and LIBS (the library's link
# dependencies), and builds "$T/tmpl_cubin" from bench/tmpl_cubin.c.
B=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
OBJ=${2:-$(command -v cuobjdump || ls /work/venv-golden/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump 2>/dev/null | head -1)}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
LIBS=$(sed -n "s/^dependency_libs='\(.*\)'/\1/p" "$B/libepjit.la" |
	sed 's/-R\([^ ]*\)/-Wl,-rpath,\1/g')
${CC:-gcc} -std=gnu11 -fopenmp -I"$B" -I"$SRC/lib" -I"$SRC/jit" \
	-I"$SRC/kernels" -I"$SRC/runtime" -I"$SRC" "$SRC/bench/tmpl_cubin.c" \
	"$B/.libs/libepjit.a" $LIBS -ldl -lpthread -o "$T/tmpl_cubin"
