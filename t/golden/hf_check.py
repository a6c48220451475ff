#!/usr/bin/env python3
"""t/golden/hf_check.py -- an `epjit-ckpt to-hf` folder against transformers.

Not run by make check (it needs torch and transformers).  Usage:

    epjit-ckpt to-hf run.ckpt hf
    epjit-train --model hf/config.json --config one-rank.json --seq 8 \\
        --load hf --dump-state hf.st
    python3 t/golden/hf_check.py hf hf.st [--tol 1e-4]

Loads the folder with transformers' AutoModelForCausalLM (Qwen3-MoE), in
float32, and checks that:
  - no parameter of the model is missing from the folder and the folder has
    no tensor the model does not take (from_pretrained's loading info);
  - its logits on the dump's input_ids match the dump's logits (epjit's
    forward on the same weights) to --tol (absolute, default 1e-4: f32
    kernels with different summation orders; logits are of order 1);
  - its mean cross-entropy on the dump's labels matches the dump's loss.
Prints one line with the numbers and exits 0 when all hold.
"""
import argparse
import json
import struct
import sys


def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    return hdr, data


def tensor(hdr, data, name):
    import torch

    e = hdr[name]
    a, b = e["data_offsets"]
    dt = {"F32": torch.float32, "I64": torch.int64}[e["dtype"]]
    t = torch.frombuffer(bytearray(data[a:b]), dtype=dt)
    return t.reshape(e["shape"]) if e["shape"] else t.reshape(())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("dump")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        a.hf_dir, torch_dtype=torch.float32, output_loading_info=True
    )
    model.eval()
    bad = {k: v for k, v in info.items() if v}
    if bad:
        print("hf_check: FAIL: loading info %s" % bad)
        return 1
    hdr, data = read_st(a.dump)
    ids = tensor(hdr, data, "input_ids")
    labels = tensor(hdr, data, "labels")
    ref = tensor(hdr, data, "logits")
    loss_ref = float(tensor(hdr, data, "loss"))
    with torch.no_grad():
        out = model(input_ids=ids)
    logits = out.logits.float()
    err = (logits - ref).abs().max().item()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
        ignore_index=-100).item()
    ok = err <= a.tol and abs(loss - loss_ref) <= a.tol
    print("hf_check: %s: %d parameters, nothing missing or unexpected; "
          "logits max |transformers - epjit| %.3g over %d values; loss "
          "%.6f (transformers) vs %.6f (epjit)"
          % ("PASS" if ok else "FAIL",
             sum(1 for _ in model.parameters()), err, ref.numel(), loss,
             loss_ref))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
