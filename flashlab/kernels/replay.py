"""Replay a kernel's own BlockSpec index maps: which block is resident at each grid step.

Pallas' pipeline copies a block from HBM to VMEM only when its block index differs from the
one of the previous grid step (the grid runs in row-major order, last axis fastest), and it
writes an output block back when its index is about to change. Calling the index maps with
plain ints reproduces exactly that schedule, without running the kernel.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

__all__ = ["grid_steps", "replay_index_maps"]


def grid_steps(grid: Sequence[int]):
    """Grid indices in execution order (row-major, last axis innermost)."""
    return list(itertools.product(*(range(int(g)) for g in grid)))


def replay_index_maps(grid: Sequence[int], specs: dict[str, Any], *prefetch) -> list[dict]:
    """One record per grid step: ``{"step", "blocks": {name: index}, "fetched": {name: bool}}``.

    ``specs`` maps operand names to ``pl.BlockSpec`` objects (the kernel's own); ``prefetch``
    are the scalar-prefetch values (e.g. NumPy int32 arrays) their index maps take after the
    grid indices. ``fetched[name]`` is True when the block index changed since the previous
    step: that step's copy (a DMA on a TPU).
    """
    records, prev = [], {}
    for step in grid_steps(grid):
        blocks = {n: tuple(int(x) for x in s.index_map(*step, *prefetch)) for n, s in specs.items()}
        fetched = {n: blocks[n] != prev.get(n) for n in specs}
        records.append({"step": step, "blocks": blocks, "fetched": fetched})
        prev = blocks
    return records
