"""The epjit Dynamo backend against eager torch: outputs, losses and every
gradient (f32 to 1e-5 relative), and the counters that show epjit ran."""

import os
import re

import pytest
import torch

import epjit
from backend_util import (assert_grads_match, assert_same_nans_close,
                          fresh, rel_err)  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh")

TOL = 1e-5


def run(model, inputs, loss_fn):
    """Output, loss and gradients of params and inputs (cloned)."""
    for p in model.parameters():
        p.grad = None
    xs = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = model(*xs)
    loss = loss_fn(out)
    loss.backward()
    grads = {n.replace("_orig_mod.", ""): p.grad.clone()
             for n, p in model.named_parameters()
             if p.grad is not None}
    for i, x in enumerate(xs):
        if x.grad is not None:
            grads["input%d" % i] = x.grad.clone()
    return out.detach(), loss.detach(), grads


def compare(model, inputs, loss_fn, compiled):
    ref = run(model, inputs, loss_fn)
    got = run(compiled, inputs, loss_fn)
    assert rel_err(got[0], ref[0]) <= TOL, "output"
    assert rel_err(got[1], ref[1]) <= TOL, "loss"
    assert set(got[2]) == set(ref[2])
    assert len(ref[2]) > 0
    for name in ref[2]:
        assert rel_err(got[2][name], ref[2][name]) <= TOL, name
    return ref, got


def test_registered_backend():
    assert "epjit" in torch._dynamo.list_backends()
    assert callable(epjit.backend)


def test_mlp_matches_eager_and_runs_kernels():
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(),
                            torch.nn.Linear(32, 32), torch.nn.Tanh(),
                            torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    compare(m, [x], lambda y: (y * y).mean(),
            torch.compile(m, backend="epjit"))
    c = epjit.counters()
    assert c["graphs"] >= 2  # forward and backward
    assert c["kernels"] > 0
    assert c["unique_graphs"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


def test_backend_callable_and_softmax():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(12, 10)

        def forward(self, x):
            h = torch.softmax(self.lin(x), dim=-1)
            return torch.log_softmax(h * 3.0 - 1.0, dim=-1).sum(dim=0)

    m = M()
    compare(m, [torch.randn(5, 12)], lambda y: (y * torch.arange(10.)).sum(),
            torch.compile(m, backend=epjit.backend))
    assert epjit.counters()["kernels"] > 0


def test_unsupported_op_falls_back_and_is_counted():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.b(torch.atan(self.a(x)).square())

    m = M()
    compare(m, [torch.randn(3, 8)], lambda y: y.square().sum(),
            torch.compile(m, backend="epjit"))
    c = epjit.counters()
    # atan has no rule; its gradient (grad / (1 + x^2)) is compiled
    assert c["fallback"] == {"aten.atan.default": {"no rule": 1}}, c
    assert c["fallback_nodes"] >= 1
    assert c["kernels"] > 0


def test_reset_zeroes_counters():
    m = torch.nn.Linear(4, 4)
    torch.compile(m, backend="epjit")(torch.randn(2, 4)).sum().backward()
    assert epjit.counters()["kernels"] > 0
    epjit.reset()
    c = epjit.counters()
    assert c["kernels"] == 0 and c["graphs"] == 0 and c["fallback"] == {}


def test_debug_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("EPJIT_DEBUG_DUMP", str(tmp_path))
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU())
    torch.compile(m, backend="epjit")(torch.randn(2, 4)).sum().backward()
    epjit.dump()
    names = os.listdir(tmp_path)
    assert "counters.json" in names and "torch_counters.json" in names
    assert "graphs.jsonl" in names, names


def test_graph_epjit_cannot_compile_runs_in_torch(monkeypatch):
    """A partition whose lowering the library rejects runs in torch, with a
    warning, its nodes counted with the reason."""
    import epjit.lower as lower

    def bad(L, node):
        return L.op("no_such_op", [L.arg(node.args[0])])

    monkeypatch.setitem(lower.RULES, torch.ops.aten.silu.default, bad)
    m = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.SiLU())
    with pytest.warns(UserWarning, match="no_such_op"):
        compare(m, [torch.randn(3, 6)], lambda y: y.square().sum(),
                torch.compile(m, backend="epjit"))
    fb = epjit.counters()["fallback"]
    assert fb["aten.silu.default"] == {"epjit compile failed": 1}, fb


def test_lowering_rule_that_raises_runs_in_torch(monkeypatch):
    """A lowering rule that raises (a bug of the rule, not the library's
    refusal) makes its partition run in torch with a warning naming the
    error, counted like a rejected partition; results equal eager."""
    import epjit.lower as lower

    def broken(L, node):
        raise IndexError("rule bug")

    monkeypatch.setitem(lower.RULES, torch.ops.aten.silu.default, broken)
    m = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.SiLU())
    with pytest.warns(UserWarning, match="IndexError in lowering: rule bug"):
        compare(m, [torch.randn(3, 6)], lambda y: y.square().sum(),
                torch.compile(m, backend="epjit"))
    fb = epjit.counters()["fallback"]
    assert fb["aten.silu.default"] == {"epjit compile failed": 1}, fb


