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
#     driver exits 1 with the driver's message;
#  5. stop signals, sent to a long run once its metrics file has 2 rows:
#     SIGTERM exits 143 after a save whose checkpoint resumes at the next
#     step, exactly as a straight run; SIGUSR1 saves, prints the resume
#     hint and exits 0; SIGINT exits 130 and leaves --save as it was; a
#     second signal while stopping exits at once (128 + its number),
#     leaving --save as it was or whole; no signal leaves a cut metrics row;
#     SIGHUP saves and exits 129; a stdout whose reader goes away (| sed q)
#     stops the run after the step with a save and exit 141, never a death
#     by SIGPIPE; the resume hint names the program the user ran (the
#     libtool wrapper in a build tree, not tools/.libs/epjit-train);
#  6. errors after step 1 (a --metrics write that fails, a bad token in a
#     later batch or in an --eval-every evaluation) save a checkpoint
#     (to --save, else epjit-train-rescue.step<N>.ckpt), print the resume
#     command and exit 1 with the error as the last line; a state that is
#     not finite is not saved and the first error still ends the output;
#     under mpirun both ranks save when rank 0's --metrics fails;
#  7. the banner says where the weights came from and what each "auto"
#     value became; --model takes a Hugging Face folder (its weights, one
#     file or shards); --bf16 trains in bf16 (and is refused with a config
#     that disables bf16); --steps 0 --load evaluates; a checkpoint whose
#     micro_step disagrees with its step is refused; --compare-eager runs
#     both arms from the same weights and prints the ratio's spread.
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
# a trainer of section 5 still running (and its ranks under mpirun):
# killed on the way out
bgpid=
ranks=
trap '[ -z "$bgpid$ranks" ] || { kill -9 $bgpid $ranks 2>/dev/null; wait; }; rm -rf "$tmp"' EXIT
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
	grep -q '^step,loss,lr,grad_norm,tokens_per_s,peak_alloc_bytes,step_ms,compile_ms,entropy_floor,peak_alloc_rank,peak_reserved_bytes,peak_reserved_rank,moe_load_max_mean_layer_0,moe_load_cv_layer_0,moe_dead_experts_layer_0,moe_load_max_mean_layer_1,moe_load_cv_layer_1,moe_dead_experts_layer_1$' ||
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
grep -q '^epjit-train: world 1 rank, expert parallel 1, ZeRO stage 0, device cpu$' \
	default.log || fail "no world line: $(head -n 4 default.log)"
grep -q '^epjit-train: weights: random (seed 42)$' default.log ||
	fail "no weights line: $(head -n 4 default.log)"

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
# --steps 0 --load: the documented evaluation of a checkpoint
run ev0.log --seq 16 --steps 0 --load f32-a1.ckpt
grep -q '^epjit-train: weights: f32-a1.ckpt (--load, step 10)$' ev0.log &&
	grep -q '^summary: eval loss [0-9.]* (held-out stream' ev0.log ||
	fail "--steps 0 --load did not evaluate: $(cat ev0.log)"
ev0=$(sed -n 's/^summary: eval loss \([0-9.]*\) .*/\1/p' ev0.log)
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

# A micro_step out of line with step x gradient_accumulation_steps is
# refused at once (a huge one would skip batches for hours); one stop
# between the micro-batches of a step is allowed.  skew CKPT FROM TO OUT:
# the metadata edited in place (same length).
skew() {
	LC_ALL=C sed "s/\"micro_step\":\"$2\"/\"micro_step\":\"$3\"/" "$1" >"$4"
	[ "$(wc -c <"$4")" -eq "$(wc -c <"$1")" ] && ! cmp -s "$1" "$4" ||
		fail "could not edit the micro_step of $1"
}
skew f32-a1.ckpt 10 99 skew1.ckpt
expect_fail 1 'inconsistent counters: micro_step 99 with step 10' \
	--seq 16 --steps 20 --load skew1.ckpt
grep -q 'expected micro_step 10 ' err.txt || fail "micro_step: $(cat err.txt)"
skew bf16-a1.ckpt 20 23 skew2.ckpt
expect_fail 1 'expected micro_step 20 to 21' --seq 16 --config bf16.json \
	--steps 20 --load skew2.ckpt
skew bf16-a1.ckpt 20 21 skew3.ckpt
run skew3.log --seq 16 --config bf16.json --steps 11 --load skew3.ckpt

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

