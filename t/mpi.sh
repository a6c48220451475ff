#!/bin/sh
# t/mpi.sh -- two ranks under mpirun (make check sets top_builddir and
# top_srcdir; by hand: top_builddir=BUILD top_srcdir=SRC sh t/mpi.sh).
#
#  1. t/mpi_check (2 ranks, and 4 for EP 2 x EDP 2): the mpi comm's
#     collectives, an AutoEP layer sharded over
#     2 ranks against the unsharded layer (also with a rank that receives
#     nothing), EP = 2 / EP = 1 with ZeRO 0/1/2 against a single-rank
#     reference on the global batch (loss, routing, every gradient, the
#     update), Megatron's router losses over the ranks (the global aux
#     loss's counts summed), the expert-load metrics (exact sums of each
#     rank's loads, fixed routing balanced over both ranks, one all-reduce
#     a step), the collective timeout;
#     t/mpi_nccl_check (2 ranks): the cuda device on the stand-in driver
#     with NCCL on device buffers (the stand-in NCCL, t/fake_nccl.c): the
#     nccl comm's collectives, EP = 2 and data parallel (ZeRO 0 / 2)
#     training against a 1-rank cpu reference, which comm carried what;
#  2. epjit-train under mpirun: one progress line per step from rank 0,
#     --rank-log files of the other rank, the memory of every rank in the
#     summary and the metrics (the largest and its rank), one rank file per
#     rank of a
#     checkpoint set and its commit record; resuming on 2 ranks (bf16,
#     ZeRO 2, AdamW) is identical to the straight run; a second save is
#     generation 2 and removes generation 1; a rank killed mid-save leaves
#     generation 2 loadable; rank files of two saves, a file of another
#     save under the record's name and a missing file are refused by name
#     before any collective of training; a world of 1 and another ZeRO
#     stage are refused;
#     a plain HF file loads on 2 ranks; impossible EP sizes are refused; EP 2 x gradient accumulation 2 on 2
#     ranks trains as 1 rank x 4 on the same micro-batches (loss, norm);
#  3. the parity matrix at world 2 (EP 2, ZeRO 1, bf16, SGD lr 1.0):
#     nested / root x checkpointing off / on x async split plan off / on,
#     compiled against eager: 8/8 must pass on every rank, each table
#     naming its device, backend, dtype, world and layout, and with
#     checkpointing the routing row compares twice the calls (replays);
#     the same 8 on the cuda device (the stand-in driver and NCCL, one
#     kernel cache shared by the ranks and the cases, one NVRTC compile
#     per kernel source; about 1.5 min);
#  4. a rank that stops (SIGSTOP) or dies (SIGKILL) mid-run: the job exits
#     non-zero well within the timeout, the surviving rank naming the call.
# Exit 77 (SKIP) only where MPI is absent (no mpirun, or a build without
# MPI).  One thread per rank; about 3 min in all.

builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
CHECK="$builddir/t/mpi_check"
MPIRUN=$(command -v mpirun || command -v mpiexec)
if [ -z "$MPIRUN" ]; then
	echo "SKIP: no mpirun / mpiexec (apt-get install openmpi-bin)"
	exit 77
fi
if ! grep -q '^#define HAVE_MPI 1' "$builddir/config.h" 2>/dev/null; then
	echo "SKIP: built without MPI (configure --with-mpi)"
	exit 77
fi
[ -x "$TRAIN" ] && [ -x "$CHECK" ] || {
	echo "FAIL: $TRAIN or $CHECK not built" >&2
	exit 1
}
# CI runs as root; Open MPI refuses that without both variables.
OMPI_ALLOW_RUN_AS_ROOT=1
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM OMP_NUM_THREADS \
	OPENBLAS_NUM_THREADS

tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-mpi-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

# mpi2 LOG CMD...: CMD on 2 ranks, output in LOG; fails unless exit 0
# within $mpi2_timeout seconds (default 300).
mpi2() {
	log=$1
	shift
	timeout "${mpi2_timeout:-300}" "$MPIRUN" -np 2 --oversubscribe "$@" \
		>"$log" 2>&1
	rc=$?
	if [ $rc -ne 0 ]; then
		# every rank's output (rank 0's, the others' prefixed "rank R
		# of N"), the last lines first where a short view sees them
		cat "$log" >&2
		echo "---- the last 20 lines of $log ----" >&2
		tail -n 20 "$log" >&2
		[ $rc -eq 124 ] &&
			fail "mpirun -np 2 $* timed out after ${mpi2_timeout:-300} s"
		fail "mpirun -np 2 $* exited $rc"
	fi
}

