"""The kernels' visit lists: a grid over the visible (q block, kv block) pairs only.

The dense grid ``(B, H, T_r, T_c)`` pays a grid step for every pair, visible or not: at causal
``T = 8192`` with 512-blocks, 120 of 256 steps per (batch, head) do nothing but still run the
step's scalar work (index maps, the visibility test, the pipeline's bookkeeping). With a visit
list the grid is ``(B, H, n)``: step ``t`` reads visit ``t`` (scalar-prefetched into SMEM)
and the index maps and the kernel take ``(i, j)`` from it, as splash's mask info and the
Pallas "sparse" guide do. Only the positional masks (causal, window, the caller's static
lengths and the padding) shape the list; data-dependent lengths are still tested in the
kernel and clamped in the index maps.

Each entry packs one visit into an int32: ``i << 16 | j << 3 | flags`` with flags ``FIRST``
(the row's first visit: init), ``LAST`` (its last: finalize) and ``EMPTY`` (a q block that sees
no key at all gets one placeholder visit that computes nothing, so its ``O_i`` and ``lse_i``
are still written). A row's visits are consecutive and ``j`` increases within a row, so the
blocks copied are exactly those of the dense grid with clamped index maps, in the same order
(:func:`copied_blocks` replays both; the tests compare them).

The kernels do not read the packed list itself: they read its :func:`planes`, ``int32 [3n]``
= rows, then columns, then flags, so each index map is one SMEM load at a constant offset with
nothing to unpack (:func:`at`, :func:`step_at`). An index map runs twice a step per operand
(this step's block and the next's), so the shifts and masks of the packed form added up: on v5e
at 512², causal T=8192, the forward's grid step fell from 199 to 173 cycles (``bench
tpu-static``, jax 0.12.0.1). SMEM holds the planes (:data:`MAX_VISITS`).

The backward runs on visit lists too: the dQ kernel on the forward's (rows are q blocks), the
dK/dV kernel on the transposed one (``transposed=True``: rows are kv blocks ``j``, each listing
the q blocks ``i`` that see it, from :func:`blocks.q_block_range`; an entry packs
``j << 16 | i << 3 | flags``). The fused backward with its resident dQ in ``q_chunks`` query
chunks runs one such list per chunk, back to back (``q_chunks``: each kv row lists only its
q blocks inside the chunk, and a row with none there gets a placeholder in the chunk).
"""
from __future__ import annotations

import functools

import numpy as np

from flashlab.kernels import blocks as blk

__all__ = ["FIRST", "LAST", "EMPTY", "MAX_VISITS", "visit_table", "unpack", "planes", "at", "step_at",
           "copied_blocks"]

FIRST, LAST, EMPTY = 1, 2, 4
_J_BITS, _I_SHIFT = 13, 16
# SMEM holds the planes (12 bytes a visit). Beyond this many visits per (batch, head) the
# kernels keep the dense grid. Measured: a list of 32896 (395 KiB; T=131072, 512², causal)
# compiles on v4 and v5e with this limit raised; larger lists were never compiled.
MAX_VISITS = 1 << 15


