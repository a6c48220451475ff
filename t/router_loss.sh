#!/bin/sh
# t/router_loss.sh -- the router losses in epjit-train (doc/trainer.md,
# "Router losses"; the losses themselves: the router_loss suite,
# t/hf_golden.sh and t/mpi_check).
#
#  1. Megatron's losses of the config's moe section (the seq aux loss and
#     the z-loss): --metrics has one column per loss after the fixed ones
#     and the expert-load ones, named after it, positive; csv_monitor writes
#     Train_Samples_<name>.csv (header "step,<name>", x = samples) and
#     tensorboard the events Train/Samples/<name> (read back by t/tb_check
#     --dump) with the values of the --metrics column; the loss column
#     exceeds that of the same run without them;
#  2. transformers' auxiliary loss (config.json output_router_logits) with
#     a balancing loss of moe.* is refused before step 1, naming both;
#     DeepSeek-V3 with output_router_logits true (transformers adds no loss
#     there) trains with no router-loss column and says why;
#  3. with mpirun: transformers' auxiliary loss on 2 ranks (EP 2, a
#     micro-batch each) trains as 1 rank with 2 micro-batches per step:
#     loss, gradient norm and the aux_loss column (the mean over the
#     ranks) within 1e-5.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
TBCHECK="$builddir/t/tb_check"
if [ ! -x "$TRAIN" ] || [ ! -x "$TBCHECK" ]; then
	echo "SKIP: $TRAIN or $TBCHECK not built"
	exit 77
fi
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
OMPI_ALLOW_RUN_AS_ROOT=1
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS OMPI_ALLOW_RUN_AS_ROOT \
	OMPI_ALLOW_RUN_AS_ROOT_CONFIRM
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-router-loss-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1
EPJIT_CACHE_DIR=$tmp/kc
export EPJIT_CACHE_DIR

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

# column (1-based) of the --metrics file $1 named $2, or nothing
column_of() {
	head -n 1 "$1" | tr , '\n' | grep -nx "$2" | cut -d: -f1
}
# a --metrics header: the fixed columns, the expert-load ones (per MoE
# layer), then the router losses' ($1: ",name,name" or "")
header_re() {
	echo ",peak_reserved_rank\(,moe_load_max_mean_layer_[0-9]*,moe_load_cv_layer_[0-9]*,moe_dead_experts_layer_[0-9]*\)\{1,\}$1\$"
}

# ---- 1. Megatron's losses in the metrics -------------------------------------
cat >moe.json <<'EOF'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
 "seed": 5, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
 "moe": {"seq_aux_loss_coeff": 0.05, "z_loss_coeff": 0.01},
 "csv_monitor": {"enabled": true, "output_path": "logs", "job_name": "j"},
 "tensorboard": {"enabled": true, "output_path": "tb", "job_name": "j"}}
EOF
sed 's/"seq_aux_loss_coeff": 0.05, "z_loss_coeff": 0.01/"z_loss_coeff": null/' \
	moe.json >plain.json
"$TRAIN" --config moe.json --steps 3 --seq 8 --metrics m.csv >moe.log 2>&1 ||
	fail "training with moe.*: $(cat moe.log)"
"$TRAIN" --config plain.json --steps 1 --seq 8 --metrics p.csv \
	>plain.log 2>&1 || fail "training without: $(cat plain.log)"
head -n 1 m.csv | grep -q "$(header_re ,seq_load_balancing_loss,z_loss)" ||
	fail "--metrics header: $(head -n 1 m.csv)"
head -n 1 p.csv | grep -q "$(header_re '')" ||
	fail "--metrics header without router losses: $(head -n 1 p.csv)"
[ "$(sed 1d m.csv | wc -l)" -eq 3 ] || fail "--metrics rows: $(cat m.csv)"
seq_col=$(column_of m.csv seq_load_balancing_loss)
z_col=$(column_of m.csv z_loss)
awk -F, -v s="$seq_col" -v z="$z_col" \
	'NR > 1 && !($s > 0.5 && $z > 0.1) { exit 1 }' m.csv ||
	fail "router loss columns: $(cat m.csv)"
# the router losses add to the loss of the same first step
m_nf=$(head -n 1 m.csv | awk -F, '{ print NF }')
paste -d, m.csv p.csv | awk -F, -v n="$m_nf" 'NR == 2 { exit !($2 > $(n + 2)) }' ||
	fail "the loss with the router losses is not above the plain one: $(cat m.csv p.csv)"
