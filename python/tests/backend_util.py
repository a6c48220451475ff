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
