#!/bin/sh
# t/dump.sh -- epjit-dump on real debug dumps and on counter files.
#
#  1. a compiled run with EPJIT_DEBUG_DUMP: epjit-dump DIR shows the counter
#     groups, the AutoEP graph breaks, the recompiles with their guard
#     failures, and every compiled segment; every IR and source path it
#     lists exists, and the segments match stats.unique_graphs;
#  2. --diff: exit 0 when only non-compile counters moved, 1 when any
#     compile counter moved (each family tried), on files and on dump
#     folders; a second run on a warm cache against the first differs in
#     cache.misses;
#  3. --json output parses (when python3 is there) and says the same;
#  4. rank<N>/ folders are shown side by side, differing counters marked;
#     --diff of two multi-rank dumps goes rank by rank (the verdict names
#     the ranks whose compile counters changed); different ranks, or a
#     multi-rank dump against a single one, exit 2;
#  5. bad input exits 2.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
DUMP="$builddir/tools/epjit-dump"
TRAIN="$builddir/tools/epjit-train"
if [ ! -x "$DUMP" ] || [ ! -x "$TRAIN" ]; then
	echo "SKIP: epjit-dump or epjit-train not built"
	exit 77
fi
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-dump-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

train() {
	rm -rf "$1"
	d=$1
	# --no-precompile: each variant after a region's first comes from a
	# guard failure, a recompile (the checkpointed replay, the evaluation)
	EPJIT_CACHE_DIR=$tmp/kc EPJIT_DEBUG_DUMP=$tmp/$d "$TRAIN" --compile \
	    --no-precompile --steps 2 --checkpointing >train.log 2>&1 ||
		{ cat train.log >&2; fail "epjit-train failed"; }
}

# ---- 1. a real dump -------------------------------------------------------------
train d1
"$DUMP" d1 >out.txt 2>err.txt || fail "epjit-dump d1: $(cat err.txt)"
for sec in '== frames' '== graphs' '== cache' '== kernels' '== autoep' \
    '== memory' '== graph breaks by reason' '== recompiles' \
    '== compiled segments'; do
	grep -q -- "^$sec" out.txt || fail "no '$sec' section"
done
grep -q '^  autoep  *[1-9]' out.txt || fail "no autoep graph break reason"
# checkpointing: eval variant first, train variant on the replay
grep -q 'variant 2: .*grad mode' out.txt ||
	fail "recompile guard failure not shown"
nseg=$(grep -c '^  [0-9][0-9][0-9] [0-9a-f]\{32\} ' out.txt)
ug=$(grep '^  stats.unique_graphs ' out.txt | awk '{print $2}')
[ "$nseg" -gt 0 ] && [ "$nseg" -eq "$ug" ] ||
	fail "compiled segments listed: $nseg, stats.unique_graphs: $ug"
grep -q '^  [0-9]* [0-9a-f]* train ' out.txt || fail "no train segment"
paths=$(sed -n 's/^      \(ir\|sources\)://p' out.txt)
[ -n "$paths" ] || fail "no IR or source paths listed"
for p in $paths; do
	[ -f "d1/$p" ] || fail "listed path d1/$p does not exist"
done
echo "$paths" | grep -q '3-backward-final' || fail "no backward IR path"
echo "$paths" | tr ' ' '\n' | grep -q '\.c$' || fail "no generated C source path"

# provenance: every compiled region variant, the parameter behind each
# "param i" of its graphs (checked against the shapes the built-in tiny
# model gives those parameters: hidden 32, 4 heads and 2 KV heads of 8),
# its steps, and where each step's activations come from
grep -q '^== provenance: [1-9][0-9]* compiled region variants' out.txt ||
	fail "no provenance section: $(cat out.txt)"
grep -q '^    step 1: break model.layers.1.mlp; act 0 = output 1 of step 0$' out.txt ||
	fail "provenance: no AutoEP break of layer 1: $(sed -n '/== provenance/,/== compiled/p' out.txt)"
if command -v python3 >/dev/null 2>&1; then
	python3 - d1 <<'EOF' || fail "provenance does not match the graphs"
import glob, json, re, sys
d = sys.argv[1]
shape = {"input_layernorm.weight": [32], "self_attn.q_proj.weight": [32, 32],
         "self_attn.k_proj.weight": [16, 32], "self_attn.v_proj.weight": [16, 32],
         "self_attn.o_proj.weight": [32, 32], "self_attn.q_norm.weight": [8],
         "self_attn.k_norm.weight": [8], "post_attention_layernorm.weight": [32]}