# A Hugging Face model folder (epjit-ckpt to-hf: config.json and
# model.safetensors, or shards with their index) as --model: the model
# starts from its weights, and says so; so does its config.json.  The
# evaluation of step 10's weights is then that of the checkpoint.
CKPT="$builddir/tools/epjit-ckpt"
if [ -x "$CKPT" ]; then
	"$CKPT" to-hf f32-a1.ckpt hfdir >to-hf.log 2>&1 &&
		"$CKPT" to-hf f32-a1.ckpt hfsh --max-shard-size 40000 \
			>>to-hf.log 2>&1 || fail "epjit-ckpt to-hf: $(cat to-hf.log)"
	[ -f hfsh/model.safetensors.index.json ] || fail "to-hf wrote no shards"
	for m in hfdir hfdir/config.json hfsh/; do
		run md.log --model "$m" --seq 16 --steps 0
		w=hfdir/model.safetensors
		[ "$m" = hfsh/ ] && w=hfsh/model.safetensors.index.json
		grep -q "^epjit-train: weights: $w\$" md.log ||
			fail "--model $m: $(grep weights md.log)"
		[ "$(sed -n 's/^summary: eval loss \([0-9.]*\) .*/\1/p' md.log)" = "$ev0" ] ||
			fail "--model $m: not the weights of the folder: $(grep 'eval loss' md.log) vs $ev0"
	done
	# --load wins over the folder's weights, and says so
	run md2.log --model hfdir --seq 16 --steps 0 --load f32-a1.ckpt
	grep -q '^epjit-train: weights: f32-a1.ckpt (--load, step 10)$' md2.log ||
		fail "--model DIR --load: $(grep weights md2.log)"
else
	echo "note: epjit-ckpt not built; skipping --model DIR"
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
grep -q 'did you mean' err.txt 2>/dev/null &&
	fail "--bogus got a suggestion: $(cat err.txt)"
# a near miss of a real option names it (flags and options with a value)
expect_fail 2 "unknown option '--chekpointing' (did you mean --checkpointing?)" \
	--chekpointing
expect_fail 2 "unknown option '--metrcs=m.csv' (did you mean --metrics?)" \
	--metrcs=m.csv
expect_fail 2 'one of cpu, cuda-sim, cuda' --device gpu0
# --device cuda without a driver: the driver's verdict and a clean exit 1
EPJIT_CUDA_DRIVER=/nonexistent/epjit/libcuda.so.1 "$TRAIN" --device cuda \
	--steps 1 >out.txt 2>err.txt
rc=$?
[ "$rc" -eq 1 ] || fail "--device cuda without a driver: exit $rc"
grep -q 'no CUDA driver (/nonexistent/epjit/libcuda.so.1 not found' \
	err.txt || fail "--device cuda without a driver: $(cat err.txt)"
grep -q '^epjit-train: cannot create a cuda context' err.txt ||
	fail "--device cuda without a driver: $(cat err.txt)"
# --bf16: the built-in config and "auto" take it; a config that says
# false refuses it rather than training in f32 without a word
run b16.log --bf16 --steps 2 --seq 8
grep -q '^epjit-train: config <built-in>, .*, bf16, seed 42,' b16.log ||
	fail "--bf16 did not train in bf16: $(grep config b16.log)"
printf '{"bf16": {"enabled": false}}\n' >nobf16.json
expect_fail 1 'nobf16.json does not enable bf16' --config nobf16.json --bf16 \
	--steps 1
# every "auto" value is printed with what it became
cat >auto.json <<'EOF2'
{"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
 "bf16": {"enabled": "auto"},
 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
 "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto",
   "total_num_steps": "auto"}}}
EOF2
run auto.log --config auto.json --bf16 --steps 30 --seq 8
for want in 'train_micro_batch_size_per_gpu = 8' 'train_batch_size = 8' \
	'bf16.enabled = true' 'optimizer.params.lr = 0.003' \
	'optimizer.params.betas = [0.9,0.95]' \
	'scheduler.params.warmup_num_steps = 20' \
	'scheduler.params.total_num_steps = 30'; do
	grep -q -x -F "epjit-train: config \"auto\": $want" auto.log ||
		fail "\"auto\" not printed as '$want': $(grep auto auto.log)"
done
[ "$(grep -c 'config "auto": ' auto.log)" -eq 7 ] ||
	fail "\"auto\" lines: $(grep auto auto.log)"
expect_fail 2 --steps --steps many
expect_fail 2 --layout --layout sideways
"$TRAIN" --help >help.txt 2>&1 || fail "--help exited non-zero"
grep -q -- '--dump-state' help.txt || fail "--help lacks --dump-state"

