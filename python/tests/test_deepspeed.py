"""DeepSpeed AutoEP with regional compilation through epjit, on the CPU.

DeepSpeed's ``engine.compile(backend=...)`` with ``"compile": {"autoep_non_moe":
true}`` compiles every callable parent of an AutoEP layer (here the decoder
layers of a Hugging Face Qwen3MoeForCausalLM) and keeps the AutoEP layer eager
(``torch.compiler.disable``).  These tests train a tiny model for STEPS steps
under ZeRO 1 and AdamW (``torch_adam``) over gloo, once eager and once with
``engine.compile(backend=...)``, on the same seed and batches, and check:

- the regions compiled are the decoder layers, and the compiled arm ran the
  backend's kernels (for epjit: its counters);
- the AutoEP layers ran eagerly, once per layer and step;
- every step's loss equals DeepSpeed eager within LOSS_RTOL;
- nothing recompiled after the first step (Dynamo's counters, with
  ``torch._dynamo.config.error_on_recompile`` set, and epjit's compiles).

World 1 runs one process; world 2 two processes over gloo with
``autoep_size`` 2 (each rank owns half the experts; the AllToAll runs).  Each
rank is a fresh interpreter (this file run as a script), so that Dynamo's and
DeepSpeed's process-wide state never leaks into pytest's process; a timeout
bounds every launch.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

STEPS = 10
WARMUP = 1  # steps before the measured window (the compiles happen there)
LOSS_RTOL = 1e-4
LOSS_ATOL = 1e-5
LAUNCH_TIMEOUT_S = 600

MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
             moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=4, num_experts_per_tok=2,
             max_position_embeddings=64, decoder_sparse_step=1,
             mlp_only_layers=[], norm_topk_prob=True,
             output_router_logits=False, tie_word_embeddings=False)
BATCH, SEQ = 2, 32


# --------------------------------------------------------------------------
# The worker: one rank, both arms (eager, then compiled).


def _ds_config(world):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "expert_parallel": {"enabled": True, "autoep_size": world,
                            "preset_model": "qwen3_moe"},
        "compile": {"autoep_non_moe": True},
        "steps_per_print": 1 << 30,
    }


def _batches(rank, steps):
    import torch
    # Arithmetic sequences with a random start and one of three strides:
    # learnable, so the loss falls within a few steps.
    g = torch.Generator().manual_seed(1234 + rank)
    pos = torch.arange(SEQ)
    out = []
    for _ in range(steps):
        start = torch.randint(0, MODEL["vocab_size"], (BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (BATCH, 1), generator=g)
        out.append((start + stride * pos) % MODEL["vocab_size"])
    return out


def _dynamo_snapshot():
    from torch._dynamo.utils import counters
    return {"unique_graphs": counters["stats"]["unique_graphs"],
            "frames": counters["frames"]["total"],
            "recompiles": sum(counters["recompiles"].values())
            if "recompiles" in counters else 0}


def _epjit_counters():
    try:
        import epjit
    except ImportError:
        return None
    return dict(epjit.counters())


def _arm(backend, world, rank, steps):
    """Train a fresh engine for `steps` steps; backend None means eager."""
    import torch
    import deepspeed
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**MODEL)
    cfg._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(cfg)
    engine, *_ = deepspeed.initialize(model=model,
                                      model_parameters=model.parameters(),
                                      config=_ds_config(world))
    layers = [(n, m) for n, m in engine.module.named_modules()
              if isinstance(m, AutoEPMoELayer)]
    # Each AutoEP layer's forward, counted: calls that ran eagerly (outside
    # any Dynamo trace) and calls that Dynamo traced.
    seen = {"eager": 0, "traced": 0}
    for _, layer in layers:
        inner = layer.forward

        def counted(*a, _inner=inner, **kw):
            if torch.compiler.is_compiling():
                seen["traced"] += 1
            else:
                seen["eager"] += 1
            return _inner(*a, **kw)
        layer.forward = counted

    regions = []
    if backend is not None:
        if backend == "epjit":
            import epjit
            epjit.reset()
        torch._dynamo.reset()
        engine.compile(backend=backend)
        regions = list(engine._compiled_regions)

    losses, marks = [], {}
    for step, ids in enumerate(_batches(rank, steps)):
        if step == WARMUP:
            torch._dynamo.config.error_on_recompile = backend is not None
            marks["dynamo_before"] = _dynamo_snapshot()
            marks["epjit_before"] = _epjit_counters()
            seen["eager"] = seen["traced"] = 0
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    torch._dynamo.config.error_on_recompile = False
    marks["dynamo_after"] = _dynamo_snapshot()
    marks["epjit_after"] = _epjit_counters()
    if hasattr(engine, "destroy"):
        engine.destroy()
    return {"backend": backend, "losses": losses, "regions": regions,
            "autoep_layers": [n for n, _ in layers],
            "autoep_local_experts": [m.num_local_experts for _, m in layers],
            "autoep_calls": seen, **marks}


def _worker(args):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 (deepspeed.comm.torch is torch)
    ds_torch_comm = sys.modules["deepspeed.comm.torch"]
    # DeepSpeed's CPU accelerator builds a shared-memory allreduce (a C++
    # extension, minutes on two cores) at its first init; gloo carries the
    # collectives without it.
    ds_torch_comm.build_shm_op = lambda: None
    deepspeed.init_distributed("gloo")
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    result = {"rank": rank, "world": world, "arms": []}
    for backend in ([None] if args.eager else []) + [args.backend]:
        t = time.perf_counter()
        arm = _arm(backend, world, rank, args.steps)
        arm["seconds"] = time.perf_counter() - t
        result["arms"].append(arm)
    with open(args.out, "w") as f:
        json.dump(result, f)


# --------------------------------------------------------------------------
# The launcher, and the tests.


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(script, args, world, what, timeout=LAUNCH_TIMEOUT_S):
    """Run `world` ranks of `script --worker ARGS --out FILE` over gloo on
    this host (one thread each); return their JSON results, by rank.  A
    rank that fails or runs past the timeout fails the test with the last
    lines of its log; `what` names the run in that message."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="epjit-ds-") as tmp:
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
            out = os.path.join(tmp, f"rank{rank}.json")
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w")
            cmd = [sys.executable, os.path.abspath(script), "--worker",
                   *args, "--out", out]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log, out))
        deadline = time.monotonic() + timeout
        failed = []
        for rank, (p, log, _) in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                failed.append((rank, rc))
        for p, log, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        if failed:
            tails = []
            for rank, rc in failed:
                with open(os.path.join(tmp, f"rank{rank}.log")) as f:
                    tails.append(f"rank {rank} exited {rc}; its last lines:\n"
                                 + "".join(f.readlines()[-30:]))
            pytest.fail("DeepSpeed worker failed (%s world %d):\n%s"
                        % (what, world, "\n".join(tails)))
        results = []
        for _, _, out in procs:
            with open(out) as f:
                results.append(json.load(f))
        return results


