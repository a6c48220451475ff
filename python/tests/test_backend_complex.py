"""Complex tensors under backend="epjit": lowered as pairs of reals (the
view_as_real layout), forward and backward against eager torch, complex
values crossing a graph's boundary, and a complex op without a rule left
to torch and counted."""

import pytest
import torch

import epjit
from backend_util import fresh, rel_err  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh")


def _real(t):
    """t as reals (a complex tensor as view_as_real)."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def _grads(fn, args, wts):
    """fn(*args) and the gradients of sum(out * wt) (complex outputs as
    view_as_real) with respect to args."""
    args = [a.detach().clone().requires_grad_() for a in args]
    outs = fn(*args)
    sum(_real(o).mul(w).sum() for o, w in zip(outs, wts)).backward()
    return [o.detach() for o in outs], [a.grad for a in args]


def _check(fn, args, tol):
    """fn compiled against eager: its outputs and the gradients of a
    random weighting of them, each within tol."""
    dt = _real(args[0]).dtype
    wts = [torch.randn(_real(o).shape, dtype=dt) for o in fn(*args)]
    ref = _grads(fn, args, wts)
    got = _grads(torch.compile(fn, backend="epjit"), args, wts)
    for g, r in zip(got[0] + got[1], ref[0] + ref[1]):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel_err(_real(g), _real(r)) <= tol
    return epjit.counters()


def _rotary(x, mag, ang, w):
    """polar, view_as_complex, complex mul (by complex, real tensor and
    scalars), conj, add, sub, div, abs, view_as_real, with broadcasts."""
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    p = torch.polar(mag, ang) * 0.5
    y = z * p.unsqueeze(0)
    y = y.conj() * y + 2.0 * y - z / (p + 1.5)
    y = y * w.unsqueeze(-1).unsqueeze(0)
    return torch.view_as_real(y).flatten(-2), y.abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_complex_ops_match_eager(dtype):
    """Odd shapes; every complex node (forward and backward: _conj, clone,
    sgn, sum, mul by 1j, view_as_real, select) compiles in epjit."""
    x = torch.randn(3, 5, 14, dtype=dtype)
    mag = torch.rand(5, 7, dtype=dtype) + 0.5
    ang = torch.randn(5, 7, dtype=dtype) * 3
    w = torch.randn(5, dtype=dtype)
    c = _check(_rotary, [x, mag, ang, w],
               1e-5 if dtype == torch.float32 else 1e-12)
    assert c["fallback"] == {}
    assert c["kernels"] > 0 and c["graphs"] > 0


def _boundary(z, x):
    """A complex input; complex outputs: a conjugate view of an
    intermediate, a view of the input, products of it and of two broadcast
    operands, slices, selects and means (their gradients: slice_backward
    and select_backward of complex tensors), tensors full of a constant."""
    q = torch.view_as_complex(x)
    y = z * q
    return (y, y.conj(), (z.conj() * 3).sum(0),
            z.unsqueeze(0).expand(2, 3, 5), z.t() * 1j,
            z[:, 1::2] * q[1, 1:3],
            q.mean(0, keepdim=True) - z[2, 1:4].mean(),
            torch.full_like(z, 1 - 2j) * z + torch.zeros(
                3, 5, dtype=torch.complex64) + torch.ones_like(x[..., 0]),
            y.new_ones((2, 3)) * 1j, z[:, :1] * q[:1] / (z[:1] + 3))


def test_complex_inputs_and_outputs():
    z = torch.randn(3, 5, dtype=torch.complex64)
    x = torch.randn(3, 5, 2)
    c = _check(_boundary, [z, x], 1e-5)
    assert c["fallback"] == {}
    assert c["graphs"] > 0


def _with_exp(x):
    z = torch.view_as_complex(x) * 2
    return (torch.view_as_real(torch.exp(z) * 3),)


def test_complex_op_without_rule_runs_in_torch():
    """Complex exp has no rule: it runs in torch, counted with its reason;
    the complex values between it and epjit's graphs cross as pairs."""
    x = torch.randn(4, 3, 2) * 0.5
    c = _check(_with_exp, [x], 1e-5)
    assert c["fallback"] == {"aten.exp.default": {"complex: no rule": 1}}
    assert c["graphs"] > 0


def _reduce_all(x):
    """Reductions over every dim by an empty or no dim list, of real and
    complex tensors (each dim reduced in turn, from the last)."""
    z = torch.view_as_complex(x)
    return (x.sum(dim=[]) * 2, torch.mean(x, dim=None) * 3,
            z.sum(dim=[]) * 1j, z.mean() * 2)


def test_reduce_over_every_dim():
    c = _check(_reduce_all, [torch.randn(3, 4, 5, 2)], 1e-5)
    assert c["fallback"] == {}