lines = [json.loads(l) for l in open(d + "/provenance.jsonl") if l.strip()]
assert {l["region"] for l in lines} == {"model.layers.0", "model.layers.1"}, lines
checked = 0
for l in lines:
    ps = l["params"]
    assert sorted(p[len(l["region"]) + 1:] for p in ps) == sorted(shape), ps
    for st in l["steps"]:
        if "break" in st:
            assert st["break"] == l["region"] + ".mlp", st
            continue
        ir = glob.glob(d + "/graphs/*-" + st["segment"][:12] + "-0-traced.txt")
        assert ir, st["segment"]
        for m in re.finditer(r"^in %\d+ param (\d+) \w+\[([\d,]*)\]", open(ir[0]).read(), re.M):
            name = ps[int(m.group(1))]
            want = shape[name[len(l["region"]) + 1:]]
            got = [int(x) for x in m.group(2).split(",") if x]
            assert got == want, (l["region"], m.group(0), name, want)
            checked += 1
assert checked >= 8, checked
EOF
fi

# a run killed by a signal writes no counters.json (the engine writes it
# when freed): its graphs and recompiles are still shown, with a note
rm -rf dk
EPJIT_CACHE_DIR=$tmp/kc EPJIT_DEBUG_DUMP=$tmp/dk "$TRAIN" --compile \
    --no-precompile --steps 4 --checkpointing --fault kill --fault-step 3 \
    >killed.log 2>&1
[ -f dk/counters.json ] && fail "the killed run wrote counters.json"
"$DUMP" dk >outk.txt 2>errk.txt || fail "epjit-dump of a killed run: $(cat errk.txt)"
grep -q 'no counters.json' errk.txt || fail "no note on the missing counters: $(cat errk.txt)"
grep -q '^== recompiles: [1-9][0-9]* (guard failures, from recompiles.txt)' outk.txt ||
	fail "killed run: recompiles not shown: $(cat outk.txt)"
nk=$(grep -c '^  [0-9][0-9][0-9] [0-9a-f]\{32\} ' outk.txt)
[ "$nk" -eq "$nseg" ] || fail "killed run: $nk compiled segments, the whole run had $nseg"
"$DUMP" --json dk >dk.json 2>/dev/null || fail "epjit-dump --json of a killed run"
grep -q '"counters_missing": true' dk.json || fail "--json: no counters_missing"

# a default run compiles every variant before step 1: each is counted in
# frames.precompiled (2 regions x checkpointed forward, replay and
# evaluation), and no call's guards fail, so there is no recompile
rm -rf d0
EPJIT_CACHE_DIR=$tmp/kc EPJIT_DEBUG_DUMP=$tmp/d0 "$TRAIN" --compile \
    --steps 2 --checkpointing >train0.log 2>&1 ||
	{ cat train0.log >&2; fail "epjit-train (precompiled) failed"; }
"$DUMP" d0 >out0.txt 2>err.txt || fail "epjit-dump d0: $(cat err.txt)"
grep -q '^== recompiles: 0 ' out0.txt ||
	fail "a precompiled run recompiled: $(grep recompiles out0.txt)"
grep -q '^  frames.precompiled  *6$' out0.txt ||
	fail "frames.precompiled: $(grep precompiled out0.txt)"
grep -q '^== recompiles: [1-9]' out.txt ||
	fail "the --no-precompile run has no recompiles"

# ---- 2. --diff ---------------------------------------------------------------------
printf '{"kernels.launched.eager": 5, "cache.disk_hits": 3, "train.steps": 1}\n' >a.json
printf '{"kernels.launched.eager": 9, "cache.disk_hits": 8, "train.steps": 2}\n' >b.json
"$DUMP" --diff a.json b.json >diff.txt
[ $? -eq 0 ] || fail "--diff with only non-compile changes exited non-zero"
grep -q 'compile counters: unchanged' diff.txt || fail "diff summary"
for c in frames.total frames.precompiled stats.unique_graphs recompiles \
    graph_break.autoep cache.misses; do
	printf '{"kernels.launched.eager": 5, "cache.disk_hits": 3, "train.steps": 1, "%s": 7}\n' \
	    "$c" >c.json
	"$DUMP" --diff a.json c.json >diff.txt
	[ $? -eq 1 ] || fail "--diff did not flag a change of $c"
	grep -q "$c.*compile counter changed" diff.txt ||
		fail "--diff did not mark $c"
