"""Figures for chapter 11 (reuse the kernel). One function per figure, each returns a Figure."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["packing_figure", "backend_loss_figure", "long_document_figure"]


def _plt():
    import matplotlib.pyplot as plt
    return plt


def packing_figure(packed, padded, *, row: int = 0):
    """Packed rows vs padded rows (segment ids as colours), and one packed row's visible mask.

    ``packed``/``padded`` are :class:`flashlab.models.Batch`; the mask of ``row`` is causal
    within each segment: a block-diagonal staircase, padding hidden from documents.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), dpi=90,
                             gridspec_kw={"width_ratios": [1.3, 1.3, 1]})
    cmap = plt.get_cmap("tab10").copy()
    cmap.set_bad("white")
    for ax, b, title in ((axes[0], packed, "packed"), (axes[1], padded, "padded")):
        # Colour = document; white = padding. Segment ids cycle through ten colours.
        seg = np.ma.masked_equal(np.asarray(b.segment_ids), 0)
        ax.imshow((seg - 1) % 10, aspect="auto", cmap=cmap, interpolation="nearest",
                  vmin=-0.5, vmax=9.5)
        ax.set_title(f"{title}: {b.shape[0]} rows x {b.shape[1]}, {100 * b.fill():.0f}% tokens")
        ax.set_xlabel("position in row")
        ax.set_ylabel("row")
        ax.set_yticks(range(b.shape[0]))
    s = np.asarray(packed.segment_ids[row])
    n = len(s)
    visible = (s[:, None] == s[None, :]) & (s[:, None] > 0) & np.tri(n, dtype=bool)
    axes[2].imshow(visible, cmap="Greys", interpolation="nearest")
    axes[2].set_title(f"row {row}: key visible from query\n(causal, same segment)")
    axes[2].set_xlabel("key position")
    axes[2].set_ylabel("query position")
    fig.tight_layout()
    return fig


def backend_loss_figure(curves: Mapping[str, Sequence[float]], *, reference: str = "reference",
                        tol: float | None = None):
    """Training loss per step for each backend (left), and ``|loss - reference's|`` (right).

    ``curves`` maps a backend name to its per-step losses (same seed, same batches).
    """
    plt = _plt()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=90)
    ref = np.asarray(curves[reference], float)
    styles = ["-", "--", ":", "-."]
    for i, (name, loss) in enumerate(curves.items()):
        loss = np.asarray(loss, float)
        ax.semilogy(np.arange(len(loss)), loss, styles[i % 4], lw=2.5 - 0.4 * i, label=name)
        if name != reference:
            diff = np.abs(loss - ref[:len(loss)])
            bx.semilogy(np.arange(len(loss)), np.maximum(diff, 1e-10), styles[i % 4],
                        label=f"{name} (max {diff.max():.1e})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Same seed, same batches, four attention backends")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if tol is not None:
        bx.axhline(tol, color="k", lw=1, ls="--", label=f"tolerance {tol:.0e}")
    bx.set_ylim(1e-10, max(1.0, 10 * (tol or 0)))
    bx.set_xlabel("step")
    bx.set_ylabel(f"|loss - {reference}| (1e-10 = equal)")
    bx.set_title("Difference from the reference backend")
    bx.legend(fontsize=8)
    bx.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def _failed_allocation_bytes(error: str) -> int | None:
    """The size in XLA's "Out of memory allocating N bytes" message, if there is one."""
    import re
    m = re.search(r"allocating (\d+) bytes", error or "")
    return int(m.group(1)) if m else None


def long_document_figure(results: Sequence[Mapping]):
    """Peak resident memory of capped long-document forwards.

    ``results`` come from :func:`flashlab.models.forward_memories`.
    One bar per run: its measured peak RSS. A run that failed is drawn with its peak at the
    moment of failure plus, hatched on top, the allocation that failed (from XLA's message).
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=90)
    cap = max(r["cap_bytes"] for r in results) / 2**30
    top = cap * 1.15          # the y axis; a failed allocation taller than that is cut off
    labels = []
    for i, r in enumerate(results):
        label = f"{r['backend']}\nN={r['seq_len']}"
        if r.get("attention", "segment_ids") != "segment_ids":
            label += f"\n{r['attention']}"
        labels.append(label)
        h = r.get("peak_rss_bytes", 0) / 2**30
        ax.bar(i, h, color="C0" if r["ok"] else "C3")
        if r["ok"]:
            ax.text(i, h, f"{h:.2f} GiB", ha="center", va="bottom", fontsize=8)
            continue
        want = _failed_allocation_bytes(r.get("error", ""))
        if want is not None:
            w = want / 2**30
            ax.bar(i, w, bottom=h, color="white", edgecolor="C3", hatch="//")
            # Inside the axes: above the hatched bar, or under the top edge when the bar is
            # cut off there (labelled so), never up over the title.
            cut = h + w > top * 0.9
            ax.text(i, top * 0.97 if cut else h + w,
                    f"failed: +{w:.2f} GiB" + ("\n(bar cut off)" if cut else ""),
                    ha="center", va="top" if cut else "bottom", fontsize=8, color="C3",
                    bbox=dict(facecolor="white", edgecolor="none", pad=1) if cut else None)
        else:
            ax.text(i, h, "failed", ha="center", va="bottom", fontsize=8, color="C3")
    ax.axhline(cap, color="k", lw=1, ls="--", label=f"cap (RLIMIT_AS, address space) {cap:.1f} GiB")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(0, top)
    ax.set_ylabel("peak RSS of the process (GiB)")
    ax.set_title("One forward of the document model, one long document")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig
