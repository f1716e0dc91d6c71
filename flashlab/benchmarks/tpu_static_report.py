"""Reports of ``bench tpu-static`` runs: merge a run's rows into the stored file, each
library's best blocks, the issue-18 target table (flashlab against the better official
kernel), and the text tables the CLI prints."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

from flashlab.benchmarks.tpu_static_changes import (  # noqa: F401
    diagonal_cycles, diagonal_table, stored_before)
from flashlab.kernels import tuned_blocks

__all__ = ["LIBRARIES", "MATMULS", "ROLE_LABEL", "TARGETS", "update_rows", "best_blocks",
           "target_table", "target_tables_by_shape", "shape_of", "header", "table",
           "training_step_table", "backward_rows", "step_rows", "OTHERS", "BACKWARD_ROLES",
           "BACKWARD_VARIANTS", "fused_vs_split_table", "splash_dq_partial_bytes",
           "before_after_table", "stored_before", "diagonal_cycles", "diagonal_table", "row_key"]

#: Backward variants, measured for the backward only (their forward is their library's):
#: ``splash_fused``, splash with ``use_fused_bwd_kernel``; ``flashlab_split``, flashlab with
#: ``backward="split"`` (``flashlab`` runs ``"auto"``: the fused kernel wherever it fits). In
#: the backward's comparisons each counts as its library (:func:`backward_rows`).
BACKWARD_VARIANTS = {"splash_fused": "splash", "flashlab_split": "flashlab"}
LIBRARIES = ("flashlab", "splash", "jax_pallas_flash") + tuple(BACKWARD_VARIANTS)
OTHERS = ("splash", "jax_pallas_flash")         # what flashlab is set against
#: matmuls of one tile, per kernel; "fused": a whole backward in one kernel (flashlab's, or
#: splash's fused dK/dV kernel, which also writes dQ)
MATMULS = {"forward": 2, "dq": 3, "dkdv": 4, "fused": 5}
ROLE_LABEL = {"forward": "forward", "dq": "dQ", "dkdv": "dK/dV", "fused": "fused",
              "backward": "bwd"}
BACKWARD_ROLES = ("dq", "dkdv", "fused")


def row_key(r) -> tuple:
    """Rows replace each other by (chip, library, kernel, blocks, shape, window and soft cap)
    and, for sweep rows, block pair (a sweep has one row per block pair)."""
    k = (r["chip"], r["library"], r["kernel"], r["blocks"], r.get("seq_len"), r.get("head_dim"),
         r.get("causal"), tuple(r.get("window") or ()), r.get("soft_cap"))
    if r["blocks"] == "sweep":
        k += (r.get("block_q"), r.get("block_k"))
    return k


def _job_key(r) -> tuple:
    """A backward row's compile: its key without the kernel (one ``jax.grad`` compiles the
    split's two kernels, or one fused kernel)."""
    k = row_key(dict(r, kernel="backward"))
    return k if r.get("kernel") in BACKWARD_ROLES else ()


def update_rows(path, rows, *, versions: dict, command: str, commit: str) -> dict:
    """Replace the rows of the stored run at ``path`` that have the same (chip, library,
    kernel, blocks) as ``rows`` (also block pair and shape for sweep rows), append the rest;
    a backward compile's rows replace every backward row of that compile (a backward that
    was split and is now fused leaves no stale dQ and dK/dV rows). Each new row records
    ``command``, ``commit`` and ``versions``, and the document's ``updates`` list records the
    run. Returns the new document."""
    p = Path(path)
    doc = json.loads(p.read_text()) if p.exists() else {"versions": versions, "args": {},
                                                        "rows": []}
    new = {}
    for r in rows:
        r = dict(r, command=command, commit=commit, versions=dict(versions))
        new[row_key(r)] = r
    jobs = {_job_key(r) for r in new.values()} - {()}
    out, seen = [], set()
    for r in doc["rows"]:
        k = row_key(r)
        if k in new:
            if k not in seen:
                out.append(new[k])
                seen.add(k)
        elif _job_key(r) in jobs:
            continue                              # replaced by the new compile's rows
        else:
            out.append(r)
    out += [r for k, r in new.items() if k not in seen]
    doc["rows"] = out
    doc.setdefault("updates", []).append(dict(command=command, commit=commit, rows=len(rows),
                                              versions=dict(versions)))
    p.write_text(json.dumps(doc, separators=(",", ":")) + "\n")   # the stored file's format
    return doc


