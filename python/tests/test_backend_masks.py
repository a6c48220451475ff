"""Padding masks: sdpa with an attn_mask (bool or additive float, broadcast,
GQA, causal with it, fully masked rows) and the ops transformers builds a
padding mask with, compiled by epjit, against eager torch."""

import pytest
import torch
import torch.nn.functional as F

import epjit
from backend_util import disable_moe_blocks, fresh, rel_err  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh")

SDPA = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default")


def _flash(q, k, v, m, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=m, scale=0.3)[0]


def _public(q, k, v, m, causal):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=m, is_causal=causal,
        enable_gqa=q.shape[1] != k.shape[1], scale=0.3)


def _attend(fn, q, k, v, m, causal):
    """fn's output and the gradients of q, k, v under a weighted sum."""
    qkv = [x.clone().requires_grad_() for x in (q, k, v)]
    o = fn(*qkv, m, causal)
    w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)
    (o * w).sum().backward()
    return [o.detach()] + [x.grad for x in qkv]


def _mask(kind, shape, dtype):
    """A mask of shape with about 40% hidden and its first query row of
    the first batch (or head) hidden entirely."""
    keep = torch.rand(shape) > 0.4
    keep[(0,) * (len(shape) - 2) + (0,)] = False
    if kind == "bool":
        return keep
    bias = torch.randn(shape)
    return torch.where(keep, bias, torch.tensor(float("-inf"))).to(dtype)


# (B, Hq, Hkv, T, S, mask kind, mask shape, causal)
CASES = [
    (2, 4, 2, 5, 7, "bool", (2, 1, 5, 7), False),
    (2, 4, 2, 5, 7, "float", (1, 4, 5, 7), False),
    (2, 4, 4, 6, 6, "float", (2, 1, 1, 6), True),
    (2, 4, 2, 5, 7, "float", (5, 7), True),
    (1, 2, 2, 7, 5, "float", (1, 2, 7, 5), True),
    (2, 4, 2, 7, 5, None, None, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_sdpa_mask_matches_eager(case, dtype):
    """Forward and the gradients of q, k, v: f32 to 1e-5, bf16 to 3e-2;
    the rows that see no key are 0 in both, with no gradient."""
    b, hq, hk, t, s, kind, mshape, causal = CASES[case]
    q = torch.randn(b, hq, t, 8, dtype=dtype)
    k = torch.randn(b, hk, s, 8, dtype=dtype)
    v = torch.randn(b, hk, s, 8, dtype=dtype)
    m = _mask(kind, mshape, dtype) if kind else None
    # the public API turns a bool mask into the op's additive one (the op
    # takes only that) and refuses a mask with is_causal (the op takes both)
    fn = _public if kind == "bool" else _flash
    ref = _attend(fn, q, k, v, m, causal)
    got = _attend(torch.compile(fn, backend="epjit"), q, k, v, m, causal)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, r) <= tol, name
    if kind:
        assert ref[0][0, 0, 0].abs().max() == 0  # a row with no key
        assert got[0][0, 0, 0].abs().max() == 0
        assert got[1][0, 0, 0].abs().max() == 0
    c = epjit.counters()
    assert c["kernels"] > 0
    for op in SDPA + ("aten.where.self", "aten.scalar_tensor.default"):
        assert op not in c["fallback"], (op, c["fallback"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_math_path_matches_eager(dtype):
    """v's head dim other than q's (MLA: qk_nope + qk_rope against v): torch
    takes its math path, whose _safe_softmax is compiled too, the rows that
    see no key 0 with no gradient; f32 to 1e-5, bf16 to 3e-2."""
    q = torch.randn(2, 4, 5, 16, dtype=dtype)
    k = torch.randn(2, 2, 7, 16, dtype=dtype)
    v = torch.randn(2, 2, 7, 8, dtype=dtype)
    m = _mask("bool", (2, 1, 5, 7), dtype)
    ref = _attend(_public, q, k, v, m, False)
    got = _attend(torch.compile(_public, backend="epjit"), q, k, v, m, False)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, r) <= tol, name
    assert ref[0][0, :, 0].abs().max() == 0  # a row with no key
    assert got[0][0, :, 0].abs().max() == 0
    assert got[1][0, :, 0].abs().max() == 0
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback"] == {}, c["fallback"]


def test_sdpa_mask_lse_matches_eager():
    """The logsumexp the backward reads: f32 [B, H, T], 0 on a row with no
    key, as torch's CPU kernel returns it."""
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    m = _mask("float", (2, 1, 5, 5), torch.float32)

    def f(q, k, v, m):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=m)

    ref = f(q, k, v, m)
    got = torch.compile(f, backend="epjit")(q, k, v, m)
    assert got[1].dtype == torch.float32 and got[1].shape == (2, 2, 5)
    assert rel_err(got[1], ref[1]) <= 1e-5 and rel_err(got[0], ref[0]) <= 1e-5
    assert ref[1][0, 0, 0] == 0 and got[1][0, 0, 0] == 0
    assert SDPA[0] not in epjit.counters()["fallback"]


tf = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
              vocab_size=128)
