#!/bin/sh
# t/warmup_graphs.sh -- epjit-warmup --graphs: the graphs of a graph file
# (the Python package records them for a torch run, doc/torch.md) compiled
# into the kernel cache.
#
#  1. a hand-written file of three graphs (two identical: one unique
#     segment for both) warms an empty cache: every artifact compiled; a
#     second warm-up finds every one cached and compiles nothing; --dry-run
#     lists them all cached; --export writes exactly those entries;
#  2. the file's "openmp_runtime" is part of the keys (another path to the
#     runtime gives other keys);
#  3. bad files (not JSON, unknown op, wrong arity, wrong output count, bad
#     dtype, undefined value, unknown key, missing key, a float that is not
#     one, a runtime that is not there, no file) fail with exit 1 and a
#     message naming the file and the entry, and compile nothing, even when
#     the graphs before the bad one are good;
#  4. bad command lines exit 2.
# The torch side (record, warm, a new process with no cache miss) is
# python/tests/test_warmup.py.  Exit 77 when the tool was not built.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
WARM="$builddir/tools/epjit-warmup"
if [ ! -x "$WARM" ]; then
	echo "SKIP: epjit-warmup not built"
	exit 77
fi
OMP_NUM_THREADS=1
export OMP_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-warmup-graphs.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

entries() {
	find "$1" -name '*.bin' 2>/dev/null | wc -l
}

# warm DIR ARGS...: epjit-warmup into cache DIR, output in warm.log.
warm() {
	dir=$1
	shift
	EPJIT_CACHE_DIR=$dir "$WARM" -j 2 "$@" >warm.log 2>&1 ||
		{ cat warm.log >&2; fail "epjit-warmup $* exited non-zero"; }
}

# summary: "N C K F" of warm.log's "N artifacts: C compiled, K already
# cached, F failed".
summary() {
	sed -n 's/^epjit-warmup: \([0-9]*\) artifacts*: \([0-9]*\) compiled, \([0-9]*\) already cached, \([0-9]*\) failed.*/\1 \2 \3 \4/p' warm.log
}

G0='{"inputs": [{"dtype": "f32", "shape": [4, 16]},
                {"dtype": "f32", "shape": [16, 8]}],
     "nodes": [{"op": "matmul", "in": [0, 1], "ints": [], "floats": [],
                "n_out": 1},
               {"op": "mul_scalar", "in": [2], "floats": [0.5], "n_out": 1},
               {"op": "tanh", "in": [3], "n_out": 1}],
     "outputs": [4]}'
G1='{"inputs": [{"dtype": "bf16", "shape": [3, 5]}],
     "nodes": [{"op": "cast", "in": [0], "ints": [0], "n_out": 1},
               {"op": "exp", "in": [1], "n_out": 1},
               {"op": "add_scalar", "in": [2], "floats": ["-inf"],
                "n_out": 1}],
     "outputs": [2, 3]}'
cat >g.json <<EOF
{"epjit_graphs": 1, "graphs": [$G0, $G1, $G0]}
EOF

# ---- 1. warm, warm again, dry run, export -----------------------------------
warm c1 --graphs g.json
grep -q '^epjit-warmup: g.json: 3 graphs, 2 unique segments' warm.log ||
	fail "header: $(head -1 warm.log)"