def best_blocks(rows, *, kernel="forward") -> dict:
    """``{(chip, library): row}``: the lowest whole-kernel estimate among a sweep's rows
    (and the default/equal rows) of one kernel."""
    best = {}
    for r in rows:
        if r.get("kernel") != kernel or "error" in r or r.get("est_cycles") is None:
            continue
        k = (r["chip"], r["library"])
        if k not in best or r["est_cycles"] < best[k]["est_cycles"]:
            best[k] = r
    return best


#: Issue 18's targets, flashlab / the better of splash and jax's kernel: at most 0.9x on v5e
#: and v6e, no worse than 1.0x on v4, v5p and 7x.
TARGETS = {"v4": 1.0, "v5e": 0.9, "v5p": 1.0, "v6e": 0.9, "7x": 1.0}


def target_table(rows, *, kernel: str = "forward", target: float | None = None) -> str:
    """flashlab against the better of splash and jax_pallas_flash, per chip: at equal blocks
    (the ``equal`` rows) and at each library's best blocks (lowest estimate among its
    default, equal and sweep rows), against the target ratio (``<= target``; ``None``: the
    issue's target for that chip, :data:`TARGETS`)."""
    out = [f"{'chip':4} {'blocks':6} {'flashlab':>18} {'best other':>30} {'ratio':>6} "
           f"{'target':>12}"]
    ok = [r for r in rows if r.get("kernel") == kernel and "error" not in r
          and r.get("est_cycles") is not None]
    for chip in dict.fromkeys(r["chip"] for r in ok):
        for mode in ("equal", "best"):
            pick = {}
            for lib in LIBRARIES:
                rs = [r for r in ok if r["chip"] == chip and r["library"] == lib
                      and (mode == "best" or r["blocks"] == "equal")]
                if rs:
                    pick[lib] = min(rs, key=lambda r: r["est_cycles"])
            others = [pick[k] for k in OTHERS if k in pick]
            if "flashlab" not in pick or not others:
                continue
            f, o = pick["flashlab"], min(others, key=lambda r: r["est_cycles"])
            ratio = f["est_cycles"] / o["est_cycles"]
            desc = lambda r: ((f"{r['est_ms']:.2f} ms " if r.get("est_ms") is not None  # noqa
                               else f"{r['est_cycles']} cyc ") + f"{r['block_q']}x{r['block_k']}"
                              + (f"+{r['bwd_blocks']}" if "bwd_blocks" in r else ""))
            t = TARGETS.get(chip, 0.9) if target is None else target
            verdict = f"<= {t:.1f} " + ("met" if ratio <= t else "MISSED")
            digits = next(n for n in (2, 3, 4) if round(ratio, n) != t or n == 4)  # 0.904, 0.8995
            out.append(f"{chip:4} {mode:6} {desc(f):>18} {o['library'] + ' ' + desc(o):>30} "
                       f"{ratio:6.{digits}f} {verdict:>12}")
    return "\n".join(out)


def shape_of(r) -> str:
    """A row's shape as a heading: ``B=2 T=8192 H=16 d=128 causal`` (`` window=(L, R)``,
    `` soft cap C`` for a run with ``--window``, ``--soft-cap``)."""
    w = f" window=({r['window'][0]}, {r['window'][1]})" if r.get("window") else ""
    w += f" soft cap {r['soft_cap']:g}" if r.get("soft_cap") else ""
    return (f"B={r.get('batch')} T={r.get('seq_len')} H={r.get('heads')} d={r.get('head_dim')} "
            f"{'causal' if r.get('causal') else 'non-causal'}{w}")


def target_tables_by_shape(rows, *, kernel: str = "forward") -> str:
    """:func:`target_table` once per shape among ``rows`` (the runs at the other shapes:
    :func:`flashlab.dispatch.static_table.stored_shapes`), each under its shape and the
    commit(s) its rows were measured at."""
    out = []
    for shape in dict.fromkeys(shape_of(r) for r in rows if r.get("kernel") == kernel):
        mine = [r for r in rows if shape_of(r) == shape]
        commits = sorted({str(r["commit"]) for r in mine if r.get("commit")})
        at = f" (commit {', '.join(commits)})" if commits else ""
        out += [shape + at, target_table(mine, kernel=kernel), ""]
    return "\n".join(out).rstrip()


