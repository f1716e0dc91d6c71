"""``python -m flashlab bench decode-static``: one decode step, flashlab's paged decode kernel
against the official ``paged_attention`` kernel, on the TPU compiler's static schedule.

For each chip and page size both kernels are compiled at the same shapes (batch, kv heads,
``G`` query heads per kv head, page size, pages per sequence, head dim, dtype; every sequence
full) with libtpu's schedule dumps on (:mod:`flashlab.instruments.tpu_dump`), and each kernel's bundles
are read into a whole-kernel cycle count for one decode step:

* flashlab (:mod:`flashlab.kernels.decode`): grid ``(batch, splits, blocks_per_split)``,
  one grid loop; :func:`flashlab.instruments.tpu_schedule.analyze` and the same estimate as ``bench
  tpu-static``: ``steps x per-step + visible blocks x tile + rows x (init + finalize) +
  prologue``. One step reads ``pages_per_block`` pages of every kv head.
* official (``inline_seq_dim=True``, its default): grid ``(cores, batch, kv_heads)``, whose
  loop's exit test says ``batch x kv_heads + 2`` trips (two pipeline stages), and inside it a
  ``fori_loop`` over the ``pages_per_compute_block``-page blocks, bounded by the sequence's
  length (a register, so not in the dump; every sequence is full here). :func:`read_official`
  takes it as ``prologue + grid trips x (grid body - block loop) + blocks x block body +
  first prefetch``, where the block body leaves out the first-block prefetch (once per
  kernel) and the loop that skips empty sequences (never run here).

Cycles are VLIW bundles. What these figures are not: wall time. No DMA waits, no HBM
bandwidth (the table's "HBM us" is that floor: the visible cache read once), no stalls; the XLA
ops around each kernel (head folding, the split-K merge) are not counted. They rank the two
kernels' instruction streams; calibrate on a real TPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

from flashlab.instruments import tpu_dump, tpu_schedule as ts
from flashlab.benchmarks.tpu_static import _positive, chip_clock, report_run

__all__ = ["build", "read_official", "OfficialSchedule", "measure", "header", "table",
           "stored", "STORED", "main"]

STORED = Path(__file__).resolve().parent.parent / "data" / "decode_static.json"
LIBRARIES = ("flashlab", "official")
_EXIT = re.compile(r"scmp\.\w+\.s32\.totalorder %\w+, (\d+) /\* loop exit test")


def build(*, chip: str, library: str, batch: int, kv_heads: int, group: int, page_size: int,
          pages_per_sequence: int, head_dim: int, dtype: str, pages_per_compute_block: int):
    """``(fn, args, info)`` of one decode step (runs in :func:`flashlab.instruments.tpu_dump.schedules`'
    child): :func:`flashlab.instruments.decode_cases.decode_step_case` or
    :func:`~flashlab.instruments.decode_cases.official_paged_step_case` with ``q_heads = kv_heads x
    group``, one new token per sequence. ``info["num_splits"]``: flashlab's split-K count."""
    from flashlab.instruments import decode_cases
    from flashlab.kernels import decode_grid
    kw = dict(batch=batch, q_heads=kv_heads * group, kv_heads=kv_heads, head_dim=head_dim,
              page_size=page_size, pages_per_sequence=pages_per_sequence, dtype=dtype)
    if library == "official":
        fn, args = decode_cases.official_paged_step_case(
            **kw, pages_per_compute_block=pages_per_compute_block)
        return fn, args, {}
    import jax
    from flashlab.contract import device
    from flashlab.contract.decode_validate import validate_decode
    fn, args = decode_cases.decode_step_case(**kw)
    got = {}

    def probe(q, kp, vp, lengths, table):     # the kernel's config, as the step resolves it
        spec = validate_decode(q, kp, vp, cache_lengths=lengths, page_table=table)[3]
        cfg = decode_grid.make_decode_config(spec, page_size, pages_per_sequence, kp.shape[0])
        got.update(num_splits=cfg.num_splits, pages_per_block=cfg.pages_per_block)
        return q
    with device.compile_target(chip):
        jax.eval_shape(probe, *args)
    return fn, args, got


@dataclasses.dataclass
class OfficialSchedule:
    """The official paged kernel's two loops, read from its bundles (cycles = bundles)."""
    kernel: str
    path: str
    total_cycles: int
    grid_loop: tuple[int, int]        # first, last bundle
    grid_trips: int                   # from the loop's exit test (grid steps + 2 stages)
    block_loop: tuple[int, int]
    grid_body_cycles: int             # grid loop body outside the block loop
    block_cycles: int                 # one block: block loop body, steady state
    first_prefetch_cycles: int        # the first block's DMA issue (once per kernel)
    outside_loop_cycles: int
    unit_busy: dict                   # compiler's table summed over one steady block
    unit_capacity: dict


