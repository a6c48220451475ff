#!/bin/sh
# bench/delta_kernels.sh -- what the GPU would run for the gated delta rule
# (templates/delta.cuh): ptxas's registers, stack frame and spills of every
# instantiation at sm_90 (NVRTC, through the ptxas suite), then the launch
# geometry of kernels/tmpl_delta.c at Qwen3.5-MoE's linear attention shapes
# (32 value heads, Dk = Dv = 128) for a few batches and sequence lengths:
# blocks of each kernel, the blocks an SM holds by registers (65536 a
# SM, 128 threads a block, at most 16 blocks), the backward's segment
# length and its scratch.  No GPU needed.  Usage, from the source root:
#
#   sh bench/delta_kernels.sh [BUILD_DIR]     (default: build)
#
# The geometry below mirrors tmpl_delta.c (COLS 8, CK 64, PART_BUDGET
# 256 MiB, SUM_THREADS 256); change both together.
set -eu
build=${1:-build}
rows=$(cd "$build" && CK_FORK=no CK_RUN_SUITE=ptxas CK_RUN_CASE=templates \
	top_srcdir=.. top_builddir=. ./t/check_epjit 2>&1 | grep '^delta')
echo "ptxas sm_90 (NVRTC), templates/delta.cuh; bytes per thread"
echo "| unit | kernel | regs | stack | spill st/ld | blocks/SM by regs |"
echo "|---|---|---:|---:|---:|---:|"
echo "$rows" | awk '{
	regs = $5; r = int((regs + 7) / 8) * 8 * 128; b = int(65536 / r);
	if (b > 16) b = 16;
	printf "| %s %s %s | %s | %d | %d | %d/%d | %d |\n", $1, $2, $3, $4,
	       regs, $6, $7, $8, b }'

echo
echo "Launch geometry at H = 32, Dk = Dv = 128 (f32 compute: bf16 or f32)"
echo "| B | T | fwd/keep/seg blocks | segments x steps | sum blocks | scratch MiB |"
echo "|---:|---:|---:|---:|---:|---:|"
H=32 Dk=128 Dv=128 cs=4
for B in 1 2 4 8; do
	for T in 1024 4096; do
		nt=$(((Dv + 7) / 8))
		nw=$((2 * Dk + 2))
		nck=$(((T + 63) / 64))
		per=$((nt * B * H * nw * cs))
		seg=$(((268435456 / per) / 64 * 64))
		[ "$seg" -lt 64 ] && seg=64
		[ "$seg" -gt $((nck * 64)) ] && seg=$((nck * 64))
		nseg=$(((T + seg - 1) / seg))
		sum=$(((B * seg * H * nw + 255) / 256))
		[ "$sum" -gt 65535 ] && sum=65535
		ss=$((Dk * Dv))
		elems=$((B * H * ss * (nck + 64 + 2) + nt * B * seg * H * nw))
		echo "| $B | $T | $((B * H * nt)) | $nseg x $seg | $sum |" \
			"$((elems * cs / 1048576)) |"
	done
done