done
# wall times move on every run, warm ones included: reported (t), never a
# compile change
for c in compile.cached_us compile.ms compile.us compile.cc_us comm.us \
    profile.step.us; do
	printf '{"kernels.launched.eager": 5, "cache.disk_hits": 3, "train.steps": 1, "%s": 4711}\n' \
	    "$c" >cu.json
	"$DUMP" --diff a.json cu.json >diff.txt
	[ $? -eq 0 ] || fail "--diff flagged the wall time $c: $(cat diff.txt)"
	grep -q "^t $c " diff.txt ||
		fail "--diff did not mark $c t: $(cat diff.txt)"
done
"$DUMP" --diff d1 d1 >/dev/null || fail "--diff of a dump with itself"
train d2
"$DUMP" --diff d1 d2 >diff.txt
[ $? -eq 1 ] || fail "--diff cold vs warm run did not flag cache.misses"
grep -q 'cache.misses' diff.txt || fail "cold vs warm: no cache.misses line"
# two warm runs did the same compile work: the verdict is unchanged, whatever
# their wall times
train d3
"$DUMP" --diff d2 d3 >diff.txt ||
	fail "--diff of two warm runs flagged a change: $(grep 'compile counter changed' diff.txt)"
grep -q 'compile counters: unchanged' diff.txt || fail "warm vs warm: $(tail -n 1 diff.txt)"

# ---- 3. --json ----------------------------------------------------------------------
"$DUMP" --json d1 >d1.json || fail "--json d1"
"$DUMP" --json --diff a.json c.json >dj.json
[ $? -eq 1 ] || fail "--json --diff exit status"
if command -v python3 >/dev/null 2>&1; then
	python3 - d1.json dj.json "$ug" <<'EOF' || fail "--json content"
import json, sys
d = json.load(open(sys.argv[1]))
assert len(d["graphs"]) == int(sys.argv[3]), d["graphs"]
assert d["counters"]["graph breaks"]["graph_break.autoep"] > 0
assert d["graph_breaks"]["autoep"] > 0
assert any(g["mode"] == "train" and g["bwd_nodes"] > 0 for g in d["graphs"])
assert d["recompiles"] and all("reason" in r for r in d["recompiles"])
j = json.load(open(sys.argv[2]))
assert j["compile_changed"] is True
assert [c for c in j["counters"] if c["name"] == "cache.misses"][0]["compile"]
EOF
else
	grep -q '"compile_changed": true' dj.json || fail "--json --diff"
fi

# ---- 4. ranks side by side ------------------------------------------------------------
mkdir ranks
cp -r d1 ranks/rank0
cp -r d2 ranks/rank1
"$DUMP" ranks >r.txt 2>&1 || fail "epjit-dump ranks: $(cat r.txt)"
grep -q '2 ranks side by side' r.txt || fail "ranks header"
grep -q '^ *counter *rank0 *rank1$' r.txt || fail "rank columns"
grep -q '^\* cache.misses ' r.txt || fail "differing cache.misses not marked"
grep -q '^  train.steps  *2  *2$' r.txt || fail "equal train.steps row"
"$DUMP" --json ranks >rj.json || fail "--json ranks"
grep -q '"rank1"' rj.json || fail "--json ranks lacks rank1"
# --diff rank by rank: rank 0 goes cold -> warm (cache.misses), rank 1
# warm -> warm
mkdir ranks2
cp -r d2 ranks2/rank0
cp -r d3 ranks2/rank1
"$DUMP" --diff ranks ranks2 >rd.txt 2>&1
rc=$?
[ $rc -eq 1 ] || fail "--diff of rank folders: exit $rc: $(cat rd.txt)"
grep -q '^## rank0$' rd.txt && grep -q '^## rank1$' rd.txt ||
	fail "--diff of rank folders: no rank sections: $(cat rd.txt)"
grep -q '^# ranks/rank1 -> ranks2/rank1 ' rd.txt ||
	fail "--diff of rank folders: rank 1 not diffed with rank 1: $(cat rd.txt)"
