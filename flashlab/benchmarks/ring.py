"""``python -m flashlab bench ring``: ring attention's per-device memory and time per step.

Two questions, on simulated CPU devices (``--xla_force_host_platform_device_count``):

* **Memory.** Grow the global length with the device count (``N = c·P`` for a fixed ``c``
  tokens per device) and read XLA's own accounting (``compiled.memory_analysis()``) of the
  forward+backward program *per device*: it should stay flat, while one device running the
  whole sequence grows with ``N``.
* **Time per step, measured vs modelled.** The measured ring time divided by ``P`` steps,
  against a model built from two measurements on this machine, the way
  :mod:`flashlab.instruments.comm_model` builds it for TPUs: one block's compute time (the backend
  alone on one ``c × c`` block) and one hop's transfer time (a lone ``ppermute`` of one K/V block).
  With the send overlapped, a step costs ``max(compute, transfer)``; without, their sum.

The device count must be set before JAX starts, so each configuration runs in a fresh child
process (``--child``) that prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main", "run_child", "markdown"]


def _parser():
    p = argparse.ArgumentParser(prog="python -m flashlab bench ring", description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tokens-per-device", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--backend", default="tiled")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--memory-only", action="store_true", help="compile only: no timings")
    p.add_argument("--json", metavar="PATH", help="also write the rows, command and commit")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return p


def run_child(a) -> dict:
    """One configuration in this (fresh) process: memory of the ring and of one device."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from flashlab.instruments import comm_model
    from flashlab.scale.ring import block_functions, ring_attention
    from flashlab.contract.masks import validate
    from flashlab.instruments.measure import compiled_memory_bytes, time_fn
    from flashlab.compat.shard_map import shard_map

    P, c = a.child, a.tokens_per_device
    N, H, K, d = c * P, a.heads, a.kv_heads, a.head_dim
    mesh = jax.make_mesh((P,), ("sp",))
    rng = np.random.default_rng(0)
    # Inputs sharded along the sequence, as a training step holds them: device i has N/P tokens.
    seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sp"))
    put = lambda n: jax.device_put(jnp.asarray(rng.standard_normal((1, N, n, d)), jnp.float32), seq)  # noqa: E731
    q, k, v = put(H), put(K), put(K)

    def train(q, k, v):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(ring_attention(
            q, k, v, mesh=mesh, axis_name="sp", backend=a.backend, is_causal=True) ** 2),
            argnums=(0, 1, 2))(q, k, v)

    ring_mem = compiled_memory_bytes(train, q, k, v)            # per device (SPMD program)
    if a.memory_only:
        return {"P": P, "N": N, "c": c, "ring_peak": ring_mem["peak"],
                "ring_temp": ring_mem["temporaries"], "ring_args": ring_mem["arguments"],
                "one_device_peak": _one_device_peak(a, N, H, K, d) if P > 1 else ring_mem["peak"]}
    fwd = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="sp",
                                                 backend=a.backend, is_causal=True))
    t_ring = time_fn(fwd, q, k, v, repeats=a.repeats)
    # The model's two inputs, measured here: one block's compute, one hop's transfer.
    blk_fwd, _ = block_functions(a.backend)
    qc, kc, vc = q[:, :c // 2], k[:, :c // 2], v[:, :c // 2]    # zig-zag: 4 half-blocks a step
    _, _, _, spec = validate(qc, kc, vc)
    t_block = 4 * time_fn(jax.jit(lambda q, k, v: blk_fwd(q, k, v, spec)), qc, kc, vc,
                          repeats=a.repeats)
    t_hop = 0.0
    if P > 1:
        hop = jax.jit(shard_map(lambda x: jax.lax.ppermute(
            x, "sp", [(j, (j + 1) % P) for j in range(P)]), mesh=mesh,
            in_specs=jax.sharding.PartitionSpec("sp"), out_specs=jax.sharding.PartitionSpec("sp")))
        kv = jax.device_put(jnp.zeros((P, 2, c, K, d), jnp.float32),   # one K, one V block each
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("sp")))
        t_hop = time_fn(hop, kv, repeats=a.repeats)
    step_bytes = comm_model.ring_step_bytes(batch=1, tokens_per_device=c, kv_heads=K,
                                            head_dim=d, bytes_per_element=4)
    return {"P": P, "N": N, "c": c, "ring_peak": ring_mem["peak"],
            "ring_temp": ring_mem["temporaries"], "step_s": t_ring / P, "block_s": t_block,
            "hop_s": t_hop, "step_bytes": step_bytes,
            "one_device_peak": _one_device_peak(a, N, H, K, d) if P > 1 else ring_mem["peak"]}


