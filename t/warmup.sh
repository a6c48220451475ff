#!/bin/sh
# t/warmup.sh -- epjit-warmup fills a kernel cache after which a compiled
# epjit-train run with the same flags compiles nothing.
#
#  1. control: a compiled run on an empty cache misses (so the check below
#     can fail);
#  2. for a matrix of runs (default; checkpointing; root layout with
#     checkpointing; a bf16 config with gradient accumulation, an odd batch
#     3 x 17 and checkpointing; full-model compile): warm a fresh cache, then
#     train 2 steps with EPJIT_DEBUG_DUMP: cache.misses, compile.cc_us
#     (host compiler time), compile.us and compile.ms must be 0,
#     compile.cached_us (passes and loading, before step 1) and
#     cache.disk_hits > 0;
#  3. a second warm-up finds everything cached and compiles nothing;
#     --dry-run lists the same keys and compiles nothing;
#  4. archives: export + import into a fresh cache, after which a run has
#     no misses; a flipped byte, a truncated archive and another host
#     compiler ($EPJIT_CC) are refused and leave the cache empty;
#  5. with NVRTC: cubins for two archs, listed and exported;
#  6. bad command lines exit 2;
#  7. the 48-layer qwen3-30b-a3b config (t/models/qwen3-30b-a3b.json, 30B
#     parameters, 120 GB in f32) warms up under a 3 GB address-space limit:
#     shapes only, each unique graph once;
#  8. expert parallelism (autoep_size 2): one process warms the cache for
#     the ranks (the world from the config's batch sizes, or --world),
#     after which an EP-2 run under mpirun -np 2 has, on each rank,
#     cache.misses 0 and no compile (codegen.cc_compiles, compile.us,
#     compile.cc_us 0); epjit-warmup itself runs under mpirun as well.
# Exit 77 when the tools were not built.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
WARM="$builddir/tools/epjit-warmup"
TRAIN="$builddir/tools/epjit-train"
if [ ! -x "$WARM" ] || [ ! -x "$TRAIN" ]; then
	echo "SKIP: epjit-warmup or epjit-train not built"
	exit 77
fi
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-warmup-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

# ctr FILE NAME: a counter of a counters.json (0 when absent).
ctr() {
	v=$(tr ',{}' '\n\n\n' <"$1" | grep "\"$2\":" | sed 's/.*: *//')
	echo "${v:-0}"
}

entries() {
	find "$1" -name '*.bin' 2>/dev/null | wc -l
}

# warm DIR ARGS...: epjit-warmup into cache DIR.
warm() {
	dir=$1
	shift
	EPJIT_CACHE_DIR=$dir "$WARM" -j 2 "$@" >warm.log 2>&1 ||
		{ cat warm.log >&2; fail "epjit-warmup $* exited non-zero"; }
}

# train DIR DUMP ARGS...: 2 compiled steps on cache DIR, counters in DUMP.
train() {
	dir=$1
	dump=$2
	shift 2
	rm -rf "$dump"
	EPJIT_CACHE_DIR=$dir EPJIT_DEBUG_DUMP=$dump "$TRAIN" --compile \
	    --steps 2 "$@" >train.log 2>&1 ||
		{ cat train.log >&2; fail "epjit-train $* exited non-zero"; }
	[ -f "$dump/counters.json" ] || fail "no $dump/counters.json"
}

# ---- 1. control ---------------------------------------------------------------
train "$tmp/cold" cold
[ "$(ctr cold/counters.json cache.misses)" -gt 0 ] ||
	fail "a run on an empty cache did not miss"
[ "$(ctr cold/counters.json compile.cc_us)" -gt 0 ] ||
	fail "a run on an empty cache spent no time in the host compiler"
[ "$(ctr cold/counters.json compile.ms)" -gt 0 ] ||
	fail "a run on an empty cache has no compile.ms"
[ "$(ctr cold/counters.json compile.cached_us)" -eq 0 ] ||
	fail "a run on an empty cache counted compile.cached_us"

# ---- 2. the matrix ------------------------------------------------------------
cat >bf16.json <<'EOF'
{"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
 "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
 "compile": {"autoep_non_moe": true}}
