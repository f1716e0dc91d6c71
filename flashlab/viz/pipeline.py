"""Figures for chapters 04-05: the Pallas pipeline and block skipping, from the index maps.

Every figure replays the kernel's own BlockSpecs (:mod:`flashlab.kernels.replay`), so what
you see is what ``pallas_call`` is told, not a restatement of it.
"""
from __future__ import annotations

import numpy as np

from flashlab.kernels import blocks as blk
from flashlab.kernels.replay import replay_index_maps

__all__ = ["pipeline_residency_figure", "block_skipping_figure", "forward_skip_table"]


def _plt():
    import matplotlib.pyplot as plt
    return plt


def pipeline_residency_figure(grid, specs, *prefetch, max_steps=24, title=None, highlight=None):
    """Which block of each operand is resident in VMEM at each grid step.

    One row per operand, one column per grid step; a filled cell is a step where the block
    index changed, i.e. a fresh copy from HBM (an output: a write-back of the previous block);
    a pale cell reuses the resident block. Cells are labelled with the block index.
    ``highlight`` marks one step (the widget's slider).
    """
    plt = _plt()
    recs = replay_index_maps(grid, specs, *prefetch)[:max_steps]
    names = list(specs)
    fig, ax = plt.subplots(figsize=(min(11, 1.2 + 0.42 * len(recs)), 0.55 * len(names) + 1.5),
                           dpi=90)
    for r, name in enumerate(names):
        for c, rec in enumerate(recs):
            new = rec["fetched"][name]
            ax.add_patch(plt.Rectangle((c, r), 0.95, 0.9, color="tab:orange" if new else "#f3e3cf"))
            idx = rec["blocks"][name]
            label = ",".join(str(x) for x in idx[-2:])
            ax.text(c + 0.47, r + 0.45, label, ha="center", va="center", fontsize=6.5)
    if highlight is not None and highlight < len(recs):
        ax.add_patch(plt.Rectangle((highlight - 0.03, -0.08), 1.0, len(names) + 0.06, fill=False,
                                   lw=2, color="black"))
    ax.set_xlim(0, len(recs))
    ax.set_ylim(len(names), 0)
    ax.set_yticks(np.arange(len(names)) + 0.45, names)
    ax.set_xticks(np.arange(len(recs)) + 0.47,
                  ["".join(str(x) for x in rec["step"][-3:]) for rec in recs], fontsize=6,
                  rotation=90)
    ax.set_xlabel("grid step (last grid indices); label = block index (last two dims)")
    nfetch = {n: sum(rec["fetched"][n] for rec in recs) for n in names}
    ax.set_title(title or "dark = copied this step, pale = already resident   " +
                 "  ".join(f"{n}: {k}" for n, k in nfetch.items()), fontsize=8)
    for s in ax.spines.values():
        s.set_visible(False)
    fig.tight_layout()
    return fig


def forward_skip_table(grid_spec, q_lengths, kv_lengths, *, b=0, h=0):
    """``(computed [T_r, T_c] bool, fetched_block [T_r, T_c] int)`` for one (batch, head).

    ``computed`` is the kernel's ``pl.when`` predicate (``kv_block_range``); ``fetched_block``
    is the kv block index the K index map asks for at that step (clamped when skipped).
    A forward on the visit grid (:mod:`flashlab.kernels.visit`) runs only the computed steps
    and copies the same blocks; the table shows the dense grid it replaces.
    """
    cfg = grid_spec.config
    if getattr(cfg, "visit_grid", False):
        import dataclasses
        from flashlab.kernels import forward as fw
        from flashlab.kernels import forward_grid
        grid_spec = forward_grid.forward_grid_spec(dataclasses.replace(cfg, visit_grid=False))
    nq, nk = cfg.num_q_blocks, cfg.num_kv_blocks
    q_lengths, kv_lengths = np.asarray(q_lengths), np.asarray(kv_lengths)
    computed = np.zeros((nq, nk), bool)
    fetched = np.zeros((nq, nk), int)
    kmap = grid_spec.spec("k").index_map
    for i in range(nq):
        lo, hi = blk.kv_block_range(i, q_lengths[b], kv_lengths[b], block_q=cfg.block_q,
                                    block_k=cfg.block_k,
                                    is_causal=cfg.is_causal, window=cfg.window)
        for j in range(nk):
            computed[i, j] = lo <= j <= hi
            fetched[i, j] = int(kmap(b, h, i, j, q_lengths, kv_lengths)[2])
    return computed, fetched


def block_skipping_figure(grid_spec, q_lengths, kv_lengths, *, b=0, h=0, title=None):
    """(q block, kv block) pairs the forward kernel computes (dark) vs skips (pale).

    Each cell is labelled with the kv block the index maps fetch at that step; a skipped
    step shows the block that is already resident, so it costs no DMA.
    """
    plt = _plt()
    computed, fetched = forward_skip_table(grid_spec, q_lengths, kv_lengths, b=b, h=h)
    nq, nk = computed.shape
    fig, ax = plt.subplots(figsize=(min(7, 1.5 + 0.45 * nk), min(5, 1.2 + 0.4 * nq)), dpi=90)
    ax.imshow(computed, cmap="Blues", vmin=-0.4, vmax=1.2, aspect="auto")
    if nq * nk <= 400:
        for i in range(nq):
            for j in range(nk):
                ax.text(j, i, str(fetched[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if computed[i, j] else "#555555")
    ax.set_xlabel("kv block j")
    ax.set_ylabel("q block i")
    frac = computed.mean()
    ax.set_title(title or f"computed {computed.sum()} of {computed.size} blocks "
                 f"({100 * frac:.0f}%); label = kv block fetched", fontsize=9)
    fig.tight_layout()
    return fig
