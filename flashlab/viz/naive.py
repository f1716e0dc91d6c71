"""Figures for chapter 01: the N×N score matrix and how naive attention scales."""
from __future__ import annotations

import numpy as np


def _plt():
    import matplotlib.pyplot as plt
    return plt


def score_matrix_figure(probs, *, title="softmax(QKᵀ) for one head"):
    """Heat map of one head's attention probabilities ``probs [q_seq, kv_seq]``."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.2, 3.6), dpi=90)
    im = ax.imshow(np.asarray(probs), cmap="viridis", aspect="auto")
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


def naive_scaling_figure(seq_lens, seconds, peak_bytes, predicted_bytes, *, budget_bytes=None,
                         fit_limit=None, device_label=""):
    """Two panels against N: measured time, and measured vs predicted peak memory.

    ``seconds``/``peak_bytes`` are per entry of ``seq_lens`` (``nan`` where not measured);
    ``predicted_bytes`` is a callable N -> bytes drawn as a line out to ``fit_limit``;
    ``budget_bytes`` draws the device's memory as a horizontal line.
    """
    plt = _plt()
    n = np.asarray(seq_lens, float)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.3), dpi=90)
    a1.loglog(n, seconds, "o-", label="measured")
    ref = seconds[-1] * (n / n[-1]) ** 2          # anchored at the largest (least noisy) N
    a1.loglog(n, ref, "k:", label="∝ N²")
    a1.set_xticks(n, [f"{int(x)}" for x in n], minor=False)
    a1.xaxis.set_minor_formatter(plt.NullFormatter())
    a1.set_xlabel("sequence length N")
    a1.set_ylabel("seconds per call")
    a1.set_title(f"time {device_label}".strip())
    a1.legend()
    hi = max(n[-1], fit_limit or 0) * 1.5
    grid = np.geomspace(n[0], hi, 64)
    a2.loglog(grid, [predicted_bytes(x) for x in grid], "k-", lw=1, label="predicted (formula)")
    a2.loglog(n, peak_bytes, "o", label="measured (XLA)")
    if budget_bytes:
        a2.axhline(budget_bytes, color="tab:red", ls="--", label="device memory")
    if fit_limit:
        a2.axvline(fit_limit, color="tab:red", ls=":", lw=1)
        a2.annotate(f"stops fitting\nN≈{fit_limit:,}", (fit_limit, budget_bytes or 1),
                    xytext=(-90, -40), textcoords="offset points", color="tab:red", fontsize=8)
    a2.set_xlabel("sequence length N")
    a2.set_ylabel("bytes")
    a2.set_title("peak memory")
    a2.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
