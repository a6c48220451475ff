#!/bin/sh
# bench/amx_ab.sh -- bf16 GEMMs on the CPU's AMX tiles against the f32 path
# (widen, then sgemm), on the bench model's own step, side by side in one
# session.
#
#   sh bench/amx_ab.sh BUILD [ROUNDS] [bench-eager flags...]
#
# Runs ROUNDS (default 2) rounds of BUILD/bench/bench-eager, each round in
# the order A B B A: A with EPJIT_CPU_AMX=0 (the f32 path), B as it runs by
# default (the tiles, lib/gemm_amx.c, where the CPU has AMX-BF16).  The
# bench config is bf16 (bench/configs/bench-ds.json).  One thread.
# EPJIT_PROFILE=1 adds the time of the GEMM ops (linear, matmul, gemm_add,
# moe_grouped_mm and its weight gradient).  Prints per run the CPU time per
# step (median) and the GEMM op time per step, then each arm's medians and
# B / A.  Exits 1 without AMX on this CPU (B would equal A).
build=${1:?usage: bench/amx_ab.sh BUILD [ROUNDS] [bench-eager flags...]}
rounds=${2:-2}
[ $# -ge 2 ] && shift 2 || shift 1
build=$(cd "$build" && pwd) || exit 2
grep -q amx_bf16 /proc/cpuinfo ||
	{ echo "amx_ab.sh: this CPU has no AMX-BF16" >&2; exit 1; }
bin=$build/bench/.libs/bench-eager
[ -x "$bin" ] || bin=$build/bench/bench-eager
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-amx-ab.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
: >"$tmp/rows"
arm() {
	a=$1
	shift
	if [ "$a" = A ]; then amx=0; else amx=1; fi
	LD_LIBRARY_PATH=$build/.libs EPJIT_PROFILE=1 EPJIT_CPU_AMX=$amx \
	    "$bin" "$@" >"$tmp/out" 2>&1 || { cat "$tmp/out" >&2; exit 1; }
	cpu=$(sed -n 's/.*CPU time \/ step, median (ms) *| *\([0-9.]*\).*/\1/p' "$tmp/out")
	gemm=$(sed -n 's/.*GEMM ops \/ step (ms) *| *\([0-9.]*\).*/\1/p' "$tmp/out")
	echo "$a ${cpu:-?} ${gemm:-?}" | tee -a "$tmp/rows"
}
echo "A: EPJIT_CPU_AMX=0 (f32 path); B: AMX tiles"
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
function spread(v, n,   i, lo, hi) {
	lo = hi = v[1]
	for (i = 2; i <= n; i++) { if (v[i] < lo) lo = v[i]; if (v[i] > hi) hi = v[i] }
	return sprintf("%.1f-%.1f", lo, hi)
}
{ if ($1 == "A") { ca[++na] = $2; ga[na] = $3 } else { cb[++nb] = $2; gb[nb] = $3 } }
END {
	sa = spread(ca, na); sb = spread(cb, nb)
	mca = med(ca, na); mcb = med(cb, nb); mga = med(ga, na); mgb = med(gb, nb)
	printf "median CPU ms/step: A %.1f (%s)  B %.1f (%s)  B/A %.3f\n", mca, sa, mcb, sb, mcb / mca
	if (mga > 0)
		printf "median GEMM op ms/step: A %.1f  B %.1f  B/A %.3f\n", mga, mgb, mgb / mga
}' "$tmp/rows"
