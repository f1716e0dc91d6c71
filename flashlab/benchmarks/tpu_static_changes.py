"""Before/after tables of issue 18's kernel changes (chapters 05 and 07): the stored BEFORE
rows (``flashlab/data/*_before.json``, ``backward_optimisations.json``: the rows of the run
before a change, with its provenance) set against the stored run's rows after it.
Static schedule: no DMA stalls, no HBM bandwidth; not wall time."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["stored_before", "stored_backward_before", "stored_forward_before",
           "before_after_table", "sub_tile_table"]

DATA = Path(__file__).parent.parent / "data"


def stored_before(name: str) -> dict:
    """A stored BEFORE file of ``flashlab/data`` by name (``"backward_subtiles_before"``: the
    fused backward before its diagonal sub-tiles)."""
    return json.loads((DATA / f"{name}.json").read_text())


def stored_backward_before(path=None) -> dict:
    """The stored BEFORE rows of the backward kernels (``data/backward_optimisations.json``:
    issue 18's backward changes, their provenance and the rows copied from the run before)."""
    p = Path(path) if path else DATA / "backward_optimisations.json"
    return json.loads(p.read_text())


def stored_forward_before(path=None) -> dict:
    """The stored BEFORE rows of the forward kernel (``data/forward_scores_before.json``: the
    base-2 score path's change, provenance, and flashlab's forward rows from before it, at
    every stored shape)."""
    p = Path(path) if path else DATA / "forward_scores_before.json"
    return json.loads(p.read_text())


def before_after_table(before_rows, after_rows, *, kernels=("dq", "dkdv"),
                       blocks: str = "equal", after_library: str = "flashlab") -> str:
    """flashlab's kernels before and after, per chip, at equal blocks (``blocks="equal"``) or
    at its fastest measured blocks (``"best"``): tile and per-step cycles, whole-kernel
    estimate, and the ratio to the better of splash and jax's kernel after (same blocks
    rule). Rows of one shape: filter ``before_rows``/``after_rows`` by :func:`shape_of`.
    ``after_library``: the after rows' library (``"flashlab_split"``: the split backward's
    kernels, now that flashlab's default backward is fused where it fits)."""
    from flashlab.benchmarks import tpu_static_report
    after_rows = [dict(r, library="flashlab") if r.get("library") == after_library else r
                  for r in after_rows if r.get("library") != "flashlab"
                  or after_library == "flashlab"]
    def eq(rows, lib, chip, kernel):
        rs = [r for r in rows if (r["library"], r["chip"], r["kernel"]) == (lib, chip, kernel)
              and (blocks == "best" or r["blocks"] == "equal")
              and r.get("est_cycles") is not None]
        return min(rs, key=lambda r: r["est_cycles"]) if rs else None
    out = [f"{'chip':4} {'kernel':6} {'tile before > after':>20} {'step before > after':>20} "
           f"{'est ms before > after':>22} {'x best other':>12}"]
    for chip in dict.fromkeys(r["chip"] for r in before_rows):
        for kernel in kernels:
            b, a = eq(before_rows, "flashlab", chip, kernel), eq(after_rows, "flashlab", chip, kernel)
            if b is None or a is None:
                continue
            others = [o for lib in tpu_static_report.OTHERS
                      if (o := eq(after_rows, lib, chip, kernel)) is not None]
            ratio = (f"{a['est_cycles'] / min(o['est_cycles'] for o in others):.2f}"
                     if others else "-")
            name = {"dq": "dQ", "dkdv": "dK/dV"}.get(kernel, kernel)
            pair = lambda r: f"{r['block_q']}x{r['block_k']}"  # noqa: E731
            if blocks != "equal":     # the blocks each side ran at
                name += f" {pair(a)}" if pair(a) == pair(b) else f" {pair(b)}>{pair(a)}"
            out.append(f"{chip:4} {name:6} {b['tile_cycles']:>9} > {a['tile_cycles']:<8} "
                       f"{b['step_cycles']:>9} > {a['step_cycles']:<8} "
                       f"{b['est_ms']:>10.2f} > {a['est_ms']:<9.2f} {ratio:>12}")
    return "\n".join(out)


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