# An unknown EPJIT_DEVICE is refused with the known names, never a CPU run.
EPJIT_DEVICE=no-such-device "$TRAIN" --steps 1 >dev.txt 2>&1 &&
	fail "EPJIT_DEVICE=no-such-device trained: $(cat dev.txt)"
grep -q 'EPJIT_DEVICE="no-such-device" is not a device (known: cpu, cuda-sim, cuda)' dev.txt ||
	fail "unknown EPJIT_DEVICE: $(cat dev.txt)"
grep -q '^step ' dev.txt && fail "unknown EPJIT_DEVICE ran a step: $(cat dev.txt)"

# ---- 5. stop signals -------------------------------------------------------
# Each run has far more steps than it will take (about 4 ms a step) and is
# stopped by a signal once its metrics file has 2 rows.  Every wait is
# bounded by a deadline of 120 s, never by a guess at how long a step takes.

nap() {
	sleep 0.2 2>/dev/null || sleep 1
}

# sigdfl CMD...: execs CMD with SIGINT, SIGTERM and SIGUSR1 at their
# default actions.  A background job of a non-interactive shell starts
# with SIGINT ignored (so may a test harness), and the trainer leaves a
# signal that is ignored at its start ignored.  Without env
# --default-signal or perl, SIGINT is not tested.
if env --default-signal=INT true 2>/dev/null; then
	sigdfl() { exec env --default-signal=INT,TERM,USR1,HUP "$@"; }
elif command -v perl >/dev/null 2>&1; then
	sigdfl() {
		exec perl -e '$SIG{$_} = "DEFAULT" for qw(INT TERM USR1 HUP);
			exec @ARGV or die "exec: $!\n"' "$@"
	}
else
	sigdfl() { exec "$@"; }
	no_sigdfl=1
fi

# bg_start TAG CMD...: runs CMD (through sigdfl) in the background, output
# in TAG.log; its pid in $bgpid, and its exit status in TAG.rc once it has
# ended (written by the subshell that waits for it, so no zombie is ever
# polled).
bg_start() {
	tag=$1
	shift
	rm -f "$tag.pid" "$tag.rc"
	(
		sigdfl "$@" >"$tag.log" 2>&1 &
		echo $! >"$tag.pid.tmp" && mv "$tag.pid.tmp" "$tag.pid"
		wait $!
		echo $? >"$tag.rc.tmp" && mv "$tag.rc.tmp" "$tag.rc"
	) &
	end=$(($(date +%s) + 120))
	until [ -s "$tag.pid" ]; do
		[ "$(date +%s)" -le "$end" ] || fail "$tag: no pid within 120 s"
		nap
	done
	bgpid=$(cat "$tag.pid")
}

# bg_rows TAG CSV N: waits until CSV has N data rows (the run still going).
bg_rows() {
	end=$(($(date +%s) + 120))
	while [ ! -f "$2" ] || [ $(($(wc -l <"$2") - 1)) -lt "$3" ]; do
		[ ! -e "$1.rc" ] ||
			fail "$1: ended (exit $(cat "$1.rc")) before $3 metrics rows: $(cat "$1.log")"
		[ "$(date +%s)" -le "$end" ] ||
			fail "$1: no $3 metrics rows within 120 s: $(cat "$1.log")"
		nap
	done
}

# bg_wait TAG: waits for the run to end and sets rc; a run still going
# 120 s after its signal did not stop: killed, and the test fails.
bg_wait() {
	end=$(($(date +%s) + 120))
	until [ -s "$1.rc" ]; do
		if [ "$(date +%s)" -gt "$end" ]; then
			kill -9 $bgpid $ranks 2>/dev/null
			fail "$1: still running 120 s after the signal: $(tail -n 3 "$1.log")"
		fi
		nap
	done
	rc=$(cat "$1.rc")
	bgpid=
	ranks=
}

# whole_rows CSV: every line has the header's number of fields, and the
# file ends with a newline (no row was cut).
whole_rows() {
	awk -F, 'NR == 1 { n = NF } NF != n { bad = 1 } END { exit bad }' "$1" ||
		fail "$1: a row with another number of fields than the header: $(tail -n 2 "$1")"
	[ "$(tail -c 1 "$1" | wc -l)" -eq 1 ] ||
		fail "$1: the last row is cut: $(tail -n 1 "$1")"
}