def _one_device_peak(a, N, H, K, d) -> int:
    """Per-device bytes of the same training step on ONE device holding the whole sequence."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from flashlab.dispatch.api import attention
    from flashlab.instruments.measure import compiled_memory_bytes
    sds = lambda n: jax.ShapeDtypeStruct((1, N, n, d), jnp.float32)  # noqa: E731

    def train(q, k, v):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(attention(
            q, k, v, backend=a.backend, is_causal=True) ** 2), argnums=(0, 1, 2))(q, k, v)
    return compiled_memory_bytes(train, sds(H), sds(K), sds(K))["peak"]


def markdown(rows) -> str:
    """The table the chapter stores: memory per device and time per step, measured vs model."""
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    if "step_s" not in rows[0]:
        out = ["| devices P | global N | ring MiB/device | of which arguments | temporaries "
               "| 1 device MiB |", "|---|---|---|---|---|---|"]
        out += [f"| {r['P']} | {r['N']} | {mib(r['ring_peak'])} | {mib(r['ring_args'])} "
                f"| {mib(r['ring_temp'])} | {mib(r['one_device_peak'])} |" for r in rows]
        return "\n".join(out)
    out = ["| devices P | global N | ring MiB/device | 1 device MiB | step ms | block ms "
           "| hop ms | model overlapped ms | model serial ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        over, serial = max(r["block_s"], r["hop_s"]), r["block_s"] + r["hop_s"]
        out.append(f"| {r['P']} | {r['N']} | {mib(r['ring_peak'])} | {mib(r['one_device_peak'])} "
                   f"| {r['step_s'] * 1e3:.1f} | {r['block_s'] * 1e3:.1f} | {r['hop_s'] * 1e3:.2f} "
                   f"| {over * 1e3:.1f} | {serial * 1e3:.1f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.child is not None:
        print(json.dumps(run_child(a)))
        return 0
    rows = []
    base = [x for x in (sys.argv[1:] if argv is None else argv) if x]
    if a.json:                                       # children print; the parent writes
        i = base.index("--json")
        base = base[:i] + base[i + 2:]
    for P in a.devices:
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={P}")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "flashlab", "bench", "ring", *base,
                               "--child", str(P)], env=env, capture_output=True, text=True,
                              timeout=a.timeout)
        if proc.returncode:
            print(f"bench ring: P={P} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"P={P} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print(markdown(rows))
    flat = max(r["ring_peak"] for r in rows) / min(r["ring_peak"] for r in rows)
    grow = rows[-1]["one_device_peak"] / rows[0]["one_device_peak"]
    print(f"per-device peak, largest/smallest over P={a.devices}: ring {flat:.2f}x; one device "
          f"holding the whole sequence: {grow:.2f}x")
    if a.json:
        from flashlab.benchmarks.tpu_static import _commit
        import jax  # noqa: PLC0415
        Path(a.json).write_text(json.dumps(dict(
            command="python -m flashlab bench ring " + " ".join(
                sys.argv[1:] if argv is None else argv), commit=_commit(), jax=jax.__version__,
            what="XLA memory_analysis of the compiled forward+backward ring, per device "
                 "(peak = arguments + outputs + temporaries), on simulated CPU devices; "
                 "N = tokens_per_device x P", rows=rows), indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0
