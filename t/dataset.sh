#!/bin/sh
# t/dataset.sh -- epjit-train on token datasets (make check sets top_builddir
# and top_srcdir; by hand: top_builddir=BUILD top_srcdir=SRC sh t/dataset.sh).
#
#  1. a Megatron prefix, a .npy file and a blend of both train, and a run
#     with a validation split evaluates on it;
#  2. resume mid-epoch: 3 steps + save, load + 3 more == 6 steps straight
#     (metrics fields step, loss, lr, grad_norm identical), on a prefix and
#     on a blend, whose 6 steps span more than two epochs of the data;
#  3. the data seed follows --seed: other seeds give other batches;
#     the config's "data" section stands for --data, --split and the data
#     seed, and --data overrides it;
#  4. bad data exits 1 naming the file: a hostile .idx, a float .npy, a
#     token >= the model's vocabulary, a bad blend or split;
#  5. epjit-tokenize: it reproduces the fixture; it never writes through a
#     planted link; a run killed between its renames leaves a pair the
#     trainer refuses (a larger .bin, and one of the same size); a failed
#     rename names what was replaced; bad input (invalid UTF-8, a lone
#     surrogate, a non-ASCII-digit --eod-token) is FILE:LINE: reason, exit
#     1, no traceback, nothing written.  It uses the Python tokenizers
#     package when installed, else a stand-in for the fixture's word-level
#     tokenizer (the tool's own logic is what is checked);
#  6. supervised fine-tuning: prompt-completion pairs (strings, and
#     messages through a chat template), conversations and plain text in
#     one file give the tokens and a loss mask (0 on prompts, system and
#     user turns and assistant headers, 1 on completions, assistant turns
#     and the EOD) in Megatron's layout; the trainer trains on it with the
#     per-token loss; a conversation without a template, a template that
#     rewrites earlier turns and --format epjtok are refused; a run killed
#     after each of its first three renames leaves files the trainer
#     refuses; a text-only run over an SFT prefix removes its stale mask;
#     2 accumulated micro-batches (and, where MPI is built, 2 ranks) of
#     other token counts take the steps of one micro-batch of their rows
#     (the per-token loss) (needs jinja2 for the template, as the tool
#     does).
# The fixtures are t/data/dataset (tools/epjit-tokenize and numpy wrote
# them; t/data/dataset/make-fixtures.py).  Exit 77 (SKIP) when the trainer
# was not built, or, after parts 1-4 passed, when python3 is missing.

builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
TRAIN="$builddir/tools/epjit-train"
if [ ! -x "$TRAIN" ]; then
	echo "SKIP: $TRAIN not built"
	exit 77
fi
OMP_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS

tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-dataset-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1
EPJIT_CACHE_DIR="$tmp/cache"
export EPJIT_CACHE_DIR
D="$srcdir/t/data/dataset"

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

run() {
	log=$1
	shift
	if ! "$TRAIN" "$@" >"$log" 2>&1; then
		cat "$log" >&2
		fail "epjit-train $* exited non-zero"
	fi
}

# ids DUMP: the bytes of a --dump-state file's input_ids, in hex (the
# safetensors header: u64 length, JSON with the tensor's data_offsets)
ids() {
	n=$(od -A n -t u8 -N 8 "$1" | tr -d ' ')
	o=$(dd if="$1" bs=1 skip=8 count="$n" 2>/dev/null |
		grep -o '"input_ids":{[^}]*}' |
		sed 's/.*"data_offsets":\[\([0-9]*\),\([0-9]*\)\].*/\1 \2/')
	set -- "$1" $o
	[ -n "$3" ] || fail "no input_ids in $1"
	od -A n -t x1 -j $((8 + n + $2)) -N $(($3 - $2)) "$1"
}

# refuse NEEDLE ARGS...: the trainer must exit 1 with NEEDLE on stderr.
refuse() {
	needle=$1
	shift
	"$TRAIN" "$@" >refuse.out 2>refuse.err
	rc=$?
	[ "$rc" -eq 1 ] || fail "epjit-train $*: exit $rc, want 1"
	grep -q -F -- "$needle" refuse.err ||
		fail "epjit-train $*: stderr lacks '$needle': $(cat refuse.err)"
}