# stopped_at TAG SIG: n = N of "epjit-train: SIG: stopping after step N".
stopped_at() {
	n=$(sed -n "s/^epjit-train: $2: stopping after step \([0-9]*\)$/\1/p" \
		"$1.log")
	[ -n "$n" ] || fail "$1: no '$2: stopping after step N': $(cat "$1.log")"
}

# last_step CSV: the step of the last row.
last_step() {
	tail -n 1 "$1" | cut -d, -f1
}

long="--steps 100000 --seq 8"

# term_case TAG GAS ARGS...: SIGTERM stops after the step under way (with
# gradient accumulation GAS, after the last micro-batch of a step), saves,
# exits 143; the checkpoint resumes at the next step, and the rows of 2
# resumed steps are those of a straight run.
term_case() {
	tag=$1
	gas=$2
	shift 2
	bg_start "$tag" "$TRAIN" $long "$@" --save "$tag.ckpt" \
		--metrics "$tag.csv"
	bg_rows "$tag" "$tag.csv" 2
	kill -TERM "$bgpid"
	bg_wait "$tag"
	[ "$rc" -eq 143 ] ||
		fail "$tag: SIGTERM: exit $rc, expected 143: $(tail -n 3 "$tag.log")"
	stopped_at "$tag" SIGTERM
	whole_rows "$tag.csv"
	[ "$(last_step "$tag.csv")" = "$n" ] ||
		fail "$tag: stopped after step $n, last metrics row $(last_step "$tag.csv")"
	grep -q "^epjit-train: saved step $n to $tag.ckpt$" "$tag.log" ||
		fail "$tag: checkpoint of step $n not saved: $(tail -n 3 "$tag.log")"
	"$TRAIN" --list-safetensors "$tag.ckpt" >"$tag.txt" 2>&1 ||
		fail "$tag: checkpoint unreadable: $(cat "$tag.txt")"
	grep -q -x "meta step=$n" "$tag.txt" &&
		grep -q -x "meta micro_step=$((n * gas))" "$tag.txt" ||
		fail "$tag: checkpoint not at step $n: $(grep meta "$tag.txt")"
	run "$tag-r.log" "$@" --steps $((n + 2)) --seq 8 --load "$tag.ckpt" \
		--metrics "$tag-r.csv"
	[ "$(sed 1d "$tag-r.csv" | cut -d, -f1 | tr '\n' ' ')" = "$((n + 1)) $((n + 2)) " ] ||
		fail "$tag: resumed steps $(sed 1d "$tag-r.csv" | cut -d, -f1 | tr '\n' ' '), expected $((n + 1)) $((n + 2))"
	[ "$n" -le 2000 ] || return 0 # a straight run to n + 2: < 10 s
	run "$tag-s.log" "$@" --steps $((n + 2)) --seq 8 --metrics "$tag-s.csv"
	tail -n 2 "$tag-s.csv" | cut -d, -f1-4 >"$tag-s.txt"
	sed 1d "$tag-r.csv" | cut -d, -f1-4 >"$tag-r.txt"
	cmp -s "$tag-s.txt" "$tag-r.txt" ||
		fail "$tag: the run resumed from step $n differs from a straight run: $(cat "$tag-r.txt") vs $(cat "$tag-s.txt")"
}
term_case term 1
term_case termb 2 --config bf16.json

# SIGUSR1: the same, exit 0, and a resume hint with the --load to give.
bg_start usr1 "$TRAIN" $long --save usr1.ckpt --metrics usr1.csv
bg_rows usr1 usr1.csv 2
kill -USR1 "$bgpid"
bg_wait usr1
[ "$rc" -eq 0 ] || fail "SIGUSR1: exit $rc, expected 0: $(tail -n 3 usr1.log)"
stopped_at usr1 SIGUSR1
whole_rows usr1.csv
[ "$(last_step usr1.csv)" = "$n" ] ||
	fail "SIGUSR1: stopped after step $n, last metrics row $(last_step usr1.csv)"
grep -q '^epjit-train: resume with: .* --steps 100000 --seq 8 --save usr1.ckpt --metrics usr1.csv --load usr1.ckpt$' usr1.log ||
	fail "SIGUSR1: no resume hint: $(tail -n 3 usr1.log)"
run usr2.log --steps $((n + 1)) --seq 8 --load usr1.ckpt --metrics usr2.csv
[ "$(last_step usr2.csv)" = "$((n + 1))" ] && [ "$(wc -l <usr2.csv)" -eq 2 ] ||
	fail "SIGUSR1: the resumed run did not take step $((n + 1)): $(cat usr2.csv)"
