#!/usr/bin/env python3
"""Regenerates the token-dataset fixtures of t/check_data.c (not run by make
check; needs the tokenizers and numpy packages).  From the source root:

    python3 t/data/dataset/make-fixtures.py

tokenizer.json  a word-level tokenizer: [UNK] 0, <|endoftext|> 1, then the
                58 most frequent words of docs.jsonl (ties alphabetical)
docs.bin/.idx   tools/epjit-tokenize --append-eod on docs.jsonl
docs.expected   each document's ids, one line each, from the tokenizer
                itself (not from the files above)
*.npy           small arrays written by numpy, each with NAME.expected:
                its rows (a 1-D array is one row) as lines of ids
"""
import collections
import json
import os
import subprocess
import sys

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(os.path.dirname(here)))


def path(name):
    return os.path.join(here, name)


texts = [json.loads(l)["text"] for l in open(path("docs.jsonl"))]
count = collections.Counter(w for t in texts for w in t.split())
words = sorted(count, key=lambda w: (-count[w], w))[:58]
vocab = {"[UNK]": 0, "<|endoftext|>": 1}
for w in words:
    vocab[w] = len(vocab)
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(path("tokenizer.json"))

# the reference ids, straight from the tokenizer
with open(path("docs.expected"), "w") as f:
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False).ids + [1]
        f.write(" ".join(map(str, ids)) + "\n")

subprocess.run(
    [sys.executable, os.path.join(root, "tools", "epjit-tokenize"),
     "--input", path("docs.jsonl"), "--tokenizer", path("tokenizer.json"),
     "--output-prefix", path("docs"), "--append-eod"],
    check=True)

rng = np.random.default_rng(20261202)


def npy(name, arr, version):
    with open(path(name), "wb") as f:
        np.lib.format.write_array(f, arr, version=version)
    rows = arr.reshape(1, -1) if arr.ndim == 1 else arr
    with open(path(name[:-4] + ".expected"), "w") as f:
        for r in rows:
            f.write(" ".join(map(str, r.tolist())) + "\n")


npy("stream_u2.npy", rng.integers(0, 64, 301).astype("<u2"), (1, 0))
npy("rows_i8.npy", rng.integers(0, 64, (7, 19)).astype("<i8"), (1, 0))
npy("rows_u4.npy", rng.integers(0, 64, (5, 23)).astype("<u4"), (2, 0))
npy("stream_i4.npy", rng.integers(0, 64, 97).astype("<i4"), (3, 0))