last_fields() {
	tail -n 1 "$1" | cut -d, -f1-4
}

# ---- 1. the library under two ranks -------------------------------------------
mpi2 check.log "$CHECK"
cat check.log
grep -q 'mpi_check: PASS' check.log || fail "mpi_check did not pass"
# 4 ranks: EP 2 x expert-data-parallel 2 (expert partitions under ZeRO)
if ! timeout 300 "$MPIRUN" -np 4 --oversubscribe "$CHECK" >check4.log 2>&1; then
	cat check4.log >&2
	fail "mpi_check on 4 ranks"
fi
grep -q 'mpi_check: PASS (0 failures over 4 ranks)' check4.log ||
	fail "mpi_check on 4 ranks did not pass"

# 2 ranks on the cuda device without a GPU: the stand-in driver and the
# stand-in NCCL (built by make check), kernels on cuda-sim, device memory
# guarded (a host access to it faults).  About 50 s.
FAKECUDA="$builddir/t/.libs/libfakecuda.so"
FAKENCCL="$builddir/t/.libs/libfakenccl.so"
# the GEMMs through the stand-in cuBLASLt: a real libcublasLt on this
# machine must never see the stand-in driver's pointers
FAKELT="$builddir/t/.libs/libfakecublaslt.so"
[ -f "$FAKELT" ] || FAKELT=0
if [ -f "$FAKECUDA" ] && [ -f "$FAKENCCL" ] &&
	grep -q '^#define HAVE_NVRTC 1' "$builddir/config.h"; then
	mkdir -p nccl.d
	(
		EPJIT_CUDA_DRIVER=$FAKECUDA EPJIT_NCCL=$FAKENCCL FAKE_CUDA_GUARD=1
		EPJIT_SIM_RACECHECK=0 FAKE_NCCL_DIR=$PWD/nccl.d
		EPJIT_CUBLASLT=$FAKELT EPJIT_CUBLAS=$FAKELT top_srcdir=$srcdir
		export EPJIT_CUDA_DRIVER EPJIT_NCCL FAKE_CUDA_GUARD \
			EPJIT_SIM_RACECHECK FAKE_NCCL_DIR EPJIT_CUBLASLT EPJIT_CUBLAS \
			top_srcdir
		mpi2 nccl.log "$builddir/t/mpi_nccl_check"
	) || exit 1
	cat nccl.log
	grep -q 'mpi_nccl_check: PASS' nccl.log || fail "mpi_nccl_check did not pass"
	[ -z "$(ls nccl.d)" ] || fail "the stand-in NCCL left $(ls nccl.d)"
else
	echo "mpi.sh: no stand-in driver / NCCL or no NVRTC: cuda ranks skipped"
fi

# ---- 2. the trainer ------------------------------------------------------------
cat >ep2.json <<'EOF'
{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 1,
  "steps_per_print": 1,
  "seed": 11,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
  "zero_optimization": {"stage": 2},
  "expert_parallel": {"enabled": true, "autoep_size": 2, "async_split_plan": true},
  "gradient_clipping": 1.0,
  "comm": {"timeout_s": 60}
}
EOF
sed 's/"stage": 2/"stage": 1/' ep2.json >ep2z1.json
mpi2 a1.log "$TRAIN" --config ep2.json --steps 3 --seq 8 --save a1.ckpt \
	--metrics a1.csv --rank-log a1
n=$(grep -c '^step ' a1.log)
[ "$n" -eq 3 ] || fail "expected 3 progress lines from rank 0, got $n: $(cat a1.log)"
[ -s a1.rank1.log ] || fail "--rank-log wrote no a1.rank1.log"
grep -q '^step ' a1.rank1.log || fail "rank 1 log lacks its progress"
[ -f a1.rank0.log ] && fail "rank 0 should print, not log"
grep -q 'autoep.split_plan.async' a1.log || fail "async plan not counted"
[ -s a1.ckpt.g1.rank0 ] && [ -s a1.ckpt.g1.rank1 ] ||
	fail "checkpoint: one file per rank expected: $(ls)"
