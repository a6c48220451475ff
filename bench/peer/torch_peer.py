#!/usr/bin/env python3
"""bench/peer/torch_peer.py -- the torch side of the peer benchmark.

Builds the bench model in Hugging Face transformers from the same config.json
epjit reads (bench/configs/bench-model.json), trains it with the settings of
the same DeepSpeed-style config (micro-batch, bf16 or f32, AdamW and its
parameters, gradient clipping), and times training steps of two arms side by
side in one process:

  eager     the model as built;
  compiled  DeepSpeed's regional recipe for AutoEP: every decoder layer is
            compiled with torch.compile (Inductor), and the MoE block's
            forward runs under torch.compiler.disable, so it stays an eager
            graph break, as epjit's compile.autoep_non_moe keeps it.

Both arms start from the same weights and train on the same fixed batch.
With bf16 enabled the model runs in bf16 and AdamW updates FP32 master
copies, then writes the bf16 weights back (DeepSpeed's bf16 optimizer);
with bf16 off everything is f32.  After --warmup steps per arm (the compiled
arm compiles then), the arms alternate A B B A ... for --steps steps each.
Printed: median wall and CPU time per step of each arm and their ratio, and
one JSON line (prefix "json: ") for scripts.  One thread by default, as the
epjit benchmarks run.

Not part of make check; bench/peer/run.sh makes the venv and runs both sides.
"""
import argparse
import copy
import json
import statistics
import sys
import time


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bench/configs/bench-model.json")
    ap.add_argument("--config", default="bench/configs/bench-ds.json")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def load_json(path):
    with open(path) as f:
        return json.load(f)


class Arm:
    """One model, its optimizer and its step function."""

    def __init__(self, torch, model, ds, bf16):
        self.torch = torch
        self.model = model
        self.bf16 = bf16
        p = ds.get("optimizer", {}).get("params", {})
        otype = ds.get("optimizer", {}).get("type", "AdamW")
        if otype.lower() != "adamw":
            sys.exit("torch_peer: only AdamW is timed (config has %s)" % otype)
        self.clip = float(ds.get("gradient_clipping", 0.0))
        self.params = [q for q in model.parameters() if q.requires_grad]
        if bf16:
            self.masters = [q.detach().float().clone() for q in self.params]
            for m in self.masters:
                m.requires_grad_(True)
        else:
            self.masters = self.params
        self.opt = torch.optim.AdamW(
            self.masters,
            lr=float(p.get("lr", 1e-3)),
            betas=tuple(p.get("betas", (0.9, 0.999))),
            eps=float(p.get("eps", 1e-8)),
            weight_decay=float(p.get("weight_decay", 0.01)),
            foreach=True,
        )

    def step(self, ids):
        torch = self.torch
        out = self.model(input_ids=ids, labels=ids)
        out.loss.backward()
        if self.bf16:
            for m, q in zip(self.masters, self.params):
                m.grad = None if q.grad is None else q.grad.float()
                q.grad = None
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.masters, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.bf16:
            with torch.no_grad():
                for m, q in zip(self.masters, self.params):
                    q.copy_(m)
        return float(out.loss.detach())


def regional_compile(torch, model):
    """Compile every decoder layer; keep each MoE block eager."""
    layers = model.model.layers
    n_moe = 0
    for layer in layers:
        mlp = layer.mlp
        if type(mlp).__name__.endswith("SparseMoeBlock"):
            mlp.forward = torch.compiler.disable(mlp.forward)
            n_moe += 1
        layer.compile()
    return len(layers), n_moe


def timed(torch, arm, ids):
    w0, c0 = time.perf_counter(), time.process_time()
    loss = arm.step(ids)
    w1, c1 = time.perf_counter(), time.process_time()
    return (w1 - w0) * 1e3, (c1 - c0) * 1e3, loss


def main():
    a = parse()
    import torch
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    mc = load_json(a.model)
    ds = load_json(a.config)
    bf16 = bool(ds.get("bf16", {}).get("enabled", False))
    dtype = torch.bfloat16 if bf16 else torch.float32
    mc = {k: v for k, v in mc.items() if k not in ("torch_dtype", "dtype")}
    cfg = Qwen3MoeConfig(**mc)
    cfg._attn_implementation = "sdpa"
    batch = int(ds.get("train_micro_batch_size_per_gpu", 1))
    base = Qwen3MoeForCausalLM(cfg).to(dtype)
    base.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, a.seq))

    eager = Arm(torch, base, ds, bf16)
    cmodel = copy.deepcopy(base)
    n_layers, n_moe = regional_compile(torch, cmodel)
    compiled = Arm(torch, cmodel, ds, bf16)

    t0 = time.perf_counter()
    for _ in range(a.warmup):
        timed(torch, eager, ids)
    t1 = time.perf_counter()
    for _ in range(a.warmup):
        timed(torch, compiled, ids)
    t2 = time.perf_counter()

    res = {"eager": ([], []), "compiled": ([], [])}
    order = []
    for i in range(a.steps):
        order += (["eager", "compiled"] if i % 2 == 0 else
                  ["compiled", "eager"])
    losses = {"eager": [], "compiled": []}
    for name in order:
        w, c, loss = timed(torch, eager if name == "eager" else compiled, ids)
        res[name][0].append(w)
        res[name][1].append(c)
        losses[name].append(loss)

    med = {k: (statistics.median(v[0]), statistics.median(v[1]))
           for k, v in res.items()}
    print("torch %s, transformers %s, %d thread(s), %s, batch %d x %d, "
          "%d layers (%d MoE blocks kept eager)" %
          (torch.__version__, transformers.__version__, a.threads,
           "bf16" if bf16 else "f32", batch, a.seq, n_layers, n_moe))
    print("warm-up: eager %.1f s, compiled %.1f s (%d steps each; the "
          "compiled arm compiles here)" % (t1 - t0, t2 - t1, a.warmup))
    print("%-24s %12s %12s %8s" % ("", "eager", "compiled", "ratio"))
    print("%-24s %12.1f %12.1f %8.3f" %
          ("median step (ms, wall)", med["eager"][0], med["compiled"][0],
           med["compiled"][0] / med["eager"][0]))
    print("%-24s %12.1f %12.1f %8.3f" %
          ("median step (ms, cpu)", med["eager"][1], med["compiled"][1],
           med["compiled"][1] / med["eager"][1]))
    print("last loss: eager %.4f, compiled %.4f" %
          (losses["eager"][-1], losses["compiled"][-1]))
    print("json: " + json.dumps({
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": a.threads, "bf16": bf16, "batch": batch, "seq": a.seq,
        "steps": a.steps,
        "eager_wall_ms": med["eager"][0], "eager_cpu_ms": med["eager"][1],
        "compiled_wall_ms": med["compiled"][0],
        "compiled_cpu_ms": med["compiled"][1],
    }))


if __name__ == "__main__":
    main()
