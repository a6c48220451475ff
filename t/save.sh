#!/bin/sh
# t/save.sh -- periodic and background saves of epjit-train (--save-every,
# --save-async, --keep; runtime/ckpt_async.c).
#
# One rank (the built-in tiny model, a few ms a step):
#  1. --save-every 2, in the foreground and in the background (and through
#     the config's checkpoint.writer.decoupled), saves steps 2 and 4 and the
#     last one, and trains exactly as a run without saves (step, loss, lr,
#     grad_norm of every row);
#  2. a background save killed with SIGKILL at each phase of its writer
#     (EPJIT_TEST_SAVE_HOLD: start, write, filled, written) leaves --save
#     the last whole save (step 2 before the rename, 4 after), and the run
#     resumed from it repeats the uninterrupted run's steps bit for bit;
#  3. a writer that fails (--save in a folder that does not exist) fails
#     the run at a later step boundary, naming the file; SIGTERM during a
#     run of background saves still saves its last step, which resumes;
#  4. bad command lines exit 2; --keep 2 on one rank exits 1.
# Two ranks under mpirun (skipped without MPI): 5. --keep 2 keeps the two
# newest generations (their files and records PATH.g<G>.record), removes
# the older (also one first saved with --keep 1), and PATH.g<G>.record
# resumes bit for bit; 6. SIGKILL while rank
# 1's writer holds its file unrenamed ("filled") leaves generation 1
# committed and loadable, whatever rank 0 did meanwhile (the commit waits
# for every rank's writer); a second hold drawn from EPJIT_TEST_SEED among
# the writer's phases on either rank and rank 0's "committed" (the record
# renamed, nothing pruned yet) leaves the generation that phase implies.
# Every wait polls a condition with a 120 s bound; none is a guess at time.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
CKPT="$builddir/tools/epjit-ckpt"
[ -x "$TRAIN" ] && [ -x "$CKPT" ] || {
	echo "SKIP: $TRAIN or $CKPT not built"
	exit 77
}
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
LC_ALL=C
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS LC_ALL
seed=${EPJIT_TEST_SEED:-$(date +%s)}
echo "seed $seed (EPJIT_TEST_SEED)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-save-test.XXXXXX") || exit 1
# the command of bg_start and a process held by EPJIT_TEST_SAVE_HOLD are
# killed on the way out
bgpid=
cmdpid=
held_pids() {
	cat ./*.log 2>/dev/null | sed -n 's/.*holds the save of step .* (pid \([0-9]*\)).*/\1/p'
}
trap 'cd "$tmp" && { p="$cmdpid $(held_pids)"; [ -z "${p# }" ] || kill -9 $p 2>/dev/null; wait; }; rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

nap() {
	sleep 0.1 2>/dev/null || sleep 1
}

# run LOG CMD...: CMD with output in LOG; fails unless exit 0.
run() {
	log=$1
	shift
	"$@" >"$log" 2>&1 || {
		cat "$log" >&2
		fail "$* exited non-zero"
	}
}

# rows CSV: step,loss,lr,grad_norm of every row.
rows() {
	sed 1d "$1" | cut -d, -f1-4
}

# same_tail REF CSV: CSV's rows are REF's last rows, bit for bit.
same_tail() {
	n=$(rows "$2" | wc -l)
	[ "$n" -gt 0 ] && [ "$(rows "$1" | tail -n "$n")" = "$(rows "$2")" ] ||
		fail "$2 does not repeat the last $n rows of $1: $(rows "$2") vs $(rows "$1" | tail -n "$n")"
}

# bg_start TAG CMD...: CMD in the background, output in TAG.log, its pid
# in $cmdpid (sh execs it: the same process), its exit status in TAG.rc
# once it ends; $bgpid the subshell that waits for it.
bg_start() {
	tag=$1
	shift
	rm -f "$tag.rc" "$tag.pid"
	(
		sh -c 'echo $$ >"$0.pid.tmp" && mv "$0.pid.tmp" "$0.pid" && exec "$@"' \
			"$tag" "$@" >"$tag.log" 2>&1
		echo $? >"$tag.rc.tmp" && mv "$tag.rc.tmp" "$tag.rc"
	) &
	bgpid=$!
	end=$(($(date +%s) + 120))
	until [ -s "$tag.pid" ]; do
		[ "$(date +%s)" -le "$end" ] || fail "$tag: no pid within 120 s"
		nap
	done
	cmdpid=$(cat "$tag.pid")
}