grep -q '"format": "epjit-checkpoint-set-1"' a1.ckpt &&
	grep -q '"generation": 1,' a1.ckpt && grep -q '"step": 3,' a1.ckpt ||
	fail "no commit record a1.ckpt: $(cat a1.ckpt)"
"$TRAIN" --list-safetensors a1.ckpt.g1.rank1 >r1.txt 2>&1 || fail "list: $(cat r1.txt)"
grep -q 'meta world_size=2' r1.txt || fail "rank file lacks world_size"
grep -q 'meta generation=1' r1.txt || fail "rank file lacks its generation"
grep -q '^optimizer.master_shard.lm_head.weight F32' r1.txt ||
	fail "rank file lacks the ZeRO master shard"
grep -q '^model.layers.0.mlp.experts.3.up_proj.weight ' r1.txt ||
	fail "rank 1 does not hold expert 3"
grep -q '^model.layers.0.mlp.experts.0.up_proj.weight ' r1.txt &&
	fail "rank 1 holds expert 0"

# Memory of every rank: the summary and the metrics report the largest over
# the ranks and the (lowest) rank that holds it, checked against the memory.*
# counters each rank prints of its own at the end (rank 0 in a1.log, rank 1
# in its --rank-log).  With this config rank 1 holds the peak allocated.
mem() { # LOG COUNTER: the counter's value in LOG
	awk -v c="memory.$2" '$1 == c { print $2 }' "$1"
}
for k in peak_allocated peak_reserved reserved; do
	v0=$(mem a1.log $k)
	v1=$(mem a1.rank1.log $k)
	[ -n "$v0" ] && [ -n "$v1" ] || fail "no memory.$k counters: $(cat a1.log)"
	want=$(awk -v a="$v0" -v b="$v1" 'BEGIN {
		printf "%.1f MiB (rank %d)", (b > a ? b : a) / 1048576, (b > a) }')
	what=$(echo $k | tr _ ' ')
	grep -q "^summary: memory, the largest of 2 ranks: .*$what $want" a1.log ||
		fail "summary: $what should be $want: $(grep 'summary: memory' a1.log)"
	[ $k = peak_allocated ] && pa0=$v0 pa1=$v1
done
# the metrics' last row: the evaluation after it (forward only, the
# training shape) does not raise the peak allocated
row=$(tail -n 1 a1.csv)
want=$(awk -v a="$pa0" -v b="$pa1" 'BEGIN { print (b > a ? b : a) "," (b > a) }')
[ "$(echo "$row" | cut -d, -f6,10)" = "$want" ] ||
	fail "metrics: peak_alloc_bytes,peak_alloc_rank should be $want: $row"
[ "$(echo "$row" | cut -d, -f12)" -le 1 ] || fail "metrics: peak_reserved_rank: $row"

mpi2 a2.log "$TRAIN" --config ep2.json --steps 6 --seq 8 --load a1.ckpt \
	--save a2.ckpt --metrics a2.csv
mpi2 b.log "$TRAIN" --config ep2.json --steps 6 --seq 8 --save b.ckpt \
	--metrics b.csv
sed 1d a2.csv | cut -d, -f1-4 >a2.txt
tail -n 3 b.csv | cut -d, -f1-4 >b3.txt
cmp -s a2.txt b3.txt || fail "resume on 2 ranks differs: $(cat a2.txt) vs $(cat b3.txt)"
cmp a2.ckpt.g1.rank0 b.ckpt.g1.rank0 && cmp a2.ckpt.g1.rank1 b.ckpt.g1.rank1 ||
	fail "resumed rank files differ from the straight run"

# ---- checkpoint sets: whole or refused ------------------------------------
# (failN LOG WHAT CMD...: CMD on 2 ranks must fail, naming WHAT in LOG.)
fail2() {
	log=$1 what=$2
	shift 2
	timeout 300 "$MPIRUN" -np 2 --oversubscribe "$@" >"$log" 2>&1 &&
		fail "accepted ($what): $(cat "$log")"
	grep -q "$what" "$log" || fail "expected '$what': $(cat "$log")"
	grep -q 'MPI_ERR\|heap\|free()' "$log" &&
		fail "a refused set reached the collectives: $(cat "$log")"
	return 0
}
# A second save to the same path is generation 2: the record names it, the
# files of generation 1 are gone.
mkdir s && cp a1.ckpt a1.ckpt.g1.rank0 a1.ckpt.g1.rank1 s/
mpi2 s2.log "$TRAIN" --config ep2.json --steps 5 --seq 8 --load s/a1.ckpt \
	--save s/a1.ckpt
