"""The fused backward's diagonal sub-tiles before and after (chapter 07): the stored BEFORE
rows of a change (``flashlab/data/*_before.json``: the rows of the run before it, with its
provenance) and the table that sets them against the stored run's rows after it. Static
schedule: no DMA stalls, no HBM bandwidth; not wall time. (The other before/after tables are
:func:`flashlab.benchmarks.tpu_static_report.before_after_table`'s.)"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["stored_before", "sub_tile_table"]

DATA = Path(__file__).parent.parent / "data"


def stored_before(name: str) -> dict:
    """A stored BEFORE file of ``flashlab/data`` by name (``"backward_subtiles_before"``: the
    fused backward before its diagonal sub-tiles)."""
    return json.loads((DATA / f"{name}.json").read_text())


def sub_tile_table(before_rows, after_rows) -> str:
    """The fused backward before and after its diagonal sub-tiles, per chip and block pair
    measured on both sides: the cost of a tile the diagonal crosses (before: the whole tile;
    after: the partial path's own cycles plus its sub-tiles, as many as it runs on average),
    the per-step cycles, the whole-kernel estimate, and the ratio to splash's fused backward
    at the same pair after (``-`` where it was not measured there)."""
    def key(r):
        return (r["chip"], r["block_q"], r["block_k"])

    def fused(rows, lib="flashlab"):
        return {key(r): r for r in rows if r.get("library") == lib
                and r.get("kernel") == "fused" and r.get("est_ms") is not None}
    before, after, splash = fused(before_rows), fused(after_rows), fused(after_rows,
                                                                          "splash_fused")
    out = [f"{'chip':4} {'blocks':>9} {'diagonal tile':>17} {'step':>11} "
           f"{'est ms before > after':>22} {'x splash':>8}"]
    for k in sorted(set(before) & set(after), key=lambda k: (k[0], k[1] * k[2])):
        b, a = before[k], after[k]
        subs = a.get("partial_chunks", 0) / a["partial_tiles"] if a.get("partial_tiles") else 0
        diag = (round(a["partial_overhead_cycles"] + subs * a["chunk_cycles"]) if subs
                else a["tile_cycles"])
        ratio = f"{a['est_ms'] / splash[k]['est_ms']:.2f}" if k in splash else "-"
        out.append(f"{k[0]:4} {k[1]:>4}x{k[2]:<4} {b['tile_cycles']:>7} > {diag:<7} "
                   f"{b['step_cycles']:>4} > {a['step_cycles']:<4} "
                   f"{b['est_ms']:>10.2f} > {a['est_ms']:<9.2f} {ratio:>8}")
    return "\n".join(out)
