#!/bin/sh
# bench/first_step.sh -- the first step of a compiled run after warm-up
# against its second, side by side.
#
#   bench/first_step.sh BUILD [RUNS] [epjit-train flags...]
#
# Fills a fresh kernel cache with epjit-warmup (same flags), then starts
# RUNS (default 7) compiled epjit-train runs of 3 steps on it, each with
# --metrics, and prints per run: step 1 and step 2 wall time (ms), their
# ratio, the run's cache.misses, compile.ms and compile.cached_us, and the
# medians and minima.  One thread (OMP/BLAS), as in bench/RESULTS.md.
build=${1:?usage: bench/first_step.sh BUILD [RUNS] [flags...]}
runs=${2:-7}
[ $# -ge 2 ] && shift 2 || shift 1
build=$(cd "$build" && pwd) || exit 2
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-first-step.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
EPJIT_CACHE_DIR=$tmp/cache "$build/tools/epjit-warmup" -j 2 "$@" \
    >"$tmp/warm.log" 2>&1 || { cat "$tmp/warm.log" >&2; exit 1; }
tail -n 1 "$tmp/warm.log"
ctr() {
	v=$(tr ',{}' '\n\n\n' <"$1" | grep "\"$2\":" | sed 's/.*: *//')
	echo "${v:-0}"
}
printf '%4s %10s %10s %7s %7s %11s %18s\n' run step1_ms step2_ms ratio misses compile.ms compile.cached_us
i=0
: >"$tmp/all"
while [ "$i" -lt "$runs" ]; do
	i=$((i + 1))
	rm -rf "$tmp/dump"
	EPJIT_CACHE_DIR=$tmp/cache EPJIT_DEBUG_DUMP=$tmp/dump \
	    "$build/tools/epjit-train" --compile --steps 3 "$@" \
	    --metrics "$tmp/m.csv" >"$tmp/train.log" 2>&1 ||
		{ cat "$tmp/train.log" >&2; exit 1; }
	s1=$(awk -F, 'NR == 2 { print $7 }' "$tmp/m.csv")
	s2=$(awk -F, 'NR == 3 { print $7 }' "$tmp/m.csv")
	c=$tmp/dump/counters.json
	echo "$s1 $s2" >>"$tmp/all"
	printf '%4d %10.2f %10.2f %7.2f %7d %11d %18d\n' "$i" "$s1" "$s2" \
	    "$(echo "$s1 $s2" | awk '{ print $1 / $2 }')" \
	    "$(ctr "$c" cache.misses)" "$(ctr "$c" compile.ms)" \
	    "$(ctr "$c" compile.cached_us)"
done
# medians and minima (the minimum is the least disturbed by other load)
for k in 1 2; do
	sort -n -k$k "$tmp/all" | awk -v k=$k '{ a[NR] = $k }
	    END { printf "step%d: median %.2f ms, min %.2f ms\n", k,
	          a[int((NR + 1) / 2)], a[1] }'
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