def _dma_in(bundles, r) -> bool:
    return any(ts.unit_of(o) == "DMA" for b in bundles[r.branch + 1:r.target] for o in b.opcodes)


def read_official(packed_path, kernel: str | None = None) -> OfficialSchedule:
    """Read the official ``paged_attention`` kernel's dump (a ``tpu_dump.schedules`` reader).

    Raises :class:`flashlab.instruments.tpu_schedule.ScheduleFormatError` when the loops are not the two
    described in this module's docstring (the kernel or libtpu changed)."""
    packed_path = Path(packed_path)
    util_path = Path(str(packed_path).replace(
        "01-packed-bundles-post-ra", "02-pre-delay_hlo-static-per-bundle-utilization"))
    bundles = ts.parse_bundles(ts._read(packed_path), str(packed_path))
    caps, rows = ts.parse_utilization(ts._read(util_path), str(util_path))
    ts._crosscheck(bundles, caps, rows, str(packed_path), str(util_path))
    fwd, back = ts._branches(bundles)
    mm = [b.index for b in bundles if any(ts._MATMUL.match(o) for o in b.opcodes)]
    loops = sorted(back, key=lambda r: r.target)
    holding = [r for r in loops if r.target <= mm[0] and mm[-1] <= r.branch] if mm else []
    if len(holding) != 2:
        raise ts.ScheduleFormatError(f"{packed_path}: expected two nested loops around the "
                                     f"vmatmuls (grid, blocks), found {holding} of {loops}")
    grid, block = sorted(holding, key=lambda r: r.branch - r.target, reverse=True)
    exits = [int(m.group(1)) for b in bundles[grid.target:grid.branch + 1]
             if not (block.target <= b.index <= block.branch) for m in _EXIT.finditer(b.text)]
    if len(exits) != 1:
        raise ts.ScheduleFormatError(f"{packed_path}: expected one constant loop exit test "
                                     f"in the grid loop, found {exits}")
    inner = [r for r in loops if block.target < r.target and r.branch < block.branch]
    dma = [r for r in fwd if block.target <= r.branch and r.target <= block.branch
           and _dma_in(bundles, r) and not any(r.branch < m < r.target for m in mm)]
    if len(dma) != 2:
        raise ts.ScheduleFormatError(f"{packed_path}: expected two DMA-issuing regions in the "
                                     f"block loop beside the vmatmuls (first block, next "
                                     f"block), found {dma}")
    first = dma[0]
    skip = {i for r in inner for i in range(r.target, r.branch + 1)}
    skip |= set(range(first.branch + 1, first.target))
    steady = [i for i in range(block.target, block.branch + 1) if i not in skip]
    block_len = block.branch - block.target + 1
    return OfficialSchedule(
        kernel=kernel or packed_path.name, path=str(packed_path), total_cycles=len(bundles),
        grid_loop=(grid.target, grid.branch), grid_trips=exits[0],
        block_loop=(block.target, block.branch),
        grid_body_cycles=grid.branch - grid.target + 1 - block_len, block_cycles=len(steady),
        first_prefetch_cycles=first.cycles,
        outside_loop_cycles=len(bundles) - (grid.branch - grid.target + 1),
        unit_busy={c: sum(rows[i][k] for i in steady) for k, c in enumerate(caps)},
        unit_capacity=dict(caps))


def _busiest(unit_busy: dict, caps: dict, cycles: int) -> tuple[str, float]:
    """The unit with the highest static utilisation over ``cycles`` bundles (MXU, XLU, VALU,
    VLOAD, VSTORE, EUP, SALU ... as the compiler's table names them)."""
    util = {u: unit_busy[u] / (caps[u] * cycles) for u in caps if caps[u] and cycles}
    u = max(util, key=util.get)
    return u, util[u]


