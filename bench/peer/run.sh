#!/bin/sh
# bench/peer/run.sh -- epjit against torch on the same model, in one session.
#
#   sh bench/peer/run.sh BUILD [--config FILE] [--model FILE] [--seq T]
#                              [--steps N] [--warmup N] [--rounds R]
#                              [--backend c|interpreter]
#
# Makes (once) a venv with torch and transformers from PyPI
# ($PEER_VENV, default bench/peer/.venv; $PEER_PIP_ARGS adds pip arguments,
# e.g. version pins), then runs R rounds (default 2) of:
#   torch:  bench/peer/torch_peer.py (eager vs DeepSpeed's regional recipe)
#   epjit:  BUILD/bench/bench-compile (eager vs compile.autoep_non_moe,
#           generated C by default)
# on the same model config, DeepSpeed config, batch and sequence, one
# thread, and prints each side's table, then the medians over the rounds of
# the four step times (CPU ms) and the ratios that compare the products:
#   epjit eager / torch eager, epjit compiled / torch compiled (Inductor),
#   each side's compiled / eager.
# Not part of make check: it downloads torch (about 1 GB with its deps).
set -e
build=${1:?usage: bench/peer/run.sh BUILD [options]}
shift
build=$(cd "$build" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
model=$top/bench/configs/bench-model.json
config=$top/bench/configs/bench-ds.json
seq=256 steps=8 warmup=2 rounds=2 backend=c
while [ $# -gt 0 ]; do
	case $1 in
	--model) model=$2 ;;
	--config) config=$2 ;;
	--seq) seq=$2 ;;
	--steps) steps=$2 ;;
	--warmup) warmup=$2 ;;
	--rounds) rounds=$2 ;;
	--backend) backend=$2 ;;
	*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
	esac
	shift 2
done
venv=${PEER_VENV:-$here/.venv}
if [ ! -x "$venv/bin/python" ] ||
   ! "$venv/bin/python" -c 'import torch, transformers' 2>/dev/null; then
	python3 -m venv "$venv"
	# shellcheck disable=SC2086
	"$venv/bin/pip" install -q torch transformers $PEER_PIP_ARGS
fi
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-peer.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
: >"$tmp/rows"
r=0
while [ "$r" -lt "$rounds" ]; do
	r=$((r + 1))
	echo "== round $r: torch"
	"$venv/bin/python" "$here/torch_peer.py" --model "$model" \
	    --config "$config" --seq "$seq" --steps "$steps" \
	    --warmup "$warmup" --threads 1 | tee "$tmp/torch.out"
	echo "== round $r: epjit"
	EPJIT_CACHE_DIR=$tmp/cache "$build/bench/bench-compile" \
	    --model "$model" --config "$config" --seq "$seq" \
	    --steps "$steps" --warmup "$warmup" --backend "$backend" | tee "$tmp/epjit.out"
	te=$(sed -n 's/^json: //p' "$tmp/torch.out" |
	    python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["eager_cpu_ms"], d["compiled_cpu_ms"])')
	ee=$(awk '/^median step \(ms, cpu\)/ { print $5, $6 }' "$tmp/epjit.out")
	echo "$te $ee" >>"$tmp/rows"
done
echo "== medians over $rounds round(s), CPU ms per step, one thread"
python3 - "$tmp/rows" <<'EOF'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
te, tc, ee, ec = (statistics.median(c) for c in zip(*rows))
print("%-34s %10.1f" % ("torch eager", te))
print("%-34s %10.1f" % ("torch compiled (Inductor, regional)", tc))
print("%-34s %10.1f" % ("epjit eager", ee))
print("%-34s %10.1f" % ("epjit compiled (autoep_non_moe)", ec))
print("%-34s %10.3f" % ("epjit eager / torch eager", ee / te))
print("%-34s %10.3f" % ("epjit compiled / torch compiled", ec / tc))
print("%-34s %10.3f" % ("torch compiled / eager", tc / te))
print("%-34s %10.3f" % ("epjit compiled / eager", ec / ee))
EOF