# name: (config, model, config kwargs, MoE block class name)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1,
                       mlp_only_layers=[]), "Qwen3MoeSparseMoeBlock"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2),
                "MixtralSparseMoeBlock"),
}


def _model(family, dtype):
    # seed 1: with seed 0, one of Mixtral's bf16 tokens has two experts
    # tied within bf16's rounding, and the last-bit differences of any
    # compiler (torch's sdpa left to torch too) pick another expert
    torch.manual_seed(1)
    cfg_name, model_name, extra, moe = FAMILIES[family]
    cfg = getattr(tf, cfg_name)(**COMMON, **extra)
    cfg._attn_implementation = "sdpa"
    model = getattr(tf, model_name)(cfg).to(dtype)
    assert disable_moe_blocks(model, moe) == 2
    return model


def _padded_batch(left):
    """ids [3, 12] and an attention_mask with 0, 4 and 7 pads on the left
    (or the right); the pads' labels are ignored."""
    ids = torch.randint(0, 128, (3, 12))
    am = torch.ones(3, 12, dtype=torch.long)
    for row, n in ((1, 4), (2, 7)):
        if left:
            am[row, :n] = 0
        else:
            am[row, 12 - n:] = 0
    return ids, am, ids.masked_fill(am == 0, -100)


def _step(model, m, batch):
    ids, am, labels = batch
    model.zero_grad(set_to_none=True)
    out = m(input_ids=ids, attention_mask=am, labels=labels)
    out.loss.backward()
    g = {n.replace("_orig_mod.", ""): p.grad.clone()
         for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), g


def _check(ref, got, tol):
    assert rel_err(got[0], ref[0]) <= tol
    assert rel_err(got[1], ref[1]) <= tol
    assert set(got[2]) == set(ref[2]) and len(ref[2]) > 10
    for n in ref[2]:
        assert rel_err(got[2][n], ref[2][n]) <= tol, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,left", [("qwen3_moe", True),
                                         ("mixtral", False)])
def test_padded_batch_whole_model(family, left, dtype):
    """A padded batch through the whole model: the mask's construction and
    the attention with it compile, nothing is left to torch; f32 to 1e-5,
    bf16 to 3e-2 (as the other family tests)."""
    model = _model(family, dtype)
    batch = _padded_batch(left)
    ref = _step(model, model, batch)
    got = _step(model, torch.compile(model, backend="epjit"), batch)
    _check(ref, got, 1e-5 if dtype == torch.float32 else 3e-2)
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


def test_padded_batch_per_layer():
    """Each decoder layer compiled on its own (DeepSpeed's regional
    compile): the mask arrives as a bool graph input."""
    model = _model("qwen3_moe", torch.float32)
    batch = _padded_batch(True)
    ref = _step(model, model, batch)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, backend="epjit")
    _check(ref, _step(model, model, batch), 1e-5)
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


def test_mask_ops_match_eager():
    """where (tensors and numbers, broadcast), a cast to bool (NaN true,
    -0.0 false), index with negative indices: exact."""
    def f(x, am, i, j):
        keep = am.bool()
        sel = x[i, j]
        a = torch.where(keep[:, None, :], x, float("-inf"))
        b = torch.where(x.bool(), 2.0, x)
        # the additive mask sdpa makes of a bool one: log(keep)
        c = torch.where(keep[:, None, :], 0.0, float("-inf"))
        return a, b, sel, torch.where(keep, am, -3), c

    x = torch.randn(3, 4, 5)
    x[0, 0, :3] = torch.tensor([float("nan"), -0.0, 0.0])
    am = torch.tensor([[1, 0, 2, 0, 1], [0, 0, 0, 0, 0], [5, 1, 1, 1, 1]])
    i = torch.tensor([[0], [-1], [1]])
    j = torch.tensor([[-4, 3, 0]])
    ref = f(x, am, i, j)
    got = torch.compile(f, backend="epjit")(x, am, i, j)
    for a, r in zip(got, ref):
        assert a.dtype == r.dtype and a.shape == r.shape
        assert torch.equal(a, r) or torch.allclose(a, r, equal_nan=True,
                                                   rtol=0, atol=0)
    c = epjit.counters()
    # the numbers arrive as scalar_tensor: where.self
    for op in ("aten.where.self", "aten.scalar_tensor.default",
               "aten._to_copy.default", "aten.index.Tensor"):
        assert op not in c["fallback"], (op, c["fallback"])


def test_masked_sdpa_is_the_sdpa_op(monkeypatch):
    """A padded batch's masked sdpa (forward and backward) compiles by
    default into the sdpa op itself, the mask its last input (not into a
    decomposed attention), and matches eager."""
    from epjit import lower
    seen = []
    op = lower.Lowering.op

    def spy(self, name, *a, **kw):
        seen.append(name)
        return op(self, name, *a, **kw)

    monkeypatch.setattr(lower.Lowering, "op", spy)
    model = _model("qwen3_moe", torch.float32)
    batch = _padded_batch(True)
    ref = _step(model, model, batch)
    got = _step(model, torch.compile(model, backend="epjit"), batch)
    _check(ref, got, 1e-5)
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]
    layers = len(model.model.layers)
    assert seen.count("sdpa") >= layers
    assert seen.count("sdpa_backward") == seen.count("sdpa")
