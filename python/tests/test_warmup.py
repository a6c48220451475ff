"""epjit-warmup --graphs fills a kernel cache for a torch run: the graphs the
backend compiled, recorded in a graph file (EPJIT_GRAPH_RECORD,
epjit.record_graphs), compiled by the tool into a fresh cache, after which
a new process running the same model takes every kernel from that cache and
still matches eager."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import epjit
from backend_util import fresh, rel_err  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.usefixtures("fresh")


def warmup_binary():
    """epjit-warmup of the build tree the package came from: $EPJIT_BUILD_DIR,
    else the source tree's build/ (where .ci/python-tests builds), else
    $PATH; None when there is none."""
    cands = []
    if os.environ.get("EPJIT_BUILD_DIR"):
        cands.append(os.path.join(os.environ["EPJIT_BUILD_DIR"], "tools",
                                  "epjit-warmup"))
    cands.append(os.path.join(ROOT, "build", "tools", "epjit-warmup"))
    cands.append(shutil.which("epjit-warmup") or "")
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


# One transformers Qwen3 decoder layer (sdpa, RMSNorm, RoPE) compiled with
# backend="epjit", forward and backward, against eager; prints the counters
# and the largest relative error.
SCRIPT = r"""
import json, sys
import torch
import epjit
sys.path.insert(0, %(here)r)
from backend_util import rel_err
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as q3

torch.manual_seed(0)
cfg = Qwen3Config(hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=1, vocab_size=100)
cfg._attn_implementation = "sdpa"
layer = q3.Qwen3DecoderLayer(cfg, 0)
rope = q3.Qwen3RotaryEmbedding(cfg)
x = torch.randn(2, 8, 64)


def step(f):
    layer.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    ce = rope(xr, torch.arange(8)[None])
    y = f(xr, position_embeddings=ce, attention_mask=None)
    if isinstance(y, tuple):
        y = y[0]
    (y * y).mean().backward()
    return [y.detach(), xr.grad] + [p.grad for p in layer.parameters()]


ref = step(layer)
got = step(torch.compile(layer, backend="epjit"))
c = epjit.counters()
c.pop("raw")
c["err"] = max(rel_err(a, b) for a, b in zip(got, ref))
print("RESULT " + json.dumps(c))
"""


def run_layer(tmp_path, cache, record=None):
    """SCRIPT in a new process (a fresh Dynamo and libepjit) on kernel cache
    `cache`, recording its graphs to `record`: its counters."""
    script = tmp_path / "layer.py"
    script.write_text(SCRIPT % {"here": HERE})
    env = dict(os.environ, EPJIT_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    env.pop("EPJIT_GRAPH_RECORD", None)
    env.pop("EPJIT_DEBUG_DUMP", None)
    if record:
        env["EPJIT_GRAPH_RECORD"] = str(record)
    p = subprocess.run([sys.executable, str(script)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, p.stdout + p.stderr
    return json.loads(lines[0][len("RESULT "):])


def graphs_in(path):
    with open(path) as f:
        data = json.load(f)
    assert data["epjit_graphs"] == 1
    return data["graphs"]


def test_warmup_fills_the_cache_for_a_torch_run(tmp_path):
    pytest.importorskip("transformers")
    warm = warmup_binary()
    if warm is None:
        pytest.skip("no epjit-warmup binary: build the C tree (build/, or "
                    "EPJIT_BUILD_DIR) first")
    record = tmp_path / "graphs.json"
    first = run_layer(tmp_path, tmp_path / "cache-record", record)
    assert first["err"] <= 1e-5
    assert first["kernels"] > 0 and first["fallback_nodes"] == 0
    graphs = graphs_in(record)
    assert len(graphs) >= 2  # forward and backward
    assert first["graphs"] >= len(graphs)
    ops = {n["op"] for g in graphs for n in g["nodes"]}
    assert "sdpa" in ops or "sdpa_backward" in ops, ops

    fresh_cache = tmp_path / "cache-warm"
    env = dict(os.environ, EPJIT_CACHE_DIR=str(fresh_cache))
    p = subprocess.run([warm, "-j", "2", "--graphs", str(record)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "%s: %d graphs" % (record, len(graphs)) in p.stdout, p.stdout
    done = re.search(r"(\d+) artifacts?: (\d+) compiled, (\d+) already "
                     r"cached, (\d+) failed", p.stdout)
    assert done, p.stdout
    n, compiled, cached, failed = map(int, done.groups())
    assert n > 0 and compiled == n and cached == 0 and failed == 0, p.stdout

    again = run_layer(tmp_path, fresh_cache)
    assert again["err"] <= 1e-5
    assert again["kernels"] > 0
    assert again["cache_misses"] == 0, again
    assert again["cache_hits"] > 0, again
    assert again["compiles"] == 0, again


def test_record_graphs_adds_each_graph_once(tmp_path):
    path = tmp_path / "g.json"
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(),
                            torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    counts = []
    epjit.record_graphs(path)
    try:
        for _ in range(2):  # the second compile adds nothing to the file
            epjit._backend._recorded.clear()  # as another process would
            torch._dynamo.reset()
            y = torch.compile(m, backend="epjit")(x)
            y.sum().backward()
            graphs = graphs_in(path)
            assert len(graphs) == len({json.dumps(g, sort_keys=True)
                                       for g in graphs})
            counts.append(len(graphs))
        assert counts[0] >= 2 and counts[1] == counts[0], counts
        assert rel_err(y, m(x)) <= 1e-5
    finally:
        epjit.record_graphs(None)
    first = counts[0]
    torch._dynamo.reset()
    torch.compile(m, backend="epjit")(x)
    assert len(graphs_in(path)) == first  # stopped


def test_recording_is_off_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EPJIT_GRAPH_RECORD", raising=False)
    m = torch.nn.Linear(4, 4)
    torch.compile(m, backend="epjit")(torch.randn(2, 4))
    assert epjit.counters()["graphs"] > 0
    assert os.listdir(tmp_path) == []


def test_a_file_that_is_no_graph_file_is_left_alone(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text('{"something": "else"}\n')
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    x = torch.randn(2, 4)
    epjit.record_graphs(path)
    try:
        with pytest.warns(UserWarning, match="not an epjit graph file"):
            y = torch.compile(m, backend="epjit")(x)
    finally:
        epjit.record_graphs(None)
    assert rel_err(y, m(x)) <= 1e-5  # the run goes on
    assert path.read_text() == '{"something": "else"}\n'
