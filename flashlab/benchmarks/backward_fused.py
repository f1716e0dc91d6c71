"""``python -m flashlab.benchmarks.backward_fused``: the fused backward against the split one, on
the TPU compiler's static schedule (compile-only: needs libtpu, not a TPU).

The split backward runs two kernels, dK/dV and dQ, each recomputing S and dP: seven matmuls
per tile. The fused one (:func:`flashlab.kernels.backward_grid.dkdv_grid_spec` with
``fused=True``) runs one kernel with five, adding each tile's dQ into a float32 ``[G, T, d]``
block that stays resident in VMEM for a whole (batch, kv head). For each chip this compiles
both (forward + backward, bf16) at the blocks each resolves to
(:func:`flashlab.kernels.backward_grid.make_backward_config`), reads every kernel's schedule
(:mod:`flashlab.instruments.tpu_dump`) and estimates the whole backward as
:func:`flashlab.instruments.tpu_schedule.kernel_cycles` does for ``bench tpu-static``.

What the static schedule leaves out is HBM traffic; here both options move the same operands
(the fused kernel writes dQ once per (batch, kv head), as the dQ kernel does), and the fused
one holds ``resident_dq_bytes`` of VMEM for its dQ (printed), which is what bounds the
sequence length it runs at.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from flashlab.instruments import tpu_dump, tpu_schedule
from flashlab.benchmarks.tpu_static import (_commit, _visible_tiles, chip_clock, init_runs,
                                            resident_zeroing)

__all__ = ["build", "measure", "main"]


def build(*, chip: str, fused: bool, batch: int, seq_len: int, heads: int, head_dim: int,
          causal: bool, block: int):
    """``(fn, args)`` for :func:`flashlab.instruments.tpu_dump.schedules`: forward with lse, then the
    backward kernels (``fused`` or split), on bf16 ``[batch, seq_len, heads, head_dim]``."""
    import jax
    import jax.numpy as jnp
    from flashlab.contract import masks
    from flashlab.kernels import backward as bw, forward as fw
    x = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.bfloat16)

    def f(q, k, v, do):
        q, k, v, spec = masks.validate(q, k, v, None, None, is_causal=causal)
        bq, bk = (block, block) if isinstance(block, int) else block
        kw = dict(block_q=bq, block_k=bk, interpret=False, chip=chip)
        out, lse = fw.flash_attention_forward(q, k, v, spec, **kw)
        return bw.flash_attention_backward(q, k, v, spec, out, lse, do, fused=fused, **kw)[:3]
    return f, (x, x, x, x)


def _resolved(chip, fused, *, batch, seq_len, heads, head_dim, causal, block):
    """``(block_q, block_k, dq_chunks, cases)`` of the backward ``block`` resolves to (a
    fused backward whose resident dQ does not fit at ``block`` chunks it or takes smaller
    blocks, or raises ``ValueError``; ``cases``: per (batch, head), the tiles the causal
    diagonal crosses at each of its offsets, :func:`diagonal.visits`)."""
    import jax
    import jax.numpy as jnp
    from flashlab.contract import masks
    from flashlab.kernels import backward_grid, diagonal
    x = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.bfloat16)
    spec = jax.eval_shape(lambda q, k, v: masks.validate(q, k, v, None, None,
                                                         is_causal=causal)[3], x, x, x)
    bq, bk = (block, block) if isinstance(block, int) else block
    c, n = backward_grid.resolve_backward(spec, "fused" if fused else "split", block_q=bq,
                                          block_k=bk, chip=chip)
    return c.block_q, c.block_k, n, diagonal.visits(c) if n else ()


def measure(*, chips, batch=2, seq_len=8192, heads=16, head_dim=128, causal=True, block=512,
            timeout=3000) -> tuple[list[dict], dict]:
    """Rows ``{chip, option, kernels: {name: {tile, step, ...}}, est_cycles, ...}``."""
    shape = dict(batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim)
    rows, versions = [], {}
    for chip in chips:
        for fused in (False, True):
            bq, bk, chunks, cases = _resolved(chip, fused, causal=causal, block=block,
                                              **shape)
            cases = [batch * heads * x for x in cases]
            tiles = batch * heads * _visible_tiles(seq_len, bq, bk, causal)
            d = tpu_dump.schedules("flashlab.benchmarks.backward_fused:build", chip, timeout=timeout,
                                   fused=fused, causal=causal, block=block, **shape)
            versions = dict(jax=d.jax_version, libtpu=d.libtpu_version)
            kernels, est = {}, 0
            for role, k in d.kernels.items():
                if role == "forward":
                    continue
                s = k.schedule
                role = "fused" if fused else k.role
                zero = (resident_zeroing(s, seq_len=seq_len, block_q=bq, head_dim=head_dim,
                                         dq_chunks=chunks) if fused else 0)
                c = tpu_schedule.kernel_cycles(s, steps=math.prod(k.grid), tiles=tiles,
                                               rows=init_runs("flashlab", role, k.grid,
                                                              batch=batch, heads=heads,
                                                              seq_len=seq_len, block_q=bq,
                                                              block_k=bk, dq_chunks=chunks),
                                               cases=cases if fused else (),
                                               once=batch * heads * chunks if zero else 0,
                                               once_cycles=zero)
                kernels[k.name] = dict(grid=list(k.grid), tile_cycles=s.tile_cycles,
                                       step_cycles=s.step_cycles, init_cycles=s.init_cycles,
                                       finalize_cycles=s.finalize_cycles,
                                       occupancy=s.occupancy, xlu_ops=s.op_mix["XLU"],
                                       est_cycles=c)
                est += c
            hz = chip_clock(chip)[0]
            t_pad = -(-seq_len // bq) * bq
            rows.append(dict(chip=chip, option="fused" if fused else "split", kernels=kernels,
                             block_q=bq, block_k=bk,
                             est_cycles=est, est_ms=est / hz * 1e3 if hz else None,
                             dq_chunks=chunks, diagonal_tiles=cases,
                             resident_dq_bytes=t_pad * head_dim * 4 // chunks if chunks else 0))
    for r in rows:
        split = [x for x in rows if x["chip"] == r["chip"] and x["option"] == "split"][0]
        r["ratio_split"] = r["est_cycles"] / split["est_cycles"]
    return rows, versions


def _block(text: str):
    """argparse type: ``512`` or ``1024x512``."""
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--block: expected B or BQxBK, e.g. 512 or 1024x512, "
                                         f"got {text!r}")
    return int(parts[0]) if len(parts) == 1 else (int(parts[0]), int(parts[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashlab.benchmarks.backward_fused",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--chip", nargs="+", default=["v5e", "v6e"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block", type=_block, default=512, metavar="B|BQxBK",
                   help="the backward's blocks asked for: B x B, or BQ x BK (default 512)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", help="write {versions, args, rows} here")
    a = p.parse_args(argv)
    rows, versions = measure(chips=a.chip, batch=a.batch, seq_len=a.seq_len, heads=a.heads,
                             head_dim=a.head_dim, causal=a.causal, block=a.block)
    print(f"Static schedule (no DMA waits, no HBM bandwidth), jax {versions.get('jax')}, "
          f"libtpu {versions.get('libtpu')}, commit {_commit()}; B={a.batch} T={a.seq_len} "
          f"H={a.heads} d={a.head_dim} bf16 {'causal' if a.causal else 'non-causal'}, "
          f"{'x'.join(map(str, a.block)) if isinstance(a.block, tuple) else a.block} asked")
    for r in rows:
        tiles = ", ".join(f"{n.split('.')[0].replace('flashlab_flash_backward_', '')} "
                          f"tile {k['tile_cycles']} step {k['step_cycles']}"
                          for n, k in sorted(r["kernels"].items()))
        print(f"{r['chip']:4s} {r['option']:5s} {r['block_q']}x{r['block_k']} est "
              f"{r['est_cycles']:>11,} cycles ({r['ratio_split']:.2f}x split); {tiles}; "
              f"resident dQ {r['resident_dq_bytes'] / 2**20:.1f} MiB VMEM")
    if a.json:
        args = dict(vars(a), commit=_commit(),
                    command="python -m flashlab.benchmarks.backward_fused " + " ".join(
                        argv if argv is not None else sys.argv[1:]))
        with open(a.json, "w") as f:
            json.dump(dict(versions=versions, args=args, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
