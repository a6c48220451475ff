"""Shared by the backend tests: a fresh Dynamo and epjit per test, and
the relative error the tests compare with."""

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
