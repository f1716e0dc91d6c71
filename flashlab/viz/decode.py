"""Figures of chapter 12 (serving): decode on the roofline, the paged cache, the page walk."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from flashlab.instruments import decode_traffic, roofline, traffic

__all__ = ["decode_roofline_figure", "paged_cache_figure", "page_walk_figure",
           "decode_points"]


def _plt():
    import matplotlib.pyplot as plt
    return plt


def decode_points(*, length: int = 4096, batch: int = 8, q_heads: int = 32,
                  group_sizes: Sequence[int] = (1, 4, 8), head_dim: int = 128,
                  dtype="bfloat16") -> list[dict]:
    """One decode step per group size ``G``: FLOPs (``4 * B * Hq * L * d``, the two matmuls),
    the replayed bytes of the decode kernel, and its arithmetic intensity (about ``G``)."""
    pts = []
    for G in group_sizes:
        d = decode_traffic.decode_step_bytes(lengths=[length] * batch, q_heads=q_heads,
                                             kv_heads=q_heads // G, head_dim=head_dim,
                                             dtype=dtype)
        flops = 4 * batch * q_heads * length * head_dim
        pts.append({"G": G, "flops": flops, "bytes": d["total"],
                    "intensity": roofline.arithmetic_intensity(flops, d["total"])})
    return pts


def decode_roofline_figure(chips: Sequence[str] = ("v4", "v5e", "v5p", "v6e", "7x"), *,
                           length: int = 4096, batch: int = 8, q_heads: int = 32,
                           group_sizes: Sequence[int] = (1, 4, 8), head_dim: int = 128,
                           dtype="bfloat16"):
    """Every chip's roofline with its ridge point, and decode steps (MHA ... GQA) on it.

    A decode step does ``~G`` FLOPs per byte of cache it reads; every TPU's ridge is in the
    hundreds, so decode sits on the bandwidth slope: its time is the bytes over HBM bandwidth.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.8, 3.9), dpi=90)
    x = np.geomspace(0.5, 3e3, 200)
    pts = decode_points(length=length, batch=batch, q_heads=q_heads, group_sizes=group_sizes,
                        head_dim=head_dim, dtype=dtype)
    for k, name in enumerate(chips):
        c = roofline.chip(name)
        peak = c.peak_flops(dtype)
        color = f"C{k}"
        ax.loglog(x, np.minimum(peak, x * c.hbm_bytes_per_s), color=color, lw=1.4,
                  label=f"{name}: ridge at {c.ridge_point:.0f} FLOP/B")
        ax.axvline(c.ridge_point, color=color, lw=0.6, ls=":")
        for p in pts:
            ax.loglog(p["intensity"], min(peak, p["intensity"] * c.hbm_bytes_per_s), "o",
                      color=color, ms=6, mec="k", mew=0.5)
    for p in pts:
        ax.annotate(f"G={p['G']}", (p["intensity"], 3e11), ha="center", fontsize=7)
    ax.set_xlabel("arithmetic intensity (FLOPs / HBM byte)")
    ax.set_ylabel("attainable FLOP/s (bf16)")
    ax.set_title(f"decode on the roofline: {batch} sequences x {length} cached tokens, "
                 f"{q_heads} query heads, d={head_dim}", fontsize=9)
    ax.set_ylim(2e11, 5e15)
    ax.legend(fontsize=6.5, loc="upper left")
    fig.tight_layout()
    return fig


