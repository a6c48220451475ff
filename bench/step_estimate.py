#!/usr/bin/env python3
"""bench/step_estimate.py -- what one training step of an EP-16 rank would
take on an H200, kernel by kernel, from figures of the kernels themselves.

No GPU is needed.  For every hot kernel of a Qwen3-30B-A3B layer (and the
per-kernel rows at DeepSeek-V3's shapes) it prints: the registers and stack
frame ptxas gives it at sm_90 (read from the `ptxas` Check suite of a build
tree, as t/check_ptxas.c compiles it), the blocks an SM holds by registers,
the grid the host launches at these shapes (the geometry of kernels/*.c,
mirrored below: change both together), FLOPs and bytes moved against the
minimum, and an estimate of its time:

    t = max(FLOPs / (peak x eff), bytes / (HBM x eff_mem)) / fill + launch

with the assumptions stated next to each number below (ASSUME).  Then it
adds up a step at EP 16, micro-batch 1 x 1024, 48 layers, bf16, activation
checkpointing (the forward runs twice), and prints it against the roofline
(every kernel at peak compute or peak bandwidth, whichever binds).

    python3 bench/step_estimate.py [--build DIR]

--build: a configured and built tree with NVRTC (default: build); without
one (or without NVRTC) the register columns say n/a and the estimate uses
the full occupancy.  The all-to-all and the optimizer's communication are
not counted: this is the compute of one rank.
"""
import argparse
import math
import os
import re
import subprocess
import sys

# ---- the H200 (SXM) ---------------------------------------------------------
SMS = 132
TC_PEAK = 989.4e12  # dense bf16 tensor-core FLOP/s
FMA_PEAK = 66.9e12  # f32 FMA FLOP/s (no tensor cores)
HBM = 4.8e12  # bytes/s
REGS_PER_SM = 65536
LAUNCH_S = 3e-6  # ASSUME: a launch in a stream, no CUDA graph

# ASSUME: the fraction of peak each kind of kernel reaches when it fills the
# GPU.  cuBLASLt GEMMs at these shapes: 0.70.  mma.sync m16n8k16 (no wgmma)
# on Hopper issues at most about 2/3 of the wgmma rate and flash attention
# written this way reaches about 0.35-0.45 of the dense peak forward, less
# backward: 0.40 / 0.30.  The FMA attention: what the issue read off its
# SASS (shared-load bound, 8-12 TFLOP/s): 0.15 of the FMA peak.
EFF = {"lt": 0.70, "mma_fwd": 0.40, "mma_bwd": 0.30, "fma": 0.15}
# ASSUME: the fraction of HBM bandwidth a memory-bound kernel reaches by the
# width of its accesses (16-byte vectors vs 2-byte elements).
EFF_MEM = {16: 0.80, 8: 0.60, 4: 0.40, 2: 0.25}


def ptxas_facts(build):
    """{(unit, kernel): (regs, stack)} from the ptxas suite's table."""
    exe = os.path.join(build, "t", "check_epjit")
    if not os.access(exe, os.X_OK):
        return {}
    env = dict(os.environ, CK_FORK="no", CK_RUN_SUITE="ptxas",
               CK_RUN_CASE="templates", top_srcdir="..", top_builddir=".")
    try:
        out = subprocess.run([os.path.abspath(exe)], cwd=build, env=env,
                             capture_output=True, text=True,
                             timeout=900).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    facts = {}
    for line in out.splitlines():
        m = re.match(r"^(\S.*?)\s+(ej_\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)",
                     line)
        if m:
            facts[(m.group(1).strip(), m.group(2))] = (int(m.group(3)),
                                                       int(m.group(4)))
    return facts