EOF
cat >full.json <<'EOF'
{"train_micro_batch_size_per_gpu": 2, "compile": {"autoep_non_moe": false}}
EOF
i=0
for args in "" "--checkpointing" "--layout root --checkpointing" \
    "--config bf16.json --seq 17 --checkpointing" "--config full.json"; do
	i=$((i + 1))
	# shellcheck disable=SC2086
	warm "$tmp/c$i" $args
	grep -q 'compiled' warm.log || fail "warm-up $args compiled nothing"
	# shellcheck disable=SC2086
	train "$tmp/c$i" d$i $args
	m=$(ctr d$i/counters.json cache.misses)
	h=$(ctr d$i/counters.json cache.disk_hits)
	[ "$m" -eq 0 ] || fail "after warm-up ($args): cache.misses = $m"
	[ "$(ctr d$i/counters.json compile.cc_us)" -eq 0 ] ||
		fail "after warm-up ($args): the host compiler ran"
	# compile.us/ms count compilation only; loading from the cache and
	# the graph passes go to compile.cached_us, all before step 1
	for c in compile.ms compile.us; do
		[ "$(ctr d$i/counters.json $c)" -eq 0 ] ||
			fail "after warm-up ($args): $c = $(ctr d$i/counters.json $c)"
	done
	[ "$(ctr d$i/counters.json compile.cached_us)" -gt 0 ] ||
		fail "after warm-up ($args): no compile.cached_us"
	grep -q 'compiled before step 1 in .*(compile.ms 0,' train.log ||
		fail "after warm-up ($args): $(grep 'compiled:' train.log)"
	[ "$h" -gt 0 ] || fail "after warm-up ($args): no disk hits"
	[ "$(ctr d$i/counters.json kernels.launched.compiled)" -gt 0 ] ||
		fail "after warm-up ($args): no compiled kernel ran"
done

# ---- 3. warm again, dry run -----------------------------------------------------
n=$(entries "$tmp/c1")
warm "$tmp/c1"
grep -q ' 0 compiled, [1-9][0-9]* already cached' warm.log ||
	fail "second warm-up recompiled: $(tail -n 2 warm.log)"
[ "$(entries "$tmp/c1")" -eq "$n" ] || fail "second warm-up added entries"
EPJIT_CACHE_DIR=$tmp/c1 "$WARM" --dry-run >dry.log 2>&1 ||
	fail "--dry-run failed: $(cat dry.log)"
grep -c '^cached ' dry.log >/dev/null || fail "--dry-run listed nothing"
! grep -q '^missing ' dry.log || fail "--dry-run after warm-up: missing keys"
EPJIT_CACHE_DIR=$tmp/dry "$WARM" --dry-run >dry2.log 2>&1 ||
	fail "--dry-run failed: $(cat dry2.log)"
[ "$(entries "$tmp/dry")" -eq 0 ] || fail "--dry-run compiled something"
[ "$(grep -c '^missing ' dry2.log)" -eq "$(grep -c '^cached ' dry.log)" ] ||
	fail "--dry-run lists differ between a warm and an empty cache"
sed -n 's/^cached *//p' dry.log | sort >k1
sed -n 's/^missing *//p' dry2.log | sort >k2
cmp -s k1 k2 || fail "--dry-run keys differ between a warm and an empty cache"

# ---- 4. archives ------------------------------------------------------------------
EPJIT_CACHE_DIR=$tmp/c2 "$WARM" --export all.epjka >exp.log 2>&1 ||
	fail "export failed: $(cat exp.log)"
EPJIT_CACHE_DIR=$tmp/imp "$WARM" --import all.epjka >imp.log 2>&1 ||
	fail "import failed: $(cat imp.log)"
[ "$(entries "$tmp/imp")" -eq "$(entries "$tmp/c2")" ] ||
	fail "import did not restore every entry"
train "$tmp/imp" dimp --checkpointing
[ "$(ctr dimp/counters.json cache.misses)" -eq 0 ] ||
	fail "after import: cache.misses = $(ctr dimp/counters.json cache.misses)"
# with a model: the entries this warm-up needs (here: those of run 4)
EPJIT_CACHE_DIR=$tmp/c4 "$WARM" --config bf16.json --seq 17 \
    --checkpointing --export part.epjka >exp2.log 2>&1 ||
	fail "export with a model failed: $(cat exp2.log)"
grep -q "exported $(entries "$tmp/c4") entr" exp2.log ||
	fail "export with a model: $(tail -n 1 exp2.log)"