# wait_for TAG PATTERN...: until TAG.log has a line matching each PATTERN.
wait_for() {
	tag=$1
	shift
	end=$(($(date +%s) + 120))
	for p in "$@"; do
		until grep -q -- "$p" "$tag.log" 2>/dev/null; do
			[ ! -e "$tag.rc" ] ||
				fail "$tag: ended (exit $(cat "$tag.rc")) before '$p': $(cat "$tag.log")"
			[ "$(date +%s)" -le "$end" ] ||
				fail "$tag: no '$p' within 120 s: $(cat "$tag.log")"
			nap
		done
	done
}

# kill_held TAG: SIGKILL to the process that holds the save, then waits
# for TAG's command to end.
kill_held() {
	pid=$(sed -n 's/.*holds the save of step .* (pid \([0-9]*\)).*/\1/p' "$1.log" | head -n 1)
	[ -n "$pid" ] || fail "$1: no pid in the hold line: $(cat "$1.log")"
	kill -9 "$pid" || fail "$1: kill -9 $pid"
	end=$(($(date +%s) + 120))
	until [ -e "$1.rc" ]; do
		[ "$(date +%s)" -le "$end" ] || fail "$1: still running 120 s after SIGKILL"
		nap
	done
	wait "$bgpid" 2>/dev/null
	bgpid= cmdpid=
}

# ---- 1. periodic saves, foreground and background --------------------------
run ref.log "$TRAIN" --steps 6 --metrics ref.csv
for mode in fg bg cfg; do
	r=ref.csv
	case $mode in
	fg) extra= ;;
	bg) extra=--save-async ;;
	cfg) # another config than the built-in one: its own reference
		echo '{"checkpoint": {"writer": {"decoupled": true}}}' >dec.json
		extra="--config dec.json"
		run cref.log "$TRAIN" --steps 6 --config dec.json --metrics cref.csv
		r=cref.csv
		;;
	esac
	# shellcheck disable=SC2086
	run p$mode.log "$TRAIN" --steps 6 --save-every 2 $extra \
		--save p$mode.ckpt --metrics p$mode.csv
	[ "$(rows $r)" = "$(rows p$mode.csv)" ] ||
		fail "$mode: periodic saves changed the training: $(rows p$mode.csv)"
	bgs=" (background save)"
	[ $mode = fg ] && bgs=
	for s in 2 4; do
		grep -q "^epjit-train: saved step $s to p$mode.ckpt$bgs\$" p$mode.log ||
			fail "$mode: no save of step $s: $(grep saved p$mode.log)"
	done
	grep -q "^epjit-train: saved step 6 to p$mode.ckpt\$" p$mode.log ||
		fail "$mode: no final save: $(grep saved p$mode.log)"
	[ "$(grep -c 'saved step' p$mode.log)" -eq 3 ] ||
		fail "$mode: saves: $(grep saved p$mode.log)"
	run e$mode.log "$TRAIN" --steps 6 --load p$mode.ckpt
	grep -q 'is at step 6' e$mode.log || fail "$mode: $(cat e$mode.log)"
done
cmp pfg.ckpt pbg.ckpt || fail "the background save of step 6 differs"

# ---- 2. SIGKILL at each phase of a background save --------------------------
for phase in start write filled written; do
	rm -f k.ckpt*
	bg_start k env EPJIT_TEST_SAVE_HOLD="$phase::4" "$TRAIN" --steps 6 \
		--save-every 2 --save-async --save k.ckpt
	wait_for k "holds the save of step 4 at '$phase'"
	kill_held k
	want=2
	[ $phase = written ] && want=4
	run kr.log "$TRAIN" --steps 6 --load k.ckpt --metrics kr.csv
	grep -q "weights: k.ckpt (--load, step $want)" kr.log ||
		fail "killed at '$phase': $(grep weights kr.log)"
	same_tail ref.csv kr.csv
	[ "$(rows kr.csv | wc -l)" -eq $((6 - want)) ] || fail "$phase: $(cat kr.csv)"