def test_indexing_and_scatter_lowered():
    """select, pad, split and the scatters functionalisation makes of
    in-place writes compile, forward and backward, with nothing left to
    torch."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)  # [4, 6, 8]
            a = h[:, 2]
            b = torch.nn.functional.pad(a, (1, 2))
            p, q = torch.split(h, [2, 4], dim=1)
            y = h.clone()
            y[:, 1] = a * 2
            y[:, 2:4] = p * 3
            return b.sum(dim=-1) + (y * h).sum(dim=(1, 2)) + q.mean(dim=(1, 2))

    m = M()
    compare(m, [torch.randn(4, 6, 8)], lambda y: (y * y).sum(),
            torch.compile(m, backend="epjit"))
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


def test_threads_share_the_context():
    """Compiled graphs called from several threads (one context serves the
    process) give eager's results."""
    import threading
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.SiLU(),
                            torch.nn.Linear(16, 16))
    cm = torch.compile(m, backend="epjit")
    x = torch.randn(8, 16)
    with torch.no_grad():
        ref = m(x)
        cm(x)
    bad = []

    def work():
        with torch.no_grad():
            for _ in range(50):
                if rel_err(cm(x), ref) > 1e-5:
                    bad.append(1)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad
    assert epjit.counters()["kernels"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_and_rotary_ops_lowered(reduction, dtype):
    """cos and sin (the rotary tables) and the loss (log_softmax, then
    nll_loss with ignored targets), forward and backward, compile with
    nothing left to torch; bf16 to 2e-2."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 10)
            self.b = torch.nn.Linear(6, 10)

        def forward(self, x, t):
            h = torch.cos(self.a(x)) * 1.5 + torch.sin(self.b(x))
            loss = torch.nn.functional.cross_entropy(
                h, t, ignore_index=-100, reduction=reduction)
            return h, loss

    m = M().to(dtype)
    x = torch.randn(7, 6, dtype=dtype)
    t = torch.randint(0, 10, (7,))
    t[2] = t[5] = -100
    cm = torch.compile(m, backend="epjit")
    tol = TOL if dtype == torch.float32 else 2e-2

    def step(f):
        m.zero_grad(set_to_none=True)
        h, loss = f(x, t)
        (loss * torch.linspace(0.5, 2.0, loss.numel(), dtype=dtype).reshape(
            loss.shape)).sum().backward()
        return h.detach(), loss.detach(), {
            n: p.grad.clone() for n, p in m.named_parameters()}

    ref, got = step(m), step(cm)
    assert rel_err(got[0], ref[0]) <= tol
    assert rel_err(got[1], ref[1]) <= tol
    for n in ref[2]:
        assert rel_err(got[2][n], ref[2][n]) <= tol, n
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_every_target_ignored(dtype):
    """A batch whose targets are all ignore_index: the mean loss is nan as
    in torch (0 / 0) and the gradient is zero, as torch's nll_loss_backward
    writes none (0 / 0 there would make every logit's gradient nan)."""
    def f(x, t):
        return torch.nn.functional.cross_entropy(x, t, ignore_index=-100)

    x = torch.randn(5, 9, dtype=dtype, requires_grad=True)
    t = torch.full((5,), -100)
    ref = f(x, t)
    gref = torch.autograd.grad(ref, x)[0]
    x2 = x.detach().clone().requires_grad_(True)
    got = torch.compile(f, backend="epjit")(x2, t)
    g = torch.autograd.grad(got, x2)[0]
    assert torch.isnan(ref) and torch.isnan(got)
    assert torch.equal(gref, torch.zeros_like(gref))
    assert torch.equal(g, gref)
    assert epjit.counters()["kernels"] > 0
    assert epjit.counters()["fallback_nodes"] == 0

def test_pad_with_a_value_lowered():
    """constant_pad_nd with a value, of floats (crop and pad) and of
    integer labels (transformers' shift of the labels, value -100)."""
    def f(x, t):
        y = torch.nn.functional.pad(x, (2, -1, 1, 3), value=-1.5)
        lab = torch.nn.functional.pad(t, (0, 1), value=-100)[..., 1:]
        return (y * 2).sum(dim=0), (lab + 1) * 2

    x = torch.randn(4, 5, requires_grad=True)
    t = torch.randint(0, 9, (3, 6))
    ref = f(x, t)
    gx = torch.autograd.grad(ref[0].square().sum(), x)[0]
    cf = torch.compile(f, backend="epjit")
    got = cf(x, t)
    assert rel_err(got[0], ref[0]) <= TOL
    assert torch.equal(got[1], ref[1])
    assert rel_err(torch.autograd.grad(got[0].square().sum(), x)[0],
                   gx) <= TOL
    c = epjit.counters()
    assert c["kernels"] > 0
    assert "aten.constant_pad_nd.default" not in c["fallback"], c["fallback"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cumsum_and_flip_lowered(dtype):
    """cumsum along a dim of odd length (forward, and its backward: a flip,
    a cumsum and a flip) and flip of several dims compile with nothing left
    to torch; bf16 to 2e-2 (the scan sums in f32)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(7, 7)

        def forward(self, x):
            h = self.lin(x)  # [3, 5, 7]
            c = torch.cumsum(h, dim=-1) + torch.cumsum(h, dim=1) * 0.5
            return torch.flip(c, dims=(0, 2)) * h

    m = M().to(dtype)
    tol = TOL if dtype == torch.float32 else 2e-2
    x = torch.randn(3, 5, 7, dtype=dtype)
    ref = run(m, [x], lambda y: (y * y).sum())
    got = run(torch.compile(m, backend="epjit"), [x],
              lambda y: (y * y).sum())
    assert rel_err(got[0], ref[0]) <= tol
    assert set(got[2]) == set(ref[2])
    for n in ref[2]:
        assert rel_err(got[2][n], ref[2][n]) <= tol, n
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


@pytest.mark.parametrize("shape", [(3, 7), (2, 129), (1, 1)])
def test_integer_cumsum_lowered(shape):
    """cumsum of a bool mask and of int64 values past 2^32 (to int64, as
    torch promotes them), and of int32 to int32 (wrapping as torch's),
    along either dim of odd lengths: exact, in torch's dtypes, compiled
    with nothing left to torch (transformers' packed-sequence test)."""
    def f(m, p):
        a = torch.cumsum(m, -1)
        b = torch.cumsum(p, 0)
        c = torch.cumsum(p.to(torch.int32), -1, dtype=torch.int32)
        return a, b, c, a * 2 + 1

    m = torch.rand(shape) > 0.4
    p = torch.randint(-1000, 1000, shape, dtype=torch.int64) * (1 << 33)
    got = torch.compile(f, backend="epjit")(m, p)
    for g, r in zip(got, f(m, p)):
        assert g.dtype == r.dtype
        assert torch.equal(g, r)
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softplus_lowered(dtype):
    """softplus and its backward (Gated DeltaNet's decay), with inputs from
    -120 to 120 (past torch's threshold and exp's range), beta 1 and 2,
    compile with nothing left to torch; bf16 to 1e-2."""
    def f(x):
        return (torch.nn.functional.softplus(x * 3.0) +
                torch.nn.functional.softplus(x, beta=2.0)) * x

    x = torch.cat([torch.linspace(-40, 40, 101), torch.randn(20),
                   torch.tensor([-1e-6, 1e-8])]).to(dtype)
    x.requires_grad_(True)
    ref = f(x)
    (gref,) = torch.autograd.grad(ref.square().sum(), x)
    got = torch.compile(f, backend="epjit")(x)
    (ggot,) = torch.autograd.grad(got.square().sum(), x)
    tol = TOL if dtype == torch.float32 else 1e-2
    assert rel_err(got, ref) <= tol
    assert rel_err(ggot, gref) <= tol
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tril_triu_lowered(dtype):
    """tril and triu of several diagonals (their backward is the same op of
    the gradient), of a batch of odd-sized matrices, keep inf and nan where
    torch keeps them and zero them elsewhere; nothing left to torch."""
    def f(x):
        y = x * 2
        return (torch.tril(y) + torch.triu(y, 2) + torch.tril(y, -1) +
                torch.triu(y, -2) + torch.tril(y, 9))

    x = torch.randn(2, 5, 7, dtype=dtype, requires_grad=True)
    ref = f(x)
    (gref,) = torch.autograd.grad(ref.square().sum(), x)
    cf = torch.compile(f, backend="epjit")
    got = cf(x)
    (ggot,) = torch.autograd.grad(got.square().sum(), x)
    tol = TOL if dtype == torch.float32 else 1e-2
    assert rel_err(got, ref) <= tol
    assert rel_err(ggot, gref) <= tol
    xi = torch.full((3, 4), float("inf"), dtype=dtype)
    xi[0, 3] = float("nan")
    xi[2, 0] = -xi[2, 0]
    for k in (-1, 0, 1):
        tri = torch.compile(lambda t: torch.tril(t * 1, k), backend="epjit",
                            dynamic=False)
        want = torch.tril(xi * 1, k)
        assert torch.equal(tri(xi).nan_to_num(), want.nan_to_num()), k
        assert torch.equal(tri(xi).isnan(), want.isnan()), k
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


def _triangular(shape, upper, unit, dtype):
    """A well-conditioned triangular system (diagonal 1.5 to 2.5 in size,
    the rest N(0, 1) / n) whose other triangle, and diagonal when unit,
    holds large values a correct solve never reads."""
    n = shape[-1]
    a = torch.randn(shape, dtype=torch.float64) / n
    d = torch.rand(shape[:-1], dtype=torch.float64) + 1.5
    d = d * (torch.randint(0, 2, shape[:-1]) * 2 - 1)
    a = a + torch.diag_embed(d)
    junk = torch.full(shape, 75.0, dtype=torch.float64)
    k = 1 if unit else 0
    keep = a.triu(k) if upper else a.tril(-k)
    other = junk.tril(-1 + k) if upper else junk.triu(1 - k)
    return (keep + other).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_solve_triangular_lowered(dtype):
    """linalg.solve_triangular (left, both triangles, unit or not) on odd
    sizes and broadcast batches, forward and backward (whose solve is of
    the transposed matrix) against eager torch; nothing left to torch.
    torch has no bf16 triangular solve on the CPU: the bf16 reference is
    its f32 solve of the same values (Gated DeltaNet solves in f32)."""
    def f(a, b, upper, unit):
        return torch.linalg.solve_triangular(a * 1, b * 1, upper=upper,
                                             unitriangular=unit)

    cases = [((5, 5), (5, 3)), ((2, 3, 67, 67), (2, 3, 67, 33)),
             ((2, 1, 1, 1), (3, 1, 1)), ((4, 64, 64), (64, 1))]
    tol = TOL if dtype == torch.float32 else 2e-2
    for upper in (False, True):
        for unit in (False, True):
            for sa, sb in cases:
                a = _triangular(sa, upper, unit, dtype).requires_grad_()
                b = torch.randn(sb, dtype=dtype, requires_grad=True)
                r32 = [x.detach().float().requires_grad_() for x in (a, b)]
                ref = f(*r32, upper, unit)
                w = torch.randn_like(ref)
                gref = torch.autograd.grad((ref * w).sum(), r32)
                w = w.to(dtype)
                torch._dynamo.reset()
                got = torch.compile(f, backend="epjit")(a, b, upper, unit)
                ggot = torch.autograd.grad((got * w).sum(), [a, b])
                what = (sa, sb, upper, unit)
                assert rel_err(got, ref) <= tol, what
                for x, y in zip(ggot, gref):
                    assert rel_err(x, y) <= tol, what
                if dtype == torch.float32:
                    k = 1 if unit else 0
                    off = ggot[0].tril(-1 + k) if upper else \
                        ggot[0].triu(1 - k)
                    assert not off.any(), what
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


def test_solve_triangular_right_falls_back():
    """left=False (X A = B) is not lowered: torch solves it, counted."""
    def f(a, b):
        return torch.linalg.solve_triangular(a * 1, b * 1, upper=True,
                                             left=False)

    a = _triangular((5, 5), True, False, torch.float32)
    b = torch.randn(3, 5)
    got = torch.compile(f, backend="epjit")(a, b)
    assert rel_err(got, f(a, b)) <= TOL
    fb = epjit.counters()["fallback"]
    assert fb["aten.linalg_solve_triangular.default"] == {
        "solve_triangular left=False": 1}, fb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_slice_scatter_lowered(dtype):
    """A write of every third element (the interleaved rotary sections of
    Qwen3.5's mRoPE: slice_scatter with a step), forward and backward, one
    scattered value an inf; nothing left to torch."""
    def f(x, y):
        z = x * 2
        z[..., 1:10:3] = y[..., :3] * 3
        z[..., 2::4] = y[..., 2:5]
        return z * x

    x = torch.randn(2, 3, 11, dtype=dtype, requires_grad=True)
    y = torch.randn(2, 3, 5, dtype=dtype, requires_grad=True)
    ref = f(x, y)
    gref = torch.autograd.grad(ref.square().sum(), (x, y))
    cf = torch.compile(f, backend="epjit")
    got = cf(x, y)
    ggot = torch.autograd.grad(got.square().sum(), (x, y))
    tol = TOL if dtype == torch.float32 else 1e-2
    assert rel_err(got, ref) <= tol
    for a, b in zip(ggot, gref):
        assert rel_err(a, b) <= tol
    yi = y.detach().clone()
    yi[0, 0, 4] = float("inf")
    with torch.no_grad():
        assert torch.equal(cf(x, yi).isinf(), f(x, yi).isinf())
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_fill_and_bool_lowered(dtype):
    """masked_fill with -inf through a triangular bool mask made in the
    graph (Gated DeltaNet's chunk mask: ones(bool).triu(1)) and with a bool
    mask from torch (a graph input, broadcast), and a bool output, forward
    and backward; nothing left to torch."""
    def f(x, keep):
        upper = torch.ones(5, 5, dtype=torch.bool).triu(1)
        y = (x * 2).masked_fill(upper, float("-inf")).exp()
        z = y.masked_fill(keep, 0.5) * x
        return z, upper.unsqueeze(0).expand(3, 5, 5)

    x = torch.randn(3, 5, 5, dtype=dtype, requires_grad=True)
    keep = torch.rand(5, 5) > 0.5
    ref = f(x, keep)
    (gref,) = torch.autograd.grad(ref[0].square().sum(), x)
    cf = torch.compile(f, backend="epjit")
    got = cf(x, keep)
    (ggot,) = torch.autograd.grad(got[0].square().sum(), x)
    tol = TOL if dtype == torch.float32 else 1e-2
    assert rel_err(got[0], ref[0]) <= tol
    assert rel_err(ggot, gref) <= tol
    assert got[1].dtype == torch.bool and torch.equal(got[1], ref[1])
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


def test_integer_masks_lowered():
    """A sliding-window causal mask as transformers builds it (arange,
    integer add and sub, comparisons, bitwise_and), bool and integer
    outputs exact, and aranges of floats; nothing left to torch."""
    def f(x, off):
        q = torch.arange(7) + 3
        kv = torch.arange(2, 11, 2)
        causal = kv[None, :] <= q[:, None]
        window = kv[None, :] > q[:, None] - 4
        mask = causal & window
        other = (q[:, None] >= kv[None, :]) | (kv[None, :] == 6) | (
            q[:, None] != off) & (kv[None, :] < 5)
        pos = torch.arange(1, 8, dtype=torch.float32) * 0.5 + torch.arange(
            7, dtype=torch.bfloat16).float()
        return mask, other, q * 2 - off, x * pos

    x = torch.randn(3, 7, requires_grad=True)
    off = torch.tensor(5)
    ref = f(x, off)
    got = torch.compile(f, backend="epjit")(x, off)
    for a, b in zip(got[:3], ref[:3]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert rel_err(got[3], ref[3]) <= TOL
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_depthwise_conv1d_lowered(dtype):
    """Gated DeltaNet's short causal convolution (depthwise conv1d, kernel
    4, padding 3, cropped to the input's length; with and without a bias),
    forward and backward; nothing left to torch."""
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=False)
    conv_b = torch.nn.Conv1d(6, 6, 3, groups=6, padding=0)
    m = torch.nn.ModuleList([conv, conv_b]).to(dtype)

    def f(x):
        y = torch.nn.functional.silu(m[0](x)[..., :x.shape[-1]])
        return m[1](y)

    x = torch.randn(2, 6, 9, dtype=dtype, requires_grad=True)
    ref = f(x)
    gref = torch.autograd.grad(ref.square().sum(), [x, *m.parameters()])
    cf = torch.compile(f, backend="epjit")
    got = cf(x)
    ggot = torch.autograd.grad(got.square().sum(), [x, *m.parameters()])
    tol = TOL if dtype == torch.float32 else 2e-2
    assert rel_err(got, ref) <= tol
    for a, b in zip(ggot, gref):
        assert rel_err(a, b) <= tol
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]



def test_outputs_that_view_inputs_alias_them(monkeypatch):
    """A graph output that epjit computes as a view of a graph input (a
    saved reshape of an input, here) comes back as a torch view of that
    input, sharing its storage (so the input stays alive while it does),
    and the results match eager; fresh outputs are epjit's own memory."""
    import epjit._backend as backend
    seen = []

    def view_of(handle, base, desc):
        t = real(handle, base, desc)
        seen.append((t, base))
        return t
    real = backend._view_of
    monkeypatch.setattr(backend, "_view_of", view_of)
    lin = torch.nn.Linear(6, 8)

    def f(x):
        return torch.nn.functional.silu(lin(x)).reshape(-1).sum()

    x = torch.randn(3, 4, 6)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ref = f(xs[0])
    ref.backward()
    ref_grads = [xs[0].grad, lin.weight.grad.clone(), lin.bias.grad.clone()]
    lin.zero_grad()
    got = torch.compile(f, backend="epjit")(xs[1])
    got.backward()
    assert epjit.counters()["kernels"] > 0
    assert rel_err(got, ref) <= TOL
    for g, r in zip([xs[1].grad, lin.weight.grad, lin.bias.grad], ref_grads):
        assert rel_err(g, r) <= TOL
    assert seen, "no output was a view of an input"
    for t, base in seen:
        assert t.untyped_storage().data_ptr() == \
            base.untyped_storage().data_ptr()


def _same(got, ref):
    """Bitwise equal values (NaN where torch has NaN) and the same dtype
    and shape, output by output."""
    assert len(got) == len(ref)
    for k, (g, r) in enumerate(zip(got, ref)):
        g, r = g.detach(), r.detach()
        assert g.dtype == r.dtype and g.shape == r.shape, k
        assert torch.equal(g.isnan(), r.isnan()) if g.is_floating_point() \
            else True, k
        assert torch.equal(g.nan_to_num(), r.nan_to_num()), k


@pytest.mark.parametrize("shape", [(3, 17), (1, 1), (2, 3, 5)])
def test_reductions_of_integers_and_bools_lowered(shape):
    """max, min, amax, amin, max.dim, min.dim, argmax, argmin and sums of
    int64 values at the ends of the range, int32 sums (to int64, wrapping),
    bools, and floats with ties and NaN (the first index, as torch's):
    exact, in torch's dtypes, with nothing left to torch (the dynamic
    rotary embedding's max over position ids)."""
    def f(p, q, m, x):
        mx, mn = x.max(dim=-1), x.min(dim=0, keepdim=True)
        return (torch.max(p) + 1, torch.min(p), p.amax(-1), p.amin(0),
                q.sum(0), q.amin((0, -1)), m.sum(-1), m.amax(-1),
                torch.min(m), p.argmax(), q.argmin(dim=-1, keepdim=True),
                p.argmax(keepdim=True), x.amin(0), torch.max(x),
                torch.min(x), mx.values, mx.indices, mn.values, mn.indices,
                x.argmax(-1), x.mean())

    p = torch.randint(-2**62, 2**62, shape)
    p.view(-1)[0] = -2**63
    p.view(-1)[-1] = 2**63 - 1
    q = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32)
    m = torch.rand(shape) > 0.5
    x = torch.randn(shape)
    if x.numel() > 4:
        x.view(-1)[3] = x.view(-1)[1] = x.max() + 1  # a tie
        x.view(-1)[-2] = float("nan")
    got = torch.compile(f, backend="epjit")(p, q, m, x)
    _same(got, f(p, q, m, x))
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16,
                                   torch.float64])
def test_float_comparisons_lowered(dtype):
    """eq, ne, lt, le, gt, ge and isnan of floats, against tensors of other
    shapes and numbers, with NaN, infinities, signed zeros, subnormals and
    values a bf16 rounding apart: bitwise as torch's, nothing left to
    torch."""
    def f(x, y, i, z):
        return (x < y, x <= y, x > y, x >= y, x == y, x != y, x > 0.1,
                x <= 0.1, x == float("inf"), x < float("nan"), i > 2.5,
                i.to(x.dtype) >= x, y.unsqueeze(0) > z, torch.isnan(x),
                x.ne(y), x.eq(0), x.ge(-0.0))

    vals = torch.tensor([0.0, -0.0, 1.0, float("nan"), float("inf"),
                         -float("inf"), 0.1, 0.10009765625, -3.5, 2.0,
                         1e-40, 3e38], dtype=torch.float64)
    pick = lambda *s: vals[torch.randint(0, len(vals), s)].to(dtype)
    x, y, z = pick(7, 12), pick(7, 12), pick(3, 1, 12)
    y[0] = x[0]
    i = torch.randint(0, 5, (7, 12))
    _same(torch.compile(f, backend="epjit")(x, y, i, z), f(x, y, i, z))
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_clamp_max_min_gradients(dtype):
    """relu (threshold_backward), clamp, clamp_min, clamp_max, and the
    values of max, min, amin, max.dim and min.dim (their backward's
    scatter of one position per row): outputs with NaN and infinities
    bitwise as torch's, gradients (ties and zeros included) to 1e-5 (bf16:
    1e-2), nothing left to torch."""
    def f(x, w):
        r = torch.relu(x) * w + torch.nn.functional.relu(x * 2 - 1)
        c = x.clamp(-1, 1) + torch.clamp_min(x, 0.5) * 2 + x.clamp(max=0.25)
        mx = x.max(dim=-1).values.sum() + x.min(dim=0).values.sum()
        return r, c, mx + torch.max(x) + torch.min(x) + x.amin(0).sum()

    x = torch.randn(5, 13, dtype=dtype) * 2
    x[0, :3] = 0.0
    x[1, 2] = x[1, 7] = 9.0  # a tie at the max
    x[2, 4] = 1.0
    x[:, 5] = -7.0  # a column of ties
    w = torch.randn(5, 13, dtype=dtype)
    xs = x.clone().requires_grad_(True)
    ref = f(xs, w)
    (gref,) = torch.autograd.grad(sum(o.sum() for o in ref), xs)
    cf = torch.compile(f, backend="epjit")
    got = cf(xs, w)
    (ggot,) = torch.autograd.grad(sum(o.sum() for o in got), xs)
    tol = TOL if dtype == torch.float32 else 1e-2
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= tol
    assert rel_err(ggot, gref) <= tol
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]
    # NaN and infinities in the forward
    y = x.clone()
    y[3, 0], y[3, 1], y[4, 2] = float("nan"), float("inf"), -float("inf")
    _same(cf(y, w), f(y, w))


