#!/bin/sh
# t/tensorboard.sh -- the config's tensorboard monitor in epjit-train.
#
#  1. a run with both monitors: one event file under output_path/job_name,
#     named events.out.tfevents.<time>.<host>.<pid>.0 and announced by the
#     trainer; t/tb_check reads it with its own reader (framing, both CRCs,
#     the Event fields) and finds the file_version event, then for each of
#     the ten Train/Samples/ tags and the six expert-load ones (two MoE
#     layers) exactly the csv_monitor rows: the same steps (samples) and
#     values (float rounding aside);
#  2. output_path "" puts the files under job_name/ in the working
#     directory, as DeepSpeed does; a second run adds a second file;
#  3. per-step flushing: a run killed (SIGKILL, no exit path) before step
#     4 leaves the events of steps 1 to 3 in the file, all of them;
#  4. a write error (the file size limit, SIGXFSZ ignored) costs the
#     events, not the run: one warning, exit 0, the CSV files complete;
#  5. under mpirun -np 2 (when there is MPI): one event file, rank 0's,
#     and csv_monitor files with one row per step (rank 0's too); x counts
#     the samples of the whole job, as DeepSpeed's global_samples (step x
#     micro-batch x accumulation x the 2 data-parallel ranks).
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
TBCHECK="$builddir/t/tb_check"
if [ ! -x "$TRAIN" ] || [ ! -x "$TBCHECK" ]; then
	echo "SKIP: $TRAIN or $TBCHECK not built"
	exit 77
fi
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-tensorboard-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1
EPJIT_CACHE_DIR=$tmp/kc
export EPJIT_CACHE_DIR

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

# the one event file under DIR (fails unless there is exactly one)
one_file() {
	n=$(ls "$1" 2>/dev/null | grep -c '^events\.out\.tfevents\.')
	[ "$n" -eq 1 ] || fail "$1: $n event files: $(ls "$1" 2>&1)"
	echo "$1/$(ls "$1" | grep '^events\.out\.tfevents\.')"
}

# ---- 1. both monitors ---------------------------------------------------------
cat >both.json <<'EOF'
{"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
 "csv_monitor": {"enabled": true, "output_path": "logs", "job_name": "job1"},
 "tensorboard": {"enabled": true, "output_path": "tb/out", "job_name": "job1"}}
EOF
"$TRAIN" --config both.json --steps 5 --seq 16 >train.log 2>&1 ||
	{ cat train.log >&2; fail "train"; }
f=$(one_file tb/out/job1) || exit 1
grep -q "tensorboard: writing $f\$" train.log ||
	fail "the trainer did not name $f: $(grep tensorboard train.log)"
host=$(hostname)
case "$f" in
tb/out/job1/events.out.tfevents.[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9].*.0) ;;
*) fail "event file name $f" ;;
esac
case "$f" in
*".$host."[0-9]*.0) ;;
*) fail "event file name $f: not host $host" ;;
esac
"$TBCHECK" "$f" logs/job1 >check.log ||
	fail "$f differs from logs/job1/*.csv"
# 16 tags: the ten, and the expert-load ones of the two MoE layers
grep -q ": 80 scalars of 16 metrics agree" check.log ||
	fail "tags: $(cat check.log)"
for t in moe_load_max_mean moe_load_cv moe_dead_experts; do
	for l in 0 1; do
		"$TBCHECK" --dump "$f" | grep -q " Train/Samples/${t}_layer_$l " ||
			fail "no Train/Samples/${t}_layer_$l events"
	done
done
# 5 steps x 16 tags, x = samples (micro-batch 3 x accumulation 2)
[ "$("$TBCHECK" --dump "$f" | awk '$2 == "Train/Samples/lr" { printf "%s ", $1 }')" = \
	"6 12 18 24 30 " ] || fail "lr steps: $("$TBCHECK" --dump "$f")"
[ "$("$TBCHECK" --dump "$f" | wc -l)" -eq 81 ] ||
	fail "expected 81 events: $("$TBCHECK" --dump "$f")"

# ---- 2. output_path "": job_name/ in the working directory ---------------------
mkdir cwd && cd cwd || exit 1
echo '{"tensorboard": {"enabled": true}}' >tb.json
"$TRAIN" --config tb.json --steps 2 --seq 16 >train.log 2>&1 ||
	{ cat train.log >&2; fail "train with the default folder"; }
one_file DeepSpeedJobName >/dev/null || exit 1
"$TRAIN" --config tb.json --steps 2 --seq 16 >train.log 2>&1 ||
	fail "second run"
[ "$(ls DeepSpeedJobName | grep -c '^events\.out\.tfevents\.')" -eq 2 ] ||
	fail "a second run should add a file: $(ls DeepSpeedJobName)"
cd .. || exit 1