# the hint names the program as run: in the build tree the libtool
# wrapper, which finds the uninstalled library, not tools/.libs/...
prog=$(sed -n 's/^epjit-train: resume with: \([^ ]*\) .*/\1/p' usr1.log)
[ "$prog" = "$TRAIN" ] ||
	fail "the resume hint runs '$prog', not the program run ($TRAIN)"
"$prog" --version >ver.txt 2>&1 || fail "$prog --version: $(cat ver.txt)"

# SIGHUP (a closed terminal, a batch system): as SIGTERM, exit 129
bg_start hup "$TRAIN" $long --save hup.ckpt --metrics hup.csv
bg_rows hup hup.csv 2
kill -HUP "$bgpid"
bg_wait hup
[ "$rc" -eq 129 ] || fail "SIGHUP: exit $rc, expected 129: $(tail -n 3 hup.log)"
stopped_at hup SIGHUP
whole_rows hup.csv
grep -q "^epjit-train: saved step $n to hup.ckpt$" hup.log ||
	fail "SIGHUP: checkpoint of step $n not saved: $(tail -n 3 hup.log)"
run hup2.log --steps $((n + 1)) --seq 8 --load hup.ckpt

# stdout's reader goes away (sed quits at the first progress line, of step
# 20): the next progress line (step 40) meets EPIPE, which stops the run
# after that step with a save and exit 141 (SIGPIPE's), never a death by
# SIGPIPE; the rest of the output goes to stderr.
(
	timeout 120 "$TRAIN" $long --save pipe.ckpt 2>pipe.log
	echo $? >pipe.rc
) | sed -n '/^step /q'
rc=$(cat pipe.rc)
[ "$rc" -eq 141 ] || fail "stdout closed: exit $rc, expected 141: $(tail -n 3 pipe.log)"
n=$(sed -n 's/^epjit-train: SIGPIPE: stopping after step \([0-9]*\) .*/\1/p' pipe.log)
[ -n "$n" ] && [ "$n" -ge 20 ] || fail "stdout closed: $(cat pipe.log)"
grep -q "^epjit-train: saved step $n to pipe.ckpt$" pipe.log ||
	fail "stdout closed: no checkpoint of step $n: $(cat pipe.log)"
"$TRAIN" --list-safetensors pipe.ckpt >pipe.txt 2>&1 &&
	grep -q -x "meta step=$n" pipe.txt ||
	fail "stdout closed: checkpoint not at step $n: $(grep meta pipe.txt)"

# No --save: stopped all the same, and said that nothing was saved.
bg_start nosave "$TRAIN" $long --metrics nosave.csv
bg_rows nosave nosave.csv 2
kill -TERM "$bgpid"
bg_wait nosave
[ "$rc" -eq 143 ] || fail "SIGTERM without --save: exit $rc: $(tail -n 3 nosave.log)"
grep -q '^epjit-train: SIGTERM: no checkpoint written (no --save PATH)$' nosave.log ||
	fail "SIGTERM without --save: $(tail -n 3 nosave.log)"
whole_rows nosave.csv

# SIGINT: stop after the step, save nothing, exit 130 (bg_start gives the
# run SIGINT back, see sigdfl).
if [ -z "${no_sigdfl:-}" ]; then
	cp term.ckpt int.ckpt
	bg_start int "$TRAIN" $long --save int.ckpt --metrics int.csv
	bg_rows int int.csv 2
	kill -INT "$bgpid"
	bg_wait int
	[ "$rc" -eq 130 ] || fail "SIGINT: exit $rc, expected 130: $(tail -n 3 int.log)"
	stopped_at int SIGINT
	whole_rows int.csv
	[ "$(last_step int.csv)" = "$n" ] ||
		fail "SIGINT: stopped after step $n, last metrics row $(last_step int.csv)"
	grep -q '^epjit-train: SIGINT: no checkpoint written' int.log ||
		fail "SIGINT: $(tail -n 3 int.log)"
	cmp -s int.ckpt term.ckpt || fail "SIGINT: --save was written"
else
	echo "note: neither env --default-signal nor perl; skipping SIGINT"
fi