# ---- 1. the forms of --data ----
run m.log --data "$D/docs" --seq 8 --steps 2
run n.log --data "$D/rows_i8.npy" --seq 8 --steps 2
run b.log --data "1 $D/docs 3 $D/stream_u2.npy" --seq 8 --steps 2
grep -q "evaluating on the train split" m.log ||
	fail "no note that the 16-document fixture has no validation split"
run v.log --data "$D/docs" --split 6,4 --seq 8 --steps 2
grep -q "from the start of the validation split of $D/docs" v.log ||
	fail "--split 6,4: eval not on the validation split: $(grep eval v.log)"

# ---- 2. resume mid-epoch equals the straight run ----
resume() {
	tag=$1
	shift
	run "$tag-a.log" "$@" --seq 8 --steps 3 --save "$tag.ckpt"
	run "$tag-b.log" "$@" --seq 8 --steps 6 --load "$tag.ckpt" \
		--metrics "$tag-b.csv"
	run "$tag-s.log" "$@" --seq 8 --steps 6 --metrics "$tag-s.csv"
	sed 1d "$tag-b.csv" | cut -d, -f1-4 >"$tag-b.txt"
	tail -n 3 "$tag-s.csv" | cut -d, -f1-4 >"$tag-s.txt"
	[ "$(wc -l <"$tag-b.txt")" -eq 3 ] || fail "$tag: resumed run: no 3 rows"
	cmp -s "$tag-b.txt" "$tag-s.txt" ||
		fail "$tag: resumed steps differ from the straight run:
$(cat "$tag-b.txt")
vs
$(cat "$tag-s.txt")"
}
# 172 tokens, 21 samples of 9 an epoch; a step is 8 samples
resume mm --data "$D/docs" --split 1
resume bl --data "2 $D/docs 1 $D/rows_u4.npy" --split 1

# ---- 3. the seed shuffles ----
run s1.log --data "$D/docs" --split 1 --seq 8 --steps 1 --dump-state s1.st
run s2.log --data "$D/docs" --split 1 --seq 8 --steps 1 --dump-state s2.st \
	--seed 43
cmp -s s1.st s2.st && fail "--seed 42 and 43 dumped the same state"
run s3.log --data "$D/docs" --split 1 --seq 8 --steps 1 --dump-state s3.st
cmp -s s1.st s3.st || fail "the same seed dumped different states"

# ---- the config's "data" section stands for --data, --split, the seed ----
cfg() {
	printf '{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "data": {"path": "%s", "split": "6,4"%s}}\n' \
		"$D/docs" "$1" >"$2"
}
cfg '' c0.json
cfg ', "seed": 7' c7.json
cfg ', "seed": 8' c8.json
run c0.log --config c0.json --seq 8 --steps 1
grep -q "data $D/docs\$" c0.log || fail "config data.path not used: $(head -3 c0.log)"
grep -q "from the start of the validation split of $D/docs" c0.log ||
	fail "config data.split not used: $(grep eval c0.log)"
run c7.log --config c7.json --seq 8 --steps 1 --dump-state c7.st
run c8.log --config c8.json --seq 8 --steps 1 --dump-state c8.st
cmp -s c7.st c8.st && fail "data.seed 7 and 8 dumped the same batch"
# with data.seed, another run seed changes the weights, not the batch
run c7b.log --config c7.json --seq 8 --steps 1 --dump-state c7b.st --seed 5
cmp -s c7.st c7b.st && fail "--seed 5 did not change the dumped weights"
[ "$(ids c7.st)" = "$(ids c7b.st)" ] ||
	fail "data.seed 7: --seed 5 changed the batch"
run c9.log --config c7.json --data "$D/rows_i8.npy" --split 1 --seq 8 \
	--steps 1
grep -q "data $D/rows_i8.npy\$" c9.log || fail "--data does not override data.path"

# ---- 4. bad data ----
cp "$D/docs.bin" h.bin
cp "$D/docs.idx" h.idx
printf 'XX' | dd of=h.idx bs=1 seek=0 conv=notrunc 2>/dev/null
refuse "h.idx': bad magic" --data "$tmp/h" --steps 1
cp "$D/docs.idx" h.idx
# sequence 15's pointer (offset 34 + 16 * 4 + 15 * 8) 2^24 bytes further,
# past the .bin
printf '\001' | dd of=h.idx bs=1 seek=$((34 + 64 + 120 + 3)) \
	conv=notrunc 2>/dev/null
