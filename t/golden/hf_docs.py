#!/usr/bin/env python3
"""hf_docs.py -- golden files of Hugging Face transformers for rows of packed
documents (Megatron's reset_attention_mask, reset_position_ids and
eod_mask_loss).  Run by hand with torch and transformers (the versions of
t/golden/hf/*/versions.txt); make check reads only the files it writes
(t/hf_docs.sh).

    python3 t/golden/hf_docs.py [OUTDIR]        (default: t/golden/docs)

For qwen3_moe, deepseek_v3 (latent attention, interleaved YaRN rope) and
qwen3_5_moe (Gated DeltaNet layers beside gated full attention), the
tiny models of t/golden/hf/<family>/ (made by hf_make.py) are copied to
OUTDIR/<family>/ with:
  batch.safetensors   input_ids, labels (I64 [2, 16]): each row documents
                      packed end to end, each ended by the end-of-document
                      token 1 (the last one cut), labels the row's next
                      tokens (the EOD masking is the trainer's, as
                      --eod-mask-loss does it)
  golden.safetensors  logits (F64 [2, 16, V]): every document's positions
                      hold the logits transformers gives for that document
                      alone (a [1, len] forward from position 0); loss (F64
                      []): the sum over the documents of their token
                      losses, labels -100 where the input is the EOD, over
                      the number of tokens that count; NAME.grad (F64): its
                      gradient; metadata compute F64, eod_token 1
  f32.safetensors     the same from transformers' own f32 run
  versions.txt
The f64 pass runs inside hf_make.Float64 (every op in f64 but the rope
tables, f32 values by transformers' definition); the script asserts that
it routes every token as the f32 pass does.  What epjit must reproduce on
the packed rows: no document sees another, each one's positions start at
0, the EOD's next-token loss does not count, and the loss is per token.
"""
import os
import shutil
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_make  # noqa: E402  (Float64, ckpt_names, families)

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "docs")
EOD = 1
B, T = 2, 16
# per row: document lengths, the EOD last; the last document is cut
LENGTHS = [[5, 7, 3, 2], [1, 9, 4, 3]]


def packed_batch(vocab):
    g = torch.Generator().manual_seed(7)
    rows = []
    for lens in LENGTHS:
        row = []
        for n in lens:
            row += torch.randint(2, vocab, (n - 1,), generator=g).tolist()
            row.append(EOD)
        rows.append(row[: T + 1])
        assert len(rows[-1]) == T + 1, len(row)
    seq = torch.tensor(rows)
    return seq[:, :T].contiguous(), seq[:, 1:].contiguous()


def documents(ids):
    """(row, lo, hi) of every document: the EOD is the document's own."""
    for b in range(ids.shape[0]):
        lo = 0
        for t in range(ids.shape[1]):
            if ids[b, t].item() == EOD or t == ids.shape[1] - 1:
                yield b, lo, t + 1
                lo = t + 1


def run(model, ids, labels):
    """Per document alone: the logits assembled into [B, T, V], and the sum
    of the counted token losses over their number."""
    masked = labels.masked_fill(ids == EOD, -100)
    parts, total = {}, 0
    for b, lo, hi in documents(ids):
        lg = model(input_ids=ids[b : b + 1, lo:hi]).logits
        parts[(b, lo)] = lg[0]
        total = total + F.cross_entropy(
            lg[0], masked[b, lo:hi], ignore_index=-100, reduction="sum"
        )
    rows = []
    for b in range(ids.shape[0]):
        rows.append(torch.cat([v for (r, _), v in sorted(parts.items()) if r == b]))
    n = (masked != -100).sum()
    return torch.stack(rows), total / n


def grads_by_name(model, moe, proj):
    out = {}
    for n, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        for cn, gv in hf_make.ckpt_names(n, grad.detach(), moe, proj):
            out[cn + ".grad"] = gv.contiguous().clone()
    return out


def make(fam, cls, moe, proj):
    src = os.path.join(HERE, "hf", fam)
    d = os.path.join(OUT, fam)
    os.makedirs(d, exist_ok=True)
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copyfile(os.path.join(src, f), os.path.join(d, f))
    model = cls.from_pretrained(d, torch_dtype=torch.float32)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    model.train()
    # the loaded model is the file's (the mapping of hf_make.py)
    saved = safe_open(os.path.join(d, "model.safetensors"), "pt")
    for n, p in model.named_parameters():
        for cn, pv in hf_make.ckpt_names(n, p.detach(), moe, proj):
            assert torch.equal(saved.get_tensor(cn), pv), f"{fam}: {cn}"
    ids, labels = packed_batch(model.config.vocab_size)
    routes = []

    def hook(mod, inp, out):
        routes.append(out[2].detach().clone())

    for n, mod in model.named_modules():
        if n.endswith(".mlp.gate"):
            mod.register_forward_hook(hook)
    logits32, loss32 = run(model, ids, labels)
    loss32.backward()
    out32 = {"logits": logits32.detach().contiguous(),
             "loss": loss32.detach().reshape(())}
    out32.update(grads_by_name(model, moe, proj))
    routes32 = [r.sort(-1).values for r in routes]
    model.zero_grad(set_to_none=True)
    routes.clear()
    model.double()
    with hf_make.Float64(model) as f64:
        logits, loss = run(model, ids, labels)
        loss.backward()
    assert not f64.low, f"{fam}: f32 ops in the f64 run: {f64.low}"
    for a, b in zip(routes32, [r.sort(-1).values for r in routes]):
        assert torch.equal(a, b), f"{fam}: f64 routes differently from f32"
    assert abs(loss.item() - loss32.item()) < 1e-5 * abs(loss.item())
    out = {"logits": logits.detach().contiguous(),
           "loss": loss.detach().reshape(())}
    out.update(grads_by_name(model, moe, proj))
    assert set(out) == set(out32)
    meta = {"eod_token": str(EOD)}
    save_file(out, os.path.join(d, "golden.safetensors"),
              metadata=dict(meta, compute="F64"))
    save_file(out32, os.path.join(d, "f32.safetensors"),
              metadata=dict(meta, compute="F32"))
    save_file({"input_ids": ids, "labels": labels},
              os.path.join(d, "batch.safetensors"))
    with open(os.path.join(d, "versions.txt"), "w") as f:
        f.write(f"torch {torch.__version__}\n"
                f"transformers {transformers.__version__}\n")
    ndoc = len(list(documents(ids)))
    print(f"{fam}: {ndoc} documents in [{B}, {T}], loss {loss.item():.6f} -> {d}")


def main():
    want = {"qwen3_moe", "deepseek_v3", "qwen3_5_moe"}
    for fam, _cfg, cls, moe, proj in hf_make.families():
        if fam in want:
            make(fam, cls, moe, proj)


if __name__ == "__main__":
    main()
