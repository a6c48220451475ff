#!/bin/sh
# t/ds_compat.sh -- DeepSpeed configs as people keep them, and
# --model-override, through epjit-train and epjit-warmup (make check sets
# top_builddir and top_srcdir; by hand: top_builddir=BUILD top_srcdir=SRC
# sh t/ds_compat.sh).
#
#  1. Hugging Face's ZeRO-2 example config (its "auto" values, offload
#     device "none", a tensorboard section) trains 3 steps compiled; "auto"
#     took the trainer's values: micro-batch 8, accumulation 1, f32, and the
#     lr of step 3 is the log warm-up from 0 to 3e-3 over 20 steps at
#     iteration 1 (the library's own rule, 1e-3 over 1000 steps, gives
#     another lr); one warning names the keys without effect;
#  2. the same config with offload to "cpu" exits 1: not implemented;
#  3. a config with three errors reports all three, in one message;
#  4. --model-override shrinks the 48-layer Qwen3-30B-A3B config.json to one
#     small layer, which trains (eager) and warms (epjit-warmup --dry-run);
#     an unknown key is an error naming it and the nearest key; a value
#     that is no scalar is an error;
#  5. DeepSpeed's AutoEP example ("preset_model": "mixtral") with its kernel
#     and DeepEP tuning keys trains the Mixtral model, naming those keys in
#     the one no-effect warning; the Qwen3-MoE preset on it exits 1 naming
#     both families; on DeepSeek-V3 a route_scale that DeepSpeed overrides
#     by the model's routed_scaling_factor is a warning, and training goes
#     on (t/configs/autoep_* hold every key's case);
#  6. the config is read once, before anything is built: a config that
#     names a seed and the cuda-sim device (no --seed, no EPJIT_DEVICE)
#     builds the model once (one log line per --model-override), on that
#     device with that seed, and trains as the same run given both on the
#     command line.
# Exit 77 (SKIP) when the trainer was not built.

builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
WARM="$builddir/tools/epjit-warmup"
if [ ! -x "$TRAIN" ] || [ ! -x "$WARM" ]; then
	echo "SKIP: $TRAIN or $WARM not built"
	exit 77
fi
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS

tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-ds-compat.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1
# a kernel cache of this test's own (make check gives one per test)
if [ -z "$EPJIT_CACHE_DIR" ]; then
	EPJIT_CACHE_DIR=$tmp/kcache
	export EPJIT_CACHE_DIR
fi

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

# hf_zero2 DEVICE: Hugging Face's ZeRO-2 example with offload to DEVICE
hf_zero2() {
	cat <<EOF
{
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
           "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
  "zero_optimization": {"stage": 2,
    "offload_optimizer": {"device": "$1", "pin_memory": true},
    "allgather_partitions": true, "allgather_bucket_size": 2e8,
    "overlap_comm": true, "reduce_scatter": true,
    "reduce_bucket_size": 2e8, "contiguous_gradients": true},
  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
  "steps_per_print": 2000, "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": false,
  "tensorboard": {"enabled": false, "output_path": "tb", "job_name": "hf"}
}
EOF
}

# ---- 1. the HF example trains, compiled, with the trainer's values
hf_zero2 none >zero2.json
"$TRAIN" --config zero2.json --compile --steps 3 --metrics m.csv \
	>out1 2>err1 || { cat out1 err1 >&2; fail "HF ZeRO-2 config did not train"; }
grep -q "micro-batch 8 x seq 32, grad accum 1, f32" out1 ||
	{ cat out1 >&2; fail "\"auto\" did not take the trainer's batch and precision"; }
grep -q "compiled: mode" out1 || fail "--compile did not compile"
n=$(grep -c "accepted, no effect in epjit" err1)
[ "$n" = 1 ] || { cat err1 >&2; fail "want one no-effect warning, got $n"; }
for k in fp16.loss_scale zero_optimization.offload_optimizer.pin_memory \
	zero_optimization.overlap_comm zero_optimization.reduce_bucket_size \
	wall_clock_breakdown; do
	grep "accepted, no effect in epjit" err1 | grep -q "$k" ||
		{ cat err1 >&2; fail "the no-effect warning does not name $k"; }
done
# a config that moves the seed is parsed twice by the trainer: still one
# warning
printf '{"seed": 7, "wall_clock_breakdown": true, "train_micro_batch_size_per_gpu": 2}\n' >seed7.json
"$TRAIN" --config seed7.json --steps 1 --seq 8 >out7 2>err7 ||
	{ cat out7 err7 >&2; fail "seed 7 config did not train"; }