grep -q '^C cache.misses .*compile counter changed' rd.txt ||
	fail "--diff of rank folders: rank 0's cache.misses not flagged"
grep -q '^# rank0: .*compile counters: CHANGED$' rd.txt &&
	grep -q '^# rank1: .*compile counters: unchanged$' rd.txt ||
	fail "--diff of rank folders: per-rank verdicts: $(grep '^# rank' rd.txt)"
grep -q '^# 2 ranks, rank by rank: .*compile counters: CHANGED on rank0$' rd.txt ||
	fail "--diff of rank folders: verdict: $(tail -n 1 rd.txt)"
# a change on rank 1 alone is a change
mkdir ranks3
cp -r d2 ranks3/rank0
cp -r d1 ranks3/rank1
"$DUMP" --diff ranks3 ranks2 >rd1.txt 2>&1
rc=$?
[ $rc -eq 1 ] && grep -q 'compile counters: CHANGED on rank1$' rd1.txt ||
	fail "--diff of rank folders, rank 1 changed: exit $rc: $(tail -n 1 rd1.txt)"
"$DUMP" --diff ranks2 ranks2 >rd2.txt 2>&1 ||
	fail "--diff of rank folders with themselves: $(tail -n 1 rd2.txt)"
grep -q 'compile counters: unchanged$' rd2.txt || fail "ranks2 vs ranks2: $(tail -n 1 rd2.txt)"
"$DUMP" --json --diff ranks ranks2 >rdj.json
[ $? -eq 1 ] || fail "--json --diff of rank folders: exit status"
if command -v python3 >/dev/null 2>&1; then
	python3 - rdj.json <<'EOF' || fail "--json --diff of rank folders: $(cat rdj.json)"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["compile_changed"] is True
assert sorted(j["ranks"]) == ["rank0", "rank1"], j["ranks"].keys()
assert j["ranks"]["rank0"]["compile_changed"] is True
assert j["ranks"]["rank1"]["compile_changed"] is False
m = [c for c in j["ranks"]["rank0"]["counters"] if c["name"] == "cache.misses"][0]
assert m["compile"] and m["delta"] < 0, m
EOF
fi
# other ranks, or one side not a multi-rank dump: refused by name
cp -r d3 ranks2/rank2
"$DUMP" --diff ranks ranks2 >rd3.txt 2>&1
rc=$?
[ $rc -eq 2 ] && grep -q 'ranks 0,1, .* has ranks 0,1,2' rd3.txt ||
	fail "--diff of rank folders of other ranks: exit $rc: $(cat rd3.txt)"
"$DUMP" --diff ranks d1 >rd4.txt 2>&1
rc=$?
[ $rc -eq 2 ] && grep -q 'ranks is a multi-rank dump' rd4.txt ||
	fail "--diff of a multi-rank dump with a single one: exit $rc: $(cat rd4.txt)"
"$DUMP" --diff ranks/rank0 d2 >/dev/null 2>&1
[ $? -eq 1 ] || fail "--diff of one rank's folder with a single dump"

# ---- 5. bad input ------------------------------------------------------------------------
printf 'not json' >bad.json
for args in "nope.json" "bad.json" "--diff a.json nope.json" "--frob" ""; do
	# shellcheck disable=SC2086
	"$DUMP" $args >/dev/null 2>&1
	[ $? -eq 2 ] || fail "epjit-dump $args: expected exit 2"
done
mkdir empty
"$DUMP" empty >/dev/null 2>&1
[ $? -eq 2 ] || fail "a folder without counters.json: expected exit 2"
# a FIFO (no writer: a blocking open would hang) and a device are refused
# by name at once; timeout only bounds a regression
mkfifo fifo.json
timeout 60 "$DUMP" fifo.json >fifo.txt 2>&1
rc=$?
[ $rc -eq 2 ] || fail "epjit-dump of a FIFO: exit $rc, expected 2"
grep -q 'fifo.json: not a regular file' fifo.txt ||
	fail "epjit-dump of a FIFO: $(cat fifo.txt)"
timeout 60 "$DUMP" /dev/zero >zero.txt 2>&1
rc=$?
[ $rc -eq 2 ] || fail "epjit-dump /dev/zero: exit $rc, expected 2"
grep -q 'not a regular file' zero.txt || fail "epjit-dump /dev/zero: $(cat zero.txt)"
exit 0
