"""Figures for chapter 03: memory traffic of tiled vs naive attention."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from flashlab.ladder.reference import naive_hbm_bytes
from flashlab.ladder.tiled import tiled_hbm_bytes

__all__ = ["traffic_figure"]


def traffic_figure(seq_lens=(512, 1024, 2048, 4096, 8192, 16384), block_qs=(128, 512, 2048), *,
                   heads: int = 8, head_dim: int = 64, bytes_per_element: int = 4):
    """Bytes moved by the forward pass vs N: naive (N² terms) and tiled for several B_r."""
    ns = np.array(seq_lens)
    kw = dict(batch=1, heads=heads, head_dim=head_dim, bytes_per_element=bytes_per_element)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=80)
    naive = [naive_hbm_bytes(q_len=n, kv_len=n, **kw)["total"] for n in ns]
    ax.loglog(ns, np.array(naive) / 1e9, "o-k", label="naive (S and P through memory)")
    for bq in block_qs:
        t = [tiled_hbm_bytes(q_len=n, kv_len=n, block_q=bq, **kw)["total"] for n in ns]
        ax.loglog(ns, np.array(t) / 1e9, "s--", label=f"tiled, block_q = {bq}")
    ax.set(xlabel="sequence length N", ylabel="GB moved (forward)",
           title=f"memory traffic, {heads} heads, d = {head_dim}, fp32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
