#!/bin/sh
# t/sim_parity.sh -- the trainer's compiled regions on cuda-sim: their
# generated CUDA C runs in the simulator (race check and poisoned outputs
# on) and must match eager execution.
#
# `EPJIT_DEVICE=cuda-sim epjit-train --compile --parity` for the nested and
# root layouts x checkpointing off/on x f32/bf16.  Both arms' contexts are
# on cuda-sim, so the eager ops (the eager arm, the AutoEP layer, extern
# nodes and backward formulas) run as eager CUDA kernels too.  The f32 runs
# share one fresh kernel cache and the bf16 runs another (an eager module
# costs a C++ compile; the first run of each dtype builds them), which
# must then hold cuda-sim modules (proof that the compiled arm ran on the
# simulator).  Then two training steps with "device": "cuda-sim" in the
# config and one with --device cuda-sim (same shapes, same cache); the
# counters of both must show eager CUDA kernels and no CPU fallback at
# all (every op of the model has a CUDA kernel).  Exit 77 (SKIP) only when the
# trainer was not built.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
if [ ! -x "$TRAIN" ]; then
	echo "SKIP: $TRAIN not built"
	exit 77
fi
OMP_NUM_THREADS=1
export OMP_NUM_THREADS
unset EPJIT_SIM_RACECHECK EPJIT_SIM_POISON
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-sim-parity.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT

# modules DIR: how many cuda-sim modules the kernel cache DIR holds
modules() {
	grep -rl "ej_sim_epjk_0" "$1" 2>/dev/null | wc -l
}

# EPJIT_CHECK_QUICK (doc/testing.md): a third of the eight combinations,
# a window drawn from EPJIT_TEST_SEED (else the clock)
quick=0
case ${EPJIT_CHECK_QUICK:-0} in 0 | "") ;; *) quick=1 ;; esac
off=$(( ${EPJIT_TEST_SEED:-$(date +%s)} % 6 ))
n=0 ran=0
for layout in nested root; do
	for ckpt in "" --checkpointing; do
		for bf16 in "" --bf16; do
			n=$((n + 1))
			if [ $quick = 1 ] && { [ $n -le $off ] ||
				[ $n -gt $((off + 3)) ]; }; then
				echo "skip: $layout $ckpt $bf16 (EPJIT_CHECK_QUICK)"
				continue
			fi
			cache="$tmp/cache-f32"
			[ -n "$bf16" ] && cache="$tmp/cache-bf16"
			if ! EPJIT_DEVICE=cuda-sim EPJIT_CACHE_DIR="$cache" \
			    "$TRAIN" --compile --parity --layout "$layout" \
			    $ckpt $bf16 >"$tmp/log" 2>&1; then
				echo "FAIL: parity on cuda-sim: $layout $ckpt $bf16"
				cat "$tmp/log"
				exit 1
			fi
			m=$(modules "$cache")
			if [ "$m" -lt 1 ]; then
				echo "FAIL: $layout $ckpt $bf16: no cuda-sim module built"
				exit 1
			fi
			echo "ok: parity on cuda-sim: $layout $ckpt $bf16 ($m modules)"
			ran=$((ran + 1))
		done
	done
done

# check_eager LOG WHAT: the run's counters show eager CUDA kernels and no
# op that fell back to the CPU
check_eager() {
	cuda=$(awk '$1 == "kernels.eager_cuda" { print $2 }' "$1")
	if [ -z "$cuda" ] || [ "$cuda" -lt 1 ]; then
		echo "FAIL: $2 ran no eager CUDA kernel"
		cat "$1"
		exit 1
	fi
	fell=$(awk '$1 ~ /^kernels\.eager_cpu_fallback/ && $2 > 0 {
		printf " %s=%s", $1, $2 }' "$1")
	if [ -n "$fell" ]; then
		echo "FAIL: $2: eager ops fell back to the CPU:$fell"
		exit 1
	fi
	echo "ok: $2: $cuda eager ops ran as CUDA kernels"
}

cfg="$tmp/ds.json"
cat >"$cfg" <<JSON
{"train_micro_batch_size_per_gpu": 2, "device": "cuda-sim",
 "compile": {"autoep_non_moe": true}}
JSON
if ! EPJIT_CACHE_DIR="$tmp/cache-cfg" "$TRAIN" --config "$cfg" --compile \
    --steps 2 --seq 9 >"$tmp/log" 2>&1; then
	echo "FAIL: training with \"device\": \"cuda-sim\""
	cat "$tmp/log"
	exit 1
fi
[ "$(modules "$tmp/cache-cfg")" -ge 1 ] || {
	echo "FAIL: \"device\": \"cuda-sim\" built no cuda-sim module"
	exit 1
}
check_eager "$tmp/log" '"device": "cuda-sim"'
# --device with the same shapes (the eager modules are in that cache now)
cat >"$cfg" <<JSON
{"train_micro_batch_size_per_gpu": 2, "compile": {"autoep_non_moe": true}}
JSON
if ! EPJIT_CACHE_DIR="$tmp/cache-cfg" "$TRAIN" --config "$cfg" \
    --device cuda-sim --compile --steps 1 --seq 9 >"$tmp/log" 2>&1; then
	echo "FAIL: training with --device cuda-sim"
	cat "$tmp/log"
	exit 1
fi
check_eager "$tmp/log" "--device cuda-sim"
echo "sim_parity: $ran of $n parity runs on cuda-sim passed; config and flag select it"
