"""Changes measured stage by stage: the fused backward's diagonal tiles (chapter 07) and the grid
step (chapter 05). The stored BEFORE rows of a change (``flashlab/data/*_before.json``: the
rows of the run before it, with its provenance) and the tables that set them against the
stored run's rows after it. Static schedule: no DMA
stalls, no HBM bandwidth; not wall time. (The other before/after tables are
:func:`flashlab.benchmarks.tpu_static_report.before_after_table`'s.)"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["stored_before", "diagonal_cycles", "diagonal_table", "step_table"]

DATA = Path(__file__).parent.parent / "data"


def stored_before(name: str) -> dict:
    """A stored BEFORE file of ``flashlab/data`` by name: ``"backward_subtiles_before"`` (the
    fused backward running every visible tile whole), ``"backward_quarters_before"`` (its
    diagonal tiles as 2 x 2 sub-tiles, before the kv strips), ``"grid_step_before"`` (the
    forward and the fused backward with Mosaic's DMA bounds checks and the packed visit list)."""
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


def step_table(before, after, *, kernels=("forward", "fused"), blocks=("equal", "default")) -> str:
    """Per chip, kernel, shape and block pair measured in both runs (flashlab's rows of
    ``blocks``): the grid step's cycles and the whole-kernel estimate (ms) before and after,
    and their ratio (``nc``: non-causal). ``before``/``after``: bench rows."""
    def key(r):
        return (r["chip"], r["kernel"], r["blocks"], r["block_q"], r["block_k"], r.get("seq_len"),
                r.get("head_dim"), r.get("causal"))

    def pick(rows):
        return {key(r): r for r in rows if r.get("library") == "flashlab"
                and r.get("kernel") in kernels and r.get("blocks") in blocks
                and r.get("est_ms") is not None}
    b, a = pick(before), pick(after)
    order = {c: n for n, c in enumerate(("v4", "v5e", "v5p", "v6e", "7x"))}
    out = [f"{'chip':4} {'kernel':7} {'shape':18} {'blocks':7} {'bq x bk':>9}  "
           f"{'step before':>11} {'after':>5}  {'est ms before':>13} {'after':>7} {'ratio':>6}"]
    out.append("-" * len(out[0]))
    for k in sorted(set(a) & set(b), key=lambda k: (order.get(k[0], 9), kernels.index(k[1]),
                                                    k[5] or 0, -(k[6] or 0), not k[7],
                                                    blocks.index(k[2]))):
        rb, ra = b[k], a[k]
        shape = f"T={k[5]} d={k[6]}{'' if k[7] else ' nc'}"
        out.append(f"{k[0]:4} {k[1]:7} {shape:18} {k[2]:7} {k[3]:>4}x{k[4]:<4}  "
                   f"{rb['step_cycles']:>11} {ra['step_cycles']:>5}  {rb['est_ms']:>13.2f} "
                   f"{ra['est_ms']:>7.2f} {ra['est_ms'] / rb['est_ms']:>6.3f}")
    return "\n".join(out)