def test_scatter_with_repeated_positions_left_to_torch():
    """scatter.src with one position per slice is compiled; with several
    (which torch resolves in its own order) it runs in torch, counted."""
    def f(x, i, s):
        return x.scatter(1, i[:, :1], s), x.scatter(1, i, s)

    x = torch.randn(4, 6)
    x[0, 0] = float("inf")
    i = torch.randint(0, 6, (4, 2))
    s = torch.randn(5, 7)
    _same(torch.compile(f, backend="epjit")(x, i, s), f(x, i, s))
    c = epjit.counters()
    assert c["fallback"] == {"aten.scatter.src": {
        "scatter with repeated positions": 1}}, c


def test_any_all_threshold_bool_comparisons_and_scalars_lowered():
    """any and all (of floats with NaN and -0.0, integers, bools; every
    form: all dims, one, several, keepdim), threshold, comparisons of
    bools, and reductions of 0-dim tensors: exact, nothing left to
    torch."""
    def f(x, i, b, s):
        return (x.any(1), x.all(0), x.any(), x.all(), x.any(dim=(0, 1)),
                x.all(1, keepdim=True), i.any(-1), i.all(-1), b.any(0),
                b.all(), torch.nn.functional.threshold(x, 0.25, -2.0),
                b < b.flip(0), b == b.flip(0), b != b.flip(0), s.sum(),
                s.mean(), s.amax(), torch.min(s), s.sum(0))

    x = torch.randn(5, 7).masked_fill(torch.rand(5, 7) > 0.5, 0.0)
    x[0, 0], x[1, :], x[2, 3] = float("nan"), -0.0, float("inf")
    x[3, :] = 1.0
    i = torch.randint(0, 3, (4, 6))
    b = torch.rand(4, 6) > 0.6
    s = torch.tensor(2.5)
    _same(torch.compile(f, backend="epjit")(x, i, b, s), f(x, i, b, s))
    c = epjit.counters()
    assert c["kernels"] > 0
    assert c["fallback_nodes"] == 0, c["fallback"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selects_fuse(dtype, tmp_path, monkeypatch):
    """tril, triu, masked_fill (a mask from torch and one made in the
    graph), where on a float comparison and relu's backward are epjit's
    where op, never a gather: in the graphs epjit compiled (the debug
    dump) there is no gather, the comparisons' bool casts are gone (the
    select reads the float), and the generated C selects inside the fused
    kernels.  NaN and Inf where torch has them (where copies elements: the
    Inf and NaN of the branch not taken stay out), values and gradients to
    1e-5 (bf16 1e-2)."""
    monkeypatch.setenv("EPJIT_DEBUG_DUMP", str(tmp_path))

    def f(x, y, keep):
        a = torch.tril(x * 2, -1) + torch.triu(y, 1)
        b = torch.where(x > 0.25, a, y * 3).masked_fill(keep, -7.0)
        upper = torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bool)
        c = b.masked_fill(upper.triu(2), 0.5)
        return torch.relu(c).exp() * y

    x = torch.randn(2, 3, 9, 9, dtype=dtype, requires_grad=True)
    y = torch.randn(2, 3, 9, 9, dtype=dtype)
    with torch.no_grad():
        x[0, 0, 4, 1] = float("nan")    # kept by tril(-1), where false
        x[0, 1, 1, 4] = float("inf")    # removed by tril(-1)
        y[1, 2, 3, 0] = float("inf")    # removed by triu(1)
    y.requires_grad_(True)
    keep = torch.rand(3, 1, 9) > 0.7
    ref = f(x, y, keep)
    gref = torch.autograd.grad(ref.nan_to_num().square().sum(), (x, y))
    cf = torch.compile(f, backend="epjit")
    got = cf(x, y, keep)
    ggot = torch.autograd.grad(got.nan_to_num().square().sum(), (x, y))
    tol = TOL if dtype == torch.float32 else 1e-2
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.isinf(), ref.isinf())
    assert rel_err(got.nan_to_num(0, 0, 0), ref.nan_to_num(0, 0, 0)) <= tol
    for g, r in zip(ggot, gref):
        assert torch.equal(g.isnan(), r.isnan())
        assert rel_err(g.nan_to_num(), r.nan_to_num()) <= tol
    c = epjit.counters()
    assert c["fallback_nodes"] == 0, c["fallback"]
    _assert_selects_read_floats(tmp_path)


