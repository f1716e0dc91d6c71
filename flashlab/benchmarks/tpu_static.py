"""``python -m flashlab bench tpu-static``: flashlab, splash and jax's flash kernel, side by
side on the TPU compiler's own static schedule, for every TPU generation, without a TPU.

For each chip, library and block setting it compiles the forward (inference) and the
gradient (``jax.grad``: the dQ and dK/dV kernels) with libtpu's schedule dumps on
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
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

from flashlab.instruments import tpu_dump

__all__ = ["build", "measure", "chip_clock", "main", "LIBRARIES", "MATMULS", "header", "table",
           "stored", "STORED", "training_step_table"]

# One run of this bench, committed for the book (chapters 05, 07, 09): its header says which
# jax, libtpu and flashlab commit produced it. Regenerate with the command in its "args".
STORED = Path(__file__).resolve().parent.parent / "data" / "tpu_static.json"

LIBRARIES = ("flashlab", "splash", "jax_pallas_flash")
MATMULS = {"forward": 2, "dq": 3, "dkdv": 4}     # matmuls of one tile, per kernel
ROLE_LABEL = {"forward": "forward", "dq": "dQ", "dkdv": "dK/dV"}
TIMELINE_UNITS = ("MXU", "XLU", "VALU", "VPOP", "EUP", "VLOAD", "VSTORE", "SALU")


def _flashlab(chip, backward, causal, block, shape, dtype):
    import jax
    from flashlab.contract import masks
    from flashlab.kernels import backward as bw, blocks, forward as fw
    B, T, H, d = shape
    x = jax.ShapeDtypeStruct((B, T, H, d), dtype)
    fb = (block, block) if block else blocks.choose_block_sizes(T, T, d, dtype, chip)
    got = {}

    def probe(q, k, v):                      # the backward's blocks as the kernel resolves them
        q, k, v, spec = masks.validate(q, k, v, None, None, is_causal=causal)
        c = bw.make_backward_config(spec, block_q=block, block_k=block, chip=chip)
        got["bwd"] = [c.block_q, c.block_k]
        return q
    jax.eval_shape(probe, x, x, x)

    def f(q, k, v):
        return fw.flash_attention(q, k, v, is_causal=causal, block_q=fb[0], block_k=fb[1],
                                  interpret=False, chip=chip)
    info = {"forward": list(fb), "dq": got["bwd"], "dkdv": got["bwd"]}
    return f, (x, x, x), info


def _splash(chip, backward, causal, block, shape, dtype):
    import jax
    from flashlab.compat.pallas import official_splash_attention
    sa = official_splash_attention()
    B, T, H, d = shape
    x = jax.ShapeDtypeStruct((B, H, T, d), dtype)
    one = sa.CausalMask((T, T)) if causal else sa.FullMask((T, T))
    bs = sa.BlockSizes.get_default() if not block else sa.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = sa.make_splash_mha(sa.MultiHeadMask([one] * H), block_sizes=bs, head_shards=1,
                                q_seq_shards=1)
    info = {"forward": [bs.block_q, bs.block_kv], "dq": [bs.block_q_dq, bs.block_kv_dq],
            "dkdv": [bs.block_q_dkv, bs.block_kv_dkv]}
    return jax.vmap(kernel), (x, x, x), info


def _jax_flash(chip, backward, causal, block, shape, dtype):
    import jax
    from flashlab.compat.pallas import official_flash_attention
    fa = official_flash_attention()
    B, T, H, d = shape
    x = jax.ShapeDtypeStruct((B, H, T, d), dtype)
    b = block
    bs = fa.BlockSizes.get_default(B, H, T, T, d) if not b else fa.BlockSizes(
        block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b,
        block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b,
        block_q_dq=b)

    def f(q, k, v):
        return fa.flash_attention(q, k, v, causal=causal, sm_scale=d ** -0.5, block_sizes=bs)
    info = {"forward": [bs.block_q, bs.block_k_major], "dq": [bs.block_q_dq, bs.block_k_major_dq],
            "dkdv": [bs.block_q_major_dkv, bs.block_k_major_dkv]}
    return f, (x, x, x), info


_BUILDERS = {"flashlab": _flashlab, "splash": _splash, "jax_pallas_flash": _jax_flash}


def build(*, chip: str, library: str, backward: bool, batch: int, seq_len: int, heads: int,
          head_dim: int, dtype: str, causal: bool, block: int | None):
    """``(fn, args, info)`` for :func:`flashlab.instruments.tpu_dump.schedules` (runs in its
    child).

    ``fn`` is the library's forward on ``[batch, seq, heads, head_dim]`` (flashlab) or
    ``[batch, heads, seq, head_dim]`` (the official kernels), or ``jax.grad`` of its sum
    w.r.t. q, k, v when ``backward``; ``block``: ``None`` for the library's default blocks,
    else ``block x block`` everywhere. ``info["blocks"]``: (block_q, block_k) per kernel.
    """
    import jax
    import jax.numpy as jnp
    f, args, blocks = _BUILDERS[library](chip, backward, causal, block,
                                         (batch, seq_len, heads, head_dim), jnp.dtype(dtype))
    if backward:
        g = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        return g, args, {"blocks": blocks}
    return f, args, {"blocks": blocks}


def chip_clock(chip: str) -> tuple[float | None, float | None, str]:
    """``(clock Hz, bf16 FLOP/s per TensorCore, source)`` of a TPU generation.

    Neither JAX nor :mod:`flashlab.instruments.roofline` lists clocks, so the clock is derived from
    JAX's per-core table: ``bf16_ops_per_second / (num_mxus x mxu_column_size**2 x 2)``. That gives
    the public clocks of v4 (1.05 GHz), v5e (1.5) and v5p (1.75); for v6e and 7x it gives 3.5
    and 4.4 GHz, which says JAX's per-core MXU count (2) and the compiler's (2) describe a
    wider machine than the clock alone: their ms are less certain than their cycles.
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


