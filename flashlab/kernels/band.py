"""A sliding window's band: the tiles it holds whole build no mask (chapters 05 and 07).

Under a window ``(left, right)`` (with or without causal) every visible tile used to build the
full mask: two iotas and, per score, two or three compares, their ``and`` and a select. Only
the tiles the band's two edges cross need it. A tile ``[q0, q0 + B_r) x [k0, k0 + B_c)`` lies
wholly inside the band when its corners do (:func:`masks.block_fully_visible`): its last key
from its first query (causal, right edge) and its first key from its last query (left edge).
At ``left = 4096`` with 512² blocks that is 7 of a row's 9 visible tiles.

The forward and the fused backward test this once per step and run such a tile by a second,
unmasked path; the crossed tiles keep the masked one. The test is from positions alone, so it
:func:`applies` only where nothing else hides a score by position or data (no q/kv offsets,
bias, mask, segment ids or run-time lengths; kv padding is a run-time length). The static
schedule prices the two paths apart: the unmasked tile is the kernel's tile, and
:func:`visits` counts the edge tiles that take the masked one
(:func:`flashlab.instruments.tpu_schedule.kernel_cycles`, ``cases``).

The dK/dV kernel (split or fused) walks the band by arithmetic rather than by a visit list
(:func:`grid_applies`): kv block ``j`` is seen by at most :func:`q_steps` q blocks, from the
first of its range ``lo`` (:func:`block_ranges.q_block_range`, from positions alone) on, so
its grid ``(b, hk, j, g, t)`` runs q block ``lo + t``. A step past the row's last visible
block, ``hi``, fetches nothing (the index map clamps it) and computes nothing (the kernel
tests ``lo + t <= hi``, on the range the index map computes). Where a visit step reads ``(j, i)`` and
its flags from SMEM for every operand's index map, twice a step, this one computes the range
from ``j`` (a multiply and a division by the block), once for the index map's clamp and once
for the kernel's test: v5e, 512², causal T = 8192 under a 1024-key window, the fused
backward's step falls from 303 to 215 cycles (v6e 297 -> 215; the split dK/dV kernel's 262 ->
191 and 255 -> 186), for 48 steps a kv row where the list has 46.
The forward keeps its visit list: walked the same way (``kv_block_range``'s first block of q
block ``i``), its step fell only from 179 to 167 cycles on v5e (176 to 166 on v6e), and its 48
steps a row against the list's 46 left the whole forward where it was (1.521 -> 1.520 ms on
v5e, 0.535 -> 0.536 on v6e).
"""
from __future__ import annotations

import functools

from flashlab.contract import masks
from flashlab.kernels.block_ranges import num_edge_blocks, q_block_range

# ``ForwardConfig`` (kernels/forward_config.py) is only named in annotations: that module
# imports this one, so importing it back would make a cycle.

__all__ = ["applies", "forward_applies", "inside", "visits", "forward_visits", "GRID_MAX_SHARE",
           "grid_applies", "q_steps"]

#: The band grid's steps may be at most this many times the transposed visit list's
#: (:func:`grid_applies`): a band step that computes nothing still costs a step, ~70% of a
#: visit step (215 against 303 cycles on v5e, 215 against 297 on v6e), so up to 1.4x the
#: steps would still break even; 1.25 leaves a margin.
GRID_MAX_SHARE = 1.25


def applies(cfg: ForwardConfig) -> bool:
    """Whether a visible tile of ``cfg`` may be told inside the band from positions alone: a
    window, :attr:`ForwardConfig.positions_only` and no length masks (q lengths, kv lengths or
    kv padding), each of which would still mask an inside tile."""
    return cfg.window is not None and cfg.positions_only and not cfg.length_masked


def forward_applies(cfg: ForwardConfig) -> bool:
    """:func:`applies` to the forward: not where it may run a tile's row chunks one by one
    (:attr:`ForwardConfig.partial_tiles`: a window's left side not a multiple of ``B_c``)."""
    return applies(cfg) and not cfg.partial_tiles


def inside(cfg: ForwardConfig, q_start, k_start):
    """Whether the tile at ``(q_start, k_start)`` sees every score by the causal and window
    masks (ints, or traced int32 in a kernel)."""
    return masks.block_fully_visible(q_start, q_start + cfg.block_q, k_start,
                                     k_start + cfg.block_k, is_causal=cfg.is_causal,
                                     window=cfg.window)


@functools.lru_cache(maxsize=64)
def visits(cfg: ForwardConfig) -> tuple[int, ...]:
    """``(edge,)``: the visible tiles per (batch, head) a band edge crosses (the masked path),
    from positions alone (:func:`block_ranges.num_edge_blocks`); ``()`` where :func:`applies`
    is false. The bench's ``cases``."""
    if not applies(cfg):
        return ()
    return (num_edge_blocks(cfg.num_q_blocks, cfg.num_kv_blocks, q_len=cfg.q_len,
                            kv_len=cfg.kv_len, block_q=cfg.block_q, block_k=cfg.block_k,
                            is_causal=cfg.is_causal, window=cfg.window),)


def forward_visits(cfg: ForwardConfig) -> tuple[int, ...]:
    """:func:`visits` where :func:`forward_applies`, else ``()``."""
    return visits(cfg) if forward_applies(cfg) else ()


@functools.lru_cache(maxsize=64)
def q_steps(cfg: ForwardConfig) -> int:
    """The band grid's steps per kv row: the most q blocks any kv block may be seen by, from
    the first of its range on (run-time lengths only ever shorten a row)."""
    n = 1
    for j in range(cfg.num_kv_blocks):
        lo, hi = q_block_range(j, cfg.q_len, cfg.kv_len, block_q=cfg.block_q,
                               block_k=cfg.block_k, is_causal=cfg.is_causal, window=cfg.window)
        n = max(n, hi - lo + 1)
    return n


def grid_applies(cfg: ForwardConfig, q_chunks: int = 1) -> bool:
    """Whether the dK/dV kernel runs on the band grid instead of the transposed visit list:
    where the kernels skip invisible steps (``cfg.visit_grid``: no offsets), under a window,
    with the whole dQ resident (``q_chunks == 1``; chunks keep their lists) and at most
    :data:`GRID_MAX_SHARE` times the list's steps."""
    if not (cfg.visit_grid and cfg.window is not None and q_chunks == 1):
        return False
    listed = len(cfg.visits(transposed=True))
    return q_steps(cfg) * cfg.num_kv_blocks <= GRID_MAX_SHARE * listed
