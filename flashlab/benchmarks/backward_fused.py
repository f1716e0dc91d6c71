"""``python -m flashlab.benchmarks.backward_fused``: the fused backward option against the split one,
on the TPU compiler's static schedule (compile-only: needs libtpu, not a TPU).

The split backward (the default) runs two kernels, dK/dV and dQ, each recomputing S and dP:
seven matmuls per tile. The fused option (:func:`flashlab.kernels.backward_grid.dkdv_grid_spec`
with ``fused=True``) runs one kernel with five, writing a float32 partial dQ per kv block that
XLA sums after. For each chip this compiles both (forward + backward, bf16), reads every
kernel's schedule (:mod:`flashlab.instruments.tpu_dump`) and estimates the whole backward as
:func:`flashlab.instruments.tpu_schedule.kernel_cycles` does for ``bench tpu-static``.

What the static schedule leaves out, and why it matters here: HBM traffic. The fused option
writes ``T_c`` float32 copies of dQ and XLA reads them back to sum them
(``dq_partial_bytes``, printed); the split option moves none of that. Compare that figure with
the chip's HBM bandwidth before trusting the cycle ratio.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from flashlab.instruments import tpu_dump, tpu_schedule
from flashlab.benchmarks.tpu_static import _commit, _visible_tiles, chip_clock, init_runs

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
        kw = dict(block_q=block, block_k=block, interpret=False, chip=chip)
        out, lse = fw.flash_attention_forward(q, k, v, spec, **kw)
        return bw.flash_attention_backward(q, k, v, spec, out, lse, do, fused=fused, **kw)[:3]
    return f, (x, x, x, x)


def measure(*, chips, batch=2, seq_len=8192, heads=16, head_dim=128, causal=True, block=512,
            timeout=3000) -> tuple[list[dict], dict]:
    """Rows ``{chip, option, kernels: {name: {tile, step, ...}}, est_cycles, ...}``."""
    shape = dict(batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim)
    tiles = batch * heads * _visible_tiles(seq_len, block, block, causal)
    rows, versions = [], {}
    for chip in chips:
        for fused in (False, True):
            d = tpu_dump.schedules("flashlab.benchmarks.backward_fused:build", chip, timeout=timeout,
                                   fused=fused, causal=causal, block=block, **shape)
            versions = dict(jax=d.jax_version, libtpu=d.libtpu_version)
            kernels, est = {}, 0
            for role, k in d.kernels.items():
                if role == "forward":
                    continue
                s = k.schedule
                c = tpu_schedule.kernel_cycles(s, steps=math.prod(k.grid), tiles=tiles,
                                               rows=init_runs("flashlab", k.role, k.grid,
                                                              batch=batch, heads=heads,
                                                              seq_len=seq_len, block_q=block,
                                                              block_k=block))
                kernels[k.name] = dict(grid=list(k.grid), tile_cycles=s.tile_cycles,
                                       step_cycles=s.step_cycles, init_cycles=s.init_cycles,
                                       finalize_cycles=s.finalize_cycles,
                                       occupancy=s.occupancy, xlu_ops=s.op_mix["XLU"],
                                       est_cycles=c)
                est += c
            hz = chip_clock(chip)[0]
            t_c = -(-seq_len // block)
            rows.append(dict(chip=chip, option="fused" if fused else "split", kernels=kernels,
                             est_cycles=est, est_ms=est / hz * 1e3 if hz else None,
                             dq_partial_bytes=(2 * batch * heads * t_c * seq_len * head_dim * 4
                                               if fused else 0)))
    for r in rows:
        split = [x for x in rows if x["chip"] == r["chip"] and x["option"] == "split"][0]
        r["ratio_split"] = r["est_cycles"] / split["est_cycles"]
    return rows, versions


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashlab.benchmarks.backward_fused",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--chip", nargs="+", default=["v5e", "v6e"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", help="write {versions, args, rows} here")
    a = p.parse_args(argv)
    rows, versions = measure(chips=a.chip, batch=a.batch, seq_len=a.seq_len, heads=a.heads,
                             head_dim=a.head_dim, causal=a.causal, block=a.block)
    print(f"Static schedule (no DMA waits, no HBM bandwidth), jax {versions.get('jax')}, "
          f"libtpu {versions.get('libtpu')}, commit {_commit()}; B={a.batch} T={a.seq_len} "
          f"H={a.heads} d={a.head_dim} bf16 {'causal' if a.causal else 'non-causal'}, "
          f"{a.block}x{a.block}")
    for r in rows:
        tiles = ", ".join(f"{n.split('.')[0].replace('flashlab_flash_backward_', '')} "
                          f"tile {k['tile_cycles']} step {k['step_cycles']}"
                          for n, k in sorted(r["kernels"].items()))
        print(f"{r['chip']:4s} {r['option']:5s} est {r['est_cycles']:>11,} cycles "
              f"({r['ratio_split']:.2f}x split); {tiles}; dQ partials "
              f"{r['dq_partial_bytes'] / 2**30:.2f} GiB HBM")
    if a.json:
        args = dict(vars(a), commit=_commit(),
                    command="python -m flashlab.benchmarks.backward_fused " + " ".join(
                        argv if argv is not None else sys.argv[1:]))
        with open(a.json, "w") as f:
            json.dump(dict(versions=versions, args=args, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
