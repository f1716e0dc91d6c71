"""Default blocks per TPU generation, as data: the winners of the static bench's sweep.

``python -m flashlab bench tpu-static --sweep ... --blocks-table flashlab/data/tpu_blocks.json``
compiles the kernels at each ``block_q x block_k`` pair with the real TPU compiler, estimates
each whole kernel from its static schedule, and stores the fastest pair per (kernel, chip,
shape class) here, with the figures of every pair it tried, the command and the commit.
``python -m flashlab bench tpu-blocks`` ranks every flashlab row of the stored runs instead
(``flashlab/data/tpu_static*.json``, each run of ``--update`` adding to them) and compiles
nothing.
``kernel`` is ``"forward"`` or ``"backward"`` (the dQ and dK/dV kernels share their blocks, so
a backward pair is ranked by the sum of their two estimates). A shape class is (chip, dtype,
causal, head_dim as the kernels carry it (:func:`~flashlab.kernels.tiling.kernel_head_dim`:
64 is its own class), sequence length within a factor of two of the measured one:
``[T/2, 2T)``); a head_dim below 128 without a class of its own takes the 128-lane one.
:func:`flashlab.kernels.blocks.choose_block_sizes` and
:func:`~flashlab.kernels.blocks.choose_backward_block_sizes` take the table's pair when it
fits the chip's VMEM and the tiling rule: the pair of the class that holds the request's
lengths, else of the class measured nearest to them (a sweep's winner hardly moves with the
length: at T = 2048, 8192 and 32768 the causal sweeps chose the same forward pair on every chip,
and the same backward pair on three of five); a chip with no class of the request's causality
takes the other's (the two winners agree in 36 of the 40 classes swept both ways). The VMEM-fit
heuristic is the fallback for what no sweep measured: a chip, dtype or head_dim
without a class.

Static estimates: no DMA stalls, no HBM bandwidth. They rank block sizes on one compiler's
schedule; calibrate on a real TPU when one is available.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from flashlab.kernels.tiling import kernel_head_dim, lane_pad

__all__ = ["TABLE", "BAND_RUN", "KERNELS", "BACKWARD_PARTS", "whole_backward", "table", "lookup",
           "log_distance", "band_rows",
           "class_of", "entries_from_rows", "stored_rows", "entries_from_stored", "class_key",
           "write"]

TABLE = Path(__file__).parent.parent / "data" / "tpu_blocks.json"
#: The stored sliding-window run (``bench tpu-static --window``): what the default blocks under
#: a window are priced from (:func:`band_rows`).
BAND_RUN = Path(__file__).parent.parent / "data" / "tpu_static_window.json"
KERNELS = ("forward", "backward")
#: The kernels of one whole backward, as the static bench names their rows: one fused kernel
#: (dQ, dK and dV; flashlab's or splash's), or the split's dQ and dK/dV kernels.
BACKWARD_PARTS = (("fused",), ("dq", "dkdv"))


def whole_backward(roles) -> tuple[str, ...] | None:
    """The kernel roles that make one whole backward among ``roles`` (the measured kernels of
    one library at one block pair; other roles, e.g. "forward", are ignored): one of
    :data:`BACKWARD_PARTS`, or ``None`` when the backward roles present are not exactly one
    of them (half a split, or a fused and a split backward mixed). The one rule the block
    table, the backend ranking and the bench report's whole-backward rows share."""
    got = {r for r in roles if r in ("dq", "dkdv", "fused")}
    return next((p for p in BACKWARD_PARTS if got == set(p)), None)


@functools.lru_cache(maxsize=4)
def _load(path: str) -> tuple:
    p = Path(path)
    if not p.exists():
        return ()
    return tuple(json.loads(p.read_text())["entries"])


def table(path=None) -> list[dict]:
    """The committed entries: each ``{kernel, chip, dtype, causal, head_dim, seq_min, seq_max,
    block_q, block_k, est_cycles, tried: [{block_q, block_k, est_cycles}], measured_at,
    command, commit, versions}`` (an entry without ``kernel`` is a forward one)."""
    return [dict(e, kernel=e.get("kernel", "forward")) for e in _load(str(path or TABLE))]


def class_of(chip: str, dtype, causal: bool, head_dim: int, seq_len: int, *,
             kernel: str = "forward") -> dict:
    """The shape class a measurement at ``seq_len`` stands for."""
    import jax.numpy as jnp
    return dict(kernel=kernel, chip=chip, dtype=jnp.dtype(dtype).name, causal=bool(causal),
                head_dim=kernel_head_dim(head_dim), seq_min=seq_len // 2,
                seq_max=2 * seq_len - 1)


