"""Figure of ``python -m flashlab bench`` results."""
from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["bench_figure"]


def bench_figure(rows, *, dtype=None, head_dim=None, figsize=(7, 3.5)):
    """Time and achieved fraction of peak against N, one line per (backend, causal).

    ``rows``: the list of dicts the bench writes (``--json``). Filters to one ``dtype`` and
    ``head_dim`` (default: the first row's). Dashed lines are causal. Returns the Figure.
    """
    if not rows:
        raise ValueError("rows: expected at least one benchmark row, got none")
    dtype = dtype or rows[0]["dtype"]
    head_dim = head_dim or rows[0]["head_dim"]
    rows = [r for r in rows if r["dtype"] == dtype and r["head_dim"] == head_dim]
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=figsize, dpi=90)
    keys = sorted({(r["backend"], r["causal"]) for r in rows})
    colors = {}
    for name, causal in keys:
        rs = sorted((r for r in rows if r["backend"] == name and r["causal"] == causal),
                    key=lambda r: r["seq_len"])
        n = [r["seq_len"] for r in rs]
        color = colors.setdefault(name, f"C{len(colors)}")
        style = dict(color=color, ls="--" if causal else "-", marker="o", ms=3)
        label = f"{name}{' (causal)' if causal else ''}"
        if any(r.get("mode", "compiled") != "compiled" for r in rs):
            label += " [interpret]"
        ax_t.plot(n, [r["seconds"] * 1e3 for r in rs], label=label, **style)
        ax_p.plot(n, [100 * r["fraction_of_peak"] for r in rs], **style)
    for ax in (ax_t, ax_p):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("forward time (ms)")
    ax_p.set_ylabel("% of peak FLOP/s")
    plat = rows[0].get("platform", "") if rows else ""
    fig.suptitle(f"attention backends on {plat}: {dtype}, d={head_dim}", fontsize=10)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    return fig