n=$(grep -c "accepted, no effect in epjit: wall_clock_breakdown" err7)
[ "$n" = 1 ] || { cat err7 >&2; fail "seed 7: want one no-effect warning, got $n"; }
# steps_per_print is acted on (the progress interval): not in the warning
grep "accepted, no effect" err1 | grep -q steps_per_print &&
	fail "steps_per_print is acted on, yet named as without effect"
# lr of step 3 (iteration 1): 3e-3 * log(2) / log(20)
lr3=$(awk -F, '$1 == 3 { print $3 }' m.csv)
[ -n "$lr3" ] || { cat m.csv >&2; fail "no metrics row for step 3"; }
awk -v lr="$lr3" 'BEGIN { want = 3e-3 * log(2) / log(20);
	d = lr - want; if (d < 0) d = -d; exit !(d <= 1e-9 + 1e-6 * want) }' ||
	fail "lr of step 3 is $lr3, want 3e-3*log(2)/log(20) (warm-up \"auto\")"
# the loss is finite
awk -F, 'NR > 1 && ($2 != $2 + 0 || $2 ~ /nan|inf/) { exit 1 }' m.csv ||
	fail "non-finite loss in m.csv"

# ---- 2. offload to the CPU is refused as not implemented
hf_zero2 cpu >zero2cpu.json
if "$TRAIN" --config zero2cpu.json --steps 1 >out2 2>err2; then
	fail "offload_optimizer.device \"cpu\" was accepted"
fi
grep -q "offload_optimizer) is not implemented in epjit" err2 ||
	{ cat err2 >&2; fail "offload \"cpu\": not the not-implemented error"; }

# ---- 3. every error of a file in one report
cat >bad3.json <<'EOF'
{
  "gradient_clippin": 1.0,
  "zero_optimization": {"stage": 7},
  "optimizer": {"type": "AdamW", "params": {"lr": "fast"}},
  "seed": "auto"
}
EOF
if "$TRAIN" --config bad3.json --steps 1 >out3 2>err3; then
	fail "a config with errors was accepted"
fi
for want in "4 errors:" \
	'unknown key "gradient_clippin" (did you mean "gradient_clipping"?)' \
	'"zero_optimization.stage" must be an integer in [0, 3], got 7' \
	'"optimizer.params.lr" must be a number >= 0, got string "fast"' \
	'"seed" does not accept "auto"'; do
	grep -qF "$want" err3 || { cat err3 >&2; fail "missing: $want"; }
done

# ---- 4. --model-override: a 48-layer config.json cut to one small layer
big=$srcdir/t/models/qwen3-30b-a3b.json
grep -q '"num_hidden_layers": 48' "$big" || fail "$big is not 48 layers"
small="--model-override num_hidden_layers=1 --model-override vocab_size=64
	--model-override hidden_size=32 --model-override num_attention_heads=4
	--model-override num_key_value_heads=2 --model-override head_dim=8
	--model-override intermediate_size=64
	--model-override moe_intermediate_size=16
	--model-override num_experts=4 --model-override num_experts_per_tok=2
	--model-override max_position_embeddings=256"
# shellcheck disable=SC2086
"$TRAIN" --model "$big" $small --steps 2 --metrics m4.csv >out4 2>err4 ||
	{ cat out4 err4 >&2; fail "the overridden model did not train"; }
# 1 layer: embed, 2 norms per layer + final, 4 attention + 2 qk-norms,
# router + 3 expert tensors, lm_head; whatever the count, far fewer
# elements than the 30B model: hidden 32, vocab 64
elems=$(sed -n 's/.* params, \([0-9]*\) elements, vocab \([0-9]*\).*/\1 \2/p' out4)
set -- $elems
[ "$2" = 64 ] || { cat out4 >&2; fail "vocab_size override not applied"; }
[ "$1" -lt 100000 ] || fail "model has $1 elements: overrides not applied"
[ "$(awk -F, 'NR > 1' m4.csv | wc -l)" = 2 ] || fail "want 2 metrics rows"
# shellcheck disable=SC2086
"$WARM" --model "$big" $small --dry-run >out5 2>err5 ||
	{ cat out5 err5 >&2; fail "epjit-warmup --model-override failed"; }
if "$TRAIN" --model "$big" --model-override num_hiden_layers=1 \
	--steps 1 >out6 2>err6; then
	fail "an unknown override key was accepted"
fi
grep -qF 'unknown key "num_hiden_layers" (did you mean "num_hidden_layers"?)' err6 ||
	{ cat err6 >&2; fail "unknown override key: not named with its nearest key"; }
