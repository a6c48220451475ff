#!/bin/sh
# t/train.sh -- epjit-train end to end (make check sets top_builddir and
# top_srcdir; by hand: top_builddir=BUILD top_srcdir=SRC sh t/train.sh).
#
#  1. the default run (fewer steps) exits 0 and its loss falls clearly;
#     the root layout with activation checkpointing trains too;
#  2. resume identity: 10 steps + save, load + 10 more == 20 steps: the
#     last metrics lines (step, loss, lr, grad_norm) and the checkpoints are
#     byte-identical, in f32 (built-in config) and in bf16 with gradient
#     accumulation (a config written here);
#  3. --dump-state writes the expected tensors (read back with the hidden
#     --list-safetensors flag), is deterministic, and works after --load of
#     a training checkpoint and (when python3 is there to make one) of a
#     plain f32 HF safetensors file;
#  4. bad inputs exit 1 with a message naming the file or key (a FIFO as any
#     input file is refused, not waited on; sizes past their range say the
#     range); a bad command line exits 2; --device cuda without a CUDA
#     driver exits 1 with the driver's message.
# Exit 77 (SKIP) when the trainer was not built.  One thread each, so the
# timings do not depend on how loaded the machine is (about 20 s in all).

# Absolute paths: the test works in a temporary directory.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
if [ ! -x "$TRAIN" ]; then
	echo "SKIP: $TRAIN not built"
	exit 77
fi
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS

tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-train-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

# run LOG ARGS...: runs the trainer with output in LOG; fails unless exit 0.
run() {
	log=$1
	shift
	if ! "$TRAIN" "$@" >"$log" 2>&1; then
		cat "$log" >&2
		fail "epjit-train $* exited non-zero"
	fi
}

# expect_fail CODE WORD ARGS...: the trainer must exit CODE and its stderr
# must name WORD (and, for exit 1, start with "epjit-train: ").
expect_fail() {
	code=$1
	word=$2
	shift 2
	"$TRAIN" "$@" >out.txt 2>err.txt
	rc=$?
	[ "$rc" -eq "$code" ] ||
		fail "epjit-train $*: exit $rc, expected $code: $(cat err.txt)"
	grep -q -F -- "$word" err.txt ||
		fail "epjit-train $*: message does not name '$word': $(cat err.txt)"
	if [ "$code" -eq 1 ]; then
		head -n 1 err.txt | grep -q '^epjit-train: ' ||
			fail "epjit-train $*: message lacks the prefix: $(cat err.txt)"
	fi
}

# last_fields CSV: step,loss,lr,grad_norm of the last line (the other two
# columns are timings and allocator peaks, which may differ).
last_fields() {
	tail -n 1 "$1" | cut -d, -f1-4
}

# ---- 1. the default run ------------------------------------------------------
run default.log --steps 60 --metrics default.csv
head -n 1 default.csv |
	grep -q '^step,loss,lr,grad_norm,tokens_per_s,peak_alloc_bytes,step_ms,compile_ms,entropy_floor$' ||
	fail "metrics header: $(head -n 1 default.csv)"
[ "$(wc -l <default.csv)" -eq 61 ] ||
	fail "metrics: expected 60 rows, got $(($(wc -l <default.csv) - 1))"
first=$(sed -n 2p default.csv | cut -d, -f2)
last=$(tail -n 1 default.csv | cut -d, -f2)
# ln(64) = 4.16 at the start; the floor of the source is about 1 nat.
awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f - 1.0) }' ||
	fail "loss did not fall clearly in 60 steps: $first -> $last"
grep -q 'entropy floor' default.log || fail "no entropy floor in the summary"
grep -q 'autoep.calls.forward' default.log || fail "no counters in the summary"

run root.log --steps 3 --seq 16 --layout root --checkpointing --threads 1
grep -q 'root layout' root.log || fail "root layout not reported"
grep -q 'autoep.calls.replay' root.log ||
	fail "checkpointing did not replay the AutoEP layer"