done

# ---- 3. a failing writer; a stop during background saves -------------------
"$TRAIN" --steps 6 --save-every 2 --save-async --save no/such/dir/x.ckpt \
	--metrics nf.csv >nf.log 2>&1 && fail "a save into a missing folder exited 0"
grep -q "no/such/dir/x.ckpt" nf.log && grep -q 'exiting with status 1 after step' nf.log ||
	fail "the failed background save: $(cat nf.log)"
[ "$(rows nf.csv | wc -l)" -lt 6 ] || fail "the run went on after its save failed"
bg_start st "$TRAIN" --steps 100000 --save-every 1 --save-async \
	--save st.ckpt --metrics st.csv
end=$(($(date +%s) + 120))
until [ -f st.csv ] && [ "$(wc -l <st.csv)" -ge 4 ]; do
	[ ! -e st.rc ] || fail "st ended: $(cat st.log)"
	[ "$(date +%s)" -le "$end" ] || fail "st: no rows within 120 s"
	nap
done
kill -TERM "$cmdpid"
end=$(($(date +%s) + 120))
until [ -e st.rc ]; do
	[ "$(date +%s)" -le "$end" ] || fail "st: still running after SIGTERM"
	nap
done
wait "$bgpid" 2>/dev/null
bgpid= cmdpid=
[ "$(cat st.rc)" -eq 143 ] || fail "SIGTERM: exit $(cat st.rc): $(tail -n 5 st.log)"
n=$(sed -n 's/^epjit-train: SIGTERM: stopping after step \([0-9]*\)$/\1/p' st.log)
[ -n "$n" ] || fail "SIGTERM: $(tail -n 5 st.log)"
grep -q "saved step $n to st.ckpt" st.log || fail "SIGTERM: no save of step $n: $(grep saved st.log)"
run sr.log "$TRAIN" --steps $((n + 2)) --load st.ckpt --metrics sr.csv
run sref.log "$TRAIN" --steps $((n + 2)) --metrics sref.csv
same_tail sref.csv sr.csv

# ---- 4. command lines ----------------------------------------------------------
for bad in "--save-every 2" "--keep 2" "--save x --save-async" "--save x --save-every 0"; do
	# shellcheck disable=SC2086
	"$TRAIN" --steps 1 $bad >bad.log 2>&1
	[ $? -eq 2 ] || fail "'$bad' did not exit 2: $(cat bad.log)"
done
"$TRAIN" --steps 1 --save one.ckpt --keep 2 >k1.log 2>&1 && fail "--keep 2 on one rank exited 0"
grep -q 'keeping 2 checkpoints needs a checkpoint set' k1.log || fail "--keep 2: $(cat k1.log)"

# ---- 5, 6. two ranks -------------------------------------------------------------
MPIRUN=$(command -v mpirun || command -v mpiexec)
if [ -z "$MPIRUN" ] || ! grep -q '^#define HAVE_MPI 1' "$builddir/config.h" 2>/dev/null; then
	echo "note: no MPI: the 2-rank part is skipped"
	echo "PASS: save (1 rank)"
	exit 0
fi
OMPI_ALLOW_RUN_AS_ROOT=1
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM
# a sanitized build: what Open MPI allocates and keeps is not our leak
if [ "${EPJIT_SANITIZED:-0}" = 1 ]; then
	ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
	export ASAN_OPTIONS
