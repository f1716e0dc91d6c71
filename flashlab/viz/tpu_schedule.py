"""Figures of the TPU compiler's static schedule (:mod:`flashlab.instruments.tpu_schedule`)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

UNIT_LABELS = {"MXU": "MXU (matmul)", "XLU": "XLU (cross-lane)", "VALU": "VPU (vector ALU)",
               "VPOP": "result pops", "EUP": "EUP (exp, 1/x)", "VLOAD": "vector loads",
               "VSTORE": "vector stores", "SALU": "scalar ALU"}
LIBRARY_COLORS = {"flashlab": "C0", "splash": "C1", "jax_pallas_flash": "C2"}


def tile_timeline_figure(rows, *, capacity=None, title=None):
    """Which unit is busy on which cycle of one tile, one panel per kernel.

    ``rows``: bench rows (``python -m flashlab bench tpu-static --timeline-chip``) holding a
    ``timeline`` (unit -> one digit per cycle: slots busy in that bundle, from the compiler's
    own utilization table) and ``unit_capacity``. Darker = more of the unit's slots busy.
    """
    rows = [r for r in rows if r.get("timeline")]
    if not rows:
        raise ValueError("rows: expected bench rows with a 'timeline' (run the bench with "
                         "--timeline-chip), got none")
    width = max(len(next(iter(r["timeline"].values()))) for r in rows)
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.9 * len(rows) + 0.6), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        units = [u for u in UNIT_LABELS if u in r["timeline"]]
        caps = capacity or r["unit_capacity"]
        img = np.zeros((len(units), width))
        for k, u in enumerate(units):
            v = np.array([int(c) for c in r["timeline"][u]], float) / max(1, caps[u])
            img[k, :len(v)] = v
        n = len(next(iter(r["timeline"].values())))
        ax.imshow(img, aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest",
                  extent=(0, width, len(units), 0))
        ax.axvline(n, color="k", lw=1)
        ax.axvline(r["mxu_cycles"], color="C3", lw=1, ls="--")
        ax.set_yticks(np.arange(len(units)) + 0.5, [UNIT_LABELS[u] for u in units], fontsize=7)
        ax.set_title(f"{r['library']} {r['kernel']} ({r['block_q']}x{r['block_k']}, "
                     f"{r['chip']}): {n} cycles, MXU busy {r['occupancy']:.0%} "
                     f"(red: the MXU floor, {r['mxu_cycles']:.0f})", fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("cycle of the tile (one VLIW bundle per cycle)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def static_estimates_figure(rows, *, versions=None, blocks="equal"):
    """Whole-kernel static estimate / peak-FLOP floor, per chip, kernel and library."""
    rows = [r for r in rows if r.get("blocks") == blocks and "error" not in r]
    if not rows:
        raise ValueError(f"rows: no successful bench rows with blocks={blocks!r}")
    kernels = [k for k in ("forward", "dq", "dkdv") if any(r["kernel"] == k for r in rows)]
    chips = list(dict.fromkeys(r["chip"] for r in rows))
    libs = [lib for lib in LIBRARY_COLORS if any(r["library"] == lib for r in rows)]
    fig, axes = plt.subplots(1, len(kernels), figsize=(3.6 * len(kernels), 3.2), sharey=True,
                             squeeze=False)
    w = 0.8 / len(libs)
    for ax, k in zip(axes[0], kernels):
        for n, lib in enumerate(libs):
            ys = [next((r["ratio_floor"] for r in rows
                        if (r["chip"], r["kernel"], r["library"]) == (c, k, lib)), np.nan)
                  for c in chips]
            ax.bar(np.arange(len(chips)) + (n - (len(libs) - 1) / 2) * w, ys, w,
                   color=LIBRARY_COLORS[lib], label=lib)
        ax.axhline(1, color="k", lw=1, ls="--")
        ax.set_xticks(np.arange(len(chips)), chips)
        ax.set_title({"forward": "forward", "dq": "dQ kernel", "dkdv": "dK/dV kernel"}[k],
                     fontsize=9)
    axes[0, 0].set_ylabel("static estimate / peak-FLOP floor")
    axes[0, 0].legend(fontsize=7)
    v = versions or {}
    fig.suptitle(f"TPU compiler's static schedule, {blocks} blocks (jax {v.get('jax')}, libtpu "
                 f"{v.get('libtpu')}); not wall time", fontsize=9)
    fig.tight_layout()
    return fig


def optimisation_rows(path=None) -> list[dict]:
    """The forward kernel's before/after static figures, one row per optimisation, as
    committed in ``flashlab/data/forward_optimisations.json`` (each row: its step, commit,
    the tree it was compiled from, the bench command, tile/step/finalize cycles, the
    whole-kernel estimate and the tile's per-unit busy slots)."""
    import json
    from pathlib import Path
    p = Path(path) if path else Path(__file__).parent.parent / "data" / "forward_optimisations.json"
    return json.loads(p.read_text())["rows"]


def optimisation_table(rows=None) -> str:
    """Plain-text table of :func:`optimisation_rows`: per step, the tile, per-step and
    finalize cycles, the whole-kernel estimate, and the busiest units of the tile (busy
    slots / slots per cycle = the cycles that unit alone needs). Static schedule: no DMA
    stalls, no HBM bandwidth."""
    rows = optimisation_rows() if rows is None else rows
    head = (f"{'step':58} {'tile':>5} {'step':>5} {'final':>5} {'est Mcyc':>8} "
            f"{'MXU':>5} {'VALU':>5} {'VST':>5} {'XLU':>5}")
    out = [head, "-" * len(head)]
    for r in rows:
        need = {u: r["unit_busy"].get(u, 0) / max(1, r["unit_capacity"].get(u, 1))
                for u in ("MXU", "VALU", "VSTORE", "XLU")}
        label = (r["step"] if len(r["step"]) <= 58 else r["step"][:55] + "...")
        out.append(f"{label:58} {r['tile_cycles']:5d} {r['step_cycles']:5d} "
                   f"{r['finalize_cycles']:5d} {r['est_cycles'] / 1e6:8.2f} "
                   + " ".join(f"{need[u]:5.0f}" for u in ("MXU", "VALU", "VSTORE", "XLU")))
    return "\n".join(out)


def optimisation_figure(rows=None):
    """Bars of :func:`optimisation_rows`: tile, per-step and finalize cycles per step, and the
    whole-kernel estimate (static schedule: no DMA stalls, no HBM bandwidth)."""
    rows = optimisation_rows() if rows is None else rows
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))
    x = np.arange(len(rows))
    for k, (key, label) in enumerate((("tile_cycles", "tile"), ("step_cycles", "per step"),
                                      ("finalize_cycles", "finalize"))):
        a.bar(x + (k - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
    a.axhline(rows[0]["mxu_cycles"], color="C3", ls="--", lw=1, label="MXU floor of a tile")
    b.bar(x, [r["est_cycles"] / 1e6 for r in rows], 0.6, color="C0")
    for ax in (a, b):
        ax.set_xticks(x, [f"{i}" for i in range(len(rows))])
        ax.set_xlabel("step (see the table)")
    a.set_ylabel("cycles")
    a.legend(fontsize=7)
    b.set_ylabel("whole-kernel estimate (M cycles)")
    fig.tight_layout()
    return fig