refuse "h.bin': sequence 15" --data "$tmp/h" --steps 1
printf '\223NUMPY\001\000\106\000{'"'"'descr'"'"': '"'"'<f4'"'"', '"'"'fortran_order'"'"': False, '"'"'shape'"'"': (2,), }' >f.npy
printf '%*s\n' 13 '' >>f.npy
printf '\0\0\0\0\0\0\0\0' >>f.npy
refuse "f.npy': dtype '<f4' is not a token type" --data "$tmp/f.npy" \
	--steps 1
# the fixture's ids reach 59: a model of vocabulary 32 refuses them
sed 's/"vocab_size": *256/"vocab_size": 32/' "$srcdir/t/models/byte.json" \
	>v32.json
grep -q '"vocab_size": 32' v32.json || fail "no vocab 32 model"
refuse "docs.bin': token" --data "$D/docs" --model v32.json --steps 1 \
	--seq 8
refuse "data blend" --data "1 $D/docs 2" --steps 1
refuse "data split '1,x'" --data "$D/docs" --split 1,x --steps 1
refuse "add up to more than the largest double" --data "$D/docs" \
	--split 1e308,1e308,1e308 --steps 1
refuse "add up to more than the largest double" \
	--data "1e308 $D/docs 1e308 $D/rows_i8.npy" --steps 1
refuse "--split (or data.split) applies to token datasets" --split 1 \
	--steps 1

# ---- 5. epjit-tokenize ----
if ! command -v python3 >/dev/null 2>&1; then
	echo "SKIP: parts 1-4 passed; no python3 to run epjit-tokenize"
	exit 77
fi
if ! python3 -c 'import tokenizers' 2>/dev/null; then
	echo "note: no Python tokenizers package: epjit-tokenize runs with a stand-in"
	mkdir stub
	cat >stub/tokenizers.py <<'EOF'
"""A stand-in for the tokenizers package: WordLevel + WhitespaceSplit."""
import json


class _Encoding:
    def __init__(self, ids):
        self.ids = ids


class Tokenizer:
    @staticmethod
    def from_file(path):
        t = Tokenizer()
        with open(path, encoding="utf-8") as f:
            m = json.load(f)["model"]
        t.vocab, t.unk = m["vocab"], m["vocab"][m["unk_token"]]
        return t

    def get_vocab_size(self, with_added_tokens=True):
        return len(self.vocab)

    def token_to_id(self, s):
        return self.vocab.get(s)

    def encode(self, text, add_special_tokens=True):
        text.encode("utf-8")  # the package refuses lone surrogates too
        return _Encoding([self.vocab.get(w, self.unk) for w in text.split()])
EOF
	PYTHONPATH="$tmp/stub${PYTHONPATH:+:$PYTHONPATH}"
	export PYTHONPATH
fi
TOKENIZE="$srcdir/tools/epjit-tokenize"
# the tool run as a script whose os.replace exits 137 at its 2nd call: a
# run killed between its renames, deterministically
cat >killed.py <<'EOF'
import os, runpy, sys
real, calls = os.replace, [0]
def replace(a, b):
    calls[0] += 1
    if calls[0] == 2:
        os._exit(137)
    real(a, b)
os.replace = replace
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
tokenize() {
	python3 "$TOKENIZE" --tokenizer "$D/tokenizer.json" --append-eod "$@"
}
# tok_refuse NEEDLE ARGS...: exit 1, NEEDLE on stderr, no traceback
tok_refuse() {
	needle=$1
	shift
	tokenize "$@" >tr.out 2>tr.err
	rc=$?
	[ "$rc" -eq 1 ] || fail "epjit-tokenize $*: exit $rc, want 1: $(cat tr.err)"
	grep -q -F -- "$needle" tr.err ||
		fail "epjit-tokenize $*: stderr lacks '$needle': $(cat tr.err)"
	grep -q Traceback tr.err && fail "epjit-tokenize $*: a traceback: $(cat tr.err)"
	return 0
}
mkdir tk
tokenize --input "$D/docs.jsonl" --output-prefix tk/docs >tk.log 2>&1 ||
	fail "epjit-tokenize: $(cat tk.log)"
