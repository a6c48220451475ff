"""DeepSpeed AutoEP with ``engine.compile(backend="epjit")`` on each model
family DeepSpeed has an AutoEP preset for, on the CPU.

test_deepspeed.py checks the whole contract (regions, AutoEP eager, no
recompiles) on Qwen3-MoE; this file runs the other families' decoder
layers through the same regional compile: Mixtral, DeepSeek-V2 (MLA and
its complex rotary embedding), DeepSeek-V3 (MLA, shared experts), and
Qwen3.5-MoE (Gated DeltaNet layers beside full attention).  Per case, one
process trains a fresh engine eagerly and then a fresh engine compiled by
epjit, on the same seed and batches (odd sequence length), and checks:

- the regions are the decoder layers and every AutoEP layer ran eagerly;
- epjit compiled them and ran its kernels, nothing compiled after the
  first step, and no node of any region was left to torch;
- every step's loss equals DeepSpeed eager's (f32 to 1e-5 relative; bf16
  to 1e-2: bf16 rounding, and a router near-tie may send a token to
  another expert on one side; measured at most 9e-5 on these seeds).

World 2 (two processes over gloo, ``autoep_size`` 2) runs DeepSeek-V3;
Mixtral also trains on padded batches (a padding ``attention_mask``).
The models are the family test models of test_backend_families.py.
"""

import argparse
import json
import os
import sys

import pytest

from test_backend_families import COMMON, FAMILIES
from test_deepspeed import launch_ranks

STEPS = 4
BATCH, SEQ = 2, 37
RTOL = {"f32": 1e-5, "bf16": 1e-2}
LAUNCH_TIMEOUT_S = 600


def _ds_config(family, dtype, world):
    cfg = {"train_micro_batch_size_per_gpu": BATCH,
           "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW",
                         "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 1},
           "expert_parallel": {"enabled": True, "autoep_size": world,
                               "preset_model": family},
           "compile": {"autoep_non_moe": True},
           "steps_per_print": 1 << 30}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _arm(backend, family, dtype, world, rank, pad):
    import torch
    import transformers
    import deepspeed
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    cname, mname, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cname)(**COMMON, **extra)
    cfg._attn_implementation = "sdpa"
    model = getattr(transformers, mname)(cfg)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config=_ds_config(family, dtype, world))
    layers = [n for n, m in engine.module.named_modules()
              if isinstance(m, AutoEPMoELayer)]
    eager_calls = [0]
    for m in engine.module.modules():
        if isinstance(m, AutoEPMoELayer):
            inner = m.forward

            def counted(*a, _inner=inner, **kw):
                if not torch.compiler.is_compiling():
                    eager_calls[0] += 1
                return _inner(*a, **kw)
            m.forward = counted
    regions, marks = [], {}
    if backend == "epjit":
        import epjit
        epjit.reset()
        torch._dynamo.reset()
        engine.compile(backend="epjit")
        regions = list(engine._compiled_regions)
    g = torch.Generator().manual_seed(1234 + rank)
    losses = []
    for step in range(STEPS):
        if step == 1 and backend == "epjit":
            marks["before"] = dict(epjit.counters())
        ids = torch.randint(0, COMMON["vocab_size"], (BATCH, SEQ),
                            generator=g)
        if pad:  # row 0 padded on the left, row 1 on the right
            am = torch.ones_like(ids)
            am[0, :9] = 0
            am[1, -5:] = 0
            out = engine(input_ids=ids, attention_mask=am,
                         labels=ids.masked_fill(am == 0, -100))
        else:
            out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    if backend == "epjit":
        c = epjit.counters()
        marks["after"] = {k: v for k, v in c.items() if k != "fallback"}
        marks["fallback"] = {str(k): dict(v) for k, v in c["fallback"].items()}
        marks["before"].pop("fallback", None)
    return {"losses": losses, "layers": layers, "regions": regions,
            "eager_calls": eager_calls[0], **marks}


def _worker(args):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 (deepspeed.comm.torch is torch)
    # no shared-memory allreduce extension (a C++ build): gloo carries it
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed("gloo")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    res = {"rank": rank, "world": world}
    for backend in ("eager", "epjit"):
        res[backend] = _arm(backend, args.family, args.dtype, world, rank,
                            args.pad)
    with open(args.out, "w") as f:
        json.dump(res, f)


def launch(family, dtype, world, pad=False):
    args = ["--family", family, "--dtype", dtype] + (["--pad"] if pad else [])
    return launch_ranks(__file__, args, world,
                        "%s %s" % (family, dtype), LAUNCH_TIMEOUT_S)


def check(res, family, dtype):
    eager, comp = res["eager"], res["epjit"]
    layers = comp["layers"]
    assert len(layers) == COMMON["num_hidden_layers"], layers
    # the regions are the AutoEP layers' parents, the decoder layers
    assert comp["regions"] == [n.rpartition(".")[0] for n in layers]
    # every AutoEP layer ran eagerly, once a step, in both arms
    assert comp["eager_calls"] == eager["eager_calls"] == \
        len(layers) * STEPS
    before, after = comp["before"], comp["after"]
    assert before["graphs"] >= 2 and before["kernels"] > 0, before
    assert after["kernels"] > before["kernels"], (before, after)
    for key in ("graphs", "unique_graphs", "compiles", "cache_misses"):
        assert after[key] == before[key], (key, before, after)
    assert comp["fallback"] == {}, comp["fallback"]
    for step, (a, b) in enumerate(zip(comp["losses"], eager["losses"])):
        assert abs(a - b) <= RTOL[dtype] * abs(b), \
            "%s %s rank %d step %d: epjit %r, eager %r" % (
                family, dtype, res["rank"], step, a, b)


@pytest.fixture(scope="module", autouse=True)
def _deps():
    for mod in ("deepspeed", "transformers", "epjit"):
        pytest.importorskip(mod)


@pytest.mark.parametrize("family,dtype", [
    ("mixtral", "f32"), ("mixtral", "bf16"), ("deepseek_v2", "f32"),
    ("deepseek_v3", "f32"), ("deepseek_v3", "bf16"), ("qwen3_5_moe", "f32")])
def test_family_world1(family, dtype):
    (res,) = launch(family, dtype, 1)
    check(res, family, dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_padded_batches_mixtral(dtype):
    """Batches with a padding attention_mask (left and right): the masked
    attention and the mask's construction compile too."""
    (res,) = launch("mixtral", dtype, 1, pad=True)
    check(res, "mixtral", dtype)


def test_deepseek_v3_world2():
    results = launch("deepseek_v3", "f32", 2)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        check(r, "deepseek_v3", "f32")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--family", required=True, choices=sorted(FAMILIES))
    ap.add_argument("--dtype", required=True, choices=sorted(RTOL))
    ap.add_argument("--out", required=True)
    ap.add_argument("--pad", action="store_true",
                    help="batches with a padding attention_mask")
    _worker(ap.parse_args())
