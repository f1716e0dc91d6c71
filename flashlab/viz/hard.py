"""Figures of chapter 08 (the hard way): VMEM of a GPU-shaped port vs flashlab's blocks."""
from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["vmem_vs_seq_len"]


def vmem_vs_seq_len(seq_lens=(1024, 2048, 4096, 8192, 16384, 32768, 65536), head_dims=(128, 256),
                    dtype="bfloat16", chip: str = "v5e"):
    """VMEM per kernel instance vs sequence length: the GPU-style port (whole K/V row as one
    block) grows with N and crosses the chip's scoped-VMEM limit (the one flashlab's kernels ask
    Mosaic for); flashlab's chosen blocks stay flat."""
    from flashlab.kernels import blocks, gpu_style
    budget = blocks.vmem_limit_bytes(chip)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=90)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for c, d in zip(colors, head_dims):
        gpu = [gpu_style.gpu_style_vmem_bytes(n, d, dtype) / 2**20 for n in seq_lens]
        ours = [blocks.vmem_bytes(*blocks.choose_block_sizes(n, n, d, dtype, chip), d, dtype)
                / 2**20 for n in seq_lens]
        ax.plot(seq_lens, gpu, "o-", color=c, label=f"GPU-style port, d={d}")
        ax.plot(seq_lens, ours, "s--", color=c, label=f"flashlab blocks, d={d}")
    ax.axhline(budget / 2**20, color="k", lw=1)
    ax.text(seq_lens[0], budget / 2**20 * 1.12, f"{chip} limit {budget / 2**20:.0f} MiB "
            "(head_dim 64 pads to 128 lanes: same as 128)", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("VMEM per kernel instance (MiB)")
    ax.set_title(f"VMEM: whole-row K/V blocks vs chosen blocks ({dtype})", fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig
