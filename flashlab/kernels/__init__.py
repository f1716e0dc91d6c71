"""Pallas TPU kernels: the FlashAttention forward, block-size choice, padding, a first kernel.

``flash_attention`` compiles with Mosaic on a TPU and runs in Pallas interpret mode elsewhere.
Every Pallas import lives in :mod:`flashlab.compat.pallas`.
"""
from flashlab.kernels import blocks, examples, forward
from flashlab.kernels.blocks import (
    choose_block_sizes, vmem_bytes, vmem_capacity_bytes, vmem_budget_bytes)
from flashlab.kernels.forward import (
    ForwardConfig, ForwardGridSpec, flash_attention, flash_attention_forward,
    flash_attention_from_spec, forward_grid_spec, make_config)

__all__ = ["flash_attention", "flash_attention_from_spec", "flash_attention_forward",
           "choose_block_sizes", "vmem_bytes", "vmem_capacity_bytes", "vmem_budget_bytes",
           "forward_grid_spec", "make_config", "ForwardConfig", "ForwardGridSpec",
           "blocks", "examples", "forward"]
