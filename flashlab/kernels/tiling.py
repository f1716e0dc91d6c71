"""The TPU's tiling arithmetic: 128 lanes, 8 sublanes, and rounding to them.

A VMEM block's last two dims must be multiples of ``(sublane_tile(dtype), LANES)`` or equal the
array's dims (the (8, 128) rule of chapter 04). Used by block-size choice
(:mod:`flashlab.kernels.blocks`) and the tuned block table (:mod:`flashlab.kernels.tuned_blocks`).
"""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["LANES", "SUBLANES", "round_up", "lane_pad", "kernel_head_dim", "sublane_tile"]

LANES = 128
SUBLANES = 8


def round_up(x: int, m: int) -> int:
    return -(-int(x) // m) * m


def lane_pad(d: int) -> int:
    """head_dim padded to a multiple of 128 lanes (64 -> 128, 80 -> 128, 256 -> 256)."""
    return round_up(d, LANES)


def kernel_head_dim(d: int) -> int:
    """The head_dim the kernels' HBM operands and blocks carry (64 -> 64, 80 -> 80, 192 -> 256).

    Below 128 lanes, ``d`` itself: a block dim equal to the array dim obeys the (8, 128) rule,
    so q, k, v, O and their gradients move ``d`` columns, not 128 (half the bytes at d = 64,
    and no padding copies in HBM). VMEM still lays a block out on whole 128-lane tiles, so
    the VMEM estimates keep :func:`lane_pad`. Above 128, rounded up to a multiple of 128 (a
    matmul contraction the compiler has not been checked on otherwise).
    """
    return int(d) if int(d) < LANES else lane_pad(d)


def sublane_tile(dtype) -> int:
    """Rows per native (sublane) tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit dtypes."""
    return SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)
