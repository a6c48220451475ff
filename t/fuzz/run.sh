#!/bin/sh
# t/fuzz/run.sh FUZZDIR [SECONDS] -- runs every fuzzer of FUZZDIR (from
# build.sh) for SECONDS (default 60) each, on a working copy of its seed
# corpus (FUZZDIR/work/<target>; new inputs stay there), with the
# dictionary of its format.  Prints one line per target: executions,
# coverage (cov: edges, ft: features), corpus size, crashes.  A crash input
# lands in FUZZDIR/work/crash-<target>-*; copy it to t/fuzz/crashes/<target>/
# once fixed.
set -u
dir=$(cd "${1:?usage: run.sh FUZZDIR [SECONDS]}" && pwd)
secs=${2:-60}
src=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dir/work"
for t in safetensors checkpoint ckpt_set ds_config hf_config tokens kcache archive; do
	case $t in
	tokens | kcache | archive) dict=binary ;;
	*) dict=json ;;
	esac
	mkdir -p "$dir/work/$t"
	cp -n "$src/t/fuzz/corpus/$t/"* "$dir/work/$t/" 2>/dev/null
	log="$dir/work/$t.log"
	ASAN_OPTIONS=detect_leaks=1 "$dir/fuzz_$t" -max_total_time="$secs" \
		-max_len=65536 -timeout=10 -rss_limit_mb=4096 \
		-dict="$src/t/fuzz/dict/$dict.dict" \
		-artifact_prefix="$dir/work/crash-$t-" "$dir/work/$t" \
		>"$log" 2>&1
	rc=$?
	stats=$(grep -E '^#[0-9]+' "$log" | tail -1)
	crashes=$(ls "$dir/work" | grep -c "^crash-$t-")
	printf '%-12s exit %d  %s  crashes %d\n' "$t" "$rc" "$stats" "$crashes"
done