def paged_cache_figure(lengths: Sequence[int] = (37, 12, 58), *, page_size: int = 16,
                       num_pages: int = 12, seed: int = 1):
    """The page pool, coloured by the sequence owning each page, and each sequence's page
    table: logical page ``i`` of sequence ``b`` lives at pool page ``page_table[b, i]``."""
    plt = _plt()
    rng = np.random.default_rng(seed)
    need = [-(-L // page_size) for L in lengths]
    free = list(rng.permutation(num_pages))
    tables = [[int(free.pop()) for _ in range(n)] for n in need]
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(8.4, 2.6), dpi=90,
                                     gridspec_kw=dict(width_ratios=(1, 1.6)))
    owner = -np.ones(num_pages, int)
    fill = np.zeros(num_pages)
    for b, (L, tab) in enumerate(zip(lengths, tables)):
        for i, p in enumerate(tab):
            owner[p] = b
            fill[p] = min(page_size, L - i * page_size) / page_size
            ax_t.add_patch(plt.Rectangle((i, -b - 1), 0.9, 0.8, color=f"C{b}", alpha=0.8))
            ax_t.text(i + 0.45, -b - 0.6, str(p), ha="center", va="center", fontsize=8,
                      color="w")
        ax_t.text(-0.2, -b - 0.6, f"seq {b} (L={L})", ha="right", va="center", fontsize=8)
    ax_t.set_xlim(-2.6, max(need) + 0.2)
    ax_t.set_ylim(-len(lengths) - 0.3, 0.2)
    ax_t.set_title("page_table[b, i] (logical page i)", fontsize=9)
    ax_t.axis("off")
    for p in range(num_pages):
        color = "0.85" if owner[p] < 0 else f"C{owner[p]}"
        ax_p.add_patch(plt.Rectangle((p, 0), 0.9, 1.0, color="0.92"))
        ax_p.add_patch(plt.Rectangle((p, 0), 0.9, fill[p] if owner[p] >= 0 else 0,
                                     color=color, alpha=0.8))
        ax_p.text(p + 0.45, -0.15, str(p), ha="center", va="top", fontsize=8)
    ax_p.set_xlim(-0.2, num_pages)
    ax_p.set_ylim(-0.5, 1.2)
    ax_p.set_title(f"page pool: {num_pages} pages of {page_size} positions (filled part "
                   "shaded, grey = free)", fontsize=9)
    ax_p.axis("off")
    fig.tight_layout()
    return fig


def page_walk_figure(lengths: Sequence[int] = (40, 17, 64), *, q_heads: int = 8,
                     kv_heads: int = 2, page_size: int = 16, num_splits: int | None = None,
                     pages_per_block: int | None = 2):
    """The decode kernel's grid replayed: at each grid step ``(b, s, i)`` the pool page each of
    its ``pages_per_block`` K operands asks for, and whether the pipeline copies it (a clamped
    operand asks for the page it already holds: no copy). ``None``: the kernel's default."""
    plt = _plt()
    kg = decode_traffic.decode_kernel_grid(lengths=lengths, q_heads=q_heads,
                                           kv_heads=kv_heads, page_size=page_size,
                                           num_splits=num_splits,
                                           pages_per_block=pages_per_block)
    sched = traffic.tile_schedule(kg)
    names = [o for o in sched["ops"] if o[0] == "k" and o[1:].isdigit() or o == "k"]
    b = sched["grid_points"][:, 0]
    steps = np.arange(len(b))
    fig, ax = plt.subplots(figsize=(7.2, 2.6), dpi=90)
    copies = 0
    for t, name in enumerate(names):
        k = sched["ops"][name]
        page = k["index"][:, 0]
        copies += int(k["copied"].sum())
        x = steps + (t - (len(names) - 1) / 2) * 0.18          # operands side by side
        for bb in range(len(lengths)):
            sel = b == bb
            cp, nc = sel & k["copied"], sel & ~k["copied"]
            ax.plot(x[cp], page[cp], "os^v"[t % 4], color=f"C{bb}", ms=6, mec="k", mew=0.5,
                    label=f"seq {bb}: L={lengths[bb]}" if t == 0 else None)
            ax.plot(x[nc], page[nc], "os^v"[t % 4], mfc="w", mec=f"C{bb}", ms=6)
    ax.set_xlabel(f"grid step (b, s, i) in execution order; {len(names)} K operands per step "
                  "(o, s, ^, v)")
    ax.set_ylabel("pool page of K")
    ax.set_title(f"the page walk: {copies} page copies in {len(steps)} steps "
                 "(filled = DMA, open = clamped, no copy)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig
