#!/bin/sh
# t/sim_asan.sh -- cuda-sim modules built with AddressSanitizer catch an
# out-of-bounds store (check_sim.c's test_asan_oob) in a build without
# --enable-sanitizers: the test suite runs with the compiler's ASan runtime
# preloaded and EPJIT_SIM_ASAN=1.  Exit 77 (SKIP) when the Check suite was
# not built, the library is itself built with sanitizers (the suite runs
# the test directly), or the C++ compiler has no libasan.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
CHECK="$builddir/t/check_epjit"
if [ ! -x "$CHECK" ]; then
	echo "SKIP: $CHECK not built"
	exit 77
fi
if grep -q 'fsanitize=address' "$builddir/Makefile" 2>/dev/null &&
	grep -q '^SAN_CFLAGS = -fsanitize' "$builddir/Makefile"; then
	echo "SKIP: sanitizer build: check_sim runs test_asan_oob itself"
	exit 77
fi
asan=$(${EPJIT_CXX:-c++} -print-file-name=libasan.so 2>/dev/null)
case "$asan" in
/*) [ -f "$asan" ] || asan= ;;
*) asan= ;;
esac
if [ -z "$asan" ]; then
	echo "SKIP: ${EPJIT_CXX:-c++} has no libasan.so"
	exit 77
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-sim-asan.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
out="$tmp/log"
LD_PRELOAD="$asan" ASAN_OPTIONS=detect_leaks=0 EPJIT_SIM_ASAN=1 \
	EPJIT_CACHE_DIR="$tmp/cache" CK_RUN_SUITE=sim CK_RUN_CASE=asan \
	"$CHECK" >"$out" 2>&1
rc=$?
if [ $rc -ne 0 ] || ! grep -q "100%: Checks: 1" "$out" ||
	grep -q "skipped" "$out"; then
	echo "FAIL: test_asan_oob under the preloaded ASan runtime (rc $rc):"
	grep -v '^  ' "$out" | head -40
	exit 1
fi
echo "sim_asan: an out-of-bounds store in a cuda-sim kernel is caught by ASan"
