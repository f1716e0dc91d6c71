"""The committed static-schedule run (``flashlab/data/tpu_static.json``), as ``auto`` reads it.

``python -m flashlab bench tpu-static`` (:mod:`flashlab.benchmarks.tpu_static`) writes the run;
on a TPU, :func:`flashlab.dispatch.registry.choose` orders the TPU kernels by
:func:`static_ranking` and ``explain`` quotes the figures it chose on. The figures are the real
compiler's static schedule (no DMA stalls, no HBM bandwidth): a ranking, not wall time.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from flashlab.kernels import tuned_blocks

__all__ = ["STORED", "STORED_SHAPES", "KERNELS", "stored", "stored_shapes", "nearest_run",
           "static_ranking"]

STORED = Path(__file__).resolve().parent.parent / "data" / "tpu_static.json"
#: Issue 18's other shapes (T = 2048 and 32768, d = 64; causal, and non-causal at T = 2048,
#: 8192 and 32768 and at d = 64), and d = 256 (Gemma's head size: no issue target, measured
#: for its default blocks): one bench run per shape, each file a run's ``--json`` output as
#: it came out (the same libraries, kernels and block pairs as :data:`STORED`). Read them
#: together with :func:`stored_shapes`.
STORED_SHAPES = tuple(STORED.parent / f"tpu_static_{name}.json"
                      for name in ("t2048", "t32768", "d64", "noncausal_t2048", "noncausal",
                                   "noncausal_t32768", "noncausal_d64", "d256"))
#: Runs with an option set for every library (``bench tpu-static --window`` / ``--soft-cap``):
#: flashlab against splash where jax's kernel has no such option. Shown in chapter 07 and
#: the README, never ranked by ``auto`` (:func:`nearest_run` reads the runs above only); the
#: window run prices the default blocks under a window (:data:`tuned_blocks.BAND_RUN`).
STORED_OPTIONS = (tuned_blocks.BAND_RUN, STORED.parent / "tpu_static_softcap.json")
KERNELS = ("forward", "dq", "dkdv")     # the kernels of one training step's attention
#: The libraries that are backends (``splash_fused`` and ``flashlab_split``, backward variants
#: of the bench, are not what the backends run by default).
BACKENDS = ("flashlab", "splash", "jax_pallas_flash")


def stored(path=None) -> dict:
    """The committed run (:data:`STORED`): ``{"versions", "args", "rows"}``."""
    p = Path(path or STORED)
    if not p.exists():
        raise _missing(p)
    return json.loads(p.read_text())


def _missing(p: Path) -> FileNotFoundError:
    return FileNotFoundError(f"{p}: no stored tpu-static run; make one with "
                             f"python -m flashlab bench tpu-static --json {p}")


def stored_shapes(paths=None) -> dict:
    """The runs at the other shapes (:data:`STORED_SHAPES`) as one: ``{"runs", "rows"}``.

    ``runs`` holds each file's ``{"path", "versions", "args"}``; ``rows`` all their rows, each
    stamped with its run's ``commit`` and ``versions`` (a run installed as it came out names
    them once, in its ``args``), so a table over several shapes can say what each was measured
    on (:func:`flashlab.benchmarks.tpu_static_report.target_tables_by_shape`).
    """
    runs, rows = [], []
    for p in paths or STORED_SHAPES:
        doc = stored(p)
        runs.append({"path": str(p), "versions": doc.get("versions") or {},
                     "args": doc.get("args") or {}})
        rows += tuned_blocks.stored_rows(doc)
    return {"runs": runs, "rows": rows}


@functools.lru_cache(maxsize=8)
def _parsed(path: str, mtime_ns: int) -> dict:
    """:func:`stored` parsed once per file version: ``auto`` reads a run on every TPU trace.
    Read-only: callers that change a run take :func:`stored`'s fresh copy."""
    return stored(path)


def _cached(p: Path) -> dict:
    return _parsed(str(p), p.stat().st_mtime_ns)


def nearest_run(q_len: int, kv_len: int, head_dim: int, causal: bool, paths=None):
    """The stored run (:data:`STORED` or one of :data:`STORED_SHAPES`) whose shape class is
    nearest a request's: the same causality first, then the same head_dim class (≤ 64 or
    128), then the length nearest by :func:`tuned_blocks.log_distance` (the default blocks'
    rule too). ``None`` if none is stored."""
    best = None
    for p in paths or (STORED, *STORED_SHAPES):
        p = Path(p)
        if not p.exists():
            continue
        a = _cached(p).get("args") or {}
        seq, d, c = a.get("seq_len"), a.get("head_dim"), a.get("causal")
        key = (c is None or bool(c) != bool(causal),
               d is None or (d <= 64) != (head_dim <= 64),
               tuned_blocks.log_distance(q_len, kv_len, seq) if seq else math.inf)
        if best is None or key < best[0]:
            best = (key, p)
    return None if best is None else best[1]


def static_ranking(chip: str, *, blocks: str = "default", path=None, shape=None):
    """The libraries ranked by the stored run's whole-kernel estimate on ``chip``, fastest
    first: ``([(library, est_ms, kernels)], source)``, or ``([], why)`` when the run has no
    rows for ``chip``.

    ``est_ms`` sums forward, dQ and dK/dV (one training step's attention) where a library has
    all three rows at ``blocks`` (forward and its fused backward kernel, where the library's
    default backward is fused), else the forward alone (``kernels`` says which). Default
    blocks: what ``attention(backend=...)`` runs for each library. ``source`` names the file,
    shape, commit and versions the figures come from.

    ``path``: the stored run to read; else, given ``shape=(q_len, kv_len, head_dim,
    causal)``, the run of the nearest shape class (:func:`nearest_run`); else :data:`STORED`.
    """
    if path is None and shape is not None:
        path = nearest_run(*shape)
    path = Path(path or STORED)
    if not path.exists():
        return [], str(_missing(path))
    doc = _cached(path)
    by = {}
    for r in doc["rows"]:
        if (r.get("chip") == chip and r.get("blocks") == blocks and "error" not in r
                and r.get("est_ms") is not None and r["library"] in BACKENDS):
            by.setdefault(r["library"], {})[r["kernel"]] = r["est_ms"]
    if not by:
        return [], f"the stored static run ({path.name}) has no {blocks}-block rows for {chip}"

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
    src = (f"{path.name}: static schedule, B={a.get('batch')} T={a.get('seq_len')} "
           f"H={a.get('heads')} d={a.get('head_dim')} {a.get('dtype')}"
           f"{' causal' if a.get('causal') else ' non-causal'}, jax {v.get('jax')}, libtpu "
           f"{v.get('libtpu')}, commit {a.get('commit')}")
    return ranked, src
