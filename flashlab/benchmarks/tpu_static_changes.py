"""The fused backward's diagonal tiles, stage by stage (chapter 07): the stored BEFORE rows of a
change (``flashlab/data/*_before.json``: the rows of the run before it, with its provenance)
and the table that sets them against the stored run's rows after it. Static schedule: no DMA
stalls, no HBM bandwidth; not wall time. (The other before/after tables are
:func:`flashlab.benchmarks.tpu_static_report.before_after_table`'s.)"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["stored_before", "diagonal_cycles", "diagonal_table"]

DATA = Path(__file__).parent.parent / "data"


def stored_before(name: str) -> dict:
    """A stored BEFORE file of ``flashlab/data`` by name: ``"backward_subtiles_before"`` (the
    fused backward running every visible tile whole), ``"backward_quarters_before"`` (its
    diagonal tiles as 2 x 2 sub-tiles, before the kv strips), ``"grid_step_before"`` (the
    forward and the fused backward with Mosaic's DMA bounds checks and the packed visit list),
    ``"forward_strips_before"`` (the forward with its crossed tiles whole and the finalize's
    empty-row test), ``"backward_fold_before"`` (the fused backward before its folded grid and
    first-visit write), ``"causal_interior_before"`` (the forward and fused backward before
    their causal interior tiles stopped building a mask), ``"soft_cap_before"`` (the forward
    under a soft cap before it folded ``scale/cap`` into the query block; against the
    ``--soft-cap`` run, :data:`flashlab.dispatch.static_table.STORED_OPTIONS`),
    ``"window_band_before"`` (the ``--window`` run before the tiles inside the band stopped
    building a mask and the default blocks under a window were priced from it),
    ``"window_grid_before"`` (that run's fused-backward rows, on the transposed visit list,
    before the dK/dV kernel walked the band by arithmetic: :func:`flashlab.kernels.band.
    grid_applies`), ``"noncausal_branch_before"`` (the forward and fused backward of the four
    non-causal runs, each tile still behind an always-true branch and the fused kernel still
    zeroing dK, dV per kv row), ``"forward_init_before"`` (the forward of those four runs with
    an init region storing each q row's opening state, before its first step took that state
    through a select), ``"forward_vmem_before"`` (the forward of all eleven runs while it asked
    Mosaic for the chip's whole VMEM ceiling, before it asked for its blocks' need:
    :func:`flashlab.kernels.forward_grid.scoped_vmem_bytes`). Chapters 05 and 07 set these
    against a run with
    :func:`tpu_static_report.before_after_table` (per run with
    :func:`tpu_static_remeasured.measured_again`, where the file names each run's commit:
    ``"forward_vmem_before"``, ``"dq_zeroing_before"``, the fused backward's rows of the four
    non-causal runs before its first kv row wrote dQ, ``"grads_on_lanes_before"``, v6e's and
    7x's of them before dO and dQ took the query positions on lanes:
    :data:`flashlab.kernels.backward_config.GRADS_ON_LANES`; ``"causal_lanes_before"``, v6e's
    and 7x's fused rows of the six causal runs before the causal kernel did too)."""
    return json.loads((DATA / f"{name}.json").read_text())


def diagonal_cycles(row: dict) -> int:
    """What one tile the causal diagonal crosses costs in a fused-backward bench row: the mean
    of its case regions over the tiles that take each (kv strips), else the partial path's
    own cycles plus the sub-tiles it runs on average (2 x 2 sub-tiles), else the whole tile."""
    if row.get("case_tiles") and sum(row["case_tiles"]):
        n = row["case_tiles"]
        return round(sum(a * b for a, b in zip(n, row["case_cycles"])) / sum(n))
    if row.get("partial_tiles") and row.get("partial_chunks"):
        return round(row["partial_overhead_cycles"]
                     + row["partial_chunks"] / row["partial_tiles"] * row["chunk_cycles"])
    return row["tile_cycles"]


def diagonal_table(stages) -> str:
    """The fused backward at each stage of its diagonal, per chip and block pair measured at
    every stage: ``stages`` is ``[(label, rows), ...]``, oldest first. Per stage the cost of a
    tile the diagonal crosses (:func:`diagonal_cycles`) and the whole-kernel estimate (ms);
    last, the ratio to splash's fused backward at the same pair in the last stage's rows
    (``-`` where it was not measured there)."""
    def key(r):
        return (r["chip"], r["block_q"], r["block_k"])

    def fused(rows, lib="flashlab"):
        return {key(r): r for r in rows if r.get("library") == lib
                and r.get("kernel") == "fused" and r.get("est_ms") is not None}
    runs = [fused(rows) for _, rows in stages]
    splash = fused(stages[-1][1], "splash_fused")
    w = max(7, *(len(label) for label, _ in stages))
    out = [f"{'chip':4} {'blocks':>9}  " + " ".join(f"{label:>{w}}" for label, _ in stages)
           + "  | " + " ".join(f"{label:>{w}}" for label, _ in stages) + "  x splash",
           f"{'':4} {'':>9}  " + f"{'diagonal tile (cycles)':^{len(stages) * (w + 1) - 1}}"
           + "  | " + f"{'estimate (ms)':^{len(stages) * (w + 1) - 1}}"]
    keys = set.intersection(*(set(r) for r in runs))
    for k in sorted(keys, key=lambda k: (k[0], k[1] * k[2], k[1])):
        rs = [r[k] for r in runs]
        ratio = f"{rs[-1]['est_ms'] / splash[k]['est_ms']:.2f}" if k in splash else "-"
        out.append(f"{k[0]:4} {k[1]:>4}x{k[2]:<4}  "
                   + " ".join(f"{diagonal_cycles(r):>{w}}" for r in rs) + "  | "
                   + " ".join(f"{r['est_ms']:>{w}.2f}" for r in rs) + f"  {ratio:>8}")
    return "\n".join(out)

