#!/bin/sh
# bench/save_cost.sh -- what a periodic save costs the training steps: no
# save, --save-every in the foreground, and --save-every --save-async (a
# background save), on the same model, config, data and steps.
#
#   bench/save_cost.sh BUILD [ROUNDS] [MODEL]
#
# MODEL: tiny (the built-in model: 60 steps, a save every 10) or bench
# (bench/configs/bench-model.json with bench-ds-f32.json, --seq 64: 24
# steps, a save every 6); both when left out.  Each round runs the three
# arms once each as fresh epjit-train processes, in an order rotated from
# round to round (none fg bg, fg bg none, bg none fg, ...), one thread.
# Per run, from --metrics (step_ms: a step's wall time; a save counts in the
# step after it) and the summary's counters, steps 2..S (step 1 warms the
# allocator):
#   base_ms   the median step_ms of the second half of every interval of K
#             steps (steps j + K/2 + 1 .. j + K after each multiple j of K,
#             and 2 .. K/2 + 1 before the first): steps a save at j no
#             longer touches, the run's own baseline whatever the load of
#             the machine does between runs
#   cost_ms   per periodic save, the sum of (step_ms - base_ms) over the K/2
#             steps that follow it: the save's time on the training thread
#             and what its writer took from the steps after it.  The no-save
#             arm gets the same figure for the same steps: the method's
#             noise.
#   after_ms  the mean step_ms of the steps right after a save
#   snap_ms   save.snapshot.us / saves: the training thread's share of a
#             background save (the copy to host memory, the writer's start)
# The summary gives per arm the median over the rounds and the range.
# Files go to a temporary folder on the file system of $TMPDIR (the save is
# an fsync there).
build=${1:?usage: bench/save_cost.sh BUILD [ROUNDS] [tiny|bench]}
rounds=${2:-5}
models=${3:-"tiny bench"}
build=$(cd "$build" && pwd) || exit 2
src=$(cd "$(dirname "$0")/.." && pwd) || exit 2
TRAIN=$build/tools/epjit-train
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-save-cost.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT

# one ARM MODEL ROUND: one run; appends "model arm round mean after other
# snap" to $tmp/rows
one() {
	arm=$1 model=$2 round=$3
	set --
	S=60 K=10
	if [ "$model" = bench ]; then
		S=24 K=6
		set -- --model "$src/bench/configs/bench-model.json" \
			--config "$src/bench/configs/bench-ds-f32.json" --seq 64
	fi
	case $arm in
	none) ;;
	fg) set -- "$@" --save "$tmp/c.ckpt" --save-every $K ;;
	bg) set -- "$@" --save "$tmp/c.ckpt" --save-every $K --save-async ;;
	esac
	rm -f "$tmp"/c.ckpt*
	"$TRAIN" --steps $S "$@" --metrics "$tmp/m.csv" >"$tmp/run.log" 2>&1 ||
		{ cat "$tmp/run.log" >&2; exit 1; }
	snap=$(sed -n 's/^  save\.snapshot\.us  *//p' "$tmp/run.log")
	awk -F, -v k=$K -v s=$S -v arm=$arm -v model=$model -v round=$round \
	    -v snap="${snap:-0}" '
		function med(v, n,   i, j, t) {
			for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
				if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
			return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
		}
		NR == 1 || $1 == 1 { next }
		{ ms[$1] = $7; sum += $7; n++
		  if (($1 - 1) % k >= k / 2 || $1 - 1 < k / 2) b[++nb] = $7 }
		END {
			base = med(b, nb)
			saves = int((s - 1) / k)
			for (j = k; j < s; j += k) {
				after += ms[j + 1]
				for (i = j + 1; i <= j + k / 2 && i <= s; i++)
					cost += ms[i] - base
			}
			printf "%s %s %d %.3f %.3f %.3f %.3f %.3f\n", model, arm,
			    round, sum / n, base, cost / saves, after / saves,
			    arm == "bg" ? snap / 1000 / saves : 0
		}' "$tmp/m.csv" >>"$tmp/rows"
}

: >"$tmp/rows"
for model in $models; do
	r=0
	while [ $r -lt "$rounds" ]; do
		set -- none fg bg
		i=0
		while [ $i -lt $((r % 3)) ]; do # rotate the order
			a=$1
			shift
			set -- "$@" "$a"
			i=$((i + 1))
		done
		for arm in "$@"; do
			one "$arm" "$model" $r
		done
		r=$((r + 1))
	done
done

printf '%-6s %-4s %5s %9s %9s %9s %9s %9s\n' model arm round mean_ms \
	base_ms cost_ms after_ms snap_ms
awk '{ printf "%-6s %-4s %5d %9.2f %9.2f %9.2f %9.2f %9.2f\n",
	$1, $2, $3, $4, $5, $6, $7, $8 }' "$tmp/rows"
echo
echo "per save, the median over $rounds rounds (the range): cost_ms," \
	"after_ms, snap_ms"
for model in $models; do
	for arm in none fg bg; do
		awk -v m=$model -v a=$arm '$1 == m && $2 == a' "$tmp/rows" |
			awk -v m=$model -v a=$arm '
			function med(v, n,   i, j, t) {
				for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
					if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
				return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
			}
			{ c[NR] = $6; p[NR] = $7; q[NR] = $8; bb[NR] = $5
			  lo = NR == 1 || $6 < lo ? $6 : lo
			  hi = NR == 1 || $6 > hi ? $6 : hi }
			END { printf "%-6s %-4s cost %7.1f ms (%.1f .. %.1f)  " \
			          "step after %7.1f ms  snapshot %6.1f ms  " \
			          "base step %7.1f ms\n", m, a, med(c, NR), lo, hi,
			          med(p, NR), med(q, NR), med(bb, NR) }'
	done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
