#!/bin/sh
# t/metrics.sh -- training metrics: the --metrics CSV, the config's
# csv_monitor (DeepSpeed's file layout), and the epjit-plot chart.
#
#  1. a compiled run with csv_monitor and --metrics: one file per event
#     under output_path/job_name named as DeepSpeed names them, each with
#     the header "step,<metric>" and one row per optimizer step, x = samples
#     (step x micro-batch x accumulation); the monitor's loss, lr and
#     tokens/s equal the --metrics columns; the compile time is spent
#     before step 1 (reported by the trainer, > 0 on an empty cache) and
#     every step's compile_ms is 0;
#     a second run appends without a second header;
#     a full disk (/dev/full under the monitor's and --metrics' names) fails
#     the run before step 1 with exit 1, naming the file and the error;
#  2. epjit-plot draws an eager and a compiled run into one PNG (skipped
#     without gnuplot), and refuses a file that is not a metrics CSV; its
#     --help; titles, labels and file names with quotes and blanks; a
#     csv_monitor folder as a run, and a folder that is not one refused;
#  3. the expert-load metrics: with fixed routing every step's columns of
#     both MoE layers are max/mean 1, CV 0, 0 dead, in --metrics and in the
#     csv_monitor's per-layer files alike; epjit-plot --experts draws a
#     --metrics file and a csv_monitor folder, and refuses a run without
#     them.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
PLOT="$srcdir/tools/epjit-plot"
if [ ! -x "$TRAIN" ]; then
	echo "SKIP: $TRAIN not built"
	exit 77
fi
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-metrics-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1
EPJIT_CACHE_DIR=$tmp/kc
export EPJIT_CACHE_DIR

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

cat >mon.json <<'EOF'
{"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
 "compile": {"autoep_non_moe": true},
 "expert_parallel": {"fixed_routing": true},
 "csv_monitor": {"enabled": true, "output_path": "logs/out", "job_name": "job1"}}
EOF
steps=6
"$TRAIN" --config mon.json --compile --steps $steps --seq 16 \
    --metrics m.csv >train.log 2>&1 || { cat train.log >&2; fail "train"; }
d=logs/out/job1
for m in train_loss lr grad_norm tokens_per_s step_time_ms peak_alloc_bytes \
    compile_ms peak_alloc_rank peak_reserved_bytes peak_reserved_rank; do
	f=$d/Train_Samples_$m.csv
	[ -f "$f" ] || fail "no $f"
	[ "$(head -n 1 "$f")" = "step,$m" ] || fail "$f header: $(head -n 1 "$f")"
	[ "$(wc -l <"$f")" -eq $((steps + 1)) ] || fail "$f: $(wc -l <"$f") lines"
	# x = samples: 6, 12, ... (micro-batch 3 x accumulation 2)
	[ "$(cut -d, -f1 "$f" | sed 1d | tr '\n' ' ')" = "6 12 18 24 30 36 " ] ||
		fail "$f: steps are not samples: $(cut -d, -f1 "$f" | tr '\n' ' ')"
