"""MoE and hyper-connection kernel benchmarks: grouped routed-expert matmuls at decode batch sizes and the fused
mHC mixes + Sinkhorn. Imported by benchmarks/kernels.py after kbench.configure()."""
import math

import torch

from deepinfer_sg.kernels import hc_mix, moe
from kbench import DEV, DRY, rotating, row, S, time_ms


def bench_moe(bw, l2, batches):
    H, F, E, K = S(2048, 64), S(1024, 32), S(64, 4), S(6, 2)
    for T in batches:
        def make():
            scores = torch.rand(T, E, device=DEV)
            ids = scores.topk(K, 1).indices
            return (torch.randn(T, H, device=DEV, dtype=torch.bfloat16), ids,
                    torch.rand(T, K, device=DEV),
                    torch.randn(E, F, H, device=DEV, dtype=torch.bfloat16) * 0.05,
                    torch.randn(E, F, H, device=DEV, dtype=torch.bfloat16) * 0.05,
                    torch.randn(E, H, F, device=DEV, dtype=torch.bfloat16) * 0.05)
        nxt = rotating(make, 3 * E * F * H * 2, l2)
        s = nxt()
        touched = int(torch.unique(s[1]).numel())
        nbytes = touched * 3 * F * H * 2 + 2 * T * H * 2
        a = moe.moe_experts_triton(*s)
        b = moe.moe_experts_torch(*s)
        err = float((a.float() - b.float()).norm() / b.float().norm())
        t = time_ms(lambda: moe.moe_experts_triton(*nxt()))
        tt = time_ms(lambda: moe.moe_experts_torch(*nxt()), graph=False)
        row("moe experts", f"T={T} H={H} F={F} E={E} K={K}", t, tt, nbytes, bw,
            f"{touched} experts touched; rel err {err:.1e}")
        t = time_ms(lambda: moe.moe_experts_triton(*nxt(), block_k=64, num_warps=8))
        row("  moe no-spill tiles", f"T={T} bk=64 w=8", t, None, nbytes, bw, "sm_90 build without spills")


def bench_hc(bw, l2, batches):
    M, H = 4, S(5120, 64)
    for T in batches:
        nz = (2 + M) * M

        def make():
            return (torch.randn(T, M, H, device=DEV, dtype=torch.bfloat16),
                    torch.randn(nz, M * H, device=DEV) / math.sqrt(M * H), torch.randn(nz, device=DEV),
                    torch.rand(3, device=DEV) + 0.5)
        nbytes = T * M * H * 2 + nz * M * H * 4
        nxt = rotating(make, nbytes, l2)
        s = nxt()
        parts = hc_mix.split_fn_bf16(s[1])       # once per layer in an engine; built outside the timed region
        a = hc_mix.hc_mixes_triton(*s, fn_parts=parts)
        b = hc_mix.hc_mixes_torch(*s)
        err = max(float((a.comb - b.comb).abs().max()), float((a.pre - b.pre).abs().max()))
        t = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), fn_parts=parts))
        tt = time_ms(lambda: hc_mix.hc_mixes_torch(*nxt()))
        row("hc mixes + sinkhorn", f"T={T} M={M} H={H}", t, tt, nbytes, bw,
            f"max abs err {err:.1e}; bf16x3 split-fn products (fn parts cached)")
        if not DRY:
            tp = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), fn_parts=parts, only_partial=True))
            ti = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), precision="ieee"))
            row("  hc streaming pass", f"T={T} M={M} H={H}", tp, None, nbytes, bw,
                f"(whole op with D's fp32 FMA dot instead: {ti * 1e3:.1f} us)")


def sweep(bw, l2):
    """Launch-parameter variants of the MoE and mHC kernels."""
    T, H, F, E, K = S(64, 5), S(2048, 64), S(1024, 32), S(64, 4), S(6, 2)

    def make_moe():
        return (torch.randn(T, H, device=DEV, dtype=torch.bfloat16), torch.rand(T, E, device=DEV).topk(K, 1).indices,
                torch.rand(T, K, device=DEV), torch.randn(E, F, H, device=DEV, dtype=torch.bfloat16) * 0.05,
                torch.randn(E, F, H, device=DEV, dtype=torch.bfloat16) * 0.05,
                torch.randn(E, H, F, device=DEV, dtype=torch.bfloat16) * 0.05)
    nxt = rotating(make_moe, 3 * E * F * H * 2, l2)
    for bn, bk, warps, stages in ((64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4),
                                  (32, 128, 4, 3), (32, 256, 4, 3)):
        t = time_ms(lambda: moe.moe_experts_triton(*nxt(), block_n=bn, block_k=bk, num_warps=warps,
                                                   num_stages=stages))
        row("  sweep moe", f"T={T} bn={bn} bk={bk} w={warps} st={stages}", t, None, 3 * E * F * H * 2, bw)
    M, H = 4, S(5120, 64)
    for T in S((64, 256), (5,)):
        nz = (2 + M) * M

        def make_hc():
            return (torch.randn(T, M, H, device=DEV, dtype=torch.bfloat16),
                    torch.randn(nz, M * H, device=DEV) / math.sqrt(M * H), torch.randn(nz, device=DEV),
                    torch.rand(3, device=DEV) + 0.5)
        nxt = rotating(make_hc, T * M * H * 2, l2)
        for bt, split in ((16, 512), (16, 1024), (32, 512), (64, 2048), (16, 2048)):
            t = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), block_t=bt, split=split, only_partial=True))
            t2 = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), block_t=bt, split=split))
            row("  sweep hc partial", f"T={T} bt={bt} split={split}", t, None, T * M * H * 2 + nz * M * H * 4, bw,
                f"with mix kernel: {t2 * 1e3:.1f} us")


def compile_cases():
    """(name, kernel, extra pointer types, constexprs, warps) for kernels.py --compile-check."""
    return [
        ("moe gate/up", moe._gate_up_kernel, {}, dict(BM=16, BN=64, BK=64, F32=False), 8),
        ("moe down", moe._down_kernel, dict(y_ptr="*fp32"), dict(BM=16, BN=64, BK=64, F32=False), 8),
        ("hc partial bf16x3", hc_mix._hc_partial_kernel, dict(fn_ptr="*bf16"),
         dict(BT=16, NZP=32, BK=64, SPLIT=2048, PRECISION="ieee", SPLIT_FN=True, UPCAST=False), 4),
    ]
