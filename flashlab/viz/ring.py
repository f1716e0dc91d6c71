"""Figures for chapter 10: the ring step by step, causal load balance, the communication model."""
from __future__ import annotations

import numpy as np

from flashlab.instruments import comm_model
from flashlab.scale import ring_layout


def _plt():
    import matplotlib.pyplot as plt
    return plt


def _colors(P):
    plt = _plt()
    cmap = plt.get_cmap("tab10" if P <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(P)]


def _owner_matrix(P, layout, is_causal, window, upto_step=None):
    """``[2P, 2P]`` (zig-zag chunk units, natural order): the step at which each (q, kv) chunk
    pair is computed, and the device computing it; -1 where it is never computed."""
    nc = ring_layout.chunks_per_device(layout)
    vis = ring_layout.visible_pairs(P, layout, is_causal=is_causal, window=window)
    chunks = ring_layout.device_chunks(P, layout)          # [P, nc] chunk ids (of P·nc)
    sched = ring_layout.ring_schedule(P)
    f = 2 // nc                                             # zig-zag chunks per layout chunk
    step_m = -np.ones((2 * P, 2 * P), int)
    dev_m = -np.ones((2 * P, 2 * P), int)
    for s in range(P if upto_step is None else upto_step + 1):
        for i in range(P):
            src = sched[s, i]
            for a in range(nc):
                for b in range(nc):
                    if vis[s, i, a, b]:
                        qa, kb = chunks[i, a] * f, chunks[src, b] * f
                        step_m[qa:qa + f, kb:kb + f] = s
                        dev_m[qa:qa + f, kb:kb + f] = i
    return step_m, dev_m


def draw_ring_step(ax_ring, ax_mat, num_devices: int, layout: str, step: int, *,
                   is_causal: bool = True, window=None):
    """Draw one frame: the ring (who holds whose K/V) and the score matrix computed so far."""
    P = num_devices
    cols = _colors(P)
    sched = ring_layout.ring_schedule(P)
    # The ring: devices on a circle, arrow to the next one; label = whose K/V it holds now.
    ang = np.pi / 2 - 2 * np.pi * np.arange(P) / P
    x, y = np.cos(ang), np.sin(ang)
    for i in range(P):
        j = (i + 1) % P
        ax_ring.annotate("", (x[j] * 0.8, y[j] * 0.8), (x[i] * 0.8, y[i] * 0.8),
                         arrowprops=dict(arrowstyle="->", color="0.6", lw=1,
                                         connectionstyle="arc3,rad=-0.25"))
        ax_ring.scatter([x[i]], [y[i]], s=330, color=cols[i], zorder=3)
        ax_ring.text(x[i], y[i], f"D{i}", ha="center", va="center", fontsize=7, color="w",
                     zorder=4, weight="bold")
        src = sched[step, i]
        # Labels point away from the ring (left of a left device, right of a right one), so
        # neither the device's marker nor the axes' edge cuts them.
        # Offset in points beyond the marker's radius, so no marker overlaps it at any size.
        ha = "right" if x[i] < -0.1 else "left" if x[i] > 0.1 else "center"
        va = "top" if y[i] < -0.1 else "bottom" if y[i] > 0.1 else "center"
        ax_ring.annotate(f"KV{src}", (x[i], y[i]), xytext=(12 * x[i], 12 * y[i]),
                         textcoords="offset points", ha=ha, va=va, fontsize=7,
                         color=cols[src], zorder=4, annotation_clip=False)
    ax_ring.set_xlim(-2.0, 2.0)
    ax_ring.set_ylim(-1.8, 1.8)
    ax_ring.set_aspect("equal")
    ax_ring.axis("off")
    ax_ring.set_title(f"step {step}", fontsize=9)
    # The score matrix in zig-zag chunk units: done earlier (faint), now (full), never (white).
    step_m, dev_m = _owner_matrix(P, layout, is_causal, window, upto_step=step)
    img = np.ones((2 * P, 2 * P, 4))
    for r in range(2 * P):
        for c in range(2 * P):
            if dev_m[r, c] >= 0:
                col = np.array(cols[dev_m[r, c]])
                img[r, c] = col if step_m[r, c] == step else np.r_[col[:3], 0.25]
    ax_mat.imshow(img, interpolation="nearest")
    ax_mat.set_xticks([])
    ax_mat.set_yticks([])
    ax_mat.set_xlabel("keys →", fontsize=7)
    ax_mat.set_ylabel("queries →", fontsize=7)


