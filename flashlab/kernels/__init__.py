"""Pallas TPU kernels: the FlashAttention forward and backward, decode, block sizes, first kernels.

- :mod:`~flashlab.kernels.flash`: ``flash_attention``, the forward and backward kernels joined
  by ``jax.custom_vjp``.
- The forward (chapter 05): :mod:`~flashlab.kernels.forward_config` (the static
  ``ForwardConfig``), :mod:`~flashlab.kernels.forward_grid` (grid, BlockSpecs, index maps),
  :mod:`~flashlab.kernels.visit` (the grid over visible blocks only),
  :mod:`~flashlab.kernels.forward` (the kernel and its call).
- The backward (chapter 07): :mod:`~flashlab.kernels.backward_grid` and
  :mod:`~flashlab.kernels.backward` (the dK/dV, fused and dQ kernels),
  :mod:`~flashlab.kernels.dbias` (the dBias kernel); :mod:`~flashlab.kernels.band` (a
  window's band: unmasked inside tiles, the dK/dV kernel's band grid).
- Decode (chapter 12): :mod:`~flashlab.kernels.decode_grid` and :mod:`~flashlab.kernels.decode`.
- Block sizes: :mod:`~flashlab.kernels.blocks` (VMEM budgets and estimates, per-chip facts),
  :mod:`~flashlab.kernels.block_ranges` (the visible block ranges and the clamp: block
  skipping), :mod:`~flashlab.kernels.tuned_blocks` (the static bench's winners as data),
  :mod:`~flashlab.kernels.tiling` (the (8, 128) arithmetic); :mod:`~flashlab.kernels.refs`
  names a kernel's refs.
- :mod:`~flashlab.kernels.examples`, :mod:`~flashlab.kernels.minimal`: chapter 04's first
  kernels; :mod:`~flashlab.kernels.gpu_style`: chapter 08's GPU-habit port;
  :mod:`~flashlab.kernels.replay`: the pipeline replay the figures read.

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