def _visible_tiles(T, bq, bk, causal) -> int:
    from flashlab.kernels import blocks
    return blocks.num_visible_blocks(-(-T // bq), -(-T // bk), q_len=T, kv_len=T, block_q=bq,
                                     block_k=bk, is_causal=causal)


def _row(k: tpu_dump.KernelDump, blocks, *, chip, library, mode, batch, seq_len, heads,
         head_dim, causal, timeline) -> dict:
    from flashlab.benchmarks.backends import attention_flops
    from flashlab.instruments import tpu_schedule
    s = k.schedule
    bq, bk = blocks
    steps = math.prod(k.grid)
    rows = math.prod(k.grid[:-1])
    tiles = batch * heads * _visible_tiles(seq_len, bq, bk, causal)
    cycles = tpu_schedule.kernel_cycles(s, steps=steps, tiles=tiles, rows=rows)
    hz, peak, _ = chip_clock(chip)
    flops = attention_flops(batch, heads, seq_len, seq_len, head_dim, causal) * MATMULS[k.role] / 2
    r = dict(chip=chip, library=library, kernel=k.role, blocks=mode, block_q=bq, block_k=bk,
             name=k.name, grid=list(k.grid), tile_cycles=s.tile_cycles,
             step_cycles=s.step_cycles, init_cycles=s.init_cycles,
             finalize_cycles=s.finalize_cycles, outside_loop_cycles=s.outside_loop_cycles,
             mxu_cycles=s.mxu_cycles, occupancy=s.occupancy, num_mxu=s.num_mxu, steps=steps,
             tiles=tiles, rows=rows, est_cycles=cycles, flops=flops,
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
            jobs_in_parallel=1):
    """Compile and read every (chip, library, block mode); returns ``(rows, versions)``.

    ``jobs_in_parallel``: compiles at once (each a child process of ~1-3 GB)."""
    jobs = [(c, lib, m, bwd) for c in chips for lib in libraries for m in modes
            for bwd in (False, True) if (bwd and {"dq", "dkdv"} & set(kernels))
            or (not bwd and "forward" in kernels)]
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

    def one(job):
        c, lib, m, bwd = job
        try:
            return tpu_dump.schedules("flashlab.benchmarks.tpu_static:build", c, timeout=timeout,
                                      library=lib, backward=bwd, dtype=dtype, causal=causal,
                                      block=None if m == "default" else block, **shape)
        except Exception as e:  # noqa: BLE001 - a rejected compile is a result; see below
            from flashlab.instruments import tpu_compile
            if not isinstance(e, (tpu_compile.CompileError, TimeoutError)):
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
        if isinstance(d, Exception):
            e = d
            for role in (("dq", "dkdv") if bwd else ("forward",)):
                if role in kernels:
                    rows.append(dict(chip=c, library=lib, kernel=role, blocks=m,
                                     error=" ".join(str(e).split())[:300]))
        else:
            versions = dict(jax=d.jax_version, libtpu=d.libtpu_version)
            for role, k in d.kernels.items():
                if role in kernels and (role == "forward") != bwd:
                    rows.append(_row(k, d.info["blocks"][role], chip=c, library=lib, mode=m,
                                     causal=causal, timeline=(c == timeline_chip and m == "equal"),
                                     **shape))
    if bar is not None:
        bar.close()
    for r in rows:                                   # ratio to splash, same chip/kernel/mode
        ref = [x for x in rows if x.get("library") == "splash" and "error" not in x
               and (x["chip"], x["kernel"], x["blocks"]) == (r["chip"], r["kernel"], r["blocks"])]
        r["ratio_splash"] = (r["est_cycles"] / ref[0]["est_cycles"]
                             if ref and "error" not in r else None)
    return rows, versions


def stored(path=None) -> dict:
    """The committed run (:data:`STORED`): ``{"versions", "args", "rows"}``."""
    p = Path(path or STORED)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no stored tpu-static run; make one with "
                                f"python -m flashlab bench tpu-static --json {p}")
    return json.loads(p.read_text())


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent,
                               timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def header(versions: dict, args: dict) -> str:
    """What the figures are and are not, with the versions, shape and commit."""
    return "\n".join([
        "Static schedule of the real TPU compiler (libtpu's packed bundles, 1 bundle = 1 cycle),",
        f"jax {versions.get('jax')}, libtpu {versions.get('libtpu')}, flashlab commit "
        f"{args.get('commit')}.",
        f"Shape: B={args['batch']} T={args['seq_len']} H={args['heads']} d={args['head_dim']} "
        f"{args['dtype']} {'causal' if args['causal'] else 'non-causal'}; blocks: each "
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
    for r in rows:
        left = (f"{r['chip']:4} {ROLE_LABEL[r['kernel']]:6} {r['blocks']:7} "
                f"{r['library']:17}")
        if "error" in r:
            out.append(f"{left} FAILED: {r['error']}")
            continue
        ms = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        rs = "-" if r["ratio_splash"] is None else f"{r['ratio_splash']:.2f}"
        rf = "-" if r["ratio_floor"] is None else f"{r['ratio_floor']:.2f}"
        out.append(f"{left} {str(r['block_q']) + 'x' + str(r['block_k']):>9} "
                   f"{r['tile_cycles']:6d} {r['step_cycles']:5d} {r['occupancy']:5.0%} "
                   f"{ms(r['est_ms']):>8} {ms(r['floor_ms']):>6} {rf:>7} {rs:>8}")
    return "\n".join(out)


def training_step_table(rows, *, blocks="equal") -> str:
    """Forward + dQ + dK/dV whole-kernel estimates per chip and library (one training step's
    attention), with the ratio to splash: what ``auto``'s order on a TPU should follow."""
    out = [f"{'chip':4} {'library':17} {'fwd+bwd est ms':>14} {'x floor':>7} {'x splash':>8}"]
    by = {}
    for r in rows:
        if r.get("blocks") == blocks and "error" not in r and r.get("est_ms") is not None:
            t = by.setdefault((r["chip"], r["library"]), [0.0, 0.0, set()])
            t[0] += r["est_ms"]
            t[1] += r["floor_ms"]
            t[2].add(r["kernel"])
    for (chip, lib), (est, floor, ks) in by.items():
        if ks != set(MATMULS):
            continue
        ref = by.get((chip, "splash"))
        rs = f"{est / ref[0]:.2f}" if ref and ref[2] == set(MATMULS) else "-"
        out.append(f"{chip:4} {lib:17} {est:14.2f} {est / floor:7.2f} {rs:>8}")
    return "\n".join(out)


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
    p.add_argument("--blocks", nargs="+", default=["default", "equal"],
                   choices=["default", "equal"],
                   help="each library's default blocks, and/or --block x --block for all")
    p.add_argument("--block", type=_positive("--block"), default=512)
    p.add_argument("--batch", type=_positive("--batch"), default=2)
    p.add_argument("--seq-len", type=_positive("--seq-len"), default=8192)
    p.add_argument("--heads", type=_positive("--heads"), default=16)
    p.add_argument("--head-dim", type=_positive("--head-dim"), default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=_positive("--timeout"), default=1800,
                   help="seconds per compile (default 1800: a loaded 2-core machine needs it)")
    p.add_argument("--json", metavar="PATH", help="write the rows and header as JSON")
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
    from flashlab.instruments import tpu_compile
    if not tpu_compile.available():
        p.error(f"libtpu (the TPU compiler) is not installed: {tpu_compile.INSTALL}")
    rows, versions = measure(
        chips=a.chip, libraries=a.library, modes=a.blocks, block=a.block, batch=a.batch,
        seq_len=a.seq_len, heads=a.heads, head_dim=a.head_dim, dtype=a.dtype, causal=a.causal,
        kernels=a.kernel, timeline_chip=a.timeline_chip, timeout=a.timeout,
        progress=not a.no_progress, jobs_in_parallel=a.jobs)
    args = dict(vars(a), commit=_commit(), command="python -m flashlab bench tpu-static "
                + " ".join(sys.argv[1:] if argv is None else argv))
    print(header(versions, args))
    print()
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(versions=versions, args=args, rows=rows),
                                           indent=1) + "\n")
        print(f"\nwrote {a.json}")
    if a.plot:
        from flashlab.viz.tpu_schedule import static_estimates_figure
        fig = static_estimates_figure(rows, versions=versions)
        fig.savefig(a.plot, bbox_inches="tight", dpi=120)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