grep -q '"generation": 2,' s/a1.ckpt && grep -q '"step": 5,' s/a1.ckpt ||
	fail "second save: $(cat s/a1.ckpt)"
[ -e s/a1.ckpt.g1.rank0 ] || [ -e s/a1.ckpt.g1.rank1 ] &&
	fail "generation 1 not removed after generation 2: $(ls s)"
# A rank killed mid-save (its file written, the record not yet): the set
# of generation 2 stays what loads, and the next save commits over it.
EPJIT_TEST_SAVE_KILL_RANK=1 timeout 300 "$MPIRUN" -np 2 --oversubscribe \
	-x EPJIT_TEST_SAVE_KILL_RANK "$TRAIN" --config ep2.json --steps 7 \
	--seq 8 --load s/a1.ckpt --save s/a1.ckpt >kill.log 2>&1 &&
	fail "the killed save exited 0: $(cat kill.log)"
grep -q '"generation": 2,' s/a1.ckpt || fail "a killed save committed: $(cat s/a1.ckpt)"
mpi2 s3.log "$TRAIN" --config ep2.json --steps 6 --seq 8 --load s/a1.ckpt \
	--metrics s3.csv
[ "$(sed -n 2p s3.csv | cut -d, -f1)" = 6 ] ||
	fail "after a killed save the set of step 5 should resume: $(cat s3.csv)"
# Rank files of two saves (the legacy form, no record): refused by name,
# before any collective of training.
cp a1.ckpt.g1.rank0 mix.ckpt.rank0
cp a2.ckpt.g1.rank1 mix.ckpt.rank1
fail2 mix.log "mixes saves" "$TRAIN" --config ep2.json --steps 9 --seq 8 \
	--load mix.ckpt
grep -q 'mix.ckpt.rank1 (rank 1) at step 6' mix.log || fail "mixed set: $(cat mix.log)"
# A file of another save under the record's name, and a missing file.
mkdir t && cp s/a1.ckpt s/a1.ckpt.g2.rank0 t/ &&
	cp b.ckpt.g1.rank1 t/a1.ckpt.g2.rank1
fail2 tamper.log "is not the one the record names" "$TRAIN" --config ep2.json \
	--steps 9 --seq 8 --load t/a1.ckpt
rm t/a1.ckpt.g2.rank1
fail2 missing.log "is incomplete: rank 1's file t/a1.ckpt.g2.rank1 is missing" \
	"$TRAIN" --config ep2.json --steps 9 --seq 8 --load t/a1.ckpt

sed 's/"autoep_size": 2/"autoep_size": 1/' ep2.json >ep1.json
"$TRAIN" --config ep1.json --steps 4 --load a1.ckpt >w1.txt 2>&1 &&
	fail "a world of 1 loaded a 2-rank checkpoint"
grep -q 'the record of a checkpoint of 2 ranks' w1.txt ||
	fail "world-of-1 refusal: $(cat w1.txt)"
timeout 300 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" --config ep2z1.json \
	--steps 4 --seq 8 --load a1.ckpt >z1.txt 2>&1 &&
	fail "ZeRO 1 loaded a ZeRO 2 checkpoint"
grep -q 'zero_optimization.stage=2' z1.txt || fail "ZeRO refusal: $(cat z1.txt)"

# A plain HF f32 file (a single-rank checkpoint without "optimizer.*")
# loads on 2 ranks: every rank takes its experts from it.
if command -v python3 >/dev/null 2>&1; then
	"$TRAIN" --steps 2 --seq 8 --save one.ckpt >one.log 2>&1 ||
		fail "single-rank save: $(cat one.log)"
	python3 - one.ckpt hf.safetensors <<'EOF' || fail "python3 could not write hf.safetensors"