def header(versions: dict, args: dict) -> str:
    """What the figures are and are not, with the versions, shape and commit."""
    return "\n".join([
        "Static schedule of the real TPU compiler (libtpu's packed bundles, 1 bundle = 1 cycle),",
        f"jax {versions.get('jax')}, libtpu {versions.get('libtpu')}, flashlab commit "
        f"{args.get('commit')}.",
        f"Shape: B={args['batch']} T={args['seq_len']} H={args['heads']} d={args['head_dim']} "
        f"{args['dtype']} {'causal' if args['causal'] else 'non-causal'}"
        f"{'' if not args.get('window') else ', window of ' + str(args['window']) + ' keys'}"
        f"{'' if not args.get('soft_cap') else ', soft cap ' + format(args['soft_cap'], 'g')}"
        "; blocks: each "
        f"kernel's default, and {args['block']}x{args['block']} for all ('equal').",
        "NOT wall time: no DMA waits, no HBM bandwidth, no stalls. Per TensorCore. The ms use a",
        "clock derived from JAX's chip table (see chip_clock). They rank kernels and blocks;",
        "calibrate on a real TPU when one is available.",
        "est = steps x step + visible tiles x tile + rows x (init + finalize) + prologue; floor =",
        "matmul FLOPs / bf16 peak; occ = static MXU occupancy of one tile.",
    ] + (textwrap.wrap(f"Note: {args['note']}", 92) if args.get("note") else []))


def table(rows) -> str:
    """The plain-text table the CLI prints."""
    head = (f"{'chip':4} {'kernel':6} {'blocks':7} {'library':17} {'bq x bk':>9} {'tile':>6} "
            f"{'step':>5} {'occ':>5} {'est ms':>8} {'floor':>6} {'x floor':>7} {'x splash':>8}")
    out = [head, "-" * len(head)]
    # Splash's estimate per (chip, kernel, blocks, block sizes) among these rows: a row stored
    # by --update from a run without splash has no ratio of its own.
    splash = {(r["chip"], r["kernel"], r["blocks"], r["block_q"], r["block_k"]): r["est_cycles"]
              for r in rows if r.get("library") in ("splash", "splash_fused")
              and r.get("est_cycles")}
    for r in rows:
        left = (f"{r['chip']:4} {ROLE_LABEL[r['kernel']]:6} {r['blocks']:7} "
                f"{r['library']:17}")
        if "error" in r:
            out.append(f"{left} FAILED: {r['error']}")
            continue
        ms = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        ratio = r["ratio_splash"]
        key = (r["chip"], r["kernel"], r["blocks"], r["block_q"], r["block_k"])
        if ratio is None and key in splash and r.get("est_cycles"):
            ratio = r["est_cycles"] / splash[key]
        rs = "-" if ratio is None else f"{ratio:.2f}"
        rf = "-" if r["ratio_floor"] is None else f"{r['ratio_floor']:.2f}"
        rf += "!" if (r["ratio_floor"] or 1) < 1 else ""       # below the floor: BELOW_FLOOR
        out.append(f"{left} {str(r['block_q']) + 'x' + str(r['block_k']):>9} "
                   f"{r['tile_cycles']:6d} {r['step_cycles']:5d} {r['occupancy']:5.0%} "
                   f"{ms(r['est_ms']):>8} {ms(r['floor_ms']):>6} {rf:>7} {rs:>8}")
    if any((r.get("ratio_floor") or 1) < 1 for r in rows):
        out += textwrap.wrap(BELOW_FLOOR, 92)
    return "\n".join(out)


#: The footnote of a row whose estimate reads below the peak-FLOP floor (see chip_clock).
BELOW_FLOOR = (
    "!: the estimate reads below the peak-FLOP floor, which no kernel can beat: the compiler's "
    "MXU model does more multiply-adds a cycle than the clock derived from JAX's peak allows "
    "(v6e, 7x: a d=256 tile at d=128's MXU cycles; a fused backward with dQ B_r wide). Compare "
    "its cycles with other libraries' at the same chip and shape, not its ms with the floor.")