# ---- 3. killed before step 4: steps 1 to 3 are in the file -------------------
sed 's/job1/kill/g' both.json >kill.json
"$TRAIN" --config kill.json --steps 6 --seq 16 --fault kill --fault-step 4 \
	>kill.log 2>&1
rc=$?
[ $rc -eq 137 ] || fail "--fault kill: exit $rc: $(cat kill.log)"
f=$(one_file tb/out/kill) || exit 1
[ "$(sed 1d logs/kill/Train_Samples_lr.csv | wc -l)" -eq 3 ] ||
	fail "the CSV should hold steps 1 to 3: $(cat logs/kill/Train_Samples_lr.csv)"
"$TBCHECK" "$f" logs/kill ||
	fail "the killed run's event file lacks finished steps"

# ---- 4. a write error: one warning, training goes on -------------------------
sed 's/job1/full/g' both.json >full.json
# 4 blocks (2 KiB in dash, 4 KiB in bash): the event file (about 400 bytes
# a step) passes it within 12 steps, each CSV file (about 15 bytes a
# row) does not; the trainer's output goes through a pipe, which the limit
# does not bound, to a file written outside it
{
	(
		trap '' XFSZ
		ulimit -f 4 || exit 99
		exec "$TRAIN" --config full.json --steps 12 --seq 16
	) 2>&1 </dev/null
	echo "exit status $?"
} | cat >full.log
rc=$(sed -n 's/^exit status //p' full.log)
[ "$rc" = 99 ] && fail "ulimit -f is not available"
[ "$rc" = 0 ] || fail "a write error failed the run: exit $rc: $(cat full.log)"
[ "$(grep -c 'warning: tensorboard: .*write failed' full.log)" -eq 1 ] ||
	fail "expected one warning: $(grep tensorboard full.log)"
[ "$(sed 1d logs/full/Train_Samples_lr.csv | wc -l)" -eq 12 ] ||
	fail "the CSV monitor should be complete: $(cat logs/full/Train_Samples_lr.csv)"
grep -q '^summary:' full.log || fail "no summary: $(cat full.log)"

# ---- 5. two ranks: rank 0 writes --------------------------------------------
MPIRUN=$(command -v mpirun || command -v mpiexec)
if [ -z "$MPIRUN" ] || ! grep -q '^#define HAVE_MPI 1' "$builddir/config.h" 2>/dev/null; then
	echo "note: no MPI; the two-rank case not run"
	exit 0
fi
OMPI_ALLOW_RUN_AS_ROOT=1
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM
# a sanitized build: Open MPI's own allocations are reported as leaks at
# exit, so the processes under mpirun leave out leak detection
if [ "${EPJIT_SANITIZED:-0}" = 1 ]; then
	ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
	export ASAN_OPTIONS
fi
cat >mpi.json <<'EOF'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
 "tensorboard": {"enabled": true, "output_path": "tb", "job_name": "mpi"},
 "csv_monitor": {"enabled": true, "output_path": "csv/", "job_name": "mpi"}}
EOF
timeout 300 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" --config mpi.json \
	--steps 2 --seq 8 >mpi.log 2>&1 || { cat mpi.log >&2; fail "mpirun"; }
f=$(one_file tb/mpi) || exit 1
grep -q '^epjit-train: world 2 ranks, expert parallel 1, ZeRO stage 0, device cpu$' \
	mpi.log || fail "no world line: $(grep '^epjit-train: ' mpi.log)"
# 2 steps x 16 tags (the ten and six of expert load), x = step x
# micro-batch 2 x accumulation 2 x 2 ranks (as csv_monitor)
[ "$("$TBCHECK" --dump "$f" | awk '$2 == "Train/Samples/train_loss" { printf "%s ", $1 }')" = \
	"8 16 " ] || fail "two ranks: x is not the job's samples: $("$TBCHECK" --dump "$f")"
[ "$("$TBCHECK" --dump "$f" | wc -l)" -eq 33 ] ||
	fail "two ranks: expected 33 events: $("$TBCHECK" --dump "$f")"
"$TBCHECK" "$f" csv/mpi || fail "two ranks: $f differs from csv/mpi/*.csv"
# csv_monitor, rank 0 only as well: one header and one row per step, in
# csv/mpi (output_path's trailing slash not doubled)
grep -q 'csv_monitor: writing csv/mpi/Train_Samples' mpi.log ||
	fail "csv_monitor folder: $(grep csv_monitor mpi.log)"
c=csv/mpi/Train_Samples_train_loss.csv
[ "$(wc -l <"$c")" -eq 3 ] && [ "$(sed 1d "$c" | cut -d, -f1 | tr '\n' ' ')" = "8 16 " ] ||
	fail "two ranks: csv_monitor rows: $(cat "$c")"
exit 0
