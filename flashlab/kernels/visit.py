"""The forward kernel's visit list: a grid over the visible (q block, kv block) pairs only.

The dense grid ``(B, H, T_r, T_c)`` pays a grid step for every pair, visible or not: at causal
``T = 8192`` with 512-blocks, 120 of 256 steps per (batch, head) do nothing but still run the
step's scalar work (index maps, the visibility test, the pipeline's bookkeeping). With a visit
list the grid is ``(B, H, n)``: step ``t`` reads ``visits[t]`` (scalar-prefetched into SMEM)
and the index maps and the kernel decode ``(i, j)`` from it, as splash's mask info and the
Pallas "sparse" guide do. Only the positional masks (causal, window, the caller's static
lengths and the padding) shape the list; data-dependent lengths are still tested in the
kernel and clamped in the index maps.

Each entry packs one visit into an int32: ``i << 16 | j << 3 | flags`` with flags ``FIRST``
(the row's first visit: init), ``LAST`` (its last: finalize) and ``EMPTY`` (a q block that sees
no key at all gets one placeholder visit that computes nothing, so its ``O_i`` and ``lse_i``
are still written). A row's visits are consecutive and ``j`` increases within a row, so the
blocks copied are exactly those of the dense grid with clamped index maps, in the same order
(:func:`copied_blocks` replays both; the tests compare them).
"""
from __future__ import annotations

import numpy as np

from flashlab.kernels import blocks as blk

__all__ = ["FIRST", "LAST", "EMPTY", "MAX_VISITS", "visit_table", "unpack", "copied_blocks"]

FIRST, LAST, EMPTY = 1, 2, 4
_J_BITS, _I_SHIFT = 13, 16
# SMEM holds the list (4 bytes a visit). Beyond this many visits per (batch, head) the
# forward keeps the dense grid (unmeasured territory for SMEM size; say so, don't guess).
MAX_VISITS = 1 << 15


def visit_table(*, num_q_blocks: int, num_kv_blocks: int, q_len: int, kv_len: int,
                block_q: int, block_k: int, is_causal: bool = False, window=None) -> np.ndarray:
    """The packed visit list ``int32 [n]`` of one (batch, head), rows in order.

    ``q_len``/``kv_len``: the caller's static lengths (padding past them is never visited).
    Raises ``ValueError`` when a block index does not fit its bit field.
    """
    if num_q_blocks >= 1 << (31 - _I_SHIFT) or num_kv_blocks >= 1 << _J_BITS:
        raise ValueError(f"num_q_blocks={num_q_blocks}, num_kv_blocks={num_kv_blocks}: the "
                         f"visit list packs i in {31 - _I_SHIFT} bits and j in {_J_BITS}; "
                         f"use larger blocks")
    out = []
    for i in range(num_q_blocks):
        lo, hi = blk.kv_block_range(i, q_len, kv_len, block_q=block_q, block_k=block_k,
                                    is_causal=is_causal,
                                    window=window)
        if hi < lo:          # nothing visible: one step that only writes O_i = 0, lse = -inf
            j = blk.clamp_block(0, lo, hi, num_kv_blocks)
            out.append(i << _I_SHIFT | j << 3 | FIRST | LAST | EMPTY)
            continue
        for j in range(lo, hi + 1):
            out.append(i << _I_SHIFT | j << 3 | (FIRST if j == lo else 0)
                       | (LAST if j == hi else 0))
    return np.asarray(out, np.int32)


def unpack(v):
    """``(i, j, flags)`` of a packed visit (Python int, NumPy array or traced int32)."""
    return v >> _I_SHIFT, (v >> 3) & ((1 << _J_BITS) - 1), v & 7


def copied_blocks(seq) -> list:
    """The block indices a pipeline copies for a sequence of per-step block indices: a block
    is copied only when it differs from the previous step's (Pallas's rule)."""
    out, prev = [], None
    for x in seq:
        if x != prev:
            out.append(x)
        prev = x
    return out
