"""Chapter 08 figure and the GPU-style VMEM model."""
import matplotlib
matplotlib.use("Agg")

from flashlab.kernels import blocks, gpu_style
from flashlab.viz import hard


def test_gpu_style_vmem_grows_with_n_and_crosses_the_budget():
    small = gpu_style.gpu_style_vmem_bytes(1024, 128, "bfloat16")
    big = gpu_style.gpu_style_vmem_bytes(65536, 128, "bfloat16")
    assert big > 32 * small > 0
    assert big > blocks.vmem_budget_bytes("v5e")
    # at head_dim 256 it crosses even the limit flashlab's kernels ask for (the figure's line)
    assert gpu_style.gpu_style_vmem_bytes(65536, 256, "bfloat16") > blocks.vmem_limit_bytes("v5e")
    bq, bk = blocks.choose_block_sizes(65536, 65536, 128, "bfloat16", "v5e")
    assert blocks.vmem_bytes(bq, bk, 128, "bfloat16") <= blocks.vmem_limit_bytes("v5e")


def test_figure():
    fig = hard.vmem_vs_seq_len(seq_lens=(1024, 4096), head_dims=(128,))
    assert len(fig.axes) == 1 and len(fig.axes[0].lines) >= 3
