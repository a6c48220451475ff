#!/usr/bin/env python3
"""hf_make.py -- golden files of Hugging Face transformers for the model
families epjit builds.  Run by hand (it needs torch and transformers from
PyPI); make check reads only the files it writes (t/hf_golden.sh).

    python3 t/golden/hf_make.py [OUTDIR]      (default: t/golden/hf)

Per family, OUTDIR/<family>/ holds:
  config.json, model.safetensors   a tiny random model made by transformers
                                   and written by its save_pretrained (the
                                   Hub's checkpoint names, f32)
  batch.safetensors                input_ids, labels (I64 [B, T]; labels
                                   already shifted: labels[b, t] is the
                                   target of logits[b, t])
  golden.safetensors               logits (F64 [B, T, V]), loss (F64 []),
                                   and NAME.grad (F64) for every
                                   checkpoint tensor NAME: the gradient of
                                   the loss; metadata compute: F64
  f32.safetensors                  the same from transformers' own f32
                                   forward and backward (F32; metadata
                                   compute: F32): t/hf_golden.sh requires
                                   them within its tolerances
  versions.txt                     torch and transformers versions
  sharded/ (mixtral only)          the same model saved in shards of at
                                   most 60 KB with model.safetensors.
                                   index.json, as the Hub holds big models

The checkpoint is f32; the golden values are transformers' forward and
backward of that same model wholly in float64 (model.double(): every f32
weight exactly), so they are the exact values epjit's f32 approximates,
not a second f32 rounding of them.  model.double() alone leaves parts in
f32 -- every RMSNorm, attention's and the routers' softmax, DeepSeek's
routers, V2's rope rotation, Qwen3.5's gated norm and decay -- which put
the goldens up to 5.5e-6 off; the f64 pass runs inside Float64, which
keeps those in f64 and requires that no aten op of the forward or
backward yields an f32 tensor, the rope tables excepted (transformers
defines them in f32, and epjit builds the same f32 values).  Qwen3.5's
gated delta rule, f32 in transformers whatever the dtype, runs as
delta_rule_f64, held to transformers' kernel first.  The script asserts
that the f64 run routes every token to the experts the f32 run chose (no
near-tie flips) and that its loss is within 1e-5 of the f32 run's.
Train mode (no dropout in these configs), eager attention; the loss is
F.cross_entropy of the logits against the labels (not transformers'
labels= path, which shifts them itself).
transformers 5 keeps experts fused in memory (gate_up_proj [E, 2I, H],
down_proj [E, H, I]); their gradients are split here into the per-expert
checkpoint names, and every parameter so mapped is checked to equal the
tensor save_pretrained wrote under that name, so the mapping cannot drift.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "hf")

# Odd sizes where the architecture allows: vocab 97, sequence 7, head_dim
# 10, intermediate 20 / 12.
COMMON = dict(vocab_size=97, hidden_size=40, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6,
              tie_word_embeddings=False, attention_dropout=0.0,
              initializer_range=0.2)
B, T = 2, 7


def families():
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM,
                              DeepseekV3Config, DeepseekV3ForCausalLM,
                              MixtralConfig, MixtralForCausalLM,
                              Qwen2MoeConfig, Qwen2MoeForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    from transformers.models.qwen3_5_moe import (Qwen3_5MoeForCausalLM,
                                                 Qwen3_5MoeTextConfig)
    yield ("qwen3_moe", Qwen3MoeConfig(
        **COMMON, head_dim=10, intermediate_size=28,
        moe_intermediate_size=12, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        Qwen3MoeForCausalLM, "mlp",
        ("gate_proj", "up_proj", "down_proj"))
    yield ("mixtral", MixtralConfig(
        **COMMON, intermediate_size=20, num_local_experts=6,
        num_experts_per_tok=2, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        MixtralForCausalLM, "block_sparse_moe", ("w1", "w3", "w2"))
    # q/k/v bias, a shared expert with its sigmoid gate, layer 1 dense
    yield ("qwen2_moe", Qwen2MoeConfig(
        **COMMON, intermediate_size=28, moe_intermediate_size=12,
        shared_expert_intermediate_size=16, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[1], qkv_bias=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        Qwen2MoeForCausalLM, "mlp", ("gate_proj", "up_proj", "down_proj"))
    # Multi-head latent attention with a q LoRA, v_head_dim 8 != the q/k
    # head 6 + 4, interleaved rope with YaRN (both mscales); layer 0 dense;
    # sigmoid routing with the correction bias (random: a trained
    # checkpoint's), 8 experts in 4 groups, 2 groups kept, top 3,
    # renormalised, times 2.5; one shared expert
    mla = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4,
               kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
               v_head_dim=8, intermediate_size=28, moe_intermediate_size=12,
               n_routed_experts=8, num_experts_per_tok=3,
               first_k_dense_replace=1, n_group=4, topk_group=2)
    yield ("deepseek_v3", DeepseekV3Config(
        **mla, q_lora_rank=12, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                         "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 0.8}),
        DeepseekV3ForCausalLM, "mlp", ("gate_proj", "up_proj", "down_proj"))
    # DeepSeek-V2-Lite's shape: no q LoRA (q_proj), softmax routing with
    # group-limited greedy top-k, times 1.5, not renormalised; two shared
    # experts; linear rope scaling
    yield ("deepseek_v2", DeepseekV2Config(
        **mla, q_lora_rank=None, n_shared_experts=2,
        routed_scaling_factor=1.5, topk_method="group_limited_greedy",
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                         "factor": 2.0}),
        DeepseekV2ForCausalLM, "mlp", ("gate_proj", "up_proj", "down_proj"))
    # Qwen3.5-MoE's text model: Gated DeltaNet layers 0 and 2 (2 key heads
    # of 6, 4 value heads of 5: grouped; a causal conv of 4 taps) around a
    # full-attention layer 1 (gated output, q/k norm, rope on 4 of the 10
    # dimensions of a head); every layer a MoE with a gated shared expert;
    # zero-centred norms
    yield ("qwen3_5_moe", Qwen3_5MoeTextConfig(
        **dict(COMMON, num_hidden_layers=3), head_dim=10,
        layer_types=["linear_attention", "full_attention",
                     "linear_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=6,
        linear_value_head_dim=5, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=12,
        shared_expert_intermediate_size=16, num_experts=6,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.4}),
        Qwen3_5MoeForCausalLM, "mlp", ("gate_proj", "up_proj", "down_proj"))


def ckpt_names(name, p, moe, proj):
    """(checkpoint name, tensor view) pairs of an in-memory parameter (or
    of its gradient, p)."""
    if ".mlp.experts.gate_up_proj" in name:
        pre = name.split(".mlp.experts.")[0] + "." + moe + ".experts."
        inter = p.shape[1] // 2
        for e in range(p.shape[0]):
            yield f"{pre}{e}.{proj[0]}.weight", p[e, :inter]
            yield f"{pre}{e}.{proj[1]}.weight", p[e, inter:]
        return
    if ".mlp.experts.down_proj" in name:
        pre = name.split(".mlp.experts.")[0] + "." + moe + ".experts."
        for e in range(p.shape[0]):
            yield f"{pre}{e}.{proj[2]}.weight", p[e]
        return
    if ".mlp.gate." in name:
        yield name.replace(".mlp.gate.", "." + moe + ".gate."), p
        return
    yield name, p


def delta_rule_f64(query, key, value, g, beta, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False,
                   **kwargs):
    """transformers' gated delta rule (torch_recurrent_gated_delta_rule's
    recurrence) in float64: transformers computes it in f32 even in a
    float64 model, 1.5e-5 off the f64 values at the gradients here (the
    oracle's own rounding, which a golden must not carry);
    check_delta_rule holds it to transformers' own chunked kernel."""
    dt = query.dtype
    _, T, hk, _ = key.shape
    hv = value.shape[-2]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    q, k, v, b, gg = [x.transpose(1, 2).double()
                      for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / (q.shape[-1] ** 0.5)
    S = torch.zeros(*k.shape[:2], k.shape[-1], v.shape[-1],
                    dtype=torch.float64)
    if initial_state is not None:
        S = initial_state.double()
    outs = []
    for i in range(T):
        S = S * gg[:, :, i].exp()[..., None, None]
        kv = (S * k[:, :, i].unsqueeze(-1)).sum(-2)
        delta = (v[:, :, i] - kv) * b[:, :, i].unsqueeze(-1)
        S = S + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((S * q[:, :, i].unsqueeze(-1)).sum(-2))
    o = torch.stack(outs, 2).transpose(1, 2).contiguous().to(dt)
    return o, (S.to(dt) if output_final_state else None)


def check_delta_rule(chunked):
    """delta_rule_f64 against transformers' chunked kernel on random
    inputs of the tiny model's shapes (f32 agreement)."""
    gen = torch.Generator().manual_seed(5)
    B, T, hk, hv, dk, dv = 2, 7, 2, 4, 6, 5
    q = torch.randn(B, T, hk, dk, generator=gen)
    k = torch.randn(B, T, hk, dk, generator=gen)
    v = torch.randn(B, T, hv, dv, generator=gen)
    g = -torch.rand(B, T, hv, generator=gen) * 2
    b = torch.rand(B, T, hv, generator=gen)
    a, _ = chunked(q, k, v, g=g, beta=b, use_qk_l2norm_in_kernel=True)
    r, _ = delta_rule_f64(q, k, v, g, b, use_qk_l2norm_in_kernel=True)
    err = ((a.double() - r.double()).norm() / r.double().norm()).item()
    assert err < 1e-6, f"delta rule: {err} from transformers' kernel"


class Float64:
    """`with Float64(model):` -- an f64 model computes in f64 where
    transformers casts to f32 even then: the RMSNorms (x.to(float32),
    x.float()), attention's and the routers' softmax(dtype=float32),
    DeepSeek's routers (.type(float32)), V2's rope rotation (xq.float()),
    Qwen3.5's gated norm and decay (gate.to(float32), A_log.float()).  A
    cast of an f64 tensor to f32 keeps f64, and softmax(dtype=float32) of
    an f64 tensor is f64.  Not in the rope modules: their tables (inv_freq,
    the angle, cos, sin) are f32 values by transformers' definition, which
    epjit builds the same way (runtime/qwen3.c), inputs of the model like
    its f32 weights.  Every aten op outside them that yields an f32 (or
    complex64, f16, bf16) tensor, forward or backward, is counted in
    .low, which make() requires to be empty (ops that only move values,
    such as a view of V2's complex rope table, are not counted)."""

    LOW = (torch.float32, torch.complex64, torch.float16, torch.bfloat16)
    # ops that move values without rounding them (V2's complex rope table
    # is used through unsqueeze, and conjugated in the backward)
    MOVES = ("unsqueeze", "view", "_conj", "clone", "expand", "detach",
             "alias", "t", "transpose", "permute", "select", "slice",
             "squeeze")

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode
        self.rope = 0
        self.low = {}
        self.saved = {}
        self.hooks = []
        for mod in model.modules():
            if type(mod).__name__.endswith("RotaryEmbedding"):
                self.hooks.append(mod.register_forward_pre_hook(
                    lambda *a: self._rope(1)))
                self.hooks.append(mod.register_forward_hook(
                    lambda *a: self._rope(-1)))
        outer = self

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outs = out if isinstance(out, (tuple, list)) else [out]
                name = func.__name__.split(".")[0]
                for o in outs:
                    if (isinstance(o, torch.Tensor) and outer.rope == 0 and
                            o.dtype in Float64.LOW and
                            name not in Float64.MOVES):
                        k = str(func)
                        outer.low[k] = outer.low.get(k, 0) + 1
                return out

        self.mode = Count()

    def _rope(self, d):
        self.rope += d

    def _wide(self, t, dtype):
        if (self.rope == 0 and t.dtype == torch.float64 and
                dtype in (torch.float32, torch.float, "torch.FloatTensor")):
            return torch.float64
        return dtype

    def __enter__(self):
        T, Fn = torch.Tensor, torch.nn.functional
        to, ty, fl = T.to, T.type, T.float
        sm, tsm = Fn.softmax, T.softmax
        self.saved = {(T, "to"): to, (T, "type"): ty, (T, "float"): fl,
                      (Fn, "softmax"): sm, (T, "softmax"): tsm}
        wide = self._wide

        def to_(t, *a, **k):
            a = [wide(t, x) if isinstance(x, torch.dtype) else x for x in a]
            if "dtype" in k:
                k["dtype"] = wide(t, k["dtype"])
            return to(t, *a, **k)

        def type_(t, dtype=None, *a, **k):
            if dtype is not None and wide(t, dtype) == torch.float64:
                return t
            return ty(t, dtype, *a, **k) if dtype is not None else ty(t)

        def float_(t, *a, **k):
            return t if wide(t, torch.float32) == torch.float64 else \
                fl(t, *a, **k)

        def softmax_(x, *a, dtype=None, **k):
            return sm(x, *a, dtype=wide(x, dtype), **k)

        def tsoftmax_(x, *a, dtype=None, **k):
            return tsm(x, *a, dtype=wide(x, dtype), **k)

        T.to, T.type, T.float = to_, type_, float_
        Fn.softmax, T.softmax = softmax_, tsoftmax_
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for (obj, name), f in self.saved.items():
            setattr(obj, name, f)
        for h in self.hooks:
            h.remove()
        return False


def make(fam, cfg, cls, moe, proj):
    d = os.path.join(OUT, fam)
    os.makedirs(d, exist_ok=True)
    # Qwen3.5-MoE: a well-conditioned draw (transformers' own f32
    # gradients 1.03e-5 from the f64 ones here, 0.30 of t/golden_cmp's
    # tolerance); its Gated DeltaNet puts the f32 gradients of most draws
    # 1e-5 to 3e-4 from the f64 ones (seeds 1 to 11 measured, 1234
    # 7.8e-5), beyond what any f32 implementation can be held to
    torch.manual_seed(6 if fam == "qwen3_5_moe" else 1234)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = cls(cfg).float()
    # the router far from uniform (distinct top-k choices); biases, which
    # transformers initialises to zero, random so that they count
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".gate." in n:
                p.mul_(4.0)
            if n.endswith(".bias"):
                p.normal_(0.0, 0.2)
            # norms that transformers initialises to zeros or ones: random,
            # so that each weight counts (Qwen3.5's are zero-centred)
            if fam == "qwen3_5_moe" and n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
        for n, b in model.named_buffers():
            if n.endswith(".e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.train()
    model.save_pretrained(d, safe_serialization=True)
    if fam == "mixtral":
        model.save_pretrained(os.path.join(d, "sharded"),
                              safe_serialization=True, max_shard_size="60KB")
        assert os.path.exists(os.path.join(d, "sharded",
                                           "model.safetensors.index.json"))
    g = torch.Generator().manual_seed(99)
    seq = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    ids, labels = seq[:, :T].contiguous(), seq[:, 1:].contiguous()

    routes = []

    def hook(mod, inp, out):
        routes.append(out[2].detach().clone())  # the top-k expert indices

    for n, mod in model.named_modules():
        if n.endswith(".mlp.gate"):
            mod.register_forward_hook(hook)

    def run():
        routes.clear()
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return logits, loss, [r.sort(-1).values for r in routes]

    with torch.no_grad():
        _, loss32, routes32 = run()
    # transformers' own f32 forward and backward: how far an f32
    # computation lands from the golden values on this model (printed
    # below, and written as f32.safetensors: t/hf_golden.sh requires its
    # tolerance to accept them)
    logits32, l32, _ = run()
    l32.backward()
    grads32 = {n: p.grad.detach().double().clone()
               for n, p in model.named_parameters() if p.grad is not None}
    out32 = {"logits": logits32.detach().clone(),
             "loss": l32.detach().reshape(()).clone()}
    for n, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        for cn, gv in ckpt_names(n, grad.detach(), moe, proj):
            out32[cn + ".grad"] = gv.clone()
    model.zero_grad(set_to_none=True)
    if fam == "qwen3_5_moe":
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as q35
        check_delta_rule(q35.torch_chunk_gated_delta_rule)
        q35._hf_make_chunk = q35.torch_chunk_gated_delta_rule
        q35.torch_chunk_gated_delta_rule = delta_rule_f64
    model.double()
    with Float64(model) as f64:
        logits, loss, routes64 = run()
        loss.backward()
    assert not f64.low, f"{fam}: f32 ops in the f64 run: {f64.low}"
    assert len(routes64) > 0
    for a, b in zip(routes32, routes64):
        assert torch.equal(a, b), f"{fam}: f64 routes differently from f32"
    assert abs(loss.item() - loss32.item()) < 1e-5 * abs(loss.item())
    out = {"logits": logits.detach().contiguous(),
           "loss": loss.detach().reshape(())}
    saved = safe_open(os.path.join(d, "model.safetensors"), "pt")
    names = set(saved.keys())
    seen = set()
    for n, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        for (cn, pv), (_, gv) in zip(ckpt_names(n, p.detach(), moe, proj),
                                     ckpt_names(n, grad, moe, proj)):
            assert cn in names, f"{fam}: {cn} (from {n}) not in the file"
            assert torch.equal(saved.get_tensor(cn).double(), pv), \
                f"{fam}: {cn} differs from the file"
            out[cn + ".grad"] = gv.contiguous()
            seen.add(cn)
    # buffers in the file (DeepSeek-V3's e_score_correction_bias): state
    # that is not trained, so it has no gradient
    for n, b in model.named_buffers():
        if n in names:
            assert torch.equal(saved.get_tensor(n).double(), b.double()), \
                f"{fam}: buffer {n} differs from the file"
            seen.add(n)
    assert seen == names, f"{fam}: unmapped {sorted(names - seen)[:4]}"
    # how far transformers' own f32 gradients are from the golden ones: the
    # scale of f32 rounding on this model (t/golden_cmp's tolerances are
    # 1.9e-5 to 3.4e-5 on these models)
    worst32 = max(((grads32[n] - p.grad).norm() / p.grad.norm()).item()
                  for n, p in model.named_parameters()
                  if n in grads32 and p.grad.norm() > 0)
    print(f"{fam}: transformers' own f32 gradients: worst {worst32:.2e}")
    assert set(out32) == set(out), f"{fam}: f32 and f64 names differ"
    save_file(out, os.path.join(d, "golden.safetensors"),
              metadata={"compute": "F64"})
    save_file(out32, os.path.join(d, "f32.safetensors"),
              metadata={"compute": "F32"})
    save_file({"input_ids": ids, "labels": labels},
              os.path.join(d, "batch.safetensors"))
    with open(os.path.join(d, "versions.txt"), "w") as f:
        f.write(f"torch {torch.__version__}\n"
                f"transformers {transformers.__version__}\n")
    print(f"{fam}: loss {loss.item():.6f}, {len(names)} tensors -> {d}")


# transformers' auxiliary loss in the aux/ goldens: a coefficient large
# enough that the loss moves every router gradient by 5 to 13% (0.001,
# the configs' default, moves them by 0.05%)
AUX_COEF = 0.1
# the families whose modeling code adds an auxiliary loss (DeepSeek-V2/V3
# in transformers have none: output_router_logits only returns the logits)
AUX_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "qwen3_5_moe")


def load_balancing_f64(gate_logits, num_experts=None, top_k=2,
                       attention_mask=None):
    """transformers' load_balancing_loss_func with float64 accumulators:
    transformers sums the counts and divides them in f32 even for a
    float64 model (6e-8 off the exact value; a golden must not carry it);
    check_load_balancing holds it to transformers' own function."""
    dev = gate_logits[0].device
    tok = torch.zeros(num_experts, dtype=torch.float64, device=dev)
    prob = torch.zeros(num_experts, dtype=torch.float64, device=dev)
    rows = 0.0
    if attention_mask is not None:
        mask = attention_mask.reshape(-1).to(dev, torch.float64)
    for g in gate_logits:
        w = F.softmax(g.double(), dim=-1)
        _, sel = torch.topk(w, top_k, dim=-1)
        m = mask if attention_mask is not None else \
            torch.ones(w.shape[0], dtype=torch.float64, device=dev)
        tok = tok + torch.zeros(num_experts, dtype=torch.float64,
                                device=dev).scatter_add_(
            0, sel.reshape(-1), m.repeat_interleave(top_k))
        prob = prob + (w * m.unsqueeze(-1)).sum(dim=0)
        rows = rows + m.sum()
    return torch.sum((tok / rows) * (prob / rows).unsqueeze(0)) * \
        num_experts


def check_load_balancing(lb):
    """load_balancing_f64 against transformers' own function on random
    router logits (3 layers of 2 x 7 tokens, 6 experts, top 2), with and
    without an attention mask (f32 agreement)."""
    gen = torch.Generator().manual_seed(7)
    logits = tuple(torch.randn(14, 6, generator=gen, dtype=torch.float64)
                   * 3 for _ in range(3))
    mask = torch.ones(2, 7)
    mask[1, 5:] = 0
    for am in (None, mask):
        a = lb(logits, 6, 2, am).double()
        r = load_balancing_f64(logits, 6, 2, am)
        assert abs((a - r).item()) < 1e-6 * abs(r.item()), \
            f"load_balancing_f64: {r.item()} against {a.item()}"


def make_aux(fam, cls, moe, proj):
    """OUTDIR/<fam>/aux/: the same model and batch with transformers'
    auxiliary loss on (config.json: output_router_logits true,
    router_aux_loss_coef AUX_COEF); golden.safetensors and f32.safetensors
    hold the logits, the loss F.cross_entropy + AUX_COEF * aux_loss (the
    sum transformers' labels= path returns: checked here) and every
    gradient of it, as make() writes them."""
    import importlib
    d = os.path.join(OUT, fam)
    da = os.path.join(d, "aux")
    os.makedirs(da, exist_ok=True)
    cfg = cls.config_class.from_pretrained(d)
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = AUX_COEF
    cfg.save_pretrained(da)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    mod = importlib.import_module(cls.__module__)
    delta = getattr(mod, "torch_chunk_gated_delta_rule", None)
    if delta is delta_rule_f64:  # make() left it patched: f32 first
        mod.torch_chunk_gated_delta_rule = mod.__dict__["_hf_make_chunk"]
    model = cls.from_pretrained(d, config=cfg).float()
    model.train()
    batch = safe_open(os.path.join(d, "batch.safetensors"), "pt")
    ids, labels = batch.get_tensor("input_ids"), batch.get_tensor("labels")

    def run():
        out = model(input_ids=ids)
        ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
        return out.logits, ce + AUX_COEF * out.aux_loss

    with torch.no_grad():
        o = model(input_ids=ids, labels=ids)
        ce = F.cross_entropy(o.logits[:, :-1].flatten(0, 1),
                             ids[:, 1:].flatten())
        assert abs(o.loss - ce - AUX_COEF * o.aux_loss).item() < 1e-6, \
            f"{fam}: transformers' loss is not CE + coef * aux_loss"
    files = {}
    for compute in ("F32", "F64"):
        lb = mod.load_balancing_loss_func
        if compute == "F64":
            check_load_balancing(lb)
            mod.load_balancing_loss_func = load_balancing_f64
            if delta is not None:
                mod.torch_chunk_gated_delta_rule = delta_rule_f64
            model.double()
            with Float64(model) as f64:
                logits, loss = run()
                loss.backward()
            assert not f64.low, f"{fam} aux: f32 ops in the f64 run: " \
                f"{f64.low}"
            mod.load_balancing_loss_func = lb
        else:
            logits, loss = run()
            loss.backward()
        out = {"logits": logits.detach().contiguous(),
               "loss": loss.detach().reshape(())}
        for n, p in model.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            for cn, gv in ckpt_names(n, grad.detach(), moe, proj):
                out[cn + ".grad"] = gv.contiguous().clone()
        model.zero_grad(set_to_none=True)
        files[compute] = out
    a, b = files["F64"]["loss"].item(), files["F32"]["loss"].item()
    assert abs(a - b) < 1e-5 * abs(a), f"{fam} aux: f32 loss {b} vs {a}"
    save_file(files["F64"], os.path.join(da, "golden.safetensors"),
              metadata={"compute": "F64"})
    save_file(files["F32"], os.path.join(da, "f32.safetensors"),
              metadata={"compute": "F32"})
    print(f"{fam} aux: loss {a:.6f} (router_aux_loss_coef {AUX_COEF}) "
          f"-> {da}")


def main():
    for fam, cfg, cls, moe, proj in families():
        make(fam, cfg, cls, moe, proj)
        if fam in AUX_FAMILIES:
            make_aux(fam, cls, moe, proj)


if __name__ == "__main__":
    main()