# A second signal while stopping exits at once.  The run is stopped
# (SIGSTOP) while both signals are sent, so that on SIGCONT it meets the
# second one before it can reach the end of its step: exit 143 (SIGTERM's)
# straight from the handler, --save as it was, no cut row.
cp term.ckpt twice.ckpt
bg_start twice "$TRAIN" $long --save twice.ckpt --metrics twice.csv
bg_rows twice twice.csv 2
kill -STOP "$bgpid"
if [ -r "/proc/$bgpid/stat" ]; then # Linux: wait until it is stopped
	end=$(($(date +%s) + 120))
	until [ "$(sed 's/.*) \(.\).*/\1/' "/proc/$bgpid/stat")" = T ]; do
		[ "$(date +%s)" -le "$end" ] || fail "twice: SIGSTOP did not stop it"
		nap
	done
fi
kill -USR1 "$bgpid"
kill -TERM "$bgpid"
kill -CONT "$bgpid"
bg_wait twice
[ "$rc" -eq 143 ] || fail "two signals: exit $rc, expected 143: $(tail -n 3 twice.log)"
grep -q '^epjit-train: second signal: exiting now$' twice.log ||
	fail "two signals: $(tail -n 3 twice.log)"
cmp -s twice.ckpt term.ckpt || fail "two signals: --save was changed"
whole_rows twice.csv

# SIGTERM twice as fast as the shell sends them, the second when the run
# already stops or saves (or has ended): exit 143, and the file at --save
# is absent or a whole checkpoint that resumes.
bg_start twice2 "$TRAIN" $long --save twice2.ckpt --metrics twice2.csv
bg_rows twice2 twice2.csv 2
kill -TERM "$bgpid"
end=$(($(date +%s) + 120))
until grep -q 'stopping after step' twice2.log || [ -e twice2.rc ]; do
	[ "$(date +%s)" -le "$end" ] || break
	nap
done
[ -e twice2.rc ] || kill -TERM "$bgpid" 2>/dev/null
bg_wait twice2
[ "$rc" -eq 143 ] || fail "SIGTERM twice: exit $rc, expected 143: $(tail -n 3 twice2.log)"
whole_rows twice2.csv
if [ -e twice2.ckpt ]; then
	"$TRAIN" --list-safetensors twice2.ckpt >twice2.txt 2>&1 ||
		fail "SIGTERM twice: a broken checkpoint: $(cat twice2.txt)"
	s=$(sed -n 's/^meta step=//p' twice2.txt)
	run twice3.log --steps $((s + 1)) --seq 8 --load twice2.ckpt
fi

# ---- 6. errors after step 1 -------------------------------------------------
# rescued TAG PATH ERR: the run of TAG.log exited 1 after saving a
# checkpoint to PATH (n = its step, >= 1), printed the resume command and
# ended with the error ERR.
rescued() {
	[ "$rc" -eq 1 ] || fail "$1: exit $rc, expected 1: $(tail -n 3 "$1.log")"
	n=$(sed -n 's/^epjit-train: the run failed after step \([0-9]*\); saving its state to .*/\1/p' "$1.log")
	[ -n "$n" ] && [ "$n" -ge 1 ] || fail "$1: no rescue save: $(cat "$1.log")"
	p=$(echo "$2" | sed "s/<n>/$n/")
	grep -q "^epjit-train: the run failed after step $n; saving its state to $p" "$1.log" &&
		grep -q "^epjit-train: saved step $n to $p\($\| (the commit record\)" "$1.log" &&
		grep -q "^epjit-train: resume with: $TRAIN .* --load $p\($\|   (under mpirun, on 2 ranks again)$\)" "$1.log" ||
		fail "$1: no save or resume hint: $(cat "$1.log")"
	# the last line of the trainer (mpirun may add its own after it)
	[ "$(grep '^epjit-train: ' "$1.log" | tail -n 1)" = "epjit-train: exiting with status 1 after step $n: $3" ] ||
		fail "$1: the last line is not the error: $(tail -n 3 "$1.log")"
	if [ -e "$p.g1.rank0" ]; then # the commit record of a set
		grep -q "\"step\": $n," "$p" ||
			fail "$1: $p is not the record of step $n: $(cat "$p")"
	else
		"$TRAIN" --list-safetensors "$p" >"$1.txt" 2>&1 &&
			grep -q -x "meta step=$n" "$1.txt" ||
			fail "$1: $p is not a checkpoint of step $n: $(cat "$1.txt")"
	fi
}

