"""Pallas TPU kernels: the FlashAttention forward and backward, decode, block sizes, first kernels.

- :mod:`~flashlab.kernels.flash`: ``flash_attention``, the forward and backward kernels joined
  by ``jax.custom_vjp``.
- :mod:`~flashlab.kernels.forward` (chapter 05), :mod:`~flashlab.kernels.backward` (chapter
  07), :mod:`~flashlab.kernels.decode` (chapter 12): the kernels and their grid specs.
- :mod:`~flashlab.kernels.blocks`: block sizes, VMEM budgets, per-chip facts.
- :mod:`~flashlab.kernels.examples`, :mod:`~flashlab.kernels.minimal`: chapter 04's first
  kernels; :mod:`~flashlab.kernels.gpu_style`: chapter 08's GPU-habit port;
  :mod:`~flashlab.kernels.replay`: the pipeline replay the traffic model reads.

``flash_attention`` compiles with Mosaic on a TPU and runs in Pallas interpret mode elsewhere.
Every Pallas import goes through :mod:`flashlab.compat.pallas`. Imports compat, contract and
ladder only.
"""
from flashlab.kernels import backward, blocks, examples, flash, forward
from flashlab.kernels.blocks import (
    choose_block_sizes, vmem_budget_bytes, vmem_bytes, vmem_capacity_bytes)
from flashlab.kernels.flash import flash_attention, flash_attention_from_spec
from flashlab.kernels.forward import flash_attention_forward
from flashlab.kernels.forward_grid import ForwardGridSpec, forward_grid_spec
from flashlab.kernels.forward_config import ForwardConfig, make_config

__all__ = ["flash_attention", "flash_attention_from_spec", "flash_attention_forward",
           "choose_block_sizes", "vmem_bytes", "vmem_capacity_bytes", "vmem_budget_bytes",
           "forward_grid_spec", "make_config", "ForwardConfig", "ForwardGridSpec",
           "backward", "blocks", "examples", "flash", "forward"]