cmp -s tk/docs.bin "$D/docs.bin" && cmp -s tk/docs.idx "$D/docs.idx" ||
	fail "epjit-tokenize does not reproduce t/data/dataset/docs.{bin,idx}"
# links planted at the old fixed temporary names, and an output that is a
# link: no link's target is written
echo precious >victim
ln -s "$tmp/victim" tk/docs.bin.tmp
ln -s "$tmp/victim" tk/docs.idx.tmp
ln -s "$tmp/victim" tk/link.bin
tokenize --input "$D/docs.jsonl" --output-prefix tk/docs >tk.log 2>&1 ||
	fail "epjit-tokenize with planted links: $(cat tk.log)"
tokenize --input "$D/docs.jsonl" --output-prefix tk/link >tk.log 2>&1 ||
	fail "epjit-tokenize over a link: $(cat tk.log)"
[ "$(cat victim)" = precious ] || fail "a planted link's target was overwritten"
[ -L tk/link.bin ] && fail "tk/link.bin is still a link"
cmp -s tk/link.bin "$D/docs.bin" || fail "tk/link.bin is not the new .bin"
rm -f tk/*
# killed between the renames, over the fixture's pair: a .bin of other
# documents (larger), one of the same size (the documents reversed), and
# the same over a pair without a pairing record (as Megatron writes it)
cat "$D/docs.jsonl" "$D/docs.jsonl" >twice.jsonl
awk '{ l[NR] = $0 } END { for (i = NR; i > 0; i--) print l[i] }' \
	"$D/docs.jsonl" >rev.jsonl
cp rev.jsonl revm.jsonl
for k in twice rev revm; do
	cp "$D/docs.bin" "tk/$k.bin"
	cp "$D/docs.idx" "tk/$k.idx"
	[ $k = revm ] && head -c $(($(wc -c <"$D/docs.idx") - 32)) \
		"$D/docs.idx" >"tk/$k.idx"
	python3 killed.py "$TOKENIZE" --tokenizer "$D/tokenizer.json" \
		--append-eod --input $k.jsonl --output-prefix tk/$k >k.log 2>&1
	rc=$?
	[ "$rc" -eq 137 ] || fail "$k: the killed run exited $rc: $(cat k.log)"
	refuse "an interrupted epjit-tokenize" --data "$tmp/tk/$k" --steps 1
	grep -q 'fingerprint' refuse.err || [ $k = twice ] ||
		fail "$k: no fingerprint: $(cat refuse.err)"
	rm -f tk/$k.*
done
# a rename that fails: over a directory, first (nothing written) or second
mkdir tk/d1.idx tk/d2.bin
tok_refuse "nothing was written" --input "$D/docs.jsonl" --output-prefix tk/d1
[ -e tk/d1.bin ] && fail "tk/d1.bin written after the .idx's rename failed"
tok_refuse "replaced: $tmp/tk/d2.idx; NOT replaced: $tmp/tk/d2.bin" \
	--input "$D/docs.jsonl" --output-prefix "$tmp/tk/d2"
ls tk/*.tmp >/dev/null 2>&1 && fail "temporary files left: $(ls tk/*.tmp)"
rm -r tk/d1.idx tk/d2.bin tk/d2.idx
tok_refuse "nothing was written" --input "$D/docs.jsonl" \
	--output-prefix tk/none/x
# bad input: FILE:LINE: reason, nothing written
printf '{"text": "the"}\n{"text": "a \377 b"}\n' >u.jsonl
tok_refuse "u.jsonl:2: not UTF-8" --input u.jsonl --output-prefix tk/u
printf '{"text": "the"}\n\n{"text": "a \\ud800 b"}\n' >s.jsonl
tok_refuse "s.jsonl:3: 'text' holds a lone surrogate" --input s.jsonl \
	--output-prefix tk/s
for e in "١٢" "²"; do
	tok_refuse "no token '$e'" --input "$D/docs.jsonl" --output-prefix tk/e \
		--eod-token "$e"
done
[ -z "$(ls tk)" ] || fail "files written by failed runs: $(ls tk)"
tokenize --input "$D/docs.jsonl" --output-prefix tk/e --eod-token 1 \
	>tk.log 2>&1 || fail "--eod-token 1: $(cat tk.log)"
cmp -s tk/e.bin "$D/docs.bin" || fail "--eod-token 1 is not <|endoftext|>"
# ---- 6. supervised fine-tuning: prompts, completions, conversations ----
if ! python3 -c 'import jinja2' 2>/dev/null; then
	echo "note: no Python jinja2 package (chat templates): part 6 skipped"
	echo "dataset.sh: ok"
	exit 0
fi
cat >chat.jinja <<'EOF'
{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}
EOF
cat >sft.jsonl <<'EOF'
{"prompt": "the cat sat on", "completion": "the mat"}
{"messages": [{"role": "system", "content": "one small model"}, {"role": "user", "content": "the dog"}, {"role": "assistant", "content": "sat on the log"}, {"role": "user", "content": "and the cat"}, {"role": "assistant", "content": "sat on the mat"}]}
{"prompt": [{"role": "user", "content": "four experts"}], "completion": [{"role": "assistant", "content": "reads each token"}]}
{"text": "a small model reads the tokens"}
EOF
tokenize --input sft.jsonl --output-prefix tk/sft --chat-template chat.jinja \
	>tk.log 2>&1 || fail "epjit-tokenize SFT: $(cat tk.log)"
grep -q "trained (loss mask)" tk.log || fail "no mask summary: $(cat tk.log)"
# the mask read as Megatron lays it out: a uint8 sequence per document, of
# the token sequence's length; "id:mask" per token
cat >readmask.py <<'EOF'
import struct, sys
def seqs(prefix):
    idx = open(prefix + ".idx", "rb").read()
    code, n = idx[17], struct.unpack_from("<Q", idx, 18)[0]
    lens = struct.unpack_from("<%di" % n, idx, 34)
    size, fmt = {1: (1, "B"), 8: (2, "H"), 4: (4, "i")}[code]
    b = open(prefix + ".bin", "rb").read()
    out, o = [], 0
    for l in lens:
        out.append(struct.unpack_from("<%d%s" % (l, fmt), b, o * size))
        o += l
    return code, out
tc, toks = seqs(sys.argv[1])
mc, masks = seqs(sys.argv[1] + ".lossmask")
assert mc == 1, mc
assert [len(t) for t in toks] == [len(m) for m in masks]
for t, m in zip(toks, masks):
    print(" ".join("%d:%d" % (a, b) for a, b in zip(t, m)))
EOF
python3 readmask.py tk/sft >mask.txt || fail "reading the mask: $(cat mask.txt)"
# the fixture's ids: the 2, cat 11, sat 28, on 25, mat 14, dog 6, log 13,
# and 3, one 9, small 15, model 55, four 7, experts 19, reads 26, each 17,
# token 10, EOD 1; the template's words are not in the vocabulary: 0
line() { sed -n "${1}p" mask.txt; }
[ "$(line 1)" = "2:0 11:0 28:0 25:0 2:1 14:1 1:1" ] ||
	fail "prompt-completion mask: $(line 1)"
want="0:0 0:0 9:0 15:0 55:0 0:0 0:0 0:0 2:0 6:0 0:0 0:0 0:0 28:1 25:1 2:1 13:1 0:1 0:0 0:0 3:0 2:0 11:0 0:0 0:0 0:0 28:1 25:1 2:1 14:1 0:1 1:1"
[ "$(line 2)" = "$want" ] || fail "conversation mask: $(line 2)"
want="0:0 0:0 7:0 19:0 0:0 0:0 0:0 26:1 17:1 10:1 0:1 1:1"
[ "$(line 3)" = "$want" ] ||
	fail "conversational prompt-completion mask: $(line 3)"
case "$(line 4)" in
*:0\ * | *:0) fail "a text line has untrained tokens: $(line 4)" ;;
esac
run sft.log --data "$tmp/tk/sft" --seq 6 --steps 2 --split 1,0,0 --compile
grep -q "batches: the data's loss mask, loss per token over the global batch" \
	sft.log || fail "the SFT run's banner: $(cat sft.log)"
# the per-token loss over micro-batches and ranks: 1 rank accumulating 2
# micro-batches of 2 rows, and 2 ranks of 1 micro-batch of 2 rows, take
# the steps of 1 rank with one micro-batch of the same 4 rows, although
# the micro-batches count other numbers of tokens (losses and gradient
# norms equal to f32 rounding; a mean of micro-batch means differs)
MPIRUN=$(command -v mpirun || command -v mpiexec)
grep -q '^#define HAVE_MPI 1' "$builddir/config.h" 2>/dev/null || MPIRUN=
for k in 41 22 21; do
	printf '{"train_micro_batch_size_per_gpu": %s, "gradient_accumulation_steps": %s, "steps_per_print": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}\n' \
		"${k%?}" "${k#?}" >g$k.json
done
same_steps() {
	paste -d, "$1" "$2" | sed 1d | awk -F, '
		function rel(a, b) { d = a - b; if (d < 0) d = -d; return d / (b < 0 ? -b : b) }
		{ h = NF / 2
		  if (!(rel($(h + 2), $2) <= 1e-6 && rel($(h + 4), $4) <= 1e-5)) bad = 1; n++ }
		END { exit bad || n != 3 }' ||
		fail "$3: $(cat "$1" "$2")"
}
for k in 41 22; do
	run g$k.log --data "$tmp/tk/sft" --seq 6 --steps 3 --split 1,0,0 \
		--config g$k.json --metrics g$k.csv
done
same_steps g41.csv g22.csv "2 accumulated micro-batches differ from 1 of both"
if [ -n "$MPIRUN" ]; then
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
		timeout 300 "$MPIRUN" -np 2 --oversubscribe "$TRAIN" \
		--data "$tmp/tk/sft" --seq 6 --steps 3 --split 1,0,0 \
		--config g21.json --metrics g21.csv >g21.log 2>&1 ||
		fail "2 ranks on the SFT data: $(cat g21.log)"
	same_steps g41.csv g21.csv "2 ranks differ from 1 rank"
fi
# refused: a conversation without a template, a template that rewrites
# earlier turns, the epjtok format (no mask there)
tok_refuse "sft.jsonl:2: a conversation needs a chat template" \
	--input sft.jsonl --output-prefix tk/x
printf '%s\n' "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if messages|length > 2 %}x{% endif %}" >bad.jinja
tok_refuse "does not render message" --input sft.jsonl \
	--output-prefix tk/x --chat-template bad.jinja
tok_refuse "needs --format megatron" --input sft.jsonl --output-prefix tk/x \
	--chat-template chat.jinja --format epjtok
[ -e tk/x.idx ] && fail "files written by refused SFT runs: $(ls tk)"
# killed after its 1st, 2nd and 3rd rename (mask .idx, mask .bin, token
# .idx) over the SFT prefix: the trainer refuses what is left
head -n 2 sft.jsonl >sft2.jsonl
for k in 1 2 3; do
	mkdir kk
	cp tk/sft.idx tk/sft.bin tk/sft.lossmask.idx tk/sft.lossmask.bin kk/
	sed "s/calls\[0\] == 2/calls[0] == $((k + 1))/" killed.py >killed$k.py
	python3 killed$k.py "$TOKENIZE" --tokenizer "$D/tokenizer.json" \
		--append-eod --input sft2.jsonl --output-prefix kk/sft \
		--chat-template chat.jinja >k.log 2>&1
	rc=$?
	[ "$rc" -eq 137 ] ||
		fail "SFT killed after rename $k: exit $rc: $(cat k.log)"
	refuse "epjit-tokenize" --data "$tmp/kk/sft" --seq 6 --steps 1 \
		--split 1,0,0
	rm -r kk
done
# a text-only run over the prefix removes the stale mask
tokenize --input "$D/docs.jsonl" --output-prefix tk/sft >tk.log 2>&1 ||
	fail "text over an SFT prefix: $(cat tk.log)"
grep -q "removed the stale" tk.log || fail "stale mask kept: $(cat tk.log)"
[ -e tk/sft.lossmask.idx ] && fail "tk/sft.lossmask.idx still there"
run sft3.log --data "$tmp/tk/sft" --seq 6 --steps 1 --split 1,0,0
echo "dataset.sh: ok"
