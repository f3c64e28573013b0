"""The projections that read a layer's attention-norm output as ONE matrix product on the batched decode path.

Why: at decode batch sizes every small projection is one GEMM launch of ~5-6 us on the H200 whatever its size
(latency, not bytes), and xn = attn_norm(read-out) feeds up to five of them per layer: `wq_a`, `wkv`, the index
head weights (`indexer.weights_proj`, index-source layers) and the in-graph compressor's `wkv` / `wgate`
(engine/compress_step.py). One GEMM over their stacked weights gives the same columns.

How, without a second copy of the weights: `fuse(model)` (once, and again whenever a weight was replaced: loads,
casts, moves) stacks the weights into one tensor and points each Linear's weight at its row block of it
(`weight.data = stacked[a:b]`), so the parameters, their names and `state_dict()` stay as they are and writes
through them (a load into the parameter) land in the stacked tensor. Not done for Linears with a bias or hooks
(`quant_sim` hooks their inputs) or weights of another dtype / device / width / kind (e.g. kept FP8).
The model calls it before a fast step's graphs are captured; it drops the graphs when a weight moved.
Results: the same products, with the GEMM library free to sum in another order than the separate products did
(bf16 round-off; the reference path and the transformers oracle are compared with tolerances; graph replays still
equal eager steps bit for bit). Measured (R2 of session 6, mid-size V4.1, bf16, H200, graphs path, same run):
7.55 / 11.41 ms per decode step at batch 8 / 64 stacked vs 7.84 / 11.66 ms one GEMM each (device kernel time
5.53 / 7.66 vs 5.70 / 7.81 ms).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import compress_step


def xn_linears(model, attn) -> list[nn.Linear]:
    """The Linears reading a layer's attention-norm output on the batched path, in stacking order."""
    mods = [attn.wq_a, attn.wkv]
    if attn.spec.index_source == attn.layer_id and hasattr(getattr(attn, "indexer", None), "weights_proj"):
        mods.append(attn.indexer.weights_proj)
    if attn.layer_id in compress_step.graph_layers(model):
        comp = attn.compressor
        mods += [comp.wkv, comp.wgate] if comp.gated else [comp.wkv]
    return mods


def _stackable(mods) -> bool:
    ws = [m.weight for m in mods]
    return (all(type(m) is nn.Linear and m.bias is None and not m._forward_pre_hooks and not m._forward_hooks
                for m in mods)
            and all(type(w.data) is torch.Tensor and w.dtype in (torch.float32, torch.bfloat16, torch.float16)
                    and not w.is_meta for w in ws)
            and len({(w.dtype, w.device, w.shape[1]) for w in ws}) == 1)


def fuse(model) -> bool:
    """Stack every layer's xn projections (module docstring) where they are not stacked as they stand.
    -> whether a weight moved (the caller drops its captured graphs). Cost: a check of ~5 addresses per layer;
    a stacking copies those weights once."""
    moved = False
    for blk in model.layers:
        attn = blk.attn
        mods = xn_linears(model, attn)
        ptrs = [m.weight.data_ptr() for m in mods]
        got = attn.__dict__.get("_xn_stacked")
        if got is not None and got[0] == ptrs:
            continue
        if len(mods) < 2 or not _stackable(mods):
            attn.__dict__["_xn_stacked"] = (ptrs, None, None)
            continue
        with torch.no_grad(), torch.inference_mode(False):   # (a normal tensor, as the parameters are)
            stacked = torch.cat([m.weight.detach() for m in mods])
            at = 0
            for m in mods:
                n = m.weight.shape[0]
                m.weight.data = stacked[at:at + n]
                at += n
        attn.__dict__["_xn_stacked"] = ([m.weight.data_ptr() for m in mods], stacked, [m.out_features for m in mods])
        moved = True
    return moved


def xn_products(model, attn, xn: torch.Tensor) -> list | None:
    """The stacked projections of xn [T, H], split per Linear (views: column blocks of one [T, sum] product), in
    `xn_linears` order; None when this layer's are not stacked as the weights stand now (the caller runs them one
    by one). (Runs when a step is eager or captured, not on graph replays: the address checks cost nothing then.)"""
    got = attn.__dict__.get("_xn_stacked")
    if got is None or got[1] is None or got[0] != [m.weight.data_ptr() for m in xn_linears(model, attn)]:
        return None
    return list(F.linear(xn, got[1]).split(got[2], dim=-1))