set -- $(summary)
[ $# -eq 4 ] || fail "no summary line: $(cat warm.log)"
n=$1
[ "$n" -ge 2 ] && [ "$2" -eq "$n" ] && [ "$3" -eq 0 ] && [ "$4" -eq 0 ] ||
	fail "first warm-up: $(cat warm.log)"
[ "$(entries c1)" -eq "$n" ] || fail "c1 holds $(entries c1) entries, not $n"
grep '^compiled ' warm.log | awk '{print $2}' | sort >keys1
[ "$(wc -l <keys1)" -eq "$n" ] || fail "compiled lines: $(cat warm.log)"

warm c1 --graphs g.json
set -- $(summary)
[ "$1" -eq "$n" ] && [ "$2" -eq 0 ] && [ "$3" -eq "$n" ] && [ "$4" -eq 0 ] ||
	fail "second warm-up compiled again: $(cat warm.log)"
[ "$(entries c1)" -eq "$n" ] || fail "second warm-up added entries"

warm c1 --graphs g.json --dry-run
[ "$(grep -c '^cached ' warm.log)" -eq "$n" ] &&
	! grep -q '^missing ' warm.log || fail "dry run: $(cat warm.log)"
grep -q 'dry run: nothing compiled' warm.log || fail "dry run: $(cat warm.log)"

warm c1 --graphs g.json --export a.epjc
grep -q "exported $n entr" warm.log || fail "export: $(cat warm.log)"

# ---- 2. the OpenMP runtime is part of the keys --------------------------------
rt=$(ldd "$WARM" 2>/dev/null | awk '/libgomp|libomp/ { print $3; exit }')
if [ -n "$rt" ] && [ -f "$rt" ]; then
	ln -s "$rt" "$tmp/libomp-copy.so"
	sed "s|\"epjit_graphs\": 1,|\"epjit_graphs\": 1, \"openmp_runtime\": \"$tmp/libomp-copy.so\",|" \
	    g.json >g-rt.json
	warm c2 --graphs g-rt.json --dry-run
	grep '^missing ' warm.log | awk '{print $2}' | sort >keys2
	[ "$(wc -l <keys2)" -eq "$n" ] || fail "runtime: $(cat warm.log)"
	[ -z "$(comm -12 keys1 keys2)" ] ||
		fail "another OpenMP runtime gave the same keys"
else
	echo "note: epjit-warmup links no OpenMP runtime: section 2 skipped"
fi

# ---- 3. bad files --------------------------------------------------------------
# bad NAME TEXT PATTERN: a file NAME.json holding TEXT fails with exit 1, a
# message matching PATTERN, and leaves the cache empty.
bad() {
	printf '%s\n' "$2" >"$1.json"
	rm -rf cb
	EPJIT_CACHE_DIR=$tmp/cb "$WARM" -j 1 --graphs "$1.json" >bad.log 2>&1
	rc=$?
	[ $rc -eq 1 ] || { cat bad.log >&2; fail "$1: exit $rc, not 1"; }
	grep -q "graph file $1.json" bad.log ||
		fail "$1: the message names no file: $(cat bad.log)"
	grep -q -- "$3" bad.log || fail "$1: '$3' not in: $(cat bad.log)"
	[ "$(entries cb)" -eq 0 ] || fail "$1: the cache got entries"
}
# a good graph 0 first: nothing is compiled when graph 1 is bad
one() {
	printf '{"epjit_graphs": 1, "graphs": [%s, %s]}' "$G0" "$1"
}
IN='"inputs": [{"dtype": "f32", "shape": [4]}]'
bad notjson 'this is not JSON' 'line 1'
bad trailing '{"epjit_graphs": 1, "graphs": []' 'line'
bad version '{"epjit_graphs": 2, "graphs": []}' 'version 1 expected'
bad topkey '{"epjit_graphs": 1, "graphs": [], "extra": 0}' 'unknown key "extra"'
bad nographs '{"epjit_graphs": 1}' 'no "graphs"'
bad unknownop "$(one "{$IN, \"nodes\": [{\"op\": \"frobnicate\", \"in\": [0], \"n_out\": 1}], \"outputs\": [1]}")" \
    'graph 1: .*node 0: unknown op "frobnicate"'
bad arity "$(one "{$IN, \"nodes\": [{\"op\": \"add\", \"in\": [0], \"n_out\": 1}], \"outputs\": [1]}")" \
    'graph 1: .*op add takes 2 inputs, got 1'
bad nout "$(one "{$IN, \"nodes\": [{\"op\": \"exp\", \"in\": [0], \"n_out\": 2}], \"outputs\": [1]}")" \
    'graph 1: .*op exp has 1 outputs, got 2'
bad dtype "$(one '{"inputs": [{"dtype": "f16", "shape": [4]}], "nodes": [], "outputs": [0]}')" \
    'graph 1, input 0: "dtype"'
bad shape "$(one '{"inputs": [{"dtype": "f32", "shape": [4, -2]}], "nodes": [], "outputs": [0]}')" \
    'graph 1, input 0: "shape"\[1\]'
bad value "$(one "{$IN, \"nodes\": [{\"op\": \"exp\", \"in\": [7], \"n_out\": 1}], \"outputs\": [1]}")" \
    'graph 1: .*input 0 is value 7'
bad bigvalue "$(one "{$IN, \"nodes\": [{\"op\": \"exp\", \"in\": [99999999999], \"n_out\": 1}], \"outputs\": [1]}")" \
    'graph 1, node 0: "in"\[0\]'
bad output "$(one "{$IN, \"nodes\": [], \"outputs\": [3]}")" \
    'graph 1: .*output 0 is value 3'
bad nooutput "$(one "{$IN, \"nodes\": [], \"outputs\": []}")" \
    'graph 1: "outputs" is empty'
bad nodekey "$(one "{$IN, \"nodes\": [{\"op\": \"exp\", \"in\": [0], \"n_out\": 1, \"attrs\": 0}], \"outputs\": [1]}")" \
    'graph 1, node 0: unknown key "attrs"'
bad float "$(one "{$IN, \"nodes\": [{\"op\": \"mul_scalar\", \"in\": [0], \"floats\": [\"half\"], \"n_out\": 1}], \"outputs\": [1]}")" \
    'graph 1, node 0: "floats"\[0\]'
bad type "$(one "{$IN, \"nodes\": {}, \"outputs\": [0]}")" \
    'graph 1: "nodes": an array expected, got an object'
bad shapes "$(one '{"inputs": [{"dtype": "f32", "shape": [4]}, {"dtype": "f32", "shape": [5]}], "nodes": [{"op": "add", "in": [0, 1], "n_out": 1}], "outputs": [2]}')" \
    'graph 1: .*not broadcastable'
bad runtime '{"epjit_graphs": 1, "openmp_runtime": "/nonexistent/libgomp.so.1", "graphs": []}' \
    '/nonexistent/libgomp.so.1'
EPJIT_CACHE_DIR=$tmp/cb "$WARM" --graphs "$tmp/absent.json" >bad.log 2>&1
[ $? -eq 1 ] && grep -q "graph file $tmp/absent.json" bad.log ||
	fail "a missing file: $(cat bad.log)"

# ---- 4. bad command lines ------------------------------------------------------
for args in "--graphs g.json --model x.json" "--graphs g.json --seq 4" \
    "--graphs g.json --import a.epjc" "--graphs"; do
	# shellcheck disable=SC2086
	"$WARM" $args >usage.log 2>&1
	rc=$?
	[ $rc -eq 2 ] || { cat usage.log >&2; fail "'$args': exit $rc, not 2"; }
done
exit 0
