"""Ops that Hugging Face models outside the six families make, lowered:
layer norm and its backward (Phi-MoE, GPT-style blocks), an embedding's
padding_idx (models that set pad_token_id), stack (Cohere2-MoE, ERNIE,
Jamba), reciprocal and log1p.  Values and gradients against eager torch,
nothing left to torch."""

import pytest
import torch

import epjit
from backend_util import assert_grads_match, fresh, rel_err  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh")

TOL = 1e-5


def _tol(dtype):
    return TOL if dtype == torch.float32 else 2e-2


def _no_fallback():
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


# (input shape, normalized shape, affine, bias)
LN_CASES = [((3, 5, 33), (33,), True, True),
            ((2, 7, 4, 6), (4, 6), True, True),
            ((4, 17), (17,), False, False),
            ((1, 1, 9), (9,), True, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(LN_CASES)))
def test_layer_norm_lowered(case, dtype):
    """torch.nn.LayerNorm (one and two normalized dims, with and without
    weight and bias, a single row) forward and backward: output, the
    input's, weight's and bias's gradients to 1e-5 (bf16 2e-2) of eager
    torch; native_layer_norm and its backward compiled by epjit."""
    shape, norm, affine, bias = LN_CASES[case]
    torch.manual_seed(case)
    ln = torch.nn.LayerNorm(norm, eps=1e-5, elementwise_affine=affine,
                            bias=bias).to(dtype)
    if affine:
        with torch.no_grad():
            ln.weight.normal_()
            if bias:
                ln.bias.normal_()
    x = (torch.randn(shape) * 3 + 1.5).to(dtype).requires_grad_(True)
    w = torch.randn(shape, dtype=dtype)

    def f(x):
        return ln(x) * 2

    ref = f(x)
    got = torch.compile(f, backend="epjit")(x)
    tol = _tol(dtype)
    assert got.dtype == ref.dtype
    assert rel_err(got, ref) <= tol
    params = tuple(p for p in ln.parameters())
    assert_grads_match(got, ref, (x,) + params, tol, w)
    _no_fallback()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_abs_sign_lowered(dtype):
    """abs and sign bitwise as torch's (+-0, NaN, Inf; abs(-0) is +0, sign
    of NaN and -0 is +0), abs's gradient (sgn) as torch's, integer abs."""
    x = torch.randn(4, 9, dtype=dtype)
    x[0, :5] = torch.tensor([0.0, -0.0, float("nan"), float("inf"),
                             float("-inf")])
    x.requires_grad_(True)

    def f(x):
        return torch.abs(x) * 3, torch.sign(x) + 1

    ref = f(x)
    got = torch.compile(f, backend="epjit")(x)
    for g, r in zip(got, ref):
        assert torch.equal(g.isnan(), r.isnan())
        assert torch.equal(g.nan_to_num(), r.nan_to_num())
        assert torch.equal(g.signbit(), r.signbit())
    w = torch.randn(4, 9, dtype=dtype)
    gref, = torch.autograd.grad((ref[0] * w).nan_to_num().sum(), x)
    ggot, = torch.autograd.grad((got[0] * w).nan_to_num().sum(), x)
    assert torch.equal(ggot.isnan(), gref.isnan())
    assert torch.equal(ggot.nan_to_num(), gref.nan_to_num())
    i = torch.randint(-9, 9, (3, 5))
    assert torch.equal(torch.compile(torch.abs, backend="epjit")(i),
                       torch.abs(i))
    _no_fallback()