@functools.lru_cache(maxsize=64)
def visit_table(*, num_q_blocks: int, num_kv_blocks: int, q_len: int, kv_len: int,
                block_q: int, block_k: int, is_causal: bool = False, window=None,
                transposed: bool = False, q_chunks: int = 1) -> np.ndarray:
    """The packed visit list ``int32 [n]`` of one (batch, head), rows in order.

    Rows are q blocks (the forward and dQ kernels), or kv blocks with ``transposed`` (the
    dK/dV kernel). ``q_len``/``kv_len``: the caller's static lengths (padding past them is
    never visited). ``q_chunks`` (``transposed`` only; it divides ``num_q_blocks``): the
    transposed list once per chunk of ``num_q_blocks // q_chunks`` q blocks, chunk by chunk,
    each row cut to the chunk's q blocks (an EMPTY placeholder in the chunk where none is
    left), so a q block's chunk is ``i // (num_q_blocks // q_chunks)``.
    Raises ``ValueError`` when a block index does not fit its bit field.
    Cached and read-only: a config's grid spec, its kernel call and its checks all ask for it.
    """
    rows, cols = (num_kv_blocks, num_q_blocks) if transposed else (num_q_blocks, num_kv_blocks)
    if rows >= 1 << (31 - _I_SHIFT) or cols >= 1 << _J_BITS:
        raise ValueError(f"num_q_blocks={num_q_blocks}, num_kv_blocks={num_kv_blocks}: the "
                         f"visit list packs its rows in {31 - _I_SHIFT} bits and its columns "
                         f"in {_J_BITS}; use larger blocks")
    if q_chunks != 1 and (not transposed or q_chunks < 1 or num_q_blocks % q_chunks):
        raise ValueError(f"q_chunks={q_chunks}: expected a divisor of num_q_blocks="
                         f"{num_q_blocks}, on a transposed list")
    span = blk.q_block_range if transposed else blk.kv_block_range
    per = cols // q_chunks
    out = []
    for chunk in range(q_chunks):
        first_col, last_col = chunk * per, chunk * per + per - 1
        for r in range(rows):
            lo, hi = span(r, q_len, kv_len, block_q=block_q, block_k=block_k,
                          is_causal=is_causal, window=window)
            if q_chunks > 1:
                lo, hi = max(lo, first_col), min(hi, last_col)
            if hi < lo:      # nothing visible: one step that only writes the row's zeros
                c = first_col if q_chunks > 1 else blk.clamp_block(0, lo, hi, cols)
                out.append(r << _I_SHIFT | c << 3 | FIRST | LAST | EMPTY)
                continue
            for c in range(lo, hi + 1):
                out.append(r << _I_SHIFT | c << 3 | (FIRST if c == lo else 0)
                           | (LAST if c == hi else 0))
    out = np.asarray(out, np.int32)
    out.setflags(write=False)
    return out


def unpack(v):
    """``(row, column, flags)`` of a packed visit: ``(i, j, flags)``, or ``(j, i, flags)`` in
    a transposed list (Python int, NumPy array or traced int32)."""
    return v >> _I_SHIFT, (v >> 3) & ((1 << _J_BITS) - 1), v & 7


def planes(table) -> np.ndarray:
    """The kernel operand of a packed visit list ``[n]``: ``int32 [3n]``, its rows, then its
    columns, then its flags (:func:`at` and :func:`step_at` read it)."""
    r, c, f = unpack(np.asarray(table, np.int64))
    out = np.concatenate([r, c, f]).astype(np.int32)
    out.setflags(write=False)
    return out


def at(ref, t):
    """``(row, column)`` of visit ``t`` from a :func:`planes` ``ref`` (an SMEM ref or an array,
    ``[3n]``; ``t`` traced or an int): two loads at static offsets, nothing to unpack."""
    n = ref.shape[0] // 3
    return ref[t], ref[n + t]


def step_at(ref, t):
    """Visit ``t`` as a kernel step reads it from a :func:`planes` ``ref``: ``(row, column,
    first, last, listed)``; ``first``/``last`` open and close the row (init, finalize),
    ``listed`` is False only for an EMPTY placeholder (nothing to compute)."""
    n = ref.shape[0] // 3
    f = ref[2 * n + t]
    return ref[t], ref[n + t], (f & FIRST) != 0, (f & LAST) != 0, (f & EMPTY) == 0


def copied_blocks(seq) -> list:
    """The block indices a pipeline copies for a sequence of per-step block indices: a block
    is copied only when it differs from the previous step's (Pallas's rule)."""
    out, prev = [], None
    for x in seq:
        if x != prev:
            out.append(x)
        prev = x
    return out
