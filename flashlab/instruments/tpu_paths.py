"""Which regions of a kernel's grid loop are its tile's paths (:mod:`flashlab.instruments.
tpu_schedule` reads the rest): a kernel with one tile path has none to find; the forward's
row chunks (:func:`partial_path`) and the fused backward's diagonal strips
(:func:`case_paths`) have a whole tile beside other paths. Regions are
:class:`tpu_schedule.Region` s; ``mm``: the bundle indices of the loop's vmatmuls.
"""
from __future__ import annotations

__all__ = ["partial_path", "case_paths"]


def partial_path(holding: Region, inner: list, mm: list):
    """The forward's two tile paths (row chunks, :attr:`ForwardConfig.partial_tiles`), if
    ``holding`` (the smallest region with every vmatmul) is their parent: ``(full, partial,
    chunks)`` where ``full`` is the straight-line tile, ``partial`` the path whose chunks each
    sit in their own region (``chunks``); ``None`` for a kernel with one tile path."""
    def children(r):
        inside = [x for x in inner if r.contains(x)]
        return [x for x in inside if not any(y.contains(x) for y in inside)]

    def has_mm(r):
        return any(r.branch < i < r.target for i in mm)
    paths = [r for r in children(holding) if has_mm(r)]
    if len(paths) != 2 or any(not any(r.branch < i < r.target for r in paths) for i in mm
                              if holding.branch < i < holding.target):
        return None
    split = [(r, [c for c in children(r) if has_mm(c)]) for r in paths]
    full = [r for r, cs in split if not cs]
    part = [(r, cs) for r, cs in split if cs]
    if len(full) != 1 or len(part) != 1:
        return None
    return full[0], part[0][0], part[0][1]


def case_paths(holding: Region, inner: list, mm: list, rows: dict | None = None):
    """The fused backward's tile paths (:mod:`flashlab.kernels.diagonal`), if ``holding`` is
    their parent: ``(full, cases)``, the whole tile (the path with the most MXU work: ``rows``
    maps each vmatmul bundle to the rows it streams, default 1; a count of instructions
    misleads, a narrow piece issues more of them per row) and the straight-line case regions
    in program order; ``None`` otherwise."""
    inside = [x for x in inner if holding.contains(x)]
    top = [x for x in inside if not any(y.contains(x) for y in inside)]

    def count(r):
        return sum((rows or {}).get(i, 1) for i in mm if r.branch < i < r.target)
    paths = [r for r in top if count(r)]
    if (len(paths) < 2 or sum(map(count, paths)) != count(holding)
            or any(x.contains(y) and count(y) for x in paths for y in inside)):
        return None
    full = max(paths, key=count)
    return full, sorted((r for r in paths if r != full), key=lambda r: r.branch)
