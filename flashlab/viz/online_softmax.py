"""Figures for chapter 02: the online-softmax state (m, l, O) converging block by block."""
from __future__ import annotations

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from flashlab.ladder import online_softmax as osm

__all__ = ["online_softmax_trace", "online_softmax_figure", "draw_online_softmax_step"]


def online_softmax_trace(scores, values, block: int):
    """Run one row through ``online_softmax.update`` a block at a time.

    scores ``[N]``, values ``[N, d]``. Returns a dict of per-step arrays: ``m [steps]``,
    ``l [steps]``, ``out [steps, d]`` (the finalized output after each block), ``err [steps]``
    (max abs distance to the exact softmax output) and the exact ``ref [d]``.
    """
    s = np.asarray(scores, np.float32)
    v = np.asarray(values, np.float32)
    p = np.exp(s.astype(np.float64) - s.max())
    ref = (p / p.sum()) @ v.astype(np.float64)
    state = osm.init((1,), v.shape[1])
    ms, ls, outs = [], [], []
    for a in range(0, len(s), block):
        state = osm.update(state, jnp.asarray(s[None, a:a + block]), jnp.asarray(v[a:a + block]))
        o, _ = osm.finalize(state)
        ms.append(float(state.m[0]))
        ls.append(float(state.l[0]))
        outs.append(np.asarray(o[0]))
    outs = np.array(outs)
    return {"m": np.array(ms), "l": np.array(ls), "out": outs, "ref": ref,
            "err": np.abs(outs - ref).max(axis=1), "block": block, "scores": s}


def draw_online_softmax_step(ax_scores, ax_state, trace, step: int):
    """Draw the row's scores (blocks seen so far highlighted) and m, l, error up to ``step``."""
    s, b = trace["scores"], trace["block"]
    n = len(s)
    seen = min(n, (step + 1) * b)
    ax_scores.bar(np.arange(n), s, color=["C0" if i < seen else "0.8" for i in range(n)], width=1)
    ax_scores.axhline(trace["m"][step], color="C3", lw=1, label=f"m = {trace['m'][step]:.2f}")
    for x in range(b, n, b):
        ax_scores.axvline(x - 0.5, color="k", lw=0.5, ls=":")
    ax_scores.set(title=f"scores, blocks 0..{step} seen", xlabel="key j", ylabel="s_j")
    ax_scores.legend(loc="upper right", fontsize=8)
    steps = np.arange(len(trace["m"]))
    ax_state.semilogy(steps[:step + 1], np.maximum(trace["err"][:step + 1], 1e-9), "o-C2",
                      label="max |O - softmax(s)V|")
    ax_state.semilogy(steps[:step + 1], trace["l"][:step + 1], "s-C1", label="l")
    ax_state.set(xlim=(-0.5, len(steps) - 0.5), xlabel="block", title="state after each block")
    ax_state.legend(fontsize=8)


def online_softmax_figure(scores, values, block: int):
    """Static figure: the whole row seen, and m, l and the output error over all blocks."""
    trace = online_softmax_trace(scores, values, block)
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 3.2), dpi=80)
    draw_online_softmax_step(a, b, trace, len(trace["m"]) - 1)
    fig.tight_layout()
    return fig