def lookup(q_len: int, kv_len: int, head_dim: int, dtype, chip: str, *, is_causal: bool,
           kernel: str = "forward", path=None) -> dict | None:
    """The table entry of ``kernel`` (``"forward"`` or ``"backward"``) for a request: the
    class of the request's own head_dim (:func:`kernel_head_dim`), else, below 128, the
    128-lane class; of those, the class that holds both lengths, else the class measured
    nearest to them (:func:`log_distance`; the shorter on a tie), so that a length the
    sweeps skipped takes a measured neighbour's pair, not the heuristic's. Where the chip has
    no class of the request's causality at all for this (kernel, dtype, head_dim), the same
    search among the other causality's classes (where both were swept, d = 64 and 128 at
    T = 2048 to 32768, the causal and the non-causal winner agree in 36 of 40 classes, the
    four others on v4 and v5p). ``None`` only where the chip has no class for this (kernel,
    dtype, head_dim)."""
    entries = (_of_head_dim(head_dim, dtype, chip, kernel, is_causal, path)
               or _of_head_dim(head_dim, dtype, chip, kernel, not is_causal, path))
    held = next((e for e in entries if e["seq_min"] <= q_len <= e["seq_max"]
                 and e["seq_min"] <= kv_len <= e["seq_max"]), None)
    if held is not None or not entries:
        return held
    d = entries[0]["head_dim"]              # the nearest class of the first head_dim that has one
    return min((e for e in entries if e["head_dim"] == d),
               key=lambda e: (log_distance(q_len, kv_len, e["measured_at"]["seq_len"]),
                              e["seq_min"]))


def log_distance(q_len: int, kv_len: int, seq_len: int) -> float:
    """How far a ``q_len x kv_len`` request lies from a measurement at ``seq_len``, in
    doublings of the request's geometric-mean length: the one nearness rule of :func:`lookup`
    and :func:`flashlab.dispatch.static_table.nearest_run`."""
    return abs(math.log2(max(math.sqrt(q_len * kv_len), 1.0) / seq_len))


def band_rows(head_dim: int, dtype, chip: str, *, kernel: str = "forward",
              path=None) -> list:
    """flashlab's rows of the stored sliding-window run (:data:`BAND_RUN`: ``bench tpu-static
    --window``, every block pair swept) on ``chip`` for ``kernel`` (``"forward"``, or
    ``"backward"``: its fused kernel), one per block pair; ``[]`` where the run has none for
    this dtype and lane-padded head_dim. Each row has the parts of its estimate: the tile
    inside the band (``tile_cycles``), the tile an edge crosses (``case_cycles``), the grid
    step, at the run's shape (``seq_len``, ``window``);
    :func:`flashlab.kernels.blocks.band_estimate` prices a pair at another from them."""
    import jax.numpy as jnp
    _check_kernel(kernel)
    doc = _load_run(str(path or BAND_RUN))
    if doc is None or doc["args"].get("dtype") != jnp.dtype(dtype).name:
        return []
    best = {}
    for r in doc["rows"]:
        if (r.get("library") == "flashlab" and r.get("chip") == chip and "error" not in r
                and r.get("kernel") == ("forward" if kernel == "forward" else "fused")
                and r.get("head_dim") == lane_pad(head_dim)):
            k = (r["block_q"], r["block_k"])
            if k not in best or r["est_cycles"] < best[k]["est_cycles"]:
                best[k] = r
    return [best[k] for k in sorted(best)]


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")


@functools.lru_cache(maxsize=2)
def _load_run(path: str) -> dict | None:
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else None


def _of_head_dim(head_dim, dtype, chip, kernel, causal, path) -> list:
    """The entries of ``kernel`` on ``chip`` for ``dtype`` and ``causal``: the class of the
    request's own head_dim (:func:`kernel_head_dim`) first, then, below 128, the 128-lane one."""
    import jax.numpy as jnp
    _check_kernel(kernel)
    name = jnp.dtype(dtype).name
    return [e for d in dict.fromkeys((kernel_head_dim(head_dim), lane_pad(head_dim)))
            for e in table(path)
            if (e["kernel"] == kernel and e["chip"] == chip and e["dtype"] == name
                and e["causal"] == bool(causal) and e["head_dim"] == d)]