def ring_steps_figure(num_devices: int = 4, layout: str = "zigzag", *, is_causal: bool = True,
                      window=None):
    """One column per ring step: top, the ring (device ``i`` holds the K/V of ``(i-s) mod P``);
    bottom, the score blocks computed at that step (full colour, by device) and before (faint).
    Blank blocks are never computed: ``block_maybe_visible`` skips them."""
    plt = _plt()
    P = num_devices
    fig, axes = plt.subplots(2, P, figsize=(1.9 * P, 4.0), dpi=90)
    for s in range(P):
        draw_ring_step(axes[0, s], axes[1, s], P, layout, s, is_causal=is_causal, window=window)
    fig.suptitle(f"ring attention, {P} devices, {layout} layout"
                 f"{', causal' if is_causal else ''}", fontsize=10)
    fig.tight_layout()
    return fig


def load_balance_figure(num_devices: int = 8, *, window=None):
    """Causal work per device: who computes which score block (contiguous vs zig-zag), and the
    number of (N/2P)² blocks each device computes over the whole ring."""
    plt = _plt()
    P = num_devices
    cols = _colors(P)
    fig, axes = plt.subplots(1, 3, figsize=(9.5, 3.2), dpi=90,
                             gridspec_kw=dict(width_ratios=[1, 1, 1.5]))
    for ax, layout in zip(axes[:2], ("contiguous", "zigzag")):
        _, dev_m = _owner_matrix(P, layout, True, window)
        img = np.ones((2 * P, 2 * P, 4))
        for r in range(2 * P):
            for c in range(2 * P):
                if dev_m[r, c] >= 0:
                    img[r, c] = cols[dev_m[r, c]]
        ax.imshow(img, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"{layout}: block → device", fontsize=9)
        ax.set_xlabel("keys →", fontsize=8)
        ax.set_ylabel("queries →", fontsize=8)
    w = 0.4
    i = np.arange(P)
    for k, layout in enumerate(("contiguous", "zigzag")):
        work = ring_layout.work_per_device(P, layout, is_causal=True, window=window)
        axes[2].bar(i + (k - 0.5) * w, work, w, label=f"{layout} (max/mean {work.max() / work.mean():.2f})")
    axes[2].set_xticks(i, [f"D{j}" for j in i])
    axes[2].set_ylabel("blocks of (N/2P)² computed")
    axes[2].set_title("causal work per device", fontsize=9)
    axes[2].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def comm_model_figure(*, heads: int = 32, kv_heads: int = 8, head_dim: int = 128, batch: int = 1,
                      bytes_per_element: int = 2, chips=("v4", "v5e", "v5p", "v6e"),
                      work_fraction: float = 1.0):
    """Left: time per ring step on a v5e, compute vs sending one K and one V block, against
    tokens per device. Right: tokens per device needed to hide the transfer, per chip, MHA vs
    the given GQA."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.3), dpi=90)
    c = np.geomspace(256, 65536, 64)
    kw = dict(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
              bytes_per_element=bytes_per_element, work_fraction=work_fraction)
    t = [comm_model.ring_step_times("v5e", tokens_per_device=int(x), **kw) for x in c]
    a1.loglog(c, [r["compute_s"] for r in t], label="compute (peak bf16)")
    a1.loglog(c, [r["comm_s"] for r in t], "--", label="send K+V block (1 ICI link)")
    cross = comm_model.min_tokens_per_device("v5e", heads=heads, kv_heads=kv_heads,
                                             bytes_per_element=bytes_per_element,
                                             work_fraction=work_fraction)
    a1.axvline(cross, color="k", ls=":", lw=1)
    a1.annotate(f"hidden for\nN/P ≥ {cross:,.0f}", (cross, t[0]["comm_s"]), xytext=(6, 0),
                textcoords="offset points", fontsize=7)
    a1.set_xlabel("tokens per device N/P")
    a1.set_ylabel("seconds per ring step")
    a1.set_title(f"TPU v5e, H={heads}, K={kv_heads}, d={head_dim}", fontsize=9)
    a1.legend(fontsize=7)
    x = np.arange(len(chips))
    for k, (kvh, lab) in enumerate(((heads, "MHA (K = H)"), (kv_heads, f"GQA (K = {kv_heads})"))):
        need = [comm_model.min_tokens_per_device(ch, heads=heads, kv_heads=kvh,
                                                 bytes_per_element=bytes_per_element,
                                                 work_fraction=work_fraction) for ch in chips]
        a2.bar(x + (k - 0.5) * 0.4, need, 0.4, label=lab)
    a2.set_xticks(x, [comm_model.RING_CHIPS[ch].name for ch in chips], fontsize=8)
    a2.set_ylabel("min tokens per device")
    a2.set_title("when the ring hides its communication", fontsize=9)
    a2.legend(fontsize=7)
    fig.tight_layout()
    return fig
