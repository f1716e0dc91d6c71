"""Stored runs measured again after a change, set against the BEFORE file that names each
run's commit (chapters 05 and 07): static schedule, no DMA stalls, no HBM bandwidth."""
from __future__ import annotations

from pathlib import Path

from flashlab.benchmarks.tpu_static_report import row_key, before_after_table, shape_of
from flashlab.dispatch import static_table

__all__ = ["remeasured", "measured_again", "right_after"]


def remeasured(doc: dict, paths):
    """``(path, run, before)`` for each stored run at ``paths`` that a BEFORE file ``doc``
    names in its ``runs`` (each run's file and the commit it was measured at, before the
    change): ``before``, the file's rows of that run's shape, or ``None`` where the run is
    still the one at that commit (not measured again since)."""
    for path in map(Path, paths):
        if path.name not in doc["runs"]:
            continue
        run = static_table.stored(path)
        shape = shape_of(run["rows"][0])
        again = run["args"]["commit"] != doc["runs"][path.name]
        yield path, run, ([r for r in doc["rows"] if shape_of(r) == shape] if again else None)


def measured_again(doc: dict, paths, *, kernels, later=()) -> str:
    """For each run of :func:`remeasured` measured again since, flashlab's ``kernels`` of its
    shape before and after, at 512² and at the best blocks
    (:func:`tpu_static_report.before_after_table`); a run not measured again says so.
    ``later``: the BEFORE files of changes made after this one; their rows stand for the
    run's (:func:`right_after`), so "after" is the rows right after this change, not today's."""
    out = []
    for _, run, before in remeasured(doc, paths):
        run = dict(run, rows=right_after(run["rows"], later))
        shape = shape_of(run["rows"][0])
        if before is None:
            out.append(f"\n{shape}: not measured again, its run is the one at "
                       f"{run['args']['commit']}")
            continue
        for blocks in ("equal", "best"):
            out += [f"\n{shape}, {'512²' if blocks == 'equal' else 'best blocks'}:",
                    before_after_table(before, run["rows"], kernels=kernels, blocks=blocks)]
    return "\n".join(out)


def right_after(rows, later) -> list:
    """``rows`` as they stood before the changes whose BEFORE files are ``later``: each row
    one of those files holds (the same :func:`tpu_static_report.row_key`: shape, option, chip,
    library, kernel and blocks) replaced by that one, so a table of an earlier change shows
    its own "after", not today's."""
    then = {row_key(r): r for d in later for r in d["rows"]}
    return [then.get(row_key(r), r) for r in rows]