fi
MODEL=$srcdir/t/models/byte.json
cat >ep2.json <<'EOF'
{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "steps_per_print": 1,
  "seed": 7,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "zero_optimization": {"stage": 1},
  "expert_parallel": {"enabled": true, "autoep_size": 2},
  "comm": {"timeout_s": 120}
}
EOF
mpi2() {
	log=$1
	shift
	timeout 300 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" --model "$MODEL" \
		--config ep2.json --seq 8 "$@" >"$log" 2>&1 || {
		cat "$log" >&2
		fail "mpirun -np 2 epjit-train $* exited non-zero"
	}
}
mpi2 m.log --steps 6 --metrics m.csv
# generation 1 saved with --keep 1 (no record copy), then resumed with
# --keep 2: generation 1 gets its copy at the commit of 2 and goes at 3
mpi2 k1.log --steps 2 --save k2.ckpt
mpi2 k2.log --steps 6 --load k2.ckpt --save-every 2 --save-async --keep 2 \
	--save k2.ckpt --metrics k2.csv
same_tail m.csv k2.csv
[ "$(ls k2.ckpt* | tr '\n' ' ')" = "k2.ckpt k2.ckpt.g2.rank0 k2.ckpt.g2.rank1 k2.ckpt.g2.record k2.ckpt.g3.rank0 k2.ckpt.g3.rank1 k2.ckpt.g3.record " ] ||
	fail "--keep 2: $(ls k2.ckpt*)"
cmp k2.ckpt k2.ckpt.g3.record || fail "the record of generation 3 is not k2.ckpt"
run k2i.log "$CKPT" info k2.ckpt.g2.record
grep -q 'generation 2' k2i.log && grep -q 'step: 4' k2i.log && grep -q 'consistent: yes' k2i.log ||
	fail "info of generation 2: $(cat k2i.log)"
mpi2 k2r.log --steps 6 --load k2.ckpt.g2.record --metrics k2r.csv
same_tail m.csv k2r.csv
[ "$(rows k2r.csv | wc -l)" -eq 2 ] || fail "resumed from generation 2: $(cat k2r.csv)"

# hold2 HOLD GEN STEP: a run of 8 steps saving every 2 in the background,
# held at HOLD (PHASE:RANK:4) and killed there: the committed generation
# is GEN (step STEP), whole, and resumes bit for bit.
mpi2 m8.log --steps 8 --metrics m8.csv
hold2() {
	rm -f q.ckpt*
	bg_start q env EPJIT_TEST_SAVE_HOLD="$1" "$MPIRUN" -np 2 \
		--oversubscribe -x EPJIT_TEST_SAVE_HOLD "$TRAIN" --model "$MODEL" \
		--config ep2.json --seq 8 --steps 8 --save-every 2 --save-async \
		--save q.ckpt
	wait_for q "holds the save of step 4 at '${1%%:*}'"
	case $1 in
	committed*) ;;
	*) # rank 0 commits if it ever will: at step 6's save at the latest
		end=$(($(date +%s) + 120))
		until grep -q -e 'waiting for the background save of step 4' \
			-e 'saved step 4 ' q.log; do
			[ ! -e q.rc ] || fail "$1: ended: $(cat q.log)"
			[ "$(date +%s)" -le "$end" ] || fail "$1: no wait within 120 s: $(cat q.log)"
			nap
		done
		;;
	esac
	kill_held q
	"$CKPT" info q.ckpt >qi.log 2>&1 ||
		fail "killed at $1: the set does not load: $(cat qi.log)"
	grep -q "generation $2)" qi.log && grep -q "step: $3\$" qi.log ||
		fail "killed at $1: expected generation $2: $(cat qi.log)"
	if [ "$2" -eq 2 ]; then # nothing pruned before every rank knew
		[ -f q.ckpt.g1.rank0 ] && [ -f q.ckpt.g1.rank1 ] ||
			fail "killed at $1: generation 1 pruned: $(ls q.ckpt*)"
	fi
	mpi2 qr.log --steps 8 --load q.ckpt --metrics qr.csv
	same_tail m8.csv qr.csv
	[ "$(rows qr.csv | wc -l)" -eq $((8 - $3)) ] || fail "$1: $(cat qr.csv)"
}
hold2 filled:1:4 1 2
set -- start:0:4 write:1:4 written:0:4 written:1:4 filled:0:4 committed:0:4
shift $((seed % 6))
case $1 in committed*) hold2 "$1" 2 4 ;; *) hold2 "$1" 1 2 ;; esac
echo "PASS: save"
exit 0
