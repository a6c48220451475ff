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
# step (median) and the GEMM op time per step, then each arm's medians,
# spread and B / A (bench/ab_eager.sh).  Exits 1 without AMX on this CPU
# (B would equal A).
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
run_arm() {
	if [ "$1" = A ]; then amx=0; else amx=1; fi
	shift
	LD_LIBRARY_PATH=$build/.libs EPJIT_PROFILE=1 EPJIT_CPU_AMX=$amx \
	    "$bin" "$@" >"$tmp/out" 2>&1
}
. "$(dirname "$0")/ab_eager.sh"
echo "A: EPJIT_CPU_AMX=0 (f32 path); B: AMX tiles"
ab_rounds "$rounds" "$@"