def launch(world, backend, steps=STEPS, eager=True, timeout=LAUNCH_TIMEOUT_S):
    """Run `world` worker processes; return their results, by rank."""
    args = ["--backend", backend, "--steps", str(steps)]
    if eager:
        args.append("--eager")
    return launch_ranks(__file__, args, world, backend, timeout)


def check_rank(result, backend):
    eager, comp = result["arms"]
    world = result["world"]
    assert eager["backend"] is None and comp["backend"] == backend
    # The regions are the decoder layers: the parents of the AutoEP layers.
    layers = comp["autoep_layers"]
    assert len(layers) == MODEL["num_hidden_layers"], layers
    assert comp["regions"] == [n.rpartition(".")[0] for n in layers]
    # autoep_size is the world: each rank owns its share of the experts.
    assert comp["autoep_local_experts"] == \
        [MODEL["num_experts"] // world] * len(layers)
    # AutoEP ran eagerly, once per layer and measured step, in both arms.
    calls = len(layers) * (STEPS - WARMUP)
    assert comp["autoep_calls"] == {"eager": calls, "traced": 0}
    assert eager["autoep_calls"] == {"eager": calls, "traced": 0}
    # Dynamo compiled graphs in the first step and nothing after it.
    before, after = comp["dynamo_before"], comp["dynamo_after"]
    assert before["unique_graphs"] >= 1, before
    assert after == before, (before, after)
    # The same losses as DeepSpeed eager, step by step.
    assert len(comp["losses"]) == len(eager["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(comp["losses"], eager["losses"])):
        assert abs(a - b) <= LOSS_ATOL + LOSS_RTOL * abs(b), \
            f"rank {result['rank']} of {world}, step {step}: " \
            f"{backend} loss {a!r}, eager {b!r}"
    # The model learns something in ten steps (the losses are not constant).
    assert eager["losses"][-1] < eager["losses"][0]
    if backend == "epjit":
        e0, e1 = comp["epjit_before"], comp["epjit_after"]
        assert e0 is not None and e1 is not None
        # Regions compiled by epjit in the first step, their kernels run in
        # every step after it, and nothing compiled again.
        # (forward and backward: at least two graphs).
        assert e0["graphs"] >= 2 and e0["unique_graphs"] >= 1, e0
        assert e1["kernels"] > e0["kernels"], (e0, e1)
        for key in ("graphs", "unique_graphs", "compiles", "cache_misses"):
            assert e1[key] == e0[key], (key, e0, e1)


def _need(module, why):
    try:
        __import__(module)
    except ImportError as e:
        pytest.skip(f"{why}: {e}")


@pytest.fixture(scope="module", autouse=True)
def _deps():
    _need("deepspeed", "DeepSpeed is not installed (python/requirements-test.txt)")
    _need("transformers", "transformers is not installed (python/requirements-test.txt)")


def _need_epjit():
    _need("epjit", "the epjit package is not installed "
          "(python -m pip install ./python)")


def test_harness_dynamo_eager_backend_world1():
    """The harness itself, with Dynamo's "eager" backend (no kernel compiler):
    regions traced, AutoEP eager, losses equal, no recompiles."""
    (r,) = launch(1, "eager")
    check_rank(r, "eager")


def test_epjit_world1():
    _need_epjit()
    (r,) = launch(1, "epjit")
    check_rank(r, "epjit")


def test_epjit_world2():
    _need_epjit()
    results = launch(2, "epjit")
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        check_rank(r, "epjit")
    # Data parallel over the same replicated dense weights: every rank's
    # regions compiled to the same graphs.
    assert results[0]["arms"][1]["epjit_after"]["unique_graphs"] == \
        results[1]["arms"][1]["epjit_after"]["unique_graphs"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--eager", action="store_true",
                    help="run the eager arm first")
    ap.add_argument("--out", required=True)
    _worker(ap.parse_args())
