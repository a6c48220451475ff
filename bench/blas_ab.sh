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
# (median) and the GEMM op time per step, then each arm's medians and B / A.
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
: >"$tmp/rows"
arm() {
	a=$1
	shift
	if [ "$a" = B ]; then
		LD_LIBRARY_PATH=$build/.libs LD_PRELOAD=$lib EPJIT_PROFILE=1 \
		    "$bin" "$@" >"$tmp/out" 2>&1
	else
		LD_LIBRARY_PATH=$build/.libs EPJIT_PROFILE=1 \
		    "$bin" "$@" >"$tmp/out" 2>&1
	fi || { cat "$tmp/out" >&2; exit 1; }
	cpu=$(sed -n 's/.*CPU time \/ step, median (ms) *| *\([0-9.]*\).*/\1/p' "$tmp/out")
	gemm=$(sed -n 's/.*GEMM ops \/ step (ms) *| *\([0-9.]*\).*/\1/p' "$tmp/out")
	echo "$a ${cpu:-?} ${gemm:-?}" | tee -a "$tmp/rows"
}
echo "A: as linked; B: LD_PRELOAD=$lib"
echo "arm cpu_ms_per_step gemm_ms_per_step"
r=0
while [ "$r" -lt "$rounds" ]; do
	r=$((r + 1))
	arm A "$@"
	arm B "$@"
	arm B "$@"
	arm A "$@"
done
awk '
function med(v, n,   i, j, t) {
	for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
		if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
	return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
}
{ if ($1 == "A") { ca[++na] = $2; ga[na] = $3 } else { cb[++nb] = $2; gb[nb] = $3 } }
END {
	mca = med(ca, na); mcb = med(cb, nb); mga = med(ga, na); mgb = med(gb, nb)
	printf "median CPU ms/step: A %.1f  B %.1f  B/A %.3f\n", mca, mcb, mcb / mca
	if (mga > 0)
		printf "median GEMM op ms/step: A %.1f  B %.1f  B/A %.3f\n", mga, mgb, mgb / mga
}' "$tmp/rows"
