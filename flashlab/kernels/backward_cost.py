"""The backward kernels' ``pl.CostEstimate`` (what XLA's scheduler and the profiler's
roofline read of each ``pallas_call``), from the grids of
:mod:`flashlab.kernels.backward_grid`."""
from __future__ import annotations

import numpy as np

from flashlab.compat import pallas as compat
from flashlab.kernels.backward_grid import BackwardGridSpec

__all__ = ["cost_estimate"]


def cost_estimate(gs: BackwardGridSpec, kernel: str):
    """The ``pl.CostEstimate`` of one backward kernel (``kernel``: "dkdv", "dq" or "dbias"):
    FLOPs, exps and HBM bytes counting only the computed tiles (static skipping)."""
    cfg = gs.config
    bh = cfg.batch * cfg.num_heads
    pairs = bh * cfg.computed_pairs()
    tile = cfg.block_q * cfg.block_k
    d, dv = cfg.head_dim_p, cfg.head_dim_v_p
    # dK/dV: S, dP, dV, dK (4 matmuls); dQ: S, dP, dQ (3); dBias: S, dP (2)
    flops = 2 * pairs * tile * {"dkdv": 2 * d + 2 * dv, "dq": 2 * d + dv, "dbias": d + dv}[kernel]
    if kernel == "dkdv" and "dq" in gs.out_names:   # the fused option's fifth matmul
        flops += 2 * pairs * tile * d
    exps = pairs * tile * (2 if cfg.soft_cap is not None else 1)

    block_bytes = gs.block_bytes
    fixed = {"dkdv": ("k", "v", "dk", "dv"), "dbias": (),
             "dq": ("q", "do", "stats", "q_segment_ids", "dq")}[kernel]
    outer = (cfg.batch * cfg.num_kv_heads * cfg.num_kv_blocks * gs.q_chunks if kernel == "dkdv"
             else bh * cfg.num_q_blocks)
    nbytes = 0
    for name in gs.in_names + gs.out_names:
        if name in fixed:
            nbytes += outer * block_bytes(name)
        elif name == "dq" and kernel == "dkdv":      # fused: written once per (b, hk, chunk)
            nbytes += cfg.batch * cfg.num_kv_heads * gs.q_chunks * block_bytes(name)
        elif name in ("ds", "dbias"):
            nbytes += int(np.prod(gs.shape(name).shape)) * 4
        else:
            nbytes += pairs * block_bytes(name)
    return compat.CostEstimate(flops=int(flops), transcendentals=int(exps),
                               bytes_accessed=int(nbytes))