def _row(k: tpu_dump.KernelDump, *, chip, library, batch, kv_heads, page_size,
         pages_per_sequence, pages_per_compute_block, num_splits=1, pages_per_block=1) -> dict:
    s = k.schedule
    hz, _, _ = chip_clock(chip)
    if library == "official":
        if s.grid_trips != batch * kv_heads + 2:
            raise ts.ScheduleFormatError(
                f"{s.path}: grid loop exit test {s.grid_trips}, expected batch x kv_heads + 2 "
                f"= {batch * kv_heads + 2}: the kernel's loop structure changed")
        blocks = batch * kv_heads * (pages_per_sequence // pages_per_compute_block)
        est = (s.outside_loop_cycles + s.grid_trips * s.grid_body_cycles
               + blocks * s.block_cycles + s.first_prefetch_cycles)
        step, per = s.block_cycles, pages_per_compute_block * page_size
        unit = _busiest(s.unit_busy, s.unit_capacity, s.block_cycles)
        extra = dict(grid_trips=s.grid_trips, grid_body_cycles=s.grid_body_cycles,
                     first_prefetch_cycles=s.first_prefetch_cycles)
    else:                                   # grid (batch, splits, blocks per split)
        steps, rows = math.prod(k.grid), math.prod(k.grid[:-1])
        n = pages_per_block
        tiles = batch * (-(-pages_per_sequence // n))          # every block has a full page
        est = ts.kernel_cycles(s, steps=steps, tiles=tiles, rows=rows)
        blocks, step, per = steps, s.tile_cycles + s.step_cycles, n * page_size
        unit = _busiest(s.unit_busy, s.unit_capacity, s.tile_cycles)
        extra = dict(tile_cycles=s.tile_cycles, step_cycles=s.step_cycles,
                     init_cycles=s.init_cycles, finalize_cycles=s.finalize_cycles,
                     occupancy=s.occupancy, num_splits=num_splits, pages_per_block=n)
    return dict(chip=chip, library=library, page_size=page_size, name=k.name,
                grid=list(k.grid), blocks=blocks, positions_per_block=per,
                kv_heads_per_block=1 if library == "official" else kv_heads,
                block_cycles=step, est_cycles=est, est_us=est / hz * 1e6 if hz else None,
                busiest_unit=unit[0], busiest_util=unit[1], **extra)


def measure(*, chips=("v5e", "v6e"), page_sizes=(16, 64), batch=8, kv_heads=4, group=8,
            tokens=4096, head_dim=128, dtype="bfloat16",
            pages_per_compute_block=8, timeout=1800, progress=True):
    """Compile and read both kernels per (chip, page size); returns ``(rows, versions)``.

    Every sequence holds ``tokens`` (``tokens // page_size`` pages). Each row: the whole kernel's static cycles for one decode step
    (``est_cycles``), its blocks and cycles per block, and the busiest unit of a block."""
    jobs = [(c, ps, lib) for c in chips for ps in page_sizes for lib in LIBRARIES]
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(jobs), desc="decode-static", file=sys.stderr)
        except ImportError:
            pass
    rows, versions = [], {}
    for chip, ps, lib in jobs:
        pps = tokens // ps
        shape = dict(batch=batch, kv_heads=kv_heads, page_size=ps, pages_per_sequence=pps,
                     pages_per_compute_block=pages_per_compute_block)
        try:
            d = tpu_dump.schedules("flashlab.benchmarks.decode_static:build", chip, timeout=timeout,
                                   reader=read_official if lib == "official" else None,
                                   library=lib, group=group, head_dim=head_dim, dtype=dtype,
                                   **shape)
        except (TimeoutError, ts.ScheduleFormatError) as e:
            rows.append(dict(chip=chip, library=lib, page_size=ps,
                             error=" ".join(str(e).split())[:300]))
        except Exception as e:  # noqa: BLE001 - a rejected compile is a result
            from flashlab.instruments import tpu_compile
            if not isinstance(e, tpu_compile.CompileError):
                raise
            rows.append(dict(chip=chip, library=lib, page_size=ps,
                             error=" ".join(str(e).split())[:300]))
        else:
            versions = dict(jax=d.jax_version, libtpu=d.libtpu_version)
            (k,) = d.kernels.values()
            rows.append(_row(k, chip=chip, library=lib, **shape, **(d.info or {})))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    from flashlab.instruments import roofline
    from flashlab.instruments.decode_traffic import decode_lower_bound_bytes
    for r in rows:                 # the HBM floor: visible cache + q + out once, at peak HBM
        nbytes = decode_lower_bound_bytes(lengths=[tokens] * batch, q_heads=kv_heads * group,
                                          kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        r["hbm_floor_us"] = nbytes / roofline.chip(r["chip"]).hbm_bytes_per_s * 1e6
    official = {(x["chip"], x["page_size"]): x["est_cycles"] for x in rows
                if x["library"] == "official" and "error" not in x}
    for r in rows:                                 # same chip and page size
        ref = official.get((r["chip"], r["page_size"]))
        r["ratio_official"] = r["est_cycles"] / ref if ref and "error" not in r else None
    return rows, versions


def stored(path=None) -> dict:
    """The committed run (:data:`STORED`): ``{"versions", "args", "rows"}``."""
    p = Path(path or STORED)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: no stored decode-static run; make one with python -m "
                                f"flashlab bench decode-static --json {p}") from None


def header(versions: dict, args: dict) -> str:
    """What the figures are and are not, with the versions, shape and commit."""
    return "\n".join([
        "One decode step on the TPU compiler's static schedule (1 bundle = 1 cycle), jax "
        f"{versions.get('jax')}, libtpu {versions.get('libtpu')}, flashlab {args.get('commit')}.",
        f"batch={args['batch']} kv_heads={args['kv_heads']} G={args['group']} "
        f"(q_heads={args['kv_heads'] * args['group']}) d={args['head_dim']} {args['dtype']}, "
        f"{args['tokens']} cached tokens per sequence (all full), one new token; official: "
        f"pages_per_compute_block={args['pages_per_compute_block']}.",
        "NOT wall time: no DMA waits, no HBM bandwidth (see HBM us), no stalls; the XLA ops",
        "around the kernels are not counted. est = whole kernel; block = cycles per grid block "
        "(flashlab:",
        "pages_per_block pages of every kv head; official: pages_per_compute_block pages of one "
        "kv head); busiest = the",
        "unit with the highest static utilisation in a block (compiler's per-bundle table): "
        "all far",
        "below 100%, so a block is bound by its dependency chain's latency (QK^T, max, exp, "
        "sum, PV),",
        "not by a unit. HBM us = the visible cache + q + out read once at the chip's HBM "
        "bandwidth",
        "(flashlab.instruments.roofline): where est us is below it, the step would be HBM-bound.",
    ])


def table(rows) -> str:
    """The plain-text table the CLI prints."""
    head = (f"{'chip':4} {'page':>4} {'library':9} {'grid':>16} {'blocks':>6} {'pos x kvh':>9} "
            f"{'block cyc':>9} {'est cycles':>10} {'est us':>7} {'HBM us':>6} {'busiest':>12} "
            f"{'x official':>10}")
    out = [head, "-" * len(head)]
    for r in rows:
        left = f"{r['chip']:4} {r['page_size']:4d} {r['library']:9}"
        if "error" in r:
            out.append(f"{left} FAILED: {r['error']}")
            continue
        us = "-" if r["est_us"] is None else f"{r['est_us']:.1f}"
        ro = "-" if r["ratio_official"] is None else f"{r['ratio_official']:.2f}"
        pk = f"{r['positions_per_block']}x{r['kv_heads_per_block']}"
        out.append(f"{left} {'x'.join(map(str, r['grid'])):>16} {r['blocks']:6d} {pk:>9} "
                   f"{r['block_cycles']:9d} {r['est_cycles']:10d} {us:>7} "
                   f"{r['hbm_floor_us']:6.1f} "
                   f"{r['busiest_unit'] + ' ' + format(r['busiest_util'], '.0%'):>12} {ro:>10}")
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashlab bench decode-static",
        description="flashlab's decode kernel vs the official paged_attention, one decode step "
                    "on the TPU compiler's static schedule (compile-only: needs libtpu, not a "
                    "TPU). Not wall time.")
    p.add_argument("--chip", nargs="+", default=["v5e", "v6e"],
                   choices=["v4", "v5e", "v5p", "v6e", "7x"])
    p.add_argument("--page-size", nargs="+", type=_positive("--page-size"), default=[16, 64])
    p.add_argument("--batch", type=_positive("--batch"), default=8)
    p.add_argument("--kv-heads", type=_positive("--kv-heads"), default=4)
    p.add_argument("--group", type=_positive("--group"), default=8,
                   help="G: query heads per kv head (8: GQA 8:1)")
    p.add_argument("--tokens", type=_positive("--tokens"), default=4096,
                   help="cached tokens per sequence (pages_per_sequence = tokens / page size)")
    p.add_argument("--head-dim", type=_positive("--head-dim"), default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--pages-per-compute-block", type=_positive("--pages-per-compute-block"),
                   default=8, help="the official kernel's pages per block")
    p.add_argument("--timeout", type=_positive("--timeout"), default=1800)
    p.add_argument("--json", metavar="PATH", help="write the rows and header as JSON")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    for ps in a.page_size:
        if a.tokens % (ps * a.pages_per_compute_block):
            p.error(f"--tokens: expected a multiple of page size x --pages-per-compute-block "
                    f"({ps} x {a.pages_per_compute_block}), got {a.tokens}")
    from flashlab.instruments import tpu_compile
    if not tpu_compile.available():
        p.error(f"libtpu (the TPU compiler) is not installed: {tpu_compile.INSTALL}")
    rows, versions = measure(
        chips=a.chip, page_sizes=a.page_size, batch=a.batch, kv_heads=a.kv_heads,
        group=a.group, tokens=a.tokens, head_dim=a.head_dim, dtype=a.dtype,
        pages_per_compute_block=a.pages_per_compute_block, timeout=a.timeout,
        progress=not a.no_progress)
    report_run(a, argv, "decode-static", rows, versions, header=header, table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
