"""Shared by the backend tests: a fresh Dynamo and epjit per test, the
relative error the tests compare with, and the MoE models' helpers."""

import pytest
import torch

import epjit


@pytest.fixture
def fresh():
    """Each test starts with Dynamo's caches and epjit's counters empty."""
    torch._dynamo.reset()
    epjit.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def rel_err(a, b):
    """max |a - b| / max |b| (0 for two zero tensors)."""
    d = (a.detach().double() - b.detach().double()).abs().max().item()
    m = b.detach().double().abs().max().item()
    return d / m if m > 0 else d


def assert_same_nans_close(got, ref, tol):
    """got and ref have NaN at the same places and agree to tol (rel_err)
    elsewhere."""
    assert torch.equal(got.isnan(), ref.isnan())
    assert rel_err(got.nan_to_num(), ref.nan_to_num()) <= tol


def assert_grads_match(got, ref, inputs, tol, weight=None):
    """The gradients of sum(out * weight) (NaN put to 0 first; weight 1 by
    default) over inputs agree between the compiled outputs got and the
    eager ones ref (tensors or tuples of tensors): NaN at the same places,
    the rest to tol; each of ref's gradients is non-zero."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)

    def loss(outs):
        w = weight if weight is not None else 1.0
        return sum((o * w).nan_to_num().sum() for o in outs)
    gref = torch.autograd.grad(loss(ref), inputs, allow_unused=True)
    ggot = torch.autograd.grad(loss(got), inputs, allow_unused=True)
    for g, r in zip(ggot, gref):
        assert (g is None) == (r is None)
        if r is not None:
            assert r.nan_to_num().abs().max() > 0
            assert_same_nans_close(g, r, tol)


def disable_moe_blocks(model, block_name):
    """Puts every module of class block_name under torch.compiler.disable
    (the MoE blocks stay eager, as DeepSpeed's AutoEP layers do); returns
    how many there were."""
    n = 0
    for mod in model.modules():
        if type(mod).__name__ == block_name:
            mod.forward = torch.compiler.disable(mod.forward)
            n += 1
    return n


def lm_step(model, m, ids):
    """One forward and backward of m (model or its compiled form) on ids as
    inputs and labels: (logits, loss, {name: grad}) of model's parameters."""
    model.zero_grad(set_to_none=True)
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    g = {n: p.grad.clone() for n, p in model.named_parameters()
         if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), g