def test_layer_norm_constant_row():
    """A row of equal values: variance 0, rstd = 1 / sqrt(eps), output the
    bias; its input gradient as torch's (finite)."""
    ln = torch.nn.LayerNorm(8)
    with torch.no_grad():
        ln.bias.uniform_()
    x = torch.full((2, 8), 3.0)
    x[1] = torch.randn(8)
    x.requires_grad_(True)
    ref = ln(x)
    got = torch.compile(lambda t: ln(t), backend="epjit")(x)
    assert rel_err(got, ref) <= TOL
    assert_grads_match(got, ref, (x, ln.weight, ln.bias), TOL,
                       torch.randn(2, 8))
    _no_fallback()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_padding_idx_lowered(dtype):
    """nn.Embedding(padding_idx=p): the lookup, and a weight gradient with
    nothing in row p (even where the incoming gradient is NaN at a padded
    position); other rows summed as torch's."""
    emb = torch.nn.Embedding(11, 6, padding_idx=3).to(dtype)
    ids = torch.tensor([[3, 1, 3, 7], [0, 3, 10, 1]])
    w = torch.randn(2, 4, 6, dtype=dtype)
    w[0, 0, 2] = float("nan")  # at a padded position: never reaches row 3

    def f(i):
        return emb(i)

    ref = f(ids)
    got = torch.compile(f, backend="epjit")(ids)
    assert torch.equal(got, ref)
    gref, = torch.autograd.grad((ref * w).sum(), emb.weight)
    ggot, = torch.autograd.grad((got * w).sum(), emb.weight)
    assert not ggot.isnan().any()
    assert torch.equal(ggot[3], torch.zeros_like(ggot[3]))
    assert rel_err(ggot, gref) <= _tol(dtype)
    _no_fallback()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_reciprocal_log1p_lowered(dtype):
    """stack at the first, a middle and the last dim (inputs of two
    dtypes: the result's promoted), reciprocal and log1p, forward and
    backward; reciprocal of +-0 and Inf as torch's."""
    x = torch.randn(3, 5, dtype=dtype, requires_grad=True)
    y = torch.randn(3, 5, dtype=dtype, requires_grad=True)
    z = torch.rand(3, 5, dtype=torch.float32, requires_grad=True)

    def f(x, y, z):
        a = torch.stack([x, y * 2], dim=0)
        b = torch.stack([x, y, x], dim=1)
        c = torch.stack([y, z], dim=-1)
        return a.sum(0), b.mean(1), c.sum(-1), \
            torch.reciprocal(x.abs() + 0.5), torch.log1p(z * 0.5)

    ref = f(x, y, z)
    got = torch.compile(f, backend="epjit")(x, y, z)
    tol = _tol(dtype)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel_err(g, r) <= tol
    assert_grads_match(got, ref, (x, y, z), tol)
    s = torch.tensor([0.0, -0.0, float("inf"), -2.0, float("nan")],
                     dtype=dtype)
    r = torch.compile(torch.reciprocal, backend="epjit")(s)
    assert torch.equal(r.isnan(), torch.reciprocal(s).isnan())
    assert torch.equal(r.nan_to_num(), torch.reciprocal(s).nan_to_num())
    assert torch.equal(r.signbit(), torch.reciprocal(s).signbit())
    _no_fallback()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expm1_pow_scalar_lowered(dtype):
    """expm1 near 0 (where exp(x) - 1 would lose every digit), at +-0, Inf,
    -Inf and NaN, and a number to a tensor power (2 ** x, 0.5 ** x, 1 ** x
    with Inf and NaN: 1, as torch's): values to 1e-6 relative element by
    element in f32 (bf16: bitwise, one rounding of an exact-enough value),
    gradients to 1e-5."""
    x = torch.randn(5, 7, dtype=dtype) * 2
    x[0, :7] = torch.tensor([1e-8, -3e-7, 0.0, -0.0, float("inf"),
                             float("-inf"), float("nan")])
    x[1, :5] = torch.tensor([2e-5, -9e-6, 1e-3, 1e-12, -1e-13])
    x.requires_grad_(True)

    def f(x):
        return (torch.expm1(x), torch.pow(2.0, x), torch.pow(0.5, x * 3),
                torch.pow(1.0, x))

    ref = f(x)
    got = torch.compile(f, backend="epjit")(x)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype
        assert torch.equal(g.isnan(), r.isnan())
        assert torch.equal(g.isinf(), r.isinf())
        num = ~r.isnan()  # a NaN's sign bit means nothing
        assert torch.equal(g.signbit() & num, r.signbit() & num)
        gf, rf = g.double().nan_to_num(0, 0, 0), r.double().nan_to_num(0, 0, 0)
        err = ((gf - rf).abs() / rf.abs().clamp_min(1e-30))
        assert err.max() <= (1e-6 if dtype == torch.float32 else 8e-3), err
    fin = torch.isfinite(x.detach())
    w = torch.randn(5, 7, dtype=dtype) * fin
    assert_grads_match(got[:3], ref[:3], (x,), _tol(dtype), w)
    _no_fallback()
