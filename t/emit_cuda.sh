#!/bin/sh
# t/emit_cuda.sh -- every CUDA C kernel generated for the test models
# compiles under NVRTC for sm_80, sm_90 and sm_100 with no warnings.
#
# epjit-train --emit-cuda traces every region of the built-in tiny model at
# an odd batch shape (micro-batch 3 x seq 13), lowers the forward and
# backward graph of every unique segment and writes their CUDA C; with
# --nvrtc-check each unit is compiled under NVRTC for every arch of
# EPJIT_CUDA_ARCH and any error or warning fails.  Matrix: nested and root
# layouts x f32 and bf16 x checkpointing off/on (checkpointing adds the
# no-grad variants), plus full-model mode.  The runs execute with the
# interpreter backend: emission needs only the graphs.  The first
# configuration runs with --nvrtc-check; the units of all twelve are then
# gathered by name (a unit is named by its graph signature, so a name is
# one unit: the files of one name must be identical) and t/nvrtc_units
# compiles each distinct unit once, as --nvrtc-check would: 30 distinct of
# 56 emitted.  Exit 77 (SKIP) only when the trainer was not built or the
# build has no NVRTC.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
UNITS="$builddir/t/nvrtc_units"
if [ ! -x "$TRAIN" ] || [ ! -x "$UNITS" ]; then
	echo "SKIP: $TRAIN not built"
	exit 77
fi
OMP_NUM_THREADS=1
EPJIT_CUDA_ARCH=sm_80,sm_90,sm_100
export OMP_NUM_THREADS EPJIT_CUDA_ARCH
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-emit-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT

units=0 check=--nvrtc-check
mkdir "$tmp/all" || exit 1
for mode in true false; do
	for bf16 in false true; do
		cfg="$tmp/ds-$mode-$bf16.json"
		cat >"$cfg" <<JSON
{"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": $bf16},
 "compile": {"autoep_non_moe": $mode, "backend": "interpreter"}}
JSON
		for layout in nested root; do
			for ckpt in "" --checkpointing; do
				[ "$mode" = false ] && [ -n "$ckpt" ] && continue
				out="$tmp/out-$mode-$bf16-$layout$ckpt"
				if ! "$TRAIN" --config "$cfg" --layout "$layout" \
				    $ckpt --seq 13 --emit-cuda "$out" \
				    $check >"$tmp/log" 2>&1; then
					if grep -q "has no NVRTC" "$tmp/log"; then
						echo "SKIP: built without NVRTC"
						exit 77
					fi
					echo "FAIL: autoep_non_moe=$mode bf16=$bf16" \
					    "$layout $ckpt:"
					cat "$tmp/log"
					exit 1
				fi
				n=$(ls "$out"/*.cu 2>/dev/null | wc -l)
				o=$(ls "$out"/*.opts 2>/dev/null | wc -l)
				if [ "$n" -lt 1 ] || [ "$n" -ne "$o" ]; then
					echo "FAIL: $out: $n .cu files, $o .opts"
					exit 1
				fi
				if ! grep -q "__global__" "$out"/*.cu; then
					echo "FAIL: $out: no kernel in the units"
					exit 1
				fi
				if [ -n "$check" ] &&
					! grep -q "each compiles under NVRTC without warnings" "$tmp/log"; then
					echo "FAIL: --nvrtc-check did not report: $(cat "$tmp/log")"
					exit 1
				fi
				for f in "$out"/*.cu; do
					g="$tmp/all/$(basename "$f")"
					if [ -f "$g" ] && ! cmp -s "$f" "$g"; then
						echo "FAIL: two units named $(basename "$f") differ"
						exit 1
					fi
					cp "$f" "$g" || exit 1
				done
				units=$((units + n))
				echo "ok: autoep_non_moe=$mode bf16=$bf16" \
				    "$layout $ckpt: $n units${check:+ (checked)}"
				check=
			done
		done
	done
done
distinct=$(ls "$tmp/all"/*.cu | wc -l)
"$UNITS" "$tmp/all"/*.cu >"$tmp/units.log" 2>&1
rc=$?
[ $rc -eq 77 ] && { echo "SKIP: built without NVRTC"; exit 77; }
[ $rc -eq 0 ] || { echo "FAIL: $(cat "$tmp/units.log")"; exit 1; }
grep -q "^nvrtc_units: $distinct units for 3 archs, 0 failed" "$tmp/units.log" || {
	echo "FAIL: $(cat "$tmp/units.log")"
	exit 1
}
echo "emit_cuda: $units units ($distinct distinct) compiled for $EPJIT_CUDA_ARCH without warnings"