# A --metrics write that fails after some steps (a FIFO whose reader reads
# 300 bytes and goes away: EPIPE), without --save: the checkpoint goes to
# epjit-train-rescue.step<N>.ckpt, and a run resumed from it goes on.
if mkfifo mfifo 2>/dev/null; then
	# (the reader gives up after 120 s should the trainer never open it)
	timeout 120 head -c 300 mfifo >/dev/null &
	reader=$!
	timeout 120 "$TRAIN" $long --metrics mfifo >mf.log 2>&1
	rc=$?
	wait $reader
	rescued mf 'epjit-train-rescue.step<n>.ckpt' \
		'mfifo: write failed: Broken pipe'
	run mf2.log --steps $((n + 1)) --seq 8 --load "epjit-train-rescue.step$n.ckpt" \
		--metrics mf2.csv
	[ "$(last_step mf2.csv)" = "$((n + 1))" ] ||
		fail "the rescued run did not resume: $(cat mf2.csv)"
fi

# A token outside the vocabulary met in a later batch (document 49 of a
# .npy, sampled in some step > 1) and in an --eval-every evaluation (the
# same document in the validation split).  npy_u2 FILE: 50 documents of 40
# tokens below 64 ("<u2"), token 100 at document 49, index 20.
npy_u2() {
	hdr="{'descr': '<u2', 'fortran_order': False, 'shape': (50, 40), }"
	len=$((${#hdr} + 1))
	pad=$(((64 - (10 + len) % 64) % 64))
	len=$((len + pad))
	{
		printf '\223NUMPY\001\000'
		printf "\\$(printf %03o $((len % 256)))\\$(printf %03o $((len / 256)))"
		printf '%s%*s\n' "$hdr" "$pad" ''
		printf "$(awk 'BEGIN { for (d = 0; d < 50; d++) for (i = 0; i < 40; i++) {
			v = (d * 7 + i * 3) % 64; if (d == 49 && i == 20) v = 100;
			printf "\\%03o\\000", v } }')"
	} >"$1"
	[ "$(wc -c <"$1")" -eq $((10 + len + 4000)) ] || fail "npy_u2: $(wc -c <"$1") bytes"
}
npy_u2 bad.npy
tokerr="dataset 'bad.npy': token 100 at index 20 of document 49 is not below the vocab size"
"$TRAIN" --data bad.npy --split 100,0,0 --steps 100 --seq 8 --save bt.ckpt \
	>bt.log 2>&1
rc=$?
rescued bt bt.ckpt "$tokerr"
"$TRAIN" --data bad.npy --split 90,10,0 --steps 100 --seq 8 --eval-every 2 \
	>be.log 2>&1
rc=$?
rescued be 'epjit-train-rescue.step<n>.ckpt' "$tokerr"
[ "$n" -eq 2 ] || fail "--eval-every 2: the run failed after step $n"

# A state that is no longer finite (lr 1e308) is not saved, and the first
# error is still the last line.
printf '{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 1e308}}}\n' >hugelr.json
"$TRAIN" --config hugelr.json --steps 5 --seq 8 --save nf.ckpt >nf.log 2>&1
rc=$?
[ "$rc" -eq 1 ] && [ ! -e nf.ckpt ] &&
	grep -q "^epjit-train: checkpoint 'nf.ckpt' not saved: .* is inf" nf.log &&
	tail -n 1 nf.log | grep -q '^epjit-train: exiting with status 1 after step 1: train step 2: the mean loss is ' ||
	fail "a non-finite state: exit $rc: $(cat nf.log)"

# ---- 7. --compare-eager: the same weights, rounds and their spread --------
run ce.log --steps 5 --seq 8 --compile --compare-eager
l=$(sed -n 's/^compare: .* same weights (eval loss \([0-9.]*\) eager, \([0-9.]*\) compiled).*/\1 \2/p' ce.log)
[ -n "$l" ] && echo "$l" | awk '{ d = $1 - $2; exit !(d < 1e-4 && -d < 1e-4) }' ||
	fail "--compare-eager: not the same weights: $(grep '^compare:' ce.log)"
v=$(sed -n 's/^compare: compiled\/eager step time \([0-9.]*\) (median of 8 rounds; spread \([0-9.]*\)\.\.\([0-9.]*\)): \(.*\)$/\1 \2 \3 \4/p' ce.log)
echo "$v" | awk '{ m = $1; lo = $2; hi = $3; $1 = $2 = $3 = ""; s = $0
	want = lo <= 1 && hi >= 1 ? "the spread crosses 1.0" : hi < 1 ? "compiled is faster" : "compiled is slower"
	exit !(lo <= m && m <= hi && index(s, want) > 0) }' ||
	fail "--compare-eager: ratio and spread: $(grep '^compare:' ce.log)"