def _assert_selects_read_floats(dump):
    """In the graphs of the debug dump: no gather; every select (where)
    reads a comparison made in the graph as its float (never through a
    cast to bool and back) and no int32 arithmetic is done on such bools;
    the generated C selects."""
    epjit.dump()
    finals = [os.path.join(dump, "graphs", n)
              for n in os.listdir(os.path.join(dump, "graphs"))
              if n.endswith("final.txt")]
    assert finals
    for p in finals:
        text = open(p).read()
        assert "gather(" not in text, p
        ops = dict(re.findall(r"^(%\d+) = ([a-z_]+\(%\d+)", text, re.M))
        for c in re.findall(r"= where\((%\d+),", text):
            v, casts = c, 0
            while ops.get(v, "").startswith("cast("):
                v, casts = ops[v][5:], casts + 1
            src = ops.get(v, "")
            assert not (casts and src.startswith(("eq(", "sub(", "add_",
                                                  "mul("))), (p, c, src)
        assert not re.search(r"= (mul|add|sub)\(.*: i32\[", text), p
    assert any("where(" in open(p).read() for p in finals)
    src = "".join(open(os.path.join(dump, "kernels", n)).read()
                  for n in os.listdir(os.path.join(dump, "kernels"))
                  if n.endswith(".c"))
    assert "!= 0 ?" in src


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bool_logic_stays_float(dtype, tmp_path, monkeypatch):
    """and, or, not of comparisons (and clamp's backward, which ands two of
    them) stay in the comparisons' float: the masks fuse with the selects
    on them; values and gradients as torch's (NaN where it has it)."""
    monkeypatch.setenv("EPJIT_DEBUG_DUMP", str(tmp_path))

    def f(x, y):
        keep = ((x > 0) & ~(y < 0.5)) | (x == y) | torch.logical_not(
            x <= -1)
        return torch.where(keep, x * 3, y) + torch.clamp(x, -0.5, 0.5) * y

    x = torch.randn(4, 33, dtype=dtype)
    y = torch.randn(4, 33, dtype=dtype)
    x[0, :3] = torch.tensor([float("nan"), 0.5, -1.0])
    y[0, 1] = 0.5
    x.requires_grad_(True)
    y.requires_grad_(True)
    ref = f(x, y)
    got = torch.compile(f, backend="epjit")(x, y)
    tol = TOL if dtype == torch.float32 else 1e-2
    assert_same_nans_close(got, ref, tol)
    assert_grads_match(got, ref, (x, y), tol)
    c = epjit.counters()
    assert c["fallback_nodes"] == 0, c["fallback"]
    _assert_selects_read_floats(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_maximum_minimum_lowered(dtype, tmp_path, monkeypatch):
    """maximum and minimum (broadcast, NaN, ties, signed zeros, integers)
    and relu, clamp and a float comparison: values bitwise equal to
    torch's (NaN where torch has it), gradients to 1e-5 (bf16 1e-2, ties
    split as torch splits them); each is epjit's maximum op in the
    compiled graphs, with no cat or amax left (the debug dump)."""
    monkeypatch.setenv("EPJIT_DEBUG_DUMP", str(tmp_path))

    def f(x, y):
        a = torch.maximum(x, y) + torch.minimum(y, x * 2)
        b = torch.relu(x) * torch.clamp(y, -0.5, 0.75)
        return a, b, (x >= y).to(x.dtype)

    x = torch.randn(3, 7, 11, dtype=dtype)
    y = torch.randn(7, 1, dtype=dtype)
    x[0, 0, :4] = torch.tensor([float("nan"), 0.0, -0.0, 1.0])
    y[0, 0] = 0.0
    x[1, 2, 3] = y[2, 0]            # a tie
    y[4, 0] = float("nan")
    x.requires_grad_(True)
    y.requires_grad_(True)
    ref = f(x, y)
    cf = torch.compile(f, backend="epjit")
    got = cf(x, y)
    for g, r in zip(got, ref):
        assert torch.equal(g.isnan(), r.isnan())
        assert torch.equal(g.nan_to_num(), r.nan_to_num())
    w = torch.randn(3, 7, 11, dtype=dtype)
    tol = TOL if dtype == torch.float32 else 1e-2
    assert_grads_match(got[0] + got[1], ref[0] + ref[1], (x, y), tol, w)
    xi = torch.randint(-5, 5, (4, 6))
    yi = torch.randint(-5, 5, (6,))
    mi = torch.compile(lambda a, b: torch.minimum(a, b) * 3 +
                       torch.maximum(b, a), backend="epjit")
    assert torch.equal(mi(xi, yi), torch.minimum(xi, yi) * 3 +
                       torch.maximum(yi, xi))
    c = epjit.counters()
    assert c["fallback_nodes"] == 0, c["fallback"]
    epjit.dump()
    text = "".join(open(os.path.join(tmp_path, "graphs", n)).read()
                   for n in os.listdir(os.path.join(tmp_path, "graphs"))
                   if n.endswith("final.txt"))
    assert "maximum(" in text
    assert "amax(" not in text and "cat(" not in text