ev=$(ls tb/j/events.out.tfevents.* 2>/dev/null | head -n 1)
[ -n "$ev" ] || fail "no tensorboard event file: $(ls -R tb)"
"$TBCHECK" --dump "$ev" >events.txt || fail "tb_check --dump $ev"
for name in seq_load_balancing_loss z_loss; do
	col=$(column_of m.csv $name)
	f=logs/j/Train_Samples_$name.csv
	[ "$(head -n 1 "$f")" = "step,$name" ] || fail "$f: $(cat "$f" 2>&1)"
	# the monitor's rows: x = step x 2 x 2, the --metrics values
	sed 1d m.csv | cut -d, -f1,$col | awk -F, '{ printf "%d,%s\n", $1 * 4, $2 }' \
		>want.txt
	sed 1d "$f" | cmp -s - want.txt ||
		fail "$f against --metrics: $(cat "$f" want.txt)"
	# the events: the same values as floats
	grep " Train/Samples/$name " events.txt | awk '{ print $1 "," $3 }' >got.txt
	paste -d, got.txt want.txt | awk -F, '
		{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1e-6 * $4) bad = 1; n++ }
		END { exit bad || n != 3 }' ||
		fail "tensorboard $name: $(cat got.txt want.txt)"
done
echo "Megatron's losses: --metrics, csv_monitor and tensorboard agree"

# ---- 2. refused, and DeepSeek -------------------------------------------------
q3=$srcdir/t/golden/hf/qwen3_moe
st=0
"$TRAIN" --model "$q3/config.json" --model-override output_router_logits=true \
	--config moe.json --steps 1 --seq 8 >both.log 2>&1 || st=$?
[ $st = 1 ] && grep -q 'moe.seq_aux_loss_coeff is 0.05 and the model.s config.json has "output_router_logits": true' both.log ||
	fail "transformers' and Megatron's balancing losses together (exit $st): $(cat both.log)"
"$TRAIN" --model "$srcdir/t/golden/hf/deepseek_v3/config.json" \
	--model-override output_router_logits=true --steps 1 --seq 8 \
	--metrics ds.csv >ds.log 2>&1 || fail "DeepSeek-V3: $(cat ds.log)"
grep -q "output_router_logits is true: transformers' DeepSeek-V2/V3 add no auxiliary loss" ds.log ||
	fail "DeepSeek-V3 does not say why it adds no loss: $(cat ds.log)"
head -n 1 ds.csv | grep -q "$(header_re '')" ||
	fail "DeepSeek-V3 has a router-loss column: $(head -n 1 ds.csv)"
echo "refused together; DeepSeek-V3 adds none"

# ---- 3. transformers' loss on 2 ranks -------------------------------------------
MPIRUN=$(command -v mpirun || command -v mpiexec)
grep -q '^#define HAVE_MPI 1' "$builddir/config.h" 2>/dev/null || MPIRUN=
if [ -z "$MPIRUN" ]; then
	echo "skip: 2 ranks (no MPI)"
	echo "PASS: router_loss"
	exit 0
fi
cat >g1.json <<'EOF'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
 "steps_per_print": 1, "seed": 3, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}
EOF
sed 's/"gradient_accumulation_steps": 2,/"gradient_accumulation_steps": 1, "expert_parallel": {"autoep_size": 2},/' \
	g1.json >g2.json
"$TRAIN" --model "$q3/aux/config.json" --load "$q3/model.safetensors" \
	--config g1.json --steps 3 --seq 7 --metrics g1.csv >g1.log 2>&1 ||
	fail "1 rank: $(cat g1.log)"
timeout 600 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" \
	--model "$q3/aux/config.json" --load "$q3/model.safetensors" \
	--config g2.json --steps 3 --seq 7 --metrics g2.csv >g2.log 2>&1 ||
	fail "2 ranks: $(cat g2.log)"
head -n 1 g2.csv | grep -q "$(header_re ,aux_loss)" ||
	fail "2 ranks: --metrics header: $(head -n 1 g2.csv)"
paste -d, g1.csv g2.csv | sed 1d | awk -F, '
	function rel(a, b) { d = a - b; if (d < 0) d = -d; return d / (b < 0 ? -b : b) }
	{ h = NF / 2
	  if (!(rel($(h + 2), $2) <= 1e-5 && rel($(h + 4), $4) <= 1e-5 &&
		rel($NF, $h) <= 1e-5 && $h > 1)) bad = 1; n++ }
	END { exit bad || n != 3 }' ||
	fail "2 ranks differ from 1 rank: $(cat g1.csv g2.csv)"
echo "transformers' auxiliary loss on 2 ranks as on 1"
echo "PASS: router_loss"