def backward_rows(rows) -> list:
    """One row per whole backward (``kernel="backward"``): a library's backward kernels of
    one (chip, blocks, block pair, shape) summed, the split's dQ + dK/dV (``option="split"``)
    or one fused kernel (``option="fused"``). A variant's rows count as its library's
    (:data:`BACKWARD_VARIANTS`): the fused backward is one of splash's options, the split one
    of ours. ``est_cycles``,
    ``est_ms``, ``floor_ms`` and ``flops`` are the sums; ``parts`` the rows summed."""
    by = {}
    for r in rows:
        if (r.get("kernel") in BACKWARD_ROLES and "error" not in r
                and r.get("est_cycles") is not None):
            fused = r["kernel"] == "fused"
            lib = BACKWARD_VARIANTS.get(r["library"], r["library"])
            k = (r["chip"], lib, r["blocks"], r["block_q"], r["block_k"], r.get("batch"),
                 r.get("heads"), r.get("seq_len"), r.get("head_dim"), r.get("causal"), fused)
            by.setdefault(k, {})[r["kernel"]] = r
    out = []
    for k, parts in by.items():
        if tuned_blocks.whole_backward(parts) is None:
            continue
        ps = [parts[n] for n in tuned_blocks.whole_backward(parts)]
        first = ps[0]
        r = {f: first.get(f) for f in ("chip", "blocks", "block_q", "block_k", "batch", "heads",
                                         "seq_len", "head_dim", "causal")}
        r.update({f: first[f] for f in ("window", "soft_cap") if f in first})   # options
        ms = [p.get("est_ms") for p in ps]
        floor = [p.get("floor_ms") for p in ps]
        r.update(library=k[1], kernel="backward", option="fused" if k[-1] else "split",
                 est_cycles=sum(p["est_cycles"] for p in ps),
                 est_ms=None if None in ms else sum(ms),
                 floor_ms=None if None in floor else sum(floor),
                 flops=sum(p.get("flops") or 0 for p in ps),
                 tile_cycles=sum(p["tile_cycles"] for p in ps),
                 step_cycles=max(p["step_cycles"] for p in ps),
                 parts=[p["name"] for p in ps])
        out.append(r)
    return out


def step_rows(rows, *, modes=("equal", "best")) -> list:
    """One training step's attention per (chip, library, shape) and mode, ``kernel="step"``:
    the forward plus the whole backward (:func:`backward_rows`, the faster of split and fused),
    both at the ``"equal"`` (512²) or ``"default"`` blocks of ``modes``, or each at its fastest
    blocks (``"best"``; ``block_q``/``block_k`` the forward's, ``bwd_blocks`` the backward's).
    ``est_ms`` and ``floor_ms`` are the sums (``None`` where a part has none). For
    :func:`target_table` (``kernel="step"``) and :func:`training_step_table`."""
    def key(r):                                   # one library on one chip at one shape
        return tuple(r.get(f) for f in ("chip", "library", "batch", "heads", "seq_len",
                                        "head_dim", "causal"))

    def pick(rs, k, mode):
        return min((r for r in rs if key(r) == k and "error" not in r
                    and r.get("est_cycles") is not None
                    and (mode == "best" or r["blocks"] == mode)),
                   key=lambda r: r["est_cycles"], default=None)

    def total(f, b, field):
        return None if None in (f.get(field), b.get(field)) else f[field] + b[field]
    fwd, bwd, out = [r for r in rows if r.get("kernel") == "forward"], backward_rows(rows), []
    for k in dict.fromkeys(map(key, fwd)):
        for mode in modes:
            f, b = pick(fwd, k, mode), pick(bwd, k, mode)
            if f and b:
                out.append(dict(f, kernel="step", blocks=mode, est_ms=total(f, b, "est_ms"),
                                floor_ms=total(f, b, "floor_ms"),
                                est_cycles=f["est_cycles"] + b["est_cycles"],
                                bwd_blocks=f"{b['block_q']}x{b['block_k']}"))
    return out


def backward_pairs(rows) -> dict:
    """``{(chip, library): {(block_q, block_k): backward row}}``: each library's fastest whole
    backward (:func:`backward_rows`, split or fused) per block pair (default, equal and sweep
    rows)."""
    out = {}
    for r in backward_rows(rows):
        k = out.setdefault((r["chip"], r["library"]), {})
        p = (r["block_q"], r["block_k"])
        if p not in k or r["est_cycles"] < k[p]["est_cycles"]:
            k[p] = r
    return out


def backward_sweep_table(rows) -> str:
    """Whole-backward estimates (ms) per chip, library and block pair (``f``: the fused
    backward was the faster there), the best pair marked ``*``, and flashlab's best against
    the better of splash's and jax's best."""
    pairs = backward_pairs(rows)
    cols = sorted({p for v in pairs.values() for p in v})
    out = [f"{'chip':4} {'library':17} " + " ".join(f"{f'{q}x{k}':>10}" for q, k in cols)
           + f" {'x best other':>12}"]
    for chip in dict.fromkeys(c for c, _ in pairs):
        best = {lib: min(r["est_ms"] for r in pairs[c, lib].values())
                for c, lib in pairs if c == chip}
        others = [best[k] for k in OTHERS if k in best]
        for lib in LIBRARIES:
            if (chip, lib) not in pairs:
                continue
            cells = []
            for p in cols:
                r = pairs[chip, lib].get(p)
                if r is None:
                    cells.append(f"{'-':>10}")
                    continue
                t = r["est_ms"]
                mark = ("f" if r["option"] == "fused" else "") + ("*" if t == best[lib] else "")
                cells.append(f"{f'{t:.2f}{mark}':>10}")
            ratio = (f"{best[lib] / min(others):.2f}" if lib == "flashlab" and others else "")
            out.append(f"{chip:4} {lib:17} " + " ".join(cells) + f" {ratio:>12}")
    return "\n".join(out)


