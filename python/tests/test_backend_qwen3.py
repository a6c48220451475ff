"""transformers' Qwen3 decoder layers (dense) and a tiny Qwen3-MoE model
with its MoE blocks eager, compiled with backend="epjit", against eager."""

import pytest
import torch

import epjit
from backend_util import (disable_moe_blocks, fresh,  # noqa: F401
                          lm_step, rel_err)

pytestmark = pytest.mark.usefixtures("fresh")

transformers = pytest.importorskip("transformers")
from transformers import Qwen3Config, Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3 as q3  # noqa: E402

TOL = 1e-5


def qwen3_config():
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=2, vocab_size=100)
    cfg._attn_implementation = "sdpa"
    return cfg


class Layers(torch.nn.Module):
    """Decoder layers with the rotary tables computed eagerly (the regions
    DeepSpeed compiles are the layers)."""

    def __init__(self, cfg, depth):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [q3.Qwen3DecoderLayer(cfg, i) for i in range(depth)])
        self.rope = q3.Qwen3RotaryEmbedding(cfg)

    def forward(self, x):
        pos = torch.arange(x.shape[1])[None]
        ce = self.rope(x, pos)
        for layer in self.layers:
            x = layer(x, position_embeddings=ce, attention_mask=None)
            if isinstance(x, tuple):
                x = x[0]
        return x


def grads_and_out(model, x):
    model.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    y = model(xr)
    loss = (y * y).mean()
    loss.backward()
    g = {n.replace("_orig_mod.", ""): p.grad.clone()
         for n, p in model.named_parameters()}
    g["x"] = xr.grad.clone()
    return y.detach(), loss.detach(), g


def check_same(ref, got):
    assert rel_err(got[0], ref[0]) <= TOL
    assert rel_err(got[1], ref[1]) <= TOL
    assert set(got[2]) == set(ref[2])
    for n in ref[2]:
        assert rel_err(got[2][n], ref[2][n]) <= TOL, n


@pytest.mark.parametrize("depth", [1, 2])
def test_qwen3_layers_compiled_per_layer(depth):
    """Each layer compiled on its own (as DeepSpeed's regional compile does):
    identical layers share graphs, so unique graphs do not grow with depth."""
    m = Layers(qwen3_config(), depth)
    x = torch.randn(2, 8, 64)
    ref = grads_and_out(m, x)
    for i, layer in enumerate(m.layers):
        m.layers[i] = torch.compile(layer, backend="epjit")
    check_same(ref, grads_and_out(m, x))
    c = epjit.counters()
    assert c["kernels"] > 0 and c["graphs"] > 0
    # forward and backward of one layer, whatever the depth
    assert c["unique_graphs"] == UNIQUE.setdefault("layers", c["unique_graphs"])
    # one epjit graph for a layer's forward, one for its backward, whatever
    # the depth (Dynamo reuses its graph for every layer)
    assert c["graphs"] == 2
    # transposed weights are read in place, not copied
    assert c["input_copies"] == 0
    # the sdpa pair and the GEMMs ran in epjit; nothing fell back
    assert c["fallback_nodes"] == 0, c["fallback"]


UNIQUE = {}


def test_identical_graphs_share_one_compiled_graph():
    """A second Dynamo compile of the same layer (new FX graphs) finds every
    graph by signature in epjit's cache: nothing compiled again."""
    cfg = qwen3_config()
    m = Layers(cfg, 1)
    x = torch.randn(2, 8, 64)
    ref = grads_and_out(m, x)
    m.layers[0] = torch.compile(m.layers[0], backend="epjit")
    check_same(ref, grads_and_out(m, x))
    first = epjit.counters()
    torch._dynamo.reset()
    m.layers[0] = torch.compile(m.layers[0]._orig_mod, backend="epjit")
    check_same(ref, grads_and_out(m, x))
    c = epjit.counters()
    assert c["graphs"] == 2 * first["graphs"]
    assert c["unique_graphs"] == first["unique_graphs"]
    assert c["graph_cache_hits"] - first["graph_cache_hits"] >= \
        first["unique_graphs"]


def test_qwen3_whole_stack_compiled():
    m = Layers(qwen3_config(), 2)
    x = torch.randn(2, 8, 64)
    ref = grads_and_out(m, x)
    check_same(ref, grads_and_out(torch.compile(m, backend="epjit"), x))
    c = epjit.counters()
    assert c["kernels"] > 0
    # the rotary tables (cos, sin) are compiled
    assert "aten.cos.default" not in c["fallback"], c["fallback"]
    assert "aten.sin.default" not in c["fallback"], c["fallback"]


def test_qwen3_moe_model_with_eager_moe_blocks():
    from transformers import Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=96,
                         moe_intermediate_size=32, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16,
                         num_hidden_layers=2, vocab_size=128,
                         num_experts=4, num_experts_per_tok=2,
                         decoder_sparse_step=1, mlp_only_layers=[])
    cfg._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(cfg)
    assert disable_moe_blocks(model, "Qwen3MoeSparseMoeBlock") == 2
    ids = torch.randint(0, 128, (2, 16))

    ref = lm_step(model, model, ids)
    got = lm_step(model, torch.compile(model, backend="epjit"), ids)
    check_same(ref, got)
    c = epjit.counters()
    assert c["kernels"] > 0 and c["graphs"] > 0
    # the loss, the labels' shift and the rotary tables included
    assert c["fallback_nodes"] == 0, c["fallback"]


def test_qwen3_layer_bf16():
    """bf16 parameters and activations: within bf16's rounding (2e-2 of the
    largest magnitude) of eager torch."""
    m = Layers(qwen3_config(), 1).to(torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    ref = grads_and_out(m, x)
    m.layers[0] = torch.compile(m.layers[0], backend="epjit")
    got = grads_and_out(m, x)
    assert rel_err(got[0], ref[0]) <= 2e-2
    assert rel_err(got[1], ref[1]) <= 2e-2
    for n in ref[2]:
        assert rel_err(got[2][n], ref[2][n]) <= 2e-2, n
    c = epjit.counters()
    assert c["kernels"] > 0 and c["fallback_nodes"] == 0, c["fallback"]
