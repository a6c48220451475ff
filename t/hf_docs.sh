#!/bin/sh
# t/hf_docs.sh -- packed documents against Hugging Face transformers' own
# golden files (t/golden/docs/<family>/, made by t/golden/hf_docs.py; no
# Python here).  Per family (Qwen3-MoE; DeepSeek-V3's latent attention with
# interleaved YaRN rope; Qwen3.5-MoE's Gated DeltaNet layers, whose state
# and conv window start anew at each document):
#
#  1. one forward and backward of a batch of rows of packed documents
#     (--dump-batch) with --reset-attention-mask --reset-position-ids
#     --eod-mask-loss --eod-token 1 matches what transformers gives for
#     every document alone, logits and the gradients of the per-token loss
#     (t/golden_cmp's tolerances, as t/hf_golden.sh), on the cpu eager and
#     compiled and on cuda-sim eager (compiled too for Qwen3-MoE; the
#     compiled arms ran compiled kernels); transformers' own f32 results
#     pass the same tolerances;
#  2. without --reset-attention-mask, or without --eod-mask-loss, the
#     comparison fails (the documents see each other; the EOD's next-token
#     loss counts).  Rope is shift invariant, so a document at other
#     positions is off by the rounding of the f32 tables only, below these
#     tolerances: suite docs checks the positions in f64;
#  3. training with the flags and --compile on the synthetic stream (token
#     1 ends documents wherever it falls, so each batch has other
#     boundaries) compiles every region once: no recompile.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
CMP="$builddir/t/golden_cmp"
[ -x "$TRAIN" ] && [ -x "$CMP" ] || {
	echo "FAIL: $TRAIN or $CMP not built" >&2
	exit 1
}
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS

tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-hfdocs-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1
EPJIT_CACHE_DIR="$tmp/cache"
export EPJIT_CACHE_DIR

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

DOCS="--reset-attention-mask --reset-position-ids --eod-mask-loss --eod-token 1"
nfam=0
for fam in qwen3_moe deepseek_v3 qwen3_5_moe; do
	dir="$srcdir/t/golden/docs/$fam"
	[ -f "$dir/golden.safetensors" ] || fail "$dir: no golden.safetensors"
	nfam=$((nfam + 1))
	# dump FLAGS...: one forward and backward of the golden batch
	dump() {
		out=$1
		shift
		"$TRAIN" --model "$dir/config.json" --load "$dir/model.safetensors" \
			--dump-batch "$dir/batch.safetensors" --dump-state "$out.st" \
			"$@" >"$out.log" 2>&1 || fail "$out: $(cat "$out.log")"
	}
	# 1. the golden comparisons
	for arm in cpu-eager cpu-compiled cuda-sim-eager cuda-sim-compiled; do
		[ $arm = cuda-sim-compiled ] && [ $fam != qwen3_moe ] && continue
		dev=${arm%-*}
		c=
		case $arm in *compiled) c=--compile ;; esac
		out="$fam-$arm"
		EPJIT_DEVICE=$dev dump "$out" $DOCS $c
		launches=$(sed -n 's/^dump-state: .* \([0-9]*\) compiled kernel launches .*/\1/p' "$out.log")
		[ -n "$launches" ] || fail "$out: no dump-state line: $(cat "$out.log")"
		if [ -n "$c" ]; then
			[ "$launches" -gt 0 ] || fail "$out: --compile ran no compiled kernel"
		fi
		"$CMP" "$dir/golden.safetensors" "$out.st" >"$out.cmp" 2>&1 ||
			fail "$out against transformers: $(cat "$out.cmp")"
		echo "$fam $arm: $(tail -n 1 "$out.cmp")"
	done
	"$CMP" "$dir/golden.safetensors" "$dir/f32.safetensors" \
		>"$fam-hf32.cmp" 2>&1 ||
		fail "$fam: transformers' own f32 results: $(cat "$fam-hf32.cmp")"
	echo "$fam transformers f32: $(tail -n 1 "$fam-hf32.cmp")"
	# 2. each flag is needed
	for drop in --reset-attention-mask --eod-mask-loss; do
		out="$fam-without$drop"
		# shellcheck disable=SC2086
		dump "$out" $(echo $DOCS | sed "s/$drop//")
		st=0
		"$CMP" "$dir/golden.safetensors" "$out.st" >"$out.cmp" 2>&1 || st=$?
		[ $st = 1 ] ||
			fail "$fam without $drop matches transformers: $(cat "$out.cmp")"
		echo "$fam without $drop, caught: $(tail -n 1 "$out.cmp")"
	done
done
[ "$nfam" = 3 ] || fail "$nfam golden families"
# 3. other boundaries every batch, one compile
"$TRAIN" --steps 4 --seq 24 --compile $DOCS >train.log 2>&1 ||
	fail "training with the flags: $(cat train.log)"
grep -q "batches: documents do not see each other, positions restart per document, no loss at end-of-document inputs, loss per token" train.log ||
	fail "no batches line: $(cat train.log)"
grep -q '^  recompiles ' train.log && fail "recompiled: $(cat train.log)"
grep -q '^  frames.precompiled ' train.log ||
	fail "nothing precompiled: $(cat train.log)"
[ "$(sed -n 's/^  frames.ok *//p' train.log)" = \
	"$(sed -n 's/^  frames.precompiled *//p' train.log)" ] ||
	fail "frames compiled after step 1: $(cat train.log)"
echo "hf_docs: $nfam families pass; 4 steps of other boundaries, no recompile"