def training_step_table(rows, *, blocks="equal") -> str:
    """Forward + whole-backward estimates per chip and library (one training step's
    attention, :func:`step_rows`), against the floor and with the ratio to splash: what
    ``auto``'s order on a TPU should follow. The backward is the faster of the library's split
    and fused ones at those blocks.

    ``blocks``: ``"equal"`` or ``"default"`` (those rows), or ``"best"``: each library's
    fastest forward blocks plus its fastest backward pair."""
    by = {(r["chip"], r["library"]): r for r in step_rows(rows, modes=(blocks,))
          if r["est_ms"] is not None}
    out = [f"{'chip':4} {'library':17} {'fwd+bwd est ms':>14} {'x floor':>7} {'x splash':>8}"]
    for (chip, lib), r in by.items():
        ref = by.get((chip, "splash"))
        rs = f"{r['est_ms'] / ref['est_ms']:.2f}" if ref else "-"
        out.append(f"{chip:4} {lib:17} {r['est_ms']:14.2f} {r['est_ms'] / r['floor_ms']:7.2f} "
                   f"{rs:>8}")
    return "\n".join(out)


def before_after_table(before_rows, after_rows, *, kernels=("dq", "dkdv"),
                       blocks: str = "equal", after_library: str = "flashlab") -> str:
    """flashlab's kernels before and after, per chip, at equal blocks (``blocks="equal"``) or
    at its fastest measured blocks (``"best"``): tile and per-step cycles, whole-kernel
    estimate, and the ratio to the better of splash and jax's kernel after (same blocks
    rule; a fused backward against splash's fused one too). Rows of one shape: filter
    ``before_rows``/``after_rows`` by :func:`shape_of`.
    ``after_library``: the after rows' library (``"flashlab_split"``: the split backward's
    kernels, now that flashlab's default backward is fused where it fits)."""
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
            others = [o for lib in OTHERS + tuple(v for v, of in BACKWARD_VARIANTS.items()
                                                  if of in OTHERS)
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


def splash_dq_partial_bytes(r, itemsize: int = 2) -> int:
    """HBM bytes of the dQ partials splash's fused backward writes (and XLA reads back to sum
    them): one ``[B, H, T, d]`` copy in the inputs' dtype per kv block, which the static
    schedule does not see. ``r``: a row with its shape and ``block_k``."""
    t_c = -(-r["seq_len"] // r["block_k"])
    return t_c * r["batch"] * r["heads"] * r["seq_len"] * r["head_dim"] * itemsize


def fused_vs_split_table(rows, *, block=(1024, 1024)) -> str:
    """Per chip at one block pair (sweep or equal rows): flashlab's split backward (dK/dV +
    dQ tiles, whole estimate) against its fused one, and splash's best backward at that pair
    (split or fused, with the dQ partials its fused one keeps in HBM: bf16, one copy of dQ per
    kv block); the fused kernel's tile is one kernel's, the split's the sum of two."""
    bw = [r for r in backward_rows(rows) if (r["block_q"], r["block_k"]) == tuple(block)]
    out = [f"{'chip':4} {'split tiles':>12} {'fused tile':>11} {'split ms':>9} {'fused ms':>9} "
           f"{'fused/split':>11} {'splash best ms':>15} {'its dQ partials':>15}"]
    for chip in dict.fromkeys(r["chip"] for r in bw):
        def one(lib, option):
            rs = [r for r in bw if (r["chip"], r["library"], r["option"]) == (chip, lib, option)]
            return min(rs, key=lambda r: r["est_cycles"]) if rs else None
        sp, fu = one("flashlab", "split"), one("flashlab", "fused")
        ref = [r for r in (one("splash", "split"), one("splash", "fused")) if r is not None]
        if sp is None or fu is None:
            continue
        best = min(ref, key=lambda r: r["est_cycles"]) if ref else None
        ref_s = f"{best['est_ms']:.2f} ({best['option']})" if best else "-"
        part = (f"{splash_dq_partial_bytes(best) / 2**20:.0f} MiB"
                if best and best["option"] == "fused" else "0")
        out.append(f"{chip:4} {sp['tile_cycles']:>12} {fu['tile_cycles']:>11} "
                   f"{sp['est_ms']:>9.2f} {fu['est_ms']:>9.2f} "
                   f"{fu['est_cycles'] / sp['est_cycles']:>11.2f} {ref_s:>15} {part:>15}")
    return "\n".join(out)
