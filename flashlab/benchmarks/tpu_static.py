"""``python -m flashlab bench tpu-static``: flashlab, splash and jax's flash kernel, side by
side on the TPU compiler's own static schedule, for every TPU generation, without a TPU.

For each chip, library and block setting it compiles the forward (inference) and the
gradient (``jax.grad``: the dQ and dK/dV kernels, or one fused backward kernel; what each
library builds: :mod:`flashlab.benchmarks.tpu_static_builders`) with libtpu's schedule dumps on
(:mod:`flashlab.instruments.tpu_dump`), reads every kernel's schedule
(:mod:`flashlab.instruments.tpu_schedule`), and estimates the whole kernel: ``grid steps x per-step
cycles + visible tiles x tile cycles + rows x (init + finalize) + prologue``. That is set against
the peak-FLOP floor (the kernel's matmul FLOPs at the chip's peak) and against splash.

What these figures are: the static schedule of the real compiler (cycles = VLIW bundles).
What they are not: wall time. No DMA waits, no HBM bandwidth, no pipeline stalls. They rank
kernels and block sizes; calibrate them on a real TPU when one is available.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

from flashlab.benchmarks.tpu_static_report import (
    BACKWARD_ROLES, BACKWARD_VARIANTS, LIBRARIES, MATMULS, header, table, update_rows)
from flashlab.benchmarks.tpu_static_builders import (  # build: the child's entry point
    OPTIONS_JAX_LACKS, build, forward_flops, window_of)
from flashlab.instruments import tpu_dump

__all__ = ["build", "measure", "chip_clock", "main", "parser", "window_of", "forward_flops"]

# One run of this bench, committed for the book (chapters 05, 07, 09): its header says which
# jax, libtpu and flashlab commit produced it. Regenerate with the command in its "args".

TIMELINE_UNITS = ("MXU", "XLU", "VALU", "VPOP", "EUP", "VLOAD", "VSTORE", "SALU")


def chip_clock(chip: str) -> tuple[float | None, float | None, str]:
    """``(clock Hz, bf16 FLOP/s per TensorCore, source)`` of a TPU generation.

    Neither JAX nor :mod:`flashlab.instruments.roofline` lists clocks, so the clock is derived from
    JAX's per-core table: ``bf16_ops_per_second / (num_mxus x mxu_column_size**2 x 2)``. That gives
    the public clocks of v4 (1.05 GHz), v5e (1.5) and v5p (1.75); for v6e and 7x it gives 3.5
    and 4.4 GHz, which says JAX's per-core MXU count (2) and the compiler's (2) describe a
    wider machine than the clock alone: their ms are less certain than their cycles. Their
    compiler gives a tile at d=256 the MXU cycles of d=128 (512², per MXU: the forward 512 at
    both, the fused backward 1280, for twice the FLOPs), so at d=256 an estimate can
    read below the peak-FLOP floor (B=2 T=4096 H=16 causal, 512²: v6e's fused backward 0.61 ms
    against a 0.75 ms floor). At d=128 too, since flashlab's fused backward keeps dQ ``[d,
    T]`` there (:data:`flashlab.kernels.backward_config.GRADS_ON_LANES`: its ``dQᵀ = Kᵀ dS'ᵀ``
    is ``B_r`` wide where ``dQ = dS' K`` was ``d`` wide): B=2 T=8192 H=16 non-causal at 2048²,
    v6e's tile spends 18432 MXU cycles where the floor allows 20480, and the kernel reads 2.77
    ms against a 2.99 ms floor. Either the real clock is half the derived one (and a matmul
    128 wide or deep reaches half their peak at most) or the model is optimistic; a TPU run
    decides. The ratios between libraries hold either way. The table marks such rows
    (``BELOW_FLOOR``).
    """
    from flashlab.compat import pallas as compat
    try:
        i = compat.get_tpu_info_for_chip(compat.ChipVersion(chip), 1)
    except Exception:  # noqa: BLE001 - older JAX: no table
        return None, None, "no per-chip table in this JAX: cycles only"
    peak = float(i.bf16_ops_per_second)
    hz = peak / (i.num_mxus * i.mxu_column_size ** 2 * 2)
    return hz, peak, ("jax pltpu.get_tpu_info_for_chip: clock = bf16_ops_per_second / "
                      "(num_mxus x mxu_column_size^2 x 2), per TensorCore")


def _visible_tiles(T, bq, bk, causal, window=None) -> int:
    from flashlab.kernels import blocks
    return blocks.num_visible_blocks(-(-T // bq), -(-T // bk), q_len=T, kv_len=T, block_q=bq,
                                     block_k=bk, is_causal=causal, window=window)


def init_runs(library: str, role: str, grid, *, batch, heads, seq_len, block_q, block_k,
              dq_chunks: int = 1) -> int:
    """How often a kernel's init and finalize run: once per step of its grid without the
    innermost (reduction) axis, or, on flashlab's visit grids (``(B, H, n)``; the dK/dV
    kernel's ``(B, K, n, G)``), once per row of the list: a q block (a kv block for dK/dV,
    once per query chunk of the fused backward, ``dq_chunks``)."""
    kv_rows = role in ("dkdv", "fused")
    if library.startswith("flashlab") and len(grid) == (4 if kv_rows else 3):
        return batch * heads * -(-seq_len // (block_k if kv_rows else block_q)) * (
            dq_chunks if role == "fused" else 1)
    return math.prod(grid[:-1])


def resident_zeroing(s, *, seq_len: int, block_q: int, head_dim: int, dq_chunks: int = 1
                     ) -> int:
    """Cycles of the fused backward's dQ zeroing, the init region that stores the whole
    resident ``[T_pad / dq_chunks, d]`` float32 block (``T_pad / 8`` vregs per 128 lanes; the
    bench runs one query head per kv head), or 0 where no init region stores that much. It
    runs once per (batch, kv head, chunk), not once per kv row as the rest of the init. (The
    compiler may fold a store or two elsewhere: 7x at T = 2048 stores 254 of the 256 vregs in
    the region.)"""
    need = -(-seq_len // block_q) * block_q // dq_chunks // 8 * -(-head_dim // 128)
    big = [c for c, stores in getattr(s, "init_regions", ()) if stores >= 0.9 * need]
    return max(big) if big else 0


def _row(k: tpu_dump.KernelDump, blocks, *, chip, library, mode, batch, seq_len, heads,
         head_dim, causal, timeline, chunk_visits=(0, 0), dq_chunks=1, cases=(),
         window=None) -> dict:
    """One bench row from a kernel's schedule. ``chunk_visits``: the partial tiles and the
    chunks they run, per (batch, head): the forward's row chunks
    (:meth:`ForwardConfig.chunk_visits`); ``cases``: per case of the diagonal strips (the
    forward's query strips or the fused backward's kv strips), its tiles per (batch, head)
    (:func:`diagonal.forward_visits`, :func:`diagonal.visits`);
    ``dq_chunks``: the fused backward's query chunks (:func:`backward_config.dq_chunks`);
    ``window``: the run's ``(left, right)`` window or ``None`` (its tiles and FLOPs count
    the band)."""
    from flashlab.instruments import tpu_schedule
    s = k.schedule
    bq, bk = blocks
    steps = math.prod(k.grid)
    rows = init_runs(library, k.role, k.grid, batch=batch, heads=heads, seq_len=seq_len,
                     block_q=bq, block_k=bk, dq_chunks=dq_chunks)
    tiles = batch * heads * _visible_tiles(seq_len, bq, bk, causal, window)
    partial, partial_chunks = (batch * heads * n for n in chunk_visits)
    cases = [batch * heads * n for n in cases]
    if len(cases) == 1 and not s.case_cycles and cases[0] == tiles:
        # every visible tile is crossed at one offset (one block: T = B_r = B_c), the compiler
        # knew it and dropped the whole-tile path: the tile region is that case
        cases = []
    zero = (resident_zeroing(s, seq_len=seq_len, block_q=bq, head_dim=head_dim,
                             dq_chunks=dq_chunks)
            if library.startswith("flashlab") and k.role == "fused" else 0)
    cycles = tpu_schedule.kernel_cycles(s, steps=steps, tiles=tiles, rows=rows,
                                        partial=partial, partial_chunks=partial_chunks,
                                        once=batch * heads * dq_chunks if zero else 0,
                                        once_cycles=zero, cases=cases)
    hz, peak, _ = chip_clock(chip)
    flops = forward_flops(batch, heads, seq_len, head_dim, causal, window) * MATMULS[k.role] / 2
    r = dict(chip=chip, library=library, kernel=k.role, blocks=mode, block_q=bq, block_k=bk,
             seq_len=seq_len, head_dim=head_dim, causal=causal, batch=batch, heads=heads,
             name=k.name, grid=list(k.grid), tile_cycles=s.tile_cycles,
             step_cycles=s.step_cycles, init_cycles=s.init_cycles,
             finalize_cycles=s.finalize_cycles, outside_loop_cycles=s.outside_loop_cycles,
             mxu_cycles=s.mxu_cycles, occupancy=s.occupancy, num_mxu=s.num_mxu, steps=steps,
             tiles=tiles, rows=rows, est_cycles=cycles, flops=flops,
             partial_tiles=partial + sum(cases), partial_chunks=partial_chunks,
             case_tiles=cases, case_cycles=s.case_cycles,
             partial_overhead_cycles=s.partial_overhead_cycles, chunk_cycles=s.chunk_cycles,
             once_per_head_cycles=zero, dq_chunks=dq_chunks,
             est_ms=cycles / hz * 1e3 if hz else None,
             floor_ms=flops / peak * 1e3 if peak else None,
             op_mix=s.op_mix, unit_busy=s.unit_busy, unit_capacity=s.unit_capacity)
    r["ratio_floor"] = r["est_ms"] / r["floor_ms"] if hz else None
    if timeline:
        cols = list(s.unit_capacity)
        r["timeline"] = {u: "".join(str(min(9, x[cols.index(u)])) for x in s.tile_util)
                         for u in TIMELINE_UNITS if u in cols}
    return r


def measure(*, chips, libraries=LIBRARIES, modes=("default", "equal"), block=512, batch=2,
            seq_len=8192, heads=16, head_dim=128, dtype="bfloat16", causal=True,
            kernels=tuple(MATMULS), timeline_chip=None, timeout=1800, progress=True,
            jobs_in_parallel=1, sweep=(), window=None, soft_cap=None):
    """Compile and read every (chip, library, block mode); returns ``(rows, versions)``.

    ``jobs_in_parallel``: compiles at once (each a child process of ~1-3 GB).
    ``sweep``: ``(block_q, block_k)`` pairs, each one more mode (rows with ``blocks="sweep"``).
    ``window``: ``(left, right)`` for every library (:func:`window_of`); ``soft_cap``: the
    logits' soft cap for every library. jax's kernel has neither, so its rows record that as
    their error. Rows of such a run carry ``window`` / ``soft_cap``.
    """
    modes = list(modes) + [("sweep", tuple(p)) for p in sweep]
    jobs = [(c, lib, m, bwd) for c in chips for lib in libraries for m in modes
            for bwd in (False, True) if (bwd and set(BACKWARD_ROLES) & set(kernels))
            or (not bwd and "forward" in kernels and lib not in BACKWARD_VARIANTS)]
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
        except ImportError:       # tqdm is in the [flax] extra; no bar without it
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=len(jobs), desc="tpu-static", file=sys.stderr)
    rows, versions = [], {}
    shape = dict(batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim)
    window = None if window is None else tuple(window)
    extra = {k: v for k, v in (("window", window), ("soft_cap", soft_cap)) if v is not None}
    tag = {k: list(v) if k == "window" else v for k, v in extra.items()}   # on every row

    def one(job):
        c, lib, m, bwd = job
        blk = None if m == "default" else m[1] if isinstance(m, tuple) else block
        if extra and lib == "jax_pallas_flash":
            return NotImplementedError(OPTIONS_JAX_LACKS)
        if lib.startswith("flashlab"):    # flashlab's own VMEM check refusing the blocks
            # (its default backward, or its split one) is a result, not a crash of the run
            try:
                build(chip=c, library=lib, backward=bwd, dtype=dtype, causal=causal, block=blk,
                      **shape, **extra)
            except ValueError as e:
                return e
        try:
            return tpu_dump.schedules("flashlab.benchmarks.tpu_static:build", c, timeout=timeout,
                                      library=lib, backward=bwd, dtype=dtype, causal=causal,
                                      block=blk, **shape, **extra)
        except Exception as e:  # noqa: BLE001 - a rejected compile is a result; see below
            from flashlab.instruments import tpu_compile
            if not isinstance(e, (tpu_compile.CompileError, TimeoutError,
                                  NotImplementedError)):
                raise
            return e

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max(1, jobs_in_parallel)) as pool:   # each compile is a child
        # Longest compiles first (gradients, ours), so parallel jobs finish together.
        order = sorted(range(len(jobs)), key=lambda n: (not jobs[n][3], jobs[n][1] != "flashlab"))
        futures = {pool.submit(one, jobs[n]): n for n in order}
        results = [None] * len(jobs)
        from concurrent.futures import as_completed
        for f in as_completed(futures):
            results[futures[f]] = f.result()
            if bar is not None:
                bar.update()
    for (c, lib, m, bwd), d in zip(jobs, results):
        pair = dict(zip(("block_q", "block_k"), m[1])) if isinstance(m, tuple) else {}
        m = m[0] if isinstance(m, tuple) else m
        if isinstance(d, Exception):
            e = d
            for role in (("dq", "dkdv") if bwd else ("forward",)):
                if role in kernels or (role == "dkdv" and "fused" in kernels):
                    rows.append(dict(chip=c, library=lib, kernel=role, blocks=m, **pair,
                                     **shape, causal=causal, **tag,
                                     error=" ".join(str(e).split())[:300]))
        else:
            versions = dict(jax=d.jax_version, libtpu=d.libtpu_version)
            for role, k in d.kernels.items():
                blocks = d.info["blocks"][role]
                if role == "dkdv" and d.info["blocks"].get("fused"):
                    role = "fused"         # one kernel for dQ, dK and dV (ours or splash's)
                if role in kernels and (role == "forward") != bwd:
                    per_head = d.info["blocks"].get("chunk_visits", (0, 0)) if (
                        role == "forward") else (0, 0)      # partial tiles, their chunks
                    k = dataclasses.replace(k, role=role)
                    rows.append(tag | _row(k, blocks, chip=c, library=lib, mode=m,
                                     causal=causal, timeline=(c == timeline_chip and m == "equal"),
                                     chunk_visits=per_head, **shape,
                                     dq_chunks=d.info["blocks"].get("dq_chunks") or 1,
                                     cases=d.info["blocks"].get(f"{role}_cases", ()),
                                     window=window))
    if bar is not None:
        bar.close()
    for r in rows:                                   # ratio to splash, same chip/kernel/mode
        key = lambda x: (x["chip"], x["kernel"], x["blocks"],  # noqa: E731
                         (x.get("block_q"), x.get("block_k")) if x["blocks"] == "sweep" else 0)
        ref = [x for x in rows if x.get("library") in ("splash", "splash_fused")
               and "error" not in x
               and "error" not in r and key(x) == key(r)]
        r["ratio_splash"] = (r["est_cycles"] / ref[0]["est_cycles"]
                             if ref and "error" not in r else None)
    return rows, versions


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10)
        # "+dirty": code changed since the commit; the stored runs under flashlab/data are
        # what --update rewrites between the commands of one measuring session, not code
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)flashlab/data"],
                               capture_output=True, text=True,
                               cwd=Path(__file__).parent.parent.parent, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def report_run(a, argv, subcommand: str, rows, versions, *, header, table) -> dict:
    """The tail every static bench shares: record the run (its command line and commit),
    print ``header`` and ``table``, and write ``--json``. Returns the recorded ``args``."""
    args = dict(vars(a), commit=_commit(), command=f"python -m flashlab bench {subcommand} "
                + " ".join(sys.argv[1:] if argv is None else argv))
    print(header(versions, args))
    print()
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(versions=versions, args=args, rows=rows),
                                           indent=1) + "\n")
        print(f"\nwrote {a.json}")
    return args


def _positive(name):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected a positive integer, got {text!r}")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name}: expected a positive integer, got {v}")
        return v
    return parse


def parser() -> argparse.ArgumentParser:
    from flashlab.instruments.tpu_compile import CHIPS
    p = argparse.ArgumentParser(
        prog="python -m flashlab bench tpu-static",
        description="flashlab vs splash vs jax's flash kernel on the TPU compiler's static "
                    "schedule (compile-only: needs libtpu, not a TPU). Not wall time.")
    p.add_argument("--chip", nargs="+", default=list(CHIPS), choices=list(CHIPS),
                   help="TPU generations (default: all five)")
    p.add_argument("--library", nargs="+", default=list(LIBRARIES), choices=list(LIBRARIES))
    p.add_argument("--kernel", nargs="+", default=list(MATMULS), choices=list(MATMULS))
    p.add_argument("--blocks", nargs="*", default=["default", "equal"],
                   choices=["default", "equal"],
                   help="each library's default blocks, and/or --block x --block for all; "
                        "none (--blocks alone): only the --sweep pairs")
    p.add_argument("--block", type=_positive("--block"), default=512)
    p.add_argument("--batch", type=_positive("--batch"), default=2)
    p.add_argument("--seq-len", type=_positive("--seq-len"), default=8192)
    p.add_argument("--heads", type=_positive("--heads"), default=16)
    p.add_argument("--head-dim", type=_positive("--head-dim"), default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--window", type=_positive("--window"), metavar="LEFT",
                   help="a sliding window for every library: each query sees the LEFT keys "
                        "before it (and itself; with --no-causal also the LEFT after it); "
                        "jax's kernel has none. Not with --update or --blocks-table (the "
                        "stored runs and default blocks have no window)")
    p.add_argument("--soft-cap", type=float, metavar="CAP",
                   help="cap·tanh(logits / cap) for every library (jax's kernel has none); "
                        "not with --update or --blocks-table")
    p.add_argument("--timeout", type=_positive("--timeout"), default=1800,
                   help="seconds per compile (default 1800: a loaded 2-core machine needs it)")
    p.add_argument("--sweep", nargs="+", metavar="BQxBK", default=[],
                   help="also each of these (block_q x block_k) pairs, e.g. 512x1024, for "
                        "every library (rows with blocks 'sweep')")
    p.add_argument("--json", metavar="PATH", help="write the rows and header as JSON")
    p.add_argument("--blocks-table", metavar="PATH",
                   help="store flashlab's fastest forward blocks, and its fastest backward "
                        "blocks (dQ + dK/dV), of this run per (chip, shape class) in PATH "
                        "(flashlab/data/tpu_blocks.json: the default blocks)")
    p.add_argument("--update", metavar="PATH",
                   help="replace the rows of the stored run PATH with the same (chip, library, "
                        "kernel, blocks) by this run's, recording command and commit per row")
    p.add_argument("--plot", metavar="PATH", help="save a figure of the estimates (png/svg)")
    p.add_argument("--timeline-chip", choices=list(CHIPS),
                   help="also store each equal-block tile's per-cycle unit use for this chip")
    p.add_argument("--jobs", type=_positive("--jobs"), default=1,
                   help="compiles at once (each a child process of ~1-3 GB RAM)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.block % 128:
        p.error(f"--block: expected a multiple of 128 (the lane width), got {a.block}")
    if "equal" in a.blocks and a.seq_len % a.block:
        p.error(f"--seq-len: expected a multiple of --block {a.block}, got {a.seq_len}")
    if a.seq_len % 128:
        p.error(f"--seq-len: expected a multiple of 128 (the official kernels' minimum "
                f"block), got {a.seq_len}")
    sweep = []
    for text in a.sweep:
        parts = text.lower().split("x")
        if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"--sweep: expected BQxBK like 512x1024, got {text!r}")
        bq, bk = map(int, parts)
        if bk % 128 or bq % 8:
            p.error(f"--sweep: block_k must be a multiple of 128 and block_q of 8, got {text!r}")
        if a.seq_len % bq or a.seq_len % bk:
            p.error(f"--sweep: --seq-len {a.seq_len} is not a multiple of {text!r}")
        sweep.append((bq, bk))
    if a.soft_cap is not None and not (a.soft_cap > 0 and math.isfinite(a.soft_cap)):
        p.error(f"--soft-cap: expected a positive finite number, got {a.soft_cap}")
    for name, v in (("--window", a.window), ("--soft-cap", a.soft_cap)):
        if v is not None and (a.update or a.blocks_table):
            p.error(f"{name} {v}: not with --update or --blocks-table (the stored runs and "
                    "the default blocks are measured without one)")
    if not a.blocks and not sweep:
        p.error("--blocks: none given and no --sweep pairs: nothing to measure")
    from flashlab.instruments import tpu_compile
    if not tpu_compile.available():
        p.error(f"libtpu (the TPU compiler) is not installed: {tpu_compile.INSTALL}")
    rows, versions = measure(
        chips=a.chip, libraries=a.library, modes=a.blocks, block=a.block, batch=a.batch,
        seq_len=a.seq_len, heads=a.heads, head_dim=a.head_dim, dtype=a.dtype, causal=a.causal,
        kernels=a.kernel, timeline_chip=a.timeline_chip, timeout=a.timeout,
        progress=not a.no_progress, jobs_in_parallel=a.jobs, sweep=sweep,
        window=window_of(a.window, a.causal), soft_cap=a.soft_cap)
    args = report_run(a, argv, "tpu-static", rows, versions, header=header, table=table)
    if a.update:
        update_rows(a.update, rows, versions=versions, command=args["command"],
                    commit=args["commit"])
        print(f"updated {len(rows)} rows of {a.update}")
    if a.blocks_table:
        from flashlab.kernels import tuned_blocks
        entries = tuned_blocks.entries_from_rows(rows, dtype=a.dtype, command=args["command"],
                                                 commit=args["commit"], versions=versions)
        tuned_blocks.write(a.blocks_table, entries)
        for e in entries:
            print(f"{a.blocks_table}: {e['kernel']} {e['chip']} causal={e['causal']} "
                  f"d={e['head_dim']} "
                  f"T in [{e['seq_min']}, {e['seq_max']}]: {e['block_q']}x{e['block_k']}")
    if a.plot:
        from flashlab.viz.tpu_schedule import static_estimates_figure
        fig = static_estimates_figure(rows, versions=versions)
        fig.savefig(a.plot, bbox_inches="tight", dpi=120)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