def blocks_per_sm(regs, threads, smem=0):
    if regs is None:
        return None
    per_block = ((regs + 7) // 8 * 8) * threads
    b = REGS_PER_SM // per_block if per_block else 32
    b = min(b, 2048 // threads, 32)
    if smem:
        b = min(b, (227 * 1024) // smem)
    return max(b, 0)


class K:
    """One kernel launch (or a library call) at one shape."""

    def __init__(self, name, sym, unit, kind, flops, bytes_min, bytes_moved,
                 grid, threads, width=16, smem=0, calls=1, flops_min=None):
        self.__dict__.update(locals())
        del self.__dict__["self"]
        if flops_min is None:
            self.flops_min = flops

    def time(self, facts):
        regs = stack = None
        f = facts.get((self.unit, self.sym)) if self.unit else None
        if f:
            regs, stack = f
        bps = blocks_per_sm(regs, self.threads, self.smem) if regs else None
        fill = 1.0
        if self.grid and bps:
            fill = min(1.0, self.grid / (SMS * bps))
        if self.kind == "mem":
            tc = 0.0
        elif self.kind == "fma":
            tc = self.flops / (FMA_PEAK * EFF["fma"])
        else:
            tc = self.flops / (TC_PEAK * EFF[self.kind])
        tm = self.bytes_moved / (HBM * EFF_MEM[self.width])
        t = max(tc, tm) / max(fill, 1e-3) + LAUNCH_S
        roof = max(self.flops_min / TC_PEAK, self.bytes_min / HBM)
        return t * self.calls, roof * self.calls, regs, stack, bps

    def row(self, facts):
        t, roof, regs, stack, bps = self.time(facts)
        na = "n/a"
        return ("| %s | %s | %s | %s | %s | %s | %.2f | %.1f / %.1f | "
                "%.3f | %.3f |" % (
                    self.name + (" (x%d)" % self.calls
                                 if self.calls > 1 else ""),
                    self.sym or ("(cuBLASLt)" if self.kind == "lt" else
                                 "(fused region)"),
                    na if regs is None else regs,
                    na if stack is None else stack,
                    na if bps is None else bps,
                    self.grid or "lib", self.flops / 1e9,
                    self.bytes_moved / 1e6, self.bytes_min / 1e6,
                    t * 1e3, roof * 1e3))


def gemm(name, m, n, k, calls=1):
    """A bf16 GEMM through cuBLASLt: out [m, n] = a [m, k] b [k, n]."""
    b = 2 * (m * k + k * n + m * n)
    return K(name, None, None, "lt", 2.0 * m * n * k, b, b, 0, 0,
             calls=calls)


def attention(tag, B, Hq, Hkv, T, D, Dv, tc):
    """Causal flash attention, forward and backward, as kernels/
    tmpl_attention.c launches it (bench/RESULTS.md, the attention kernels
    at sm_90: shared memory and grids)."""
    work = B * Hq * T * T / 2  # causal: half the score matrix
    # forward: S = Q K^T (D) and P V (Dv).  dq: S again, dP = dO V^T (Dv),
    # dS K (D).  dk/dv up to head dim 128 in one pass (S^T, dP^T, P^T dO,
    # dS^T Q); past it in two passes of one accumulator each: dv (S, P^T
    # dO) and dk (S, dP, dS^T Q).
    f_fwd = 2.0 * work * (D + Dv)
    f_dq = 2.0 * work * (2 * D + Dv)
    f_dv = 2.0 * work * (D + Dv)
    f_dk = 2.0 * work * (2 * D + Dv)
    io = 2 * (B * Hq * T * D + B * Hkv * T * (D + Dv) + B * Hq * T * Dv)
    unit = "attention bf16 hd<=%d" % (32 * math.ceil(max(D, Dv) / 32))
    rows = []
    if tc:
        g = B * Hq * math.ceil(T / 64)  # 64 queries (or keys) a block
        sm_f = (51 if D <= 128 else 46) * 1024
        sm_b = (68 if D <= 128 else 63) * 1024
        rows.append(K("attention fwd " + tag, "ej_attn_fwd_tc", unit,
                      "mma_fwd", f_fwd, io, io, g, 128, smem=sm_f))
        rows.append(K("attention bwd dq " + tag, "ej_attn_bwd_dq_tc", unit,
                      "mma_bwd", f_dq, io, 2 * io, g, 128, smem=sm_b))
        # the minimum backward is 3 D + 2 Dv (S once, dV, dP, dQ, dK): the
        # dq kernel's own, dV's and dK's products; the passes' recomputed S
        # count against the kernels, not the roofline
        if max(D, Dv) <= 128:
            rows.append(K("attention bwd dk/dv " + tag,
                          "ej_attn_bwd_dkdv1_tc", unit, "mma_bwd",
                          2.0 * work * (2 * D + 2 * Dv), io, 2 * io, g, 128,
                          smem=sm_b, flops_min=2.0 * work * (D + Dv)))
        else:
            rows.append(K("attention bwd dv pass " + tag,
                          "ej_attn_bwd_dkdv_tc", unit, "mma_bwd", f_dv, io,
                          2 * io, g, 128, smem=sm_b,
                          flops_min=2.0 * work * Dv))
            rows.append(K("attention bwd dk pass " + tag,
                          "ej_attn_bwd_dkdv_tc", unit, "mma_bwd", f_dk, io,
                          2 * io, g, 128, smem=sm_b,
                          flops_min=2.0 * work * D))
        if Hq > Hkv:  # f32 partials per query head, summed in head order
            part = 4 * B * Hq * T * (D + Dv)
            rows.append(K("attention bwd kv sum " + tag,
                          "ej_attn_bwd_kv_sum", unit, "mem", 0,
                          2 * B * Hkv * T * (D + Dv), 2 * part,
                          B * Hkv * T, 128, width=4))
    else:
        g = B * Hq * math.ceil(T / 16)
        unit = "attention bf16 hd<=128"
        rows.append(K("attention fwd (FMA) " + tag, "ej_attn_fwd", unit,
                      "fma", f_fwd, io, io, g, 128))
        rows.append(K("attention bwd dq (FMA) " + tag, "ej_attn_bwd_dq",
                      unit, "fma", f_dq, io, 2 * io, g, 128))
        rows.append(K("attention bwd dk/dv (FMA) " + tag,
                      "ej_attn_bwd_dkdv", unit, "fma", 2.0 * work * (
                          2 * D + 2 * Dv), io, 2 * io,
                      B * Hkv * math.ceil(T / 16), 128))
    return rows


def moe_kernels(tag, N, H, I, k, E_local, fwd=True):
    """The AutoEP layer's own kernels on one rank (bf16 rows)."""
    R = N * k  # routed rows: at EP 16 with balanced routing a rank
    # receives as many rows as it sends
    rows = []
    if fwd:
        rows.append(K("router softmax+top-k " + tag, "ej_moe_route", "moe",
                      "mem", 0, N * 128 * 4, N * 128 * 8, math.ceil(N / 4),
                      128, width=4))
        rows.append(K("sort (count, scan, scatter) " + tag,
                      "ej_moe_sort_count", "moe", "mem", 0, R * 16, R * 40,
                      math.ceil(R / 256), 256, width=8, calls=1))
        rows.append(K("permute " + tag, "ej_moe_permute", "moe", "mem", 0,
                      2 * R * H * 2, 2 * R * H * 2, R, 256))
        rows.append(K("SwiGLU fwd " + tag, "ej_swiglu_fwd", "moe", "mem", 0,
                      3 * R * I * 2, 3 * R * I * 2, SMS * 8, 256))
        rows.append(K("combine " + tag, "ej_moe_combine", "moe", "mem", 0,
                      (R + N) * H * 2, (R + N) * H * 2, N, 256))
    else:
        rows.append(K("combine bwd (dy) " + tag, "ej_moe_combine_bw_y",
                      "moe", "mem", 0, (R + N) * H * 2, (R + N) * H * 2, R,
                      256))
        rows.append(K("combine bwd (dw) " + tag, "ej_moe_combine_bw_w",
                      "moe", "mem", 0, (R + N) * H * 2, (R + N) * H * 2,
                      math.ceil(R / 4), 128, width=2))
        rows.append(K("SwiGLU bwd " + tag, "ej_swiglu_bwd", "moe", "mem", 0,
                      5 * R * I * 2, 5 * R * I * 2, SMS * 8, 256))
        rows.append(K("permute bwd " + tag, "ej_moe_permute_bw", "moe",
                      "mem", 0, (R + N) * H * 2, (R + N) * H * 2, N, 256))
        rows.append(K("router bwd " + tag, "ej_moe_route_bw", "moe", "mem",
                      0, N * 128 * 8, N * 128 * 8, math.ceil(N / 4), 128,
                      width=4))
    return rows


def fused(name, elems_in, elems_out, N):
    """A fused pointwise/norm region kernel of the compiler (bf16)."""
    b = 2 * (elems_in + elems_out)
    return K(name, None, None, "mem", 0, b, b, N, 256)


def qwen3_layer(N=1024, H=2048, Hq=32, Hkv=4, D=128, I=768, E=128, k=8,
                ep=16, tc=True):
    """Forward and backward kernel lists of one Qwen3-MoE decoder layer on
    one rank (N tokens)."""
    E_loc = E // ep
    R = N * k
    qkv = (Hq + 2 * Hkv) * D
    fwd = [fused("RMSNorm (input)", N * H, N * H, N),
           gemm("QKV projection", N, qkv, H),
           fused("q/k norm + RoPE", N * qkv, N * qkv, N)]
    fwd += [r for r in attention("qwen3", 1, Hq, Hkv, N, D, D, tc)
            if "fwd" in r.name]
    fwd += [gemm("o_proj", N, H, Hq * D),
            fused("residual + RMSNorm", 2 * N * H, 2 * N * H, N),
            gemm("router", N, E, H)]
    fwd += moe_kernels("", N, H, I, k, E_loc, fwd=True)
    # the experts: three grouped GEMMs (cuBLAS's grouped batched GEMM
    # through cuBLASLt's handle, kernels/tmpl_gemm.c)
    fwd += [gemm("experts gate, up (grouped)", R, I, H, calls=2),
            gemm("experts down (grouped)", R, H, I),
            fused("residual add", 2 * N * H, N * H, N)]
    bwd = [gemm("experts down dX+dW", R, I, H, calls=2),
           gemm("experts gate, up dX+dW", R, H, I, calls=4)]
    bwd += moe_kernels("", N, H, I, k, E_loc, fwd=False)
    bwd += [gemm("router dX+dW", N, H, E, calls=2),
            fused("RMSNorm bwd (post)", 3 * N * H, 2 * N * H, N),
            gemm("o_proj dX+dW", N, Hq * D, H, calls=2)]
    bwd += [r for r in attention("qwen3", 1, Hq, Hkv, N, D, D, tc)
            if "bwd" in r.name]
    bwd += [fused("q/k norm + RoPE bwd", 2 * N * qkv, N * qkv, N),
            gemm("QKV dX+dW", N, H, qkv, calls=2),
            fused("RMSNorm bwd (input)", 3 * N * H, 2 * N * H, N)]
    return fwd, bwd


def table(rows, facts, title):
    print("\n### " + title + "\n")
    print("| kernel | symbol | regs | stack | blocks/SM | grid | GFLOP | "
          "MB moved / min | est. ms | roofline ms |")
    # GFLOP and MB: one call's, what the kernel computes (recomputation
    # included); the times: all its calls; roofline: the minimum FLOPs at
    # peak or the minimum bytes at full bandwidth, whichever binds
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    t_sum = r_sum = 0.0
    for r in rows:
        print(r.row(facts))
        t, roof, *_ = r.time(facts)
        t_sum += t
        r_sum += roof
    print("| **total** | | | | | | | | **%.3f** | **%.3f** |" %
          (t_sum * 1e3, r_sum * 1e3))
    return t_sum, r_sum


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--layers", type=int, default=48)
    a = ap.parse_args()
    facts = ptxas_facts(a.build)
    if not facts:
        print("note: no ptxas facts (no build with NVRTC at %s): registers "
              "n/a, full occupancy assumed" % a.build)
    print("H200: %d SMs, %.0f TFLOP/s bf16 dense, %.1f TB/s HBM; efficiencies"
          " %s, memory by access width %s, %.0f us a launch" %
          (SMS, TC_PEAK / 1e12, HBM / 1e12, EFF, EFF_MEM, LAUNCH_S * 1e6))

    fwd, bwd = qwen3_layer(tc=True)
    tf, rf = table(fwd, facts, "Qwen3-30B-A3B layer forward, EP 16, 1 x 1024"
                   " tokens a rank, bf16")
    tb, rb = table(bwd, facts, "Qwen3-30B-A3B layer backward")
    fwd_old, bwd_old = qwen3_layer(tc=False)
    old = [r for r in fwd_old + bwd_old if "attention" in r.name]
    to, ro = table(old, facts, "the FMA attention kernels at the same "
                   "shapes (before tensor cores)")
    L = a.layers
    # the head: embedding, final norm, LM head (vocab 151936) and its loss
    V, H, N = 151936, 2048, 1024
    head = [gemm("LM head", N, V, H), gemm("LM head dX+dW", N, H, V, calls=2),
            K("cross-entropy fwd+bwd", "ej_ce_rows", "embedding", "mem", 0,
              2 * N * V * 4, 3 * N * V * 4, N, 256)]
    th, rh = table(head, facts, "head (once a step)")
    # optimizer: AdamW over this rank's parameters, f32 master and moments
    # (ZeRO 1 over the data-parallel group is not counted: worst case)
    p_dense = L * (H * (32 + 8) * 128 + 32 * 128 * H + H * 128 + 2 * H) \
        + 2 * V * H
    p_exp = L * (128 // 16) * 3 * H * 768
    P = p_dense + p_exp
    opt = [K("AdamW step (%.2fB params)" % (P / 1e9), "ej_optim_step",
             "optim", "mem", 0, P * 22, P * 22, SMS * 16, 256)]
    tp, rp = table(opt, facts, "optimizer (once a step)")
    step = L * (2 * tf + tb) + th
    roof = L * (2 * rf + rb) + rh
    print("\n### step (EP 16, 1 x 1024, %d layers, checkpointing: forward "
          "twice)\n" % L)
    print("| part | est. ms | roofline ms |")
    print("|---|---:|---:|")
    print("| layers: %d x (2 x %.3f fwd + %.3f bwd) | %.1f | %.1f |" %
          (L, tf * 1e3, tb * 1e3, L * (2 * tf + tb) * 1e3,
           L * (2 * rf + rb) * 1e3))
    print("| head | %.1f | %.1f |" % (th * 1e3, rh * 1e3))
    print("| **compute** | **%.1f** | **%.1f** |" % (step * 1e3, roof * 1e3))
    print("| optimizer | %.1f | %.1f |" % (tp * 1e3, rp * 1e3))
    print("\ncompute estimate / roofline: %.2fx (goal: at most 2x)" %
          (step / roof))
    old_att = L * (2 * sum(r.time(facts)[0] for r in old if "fwd" in r.name)
                   + sum(r.time(facts)[0] for r in old if "bwd" in r.name))
    new_att = L * (2 * sum(r.time(facts)[0] for r in fwd if "attention" in
                           r.name) +
                   sum(r.time(facts)[0] for r in bwd if "attention" in r.name))
    print("attention in the step: %.1f ms on tensor cores, %.1f ms with the "
          "FMA kernels" % (new_att * 1e3, old_att * 1e3))

    # DeepSeek-V3's shapes, per kernel (MLA: q/k 192, v 128; 128 heads)
    ds = attention("deepseek-v3", 1, 128, 128, 1024, 192, 128, True)
    ds += moe_kernels("deepseek-v3", 1024, 7168, 2048, 8, 256 // 16)
    ds += [gemm("experts gate+up (grouped) deepseek-v3", 8192, 4096, 7168),
           gemm("experts down (grouped) deepseek-v3", 8192, 7168, 2048)]
    table(ds, facts, "DeepSeek-V3 shapes (one layer's hot kernels, "
          "forward and attention backward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