def entries_from_rows(rows, *, dtype: str, command: str, commit: str, versions: dict) -> list:
    """One entry per (kernel, chip, shape) from a bench run's flashlab rows: the pair with the
    lowest whole-kernel estimate, and every pair tried. A backward pair's estimate is its dQ
    plus its dK/dV estimate, or its fused kernel's where ``backward="auto"`` ran that
    (:func:`backward_grid.resolve_backward`); a pair with only one of dQ and dK/dV measured
    is not ranked.
    ``row_commits``: the commits the group's rows record (stored rows do, a fresh run's rows
    do not)."""
    groups = {}
    for r in rows:
        if r.get("library") != "flashlab" or "error" in r:
            continue
        kernel = "forward" if r.get("kernel") == "forward" else "backward"
        groups.setdefault((kernel, r["chip"], r["causal"], r["head_dim"], r["seq_len"]),
                          []).append(r)
    out = []
    for (kernel, chip, causal, d, T), rs in groups.items():
        per = {}                           # (bq, bk) -> {kernel role: lowest estimate}
        for r in rs:
            k = per.setdefault((r["block_q"], r["block_k"]), {})
            k[r["kernel"]] = min(k.get(r["kernel"], r["est_cycles"]), r["est_cycles"])
        tried = {}      # a pair's backward: its fused kernel, or its dQ + dK/dV (what ran)
        for pair, v in per.items():
            parts = ("forward",) if kernel == "forward" else whole_backward(v)
            if parts is not None and set(v) == set(parts):
                tried[pair] = sum(v[n] for n in parts)
        if not tried:
            continue
        (bq, bk), est = min(tried.items(), key=lambda t: t[1])
        out.append(dict(class_of(chip, dtype, causal, d, T, kernel=kernel), block_q=bq,
                        block_k=bk,
                        est_cycles=est, measured_at=dict(seq_len=T, batch=rs[0].get("batch"),
                                                         heads=rs[0].get("heads")),
                        tried=[dict(block_q=q, block_k=k, est_cycles=c)
                               for (q, k), c in sorted(tried.items())],
                        command=command, commit=commit, versions=dict(versions),
                        row_commits=sorted({str(r["commit"]) for r in rs if "commit" in r})))
    return out


def stored_rows(doc: dict) -> list:
    """A stored run's rows, each with the ``commit`` and ``versions`` it was measured at. A
    run installed as it came out names them once, in its ``args`` and ``versions``; a row
    that records its own (``bench tpu-static --update``) keeps them."""
    a, v = doc.get("args") or {}, doc.get("versions") or {}
    stamp = {"versions": v} | ({"commit": a["commit"]} if a.get("commit") else {})
    return [stamp | r for r in doc["rows"]]


def entries_from_stored(paths, *, command: str, commit: str) -> list:
    """:func:`entries_from_rows` over every row of the stored runs ``paths`` (the JSON that
    ``bench tpu-static --update`` writes), one dtype at a time. Each entry's ``commit`` is
    the commits its rows were measured at (``row_commits``, joined; a row without one was
    measured at its run's ``args.commit``), ``ranked_at`` the
    ``commit`` of this ranking, ``command`` its command, ``versions`` the runs' library
    versions. A pair measured by several rows (its default-blocks row and its sweep row) is
    ranked by the lowest of their estimates."""
    rows, versions = [], {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        rows += stored_rows(doc)
        versions.update(doc.get("versions") or {})
    out = []
    for dtype in sorted({r.get("dtype", "bfloat16") for r in rows}):
        mine = [r for r in rows if r.get("dtype", "bfloat16") == dtype]
        for e in entries_from_rows(mine, dtype=dtype, command=command, commit=commit,
                                   versions=versions):
            out.append(dict(e, commit=", ".join(e["row_commits"]), ranked_at=commit))
    return out


def class_key(e) -> tuple:
    """What names an entry's shape class: (kernel, chip, dtype, causal, head_dim, seq_min)."""
    return (e.get("kernel", "forward"), e["chip"], e["dtype"], e["causal"], e["head_dim"],
            e["seq_min"])


def write(path, entries) -> list:
    """Replace the entries of ``path`` with the same shape class by ``entries``."""
    p = Path(path)
    old = json.loads(p.read_text())["entries"] if p.exists() else []
    new = {class_key(e): e for e in entries}
    out = [e for e in old if class_key(e) not in new] + list(new.values())
    p.write_text(json.dumps(dict(note=__doc__.split("\n\n")[0], entries=out), indent=1) + "\n")
    _load.cache_clear()
    return out
