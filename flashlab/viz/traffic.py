"""Figures for chapter 06 (and the traffic panel of chapters 01, 03, 05, 07).

One function per figure, each returns a matplotlib Figure. Inputs are sizes, not arrays:
every number is computed by :mod:`flashlab.instruments.traffic` and
:mod:`flashlab.instruments.roofline`.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from flashlab.instruments import io_model, roofline, traffic

__all__ = ["traffic_vs_seq_len_figure", "traffic_vs_block_size_figure", "roofline_figure",
           "tile_schedule_figure", "tile_schedule_frame", "explorer_figure"]


def _plt():
    import matplotlib.pyplot as plt
    return plt


def _itemsize(dtype) -> int:
    import jax.numpy as jnp
    return jnp.dtype(dtype).itemsize


def _kernel_bytes(N, d, dtype, block_q, block_k, is_causal, batch=1, heads=1):
    """Replayed forward-kernel bytes, or the closed form if the kernel is not available."""
    try:
        return traffic.kernel_hbm_bytes("forward", batch=batch, heads=heads, seq_len=N,
                                        head_dim=d, dtype=dtype, block_q=min(block_q, N),
                                        block_k=min(block_k, N), is_causal=is_causal)["total"]
    except (NotImplementedError, ValueError):
        return io_model.forward_closed_form_bytes(batch=batch, heads=heads, seq_len=N,
                                                 head_dim=d, dtype=dtype,
                                                 block_q=min(block_q, N))


def traffic_vs_seq_len_figure(seq_lens: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384),
                              *, head_dim: int = 128, dtype="bfloat16", block_q: int = 128,
                              block_k: int = 128, sram_bytes: int = 192 * 1024,
                              is_causal: bool = False, highlight: str | None = None):
    """Forward HBM bytes per (batch, head) against N: standard, paper flash, replayed kernel.

    ``highlight``: ``"standard"``, ``"flash"`` or ``"kernel"`` draws that curve thicker
    (chapters 01/03/05 use it to mark their rung).
    """
    plt = _plt()
    e = _itemsize(dtype)
    n = np.asarray(seq_lens)
    std = [io_model.analytic_hbm_bytes("standard", batch=1, heads=1, seq_len=int(x),
                                      head_dim=head_dim, bytes_per_element=e)["total"] for x in n]
    fl = [io_model.analytic_hbm_bytes("flash", batch=1, heads=1, seq_len=int(x),
                                     head_dim=head_dim, bytes_per_element=e,
                                     sram_bytes=sram_bytes)["total"] for x in n]
    kern = [_kernel_bytes(int(x), head_dim, dtype, block_q, block_k, is_causal) for x in n]
    qkvo = 4 * n * head_dim * e
    fig, ax = plt.subplots(figsize=(6.5, 3.5), dpi=90)
    lw = lambda k: 3 if highlight == k else 1.5  # noqa: E731
    ax.loglog(n, std, "o-", lw=lw("standard"), label="standard (S, P through HBM)")
    ax.loglog(n, fl, "s-", lw=lw("flash"), label=f"flash, paper model (M = {sram_bytes // 1024} KB)")
    ax.loglog(n, kern, "^-", lw=lw("kernel"),
              label=f"flashlab kernel, replay (B_r={block_q}, B_c={block_k}"
                    + (", causal)" if is_causal else ")"))
    ax.loglog(n, qkvo, "k:", lw=1, label="read Q, K, V + write O once")
    ax.set_xticks(n, [str(int(x)) for x in n])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("HBM bytes per (batch, head)")
    ax.set_title(f"forward traffic, d = {head_dim}, {np.dtype(_np(dtype)).name}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _np(dtype):
    import jax.numpy as jnp
    return jnp.dtype(dtype)


def traffic_vs_block_size_figure(block_sizes: Sequence[int] = (128, 256, 512, 1024, 2048), *,
                                 seq_len: int = 8192, head_dim: int = 128, dtype="bfloat16",
                                 block_k: int = 128, chip: str = "v5e"):
    """Replayed kernel bytes (per (batch, head), causal and not) against B_r, with VMEM use.

    K and V are read once per query block, so traffic falls as ``1/B_r`` towards the Q, K,
    V, O floor while the pipeline's VMEM grows linearly; the chip's physical VMEM (one
    TensorCore) is drawn dashed, the compiler's default scoped limit dotted.
    """
    plt = _plt()
    bs = [b for b in block_sizes if b <= seq_len]
    e = _itemsize(dtype)
    full = [_kernel_bytes(seq_len, head_dim, dtype, b, block_k, False) for b in bs]
    causal = [_kernel_bytes(seq_len, head_dim, dtype, b, block_k, True) for b in bs]
    vmem = []
    for b in bs:
        try:
            vmem.append(traffic.pipeline_vmem_bytes(traffic.kernel_grid(
                "forward", batch=1, heads=1, seq_len=seq_len, head_dim=head_dim, dtype=dtype,
                block_q=b, block_k=block_k)))
        except (NotImplementedError, ValueError):
            vmem.append(2 * (2 * b + 2 * block_k) * head_dim * e + b * head_dim * 4)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.3), dpi=90)
    a1.loglog(bs, full, "o-", label="non-causal")
    a1.loglog(bs, causal, "s-", label="causal")
    a1.axhline(4 * seq_len * head_dim * e, color="k", ls=":", lw=1, label="Q, K, V, O once")
    a1.set_xticks(bs, [str(b) for b in bs])
    a1.xaxis.set_minor_formatter(plt.NullFormatter())
    a1.set_xlabel("block_q (B_r)")
    a1.set_ylabel("HBM bytes per (batch, head)")
    a1.set_title(f"traffic, N = {seq_len}, B_c = {block_k}")
    a1.legend(fontsize=7)
    a2.loglog(bs, np.asarray(vmem) / 2**20, "o-", color="tab:green")
    c = roofline.chip(chip)
    a2.axhline(c.vmem_bytes / 2**20, color="tab:red", ls="--", label=f"{chip} VMEM (physical)")
    a2.axhline(c.scoped_vmem_bytes / 2**20, color="tab:orange", ls=":",
               label=f"{chip} default scoped limit")
    a2.set_xticks(bs, [str(b) for b in bs])
    a2.xaxis.set_minor_formatter(plt.NullFormatter())
    a2.set_xlabel("block_q (B_r)")
    a2.set_ylabel("MiB")
    a2.set_title("pipeline VMEM (2 buffers + scratch)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def roofline_figure(chips: Iterable[str] = ("v5e", "v6e", "7x"), *, batch: int = 4,
                    heads: int = 16, seq_len: int = 4096, head_dim: int = 128,
                    dtype="bfloat16", block_q: int = 512, is_causal: bool = False,
                    measured: Iterable[Mapping] | None = None, measured_chip: str | None = None):
    """Roofline per chip (bf16 peak, HBM bandwidth), with standard and flash attention on it.

    ``measured``: bench CLI rows (``python -m flashlab bench --json``), drawn as crosses
    against the roofline of ``measured_chip`` (default: the first chip).
    """
    plt = _plt()
    chips = list(chips)
    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=90)
    x = np.geomspace(1, 1e4, 200)
    markers = {"standard": "o", "flash": "*"}
    for k, name in enumerate(chips):
        c = roofline.chip(name)
        color = f"C{k}"
        peak = c.peak_flops(dtype)
        ax.loglog(x, np.minimum(peak, x * c.hbm_bytes_per_s), color=color, lw=1.5,
                  label=f"{name}: {peak / 1e12:.0f} TFLOP/s, {c.hbm_bytes_per_s / 1e12:.2f} TB/s")
        pts = io_model.algorithm_points(name, batch=batch, heads=heads, seq_len=seq_len,
                                        head_dim=head_dim, dtype=dtype, block_q=block_q,
                                        is_causal=is_causal)
        for alg, p in pts.items():
            ax.loglog(p["intensity"], p["flops_per_s"], markers[alg], color=color, ms=9,
                      mec="k", mew=0.5)
    for alg, m in markers.items():
        ax.plot([], [], m, color="gray", mec="k", label=f"{alg} attention (bound)")
    if measured:
        mc = measured_chip or chips[0]
        pts = io_model.measured_points(measured, batch=batch, heads=heads)
        if pts:
            ax.loglog([p["intensity"] for p in pts], [p["flops_per_s"] for p in pts], "x",
                      color="k", ms=8, label=f"measured ({mc})")
    ax.set_xlabel("arithmetic intensity (FLOPs / HBM byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(f"roofline, forward, N = {seq_len}, d = {head_dim}")
    ax.legend(fontsize=6.5, loc="lower right")
    fig.tight_layout()
    return fig


def _schedule_grid(seq_len, block_q, block_k, is_causal, head_dim, dtype):
    try:
        return traffic.kernel_grid("forward", batch=1, heads=1, seq_len=seq_len,
                                   head_dim=head_dim, dtype=dtype, block_q=block_q,
                                   block_k=block_k, is_causal=is_causal)
    except NotImplementedError:
        raise


def tile_schedule_frame(ax, schedule, step: int, *, num_q_blocks: int, num_kv_blocks: int):
    """Draw grid step ``step`` of a :func:`flashlab.instruments.traffic.tile_schedule` on ``ax``.

    The (i, j) score-tile grid: visited tiles grey, the current one dark, tiles the kernel
    skips (its K/V index does not follow j) hatched; Q_i / O_i on the left, K_j / V_j on top,
    orange when this step copies them.
    """
    from matplotlib.patches import Rectangle
    pts = schedule["grid_points"]
    ki = schedule["ops"]["k"]["index"][:, 2]
    ax.set_xlim(-1.5, num_kv_blocks)
    ax.set_ylim(num_q_blocks, -1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    for t in range(len(pts)):
        i, j = int(pts[t][2]), int(pts[t][3])
        skipped = int(ki[t]) != j
        if t < step:
            fc = "0.85"
        elif t == step:
            fc = "0.35" if not skipped else "0.7"
        else:
            fc = "white"
        ax.add_patch(Rectangle((j, i), 1, 1, fc=fc, ec="0.6", lw=0.5,
                               hatch="///" if skipped else None))
    i, j = int(pts[step][2]), int(pts[step][3])
    copied = {n: bool(o["copied"][step]) for n, o in schedule["ops"].items()}
    col = lambda name: "tab:orange" if copied.get(name) else "tab:blue"  # noqa: E731
    ax.add_patch(Rectangle((-1.4, i), 0.6, 1, fc=col("q")))
    ax.add_patch(Rectangle((-0.7, i), 0.6, 1, fc=col("o")))
    kj = int(ki[step])
    ax.add_patch(Rectangle((kj, -1.4), 1, 0.6, fc=col("k")))
    ax.add_patch(Rectangle((kj, -0.7), 1, 0.6, fc=col("v")))
    ax.set_title(f"step {step}: (i, j) = ({i}, {j})" + ("  skipped" if kj != j else ""),
                 fontsize=8)


def tile_schedule_figure(*, seq_len: int = 512, block_q: int = 128, block_k: int = 128,
                         is_causal: bool = True, head_dim: int = 128, dtype="bfloat16",
                         steps: Sequence[int] | None = None, cols: int = 4):
    """Static frames of the forward kernel's tile schedule for one (batch, head).

    Each frame shows which Q_i, O_i (left) and K_j, V_j (top) blocks are resident at that
    grid step, orange when the step copies them, and the score tiles visited so far; causal
    steps above the diagonal are hatched: the kernel neither computes nor fetches for them.
    """
    plt = _plt()
    kg = _schedule_grid(seq_len, block_q, block_k, is_causal, head_dim, dtype)
    sch = traffic.tile_schedule(kg)
    nq, nk = kg.grid[2], kg.grid[3]
    T = len(sch["grid_points"])
    steps = list(range(min(T, 8))) if steps is None else list(steps)
    rows = -(-len(steps) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.8 * cols, 1.9 * rows), dpi=90,
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, s in zip(axes.flat, steps):
        tile_schedule_frame(ax, sch, s, num_q_blocks=nq, num_kv_blocks=nk)
    fig.suptitle(f"tile schedule, N = {seq_len}, B_r = {block_q}, B_c = {block_k}"
                 + (", causal" if is_causal else "") + "   (orange = copied this step)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def explorer_figure(*, seq_len: int = 4096, head_dim: int = 128, block_q: int = 512,
                    block_k: int = 512, dtype="bfloat16", chip: str = "v5e",
                    is_causal: bool = False, batch: int = 1, heads: int = 1):
    """What the traffic explorer shows for one setting: bytes per operand, VMEM, roofline.

    Left: replayed kernel bytes per operand beside the standard-attention model. Middle:
    pipeline VMEM against the chip's default scoped limit (dotted) and physical VMEM (dashed).
    Right: the chip's roofline with the kernel's point.
    """
    plt = _plt()
    c = roofline.chip(chip)
    e = _itemsize(dtype)
    kg = traffic.kernel_grid("forward", batch=batch, heads=heads, seq_len=seq_len,
                             head_dim=head_dim, dtype=dtype, block_q=block_q,
                             block_k=block_k, is_causal=is_causal)
    r = traffic.replay(kg)
    ops = [o.name for o in kg.operands]
    std = io_model.analytic_hbm_bytes("standard", batch=batch, heads=heads, seq_len=seq_len,
                                     head_dim=head_dim, bytes_per_element=e,
                                     masked=is_causal)["total"]
    vmem = traffic.pipeline_vmem_bytes(kg)
    frac = 0.5 if is_causal else 1.0
    flops = io_model.attention_flops("flash", batch=batch, heads=heads, seq_len=seq_len,
                                    head_dim=head_dim, causal_fraction=frac)
    tb = roofline.time_bound(flops, r["total"]["bytes"], c, dtype=dtype)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(9, 3.0), dpi=90,
                                     gridspec_kw={"width_ratios": [2, 1, 2]})
    a1.bar(ops, [r[o]["bytes"] / 2**20 for o in ops], color="tab:blue")
    a1.bar(["standard"], [std / 2**20], color="tab:gray")
    a1.set_yscale("log")
    a1.set_ylabel("MiB")
    a1.set_title(f"HBM traffic: {r['total']['bytes'] / 2**20:.1f} MiB", fontsize=9)
    scoped = c.scoped_vmem_bytes or c.vmem_bytes
    a2.bar(["VMEM"], [vmem / 2**20], color="tab:green" if vmem <= scoped else
           "tab:orange" if vmem <= c.vmem_bytes else "tab:red")
    a2.axhline(c.vmem_bytes / 2**20, color="tab:red", ls="--")
    a2.axhline(scoped / 2**20, color="tab:orange", ls=":")
    a2.set_ylabel("MiB")
    a2.set_title(f"{vmem / 2**20:.1f} MiB; limit {scoped / 2**20:.0f},\n"
                 f"VMEM {c.vmem_bytes / 2**20:.0f}", fontsize=9)
    x = np.geomspace(1, 1e4, 100)
    peak = c.peak_flops(dtype)
    a3.loglog(x, np.minimum(peak, x * c.hbm_bytes_per_s), "k-", lw=1)
    a3.loglog(tb["intensity"], flops / tb["seconds"], "*", ms=12, color="tab:orange")
    a3.set_xlabel("FLOPs / byte")
    a3.set_ylabel("FLOP/s")
    a3.set_title(f"{chip}: {tb['bound']}-bound, ≥ {tb['seconds'] * 1e6:.0f} µs", fontsize=9)
    fig.tight_layout()
    return fig
