"""Where a tile's MXUs wait: its opening, its close, and the cycles between (chapter 07,
"What is left at 512²").

A tile of :class:`flashlab.instruments.tpu_schedule.TileSchedule` is ``tile_cycles`` bundles,
of which ``mxu_cycles`` would be matmul if every MXU were busy all the time. The rest is
either *at the edges* (the MXUs wait for their first weights, or every matmul has issued and
the tile waits for the last results to pop and be stored) or *between* (the MXUs wait on the
softmax in the middle of the tile). :func:`mxu_edges` tells them apart from the compiler's
own per-bundle table (its MXU column: how many MXUs are busy in each bundle of the tile);
:func:`opening` lists the tile's first bundles, to see what the MXUs wait on, and
:func:`opening_line` draws them one character a cycle.

Static, as every figure of the schedule: the edges a real run adds (DMA waits, HBM) are not
here, and a dense grid's unpredicated tile (:attr:`TileSchedule.unpredicated`) holds the
step's own work inside its region, so its opening counts that too.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from flashlab.instruments import tpu_schedule as ts

__all__ = ["Edges", "mxu_edges", "opening", "opening_line"]


@dataclasses.dataclass(frozen=True)
class Edges:
    """A tile's cycles by what its MXUs do (cycles = bundles; they sum to the tile's)."""
    open_cycles: int      # before the first bundle with an MXU busy: waiting for weights
    close_cycles: int     # after the last: popping, scaling and storing the last results
    idle_cycles: int      # between those, no MXU busy
    partial_cycles: int   # between, some MXUs busy but not all
    full_cycles: int      # between, every MXU busy

    @property
    def edge_cycles(self) -> int:
        return self.open_cycles + self.close_cycles


def mxu_edges(s: ts.TileSchedule) -> Edges:
    """Split ``s.tile_cycles`` by MXU activity, from the compiler's table (``s.tile_util``).

    Raises ``ValueError`` for a schedule read without its table rows (``tile_util`` empty:
    a :class:`TileSchedule` rebuilt from :meth:`~TileSchedule.as_dict`) or a tile with no
    matmul."""
    if len(s.tile_util) != s.tile_cycles:
        raise ValueError(f"s: a TileSchedule with its table rows (tile_util, one per tile "
                         f"cycle) is needed, got {len(s.tile_util)} rows for "
                         f"{s.tile_cycles} cycles; read it with tpu_schedule.analyze")
    k = list(s.unit_capacity).index("MXU")
    busy = [row[k] for row in s.tile_util]
    on = [i for i, b in enumerate(busy) if b]
    if not on:
        raise ValueError(f"s: the tile of {s.kernel} keeps no MXU busy")
    mid = busy[on[0]:on[-1] + 1]
    return Edges(open_cycles=on[0], close_cycles=len(busy) - 1 - on[-1],
                 idle_cycles=sum(b == 0 for b in mid),
                 partial_cycles=sum(0 < b < s.num_mxu for b in mid),
                 full_cycles=sum(b == s.num_mxu for b in mid))


def opening(s: ts.TileSchedule, n: int = 16) -> list[list[str]]:
    """The opcodes of the tile's first ``n`` bundles (one list a cycle, ``[]`` for an empty
    latency bundle), read again from the dump ``s.path``."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n: expected a positive int (bundles to list), got {n!r}")
    bundles = ts.parse_bundles(ts._read(Path(s.path)), s.path)
    return [bundles[i].opcodes for i in s.tile_index[:n]]


def opening_line(s: ts.TileSchedule) -> str:
    """The tile's opening, up to its first busy MXU, one character a cycle: ``x`` a weight
    push into an MXU transposed (``vmatpush...xpose``), ``p`` a plain push, ``M`` a
    ``vmatmul`` (``M`` over ``x``/``p`` where a bundle holds both), ``.`` none of those."""
    def mark(ops):
        if any(o.startswith("vmatmul") for o in ops):
            return "M"
        pushes = [o for o in ops if o.startswith("vmatpush")]
        return "." if not pushes else "x" if any(".xpose" in o for o in pushes) else "p"
    n = mxu_edges(s).open_cycles            # 0: an MXU is busy from the tile's first cycle
    return "".join(mark(ops) for ops in opening(s, n)) if n else ""
