"""The GPU path without a GPU: with EPJIT_TORCH_CPU_DEVICE=cuda-sim the
graphs of CPU tensors run on epjit's cuda-sim device, which runs the CUDA
C a GPU would (NVRTC-ready templates and generated kernels) on the CPU over
the same memory.  The families' regions, padded batches (the attention
template's mask) and a kernel the device lacks, against eager torch."""

import pytest
import torch

import epjit
from epjit import _lib
from backend_util import fresh, rel_err  # noqa: F401
from test_backend_families import test_family_matches_eager as _family
from test_backend_masks import test_padded_batch_whole_model as _padded
from test_backend import test_float_comparisons_lowered as _cmp
from test_backend import test_relu_clamp_max_min_gradients as _relu
from test_backend import test_reductions_of_integers_and_bools_lowered \
    as _reductions

pytestmark = pytest.mark.usefixtures("fresh")


@pytest.fixture(autouse=True)
def on_sim(monkeypatch):
    monkeypatch.setenv("EPJIT_TORCH_CPU_DEVICE", "cuda-sim")


def _ran_on_sim():
    """The graphs ran on the cuda-sim context, its templates included, and
    nothing on the cpu one."""
    sim = _lib.counters_raw("cuda-sim")
    assert sim.get("kernels.launched.compiled", 0) > 0, sim
    assert sim.get("kernels.launched.template", 0) > 0, sim
    assert _lib.counters_raw("cpu").get("kernels.launched.compiled",
                                        0) == 0


@pytest.mark.parametrize("family,dtype", [
    ("deepseek_v2", torch.float32), ("deepseek_v2", torch.bfloat16),
    ("qwen3_5_moe", torch.bfloat16)])
def test_family_on_cuda_sim(family, dtype):
    """MLA with its complex rotary embedding, Gated DeltaNet with its
    triangular solves: as on the CPU, nothing left to torch (Qwen3.5-MoE
    in bf16 only, for CI's time: 16 s a dtype on cuda-sim)."""
    _family(family, dtype)
    _ran_on_sim()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_batch_on_cuda_sim(dtype):
    """The attention template with a mask (bf16: its tensor-core
    kernels)."""
    _padded("qwen3_moe", True, dtype)
    _ran_on_sim()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_comparisons_reductions_clamp_on_cuda_sim(dtype):
    """Float comparisons, integer reductions, relu, clamp and the max/min
    gradients as on the CPU, in generated CUDA C."""
    _cmp(dtype)
    _relu(dtype)
    if dtype == torch.float32:
        _reductions((2, 3, 5))
    sim = _lib.counters_raw("cuda-sim")
    assert sim.get("kernels.launched.compiled", 0) > 0, sim
    assert _lib.counters_raw("cpu").get("kernels.launched.compiled",
                                        0) == 0


def test_unsupported_kernel_runs_in_torch():
    """Head dim 272 is past the attention template's 256: the graph fails
    at its first run with EPJ_ERR_UNSUPPORTED, runs in torch from then on
    (the same results), and its nodes are counted with the reason."""
    assert _lib.lib.epj_status_name(_lib.ERR_UNSUPPORTED) == \
        b"EPJ_ERR_UNSUPPORTED"

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True).sin()

    q, k, v = (torch.randn(1, 2, 5, 272, requires_grad=True)
               for _ in range(3))
    g = torch.compile(f, backend="epjit")
    with pytest.warns(UserWarning, match="not supported|256"):
        got = g(q, k, v)
    assert rel_err(got, f(q, k, v)) <= 1e-5
    got.sum().backward()
    assert torch.isfinite(q.grad).all()
    g(q, k, v)  # again: torch, no new warning needed
    fb = epjit.counters()["fallback"]
    why = "epjit: not on device cuda-sim"
    assert any(why in r for r in fb.values()), fb


def test_bad_cpu_device(monkeypatch):
    monkeypatch.setenv("EPJIT_TORCH_CPU_DEVICE", "gpu")
    g = torch.compile(lambda x: x.sin() + 1, backend="epjit")
    with pytest.raises(Exception, match="EPJIT_TORCH_CPU_DEVICE"):
        g(torch.randn(3))
