"""Figures for chapter 07 (the backward kernels). One function per figure, each returns a Figure.

Every byte count comes from :mod:`flashlab.instruments.traffic` (the paper's model, and the replay
of the backward kernels' own BlockSpecs); the tile maps from :mod:`flashlab.kernels.blocks`.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from flashlab.instruments import io_model, traffic

__all__ = ["backward_traffic_figure", "backward_tile_map_figure", "loss_curves_figure"]


def _plt():
    import matplotlib.pyplot as plt
    return plt


def backward_traffic_figure(seq_lens: Sequence[int] = (512, 1024, 2048, 4096, 8192),
                            *, head_dim: int = 128, dtype="bfloat16", block_q: int = 128,
                            block_k: int = 128, sram_bytes: int = 192 * 1024,
                            is_causal: bool = False):
    """Backward HBM bytes per (batch, head) against N: stored P vs recomputed P.

    Curves: standard attention's backward (Algorithm 3: reads the stored P, writes dP, dS),
    the paper's flash backward model (Algorithm 4), and flashlab's two backward kernels
    replayed from their BlockSpecs (``kernel_hbm_bytes("backward")``, incl. the D pass).
    """
    import jax.numpy as jnp
    plt = _plt()
    e = jnp.dtype(dtype).itemsize
    n = [int(x) for x in seq_lens]
    std = [io_model.analytic_hbm_bytes("standard", batch=1, heads=1, seq_len=x, head_dim=head_dim,
                                      bytes_per_element=e, backward=True)["backward"] for x in n]
    fl = [io_model.analytic_hbm_bytes("flash", batch=1, heads=1, seq_len=x, head_dim=head_dim,
                                     bytes_per_element=e, sram_bytes=sram_bytes,
                                     backward=True)["backward"] for x in n]
    kern = [traffic.kernel_hbm_bytes("backward", batch=1, heads=1, seq_len=x, head_dim=head_dim,
                                     dtype=dtype, block_q=min(block_q, x),
                                     block_k=min(block_k, x), is_causal=is_causal)["total"]
            for x in n]
    fig, ax = plt.subplots(figsize=(6.5, 3.5), dpi=90)
    ax.loglog(n, np.asarray(std) / 2**20, "o-", label="standard: store P, read it back")
    ax.loglog(n, np.asarray(fl) / 2**20, "s--", label="flash (paper model, A100 SRAM)")
    ax.loglog(n, np.asarray(kern) / 2**20, "^-", lw=2.5,
              label=f"our kernels, replayed (B_r={block_q}, B_c={block_k}"
                    f"{', causal' if is_causal else ''})")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("backward HBM traffic (MiB)")
    ax.set_title(f"Backward traffic per (batch, head), d={head_dim}, {jnp.dtype(dtype).name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def backward_tile_map_figure(q_len: int = 512, kv_len: int = 512, *, block_q: int = 64,
                             block_k: int = 64, is_causal: bool = True, window=None):
    """Which ``(q block i, kv block j)`` tiles the backward kernels compute.

    Left: the dQ kernel walks each row ``i`` over :func:`blocks.kv_block_range`; right: the
    dK/dV kernel walks each column ``j`` over :func:`blocks.q_block_range`. Both cover the
    same tiles; pale ones are skipped with neither compute nor DMA (chapter 05's colours).
    """
    from flashlab.kernels import blocks as blk
    plt = _plt()
    nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
    rows = np.zeros((nq, nk))
    cols = np.zeros((nq, nk))
    for i in range(nq):
        lo, hi = blk.kv_block_range(i, q_len, kv_len, block_q=block_q, block_k=block_k,
                                    is_causal=is_causal, window=window)
        rows[i, max(lo, 0):hi + 1] = 1
    for j in range(nk):
        lo, hi = blk.q_block_range(j, q_len, kv_len, block_q=block_q, block_k=block_k,
                                   is_causal=is_causal, window=window)
        cols[max(lo, 0):hi + 1, j] = 1
    fig, axes = plt.subplots(1, 2, figsize=(7, 3.5), dpi=90)
    for ax, m, title, xl in ((axes[0], rows, "dQ kernel: row i over kv blocks", "kv block j"),
                             (axes[1], cols, "dK/dV kernel: column j over q blocks",
                              "kv block j (outer)")):
        # Chapter 05's colours (viz.pipeline.block_skipping_figure): computed dark, skipped pale.
        ax.imshow(m, cmap="Blues", vmin=-0.4, vmax=1.2, aspect="equal")
        ax.set_title(f"{title}\n{int(m.sum())} of {nq * nk} tiles", fontsize=9)
        ax.set_xlabel(xl)
        ax.set_ylabel("q block i")
    cmap = plt.get_cmap("Blues")
    shade = lambda x: cmap((x + 0.4) / 1.6)  # noqa: E731 - the imshow normalisation above
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=shade(1.0), label="computed"),
                        plt.Rectangle((0, 0), 1, 1, color=shade(0.0),
                                      label="skipped: no compute, no DMA")],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def loss_curves_figure(losses: Mapping[str, Sequence[float]], *, title: str = "Training loss"):
    """Loss against step, one curve per label (e.g. ``{"kernel": [...], "reference": [...]}``)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.5), dpi=90)
    styles = ["o-", "x--", "s:", "^-."]
    for k, (label, ys) in enumerate(losses.items()):
        ax.plot(np.arange(len(ys)), ys, styles[k % len(styles)], label=label,
                ms=5 if k == 0 else 7, lw=2.5 if k == 0 else 1.2)
    ax.set_xlabel("SGD step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
