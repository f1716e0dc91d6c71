"""The committed static-schedule run (``flashlab/data/tpu_static.json``), as ``auto`` reads it.

``python -m flashlab bench tpu-static`` (:mod:`flashlab.benchmarks.tpu_static`) writes the run;
on a TPU, :func:`flashlab.dispatch.registry.choose` orders the TPU kernels by
:func:`static_ranking` and ``explain`` quotes the figures it chose on. The figures are the real
compiler's static schedule (no DMA stalls, no HBM bandwidth): a ranking, not wall time.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["STORED", "STORED_SHAPES", "KERNELS", "stored", "static_ranking"]

STORED = Path(__file__).resolve().parent.parent / "data" / "tpu_static.json"
#: The forward at issue 18's other shapes (T = 2048 and 32768, d = 64, non-causal), one bench
#: run per shape: ``stored(STORED_SHAPES)``; rows carry their shape (``tpu_static_report.shape_of``).
STORED_SHAPES = STORED.parent / "tpu_static_shapes.json"
KERNELS = ("forward", "dq", "dkdv")     # the kernels of one training step's attention
#: The libraries that are backends (``splash_fused``, splash with its fused backward, is a
#: bench variant, not what the splash backend runs).
BACKENDS = ("flashlab", "splash", "jax_pallas_flash")


def stored(path=None) -> dict:
    """The committed run (:data:`STORED`): ``{"versions", "args", "rows"}``."""
    p = Path(path or STORED)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no stored tpu-static run; make one with "
                                f"python -m flashlab bench tpu-static --json {p}")
    return json.loads(p.read_text())


def static_ranking(chip: str, *, blocks: str = "default", path=None):
    """The libraries ranked by the stored run's whole-kernel estimate on ``chip``, fastest
    first: ``([(library, est_ms, kernels)], source)``, or ``([], why)`` when the run has no
    rows for ``chip``.

    ``est_ms`` sums forward, dQ and dK/dV (one training step's attention) where a library has
    all three rows at ``blocks``, else the forward alone (``kernels`` says which); a fused
    backward row counts as dQ and dK/dV together. Default
    blocks: what ``attention(backend=...)`` runs for each library. ``source`` names the file,
    shape, commit and versions the figures come from.
    """
    try:
        doc = stored(path)
    except FileNotFoundError as e:
        return [], str(e)
    by = {}
    for r in doc["rows"]:
        if (r.get("chip") == chip and r.get("blocks") == blocks and "error" not in r
                and r.get("est_ms") is not None and r["library"] in BACKENDS):
            by.setdefault(r["library"], {})[r["kernel"]] = r["est_ms"]
    for k in by.values():          # a fused backward: one kernel for dQ, dK and dV
        if "fused" in k:
            k["dq"], k["dkdv"] = k.pop("fused"), 0.0
    if not by:
        return [], f"the stored static run ({STORED.name}) has no {blocks}-block rows for {chip}"
    full = all(set(KERNELS) <= set(k) for k in by.values())
    kernels = KERNELS if full else ("forward",)
    ranked = sorted(((lib, sum(k[n] for n in kernels), kernels) for lib, k in by.items()
                     if all(n in k for n in kernels)), key=lambda t: t[1])
    a = doc.get("args", {})
    v = doc.get("versions", {})
    src = (f"{STORED.name}: static schedule, B={a.get('batch')} T={a.get('seq_len')} "
           f"H={a.get('heads')} d={a.get('head_dim')} {a.get('dtype')}"
           f"{' causal' if a.get('causal') else ''}, jax {v.get('jax')}, libtpu "
           f"{v.get('libtpu')}")
    return ranked, src
