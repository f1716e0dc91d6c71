"""The committed static-schedule run (``flashlab/data/tpu_static.json``), as ``auto`` reads it.

``python -m flashlab bench tpu-static`` (:mod:`flashlab.benchmarks.tpu_static`) writes the run;
on a TPU, :func:`flashlab.dispatch.registry.choose` orders the TPU kernels by
:func:`static_ranking` and ``explain`` quotes the figures it chose on. The figures are the real
compiler's static schedule (no DMA stalls, no HBM bandwidth): a ranking, not wall time.
"""
from __future__ import annotations

import json
from pathlib import Path

from flashlab.kernels import tuned_blocks

__all__ = ["STORED", "STORED_SHAPES", "KERNELS", "stored", "static_ranking"]

STORED = Path(__file__).resolve().parent.parent / "data" / "tpu_static.json"
#: The forward at issue 18's other shapes (T = 2048 and 32768, d = 64, non-causal), one bench
#: run per shape: ``stored(STORED_SHAPES)``; rows carry their shape (``tpu_static_report.shape_of``).
STORED_SHAPES = STORED.parent / "tpu_static_shapes.json"
KERNELS = ("forward", "dq", "dkdv")     # the kernels of one training step's attention
#: The libraries that are backends (``splash_fused`` and ``flashlab_split``, backward variants
#: of the bench, are not what the backends run by default).
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
    all three rows at ``blocks`` (forward and its fused backward kernel, where the library's
    default backward is fused), else the forward alone (``kernels`` says which). Default
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
    if not by:
        return [], f"the stored static run ({STORED.name}) has no {blocks}-block rows for {chip}"

    def step(k):              # (kernels, est): a fused backward is one kernel for dQ, dK, dV
        parts = tuned_blocks.whole_backward(k)
        if "forward" not in k or parts is None:
            return None
        kernels = ("forward",) + parts
        return kernels, sum(k[n] for n in kernels)
    full = all(step(k) is not None for k in by.values())
    ranked = sorted(((lib, *step(k)[::-1]) if full else (lib, k["forward"], ("forward",))
                     for lib, k in by.items() if full or "forward" in k), key=lambda t: t[1])
    a = doc.get("args", {})
    v = doc.get("versions", {})
    src = (f"{STORED.name}: static schedule, B={a.get('batch')} T={a.get('seq_len')} "
           f"H={a.get('heads')} d={a.get('head_dim')} {a.get('dtype')}"
           f"{' causal' if a.get('causal') else ''}, jax {v.get('jax')}, libtpu "
           f"{v.get('libtpu')}")
    return ranked, src