size=$(wc -c <all.epjka)
# a flipped byte in the middle, a truncated archive, another host cc
cp all.epjka bad.epjka
printf 'X' | dd of=bad.epjka bs=1 seek=$((size / 2)) conv=notrunc 2>/dev/null
head -c $((size - 100)) all.epjka >short.epjka
for a in bad.epjka short.epjka; do
	if EPJIT_CACHE_DIR=$tmp/r-$a "$WARM" --import $a >rej.log 2>&1; then
		fail "import of $a succeeded"
	fi
	grep -q '^epjit-warmup: .*nothing imported' rej.log ||
		fail "import of $a: $(cat rej.log)"
	[ "$(entries "$tmp/r-$a")" -eq 0 ] || fail "import of $a wrote entries"
done
# a FIFO and /dev/zero: refused by name at once (not a hang, not a spin)
mkfifo fifo.epjka
for a in fifo.epjka /dev/zero; do
	timeout 60 env EPJIT_CACHE_DIR=$tmp/r-fifo "$WARM" --import $a \
		>rej.log 2>&1
	rc=$?
	[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "import of $a: exit $rc"
	grep -q 'not a regular file' rej.log || fail "import of $a: $(cat rej.log)"
done
if EPJIT_CC="cc -w" EPJIT_CACHE_DIR=$tmp/r-cc "$WARM" --import all.epjka \
    >rej.log 2>&1; then
	fail "import with another host compiler succeeded"
fi
grep -q 'host compiler' rej.log || fail "another cc: $(cat rej.log)"
[ "$(entries "$tmp/r-cc")" -eq 0 ] || fail "refused import wrote entries"

# ---- 5. NVRTC ----------------------------------------------------------------------
if EPJIT_CACHE_DIR=$tmp/cu "$WARM" --backend cuda --arch sm_80,sm_90 \
    -j 2 >cu.log 2>&1; then
	nc=$(grep -c '^compiled .* sm_80$' cu.log)
	[ "$nc" -gt 0 ] || fail "no sm_80 cubin compiled: $(cat cu.log)"
	[ "$(grep -c '^compiled .* sm_90$' cu.log)" -eq "$nc" ] ||
		fail "sm_80 and sm_90 compiled different unit counts"
	EPJIT_CACHE_DIR=$tmp/cu "$WARM" --backend cuda --arch sm_80,sm_90 \
	    --export cu.epjka >cuexp.log 2>&1 ||
		fail "cuda export: $(cat cuexp.log)"
	EPJIT_CUDA_ARCH=sm_90 EPJIT_CACHE_DIR=$tmp/cu2 "$WARM" \
	    --import cu.epjka >cuimp.log 2>&1 &&
		fail "import of sm_80 cubins with EPJIT_CUDA_ARCH=sm_90 succeeded"
	grep -q 'sm_80' cuimp.log || fail "arch refusal: $(cat cuimp.log)"
elif grep -q 'without NVRTC' cu.log; then
	echo "note: no NVRTC in this build; cuda warm-up not tested"
else
	cat cu.log >&2
	fail "cuda warm-up failed"
fi

# ---- 6. command line ------------------------------------------------------------
for bad in "--backend rocm" "--arch sm_90" "-j 0" "--seq x" "--frobnicate" \
    "--import a --model b" "--world 0"; do
	# shellcheck disable=SC2086
	"$WARM" $bad >/dev/null 2>&1
	rc=$?
	[ "$rc" -eq 2 ] || fail "epjit-warmup $bad: exit $rc, expected 2"
done
"$WARM" --help | grep -q -- '--dry-run' || fail "--help lacks --dry-run"

# ---- 7. the real 48-layer config, shapes only --------------------------------------
big=$srcdir/t/models/qwen3-30b-a3b.json
# AddressSanitizer reserves terabytes of shadow address space, so under it
# (a sanitized build's make check sets EPJIT_SANITIZED) the 3 GB limit is left out.
limit="ulimit -v 3000000"
[ "${EPJIT_SANITIZED:-0}" = 1 ] && limit=true
if ($limit && EPJIT_CACHE_DIR=$tmp/big "$WARM" -j 2 \
    --model "$big") >big.log 2>&1; then
	grep -q '48 layers.*48 regions' big.log || fail "30b: $(head -n 1 big.log)"
	grep -q ' 0 failed' big.log || fail "30b: $(tail -n 2 big.log)"
	# each unique graph once: a handful of artifacts, not 48 x that
	nb=$(grep -c '^compiled ' big.log)
	[ "$nb" -gt 0 ] && [ "$nb" -le 8 ] || fail "30b: $nb artifacts compiled"
else
	cat big.log >&2
	fail "warm-up of the 48-layer config failed under a 3 GB limit"
fi

# ---- 8. expert parallelism: warm for the ranks, no ranks needed ------------------
# train_batch_size 8 = micro-batch 2 x accumulation 2 x 2 ranks: the
# warm-up stands for one rank of 2 (at world 1 these batch sizes would not
# even agree)
cat >ep2.json <<'EOF'
{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
 "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
 "expert_parallel": {"enabled": true, "autoep_size": 2}}
EOF
warm "$tmp/ep" --config ep2.json --seq 8
grep -q 'batch 2 x 8 (a rank of 2, expert parallel 2)' warm.log ||
	fail "EP-2 warm-up: $(head -n 1 warm.log)"
grep -q ' 0 failed' warm.log || fail "EP-2 warm-up: $(tail -n 2 warm.log)"
# --world: another world, the same per-rank batch; one that EP 2 cannot
# have is refused
sed 's/"train_batch_size": 8, //' ep2.json >ep2w.json
EPJIT_CACHE_DIR=$tmp/ep "$WARM" --config ep2w.json --seq 8 --world 4 \
    --dry-run >w4.log 2>&1 || fail "--world 4: $(cat w4.log)"
grep -q 'a rank of 4, expert parallel 2' w4.log || fail "--world 4: $(head -n 1 w4.log)"
! grep -q '^missing ' w4.log || fail "--world 4 needs other kernels: $(cat w4.log)"
if EPJIT_CACHE_DIR=$tmp/ep "$WARM" --config ep2w.json --world 3 --dry-run \
    >w3.log 2>&1; then
	fail "--world 3 with autoep_size 2 was accepted"
fi
grep -q 'autoep_size=2 needs a world of a multiple of 2' w3.log ||
	fail "--world 3: $(cat w3.log)"
MPIRUN=$(command -v mpirun || command -v mpiexec)
if [ -z "$MPIRUN" ] || ! grep -q '^#define HAVE_MPI 1' "$builddir/config.h" 2>/dev/null; then
	echo "note: no MPI; the EP-2 run on the warmed cache not tried"
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
rm -rf dep
EPJIT_CACHE_DIR=$tmp/ep EPJIT_DEBUG_DUMP=$tmp/dep timeout 300 "$MPIRUN" \
    -np 2 --oversubscribe "$TRAIN" --compile --config ep2.json --steps 2 \
    --seq 8 >ep.log 2>&1 || { cat ep.log >&2; fail "EP-2 run under mpirun"; }
grep -q 'world 2 ranks, expert parallel 2' ep.log ||
	fail "EP-2 run: $(grep '^epjit-train: world' ep.log)"
for r in 0 1; do
	c=dep/rank$r/counters.json
	[ -f "$c" ] || fail "EP-2 run: no $c"
	for k in cache.misses codegen.cc_compiles compile.us compile.cc_us; do
		[ "$(ctr "$c" $k)" -eq 0 ] ||
			fail "EP-2 run after warm-up, rank $r: $k = $(ctr "$c" $k)"
	done
	[ "$(ctr "$c" cache.disk_hits)" -gt 0 ] &&
		[ "$(ctr "$c" kernels.launched.compiled)" -gt 0 ] ||
		fail "EP-2 run, rank $r: no kernel from the cache ran"
done
# under mpirun too: each process warms for the ranks (nothing left here)
timeout 300 env EPJIT_CACHE_DIR="$tmp/ep" "$MPIRUN" -np 2 --oversubscribe \
    "$WARM" --config ep2.json --seq 8 --dry-run >epm.log 2>&1 ||
	{ cat epm.log >&2; fail "epjit-warmup under mpirun -np 2"; }
[ "$(grep -c 'a rank of 2, expert parallel 2' epm.log)" -eq 2 ] ||
	fail "epjit-warmup under mpirun: $(cat epm.log)"
! grep -q '^missing ' epm.log || fail "under mpirun: missing keys: $(cat epm.log)"
exit 0
