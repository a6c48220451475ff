#!/bin/sh
# t/gpu_check.sh -- tools/gpu-check's own behaviour, without a GPU and in
# seconds (the whole script runs against the stand-in in CI: .ci/run):
#  - --help prints the usage and exits 0; an unknown argument exits 1;
#  - without a driver it says so, prints the step table and exits 2, and
#    writes $OUT/gpu-check.log and gpu-check.json;
#  - a TERM during a step ends that step's processes and the run, with the
#    table (the step marked KILLED) and the JSON, exit 1;
#  - a KILL leaves the log of everything up to it (the log streams);
#  - --bundle: a folder that is not a bundle is refused; with the build
#    tree standing in for a bundle and the stand-in driver, a missing
#    cuBLASLt or NVRTC fails the run at the probe (exit 1), never passes;
#  - the gpu suite passes with no driver (each case says it skips), and
#    fails under EPJIT_GPU_STRICT=1, which gpu-check sets: there a skip is
#    a failure.
# The TERM and KILL cases start the build step in a scratch tree against
# the stand-in driver; they wait for the log to show the step, never for a
# fixed time.  Built without NVRTC, the stand-in's probe stops the run
# before any build step: those two cases are skipped then (exit 77), after
# everything else has passed.
set -u
top_srcdir=${top_srcdir:-.}
top_builddir=${top_builddir:-.}
gc="$top_srcdir/tools/gpu-check"
fake="$top_builddir/t/.libs/libfakecuda.so"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-gpucheck.XXXXXX") || exit 99
trap 'rm -rf "$tmp"' EXIT
fail() {
	echo "FAIL: $*"
	exit 1
}
# in_tree DIR: the pids of processes working in DIR (their cwd under it)
in_tree() {
	for d in /proc/[0-9]*; do
		c=$(readlink "$d/cwd" 2>/dev/null) || continue
		case "$c" in "$1" | "$1"/*) echo "${d#/proc/}" ;; esac
	done
}
# wait_for FILE PATTERN: until FILE holds PATTERN (at most 120 s)
wait_for() {
	i=0
	while ! grep -q -- "$2" "$1" 2>/dev/null; do
		i=$((i + 1))
		[ $i -gt 1200 ] && return 1
		sleep 0.1
	done
	return 0
}

bash "$gc" --help >"$tmp/help" 2>&1 || fail "--help exited $?"
grep -q 'tools/gpu-check --bundle DIR' "$tmp/help" || fail "--help printed no usage"
bash "$gc" --bogus >/dev/null 2>&1 && fail "an unknown argument was accepted"

OUT="$tmp/none" EPJIT_GPU_CHECK_BUILD="$tmp/b0" \
	EPJIT_GPU_CHECK_DRIVER=/nonexistent/epjit/libcuda.so.1 \
	bash "$gc" >"$tmp/none.out" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "no driver: exit $rc, want 2"
wait_for "$tmp/none/gpu-check.log" "total .*exit 2" || fail "no driver: no summary in the log"
grep -q '^probe *FAIL' "$tmp/none/gpu-check.log" || fail "no driver: no probe row"
grep -q '"exit": 2' "$tmp/none/gpu-check.json" || fail "no driver: no JSON"

# --bundle: not a bundle
bash "$gc" --bundle /nonexistent/epjit-bundle >"$tmp/nb.out" 2>&1 && fail "--bundle of a missing folder passed"
grep -q 'is not a GPU bundle' "$tmp/nb.out" || fail "--bundle /nonexistent: $(cat "$tmp/nb.out")"

# the gpu suite: skips without a driver, fails under EPJIT_GPU_STRICT
check="$top_builddir/t/check_epjit"
if [ -x "$check" ]; then
	CK_RUN_SUITE=gpu EPJIT_CUDA_DRIVER=/nonexistent/epjit/libcuda.so.1 \
		"$check" >"$tmp/gpu-lax.out" 2>&1 ||
		fail "the gpu suite without a driver failed: $(tail -n 5 "$tmp/gpu-lax.out")"
	CK_RUN_SUITE=gpu EPJIT_GPU_STRICT=1 EPJIT_CUDA_DRIVER=/nonexistent/epjit/libcuda.so.1 \
		"$check" >"$tmp/gpu-strict.out" 2>&1 &&
		fail "the gpu suite without a driver passed under EPJIT_GPU_STRICT"
	grep -q 'under EPJIT_GPU_STRICT a skip is a failure' "$tmp/gpu-strict.out" ||
		fail "strict gpu suite: no failure says why: $(tail -n 5 "$tmp/gpu-strict.out")"
	# every case of the suite fails, none passes quietly
	grep -q '^0%: Checks: ' "$tmp/gpu-strict.out" ||
		fail "strict gpu suite: a case passed without a driver: $(grep -E '^[0-9]+%' "$tmp/gpu-strict.out")"
fi

if [ ! -f "$fake" ]; then
	echo "SKIP: the kill and bundle cases need the stand-in driver ($fake)"
	exit 77
fi

# --bundle with the build tree standing in for a bundle: a missing cuBLASLt
# or NVRTC stops the run at the probe, exit 1
if [ -x "$top_builddir/tools/gpu-probe" ] && [ -x "$check" ]; then
	for lib in CUBLASLT NVRTC; do
		OUT="$tmp/no$lib" EPJIT_GPU_CHECK_DRIVER="$fake" \
			env "EPJIT_$lib=/nonexistent/epjit/lib$lib.so" \
			bash "$gc" --bundle "$top_builddir" >"$tmp/no$lib.out" 2>&1
		rc=$?
		log="$tmp/no$lib/gpu-check.log"
		[ $rc -eq 1 ] || fail "no $lib: exit $rc, want 1: $(tail -n 5 "$log")"
		grep -q '^probe *FAIL' "$log" || fail "no $lib: the probe did not fail"
		case $lib in
		CUBLASLT) want='no cuBLASLt found' ;;
		NVRTC) want='no NVRTC found' ;;
		esac
		# built without the CUDA toolkit there is no NVRTC either,
		# and the probe says that first
		grep -q '^nvrtc: none' "$log" && want='no NVRTC found'
		grep -q "$want" "$log" || fail "no $lib: the log does not say '$want'"
		grep -qE '^(smoke|tests) ' "$log" && fail "no $lib: steps ran after the probe"
	done
fi
for sig in TERM KILL; do
	# TMPDIR: the run's scratch folder, which a KILL leaves behind,
	# goes under ours
	OUT="$tmp/$sig" EPJIT_GPU_CHECK_BUILD="$tmp/b$sig" \
		EPJIT_GPU_CHECK_DRIVER="$fake" TMPDIR="$tmp" \
		bash "$gc" >"$tmp/$sig.out" 2>&1 &
	pid=$!
	wait_for "$tmp/$sig/gpu-check.log" "== build\|^total " ||
		fail "$sig: the build step never started"
	if ! grep -q "== build" "$tmp/$sig/gpu-check.log"; then
		# the probe is a plain program: it cannot load a stand-in
		# built with the sanitizers (ASan must come first); and built
		# without NVRTC it stops at the probe
		wait "$pid"
		if grep -q '^nvrtc: none' "$tmp/$sig/gpu-check.log"; then
			echo "SKIP: no NVRTC here: gpu-check stops at its probe (the kill cases need its build step)"
			exit 77
		fi
		grep -q '^probe *FAIL' "$tmp/$sig/gpu-check.log" &&
			grep -q 'driver: none' "$tmp/$sig/gpu-check.log" ||
			fail "$sig: the run ended before its build step: $(tail -n 8 "$tmp/$sig/gpu-check.log")"
		echo "SKIP: the probe cannot load $fake (a sanitizer build?)"
		exit 77
	fi
	kill -s "$sig" "$pid"
	wait "$pid"
	rc=$?
	log="$tmp/$sig/gpu-check.log"
	grep -q '^driver: 13000' "$log" || fail "$sig: the probe's lines are not in the log"
	grep -q '^probe *pass' "$log" 2>/dev/null && [ "$sig" = KILL ] &&
		fail "KILL: a summary cannot have been printed"
	if [ "$sig" = TERM ]; then
		[ $rc -eq 1 ] || fail "TERM: exit $rc, want 1"
		wait_for "$log" "total .*exit 1" || fail "TERM: no summary"
		grep -q '^build *KILLED' "$log" || fail "TERM: the build step is not marked KILLED"
		grep -q '"result": "KILLED"' "$tmp/$sig/gpu-check.json" || fail "TERM: no JSON"
		# the step's processes are gone (configure or make in that tree)
		i=0
		while [ -n "$(in_tree "$tmp/bTERM")" ]; do
			i=$((i + 1))
			[ $i -gt 300 ] && fail "TERM: the build step's processes outlived the run"
			sleep 0.1
		done
	fi
done
# a KILL leaves the step's processes behind (nothing can end them): end
# them here, as the machine's owner would
for p in $(in_tree "$tmp/bKILL"); do kill -9 "$p" 2>/dev/null; done
echo "PASS: usage, no driver (exit 2), not a bundle, the gpu suite lax and strict, no cuBLASLt / no NVRTC (exit 1), TERM (summary, exit 1), KILL (log kept)"
exit 0
