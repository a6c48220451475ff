#!/bin/sh
# bench/blas_ab.sh -- the linked BLAS against another CBLAS library, on the
# bench model's own GEMMs, side by side in one session.
#
#   sh bench/blas_ab.sh BUILD LIB [ROUNDS] [bench-eager flags...]
#
# Runs ROUNDS (default 2) rounds of BUILD/bench/bench-eager, each round in
# the order A B B A: A is the library as linked (OpenBLAS on Debian), B is
# the same binary with LIB preloaded (a shared library exporting
# cblas_sgemm/cblas_dgemm, e.g. BLIS from libblis4-serial:
# /usr/lib/x86_64-linux-gnu/blis-serial/libblis.so.4), so every cblas_*
# call of libepjit resolves to LIB and nothing else changes.  One thread
# (OMP/BLAS/BLIS).  EPJIT_PROFILE=1 adds the time of the GEMM ops (linear,
# matmul, gemm_add, moe_grouped_mm and its weight gradient; a bf16 linear's
# input conversion included).  Prints per run the CPU time per step
# (median) and the GEMM op time per step, then each arm's medians, spread
# and B / A (bench/ab_eager.sh).
build=${1:?usage: bench/blas_ab.sh BUILD LIB [ROUNDS] [bench-eager flags...]}
lib=${2:?usage: bench/blas_ab.sh BUILD LIB [ROUNDS] [bench-eager flags...]}
rounds=${3:-2}
[ $# -ge 3 ] && shift 3 || shift 2
build=$(cd "$build" && pwd) || exit 2
[ -r "$lib" ] || { echo "blas_ab.sh: $lib: no such library" >&2; exit 2; }
bin=$build/bench/.libs/bench-eager
[ -x "$bin" ] || bin=$build/bench/bench-eager
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
BLIS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS BLIS_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-blas-ab.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
run_arm() {
	a=$1
	shift
	if [ "$a" = B ]; then
		LD_LIBRARY_PATH=$build/.libs LD_PRELOAD=$lib EPJIT_PROFILE=1 \
		    "$bin" "$@" >"$tmp/out" 2>&1
	else
		LD_LIBRARY_PATH=$build/.libs EPJIT_PROFILE=1 \
		    "$bin" "$@" >"$tmp/out" 2>&1
	fi
}
. "$(dirname "$0")/ab_eager.sh"
echo "A: as linked; B: LD_PRELOAD=$lib"
ab_rounds "$rounds" "$@"