# Two ranks (where mpirun and a build with MPI are): SIGTERM to rank 1
# only.  The ranks agree on stopping between steps, so both stop after the
# same step and both write their file of the checkpoint, which resumes on
# 2 ranks at the next step.
MPIRUN=$(command -v mpirun || command -v mpiexec)
if [ -n "$MPIRUN" ] &&
	grep -q '^#define HAVE_MPI 1' "$builddir/config.h" 2>/dev/null; then
	# CI runs as root; Open MPI refuses that without both variables.
	OMPI_ALLOW_RUN_AS_ROOT=1
	OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
	export OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM
	cat >ep2.json <<'EOF'
{
  "train_micro_batch_size_per_gpu": 2,
  "steps_per_print": 1000,
  "seed": 11,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
  "zero_optimization": {"stage": 1},
  "expert_parallel": {"autoep_size": 2},
  "comm": {"timeout_s": 60}
}
EOF
	# each rank writes its pid (sh execs the trainer: the same process)
	bg_start mp "$MPIRUN" -np 2 --oversubscribe sh -c \
		'echo $$ >"mp.pid${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-$PMIX_RANK}}" && exec "$@"' \
		sh "$TRAIN" $long --config ep2.json --save mp.ckpt \
		--metrics mp.csv --rank-log mp
	bg_rows mp mp.csv 2
	[ -s mp.pid0 ] && [ -s mp.pid1 ] || fail "mpirun: no pid files of the ranks"
	ranks="$(cat mp.pid0) $(cat mp.pid1)"
	kill -TERM "$(cat mp.pid1)"
	bg_wait mp
	[ "$rc" -eq 143 ] || fail "2 ranks, SIGTERM to rank 1: exit $rc: $(tail -n 5 mp.log)"
	stopped_at mp SIGTERM
	grep -q "^epjit-train: SIGTERM: stopping after step $n$" mp.rank1.log ||
		fail "2 ranks: rank 0 stopped after step $n, rank 1: $(grep stopping mp.rank1.log)"
	whole_rows mp.csv
	[ "$(last_step mp.csv)" = "$n" ] ||
		fail "2 ranks: stopped after step $n, last metrics row $(last_step mp.csv)"
	grep -q "^epjit-train: saved step $n to mp.ckpt" mp.log ||
		fail "2 ranks: no checkpoint of step $n: $(tail -n 5 mp.log)"
	# autoep_size 2 without "enabled" (parsed only) is EP 2, and says so
	grep -q '^epjit-train: world 2 ranks, expert parallel 2, ZeRO stage 1, device cpu$' mp.log ||
		fail "2 ranks: banner: $(grep world mp.log)"
	timeout 300 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" --config ep2.json \
		--steps $((n + 1)) --seq 8 --load mp.ckpt --metrics mp2.csv \
		>mp2.log 2>&1 || fail "2 ranks: resume failed: $(tail -n 5 mp2.log)"
	[ "$(last_step mp2.csv)" = "$((n + 1))" ] && [ "$(wc -l <mp2.csv)" -eq 2 ] ||
		fail "2 ranks: the resumed run did not take step $((n + 1)): $(cat mp2.csv)"
	# rank 0's --metrics fails after some steps: the ranks agree on the
	# error, both take part in the save of a committed set, both exit 1
	if mkfifo mpfifo 2>/dev/null; then
		timeout 300 head -c 300 mpfifo >/dev/null &
		reader=$!
		timeout 300 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" $long \
			--config ep2.json --save mpe.ckpt --metrics mpfifo \
			--rank-log mpe >mpe.out 2>mpe.log
		rc=$?
		wait $reader
		rescued mpe mpe.ckpt 'mpfifo: write failed: Broken pipe'
		[ -s mpe.ckpt.g1.rank0 ] && [ -s mpe.ckpt.g1.rank1 ] ||
			fail "2 ranks, error: not a set of 2 files: $(ls mpe.ckpt*)"
		tail -n 1 mpe.rank1.log | grep -q "^epjit-train: exiting with status 1 after step $n: stopping: another rank failed" ||
			fail "2 ranks, error: rank 1: $(tail -n 3 mpe.rank1.log)"
		timeout 300 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" --config ep2.json \
			--steps $((n + 1)) --seq 8 --load mpe.ckpt >mpe2.log 2>&1 ||
			fail "2 ranks: the rescued set does not resume: $(tail -n 5 mpe2.log)"
	fi
else
	echo "note: no mpirun or a build without MPI; skipping 2 ranks"
fi
echo "PASS: epjit-train"
exit 0
