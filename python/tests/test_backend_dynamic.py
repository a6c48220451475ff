"""Graphs Dynamo traces with symbolic shapes (torch.compile's default
dynamic=None once a shape changes, or dynamic=True): compiled by epjit per
concrete shape, equal to eager, forward and backward."""

import warnings

import pytest
import torch

import epjit
from backend_util import fresh, rel_err  # noqa: F401
from epjit import _backend

pytestmark = pytest.mark.usefixtures("fresh")

tf = pytest.importorskip("transformers")


def _qwen3_layer(dtype):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3DecoderLayer, Qwen3RotaryEmbedding)
    cfg = Qwen3Config(hidden_size=48, intermediate_size=80,
                      num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, vocab_size=64, num_hidden_layers=1,
                      max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    return (Qwen3DecoderLayer(cfg, layer_idx=0).to(dtype),
            Qwen3RotaryEmbedding(cfg))


def _step(layer, rope, fn, x, dtype):
    """Forward and backward of fn on x: (out, x.grad, {name: grad})."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
    cos, sin = rope(x, pos)
    out = fn(x, attention_mask=None, position_embeddings=(cos, sin))
    if isinstance(out, tuple):
        out = out[0]
    g = torch.randn(out.shape, dtype=dtype,
                    generator=torch.Generator().manual_seed(7))
    out.backward(g)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad.clone(), grads


@pytest.mark.parametrize("dynamic", [None, True])
def test_shapes_change(dynamic):
    """A decoder layer under torch.compile with dynamic shapes, called with
    sequences of 5, 9, 17 and 9 again tokens, then batch 3: every call
    matches eager in the output, the input's and every parameter's
    gradient; epjit compiled each new shape (nothing left to torch for
    symbolic shapes), and the repeated shape reused its graphs."""
    dtype = torch.float32
    layer, rope = _qwen3_layer(dtype)
    fn = torch.compile(layer, backend="epjit", dynamic=dynamic)
    seen = []
    for b, t in ((2, 5), (2, 9), (2, 17), (2, 9), (3, 9)):
        x = torch.randn(b, t, 48, dtype=dtype)
        out, gx, grads = _step(layer, rope, fn, x, dtype)
        r_out, r_gx, r_grads = _step(layer, rope, layer, x, dtype)
        assert rel_err(out, r_out) < 1e-5, (b, t)
        assert rel_err(gx, r_gx) < 1e-5, (b, t)
        for name, g in r_grads.items():
            assert rel_err(grads[name], g) < 1e-5, (b, t, name)
        c = epjit.counters()
        seen.append((c["specialized"], c["graphs"]))
        assert not any("symbolic" in why for reasons in
                       c["fallback"].values() for why in reasons), \
            c["fallback"]
    # the repeated shape compiled nothing new
    assert seen[3] == seen[2], seen
    # dynamic=True: every call on symbolic shapes; None: the first call
    # static, the rest symbolic
    assert seen[2][0] == (6 if dynamic else 4), seen
    assert seen[4][0] > seen[3][0], seen  # batch 3: a new shape
    assert seen[2][1] > seen[1][1] > seen[0][1] > 0, seen


def test_too_many_shapes_run_in_torch(monkeypatch):
    """Past MAX_SHAPES distinct shapes a graph traced with symbolic shapes
    runs in torch, correct and counted."""
    monkeypatch.setattr(_backend, "MAX_SHAPES", 2)
    m = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.SiLU(),
                            torch.nn.Linear(20, 6))
    fn = torch.compile(m, backend="epjit", dynamic=True)
    for t in (3, 5, 7, 11):
        x = torch.randn(t, 12, requires_grad=True)
        y = fn(x)
        y.backward(torch.ones_like(y))
        gx = x.grad.clone()
        x.grad = None
        ref = m(x)
        ref.backward(torch.ones_like(ref))
        assert rel_err(y, ref) < 1e-5
        assert rel_err(gx, x.grad) < 1e-5
    c = epjit.counters()
    assert c["specialized"] == 4  # 2 shapes x forward and backward
    whys = {why for reasons in c["fallback"].values() for why in reasons}
    assert "symbolic shape: more than 2 shapes" in whys, c["fallback"]


def test_specialize_folds_sizes():
    """_specialize turns the integers a symbolic graph computes from sizes
    into constants: the copy has no SymInt left, and gives the original's
    results."""
    def f(x, y):
        n = x.shape[0] * 2
        return (x.reshape(n, -1) + 1).sum(0) * y.shape[1]

    from torch.fx.experimental.proxy_tensor import make_fx
    x, y = torch.randn(3, 4), torch.randn(2, 5)
    gm = make_fx(f, tracing_mode="symbolic")(x, y)
    assert _backend._symbolic([n.meta["val"] for n in gm.graph.nodes
                               if n.op == "placeholder"])
    g = _backend._specialize(gm, [x, y])
    for n in g.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            assert all(isinstance(d, int) for d in v.shape), n
        assert not isinstance(v, torch.SymInt), n
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(g(x, y), f(x, y))
