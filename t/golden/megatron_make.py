#!/usr/bin/env python3
"""megatron_make.py -- golden values of Megatron Core's router losses, from
Megatron's own functions.  Run by hand (it needs torch and a Megatron-LM
checkout); make check reads only the file it writes (the router_loss
suite, test_megatron_golden).

    python3 t/golden/megatron_make.py MEGATRON_LM_DIR [OUT]
        (default OUT: t/golden/megatron/router_losses.safetensors)

megatron/core/transformer/moe/moe_utils.py is read from MEGATRON_LM_DIR and
its switch_load_balancing_loss_func, z_loss_func and
compute_routing_scores_for_aux_loss are run as they are (taken out of the
file, which imports half of Megatron); router.py's callers are followed
here: _apply_aux_loss (the micro-batch's counts), _apply_seq_aux_loss
(the scores reshaped [seq_length, batch x experts], divided by the batch)
and _apply_global_aux_loss (the counts summed over the micro-batches so far
and divided by their number; one rank), each with coefficient 1, and
apply_z_loss.  Megatron lays tokens out [seq, batch]; the file holds the
logits in epjit's order [batch, seq].

For each score function (softmax, sigmoid) the file holds:
  <sf>.logits          F64 [M, L, B, T, E]   M micro-batches of L layers
  <sf>.aux_loss, <sf>.seq_aux_loss, <sf>.global_aux_loss, <sf>.z_loss
                       F64 [M, L]            each layer's loss
Metadata "about": k=<top-k>, the Megatron-LM commit and moe_utils.py's
git blob, the torch version.  Megatron
computes the scores in float32 (softmax(dtype=torch.float32)), so the
values carry f32 rounding: compare to 1e-6 relative.
"""
import ast
import os
import subprocess
import sys
import typing

import torch
from safetensors.torch import save_file

M, L, S, B, E, K = 2, 3, 5, 3, 6, 2


def megatron_functions(root):
    path = os.path.join(root, "megatron/core/transformer/moe/moe_utils.py")
    src = open(path).read()
    want = {"switch_load_balancing_loss_func", "z_loss_func",
            "compute_routing_scores_for_aux_loss"}
    body = [n for n in ast.parse(src).body
            if isinstance(n, ast.FunctionDef) and n.name in want]
    assert {n.name for n in body} == want, "moe_utils.py lacks a function"
    g = {"torch": torch, "Optional": typing.Optional,
         "Tuple": typing.Tuple, "HAVE_TE": False,
         "fused_moe_aux_loss": None,
         "fused_compute_score_for_moe_aux_loss": None,
         "is_te_min_version": lambda *a: False}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), g)
    ids = []
    for rev in ("HEAD", "HEAD:megatron/core/transformer/moe/moe_utils.py"):
        try:
            ids.append(subprocess.run(["git", "-C", root, "rev-parse", rev],
                                      capture_output=True, text=True,
                                      check=True).stdout.strip())
        except (OSError, subprocess.CalledProcessError):
            ids.append("unknown")
    return g, ids


def main():
    root = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "megatron",
        "router_losses.safetensors")
    g, (commit, blob) = megatron_functions(root)
    sw = g["switch_load_balancing_loss_func"]
    zl = g["z_loss_func"]
    cr = g["compute_routing_scores_for_aux_loss"]
    gen = torch.Generator().manual_seed(17)
    tensors = {}
    for sf in ("softmax", "sigmoid"):
        logits = torch.randn(M, L, S, B, E, generator=gen,
                             dtype=torch.float64) * 2
        vals = {k: torch.zeros(M, L, dtype=torch.float64)
                for k in ("aux_loss", "seq_aux_loss", "global_aux_loss",
                          "z_loss")}
        gsum = torch.zeros(L, E, dtype=torch.float64)
        for m in range(M):
            for l in range(L):
                z = logits[m, l].reshape(S * B, E)  # Megatron's [s, b]
                rmap, scores = cr(z, K, sf)
                tpe = rmap.sum(0).double()
                vals["aux_loss"][m, l] = sw(scores, tpe, S * B, K, E, 1.0)
                s2, r2 = scores.reshape(S, -1), rmap.reshape(S, -1)
                vals["seq_aux_loss"][m, l] = sw(
                    s2, r2.sum(0).double(), S, K, E, 1.0) / B
                gsum[l] += tpe
                vals["global_aux_loss"][m, l] = sw(
                    scores, gsum[l] / (m + 1), S * B, K, E, 1.0)
                vals["z_loss"][m, l] = zl(z, 1.0)
        tensors[sf + ".logits"] = logits.permute(0, 1, 3, 2, 4).contiguous()
        for k, v in vals.items():
            tensors[sf + "." + k] = v
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # one metadata key: safetensors writes several in no fixed order
    save_file(tensors, out, metadata={
        "about": f"k={K} megatron_commit={commit} moe_utils_blob={blob} "
                 f"torch={torch.__version__}"})
    print(f"{out}: {M} micro-batches x {L} layers x [{B}, {S}, {E}], "
          f"moe_utils.py blob {blob}")


if __name__ == "__main__":
    main()