# ---- 2. resume identity ----------------------------------------------------------
# resume TAG ARGS...: A = 10 steps, save, load, 10 more; B = 20 steps.
resume() {
	tag=$1
	shift
	run "$tag-a1.log" "$@" --steps 10 --save "$tag-a1.ckpt" \
		--metrics "$tag-a1.csv"
	run "$tag-a2.log" "$@" --steps 20 --load "$tag-a1.ckpt" \
		--save "$tag-a2.ckpt" --metrics "$tag-a2.csv"
	run "$tag-b.log" "$@" --steps 20 --save "$tag-b.ckpt" \
		--metrics "$tag-b.csv"
	[ "$(last_fields "$tag-a2.csv")" = "$(last_fields "$tag-b.csv")" ] ||
		fail "$tag: resumed metrics differ: $(last_fields "$tag-a2.csv") vs $(last_fields "$tag-b.csv")"
	tail -n 10 "$tag-b.csv" | cut -d, -f1-4 >"$tag-b10.txt"
	sed 1d "$tag-a2.csv" | cut -d, -f1-4 >"$tag-a10.txt"
	cmp -s "$tag-a10.txt" "$tag-b10.txt" ||
		fail "$tag: steps 11..20 differ after resume"
	cmp "$tag-a2.ckpt" "$tag-b.ckpt" ||
		fail "$tag: resumed checkpoint differs from the straight run"
}
resume f32 --seq 16
# A checkpoint at or past --steps: nothing to train, said so, exit 0, and
# the checkpoint and metrics of a --save/--metrics are not touched.
cp f32-a1.ckpt done.ckpt
run done.log --seq 16 --steps 7 --load done.ckpt --save done.ckpt \
	--metrics done.csv
grep -q 'is at step 10, --steps is 7: nothing left to train' done.log ||
	fail "a finished run's resume did not say so: $(cat done.log)"
cmp -s done.ckpt f32-a1.ckpt || fail "a resume with nothing to train rewrote the checkpoint"
[ ! -e done.csv ] || fail "a resume with nothing to train wrote metrics"

cat >bf16.json <<'EOF'
{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "steps_per_print": 5,
  "seed": 7,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0,
    "warmup_max_lr": 0.003, "warmup_num_steps": 5, "warmup_type": "linear",
    "total_num_steps": 40}},
  "gradient_clipping": 1.0
}
EOF
resume bf16 --seq 16 --config bf16.json
grep -q 'bf16, seed 7' bf16-b.log || fail "bf16 run: config seed or bf16 not used"

# ---- 3. --dump-state ---------------------------------------------------------------
run d1.log --dump-state d1.st --seq 8
run d2.log --dump-state d2.st --seq 8
cmp d1.st d2.st || fail "--dump-state is not deterministic"
"$TRAIN" --list-safetensors d1.st >d1.txt 2>&1 || fail "list: $(cat d1.txt)"
for want in 'input_ids I64 [8,8]' 'labels I64 [8,8]' 'logits F32 [8,8,64]' \
	'loss F32 []' 'model.embed_tokens.weight.grad F32 [64,32]' \
	'model.layers.0.self_attn.q_proj.weight.grad F32 [32,32]' \
	'model.layers.1.mlp.gate.weight.grad F32 [4,32]' \
	'model.layers.1.mlp.experts.3.down_proj.weight.grad F32 [32,32]' \
	'model.norm.weight.grad F32 [32]' 'lm_head.weight.grad F32 [64,32]' \
	'lm_head.weight F32 [64,32]'; do
	grep -q -x -F "$want" d1.txt || fail "dump lacks '$want'"
done
ngrad=$(grep -c '\.grad F32 ' d1.txt)
nparam=$(grep -c '\.weight F32 ' d1.txt)
if [ "$ngrad" -ne "$nparam" ] || [ "$ngrad" -eq 0 ]; then
	fail "dump: $ngrad gradients for $nparam parameters"
fi

# bf16 parameters: everything is still written as f32.
run d3.log --dump-state d3.st --seq 8 --config bf16.json --load bf16-b.ckpt
"$TRAIN" --list-safetensors d3.st >d3.txt 2>&1 || fail "list: $(cat d3.txt)"
grep -q -x -F 'logits F32 [4,8,64]' d3.txt || fail "bf16 dump: $(cat d3.txt)"
grep -q 'BF16' d3.txt && fail "bf16 dump holds bf16 tensors"

# A plain HF f32 file: the training checkpoint without "optimizer.*".
if command -v python3 >/dev/null 2>&1; then
	python3 - f32-b.ckpt hf.safetensors <<'EOF' || fail "python3 could not write hf.safetensors"