import json, struct, sys
with open(sys.argv[1], "rb") as f:
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
with open(sys.argv[2], "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
EOF
	sed -e 's/"enabled": true}/"enabled": false}/' ep2.json >ep2f32.json
	mpi2 hf.log "$TRAIN" --config ep2f32.json --seq 8 --load hf.safetensors \
		--dump-state d.st
	[ -s d.st.rank0 ] && [ -s d.st.rank1 ] || fail "--dump-state: no rank files"
	python3 - hf.safetensors d.st.rank1 <<'EOF' || fail "rank 1 did not take its weights from the HF file"
import json, struct, sys
def read(p):
    with open(p, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), f.read()
(ha, da), (hb, db) = read(sys.argv[1]), read(sys.argv[2])
for k in ("lm_head.weight", "model.layers.1.mlp.experts.3.up_proj.weight"):
    a, b = ha[k]["data_offsets"], hb[k]["data_offsets"]
    assert da[a[0]:a[1]] == db[b[0]:b[1]], k
assert "model.layers.1.mlp.experts.0.up_proj.weight" not in hb
EOF
fi

# EP 2 on 2 ranks against one rank on the same global batches, through the
# trainer: rank r takes micro-batches r, r + 2, ... so 2 ranks x 2
# accumulation steps see the micro-batches of 1 rank x 4.  Loss and
# gradient norm of every step agree to f32 rounding.
cat >g1.json <<'EOF'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
 "steps_per_print": 1, "seed": 5, "gradient_clipping": 1.0,
 "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
EOF
sed -e 's/"gradient_accumulation_steps": 4/"gradient_accumulation_steps": 2/' \
	-e 's/"seed": 5,/"seed": 5, "zero_optimization": {"stage": 1}, "expert_parallel": {"autoep_size": 2},/' \
	g1.json >g2.json
"$TRAIN" --config g1.json --steps 3 --seq 8 --metrics g1.csv >g1.log 2>&1 ||
	fail "one rank, gas 4: $(cat g1.log)"
mpi2 g2.log "$TRAIN" --config g2.json --steps 3 --seq 8 --metrics g2.csv
paste -d, g1.csv g2.csv | sed 1d | awk -F, '
	function rel(a, b) { d = a - b; if (d < 0) d = -d; return d / (b < 0 ? -b : b) }
	{ h = NF / 2  # the columns of g1.csv, then those of g2.csv
	  if (rel($(h + 2), $2) > 1e-5 || rel($(h + 4), $4) > 1e-5) bad = 1; n++ }
	END { exit bad || n != 3 }' ||
	fail "EP 2 on 2 ranks differs from 1 rank: $(cat g1.csv g2.csv)"

# Expert-parallel sizes that cannot work are refused at initialize.
sed 's/"num_experts": 4,/"num_experts": 3,/' "$srcdir/t/models/byte.json" >e3.json
timeout 300 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" --model e3.json \
	--config ep2.json --steps 1 --seq 8 >e3.txt 2>&1 &&
	fail "3 experts sharded over 2 ranks"
grep -q "num_experts=3 is not divisible by expert_parallel.autoep_size=2" e3.txt ||
	fail "3 experts over 2: $(cat e3.txt)"
sed 's/"autoep_size": 2/"autoep_size": 4/' ep2.json >ep4.json
timeout 300 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" --config ep4.json \
	--steps 1 --seq 8 >ep4.txt 2>&1 && fail "autoep_size 4 on 2 ranks"
grep -q "autoep_size=4 needs a world of a multiple of 4 ranks; this run has 2" ep4.txt ||
	fail "autoep_size 4 on 2 ranks: $(cat ep4.txt)"

# ---- 3. the parity matrix at world 2 --------------------------------------------
pass=0
for layout in nested root; do
	for ck in "" --checkpointing; do
		for as in "" --async-split-plan; do
			log="parity-$layout$ck$as.log"
			mpi2 "$log" "$TRAIN" --parity --bf16 --layout "$layout" \
				$ck $as
			grep -q 'every rank passed' "$log" &&
				grep -q '^parity: PASS' "$log" ||
				fail "parity $layout $ck $as: $(cat "$log")"
			grep -q "^parity: device cpu, backend c, dtype bf16, world size 2 (EP 2, ZeRO 1), layout $layout\$" "$log" ||
				fail "parity $layout $ck $as: no header: $(cat "$log")"
			# the routing row's calls: with checkpointing the
			# replays too, twice the calls of the run without
			calls=$(awk '$1 == "routing" && $2 == "mismatches" {
				print $4; exit }' "$log")
			key=$(printf '%s' "$layout$as" | tr -c 'a-z0-9' '_')
			if [ -z "$ck" ]; then
				eval "calls_$key=\$calls"
			else
				eval "want=\$((2 * calls_$key))"
				[ -n "$calls" ] && [ "$calls" -gt 0 ] &&
					[ "$calls" -eq "$want" ] ||
					fail "parity $layout $ck $as: routing of $calls calls, expected $want (the replays counted)"
			fi
			pass=$((pass + 1))
		done
	done
done
[ "$pass" -eq 8 ] || fail "parity: $pass/8"
echo "parity at world 2: $pass/8"

# The same matrix as the seed ran it, 2 ranks each on a cuda context: the
# stand-in driver and NCCL, every kernel run on cuda-sim from the CUDA C the
# NVRTC pass-through (preloaded) saw compiled.  The pass-through keeps its
# image -> source table in one folder (FAKE_NVRTC_SOURCES) and all eight
# runs share one kernel cache this script made, as the ranks of one node
# would: a cubin that one rank (or an earlier case) compiled and cached is
# run by the other from the source recorded for it.  The first case
# compiles (about 1 min on 2 idle cores; the ranks wait on the cache's
# per-key lock instead of compiling a kernel twice), the others mostly hit.
FAKENVRTC="$builddir/t/.libs/libfakenvrtc.so"
if [ -f "$FAKECUDA" ] && [ -f "$FAKENCCL" ] && [ -f "$FAKENVRTC" ] &&
	grep -q '^#define HAVE_NVRTC 1' "$builddir/config.h"; then
	mkdir -p pnccl.d
	mkdir -m 700 cuda-kc cuda-src || fail "mkdir cuda-kc cuda-src"
	cpass=0
	for layout in nested root; do
		for ck in "" --checkpointing; do
			for as in "" --async-split-plan; do
				log="cuda-parity-$layout$ck$as.log"
				(
					EPJIT_CUDA_DRIVER=$FAKECUDA EPJIT_NCCL=$FAKENCCL
					FAKE_CUDA_GUARD=1 EPJIT_SIM_RACECHECK=0
					FAKE_NCCL_DIR=$PWD/pnccl.d EPJIT_DEVICE=cuda
					EPJIT_CUBLASLT=$FAKELT EPJIT_CUBLAS=$FAKELT
					LD_PRELOAD=$FAKENVRTC mpi2_timeout=900
					EPJIT_CACHE_DIR=$PWD/cuda-kc
					FAKE_NVRTC_SOURCES=$PWD/cuda-src
					FAKE_NVRTC_LOG=$PWD/cuda-nvrtc.log
					export EPJIT_CUDA_DRIVER EPJIT_NCCL \
						FAKE_CUDA_GUARD EPJIT_SIM_RACECHECK \
						FAKE_NCCL_DIR EPJIT_DEVICE EPJIT_CUBLASLT \
						EPJIT_CUBLAS LD_PRELOAD EPJIT_CACHE_DIR \
						FAKE_NVRTC_SOURCES FAKE_NVRTC_LOG
					mpi2 "$log" "$TRAIN" --parity --bf16 \
						--layout "$layout" $ck $as
				) || exit 1
				grep -q 'every rank passed' "$log" &&
					grep -q '^parity: PASS' "$log" &&
					grep -q "^parity: device cuda, backend nvrtc, dtype bf16, world size 2 (EP 2, ZeRO 1), layout $layout\$" "$log" ||
					fail "cuda parity $layout $ck $as: $(cat "$log")"
				# the compiled arm ran compiled kernels on the
				# stand-in, every one of them found on cuda-sim
				grep -q '^  compiled launches > 0  *1  *1  *ok' "$log" ||
					fail "cuda parity $layout $ck $as: no compiled launches: $(cat "$log")"
				! grep -q 'cannot run it' "$log" ||
					fail "cuda parity $layout $ck $as: a kernel did not run: $(cat "$log")"
				# routing compared call by call, replays included:
				# as many calls as the cpu matrix's same case
				calls=$(awk '$1 == "routing" && $2 == "mismatches" {
					print $4; exit }' "$log")
				want=$(awk '$1 == "routing" && $2 == "mismatches" {
					print $4; exit }' "parity-$layout$ck$as.log")
				[ -n "$calls" ] && [ "$calls" -gt 0 ] &&
					[ "$calls" = "$want" ] ||
					fail "cuda parity $layout $ck $as: routing of $calls calls, the cpu's $want"
				cpass=$((cpass + 1))
			done
		done
	done
	[ "$cpass" -eq 8 ] || fail "cuda parity: $cpass/8"
	# the table on disk holds the kernels' sources (a later case that
	# hit the cache ran its cubins from there, or failed above)
	nsrc=$(ls cuda-src | wc -l)
	[ "$nsrc" -gt 20 ] || fail "cuda parity: $nsrc sources recorded"
	# one NVRTC compile per source over 2 ranks x 8 cases: the ranks
	# that miss a key at once wait on its lock and load the entry
	ncomp=$(wc -l <cuda-nvrtc.log)
	nuniq=$(sort -u cuda-nvrtc.log | wc -l)
	[ "$ncomp" -eq "$nuniq" ] && [ "$ncomp" -gt 20 ] ||
		fail "cuda parity: $ncomp NVRTC compiles of $nuniq sources (one each expected)"
	echo "parity at world 2 on the cuda device (stand-ins): $cpass/8, $nsrc kernel sources, $ncomp NVRTC compiles"
else
	echo "mpi.sh: parity on the cuda device at world 2 not run (no NVRTC or no stand-ins)"
fi

# ---- 4. a rank that vanishes -----------------------------------------------------
sed 's/"timeout_s": 60/"timeout_s": 3/' ep2.json >short.json
for fault in stop kill; do
	start=$(date +%s)
	timeout 120 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" --config short.json \
		--steps 5 --seq 8 --fault "$fault" --fault-step 3 \
		--fault-rank 1 >"f-$fault.txt" 2>&1
	rc=$?
	took=$(($(date +%s) - start))
	[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] ||
		fail "--fault $fault: exit $rc: $(cat "f-$fault.txt")"
	[ "$took" -lt 60 ] || fail "--fault $fault: took $took s"
	grep -q 'rank 1: --fault' "f-$fault.txt" ||
		fail "--fault $fault: no fault injected: $(cat "f-$fault.txt")"
done
# Two ranks compiling into one empty kernel cache: each key is compiled
# once on this host (the key's lock), every entry verifies, and the debug
# dump has a folder per rank that epjit-dump shows side by side.
rm -rf kc2 dump2
mkdir -m 700 kc2
EPJIT_CACHE_DIR=$PWD/kc2 EPJIT_DEBUG_DUMP=$PWD/dump2 mpi2 kc2.log "$TRAIN" \
	--compile --steps 2 --seq 8
for r in 0 1; do
	[ -f "dump2/rank$r/counters.json" ] ||
		fail "two ranks: no dump2/rank$r/counters.json: $(ls -R dump2)"
done
compiles=$(cat dump2/rank0/counters.json dump2/rank1/counters.json |
	tr ',{}' '\n\n\n' | sed -n 's/.*"codegen.cc_compiles": *\([0-9]*\).*/\1/p' |
	awk '{ s += $1 } END { print s + 0 }')
entries=$(find kc2 -name '*.bin' | wc -l)
[ "$entries" -gt 0 ] && [ "$compiles" -eq "$entries" ] ||
	fail "two ranks, one cache: $compiles compiles for $entries entries"
"$builddir/tools/epjit-dump" dump2 >dump2.txt 2>&1 ||
	fail "epjit-dump of the rank folders: $(cat dump2.txt)"
grep -q 'rank0' dump2.txt && grep -q 'rank1' dump2.txt ||
	fail "epjit-dump does not show both ranks: $(cat dump2.txt)"
# A stopped peer: rank 0 itself reports the call that timed out.
grep -q 'rank 0 of 2: .*did not complete within 3 s' f-stop.txt ||
	fail "stopped peer: rank 0's message: $(cat f-stop.txt)"
echo "PASS: mpi"
exit 0