done
# the same values as the --metrics columns (loss 2, lr 3, tokens/s 5, compile
# 8, the memory ones 6 and 10 to 12)
for pair in train_loss:2 lr:3 tokens_per_s:5 compile_ms:8 peak_alloc_bytes:6 \
    peak_alloc_rank:10 peak_reserved_bytes:11 peak_reserved_rank:12; do
	m=${pair%:*}
	c=${pair#*:}
	sed 1d "$d/Train_Samples_$m.csv" | cut -d, -f2 >a.txt
	sed 1d m.csv | cut -d, -f"$c" >b.txt
	awk 'NR == FNR { a[FNR] = $1; next }
	     { d = a[FNR] - $1; if (d < 0) d = -d;
	       s = ($1 < 0 ? -$1 : $1); if (d > 1e-3 * (s + 1e-9) + 0.06) exit 1 }' \
	    a.txt b.txt || fail "$m differs from --metrics column $c"
done
# epjit-train compiles every region before step 1 (epj_engine_precompile),
# on this test's empty cache with the host compiler: the time is reported
# there, and no step carries compile time.
pre=$(sed -n 's/.*compiled before step 1 in .* (compile.ms \([0-9]*\),.*/\1/p' train.log)
[ -n "$pre" ] && [ "$pre" -gt 0 ] ||
	fail "no compile time before step 1: $(grep 'compiled:' train.log)"
nz=$(sed 1d "$d/Train_Samples_compile_ms.csv" | cut -d, -f2 |
	awk '$1 != 0' | wc -l)
[ "$nz" -eq 0 ] || fail "compile_ms: $nz steps compiled (want none)"
# the expert-load metrics of the two MoE layers: with fixed routing
# (3 x 16 tokens x top-2 a micro-batch, a multiple of the 4 experts) every
# step balanced, exactly: max/mean 1, CV 0, no dead expert; the same in the
# csv_monitor's files
[ "$(head -n 1 m.csv | cut -d, -f13-)" = \
    "moe_load_max_mean_layer_0,moe_load_cv_layer_0,moe_dead_experts_layer_0,moe_load_max_mean_layer_1,moe_load_cv_layer_1,moe_dead_experts_layer_1" ] ||
	fail "--metrics expert-load header: $(head -n 1 m.csv)"
[ "$(sed 1d m.csv | cut -d, -f13- | sort -u)" = "1,0,0,1,0,0" ] ||
	fail "fixed routing is not balanced: $(cut -d, -f13- m.csv)"
c=13
for l in 0 1; do
	for m in moe_load_max_mean moe_load_cv moe_dead_experts; do
		f=$d/Train_Samples_${m}_layer_$l.csv
		[ "$(head -n 1 "$f")" = "step,${m}_layer_$l" ] || fail "$f header"
		[ "$(sed 1d "$f" | cut -d, -f2 | tr '\n' ' ')" = \
		    "$(sed 1d m.csv | cut -d, -f$c | tr '\n' ' ')" ] &&
			[ "$(wc -l <"$f")" -eq $((steps + 1)) ] ||
			fail "$f differs from --metrics column $c"
		c=$((c + 1))
	done
done
floor=$(sed -n 2p m.csv | cut -d, -f9)
awk -v f="$floor" 'BEGIN { exit !(f > 0.5 && f < 4.2) }' ||
	fail "entropy floor column: $floor"
# a second run appends (no second header)
"$TRAIN" --config mon.json --compile --steps 2 --seq 16 >train.log 2>&1 ||
	fail "second run"
[ "$(grep -c '^step,' "$d/Train_Samples_train_loss.csv")" -eq 1 ] ||
	fail "second run wrote a second header"
[ "$(wc -l <"$d/Train_Samples_train_loss.csv")" -eq $((steps + 3)) ] ||
	fail "second run did not append"

# a full disk: the header of the first file cannot be written.  The run
# fails before training (nothing to save yet) naming the file and errno.
if [ -w /dev/full ]; then
	mkdir -p full/j
	for m in train_loss lr grad_norm tokens_per_s step_time_ms \
	    peak_alloc_bytes compile_ms; do
		ln -s /dev/full "full/j/Train_Samples_$m.csv"
	done
	cat >full.json <<'EOF'
{"csv_monitor": {"enabled": true, "output_path": "full", "job_name": "j"}}
EOF
	"$TRAIN" --config full.json --steps 3 --seq 8 >full.log 2>&1
	rc=$?
	[ "$rc" -eq 1 ] ||
		fail "csv_monitor on a full disk: exit $rc: $(tail -n 3 full.log)"
	grep -q '^epjit-train: csv_monitor: full/j/Train_Samples_train_loss.csv: write failed: No space left on device$' full.log ||
		fail "csv_monitor on a full disk: $(tail -n 3 full.log)"
	grep -q '^step ' full.log && fail "csv_monitor on a full disk trained: $(cat full.log)"
	"$TRAIN" --steps 3 --seq 8 --metrics /dev/full >full.log 2>&1
	rc=$?
	[ "$rc" -eq 1 ] &&
		grep -q '^epjit-train: /dev/full: write failed: No space left on device$' full.log ||
		fail "--metrics /dev/full: exit $rc: $(tail -n 3 full.log)"
fi

# ---- plot -------------------------------------------------------------------------
if ! command -v gnuplot >/dev/null 2>&1; then
	echo "note: gnuplot not installed; epjit-plot not tested"
	exit 0
fi
"$TRAIN" --steps 8 --seq 16 --metrics eager.csv >e.log 2>&1 || fail "eager run"
"$TRAIN" --steps 8 --seq 16 --compile --metrics comp.csv >c.log 2>&1 ||
	fail "compiled run"
sh "$PLOT" -o chart.png -t test eager.csv=eager comp.csv=compiled \
    >plot.log 2>&1 || fail "epjit-plot: $(cat plot.log)"
[ "$(head -c 4 chart.png | od -An -c | tr -d ' ')" = "211PNG" ] ||
	fail "chart.png is not a PNG"
[ "$(wc -c <chart.png)" -gt 20000 ] || fail "chart.png is suspiciously small"
if sh "$PLOT" -o bad.png mon.json >plot.log 2>&1; then
	fail "epjit-plot accepted a file that is not a metrics CSV"
fi
grep -q 'not an epjit-train --metrics file' plot.log || fail "$(cat plot.log)"
# --help: the usage on stdout, exit 0
sh "$PLOT" --help >help.txt 2>&1 || fail "epjit-plot --help exited $?"
grep -q '^usage: epjit-plot' help.txt || fail "epjit-plot --help: $(cat help.txt)"
# quotes and blanks in a title, a label, a file name and the output name;
# and the csv_monitor folder of section 1 as a run, next to a --metrics file
cp eager.csv "it's a run.csv"
sh "$PLOT" -o "chart 'q'.png" -t "it's \"quoted\"; system('false')" \
    "it's a run.csv=eager 'e'" "$d=csv_monitor" >plot.log 2>&1 ||
	fail "epjit-plot with quotes and a csv_monitor folder: $(cat plot.log)"
[ "$(head -c 4 "chart 'q'.png" | od -An -c | tr -d ' ')" = "211PNG" ] ||
	fail "chart 'q'.png is not a PNG"
mkdir notmon
if sh "$PLOT" -o bad.png notmon >plot.log 2>&1; then
	fail "epjit-plot accepted a folder that is not a csv_monitor's"
fi
grep -q 'not a csv_monitor folder' plot.log || fail "$(cat plot.log)"
# the expert-load view: a --metrics file and a csv_monitor folder; a file
# without the expert-load columns is refused
sh "$PLOT" --experts -o experts.png eager.csv=learned "$d=fixed" \
    >plot.log 2>&1 || fail "epjit-plot --experts: $(cat plot.log)"
[ "$(head -c 4 experts.png | od -An -c | tr -d ' ')" = "211PNG" ] ||
	fail "experts.png is not a PNG"
cut -d, -f1-12 eager.csv >noload.csv
if sh "$PLOT" --experts -o bad.png noload.csv >plot.log 2>&1; then
	fail "epjit-plot --experts drew a run without expert-load columns"
fi
grep -q 'no moe_load_max_mean_layer_\* column' plot.log || fail "$(cat plot.log)"
exit 0