import json, struct, sys
src, dst = sys.argv[1], sys.argv[2]
with open(src, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    hdr = json.loads(f.read(n))
    data = f.read()
out, blobs, off = {}, [], 0
for name in sorted(k for k in hdr if k != "__metadata__"):
    if name.startswith("optimizer."):
        continue
    e = hdr[name]
    b = data[e["data_offsets"][0]:e["data_offsets"][1]]
    out[name] = {"dtype": e["dtype"], "shape": e["shape"],
                 "data_offsets": [off, off + len(b)]}
    blobs.append(b)
    off += len(b)
h = json.dumps(out, separators=(",", ":")).encode()
h += b" " * (-len(h) % 8)
with open(dst, "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
EOF
	run d4.log --dump-state d4.st --seq 8 --load hf.safetensors
	python3 - hf.safetensors d4.st <<'EOF' || fail "--load of a plain HF file did not set the weights"
import json, struct, sys
def read(p):
    with open(p, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), f.read()
(ha, da), (hb, db) = read(sys.argv[1]), read(sys.argv[2])
for k in ("lm_head.weight", "model.layers.1.mlp.experts.2.up_proj.weight"):
    a, b = ha[k]["data_offsets"], hb[k]["data_offsets"]
    assert da[a[0]:a[1]] == db[b[0]:b[1]], k
EOF
else
	echo "note: python3 not found; skipping --load of a plain HF file"
fi

# ---- 4. bad inputs ---------------------------------------------------------------
expect_fail 1 missing.json --config missing.json --steps 1
printf '{"train_micro_batch_size_per_gpu": 2, "optimiser": {}}\n' >typo.json
expect_fail 1 optimiser --config typo.json --steps 1
head -c 100 f32-a1.ckpt >truncated.ckpt
expect_fail 1 truncated.ckpt --load truncated.ckpt --steps 1
printf 'NOTATOKFILE_____________________________________' >bad.tok
expect_fail 1 bad.tok --data bad.tok --steps 1
expect_fail 1 missing_model.json --model missing_model.json --steps 1
# Byte-level text has vocab 256: too many for the tiny model, fine for a
# model with a 256-token vocabulary.
cp "$srcdir/t/models/byte.json" text.txt
expect_fail 1 vocab_size --data text.txt --steps 1
run text.log --data text.txt --model "$srcdir/t/models/byte.json" --steps 2 \
	--seq 16
# A FIFO for any input file is refused at once (nobody writes to it, so
# opening it for reading would block forever).
if mkfifo fifo 2>/dev/null; then
	for opt in --load --config --model --data; do
		timeout 20 "$TRAIN" $opt fifo --steps 1 >out.txt 2>err.txt
		rc=$?
		[ "$rc" -eq 1 ] ||
			fail "epjit-train $opt fifo: exit $rc: $(cat err.txt)"
		grep -q 'not a regular file (a FIFO)' err.txt ||
			fail "epjit-train $opt fifo: $(cat err.txt)"
	done
fi
# Sizes near INT64_MAX go through checked arithmetic with the range.
expect_fail 2 '[1, 2147483647]' --seq 9223372036854775807
printf '{"train_micro_batch_size_per_gpu": 1048576}\n' >huge.json
expect_fail 1 'at most 1099511627776' --config huge.json --seq 2147483647 \
	--steps 1
expect_fail 2 --bogus --bogus
expect_fail 2 'cpu, cuda-sim or cuda' --device gpu0
# --device cuda without a driver: the driver's verdict and a clean exit 1
EPJIT_CUDA_DRIVER=/nonexistent/epjit/libcuda.so.1 "$TRAIN" --device cuda \
	--steps 1 >out.txt 2>err.txt
rc=$?
[ "$rc" -eq 1 ] || fail "--device cuda without a driver: exit $rc"
grep -q 'no CUDA driver (/nonexistent/epjit/libcuda.so.1 not found' \
	err.txt || fail "--device cuda without a driver: $(cat err.txt)"
grep -q '^epjit-train: cannot create a cuda context' err.txt ||
	fail "--device cuda without a driver: $(cat err.txt)"
expect_fail 2 --steps --steps many
expect_fail 2 --layout --layout sideways
"$TRAIN" --help >help.txt 2>&1 || fail "--help exited non-zero"
grep -q -- '--dump-state' help.txt || fail "--help lacks --dump-state"
echo "PASS: epjit-train"
exit 0
