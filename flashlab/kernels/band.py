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
"""
from __future__ import annotations

import functools

from flashlab.contract import masks
from flashlab.kernels.block_ranges import num_edge_blocks

# ``ForwardConfig`` (kernels/forward_config.py) is only named in annotations: that module
# imports this one, so importing it back would make a cycle.

__all__ = ["applies", "forward_applies", "inside", "visits", "forward_visits"]


def applies(cfg: ForwardConfig) -> bool:
    """Whether a visible tile of ``cfg`` may be told inside the band from positions alone: a
    window, :attr:`ForwardConfig.positions_only` and no length masks (q lengths, kv lengths or
    kv padding), each of which would still mask an inside tile."""
    return (cfg.window is not None and cfg.positions_only
            and not (cfg.mask_q_len or cfg.mask_kv_len))


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