if "$TRAIN" --model "$big" --model-override 'num_experts=[1]' \
	--steps 1 >out7 2>err7; then
	fail "an array override value was accepted"
fi
grep -q "must be a JSON scalar" err7 || { cat err7 >&2; fail "array value"; }
if "$TRAIN" --model-override num_hidden_layers=1 --steps 1 >out8 2>err8; then
	fail "an override without --model was accepted"
fi
grep -q "need a config.json" err8 || { cat err8 >&2; fail "no --model"; }
# ---- 5. DeepSpeed's AutoEP keys on the families' models
hf=$srcdir/t/golden/hf
cat >ep.json <<'EOF'
{"train_micro_batch_size_per_gpu": 2,
 "expert_parallel": {"enabled": true, "autoep_size": 1,
   "preset_model": "mixtral", "use_grouped_mm": true,
   "gate_up_impl": "fused", "combine_impl": "weighted_sum",
   "comm_num_sm": 12, "comm_qp_margin": 4, "load_balance_coeff": null}}
EOF
"$TRAIN" --model "$hf/mixtral/config.json" --config ep.json --steps 2 \
	--seq 8 >out9 2>err9 || { cat out9 err9 >&2; fail "preset mixtral on Mixtral"; }
grep -q "accepted, no effect in epjit: expert_parallel.use_grouped_mm, expert_parallel.combine_impl, expert_parallel.gate_up_impl, expert_parallel.comm_num_sm, expert_parallel.comm_qp_margin$" err9 ||
	{ cat err9 >&2; fail "the AutoEP kernel keys are not named as without effect"; }
sed 's/"mixtral"/"qwen3_moe"/' ep.json >ep2.json
if "$TRAIN" --model "$hf/mixtral/config.json" --config ep2.json --steps 1 \
	--seq 8 >out10 2>err10; then
	fail "preset qwen3_moe on a Mixtral model was accepted"
fi
grep -qF 'ep2.json: expert_parallel.preset_model="qwen3_moe" does not match the model: its model_type is "mixtral", whose preset is "mixtral"' err10 ||
	{ cat err10 >&2; fail "preset qwen3_moe on Mixtral: not the mismatch error"; }
printf '{"train_micro_batch_size_per_gpu": 2, "expert_parallel": {"preset_model": "deepseek_v3", "route_scale": 3.0}}\n' >ep3.json
"$TRAIN" --model "$hf/deepseek_v3/config.json" --config ep3.json --steps 1 \
	--seq 8 >out11 2>err11 || { cat out11 err11 >&2; fail "route_scale on DeepSeek-V3"; }
grep -qF "ep3.json: expert_parallel.route_scale=3 is overridden by the model's routed_scaling_factor (2.5), as in DeepSpeed" err11 ||
	{ cat err11 >&2; fail "route_scale on DeepSeek-V3: no override warning"; }
# ---- 6. the config read once: its seed and device before the model
seed=$(awk 'BEGIN { srand(); print 43 + int(rand() * 100000) }')
printf '{"seed": %s, "device": "cuda-sim", "train_micro_batch_size_per_gpu": 2}\n' \
	"$seed" >once.json
# shellcheck disable=SC2086
env -u EPJIT_DEVICE EPJIT_LOG=info "$TRAIN" --model "$big" $small \
	--config once.json --steps 1 --seq 8 >out12 2>err12 ||
	{ cat out12 err12 >&2; fail "the config's seed and device"; }
builds=$(grep -c 'override num_hidden_layers=1$' err12)
[ "$builds" = 1 ] || { cat err12 >&2; fail "the model was built $builds times"; }
grep -q "seed $seed, steps" out12 || { cat out12 >&2; fail "not the config's seed"; }
grep -q "device cuda-sim$" out12 || { cat out12 >&2; fail "not the config's device"; }
printf '{"train_micro_batch_size_per_gpu": 2}\n' >plain.json
# shellcheck disable=SC2086
EPJIT_DEVICE=cuda-sim "$TRAIN" --model "$big" $small --config plain.json \
	--seed "$seed" --steps 1 --seq 8 >out13 2>err13 ||
	{ cat out13 err13 >&2; fail "--seed and EPJIT_DEVICE"; }
for f in out12 out13; do
	sed -n 's/^\(step .*grad_norm [^ ]*\).*/\1/p; /^summary: eval loss/p' $f >$f.loss
done
[ -s out12.loss ] && cmp -s out12.loss out13.loss ||
	{ cat out12 out13 >&2; fail "the config's seed and device train otherwise than the flags"; }
echo "ok: ds_compat"
